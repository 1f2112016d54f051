"""LFW pairs protocol (Huang et al., 2007): ``pairs.txt`` and ``pairsDev{Train,Test}.txt``.

Two header formats exist:

- ``pairsDevTrain.txt`` / ``pairsDevTest.txt``: one line ``N``, then ``N`` same-person lines
  ``name i j`` followed by ``N`` different-person lines ``name1 i name2 j`` (one fold);
- ``pairs.txt``: one line ``F N`` (``10 300``), then ``F`` folds of ``N`` same-person lines
  followed by ``N`` different-person lines (the 10-fold "unrestricted" view 2 protocol).

Image ``i`` of ``name`` is ``<root>/<name>/<name>_<iiii>.jpg`` (1-based, zero-padded to 4).
LFW results must not be used to claim fitness for commercial use (see the LFW terms).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fl_secure.data.folders import load_image
from fl_secure.data.types import FaceDataset
from fl_secure.errors import DataError


@dataclass(frozen=True)
class Pair:
    """One protocol pair: image ``index1`` of ``name1`` against image ``index2`` of ``name2``."""

    name1: str
    index1: int
    name2: str
    index2: int
    same: bool
    fold: int


@dataclass(frozen=True)
class PairsProtocol:
    """Parsed pairs file.

    Attributes:
        pairs: every pair in file order.
        num_folds: 1 for the development files, 10 for ``pairs.txt``.
        pairs_per_fold: same-person pairs per fold (equal to the different-person pairs).
        source: file the protocol came from.
    """

    pairs: tuple[Pair, ...]
    num_folds: int
    pairs_per_fold: int
    source: str = ""

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def num_same(self) -> int:
        """Number of same-person pairs."""
        return sum(p.same for p in self.pairs)


@dataclass(frozen=True)
class PairImages:
    """Unique images of a protocol and the pairs as index arrays into them.

    Attributes:
        dataset: each image used by some pair, once; labels index the person names (sorted).
        left: dataset index of the first image of each pair (int64).
        right: dataset index of the second image of each pair (int64).
        same: whether each pair shows one person (bool).
        fold: fold of each pair (int64).
    """

    dataset: FaceDataset
    left: np.ndarray
    right: np.ndarray
    same: np.ndarray
    fold: np.ndarray


def image_path(root: str | Path, name: str, index: int) -> Path:
    """Path of image ``index`` (1-based) of person ``name`` under an LFW ``root``."""
    return Path(root) / name / f"{name}_{index:04d}.jpg"


def _is_decimal(token: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also accepts '²' or '٣', which ``int`` refuses."""
    return token.isascii() and token.isdigit()


def _index(token: str, where: str) -> int:
    if not _is_decimal(token) or int(token) < 1:
        raise DataError(f"{where}: image index must be a positive integer, got {token!r}")
    return int(token)


def read_pairs(path: str | Path) -> PairsProtocol:
    """Parse an LFW pairs file, checking every line against the header.

    Raises:
        DataError: missing file, bad header, a line of the wrong kind or shape (with its line
            number), or a pair count that does not match the header.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as exc:
        raise DataError(f"pairs file {path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read pairs file {path}: {exc}") from exc
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise DataError(f"pairs file {path} is empty")
    header = lines[0].split()
    if len(header) == 1 and _is_decimal(header[0]):
        folds, per_fold = 1, int(header[0])
    elif len(header) == 2 and all(_is_decimal(t) for t in header):
        folds, per_fold = int(header[0]), int(header[1])
    else:
        raise DataError(
            f"{path} line 1: expected 'N' (dev files) or 'FOLDS N' (pairs.txt), got {lines[0]!r}"
        )
    if folds < 1 or per_fold < 1:
        raise DataError(f"{path} line 1: folds and pairs per fold must be >= 1, got {lines[0]!r}")
    expected = folds * 2 * per_fold
    if len(lines) - 1 != expected:
        raise DataError(
            f"{path}: header {lines[0]!r} announces {expected} pairs but the file has "
            f"{len(lines) - 1} pair lines"
        )
    pairs = []
    for offset, line in enumerate(lines[1:]):
        where = f"{path} line {offset + 2}"
        fold, position = divmod(offset, 2 * per_fold)
        tokens = line.split()
        if position < per_fold:
            if len(tokens) != 3:
                raise DataError(f"{where}: expected a same-person pair 'name i j', got {line!r}")
            name, i, j = tokens
            pairs.append(Pair(name, _index(i, where), name, _index(j, where), True, fold))
        else:
            if len(tokens) != 4:
                raise DataError(
                    f"{where}: expected a different-person pair 'name1 i name2 j', got {line!r}"
                )
            name1, i, name2, j = tokens
            if name1 == name2:
                raise DataError(f"{where}: a different-person pair names {name1!r} twice")
            pairs.append(Pair(name1, _index(i, where), name2, _index(j, where), False, fold))
    return PairsProtocol(tuple(pairs), folds, per_fold, source=str(path))


def load_pair_images(
    protocol: PairsProtocol,
    root: str | Path,
    *,
    image_size: int = 64,
    center_crop: int | None = None,
) -> PairImages:
    """Load every image a protocol refers to, once, and index the pairs into them.

    Args:
        protocol: parsed pairs file.
        root: LFW image root (``<root>/<name>/<name>_0001.jpg``).
        image_size: side of the square output images.
        center_crop: central square cut before resizing (150 suits deep-funneled LFW).

    Raises:
        DataError: an image is missing or unreadable (named). The full ``pairs.txt`` needs the
            complete LFW set, which the user supplies.
    """
    keys: dict[tuple[str, int], int] = {}
    for p in protocol.pairs:
        keys.setdefault((p.name1, p.index1), len(keys))
        keys.setdefault((p.name2, p.index2), len(keys))
    missing = [image_path(root, n, i) for n, i in keys if not image_path(root, n, i).is_file()]
    if missing:
        raise DataError(
            f"{len(missing)} of {len(keys)} images of {protocol.source or 'the protocol'} are "
            f"missing under {root}, e.g. {missing[0]}; the 10-fold pairs.txt needs the complete "
            "LFW set"
        )
    names = sorted({name for name, _ in keys})
    label_of = {name: i for i, name in enumerate(names)}
    images = np.stack([
        load_image(image_path(root, name, index), image_size=image_size, center_crop=center_crop)
        for name, index in keys
    ])  # fmt: skip
    labels = np.array([label_of[name] for name, _ in keys], dtype=np.int64)
    dataset = FaceDataset(
        images=torch.from_numpy(images),
        labels=torch.from_numpy(labels),
        identity_names=tuple(names),
        attributes={"image_number": np.array([index for _, index in keys], dtype=np.int64)},
        source=f"lfw-pairs:{Path(protocol.source).name} (size={image_size}, crop={center_crop})",
    )
    return PairImages(
        dataset=dataset,
        left=np.array([keys[(p.name1, p.index1)] for p in protocol.pairs], dtype=np.int64),
        right=np.array([keys[(p.name2, p.index2)] for p in protocol.pairs], dtype=np.int64),
        same=np.array([p.same for p in protocol.pairs], dtype=bool),
        fold=np.array([p.fold for p in protocol.pairs], dtype=np.int64),
    )
