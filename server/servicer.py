"""Thin gRPC servicer: identity from the TLS certificate, messages in and out of the coordinator.

Every refusal names its reason; a bad message from one client (wrong digest, shape, dtype,
NaN/Inf, oversize) is answered with ``INVALID_ARGUMENT`` and the round goes on for the others.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import grpc

from fl_secure import serde
from fl_secure.errors import FlSecureError, ProtocolError, RoundAborted
from fl_secure.v1 import transport_pb2 as pb
from fl_secure.v1 import transport_pb2_grpc as pb_grpc
from server.coordinator import Coordinator

log = logging.getLogger(__name__)

#: Returns the authenticated, enrolled client id of a call, or aborts the call.
Authenticator = Callable[[grpc.ServicerContext], str]

#: Calls one client may have open at once. An honest client holds at most four (a secure
#: round's attendance, a stage call, the masked-input call and its upload, or a download);
#: one more for a call whose end the server has not yet seen. The server's thread pool
#: has this many workers per enrolled client, so no client can starve the others.
MAX_CALLS_PER_CLIENT = 5


class CallLimiter:
    """Counts each client's open calls and refuses one past :data:`MAX_CALLS_PER_CLIENT`."""

    def __init__(self, authenticate: Authenticator, limit: int = MAX_CALLS_PER_CLIENT) -> None:
        self._authenticate = authenticate
        self._limit = limit
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, context: grpc.ServicerContext) -> str:
        """Authenticate the call and count it until it ends (or abort it)."""
        client_id = self._authenticate(context)
        with self._lock:
            count = self._open.get(client_id, 0)
            if count < self._limit:
                self._open[client_id] = count + 1
        if count >= self._limit:
            log.warning("client %s has %d calls open; refusing another", client_id, count)
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {client_id} already has {count} calls open (the limit)",
            )
        if not context.add_callback(lambda: self._closed(client_id)):
            self._closed(client_id)  # the call already ended: its callback will never run
            context.abort(grpc.StatusCode.CANCELLED, "the call ended before it was served")
        return client_id

    def _closed(self, client_id: str) -> None:
        with self._lock:
            left = self._open.get(client_id, 1) - 1
            if left > 0:
                self._open[client_id] = left
            else:
                self._open.pop(client_id, None)

    def open_calls(self, client_id: str) -> int:
        """How many calls ``client_id`` has open now."""
        with self._lock:
            return self._open.get(client_id, 0)


class FlSecureServicer(pb_grpc.FlSecureServicer):
    """Moves messages between gRPC and the :class:`~server.coordinator.Coordinator`."""

    def __init__(self, coordinator: Coordinator, authenticate: Authenticator) -> None:
        self.coordinator = coordinator
        self.authenticate = CallLimiter(authenticate)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:  # noqa: N802
        """Register the calling client."""
        client_id = self.authenticate(context)
        reply = self.coordinator.join(client_id, int(request.num_examples))
        return serde.join_reply_to_proto(reply)

    def PollTask(self, request: pb.PollRequest, context: grpc.ServicerContext) -> pb.Task:  # noqa: N802
        """Long poll for the caller's next task."""
        client_id = self.authenticate(context)
        task = self.coordinator.poll(client_id, int(request.last_round))
        return serde.task_to_proto(task)

    def GetParameters(  # noqa: N802
        self, request: pb.ParametersRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ParameterChunk]:
        """Stream the global shared parameters to a cohort member."""
        client_id = self.authenticate(context)
        try:
            version, params = self.coordinator.parameters(
                client_id, int(request.round), bytes(request.nonce)
            )
        except ProtocolError as exc:
            log.warning("GetParameters from %s refused: %s", client_id, exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        yield from serde.parameters_to_chunks(version, params)

    def SubmitUpdate(  # noqa: N802
        self, request_iterator: Iterator[pb.UpdateChunk], context: grpc.ServicerContext
    ) -> pb.SubmitReply:
        """Receive, validate and aggregate one client's update."""
        client_id = self.authenticate(context)
        first = next(request_iterator, None)
        try:
            if first is None or first.WhichOneof("kind") != "header":
                raise ProtocolError("an update stream must start with its header")
            header = serde.update_header_from_proto(first.header)
            ticket = self.coordinator.open_upload(client_id, header, cancel=context.cancel)
        except ProtocolError as exc:
            log.warning("update from %s refused: %s", client_id, exc)
            if first is not None and first.WhichOneof("kind") == "header":
                head = first.header
                self.coordinator.record_failure(client_id, int(head.round), head.nonce, str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        error: str | None = None
        try:
            reader = serde.TensorStreamReader(ticket.expected, max_bytes=ticket.max_bytes)
            for chunk in request_iterator:
                reader.feed(chunk)
                self.coordinator.upload_progress(ticket)
            tensors = reader.finish()
            self.coordinator.commit_upload(ticket, tensors)
        except FlSecureError as exc:  # a bad upload, or its secure round aborted meanwhile
            error = str(exc)
        except grpc.RpcError:  # cancelled: it stalled, or its round ended first
            error = "upload cancelled before it completed (it stalled, or its round ended)"
            log.warning("update from %s in round %d: %s", client_id, header.round, error)
            raise
        finally:
            self.coordinator.release_upload(ticket, error)
        if error is not None:
            log.warning("update from %s in round %d rejected: %s", client_id, header.round, error)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        return pb.SubmitReply(accepted=True, message=f"round {header.round} update accepted")

    def SecAggExchange(  # noqa: N802
        self, request: pb.SecAggMessage, context: grpc.ServicerContext
    ) -> pb.SecAggMessage:
        """One secure-aggregation stage; answers when the stage has closed for the cohort."""
        client_id = self.authenticate(context)
        round_, nonce = int(request.round), bytes(request.nonce)
        if request.stage in (pb.SECAGG_STAGE_WITHDRAW, pb.SECAGG_STAGE_ATTEND):
            try:
                if request.stage == pb.SECAGG_STAGE_WITHDRAW:
                    self.coordinator.secagg_withdraw(
                        client_id, round_, nonce, int(request.withdraw_reason)
                    )
                else:  # held until the round ends; a closed call wakes its handler at once
                    wake = threading.Event()
                    context.add_callback(wake.set)
                    self.coordinator.secagg_attend(
                        client_id, round_, nonce, context.is_active, wake
                    )
            except FlSecureError as exc:  # not (or no longer) in that round, or attending
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return pb.SecAggMessage(round=request.round, nonce=request.nonce, stage=request.stage)
        if not pb.SECAGG_STAGE_ADVERTISE_KEYS <= request.stage <= pb.SECAGG_STAGE_UNMASK_REPLY:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown secure-aggregation stage {int(request.stage)}",
            )
        stage = int(request.stage) - 1  # wire stages start at 1, privacy.secagg_session at 0
        try:
            payload = self.coordinator.secagg_exchange(
                client_id, round_, nonce, stage, bytes(request.payload)
            )
        except RoundAborted as exc:
            context.abort(grpc.StatusCode.ABORTED, str(exc))
        except FlSecureError as exc:  # malformed, unsigned, out of order: this client drops
            log.warning("secure aggregation message from %s refused: %s", client_id, exc)
            self.coordinator.record_failure(client_id, round_, nonce, str(exc))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.SecAggMessage(
            round=request.round, nonce=request.nonce, stage=request.stage, payload=payload
        )
