"""FedAffect's ``LocalFewShot`` parts: N-way K-shot episodes and the relation network ``g``.

Sung et al., "Learning to Compare: Relation Network for Few-Shot Learning" (CVPR 2018, Eq.
2-3), as Algorithm 1 of the FedAffect slides (lines 31-35) uses it on a client's few
expression-labelled images: N-way K-shot episodes train the encoder ``f`` and the relation
module ``g`` jointly with the relation network's MSE loss.

Choices made here, where the slides are silent or garbled:

- ``f`` outputs a vector (the framework's backbones), so the relation module is an MLP on
  the layer-normalised pair ``[p, q, |p - q|, p * q]`` (prototype ``p``, query embedding
  ``q``) ending in a sigmoid, not Sung et al.'s conv module on concatenated feature maps
  (an MLP on ``[p, q]`` alone collapsed to the constant score ``1/N``). The class prototype
  is the *mean* of the K support embeddings (Sung et al. sum them; the mean keeps the scale
  independent of K). The loss is the mean
  squared error of the scores against one-hot relation targets ``1(y_query == c)``.

The training loop over episodes is
:func:`fl_secure.algorithms.fedaffect_rounds.local_few_shot`; :func:`expression_accuracy`
scores the trained pair on held-out images.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


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
