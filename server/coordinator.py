"""Round coordinator: the run's driver, and the one object the gRPC servicer talks to.

Transport-free: the servicer (:mod:`server.servicer`) only moves messages in and out of this
object, so the whole round logic is testable without a network. One driver thread
(:meth:`Coordinator.run`) advances rounds; servicer threads call :meth:`join`, :meth:`poll`,
:meth:`parameters`, :meth:`open_upload`, :meth:`commit_upload` and the secure-aggregation
entries. The work is done by collaborators that share one :class:`~server.attempt.RoundBoard`:

- :class:`~server.round.RoundState`: the model a round starts from, what a client is sent,
  the server's steps (the same code the simulation runs);
- :class:`~server.membership.Membership`: who is enrolled and online, cohort sampling;
- :class:`~server.uploads.UploadDesk`: upload admission, slots, the fold into the aggregate;
- :class:`~server.secure_relay.SecureRelay`: SecAgg / SecAgg+ stages and CKKS rounds;
- :class:`~server.round_attempts.AttemptRunner`: a round's attempts and retries;
- :class:`~server.release_accounting.ReleaseAccounting`: what the server saw, accounted;
- :class:`~server.records.RoundRecords`: ``metrics.jsonl`` and the attempt log.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from fl_secure.checkpoints import CheckpointStore
from fl_secure.errors import CheckpointError, ProtocolError, RoundAborted
from fl_secure.evaluation import DegenerateEmbeddings
from fl_secure.logsafe import safe
from fl_secure.messages import JoinReply, Task, TaskKind, Tensors, TensorSpec, UpdateHeader
from privacy.ledger.anchors import STATE_KEY as LEDGER_HEAD_KEY
from privacy.ledger.entries import canonical_json
from privacy.secagg.stages import DECLINED, WITHDRAW_REASONS
from server.attempt import Attempt, RoundBoard, UploadTicket
from server.influence import describe_norms, diverged_offenders
from server.membership import Membership
from server.records import RoundRecords, finite_or_none
from server.release_accounting import BudgetStop, ReleaseAccounting
from server.round import Evaluator, HeadStep, RoundState, ServerStep, vet_model
from server.round_attempts import AttemptRunner
from server.secure_relay import SecureRelay
from server.uploads import UploadDesk

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable, Mapping

    import numpy as np
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from fl_secure.algorithms.base import Broadcaster
    from fl_secure.runs import RunDir
    from privacy.server_round import ServerPrivacy
    from server.settings import CoordinatorSettings

log = logging.getLogger(__name__)


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
        broadcast: Broadcaster | None = None,
    ) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.store = CheckpointStore(run_dir.checkpoints)
        self.evaluator = evaluator
        self.privacy = privacy
        self.clock = clock
        self.completed_round = 0
        self.status = "running"
        self.final_client_metrics: dict[str, dict[str, float]] = {}
        self.model = RoundState(
            initial,
            settings.round_rules(),
            server_step=server_step,
            head_step=head_step,
            broadcaster=broadcast,
        )
        self.board = RoundBoard(clock)
        self.membership = Membership(self.board, settings, enrolled, privacy)
        self.uploads = UploadDesk(self.board, settings, self.model, self.membership, privacy)
        self.relay = SecureRelay(
            self.board,
            settings,
            self.model.specs,
            privacy=privacy,
            signing_registry=signing_registry,
        )
        self.accounting = ReleaseAccounting(privacy)
        self.records = RoundRecords(run_dir)
        self.attempts = AttemptRunner(
            self.board,
            settings,
            self.model,
            membership=self.membership,
            uploads=self.uploads,
            relay=self.relay,
            accounting=self.accounting,
            records=self.records,
            privacy=privacy,
        )

    # ------------------------------------------------------------- the state
    @property
    def params(self) -> Tensors:
        """The global shared parameters (of the last completed round)."""
        return self.model.params

    @property
    def heads(self) -> dict[str, Tensors]:
        """Server-sees-heads: each client's latest corrected head."""
        return self.model.heads

    @property
    def specs(self) -> list[TensorSpec]:
        """The shared parameters' specs (what a plain upload must match)."""
        return self.model.specs

    @property
    def enrolled(self) -> set[str]:
        """The client ids that may take part (the population)."""
        return self.membership.enrolled

    @property
    def events(self) -> list[dict[str, Any]]:
        """One event per attempt that drew a cohort (:class:`~server.records.RoundRecords`)."""
        return self.records.events

    @property
    def stop_reason(self) -> str:
        """Why the run stopped or ended ("" while it runs)."""
        return self.board.stop_reason

    @stop_reason.setter
    def stop_reason(self, reason: str) -> None:
        self.board.stop_reason = reason

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
            self.model.check_head(client, head)
        self.model.advance(checkpoint.parameters, checkpoint.client_tensors)
        self.completed_round = checkpoint.round
        dropped = self.run_dir.truncate_metrics_after(checkpoint.round)
        log.info("resumed after round %d (%d metric lines dropped)", checkpoint.round, dropped)
        return checkpoint.round

    # ------------------------------------------------------- servicer entries
    def join(self, client_id: str, num_examples: int) -> JoinReply:
        """Register a client as online (identity already checked by mTLS + enrollment)."""
        return self.membership.join(client_id, num_examples)

    def reported_examples(self) -> dict[str, int]:
        """Example count each client that joined reported at join (its weight's basis)."""
        return self.membership.reported_examples()

    def poll(self, client_id: str, last_round: int) -> Task:
        """Next task of ``client_id``; waits up to ``poll_wait`` seconds for one."""
        board = self.board
        deadline = board.clock() + self.settings.poll_wait
        with board.cv:
            self.membership.heard_from(client_id)
            board.cv.notify_all()
            while True:
                task = self._task_for(client_id)
                remaining = deadline - board.clock()
                if task.kind is not TaskKind.WAIT or remaining <= 0 or board.stopping:
                    return task
                board.cv.wait(timeout=min(remaining, 0.5))
                self.membership.heard_from(client_id)

    def _task_for(self, client_id: str) -> Task:
        if self.board.finished:
            return Task(kind=TaskKind.FINISHED, message=self._finished_message(client_id))
        rnd = self.board.current
        if rnd is None or client_id not in rnd.pending or client_id in rnd.uploading:
            return Task(kind=TaskKind.WAIT, retry_after_ms=500, message="no task for you now")
        s = self.settings
        remaining_ms = max(0, int((rnd.deadline - self.board.clock()) * 1000))
        return Task(
            kind=rnd.kind,
            round=rnd.number,
            nonce=rnd.cohort[client_id],
            algorithm=s.algorithm,
            training=self.model.rules.training_for(rnd.number),
            algorithm_params=s.algorithm_params,
            deadline_unix_ms=int(time.time() * 1000) + remaining_ms,
            parameters_bytes=self.model.sent_bytes(client_id),
            secagg_setup=rnd.secure.setup.to_bytes() if rnd.secure is not None else b"",
            ledger_head=self._ledger_head() if rnd.kind is TaskKind.TRAIN else b"",
        )

    def _ledger_head(self) -> bytes:
        """The signed ledger head a TRAIN task carries: each site keeps the ones it saw."""
        signed = self.privacy.signed_head() if self.privacy is not None else None
        return b"" if signed is None else canonical_json(signed).encode("utf-8")

    def _finished_message(self, client_id: str) -> str:
        """How the run ended, as ``client_id`` may learn it: its own status, no one else's.

        The stop reason of an aborted run names the other clients of its last attempt and
        why each failed; that stays in the server's log and ``metrics.jsonl``.
        """
        if self.status == "completed":
            text = f"run completed: {self.completed_round} rounds"
        elif self.status == "budget_exhausted":  # the run's own budget: no client's doing
            text = f"run ended after round {self.completed_round}: privacy budget exhausted"
        elif self.status == "aborted":
            text = (
                f"run aborted after round {self.completed_round} (too few updates, or a secure "
                "round failed; the server operator has the details)"
            )
        else:
            text = f"run stopped by the server after round {self.completed_round}"
        mine = [e for e in self.records.events if client_id in e["cohort"]]
        if mine:
            last = mine[-1]
            where = f"round {last['round']} attempt {last['attempt']}"
            if client_id in last["failed"]:
                text += f"; your update in {where} failed: {last['failed'][client_id]}"
            elif client_id in last["received"]:
                text += f"; your update in {where} was received"
            else:
                text += f"; your update in {where} did not arrive before its deadline"
        return text

    def parameters(self, client_id: str, round_: int, nonce: bytes) -> tuple[int, Tensors]:
        """Global parameters for a client of the current cohort (and its own head only)."""
        with self.board.cv:
            self.board.member(client_id, round_, nonce)
            return self.completed_round, self.model.sent_to(client_id)

    def open_upload(
        self, client_id: str, header: UpdateHeader, cancel: Callable[[], None] | None = None
    ) -> UploadTicket:
        """Check an update header and take an upload slot (:meth:`UploadDesk.open`)."""
        return self.uploads.open(client_id, header, cancel)

    def upload_progress(self, ticket: UploadTicket, num_bytes: int) -> None:
        """``num_bytes`` tensor bytes of an upload arrived (:meth:`UploadDesk.progress`)."""
        self.uploads.progress(ticket, num_bytes)

    def commit_upload(self, ticket: UploadTicket, tensors: Mapping[str, np.ndarray]) -> None:
        """Fold a fully validated update into the round's aggregate."""
        self.uploads.commit(ticket, tensors)

    def release_upload(self, ticket: UploadTicket, error: str | None = None) -> None:
        """Free the upload slot; record a failed upload (the round goes on without it)."""
        self.uploads.release(ticket, error)

    def record_failure(self, client_id: str, round_: int, nonce: bytes, error: str) -> None:
        """A cohort member's upload or message was refused: the round goes on without it."""
        self.uploads.record_failure(client_id, round_, nonce, error)

    def secagg_exchange(
        self, client_id: str, round_: int, nonce: bytes, stage: int, payload: bytes
    ) -> bytes:
        """One secure-aggregation stage message (:meth:`SecureRelay.exchange`)."""
        return self.relay.exchange(client_id, round_, nonce, stage, payload)

    def secagg_attend(
        self,
        client_id: str,
        round_: int,
        nonce: bytes,
        alive: Callable[[], bool],
        wake: threading.Event,
    ) -> None:
        """Hold a cohort member's attendance call until its secure round ends.

        A call that closed first (the client's process or link died) also marks the client
        offline (:meth:`Membership.went_offline`): the next round does not wait for it.
        """
        self.relay.attend(client_id, round_, nonce, alive, wake)
        if not alive():
            with self.board.cv:
                self.membership.went_offline(client_id)

    def secagg_withdraw(self, client_id: str, round_: int, nonce: bytes, reason: int = 0) -> None:
        """``client_id`` leaves its secure round (it failed locally): a dropout, noticed now.

        A client may also decline a plain round's task (``DECLINED``: its own policy, such as
        its privacy budget): the round stops waiting for it. Either way a client that
        declined is left out of the round's later attempts.
        """
        with self.board.cv:
            rnd = self.board.member(client_id, round_, nonce)
            if reason == DECLINED:
                self.membership.decline(rnd.number, client_id)
                if rnd.secure is None:
                    self._declined(rnd, client_id, WITHDRAW_REASONS.get(reason, ""))
                    return
            self.relay.withdraw(rnd, client_id, reason)

    def _declined(self, rnd: Attempt, client_id: str, why: str) -> None:
        if rnd.fail(client_id, f"declined the task ({why})"):
            log.warning("round %d: %s declined its task: %s", rnd.number, safe(client_id), why)
            self.board.cv.notify_all()

    def online_clients(self) -> list[str]:
        """Enrolled clients heard of within ``online_timeout``."""
        return self.membership.online_clients()

    def stop(self, reason: str = "stopped") -> None:
        """Ask the driver to stop at the next opportunity."""
        self.board.stop(reason)

    def wait_clients_finished(self, timeout: float) -> None:
        """After the run, give polling clients time to hear FINISHED."""
        self.membership.wait_clients_finished(timeout)

    # ------------------------------------------------------------ the driver
    def run(self, on_round: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run every remaining round, then a final evaluation; return the last metrics."""
        s = self.settings
        last: dict[str, Any] = {}
        try:
            if self.completed_round == 0:
                self._record_untrained()
            for number in range(self.completed_round + 1, s.rounds + 1):
                try:
                    # checked before the round, and before each of its retries (AttemptRunner)
                    self.accounting.check_budget(number, 0)
                    last = self._train_round(number)
                except BudgetStop as exc:
                    self.status = "budget_exhausted"
                    self.stop_reason = str(exc)
                    break
                if on_round is not None:
                    on_round(last)
            if s.final_evaluation:
                rnd = self.attempts.run(s.rounds + 1, TaskKind.EVALUATE, 1)
                self.final_client_metrics = {c: h.metrics for c, h in rnd.received.items()}
            if self.status != "budget_exhausted":
                self.status = "completed"
                self.stop_reason = self.stop_reason or f"{s.rounds} rounds completed"
        except RoundAborted as exc:
            # every path to here accounted what the server saw: no attempt is in flight
            self.accounting.end_attempt()
            self.status = "aborted" if not self.board.stopping else "stopped"
            self.stop_reason = str(exc)
            log.error("%s", safe(exc))
        finally:
            with self.board.cv:
                self.board.finished = True
                self.board.cv.notify_all()
        return last

    def _train_round(self, number: int) -> dict[str, Any]:
        """Round ``number``: aggregate, step, vet, record, checkpoint, then release."""
        self.model.prepare_broadcast(number)
        first = 0
        while True:
            rnd = self.attempts.run(number, TaskKind.TRAIN, self.settings.min_clients, first)
            params = self.model.step(number, self.attempts.mean_update(rnd))
            accepted, held = self._vet_model(rnd, params)  # a diverged one is never released
            if accepted:
                break
            first = rnd.attempt + 1  # retried without the updates it was blamed on
        heads = self.model.step_heads(number, rnd.heads)
        encoded = self.store.encode(number, params)  # hashed for the ledger, written
        rows = self.accounting.ledger_rows(rnd, encoded)
        last = self.records.completed(
            rnd,
            secure=self.relay.record(rnd, "") if rnd.secure is not None else None,
            bytes_per_client=(
                self.model.bytes_per_client() if self.model.broadcaster is not None else None
            ),
            privacy=self.accounting.preview(rows),
            held_out=held,
        )
        # Checkpoint (with the round's ledger rows and the clients' heads), then the ledger
        # entry is synced, and only then is the model released to the next cohort.
        state: dict[str, Any] = {"status": "running", "privacy_rows": rows}
        signed = self.privacy.signed_head() if self.privacy is not None else None
        if signed is not None:  # the ledger's signed head so far: a copy outside the ledger
            state[LEDGER_HEAD_KEY] = signed
        if self.settings.config_sha256:
            state["config_sha256"] = self.settings.config_sha256
        if self.settings.run_id:  # the ledger's id, kept if the folder is renamed
            state["run_id"] = self.settings.run_id
        self.store.save(number, params, state, client_tensors=heads, encoded=encoded)
        self.accounting.commit(number, rows)
        with self.board.cv:
            self.model.advance(params, heads)
            self.completed_round = number
        return last

    def _record_untrained(self) -> None:
        """Round 0: the untrained model, the baseline every later round is read against."""
        self.run_dir.truncate_metrics_after(-1)  # before round 0's own failed attempts
        record: dict[str, Any] = {"round": 0}
        if self.evaluator is not None:
            try:
                record["held_out"] = finite_or_none(self.evaluator(self.params))
            except DegenerateEmbeddings as exc:
                raise RoundAborted(
                    f"the initial model's held-out embeddings: {exc} (check model.* and the "
                    "initial parameters); no round ran"
                ) from exc
        if self.settings.final_evaluation:  # the clients score it on their own test images
            rnd = self.attempts.run(0, TaskKind.EVALUATE, 1)
            record["clients"] = {c: h.metrics for c, h in sorted(rnd.received.items())}
        self.records.untrained(record)

    def _vet_model(self, rnd: Attempt, params: Tensors) -> tuple[bool, dict[str, Any] | None]:
        """Round ``rnd.number``'s new global model scored, or the attempt refused as diverged.

        A diverged model (:func:`server.round.vet_model`) is neither checkpointed nor
        released; the previous round's model stays the run's. The server did see the
        attempt's updates (or their sum), so under client-level DP with local or distributed
        noise that view is accounted like any discarded sum. The round is then retried, while
        ``server.max_retries`` allows: without the plain updates the divergence is blamed on
        (:func:`server.influence.diverged_offenders`, named), or, securely aggregated, with a
        fresh cohort (a masked update cannot be told from the others: only the sum is
        vetted). A plain attempt whose updates are all alike diverged by the run's own
        settings, and a retry would diverge again: the run stops.

        Returns:
            Whether the model is accepted, and its held-out metrics (NaN scores as None; None
            without an evaluator, or when the round is to be retried).

        Raises:
            RoundAborted: Naming what diverged, after the attempt is recorded and accounted.
        """
        held, reason = vet_model(rnd.number, params, self.evaluator)
        if not reason:
            scored: dict[str, Any] | None = finite_or_none(held)
            return True, scored
        offenders: list[str] = []
        if rnd.secure is None and not self.attempts.clips_updates():
            offenders = diverged_offenders(rnd.norms, self.settings.update_norm_factor)
        retry = rnd.attempt < self.settings.max_retries and (
            bool(offenders) or rnd.secure is not None
        )
        if offenders:
            blamed = describe_norms(offenders, rnd.norms)
            reason += (
                f"; blamed on the update(s) of {blamed}, over server.update_norm_factor = "
                f"{self.settings.update_norm_factor:g} times the median L2 norm of the others"
            )
            for client in offenders:
                rnd.failed[client] = f"update dropped: the aggregate with it diverged ({blamed})"
            self.membership.leave_out(rnd.number, offenders)
        elif rnd.secure is not None:
            reason += (
                "; the updates were masked, so only their sum could be vetted: a client's "
                "update or train.lr is to blame"
            )
        if retry:
            reason += (
                "; the round is retried without them"
                if offenders
                else "; the round is retried with a fresh cohort"
            )
        reason = self.accounting.diverged(rnd, reason)
        event = self.records.last_event(rnd.number)
        self.records.failed_attempt(rnd.number, rnd.attempt, TaskKind.TRAIN, reason, event)
        if not retry:
            raise RoundAborted(reason)
        log.warning("%s", reason)
        return False, None
