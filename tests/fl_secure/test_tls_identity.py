"""Ed25519 signing identities for secure aggregation: CA-signed registry, tampering refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fl_secure.errors import TlsError
from fl_secure.tls import init_certificates, issue_client_certificate
from fl_secure.tls.identity import (
    REGISTRY_FILE,
    REGISTRY_SIGNATURE,
    load_signing_identity,
    load_signing_key,
    load_signing_registry,
)
from fl_secure.tls.registry import encode_registry, registry_message


def _ca_sign(directory: Path, body: bytes, ca_dir: Path | None = None) -> None:
    """Write ``body`` as the registry with a valid CA signature (what only the CA can do)."""
    key_pem = ((ca_dir or directory) / "ca.key").read_bytes()
    ca_key = serialization.load_pem_private_key(key_pem, None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    (directory / REGISTRY_FILE).write_bytes(body)
    signature = ca_key.sign(registry_message(body), ec.ECDSA(hashes.SHA256()))
    (directory / REGISTRY_SIGNATURE).write_bytes(signature)


def test_registry_holds_every_client_key_and_verifies(tmp_path: Path) -> None:
    # Prepare / Execute
    paths = init_certificates(tmp_path, clients=3)
    registry = load_signing_registry(paths.server_dir)
    # Assert: each client's private key matches its enrolled public key, and signs verifiably
    assert sorted(registry) == ["client-0", "client-1", "client-2"]
    for client_id, public in registry.items():
        key = load_signing_key(paths.site_dir(client_id), client_id)
        assert key.public_key().public_bytes_raw() == public.public_bytes_raw()
        public.verify(key.sign(b"advert"), b"advert")
    key_file = paths.site_dir("client-0") / "clients" / "client-0.sign.key"
    assert key_file.stat().st_mode & 0o077 == 0


def test_a_client_added_later_is_in_the_re_signed_registry(tmp_path: Path) -> None:
    init_certificates(tmp_path, clients=2)
    before = load_signing_registry(tmp_path / "server")
    issue_client_certificate(tmp_path, "late-site")
    after = load_signing_registry(tmp_path / "server")
    assert sorted(after) == ["client-0", "client-1", "late-site"]
    for site in ("client-0", "late-site"):  # every site holds the re-signed registry
        assert sorted(load_signing_registry(tmp_path / "sites" / site)) == sorted(after)
    assert after["client-0"].public_bytes_raw() == before["client-0"].public_bytes_raw()


def test_an_altered_registry_is_refused(tmp_path: Path) -> None:
    # Prepare: swap client-1's key for client-0's (a server substituting keys)
    init_certificates(tmp_path, clients=2)
    server = tmp_path / "server"
    doc = json.loads((server / REGISTRY_FILE).read_text())
    doc["keys"]["client-1"] = doc["keys"]["client-0"]
    (server / REGISTRY_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    # Execute / Assert
    with pytest.raises(TlsError, match="not signed by the CA"):
        load_signing_registry(server)


def test_a_registry_nested_past_the_parsers_limit_is_named(tmp_path: Path) -> None:
    # `certs issue` reads the registry it re-signs: a damaged one is named, not a traceback
    # (signed by the CA, so that the check of its signature lets it through to the parser)
    init_certificates(tmp_path, clients=1)
    _ca_sign(tmp_path / "ca", b"[" * 100_000)
    with pytest.raises(TlsError, match="is not a valid signing-key registry"):
        issue_client_certificate(tmp_path, "late-site")


def test_an_altered_registry_is_not_re_signed_by_a_later_issue(tmp_path: Path) -> None:
    # Prepare: whoever controls the server's folder swaps client-1's key for their own
    paths = init_certificates(tmp_path, clients=2)
    ca = paths.ca_dir
    doc = json.loads((ca / REGISTRY_FILE).read_text())
    forged = Ed25519PrivateKey.generate().public_key().public_bytes_raw().hex()
    doc["keys"]["client-1"] = forged
    (ca / REGISTRY_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    altered = (ca / REGISTRY_FILE).read_bytes()
    # Execute / Assert: adding a site refuses to sign the altered list with the CA key
    with pytest.raises(TlsError, match=r"signing_keys\.json does not verify against .*ca\.pem"):
        issue_client_certificate(tmp_path, "late-site")
    assert (ca / REGISTRY_FILE).read_bytes() == altered
    with pytest.raises(TlsError, match="not signed by the CA"):
        load_signing_registry(ca)  # still refused by every party: not laundered
    assert not paths.client_cert("late-site").exists()
    # a registry whose signature was deleted is refused too, not signed afresh
    init_certificates(tmp_path, clients=2, overwrite=True)
    (ca / REGISTRY_SIGNATURE).unlink()
    with pytest.raises(TlsError, match=r"signing_keys\.sig does not exist"):
        issue_client_certificate(tmp_path, "late-site")


def test_a_re_issued_client_gets_a_new_signing_key(tmp_path: Path) -> None:
    init_certificates(tmp_path, clients=2)
    before = load_signing_registry(tmp_path / "server")
    issue_client_certificate(tmp_path, "client-1", overwrite=True)
    after = load_signing_registry(tmp_path / "server")
    # the old key may have leaked with the old certificate: it must not outlive it
    assert after["client-1"].public_bytes_raw() != before["client-1"].public_bytes_raw()
    assert after["client-0"].public_bytes_raw() == before["client-0"].public_bytes_raw()
    key = load_signing_key(tmp_path / "sites" / "client-1", "client-1")
    assert key.public_key().public_bytes_raw() == after["client-1"].public_bytes_raw()


def test_a_new_ca_signs_only_its_own_clients(tmp_path: Path) -> None:
    init_certificates(tmp_path, clients=3)
    old = load_signing_registry(tmp_path / "server")
    init_certificates(tmp_path, clients=["client-0"], overwrite=True)
    new = load_signing_registry(tmp_path / "server")
    assert sorted(new) == ["client-0"]  # client-1 and client-2 are not carried over
    assert new["client-0"].public_bytes_raw() != old["client-0"].public_bytes_raw()


def test_a_damaged_signing_key_is_named(tmp_path: Path) -> None:
    init_certificates(tmp_path, clients=1)
    site = tmp_path / "sites" / "client-0"
    (site / "clients" / "client-0.sign.key").write_bytes(b"not a key\n")
    with pytest.raises(TlsError, match=r"clients/client-0\.sign\.key is not a readable"):
        load_signing_key(site, "client-0")


def test_a_signing_key_that_is_not_the_enrolled_one_is_refused(tmp_path: Path) -> None:
    # Prepare: client-0 re-issued, but the site still has its old signing key
    init_certificates(tmp_path, clients=2)
    site, other = tmp_path / "sites" / "client-0", tmp_path / "sites" / "client-1"
    old = (site / "clients" / "client-0.sign.key").read_bytes()
    issue_client_certificate(tmp_path, "client-0", overwrite=True)
    key, registry = load_signing_identity(site, "client-0")  # the current key is fine
    assert key.public_key().public_bytes_raw() == registry["client-0"].public_bytes_raw()
    (site / "clients" / "client-0.sign.key").write_bytes(old)
    # Execute / Assert
    with pytest.raises(TlsError, match=r"client-0\.sign\.key is not the key enrolled for"):
        load_signing_identity(site, "client-0")
    # a site whose id the registry does not list at all
    _ca_sign(other, encode_registry({}, version=9), tmp_path / "ca")
    with pytest.raises(TlsError, match=r"no entry for 'client-1' in .*signing_keys\.json"):
        load_signing_identity(other, "client-1")
