"""A model's tensors as the one flat vector secure aggregation sums, and back."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from fl_secure.errors import ProtocolError
from fl_secure.messages import Tensors, TensorSpec


def flatten(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """All tensors as one float64 vector, in order."""
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in tensors.values()])


def concatenate(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """All tensors as one flat vector of their own dtype (a view when there is one tensor).

    The same values as :func:`flatten` without its float64 copy: fixed-point encoding reads
    the vector chunk by chunk in float64 anyway. Tensors of different dtypes are concatenated
    as float64 (exactly :func:`flatten`).
    """
    arrays = [np.asarray(v) for v in tensors.values()]
    if len(arrays) == 1:
        return arrays[0].ravel()
    if arrays and all(a.dtype == arrays[0].dtype for a in arrays):
        return np.concatenate([a.ravel() for a in arrays])
    return flatten(tensors)


def unflatten(vector: np.ndarray, specs: Sequence[TensorSpec]) -> Tensors:
    """Inverse of :func:`flatten` for tensors of ``specs`` (float64 values)."""
    out: Tensors = OrderedDict()
    pos = 0
    for s in specs:
        n = math.prod(s.shape)
        out[s.name] = vector[pos : pos + n].reshape(s.shape)
        pos += n
    if pos != vector.size:
        raise ProtocolError(f"aggregate has {vector.size} values, the model {pos}")
    return out
