"""HF-MAML: Hessian-free model-agnostic meta-learning for federated face recognition.

HF-MAML paper (Algorithm 1; Fallah, Mokhtari & Ozdaglar 2020's Hessian-free MAML), each local
step on three disjoint batches ``D``, ``D'``, ``D''`` of the client's data:

    w~ = w - alpha * grad F(w, D)                                                   (Eq. 2)
    g  = grad f(w~, D')
    Hg = [grad f(w + delta g, D'') - grad f(w - delta g, D'')] / (2 delta)          (Eq. 3)
    w  = w - beta * (g - alpha * Hg)          = w - beta grad f(w~, D') [I - alpha H]  (Eq. 1)

``f`` is the margin-head cross-entropy; ``F = f + C (1 - S_c(f_emb^global(x), f_emb^local(x)))``
adds the embedding regularization of Eq. 4 (cosine between the embeddings of the round's
starting model and of the local model; ``C = 0`` turns it off). The paper's defaults are
``alpha = 0.01``, ``beta = 0.1``, ``delta = 0.001`` (Table IV), with SGD at lr 0.01 and
momentum 0.9 for the baselines' training.

The outer step (Eq. 1) goes through the run's configured optimiser, the one FedAvg's local
training uses (:func:`fl_secure.training.make_optimizer`: ``train.optimizer``, the round's
``train.lr``, ``train.momentum``, ``train.weight_decay``, ``train.head_lr_scale``; its state
is reset every round): the HF-MAML meta-gradient ``g - alpha * Hg`` (:func:`meta_gradient`)
takes the place of the plain gradient, so HF-MAML differs from FedAvg by its gradient alone,
not by a momentum-free step. ``algorithm.beta > 0`` replaces the round's learning rate by a
constant ``beta``; 0 (the default) keeps ``train.lr``. The inner step (Eq. 2) stays a plain
step of ``algorithm.alpha``: at the paper's 0.01 on an untrained model the correction
``alpha * Hg`` was larger than ``g`` itself (``alpha |Hg| / |g|`` of 1.8-2.8 at initialisation
of the experiments' ``cnn-small``, 0.21-0.28 at ``alpha = 1e-3``; pinned by
tests/fl_secure/algorithms/test_hfmaml_optimiser.py), so the from-scratch experiment bases
set ``alpha = 1e-3``; the paper's 0.01 (the default) is for its pretrained backbone, whose
gradients are small.

Eq. 3 is a central difference along ``g`` itself, so its error grows like
``delta^2 ||g||^2``: measured on a small GroupNorm CNN with ``||g|| ~ 300``
(tests/fl_secure/test_hfmaml.py), the relative error of ``H g`` is 1.0 at ``delta = 1e-3``
and 5e-4 at ``1e-6``; small gradients (a pretrained backbone, as in the paper) or a smaller
``algorithm.delta`` keep the Hessian term meaningful.

``hfmaml`` keeps the classification layer on the client (private class embeddings);
``hfmaml-global`` averages it like FedAvg, with absent classes masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar, Self

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fl_secure.algorithms.base import Exposure, Strategy
from fl_secure.config import AlgorithmConfig
from fl_secure.messages import LocalTraining
from fl_secure.training import (
    AbsentRows,
    FaceModel,
    LocalData,
    make_optimizer,
    parameter_groups,
    round_start_copy,
)


def _loss(
    model: FaceModel,
    images: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None,
    reference: torch.Tensor | None = None,
    reg: float = 0.0,
) -> torch.Tensor:
    """``f`` (``reg = 0``) or ``F`` of Eq. 4 on one batch."""
    emb = model.backbone(images)
    loss = F.cross_entropy(model.head(emb, targets, mask), targets)
    if reg > 0 and reference is not None:
        loss = loss + reg * (1 - F.cosine_similarity(emb, reference, dim=1)).mean()
    return loss


def _grads(loss: torch.Tensor, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


@torch.no_grad()
def _add(params: Sequence[nn.Parameter], vectors: Sequence[torch.Tensor], scale: float) -> None:
    for p, v in zip(params, vectors, strict=True):
        p.add_(v, alpha=scale)


def finite_difference_hvp(
    model: FaceModel,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    vector: Sequence[torch.Tensor],
    delta: float,
) -> list[torch.Tensor]:
    """Eq. 3: ``H v ~ [grad f(w + delta v) - grad f(w - delta v)] / (2 delta)``.

    Evaluated at the model's current parameters, which are restored exactly afterwards.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    _add(params, vector, delta)
    plus = _grads(_loss(model, *batch), params)
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    _add(params, vector, -delta)
    minus = _grads(_loss(model, *batch), params)
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    return [(a - b) / (2 * delta) for a, b in zip(plus, minus, strict=True)]


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def meta_gradient(
    model: FaceModel,
    batches: Sequence[Batch],
    *,
    alpha: float,
    delta: float,
    reg: float = 0.0,
    references: Sequence[torch.Tensor | None] = (None, None, None),
) -> tuple[list[torch.Tensor], float]:
    """The HF-MAML meta-gradient ``g - alpha * Hg`` at the model's parameters (Eq. 1-3).

    ``w~ = w - alpha grad F(w, D)`` (Eq. 2), ``g = grad f(w~, D')``, ``Hg`` by the central
    difference of Eq. 3 on ``D''`` at ``w``. The parameters are restored exactly afterwards.

    Returns:
        One tensor per trainable parameter (``model.parameters()`` order) and ``f(w~, D')``.
    """
    d, d1, d2 = batches
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    # w~ = w - alpha grad F(w, D)                                                  (Eq. 2)
    _add(params, _grads(_loss(model, *d, reference=references[0], reg=reg), params), -alpha)
    outer = _loss(model, *d1)
    g = _grads(outer, params)  # grad f(w~, D')
    with torch.no_grad():
        for p, s in zip(params, start, strict=True):
            p.copy_(s)
    hg = finite_difference_hvp(model, d2, g, delta)  # (Eq. 3) at w
    return [gi - alpha * hi for gi, hi in zip(g, hg, strict=True)], float(outer.detach())


def hfmaml_step(
    model: FaceModel,
    batches: Sequence[Batch],
    *,
    alpha: float,
    beta: float = 0.0,
    delta: float,
    reg: float = 0.0,
    references: Sequence[torch.Tensor | None] = (None, None, None),
    optimizer: torch.optim.Optimizer | None = None,
) -> float:
    """One HF-MAML update (Eq. 1-3) in place; returns ``f(w~, D')``.

    With ``optimizer`` (over the model's trainable parameters) the meta-gradient is written
    to the parameters' ``.grad`` and the optimiser steps (its momentum and weight decay
    apply; ``beta`` is unused); without, Eq. 1 verbatim: ``w <- w - beta (g - alpha Hg)``.
    """
    grads, outer = meta_gradient(
        model, batches, alpha=alpha, delta=delta, reg=reg, references=references
    )
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        if beta <= 0:
            raise ValueError(f"a plain HF-MAML step needs beta > 0, got {beta:g}")
        _add(params, grads, -beta)  # (Eq. 1)
        return outer
    optimizer.zero_grad(set_to_none=True)
    for p, gr in zip(params, grads, strict=True):
        p.grad = gr.detach().clone()
    optimizer.step()  # (Eq. 1) through the run's optimiser
    return outer


class HFMAML(Strategy):
    """HF-MAML with a local classification layer (class embeddings stay on the client)."""

    name: ClassVar[str] = "hfmaml"
    exposure: ClassVar[Exposure] = "private-embedding"
    shares_head: ClassVar[bool] = False
    uses_embedding_reg: ClassVar[bool] = True
    local_softmax_only: ClassVar[bool] = True

    def __init__(
        self, alpha: float = 0.01, beta: float = 0.0, delta: float = 0.001, reg: float = 0.0
    ) -> None:
        self.alpha, self.beta, self.delta, self.reg = alpha, beta, delta, reg

    @classmethod
    def from_config(
        cls,
        params: AlgorithmConfig | None = None,
        *,
        head: str | None = None,
        scale: float | None = None,
    ) -> Self:
        """The run's inner step (Eq. 2), outer rate (Eq. 1), difference width (Eq. 3), C (Eq. 4)."""
        del head, scale
        if params is None:
            return cls()
        return cls(params.alpha, params.beta, params.delta, params.embedding_reg)

    def describe(self) -> str:
        """One line for logs and reports."""
        where = "global" if self.shares_head else "local"
        outer = f"beta {self.beta:g}" if self.beta > 0 else "outer rate train.lr"
        return (
            f"HF-MAML (alpha {self.alpha:g}, {outer}, delta {self.delta:g}, "
            f"embedding regularization C = {self.reg:g}), {where} classification layer"
        )

    def local_train(
        self,
        model: FaceModel,
        data: LocalData,
        training: LocalTraining,
        *,
        generator: torch.Generator,
    ) -> dict[str, float]:
        """``local_steps`` (or epochs x batches / 3) HF-MAML steps on disjoint batch triples.

        The outer step is the run's optimiser (:func:`fl_secure.training.make_optimizer`, as
        FedAvg's local training) at the round's learning rate, or at ``beta`` if it is > 0.
        """
        model.train()
        n = len(data.train)
        if n < 3:
            raise ValueError(
                f"HF-MAML needs at least 3 training images on a client (three disjoint batches "
                f"D, D', D'' per step, Eq. 2-3); this client has {n}"
            )
        batch = max(1, min(training.batch_size, n // 3))
        steps = training.local_steps or max(1, training.local_epochs * (n // (3 * batch)))
        frozen = None
        if self.reg > 0:  # the round's starting model, for Eq. 4
            frozen = round_start_copy(model.backbone)
        absent = AbsentRows(model, data.class_mask)
        if self.beta > 0:
            training = replace(training, learning_rate=self.beta)
        optimizer = make_optimizer(parameter_groups(model, training), training)
        losses = []
        for _ in range(steps):
            order = torch.randperm(n, generator=generator)[: 3 * batch]
            triple = []
            refs: list[torch.Tensor | None] = []
            for part in torch.split(order, batch):
                images = data.train.images[part]
                triple.append((images, data.train_targets[part], data.class_mask))
                if frozen is not None:
                    with torch.no_grad():
                        refs.append(frozen(images))
                else:
                    refs.append(None)
            losses.append(
                hfmaml_step(
                    model,
                    triple,
                    alpha=self.alpha,
                    delta=self.delta,
                    reg=self.reg,
                    references=refs,
                    optimizer=optimizer,
                )
            )
            absent.restore()
        return {"train_loss": float(np.mean(losses)), "local_steps": float(steps)}


class HFMAMLGlobal(HFMAML):
    """HF-MAML with a global classification layer, averaged with absent classes masked."""

    name: ClassVar[str] = "hfmaml-global"
    exposure: ClassVar[Exposure] = "global-head"
    shares_head: ClassVar[bool] = True
