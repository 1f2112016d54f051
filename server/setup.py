"""Build the server side of a run from its config: initial parameters, evaluator, coordinator."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fl_secure.algorithms import Strategy, get_strategy
from fl_secure.config import Config, config_to_toml
from fl_secure.data.plan import FederatedData, plan_federation
from fl_secure.messages import Tensors
from fl_secure.runs import RunDir, atomic_write_bytes
from fl_secure.training import (
    build_model,
    evaluate_verification,
    get_tensors,
    local_training,
    set_tensors,
)
from server.coordinator import Coordinator, CoordinatorSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSide:
    """What the server holds: the coordinator and the data plan it evaluates with."""

    coordinator: Coordinator
    strategy: Strategy
    plan: FederatedData


def make_evaluator(config: Config, plan: FederatedData) -> Callable[[Tensors], dict[str, float]]:
    """Verification of the global backbone on the held-out identities."""
    model = build_model(config.model, 1, config.data.image_size, config.run.seed)
    backbone = model.backbone

    def evaluate(params: Tensors) -> dict[str, float]:
        prefix = "backbone."
        set_tensors(
            backbone,
            type(params)((k[len(prefix) :], v) for k, v in params.items() if k.startswith(prefix)),
        )
        return evaluate_verification(backbone, plan.held_out)

    return evaluate


def build_server(
    config: Config,
    run_dir: RunDir,
    *,
    enrolled: set[str],
    plan: FederatedData | None = None,
    evaluate: bool = True,
) -> ServerSide:
    """Initial shared parameters (same seed as the clients), evaluator and coordinator."""
    strategy = get_strategy(config.algorithm.name)
    plan = plan or plan_federation(config)
    classes = len(plan.train_identities) if strategy.shares_head else 1
    model = build_model(config.model, classes, config.data.image_size, config.run.seed)
    initial = get_tensors(model, strategy.shared_names(model))
    s = config.server
    settings = CoordinatorSettings(
        rounds=config.train.rounds,
        min_clients=s.min_clients,
        clients_per_round=s.clients_per_round,
        sample_rate=s.sample_rate,
        round_timeout=s.round_timeout,
        max_retries=s.max_retries,
        max_concurrent_uploads=s.max_concurrent_uploads,
        max_upload_factor=s.max_upload_factor,
        algorithm=strategy.name,
        training=local_training(config.train),
        lr_schedule=config.train.lr_schedule,
        run_id=run_dir.path.name or secrets.token_hex(4),
        run_config_toml=config_to_toml(config),
    )
    coordinator = Coordinator(
        settings,
        initial,
        enrolled=enrolled,
        run_dir=run_dir,
        server_step=strategy.server_update,
        evaluator=make_evaluator(config, plan) if evaluate and len(plan.held_out) else None,
    )
    return ServerSide(coordinator=coordinator, strategy=strategy, plan=plan)


def write_config(run_dir: RunDir, config: Config) -> Path:
    """Write the resolved config into the run directory."""
    atomic_write_bytes(run_dir.config, config_to_toml(config).encode())
    return run_dir.config
