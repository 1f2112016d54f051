"""Untuned and tuned client evaluation after training, for training and held-out clients.

HF-MAML paper (Sec. IV-C, Fig. 1-2, Tables V-X): every client is scored with the final
global model as it is ("untuned") and after a few batches of local fine-tuning ("tuned";
the paper tunes for 5 batches with the training optimiser). "In scenarios with a local
classification layer, the local classification weights are combined with the global
backbone weights to tune the model": a training client tunes a copy of its own model with
the global shared parameters loaded (global backbone + its private head, or + the global
head with absent classes masked). A client that joins only after training has no head yet:
it gets a freshly initialised head over its own identities, which the tuning fits.

Every score is :func:`fl_secure.training.evaluate_local` on the (tuned or untuned) backbone:
verification over all pairs of the client's test images and rank-1 against its training
images. It needs no head, so a private-head model is scored untuned on its embeddings alone.
A training client's tuned model is scored as its untuned one is, by the design's client-side
scoring (:meth:`~fl_secure.algorithms.base.Strategy.evaluate_client`) with the client's
private state (AdaFedFR's local adapter after the backbone), so the two compare one network.
A model whose embeddings are zero or not finite (the tuning, or the training, diverged)
aborts the run (:class:`~fl_secure.errors.RoundAborted`), as a diverged round does.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fl_secure.config import Config
from fl_secure.data.plan import ClientShare
from fl_secure.errors import RoundAborted
from fl_secure.evaluation import DegenerateEmbeddings, per_client_summary
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.training import (
    FaceModel,
    LocalData,
    build_run_model,
    evaluate_local,
    local_training,
    set_tensors,
    train_local,
)

if TYPE_CHECKING:
    from fl_secure.algorithms.base import Strategy


def tuning_task(config: Config) -> LocalTraining:
    """``eval.tune_steps`` batches with the run's optimiser, at ``eval.tune_lr`` (or train.lr)."""
    return dataclasses.replace(
        local_training(config.train),
        local_steps=config.eval.tune_steps,
        learning_rate=config.eval.tune_lr or config.train.lr,
    )


def _generator(seed: int, client_id: str) -> torch.Generator:
    """Batch order of one client's tuning (reproducible; not security-sensitive)."""
    digest = hashlib.sha256(f"{seed}:tune:{client_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def tuned_metrics(
    model: FaceModel,
    data: LocalData,
    shared: Tensors,
    task: LocalTraining,
    *,
    generator: torch.Generator,
    tune_on: LocalData | None = None,
    client_id: str = "a client",
    strategy: Strategy | None = None,
) -> dict[str, float]:
    """Load ``shared`` into a copy of ``model``, fine-tune it on ``tune_on``, score it on ``data``.

    ``tune_on`` defaults to ``data``; FedFR's target clients tune on their pseudo labels
    (:meth:`~fl_secure.algorithms.base.Strategy.training_data`) and are scored with their
    images' identities, as during training. ``model`` itself is left untouched (its private
    head stays as training left it). ``client_id`` names the client in errors.

    ``strategy``: the client's design, whose client-side scoring
    (:meth:`~fl_secure.algorithms.base.Strategy.evaluate_client`) the copy is scored with,
    carrying ``model``'s private state (AdaFedFR's adapter, which the tuning leaves as it
    is); ``None`` scores the copy's backbone alone.

    Raises:
        RoundAborted: the tuned model's embeddings are zero or not finite (the tuning
            diverged).
    """
    tuned = copy.deepcopy(model)
    set_tensors(tuned, shared)
    if strategy is not None:  # the design's state beside the model goes with the copy
        strategy.restore_private_state(tuned, strategy.private_state(model))
    train_local(tuned, data if tune_on is None else tune_on, task, generator=generator)
    with _diverged(
        f"{client_id}'s model after fine-tuning", "the tuning diverged: lower eval.tune_lr"
    ):
        if strategy is not None:
            return strategy.evaluate_client(tuned, data)
        return evaluate_local(tuned.backbone, data)


@contextmanager
def _diverged(model: str, remedy: str) -> Iterator[None]:
    """Scoring ``model``: degenerate embeddings abort the run as a diverged round does."""
    try:
        yield
    except DegenerateEmbeddings as exc:
        raise RoundAborted(f"{model}: its embeddings cannot be scored ({exc}; {remedy})") from exc


def newcomer(config: Config, share: ClientShare, shared: Tensors) -> tuple[FaceModel, LocalData]:
    """A client that joins after training: global backbone, fresh head over its identities."""
    own = np.unique(share.train.labels.numpy())
    model = build_run_model(config, len(own))
    prefix = "backbone."
    set_tensors(model, type(shared)((k, v) for k, v in shared.items() if k.startswith(prefix)))
    targets = np.searchsorted(own, share.train.labels.numpy()).astype(np.int64)
    data = LocalData(
        train=share.train,
        test=share.test,
        train_targets=torch.from_numpy(targets),
        class_mask=None,
    )
    return model, data


def _group(name: str, scores: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    if not scores:
        return {}
    return {name: dict(scores), f"{name}_summary": per_client_summary(scores)}


def tune_trained(
    config: Config,
    trained: Mapping[str, tuple[FaceModel, LocalData]],
    shared: Tensors,
    *,
    tune_on: Mapping[str, LocalData] | None = None,
    strategies: Mapping[str, Strategy] | None = None,
) -> dict[str, dict[str, float]]:
    """The training clients' tuned scores, by id, in ``trained``'s order ({}: no tuning).

    The arguments are :func:`evaluate_after_training`'s; a Ray actor calls this for the
    clients it kept, where their models and design state live.

    Raises:
        RoundAborted: naming the client, when its tuned model's embeddings are zero or not
            finite.
    """
    if config.eval.tune_steps <= 0:
        return {}
    task = tuning_task(config)
    return {
        cid: tuned_metrics(
            model,
            data,
            type(shared)((k, v) for k, v in shared.items() if k in model.state_dict()),
            task,
            generator=_generator(config.run.seed, cid),
            tune_on=(tune_on or {}).get(cid),
            client_id=cid,
            strategy=(strategies or {}).get(cid),
        )
        for cid, (model, data) in trained.items()
    }


def evaluate_after_training(
    config: Config,
    trained: Mapping[str, tuple[FaceModel, LocalData]],
    held_out_clients: list[ClientShare],
    shared: Tensors,
    *,
    tune_on: Mapping[str, LocalData] | None = None,
    strategies: Mapping[str, Strategy] | None = None,
    tuned_elsewhere: Mapping[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Tuned scores of the training clients; untuned and tuned scores of held-out clients.

    Args:
        config: the run (``eval.tune_steps``, ``eval.tune_lr``, model, seed).
        trained: training client id -> (its model after the last round, its data); the
            models are copied, not changed.
        held_out_clients: the plan's clients that join after training.
        shared: the final global shared parameters.
        tune_on: training client id -> the data its fine-tuning trains on, where that is
            not its own data (see :func:`tuned_metrics`).
        strategies: training client id -> its design (the strategy object that holds its
            private state), whose client-side scoring its untuned scores used: the tuned
            model is scored the same way (see :func:`tuned_metrics`). Without it, the
            tuned backbone alone is scored.
        tuned_elsewhere: training clients' tuned scores (:func:`tune_trained`) computed
            where the clients live (Ray actors), reported after ``trained``'s own.

    Returns:
        ``clients_tuned`` (+ ``_summary``), ``held_out_clients`` and
        ``held_out_clients_tuned`` (+ ``_summary``): per client id the figures of
        :func:`fl_secure.training.evaluate_local`; a group without clients, or tuned
        groups when ``eval.tune_steps = 0``, are left out.

    Raises:
        RoundAborted: naming the client, when a model's embeddings are zero or not finite
            (its tuning, or the training, diverged): the experiment grid records the run as
            aborted, as a diverged round.
    """
    task = tuning_task(config)
    tune = config.eval.tune_steps > 0
    seed = config.run.seed
    result: dict[str, Any] = {}
    if tune:
        scores = tune_trained(config, trained, shared, tune_on=tune_on, strategies=strategies)
        result |= _group("clients_tuned", scores | dict(tuned_elsewhere or {}))
    untuned: dict[str, dict[str, float]] = {}
    tuned: dict[str, dict[str, float]] = {}
    for k, share in enumerate(held_out_clients):
        cid = f"held-out-client-{k}"
        model, data = newcomer(config, share, shared)
        joined = f"{cid} (joining after training) with the final global backbone"
        with _diverged(joined, "training diverged: lower train.lr"):
            untuned[cid] = evaluate_local(model.backbone, data)
        if tune:
            backbone_only = type(shared)(
                (n, v) for n, v in shared.items() if n.startswith("backbone.")
            )
            tuned[cid] = tuned_metrics(
                model, data, backbone_only, task, generator=_generator(seed, cid), client_id=cid
            )
    return result | _group("held_out_clients", untuned) | _group("held_out_clients_tuned", tuned)
