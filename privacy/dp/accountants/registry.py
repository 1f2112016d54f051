"""Accountants by short name.

Defaults: ``"pld"`` for client-level DP (tight, and the only one that also analyses
fixed-size cohorts), ``"prv"`` for example-level DP (tight, as in Opacus). ``"rdp"`` is a
looser bound kept for comparison with published RDP figures.
"""

from __future__ import annotations

from typing import Final

from fl_secure.errors import PrivacyError
from privacy.dp.accountants.accountant import Accountant
from privacy.dp.accountants.pld import PLDAccountant
from privacy.dp.accountants.prv import PRVAccountant
from privacy.dp.accountants.rdp import RDPAccountant

ACCOUNTANTS: Final[dict[str, type[Accountant]]] = {
    "rdp": RDPAccountant,
    "prv": PRVAccountant,
    "pld": PLDAccountant,
}

DEFAULT_CLIENT_LEVEL: Final = "pld"
DEFAULT_EXAMPLE_LEVEL: Final = "prv"


def create_accountant(name: str) -> Accountant:
    """A fresh accountant registered under ``name``.

    Raises:
        PrivacyError: ``name`` is not registered (the message lists the allowed names).
    """
    try:
        cls = ACCOUNTANTS[name]
    except KeyError:
        raise PrivacyError(
            f"unknown accountant {name!r}; allowed: {', '.join(sorted(ACCOUNTANTS))}"
        ) from None
    return cls()
