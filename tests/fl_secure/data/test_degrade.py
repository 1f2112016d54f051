"""Target-domain degradations: exact invariants, reference libraries, determinism, specs.

References: PIL's BOX-then-BILINEAR resize (where ``side`` divides the size, the two area
filters coincide), SciPy's ``gaussian_filter`` and PIL's ``convert("L")`` grey.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.ndimage import gaussian_filter

from fl_secure.data.degrade import (
    Degradation,
    GreyBlur,
    LowResolution,
    Occlusion,
    degrade_dataset,
    degrade_tensor,
    grey_blur,
    low_resolution,
    occlusion,
    occlusion_box,
    parse_degradation,
)
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError, DataError


@pytest.fixture
def chip() -> np.ndarray:
    """A 150x150 RGB ``uint8`` image with no zero pixel (so occlusion is countable)."""
    return np.random.default_rng(0).integers(1, 256, (150, 150, 3), dtype=np.uint8)


def _pil(image: np.ndarray, low: tuple[int, int]) -> np.ndarray:
    """PIL, channel by channel in float: BOX down to ``low`` (w, h), BILINEAR back up."""
    h, w = image.shape[:2]
    return np.stack(
        [
            np.asarray(
                Image.fromarray(image[..., c].astype(np.float32), mode="F")
                .resize(low, Image.Resampling.BOX)
                .resize((w, h), Image.Resampling.BILINEAR)
            )
            for c in range(image.shape[2])
        ],
        axis=-1,
    )


# ------------------------------------------------------------------------- low resolution


def test_lowres_at_the_full_side_is_the_identity(chip: np.ndarray) -> None:
    assert np.array_equal(low_resolution(chip, 150), chip)
    floats = chip.astype(np.float64) + 0.25
    np.testing.assert_allclose(low_resolution(floats, 150), floats, atol=1e-9)


@pytest.mark.parametrize(
    ("shape", "side", "low"), [((150, 150), 30, (30, 30)), ((112, 92), 23, (23, 28))]
)
def test_lowres_is_pil_box_then_bilinear_where_side_divides_the_size(
    shape: tuple[int, int], side: int, low: tuple[int, int]
) -> None:
    image = np.random.default_rng(1).random((*shape, 3)) * 255
    out = low_resolution(image, side)
    assert out.shape == image.shape and out.dtype == np.float64
    np.testing.assert_allclose(out, _pil(image, low), atol=1e-3)


def test_lowres_output_is_set_by_the_side_by_side_block_means(chip: np.ndarray) -> None:
    # Prepare: a perturbation with zero mean over every 5x5 block (150 = 30 blocks of 5)
    rng = np.random.default_rng(2)
    noise = rng.normal(size=(30, 5, 30, 5, 3))
    noise -= noise.mean(axis=(1, 3), keepdims=True)
    image = chip.astype(np.float64)
    # Execute
    out = low_resolution(image, 30)
    perturbed = low_resolution(image + noise.reshape(150, 150, 3), 30)
    # Assert: the same 30x30 block means give the same image
    np.testing.assert_allclose(perturbed, out, atol=1e-9)


@pytest.mark.parametrize("side", [24, 40])
def test_lowres_has_rank_side_and_uint8_only_adds_rounding(chip: np.ndarray, side: int) -> None:
    exact = low_resolution(chip.astype(np.float64), side)
    rounded = low_resolution(chip, side)
    assert rounded.dtype == np.uint8
    assert np.abs(rounded - exact).max() <= 0.5 + 1e-9  # rounded once, at the end
    for c in range(3):
        singular = np.linalg.svd(exact[..., c], compute_uv=False)
        assert singular[side:].max() <= 1e-9 * singular[0]  # at most side x side free values
        tail = np.linalg.svd(rounded[..., c].astype(np.float64), compute_uv=False)[side:]
        assert np.sqrt((tail**2).sum()) <= 0.5 * 150  # Eckart-Young: ||rounding||_F <= 75


def test_lowres_larger_than_the_image_is_refused(chip: np.ndarray) -> None:
    with pytest.raises(DataError, match=r"lowres:151 needs a side in \[1, 150\]"):
        low_resolution(chip, 151)


# ------------------------------------------------------------------------- grey and blur


def test_grey_is_bt601_luma_on_equal_channels(chip: np.ndarray) -> None:
    grey = grey_blur(chip, 0.0)
    assert grey.dtype == np.uint8 and grey.shape == chip.shape
    assert np.array_equal(grey[..., 0], grey[..., 1]) and np.array_equal(grey[..., 0], grey[..., 2])
    pil = np.asarray(Image.fromarray(chip).convert("L"), dtype=np.int16)
    assert np.abs(grey[..., 0].astype(np.int16) - pil).max() <= 1  # PIL rounds in fixed point


@pytest.mark.parametrize("sigma", [0.5, 1.5, 4.0])
def test_blur_is_scipy_gaussian_filter(chip: np.ndarray, sigma: float) -> None:
    image = chip.astype(np.float64)
    out = grey_blur(image, sigma)
    reference = gaussian_filter(image @ np.array([0.299, 0.587, 0.114]), sigma)
    for c in range(3):
        np.testing.assert_allclose(out[..., c], reference, atol=1e-9)


# ------------------------------------------------------------------------- occlusion


@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.5])
def test_occlusion_covers_the_fraction_to_a_pixel(chip: np.ndarray, fraction: float) -> None:
    out = occlusion(chip, fraction, seed=7, key="Abdullah_Gul/0")
    black = np.all(out == 0, axis=-1)
    rows, cols = np.flatnonzero(black.any(axis=1)), np.flatnonzero(black.any(axis=0))
    assert black.sum() == rows.size * cols.size  # one solid rectangle
    side = np.sqrt(fraction) * 150
    assert abs(rows.size - side) <= 1 and abs(cols.size - side) <= 1
    assert np.array_equal(out[~black], chip[~black])  # nothing else touched
    top, left, bottom, right = occlusion_box(150, 150, fraction, seed=7, key="Abdullah_Gul/0")
    assert (top, left, bottom, right) == (rows[0], cols[0], rows[-1] + 1, cols[-1] + 1)


def test_occlusion_box_depends_on_seed_and_key_only(chip: np.ndarray) -> None:
    boxes = {occlusion_box(150, 150, 0.2, seed=0, key=f"p/{i}") for i in range(20)}
    assert len(boxes) >= 15  # different images, different boxes
    assert occlusion_box(150, 150, 0.2, seed=0, key="p/3") == occlusion_box(
        150, 150, 0.2, seed=0, key="p/3"
    )
    reseeded = {occlusion_box(150, 150, 0.2, seed=s, key="p/3") for s in range(10)}
    assert len(reseeded) >= 7  # another seed, other boxes
    batch = Degradation((Occlusion(0.2, 0),)).batch(np.stack([chip, chip]), ["p/1", "p/3"])
    assert np.array_equal(batch[1], occlusion(chip, 0.2, seed=0, key="p/3"))


def test_occlusion_without_a_key_is_refused(chip: np.ndarray) -> None:
    with pytest.raises(DataError, match="occlusion needs each image's key"):
        parse_degradation("occlusion:0.2")(chip)


# ------------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("none", Degradation()),
        ("", Degradation()),
        ("lowres:24", Degradation((LowResolution(24),))),
        (" greyblur:1.5 ", Degradation((GreyBlur(1.5),))),
        ("occlusion:0.25", Degradation((Occlusion(0.25, 0),))),
        (
            "lowres:32+greyblur:1+occlusion:0.1:3",
            Degradation((LowResolution(32), GreyBlur(1.0), Occlusion(0.1, 3))),
        ),
    ],
)
def test_specs_parse_and_round_trip(spec: str, expected: Degradation) -> None:
    assert parse_degradation(spec) == expected
    assert parse_degradation(expected.spec) == expected


@pytest.mark.parametrize(
    "spec",
    [
        "lowres",
        "lowres:0",
        "lowres:24.5",
        "lowres:24:2",
        "greyblur:-1",
        "greyblur:nan",
        "occlusion:1.0",
        "occlusion:0.1:-2",
        "blur:3",
        "lowres:24+",
    ],
)
def test_bad_specs_are_refused_naming_the_spec(spec: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"degradation spec '{re.escape(spec)}'.*expected 'none' or"
    ):
        parse_degradation(spec)


# ------------------------------------------------------------------------- tensors, data sets


def test_tensors_in_minus_one_one_agree_with_uint8_chips(chip: np.ndarray) -> None:
    degradation = parse_degradation("lowres:24+greyblur:1+occlusion:0.1")
    tensor = torch.from_numpy(chip.transpose(2, 0, 1)[None] / 127.5 - 1.0).float()
    out = degrade_tensor(degradation, tensor, ["a/0"])
    assert out.dtype == torch.float32 and out.shape == tensor.shape
    reference = torch.from_numpy(degradation(chip, "a/0").transpose(2, 0, 1)[None] / 127.5 - 1.0)
    assert (out.double() - reference).abs().max() <= 0.5 / 127.5 + 1e-6
    with pytest.raises(DataError, match="N keys"):
        degrade_tensor(degradation, tensor, ["a/0", "a/1"])


def test_dataset_keys_follow_identity_and_rank_not_position(chip: np.ndarray) -> None:
    image = torch.from_numpy(chip.transpose(2, 0, 1) / 127.5 - 1.0).float()
    both = FaceDataset(
        images=image.repeat(4, 1, 1, 1),
        labels=torch.tensor([0, 1, 1, 0]),
        identity_names=("ann", "bob"),
        source="test",
    )
    bob_only = both.subset([1, 2])
    degradation = parse_degradation("occlusion:0.2:5")
    out, out_bob = degrade_dataset(both, degradation), degrade_dataset(bob_only, degradation)
    assert torch.equal(out.images[1:3], out_bob.images)  # bob/0 and bob/1 wherever they sit
    assert not torch.equal(out.images[0], out.images[3])  # ann/0 and ann/1 differ
    assert torch.equal(out.labels, both.labels) and out.source == "test degraded occlusion:0.2:5"
    assert degrade_dataset(both, parse_degradation("none")) is both
