"""In-memory face data set shared by every loader, partitioner and trainer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fl_secure.errors import DataError


@dataclass(frozen=True)
class FaceDataset:
    """Face images with identity labels.

    Attributes:
        images: float32 tensor ``[N, 3, H, W]`` normalised to ``[-1, 1]``.
        labels: int64 tensor ``[N]``, identity index into ``identity_names``.
        identity_names: one name per identity (folder name, or ``synthetic-000123``).
        attributes: optional per-image attributes, each an array of length ``N``
            (bool or int), e.g. ``glasses``, ``hat``, ``expression``, ``domain``.
        source: short description of where the data came from (for manifests).
    """

    images: torch.Tensor
    labels: torch.Tensor
    identity_names: tuple[str, ...]
    attributes: dict[str, np.ndarray] = field(default_factory=dict)
    source: str = ""
    #: ``images`` holds a frozen trunk's ``[N, D]`` features, computed once at a site
    #: (``train.trainable``; :func:`fl_secure.training.with_trunk_features`), not pixels.
    trunk_features: bool = False

    def __post_init__(self) -> None:
        """Check shapes and dtypes so that a malformed set fails where it is built."""
        if self.trunk_features:
            if self.images.dim() not in (2, 4):
                raise DataError(
                    f"trunk features must be [N, D] or [N, C, h, w], got {tuple(self.images.shape)}"
                )
        elif self.images.dim() != 4 or self.images.shape[1] != 3:
            raise DataError(f"images must be [N, 3, H, W], got {tuple(self.images.shape)}")
        if self.images.dtype != torch.float32:
            raise DataError(f"images must be float32, got {self.images.dtype}")
        if self.labels.shape != (self.images.shape[0],) or self.labels.dtype != torch.int64:
            raise DataError("labels must be int64 [N] matching the images")
        for key, value in self.attributes.items():
            if len(value) != len(self):
                raise DataError(f"attribute {key!r} has {len(value)} values for {len(self)} images")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def num_identities(self) -> int:
        """Number of identity names (labels index into them)."""
        return len(self.identity_names)

    @property
    def image_size(self) -> int:
        """Side length of the square images."""
        return int(self.images.shape[-1])

    def subset(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> FaceDataset:
        """Return the images at ``indices`` (labels keep their global meaning)."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        np_idx = idx.numpy()
        return FaceDataset(
            images=self.images[idx],
            labels=self.labels[idx],
            identity_names=self.identity_names,
            attributes={k: v[np_idx] for k, v in self.attributes.items()},
            source=self.source,
            trunk_features=self.trunk_features,
        )

    def identities(self) -> np.ndarray:
        """Sorted unique identity labels present in this set."""
        return np.unique(self.labels.numpy())
