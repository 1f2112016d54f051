"""A simulated client-level DP run's accounting is dp_accounting's for the mechanism it ran.

The engine draws a cohort per round (Poisson at ``server.sample_rate`` or
``server.clients_per_round`` of the population), clips each update and adds Gaussian noise
of std ``z C`` to the sum (central placement), and commits one ledger row per released model.
The epsilon it states is recomputed here from dp_accounting directly (and, for Poisson
cohorts, from the closed form of composed Gaussian mechanisms), with the rounds the ledger
says were released.
"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.optimize import brentq
from scipy.stats import norm

from fl_secure.app.cli.console import main
from fl_secure.app.simulated_run import write_simulated_run
from fl_secure.config import load_config
from tests.fl_secure.app.sim.tiny import tiny_toml

POPULATION = 24
BASE = tiny_toml(
    name="simdp", seed=7, identities=54, clients=24,
    train={"rounds": 3, "local_steps": 1, "batch_size": 4, "lr": 0.05},
    server={"min_clients": 2},
    extra='[privacy]\nunit = "client"\nnoise_placement = "central"\nnoise_multiplier = 1.3\n'
    "clip_norm = 0.5\ndelta = 1e-5\n",
)  # fmt: skip
Z, DELTA = 1.3, 1e-5


def _run(tmp_path: Path, overrides: list[str]) -> tuple[dict, list[dict], Path]:
    path = tmp_path / "simdp.toml"
    path.write_text(BASE)
    config = load_config(path, overrides)
    run = write_simulated_run(config, tmp_path / "runs")
    summary = json.loads((run / "summary.json").read_text())
    with sqlite3.connect(run / "ledger.sqlite") as db:
        rows = [
            {"kind": k, "round": r, **json.loads(p)}
            for k, r, p in db.execute("SELECT kind, round, payload FROM entries ORDER BY seq")
        ]
    return summary, rows, run


def _gaussian_composition_epsilon(rounds: int, z: float, delta: float) -> float:
    """Exact epsilon of ``rounds`` Gaussian mechanisms of noise ``z`` (Balle & Wang 2018).

    Their composition is one Gaussian mechanism with ``mu = sqrt(rounds) / z``; its privacy
    profile is ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``.
    """
    mu = math.sqrt(rounds) / z

    def gap(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return float(brentq(gap, 0.0, 100.0))


def test_poisson_cohorts_are_accounted_as_dp_accounting_says(tmp_path: Path) -> None:
    # Execute: Poisson cohorts at q = 0.5, PLD accountant
    summary, rows, run = _run(
        tmp_path, ["server.sample_rate=0.5", "privacy.accountant=pld", "server.min_clients=1"]
    )
    # Assert: one client_level row per released round, drawn at q and accounted at rate 1
    # (each cohort is published: no amplification in the stated figure)
    released = [r for r in rows if r["kind"] == "client_level"]
    assert summary["status"] == "completed" and len(released) == 3
    assert all(r["cohort_sample_rate"] == 0.5 and r["sample_rate"] == 1.0 for r in released)
    assert [r["cohort_size"] for r in released] == summary["cohort_sizes"]
    # ... the stated epsilon: dp_accounting's PLD of 3 Gaussian mechanisms, and the closed form
    pld = pld_privacy_accountant.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    pld.compose(dp_accounting.GaussianDpEvent(Z), 3)
    assert summary["epsilon"] == pytest.approx(pld.get_epsilon(DELTA), rel=1e-6)
    assert summary["epsilon"] == pytest.approx(_gaussian_composition_epsilon(3, Z, DELTA), rel=2e-3)
    # ... and the amplified figure beside it: Poisson-subsampled Gaussian at the drawn rate
    sampled = pld_privacy_accountant.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    sampled.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(Z)), 3)
    amplified = summary["privacy"]["epsilon_amplified"]
    assert amplified == pytest.approx(sampled.get_epsilon(DELTA), rel=1e-6)
    assert amplified < summary["epsilon"]


def test_fixed_size_cohorts_are_accounted_as_dp_accounting_says(tmp_path: Path) -> None:
    # Execute: 6 of the 24 clients a round, PLD accountant (fixed size: replace-one RDP)
    summary, rows, run = _run(tmp_path, ["server.clients_per_round=6", "privacy.accountant=pld"])
    released = [r for r in rows if r["kind"] == "client_level"]
    assert summary["cohort_sizes"] == [6, 6, 6] and len(released) == 3
    # Assert: replace-one moves a clipped sum by 2C: the noise-to-sensitivity ratio is z / 2
    rdp = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        POPULATION, 6, dp_accounting.GaussianDpEvent(Z / 2)
    )
    rdp.compose(event, 3)
    assert summary["epsilon"] == pytest.approx(rdp.get_epsilon(DELTA), rel=1e-6)
    assert [r["epsilon"] for r in released][-1] == summary["epsilon"]
    # ... and the run folder reads as a gRPC run's: the ledger's chain and signed head verify
    # against summary.json and the released checkpoint, and the compliance report is written
    assert main(["privacy", "ledger", "--run", str(run), "--verify", "--json"]) == 0
    assert main(["report", "--run", str(run), "--format", "json", "--quiet"]) == 0
    report = json.loads((run / "report" / "report.json").read_text())
    assert "epsilon" in json.dumps(report)


def test_the_budget_stops_a_simulated_run_before_it_is_passed(tmp_path: Path) -> None:
    # Prepare: a target between the epsilon of 2 and of 3 rounds
    two = _gaussian_composition_epsilon(2, Z, DELTA)
    three = _gaussian_composition_epsilon(3, Z, DELTA)
    target = (two + three) / 2
    # Execute
    summary, rows, run = _run(
        tmp_path,
        [
            "server.sample_rate=0.5",
            "server.min_clients=1",
            "privacy.accountant=pld",
            f"privacy.target_epsilon={target}",
        ],
    )
    # Assert: two rounds released and accounted, the third refused before it ran
    assert summary["status"] == "budget_exhausted"
    assert summary["rounds_completed"] == 2
    assert [r["round"] for r in rows if r["kind"] == "client_level"] == [1, 2]
    assert [r["round"] for r in rows if r["kind"] == "note"] == [3]
    assert summary["epsilon"] <= target


def test_the_audits_attack_a_simulated_run_as_a_real_one(tmp_path: Path) -> None:
    # Prepare: a simulated client-level DP run folder (fixed-size cohorts)
    summary, _, run = _run(tmp_path, ["server.clients_per_round=6"])
    # Execute: the attack audit on it, small budgets
    args = ["audit", "--run", str(run), "--steps", "3", "--targets", "2", "--canary-trials", "4"]
    assert main([*args, "--json", "--quiet"]) == 0
    # Assert: the audit read the run's final checkpoint, design and mechanism, and its canary
    # audit states the ledger's epsilon and the mechanism the engine ran
    audit = json.loads((run / "audit" / "results.json").read_text())
    assert audit["checkpoint_round"] == 3 and audit["exposure"] == "global-head"
    canary = audit["attacks"]["canary"]
    assert canary["accountant_epsilon"] == pytest.approx(summary["epsilon"], rel=1e-12)
    mechanism = canary["mechanism"]
    assert mechanism["noise_multiplier"] == Z and mechanism["clip_norm"] == 0.5
    assert mechanism["client_sample_rate"] == pytest.approx(6 / POPULATION)
    assert mechanism["rounds"] == 3 and mechanism["noise_placement"] == "central"
    assert {v["party"] for v in audit["views"]} == {"server", "curious_client"}
