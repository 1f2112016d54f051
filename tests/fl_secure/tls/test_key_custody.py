"""Key custody: a party's secret key never leaves that party's folder.

The server's ``--certs`` folder used to hold every client's TLS key, Ed25519 signing key and
the clients' CKKS secret: an honest-but-curious server could sign a key advertisement in
another client's name that verified against the CA-signed registry, and decrypt a client's
CKKS upload. These tests take the folder the server is given and try exactly that.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.x509.oid import NameOID

from fl_secure.app.cli import main
from fl_secure.errors import TlsError
from fl_secure.tls import CertificateSet, init_certificates
from fl_secure.tls.identity import load_signing_registry
from privacy.secagg.config import SecAggConfig
from privacy.secagg.keys import verify_advert
from privacy.secagg.messages import AdvertiseKeys, advert_payload

ROUND = b"round-1"


def _server_folder(paths: CertificateSet) -> Path:
    """The folder the README hands to ``fl-secure server --certs``."""
    server = getattr(paths, "server_dir", None)  # the whole folder before the per-party layout
    return server if server is not None else paths.directory


def _private_keys(folder: Path) -> list[tuple[Path, object]]:
    """Every readable PEM private key under ``folder``: what a curious server could use."""
    found = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or b"PRIVATE KEY-----" not in path.read_bytes():
            continue
        try:
            found.append((path, serialization.load_pem_private_key(path.read_bytes(), None)))
        except (ValueError, TypeError):
            continue
    return found


def _forge_advert(folder: Path, victim: str, cohort: tuple[str, ...]) -> AdvertiseKeys | None:
    """The attack: sign the victim's key advertisement with a key found in ``folder``.

    Returns an advertisement carrying keys of the attacker's choice that the project's own
    check accepts against the folder's CA-signed registry, or None when no key in the
    folder can make one.
    """
    registry = load_signing_registry(folder)
    config = SecAggConfig(ROUND, cohort, threshold=2, clip_range=1.0, scale=1.0)
    c_pk, s_pk = (X25519PrivateKey.generate().public_key().public_bytes_raw() for _ in "cs")
    for _path, key in _private_keys(folder):
        if not isinstance(key, Ed25519PrivateKey):
            continue
        signature = key.sign(advert_payload(victim, ROUND, c_pk, s_pk))
        advert = AdvertiseKeys(victim, ROUND, c_pk, s_pk, signature)
        try:
            verify_advert(advert, config, registry)
        except Exception:  # noqa: BLE001 - not the victim's key: try the next one
            continue
        return advert
    return None


def test_the_server_folder_holds_no_key_to_sign_as_another_client(tmp_path: Path) -> None:
    # Prepare: the one-machine set; the server is given its folder, as the README says
    paths = init_certificates(tmp_path / "certs", clients=3)
    served = _server_folder(paths)
    cohort = ("client-0", "client-1", "client-2")
    # Execute: the server looks for client-1's signing key and signs an advertisement with it
    forged = _forge_advert(served, "client-1", cohort)
    # Assert: impossible, and the folder holds no private key other than the server's
    assert forged is None
    assert [p.name for p, _ in _private_keys(served)] == ["server.key"]
    # the site's own folder does hold the key: the attack works where the key is (the check
    # is real, not vacuous)
    assert _forge_advert(paths.site_dir("client-1"), "client-1", cohort) is not None


def _ckks_files(paths: CertificateSet) -> tuple[bytes, Path]:
    """Make the CKKS keys as `certs ckks` does; the clients' secret and the server's folder."""
    import privacy.ckks.keys as keys

    distribute = getattr(keys, "distribute_ckks_keys", None)
    if distribute is not None:
        secrets, _public = distribute(paths.directory)
        return secrets[0].read_bytes(), _server_folder(paths)
    secret, _public = keys.write_ckks_keys(paths.directory)  # the single-folder layout
    return secret.read_bytes(), _server_folder(paths)


def test_the_server_folder_cannot_decrypt_a_clients_ckks_upload(tmp_path: Path) -> None:
    ts = pytest.importorskip("tenseal")
    # Prepare: a client encrypts its update with the clients' shared key
    paths = init_certificates(tmp_path / "certs", clients=2)
    secret, served = _ckks_files(paths)
    values = [0.25, -1.5, 3.0, 0.125]
    upload = ts.ckks_vector(ts.context_from(secret), values).serialize()
    # Execute: the server tries every context in its folder that holds a secret key
    decrypted = []
    for path in sorted(p for p in served.rglob("*") if p.is_file()):
        try:
            ctx = ts.context_from(path.read_bytes())
        except Exception:  # noqa: BLE001, S112 - not a TenSEAL context
            continue
        if ctx.is_private():
            decrypted.append(ts.ckks_vector_from(ctx, upload).decrypt())
    # Assert: nothing in the server's folder decrypts it; its context is the key-less one
    assert decrypted == []
    public = ts.context_from((served / "ckks" / "server.public").read_bytes())
    assert not public.is_private() and not public.has_secret_key()
    with pytest.raises(ValueError, match="doesn't hold a secret_key"):
        ts.ckks_vector_from(public, upload).decrypt()
    # (the same upload does decrypt with the clients' key: the test can tell)
    mine = ts.ckks_vector_from(ts.context_from(secret), upload).decrypt()
    np.testing.assert_allclose(mine, values, atol=1e-3)


def _serve(certs: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`fl-secure server`, stopped by a bad address right after its start-up checks."""
    code = main(["server", "--certs", str(certs), "--config", str(config),
                 "--address", "no-port-here"])  # fmt: skip
    return code, capsys.readouterr().err


@pytest.mark.parametrize("planted", ["signing", "signing-renamed", "tls", "tls-alone", "ckks"])
def test_fl_secure_server_refuses_a_folder_with_a_client_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: str
) -> None:
    # Prepare: the server's folder, and a client secret put into it
    paths = init_certificates(tmp_path / "certs", clients=2)
    served = _server_folder(paths)
    config = tmp_path / "c.toml"
    config.write_text("[partition]\nnum_clients = 2\n[server]\nmin_clients = 2\n")
    site = paths.directory / "sites" / "client-1" / "clients"
    if not site.is_dir():  # the single-folder layout: the keys are already beside the server's
        site = paths.directory / "clients"
    target = {
        "signing": served / "clients" / "client-1.sign.key",
        "signing-renamed": served / "backup" / "old.pem",
        "tls": served / "clients" / "client-1.key",
        "tls-alone": served / "spare.key",
        "ckks": served / "ckks" / "clients.secret",
    }[planted]
    target.parent.mkdir(parents=True, exist_ok=True)
    source = {"ckks": None, "tls": "client-1.key", "tls-alone": "client-1.key"}.get(
        planted, "client-1.sign.key"
    )
    if source is None:
        target.write_bytes(b"a CKKS context with the secret key")
    elif (site / source).resolve() != target.resolve():  # (already there in a single folder)
        shutil.copy(site / source, target)
        if planted == "tls":
            shutil.copy(site / "client-1.pem", served / "clients" / "client-1.pem")
    # Execute
    code, err = _serve(served, config, capsys)
    # Assert: refused, naming the file and what to do
    assert code == 2
    assert str(target) in err and "must hold no client secret" in err, err
    what = {
        "signing": "client's signing private key",
        "signing-renamed": "signing private key of client 'client-1'",
        "tls": "client's TLS private key",
        "tls-alone": "not the server's own",
        "ckks": "CKKS secret",
    }[planted]
    assert what in err
    # the clean folder passes the check (and stops only at the bad address)
    target.unlink()
    code, err = _serve(served, config, capsys)
    assert "must hold no client secret" not in err and "no-port-here" in err


def test_fl_secure_server_refuses_the_whole_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    init_certificates(tmp_path / "certs", clients=2)
    config = tmp_path / "c.toml"
    config.write_text("[partition]\nnum_clients = 2\n[server]\nmin_clients = 2\n")
    code, err = _serve(tmp_path / "certs", config, capsys)
    assert code == 2 and "pass " + str(tmp_path / "certs" / "server") in err, err


def test_the_ledger_key_and_the_ca_key_are_the_servers_own(tmp_path: Path) -> None:
    from privacy.ledger.signed_head import HeadSigner
    from server.custody import check_server_folder

    paths = init_certificates(tmp_path / "certs", clients=2)
    HeadSigner.load_or_create(paths.server_dir)  # what a DP run writes beside server.key
    shutil.copy(paths.ca_key, paths.server_dir / "ca.key")  # warned about, not a client's
    check_server_folder(paths.server_dir)
    # but a client's signing key named as the ledger key is still a client's key
    sign_key = paths.site_dir("client-0") / "clients" / "client-0.sign.key"
    shutil.copy(sign_key, paths.server_dir / "ledger_signing.key")
    with pytest.raises(TlsError, match="signing private key of client 'client-0'"):
        check_server_folder(paths.server_dir)


def test_embedded_clients_see_only_their_own_site_folder(tmp_path: Path) -> None:
    from fl_secure.runs import RunDir
    from server.embedded import client_command

    run = RunDir(tmp_path / "run")
    paths = init_certificates(run.certs, clients=2)
    command = client_command(5000, "client-1", run, 1, insecure=False)
    folder = Path(command[command.index("--certs") + 1])
    assert folder == paths.site_dir("client-1")
    names = {p.name for p, _ in _private_keys(folder)}
    assert names == {"client-1.key", "client-1.sign.key"}  # no other site's, no CA's


# ----------------------------------------------------------------- request -> sign -> join


def _sign(ca: Path, request: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["certs", "sign", "--ca", str(ca), "--request", str(request)])
    return code, capsys.readouterr().err


def test_request_and_sign_keep_the_sites_keys_at_the_site(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the operator's set; a hospital's own machine makes its keys and a request
    paths = init_certificates(tmp_path / "operator", clients=1)
    site = tmp_path / "hospital"
    assert main(["certs", "request", "--id", "hospital-a", "--out", str(site), "--json"]) == 0
    request = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["request"]
    sent = tmp_path / "mail" / "hospital-a.request.json"  # only this travels
    sent.parent.mkdir()
    shutil.copy(request, sent)
    # Execute: the CA signs it; the reply (next to the request) is installed at the site
    code, err = _sign(paths.ca_dir, sent, capsys)
    assert code == 0, err
    for name in ("ca.pem", "signing_keys.json", "signing_keys.sig", "clients/hospital-a.pem"):
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(sent.parent / name, site / name)
    # Assert: the keys were made 0600 at the site, and no private key reached the CA or mail
    for key in (site / "clients" / "hospital-a.key", site / "clients" / "hospital-a.sign.key"):
        assert key.stat().st_mode & 0o777 == 0o600
    assert _private_keys(sent.parent) == []
    assert [p.name for p, _ in _private_keys(paths.ca_dir)] == ["ca.key"]
    # the certificate is for the site's own key, CN = id, issued by the CA
    cert = x509.load_pem_x509_certificate((site / "clients" / "hospital-a.pem").read_bytes())
    key_pem = (site / "clients" / "hospital-a.key").read_bytes()
    key = serialization.load_pem_private_key(key_pem, None)
    assert cert.public_key() == key.public_key()  # type: ignore[union-attr]
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "hospital-a"
    ca = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    # enrolled (pinned) on the server, its signing key in the registry every party verifies
    enrolled = json.loads(paths.enrollment.read_text())["clients"]
    pinned = {c["id"]: c["sha256"] for c in enrolled}
    assert pinned["hospital-a"] == cert.fingerprint(hashes.SHA256()).hex()
    sign_key = serialization.load_pem_private_key(
        (site / "clients" / "hospital-a.sign.key").read_bytes(), None
    )
    assert isinstance(sign_key, Ed25519PrivateKey)
    for folder in (paths.server_dir, paths.site_dir("client-0"), site):
        registry = load_signing_registry(folder)
        assert registry["hospital-a"].public_bytes_raw() == sign_key.public_key().public_bytes_raw()
    # signing it again is refused (no silent re-issue)
    code, err = _sign(paths.ca_dir, sent, capsys)
    assert code == 2 and "'hospital-a' is already issued" in err


def _request_doc(client_id: str, cn: str, key: object) -> dict[str, object]:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .sign(key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return {
        "version": 1,
        "id": client_id,
        "csr": csr.public_bytes(serialization.Encoding.PEM).decode(),
        "signing_public_key": Ed25519PrivateKey.generate().public_key().public_bytes_raw().hex(),
    }


def _tampered_csr(doc: dict[str, object]) -> dict[str, object]:
    """The CSR with one letter of its subject changed: still parses, signature broken."""
    pem = str(doc["csr"]).encode()
    der = x509.load_pem_x509_csr(pem).public_bytes(serialization.Encoding.DER)
    altered = x509.load_der_x509_csr(der.replace(b"hospital-a", b"hospital-b"))
    return {
        **doc,
        "id": "hospital-b",
        "csr": altered.public_bytes(serialization.Encoding.PEM).decode(),
    }


BAD_REQUESTS = {
    "cn-mismatch": (
        lambda: _request_doc("hospital-a", "client-0", ec.generate_private_key(ec.SECP256R1())),
        "CSR's common name ['client-0'] is not the request's id 'hospital-a'",
    ),
    "bad-csr-signature": (
        lambda: _tampered_csr(
            _request_doc("hospital-a", "hospital-a", ec.generate_private_key(ec.SECP256R1()))
        ),
        "the CSR's signature does not verify",
    ),
    "weak-rsa": (
        lambda: _request_doc(
            "hospital-a", "hospital-a", rsa.generate_private_key(65537, key_size=1024)
        ),
        "an RSA key of 1024 bits",
    ),
    "bad-id": (
        lambda: _request_doc("../x", "../x", ec.generate_private_key(ec.SECP256R1())),
        "invalid client id '../x'",
    ),
    "bad-signing-key": (
        lambda: {
            **_request_doc("hospital-a", "hospital-a", ec.generate_private_key(ec.SECP256R1())),
            "signing_public_key": "00" * 31,
        },
        "'signing_public_key' is not a hex Ed25519 public key",
    ),
    "not-json": (lambda: None, "is not a JSON enrollment request"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_bad_request_is_refused_with_its_problem_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    # Prepare
    paths = init_certificates(tmp_path / "operator", clients=1)
    make, message = BAD_REQUESTS[case]
    doc = make()
    request = tmp_path / "mail" / "request.json"
    request.parent.mkdir()
    request.write_text(json.dumps(doc) if doc is not None else "{not json")
    enrolled_before = paths.enrollment.read_bytes()
    registry_before = (paths.ca_dir / "signing_keys.json").read_bytes()
    # Execute
    code, err = _sign(paths.ca_dir, request, capsys)
    # Assert: refused, the problem named, nothing enrolled or written
    assert code == 2 and message in err, err
    assert paths.enrollment.read_bytes() == enrolled_before
    assert (paths.ca_dir / "signing_keys.json").read_bytes() == registry_before
    assert sorted(p.name for p in request.parent.iterdir()) == ["request.json"]


def test_a_signed_site_joins_the_server_over_mutual_tls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading
    from collections import OrderedDict

    from client.app import FlClient
    from client.transport import Connection
    from fl_secure.runs import RunDir
    from server.app import load_enrollment, start_server
    from server.coordinator import Coordinator
    from server.custody import check_server_folder
    from server.settings import CoordinatorSettings

    # Prepare: one site from `certs init`, one that made its own keys and was signed
    paths = init_certificates(tmp_path / "operator", clients=1)
    site = tmp_path / "hospital"
    assert main(["certs", "request", "--id", "hospital-a", "--out", str(site)]) == 0
    code, err = _sign(paths.ca_dir, site / "hospital-a.request.json", capsys)
    assert code == 0, err
    check_server_folder(paths.server_dir)  # still no client secret in it
    enrolled = set(load_enrollment(paths.server_dir).fingerprints)
    assert enrolled == {"client-0", "hospital-a"}
    initial = OrderedDict([("w", np.zeros(4, np.float32))])
    settings = CoordinatorSettings(
        rounds=1, min_clients=2, round_timeout=30.0, poll_wait=0.5, final_evaluation=False,
        run_id="custody", run_config_toml="",
    )  # fmt: skip
    coordinator = Coordinator(
        settings,
        initial,
        enrolled=enrolled,
        run_dir=RunDir(tmp_path / "run"),
        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p),
    )
    server, port = start_server(coordinator, "127.0.0.1:0", cert_dir=paths.server_dir)
    driver = threading.Thread(target=coordinator.run, daemon=True)
    driver.start()

    class Shift:
        def __init__(self, shift: float) -> None:
            self.shift, self.num_examples = shift, 1

        def train(self, shared, training):  # noqa: ANN001, ANN202
            update = OrderedDict((k, (v + self.shift).astype(v.dtype)) for k, v in shared.items())
            return update, 1, {}

        def evaluate(self, shared):  # noqa: ANN001, ANN202
            return 1, {}

    folders = {"client-0": paths.site_dir("client-0"), "hospital-a": site}
    shifts = {"client-0": 1.0, "hospital-a": 3.0}
    errors: list[BaseException] = []

    def run_client(client_id: str) -> None:
        trainer = Shift(shifts[client_id])
        conn = Connection(f"localhost:{port}", client_id, cert_dir=folders[client_id])
        try:
            FlClient(conn, lambda reply: trainer, max_wait=20.0).run()  # type: ignore[arg-type,return-value]
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run_client, args=(c,), daemon=True) for c in folders]
    try:
        for t in threads:
            t.start()
        driver.join(timeout=60)
        for t in threads:
            t.join(timeout=30)
    finally:
        server.stop(grace=1.0)
    # Assert: both sites were served over mTLS; the global step is the mean of the two shifts
    assert not driver.is_alive() and errors == []
    np.testing.assert_allclose(coordinator.params["w"], np.full(4, 2.0, np.float32))


def test_the_site_folder_refuses_to_be_overwritten_without_asking(tmp_path: Path) -> None:
    from fl_secure.tls.request import create_request

    create_request(tmp_path / "site", "hospital-a")
    before = (tmp_path / "site" / "clients" / "hospital-a.key").read_bytes()
    with pytest.raises(TlsError, match="already exists: this site has keys"):
        create_request(tmp_path / "site", "hospital-a")
    create_request(tmp_path / "site", "hospital-a", overwrite=True)
    assert (tmp_path / "site" / "clients" / "hospital-a.key").read_bytes() != before
    assert os.stat(tmp_path / "site" / "clients" / "hospital-a.key").st_mode & 0o777 == 0o600
