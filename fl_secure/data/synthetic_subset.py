"""Any subset of a synthetic population, rendered without rendering the rest.

:func:`fl_secure.data.synthetic.generate_synthetic_faces` draws identity ``k``'s traits from
``(seed, k)`` and image ``j``'s nuisance and noise from ``(seed, k, j, domain)``, and renders
element-wise, so an image does not depend on which other images share its chunk. Image
``p`` of the population (identity-major: ``p = (k - first_identity) * images_per_identity +
j``) is therefore rendered here bit for bit as the whole generator renders it, with the same
label, attributes, identity names and source: a virtual client's share of 10,000 identities
costs its own images, not the population's.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from fl_secure.data import synthetic
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError, DataError

#: The attributes' dtypes, for an empty subset (as the whole set's subset gives them).
_EMPTY_ATTRIBUTES: dict[str, type] = {
    "glasses": bool, "hat": bool, "beard": bool, "male": bool, "bushy_eyebrows": bool,
    "hair_colour": np.int64, "age": np.int64, "smile": bool, "expression": np.int64,
    "domain": np.int64,
}  # fmt: skip


@lru_cache(maxsize=8)
def identity_names(first: int, count: int) -> tuple[str, ...]:
    """The generator's identity names (one shared tuple per population)."""
    return tuple(f"synthetic-{k:06d}" for k in range(first, first + count))


def population_size(cfg: synthetic.SyntheticFaceConfig) -> int:
    """Images in the whole population ``cfg`` describes."""
    return cfg.num_identities * cfg.images_per_identity


def population_labels(cfg: synthetic.SyntheticFaceConfig) -> np.ndarray:
    """Label of every image of the population, identity-major, without rendering any."""
    return np.repeat(np.arange(cfg.num_identities, dtype=np.int64), cfg.images_per_identity)


def render_synthetic_subset(
    cfg: synthetic.SyntheticFaceConfig, positions: np.ndarray, *, chunk: int = 256
) -> FaceDataset:
    """Images ``positions`` of ``cfg``'s population: ``generate_synthetic_faces(cfg)[positions]``.

    Args:
        cfg: the population.
        positions: indices into the identity-major image order, each in
            ``[0, num_identities * images_per_identity)``.
        chunk: images rendered per vectorised batch (memory only).

    Raises:
        DataError: a position outside the population.
    """
    if chunk < 1:
        raise ConfigError(f"chunk must be >= 1, got {chunk}")
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    total = population_size(cfg)
    if pos.size and (pos.min() < 0 or pos.max() >= total):
        raise DataError(f"image positions must be in [0, {total}), got {pos.min()}..{pos.max()}")
    per = cfg.images_per_identity
    labels = pos // per
    keys = [(cfg.first_identity + int(p) // per, int(p) % per) for p in pos]
    traits = {k: synthetic._identity_traits(cfg.seed, k) for k in {k for k, _ in keys}}
    per_image_traits = [traits[k] for k, _ in keys]
    per_image = [synthetic._image_params(cfg, k, j, traits[k]) for k, j in keys]
    shifted = int(cfg.domain == "shifted")
    n, size = len(keys), cfg.image_size
    out = np.empty((n, 3, size, size), dtype=np.float32)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        noise = np.stack([
            np.random.default_rng([cfg.seed, k, j, shifted, synthetic._NOISE_STREAM])
            .standard_normal((3, size, size), dtype=np.float32)
            for k, j in keys[start:stop]
        ])  # fmt: skip
        out[start:stop] = synthetic._render(
            synthetic._stack(per_image_traits[start:stop]),
            synthetic._stack(per_image[start:stop]),
            noise,
            size,
            bool(shifted),
        )
    attributes: dict[str, np.ndarray] = {
        key: np.zeros(0, dtype=dtype) for key, dtype in _EMPTY_ATTRIBUTES.items()
    }
    if n:
        attributes = synthetic.image_attributes(
            synthetic._stack(per_image_traits), synthetic._stack(per_image), shifted
        )
    return FaceDataset(
        images=torch.from_numpy(out * 2 - 1),
        labels=torch.from_numpy(labels),
        identity_names=identity_names(cfg.first_identity, cfg.num_identities),
        attributes=attributes,
        source=f"synthetic(seed={cfg.seed}, domain={cfg.domain or 'source'}, size={size})",
    )
