"""The hard privacy budget is checked before every release attempt, retries included.

Under client-level DP with ``local`` noise the server's view is covered by the guarantee: the
updates of an attempt that then fails are a release (``discarded_sum``), composed like a
round. A retry would release the round again, so it must fit the budget left after them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from fl_secure.config import PrivacyConfig
from fl_secure.messages import TaskKind, UpdateHeader
from fl_secure.runs import RunDir
from privacy.dp.calibration import epsilon_for
from privacy.dp.noise import SeededGaussian
from privacy.ledger.run_ledger import Ledger
from privacy.server_round import open_server_privacy
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings

CLIENTS = ("c0", "c1", "c2")
Z = 2.0  # local (integer) noise, zCDP: one release epsilon 2.1658 at delta 1e-5; two: 3.1890


def _eps(releases: int) -> float:
    """The epsilon of ``releases`` local-noise releases at z = 2, q = 1 (integer noise: zCDP)."""
    return epsilon_for(
        accountant="pld", noise_multiplier=Z, sample_rate=1.0, steps=releases, delta=1e-5,
        noise="discrete_gaussian",
    )  # fmt: skip


def _coordinator(tmp_path: Path, target: float, rounds: int) -> Coordinator:
    """Client-level DP, local noise z = 2, every client every round, a 1 s attempt."""
    cfg = PrivacyConfig(
        unit="client", noise_placement="local", noise_multiplier=Z, target_epsilon=target
    )
    privacy = open_server_privacy(
        cfg, tmp_path / "ledger.sqlite", "test-run", rounds=rounds, population=len(CLIENTS),
        clients_per_round=0, sample_rate=0.0, source=SeededGaussian(0),
    )  # fmt: skip
    settings = CoordinatorSettings(
        rounds=rounds, min_clients=3, round_timeout=1.0, max_retries=2, poll_wait=0.05,
        final_evaluation=False,
    )  # fmt: skip
    return Coordinator(
        settings, OrderedDict([("w", np.zeros((2, 2), np.float32))]), enrolled=set(CLIENTS),
        run_dir=RunDir(tmp_path),
        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p), privacy=privacy,
    )  # fmt: skip


def _submit(coord: Coordinator, cid: str, tasks: list[tuple[int, bytes]]) -> None:
    """Poll until a training task (noted in ``tasks``) and send an update, or until FINISHED."""
    while True:
        task = coord.poll(cid, 0)
        if task.kind is TaskKind.FINISHED:
            return
        if task.kind is TaskKind.TRAIN:
            break
    tasks.append((task.round, task.nonce))
    _, params = coord.parameters(cid, task.round, task.nonce)
    update = OrderedDict((k, np.full_like(v, 0.1)) for k, v in params.items())
    ticket = coord.open_upload(cid, UpdateHeader(task.round, task.nonce, 1, {}, 1, 16))
    try:
        coord.commit_upload(ticket, update)
    finally:
        coord.release_upload(ticket)


def _drive(coord: Coordinator, waves: list[tuple[str, ...]]) -> list[tuple[int, bytes]]:
    """Run ``coord``; each wave of senders answers one attempt (a short one: then its deadline
    passes).

    Returns:
        The (round, nonce) of every training task a client was given.
    """
    for c in CLIENTS:
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    tasks: list[tuple[int, bytes]] = []
    for senders in waves:
        workers = [threading.Thread(target=_submit, args=(coord, c, tasks)) for c in senders]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
        if len(senders) < len(CLIENTS):
            time.sleep(1.5)  # past the attempt's deadline (round_timeout 1 s)
    driver.join(timeout=30)
    assert not driver.is_alive()
    return tasks


def _ledger(tmp_path: Path) -> list[tuple[str, int, dict]]:
    with Ledger.read(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.verify().ok
        return [(e.kind, e.round, e.payload) for e in ledger.entries()]


def _final_epsilon(rows: list[tuple[str, int, dict]]) -> float:
    """The ledger's epsilon: that of its last client-level release (round or discarded sum)."""
    return [p["epsilon"] for k, _, p in rows if k in ("client_level", "discarded_sum")][-1]


def test_a_retry_past_the_budget_is_not_released_after_a_discarded_sum(tmp_path: Path) -> None:
    # Prepare: a target that one release fits and two do not; in round 1's first attempt
    # only two of the three clients send (the server saw their updates; the attempt fails)
    target = (_eps(1) + _eps(2)) / 2
    # rho = T / (2 z^2) (+1e-9), converted by Canonne, Kamath & Steinke 2020, Prop. 12
    assert _eps(1) == pytest.approx(2.1658, abs=1e-4) and _eps(2) == pytest.approx(3.1890, abs=1e-4)
    coord = _coordinator(tmp_path, target, rounds=1)
    # Execute: attempt 0 gets two updates; every client would answer a retry
    tasks = _drive(coord, [CLIENTS[:2], CLIENTS])
    # Assert: the retry was never drawn nor sent: the run stopped for its budget, saying so
    # in its status, stop reason and ledger, with the ledger's epsilon within the target
    assert coord.status == "budget_exhausted", (coord.status, coord.stop_reason)
    assert coord.completed_round == 0
    assert "privacy budget reached: round 1 attempt 1" in coord.stop_reason
    assert f"epsilon to {_eps(2):.4f} > target {target:g}" in coord.stop_reason
    assert [e["attempt"] for e in coord.events if e.get("round") == 1] == [0]
    assert len(tasks) == 2 and {r for r, _ in tasks} == {1}  # c0 and c1, in attempt 0 only
    rows = _ledger(tmp_path)
    assert [(k, r) for k, r, _ in rows] == [("discarded_sum", 1), ("note", 1)]
    assert rows[0][2]["updates"] == 2
    assert rows[1][2]["message"] == coord.stop_reason
    assert _final_epsilon(rows) == pytest.approx(_eps(1), rel=1e-9)
    assert _final_epsilon(rows) <= target
    assert coord.privacy is not None and coord.privacy.epsilon <= target
    assert not coord.privacy.inflight_path.exists()  # nothing left in flight


def test_a_later_rounds_retry_past_the_budget_stops_after_the_last_released_round(
    tmp_path: Path,
) -> None:
    # Prepare: a target that two releases fit and three do not; round 1 completes, then in
    # round 2's first attempt only two clients send
    target = (_eps(2) + _eps(3)) / 2
    coord = _coordinator(tmp_path, target, rounds=3)
    # Execute
    _drive(coord, [CLIENTS, CLIENTS[:2], CLIENTS])
    # Assert: round 1's model stays the run's; round 2 is not retried
    assert coord.status == "budget_exhausted", (coord.status, coord.stop_reason)
    assert coord.completed_round == 1
    assert "round 2 attempt 1" in coord.stop_reason
    assert "stopped after round 1" in coord.stop_reason
    assert [(e["round"], e["attempt"]) for e in coord.events if e.get("round", 0) > 0] == [
        (1, 0),
        (2, 0),
    ]
    rows = _ledger(tmp_path)
    assert [(k, r) for k, r, _ in rows] == [
        ("client_level", 1),
        ("discarded_sum", 2),
        ("note", 2),
    ]
    assert _final_epsilon(rows) == pytest.approx(_eps(2), rel=1e-9) and _eps(2) <= target


def test_a_retry_the_budget_still_allows_is_released(tmp_path: Path) -> None:
    # Prepare: a target that two releases fit and three do not; round 1's first attempt fails
    target = (_eps(2) + _eps(3)) / 2
    coord = _coordinator(tmp_path, target, rounds=2)
    # Execute
    _drive(coord, [CLIENTS[:2], CLIENTS, CLIENTS])
    # Assert: the retry fit (discarded sum + round 1 = two releases) and released round 1;
    # round 2 would be a third release, so the run stops before it
    assert coord.status == "budget_exhausted", (coord.status, coord.stop_reason)
    assert coord.completed_round == 1
    assert coord.stop_reason.startswith("privacy budget reached: round 2 would bring")
    rows = _ledger(tmp_path)
    assert [(k, r) for k, r, _ in rows] == [
        ("discarded_sum", 1),
        ("client_level", 1),
        ("note", 2),
    ]
    assert rows[1][2]["attempt"] == 1
    assert _final_epsilon(rows) == pytest.approx(_eps(2), rel=1e-9) and _eps(2) <= target
