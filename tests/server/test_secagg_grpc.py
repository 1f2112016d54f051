"""Secure aggregation over gRPC + mTLS: the server learns only the sum, dropouts recovered."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from client.app import Connection, FlClient
from fl_secure.config import SecureAggregationConfig
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.runs import RunDir
from fl_secure.tls import init_certificates
from fl_secure.tls.identity import load_signing_registry
from server.app import load_enrollment, start_server
from server.coordinator import Coordinator, CoordinatorSettings


class ShiftTrainer:
    """Sends ``shift`` everywhere as its update; ``fail`` makes it die while training."""

    def __init__(self, shift: float, fail: bool = False) -> None:
        self.shift, self.fail, self.num_examples = shift, fail, 5

    def train(self, shared: Tensors, training: LocalTraining):
        if self.fail:
            raise RuntimeError("site crashed while training")
        update = OrderedDict((k, np.full_like(v, self.shift)) for k, v in shared.items())
        return update, self.num_examples, {"train_loss": 1.0}

    def evaluate(self, shared: Tensors):
        return self.num_examples, {}


def _run(tmp_path: Path, shifts: list[float], failing: set[int]) -> Coordinator:
    certs = tmp_path / "certs"
    init_certificates(certs, clients=len(shifts))
    initial = OrderedDict([("w", np.zeros((50, 40), np.float32)), ("b", np.zeros(7, np.float32))])
    settings = CoordinatorSettings(
        rounds=1,
        min_clients=len(shifts) - len(failing),
        round_timeout=15.0 if failing else 60.0,  # a dead client is noticed at the deadline
        poll_wait=0.5,
        final_evaluation=False,
        run_id="secagg-test",
        secure_aggregation=SecureAggregationConfig(
            scheme="secagg", clip_range=4.0, stage_timeout=20
        ),
    )
    coord = Coordinator(
        settings,
        initial,
        enrolled=set(load_enrollment(certs).fingerprints),
        run_dir=RunDir(tmp_path / "run"),
        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p),
        signing_registry=load_signing_registry(certs),
    )
    server, port = start_server(coord, "127.0.0.1:0", cert_dir=certs)
    driver = threading.Thread(target=coord.run, daemon=True)
    driver.start()
    threads = []
    for i, shift in enumerate(shifts):
        trainer = ShiftTrainer(shift, fail=i in failing)
        client = FlClient(
            Connection(f"localhost:{port}", f"client-{i}", cert_dir=certs),
            lambda reply, t=trainer: t,  # type: ignore[misc]
            max_wait=20.0,
        )
        th = threading.Thread(target=lambda c=client: _quiet(c.run), daemon=True)
        th.start()
        threads.append(th)
    driver.join(timeout=120)
    server.stop(grace=None)
    return coord


def _quiet(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001, S110 - the failing client's thread just dies
        pass


def test_secure_sum_equals_the_plain_mean(tmp_path: Path) -> None:
    # Prepare: 4 clients, SecAgg (every pair masks), updates 0.5, 1.0, -0.25, 2.0
    shifts = [0.5, 1.0, -0.25, 2.0]
    # Execute
    coord = _run(tmp_path, shifts, failing=set())
    # Assert: the unmasked mean equals the plaintext mean within the fixed-point resolution
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts), atol=4 * 2.0**-20)
    record = RunDir(tmp_path / "run").read_metrics()[-1]
    sa = record["secure_aggregation"]
    assert (
        sa["scheme"] == "secagg"
        and sa["threshold"] == 2
        and sa["survivors"] == [f"client-{i}" for i in range(4)]
    )


def test_a_client_dropping_after_sharing_keys_is_recovered(tmp_path: Path) -> None:
    # Prepare: client-3 shares its keys, then dies while training (before its masked input)
    shifts = [0.5, 1.0, -0.25, 2.0]
    # Execute
    coord = _run(tmp_path, shifts, failing={3})
    # Assert: its pairwise masks were removed with the survivors' shares; exact mean of three
    assert coord.status == "completed", coord.stop_reason
    np.testing.assert_allclose(coord.params["w"], np.mean(shifts[:3]), atol=4 * 2.0**-20)
    sa = RunDir(tmp_path / "run").read_metrics()[-1]["secure_aggregation"]
    assert sa["survivors"] == ["client-0", "client-1", "client-2"]
