"""In-process simulation: the federated rounds of a config without the network.

Runs the *same* code as the gRPC path: every client is a :class:`client.trainer.LocalTrainer`
built by :func:`client.trainer_factory.build_local_trainer` (same model, label space,
batch-order seed),
and every round is the coordinator's round, step for step (:mod:`server.round`): the round's
learning rate and broadcast (AdaFedFR's public representations ``R``, Eq. 4, Algorithm 1
lines 6-8: :meth:`Strategy.broadcaster`), what each client is sent (the global parameters,
its own head, the broadcast), the head of a ``server-sees-heads`` upload (FedGC) kept apart
from the :class:`fl_secure.aggregation.StreamingMean` of the updates weighted by example counts,
the strategy's ``server_update`` and ``server_heads``, the check of the new model, and each
broadcast round's record of the bytes one client exchanges (``bytes_per_client``). Only
transport, certificates, deadlines and process boundaries are left out, so a grid of
experiments runs in one process on 2 cores.
Every client takes part in every round (the gRPC default): a sampled cohort
(``server.clients_per_round`` below the clients, ``server.sample_rate`` below 1),
differential privacy and secure aggregation need the real path, and are refused.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from tqdm import tqdm

from client.trainer_factory import build_local_trainer
from fl_secure.aggregation import StreamingMean
from fl_secure.algorithms import check_config, get_strategy, strategy_class
from fl_secure.app.tuning import evaluate_after_training
from fl_secure.data.plan import plan_client_id, plan_federation
from fl_secure.errors import ConfigError, RoundAborted
from fl_secure.evaluation import DegenerateEmbeddings, per_client_summary
from fl_secure.training import HEADLINE, build_run_model, get_tensors
from server.bootstrap import make_evaluator
from server.influence import weight_cap
from server.round import (
    Evaluator,
    RoundState,
    non_finite_names,
    round_rules,
    update_weight,
    vet_model,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from client.trainer import LocalTrainer
    from fl_secure.config import Config
    from fl_secure.messages import Tensors


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
    strategy = get_strategy(
        config.algorithm.name, config.algorithm, head=config.model.head, scale=config.model.scale
    )
    plan = plan_federation(config)
    size = config.data.image_size
    classes = len(plan.train_identities) if strategy.shares_head else 1
    model = build_run_model(config, classes, image_size=size)
    state = RoundState(
        get_tensors(model, strategy.shared_names(model)),
        round_rules(config, strategy, model, plan),
        server_step=strategy.server_update,
        head_step=strategy.server_heads if strategy.uploads_head else None,
        broadcaster=strategy.broadcaster(config),
    )
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

    def evaluate_clients() -> dict[str, dict[str, float]]:  # the global model, as sent
        return {c: t.evaluate(state.sent_to(c))[1] for c, t in trainers.items()}

    untrained: dict[str, Any] = {"round": 0, "clients": evaluate_clients()}
    if evaluator is not None:
        untrained["held_out"] = evaluator(state.params)
    records = [untrained]
    rounds = config.train.rounds
    # the server's weight cap on plain updates, from the counts the clients state at join
    cap = weight_cap(
        [t.num_examples for t in trainers.values()],
        config.server.max_examples,
        config.server.examples_factor,
    )
    for number in tqdm(range(1, rounds + 1), desc="rounds", disable=not progress):
        record = _round(state, trainers, evaluator, number, cap)
        records.append(record)
        if on_round is not None:
            on_round(record)
    params = state.params
    final_clients = _scored(evaluate_clients, rounds)
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
        "bytes_per_client": state.bytes_per_client(),  # one round's payload
        "duration_s": round(time.time() - started, 1),
    }
    return SimulationResult(params=params, records=records, summary=summary, heads=state.heads)


def _round(
    state: RoundState,
    trainers: Mapping[str, LocalTrainer],
    evaluator: Evaluator | None,
    number: int,
    cap: float = math.inf,
) -> dict[str, Any]:
    """Round ``number`` with every client: the coordinator's steps, in this process.

    ``cap``: the most an update may weigh (:func:`server.influence.weight_cap`).

    Raises:
        RoundAborted: An update or the new global model diverged.
    """
    task = state.rules.training_for(number)
    state.prepare_broadcast(number)  # e.g. AdaFedFR Algorithm 1 lines 6-8: R under w^t
    aggregate = StreamingMean(state.specs)
    metrics: dict[str, dict[str, float]] = {}
    uploaded: dict[str, Tensors] = {}
    for client_id, trainer in trainers.items():
        update, examples, found = trainer.train(state.sent_to(client_id), task)
        _require_finite(update, f"round {number}: {client_id}'s update")  # as the server
        shared, head = state.split_upload(client_id, update)  # FedGC: W_k apart from the mean
        if head:
            uploaded[client_id] = head
        aggregate.add(shared, update_weight(min(examples, cap), private=False))
        metrics[client_id] = found
    params = state.step(number, aggregate.mean())
    held, reason = vet_model(number, params, evaluator)
    if reason:
        raise RoundAborted(reason)
    state.advance(params, state.step_heads(number, uploaded))
    record: dict[str, Any] = {"round": number, "clients": metrics}
    if state.broadcaster is not None:
        record["bytes_per_client"] = state.bytes_per_client()
    if held is not None:
        record["held_out"] = held
    return record


def _require_finite(tensors: Tensors, what: str) -> None:
    """Abort where the server refuses an update with NaN/Inf values (training diverged).

    Raises:
        RoundAborted: naming the tensors.
    """
    bad = non_finite_names(tensors)
    if bad:
        raise RoundAborted(
            f"{what} has non-finite values in {bad[:5]}{' ...' if len(bad) > 5 else ''} (training "
            "diverged: lower train.lr)"
        )


_T = TypeVar("_T")


def _scored(evaluate: Callable[[], _T], number: int) -> _T:
    """``evaluate()`` of the global model; a finite model whose embeddings overflow aborts."""
    try:
        return evaluate()
    except DegenerateEmbeddings as exc:
        raise RoundAborted(
            f"round {number}: the global model's embeddings are not finite ({exc}; training "
            "diverged: lower train.lr)"
        ) from exc
