"""Registry of federated strategies: the names ``algorithm.name`` takes, and their classes.

Callers ask the class what they need to know of a design (:meth:`Strategy.from_config`,
:meth:`Strategy.check_config`, :attr:`Strategy.evaluates_expressions`, what it shares and
uploads) instead of comparing names; a test keeps name comparisons out of the other packages.
"""

from __future__ import annotations

from fl_secure.algorithms.adafedfr import AdaFedFR
from fl_secure.algorithms.base import Strategy
from fl_secure.algorithms.fedaffect import FedAffect
from fl_secure.algorithms.fedavg import FedAvg
from fl_secure.algorithms.fedfr import FedFR
from fl_secure.algorithms.fedgc import FedCos, FedGC
from fl_secure.algorithms.fedpe import FedPE
from fl_secure.algorithms.hfmaml import HFMAML, HFMAMLGlobal
from fl_secure.algorithms.publicshare import PublicDataShare
from fl_secure.config import AlgorithmConfig, Config
from fl_secure.errors import ConfigError

ALGORITHMS: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        FedPE,
        FedGC,
        FedCos,
        HFMAML,
        HFMAMLGlobal,
        AdaFedFR,
        FedAffect,
        PublicDataShare,
        FedFR,
    )
}


def strategy_class(name: str) -> type[Strategy]:
    """The strategy class registered under ``name``.

    Raises:
        ConfigError: an unknown name (the message lists the allowed ones).
    """
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            f"unknown algorithm {name!r}; allowed: {', '.join(sorted(ALGORITHMS))}"
        ) from None


def get_strategy(
    name: str,
    params: AlgorithmConfig | None = None,
    *,
    head: str | None = None,
    scale: float | None = None,
) -> Strategy:
    """A strategy instance by name, with the run's algorithm settings.

    ``head`` and ``scale``: the run's ``model.head`` and ``model.scale``; FedGC regularizes a
    softmax head's raw class embeddings (Eq. 5 verbatim) and a margin head's directions at
    the head's logit scale (unless ``algorithm.reg_scale`` sets one). Unknown names list the
    allowed ones.
    """
    return strategy_class(name).from_config(params, head=head, scale=scale)


def check_config(config: Config) -> None:
    """Refuse a run config that its algorithm would not run as it reads.

    Loading a config checks every key and every combination that does not depend on the
    algorithm; the algorithm's own refusals (:meth:`Strategy.check_config`) need the
    registry, which sits above :mod:`fl_secure.config`. Every entry point that turns a loaded
    config into a run calls this: ``fl-secure train``, ``server``, ``client --config``,
    ``eval`` and ``experiment``, the simulation, the server's setup and a client joining a run.

    Raises:
        ConfigError: naming the setting, why the algorithm refuses it, and what to use instead.
    """
    strategy_class(config.algorithm.name).check_config(config)
