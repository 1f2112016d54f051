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
        "fl_secure.cli",
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
    assert written <= {".toml", ".jsonl", ".json", ".safetensors", ".pem", ".key", ".log"}
    assert (run_dir / "certs" / "ca.pem").exists()  # the run used mutual TLS
