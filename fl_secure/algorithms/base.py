"""Strategy interface: a client step and a server step, one algorithm per file.

A template method (:meth:`Strategy.client_update`) loads the shared parameters, runs the
algorithm's local objective (:meth:`Strategy.local_train`) and returns the update of the
shared parameters only; :meth:`Strategy.server_update` turns the cohort's mean update into
the next global parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, Self

import numpy as np
import torch
from torch import nn

from fl_secure.config import AlgorithmConfig, Config, PrivacyUnit
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.models.trainable import is_partly_frozen, trained_state_names
from fl_secure.training import (
    FaceModel,
    LocalData,
    evaluate_local,
    get_tensors,
    set_tensors,
    train_local,
)

#: What the design shares, for audits and reports (ARCHITECTURE: "Designs differ in what is
#: shared").
Exposure = Literal["global-head", "server-sees-heads", "private-embedding"]

#: Name prefix of the tensors a server sends with a round's parameters beyond the model
#: (AdaFedFR's public representations R): downlink only, never aggregated or uploaded.
BROADCAST_PREFIX = "broadcast."

#: A server's per-round broadcast: (global parameters, round) -> ``broadcast.*`` tensors.
Broadcaster = Callable[[Tensors, int], Tensors]


@dataclass(frozen=True)
class ClientUpdate:
    """What a client sends back: the shared parameters' update and its metrics."""

    update: Tensors
    num_examples: int
    metrics: dict[str, float]


class Strategy(ABC):
    """A federated face-recognition algorithm."""

    name: ClassVar[str]
    exposure: ClassVar[Exposure]
    shares_head: ClassVar[bool]
    #: The local loss is a softmax over the client's own identities only (a private head, or a
    #: shared one with absent classes masked): with one identity per client
    #: (``partition.kind = "person"``) it is 0 for every input, so nothing trains; refused.
    local_softmax_only: ClassVar[bool] = False
    #: ``server-sees-heads`` designs (FedGC): the client's private head travels to the server
    #: with its update (as ``head.*`` values) and back to the client alone.
    uploads_head: ClassVar[bool] = False
    #: The model learns facial expressions, not identities (FedAffect): the server and
    #: ``fl-secure eval`` score expression accuracy instead of face verification, and the
    #: in-process simulation, which scores verification, does not run the design.
    evaluates_expressions: ClassVar[bool] = False
    #: Local training transforms the images themselves (FedAffect's augmented views), so a
    #: site cannot replace them by a frozen trunk's cached features (``train.trainable``).
    transforms_images: ClassVar[bool] = False
    #: Whether the design implements ``algorithm.embedding_reg`` (HF-MAML Eq. 4).
    uses_embedding_reg: ClassVar[bool] = False
    #: Why the design cannot run under secure aggregation, if it cannot ("" if it can).
    refuses_secure_aggregation: ClassVar[str] = ""
    #: Privacy units the design cannot run under: why, and what to use instead.
    refused_privacy_units: ClassVar[Mapping[PrivacyUnit, str]] = {}
    #: Client state, beyond its private layers, that a virtual client rebuilt for each round
    #: it is drawn into would lose: why sampled cohorts are not simulated ("" if they are).
    unsimulated_sampling: ClassVar[str] = ""

    @classmethod
    def from_config(
        cls,
        params: AlgorithmConfig | None = None,
        *,
        head: str | None = None,
        scale: float | None = None,
    ) -> Self:
        """An instance with the run's ``[algorithm]`` settings (the defaults without them).

        ``head`` and ``scale``: the run's ``model.head`` and ``model.scale``, for designs whose
        server step depends on them (FedGC).
        """
        del params, head, scale
        return cls()

    @classmethod
    def check_config(cls, config: Config) -> None:
        """Refuse a run config that this design would not run as it reads.

        :mod:`fl_secure.config` sits below the algorithms and cannot ask them: the entry points
        call this through :func:`fl_secure.algorithms.registry.check_config`.

        Raises:
            ConfigError: a setting the design would ignore, or one it cannot run under (the
                message names the key, why, and what to use instead).
        """
        reg_scale = config.algorithm.reg_scale
        if reg_scale > 0 and not cls.uses_reg_scale(config.model.head):
            raise ConfigError(
                f"algorithm.reg_scale = {reg_scale:g} (the logit scale of FedGC's softmax "
                f"regularizer on a margin head's unit rows) would be ignored by {cls.name} "
                f"with model.head = {config.model.head!r}; it applies to fedgc with a cosface "
                "or arcface head"
            )
        embedding_reg = config.algorithm.embedding_reg
        if embedding_reg > 0 and not cls.uses_embedding_reg:
            raise ConfigError(
                f"algorithm.embedding_reg = {embedding_reg:g} (HF-MAML Eq. 4) is implemented "
                f"by hfmaml and hfmaml-global only; {cls.name} would ignore it"
            )
        scheme = config.secure_aggregation.scheme
        if cls.refuses_secure_aggregation and config.secure_aggregation.enabled:
            raise ConfigError(
                f"algorithm.name = {cls.name!r} cannot run with secure_aggregation.scheme = "
                f"{scheme!r}: {cls.refuses_secure_aggregation}"
            )
        if cls.local_softmax_only and config.partition.kind == "person":
            raise ConfigError(
                f"algorithm.name = {cls.name!r} cannot train with partition.kind = 'person': "
                "its local loss is a softmax over the client's own identities, which with one "
                "identity per client is 0 for every image (no gradient); use 'adafedfr' "
                "(public identities as negatives; benchmarks/person_dp_engine.py)"
            )
        unit = config.privacy.unit
        if unit in cls.refused_privacy_units:
            raise ConfigError(
                f"algorithm.name = {cls.name!r} cannot run with privacy.unit = {unit!r}: "
                f"{cls.refused_privacy_units[unit]}"
            )

    @classmethod
    def uses_reg_scale(cls, head: str) -> bool:
        """Whether ``algorithm.reg_scale`` applies to this design with ``head`` (FedGC's)."""
        del head
        return False

    def shared_names(self, model: FaceModel) -> list[str]:
        """Names of the tensors the server aggregates (state-dict keys, in order).

        Floating-point tensors only: BatchNorm's ``num_batches_tracked`` counters stay on the
        client. Averaging a step count means nothing; under client-level DP it entered the
        update's norm (shrinking the weights' share of the clip) and its noise was truncated
        to an integer, not the Gaussian the accountant models; CKKS cannot encrypt it.

        With ``train.trainable`` other than ``all``, the backbone's frozen parameters and
        buffers are not shared either: every party holds them from the same pretrained file.
        """
        names = [
            f"backbone.{k}" for k, v in model.backbone.state_dict().items() if v.is_floating_point()
        ]
        if is_partly_frozen(model.backbone):  # train.trainable: only what trains is shared
            trains = {f"backbone.{k}" for k in trained_state_names(model.backbone)}
            names = [n for n in names if n in trains]
        if self.shares_head:
            names += [
                f"head.{k}" for k, v in model.head.state_dict().items() if v.is_floating_point()
            ]
        return names

    def head_names(self, model: FaceModel) -> list[str]:
        """Names of the private head tensors a ``server-sees-heads`` client uploads."""
        return [f"head.{k}" for k in model.head.state_dict()] if self.uploads_head else []

    def num_head_classes(self, num_train_identities: int, local_identities: np.ndarray) -> int:
        """Rows of the client's head: global identities if shared, else its own ones."""
        return num_train_identities if self.shares_head else len(local_identities)

    def local_data(
        self, train: FaceDataset, test: FaceDataset, train_identities: np.ndarray
    ) -> LocalData:
        """Remap a client's labels to head classes (global index, or local index if private).

        Args:
            train: the client's training images (labels = global identity ids).
            test: the client's test images of the same identities.
            train_identities: sorted identity ids of the whole federation's training set.
        """
        own = np.unique(train.labels.numpy())
        space = train_identities if self.shares_head else own
        missing = np.setdiff1d(own, space)
        if missing.size:
            raise ValueError(f"identities {missing[:5].tolist()} are not in the label space")
        targets = torch.from_numpy(np.searchsorted(space, train.labels.numpy()).astype(np.int64))
        mask: torch.Tensor | None = None
        if self.shares_head:  # HF-MAML III-A: absent classes get logit -inf
            mask = torch.zeros(len(space), dtype=torch.bool)
            mask[torch.from_numpy(np.searchsorted(space, own).astype(np.int64))] = True
        return LocalData(train=train, test=test, train_targets=targets, class_mask=mask)

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
        """Load ``shared``, train locally, return the update of the shared parameters.

        ``train_fn`` replaces the algorithm's local objective (DP-SGD in example-level runs).
        """
        set_tensors(model, shared)
        if train_fn is not None:
            metrics = train_fn(model, data, training)
        else:
            metrics = self.local_train(model, data, training, generator=generator)
        trained = get_tensors(model, shared.keys())
        update = OrderedDict((k, (trained[k] - shared[k]).astype(shared[k].dtype)) for k in shared)
        return ClientUpdate(update=update, num_examples=len(data.train), metrics=metrics)

    def local_train(
        self,
        model: FaceModel,
        data: LocalData,
        training: LocalTraining,
        *,
        generator: torch.Generator,
    ) -> dict[str, float]:
        """The algorithm's local objective; default: margin-head cross-entropy."""
        return train_local(model, data, training, generator=generator)

    def server_update(self, params: Tensors, mean_update: Tensors, round_: int) -> Tensors:
        """Next global parameters: FedAvg's ``w + mean(delta)`` (server learning rate 1)."""
        del round_
        return OrderedDict(
            (k, (params[k] + mean_update[k]).astype(params[k].dtype)) for k in params
        )

    def broadcaster(self, config: Config) -> Broadcaster | None:
        """The server's per-round broadcast to every client of the cohort, if the design has one.

        Called once per run on the server; the returned callable gets the round's global
        parameters before the round and returns ``broadcast.*`` tensors, which travel with
        the parameters (the coordinator's and the simulation's download) and reach
        :meth:`take_broadcast` on each client.
        """
        del config
        return None

    def training_data(self, data: LocalData) -> LocalData:
        """The labelled data a client's local training uses: ``data`` by default.

        Fine-tuning after training (:func:`fl_secure.app.tuning.evaluate_after_training`) tunes
        on it. FedFR's target clients return their pseudo-labelled images: their own targets
        are ``-1`` (unlabelled) and their head has one row per cluster.
        """
        return data

    def personalized(self, model: FaceModel) -> nn.Module:
        """The embedding network a client evaluates on its own test images.

        The shared backbone by default; designs with a private personalisation (AdaFedFR's
        local adapter) return the backbone followed by it.
        """
        return model.backbone

    def evaluate_client(self, model: FaceModel, data: LocalData) -> dict[str, float]:
        """A client's scores of the received model on its own test images.

        Face verification and rank-1 (:func:`~fl_secure.training.evaluate_local`) of the
        :meth:`personalized` network by default.
        """
        return evaluate_local(self.personalized(model), data)

    def private_state(self, model: FaceModel) -> dict[str, torch.Tensor]:
        """Client-side tensors the design keeps beside ``model`` (none by default).

        They never leave the client; :class:`client.trainer.LocalTrainer` saves copies of them
        with the model's private parameters so that a restarted client continues with them
        (:meth:`restore_private_state`). AdaFedFR returns its adapter and ``phi``.
        """
        del model
        return {}

    def restore_private_state(self, model: FaceModel, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take back what :meth:`private_state` returned, for ``model`` (a restarted client).

        Raises:
            ValueError: naming the problem if ``tensors`` do not fit this design and model.
        """
        del model
        if tensors:
            raise ValueError(f"{self.name} keeps no client state, got {sorted(tensors)}")

    def take_broadcast(self, model: FaceModel, tensors: Tensors) -> None:
        """A client receives the round's ``broadcast.*`` tensors; validate, then keep them.

        Raises:
            ValueError: naming the problem (this design expects no broadcast by default).
        """
        del model
        if tensors:
            raise ValueError(f"{self.name} expects no broadcast tensors, got {sorted(tensors)}")

    def server_heads(
        self, heads: Mapping[str, Tensors], *, learning_rate: float, round_: int
    ) -> dict[str, Tensors]:
        """Server step on the cohort's uploaded heads (client id -> ``head.*`` values).

        Only called when :attr:`uploads_head`; each returned head goes back to its owner only.
        """
        del learning_rate, round_
        return dict(heads)

    @abstractmethod
    def describe(self) -> str:
        """One line naming the paper and what is shared."""
