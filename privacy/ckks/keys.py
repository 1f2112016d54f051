"""The CKKS contexts of a certificate folder: written once, read by the clients and the server.

The clients' secret context (``SITE/ckks/clients.secret``) goes to the sites' folders only,
never through the server; the server's folder holds only ``SERVER/ckks/server.public``
(:func:`distribute_ckks_keys` on the folder ``fl-secure certs init`` wrote).
"""

from __future__ import annotations

from pathlib import Path

import tenseal as ts

from fl_secure.errors import PrivacyError
from fl_secure.tls.layout import CertificateSet, StagedFiles, is_layout_root, server_bundle
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
    if is_layout_root(Path(cert_dir)):
        raise PrivacyError(
            f"{cert_dir} is a whole certificate set: use distribute_ckks_keys, which keeps the "
            "secret out of the server's folder"
        )
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


def distribute_ckks_keys(
    cert_dir: Path, params: CkksParams | None = None, *, overwrite: bool = False
) -> tuple[list[Path], Path]:
    """A fresh CKKS key: the secret into every site folder, the key-less context to the server.

    ``cert_dir`` is the folder ``init_certificates`` wrote: each ``sites/<id>/ckks/`` gets
    ``clients.secret`` (0600), ``server/ckks/`` gets ``server.public``; the server's folder never
    holds the secret. All files are written, or none; existing ones are replaced only with
    ``overwrite`` (sites holding the old key could not decrypt).

    Returns:
        The sites' secret contexts and the server's public context.

    Raises:
        PrivacyError: ``cert_dir`` is not such a folder (or has no site), or the contexts
            exist without ``overwrite``.
    """
    paths = CertificateSet(Path(cert_dir))
    sites = [paths.site_dir(c) for c in paths.site_ids()]
    if not is_layout_root(paths.directory) or not sites:
        raise PrivacyError(
            f"{cert_dir} is not a certificate folder with sites/<id>/ (made by `fl-secure "
            "certs init`); give that folder"
        )
    secrets = [secret_context_path(s) for s in sites]
    public_path = public_context_path(paths.server_dir)
    existing = [p for p in (*secrets, public_path) if p.exists()]
    if existing and not overwrite:
        raise PrivacyError(
            f"{existing[0]} already exists; pass --overwrite to replace the CKKS contexts "
            "(clients holding the old key could no longer decrypt)"
        )
    secret = make_secret_context(params)
    with StagedFiles() as files:
        for path in secrets:
            files.write(path, secret, mode=0o600)
        files.write(public_path, public_context(secret), mode=0o644)
    return secrets, public_path


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PrivacyError(
            f"{what} {path} does not exist; the operator creates the CKKS contexts with "
            "`fl-secure certs ckks --out DIR` (DIR: the folder `certs init` wrote), and a site "
            "gets its clients.secret over a channel that bypasses the server"
        ) from None


def load_secret_context(cert_dir: Path) -> bytes:
    """The clients' secret context from a certificate folder."""
    return _read(secret_context_path(cert_dir), "the clients' CKKS secret context")


def load_public_context(cert_dir: Path) -> bytes:
    """The server's public context (refused if it holds the secret key).

    ``cert_dir`` is the server's folder (``server/`` of a whole set).
    """
    cert_dir = server_bundle(cert_dir)
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
