"""fl-secure train/server --resume: a run continues under its own config, and only if unfinished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fl_secure.app.cli import main
from fl_secure.config import config_from_dict, config_to_toml


def _run_dir(tmp_path: Path, status: str | None) -> Path:
    run = tmp_path / "run-1"
    run.mkdir()
    (run / "config.toml").write_text(config_to_toml(config_from_dict({})))
    if status is not None:
        (run / "summary.json").write_text(json.dumps({"status": status}))
    return run


@pytest.mark.parametrize("command", ["train", "server"])
def test_resume_refuses_a_config_change(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path, "stopped")
    before = (run / "config.toml").read_bytes()
    code = main([command, "--resume", str(run), "--set", "privacy.target_epsilon=100"])
    err = capsys.readouterr().err
    assert code == 2 and "drop --set" in err and "config.toml" in err
    assert main([command, "--resume", str(run), "--config", str(run / "config.toml")]) == 2
    assert "drop --config" in capsys.readouterr().err
    assert (run / "config.toml").read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == ["config.toml", "summary.json"]


@pytest.mark.parametrize("status", ["completed", "budget_exhausted"])
def test_resume_refuses_a_run_that_ended(
    tmp_path: Path, status: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path, status)
    summary = (run / "summary.json").read_bytes()
    assert main(["train", "--resume", str(run)]) == 2
    assert f"already ended ('{status}' in summary.json)" in capsys.readouterr().err
    assert (run / "summary.json").read_bytes() == summary  # its record is left as it was


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("secure_aggregation.threshold=10", "threshold = 10 exceeds the 3 neighbours"),
        ("secure_aggregation.threshold=1", "threshold = 1 is not a strict majority of the 3"),
        ("secure_aggregation.modulus_bits=4", "wraps mod 2^4"),
        ("model.pretrained=missing.safetensors", "missing.safetensors does not exist"),
        ("data.path=nowhere", "data.path"),
    ],
)
def test_train_refuses_an_unworkable_config_before_writing_a_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    override: str,
    message: str,
) -> None:
    config = Path(__file__).resolve().parents[4] / "examples" / "quickstart.toml"
    monkeypatch.chdir(tmp_path)
    extra = ["--set", "data.source=folders"] if override.startswith("data.path") else []
    code = main(["train", "--config", str(config), "--set", override, *extra, "--out", "runs"])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # no run directory, no CA key left behind
