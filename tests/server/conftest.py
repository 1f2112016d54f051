"""A real gRPC server with mutual TLS over a coordinator, and echo clients, on port 0."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.app import FlClient
from client.trainer import LocalTrainer
from client.trainer_factory import build_local_trainer
from client.transport import Connection
from fl_secure.config import Config
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.runs import RunDir
from fl_secure.tls import CertificateSet, EnrollmentList, init_certificates
from server.app import load_enrollment, start_server
from server.bootstrap import ServerSide, build_server
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings


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
    **settings,
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
        **settings,
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


class Recorder:
    """A real LocalTrainer; records what it received and released, and the raw update."""

    def __init__(self, trainer: LocalTrainer) -> None:
        self.trainer = trainer
        self.num_examples = trainer.num_examples
        self.received: list[Tensors] = []
        self.released: list[tuple[Tensors, int]] = []  # (update as sent, example count)
        self.raw: list[Tensors] = []  # the update before the privacy module's clip and noise
        privacy = trainer.privacy
        if privacy is not None:
            release = privacy.release

            def spy(
                update: Tensors, metrics: dict[str, float], trained: bool
            ) -> tuple[Tensors, dict[str, float]]:
                self.raw.append(OrderedDict((k, v.copy()) for k, v in update.items()))
                return release(update, metrics, trained)

            privacy.release = spy  # type: ignore[method-assign]

    def train(self, shared: Tensors, training: LocalTraining) -> tuple[Tensors, int, Any]:
        self.received.append(OrderedDict((k, v.copy()) for k, v in shared.items()))
        update, examples, metrics = self.trainer.train(shared, training)
        self.released.append((OrderedDict((k, v.copy()) for k, v in update.items()), examples))
        return update, examples, metrics

    def evaluate(self, shared: Tensors) -> tuple[int, dict[str, float]]:
        return self.trainer.evaluate(shared)


def serve_config(
    tmp_path: Path,
    config: Config,
    ids: list[str],
    *,
    state_dirs: bool = False,
    before: Callable[[str, LocalTrainer], None] | None = None,
) -> tuple[ServerSide, dict[str, Recorder]]:
    """Run ``config`` to its end: ``build_server`` over gRPC + mTLS, and one recording client
    thread per id, each a real ``LocalTrainer`` on its share of the data plan (``before`` sees
    each trainer before any round)."""
    certs = tmp_path / "certs"
    init_certificates(certs, clients=ids)
    load_enrollment(certs)
    side = build_server(config, RunDir(tmp_path / "run"), enrolled=set(ids), cert_dir=certs)
    recorders = {}
    for i, cid in enumerate(ids):
        share = side.plan.clients[i]
        trainer = build_local_trainer(
            config,
            share.train,
            share.test,
            side.plan.train_identities,
            client_id=cid,
            image_size=config.data.image_size,
            state_dir=tmp_path / "clients" / cid if state_dirs else None,
            run_id=side.coordinator.settings.run_id,  # as a client learns it at join
        )
        if before is not None:
            before(cid, trainer)
        recorders[cid] = Recorder(trainer)
    server, port = start_server(side.coordinator, "127.0.0.1:0", cert_dir=certs)
    driver = threading.Thread(target=side.coordinator.run, daemon=True)
    driver.start()
    threads = []
    try:
        for cid in ids:
            client = FlClient(
                Connection(f"localhost:{port}", cid, cert_dir=certs),
                lambda reply, t=recorders[cid]: t,  # type: ignore[misc]
                max_wait=30.0,
            )
            threads.append(threading.Thread(target=client.run, daemon=True))
            threads[-1].start()
        driver.join(timeout=600)
        for th in threads:
            th.join(timeout=30)
    finally:
        side.coordinator.stop("test teardown")
        server.stop(grace=None)
    return side, recorders


@pytest.fixture
def serve() -> Callable[..., tuple[ServerSide, dict[str, Recorder]]]:
    """:func:`serve_config` for a test (fixtures are how test files share helpers here)."""
    return serve_config
