"""Reading ``RUN/audit/results.json`` back: its check, one row per party view, the README table.

The report reads the results after they have sat in a run folder (:func:`check_results`
refuses a damaged file by naming its field), states one row per party view beside chance
(:func:`table_rows`), and the benchmarks print a design x view table of several audits
(:func:`markdown_table`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fl_secure.errors import CheckpointError


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (party view) for README tables: top-1 vs chance, KNN, SSIM, epsilon."""
    rows = []
    inversion = results["attacks"].get("inversion", {})
    canary = results["attacks"].get("canary", {})
    templates = results["attacks"].get("templates", {})
    order = sorted(inversion, key=lambda p: (p != "server", p))
    for party in order:
        res = inversion[party]
        best = res[res["best"]]
        rows.append({
            "algorithm": results["algorithm"],
            "exposure": results["exposure"],
            "privacy": results["privacy_unit"],
            "party": party,
            "direction": res["best"],
            "top1": best["top1"],
            "top1_ci95": best.get("top1_ci95"),
            "chance": best["chance_top1"],
            "knn_distance": best["knn_distance"],
            "chance_knn_distance": best.get("chance_knn_distance"),
            "ssim": best["ssim"],
            "chance_ssim": best.get("chance_ssim"),
            "templates_top1": templates.get(party, {}).get("top1"),
            "templates_top1_ci95": templates.get(party, {}).get("top1_ci95"),
            "epsilon_lower_bound": canary.get("epsilon_lower_bound"),
            "epsilon_lower_bound_at_audit_cap": canary.get("at_audit_cap"),
            "accountant_epsilon": canary.get("accountant_epsilon"),
        })  # fmt: skip
    return rows


def _is_finding(f: dict[str, Any]) -> bool:
    return isinstance(f.get("code"), str) and isinstance(f.get("message"), str)


def check_results(results: Any, source: str = "audit/results.json") -> None:
    """Refuse audit results that :func:`table_rows` and the findings cannot read.

    The report reads ``audit/results.json`` after it has sat in a run folder, where it may
    have been edited or damaged; this names the first field that is missing or of the wrong
    type instead of failing somewhere inside the report (or in
    :func:`audits.run_audit.findings`).

    Raises:
        CheckpointError: naming ``source`` and the field.
    """

    def fail(where: str, what: str) -> None:
        raise CheckpointError(f"{source} is damaged: {where} {what}")

    def node(parent: Any, key: str, where: str) -> dict[str, Any]:
        value = parent.get(key) if isinstance(parent, dict) else None
        if not isinstance(value, dict):
            fail(f"{where}.{key}" if where else key, "is missing or not an object")
        return value  # type: ignore[return-value]

    def number(parent: dict[str, Any], key: str, where: str, *, optional: bool = False) -> None:
        value = parent.get(key)
        if value is None and optional:
            return
        if key not in parent:
            fail(f"{where}.{key}", "is missing (expected a number)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            fail(f"{where}.{key}", f"is {value!r}, not a number")

    def interval(parent: dict[str, Any], key: str, where: str) -> None:
        value = parent.get(key)
        ok = value is None or (
            isinstance(value, list)
            and len(value) == 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        )
        if not ok:
            fail(f"{where}.{key}", f"is {value!r}, not a [low, high] interval")

    stated = results.get("findings") if isinstance(results, dict) else None
    if stated is not None and not (
        isinstance(stated, list) and all(isinstance(f, dict) and _is_finding(f) for f in stated)
    ):
        fail("findings", "is not a list of {code, message} objects")
    attacks = node(results, "attacks", "")
    sections = {
        name: node(attacks, name, "attacks") if name in attacks else {}
        for name in ("inversion", "templates", "leakage")
    }
    for party in sections["inversion"]:
        view = node(attacks["inversion"], party, "attacks.inversion")
        at = f"attacks.inversion.{party}"
        best = view.get("best")
        if not isinstance(best, str):
            fail(f"{at}.best", "is missing (expected the name of the best direction)")
        entry = node(view, str(best), at)
        for key in ("top1", "chance_top1", "knn_distance", "ssim"):
            number(entry, key, f"{at}.{best}")
        for key in ("chance_knn_distance", "chance_ssim"):
            number(entry, key, f"{at}.{best}", optional=True)
        interval(entry, "top1_ci95", f"{at}.{best}")
        for direction, each in view.items():
            grid = each.get("grid") if isinstance(each, dict) else None
            if grid is not None and (
                not isinstance(grid, str) or Path(grid).name != grid or not grid.endswith(".png")
            ):  # the report embeds the file: it must be a PNG in the audit folder itself
                fail(f"{at}.{direction}.grid", f"is {grid!r}, not a PNG file name")
    for party in sections["templates"]:
        res = node(attacks["templates"], party, "attacks.templates")
        if res.get("applicable"):
            where = f"attacks.templates.{party}"
            number(res, "top1", where)
            number(res, "chance", where)
            interval(res, "top1_ci95", where)
    for party in sections["leakage"]:
        res = node(attacks["leakage"], party, "attacks.leakage")
        one = res.get("single_client_one_image") if res.get("applicable") else None
        if one is not None:
            where = f"attacks.leakage.{party}.single_client_one_image"
            one = node(res, "single_client_one_image", f"attacks.leakage.{party}")
            for key in ("top1", "chance", "clients"):
                number(one, key, where)
            interval(one, "top1_ci95", where)
    if attacks.get("canary") is not None:
        canary = node(attacks, "canary", "attacks")
        number(canary, "epsilon_lower_bound", "attacks.canary")
        number(canary, "accountant_epsilon", "attacks.canary", optional=True)
        if canary.get("exceeds_accountant"):
            number(canary, "accountant_epsilon", "attacks.canary")


def ci_text(ci: Sequence[float] | None) -> str:
    """`` [low, high]`` of a 95% interval, or nothing for results written before it existed."""
    return "" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def chance_text(chance: float | None) -> str:
    """`` (chance x)`` for KNN distance and SSIM, or nothing for older results."""
    return "" if chance is None else f" (chance {chance:.3f})"


def markdown_table(all_results: Sequence[dict[str, Any]]) -> str:
    """README table: design x party view x inversion/templates/leakage, empirical epsilon."""
    lines = [
        "| design | DP | party view | direction attacked | inversion top-1 [95% CI] (chance) | "
        "KNN dist. (chance) | SSIM (chance) | templates top-1 | "
        "FC-update leakage top-1 (chance) | "
        "empirical eps >= (accountant) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for results in all_results:
        canary = results["attacks"].get("canary", {})
        acc = canary.get("accountant_epsilon")
        cap = " (audit cap)" if canary.get("at_audit_cap") else ""
        if canary.get("can_test_accountant") is False:  # no outcome could have passed it
            cap += f", cannot test: at most {canary['largest_bound_this_audit_can_show']:.2f}"
        eps = (
            f"{canary['epsilon_lower_bound']:.2f}{cap} ({'none' if acc is None else f'{acc:.2f}'})"
            if canary
            else "-"
        )
        privacy = (
            "none"
            if results["privacy_unit"] == "none"
            else (f"{results['privacy_unit']}, eps {results['epsilon']:.2f}")
        )
        for row in table_rows(results):
            party = row["party"]
            templates = row["templates_top1"]
            leak = results["attacks"].get("leakage", {}).get(party, {})
            if leak.get("single_client_one_image"):
                one = leak["single_client_one_image"]
                leaked = f"{one['top1']:.2f} ({one['chance']:.2f})"
            elif leak.get("applicable"):
                summed = leak["secure_sum_one_image_each"]
                leaked = f"sum only: {summed['participant_precision']:.2f} ({summed['chance']:.2f})"
            else:
                leaked = "no update seen"
            lines.append(
                f"| {results['algorithm']} ({results['exposure']}) | {privacy} | {party} | "
                f"{row['direction']} | {row['top1']:.2f}{ci_text(row['top1_ci95'])} "
                f"({row['chance']:.2f}) | {row['knn_distance']:.3f}"
                f"{chance_text(row['chance_knn_distance'])} | {row['ssim']:.3f}"
                f"{chance_text(row['chance_ssim'])} | "
                f"{'-' if templates is None else f'{templates:.2f}'} | {leaked} | {eps} |"
            )
    return "\n".join(lines) + "\n"
