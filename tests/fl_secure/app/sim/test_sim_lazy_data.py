"""A simulated population renders its cohorts' images, not the population's.

The engine's driver needs the held-out identities (its evaluation) and each worker a drawn
client's share; 10,000 virtual clients of the synthetic source must not cost 10,000 clients'
images at start, in the driver or in a worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_secure.app.sim.engine import SimulationEngine
from fl_secure.config import load_config
from tests.fl_secure.app.sim.tiny import tiny_toml
from tests.fl_secure.data.test_lazy_plan import count_renders

POPULATION, HELD_OUT, IMAGES, COHORT, EVALUATED = 10_000, 4, 2, 5, 3
CONFIG = tiny_toml(
    name="lazy-population", seed=11, identities=POPULATION + HELD_OUT, clients=POPULATION,
    images=IMAGES, held_out=HELD_OUT,
    train={"rounds": 1, "local_steps": 1, "batch_size": 2, "lr": 0.05},
    server={"min_clients": 2, "clients_per_round": COHORT},
)  # fmt: skip


def test_ten_thousand_clients_render_only_the_held_out_set_and_the_drawn_clients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: every image the synthetic generator renders counted, a 10,000-client run
    rendered = count_renders(monkeypatch)
    path = tmp_path / "population.toml"
    path.write_text(CONFIG)
    # Execute: the engine (the driver's plan), the untrained clients' scores, one round
    engine = SimulationEngine(load_config(path), evaluated=EVALUATED)
    at_start = sum(rendered)
    records, status = engine.run()
    # Assert: the driver rendered the held-out images only; then the worker its plan's
    # held-out images and each job's client (one train and one test image), of 20,008
    held_out = HELD_OUT * IMAGES
    assert status == "completed" and engine.server.population == POPULATION
    assert at_start == held_out == len(engine.server.plan.held_out)
    assert engine.cohort_sizes == [COHORT]
    assert sum(rendered) == 2 * held_out + (EVALUATED + COHORT) * IMAGES == 32
    assert [r["round"] for r in records] == [0, 1]
