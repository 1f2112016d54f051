"""Allowed values of the configuration: the closed sets of each mode, limits, the range check.

The sections (:mod:`fl_secure.config.data`, :mod:`~fl_secure.config.learning`,
:mod:`~fl_secure.config.protection`, :mod:`~fl_secure.config.run`) check their keys with
:func:`check`, whose :class:`~fl_secure.errors.ConfigError` names the key and what is allowed.
"""

from __future__ import annotations

import re
from typing import Literal

from fl_secure.errors import ConfigError

DataSource = Literal["synthetic", "folders", "celeba"]
PartitionKind = Literal["equal", "lognormal", "dirichlet", "attribute", "domain", "person"]
AlgorithmName = Literal[
    "fedavg",
    "fedpe",
    "fedgc",
    "fedcos",
    "hfmaml",
    "hfmaml-global",
    "adafedfr",
    "fedaffect",
    "fedfr-public",
    "fedfr",
]
Optimizer = Literal["sgd", "adam"]
LrSchedule = Literal["constant", "cosine"]
#: none; client (DP-FedAvg: a whole site is the record); example (DP-SGD on each site: one image);
#: identity (DP-SGD on each site over identities: one person, every image of them at the site)
PrivacyUnit = Literal["none", "client", "example", "identity"]
#: The units whose noise is DP-SGD's, added on each client in every step (placement "local").
DPSGD_UNITS: tuple[PrivacyUnit, ...] = ("example", "identity")
NoisePlacement = Literal["local", "distributed", "central"]
#: smallest privacy.noise_multiplier: privacy.dp.accountants.accountant.MIN_ACCOUNTED_NOISE, kept
#: here so that reading a config does not import the accountants (a test ties the two)
MIN_NOISE_MULTIPLIER = 0.05
#: The longest timeout a config may set (a week): larger ones overflow the waits' timers
#: and the task's deadline field, and no round should wait that long.
MAX_TIMEOUT = 7 * 24 * 3600.0
TIMEOUT_RANGE = "seconds in (0, 604800] (up to a week)"
RUN_NAME = re.compile(r"[^/\\\x00-\x1f\x7f.\s][^/\\\x00-\x1f\x7f]{0,99}")
AccountantName = Literal["", "rdp", "prv", "pld"]
ClippingEngine = Literal["auto", "book-keeping", "opacus"]
SecAggScheme = Literal["none", "secagg", "secagg+", "ckks"]


def check(ok: bool, key: str, allowed: str) -> None:
    """Raise a :class:`~fl_secure.errors.ConfigError` naming ``key`` and what is allowed.

    Raises:
        ConfigError: if not ``ok``.
    """
    if not ok:
        raise ConfigError(f"{key}: invalid value; allowed: {allowed}")
