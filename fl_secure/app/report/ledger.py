"""The report's ledger section: ``ledger.sqlite`` verified, its epsilon per round, the model.

The privacy ledger is the record of what the run spent: its hash chain is verified (against
the head ``summary.json`` recorded, when it did), and its (epsilon, delta) is the statement's.
The released model's file and SHA-256 are checked against the model the ledger's rows name.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_secure.runs import RunDir
from privacy.ledger.anchors import run_anchors
from privacy.ledger.entries import CLIENT_KINDS
from privacy.ledger.guarantee import ledger_guarantee, released_model_of_run
from privacy.ledger.run_ledger import Ledger
from privacy.ledger.verification import recorded_head

if TYPE_CHECKING:
    from privacy.ledger.entries import Entry


def model_section(run: RunDir, entries: list[Entry]) -> dict[str, Any]:
    """The released model's file and SHA-256, checked against what the ledger names."""
    source = (
        "checkpoints/latest.json and the parameters file it names; ledger.sqlite "
        "(model_sha256 of that round's rows)"
    )
    model = {**released_model_of_run(run.path, entries), "source": source}
    named = [
        (e.round, str(e.payload["model_sha256"]))
        for e in entries
        if e.kind in ("client_level", "example_level") and "model_sha256" in e.payload
    ]
    if model["checkpoint"] is None and model["problem"] is None and named:
        round_, digest = max(named)  # the last model the ledger says the run released
        model["problem"] = (
            f"the released model is missing: the ledger's rows of round {round_} name a model "
            f"with SHA-256 {digest[:16]}, but the run has no checkpoint "
            "(checkpoints/latest.json is absent)"
        )
    return model


def ledger_section(path: Path, summary: dict[str, Any]) -> tuple[dict[str, Any], list[Entry]]:
    """The report's ledger section, and the ledger's entries (none without a ledger)."""
    recorded = recorded_head(summary)
    if not path.exists():
        spent = summary.get("epsilon")
        rounds = (summary.get("privacy") or {}).get("rounds_accounted")
        return {
            "present": False,
            "recorded_entries": None if recorded is None else recorded[0],
            # a summary from before ledger heads were recorded still states what was spent
            "summary_states_spending": bool(
                (isinstance(spent, (int, float)) and spent > 0)
                or (isinstance(rounds, int) and rounds > 0)
            ),
            "source": "ledger.sqlite",
        }, []
    with Ledger.read(path) as ledger:
        result = ledger.verify(
            recorded=recorded, anchors=run_anchors(path.parent, path), recompute=True
        )
        entries = list(ledger.entries())
    epsilon, delta = ledger_guarantee(entries)
    client_rows = [e for e in entries if e.kind == "client_level"]
    newest = client_rows[-1].payload if client_rows else {}
    example_rows: dict[str, Any] = {}
    for e in entries:
        if e.kind == "example_level":  # the latest row per client is its running total
            example_rows[e.party] = {
                "client": e.party,
                "round": e.round,
                "epsilon": e.payload.get("epsilon"),
                "delta": e.payload.get("delta"),
                "accountant": e.payload.get("accountant"),
                "noise_multiplier": e.payload.get("noise_multiplier"),
                "sample_rate": e.payload.get("sample_rate"),
            }
    return {
        "present": True,
        "verified": result.ok,
        "problems": list(result.problems),
        "entries": result.entries,
        "head": result.head,
        "checked_against_summary": recorded is not None,
        "signed_head": result.signed,
        "entries_after_signed_head": result.unsigned_after,
        "entries_after_summary": result.after_record,
        # free-text events: a budget stop, a discarded sum the server had seen
        "notes": [
            {"round": e.round, "message": e.payload.get("message")}
            for e in entries
            if e.kind == "note"
        ],
        "epsilon": epsilon,
        "delta": delta,
        "noise_distribution": newest.get("noise_distribution"),
        "effective_noise_multiplier": newest.get("effective_noise_multiplier"),
        "epsilon_by_round": _epsilon_by_round(entries),
        "example_level": [example_rows[k] for k in sorted(example_rows)],
        "source": "ledger.sqlite",
    }, entries


def _epsilon_by_round(entries: list[Entry]) -> list[dict[str, Any]]:
    """Epsilon after each round (client level), or the largest client's (example level).

    A client-level release the server saw in a discarded attempt is a row of its own (marked
    ``discarded_sum``): it is composed like a round.

    Example-level rows are each client's running total; a round's is the largest total of
    every client so far (a client without a row in that round keeps its latest), so the
    series never goes down.
    """
    rows = [
        {"round": e.round, "epsilon": e.payload.get("epsilon"), "at": e.created_at}
        | ({"discarded_sum": True} if e.kind == "discarded_sum" else {})
        for e in entries
        if e.kind in CLIENT_KINDS
    ]
    if rows:
        return rows
    example = [
        (e, eps)
        for e in entries
        if e.kind == "example_level"
        and isinstance(eps := e.payload.get("epsilon"), (int, float))
        and not isinstance(eps, bool)
    ]
    latest: dict[str, tuple[Entry, float]] = {}  # each client's running total so far
    out = []
    for number in sorted({e.round for e, _ in example}):
        latest.update((e.party, (e, eps)) for e, eps in example if e.round == number)
        top, eps = max(latest.values(), key=lambda row: row[1])
        out.append({"round": number, "epsilon": eps, "at": top.created_at})
    return out
