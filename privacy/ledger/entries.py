"""The rows of a run's privacy ledger: their kinds, payloads and hash chain.

One row per privacy-relevant event: the client-level guarantee after each round
(``client_level``), each client's example-level guarantee (``example_level``), a client-level
release the server saw in an attempt it then discarded (``discarded_sum``: a sum it unmasked
and could not decode, or the plain updates of a failed attempt; composed like a round) and
free-text events such as a budget stop (``note``).

Each row is chained to its predecessor (a hash chain, as in Haber & Stornetta, "How to
time-stamp a digital document", J. Cryptology 3(2), 1991)::

    hash = SHA-256(prev_hash || canonical_json([seq, kind, round, party, payload, created_at]))

and the first row's ``prev_hash`` is ``SHA-256(run_id)`` (:func:`genesis_hash`), so entries
cannot be moved between runs.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, get_args

from fl_secure.errors import CheckpointError

FORMAT_VERSION = 1

Kind = Literal["client_level", "example_level", "discarded_sum", "note"]
KINDS: tuple[str, ...] = get_args(Kind)
JsonValue: TypeAlias = "None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]"

# Required payload keys per kind -> (value type, lowest, highest). Other keys are free.
_Spec = tuple[Literal["number", "int", "str"], float, float]
_ANY: _Spec = ("number", 0.0, math.inf)
_PROB: _Spec = ("number", 0.0, 1.0)
REQUIRED: dict[str, dict[str, _Spec]] = {
    "client_level": {
        "noise_multiplier": _ANY,
        "sample_rate": _PROB,
        "clip_norm": _ANY,
        "cohort_size": ("int", 0, math.inf),
        "accountant": ("str", 0, 0),
        "epsilon": _ANY,  # cumulative epsilon of the run after this round
        "delta": _PROB,
        "noise_placement": ("str", 0, 0),
    },
    "example_level": {
        "epsilon": _ANY,  # this client's cumulative epsilon after this round
        "delta": _PROB,
        "accountant": ("str", 0, 0),
        "steps": ("int", 0, math.inf),
        "noise_multiplier": _ANY,
        "sample_rate": _PROB,
    },
    "note": {"message": ("str", 0, 0)},
}
# A client-level release the server saw in an attempt it then discarded (a sum it could not
# decode; the plain updates of a failed attempt): composed like a round.
REQUIRED["discarded_sum"] = {**REQUIRED["client_level"], "message": ("str", 0, 0)}
#: Kinds whose payload carries the run's cumulative client-level epsilon.
CLIENT_KINDS = ("client_level", "discarded_sum")


class LedgerError(CheckpointError):
    """The privacy ledger cannot be opened or written, or an entry is invalid."""


def canonical_json(value: Any) -> str:
    """Canonical JSON text: sorted keys, no spaces, no NaN or infinity."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def genesis_hash(run_id: str) -> str:
    """The ``prev_hash`` of a run's first entry: SHA-256 of the run id."""
    return hashlib.sha256(run_id.encode("utf-8")).hexdigest()


def chain_hash(
    prev_hash: str,
    seq: int,
    kind: str,
    round: int,
    party: str,
    payload: Mapping[str, JsonValue],
    created_at: str,
) -> str:
    """Hash of one entry: SHA-256 of ``prev_hash`` then the canonical JSON of its fields."""
    body = canonical_json([seq, kind, round, party, dict(payload), created_at])
    return hashlib.sha256((prev_hash + body).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One committed ledger row."""

    seq: int
    kind: str
    round: int
    party: str
    payload: dict[str, JsonValue]
    created_at: str
    prev_hash: str
    hash: str

    def to_dict(self) -> dict[str, JsonValue]:
        """Plain JSON-ready form."""
        return {
            "seq": self.seq,
            "kind": self.kind,
            "round": self.round,
            "party": self.party,
            "payload": self.payload,
            "created_at": self.created_at,
            "prev_hash": self.prev_hash,
            "hash": self.hash,
        }


def check_payload(kind: str, payload: Mapping[str, Any]) -> None:
    """Raise :class:`LedgerError` unless ``payload`` has the keys and values ``kind`` needs."""
    if kind not in REQUIRED:
        raise LedgerError(f"unknown ledger kind {kind!r}; allowed: {', '.join(map(repr, KINDS))}")
    spec = REQUIRED[kind]
    for key, (expected, low, high) in spec.items():
        if key not in payload:
            raise LedgerError(
                f"{kind} payload is missing required key {key!r} (required: {', '.join(spec)})"
            )
        value = payload[key]
        where = f"{kind} payload key {key!r} = {value!r}"
        if expected == "str":
            if not isinstance(value, str) or not value:
                raise LedgerError(f"{where}: expected a non-empty string")
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise LedgerError(
                f"{where}: expected {'an integer' if expected == 'int' else 'a number'}"
            )
        if expected == "int" and not isinstance(value, int):
            raise LedgerError(f"{where}: expected an integer")
        if not (math.isfinite(value) and low <= value <= high):
            raise LedgerError(f"{where}: expected a finite value in [{low:g}, {high:g}]")
