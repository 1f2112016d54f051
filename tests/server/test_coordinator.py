"""Round logic without a network: cohorts, streaming mean, deadlines, retries, resume."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from fl_secure.errors import CheckpointError, ProtocolError
from fl_secure.messages import Task, TaskKind, UpdateHeader
from fl_secure.runs import RunDir
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.t

    def advance(self, dt: float) -> None:
        with self.lock:
            self.t += dt


def _initial() -> OrderedDict[str, np.ndarray]:
    return OrderedDict([("w", np.zeros((2, 2), np.float32)), ("b", np.zeros(3, np.float32))])


def _add(params, update, round_):
    return OrderedDict((k, params[k] + update[k]) for k in params)


def _coordinator(tmp_path: Path, clock=None, **kw) -> Coordinator:
    settings = CoordinatorSettings(
        rounds=kw.pop("rounds", 2),
        min_clients=kw.pop("min_clients", 2),
        round_timeout=kw.pop("round_timeout", 100.0),
        poll_wait=0.05,
        final_evaluation=kw.pop("final_evaluation", False),
        **kw,
    )
    return Coordinator(
        settings,
        _initial(),
        enrolled={"c0", "c1", "c2"},
        run_dir=RunDir(tmp_path),
        server_step=_add,
        evaluator=lambda p: {"norm": float(sum(np.abs(v).sum() for v in p.values()))},
        clock=clock or FakeClock(),
    )


def _submit(coord: Coordinator, cid: str, value: float, examples: int) -> int:
    """Poll until a task arrives, then upload a constant update; return the round."""
    while True:
        task = coord.poll(cid, 0)
        if task.kind is TaskKind.TRAIN:
            break
    _, params = coord.parameters(cid, task.round, task.nonce)
    update = OrderedDict((k, np.full_like(v, value)) for k, v in params.items())
    header = UpdateHeader(task.round, task.nonce, examples, {"loss": value}, 2, 28)
    ticket = coord.open_upload(cid, header)
    try:
        coord.commit_upload(ticket, update)
    finally:
        coord.release_upload(ticket)
    return task.round


def test_weighted_mean_over_rounds_and_metrics(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path, rounds=2)
    for c in ("c0", "c1", "c2"):
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    for _ in range(2):
        workers = [
            threading.Thread(target=_submit, args=(coord, c, v, n))
            for c, v, n in (("c0", 1.0, 1), ("c1", 2.0, 1), ("c2", 4.0, 2))
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    driver.join(timeout=30)
    assert coord.status == "completed"
    # (1*1 + 2*1 + 4*2) / 4 = 2.75 per round, two rounds
    np.testing.assert_allclose(coord.params["w"], np.full((2, 2), 5.5))
    records = RunDir(tmp_path).read_metrics()
    assert [r["round"] for r in records] == [0, 1, 2]
    assert records[1]["num_updates"] == 3 and records[1]["clients"]["c2"]["loss"] == 4.0
    assert coord.store.latest().round == 2


CLIENTS = ("c0", "c1", "c2")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_finite_updates_that_overflow_the_model_are_never_checkpointed(tmp_path: Path) -> None:
    # Prepare: every upload is finite (float32 max), but two rounds of them overflow w + u
    big = float(np.finfo(np.float32).max)
    coord = _coordinator(tmp_path, rounds=2)
    for c in CLIENTS:
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    for _ in range(2):
        workers = [threading.Thread(target=_submit, args=(coord, c, big, 1)) for c in CLIENTS]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
    driver.join(timeout=30)
    # Assert: round 2 aborts by name; round 1's finite model stays the run's last checkpoint
    assert coord.status == "aborted"
    assert "round 2: the aggregate made the global model non-finite in ['w', 'b']" in (
        coord.stop_reason
    )
    assert coord.store.latest().round == 1
    assert np.isfinite(coord.store.latest().parameters["w"]).all()
    assert np.isfinite(coord.params["w"]).all()
    # round 1's evaluation overflowed (a finite model, an infinite norm): recorded as null
    assert RunDir(tmp_path).read_metrics()[1]["held_out"] == {"norm": None}


@pytest.mark.parametrize("bad_call", [1, 3])
def test_a_model_whose_embeddings_overflow_is_never_checkpointed(
    tmp_path: Path, bad_call: int
) -> None:
    from fl_secure.evaluation import DegenerateEmbeddings

    # Prepare: the evaluator's 1st call scores the initial model, its 3rd round 2's model
    calls: list[int] = []

    def evaluator(params) -> dict[str, float]:
        calls.append(1)
        if len(calls) == bad_call:
            raise DegenerateEmbeddings("embedding rows [3] are zero or not finite")
        return {"norm": 1.0}

    coord = _coordinator(tmp_path, rounds=2)
    coord.evaluator = evaluator
    for c in CLIENTS:
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    # Execute
    for _ in range(2 if bad_call == 3 else 0):
        workers = [threading.Thread(target=_submit, args=(coord, c, 1.0, 1)) for c in CLIENTS]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
    driver.join(timeout=30)
    # Assert: the run stops by name instead of the thread dying on a ValueError
    assert not driver.is_alive()
    assert coord.status == "aborted"
    records = RunDir(tmp_path).read_metrics()
    if bad_call == 1:
        assert coord.stop_reason.startswith("the initial model's held-out embeddings")
        assert coord.store.latest() is None and records == []
        return
    assert coord.stop_reason.startswith("round 2: the new global model's held-out embeddings")
    assert coord.store.latest().round == 1
    np.testing.assert_array_equal(coord.params["w"], np.ones((2, 2)))
    assert [(r["round"], r.get("kind")) for r in records] == [(0, None), (1, None), (2, "aborted")]


def test_straggler_dropped_after_deadline(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = _coordinator(tmp_path, clock=clock, rounds=1, min_clients=2, round_timeout=10.0)
    for c in ("c0", "c1", "c2"):
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    _submit(coord, "c0", 1.0, 1)
    _submit(coord, "c1", 3.0, 1)
    clock.advance(11.0)  # c2 never answers
    driver.join(timeout=30)
    assert coord.status == "completed"
    record = RunDir(tmp_path).read_metrics()[-1]
    assert record["dropped"] == ["c2"] and record["num_updates"] == 2
    np.testing.assert_allclose(coord.params["b"], np.full(3, 2.0))


def test_too_few_updates_retries_then_aborts(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = _coordinator(
        tmp_path, clock=clock, rounds=1, min_clients=2, round_timeout=10.0, max_retries=1
    )
    for c in ("c0", "c1", "c2"):
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    for _ in range(2):  # two attempts, each with only one update
        _submit(coord, "c0", 1.0, 1)
        for c in ("c1", "c2"):
            coord.join(c, 10)  # keep them "online" but silent
        clock.advance(11.0)
        while len(coord.events) < _ + 1 and driver.is_alive():
            pass
    driver.join(timeout=30)
    assert coord.status == "aborted"
    assert "round 1 aborted" in coord.stop_reason
    assert coord.stop_reason.endswith(
        "in the last attempt c1, c2: sent nothing before the round's timeout"
    )
    assert [e["attempt"] for e in coord.events] == [0, 1]
    np.testing.assert_array_equal(coord.params["w"], np.zeros((2, 2)))  # nothing applied
    assert coord.store.latest() is None
    assert coord.poll("c0", 0).kind is TaskKind.FINISHED


def _first_task(coord: Coordinator, kind: TaskKind) -> tuple[threading.Thread, Task]:
    """Join c0-c2, start the driver, and poll c0 until a task of ``kind`` arrives."""
    for c in ("c0", "c1", "c2"):
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    task = coord.poll("c0", 0)
    while task.kind is not kind:
        task = coord.poll("c0", 0)
    return driver, task


def test_upload_checks(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path, rounds=1, min_clients=3)
    driver, task = _first_task(coord, TaskKind.TRAIN)
    with pytest.raises(ProtocolError, match="holds no task"):
        coord.parameters("c0", task.round, b"wrong-nonce-0000")
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        coord.open_upload("c0", UpdateHeader(task.round, task.nonce, 1, {}, 2, 10**9))
    with pytest.raises(ProtocolError, match="announces 5 tensors"):
        coord.open_upload("c0", UpdateHeader(task.round, task.nonce, 1, {}, 5, 28))
    with pytest.raises(ProtocolError, match="num_examples must be positive, got 0"):
        coord.open_upload("c0", UpdateHeader(task.round, task.nonce, 0, {}, 2, 28))
    # without DP the count is the update's weight: no more than the images stated at join
    with pytest.raises(ProtocolError, match="num_examples = 11 is more than the 10 training"):
        coord.open_upload("c0", UpdateHeader(task.round, task.nonce, 11, {}, 2, 28))
    coord.stop("test over")
    driver.join(timeout=30)
    assert coord.status == "stopped"


def test_resume_drops_unfinished_round_metrics(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path, rounds=1)
    coord.store.save(1, OrderedDict((k, v + 1) for k, v in _initial().items()), {})
    run = RunDir(tmp_path)
    for r in (0, 1, 2):
        run.append_metrics({"round": r})
    with run.metrics.open("a") as f:
        f.write('{"round": 3, "torn')  # a crash mid-write
    assert coord.resume() == 1
    assert [r["round"] for r in run.read_metrics()] == [0, 1]
    np.testing.assert_array_equal(coord.params["w"], np.ones((2, 2)))


def test_only_the_final_metrics_line_may_be_torn(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for r in (0, 1):
        run.append_metrics({"round": r})
    with run.metrics.open("a") as f:
        f.write('{"round": 2, "torn\n')
    assert [r["round"] for r in run.read_metrics()] == [0, 1]  # a crash mid-append
    run.append_metrics({"round": 3})  # a damaged line is no longer the last one
    with pytest.raises(CheckpointError, match=r"metrics.jsonl:3 is not JSON"):
        run.read_metrics()


def test_a_final_line_cut_right_after_a_nested_brace_is_torn_too(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.append_metrics({"round": 0})
    line = json.dumps({"clients": {"c0": {"loss": 1.0}}, "round": 1}, sort_keys=True)
    with run.metrics.open("a") as f:
        f.write(line[: line.index("}") + 1])  # '{"clients": {"c0": {"loss": 1.0}'
    assert [r["round"] for r in run.read_metrics()] == [0]


def test_resume_refuses_a_config_edited_since_the_checkpoint(tmp_path: Path) -> None:
    # Prepare: one round run under config fingerprint "a...", checkpointed
    coord = _coordinator(tmp_path, rounds=1, config_sha256="a" * 64)
    for c in ("c0", "c1", "c2"):
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    workers = [
        threading.Thread(target=_submit, args=(coord, c, 1.0, 1)) for c in ("c0", "c1", "c2")
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    driver.join(timeout=30)
    assert coord.store.latest().state["config_sha256"] == "a" * 64
    metrics = RunDir(tmp_path).metrics.read_bytes()
    # Execute + Assert: another config is refused by name, before anything is touched
    with pytest.raises(CheckpointError, match=r"config.toml has changed since round 1"):
        _coordinator(tmp_path, rounds=2, config_sha256="b" * 64).resume()
    assert RunDir(tmp_path).metrics.read_bytes() == metrics
    assert _coordinator(tmp_path, rounds=1, config_sha256="a" * 64).resume() == 1


def test_cohort_sampling_fixed_size_and_poisson(tmp_path: Path) -> None:
    online = [f"c{i}" for i in range(50)]
    fixed = _coordinator(tmp_path / "a", clients_per_round=7)
    sizes = {len(fixed.membership.sample_cohort(online)) for _ in range(20)}
    assert sizes == {7}
    cohorts = [tuple(fixed.membership.sample_cohort(online)) for _ in range(20)]
    assert len(set(cohorts)) > 1  # random, not the first 7
    poisson = _coordinator(tmp_path / "b", sample_rate=0.2)
    counts = [len(poisson.membership.sample_cohort(online)) for _ in range(400)]
    # Binomial(50, 0.2): mean 10, std 2.83; the mean of 400 draws has std 0.14
    assert abs(np.mean(counts) - 10.0) < 0.6
    assert 1.5 < np.std(counts) < 4.0
    everyone = _coordinator(tmp_path / "c")
    assert everyone.membership.sample_cohort(online) == online


def test_a_client_gone_silent_is_not_waited_for_but_an_unseen_one_is(tmp_path: Path) -> None:
    # Prepare: three enrolled clients; online_timeout 30 s, round timeout 100 s
    clock = FakeClock()
    coord = _coordinator(tmp_path, clock=clock, online_timeout=30.0)
    for cid in ("c0", "c1", "c2"):
        coord.join(cid, 1)
    clock.advance(31.0)  # c2 went silent (died); c0 and c1 poll again
    coord.join("c0", 1)
    coord.join("c1", 1)
    # Execute / Assert: the next round starts at once with the two live clients
    assert coord.membership.wait_for_clients(2) == ["c0", "c1"]
    assert clock() == 31.0  # no waiting for the round timeout
    # ... while a client never seen at all is waited for (start-up): only the deadline ends it
    fresh = _coordinator(tmp_path / "fresh", clock=FakeClock(), online_timeout=30.0)
    fresh.join("c0", 1)
    fresh.join("c1", 1)
    result: dict[str, list[str]] = {}
    wait = fresh.membership.wait_for_clients
    waiter = threading.Thread(target=lambda: result.setdefault("c", wait(2)))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive()  # still waiting for c2
    fresh.clock.advance(101.0)  # type: ignore[attr-defined]
    fresh.join("c0", 1)
    fresh.join("c1", 1)
    waiter.join(timeout=5)
    assert result["c"] == ["c0", "c1"]


def test_abort_message_names_why_the_updates_were_refused(tmp_path: Path) -> None:
    # A diverged training: two clients' uploads are refused for the same reason, a third
    # for another. The abort message (what `fl-secure train` prints) names both reasons once.
    coord = _coordinator(tmp_path, rounds=1, min_clients=2, max_retries=0)
    for c in ("c0", "c1", "c2"):
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    nonces = {}
    for c in ("c0", "c1", "c2"):
        while (task := coord.poll(c, 0)).kind is not TaskKind.TRAIN:
            pass
        nonces[c] = task.nonce
    coord.record_failure("c1", 1, b"another attempt's", "a straggler's late message")
    for c in ("c0", "c2"):
        coord.record_failure(c, 1, nonces[c], "metrics ['train_loss'] are not finite")
    coord.record_failure("c1", 1, nonces["c1"], "tensor 'w' has shape (3,), expected (2, 2)")
    driver.join(timeout=30)
    assert coord.status == "aborted"
    assert coord.stop_reason == (
        "round 1 aborted: fewer than 2 updates after 1 attempt; in the last attempt "
        "c0, c2: metrics ['train_loss'] are not finite; "
        "c1: tensor 'w' has shape (3,), expected (2, 2)"
    )
    assert coord.events[-1]["failed"] == {
        "c0": "metrics ['train_loss'] are not finite",
        "c1": "tensor 'w' has shape (3,), expected (2, 2)",
        "c2": "metrics ['train_loss'] are not finite",
    }


def test_abort_after_too_small_cohorts_says_so(tmp_path: Path) -> None:
    # Poisson sampling at q = 1e-9: the cohort is empty on every attempt
    coord = _coordinator(tmp_path, rounds=1, min_clients=2, max_retries=1, sample_rate=1e-9)
    for c in ("c0", "c1", "c2"):
        coord.join(c, 10)
    coord.run()
    assert coord.status == "aborted"
    assert coord.stop_reason == (
        "round 1 aborted: fewer than 2 updates after 2 attempts; "
        "in the last attempt the sampled cohort had 0 clients"
    )


def test_a_client_without_test_images_may_report_an_empty_evaluation(tmp_path: Path) -> None:
    # Prepare: round 0 asks the clients to score the initial model on their test images
    coord = _coordinator(tmp_path, rounds=1, min_clients=2, final_evaluation=True)
    driver, task = _first_task(coord, TaskKind.EVALUATE)
    # Execute / Assert: 0 test images is an honest count for an evaluation, -1 is not
    with pytest.raises(ProtocolError, match="num_examples must be >= 0, got -1"):
        coord.open_upload("c0", UpdateHeader(task.round, task.nonce, -1, {}, 0, 0))
    ticket = coord.open_upload("c0", UpdateHeader(task.round, task.nonce, 0, {}, 0, 0))
    try:
        coord.commit_upload(ticket, OrderedDict())
    finally:
        coord.release_upload(ticket)
    coord.stop("test over")
    driver.join(timeout=30)
