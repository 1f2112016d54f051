"""FedAffect: few-shot federated facial expression recognition.

Shome & Kar, "FedAffect: Few-shot federated learning for facial expression recognition"
(ICCV 2021 workshop slides, Algorithm 1). Each client holds a few expression-labelled images
and many unlabelled ones. Two networks are shared: the encoder / embedding network ``f``
(weights ``w_f``) and the relation module ``g`` (weights ``w_g``). Per round, each client

- runs ``LocalFewShot`` (Algorithm 1, lines 31-35) if it holds more labelled images than there
  are classes (line 5): N-way K-shot episodes sampled from its labelled images train ``f`` and
  ``g`` jointly with the relation network's MSE loss (Sung et al., "Learning to Compare:
  Relation Network for Few-Shot Learning", CVPR 2018, Eq. 2-3);
- runs ``LocalReprLearn`` (lines 17-30) if it has unlabelled images: SimCLR (Chen et al., "A
  Simple Framework for Contrastive Learning of Visual Representations", ICML 2020) on two
  augmented views per image, ``z = p(f(t(x)))``, with the NT-Xent loss (lines 26-27)::

      l(i, j) = -log( exp(sim(z_i, z_j) / tau) / sum_{k != i} exp(sim(z_i, z_k) / tau) )
      L = 1 / (2B) * sum_k [ l(2k-1, 2k) + l(2k, 2k-1) ]

and the server averages both networks weighted by the clients' data sizes (lines 13-14)::

    w^{t+1} = sum_k D_k / D * w_k^t

Choices made here, where the slides are silent or garbled:

- Order: ``LocalReprLearn`` starts from the encoder ``LocalFewShot`` returned (taken
  literally, line 10 would overwrite line 7's encoder with one trained from ``w_f^t``, and the
  few-shot update of ``f`` would be lost). Line 6's ``w_f^0, w_g^0`` is read as ``w_f^t, w_g^t``.
- The projection head ``p`` (a 2-layer MLP, as in SimCLR) is initialised once per client and
  kept private across rounds (line 17 initialises it inside ``LocalReprLearn``; a fresh random
  head every round would waste the few local steps). It is never uploaded.
- ``f`` outputs a vector (the framework's backbones), so the relation module is an MLP on
  the layer-normalised pair ``[p, q, |p - q|, p * q]`` (prototype ``p``, query embedding
  ``q``) ending in a sigmoid, not Sung et al.'s conv module on concatenated feature maps
  (an MLP on ``[p, q]`` alone collapsed to the constant score ``1/N``). The class prototype
  is the *mean* of the K support embeddings (Sung et al. sum them; the mean keeps the scale
  independent of K). The loss is the mean
  squared error of the scores against one-hot relation targets ``1(y_query == c)``.
- Augmentations (SimCLR's random resized crop, horizontal flip, colour jitter; no hue jitter
  and no blur) are batched torch operations drawn from a ``torch.Generator``.
- ``D_k`` is the client's labelled plus unlabelled image count, for both networks; a client
  that skipped ``LocalFewShot`` contributes the unchanged global ``w_g`` with its weight
  (Algorithm 1 line 14 sums over all N clients).

The functions above the "Strategy" section are in-process building blocks (used by
``benchmarks/fedaffect.py``); :class:`FedAffect` runs the same client step (:func:`client_round`)
as a :class:`~fl_secure.algorithms.base.Strategy`, over gRPC like every other algorithm
(``algorithm.name = "fedaffect"``). How it maps onto the framework, with the least special-casing:

- Model: :class:`FedAffectModel` is a :class:`~fl_secure.training.FaceModel` whose ``backbone``
  is the encoder ``f`` and whose ``head`` slot holds the relation module ``g``; it adds a
  ``projection`` submodule (SimCLR's ``p``). The strategy declares ``shares_head = True``, so the
  shared parameters are exactly ``backbone.*`` (``w_f``) and ``head.*`` (``w_g``); everything
  else (``projection.*``) is the client's private state, kept and saved by ``LocalTrainer`` like
  FedPE's class embeddings, never uploaded. ``g`` holds no identity template (it scores pairs
  of embeddings), so the exposure is ``private-embedding``.
- Data: the client's training images, with targets = the generator's ``expression``
  attribute for ``algorithm.labels_per_class`` images per expression (picked evenly spread
  through the client's images, so they come from many identities) and ``-1`` (unlabelled)
  for all the others. ``D_k`` = labelled + unlabelled count is the example count the client
  reports, so the coordinator's example-weighted mean *is* Algorithm 1 lines 13-14 (the server
  step stays FedAvg's ``w + mean(delta)``). Under client-level DP (DP-FedAvg) the count is
  hidden and the mean is uniform over the expected cohort, as the sensitivity analysis needs.
- Local schedule: ``train.local_steps`` (or ``train.local_epochs`` passes over the client's
  images in ``train.batch_size`` batches) episodes of ``LocalFewShot`` and as many NT-Xent
  minibatches of ``LocalReprLearn``, Adam at the round's learning rate (the core's optimiser;
  ``train.optimizer`` and ``weight_decay`` do not apply).
- Evaluation: expression accuracy of the relation scores (:func:`expression_accuracy`) on the
  held-out identities, ``labels_per_class`` support images per expression, every other image
  a query (:func:`held_out_expression_split`).
- Example-level DP is refused (config check): NT-Xent couples the examples of a minibatch, so
  per-example clipping would not bound one image's influence.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Self

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fl_secure.algorithms.base import Exposure, Strategy
from fl_secure.config import AlgorithmConfig, ModelConfig, PrivacyUnit
from fl_secure.data.synthetic import EXPRESSIONS
from fl_secure.data.types import FaceDataset
from fl_secure.errors import DataError
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.models.factory import get_backbone
from fl_secure.training import FaceModel, LocalData, set_tensors

NUM_EXPRESSIONS = len(EXPRESSIONS)
HeldOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""Support images, support labels, query images, query labels."""


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


# --------------------------------------------------------------------------- NT-Xent (SimCLR)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float) -> torch.Tensor:
    """NT-Xent loss of Algorithm 1 lines 26-27 on two views ``[B, d]`` (row k of each pairs up).

    ``sim`` is the cosine similarity; each of the 2B views is an anchor whose positive is its
    other view and whose negatives are the other 2B - 2 views. Returns the mean over the 2B
    anchors, i.e. ``1/(2B) * sum_k [l(2k-1, 2k) + l(2k, 2k-1)]``.
    """
    if z1.shape != z2.shape or z1.dim() != 2 or z1.shape[0] < 2:
        raise ValueError(f"need two [B >= 2, d] views of equal shape, got {z1.shape}, {z2.shape}")
    b = z1.shape[0]
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    logits = z @ z.T / tau
    self_mask = torch.eye(2 * b, dtype=torch.bool, device=z.device)
    logits = logits.masked_fill(self_mask, float("-inf"))  # the 1[k != i] of the denominator
    positives = torch.cat([torch.arange(b, 2 * b), torch.arange(b)]).to(z.device)
    return F.cross_entropy(logits, positives)


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One SimCLR view per image: random resized crop, horizontal flip, colour jitter.

    Args:
        images: ``[B, 3, H, W]`` in ``[-1, 1]``.
        generator: source of every random draw (CPU generator).

    Returns:
        ``[B, 3, H, W]`` in ``[-1, 1]``: a crop of 30-100% of the area with aspect ratio in
        [3/4, 4/3] resized back to ``H x W`` (bilinear), flipped with probability 1/2, then
        with probability 0.8 brightness, contrast and saturation factors in [0.6, 1.4].
    """
    b = images.shape[0]

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=generator)

    area = uniform(0.3, 1.0, b)
    log_ratio = uniform(math.log(3 / 4), math.log(4 / 3), b)
    ratio = torch.exp(log_ratio)
    w = torch.sqrt(area * ratio).clamp(max=1.0)  # crop width / image width
    h = torch.sqrt(area / ratio).clamp(max=1.0)
    cx = (1 - w) * uniform(-1.0, 1.0, b)  # crop centre in [-1, 1] coordinates
    cy = (1 - h) * uniform(-1.0, 1.0, b)
    flip = torch.where(torch.rand(b, generator=generator) < 0.5, -1.0, 1.0)
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = w * flip, cx
    theta[:, 1, 1], theta[:, 1, 2] = h, cy
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)

    x = (out + 1) / 2  # jitter in [0, 1]
    jitter = (torch.rand(b, generator=generator) < 0.8).float().view(b, 1, 1, 1)

    def factor() -> torch.Tensor:
        f = uniform(0.6, 1.4, b).view(b, 1, 1, 1)
        return jitter * f + (1 - jitter)

    x = (x * factor()).clamp(0, 1)  # brightness
    grey = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)
    mean = grey.mean(dim=(2, 3), keepdim=True)
    x = ((x - mean) * factor() + mean).clamp(0, 1)  # contrast
    grey = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)
    x = ((x - grey) * factor() + grey).clamp(0, 1)  # saturation
    result: torch.Tensor = x * 2 - 1
    return result


# --------------------------------------------------------------------- relation network


class RelationModule(nn.Module):
    """``g``: scores a (class prototype, query embedding) pair in (0, 1).

    Both embeddings are layer-normalised, and the MLP sees ``[p, q, |p - q|, p * q]``: on
    vectors (not Sung et al.'s feature maps, where the conv module compares aligned
    positions) a plain MLP on ``[p, q]`` collapsed to the constant score ``1/N`` in our runs,
    the comparison features train.

    Args:
        embedding_size: length of ``f``'s embeddings.
        hidden: width of the hidden layer.
    """

    def __init__(self, embedding_size: int, hidden: int = 64):
        super().__init__()
        self.norm = nn.LayerNorm(embedding_size)
        self.net = nn.Sequential(
            nn.Linear(4 * embedding_size, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def pair_features(self, prototypes: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """``[M, N, 4d]`` features of every (query, prototype) pair."""
        p, q = self.norm(prototypes), self.norm(queries)
        m, n = q.shape[0], p.shape[0]
        pp, qq = p.unsqueeze(0).expand(m, n, -1), q.unsqueeze(1).expand(m, n, -1)
        return torch.cat([pp, qq, (pp - qq).abs(), pp * qq], dim=2)

    def forward(self, prototypes: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """Relation scores ``[M, N]`` of queries ``[M, d]`` against prototypes ``[N, d]``."""
        logits = self.net(self.pair_features(prototypes, queries)).squeeze(-1)
        scores: torch.Tensor = torch.sigmoid(logits)
        return scores


def projection_head(embedding_size: int, projection_dim: int) -> nn.Module:
    """SimCLR's projection ``p``: Linear, ReLU, Linear (client-private)."""
    return nn.Sequential(
        nn.Linear(embedding_size, embedding_size),
        nn.ReLU(),
        nn.Linear(embedding_size, projection_dim),
    )


@dataclass(frozen=True)
class Episode:
    """An N-way K-shot episode: indices into the labelled images and episode-local labels.

    Attributes:
        classes: the N sampled class ids (episode label ``c`` is ``classes[c]``).
        support: ``[N * K]`` indices, class-major.
        support_labels: ``[N * K]`` episode labels in ``0 .. N - 1``.
        query: ``[N * Q]`` indices, class-major, disjoint from ``support``.
        query_labels: ``[N * Q]`` episode labels.
    """

    classes: torch.Tensor
    support: torch.Tensor
    support_labels: torch.Tensor
    query: torch.Tensor
    query_labels: torch.Tensor


def eligible_classes(labels: torch.Tensor, per_class: int) -> torch.Tensor:
    """Sorted class ids with at least ``per_class`` images."""
    classes, counts = torch.unique(labels, return_counts=True)
    eligible: torch.Tensor = classes[counts >= per_class]
    return eligible


def sample_episode(
    labels: torch.Tensor,
    n_way: int,
    k_shot: int,
    n_query: int,
    generator: torch.Generator,
) -> Episode:
    """Sample N classes, then K support and Q query images of each, without replacement.

    Raises:
        ValueError: if fewer than ``n_way`` classes have ``k_shot + n_query`` images.
    """
    pool = eligible_classes(labels, k_shot + n_query)
    if len(pool) < n_way:
        raise ValueError(
            f"{n_way}-way episodes need {n_way} classes with >= {k_shot + n_query} images; "
            f"only {len(pool)} have"
        )
    classes = pool[torch.randperm(len(pool), generator=generator)[:n_way]]
    support: list[torch.Tensor] = []
    query: list[torch.Tensor] = []
    for c in classes:
        members = torch.nonzero(labels == c).flatten()
        chosen = members[torch.randperm(len(members), generator=generator)[: k_shot + n_query]]
        support.append(chosen[:k_shot])
        query.append(chosen[k_shot:])
    ways = torch.arange(n_way)
    return Episode(
        classes=classes,
        support=torch.cat(support),
        support_labels=ways.repeat_interleave(k_shot),
        query=torch.cat(query),
        query_labels=ways.repeat_interleave(n_query),
    )


def prototypes(embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Mean embedding ``[num_classes, d]`` of each label ``0 .. num_classes - 1``."""
    one_hot = F.one_hot(labels, num_classes).to(embeddings.dtype)  # [S, C]
    counts = one_hot.sum(0).clamp(min=1).unsqueeze(1)
    result: torch.Tensor = one_hot.T @ embeddings / counts
    return result


def relation_targets(query_labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """One-hot relation targets ``[M, N]``: ``1(y_query == c)`` (Sung et al. Eq. 3)."""
    return F.one_hot(query_labels, num_classes).float()


def relation_loss(
    encoder: nn.Module, relation: nn.Module, images: torch.Tensor, episode: Episode
) -> torch.Tensor:
    """MSE between the relation scores of an episode's queries and their one-hot targets."""
    n = len(episode.classes)
    emb = encoder(torch.cat([images[episode.support], images[episode.query]]))
    protos = prototypes(emb[: len(episode.support)], episode.support_labels, n)
    scores = relation(protos, emb[len(episode.support) :])
    return F.mse_loss(scores, relation_targets(episode.query_labels, n))


# ------------------------------------------------------------------------ client and server


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


@torch.no_grad()
def expression_accuracy(
    encoder: nn.Module,
    relation: nn.Module,
    support: torch.Tensor,
    support_labels: torch.Tensor,
    queries: torch.Tensor,
    query_labels: torch.Tensor,
    num_classes: int,
    batch_size: int = 256,
) -> float:
    """Share of queries whose highest relation score is against their own class's prototype.

    Prototypes are the mean support embeddings of classes ``0 .. num_classes - 1``; a class
    absent from the support set is never predicted.
    """
    encoder.eval()
    relation.eval()
    protos = prototypes(_embed(encoder, support, batch_size), support_labels, num_classes)
    present = torch.bincount(support_labels, minlength=num_classes) > 0
    scores = relation(protos, _embed(encoder, queries, batch_size))
    scores = scores.masked_fill(~present.unsqueeze(0), -1.0)
    return float((scores.argmax(1) == query_labels).float().mean())


def _embed(encoder: nn.Module, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    return torch.cat(
        [encoder(images[i : i + batch_size]) for i in range(0, len(images), batch_size)]
    )


# ---------------------------------------------------------------------------- simulation


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


# ------------------------------------------------------------------------------ Strategy


class FedAffectModel(FaceModel):
    """``f`` as the backbone, ``g`` in the head slot (shared), ``p`` as private ``projection``."""

    def __init__(self, encoder: nn.Module, relation: RelationModule, projection: nn.Module):
        nn.Module.__init__(self)  # FaceModel's head slot is typed for margin heads: fill it here
        self.backbone = encoder
        self.head = relation  # type: ignore[assignment]
        self.projection = projection

    def forward(
        self,
        images: torch.Tensor,
        labels: torch.Tensor | None = None,
        class_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embeddings ``f(x)`` (there are no class logits)."""
        del labels, class_mask
        result: torch.Tensor = self.backbone(images)
        return result

    @property
    def relation(self) -> nn.Module:
        """The relation module ``g`` (stored as ``head``)."""
        head: nn.Module = self.head
        return head


def build_fedaffect_model(
    model: ModelConfig, algorithm: AlgorithmConfig, image_size: int, seed: int
) -> FedAffectModel:
    """``w_f^0`` and ``w_g^0`` (Algorithm 1 line 1) and a client's ``p``, from ``seed``.

    ``f`` is initialised exactly as :func:`~fl_secure.training.build_model`'s backbone (the same
    draws), so FedAffect and FedAvg start from the same encoder.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = get_backbone(
            model.backbone, embedding_size=model.embedding_size, image_size=image_size
        )
        relation = RelationModule(model.embedding_size, algorithm.relation_hidden)
        projection = projection_head(model.embedding_size, algorithm.projection_dim)
    return FedAffectModel(encoder, relation, projection)


def spread_pick(members: np.ndarray, count: int) -> np.ndarray:
    """``count`` of ``members`` evenly spread through them (all of them if fewer)."""
    if len(members) <= count:
        return members
    return members[np.round(np.linspace(0, len(members) - 1, count)).astype(np.int64)]


def expression_targets(data: FaceDataset, labels_per_class: int) -> torch.Tensor:
    """Per image: its expression if among the ``labels_per_class`` labelled of its class, else -1.

    Raises:
        DataError: if the images carry no ``expression`` attribute (synthetic faces do).
    """
    if "expression" not in data.attributes:
        raise DataError(
            "fedaffect needs expression labels: the images have no 'expression' attribute "
            "(use data.source = 'synthetic')"
        )
    expr = np.asarray(data.attributes["expression"], dtype=np.int64)
    targets = np.full(len(expr), -1, dtype=np.int64)
    for c in range(NUM_EXPRESSIONS):
        chosen = spread_pick(np.flatnonzero(expr == c), labels_per_class)
        targets[chosen] = c
    return torch.from_numpy(targets)


def client_data(data: LocalData) -> ClientData:
    """The labelled (target >= 0) and unlabelled (target -1) training images of a client."""
    labelled = data.train_targets >= 0
    return ClientData(
        labelled=data.train.images[labelled],
        labels=data.train_targets[labelled],
        unlabelled=data.train.images[~labelled],
    )


def held_out_expression_split(data: FaceDataset, support_per_class: int) -> HeldOut:
    """Support (``support_per_class`` per expression, spread) and query images of a test set."""
    targets = expression_targets(data, support_per_class)
    support = targets >= 0
    expr = torch.from_numpy(np.asarray(data.attributes["expression"], dtype=np.int64))
    return (
        data.images[support],
        expr[support],
        data.images[~support],
        expr[~support],
    )


class FedAffect(Strategy):
    """Algorithm 1 of the FedAffect slides as a strategy: ``f`` and ``g`` shared, ``p`` private."""

    name: ClassVar[str] = "fedaffect"
    exposure: ClassVar[Exposure] = "private-embedding"
    shares_head: ClassVar[bool] = True  # the head slot holds g, which is shared
    evaluates_expressions: ClassVar[bool] = True
    refused_privacy_units: ClassVar[Mapping[PrivacyUnit, str]] = {
        "example": "NT-Xent couples the images of a minibatch, so DP-SGD's per-example "
        "clipping would not bound one image's influence; use privacy.unit = 'client' "
        "(DP-FedAvg) or 'none'"
    }

    def __init__(self, params: AlgorithmConfig | None = None) -> None:
        self.params = params or AlgorithmConfig(name="fedaffect")

    @classmethod
    def from_config(cls, params: AlgorithmConfig | None = None, *, head: str | None = None) -> Self:
        """The run's labels, episode shape, NT-Xent temperature and module sizes."""
        del head
        return cls(params)

    def evaluate_client(self, model: FaceModel, data: LocalData) -> dict[str, float]:
        """Expression accuracy on the client's test images, its labelled images as support.

        The prototypes are the client's own labelled training images (its few labels); the
        queries are its test images with the generator's ``expression`` attribute.
        """
        labelled = data.train_targets >= 0
        if not bool(labelled.any()) or len(data.test) == 0:
            return {}
        truth = torch.from_numpy(np.asarray(data.test.attributes["expression"], dtype=np.int64))
        relation = model.relation if isinstance(model, FedAffectModel) else model.head
        accuracy = expression_accuracy(
            model.backbone,
            relation,
            data.train.images[labelled],
            data.train_targets[labelled],
            data.test.images,
            truth,
            NUM_EXPRESSIONS,
        )
        majority = float(torch.bincount(truth, minlength=NUM_EXPRESSIONS).max()) / len(truth)
        return {"expression_accuracy": accuracy, "expression_majority": majority}

    def describe(self) -> str:
        """One line for logs and reports."""
        return (
            "FedAffect: relation network on few expression labels + NT-Xent on unlabelled "
            "images; encoder f and relation module g averaged by data size, projection head "
            "private (FedAffect slides, Algorithm 1)"
        )

    def num_head_classes(self, num_train_identities: int, local_identities: np.ndarray) -> int:
        """No class rows: ``g`` compares embeddings (the value only satisfies the interface)."""
        del num_train_identities, local_identities
        return 1

    def local_data(
        self, train: FaceDataset, test: FaceDataset, train_identities: np.ndarray
    ) -> LocalData:
        """Targets = expression of the few labelled images, -1 for the unlabelled ones."""
        del train_identities
        targets = expression_targets(train, self.params.labels_per_class)
        return LocalData(train=train, test=test, train_targets=targets, class_mask=None)

    def config(self, data: LocalData, training: LocalTraining) -> FedAffectConfig:
        """The core's settings for one round, from the run's algorithm and train settings."""
        n = len(data.train)
        batch = max(2, min(training.batch_size, n))
        steps = training.local_steps or training.local_epochs * max(1, n // batch)
        p = self.params
        return FedAffectConfig(
            tau=p.nt_xent_tau,
            n_way=p.n_way,
            k_shot=p.k_shot,
            n_query=p.n_query,
            episodes=steps,
            repr_steps=steps if p.use_unlabelled else 0,
            batch_size=batch,
            learning_rate=training.learning_rate,
            projection_dim=p.projection_dim,
            relation_hidden=p.relation_hidden,
        )

    def local_train(
        self,
        model: FaceModel,
        data: LocalData,
        training: LocalTraining,
        *,
        generator: torch.Generator,
    ) -> dict[str, float]:
        """Algorithm 1 lines 5-11 on this client: LocalFewShot, then LocalReprLearn."""
        if not isinstance(model, FedAffectModel):
            raise TypeError("fedaffect trains a FedAffectModel (build_fedaffect_model)")
        cfg = self.config(data, training)
        local = client_data(data)
        state = ClientState(model.projection)
        metrics = client_round(
            model.backbone, model.relation, state, local, cfg, generator, NUM_EXPRESSIONS
        )
        return {
            **metrics,
            "local_steps": float(cfg.episodes + cfg.repr_steps),
            "labelled": float(local.labelled.shape[0]),
            "unlabelled": float(local.unlabelled.shape[0]),
        }


def make_expression_evaluator(
    model_cfg: ModelConfig,
    algorithm: AlgorithmConfig,
    image_size: int,
    seed: int,
    held_out: FaceDataset,
) -> Callable[[Tensors], dict[str, float]]:
    """Server-side evaluation: expression accuracy of the global ``f`` and ``g`` on ``held_out``."""
    model = build_fedaffect_model(model_cfg, algorithm, image_size, seed)
    split = held_out_expression_split(held_out, algorithm.labels_per_class)
    queries = split[3]
    majority = float(torch.bincount(queries, minlength=NUM_EXPRESSIONS).max()) / max(
        len(queries), 1
    )

    def evaluate(params: Tensors) -> dict[str, float]:
        set_tensors(model, params)
        acc = expression_accuracy(model.backbone, model.relation, *split, NUM_EXPRESSIONS)
        return {"expression_accuracy": acc, "expression_majority": majority}

    return evaluate
