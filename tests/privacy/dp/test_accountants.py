"""Accountants against published figures, their reference libraries, and invariants."""

from __future__ import annotations

import json

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from opacus.accountants import PRVAccountant as OpacusPRV
from opacus.accountants import RDPAccountant as OpacusRDP

from fl_secure.config import MIN_NOISE_MULTIPLIER
from fl_secure.errors import PrivacyError
from privacy.dp.accountants.accountant import MIN_ACCOUNTED_NOISE, Accountant, client_adjacency
from privacy.dp.accountants.registry import ACCOUNTANTS, create_accountant

DELTA = 1e-5


def _eps(name: str, z: float, q: float, t: int) -> float:
    acc = create_accountant(name)
    acc.step(noise_multiplier=z, sample_rate=q, num_steps=t)
    return acc.get_epsilon(DELTA)


# Published figures (delta 1e-5, add/remove, Poisson): Opacus / dp_accounting tutorials.
@pytest.mark.parametrize(
    ("name", "q", "z", "t", "published"),
    [
        ("rdp", 0.01, 4.0, 10_000, 1.035),
        ("pld", 0.01, 4.0, 10_000, 0.947),
        ("prv", 0.01, 4.0, 10_000, 0.957),
        ("rdp", 0.04, 1.5, 2_250, 7.329),
        ("prv", 0.04, 1.5, 2_250, 6.777),
    ],
)
def test_published_figures(name: str, q: float, z: float, t: int, published: float) -> None:
    assert _eps(name, z, q, t) == pytest.approx(published, abs=0.01)


def _pld_reference(z: float, q: float, t: int) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, t))
    return float(acc.get_epsilon(DELTA))


GRID = [(0.02, 1.0, 200), (0.1, 2.0, 50), (0.005, 0.8, 1_000)]


@pytest.mark.parametrize(("q", "z", "t"), GRID)
def test_grid_matches_reference_libraries(q: float, z: float, t: int) -> None:
    # Prepare: each reference library called directly.
    opacus_rdp = OpacusRDP()
    opacus_rdp.history = [(z, q, t)]
    opacus_prv = OpacusPRV()
    opacus_prv.history = [(z, q, t)]
    google_rdp = rdp_privacy_accountant.RdpAccountant()
    google_rdp.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t
        )
    )
    # Execute / Assert: exact for wrappers, close for an independent implementation.
    rdp = _eps("rdp", z, q, t)
    assert rdp == pytest.approx(opacus_rdp.get_epsilon(DELTA), rel=1e-12)
    assert rdp == pytest.approx(google_rdp.get_epsilon(DELTA), rel=2e-3)
    prv = _eps("prv", z, q, t)
    assert prv == pytest.approx(opacus_prv.get_epsilon(DELTA), rel=1e-9)
    pld = _eps("pld", z, q, t)
    assert pld == pytest.approx(_pld_reference(z, q, t), rel=1e-9)
    # Tight accountants agree with each other; RDP is an upper bound on both.
    assert prv == pytest.approx(pld, rel=0.03, abs=0.02)
    assert rdp >= pld


@pytest.mark.parametrize("name", sorted(ACCOUNTANTS))
def test_monotone_in_sigma_steps_and_rate(name: str) -> None:
    base = _eps(name, 1.0, 0.02, 200)
    assert _eps(name, 1.5, 0.02, 200) < base
    assert _eps(name, 1.0, 0.02, 400) > base
    assert _eps(name, 1.0, 0.04, 200) > base


@pytest.mark.parametrize("name", sorted(ACCOUNTANTS))
def test_steps_merge_and_split_agree(name: str) -> None:
    one = create_accountant(name)
    one.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=200)
    many = create_accountant(name)
    for _ in range(200):
        many.step(noise_multiplier=1.0, sample_rate=0.02)
    assert len(many) == 1
    assert many.get_epsilon(DELTA) == one.get_epsilon(DELTA)


@pytest.mark.parametrize("name", sorted(ACCOUNTANTS))
def test_state_dict_round_trip(name: str) -> None:
    acc = create_accountant(name)
    acc.step(noise_multiplier=1.2, sample_rate=0.02, num_steps=100)
    acc.step(noise_multiplier=0.9, sample_rate=0.05, num_steps=30)
    state = json.loads(json.dumps(acc.state_dict()))
    restored = create_accountant(name)
    restored.load_state_dict(state)
    assert restored.history == acc.history
    assert restored.get_epsilon(DELTA) == acc.get_epsilon(DELTA)


def test_state_dict_rejects_other_accountant_and_keeps_history() -> None:
    acc = create_accountant("pld")
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(PrivacyError, match="'rdp'"):
        acc.load_state_dict({"mechanism": "rdp", "history": []})
    with pytest.raises(PrivacyError, match="sample_rate"):
        acc.load_state_dict({"mechanism": "pld", "history": [{"noise_multiplier": 1.0}]})
    assert len(acc) == 1


def test_empty_history_spends_nothing() -> None:
    for name in ACCOUNTANTS:
        assert create_accountant(name).get_epsilon(DELTA) == 0.0


def test_fixed_size_cohorts_pld_finite_replace_one() -> None:
    acc = create_accountant("pld")
    acc.step(
        noise_multiplier=4.0,
        sample_rate=0.01,
        num_steps=10_000,
        sampling="fixed_size",
        population=1_000,
    )
    eps = acc.get_epsilon(DELTA)
    # Reference: dp_accounting's RDP for sampling without replacement, replace-one, with the
    # clipped sum's replace-one sensitivity 2C (noise-to-sensitivity ratio z / 2).
    ref = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    ref.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(
                1_000, 10, dp_accounting.GaussianDpEvent(2.0)
            ),
            10_000,
        )
    )
    assert eps == pytest.approx(ref.get_epsilon(DELTA), rel=1e-12)
    assert 0 < eps < 10
    assert acc.ledger_adjacency == "replace-one"
    with pytest.raises(PrivacyError, match="cannot compose"):
        acc.step(noise_multiplier=4.0, sample_rate=0.01)


@pytest.mark.parametrize("name", ["rdp", "prv"])
def test_fixed_size_cohorts_rejected_by_opacus_accountants(name: str) -> None:
    acc: Accountant = create_accountant(name)
    with pytest.raises(PrivacyError, match="'pld'"):
        acc.step(noise_multiplier=4.0, sample_rate=0.01, sampling="fixed_size", population=1000)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"noise_multiplier": 0.0, "sample_rate": 0.1}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "sample_rate": 0.0}, "sample_rate"),
        ({"noise_multiplier": 1.0, "sample_rate": 1.1}, "sample_rate"),
        ({"noise_multiplier": 1.0, "sample_rate": 0.1, "num_steps": 0}, "num_steps"),
        ({"noise_multiplier": 1.0, "sample_rate": 0.1, "sampling": "fixed_size"}, "population"),
        (
            {
                "noise_multiplier": 1.0,
                "sample_rate": 0.015,
                "sampling": "fixed_size",
                "population": 100,
            },
            "cohort",
        ),
    ],
)
def test_step_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(PrivacyError, match=match):
        create_accountant("pld").step(**kwargs)  # type: ignore[arg-type]


def test_bad_delta_and_unknown_accountant() -> None:
    acc = create_accountant("rdp")
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(PrivacyError, match="delta"):
        acc.get_epsilon(1.0)
    with pytest.raises(PrivacyError, match="pld, prv, rdp"):
        create_accountant("gdp")


def test_registry_names_and_adjacency() -> None:
    for name, cls in ACCOUNTANTS.items():
        assert cls.name == name == cls.mechanism()
        assert cls.adjacency == "add/remove"


@pytest.mark.parametrize("name", sorted(ACCOUNTANTS))
def test_noise_too_small_to_account_is_refused_before_any_grid_is_built(name: str) -> None:

    assert MIN_NOISE_MULTIPLIER == MIN_ACCOUNTED_NOISE  # the config refuses what is not accounted

    acc = create_accountant(name)
    with pytest.raises(PrivacyError, match="is below 0.05"):  # PLD: > 7 GB at z = 0.01
        acc.step(noise_multiplier=0.01, sample_rate=1.0, num_steps=3)
    # the floor is where privacy has already gone: one release spends epsilon above 100
    rdp = create_accountant("rdp")
    rdp.step(noise_multiplier=MIN_ACCOUNTED_NOISE, sample_rate=1e-3, num_steps=1)
    reference = rdp_privacy_accountant.RdpAccountant()
    reference.compose(
        dp_accounting.PoissonSampledDpEvent(1e-3, dp_accounting.GaussianDpEvent(0.05)), 1
    )
    assert rdp.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-6)
    assert reference.get_epsilon(1e-5) > 100


def _epsilon_of_two_gaussians(
    shift: float, std_with: float, std_without: float, delta: float
) -> float:
    """Exact epsilon at ``delta`` between N(shift, std_with^2) and N(0, std_without^2).

    The hockey-stick divergence in both directions, by numerical integration (scipy), and
    the smallest epsilon whose larger divergence is at most ``delta``.
    """
    import numpy as np
    from scipy import integrate, optimize, stats

    p, q = stats.norm(shift, std_with), stats.norm(0.0, std_without)
    span = 40 * max(std_with, std_without)

    def divergence(eps: float, a, b) -> float:  # type: ignore[no-untyped-def]
        def integrand(x: float) -> float:
            return max(0.0, a.pdf(x) - np.exp(eps) * b.pdf(x))

        return integrate.quad(integrand, -span, span + shift, limit=400, points=[0, shift])[0]

    def gap(eps: float) -> float:
        return max(divergence(eps, p, q), divergence(eps, q, p)) - delta

    return float(optimize.brentq(gap, 1e-6, 60.0, xtol=1e-6))


def test_local_noise_is_accounted_under_zero_out_not_add_remove() -> None:
    # Prepare: one round, every client (q = 1), z = 2, C = 1, five clients, local shares

    z, m, delta = 2.0, 5, 1e-5
    accounted = create_accountant("pld")
    accounted.step(noise_multiplier=z, sample_rate=1.0)
    gaussian = accounted.get_epsilon(delta)
    # the integration reproduces the accountant on the plain Gaussian (equal variances)
    assert _epsilon_of_two_gaussians(1.0, z, z, delta) == pytest.approx(gaussian, rel=2e-3)
    # Execute: the two neighbouring sums each relation compares
    zero_out = _epsilon_of_two_gaussians(1.0, np.sqrt(m) * z, np.sqrt(m) * z, delta)
    add_remove = _epsilon_of_two_gaussians(1.0, np.sqrt(m) * z, np.sqrt(m - 1) * z, delta)
    # Assert: zero-out (the client's share present in both) is within z's accounting (it is
    # conservative by sqrt(m)); add/remove (its share gone with it) is not
    assert zero_out <= gaussian
    assert add_remove > 1.4 * gaussian  # measured 2.94 vs 1.99
    assert client_adjacency("poisson", "local") == "zero-out"
    assert client_adjacency("poisson", "distributed") == "zero-out"
    assert client_adjacency("poisson", "central") == "add/remove"
    assert client_adjacency("fixed_size", "local") == "replace-one"  # same cohort size
