"""Checks of a run's config that need no run directory, so a bad config leaves nothing behind.

DP-SGD needs a model Opacus can train; secure aggregation's threshold and fixed-point modulus
must fit the largest cohort; client-level noise must be calibratable to the budget and fit the
secure-aggregation encoding. :func:`server.bootstrap.build_server` repeats what depends on the
run (the noise it calibrated, the model's size).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from fl_secure.algorithms import check_config
from fl_secure.errors import ConfigError, PrivacyError
from fl_secure.training import build_run_model
from privacy.dp.client_level import client_level_plan, client_noise_std
from privacy.secagg.encoding import check_modulus
from privacy.secagg.round_setup import check_ddg, neighbourhood

if TYPE_CHECKING:
    from torch import nn

    from fl_secure.config import Config
    from privacy.dp.client_level import ClientLevelPlan
    from privacy.server_round import ServerPrivacy

#: A noisy coordinate beyond this many standard deviations is clipped by the fixed-point
#: encoding; at 8 sigma that happens with probability ~1e-15 per coordinate.
ENCODING_SIGMAS = 8.0


def preflight(config: Config, population: int) -> None:
    """The checks that need no run directory, so a bad config leaves nothing behind.

    Raises:
        ConfigError: Naming the setting that cannot work, and why.
    """
    check_config(config)
    # an unknown backbone or unusable pretrained weights: refused before a run dir exists
    model = build_run_model(config, 1)
    if (
        config.data.source != "synthetic"
        and config.data.path
        and not Path(config.data.path).exists()
    ):
        raise ConfigError(f"data.path {config.data.path} does not exist")
    _check_secagg_cohort(config, population)
    check_dpsgd_model(config, model)
    if config.privacy.unit == "client":
        plan = client_level_plan(
            config.privacy,
            rounds=config.train.rounds,
            population=population,
            clients_per_round=config.server.clients_per_round,
            sample_rate=config.server.sample_rate,
        )
        _check_plan_encoding(config, plan)


def largest_cohort(config: Config, population: int) -> int:
    """The most clients a round of the run can have (``clients_per_round``, or everyone)."""
    return min(config.server.clients_per_round or population, population)


def check_dpsgd_model(config: Config, model: nn.Module) -> None:
    """Under DP-SGD (example or identity unit), refuse a model it cannot train, before training.

    Raises:
        ConfigError: Naming ``model.backbone`` and what Opacus cannot handle.
    """
    if not config.privacy.dpsgd:
        return
    # deferred: privacy.dp.dpsgd imports opacus, which only example-level DP needs
    from privacy.dp.dpsgd import validate_model

    try:
        validate_model(model)
    except PrivacyError as exc:
        raise ConfigError(f"model.backbone = {config.model.backbone!r}: {exc}") from exc


def _check_secagg_cohort(config: Config, population: int) -> None:
    """The threshold and the fixed-point modulus against the largest cohort the run can have.

    The round setup repeats both checks for the actual cohort; here a configuration that
    cannot work is refused before a run directory exists rather than at round 1.
    """
    sa = config.secure_aggregation
    if sa.scheme not in ("secagg", "secagg+"):
        return
    n = largest_cohort(config, population)
    try:
        neighbourhood(sa, n)
        check_modulus(n, sa.clip_range, float(2**sa.scale_bits), sa.modulus_bits)
    except PrivacyError as exc:
        raise ConfigError(f"secure_aggregation: {exc}") from exc


def check_encoding_range(
    config: Config, privacy: ServerPrivacy | None, vector_length: int, population: int
) -> None:
    """Under secure aggregation, clipped + noised updates must fit the encoding's range.

    With distributed noise, the discrete Gaussian of the largest cohort must be as private
    as the accounted Gaussian and its noisy sum must not wrap: checked here for the model's
    ``vector_length`` shared values, so the run stops before round 1 rather than in it.

    Raises:
        ConfigError: Naming the setting to change.
    """
    if privacy is None or privacy.plan is None:
        return
    p, sa = privacy.plan, config.secure_aggregation
    if p.placement == "distributed" and sa.scheme in ("secagg", "secagg+"):
        n = largest_cohort(config, population)
        ddg = (p.noise_multiplier, p.clip_norm, config.server.min_clients)
        try:
            check_ddg(ddg, sa, n, vector_length)
        except PrivacyError as exc:
            raise ConfigError(f"privacy.noise_placement = 'distributed': {exc}") from exc
    _check_plan_encoding(config, p)


def _check_plan_encoding(config: Config, p: ClientLevelPlan) -> None:
    sa = config.secure_aggregation
    if sa.scheme in ("none", "ckks") or p.placement == "distributed":  # no fixed-point clip
        return
    std = client_noise_std(p.placement, p.noise_multiplier, p.clip_norm, config.server.min_clients)
    needed = p.clip_norm + ENCODING_SIGMAS * std
    if sa.clip_range < needed:
        raise ConfigError(
            f"secure_aggregation.clip_range = {sa.clip_range:g} would clip the noisy updates: "
            f"clip norm {p.clip_norm:g} plus {ENCODING_SIGMAS:g} x the clients' noise std "
            f"{std:.4g} needs at least {needed:.4g} (set secure_aggregation.clip_range = "
            f"{math.ceil(needed)})"
        )
