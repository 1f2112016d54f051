"""Folding a round's updates together: running float64 sums, memory O(d) in the parameters.

Each accepted update is folded into float64 running sums as soon as it has been validated, so
the server never holds the cohort's updates side by side. :class:`StreamingSum` keeps the
sums; :class:`StreamingMean` divides them by the summed weights (the plain weighted mean of
FedAvg); the DP-FedAvg aggregator (:class:`privacy.dp.client_level.NoisyClippedSum`) adds noise
and divides by the expected cohort size instead. Whoever drives a round sees them through
:class:`Aggregator`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from fl_secure.errors import ProtocolError
from fl_secure.messages import Tensors, TensorSpec


class Aggregator(Protocol):
    """Folds a round's updates together: :class:`StreamingMean` or a DP aggregator."""

    count: int

    def add(self, tensors: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold one validated update in."""

    def mean(self) -> Tensors:
        """The round's aggregate update."""


class StreamingSum:
    """Running float64 sums of tensors with fixed specs, one per tensor name.

    Attributes:
        specs: The tensors every update must hold, in order.
        count: How many updates were folded in.
    """

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.specs = list(specs)
        self._sums: OrderedDict[str, np.ndarray] = OrderedDict(
            (s.name, np.zeros(s.shape, dtype=np.float64)) for s in self.specs
        )
        self.count = 0

    def check(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Raise :class:`ProtocolError` unless ``tensors`` are those of :attr:`specs`, in order."""
        if list(tensors) != list(self._sums):
            raise ProtocolError("update tensors do not match the shared parameters")

    def fold(self, tensors: Mapping[str, np.ndarray], weight: float = 1.0) -> None:
        """Add ``tensors * weight`` (in float64) to the sums, after :meth:`check`.

        A weight of 1 adds the values themselves (``x * 1.0`` is ``x`` in IEEE arithmetic, so
        this only skips a temporary).
        """
        self.check(tensors)
        for name, total in self._sums.items():
            values = np.asarray(tensors[name], dtype=np.float64)
            total += values if weight == 1.0 else values * weight
        self.count += 1

    def total(self, name: str) -> np.ndarray:
        """The running float64 sum of tensor ``name`` (the array itself, not a copy)."""
        return self._sums[name]


class StreamingMean(StreamingSum):
    """Running weighted sum of tensors with fixed specs; :meth:`mean` is the weighted mean."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        super().__init__(specs)
        self.total_weight = 0.0

    def add(self, tensors: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold one update in with ``weight`` (e.g. its number of examples)."""
        if not weight > 0 or not np.isfinite(weight):
            raise ProtocolError(f"aggregation weight must be a positive number, got {weight}")
        self.fold(tensors, weight)
        self.total_weight += weight

    def mean(self) -> Tensors:
        """Weighted mean, cast back to each tensor's dtype."""
        if self.count == 0:
            raise ProtocolError("no update to average")
        return OrderedDict(
            (s.name, (self.total(s.name) / self.total_weight).astype(s.dtype)) for s in self.specs
        )
