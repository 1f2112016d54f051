"""The server's enrollment list: which client ids may connect, pinned to which certificate."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from fl_secure.errors import JSON_DOCUMENT_ERRORS, TlsError
from fl_secure.tls.layout import read_bytes, validate_client_id, write_atomic


def certificate_fingerprint(cert: x509.Certificate | bytes) -> str:
    """Lowercase hex SHA-256 of the DER encoding of a certificate (object or PEM bytes)."""
    if isinstance(cert, bytes):
        try:
            cert = x509.load_pem_x509_certificate(cert)
        except ValueError as exc:
            raise TlsError(f"not a PEM certificate: {exc}") from exc
    return cert.fingerprint(hashes.SHA256()).hex()


@dataclass(frozen=True)
class EnrollmentList:
    """Client ids the server accepts, each optionally pinned to a certificate fingerprint.

    Attributes:
        fingerprints: client id -> lowercase hex SHA-256 of its DER certificate, or None when
            the id is enrolled without pinning.
        pin_fingerprints: when True, a peer whose id has a fingerprint must present exactly that
            certificate, so re-issuing a client's certificate revokes the previous one.
    """

    fingerprints: Mapping[str, str | None]
    pin_fingerprints: bool = True

    @classmethod
    def load(cls, path: Path, *, pin_fingerprints: bool = True) -> EnrollmentList:
        """Read ``enrolled.json``; raise TlsError when it is missing or malformed."""
        raw = read_bytes(path, "enrollment list")
        try:
            doc = json.loads(raw)
            entries = {str(c["id"]): c.get("sha256") for c in doc["clients"]}
            if not all(fp is None or isinstance(fp, str) for fp in entries.values()):
                raise TypeError("sha256 must be a hex string or null")
        except JSON_DOCUMENT_ERRORS as exc:
            raise TlsError(
                f"{path} is not a valid enrollment list ({exc!r}); expected "
                '{"clients": [{"id": "...", "sha256": "..."}]}; regenerate it with '
                "`fl-secure certs init` or fix it by hand"
            ) from exc
        for client_id in entries:
            validate_client_id(client_id)
        return cls(entries, pin_fingerprints=pin_fingerprints)

    def save(self, path: Path) -> None:
        """Write the list as ``enrolled.json`` (atomically)."""
        write_atomic(path, self.to_json(), mode=0o644)

    def to_json(self) -> bytes:
        """The contents of ``enrolled.json``, sorted by id."""
        clients = [{"id": i, "sha256": fp} for i, fp in sorted(self.fingerprints.items())]
        return (json.dumps({"version": 1, "clients": clients}, indent=2) + "\n").encode()

    def with_client(self, client_id: str, fingerprint: str | None) -> EnrollmentList:
        """Return a copy with ``client_id`` added, or its fingerprint replaced."""
        entries = dict(self.fingerprints)
        entries[validate_client_id(client_id)] = fingerprint
        return EnrollmentList(entries, pin_fingerprints=self.pin_fingerprints)

    def is_enrolled(self, client_id: str) -> bool:
        """Whether ``client_id`` is on the list."""
        return client_id in self.fingerprints

    def matches(self, client_id: str, cert_pem: bytes | None) -> bool:
        """Whether ``client_id`` is enrolled and, if pinned, ``cert_pem`` is its certificate."""
        if not self.is_enrolled(client_id):
            return False
        expected = self.fingerprints[client_id]
        if not self.pin_fingerprints or expected is None:
            return True
        if cert_pem is None:
            return False
        return certificate_fingerprint(cert_pem) == expected.lower().replace(":", "")
