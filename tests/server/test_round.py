"""The round steps the coordinator and the simulation share: sent, split, stepped, vetted."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest

from fl_secure.algorithms import get_strategy
from fl_secure.algorithms.fedgc import WEIGHT
from fl_secure.config import config_from_dict
from fl_secure.data.plan import plan_federation
from fl_secure.errors import ProtocolError
from fl_secure.evaluation import DegenerateEmbeddings
from fl_secure.messages import LocalTraining, Tensors, TensorSpec
from fl_secure.training import build_model
from server.round import RoundRules, RoundState, round_rules, update_weight, vet_model

HEAD = (TensorSpec(WEIGHT, np.dtype("float32"), (-1, 4)),)


def _params() -> Tensors:
    return OrderedDict([("backbone.w", np.ones((2, 3), np.float32))])


def _add(params: Tensors, update: Tensors, round_: int) -> Tensors:
    return OrderedDict((k, params[k] + update[k]) for k in params)


def test_the_learning_rate_follows_the_schedule() -> None:
    # Prepare: 4 rounds at lr 0.1 under cosine decay
    rules = RoundRules(rounds=4, training=LocalTraining(learning_rate=0.1), lr_schedule="cosine")
    # Execute
    first, third = rules.training_for(1), rules.training_for(3)
    # Assert: full rate in round 1, half-way down the cosine in round 3; the rest as set
    assert first.learning_rate == pytest.approx(0.1)
    assert third.learning_rate == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 2 / 4)))
    assert third.batch_size == rules.training.batch_size
    assert RoundRules(rounds=4).learning_rate(3) == LocalTraining().learning_rate


def test_a_client_is_sent_the_parameters_its_own_head_and_the_broadcast() -> None:
    # Prepare: a held head for c0 and a broadcaster
    r = np.full((2, 4), 3.0, np.float32)
    state = RoundState(
        _params(),
        RoundRules(rounds=1, head_specs=HEAD, max_head_rows=5),
        server_step=_add,
        broadcaster=lambda params, round_: OrderedDict([("broadcast.r", r * round_)]),
    )
    assert state.sent_to("c0") is state.params  # nothing else yet: the parameters as they are
    state.heads = {"c0": OrderedDict([(WEIGHT, np.zeros((2, 4), np.float32))])}
    # Execute
    state.prepare_broadcast(2)
    mine, theirs = state.sent_to("c0"), state.sent_to("c1")
    # Assert: parameters, then the client's own head, then the broadcast; no other's head
    assert list(mine) == ["backbone.w", WEIGHT, "broadcast.r"]
    assert list(theirs) == ["backbone.w", "broadcast.r"]
    np.testing.assert_array_equal(mine["broadcast.r"], r * 2)
    assert state.sent_bytes("c0") == 24 + 32 + 32 and state.sent_bytes("c1") == 24 + 32
    assert state.bytes_per_client() == {
        "broadcast": 32, "parameters_down": 24, "parameters_up": 24, "total": 80
    }  # fmt: skip


@pytest.mark.parametrize("name", ["r", "broadcast.nan"])
def test_a_bad_broadcast_is_refused(name: str) -> None:
    bad = np.full(2, np.nan if name.endswith("nan") else 1.0, np.float32)
    state = RoundState(
        _params(),
        RoundRules(rounds=1),
        server_step=_add,
        broadcaster=lambda params, round_: OrderedDict([(name, bad)]),
    )
    with pytest.raises(ProtocolError, match="bad name or non-finite values"):
        state.prepare_broadcast(1)
    assert not state.broadcast


def test_an_upload_s_head_is_kept_apart_and_checked() -> None:
    # Prepare: a head template of up to 3 rows
    state = RoundState(
        _params(), RoundRules(rounds=1, head_specs=HEAD, max_head_rows=3), server_step=_add
    )
    head = np.zeros((2, 4), np.float32)
    upload = OrderedDict([("backbone.w", np.ones((2, 3), np.float32)), (WEIGHT, head)])
    # Execute
    shared, kept = state.split_upload("c0", upload)
    # Assert: the shared part for the mean, the head apart; a head past the rows is refused
    assert list(shared) == ["backbone.w"] and list(kept) == [WEIGHT]
    assert kept[WEIGHT] is head
    too_many = OrderedDict([*shared.items(), (WEIGHT, np.zeros((4, 4), np.float32))])
    with pytest.raises(ProtocolError, match="has 4 rows; this run takes 1 to 3"):
        state.split_upload("c0", too_many)
    plain = RoundState(_params(), RoundRules(rounds=1), server_step=_add)
    assert plain.split_upload("c0", upload) == (upload, OrderedDict())


def test_the_steps_move_the_model_and_the_uploaded_heads_with_the_round_s_lr() -> None:
    # Prepare: a head step that records its learning rate and shifts each head by it
    seen: list[tuple[list[str], float, int]] = []

    def head_step(heads, *, learning_rate: float, round_: int) -> dict[str, Tensors]:
        seen.append((sorted(heads), learning_rate, round_))
        return {
            c: OrderedDict((k, v + learning_rate) for k, v in h.items()) for c, h in heads.items()
        }

    rules = RoundRules(rounds=2, training=LocalTraining(learning_rate=0.5), lr_schedule="cosine")
    state = RoundState(_params(), rules, server_step=_add, head_step=head_step)
    held = OrderedDict([(WEIGHT, np.zeros((1, 4), np.float32))])
    state.heads = {"c0": held, "c1": held}
    # Execute: round 2, where only c1 uploaded its head
    params = state.step(2, OrderedDict([("backbone.w", np.ones((2, 3), np.float32))]))
    heads = state.step_heads(2, {"c1": held})
    # Assert: w + mean; c1's head moved by round 2's lr, c0 kept its own; nothing kept yet
    lr = rules.learning_rate(2)
    assert seen == [(["c1"], lr, 2)]
    np.testing.assert_array_equal(params["backbone.w"], np.full((2, 3), 2.0, np.float32))
    np.testing.assert_array_equal(heads["c1"][WEIGHT], np.full((1, 4), lr, np.float32))
    assert heads["c0"] is held
    assert state.params["backbone.w"][0, 0] == 1.0
    state.advance(params, heads)
    assert state.params is params and state.heads == heads
    assert state.step_heads(3, {}) == heads  # no upload: no step


def test_vetting_refuses_a_diverged_model_and_scores_a_sound_one() -> None:
    def degenerate(params: Tensors) -> dict[str, float]:
        raise DegenerateEmbeddings("embedding rows [0] are zero or not finite")

    nan = OrderedDict([("w", np.array([1.0, np.nan], np.float32))])
    held, reason = vet_model(3, nan, lambda p: {"tar": 1.0})
    assert held is None
    assert reason.startswith("round 3: the aggregate made the global model non-finite in ['w']")
    assert reason.endswith("the model of round 2 is kept")
    held, reason = vet_model(3, _params(), degenerate)
    assert held is None and "round 3: the new global model's held-out embeddings" in reason
    assert vet_model(3, _params(), lambda p: {"tar": float("nan")})[1] == ""
    assert vet_model(3, _params(), None) == (None, "")


def test_an_update_weighs_its_examples_unless_private() -> None:
    assert update_weight(7, private=False) == 7.0
    assert update_weight(7, private=True) == 1.0


def test_the_rules_of_a_run_come_from_its_config() -> None:
    # Prepare: FedGC (server-sees-heads) with the defaults
    config = config_from_dict(
        {"algorithm": {"name": "fedgc"}, "partition": {"num_clients": 2},
         "model": {"backbone": "cnn-small", "embedding_size": 8},
         "train": {"rounds": 3, "lr": 0.01, "lr_schedule": "cosine"}}
    )  # fmt: skip
    strategy = get_strategy(config.algorithm.name, config.algorithm, head=config.model.head)
    plan = plan_federation(config)
    model = build_model(config.model, 1, config.data.image_size, config.run.seed)
    # Execute
    rules = round_rules(config, strategy, model, plan)
    # Assert: any rows up to the plan's identities; the schedule and rate of [train]
    assert [(s.name, s.shape) for s in rules.head_specs] == [(WEIGHT, (-1, 8))]
    assert rules.max_head_rows == len(plan.train_identities)
    assert (rules.rounds, rules.lr_schedule, rules.training.learning_rate) == (3, "cosine", 0.01)
