"""A whole simulated run: the engine's rounds, the final evaluation and the summary figures."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from fl_secure.app.sim.engine import (
    EVALUATED_CLIENTS,
    ExecutorFactory,
    SimulationEngine,
    SimulationResult,
    kept_trainers,
)
from fl_secure.app.tuning import evaluate_after_training
from fl_secure.errors import RoundAborted
from fl_secure.evaluation import DegenerateEmbeddings, per_client_summary
from fl_secure.training import HEADLINE

if TYPE_CHECKING:
    from collections.abc import Callable

    from fl_secure.config import Config
    from fl_secure.runs import RunDir


def run_simulation(
    config: Config,
    *,
    run_dir: RunDir | None = None,
    executor: ExecutorFactory | None = None,
    evaluated: int = EVALUATED_CLIENTS,
    dropout_rate: float = 0.0,
    progress: bool = False,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> SimulationResult:
    """Run ``config``'s rounds on virtual clients; return parameters, records and summary.

    Local training uses ``train.threads`` torch threads, as each client process does (the
    thread count changes the order of float reductions). ``evaluated``: how many clients
    (a seeded choice of a larger population) score the model before and after training;
    ``dropout_rate``: secure rounds, the fraction of a cohort that leaves mid-round.

    Raises:
        ConfigError: what the engine does not run
            (:func:`~fl_secure.app.sim.server_side.check_engine`).
        RoundAborted: training diverged, or too few clients were drawn.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(config.train.threads)
    try:
        engine = SimulationEngine(
            config,
            run_dir=run_dir,
            executor=executor,
            evaluated=evaluated,
            dropout_rate=dropout_rate,
        )
        try:
            return _run(engine, progress=progress, on_round=on_round)
        finally:
            engine.close()
    finally:
        torch.set_num_threads(before)


def _run(
    engine: SimulationEngine,
    *,
    progress: bool,
    on_round: Callable[[dict[str, Any]], None] | None,
) -> SimulationResult:
    started = time.time()
    config, s = engine.config, engine.server
    records, status = engine.run(progress=progress, on_round=on_round)
    params = s.state.params
    try:
        final_clients = engine.evaluate_clients()
    except DegenerateEmbeddings as exc:
        raise RoundAborted(
            f"round {engine.rounds_completed}: the global model's embeddings are not finite "
            f"({exc}; training diverged: lower train.lr)"
        ) from exc
    final = records[-1].get("held_out", {}) if engine.rounds_completed else {}
    untrained = records[0]
    # the clients' own fine-tuning scores where the serial executor kept them (every client
    # in every round, no DP: a private site's model stays with it); held-out clients always
    kept = kept_trainers(engine) if s.privacy is None else {}
    # clients kept on Ray actors are tuned there, where their models and design state live
    tune_kept = getattr(engine.executor, "tune_kept", None)
    elsewhere = tune_kept(config, params) if tune_kept is not None and s.privacy is None else {}
    tuning = evaluate_after_training(
        config,
        {c: (t.model, t.data) for c, t in kept.items()},
        s.plan.held_out_clients,
        params,
        tune_on={c: t.strategy.training_data(t.data) for c, t in kept.items()},
        strategies={c: t.strategy for c, t in kept.items()},
        tuned_elsewhere=elsewhere,
    )
    summary: dict[str, Any] = {
        "status": status,
        "backend": "simulation",
        "algorithm": s.strategy.name,
        "exposure": s.strategy.exposure,
        "partition": config.partition.kind,
        "rounds_completed": engine.rounds_completed,
        "client_train_sizes": s.plan.client_sizes(),
        "client_plan": s.plan.client_plan(),
        **{k: final[k] for k in HEADLINE if k in final},
        "held_out": final,
        "untrained": untrained.get("held_out", {}),
        "clients": final_clients,
        "clients_summary": per_client_summary(final_clients),
        "untrained_clients_summary": per_client_summary(untrained["clients"]),
        "held_out_client_train_sizes": s.plan.held_out_client_sizes(),
        **tuning,
        "bytes_per_client": s.state.bytes_per_client(),  # one round's payload
        "duration_s": round(time.time() - started, 1),
    }
    if engine.stop_reason:
        summary["stop_reason"] = engine.stop_reason
    if engine.sampled:
        summary["cohort_sizes"] = engine.cohort_sizes
    return SimulationResult(
        params=params,
        records=records,
        summary=summary,
        heads=s.state.heads,
        status=status,
        privacy=s.privacy.summary() if s.privacy is not None else None,
        rounds_completed=engine.rounds_completed,
    )
