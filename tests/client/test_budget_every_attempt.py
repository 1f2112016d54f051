"""A site holds its own budget before every update it releases, a retry of a round included.

An attempt that fails at the server (too few updates) still released this site's update: it
was counted before the upload started. The retry's task, a new nonce for the same round, is
a second release, held against what is left of the site's budgets.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from client.app import FlClient
from client.transport import Connection
from fl_secure.config import config_from_dict, config_to_toml
from fl_secure.messages import LocalTraining, Task, TaskKind
from fl_secure.training import local_training
from privacy.client_round import ClientPrivacy
from privacy.dp.calibration import epsilon_for
from privacy.dp.noise import SeededGaussian
from privacy.dp.zcdp import composed_rho, zcdp_epsilon
from privacy.ledger.site_ledger import SiteLedger


def _task(round_: int, nonce: bytes) -> Task:
    return Task(kind=TaskKind.TRAIN, round=round_, nonce=nonce, training=LocalTraining())


def test_a_sites_budget_refuses_the_retry_of_a_round_it_already_released(tmp_path: Path) -> None:
    # Prepare: client-level DP, local noise z = 2, two retries allowed; a site budget that
    # one release fits (epsilon 2.17 against the server) and two do not (3.19)
    config = config_from_dict(
        {"partition": {"num_clients": 3}, "server": {"min_clients": 2, "max_retries": 2},
         "train": {"rounds": 4},
         "privacy": {"unit": "client", "noise_placement": "local", "noise_multiplier": 2.0}}
    )  # fmt: skip
    # local noise is integer noise: its zCDP bound, rho = n / (2 z^2) (+1e-9), converted by
    # Canonne, Kamath & Steinke 2020, Prop. 12
    one, two = (zcdp_epsilon(composed_rho([2.0] * n), 1e-5) for n in (1, 2))
    assert one == pytest.approx(2.1658, abs=1e-3) and two == pytest.approx(3.1890, abs=1e-3)
    site = SiteLedger(tmp_path, max_epsilon=(one + two) / 2, delta=1e-5)
    client = FlClient(Connection("localhost:1", "client-0"), lambda r: None, site=site)  # type: ignore[arg-type,return-value]
    client._hold_run_config(config_to_toml(config), "run")
    first = _task(1, b"a" * 16)
    assert client._refuse_training(first) == ""
    client._count_release(first)  # counted before the upload; the attempt then failed
    # Execute: the server retries round 1 (a new nonce, within server.max_retries)
    retry = _task(1, b"b" * 16)
    refusal = client._refuse_training(retry)
    # Assert: refused for the budget, also by a restarted client; one release counted
    assert f"above its budget of {(one + two) / 2:g}" in refusal
    assert "above its budget" in SiteLedger(tmp_path, max_epsilon=(one + two) / 2).refusal(
        config, "run", 1, b"b" * 16, last_round=0
    )
    assert [(r.round, r.nonce) for r in site.releases] == [(1, (b"a" * 16).hex())]
    assert site.epsilon() == pytest.approx(one, rel=1e-9)  # 2.17: within the budget


def test_an_example_level_client_does_not_train_a_retry_past_the_runs_budget() -> None:
    # Prepare: 640 images, q = 0.05, 20 DP-SGD steps a round, z = 1; a target one round fits
    config = config_from_dict(
        {"train": {"rounds": 10, "local_epochs": 1, "batch_size": 32},
         "privacy": {"unit": "example", "noise_multiplier": 1.0, "target_epsilon": 2.2}}
    )  # fmt: skip
    privacy = ClientPrivacy(config, num_examples=640, source=SeededGaussian(0))
    one, two = (
        epsilon_for(accountant="prv", noise_multiplier=1.0, sample_rate=0.05, steps=s, delta=1e-5)
        for s in (20, 40)
    )
    assert one <= 2.2 < two
    zero = OrderedDict(w=np.zeros(3, np.float32))
    task = local_training(config.train)  # round 1's task, and its retry's
    assert privacy.may_train(task)
    privacy.release(zero, {"local_steps": 20.0}, trained=True)  # attempt 0, which then failed
    # Execute / Assert: the retry of round 1 would be a second round's steps: not trained; the
    # data-independent update it sends instead costs nothing
    assert not privacy.may_train(task)
    _, idle = privacy.release(zero, {}, trained=False)
    assert idle["dp_steps"] == 0.0 and math.isclose(idle["dp_epsilon"], one, rel_tol=1e-6)
