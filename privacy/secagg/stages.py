"""A secure round over the wire: its stages, the packing of its payloads, their bookkeeping.

The coordinator and the client loop run a round through ``SecAggExchange`` and
``SubmitUpdate``, one stage at a time (:data:`ADVERTISE` ... :data:`DONE`); a client's call
carries its stage and payload and receives the server's reply (:data:`Exchange`). Payloads are
the protocol messages' own strict encodings; lists of them are packed as a ``u32`` count
followed by ``u32``-length-prefixed items (:func:`pack`, :func:`unpack`). :class:`StagedRound`
is the stage bookkeeping the server's secure rounds share (pairwise masks,
:class:`privacy.secagg.server_round.ServerSecureRound`, and CKKS,
:class:`privacy.ckks.server_round.ServerCkksRound`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted

if TYPE_CHECKING:
    from privacy.secagg.round_setup import RoundSetup

#: Name of the single tensor a masked upload carries.
MASKED_TENSOR = "secagg.masked"
#: Stages of a secure round (:class:`~privacy.secagg.server_round.ServerSecureRound`), in order.
#: CKKS rounds go from :data:`MASKED` to :data:`UNMASK` (they have no consistency check).
ADVERTISE, SHARE, MASKED, CONSISTENCY, UNMASK, DONE = range(6)
STAGE_NAMES = {ADVERTISE: "advertise keys", SHARE: "share keys", MASKED: "masked input",
               CONSISTENCY: "consistency check", UNMASK: "unmasking", DONE: "done"}  # fmt: skip
#: A stage's number on the wire (``fl_secure.v1.SecAggStage``): the consistency check was
#: added after the others, so it is numbered after them there.
WIRE_STAGES = {ADVERTISE: 1, SHARE: 2, MASKED: 3, UNMASK: 4, CONSISTENCY: 7}
FROM_WIRE = {wire: stage for stage, wire in WIRE_STAGES.items()}
_MAX_ITEMS = 100_000

#: Why a client withdrew from a secure round (``fl_secure.v1.WithdrawReason``, same numbers),
#: as the server words it. A category of the client's own failure, never data; like the
#: withdrawal itself (a dropout) it is visible to the server and not covered by DP.
#: ``WithdrawReason`` DECLINED: the site's own policy (its budget) declined the task.
DECLINED = 7
WITHDRAW_REASONS = {
    0: "",  # a client that gave no reason
    1: "local training failed",
    2: "its update was not finite or had the wrong size",
    3: "a message of the round failed its checks (malformed, out of order, or a key or "
    "share that failed verification)",
    4: "too few of its neighbours took part to reach the threshold",
    5: "a call to the server failed",
    6: "an unexpected local error",
    7: "the site's own policy declined the round, such as its privacy budget",
    8: "the consistency check failed (too few cohort members signed the survivor set it was "
    "shown, or a relayed signature did not verify): it revealed no share",
}


#: (stage, payload) -> the server's reply payload (one SecAggExchange call).
Exchange = Callable[[int, bytes], bytes]


def pack(items: Sequence[bytes]) -> bytes:
    """``u32`` count, then each item as ``u32`` length + bytes."""
    out = [struct.pack(">I", len(items))]
    for item in items:
        out += [struct.pack(">I", len(item)), item]
    return b"".join(out)


def unpack(data: bytes, what: str) -> list[bytes]:
    """Inverse of :func:`pack`; strict about lengths and trailing bytes."""
    if len(data) < 4:
        raise ProtocolError(f"{what}: truncated list")
    (count,) = struct.unpack_from(">I", data, 0)
    if count > _MAX_ITEMS:
        raise ProtocolError(f"{what}: {count} items is more than allowed")
    pos, items = 4, []
    for _ in range(count):
        if pos + 4 > len(data):
            raise ProtocolError(f"{what}: truncated list")
        (n,) = struct.unpack_from(">I", data, pos)
        pos += 4
        if pos + n > len(data):
            raise ProtocolError(f"{what}: truncated item")
        items.append(data[pos : pos + n])
        pos += n
    if pos != len(data):
        raise ProtocolError(f"{what}: {len(data) - pos} trailing bytes")
    return items


def wire_dtype(setup: RoundSetup) -> np.dtype:
    """Masked vectors travel as 32-bit words when the modulus allows (half the bytes)."""
    return np.dtype("<u4") if setup.modulus_bits <= 32 else np.dtype("<u8")


class StagedRound:
    """Stage bookkeeping shared by the server's secure rounds (masks and CKKS).

    A stage closes when everyone :meth:`expected` answered or its deadline passed; the late
    ones are recorded as dropped at that stage, a protocol failure aborts the round, and the
    next stage gets a fresh deadline. A client whose connection is known to be gone
    (:meth:`mark_gone`) is not waited for. Subclasses are dataclasses holding these attributes.
    """

    stage: int
    deadline: float
    answered: set[str]
    gone: set[str]  # clients whose connection closed: no stage waits for them
    aborted: str
    dropped: dict[str, str]  # client -> the stage it missed
    stage_timeout: float
    clock: Callable[[], float]

    def expected(self) -> set[str]:
        """Who must answer the open stage."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the open stage may close now."""
        return self.expected() - self.gone <= self.answered or self.clock() >= self.deadline

    def next_stage(self) -> int:
        """The stage that follows the open one."""
        return self.stage + 1

    def mark_gone(self, client_id: str) -> None:
        """``client_id``'s connection closed: the open and later stages stop waiting for it.

        Only the waiting ends early; what the protocol does with a missing client (recover
        its masks from the survivors' shares, or abort) is what it does at a deadline.
        """
        self.gone.add(client_id)

    def _close(self, step: Callable[[], None], what: str) -> None:
        """Record the missing as dropped, run the stage's ``step``, open the next stage."""
        for c in self.expected() - self.answered:
            self.dropped.setdefault(c, STAGE_NAMES[self.stage])
        try:
            step()
        except (RoundAborted, PrivacyError, ProtocolError) as exc:
            self.aborted = str(exc)
            raise RoundAborted(f"{what} aborted: {exc}") from exc
        self.stage = self.next_stage()
        self.answered = set()
        self.deadline = self.clock() + self.stage_timeout
