"""Seeded DP noise is no noise against the server: the site ledger counts it as unbounded.

``privacy.secure_rng = false`` seeds each client's noise from ``run.seed`` and the client id
(:func:`privacy.dp.noise.seeded_source`), both of which the server knows: it can draw the same
noise and subtract it. A client joins such a run only with ``--accept-seeded-noise`` (the
embedded mode's own clients pass it); its site ledger must then not state a finite epsilon.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from fl_secure.config import Config, config_from_dict
from fl_secure.errors import PrivacyError
from privacy.client_round import ClientPrivacy
from privacy.dp.noise import seeded_source
from privacy.ledger.site_ledger import SiteLedger


def _config(secure_rng: bool, **privacy: object) -> Config:
    scheme = "secagg" if privacy.get("noise_placement") == "distributed" else "none"
    return config_from_dict(
        {"run": {"seed": 7}, "partition": {"num_clients": 4}, "server": {"min_clients": 3},
         "privacy": {"unit": "client", "noise_multiplier": 2.0, "secure_rng": secure_rng,
                     **privacy},
         "secure_aggregation": {"scheme": scheme}}
    )  # fmt: skip


def test_the_server_can_subtract_seeded_noise() -> None:
    # The premise: what the server knows (run.seed, the client id) regenerates the noise
    config = _config(False, clip_norm=1.0)
    update = OrderedDict(w=np.full(64, 0.05, np.float32))
    client = ClientPrivacy(config, num_examples=10, source=seeded_source(7, "client-1"))
    released, _ = client.release(update, {}, trained=True)
    replay = ClientPrivacy(config, num_examples=10, source=seeded_source(7, "client-1"))
    again, _ = replay.release(OrderedDict(w=np.zeros(64, np.float32)), {}, trained=True)
    # the same noise: the difference is the (rounded) update itself, to the grid's step
    assert np.abs((released["w"] - again["w"]) - 0.05).max() < 1e-3


@pytest.mark.parametrize("placement", ["local", "distributed"])
def test_a_seeded_release_makes_every_site_figure_unbounded(tmp_path: Path, placement: str) -> None:
    site = SiteLedger(tmp_path)
    seeded = _config(False, noise_placement=placement)
    secure = _config(True, noise_placement=placement)
    # Execute: one release with CSPRNG noise, then one with seeded noise
    site.record(secure, "run-a", 1, b"a" * 16)
    assert math.isfinite(site.epsilon())
    site.record(seeded, "run-b", 1, b"b" * 16)
    # Assert: against the server, the seeded release has no noise at all
    assert site.epsilon() == math.inf
    assert site.epsilon(colluding_peers=True) == math.inf
    assert site.example_epsilon() == math.inf
    summary = SiteLedger(tmp_path).summary()  # also as read back from the file
    assert summary["epsilon"] == math.inf
    assert summary["releases_without_client_level_noise"] == 1


def test_a_seeded_example_level_release_is_unbounded_for_one_image(tmp_path: Path) -> None:
    config = _config(False, unit="example", noise_multiplier=1.0)
    site = SiteLedger(tmp_path)
    site.record(config, "run", 1, b"a" * 16, dpsgd=(1.0, 0.05, 20))
    assert site.example_epsilon() == math.inf


def test_a_site_with_a_budget_refuses_a_seeded_run(tmp_path: Path) -> None:
    with pytest.raises(PrivacyError, match=r"seeded \(privacy.secure_rng = false\)"):
        SiteLedger(tmp_path, max_epsilon=8.0).check_run(_config(False))
    SiteLedger(tmp_path, max_epsilon=8.0).check_run(_config(True))  # the same run, CSPRNG
