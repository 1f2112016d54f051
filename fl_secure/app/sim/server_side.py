"""The server's side of a simulated run, built from the gRPC server's own parts.

:class:`SimServer` holds what :func:`server.bootstrap.build_server` gives the coordinator,
made for a population of virtual clients: the initial model and its
:class:`server.round.RoundState`, the held-out evaluator, the run's
:class:`privacy.server_round.ServerPrivacy` (mechanism, accountant, signed ledger) behind the
coordinator's :class:`server.release_accounting.ReleaseAccounting`, and the cohort draw of
:class:`server.membership.Membership` (Poisson at ``server.sample_rate`` or
``server.clients_per_round`` of the clients, from :class:`secrets.SystemRandom`). The clients
receive the config the server sends (:func:`client_config`: the noise multiplier it
calibrated), as gRPC clients do.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from fl_secure.algorithms import check_config, get_strategy, strategy_class
from fl_secure.data.lazy_plan import plan_population
from fl_secure.data.plan import plan_client_id
from fl_secure.errors import ConfigError
from fl_secure.messages import TaskKind
from fl_secure.training import build_run_model, get_tensors
from privacy.dp.noise import seeded_source
from privacy.ledger.signed_head import HeadSigner
from privacy.server_round import ServerPrivacy, open_server_privacy
from server.attempt import RoundBoard
from server.bootstrap import make_evaluator
from server.influence import weight_cap
from server.membership import Membership
from server.preflight import check_dpsgd_model
from server.release_accounting import ReleaseAccounting
from server.round import Evaluator, RoundState, round_rules
from server.settings import CoordinatorSettings

if TYPE_CHECKING:
    from fl_secure.config import Config
    from fl_secure.runs import RunDir


def sampled(config: Config) -> bool:
    """Whether rounds draw a cohort smaller than the population."""
    s, everyone = config.server, config.partition.num_clients
    return 0 < s.clients_per_round < everyone or 0 < s.sample_rate < 1


def check_engine(config: Config) -> None:
    """Refuse what the engine does not run, before anything runs.

    Raises:
        ConfigError: CKKS, FedAffect, or FedFR with sampled cohorts.
    """
    check_config(config)
    if config.secure_aggregation.scheme == "ckks":
        raise ConfigError(
            "secure_aggregation.scheme = 'ckks' is not simulated (the engine runs SecAgg and "
            "SecAgg+ rounds in process): run it over gRPC (fl-secure train)"
        )
    if strategy_class(config.algorithm.name).evaluates_expressions:
        raise ConfigError(
            "algorithm.name = 'fedaffect' is not simulated (its model is f + g + a private "
            "projection head, and its evaluation is expression accuracy): run it over gRPC "
            "(fl-secure train) or with python benchmarks/fedaffect.py"
        )
    unsimulated = strategy_class(config.algorithm.name).unsimulated_sampling
    if unsimulated and sampled(config):
        raise ConfigError(
            f"algorithm.name = {config.algorithm.name!r} with sampled cohorts: {unsimulated}; "
            "simulate it with every client in every round (server.clients_per_round = 0, "
            "server.sample_rate = 0)"
        )


def client_config(config: Config, privacy: ServerPrivacy | None) -> Config:
    """The run config the clients receive: with the client-level noise the server calibrated."""
    if privacy is None or privacy.plan is None:
        return config
    z = privacy.plan.noise_multiplier
    privacy_cfg = dataclasses.replace(config.privacy, noise_multiplier=z)
    return dataclasses.replace(config, privacy=privacy_cfg)


class SimServer:
    """The coordinator's parts for one simulated run (see the module docstring)."""

    def __init__(self, config: Config, run_dir: RunDir | None) -> None:
        check_engine(config)
        self.config = config
        self.strategy = get_strategy(
            config.algorithm.name,
            config.algorithm,
            head=config.model.head,
            scale=config.model.scale,
        )
        self.plan = plan_population(config)  # the held-out images; no client's rendered
        self.population = len(self.plan.clients)
        size = config.data.image_size
        classes = len(self.plan.train_identities) if self.strategy.shares_head else 1
        model = build_run_model(config, classes, image_size=size)
        check_dpsgd_model(config, model)  # refuse before any client trains
        self.state = RoundState(
            get_tensors(model, self.strategy.shared_names(model)),
            round_rules(config, self.strategy, model, self.plan),
            server_step=self.strategy.server_update,
            head_step=self.strategy.server_heads if self.strategy.uploads_head else None,
            broadcaster=self.strategy.broadcaster(config),
        )
        self.evaluator: Evaluator | None = (
            make_evaluator(config, self.plan) if len(self.plan.held_out) else None
        )
        self.privacy = self._open_privacy(run_dir)
        self.accounting = ReleaseAccounting(self.privacy)
        self.client_config = client_config(config, self.privacy)
        s = config.server
        settings = CoordinatorSettings(
            rounds=config.train.rounds,
            min_clients=s.min_clients,
            clients_per_round=s.clients_per_round,
            sample_rate=s.sample_rate,
        )
        self.ids = [plan_client_id(i) for i in range(self.population)]
        self.index = {c: i for i, c in enumerate(self.ids)}
        board = RoundBoard(time.monotonic)
        self.membership = Membership(board, settings, set(self.ids), self.privacy)
        # the server's weight cap on plain updates, from the counts clients state at join
        self.weight_cap = weight_cap(self.plan.client_sizes(), s.max_examples, s.examples_factor)

    def _open_privacy(self, run_dir: RunDir | None) -> ServerPrivacy | None:
        config = self.config
        if not config.privacy.enabled:
            return None
        if run_dir is None:
            raise ConfigError("a private simulation needs a run directory for its ledger")
        s = config.server
        privacy = open_server_privacy(
            config.privacy,
            run_dir.path / "ledger.sqlite",
            run_dir.path.name,
            rounds=config.train.rounds,
            population=self.population,
            clients_per_round=s.clients_per_round,
            sample_rate=s.sample_rate,
            source=None,  # the CSPRNG (privacy.secure_rng = false: a seeded one, below)
            min_survivors=s.min_clients,
            signer=HeadSigner.load_or_create(run_dir.certs),
        )
        assert privacy is not None
        if not config.privacy.secure_rng:
            privacy.source = seeded_source(config.run.seed, "server")
        over = privacy.first_round_over_budget()
        if over is not None:
            raise ConfigError(
                f"privacy.noise_multiplier = {config.privacy.noise_multiplier:g} cannot pay for a "
                f"single round within privacy.target_epsilon = {config.privacy.target_epsilon:g}:"
                f" round 1 alone spends epsilon {over:.4g} (delta {config.privacy.delta:g}); "
                "raise the noise multiplier, or leave it at 0 to calibrate it to the target"
            )
        return privacy

    def draw_cohort(self, number: int) -> list[str]:
        """Round ``number``'s cohort: the coordinator's draw over the whole population.

        Every virtual client is online; the draw is :meth:`Membership.sample_cohort` (a
        CSPRNG), in plan order so that a full cohort aggregates as the old simulation did.
        """
        candidates = self.membership.candidates(number, self.ids)
        cohort = self.membership.sample_cohort(candidates, TaskKind.TRAIN)
        return sorted(cohort, key=self.index.__getitem__)
