"""Identity-level DP end to end: two real clients over gRPC + mTLS, the ledger, the report."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from fl_secure.app.report import build_report, load_schema
from fl_secure.app.report.render_markdown import render_markdown
from fl_secure.config import config_from_dict
from fl_secure.runs import RunDir
from privacy.dp import identity_dpsgd
from privacy.dp.calibration import epsilon_for
from privacy.ledger.run_ledger import Ledger
from server.run_files import write_config
from server.summary import build_summary

IDS = ["client-0", "client-1"]
TINY = {
    "run": {"name": "tiny-identity", "seed": 3},
    "data": {"source": "synthetic", "image_size": 32, "num_identities": 12,
             "images_per_identity": 4, "held_out_identities": 4},
    "partition": {"num_clients": 2},
    "model": {"backbone": "cnn-small", "embedding_size": 16},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 2, "local_steps": 3, "batch_size": 4},
    "eval": {"tune_steps": 0},
    "privacy": {"unit": "identity", "noise_multiplier": 1.0, "clip_norm": 1.0,
                "sample_rate": 0.5, "secure_rng": False},
    "server": {"min_clients": 2, "round_timeout": 120.0},
}  # fmt: skip


def test_an_identity_level_run_trains_accounts_and_reports_the_unit(
    tmp_path: Path, serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: count the identity-level DP-SGD calls and the identities each one saw
    config = config_from_dict(TINY)
    run = RunDir(tmp_path / "run")
    write_config(run, config)
    calls: list[tuple[int, int]] = []
    train = identity_dpsgd.train_local_identity_dpsgd

    def spy(model, data, training, settings, *, noise):  # type: ignore[no-untyped-def]
        calls.append((len(data.train.labels.unique()), training.local_steps))
        return train(model, data, training, settings, noise=noise)

    monkeypatch.setattr("privacy.client_round.train_local_identity_dpsgd", spy)
    started = time.time()
    # Execute: two rounds served to two real LocalTrainers
    side, recorders = serve(tmp_path, config, IDS)
    run.write_summary(build_summary(config, side.coordinator, side.strategy, side.plan,
                                    started=started))  # fmt: skip
    # Assert: the run completed, each client trained identity-level DP-SGD in each round
    assert side.coordinator.status == "completed", side.coordinator.stop_reason
    assert len(calls) == 4 and all(m >= 2 and steps == 3 for m, steps in calls)
    for rec in recorders.values():
        assert rec.trainer.privacy is not None and rec.trainer.privacy.sample_rate == 0.5
        assert rec.trainer.privacy.num_examples == calls[0][0]  # the records are identities
    # ... the ledger holds one row per client and round, naming the identity unit
    with Ledger.read(run.path / "ledger.sqlite") as ledger:
        entries = ledger.entries()
    rows = [e for e in entries if e.kind == "example_level"]
    assert sorted((e.round, e.party) for e in rows) == [(r, c) for r in (1, 2) for c in IDS]
    assert {e.payload["privacy_unit"] for e in rows} == {"identity"}
    assert {(e.payload["steps"], e.payload["sample_rate"]) for e in rows} == {(3, 0.5)}
    two_rounds = epsilon_for(accountant="prv", noise_multiplier=1.0, sample_rate=0.5, steps=6,
                             delta=1e-5)  # fmt: skip
    epsilons = [e.payload["epsilon"] for e in rows]
    assert max(float(x) for x in epsilons if isinstance(x, float)) == pytest.approx(two_rounds)
    assert all(isinstance(x, float) for x in epsilons)
    # ... and the report states the unit, the record and the mechanism
    report = build_report(run.path)
    jsonschema.validate(report, load_schema())
    p = report["privacy"]
    assert p["privacy_unit"] == "identity" and p["noise_placement"] == "local"
    assert p["protected_record"].startswith("one person: every image of one identity")
    assert p["mechanism"].startswith("identity-level DP-SGD")
    assert p["epsilon"] == pytest.approx(two_rounds, rel=1e-6)
    assert p["population"] is None and "identities" in p["population_of"]
    assert any("level of a whole person" in line for line in report["plain_summary"])
    markdown = render_markdown(report, [])
    assert "Protected record" in markdown and "every image of one identity at a site" in markdown
