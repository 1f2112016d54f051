"""Experiment grids: parsing, one simulated run per cell, CSV and Markdown tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_secure.app.experiment import (
    algorithm_overrides,
    load_experiment,
    read_results,
    run_experiment,
)
from fl_secure.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]

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
    main_table = md.split("\n## ")[0]  # the paired differences and groups follow it
    assert main_table.count("\n| fed") == 4 and "held-out TAR@FAR=1e-2" in main_table
    assert md.count("\n| fedavg | ") == 4  # + fedavg vs fedpe (the first), paired, per partition


def test_held_out_clients_and_variants_fill_the_paper_layout(tmp_path: Path) -> None:
    # Prepare: 2 clients that train, 2 that join after training; HF-MAML with Eq. 4 as a variant
    (tmp_path / "base.toml").write_text(
        BASE.replace("num_clients = 3", "num_clients = 2\nheld_out_clients = 2").replace(
            "min_clients = 3", "min_clients = 2"
        )
    )
    (tmp_path / "grid.toml").write_text(
        '[experiment]\nname = "tiny"\nbase = "base.toml"\nalgorithms = ["hfmaml+embedding_reg=0.5"]'
        '\npartitions = ["equal"]\nseeds = [0, 1]\nset = ["eval.tune_steps=2"]\nfar = "1e-1"\n'
    )
    experiment = load_experiment(tmp_path / "grid.toml")
    # Execute
    run_experiment(experiment, tmp_path / "out")
    # Assert: the entry's override reaches the config; every group has figures in [0, 1]
    from fl_secure.config import load_config

    overrides = experiment.cell_overrides("hfmaml+embedding_reg=0.5", "equal", 0)
    assert load_config(experiment.base, overrides).algorithm.embedding_reg == 0.5
    table = read_results(tmp_path / "out" / "results.csv")
    assert [r["algorithm"] for r in table] == ["hfmaml+embedding_reg=0.5"] * 2
    for row in table:
        for group in ("train_untuned", "train_tuned", "new_untuned", "new_tuned"):
            assert 0.0 <= float(row[f"{group}_tar_at_far_1e-1_mean"]) <= 1.0
            assert 0.0 <= float(row[f"{group}_tar_at_far_1e-1_std"]) <= 0.5  # std of [0, 1]
        # untuned training clients are the figures the existing columns already report
        assert row["train_untuned_tar_at_far_1e-2_mean"] == row["clients_tar_at_far_1e-2_mean"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "### equal" in md and "| train mean | new mean | train std | new std |" in md
    assert md.count("| untuned | hfmaml+embedding_reg=0.5 |") == 1
    assert md.count("| tuned | hfmaml+embedding_reg=0.5 |") == 1


def test_variants_are_checked(tmp_path: Path) -> None:
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "grid.toml").write_text(
        '[experiment]\nbase = "base.toml"\nalgorithms = ["fedavg+embedding_reg=1"]\n'
        'partitions = ["equal"]\nseeds = [0]\n'
    )
    with pytest.raises(
        ConfigError,
        match="cell algorithm 'fedavg\\+embedding_reg=1', partition 'equal', seed 0 .*"
        "embedding_reg .* hfmaml and hfmaml-global only",
    ):
        run_experiment(load_experiment(tmp_path / "grid.toml"), tmp_path / "out")
    with pytest.raises(ConfigError, match="'alpha' is not key=value"):
        algorithm_overrides("hfmaml+alpha")
    assert algorithm_overrides("hfmaml-global+beta=0.2+train.lr=0.5") == [
        "algorithm.name=hfmaml-global", "algorithm.beta=0.2", "train.lr=0.5",
    ]  # fmt: skip
    (tmp_path / "far.toml").write_text(
        '[experiment]\nbase = "base.toml"\nalgorithms = ["fedavg"]\npartitions = ["equal"]\n'
        'seeds = [0]\nfar = "0.1"\n'
    )
    with pytest.raises(ConfigError, match="experiment.far = '0.1'; allowed: 1e-1, 1e-2"):
        load_experiment(tmp_path / "far.toml")
    # the module's documentation lists exactly the FARs the code allows
    import fl_secure.app.experiment as module

    assert 'FAR of the client-group tables ("1e-1" or "1e-2")' in (module.__doc__ or "")
    assert module.GROUP_FARS == ("1e-1", "1e-2")
    for text, message in (
        ('far = "1e-3"', "experiment.far = '1e-3'; allowed: 1e-1, 1e-2"),  # no such column
        ("far = 1e-1", r"experiment.far = 0.1; allowed: 1e-1, 1e-2 \(as strings"),  # a float
    ):
        (tmp_path / "far.toml").write_text(
            '[experiment]\nbase = "base.toml"\nalgorithms = ["fedavg"]\npartitions = ["equal"]\n'
            f"seeds = [0]\n{text}\n"
        )
        with pytest.raises(ConfigError, match=message):
            load_experiment(tmp_path / "far.toml")


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
    # values of the wrong type are named, not a ValueError from deep inside
    good = '[experiment]\nbase = "x"\nalgorithms = ["fedpe"]\npartitions = ["equal"]\n'
    for extra, message in (
        ('seeds = ["a"]', "experiment.seeds holds 'a': expected integers"),
        ("seeds = [true]", "experiment.seeds holds True: expected integers"),
        ("seeds = [1.5]", "experiment.seeds holds 1.5: expected integers"),
        ('seeds = [0]\nset = "train.rounds=2"', "experiment.set must be a list of"),
        ("seeds = [0]\nset = [3]", "experiment.set must be a list of"),
        ("seeds = [0, 0]", "experiment.seeds repeats 0"),  # not a spread over two seeds
        # the results go to runs/experiments/NAME: a name must not lead out of it
        (
            'seeds = [0]\nname = "../../../escaped"',
            "experiment.name = '../../../escaped': expected a plain folder name",
        ),  # fmt: skip
        ('seeds = [0]\nname = "a/b"', "experiment.name = 'a/b': expected a plain folder"),
        ('seeds = [0]\nname = ""', "experiment.name = '': expected a plain folder"),
        ("seeds = [0]\nname = 3", "experiment.name = 3: expected a plain folder"),
    ):
        (tmp_path / "d.toml").write_text(good + extra + "\n")
        with pytest.raises(ConfigError, match=message):
            load_experiment(tmp_path / "d.toml")
    (tmp_path / "e.toml").write_text(good.replace('["fedpe"]', "[1]") + "seeds = [0]\n")
    with pytest.raises(ConfigError, match="experiment.algorithms holds 1: expected strings"):
        load_experiment(tmp_path / "e.toml")


def test_committed_experiments_parse_and_their_cells_load() -> None:
    from fl_secure.app.simulation import check_simulable
    from fl_secure.config import load_config

    folder = ROOT / "examples" / "experiments"
    paths = sorted([*folder.glob("*.toml"), *folder.glob("cpu/*.toml")])  # cpu/: reduced copies
    assert len(paths) >= 10
    for path in paths:
        experiment = load_experiment(path)
        for algorithm, partition, seed in experiment.cells():
            cfg = load_config(
                experiment.base, experiment.cell_overrides(algorithm, partition, seed)
            )
            assert not cfg.privacy.enabled and not cfg.secure_aggregation.enabled
            check_simulable(cfg)
            assert cfg.algorithm.name == algorithm.split("+")[0]
            assert cfg.partition.kind == partition and cfg.run.seed == seed


def test_a_held_out_set_without_impostor_pairs_is_refused_before_any_output(
    tmp_path: Path,
) -> None:
    from fl_secure.errors import DataError

    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "grid.toml").write_text(
        '[experiment]\nbase = "base.toml"\nalgorithms = ["fedavg"]\npartitions = ["equal"]\n'
        'seeds = [0]\nset = ["data.held_out_identities=1"]\n'
    )
    with pytest.raises(DataError, match="data.held_out_identities = 1: .* at least 2 held-out"):
        run_experiment(load_experiment(tmp_path / "grid.toml"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_diverging_cell_is_recorded_as_aborted_and_the_grid_goes_on(tmp_path: Path) -> None:
    # Prepare: one variant whose learning rate makes training diverge, one that trains
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "grid.toml").write_text(
        '[experiment]\nbase = "base.toml"\nalgorithms = ["fedavg+train.lr=1e12", "fedavg"]\n'
        'partitions = ["equal"]\nseeds = [0]\nset = ["train.optimizer=\\"sgd\\""]\n'
    )
    # Execute
    rows = run_experiment(load_experiment(tmp_path / "grid.toml"), tmp_path / "out")
    # Assert: the first cell aborted with its reason and no figures; the second completed
    table = read_results(tmp_path / "out" / "results.csv")
    assert [(r["algorithm"], r["status"]) for r in table] == [
        ("fedavg+train.lr=1e12", "aborted"), ("fedavg", "completed"),
    ]  # fmt: skip
    assert table[0]["reason"].startswith("round 1: client-0's update has non-finite values")
    assert "lower train.lr" in table[0]["reason"]
    assert table[0]["tar_at_far_1e-2"] == "" and rows[0]["tar_at_far_1e-2"] is None
    assert 0.0 <= float(table[1]["tar_at_far_1e-2"]) <= 1.0 and table[1]["reason"] == ""
    md = (tmp_path / "out" / "results.md").read_text()
    assert "1 of 2 runs aborted" in md and "- fedavg+train.lr=1e12 / equal / seed 0: " in md


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("server.clients_per_round=2", "server.clients_per_round = 2"),
        ("server.sample_rate=0.5", "server.sample_rate = 0.5"),
    ],
)
def test_sampled_cohorts_are_refused_before_any_cell_runs(
    tmp_path: Path, setting: str, named: str
) -> None:
    # Prepare: a grid whose second cell samples a cohort of its 3 clients
    (tmp_path / "base.toml").write_text(BASE.replace("min_clients = 3", "min_clients = 1"))
    (tmp_path / "grid.toml").write_text(
        '[experiment]\nbase = "base.toml"\nalgorithms = ["fedavg", "fedpe+' + setting + '"]\n'
        'partitions = ["equal"]\nseeds = [0]\n'
    )
    # Execute / Assert: named, and nothing ran or was written
    with pytest.raises(
        ConfigError, match=f"cell algorithm 'fedpe.*{named}: the simulation trains every client"
    ):
        run_experiment(load_experiment(tmp_path / "grid.toml"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # every client in every round is what the simulation runs: allowed
    from fl_secure.app.simulation import check_simulable
    from fl_secure.config import load_config

    check_simulable(load_config(tmp_path / "base.toml", ["server.clients_per_round=3"]))
    check_simulable(load_config(tmp_path / "base.toml", ["server.sample_rate=1"]))


def test_earlier_results_are_not_replaced_without_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fl_secure.app.cli import main

    # Prepare: a results folder from an earlier grid
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "grid.toml").write_text(
        '[experiment]\nbase = "base.toml"\nalgorithms = ["fedavg"]\npartitions = ["equal"]\n'
        "seeds = [0]\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_text("earlier\n")
    argv = ["experiment", "--config", str(tmp_path / "grid.toml"), "--out", str(out)]
    # Execute / Assert: refused, the earlier results untouched
    assert main(argv) == 2
    assert "is not empty (results.csv): give another --out, or --overwrite" in (
        capsys.readouterr().err
    )
    assert (out / "results.csv").read_text() == "earlier\n"
    # with --overwrite the grid runs and replaces them
    assert main([*argv, "--overwrite", "--json"]) == 0
    assert [r["algorithm"] for r in read_results(out / "results.csv")] == ["fedavg"]


def test_relative_paths_in_overrides_start_from_the_experiment_files_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fl_secure.config import load_config

    # Prepare: the grid in its own folder; the current directory elsewhere
    grids = tmp_path / "grids"
    grids.mkdir()
    (grids / "base.toml").write_text(BASE)
    (grids / "grid.toml").write_text(
        '[experiment]\nbase = "base.toml"\nalgorithms = ["fedpe+model.pretrained=w/b.st"]\n'
        'partitions = ["equal"]\nseeds = [0]\nset = ["data.path=faces", "data.source=folders",'
        ' "data.attributes_file=/abs/attrs.txt"]\n'
    )
    monkeypatch.chdir(tmp_path)
    # Execute
    experiment = load_experiment("grids/grid.toml")
    overrides = experiment.cell_overrides("fedpe+model.pretrained=w/b.st", "equal", 0)
    config = load_config(experiment.base, overrides)
    # Assert: from grids/, as base is; absolute paths and other keys as written
    assert config.data.path == str(grids.resolve() / "faces")
    assert config.model.pretrained == str(grids.resolve() / "w" / "b.st")
    assert config.data.attributes_file == "/abs/attrs.txt" and config.data.source == "folders"
    assert experiment.overrides[0] == "data.path=faces"  # the tables show them as written


def test_labels_with_quotes_survive_results_csv(tmp_path: Path) -> None:
    # Prepare: an entry whose label holds double quotes (a TOML string value)
    (tmp_path / "base.toml").write_text(BASE)
    label = 'fedavg+train.lr_schedule="cosine"'
    (tmp_path / "grid.toml").write_text(
        '[experiment]\nbase = "base.toml"\nalgorithms = [\'' + label + "']\n"
        'partitions = ["equal"]\nseeds = [0]\n'
    )
    # Execute
    run_experiment(load_experiment(tmp_path / "grid.toml"), tmp_path / "out")
    # Assert: read back as written, every column in its place
    (row,) = read_results(tmp_path / "out" / "results.csv")
    assert row["algorithm"] == label and row["partition"] == "equal" and row["seed"] == "0"
    assert 0.0 <= float(row["tar_at_far_1e-2"]) <= 1.0


def test_a_cell_whose_fine_tuning_diverges_is_aborted_and_the_grid_goes_on(
    tmp_path: Path,
) -> None:
    # Prepare: training is fine, but the tuning after it (SGD at lr 1e6) diverges
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "grid.toml").write_text(
        '[experiment]\nbase = "base.toml"\nalgorithms = ["fedavg+eval.tune_lr=1e6", "fedavg"]\n'
        'partitions = ["equal"]\nseeds = [0]\n'
        'set = ["train.optimizer=\\"sgd\\"", "eval.tune_steps=3"]\n'
    )
    # Execute: it used to stop the grid with a DegenerateEmbeddings traceback
    run_experiment(load_experiment(tmp_path / "grid.toml"), tmp_path / "out")
    # Assert: the first cell aborted, naming the client and the setting; the second completed
    table = read_results(tmp_path / "out" / "results.csv")
    assert [(r["algorithm"], r["status"]) for r in table] == [
        ("fedavg+eval.tune_lr=1e6", "aborted"), ("fedavg", "completed"),
    ]  # fmt: skip
    assert table[0]["reason"].startswith("client-0's model after fine-tuning: its embeddings")
    assert "lower eval.tune_lr" in table[0]["reason"] and table[0]["tar_at_far_1e-2"] == ""
    assert 0.0 <= float(table[1]["train_tuned_tar_at_far_1e-1_mean"]) <= 1.0
