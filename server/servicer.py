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


class FlSecureServicer(pb_grpc.FlSecureServicer):
    """Moves messages between gRPC and the :class:`~server.coordinator.Coordinator`."""

    def __init__(self, coordinator: Coordinator, authenticate: Authenticator) -> None:
        self.coordinator = coordinator
        self.authenticate = authenticate

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
                self.coordinator.record_failure(client_id, int(first.header.round), str(exc))
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
            self.coordinator.record_failure(client_id, round_, str(exc))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.SecAggMessage(
            round=request.round, nonce=request.nonce, stage=request.stage, payload=payload
        )
