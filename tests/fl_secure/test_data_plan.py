"""The data plan's held-out clients: partitioned with the others, disjoint from training."""

from __future__ import annotations

import numpy as np
import pytest

from fl_secure.config import Config, config_from_dict
from fl_secure.data.plan import load_dataset, plan_federation
from fl_secure.errors import ConfigError, DataError


def _config(kind: str, held_out_clients: int, clients: list[str] | None = None) -> Config:
    partition: dict[str, object] = {
        "kind": kind, "num_clients": 4, "held_out_clients": held_out_clients,
    }  # fmt: skip
    if clients is not None:
        partition["clients"] = clients
    return config_from_dict({
        "data": {"image_size": 32, "num_identities": 40, "images_per_identity": 4,
                 "held_out_identities": 5},
        "partition": partition, "server": {"min_clients": 2},
    })  # fmt: skip


def _ids(share) -> set[int]:  # type: ignore[no-untyped-def]
    return set(np.concatenate([share.train.labels.numpy(), share.test.labels.numpy()]).tolist())


@pytest.mark.parametrize("kind", ["equal", "lognormal", "dirichlet"])
def test_held_out_clients_are_identity_disjoint_and_outside_the_label_space(kind: str) -> None:
    # Execute
    plan = plan_federation(_config(kind, 2))
    # Assert: 4 training + 2 held-out clients; together they hold the 35 non-held-out ids
    assert len(plan.clients) == 4 and len(plan.held_out_clients) == 2
    training = set().union(*(_ids(s) for s in plan.clients))
    newcomers = [_ids(s) for s in plan.held_out_clients]
    assert all(newcomers) and not newcomers[0] & newcomers[1]
    assert not training & (newcomers[0] | newcomers[1])
    assert len(training | newcomers[0] | newcomers[1]) == 35
    assert set(plan.train_identities.tolist()) == training  # a global head has no row for them
    assert not set(plan.held_out.identities().tolist()) & (newcomers[0] | newcomers[1])
    assert len(plan.held_out_client_sizes()) == 2


def test_no_held_out_clients_keeps_every_identity_in_training() -> None:
    plan = plan_federation(_config("equal", 0))
    assert plan.held_out_clients == [] and len(plan.train_identities) == 35
    assert [len(s.train.identities()) for s in plan.clients] == [9, 9, 9, 8]


def test_attribute_held_out_clients_take_the_last_predicates() -> None:
    # Prepare: identity-level traits for the newcomer, so nobody else has its identities
    preds = ["male=1 & age!=3", "male=0 & age!=3", "age=3"]
    config = config_from_dict({
        "data": {"image_size": 32, "num_identities": 40, "images_per_identity": 4,
                 "held_out_identities": 5},
        "partition": {"kind": "attribute", "num_clients": 2, "held_out_clients": 1,
                      "clients": preds},
        "server": {"min_clients": 2},
    })  # fmt: skip
    # Execute
    plan = plan_federation(config)
    # Assert: the newcomer holds exactly the age=3 images, and they are not in the label space
    share = plan.held_out_clients[0]
    for part in (share.train, share.test):
        assert (part.attributes["age"] == 3).all()
    assert not set(plan.train_identities.tolist()) & _ids(share)


def test_attribute_newcomer_sharing_all_identities_with_training_is_refused() -> None:
    # hat is per image and rare (2-15% of an identity's images): every identity with a hat
    # image also has images without one, which the training client takes
    config = config_from_dict({
        "data": {"image_size": 32, "num_identities": 40, "images_per_identity": 6,
                 "held_out_identities": 0},
        "partition": {"kind": "attribute", "num_clients": 1, "held_out_clients": 1,
                      "clients": ["hat=0", "hat=1"]},
        "server": {"min_clients": 1},
    })  # fmt: skip
    with pytest.raises(DataError, match="held-out client 0 .* identity-level attributes"):
        plan_federation(config)


def test_attribute_predicates_must_cover_held_out_clients_too() -> None:
    with pytest.raises(ConfigError, match="num_clients \\+ held_out_clients is 5"):
        _config("attribute", 1, ["male=1"] * 4)
    with pytest.raises(DataError, match="cannot be spread over 41 clients"):
        plan_federation(
            config_from_dict(
                {
                    "data": {
                        "image_size": 32,
                        "num_identities": 40,
                        "images_per_identity": 4,
                        "held_out_identities": 0,
                    },
                    "partition": {"num_clients": 4, "held_out_clients": 37},
                    "server": {"min_clients": 2},
                }
            )  # fmt: skip
        )


def test_manifest_lists_each_clients_identities_as_sampled() -> None:
    plan = plan_federation(_config("lognormal", 1))
    m = plan.manifest()
    clients = m["clients"]
    assert isinstance(clients, dict) and list(clients) == [
        f"client-{k}" for k in range(len(plan.clients))
    ]
    for share, entry in zip(plan.clients, clients.values(), strict=True):
        assert entry["identities"] == sorted(_ids(share))
        assert (entry["train_images"], entry["test_images"]) == (len(share.train), len(share.test))
    everyone = [i for e in clients.values() for i in e["identities"]]
    everyone += [i for e in m["held_out_clients"] for i in e["identities"]]  # type: ignore[attr-defined]
    assert len(everyone) == len(set(everyone))  # disjoint
    assert set(m["held_out_identities"]).isdisjoint(everyone)  # type: ignore[arg-type]


def test_identities_no_attribute_predicate_matches_are_named_in_the_manifest() -> None:
    # Prepare: two clients whose predicates leave out every identity of age 3
    config = config_from_dict({
        "data": {"image_size": 32, "num_identities": 40, "images_per_identity": 4,
                 "held_out_identities": 5},
        "partition": {"kind": "attribute", "num_clients": 2,
                      "clients": ["male=1 & age!=3", "male=0 & age!=3"]},
        "server": {"min_clients": 2},
    })  # fmt: skip
    # Execute
    plan = plan_federation(config)
    # Assert: exactly the training identities of no client, recorded with the partition
    held = set().union(*(_ids(s) for s in plan.clients))
    missing = sorted(set(plan.train_identities.tolist()) - held)
    assert missing and plan.unassigned_identities().tolist() == missing
    assert plan.manifest()["unassigned_identities"] == missing
    assert plan_federation(_config("equal", 0)).manifest()["unassigned_identities"] == []


@pytest.mark.parametrize("kind", ["equal", "domain"])
def test_a_held_out_set_without_impostor_or_genuine_pairs_is_refused(kind: str) -> None:
    # Prepare: 1 held-out identity (no impostor pair); held-out identities of one image each
    def config(held_out: int) -> Config:
        return config_from_dict({
            "data": {"image_size": 32, "num_identities": 12, "images_per_identity": 4,
                     "held_out_identities": held_out},
            "partition": {"kind": kind, "num_clients": 2}, "server": {"min_clients": 2},
        })  # fmt: skip

    full = load_dataset(config(3).data, seed=0)
    labels = full.labels.numpy()
    one_each = full.subset(np.unique(labels, return_index=True)[1])  # one image per identity
    # Execute / Assert
    with pytest.raises(DataError, match=r"data.held_out_identities = 1: .* at least 2 held-out"):
        plan_federation(config(1))
    if kind == "equal":  # a domain plan draws its held-out images from the generator itself
        with pytest.raises(DataError, match=r"the 3 held-out identities \(data.held_out_"
                           r"identities\) have one image each: .* genuine pairs"):  # fmt: skip
            plan_federation(config(3), one_each)
    assert len(plan_federation(config(2)).held_out.identities()) == 2
    assert len(plan_federation(config(0)).held_out) == 0  # no held-out evaluation at all
