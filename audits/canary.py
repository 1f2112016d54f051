"""Empirical lower bounds on epsilon from canary membership tests.

An (epsilon, delta)-DP mechanism bounds every membership test's error rates (Kairouz, Oh &
Viswanath, ICML 2015, Thm. 2.1): ``FPR + e^eps FNR >= 1 - delta`` and
``FNR + e^eps FPR >= 1 - delta``. Observed rates therefore *refute* small epsilons.

**Over many trials** (Jagielski, Ullman & Oprea, "Auditing Differentially Private Machine
Learning: How Private is Private SGD?", NeurIPS 2020, Sec. 4 and Algorithm 2): run the
mechanism with and without the canary, count the attack's false positives and false
negatives, bound both rates from above with one-sided Clopper-Pearson intervals (Clopper &
Pearson, Biometrika 1934), and report::

    eps_lb = max(log((1 - delta - FPR_hi) / FNR_hi), log((1 - delta - FNR_hi) / FPR_hi), 0)

Each rate bound holds with probability ``1 - alpha / 2``, so ``eps_lb`` is a valid lower bound
with confidence at least ``1 - alpha`` (union bound). Even a perfect attack (no error) gets only
``FPR_hi = 1 - (alpha / 2) ** (1 / n)``: the number of trials caps the bound, and that cap is
reported as ``max_epsilon``.

**In one run** (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run",
NeurIPS 2023, Thm. 3.1 for pure DP and its (epsilon, delta) extension in Sec. 5): ``m``
canaries are each included independently with probability 1/2; the auditor guesses
"in" for the ``k_plus`` highest scores and "out" for the ``k_minus`` lowest, abstaining
otherwise (``r = k_plus + k_minus`` guesses, ``v`` correct). Under (epsilon, delta)-DP::

    P[V >= v] <= P[Binomial(r, e^eps / (1 + e^eps)) >= v]
                 + 2 m delta * max_{1 <= i <= v} P[v - i <= Binomial(...) < v] / i

(the p-value of the paper's reference code); ``eps_lb`` is the largest epsilon whose p-value is
below ``alpha``. With ``delta = 0`` this is exactly the pure-DP theorem.

The guess counts and the threshold must be fixed before the scores are seen (or the
confidence divided among the candidates tried, Bonferroni): choosing them on the same scores
overstates the bound. :func:`threshold_audit` splits the trials to do that honestly.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from scipy import stats

DEFAULT_ALPHA = 0.05
"""1 - confidence of every bound (95% confidence)."""

_BISECTION_STEPS = 60


def clopper_pearson_upper(failures: int, trials: int, alpha: float) -> float:
    """One-sided ``1 - alpha`` Clopper-Pearson upper bound on a binomial rate.

    Args:
        failures: observed count ``k``.
        trials: number of trials ``n >= 1``.
        alpha: 1 - confidence.

    Returns:
        ``p`` with ``P[Binomial(n, p) <= k] = alpha`` (1 if ``k == n``), i.e. the
        ``1 - alpha`` quantile of ``Beta(k + 1, n - k)``.
    """
    _check_counts(failures, trials)
    _check_alpha(alpha)
    if failures == trials:
        return 1.0
    return float(stats.beta.ppf(1.0 - alpha, failures + 1, trials - failures))


def clopper_pearson_interval(
    successes: int, trials: int, alpha: float = DEFAULT_ALPHA
) -> tuple[float, float]:
    """Two-sided ``1 - alpha`` Clopper-Pearson ("exact") interval on a binomial rate.

    The interval scipy's ``binomtest(k, n).proportion_ci(method="exact")`` gives: the
    ``alpha / 2`` quantile of ``Beta(k, n - k + 1)`` (0 if ``k == 0``) and the
    ``1 - alpha / 2`` quantile of ``Beta(k + 1, n - k)`` (1 if ``k == n``).

    Args:
        successes: observed count ``k``.
        trials: number of trials ``n >= 1``.
        alpha: 1 - confidence.

    Returns:
        ``(low, high)``.
    """
    _check_counts(successes, trials)
    _check_alpha(alpha)
    low = 0.0 if successes == 0 else float(stats.beta.ppf(alpha / 2, successes,
                                                          trials - successes + 1))  # fmt: skip
    return low, clopper_pearson_upper(successes, trials, alpha / 2)


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """``max(log((1-delta-fpr)/fnr), log((1-delta-fnr)/fpr), 0)`` (Jagielski et al., Sec. 4).

    Both rates must be upper bounds (or true rates) for the result to be a lower bound.
    """
    if not (0 <= fpr <= 1 and 0 <= fnr <= 1):
        raise ValueError(f"rates must be in [0, 1]; got fpr={fpr}, fnr={fnr}")
    _check_delta(delta)
    best = 0.0
    for err_a, err_b in ((fpr, fnr), (fnr, fpr)):
        numerator = 1.0 - delta - err_a
        if numerator <= 0:
            continue
        if err_b == 0:
            return math.inf
        best = max(best, math.log(numerator / err_b))
    return best


@dataclass(frozen=True)
class EpsilonLowerBound:
    """An empirical epsilon lower bound and what it rests on.

    Attributes:
        method: ``"clopper-pearson"`` (many trials) or ``"one-run"``.
        epsilon: the bound: the mechanism is not (epsilon', delta)-DP for any epsilon' below
            it, with probability at least ``confidence`` over the audit's randomness.
        max_epsilon: the bound a perfect attack would get with the same number of trials or
            guesses -- no audit of this size can show more.
        confidence: ``1 - alpha``.
        delta: the delta the bound is stated for.
        counts: the raw counts (JSON-serialisable).
    """

    method: Literal["clopper-pearson", "one-run"]
    epsilon: float
    max_epsilon: float
    confidence: float
    delta: float
    counts: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable form."""
        return {
            "method": self.method,
            "epsilon_lower_bound": self.epsilon,
            "max_epsilon_lower_bound": self.max_epsilon,
            "confidence": self.confidence,
            "delta": self.delta,
            **self.counts,
        }


def clopper_pearson_bound(
    *,
    true_positives: int,
    false_negatives: int,
    false_positives: int,
    true_negatives: int,
    delta: float,
    alpha: float = DEFAULT_ALPHA,
) -> EpsilonLowerBound:
    """Epsilon lower bound from a membership test over independent trials (Jagielski et al.).

    Args:
        true_positives: trials with the canary that the attack called "in".
        false_negatives: trials with the canary called "out".
        false_positives: trials without the canary called "in".
        true_negatives: trials without the canary called "out".
        delta: the delta of the DP claim being tested.
        alpha: 1 - confidence (split evenly between the two rates).

    Returns:
        The bound at confidence ``1 - alpha``, with the cap of a perfect attack.
    """
    positives = true_positives + false_negatives
    negatives = false_positives + true_negatives
    _check_counts(false_negatives, positives)
    _check_counts(false_positives, negatives)
    fnr_hi = clopper_pearson_upper(false_negatives, positives, alpha / 2)
    fpr_hi = clopper_pearson_upper(false_positives, negatives, alpha / 2)
    perfect = epsilon_from_rates(
        clopper_pearson_upper(0, negatives, alpha / 2),
        clopper_pearson_upper(0, positives, alpha / 2),
        delta,
    )
    return EpsilonLowerBound(
        method="clopper-pearson",
        epsilon=epsilon_from_rates(fpr_hi, fnr_hi, delta),
        max_epsilon=perfect,
        confidence=1.0 - alpha,
        delta=delta,
        counts={
            "true_positives": true_positives,
            "false_negatives": false_negatives,
            "false_positives": false_positives,
            "true_negatives": true_negatives,
        },
    )


def threshold_bound(
    scores_in: torch.Tensor,
    scores_out: torch.Tensor,
    *,
    threshold: float,
    delta: float,
    alpha: float = DEFAULT_ALPHA,
) -> EpsilonLowerBound:
    """:func:`clopper_pearson_bound` for the test "score > threshold means the canary is in".

    Args:
        scores_in: ``[n1]`` attack scores of trials run with the canary.
        scores_out: ``[n0]`` attack scores of trials run without it.
        threshold: fixed before these scores were seen.
        delta: the delta of the DP claim being tested.
        alpha: 1 - confidence.
    """
    tp = int((scores_in > threshold).sum())
    fp = int((scores_out > threshold).sum())
    return clopper_pearson_bound(
        true_positives=tp,
        false_negatives=int(scores_in.numel()) - tp,
        false_positives=fp,
        true_negatives=int(scores_out.numel()) - fp,
        delta=delta,
        alpha=alpha,
    )


def best_threshold(
    scores_in: torch.Tensor,
    scores_out: torch.Tensor,
    *,
    delta: float,
    alpha: float = DEFAULT_ALPHA,
    candidates: int = 2000,
) -> float:
    """The threshold whose Clopper-Pearson bound on these trials is largest.

    The criterion is the bound itself (:func:`clopper_pearson_bound` at ``alpha``), not the
    plain error frequencies: those favour far tails, where a handful of trials decides the
    rates and the bound on fresh trials is loose. Candidates are the midpoints between
    consecutive distinct scores (at most ``candidates`` of them, at evenly spaced
    quantiles). Choose on trials set apart from those the bound is computed on.
    """
    values = torch.unique(torch.cat([scores_in, scores_out]).double())
    if values.numel() < 2:
        return float(values[0]) if values.numel() else 0.0
    mids = ((values[1:] + values[:-1]) / 2).numpy()
    if len(mids) > candidates:
        mids = np.unique(np.quantile(mids, np.linspace(0.0, 1.0, candidates)))
    n1, n0 = scores_in.numel(), scores_out.numel()
    if n1 == 0 or n0 == 0:
        return float(mids[len(mids) // 2])
    fn = np.searchsorted(np.sort(scores_in.double().numpy()), mids, side="right")
    fp = n0 - np.searchsorted(np.sort(scores_out.double().numpy()), mids, side="right")

    def upper(k: np.ndarray, n: int) -> np.ndarray:  # clopper_pearson_upper, vectorised
        out = np.ones(len(k))
        below = k < n
        out[below] = stats.beta.ppf(1.0 - alpha / 2, k[below] + 1, n - k[below])
        return out

    fnr, fpr = upper(fn, n1), upper(fp, n0)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.maximum(
            np.log(np.clip(1.0 - delta - fpr, 1e-300, None) / fnr),
            np.log(np.clip(1.0 - delta - fnr, 1e-300, None) / fpr),
        )
    return float(mids[int(np.argmax(eps))])


def threshold_audit(
    scores_in: torch.Tensor,
    scores_out: torch.Tensor,
    *,
    delta: float,
    alpha: float = DEFAULT_ALPHA,
    calibration_fraction: float = 0.5,
) -> tuple[EpsilonLowerBound, float]:
    """Choose the threshold on the first trials, bound epsilon on the others.

    Returns:
        The bound from the held-out trials and the threshold used.
    """
    if not 0 < calibration_fraction < 1:
        raise ValueError(f"calibration_fraction must be in (0, 1), got {calibration_fraction}")
    c1 = int(len(scores_in) * calibration_fraction)
    c0 = int(len(scores_out) * calibration_fraction)
    threshold = best_threshold(scores_in[:c1], scores_out[:c0], delta=delta, alpha=alpha)
    bound = threshold_bound(
        scores_in[c1:], scores_out[c0:], threshold=threshold, delta=delta, alpha=alpha
    )
    return bound, threshold


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P-value of ``>= v`` correct guesses out of ``r`` under (epsilon, delta)-DP (SNJ 2023).

    Args:
        m: canaries, each included with probability 1/2.
        r: guesses made (abstentions excluded).
        v: correct guesses.
        epsilon: DP epsilon of the null hypothesis.
        delta: DP delta of the null hypothesis (0 for pure DP, Thm. 3.1).
    """
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m; got v={v}, r={r}, m={m}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1], got {delta}")
    q = 1.0 / (1.0 + math.exp(-epsilon))  # accuracy of epsilon-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if delta == 0:
        return min(tail, 1.0)
    # window[i - 1] = P[v - i <= Binomial(r, q) < v] for i = 1 .. v
    window = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))
    worst = float(np.max(window / np.arange(1, v + 1))) if v else 0.0
    return min(tail + 2.0 * m * delta * worst, 1.0)


def one_run_bound(
    m: int, r: int, v: int, *, delta: float, alpha: float = DEFAULT_ALPHA
) -> EpsilonLowerBound:
    """Largest epsilon rejected at level ``alpha`` by ``v`` correct guesses out of ``r``.

    Returns:
        The bound, with ``max_epsilon`` the bound of ``r`` correct guesses out of ``r``.
    """
    _check_alpha(alpha)

    def solve(correct: int) -> float:
        if one_run_p_value(m, r, correct, 0.0, delta) >= alpha:
            return 0.0
        lo, hi = 0.0, 1.0
        while one_run_p_value(m, r, correct, hi, delta) < alpha:
            lo, hi = hi, 2.0 * hi
            if hi > 1e4:
                return math.inf
        for _ in range(_BISECTION_STEPS):
            mid = 0.5 * (lo + hi)
            if one_run_p_value(m, r, correct, mid, delta) < alpha:
                lo = mid
            else:
                hi = mid
        return lo

    return EpsilonLowerBound(
        method="one-run",
        epsilon=solve(v),
        max_epsilon=solve(r),
        confidence=1.0 - alpha,
        delta=delta,
        counts={"canaries": m, "guesses": r, "correct": v},
    )


def draw_inclusion(m: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[m]`` bool: each canary included independently with probability 1/2.

    Without ``generator`` the bits come from the OS CSPRNG (:mod:`secrets`), so the trained
    model cannot depend on them; tests may pass a seeded generator.
    """
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if generator is not None:
        return torch.rand(m, generator=generator) < 0.5
    bits = secrets.randbits(m)
    return torch.tensor([(bits >> i) & 1 == 1 for i in range(m)], dtype=torch.bool)


def one_run_audit(
    scores: torch.Tensor,
    included: torch.Tensor,
    *,
    k_plus: int,
    k_minus: int,
    delta: float,
    alpha: float = DEFAULT_ALPHA,
) -> EpsilonLowerBound:
    """Guess "in" for the ``k_plus`` highest scores, "out" for the ``k_minus`` lowest; bound.

    Args:
        scores: ``[m]`` membership scores (higher = more likely included), one per canary.
        included: ``[m]`` bool, which canaries were really included.
        k_plus: positive guesses (fixed in advance).
        k_minus: negative guesses (fixed in advance).
        delta: the delta of the DP claim being tested.
        alpha: 1 - confidence.
    """
    m = int(scores.numel())
    if included.shape != scores.shape or included.dtype != torch.bool:
        raise ValueError("included must be a bool tensor shaped like scores")
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise ValueError(f"need k_plus, k_minus >= 0 and k_plus + k_minus <= m={m}")
    order = torch.argsort(scores, descending=True, stable=True)
    correct = int(included[order[:k_plus]].sum())
    if k_minus:
        correct += int((~included[order[m - k_minus :]]).sum())
    return one_run_bound(m, k_plus + k_minus, correct, delta=delta, alpha=alpha)


def _check_counts(k: int, n: int) -> None:
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"need n >= 1 trials and 0 <= count <= n; got count={k}, n={n}")


def _check_alpha(alpha: float) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def _check_delta(delta: float) -> None:
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
