"""In-process simulation: the federated rounds of a config without the network.

Runs the *same* code as the gRPC path, through the simulation engine
(:mod:`fl_secure.app.sim`): every client is a :class:`client.trainer.LocalTrainer` built by
:func:`client.trainer_factory.build_local_trainer` (same model, label space, batch-order
seed), and every round is the coordinator's round, step for step (:mod:`server.round`): the
round's learning rate and broadcast (AdaFedFR's public representations ``R``, Eq. 4,
Algorithm 1 lines 6-8: :meth:`Strategy.broadcaster`), what each client is sent (the global
parameters, its own head, the broadcast), the head of a ``server-sees-heads`` upload (FedGC)
kept apart from the :class:`fl_secure.aggregation.StreamingMean` of the updates weighted by
example counts, the strategy's ``server_update`` and ``server_heads``, the check of the new
model, and each broadcast round's record of the bytes one client exchanges
(``bytes_per_client``). Only transport, certificates, deadlines and process boundaries are
left out, so a grid of experiments runs in one process on 2 cores.

:func:`simulate` is the non-private simulation every client of which trains every round (the
gRPC default), as experiments and tests call it: a sampled cohort, differential privacy and
secure aggregation are refused here (:func:`check_simulable`). The engine itself
(:func:`fl_secure.app.sim.run.run_simulation`, ``fl-secure simulate``) runs sampled cohorts
from large populations and client-level DP with its ledger.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fl_secure.algorithms import check_config, strategy_class
from fl_secure.app.sim.engine import ExecutorFactory, SimulationResult
from fl_secure.app.sim.run import run_simulation
from fl_secure.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from fl_secure.config import Config

__all__ = ["SimulationResult", "check_simulable", "simulate"]


def simulate(
    config: Config,
    *,
    executor: ExecutorFactory | None = None,
    progress: bool = False,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> SimulationResult:
    """Run every round of ``config``; return parameters and figures.

    ``executor`` builds where the clients train (default: this process, every client kept,
    :class:`~fl_secure.app.sim.executor.SerialExecutor`); a
    :class:`~fl_secure.app.sim.ray_executor.RayExecutor` with ``keep_trainers=True`` runs
    them on Ray actors, each client always on the same actor, with the same results.

    Local training uses ``train.threads`` torch threads, as each client process does, so the
    simulation gives the bit-identical model of a gRPC run (the thread count changes the order
    of float reductions, and training amplifies that: measured 3e-3 of a layer's scale after
    two rounds with 2 threads against the clients' 1).

    Raises:
        RoundAborted: training diverged (an update, the global model or its embeddings not
            finite), where the gRPC coordinator would abort the run; or the fine-tuning after
            training did (:func:`fl_secure.app.tuning.evaluate_after_training`).
    """
    check_simulable(config)
    return run_simulation(config, executor=executor, progress=progress, on_round=on_round)


def check_simulable(config: Config) -> None:
    """Refuse what the simulation does not model, before anything runs.

    Raises:
        ConfigError: differential privacy, secure aggregation, a sampled cohort, or FedAffect.
    """
    check_config(config)
    if config.privacy.enabled or config.secure_aggregation.enabled:
        raise ConfigError(
            "the simulation runs non-private rounds only: differential privacy and secure "
            "aggregation run over gRPC (fl-secure train); set privacy.unit = 'none' and "
            "secure_aggregation.scheme = 'none' to simulate"
        )
    s, everyone = config.server, config.partition.num_clients
    if 0 < s.clients_per_round < everyone or 0 < s.sample_rate < 1:
        given = (
            f"server.clients_per_round = {s.clients_per_round}"
            if s.clients_per_round
            else f"server.sample_rate = {s.sample_rate:g}"
        )
        raise ConfigError(
            f"{given}: the simulation trains every client in every round; sampled cohorts run "
            f"over gRPC (fl-secure train); set server.clients_per_round = 0 (or {everyone}, "
            "every client) and server.sample_rate = 0 to simulate"
        )
    if strategy_class(config.algorithm.name).evaluates_expressions:
        raise ConfigError(
            "algorithm.name = 'fedaffect' is not simulated (its model is f + g + a private "
            "projection head, and its evaluation is expression accuracy): run it over gRPC "
            "(fl-secure train) or with python benchmarks/fedaffect.py"
        )
