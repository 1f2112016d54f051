"""Each attempt of a round from ``metrics.jsonl``: the failed ones, and secure aggregation's.

A round may take several attempts: a failed one is recorded as ``"kind": "aborted"`` beside
the completed rounds. The run section lists the failed attempts and what happened next; the
secure-aggregation section lists each attempt's cohort, survivors and threshold, in order.
"""

from __future__ import annotations

from typing import Any


def failed_attempts(
    metrics: list[dict[str, Any]], failed: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each failed attempt of a round (metrics.jsonl's ``"kind": "aborted"`` records).

    ``outcome``: ``retried`` when a later attempt of the same round was made (recorded as
    failed too, or as the completed round), else ``round aborted``.
    """
    done = {m.get("round") for m in metrics}
    out = []
    for m in failed:
        later = m.get("round") in done or any(
            f.get("round") == m.get("round") and _int(f.get("attempt")) > _int(m.get("attempt"))
            for f in failed
        )
        out.append(
            {
                "round": m.get("round"),
                "attempt": m.get("attempt"),
                "task": m.get("task"),
                "reason": str(m.get("reason") or ""),
                "outcome": "retried" if later else "round aborted",
                "failed": {str(c): str(why) for c, why in (m.get("failed") or {}).items()},
            }
        )
    return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def secure_aggregation_section(
    summary: dict[str, Any], metrics: list[dict[str, Any]], failed: list[dict[str, Any]]
) -> dict[str, Any]:
    """The scheme, and each attempt's record (completed rounds and failed attempts, in order)."""
    sa = dict(summary.get("secure_aggregation") or {"scheme": "none"})
    rounds = []
    aborted: list[Any] = []
    for m in sorted(metrics + failed, key=lambda m: (_int(m.get("round")), _int(m.get("attempt")))):
        rec = m.get("secure_aggregation")
        if not isinstance(rec, dict):
            continue
        row = {
            "round": m.get("round"),
            "attempt": m.get("attempt"),
            "cohort": rec.get("cohort"),
            "survivors": rec.get("survivors"),
            "threshold": rec.get("threshold"),
            "dropped": rec.get("dropped"),
            "aborted": rec.get("aborted") or "",
        }
        if m.get("kind") == "aborted" and not row["aborted"]:
            row["aborted"] = str(m.get("reason") or "aborted")
        rounds.append(row)
    for m in failed:  # rounds with a failed attempt, once each
        if m.get("round") not in aborted:
            aborted.append(m.get("round"))
    return {
        "scheme": sa.pop("scheme", "none"),
        "server_sees": sa.pop("server_sees", None),
        "malicious_server": sa.pop("malicious_server", None),  # SecAgg: the guarantee
        "parameters": {k: v for k, v in sa.items() if not k.endswith("_per_round")},
        "rounds": rounds,
        "aborted_rounds": aborted,
        "source": "summary.json (secure_aggregation), metrics.jsonl",
    }
