"""The only module that converts between protobuf messages and fl-secure's dataclasses.

Tensors are sent as raw little-endian bytes with dtype, shape and a SHA-256 digest, split in
data chunks of at most :data:`MAX_CHUNK_BYTES`. Readers validate every field against what is
expected (names, dtypes, shapes, sizes, digests, finite values) and raise
:class:`~fl_secure.errors.ProtocolError` naming the problem.

Every other message is a symmetric pair ``x_to_proto`` / ``x_from_proto`` of a dataclass of
:mod:`fl_secure.messages`. The module runs past 500 lines on purpose: it is the one place that
builds or reads protobuf messages, so each pair stays beside its mirror and the tensor stream
beside the headers it checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from fl_secure.errors import ProtocolError
from fl_secure.messages import (
    JoinReply,
    JoinRequest,
    LocalTraining,
    ParametersRequest,
    PollRequest,
    SecAggMessage,
    SecAggStage,
    SubmitReply,
    Task,
    TaskKind,
    Tensors,
    TensorSpec,
    UpdateHeader,
    WithdrawReason,
)
from fl_secure.v1 import transport_pb2 as pb

MAX_CHUNK_BYTES = 2 * 1024 * 1024
#: A tensor's buffer is allocated up to this size when its header arrives, then as data does.
_PREALLOCATE_BYTES = 64 * 1024 * 1024
#: An update header's metrics: at most this many, with names of at most this many characters
#: (they are stored in metrics.jsonl and summary.json every round; clients send about 15).
MAX_METRICS = 256
MAX_METRIC_NAME = 100
#: The characters of a client's tensor name quoted in an error (it reaches logs, the round's
#: record, summary.json and the report).
QUOTED_NAME_CHARS = 64


def quoted_name(name: str) -> str:
    """A client-chosen ``name`` for an error message: its first characters, as a repr.

    The repr escapes line breaks and control characters; a longer name is cut and marked.
    """
    cut = name[:QUOTED_NAME_CHARS]
    return repr(cut) + (
        f" (first {QUOTED_NAME_CHARS} of {len(name)} characters)" if cut != name else ""
    )


_DTYPES: dict[pb.DType.ValueType, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_UINT8: np.dtype("u1"),
    pb.DTYPE_BOOL: np.dtype("?"),
    pb.DTYPE_UINT64: np.dtype("<u8"),
    pb.DTYPE_UINT32: np.dtype("<u4"),
}
_DTYPE_CODES: dict[str, pb.DType.ValueType] = {
    dt.str.lstrip("<|"): code for code, dt in _DTYPES.items()
}

_TASK_KINDS: dict[TaskKind, pb.TaskKind.ValueType] = {
    TaskKind.WAIT: pb.TASK_KIND_WAIT,
    TaskKind.TRAIN: pb.TASK_KIND_TRAIN,
    TaskKind.EVALUATE: pb.TASK_KIND_EVALUATE,
    TaskKind.FINISHED: pb.TASK_KIND_FINISHED,
}
_TASK_KINDS_BACK = {v: k for k, v in _TASK_KINDS.items()}


def dtype_to_proto(dtype: np.dtype) -> pb.DType.ValueType:
    """Protobuf code of a numpy dtype (little-endian)."""
    code = _DTYPE_CODES.get(np.dtype(dtype).newbyteorder("<").str.lstrip("<|"))
    if code is None:
        allowed = ", ".join(str(d) for d in _DTYPES.values())
        raise ProtocolError(f"dtype {dtype} cannot be sent; allowed: {allowed}")
    return code


def dtype_from_proto(code: pb.DType.ValueType) -> np.dtype:
    """Numpy dtype of a protobuf code; unknown codes are a protocol error."""
    if code not in _DTYPES:
        raise ProtocolError(f"unknown dtype code {code}")
    return _DTYPES[code]


def _le_bytes(array: np.ndarray) -> memoryview:
    """Raw little-endian, C-contiguous bytes of ``array`` (no copy when already so)."""
    le = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return le.reshape(-1).view(np.uint8).data


def tensor_header(name: str, array: np.ndarray) -> pb.TensorHeader:
    """Header of one tensor, with the SHA-256 of its raw bytes."""
    raw = _le_bytes(array)
    return pb.TensorHeader(
        name=name,
        dtype=dtype_to_proto(array.dtype),
        shape=[int(s) for s in array.shape],
        num_bytes=raw.nbytes,
        sha256=hashlib.sha256(raw).digest(),
    )


def _tensor_pieces(
    tensors: Mapping[str, np.ndarray], chunk_bytes: int
) -> Iterator[pb.TensorHeader | bytes]:
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    for name, array in tensors.items():
        yield tensor_header(name, array)
        raw = _le_bytes(array)
        for start in range(0, raw.nbytes, chunk_bytes):
            yield bytes(raw[start : start + chunk_bytes])


def total_bytes(tensors: Mapping[str, np.ndarray]) -> int:
    """Number of raw bytes of all tensors."""
    return sum(int(a.nbytes) for a in tensors.values())


def parameters_to_chunks(
    round_: int, tensors: Mapping[str, np.ndarray], *, chunk_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[pb.ParameterChunk]:
    """Stream of a parameters header, then each tensor's header and data chunks."""
    yield pb.ParameterChunk(
        parameters=pb.ParametersHeader(
            round=round_, num_tensors=len(tensors), total_bytes=total_bytes(tensors)
        )
    )
    for piece in _tensor_pieces(tensors, chunk_bytes):
        if isinstance(piece, bytes):
            yield pb.ParameterChunk(data=piece)
        else:
            yield pb.ParameterChunk(tensor=piece)


def update_to_chunks(
    header: UpdateHeader, tensors: Mapping[str, np.ndarray], *, chunk_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[pb.UpdateChunk]:
    """Stream of an update header, then each tensor's header and data chunks."""
    yield pb.UpdateChunk(
        header=pb.UpdateHeader(
            round=header.round,
            nonce=header.nonce,
            num_examples=header.num_examples,
            metrics=header.metrics,
            num_tensors=len(tensors),
            total_bytes=total_bytes(tensors),
        )
    )
    for piece in _tensor_pieces(tensors, chunk_bytes):
        if isinstance(piece, bytes):
            yield pb.UpdateChunk(data=piece)
        else:
            yield pb.UpdateChunk(tensor=piece)


class TensorStreamReader:
    """Reassembles tensors from a stream of tensor headers and data chunks, validating all.

    Args:
        expected: the specs the stream must match, in order; ``None`` accepts any names,
            dtypes and shapes (used by a client reading the server's parameters).
        max_bytes: refuse a stream whose tensors add up to more than this.
        require_finite: refuse NaN or Inf in floating-point tensors.
    """

    def __init__(
        self,
        expected: Sequence[TensorSpec] | None,
        *,
        max_bytes: int,
        require_finite: bool = True,
    ) -> None:
        self._expected = list(expected) if expected is not None else None
        self._max_bytes = max_bytes
        self._require_finite = require_finite
        self._received = 0
        self._current: pb.TensorHeader | None = None
        self._buffer: bytearray | None = None
        self._declared = 0
        self._filled = 0
        self.tensors: Tensors = OrderedDict()

    def add_header(self, header: pb.TensorHeader) -> None:
        """Start a new tensor; the previous one must be complete."""
        if self._current is not None:
            raise ProtocolError(f"tensor {quoted_name(self._current.name)} is incomplete")
        index = len(self.tensors)
        dtype = dtype_from_proto(header.dtype)
        shape = tuple(int(s) for s in header.shape)
        if any(s < 0 for s in shape):
            raise ProtocolError(
                f"tensor {quoted_name(header.name)} has a negative dimension {shape}"
            )
        if self._expected is not None:
            if index >= len(self._expected):
                raise ProtocolError(f"unexpected extra tensor {quoted_name(header.name)}")
            spec = self._expected[index]
            if header.name != spec.name:
                raise ProtocolError(
                    f"tensor #{index} is {quoted_name(header.name)}, expected {spec.name!r}"
                )
            if dtype != spec.dtype.newbyteorder("<") and dtype != spec.dtype:
                raise ProtocolError(
                    f"tensor {spec.name!r} has dtype {dtype}, expected {spec.dtype}"
                )
            if not spec.fits(shape):
                raise ProtocolError(
                    f"tensor {spec.name!r} has shape {shape}, expected {spec.shape}"
                )
        elif header.name in self.tensors:
            raise ProtocolError(f"tensor {quoted_name(header.name)} sent twice")
        num_bytes = math.prod(shape) * dtype.itemsize  # exact: no int64 wrap-around
        if header.num_bytes != num_bytes:
            raise ProtocolError(
                f"tensor {quoted_name(header.name)} declares {header.num_bytes} bytes, "
                f"its shape and dtype need {num_bytes}"
            )
        if self._received + num_bytes > self._max_bytes:
            raise ProtocolError(
                f"upload exceeds the limit of {self._max_bytes} bytes at tensor "
                f"{quoted_name(header.name)}"
            )
        if len(header.sha256) != 32:
            raise ProtocolError(f"tensor {quoted_name(header.name)} has no valid SHA-256 digest")
        self._current = header
        # Allocated as the data arrives past the first 64 MiB: a header alone (a size the
        # peer declares) cannot make this process allocate memory no data backs.
        self._buffer = bytearray(min(num_bytes, _PREALLOCATE_BYTES))
        self._declared = num_bytes
        self._filled = 0
        if num_bytes == 0:
            self._finish()

    def add_data(self, data: bytes) -> None:
        """Append one data chunk to the current tensor."""
        if self._current is None or self._buffer is None:
            raise ProtocolError("data chunk outside a tensor")
        if len(data) > MAX_CHUNK_BYTES:
            raise ProtocolError(f"data chunk of {len(data)} bytes exceeds {MAX_CHUNK_BYTES}")
        end = self._filled + len(data)
        if end > self._declared:
            raise ProtocolError(
                f"tensor {quoted_name(self._current.name)} receives more bytes than declared"
            )
        if end > len(self._buffer):  # grow geometrically, never past the declared size
            grown = min(self._declared, max(end, 2 * len(self._buffer)))
            self._buffer.extend(bytes(grown - len(self._buffer)))
        self._buffer[self._filled : end] = data
        self._filled = end
        if self._filled == self._declared:
            self._finish()

    def _finish(self) -> None:
        header, buffer = self._current, self._buffer
        if header is None or buffer is None:  # pragma: no cover - guarded by callers
            raise ProtocolError("no tensor in progress")
        if hashlib.sha256(buffer).digest() != header.sha256:
            raise ProtocolError(f"tensor {quoted_name(header.name)} fails its SHA-256 digest check")
        dtype = dtype_from_proto(header.dtype)
        array = np.frombuffer(buffer, dtype=dtype).reshape(tuple(header.shape))
        if self._require_finite and dtype.kind == "f" and not np.isfinite(array).all():
            raise ProtocolError(f"tensor {quoted_name(header.name)} contains NaN or Inf")
        self.tensors[header.name] = array
        self._received += len(buffer)
        self._current, self._buffer = None, None

    def finish(self) -> Tensors:
        """Check that the stream is complete and return the tensors in order."""
        if self._current is not None:
            raise ProtocolError(f"stream ended inside tensor {quoted_name(self._current.name)}")
        if self._expected is not None and len(self.tensors) != len(self._expected):
            missing = [s.name for s in self._expected[len(self.tensors) :]]
            raise ProtocolError(f"stream ended before tensors {missing}")
        return self.tensors

    def feed(self, chunk: pb.ParameterChunk | pb.UpdateChunk) -> None:
        """Route a tensor header or data chunk of either stream type."""
        kind = chunk.WhichOneof("kind")
        if kind == "tensor":
            self.add_header(chunk.tensor)
        elif kind == "data":
            self.add_data(chunk.data)
        else:
            raise ProtocolError(f"unexpected {kind or 'empty'} message inside a tensor stream")


def parameters_from_chunks(
    chunks: Iterable[pb.ParameterChunk], *, max_bytes: int
) -> tuple[int, Tensors]:
    """Read a parameter stream; return its round and tensors."""
    iterator = iter(chunks)
    first = next(iterator, None)
    if first is None or first.WhichOneof("kind") != "parameters":
        raise ProtocolError("parameter stream must start with a parameters header")
    head = first.parameters
    if head.total_bytes > max_bytes:
        raise ProtocolError(f"parameters of {head.total_bytes} bytes exceed {max_bytes}")
    reader = TensorStreamReader(None, max_bytes=max_bytes)
    for chunk in iterator:
        reader.feed(chunk)
    tensors = reader.finish()
    if len(tensors) != head.num_tensors or total_bytes(tensors) != head.total_bytes:
        raise ProtocolError("parameter stream does not match its header")
    return int(head.round), tensors


def update_header_from_proto(msg: pb.UpdateHeader) -> UpdateHeader:
    """Dataclass of an update header, with its metrics checked for number, names, finiteness."""
    if len(msg.metrics) > MAX_METRICS:
        raise ProtocolError(f"{len(msg.metrics)} metrics exceed the limit of {MAX_METRICS}")
    long = [k[:40] + "..." for k in msg.metrics if len(k) > MAX_METRIC_NAME]
    if long:
        raise ProtocolError(f"metric names {long} exceed {MAX_METRIC_NAME} characters")
    metrics = {str(k): float(v) for k, v in msg.metrics.items()}
    bad = [k for k, v in metrics.items() if not np.isfinite(v)]
    if bad:
        raise ProtocolError(f"metrics {bad} are not finite")
    return UpdateHeader(
        round=int(msg.round),
        nonce=bytes(msg.nonce),
        num_examples=int(msg.num_examples),
        metrics=metrics,
        num_tensors=int(msg.num_tensors),
        total_bytes=int(msg.total_bytes),
    )


def update_header_to_proto(header: UpdateHeader) -> pb.UpdateHeader:
    """Protobuf of an update header."""
    return pb.UpdateHeader(
        round=header.round,
        nonce=header.nonce,
        num_examples=header.num_examples,
        metrics=header.metrics,
        num_tensors=header.num_tensors,
        total_bytes=header.total_bytes,
    )


def training_to_proto(t: LocalTraining) -> pb.LocalTraining:
    """Protobuf of local-training settings (field names are the same on both sides)."""
    return pb.LocalTraining(**dataclasses.asdict(t))


def training_from_proto(msg: pb.LocalTraining) -> LocalTraining:
    """Dataclass of local-training settings; an empty optimizer means SGD."""
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(LocalTraining)}
    values["optimizer"] = values["optimizer"] or "sgd"
    return LocalTraining(**values)


def check_training(t: LocalTraining) -> LocalTraining:
    """``t``, after checking that a run config could give it (a training task's settings).

    Raises:
        ProtocolError: a value no run config can give (non-finite or out of range).
    """
    problems = [
        what
        for ok, what in (
            (math.isfinite(t.learning_rate) and t.learning_rate >= 0, "learning_rate"),
            (math.isfinite(t.momentum) and 0 <= t.momentum < 1, "momentum"),
            (math.isfinite(t.weight_decay) and t.weight_decay >= 0, "weight_decay"),
            (t.batch_size >= 1, "batch_size"),
            (t.local_epochs >= 1 or t.local_steps >= 1, "local_epochs/local_steps"),
            (t.optimizer in ("sgd", "adam"), "optimizer"),
        )
        if not ok
    ]
    if problems:
        raise ProtocolError(f"local-training settings out of range ({', '.join(problems)}): {t}")
    return t


def task_to_proto(task: Task) -> pb.Task:
    """Protobuf of a task."""
    return pb.Task(
        kind=_TASK_KINDS[task.kind],
        round=task.round,
        nonce=task.nonce,
        algorithm=task.algorithm,
        training=training_to_proto(task.training),
        algorithm_params=task.algorithm_params,
        deadline_unix_ms=task.deadline_unix_ms,
        retry_after_ms=task.retry_after_ms,
        message=task.message,
        parameters_bytes=task.parameters_bytes,
        secagg_setup=task.secagg_setup,
        ledger_head=task.ledger_head,
    )


def task_from_proto(msg: pb.Task) -> Task:
    """Dataclass of a task; an unknown kind is a protocol error."""
    if msg.kind not in _TASK_KINDS_BACK:
        raise ProtocolError(f"unknown task kind {msg.kind}")
    return Task(
        kind=_TASK_KINDS_BACK[msg.kind],
        round=int(msg.round),
        nonce=bytes(msg.nonce),
        algorithm=msg.algorithm,
        training=check_training(training_from_proto(msg.training))
        if msg.kind == pb.TASK_KIND_TRAIN
        else training_from_proto(msg.training),
        algorithm_params={str(k): float(v) for k, v in msg.algorithm_params.items()},
        deadline_unix_ms=int(msg.deadline_unix_ms),
        retry_after_ms=int(msg.retry_after_ms),
        message=msg.message,
        parameters_bytes=int(msg.parameters_bytes),
        secagg_setup=bytes(msg.secagg_setup),
        ledger_head=bytes(msg.ledger_head),
    )


def join_request_to_proto(request: JoinRequest) -> pb.JoinRequest:
    """Protobuf of a join request."""
    return pb.JoinRequest(
        software_version=request.software_version, num_examples=request.num_examples
    )


def join_request_from_proto(msg: pb.JoinRequest) -> JoinRequest:
    """Dataclass of a join request."""
    return JoinRequest(software_version=msg.software_version, num_examples=int(msg.num_examples))


def join_reply_to_proto(reply: JoinReply) -> pb.JoinReply:
    """Protobuf of a join reply."""
    return pb.JoinReply(
        client_id=reply.client_id,
        run_id=reply.run_id,
        software_version=reply.software_version,
        run_config_toml=reply.run_config_toml,
    )


def join_reply_from_proto(msg: pb.JoinReply) -> JoinReply:
    """Dataclass of a join reply."""
    return JoinReply(
        client_id=msg.client_id,
        run_id=msg.run_id,
        software_version=msg.software_version,
        run_config_toml=msg.run_config_toml,
    )


def poll_request_to_proto(request: PollRequest) -> pb.PollRequest:
    """Protobuf of a poll for the next task."""
    return pb.PollRequest(last_round=request.last_round)


def poll_request_from_proto(msg: pb.PollRequest) -> PollRequest:
    """Dataclass of a poll for the next task."""
    return PollRequest(last_round=int(msg.last_round))


def parameters_request_to_proto(request: ParametersRequest) -> pb.ParametersRequest:
    """Protobuf of a request for a task's global parameters."""
    return pb.ParametersRequest(round=request.round, nonce=request.nonce)


def parameters_request_from_proto(msg: pb.ParametersRequest) -> ParametersRequest:
    """Dataclass of a request for a task's global parameters."""
    return ParametersRequest(round=int(msg.round), nonce=bytes(msg.nonce))


def submit_reply_to_proto(reply: SubmitReply) -> pb.SubmitReply:
    """Protobuf of the answer to an upload."""
    return pb.SubmitReply(accepted=reply.accepted, message=reply.message)


def submit_reply_from_proto(msg: pb.SubmitReply) -> SubmitReply:
    """Dataclass of the answer to an upload."""
    return SubmitReply(accepted=bool(msg.accepted), message=msg.message)


def secagg_message_to_proto(msg: SecAggMessage) -> pb.SecAggMessage:
    """Protobuf of a secure-aggregation message (the enums keep their numbers)."""
    return pb.SecAggMessage(
        round=msg.round,
        nonce=msg.nonce,
        stage=pb.SecAggStage.ValueType(int(msg.stage)),
        payload=msg.payload,
        withdraw_reason=pb.WithdrawReason.ValueType(int(msg.withdraw_reason)),
    )


def secagg_message_from_proto(msg: pb.SecAggMessage) -> SecAggMessage:
    """Dataclass of a secure-aggregation message.

    A withdrawal reason this version does not know (a newer client's) reads as none.

    Raises:
        ProtocolError: an unknown stage.
    """
    try:
        stage = SecAggStage(msg.stage)
    except ValueError:
        raise ProtocolError(f"unknown secure-aggregation stage {int(msg.stage)}") from None
    try:
        reason = WithdrawReason(msg.withdraw_reason)
    except ValueError:
        reason = WithdrawReason.UNSPECIFIED
    return SecAggMessage(
        round=int(msg.round),
        nonce=bytes(msg.nonce),
        stage=stage,
        payload=bytes(msg.payload),
        withdraw_reason=reason,
    )
