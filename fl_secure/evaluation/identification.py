"""Closed-set face identification: rank-1 accuracy of cosine nearest-neighbour search.

The rank-1 identification rate of the face-identification literature (e.g. the MegaFace and
IJB protocols; Deng et al., "ArcFace", CVPR 2019, section 4): each probe takes the identity
of its most similar gallery embedding. Pure numpy; the similarity matrix is computed in row
blocks so memory stays ``O(block * gallery)``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from fl_secure.evaluation.verification import FloatArray, normalise_rows

BLOCK_ROWS = 1024
"""Probe rows scored per block."""


def _nearest(
    probes: FloatArray, gallery: FloatArray, *, exclude_self: bool
) -> npt.NDArray[np.intp]:
    """Index of the most similar gallery row for each probe row (first one on ties).

    With ``exclude_self`` probes and gallery are the same set and row ``i`` never matches
    itself.
    """
    nearest = np.empty(probes.shape[0], dtype=np.intp)
    for start in range(0, probes.shape[0], BLOCK_ROWS):
        block = probes[start : start + BLOCK_ROWS] @ gallery.T
        if exclude_self:
            rows = np.arange(block.shape[0])
            block[rows, start + rows] = -np.inf
        nearest[start : start + block.shape[0]] = np.argmax(block, axis=1)
    return nearest


def _labelled(
    embeddings: npt.ArrayLike, labels: npt.ArrayLike, role: str
) -> tuple[FloatArray, npt.NDArray[np.generic]]:
    """Normalised embeddings and labels, checked to be ``[N, D]`` and ``[N]`` with ``N >= 1``."""
    unit = normalise_rows(embeddings)
    ids = np.asarray(labels)
    if ids.shape != unit.shape[:1] or unit.shape[0] == 0:
        raise ValueError(
            f"{role}: need [N, D] embeddings and [N] labels, N >= 1; got {unit.shape}, {ids.shape}"
        )
    return unit, ids


def rank1(
    gallery_emb: npt.ArrayLike,
    gallery_labels: npt.ArrayLike,
    probe_emb: npt.ArrayLike,
    probe_labels: npt.ArrayLike,
) -> float:
    """Fraction of probes whose cosine nearest gallery embedding has the probe's identity.

    Args:
        gallery_emb: ``[G, D]`` enrolled embeddings.
        gallery_labels: ``[G]`` their identities.
        probe_emb: ``[P, D]`` query embeddings.
        probe_labels: ``[P]`` their identities; each must occur in the gallery (closed set).

    Returns:
        The rank-1 identification rate in ``[0, 1]``.

    Raises:
        ValueError: if shapes disagree or a probe identity is absent from the gallery.
    """
    gallery, g_ids = _labelled(gallery_emb, gallery_labels, "gallery")
    probes, p_ids = _labelled(probe_emb, probe_labels, "probe")
    if probes.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"probe dimension {probes.shape[1]} != gallery dimension {gallery.shape[1]}"
        )
    absent = np.setdiff1d(p_ids, g_ids)
    if absent.size:
        raise ValueError(
            f"rank-1 is closed-set: probe identities {absent[:10].tolist()} are not in the gallery"
        )
    nearest = _nearest(probes, gallery, exclude_self=False)
    return float(np.mean(g_ids[nearest] == p_ids))


def rank1_leave_one_out(embeddings: npt.ArrayLike, labels: npt.ArrayLike) -> float:
    """Closed-set rank-1 within one set: each image is a probe against all the others.

    Only images whose identity has at least one other image are probes (a singleton cannot be
    identified), but every image stays in the gallery as a distractor.

    Args:
        embeddings: ``[N, D]`` embeddings.
        labels: ``[N]`` identities.

    Returns:
        The rank-1 identification rate over the eligible probes.

    Raises:
        ValueError: if shapes disagree or no identity has two images.
    """
    unit, ids = _labelled(embeddings, labels, "set")
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    eligible = counts[inverse] >= 2
    if not eligible.any():
        raise ValueError("rank1_leave_one_out needs an identity with at least two images")
    nearest = _nearest(unit, unit, exclude_self=True)
    return float(np.mean(ids[nearest][eligible] == ids[eligible]))
