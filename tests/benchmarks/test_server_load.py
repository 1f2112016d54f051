"""The server-load benchmark runs a real server with virtual clients and checks exact sums.

Four virtual clients over mTLS: one plain FedAvg round, then one SecAgg round in which the
harness process of one client is SIGKILLed after the key stages. The benchmark recomputes each
released model from the known updates of the round's survivors; here that check is also fed
a wrong survivor set and a model one ulp off, which it must refuse. (Two server processes and
three harness processes start, each importing torch: 2 to 7 minutes on the shared 2-core
machine at load average 20-30.)
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checks():
    """benchmarks/server_load_checks.py (it imports its sibling, the harness, by name)."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        path = ROOT / "benchmarks" / "server_load_checks.py"
        spec = importlib.util.spec_from_file_location("server_load_checks", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:  # benchmarks/ holds dp.py, transport.py...: never left ahead of the project
        sys.path.remove(folder)
    return module


@pytest.mark.slow
def test_four_clients_plain_and_secure_with_one_killed_sum_exactly(tmp_path: Path) -> None:
    # Prepare
    out, keep = tmp_path / "load.json", tmp_path / "keep"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "server_load.py"), "--clients", "4",
        "--baseline-clients", "0", "--rounds", "1", "--scheme", "secagg",
        "--stage-timeout", "60", "--max-minutes", "3", "--json-out", str(out),
        "--keep", str(keep),
    ]  # fmt: skip
    # Execute
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    # Assert: every check of both workloads held
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    plain, secure = result["plain"]["4"], result["secure"]["4"]
    assert plain["ok"] and secure["ok"], json.dumps(result)[:3000]
    assert plain["survivors"] == [4] and plain["killed"] == 0
    assert secure["killed"] == 1 and secure["survivors"] == [3]
    assert secure["checks"]["released_models_bit_exact"]
    assert secure["model"]["max_abs_difference"] == 0.0
    assert secure["client_errors"] == 0 and secure["join_s"] > 0
    assert secure["server_peak_rss_mb"] > 0 and secure["server_max_connections"] >= 3
    # ... and the model check refuses a wrong survivor set and a model one ulp off
    checks = _checks()
    run = next((keep / "secure-4" / "runs").glob("load-*"))
    record = keep / "secure-4" / "params"
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    completed = [r for r in rounds if "kind" not in r and r["round"] > 0]
    everyone = [f"client-{i}" for i in range(4)]
    good = checks.check_models(run, record, completed, True, everyone, ["client-3"])
    assert good["checks"] == {
        "survivors_are_the_live_clients": True,
        "released_models_bit_exact": True,
    }
    wrong = checks.check_models(run, record, completed, True, everyone, ["client-2"])
    assert not wrong["checks"]["survivors_are_the_live_clients"]
    released = checks.released(run, record, 1)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(released))
    name = next(iter(tensors))
    flat = tensors[name].reshape(-1)
    flat[0] = np.nextafter(flat[0], np.float32(np.inf))
    save_file(tensors, str(released))
    off = checks.check_models(run, record, completed, True, everyone, ["client-3"])
    assert not off["checks"]["released_models_bit_exact"]
