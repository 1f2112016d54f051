"""What the server saw, accounted: the privacy decisions a round's attempts call for.

Under client-level DP with ``local`` or ``distributed`` noise the guarantee covers the server's
view, so whatever an attempt showed the server is a release, whether or not the round then
completes: updates received by an attempt that fails, a sum unmasked and then discarded, the
sum of a round refused as diverged, what a stopped attempt saw. Each is composed like a round
(ledger kind ``discarded_sum``, :meth:`privacy.server_round.ServerPrivacy.discard_sum`) before the
run moves on. Without DP every method here does nothing.

The budget (``privacy.target_epsilon``) is therefore held before every training attempt, not
once a round: :meth:`ReleaseAccounting.check_budget` before a round's first attempt and again
before each retry, which would release the round once more on top of the failed attempts'
discarded sums. An attempt that would pass the budget is not started; the run stops
(:class:`BudgetStop`, status ``budget_exhausted``, a ``note`` in the ledger).
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from fl_secure.errors import RoundAborted
from fl_secure.messages import TaskKind

if TYPE_CHECKING:
    from privacy.server_round import ServerPrivacy
    from server.attempt import Attempt

log = logging.getLogger(__name__)


class BudgetStop(RoundAborted):
    """The next training attempt would pass the privacy budget: the run stops before it."""


class ReleaseAccounting:
    """The coordinator's side of the privacy ledger: releases, budget stops, round rows."""

    def __init__(self, privacy: ServerPrivacy | None) -> None:
        self.privacy = privacy
        self._composed = 0  # releases composed through this object (rounds, discarded sums)
        self._passed: tuple[int, int] | None = None  # (round, _composed) of the last pass

    def begin_attempt(self, number: int, attempt: int, kind: TaskKind, cohort_size: int) -> None:
        """Before any task of a training attempt goes out (and a secure round's clocks start)."""
        if kind is TaskKind.TRAIN and self.privacy is not None:
            self.privacy.begin_release(number, attempt, cohort_size)

    def end_attempt(self) -> None:
        """The last attempt ended and what it showed is accounted (or was nothing)."""
        if self.privacy is not None:
            self.privacy.end_release()

    def check_budget(self, number: int, attempt: int) -> None:
        """Before attempt ``attempt`` of round ``number``: stop if it would pass the budget.

        Called before every attempt that may release the round (its first and each retry).
        A retry after an attempt that released nothing (no update reached the server) is not
        computed again: the accountant's state is the one that passed.

        Raises:
            BudgetStop: Naming the epsilon the attempt would bring and the target; the reason
                is noted in the ledger first.
        """
        if self.privacy is None or self._passed == (number, self._composed):
            return
        reason = self.privacy.budget_stop(number, attempt)
        if reason is None:
            self._passed = (number, self._composed)
            return
        log.warning("%s", reason)
        self.privacy.note(number, reason)
        raise BudgetStop(reason)

    def _discard(self, number: int, cohort: int, updates: int, attempt: int, why: str) -> bool:
        """:meth:`ServerPrivacy.discard_sum`, counted for :meth:`check_budget`."""
        assert self.privacy is not None
        counted = self.privacy.discard_sum(number, cohort, updates, attempt, why)
        self._composed += counted
        return counted

    def stopped_attempt(self, rnd: Attempt) -> None:
        """Count what an attempt showed the server before a stop ended it.

        A stop (a signal, the embedded driver) can end an attempt after the server unmasked
        its sum, or received plain updates: released all the same, and a resume runs the
        round again. Counted like any discarded sum (see :meth:`failed_attempt`).
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
            f"round {rnd.number} attempt {rnd.attempt}: the run was stopped after the server "
            f"had {'unmasked the sum' if rnd.secure is not None else 'received updates'}"
        )
        if self._discard(rnd.number, len(rnd.cohort), updates, rnd.attempt, reason):
            log.warning("%s; counted in epsilon like a round", reason)

    def failed_attempt(self, rnd: Attempt, needed: int) -> None:
        """Count the updates a failed plain attempt showed the server.

        Without secure aggregation the server sees each update as it arrives; with ``local``
        noise the guarantee covers that view, so an attempt that then fails (too few
        updates) has released them all the same, and the retry releases them again. Each
        such attempt is composed like a round (``discarded_sum``); see
        :meth:`privacy.server_round.ServerPrivacy.discard_sum` for the placements it counts.
        """
        if not rnd.received or len(rnd.received) >= needed or self.privacy is None:
            return
        number, attempt, received = rnd.number, rnd.attempt, len(rnd.received)
        reason = (
            f"round {number} attempt {attempt}: the server received {received} "
            f"update(s) and the attempt then failed (fewer than {needed})"
        )
        if self._discard(number, len(rnd.cohort), received, attempt, reason):
            log.warning("%s; counted in epsilon like a round", reason)

    def discarded_secure_sum(self, rnd: Attempt, reason: str) -> None:
        """Account and note a sum the server unmasked before the secure round failed."""
        if self.privacy is None or rnd.secure is None:
            return
        survivors = len(rnd.secure.survivors())
        if self._discard(rnd.number, len(rnd.cohort), survivors, rnd.attempt, reason):
            how = "it is counted in epsilon like a round (ledger kind discarded_sum)"
        elif self.privacy.unit == "client":
            how = "under central noise the server is trusted with it"
        else:
            how = "each client's own accountant counted its steps"
        released = "The discarded sum was released to nobody else"
        self.privacy.note(rnd.number, f"{reason}. {released}; {how}")

    def diverged(self, rnd: Attempt, reason: str) -> str:
        """Account the sum of a round refused as diverged; return the reason as noted.

        The server did see the round's updates (or their sum), so a resume that runs the
        round again composes both.
        """
        if self.privacy is None:
            return reason
        survivors = len(rnd.received)
        if self._discard(rnd.number, len(rnd.cohort), survivors, rnd.attempt, reason):
            reason += "; the server saw the round's sum, counted in epsilon like a round"
        self.privacy.note(rnd.number, reason)
        return reason

    def ledger_rows(self, rnd: Attempt, encoded: bytes) -> list[dict[str, Any]]:
        """The round's ledger rows; each names the parameters file (``encoded``) it covers."""
        if self.privacy is None:
            return []
        metrics = {c: h.metrics for c, h in rnd.received.items()}
        rows = self.privacy.round_entries(rnd.number, len(rnd.cohort), metrics, rnd.attempt)
        digest = hashlib.sha256(encoded).hexdigest()  # sha256sum of the file checks it
        for row in rows:
            row["payload"]["model_sha256"] = digest
        return rows

    def preview(self, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The round record's privacy figures, as the rows will commit them (None: no DP)."""
        return self.privacy.preview(rows) if self.privacy is not None else None

    def commit(self, number: int, rows: list[dict[str, Any]]) -> None:
        """Sync the round's ledger entry (after its checkpoint, before its model is released)."""
        if self.privacy is not None:
            self.privacy.commit(number, rows)
            self._composed += 1
