"""The audit's target identities and the auditor's own images of them.

The targets are training identities of the clients other than the curious one
(:func:`audits.observations.choose_targets`). Their training images train the judge's
evaluator and their test images are the template gallery; the attacker never sees either.
Both are re-indexed so that target ``i`` carries label ``i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from audits.observations import RunContext
from fl_secure.data.types import FaceDataset


@dataclass(frozen=True)
class Targets:
    """The target identities and the auditor's images of them (never the attacker's)."""

    identities: list[int]
    private: FaceDataset  # the targets' training images, labels = target index 0..N-1
    gallery: FaceDataset  # the targets' test images (template gallery), labels = index


def _remap(data: FaceDataset, identities: list[int]) -> FaceDataset:
    index = {t: i for i, t in enumerate(identities)}
    keep = np.flatnonzero(np.isin(data.labels.numpy(), identities))
    part = data.subset(keep)
    labels = torch.tensor([index[int(v)] for v in part.labels], dtype=torch.int64)
    return FaceDataset(part.images, labels, tuple(str(t) for t in identities), source=part.source)


def target_data(run: RunContext, identities: list[int]) -> Targets:
    """The targets' training images (judge) and test images (gallery), labels re-indexed.

    Raises:
        ValueError: ``identities`` names an identity twice: its images would all carry the
            label of one of its indices, and the other would be a target without images.
    """
    repeated = sorted({t for t in identities if identities.count(t) > 1})
    if repeated:
        raise ValueError(
            f"target identities {repeated} are named more than once in {identities}: each "
            "target must be a distinct identity"
        )
    train = [c.train for c in run.plan.clients]
    test = [c.test for c in run.plan.clients]

    def union(parts: Sequence[FaceDataset]) -> FaceDataset:
        chosen = [_remap(p, identities) for p in parts]
        chosen = [c for c in chosen if len(c)]
        return FaceDataset(
            torch.cat([c.images for c in chosen]),
            torch.cat([c.labels for c in chosen]),
            tuple(str(t) for t in identities),
        )

    private = union(train)
    gallery_parts = [p for p in (_remap(t, identities) for t in test) if len(p)]
    gallery = union(test) if gallery_parts else private
    return Targets(identities=identities, private=private, gallery=gallery)
