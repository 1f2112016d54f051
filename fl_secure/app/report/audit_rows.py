"""The audit's tables in the report: one row per party view, every number, the grids' captions.

Each measure stands beside its chance level; an empirical epsilon is rounded down and the
accountant's up (:func:`~fl_secure.app.report.formatting.fmt_measure`).
"""

from __future__ import annotations

from typing import Any

from fl_secure.app.report.formatting import fmt, fmt_bound, fmt_lower, fmt_measure

AUDIT_HEADER = (
    "party view",
    "direction attacked",
    "inversion top-1 [95% CI]",
    "chance",
    "KNN distance (chance)",
    "SSIM (chance)",
    "templates top-1 [95% CI]",
    "empirical epsilon >=",
    "accountant epsilon",
)


def audit_summary_row(r: dict[str, Any]) -> list[str]:
    """One party view's row of :data:`AUDIT_HEADER` (from :func:`audits.results.table_rows`)."""

    def with_ci(value: Any, ci: Any) -> str:
        return fmt(value) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if isinstance(ci, list) else "")

    def with_chance(value: Any, chance: Any) -> str:
        return fmt(value) + (f" ({fmt(chance)})" if chance is not None else "")

    eps = fmt_lower(r.get("epsilon_lower_bound"))
    if r.get("epsilon_lower_bound_at_audit_cap"):
        eps += " (the audit's cap: a perfect attack; a larger audit could show more)"
    return [
        fmt(r.get("party")),
        fmt(r.get("direction")),
        with_ci(r.get("top1"), r.get("top1_ci95")),
        fmt(r.get("chance")),
        with_chance(r.get("knn_distance"), r.get("chance_knn_distance")),
        with_chance(r.get("ssim"), r.get("chance_ssim")),
        with_ci(r.get("templates_top1"), r.get("templates_top1_ci95")),
        eps,
        fmt_bound(r.get("accountant_epsilon")),
    ]


#: measures compared with a node's "chance" (a by_attack entry's values as well)
_CHANCE_MEASURES = frozenset(
    {"top1", "participant_precision", "exact_inputs", "row_ratios", "span"}
)


#: (key holding a chance level, the measure it is the chance level of); "*": every measure
#: of _CHANCE_MEASURES without a level of its own
_CHANCE_KEYS = (
    ("chance", "*"),
    ("chance_top1", "top1"),
    ("chance_top5", "top5"),
    ("chance_knn_distance", "knn_distance"),
    ("chance_ssim", "ssim"),
    ("chance_psnr_db", "psnr_db"),
)


def audit_rows(audit: dict[str, Any]) -> list[list[str]]:
    """Flatten the audit's attack results into (attack, view, measure, value, chance) rows."""
    rows: list[list[str]] = []

    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    def walk(prefix: str, node: Any, inherited: dict[str, float]) -> None:
        if isinstance(node, dict):
            # chance level per measure: top-5 has its own; identification-style scores
            # (top1, participant_precision, each attack under by_attack) use "chance"
            levels = dict(inherited)
            for key, measure in _CHANCE_KEYS:
                if number(node.get(key)):
                    levels[measure] = float(node[key])
            for k, v in sorted(node.items()):
                if number(v) and not k.startswith("chance"):
                    level = levels.get(k, levels.get("*") if k in _CHANCE_MEASURES else None)
                    shown = fmt_measure(k, v)
                    rows.append([prefix, k, shown, fmt(level) if level is not None else ""])
                elif isinstance(v, dict | list):
                    inherit = levels if k == "by_attack" else {}
                    walk(f"{prefix}/{k}" if prefix else k, v, inherit)
        elif isinstance(node, list):
            for i, v in enumerate(node[:50]):
                walk(f"{prefix}[{i}]", v, {})

    walk("", audit.get("attacks", audit), {})
    return rows[:400]


def grid_captions(audit: dict[str, Any] | None) -> dict[str, str]:
    """What each audit image grid shows, by file name (from ``audit/results.json``).

    Parties that hold the same view (a global head: the server and every client) share one
    grid, so a caption names every party whose attack wrote it.
    """
    seen: dict[str, tuple[list[str], str, dict[str, Any]]] = {}
    for party, view in sorted(((audit or {}).get("attacks") or {}).get("inversion", {}).items()):
        for direction, entry in sorted(view.items()):
            if isinstance(entry, dict) and isinstance(entry.get("grid"), str):
                seen.setdefault(entry["grid"], ([], direction, entry))[0].append(party)
    return {
        name: (
            f"Model inversion from the view of {' and '.join(parties)}, {direction} "
            f"({entry.get('target_direction', '')}). One target per row: three of its real "
            "images (the judge's, never seen by the attacker), then the reconstruction. "
            f"Judged top-1 {fmt(entry.get('top1'))} against chance "
            f"{fmt(entry.get('chance_top1'))}."
        )
        for name, (parties, direction, entry) in seen.items()
    }
