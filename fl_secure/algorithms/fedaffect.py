"""FedAffect: few-shot federated facial expression recognition, as a strategy.

Shome & Kar, "FedAffect: Few-shot federated learning for facial expression recognition"
(ICCV 2021 workshop slides, Algorithm 1). Each client holds a few expression-labelled images
and many unlabelled ones. Two networks are shared: the encoder / embedding network ``f``
(weights ``w_f``) and the relation module ``g`` (weights ``w_g``). Per round, each client

- runs ``LocalFewShot`` (Algorithm 1, lines 31-35) if it holds more labelled images than there
  are classes (line 5): N-way K-shot episodes sampled from its labelled images train ``f`` and
  ``g`` jointly with the relation network's MSE loss (Sung et al., "Learning to Compare:
  Relation Network for Few-Shot Learning", CVPR 2018, Eq. 2-3;
  :mod:`fl_secure.algorithms.fedaffect_relation`);
- runs ``LocalReprLearn`` (lines 17-30) if it has unlabelled images: SimCLR (Chen et al., "A
  Simple Framework for Contrastive Learning of Visual Representations", ICML 2020) on two
  augmented views per image with the NT-Xent loss (lines 26-27;
  :mod:`fl_secure.algorithms.fedaffect_simclr`);

and the server averages both networks weighted by the clients' data sizes (lines 13-14).
:mod:`fl_secure.algorithms.fedaffect_rounds` holds one client's round and that average as
in-process building blocks (used by ``benchmarks/fedaffect.py``), with the choices made where
the slides are silent or garbled.

:class:`FedAffect` runs the same client step
(:func:`~fl_secure.algorithms.fedaffect_rounds.client_round`) as a
:class:`~fl_secure.algorithms.base.Strategy`, over gRPC like every other algorithm
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
- Evaluation: expression accuracy of the relation scores
  (:func:`~fl_secure.algorithms.fedaffect_relation.expression_accuracy`) on the held-out
  identities, ``labels_per_class`` support images per expression, every other image a query
  (:func:`held_out_expression_split`).
- Example-level DP is refused (config check): NT-Xent couples the examples of a minibatch, so
  per-example clipping would not bound one image's influence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar, Self

import numpy as np
import torch
from torch import nn

from fl_secure.algorithms.base import Exposure, Strategy
from fl_secure.algorithms.fedaffect_relation import RelationModule, expression_accuracy
from fl_secure.algorithms.fedaffect_rounds import (
    ClientData,
    ClientState,
    FedAffectConfig,
    client_round,
)
from fl_secure.algorithms.fedaffect_simclr import projection_head
from fl_secure.config import AlgorithmConfig, ModelConfig, PrivacyUnit
from fl_secure.data.synthetic import EXPRESSIONS
from fl_secure.errors import DataError
from fl_secure.models.factory import get_backbone
from fl_secure.training import FaceModel, LocalData, set_tensors

if TYPE_CHECKING:
    from fl_secure.data.types import FaceDataset
    from fl_secure.messages import LocalTraining, Tensors

NUM_EXPRESSIONS = len(EXPRESSIONS)
HeldOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""Support images, support labels, query images, query labels."""


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
    transforms_images: ClassVar[bool] = True  # SimCLR views of the images (LocalReprLearn)
    refused_privacy_units: ClassVar[Mapping[PrivacyUnit, str]] = {
        "example": "NT-Xent couples the images of a minibatch, so DP-SGD's per-example "
        "clipping would not bound one image's influence; use privacy.unit = 'client' "
        "(DP-FedAvg) or 'none'",
        "identity": "NT-Xent couples the images of a minibatch across people, so per-identity "
        "clipping would not bound one person's influence; use privacy.unit = 'client' "
        "(DP-FedAvg) or 'none'",
    }

    def __init__(self, params: AlgorithmConfig | None = None) -> None:
        self.params = params or AlgorithmConfig(name="fedaffect")

    @classmethod
    def from_config(
        cls,
        params: AlgorithmConfig | None = None,
        *,
        head: str | None = None,
        scale: float | None = None,
    ) -> Self:
        """The run's labels, episode shape, NT-Xent temperature and module sizes."""
        del head, scale
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
