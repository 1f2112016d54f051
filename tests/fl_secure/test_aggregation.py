"""The streaming weighted mean: exact float64 sums, the dtype back, refusals that name why."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from fl_secure.aggregation import StreamingMean
from fl_secure.errors import ProtocolError
from fl_secure.messages import TensorSpec

SPECS = [TensorSpec("w", np.dtype(np.float32), (2, 3)), TensorSpec("b", np.dtype(np.float16), (3,))]


def _update(value: float) -> OrderedDict[str, np.ndarray]:
    return OrderedDict((s.name, np.full(s.shape, value, s.dtype)) for s in SPECS)


def test_weighted_mean_is_computed_in_float64_and_cast_back() -> None:
    # Prepare
    mean = StreamingMean(SPECS)
    # Execute: weights 1 and 3, as example counts
    mean.add(_update(1.0), 1.0)
    mean.add(_update(3.0), 3.0)
    # Assert: (1 * 1 + 3 * 3) / 4 = 2.5 in each tensor's own dtype
    out = mean.mean()
    assert list(out) == ["w", "b"] and (mean.count, mean.total_weight) == (2, 4.0)
    for s in SPECS:
        assert out[s.name].dtype == s.dtype and out[s.name].shape == s.shape
        np.testing.assert_array_equal(out[s.name], np.full(s.shape, 2.5, s.dtype))


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_a_weight_that_is_not_a_positive_number_is_refused(weight: float) -> None:
    mean = StreamingMean(SPECS)
    with pytest.raises(ProtocolError, match="positive number"):
        mean.add(_update(1.0), weight)
    assert mean.count == 0


def test_tensors_other_than_the_shared_ones_are_refused_before_anything_is_summed() -> None:
    # Prepare: the right tensors in the wrong order
    mean = StreamingMean(SPECS)
    swapped = OrderedDict(reversed(list(_update(1.0).items())))
    # Execute / Assert
    with pytest.raises(ProtocolError, match="do not match the shared parameters"):
        mean.add(swapped, 1.0)
    assert (mean.count, mean.total_weight) == (0, 0.0)
    with pytest.raises(ProtocolError, match="no update to average"):
        mean.mean()
