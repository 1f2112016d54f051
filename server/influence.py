"""Bounded client influence: how far one plain update may move the global model.

Without DP nothing else bounds what one client adds to the weighted mean: neither the size
of its update nor the example count it claims. The server's own policy does, from the run's
``[server]`` config:

- an update's L2 norm (its shared tensors, in float64) must be finite and at most
  ``server.max_update_norm`` when set (:func:`norm_refusal`, at upload);
- after an attempt, an update over ``server.update_norm_factor`` times the median norm of the
  attempt's updates is dropped by name and the round retried without it
  (:func:`norm_outliers`); a median is not moved far by a minority, so one client cannot
  drag the bound up to its own update;
- if the new model diverges all the same, the update that stands out against the median of
  the others is named and the round retried without it (:func:`diverged_offenders`);
- an update's weight is its example count capped at ``server.max_examples`` and at
  ``server.examples_factor`` times the median count the enrolled clients stated at join
  (:func:`weight_cap`), besides at its own statement at join (checked at upload).

Masked updates (secure aggregation) are seen only in their sum: none of this applies to them;
a diverged sum can only be refused and its round retried with a fresh cohort.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping

import numpy as np

#: Values converted to float64 at a time by :func:`update_norm` (8 MiB: no model-sized copy).
_CHUNK = 1 << 20


def update_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of an update's tensors together, summed in float64 (inf if it overflows)."""
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for array in tensors.values():
            flat = np.asarray(array).ravel()
            for start in range(0, flat.size, _CHUNK):
                values = flat[start : start + _CHUNK].astype(np.float64)
                total += float(np.dot(values, values))
    return math.sqrt(total) if math.isfinite(total) else math.inf


def norm_refusal(client_id: str, norm: float, max_norm: float) -> str:
    """Why an update of L2 norm ``norm`` is refused at upload ("" if it is not)."""
    if not math.isfinite(norm):
        return f"the update of {client_id} is refused: its L2 norm is not finite"
    if max_norm > 0 and norm > max_norm:
        return (
            f"the update of {client_id} is refused: its L2 norm {norm:.4g} is over "
            f"server.max_update_norm = {max_norm:g}"
        )
    return ""


def norm_outliers(norms: Mapping[str, float], factor: float) -> tuple[list[str], float]:
    """The updates over ``factor`` times the median norm, and that median.

    Nothing is an outlier when ``factor`` is 0 (off) or the median is 0 (most updates are
    empty, e.g. from clients whose privacy budget is spent: the median says nothing then).
    With two updates the median is their mean, which neither exceeds twice: a factor >= 2
    (the config's least) never drops one of two.
    """
    if factor <= 0 or not norms:
        return [], 0.0
    median = statistics.median(norms.values())
    if median <= 0:
        return [], median
    return sorted(c for c, n in norms.items() if n > factor * median), median


def diverged_offenders(norms: Mapping[str, float], factor: float) -> list[str]:
    """The updates a diverged aggregate is blamed on: over ``factor`` times the others' median.

    Empty when ``factor`` is 0, or when no update stands out (then the run's own settings,
    such as its learning rate, are to blame).
    """
    if factor <= 0 or len(norms) < 2:
        return []
    blamed = []
    for client, norm in norms.items():
        others = [n for c, n in norms.items() if c != client]
        if norm > factor * statistics.median(others):
            blamed.append(client)
    return sorted(blamed) if len(blamed) < len(norms) else []


def weight_cap(stated: Iterable[int], max_examples: int, factor: float) -> float:
    """The most an update may weigh in a plain mean: the server's cap, not a client's claim.

    Args:
        stated: The example counts the enrolled clients stated at join (0s are ignored).
        max_examples: The absolute cap (0: none).
        factor: The cap in medians of ``stated`` (0: none).

    Returns:
        The cap (``inf`` when neither applies).
    """
    cap = float(max_examples) if max_examples > 0 else math.inf
    counts = [n for n in stated if n > 0]
    if factor > 0 and counts:
        cap = min(cap, factor * float(statistics.median(counts)))
    return cap


def describe_norms(clients: Iterable[str], norms: Mapping[str, float]) -> str:
    """``c2 (7.9e+38)``, ...: the named clients with their updates' L2 norms."""
    return ", ".join(f"{c} ({norms[c]:.3g})" for c in clients)
