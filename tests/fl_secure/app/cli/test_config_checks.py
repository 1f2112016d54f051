"""A config its algorithm refuses is refused by every entry point, with the algorithm's words.

The refusals that depend on ``algorithm.name`` live with the strategies
(:func:`fl_secure.algorithms.registry.check_config`), above :mod:`fl_secure.config`: loading
such a config succeeds, and each way of running it must still stop before anything is
written, with the message ``Config`` itself gave before the checks moved.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from client.app import FlClient
from client.transport import Connection
from fl_secure.app.cli import main
from fl_secure.app.simulation import simulate
from fl_secure.config import config_from_dict, config_to_toml, load_config
from fl_secure.errors import ConfigError
from fl_secure.runs import RunDir
from server.bootstrap import build_server
from server.embedded import run_embedded
from server.preflight import preflight

REFUSED = config_from_dict(
    {"algorithm": {"name": "fedaffect"}, "privacy": {"unit": "example", "noise_multiplier": 1.0}}
)
MESSAGE = (
    "algorithm.name = 'fedaffect' cannot run with privacy.unit = 'example': NT-Xent couples "
    "the images of a minibatch, so DP-SGD's per-example clipping would not bound one image's "
    "influence; use privacy.unit = 'client' (DP-FedAvg) or 'none'"
)


@pytest.fixture
def refused(tmp_path: Path) -> Path:
    path = tmp_path / "refused.toml"
    path.write_text(config_to_toml(REFUSED))
    return path


def _command(name: str, config: Path, out: Path) -> list[str]:
    if name == "eval":  # a run directory holding the config (as if it had been edited)
        out.mkdir()
        (out / "config.toml").write_text(config.read_text())
        return ["eval", "--run", str(out)]
    if name == "experiment":
        grid = config.with_name("grid.toml")
        grid.write_text(
            f'[experiment]\nbase = "{config.name}"\nalgorithms = ["fedaffect"]\n'
            'partitions = ["equal"]\nseeds = [0]\n'
        )
        return ["experiment", "--config", str(grid), "--out", str(out)]
    return {
        "train": ["train", "--config", str(config), "--out", str(out)],
        "server": ["server", "--config", str(config), "--insecure", "--out", str(out)],
        "client": ["client", "--server", "127.0.0.1:1", "--id", "client-0", "--insecure",
                   "--config", str(config), "--plan-index", "0"],
    }[name]  # fmt: skip


@pytest.mark.parametrize("command", ["train", "server", "client", "eval", "experiment"])
def test_each_command_refuses_the_config_before_it_runs(
    tmp_path: Path, refused: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the config loads (what holds for every algorithm holds)
    assert load_config(refused).algorithm.name == "fedaffect"
    out = tmp_path / "out"
    # Execute
    code = main(_command(command, refused, out))
    # Assert: exit 2 with the algorithm's message, and nothing written
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("fl-secure: error: ") and err.endswith(f"{MESSAGE}\n")
    if command == "experiment":
        assert "cell algorithm 'fedaffect', partition 'equal', seed 0" in err
    written = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert written == (["config.toml"] if command == "eval" else [])


def test_the_simulation_and_the_server_refuse_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as simulated:
        simulate(REFUSED)
    with pytest.raises(ConfigError) as checked:
        preflight(REFUSED, REFUSED.partition.num_clients)
    with pytest.raises(ConfigError) as built:
        build_server(REFUSED, RunDir(tmp_path), enrolled=set())
    with pytest.raises(ConfigError) as embedded:
        run_embedded(REFUSED, out=tmp_path / "runs")
    assert [str(e.value) for e in (simulated, checked, built, embedded)] == [MESSAGE] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_client_refuses_to_join_a_run_under_it() -> None:
    client = FlClient(Connection("localhost:1", "client-0"), lambda reply: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError) as joined:
        client._hold_run_config(config_to_toml(REFUSED))
    assert str(joined.value) == f"the server sent an invalid run config: {MESSAGE}"
