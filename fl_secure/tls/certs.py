"""One certificate: create it with the extensions of its role, load it back and check it."""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fl_secure.errors import TlsError
from fl_secure.tls.layout import INIT_HINT, StagedFiles, read_bytes

KeyType = Literal["ec-p256", "ec-p384", "rsa-2048", "rsa-3072"]
Role = Literal["ca", "server", "client"]
PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
PublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey

CLIENT_URI_PREFIX = "urn:fl-secure:client:"
CLOCK_SKEW = dt.timedelta(minutes=5)
MAX_DAYS = 36_500  # a century; far beyond it the end date overflows datetime (year 9999)
_DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


@dataclass(frozen=True)
class CertifiedKey:
    """A certificate and its private key."""

    certificate: x509.Certificate
    private_key: PrivateKey

    @property
    def cert_pem(self) -> bytes:
        """The certificate as PEM."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM (gRPC cannot read encrypted keys)."""
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def write(self, cert_path: Path, key_path: Path) -> None:
        """Write the key (mode 0600) and the certificate (mode 0644): both, or neither."""
        with StagedFiles() as files:
            self.stage(files, cert_path, key_path)

    def stage(self, files: StagedFiles, cert_path: Path, key_path: Path) -> None:
        """Add the key (mode 0600) and the certificate (mode 0644) to ``files``."""
        files.write(key_path, self.key_pem, mode=0o600)
        files.write(cert_path, self.cert_pem, mode=0o644)


def make_certificate(
    role: Role,
    common_name: str,
    *,
    issuer: CertifiedKey | None = None,
    hosts: Sequence[str] = (),
    days: int = 365,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    key_type: KeyType = "ec-p256",
) -> CertifiedKey:
    """Create a new key pair and a certificate for it.

    Args:
        role: ``"ca"`` (BasicConstraints ca=True, KeyUsage keyCertSign + cRLSign), ``"server"``
            (SAN from ``hosts``, EKU serverAuth) or ``"client"`` (SAN URI
            ``urn:fl-secure:client:<common_name>``, EKU clientAuth).
        common_name: subject CN (at most 64 characters); for a client, its id.
        issuer: the signing CA; None makes a self-signed certificate (normal only for a CA).
        hosts: DNS names and IP addresses of a server certificate.
        days: validity counted from now when ``not_after`` is not given.
        not_before: start of validity; defaults to now minus 5 minutes for clock skew, or to
            ``not_after - days`` when that is earlier.
        not_after: end of validity; may be in the past (tests use it for expired certificates).
        key_type: algorithm of the new key.

    Returns:
        The certificate with its new private key.
    """
    check_days(days)
    if role == "server" and not hosts:
        raise TlsError("a server certificate needs hosts: the DNS names / IPs clients dial")
    now = dt.datetime.now(dt.UTC)
    not_after = not_after or now + dt.timedelta(days=days)
    if not_before is None:  # a not_after in the past (a test's expired cert) moves the start too
        not_before = min(now - CLOCK_SKEW, not_after - dt.timedelta(days=days))
    if not_before >= not_after:
        raise TlsError(f"not_before {not_before} must be earlier than not_after {not_after}")
    key = generate_key(key_type)
    certificate = issue_certificate(
        role,
        common_name,
        key.public_key(),
        issuer=issuer,
        self_signing_key=key,
        hosts=hosts,
        not_before=not_before,
        not_after=not_after,
    )
    return CertifiedKey(certificate, key)


def issue_certificate(
    role: Role,
    common_name: str,
    public_key: PublicKey,
    *,
    issuer: CertifiedKey | None,
    not_before: dt.datetime,
    not_after: dt.datetime,
    hosts: Sequence[str] = (),
    self_signing_key: PrivateKey | None = None,
) -> x509.Certificate:
    """A certificate of ``role`` for ``public_key``, signed by ``issuer``.

    ``certs sign`` calls it with the public key of a site's request: the site's private key
    never reaches the CA. The extensions are the role's own (those a request asks for are
    ignored). ``self_signing_key`` signs a CA's own certificate when ``issuer`` is None.
    """
    if role == "server" and not hosts:
        raise TlsError("a server certificate needs hosts: the DNS names / IPs clients dial")
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.certificate.subject if issuer else subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), False)
    )
    if issuer is not None:
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.private_key.public_key())
        builder = builder.add_extension(aki, critical=False)
    for extension, critical in _role_extensions(role, common_name, hosts, public_key):
        builder = builder.add_extension(extension, critical=critical)
    signing_key = issuer.private_key if issuer else self_signing_key
    if signing_key is None:
        raise TlsError("a certificate needs an issuer (or its own key, for a CA)")
    return builder.sign(signing_key, hashes.SHA256())


def check_days(days: int) -> None:
    """Raise TlsError unless ``days`` is a validity from 1 to ``MAX_DAYS`` days."""
    if not 1 <= days <= MAX_DAYS:
        raise TlsError(f"days must be from 1 to {MAX_DAYS} (100 years), got {days}")


def load_certified_key(cert_path: Path, key_path: Path) -> CertifiedKey:
    """Load a PEM certificate and its key.

    Raises:
        TlsError: a file is missing or unparsable, the key does not belong to the certificate,
            or the certificate is not valid now (expired, or the clock is wrong).
    """
    cert_pem = read_bytes(cert_path, "certificate")
    key_pem = read_bytes(key_path, "private key")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(f"cannot parse {cert_path} / {key_path}: {exc}; {INIT_HINT}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise TlsError(f"{key_path} holds a {type(key).__name__}; use an EC or RSA key")
    if _spki(key) != _spki_of(cert):
        raise TlsError(f"{key_path} is not the private key of {cert_path}; re-issue the pair")
    now = dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise TlsError(
            f"{cert_path} is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC (now {now:%Y-%m-%d %H:%M}); check "
            "the clock or re-issue the certificate"
        )
    return CertifiedKey(cert, key)


def load_ca_certificates(path: Path) -> list[x509.Certificate]:
    """The certificates of a ``ca.pem`` (one CA, or a bundle), each checked to be a CA.

    Raises:
        TlsError: the file is missing, holds no readable PEM certificate, or holds one that
            is not a CA certificate (BasicConstraints ca=True).
    """
    pem = read_bytes(path, "CA certificate")
    try:
        cas = x509.load_pem_x509_certificates(pem)
        not_ca = [c for c in cas if not _is_ca(c)]
    except ValueError as exc:
        raise TlsError(f"{path} is not a readable PEM CA certificate ({exc}); {INIT_HINT}") from exc
    if not_ca:
        raise TlsError(
            f"{path} holds a certificate that is not a CA ({not_ca[0].subject.rfc4514_string()}):"
            " give the ca.pem written by `fl-secure certs init`, not a server or client "
            "certificate"
        )
    return cas


def check_issued_by(
    cert: x509.Certificate, cert_path: Path, cas: Sequence[x509.Certificate], ca_path: Path
) -> None:
    """Raise TlsError unless one of ``cas`` signed ``cert`` (the peer would refuse it)."""
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return
        except (ValueError, TypeError, InvalidSignature):
            continue
    raise TlsError(
        f"{cert_path} was not issued by the CA in {ca_path}, so the other side would refuse "
        "the TLS handshake; use ca.pem and the certificate from the same `fl-secure certs init`"
    )


def _is_ca(cert: x509.Certificate) -> bool:
    """Whether ``cert`` has BasicConstraints ca=True."""
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def _role_extensions(
    role: Role, common_name: str, hosts: Sequence[str], key: PublicKey
) -> Iterator[tuple[x509.ExtensionType, bool]]:
    """Yield (extension, critical) pairs for ``role``."""
    is_ca = role == "ca"
    yield x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None), True
    key_usage = x509.KeyUsage(
        digital_signature=not is_ca,
        content_commitment=False,
        key_encipherment=not is_ca and isinstance(key, rsa.RSAPublicKey),
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=is_ca,
        crl_sign=is_ca,
        encipher_only=False,
        decipher_only=False,
    )
    yield key_usage, True
    if role == "server":
        yield x509.SubjectAlternativeName([_general_name(h) for h in hosts]), False
        yield x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False
    elif role == "client":
        uri = x509.UniformResourceIdentifier(CLIENT_URI_PREFIX + common_name)
        yield x509.SubjectAlternativeName([uri]), False
        yield x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False


def _general_name(host: str) -> x509.GeneralName:
    """An IP address SAN for an address, a DNS SAN for a name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.removeprefix("*.").split(".")  # a wildcard only as the whole first label
    if "" in labels:
        reason = "a DNS name has no empty label (no leading, trailing or doubled dot)"
    elif not all(_DNS_LABEL.fullmatch(label) for label in labels) or len(host) > 253:
        reason = (
            "give an ASCII DNS name of at most 253 characters, in labels of 1-63 letters, "
            "digits and inner hyphens, or an IP address"
        )
    elif labels[-1].isdigit():  # 10.0.0.300, 1.2.3, 1234: a resolver may read it as an IP
        reason = "not a valid IP address, and a DNS name does not end in a numeric label"
    else:
        return x509.DNSName(host)
    raise TlsError(f"invalid host {host!r}: {reason}")


def generate_key(key_type: KeyType) -> PrivateKey:
    """A fresh private key from the OpenSSL CSPRNG."""
    match key_type:
        case "ec-p256":
            return ec.generate_private_key(ec.SECP256R1())
        case "ec-p384":
            return ec.generate_private_key(ec.SECP384R1())
        case "rsa-2048":
            return rsa.generate_private_key(public_exponent=65537, key_size=2048)
        case "rsa-3072":
            return rsa.generate_private_key(public_exponent=65537, key_size=3072)
    raise TlsError(f"unknown key_type {key_type!r}; use ec-p256, ec-p384, rsa-2048 or rsa-3072")


def _spki(key: PrivateKey) -> bytes:
    """DER SubjectPublicKeyInfo of a private key's public half."""
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _spki_of(cert: x509.Certificate) -> bytes:
    """DER SubjectPublicKeyInfo of a certificate."""
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
