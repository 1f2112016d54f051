"""Client-level differential privacy of federated updates (DP-FedAvg).

Implements the clip-and-noise step of DP-FedAvg (McMahan, Ramage, Talwar & Zhang, "Learning
differentially private recurrent language models", ICLR 2018, Algorithm 1 with the fixed
denominator estimator) as AdaFedFR (Algorithm 1, lines 23-26) applies it to the shared
parameters of a face model:

    clip:   Delta_k <- Delta_k * min(1, C / ||Delta_k||_2)            (line 24)
    noise:  Delta   <- (sum_k Delta_k + N(0, (z C)^2 I)) / W          (lines 25-26)

``W`` is the *expected* cohort size (``q N`` for Poisson sampling, the cohort size for fixed
cohorts), never the number of updates that arrived, so the average has sensitivity ``C / W``
whoever participates. Where the noise is added (``noise_placement``):

* ``local``: each client adds ``N(0, (z C)^2)`` to its own clipped update, so each update is
  private by itself and the sum carries variance ``m (z C)^2 >= (z C)^2`` for ``m >= 1``
  survivors. It is accounted as ``z`` (conservative by ``sqrt(m)``) under zero-out
  adjacency with Poisson cohorts: a client's own noise share goes with it, so add/remove
  would compare sums of different variances
  (:func:`privacy.dp.accountants.accountant.client_adjacency`); the same holds for
  ``distributed``.
* ``distributed``: each of the cohort adds ``N(0, (z C)^2 / t)`` where ``t`` is the smallest
  number of survivors the round accepts, so the sum over ``m >= t`` survivors carries variance
  ``m / t (z C)^2 >= (z C)^2``. Needs secure aggregation so the server never holds an
  un-noised sum.
* ``central``: the server adds ``N(0, (z C)^2)`` to the sum (the server is trusted).

Updates are flattened over every shared tensor for the L2 norm (one vector per client).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fl_secure.aggregation import StreamingSum
from fl_secure.config import PrivacyConfig
from fl_secure.errors import PrivacyError, ProtocolError, UpdateError
from fl_secure.messages import Tensors, TensorSpec
from privacy.dp.amplification import accounted_sample_rate
from privacy.dp.calibration import calibrate_noise
from privacy.dp.noise import NoiseSource, gaussian_like


def update_norm(update: Mapping[str, np.ndarray]) -> float:
    """L2 norm of the update flattened over all its tensors (computed in float64)."""
    total = 0.0
    for array in update.values():
        flat = np.asarray(array, dtype=np.float64).ravel()
        total += float(flat @ flat)
    return math.sqrt(total)


def clip_update(update: Mapping[str, np.ndarray], clip_norm: float) -> tuple[Tensors, float]:
    """``update * min(1, C / ||update||)`` (AdaFedFR Alg. 1 line 24); also the norm before."""
    if not clip_norm > 0:
        raise PrivacyError(f"clip_norm must be > 0, got {clip_norm!r}")
    norm = update_norm(update)
    if not math.isfinite(norm):
        raise UpdateError("the update contains NaN or infinity; refusing to release it")
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    clipped = OrderedDict(
        (k, (np.asarray(v, dtype=np.float64) * factor).astype(v.dtype)) for k, v in update.items()
    )
    return clipped, norm


def add_gaussian(update: Mapping[str, np.ndarray], std: float, source: NoiseSource) -> Tensors:
    """``update + N(0, std^2 I)`` with noise from ``source``, in each tensor's dtype."""
    return OrderedDict(
        (k, (v + gaussian_like(source, np.asarray(v), std)).astype(v.dtype))
        for k, v in update.items()
    )


def distributed_share_std(noise_multiplier: float, clip_norm: float, min_survivors: int) -> float:
    """Std of one client's noise share so that any ``>= min_survivors`` shares sum to >= z C."""
    if min_survivors < 1:
        raise PrivacyError(f"min_survivors must be >= 1, got {min_survivors}")
    return noise_multiplier * clip_norm / math.sqrt(min_survivors)


def client_noise_std(placement: str, noise_multiplier: float, clip_norm: float, t: int) -> float:
    """Noise std a client adds to its clipped update in ``placement`` (0 for central)."""
    if placement == "local":
        return noise_multiplier * clip_norm
    if placement == "distributed":
        return distributed_share_std(noise_multiplier, clip_norm, t)
    if placement == "central":
        return 0.0
    raise PrivacyError(
        f"unknown noise placement {placement!r}; allowed: local, distributed, central"
    )


def placement_noise(placement: str) -> str:
    """The noise a placement releases to the server: integer noise unless it is ``central``.

    ``distributed``: the distributed discrete Gaussian (secure aggregation over integers);
    ``local``: each client's update on a grid plus discrete Gaussian noise
    (:func:`privacy.dp.grid_noise.add_grid_discrete_gaussian`). Both are accounted by their
    zCDP bound (:mod:`privacy.dp.zcdp`).
    """
    return "gaussian" if placement == "central" else "discrete_gaussian"


def effective_noise_multiplier(
    placement: str, noise_multiplier: float, survivors: int, min_survivors: int
) -> float:
    """Noise multiplier the released sum actually carries, as accounted.

    ``local`` is accounted as ``z`` although ``m`` shares carry ``sqrt(m) z`` (one honest
    client's noise suffices); ``distributed`` carries ``sqrt(m / t) z`` with ``m`` survivors.
    """
    if placement == "distributed":
        if survivors < min_survivors:
            raise PrivacyError(
                f"only {survivors} of the required {min_survivors} noise shares arrived; the "
                "sum does not carry the configured noise and must not be released"
            )
        return noise_multiplier * math.sqrt(survivors / min_survivors)
    return noise_multiplier


class NoisyClippedSum(StreamingSum):
    """DP-FedAvg aggregation: (sum of clipped updates + central noise) / expected cohort size.

    An :class:`~fl_secure.aggregation.Aggregator` like
    :class:`~fl_secure.aggregation.StreamingMean` (``add``, ``mean``) over the same running
    float64 sums: weights are ignored (every client counts the same, as the sensitivity
    analysis needs); updates are re-clipped on arrival when ``reclip`` (central placement: a
    client that did not clip cannot raise the sensitivity); ``central_std`` is the noise the
    server adds.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        *,
        clip_norm: float,
        denominator: float,
        central_std: float,
        source: NoiseSource,
        reclip: bool,
    ) -> None:
        if not denominator > 0:
            raise PrivacyError(f"denominator must be > 0, got {denominator!r}")
        super().__init__(specs)
        self.clip_norm = clip_norm
        self.denominator = denominator
        self.central_std = central_std
        self.source = source
        self.reclip = reclip
        self.clipped = 0

    def add(self, tensors: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold one client's update in (``weight`` is ignored: uniform weighting)."""
        del weight
        self.check(tensors)
        if self.reclip:
            clipped, norm = clip_update(tensors, self.clip_norm)
            self.clipped += int(norm > self.clip_norm)
            tensors = clipped
        self.fold(tensors)

    def mean(self) -> Tensors:
        """``(sum + N(0, central_std^2)) / denominator`` cast back to each tensor's dtype."""
        if self.count == 0:
            raise ProtocolError("no update to average")
        out: Tensors = OrderedDict()
        for s in self.specs:
            total = self.total(s.name)
            if self.central_std > 0:
                total = total + gaussian_like(self.source, total, self.central_std)
            out[s.name] = (total / self.denominator).astype(s.dtype)
        return out


@dataclass(frozen=True)
class ClientLevelPlan:
    """The client-level mechanism of a run, fixed before the first round."""

    noise_multiplier: float
    clip_norm: float
    sample_rate: float  # cohort inclusion probability (Poisson) or cohort / population
    sampling: str  # "poisson" or "fixed_size"
    population: int  # enrolled clients
    denominator: float  # expected cohort size W
    placement: str
    accountant: str
    delta: float
    target_epsilon: float
    rounds: int
    calibrated: bool
    #: The inclusion probability the stated epsilon is accounted at: 1 for Poisson cohorts
    #: (:func:`accounted_sample_rate`), ``sample_rate`` for fixed-size ones.
    accounted_rate: float = 1.0

    @property
    def amplified(self) -> bool:
        """Whether the stated epsilon takes amplification by the server's cohort sampling."""
        return self.accounted_rate < 1.0

    @property
    def noise(self) -> str:
        """``gaussian`` or ``discrete_gaussian`` (:func:`placement_noise`)."""
        return placement_noise(self.placement)

    def event(self, noise_multiplier: float | None = None) -> dict[str, Any]:
        """One round's accountant event, at the accounted rate (``noise_multiplier``: ``z``)."""
        return {
            "noise_multiplier": noise_multiplier or self.noise_multiplier,
            "sample_rate": self.accounted_rate,
            "num_steps": 1,
            "sampling": self.sampling,
            "population": self.population if self.sampling == "fixed_size" else None,
            "noise": self.noise,
        }

    def amplified_event(self) -> dict[str, Any]:
        """One round's event at the drawn rate: the figure trusting the server's sampling."""
        return {**self.event(), "sample_rate": self.sample_rate}


def plan_client_level(
    *,
    noise_multiplier: float,
    clip_norm: float,
    target_epsilon: float,
    delta: float,
    accountant: str,
    placement: str,
    rounds: int,
    population: int,
    clients_per_round: int,
    sample_rate: float,
) -> ClientLevelPlan:
    """Sampling, denominator and (if ``noise_multiplier`` is 0) the calibrated noise."""
    if population < 1:
        raise PrivacyError("client-level DP needs at least one enrolled client")
    if sample_rate > 0:
        sampling, q, denominator = "poisson", sample_rate, sample_rate * population
    elif 0 < clients_per_round < population:
        sampling, q, denominator = "fixed_size", clients_per_round / population, clients_per_round
    else:
        sampling, q, denominator = "poisson", 1.0, float(population)
    if sampling == "fixed_size" and accountant != "pld":
        raise PrivacyError(
            f"fixed-size cohorts (server.clients_per_round = {clients_per_round}) are only "
            f"analysed by the 'pld' accountant, not {accountant!r}; set privacy.accountant = "
            "'pld' or use Poisson cohorts (server.sample_rate)"
        )
    accounted = accounted_sample_rate(sampling, q)
    calibrated = noise_multiplier == 0
    if calibrated:
        noise_multiplier = calibrate_noise(
            target_epsilon=target_epsilon,
            sample_rate=accounted,
            steps=rounds,
            delta=delta,
            accountant=accountant,
            sampling=sampling,  # type: ignore[arg-type]
            population=population if sampling == "fixed_size" else None,
            noise=placement_noise(placement),  # type: ignore[arg-type]
        )
    return ClientLevelPlan(
        noise_multiplier=noise_multiplier,
        clip_norm=clip_norm,
        sample_rate=q,
        sampling=sampling,
        population=population,
        denominator=denominator,
        placement=placement,
        accountant=accountant,
        delta=delta,
        target_epsilon=target_epsilon,
        rounds=rounds,
        calibrated=calibrated,
        accounted_rate=accounted,
    )


def client_level_plan(
    cfg: PrivacyConfig, *, rounds: int, population: int, clients_per_round: int, sample_rate: float
) -> ClientLevelPlan:
    """The client-level mechanism a ``[privacy]`` section and the cohort settings define."""
    plan = plan_client_level(
        noise_multiplier=cfg.noise_multiplier,
        clip_norm=cfg.clip_norm,
        target_epsilon=cfg.target_epsilon,
        delta=cfg.delta,
        accountant=cfg.accountant_name(),
        placement=cfg.noise_placement,
        rounds=rounds,
        population=population,
        clients_per_round=clients_per_round,
        sample_rate=sample_rate,
    )
    if not math.isfinite(plan.noise_multiplier):  # pragma: no cover - calibration guards
        raise PrivacyError("calibration returned a non-finite noise multiplier")
    return plan


def server_aggregator(
    specs: Sequence[TensorSpec],
    *,
    placement: str,
    noise_multiplier: float,
    clip_norm: float,
    denominator: float,
    source: NoiseSource,
    sees_updates: bool = True,
) -> NoisyClippedSum:
    """The server's DP-FedAvg aggregator for a noise placement (the run's and the audit's).

    Only under ``central`` placement does the server add the noise (``z C``) and, when it
    sees individual updates (``sees_updates``; not a securely aggregated sum), re-clip them.
    """
    central = placement == "central"
    return NoisyClippedSum(
        specs,
        clip_norm=clip_norm,
        denominator=denominator,
        central_std=noise_multiplier * clip_norm if central else 0.0,
        source=source,
        reclip=central and sees_updates,
    )
