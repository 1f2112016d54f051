"""A CKKS round's setup: a client refuses one weaker than the run config it joined."""

from __future__ import annotations

import dataclasses

import pytest

from fl_secure.config import config_from_dict
from fl_secure.errors import ProtocolError
from privacy.ckks.round_setup import CkksSetup, check_ckks_setup


def test_a_ckks_client_refuses_a_setup_that_leaves_layers_in_the_clear() -> None:
    config = config_from_dict(
        {"partition": {"num_clients": 4}, "server": {"min_clients": 3},
         "secure_aggregation": {"scheme": "ckks"}}
    )  # fmt: skip
    names = ["w", "b"]
    honest = CkksSetup(round_id=b"r" * 16, cohort=("a", "b", "c"), layers=None, min_count=3)
    check_ckks_setup(honest, config, names)
    with pytest.raises(ProtocolError, match=r"encrypted layers \['b'\] \(the run config gives all"):
        check_ckks_setup(dataclasses.replace(honest, layers=("b",)), config, names)
    with pytest.raises(ProtocolError, match="min_count 1 < server.min_clients 3"):
        check_ckks_setup(dataclasses.replace(honest, min_count=1), config, names)
