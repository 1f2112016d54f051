"""The discrete Gaussian and the distributed discrete Gaussian mechanism (integer DP noise).

Secure aggregation sums integers mod ``2^k``; continuous Gaussian noise has to be rounded
into that domain, and a rounded Gaussian is not the distribution the accountant analyses.
The rigorous form is integer noise:

* the **discrete Gaussian** ``N_Z(0, sigma^2)``, ``P[Y = y] ∝ exp(-y^2 / (2 sigma^2))`` on the
  integers, sampled by Canonne, Kamath & Steinke, "The Discrete Gaussian for Differential
  Privacy", NeurIPS 2020, Algorithm 3 (rejection from a discrete Laplace with scale
  ``t = floor(sigma) + 1``, itself sampled by Algorithm 2), vectorised over a whole update;
* the **distributed discrete Gaussian** of Kairouz, Liu & Steinke, "The Distributed Discrete
  Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML 2021: each client
  scales its clipped update by ``1 / gamma``, rounds it randomly (unbiased) to integers, and
  adds ``N_Z(0, sigma^2)``; the sum of ``m`` clients carries the sum of ``m`` discrete
  Gaussians, which their Theorem 1 shows is
  ``1/2 eps^2``-concentrated DP with

      eps = min( sqrt(D2^2 / (m sigma^2) + tau d / 2),  D1 / sqrt(m sigma^2) + tau sqrt(d) ),
      tau = 10 * sum_{k=1}^{m-1} exp(-2 pi^2 sigma^2 k / (k + 1)),

  where ``D2`` / ``D1`` bound the L2 / L1 norm of one client's integer vector. With
  ``sigma >> 1`` (``sigma`` is in units of ``gamma``), ``tau`` underflows to 0 and the bound
  is the zCDP bound of a Gaussian with noise multiplier ``sqrt(m) sigma / D2``. It is a
  zCDP bound, not the Gaussian's privacy curve: the run accounts it as such
  (:mod:`privacy.dp.zcdp`; quickstart: epsilon 8.59 where the continuous
  Gaussian's PLD would state 7.99 for the same noise).

The rejection steps compare floating-point uniforms with ``exp(.)``, so this is the
"approximately exact" float version of the samplers (the exact one uses rational
arithmetic); uniforms come from the CSPRNG of :mod:`privacy.dp.noise` (or a seeded source in
tests).
"""

from __future__ import annotations

import math

import numpy as np

from fl_secure.errors import PrivacyError, ProtocolError
from privacy.dp.noise import NoiseSource

ZCDP_SLACK = 1e-9
"""Relative allowance on the ``rho = 1 / (2 z^2)`` a discrete Gaussian release is charged
(:mod:`privacy.dp.zcdp`): it covers KLS21's ``tau`` term (:func:`check_ddg_slack`)
and the floating-point error of a clipped norm."""


def _bernoulli_exp(source: NoiseSource, gamma: np.ndarray) -> np.ndarray:
    """Bernoulli(exp(-gamma)) per entry (float comparison)."""
    hits: np.ndarray = source.uniform(gamma.size).reshape(gamma.shape) < np.exp(-gamma)
    return hits


def sample_discrete_laplace(source: NoiseSource, scale: int, n: int) -> np.ndarray:
    """``n`` draws of the discrete Laplace with ``P[Y = y] ∝ exp(-|y| / scale)`` (CKS20 Alg. 2).

    Args:
        source: Uniforms.
        scale: ``t``, a positive integer.
        n: Number of draws.
    """
    if scale < 1:
        raise PrivacyError(f"discrete Laplace scale must be an integer >= 1, got {scale}")
    out = np.empty(n, dtype=np.int64)
    filled = 0
    while filled < n:
        m = max(2 * (n - filled), 64)
        u = np.floor(source.uniform(m) * scale).astype(np.int64)  # uniform on {0..t-1}
        keep = _bernoulli_exp(source, u / scale)
        # V ~ geometric: the number of Bernoulli(exp(-1)) successes before the first failure
        v = np.floor(-np.log1p(-source.uniform(m))).astype(np.int64)
        x = u + scale * v
        negative = source.uniform(m) < 0.5
        keep &= ~(negative & (x == 0))  # y = -0 would count zero twice
        y = np.where(negative, -x, x)[keep]
        take = min(y.size, n - filled)
        out[filled : filled + take] = y[:take]
        filled += take
    return out


def sample_discrete_gaussian(source: NoiseSource, sigma: float, n: int) -> np.ndarray:
    """``n`` draws of ``N_Z(0, sigma^2)`` (CKS20 Algorithm 3), as int64."""
    if not (math.isfinite(sigma) and sigma > 0):
        raise PrivacyError(f"discrete Gaussian sigma must be a finite number > 0, got {sigma!r}")
    t = math.floor(sigma) + 1
    out = np.empty(n, dtype=np.int64)
    filled = 0
    while filled < n:
        m = max(2 * (n - filled), 64)
        y = sample_discrete_laplace(source, t, m)
        gamma = (np.abs(y) - sigma**2 / t) ** 2 / (2 * sigma**2)
        accepted = y[_bernoulli_exp(source, gamma)]
        take = min(accepted.size, n - filled)
        out[filled : filled + take] = accepted[:take]
        filled += take
    return out


def randomized_round(source: NoiseSource, x: np.ndarray) -> np.ndarray:
    """Unbiased rounding to integers: ``floor(x) + Bernoulli(x - floor(x))``."""
    low = np.floor(x)
    up = source.uniform(x.size).reshape(x.shape) < (x - low)
    rounded: np.ndarray = (low + up).astype(np.int64)
    return rounded


def integer_l2_bound(clip_norm: float, gamma: float, d: int) -> float:
    """Bound on ``||round(x / gamma)||_2`` for ``||x||_2 <= clip_norm``: ``C / gamma + sqrt(d)``.

    Each coordinate moves by less than 1 when rounded, so the rounding error has L2 norm
    below ``sqrt(d)`` (a deterministic bound, no conditional re-rounding needed).
    """
    return clip_norm / gamma + math.sqrt(d)


def ddg_tau(sigma: float, m: int) -> float:
    """KLS21 Theorem 1's ``tau = 10 sum_{k=1}^{m-1} exp(-2 pi^2 sigma^2 k / (k + 1))``."""
    return 10.0 * sum(math.exp(-2 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, m))


def ddg_concentrated_epsilon(sigma: float, m: int, l2_bound: float, d: int) -> float:
    """KLS21 Theorem 1 (L2 branch): the concentrated-DP ``eps`` of a sum of ``m`` noises.

    The sum of ``m`` ``N_Z(0, sigma^2)`` vectors is ``1/2 eps^2``-concentrated DP for one
    client's integer vector of L2 norm ``<= l2_bound``.
    """
    tau = ddg_tau(sigma, m)
    return math.sqrt(l2_bound**2 / (m * sigma**2) + tau * d / 2)


def ddg_tau_rho(sigma: float, m: int, d: int) -> float:
    """KLS21 Theorem 1's excess over a Gaussian in ``rho = eps^2 / 2``: ``tau d / 4``."""
    return ddg_tau(sigma, m) * d / 4.0


def check_ddg_slack(sigma: float, n: int, d: int, noise_multiplier: float) -> None:
    """Refuse a distributed discrete Gaussian whose ``tau`` term passes :data:`ZCDP_SLACK`.

    The accountant charges each release ``rho = (1 + ZCDP_SLACK) / (2 z^2)``; any ``m`` of at
    most ``n`` shares (``t <= m <= n``, ``sigma = z D2 / sqrt(t)``) are
    ``D2^2 / (2 m sigma^2) + tau(sigma, m) d / 4 <= 1 / (2 z^2) + tau(sigma, n) d / 4``-zCDP
    (``tau`` grows with ``m``), so ``tau(sigma, n) d / 4 <= ZCDP_SLACK / (2 z^2)`` keeps the
    charge an upper bound.

    Raises:
        PrivacyError: The ``tau`` term is larger (``sigma`` too small in integer units).
    """
    excess = ddg_tau_rho(sigma, n, d)
    if excess > ZCDP_SLACK / (2.0 * noise_multiplier**2):
        raise PrivacyError(
            f"the discrete Gaussian with sigma {sigma:.3g} is not as private as z = "
            f"{noise_multiplier:g}: KLS21's tau term adds {excess:.3g} to rho; raise "
            "secure_aggregation.scale_bits"
        )


def ddg_noise_multiplier(sigma: float, m: int, l2_bound: float, d: int) -> float:
    """The Gaussian noise multiplier with the same concentrated-DP bound: ``1 / eps``.

    A Gaussian mechanism with noise multiplier ``z`` is ``1/(2 z^2)``-zCDP, so the sum is
    accounted as a Gaussian with ``z = 1 / eps`` (equal to ``sqrt(m) sigma / l2_bound`` when
    ``tau`` is negligible).
    """
    return 1.0 / ddg_concentrated_epsilon(sigma, m, l2_bound, d)


def ddg_client_sigma(noise_multiplier: float, l2_bound: float, min_survivors: int) -> float:
    """One client's ``sigma`` so that any ``min_survivors`` sum to ``noise_multiplier * D2``."""
    if min_survivors < 1:
        raise PrivacyError(f"min_survivors must be >= 1, got {min_survivors}")
    return noise_multiplier * l2_bound / math.sqrt(min_survivors)


def ddg_encode(
    source: NoiseSource,
    clipped: np.ndarray,
    *,
    gamma: float,
    sigma: float,
    modulus_bits: int,
) -> np.ndarray:
    """A client's distributed-discrete-Gaussian vector mod ``2^modulus_bits`` (uint64).

    ``clipped`` is the flattened update already clipped to L2 norm ``C``; the result is
    ``randomized_round(clipped / gamma) + N_Z(0, sigma^2)`` reduced mod ``2^bits``.
    """
    ints = randomized_round(source, np.asarray(clipped, dtype=np.float64) / gamma)
    ints += sample_discrete_gaussian(source, sigma, ints.size)
    if not 1 <= modulus_bits <= 62:
        raise PrivacyError(f"modulus_bits = {modulus_bits}: the encoding supports 1..62")
    return ints.astype(np.uint64) & np.uint64((1 << modulus_bits) - 1)  # negatives wrap


def ddg_decode(
    total: np.ndarray, *, gamma: float, modulus_bits: int, bound: float | None = None
) -> np.ndarray:
    """Centered lift of a sum mod ``2^bits`` (``bits <= 62``) back to reals, times ``gamma``.

    Raises:
        ProtocolError: A lifted value exceeds ``bound`` (integer units): the sum is corrupted.
    """
    if not 1 <= modulus_bits <= 62:
        raise PrivacyError(f"modulus_bits = {modulus_bits}: the lift supports 1..62")
    values = np.asarray(total, dtype=np.uint64).astype(np.int64)
    values = np.where(values >= 1 << (modulus_bits - 1), values - (1 << modulus_bits), values)
    if bound is not None and values.size:
        peak = int(np.abs(values).max())
        if peak > bound:
            raise ProtocolError(
                f"decoded sum has a coordinate of magnitude {peak} > {bound:.6g}, more than "
                "the survivors' clipped, noised inputs can produce: the sum is corrupted"
            )
    return values.astype(np.float64) * gamma
