"""The person partition: one identity per client, so client-level DP is person-level DP."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fl_secure.algorithms.registry import check_config
from fl_secure.config import Config, config_from_dict
from fl_secure.data.plan import plan_federation
from fl_secure.data.splits import person_partition
from fl_secure.errors import ConfigError, DataError
from fl_secure.models.heads import make_head


def _config(num_clients: int = 30, held_out_clients: int = 0, seed: int = 3, **data: int) -> Config:
    values = {"image_size": 32, "num_identities": num_clients + held_out_clients + 6,
              "images_per_identity": 4, "held_out_identities": 6} | data  # fmt: skip
    return config_from_dict({
        "data": values,
        "partition": {"kind": "person", "num_clients": num_clients,
                      "held_out_clients": held_out_clients, "seed": seed},
        "server": {"min_clients": 2},
    })  # fmt: skip


def _ids(share) -> set[int]:  # type: ignore[no-untyped-def]
    return set(np.concatenate([share.train.labels.numpy(), share.test.labels.numpy()]).tolist())


def test_person_partition_gives_each_client_one_distinct_identity() -> None:
    ids = np.arange(100, 150)
    parts = person_partition(ids, 50, seed=7)
    assert [len(p) for p in parts] == [1] * 50
    assert sorted(int(p[0]) for p in parts) == ids.tolist()  # each identity exactly once
    again = person_partition(ids, 50, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = person_partition(ids, 50, seed=8)
    assert [int(p[0]) for p in other] != [int(p[0]) for p in parts]  # the seed shuffles


@pytest.mark.parametrize(("count", "clients"), [(49, 50), (51, 50)])
def test_person_partition_refuses_a_count_other_than_the_clients(count: int, clients: int) -> None:
    with pytest.raises(DataError, match=f"{count} (training )?identities"):
        person_partition(np.arange(count), clients, seed=0)


def test_person_plan_holds_all_images_of_one_identity_per_client() -> None:
    # Execute
    plan = plan_federation(_config(num_clients=30, held_out_clients=2))
    # Assert: every client one identity, with all its 4 images split 3 train / 1 test
    assert len(plan.clients) == 30 and len(plan.held_out_clients) == 2
    per_client = [_ids(s) for s in plan.clients + plan.held_out_clients]
    assert all(len(ids) == 1 for ids in per_client)
    assert len(set().union(*per_client)) == 32  # distinct people
    assert all(len(s.train) == 3 and len(s.test) == 1 for s in plan.clients)
    held = set(plan.held_out.identities().tolist())
    assert len(held) == 6 and not held & set().union(*per_client)
    training = set().union(*per_client[:30])
    assert set(plan.train_identities.tolist()) == training


def test_person_plan_is_deterministic_by_partition_seed() -> None:
    first = [_ids(s) for s in plan_federation(_config(seed=3)).clients]
    again = [_ids(s) for s in plan_federation(_config(seed=3)).clients]
    other = [_ids(s) for s in plan_federation(_config(seed=4)).clients]
    assert first == again and first != other


def test_person_config_refuses_identities_that_do_not_match_the_clients() -> None:
    with pytest.raises(ConfigError, match="set data.num_identities = 36"):
        _config(num_clients=30, num_identities=40)


def test_person_config_allows_a_population_of_devices() -> None:
    config = _config(num_clients=5000)
    assert config.partition.num_clients == 5000


def test_person_config_refuses_attribute_predicates() -> None:
    with pytest.raises(ConfigError, match="partition.clients"):
        config_from_dict({
            "data": {"num_identities": 46, "held_out_identities": 6},
            "partition": {"kind": "person", "num_clients": 40, "clients": ["male=1"]},
        })  # fmt: skip


@pytest.mark.parametrize("kind", ["softmax", "cosface", "arcface"])
def test_a_softmax_over_one_own_identity_gives_no_gradient(kind: str) -> None:
    # why the person partition refuses the softmax-only designs: one class, loss 0, grad 0
    head = make_head(kind, 1, 8)  # type: ignore[arg-type]
    embeddings = torch.randn(5, 8, requires_grad=True)
    loss = F.cross_entropy(
        head(embeddings, torch.zeros(5, dtype=torch.long)), torch.zeros(5, dtype=torch.long)
    )
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert embeddings.grad is not None and float(embeddings.grad.abs().max()) == 0.0


@pytest.mark.parametrize("name", ["fedavg", "fedpe", "fedgc", "fedcos", "hfmaml", "hfmaml-global"])
def test_person_partition_refuses_designs_whose_loss_is_a_softmax_over_own_classes(
    name: str,
) -> None:
    config = _config(num_clients=30)
    config = replace(config, algorithm=replace(config.algorithm, name=name))
    with pytest.raises(ConfigError, match=f"{name}.*partition.kind = 'person'.*0 for every"):
        check_config(config)


def test_person_partition_accepts_adafedfr_with_public_negatives() -> None:
    config = _config(num_clients=30)
    check_config(replace(config, algorithm=replace(config.algorithm, name="adafedfr")))
