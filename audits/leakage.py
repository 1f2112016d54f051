"""Analytic update leakage of a fully connected layer, and identity templates of a shared head.

**Inputs from a weight/bias update.** For a fully connected layer ``y = W x + b`` and a loss
``L`` of one example, ``dL/dW[i] = (dL/dy[i]) x`` and ``dL/db[i] = dL/dy[i]``, so every row
with a non-zero bias gradient gives the input exactly::

    x = (dL/dW[i]) / (dL/db[i])

(Phong et al., "Privacy-Preserving Deep Learning via Additively Homomorphic Encryption",
IEEE TIFS 2018, Sec. 3; Geiping et al., "Inverting Gradients -- How easy is it to break
privacy in federated learning?", NeurIPS 2020, Sec. 4). A single step of
SGD multiplies both by ``-lr``, so the ratio of the *update* rows is the same. For a batch,
``dL/dW[i] = sum_n g[n, i] x_n`` and ``dL/db[i] = sum_n g[n, i]``: a row that exactly one
example activated (``g[n, i] != 0`` for one ``n`` only, as behind a ReLU; Fowl et al., "Robbing
the Fed", ICLR 2022, Sec. 3) still recovers that example exactly; other rows give weighted
mixtures. Several local steps or a secure-aggregated sum of clients mix inputs further.

**Who took part, from a sum.** The rows of one step's weight update are combinations of the
inputs, ``dW = sum_n g[:, n] x_n^T``, so the row space of ``dW`` lies in ``span{x_n}``, and
equals it when the ``g[:, n]`` are linearly independent (at most ``out`` inputs). A sum of
clients' updates -- what the server holds under secure aggregation -- keeps this: its row space
is the span of every participant's inputs. :func:`span_membership` takes the top ``r`` right
singular vectors ``V_r`` of the summed ``dW`` and scores each gallery vector ``v`` by how much
of it lies in that span, ``||V_r^T v|| / ||v||`` (the cosine between ``v`` and its
projection). The mixing of rows that defeats :func:`recover_fc_inputs` does not matter to it:
with one image per client the span holds each participant's input exactly, whatever the
weights of the mixture. It follows from the same identity as the row ratio above. Distributed
DP noise spreads over every direction and hides the span.

**Identity templates.** The rows ``W_c`` of a shared margin head are class embeddings: a party
that sees the head holds one template per identity and can match it against embeddings of
faces -- the leak FedGC (Niu & Deng, AAAI 2022) keeps heads away from other clients for.

Identification is cosine nearest neighbour against a labelled gallery of vectors in the same
space (embeddings or penultimate features of the identities' images, computed by the auditor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DEFAULT_RELATIVE_TOLERANCE = 1e-6
"""Rows whose ``|db[i]|`` is below this fraction of ``max |db|`` are skipped (ratio unstable)."""


@dataclass(frozen=True)
class RecoveredInputs:
    """Inputs of a fully connected layer recovered from its update.

    Attributes:
        vectors: ``[K, in_features]``, one candidate input per usable row.
        rows: ``[K]`` int64, the output row each candidate came from.
        bias_delta: ``[K]``, the bias update of those rows (its magnitude is a confidence).
    """

    vectors: torch.Tensor
    rows: torch.Tensor
    bias_delta: torch.Tensor


def recover_fc_inputs(
    weight_delta: torch.Tensor,
    bias_delta: torch.Tensor,
    *,
    relative_tolerance: float = DEFAULT_RELATIVE_TOLERANCE,
    absolute_tolerance: float = 0.0,
) -> RecoveredInputs:
    """Recover the layer inputs as ``dW[i] / db[i]`` for every row with a usable ``db[i]``.

    Args:
        weight_delta: ``[out, in]`` update (or gradient) of the weight.
        bias_delta: ``[out]`` update (or gradient) of the bias, same step as ``weight_delta``.
        relative_tolerance: skip rows with ``|db[i]| <= relative_tolerance * max |db|``.
        absolute_tolerance: also skip rows with ``|db[i]| <= absolute_tolerance``.

    Returns:
        The candidate inputs, ordered by decreasing ``|db[i]|``; empty if no row qualifies.

    Raises:
        ValueError: if the shapes do not describe one fully connected layer.
    """
    if weight_delta.dim() != 2 or bias_delta.shape != weight_delta.shape[:1]:
        raise ValueError(
            f"expected weight [out, in] and bias [out]; got {tuple(weight_delta.shape)} and "
            f"{tuple(bias_delta.shape)}"
        )
    if relative_tolerance < 0 or absolute_tolerance < 0:
        raise ValueError("tolerances must be >= 0")
    magnitude = bias_delta.abs()
    peak = float(magnitude.max()) if magnitude.numel() else 0.0
    threshold = max(relative_tolerance * peak, absolute_tolerance)
    usable = torch.nonzero(magnitude > threshold).flatten()
    usable = usable[torch.argsort(magnitude[usable], descending=True, stable=True)]
    vectors = weight_delta[usable] / bias_delta[usable].unsqueeze(1)
    return RecoveredInputs(vectors=vectors, rows=usable, bias_delta=bias_delta[usable])


def recover_fc_inputs_without_bias(weight_delta: torch.Tensor) -> RecoveredInputs:
    """Recover the inputs of a fully connected layer *without bias* (dlib's embedding layer).

    Without a bias row there is no ratio, but each row of one example's update is still
    ``g[i] x``: the input up to scale, and identification by cosine needs no scale. The
    sign is fixed by the input being non-negative (pooled ReLU features, as in every
    backbone here): a row whose entries sum below zero is negated. For a batch or a sum the
    rows are mixtures, as are the row ratios of a layer with bias; the span attack
    (:func:`span_membership`) does not depend on the bias at all.

    Returns:
        Every non-zero row, sign-fixed, ordered by decreasing norm; ``bias_delta`` holds the
        row norms (the confidence a bias update gives :func:`recover_fc_inputs`).

    Raises:
        ValueError: if ``weight_delta`` is not ``[out, in]``.
    """
    if weight_delta.dim() != 2:
        raise ValueError(f"expected weight [out, in]; got {tuple(weight_delta.shape)}")
    norms = weight_delta.norm(dim=1)
    peak = float(norms.max()) if norms.numel() else 0.0
    usable = torch.nonzero(norms > DEFAULT_RELATIVE_TOLERANCE * peak).flatten()
    usable = usable[torch.argsort(norms[usable], descending=True, stable=True)]
    rows = weight_delta[usable]
    sign = torch.where(rows.sum(dim=1, keepdim=True) < 0, -1.0, 1.0).to(rows.dtype)
    return RecoveredInputs(vectors=rows * sign, rows=usable, bias_delta=norms[usable])


@dataclass(frozen=True)
class Identification:
    """Cosine nearest-neighbour identification of query vectors against a gallery.

    Attributes:
        ranked: ``[Q, G']`` gallery identities ordered by decreasing best cosine per identity
            (``G'`` distinct identities).
        scores: ``[Q, G']`` the matching best cosines.
    """

    ranked: torch.Tensor
    scores: torch.Tensor

    @property
    def top1(self) -> torch.Tensor:
        """``[Q]`` the predicted identity of each query."""
        return self.ranked[:, 0]

    def accuracy(self, truth: torch.Tensor, k: int = 1) -> float:
        """Fraction of queries whose true identity is among the first ``k`` predictions."""
        if truth.shape != self.ranked.shape[:1]:
            raise ValueError(f"truth must be [{self.ranked.shape[0]}], got {tuple(truth.shape)}")
        if self.ranked.shape[0] == 0:
            return 0.0
        hits = (self.ranked[:, :k] == truth.unsqueeze(1)).any(dim=1)
        return float(hits.float().mean())


def identify(
    queries: torch.Tensor, gallery: torch.Tensor, gallery_labels: torch.Tensor
) -> Identification:
    """Rank gallery identities for each query by their best cosine similarity.

    The score of an identity is the maximum cosine between the query and any of its gallery
    vectors (nearest neighbour); identities are ranked by that score.

    Args:
        queries: ``[Q, D]`` vectors to identify (recovered inputs, head rows, embeddings).
        gallery: ``[G, D]`` reference vectors of known identities.
        gallery_labels: ``[G]`` int64 identity of each gallery vector.

    Returns:
        The ranking of the distinct gallery identities for every query.

    Raises:
        ValueError: on mismatched shapes or an empty gallery.
    """
    _check_gallery(queries, "queries [Q, D]", gallery, gallery_labels)
    cosine = F.normalize(queries.double(), dim=1) @ F.normalize(gallery.double(), dim=1).T
    return _rank_identities(cosine, gallery_labels)


def _check_gallery(
    vectors: torch.Tensor, what: str, gallery: torch.Tensor, gallery_labels: torch.Tensor
) -> None:
    if vectors.dim() != 2 or gallery.dim() != 2 or vectors.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"{what} and gallery [G, D] must share D; got {tuple(vectors.shape)} and "
            f"{tuple(gallery.shape)}"
        )
    if gallery_labels.shape != gallery.shape[:1] or gallery.shape[0] == 0:
        raise ValueError("gallery_labels must be [G] for a non-empty gallery")


def _rank_identities(scores: torch.Tensor, gallery_labels: torch.Tensor) -> Identification:
    """Per query row of ``scores`` ``[Q, G]``: identities by their best score, highest first."""
    identities, inverse = torch.unique(gallery_labels, return_inverse=True)
    best = torch.full((scores.shape[0], identities.numel()), -2.0, dtype=torch.float64)
    best = best.scatter_reduce(
        1, inverse.expand(scores.shape[0], -1), scores, reduce="amax", include_self=True
    )
    order = torch.argsort(best, dim=1, descending=True, stable=True)
    return Identification(ranked=identities[order], scores=best.gather(1, order))


def identify_head_templates(
    head_weight: torch.Tensor,
    class_identities: torch.Tensor,
    gallery: torch.Tensor,
    gallery_labels: torch.Tensor,
) -> tuple[Identification, float]:
    """Identify the rows of a shared head (identity templates) against a gallery.

    Args:
        head_weight: ``[C, D]`` class embeddings of the head.
        class_identities: ``[C]`` int64, the gallery identity each head row belongs to.
        gallery: ``[G, D]`` embeddings of the identities' images (same space as the head).
        gallery_labels: ``[G]`` int64.

    Returns:
        The identification of every row and its top-1 accuracy.
    """
    result = identify(head_weight, gallery, gallery_labels)
    return result, result.accuracy(class_identities)


def span_membership(
    weight_delta: torch.Tensor,
    gallery: torch.Tensor,
    gallery_labels: torch.Tensor,
    *,
    rank: int,
) -> Identification:
    """Rank gallery identities by how much of their vectors lies in the row space of ``dW``.

    Args:
        weight_delta: ``[out, in]`` update of a fully connected layer's weight, one client's or
            the sum of several (the server's view under secure aggregation).
        gallery: ``[G, in]`` vectors of known identities, in the layer's input space.
        gallery_labels: ``[G]`` int64 identity of each gallery vector.
        rank: how many singular directions span the inputs: the number of inputs that went
            into the update (the server knows its cohort's size, and without client-level DP
            each client's example count), capped at ``min(out, in)``.

    Returns:
        One query row: identities ordered by their best ``||V_r^T v|| / ||v||`` over their
        gallery vectors (1 for a vector inside the span, 0 for one orthogonal to it); pass it
        to :func:`participant_precision`.

    Raises:
        ValueError: on mismatched shapes, an empty gallery or ``rank < 1``.
    """
    _check_gallery(weight_delta, "weight [out, D]", gallery, gallery_labels)
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    _, _, vh = torch.linalg.svd(weight_delta.double(), full_matrices=False)
    basis = vh[: min(rank, vh.shape[0])]  # [r, D], orthonormal rows
    g = gallery.double()
    inside = (g @ basis.T).norm(dim=1) / g.norm(dim=1).clamp_min(torch.finfo(g.dtype).tiny)
    return _rank_identities(inside[None], gallery_labels)


def participant_precision(
    recovered: Identification, participants: torch.Tensor, *, claims: int | None = None
) -> float:
    """Fraction of the attacker's identity claims that name an actual participant.

    The attacker recovered candidate vectors from an (aggregated) update and claims the
    ``claims`` identities (default: as many as there are participants) whose best cosine
    over all candidates is highest. A random guess scores ``len(participants) / G`` with
    ``G`` the number of gallery identities.

    Args:
        recovered: identification of the recovered candidates.
        participants: int64 identities whose data entered the update.
        claims: how many identities the attacker names.

    Returns:
        ``|claimed & participants| / claims``; 0 when nothing was recovered.
    """
    count = int(participants.numel()) if claims is None else claims
    if recovered.ranked.shape[0] == 0 or count < 1:
        return 0.0
    ids = recovered.ranked.flatten()
    scores = recovered.scores.flatten()
    identities = torch.unique(ids)
    best = torch.full((int(identities.max()) + 1,), -3.0, dtype=torch.float64)
    best = best.scatter_reduce(0, ids, scores, reduce="amax")
    order = torch.argsort(best[identities], descending=True, stable=True)
    claimed = identities[order[:count]]
    hits = torch.isin(claimed, participants).sum()
    return float(hits) / count
