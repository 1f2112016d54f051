"""Run configuration: frozen dataclasses loaded from TOML and validated on load.

One dataclass per TOML section (:mod:`~fl_secure.config.data`,
:mod:`~fl_secure.config.learning`, :mod:`~fl_secure.config.protection`,
:mod:`~fl_secure.config.run`), their allowed values (:mod:`~fl_secure.config.values`),
reading (:mod:`~fl_secure.config.loading`) and writing back (:mod:`~fl_secure.config.to_toml`).
The checks that depend on ``algorithm.name`` belong to the algorithms, which sit above this
package: the entry points call :func:`fl_secure.algorithms.registry.check_config`.
"""

from fl_secure.config.data import DataConfig, PartitionConfig
from fl_secure.config.learning import AlgorithmConfig, EvalConfig, ModelConfig, TrainConfig
from fl_secure.config.loading import config_from_dict, load_config, parse_override
from fl_secure.config.protection import PrivacyConfig, SecureAggregationConfig
from fl_secure.config.run import Config, RunConfig, ServerConfig
from fl_secure.config.to_toml import (
    CLIENT_KEYS,
    config_fingerprint,
    config_sections_to_toml,
    config_to_toml,
)
from fl_secure.config.values import (
    MAX_TIMEOUT,
    MIN_NOISE_MULTIPLIER,
    AccountantName,
    AlgorithmName,
    ClippingEngine,
    DataSource,
    LrSchedule,
    NoisePlacement,
    Optimizer,
    PartitionKind,
    PrivacyUnit,
    SecAggScheme,
)

__all__ = [
    "CLIENT_KEYS",
    "MAX_TIMEOUT",
    "MIN_NOISE_MULTIPLIER",
    "AccountantName",
    "AlgorithmConfig",
    "AlgorithmName",
    "ClippingEngine",
    "Config",
    "DataConfig",
    "DataSource",
    "EvalConfig",
    "LrSchedule",
    "ModelConfig",
    "NoisePlacement",
    "Optimizer",
    "PartitionConfig",
    "PartitionKind",
    "PrivacyConfig",
    "PrivacyUnit",
    "RunConfig",
    "SecAggScheme",
    "SecureAggregationConfig",
    "ServerConfig",
    "TrainConfig",
    "config_fingerprint",
    "config_from_dict",
    "config_sections_to_toml",
    "config_to_toml",
    "load_config",
    "parse_override",
]
