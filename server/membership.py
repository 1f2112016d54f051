"""Who takes part: enrolled clients, who is online, what each stated, how cohorts are drawn."""

from __future__ import annotations

import logging
import math
import secrets
from typing import TYPE_CHECKING

from fl_secure import __version__
from fl_secure.errors import RoundAborted
from fl_secure.logsafe import safe
from fl_secure.messages import JoinReply, TaskKind
from server.influence import weight_cap

if TYPE_CHECKING:
    from privacy.server_round import ServerPrivacy
    from server.attempt import RoundBoard
    from server.settings import CoordinatorSettings

log = logging.getLogger(__name__)


class Membership:
    """The run's clients as the server knows them (its state is guarded by the board's cv)."""

    def __init__(
        self,
        board: RoundBoard,
        settings: CoordinatorSettings,
        enrolled: set[str],
        privacy: ServerPrivacy | None = None,
    ) -> None:
        self.board = board
        self.settings = settings
        self.enrolled = set(enrolled)
        self.privacy = privacy
        self._last_seen: dict[str, float] = {}
        self._examples: dict[str, int] = {}
        self._rng = secrets.SystemRandom()  # cohort sampling is privacy-relevant (amplification)
        #: Clients that declined a round's task (their own policy): not drawn again for it.
        self._declined: dict[int, set[str]] = {}
        #: Clients whose update of a round was dropped (server.influence): left out of it.
        self._left_out: dict[int, set[str]] = {}

    def join(self, client_id: str, num_examples: int) -> JoinReply:
        """Register a client as online (identity already checked by mTLS + enrollment)."""
        with self.board.cv:
            self._last_seen[client_id] = self.board.clock()
            self._examples[client_id] = num_examples
            self.board.cv.notify_all()
        log.info("client %s joined (%d examples)", safe(client_id), num_examples)
        return JoinReply(
            client_id=client_id,
            run_id=self.settings.run_id,
            software_version=__version__,
            run_config_toml=self.settings.run_config_toml,
        )

    def heard_from(self, client_id: str) -> None:
        """``client_id`` is online now (under the board's cv)."""
        self._last_seen[client_id] = self.board.clock()

    def went_offline(self, client_id: str) -> None:
        """``client_id``'s connection closed mid-round: offline until it is heard from again.

        Its secure round's attendance call closed (its process or its link died). Seen last
        "long ago", it is neither drawn into the next cohort, whose key stage would wait a
        whole ``stage_timeout`` for it, nor awaited before one; its next call brings it back.
        """
        if client_id in self._last_seen:
            self._last_seen[client_id] = -math.inf

    def reported_examples(self) -> dict[str, int]:
        """Example count each client that joined reported at join (its weight's basis)."""
        with self.board.cv:
            return dict(sorted(self._examples.items()))

    def stated_examples(self, client_id: str) -> int:
        """The training images ``client_id`` stated at join (0 if it did not)."""
        return self._examples.get(client_id, 0)

    def online_clients(self) -> list[str]:
        """Enrolled clients heard of within ``online_timeout``."""
        now = self.board.clock()
        return sorted(
            c
            for c, t in self._last_seen.items()
            if c in self.enrolled and now - t <= self.settings.online_timeout
        )

    def decline(self, number: int, client_id: str) -> None:
        """``client_id`` declined round ``number``'s task: not drawn again for that round."""
        self._declined.setdefault(number, set()).add(client_id)

    def leave_out(self, number: int, clients: list[str]) -> None:
        """Round ``number``'s later attempts go on without ``clients``.

        Their updates were dropped (:mod:`server.influence`). They are not drawn again, and
        where a draw is from every enrolled client (fixed-size cohorts under client-level DP)
        one drawn all the same fails at once (:meth:`left_out_of`).
        """
        self._left_out.setdefault(number, set()).update(clients)

    def left_out_of(self, number: int) -> set[str]:
        """The clients whose update of round ``number`` was dropped (:meth:`leave_out`)."""
        return set(self._left_out.get(number, set()))

    def weight_cap(self) -> float:
        """The most one plain update may weigh now (:func:`server.influence.weight_cap`)."""
        s = self.settings
        with self.board.cv:
            stated = [n for c, n in self._examples.items() if c in self.enrolled]
        return weight_cap(stated, s.max_examples, s.examples_factor)

    def candidates(self, number: int, online: list[str]) -> list[str]:
        """The online clients that did not decline round ``number``, nor were left out of it."""
        declined = self._declined.get(number, set()) | self._left_out.get(number, set())
        return [c for c in online if c not in declined]

    def sample_cohort(self, online: list[str], kind: TaskKind = TaskKind.TRAIN) -> list[str]:
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

    def wait_for_clients(self, needed: int) -> list[str]:
        """Wait until every enrolled client is online, or the timeout with >= needed.

        A client that was seen and then went silent for longer than ``online_timeout`` is
        not waited for (it died; waiting the full timeout every round would stall the run);
        one never seen yet is, until the timeout.

        Raises:
            RoundAborted: Fewer than ``needed`` came online in twice the round timeout, or
                the run was asked to stop.
        """
        board, timeout = self.board, self.settings.round_timeout
        deadline = board.clock() + timeout
        with board.cv:
            while not board.stopping:
                online = self.online_clients()
                now = board.clock()
                gone = {
                    c for c, t in self._last_seen.items() if now - t > self.settings.online_timeout
                }
                awaited = self.enrolled - gone
                if len(online) >= len(awaited) or (len(online) >= needed and now >= deadline):
                    if len(online) >= needed:
                        return online
                if board.clock() >= deadline + timeout:
                    break
                board.cv.wait(timeout=0.25)
        raise RoundAborted(f"fewer than {needed} clients came online")

    def wait_clients_finished(self, timeout: float) -> None:
        """After the run, give polling clients time to hear FINISHED."""
        board = self.board
        end = board.clock() + timeout
        with board.cv:
            while board.clock() < end:
                now = board.clock()
                active = [c for c, t in self._last_seen.items() if now - t < 1.0]
                if not active:
                    return
                board.cv.wait(timeout=0.25)
