"""Checking a ledger against its signed head and the copies of it kept elsewhere.

The anchors of a run's ledger (:mod:`privacy.ledger.signed_head`): ``ledger.head.json``,
rewritten and signed by the server after every commit; the copy in
``checkpoints/latest.json`` (the head when the last checkpoint was saved); the copy in
``summary.json`` (the head when the run ended); and the heads each site recorded when the
server sent it a task (its site ledger, outside the run folder). Each must carry a valid
signature by the same key (the server's, pinned by the verifier where it can be), name this
run, and be a prefix of the ledger: a copy that covers more entries than the ledger holds
shows a dropped tail, one whose hash differs from the ledger's row a rewritten chain.

What it does not catch alone: a forger who restores an old, genuinely signed
``ledger.head.json`` together with the ledger truncated to it, and rewrites every other copy
in the run folder to match. The sites' copies, outside the folder, catch that for every
head sent to a site after the dropped rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_secure.errors import CheckpointError, PrivacyError
from fl_secure.runs import read_json_object
from privacy.ledger.entries import Entry, LedgerError, genesis_hash
from privacy.ledger.signed_head import SignedHead, head_path, read_head
from privacy.ledger.site_heads import SiteHeads

#: Key of the signed head in a checkpoint's state and in summary.json's ``privacy``.
STATE_KEY = "ledger_signed_head"


@dataclass(frozen=True)
class Anchors:
    """The signed head file, the copies of it found elsewhere, and the key to check them by.

    Attributes:
        head: ``ledger.head.json`` (None: absent).
        copies: Where each copy was found -> the copy.
        pinned_key: The server's public key (hex) as the verifier knows it independently of
            the run folder (``ledger_signing.pub``), or None: the head file's key is used.
        problems: Copies that could not be read.
        where: How the head file is named in problems.
    """

    head: SignedHead | None
    copies: dict[str, SignedHead] = field(default_factory=dict)
    pinned_key: str | None = None
    problems: list[str] = field(default_factory=list)
    where: str = "ledger.head.json"


def copy_in(state: Mapping[str, Any] | None, where: str) -> tuple[SignedHead | None, str | None]:
    """The signed head stored under :data:`STATE_KEY` in ``state``, or a problem reading it."""
    if not isinstance(state, Mapping) or STATE_KEY not in state:
        return None, None
    try:
        return SignedHead.from_dict(state[STATE_KEY], where), None
    except LedgerError as exc:
        return None, str(exc)


def run_anchors(
    run: Path,
    ledger_path: Path,
    pinned_key: str | None = None,
    *,
    sites: Sequence[Path] = (),
    run_id: str = "",
) -> Anchors:
    """The anchors found in run folder ``run`` for its ledger at ``ledger_path``.

    ``sites``: state folders of sites (``--state-dir``), whose newest head seen in run
    ``run_id`` is checked too (:mod:`privacy.ledger.site_heads`).
    """
    problems: list[str] = []
    try:
        head = read_head(head_path(ledger_path))
    except LedgerError as exc:
        head, problems = None, [str(exc)]
    copies: dict[str, SignedHead] = {}
    sources: list[tuple[str, Path, str | None]] = [
        ("checkpoints/latest.json", run / "checkpoints" / "latest.json", None),
        ("summary.json", run / "summary.json", "privacy"),
    ]
    for name, path, section in sources:
        if not path.exists():
            continue
        try:
            value: Any = read_json_object(path, name)
        except CheckpointError as exc:
            problems.append(f"{name}: unreadable ({exc}); its copy of the head cannot be checked")
            continue
        found, problem = copy_in(value.get(section) if section else value, name)
        if found is not None:
            copies[name] = found
        if problem is not None:
            problems.append(problem)
    for site in sites:
        try:
            seen = SiteHeads(site, run_id).latest()
        except PrivacyError as exc:
            problems.append(str(exc))
            continue
        if seen is None:
            problems.append(f"site {site}: it kept no ledger head of run {run_id!r}")
        else:
            copies[f"site {site}"] = seen
    return Anchors(head, copies, pinned_key, problems)


def check_anchors(entries: Sequence[Entry], run_id: str, anchors: Anchors) -> tuple[list[str], int]:
    """Problems of ``entries`` against ``anchors``, and how many entries follow the signed head.

    Entries after the signed head are not flagged here: a server that stopped between a
    commit and its signature leaves them (resume checks and signs them; ``--verify`` says so).
    """
    problems = list(anchors.problems)
    head = anchors.head
    if head is None:
        if entries:
            problems.append(
                f"{anchors.where} is missing: the ledger's {len(entries)} entries carry no "
                "signed head, so a dropped tail or a rewritten chain cannot be ruled out"
            )
        key = anchors.pinned_key
    else:
        key = anchors.pinned_key or head.public_key
    named = ([(anchors.where, head)] if head is not None else []) + list(anchors.copies.items())
    for where, signed in named:
        problems += _check_one(where, signed, entries, run_id, key, pinned=bool(anchors.pinned_key))
    after = 0 if head is None else max(0, len(entries) - head.entries)
    if head is not None:
        for where, signed in anchors.copies.items():
            if signed.entries > head.entries:
                problems.append(
                    f"{where}: its signed head covers {signed.entries} entries, more than the "
                    f"{head.entries} of {anchors.where} (an older head file restored)"
                )
    return problems, after


def _check_one(
    where: str,
    signed: SignedHead,
    entries: Sequence[Entry],
    run_id: str,
    key: str | None,
    *,
    pinned: bool,
) -> list[str]:
    if key is not None and signed.public_key != key:
        whose = "the pinned server key" if pinned else "the key of ledger.head.json"
        return [
            f"{where}: the ledger head is signed by key {signed.public_key[:16]}, not "
            f"{whose} {key[:16]} (re-signed by someone else, or the server's "
            "ledger_signing.key replaced)"
        ]
    if not signed.signature_ok():
        return [f"{where}: the signature of the ledger head does not verify (head edited)"]
    if signed.run_id != run_id:
        return [f"{where}: the signed head is of run {signed.run_id!r}, not {run_id!r}"]
    if signed.entries > len(entries):
        n = len(entries)
        gone = f"entry {n + 1}" if signed.entries == n + 1 else f"entries {n + 1}..{signed.entries}"
        return [
            f"{where}: the server signed a ledger of {signed.entries} entries, but it holds "
            f"{n} ({gone} dropped from the end)"
        ]
    at = genesis_hash(run_id) if signed.entries == 0 else entries[signed.entries - 1].hash
    if at != signed.head:
        return [
            f"{where}: entry {signed.entries} has hash {at[:12]}, not the {signed.head[:12]} "
            "the server signed (the chain was rewritten)"
        ]
    return []
