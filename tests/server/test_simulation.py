"""The simulation runs the same algorithm code as gRPC: same final model on a tiny config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import load_config
from fl_secure.errors import ConfigError
from fl_secure.simulation import simulate

TINY = """
[run]
name = "tiny"
seed = 3
[data]
source = "synthetic"
image_size = 32
num_identities = 24
images_per_identity = 6
held_out_identities = 6
[partition]
kind = "{partition}"
num_clients = 3
[model]
backbone = "cnn-small"
embedding_size = 32
[algorithm]
name = "{algorithm}"
[train]
rounds = 2
local_steps = 3
batch_size = 8
optimizer = "adam"
lr = 0.001
lr_schedule = "cosine"
[server]
min_clients = 3
round_timeout = 120.0
"""


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "partition"), [("fedpe", "equal"), ("fedavg", "lognormal")])
def test_simulation_and_grpc_give_the_same_model(
    tmp_path: Path, algorithm: str, partition: str
) -> None:
    # Prepare: a tiny config
    path = tmp_path / "tiny.toml"
    path.write_text(TINY.format(algorithm=algorithm, partition=partition))
    config = load_config(path)
    # Execute: embedded (server + 3 client processes over gRPC + mTLS), then in-process
    done = subprocess.run(
        [sys.executable, "-m", "fl_secure.cli", "train", "--config", str(path),
         "--out", str(tmp_path / "runs"), "--json", "--quiet"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(json.loads(done.stdout.strip().splitlines()[-1])["run_dir"])
    over_grpc = CheckpointStore(run_dir / "checkpoints").latest()
    simulated = simulate(config)
    # Assert: the same parameters. Updates arrive in another order over gRPC, so the float64
    # sums differ in the last bits and Adam amplifies that in round 2: measured at most
    # 1.6e-6 on one weight of 36,864; the bound below is still 100x below the weights' scale.
    assert over_grpc is not None and over_grpc.round == 2
    assert list(over_grpc.parameters) == list(simulated.params)
    for name, value in simulated.params.items():
        np.testing.assert_allclose(over_grpc.parameters[name], value, rtol=1e-3, atol=1e-5)
    assert simulated.summary["partition"] == partition


def test_simulation_refuses_private_runs(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY.format(algorithm="fedpe", partition="equal"))
    config = load_config(path, ["privacy.unit=client", "privacy.noise_multiplier=1.0"])
    with pytest.raises(ConfigError, match="non-private rounds only"):
        simulate(config)
