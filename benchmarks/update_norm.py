"""Benchmark of the server's norm bound on a plain update against the fold it precedes.

Every plain (unmasked) update's L2 norm is computed in float64 before it is folded into the
attempt's float64 running sums (:func:`server.influence.update_norm`, then
:meth:`fl_secure.aggregation.StreamingMean.add`). Prints one JSON object: for each model size,
the median seconds of each over ``--repeats`` runs and ``norm_to_fold_ratio``, the baseline
from the same run.

Run on 2 cores::

    python benchmarks/update_norm.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from fl_secure.aggregation import StreamingMean
from fl_secure.messages import TensorSpec
from server.influence import update_norm

#: Parameter counts: the quickstart CNN's order, and a ResNet-scale backbone's.
SIZES = (1_000_000, 25_000_000)


def _median_seconds(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(size: int, repeats: int) -> dict[str, Any]:
    """Median seconds of the norm and of the fold of one float32 update of ``size`` values."""
    rng = np.random.default_rng(0)
    update = OrderedDict(
        [
            ("w", rng.standard_normal(size - 1000, dtype=np.float32)),
            ("b", np.ones(1000, np.float32)),
        ]
    )
    mean = StreamingMean([TensorSpec.of(k, v) for k, v in update.items()])
    norm_s = _median_seconds(lambda: update_norm(update), repeats)
    fold_s = _median_seconds(lambda: mean.add(update, 10.0), repeats)
    return {
        "parameters": size,
        "norm_s": round(norm_s, 5),
        "fold_s": round(fold_s, 5),
        "norm_to_fold_ratio": round(norm_s / fold_s, 3),
    }


def main() -> None:
    """Print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "numpy": np.__version__,
                "sizes": [measure(n, args.repeats) for n in SIZES],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
