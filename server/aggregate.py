"""Streaming weighted mean of updates: memory O(d) in the number of parameters.

Each accepted update is folded into float64 running sums as soon as it has been validated, so
the server never holds the cohort's updates side by side.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from fl_secure.errors import ProtocolError
from fl_secure.messages import Tensors, TensorSpec


class StreamingMean:
    """Running weighted sum of tensors with fixed specs."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.specs = list(specs)
        self._sums: OrderedDict[str, np.ndarray] = OrderedDict(
            (s.name, np.zeros(s.shape, dtype=np.float64)) for s in self.specs
        )
        self.total_weight = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold one update in with ``weight`` (e.g. its number of examples)."""
        if not weight > 0 or not np.isfinite(weight):
            raise ProtocolError(f"aggregation weight must be a positive number, got {weight}")
        if list(tensors) != list(self._sums):
            raise ProtocolError("update tensors do not match the shared parameters")
        for name, total in self._sums.items():
            total += np.asarray(tensors[name], dtype=np.float64) * weight
        self.total_weight += weight
        self.count += 1

    def mean(self) -> Tensors:
        """Weighted mean, cast back to each tensor's dtype."""
        if self.count == 0:
            raise ProtocolError("no update to average")
        return OrderedDict(
            (s.name, (self._sums[s.name] / self.total_weight).astype(s.dtype)) for s in self.specs
        )
