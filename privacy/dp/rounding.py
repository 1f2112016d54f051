"""How a privacy figure is rounded for people: an upper bound up, a lower bound down.

A stated epsilon or delta is an upper bound, so it is never rounded down (a stated bound must
not be stronger than the one computed); an empirical epsilon is a lower bound, so it is never
rounded up. Every place that prints or writes such a figure (the run's summary line, the
ledger's notes, ``fl-secure privacy``, the compliance report) rounds it here, with one tolerance.
"""

from __future__ import annotations

import math

#: Floating-point slack of ``value / step``: a figure that is exactly on a rounding step (for
#: example 7.9886 computed as 7.988600000000001) is not pushed to the next step by the error of
#: its own division.
TOLERANCE = 1e-9


def round_up(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits, rounded up: a stated bound is never lower.

    A value that is not a positive finite number is formatted as it is (``inf``, ``nan``, ``0``).
    """
    if not (math.isfinite(value) and value > 0):
        return f"{value:.{digits}g}"
    step = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return f"{math.ceil(value / step - TOLERANCE) * step:.{digits}g}"


def round_down(value: float, digits: int = 4) -> str:
    """``value`` to ``digits`` significant digits, rounded down: a lower bound is never higher.

    A value that is not a positive finite number is formatted as it is.
    """
    if not (math.isfinite(value) and value > 0):
        return f"{value:.{digits}g}"
    step = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return f"{math.floor(value / step + TOLERANCE) * step:.{digits}g}"


def up_to_places(value: float, places: int = 4) -> str:
    """``value`` to ``places`` decimals, rounded up; an infinite bound reads ``unbounded``."""
    if not math.isfinite(value):
        return "unbounded" if value > 0 else f"{value}"
    scale = 10.0**places
    return f"{math.ceil(value * scale - TOLERANCE) / scale:.{places}f}"
