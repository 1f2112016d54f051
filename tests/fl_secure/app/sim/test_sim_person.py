"""The person partition through the simulation engine: one identity per virtual client, DP.

Client-level DP over single-identity clients is person-level DP; the engine's stated epsilon
for the mechanism it ran (Poisson cohorts, central Gaussian noise of std ``z C``) is
dp_accounting's for the released rounds, and every virtual client holds one person.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant

from fl_secure.app.cli.console import main
from fl_secure.app.simulated_run import write_simulated_run
from fl_secure.config import load_config
from fl_secure.data.plan import plan_federation
from fl_secure.models.factory import get_backbone, save_weights

CONFIG = """
[run]
name = "persondp"
seed = 5
[data]
source = "synthetic"
image_size = 32
num_identities = 36
images_per_identity = 3
held_out_identities = 6
[partition]
kind = "person"
num_clients = 30
seed = 1
[model]
backbone = "cnn-small"
embedding_size = 16
[algorithm]
name = "adafedfr"
public_identities = 8
public_images_per_identity = 3
[train]
rounds = 3
local_steps = 1
batch_size = 2
lr = 0.05
[server]
min_clients = 1
sample_rate = 0.3
[privacy]
unit = "client"
noise_placement = "central"
noise_multiplier = 1.1
clip_norm = 0.5
delta = 1e-3
accountant = "pld"
"""


def test_person_partition_runs_through_the_engine_with_dp_accounting_epsilon(
    tmp_path: Path,
) -> None:
    # Prepare
    path = tmp_path / "person.toml"
    path.write_text(CONFIG)
    config = load_config(path)
    plan = plan_federation(config)
    # every virtual client is one person: one identity in its train and test images
    people = [set(s.train.labels.tolist()) | set(s.test.labels.tolist()) for s in plan.clients]
    assert all(len(p) == 1 for p in people) and len(set().union(*people)) == 30
    # Execute
    run = write_simulated_run(config, tmp_path / "runs")
    summary = json.loads((run / "summary.json").read_text())
    with sqlite3.connect(run / "ledger.sqlite") as db:
        rows = [
            {"kind": k, "round": r, **json.loads(p)}
            for k, r, p in db.execute("SELECT kind, round, payload FROM entries ORDER BY seq")
        ]
    released = [r for r in rows if r["kind"] == "client_level"]
    # Assert: three released rounds of Poisson cohorts drawn from the 30 people
    assert summary["status"] == "completed" and len(released) == 3
    assert all(0 <= size <= 30 for size in summary["cohort_sizes"])
    assert np.mean(summary["cohort_sizes"]) > 0
    # ... the stated (person-level) epsilon: dp_accounting's PLD of the 3 Gaussian releases
    pld = pld_privacy_accountant.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    pld.compose(dp_accounting.GaussianDpEvent(1.1), 3)
    assert summary["epsilon"] == pytest.approx(pld.get_epsilon(1e-3), rel=1e-6)
    assert released[-1]["epsilon"] == summary["epsilon"]


def _pld_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    pld = pld_privacy_accountant.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    pld.compose(dp_accounting.GaussianDpEvent(noise_multiplier), rounds)
    return float(pld.get_epsilon(delta))


def test_person_dp_from_a_pretrained_start_states_the_ledger_epsilon_and_reports(
    tmp_path: Path,
) -> None:
    # Prepare: benchmarks/person_dp_engine.py's run in small: a pretrained backbone of which
    # only the embedding layer trains, the noise calibrated to a target epsilon, delta = 1/N
    torch.manual_seed(3)
    weights = tmp_path / "public.safetensors"
    save_weights(get_backbone("cnn-small", embedding_size=16, image_size=32), weights)
    path = tmp_path / "person.toml"
    path.write_text(CONFIG.replace("noise_multiplier = 1.1", "target_epsilon = 8.0"))
    delta = 1.0 / 30  # 1 / N
    config = load_config(
        path,
        [
            f"model.pretrained={json.dumps(str(weights))}",
            "train.trainable=embedding",
            f"privacy.delta={delta}",
        ],
    )
    # Execute
    run = write_simulated_run(config, tmp_path / "runs")
    summary = json.loads((run / "summary.json").read_text())
    with sqlite3.connect(run / "ledger.sqlite") as db:
        payloads = [
            json.loads(p)
            for (p,) in db.execute(
                "SELECT payload FROM entries WHERE kind = 'client_level' ORDER BY seq"
            )
        ]
    # Assert: three releases, each stating dp_accounting's PLD epsilon of the Gaussian
    # releases so far with the noise multiplier the engine calibrated to the target
    z = summary["privacy"]["noise_multiplier"]
    assert summary["status"] == "completed" and len(payloads) == 3
    assert summary["privacy"]["noise_calibrated_to_target"] is True
    for rounds, payload in enumerate(payloads, start=1):
        assert payload["epsilon"] == pytest.approx(_pld_epsilon(z, rounds, delta), rel=1e-6)
    assert summary["epsilon"] == payloads[-1]["epsilon"] <= 8.0
    # ... calibrated, not merely safe: 1 % less noise would pass the target
    assert _pld_epsilon(0.99 * z, 3, delta) > 8.0
    assert summary["delta"] == delta
    # ... and the compliance report reads the run folder, stating the ledger's epsilon
    assert main(["privacy", "ledger", "--run", str(run), "--verify", "--json"]) == 0
    assert main(["report", "--run", str(run), "--format", "json", "--quiet"]) == 0
    report = json.loads((run / "report" / "report.json").read_text())
    assert report["privacy"]["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-9)
