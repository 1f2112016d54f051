"""train --centralized: what it refuses before it writes anything, and a diverged run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fl_secure.app.centralized import run_centralized
from fl_secure.config import config_from_dict, config_to_toml
from fl_secure.errors import DataError, RoundAborted


def test_a_bad_data_path_is_named_before_a_run_directory_exists(tmp_path: Path) -> None:
    # Prepare: identity folders that are not there
    config = config_from_dict({
        "data": {"source": "folders", "path": str(tmp_path / "no-such-faces"),
                 "image_size": 32, "held_out_identities": 2},
        "partition": {"num_clients": 2}, "server": {"min_clients": 2},
        "model": {"backbone": "cnn-small", "embedding_size": 32},
    })  # fmt: skip
    out = tmp_path / "runs"
    # Execute / Assert: the folder is named, and no run directory is left behind
    with pytest.raises(DataError, match="no-such-faces"):
        run_centralized(config, out=out, progress=False)
    assert not out.exists() or list(out.iterdir()) == []


TINY = {
    "run": {"name": "tiny"},
    "data": {"image_size": 32, "num_identities": 16, "images_per_identity": 4,
             "held_out_identities": 6},
    "partition": {"num_clients": 2}, "server": {"min_clients": 1},
    "model": {"backbone": "cnn-small", "embedding_size": 32},
    "train": {"rounds": 3, "local_steps": 2, "batch_size": 8, "optimizer": "sgd"},
}  # fmt: skip


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_diverging_run_is_recorded_as_aborted_and_named_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fl_secure.app.cli import main

    # Prepare: SGD at lr 1e8 diverges in the first pass
    config = tmp_path / "tiny.toml"
    config.write_text(config_to_toml(config_from_dict(TINY)))
    argv = ["train", "--centralized", "--config", str(config), "--set", "train.lr=1e8",
            "--out", str(tmp_path / "runs")]  # fmt: skip
    # Execute: it used to stop with a DegenerateEmbeddings traceback, leaving only
    # config.toml and metrics.jsonl
    code = main(argv)
    # Assert: a clean error naming the pass and the setting; the run says it aborted
    err = capsys.readouterr().err
    assert code == 2 and re.match(
        r"fl-secure: error: pass 1: the model('s held-out embeddings| has non-finite values)", err
    )
    assert "lower train.lr" in err and "recorded as aborted in" in err
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "aborted" and summary["reason"].startswith("pass 1: ")
    assert summary["rounds_completed"] == 0 and summary["backbone"] is None
    assert 0.0 <= summary["untrained"]["tar_at_far_1e-1"] <= 1.0
    records = _records(run_dir)
    assert [r.get("kind") for r in records] == [None, "aborted"]
    assert records[-1]["round"] == 1 and records[-1]["reason"] == summary["reason"]
    assert not (run_dir / "backbone.safetensors").exists()


def test_degenerate_embeddings_after_a_pass_abort_after_the_passes_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fl_secure.app.centralized as centralized
    from fl_secure.evaluation import DegenerateEmbeddings

    # Prepare: finite parameters whose held-out embeddings vanish after pass 2 (calls:
    # the untrained model, pass 1, pass 2)
    real = centralized.evaluate_verification
    calls: list[int] = []

    def vanishing(backbone, dataset):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:
            raise DegenerateEmbeddings("embedding rows [0, 1] are zero or not finite")
        return real(backbone, dataset)

    monkeypatch.setattr(centralized, "evaluate_verification", vanishing)
    # Execute
    with pytest.raises(RoundAborted, match=r"pass 2: the model's held-out embeddings: embed"):
        run_centralized(config_from_dict(TINY), out=tmp_path, progress=False)
    # Assert: pass 1 is kept, its figures are the summary's, and the abort is the last record
    (run_dir,) = tmp_path.iterdir()
    records = _records(run_dir)
    assert [(r["round"], r.get("kind")) for r in records] == [(0, None), (1, None), (2, "aborted")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "aborted" and summary["rounds_completed"] == 1
    assert summary["held_out"] == records[1]["held_out"]
    assert summary["tar_at_far_1e-1"] == records[1]["held_out"]["tar_at_far_1e-1"]


def test_a_pretrained_model_without_embeddings_aborts_before_any_pass(tmp_path: Path) -> None:
    from fl_secure.models import save_weights
    from fl_secure.training import build_model

    # Prepare: model.pretrained weights that are all zero (every embedding vanishes)
    config = config_from_dict(TINY)
    backbone = build_model(config.model, 1, 32, seed=0).backbone
    for param in backbone.parameters():
        param.data.zero_()
    save_weights(backbone, tmp_path / "zeros.safetensors")
    model = {**TINY["model"], "pretrained": str(tmp_path / "zeros.safetensors")}
    # Execute / Assert
    with pytest.raises(RoundAborted, match="the initial model's embeddings: .*no pass ran"):
        run_centralized(config_from_dict({**TINY, "model": model}), out=tmp_path / "runs")
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert [(r["round"], r.get("kind")) for r in _records(run_dir)] == [(0, "aborted")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "aborted" and summary["rounds_completed"] == 0


@pytest.mark.parametrize(
    ("partition", "clients", "local_steps", "batches"),
    [
        ("equal", 4, 3, 12),  # every client's 3 batches of a federated round, pooled
        ("domain", 3, 3, 3),  # FedFR: the source client alone is pooled (and trained)
        ("equal", 4, 0, None),  # local_epochs = 2: twice the pooled images' full batches
    ],
)
def test_a_pass_trains_as_many_batches_as_a_federated_round(
    monkeypatch: pytest.MonkeyPatch,
    partition: str,
    clients: int,
    local_steps: int,
    batches: int | None,
) -> None:
    import fl_secure.app.centralized as centralized
    from fl_secure.app.centralized import pretraining_clients, train_centralized_model
    from fl_secure.data.plan import plan_federation

    # Prepare: count the batches each pass trains (the loop's own count)
    real = centralized.train_local
    counted: list[float] = []

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        metrics = real(*args, **kwargs)
        counted.append(metrics["local_steps"])
        return metrics

    monkeypatch.setattr(centralized, "train_local", counting)
    train = {"rounds": 2, "local_steps": local_steps, "local_epochs": 2, "batch_size": 8}
    data = {**TINY["data"], "num_identities": 20, "held_out_identities": 2}
    partitioned = {"kind": partition, "num_clients": clients}
    config = config_from_dict({**TINY, "data": data, "train": train, "partition": partitioned})
    plan = plan_federation(config)
    pooled = sum(len(c.train) for c in pretraining_clients(config, plan))
    assert all(len(c.train) >= 8 for c in plan.clients)  # full batches of 8 on every client
    expected = 2 * (pooled // 8) if batches is None else batches
    # Execute
    train_centralized_model(config, plan)
    # Assert: with local_steps, the batches of all pooled clients' rounds, not one client's
    assert counted == [expected, expected]
