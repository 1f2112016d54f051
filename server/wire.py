"""The servicer's methods on a gRPC server, with request parsing that cannot flood the log.

The generated ``add_FlSecureServicer_to_server`` parses each request with the message's
``FromString``; a message that does not parse makes grpcio log a multi-line traceback
("Exception deserializing message!") before the handler is even called, so any peer with a
CA-signed certificate could fill the operator's log. Here a message that does not parse
becomes an :class:`Undecodable` the handler refuses, with one rate-limited line
(:class:`fl_secure.logsafe.RefusalLog`) naming the authenticated client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from fl_secure.errors import ProtocolError
from fl_secure.logsafe import safe
from fl_secure.v1 import transport_pb2 as pb

SERVICE = "fl_secure.v1.FlSecure"

M = TypeVar("M")


class Undecodable:
    """A request message that did not parse, and why (what a lenient parser returns)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error

    def __str__(self) -> str:
        return f"the message could not be decoded ({self.error})"


def lenient(parse: Callable[[bytes], M]) -> Callable[[bytes], M | Undecodable]:
    """``parse``, returning an :class:`Undecodable` instead of raising."""

    def deserialize(data: bytes) -> M | Undecodable:
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the peer's message
            return Undecodable(safe(f"{type(exc).__name__}: {exc}", 200))

    return deserialize


def decoded(messages: Iterator[M | Undecodable]) -> Iterator[M]:
    """A request stream's messages; one that did not parse ends it with a ProtocolError."""
    for message in messages:
        if isinstance(message, Undecodable):
            raise ProtocolError(str(message))
        yield message


def add_servicer(server: grpc.Server, servicer: Any) -> None:
    """Register ``servicer``'s five methods on ``server`` with lenient request parsing."""
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            servicer.Join,
            request_deserializer=lenient(pb.JoinRequest.FromString),
            response_serializer=pb.JoinReply.SerializeToString,
        ),
        "PollTask": grpc.unary_unary_rpc_method_handler(
            servicer.PollTask,
            request_deserializer=lenient(pb.PollRequest.FromString),
            response_serializer=pb.Task.SerializeToString,
        ),
        "GetParameters": grpc.unary_stream_rpc_method_handler(
            servicer.GetParameters,
            request_deserializer=lenient(pb.ParametersRequest.FromString),
            response_serializer=pb.ParameterChunk.SerializeToString,
        ),
        "SubmitUpdate": grpc.stream_unary_rpc_method_handler(
            servicer.SubmitUpdate,
            request_deserializer=lenient(pb.UpdateChunk.FromString),
            response_serializer=pb.SubmitReply.SerializeToString,
        ),
        "SecAggExchange": grpc.unary_unary_rpc_method_handler(
            servicer.SecAggExchange,
            request_deserializer=lenient(pb.SecAggMessage.FromString),
            response_serializer=pb.SecAggMessage.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
