"""A real gRPC server with mutual TLS over a coordinator, and echo clients, on port 0."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from client.app import Connection, FlClient
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.runs import RunDir
from fl_secure.tls import CertificateSet, EnrollmentList, init_certificates
from server.app import load_enrollment, start_server
from server.coordinator import Coordinator, CoordinatorSettings


class EchoTrainer:
    """Test double of LocalTrainer: sends back what it received plus ``shift``."""

    def __init__(self, shift: float = 0.0, examples: int = 1) -> None:
        self.shift, self.num_examples, self.seen = shift, examples, []

    def train(self, shared: Tensors, training: LocalTraining):
        self.seen.append(shared)
        if self.shift == 0.0:  # exact echo (x + 0.0 would turn -0.0 into 0.0)
            update = OrderedDict((k, v.copy()) for k, v in shared.items())
        else:
            update = OrderedDict((k, (v + self.shift).astype(v.dtype)) for k, v in shared.items())
        return update, self.num_examples, {"shift": self.shift}

    def evaluate(self, shared: Tensors):
        return self.num_examples, {"tar_at_far_1e-2": 0.5}


@dataclass
class GrpcRun:
    coordinator: Coordinator
    port: int
    certs: Path
    server: object
    driver: threading.Thread

    def client(self, client_id: str, trainer: EchoTrainer | None = None) -> FlClient:
        conn = Connection(f"localhost:{self.port}", client_id, cert_dir=self.certs)
        t = trainer or EchoTrainer()
        return FlClient(conn, lambda reply: t, max_wait=20.0)  # type: ignore[arg-type,return-value]

    def start_client(self, client_id: str, trainer: EchoTrainer | None = None):
        c = self.client(client_id, trainer)
        result: dict[str, object] = {}

        def target() -> None:
            try:
                result["message"] = c.run()
            except Exception as exc:  # noqa: BLE001 - surfaced by the test
                result["error"] = exc

        th = threading.Thread(target=target, daemon=True)
        th.start()
        return th, result, c


def make_run(
    tmp_path: Path,
    initial: Tensors,
    *,
    clients: int = 3,
    rounds: int = 1,
    min_clients: int = 2,
    round_timeout: float = 30.0,
    server_step=None,
    extra_ids: tuple[str, ...] = (),
    broadcast=None,
    on_round=None,
) -> GrpcRun:
    certs = tmp_path / "certs"
    ids = [f"client-{i}" for i in range(clients)]
    init_certificates(certs, clients=[*ids, *extra_ids])
    full = load_enrollment(certs)  # extra ids get certificates but are not enrolled
    kept = {k: v for k, v in full.fingerprints.items() if k not in extra_ids}
    EnrollmentList(kept).save(CertificateSet(certs).enrollment)
    enrolled = set(kept)
    settings = CoordinatorSettings(
        rounds=rounds,
        min_clients=min_clients,
        round_timeout=round_timeout,
        poll_wait=0.5,
        final_evaluation=False,
        run_id="test",
        run_config_toml="",
    )
    coord = Coordinator(
        settings,
        initial,
        enrolled=enrolled,
        run_dir=RunDir(tmp_path / "run"),
        server_step=server_step or (lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p)),
        broadcast=broadcast,
    )
    server, port = start_server(coord, "127.0.0.1:0", cert_dir=certs)
    driver = threading.Thread(target=coord.run, kwargs={"on_round": on_round}, daemon=True)
    driver.start()
    return GrpcRun(coord, port, certs, server, driver)


@pytest.fixture
def small_params() -> Tensors:
    rng = np.random.default_rng(1)
    return OrderedDict(
        [("w", rng.standard_normal((4, 3)).astype(np.float32)), ("b", np.zeros(4, np.float32))]
    )


@pytest.fixture
def grpc_run_factory(tmp_path: Path) -> Iterator:
    runs: list[GrpcRun] = []

    def factory(initial: Tensors, **kw) -> GrpcRun:
        run = make_run(tmp_path, initial, **kw)
        runs.append(run)
        return run

    yield factory
    for run in runs:
        run.coordinator.stop("test teardown")
        run.server.stop(grace=None)  # type: ignore[attr-defined]
        run.driver.join(timeout=10)
