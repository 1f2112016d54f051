"""A run's client-level aggregation released on worst-case canaries, and the canaries' scores.

The audit runs the *mechanism as implemented*: the project's own aggregation code
(:func:`privacy.dp.client_level.server_aggregator`, the server's own, with
:func:`privacy.dp.client_level.clip_update`,
:func:`privacy.dp.client_level.add_gaussian` and the clients' noise shares of
:func:`privacy.dp.client_level.client_noise_std`; :class:`fl_secure.aggregation.StreamingMean` for a
non-private run) with the run's :class:`~audits.mechanism.Mechanism`.

A canary is a client whose update is chosen by the auditor in the worst case: a vector of
norm ``2 C`` (so that clipping acts) along a coordinate no other update touches, while the
honest clients send zero updates (plus their noise shares) so that nothing masks it. The
release carries the noise shares of the fewest honest clients any released round has
(:func:`audits.mechanism.noise_contributors`). The attacker observes every round's released
average and scores a canary by the sum over rounds of the released coordinate. With every
client in every round (q = 1) this is the strongest membership test for the Gaussian
mechanism (the likelihood ratio is monotone in that sum); with client sampling (q < 1) each
round's likelihood ratio is a mixture, ``log(1 - q + q exp((x mu - mu^2 / 2) / s^2))``, which
the sum does not follow: :func:`canary_scores` can score by that log-likelihood ratio summed
over rounds instead. Noise is drawn from a seeded generator (the same Gaussian distribution
as the CSPRNG the run used) so that the audit is reproducible.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from audits.mechanism import Mechanism
from fl_secure.aggregation import StreamingMean
from fl_secure.messages import Tensors, TensorSpec
from privacy.dp.client_level import (
    NoisyClippedSum,
    add_gaussian,
    client_noise_std,
    clip_update,
    server_aggregator,
)
from privacy.dp.noise import SeededGaussian

#: Coordinates (canaries) per aggregation in :func:`canary_scores`.
CANARY_BLOCK = 2048


class OneHotCanaries:
    """Canary updates ``norm * e_i`` for coordinates ``i`` of ``[0, dim)``, built one at a time.

    A round of ``k`` canaries over ``d`` coordinates held as a dense ``[k, d]`` array takes
    ``8 k d`` bytes (2.7 GB for the 26,000 trials that can test epsilon 8); one row at a time
    the round needs ``O(d)``.
    """

    def __init__(self, coordinates: np.ndarray, dim: int, norm: float) -> None:
        self.coordinates, self.dim, self.norm = coordinates, dim, norm

    def __len__(self) -> int:
        return len(self.coordinates)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in self.coordinates:
            row = np.zeros(self.dim, dtype=np.float32)
            row[i] = self.norm
            yield row


def release_round(
    mech: Mechanism, canaries: np.ndarray | OneHotCanaries, source: SeededGaussian
) -> np.ndarray:
    """One round's released average of a ``[k, d]`` batch of canary updates (one per row).

    Honest clients send zero updates plus their noise shares; the server aggregates with the
    project's code for the run's placement.
    """
    dim = canaries.dim if isinstance(canaries, OneHotCanaries) else canaries.shape[1]
    specs = [TensorSpec(name="u", shape=(dim,), dtype=np.dtype(np.float32))]
    c = mech.clip_norm
    agg: NoisyClippedSum | StreamingMean
    if c is None:
        agg = StreamingMean(specs)
    else:
        agg = server_aggregator(specs, placement=mech.placement,
                                noise_multiplier=mech.noise_multiplier, clip_norm=c,
                                denominator=mech.denominator, source=source)  # fmt: skip
    zero: Tensors = OrderedDict(u=np.zeros(dim, dtype=np.float32))
    if c is None and mech.honest_clients == 0 and len(canaries) == 0:
        return np.zeros(dim)  # no DP and nobody sent anything here: the sum is 0
    if c is not None and mech.honest_clients == 0 and len(canaries) == 0:
        # central noise (no honest noise shares) and no canary sampled: the round still
        # releases; a zero update stands for the honest clients the real round has
        agg.add(zero, 1.0)
    share = _share_std(mech)
    for _ in range(mech.honest_clients):
        agg.add(add_gaussian(zero, share, source) if share > 0 else zero, 1.0)
    for row in canaries:
        update: Tensors = OrderedDict(u=row.astype(np.float32))
        if c is not None and mech.placement != "central":
            update, _ = clip_update(update, c)  # the client clips before sending
        agg.add(update, 1.0)
    out = agg.mean()["u"].astype(np.float64)
    if c is None:  # StreamingMean divides by the count; the sum / W is what leaks
        out = out * (mech.honest_clients + len(canaries)) / mech.denominator
    return out


def _share_std(mech: Mechanism) -> float:
    """Noise std each honest client adds to its update (``local``/``distributed``; else 0)."""
    c = mech.clip_norm
    if c is None or mech.placement not in ("local", "distributed"):
        return 0.0
    return client_noise_std(mech.placement, mech.noise_multiplier, c, mech.min_survivors)


def release_std(mech: Mechanism) -> float:
    """Std of the noise on one released coordinate: the honest shares' or the central noise.

    (0 without clipping or noise.) A present canary's own share adds to it; the score below
    leaves that out, which costs it optimality, not validity.
    """
    c, z = mech.clip_norm, mech.noise_multiplier
    if c is None or z <= 0:
        return 0.0
    if mech.placement == "central":
        return z * c / mech.denominator
    return math.sqrt(mech.honest_clients) * _share_std(mech) / mech.denominator


def canary_scores(
    mech: Mechanism, included: np.ndarray, *, seed: int, mixture: bool = False
) -> tuple[np.ndarray, float]:
    """Scores of ``m`` canaries (canary ``i`` on coordinate ``i``) over the run's rounds.

    The default score is the sum over rounds of the released coordinate. ``mixture`` scores
    by the log-likelihood ratio of the rounds instead, each a mixture under client sampling:
    ``sum_r log(1 - q + q exp((x_r mu - mu^2 / 2) / s^2))`` with ``mu = C / W`` (the clipped
    canary's share of the average) and ``s`` from :func:`release_std`; with ``q = 1`` it is
    a monotone function of the sum.

    Returns:
        ``[m]`` scores, and the expected *sum* of an included canary
        (``rounds * q * min(2C, C) / W``; norm 1 without clipping).
    """
    m = len(included)
    norm = 2.0 * mech.clip_norm if mech.clip_norm is not None else 1.0
    effective = mech.clip_norm if mech.clip_norm is not None else 1.0
    source = SeededGaussian(seed)
    rng = np.random.default_rng(seed + 1)
    mu, s = effective / mech.denominator, release_std(mech)
    q = mech.sample_rate
    mixture = mixture and s > 0 and q < 1.0
    scores = np.zeros(m)
    for _ in range(mech.rounds):
        present = included & (rng.random(m) < mech.sample_rate)
        # Blocks of coordinates, each released by its own aggregation: every coordinate's
        # noise is independent and a canary touches its coordinate only, so the released
        # values have the same distribution as one aggregation over all m, and the cost is
        # O(m * block) instead of O(m^2) (each client clips its full-length update)
        released = np.empty(m)
        for lo in range(0, m, CANARY_BLOCK):
            hi = min(m, lo + CANARY_BLOCK)
            block = OneHotCanaries(np.flatnonzero(present[lo:hi]), hi - lo, norm)
            released[lo:hi] = release_round(mech, block, source)
        if mixture:  # log(1 - q + q e^a), computed without overflow
            a = (released * mu - mu * mu / 2.0) / (s * s)
            scores += np.logaddexp(math.log1p(-q), math.log(q) + a)
        else:
            scores += released
    expected = mech.rounds * mech.sample_rate * effective / mech.denominator
    return scores, expected
