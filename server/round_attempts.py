"""A round's attempts: draw a cohort, open the attempt, wait for its updates, retry or abort.

An attempt ends at its deadline, when nothing is pending, or when the run stops; under
secure aggregation the survivors' sum is then unmasked. An attempt with too few results is
recorded and retried (``server.max_retries``) with a fresh cohort and fresh nonces, except
one whose secure sum the server already saw: one faulty client could otherwise force release
after release. Before each training attempt, retries included, the privacy budget is checked
(:meth:`~server.release_accounting.ReleaseAccounting.check_budget`): a retry would release the
round again on top of what the failed attempts showed the server.
"""

from __future__ import annotations

import logging
import math
import secrets
from typing import TYPE_CHECKING

from fl_secure.aggregation import Aggregator, StreamingMean
from fl_secure.errors import RoundAborted
from fl_secure.logsafe import safe
from fl_secure.messages import TaskKind, Tensors
from server.attempt import Attempt, RoundBoard
from server.influence import describe_norms, norm_outliers
from server.records import RoundRecords, describe_shortfall

if TYPE_CHECKING:
    from privacy.server_round import ServerPrivacy
    from server.membership import Membership
    from server.release_accounting import ReleaseAccounting
    from server.round import RoundState
    from server.secure_relay import SecureRelay
    from server.settings import CoordinatorSettings
    from server.uploads import UploadDesk

log = logging.getLogger(__name__)


class AttemptRunner:
    """Runs one round, attempt after attempt, until it has enough results (the driver thread)."""

    def __init__(
        self,
        board: RoundBoard,
        settings: CoordinatorSettings,
        model: RoundState,
        *,
        membership: Membership,
        uploads: UploadDesk,
        relay: SecureRelay,
        accounting: ReleaseAccounting,
        records: RoundRecords,
        privacy: ServerPrivacy | None = None,
    ) -> None:
        self.board = board
        self.settings = settings
        self.model = model
        self.membership = membership
        self.uploads = uploads
        self.relay = relay
        self.accounting = accounting
        self.records = records
        self.privacy = privacy

    def run(self, number: int, kind: TaskKind, needed: int, first: int = 0) -> Attempt:
        """Run round ``number`` with retries; the returned attempt has >= ``needed`` results.

        ``first``: the attempt to start at (a round whose aggregate was refused goes on with
        the next; the retries are the round's, ``server.max_retries`` in all). A plain
        training attempt's updates far over its median norm are dropped, their clients
        named, and the round retried without them (:func:`server.influence.norm_outliers`).

        Raises:
            BudgetStop: A training attempt would pass the privacy budget (it is not started).
            RoundAborted: Every attempt fell short, a secure sum was seen and discarded, too
                few clients came online, or the run was asked to stop.
        """
        retries = self.settings.max_retries
        last_secure_error = ""
        last_shortfall = ""
        for attempt in range(first, retries + 1):
            then = "retrying" if attempt < retries else "aborting"
            self.accounting.end_attempt()  # the last attempt ended, what it showed accounted
            if kind is TaskKind.TRAIN:  # after the failed attempts' releases are composed
                self.accounting.check_budget(number, attempt)
            try:
                online = self.membership.wait_for_clients(needed)
            except RoundAborted as exc:
                self.records.failed_attempt(number, attempt, kind, str(exc))
                raise
            candidates = self.membership.candidates(number, online)
            cohort = self.membership.sample_cohort(candidates, kind)
            if len(cohort) < needed:
                log.warning("round %d: cohort of %d < %d, resampling", number, len(cohort), needed)
                last_shortfall = f"the sampled cohort had {len(cohort)} clients"
                short = f"{last_shortfall}, fewer than the {needed} needed"
                self.records.failed_attempt(number, attempt, kind, short)
                continue
            # before any task (and before a secure round's stage clocks start)
            self.accounting.begin_attempt(number, attempt, kind, len(cohort))
            aggregator: Aggregator | None = None
            secure = None
            if kind is TaskKind.TRAIN and self.settings.secure:
                try:
                    secure = self.relay.start(number, attempt, cohort)
                except RoundAborted as exc:  # e.g. no graph fits this cohort's size: redraw
                    last_secure_error, last_shortfall = str(exc), ""
                    log.warning("round %d attempt %d: %s; %s", number, attempt, safe(exc), then)
                    self.records.failed_attempt(number, attempt, kind, str(exc))
                    continue
            elif kind is TaskKind.TRAIN:
                aggregator = self._aggregator()
            rnd = Attempt(
                number=number,
                kind=kind,
                attempt=attempt,
                cohort={c: secrets.token_bytes(16) for c in cohort},
                deadline=self.board.clock() + self.settings.round_timeout,
                aggregator=aggregator,
                secure=secure,
                weight_cap=self.membership.weight_cap() if aggregator is not None else math.inf,
            )
            secure_error = self._hold(rnd, online)
            if self.board.stopping:
                if kind is TaskKind.TRAIN:
                    self.accounting.stopped_attempt(rnd)
                raise RoundAborted(self.board.stop_reason or "stopped")
            secure_record = None if rnd.secure is None else self.relay.record(rnd, secure_error)
            event = self.records.attempt_event(rnd, secure_record)
            if secure_error and rnd.secure is not None and rnd.secure.sum_seen():
                # The server saw that sum: a release, accounted like a round. Not retried:
                # one faulty or colluding client could force release after release.
                reason = (
                    f"round {number} attempt {attempt}: {secure_error}; the server had already "
                    "unmasked the sum, so the round is not retried (one faulty client could "
                    "otherwise force release after release); find the faulty client in the "
                    "round record, remove it, and --resume"
                )
                self.accounting.discarded_secure_sum(rnd, reason)
                self.records.failed_attempt(number, attempt, kind, reason, event)
                raise RoundAborted(reason)
            if kind is TaskKind.TRAIN and rnd.secure is None:
                self.accounting.failed_attempt(rnd, needed)
            if secure_error:
                last_secure_error = secure_error
                last_shortfall = describe_shortfall(rnd.failed, [])
                log.warning(
                    "round %d attempt %d: %s; %s", number, attempt, safe(secure_error), then
                )
                self.records.failed_attempt(number, attempt, kind, secure_error, event)
                continue
            outliers = self._norm_outliers(rnd) if len(rnd.received) >= needed else ""
            if len(rnd.received) >= needed and not outliers:
                return rnd
            if outliers:  # the server saw these updates: accounted like a refused aggregate
                last_secure_error, last_shortfall = outliers, ""
                reason = self.accounting.diverged(rnd, f"{outliers}; {then}")
                self.records.failed_attempt(number, attempt, kind, reason, event)
                log.warning("%s", reason)
                continue
            last_secure_error = ""
            last_shortfall = describe_shortfall(rnd.failed, sorted(rnd.pending))
            shortfall = f"{len(rnd.received)} of {needed} needed updates arrived"
            if last_shortfall:
                shortfall += f": {last_shortfall}"
            self.records.failed_attempt(number, attempt, kind, shortfall, event)
            log.warning(
                "round %d attempt %d: %d of %d needed updates arrived; %s",
                number,
                attempt,
                len(rnd.received),
                needed,
                then,
            )
        tries = f"{retries + 1} attempt" + ("s" if retries > 0 else "")
        why = f"; in the last attempt {last_shortfall}" if last_shortfall else ""
        if last_secure_error:
            raise RoundAborted(f"round {number} aborted after {tries}: {last_secure_error}{why}")
        raise RoundAborted(
            f"round {number} aborted: fewer than {needed} updates after {tries}{why}"
        )

    def clips_updates(self) -> bool:
        """Whether the server clips each plain update itself (client-level DP, central noise).

        Then no update can move the mean by more than the clip norm, and dropping one by how
        it compares with the others' norms would make one client's inclusion depend on
        another's data, which the accountant does not cover: the norm screens are off.
        """
        p = self.privacy
        return p is not None and p.unit == "client" and p.placement == "central"

    def _norm_outliers(self, rnd: Attempt) -> str:
        """Drop a plain attempt's updates far over its median norm: why, or "" if none."""
        if rnd.kind is not TaskKind.TRAIN or rnd.secure is not None or self.clips_updates():
            return ""
        factor = self.settings.update_norm_factor
        outliers, median = norm_outliers(rnd.norms, factor)
        if not outliers:
            return ""
        self.membership.leave_out(rnd.number, outliers)
        for client in outliers:
            rnd.failed[client] = (
                f"update dropped: its L2 norm {rnd.norms[client]:.4g} is over "
                f"server.update_norm_factor = {factor:g} times the attempt's median {median:.4g}"
            )
        return (
            f"round {rnd.number} attempt {rnd.attempt}: the updates of "
            f"{describe_norms(outliers, rnd.norms)} are over server.update_norm_factor = "
            f"{factor:g} times the median L2 norm {median:.4g} of the attempt's "
            f"{len(rnd.norms)} updates: dropped (left out of the round's later attempts)"
        )

    def _aggregator(self) -> Aggregator:
        """A plain attempt's aggregator: the DP one (central noise), or the streaming mean."""
        dp = self.privacy.make_aggregator(self.model.specs) if self.privacy else None
        return dp if dp is not None else StreamingMean(self.model.specs)

    def _hold(self, rnd: Attempt, online: list[str]) -> str:
        """Post ``rnd`` on the board and wait until it ends; return a secure abort's reason.

        Members drawn while offline (a fixed-size cohort under DP is drawn from the enrolled
        clients), or left out of the round (their update was dropped), drop out at once. When
        the attempt ends, its attendance calls are answered and uploads still streaming are
        cancelled: too late to count, they free their slots.
        """
        board = self.board
        with board.cv:
            gone = dict.fromkeys(set(rnd.cohort) - set(online), "offline when the cohort was drawn")
            for c in set(rnd.cohort) & self.membership.left_out_of(rnd.number):
                gone.setdefault(c, "left out of the round: its update was dropped")
            for c, why in sorted(gone.items()):
                rnd.failed[c] = why
                if rnd.secure is not None:
                    rnd.secure.mark_gone(c)
            board.current = rnd
            board.cv.notify_all()
            cohort = list(rnd.cohort)
            log.info("round %d (%s) started with cohort %s", rnd.number, rnd.kind.value, cohort)
            secure_error = ""
            while not board.stopping and rnd.pending and board.clock() < rnd.deadline:
                aborted = self.relay.close_ready_key_stage(rnd)
                if aborted is not None:
                    secure_error = aborted
                    break
                self.uploads.cancel_idle(rnd)
                board.cv.wait(timeout=0.25)
            if rnd.secure is not None and not secure_error and not board.stopping:
                secure_error = self.relay.unmask(rnd)
            board.current = None
            rnd.wake_attendants()  # their round is over: answer them
            for flow in rnd.streaming.values():  # too late to count: free the slots
                flow.cancel()
            board.cv.notify_all()
        return secure_error

    def mean_update(self, rnd: Attempt) -> Tensors:
        """The attempt's aggregate update (from the unmasked sum, or the aggregator)."""
        if rnd.secure is not None:
            return self.relay.mean(rnd)
        if rnd.aggregator is None:  # pragma: no cover - TRAIN rounds always aggregate
            raise RoundAborted("no aggregator")
        return rnd.aggregator.mean()
