"""The real transport: gRPC + mutual TLS on loopback, port 0, echo clients."""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

import grpc
import numpy as np
import pytest

from fl_secure import serde
from fl_secure.messages import TaskKind, UpdateHeader
from fl_secure.tls import channel_credentials, init_certificates
from fl_secure.v1 import transport_pb2 as pb
from fl_secure.v1 import transport_pb2_grpc as pb_grpc

from .conftest import EchoTrainer  # type: ignore[import-not-found]


def _join_all(threads, timeout: float = 60.0) -> None:
    for th, _, _ in threads:
        th.join(timeout=timeout)


def test_100mb_parameters_round_trip_bit_exact(tmp_path: Path, grpc_run_factory) -> None:
    # Prepare: 100 MB of float32 with every bit pattern class (negative zero, subnormals).
    rng = np.random.default_rng(7)
    big = rng.standard_normal(25_000_000).astype(np.float32)
    big[:4] = [-0.0, np.float32(1e-45), np.finfo(np.float32).max, np.finfo(np.float32).tiny]
    initial = OrderedDict([("big", big), ("small", np.arange(5, dtype=np.int64))])
    received = {}
    run = grpc_run_factory(initial, clients=1, min_clients=1, server_step=lambda p, u, r: u)
    commit = run.coordinator.commit_upload

    def capture(ticket, tensors):  # what the server read off the wire, before averaging
        received.update(tensors)
        commit(ticket, tensors)

    run.coordinator.commit_upload = capture
    trainer = EchoTrainer(shift=0.0)
    # Execute: the client downloads and uploads the same tensors back.
    th, result, _ = run.start_client("client-0", trainer)
    th.join(timeout=300)
    # Assert: what the client saw and what the server got back are the original bytes.
    assert "error" not in result, result
    assert trainer.seen[0]["big"].tobytes() == big.tobytes()
    assert received["big"].tobytes() == big.tobytes()
    np.testing.assert_array_equal(received["small"], initial["small"])
    assert run.coordinator.status == "completed"


def test_rounds_complete_over_mtls(grpc_run_factory, small_params) -> None:
    run = grpc_run_factory(small_params, clients=3, rounds=2, min_clients=3)
    threads = [run.start_client(f"client-{i}", EchoTrainer(shift=float(i))) for i in range(3)]
    _join_all(threads)
    assert all("error" not in r for _, r, _ in threads), [r for _, r, _ in threads]
    assert run.coordinator.status == "completed"
    # two rounds: params + 2 * (w + mean shift), where the update is w + shift
    expected = small_params["w"]
    for _ in range(2):
        expected = expected + (expected + 1.0)
    np.testing.assert_allclose(run.coordinator.params["w"], expected, rtol=1e-6)


def test_a_client_whose_round_closed_before_its_download_waits_for_the_next(
    grpc_run_factory, small_params
) -> None:
    # Prepare: one client that takes its first task only after the attempt's deadline (a
    # poll answered at the deadline, a slow link), so its download is refused
    import time

    from client.app import FlClient
    from client.transport import Connection

    run = grpc_run_factory(small_params, clients=1, min_clients=1, round_timeout=1.5)

    class Late(FlClient):
        late = True

        def _do_task(self, stub, task):  # type: ignore[no-untyped-def]
            if self.late:
                self.late = False
                time.sleep(2.0)
            return super()._do_task(stub, task)

    trainer = EchoTrainer()
    client = Late(Connection(f"localhost:{run.port}", "client-0", cert_dir=run.certs),
                  lambda reply: trainer, max_wait=20.0)  # fmt: skip
    # Execute: the refused download must not end the client
    message = client.run()
    # Assert: it took the retried attempt's task and the round completed with its update
    assert run.coordinator.status == "completed", message
    assert client.rounds_done == 1 and len(trainer.seen) == 1
    attempts = [e["attempt"] for e in run.coordinator.events if e["round"] == 1]
    assert attempts == [0, 1]


def _stub(run, client_id: str) -> pb_grpc.FlSecureStub:
    creds = channel_credentials(run.certs, client_id)
    channel = grpc.secure_channel(f"localhost:{run.port}", creds)
    return pb_grpc.FlSecureStub(channel)


def _task(stub) -> pb.Task:
    stub.Join(pb.JoinRequest(num_examples=5), timeout=10)
    for _ in range(100):
        task = stub.PollTask(pb.PollRequest(), timeout=10)
        if task.kind == pb.TASK_KIND_TRAIN:
            return task
    raise AssertionError("no task within 100 polls")


def _chunks(task, tensors, mutate=None):
    header = UpdateHeader(task.round, task.nonce, 5)
    chunks = list(serde.update_to_chunks(header, tensors))
    if mutate:
        mutate(chunks)
    return iter(chunks)


def _bad_cases(params):
    w, b = params["w"], params["b"]

    def flip_byte(chunks):
        data = bytearray(chunks[2].data)
        data[0] ^= 1
        chunks[2] = pb.UpdateChunk(data=bytes(data))

    nan_w = w.copy()
    nan_w[0, 0] = np.nan
    inf_b = b.copy()
    inf_b[1] = np.inf
    return {
        "digest": (OrderedDict(w=w, b=b), flip_byte, "SHA-256"),
        "shape": (OrderedDict(w=w.T.copy(), b=b), None, "shape"),
        "dtype": (OrderedDict(w=w.view(np.int32), b=b), None, "dtype"),
        "nan": (OrderedDict(w=nan_w, b=b), None, "NaN or Inf"),
        "inf": (OrderedDict(w=w, b=inf_b), None, "NaN or Inf"),
        "oversize": (OrderedDict(w=w, b=b, extra=np.zeros(10**6, np.float32)), None, "exceeds"),
    }


@pytest.mark.parametrize("case", ["digest", "shape", "dtype", "nan", "inf", "oversize"])
def test_bad_upload_invalid_argument_and_round_goes_on(
    case: str, grpc_run_factory, small_params
) -> None:
    # Prepare: three enrolled clients, two honest echo clients and one crafted bad upload.
    run = grpc_run_factory(small_params, clients=3, rounds=1, min_clients=2, round_timeout=20)
    good = [run.start_client(f"client-{i}", EchoTrainer(shift=1.0)) for i in range(2)]
    bad = _stub(run, "client-2")
    task = _task(bad)
    tensors, mutate, match = _bad_cases(small_params)[case]
    # Execute
    with pytest.raises(grpc.RpcError) as err:
        bad.SubmitUpdate(_chunks(task, tensors, mutate), timeout=10)
    # Assert: INVALID_ARGUMENT naming the problem; the others finish the round.
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in err.value.details()
    _join_all(good)
    assert run.coordinator.status == "completed"
    record = run.coordinator.run_dir.read_metrics()[-1]
    assert record["num_updates"] == 2
    assert "client-2" in record["failed"]
    assert match in record["failed"]["client-2"]


def test_a_stalled_upload_loses_its_slot_and_the_others_finish(
    grpc_run_factory, small_params
) -> None:
    # Prepare: one upload slot; client-2 takes it with a header and then sends nothing
    import threading
    import time

    run = grpc_run_factory(
        small_params, clients=3, min_clients=2, round_timeout=30,
        max_concurrent_uploads=1, upload_idle_timeout=0.5,
    )  # fmt: skip
    for i in range(2):  # online, so that the first cohort holds all three
        _stub(run, f"client-{i}").Join(pb.JoinRequest(num_examples=5), timeout=10)
    staller = _stub(run, "client-2")
    task = _task(staller)
    header = UpdateHeader(task.round, task.nonce, 5, num_tensors=2, total_bytes=28)
    release = threading.Event()

    def stalled():  # the header, then silence until the test ends
        yield pb.UpdateChunk(header=serde.update_header_to_proto(header))
        release.wait(30)

    outcome: dict[str, object] = {}

    def upload() -> None:
        try:
            staller.SubmitUpdate(stalled(), timeout=30)
        except grpc.RpcError as exc:
            outcome["code"] = exc.code()

    thread = threading.Thread(target=upload, daemon=True)
    thread.start()
    for _ in range(100):  # until it holds the slot
        rnd = run.coordinator.board.current
        if rnd is not None and "client-2" in rnd.streaming:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the stalled upload never took the slot")
    # Execute: two honest clients need the only slot
    good = [run.start_client(f"client-{i}", EchoTrainer(shift=1.0)) for i in range(2)]
    _join_all(good)
    release.set()
    thread.join(timeout=10)
    # Assert: the stall was cancelled after 0.5 s, the others' updates made the round
    assert run.coordinator.status == "completed", run.coordinator.stop_reason
    record = run.coordinator.run_dir.read_metrics()[-1]
    assert record["num_updates"] == 2
    assert record["failed"] == {"client-2": "upload stalled: no data for 0.5 s"}
    assert outcome["code"] == grpc.StatusCode.CANCELLED


def test_one_client_cannot_hold_the_servers_workers(grpc_run_factory, small_params) -> None:
    # Prepare: client-1 opens many uploads that never send a message; each would hold a
    # worker thread of the server's fixed pool
    import threading

    from server.servicer import MAX_CALLS_PER_CLIENT

    run = grpc_run_factory(small_params, clients=2, min_clients=2)
    hog, other = _stub(run, "client-1"), _stub(run, "client-0")
    hold = threading.Event()

    def nothing():
        hold.wait(30)
        yield from ()

    calls = [hog.SubmitUpdate.future(nothing(), timeout=30) for _ in range(3 * 2 + 8)]
    refused = []
    for call in calls:  # the calls past the limit are answered at once
        try:
            call.result(timeout=0.2)
        except grpc.FutureTimeoutError:
            continue
        except grpc.RpcError as exc:
            refused.append(exc)
    # Execute / Assert: the other client is still served, and the hog was refused by name
    reply = other.Join(pb.JoinRequest(num_examples=1), timeout=5)
    assert reply.client_id == "client-0"
    assert len(refused) == len(calls) - MAX_CALLS_PER_CLIENT
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
    assert "client client-1 already has 5 calls open" in refused[0].details()
    hold.set()
    for call in calls:
        call.cancel()


def test_the_call_limiter_counts_handlers_until_they_return() -> None:
    from server.servicer import CallLimiter

    class Context:  # what the limiter uses of a grpc.ServicerContext
        def abort(self, code, details):  # type: ignore[no-untyped-def]
            raise RuntimeError(f"{code}: {details}")

    limiter = CallLimiter(lambda ctx: "c0", limit=2)
    # Execute / Assert: two handlers run; a third is refused and not counted
    with limiter.admit(Context()) as first, limiter.admit(Context()) as second:
        assert first == second == "c0" and limiter.open_calls("c0") == 2
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED.*already has 2 calls open"):
            with limiter.admit(Context()):
                pass  # pragma: no cover - refused
        assert limiter.open_calls("c0") == 2
    assert limiter.open_calls("c0") == 0
    # a handler that fails (an abort raises) gives its place back too
    with pytest.raises(ValueError):
        with limiter.admit(Context()):
            raise ValueError("bad message")
    assert limiter.open_calls("c0") == 0


def test_cancelled_calls_do_not_let_a_client_hold_more_threads(
    grpc_run_factory, small_params
) -> None:
    # Prepare: client-1 opens long polls and cancels each at once, over and over: its
    # handlers keep waiting on the server's threads after their calls have ended
    import threading

    from server.servicer import MAX_CALLS_PER_CLIENT

    run = grpc_run_factory(small_params, clients=2, min_clients=2)
    coord = run.coordinator
    running = {"now": 0, "most": 0}
    lock = threading.Lock()
    real_poll = coord.poll

    def counting_poll(client_id: str, last_round: int):  # type: ignore[no-untyped-def]
        with lock:
            if client_id == "client-1":
                running["now"] += 1
                running["most"] = max(running["most"], running["now"])
        try:
            return real_poll(client_id, last_round)
        finally:
            with lock:
                if client_id == "client-1":
                    running["now"] -= 1

    coord.poll = counting_poll  # type: ignore[method-assign]
    hog, other = _stub(run, "client-1"), _stub(run, "client-0")
    hog.Join(pb.JoinRequest(num_examples=1), timeout=5)
    # Execute: 60 polls, cancelled in fives
    for _ in range(12):
        calls = [hog.PollTask.future(pb.PollRequest(), timeout=10) for _ in range(5)]
        time.sleep(0.05)
        for call in calls:
            call.cancel()
    # Assert: never more of its handlers than its share; the other client is served
    assert other.Join(pb.JoinRequest(num_examples=1), timeout=5).client_id == "client-0"
    assert 0 < running["most"] <= MAX_CALLS_PER_CLIENT


def test_refusals_and_the_others_finish(tmp_path: Path, grpc_run_factory, small_params) -> None:
    # Prepare: a server enrolling client-0/1; client-9 has a valid cert but is not enrolled;
    # a foreign CA issues its own client-0.
    run = grpc_run_factory(small_params, clients=2, min_clients=2, extra_ids=("client-9",))
    foreign = tmp_path / "foreign"
    init_certificates(foreign, clients=["client-0"])
    target = f"localhost:{run.port}"
    attempts = {
        "plaintext": grpc.insecure_channel(target),
        "foreign CA": grpc.secure_channel(target, channel_credentials(foreign, "client-0")),
        "unenrolled": grpc.secure_channel(target, channel_credentials(run.certs, "client-9")),
    }
    codes = {}
    for name, channel in attempts.items():
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.FlSecureStub(channel).Join(pb.JoinRequest(), timeout=5)
        codes[name] = err.value.code()
    assert codes["plaintext"] == grpc.StatusCode.UNAVAILABLE
    assert codes["foreign CA"] == grpc.StatusCode.UNAVAILABLE
    assert codes["unenrolled"] == grpc.StatusCode.PERMISSION_DENIED
    # Execute: the enrolled clients run the round.
    good = [run.start_client(f"client-{i}", EchoTrainer(shift=1.0)) for i in range(2)]
    _join_all(good)
    assert all("error" not in r for _, r, _ in good)
    assert run.coordinator.status == "completed"
    assert "client-9" not in run.coordinator.online_clients()
    assert run.coordinator.poll("client-0", 1).kind is TaskKind.FINISHED


def test_unusable_addresses_are_refused_by_name(grpc_run_factory, small_params) -> None:
    from fl_secure.errors import ConfigError
    from server.app import start_server

    run = grpc_run_factory(small_params, rounds=1)
    for address in ("127.0.0.1:99999", "bogus", "127.0.0.1:", ":50051"):
        with pytest.raises(ConfigError, match="expected host:port with a port in 0..65535"):
            start_server(run.coordinator, address, cert_dir=run.certs)
    # a port another server holds: grpcio raises RuntimeError; the caller gets the address
    with pytest.raises(ConfigError, match=f"could not bind the server to 127.0.0.1:{run.port}"):
        start_server(run.coordinator, f"127.0.0.1:{run.port}", cert_dir=run.certs)


def test_an_unreachable_server_is_reported_once_loudly_then_explained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import socket

    from client.app import FlClient
    from client.transport import Connection, explain_rpc_error

    init_certificates(tmp_path / "certs", clients=1)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn = Connection(f"127.0.0.1:{port}", "client-0", cert_dir=tmp_path / "certs")
    client = FlClient(conn, lambda reply: EchoTrainer(), max_wait=0.3, sleep=lambda s: None)
    with caplog.at_level(logging.INFO, logger="client.app"), pytest.raises(grpc.RpcError) as err:
        client.run()
    retries = [r for r in caplog.records if "cannot reach the server" in r.getMessage()]
    assert retries and retries[0].levelno == logging.WARNING
    assert all(r.levelno == logging.INFO for r in retries[1:])
    assert f"127.0.0.1:{port} (UNAVAILABLE" in retries[0].getMessage()
    line = explain_rpc_error(err.value, conn.address)
    assert line.startswith(f"server 127.0.0.1:{port}: UNAVAILABLE: ")
    assert "is the server running" in line


def test_a_server_fault_on_one_header_refuses_that_client_alone(
    grpc_run_factory, small_params
) -> None:
    # Prepare: checking client-1's header raises something that is not a protocol error
    run = grpc_run_factory(small_params, clients=3, min_clients=2)
    real = run.coordinator.open_upload

    def open_upload(client_id, header, **kw):  # type: ignore[no-untyped-def]
        if client_id == "client-1":
            raise OverflowError("cannot convert float infinity to integer")
        return real(client_id, header, **kw)

    run.coordinator.open_upload = open_upload  # type: ignore[method-assign]
    good = [_stub(run, "client-0"), _stub(run, "client-2")]
    for stub in good:  # online, so that the first cohort holds all three
        stub.Join(pb.JoinRequest(num_examples=5), timeout=10)
    bad = _stub(run, "client-1")
    task_bad = _task(bad)
    # Execute / Assert: a named INTERNAL error (not UNKNOWN), recorded as that client's failure
    with pytest.raises(grpc.RpcError) as refused:
        bad.SubmitUpdate(_chunks(task_bad, small_params), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INTERNAL
    assert refused.value.details() == (
        "the server could not check this update's header (OverflowError)"
    )
    for stub in good:  # the round goes on with the others
        stub.SubmitUpdate(_chunks(_task(stub), small_params), timeout=10)
    run.driver.join(timeout=30)
    assert run.coordinator.status == "completed"
    assert run.coordinator.events[-1]["failed"] == {
        "client-1": "the server could not check this update's header (OverflowError)"
    }


def _two_send_and_client_2_declines(run, params) -> None:
    """Three clients join; client-2 declines its task, the others send theirs; the run ends."""
    stubs = [_stub(run, f"client-{i}") for i in range(3)]
    for stub in stubs:  # online, so that the first cohort holds all three
        stub.Join(pb.JoinRequest(num_examples=5), timeout=10)
    tasks = [_task(stub) for stub in stubs]
    _decline(stubs[2], tasks[2])
    for stub, task in zip(stubs[:2], tasks[:2], strict=True):
        stub.SubmitUpdate(_chunks(task, params), timeout=10)
    run.driver.join(timeout=20)


def _decline(stub, task) -> None:
    stub.SecAggExchange(
        pb.SecAggMessage(
            round=task.round,
            nonce=task.nonce,
            stage=pb.SECAGG_STAGE_WITHDRAW,
            withdraw_reason=pb.WITHDRAW_REASON_DECLINED,
        ),
        timeout=10,
    )


def test_a_plain_task_a_site_declines_is_not_waited_for(grpc_run_factory, small_params) -> None:
    # Prepare: three clients, two needed; round_timeout 300 s, so a round still waiting for
    # the declining client could not end within the driver's 20 s below
    run = grpc_run_factory(small_params, clients=3, min_clients=2, round_timeout=300)
    # Execute: client-2 declines (its budget, say); the others send their updates
    _two_send_and_client_2_declines(run, small_params)
    # Assert: the round completed without it, and says why
    assert run.coordinator.status == "completed"
    assert run.coordinator.events[-1]["failed"] == {
        "client-2": "declined the task (the site's own policy declined the round, such as its "
        "privacy budget)"
    }


def test_a_site_that_declined_is_not_drawn_again_for_the_round(
    grpc_run_factory, small_params
) -> None:
    # Prepare: three clients, all three needed, one retry
    run = grpc_run_factory(small_params, clients=3, min_clients=3, round_timeout=300, max_retries=1)
    # Execute: client-2 declines attempt 0; the others send theirs
    _two_send_and_client_2_declines(run, small_params)
    # Assert: the retry drew from the two others only, which is too few: the round aborts
    # at once instead of asking client-2 again
    assert run.coordinator.status == "aborted"
    assert "the sampled cohort had 2 clients" in run.coordinator.stop_reason
