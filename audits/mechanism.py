"""Empirical epsilon of a run's client-level aggregation, measured with worst-case canaries.

The audit runs the *mechanism as implemented*: the project's own aggregation code
(:func:`privacy.dp.client_level.server_aggregator`, the server's own, with
:func:`privacy.dp.client_level.clip_update`,
:func:`privacy.dp.client_level.add_gaussian` and the clients' noise shares of
:func:`privacy.dp.client_level.client_noise_std`; :class:`fl_secure.aggregation.StreamingMean` for a
non-private run) with the run's noise multiplier ``z``, clip norm ``C``, denominator ``W``,
noise placement, client sampling rate and number of rounds (``summary.json``).

A canary is a client whose update is chosen by the auditor in the worst case: a vector of
norm ``2 C`` (so that clipping acts) along a coordinate no other update touches, while the
honest clients send zero updates (plus their noise shares) so that nothing masks it. The
release carries the noise shares of the fewest honest clients any released round has
(:func:`noise_contributors`), not of every enrolled client: more noise than a real adversary
faces would understate the bound. The
attacker observes every round's released average and scores a canary by the sum over rounds
of the released coordinate. With every client in every round (q = 1) this is the strongest
membership test for the Gaussian mechanism (the likelihood ratio is monotone in that sum);
with client sampling (q < 1) each round's likelihood ratio is a mixture,
``log(1 - q + q exp((x mu - mu^2 / 2) / s^2))``, which the sum does not follow. The one-run
audit therefore ranks its canaries by that log-likelihood ratio summed over rounds; the
trials keep the sum and its threshold fixed in advance, valid but looser under sampling.
Noise is drawn from a seeded generator (the same Gaussian distribution as the CSPRNG the run
used) so that the audit is reproducible.

Two bounds (:mod:`audits.canary`): one run with ``m`` canaries each included with probability
1/2 (Steinke, Nasr & Jagielski 2023), and ``n`` independent trials with and without a canary,
Clopper-Pearson (Jagielski et al. 2020). The trials are the coordinates of one release: each
trial's canary is its own client on its own coordinate and the noise is independent per
coordinate, so they are independent runs of the mechanism. The decision threshold of the
trials is fixed in advance at half the canary's expected contribution.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from audits.canary import (
    DEFAULT_ALPHA,
    clopper_pearson_bound,
    one_run_audit,
    threshold_bound,
)
from audits.observations import ckks_encrypted_layers
from fl_secure.aggregation import StreamingMean
from fl_secure.errors import CheckpointError
from fl_secure.messages import Tensors, TensorSpec
from privacy.dp.client_level import (
    NoisyClippedSum,
    add_gaussian,
    client_noise_std,
    clip_update,
    server_aggregator,
)
from privacy.dp.noise import SeededGaussian

NON_PRIVATE_DELTA = 1e-5
"""Delta the bound is stated for when the run claims no DP at all."""


@dataclass(frozen=True)
class Mechanism:
    """The client-level aggregation of a run, as configured."""

    noise_multiplier: float  # z; 0 = no noise
    clip_norm: float | None  # C; None = no clipping (non-private run)
    denominator: float  # W: the sum is divided by it
    placement: str  # central, local, distributed, or none
    rounds: int
    sample_rate: float  # q: probability that a client takes part in a round
    honest_clients: int  # honest cohort members adding noise shares (see noise_contributors)
    min_survivors: int  # t of the distributed placement
    delta: float
    accountant_epsilon: float | None  # None: the run claims no client-level DP
    privacy_unit: str = "client"  # the run's: none, client or example (DP-SGD)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.clip_norm,
            "denominator": self.denominator,
            "noise_placement": self.placement,
            "rounds": self.rounds,
            "client_sample_rate": self.sample_rate,
            "honest_clients": self.honest_clients,
            "min_survivors": self.min_survivors,
        }


def noise_contributors(placement: str, *, secure: bool, min_clients: int) -> int:
    """Honest cohort members whose noise shares the audited release carries.

    The fewest any released round has, so that the canaries face no more noise than a real
    adversary does.

    ``distributed``: the ``t = min_clients`` shares that together carry ``z C``. ``local``:
    under secure aggregation the server sees a sum of at least ``min_clients`` updates, each
    with its own ``z C``; without it, each client's update alone, so one share (the canary's
    own). ``central`` (and no DP): honest clients add no noise. ``secure`` is False for a
    CKKS run that encrypted only some layers (:func:`secure_sum_of_every_layer`).
    """
    if placement == "distributed":
        return min_clients
    if placement == "local":
        return min_clients if secure else 1
    return 0


def secure_sum_of_every_layer(summary: dict[str, Any]) -> bool:
    """Whether the server saw only the sum of the clients' updates, in every shared layer.

    Secure aggregation (SecAgg, SecAgg+, CKKS) hides each update behind the sum; a CKKS run
    that encrypted only ``secure_aggregation.ckks_layers`` sent the other layers of each
    client's update in the clear (:func:`audits.observations.ckks_encrypted_layers`, the
    layers the audit's views also treat as seen one client at a time), and a canary on a
    coordinate of those layers reaches the server with its own noise share only.
    """
    scheme = (summary.get("secure_aggregation") or {}).get("scheme") or "none"
    if scheme == "none":
        return False
    return not (scheme == "ckks" and ckks_encrypted_layers(summary) is not None)


def mechanism_of_run(summary: dict[str, Any], *, num_clients: int, min_clients: int,
                     rounds: int, source: str = "summary.json") -> Mechanism:  # fmt: skip
    """The mechanism a run's ``summary.json`` states (no client-level DP: plain averaging).

    Raises:
        CheckpointError: naming ``source`` and the first privacy field of a client-level run
            that is missing or of the wrong type (``privacy.noise_multiplier``,
            ``privacy.clip_norm``, ``epsilon``, ``noise_placement``, ...), as
            :func:`audits.run_audit.check_results` does for ``results.json``.
    """
    privacy = summary.get("privacy", {})
    if privacy is None:
        privacy = {}
    if not isinstance(privacy, dict):
        raise CheckpointError(f"{source} is damaged: privacy is {privacy!r}, not an object")
    unit = summary.get("privacy_unit") or "none"
    rounds_done = int(_number(summary, "rounds_completed", source) or rounds)
    if unit != "client":
        return Mechanism(
            noise_multiplier=0.0,
            clip_norm=None,
            denominator=float(num_clients),
            placement="none",
            rounds=rounds_done,
            sample_rate=1.0,
            honest_clients=num_clients,
            min_survivors=min_clients,
            delta=NON_PRIVATE_DELTA,
            accountant_epsilon=None,
            privacy_unit=str(unit),
        )

    def number(parent: dict[str, Any], key: str, where: str = "") -> float:
        value = _number(parent, key, source, where=where)
        if value is None:
            name = f"{where}{key}"
            raise CheckpointError(
                f"{source} is damaged: {name} is missing (expected a number; a client-level "
                "DP run states it)"
            )
        return value

    placement = summary.get("noise_placement") or privacy.get("noise_placement")
    if placement not in PLACEMENTS:
        raise CheckpointError(
            f"{source} is damaged: noise_placement is {placement!r}, not one of "
            f"{', '.join(PLACEMENTS)} (a client-level DP run states it)"
        )
    delta = _number(summary, "delta", source) or _number(privacy, "delta", source, "privacy.")
    return Mechanism(
        noise_multiplier=number(privacy, "noise_multiplier", "privacy."),
        clip_norm=number(privacy, "clip_norm", "privacy."),
        denominator=_number(privacy, "aggregate_denominator", source, "privacy.")
        or float(num_clients),
        placement=str(placement),
        rounds=int(_number(privacy, "rounds_accounted", source, "privacy.") or rounds_done),
        sample_rate=_number(privacy, "client_sample_rate", source, "privacy.") or 1.0,
        honest_clients=noise_contributors(
            str(placement), secure=secure_sum_of_every_layer(summary), min_clients=min_clients
        ),
        min_survivors=min_clients,
        delta=delta or NON_PRIVATE_DELTA,
        accountant_epsilon=number(summary, "epsilon"),
    )


#: The noise placements of a client-level DP run (``privacy.noise_placement``).
PLACEMENTS = ("central", "local", "distributed")


def _number(parent: dict[str, Any], key: str, source: str, where: str = "") -> float | None:
    """``parent[key]`` as a float; None when absent or null.

    Raises:
        CheckpointError: the value is there but not a number (``where`` prefixes its name).
    """
    value = parent.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{source} is damaged: {where}{key} is {value!r}, not a number")
    return float(value)


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


def _accountant_text(mech: Mechanism) -> str:
    if mech.accountant_epsilon is not None:
        return "the run's accountant (summary.json epsilon)"
    if mech.privacy_unit == "example":
        return (
            "none at the client level: the run's DP is example-level (DP-SGD on each client), "
            "whose epsilon bounds one training image's influence, not a client's; the "
            "aggregation audited here is the plain average it uses"
        )
    return "none: the run claims no differential privacy"


def audit_mechanism(
    mech: Mechanism,
    *,
    canaries: int = 1000,
    trials: int = 1000,
    guess_fraction: float = 0.1,
    seed: int = 0,
    alpha: float = DEFAULT_ALPHA,
) -> dict[str, Any]:
    """Empirical epsilon lower bounds of the mechanism, beside the accountant's epsilon.

    Args:
        mech: the run's mechanism (:func:`mechanism_of_run`).
        canaries: ``m`` of the one-run audit (each included with probability 1/2).
        trials: ``n`` of the Clopper-Pearson audit (half with the canary, half without).
        guess_fraction: the one-run audit guesses "in" for this fraction of the highest
            scores and "out" for as many of the lowest (fixed in advance).
        seed: audit randomness (inclusion bits, noise); not a secret.
        alpha: 1 - confidence.
    """
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5
    # the one-run audit ranks its canaries: by the likelihood ratio under client sampling
    scores, expected = canary_scores(mech, included, seed=seed + 10, mixture=True)
    k = max(1, int(guess_fraction * canaries))
    # Two bounds, and the larger is reported: each at alpha / 2, so that both hold at once,
    # and hence the larger, with confidence 1 - alpha (union bound)
    one_run = one_run_audit(
        torch.from_numpy(scores), torch.from_numpy(included),
        k_plus=k, k_minus=k, delta=mech.delta, alpha=alpha / 2,
    )  # fmt: skip
    with_canary = np.arange(trials) < trials // 2
    trial_scores, _ = canary_scores(mech, with_canary, seed=seed + 20)
    threshold = expected / 2.0
    cp = threshold_bound(
        torch.from_numpy(trial_scores[with_canary]), torch.from_numpy(trial_scores[~with_canary]),
        threshold=threshold, delta=mech.delta, alpha=alpha / 2,
    )  # fmt: skip
    accountant = mech.accountant_epsilon
    best = max(one_run, cp, key=lambda b: b.epsilon)
    # The most any outcome of an audit of this size can show: at or below the accountant's
    # epsilon, the audit cannot refute it whatever the mechanism does
    largest = max(one_run.max_epsilon, cp.max_epsilon)
    refutable = accountant is not None and largest > accountant
    needed = None if accountant is None or refutable else trials_to_test(
        accountant, mech.delta, alpha / 2
    )  # fmt: skip
    return {
        "what": "the client-level aggregation as implemented (privacy.dp.client_level: clipping, "
        "noise shares / central noise, denominator), run with the run's z, C, W, placement, "
        "sampling rate and rounds, on worst-case canary clients: an update of norm 2C on a "
        "coordinate no other client touches; the fewest honest clients a released round "
        "has (see mechanism.honest_clients) send zero updates plus their noise shares; "
        "the attacker sees every round's released average",
        "not_covered": "the training data and model (the canaries replace them); secure "
        "aggregation's integer encoding (the continuous Gaussian of the same variance is used)",
        "mechanism": mech.to_dict(),
        "accountant_epsilon": accountant,  # null: no DP claimed (no upper bound)
        "accountant": _accountant_text(mech),
        "delta": mech.delta,
        "one_run": {**one_run.to_dict(), "k_plus": k, "k_minus": k},
        "clopper_pearson": {**cp.to_dict(), "trials": trials, "threshold": threshold},
        "epsilon_lower_bound": best.epsilon,
        # a bound at its method's cap says only "at least this much": a bigger audit could
        # show more (a non-private run always lands here)
        "at_audit_cap": math.isclose(best.epsilon, best.max_epsilon, rel_tol=1e-9),
        "largest_bound_this_audit_can_show": largest,
        # null without a DP claim; false: no outcome of this audit could exceed the claim
        "can_test_accountant": None if accountant is None else refutable,
        # null when the audit can test the claim, or when more than MAX_TRIALS_TO_TEST trials
        # would be needed (an infinite epsilon: no number of trials); the next field says so
        "trials_to_test_accountant": needed,
        "trials_to_test_accountant_more_than": MAX_TRIALS_TO_TEST
        if accountant is not None and not refutable and needed is None
        else None,
        # null when the audit cannot test the claim (it could not have said "exceeds")
        "exceeds_accountant": False
        if accountant is None
        else (best.epsilon > accountant if refutable else None),
        "noise": "numpy PCG64 seeded (reproducible audit; same Gaussian as the run's CSPRNG)",
    }


#: The fewest canaries (and trials) an audit runs, and the most :func:`audit_size` picks
#: (about 50 s for 20 rounds on one core; a larger audit is asked for with --canary-trials).
MIN_AUDIT_TRIALS = 1000
MAX_AUTO_TRIALS = 60_000


def audit_size(mech: Mechanism, alpha: float = DEFAULT_ALPHA) -> int:
    """Canaries and trials for an audit that can test the run's claim.

    Without a claim, :data:`MIN_AUDIT_TRIALS`. With one, 1.25 times the fewest trials whose
    Clopper-Pearson bound can exceed the accountant's epsilon (:func:`trials_to_test`, at the
    ``alpha / 2`` each bound gets), at least :data:`MIN_AUDIT_TRIALS` and at most
    :data:`MAX_AUTO_TRIALS`: a larger claim is then reported as one the audit cannot test.
    """
    eps = mech.accountant_epsilon
    if eps is None:
        return MIN_AUDIT_TRIALS
    need = trials_to_test(eps, mech.delta, alpha / 2)
    if need is None or need > MAX_AUTO_TRIALS:
        return MAX_AUTO_TRIALS
    return min(MAX_AUTO_TRIALS, max(MIN_AUDIT_TRIALS, math.ceil(1.25 * need / 2) * 2))


def _perfect_bound(n: int, delta: float, alpha: float) -> float:
    """The Clopper-Pearson bound of ``n`` trials (half with the canary) all guessed right."""
    half = n // 2
    return clopper_pearson_bound(
        true_positives=half, false_negatives=0, false_positives=0, true_negatives=half,
        delta=delta, alpha=alpha,
    ).epsilon  # fmt: skip


#: The most trials :func:`trials_to_test` names: an accountant's epsilon that needs more
#: (above 25.46 at delta 1e-5 and 95% confidence) is reported as one no practical audit
#: can test.
MAX_TRIALS_TO_TEST = 10**12


def perfect_attack_epsilon(n: float, delta: float, alpha: float) -> float:
    """:func:`_perfect_bound` in closed form, in floats: valid for any number of trials.

    With no error among ``h = n // 2`` trials each way, the one-sided Clopper-Pearson upper
    bound on either rate at ``alpha / 2`` is ``p = 1 - (alpha / 2) ** (1 / h)``, and the bound
    is ``max(log((1 - delta - p) / p), 0)`` (:func:`audits.canary.epsilon_from_rates`).
    """
    half = math.floor(n / 2)
    if half < 1:
        raise ValueError(f"need at least 2 trials, got {n}")
    p = -math.expm1(math.log(alpha / 2) / half)
    return max(math.log((1.0 - delta - p) / p), 0.0) if 1.0 - delta - p > 0 else 0.0


def trials_to_test(
    epsilon: float, delta: float, alpha: float, *, limit: int = MAX_TRIALS_TO_TEST
) -> int | None:
    """The fewest trials whose Clopper-Pearson audit at ``alpha`` can show more than ``epsilon``.

    Half the trials run with the canary; a perfect attack's bound then exceeds ``epsilon``.
    ``None`` when more than ``limit`` trials would be needed, or ``epsilon`` is not finite
    (no number of trials can then show more).

    The count follows from the closed form of :func:`perfect_attack_epsilon`: the bound of
    ``2 h`` trials exceeds ``epsilon`` when ``p < (1 - delta) / (1 + e^epsilon)``, i.e. when
    ``h > log(alpha / 2) / log(1 - (1 - delta) / (1 + e^epsilon))``. The last step is settled
    on the bound the audit itself computes (:func:`_perfect_bound`), so that an audit of the
    size named here can show more than ``epsilon``.
    """
    if not math.isfinite(epsilon):
        return None
    # (1 - delta) / (1 + e^eps), without overflow for a large epsilon
    ratio = (1.0 - delta) / (1.0 + math.exp(epsilon)) if epsilon < 0 else (
        (1.0 - delta) * math.exp(-epsilon) / (1.0 + math.exp(-epsilon))
    )  # fmt: skip
    if ratio <= 0.0:
        return None
    need = math.log(alpha / 2) / math.log1p(-ratio)
    if 2 * need > limit:
        return None
    half = max(1, math.floor(need) + 1)

    def cap(h: int) -> float:
        return _perfect_bound(2 * h, delta, alpha)

    while half > 1 and cap(half - 1) > epsilon:
        half -= 1
    while cap(half) <= epsilon:
        half += 1
    return 2 * half if 2 * half <= limit else None
