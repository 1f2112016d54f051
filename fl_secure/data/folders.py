"""Folder-per-identity face data sets (ORL / AT&T, LFW, CASIA-WebFace or VGGFace2 crops).

Layout: ``<root>/<identity>/<image>``, one folder per person. Identity folders and image files
are taken in natural order (``s2`` before ``s10``, ``2.pgm`` before ``10.pgm``), so the same
folder always gives the same labels and image order.

Each image is optionally centre-cropped (deep-funneled LFW: 250x250 with the face in the
middle 150 px or so), padded to a square with its mean border colour (ORL is 92x112), resized
to ``image_size`` and scaled to ``[-1, 1]``. Grayscale images (ORL) are replicated to three
channels.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from fl_secure.data.types import FaceDataset
from fl_secure.errors import DataError

IMAGE_SUFFIXES = frozenset({".pgm", ".ppm", ".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff"})
#: What PIL raises on a file it cannot decode; a header claiming an absurd size (a
#: decompression bomb) raises DecompressionBombError, which is neither OSError nor ValueError.
_UNREADABLE = (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError)


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders digit runs by value: ``s2 < s10``, ``2.pgm < 10.pgm``.

    ``s1`` and ``s01`` get the same key: sort by :func:`natural_order` for a total order.
    """
    parts = re.split(r"(\d+)", name)
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts if p)


def natural_order(name: str) -> tuple[tuple[tuple[int, int | str], ...], str]:
    """:func:`natural_key` with ties (``s1``, ``s01``) broken by the name.

    So a folder gives the same order whatever order the file system lists it in.
    """
    return natural_key(name), name


def list_images(folder: Path) -> list[Path]:
    """Image files directly in ``folder`` (hidden files skipped), in natural order."""
    files = [
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES
    ]
    return sorted(files, key=lambda p: natural_order(p.name))


def load_image(
    path: Path, *, image_size: int, center_crop: int | None = None, grayscale_to_rgb: bool = True
) -> np.ndarray:
    """Read one image as float32 ``[3, image_size, image_size]`` in ``[-1, 1]``.

    Args:
        path: image file.
        image_size: output side length.
        center_crop: side of a central square cut out before resizing, or ``None``.
        grayscale_to_rgb: replicate single-channel images to RGB; when ``False`` a grayscale
            image is an error (use it to make sure a colour data set really is colour).

    Raises:
        DataError: the file is missing or unreadable, is grayscale while ``grayscale_to_rgb`` is
            off, or is smaller than ``center_crop``.
    """
    try:
        with Image.open(path) as opened:
            opened.load()
            # a camera's EXIF orientation: the face upright, as any viewer shows it
            img = ImageOps.exif_transpose(opened) or opened.copy()
    except FileNotFoundError as exc:
        raise DataError(f"image {path} does not exist") from exc
    except _UNREADABLE as exc:
        raise DataError(f"cannot read image {path}: {exc}") from exc
    if center_crop is not None and center_crop < 1:
        raise DataError(f"center_crop={center_crop}: give a side >= 1 (None: no crop)")
    if img.mode in ("L", "I", "F", "1", "LA") or img.mode.startswith("I;16"):
        if not grayscale_to_rgb:
            raise DataError(
                f"image {path} is grayscale ({img.mode}); pass grayscale_to_rgb=True to "
                "replicate it to three channels"
            )
        img = _to_8_bit(img, path)
    img = img.convert("RGB")
    if center_crop is not None:
        w, h = img.size
        if center_crop > min(w, h):
            raise DataError(f"center_crop={center_crop} exceeds the {w}x{h} image {path}")
        left, top = (w - center_crop) // 2, (h - center_crop) // 2
        img = img.crop((left, top, left + center_crop, top + center_crop))
    if img.size[0] != img.size[1]:
        arr = np.asarray(img)
        border = np.concatenate([arr[0], arr[-1], arr[:, 0], arr[:, -1]])
        fill = tuple(int(c) for c in border.mean(axis=0).round())
        img = ImageOps.pad(img, (max(img.size),) * 2, color=fill)
    if img.size != (image_size, image_size):
        img = img.resize((image_size, image_size), Image.Resampling.BICUBIC)
    arr = np.asarray(img, dtype=np.float32).transpose(2, 0, 1)
    return np.ascontiguousarray(arr / 127.5 - 1.0, dtype=np.float32)


def _to_8_bit(img: Image.Image, path: str | Path) -> Image.Image:
    """A grayscale image as 8-bit ``L``: 16-bit values scaled by 255/65535, not clipped.

    PIL's ``convert("L")`` clips ``I;16`` and ``I`` values above 255, which turns most of a
    16-bit image white.
    """
    if img.mode.startswith("I;16") or img.mode == "I":
        arr = np.asarray(img, dtype=np.float64) * (255.0 / 65535.0)
        return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8))
    if img.mode == "F":
        raise DataError(f"image {path} holds floating-point pixels (mode F); save it as 8 bits")
    return img.convert("L")


K = TypeVar("K")
F = TypeVar("F")


def keep_identities(
    groups: Iterable[tuple[K, list[F]]],
    *,
    min_images: int,
    max_identities: int | None,
    max_images: int | None,
) -> list[tuple[K, list[F]]]:
    """The data-set filters, in order, over ``(identity, files)`` groups.

    Identities with at least ``min_images`` files are kept, each with its first
    ``max_images`` files, up to ``max_identities`` of them. ``groups`` is read lazily, so
    nothing after the last identity kept is listed.
    """
    chosen: list[tuple[K, list[F]]] = []
    for key, files in groups:
        if len(files) < min_images:
            continue
        chosen.append((key, files[:max_images]))
        if max_identities is not None and len(chosen) == max_identities:
            break
    return chosen


def check_filters(
    *,
    image_size: int,
    min_images_per_identity: int,
    max_identities: int | None,
    max_images_per_identity: int | None,
    center_crop: int | None,
) -> None:
    """Refuse loader settings out of range (``None``: the filter is off).

    Raises:
        DataError: a value below its floor, or a cap on images per identity below the
            minimum (every identity kept would be cut under the minimum it was kept for).
    """
    for name, value, low in (
        ("image_size", image_size, 8),
        ("min_images_per_identity", min_images_per_identity, 1),
        ("max_identities", max_identities, 1),
        ("max_images_per_identity", max_images_per_identity, 1),
        ("center_crop", center_crop, 1),
    ):
        if value is not None and value < low:
            raise DataError(f"{name} must be >= {low}, got {value}")
    if max_images_per_identity is not None and max_images_per_identity < min_images_per_identity:
        raise DataError(
            f"max_images_per_identity = {max_images_per_identity} is below "
            f"min_images_per_identity = {min_images_per_identity}: every identity kept would "
            "be cut under the minimum"
        )


def list_identity_folders(
    root: str | Path,
    *,
    min_images_per_identity: int = 1,
    max_identities: int | None = None,
    max_images_per_identity: int | None = None,
    check_headers: bool = False,
) -> list[tuple[str, list[Path]]]:
    """The identities and image files :func:`load_identity_folders` would load, unread.

    Cheap enough to run before anything else (a client checks its ``--data`` before it
    dials the server). With ``check_headers`` every file's header is opened too (no pixel
    is decoded), which catches a file that is not an image at all.

    Raises:
        DataError: missing root, no identity folder, an identity folder without images, a
            file that is not an image (with ``check_headers``), or nothing left after the
            filters.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data root {root} does not exist or is not a folder")
    folders = sorted(
        (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
        key=lambda p: natural_order(p.name),
    )
    if not folders:
        raise DataError(f"data root {root} has no identity folders (expected <root>/<name>/*.jpg)")

    def images_of(folder: Path) -> list[Path]:
        files = list_images(folder)
        if not files:
            raise DataError(f"identity folder {folder} holds no images ({sorted(IMAGE_SUFFIXES)})")
        return files

    chosen = keep_identities(
        ((folder.name, images_of(folder)) for folder in folders),
        min_images=min_images_per_identity,
        max_identities=max_identities,
        max_images=max_images_per_identity,
    )
    if not chosen:
        raise DataError(
            f"no identity in {root} has >= {min_images_per_identity} images; lower "
            "min_images_per_identity"
        )
    if check_headers:
        for _, files in chosen:
            for path in files:
                try:
                    Image.open(path).close()  # reads the header only
                except _UNREADABLE as exc:
                    raise DataError(f"cannot read image {path}: {exc}") from exc
    return chosen


def load_identity_folders(
    root: str | Path,
    *,
    image_size: int = 64,
    min_images_per_identity: int = 1,
    max_identities: int | None = None,
    max_images_per_identity: int | None = None,
    grayscale_to_rgb: bool = True,
    center_crop: int | None = None,
) -> FaceDataset:
    """Load ``<root>/<identity>/<image>`` into a :class:`FaceDataset`.

    Args:
        root: folder holding one sub-folder per identity (files directly in it are ignored).
        image_size: side of the square output images.
        min_images_per_identity: identities with fewer images are skipped.
        max_identities: keep the first identities (natural order) after the minimum filter.
        max_images_per_identity: keep the first images (natural order) of each identity.
        grayscale_to_rgb: replicate grayscale images to RGB (see :func:`load_image`).
        center_crop: central square cut before resizing, e.g. 150 for deep-funneled LFW.

    Returns:
        Images ordered identity by identity; labels index ``identity_names`` (folder names).

    Raises:
        DataError: missing root, no identity folder, an identity folder without images, an
            unreadable image (named), or nothing left after the filters.
    """
    root = Path(root)
    check_filters(
        image_size=image_size,
        min_images_per_identity=min_images_per_identity,
        max_identities=max_identities,
        max_images_per_identity=max_images_per_identity,
        center_crop=center_crop,
    )
    chosen = list_identity_folders(
        root,
        min_images_per_identity=min_images_per_identity,
        max_identities=max_identities,
        max_images_per_identity=max_images_per_identity,
    )
    images = [
        load_image(
            path, image_size=image_size, center_crop=center_crop, grayscale_to_rgb=grayscale_to_rgb
        )
        for _, files in chosen
        for path in files
    ]
    labels = np.concatenate(
        [np.full(len(files), i, dtype=np.int64) for i, (_, files) in enumerate(chosen)]
    )
    return FaceDataset(
        images=torch.from_numpy(np.stack(images)),
        labels=torch.from_numpy(labels),
        identity_names=tuple(name for name, _ in chosen),
        source=f"folders:{root.name} (size={image_size}, center_crop={center_crop})",
    )
