"""The masked-round benchmark still runs a secure round its clients accept (tiny sizes).

The script checks each side's aggregate against the exact mean of the clients' updates
and raises otherwise, so a completed run is a correct one. Its clients hold every round's
setup to the run config they joined under: a benchmark whose server sent none had every
client withdraw at the key advertisement.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("neighbours", ["0", "2"])
def test_the_masked_round_benchmark_completes_both_sides(neighbours: str) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "secagg_round.py"), "--clients", "3",
        "--params", "2000", "--repeats", "1", "--rounds", "2", "--neighbours", neighbours,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["scheme"] == ("secagg" if neighbours == "0" else "secagg+")
    assert out["plaintext_round_s"] > 0 and out["secure_round_s"] > 0
    cpu = out["cpu_per_round_s"]  # every process's CPU clock, ended threads included
    assert cpu["none"]["clients"] > 0 and cpu[out["scheme"]]["clients"] > 0
