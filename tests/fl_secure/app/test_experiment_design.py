"""Grid design: one partition for every cell, paired differences against the baseline."""

from __future__ import annotations

from pathlib import Path

import pytest
from scipy import stats

from fl_secure.app.experiment import load_experiment, read_results, run_experiment
from fl_secure.config import load_config
from fl_secure.data.plan import plan_federation
from fl_secure.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]

BASE = """
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
GRID = (
    '[experiment]\nname = "tiny"\nbase = "base.toml"\nalgorithms = ["fedpe", "fedavg"]\n'
    'partitions = ["lognormal"]\nseeds = [0, 1, 2]\n'
)


def test_every_cell_of_a_grid_shares_one_partition(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "grid.toml").write_text(GRID)
    experiment = load_experiment(tmp_path / "grid.toml")
    # Execute
    configs = [load_config(experiment.base, experiment.cell_overrides(*cell))
               for cell in experiment.cells()]  # fmt: skip
    # Assert: partition.seed 0 everywhere (the default), run.seed per cell, one plan
    assert experiment.partition_seed == 0 and experiment.reference == "fedpe"
    assert {c.partition.seed for c in configs} == {0}
    assert [c.run.seed for c in configs] == [0, 1, 2, 0, 1, 2]
    manifests = [plan_federation(c).manifest() for c in configs[:3]]
    assert manifests[0] == manifests[1] == manifests[2]
    sizes = [len(m["clients"]["client-0"]["identities"]) for m in manifests]  # type: ignore[index]
    assert len(set(sizes)) == 1


def test_partition_seed_minus_one_redraws_per_seed(tmp_path: Path) -> None:
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "grid.toml").write_text(GRID + "partition_seed = -1\n")
    experiment = load_experiment(tmp_path / "grid.toml")
    configs = [load_config(experiment.base, experiment.cell_overrides(*cell))
               for cell in experiment.cells()[:2]]  # fmt: skip
    assert all(c.partition.seed == -1 for c in configs)
    assert plan_federation(configs[0]).manifest() != plan_federation(configs[1]).manifest()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('baseline = "fedgc"', "experiment.baseline = 'fedgc' is not one of"),
        ("partition_seed = -2", "experiment.partition_seed = -2: expected an integer"),
        ("partition_seed = true", "experiment.partition_seed = True: expected an integer"),
        ('partition_seed = "0"', "experiment.partition_seed = '0': expected an integer"),
        ('set = ["partition.seed=3"]', "experiment.set holds partition.seed"),
    ],
)
def test_bad_design_keys_are_named(tmp_path: Path, extra: str, message: str) -> None:
    (tmp_path / "grid.toml").write_text(GRID + extra + "\n")
    with pytest.raises(ConfigError, match=message):
        load_experiment(tmp_path / "grid.toml")


def test_a_tiny_grid_reports_paired_differences_from_its_own_rows(tmp_path: Path) -> None:
    # Prepare: 2 algorithms x 1 partition x 3 seeds, baseline fedavg (not the first)
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "grid.toml").write_text(GRID + 'baseline = "fedavg"\n')
    # Execute
    run_experiment(load_experiment(tmp_path / "grid.toml"), tmp_path / "out")
    # Assert: the section's figures are those of results.csv, paired by seed
    table = read_results(tmp_path / "out" / "results.csv")
    value = {(r["algorithm"], int(r["seed"])): float(r["tar_at_far_1e-2"]) for r in table}
    diffs = [value["fedpe", s] - value["fedavg", s] for s in (0, 1, 2)]
    mean = sum(diffs) / 3
    low, high = stats.t.interval(0.95, 2, loc=mean, scale=stats.sem(diffs))
    md = (tmp_path / "out" / "results.md").read_text()
    assert "one partition for every cell (partition.seed = 0)" in md
    assert "## Paired differences against fedavg (held-out TAR@FAR=1e-2)" in md
    paired = md.split("## Paired differences")[1].split("\n## ")[0]
    (line,) = [x for x in paired.splitlines() if x.startswith("| fedpe | lognormal | ")]
    figures = line.strip("| ").replace("[", "").replace("]", "").replace(",", " |").split(" | ")[2:]
    assert [float(f) for f in figures] == pytest.approx([mean, low, high, 3], abs=6e-5)


def test_shipped_grids_use_five_seeds_and_one_partition() -> None:
    for path in sorted((ROOT / "examples" / "experiments").glob("*.toml")):
        experiment = load_experiment(path)
        assert len(experiment.seeds) >= 5, path.name
        assert experiment.partition_seed >= 0, path.name
