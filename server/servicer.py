"""Thin gRPC servicer: identity from the TLS certificate, messages in and out of the coordinator.

Every refusal names its reason; a bad message from one client (wrong digest, shape, dtype,
NaN/Inf, oversize, a message that does not parse) is answered with ``INVALID_ARGUMENT`` and
the round goes on for the others. Refusals are logged one line per client per interval, with
client-chosen text escaped (:class:`fl_secure.logsafe.RefusalLog`): no peer floods or forges
the operator's log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc

from fl_secure import serde
from fl_secure.errors import FlSecureError, ProtocolError, RoundAborted
from fl_secure.logsafe import RefusalLog, safe
from fl_secure.v1 import transport_pb2 as pb
from fl_secure.v1 import transport_pb2_grpc as pb_grpc
from privacy.secagg.stages import FROM_WIRE
from server.wire import Undecodable, decoded

if TYPE_CHECKING:
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
    """Counts each client's running handlers and refuses one past :data:`MAX_CALLS_PER_CLIENT`.

    A handler holds its place from the moment it is admitted until it returns, not until the
    call ends: a client that cancels its calls (its long polls, say) leaves their handlers
    running on the server's threads until they return, so counting calls would let it hold
    more threads than its share.
    """

    def __init__(
        self,
        authenticate: Authenticator,
        limit: int = MAX_CALLS_PER_CLIENT,
        refusals: RefusalLog | None = None,
    ) -> None:
        self._authenticate = authenticate
        self._limit = limit
        self.refusals = refusals or RefusalLog(log)
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def admit(self, context: grpc.ServicerContext) -> Iterator[str]:
        """Authenticate the call and count its handler while the block runs (or abort it)."""
        client_id = self._authenticate(context)
        with self._lock:
            count = self._open.get(client_id, 0)
            if count < self._limit:
                self._open[client_id] = count + 1
        if count >= self._limit:
            self.refusals.warn(
                client_id, "client %s has %d calls running; refusing another", client_id, count
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {client_id} already has {count} calls open (the limit)",
            )
        try:
            yield client_id
        finally:
            self._closed(client_id)

    def _closed(self, client_id: str) -> None:
        with self._lock:
            left = self._open.get(client_id, 1) - 1
            if left > 0:
                self._open[client_id] = left
            else:
                self._open.pop(client_id, None)

    def open_calls(self, client_id: str) -> int:
        """How many handlers of ``client_id`` run now."""
        with self._lock:
            return self._open.get(client_id, 0)


class FlSecureServicer(pb_grpc.FlSecureServicer):
    """Moves messages between gRPC and the :class:`~server.coordinator.Coordinator`."""

    def __init__(self, coordinator: Coordinator, authenticate: Authenticator) -> None:
        self.coordinator = coordinator
        #: Refusals: one line per client per interval, client-chosen text escaped.
        self.refusals = RefusalLog(log)
        self.limiter = CallLimiter(authenticate, refusals=self.refusals)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:  # noqa: N802
        """Register the calling client."""
        with self.limiter.admit(context) as client_id:
            self._refuse_undecodable(client_id, request, context)
            return self._join(client_id, request)

    def PollTask(self, request: pb.PollRequest, context: grpc.ServicerContext) -> pb.Task:  # noqa: N802
        """Long poll for the caller's next task."""
        with self.limiter.admit(context) as client_id:
            self._refuse_undecodable(client_id, request, context)
            return self._poll(client_id, request)

    def GetParameters(  # noqa: N802
        self, request: pb.ParametersRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ParameterChunk]:
        """Stream the global shared parameters to a cohort member."""
        with self.limiter.admit(context) as client_id:  # held until the stream is done
            self._refuse_undecodable(client_id, request, context)
            yield from self._parameters(client_id, request, context)

    def SubmitUpdate(  # noqa: N802
        self, request_iterator: Iterator[pb.UpdateChunk], context: grpc.ServicerContext
    ) -> pb.SubmitReply:
        """Receive, validate and aggregate one client's update."""
        with self.limiter.admit(context) as client_id:
            return self._submit(client_id, decoded(request_iterator), context)

    def SecAggExchange(  # noqa: N802
        self, request: pb.SecAggMessage, context: grpc.ServicerContext
    ) -> pb.SecAggMessage:
        """One secure-aggregation stage; answers when the stage has closed for the cohort."""
        with self.limiter.admit(context) as client_id:
            self._refuse_undecodable(client_id, request, context)
            return self._secagg(client_id, request, context)

    def _refuse_undecodable(
        self, client_id: str, request: object, context: grpc.ServicerContext
    ) -> None:
        """Abort the call if its request did not parse (one log line per client per interval)."""
        if isinstance(request, Undecodable):
            self.refusals.warn(client_id, "message from %s refused: %s", client_id, str(request))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))

    def _join(self, client_id: str, request: pb.JoinRequest) -> pb.JoinReply:
        reply = self.coordinator.join(client_id, int(request.num_examples))
        return serde.join_reply_to_proto(reply)

    def _poll(self, client_id: str, request: pb.PollRequest) -> pb.Task:
        task = self.coordinator.poll(client_id, int(request.last_round))
        return serde.task_to_proto(task)

    def _parameters(
        self, client_id: str, request: pb.ParametersRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ParameterChunk]:
        try:
            version, params = self.coordinator.parameters(
                client_id, int(request.round), bytes(request.nonce)
            )
        except ProtocolError as exc:
            self.refusals.warn(client_id, "GetParameters from %s refused: %s", client_id, str(exc))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        yield from serde.parameters_to_chunks(version, params)

    def _submit(
        self,
        client_id: str,
        request_iterator: Iterator[pb.UpdateChunk],
        context: grpc.ServicerContext,
    ) -> pb.SubmitReply:
        first: pb.UpdateChunk | None = None
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise ProtocolError("an update stream must start with its header")
            header = serde.update_header_from_proto(first.header)
            ticket = self.coordinator.open_upload(client_id, header, cancel=context.cancel)
        except ProtocolError as exc:
            self.refusals.warn(client_id, "update from %s refused: %s", client_id, str(exc))
            if first is not None and first.WhichOneof("kind") == "header":
                head = first.header
                self.coordinator.record_failure(client_id, int(head.round), head.nonce, str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # a server fault on this header: this client alone is refused
            log.exception("update header from %s could not be checked", safe(client_id))
            why = f"the server could not check this update's header ({type(exc).__name__})"
            if first is not None and first.WhichOneof("kind") == "header":
                head = first.header
                self.coordinator.record_failure(client_id, int(head.round), head.nonce, why)
            context.abort(grpc.StatusCode.INTERNAL, why)
        error: str | None = None
        try:
            reader = serde.TensorStreamReader(ticket.expected, max_bytes=ticket.max_bytes)
            for chunk in request_iterator:
                reader.feed(chunk)
                data = len(chunk.data) if chunk.WhichOneof("kind") == "data" else 0
                self.coordinator.upload_progress(ticket, data)
            tensors = reader.finish()
            self.coordinator.commit_upload(ticket, tensors)
        except FlSecureError as exc:  # a bad upload, or its secure round aborted meanwhile
            error = str(exc)
        except grpc.RpcError:  # cancelled: it stalled, or its round ended first
            error = "upload cancelled before it completed (it stalled, or its round ended)"
            self.refusals.warn(
                client_id, "update from %s in round %d: %s", client_id, header.round, error
            )
            raise
        finally:
            self.coordinator.release_upload(ticket, error)
        if error is not None:
            self.refusals.warn(
                client_id, "update from %s in round %d rejected: %s", client_id, header.round, error
            )
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        return pb.SubmitReply(accepted=True, message=f"round {header.round} update accepted")

    def _secagg(
        self, client_id: str, request: pb.SecAggMessage, context: grpc.ServicerContext
    ) -> pb.SecAggMessage:
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
        if request.stage not in FROM_WIRE:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown secure-aggregation stage {int(request.stage)}",
            )
        stage = FROM_WIRE[int(request.stage)]  # privacy.secagg.stages numbers them otherwise
        try:
            payload = self.coordinator.secagg_exchange(
                client_id, round_, nonce, stage, bytes(request.payload)
            )
        except RoundAborted as exc:
            context.abort(grpc.StatusCode.ABORTED, str(exc))
        except FlSecureError as exc:  # malformed, unsigned, out of order: this client drops
            self.refusals.warn(
                client_id, "secure aggregation message from %s refused: %s", client_id, str(exc)
            )
            self.coordinator.record_failure(client_id, round_, nonce, str(exc))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.SecAggMessage(
            round=request.round, nonce=request.nonce, stage=request.stage, payload=payload
        )
