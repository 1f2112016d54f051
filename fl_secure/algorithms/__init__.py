"""Federated algorithms: a registry of strategies keyed by short names."""

from fl_secure.algorithms.base import ClientUpdate, Exposure, Strategy
from fl_secure.algorithms.fedavg import FedAvg
from fl_secure.algorithms.fedgc import FedCos, FedGC
from fl_secure.algorithms.fedpe import FedPE
from fl_secure.algorithms.registry import ALGORITHMS, check_config, get_strategy, strategy_class

__all__ = [
    "ALGORITHMS",
    "ClientUpdate",
    "Exposure",
    "FedAvg",
    "FedCos",
    "FedGC",
    "FedPE",
    "Strategy",
    "check_config",
    "get_strategy",
    "strategy_class",
]
