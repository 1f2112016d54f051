"""In-process simulation: the federated rounds of a config without the network.

Runs the *same* code as the gRPC path: every client is a :class:`client.trainer.LocalTrainer`
built by :func:`client.trainer_factory.build_local_trainer` (same model, label space,
batch-order seed), the server folds the updates with :class:`fl_secure.aggregation.StreamingMean`
weighted by example counts and applies the strategy's ``server_update`` (and, for
``server-sees-heads`` designs
such as FedGC, its ``server_heads`` on the uploaded heads, each returned to its owner only),
with the coordinator's per-round learning rate. A strategy's per-round broadcast (AdaFedFR's
public representations ``R``, Eq. 4, Algorithm 1 lines 6-8: :meth:`Strategy.broadcaster`)
is computed from the global parameters and handed to every client with them, as the
coordinator does, and each such round's record carries the bytes one client exchanges
(``bytes_per_client``). Only transport,
certificates, deadlines and process boundaries are left out, so a grid of experiments runs in
one process on 2 cores.
Every client takes part in every round (the gRPC default): a sampled cohort
(``server.clients_per_round`` below the clients, ``server.sample_rate`` below 1),
differential privacy and secure aggregation need the real path, and are refused.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from client.trainer_factory import build_local_trainer
from fl_secure.aggregation import StreamingMean
from fl_secure.algorithms import check_config, get_strategy, strategy_class
from fl_secure.app.tuning import evaluate_after_training
from fl_secure.config import Config
from fl_secure.data.plan import plan_client_id, plan_federation
from fl_secure.errors import ConfigError, RoundAborted
from fl_secure.evaluation import DegenerateEmbeddings, per_client_summary
from fl_secure.messages import Tensors, TensorSpec
from fl_secure.training import HEADLINE, build_model, get_tensors, local_training
from fl_secure.training import round_learning_rate as lr_of_round
from server.setup import make_evaluator


@dataclasses.dataclass
class SimulationResult:
    """Final shared parameters, one record per round, and the run's summary figures."""

    params: Tensors
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    heads: dict[str, Tensors] = dataclasses.field(default_factory=dict)  # FedGC: final W_k


def simulate(
    config: Config,
    *,
    progress: bool = False,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> SimulationResult:
    """Run every round of ``config`` in this process; return parameters and figures.

    Local training uses ``train.threads`` torch threads, as each client process does, so the
    simulation gives the bit-identical model of a gRPC run (the thread count changes the order
    of float reductions, and training amplifies that: measured 3e-3 of a layer's scale after
    two rounds with 2 threads against the clients' 1).

    Raises:
        RoundAborted: training diverged (an update, the global model or its embeddings not
            finite), where the gRPC coordinator would abort the run; or the fine-tuning after
            training did (:func:`fl_secure.app.tuning.evaluate_after_training`).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(config.train.threads)
    try:
        return _simulate(config, progress=progress, on_round=on_round)
    finally:
        torch.set_num_threads(before)


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


def _simulate(
    config: Config,
    *,
    progress: bool,
    on_round: Callable[[dict[str, Any]], None] | None,
) -> SimulationResult:
    check_simulable(config)
    started = time.time()
    strategy = get_strategy(config.algorithm.name, config.algorithm, head=config.model.head)
    plan = plan_federation(config)
    size = config.data.image_size
    classes = len(plan.train_identities) if strategy.shares_head else 1
    model = build_model(config.model, classes, size, config.run.seed)
    params = get_tensors(model, strategy.shared_names(model))
    specs = [TensorSpec.of(k, v) for k, v in params.items()]
    trainers = {
        plan_client_id(i): build_local_trainer(
            config,
            share.train,
            share.test,
            plan.train_identities,
            client_id=plan_client_id(i),
            image_size=size,
        )  # fmt: skip
        for i, share in enumerate(plan.clients)
    }
    evaluator = make_evaluator(config, plan) if len(plan.held_out) else None
    training = local_training(config.train)
    broadcaster = strategy.broadcaster(config)
    broadcast: Tensors = OrderedDict()  # the round's broadcast tensors, to every client

    heads: dict[str, Tensors] = {}  # server-sees-heads (FedGC): each client's corrected W_k

    def sent_to(client_id: str, shared: Tensors) -> Tensors:  # as Coordinator.parameters
        return OrderedDict([*shared.items(), *heads.get(client_id, {}).items(), *broadcast.items()])

    def evaluate_clients(shared: Tensors) -> dict[str, dict[str, float]]:
        return {c: t.evaluate(sent_to(c, shared))[1] for c, t in trainers.items()}

    untrained: dict[str, Any] = {"round": 0, "clients": evaluate_clients(params)}
    if evaluator is not None:
        untrained["held_out"] = evaluator(params)
    records = [untrained]
    rounds = config.train.rounds
    for number in tqdm(range(1, rounds + 1), desc="rounds", disable=not progress):
        lr = lr_of_round(training.learning_rate, number, rounds, config.train.lr_schedule)
        task = dataclasses.replace(training, learning_rate=lr)
        aggregate = StreamingMean(specs)
        metrics: dict[str, dict[str, float]] = {}
        uploaded: dict[str, Tensors] = {}
        sent: dict[str, int] = {}
        if broadcaster is not None:  # e.g. AdaFedFR Algorithm 1 lines 6-8: R under w^t
            broadcast = broadcaster(params, number)
            sent = bytes_per_client(params, broadcast)
        for client_id, trainer in trainers.items():
            update, examples, found = trainer.train(sent_to(client_id, params), task)
            _require_finite(update, f"round {number}: {client_id}'s update")  # as the server
            if trainer.head_names:  # as Coordinator.commit_upload: W_k apart from the mean
                uploaded[client_id] = OrderedDict((k, update.pop(k)) for k in trainer.head_names)
            aggregate.add(update, float(examples))
            metrics[client_id] = found
        params = strategy.server_update(params, aggregate.mean(), number)
        _require_finite(params, f"round {number}: the global model after aggregation")
        if uploaded:
            heads.update(strategy.server_heads(uploaded, learning_rate=lr, round_=number))
        record: dict[str, Any] = {"round": number, "clients": metrics}
        if sent:
            record["bytes_per_client"] = sent
        if evaluator is not None:
            record["held_out"] = _scored(evaluator, params, number)
        records.append(record)
        if on_round is not None:
            on_round(record)
    final_clients = _scored(evaluate_clients, params, rounds)
    final = records[-1].get("held_out", {})
    summary: dict[str, Any] = {
        "status": "completed",
        "backend": "simulation",
        "algorithm": strategy.name,
        "exposure": strategy.exposure,
        "partition": config.partition.kind,
        "rounds_completed": rounds,
        "client_train_sizes": plan.client_sizes(),
        "client_plan": plan.client_plan(),
        **{k: final[k] for k in HEADLINE if k in final},
        "held_out": final,
        "untrained": untrained.get("held_out", {}),
        "clients": final_clients,
        "clients_summary": per_client_summary(final_clients),
        "untrained_clients_summary": per_client_summary(untrained["clients"]),
        "held_out_client_train_sizes": plan.held_out_client_sizes(),
        **evaluate_after_training(  # tuned training clients; untuned/tuned held-out clients
            config,
            {c: (t.model, t.data) for c, t in trainers.items()},
            plan.held_out_clients,
            params,
            tune_on={c: t.strategy.training_data(t.data) for c, t in trainers.items()},
            strategies={c: t.strategy for c, t in trainers.items()},  # as final_clients
        ),
        "bytes_per_client": bytes_per_client(params, broadcast),  # one round's payload
        "duration_s": round(time.time() - started, 1),
    }
    return SimulationResult(params=params, records=records, summary=summary, heads=heads)


def _require_finite(tensors: Tensors, what: str) -> None:
    """Abort as the coordinator does when training diverged (NaN/Inf in an update or model).

    Raises:
        RoundAborted: naming the tensors.
    """
    bad = [k for k, a in tensors.items() if a.dtype.kind in "fc" and not np.isfinite(a).all()]
    if bad:
        raise RoundAborted(
            f"{what} has non-finite values in {bad[:5]}{' ...' if len(bad) > 5 else ''} (training "
            "diverged: lower train.lr)"
        )


_T = TypeVar("_T")


def _scored(evaluate: Callable[[Tensors], _T], params: Tensors, number: int) -> _T:
    """``evaluate(params)``; a finite model whose embeddings overflow aborts the run."""
    try:
        return evaluate(params)
    except DegenerateEmbeddings as exc:
        raise RoundAborted(
            f"round {number}: the global model's embeddings are not finite ({exc}; training "
            "diverged: lower train.lr)"
        ) from exc


def bytes_per_client(params: Tensors, broadcast: Tensors) -> dict[str, int]:
    """Payload bytes one client exchanges per round, as ``Coordinator.bytes_per_client``."""
    size = int(sum(np.asarray(v).nbytes for v in params.values()))
    extra = int(sum(np.asarray(v).nbytes for v in broadcast.values()))
    return {
        "broadcast": extra,
        "parameters_down": size,
        "parameters_up": size,
        "total": extra + 2 * size,
    }
