"""Identity-level DP around the training: the client's plan and accountant, the server's rows."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from opacus.accountants import PRVAccountant as OpacusPRV

from fl_secure.config import PrivacyConfig, config_from_dict
from fl_secure.errors import PrivacyError
from fl_secure.messages import LocalTraining
from privacy.client_round import ClientPrivacy
from privacy.dp.calibration import epsilon_for
from privacy.dp.noise import SeededGaussian
from privacy.ledger.formatting import ledger_json
from privacy.ledger.guarantee import ledger_guarantee
from privacy.ledger.site_release import release_for
from privacy.server_round import open_server_privacy

DELTA = 1e-5
# 640 images of 40 identities, batch 32: q = 32 / 640 = 0.05 per identity, one local epoch
# is round(1 / q) = 20 steps
TABLE: dict[str, Any] = {
    "train": {"rounds": 10, "local_epochs": 1, "batch_size": 32},
    "privacy": {"unit": "identity", "noise_multiplier": 1.1},
}


def _pld_reference(z: float, q: float, t: int) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, t))
    return float(acc.get_epsilon(DELTA))


@pytest.mark.parametrize("accountant", ["prv", "pld"])
def test_the_identity_accountant_is_the_reference_librarys_for_q_z_and_steps(
    tmp_path: Path, accountant: str
) -> None:
    # Prepare: the planned (z, q, steps) over the site's 40 identities
    cfg = config_from_dict({**TABLE, "privacy": {**TABLE["privacy"], "accountant": accountant}})
    privacy = ClientPrivacy(
        cfg, num_examples=640, num_identities=40, state_dir=tmp_path, source=SeededGaussian(0)
    )
    assert (privacy.sample_rate, privacy.steps_per_round) == (0.05, 20)
    assert privacy.num_examples == 40  # the records are identities
    zero = OrderedDict(w=np.zeros(3, np.float32))
    # Execute: two rounds released
    for _ in range(2):
        _, metrics = privacy.release(zero, {"local_steps": 20.0}, trained=True)
    # Assert: the epsilon is the reference library's for (z = 1.1, q = 0.05, 40 steps)
    if accountant == "prv":
        reference = OpacusPRV()
        reference.history = [(1.1, 0.05, 40)]
        assert metrics["dp_epsilon"] == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)
    else:
        assert metrics["dp_epsilon"] == pytest.approx(_pld_reference(1.1, 0.05, 40), rel=1e-9)
    assert 0.5 < metrics["dp_epsilon"] < 5  # not a trivial figure
    assert (metrics["dp_sample_rate"], metrics["dp_steps"]) == (0.05, 20.0)


def test_the_identity_rate_and_steps_count_identities_not_images() -> None:
    # Prepare: the same site as 640 images of 8 identities, with privacy.sample_rate = 0.25
    cfg = config_from_dict(
        {**TABLE, "privacy": {"unit": "identity", "noise_multiplier": 1.0, "sample_rate": 0.25}}
    )
    # Execute
    privacy = ClientPrivacy(cfg, num_examples=640, num_identities=8)
    # Assert: 1 epoch = round(1 / 0.25) = 4 steps of the 8 identities
    assert (privacy.sample_rate, privacy.steps_per_round, privacy.num_examples) == (0.25, 4, 8)
    assert privacy.planned_dpsgd(LocalTraining(local_epochs=1)) == (1.0, 0.25, 4)
    # ... and a site that cannot name its identities is refused before training
    with pytest.raises(PrivacyError, match="needs the number of identities"):
        ClientPrivacy(cfg, num_examples=640)


def test_identity_level_calibrates_to_the_target_over_the_planned_rounds() -> None:
    cfg = config_from_dict(
        {
            "train": {"rounds": 5, "local_epochs": 1, "batch_size": 32},
            "privacy": {"unit": "identity", "target_epsilon": 4.0},
        }
    )
    privacy = ClientPrivacy(cfg, num_examples=640, num_identities=40)
    total = epsilon_for(accountant="prv", noise_multiplier=privacy.noise_multiplier,
                        sample_rate=0.05, steps=5 * 20, delta=DELTA)  # fmt: skip
    assert 0.99 * 4.0 <= total <= 4.0
    assert privacy.train_fn() is not None


def test_the_servers_rows_name_the_identity_unit_and_compose_the_steps(tmp_path: Path) -> None:
    # Prepare: the server side of an identity-level run; one client, three rounds of 20 steps
    cfg = PrivacyConfig(unit="identity", noise_multiplier=1.1, delta=DELTA)
    session = open_server_privacy(
        cfg, tmp_path / "ledger.sqlite", "run1", rounds=3, population=1,
        clients_per_round=0, sample_rate=0.0, source=SeededGaussian(0),
    )  # fmt: skip
    assert session is not None
    session.resume(0, [])
    metrics = {"dp_epsilon": 0.1, "dp_steps": 20.0, "dp_noise_multiplier": 1.1,
               "dp_sample_rate": 0.05}  # fmt: skip
    # Execute
    for r in (1, 2, 3):
        session.commit(r, session.round_entries(r, 1, {"A": metrics}))
    # Assert: example_level rows (one client's DP-SGD release) whose payload says identity
    entries = session.ledger.entries()
    assert [(e.kind, e.round, e.payload["privacy_unit"]) for e in entries] == [
        ("example_level", r, "identity") for r in (1, 2, 3)
    ]
    three = epsilon_for(accountant="prv", noise_multiplier=1.1, sample_rate=0.05, steps=60,
                        delta=DELTA)  # fmt: skip
    assert ledger_guarantee(entries)[0] == pytest.approx(three, rel=1e-6)
    assert ledger_json(entries, None)["privacy_unit"] == "identity"
    summary = session.summary()
    assert summary["privacy_unit"] == "identity" and summary["noise_placement"] == "local"
    assert summary["accountant"] == "prv"


def test_a_site_ledger_row_of_an_identity_release_keeps_its_dpsgd_figures() -> None:
    # the site's own record: (z, q, steps) kept, counted like an example-level release
    cfg = config_from_dict(TABLE)
    row = release_for(cfg, "run1", 1, b"\x01", (1.1, 0.05, 20))
    assert (row.unit, row.dpsgd_noise_multiplier, row.dpsgd_sample_rate) == ("identity", 1.1, 0.05)
    assert row.example_events(own=True) == (0.0, (1.1, 0.05, 20))
    unknown = release_for(cfg, "run1", 2, b"\x02")  # steps not stated: unbounded, never free
    assert unknown.dpsgd_steps == -1 and unknown.example_events(own=True)[0] == float("inf")
