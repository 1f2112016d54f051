"""Privacy accountants for DP-SGD / DP-FedAvg (RDP, PRV, PLD) and their registry."""

from privacy.dp.accountants.accountant import (
    ADJACENCY,
    Accountant,
    PrivacyEvent,
    Sampling,
)
from privacy.dp.accountants.pld import PLDAccountant
from privacy.dp.accountants.prv import PRVAccountant
from privacy.dp.accountants.rdp import RDPAccountant
from privacy.dp.accountants.registry import (
    ACCOUNTANTS,
    DEFAULT_CLIENT_LEVEL,
    DEFAULT_EXAMPLE_LEVEL,
    create_accountant,
)

__all__ = [
    "ACCOUNTANTS",
    "ADJACENCY",
    "DEFAULT_CLIENT_LEVEL",
    "DEFAULT_EXAMPLE_LEVEL",
    "Accountant",
    "PLDAccountant",
    "PRVAccountant",
    "PrivacyEvent",
    "RDPAccountant",
    "Sampling",
    "create_accountant",
]
