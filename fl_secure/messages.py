"""Plain dataclasses for what travels between server and client.

The rest of the code uses these; only :mod:`fl_secure.serde` converts them to and from
protobuf.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

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
class JoinReply:
    """The server's answer to a client joining."""

    client_id: str
    run_id: str
    software_version: str
    run_config_toml: str = ""
