"""A hostile client over real mutual TLS: it may not hold the upload slots, flood or forge the
server's log, learn the server's config or the other clients' fate, or mis-announce its bytes.
"""

from __future__ import annotations

import threading
import time

import grpc

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
