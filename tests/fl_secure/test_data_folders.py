"""Identity-folder loader: real ORL / LFW layouts and hand-made folders with known pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fl_secure.data.folders import (
    list_identity_folders,
    load_identity_folders,
    load_image,
    natural_key,
)
from fl_secure.errors import DataError

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _needs(folder: str) -> Path:
    path = SHARED / folder
    if not path.is_dir():
        pytest.skip(f"shared test data {path} is not available")
    return path


def _write(path: Path, value: int, size: tuple[int, int] = (20, 20), mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fill: int | tuple[int, int, int] = value if mode == "L" else (value, 255 - value, value // 2)
    Image.new(mode, size, fill).save(path)


def test_natural_key_orders_digit_runs_by_value() -> None:
    names = ["s10", "s2", "s1", "10.pgm", "2.pgm", "1.pgm"]
    assert sorted(names, key=natural_key) == ["1.pgm", "2.pgm", "10.pgm", "s1", "s2", "s10"]


def test_orl_loads_40_identities_of_10_grayscale_images() -> None:
    data = load_identity_folders(_needs("orl"), image_size=64)
    assert len(data) == 400 and data.num_identities == 40
    assert data.identity_names[:3] == ("s1", "s2", "s3")
    assert data.identity_names[-1] == "s40"
    np.testing.assert_array_equal(data.labels.numpy(), np.repeat(np.arange(40), 10))
    assert data.images.shape == (400, 3, 64, 64) and data.images.dtype == torch.float32
    assert -1.0 <= float(data.images.min()) and float(data.images.max()) <= 1.0
    # grayscale replicated to RGB
    assert torch.equal(data.images[:, 0], data.images[:, 1])
    assert torch.equal(data.images[:, 1], data.images[:, 2])
    assert float(data.images.std()) > 0.2  # real content, not a constant


def test_names_with_the_same_natural_key_keep_one_order(tmp_path: Path) -> None:
    # 's1' and 's01' (and '1.pgm', '01.pgm') tie under natural_key: the listing order of the
    # file system must not decide the labels, so two folders created in opposite orders agree
    from fl_secure.data.folders import list_identity_folders

    orders = []
    for k, names in enumerate((("s1", "s01"), ("s01", "s1"))):
        root = tmp_path / str(k)
        for name in names:
            (root / name).mkdir(parents=True)
            for image in ("s1.pgm", "1.pgm", "01.pgm", "s01.pgm"):
                (root / name / image).write_bytes(b"P5 1 1 255 x")
        found = list_identity_folders(root)
        orders.append([(who, [p.name for p in files]) for who, files in found])
    assert orders[0] == orders[1]
    assert [who for who, _ in orders[0]] == ["s01", "s1"]
    assert orders[0][0][1] == ["01.pgm", "1.pgm", "s01.pgm", "s1.pgm"]


def test_orl_files_in_natural_order() -> None:
    root = _needs("orl")
    data = load_identity_folders(root, image_size=32, max_identities=2)
    assert len(data) == 20 and data.identity_names == ("s1", "s2")
    for position, number in ((1, 2), (9, 10)):
        expected = load_image(root / "s1" / f"{number}.pgm", image_size=32)
        assert torch.equal(data.images[position], torch.from_numpy(expected))


def test_lfw_min10_cap20_loads_158_identities_2541_images() -> None:
    data = load_identity_folders(_needs("lfw_min10_cap20"), image_size=32, center_crop=150)
    assert data.num_identities == 158 and len(data) == 2541
    counts = np.bincount(data.labels.numpy())
    assert counts.min() == 10 and counts.max() == 20
    assert list(data.identity_names) == sorted(data.identity_names, key=natural_key)
    assert not torch.equal(data.images[:, 0], data.images[:, 2])  # colour kept


def test_filters_min_max_images_and_identities(tmp_path: Path) -> None:
    for name, count in (("a", 3), ("b", 1), ("c", 5), ("d", 4)):
        for i in range(count):
            _write(tmp_path / name / f"{i}.png", 10 * i)
    data = load_identity_folders(
        tmp_path, image_size=8, min_images_per_identity=3, max_images_per_identity=4,
        max_identities=2,
    )  # fmt: skip
    assert data.identity_names == ("a", "c")
    np.testing.assert_array_equal(data.labels.numpy(), [0, 0, 0, 1, 1, 1, 1])


def test_files_in_natural_order_with_known_pixels(tmp_path: Path) -> None:
    for i in (10, 2, 1):
        _write(tmp_path / "p" / f"{i}.png", 20 * i, mode="L")
    _write(tmp_path / "p" / ".hidden.png", 255, mode="L")
    (tmp_path / "p" / "notes.txt").write_text("not an image")
    (tmp_path / "README").write_text("files in the root are ignored")
    data = load_identity_folders(tmp_path, image_size=8)
    means = ((data.images.mean(dim=(1, 2, 3)) + 1) * 127.5).numpy()
    np.testing.assert_allclose(means, [20, 40, 200], atol=0.01)


def test_non_square_padded_and_center_crop(tmp_path: Path) -> None:
    # 40x20 white image: padding to 40x40 with the border colour keeps it white
    _write(tmp_path / "x" / "1.png", 255, size=(40, 20), mode="L")
    padded = load_identity_folders(tmp_path, image_size=10)
    assert torch.allclose(padded.images, torch.ones_like(padded.images))
    # a white square inside black: the centre crop sees only white
    img = Image.new("RGB", (30, 30), (0, 0, 0))
    img.paste((255, 255, 255), (10, 10, 20, 20))
    img.save(tmp_path / "x" / "1.png")
    cropped = load_identity_folders(tmp_path, image_size=10, center_crop=10)
    assert torch.allclose(cropped.images, torch.ones_like(cropped.images))
    with pytest.raises(DataError, match="center_crop=31 exceeds"):
        load_identity_folders(tmp_path, image_size=10, center_crop=31)


def test_missing_root_and_empty_folders(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_identity_folders(tmp_path / "nope")
    with pytest.raises(DataError, match="no identity folders"):
        load_identity_folders(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"identity folder .*empty holds no images"):
        load_identity_folders(tmp_path)


def test_unreadable_image_is_named(tmp_path: Path) -> None:
    _write(tmp_path / "a" / "1.png", 5)
    (tmp_path / "a" / "2.jpg").write_bytes(b"this is not a jpeg")
    with pytest.raises(DataError, match=r"cannot read image .*a/2\.jpg"):
        load_identity_folders(tmp_path)


def test_an_image_header_claiming_a_huge_size_is_named(tmp_path: Path) -> None:
    # A PNG whose header declares 20000 x 20000 pixels: PIL refuses it as a decompression
    # bomb, an error that is neither OSError nor ValueError
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
    _write(tmp_path / "a" / "1.png", 5)
    (tmp_path / "a" / "2.png").write_bytes(bomb)
    with pytest.raises(DataError, match=r"cannot read image .*a/2\.png.*exceeds limit"):
        list_identity_folders(tmp_path, check_headers=True)
    with pytest.raises(DataError, match=r"cannot read image .*a/2\.png.*exceeds limit"):
        load_image(tmp_path / "a" / "2.png", image_size=16)


def test_grayscale_rejected_when_conversion_is_off(tmp_path: Path) -> None:
    _write(tmp_path / "a" / "1.png", 5, mode="L")
    with pytest.raises(DataError, match="grayscale"):
        load_identity_folders(tmp_path, grayscale_to_rgb=False)


def test_too_few_images_everywhere(tmp_path: Path) -> None:
    _write(tmp_path / "a" / "1.png", 5)
    with pytest.raises(DataError, match="min_images_per_identity"):
        load_identity_folders(tmp_path, min_images_per_identity=2)
    with pytest.raises(DataError, match="image_size must be >= 8"):
        load_identity_folders(tmp_path, image_size=4)


def test_listing_names_what_loading_would_load_without_decoding(tmp_path: Path) -> None:
    for person, count in (("b", 3), ("a", 2), ("c", 1)):
        for i in range(count):
            _write(tmp_path / person / f"{i}.png", 10 * i)
    listed = list_identity_folders(tmp_path, min_images_per_identity=2, check_headers=True)
    loaded = load_identity_folders(tmp_path, image_size=8, min_images_per_identity=2)
    assert [name for name, _ in listed] == list(loaded.identity_names) == ["a", "b"]
    assert sum(len(files) for _, files in listed) == len(loaded) == 5
    # a file with an image suffix that is not an image: found by its header, named
    (tmp_path / "a" / "9.png").write_bytes(b"not a png at all")
    assert len(list_identity_folders(tmp_path)) == 3  # without headers: not opened
    with pytest.raises(DataError, match=r"cannot read image .*a/9.png"):
        list_identity_folders(tmp_path, check_headers=True)


def test_a_client_refuses_bad_data_before_it_dials(tmp_path: Path, capsys) -> None:
    from fl_secure.app.cli import main

    # port 1 on loopback: a client that got as far as dialling would retry for minutes
    base = ["client", "--server", "127.0.0.1:1", "--id", "site-a", "--insecure", "--quiet"]
    assert main([*base, "--data", str(tmp_path / "nope")]) == 2
    assert "data root" in capsys.readouterr().err
    (tmp_path / "faces" / "alice").mkdir(parents=True)
    (tmp_path / "faces" / "alice" / "1.jpg").write_text("not a jpeg")
    assert main([*base, "--data", str(tmp_path / "faces")]) == 2
    assert "cannot read image" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main([*base, "--data", str(tmp_path / "faces"), "--threads", "0"])
    assert exited.value.code == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".png", ".tif", ".pgm"])
def test_16_bit_grayscale_is_scaled_not_clipped(tmp_path: Path, suffix: str) -> None:
    # Prepare: the same gradient at 16 and at 8 bits
    ramp = np.tile(np.linspace(0, 65535, 32).round().astype(np.uint16), (32, 1))
    deep = tmp_path / f"deep{suffix}"
    Image.fromarray(ramp).save(deep)  # uint16: mode I;16
    shallow = tmp_path / "shallow.png"
    Image.fromarray((ramp // 257).astype(np.uint8)).save(shallow)
    # Execute
    found = load_image(deep, image_size=32)
    expected = load_image(shallow, image_size=32)
    # Assert: within one 8-bit level of the 8-bit image (a clipped image would be white)
    assert np.abs(found - expected).max() <= 1.0 / 127.5 + 1e-6
    assert found.mean() == pytest.approx(0.0, abs=0.02)


def test_a_crop_below_one_pixel_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "face.png"
    Image.fromarray(np.full((8, 8), 100, np.uint8)).save(path)
    for crop in (0, -10):
        with pytest.raises(DataError, match=f"center_crop={crop}: give a side >= 1"):
            load_image(path, image_size=8, center_crop=crop)


def test_a_cameras_exif_orientation_is_applied(tmp_path: Path) -> None:
    # Prepare: a 16x8 picture stored sideways, with EXIF orientation 6 (rotate to view)
    pixels = np.zeros((8, 16, 3), np.uint8)
    pixels[:, :4] = 255  # a white band on the stored image's left edge
    stored = Image.fromarray(pixels)
    exif = stored.getexif()
    exif[0x0112] = 6  # Orientation: the viewer rotates it 90 degrees clockwise
    tagged = tmp_path / "tagged.png"
    stored.save(tagged, exif=exif)
    upright = tmp_path / "upright.png"
    stored.transpose(Image.Transpose.ROTATE_270).save(upright)  # what a viewer shows
    # Execute / Assert: loaded as the viewer shows it (the band on top), not as stored
    found = load_image(tagged, image_size=16)
    assert np.array_equal(found, load_image(upright, image_size=16))
    assert found[:, :4, 4:12].min() > 0.9 and found[:, 8:, 4:12].max() < -0.9  # band on top
