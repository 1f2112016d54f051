"""CelebA's annotation files and image folder, with identity-level attributes.

Liu et al., "Deep Learning Face Attributes in the Wild" (ICCV 2015) distribute CelebA as a
flat image folder (``img_align_celeba/000001.jpg`` ...) and two text files:

- ``list_attr_celeba.txt``: a count line, a line of the 40 attribute names, then one line per
  image, ``filename v1 .. v40`` with values ``1`` (present) or ``-1`` (absent);
- ``identity_CelebA.txt``: one line per image, ``filename identity`` (identity an integer).

The HF-MAML paper's attribute partition (Sec. III, Table II) gives each client a conjunction
of attribute predicates. Attributes here are *identity-level*: an identity has an attribute
when a strict majority of its images are annotated with it (a tie counts as absent), and
every image of the identity carries that value (``1`` or ``0``), so a predicate such as
``"Male=1 & Eyeglasses=0"`` selects whole identities and clients never share one.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fl_secure.data.folders import check_filters, keep_identities, load_image, natural_order
from fl_secure.data.types import FaceDataset
from fl_secure.errors import DataError


@dataclass(frozen=True)
class AttributeTable:
    """``list_attr_celeba.txt``: attribute names and one ``{0, 1}`` row per image."""

    names: tuple[str, ...]
    filenames: tuple[str, ...]
    values: np.ndarray  # uint8 [images, attributes], 1 = present (the file's 1), 0 = its -1

    def row(self) -> dict[str, int]:
        """Image name -> row index."""
        return {name: i for i, name in enumerate(self.filenames)}


def _lines(path: Path) -> list[str]:
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not a UTF-8 text file ({exc.reason} at byte {exc.start})"
        ) from None
    return [line for line in text.splitlines() if line.strip()]


def read_attribute_file(path: str | Path) -> AttributeTable:
    """Read CelebA's ``list_attr_celeba.txt`` (count line, names line, ``file v1..vK`` lines).

    Raises:
        DataError: a missing file, a count that disagrees with the rows, a row with the wrong
            number of values, a value other than 1 / -1, or a repeated image name.
    """
    p = Path(path)
    lines = _lines(p)
    if len(lines) < 2:
        raise DataError(f"{p}: expected a count line and an attribute-names line")
    try:
        count = int(lines[0].strip())
    except ValueError:
        raise DataError(f"{p}: first line must be the image count, got {lines[0]!r}") from None
    names = tuple(lines[1].split())
    if not names or len(set(names)) != len(names):
        raise DataError(f"{p}: line 2 must name each attribute once")
    rows = lines[2:]
    if len(rows) != count:
        raise DataError(f"{p}: the count line says {count} images, the file has {len(rows)}")
    filenames: list[str] = []
    values = np.empty((len(rows), len(names)), dtype=np.uint8)
    for i, line in enumerate(rows):
        parts = line.split()
        if len(parts) != len(names) + 1:
            raise DataError(
                f"{p} line {i + 3}: expected a file name and {len(names)} values, "
                f"got {len(parts)} fields"
            )
        if any(v not in ("1", "-1") for v in parts[1:]):
            raise DataError(f"{p} line {i + 3}: attribute values must be 1 or -1")
        filenames.append(parts[0])
        values[i] = [v == "1" for v in parts[1:]]
    if len(set(filenames)) != len(filenames):
        raise DataError(f"{p}: an image is listed twice")
    return AttributeTable(names=names, filenames=tuple(filenames), values=values)


def read_identity_file(path: str | Path) -> dict[str, int]:
    """Read CelebA's ``identity_CelebA.txt``: image name -> identity number.

    Raises:
        DataError: a missing file, a line that is not ``filename integer``, or a repeated image.
    """
    p = Path(path)
    identities: dict[str, int] = {}
    for i, line in enumerate(_lines(p)):
        parts = line.split()
        number = parts[1].removeprefix("-") if len(parts) == 2 else ""
        if not (number.isascii() and number.isdigit()):  # isdigit alone accepts '²'
            raise DataError(f"{p} line {i + 1}: expected 'filename identity', got {line!r}")
        if parts[0] in identities:
            raise DataError(f"{p} line {i + 1}: {parts[0]} is listed twice")
        identities[parts[0]] = int(parts[1])
    return identities


def identity_attributes(
    table: AttributeTable, identities: dict[str, int]
) -> dict[int, dict[str, int]]:
    """Per identity, each attribute by strict majority over its annotated images (tie: 0).

    Images without an identity line are ignored; an identity none of whose images is in the
    attribute table has no entry.
    """
    rows = table.row()
    members: dict[int, list[int]] = defaultdict(list)
    for filename, identity in identities.items():
        if filename in rows:
            members[identity].append(rows[filename])
    result: dict[int, dict[str, int]] = {}
    for identity, idx in members.items():
        present = table.values[idx].sum(axis=0)
        majority = 2 * present > len(idx)
        result[identity] = {n: int(v) for n, v in zip(table.names, majority, strict=True)}
    return result


def load_celeba(
    image_dir: str | Path,
    attributes_file: str | Path,
    identities_file: str | Path,
    *,
    image_size: int = 64,
    min_images_per_identity: int = 2,
    max_identities: int | None = None,
    max_images_per_identity: int | None = None,
    center_crop: int | None = None,
) -> FaceDataset:
    """CelebA images grouped by identity, with identity-level attributes (module docstring).

    Identities are taken in increasing identity number and their images in natural file
    order, so the same files always give the same labels; only images listed in both files
    are used.

    Args:
        image_dir: the flat image folder (``img_align_celeba``).
        attributes_file: ``list_attr_celeba.txt``.
        identities_file: ``identity_CelebA.txt``.
        image_size: side of the square output images.
        min_images_per_identity: identities with fewer images are skipped.
        max_identities: keep the first identities after the minimum filter.
        max_images_per_identity: keep the first images of each identity.
        center_crop: central square cut before resizing (see :func:`load_image`).

    Returns:
        A data set whose ``attributes`` hold every CelebA attribute as a ``{0, 1}`` array,
        constant over each identity's images; identity names are the identity numbers.

    Raises:
        DataError: unreadable files, a missing image, or no identity left after the filters.
    """
    check_filters(
        image_size=image_size,
        min_images_per_identity=min_images_per_identity,
        max_identities=max_identities,
        max_images_per_identity=max_images_per_identity,
        center_crop=center_crop,
    )
    folder = Path(image_dir)
    if not folder.is_dir():
        raise DataError(f"CelebA image folder {folder} does not exist")
    table = read_attribute_file(attributes_file)
    ids = read_identity_file(identities_file)
    attrs = identity_attributes(table, ids)
    annotated = set(table.filenames)
    by_identity: dict[int, list[str]] = defaultdict(list)
    for filename, identity in ids.items():
        if filename in annotated:
            by_identity[identity].append(filename)
    chosen = keep_identities(
        (
            (identity, sorted(by_identity[identity], key=natural_order))
            for identity in sorted(by_identity)
        ),
        min_images=min_images_per_identity,
        max_identities=max_identities,
        max_images=max_images_per_identity,
    )
    if not chosen:
        raise DataError(
            f"no CelebA identity has >= {min_images_per_identity} annotated images; lower "
            "data.min_images_per_identity"
        )
    images = [
        load_image(folder / name, image_size=image_size, center_crop=center_crop)
        for _, files in chosen
        for name in files
    ]
    counts = [len(files) for _, files in chosen]
    labels = np.repeat(np.arange(len(chosen), dtype=np.int64), counts)
    attributes = {
        name: np.repeat(np.array([attrs[i][name] for i, _ in chosen], dtype=np.int64), counts)
        for name in table.names
    }
    return FaceDataset(
        images=torch.from_numpy(np.stack(images)),
        labels=torch.from_numpy(labels),
        identity_names=tuple(str(identity) for identity, _ in chosen),
        attributes=attributes,
        source=f"celeba:{folder.name} (size={image_size}, center_crop={center_crop})",
    )
