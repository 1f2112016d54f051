"""A Poisson-sampled run's stated epsilon bounds the mechanism it actually releases.

Each round's cohort and its size are published (ledger ``cohort_size``, the ids in
``metrics.jsonl``, secure-aggregation records) and a draw smaller than ``min_clients`` is
drawn again. Under zero-out adjacency (the enrolled clients are public) the output is then
``(membership, releases)`` with a membership independent of the data, so its hockey-stick
divergence is the average over the membership of the Gaussian releases' (dp_accounting's
PLD): a client in ``k`` of ``T`` rounds at noise ``z`` is a Gaussian of std ``z / sqrt(k)``,
and ``k ~ Binomial(T, q')`` with ``q'`` the inclusion probability of a draw conditioned on
its size ``>= min_clients``. Against the server, which draws the cohort, ``k`` may be ``T``.

The Gaussian's delta(epsilon) is dp_accounting's analytic one (exact), and the bisection
returns an epsilon whose delta is still above the target: a lower bound of the true epsilon,
so a stated figure below it is proven wrong.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from dp_accounting.pld import privacy_loss_mechanism
from scipy.stats import binom

from fl_secure.config import PrivacyConfig
from privacy.ledger.guarantee import ledger_guarantee
from privacy.server_round import ServerPrivacy, open_server_privacy

DELTA = 1e-5


def _gaussian(std: float) -> privacy_loss_mechanism.GaussianPrivacyLoss:
    """A sensitivity-1 Gaussian of ``std``: dp_accounting's exact (analytic) privacy loss."""
    return privacy_loss_mechanism.GaussianPrivacyLoss(std, sensitivity=1.0)


def conditioned_inclusion(population: int, q: float, min_clients: int) -> float:
    """P(a client is in the cohort | the Poisson draw has >= ``min_clients`` members)."""
    others = binom.sf(min_clients - 2, population - 1, q)  # >= min_clients - 1 others drawn
    return float(q * others / binom.sf(min_clients - 1, population, q))


def published_epsilon(z: float, rounds: int, inclusion: float) -> float:
    """Epsilon at DELTA of ``rounds`` Gaussian releases, each with the client at ``inclusion``.

    The membership is published: delta(eps) = sum_k P(k) delta_{N(0, z^2 / k)}(eps).
    """
    weights = [(k, float(binom.pmf(k, rounds, inclusion))) for k in range(1, rounds + 1)]
    parts = [(w, _gaussian(z / math.sqrt(k))) for k, w in weights if w > 1e-15]

    def delta(eps: float) -> float:
        return sum(w * float(d.get_delta_for_epsilon(eps)) for w, d in parts)

    lo, hi = 0.0, 100.0
    for _ in range(50):  # delta is decreasing in epsilon
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta(mid) > DELTA else (lo, mid)
    return lo  # delta(lo) > DELTA: the true epsilon is above lo


def _run(
    tmp_path: Path, *, placement: str, z: float, q: float, population: int, rounds: int,
    attempt: int = 0,
) -> ServerPrivacy:  # fmt: skip
    """``rounds`` client-level rounds of a Poisson-sampled run, committed to its ledger."""
    cfg = PrivacyConfig(
        unit="client", noise_multiplier=z, clip_norm=1.0, delta=DELTA,
        accountant="pld", noise_placement=placement,
    )  # fmt: skip
    sp = open_server_privacy(
        cfg, tmp_path / "ledger.sqlite", "run", rounds=rounds, population=population,
        clients_per_round=0, sample_rate=q, min_survivors=1,
    )  # fmt: skip
    assert sp is not None
    for r in range(1, rounds + 1):
        metrics: dict[str, Any] = {f"c{i}": {} for i in range(3)}
        sp.commit(r, sp.round_entries(r, 3, metrics, attempt=attempt if r == 1 else 0))
    return sp


# z calibrated on main to epsilon 4 at the drawn rate: 0.949 (q 0.1, T 20), 1.137 (q 0.2, T 10)
Z_CENTRAL, Z_LOCAL = 0.94921875, 1.13671875


@pytest.fixture(scope="module")
def central(tmp_path_factory: pytest.TempPathFactory) -> ServerPrivacy:
    """Central noise, N = 20, q = 0.1, T = 20 at z 0.949 (one run for the tests below)."""
    return _run(
        tmp_path_factory.mktemp("central"), placement="central", z=Z_CENTRAL, q=0.1,
        population=20, rounds=20,
    )  # fmt: skip


def test_central_redrawn_published_cohorts_stated_epsilon_bounds_exact(
    central: ServerPrivacy,
) -> None:
    # central noise, N = 20, q = 0.1, T = 20, min_clients 2 (redrawn below it), ids published
    q1 = conditioned_inclusion(20, 0.1, 2)
    # in closed form: q (1 - P(no other)) / (1 - P(none) - P(exactly one))
    assert q1 == pytest.approx(0.1 * (1 - 0.9**19) / (1 - 0.9**20 - 2 * 0.9**19), rel=1e-9)
    exact = published_epsilon(Z_CENTRAL, 20, q1)
    sp = central
    stated, delta = ledger_guarantee(sp.ledger.entries())
    assert delta == DELTA
    assert exact > 5.0  # the amplified 3.99 main stated is below it
    assert float(stated) >= exact  # type: ignore[arg-type]
    summary = sp.summary()
    assert summary["epsilon"] == stated
    # add/remove is told apart by the published ids: the statement is zero-out
    assert summary["adjacency"] == "zero-out"
    # the amplified figure is beside it, and says whom it trusts
    assert summary["epsilon_amplified"] == pytest.approx(3.988, abs=1e-3)
    assert "server" in summary["epsilon_amplified_trusts"]
    assert "secret" in summary["epsilon_amplified_trusts"]


def test_central_min_clients_three_stated_epsilon_bounds_exact(central: ServerPrivacy) -> None:
    exact = published_epsilon(Z_CENTRAL, 20, conditioned_inclusion(20, 0.1, 3))
    assert exact > 6.0
    assert central.summary()["epsilon"] >= exact


def test_distributed_redrawn_published_cohorts_stated_epsilon_bounds_exact(
    tmp_path: Path,
) -> None:
    # distributed noise (t = 3 shares): the server holds the cohort; a sum carries >= z
    exact = published_epsilon(Z_CENTRAL, 20, conditioned_inclusion(20, 0.1, 3))
    sp = _run(tmp_path, placement="distributed", z=Z_CENTRAL, q=0.1, population=20, rounds=20)
    assert float(ledger_guarantee(sp.ledger.entries())[0]) >= exact  # type: ignore[arg-type]


def test_local_noise_poisson_figure_against_the_server_is_unamplified(tmp_path: Path) -> None:
    # The server draws the cohort: it may put one client in every round (k = T). Local noise
    # is stated to trust no one, so its epsilon must hold against the server.
    against_server = published_epsilon(Z_LOCAL, 10, 1.0)
    assert against_server > 8.0
    sp = _run(tmp_path, placement="local", z=Z_LOCAL, q=0.2, population=20, rounds=10)
    summary = sp.summary()
    assert summary["epsilon"] >= against_server
    assert summary["accounted_sample_rate"] == 1.0
    assert summary["client_sample_rate"] == 0.2
    # no amplified figure beside it: local noise is integer noise on a grid (zCDP-accounted),
    # for which amplification by sampling is not proven
    assert summary["epsilon_amplified"] is None
    assert "not proven for integer" in summary["epsilon_amplified_trusts"]


def test_a_redrawn_round_withdraws_the_amplified_figure(tmp_path: Path) -> None:
    # round 1 was released by the attempt after a short draw: the drawn cohort is
    # conditioned on its size, and the amplified figure no longer bounds anything
    sp = _run(tmp_path, placement="central", z=Z_CENTRAL, q=0.1, population=20, rounds=2,
              attempt=1)  # fmt: skip
    summary = sp.summary()
    assert summary["epsilon_amplified"] is None
    assert "rounds [1]" in summary["epsilon_amplified_trusts"]
    row = sp.ledger.entries()[0].payload
    assert (row["sample_rate"], row["cohort_sample_rate"], row["attempt"]) == (1.0, 0.1, 1)
