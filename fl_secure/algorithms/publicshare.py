"""FedFR-style data sharing: the public identities' *images* go to every client.

The baseline of the AdaFedFR paper's comparison (its Tables 1, 3 and section "Comparison with
FedFR"): Liu et al., "FedFR: Joint optimization federated framework for generic and
personalized face recognition" (AAAI 2022), "sends the global datasets ... and class
embeddings of shared identities to each client and subsequently jointly utilizes the global
and local data to train the local model", in every communication round. AdaFedFR replaces
the images by one representation per public identity (Eq. 4); this strategy is the other side
of that comparison, on the same public set (:func:`~fl_secure.algorithms.adafedfr.public_dataset`).

What is implemented here (named ``fedfr-public``, apart from Zhuang et al.'s FedFR,
:mod:`.fedfr`):

- Each round the server broadcasts the public images (8-bit pixels, as an image file would
  carry them) and their identity indices (:meth:`PublicDataShare.broadcaster`); the round's
  record counts their bytes.
- Each client's private head has a row per own identity and per public identity; local
  training is the margin-head loss on the union of its images and the public ones (the
  public identities act as extra negatives for its own). The backbone is averaged (FedPE's
  sharing); the public rows stay in the private head.

Simplifications, stated: no hard-negative sampling (Liu et al. subsample the public set to
cut computation; here every public image is used) and no decoupled feature customisation
module (their personalisation); the public class embeddings are not aggregated.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar, Self

import numpy as np
import torch

from fl_secure.algorithms.adafedfr import public_dataset
from fl_secure.algorithms.base import BROADCAST_PREFIX, Broadcaster, Exposure, Strategy
from fl_secure.config import AlgorithmConfig, Config
from fl_secure.data.types import FaceDataset
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.training import FaceModel, LocalData, train_local

#: Broadcast tensors: ``[N, 3, H, W]`` uint8 images and ``[N]`` int64 public identity indices.
IMAGES = f"{BROADCAST_PREFIX}public_images"
LABELS = f"{BROADCAST_PREFIX}public_labels"


def to_pixels(images: torch.Tensor) -> np.ndarray:
    """Images in [-1, 1] as 8-bit pixels (what a shared image file carries)."""
    return np.clip(np.rint((images.numpy() + 1.0) * 127.5), 0, 255).astype(np.uint8)


def from_pixels(pixels: np.ndarray) -> torch.Tensor:
    """8-bit pixels back to float images in [-1, 1]."""
    return torch.from_numpy(pixels.astype(np.float32) / 127.5 - 1.0)


class PublicDataShare(Strategy):
    """Backbone averaging; local training on own plus the broadcast public images."""

    name: ClassVar[str] = "fedfr-public"
    exposure: ClassVar[Exposure] = "private-embedding"
    shares_head: ClassVar[bool] = False

    def __init__(self, public_identities: int = 50) -> None:
        if public_identities < 1:
            raise ValueError(f"public_identities must be >= 1, got {public_identities}")
        self.public_identities = public_identities
        self.public: tuple[torch.Tensor, torch.Tensor] | None = None  # images, indices

    @classmethod
    def from_config(
        cls,
        params: AlgorithmConfig | None = None,
        *,
        head: str | None = None,
        scale: float | None = None,
    ) -> Self:
        """The run's number of public identities."""
        del head, scale
        return cls() if params is None else cls(params.public_identities)

    def describe(self) -> str:
        """One line for logs and reports."""
        return (
            f"FedFR-style data sharing ({self.public_identities} public identities' images "
            "sent to every client each round; Liu et al., AAAI 2022, the AdaFedFR paper's "
            "baseline), backbone averaged, private head over own and public identities"
        )

    def num_head_classes(self, num_train_identities: int, local_identities: np.ndarray) -> int:
        """A row per own identity, then one per public identity."""
        return len(local_identities) + self.public_identities

    def broadcaster(self, config: Config) -> Broadcaster:
        """Every round: the public images (8-bit) and their identity indices 0..G-1."""
        public = public_dataset(config)
        _, index = torch.unique(public.labels, sorted=True, return_inverse=True)
        tensors = OrderedDict(
            [(IMAGES, to_pixels(public.images)), (LABELS, index.numpy().astype(np.int64))]
        )

        def broadcast(params: Tensors, round_: int) -> Tensors:
            del params, round_
            return tensors

        return broadcast

    def take_broadcast(self, model: FaceModel, tensors: Tensors) -> None:
        """Check the public images (uint8 ``[N, 3, H, W]``) and indices (0..G-1), keep them."""
        if list(tensors) != [IMAGES, LABELS]:
            raise ValueError(f"expected the broadcasts {IMAGES!r}, {LABELS!r}: {sorted(tensors)}")
        images, labels = np.asarray(tensors[IMAGES]), np.asarray(tensors[LABELS])
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"public images: expected uint8 [N, 3, H, W], got {images.shape}")
        if labels.shape != (images.shape[0],) or labels.dtype != np.int64:
            raise ValueError(f"public labels: expected int64 [{images.shape[0]}]")
        if labels.size and not (0 <= labels.min() and labels.max() < self.public_identities):
            raise ValueError(f"public labels must lie in 0..{self.public_identities - 1}")
        self.public = (from_pixels(images), torch.from_numpy(labels.copy()))

    def local_train(
        self,
        model: FaceModel,
        data: LocalData,
        training: LocalTraining,
        *,
        generator: torch.Generator,
    ) -> dict[str, float]:
        """Margin-head training on own images (rows 0..L-1) and public ones (rows L..L+G-1)."""
        if self.public is None:
            raise ValueError("fedfr-public needs the server's public images; none arrived")
        images, labels = self.public
        own = int(data.train_targets.max()) + 1 if len(data.train) else 0
        rows = int(model.head.weight.shape[0])
        if own + self.public_identities != rows:
            raise ValueError(f"the head has {rows} rows, expected {own} own + public ones")
        union = FaceDataset(
            torch.cat([data.train.images, images]),
            torch.cat([data.train_targets, labels + own]),
            tuple(f"class-{i}" for i in range(rows)),
        )
        joint = LocalData(train=union, test=data.test, train_targets=union.labels, class_mask=None)
        return train_local(model, joint, training, generator=generator)
