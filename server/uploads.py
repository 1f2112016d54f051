"""Upload admission: header checks, a bounded number of slots, stalls, and the fold-in.

Server memory is bounded by the slots: at most ``max_concurrent_uploads`` updates stream at
once, each checked against what its header may announce before a byte of it is read. A slot
is kept by delivering bytes, not messages: an upload that sends no tensor bytes for
``upload_idle_timeout``, or fewer than ``upload_min_rate`` bytes/s over a window of that
length, is cancelled and its client named as the cause, so neither a stalled nor a trickling
client (an empty chunk every few seconds) can hold a slot the others need. A slot is thus
held for at most ``upload_idle_timeout + max_bytes / upload_min_rate`` seconds. The bytes
that arrive must be the ``total_bytes`` the header announced, no more and no fewer. A
complete, validated update is folded into the open
attempt at once (its aggregate, or its secure sum); the head of a ``server-sees-heads``
upload is kept apart (:meth:`server.round.RoundState.split_upload`). A plain update's norm and
weight are bounded by the server's policy first (:mod:`server.influence`).
"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import TYPE_CHECKING

import numpy as np

from fl_secure.errors import ProtocolError
from fl_secure.logsafe import safe
from fl_secure.messages import TaskKind, TensorSpec, UpdateHeader
from fl_secure.serde import quoted_name
from privacy.site_figures import released_header
from server.attempt import Attempt, RoundBoard, UploadFlow, UploadTicket
from server.influence import norm_refusal, update_norm
from server.round import RoundState, update_weight

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from privacy.server_round import ServerPrivacy
    from server.membership import Membership
    from server.settings import CoordinatorSettings

log = logging.getLogger(__name__)


#: Metric names a client reports that are rates (a TAR, an accuracy, an AUC, an EER): a value
#: outside [0, 1] is not a measurement, whatever a client's own evaluation code says.
RATE_PREFIXES = ("tar_at_far_", "roc_tar_at_far_", "rank1", "roc_auc", "eer")
RATE_SUFFIXES = ("accuracy",)


def check_reported_rates(metrics: Mapping[str, float]) -> None:
    """Refuse a self-reported rate outside [0, 1] (it would skew the run's per-client figures).

    Raises:
        ProtocolError: Naming the metric and its value.
    """
    for name, value in metrics.items():
        rate = name.startswith(RATE_PREFIXES) or name.endswith(RATE_SUFFIXES)
        if rate and not 0.0 <= value <= 1.0:
            raise ProtocolError(f"metric {quoted_name(name)} = {value:g} is a rate outside [0, 1]")


class UploadDesk:
    """Admits, times and folds in the updates of the open attempt."""

    def __init__(
        self,
        board: RoundBoard,
        settings: CoordinatorSettings,
        model: RoundState,
        membership: Membership,
        privacy: ServerPrivacy | None = None,
    ) -> None:
        self.board = board
        self.settings = settings
        self.model = model
        self.membership = membership
        self.privacy = privacy
        self._slots = threading.BoundedSemaphore(settings.max_concurrent_uploads)

    def open(
        self, client_id: str, header: UpdateHeader, cancel: Callable[[], None] | None = None
    ) -> UploadTicket:
        """Check an update header and take an upload slot (bounded server memory).

        ``cancel`` ends the upload's call: the attempt calls it when the upload stalls or
        trickles (:meth:`cancel_idle`) or the attempt ends first.

        Raises:
            ProtocolError: The header is refused, or no slot freed before the deadline.
        """
        board = self.board
        with board.cv:
            rnd = board.member(client_id, header.round, header.nonce)
            expected, max_bytes = self._admit(rnd, client_id, header)
            rnd.uploading.add(client_id)
        if not self._slots.acquire(timeout=max(0.0, rnd.deadline - board.clock())):
            with board.cv:
                rnd.uploading.discard(client_id)
            raise ProtocolError("round deadline passed while waiting for an upload slot")
        with board.cv:
            if board.current is not rnd or client_id not in rnd.uploading:
                # the round ended while this upload waited for a slot: no one would cancel
                # it or free its slot if it stalled now
                self._slots.release()
                raise ProtocolError(f"round {rnd.number} closed before the upload could start")
            if cancel is not None:
                now = board.clock()
                rnd.streaming[client_id] = UploadFlow(cancel, now, now, header.total_bytes)
        return UploadTicket(client_id, header.round, header, expected, max_bytes)

    def _admit(
        self, rnd: Attempt, client_id: str, header: UpdateHeader
    ) -> tuple[list[TensorSpec], int]:
        """The tensors ``header`` must announce and its byte limit, or why it is refused."""
        if client_id not in rnd.pending or client_id in rnd.uploading:
            raise ProtocolError(f"client {client_id} already submitted in round {rnd.number}")
        train = rnd.kind is TaskKind.TRAIN
        # an evaluation by a client without test images (every identity had a single
        # image) scores nothing: 0 is its honest count; a training update needs examples
        if header.num_examples < 0 or (train and header.num_examples == 0):
            raise ProtocolError(
                f"num_examples must be {'positive' if train else '>= 0'}, got {header.num_examples}"
            )
        check_reported_rates(header.metrics)
        if train and self.privacy is not None:  # before aggregation, not in the ledger
            self.privacy.check_upload_metrics(client_id, header.metrics, self.settings.training)
        stated = self.membership.stated_examples(client_id)
        if train and self.privacy is None and 0 < stated < header.num_examples:
            raise ProtocolError(  # without DP the count is the update's weight in the mean
                f"num_examples = {header.num_examples} is more than the {stated} training "
                f"images client {client_id} stated at join"
            )
        expected = self.model.specs if train else []
        if train and rnd.secure is not None:
            expected = rnd.secure.upload_specs
        model_bytes = sum(s.num_bytes for s in expected)
        if train and rnd.secure is not None:
            model_bytes = rnd.secure.max_upload_bytes
        if train and rnd.secure is None and self.settings.head_specs:  # FedGC: then W_k
            head_specs, head_bytes = self.model.head_expectation(client_id)
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
        return expected, max_bytes

    def progress(self, ticket: UploadTicket, num_bytes: int) -> None:
        """``num_bytes`` tensor bytes of ``ticket``'s upload arrived (0: a message without any).

        Only bytes count: a message that carries none (an empty data chunk) neither resets
        the idle time nor adds to the rate window.

        Raises:
            ProtocolError: The upload sent more bytes than its header announced.
        """
        if num_bytes <= 0:
            return
        with self.board.cv:
            rnd = self.board.current
            flow = rnd.streaming.get(ticket.client_id) if rnd is not None else None
            if rnd is None or flow is None or not rnd.owns(ticket):
                return
            flow.last_data = self.board.clock()
            flow.window_bytes += num_bytes
            flow.received += num_bytes
            if flow.received > flow.announced:
                raise ProtocolError(
                    f"upload sends more than the {flow.announced} bytes (total_bytes) its "
                    "header announced"
                )

    def cancel_idle(self, rnd: Attempt) -> None:
        """Cancel the uploads that stall or trickle, naming the client (under the cv).

        Stalled: no tensor bytes for ``upload_idle_timeout``. Trickling: fewer than
        ``upload_min_rate * upload_idle_timeout`` bytes in a window of ``upload_idle_timeout``
        seconds while announced bytes are still missing.
        """
        window, rate = self.settings.upload_idle_timeout, self.settings.upload_min_rate
        now = self.board.clock()
        for client, flow in list(rnd.streaming.items()):
            if client in rnd.received:  # committed; its slot is being freed
                continue
            reason = ""
            if now - flow.last_data > window:
                reason = f"upload stalled: no data for {window:g} s"
            elif now - flow.window_start > window:
                if flow.received < flow.announced and flow.window_bytes < rate * window:
                    reason = (
                        f"upload too slow: {flow.window_bytes} bytes in {window:g} s, below "
                        f"the minimum of {rate:g} bytes/s (server.upload_min_rate)"
                    )
                flow.window_start, flow.window_bytes = now, 0
            if reason:
                del rnd.streaming[client]
                rnd.uploading.discard(client)
                rnd.failed.setdefault(client, reason)
                log.warning(
                    "round %d: upload of %s cancelled: %s", rnd.number, safe(client), reason
                )
                flow.cancel()

    def commit(self, ticket: UploadTicket, tensors: Mapping[str, np.ndarray]) -> None:
        """Fold a fully validated update into the attempt's aggregate (or secure sum).

        Raises:
            ProtocolError: The attempt closed first, or a head does not fit.
        """
        board = self.board
        with board.cv:
            rnd = board.current
            if rnd is None or not rnd.owns(ticket) or ticket.client_id not in rnd.pending:
                raise ProtocolError(f"round {ticket.round} closed before the upload completed")
            got = sum(int(a.nbytes) for a in tensors.values())
            if got != ticket.header.total_bytes:
                raise ProtocolError(
                    f"upload header announced total_bytes = {ticket.header.total_bytes}, its "
                    f"tensors have {got} bytes"
                )
            if rnd.secure is not None:
                (vector,) = tensors.values()  # the upload spec names the one tensor
                rnd.secure.add_masked(ticket.client_id, np.asarray(vector))
            elif rnd.aggregator is not None:
                shared, head = self.model.split_upload(ticket.client_id, tensors)
                norm = update_norm(shared)
                refusal = norm_refusal(ticket.client_id, norm, self.settings.max_update_norm)
                if refusal:
                    raise ProtocolError(refusal)
                weight = self._weight(rnd, ticket)
                if head:
                    rnd.heads[ticket.client_id] = head
                rnd.aggregator.add(shared, weight)
                rnd.norms[ticket.client_id] = norm
            header = ticket.header
            if self.privacy is not None:
                # recorded as a private site may send it: an older client's count, schedule
                # or time stays out of metrics.jsonl and the summary (privacy.site_figures)
                header = released_header(
                    header, unit=self.privacy.unit, train=rnd.kind is TaskKind.TRAIN
                )
            rnd.received[ticket.client_id] = header
            self.membership.heard_from(ticket.client_id)
            board.cv.notify_all()

    def _weight(self, rnd: Attempt, ticket: UploadTicket) -> float:
        """An update's weight in the mean: its example count within the attempt's cap.

        The count was checked against the client's statement at join (:meth:`_admit`); the
        cap is the server's own (:func:`server.influence.weight_cap`). Under DP every update
        weighs 1 (:func:`server.round.update_weight`).
        """
        private = self.privacy is not None
        claimed = ticket.header.num_examples
        if private or claimed <= rnd.weight_cap:
            return update_weight(claimed, private=private)
        rnd.capped[ticket.client_id] = rnd.weight_cap
        return update_weight(rnd.weight_cap, private=False)

    def release(self, ticket: UploadTicket, error: str | None = None) -> None:
        """Free the upload slot; record a failed upload (the round goes on without it)."""
        self._slots.release()
        with self.board.cv:
            rnd = self.board.current
            if rnd is not None and rnd.owns(ticket):
                rnd.streaming.pop(ticket.client_id, None)
                rnd.uploading.discard(ticket.client_id)
                if error is not None and ticket.client_id not in rnd.received:
                    rnd.failed.setdefault(ticket.client_id, error)
            self.board.cv.notify_all()

    def record_failure(self, client_id: str, round_: int, nonce: bytes, error: str) -> None:
        """A cohort member's upload was refused: the round goes on without it.

        Only a message of the open attempt (its nonce) counts: a straggler's late message of
        a failed attempt must not cost it the retry that exists for it.
        """
        with self.board.cv:
            rnd = self.board.current
            if rnd is None or rnd.number != round_:
                return
            if not secrets.compare_digest(rnd.cohort.get(client_id, b""), nonce):
                return
            if rnd.fail(client_id, error):
                self.board.cv.notify_all()
