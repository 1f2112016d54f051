"""Face verification metrics: ROC, TAR@FAR, AUC, EER, best and 10-fold accuracy.

Pure numpy, separate from training, as in insightface's ``eval/verification.py``. A pair is
*accepted* when its score (cosine similarity) is ``>= threshold``; genuine pairs (same
identity) accepted are true accepts (TAR = TPR), impostor pairs accepted are false accepts
(FAR = FPR). The 10-fold protocol is the "unrestricted" LFW protocol of Huang et al.,
"Labeled Faces in the Wild" (2007); TAR@FAR is the verification figure reported by HF-MAML
(Gansekoele et al., section IV-C) and AdaFedFR.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

VERIFICATION_FARS: Final[dict[str, float]] = {"1e-1": 1e-1, "1e-2": 1e-2, "1e-3": 1e-3}
"""False-accept rates reported by :func:`verification_metrics` as ``tar_at_far_<name>``."""


def _pairs(scores: npt.ArrayLike, same: npt.ArrayLike) -> tuple[FloatArray, BoolArray]:
    """Validate and convert to a finite float64 score vector and a bool genuine vector."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(same)
    if s.ndim != 1 or y.shape != s.shape:
        raise ValueError(f"scores and same must be 1-D of equal length; got {s.shape}, {y.shape}")
    if s.size == 0:
        raise ValueError("need at least one pair")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    if y.dtype != np.bool_:
        if not np.all((y == 0) | (y == 1)):
            raise ValueError("same must be bool or 0/1")
        y = y.astype(np.bool_)
    return s, y


def _counts(s: FloatArray, y: BoolArray) -> tuple[FloatArray, FloatArray, FloatArray]:
    """False and true accepts at every distinct threshold, highest threshold (+inf) first."""
    order = np.argsort(-s)  # order within ties is irrelevant: only group ends are read
    s, y = s[order], y[order]
    last = np.r_[np.flatnonzero(np.diff(s)), s.size - 1]  # last index of each tie group
    tps = np.cumsum(y, dtype=np.float64)[last]
    fps = last + 1.0 - tps
    return np.r_[0.0, fps], np.r_[0.0, tps], np.r_[np.inf, s[last]]


def roc(scores: npt.ArrayLike, same: npt.ArrayLike) -> tuple[FloatArray, FloatArray, FloatArray]:
    """ROC curve with one point per distinct score.

    Equals ``sklearn.metrics.roc_curve(same, scores, drop_intermediate=False)``.

    Args:
        scores: ``[P]`` similarity of each pair (higher = more alike).
        same: ``[P]`` True (or 1) for genuine pairs.

    Returns:
        ``(fpr, tpr, thresholds)``: ``thresholds`` decrease from ``+inf`` (nothing accepted)
        to the lowest score (everything accepted); point ``i`` accepts ``scores >=
        thresholds[i]``.

    Raises:
        ValueError: if the inputs are malformed or lack genuine or impostor pairs.
    """
    fps, tps, thresholds = _counts(*_pairs(scores, same))
    fpr, tpr = _rates(fps, tps)
    return fpr, tpr, thresholds


def _rates(fps: FloatArray, tps: FloatArray) -> tuple[FloatArray, FloatArray]:
    """FPR and TPR from cumulative counts; both pair kinds must occur."""
    if fps[-1] == 0 or tps[-1] == 0:
        raise ValueError("ROC needs both genuine and impostor pairs")
    return fps / fps[-1], tps / tps[-1]


def _tar_from_roc(fpr: FloatArray, tpr: FloatArray, far: float) -> float:
    """TPR of the last ROC point whose FPR does not exceed ``far``."""
    if not 0.0 < far <= 1.0:
        raise ValueError(f"far must be in (0, 1], got {far}")
    return float(tpr[np.searchsorted(fpr, far, side="right") - 1])


def tar_at_far(scores: npt.ArrayLike, same: npt.ArrayLike, far: float) -> float:
    """True-accept rate at a false-accept rate of at most ``far``, without interpolation.

    Convention: over the thresholds ``t`` in ``{+inf} U scores`` (accept ``score >= t``),
    return ``max TAR(t)`` subject to ``FAR(t) <= far``. That is the lowest threshold whose
    FAR stays within ``far``; tied scores are accepted or rejected together, so the achieved
    FAR can be below ``far`` (e.g. 0 when ``far < 1 / num_impostor``: TAR then counts only
    genuine pairs scoring above every impostor). Unlike the nearest-FAR rule of some
    benchmarks, this never reports a point with FAR above ``far``.

    Args:
        scores: ``[P]`` pair similarities.
        same: ``[P]`` True for genuine pairs.
        far: the false-accept budget, in ``(0, 1]``.

    Returns:
        The TAR, in ``[0, 1]``.
    """
    fpr, tpr, _ = roc(scores, same)
    return _tar_from_roc(fpr, tpr, far)


def _auc(fpr: FloatArray, tpr: FloatArray) -> float:
    return float(np.trapezoid(tpr, fpr))


def roc_auc(scores: npt.ArrayLike, same: npt.ArrayLike) -> float:
    """Area under the ROC curve (ties count one half, as in ``sklearn.metrics.roc_auc_score``)."""
    fpr, tpr, _ = roc(scores, same)
    return _auc(fpr, tpr)


def _eer(fpr: FloatArray, tpr: FloatArray) -> float:
    """Error rate where the ROC's piecewise-linear FAR and FRR curves cross."""
    gap = fpr - (1.0 - tpr)  # rises from -1 (nothing accepted) to +1 (everything accepted)
    i = int(np.searchsorted(gap, 0.0, side="left"))  # first point with FAR >= FRR
    if gap[i] == 0.0:
        return float(fpr[i])
    t = -gap[i - 1] / (gap[i] - gap[i - 1])
    return float(fpr[i - 1] + t * (fpr[i] - fpr[i - 1]))


def eer(scores: npt.ArrayLike, same: npt.ArrayLike) -> float:
    """Equal error rate: the FAR (= FRR) where the two error rates cross on the ROC curve.

    Linear interpolation between the two ROC points that bracket the crossing.
    """
    fpr, tpr, _ = roc(scores, same)
    return _eer(fpr, tpr)


def _best_cut(fps: FloatArray, tps: FloatArray, thresholds: FloatArray) -> tuple[float, float]:
    """Best-accuracy threshold (midway to the next lower score) and its accuracy."""
    num_pairs = fps[-1] + tps[-1]
    correct = tps + (fps[-1] - fps)  # true accepts + true rejects
    i = int(np.argmax(correct))
    return _cut(i, thresholds), float(correct[i] / num_pairs)


def _cut(i: int, thresholds: FloatArray) -> float:
    """The threshold accepting exactly the scores ``>= thresholds[i]``, midway to the next."""
    if i == 0:
        return np.inf
    if i == thresholds.size - 1:
        return -np.inf
    cut = (thresholds[i] + thresholds[i + 1]) / 2.0
    if cut <= thresholds[i + 1]:  # adjacent floats: the midpoint rounded onto the lower score
        cut = thresholds[i]
    return float(cut)


def best_accuracy(scores: npt.ArrayLike, same: npt.ArrayLike) -> float:
    """Verification accuracy at the best single threshold (chosen on these same pairs)."""
    return _best_cut(*_counts(*_pairs(scores, same)))[1]


def kfold_accuracy(
    scores: npt.ArrayLike, same: npt.ArrayLike, folds: int | npt.ArrayLike = 10
) -> tuple[float, float]:
    """LFW-protocol accuracy: the threshold is tuned on k-1 folds, tested on the held-out one.

    On the training folds the threshold maximising accuracy is placed midway between the
    lowest accepted score and the next lower score; the held-out fold accepts
    ``score >= threshold``.

    Args:
        scores: ``[P]`` pair similarities.
        same: ``[P]`` True for genuine pairs.
        folds: ``k`` for ``k`` contiguous, near-equal splits in the given order (LFW's
            ``pairs.txt`` lists its 10 folds contiguously), or a ``[P]`` integer fold id per pair.

    Returns:
        ``(mean, std)`` of the per-fold accuracies; ``std`` is the population standard
        deviation (``ddof=0``), as in insightface's LFW evaluation.

    Raises:
        ValueError: if the inputs are malformed or there are fewer than two folds.
    """
    s, y = _pairs(scores, same)
    accuracies = []
    for test in _test_folds(folds, s):
        cut, _ = _best_cut(*_counts(s[~test], y[~test]))
        accuracies.append(np.mean((s[test] >= cut) == y[test]))
    return float(np.mean(accuracies)), float(np.std(accuracies))


def _test_folds(folds: int | npt.ArrayLike, s: FloatArray) -> list[BoolArray]:
    """The test mask of each fold: ``k`` contiguous splits or one per distinct fold id."""
    if isinstance(folds, int | np.integer):
        k = int(folds)
        if not 2 <= k <= s.size:
            raise ValueError(f"folds must be in [2, {s.size}] (number of pairs), got {k}")
        fold_ids = np.arange(s.size) * k // s.size
    else:
        fold_ids = np.asarray(folds)
        if fold_ids.shape != s.shape or not np.issubdtype(fold_ids.dtype, np.integer):
            raise ValueError(f"folds must be an int or {s.shape} integer array of fold ids")
    masks = [fold_ids == fold for fold in np.unique(fold_ids)]
    if len(masks) < 2:
        raise ValueError("folds must name at least two distinct folds")
    return masks


def kfold_balanced_accuracy(
    scores: npt.ArrayLike, same: npt.ArrayLike, folds: int | npt.ArrayLike = 10
) -> float:
    """Balanced accuracy, ``(TPR + TNR) / 2``, with each fold's threshold tuned on the others.

    For pairs whose genuine and impostor counts differ (LFW's folds after some pairs are
    dropped), where plain accuracy rewards a model that accepts everything: with 33 genuine
    and 5 impostor pairs, a model without skill scores 0.87, but 0.5 here. On the other
    folds the threshold maximising balanced accuracy is placed as in :func:`kfold_accuracy`;
    each pair is then accepted or rejected at its own fold's threshold, and TPR and TNR are
    counted over all pairs (a fold need not hold both kinds).

    Args:
        scores: ``[P]`` pair similarities.
        same: ``[P]`` True for genuine pairs.
        folds: as in :func:`kfold_accuracy`.

    Returns:
        The balanced accuracy, in ``[0, 1]``; 0.5 for scores that do not separate the pairs.

    Raises:
        ValueError: if the inputs are malformed, there are fewer than two folds, or the
            pairs outside some fold lack genuine or impostor pairs (no threshold to tune).
    """
    s, y = _pairs(scores, same)
    accepted = np.zeros(s.size, dtype=np.bool_)
    for test in _test_folds(folds, s):
        fps, tps, thresholds = _counts(s[~test], y[~test])
        if fps[-1] == 0 or tps[-1] == 0:
            raise ValueError(
                "balanced accuracy needs genuine and impostor pairs outside every fold"
            )
        balanced = tps / tps[-1] + (1.0 - fps / fps[-1])  # 2x, at each threshold
        accepted[test] = s[test] >= _cut(int(np.argmax(balanced)), thresholds)
    return float((np.mean(accepted[y]) + np.mean(~accepted[~y])) / 2.0)


def all_pairs(
    embeddings: npt.ArrayLike,
    labels: npt.ArrayLike,
    *,
    max_impostor: int | None = None,
    seed: int = 0,
) -> tuple[FloatArray, BoolArray]:
    """Cosine score and genuine flag of every unordered pair ``i < j`` of a set of embeddings.

    Memory is ``O(N^2)``: fine for ``N`` up to a few thousand (3,000 images: 4.5 M pairs).

    Args:
        embeddings: ``[N, D]`` embeddings (normalised here).
        labels: ``[N]`` identity labels.
        max_impostor: keep at most this many impostor pairs, drawn uniformly without
            replacement (all genuine pairs are kept); ``None`` keeps all.
        seed: seed of the impostor subsampling (evaluation only, not security-relevant).

    Returns:
        ``(scores, same)`` in row-major pair order ``(0, 1), (0, 2), ..., (N-2, N-1)``.

    Raises:
        ValueError: if shapes disagree, there are fewer than two embeddings, or one is zero.
    """
    unit = normalise_rows(embeddings)
    ids = np.asarray(labels)
    if ids.shape != unit.shape[:1] or unit.shape[0] < 2:
        raise ValueError(
            f"need [N, D] embeddings and [N] labels, N >= 2; got {unit.shape}, {ids.shape}"
        )
    rows, cols = np.triu_indices(unit.shape[0], k=1)
    scores = (unit @ unit.T)[rows, cols]
    same = ids[rows] == ids[cols]
    if max_impostor is not None:
        if max_impostor < 0:
            raise ValueError(f"max_impostor must be >= 0 or None, got {max_impostor}")
        impostor = np.flatnonzero(~same)
        if impostor.size > max_impostor:
            rng = np.random.default_rng(seed)
            keep = same.copy()
            keep[rng.choice(impostor, size=max_impostor, replace=False)] = True
            scores, same = scores[keep], same[keep]
    return scores, same


#: FARs of the ROC operating points ``roc_tar_at_far_<far>`` (held-out evaluation, reports).
ROC_FARS: Final[tuple[float, ...]] = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)


def verification_metrics(
    embeddings: npt.ArrayLike,
    labels: npt.ArrayLike,
    *,
    max_impostor: int | None = None,
    seed: int = 0,
    roc_points: bool = False,
) -> dict[str, float]:
    """All-pairs verification figures of one evaluation set.

    Args:
        embeddings: ``[N, D]`` embeddings.
        labels: ``[N]`` identity labels; at least one identity needs two images.
        max_impostor: see :func:`all_pairs`.
        seed: see :func:`all_pairs`.
        roc_points: also ``roc_tar_at_far_<far>`` for every FAR of :data:`ROC_FARS`.

    Returns:
        ``tar_at_far_1e-1``, ``tar_at_far_1e-2``, ``tar_at_far_1e-3`` (see
        :func:`tar_at_far`), ``roc_auc``, ``eer``, ``best_accuracy``, ``num_genuine`` and
        ``num_impostor``.

    Raises:
        ValueError: if the set yields no genuine or no impostor pair.
    """
    scores, same = all_pairs(embeddings, labels, max_impostor=max_impostor, seed=seed)
    counts = _counts(scores, same)
    fpr, tpr = _rates(counts[0], counts[1])
    metrics = {
        f"tar_at_far_{name}": _tar_from_roc(fpr, tpr, far)
        for name, far in VERIFICATION_FARS.items()
    }
    metrics["roc_auc"] = _auc(fpr, tpr)
    metrics["eer"] = _eer(fpr, tpr)
    metrics["best_accuracy"] = _best_cut(*counts)[1]
    metrics["num_genuine"] = float(counts[1][-1])
    metrics["num_impostor"] = float(counts[0][-1])
    if roc_points:
        for far in ROC_FARS:
            metrics[f"roc_tar_at_far_{far:g}"] = _tar_from_roc(fpr, tpr, far)
    return metrics


class DegenerateEmbeddings(ValueError):
    """Embedding rows that are zero or not finite: a diverged model has no cosine to score."""


def normalise_rows(embeddings: npt.ArrayLike) -> FloatArray:
    """Return ``[N, D]`` float64 rows scaled to unit L2 norm.

    Raises:
        ValueError: if the input is not 2-D.
        DegenerateEmbeddings: if a row is zero or not finite.
    """
    x = np.asarray(embeddings, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be [N, D], got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    bad = np.flatnonzero(~(np.isfinite(norms[:, 0]) & (norms[:, 0] > 0)))
    if bad.size:
        raise DegenerateEmbeddings(f"embedding rows {bad[:10].tolist()} are zero or not finite")
    unit: FloatArray = x / norms
    return unit
