"""Registry of federated strategies."""

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
from fl_secure.config import AlgorithmConfig
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


def get_strategy(
    name: str, params: AlgorithmConfig | None = None, *, head: str | None = None
) -> Strategy:
    """A strategy instance by name, with the run's algorithm settings.

    ``head``: the run's ``model.head``; FedGC regularizes a softmax head's raw class
    embeddings (Eq. 5 verbatim) and a margin head's directions. Unknown names list the
    allowed ones.
    """
    if name in ("hfmaml", "hfmaml-global") and params is not None:
        cls = HFMAMLGlobal if name == "hfmaml-global" else HFMAML
        return cls(params.alpha, params.beta, params.delta, params.embedding_reg)
    if name in ("fedgc", "fedcos") and params is not None:
        cls_gc = FedCos if name == "fedcos" else FedGC
        return cls_gc(params.reg_lambda, normalize=head != "softmax")
    if name == "adafedfr" and params is not None:
        return AdaFedFR(params.num_negatives)
    if name == "fedfr-public" and params is not None:
        return PublicDataShare(params.public_identities)
    if name == "fedfr" and params is not None:
        return FedFR(params.dcl_lambda, params.cfinch_threshold)
    if name == "fedaffect":
        return FedAffect(params)
    try:
        return ALGORITHMS[name]()
    except KeyError:
        raise ConfigError(
            f"unknown algorithm {name!r}; allowed: {', '.join(sorted(ALGORITHMS))}"
        ) from None
