"""The newest signing-key registry a site has accepted: an older one is refused.

``certs issue --overwrite`` revokes a site's old signing key by re-signing the registry
without it; the old registry and its signature still verify against ``ca.pem``. A site
therefore keeps, per CA, the version and SHA-256 of the newest registry it accepted, in
``registry_seen.json`` (written atomically, so it survives restarts and crashes), and refuses
a registry of a lower version, or one of the same version with other contents.

The file::

    {"format": 1, "registries": {"<CA certificate SHA-256>":
        {"version": 3, "sha256": "<registry file SHA-256>", "issued": "2026-11-28T00:40:12Z"}}}
"""

from __future__ import annotations

import json
from pathlib import Path

from fl_secure.errors import JSON_DOCUMENT_ERRORS, TlsError
from fl_secure.tls.layout import CLIENTS_DIR, read_bytes, validate_client_id, write_atomic
from fl_secure.tls.registry import REGISTRY_FILE, REGISTRY_SIGNATURE, SignedRegistry

SEEN_FILE = "registry_seen.json"


class RegistryRollbackError(TlsError):
    """A registry older than (or forked from) the newest one this site accepted."""


def seen_path(state_dir: Path | None, cert_dir: Path, client_id: str) -> Path:
    """Where a site keeps its record: its state folder, else next to its keys in ``clients/``."""
    if state_dir is not None:
        return Path(state_dir) / SEEN_FILE
    return Path(cert_dir) / CLIENTS_DIR / f"{validate_client_id(client_id)}.{SEEN_FILE}"


class RegistrySeen:
    """A site's record of the newest registry it accepted, per CA (see the module docstring).

    Args:
        path: The record's file (:func:`seen_path`), or None to keep it in memory only.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._memory: dict[str, dict[str, object]] = {}

    def held(self) -> dict[str, dict[str, object]]:
        """CA SHA-256 -> {"version", "sha256", "issued"} of the newest registry accepted.

        Raises:
            TlsError: the file exists but is damaged (it is left as it is).
        """
        if self.path is None or not self.path.exists():
            return dict(self._memory)
        raw = read_bytes(self.path, "record of the signing-key registry seen")
        try:
            doc = json.loads(raw)
            entries = {str(k): dict(v) for k, v in doc["registries"].items()}
            for entry in entries.values():
                version = entry["version"]
                if isinstance(version, bool) or not isinstance(version, int):
                    raise TypeError(f"version {version!r} is not an integer")
                str(entry["sha256"])
        except JSON_DOCUMENT_ERRORS as exc:
            raise TlsError(
                f"{self.path} is damaged ({exc!r}); it holds the newest signing-key registry "
                "this site accepted, and without it an older registry could be accepted again. "
                "Restore it from a backup, or delete it only after checking signing_keys.json "
                "is the one the operator issued last"
            ) from exc
        return entries

    def accept(self, registry: SignedRegistry, where: Path) -> None:
        """Refuse ``registry`` (read from folder ``where``) if older than the one held; record it.

        Raises:
            RegistryRollbackError: its version is lower than the version accepted before under
                the same CA, or equal to it with other contents.
            TlsError: the record cannot be read or written.
        """
        entries = self.held()
        held = entries.get(registry.ca_sha256)
        if held is not None:
            version = int(str(held["version"]))
            file = Path(where) / REGISTRY_FILE
            if registry.version < version:
                raise RegistryRollbackError(
                    f"{file} is version {registry.version} (issued {registry.issued}), older "
                    f"than version {version} (issued {held.get('issued')}) this site accepted "
                    "before: an old registry can still list a revoked site's signing key; "
                    f"refusing it. Copy signing_keys.json and {REGISTRY_SIGNATURE} issued last "
                    "from the operator"
                )
            if registry.version == version:
                if registry.sha256 != held["sha256"]:
                    raise RegistryRollbackError(
                        f"{file} is version {registry.version} but not the version {version} "
                        f"this site accepted before (SHA-256 {registry.sha256[:16]}... vs "
                        f"{str(held['sha256'])[:16]}...): two registries under one version; "
                        "refusing it. Ask the operator which one was issued last"
                    )
                return
        entries[registry.ca_sha256] = {
            "version": registry.version,
            "sha256": registry.sha256,
            "issued": registry.issued,
        }
        self._memory = entries
        if self.path is not None:
            text = json.dumps({"format": 1, "registries": entries}, indent=2, sort_keys=True)
            try:
                write_atomic(self.path, (text + "\n").encode(), mode=0o644)
            except TlsError as exc:
                raise TlsError(
                    f"{exc}: the site records there the newest signing-key registry it accepted;"
                    " give the client a writable --state-dir"
                ) from exc
