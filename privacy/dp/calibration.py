"""Stateless privacy maths: epsilon of a schedule, and the noise that meets a budget.

``calibrate_noise`` brackets the noise multiplier geometrically and bisects it, relying on
epsilon being non-increasing in the noise multiplier (true of the subsampled Gaussian for
all three accountants). The returned ``z`` is always *verified*: ``epsilon(z) <= target``.
It is also tight: ``epsilon(z) >= (1 - tolerance) * target`` and the bracket below it,
``z * (1 - tolerance)``, was shown to exceed the target (so ``z`` is within ``tolerance``
of the smallest admissible noise multiplier).
"""

from __future__ import annotations

import math

from fl_secure.errors import PrivacyError
from privacy.dp.accountants.accountant import MIN_ACCOUNTED_NOISE, Noise, Sampling, check_delta
from privacy.dp.accountants.registry import create_accountant

MIN_NOISE_MULTIPLIER = MIN_ACCOUNTED_NOISE
"""Calibration never goes below this (smaller values make epsilon meaningless anyway)."""

MAX_NOISE_MULTIPLIER = 1000.0
"""Calibration gives up above this: the target is then declared unreachable."""

_MAX_ITERATIONS = 100

HOPELESS_EPSILON = 1000.0
"""Above this RDP epsilon the PLD and PRV accountants are not run. Their discretised privacy
loss grows with epsilon (measured: 1 GB at epsilon ~650, 5 GB at ~55,000, over 20 GB beyond),
and no such epsilon is a guarantee; RDP bounds it cheaply."""


class HopelessSchedule(PrivacyError):
    """The schedule's epsilon exceeds :data:`HOPELESS_EPSILON` (by the RDP bound)."""

    def __init__(self, bound: float, accountant: str) -> None:
        super().__init__(
            f"this schedule spends epsilon > {HOPELESS_EPSILON:g} (RDP bound {bound:.4g}): no "
            f"guarantee at all; the {accountant} accountant is not run for it (its grid would "
            "take many GB); add noise, or lower the sample rate or the steps"
        )
        self.bound = bound


def epsilon_for(
    *,
    accountant: str,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    sampling: Sampling = "poisson",
    population: int | None = None,
    noise: Noise = "gaussian",
) -> float:
    """Epsilon spent by ``steps`` subsampled-Gaussian releases, at ``delta``.

    ``noise = "discrete_gaussian"``: integer noise, accounted by its zCDP bound
    (:mod:`privacy.dp.zcdp`) whichever ``accountant`` is named.

    Raises:
        PrivacyError: Unknown accountant, a value out of range, or a sampling scheme the
            accountant cannot analyse.
        HopelessSchedule: PLD or PRV asked for a schedule whose RDP epsilon is above
            :data:`HOPELESS_EPSILON`.
    """
    if accountant in ("pld", "prv") and sampling == "poisson" and noise == "gaussian":
        bound = epsilon_for(
            accountant="rdp", noise_multiplier=noise_multiplier, sample_rate=sample_rate,
            steps=steps, delta=delta, sampling=sampling, population=population,
        )  # fmt: skip
        if bound > HOPELESS_EPSILON:
            raise HopelessSchedule(bound, accountant)
    acc = create_accountant(accountant)
    acc.step(
        noise_multiplier=noise_multiplier,
        sample_rate=sample_rate,
        num_steps=steps,
        sampling=sampling,
        population=population,
        noise=noise,
    )
    return acc.get_epsilon(delta)


def calibrate_noise(
    *,
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
    tolerance: float = 0.01,
    sampling: Sampling = "poisson",
    population: int | None = None,
    noise: Noise = "gaussian",
) -> float:
    """Smallest noise multiplier (within ``tolerance``) whose epsilon is <= ``target_epsilon``.

    Raises:
        PrivacyError: A value is out of range, or the target cannot be met with a noise
            multiplier in [``MIN_NOISE_MULTIPLIER``, ``MAX_NOISE_MULTIPLIER``].
    """
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise PrivacyError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    if not (0 < tolerance < 0.5):
        raise PrivacyError(f"tolerance must be in (0, 0.5), got {tolerance!r}")
    check_delta(delta)

    def eps(z: float) -> float:
        try:
            return epsilon_for(
                accountant=accountant,
                noise_multiplier=z,
                sample_rate=sample_rate,
                steps=steps,
                delta=delta,
                sampling=sampling,
                population=population,
                noise=noise,
            )
        except HopelessSchedule as exc:  # far above any target: more noise is needed
            if target_epsilon >= HOPELESS_EPSILON:
                raise
            return exc.bound

    # Bracket: eps(lo) > target >= eps(hi).
    hi = 1.0
    while eps(hi) > target_epsilon:
        if hi >= MAX_NOISE_MULTIPLIER:
            raise PrivacyError(
                f"target_epsilon={target_epsilon} is unreachable: even noise_multiplier="
                f"{MAX_NOISE_MULTIPLIER:g} spends more at delta={delta}; raise the target or "
                f"delta, or lower sample_rate or steps"
            )
        hi = min(2.0 * hi, MAX_NOISE_MULTIPLIER)
    lo = hi / 2.0
    while eps(lo) <= target_epsilon:
        hi = lo
        if lo <= MIN_NOISE_MULTIPLIER:
            raise PrivacyError(
                f"target_epsilon={target_epsilon} is met even at noise_multiplier="
                f"{MIN_NOISE_MULTIPLIER:g}; such a budget gives no meaningful protection, "
                f"lower the target"
            )
        lo = max(lo / 2.0, MIN_NOISE_MULTIPLIER)

    # Bisect until z is tight in both noise and epsilon.
    eps_hi = eps(hi)
    for _ in range(_MAX_ITERATIONS):
        if hi - lo <= tolerance * hi and eps_hi >= (1.0 - tolerance) * target_epsilon:
            break
        mid = 0.5 * (lo + hi)
        eps_mid = eps(mid)
        if eps_mid <= target_epsilon:
            hi, eps_hi = mid, eps_mid
        else:
            lo = mid
    return hi
