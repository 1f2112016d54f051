"""``data.degrade`` and ``data.image_size = 150`` in a run: every site and the server alike.

The reference is :mod:`fl_secure.data.degrade` applied directly to the data set as loaded:
the server's held-out images and each client's images are those, bit for bit. Folder data is
generated noise (no real face is committed).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fl_secure.config import Config, config_from_dict
from fl_secure.data.align_report import (
    MANIFEST,
    AlignEntry,
    AlignParameters,
    AlignReport,
)
from fl_secure.data.degrade import degrade_dataset, parse_degradation
from fl_secure.data.folders import load_identity_folders
from fl_secure.data.plan import degrade_for_run, load_dataset, load_source, plan_federation
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError, DataError

SPEC = "lowres:12+greyblur:1+occlusion:0.2:3"


def _config(degrade: str = "", **data: object) -> Config:
    table = {
        "image_size": 32, "num_identities": 8, "images_per_identity": 4,
        "held_out_identities": 2, "degrade": degrade, **data,
    }  # fmt: skip
    return config_from_dict({
        "data": table, "partition": {"num_clients": 2}, "server": {"min_clients": 2},
        "run": {"seed": 5},
    })  # fmt: skip


def _positions(full: FaceDataset, part: FaceDataset) -> list[int]:
    """Where each image of ``part`` sits in ``full`` (the synthetic images are distinct)."""
    index = {img.numpy().tobytes(): i for i, img in enumerate(full.images)}
    assert len(index) == len(full)
    return [index[img.numpy().tobytes()] for img in part.images]


# ---------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("blur:2", "'blur:2' is not a degradation step"),
        ("occlusion:1.5", "occlusion fraction must be in"),
        ("lowres:0", "lowres side must be >= 1"),
        ("lowres:64", "more than data.image_size = 32"),
    ],
)
def test_a_bad_degrade_spec_is_a_config_error_naming_the_key(spec: str, words: str) -> None:
    with pytest.raises(ConfigError, match="data.degrade") as caught:
        _config(spec)
    assert words in str(caught.value)


def test_image_size_150_is_allowed_and_the_message_lists_the_sizes() -> None:
    assert _config(image_size=150).data.image_size == 150
    with pytest.raises(ConfigError, match="data.image_size.*32, 64, 112, 150"):
        _config(image_size=100)


# -------------------------------------------------------------------- the run's data, degraded


def test_no_degradation_leaves_the_images_bit_identical() -> None:
    for spec in ("", "none"):
        config = _config(spec)
        direct = generate_synthetic_faces(
            SyntheticFaceConfig(num_identities=8, images_per_identity=4, image_size=32, seed=5)
        )
        loaded = load_dataset(config.data, config.run.seed)
        assert torch.equal(loaded.images, direct.images)
        assert loaded.source == direct.source


def test_held_out_and_client_images_are_degrade_py_applied_directly() -> None:
    clean_plan, plan = plan_federation(_config()), plan_federation(_config(SPEC))
    config = _config(SPEC)
    full = load_source(config.data, config.run.seed)  # as loaded, before data.degrade
    expected = degrade_dataset(full, parse_degradation(SPEC), run_seed=config.run.seed)
    assert not torch.equal(expected.images, full.images)
    pairs = [(clean_plan.held_out, plan.held_out)]
    for clean, degraded in zip(clean_plan.clients, plan.clients, strict=True):
        pairs += [(clean.train, degraded.train), (clean.test, degraded.test)]
    for clean, degraded in pairs:  # the same split, each image degraded as degrade.py does
        assert torch.equal(degraded.labels, clean.labels)
        assert torch.equal(degraded.images, expected.images[_positions(full, clean)])
    # and one image through the public per-image call (float64 pixels, same key)
    k = _positions(full, clean_plan.held_out)[0]
    label = int(full.labels[k])
    rank = int((full.labels[:k] == label).sum())
    pixels = (full.images[k].double().numpy().transpose(1, 2, 0) + 1.0) * 127.5
    key = f"{config.run.seed}/{full.identity_names[label]}/{rank}"
    direct = parse_degradation(SPEC)(pixels, key).transpose(2, 0, 1) / 127.5 - 1.0
    assert np.abs(plan.held_out.images[0].double().numpy() - direct).max() < 1e-6


def test_degradation_is_deterministic_and_follows_the_run_seed() -> None:
    config = _config(SPEC)
    first = load_dataset(config.data, config.run.seed)
    assert torch.equal(first.images, load_dataset(config.data, config.run.seed).images)
    other = load_dataset(config.data, config.run.seed + 1)
    clean = load_source(config.data, config.run.seed + 1)
    again = degrade_dataset(clean, parse_degradation(SPEC), run_seed=config.run.seed)
    assert not torch.equal(other.images, again.images)  # another run: other occlusion boxes


# ----------------------------------------------------------------------- folders at 150 px


def _noise_folder(root: Path, identities: int = 3, images: int = 2, side: int = 150) -> Path:
    rng = np.random.default_rng(0)
    for i in range(identities):
        (root / f"p{i}").mkdir(parents=True)
        for j in range(images):
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"p{i}" / f"{j}.png")
    return root


def test_folder_chips_load_at_150_and_degrade_like_a_client_folder(tmp_path: Path) -> None:
    root = _noise_folder(tmp_path / "chips")
    config = _config(
        "lowres:24+occlusion:0.1", source="folders", path=str(root), image_size=150,
        held_out_identities=0,
    )  # fmt: skip
    data = load_dataset(config.data, config.run.seed)
    assert data.images.shape == (6, 3, 150, 150)
    raw = load_identity_folders(root, image_size=150)
    chip = np.asarray(Image.open(root / "p0" / "0.png"), dtype=np.float32) / 127.5 - 1.0
    assert torch.equal(raw.images[0], torch.from_numpy(chip.transpose(2, 0, 1)))  # no resize
    # a client's own --data folder (client/trainer_factory.py) goes through degrade_for_run
    assert torch.equal(data.images, degrade_for_run(raw, config.data, config.run.seed).images)
    clean = load_dataset(_config(source="folders", path=str(root), image_size=150).data, 5)
    assert torch.equal(clean.images, raw.images)


def _report(root: Path, statuses: list[str]) -> AlignReport:
    parameters = AlignParameters(150, 0.25, "hog", 1, "none", "lm.dat", "0" * 64, None, "20")
    entries = tuple(
        AlignEntry(f"p0/{j}.png", "p0", s, f"p0/{j}.png" if s == "aligned" else None)  # type: ignore[arg-type]
        for j, s in enumerate(statuses)
    )
    return AlignReport(root.parent / "raw", root, parameters, ("p0",), entries)


def test_an_aligned_folder_logs_its_chips(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = _noise_folder(tmp_path / "chips", identities=1, images=2)
    report = _report(root, ["aligned", "aligned", "no_face"])
    (root / MANIFEST).write_text(json.dumps(report.to_dict()))
    config = _config(source="folders", path=str(root), image_size=64, held_out_identities=0)
    with caplog.at_level(logging.INFO, logger="fl_secure.data.align_report"):
        load_dataset(config.data, 5)
    text = caplog.text
    assert f"data.path {root}: 2 chips (150 px) of 3 images aligned" in text
    assert "its chips are 150 px and data.image_size = 64 resizes them" in text


def test_an_aligned_folder_without_a_face_is_refused_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "chips"
    (root / "p0").mkdir(parents=True)
    report = _report(root, ["no_face", "no_face", "unreadable"])
    (root / MANIFEST).write_text(json.dumps(report.to_dict()))
    config = _config(source="folders", path=str(root), image_size=150, held_out_identities=0)
    with pytest.raises(DataError, match="no detectable face in any of 3 images under") as caught:
        load_dataset(config.data, 5)
    assert str(root) in str(caught.value) and "no_face 2, unreadable 1" in str(caught.value)
    assert report.faces == 0 and _report(root, ["aligned"]).no_face_error() is None
