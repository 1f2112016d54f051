"""What an alignment run did to every input file: the report and its ``manifest.json``.

:func:`fl_secure.data.align.align_folder` returns an :class:`AlignReport` and writes it as
``<dst>/manifest.json``; :func:`read_align_manifest` reads it back. One entry per image file
of the source, in the order the loaders read them, with its status:

- ``aligned``: one face found; its chip was written;
- ``several_faces``: more than one found; the chip is of the largest (its box and score are
  recorded, with how many were found);
- ``no_face``: none found; no chip (unless the fallback is on);
- ``fallback_center``: none found, and the centre crop was written instead (``fallback =
  "center"``);
- ``unreadable``: the file could not be decoded (the reason is recorded); no chip.

Counts are derived from the entries, never stored apart from them, so they cannot disagree.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

from fl_secure.errors import JSON_DOCUMENT_ERRORS, DataError

Status = Literal["aligned", "several_faces", "no_face", "fallback_center", "unreadable"]
STATUSES: Final[tuple[str, ...]] = get_args(Status)
#: statuses whose chip is of a detected face, aligned on its landmarks
FACE_STATUSES: Final = frozenset({"aligned", "several_faces"})
#: statuses with a chip written
CHIP_STATUSES: Final = FACE_STATUSES | {"fallback_center"}
MANIFEST: Final = "manifest.json"
MANIFEST_FORMAT: Final = "fl-secure align manifest 1"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlignParameters:
    """How the chips were made: enough to make the same chips again at another site."""

    size: int  # chip side in pixels
    padding: float  # dlib's padding around the landmarks' mean face (0.25: dlib's ResNet)
    detector: str  # "hog" or "cnn"
    upsample: int  # times the image is doubled before detection
    fallback: str  # "none" or "center"
    landmarks_model: str  # file name of the 5-point shape predictor
    landmarks_sha256: str  # its SHA-256
    detector_sha256: str | None  # the CNN detector's .dat (None: HOG, built into dlib)
    dlib_version: str


@dataclass(frozen=True)
class AlignEntry:
    """One input image file and what became of it.

    Attributes:
        source: path relative to the source folder (``<identity>/<file>``, ``/``-separated).
        identity: the identity folder's name.
        status: see the module docstring.
        chip: the chip's path relative to the output folder, or ``None`` if none was written.
        faces: how many faces the detector found.
        box: ``(left, top, right, bottom)`` of the face taken, in the source image's pixels.
        score: the detector's score of the face taken.
        reason: why an ``unreadable`` file could not be read.
    """

    source: str
    identity: str
    status: Status
    chip: str | None = None
    faces: int = 0
    box: tuple[int, int, int, int] | None = None
    score: float | None = None
    reason: str | None = None


@dataclass(frozen=True)
class AlignReport:
    """Every input file of an alignment run, with the parameters and the folders.

    Attributes:
        src: the source folder (``<src>/<identity>/<image>``).
        dst: the output folder (``<dst>/<identity>/<stem>.png`` and ``manifest.json``).
        parameters: how the chips were made.
        identities: every identity folder of the source, in natural order, with or without
            images.
        entries: one per image file, identity by identity, in natural order.
        ignored: files of the source that are not images by their suffix (listed, not read).
    """

    src: Path
    dst: Path
    parameters: AlignParameters
    identities: tuple[str, ...]
    entries: tuple[AlignEntry, ...]
    ignored: tuple[str, ...] = ()

    @property
    def totals(self) -> dict[str, int]:
        """Entries per status (every status, zeros included)."""
        counts: Counter[str] = Counter(e.status for e in self.entries)
        return {status: counts[status] for status in STATUSES}

    @property
    def per_identity(self) -> dict[str, dict[str, int]]:
        """Entries per status of each identity."""
        table = {name: dict.fromkeys(STATUSES, 0) for name in self.identities}
        for entry in self.entries:
            table[entry.identity][entry.status] += 1
        return table

    @property
    def chips(self) -> int:
        """How many chips were written."""
        return sum(e.status in CHIP_STATUSES for e in self.entries)

    @property
    def faces(self) -> int:
        """How many images held a detected face (``aligned`` or ``several_faces``)."""
        return sum(e.status in FACE_STATUSES for e in self.entries)

    def no_face_error(self) -> str | None:
        """Why this run is a failure when no image held a detectable face, else ``None``.

        Names the source folder, how many images were tried, what became of them and where
        the manifest is; the manifest is written all the same.
        """
        if self.faces:
            return None
        totals = ", ".join(f"{status} {n}" for status, n in self.totals.items() if n)
        return (
            f"no detectable face in any of {len(self.entries)} images under {self.src} "
            f"({totals}); every file's status is in {self.dst / MANIFEST}. Check that the "
            "folder holds face photos; small or profile faces: --upsample 2 or --detector cnn"
        )

    @property
    def unaligned_identities(self) -> tuple[str, ...]:
        """Identities without a single chip of a detected face (centre crops do not count)."""
        aligned = {e.identity for e in self.entries if e.status in FACE_STATUSES}
        return tuple(name for name in self.identities if name not in aligned)

    def summary(self) -> str:
        """A few lines for a terminal: chips written, counts per status, what to look at."""
        p = self.parameters
        lines = [
            f"{self.chips} chips of {len(self.entries)} images ({len(self.identities)} "
            f"identities) from {self.src} in {self.dst}",
            f"  {p.size} px, padding {p.padding}, {p.detector} detector, upsample "
            f"{p.upsample}, fallback {p.fallback}",
            "  " + ", ".join(f"{status} {count}" for status, count in self.totals.items()),
        ]
        if self.unaligned_identities:
            lines.append(
                f"  identities without an aligned face: {_some(self.unaligned_identities)}"
            )
        if self.ignored:
            lines.append(f"  not images, left out: {_some(self.ignored)}")
        lines.append(f"  every file's status: {self.dst / MANIFEST}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The manifest: parameters, totals, per-identity counts, then every entry."""
        return {
            "format": MANIFEST_FORMAT,
            "src": str(self.src),
            "parameters": asdict(self.parameters),
            "totals": self.totals,
            "chips": self.chips,
            "identities": self.per_identity,
            "unaligned_identities": list(self.unaligned_identities),
            "ignored": list(self.ignored),
            "images": [{k: v for k, v in asdict(e).items() if v is not None} for e in self.entries],
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any], *, dst: Path) -> AlignReport:
        """The report of a manifest written by :meth:`to_dict` into ``dst``.

        Raises:
            DataError: not an alignment manifest, or a field missing or of the wrong type.
        """
        where = dst / MANIFEST
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise DataError(f"{where} is not a manifest of `fl-secure data align`")
        try:
            entries = tuple(_entry_from_dict(item) for item in doc["images"])
            identities = tuple(str(name) for name in doc["identities"])
            report = cls(
                src=Path(str(doc["src"])),
                dst=dst,
                parameters=AlignParameters(**doc["parameters"]),
                identities=identities,
                entries=entries,
                ignored=tuple(str(name) for name in doc["ignored"]),
            )
        except JSON_DOCUMENT_ERRORS as exc:
            raise DataError(f"{where} is malformed: {type(exc).__name__}: {exc}") from exc
        unknown = {e.identity for e in entries} - set(identities)
        if unknown:
            raise DataError(f"{where} lists images of unknown identities {sorted(unknown)}")
        return report


def _some(names: tuple[str, ...], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _entry_from_dict(item: dict[str, Any]) -> AlignEntry:
    status = item["status"]
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r} (one of {', '.join(STATUSES)})")
    box = item.get("box")
    return AlignEntry(
        source=str(item["source"]),
        identity=str(item["identity"]),
        status=status,
        chip=None if item.get("chip") is None else str(item["chip"]),
        faces=int(item.get("faces", 0)),
        box=None if box is None else (int(box[0]), int(box[1]), int(box[2]), int(box[3])),
        score=None if item.get("score") is None else float(item["score"]),
        reason=None if item.get("reason") is None else str(item["reason"]),
    )


def log_aligned_folder(path: str | Path, image_size: int) -> AlignReport | None:
    """Log what an aligned folder (``fl-secure data align``'s output) holds, if it is one.

    A folder without an alignment manifest is left alone (``None``); one whose manifest
    cannot be read is logged as a warning and left to the loader.

    Raises:
        DataError: the manifest says no chip was written (no detectable face in any image).
    """
    if not (Path(path) / MANIFEST).is_file():
        return None
    try:
        report = read_align_manifest(path)
    except DataError as exc:
        log.warning("data.path %s: %s", path, exc)
        return None
    if not report.chips:
        raise DataError(
            f"data.path {path} holds no face chip: "
            f"{report.no_face_error() or 'the alignment wrote none'}"
        )
    log.info(
        "data.path %s: %d chips (%d px) of %d images aligned by `fl-secure data align` from %s",
        path,
        report.chips,
        report.parameters.size,
        len(report.entries),
        report.src,
    )
    if report.parameters.size != image_size:
        log.warning(
            "data.path %s: its chips are %d px and data.image_size = %d resizes them",
            path,
            report.parameters.size,
            image_size,
        )
    return report


def read_align_manifest(dst: str | Path) -> AlignReport:
    """The report of the alignment run that wrote ``dst``.

    Raises:
        DataError: ``dst`` has no manifest, or it is not valid JSON or not an alignment
            manifest.
    """
    dst = Path(dst)
    path = dst / MANIFEST
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(
            f"{dst} has no {MANIFEST}: was it written by `fl-secure data align`?"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    return AlignReport.from_dict(doc, dst=dst)
