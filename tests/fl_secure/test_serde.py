"""Serde round trips and the validation of every field a peer controls."""

from collections import OrderedDict

import numpy as np
import pytest

from fl_secure import serde
from fl_secure.errors import ProtocolError
from fl_secure.messages import (
    JoinRequest,
    LocalTraining,
    ParametersRequest,
    PollRequest,
    SecAggMessage,
    SecAggStage,
    SubmitReply,
    Task,
    TaskKind,
    TensorSpec,
    UpdateHeader,
    WithdrawReason,
)
from fl_secure.v1 import transport_pb2 as pb


def _tensors() -> OrderedDict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return OrderedDict(
        [
            ("a", rng.standard_normal((3, 5)).astype(np.float32)),
            ("b", rng.standard_normal(7).astype(np.float64)),
            ("c", np.arange(12, dtype=np.int64).reshape(2, 6)),
            ("empty", np.zeros((0, 4), dtype=np.float32)),
        ]
    )


def test_parameters_round_trip_bit_exact_with_small_chunks() -> None:
    tensors = _tensors()
    chunks = list(serde.parameters_to_chunks(7, tensors, chunk_bytes=16))
    assert all(len(c.data) <= 16 for c in chunks if c.WhichOneof("kind") == "data")
    round_, back = serde.parameters_from_chunks(iter(chunks), max_bytes=10_000)
    assert round_ == 7
    assert list(back) == list(tensors)
    for k in tensors:
        assert back[k].dtype == tensors[k].dtype
        assert back[k].tobytes() == tensors[k].tobytes()


def test_big_endian_input_is_sent_little_endian() -> None:
    big = np.arange(6, dtype=">f4")
    _, back = serde.parameters_from_chunks(
        serde.parameters_to_chunks(1, {"x": big}), max_bytes=1000
    )
    np.testing.assert_array_equal(back["x"], big.astype("<f4"))


def _update_chunks(tensors: dict[str, np.ndarray]) -> list[pb.UpdateChunk]:
    header = UpdateHeader(round=1, nonce=b"n" * 16, num_examples=3)
    return list(serde.update_to_chunks(header, tensors, chunk_bytes=8))


def _read(chunks: list[pb.UpdateChunk], specs: list[TensorSpec], max_bytes: int = 10_000):
    reader = serde.TensorStreamReader(specs, max_bytes=max_bytes)
    for c in chunks[1:]:
        reader.feed(c)
    return reader.finish()


SPEC = [TensorSpec("w", np.dtype("<f4"), (2, 3))]


def test_update_round_trip() -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = _read(_update_chunks({"w": w}), SPEC)
    np.testing.assert_array_equal(out["w"], w)


def test_wrong_digest_rejected() -> None:
    chunks = _update_chunks({"w": np.ones((2, 3), np.float32)})
    chunks[2] = pb.UpdateChunk(data=b"\x00" * len(chunks[2].data))
    with pytest.raises(ProtocolError, match="SHA-256"):
        _read(chunks, SPEC)


@pytest.mark.parametrize(
    ("array", "match"),
    [
        (np.ones((3, 2), np.float32), "shape"),
        (np.ones((2, 3), np.float64), "dtype"),
        (np.array([[np.nan, 0, 0], [0, 0, 0]], np.float32), "NaN or Inf"),
        (np.array([[np.inf, 0, 0], [0, 0, 0]], np.float32), "NaN or Inf"),
    ],
)
def test_bad_tensors_rejected(array: np.ndarray, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        _read(_update_chunks({"w": array}), SPEC)


def test_wrong_name_extra_and_missing_tensors_rejected() -> None:
    w = np.ones((2, 3), np.float32)
    with pytest.raises(ProtocolError, match="expected 'w'"):
        _read(_update_chunks({"v": w}), SPEC)
    with pytest.raises(ProtocolError, match="extra tensor"):
        _read(_update_chunks({"w": w, "x": w}), SPEC)
    with pytest.raises(ProtocolError, match="before tensors"):
        _read(_update_chunks({}), SPEC)


def test_oversize_and_truncated_streams_rejected() -> None:
    w = np.ones((2, 3), np.float32)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        _read(_update_chunks({"w": w}), SPEC, max_bytes=10)
    chunks = _update_chunks({"w": w})
    with pytest.raises(ProtocolError, match="ended inside"):
        _read(chunks[:-1], SPEC)
    extra = [*chunks, pb.UpdateChunk(data=b"\x00")]
    with pytest.raises(ProtocolError, match="outside a tensor"):
        _read(extra, SPEC)


def test_header_lies_about_size() -> None:
    chunks = _update_chunks({"w": np.ones((2, 3), np.float32)})
    chunks[1].tensor.num_bytes = 4
    with pytest.raises(ProtocolError, match="declares"):
        _read(chunks, SPEC)


def test_oversize_chunk_rejected() -> None:
    reader = serde.TensorStreamReader(None, max_bytes=1 << 30)
    big = np.zeros(serde.MAX_CHUNK_BYTES // 4 + 1, np.float32)
    reader.add_header(serde.tensor_header("big", big))
    with pytest.raises(ProtocolError, match="exceeds"):
        reader.add_data(big.tobytes())


def test_non_finite_metrics_rejected() -> None:
    msg = pb.UpdateHeader(round=1, nonce=b"x", num_examples=1, metrics={"loss": float("nan")})
    with pytest.raises(ProtocolError, match="not finite"):
        serde.update_header_from_proto(msg)


def test_task_round_trip() -> None:
    task = Task(
        kind=TaskKind.TRAIN,
        round=3,
        nonce=b"abc",
        algorithm="fedpe",
        training=LocalTraining(local_epochs=2, batch_size=16, learning_rate=0.05),
        algorithm_params={"lambda": 20.0},
        deadline_unix_ms=123,
        parameters_bytes=999,
    )
    assert serde.task_from_proto(serde.task_to_proto(task)) == task
    with pytest.raises(ProtocolError, match="unknown task kind"):
        serde.task_from_proto(pb.Task(kind=0))


def test_too_many_or_too_long_metrics_rejected() -> None:
    # Prepare: the limits, and one past each
    many = {f"m{i}": 1.0 for i in range(serde.MAX_METRICS + 1)}
    long = {"x" * (serde.MAX_METRIC_NAME + 1): 1.0}
    at_limit = {f"m{i}": 1.0 for i in range(serde.MAX_METRICS - 1)}
    at_limit["y" * serde.MAX_METRIC_NAME] = 2.0
    # Execute / Assert
    for metrics, match in ((many, "257 metrics exceed the limit of 256"), (long, "exceed 100")):
        msg = pb.UpdateHeader(round=1, nonce=b"x", num_examples=1, metrics=metrics)
        with pytest.raises(ProtocolError, match=match):
            serde.update_header_from_proto(msg)
    msg = pb.UpdateHeader(round=1, nonce=b"x", num_examples=1, metrics=at_limit)
    assert serde.update_header_from_proto(msg).metrics == at_limit


def test_a_declared_size_beyond_int64_is_refused_not_wrapped() -> None:
    # (2^55, 512) float32 wraps to 0 bytes in int64 arithmetic: it must count as huge
    reader = serde.TensorStreamReader(
        [TensorSpec("head", np.dtype("<f4"), (-1, 512))], max_bytes=1 << 30
    )
    header = serde.tensor_header("head", np.zeros((1, 512), np.float32))
    del header.shape[:]
    header.shape.extend([2**55, 512])
    header.num_bytes = 0
    with pytest.raises(ProtocolError, match="declares 0 bytes, its shape and dtype need "):
        reader.add_header(header)


def test_a_header_alone_allocates_no_more_than_the_data_sent() -> None:
    import tracemalloc

    # Prepare: a header declaring a 2 GiB tensor, within the reader's limit
    reader = serde.TensorStreamReader(None, max_bytes=1 << 32)
    header = serde.tensor_header("w", np.zeros(4, np.float32))
    del header.shape[:]
    header.shape.append(2**29)
    header.num_bytes = 2**31
    # Execute
    tracemalloc.start()
    try:
        reader.add_header(header)
        reader.add_data(b"\x00" * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Assert: what the header declared was not allocated up front (at most the 64 MiB start)
    assert peak < 80 * 2**20, peak
    # and a tensor larger than the first allocation still arrives bit-exact
    big = np.random.default_rng(0).standard_normal(9 * 2**20).astype(np.float64)  # 72 MiB
    chunks = list(serde.parameters_to_chunks(1, OrderedDict(w=big)))
    _, tensors = serde.parameters_from_chunks(iter(chunks), max_bytes=big.nbytes)
    np.testing.assert_array_equal(tensors["w"], big)


def test_a_training_task_with_settings_no_config_gives_is_refused() -> None:
    good = Task(kind=TaskKind.TRAIN, round=1, nonce=b"n", training=LocalTraining())
    assert serde.task_from_proto(serde.task_to_proto(good)) == good
    bad = {
        "learning_rate": LocalTraining(learning_rate=float("inf")),
        "momentum": LocalTraining(momentum=float("nan")),
        "weight_decay": LocalTraining(weight_decay=-1.0),
        "batch_size": LocalTraining(batch_size=0),
        "local_epochs/local_steps": LocalTraining(local_epochs=0, local_steps=0),
        "optimizer": LocalTraining(optimizer="lbfgs"),
    }
    for name, training in bad.items():
        msg = serde.task_to_proto(Task(kind=TaskKind.TRAIN, round=1, training=training))
        with pytest.raises(ProtocolError, match=f"out of range \\({name}\\)"):
            serde.task_from_proto(msg)
    # a task that trains nothing carries no settings to check
    wait = pb.Task(kind=pb.TASK_KIND_WAIT)
    assert serde.task_from_proto(wait).kind is TaskKind.WAIT


@pytest.mark.parametrize(
    ("value", "to_proto", "from_proto", "direct"),
    [
        (
            JoinRequest(software_version="1.2.3", num_examples=40),
            serde.join_request_to_proto,
            serde.join_request_from_proto,
            pb.JoinRequest(software_version="1.2.3", num_examples=40),
        ),
        (
            JoinRequest(software_version="1.2.3"),
            serde.join_request_to_proto,
            serde.join_request_from_proto,
            pb.JoinRequest(software_version="1.2.3", num_examples=0),
        ),
        (
            PollRequest(last_round=7),
            serde.poll_request_to_proto,
            serde.poll_request_from_proto,
            pb.PollRequest(last_round=7),
        ),
        (
            ParametersRequest(round=3, nonce=b"n" * 16),
            serde.parameters_request_to_proto,
            serde.parameters_request_from_proto,
            pb.ParametersRequest(round=3, nonce=b"n" * 16),
        ),
        (
            SubmitReply(accepted=True, message="round 3 update accepted"),
            serde.submit_reply_to_proto,
            serde.submit_reply_from_proto,
            pb.SubmitReply(accepted=True, message="round 3 update accepted"),
        ),
        (  # a key stage, as the client starts it (privacy stage 1 + 1)
            SecAggMessage(round=2, nonce=b"x" * 16, stage=SecAggStage(1 + 1), payload=b"keys"),
            serde.secagg_message_to_proto,
            serde.secagg_message_from_proto,
            pb.SecAggMessage(
                round=2, nonce=b"x" * 16, stage=pb.SECAGG_STAGE_SHARE_KEYS, payload=b"keys"
            ),
        ),
        (  # the attendance call: no payload, no reason
            SecAggMessage(round=2, nonce=b"x" * 16, stage=SecAggStage.ATTEND),
            serde.secagg_message_to_proto,
            serde.secagg_message_from_proto,
            pb.SecAggMessage(round=2, nonce=b"x" * 16, stage=pb.SECAGG_STAGE_ATTEND),
        ),
        (  # a withdrawal with its reason
            SecAggMessage(
                round=5,
                nonce=b"y" * 16,
                stage=SecAggStage.WITHDRAW,
                withdraw_reason=WithdrawReason.DECLINED,
            ),
            serde.secagg_message_to_proto,
            serde.secagg_message_from_proto,
            pb.SecAggMessage(
                round=5,
                nonce=b"y" * 16,
                stage=pb.SECAGG_STAGE_WITHDRAW,
                withdraw_reason=pb.WITHDRAW_REASON_DECLINED,
            ),
        ),
    ],
)
def test_request_and_reply_round_trip_with_the_same_wire_bytes(
    value: object, to_proto, from_proto, direct
) -> None:
    # Execute
    msg = to_proto(value)
    back = from_proto(type(msg).FromString(msg.SerializeToString()))
    # Assert: the dataclass comes back equal, and the bytes are those of the message built
    # field by field (proto3 leaves default values off the wire)
    assert back == value
    assert msg.SerializeToString() == direct.SerializeToString()


@pytest.mark.parametrize(
    ("enum", "proto_enum", "prefix"),
    [
        (SecAggStage, pb.SecAggStage, "SECAGG_STAGE_"),
        (WithdrawReason, pb.WithdrawReason, "WITHDRAW_REASON_"),
    ],
)
def test_secagg_enums_have_the_wire_names_and_numbers(enum, proto_enum, prefix) -> None:
    assert {prefix + m.name: m.value for m in enum} == dict(proto_enum.items())


def test_an_unknown_secagg_stage_is_refused_and_an_unknown_reason_reads_as_none() -> None:
    bad_stage = pb.SecAggMessage(round=1, nonce=b"n", stage=9)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="unknown secure-aggregation stage 9"):
        serde.secagg_message_from_proto(bad_stage)
    newer = pb.SecAggMessage(
        round=1,
        nonce=b"n",
        stage=pb.SECAGG_STAGE_WITHDRAW,
        withdraw_reason=99,  # type: ignore[arg-type]
    )
    back = serde.secagg_message_from_proto(newer)
    assert back.stage is SecAggStage.WITHDRAW
    assert back.withdraw_reason is WithdrawReason.UNSPECIFIED
