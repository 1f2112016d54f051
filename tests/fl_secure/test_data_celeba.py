"""CelebA's list_attr_celeba.txt / identity_CelebA.txt readers and identity-level attributes.

CelebA is not in ../shared/data, so the files are written in its exact format in a tmp dir
from synthetic faces and their attributes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fl_secure.config import load_config
from fl_secure.data.celeba import (
    identity_attributes,
    load_celeba,
    read_attribute_file,
    read_identity_file,
)
from fl_secure.data.plan import plan_federation
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError, DataError

# CelebA's 40 attribute names, in the file's order
NAMES = (
    "5_o_Clock_Shadow Arched_Eyebrows Attractive Bags_Under_Eyes Bald Bangs Big_Lips Big_Nose "
    "Black_Hair Blond_Hair Blurry Brown_Hair Bushy_Eyebrows Chubby Double_Chin Eyeglasses "
    "Goatee Gray_Hair Heavy_Makeup High_Cheekbones Male Mouth_Slightly_Open Mustache "
    "Narrow_Eyes No_Beard Oval_Face Pale_Skin Pointy_Nose Receding_Hairline Rosy_Cheeks "
    "Sideburns Smiling Straight_Hair Wavy_Hair Wearing_Earrings Wearing_Hat Wearing_Lipstick "
    "Wearing_Necklace Wearing_Necktie Young"
).split()


def _celeba_values(data: FaceDataset) -> np.ndarray:
    """[N, 40] in {1, -1}: synthetic attributes where CelebA has them, seeded noise elsewhere."""
    a = data.attributes
    known = {
        "Male": a["male"], "Eyeglasses": a["glasses"], "Wearing_Hat": a["hat"],
        "No_Beard": ~a["beard"], "Gray_Hair": a["hair_colour"] == 5, "Young": a["age"] == 0,
        "Smiling": a["smile"], "Bushy_Eyebrows": a["bushy_eyebrows"],
    }  # fmt: skip
    noise = np.random.default_rng(7).random((len(data), len(NAMES))) < 0.5
    present = np.stack([known.get(n, noise[:, j]) for j, n in enumerate(NAMES)], axis=1)
    return np.where(present, 1, -1)


def write_celeba(root: Path, data: FaceDataset) -> tuple[Path, Path, Path, list[int]]:
    """Images (shuffled file order, not grouped by identity) and both annotation files."""
    images = root / "img_align_celeba"
    images.mkdir()
    order = np.random.default_rng(3).permutation(len(data))  # file k+1 shows image order[k]
    values = _celeba_values(data)
    attr_lines = [str(len(data)), " ".join(NAMES)]
    id_lines = []
    for k, i in enumerate(order):
        name = f"{k + 1:06d}.png"  # lossless, so the pixels can be compared
        pixels = ((data.images[i].numpy().transpose(1, 2, 0) + 1) * 127.5).round()
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(images / name)
        attr_lines.append(name + "".join(f" {v:2d}" for v in values[i]))
        id_lines.append(f"{name} {1000 + 7 * int(data.labels[i])}")  # sparse identity numbers
    (root / "list_attr_celeba.txt").write_text("\n".join(attr_lines) + "\n")
    (root / "identity_CelebA.txt").write_text("\n".join(id_lines) + "\n")
    return images, root / "list_attr_celeba.txt", root / "identity_CelebA.txt", order.tolist()


@pytest.fixture(scope="module")
def synthetic() -> FaceDataset:
    return generate_synthetic_faces(SyntheticFaceConfig(16, 5, image_size=32, seed=2))


def test_majority_is_strict_and_per_identity(tmp_path: Path) -> None:
    # Prepare: identity 7 has Eyeglasses on 2 of 3 images, identity 8 on 1 of 2 (a tie)
    (tmp_path / "attr.txt").write_text(
        "5\nEyeglasses Male\na.jpg 1 1\nb.jpg 1 1\nc.jpg -1 1\nd.jpg 1 -1\ne.jpg -1 -1\n"
    )
    (tmp_path / "id.txt").write_text("a.jpg 7\nb.jpg 7\nc.jpg 7\nd.jpg 8\ne.jpg 8\nz.jpg 9\n")
    # Execute
    table = read_attribute_file(tmp_path / "attr.txt")
    attrs = identity_attributes(table, read_identity_file(tmp_path / "id.txt"))
    # Assert: 1/-1 read as 1/0; 2 of 3 is a majority, 1 of 2 is not; z.jpg has no attributes
    assert table.names == ("Eyeglasses", "Male")
    assert table.values.tolist() == [[1, 1], [1, 1], [0, 1], [1, 0], [0, 0]]
    assert attrs == {7: {"Eyeglasses": 1, "Male": 1}, 8: {"Eyeglasses": 0, "Male": 0}}


def test_load_celeba_groups_images_and_attributes_by_identity(
    tmp_path: Path, synthetic: FaceDataset
) -> None:
    # Prepare
    folder, attr_file, id_file, order = write_celeba(tmp_path, synthetic)
    # Execute
    data = load_celeba(folder, attr_file, id_file, image_size=32)
    # Assert: 16 identities in increasing identity number, 5 images each
    assert data.identity_names == tuple(str(1000 + 7 * k) for k in range(16))
    assert np.bincount(data.labels.numpy()).tolist() == [5] * 16
    # the images are the synthetic ones (PNG: 8-bit quantisation only), in file order
    first = [order[k] for k in range(len(order)) if int(synthetic.labels[order[k]]) == 0]
    np.testing.assert_allclose(data.images[:5], synthetic.images[first], atol=1 / 127.5 + 1e-6)
    # attributes are constant per identity and equal the strict majority of its images
    glasses = synthetic.attributes["glasses"].reshape(16, 5)
    assert data.attributes["Eyeglasses"].reshape(16, 5).tolist() == [
        [int(2 * row.sum() > 5)] * 5 for row in glasses
    ]
    male = synthetic.attributes["male"].reshape(16, 5)[:, 0]
    assert data.attributes["Male"][::5].tolist() == male.astype(int).tolist()
    assert set(data.attributes) == set(NAMES)


def test_celeba_config_feeds_the_attribute_partition(
    tmp_path: Path, synthetic: FaceDataset
) -> None:
    # Prepare: a run config naming the files relative to itself
    write_celeba(tmp_path, synthetic)
    (tmp_path / "run.toml").write_text(
        '[data]\nsource = "celeba"\npath = "img_align_celeba"\nimage_size = 32\n'
        'attributes_file = "list_attr_celeba.txt"\nidentities_file = "identity_CelebA.txt"\n'
        "held_out_identities = 0\n"
        '[partition]\nkind = "attribute"\nnum_clients = 2\nheld_out_clients = 1\n'
        'clients = ["Male=1 & Eyeglasses=0", "Male=0", "Male=1 & Eyeglasses=1"]\n'
        "[server]\nmin_clients = 2\n"
    )
    # Execute
    plan = plan_federation(load_config(tmp_path / "run.toml"))
    # Assert: each client holds exactly its predicate's identities, disjoint across clients
    truth = identity_attributes(
        read_attribute_file(tmp_path / "list_attr_celeba.txt"),
        read_identity_file(tmp_path / "identity_CelebA.txt"),
    )
    ordered = [truth[n] for n in sorted(truth)]  # label k <-> k-th identity number
    wanted = [
        {k for k, t in enumerate(ordered) if t["Male"] and not t["Eyeglasses"]},
        {k for k, t in enumerate(ordered) if not t["Male"]},
        {k for k, t in enumerate(ordered) if t["Male"] and t["Eyeglasses"]},
    ]
    shares = [*plan.clients, *plan.held_out_clients]
    held = [
        set(np.concatenate([s.train.labels.numpy(), s.test.labels.numpy()]).tolist())
        for s in shares
    ]
    assert all(wanted)  # every predicate matches someone, so the test is not vacuous
    assert held == wanted
    assert set(plan.train_identities.tolist()) == wanted[0] | wanted[1]


def test_bad_celeba_files_are_refused(tmp_path: Path) -> None:
    cases = {
        "3\nA B\nx.jpg 1 -1\n": "count line says 3 images, the file has 1",
        "1\nA B\nx.jpg 1\n": "expected a file name and 2 values",
        "1\nA B\nx.jpg 1 0\n": "must be 1 or -1",
        "2\nA B\nx.jpg 1 1\nx.jpg 1 1\n": "listed twice",
        "many\nA\n": "first line must be the image count",
    }
    for text, message in cases.items():
        (tmp_path / "attr.txt").write_text(text)
        with pytest.raises(DataError, match=message):
            read_attribute_file(tmp_path / "attr.txt")
    (tmp_path / "id.txt").write_text("x.jpg seven\n")
    with pytest.raises(DataError, match="expected 'filename identity'"):
        read_identity_file(tmp_path / "id.txt")
    (tmp_path / "run.toml").write_text('[data]\nsource = "celeba"\npath = "imgs"\n')
    with pytest.raises(ConfigError, match="data.attributes_file"):
        load_config(tmp_path / "run.toml")


def test_an_identity_number_with_a_non_ascii_digit_is_named(tmp_path: Path) -> None:
    # '²' passes str.isdigit but not int(): a DataError naming the line, not a traceback
    (tmp_path / "id.txt").write_text("a.jpg 7\nb.jpg \u00b2\n")
    with pytest.raises(DataError, match=r"id.txt line 2: expected 'filename identity', got"):
        read_identity_file(tmp_path / "id.txt")
    (tmp_path / "id.txt").write_text("a.jpg 7\nb.jpg -3\n")
    assert read_identity_file(tmp_path / "id.txt") == {"a.jpg": 7, "b.jpg": -3}


def test_a_doubled_sign_or_a_non_utf8_file_is_named(tmp_path: Path) -> None:
    # '--5' passes a check that strips every '-' but not int(); a Latin-1 byte is not UTF-8:
    # both are DataErrors naming the file, not tracebacks
    (tmp_path / "id.txt").write_text("a.jpg 7\nb.jpg --5\n")
    with pytest.raises(DataError, match=r"id.txt line 2: expected 'filename identity'"):
        read_identity_file(tmp_path / "id.txt")
    (tmp_path / "id.txt").write_bytes(b"a.jpg 7\n\xe9.jpg 8\n")
    with pytest.raises(DataError, match=r"id.txt is not a UTF-8 text file"):
        read_identity_file(tmp_path / "id.txt")
    (tmp_path / "attr.txt").write_bytes(b"1\nA\n\xff.jpg 1\n")
    with pytest.raises(DataError, match=r"attr.txt is not a UTF-8 text file"):
        read_attribute_file(tmp_path / "attr.txt")


def test_the_loader_filters_are_checked_for_celeba_too(
    tmp_path: Path, synthetic: FaceDataset
) -> None:
    # a negative cap would slice files[:-1] and never stop at -1 identities; a cap below the
    # minimum would cut every kept identity under it: refused, as for identity folders
    folder, attr_file, id_file, _ = write_celeba(tmp_path, synthetic)
    for kwargs, message in (
        ({"max_images_per_identity": -1}, "max_images_per_identity must be >= 1, got -1"),
        ({"max_identities": -2}, "max_identities must be >= 1, got -2"),
        ({"max_images_per_identity": 2, "min_images_per_identity": 3}, "is below"),
    ):
        with pytest.raises(DataError, match=message):
            load_celeba(folder, attr_file, id_file, image_size=32, **kwargs)  # type: ignore[arg-type]
    # the same values in a run config are refused when it is read
    for key, value in (
        ("max_images_per_identity", -1),
        ("max_identities", -2),
        ("max_images_per_identity", 1),  # below the default minimum of 2
        ("min_images_per_identity", 0),
        ("center_crop", -5),
    ):
        (tmp_path / "run.toml").write_text(
            f'[data]\nsource = "folders"\npath = "x"\n{key} = {value}\n'
        )
        with pytest.raises(ConfigError, match=f"data.{key}: invalid value"):
            load_config(tmp_path / "run.toml")
