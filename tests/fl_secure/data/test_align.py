"""Face alignment: real LFW and ORL faces through dlib, and hand-made folders around them.

The reference is dlib itself: a chip we wrote gives the same face descriptor as dlib's own
``compute_face_descriptor(image, landmarks)``, which aligns internally. Tests that need dlib,
the ``face_recognition_models`` package or the shared faces skip when they are absent; the
error paths that need none of them always run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fl_secure.data import align as align_module
from fl_secure.data import dlib_faces
from fl_secure.data.align import align_folder, center_chip, read_rgb, scan_source
from fl_secure.data.align_report import MANIFEST, AlignReport, read_align_manifest
from fl_secure.data.dlib_faces import LANDMARKS_DAT, Detection, FaceAligner
from fl_secure.errors import ConfigError, DataError

SHARED = Path(__file__).resolve().parents[3] / ".." / "shared" / "data"
LFW = SHARED / "lfw_min10_cap20"
ORL = SHARED / "orl"
HAS_DLIB = importlib.util.find_spec("dlib") is not None
HAS_MODELS = importlib.util.find_spec("face_recognition_models") is not None
needs_dlib = pytest.mark.skipif(
    not (HAS_DLIB and HAS_MODELS),
    reason="dlib or face_recognition_models is not installed (pip install 'fl-secure[faces]')",
)
PEOPLE = ("Abdullah_Gul", "Adrien_Brody", "Alejandro_Toledo", "Alvaro_Uribe")


def _needs_faces() -> None:
    if not (LFW.is_dir() and ORL.is_dir()):
        pytest.skip(f"the shared LFW and ORL faces are not in {SHARED.resolve()}")


def _lfw(person: str, number: int) -> Path:
    return LFW / person / f"{person}_{number:04d}.jpg"


def _copy(path: Path, folder: Path, name: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / (name or path.name)
    target.write_bytes(path.read_bytes())
    return target


def _two_faces(big: Path, small: Path, target: Path) -> None:
    """``big`` at full size on the left, ``small`` at 150x150 on the right, one canvas."""
    canvas = Image.new("RGB", (250 + 150, 250), (90, 90, 90))
    canvas.paste(Image.open(big).convert("RGB"), (0, 0))
    canvas.paste(Image.open(small).convert("RGB").resize((150, 150)), (250, 50))
    target.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(target)


@pytest.fixture(scope="module")
def lfw_run(tmp_path_factory: pytest.TempPathFactory) -> AlignReport:
    """Two LFW images of each of four people, one ORL face, then the odd files."""
    if not (HAS_DLIB and HAS_MODELS):
        pytest.skip("dlib or face_recognition_models is not installed")
    _needs_faces()
    root = tmp_path_factory.mktemp("lfw-run")
    src = root / "raw"
    for person in PEOPLE:
        for number in (1, 3):
            _copy(_lfw(person, number), src / person)
    _copy(ORL / "s1" / "1.pgm", src / "s1")
    odd = src / "zz_odd"
    odd.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (120, 120, 3), dtype=np.uint8)).save(odd / "1.png")
    Image.new("L", (100, 100), 128).save(odd / "2.png")
    (odd / "3.jpg").write_bytes(b"not an image")
    (odd / "4.jpg").write_bytes(_lfw(PEOPLE[0], 1).read_bytes()[:600])  # truncated JPEG
    _two_faces(_lfw(PEOPLE[1], 1), _lfw(PEOPLE[2], 1), odd / "5.png")
    (odd / "notes.txt").write_text("not an image")
    return align_folder(src, root / "chips", progress=False)


def _entry(report: AlignReport, source: str) -> dict[str, object]:
    (entry,) = (e for e in report.to_dict()["images"] if e["source"] == source)
    return dict(entry)


@needs_dlib
def test_every_lfw_image_gets_a_150_chip_and_an_entry(lfw_run: AlignReport) -> None:
    lfw = [e for e in lfw_run.entries if e.identity in PEOPLE]
    assert [e.source for e in lfw] == [
        f"{p}/{p}_{n:04d}.jpg" for p in PEOPLE for n in (1, 3)
    ]  # every input, in natural order
    assert all(e.status in ("aligned", "several_faces") and e.faces >= 1 for e in lfw)
    for entry in lfw:
        assert entry.chip == entry.source.removesuffix(".jpg") + ".png"
        chip = np.asarray(Image.open(lfw_run.dst / entry.chip))
        assert chip.shape == (150, 150, 3) and chip.dtype == np.uint8


@needs_dlib
def test_grey_orl_face_is_aligned_in_rgb_with_equal_channels(lfw_run: AlignReport) -> None:
    entry = _entry(lfw_run, "s1/1.pgm")
    assert entry["status"] == "aligned"
    chip = np.asarray(Image.open(lfw_run.dst / "s1" / "1.png"))
    assert chip.shape == (150, 150, 3)
    assert np.array_equal(chip[..., 0], chip[..., 1]) and np.array_equal(chip[..., 1], chip[..., 2])


@needs_dlib
def test_odd_files_are_recorded_not_dropped(lfw_run: AlignReport) -> None:
    for source in ("zz_odd/1.png", "zz_odd/2.png"):  # noise, a plain grey square
        assert _entry(lfw_run, source) == {
            "source": source, "identity": "zz_odd", "status": "no_face", "faces": 0
        }  # fmt: skip
    for source in ("zz_odd/3.jpg", "zz_odd/4.jpg"):  # not an image, truncated
        entry = _entry(lfw_run, source)
        assert entry["status"] == "unreadable" and "chip" not in entry
        assert entry["reason"]
    assert lfw_run.ignored == ("zz_odd/notes.txt",)
    assert sorted(p.name for p in (lfw_run.dst / "zz_odd").iterdir()) == ["5.png"]
    totals = lfw_run.totals
    assert totals["aligned"] + totals["several_faces"] == 8 + 1 + 1  # LFW, ORL, the canvas
    assert (totals["no_face"], totals["fallback_center"], totals["unreadable"]) == (2, 0, 2)
    assert len(lfw_run.entries) == 8 + 1 + 5 and lfw_run.chips == 10
    assert lfw_run.unaligned_identities == ()
    summary = lfw_run.summary()
    assert summary.startswith(f"10 chips of 14 images (6 identities) from {lfw_run.src}")
    assert "no_face 2, fallback_center 0, unreadable 2" in summary
    assert "not images, left out: zz_odd/notes.txt" in summary


@needs_dlib
def test_of_two_faces_the_larger_is_taken(lfw_run: AlignReport) -> None:
    (entry,) = (e for e in lfw_run.entries if e.source == "zz_odd/5.png")
    assert (entry.status, entry.faces, entry.chip) == ("several_faces", 2, "zz_odd/5.png")
    assert entry.box is not None and entry.box[2] < 250  # the left face, not the 150 px one
    faces = FaceAligner().detect(read_rgb(lfw_run.src / "zz_odd" / "5.png"))
    assert faces[0].box == entry.box and faces[0].score == pytest.approx(entry.score, abs=1e-6)
    assert faces[0].area > faces[1].area and faces[1].box[0] >= 250


@needs_dlib
def test_manifest_on_disk_is_the_report(lfw_run: AlignReport) -> None:
    doc = json.loads((lfw_run.dst / MANIFEST).read_text())
    assert doc["totals"] == lfw_run.totals and doc["chips"] == lfw_run.chips
    assert len(doc["images"]) == len(lfw_run.entries)
    assert read_align_manifest(lfw_run.dst) == lfw_run
    models = dlib_faces.dlib_model_file(LANDMARKS_DAT)
    assert doc["parameters"]["landmarks_sha256"] == hashlib.sha256(models.read_bytes()).hexdigest()
    assert doc["parameters"] | {"landmarks_sha256": "", "dlib_version": ""} == {
        "size": 150, "padding": 0.25, "detector": "hog", "upsample": 1, "fallback": "none",
        "landmarks_model": LANDMARKS_DAT, "landmarks_sha256": "", "detector_sha256": None,
        "dlib_version": "",
    }  # fmt: skip


@needs_dlib
def test_chips_are_dlib_chips_by_dlib_face_descriptors(lfw_run: AlignReport) -> None:
    dlib = dlib_faces.import_dlib()  # the reference implementation
    net = dlib.face_recognition_model_v1(
        str(dlib_faces.dlib_model_file("dlib_face_recognition_resnet_model_v1.dat"))
    )
    aligner = FaceAligner()
    for entry in lfw_run.entries[:3]:
        assert entry.box is not None and entry.chip is not None
        image = read_rgb(lfw_run.src / entry.source)
        shape = aligner.landmarks(image, Detection(entry.box, 0.0))
        theirs = np.asarray(net.compute_face_descriptor(image, shape))
        ours = np.asarray(net.compute_face_descriptor(read_rgb(lfw_run.dst / entry.chip)))
        cosine = ours @ theirs / np.linalg.norm(ours) / np.linalg.norm(theirs)
        assert cosine >= 0.999, (entry.source, cosine)


@needs_dlib
def test_cnn_detector_aligns_and_records_its_model(tmp_path: Path) -> None:
    _needs_faces()
    src = tmp_path / "raw"
    _copy(ORL / "s2" / "1.pgm", src / "s2")
    _copy(_lfw(PEOPLE[3], 1), src / PEOPLE[3])
    report = align_folder(src, tmp_path / "chips", detector="cnn", upsample=0, progress=False)
    assert [e.status for e in report.entries] == ["aligned", "aligned"]
    mmod = dlib_faces.dlib_model_file(dlib_faces.MMOD_DAT)
    assert report.parameters.detector == "cnn"
    assert report.parameters.detector_sha256 == hashlib.sha256(mmod.read_bytes()).hexdigest()


def test_manifest_reader_refuses_other_documents(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"{tmp_path} has no {MANIFEST}"):
        read_align_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="cannot read"):
        read_align_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(DataError, match="is not a manifest of `fl-secure data align`"):
        read_align_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "fl-secure align manifest 1"}))
    with pytest.raises(DataError, match="is malformed: KeyError"):
        read_align_manifest(tmp_path)


@needs_dlib
def test_fallback_center_writes_the_centre_square_of_faceless_images(tmp_path: Path) -> None:
    src = tmp_path / "raw"
    (src / "a").mkdir(parents=True)
    noise = np.random.default_rng(1).integers(0, 256, (100, 140, 3), dtype=np.uint8)
    Image.fromarray(noise).save(src / "a" / "noise.png")
    report = align_folder(src, tmp_path / "chips", size=64, fallback="center", progress=False)
    (entry,) = report.entries
    assert (entry.status, entry.chip, entry.faces) == ("fallback_center", "a/noise.png", 0)
    chip = np.asarray(Image.open(tmp_path / "chips" / "a" / "noise.png"))
    assert np.array_equal(chip, center_chip(noise, 64)) and chip.shape == (64, 64, 3)
    assert report.unaligned_identities == ("a",)  # a centre crop is not an aligned face


@needs_dlib
def test_rerun_is_refused_unless_overwrite_and_then_replaces_everything(tmp_path: Path) -> None:
    src, dst = tmp_path / "raw", tmp_path / "chips"
    (src / "a").mkdir(parents=True)
    Image.new("RGB", (60, 60), (10, 20, 30)).save(src / "a" / "1.png")
    align_folder(src, dst, fallback="center", progress=False)
    assert (dst / "a" / "1.png").is_file()
    with pytest.raises(DataError, match=f"{dst}.*overwrite"):
        align_folder(src, dst, progress=False)
    report = align_folder(src, dst, overwrite=True, progress=False)
    assert report.totals["no_face"] == 1
    assert sorted(p.name for p in dst.iterdir()) == [MANIFEST]  # the old centre crop is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chips", "raw"]  # no leftovers


@needs_dlib
def test_overwrite_refuses_a_folder_that_alignment_did_not_write(tmp_path: Path) -> None:
    src, dst = tmp_path / "raw", tmp_path / "precious"
    (src / "a").mkdir(parents=True)
    Image.new("RGB", (60, 60)).save(src / "a" / "1.png")
    dst.mkdir()
    (dst / "thesis.tex").write_text("keep me")
    with pytest.raises(DataError, match="refusing to overwrite"):
        align_folder(src, dst, overwrite=True, progress=False)
    assert (dst / "thesis.tex").read_text() == "keep me"


@needs_dlib
def test_an_interrupted_run_leaves_no_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = tmp_path / "raw", tmp_path / "chips"
    (src / "a").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (60, 60)).save(src / "a" / f"{i}.png")
    calls = []
    real = align_module._align_one

    def interrupted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(align_module, "_align_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        align_folder(src, dst, fallback="center", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def test_source_errors_name_the_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"{tmp_path / 'missing'}.*does not exist"):
        scan_source(tmp_path / "missing")
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (8, 8)).save(flat / "1.png")
    with pytest.raises(DataError, match=f"{flat} holds no identity folders"):
        scan_source(flat)
    empty = tmp_path / "empty"
    (empty / "a").mkdir(parents=True)
    (empty / "a" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=f"no image in the identity folders of {empty}"):
        scan_source(empty)
    twins = tmp_path / "twins"
    (twins / "a").mkdir(parents=True)
    for name in ("1.jpg", "1.png"):
        Image.new("RGB", (8, 8)).save(twins / "a" / name)
    with pytest.raises(DataError, match="would both be aligned to a/1.png"):
        scan_source(twins)


def test_missing_dlib_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dlib", None)  # `import dlib` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'fl-secure\[faces\]'"):
        FaceAligner()


@needs_dlib
def test_missing_model_file_says_which_extra_to_install(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"{LANDMARKS_DAT}.*pip install 'fl-secure\[faces\]'"):
        FaceAligner(models_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"size": 4}, "size must be >= 8"),
        ({"padding": -0.1}, "padding must be in"),
        ({"fallback": "blur"}, "fallback 'blur' is not one of none, center"),
        ({"detector": "haar"}, "detector 'haar' is not one of hog, cnn"),
        ({"upsample": -1}, "upsample must be >= 0"),
    ],
)
def test_parameters_out_of_range_are_refused(
    tmp_path: Path, kwargs: dict[str, object], match: str
) -> None:
    src = tmp_path / "raw"
    (src / "a").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(src / "a" / "1.png")
    with pytest.raises(ConfigError, match=match):
        align_folder(src, tmp_path / "chips", progress=False, **kwargs)  # type: ignore[arg-type]
