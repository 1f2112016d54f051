"""SecAgg+'s graph: k and t bounded by the stated rates, and a graph the server cannot grind.

Two attacks: (1) a small ``k`` (``k = 4`` of ``n = 10`` with 3 colluders exposes an honest
client in ``6 / 126`` of rounds) was accepted; (2) the graph was seeded by the round id the
server picks, so grinding round ids put chosen colluders around a target. Figures are checked
against scipy's hypergeometric distribution, never against the module's own arithmetic alone.
"""

from __future__ import annotations

import math
import secrets
from fractions import Fraction

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scipy import stats

from fl_secure.config import SecureAggregationConfig
from fl_secure.errors import PrivacyError
from privacy.secagg.client import SecAggClient
from privacy.secagg.config import SecAggConfig
from privacy.secagg.graph import neighbour_graph
from privacy.secagg.parameters import exposure
from privacy.secagg.round_setup import neighbourhood
from tests.privacy.secagg.helpers import ids

SIGMA = 40


def _secagg_plus(**kw: object) -> SecureAggregationConfig:
    return SecureAggregationConfig(scheme="secagg+", **kw)  # type: ignore[arg-type]


def _union_exposure(n: int, c: int, k: int, t: int) -> float:
    """scipy: ``(n - c) P[X >= t]``, ``X ~ Hypergeom(n - 1, c, k)``."""
    return (n - c) * float(stats.hypergeom.sf(t - 1, n - 1, c, k))


# -- k and t against the stated rates ---------------------------------------------------------


def test_reviewers_k4_with_three_of_ten_colluding_is_refused_naming_the_bound() -> None:
    # Prepare: n = 10, up to 30% colluding (3 clients), k = 4 with the majority t = 3
    cfg = _secagg_plus(neighbours=4, corrupt_fraction=0.3, dropout_fraction=0.1)
    # Execute / Assert: refused, and the message names the exposure and the derived bound
    with pytest.raises(PrivacyError, match=r"neighbours = 4, threshold = 4 are too small") as e:
        neighbourhood(cfg, 10)  # t = 4 (of 4) is safe from 3 colluders but no dropout is
    assert "fewer than t = 4 of its k = 4 neighbours" in str(e.value)
    assert "k >= 6 with t = 4" in str(e.value)
    majority = _secagg_plus(neighbours=4, threshold=3, corrupt_fraction=0.3, dropout_fraction=0.1)
    with pytest.raises(PrivacyError, match=r"neighbours = 4, threshold = 3 are too small") as e:
        neighbourhood(majority, 10)
    assert "with 3 of 10 clients colluding (corrupt_fraction 0.3)" in str(e.value)
    assert f"probability {7 * 6 / 126:.3g}" in str(e.value)  # 7 honest x the exact 6/126
    assert "k >= 6 with t = 4" in str(e.value)
    # k = 2 (accepted before) is refused as well; the derived pair is accepted
    with pytest.raises(PrivacyError, match="too small"):
        neighbourhood(_secagg_plus(neighbours=2, corrupt_fraction=0.3), 10)
    assert neighbourhood(_secagg_plus(corrupt_fraction=0.3, dropout_fraction=0.1), 10) == (6, 4)


@pytest.mark.parametrize("gamma", [0.2, 0.3])
@pytest.mark.parametrize("n", [10, 100, 1000])
def test_derived_k_meets_the_bound_exactly_and_is_the_smallest(n: int, gamma: float) -> None:
    # Prepare: the stated rates; c = floor(gamma n) colluders
    cfg = _secagg_plus(corrupt_fraction=gamma, dropout_fraction=0.1)
    c = math.floor(gamma * n + 1e-9)
    # Execute
    k, t = neighbourhood(cfg, n)
    # Assert: scipy's hypergeometric tail, over the honest clients, is within 2^-sigma ...
    assert k % 2 == 0 and k // 2 < t <= k
    assert _union_exposure(n, c, k, t) <= 2.0**-SIGMA
    # ... and no smaller even k has any majority threshold that is (privacy alone)
    for smaller in range(2, k, 2):
        best = min(_union_exposure(n, c, smaller, u) for u in range(smaller // 2 + 1, smaller + 1))
        if best <= 2.0**-SIGMA:  # then the dropout or connectivity condition ruled it out
            with pytest.raises(PrivacyError, match="drop|split"):
                neighbourhood(_secagg_plus(neighbours=smaller, corrupt_fraction=gamma), n)
    # a configured (k - 2, its best t) is refused, the derived (k, t) accepted as set
    set_cfg = _secagg_plus(neighbours=k, threshold=t, corrupt_fraction=gamma)
    assert neighbourhood(set_cfg, n) == (k, t)
    if k > 2:
        with pytest.raises(PrivacyError, match=f"k >= {k} with t = {t}"):
            neighbourhood(_secagg_plus(neighbours=k - 2, corrupt_fraction=gamma), n)


def test_measured_exposure_of_k4_matches_the_exact_hypergeometric_figure() -> None:
    # Prepare: the reviewer's case, k = 4, t = 3, 3 colluders of 10; the real graph builder
    # with fresh random seeds; the colluders are the last three ids, the target the first
    n, k, t, trials = 10, 4, 3, 20_000
    cohort = ids(n)
    colluders, honest = set(cohort[-3:]), cohort[:-3]
    exact = stats.hypergeom.sf(t - 1, n - 1, 3, k)
    assert exact == pytest.approx(6 / 126)  # C(3,3) C(6,1) / C(9,4)
    assert exposure(n, 3, k, t) == Fraction(6, 126)  # the bound's own figure, exactly
    # Execute
    target_hit = someone_hit = 0
    for _ in range(trials):
        g = neighbour_graph(cohort, k, secrets.token_bytes(16))
        exposed = [u for u in honest if len(g[u] & colluders) >= t]
        target_hit += cohort[0] in exposed
        someone_hit += bool(exposed)
    # Assert: the target's rate is the exact figure (5 standard errors); someone is exposed
    # in about a third of the rounds (the reviewer's 34%), at most the union bound 7 * 6/126
    se = math.sqrt(exact * (1 - exact) / trials)
    assert abs(target_hit / trials - exact) < 5 * se
    assert 0.30 < someone_hit / trials <= 7 * exact + 0.01


def test_secagg_threshold_must_exceed_the_colluders() -> None:
    # The complete graph keeps its majority threshold; t <= floor(gamma n) is refused
    cfg = SecureAggregationConfig(scheme="secagg", corrupt_fraction=0.45)
    assert neighbourhood(cfg, 10) == (9, 5)
    with pytest.raises(PrivacyError, match="threshold"):
        neighbourhood(SecureAggregationConfig(scheme="secagg", threshold=4), 9)


# -- the graph's seed: the advertisements, not the round id -----------------------------------


def _round(n: int, k: int, round_id: bytes, only: str | None = None) -> dict[str, frozenset[str]]:
    """One real Round 0 + ShareKeys; each client's neighbours as the receivers of its shares.

    Fresh X25519 keys for every client (as in every round) and the server's relay; what is
    returned is what the clients themselves chose to share with (``only``: just that one).
    """
    from privacy.secagg.server import SecAggServer

    config = SecAggConfig(
        round_id=round_id,
        cohort=tuple(ids(n)),
        threshold=k // 2 + 1,
        clip_range=1.0,
        scale=2.0**10,
        neighbours=k,
    )
    keys = {u: _IDENTITIES[u] for u in config.cohort}
    registry = {u: key.public_key() for u, key in keys.items()}
    clients = {u: SecAggClient(u, keys[u], config, registry, 1) for u in config.cohort}
    server = SecAggServer(config, registry, 1)
    for c in clients.values():
        server.add_advert(c.advertise_keys())
    inbox = server.route_adverts()
    who = [only] if only else list(clients)
    return {u: frozenset(s.receiver for s in clients[u].share_keys(inbox[u])) for u in who}


_IDENTITIES = {u: Ed25519PrivateKey.generate() for u in ids(16)}


def test_grinding_round_ids_gives_no_control_over_a_targets_neighbours() -> None:
    # Prepare: n = 16, k = 4; a server wants its 3 colluders among client-000's 4 neighbours
    # (chance 12 / 1365 per round). It grinds round ids, rehearsing each (the graph it would
    # get for that id), until one works, then runs the real round with that id.
    n, k, target = 16, 4, "client-000"
    colluders = {"client-013", "client-014", "client-015"}
    base = 12 / 1365
    assert base == pytest.approx(stats.hypergeom.pmf(3, n - 1, 3, k))
    chosen = None
    for i in range(3000):  # 1 - (1 - base)^3000 > 1 - 1e-11
        rid = f"grind-{i}".encode()
        if colluders <= _round(n, k, rid, target)[target]:
            chosen = rid
            break
    assert chosen is not None
    # Execute: eight real rounds with the ground round id (fresh keys each, as always)
    hits = sum(colluders <= _round(n, k, chosen, target)[target] for _ in range(8))
    # Assert: the round id does not carry the graph: the colluders are around the target
    # only at the base rate (P[>= 3 of 8] < 4e-5), where seeding by the round id gave 8 of 8
    assert hits <= 2, f"the ground round id put the colluders around the target {hits}/8"


def test_same_round_id_fresh_keys_give_a_fresh_graph_and_all_parties_agree() -> None:
    # Prepare / Execute: two rounds with one round id: every client draws fresh keys
    first, second = _round(16, 4, b"same-id"), _round(16, 4, b"same-id")
    # Assert: the graphs differ (the same graph again has chance about 1 / 10^11), and in
    # each, the neighbourhoods the clients computed themselves are symmetric and k-regular
    assert first != second
    for g in (first, second):
        assert all(len(g[u]) == 4 and all(u in g[v] for v in g[u]) for u in g)


def test_graph_is_a_function_of_the_advert_seed_not_of_the_round_id() -> None:
    # For one seed, two configs differing only in the round id give the same graph; a
    # different seed (one advert changed) gives another
    cfg_a = SecAggConfig(b"round-a", tuple(ids(12)), 3, 1.0, 2.0**10, neighbours=4)
    cfg_b = SecAggConfig(b"round-b", tuple(ids(12)), 3, 1.0, 2.0**10, neighbours=4)
    seed = secrets.token_bytes(32)
    assert cfg_a.graph(seed) == cfg_b.graph(seed)
    assert cfg_a.graph(seed) != cfg_a.graph(secrets.token_bytes(32))


def test_changing_one_advertisement_reshuffles_the_graph() -> None:
    # Prepare: one round's adverts; client-005 redraws its keys (a new advert)
    from privacy.secagg.graph import advert_seed

    config = SecAggConfig(b"r", tuple(ids(16)), 3, 1.0, 2.0**10, neighbours=4)
    registry = {u: k.public_key() for u, k in _IDENTITIES.items()}
    adverts = {
        u: SecAggClient(u, _IDENTITIES[u], config, registry, 1).advertise_keys()
        for u in config.cohort
    }
    again = SecAggClient("client-005", _IDENTITIES["client-005"], config, registry, 1)
    changed = dict(adverts, **{"client-005": again.advertise_keys()})
    # Execute
    g1 = config.graph(advert_seed(a.signed_payload() for a in adverts.values()))
    g2 = config.graph(advert_seed(a.signed_payload() for a in changed.values()))
    # Assert: most neighbourhoods change (not just client-005's): the permutation is redrawn
    moved = sum(g1[u] != g2[u] for u in config.cohort)
    assert moved >= 8, moved
    assert np.mean([len(g1[u] & g2[u]) for u in config.cohort]) < 2


def test_client_refuses_an_advert_set_without_its_own() -> None:
    from privacy.secagg.server import SecAggServer

    config = SecAggConfig(b"r", tuple(ids(8)), 3, 1.0, 2.0**10, neighbours=4)
    registry = {u: k.public_key() for u, k in _IDENTITIES.items()}
    clients = {u: SecAggClient(u, _IDENTITIES[u], config, registry, 1) for u in config.cohort}
    server = SecAggServer(config, registry, 1)
    for c in clients.values():
        server.add_advert(c.advertise_keys())
    inbox = server.route_adverts()["client-000"]
    others = [a for a in inbox if a.client_id != "client-000"]
    with pytest.raises(PrivacyError, match="left out the advertisement of 'client-000'"):
        clients["client-000"].share_keys(others)


def test_the_rates_are_run_config_keys_with_checked_ranges() -> None:
    from fl_secure.config import config_from_dict
    from fl_secure.errors import ConfigError

    sa = {"scheme": "secagg+", "corrupt_fraction": 0.3, "dropout_fraction": 0.05}
    cfg = config_from_dict({"secure_aggregation": sa}).secure_aggregation
    assert (cfg.corrupt_fraction, cfg.dropout_fraction, cfg.neighbours) == (0.3, 0.05, 0)
    # neighbours = 0 with secagg+: derived; no dropout in 10 (0.05 n < 1), so t = k = 4 > 3
    assert neighbourhood(cfg, 10) == (4, 4)
    for key, bad in (("corrupt_fraction", 0.5), ("dropout_fraction", -0.1), ("security_bits", 0)):
        with pytest.raises(ConfigError, match=f"secure_aggregation.{key}: invalid value"):
            config_from_dict({"secure_aggregation": {"scheme": "secagg+", key: bad}})
