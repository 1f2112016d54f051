"""A grid's shared pretrained start: public identities, one backbone, cached, same bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import fl_secure.app.experiment as experiment_module
import fl_secure.app.pretrain as pretrain_module
from fl_secure.algorithms.adafedfr import public_dataset
from fl_secure.app.experiment import load_experiment, read_results, run_experiment
from fl_secure.app.pretrain import public_faces
from fl_secure.config import Config, load_config
from fl_secure.data.plan import plan_federation
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError
from fl_secure.training import build_run_model

BASE = """
[data]
image_size = 32
num_identities = 30
images_per_identity = 6
held_out_identities = 6
[partition]
num_clients = 3
held_out_clients = 1
[model]
backbone = "cnn-small"
embedding_size = 32
[algorithm]
public_identities = 5
public_images_per_identity = 3
[train]
rounds = 1
local_steps = 2
batch_size = 8
optimizer = "adam"
lr = 0.001
[server]
min_clients = 3
"""
PRETRAIN = "identities = 12, images_per_identity = 4, held_out_identities = 3, passes = 1"
GRID = (
    '[experiment]\nname = "tiny"\nbase = "base.toml"\nalgorithms = ["fedpe", "fedavg"]\n'
    f'partitions = ["equal"]\nseeds = [0, 1]\npretrain = {{{PRETRAIN}}}\n'
)


def _grid(tmp_path: Path, grid: str = GRID) -> Path:
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "grid.toml").write_text(grid)
    return tmp_path / "grid.toml"


def _names(data: FaceDataset) -> set[str]:
    return {data.identity_names[int(label)] for label in data.labels}


def _digests(data: FaceDataset) -> set[str]:
    return {hashlib.sha256(image.numpy().tobytes()).hexdigest() for image in data.images}


def test_public_identities_are_disjoint_from_every_sites(tmp_path: Path) -> None:
    # Prepare: a cell of the grid and its plan (clients, held-out clients, held-out set)
    experiment = load_experiment(_grid(tmp_path))
    assert experiment.pretrain is not None
    cell = load_config(experiment.base, experiment.cell_overrides("adafedfr", "equal", 1))
    plan = plan_federation(cell)
    sites = [plan.held_out] + [s for c in [*plan.clients, *plan.held_out_clients]
                               for s in (c.train, c.test)]  # fmt: skip
    # Execute
    public = public_faces(cell, experiment.pretrain)
    # Assert: the sites hold identities 0..29 of the data seed, the public set 30..41 of the
    # same seed (an identity depends only on (seed, index)): no name, no image in common
    site_names = set().union(*(_names(s) for s in sites))
    assert len(site_names) == 30 and len(_names(public)) == 12
    assert site_names.isdisjoint(_names(public))
    assert max(site_names) == "synthetic-000029" and min(_names(public)) == "synthetic-000030"
    assert cell.data_seed == 0 and public.source.startswith("synthetic(seed=0,")
    assert set().union(*(_digests(s) for s in sites)).isdisjoint(_digests(public))
    # AdaFedFR's public set (its R) is the first identities of the same public faces, bit
    # for bit, whatever the cell's run.seed
    shared = public_dataset(cell)
    assert _names(shared) == {f"synthetic-{k:06d}" for k in range(30, 35)}
    assert _digests(shared) <= _digests(public)


def test_every_cell_starts_from_the_same_pretrained_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: record every cell's config as the grid simulates it
    seen: list[Config] = []
    simulate = experiment_module.simulate

    def recording(config: Config, **options: Any) -> Any:
        seen.append(config)
        return simulate(config, **options)

    monkeypatch.setattr(experiment_module, "simulate", recording)
    # Execute
    run_experiment(load_experiment(_grid(tmp_path)), tmp_path / "out")
    # Assert: 4 cells (2 algorithms x seeds 0, 1), one weights file, one initial backbone
    files = sorted((tmp_path / "out" / "pretrain").glob("*/backbone.safetensors"))
    assert len(files) == 1 and len(seen) == 4
    assert {c.model.pretrained for c in seen} == {str(files[0].resolve())}
    assert sorted(c.run.seed for c in seen) == [0, 0, 1, 1]
    saved = load_file(files[0])
    for config in seen:
        state = build_run_model(config, 3).backbone.state_dict()
        assert state.keys() == saved.keys()
        assert all(torch.equal(state[k], saved[k]) for k in saved)
    # the control: without the pretraining, seeds 0 and 1 start from different weights
    bare = [
        build_run_model(load_config(tmp_path / "base.toml", [f"run.seed={s}"]), 3).backbone
        for s in (0, 1)
    ]
    assert not all(
        torch.equal(a, b)
        for a, b in zip(bare[0].state_dict().values(), bare[1].state_dict().values(), strict=True)
    )
    # every cell's initial model scores the same on the held-out identities
    table = read_results(tmp_path / "out" / "results.csv")
    assert len({r["untrained_tar_at_far_1e-2"] for r in table}) == 1
    md = (tmp_path / "out" / "results.md").read_text()
    assert "Start: every cell loads one backbone pretrained centrally" in md
    assert hashlib.sha256(files[0].read_bytes()).hexdigest()[:16] in md


def test_a_rerun_reuses_the_cached_backbone_and_a_change_trains_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a first run trains and caches the backbone
    one_cell = GRID.replace('["fedpe", "fedavg"]', '["fedavg"]').replace("[0, 1]", "[0]")
    path = _grid(tmp_path, one_cell)
    run_experiment(load_experiment(path), tmp_path / "out")
    (first,) = (tmp_path / "out" / "pretrain").glob("*/backbone.safetensors")
    before = first.read_bytes()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the cached backbone was trained again")

    monkeypatch.setattr(pretrain_module, "train_centralized_model", refuse)
    # Execute: the same grid again
    run_experiment(load_experiment(path), tmp_path / "out", overwrite=True)
    # Assert: nothing trained, the same file and bytes
    assert list((tmp_path / "out" / "pretrain").glob("*/backbone.safetensors")) == [first]
    assert first.read_bytes() == before
    # another pretraining setting is another key: it trains (here: refused by the patch)
    path.write_text(one_cell.replace("passes = 1", "passes = 2"))
    with pytest.raises(AssertionError, match="trained again"):
        run_experiment(load_experiment(path), tmp_path / "out", overwrite=True)


@pytest.mark.parametrize(
    ("pretrain", "extra", "message"),
    [
        ("passes = 0", "", "experiment.pretrain.passes = 0: expected an integer >= 1"),
        ("identities = 4, held_out_identities = 4", "", "held_out_identities = 4"),
        ("images_per_identity = 1", "", "images_per_identity must be >= 2"),
        ("epochs = 3", "", "unknown key epochs in [experiment.pretrain]"),
        ('set = ["data.num_identities=9"]', "", "the pretraining takes the grid's model"),
        ('set = ["model.embedding_size=9"]', "", "the pretraining takes the grid's model"),
        ("", 'set = ["model.pretrained=w.safetensors"]', "give one start"),
    ],
)
def test_bad_pretrain_tables_are_refused(
    tmp_path: Path, pretrain: str, extra: str, message: str
) -> None:
    grid = GRID.replace(PRETRAIN, pretrain) + extra + "\n"
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_experiment(_grid(tmp_path, grid))


def test_committed_grids_pretrain_and_their_cpu_copies_start_alike() -> None:
    # the CPU-sized copies in examples/experiments/cpu/ change rounds, not the pretraining
    from fl_secure.app.pretrain import cache_key, pretrain_config, public_settings

    folder = Path(__file__).resolve().parents[3] / "examples" / "experiments"
    keys = {}
    for path in sorted([*folder.glob("*.toml"), *folder.glob("cpu/*.toml")]):
        experiment = load_experiment(path)
        if experiment.pretrain is None:
            continue
        cell = load_config(experiment.base, experiment.cell_overrides(*experiment.cells()[0]))
        config = pretrain_config(experiment.base, experiment.grid_overrides(), experiment.pretrain)
        public = public_settings(cell, experiment.pretrain)
        assert public.first_identity == cell.data.num_identities and public.seed == 0
        assert config.train.rounds == experiment.pretrain.passes and not config.privacy.enabled
        keys[str(path.relative_to(folder))] = cache_key(config, public)
    assert len(keys) == 12
    for name in ("fedpe_vs_fedavg", "fedgc_vs_fedpe", "adafedfr_vs_fedavg", "hfmaml_partitions"):
        assert keys[f"{name}.toml"] == keys[f"cpu/{name}.toml"]
    # FedPE-vs-FedAvg, FedGC-vs-FedPE and the combined CPU grid share the quickstart model
    quickstart = keys["fedpe_vs_fedavg.toml"]
    assert keys["fedgc_vs_fedpe.toml"] == keys["cpu/quickstart_papers.toml"] == quickstart
    # the small stand-ins (FedPE, FedGC, AdaFedFR) start from the HF-MAML grid's backbone
    for small in ("fedpe_vs_fedavg_small", "fedgc_vs_fedpe_small", "adafedfr_vs_fedavg_small"):
        assert keys[f"cpu/{small}.toml"] == keys["hfmaml_partitions.toml"], small
