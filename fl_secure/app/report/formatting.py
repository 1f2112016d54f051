"""How the report states a number: bounds rounded the safe way, and n/a for a missing figure.

An upper bound (epsilon, delta) is rounded up and a lower bound (an empirical epsilon) down,
so that a stated bound is never stronger than the one computed; the rounding itself is
:mod:`privacy.dp.rounding`'s, the one every figure of the project goes through.
"""

from __future__ import annotations

import json
import math
from typing import Any

from privacy.dp.rounding import round_down, round_up


def finite(value: Any) -> bool:
    """Whether ``value`` is a finite number (not None, NaN, a bool or text)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def fmt(value: Any) -> str:
    """Numbers to 4 significant digits (NaN or infinite: n/a); everything else as text."""
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "—"}[value]
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "n/a"
    if isinstance(value, list | dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def fmt_figure(value: Any) -> str:
    """A utility figure: null (the run wrote null for a NaN score) or not finite is n/a."""
    return fmt(value) if finite(value) else "n/a"


def fmt_bound(value: Any) -> str:
    """An upper bound (epsilon, delta) to 4 significant digits, rounded up, never down."""
    if isinstance(value, float):
        return round_up(value, 4)
    return fmt(value)


def fmt_lower(value: Any) -> str:
    """A lower bound (an empirical epsilon) to 4 significant digits, rounded down, never up."""
    if isinstance(value, float) and math.isfinite(value) and value > 0:
        return round_down(value, 4)
    return fmt(value)


def fmt_measure(key: str, value: Any) -> str:
    """An audit figure: epsilon lower bounds rounded down, epsilons and deltas up."""
    if "epsilon" in key and "lower" in key:
        return fmt_lower(value)
    if "epsilon" in key or "delta" in key:
        return fmt_bound(value)
    return fmt(value)


#: Rows shown with :func:`fmt_bound`: a statement must not round a bound down.
BOUNDS = frozenset({"epsilon", "delta", "target_epsilon", "epsilon_amplified"})
