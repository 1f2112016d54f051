"""FedAffect's Algorithm 1 in process: one client's round and the server's weighted average.

Shome & Kar, "FedAffect: Few-shot federated learning for facial expression recognition"
(ICCV 2021 workshop slides, Algorithm 1). Per round, each client

- runs ``LocalFewShot`` (lines 31-35, :func:`local_few_shot`) if it holds more labelled
  images than there are classes (line 5): episodes of
  :mod:`fl_secure.algorithms.fedaffect_relation` train ``f`` and ``g``;
- runs ``LocalReprLearn`` (lines 17-30, :func:`local_repr_learn`) if it has unlabelled
  images: NT-Xent on two views per image (:mod:`fl_secure.algorithms.fedaffect_simclr`);

and the server averages both networks weighted by the clients' data sizes (lines 13-14,
:func:`weighted_average`)::

    w^{t+1} = sum_k D_k / D * w_k^t

Choices made here, where the slides are silent or garbled:

- Order: ``LocalReprLearn`` starts from the encoder ``LocalFewShot`` returned (taken
  literally, line 10 would overwrite line 7's encoder with one trained from ``w_f^t``, and the
  few-shot update of ``f`` would be lost). Line 6's ``w_f^0, w_g^0`` is read as ``w_f^t, w_g^t``.
- The projection head ``p`` is initialised once per client and kept private across rounds
  (line 17 initialises it inside ``LocalReprLearn``; a fresh random head every round would
  waste the few local steps). It is never uploaded.
- ``D_k`` is the client's labelled plus unlabelled image count, for both networks; a client
  that skipped ``LocalFewShot`` contributes the unchanged global ``w_g`` with its weight
  (Algorithm 1 line 14 sums over all N clients).

These are in-process building blocks (:func:`run_round` is a whole round without the
framework; ``benchmarks/fedaffect.py`` uses :func:`weighted_average`); the strategy
:class:`fl_secure.algorithms.fedaffect.FedAffect` runs the same client step
(:func:`client_round`) over gRPC.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fl_secure.algorithms.fedaffect_relation import (
    RelationModule,
    eligible_classes,
    relation_loss,
    sample_episode,
)
from fl_secure.algorithms.fedaffect_simclr import augment, nt_xent
from fl_secure.models.factory import get_backbone


@dataclass(frozen=True)
class FedAffectConfig:
    """Hyper-parameters of FedAffect's local training.

    Attributes:
        tau: NT-Xent temperature (SimCLR's ``tau``; the slides' ``gamma``).
        n_way: classes per episode (N); capped at the classes a client can fill.
        k_shot: support images per class (K).
        n_query: query images per class (Q).
        episodes: few-shot episodes (optimizer steps) per round (``LocalFewShot``).
        repr_steps: NT-Xent minibatches (optimizer steps) per round (``LocalReprLearn``).
        batch_size: unlabelled images per NT-Xent minibatch (B; 2B views).
        learning_rate: Adam learning rate (the slides' ``eta``).
        projection_dim: output size of the private projection head ``p``.
        relation_hidden: hidden width of the relation module ``g``.
    """

    tau: float = 0.5
    n_way: int = 5
    k_shot: int = 1
    n_query: int = 2
    episodes: int = 10
    repr_steps: int = 10
    batch_size: int = 32
    learning_rate: float = 1e-3
    projection_dim: int = 64
    relation_hidden: int = 64

    def __post_init__(self) -> None:
        """Reject values that cannot train."""
        if self.tau <= 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")
        if self.n_way < 2 or self.k_shot < 1 or self.n_query < 1:
            raise ValueError("episodes need n_way >= 2, k_shot >= 1 and n_query >= 1")
        if self.batch_size < 2:
            raise ValueError(
                f"batch_size must be >= 2 (NT-Xent needs negatives), got {self.batch_size}"
            )
        if min(self.episodes, self.repr_steps) < 0:
            raise ValueError("episodes and repr_steps must be >= 0")
        if min(self.projection_dim, self.relation_hidden) < 1:
            raise ValueError("projection_dim and relation_hidden must be >= 1")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


@dataclass
class ClientData:
    """One client's images: a few expression-labelled ones and many unlabelled ones."""

    labelled: torch.Tensor
    labels: torch.Tensor
    unlabelled: torch.Tensor

    @property
    def num_examples(self) -> int:
        """``D_k``: labelled plus unlabelled images."""
        return int(self.labelled.shape[0] + self.unlabelled.shape[0])


@dataclass
class ClientState:
    """What a client keeps between rounds: its private projection head ``p``."""

    projection: nn.Module
    metrics: dict[str, float] = field(default_factory=dict)


def local_few_shot(
    encoder: nn.Module,
    relation: nn.Module,
    data: ClientData,
    cfg: FedAffectConfig,
    generator: torch.Generator,
) -> list[float]:
    """``LocalFewShot`` (Algorithm 1, lines 31-35): train ``f`` and ``g`` on episodes.

    Returns the relation loss of each episode (before its step).
    """
    n_way = min(cfg.n_way, len(eligible_classes(data.labels, cfg.k_shot + cfg.n_query)))
    if n_way < 2:
        return []
    params = list(encoder.parameters()) + list(relation.parameters())
    optimizer = torch.optim.Adam(params, lr=cfg.learning_rate)
    encoder.train()
    relation.train()
    losses = []
    for _ in range(cfg.episodes):
        episode = sample_episode(data.labels, n_way, cfg.k_shot, cfg.n_query, generator)
        loss = relation_loss(encoder, relation, data.labelled, episode)
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def local_repr_learn(
    encoder: nn.Module,
    projection: nn.Module,
    unlabelled: torch.Tensor,
    cfg: FedAffectConfig,
    generator: torch.Generator,
) -> list[float]:
    """``LocalReprLearn`` (Algorithm 1, lines 17-30): NT-Xent on two views per image.

    Returns the NT-Xent loss of each minibatch (before its step).
    """
    if unlabelled.shape[0] < 2:
        return []
    params = list(encoder.parameters()) + list(projection.parameters())
    optimizer = torch.optim.Adam(params, lr=cfg.learning_rate)
    encoder.train()
    projection.train()
    batch = min(cfg.batch_size, unlabelled.shape[0])
    losses = []
    for _ in range(cfg.repr_steps):
        idx = torch.randperm(unlabelled.shape[0], generator=generator)[:batch]
        x = unlabelled[idx]
        z1 = projection(encoder(augment(x, generator)))
        z2 = projection(encoder(augment(x, generator)))
        loss = nt_xent(z1, z2, cfg.tau)
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def client_round(
    encoder: nn.Module,
    relation: nn.Module,
    state: ClientState,
    data: ClientData,
    cfg: FedAffectConfig,
    generator: torch.Generator,
    num_classes: int,
) -> dict[str, float]:
    """One client's round of Algorithm 1 (lines 5-11), in place on ``encoder`` and ``relation``.

    ``encoder`` and ``relation`` must hold the global weights; afterwards they hold the
    client's ``(w_f^t)_i`` and ``(w_g^t)_i``. Returns mean losses of the round.
    """
    metrics: dict[str, float] = {}
    if data.labelled.shape[0] > num_classes:  # line 5
        few = local_few_shot(encoder, relation, data, cfg, generator)
        if few:
            metrics["relation_loss"] = sum(few) / len(few)
    rep = local_repr_learn(encoder, state.projection, data.unlabelled, cfg, generator)
    if rep:
        metrics["nt_xent"] = sum(rep) / len(rep)
    state.metrics = metrics
    return metrics


def weighted_average(
    states: Sequence[Mapping[str, torch.Tensor]], sizes: Sequence[int | float]
) -> dict[str, torch.Tensor]:
    """``sum_k D_k / D * w_k`` of state dicts (Algorithm 1, lines 13-14).

    Floating tensors are averaged in float64 and cast back; other tensors (counters) are
    taken from the first state.
    """
    if not states or len(states) != len(sizes):
        raise ValueError("need one size per state and at least one state")
    total = float(sum(sizes))
    if total <= 0 or any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be >= 0 with a positive sum, got {list(sizes)}")
    keys = list(states[0])
    if any(list(s) != keys for s in states[1:]):
        raise ValueError("state dicts have different keys")
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        first = states[0][key]
        if not first.is_floating_point():
            out[key] = first.clone()
            continue
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for state, size in zip(states, sizes, strict=True):
            acc += state[key].to(torch.float64) * (float(size) / total)
        out[key] = acc.to(first.dtype)
    return out


@dataclass
class FedAffectModels:
    """The global networks: encoder ``f`` (``w_f``) and relation module ``g`` (``w_g``)."""

    encoder: nn.Module
    relation: nn.Module


def build_models(
    backbone: str, embedding_size: int, image_size: int, cfg: FedAffectConfig, seed: int
) -> FedAffectModels:
    """Initialise ``w_f^0`` and ``w_g^0`` (Algorithm 1, line 1) from ``seed``."""
    torch.manual_seed(seed)
    encoder = get_backbone(backbone, embedding_size=embedding_size, image_size=image_size)
    return FedAffectModels(encoder, RelationModule(embedding_size, cfg.relation_hidden))


def run_round(
    models: FedAffectModels,
    clients: Sequence[ClientData],
    states: Sequence[ClientState],
    cfg: FedAffectConfig,
    generator: torch.Generator,
    num_classes: int,
) -> list[dict[str, float]]:
    """One communication round (Algorithm 1, lines 4-14), updating ``models`` in place."""
    enc_states, rel_states, metrics = [], [], []
    for data, state in zip(clients, states, strict=True):
        encoder = copy.deepcopy(models.encoder)
        relation = copy.deepcopy(models.relation)
        metrics.append(client_round(encoder, relation, state, data, cfg, generator, num_classes))
        enc_states.append(encoder.state_dict())
        rel_states.append(relation.state_dict())
    sizes = [c.num_examples for c in clients]
    models.encoder.load_state_dict(weighted_average(enc_states, sizes))
    models.relation.load_state_dict(weighted_average(rel_states, sizes))
    return metrics
