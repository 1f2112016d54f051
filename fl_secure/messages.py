"""Plain dataclasses for what travels between server and client.

The rest of the code uses these; only :mod:`fl_secure.serde` converts them to and from
protobuf.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum, IntEnum

import numpy as np

#: An ordered mapping of parameter name to array (what a model shares).
Tensors = OrderedDict[str, np.ndarray]


class TaskKind(Enum):
    """What the server asks a client to do next."""

    WAIT = "wait"
    TRAIN = "train"
    EVALUATE = "evaluate"
    FINISHED = "finished"


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor: what an upload must match."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        """Size of the tensor's raw bytes (only meaningful without ``-1`` dimensions)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether ``shape`` matches; a ``-1`` dimension of this spec matches any size."""
        return len(shape) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, shape, strict=True)
        )

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> TensorSpec:
        """Spec of an existing array."""
        return cls(name=name, dtype=array.dtype, shape=tuple(int(s) for s in array.shape))


@dataclass(frozen=True)
class LocalTraining:
    """Local optimisation settings a task carries."""

    local_epochs: int = 1
    local_steps: int = 0
    batch_size: int = 32
    learning_rate: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    optimizer: str = "sgd"


@dataclass(frozen=True)
class Task:
    """A task handed to one client."""

    kind: TaskKind
    round: int = 0
    nonce: bytes = b""
    algorithm: str = ""
    training: LocalTraining = field(default_factory=LocalTraining)
    algorithm_params: dict[str, float] = field(default_factory=dict)
    deadline_unix_ms: int = 0
    retry_after_ms: int = 0
    message: str = ""
    parameters_bytes: int = 0
    secagg_setup: bytes = b""
    #: the server's signed ledger head (canonical JSON) when the task was issued; b"": none
    ledger_head: bytes = b""


@dataclass(frozen=True)
class UpdateHeader:
    """What precedes the tensors of an uploaded update."""

    round: int
    nonce: bytes
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    num_tensors: int = 0
    total_bytes: int = 0


@dataclass(frozen=True)
class JoinRequest:
    """A client joining (or joining again after a reconnect)."""

    software_version: str
    num_examples: int = 0  # 0 until the client has built its trainer


@dataclass(frozen=True)
class JoinReply:
    """The server's answer to a client joining."""

    client_id: str
    run_id: str
    software_version: str
    run_config_toml: str = ""


@dataclass(frozen=True)
class PollRequest:
    """A client asking for its next task."""

    last_round: int = 0  # the last round this client finished (0 = none)


@dataclass(frozen=True)
class ParametersRequest:
    """A client asking for the global parameters of the task it holds."""

    round: int
    nonce: bytes


@dataclass(frozen=True)
class SubmitReply:
    """The server's answer to an uploaded update."""

    accepted: bool
    message: str = ""


class SecAggStage(IntEnum):
    """Stage of a secure round's message (``fl_secure.v1.SecAggStage``, the same numbers).

    The client and server sessions of secure aggregation number their stages in protocol
    order from 0 (:data:`privacy.secagg.stages.WIRE_STAGES` maps them to these numbers; the
    consistency check, added later, is 7 here).
    """

    UNSPECIFIED = 0
    ADVERTISE_KEYS = 1  # send: signed public keys; reply: the cohort's keys
    SHARE_KEYS = 2  # send: encrypted shares; reply: the shares sent to you
    UNMASK = 3  # send: nothing; reply: which shares to reveal
    UNMASK_REPLY = 4  # send: the revealed shares; reply: acknowledgement
    WITHDRAW = 5  # send: nothing; the client leaves the round now
    ATTEND = 6  # send: nothing; held open by the client for its whole round
    CONSISTENCY = 7  # send: signature on the survivor set; reply: the survivors' signatures


class WithdrawReason(IntEnum):
    """Why a client withdraws (``fl_secure.v1.WithdrawReason``, the same numbers).

    A category of the client's own failure, never data; the server words it by number, and
    a number it does not know (a newer client's) reads as none.
    """

    UNSPECIFIED = 0
    LOCAL_TRAINING = 1  # local training raised an error
    UPDATE_REFUSED = 2  # the update was not finite or had the wrong size
    MESSAGE_REFUSED = 3  # a message of the round failed the client's checks
    TOO_FEW_SHARES = 4  # too few neighbours took part to reach t
    TRANSPORT = 5  # a call to the server failed
    OTHER = 6  # an unexpected local error
    DECLINED = 7  # the site's own policy declined the round (its budget)
    CONSISTENCY = 8  # the consistency check failed: it revealed no share


@dataclass(frozen=True)
class SecAggMessage:
    """One message of a secure round's exchange (either direction)."""

    round: int
    nonce: bytes  # the task's nonce: only cohort members take part
    stage: SecAggStage
    payload: bytes = b""  # versioned encoding of privacy.secagg messages (never pickle)
    withdraw_reason: WithdrawReason = WithdrawReason.UNSPECIFIED  # with WITHDRAW only
