"""FedGC over gRPC + mTLS: each client's class embeddings go up, are corrected, come back alone."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from client.app import FlClient
from client.transport import Connection
from fl_secure.algorithms import FedGC
from fl_secure.algorithms.fedgc import WEIGHT, correct_embeddings
from fl_secure.errors import ProtocolError
from fl_secure.messages import LocalTraining, Tensors, TensorSpec
from fl_secure.runs import RunDir
from fl_secure.tls import init_certificates
from server.app import load_enrollment, start_server
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings

LR = 0.05  # the rounds' learning rate (the clients'); the server's eta is its own
STEP = FedGC(reg_lambda=20.0, reg_eta=0.05)  # lambda * eta = 1.0, logit scale 30


class HeadTrainer:
    """Test double of a FedGC LocalTrainer: a zero backbone update, then its head rows."""

    def __init__(self, head: np.ndarray) -> None:
        self.head, self.num_examples = head, 4
        self.seen: list[Tensors] = []
        self.uploaded: list[np.ndarray] = []

    def train(self, shared: Tensors, training: LocalTraining):  # type: ignore[no-untyped-def]
        self.seen.append(shared)
        if WEIGHT in shared:  # the server's corrected W_k replaces the local rows
            self.head = shared[WEIGHT].copy()
        self.head = (self.head * 1.01).astype(np.float32)  # "local training" moves the rows
        self.uploaded.append(self.head.copy())
        update = OrderedDict((k, np.zeros_like(v)) for k, v in shared.items() if k != WEIGHT)
        update[WEIGHT] = self.head.copy()
        return update, self.num_examples, {}

    def evaluate(self, shared: Tensors):  # type: ignore[no-untyped-def]
        return 1, {}


def _coordinator(tmp_path: Path, ids: list[str], params: Tensors) -> Coordinator:
    settings = CoordinatorSettings(
        rounds=2,
        min_clients=len(ids),
        round_timeout=60.0,
        poll_wait=0.5,
        final_evaluation=False,
        run_id="fedgc",
        training=LocalTraining(learning_rate=LR),
        head_specs=(TensorSpec(WEIGHT, np.dtype("float32"), (-1, 4)),),
        max_head_rows=10,
    )
    return Coordinator(
        settings,
        params,
        enrolled=set(ids),
        run_dir=RunDir(tmp_path / "run"),
        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p),
        head_step=STEP.server_heads,
    )


def test_each_client_gets_back_only_its_corrected_head(tmp_path: Path) -> None:
    # Prepare: 3 clients with 2, 3 and 4 identities; a server with the FedGC head step
    ids = ["client-0", "client-1", "client-2"]
    certs = tmp_path / "certs"
    init_certificates(certs, clients=ids)
    load_enrollment(certs)
    rng = np.random.default_rng(0)
    trainers = {
        c: HeadTrainer(rng.standard_normal((rows, 4)).astype(np.float32))
        for c, rows in zip(ids, (2, 3, 4), strict=True)
    }
    params: Tensors = OrderedDict([("backbone.w", np.ones((3, 2), np.float32))])
    coord = _coordinator(tmp_path, ids, params)
    server, port = start_server(coord, "127.0.0.1:0", cert_dir=certs)
    driver = threading.Thread(target=coord.run, daemon=True)
    driver.start()
    threads = []
    try:
        for c in ids:
            client = FlClient(
                Connection(f"localhost:{port}", c, cert_dir=certs),
                lambda reply, t=trainers[c]: t,  # type: ignore[misc]
                max_wait=20.0,
            )
            th = threading.Thread(target=client.run, daemon=True)
            th.start()
            threads.append(th)
        # Execute: two rounds
        driver.join(timeout=120)
        for th in threads:
            th.join(timeout=30)
    finally:
        coord.stop("test teardown")
        server.stop(grace=None)
    assert coord.status == "completed", coord.stop_reason
    # Assert: round 1 carries no head (the server has none yet); round 2 carries the
    # client's own W_k, corrected by Eq. 5 jointly with the others' round-1 uploads
    round1 = correct_embeddings(
        [trainers[c].uploaded[0] for c in ids], step=1.0, regularizer="softmax", scale=30.0
    )
    for k, c in enumerate(ids):
        first, second = trainers[c].seen
        assert list(first) == ["backbone.w"]
        assert list(second) == ["backbone.w", WEIGHT]
        np.testing.assert_allclose(second[WEIGHT], round1[k], rtol=1e-6)
        assert np.abs(round1[k] - trainers[c].uploaded[0]).max() > 1e-3  # it did move
        for other in ids:  # no row of another client's head, before or after correction
            if other == c:
                continue
            theirs = np.concatenate([trainers[other].uploaded[0], round1[ids.index(other)]])
            assert not np.isclose(second[WEIGHT][:, None, :], theirs[None]).all(-1).any()
    # ... and the server keeps the round-2 correction of each client, checkpointed
    round2 = correct_embeddings([trainers[c].uploaded[1] for c in ids], step=1.0, scale=30.0)
    resumed = _coordinator(tmp_path, ids, params)
    assert resumed.resume() == 2
    for k, c in enumerate(ids):
        np.testing.assert_allclose(coord.heads[c][WEIGHT], round2[k], rtol=1e-6)
        np.testing.assert_array_equal(resumed.heads[c][WEIGHT], coord.heads[c][WEIGHT])


def test_a_head_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    # Prepare: a coordinator that already holds client-0's head of 2 rows
    ids = ["client-0", "client-1"]
    coord = _coordinator(tmp_path, ids, OrderedDict([("backbone.w", np.ones(2, np.float32))]))
    coord.heads["client-0"] = OrderedDict([(WEIGHT, np.zeros((2, 4), np.float32))])
    # Execute / Assert: the expected upload is the shared update then exactly that head
    specs, size = coord.model.head_expectation("client-0")
    assert specs == [TensorSpec(WEIGHT, np.dtype("float32"), (2, 4))] and size == 32
    specs, size = coord.model.head_expectation("client-1")  # unknown: up to max_head_rows rows
    assert specs[0].shape == (-1, 4) and size == 10 * 4 * 4
    coord.model.check_head("client-1", OrderedDict([(WEIGHT, np.zeros((10, 4), np.float32))]))
    for bad in (np.zeros((11, 4), np.float32), np.zeros((3, 5), np.float32)):
        with pytest.raises(ProtocolError, match="head of client-1"):
            coord.model.check_head("client-1", OrderedDict([(WEIGHT, bad)]))
    with pytest.raises(ProtocolError, match="has 11 rows; this run takes 1 to 10 \\(server.max"):
        coord.model.check_head("client-1", OrderedDict([(WEIGHT, np.zeros((11, 4), np.float32))]))


def test_a_standalone_server_takes_heads_as_large_as_server_max_head_rows(tmp_path: Path) -> None:
    from fl_secure.config import config_from_dict
    from server.bootstrap import build_server

    # Prepare: FedGC whose server plan has few identities; sites bring their own data
    config = {"algorithm": {"name": "fedgc"}, "partition": {"num_clients": 2},
              "model": {"backbone": "cnn-small", "embedding_size": 8}}  # fmt: skip
    enrolled = {"client-0", "client-1"}
    default = build_server(config_from_dict(config), RunDir(tmp_path / "a"), enrolled=enrolled)
    identities = len(default.plan.train_identities)
    # Execute: the same with server.max_head_rows set past the plan's identities
    config["server"] = {"max_head_rows": identities + 500}
    larger = build_server(config_from_dict(config), RunDir(tmp_path / "b"), enrolled=enrolled)
    # Assert: the default is the plan's count; the setting replaces it
    assert default.coordinator.settings.max_head_rows == identities
    assert larger.coordinator.settings.max_head_rows == identities + 500
    head = OrderedDict([(WEIGHT, np.zeros((identities + 500, 8), np.float32))])
    larger.coordinator.model.check_head("client-0", head)
    with pytest.raises(ProtocolError, match="server.max_head_rows"):
        default.coordinator.model.check_head("client-0", head)
