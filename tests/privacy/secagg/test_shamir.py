"""Shamir sharing over GF(2^521 - 1): t shares rebuild a secret, t - 1 say nothing of it."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fl_secure.errors import PrivacyError
from privacy.secagg.shamir import PRIME, shamir_interpolate, shamir_split


@settings(max_examples=60, deadline=None)
@given(
    secret=st.integers(0, 2**256 - 1),
    other=st.integers(0, 2**256 - 1),
    t=st.integers(1, 8),
    extra=st.integers(0, 5),
    order=st.randoms(use_true_random=False),
)
def test_shamir_t_minus_one_shares_fit_every_secret_and_t_reconstruct(
    secret: int, other: int, t: int, extra: int, order: random.Random
) -> None:
    # Prepare
    xs = list(range(3, 3 + t + extra))
    ys = shamir_split(secret, xs, t)
    points = list(zip(xs, ys, strict=True))
    order.shuffle(points)
    # Execute / Assert: any t shares give the secret exactly
    assert shamir_interpolate(points[:t]) == secret
    assert all(0 <= y < PRIME for y in ys)
    if t == 1:
        return
    # t - 1 shares plus the point (0, other) define a polynomial of degree t - 1 ...
    seen = points[: t - 1]
    fake = [(0, other), *seen]
    completed = [*seen, (1, shamir_interpolate(fake, 1))]  # x = 1 is never a real abscissa
    # ... which is a complete, consistent sharing of `other`: the t - 1 shares cannot tell
    assert shamir_interpolate(completed) == other
    for x, y in seen:
        assert shamir_interpolate(completed, x) == y
    assert shamir_interpolate(completed, 2) == shamir_interpolate(fake, 2)  # same polynomial


@pytest.mark.parametrize("secret", [0, 5])
def test_shamir_t_minus_one_shares_are_uniform_whatever_the_secret(secret: int) -> None:
    # Prepare: GF(7), t = 3: two shares; 49 possible share pairs
    prime, samples = 7, 9800
    # Execute
    pairs = [shamir_split(secret, [1, 2, 3], 3, prime=prime)[:2] for _ in range(samples)]
    # Assert: the pair (f(1), f(2)) is uniform over GF(7)^2 for either secret
    counts = np.zeros(49)
    for a, b in pairs:
        counts[a * prime + b] += 1
    assert stats.chisquare(counts).pvalue > 1e-4


def test_shamir_rejects_bad_arguments() -> None:
    with pytest.raises(PrivacyError, match="distinct"):
        shamir_split(1, [1, 1], 2)
    with pytest.raises(PrivacyError, match="threshold 3"):
        shamir_split(1, [1, 2], 3)
    with pytest.raises(PrivacyError, match="element"):
        shamir_split(PRIME, [1, 2], 2)
