"""The signing-key registry: a version a site never lets go back, and a signature context.

After ``certs issue --overwrite`` the old registry (which still lists the revoked site's old
signing key) and its signature still verify against ``ca.pem``; a site that has seen the new
one must refuse it. And the CA key, which also signs X.509 certificates, signs the registry
over a context string only, never over the bare file.

The CA keeps the master registry in ``ca/``; ``certs issue`` and ``certs resign-registry``
copy it to ``server/`` and every ``sites/<id>/`` (one folder per party).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fl_secure.app.cli import main
from fl_secure.errors import TlsError
from fl_secure.tls import init_certificates, issue_client_certificate
from fl_secure.tls.identity import load_signing_registry
from fl_secure.tls.layout import CertificateSet

CONTEXT = b"fl-secure signing-key registry v1\x00"  # the format's, written out bit for bit
FILES = ("signing_keys.json", "signing_keys.sig")


def _pair(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in FILES}


def _site(tmp_path: Path, ca: Path, pair: dict[str, bytes]) -> Path:
    """A site's folder: the CA certificate (from the CA's folder ``ca``) and the registry pair
    it was given."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    shutil.copy(ca / "ca.pem", site / "ca.pem")
    for name, data in pair.items():
        (site / name).write_bytes(data)
    return site


def _ca_key(ca: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def _version(directory: Path) -> int:
    return int(json.loads((directory / "signing_keys.json").read_text())["version"])


def test_after_a_reissue_a_site_that_saw_the_new_registry_refuses_the_old_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: three sites; the registry as issued first; then client-1 re-issued (revoked)
    certs = tmp_path / "certs"
    ca = init_certificates(certs, clients=3).ca_dir
    old = _pair(ca)
    assert main(["certs", "issue", "--out", str(certs), "--id", "client-1", "--overwrite"]) == 0
    new = _pair(ca)
    assert new != old and _pair(CertificateSet(certs).site_dir("client-0")) == new  # handed out
    from fl_secure.tls.registry import read_registry
    from fl_secure.tls.registry_seen import RegistryRollbackError, RegistrySeen

    # the attack's premise: the old pair still verifies against ca.pem (it lists the old key)
    site = _site(tmp_path, ca, old)
    assert read_registry(site).version == 1
    record = tmp_path / "state" / "registry_seen.json"
    # Execute: the site accepts the new registry, then is handed the old one (after a restart)
    _site(tmp_path, ca, new)
    accepted = load_signing_registry(site, seen=RegistrySeen(record))
    _site(tmp_path, ca, old)
    with pytest.raises(RegistryRollbackError, match=r"version 1 .*older than version 2") as err:
        load_signing_registry(site, seen=RegistrySeen(record))
    # Assert: refused, naming both versions; the revoked key is not what the site holds
    assert "signing_keys.json is version 1" in str(err.value)
    assert json.loads(record.read_text())["registries"].popitem()[1]["version"] == 2
    old_keys = json.loads(old["signing_keys.json"])["keys"]
    assert accepted["client-1"].public_bytes_raw().hex() != old_keys["client-1"]
    # the same version with other contents is refused too (two registries under version 2)
    body = json.loads(new["signing_keys.json"])
    body["keys"]["client-1"] = old_keys["client-1"]
    forked = (json.dumps(body, indent=2) + "\n").encode()
    signature = _ca_key(ca).sign(CONTEXT + forked, ec.ECDSA(hashes.SHA256()))
    _site(tmp_path, ca, {FILES[0]: forked, FILES[1]: signature})
    with pytest.raises(RegistryRollbackError, match="two registries under one version"):
        load_signing_registry(site, seen=RegistrySeen(record))
    # and the newer one the operator issues next is accepted and recorded
    issue_client_certificate(certs, "client-2", overwrite=True)
    _site(tmp_path, ca, _pair(ca))
    assert sorted(load_signing_registry(site, seen=RegistrySeen(record))) == [
        "client-0", "client-1", "client-2"
    ]  # fmt: skip
    assert json.loads(record.read_text())["registries"].popitem()[1]["version"] == 3


def test_a_registry_signature_is_bound_to_its_context(tmp_path: Path) -> None:
    # Prepare
    paths = init_certificates(tmp_path / "certs", clients=2)
    certs = paths.ca_dir  # the CA's folder: ca.pem, the master registry, clients/<id>.pem
    pair = _pair(certs)
    body, signature = pair["signing_keys.json"], pair["signing_keys.sig"]
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    public = ca.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    # Assert: the CA signed the context string + the file, and not the bare file
    with pytest.raises(InvalidSignature):
        public.verify(signature, body, ec.ECDSA(hashes.SHA256()))
    public.verify(signature, CONTEXT + body, ec.ECDSA(hashes.SHA256()))
    # a CA signature over the bare file (the old scheme, or any other use of the CA key) is
    # refused, even for a well-formed registry
    bare = _ca_key(certs).sign(body, ec.ECDSA(hashes.SHA256()))
    (certs / "signing_keys.sig").write_bytes(bare)
    with pytest.raises(TlsError, match="not signed by the CA"):
        load_signing_registry(certs)
    # Cross-protocol: a certificate the CA signed, presented as a registry (its TBS as the
    # file, its signature as the .sig), is refused at the signature, before any parsing
    cert = x509.load_pem_x509_certificate((certs / "clients" / "client-0.pem").read_bytes())
    public.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    (certs / "signing_keys.json").write_bytes(cert.tbs_certificate_bytes)
    (certs / "signing_keys.sig").write_bytes(cert.signature)
    with pytest.raises(TlsError, match="not signed by the CA"):
        load_signing_registry(certs)
    # ...and the other way: every message signed for the registry starts with "f" (0x66),
    # every TBSCertificate with a DER SEQUENCE (0x30), so neither signature serves the other
    server = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    assert {c.tbs_certificate_bytes[0] for c in (ca, cert, server)} == {0x30}
    assert (CONTEXT + body)[0] == ord("f")
    with pytest.raises(InvalidSignature):  # the registry's signature is no certificate's
        public.verify(signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))


def test_an_rsa_ca_signs_the_registry_with_the_context_too(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    paths = init_certificates(tmp_path, clients=1, key_type="rsa-2048")
    public = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes()).public_key()
    assert isinstance(public, rsa.RSAPublicKey)
    body, signature = _pair(paths.ca_dir).values()
    public.verify(signature, CONTEXT + body, padding.PKCS1v15(), hashes.SHA256())
    assert sorted(load_signing_registry(paths.ca_dir)) == ["client-0"]
    assert sorted(load_signing_registry(paths.site_dir("client-0"))) == ["client-0"]


def test_the_version_rises_with_every_re_signing(tmp_path: Path) -> None:
    # Prepare / Execute: init, one new site, a re-issue, two sites in one call, a re-sign
    certs = tmp_path / "certs"
    paths = CertificateSet(certs)
    ca = paths.ca_dir
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    init_certificates(certs, clients=2)
    versions = [_version(ca)]
    issue_client_certificate(certs, "site-a")
    versions.append(_version(ca))
    issue_client_certificate(certs, "client-0", overwrite=True)
    versions.append(_version(ca))
    assert main(["certs", "issue", "--out", str(certs), "--id", "site-b", "site-c"]) == 0
    versions.append(_version(ca))
    keys = json.loads((ca / "signing_keys.json").read_text())["keys"]
    assert main(["certs", "resign-registry", "--out", str(certs)]) == 0
    versions.append(_version(ca))
    # Assert: strictly increasing by one per re-signing; a re-sign changes nothing else
    assert versions == [1, 2, 3, 5, 6]
    # ...and the server and every site were handed the re-signed pair
    parts = [paths.server_dir, *(paths.site_dir(c) for c in paths.site_ids())]
    assert len(parts) == 6 and all(_pair(part) == _pair(ca) for part in parts)
    doc = json.loads((ca / "signing_keys.json").read_text())
    assert doc["keys"] == keys and doc["format"] == 2
    issued = dt.datetime.fromisoformat(doc["issued"])
    assert doc["issued"].endswith("Z") and issued.utcoffset() == dt.timedelta(0)
    assert before <= issued <= dt.datetime.now(dt.UTC)
    # a new CA starts its own sequence: a site's record is kept per CA certificate
    from fl_secure.tls.registry_seen import RegistrySeen

    record = RegistrySeen(tmp_path / "registry_seen.json")
    load_signing_registry(paths.site_dir("client-1"), seen=record)
    init_certificates(certs, clients=2, overwrite=True)
    assert _version(ca) == 1
    load_signing_registry(paths.site_dir("client-1"), seen=record)  # another CA's version 1
    assert sorted(v["version"] for v in record.held().values()) == [1, 6]


def test_an_old_format_registry_is_refused_and_re_signed_by_the_migration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the registry as earlier versions wrote it: no format, signed over the bare file,
    # in the CA's folder and a site's
    certs = tmp_path / "certs"
    paths = init_certificates(certs, clients=2)
    ca, site = paths.ca_dir, paths.site_dir("client-0")
    keys = json.loads((ca / "signing_keys.json").read_text())["keys"]
    legacy = (json.dumps({"version": 1, "keys": keys}, indent=2) + "\n").encode()
    for folder in (ca, site):
        (folder / "signing_keys.json").write_bytes(legacy)
        (folder / "signing_keys.sig").write_bytes(
            _ca_key(ca).sign(legacy, ec.ECDSA(hashes.SHA256()))
        )
    # Execute / Assert: sites and `certs issue` refuse it and name the migration
    for folder in (ca, site):
        with pytest.raises(TlsError, match="resign-registry"):
            load_signing_registry(folder)
    with pytest.raises(TlsError, match="resign-registry"):
        issue_client_certificate(certs, "site-a")
    # the migration checks the old signature, then signs the same entries as version 1 (and
    # hands the new pair to the sites)
    assert main(["certs", "resign-registry", "--out", str(certs), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["registry_version"] == 1
    for folder in (ca, site):
        assert {
            k: v.public_bytes_raw().hex() for k, v in load_signing_registry(folder).items()
        } == keys
    # an old-format registry altered after it was signed is not migrated (not laundered)
    keys["client-1"] = keys["client-0"]
    altered = (json.dumps({"version": 1, "keys": keys}, indent=2) + "\n").encode()
    (ca / "signing_keys.json").write_bytes(altered)
    (ca / "signing_keys.sig").write_bytes(_ca_key(ca).sign(legacy, ec.ECDSA(hashes.SHA256())))
    migrated = _pair(site)
    assert main(["certs", "resign-registry", "--out", str(certs)]) != 0
    assert "refusing to re-sign it" in capsys.readouterr().err
    assert (ca / "signing_keys.json").read_bytes() == altered
    assert _pair(site) == migrated  # nothing was handed out


def test_a_site_without_a_state_folder_keeps_its_record_beside_its_keys(tmp_path: Path) -> None:
    from fl_secure.tls.registry_seen import RegistrySeen, seen_path

    site = init_certificates(tmp_path, clients=1).site_dir("client-0")
    path = seen_path(None, site, "client-0")
    assert path == tmp_path / "sites" / "client-0" / "clients" / "client-0.registry_seen.json"
    assert seen_path(tmp_path / "state", site, "client-0") == (
        tmp_path / "state" / "registry_seen.json"
    )
    load_signing_registry(site, seen=RegistrySeen(path))
    assert json.loads(path.read_text())["format"] == 1
    # a damaged record is named, and never read as "nothing seen yet"
    path.write_text('{"registries": {"x": {"version": "2"}}}')
    with pytest.raises(TlsError, match=r"registry_seen\.json is damaged"):
        load_signing_registry(site, seen=RegistrySeen(path))
