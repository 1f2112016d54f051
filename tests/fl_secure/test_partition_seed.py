"""``partition.seed``: one data split for runs that differ in ``run.seed`` only.

Without it the plan is today's, bit for bit (digests computed on the code before the key
existed); with it the data, held-out identities, partition and per-client splits follow
``partition.seed`` while ``run.seed`` still seeds the model.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from typing import Any

import numpy as np
import pytest
import torch

from fl_secure.config import config_fingerprint, config_from_dict, config_to_toml
from fl_secure.config.to_toml import config_sections_to_toml
from fl_secure.data.plan import FederatedData, plan_federation
from fl_secure.errors import ConfigError
from fl_secure.training import build_run_model

#: sha256 of the manifest and every share's label order, for run.seed = 3 and no
#: partition.seed, computed with the code before partition.seed existed (git main 18282e5)
BEFORE = {
    "lognormal": "1be08bf86af974c7a89d9c3ee3944846a2c4689f4470f89c09bc4cc1a28bed7a",
    "domain": "ac3e4b1888d37c718a2a5ffa9b80c5a906427c48bbad5c3428458654816dacb7",
}


def _config(kind: str, run_seed: int, partition_seed: int | None = None) -> Any:
    partition: dict[str, Any] = {"kind": kind, "num_clients": 3}
    if kind != "domain":
        partition["held_out_clients"] = 1
    if partition_seed is not None:
        partition["seed"] = partition_seed
    return config_from_dict({
        "run": {"seed": run_seed},
        "data": {"image_size": 32, "num_identities": 30, "images_per_identity": 4,
                 "held_out_identities": 5, "degrade": "occlusion:0.2"},
        "partition": partition, "server": {"min_clients": 2},
    })  # fmt: skip


def _digest(plan: FederatedData) -> str:
    h = hashlib.sha256(json.dumps(plan.manifest(), sort_keys=True).encode())
    for share in [*plan.clients, *plan.held_out_clients]:
        for part in (share.train, share.test):
            h.update(part.labels.numpy().astype(np.int64).tobytes())
    h.update(plan.held_out.labels.numpy().astype(np.int64).tobytes())
    return h.hexdigest()


def _same_plan(a: FederatedData, b: FederatedData) -> None:
    """Identities, label order and every image tensor equal (bit for bit)."""
    assert a.manifest() == b.manifest()
    assert np.array_equal(a.train_identities, b.train_identities)
    pairs = [(a.held_out, b.held_out)]
    for x, y in zip([*a.clients, *a.held_out_clients], [*b.clients, *b.held_out_clients],
                    strict=True):  # fmt: skip
        pairs += [(x.train, y.train), (x.test, y.test)]
    for x, y in pairs:
        assert torch.equal(x.labels, y.labels) and torch.equal(x.images, y.images)


@pytest.mark.parametrize("kind", ["lognormal", "domain"])
def test_without_partition_seed_the_plan_is_as_before(kind: str) -> None:
    assert _digest(plan_federation(_config(kind, 3))) == BEFORE[kind]


@pytest.mark.parametrize("kind", ["lognormal", "domain"])
def test_partition_seed_s_gives_the_plan_of_run_seed_s(kind: str) -> None:
    # the split under partition.seed = 3 is the one run.seed = 3 alone draws, whatever run.seed
    _same_plan(
        plan_federation(_config(kind, 11, partition_seed=3)), plan_federation(_config(kind, 3))
    )


@pytest.mark.parametrize("kind", ["lognormal", "dirichlet", "domain"])
def test_run_seeds_share_the_plan_under_one_partition_seed(kind: str) -> None:
    # Execute
    first, second = _config(kind, 0, partition_seed=5), _config(kind, 1, partition_seed=5)
    # Assert: same plan; without partition.seed the two run seeds draw different ones
    _same_plan(plan_federation(first), plan_federation(second))
    assert (
        plan_federation(_config(kind, 0)).manifest() != plan_federation(_config(kind, 1)).manifest()
    )


def test_run_seed_still_seeds_the_model() -> None:
    first, second = _config("equal", 0, partition_seed=5), _config("equal", 1, partition_seed=5)
    a, b = build_run_model(first, 10), build_run_model(second, 10)
    again = build_run_model(_config("equal", 0, partition_seed=9), 10)
    weights = [dict(m.state_dict()) for m in (a, b, again)]
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


def test_unset_partition_seed_leaves_the_config_text_and_fingerprint_alone() -> None:
    # Prepare
    unset, explicit = _config("equal", 2), _config("equal", 2, partition_seed=-1)
    chosen = _config("equal", 2, partition_seed=0)
    # Assert: -1 is not written (a run recorded before the key keeps its fingerprint) ...
    assert config_to_toml(unset) == config_to_toml(explicit)
    assert config_fingerprint(unset) == config_fingerprint(explicit)
    partition = tomllib.loads(config_to_toml(unset))["partition"]
    assert "seed" not in partition and partition["num_clients"] == 3
    assert "seed" not in tomllib.loads(config_sections_to_toml(unset))["partition"]
    # ... a set one is, changes the fingerprint, reads back, and reaches the clients
    assert config_fingerprint(chosen) != config_fingerprint(unset)
    assert tomllib.loads(config_to_toml(chosen))["partition"]["seed"] == 0
    assert config_from_dict(tomllib.loads(config_to_toml(chosen))) == chosen
    client = config_from_dict(tomllib.loads(config_sections_to_toml(chosen)))
    assert client.data_seed == 0 and client.run.seed == 2


def test_data_seed_follows_partition_seed_or_run_seed() -> None:
    assert _config("equal", 7).data_seed == 7
    assert _config("equal", 7, partition_seed=0).data_seed == 0


@pytest.mark.parametrize("bad", [-2, 2**63, True, "0"])
def test_partition_seed_out_of_range_is_named(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"partition\.seed"):
        config_from_dict({"partition": {"seed": bad}})
