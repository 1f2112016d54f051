"""The CKKS contexts of a certificate folder: written once, read by the clients and the server.

The clients' secret context (``CERTS/ckks/clients.secret``) is distributed with the
certificates, never through the server; the server holds only ``CERTS/ckks/server.public``.
"""

from __future__ import annotations

from pathlib import Path

import tenseal as ts

from fl_secure.errors import PrivacyError
from fl_secure.tls.layout import StagedFiles
from privacy.ckks.context import CkksParams, make_secret_context, public_context

#: Where the contexts live in a certificate folder.
CKKS_DIR, SECRET_FILE, PUBLIC_FILE = "ckks", "clients.secret", "server.public"


def secret_context_path(cert_dir: Path) -> Path:
    """The clients' context with the secret key (distribute to clients only)."""
    return cert_dir / CKKS_DIR / SECRET_FILE


def public_context_path(cert_dir: Path) -> Path:
    """The server's context: parameters only, no key."""
    return cert_dir / CKKS_DIR / PUBLIC_FILE


def write_ckks_keys(
    cert_dir: Path, params: CkksParams | None = None, *, overwrite: bool = False
) -> tuple[Path, Path]:
    """Generate a fresh CKKS secret key; write the clients' and the server's contexts.

    The secret context is written ``0600`` (like the clients' TLS keys). Refuses to replace
    existing files unless ``overwrite``: clients that kept the old key could not decrypt.
    Both files are written, or neither: a failed write (a full disk) cannot leave a new
    secret context beside the old public one, which would no longer match it.
    """
    secret_path, public_path = secret_context_path(cert_dir), public_context_path(cert_dir)
    if not overwrite and (secret_path.exists() or public_path.exists()):
        raise PrivacyError(
            f"CKKS contexts already exist in {cert_dir / CKKS_DIR}; pass --overwrite to replace "
            "them (clients holding the old key could no longer decrypt)"
        )
    secret = make_secret_context(params)
    with StagedFiles() as files:
        files.write(secret_path, secret, mode=0o600)
        files.write(public_path, public_context(secret), mode=0o644)
    return secret_path, public_path


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PrivacyError(
            f"{what} {path} does not exist; create the CKKS contexts with "
            f"`fl-secure certs ckks --out {path.parent.parent}`"
        ) from None


def load_secret_context(cert_dir: Path) -> bytes:
    """The clients' secret context from a certificate folder."""
    return _read(secret_context_path(cert_dir), "the clients' CKKS secret context")


def load_public_context(cert_dir: Path) -> bytes:
    """The server's public context (refused if it holds the secret key)."""
    data = _read(public_context_path(cert_dir), "the server's CKKS public context")
    try:
        ctx = ts.context_from(data)
    except Exception as exc:
        raise PrivacyError(f"{public_context_path(cert_dir)} is not a CKKS context: {exc}") from exc
    if ctx.has_secret_key() or ctx.is_private():
        raise PrivacyError(
            f"{public_context_path(cert_dir)} holds the secret key; the server must hold only "
            "the public context"
        )
    return data
