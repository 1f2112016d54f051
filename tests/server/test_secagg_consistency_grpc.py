"""The consistency check over gRPC: dropouts at it, a malformed signature, a hostile relay.

Real server and clients over mTLS (threads, as in ``test_secagg_grpc.py``); the coordinator's
clock is frozen, so a stage closes only because every member answered or was seen to go.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from fl_secure.runs import RunDir
from tests.server.secagg_processes import run_client_processes
from tests.server.test_secagg_grpc import _frozen, _Killed, _run, _serve

TOL = 10 * 2.0**-20  # the fixed-point resolution of ten inputs


def _die_at(monkeypatch: pytest.MonkeyPatch, dying: dict[str, int]) -> None:
    """Client ``c`` vanishes when it would make its call of stage ``dying[c]``."""
    import privacy.secagg.client_round as session

    real = session.client_secure_update

    def wrapped(setup, client_id, identity, registry, exchange, compute, upload):
        def exchange_or_die(stage: int, payload: bytes) -> bytes:
            if dying.get(client_id) == stage:
                raise _Killed(client_id)
            return exchange(stage, payload)

        return real(setup, client_id, identity, registry, exchange_or_die, compute, upload)

    monkeypatch.setattr(session, "client_secure_update", wrapped)


def _record(tmp_path: Path) -> dict:
    return RunDir(tmp_path / "run").read_metrics()[-1]["secure_aggregation"]


def test_dropouts_at_the_consistency_check_and_after_it_give_the_exact_sum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: SecAgg+, ten clients, 6 neighbours (t = 4); corrupt_fraction 0.2 (c = 2), so
    # a client reveals once 7 survivors signed U3. client-3 vanishes before it signs;
    # client-7 signs, then vanishes before it reveals any share (two dropouts: k - t)
    from privacy.secagg.stages import CONSISTENCY, UNMASK

    _die_at(monkeypatch, {"client-3": CONSISTENCY, "client-7": UNMASK})
    shifts = [0.1 * (i + 1) for i in range(10)]
    # Execute
    coord = _run(tmp_path, shifts, failing=set(), min_clients=8, neighbours=6, scheme="secagg+")
    # Assert: all ten inputs are in the sum (both uploaded theirs): exact mean
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts), atol=TOL)
    sa = _record(tmp_path)
    assert len(sa["survivors"]) == 10
    assert sa["dropped"] == {"client-3": "consistency check", "client-7": "unmasking"}, sa


def test_secagg_with_one_dropout_at_the_consistency_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: SecAgg, five clients (t = 3, c = 1: 4 signatures needed); client-4 vanishes
    # after its masked input, before signing
    from privacy.secagg.stages import CONSISTENCY

    _die_at(monkeypatch, {"client-4": CONSISTENCY})
    shifts = [0.5, 1.0, -0.25, 2.0, 0.75]
    # Execute
    coord = _run(tmp_path, shifts, failing=set(), min_clients=4)
    # Assert
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts), atol=TOL)
    assert _record(tmp_path)["dropped"] == {"client-4": "consistency check"}


def test_too_few_signers_abort_before_any_share_is_revealed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: SecAgg, five clients (4 signatures needed); two vanish before signing
    from privacy.secagg.stages import CONSISTENCY

    _die_at(monkeypatch, {"client-3": CONSISTENCY, "client-4": CONSISTENCY})
    # Execute
    coord = _run(tmp_path, [0.5, 1.0, -0.25, 2.0, 0.75], failing=set(), min_clients=3)
    # Assert: aborted at the consistency check, no model update
    assert coord.status == "aborted"
    assert "too few survivors signed the survivor set (3)" in coord.stop_reason
    assert "consistency check needs 4" in coord.stop_reason
    np.testing.assert_array_equal(coord.params["w"], np.zeros((50, 40), np.float32))


def test_a_malformed_signature_is_refused_naming_its_sender_and_the_others_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: SecAgg, five clients; client-2 sends a truncated consistency signature
    import privacy.secagg.client_round as session
    from privacy.secagg.stages import CONSISTENCY

    real = session.client_secure_update

    def wrapped(setup, client_id, identity, registry, exchange, compute, upload):
        def garble(stage: int, payload: bytes) -> bytes:
            if client_id == "client-2" and stage == CONSISTENCY:
                payload = payload[:-5]
            return exchange(stage, payload)

        return real(setup, client_id, identity, registry, garble, compute, upload)

    monkeypatch.setattr(session, "client_secure_update", wrapped)
    shifts = [0.5, 1.0, -0.25, 2.0, 0.75]
    # Execute
    with caplog.at_level(logging.WARNING):
        coord = _run(tmp_path, shifts, failing=set(), min_clients=4)
    # Assert: refused with an error naming client-2; the four others sign and unmask the
    # sum of all five inputs (client-2's input is in it: its self mask is rebuilt)
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts), atol=TOL)
    refused = [
        r.getMessage() for r in caplog.records if "consistency signature from" in r.getMessage()
    ]
    assert refused and all("client-2" in m for m in refused), refused
    assert "ConsistencySignature: truncated message" in refused[0]


def test_a_relay_that_withholds_signatures_gets_no_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a hostile server that relays only two of the five signatures
    from privacy.secagg.server import SecAggServer

    real = SecAggServer.route_signatures
    monkeypatch.setattr(SecAggServer, "route_signatures", lambda self: real(self)[:2])
    # Execute
    with caplog.at_level(logging.WARNING):
        coord = _run(tmp_path, [0.5, 1.0, -0.25, 2.0, 0.75], failing=set(), min_clients=4)
    # Assert: every client withdrew saying its consistency check failed; no sum
    assert coord.status == "aborted"
    assert "too few unmasking responses" in coord.stop_reason
    left = [r.getMessage() for r in caplog.records if "left secure aggregation" in r.getMessage()]
    assert len(left) == 5 and all("the consistency check failed" in m for m in left), left
    np.testing.assert_array_equal(coord.params["w"], np.zeros((50, 40), np.float32))


@pytest.mark.slow
def test_client_processes_killed_9_at_and_after_the_consistency_check(tmp_path: Path) -> None:
    # Prepare: a real server over mTLS and ten client *processes* (SecAgg+, 6 neighbours,
    # t = 4, 7 signatures needed); client-3 is killed with SIGKILL after its masked input,
    # before it signs; client-7 after it signed and got the signatures, before it reveals
    shifts = [0.1 * (i + 1) for i in range(10)]
    coord, server, port, certs = _serve(
        tmp_path, 10, min_clients=8, round_timeout=120.0, stage_timeout=20,
        neighbours=6, scheme="secagg+", clock=_frozen,
    )  # fmt: skip
    # Execute: kill -9 each dying client once it reached its point of the protocol
    dying = {3: (["--die"], "masked"), 7: (["--die-after-signing"], "signed")}
    codes, logs = run_client_processes(coord, server, port, certs, tmp_path, shifts, dying)
    # Assert: all ten inputs in the sum, exact to the fixed-point resolution
    assert coord.status == "completed", (coord.stop_reason, logs)
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts), atol=TOL)
    sa = _record(tmp_path)
    assert len(sa["survivors"]) == 10
    assert sa["dropped"] == {"client-3": "consistency check", "client-7": "unmasking"}, sa
    assert sa["left"] == ["client-3", "client-7"], sa
    assert codes == [0] * 8, logs
