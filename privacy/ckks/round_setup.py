"""The setup of one CKKS round, and a client's check that it is the run config's."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from fl_secure.config import Config
from fl_secure.errors import JSON_DOCUMENT_ERRORS, PrivacyError, ProtocolError

#: Name of the single tensor a CKKS upload carries (the serialized encrypted update).
CKKS_TENSOR = "ckks.update"
_SETUP_KEYS = {"version", "scheme", "round_id", "cohort", "layers", "min_count", "decryptors"}


@dataclass(frozen=True)
class CkksSetup:
    """What every cohort member needs for a CKKS round."""

    round_id: bytes
    cohort: tuple[str, ...]
    layers: tuple[str, ...] | None  # encrypted layers; None = all shared layers
    min_count: int  # a decryptor refuses to open a sum of fewer updates
    decryptors: int = 2

    def to_bytes(self) -> bytes:
        """Canonical JSON (version 1, ``scheme = "ckks"``)."""
        doc = {
            "version": 1,
            "scheme": "ckks",
            "round_id": self.round_id.hex(),
            "cohort": list(self.cohort),
            "layers": None if self.layers is None else list(self.layers),
            "min_count": self.min_count,
            "decryptors": self.decryptors,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> CkksSetup:
        """Strict inverse of :meth:`to_bytes`."""
        try:
            doc = json.loads(data)
            if set(doc) != _SETUP_KEYS or doc["version"] != 1 or doc["scheme"] != "ckks":
                raise ValueError(f"keys {sorted(doc)}")
            layers = doc["layers"]
            setup = cls(
                round_id=bytes.fromhex(doc["round_id"]),
                cohort=tuple(str(c) for c in doc["cohort"]),
                layers=None if layers is None else tuple(str(x) for x in layers),
                min_count=int(doc["min_count"]),
                decryptors=int(doc["decryptors"]),
            )
        except JSON_DOCUMENT_ERRORS as exc:
            raise ProtocolError(f"invalid CKKS round setup: {exc}") from exc
        if setup.min_count < 1 or not 1 <= setup.decryptors <= 2:
            raise ProtocolError("invalid CKKS round setup: min_count or decryptors")
        return setup


def is_ckks_setup(data: bytes) -> bool:
    """Whether a task's ``secagg_setup`` describes a CKKS round (vs pairwise masks)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("scheme") == "ckks"


def check_ckks_setup(setup: CkksSetup, config: Config, shared_names: Sequence[str]) -> None:
    """Refuse a CKKS round setup weaker than the run config this client joined under.

    The encrypted layers must be those ``secure_aggregation.ckks_layers`` selects (a setup
    naming fewer would send the others in the clear), and a decryptor must refuse sums of
    fewer than ``server.min_clients`` updates.

    Raises:
        ProtocolError: naming what differs.
    """
    expected = shared_layers(shared_names, config.secure_aggregation.ckks_layers)
    problems = []
    if setup.layers != expected:
        problems.append(
            f"encrypted layers {'all' if setup.layers is None else list(setup.layers)} (the "
            f"run config gives {'all' if expected is None else list(expected)})"
        )
    if setup.min_count < config.server.min_clients:
        problems.append(f"min_count {setup.min_count} < server.min_clients "
                        f"{config.server.min_clients}")  # fmt: skip
    if problems:
        raise ProtocolError(
            "refusing a CKKS setup weaker than the run this client joined: " + "; ".join(problems)
        )


def shared_layers(names: Sequence[str], prefixes: Sequence[str]) -> tuple[str, ...] | None:
    """The layers to encrypt: those starting with one of ``prefixes`` (all if none given)."""
    if not prefixes:
        return None
    chosen = tuple(n for n in names if any(n.startswith(p) for p in prefixes))
    if not chosen:
        raise PrivacyError(
            f"secure_aggregation.ckks_layers {list(prefixes)} matches none of the shared "
            f"layers (first: {list(names[:3])})"
        )
    return chosen
