"""Tests of fl_secure.tls: what the certificates contain and whom a mutual-TLS server admits.

Certificates are checked with an independent verifier (cryptography's RFC 5280 / CA-B policy
verifier and hashlib); admission is checked end to end against a real gRPC server on
127.0.0.1 port 0 with a bytes-identity generic handler (no generated protobuf code).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import fl_secure
from fl_secure.errors import TlsError
from fl_secure.tls import (
    CertificateSet,
    CertifiedKey,
    EnrollmentList,
    InsecureTransportWarning,
    certificate_fingerprint,
    channel_credentials,
    init_certificates,
    issue_client_certificate,
    load_certified_key,
    make_certificate,
    peer_client_id,
    require_enrolled,
    server_credentials,
    validate_client_id,
    warn_insecure,
)
from fl_secure.tls.layout import server_bundle

SERVICE, METHOD = "fl_secure.test.Identity", "WhoAmI"
TIMEOUT_S = 5.0  # every call and readiness wait; a refused handshake fails in milliseconds
INIT_HINT = "fl-secure certs init --out DIR --clients N"
NOW = dt.datetime.now(dt.UTC)


def _identity(data: bytes) -> bytes:
    return data


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _ext(cert: x509.Certificate, kind: type[Any]) -> Any:
    return cert.extensions.get_extension_for_class(kind)


# --------------------------------------------------------------------------- gRPC harness


@dataclass
class Server:
    port: int
    ca_pem: bytes
    reached: list[str | None] = field(default_factory=list)  # peer ids that reached the handler


@contextmanager
def serve(cert_dir: Path, enrollment: EnrollmentList, *, secure: bool = True) -> Iterator[Server]:
    state = Server(port=0, ca_pem=(server_bundle(cert_dir) / "ca.pem").read_bytes())

    def who_am_i(request: bytes, context: grpc.ServicerContext) -> bytes:
        state.reached.append(peer_client_id(context))
        return require_enrolled(context, enrollment).encode()

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            METHOD: grpc.unary_unary_rpc_method_handler(
                who_am_i, request_deserializer=_identity, response_serializer=_identity
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    if secure:
        state.port = server.add_secure_port("127.0.0.1:0", server_credentials(cert_dir))
    else:
        state.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield state
    finally:
        server.stop(grace=None)


def call(port: int, credentials: grpc.ChannelCredentials | None) -> bytes:
    """One WhoAmI call; ``None`` credentials means a plaintext channel."""
    target = f"127.0.0.1:{port}"  # the server certificate carries the IP SAN 127.0.0.1
    if credentials is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, credentials)
    with channel:
        stub = channel.unary_unary(
            f"/{SERVICE}/{METHOD}", request_serializer=_identity, response_deserializer=_identity
        )
        response: bytes = stub(b"", timeout=TIMEOUT_S)
        return response


def call_refused(port: int, credentials: grpc.ChannelCredentials | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(port, credentials)
    error: grpc.RpcError = info.value
    return error


def raw_credentials(ca_pem: bytes, client: CertifiedKey | None) -> grpc.ChannelCredentials:
    """Credentials built without fl_secure's checks, as an attacker would."""
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=ca_pem)
    return grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=client.key_pem, certificate_chain=client.cert_pem
    )


@pytest.fixture
def certs(tmp_path: Path) -> CertificateSet:
    return init_certificates(tmp_path / "certs", clients=2)


@pytest.fixture
def ca(certs: CertificateSet) -> CertifiedKey:
    return load_certified_key(certs.ca_cert, certs.ca_key)


@pytest.fixture
def server(certs: CertificateSet) -> Iterator[Server]:
    with serve(certs.directory, EnrollmentList.load(certs.enrollment)) as state:
        yield state


# --------------------------------------------------------------------------- certificates


def test_ca_is_a_self_signed_signing_only_ca(certs: CertificateSet) -> None:
    ca = _load(certs.ca_cert)

    ca.verify_directly_issued_by(ca)  # raises InvalidSignature if the self-signature is bad
    constraints = _ext(ca, x509.BasicConstraints)
    usage = _ext(ca, x509.KeyUsage).value
    assert constraints.critical and constraints.value.ca
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature


def test_server_certificate_has_hosts_san_and_server_auth(certs: CertificateSet) -> None:
    ca, leaf = _load(certs.ca_cert), _load(certs.server_cert)

    leaf.verify_directly_issued_by(ca)
    san = _ext(leaf, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    assert list(_ext(leaf, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not _ext(leaf, x509.BasicConstraints).value.ca
    assert _ext(leaf, x509.KeyUsage).value.digital_signature
    store = verification.Store([ca])
    for name in (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))):
        verifier = verification.PolicyBuilder().store(store).build_server_verifier(name)
        assert verifier.verify(leaf, []) == [leaf, ca]


@pytest.mark.parametrize("client_id", ["client-0", "client-1"])
def test_client_certificate_has_id_as_cn_and_uri_and_client_auth(
    certs: CertificateSet, client_id: str
) -> None:
    ca, leaf = _load(certs.ca_cert), _load(certs.client_cert(client_id))

    leaf.verify_directly_issued_by(ca)
    cn = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert [a.value for a in cn] == [client_id]
    assert list(_ext(leaf, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert _ext(leaf, x509.KeyUsage).value.digital_signature
    verifier = verification.PolicyBuilder().store(verification.Store([ca]))
    verified = verifier.build_client_verifier().verify(leaf, [])
    uri = x509.UniformResourceIdentifier(f"urn:fl-secure:client:{client_id}")
    assert verified.subjects == [uri]


def test_client_certificate_from_another_ca_does_not_verify(certs: CertificateSet) -> None:
    foreign = make_certificate("ca", "foreign CA")
    leaf = make_certificate("client", "client-0", issuer=foreign).certificate

    verifier = verification.PolicyBuilder().store(verification.Store([_load(certs.ca_cert)]))
    with pytest.raises(verification.VerificationError):
        verifier.build_client_verifier().verify(leaf, [])


def test_make_certificate_can_make_an_expired_certificate(ca: CertifiedKey) -> None:
    expired = make_certificate(
        "client",
        "client-0",
        issuer=ca,
        not_before=NOW - dt.timedelta(days=30),
        not_after=NOW - dt.timedelta(days=1),
    ).certificate

    assert expired.not_valid_after_utc < NOW
    verifier = verification.PolicyBuilder().store(verification.Store([ca.certificate]))
    with pytest.raises(verification.VerificationError, match="not valid at validation time"):
        verifier.build_client_verifier().verify(expired, [])


def test_key_files_are_private_and_certificates_readable(certs: CertificateSet) -> None:
    keys = [certs.ca_key, certs.server_key, *(certs.client_key(c) for c in certs.client_ids)]
    pems = [certs.ca_cert, certs.server_cert, *(certs.client_cert(c) for c in certs.client_ids)]

    assert {p.stat().st_mode & 0o777 for p in keys} == {0o600}
    assert {p.stat().st_mode & 0o777 for p in pems} == {0o644}
    # one folder per party, each with its own private keys only
    assert sorted(p.name for p in certs.directory.iterdir()) == ["ca", "server", "sites"]
    registry = ["signing_keys.json", "signing_keys.sig"]
    assert _names(certs.ca_dir) == sorted(
        ["ca.key", "ca.pem", "clients/client-0.pem", "clients/client-1.pem", "enrolled.json",
         *registry]
    )  # fmt: skip
    assert _names(certs.server_dir) == sorted(
        ["ca.pem", "enrolled.json", "server.key", "server.pem", *registry]
    )
    for c in certs.client_ids:
        assert _names(certs.site_dir(c)) == sorted(
            ["ca.pem", f"clients/{c}.key", f"clients/{c}.pem", f"clients/{c}.sign.key", *registry]
        )


def _names(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def test_each_key_belongs_to_its_certificate(certs: CertificateSet) -> None:
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    for cert_path, key_path in [
        (certs.server_cert, certs.server_key),
        *((certs.client_cert(c), certs.client_key(c)) for c in certs.client_ids),
    ]:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert key.public_key().public_bytes(serialization.Encoding.DER, spki) == _load(
            cert_path
        ).public_key().public_bytes(serialization.Encoding.DER, spki)


def test_enrolled_json_lists_ids_with_sha256_of_each_certificate(certs: CertificateSet) -> None:
    doc = json.loads(certs.enrollment.read_text())

    expected = {
        c: hashlib.sha256(_load(certs.client_cert(c)).public_bytes(serialization.Encoding.DER))
        for c in ("client-0", "client-1")
    }
    assert doc["clients"] == [{"id": c, "sha256": h.hexdigest()} for c, h in expected.items()]
    assert EnrollmentList.load(certs.enrollment).fingerprints == {
        c: h.hexdigest() for c, h in expected.items()
    }


def test_explicit_ids_hosts_and_rsa_keys(tmp_path: Path) -> None:
    made = init_certificates(
        tmp_path, clients=["site_A", "site.b"], hosts=["fl.example.org", "10.1.2.3"],
        key_type="rsa-2048",
    )  # fmt: skip

    assert made.client_ids == ("site_A", "site.b")
    san = _ext(_load(made.server_cert), x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.1.2.3")]
    public_key = _load(made.client_cert("site.b")).public_key()
    assert isinstance(public_key, rsa.RSAPublicKey) and public_key.key_size == 2048


@pytest.mark.parametrize("bad", ["", "a" * 65, "../x", "a b", "é", ".", "..", "x/y"])
def test_invalid_client_ids_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(TlsError, match="invalid client id"):
        init_certificates(tmp_path, clients=["ok", bad])
    assert not (tmp_path / "ca.pem").exists()  # nothing written when an argument is bad


def test_valid_client_id_limits() -> None:
    assert validate_client_id("a" * 64) == "a" * 64
    assert validate_client_id("Site_1.eu-west") == "Site_1.eu-west"


def test_duplicate_ids_and_bad_hosts_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TlsError, match="duplicate client ids"):
        init_certificates(tmp_path, clients=["a", "b", "a"])
    with pytest.raises(TlsError, match="invalid host"):
        init_certificates(tmp_path, clients=1, hosts=["bad host"])


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("10.0.0.300", "not a valid IP address"),
        ("1.2.3", "not a valid IP address"),
        ("1234", "not a valid IP address"),
        ("foo..bar", "empty label"),
        (".example.org", "empty label"),
        ("example.org.", "empty label"),
        ("-foo.example.org", "letters, digits and inner hyphens"),
        ("a" * 64 + ".org", "1-63"),
    ],
)
def test_hosts_that_are_neither_an_ip_nor_a_dns_name_are_refused(
    tmp_path: Path, host: str, reason: str
) -> None:
    with pytest.raises(TlsError, match=f"invalid host '{host}': .*{reason}"):
        init_certificates(tmp_path, clients=0, hosts=[host])
    assert not (tmp_path / "ca.pem").exists()


def test_valid_dns_names_and_ips_are_accepted(tmp_path: Path) -> None:
    hosts = ["fl.example.org", "*.fl.example.org", "localhost", "xn--bcher-kva.example",
             "site-1.a1", "10.0.0.5", "::1"]  # fmt: skip
    made = init_certificates(tmp_path, clients=0, hosts=hosts)
    san = _ext(_load(made.server_cert), x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == hosts[:5]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(h) for h in hosts[5:]]


def test_existing_ca_is_not_overwritten_unless_asked(certs: CertificateSet) -> None:
    before = certs.ca_cert.read_bytes()

    with pytest.raises(TlsError, match="overwrite=True"):
        init_certificates(certs.directory, clients=1)
    assert certs.ca_cert.read_bytes() == before
    init_certificates(certs.directory, clients=1, overwrite=True)
    assert certs.ca_cert.read_bytes() != before
    assert list(EnrollmentList.load(certs.enrollment).fingerprints) == ["client-0"]


def test_issue_client_certificate_enrolls_the_new_client(certs: CertificateSet) -> None:
    issued = issue_client_certificate(certs.directory, "site-late")

    assert certs.client_key("site-late").stat().st_mode & 0o777 == 0o600
    _load(certs.client_cert("site-late")).verify_directly_issued_by(_load(certs.ca_cert))
    enrolled = EnrollmentList.load(certs.enrollment).fingerprints
    assert enrolled["site-late"] == certificate_fingerprint(issued.certificate)
    assert set(enrolled) == {"client-0", "client-1", "site-late"}


def test_reissue_needs_overwrite_and_changes_the_pinned_fingerprint(
    certs: CertificateSet,
) -> None:
    old = EnrollmentList.load(certs.enrollment).fingerprints["client-0"]

    with pytest.raises(TlsError, match=r"already issued: found in .*client-0\.pem"):
        issue_client_certificate(certs.directory, "client-0")
    issue_client_certificate(certs.directory, "client-0", overwrite=True)
    assert EnrollmentList.load(certs.enrollment).fingerprints["client-0"] != old


def test_reissue_needs_overwrite_even_when_the_certificate_file_was_moved_away(
    certs: CertificateSet,
) -> None:
    # Prepare: client-0's certificate moved off the operator's machine (given to its site)
    certs.client_cert("client-0").rename(certs.directory / "client-0.pem.handed-out")
    certs.ca.client_cert("client-0").unlink()  # and the CA's record of it lost
    enrolled = EnrollmentList.load(certs.ca.enrollment)
    registry = (certs.ca_dir / "signing_keys.json").read_bytes()
    # Execute / Assert: still enrolled, so no silent re-issue (it would revoke the site)
    with pytest.raises(TlsError, match=r"'client-0' is already issued: .*enrolled\.json"):
        issue_client_certificate(certs.directory, "client-0")
    # enrolled.json edited by hand to drop it: the signing-key registry still lists it
    without = {k: v for k, v in enrolled.fingerprints.items() if k != "client-0"}
    EnrollmentList(without).save(certs.ca.enrollment)
    with pytest.raises(TlsError, match=r"already issued: found in [^,;]*signing_keys\.json;"):
        issue_client_certificate(certs.directory, "client-0")
    assert not certs.client_cert("client-0").exists()
    assert (certs.ca_dir / "signing_keys.json").read_bytes() == registry
    # an explicit re-issue is still possible
    issue_client_certificate(certs.directory, "client-0", overwrite=True)
    assert EnrollmentList.load(certs.enrollment).is_enrolled("client-0")


def test_issue_with_offline_ca_key(certs: CertificateSet, tmp_path: Path) -> None:
    offline = tmp_path / "usb" / "ca.key"
    offline.parent.mkdir()
    shutil.move(certs.ca_key, offline)

    with pytest.raises(TlsError, match="ca.key does not exist"):
        issue_client_certificate(certs.directory, "site-x")
    issue_client_certificate(certs.directory, "site-x", ca_key=offline)
    assert EnrollmentList.load(certs.enrollment).is_enrolled("site-x")


def test_issued_certificate_ends_no_later_than_the_ca(tmp_path: Path) -> None:
    made = init_certificates(tmp_path, clients=0, ca_days=10)

    issued = issue_client_certificate(tmp_path, "late", days=365)
    assert issued.certificate.not_valid_after_utc == _load(made.ca_cert).not_valid_after_utc


def test_init_certificates_end_no_later_than_the_ca(tmp_path: Path) -> None:
    made = init_certificates(tmp_path, clients=1, days=5000, ca_days=10)

    ca_end = _load(made.ca_cert).not_valid_after_utc
    assert _load(made.server_cert).not_valid_after_utc == ca_end
    assert _load(made.client_cert("client-0")).not_valid_after_utc == ca_end
    # and they start when they were made, not 5000 days before the cut end
    assert _load(made.server_cert).not_valid_before_utc > NOW - dt.timedelta(days=1)


# A disk that takes a 241-byte EC key but not a certificate (550-700 bytes): the file-size
# limit makes a write past 400 bytes fail with EFBIG, as ENOSPC would on a full disk.
_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from fl_secure.errors import TlsError
from fl_secure.tls import init_certificates, issue_client_certificate

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (400, 400))
command, out = sys.argv[1], Path(sys.argv[2])
try:
    if command == "init":
        init_certificates(out, clients=2, overwrite=True)
    else:
        issue_client_certificate(out, "client-1", overwrite=True)
except TlsError as exc:
    sys.exit(f"TlsError: {exc}")
"""


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*.*")}


@pytest.mark.parametrize(("command", "failing"), [("init", "ca.pem"), ("issue", "client-1.pem")])
def test_a_failed_write_replaces_no_file(certs: CertificateSet, command: str, failing: str) -> None:
    # Prepare
    before = _files(certs.directory)
    root = Path(fl_secure.__file__).parents[1]
    # Execute: init / issue with overwrite=True on a full disk
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, command, str(certs.directory)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Assert: a TlsError names the file; every file is the old one, no temporary is left over
    assert done.returncode == 1 and done.stderr.startswith("TlsError: cannot write"), done.stderr
    assert f"{failing}: File too large; no file was replaced" in done.stderr
    assert _files(certs.directory) == before
    assert [p.name for p in certs.directory.rglob(".*")] == []
    load_certified_key(certs.ca_cert, certs.ca_key)  # the pairs still match
    load_certified_key(certs.client_cert("client-1"), certs.client_key("client-1"))


# --------------------------------------------------------------------------- loading errors


def test_missing_files_name_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TlsError, match=f"server.pem does not exist.*{INIT_HINT}"):
        server_credentials(tmp_path)
    with pytest.raises(TlsError, match=r"clients/client-7\.pem does not exist"):
        channel_credentials(tmp_path, "client-7")
    with pytest.raises(TlsError, match="enrolled.json does not exist"):
        EnrollmentList.load(tmp_path / "enrolled.json")


def test_a_damaged_or_foreign_ca_pem_is_named_before_grpc_sees_it(
    certs: CertificateSet, tmp_path: Path
) -> None:
    from fl_secure.tls.identity import load_signing_registry

    good = certs.ca_cert.read_bytes()
    loaders: list[Callable[[], object]] = [
        lambda: server_credentials(certs.directory),
        lambda: channel_credentials(certs.directory, "client-0"),
        lambda: load_signing_registry(certs.server_dir),
    ]
    copies = [certs.ca_cert, certs.server.ca_cert, certs.site("client-0").ca_cert]

    def write_ca(data: bytes) -> None:  # every party's copy
        for path in copies:
            path.write_bytes(data)

    # a damaged file: gRPC would only fail later, as "port in use" or endless retries
    write_ca(good[:200])
    for load in loaders:
        with pytest.raises(TlsError, match=r"ca\.pem is not a readable PEM CA certificate"):
            load()
    # a certificate that is not a CA (the server's own, copied by mistake)
    write_ca(certs.server_cert.read_bytes())
    for load in loaders:
        with pytest.raises(TlsError, match=r"ca\.pem holds a certificate that is not a CA"):
            load()
    # another CA's certificate: our own certificate was not issued by it
    other = init_certificates(tmp_path / "other", clients=0)
    write_ca(other.ca_cert.read_bytes())
    with pytest.raises(TlsError, match=r"server\.pem was not issued by the CA in .*ca\.pem"):
        server_credentials(certs.directory)
    with pytest.raises(TlsError, match=r"client-0\.pem was not issued by the CA in .*ca\.pem"):
        channel_credentials(certs.directory, "client-0")
    # a bundle holding the right CA next to another one is accepted
    write_ca(other.ca_cert.read_bytes() + good)
    server_credentials(certs.directory)
    channel_credentials(certs.directory, "client-0")


def test_mismatched_key_is_refused(certs: CertificateSet) -> None:
    shutil.copy(certs.client_key("client-1"), certs.client_key("client-0"))

    with pytest.raises(TlsError, match="is not the private key of"):
        channel_credentials(certs.directory, "client-0")


def test_own_expired_certificate_is_refused_before_dialling(
    certs: CertificateSet, ca: CertifiedKey
) -> None:
    expired = make_certificate("client", "client-0", issuer=ca, not_after=NOW - dt.timedelta(1))
    expired.write(certs.client_cert("client-0"), certs.client_key("client-0"))

    with pytest.raises(TlsError, match="valid only from"):
        channel_credentials(certs.directory, "client-0")


def test_malformed_enrollment_list_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "enrolled.json"
    path.write_text('{"clients": [{"name": "x"}]}')

    with pytest.raises(TlsError, match="not a valid enrollment list"):
        EnrollmentList.load(path)
    path.write_text("[" * 100_000)  # nested past the JSON parser's recursion limit
    with pytest.raises(TlsError, match="not a valid enrollment list"):
        EnrollmentList.load(path)


def test_enrollment_matching_rules(certs: CertificateSet) -> None:
    good = certs.client_cert("client-0").read_bytes()
    other = certs.client_cert("client-1").read_bytes()
    pinned = EnrollmentList.load(certs.enrollment)

    assert pinned.matches("client-0", good)
    assert not pinned.matches("client-0", other)
    assert not pinned.matches("client-0", None)
    assert not pinned.matches("client-9", good)
    assert EnrollmentList.load(certs.enrollment, pin_fingerprints=False).matches("client-0", other)
    assert pinned.with_client("client-0", None).matches("client-0", other)


# --------------------------------------------------------------------------- peer identity


class FakeContext:
    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self._auth = auth

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth


@pytest.mark.parametrize(
    ("auth", "expected"),
    [
        ({}, None),
        ({"transport_security_type": [b"insecure"], "x509_common_name": [b"client-0"]}, None),
        ({"transport_security_type": [b"ssl"]}, None),
        ({"transport_security_type": [b"ssl"], "x509_common_name": [b"client-3"]}, "client-3"),
    ],
)
def test_peer_client_id_from_auth_context(
    auth: dict[str, list[bytes]], expected: str | None
) -> None:
    assert peer_client_id(FakeContext(auth)) == expected


def test_warn_insecure_is_loud(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), pytest.warns(InsecureTransportWarning) as record:
        warn_insecure("the test client")

    assert "plaintext" in str(record[0].message) and "identities" in str(record[0].message)
    assert record[0].filename == __file__  # stacklevel=2 points at the caller
    assert any("INSECURE: the test client" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- mutual TLS


def test_mutual_tls_call_sees_the_client_id(certs: CertificateSet, server: Server) -> None:
    target = f"127.0.0.1:{server.port}"
    with grpc.secure_channel(target, channel_credentials(certs.directory, "client-1")) as ch:
        grpc.channel_ready_future(ch).result(timeout=TIMEOUT_S)

    assert call(server.port, channel_credentials(certs.directory, "client-1")) == b"client-1"
    assert call(server.port, channel_credentials(certs.directory, "client-0")) == b"client-0"
    assert server.reached == ["client-1", "client-0"]


def test_mutual_tls_with_rsa_keys(tmp_path: Path) -> None:
    made = init_certificates(tmp_path, clients=1, key_type="rsa-2048")

    with serve(tmp_path, EnrollmentList.load(made.enrollment)) as state:
        assert call(state.port, channel_credentials(tmp_path, "client-0")) == b"client-0"


def _foreign_ca(ca: CertifiedKey) -> CertifiedKey:
    return make_certificate("client", "client-0", issuer=make_certificate("ca", "foreign CA"))


def _expired(ca: CertifiedKey) -> CertifiedKey:
    start, end = NOW - dt.timedelta(days=30), NOW - dt.timedelta(days=1)
    return make_certificate("client", "client-0", issuer=ca, not_before=start, not_after=end)


def _server_auth_only(ca: CertifiedKey) -> CertifiedKey:
    return make_certificate("server", "client-0", issuer=ca, hosts=["localhost"])


HANDSHAKE_REFUSALS: dict[str, Callable[[CertifiedKey], CertifiedKey | None]] = {
    "foreign-ca": _foreign_ca,
    "expired": _expired,
    "server-eku-only": _server_auth_only,
    "no-client-certificate": lambda ca: None,
}


@pytest.mark.parametrize("case", HANDSHAKE_REFUSALS)
def test_handshake_refusals_never_reach_the_handler(
    certs: CertificateSet, ca: CertifiedKey, server: Server, case: str
) -> None:
    bad = raw_credentials(server.ca_pem, HANDSHAKE_REFUSALS[case](ca))

    error = call_refused(server.port, bad)
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # TLS handshake failed on the server
    assert server.reached == []
    assert call(server.port, channel_credentials(certs.directory, "client-0")) == b"client-0"


def test_plaintext_client_is_refused(certs: CertificateSet, server: Server) -> None:
    error = call_refused(server.port, None)

    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert server.reached == []
    assert call(server.port, channel_credentials(certs.directory, "client-1")) == b"client-1"


def test_valid_but_unenrolled_client_is_denied(
    certs: CertificateSet, ca: CertifiedKey, server: Server
) -> None:
    stranger = make_certificate("client", "client-9", issuer=ca)

    error = call_refused(server.port, raw_credentials(server.ca_pem, stranger))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'client-9' is not enrolled" in error.details()
    assert server.reached == ["client-9"]
    assert call(server.port, channel_credentials(certs.directory, "client-0")) == b"client-0"


def test_reissued_certificate_for_an_enrolled_id_is_denied_by_pinning(
    certs: CertificateSet, ca: CertifiedKey, server: Server
) -> None:
    impostor = make_certificate("client", "client-0", issuer=ca)  # same CN, other key

    error = call_refused(server.port, raw_credentials(server.ca_pem, impostor))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "fingerprint" in error.details()
    assert call(server.port, channel_credentials(certs.directory, "client-0")) == b"client-0"


def test_plaintext_server_yields_unauthenticated(certs: CertificateSet) -> None:
    with serve(certs.directory, EnrollmentList.load(certs.enrollment), secure=False) as state:
        error = call_refused(state.port, None)

    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert state.reached == [None]
