"""The one rounding rule of stated privacy figures: upper bounds up, lower bounds down."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from privacy.dp.rounding import TOLERANCE, round_down, round_up, up_to_places

positive = st.floats(min_value=1e-12, max_value=1e12, allow_nan=False, allow_infinity=False)


def test_published_figures_round_the_safe_way() -> None:
    # the quickstart's accountant figure and its neighbours of one ulp
    assert round_up(7.98859, 4) == "7.989"
    assert round_up(7.9886, 5) == "7.9886"
    assert round_up(7.988600000000001, 5) == "7.9886"  # float fuzz of an exact figure
    assert round_down(3.4669, 4) == "3.466"
    assert round_down(3.466, 4) == "3.466"
    assert up_to_places(7.98861, 4) == "7.9887"
    assert up_to_places(2.0, 4) == "2.0000"
    assert up_to_places(math.inf) == "unbounded"
    assert round_up(math.inf) == "inf" and round_up(0.0) == "0"


@given(positive, st.integers(min_value=1, max_value=6))
def test_an_upper_bound_is_never_stated_lower(value: float, digits: int) -> None:
    step = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    stated = float(round_up(value, digits))
    assert stated >= value - 2 * TOLERANCE * step - 1e-12 * value
    assert stated <= value + step * (1 + 1e-9)


@given(positive, st.integers(min_value=1, max_value=6))
def test_a_lower_bound_is_never_stated_higher(value: float, digits: int) -> None:
    step = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    stated = float(round_down(value, digits))
    assert stated <= value + 2 * TOLERANCE * step + 1e-12 * value
    assert stated >= value - step * (1 + 1e-9)


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False), st.integers(0, 6))
def test_decimal_places_round_up(value: float, places: int) -> None:
    stated = float(up_to_places(value, places))
    assert stated >= value - 2 * TOLERANCE / 10.0**places - 1e-12 * value
    assert stated <= value + 10.0**-places * (1 + 1e-9)
