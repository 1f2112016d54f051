"""Identity hold-out, per-identity stratified splits and equal client partitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_secure.data.splits import (
    equal_partition,
    held_out_identities,
    identity_indices,
    stratified_split,
)
from fl_secure.data.types import FaceDataset
from fl_secure.errors import DataError


def _labels(counts: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(counts)), counts)


def test_held_out_identities_disjoint_cover_and_deterministic() -> None:
    # Prepare: 30 identities, shuffled image order
    labels = np.random.default_rng(0).permutation(_labels([5] * 30))
    # Execute
    train, held = held_out_identities(labels, num_held_out=8, seed=3)
    again = held_out_identities(torch.from_numpy(labels), num_held_out=8, seed=3)
    other = held_out_identities(list(labels), num_held_out=8, seed=4)
    # Assert
    assert len(held) == 8 and len(train) == 22
    assert np.intersect1d(train, held).size == 0
    np.testing.assert_array_equal(np.union1d(train, held), np.arange(30))
    np.testing.assert_array_equal(again[1], held)
    assert not np.array_equal(other[1], held)
    assert np.all(np.diff(held) > 0) and np.all(np.diff(train) > 0)


def test_held_out_identities_by_fraction_and_from_dataset() -> None:
    data = FaceDataset(
        images=torch.zeros(40, 3, 8, 8),
        labels=torch.from_numpy(_labels([2] * 20)),
        identity_names=tuple(f"id{i}" for i in range(20)),
    )
    train, held = held_out_identities(data, fraction=0.25, seed=0)
    assert (len(train), len(held)) == (15, 5)


def test_held_out_zero_is_allowed() -> None:
    train, held = held_out_identities(_labels([2, 2, 2]), num_held_out=0, seed=0)
    np.testing.assert_array_equal(train, [0, 1, 2])
    assert held.size == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_held_out": 5}, "cannot hold out 5 of 5"),
        ({"num_held_out": -1}, "cannot hold out -1"),
        ({"fraction": 1.0}, "fraction must be in"),
        ({}, "exactly one"),
        ({"num_held_out": 1, "fraction": 0.2}, "exactly one"),
    ],
)
def test_held_out_identities_rejects_impossible_requests(
    kwargs: dict[str, float], message: str
) -> None:
    with pytest.raises(DataError, match=message):
        held_out_identities(_labels([3] * 5), seed=0, **kwargs)  # type: ignore[arg-type]


def test_held_out_rejects_float_labels() -> None:
    with pytest.raises(DataError, match="integer"):
        held_out_identities(np.array([0.5, 1.5]), num_held_out=1, seed=0)


def test_stratified_split_two_way_per_identity() -> None:
    labels = np.random.default_rng(1).permutation(_labels([10] * 6 + [4, 2]))
    train, test = stratified_split(labels, fractions=(0.7, 0.3), seed=0)
    assert np.intersect1d(train, test).size == 0
    np.testing.assert_array_equal(np.union1d(train, test), np.arange(len(labels)))
    per_train = np.bincount(labels[train], minlength=8)
    per_test = np.bincount(labels[test], minlength=8)
    np.testing.assert_array_equal(per_train, [7] * 6 + [3, 1])
    np.testing.assert_array_equal(per_test, [3] * 6 + [1, 1])


def test_stratified_split_three_way_gives_every_part_an_image() -> None:
    labels = _labels([10, 3, 5, 2, 1])
    train, val, test = stratified_split(labels, fractions=(0.7, 0.1, 0.2), seed=5)
    counts = [np.bincount(labels[p], minlength=5) for p in (train, val, test)]
    np.testing.assert_array_equal(counts[0], [7, 1, 3, 1, 1])
    np.testing.assert_array_equal(counts[1], [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(counts[2], [2, 1, 1, 0, 0])
    assert sum(len(p) for p in (train, val, test)) == len(labels)


def test_stratified_split_deterministic_by_seed() -> None:
    labels = _labels([10] * 10)
    first = stratified_split(labels, seed=7)
    second = stratified_split(labels, seed=7)
    third = stratified_split(labels, seed=8)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], third[0])


@pytest.mark.parametrize("fractions", [(1.0,), (0.5, 0.6), (1.2, -0.2), (0.5, 0.5, 0.0)])
def test_stratified_split_rejects_bad_fractions(fractions: tuple[float, ...]) -> None:
    with pytest.raises(DataError, match="fractions"):
        stratified_split(_labels([4, 4]), fractions=fractions, seed=0)


def test_equal_partition_even_disjoint_deterministic() -> None:
    ids = np.arange(100, 123)  # 23 identities over 5 clients: 5, 5, 5, 4, 4
    parts = equal_partition(ids, 5, seed=2)
    sizes = sorted(len(p) for p in parts)
    assert sizes == [4, 4, 5, 5, 5]
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), ids)
    again = equal_partition(list(ids), 5, seed=2)
    for a, b in zip(parts, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(
        not np.array_equal(a, b) for a, b in zip(parts, equal_partition(ids, 5, 3), strict=True)
    )


@pytest.mark.parametrize(
    ("ids", "clients", "message"),
    [
        ([1, 2, 3], 4, "cannot give 3 identities to 4 clients"),
        ([1, 2, 3], 0, "num_clients must be >= 1"),
        ([1, 1, 2], 2, "duplicates"),
    ],
)
def test_equal_partition_rejects_impossible_requests(
    ids: list[int], clients: int, message: str
) -> None:
    with pytest.raises(DataError, match=message):
        equal_partition(ids, clients, seed=0)


def test_identity_indices_selects_images_of_identities() -> None:
    labels = np.array([3, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(identity_indices(labels, [1, 3]), [0, 1, 3, 5])


@pytest.mark.parametrize("kind", ["lognormal", "dirichlet"])
def test_skewed_partitions_are_disjoint_covering_and_deterministic(kind: str) -> None:
    # Prepare
    from fl_secure.data.splits import dirichlet_partition, lognormal_partition

    make = lognormal_partition if kind == "lognormal" else dirichlet_partition
    ids = np.arange(100, 1100)
    # Execute
    parts = make(ids, 20, seed=3)
    again = make(ids.tolist(), 20, seed=3)
    # Assert: every identity exactly once, every client at least one, reproducible, skewed
    assert sorted(np.concatenate(parts).tolist()) == ids.tolist()
    assert all(len(p) >= 1 for p in parts)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    sizes = np.array([len(p) for p in parts])
    assert sizes.max() > 5 * np.median(sizes)  # a few clients hold most identities


def test_lognormal_counts_follow_eq5() -> None:
    # HF-MAML Eq. 5: client i gets C S_i / sum_j S_j identities, S_i ~ lognormal(3, 3)
    from fl_secure.data.splits import lognormal_partition

    ids = np.arange(5000)
    parts = lognormal_partition(ids, 10, seed=0)
    weights = np.random.default_rng(0).lognormal(mean=3.0, sigma=3.0, size=10)
    expected = 5000 * weights / weights.sum()
    sizes = np.array([len(p) for p in parts])
    assert np.all(np.abs(sizes - expected) <= 1.0 + (expected < 1))  # rounding, min one each


@pytest.mark.parametrize(("mu", "sigma"), [(800.0, 3.0), (-800.0, 3.0), (3.0, 300.0)])
def test_lognormal_shares_that_overflow_a_float_still_partition(mu: float, sigma: float) -> None:
    # S_i = exp(800 + ...) is inf in float64 and exp(-800 + ...) is 0: the shares are taken in
    # log space, so mu still cancels and the partition is the one of Eq. 5
    from fl_secure.data.splits import lognormal_partition

    ids = np.arange(26)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # no inf, no 0/0
        parts = lognormal_partition(ids, 4, seed=34, mu=mu, sigma=sigma)
    assert sorted(np.concatenate(parts).tolist()) == ids.tolist()  # each identity once
    assert all(len(p) >= 1 for p in parts)
    if sigma == 3.0:  # mu cancels in Eq. 5: the same partition as at the paper's mu = 3
        paper = lognormal_partition(ids, 4, seed=34, mu=3.0, sigma=3.0)
        assert all(np.array_equal(a, b) for a, b in zip(parts, paper, strict=True))


def test_dirichlet_with_large_alpha_is_nearly_equal() -> None:
    from fl_secure.data.splits import dirichlet_partition

    sizes = [len(p) for p in dirichlet_partition(np.arange(1000), 10, seed=1, alpha=1e4)]
    assert max(sizes) - min(sizes) <= 10
    with pytest.raises(DataError, match="alpha"):
        dirichlet_partition(np.arange(10), 2, seed=0, alpha=0.0)


def test_attribute_partition_follows_the_predicates() -> None:
    # Prepare: synthetic faces carry glasses/hat/male/... per image
    from fl_secure.data.splits import attribute_partition
    from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces

    data = generate_synthetic_faces(SyntheticFaceConfig(30, 6, image_size=32, seed=1))
    candidates = np.arange(len(data))
    predicates = ["glasses=1 & hat=0", "hat=1", "male=true & glasses=0", "male=0"]
    # Execute
    parts = attribute_partition(data.attributes, candidates, predicates)
    # Assert: every image of a client satisfies its conjunction; no image on two clients
    a = data.attributes
    assert all(a["glasses"][parts[0]]) and not any(a["hat"][parts[0]])
    assert all(a["hat"][parts[1]])
    assert all(a["male"][parts[2]]) and not any(a["glasses"][parts[2]])
    assert not any(a["male"][parts[3]])
    together = np.concatenate(parts)
    assert len(together) == len(np.unique(together))
    # identities can span clients (the point of an attribute partition)
    spans = [len({int(c) for c, p in enumerate(parts) if i in set(data.labels[p].tolist())})
             for i in range(30)]  # fmt: skip
    assert max(spans) > 1


def test_attribute_predicates_are_checked_by_name() -> None:
    from fl_secure.data.splits import attribute_partition

    attrs = {"hat": np.array([True, False])}
    with pytest.raises(DataError, match="unknown attribute 'wig'; known: hat"):
        attribute_partition(attrs, np.arange(2), ["wig=1"])
    with pytest.raises(DataError, match="no image matches"):
        attribute_partition(attrs, np.arange(2), ["hat=1", "hat=1"])
    with pytest.raises(DataError, match="is not name=value"):
        attribute_partition(attrs, np.arange(2), ["hat"])
