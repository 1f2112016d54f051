"""Round coordinator: enrollment, cohorts, deadlines, streaming aggregation, checkpoints.

Transport-free: the gRPC servicer (:mod:`server.servicer`) only moves messages in and out of
this object, so the whole round logic is testable without a network. One driver thread
(:meth:`Coordinator.run`) advances rounds; servicer threads call :meth:`join`, :meth:`poll`,
:meth:`parameters`, :meth:`open_upload` and :meth:`commit_upload`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fl_secure.aggregation import Aggregator, StreamingMean
from fl_secure.algorithms.base import BROADCAST_PREFIX
from fl_secure.checkpoints import CheckpointStore
from fl_secure.errors import CheckpointError, ProtocolError, RoundAborted
from fl_secure.evaluation import DegenerateEmbeddings
from fl_secure.messages import (
    JoinReply,
    LocalTraining,
    Task,
    TaskKind,
    Tensors,
    TensorSpec,
    UpdateHeader,
)
from fl_secure.runs import RunDir
from fl_secure.training import round_learning_rate

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from fl_secure.config import SecureAggregationConfig
    from privacy.ckks.server_round import ServerCkksRound
    from privacy.secagg.server_round import ServerSecureRound
    from privacy.server_round import ServerPrivacy

log = logging.getLogger(__name__)

#: Server-side model update: (global parameters, mean update, round) -> new global parameters.
ServerStep = Callable[[Tensors, Tensors, int], Tensors]
#: Evaluation of the global parameters on the server's held-out data -> metrics.
Evaluator = Callable[[Tensors], dict[str, float]]


class HeadStep(Protocol):
    """Server step on the cohort's uploaded heads (``Strategy.server_heads``, FedGC)."""

    def __call__(
        self, heads: Mapping[str, Tensors], *, learning_rate: float, round_: int
    ) -> dict[str, Tensors]:
        """Client id -> head tensors in, the corrected heads out."""
        ...


@dataclass(frozen=True)
class CoordinatorSettings:
    """What the coordinator needs from the run configuration."""

    rounds: int
    min_clients: int
    clients_per_round: int = 0
    sample_rate: float = 0.0
    round_timeout: float = 600.0
    max_retries: int = 2
    max_concurrent_uploads: int = 2
    max_upload_factor: float = 1.05
    upload_idle_timeout: float = 60.0  # an upload silent this long is cancelled
    algorithm: str = "fedpe"
    training: LocalTraining = field(default_factory=LocalTraining)
    algorithm_params: dict[str, float] = field(default_factory=dict)
    run_id: str = ""
    run_config_toml: str = ""
    # SHA-256 of the run's whole resolved config (config_to_toml); every checkpoint records
    # it and a resume refuses a config.toml edited since ("": not checked)
    config_sha256: str = ""
    poll_wait: float = 2.0  # seconds a long poll may wait before answering WAIT
    online_timeout: float = 30.0  # a client not heard of for this long is offline
    final_evaluation: bool = True
    lr_schedule: str = "constant"
    secure_aggregation: SecureAggregationConfig | None = None
    # server-sees-heads (FedGC): the head tensors every TRAIN upload ends with, rows -1 (each
    # client has its own number of classes), and the most rows a client's head may have
    head_specs: tuple[TensorSpec, ...] = ()
    max_head_rows: int = 0
    # secure_aggregation.scheme = "ckks": the server's CKKS context (no key: it cannot decrypt)
    ckks_public_context: bytes = b""


@dataclass
class _Round:
    number: int
    kind: TaskKind
    attempt: int
    cohort: dict[str, bytes]  # client id -> nonce
    deadline: float
    aggregator: Aggregator | None
    received: dict[str, UpdateHeader] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    uploading: set[str] = field(default_factory=set)
    # uploads holding a slot: client -> (cancel its call, when its last data arrived)
    streaming: dict[str, tuple[Callable[[], None], float]] = field(default_factory=dict)
    # open attendance calls of a secure round: client -> the event that wakes its handler
    attending: dict[str, threading.Event] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    secure: ServerSecureRound | ServerCkksRound | None = None
    heads: dict[str, Tensors] = field(default_factory=dict)  # uploaded heads (FedGC)

    @property
    def pending(self) -> set[str]:
        return set(self.cohort) - set(self.received) - set(self.failed)

    def fail(self, client_id: str, reason: str) -> bool:
        """Stop waiting for ``client_id``'s update, unless it is in or arriving; True if so."""
        if client_id not in self.pending or client_id in self.uploading:
            return False
        self.failed[client_id] = reason
        return True


@dataclass(frozen=True)
class UploadTicket:
    """Permission to stream one update; holds a slot of the upload semaphore."""

    client_id: str
    round: int
    header: UpdateHeader
    expected: list[TensorSpec]
    max_bytes: int


class Coordinator:
    """State machine of a federated run."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        initial: Tensors,
        *,
        enrolled: set[str],
        run_dir: RunDir,
        server_step: ServerStep,
        evaluator: Evaluator | None = None,
        clock: Callable[[], float] = time.monotonic,
        privacy: ServerPrivacy | None = None,
        signing_registry: Mapping[str, Ed25519PublicKey] | None = None,
        head_step: HeadStep | None = None,
        broadcast: Callable[[Tensors, int], Tensors] | None = None,
    ) -> None:
        self.settings = settings
        self.enrolled = set(enrolled)
        self.run_dir = run_dir
        self.store = CheckpointStore(run_dir.checkpoints)
        self.server_step = server_step
        self.evaluator = evaluator
        self.privacy = privacy
        self.signing_registry = dict(signing_registry or {})
        self.clock = clock
        self.params: Tensors = initial
        self.specs = [TensorSpec.of(k, v) for k, v in initial.items()]
        self.completed_round = 0
        self.status = "running"
        self.stop_reason = ""
        self._cv = threading.Condition()
        self._round: _Round | None = None
        self._finished = False
        self._stop = threading.Event()
        self._last_seen: dict[str, float] = {}
        self._examples: dict[str, int] = {}
        self._uploads = threading.BoundedSemaphore(settings.max_concurrent_uploads)
        self._rng = secrets.SystemRandom()  # cohort sampling is privacy-relevant (amplification)
        self.events: list[dict[str, Any]] = []
        self.final_client_metrics: dict[str, dict[str, float]] = {}
        self.head_step = head_step
        # server-sees-heads: each client's latest (corrected) head, sent back to it alone
        self.heads: dict[str, Tensors] = {}
        # per-round tensors sent to the whole cohort with the parameters (AdaFedFR's R)
        self.broadcast = broadcast
        self._broadcast_tensors: Tensors = OrderedDict()
        #: Clients that declined a round's task (their own policy): not drawn again for it.
        self._declined: dict[int, set[str]] = {}

    # ----------------------------------------------------------------- resume
    def resume(self) -> int:
        """Load the last checkpoint, drop metrics of unfinished rounds; return the round."""
        checkpoint = self.store.latest()
        if checkpoint is None:
            if self.privacy is not None:
                self.privacy.resume(0, [])
            self.run_dir.truncate_metrics_after(0)
            return 0
        recorded = checkpoint.state.get("config_sha256")
        if recorded and self.settings.config_sha256 and recorded != self.settings.config_sha256:
            raise CheckpointError(
                f"{self.run_dir.config} has changed since round {checkpoint.round} was "
                f"checkpointed (config SHA-256 {recorded[:12]}... then, "
                f"{self.settings.config_sha256[:12]}... now): rounds 1-{checkpoint.round} ran "
                "under the old config, and a run's privacy accounting and partition assume one "
                "config throughout; restore config.toml, or start a new run"
            )
        if [TensorSpec.of(k, v) for k, v in checkpoint.parameters.items()] != self.specs:
            raise ProtocolError("checkpoint parameters do not match the model of this run")
        if self.privacy is not None:  # before anything is released again
            self.privacy.resume(checkpoint.round, list(checkpoint.state.get("privacy_rows", [])))
        for client, head in checkpoint.client_tensors.items():
            self._check_head(client, head)
        self.params = checkpoint.parameters
        self.heads = dict(checkpoint.client_tensors)
        self.completed_round = checkpoint.round
        dropped = self.run_dir.truncate_metrics_after(checkpoint.round)
        log.info("resumed after round %d (%d metric lines dropped)", checkpoint.round, dropped)
        return checkpoint.round

    # ------------------------------------------------------- servicer entries
    def join(self, client_id: str, num_examples: int) -> JoinReply:
        """Register a client as online (identity already checked by mTLS + enrollment)."""
        with self._cv:
            self._last_seen[client_id] = self.clock()
            self._examples[client_id] = num_examples
            self._cv.notify_all()
        log.info("client %s joined (%d examples)", client_id, num_examples)
        return JoinReply(
            client_id=client_id,
            run_id=self.settings.run_id,
            software_version=_version(),
            run_config_toml=self.settings.run_config_toml,
        )

    def reported_examples(self) -> dict[str, int]:
        """Example count each client that joined reported at join (its weight's basis)."""
        with self._cv:
            return dict(sorted(self._examples.items()))

    def poll(self, client_id: str, last_round: int) -> Task:
        """Next task of ``client_id``; waits up to ``poll_wait`` seconds for one."""
        deadline = self.clock() + self.settings.poll_wait
        with self._cv:
            self._last_seen[client_id] = self.clock()
            self._cv.notify_all()
            while True:
                task = self._task_for(client_id)
                remaining = deadline - self.clock()
                if task.kind is not TaskKind.WAIT or remaining <= 0 or self._stop.is_set():
                    return task
                self._cv.wait(timeout=min(remaining, 0.5))
                self._last_seen[client_id] = self.clock()

    def _task_for(self, client_id: str) -> Task:
        if self._finished:
            return Task(kind=TaskKind.FINISHED, message=self.stop_reason or "run finished")
        rnd = self._round
        if rnd is None or client_id not in rnd.pending or client_id in rnd.uploading:
            return Task(kind=TaskKind.WAIT, retry_after_ms=500, message="no task for you now")
        s = self.settings
        remaining_ms = max(0, int((rnd.deadline - self.clock()) * 1000))
        lr = round_learning_rate(s.training.learning_rate, rnd.number, s.rounds, s.lr_schedule)
        return Task(
            kind=rnd.kind,
            round=rnd.number,
            nonce=rnd.cohort[client_id],
            algorithm=s.algorithm,
            training=dataclasses.replace(s.training, learning_rate=lr),
            algorithm_params=s.algorithm_params,
            deadline_unix_ms=int(time.time() * 1000) + remaining_ms,
            parameters_bytes=sum(sp.num_bytes for sp in self.specs)
            + sum(a.nbytes for a in self.heads.get(client_id, {}).values())
            + sum(a.nbytes for a in self._broadcast_tensors.values()),
            secagg_setup=rnd.secure.setup.to_bytes() if rnd.secure is not None else b"",
        )

    def parameters(self, client_id: str, round_: int, nonce: bytes) -> tuple[int, Tensors]:
        """Global parameters for a client of the current cohort (and its own head only)."""
        with self._cv:
            self._check_member(client_id, round_, nonce)
            head: Tensors = self.heads.get(client_id, OrderedDict())
            if not head and not self._broadcast_tensors:
                return self.completed_round, self.params
            return self.completed_round, OrderedDict(
                [*self.params.items(), *head.items(), *self._broadcast_tensors.items()]
            )

    def _check_member(self, client_id: str, round_: int, nonce: bytes) -> _Round:
        rnd = self._round
        if rnd is None or rnd.number != round_:
            raise ProtocolError(f"round {round_} is not open")
        expected = rnd.cohort.get(client_id)
        if expected is None or not secrets.compare_digest(expected, nonce):
            raise ProtocolError(f"client {client_id} holds no task of round {round_}")
        return rnd

    def _secure_member(
        self, client_id: str, round_: int, nonce: bytes
    ) -> tuple[_Round, ServerSecureRound | ServerCkksRound]:
        """The open round and its secure session, if ``client_id`` holds its task."""
        rnd = self._check_member(client_id, round_, nonce)
        if rnd.secure is None:
            raise ProtocolError(f"round {round_} is not securely aggregated")
        return rnd, rnd.secure

    def open_upload(
        self, client_id: str, header: UpdateHeader, cancel: Callable[[], None] | None = None
    ) -> UploadTicket:
        """Check an update header and take an upload slot (bounded server memory).

        ``cancel`` ends the upload's call: the round calls it when the upload stalls for
        ``upload_idle_timeout`` (see :meth:`upload_progress`) or the round ends first, so a
        stalled client cannot hold a slot the others need.
        """
        with self._cv:
            rnd = self._check_member(client_id, header.round, header.nonce)
            if client_id not in rnd.pending or client_id in rnd.uploading:
                raise ProtocolError(f"client {client_id} already submitted in round {rnd.number}")
            train = rnd.kind is TaskKind.TRAIN
            # an evaluation by a client without test images (every identity had a single
            # image) scores nothing: 0 is its honest count; a training update needs examples
            if header.num_examples < 0 or (train and header.num_examples == 0):
                raise ProtocolError(
                    f"num_examples must be {'positive' if train else '>= 0'}, got "
                    f"{header.num_examples}"
                )
            if train and self.privacy is not None:  # before aggregation, not in the ledger
                self.privacy.check_upload_metrics(client_id, header.metrics, self.settings.training)
            stated = self._examples.get(client_id, 0)
            if train and self.privacy is None and 0 < stated < header.num_examples:
                raise ProtocolError(  # without DP the count is the update's weight in the mean
                    f"num_examples = {header.num_examples} is more than the {stated} training "
                    f"images client {client_id} stated at join"
                )
            expected = self.specs if train else []
            if train and rnd.secure is not None:
                expected = rnd.secure.upload_specs
            model_bytes = sum(s.num_bytes for s in expected)
            if train and rnd.secure is not None:
                model_bytes = rnd.secure.max_upload_bytes
            if train and rnd.secure is None and self.settings.head_specs:  # FedGC: then W_k
                head_specs, head_bytes = self._head_expectation(client_id)
                expected = [*expected, *head_specs]
                model_bytes += head_bytes
            max_bytes = int(model_bytes * self.settings.max_upload_factor)
            if header.total_bytes > max_bytes:
                raise ProtocolError(
                    f"upload of {header.total_bytes} bytes exceeds the limit of {max_bytes}"
                )
            if header.num_tensors != len(expected):
                raise ProtocolError(
                    f"upload announces {header.num_tensors} tensors, expected {len(expected)}"
                )
            rnd.uploading.add(client_id)
        if not self._uploads.acquire(timeout=max(0.0, rnd.deadline - self.clock())):
            with self._cv:
                rnd.uploading.discard(client_id)
            raise ProtocolError("round deadline passed while waiting for an upload slot")
        with self._cv:
            if self._round is not rnd or client_id not in rnd.uploading:
                # the round ended while this upload waited for a slot: no one would cancel
                # it or free its slot if it stalled now
                self._uploads.release()
                raise ProtocolError(f"round {rnd.number} closed before the upload could start")
            if cancel is not None:
                rnd.streaming[client_id] = (cancel, self.clock())
        return UploadTicket(client_id, header.round, header, expected, max_bytes)

    def upload_progress(self, ticket: UploadTicket) -> None:
        """Data of ``ticket``'s upload arrived (resets its idle time; no lock: one store)."""
        rnd = self._round
        entry = rnd.streaming.get(ticket.client_id) if rnd is not None else None
        if rnd is not None and entry is not None and self._owns(rnd, ticket):
            rnd.streaming[ticket.client_id] = (entry[0], self.clock())

    @staticmethod
    def _owns(rnd: _Round, ticket: UploadTicket) -> bool:
        """Whether ``ticket`` was issued in this attempt of its round (same nonce)."""
        return rnd.number == ticket.round and rnd.cohort.get(ticket.client_id) == (
            ticket.header.nonce
        )

    def _cancel_idle_uploads(self, rnd: _Round) -> None:
        """Cancel uploads that sent nothing for ``upload_idle_timeout`` (under the lock)."""
        limit = self.settings.upload_idle_timeout
        now = self.clock()
        for client, (cancel, last) in list(rnd.streaming.items()):
            if now - last > limit:
                del rnd.streaming[client]
                rnd.uploading.discard(client)
                rnd.failed.setdefault(client, f"upload stalled: no data for {limit:g} s")
                cancel()

    def commit_upload(self, ticket: UploadTicket, tensors: Mapping[str, np.ndarray]) -> None:
        """Fold a fully validated update into the round's aggregate."""
        with self._cv:
            rnd = self._round
            if rnd is None or not self._owns(rnd, ticket) or ticket.client_id not in rnd.pending:
                raise ProtocolError(f"round {ticket.round} closed before the upload completed")
            if rnd.secure is not None:
                (vector,) = tensors.values()  # the upload spec names the one tensor
                rnd.secure.add_masked(ticket.client_id, np.asarray(vector))
            elif rnd.aggregator is not None:
                if self.settings.head_specs:
                    names = {s.name for s in self.settings.head_specs}
                    head = OrderedDict((k, v) for k, v in tensors.items() if k in names)
                    self._check_head(ticket.client_id, head)
                    rnd.heads[ticket.client_id] = head
                    tensors = OrderedDict((k, v) for k, v in tensors.items() if k not in names)
                # Under DP a client's image count is part of what is protected (one image
                # more or less, at example level): the mean is unweighted, as a secure sum is.
                weight = 1.0 if self.privacy is not None else float(ticket.header.num_examples)
                rnd.aggregator.add(tensors, weight)
            rnd.received[ticket.client_id] = ticket.header
            self._last_seen[ticket.client_id] = self.clock()
            self._cv.notify_all()

    def _head_expectation(self, client_id: str) -> tuple[list[TensorSpec], int]:
        """The head specs a client's upload must end with, and their byte bound.

        Once the server holds a client's head its shape is fixed; before that, any number of
        rows up to ``max_head_rows``.
        """
        known = self.heads.get(client_id)
        if known is not None:
            specs = [TensorSpec.of(k, v) for k, v in known.items()]
            return specs, sum(s.num_bytes for s in specs)
        specs = list(self.settings.head_specs)
        rows = max(self.settings.max_head_rows, 1)
        bound = sum(
            rows * int(np.prod(s.shape[1:], dtype=np.int64)) * s.dtype.itemsize for s in specs
        )
        return specs, bound

    def _check_head(self, client_id: str, head: Mapping[str, np.ndarray]) -> None:
        """A head fits the template, all its tensors have the same rows, within the limit."""
        template = self.settings.head_specs
        if list(head) != [s.name for s in template] or not all(
            s.fits(tuple(head[s.name].shape)) for s in template
        ):
            raise ProtocolError(f"the head of {client_id} does not fit this run's head")
        rows = {int(np.asarray(a).shape[0]) for a in head.values()}
        if len(rows) != 1:
            raise ProtocolError(f"the head of {client_id} has tensors of different row counts")
        count, most = rows.pop(), max(self.settings.max_head_rows, 1)
        if not 1 <= count <= most:
            raise ProtocolError(
                f"the head of {client_id} has {count} rows; this run takes 1 to {most} "
                "(server.max_head_rows; default: the identities of the server's data plan, "
                "which sites that bring their own data may exceed)"
            )

    def secagg_exchange(
        self, client_id: str, round_: int, nonce: bytes, stage: int, payload: bytes
    ) -> bytes:
        """One secure-aggregation stage message; waits until the stage has closed.

        ``stage`` is the internal stage number of :mod:`privacy.secagg.stages` (advertise,
        share: submit then wait; masked: wait for the unmask request; unmask: submit).
        """
        from privacy.secagg.stages import ADVERTISE, SHARE, UNMASK

        with self._cv:
            rnd, sec = self._secure_member(client_id, round_, nonce)
            if stage in (ADVERTISE, SHARE, UNMASK):
                sec.submit(stage, client_id, payload)
                self._cv.notify_all()
                if stage == UNMASK:
                    return sec.reply(stage, client_id)
            while sec.stage <= stage and not sec.aborted and not self._stop.is_set():
                if self._round is not rnd:
                    raise RoundAborted(f"round {round_} closed before its secure stages ended")
                if stage in (ADVERTISE, SHARE) and sec.stage == stage and sec.ready():
                    self._close_secure_stage(rnd)
                    break
                self._cv.wait(timeout=0.25)
            return sec.reply(stage, client_id)

    def secagg_attend(
        self,
        client_id: str,
        round_: int,
        nonce: bytes,
        alive: Callable[[], bool],
        wake: threading.Event,
    ) -> None:
        """Hold a cohort member's attendance call until its secure round ends.

        ``alive`` tells whether the call is still open; ``wake`` is set when it closes (a
        gRPC callback) and when the round ends. A call that closes first means the client is
        gone (its process died, or its link): the round stops waiting for it at once instead
        of at a deadline (:meth:`_client_gone`). The wait is on ``wake``, not on the round's
        condition, so the round's every step does not wake every attendance handler.
        """
        from privacy.secagg.stages import STAGE_NAMES

        with self._cv:
            rnd, sec = self._secure_member(client_id, round_, nonce)
            if client_id in rnd.attending:
                raise ProtocolError(f"client {client_id} already attends round {round_}")
            rnd.attending[client_id] = wake
        try:
            while True:
                wake.wait(timeout=5.0)
                wake.clear()  # before the checks: a later wake-up is not lost
                with self._cv:
                    if self._round is not rnd or sec.aborted or self._stop.is_set():
                        return
                    if not alive():
                        where = STAGE_NAMES[sec.stage]
                        self._client_gone(rnd, client_id, f"disconnected at {where}")
                        return
        finally:
            with self._cv:
                rnd.attending.pop(client_id, None)

    def secagg_withdraw(self, client_id: str, round_: int, nonce: bytes, reason: int = 0) -> None:
        """``client_id`` leaves its secure round (it failed locally): a dropout, noticed now.

        ``reason`` is the client's ``WithdrawReason``; a number this server does not know
        (a newer client's) reads as no reason. A client may also decline a plain round's
        task (``DECLINED``: its own policy, such as its privacy budget): the round stops
        waiting for it. Either way a client that declined is left out of the round's later
        attempts.
        """
        from privacy.secagg.stages import DECLINED, STAGE_NAMES, WITHDRAW_REASONS

        why = WITHDRAW_REASONS.get(reason, "")
        with self._cv:
            rnd = self._check_member(client_id, round_, nonce)
            if reason == DECLINED:
                self._declined.setdefault(rnd.number, set()).add(client_id)
            if rnd.secure is None and reason == DECLINED:
                if rnd.fail(client_id, f"declined the task ({why})"):
                    log.warning("round %d: %s declined its task: %s", rnd.number, client_id, why)
                    self._cv.notify_all()
                return
            rnd, sec = self._secure_member(client_id, round_, nonce)
            how = f"withdrew at {STAGE_NAMES[sec.stage]}" + (f" ({why})" if why else "")
            self._client_gone(rnd, client_id, how)

    def _client_gone(self, rnd: _Round, client_id: str, how: str) -> None:
        """``client_id`` left the secure round: its open call closed, or it withdrew.

        No stage waits for it any more; if it has not uploaded, it never will, and the round
        stops waiting for its update too. The protocol then treats it as it treats a client
        that missed a deadline (under the lock).
        """
        sec = rnd.secure
        assert sec is not None
        if client_id in sec.gone:  # withdrew, then its attendance call closed
            return
        sec.mark_gone(client_id)
        rnd.fail(client_id, f"secure aggregation: {how}")
        log.warning("round %d: %s left secure aggregation: %s", rnd.number, client_id, how)
        self._cv.notify_all()

    def _close_secure_stage(self, rnd: _Round) -> None:
        """Close the open secure stage (under the lock); late clients count as dropped."""
        sec = rnd.secure
        assert sec is not None
        try:
            sec.close_stage()
        finally:
            for client, where in sec.dropped.items():
                rnd.fail(client, f"dropped at secure-aggregation stage {where}")
            self._cv.notify_all()

    def record_failure(self, client_id: str, round_: int, nonce: bytes, error: str) -> None:
        """A cohort member's upload was refused: the round goes on without it.

        Only a message of the open attempt (its nonce) counts: a straggler's late message of
        a failed attempt must not cost it the retry that exists for it.
        """
        with self._cv:
            rnd = self._round
            if rnd is None or rnd.number != round_:
                return
            if not secrets.compare_digest(rnd.cohort.get(client_id, b""), nonce):
                return
            if rnd.fail(client_id, error):
                self._cv.notify_all()

    def release_upload(self, ticket: UploadTicket, error: str | None = None) -> None:
        """Free the upload slot; record a failed upload (the round goes on without it)."""
        self._uploads.release()
        with self._cv:
            rnd = self._round
            if rnd is not None and self._owns(rnd, ticket):
                rnd.streaming.pop(ticket.client_id, None)
                rnd.uploading.discard(ticket.client_id)
                if error is not None and ticket.client_id not in rnd.received:
                    rnd.failed.setdefault(ticket.client_id, error)
            self._cv.notify_all()

    # ------------------------------------------------------------ the driver
    def online_clients(self) -> list[str]:
        """Enrolled clients heard of within ``online_timeout``."""
        now = self.clock()
        return sorted(
            c
            for c, t in self._last_seen.items()
            if c in self.enrolled and now - t <= self.settings.online_timeout
        )

    def stop(self, reason: str = "stopped") -> None:
        """Ask the driver to stop at the next opportunity."""
        self.stop_reason = reason
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
            if self._round is not None:
                for wake in self._round.attending.values():
                    wake.set()

    def _sample_cohort(self, online: list[str], kind: TaskKind = TaskKind.TRAIN) -> list[str]:
        """The attempt's cohort: Poisson over the online clients, or ``clients_per_round``.

        Under client-level DP with fixed-size cohorts the accountant assumes a uniform draw
        of ``k`` of the ``N`` enrolled clients (inclusion ``k / N``); drawing from the online
        ones only would include each of ``m < N`` with ``k / m``. So that draw is from the
        enrolled clients, and members offline then drop out of the attempt at once. (Poisson
        sampling over the online clients includes each with at most ``q``.)
        """
        s = self.settings
        if s.sample_rate > 0:
            return [c for c in online if self._rng.random() < s.sample_rate]
        plan = self.privacy.plan if self.privacy is not None else None
        if plan is not None and plan.sampling == "fixed_size" and kind is TaskKind.TRAIN:
            return sorted(self._rng.sample(sorted(self.enrolled), s.clients_per_round))
        if 0 < s.clients_per_round < len(online):
            return sorted(self._rng.sample(online, s.clients_per_round))
        return online

    def _wait_for_clients(self, needed: int) -> list[str]:
        """Wait until every enrolled client is online, or the timeout with >= needed.

        A client that was seen and then went silent for longer than ``online_timeout`` is
        not waited for (it died; waiting the full timeout every round would stall the run);
        one never seen yet is, until the timeout.
        """
        deadline = self.clock() + self.settings.round_timeout
        with self._cv:
            while not self._stop.is_set():
                online = self.online_clients()
                now = self.clock()
                gone = {
                    c for c, t in self._last_seen.items() if now - t > self.settings.online_timeout
                }
                awaited = self.enrolled - gone
                if len(online) >= len(awaited) or (len(online) >= needed and now >= deadline):
                    if len(online) >= needed:
                        return online
                if self.clock() >= deadline + self.settings.round_timeout:
                    break
                self._cv.wait(timeout=0.25)
        raise RoundAborted(f"fewer than {needed} clients came online")

    def _run_round(self, number: int, kind: TaskKind, needed: int) -> _Round:
        """Run one round with retries; the returned round has >= needed results."""
        last_secure_error = ""
        last_shortfall = ""
        for attempt in range(self.settings.max_retries + 1):
            then = "retrying" if attempt < self.settings.max_retries else "aborting"
            if self.privacy is not None:  # the last attempt ended, what it showed accounted
                self.privacy.end_release()
            try:
                online = self._wait_for_clients(needed)
            except RoundAborted as exc:
                self._record_failed_attempt(number, attempt, kind, str(exc))
                raise
            declined = self._declined.get(number, set())
            cohort = self._sample_cohort([c for c in online if c not in declined], kind)
            if len(cohort) < needed:
                log.warning("round %d: cohort of %d < %d, resampling", number, len(cohort), needed)
                last_shortfall = f"the sampled cohort had {len(cohort)} clients"
                short = f"{last_shortfall}, fewer than the {needed} needed"
                self._record_failed_attempt(number, attempt, kind, short)
                continue
            if kind is TaskKind.TRAIN and self.privacy is not None:
                # before any task (and before a secure round's stage clocks start)
                self.privacy.begin_release(number, attempt, len(cohort))
            aggregator: Aggregator | None = None
            secure = None
            if kind is TaskKind.TRAIN and self._secure_enabled():
                try:
                    secure = self._secure_round(number, attempt, cohort)
                except RoundAborted as exc:  # e.g. no graph fits this cohort's size: redraw
                    last_secure_error, last_shortfall = str(exc), ""
                    log.warning("round %d attempt %d: %s; %s", number, attempt, exc, then)
                    self._record_failed_attempt(number, attempt, kind, str(exc))
                    continue
            elif kind is TaskKind.TRAIN:
                dp = self.privacy.make_aggregator(self.specs) if self.privacy else None
                aggregator = dp if dp is not None else StreamingMean(self.specs)
            with self._cv:
                rnd = _Round(
                    number=number,
                    kind=kind,
                    attempt=attempt,
                    cohort={c: secrets.token_bytes(16) for c in cohort},
                    deadline=self.clock() + self.settings.round_timeout,
                    aggregator=aggregator,
                    secure=secure,
                )
                for c in sorted(set(cohort) - set(online)):  # drawn from the enrolled (DP)
                    rnd.failed[c] = "offline when the cohort was drawn"
                    if rnd.secure is not None:
                        rnd.secure.mark_gone(c)
                self._round = rnd
                self._cv.notify_all()
                log.info("round %d (%s) started with cohort %s", number, kind.value, cohort)
                secure_error = ""
                while not self._stop.is_set() and rnd.pending and self.clock() < rnd.deadline:
                    sec = rnd.secure
                    if sec is not None and sec.stage < 2 and sec.ready():  # advertise, share
                        try:
                            self._close_secure_stage(rnd)
                        except RoundAborted as exc:
                            secure_error = str(exc)
                            break
                    self._cancel_idle_uploads(rnd)
                    self._cv.wait(timeout=0.25)
                if rnd.secure is not None and not secure_error and not self._stop.is_set():
                    secure_error = self._unmask(rnd)
                self._round = None
                for wake in rnd.attending.values():  # their round is over: answer them
                    wake.set()
                for cancel, _ in rnd.streaming.values():  # too late to count: free the slots
                    cancel()
                self._cv.notify_all()
            if self._stop.is_set():
                if kind is TaskKind.TRAIN:
                    self._account_stopped_attempt(number, attempt, rnd)
                raise RoundAborted(self.stop_reason or "stopped")
            event = {
                "round": number,
                "attempt": attempt,
                "kind": kind.value,
                "cohort": sorted(rnd.cohort),
                "received": sorted(rnd.received),
                "failed": rnd.failed,
                "dropped": sorted(rnd.pending),
            }
            if rnd.secure is not None:
                event["secure_aggregation"] = self._secure_record(rnd, secure_error)
            self.events.append(event)
            if secure_error and rnd.secure is not None and rnd.secure.sum_seen():
                # The server saw that sum: a release, accounted like a round. Not retried:
                # one faulty or colluding client could force release after release.
                reason = (
                    f"round {number} attempt {attempt}: {secure_error}; the server had already "
                    "unmasked the sum, so the round is not retried (one faulty client could "
                    "otherwise force release after release); find the faulty client in the "
                    "round record, remove it, and --resume"
                )
                if self.privacy is not None:
                    survivors = len(rnd.secure.survivors())
                    if self.privacy.discard_sum(
                        number, len(rnd.cohort), survivors, attempt, reason
                    ):
                        how = "it is counted in epsilon like a round (ledger kind discarded_sum)"
                    elif self.privacy.unit == "client":
                        how = "under central noise the server is trusted with it"
                    else:
                        how = "each client's own accountant counted its steps"
                    released = "The discarded sum was released to nobody else"
                    self.privacy.note(number, f"{reason}. {released}; {how}")
                self._record_failed_attempt(number, attempt, kind, reason, event)
                raise RoundAborted(reason)
            if kind is TaskKind.TRAIN and rnd.secure is None:
                self._account_failed_attempt(number, attempt, rnd, needed)
            if secure_error:
                last_secure_error = secure_error
                last_shortfall = _describe_shortfall(rnd.failed, [])
                log.warning("round %d attempt %d: %s; %s", number, attempt, secure_error, then)
                self._record_failed_attempt(number, attempt, kind, secure_error, event)
                continue
            if len(rnd.received) >= needed:
                return rnd
            last_secure_error = ""
            last_shortfall = _describe_shortfall(rnd.failed, sorted(rnd.pending))
            shortfall = f"{len(rnd.received)} of {needed} needed updates arrived"
            if last_shortfall:
                shortfall += f": {last_shortfall}"
            self._record_failed_attempt(number, attempt, kind, shortfall, event)
            log.warning(
                "round %d attempt %d: %d of %d needed updates arrived; %s",
                number,
                attempt,
                len(rnd.received),
                needed,
                then,
            )
        attempts = self.settings.max_retries + 1
        tries = f"{attempts} attempt" + ("s" if attempts > 1 else "")
        why = f"; in the last attempt {last_shortfall}" if last_shortfall else ""
        if last_secure_error:
            raise RoundAborted(f"round {number} aborted after {tries}: {last_secure_error}{why}")
        raise RoundAborted(
            f"round {number} aborted: fewer than {needed} updates after {tries}{why}"
        )

    def _account_stopped_attempt(self, number: int, attempt: int, rnd: _Round) -> None:
        """Count what an attempt showed the server before a stop ended it (client-level DP).

        A stop (a signal, the embedded driver) can end an attempt after the server unmasked
        its sum, or received plain updates: released all the same, and a resume runs the
        round again. Counted like any discarded sum (see :meth:`_account_failed_attempt`).
        """
        if self.privacy is None:
            return
        if rnd.secure is not None:
            if not rnd.secure.sum_seen():
                return
            updates = len(rnd.secure.survivors())
        elif rnd.received:
            updates = len(rnd.received)
        else:
            return
        reason = (
            f"round {number} attempt {attempt}: the run was stopped after the server had "
            f"{'unmasked the sum' if rnd.secure is not None else 'received updates'}"
        )
        if self.privacy.discard_sum(number, len(rnd.cohort), updates, attempt, reason):
            log.warning("%s; counted in epsilon like a round", reason)

    def _account_failed_attempt(self, number: int, attempt: int, rnd: _Round, needed: int) -> None:
        """Count the updates a failed plain attempt showed the server (client-level DP).

        Without secure aggregation the server sees each update as it arrives; with ``local``
        noise the guarantee covers that view, so an attempt that then fails (too few
        updates) has released them all the same, and the retry releases them again. Each
        such attempt is composed like a round (``discarded_sum``); see
        :meth:`privacy.server_round.ServerPrivacy.discard_sum` for the placements it counts.
        """
        if not rnd.received or len(rnd.received) >= needed or self.privacy is None:
            return
        reason = (
            f"round {number} attempt {attempt}: the server received {len(rnd.received)} "
            f"update(s) and the attempt then failed (fewer than {needed})"
        )
        if self.privacy.discard_sum(number, len(rnd.cohort), len(rnd.received), attempt, reason):
            log.warning("%s; counted in epsilon like a round", reason)

    # ------------------------------------------------------- secure aggregation
    def _secure_enabled(self) -> bool:
        cfg = self.settings.secure_aggregation
        return cfg is not None and cfg.enabled

    def _secure_round(
        self, number: int, attempt: int, cohort: list[str]
    ) -> ServerSecureRound | ServerCkksRound:
        from fl_secure.errors import PrivacyError
        from privacy.secagg.round_setup import make_setup
        from privacy.secagg.server_round import ServerSecureRound

        cfg = self.settings.secure_aggregation
        assert cfg is not None
        length = sum(int(np.prod(sp.shape, dtype=np.int64)) for sp in self.specs)
        try:
            if cfg.scheme == "ckks":
                return self._ckks_round(number, attempt, cohort)
            setup = make_setup(
                cfg,
                run_id=self.settings.run_id,
                round_=number,
                attempt=attempt,
                cohort=cohort,
                vector_length=length,
                ddg=self._ddg(),
                min_inputs=self.settings.min_clients,
            )
            return ServerSecureRound(setup, self.signing_registry, cfg.stage_timeout, self.clock)
        except PrivacyError as exc:
            raise RoundAborted(f"round {number}: secure aggregation cannot start: {exc}") from exc

    def _ckks_round(self, number: int, attempt: int, cohort: list[str]) -> ServerCkksRound:
        """A CKKS round: encrypted uploads summed here, decrypted by one or two clients."""
        from privacy.ckks.round_setup import CkksSetup, shared_layers
        from privacy.ckks.server_round import ServerCkksRound

        cfg = self.settings.secure_aggregation
        assert cfg is not None
        if not self.settings.ckks_public_context:
            raise RoundAborted("secure_aggregation.scheme = 'ckks' but no CKKS context is loaded")
        # random too: a resumed run repeats the round's number and attempt
        tag = f"fl-secure/ckks/{self.settings.run_id}/{number}/{attempt}/".encode()
        tag += secrets.token_bytes(16)
        setup = CkksSetup(
            round_id=hashlib.sha256(tag).digest()[:16],
            cohort=tuple(sorted(cohort)),
            layers=shared_layers([sp.name for sp in self.specs], cfg.ckks_layers),
            min_count=self.settings.min_clients,
            decryptors=cfg.ckks_decryptors,
        )
        return ServerCkksRound(
            setup, self.settings.ckks_public_context, list(self.specs), cfg.stage_timeout,
            self.clock,
        )  # fmt: skip

    def _ddg(self) -> tuple[float, float, int] | None:
        """(z, C, t) when client-level DP noise is distributed: integer noise under SecAgg."""
        plan = self.privacy.plan if self.privacy is not None else None
        if plan is None or plan.placement != "distributed":
            return None
        return plan.noise_multiplier, plan.clip_norm, self.settings.min_clients

    def _unmask(self, rnd: _Round) -> str:
        """After the masked inputs: ask for shares, wait for them, unmask (under the lock)."""
        sec = rnd.secure
        assert sec is not None
        try:
            if sec.stage < 2:
                raise RoundAborted(
                    "secure aggregation aborted: the round ended before the key stages completed"
                )
            self._close_secure_stage(rnd)  # masked input -> unmask request
            while not self._stop.is_set() and not sec.ready():
                self._cv.wait(timeout=0.25)
            self._close_secure_stage(rnd)  # unmask -> the sum
        except RoundAborted as exc:
            return str(exc)
        return ""

    def _secure_record(self, rnd: _Round, error: str) -> dict[str, Any]:
        sec = rnd.secure
        assert sec is not None
        return {
            **sec.record(),
            "survivors": list(sec.survivors()) if not error else [],
            "dropped": dict(sorted(sec.dropped.items())),
            # seen to leave (a closed attendance call or a withdrawal), not at a deadline
            "left": sorted(sec.gone),
            "aborted": error,
        }

    def _aggregate(self, rnd: _Round) -> Tensors:
        """The round's aggregate update (from the unmasked sum, or the aggregator)."""
        if rnd.secure is None:
            if rnd.aggregator is None:  # pragma: no cover - TRAIN rounds always aggregate
                raise RoundAborted("no aggregator")
            return rnd.aggregator.mean()
        from privacy.secagg.vectors import unflatten

        total = unflatten(rnd.secure.decoded_sum(), self.specs)
        count = len(rnd.secure.survivors())
        if self.privacy is not None and self.privacy.plan is not None:  # client-level DP
            return self.privacy.finish_sum(total, self.specs)
        return OrderedDict((s.name, (total[s.name] / count).astype(s.dtype)) for s in self.specs)

    def run(self, on_round: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run every remaining round, then a final evaluation; return the last metrics."""
        s = self.settings
        last: dict[str, Any] = {}
        try:
            if self.completed_round == 0:
                self._record_untrained()
            for number in range(self.completed_round + 1, s.rounds + 1):
                if self._budget_exhausted(number):
                    break
                self._prepare_broadcast(number)
                rnd = self._run_round(number, TaskKind.TRAIN, s.min_clients)
                mean_update = self._aggregate(rnd)
                params = self.server_step(self.params, mean_update, number)
                held = self._vet_model(number, rnd, params)  # a diverged one is never released
                heads = {**self.heads, **self._step_heads(number, rnd)}
                encoded = self.store.encode(number, params)  # hashed for the ledger, written
                rows = self._privacy_rows(number, rnd, encoded)
                last = self._record(number, rnd, rows, held)
                # Checkpoint (with the round's ledger rows and the clients' heads), then the
                # ledger entry is synced, and only then is the model released to the next cohort.
                state: dict[str, Any] = {"status": "running", "privacy_rows": rows}
                if self.settings.config_sha256:
                    state["config_sha256"] = self.settings.config_sha256
                if self.settings.run_id:  # the ledger's id, kept if the folder is renamed
                    state["run_id"] = self.settings.run_id
                self.store.save(number, params, state, client_tensors=heads, encoded=encoded)
                if self.privacy is not None:
                    self.privacy.commit(number, rows)
                with self._cv:
                    self.params = params
                    self.heads = heads
                    self.completed_round = number
                if on_round is not None:
                    on_round(last)
            if s.final_evaluation:
                rnd = self._run_round(s.rounds + 1, TaskKind.EVALUATE, 1)
                self.final_client_metrics = {c: h.metrics for c, h in rnd.received.items()}
            if self.status != "budget_exhausted":
                self.status = "completed"
                self.stop_reason = self.stop_reason or f"{s.rounds} rounds completed"
        except RoundAborted as exc:
            # every path to here accounted what the server saw: no attempt is in flight
            if self.privacy is not None:
                self.privacy.end_release()
            self.status = "aborted" if not self._stop.is_set() else "stopped"
            self.stop_reason = str(exc)
            log.error("%s", exc)
        finally:
            with self._cv:
                self._finished = True
                self._cv.notify_all()
        return last

    def _step_heads(self, number: int, rnd: _Round) -> dict[str, Tensors]:
        """The server step on the heads the round's cohort uploaded (FedGC, Eq. 5)."""
        if self.head_step is None or not rnd.heads:
            return {}
        s = self.settings
        lr = round_learning_rate(s.training.learning_rate, number, s.rounds, s.lr_schedule)
        return self.head_step(rnd.heads, learning_rate=lr, round_=number)

    def _prepare_broadcast(self, number: int) -> None:
        """The round's broadcast tensors from the global parameters, before its cohort asks."""
        if self.broadcast is None:
            return
        tensors = self.broadcast(self.params, number)
        for name, array in tensors.items():
            if not name.startswith(BROADCAST_PREFIX) or not np.all(np.isfinite(array)):
                raise ProtocolError(f"broadcast tensor {name!r}: bad name or non-finite values")
        with self._cv:
            self._broadcast_tensors = OrderedDict(tensors)

    def bytes_per_client(self) -> dict[str, int]:
        """Payload bytes one client exchanges in a training round (tensor bytes, no framing).

        ``parameters_down`` and ``parameters_up`` are the shared parameters (the plain upload
        has the same specs; a masked upload's size is in the secure-aggregation record),
        ``broadcast`` the round's broadcast tensors.
        """
        params = sum(sp.num_bytes for sp in self.specs)
        extra = sum(int(a.nbytes) for a in self._broadcast_tensors.values())
        return {
            "broadcast": extra,
            "parameters_down": params,
            "parameters_up": params,
            "total": extra + 2 * params,
        }

    def _record_untrained(self) -> None:
        """Round 0: the untrained model, the baseline every later round is read against."""
        self.run_dir.truncate_metrics_after(-1)  # before round 0's own failed attempts
        record: dict[str, Any] = {"round": 0}
        if self.evaluator is not None:
            try:
                record["held_out"] = _finite_or_none(self.evaluator(self.params))
            except DegenerateEmbeddings as exc:
                raise RoundAborted(
                    f"the initial model's held-out embeddings: {exc} (check model.* and the "
                    "initial parameters); no round ran"
                ) from exc
        if self.settings.final_evaluation:  # the clients score it on their own test images
            rnd = self._run_round(0, TaskKind.EVALUATE, 1)
            record["clients"] = {c: h.metrics for c, h in sorted(rnd.received.items())}
        self.run_dir.append_metrics(record)

    def _budget_exhausted(self, number: int) -> bool:
        """Stop before round ``number`` if it would pass the privacy budget."""
        if self.privacy is None:
            return False
        reason = self.privacy.budget_stop(number)
        if reason is None:
            return False
        log.warning("%s", reason)
        self.privacy.note(number, reason)
        self.status = "budget_exhausted"
        self.stop_reason = reason
        return True

    def _privacy_rows(self, number: int, rnd: _Round, encoded: bytes) -> list[dict[str, Any]]:
        """The round's ledger rows; each names the parameters file (``encoded``) it covers."""
        if self.privacy is None:
            return []
        metrics = {c: h.metrics for c, h in rnd.received.items()}
        rows = self.privacy.round_entries(number, len(rnd.cohort), metrics, rnd.attempt)
        digest = hashlib.sha256(encoded).hexdigest()  # sha256sum of the file checks it
        for row in rows:
            row["payload"]["model_sha256"] = digest
        return rows

    def _vet_model(self, number: int, rnd: _Round, params: Tensors) -> dict[str, Any] | None:
        """Round ``number``'s new global model scored, or the round refused as diverged.

        A model with NaN/Inf parameters, or finite ones whose held-out embeddings overflow
        (or vanish), is neither checkpointed nor released; the last checkpoint stays the
        run's model. The server did see the round's updates (or their sum), so under
        client-level DP with local or distributed noise that view is accounted like any
        discarded sum before the run stops: a resume that runs the round again composes
        both.

        Returns:
            The held-out metrics (NaN scores as None), or None without an evaluator.

        Raises:
            RoundAborted: Naming what diverged, after the attempt is recorded and accounted.
        """
        reason = _non_finite_reason(params, number)
        held = None
        if not reason and self.evaluator is not None:
            try:
                held = _finite_or_none(self.evaluator(params))
            except DegenerateEmbeddings as exc:
                reason = (
                    f"round {number}: the new global model's held-out embeddings: {exc} "
                    f"(training diverged: lower train.lr); the model of round {number - 1} "
                    "is kept"
                )
        if not reason:
            return held
        if self.privacy is not None:
            survivors = len(rnd.received)
            if self.privacy.discard_sum(number, len(rnd.cohort), survivors, rnd.attempt, reason):
                reason += "; the server saw the round's sum, counted in epsilon like a round"
            self.privacy.note(number, reason)
        event = self.events[-1] if self.events and self.events[-1]["round"] == number else None
        self._record_failed_attempt(number, rnd.attempt, TaskKind.TRAIN, reason, event)
        raise RoundAborted(reason)

    def _record(
        self, number: int, rnd: _Round, rows: list[dict[str, Any]], held: dict[str, Any] | None
    ) -> dict[str, Any]:
        record: dict[str, Any] = {
            "round": number,
            "attempt": rnd.attempt,
            "cohort_size": len(rnd.cohort),
            "num_updates": len(rnd.received),
            "dropped": sorted(rnd.pending),
            "failed": rnd.failed,
            "num_examples": sum(h.num_examples for h in rnd.received.values()),
            "duration_s": round(time.monotonic() - rnd.started, 3),
            "clients": {c: h.metrics for c, h in sorted(rnd.received.items())},
        }
        if rnd.secure is not None:
            record["secure_aggregation"] = self._secure_record(rnd, "")
        if self.broadcast is not None:
            record["bytes_per_client"] = self.bytes_per_client()
        if self.privacy is not None:
            record["privacy"] = self.privacy.preview(rows)
            record["epsilon"] = record["privacy"]["epsilon"]
        if held is not None:
            record["held_out"] = held
        self.run_dir.append_metrics(record)
        return record

    def _record_failed_attempt(
        self,
        number: int,
        attempt: int,
        kind: TaskKind,
        reason: str,
        event: dict[str, Any] | None = None,
    ) -> None:
        """A failed attempt of round ``number``, in metrics.jsonl as ``"kind": "aborted"``.

        Retried or the end of the run, it is recorded (the report lists each); readers of
        completed rounds skip records with a ``kind``. ``event``: the attempt's cohort,
        updates received, failures and secure-aggregation record, when it got that far.
        """
        record: dict[str, Any] = {
            "kind": "aborted",
            "round": number,
            "attempt": attempt,
            "task": kind.value,
            "reason": reason,
        }
        keys = ("cohort", "received", "failed", "dropped", "secure_aggregation")
        record |= {k: event[k] for k in keys if event is not None and k in event}
        self.run_dir.append_metrics(_finite_or_none(record))

    def wait_clients_finished(self, timeout: float) -> None:
        """After the run, give polling clients time to hear FINISHED."""
        end = self.clock() + timeout
        with self._cv:
            while self.clock() < end:
                now = self.clock()
                active = [c for c, t in self._last_seen.items() if now - t < 1.0]
                if not active:
                    return
                self._cv.wait(timeout=0.25)


def _version() -> str:
    from fl_secure import __version__

    return __version__


def _finite_or_none(value: Any) -> Any:
    """``value`` with NaN/Inf floats (at any depth) as None: metrics.jsonl is strict JSON.

    A finite model can still evaluate to NaN (its embeddings overflow float32); the round's
    record says so with a null instead of the write failing after the round was aggregated.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(v) for v in value]
    return value


def _non_finite_reason(params: Tensors, number: int) -> str:
    """Why a new global model with NaN/Inf values is refused, or "" if it is finite.

    Finite updates can still overflow it.
    """
    bad = [name for name, a in params.items() if a.dtype.kind in "fc" and not np.isfinite(a).all()]
    if not bad:
        return ""
    return (
        f"round {number}: the aggregate made the global model non-finite in {bad} (updates "
        "too large: lower train.lr, or clip them with privacy.unit = 'client'); the model "
        f"of round {number - 1} is kept"
    )


def _describe_shortfall(failed: dict[str, str], silent: list[str]) -> str:
    """Why a round's cohort fell short, one clause per reason (for the abort message).

    The same refusal from every client (a diverged training's non-finite loss, say) reads
    once with the clients it hit, so the user learns the cause from the command's own
    output instead of from the server's log.
    """
    by_reason: dict[str, list[str]] = {}
    for client, reason in sorted(failed.items()):
        by_reason.setdefault(reason, []).append(client)
    parts = [f"{', '.join(clients)}: {reason}" for reason, clients in by_reason.items()]
    if silent:
        parts.append(f"{', '.join(silent)}: sent nothing before the round's timeout")
    return "; ".join(parts)
