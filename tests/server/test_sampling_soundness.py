"""A Poisson draw below ``min_clients`` is drawn again: the released round stays bounded.

The server redraws a cohort smaller than ``min_clients``, so the cohort a round is released
with is conditioned on its size, and its ids and size are published (``metrics.jsonl``,
the ledger's ``cohort_size``). The stated epsilon must bound that: here the round's
released cohort holds every client, so each is a sensitivity-``C`` Gaussian at ``z``
(dp_accounting's exact loss), not the subsampled one the drawn rate suggests.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
from dp_accounting.pld import privacy_loss_mechanism

from fl_secure.config import PrivacyConfig
from fl_secure.runs import RunDir
from privacy.dp.noise import seeded_source
from privacy.server_round import open_server_privacy
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings

from .coordinator_clients import answer_every_task  # type: ignore[import-not-found]

CLIENTS = ("c0", "c1", "c2")


class _ScriptedUniforms:
    """A sampler whose ``random()`` returns ``values`` in turn (Poisson draws per client)."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_a_short_poisson_draw_is_redrawn_and_the_release_stays_bounded(tmp_path: Path) -> None:
    # Prepare: central client-level DP, q = 0.5 of 3 clients, min_clients 2; the first draw
    # holds c2 alone (too small: drawn again), the second every client
    cfg = PrivacyConfig(unit="client", noise_placement="central", noise_multiplier=1.0)
    privacy = open_server_privacy(
        cfg, tmp_path / "ledger.sqlite", "run", rounds=1, population=3, clients_per_round=0,
        sample_rate=0.5, source=seeded_source(0, "s"),
    )  # fmt: skip
    assert privacy is not None
    settings = CoordinatorSettings(
        rounds=1, min_clients=2, sample_rate=0.5, round_timeout=30.0, max_retries=2,
        poll_wait=0.05, final_evaluation=False,
    )  # fmt: skip
    coord = Coordinator(
        settings, OrderedDict([("w", np.zeros((2, 2), np.float32))]), enrolled=set(CLIENTS),
        run_dir=RunDir(tmp_path), server_step=lambda p, u, r: p, privacy=privacy,
    )  # fmt: skip
    coord.membership._rng = _ScriptedUniforms([0.9, 0.9, 0.1, 0.1, 0.1, 0.1])  # type: ignore[assignment]
    for c in CLIENTS:
        coord.join(c, 10)
    driver = threading.Thread(target=coord.run)
    driver.start()
    workers = [threading.Thread(target=answer_every_task, args=(coord, c)) for c in CLIENTS]
    for w in workers:
        w.start()
    driver.join(timeout=60)
    for w in workers:
        w.join(timeout=10)
    # Act: the run released one round, from the second draw
    assert coord.status == "completed", coord.stop_reason
    (row,) = [e for e in privacy.ledger.entries() if e.kind == "client_level"]
    assert (row.payload["attempt"], row.payload["cohort_size"]) == (1, 3)
    # Assert: the stated epsilon bounds the Gaussian every published member went through
    exact = privacy_loss_mechanism.GaussianPrivacyLoss(1.0, sensitivity=1.0)
    assert exact.get_delta_for_epsilon(float(row.payload["epsilon"])) <= 1e-5  # type: ignore[arg-type]
    assert exact.get_delta_for_epsilon(0.99 * float(row.payload["epsilon"])) > 1e-5  # type: ignore[arg-type]
    summary = privacy.summary()
    assert summary["epsilon"] == row.payload["epsilon"]
    # the amplified figure does not bound a redrawn cohort: withdrawn, and the reason named
    assert summary["epsilon_amplified"] is None
    assert "rounds [1]" in summary["epsilon_amplified_trusts"]
