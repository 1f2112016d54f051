"""One attempt of a round, and the board the driver and the servicer threads meet on.

A round runs in attempts: each draws a cohort, gives every member a fresh nonce, and collects
what arrives until its deadline (:mod:`server.round_attempts`). The driver thread posts the
open attempt on a :class:`RoundBoard`; servicer threads find it there, under the board's one
condition, when a client asks for its task, downloads, uploads or runs a secure stage.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fl_secure.errors import ProtocolError

if TYPE_CHECKING:
    from collections.abc import Callable

    from fl_secure.aggregation import Aggregator
    from fl_secure.messages import TaskKind, Tensors, TensorSpec, UpdateHeader
    from privacy.ckks.server_round import ServerCkksRound
    from privacy.secagg.server_round import ServerSecureRound


@dataclass(frozen=True)
class UploadTicket:
    """Permission to stream one update; holds a slot of the upload semaphore."""

    client_id: str
    round: int
    header: UpdateHeader
    expected: list[TensorSpec]
    max_bytes: int


@dataclass
class UploadFlow:
    """An upload holding a slot: how to end its call, and what it delivered when.

    ``window_start``/``window_bytes`` are the current rate window (see
    :meth:`server.uploads.UploadDesk.cancel_idle`); ``received`` counts the tensor bytes
    of the whole upload, ``announced`` is its header's ``total_bytes``.
    """

    cancel: Callable[[], None]
    last_data: float
    window_start: float
    announced: int
    window_bytes: int = 0
    received: int = 0


@dataclass
class Attempt:
    """An attempt of round ``number``: its cohort and what each member did."""

    number: int
    kind: TaskKind
    attempt: int
    cohort: dict[str, bytes]  # client id -> nonce
    deadline: float
    aggregator: Aggregator | None
    received: dict[str, UpdateHeader] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    uploading: set[str] = field(default_factory=set)
    # uploads holding a slot: client -> its call's cancel and its delivery so far
    streaming: dict[str, UploadFlow] = field(default_factory=dict)
    # open attendance calls of a secure round: client -> the event that wakes its handler
    attending: dict[str, threading.Event] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    secure: ServerSecureRound | ServerCkksRound | None = None
    heads: dict[str, Tensors] = field(default_factory=dict)  # uploaded heads (FedGC)
    # bounded client influence (server.influence), plain attempts: the most an update may
    # weigh, the L2 norm of each update folded in, and the weights that were capped
    weight_cap: float = math.inf
    norms: dict[str, float] = field(default_factory=dict)
    capped: dict[str, float] = field(default_factory=dict)

    @property
    def pending(self) -> set[str]:
        """Members whose update neither arrived nor failed yet."""
        return set(self.cohort) - set(self.received) - set(self.failed)

    def fail(self, client_id: str, reason: str) -> bool:
        """Stop waiting for ``client_id``'s update, unless it is in or arriving; True if so."""
        if client_id not in self.pending or client_id in self.uploading:
            return False
        self.failed[client_id] = reason
        return True

    def owns(self, ticket: UploadTicket) -> bool:
        """Whether ``ticket`` was issued in this attempt of its round (same nonce)."""
        return self.number == ticket.round and self.cohort.get(ticket.client_id) == (
            ticket.header.nonce
        )

    def wake_attendants(self) -> None:
        """Wake every open attendance call (the round ended, or the run stops)."""
        for wake in self.attending.values():
            wake.set()


class RoundBoard:
    """The open attempt, behind the one condition the driver and servicer threads share.

    ``cv`` guards ``current`` and everything the collaborators of the coordinator keep per
    run; it is reentrant, so a step called under it may take it again.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.cv = threading.Condition()
        self.current: Attempt | None = None
        self.finished = False  # the run is over: every poll answers FINISHED
        self.stop_reason = ""  # why the run stopped or ended ("" while it runs)
        self._stop = threading.Event()

    @property
    def stopping(self) -> bool:
        """Whether the run was asked to stop."""
        return self._stop.is_set()

    def stop(self, reason: str) -> None:
        """Ask every wait on the board to end; wake the open attempt's attendance calls."""
        self.stop_reason = reason
        self._stop.set()
        with self.cv:
            self.cv.notify_all()
            if self.current is not None:
                self.current.wake_attendants()

    def member(self, client_id: str, round_: int, nonce: bytes) -> Attempt:
        """The open attempt, if ``client_id`` holds its task of round ``round_`` (under cv).

        Raises:
            ProtocolError: The round is not open, or the client holds no task of it.
        """
        rnd = self.current
        if rnd is None or rnd.number != round_:
            raise ProtocolError(f"round {round_} is not open")
        expected = rnd.cohort.get(client_id)
        if expected is None or not secrets.compare_digest(expected, nonce):
            raise ProtocolError(f"client {client_id} holds no task of round {round_}")
        return rnd

    def secure_member(
        self, client_id: str, round_: int, nonce: bytes
    ) -> tuple[Attempt, ServerSecureRound | ServerCkksRound]:
        """The open attempt and its secure session, if ``client_id`` holds its task.

        Raises:
            ProtocolError: As :meth:`member`, or the round is not securely aggregated.
        """
        rnd = self.member(client_id, round_, nonce)
        if rnd.secure is None:
            raise ProtocolError(f"round {round_} is not securely aggregated")
        return rnd, rnd.secure
