"""Fuzz harness of the gRPC servicer: hostile messages for every RPC, and how each was answered.

A :class:`FuzzServer` is a real coordinator (secure aggregation configured) with its real gRPC
server over mutual TLS on port 0, but no driver thread: before each fuzzed message the
harness posts a fresh attempt on the coordinator's board itself (a plain training round, a
SecAgg round, an evaluation, or none), so every message can carry the round and nonce of a
task it holds and reach the checks behind them. The message is sent either straight to the
servicer's methods with a fake context (fast) or over the real transport. A call still running
after ``round_wait`` seconds has its attempt closed, as the driver closes one at its deadline;
one still running ``hang_timeout`` seconds later is a hang.

:func:`messages` draws, for a posted attempt (a :class:`Scene`), one call of any RPC:
structurally valid messages with hostile field values (huge or negative numbers, wrong tensor
shapes and dtypes, NaN, control characters in names, wrong rounds and nonces, signed and
unsigned secure-aggregation payloads) and raw random bytes decoded as the RPC's request.

Used by ``tests/server/test_servicer_fuzz.py`` and ``benchmarks/fuzz_servicer.py``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fl_secure.aggregation import StreamingMean
from fl_secure.config import (
    Config,
    PartitionConfig,
    SecureAggregationConfig,
    ServerConfig,
    config_to_toml,
)
from fl_secure.messages import TaskKind, Tensors
from fl_secure.runs import RunDir
from fl_secure.tls import channel_credentials, init_certificates
from fl_secure.tls.identity import load_signing_key, load_signing_registry
from fl_secure.v1 import transport_pb2_grpc as pb_grpc
from server.app import load_enrollment, start_server
from server.attempt import Attempt
from server.coordinator import Coordinator
from server.servicer import FlSecureServicer
from server.settings import CoordinatorSettings

from .fuzz_messages import CLIENTS, FuzzCall, Scene  # type: ignore[import-not-found]

KINDS = ("plain", "secure", "evaluate", "none")
#: Status codes that mean the server failed, not the message: a crash.
CRASH_CODES = frozenset({"UNKNOWN", "INTERNAL"})
#: The one honest round after the fuzz is round 1; fuzzed attempts are numbered apart.
FUZZ_ROUND = 7


def initial_params() -> Tensors:
    """The global model of the fuzzed server: two small float32 tensors."""
    rng = np.random.default_rng(1)
    return OrderedDict(
        [("w", rng.standard_normal((4, 3)).astype(np.float32)), ("b", np.zeros(4, np.float32))]
    )


# -------------------------------------------------------------------------- the target
class Aborted(Exception):  # noqa: N818 - what grpc's context.abort raises, in the fake
    """A fake context's abort: the status the call ends with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """What the servicer uses of a ``grpc.ServicerContext``; the caller is ``client``."""

    def __init__(self, client: str) -> None:
        self.client = client
        self.cancelled = False
        self.callbacks: list[Callable[[], None]] = []

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def cancel(self) -> None:
        self.cancelled = True
        for cb in self.callbacks:
            cb()

    def is_active(self) -> bool:
        return not self.cancelled

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True


@dataclass
class Outcome:
    """How one call ended: a status name ("OK" if it returned), or a crash or a hang."""

    status: str
    seconds: float
    details: str = ""
    crash: bool = False
    hang: bool = False


@dataclass
class Tally:
    """Counts over many calls (the benchmark's figures)."""

    statuses: Counter[str] = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    calls: int = 0
    slowest: float = 0.0

    def add(self, call: FuzzCall, outcome: Outcome) -> None:
        self.calls += 1
        self.statuses[f"{call.rpc}:{outcome.status}"] += 1
        self.slowest = max(self.slowest, outcome.seconds)
        if outcome.crash:
            self.crashes.append(f"{call!r} -> {outcome.status}: {outcome.details}")
        if outcome.hang:
            self.hangs.append(repr(call))


class ServerErrors(logging.Handler):
    """Counts the errors gRPC logs for handlers that raised (an UNKNOWN to the caller)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


class FuzzServer:
    """A coordinator with its gRPC server, attempts posted by hand, and fuzzed calls run."""

    def __init__(self, root: Path, *, round_wait: float = 0.3, hang_timeout: float = 10.0) -> None:
        self.certs = root / "certs"
        init_certificates(self.certs, clients=list(CLIENTS))
        self.secure = SecureAggregationConfig(scheme="secagg", clip_range=4.0, stage_timeout=60.0)
        config = Config(
            partition=PartitionConfig(num_clients=len(CLIENTS)),
            server=ServerConfig(min_clients=3),
            secure_aggregation=self.secure,
        )
        settings = CoordinatorSettings(
            rounds=1, min_clients=3, round_timeout=120.0, max_retries=0, poll_wait=0.002,
            final_evaluation=False, run_id="fuzz", secure_aggregation=self.secure,
            run_config_toml=config_to_toml(config), upload_idle_timeout=5.0,
        )  # fmt: skip
        self.initial = initial_params()
        self.coordinator = Coordinator(
            settings,
            self.initial,
            enrolled=set(load_enrollment(self.certs).fingerprints),
            run_dir=RunDir(root / "run"),
            server_step=lambda p, u, r: OrderedDict((k, p[k] + u[k]) for k in p),
            signing_registry=load_signing_registry(self.certs / "server"),
        )
        self.keys = {c: load_signing_key(self.certs / "sites" / c, c) for c in CLIENTS}
        self.servicer = FlSecureServicer(self.coordinator, lambda ctx: ctx.client)  # type: ignore[attr-defined]
        self.server, self.port = start_server(self.coordinator, "127.0.0.1:0", cert_dir=self.certs)
        self.errors = ServerErrors()
        logging.getLogger("grpc._server").addHandler(self.errors)
        self.round_wait, self.hang_timeout = round_wait, hang_timeout
        self._channels: dict[str, grpc.Channel] = {}
        self._attempts = 0
        self.last: Attempt | None = None
        self._before = self._trace()

    def close(self) -> None:
        """Stop the server, drop the channels."""
        self.end_attempt()
        logging.getLogger("grpc._server").removeHandler(self.errors)
        for channel in self._channels.values():
            channel.close()
        self.coordinator.stop("fuzz over")
        self.server.stop(grace=None)

    # ------------------------------------------------------------------ attempts
    def post_attempt(self, kind: str) -> Scene:
        """Post a fresh attempt of ``kind`` (every client in its cohort) on the board."""
        coord, board = self.coordinator, self.coordinator.board
        self.end_attempt()
        self._attempts += 1
        if kind == "none":
            return Scene(kind, FUZZ_ROUND, {}, list(coord.specs), b"", self.keys)
        secure = (
            coord.relay.start(FUZZ_ROUND, self._attempts, list(CLIENTS))
            if kind == "secure"
            else None
        )
        task = TaskKind.EVALUATE if kind == "evaluate" else TaskKind.TRAIN
        tag = f"fuzz/{self._attempts}/".encode()
        rnd = Attempt(
            number=FUZZ_ROUND, kind=task, attempt=self._attempts,
            cohort={c: hashlib.sha256(tag + c.encode()).digest()[:16] for c in CLIENTS},
            deadline=board.clock() + 30.0,
            aggregator=StreamingMean(coord.specs) if kind == "plain" else None,
            secure=secure,
        )  # fmt: skip
        with board.cv:
            board.current = rnd
            board.cv.notify_all()
        self.last = rnd
        specs = list(coord.specs) if kind == "plain" else []
        if secure is not None:
            specs = list(secure.upload_specs)
        round_id = secure.setup.round_id if secure is not None else b""
        return Scene(kind, FUZZ_ROUND, dict(rnd.cohort), specs, round_id, self.keys)

    def end_attempt(self) -> None:
        """Close the posted attempt as the driver does at its deadline."""
        board = self.coordinator.board
        with board.cv:
            rnd = board.current
            if rnd is None:
                return
            board.current = None
            rnd.wake_attendants()
            for cancel, _ in rnd.streaming.values():
                cancel()
            board.cv.notify_all()

    # --------------------------------------------------------------------- calls
    def run(self, call: FuzzCall, scene: Scene, *, transport: bool = False) -> Outcome:
        """Send ``call`` against ``scene`` (in-process, or over gRPC + mTLS); how it ended."""
        result: dict[str, Any] = {}
        request = call.request(scene)
        self._before = self._trace()
        send = self._grpc if transport else self._direct
        worker = threading.Thread(target=send, args=(call, request, result), daemon=True)
        start = time.monotonic()
        worker.start()
        worker.join(self.round_wait)
        if worker.is_alive():  # the attempt's deadline: the driver closes it
            self.end_attempt()
            worker.join(self.hang_timeout)
        seconds = time.monotonic() - start
        if worker.is_alive():
            cancel = result.get("cancel")
            if cancel is not None:
                cancel()
            return Outcome("HANG", seconds, hang=True)
        status, details = result.get("status", "OK"), result.get("details", "")
        return Outcome(status, seconds, details, crash=status in CRASH_CODES or "error" in result)

    def _direct(self, call: FuzzCall, request: Any, result: dict[str, Any]) -> None:
        if call.raw is not None:  # grpc's deserializer refuses it before any servicer code
            result["status"] = "UNDECODABLE"
            return
        ctx = FakeContext(call.client)
        result["cancel"] = ctx.cancel
        s: Any = self.servicer
        try:
            if call.rpc == "GetParameters":
                for _ in s.GetParameters(request, ctx):
                    pass
            elif call.rpc == "SubmitUpdate":
                s.SubmitUpdate(iter(request), ctx)
            else:
                getattr(s, call.rpc)(request, ctx)
        except Aborted as exc:
            result["status"], result["details"] = exc.code.name, exc.details
        except Exception as exc:  # noqa: BLE001 - the fuzz's finding: gRPC would answer UNKNOWN
            result["status"], result["details"] = "UNKNOWN", f"{type(exc).__name__}: {exc}"
            result["error"] = exc

    def _channel(self, client: str) -> grpc.Channel:
        if client not in self._channels:
            creds = channel_credentials(self.certs, client)
            self._channels[client] = grpc.secure_channel(f"localhost:{self.port}", creds)
        return self._channels[client]

    def _grpc(self, call: FuzzCall, request: Any, result: dict[str, Any]) -> None:
        channel = self._channel(call.client)
        timeout = self.round_wait + self.hang_timeout + 5.0
        path = f"/fl_secure.v1.FlSecure/{call.rpc}"
        try:
            if call.raw is not None:  # bytes as they are: no client-side serializer
                identity: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
                if call.rpc == "SubmitUpdate":
                    stream = channel.stream_unary(path, identity, identity)
                    fut = stream.future(iter([call.raw]), timeout=timeout)
                elif call.rpc == "GetParameters":
                    it = channel.unary_stream(path, identity, identity)(call.raw, timeout=timeout)
                    result["cancel"] = it.cancel
                    for _ in it:
                        pass
                    return
                else:
                    fut = channel.unary_unary(path, identity, identity).future(
                        call.raw, timeout=timeout
                    )
                result["cancel"] = fut.cancel
                fut.result()
                return
            stub = pb_grpc.FlSecureStub(channel)
            if call.rpc == "GetParameters":
                stream_it = stub.GetParameters(request, timeout=timeout)
                result["cancel"] = stream_it.cancel
                for _ in stream_it:
                    pass
                return
            method = getattr(stub, call.rpc)
            sent = iter(request) if call.rpc == "SubmitUpdate" else request
            fut = method.future(sent, timeout=timeout)
            result["cancel"] = fut.cancel
            fut.result()
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            result["status"], result["details"] = code.name, exc.details()  # type: ignore[attr-defined]
            if (
                call.raw is not None
                and code.name == "INTERNAL"
                and "deserializ" in str(result["details"])
            ):
                result["status"] = "UNDECODABLE"  # gRPC's own answer to bytes that are no message
        except Exception as exc:  # noqa: BLE001
            result["status"], result["details"] = "CLIENT_ERROR", f"{type(exc).__name__}: {exc}"
            result["error"] = exc

    # ----------------------------------------------------------------- invariants
    def _trace(self) -> tuple[frozenset[str], int, int]:
        """What the posted attempt received: who, how many folded in, how many masked inputs."""
        rnd = self.last
        if rnd is None:
            return frozenset(), 0, 0
        folded = getattr(rnd.aggregator, "count", 0)
        masked = len(getattr(getattr(rnd.secure, "server", None), "_u3", ()))
        return frozenset(rnd.received), folded, masked

    def refused_upload_left_no_trace(self, call: FuzzCall, outcome: Outcome) -> bool:
        """A refused call added nothing to what the posted attempt received or aggregated."""
        return outcome.status == "OK" or self._trace() == self._before


# ------------------------------------------------------------------ the honest round after
class ShiftTrainer:
    """An honest client's trainer: ``shift`` everywhere as its update."""

    def __init__(self, shift: float) -> None:
        self.shift, self.num_examples = shift, 5

    def train(self, shared: Tensors, training: Any) -> tuple[Tensors, int, dict[str, float]]:
        update = OrderedDict((k, np.full_like(v, self.shift)) for k, v in shared.items())
        return update, self.num_examples, {"train_loss": 1.0, "local_steps": 3.0}

    def evaluate(self, shared: Tensors) -> tuple[int, dict[str, float]]:
        return self.num_examples, {}


def honest_round(fuzz: FuzzServer, shifts: dict[str, float], timeout: float = 120.0) -> str:
    """Run the server's one (secure) round with honest clients after the fuzz; its status."""
    from client.app import FlClient
    from client.transport import Connection

    fuzz.end_attempt()
    coord = fuzz.coordinator
    driver = threading.Thread(target=coord.run, daemon=True)
    driver.start()
    threads = []
    for client_id, shift in shifts.items():
        trainer = ShiftTrainer(shift)
        client = FlClient(
            Connection(f"localhost:{fuzz.port}", client_id, cert_dir=fuzz.certs),
            lambda reply, t=trainer: t,  # type: ignore[misc]
            max_wait=20.0,
        )
        threads.append(threading.Thread(target=client.run, daemon=True))
        threads[-1].start()
    driver.join(timeout=timeout)
    for th in threads:
        th.join(timeout=10)
    return coord.status
