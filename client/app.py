"""The client loop: connect with the client's certificate, join, poll, train, upload.

The client opens every connection (it may sit behind NAT). When the server is unreachable or
restarts, it reconnects with exponential backoff and jitter and joins again.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from client.trainer import LocalTrainer
from fl_secure import __version__, serde
from fl_secure.config import Config
from fl_secure.errors import (
    ConfigError,
    FlSecureError,
    PrivacyError,
    ProtocolError,
    RoundAborted,
    TlsError,
    UpdateError,
)
from fl_secure.memory import retain_freed_memory
from fl_secure.messages import JoinReply, Task, TaskKind, Tensors, UpdateHeader
from fl_secure.tls import channel_credentials, warn_insecure
from fl_secure.tls.identity import load_signing_identity
from fl_secure.v1 import transport_pb2 as pb
from fl_secure.v1 import transport_pb2_grpc as pb_grpc
from privacy.ledger.site_ledger import SiteLedger

log = logging.getLogger(__name__)

INSECURE_ID_HEADER = "x-fl-secure-client-id"
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
#: Training metrics a secure round's upload may carry (besides ``dp_*``): not data-dependent.
_SECURE_METRICS = frozenset({"local_steps"})


@dataclass(frozen=True)
class Connection:
    """Where and how to reach the server."""

    address: str
    client_id: str
    cert_dir: Path | None = None
    insecure: bool = False
    server_name: str = ""  # TLS name to check when the address is an IP without SAN


def open_channel(conn: Connection) -> grpc.Channel:
    """A channel with the client's certificate (or, loudly, a plaintext one)."""
    options: list[tuple[str, object]] = [
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.enable_retries", 0),
        # replies of the authenticated server can be large: a CKKS round's encrypted sum is
        # ~80 bytes per parameter (tensors themselves are streamed in chunks)
        ("grpc.max_receive_message_length", 1 << 30),
    ]
    if conn.server_name:
        options.append(("grpc.ssl_target_name_override", conn.server_name))
    if conn.insecure:
        warn_insecure(f"client {conn.client_id}")
        return grpc.insecure_channel(conn.address, options=options)
    if conn.cert_dir is None:
        raise TlsError("the client needs --certs DIR (or --insecure for a loopback test)")
    creds = channel_credentials(conn.cert_dir, conn.client_id)
    return grpc.secure_channel(conn.address, creds, options=options)


class Backoff:
    """Exponential backoff with full jitter."""

    def __init__(self, initial: float = 0.5, maximum: float = 10.0) -> None:
        self.initial, self.maximum, self.attempt = initial, maximum, 0

    def next_delay(self) -> float:
        """Delay before the next attempt."""
        delay = min(self.maximum, self.initial * 2**self.attempt)
        self.attempt += 1
        return random.uniform(0, delay)  # noqa: S311 - timing jitter, not security

    def reset(self) -> None:
        """After a success."""
        self.attempt = 0


class FlClient:
    """Runs tasks from the server until it says the run is finished."""

    def __init__(
        self,
        conn: Connection,
        trainer_factory: Callable[[JoinReply], LocalTrainer],
        *,
        max_wait: float = 600.0,
        sleep: Callable[[float], None] = time.sleep,
        site: SiteLedger | None = None,
    ) -> None:
        self.conn = conn
        self.trainer_factory = trainer_factory
        self.max_wait = max_wait  # give up after this long without reaching the server
        self.sleep = sleep
        self.trainer: LocalTrainer | None = None
        self._signing: tuple[Ed25519PrivateKey, dict[str, Ed25519PublicKey]] | None = None
        self._ckks_secret: bytes | None = None  # the clients' shared CKKS key (scheme ckks)
        self._attend: Any = None  # the open attendance call of the current secure round
        self.last_round = 0
        self.rounds_done = 0
        #: Every training update that left this site (persisted in its state folder when it
        #: has one): tasks are never answered twice, and the site's own epsilon is kept.
        self.site = site if site is not None else SiteLedger(None)
        #: The run config and run id of the first join: every later round is held to them.
        self._run_config: Config | None = None
        self._run_config_toml: str | None = None
        self._run_id = ""
        self._unreachable_since: float | None = None  # start of the current outage
        self._metadata = ((INSECURE_ID_HEADER, conn.client_id),) if conn.insecure else ()

    def run(self) -> str:
        """Loop until FINISHED; return the server's closing message."""
        retain_freed_memory()  # reuse each round's buffers (fl_secure/memory.py)
        backoff = Backoff()
        while True:
            channel = open_channel(self.conn)
            try:
                stub = pb_grpc.FlSecureStub(channel)
                message = self._session(stub, backoff)
                return message
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code not in _RETRYABLE:
                    raise
                now = time.monotonic()
                first = self._unreachable_since is None
                if self._unreachable_since is None:
                    self._unreachable_since = now
                if now - self._unreachable_since > self.max_wait:
                    raise
                delay = backoff.next_delay()
                log.log(
                    logging.WARNING if first else logging.INFO,
                    "cannot reach the server at %s (%s: %s); retrying for up to %.0f s",
                    self.conn.address,
                    getattr(code, "name", code),
                    _details(exc),
                    self.max_wait,
                )
                self.sleep(delay)
            finally:
                channel.close()

    def _session(self, stub: pb_grpc.FlSecureStub, backoff: Backoff) -> str:
        examples = self.trainer.num_examples if self.trainer else 0
        reply = serde.join_reply_from_proto(
            stub.Join(
                pb.JoinRequest(software_version=__version__, num_examples=examples),
                metadata=self._metadata,
                timeout=30,
            )
        )
        if reply.client_id != self.conn.client_id:
            raise TlsError(
                f"server knows this client as {reply.client_id!r}, not {self.conn.client_id!r}"
            )
        self._hold_run_config(reply.run_config_toml, reply.run_id)
        self._unreachable_since = None  # reached: a later outage gets max_wait of its own
        self._load_signing_keys()
        if self.trainer is None:
            self.trainer = self.trainer_factory(reply)
            stub.Join(
                pb.JoinRequest(
                    software_version=__version__, num_examples=self.trainer.num_examples
                ),
                metadata=self._metadata,
                timeout=30,
            )
        backoff.reset()
        log.info("joined run %s as %s", reply.run_id, reply.client_id)
        while True:
            task = serde.task_from_proto(
                stub.PollTask(
                    pb.PollRequest(last_round=self.last_round), metadata=self._metadata, timeout=60
                )
            )
            if task.kind is TaskKind.FINISHED:
                log.info("run finished: %s", task.message)
                return task.message
            if task.kind is TaskKind.WAIT:
                continue  # the server long-polls; ask again at once
            if task.kind in (TaskKind.TRAIN, TaskKind.EVALUATE):
                refusal = (
                    self._refuse_training(task)
                    if task.kind is TaskKind.TRAIN
                    else self.site.evaluation_refusal(
                        self._run_config, self._run_id, task.round, task.nonce
                    )
                )
                if refusal:
                    what = "training" if task.kind is TaskKind.TRAIN else "evaluation"
                    log.error("round %d: %s task refused: %s", task.round, what, refusal)
                    # said at once, so that the round (or its cohort) does not wait for it
                    self._withdraw(stub, task, pb.WITHDRAW_REASON_DECLINED)
                    self.sleep(1.0)  # a server that insists is not answered in a tight loop
                    continue
            self._do_task(stub, task)

    def _refuse_training(self, task: Task) -> str:
        """Why this client will not train on ``task`` ("" if it will).

        Each update this client releases spends privacy; the server's ledger counts one
        release per round. So a task already answered, an older round, or more attempts of a
        round than the run's ``server.max_retries`` allows are refused, and so is an update
        past the site's own epsilon budget (:class:`privacy.ledger.site_ledger.SiteLedger`, which
        keeps the releases across restarts). (The local settings' ranges are checked when the
        task is read: :func:`fl_secure.serde.check_training`.)
        """
        privacy = getattr(self.trainer, "privacy", None)  # ClientPrivacy | None
        return self.site.refusal(
            self._run_config,
            self._run_id,
            task.round,
            task.nonce,
            last_round=self.last_round,
            # example level: the steps the task would train, held against the site's budget
            dpsgd=privacy.planned_dpsgd(task.training) if privacy is not None else None,
        )

    def _hold_run_config(self, run_config_toml: str, run_id: str = "") -> None:
        """Keep the run config and id of the first join; refuse others on a later join.

        Each round's secure-aggregation setup is then checked against it
        (:func:`privacy.secagg.round_setup.check_setup`), so a later message cannot weaken the
        protection this client joined under (drop the masking or the noise, lower the
        threshold).

        The run id keys this site's releases (:meth:`_refuse_training`): a server that
        changed it between joins would start the per-round limits afresh.

        Raises:
            ConfigError: the config is not valid.
            ProtocolError: the server sends another config or run id than at the first join.
            PrivacyError: the run cannot keep the site's own epsilon budget.
        """
        import tomllib

        from fl_secure.config import config_from_dict

        if self._run_config_toml is not None:
            if run_config_toml != self._run_config_toml or run_id != self._run_id:
                raise ProtocolError(
                    f"the server's run {'config' if run_id == self._run_id else 'id'} differs "
                    "from the one this client joined under; restart the client to join the "
                    "new run"
                )
            return
        try:
            config = config_from_dict(tomllib.loads(run_config_toml))
        except (tomllib.TOMLDecodeError, FlSecureError) as exc:
            raise ConfigError(f"the server sent an invalid run config: {exc}") from exc
        self.site.check_run(config, run_id)
        self._run_config, self._run_config_toml, self._run_id = config, run_config_toml, run_id

    def _load_signing_keys(self) -> None:
        """Load this site's signing key at join when the run masks updates (SecAgg/SecAgg+).

        A missing or damaged key, or one that is not the key the CA-signed registry enrolls for
        this site (a stale copy after a re-issue, which the peers would reject), then stops
        the client before it takes part in any round, instead of in the middle of the first
        secure round, where the cohort waits for it.
        The scheme is the joined run config's (:meth:`_hold_run_config` has read it).
        """
        if self._signing is not None or self._run_config is None:
            return
        if self._run_config.secure_aggregation.scheme not in ("secagg", "secagg+"):
            return
        if self.conn.cert_dir is None:
            raise TlsError("secure aggregation needs the certificate folder (signing keys)")
        self._signing = load_signing_identity(self.conn.cert_dir, self.conn.client_id)

    def _do_task(self, stub: pb_grpc.FlSecureStub, task: Task) -> None:
        trainer = self.trainer
        if trainer is None:  # pragma: no cover - set in _session
            raise RuntimeError("no trainer")

        def fetch() -> Tensors:
            chunks = stub.GetParameters(
                pb.ParametersRequest(round=task.round, nonce=task.nonce),
                metadata=self._metadata,
                timeout=600,
            )
            limit = max(task.parameters_bytes, 1) + 1024
            return serde.parameters_from_chunks(chunks, max_bytes=limit)[1]

        if task.kind is TaskKind.TRAIN and task.secagg_setup:
            # The key stages (which wait for the whole cohort) come before training; the
            # download runs alongside them, so no stage waits for a client's download.
            self._secure_round(stub, task, fetch, time.monotonic())
            return
        scheme = self._run_config.secure_aggregation.scheme if self._run_config else "none"
        if task.kind is TaskKind.TRAIN and scheme != "none":
            log.error(
                "round %d: refused: a training task without a secure-aggregation setup, in a "
                "run that joined with secure_aggregation.scheme = %r (the update would leave "
                "this site unmasked)",
                task.round,
                scheme,
            )
            return
        try:
            shared = fetch()
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # the round (attempt) closed before the download began: wait for the next task
            log.warning("round %d: parameters refused: %s", task.round, exc.details())
            return
        started = time.monotonic()
        if task.kind is TaskKind.TRAIN:
            update, examples, metrics = trainer.train(shared, task.training)
        else:
            update = type(shared)()
            examples, metrics = trainer.evaluate(shared)
        metrics = {**metrics, "local_seconds": time.monotonic() - started}
        header = UpdateHeader(
            round=task.round, nonce=task.nonce, num_examples=examples, metrics=metrics
        )
        if task.kind is TaskKind.TRAIN:
            self._count_release(task, metrics)  # before it may leave: a failed upload too
        else:  # evaluation figures are not covered by DP: a run has two, each counted
            self.site.record_evaluation(self._run_id, task.round, task.nonce)
        try:
            reply = stub.SubmitUpdate(
                serde.update_to_chunks(header, update), metadata=self._metadata, timeout=600
            )
            log.info("round %d: %s", task.round, reply.message)
        except grpc.RpcError as exc:
            if exc.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
            ):
                log.warning("round %d: update refused: %s", task.round, exc.details())
                return
            raise
        self.last_round = task.round
        self.rounds_done += 1

    def _count_release(self, task: Task, metrics: dict[str, float] | None = None) -> None:
        """Count this training task's update in the site ledger, before it may leave.

        Saved before the upload starts, so a crash or a failed upload never leaves a release
        uncounted. ``metrics``: the update's, whose ``dp_*`` figures (example level) give the
        DP-SGD steps it was trained with.
        """
        if self._run_config is None:  # pragma: no cover - _session holds it before any task
            raise RuntimeError("a release before the run config was held")
        from privacy.client_round import ClientPrivacy

        dpsgd = ClientPrivacy.released_dpsgd(metrics or {})
        row = self.site.record(self._run_config, self._run_id, task.round, task.nonce, dpsgd)
        if row is None or row.unit not in ("client", "example"):
            return
        if row.unit == "client":
            honest = self.site.epsilon(colluding_peers=False)
            colluding = self.site.epsilon(colluding_peers=True)
            figure = f"epsilon against the server {honest:.4g} ({colluding:.4g} if the other "
            figure += "sites collude)"
        else:
            figure = f"example-level epsilon (one training image) {self.site.example_epsilon():.4g}"
        log.info(
            "round %d: site ledger: %d releases; this site's %s, delta %g",
            task.round,
            len(self.site.releases),
            figure,
            self.site.delta,
        )

    def _secure_round(
        self,
        stub: pb_grpc.FlSecureStub,
        task: Task,
        fetch: Callable[[], Tensors],
        started: float,
    ) -> None:
        """A TRAIN round under secure aggregation: the server only learns the cohort's sum."""
        from privacy.ckks.client_round import client_ckks_update
        from privacy.ckks.keys import load_secret_context
        from privacy.ckks.round_setup import CKKS_TENSOR, CkksSetup, check_ckks_setup, is_ckks_setup
        from privacy.secagg.client_round import client_secure_update
        from privacy.secagg.round_setup import RoundSetup, check_setup
        from privacy.secagg.stages import MASKED, MASKED_TENSOR, wire_dtype

        trainer = self.trainer
        run_config = self._run_config
        assert trainer is not None and run_config is not None
        if self.conn.cert_dir is None:
            raise TlsError("secure aggregation needs the certificate folder (signing keys)")
        ckks = is_ckks_setup(task.secagg_setup)
        scheme = run_config.secure_aggregation.scheme
        if scheme != "ckks" if ckks else scheme not in ("secagg", "secagg+"):
            # e.g. a CKKS round in a masked run: distributed DP noise would be left out
            log.error(
                "round %d: refused: a %s setup in a run that joined with "
                "secure_aggregation.scheme = %r",
                task.round,
                "CKKS" if ckks else "masking (SecAgg)",
                scheme,
            )
            self._withdraw(stub, task, pb.WITHDRAW_REASON_MESSAGE_REFUSED)
            return
        try:  # a round id this site has seen is a replay: refused before any stage
            parsed = (CkksSetup if ckks else RoundSetup).from_bytes(task.secagg_setup)
            self._first_use(parsed.round_id)
        except FlSecureError as exc:
            log.error("round %d: refused: %s", task.round, exc)
            self._withdraw(stub, task, pb.WITHDRAW_REASON_MESSAGE_REFUSED)
            return
        if self._signing is None and not ckks:
            self._signing = load_signing_identity(self.conn.cert_dir, self.conn.client_id)
        metrics: dict[str, float] = {}
        timeout = max(60.0, (task.deadline_unix_ms / 1000.0) - time.time() + 60.0)

        def start(stage: int, payload: bytes) -> Any:  # a grpc.Future of the reply
            return stub.SecAggExchange.future(
                pb.SecAggMessage(
                    round=task.round,
                    nonce=task.nonce,
                    stage=pb.SecAggStage.ValueType(stage + 1),
                    payload=payload,
                ),
                metadata=self._metadata,
                timeout=timeout,
            )

        # Held open for the whole round, so that the server notices at once if this process
        # dies (the call closes); the server answers it when the round ends. Kept on self:
        # gRPC cancels a call whose future is garbage collected. No deadline: the unmasking
        # may run a stage timeout past the round's deadline, and an expired call would tell
        # the server this client had gone. Nothing waits for its reply.
        self._attend = attend = stub.SecAggExchange.future(
            pb.SecAggMessage(round=task.round, nonce=task.nonce, stage=pb.SECAGG_STAGE_ATTEND),
            metadata=self._metadata,
        )
        finished = False

        # The "masked input" call only waits for the server's unmask request (sent once every
        # upload is in); it is started with the upload (see upload) so that the request
        # reaches this client without a round trip after the upload's reply.
        pending: dict[int, Any] = {}

        def exchange(stage: int, payload: bytes) -> bytes:
            call = pending.pop(stage, None)
            if call is None:
                call = start(stage, payload)
            elif payload:  # pragma: no cover - only the empty "masked input" call is started
                raise FlSecureError("a secure-aggregation call was started with another payload")
            return bytes(call.result().payload)

        # The global parameters download while the key stages run (they are public to the
        # cohort); training starts only after the key stages, as before.
        parameters = _background(fetch)

        training_failed = False
        ckks_setup: CkksSetup | None = None

        def compute() -> Tensors:  # after the key stages: the download, then training
            nonlocal training_failed
            params = parameters.result()
            if ckks_setup is not None:  # the layers it encrypts, against the shared ones
                check_ckks_setup(ckks_setup, run_config, list(params))
            try:
                update, _, found = trainer.train(params, task.training)
            except BaseException:
                training_failed = True
                raise
            # Only the schedule and the DP bookkeeping go beside a masked upload: a training
            # loss or accuracy in the clear would tell the server about this site's update.
            metrics.update(
                {k: v for k, v in found.items() if k in _SECURE_METRICS or k[:3] == "dp_"}
            )
            return update

        def upload(vector: np.ndarray) -> None:
            # The example count is not sent: the secure sum is an unweighted one.
            header = UpdateHeader(
                round=task.round,
                nonce=task.nonce,
                num_examples=1,
                metrics={**metrics, "local_seconds": time.monotonic() - started},
            )
            if ckks:
                tensors = OrderedDict([(CKKS_TENSOR, vector.astype(np.uint8))])
            else:
                tensors = OrderedDict(
                    [(MASKED_TENSOR, vector.astype(wire_dtype(setup), copy=False))]
                )
                # Nothing is revealed before the upload has succeeded and the request is in:
                # client_secure_update reads the reply only after upload() returned.
                pending[MASKED] = start(MASKED, b"")
            try:
                self._count_release(task, metrics)  # before the masked/encrypted update leaves
                stub.SubmitUpdate(
                    serde.update_to_chunks(header, tensors), metadata=self._metadata, timeout=600
                )
            except BaseException:
                call = pending.pop(MASKED, None)
                if call is not None:
                    call.cancel()
                raise

        try:
            if ckks:
                if self._ckks_secret is None:
                    self._ckks_secret = load_secret_context(self.conn.cert_dir)
                ckks_setup = CkksSetup.from_bytes(task.secagg_setup)
                client_ckks_update(ckks_setup, self._ckks_secret, exchange, compute, upload)
            else:
                assert self._signing is not None
                identity, registry = self._signing
                setup = RoundSetup.from_bytes(task.secagg_setup)
                check_setup(setup, run_config, self.conn.client_id, registry)
                client_secure_update(
                    setup, self.conn.client_id, identity, registry, exchange, compute, upload
                )
            finished = True
        except Exception as exc:
            # Say so at once, so that the cohort does not wait for this client to a deadline.
            self._withdraw(stub, task, withdraw_reason(exc, training_failed))
            if isinstance(exc, grpc.RpcError) and exc.code() in (
                grpc.StatusCode.ABORTED,
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.INVALID_ARGUMENT,
            ):
                log.warning("round %d: secure aggregation ended: %s", task.round, exc.details())
                return
            if isinstance(exc, FlSecureError):  # a peer's bad key or share: the round is lost
                log.warning("round %d: secure aggregation refused: %s", task.round, exc)
                return
            raise
        finally:
            for call in pending.values():  # a call left over by a failed round
                call.cancel()
            if not finished:  # leaving the round (as a killed process would)
                attend.cancel()
        log.info("round %d: masked update in the secure sum", task.round)
        self.last_round = task.round
        self.rounds_done += 1

    def _first_use(self, round_id: bytes) -> None:
        """Refuse a secure round whose id this site has seen (kept in its site ledger)."""
        if not self.site.first_use(round_id):
            raise ProtocolError(
                f"secure round id {round_id.hex()} was used before: a replayed round (its "
                "signed key advertisements could be an earlier round's)"
            )

    def _withdraw(
        self, stub: pb_grpc.FlSecureStub, task: Task, reason: pb.WithdrawReason.ValueType
    ) -> None:
        """Leave a secure round this client can no longer finish (best effort)."""
        try:
            stub.SecAggExchange(
                pb.SecAggMessage(
                    round=task.round,
                    nonce=task.nonce,
                    stage=pb.SECAGG_STAGE_WITHDRAW,
                    withdraw_reason=reason,
                ),
                metadata=self._metadata,
                timeout=10,
            )
        except grpc.RpcError as exc:  # the round is over, or the server is out of reach
            log.info("round %d: withdrawal not delivered: %s", task.round, exc.code())


def withdraw_reason(exc: BaseException, training_failed: bool) -> pb.WithdrawReason.ValueType:
    """The category of a secure round's local failure that a withdrawal tells the server.

    Only the category leaves the client (``WithdrawReason``), never the error's text, which
    may quote data-dependent values.
    """
    if isinstance(exc, UpdateError):  # before training: a diverged model's update is refused
        return pb.WITHDRAW_REASON_UPDATE_REFUSED
    if training_failed:
        return pb.WITHDRAW_REASON_LOCAL_TRAINING
    if isinstance(exc, grpc.RpcError):
        return pb.WITHDRAW_REASON_TRANSPORT
    if isinstance(exc, RoundAborted):  # a client raises it for too few neighbours only
        return pb.WITHDRAW_REASON_TOO_FEW_SHARES
    if isinstance(exc, (ProtocolError, PrivacyError)):
        return pb.WITHDRAW_REASON_MESSAGE_REFUSED
    return pb.WITHDRAW_REASON_OTHER


def _background(work: Callable[[], Tensors]) -> Future[Tensors]:
    """Run ``work`` in a daemon thread (it never holds up the process's exit)."""
    future: Future[Tensors] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():  # pragma: no cover - never cancelled
            return
        try:
            future.set_result(work())
        except BaseException as exc:  # handed to whoever waits for the result
            future.set_exception(exc)

    threading.Thread(target=run, name="fl-secure-prefetch", daemon=True).start()
    return future


__all__ = ["Backoff", "Connection", "FlClient", "ProtocolError", "open_channel"]


def _details(exc: grpc.RpcError) -> str:
    """The reason gRPC gives for a failed call (e.g. a refused connection, a TLS failure)."""
    details = exc.details() if hasattr(exc, "details") else None
    return str(details or exc).strip()


def explain_rpc_error(exc: grpc.RpcError, address: str) -> str:
    """One line for the user: what the server or the transport said, and what to check."""
    code = exc.code() if hasattr(exc, "code") else None
    name = getattr(code, "name", str(code))
    hint = {
        "UNAVAILABLE": "is the server running and reachable, and does --certs hold the ca.pem "
        "that signed the server's certificate?",
        "PERMISSION_DENIED": "the server does not enroll this client's certificate",
        "DEADLINE_EXCEEDED": "the server did not answer in time",
    }.get(name, "")
    return f"server {address}: {name}: {_details(exc)}" + (f" ({hint})" if hint else "")
