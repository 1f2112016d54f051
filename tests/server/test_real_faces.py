"""Real faces end to end: ORL over gRPC + mutual TLS, 4 clients with disjoint identities, FedPE.

Reads ``../shared/data/orl`` (skipped where it is absent); everything is written to a
temporary folder, so no real face reaches the repository.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fl_secure.config import load_config
from fl_secure.data.plan import plan_federation

ROOT = Path(__file__).resolve().parents[2]
ORL = ROOT.parent / "shared" / "data" / "orl"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ORL.is_dir(), reason="../shared/data/orl is not available"),
]


def test_orl_fedpe_over_mtls(tmp_path: Path) -> None:
    # Prepare: the committed ORL example as it is (20 rounds, about 30 s).
    overrides: list[str] = []
    config = load_config(ROOT / "examples" / "orl.toml", overrides)
    plan = plan_federation(config)
    ids = [set(np.unique(c.train.labels.numpy())) for c in plan.clients]
    assert all(not (a & b) for i, a in enumerate(ids) for b in ids[i + 1 :])  # disjoint
    assert sum(len(s) for s in ids) == 40
    for share in plan.clients:  # stratified 7/3: every identity on both sides
        assert set(np.unique(share.test.labels.numpy())) == set(
            np.unique(share.train.labels.numpy())
        )
        assert len(share.train) == 70 and len(share.test) == 30
    # Execute: embedded mode = a server and 4 client processes over gRPC with mTLS.
    cmd = [
        sys.executable,
        "-m",
        "fl_secure.app.cli",
        "train",
        "--config",
        str(ROOT / "examples" / "orl.toml"),
        "--out",
        str(tmp_path),
        "--json",
        "--quiet",
    ]
    for o in overrides:
        cmd += ["--set", o]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # Assert: every client scored the untrained and the final model on its own test images,
    # and federated training improved on the untrained model.
    assert summary["status"] == "completed"
    assert sorted(summary["clients"]) == [f"client-{i}" for i in range(4)]
    after, before = summary["clients_summary"], summary["untrained_clients_summary"]
    assert after["rank1_mean"] > before["rank1_mean"]
    assert after["tar_at_far_1e-2_mean"] > before["tar_at_far_1e-2_mean"] + 0.1
    run_dir = Path(summary["run_dir"])
    written = {p.suffix for p in run_dir.rglob("*") if p.is_file()}
    allowed = {".toml", ".jsonl", ".json", ".safetensors", ".pem", ".key", ".sig", ".log"}
    assert written <= allowed | {".lock"}  # no image: the run lock holds a pid
    assert (run_dir / "certs" / "server" / "ca.pem").exists()  # the run used mutual TLS


@pytest.mark.parametrize(
    ("unit", "overrides"),
    [
        ("client", ["privacy.noise_placement=local"]),
        ("example", ["privacy.max_physical_batch_size=32"]),
    ],
)
def test_orl_with_differential_privacy(tmp_path: Path, unit: str, overrides: list[str]) -> None:
    # Prepare: ORL, 4 clients over gRPC + mTLS, 4 rounds, budget epsilon 8 at delta 1e-5
    rounds, target = 4, 8.0
    cmd = [
        sys.executable, "-m", "fl_secure.app.cli", "train",
        "--config", str(ROOT / "examples" / "orl.toml"),
        "--out", str(tmp_path), "--json", "--quiet",
        "--set", f"train.rounds={rounds}", "--set", "train.local_epochs=1",
        "--set", f"privacy.unit={unit}", "--set", f"privacy.target_epsilon={target}",
    ]  # fmt: skip
    for o in overrides:
        cmd += ["--set", o]
    # Execute
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    run_dir = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Assert: epsilon per round in metrics.jsonl, growing, within the budget
    assert summary["status"] == "completed"
    eps = [r["epsilon"] for r in records if r["round"] > 0]
    assert len(eps) == rounds and all(0 < a < b for a, b in zip(eps, eps[1:], strict=False))
    assert eps[-1] <= target
    # ... the final statement in summary.json under the agreed keys
    assert summary["epsilon"] == pytest.approx(eps[-1])
    assert summary["delta"] == 1e-5 and summary["privacy_unit"] == unit
    assert summary["accountant"] == ("pld" if unit == "client" else "prv")
    assert summary["noise_placement"] == "local"
    assert summary["privacy"]["noise_secure"] is True
    # ... and a verified ledger with the entries of every round (per client at example level)
    ledger = subprocess.run(
        [sys.executable, "-m", "fl_secure.app.cli", "privacy", "ledger", "--run", str(run_dir),
         "--verify", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert ledger.returncode == 0, ledger.stdout + ledger.stderr
    report = json.loads(ledger.stdout)
    entries = report["entries"]
    assert report["privacy_unit"] == unit and report["epsilon"] == pytest.approx(eps[-1])
    assert report["verify"]["ok"] is True
    if unit == "client":
        assert [(e["kind"], e["round"]) for e in entries] == [
            ("client_level", r) for r in range(1, rounds + 1)
        ]
    else:
        assert sorted((e["round"], e["party"]) for e in entries) == [
            (r, f"client-{i}") for r in range(1, rounds + 1) for i in range(4)
        ]
        assert max(e["payload"]["epsilon"] for e in entries) == pytest.approx(eps[-1])
