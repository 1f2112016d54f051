"""The server's signed ledger heads a site saw: an anchor of the run ledger outside the run.

Each training task of a DP run carries the server's signed ledger head
(:mod:`privacy.ledger.signed_head`). The site checks it before it trains, and keeps it in its
state folder (``ledger-heads-<run digest>.json``, next to its site ledger)::

    {"version": 1, "run_id": "...", "heads": [{signed head}, ...]}

A head is refused (the site does not train) when its signature does not verify, it names
another run, it is signed by a key other than the one the site saw first in this run, or it
covers fewer entries than a head the site saw before, or as many with another hash: the
server's ledger lost entries or was rewritten since. The heads kept let an auditor check the
run ledger against what the sites were shown (``fl-secure privacy ledger --verify --site``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fl_secure.errors import PrivacyError
from fl_secure.runs import atomic_write_json, run_keyed_path
from privacy.ledger.entries import LedgerError
from privacy.ledger.signed_head import SignedHead

STEM, SUFFIX = "ledger-heads", ".json"


def heads_path(state_dir: Path, run_id: str) -> Path:
    """Where a site keeps the heads of run ``run_id``."""
    return run_keyed_path(Path(state_dir), STEM, SUFFIX, run_id)


class SiteHeads:
    """The heads a site saw in one run (kept in ``state_dir``; in memory without one)."""

    def __init__(self, state_dir: Path | None, run_id: str) -> None:
        self.run_id = run_id
        self.path = heads_path(state_dir, run_id) if state_dir is not None else None
        self.heads: list[SignedHead] = self._load()

    def _load(self) -> list[SignedHead]:
        if self.path is None or not self.path.exists():
            return []
        try:
            doc: Any = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(doc, dict) or doc.get("run_id") != self.run_id:
                raise LedgerError("not this run's heads")
            return [SignedHead.from_dict(h, str(self.path)) for h in doc["heads"]]
        except (OSError, ValueError, KeyError, TypeError, LedgerError) as exc:
            raise PrivacyError(
                f"{self.path} (the server's ledger heads this site saw) is damaged ({exc}); "
                "restore it from a backup"
            ) from exc

    def accept(self, raw: bytes, round_: int) -> SignedHead | None:
        """Check the head a training task of round ``round_`` carries; keep it if it is new.

        Returns:
            The head, or None when the task carries none and the site has seen none.

        Raises:
            PrivacyError: Naming why the head is refused (the site must not train).
        """
        where = f"round {round_}: the server's ledger head"
        if not raw:
            if self.heads:
                raise PrivacyError(f"{where} is missing, though earlier tasks of this run had one")
            return None
        try:
            signed = SignedHead.from_dict(json.loads(raw.decode("utf-8")), where)
        except (ValueError, LedgerError) as exc:
            raise PrivacyError(f"{where} is malformed: {exc}") from exc
        if not signed.signature_ok():
            raise PrivacyError(f"{where}: its signature does not verify")
        if signed.run_id != self.run_id:
            raise PrivacyError(f"{where} is of run {signed.run_id!r}, not {self.run_id!r}")
        if self.heads:
            first, last = self.heads[0], self.heads[-1]
            if signed.public_key != first.public_key:
                raise PrivacyError(
                    f"{where} is signed by key {signed.public_key[:16]}, not the server's "
                    f"{first.public_key[:16]} this site saw first"
                )
            if signed.entries < last.entries:
                raise PrivacyError(
                    f"{where} covers {signed.entries} entries, but this site saw "
                    f"{last.entries} before: the ledger lost entries since"
                )
            if signed.entries == last.entries and signed.head != last.head:
                raise PrivacyError(
                    f"{where} has another hash at entry {signed.entries} than this site saw "
                    "before: the ledger was rewritten"
                )
            if signed.entries == last.entries:
                return signed
        self.heads.append(signed)
        if self.path is not None:
            doc = {"version": 1, "run_id": self.run_id, "heads": [h.to_dict() for h in self.heads]}
            atomic_write_json(self.path, doc)
        return signed

    def latest(self) -> SignedHead | None:
        """The newest head kept (None: none)."""
        return self.heads[-1] if self.heads else None
