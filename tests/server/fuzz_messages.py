"""Hostile messages for every RPC of the servicer, drawn by Hypothesis (the fuzz's inputs).

:func:`messages` draws one call: the RPC, the calling client, and a *plan* of its request that
is built against the attempt the server has open when the call is sent (a :class:`Scene`):
the plan says "this round's nonce" or "another client's nonce" or random bytes, and the
build fills in the bytes. So a message can carry the task a client really holds and reach
the checks behind the nonce (tensor headers, digests, shapes, dtypes, NaN, signatures),
while the strategies stay fixed objects Hypothesis draws from quickly.

What is drawn: structurally valid messages with hostile values (huge and negative numbers,
wrong tensor shapes and dtypes, NaN and Inf, control characters and escapes in names and
ids, wrong rounds and nonces, forged and validly signed secure-aggregation payloads with
hostile fields), and raw random bytes decoded as the RPC's request (bytes that are no message
are kept as they are: gRPC refuses them before the servicer).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from hypothesis import strategies as st

from fl_secure import serde
from fl_secure.messages import Tensors, TensorSpec, UpdateHeader
from fl_secure.v1 import transport_pb2 as pb
from privacy.secagg.messages import (
    AdvertiseKeys,
    EncryptedShare,
    RevealedShare,
    UnmaskResponse,
    advert_payload,
)
from privacy.secagg.shamir import FIELD_BYTES
from privacy.secagg.stages import pack

CLIENTS = ("client-0", "client-1", "client-2", "client-3")
RPCS = ("Join", "PollTask", "GetParameters", "SubmitUpdate", "SecAggExchange")


@dataclass(frozen=True)
class Scene:
    """The attempt open when a message is sent: what a message must carry to reach deep."""

    kind: str  # "plain", "secure", "evaluate" or "none"
    number: int
    nonces: dict[str, bytes]
    specs: list[TensorSpec]  # what a valid upload of this attempt holds
    round_id: bytes  # the secure setup's round id (b"" outside a secure attempt)
    keys: dict[str, Any]  # the clients' Ed25519 signing keys (to sign hostile adverts)


Build = Callable[[Scene, str], Any]


@dataclass(frozen=True)
class FuzzCall:
    """One call: the RPC, the calling client, and how to build its request against a scene.

    ``raw`` holds bytes that decode to no message of the RPC (sent as they are).
    """

    rpc: str
    client: str
    build: Build | None
    raw: bytes | None = None

    def request(self, scene: Scene) -> Any:
        """The request (an upload: its list of chunks) for the attempt ``scene``."""
        return None if self.build is None else self.build(scene, self.client)

    def __repr__(self) -> str:
        what = f"raw={self.raw!r}" if self.raw is not None else getattr(self.build, "plan", "")
        return f"FuzzCall({self.rpc} from {self.client}: {str(what)[:600]})"


# ------------------------------------------------------------------- scalar strategies
U64_EDGES = [0, 1, 2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1]
u64 = st.one_of(st.sampled_from(U64_EDGES), st.integers(0, 2**64 - 1))
u32 = st.one_of(st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
i64 = st.one_of(st.sampled_from([-1, 0, 1, 2**62, -(2**63), 2**63 - 1]), st.integers(-50, 50))
#: proto3 enums are open: any int32 arrives.
enum_int = st.one_of(st.integers(-2, 12), st.sampled_from([-(2**31), 2**31 - 1]))
HOSTILE_TEXT = [
    "", "client-0\n", "client-1\r\nx-fl-secure-client-id: client-2", "\x1b[2J\x1b[31mred",
    "\x00nul", "../../../etc/passwd", "w" * 300, "b\u202etxt", "w\n", "%s%s%n", "\ufeffw",
]  # fmt: skip
text = st.one_of(
    st.sampled_from(HOSTILE_TEXT), st.text(st.characters(exclude_categories=("Cs",)), max_size=48)
)
raw_bytes = st.binary(max_size=300)
floats = st.floats(allow_nan=True, allow_infinity=True)
#: A round: the open attempt's ("task"), one near it, or any u64.
round_pick = st.one_of(st.sampled_from(["task", "task", "task", "next", "previous", 1]), u64)
#: A nonce: the caller's own, another member's, a near miss, or random bytes.
nonce_pick = st.one_of(
    st.sampled_from(["own", "own", "own", "other", "short", "long"]), st.binary(max_size=40)
)
#: An id inside a payload: the caller's, another client's, or any text.
id_pick = st.one_of(st.sampled_from(["self", *CLIENTS]), text)


def _round(pick: int | str, scene: Scene) -> int:
    if isinstance(pick, int):
        return pick
    return {"task": scene.number, "next": scene.number + 1, "previous": scene.number - 1}[pick]


def _nonce(pick: bytes | str, scene: Scene, client: str) -> bytes:
    if isinstance(pick, bytes):
        return pick
    own = scene.nonces.get(client, b"")
    if pick == "other":
        others = [n for c, n in sorted(scene.nonces.items()) if c != client]
        return others[0] if others else b"\x00" * 16
    return {"own": own, "short": own[:-1], "long": own + b"\x00"}[str(pick)]


def _id(pick: str, client: str) -> str:
    return client if pick == "self" else pick


def _planned(plan: dict[str, Any], build: Build) -> Build:
    build.plan = plan  # type: ignore[attr-defined]  # shown when a call fails
    return build


# ----------------------------------------------------------------------------- uploads
def _valid_tensors(scene: Scene, seed: int) -> Tensors:
    rng = np.random.default_rng(seed)
    out: Tensors = OrderedDict()
    for spec in scene.specs:
        shape = tuple(max(d, 1) for d in spec.shape)
        if spec.dtype.kind == "u":
            out[spec.name] = rng.integers(0, 2**31, size=shape).astype(spec.dtype)
        else:
            out[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    return out


def _retyped(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The same bytes read as another dtype, or the values converted where that cannot be."""
    try:
        return array.view(dtype)
    except ValueError:
        return array.astype(dtype)


tensor_header = st.builds(
    pb.TensorHeader,
    name=text,
    dtype=enum_int,
    shape=st.lists(i64, max_size=5),
    num_bytes=u64,
    sha256=st.binary(max_size=40),
)
metrics = st.one_of(
    st.dictionaries(text, floats, max_size=4),
    st.dictionaries(st.sampled_from(["train_loss", "local_steps", "x" * 200]), floats),
)
#: One to three fields of an update header made hostile.
header_overrides = st.lists(
    st.one_of(
        st.tuples(st.just("round"), round_pick),
        st.tuples(st.just("nonce"), nonce_pick),
        st.tuples(st.just("num_examples"), u64),
        st.tuples(st.just("metrics"), metrics),
        st.tuples(st.just("num_tensors"), u32),
        st.tuples(st.just("total_bytes"), u64),
    ),
    min_size=1,
    max_size=3,
).map(dict)
DTYPES = [np.float64, np.float16, np.int64, np.int32, np.uint8, np.bool_, np.uint64, np.uint32,
          np.float32]  # fmt: skip
tensor_edit = st.one_of(
    st.just(("none",)),
    st.tuples(st.just("nan"), st.sampled_from([np.nan, np.inf, -np.inf])),
    st.just(("shape",)),
    st.tuples(st.just("dtype"), st.sampled_from(DTYPES)),
    st.tuples(st.just("extra"), text, st.integers(0, 64)),
    st.just(("drop_tensor",)),
)
stream_edit = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 63), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("drop"), st.integers(0, 63)),
    st.tuples(st.just("dup"), st.integers(0, 63)),
    st.tuples(
        st.just("insert"),
        st.integers(0, 63),
        st.one_of(
            st.builds(lambda h: pb.UpdateChunk(tensor=h), tensor_header),
            st.builds(lambda b: pb.UpdateChunk(data=b), raw_bytes),
            st.just(pb.UpdateChunk()),
            st.just("header again"),
        ),
    ),
    st.tuples(st.just("swap_header"), st.integers(0, 63), tensor_header),
    st.tuples(st.just("truncate"), st.integers(0, 63)),
)


def _edit_tensors(tensors: Tensors, edit: tuple[Any, ...], which: int) -> None:
    names = list(tensors)
    if edit[0] == "extra":
        tensors[edit[1]] = np.zeros(edit[2], np.float32)
        return
    if not names or edit[0] == "none":
        return
    name = names[which % len(names)]
    array = tensors[name]
    if edit[0] == "nan" and array.dtype.kind == "f":
        array = array.copy()
        array.flat[0] = edit[1]
    elif edit[0] == "shape":
        array = array.reshape(-1)[: max(array.size - 1, 0)].copy()
    elif edit[0] == "dtype":
        array = _retyped(array, np.dtype(edit[1]))
    elif edit[0] == "drop_tensor":
        del tensors[name]
        return
    tensors[name] = array


def _edit_stream(chunks: list[pb.UpdateChunk], edit: tuple[Any, ...]) -> list[pb.UpdateChunk]:
    op, where = edit[0], edit[1] % max(len(chunks), 1)
    if op == "truncate":
        return chunks[:where]
    if op == "insert":
        extra = chunks[0] if isinstance(edit[2], str) and chunks else edit[2]
        if not isinstance(extra, str):
            chunks.insert(where, extra)
    elif not chunks:
        return chunks
    elif op == "flip" and chunks[where].WhichOneof("kind") == "data":
        data = bytearray(chunks[where].data)
        if data:
            data[edit[2] % len(data)] ^= 1 << edit[3]
        chunks[where] = pb.UpdateChunk(data=bytes(data))
    elif op == "drop":
        del chunks[where]
    elif op == "dup":
        chunks.insert(where, chunks[where])
    elif op == "swap_header" and chunks[where].WhichOneof("kind") == "tensor":
        chunks[where] = pb.UpdateChunk(tensor=edit[2])
    return chunks


@st.composite
def upload(draw: st.DrawFn) -> Build:
    """An upload: the attempt's honest stream, a hostile header field or two, 0-3 edits."""
    plan = {
        "seed": draw(st.integers(0, 2**16)),
        "tensor_edit": draw(tensor_edit),
        "which": draw(st.integers(0, 7)),
        "header": draw(st.one_of(st.just({}), header_overrides)),
        "stream_edits": draw(st.lists(stream_edit, max_size=3)),
    }

    def build(scene: Scene, client: str) -> list[pb.UpdateChunk]:
        tensors = _valid_tensors(scene, plan["seed"])
        _edit_tensors(tensors, plan["tensor_edit"], plan["which"])
        metrics = {"train_loss": 1.0, "local_steps": 1.0}
        valid = UpdateHeader(scene.number, scene.nonces.get(client, b""), 5, metrics)
        chunks = list(serde.update_to_chunks(valid, tensors))
        head = chunks[0].header
        for key, value in plan["header"].items():
            if key == "round":
                value = _round(value, scene)
            elif key == "nonce":
                value = _nonce(value, scene, client)
            if key == "metrics":
                head.ClearField("metrics")
                head.metrics.update(value)
            else:
                setattr(head, key, value)
        for edit in plan["stream_edits"]:
            chunks = _edit_stream(chunks, edit)
        return chunks

    return _planned(plan, build)


# -------------------------------------------------------------- secure-aggregation stage
encrypted_share = st.tuples(id_pick, id_pick, st.binary(min_size=12, max_size=12),
                            st.binary(max_size=64))  # fmt: skip
revealed_share = st.tuples(id_pick, u32, st.integers(0, 2 ** (8 * FIELD_BYTES) - 1))
public_key = st.one_of(st.binary(min_size=32, max_size=32), st.just(bytes(32)))
payload_plan = st.one_of(
    st.tuples(st.just("raw"), raw_bytes),
    st.just(("empty",)),
    st.tuples(
        st.just("advert"),
        id_pick,
        public_key,
        public_key,
        st.binary(min_size=64, max_size=64),
        st.booleans(),
    ),  # fmt: skip
    st.tuples(st.just("shares"), st.lists(encrypted_share, max_size=5)),
    st.tuples(
        st.just("unmask"),
        id_pick,
        st.lists(revealed_share, max_size=4),
        st.lists(revealed_share, max_size=4),
    ),  # fmt: skip
)
round_id_pick = st.one_of(st.just("task"), st.binary(max_size=40))


def payload_bytes(plan: tuple[Any, ...], round_id_plan: Any, scene: Scene, client: str) -> bytes:
    round_id = scene.round_id if round_id_plan == "task" else round_id_plan
    kind = plan[0]
    if kind == "raw":
        return bytes(plan[1])
    if kind == "advert":
        who, c_pk, s_pk, signature, sign = _id(plan[1], client), plan[2], plan[3], plan[4], plan[5]
        if sign and client in scene.keys:  # signed by the caller's own enrolled key
            signature = scene.keys[client].sign(advert_payload(who, round_id, c_pk, s_pk))
        return AdvertiseKeys(who, round_id, c_pk, s_pk, signature).to_bytes()
    if kind == "shares":
        shares = [
            EncryptedShare(_id(a, client), _id(b, client), round_id, nonce, ct).to_bytes()
            for a, b, nonce, ct in plan[1]
        ]
        return pack(shares)
    if kind == "unmask":
        groups = [
            tuple(RevealedShare(_id(o, client), x, y) for o, x, y in group)
            for group in (plan[2], plan[3])
        ]
        return UnmaskResponse(_id(plan[1], client), round_id, groups[0], groups[1]).to_bytes()
    return b""


@st.composite
def secagg_message(draw: st.DrawFn) -> Build:
    """A stage message: any stage number, round, nonce, payload and withdraw reason."""
    plan = {
        "round": draw(round_pick),
        "nonce": draw(nonce_pick),
        "stage": draw(st.one_of(st.integers(1, 7), enum_int)),
        "payload": draw(payload_plan),
        "round_id": draw(round_id_pick),
        "reason": draw(enum_int),
    }

    def build(scene: Scene, client: str) -> pb.SecAggMessage:
        return pb.SecAggMessage(
            round=_round(plan["round"], scene),
            nonce=_nonce(plan["nonce"], scene, client),
            stage=plan["stage"],
            payload=payload_bytes(plan["payload"], plan["round_id"], scene, client),
            withdraw_reason=plan["reason"],
        )

    return _planned(plan, build)


# ------------------------------------------------------------------------------ calls
REQUEST_TYPES: dict[str, Any] = {
    "Join": pb.JoinRequest,
    "PollTask": pb.PollRequest,
    "GetParameters": pb.ParametersRequest,
    "SubmitUpdate": pb.UpdateChunk,
    "SecAggExchange": pb.SecAggMessage,
}


def _fixed(plan: Any, request: Any) -> Build:
    return _planned(plan, lambda scene, client: request)


@st.composite
def raw_call(draw: st.DrawFn, client: str) -> FuzzCall:
    """Random bytes as an RPC's request (an upload: a list of them)."""
    rpc = draw(st.sampled_from(RPCS))
    count = draw(st.integers(1, 3)) if rpc == "SubmitUpdate" else 1
    parts = [draw(raw_bytes) for _ in range(count)]
    decoded = []
    for part in parts:
        try:
            decoded.append(REQUEST_TYPES[rpc].FromString(part))
        except DecodeError:
            return FuzzCall(rpc, client, None, raw=part)
    request = decoded if rpc == "SubmitUpdate" else decoded[0]
    return FuzzCall(rpc, client, _fixed(("raw", parts), request))


@st.composite
def messages(draw: st.DrawFn) -> FuzzCall:
    """One fuzzed call of any RPC (its request built against the attempt open when sent)."""
    client = draw(st.sampled_from(CLIENTS))
    rpc = draw(st.sampled_from([*RPCS, "SubmitUpdate", "SecAggExchange", "raw"]))
    if rpc == "raw":
        return draw(raw_call(client))
    if rpc == "Join":
        request = pb.JoinRequest(software_version=draw(text), num_examples=draw(u64))
        return FuzzCall(rpc, client, _fixed(request, request))
    if rpc == "PollTask":
        request = pb.PollRequest(last_round=draw(u64))
        return FuzzCall(rpc, client, _fixed(request, request))
    if rpc == "GetParameters":
        plan = {"round": draw(round_pick), "nonce": draw(nonce_pick)}

        def parameters(scene: Scene, caller: str) -> pb.ParametersRequest:
            round_, nonce = _round(plan["round"], scene), _nonce(plan["nonce"], scene, caller)
            return pb.ParametersRequest(round=round_, nonce=nonce)

        return FuzzCall(rpc, client, _planned(plan, parameters))
    if rpc == "SubmitUpdate":
        return FuzzCall(rpc, client, draw(upload()))
    return FuzzCall(rpc, client, draw(secagg_message()))
