"""Bounded client influence without DP: no client can stop a run or choose the global model.

Two attacks from an enrolled client: an update of 3e38 everywhere (finite, so it passes the
NaN/Inf check) that made the aggregate diverge and the run abort, and a claim of 2**63
examples that made the weighted mean its own update. Each is driven through the coordinator
in process, as a hostile client would drive the servicer.
"""

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from fl_secure.config import ServerConfig, config_from_dict
from fl_secure.errors import ConfigError
from fl_secure.evaluation import DegenerateEmbeddings
from fl_secure.messages import TaskKind, Tensors
from fl_secure.runs import RunDir
from server.coordinator import Coordinator
from server.influence import diverged_offenders, norm_outliers, update_norm, weight_cap
from server.settings import CoordinatorSettings

from .coordinator_clients import answer_every_task  # type: ignore[import-not-found]

ATTACK = 3e38  # finite in float32 (max 3.4e38); the mean of a few such updates overflows a model


class FakeClock:
    """A clock that stands still: attempts end only when every member answered."""

    def __call__(self) -> float:
        return 0.0


def _initial() -> Tensors:
    return OrderedDict([("w", np.zeros((2, 2), np.float32)), ("b", np.zeros(3, np.float32))])


def _add(params: Tensors, update: Tensors, round_: int) -> Tensors:
    return OrderedDict((k, (params[k] + update[k]).astype(params[k].dtype)) for k in params)


def _embeddings_norm(params: Tensors) -> dict[str, float]:
    """Stand-in for the held-out evaluation: its float32 "embeddings" overflow as a real
    model's do when its weights are this large (then vet_model refuses the model)."""
    with np.errstate(over="ignore"):
        energy = sum(float(np.sum(np.square(v, dtype=np.float32))) for v in params.values())
    if not math.isfinite(energy):
        raise DegenerateEmbeddings("embedding rows [0] are zero or not finite")
    return {"energy": energy}


def _coordinator(tmp_path: Path, enrolled: set[str], **kw) -> Coordinator:
    settings = CoordinatorSettings(
        rounds=kw.pop("rounds", 1),
        min_clients=kw.pop("min_clients", 2),
        round_timeout=100.0,
        poll_wait=0.05,
        final_evaluation=False,
        **kw,
    )
    return Coordinator(
        settings,
        _initial(),
        enrolled=enrolled,
        run_dir=RunDir(tmp_path),
        server_step=_add,
        evaluator=_embeddings_norm,
        clock=FakeClock(),
    )


def _run(coord: Coordinator, clients: dict[str, tuple[float, int]]) -> list[str]:
    """Run ``coord`` to its end with ``clients`` (id -> (update value, example count))."""
    refused: list[str] = []
    driver = threading.Thread(target=coord.run)
    driver.start()
    workers = [
        threading.Thread(target=answer_every_task, args=(coord, c, v, n, refused), daemon=True)
        for c, (v, n) in clients.items()
    ]
    for w in workers:
        w.start()
    driver.join(timeout=60)
    for w in workers:
        w.join(timeout=10)
    assert not driver.is_alive()
    return refused


# ----------------------------------------------- an update of 3e38 everywhere
def test_an_update_of_3e38_everywhere_is_dropped_by_name_and_the_run_completes(
    tmp_path: Path,
) -> None:
    # Prepare: two honest clients and one that sends 3e38 in every tensor, every round
    coord = _coordinator(tmp_path, {"c0", "c1", "c2"}, rounds=2)
    for c in ("c0", "c1", "c2"):
        coord.join(c, 10)
    # Execute
    _run(coord, {"c0": (1.0, 10), "c1": (2.0, 10), "c2": (ATTACK, 10)})
    # Assert: the run completed; each round's model is the mean of the other two, 1.5
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_array_equal(coord.params["w"], np.full((2, 2), 3.0, np.float32))
    np.testing.assert_array_equal(coord.params["b"], np.full(3, 3.0, np.float32))
    records = RunDir(tmp_path).read_metrics()
    dropped = [r for r in records if r.get("kind") == "aborted"]
    assert [(r["round"], r["attempt"]) for r in dropped] == [(1, 0), (2, 0)]
    for r in dropped:  # the attempt names the client, its norm and the bound it broke
        assert (
            "the updates of c2 (7.94e+38) are over server.update_norm_factor = 10" in (r["reason"])
        )
        assert r["failed"]["c2"].startswith("update dropped: its L2 norm 7.937e+38")
    completed = [r for r in records if "kind" not in r and r["round"] > 0]
    assert [(r["round"], r["attempt"], r["num_updates"]) for r in completed] == [
        (1, 1, 2),
        (2, 1, 2),
    ]
    assert sorted(completed[0]["clients"]) == ["c0", "c1"]


def test_a_diverged_aggregate_of_two_updates_is_retried_without_the_one_that_stands_out(
    tmp_path: Path,
) -> None:
    # Prepare: two updates per attempt, so no median can tell them apart before the step;
    # the 3e38 one makes the new model's embeddings overflow
    coord = _coordinator(tmp_path, {"c0", "c2"}, min_clients=1)
    for c in ("c0", "c2"):
        coord.join(c, 10)
    # Execute
    _run(coord, {"c0": (1.0, 10), "c2": (ATTACK, 10)})
    # Assert: the round is retried without c2 (named), c0's update is the model
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_array_equal(coord.params["w"], np.ones((2, 2), np.float32))
    records = RunDir(tmp_path).read_metrics()
    (refused,) = [r for r in records if r.get("kind") == "aborted"]
    assert refused["round"] == 1 and refused["attempt"] == 0
    assert refused["reason"].startswith("round 1: the new global model's held-out embeddings")
    assert "blamed on the update(s) of c2 (7.94e+38)" in refused["reason"]
    assert refused["reason"].endswith("the round is retried without them")
    assert records[-1]["round"] == 1 and records[-1]["clients"] == {"c0": {}}
    assert coord.store.latest().round == 1


def test_an_update_over_max_update_norm_is_refused_at_upload(tmp_path: Path) -> None:
    # Prepare: an absolute bound; c2's update has L2 norm 100 * sqrt(7) = 264.6
    coord = _coordinator(tmp_path, {"c0", "c1", "c2"}, max_update_norm=50.0)
    for c in ("c0", "c1", "c2"):
        coord.join(c, 10)
    # Execute
    refused = _run(coord, {"c0": (1.0, 10), "c1": (2.0, 10), "c2": (100.0, 10)})
    # Assert: refused by name in the first attempt, which completes with the others
    assert coord.status == "completed", coord.stop_reason
    message = "the update of c2 is refused: its L2 norm 264.6 is over server.max_update_norm = 50"
    assert refused == [message]
    record = RunDir(tmp_path).read_metrics()[-1]
    assert (record["attempt"], record["failed"]) == (0, {"c2": message})
    np.testing.assert_array_equal(coord.params["w"], np.full((2, 2), 1.5, np.float32))


def test_honest_updates_that_all_diverge_still_stop_the_run_by_name(tmp_path: Path) -> None:
    # Prepare: no update stands out (all 3e38): the run's own settings are to blame
    coord = _coordinator(tmp_path, {"c0", "c1", "c2"})
    for c in ("c0", "c1", "c2"):
        coord.join(c, 10)
    # Execute
    _run(coord, dict.fromkeys(("c0", "c1", "c2"), (ATTACK, 10)))
    # Assert: stopped after one attempt (a retry would diverge again); nothing checkpointed
    assert coord.status == "aborted"
    assert coord.stop_reason.startswith("round 1: the new global model's held-out embeddings")
    assert "blamed" not in coord.stop_reason and "retried" not in coord.stop_reason
    assert coord.store.latest() is None


# ----------------------------------------------------- a claim of 2**63 examples
def test_a_claim_of_2_pow_63_examples_cannot_make_the_mean_its_own_update(
    tmp_path: Path,
) -> None:
    # Prepare: c2 states 2**63 images at join and claims them with its update of 0.5
    coord = _coordinator(tmp_path, {"c0", "c1", "c2"})
    coord.join("c0", 10)
    coord.join("c1", 10)
    coord.join("c2", 2**63)
    # Execute
    _run(coord, {"c0": (1.0, 10), "c1": (2.0, 10), "c2": (0.5, 2**63)})
    # Assert: c2 weighs 10 x the median stated count (10): (10*1 + 10*2 + 100*0.5) / 120
    assert coord.status == "completed", coord.stop_reason
    expected = np.float32((10 * 1.0 + 10 * 2.0 + 100 * 0.5) / 120)
    np.testing.assert_array_equal(coord.params["w"], np.full((2, 2), expected))
    assert not np.any(coord.params["w"] == np.float32(0.5))
    record = RunDir(tmp_path).read_metrics()[-1]
    assert record["weights_capped"] == {"c2": 100.0}


def test_max_examples_caps_every_weight(tmp_path: Path) -> None:
    # Prepare: an absolute cap of 5 and no relative one: 40 and 20 images weigh 5 each
    coord = _coordinator(tmp_path, {"c0", "c1"}, max_examples=5, examples_factor=0.0)
    coord.join("c0", 40)
    coord.join("c1", 20)
    # Execute
    _run(coord, {"c0": (1.0, 40), "c1": (2.0, 20)})
    # Assert: the unweighted mean, not (40*1 + 20*2) / 60
    np.testing.assert_array_equal(coord.params["b"], np.full(3, 1.5, np.float32))
    assert RunDir(tmp_path).read_metrics()[-1]["weights_capped"] == {"c0": 5.0, "c1": 5.0}


# ------------------------------------------------------------------ the rules
def test_weight_cap_is_the_servers_not_a_clients_claim() -> None:
    assert weight_cap([10, 10, 2**63], 0, 10.0) == 100.0
    assert weight_cap([10, 12, 2**63, 0], 0, 10.0) == 120.0  # 0s (no statement) ignored
    assert weight_cap([10, 10, 2**63], 50, 10.0) == 50.0
    assert weight_cap([10, 10, 2**63], 0, 0.0) == math.inf
    assert weight_cap([], 0, 10.0) == math.inf


def test_norm_rules() -> None:
    # the L2 norm of all tensors together, in float64
    assert update_norm({"a": np.array([3.0], np.float32), "b": np.array([4.0])}) == 5.0
    assert update_norm({"a": np.full(4, 1e200)}) == math.inf  # overflows float64: refused
    # a minority cannot drag the median up to its own update; a zero median screens nothing
    assert norm_outliers({"a": 1.0, "b": 2.0, "c": 1e9}, 10.0) == (["c"], 2.0)
    assert norm_outliers({"a": 1.0, "b": 1e9}, 10.0) == ([], 5e8 + 0.5)
    assert norm_outliers({"a": 0.0, "b": 0.0, "c": 1e9}, 10.0) == ([], 0.0)
    assert norm_outliers({"a": 1.0, "b": 2.0, "c": 1e9}, 0.0) == ([], 0.0)
    # a diverged aggregate is blamed on the update that stands out against the others
    assert diverged_offenders({"a": 1.0, "b": 1e9}, 10.0) == ["b"]
    assert diverged_offenders({"a": 1.0, "b": 2.0}, 10.0) == []
    assert diverged_offenders({"a": 1.0}, 10.0) == []


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("max_update_norm", -1.0, "a finite number >= 0"),
        ("max_update_norm", math.inf, "a finite number >= 0"),
        ("update_norm_factor", 1.5, "0 (off) or a finite number >= 2"),
        ("examples_factor", math.nan, "0 (off) or a finite number >= 2"),
        ("max_examples", -1, "an integer >= 0"),
    ],
)
def test_the_bounds_are_checked_in_the_config(key: str, value: float, allowed: str) -> None:
    message = re.escape(f"server.{key}: invalid value; allowed: {allowed}")
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**{key: value})


def test_a_config_file_sets_the_bounds() -> None:
    server = {"max_update_norm": 25, "update_norm_factor": 4, "max_examples": 1000}
    config = config_from_dict({"server": server})
    assert (config.server.max_update_norm, config.server.update_norm_factor) == (25.0, 4.0)
    assert (config.server.max_examples, config.server.examples_factor) == (1000, 10.0)
    with pytest.raises(ConfigError, match=re.escape("server.examples_factor: invalid value")):
        config_from_dict({"server": {"examples_factor": 1}})


@pytest.mark.parametrize("attempt", [0, 2])
def test_a_diverged_secure_sum_is_retried_with_a_fresh_cohort_while_retries_last(
    tmp_path: Path, attempt: int
) -> None:
    from fl_secure.errors import RoundAborted
    from server.attempt import Attempt

    # Prepare: a securely aggregated attempt (its session stands in: only its presence is
    # read) whose sum made the model non-finite; no update of it was seen, so none is named
    coord = _coordinator(tmp_path, {"c0", "c1", "c2"})
    cohort = dict.fromkeys(("c0", "c1", "c2"), b"n")
    rnd = Attempt(1, TaskKind.TRAIN, attempt, cohort, 0.0, None, secure=object())  # type: ignore[arg-type]
    diverged = OrderedDict([("w", np.full((2, 2), np.inf, np.float32)), ("b", np.zeros(3))])
    # Execute / Assert: attempts 0 and 1 are retried; the last (server.max_retries = 2) stops
    if attempt == 2:
        with pytest.raises(RoundAborted, match="only their sum could be vetted"):
            coord._vet_model(rnd, diverged)
        return
    assert coord._vet_model(rnd, diverged) == (False, None)
    (record,) = RunDir(tmp_path).read_metrics()
    assert record["reason"].startswith("round 1: the aggregate made the global model non-finite")
    assert record["reason"].endswith(
        "the updates were masked, so only their sum could be vetted: a client's update or "
        "train.lr is to blame; the round is retried with a fresh cohort"
    )


def test_under_local_noise_the_dropped_attempt_is_counted_and_the_round_completes(
    tmp_path: Path,
) -> None:
    from fl_secure.config import PrivacyConfig
    from privacy.dp.calibration import epsilon_for
    from privacy.dp.noise import SeededGaussian
    from privacy.ledger.run_ledger import Ledger
    from privacy.server_round import open_server_privacy

    # Prepare: client-level DP with local noise (the server sees each noised update, and
    # adds nothing); c3 sends 3e38 everywhere in place of its clipped, noised update
    clients = ("c0", "c1", "c2", "c3")
    cfg = PrivacyConfig(unit="client", noise_placement="local", noise_multiplier=2.0)
    privacy = open_server_privacy(
        cfg, tmp_path / "ledger.sqlite", "test-run", rounds=1, population=4,
        clients_per_round=0, sample_rate=0.0, source=SeededGaussian(0),
    )  # fmt: skip
    settings = CoordinatorSettings(
        rounds=1, min_clients=3, round_timeout=100.0, poll_wait=0.05, final_evaluation=False
    )
    coord = Coordinator(
        settings,
        _initial(),
        enrolled=set(clients),
        run_dir=RunDir(tmp_path),
        server_step=_add,
        evaluator=_embeddings_norm,
        clock=FakeClock(),
        privacy=privacy,
    )
    for c in clients:
        coord.join(c, 10)
    # Execute
    _run(coord, {"c0": (0.1, 1), "c1": (0.2, 1), "c2": (0.3, 1), "c3": (ATTACK, 1)})
    # Assert: completed without c3; the sum of the others over the plan's denominator
    assert coord.status == "completed", coord.stop_reason
    assert privacy.plan is not None
    expected = np.float32((0.1 + 0.2 + 0.3) / privacy.plan.denominator)
    np.testing.assert_allclose(coord.params["w"], np.full((2, 2), expected), rtol=1e-6)
    # the dropped attempt's updates were seen: composed like a round before the round's row
    privacy.ledger.close()
    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.verify().ok
        entries = ledger.entries()
    assert [(e.kind, e.round) for e in entries if e.kind != "note"] == [
        ("discarded_sum", 1),
        ("client_level", 1),
    ]
    assert "the updates of c3 (7.94e+38)" in entries[0].payload["message"]

    def eps(steps: int) -> float:
        return epsilon_for(
            accountant="pld",
            noise_multiplier=2.0,
            sample_rate=1.0,
            steps=steps,
            delta=1e-5,
            noise="discrete_gaussian",  # local noise is integer noise, zCDP-accounted
        )

    client_level = [e for e in entries if e.kind == "client_level"][0]
    assert client_level.payload["epsilon"] == pytest.approx(eps(2), rel=1e-9)
