"""Under DP every figure a site sends is the same whatever the size of its data.

Three sites of one run hold 8, 12 and 28 training images (2, 3 and 7 batches of 4 an epoch)
and 4, 6 and 12 test images. Each is a real :class:`client.trainer.LocalTrainer` driven by
the real client loop (:class:`client.app.FlClient`) through a run's tasks (evaluate the
initial model, train one epoch, evaluate the final model) against a stub of the server that
keeps the serialized messages the client sends. Under each DP unit those messages must not
tell the sites apart: not the example count, nor the schedule (``local_steps`` was epochs x
N / batch), nor the time (``local_seconds``), nor the evaluation's pair counts. Without DP
they do, as before (the count weights the mean).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from client.app import FlClient
from client.secure_round import SecureExchange
from client.trainer_factory import build_local_trainer
from client.transport import Backoff, Connection
from fl_secure import __version__, serde
from fl_secure.config import Config, PrivacyConfig, config_from_dict, config_to_toml
from fl_secure.data.plan import FederatedData, plan_federation
from fl_secure.data.types import FaceDataset
from fl_secure.messages import JoinReply, Task, TaskKind, Tensors, UpdateHeader
from fl_secure.runs import RunDir
from fl_secure.training import local_training
from fl_secure.v1 import transport_pb2 as pb
from privacy.dp.noise import SeededGaussian
from privacy.server_round import open_server_privacy
from privacy.site_figures import DPSGD_FIGURES, released_header
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings

#: (training images, test images) of the three sites.
SITES = ((8, 4), (12, 6), (28, 12))
DP_UNITS = ("client", "example", "identity")
#: A fixed per-record rate for the DP-SGD units (unset, q = batch / N is derived from N).
RATES = {"example": 0.25, "identity": 0.5}


def _config(unit: str, **privacy: Any) -> Config:
    table: dict[str, Any] = {
        "run": {"seed": 3},
        "data": {"image_size": 32, "num_identities": 8, "images_per_identity": 10,
                 "held_out_identities": 0},
        "partition": {"num_clients": 2},
        "model": {"backbone": "cnn-small", "embedding_size": 16},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 1, "local_epochs": 1, "batch_size": 4},
        "server": {"min_clients": 2},
    }  # fmt: skip
    if unit != "none":
        rate = {"sample_rate": RATES[unit]} if unit in RATES else {}
        table["privacy"] = {"unit": unit, "noise_multiplier": 1.0, "secure_rng": False,
                            **rate, **privacy}  # fmt: skip
    return config_from_dict(table)


@pytest.fixture(scope="module")
def plan() -> FederatedData:
    return plan_federation(_config("none"))  # the data do not depend on the privacy unit


def _round_robin(data: FaceDataset, k: int, identities: int) -> FaceDataset:
    """``k`` images of ``data``'s first ``identities`` identities, one of each in turn."""
    labels = data.labels.numpy()
    pools = [list(np.flatnonzero(labels == i)) for i in np.unique(labels)[:identities]]
    order = [pool[j] for j in range(max(map(len, pools))) for pool in pools if j < len(pool)]
    assert len(order) >= k
    return data.subset(np.array(order[:k]))


def _site(plan: FederatedData, size: tuple[int, int]) -> tuple[FaceDataset, FaceDataset]:
    share = plan.clients[0]
    # test images of two identities at least twice each (the scores are verification's)
    people = 2 if size[1] <= 6 else 4
    return _round_robin(share.train, size[0], 4), _round_robin(share.test, size[1], people)


class _Server:
    """A stub of the server's side of the wire: a run's tasks; keeps what the client sends."""

    def __init__(self, config: Config, params: Tensors) -> None:
        self.config_toml, self.params = config_to_toml(config), params
        size = serde.total_bytes(params)
        training = local_training(config.train)
        self.tasks = [
            Task(TaskKind.EVALUATE, round=0, nonce=b"e" * 16, parameters_bytes=size),
            Task(TaskKind.TRAIN, round=1, nonce=b"t" * 16, training=training,
                 parameters_bytes=size),
            Task(TaskKind.EVALUATE, round=2, nonce=b"f" * 16, parameters_bytes=size),
            Task(TaskKind.FINISHED, message="done"),
        ]  # fmt: skip
        self.sent: list[tuple[str, bytes]] = []  # (what, serialized message) in order

    def Join(self, request: pb.JoinRequest, **_: Any) -> pb.JoinReply:  # noqa: N802
        self.sent.append(("join", request.SerializeToString(deterministic=True)))
        return serde.join_reply_to_proto(
            JoinReply("client-0", "run", __version__, self.config_toml)
        )

    def PollTask(self, request: pb.PollRequest, **_: Any) -> pb.Task:  # noqa: N802
        self.sent.append(("poll", request.SerializeToString(deterministic=True)))
        return serde.task_to_proto(self.tasks.pop(0))

    def GetParameters(self, request: pb.ParametersRequest, **_: Any) -> Iterator[Any]:  # noqa: N802
        self.sent.append(("parameters", request.SerializeToString(deterministic=True)))
        return serde.parameters_to_chunks(request.round, self.params)

    def SubmitUpdate(self, chunks: Iterable[pb.UpdateChunk], **_: Any) -> pb.SubmitReply:  # noqa: N802
        for chunk in chunks:
            kind = chunk.WhichOneof("kind")
            if kind == "header":
                self.sent.append(("update", chunk.header.SerializeToString(deterministic=True)))
            elif kind == "tensor":  # the tensor's name, dtype, shape and size (not its digest)
                chunk.tensor.ClearField("sha256")
                self.sent.append(("tensor", chunk.tensor.SerializeToString(deterministic=True)))
        return pb.SubmitReply(accepted=True)

    def SecAggExchange(self, message: pb.SecAggMessage, **_: Any) -> pb.SecAggMessage:  # noqa: N802
        self.sent.append(("secagg", message.SerializeToString(deterministic=True)))
        return pb.SecAggMessage()


def _run_site(config: Config, plan: FederatedData, size: tuple[int, int]) -> _Server:
    """One site of ``size`` through the run's tasks; the server stub with what it sent."""
    train, test = _site(plan, size)

    def factory(reply: JoinReply) -> Any:
        return build_local_trainer(
            config, train, test, plan.train_identities, client_id="client-0", image_size=32,
            run_id=reply.run_id,
        )  # fmt: skip

    initial = factory(JoinReply("client-0", "run", __version__)).shared_parameters()
    server = _Server(config, initial)
    client = FlClient(Connection("localhost:1", "client-0"), factory, sleep=lambda s: None)
    assert client._session(server, Backoff()) == "done"  # type: ignore[arg-type]
    assert client.rounds_done == 3 and len(train) == size[0] and len(test) == size[1]
    return server


def _headers(server: _Server) -> list[pb.UpdateHeader]:
    return [pb.UpdateHeader.FromString(m) for what, m in server.sent if what == "update"]


def _without_scores(server: _Server) -> list[tuple[str, bytes]]:
    """What ``server`` was sent, less the two evaluation headers (their scores differ)."""
    updates = [i for i, (what, _) in enumerate(server.sent) if what == "update"]
    assert len(updates) == 3  # evaluate, train, evaluate
    return [m for i, m in enumerate(server.sent) if i not in (updates[0], updates[2])]


@pytest.mark.parametrize("unit", DP_UNITS)
def test_under_dp_every_figure_a_site_sends_is_the_same_whatever_its_size(
    unit: str, plan: FederatedData
) -> None:
    # Prepare / Execute: the three sites through the same run (one epoch of batches of 4)
    config = _config(unit)
    servers = [_run_site(config, plan, size) for size in SITES]
    # Assert: the training update carries the count 1 and the accountant's figures only
    train = [_headers(s)[1] for s in servers]
    expected = set(DPSGD_FIGURES) if unit in RATES else set()
    assert [(h.num_examples, set(h.metrics)) for h in train] == [(1, expected)] * 3
    # ... the evaluations the count 1 and the same score names, no count of pairs, no time
    names = set(_headers(servers[0])[0].metrics)
    assert "rank1" in names and not names & {"num_genuine", "num_impostor", "local_seconds"}
    for server in servers:
        assert [(h.num_examples, set(h.metrics)) for h in _headers(server)[::2]] == [(1, names)] * 2
    # ... and everything else (joins, polls, downloads, the training update's header and its
    # tensors' headers) is byte for byte the same at every site
    assert _without_scores(servers[0]) == _without_scores(servers[1])
    assert _without_scores(servers[0]) == _without_scores(servers[2])


def test_without_dp_a_site_states_its_count_and_schedule_as_before(
    plan: FederatedData,
) -> None:
    # Prepare / Execute: the same sites in a run without DP
    servers = [_run_site(_config("none"), plan, size) for size in SITES[:2]]
    # Assert: the count weights the mean, the schedule and time are stated, as before
    train = [_headers(s)[1] for s in servers]
    assert [h.num_examples for h in train] == [8, 12]
    assert [h.metrics["local_steps"] for h in train] == [2.0, 3.0]
    assert all(h.metrics["local_seconds"] > 0 for h in train)
    assert [_headers(s)[0].num_examples for s in servers] == [4, 6]
    assert {"num_genuine", "num_impostor"} <= set(_headers(servers[0])[0].metrics)


def test_with_the_sample_rate_unset_only_the_rate_derived_figures_tell_sites_apart(
    plan: FederatedData,
) -> None:
    # Prepare / Execute: example level with privacy.sample_rate unset: q = 4 / N
    config = _config("example", sample_rate=0.0)
    servers = [_run_site(config, plan, size) for size in SITES]
    # Assert: the documented exception (the report's example-count-public): q, the steps
    # 1 / q and the epsilon they give differ; nothing else does
    train = [dict(_headers(s)[1].metrics) for s in servers]
    assert [m["dp_sample_rate"] for m in train] == pytest.approx([4 / 8, 4 / 12, 4 / 28])
    assert [m["dp_steps"] for m in train] == [2.0, 3.0, 7.0]
    differ = {k for k in train[0] if len({m[k] for m in train}) > 1}
    assert differ == {"dp_sample_rate", "dp_steps", "dp_epsilon"}
    assert set(train[0]) == set(DPSGD_FIGURES)
    assert {_headers(s)[1].num_examples for s in servers} == {1}


class _Call:
    """A stub RPC: called, it keeps the message; ``future`` starts nothing."""

    def __init__(self, keep: list[Any]) -> None:
        self.keep = keep

    def __call__(self, message: Any, **_: Any) -> pb.SubmitReply:
        self.keep.append(message)
        return pb.SubmitReply(accepted=True)

    def future(self, message: Any, **_: Any) -> None:
        return None


@pytest.mark.parametrize("unit", DP_UNITS)
def test_under_dp_a_secure_upload_states_the_same_figures_whatever_the_size(
    unit: str, plan: FederatedData
) -> None:
    # Prepare: the secure round's upload (CKKS: one ciphertext tensor) of each site
    config = _config(unit)
    headers = []
    for size in SITES:
        train, test = _site(plan, size)
        trainer = build_local_trainer(config, train, test, plan.train_identities,
                                      client_id="client-0", image_size=32)  # fmt: skip
        uploads: list[Any] = []
        stub = SimpleNamespace(SecAggExchange=_Call([]), SubmitUpdate=_Call(uploads))
        params = trainer.shared_parameters()
        task = Task(TaskKind.TRAIN, round=1, nonce=b"t" * 16, training=local_training(config.train))
        exchange = SecureExchange(stub, task, (), trainer=trainer, run_config=config,
                                  fetch=lambda p=params: p, started=0.0,
                                  count_release=lambda task, metrics: None)  # fmt: skip
        # Execute: train, then upload the (here: dummy) ciphertext
        exchange._compute()
        exchange._upload(np.zeros(16, np.uint8))
        (chunks,) = uploads
        header = next(iter(chunks)).header
        headers.append(header.SerializeToString(deterministic=True))
    # Assert: the same header bytes at every site: count 1, the accountant's figures only
    assert headers[0] == headers[1] == headers[2]
    header = pb.UpdateHeader.FromString(headers[0])
    assert header.num_examples == 1
    assert set(header.metrics) == (set(DPSGD_FIGURES) if unit in RATES else set())


def test_the_server_records_only_the_figures_a_private_site_may_send(tmp_path: Path) -> None:
    # Prepare: client-level DP (central noise); three clients of an older version state 20
    # images, their schedule, time and training loss
    privacy = open_server_privacy(
        PrivacyConfig(unit="client", noise_placement="central", noise_multiplier=2.0),
        tmp_path / "ledger.sqlite", "test-run", rounds=1, population=3, clients_per_round=0,
        sample_rate=0.0, source=SeededGaussian(0),
    )  # fmt: skip
    settings = CoordinatorSettings(rounds=1, min_clients=3, round_timeout=60.0, poll_wait=0.05,
                                   final_evaluation=False)  # fmt: skip
    initial = OrderedDict([("w", np.zeros((2, 2), np.float32))])
    coord = Coordinator(settings, initial, enrolled={"c0", "c1", "c2"}, run_dir=RunDir(tmp_path),
                        server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p),
                        privacy=privacy)  # fmt: skip
    told = {"local_steps": 5.0, "local_seconds": 1.25, "train_loss": 0.5}

    def submit(cid: str) -> None:
        while (task := coord.poll(cid, 0)).kind is not TaskKind.TRAIN:
            pass
        _, params = coord.parameters(cid, task.round, task.nonce)
        ticket = coord.open_upload(cid, UpdateHeader(task.round, task.nonce, 20, told, 1, 16))
        try:
            coord.commit_upload(
                ticket, OrderedDict((k, np.ones_like(v)) for k, v in params.items())
            )
        finally:
            coord.release_upload(ticket)

    for cid in ("c0", "c1", "c2"):
        coord.join(cid, 1)
    driver = threading.Thread(target=coord.run)
    driver.start()
    workers = [threading.Thread(target=submit, args=(c,)) for c in ("c0", "c1", "c2")]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    driver.join(timeout=30)
    # Execute / Assert: metrics.jsonl keeps the count 1 per update and none of the figures
    assert coord.status == "completed", coord.stop_reason
    record = RunDir(tmp_path).read_metrics()[-1]
    assert record["num_examples"] == 3
    assert record["clients"] == {"c0": {}, "c1": {}, "c2": {}}


@pytest.mark.parametrize(
    ("unit", "train", "kept"),
    [
        ("none", True, {"local_steps", "local_seconds", "train_loss", "dp_steps", "num_genuine",
                        "rank1"}),
        ("client", True, set()),
        ("example", True, {"dp_steps"}),
        ("identity", False, {"train_loss", "dp_steps", "rank1"}),
    ],
)  # fmt: skip
def test_released_header_keeps_what_the_unit_allows(unit: str, train: bool, kept: set[str]) -> None:
    figures = {"local_steps": 7.0, "local_seconds": 0.3, "train_loss": 1.0, "dp_steps": 4.0,
               "num_genuine": 12.0, "rank1": 0.5}  # fmt: skip
    out = released_header(UpdateHeader(1, b"n", 28, figures), unit=unit, train=train)
    assert set(out.metrics) == kept
    assert out.num_examples == (28 if unit == "none" else 1)
