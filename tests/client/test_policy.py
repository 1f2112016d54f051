"""A client holds every round to the run config it joined under, and reconnects per outage."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections import OrderedDict
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from client.app import FlClient
from client.transport import Backoff, Connection
from fl_secure import __version__, serde
from fl_secure.config import config_from_dict, config_to_toml
from fl_secure.errors import PrivacyError, ProtocolError
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


def _plain_client() -> FlClient:
    config = config_from_dict(
        {"partition": {"num_clients": 3}, "server": {"min_clients": 2, "max_retries": 1},
         "train": {"rounds": 4, "lr": 0.1, "lr_schedule": "cosine"}}
    )  # fmt: skip
    client = FlClient(Connection("localhost:1", "client-0"), lambda reply: None)  # type: ignore[arg-type,return-value]
    client._hold_run_config(config_to_toml(config))
    return client


def _train_task(round_: int, nonce: bytes, **training: float) -> Task:
    from fl_secure.training import local_training, round_learning_rate

    config = config_from_dict(
        {"train": {"rounds": 4, "lr": 0.1, "lr_schedule": "cosine"}}
    )  # the run's [train] section
    t = config.train
    lr = round_learning_rate(t.lr, round_, t.rounds, t.lr_schedule)
    settings = dataclasses.replace(local_training(t), **{"learning_rate": lr, **training})
    return Task(kind=TaskKind.TRAIN, round=round_, nonce=nonce, training=settings)


def test_a_training_task_already_answered_is_refused() -> None:
    # Prepare: a run with max_retries = 1 (two attempts per round); round 2 answered once
    client = _plain_client()
    first = _train_task(2, b"a" * 16)
    assert client._refuse_training(first) == ""
    client._count_release(first)
    client.last_round = 2
    # Execute / Assert: the same task again is a replay; a new attempt of the round is not
    assert "already sent its update for this task" in client._refuse_training(first)
    retry = _train_task(2, b"b" * 16)
    assert client._refuse_training(retry) == ""
    client._count_release(retry)
    third = _train_task(2, b"c" * 16)
    assert "already sent 2 updates for round 2" in client._refuse_training(third)
    assert "older than round 2" in client._refuse_training(_train_task(1, b"d" * 16))
    assert client._refuse_training(_train_task(3, b"e" * 16)) == ""


def test_a_replayed_training_task_is_trained_and_sent_once() -> None:
    from fl_secure.v1 import transport_pb2 as pb

    # Prepare: a server stub that hands out round 1's task three times, then finishes
    config = config_from_dict(
        {"partition": {"num_clients": 3}, "server": {"min_clients": 2},
         "train": {"rounds": 4, "lr": 0.1, "lr_schedule": "cosine"}}
    )  # fmt: skip
    stub = _replaying_stub(config_to_toml(config), _train_task(1, b"r" * 16), times=3)
    trainer = _Trainer()
    conn = Connection("localhost:1", "client-0")
    client = FlClient(conn, lambda reply: trainer, sleep=lambda s: None)  # type: ignore[arg-type,return-value]
    # Execute
    message = client._session(stub, Backoff())
    # Assert: one training and one upload; the two replays were refused, and the server told
    assert message == "done" and stub.polls == 4
    assert trainer.trained == 1 and stub.uploads == 1 and client.rounds_done == 1
    assert stub.withdrawals == [pb.WITHDRAW_REASON_DECLINED] * 2


def test_a_ckks_round_in_a_masked_run_is_refused_before_any_stage(tmp_path: Path) -> None:

    # Prepare: a client that joined a SecAgg run (distributed noise would be dropped by CKKS)
    client = FlClient(Connection("localhost:1", "client-0", cert_dir=tmp_path), lambda r: None)  # type: ignore[arg-type,return-value]
    client._hold_run_config(config_to_toml(SECURE))
    # Execute
    calls = _ckks_round(client)
    # Assert: the client withdrew (message refused) and sent nothing else
    from fl_secure.v1 import transport_pb2 as pb

    assert calls == [(pb.SECAGG_STAGE_WITHDRAW, pb.WITHDRAW_REASON_MESSAGE_REFUSED)]
    assert client.rounds_done == 0


def _ckks_round(client: FlClient) -> list[tuple[int, int]]:
    """Run a CKKS task of round id r...r on ``client``; the (stage, reason) of each call.

    The stub fails the test if a stage is started: the round must be refused before.
    """
    from privacy.ckks.round_setup import CkksSetup

    client.trainer = object()  # type: ignore[assignment]  # never asked to train
    setup = CkksSetup(round_id=b"r" * 16, cohort=("client-0", "client-1"), layers=None,
                      min_count=2).to_bytes()  # fmt: skip
    task = Task(kind=TaskKind.TRAIN, round=1, nonce=b"n" * 16, secagg_setup=setup)
    calls: list[tuple[int, int]] = []

    class Stub:
        class SecAggExchange:  # noqa: N801 - the gRPC method name
            def __new__(cls, message, metadata, timeout):  # type: ignore[misc]
                calls.append((message.stage, message.withdraw_reason))

            @staticmethod
            def future(*args, **kwargs):  # noqa: ANN205
                raise AssertionError("a stage was started")

    client._secure_round(Stub(), task, lambda: OrderedDict(), 0.0)  # type: ignore[arg-type]
    return calls


def _replaying_stub(config_toml: str, task: Task, run_id: str = "run", times: int = 3) -> Any:
    """A server stub that hands out ``task`` ``times`` times, then finishes."""
    import numpy as np

    from fl_secure.v1 import transport_pb2 as pb

    params = OrderedDict(w=np.zeros(3, np.float32))

    class Stub:
        polls = 0
        uploads = 0

        def __init__(self) -> None:
            self.withdrawals: list[int] = []

        def Join(self, request, metadata, timeout):  # noqa: N802 - the gRPC method name
            return serde.join_reply_to_proto(
                JoinReply("client-0", run_id, __version__, config_toml)
            )

        def PollTask(self, request, metadata, timeout):  # noqa: N802
            self.polls += 1
            if self.polls > times:
                return serde.task_to_proto(Task(kind=TaskKind.FINISHED, message="done"))
            return serde.task_to_proto(task)

        def GetParameters(self, request, metadata, timeout):  # noqa: N802
            return iter(list(serde.parameters_to_chunks(1, params)))

        def SubmitUpdate(self, chunks, metadata, timeout):  # noqa: N802
            list(chunks)
            self.uploads += 1
            return pb.SubmitReply(message="ok")

        def SecAggExchange(self, message, metadata, timeout):  # noqa: N802
            self.withdrawals.append(message.withdraw_reason)
            return pb.SecAggMessage()

    return Stub()


class _Trainer:
    num_examples = 5

    def __init__(self) -> None:
        self.trained = 0

    def train(self, shared: Any, training: Any) -> Any:
        import numpy as np

        self.trained += 1
        return OrderedDict(w=np.ones(3, np.float32)), 5, {}


def test_a_restarted_client_still_refuses_a_task_it_answered(tmp_path: Path) -> None:
    from privacy.ledger.site_ledger import SiteLedger

    # Prepare: a plain run; the client answers round 1, and its process is restarted
    config = config_from_dict(
        {"partition": {"num_clients": 3}, "server": {"min_clients": 2},
         "train": {"rounds": 4, "lr": 0.1, "lr_schedule": "cosine"}}
    )  # fmt: skip
    task = _train_task(1, b"r" * 16)
    conn = Connection("localhost:1", "client-0")
    first = _Trainer()
    client = FlClient(conn, lambda r: first, sleep=lambda s: None, site=SiteLedger(tmp_path))  # type: ignore[arg-type,return-value]
    client._session(_replaying_stub(config_to_toml(config), task, times=1), Backoff())
    assert first.trained == 1
    # Execute: the restarted process (a new FlClient on the same state folder) gets it again
    second = _Trainer()
    restarted = FlClient(conn, lambda r: second, sleep=lambda s: None, site=SiteLedger(tmp_path))  # type: ignore[arg-type,return-value]
    stub = _replaying_stub(config_to_toml(config), task, times=2)
    assert restarted._session(stub, Backoff()) == "done"
    # Assert: nothing trained, nothing sent; a new run id on a later join is refused
    assert second.trained == 0 and stub.uploads == 0
    with pytest.raises(ProtocolError, match="run id differs"):
        restarted._session(_replaying_stub(config_to_toml(config), task, "other"), Backoff())


def test_a_site_budget_stops_releases_and_withdraws_from_a_secure_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from privacy.ledger.site_ledger import SiteLedger

    # Prepare: z = 1 per release: one release spends epsilon 4.38 at delta 1e-5, two 6.4; a
    # budget of 5. The site joined (one release fits) and round 1 went out
    config = config_from_dict(
        {"partition": {"num_clients": 3}, "server": {"min_clients": 2},
         "privacy": {"unit": "client", "noise_multiplier": 1.0},
         "secure_aggregation": {"scheme": "ckks"}}
    )  # fmt: skip
    toml = config_to_toml(config)
    task = dataclasses.replace(_train_task(2, b"s" * 16), secagg_setup=b"setup")
    trainer = _Trainer()
    site = SiteLedger(tmp_path, max_epsilon=5.0)
    client = FlClient(
        Connection("localhost:1", "client-0"), lambda r: trainer, sleep=lambda s: None, site=site
    )  # type: ignore[arg-type,return-value]
    client._hold_run_config(toml, "run")
    site.record(config, "run", 1, b"1" * 16)
    stub = _replaying_stub(toml, task, times=1)
    # Execute: round 2's task
    with caplog.at_level("ERROR", logger="client.app"):
        assert client._session(stub, Backoff()) == "done"
    # Assert: refused before any stage, with the reason the server is told
    from fl_secure.v1 import transport_pb2 as pb

    assert "above its budget of 5" in caplog.text
    assert trainer.trained == 0 and stub.uploads == 0
    assert stub.withdrawals == [pb.WITHDRAW_REASON_DECLINED]


def test_an_example_budget_declines_a_round_before_it_trains(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from privacy.client_round import ClientPrivacy
    from privacy.dp.gdp import example_epsilon
    from privacy.ledger.site_ledger import SiteLedger
    from privacy.ledger.site_release import release_for

    # Prepare: example-level DP-SGD, z = 1.1, q = 0.05, 60 steps a round; a site budget
    # between the epsilon of one round and that of two
    config = config_from_dict(
        {"partition": {"num_clients": 3}, "server": {"min_clients": 2},
         "train": {"rounds": 4, "lr": 0.1},
         "privacy": {"unit": "example", "noise_multiplier": 1.1, "sample_rate": 0.05}}
    )  # fmt: skip
    plan = (1.1, 0.05, 60)
    one, two = (
        example_epsilon([release_for(config, "r", i, b"", plan) for i in range(n)], 1e-5)
        for n in (1, 2)
    )
    budget = (one + two) / 2

    class DpTrainer(_Trainer):
        privacy = ClientPrivacy(config, num_examples=100)

        def train(self, shared: Any, training: Any) -> Any:
            update, n, _ = super().train(shared, training)
            steps = self.privacy.planned_dpsgd(training)
            assert steps == plan  # the task's local_steps at the site's own q
            z, q, t = steps
            return update, n, {"dp_noise_multiplier": z, "dp_sample_rate": q, "dp_steps": t}

    trainer = DpTrainer()
    site = SiteLedger(tmp_path, max_example_epsilon=budget)
    client = FlClient(
        Connection("localhost:1", "client-0"), lambda r: trainer, sleep=lambda s: None, site=site
    )  # type: ignore[arg-type,return-value]
    toml = config_to_toml(config)
    # Execute: rounds 1 and 2 (the plan's 60 steps each)
    for round_ in (1, 2):
        task = _train_task(round_, bytes([round_]) * 16, local_steps=60)
        stub = _replaying_stub(toml, task, times=1)
        with caplog.at_level("INFO", logger="client.app"):
            assert client._session(stub, Backoff()) == "done"
    # Assert: round 1 trained, went out and was counted with its steps; round 2 was
    # declined before training, and the server was told
    from fl_secure.v1 import transport_pb2 as pb

    assert trainer.trained == 1
    assert [(r.round, r.dpsgd_steps) for r in SiteLedger(tmp_path).releases] == [(1, 60)]
    assert stub.uploads == 0 and stub.withdrawals == [pb.WITHDRAW_REASON_DECLINED]
    assert site.example_epsilon() == pytest.approx(one)
    assert f"1 releases; this site's example-level epsilon (one training image) {one:.4g}" in (
        caplog.text
    )


def test_a_site_refuses_runs_past_their_rounds_their_evaluations_and_a_changed_config(
    tmp_path: Path,
) -> None:
    from privacy.ledger.site_ledger import SiteLedger

    # Prepare: a plain run of 4 rounds, max_retries 0
    config = config_from_dict(
        {"partition": {"num_clients": 3}, "server": {"min_clients": 2, "max_retries": 0},
         "train": {"rounds": 4}}
    )  # fmt: skip
    site = SiteLedger(tmp_path)
    site.check_run(config, "run")
    # Execute / Assert: training rounds 1..4 only; evaluations at 0 and 5, once each
    assert "not a training round of this run (1..4)" in site.refusal(
        config, "run", 5, b"a" * 16, last_round=0
    )
    assert "not a training round" in site.refusal(config, "run", 0, b"a" * 16, last_round=0)
    assert site.refusal(config, "run", 4, b"a" * 16, last_round=0) == ""
    assert "not an evaluation round of this run (0 or 5)" in site.evaluation_refusal(
        config, "run", 3, b"e" * 16
    )
    assert site.evaluation_refusal(config, "run", 5, b"e" * 16) == ""
    site.record_evaluation("run", 5, b"e" * 16)
    restarted = SiteLedger(tmp_path)
    assert "replayed task" in restarted.evaluation_refusal(config, "run", 5, b"e" * 16)
    assert "already answered 1 evaluation" in restarted.evaluation_refusal(
        config, "run", 5, b"f" * 16
    )
    # the same run id with another config (more retries) is refused after the restart
    looser = config_from_dict(
        {"partition": {"num_clients": 3}, "server": {"min_clients": 2, "max_retries": 50},
         "train": {"rounds": 4}}
    )  # fmt: skip
    with pytest.raises(PrivacyError, match="joined run 'run' before under another run config"):
        restarted.check_run(looser, "run")
    restarted.check_run(config, "run")  # the same config is welcome back
    # a resumed run that recalibrated its noise (its population changed) is welcome too:
    # each release records the noise it carried
    recalibrated = dataclasses.replace(
        config, privacy=dataclasses.replace(config.privacy, noise_multiplier=1.7)
    )
    restarted.check_run(recalibrated, "run")
    # a budget that one release of the run would already pass: not joined
    noisy = config_from_dict({"privacy": {"unit": "client", "noise_multiplier": 0.3}})
    with pytest.raises(PrivacyError, match="one more update of this run would bring"):
        SiteLedger(tmp_path / "b", max_epsilon=1.0).check_run(noisy, "run-2")


def test_two_clients_cannot_share_a_state_folder(tmp_path: Path) -> None:
    from privacy.ledger.site_ledger import SiteLedger

    first = SiteLedger(tmp_path, exclusive=True)
    with pytest.raises(PrivacyError, match="in use by another client process"):
        SiteLedger(tmp_path, exclusive=True)
    del first  # its lock goes with it
    import gc

    gc.collect()
    SiteLedger(tmp_path, exclusive=True)


def test_a_secure_round_id_seen_before_is_refused_also_after_a_restart(tmp_path: Path) -> None:
    from privacy.ledger.site_ledger import SiteLedger
    from privacy.secagg.round_setup import make_setup

    # Prepare: a CKKS run; this site took part in round id r...r before its restart
    config = config_from_dict(
        {"partition": {"num_clients": 3}, "server": {"min_clients": 2},
         "secure_aggregation": {"scheme": "ckks"}}
    )  # fmt: skip
    assert SiteLedger(tmp_path / "state").first_use(b"r" * 16)
    client = FlClient(
        Connection("localhost:1", "client-0", cert_dir=tmp_path),
        lambda r: None,  # type: ignore[arg-type,return-value]
        site=SiteLedger(tmp_path / "state"),
    )
    client._hold_run_config(config_to_toml(config))
    # Execute
    calls = _ckks_round(client)
    # Assert: withdrawn before any stage; and the server draws a new id for every attempt,
    # also for a round number and attempt a resumed run repeats
    from fl_secure.v1 import transport_pb2 as pb

    assert calls == [(pb.SECAGG_STAGE_WITHDRAW, pb.WITHDRAW_REASON_MESSAGE_REFUSED)]
    args = {"run_id": "run", "round_": 3, "attempt": 0, "cohort": ["a", "b", "c"],
            "vector_length": 10}  # fmt: skip
    first, again = (make_setup(SECURE.secure_aggregation, **args) for _ in range(2))  # type: ignore[arg-type]
    assert first.round_id != again.round_id and len(first.round_id) == 16
    assert dataclasses.replace(first, round_id=again.round_id) == again
