"""Empirical epsilon of a run's client-level aggregation, beside the accountant's, and its size.

Two bounds (:mod:`audits.canary`) from the canaries' scores (:mod:`audits.canary_release`):
one run with ``m`` canaries each included with probability 1/2 (Steinke, Nasr & Jagielski
2023), ranked by the log-likelihood ratio of the rounds, and ``n`` independent trials with and
without a canary, Clopper-Pearson (Jagielski et al. 2020), scored by the sum over rounds with
its threshold fixed in advance (valid but looser under client sampling). The trials are the
coordinates of one release: each trial's canary is its own client on its own coordinate and
the noise is independent per coordinate, so they are independent runs of the mechanism. The
decision threshold of the trials is fixed in advance at half the canary's expected
contribution.

An audit can show no more than a perfect attack on its trials: :func:`audit_size` sizes it so
that it can test the accountant's epsilon (:func:`trials_to_test`), and the result says when
it cannot.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from audits.canary import (
    DEFAULT_ALPHA,
    clopper_pearson_bound,
    one_run_audit,
    threshold_bound,
)
from audits.canary_release import canary_scores
from audits.mechanism import Mechanism


def _accountant_text(mech: Mechanism) -> str:
    if mech.accountant_epsilon is not None:
        return "the run's accountant (summary.json epsilon)"
    if mech.privacy_unit in ("example", "identity"):
        record = "one training image's" if mech.privacy_unit == "example" else "one person's"
        return (
            f"none at the client level: the run's DP is {mech.privacy_unit}-level (DP-SGD on "
            f"each client), whose epsilon bounds {record} influence, not a client's; the "
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
        mech: the run's mechanism (:func:`audits.mechanism.mechanism_of_run`).
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
