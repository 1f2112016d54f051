"""The report's utility section: the headline figures of the final and the initial model.

Held-out verification (TAR at each FAR, rank-1, ROC AUC, EER) per round and at the end, the
final ROC operating points, and each client's scores on its own test images with their
spread across clients, all from ``summary.json`` and ``metrics.jsonl``.
"""

from __future__ import annotations

from typing import Any

HEADLINE = ("tar_at_far_1e-1", "tar_at_far_1e-2", "tar_at_far_1e-3", "rank1", "roc_auc", "eer")


def utility_section(summary: dict[str, Any], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The final and initial models' headline figures, per round, per client and their spread."""
    per_round = []
    for m in metrics:
        held = m.get("held_out")
        if isinstance(held, dict) and "round" in m:
            per_round.append({"round": m["round"], **{k: held[k] for k in HEADLINE if k in held}})
    clients = summary.get("clients") or {}
    return {
        "evaluation": summary.get("evaluation"),
        "final": {k: summary.get(k) for k in HEADLINE if k in summary},
        "untrained": {k: v for k, v in (summary.get("untrained") or {}).items() if k in HEADLINE},
        "initial_model": summary.get("initial_model", "untrained (random initialisation)"),
        "roc": {  # final held-out ROC operating points, TAR at each FAR of the key
            k: v
            for k, v in (summary.get("held_out") or {}).items()
            if k.startswith("roc_tar_at_far_")
        },
        "per_round": per_round,
        "clients": {
            c: {k: v for k, v in m.items() if k in HEADLINE} for c, m in sorted(clients.items())
        },
        "clients_spread": _spread(summary.get("clients_summary")),
        # the initial model on the same clients' test images (runs without held-out
        # identities are judged by these two)
        "untrained_clients_spread": _spread(summary.get("untrained_clients_summary")),
        "source": "summary.json, metrics.jsonl",
    }


def _spread(summary: dict[str, Any] | None) -> dict[str, Any]:
    """The headline figures' across-client mean/std/min/max of a ``*_summary`` block."""
    return {k: v for k, v in (summary or {}).items() if k.rsplit("_", 1)[0] in HEADLINE}
