"""Verification, identification and summary metrics (fl_secure.evaluation) against references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score, roc_curve

from fl_secure.evaluation import (
    all_pairs,
    best_accuracy,
    eer,
    kfold_accuracy,
    kfold_balanced_accuracy,
    per_client_summary,
    rank1,
    rank1_leave_one_out,
    roc,
    roc_auc,
    tar_at_far,
    verification_metrics,
)


def _random_pairs(seed: int, n: int = 400, decimals: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Overlapping genuine/impostor scores, rounded so that many scores tie."""
    rng = np.random.default_rng(seed)
    same = rng.random(n) < 0.3
    scores = np.round(rng.normal(0.0, 1.0, n) + 1.5 * same, decimals)
    return scores, same


@pytest.mark.parametrize("seed", range(5))
def test_roc_matches_sklearn(seed: int) -> None:
    scores, same = _random_pairs(seed)
    fpr, tpr, thresholds = roc(scores, same)
    ref_fpr, ref_tpr, ref_thresholds = roc_curve(same, scores, drop_intermediate=False)
    np.testing.assert_allclose(fpr, ref_fpr, rtol=0, atol=1e-15)
    np.testing.assert_allclose(tpr, ref_tpr, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(thresholds, ref_thresholds)


@pytest.mark.parametrize("seed", range(5))
def test_roc_auc_matches_sklearn(seed: int) -> None:
    scores, same = _random_pairs(seed, decimals=1)  # heavy ties: each counts one half
    assert roc_auc(scores, same) == pytest.approx(roc_auc_score(same, scores), abs=1e-12)


def _brute_rates(scores: np.ndarray, same: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FAR, TAR) at every candidate threshold in {+inf} U scores, accepting score >= t."""
    candidates = np.r_[np.inf, np.unique(scores)]
    accepted = scores[None, :] >= candidates[:, None]
    far = (accepted & ~same).sum(axis=1) / (~same).sum()
    tar = (accepted & same).sum(axis=1) / same.sum()
    return far, tar


@pytest.mark.parametrize("seed", range(3))
def test_tar_at_far_matches_brute_force_on_a_grid(seed: int) -> None:
    scores, same = _random_pairs(seed, n=600)
    far, tar = _brute_rates(scores, same)
    for budget in [1e-3, 1e-2, 0.05, 0.1, 0.25, 0.5, 0.99, 1.0, *np.unique(far)[1:6]]:
        expected = tar[far <= budget].max()
        assert tar_at_far(scores, same, float(budget)) == expected


def test_tar_at_far_never_exceeds_the_budget_with_ties() -> None:
    # impostors score 0.5 (x2) and 0.1 (x8): accepting 0.5 gives FAR 0.2, so at FAR <= 0.1
    # the threshold stays at 0.9
    scores = np.array([0.9, 0.5, 0.5, 0.5, *[0.1] * 8])
    same = np.array([True, True, False, False, *[False] * 8])
    assert tar_at_far(scores, same, 0.1) == 0.5
    assert tar_at_far(scores, same, 0.2) == 1.0


def test_eer_of_two_gaussians_is_the_analytic_value() -> None:
    # genuine ~ N(1, 1), impostor ~ N(-1, 1): the threshold 0 gives FAR = FRR = Phi(-1)
    rng = np.random.default_rng(0)
    scores = np.r_[rng.normal(1.0, 1.0, 50_000), rng.normal(-1.0, 1.0, 50_000)]
    same = np.r_[np.ones(50_000, bool), np.zeros(50_000, bool)]
    phi_minus_one = 0.5 * math.erfc(1.0 / math.sqrt(2.0))
    assert eer(scores, same) == pytest.approx(phi_minus_one, abs=4e-3)


@pytest.mark.parametrize("seed", range(3))
def test_eer_lies_where_far_and_frr_cross(seed: int) -> None:
    scores, same = _random_pairs(seed)
    far, tar = _brute_rates(scores, same)
    frr = 1.0 - tar
    i = int(np.argmax(far >= frr))  # first candidate with FAR >= FRR; the one before has FAR < FRR
    value = eer(scores, same)
    assert far[i - 1] <= value <= far[i]
    assert frr[i] <= value <= frr[i - 1]


@pytest.mark.parametrize("seed", range(3))
def test_best_accuracy_matches_brute_force(seed: int) -> None:
    scores, same = _random_pairs(seed)
    candidates = np.r_[np.inf, np.unique(scores)]
    accuracy = ((scores[None, :] >= candidates[:, None]) == same).mean(axis=1)
    assert best_accuracy(scores, same) == pytest.approx(accuracy.max(), abs=1e-15)


def test_kfold_accuracy_is_one_on_a_separable_set() -> None:
    rng = np.random.default_rng(0)
    same = rng.random(600) < 0.5
    scores = np.where(same, rng.uniform(0.6, 1.0, 600), rng.uniform(-1.0, 0.4, 600))
    assert kfold_accuracy(scores, same, 10) == (1.0, 0.0)


def test_kfold_accuracy_is_chance_on_random_labels() -> None:
    rng = np.random.default_rng(1)
    scores, same = rng.normal(size=6000), rng.random(6000) < 0.5
    mean, std = kfold_accuracy(scores, same, 10)
    assert mean == pytest.approx(0.5, abs=0.03)
    assert 0.0 < std < 0.05


def test_kfold_accepts_fold_ids_and_contiguous_k_alike() -> None:
    scores, same = _random_pairs(3, n=300)
    contiguous = np.repeat(np.arange(10), 30)
    assert kfold_accuracy(scores, same, contiguous) == kfold_accuracy(scores, same, 10)
    with pytest.raises(ValueError, match="folds"):
        kfold_accuracy(scores, same, 1)
    with pytest.raises(ValueError, match="two distinct folds"):
        kfold_accuracy(scores, same, np.zeros(300, dtype=int))


def test_balanced_accuracy_gives_no_credit_for_accepting_the_majority() -> None:
    # Prepare: 33 genuine and 5 impostor pairs in 2 folds, all with the same score (no skill)
    same = np.r_[np.ones(17, bool), np.zeros(2, bool), np.ones(16, bool), np.zeros(3, bool)]
    folds = np.repeat([0, 1], 19)
    flat = np.full(38, 0.3)
    # Execute / Assert: plain accuracy is the majority's share, balanced accuracy chance
    assert kfold_accuracy(flat, same, folds)[0] == pytest.approx(33 / 38, abs=0.01)
    assert kfold_balanced_accuracy(flat, same, folds) == 0.5
    # random scores over many such pairs: chance as well; separable ones: 1
    rng = np.random.default_rng(0)
    many = rng.random(4000) < 0.9
    assert kfold_balanced_accuracy(rng.normal(size=4000), many, 10) == pytest.approx(0.5, abs=0.05)
    assert kfold_balanced_accuracy(np.where(many, 0.9, 0.1), many, 10) == 1.0


def test_balanced_accuracy_on_a_case_computed_by_hand() -> None:
    # fold 0: genuine 0.9, 0.8, impostor 0.1; fold 1: genuine 0.7, 0.6, impostor 0.65.
    # Fold 1 is cut at 0.45 (fold 0 separates at 0.8): all three accepted. Fold 0 is cut
    # at 0.675 (on fold 1, accepting >= 0.7 gives TPR 1/2, TNR 1: the best sum): genuine
    # accepted, impostor rejected. TPR 4/4, TNR 1/2: 0.75 (plain accuracy: 5/6 on average).
    scores = np.array([0.9, 0.8, 0.1, 0.7, 0.6, 0.65])
    same = np.array([True, True, False, True, True, False])
    folds = np.array([0, 0, 0, 1, 1, 1])
    assert kfold_balanced_accuracy(scores, same, folds) == pytest.approx(0.75, abs=1e-15)
    assert kfold_accuracy(scores, same, folds)[0] == pytest.approx(5 / 6, abs=1e-15)
    with pytest.raises(ValueError, match="genuine and impostor pairs outside every fold"):
        kfold_balanced_accuracy(scores, same, np.array([0, 0, 1, 0, 0, 0]))


def test_all_pairs_matches_a_double_loop_and_subsamples_impostors() -> None:
    # Prepare
    rng = np.random.default_rng(0)
    embeddings, labels = rng.normal(size=(7, 5)), np.array([0, 0, 1, 2, 1, 0, 3])
    # Execute
    scores, same = all_pairs(embeddings, labels)
    kept_scores, kept_same = all_pairs(embeddings, labels, max_impostor=5, seed=1)
    # Assert
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    pairs = [(i, j) for i in range(7) for j in range(i + 1, 7)]
    np.testing.assert_allclose(scores, [unit[i] @ unit[j] for i, j in pairs], atol=1e-12)
    np.testing.assert_array_equal(same, [labels[i] == labels[j] for i, j in pairs])
    assert kept_same.sum() == same.sum() == 4 and (~kept_same).sum() == 5
    assert set(kept_scores) <= set(scores)
    repeat = all_pairs(embeddings, labels, max_impostor=5, seed=1)
    np.testing.assert_array_equal(repeat[0], kept_scores)


def test_verification_metrics_keys_and_values() -> None:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(20), 4)
    centres = rng.normal(size=(20, 16))
    embeddings = centres[labels] + 0.7 * rng.normal(size=(80, 16))
    metrics = verification_metrics(embeddings, labels)
    assert list(metrics) == [
        "tar_at_far_1e-1",
        "tar_at_far_1e-2",
        "tar_at_far_1e-3",
        "roc_auc",
        "eer",
        "best_accuracy",
        "num_genuine",
        "num_impostor",
    ]
    scores, same = all_pairs(embeddings, labels)
    assert metrics["num_genuine"] == 20 * 6 and metrics["num_impostor"] == 80 * 79 / 2 - 120
    assert metrics["tar_at_far_1e-2"] == tar_at_far(scores, same, 1e-2)
    assert metrics["roc_auc"] == pytest.approx(roc_auc_score(same, scores), abs=1e-12)
    assert metrics["eer"] == eer(scores, same)
    assert metrics["best_accuracy"] == best_accuracy(scores, same)
    with pytest.raises(ValueError, match="genuine"):
        verification_metrics(embeddings[:20], np.arange(20))  # no identity twice


def test_rank1_on_a_constructed_case() -> None:
    gallery = np.eye(3)
    probes = np.array([[0.9, 0.1, 0.0], [0.0, 1.0, 0.2], [0.0, 0.8, 0.6], [0.1, 0.0, 1.0]])
    # the third probe (identity 2) is nearer identity 1's enrolment: 3 of 4 correct
    assert rank1(gallery, [10, 11, 12], probes, [10, 11, 12, 12]) == 0.75
    with pytest.raises(ValueError, match="closed-set"):
        rank1(gallery, [10, 11, 12], probes, [10, 11, 12, 13])


def test_rank1_leave_one_out_on_a_constructed_case() -> None:
    embeddings = np.array(
        [[1.0, 0.0], [0.95, 0.05], [0.0, 1.0], [0.9, 0.3], [-1.0, 0.1]]
    )  # identity 1 = rows 2, 3; row 3 is nearer row 1 (identity 0); row 4 is a singleton
    labels = np.array([0, 0, 1, 1, 2])
    assert rank1_leave_one_out(embeddings, labels) == 0.75  # rows 0, 1, 2 right; 3 wrong
    with pytest.raises(ValueError, match="two images"):
        rank1_leave_one_out(embeddings[:3], [0, 1, 2])


@pytest.mark.parametrize("bad", [0.0, np.inf, np.nan])
def test_zero_or_non_finite_embedding_is_rejected_by_its_own_type(bad: float) -> None:
    from fl_secure.evaluation import DegenerateEmbeddings

    # the server tells a diverged model (this type) from a wrong-shape bug (plain ValueError)
    with pytest.raises(DegenerateEmbeddings, match=r"rows \[1\]"):
        all_pairs(np.array([[1.0, 0.0], [bad, 0.0]]), [0, 0])
    with pytest.raises(ValueError, match="must be") as info:
        all_pairs(np.zeros(3), [0, 0, 0])
    assert not isinstance(info.value, DegenerateEmbeddings)


def test_per_client_summary_uses_the_population_std() -> None:
    per_client = {
        "a": {"tar_at_far_1e-2": 0.2, "eer": 0.10},
        "b": {"tar_at_far_1e-2": 0.4, "eer": 0.30},
        "c": {"tar_at_far_1e-2": 0.9, "eer": 0.20},
    }
    summary = per_client_summary(per_client)
    assert list(summary) == ["tar_at_far_1e-2_mean", "tar_at_far_1e-2_std", "eer_mean", "eer_std"]
    assert summary["tar_at_far_1e-2_mean"] == pytest.approx(0.5)
    assert summary["tar_at_far_1e-2_std"] == pytest.approx(math.sqrt((0.09 + 0.01 + 0.16) / 3))
    assert summary["eer_std"] == pytest.approx(np.std([0.1, 0.3, 0.2], ddof=0))
    # a metric only some clients report is summarised over them, with their count
    partial = per_client_summary({"a": {"eer": 0.1, "x": 1.0}, "b": {"x": 2.0}})
    assert partial == {"eer_mean": 0.1, "eer_std": 0.0, "eer_clients": 1.0,
                       "x_mean": 1.5, "x_std": 0.5}  # fmt: skip
    with pytest.raises(ValueError, match="at least one client"):
        per_client_summary({})


def test_roc_points_agree_with_the_headline_tar_and_are_monotone() -> None:
    from fl_secure.evaluation.verification import ROC_FARS, verification_metrics

    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(30), 4)
    emb = rng.normal(size=(30, 16))[labels] + 0.8 * rng.normal(size=(120, 16))
    m = verification_metrics(emb, labels, roc_points=True)
    tars = [m[f"roc_tar_at_far_{far:g}"] for far in ROC_FARS]
    assert m["roc_tar_at_far_0.01"] == m["tar_at_far_1e-2"]
    assert m["roc_tar_at_far_0.001"] == m["tar_at_far_1e-3"]
    assert tars == sorted(tars) and tars[-1] == 1.0
    assert "roc_tar_at_far_0.01" not in verification_metrics(emb, labels)
