"""A hostile client over real mutual TLS: it may not hold the upload slots, flood or forge the
server's log, learn the server's config or the other clients' fate, or mis-announce its bytes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import grpc
import numpy as np
import pytest

from fl_secure import serde
from fl_secure.messages import UpdateHeader
from fl_secure.tls import channel_credentials
from fl_secure.v1 import transport_pb2 as pb
from fl_secure.v1 import transport_pb2_grpc as pb_grpc

from .conftest import EchoTrainer  # type: ignore[import-not-found]


def _channel(run, client_id: str) -> grpc.Channel:
    return grpc.secure_channel(f"localhost:{run.port}", channel_credentials(run.certs, client_id))


def _stub(run, client_id: str) -> pb_grpc.FlSecureStub:
    return pb_grpc.FlSecureStub(_channel(run, client_id))


def _task(stub) -> pb.Task:
    stub.Join(pb.JoinRequest(num_examples=5), timeout=10)
    for _ in range(100):
        task = stub.PollTask(pb.PollRequest(), timeout=10)
        if task.kind == pb.TASK_KIND_TRAIN:
            return task
    raise AssertionError("no task within 100 polls")


def _update(task, params) -> list[pb.UpdateChunk]:
    return list(serde.update_to_chunks(UpdateHeader(task.round, task.nonce, 5), params))


def _join_all(threads, timeout: float = 60.0) -> None:
    for th, _, _ in threads:
        th.join(timeout=timeout)


# ----------------------------------------------------------------------- upload slots


def test_two_trickling_clients_cannot_hold_the_upload_slots(grpc_run_factory, small_params):
    # Prepare: two upload slots, four clients, two needed, no retry. client-2 sends its
    # header, its first tensor's header, then an empty data message every 0.2 s; client-3 the
    # tensor's bytes one at a time every 0.2 s. Each message used to reset the idle timer,
    # so the two held both slots until the deadline and the honest clients were blamed.
    run = grpc_run_factory(
        small_params, clients=4, min_clients=2, round_timeout=8, max_retries=0,
        max_concurrent_uploads=2, upload_idle_timeout=1.0,
    )  # fmt: skip
    for i in range(2):  # online, so that the cohort holds all four
        _stub(run, f"client-{i}").Join(pb.JoinRequest(num_examples=5), timeout=10)
    stop = threading.Event()
    outcome: dict[str, object] = {}

    def trickle(client_id: str, piece: int):
        stub = _stub(run, client_id)
        chunks = _update(_task(stub), small_params)

        def stream():
            yield chunks[0]  # the update header
            yield chunks[1]  # the first tensor's header
            data = chunks[2].data
            for i in range(0, 10**6):
                if stop.wait(0.2):
                    return
                yield pb.UpdateChunk(data=data[i * piece : (i + 1) * piece] if piece else b"")

        try:
            stub.SubmitUpdate(stream(), timeout=30)
            outcome[client_id] = "accepted"
        except grpc.RpcError as exc:
            outcome[client_id] = exc.code()

    tricklers = [
        threading.Thread(target=trickle, args=("client-2", 0), daemon=True),
        threading.Thread(target=trickle, args=("client-3", 1), daemon=True),
    ]
    for th in tricklers:
        th.start()
    for _ in range(200):  # until both hold a slot
        rnd = run.coordinator.board.current
        if rnd is not None and {"client-2", "client-3"} <= set(rnd.streaming):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the trickling uploads never took the slots")
    # Execute: the two honest clients need the slots
    good = [run.start_client(f"client-{i}", EchoTrainer(shift=1.0)) for i in range(2)]
    _join_all(good)
    stop.set()
    for th in tricklers:
        th.join(timeout=10)
    # Assert: the round completed with the honest updates; the tricklers are blamed by name
    assert run.coordinator.status == "completed", run.coordinator.stop_reason
    record = run.coordinator.run_dir.read_metrics()[-1]
    assert record["num_updates"] == 2
    assert sorted(record["failed"]) == ["client-2", "client-3"]
    assert record["failed"]["client-2"] == "upload stalled: no data for 1 s"
    assert record["failed"]["client-3"].startswith("upload too slow: ")
    assert "below the minimum of 65536 bytes/s" in record["failed"]["client-3"]
    assert outcome == {"client-2": grpc.StatusCode.CANCELLED, "client-3": grpc.StatusCode.CANCELLED}


# ------------------------------------------------------------------------ total_bytes


@pytest.mark.parametrize(
    ("announced", "match"),
    [
        (10, "upload sends more than the 10 bytes (total_bytes) its header announced"),
        (66, "upload header announced total_bytes = 66, its tensors have 64 bytes"),
    ],
)
def test_an_upload_must_be_the_size_its_header_announced(
    announced: int, match: str, grpc_run_factory, small_params
) -> None:
    # Prepare: an honest update of 64 tensor bytes whose header announces another size
    run = grpc_run_factory(small_params, clients=3, min_clients=2, round_timeout=20)
    good = [run.start_client(f"client-{i}", EchoTrainer(shift=1.0)) for i in range(2)]
    liar = _stub(run, "client-2")
    chunks = _update(_task(liar), small_params)
    assert chunks[0].header.total_bytes == 64
    chunks[0].header.total_bytes = announced
    # Execute / Assert: refused by name; the round goes on with the others and records why
    with pytest.raises(grpc.RpcError) as err:
        liar.SubmitUpdate(iter(chunks), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == match
    _join_all(good)
    assert run.coordinator.status == "completed"
    record = run.coordinator.run_dir.read_metrics()[-1]
    assert record["num_updates"] == 2
    assert record["failed"] == {"client-2": match}


# ------------------------------------------------------------------------- FINISHED


def test_finished_tells_each_client_its_own_status_only(grpc_run_factory, small_params) -> None:
    # Prepare: three clients, all three needed, no retry; client-1 sends a NaN update,
    # client-2 sends nothing: the round aborts naming both in the server's own records
    run = grpc_run_factory(small_params, clients=3, min_clients=3, round_timeout=3, max_retries=0)
    stubs = [_stub(run, f"client-{i}") for i in range(3)]
    for stub in stubs:
        stub.Join(pb.JoinRequest(num_examples=5), timeout=10)
    tasks = [_task(stub) for stub in stubs]
    stubs[0].SubmitUpdate(iter(_update(tasks[0], small_params)), timeout=10)
    bad = OrderedDict((k, v.copy()) for k, v in small_params.items())
    bad["w"][0, 0] = np.nan
    with pytest.raises(grpc.RpcError):
        stubs[1].SubmitUpdate(iter(_update(tasks[1], bad)), timeout=10)
    run.driver.join(timeout=30)
    assert run.coordinator.status == "aborted"
    assert "client-1" in run.coordinator.stop_reason  # the operator's record names them all
    # Execute: each polls and hears FINISHED
    finished = {}
    for i, stub in enumerate(stubs):
        task = stub.PollTask(pb.PollRequest(), timeout=10)
        assert task.kind == pb.TASK_KIND_FINISHED
        finished[i] = task.message
    # Assert: no client hears another's id or failure
    for i, message in finished.items():
        others = [f"client-{j}" for j in range(3) if j != i]
        assert not any(o in message for o in others), message
        assert message.startswith("run aborted after round 0")
    assert finished[0].endswith("your update in round 1 attempt 0 was received")
    assert "your update in round 1 attempt 0 failed: tensor 'w' contains NaN or Inf" in finished[1]
    assert finished[2].endswith("in round 1 attempt 0 did not arrive before its deadline")


# ------------------------------------------------------------------ the config sent


def test_join_sends_only_the_config_a_client_reads(tmp_path) -> None:
    import tomllib

    from fl_secure.config import config_from_dict
    from fl_secure.runs import RunDir
    from fl_secure.tls import init_certificates
    from server.app import start_server
    from server.bootstrap import build_server

    # Prepare: a server whose config holds data paths and its listening address
    table = {
        "data": {"path": "/srv/site-secrets/faces", "identities_file": "/srv/ids.txt",
                 "attributes_file": "/srv/attrs.txt", "num_identities": 30,
                 "held_out_identities": 10, "images_per_identity": 4},
        "partition": {"num_clients": 2},
        "model": {"backbone": "cnn-small", "embedding_size": 8},
        "train": {"rounds": 3, "lr": 0.05},
        "server": {"address": "10.20.30.40:50051", "round_timeout": 123.0, "min_clients": 2},
    }  # fmt: skip
    config = config_from_dict(table)
    certs = tmp_path / "certs"
    init_certificates(certs, clients=["client-0", "client-1"])
    side = build_server(
        config, RunDir(tmp_path / "run"), enrolled={"client-0", "client-1"}, cert_dir=certs
    )
    server, port = start_server(side.coordinator, "127.0.0.1:0", cert_dir=certs)
    try:
        # Execute: a client joins over mTLS and reads what it was sent
        stub = pb_grpc.FlSecureStub(
            grpc.secure_channel(f"localhost:{port}", channel_credentials(certs, "client-0"))
        )
        sent = stub.Join(pb.JoinRequest(num_examples=5), timeout=10).run_config_toml
    finally:
        server.stop(grace=None)
    # Assert: no path, no address, no server-only section or key; what a client reads is there
    for secret in ("/srv/", "10.20.30.40", "round_timeout", "held_out_identities", "[eval]"):
        assert secret not in sent, secret
    table_sent = tomllib.loads(sent)
    assert sorted(table_sent) == sorted(
        ["run", "data", "partition", "model", "algorithm", "train", "server", "privacy",
         "secure_aggregation"]
    )  # fmt: skip
    assert table_sent["server"] == {"min_clients": 2, "max_retries": 2}
    assert table_sent["data"] == {
        "image_size": 64, "min_images_per_identity": 2, "center_crop": 0, "degrade": ""
    }  # fmt: skip
    got = config_from_dict(table_sent)
    assert (got.model, got.algorithm, got.train, got.privacy, got.secure_aggregation) == (
        config.model, config.algorithm, config.train, config.privacy, config.secure_aggregation
    )  # fmt: skip


# --------------------------------------------------------------------------- the log

FORGED = "client-1\n11/27/2026 12:00:00:CRITICAL:forged line \x1b[2J\x1b[31m"


def _is_one_printable_line(text: str) -> bool:
    return all(ch.isprintable() for ch in text)


def test_a_secagg_client_id_with_newline_and_escape_codes_is_logged_escaped(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from fl_secure.config import SecureAggregationConfig
    from fl_secure.runs import RunDir
    from fl_secure.tls import init_certificates
    from fl_secure.tls.identity import load_signing_registry
    from privacy.secagg.messages import AdvertiseKeys
    from server.app import load_enrollment, start_server
    from server.coordinator import Coordinator
    from server.settings import CoordinatorSettings

    # Prepare: a SecAgg run of three clients; client-0 advertises keys under a forged id
    certs = tmp_path / "certs"
    init_certificates(certs, clients=3)
    settings = CoordinatorSettings(
        rounds=1, min_clients=2, round_timeout=5, max_retries=0, poll_wait=0.5,
        final_evaluation=False, run_id="log", secure_aggregation=SecureAggregationConfig(
            scheme="secagg", clip_range=4.0, stage_timeout=5.0),
    )  # fmt: skip
    coord = Coordinator(
        settings,
        OrderedDict([("w", np.zeros(8, np.float32))]),
        enrolled=set(load_enrollment(certs).fingerprints),
        run_dir=RunDir(tmp_path / "run"),
        server_step=lambda p, u, r: p,
        signing_registry=load_signing_registry(certs / "server"),
    )
    server, port = start_server(coord, "127.0.0.1:0", cert_dir=certs)
    driver = threading.Thread(target=coord.run, daemon=True)
    driver.start()
    try:
        stubs = [
            pb_grpc.FlSecureStub(
                grpc.secure_channel(f"localhost:{port}", channel_credentials(certs, f"client-{i}"))
            )
            for i in range(3)
        ]
        for stub in stubs:
            stub.Join(pb.JoinRequest(num_examples=5), timeout=10)
        task = _task(stubs[0])
        advert = AdvertiseKeys(FORGED, b"r" * 16, b"c" * 32, b"s" * 32, b"g" * 64)
        # Execute
        with caplog.at_level(logging.WARNING), pytest.raises(grpc.RpcError) as err:
            stubs[0].SecAggExchange(
                pb.SecAggMessage(
                    round=task.round, nonce=task.nonce, stage=pb.SECAGG_STAGE_ADVERTISE_KEYS,
                    payload=advert.to_bytes(),
                ),
                timeout=10,
            )  # fmt: skip
    finally:
        coord.stop("test teardown")
        server.stop(grace=None)
        driver.join(timeout=10)
    # Assert: refused; the log line names the forged id escaped, on one printable line
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    refused = [r.getMessage() for r in caplog.records if "advertisement of" in r.getMessage()]
    assert refused, [r.getMessage() for r in caplog.records]
    assert all(_is_one_printable_line(m) for m in refused), refused
    assert "client-1\\n11/27/2026 12:00:00:CRITICAL:forged line \\x1b[2J" in refused[0]


def _undecodable(run, client_id: str, count: int) -> list[grpc.StatusCode]:
    """``count`` Join calls whose request bytes are not a JoinRequest."""
    join = _channel(run, client_id).unary_unary("/fl_secure.v1.FlSecure/Join")
    codes = []
    for _ in range(count):
        with pytest.raises(grpc.RpcError) as err:
            join(b"\xff\xff\xff\xff", timeout=5)  # field 31, a truncated varint
        codes.append(err.value.code())
    return codes


def test_undecodable_messages_are_refused_with_one_line_no_traceback(
    grpc_run_factory, small_params, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    run = grpc_run_factory(small_params, clients=2, min_clients=2)
    # Execute: 50 messages that do not parse, from one enrolled client
    with caplog.at_level(logging.DEBUG):
        codes = _undecodable(run, "client-1", 50)
        reply = _stub(run, "client-0").Join(pb.JoinRequest(num_examples=1), timeout=5)
    # Assert: each refused as INVALID_ARGUMENT; one log line for the lot, and no traceback
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 50
    assert reply.client_id == "client-0"  # the others are still served
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith(("server", "grpc"))
    ]
    assert len(lines) == 1, lines
    assert lines[0].startswith("message from client-1 refused: the message could not be decoded")


def test_refusal_lines_are_one_per_peer_per_interval() -> None:
    import logging

    from fl_secure.logsafe import RefusalLog

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test.refusals")
    logger.addHandler(Keep())
    logger.propagate = False
    now = [0.0]
    refusals = RefusalLog(logger, interval=10.0, clock=lambda: now[0])
    # Execute: 100 refusals of one peer and 1 of another within 10 s, then one more later
    written = [refusals.warn("a", "refused %s: %s", "a", FORGED) for _ in range(100)]
    written.append(refusals.warn("b", "refused %s", "b"))
    now[0] = 10.0
    written.append(refusals.warn("a", "refused %s: %s", "a", "again"))
    # Assert: three lines, the last counts what was held back, all escaped
    assert written.count(True) == 3 and written[0] and written[100] and written[101]
    assert records[0] == "refused a: " + FORGED.replace("\n", "\\n").replace("\x1b", "\\x1b")
    assert records[1] == "refused b"
    assert (
        records[2] == "refused a: again (99 more refusals of this peer in the last 10 s unlogged)"
    )


# ------------------------------------------------------------ connections before TLS


def _closed_by_peer(sock, wait: float) -> bool:
    import select

    ready, _, _ = select.select([sock], [], [], wait)
    if not ready:
        return False
    try:
        return sock.recv(1) == b""
    except OSError:  # reset
        return True


def _silent_connections(run, count: int) -> list:
    import socket

    return [socket.create_connection(("127.0.0.1", run.port), timeout=5) for _ in range(count)]


def test_connections_past_the_cap_are_closed_at_once(grpc_run_factory, small_params) -> None:
    # Prepare: two enrolled clients: the server holds 256 connections (server.app)
    run = grpc_run_factory(small_params, clients=2, min_clients=2)
    # Execute: 296 TCP connections that never send a byte (no TLS handshake)
    socks = _silent_connections(run, 256 + 40)
    try:
        time.sleep(0.3)
        # Assert: at least those past the cap were closed at once (the server's descriptors
        # and memory stay bounded; while the cap is full a new client waits for the handshake
        # timeout to free places, see the next test)
        assert sum(_closed_by_peer(s, 0.0) for s in socks) >= 40
    finally:
        for s in socks:
            s.close()
    reply = _stub(run, "client-0").Join(pb.JoinRequest(num_examples=1), timeout=10)
    assert reply.client_id == "client-0"  # places free again once they are gone


def test_connections_that_never_handshake_are_closed_after_the_timeout(
    grpc_run_factory, small_params
) -> None:
    # Prepare: a server that gives a TLS handshake 1 s (gRPC's default is 120 s)
    run = grpc_run_factory(small_params, clients=2, min_clients=2, handshake_timeout=1.0)
    # Execute: 20 TCP connections that never send a byte
    socks = _silent_connections(run, 20)
    try:
        # Assert: every one is closed by the server within 3 s; an honest client is served
        assert all(_closed_by_peer(s, 3.0) for s in socks)
        reply = _stub(run, "client-0").Join(pb.JoinRequest(num_examples=1), timeout=10)
        assert reply.client_id == "client-0"
    finally:
        for s in socks:
            s.close()


# ------------------------------------------------------------ self-reported metrics


def test_a_self_reported_rate_outside_0_1_is_refused(grpc_run_factory, small_params) -> None:
    # Prepare: client-2 reports a rank-1 rate of 7 with an otherwise honest update
    run = grpc_run_factory(small_params, clients=3, min_clients=2, round_timeout=20)
    good = [run.start_client(f"client-{i}", EchoTrainer(shift=1.0)) for i in range(2)]
    liar = _stub(run, "client-2")
    task = _task(liar)
    header = UpdateHeader(task.round, task.nonce, 5, metrics={"rank1": 7.0, "loss": 9.0})
    # Execute / Assert: refused by name; the others' round completes without it
    with pytest.raises(grpc.RpcError) as err:
        liar.SubmitUpdate(serde.update_to_chunks(header, small_params), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "metric 'rank1' = 7 is a rate outside [0, 1]"
    _join_all(good)
    assert run.coordinator.status == "completed"
    assert run.coordinator.run_dir.read_metrics()[-1]["failed"] == {
        "client-2": "metric 'rank1' = 7 is a rate outside [0, 1]"
    }
