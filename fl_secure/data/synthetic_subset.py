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

import numpy as np

from fl_secure.data import synthetic
from fl_secure.data.types import FaceDataset


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

    The whole generator is this renderer over every position
    (:func:`fl_secure.data.synthetic.render_positions`).

    Raises:
        DataError: a position outside the population.
    """
    return synthetic.render_positions(cfg, positions, chunk=chunk)
