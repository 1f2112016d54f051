"""``fl-secure experiment --backend ray``: the serial grid's figures, one Ray start per grid."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fl_secure.app.cli import main
from fl_secure.app.experiment import read_results
from fl_secure.app.sim.ray_executor import RayExecutor
from fl_secure.app.sim.run import run_simulation
from fl_secure.config import Config, load_config
from fl_secure.errors import RoundAborted
from tests.fl_secure.app.sim.tiny import tiny_toml

#: Columns that hold a figure of the run (all but the labels, the status and the wall clock).
LABELS = ("algorithm", "partition", "seed", "status", "reason", "duration_s")


def _grid(tmp_path: Path) -> Path:
    """2 cells (FedPer-style private layers, FedAvg) of 3 training + 1 held-out client."""
    base = tiny_toml(name="tiny-grid", seed=0, identities=30, images=6, clients=3, held_out=4,
                     train={"rounds": 2, "local_steps": 2, "batch_size": 4})  # fmt: skip
    (tmp_path / "base.toml").write_text(base)
    path = tmp_path / "grid.toml"
    path.write_text(
        '[experiment]\nname = "tiny-ray"\nbase = "base.toml"\nalgorithms = ["fedpe", "fedavg"]\n'
        'partitions = ["equal"]\nseeds = [3]\n'
        'set = ["partition.held_out_clients=1", "eval.tune_steps=2"]\n'
    )
    return path


def _experiment(path: Path, out: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> Any:
    """``fl-secure experiment ... --json``: its exit code must be 0; its rows."""
    capsys.readouterr()
    code = main(["experiment", "--config", str(path), "--out", str(out), "--json", "--quiet",
                 *flags])  # fmt: skip
    printed = capsys.readouterr().out.strip().splitlines()
    assert code == 0, printed[-5:]
    return json.loads(printed[-1])["rows"]


@pytest.mark.slow  # Ray starts worker processes that import torch (~20 s on 2 cores)
def test_experiment_on_ray_gives_the_serial_figures_with_one_ray_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a 2-cell grid; ray.init counted (the grid must start Ray once, not per cell)
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    path = _grid(tmp_path)
    init = ray.init
    starts: list[str | None] = []

    def counting_init(*args: Any, **kwargs: Any) -> Any:
        starts.append(kwargs.get("address"))
        return init(*args, **kwargs)

    monkeypatch.setattr(ray, "init", counting_init)
    # Execute: the grid in this process, then with every cell's clients on 2 Ray actors
    serial = _experiment(path, tmp_path / "serial", capsys)
    over_ray = _experiment(path, tmp_path / "ray", capsys, "--backend", "ray", "--workers", "2")
    # Assert: Ray started once for both cells, and is stopped after the grid
    assert starts == [None]
    assert not ray.is_initialized()
    # every figure of every cell is equal, bit for bit: the same jobs on the same seeds, each
    # client on one actor with its private layers, and the final fine-tuning of the clients
    # done on the actors that kept them, as the serial run does in its process
    assert [r["status"] for r in over_ray] == ["completed", "completed"]
    assert len(serial) == len(over_ray) == 2
    for ours, theirs in zip(over_ray, serial, strict=True):
        figures = {k: v for k, v in theirs.items() if k not in LABELS}
        assert {k: ours[k] for k in figures} == figures
        # every group of the paper layout is there: training and held-out, untuned and tuned
        assert all(v is not None for v in figures.values()), figures
    # and the tables say the same (CSV rounds to 6 significant digits)
    drop = {"duration_s"}
    ours_csv = read_results(tmp_path / "ray" / "results.csv")
    theirs_csv = read_results(tmp_path / "serial" / "results.csv")
    assert [{k: v for k, v in r.items() if k not in drop} for r in ours_csv] == [
        {k: v for k, v in r.items() if k not in drop} for r in theirs_csv
    ]


def _tiny(tmp_path: Path, algorithm: str, *overrides: str) -> Config:
    path = tmp_path / f"{algorithm}.toml"
    path.write_text(tiny_toml(name="tiny-tuned", seed=1, identities=30, images=6, clients=3,
                              held_out=4, algorithm=algorithm,
                              train={"rounds": 1, "local_steps": 2, "batch_size": 4}))  # fmt: skip
    return load_config(path, ["eval.tune_steps=2", *overrides])


@pytest.mark.slow
def test_ray_run_scores_its_kept_clients_after_fine_tuning(tmp_path: Path) -> None:
    # Prepare: every client in every round; AdaFedFR's local adapters are design state held
    # beside each client's model (kept on the client's actor)
    config = _tiny(tmp_path, "adafedfr")
    # Execute: the run in this process, and on 2 Ray actors that keep their clients
    serial = run_simulation(config).summary
    over_ray = run_simulation(
        config, executor=lambda c: RayExecutor(c, num_workers=2, keep_trainers=True)
    ).summary
    # Assert: the training clients' tuned scores are there, and equal to the serial run's
    # (a Ray run used to leave them out: its clients were on the actors, not in the driver)
    assert list(serial["clients_tuned"]) == [f"client-{i}" for i in range(3)]
    assert over_ray["clients_tuned"] == serial["clients_tuned"]
    assert over_ray["clients_tuned_summary"] == serial["clients_tuned_summary"]
    assert over_ray["clients"] == serial["clients"]


@pytest.mark.slow
def test_a_tuning_that_diverges_on_an_actor_aborts_the_run_naming_the_client(
    tmp_path: Path,
) -> None:
    # Prepare: the final fine-tuning by SGD at lr 1e30 (it diverges), on 1 Ray actor
    wild = _tiny(tmp_path, "fedavg", "eval.tune_lr=1e30", 'train.optimizer="sgd"')
    # Execute / Assert: the actor's RoundAborted, with its message, in the driver (a grid
    # records the cell as aborted and goes on)
    with pytest.raises(RoundAborted, match="client-0's model after fine-tuning: .* eval.tune_lr"):
        run_simulation(wild, executor=lambda c: RayExecutor(c, num_workers=1, keep_trainers=True))


def test_experiment_without_ray_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: `import ray` fails as it does where Ray is not installed
    path = _grid(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)
    # Execute
    code = main(["experiment", "--config", str(path), "--backend", "ray",
                 "--out", str(tmp_path / "out")])  # fmt: skip
    # Assert: simulate's error (exit 2, the pip extra named), before any cell ran
    assert code == 2
    err = capsys.readouterr().err
    assert "the Ray backend needs Ray, which is not installed" in err
    assert "pip install 'fl-secure[sim]'" in err and "--backend serial" in err
    assert not (tmp_path / "out").exists()


def test_experiment_ray_flags_need_the_ray_backend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _grid(tmp_path)
    out = tmp_path / "out"
    code = main(["experiment", "--config", str(path), "--ray-address", "auto", "--workers", "2",
                 "--out", str(out)])  # fmt: skip
    assert code == 2
    assert "--ray-address and --workers need --backend ray" in capsys.readouterr().err
    assert not out.exists()  # refused before anything ran


@pytest.mark.parametrize("command", ["experiment", "simulate"])
def test_no_worker_is_refused_by_the_parser(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([command, "--config", str(tmp_path / "x.toml"), "--backend", "ray",
              "--workers", "0"])  # fmt: skip
    assert stopped.value.code == 2
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err


def test_experiment_refuses_client_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a grid keeps every client and trains it every round: batches would silently do nothing
    code = main(["experiment", "--config", str(tmp_path / "grid.toml"), "--client-batch", "4"])
    assert code == 2
    assert "--client-batch applies to sampled cohorts" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
