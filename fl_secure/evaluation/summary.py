"""Across-client summary of per-client metrics: mean and fairness spread.

Gansekoele et al., "Meta-Learning for Federated Face Recognition in Imbalanced Data Regimes"
(HF-MAML), section V-C and Tables VIII-X: the mean of a metric over clients measures
performance, its standard deviation over clients measures (un)fairness.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def per_client_summary(per_client: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Mean and population standard deviation of every metric over clients.

    The standard deviation is the population one (``ddof=0``, divide by the number of
    clients; HF-MAML does not say which it uses): the clients evaluated are the whole
    population the fairness statement is about, not a sample of it. One client gives 0.

    Args:
        per_client: client id -> metric name -> value; every client must report the same
            metric names.

    Returns:
        ``<metric>_mean`` and ``<metric>_std`` for every metric, in the order the first
        client lists them.

    Raises:
        ValueError: if there is no client or the clients report different metric names.
    """
    if not per_client:
        raise ValueError("per_client_summary needs at least one client")
    clients = list(per_client)
    names = list(per_client[clients[0]])
    for client in clients[1:]:
        if set(per_client[client]) != set(names):
            missing = sorted(set(names) - set(per_client[client]))
            extra = sorted(set(per_client[client]) - set(names))
            raise ValueError(
                f"client {client!r} reports different metrics than {clients[0]!r}: "
                f"missing {missing}, extra {extra}"
            )
    summary: dict[str, float] = {}
    for name in names:
        values = np.array([per_client[client][name] for client in clients], dtype=np.float64)
        summary[f"{name}_mean"] = float(values.mean())
        summary[f"{name}_std"] = float(values.std(ddof=0))
    return summary
