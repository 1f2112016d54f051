"""FedFR: unsupervised federated face recognition across a source and a target domain.

FedFR paper (Zhuang, Gan, Wen, Zhang & Yi, "Towards Unsupervised Domain Adaptation for Deep
Face Recognition under Privacy Constraints via Federated Learning"), Algorithm 1:

1. *Pre-training* (lines 1-2): train ``f_s`` on the labelled source domain ``(X_S, Y_S)``.
2. *Pseudo labels* (lines 4-8): each target client extracts features of its unlabelled
   images with ``f_s`` and clusters them with C-FINCH (section 3.3, :mod:`.cfinch`); the
   clusters are its identities (:func:`pseudo_labels`, :func:`pseudo_labelled`).
3. *Domain-constrained FL* (lines 10-22): every round each client runs ``E`` local
   *iterations* (batches, ``train.local_steps``) from the global model; the source client
   minimises, instead of its loss ``F``,

       h(theta; theta_r) = F(theta) + lambda / 2 * ||theta - theta_r||^2            (Eq. 3)

   (the domain constraint loss, DCL), whose extra gradient is ``lambda (theta - theta_r)``;
   target clients keep their loss. Only the backbone is averaged (FedPav, section 3.4 "three
   enhancements" (2), the existing FedPE behaviour): each client's classifier has as many
   rows as its own (pseudo-)identities and stays on the client.

Choices made here, where the paper is silent or this framework differs:

- ``theta`` in Eq. 3 is the shared backbone's parameters: ``theta_r`` is the global model
  the client received, and the classifier has no global counterpart under FedPav.
- The DCL gradient is added by parameter hooks (:func:`domain_constraint`) around the usual
  margin-head training loop, so the source client trains with exactly the loop every other
  algorithm uses. A client applies DCL when its training set carries the ``domain``
  attribute (the synthetic generator's) and every image is from the source domain (0);
  a set without that attribute never gets DCL. DP-SGD runs (a ``train_fn``) replace the
  local objective and therefore drop DCL.
- Aggregation is this framework's example-weighted mean; Algorithm 1 line 21 averages the
  ``N`` clients uniformly, which weighs a large source domain less.
- Singletons of the clustering: the paper neither drops nor keeps them explicitly; they
  are kept by default (each becomes a one-image class), ``drop_singletons`` removes them.
- Where pseudo-labelling runs (Algorithm 1 lines 4-8): in the client, inside
  :meth:`FedFR.client_update`, the first time a *target* client (``domain`` attribute all 1)
  receives the global model: its backbone is ``f_s`` when the run starts from the
  source-pretrained weights (``model.pretrained``). The client's private head is then rebuilt
  with one row per cluster. Until then the target client's training targets are ``-1``
  (:meth:`FedFR.local_data`), so its true labels can never reach the loss; they stay in the
  trainer's data for local *evaluation* only. A restarted target client clusters again with
  the model it then receives (its saved head no longer fits and is ignored).
- The threshold ``d`` is a cosine distance ``1 - cos`` (:mod:`.cfinch`); the default 0.405 is
  the paper's FedFR-L ``d = 0.9`` read as a Euclidean distance of unit vectors
  (``d^2 / 2``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import ClassVar, Self

import numpy as np
import torch
from torch import nn

from fl_secure.algorithms.base import ClientUpdate, Exposure, Strategy
from fl_secure.algorithms.cfinch import Metric, c_finch, canonical
from fl_secure.config import AlgorithmConfig, PrivacyUnit
from fl_secure.data.types import FaceDataset
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.models.heads import ClassHead, MarginHead, SoftmaxHead
from fl_secure.training import FaceModel, LocalData, embed, set_tensors, train_local

#: The paper's FedFR-L ``d = 0.9`` (Euclidean, unit features) as a cosine distance.
DEFAULT_THRESHOLD = 0.9**2 / 2


def domain_constraint_loss(
    params: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], lam: float
) -> torch.Tensor:
    """Eq. 3's DCL term ``lambda / 2 * sum ||theta - theta_r||^2`` (``reference`` = theta_r)."""
    if len(params) != len(reference):
        raise ValueError(f"{len(params)} parameters for {len(reference)} reference tensors")
    terms = [((p - r.detach()) ** 2).sum() for p, r in zip(params, reference, strict=True)]
    if not terms:
        return torch.zeros(())
    return 0.5 * lam * torch.stack(terms).sum()


@contextmanager
def domain_constraint(params: Sequence[nn.Parameter], lam: float) -> Iterator[list[torch.Tensor]]:
    """Within the block, every backward pass adds ``lam (theta - theta_r)`` to the gradient.

    ``theta_r`` is the parameters' value on entry (the received global model), yielded as a
    list of copies; the added term is the gradient of :func:`domain_constraint_loss`, Eq. 3.
    A parameter the loss does not reach gets no gradient at all (hooks fire on use).
    """
    reference = [p.detach().clone() for p in params]
    handles = []
    for p, r in zip(params, reference, strict=True):

        def pull(grad: torch.Tensor, p: nn.Parameter = p, r: torch.Tensor = r) -> torch.Tensor:
            return grad + lam * (p.detach() - r)

        handles.append(p.register_hook(pull))  # type: ignore[no-untyped-call]
    try:
        yield reference
    finally:
        for handle in handles:
            handle.remove()


def is_source_domain(dataset: FaceDataset) -> bool:
    """True when the set has a ``domain`` attribute and every image is from domain 0."""
    domain = dataset.attributes.get("domain")
    return domain is not None and len(domain) > 0 and not np.asarray(domain).any()


def is_target_domain(dataset: FaceDataset) -> bool:
    """True when the set has a ``domain`` attribute and every image is from a shifted domain."""
    domain = dataset.attributes.get("domain")
    return domain is not None and len(domain) > 0 and bool(np.asarray(domain).all())


def resized_head(head: ClassHead, num_classes: int, seed: int) -> ClassHead:
    """A fresh head of the same kind (and margin) with ``num_classes`` rows, seeded init."""
    embedding_size = int(head.weight.shape[1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(head, MarginHead):
            return MarginHead(num_classes, embedding_size, head.margin)
        if isinstance(head, SoftmaxHead):
            return SoftmaxHead(num_classes, embedding_size)
    raise TypeError(f"cannot resize a {type(head).__name__}")


def without_singletons(labels: np.ndarray) -> np.ndarray:
    """``-1`` for the members of one-sample clusters; the rest relabelled ``0, 1, ...``."""
    labels = np.asarray(labels)
    counts = np.unique(labels, return_inverse=True, return_counts=True)
    keep = counts[2][counts[1].reshape(-1)] > 1
    result = np.full(len(labels), -1, dtype=np.int64)
    if keep.any():
        result[keep] = canonical(labels[keep])
    return result


def pseudo_labels(
    backbone: nn.Module,
    images: torch.Tensor,
    threshold: float,
    *,
    metric: Metric = "cosine",
    recursive: bool = True,
    drop_singletons: bool = False,
) -> np.ndarray:
    """Algorithm 1 lines 6-7: C-FINCH clusters of the backbone's L2-normalised features.

    Returns one label per image (``-1`` for dropped singletons when ``drop_singletons``).
    """
    labels = c_finch(embed(backbone, images), threshold, metric=metric, recursive=recursive)
    return without_singletons(labels) if drop_singletons else labels


def pseudo_labelled(dataset: FaceDataset, labels: np.ndarray) -> FaceDataset:
    """``dataset`` with its identities replaced by ``labels``; images labelled ``-1`` dropped.

    The true labels do not survive: identities are named ``pseudo-000000``, ... .
    """
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (len(dataset),):
        raise ValueError(f"{len(labels)} pseudo labels for {len(dataset)} images")
    kept = np.flatnonzero(labels >= 0)
    new = canonical(labels[kept]) if kept.size else labels[kept]
    subset = dataset.subset(kept)
    return FaceDataset(
        images=subset.images,
        labels=torch.from_numpy(new.astype(np.int64)),
        identity_names=tuple(f"pseudo-{i:06d}" for i in range(int(new.max(initial=-1)) + 1)),
        attributes=subset.attributes,
        source=f"{dataset.source} pseudo-labelled",
    )


class FedFR(Strategy):
    """FedFR Algorithm 1 as a strategy: FedPav, DCL (Eq. 3), C-FINCH pseudo labels.

    Only the backbone is shared (FedPav); every head is private. The source client (every
    image of ``domain`` 0) adds DCL with ``dcl_lambda`` (Eq. 3; line 16). A target client
    (every image of ``domain`` 1) has no training targets until its first round. Then it
    clusters the features of the received model with C-FINCH at ``cfinch_threshold`` (lines
    4-8) and trains a head of one row per cluster (line 17). A client without the attribute
    (identity folders) trains on its labels like FedPE. The defaults are the paper's FedFR-L
    values: ``lambda = 0.01`` and ``d = 0.9`` (Euclidean, as a cosine distance).
    """

    name: ClassVar[str] = "fedfr"
    exposure: ClassVar[Exposure] = "private-embedding"
    shares_head: ClassVar[bool] = False
    unsimulated_sampling: ClassVar[str] = (
        "its target clients keep the pseudo labels of the first model they receive, client "
        "state the engine does not carry between the rounds a client is drawn into"
    )
    refused_privacy_units: ClassVar[Mapping[PrivacyUnit, str]] = {
        "example": "a target client's pseudo labels come from clustering all its images "
        "(C-FINCH), so one image can change the labels of others and DP-SGD's per-example "
        "guarantee does not cover it; use privacy.unit = 'client' (DP-FedAvg) or 'none'",
        "identity": "a target client's pseudo labels come from clustering all its images "
        "(C-FINCH), so one person's images can change the labels of others and the "
        "identity-level guarantee does not cover it (nor are the pseudo labels identities); "
        "use privacy.unit = 'client' (DP-FedAvg) or 'none'",
    }

    def __init__(
        self,
        dcl_lambda: float = 0.01,
        cfinch_threshold: float = DEFAULT_THRESHOLD,
        *,
        drop_singletons: bool = False,
    ) -> None:
        if not (dcl_lambda >= 0 and math.isfinite(dcl_lambda)):
            raise ValueError(f"dcl_lambda must be a finite number >= 0, got {dcl_lambda}")
        if not cfinch_threshold > 0:
            raise ValueError(f"cfinch_threshold must be > 0, got {cfinch_threshold}")
        self.dcl_lambda = dcl_lambda
        self.cfinch_threshold = cfinch_threshold
        self.drop_singletons = drop_singletons
        #: A target client's pseudo-labelled data, made on the first model it receives.
        self.pseudo: LocalData | None = None

    @classmethod
    def from_config(
        cls,
        params: AlgorithmConfig | None = None,
        *,
        head: str | None = None,
        scale: float | None = None,
    ) -> Self:
        """The run's DCL lambda (Eq. 3) and C-FINCH threshold."""
        del head, scale
        return cls() if params is None else cls(params.dcl_lambda, params.cfinch_threshold)

    def describe(self) -> str:
        """One line for logs and reports."""
        return (
            f"FedFR (FedPav backbone-only averaging, DCL lambda {self.dcl_lambda:g} on the "
            f"source client, C-FINCH d={self.cfinch_threshold:g} pseudo labels on target "
            "clients), private class embeddings"
        )

    def local_data(
        self, train: FaceDataset, test: FaceDataset, train_identities: np.ndarray
    ) -> LocalData:
        """Private-head label space; a target client's targets are ``-1`` (unlabelled).

        Its pseudo labels replace them in :meth:`client_update` (Algorithm 1 lines 4-8).
        """
        if not is_target_domain(train):
            return super().local_data(train, test, train_identities)
        unlabelled = torch.full((len(train),), -1, dtype=torch.int64)
        return LocalData(train=train, test=test, train_targets=unlabelled, class_mask=None)

    def pseudo_label(self, model: FaceModel, data: LocalData, seed: int) -> LocalData:
        """Algorithm 1 lines 6-7 on the received backbone; rebuild the head for the clusters."""
        labels = pseudo_labels(
            model.backbone,
            data.train.images,
            self.cfinch_threshold,
            drop_singletons=self.drop_singletons,
        )
        train = pseudo_labelled(data.train, labels)
        if len(train) == 0:
            raise ValueError("C-FINCH left no pseudo-labelled image (all singletons dropped)")
        model.head = resized_head(model.head, train.num_identities, seed)
        return LocalData(
            train=train, test=data.test, train_targets=train.labels.clone(), class_mask=None
        )

    def training_data(self, data: LocalData) -> LocalData:
        """A target client's pseudo-labelled images once it has made them (else ``data``)."""
        if is_target_domain(data.train) and self.pseudo is not None:
            return self.pseudo
        return data

    def client_update(
        self,
        model: FaceModel,
        data: LocalData,
        training: LocalTraining,
        shared: Tensors,
        *,
        generator: torch.Generator,
        train_fn: Callable[[FaceModel, LocalData, LocalTraining], dict[str, float]] | None = None,
    ) -> ClientUpdate:
        """Target clients pseudo-label on their first received model, then train on that."""
        if is_target_domain(data.train):
            if self.pseudo is None:
                set_tensors(model, shared)
                self.pseudo = self.pseudo_label(model, data, generator.initial_seed())
            data = self.pseudo
        result = super().client_update(
            model, data, training, shared, generator=generator, train_fn=train_fn
        )
        if self.pseudo is not None and data is self.pseudo:
            result.metrics["pseudo_identities"] = float(self.pseudo.train.num_identities)
        return result

    def local_train(
        self,
        model: FaceModel,
        data: LocalData,
        training: LocalTraining,
        *,
        generator: torch.Generator,
    ) -> dict[str, float]:
        """Margin-head training; the source client adds DCL (Eq. 3) on the backbone."""
        if self.dcl_lambda == 0 or not is_source_domain(data.train):
            return train_local(model, data, training, generator=generator)
        params = [p for p in model.backbone.parameters() if p.requires_grad]
        with domain_constraint(params, self.dcl_lambda) as reference:
            metrics = train_local(model, data, training, generator=generator)
        with torch.no_grad():
            metrics["dcl"] = float(domain_constraint_loss(params, reference, self.dcl_lambda))
        return metrics
