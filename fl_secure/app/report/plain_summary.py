"""The report's plain-language summary: the guarantee, the aggregation and the accuracy."""

from __future__ import annotations

import math
from typing import Any

from fl_secure.app.report.units import RECORD_IN_FULL, record_of
from privacy.dp.rounding import round_up


def plain_summary(report: dict[str, Any]) -> list[str]:
    """A few sentences a reader without the vocabulary can follow, from the report's sections."""
    p, sa, u = report["privacy"], report["secure_aggregation"], report["utility"]
    lines = []
    if p["differential_privacy"] and not p["epsilon"]:  # None, or 0: nothing released
        lines.append("Differential privacy was configured, but no round was accounted.")
    elif p["differential_privacy"]:
        unit = record_of(p)
        change = {
            "replace-one": f"whether any one {unit} is replaced by another",
            "zero-out": f"whether any one {unit} sent its real update or a zero one (its "
            "noise share is sent either way)",
        }.get(p["adjacency"], f"whether or not any one {unit} took part")
        lines.append(
            f"Training was differentially private at the level of a whole {unit}: with "
            f"epsilon = {round_up(p['epsilon'])} and delta = "
            f"{round_up(p['delta']) if p['delta'] is not None else 'not recorded'} "
            f"({p['adjacency']} adjacency, {p['accountant']} accountant), the probability of "
            "any outcome of the released models changes by at most a factor e^epsilon = "
            f"{round_up(math.exp(min(p['epsilon'], 700)))} (plus delta) {change}"
            + (" (a weak bound: epsilon is above 5)." if p["epsilon"] > 5 else ".")
        )
        if p["privacy_unit"] == "identity":
            lines.append(f"The protected record is {RECORD_IN_FULL['identity']}.")
    else:
        lines.append("Training was not differentially private.")
    if sa["scheme"] == "none":
        lines.append("The server saw each institution's individual model update.")
    else:
        lines.append(f"Updates were combined with {sa['scheme']}: {sa['server_sees']}.")
    lines.append(f"Design: {report['threat_model']['design']}.")
    final = u["final"].get("tar_at_far_1e-2")
    if final is not None:
        lines.append(f"Accuracy on identities no site trained on: TAR = {final:.3f} at FAR = 1e-2.")
    return lines
