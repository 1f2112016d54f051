"""Fuzzing the gRPC servicer: every hostile message is refused by name, nothing crashes or hangs.

Hypothesis draws messages for every RPC (``fuzz_harness.messages``): structurally valid ones
with hostile values (huge numbers, wrong shapes and dtypes, NaN, control characters, wrong
rounds and nonces, forged secure-aggregation payloads) and random bytes. Each is sent against
a freshly posted attempt of the real coordinator. Invariants: the answer is a gRPC status that
names the message's fault (never UNKNOWN or INTERNAL, which mean a server fault), every call
ends within its attempt's deadline plus a margin, a refused upload leaves no trace in the
aggregate, and afterwards the same server runs an honest secure round whose model is exactly
the honest clients' mean. The budget is fixed (``derandomize``: the same examples every run);
``benchmarks/fuzz_servicer.py`` runs the same harness for 100,000 messages.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fl_secure.errors import ProtocolError
from privacy.secagg.messages import (
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    UnmaskRequest,
    UnmaskResponse,
)
from privacy.secagg.stages import unpack

from .fuzz_harness import KINDS, FuzzServer, honest_round  # type: ignore[import-not-found]
from .fuzz_messages import (  # type: ignore[import-not-found]
    CLIENTS,
    Scene,
    messages,
    payload_bytes,
    payload_plan,
)

#: Statuses a refused message may get: each names the message's fault.
REFUSALS = {
    "INVALID_ARGUMENT", "FAILED_PRECONDITION", "ABORTED", "RESOURCE_EXHAUSTED", "UNDECODABLE",
}  # fmt: skip
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _fuzz(fuzz: FuzzServer, examples: int, *, transport: bool) -> dict[str, int]:
    seen: dict[str, int] = {}

    @settings(FUZZ, max_examples=examples)
    @given(kind=st.sampled_from(KINDS), calls=st.lists(messages(), min_size=1, max_size=3))
    def one_attempt(kind: str, calls: list) -> None:
        scene = fuzz.post_attempt(kind)
        for call in calls:
            outcome = fuzz.run(call, scene, transport=transport)
            seen[f"{call.rpc}:{outcome.status}"] = seen.get(f"{call.rpc}:{outcome.status}", 0) + 1
            assert not outcome.hang, f"hang: {call!r}"
            assert not outcome.crash, f"{outcome.status} {outcome.details}: {call!r}"
            assert outcome.status == "OK" or outcome.status in REFUSALS, outcome
            assert fuzz.refused_upload_left_no_trace(call, outcome), repr(call)

    one_attempt()
    return seen


def _honest_round_after(fuzz: FuzzServer) -> None:
    # before: the fuzz never moved the global model
    for name, value in fuzz.initial.items():
        assert fuzz.coordinator.params[name].tobytes() == value.tobytes()
    shifts = {c: 0.5 * (i + 1) for i, c in enumerate(CLIENTS)}
    status = honest_round(fuzz, shifts)
    assert status == "completed", fuzz.coordinator.stop_reason
    record = fuzz.coordinator.run_dir.read_metrics()[-1]
    assert record["round"] == 1 and record["num_updates"] == len(CLIENTS), record
    mean = np.mean(list(shifts.values()))  # 1.25: exact in SecAgg's fixed point
    for name, value in fuzz.initial.items():
        np.testing.assert_array_equal(fuzz.coordinator.params[name], value + np.float32(mean))
    assert not fuzz.errors.records, fuzz.errors.records


def test_in_process_fuzz_then_an_honest_secure_round(tmp_path: Path) -> None:
    fuzz = FuzzServer(tmp_path)
    try:
        seen = _fuzz(fuzz, 300, transport=False)
        # the fuzz reached every RPC, and past the nonce checks into uploads and stages
        assert {k.split(":")[0] for k in seen} >= {"Join", "PollTask", "GetParameters"}
        assert seen.get("SubmitUpdate:INVALID_ARGUMENT", 0) > 20, seen
        assert seen.get("SecAggExchange:FAILED_PRECONDITION", 0) > 20, seen
        _honest_round_after(fuzz)
    finally:
        fuzz.close()


def test_fuzz_over_mtls_then_an_honest_secure_round(tmp_path: Path) -> None:
    fuzz = FuzzServer(tmp_path)
    try:
        seen = _fuzz(fuzz, 60, transport=True)
        assert seen.get("SubmitUpdate:INVALID_ARGUMENT", 0) > 3, seen
        _honest_round_after(fuzz)
    finally:
        fuzz.close()


PARSERS = {
    "AdvertiseKeys": AdvertiseKeys.from_bytes,
    "EncryptedShare": EncryptedShare.from_bytes,
    "MaskedInput": MaskedInput.from_bytes,
    "UnmaskRequest": UnmaskRequest.from_bytes,
    "UnmaskResponse": UnmaskResponse.from_bytes,
    "list": lambda data: unpack(data, "fuzz"),
}


@settings(FUZZ, max_examples=400)
@given(
    plan=payload_plan,
    cut=st.integers(0, 400),
    flip=st.tuples(st.integers(0, 400), st.integers(0, 7)),
)
def test_secure_aggregation_parsers_refuse_hostile_payloads_by_name(plan, cut, flip) -> None:
    # the stage payloads the server parses at the later stages (which a posted attempt at
    # its first stage does not reach): well-formed with hostile fields, cut, or bit-flipped
    scene = Scene("secure", 7, {}, [], b"r" * 16, {})
    whole = payload_bytes(plan, "task", scene, "client-0")
    flipped = bytearray(whole)
    if flipped:
        flipped[flip[0] % len(flipped)] ^= 1 << flip[1]
    for data in (whole, whole[:cut], bytes(flipped)):
        for parse in PARSERS.values():
            try:
                parse(data)
            except ProtocolError:
                pass  # refused by name: the servicer answers FAILED_PRECONDITION
