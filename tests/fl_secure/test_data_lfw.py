"""LFW pairs protocol: the official files (checksums, counts, folds) and malformed inputs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from fl_secure.data.lfw import Pair, image_path, load_pair_images, read_pairs
from fl_secure.errors import DataError

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
PROTOCOL = SHARED / "lfw_protocol"


def _protocol_file(name: str, md5: str) -> Path:
    path = PROTOCOL / name
    if not path.is_file():
        pytest.skip(f"shared test data {path} is not available")
    assert hashlib.md5(path.read_bytes()).hexdigest() == md5  # noqa: S324  # published checksum
    return path


def _dev_test() -> Path:
    return _protocol_file("pairsDevTest.txt", "5132f7440eb68cf58910c8a45a2ac10b")


def test_image_path_is_one_based_and_zero_padded() -> None:
    assert image_path("/lfw", "Zico", 3) == Path("/lfw/Zico/Zico_0003.jpg")
    assert image_path(Path("r"), "A_B", 1234) == Path("r/A_B/A_B_1234.jpg")


def test_pairs_dev_test_counts_and_first_pairs() -> None:
    protocol = read_pairs(_dev_test())
    assert len(protocol) == 1000 and protocol.num_same == 500
    assert (protocol.num_folds, protocol.pairs_per_fold) == (1, 500)
    assert protocol.pairs[0] == Pair("Abdullah_Gul", 13, "Abdullah_Gul", 14, True, 0)
    assert protocol.pairs[500] == Pair("AJ_Lamas", 1, "Zach_Safrin", 1, False, 0)
    assert all(p.same for p in protocol.pairs[:500])
    assert not any(p.same for p in protocol.pairs[500:])


def test_pairs_txt_has_ten_folds_of_300_plus_300() -> None:
    protocol = read_pairs(_protocol_file("pairs.txt", "9f1ba174e4e1c508ff7cdf10ac338a7d"))
    assert len(protocol) == 6000 and protocol.num_same == 3000
    assert (protocol.num_folds, protocol.pairs_per_fold) == (10, 300)
    folds = np.array([p.fold for p in protocol.pairs])
    same = np.array([p.same for p in protocol.pairs])
    np.testing.assert_array_equal(np.bincount(folds), [600] * 10)
    np.testing.assert_array_equal(np.bincount(folds[same]), [300] * 10)
    assert protocol.pairs[0] == Pair("Abel_Pacheco", 1, "Abel_Pacheco", 4, True, 0)
    assert not protocol.pairs[300].same and protocol.pairs[600].same
    assert protocol.pairs[600].fold == 1 and protocol.pairs[5999].fold == 9


def test_pairs_txt_images_beyond_dev_test_are_reported_missing() -> None:
    protocol = read_pairs(_protocol_file("pairs.txt", "9f1ba174e4e1c508ff7cdf10ac338a7d"))
    with pytest.raises(DataError, match="complete LFW set"):
        load_pair_images(protocol, SHARED / "lfw_devtest", image_size=32)


def test_load_dev_test_pair_images() -> None:
    root = SHARED / "lfw_devtest"
    if not root.is_dir():
        pytest.skip(f"shared test data {root} is not available")
    protocol = read_pairs(_dev_test())
    loaded = load_pair_images(protocol, root, image_size=32, center_crop=150)
    data = loaded.dataset
    assert len(data) == 1549 and data.num_identities == 963
    assert data.images.shape == (1549, 3, 32, 32)
    assert len(loaded.left) == len(loaded.right) == 1000
    labels = data.labels.numpy()
    np.testing.assert_array_equal(labels[loaded.left] == labels[loaded.right], loaded.same)
    assert loaded.same.sum() == 500 and set(loaded.fold.tolist()) == {0}
    first = protocol.pairs[0]
    assert data.identity_names[labels[loaded.left[0]]] == first.name1
    assert data.attributes["image_number"][loaded.left[0]] == first.index1
    assert data.attributes["image_number"][loaded.right[0]] == first.index2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("two\nA 1 2\nA 1 B 2\n", "line 1: expected 'N'"),
        ("1\nA 1 2\n", "announces 2 pairs but the file has 1"),
        ("1\nA 1 B 2\nA 1 2\n", "line 2: expected a same-person pair"),
        ("1\nA 1 2\nA 1 2\n", "line 3: expected a different-person pair"),
        ("1\nA 1 x\nA 1 B 2\n", "line 2: image index must be a positive integer, got 'x'"),
        ("1\nA 0 2\nA 1 B 2\n", "line 2: image index must be a positive integer, got '0'"),
        # digits str.isdigit accepts but int() does not: named with the line, no traceback
        (
            "1\nA 1 \u00b2\nA 1 B 2\n",
            "line 2: image index must be a positive integer, got '\u00b2'",
        ),
        ("1\nA 1 2\nA 1 B \u00b9\n", "line 3: image index must be a positive integer"),
        ("\u00b2\nA 1 2\nA 1 B 2\n", "line 1: expected 'N'"),
        ("1 \u00b9\nA 1 2\nA 1 B 2\n", "line 1: expected 'N'"),
        ("1\nA 1 2\nA 1 A 2\n", "line 3: a different-person pair names 'A' twice"),
        ("2 1\nA 1 2\nA 1 B 2\nC 1 2\nC 1 2\n", "line 5: expected a different-person pair"),
    ],
)
def test_malformed_pairs_files_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "pairs.txt"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        read_pairs(path)


def test_trailing_blank_lines_and_two_fold_header(tmp_path: Path) -> None:
    path = tmp_path / "pairs.txt"
    path.write_text("2 1\nA\t1\t2\nA\t1\tB\t2\nC 3 4\nD 1 E 1\n\n")
    protocol = read_pairs(path)
    assert [p.fold for p in protocol.pairs] == [0, 0, 1, 1]
    assert protocol.pairs[2] == Pair("C", 3, "C", 4, True, 1)


def test_missing_pairs_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        read_pairs(tmp_path / "absent.txt")
