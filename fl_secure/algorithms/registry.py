"""Registry of federated strategies."""

from __future__ import annotations

from fl_secure.algorithms.base import Strategy
from fl_secure.algorithms.fedavg import FedAvg
from fl_secure.algorithms.fedpe import FedPE
from fl_secure.errors import ConfigError

ALGORITHMS: dict[str, type[Strategy]] = {cls.name: cls for cls in (FedAvg, FedPE)}


def get_strategy(name: str) -> Strategy:
    """A strategy instance by name; unknown names list the allowed ones."""
    try:
        return ALGORITHMS[name]()
    except KeyError:
        raise ConfigError(
            f"unknown algorithm {name!r}; allowed: {', '.join(sorted(ALGORITHMS))}"
        ) from None
