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

    A metric that only some clients can report (verification needs at least two identities
    on a client, which skewed partitions do not guarantee) is summarised over those clients,
    and ``<metric>_clients`` says how many they were.

    Args:
        per_client: client id -> metric name -> value.

    Returns:
        ``<metric>_mean`` and ``<metric>_std`` for every metric, in order of first appearance.

    Raises:
        ValueError: if there is no client.
    """
    if not per_client:
        raise ValueError("per_client_summary needs at least one client")
    names: list[str] = []
    for metrics in per_client.values():
        names += [n for n in metrics if n not in names]
    summary: dict[str, float] = {}
    for name in names:
        reported = [m[name] for m in per_client.values() if name in m]
        values = np.array(reported, dtype=np.float64)
        summary[f"{name}_mean"] = float(values.mean())
        summary[f"{name}_std"] = float(values.std(ddof=0))
        if len(reported) < len(per_client):
            summary[f"{name}_clients"] = float(len(reported))
    return summary
