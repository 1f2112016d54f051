"""Several virtual clients' local rounds in one vectorised pass (``torch.func.vmap``).

On the small models of simulations at scale a client's round is a few batches of a few
images, and its time goes to per-operation overhead, not arithmetic: one step of the
benchmark's ``cnn-small`` on 3 images costs ~12 ms of forward and backward, the same step for
25 clients under ``vmap`` ~3.6 ms a client (``python -m cProfile``, one thread). A worker
given a batch of jobs (:meth:`fl_secure.app.sim.executor.VirtualClientWorker.run_many`)
therefore runs the local objective of all of them here, on the parameters stacked along a
new first dimension, and then hands each client's trained parameters to that client's own
round (:meth:`client.trainer.LocalTrainer.train` with ``local=``), so the update, the
clipping and noise of client-level DP and the carried state are the gRPC client's code.

:func:`train_stacked` is :func:`fl_secure.training.train_local` for K clients at once, step
for step: each client's batch order from its own generator, the optimiser of
:func:`~fl_secure.training.make_optimizer` over the same groups (SGD and Adam act element by
element, so one optimiser over the stacked parameters is K optimisers), the margin head's
cross-entropy with each client's class mask, the absent classes' rows restored after every
step, the same loss and accuracy figures. The batched convolutions sum in another order than
K separate ones, so the parameters agree with the one-at-a-time path to float tolerance, not
bit for bit (``tests/fl_secure/app/sim/test_vectorized.py``); batches are opt-in
(``fl-secure simulate --client-batch``) for that reason.

Only the plain objective is vectorised (:func:`vectorizable`): a design that keeps its own
client step or local objective, state outside the model, a broadcast, DP-SGD, or a model
with buffers (batch norm) runs its clients one at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from fl_secure.algorithms.base import Strategy
from fl_secure.app.sim.reuse import reusable
from fl_secure.models.heads import ClassHead
from fl_secure.training import FaceModel, make_optimizer, parameter_groups

if TYPE_CHECKING:
    from fl_secure.config import Config
    from fl_secure.messages import LocalTraining
    from fl_secure.training import LocalData


def vectorizable(strategy: Strategy, config: Config) -> bool:
    """Whether this design's clients may train together (the plain objective, model state)."""
    kind = type(strategy)
    return (
        reusable(strategy, config)
        and kind.client_update is Strategy.client_update
        and kind.local_train is Strategy.local_train
        and kind.training_data is Strategy.training_data
    )


def model_fits(model: FaceModel, sent_names: Sequence[str]) -> bool:
    """Whether ``model`` can be stacked: no buffers, a class head, every parameter sent.

    With every parameter in what the clients are sent, each client of the batch starts its
    round from the same values, whatever its model held before.
    """
    names = [n for n, _ in model.named_parameters()]
    return (
        not any(True for _ in model.buffers())
        and isinstance(model.head, ClassHead)
        and sorted(names) == sorted(sent_names)
        and len(set(model.state_dict())) == len(names)
    )


class _Objective(nn.Module):
    """The local loss of :func:`fl_secure.training.train_local`, without the head's checks.

    The head's ``forward`` checks labels and the mask with Python branches on tensor values,
    which ``vmap`` cannot run; :func:`train_stacked` checks them for each client first.
    """

    def __init__(self, model: FaceModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, images: torch.Tensor, targets: torch.Tensor, absent: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.model.backbone(images)
        head = self.model.head
        assert isinstance(head, ClassHead)
        logits = head.logits(emb, targets)
        plain = head.logits(emb.detach(), None)
        if absent is not None:
            logits = logits.masked_fill(absent, float("-inf"))
            plain = plain.masked_fill(absent, float("-inf"))
        loss = F.cross_entropy(logits, targets)
        correct = (plain.argmax(1) == targets).sum()
        return loss, correct


@dataclass
class StackedResult:
    """One client's trained parameters and the figures ``train_local`` returns."""

    params: dict[str, np.ndarray]
    metrics: dict[str, float]


def train_stacked(
    model: FaceModel,
    datas: Sequence[LocalData],
    training: LocalTraining,
    generators: Sequence[torch.Generator],
) -> list[StackedResult]:
    """``train_local`` for each ``(datas[k], generators[k])`` from ``model``'s parameters.

    Every client starts from ``model``'s current parameters (the round's global model) and
    holds the same number of training images (the caller groups them). ``model`` is left as
    it was.

    Raises:
        ValueError: the clients hold different numbers of images, or a label is outside a
            client's head or names a class its mask excludes.
    """
    count = len(datas)
    n = len(datas[0].train)
    if any(len(d.train) != n for d in datas):
        raise ValueError("clients trained together must hold the same number of images")
    masks = [d.class_mask for d in datas]
    if any((m is None) != (masks[0] is None) for m in masks):
        raise ValueError("clients trained together must all have a class mask, or none")
    head = model.head
    assert isinstance(head, ClassHead)
    for d in datas:  # the head's own checks, which the vectorised loss cannot run
        head(torch.zeros(len(d.train_targets), head.weight.shape[1]), d.train_targets,
             d.class_mask)  # fmt: skip
    absent = None if masks[0] is None else torch.stack([~m for m in masks if m is not None])

    model.train()
    names = [name for name, _ in model.named_parameters()]
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    stacked = {
        name: nn.Parameter(
            start[name].unsqueeze(0).repeat(count, *([1] * start[name].dim())),
            requires_grad=p.requires_grad,
        )
        for name, p in model.named_parameters()
    }
    by_id = {id(p): name for name, p in model.named_parameters()}
    groups = [
        {**g, "params": [stacked[by_id[id(p)]] for p in g["params"]]}
        for g in parameter_groups(model, training)
    ]
    opt = make_optimizer(groups, training)
    # rows of classes a client does not hold: kept as sent (fl_secure.training.AbsentRows)
    kept: list[tuple[nn.Parameter, torch.Tensor]] = []
    if absent is not None:
        classes = absent.shape[1]
        kept = [
            (stacked["head." + n], start["head." + n])
            for n, p in head.named_parameters()
            if p.dim() >= 1 and p.shape[0] == classes
        ]
    objective = _Objective(model)

    def one(params: Mapping[str, torch.Tensor], images: torch.Tensor, targets: torch.Tensor,
            absent_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        full = {"model." + k: v for k, v in params.items()}
        out: tuple[torch.Tensor, torch.Tensor] = functional_call(
            objective, full, (images, targets, absent_rows)
        )
        return out

    batched = vmap(one, in_dims=(0, 0, 0, None if absent is None else 0))
    batch = min(training.batch_size, n)
    total = training.local_steps or training.local_epochs * max(1, n // batch)
    orders = [torch.randperm(n, generator=g) for g in generators]
    cursor = 0
    losses = torch.zeros(count, total)
    correct = torch.zeros(count, dtype=torch.long)
    seen = 0
    for step in range(total):
        if cursor + batch > n:
            orders, cursor = [torch.randperm(n, generator=g) for g in generators], 0
        idx = [o[cursor : cursor + batch] for o in orders]
        cursor += batch
        images = torch.stack([d.train.images[i] for d, i in zip(datas, idx, strict=True)])
        targets = torch.stack([d.train_targets[i] for d, i in zip(datas, idx, strict=True)])
        loss, hits = batched(stacked, images, targets, absent)
        opt.zero_grad(set_to_none=True)
        loss.sum().backward()  # type: ignore[no-untyped-call]
        opt.step()
        with torch.no_grad():
            for param, rows in kept:
                assert absent is not None
                shape = (*absent.shape, *([1] * (param.dim() - 2)))
                param.copy_(torch.where(absent.view(shape), rows.unsqueeze(0), param))
        losses[:, step] = loss.detach()
        correct += hits.detach()
        seen += batch
    results = []
    for k in range(count):
        params = {name: stacked[name][k].detach().numpy().copy() for name in names}
        metrics = {
            "train_loss": float(np.mean([float(v) for v in losses[k]])) if total else 0.0,
            "train_accuracy": int(correct[k]) / max(seen, 1),
            "local_steps": float(total),
        }
        results.append(StackedResult(params, metrics))
    return results
