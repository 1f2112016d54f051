"""Experiment grids: parsing, one simulated run per cell, CSV and Markdown tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_secure.errors import ConfigError
from fl_secure.experiment import load_experiment, read_results, run_experiment

ROOT = Path(__file__).resolve().parents[2]

BASE = """
[run]
seed = 0
[data]
image_size = 32
num_identities = 30
images_per_identity = 6
held_out_identities = 6
[partition]
num_clients = 3
[model]
backbone = "cnn-small"
embedding_size = 32
[train]
rounds = 1
local_steps = 2
batch_size = 8
optimizer = "adam"
lr = 0.001
[server]
min_clients = 3
"""


def test_grid_runs_every_cell_and_writes_both_tables(tmp_path: Path) -> None:
    # Prepare: 2 algorithms x 2 partitions x 1 seed on a tiny base config
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "grid.toml").write_text(
        '[experiment]\nname = "tiny"\nbase = "base.toml"\n'
        'algorithms = ["fedpe", "fedavg"]\npartitions = ["equal", "dirichlet"]\nseeds = [0]\n'
    )
    # Execute
    rows = run_experiment(load_experiment(tmp_path / "grid.toml"), tmp_path / "out")
    # Assert: one CSV row per cell with real figures; one Markdown row per (algorithm, partition)
    table = read_results(tmp_path / "out" / "results.csv")
    assert [(r["algorithm"], r["partition"]) for r in table] == [
        ("fedpe", "equal"), ("fedpe", "dirichlet"), ("fedavg", "equal"), ("fedavg", "dirichlet"),
    ]  # fmt: skip
    assert all(0.0 <= float(r["tar_at_far_1e-2"]) <= 1.0 for r in table)
    assert rows[0]["untrained_tar_at_far_1e-2"] is not None
    md = (tmp_path / "out" / "results.md").read_text()
    assert md.count("\n| fed") == 4 and "held-out TAR@FAR=1e-2" in md


def test_bad_experiment_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text('[experiment]\nbase = "x.toml"\nalgorithms = []\n')
    with pytest.raises(ConfigError, match="needs 'partitions'"):
        load_experiment(tmp_path / "a.toml")
    (tmp_path / "b.toml").write_text(
        '[experiment]\nbase = "x"\nalgorithms = ["fedpe"]\npartitions = []\nseeds = [0]\n'
    )
    with pytest.raises(ConfigError, match="partitions must be a non-empty list"):
        load_experiment(tmp_path / "b.toml")
    (tmp_path / "c.toml").write_text('[experiment]\nbasis = "x"\n')
    with pytest.raises(ConfigError, match="unknown key basis"):
        load_experiment(tmp_path / "c.toml")


def test_committed_experiments_parse_and_their_cells_load() -> None:
    from fl_secure.config import load_config

    for path in sorted((ROOT / "examples" / "experiments").glob("*.toml")):
        experiment = load_experiment(path)
        for algorithm, partition, seed in experiment.cells():
            cfg = load_config(experiment.base, [*experiment.overrides,
                              f"algorithm.name={algorithm}", f"partition.kind={partition}",
                              f"run.seed={seed}"])  # fmt: skip
            assert not cfg.privacy.enabled and not cfg.secure_aggregation.enabled
