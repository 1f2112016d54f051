"""A client joining with identity folders: designs it cannot run are refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from client.trainer_factory import ClientDataSource, trainer_factory
from fl_secure.errors import ConfigError
from fl_secure.messages import JoinReply

EXAMPLES = Path(__file__).parents[2] / "examples"


def _folders(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for person in ("ann", "bob"):
        (root / person).mkdir(parents=True)
        for k in range(4):
            pixels = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / person / f"{k}.png")
    return root


def _join(config: str) -> JoinReply:
    return JoinReply("client-0", "run", "0", run_config_toml=config)


#: As the server sends it: with the noise multiplier it calibrated (the file says 0, calibrate).
QUICKSTART = (
    (EXAMPLES / "quickstart.toml")
    .read_text()
    .replace("target_epsilon = 8.0\n", "target_epsilon = 8.0\nnoise_multiplier = 1.5\n", 1)
)
assert "noise_multiplier = 1.5" in QUICKSTART


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ((EXAMPLES / "fedaffect.toml").read_text(), "fedaffect needs an expression label"),
        (QUICKSTART.replace('name = "fedpe"', 'name = "fedavg"'), "fedavg shares a global head"),
    ],
)
def test_folder_clients_are_refused_by_what_the_design_needs(
    tmp_path: Path, config: str, message: str
) -> None:
    make = trainer_factory(ClientDataSource(data_path=_folders(tmp_path)), state_dir=None)
    with pytest.raises(ConfigError, match=message):
        make(_join(config))


def test_a_private_head_design_trains_on_the_folders(tmp_path: Path) -> None:
    make = trainer_factory(ClientDataSource(data_path=_folders(tmp_path)), state_dir=None)
    trainer = make(_join(QUICKSTART))
    assert trainer.strategy.name == "fedpe"
    assert trainer.data.train.identity_names == ("ann", "bob")
    assert trainer.model.head.weight.shape[0] == 2  # one private row per local identity


def test_a_damaged_private_state_is_named_and_kept(tmp_path: Path) -> None:
    # Prepare: the site's saved private layers were cut short (a full disk, say)
    from fl_secure.errors import CheckpointError

    state = tmp_path / "state"
    state.mkdir()
    damaged = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"
    (state / "private.safetensors").write_bytes(damaged)
    make = trainer_factory(ClientDataSource(data_path=_folders(tmp_path / "data")), state_dir=state)
    # Execute / Assert: a named error, not a traceback, and the file is left for restoring
    with pytest.raises(CheckpointError, match=r"private state .*private\.safetensors is damaged"):
        make(_join(QUICKSTART))
    assert (state / "private.safetensors").read_bytes() == damaged


def test_private_layers_are_kept_per_run_and_an_unkeyed_file_is_adopted_once(
    tmp_path: Path,
) -> None:
    from client.trainer import private_state_path

    state = tmp_path / "state"
    make = trainer_factory(ClientDataSource(data_path=_folders(tmp_path / "data")), state_dir=state)

    def join(run_id: str) -> torch.Tensor:
        trainer = make(JoinReply("client-0", run_id, "0", run_config_toml=QUICKSTART))
        return trainer.model.head.weight.detach().clone()

    # Prepare: run A's trainer saves a recognisable private head
    trainer = make(JoinReply("client-0", "run-a", "0", run_config_toml=QUICKSTART))
    fresh = trainer.model.head.weight.detach().clone()
    with torch.no_grad():
        trainer.model.head.weight.fill_(7.0)
    trainer._save_private()
    file_a = private_state_path(state, "run-a")
    saved_a = file_a.read_bytes()
    # Execute / Assert: a client restarted into run A gets its head back ...
    assert torch.all(join("run-a") == 7.0)
    # ... a new run in the same folder starts afresh, and run A's file is left as it was
    assert torch.equal(join("run-b"), fresh)
    assert file_a.read_bytes() == saved_a
    # An unkeyed private.safetensors (an older client's) is taken by the next run, once
    (state / "private.safetensors").write_bytes(saved_a)
    assert torch.all(join("run-c") == 7.0)
    assert not (state / "private.safetensors").exists()
    assert (state / "private.safetensors.adopted").read_bytes() == saved_a
    assert private_state_path(state, "run-c").read_bytes() == saved_a
    assert torch.equal(join("run-d"), fresh)
    assert private_state_path(state, "run-a").name.startswith("private-")


def test_a_folder_client_reads_its_images_with_the_runs_crop(tmp_path: Path) -> None:
    from fl_secure.data.folders import load_identity_folders

    folders = _folders(tmp_path / "data")
    config = QUICKSTART.replace("[data]\n", "[data]\ncenter_crop = 20\n", 1)
    trainer = trainer_factory(ClientDataSource(data_path=folders), state_dir=None)(_join(config))
    cropped = load_identity_folders(folders, image_size=64, center_crop=20)
    assert "center_crop=20" in trainer.data.train.source
    first = trainer.data.train
    expected = cropped.images[(cropped.labels == first.labels[0]).nonzero()[:, 0]]
    assert any(torch.equal(first.images[0], image) for image in expected)


def test_a_folder_client_degrades_its_images_as_the_run_says(tmp_path: Path) -> None:
    import tomllib

    from fl_secure.config import config_from_dict
    from fl_secure.data.folders import load_identity_folders
    from fl_secure.data.plan import degrade_for_run

    folders = _folders(tmp_path / "data")
    spec = "lowres:16+occlusion:0.2"
    config = QUICKSTART.replace("[data]\n", f'[data]\ndegrade = "{spec}"\n', 1)
    trainer = trainer_factory(ClientDataSource(data_path=folders), state_dir=None)(_join(config))
    run = config_from_dict(tomllib.loads(config))
    expected = degrade_for_run(
        load_identity_folders(folders, image_size=64), run.data, run.run.seed
    )
    first = trainer.data.train
    assert f"degraded {spec}" in first.source
    assert any(torch.equal(first.images[0], image) for image in expected.images)


def test_a_run_with_seeded_noise_is_joined_only_when_the_site_accepts_it(tmp_path: Path) -> None:
    # Prepare: the quickstart (client-level DP) with privacy.secure_rng = false: the noise
    # would be seeded from run.seed and the client id, both known to the server
    config = QUICKSTART.replace("[privacy]\n", "[privacy]\nsecure_rng = false\n", 1)
    assert "secure_rng = false" in config
    folders = _folders(tmp_path / "data")
    # Execute / Assert: refused by default, naming the setting and the way to accept it
    with pytest.raises(ConfigError, match="privacy.secure_rng = false.*--accept-seeded-noise"):
        trainer_factory(ClientDataSource(data_path=folders), state_dir=None)(_join(config))
    make = trainer_factory(
        ClientDataSource(data_path=folders), state_dir=None, accept_seeded_noise=True
    )
    assert make(_join(config)).privacy is not None
    # the secure default needs nothing
    assert trainer_factory(ClientDataSource(data_path=folders), state_dir=None)(_join(QUICKSTART))


def test_each_clients_private_head_starts_from_its_own_draw(tmp_path: Path) -> None:
    # Prepare: two sites of a FedPE run (private heads) built from the same run config
    make = trainer_factory(ClientDataSource(data_path=_folders(tmp_path)), state_dir=None)
    heads = []
    for cid in ("site-a", "site-b", "site-a"):
        trainer = make(JoinReply(cid, "run", "0", run_config_toml=QUICKSTART))
        assert not trainer.strategy.shares_head
        heads.append(trainer.model.head.weight.detach().clone())
    # Assert: the two sites' rows are unrelated draws (a shared seed made row i identical on
    # every site: cosine 1); the same site gets the same head again (reproducible)
    cos = torch.nn.functional.cosine_similarity(heads[0], heads[1], dim=1)
    assert heads[0].shape == heads[1].shape and cos.abs().max() < 0.9, cos
    assert torch.equal(heads[0], heads[2])
