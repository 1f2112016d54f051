"""A client holds every round to the run config it joined under, and reconnects per outage."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from client.app import Connection, FlClient
from fl_secure import __version__, serde
from fl_secure.config import config_from_dict, config_to_toml
from fl_secure.errors import ProtocolError
from fl_secure.messages import JoinReply, LocalTraining, Task, TaskKind
from fl_secure.tls import init_certificates, server_credentials
from fl_secure.v1 import transport_pb2_grpc as pb_grpc

SECURE = config_from_dict(
    {"partition": {"num_clients": 3}, "server": {"min_clients": 2},
     "secure_aggregation": {"scheme": "secagg"}}
)  # fmt: skip


class _NoCalls:
    """A stub any call on which fails the test (nothing may be sent)."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the client called {name}")


def test_a_training_task_without_a_setup_in_a_secure_run_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = FlClient(Connection("localhost:1", "client-0"), lambda reply: None)  # type: ignore[arg-type,return-value]
    client._hold_run_config(config_to_toml(SECURE))
    client.trainer = object()  # type: ignore[assignment]  # never asked to train
    task = Task(kind=TaskKind.TRAIN, round=3, nonce=b"n" * 16, training=LocalTraining())
    with caplog.at_level("ERROR", logger="client.app"):
        client._do_task(_NoCalls(), task)  # type: ignore[arg-type]
    assert "round 3: refused: a training task without a secure-aggregation setup" in caplog.text
    assert client.last_round == 0 and client.rounds_done == 0


def test_a_later_join_with_another_run_config_is_refused() -> None:
    client = FlClient(Connection("localhost:1", "client-0"), lambda reply: None)  # type: ignore[arg-type,return-value]
    client._hold_run_config(config_to_toml(SECURE))
    client._hold_run_config(config_to_toml(SECURE))  # a server restart: the same run
    plain = config_from_dict({"partition": {"num_clients": 3}, "server": {"min_clients": 2}})
    with pytest.raises(ProtocolError, match="differs from the one this client joined under"):
        client._hold_run_config(config_to_toml(plain))


def test_each_outage_gets_max_wait_of_its_own(tmp_path: Path) -> None:
    # Prepare: a server that is down at first, up, then restarted; max_wait 1.5 s
    certs = tmp_path / "certs"
    init_certificates(certs, clients=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    finish = threading.Event()

    class Server(pb_grpc.FlSecureServicer):
        def Join(self, request, context):  # noqa: N802 - the gRPC method name
            return serde.join_reply_to_proto(JoinReply("client-0", "run", __version__, ""))

        def PollTask(self, request, context):  # noqa: N802
            time.sleep(0.1)
            kind = TaskKind.FINISHED if finish.is_set() else TaskKind.WAIT
            return serde.task_to_proto(Task(kind=kind, message="done"))

    def serve() -> grpc.Server:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_FlSecureServicer_to_server(Server(), server)
        server.add_secure_port(f"127.0.0.1:{port}", server_credentials(certs))
        server.start()
        return server

    class Trainer:
        num_examples = 1

    conn = Connection(f"localhost:{port}", "client-0", cert_dir=certs)
    client = FlClient(conn, lambda reply: Trainer(), max_wait=1.5)  # type: ignore[arg-type,return-value]
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["message"] = client.run()
        except grpc.RpcError as exc:
            result["error"] = exc.code()

    thread = threading.Thread(target=run)
    thread.start()
    # Execute: outage 1 (0.3 s), 2 s up (past max_wait since outage 1), outage 2 (0.3 s)
    time.sleep(0.3)
    server = serve()
    time.sleep(2.0)
    server.stop(None)
    time.sleep(0.3)
    server = serve()
    finish.set()
    thread.join(timeout=20)
    server.stop(None)
    # Assert: the client rode out both outages
    assert result == {"message": "done"}
