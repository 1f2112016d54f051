"""In-process SecAgg / SecAgg+ cohort rounds: exact sums, dropouts, aborts, decoding, cost-only."""

from __future__ import annotations

import secrets
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fl_secure.config import SecureAggregationConfig
from fl_secure.errors import RoundAborted
from fl_secure.messages import TensorSpec
from privacy.secagg.cost_only import COST_ONLY, cost_only_round, probe_costs
from privacy.secagg.in_process import (
    CohortSum,
    cohort_setup,
    encode_update,
    mean_update,
    run_cohort_round,
)
from privacy.secagg.round_setup import RoundSetup
from privacy.secagg.server import SecAggServer
from privacy.secagg.stages import ADVERTISE, CONSISTENCY, DONE, MASKED, SHARE, UNMASK

D = 48  # vector length: the protocol's checks do not depend on it


def _ids(n: int) -> list[str]:
    return [f"client-{i:03d}" for i in range(n)]


def _cohort(
    scheme: str, n: int, *, bits: int = 32, seed: int = 0
) -> tuple[RoundSetup, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A setup, each client's float update in [-1, 1] and its encoding."""
    cfg = SecureAggregationConfig(scheme=scheme, modulus_bits=bits)  # type: ignore[arg-type]
    setup = cohort_setup(cfg, _ids(n), D, round_id=secrets.token_bytes(16))
    rng = np.random.default_rng(seed)
    floats = {c: rng.uniform(-1.0, 1.0, D) for c in setup.cohort}
    return setup, floats, {c: encode_update(setup, x) for c, x in floats.items()}


def _plain_sum(encoded: dict[str, np.ndarray], who: tuple[str, ...], bits: int) -> list[int]:
    """The reference: the survivors' sum mod 2^bits in Python integers (no numpy wrap)."""
    return [sum(int(encoded[c][i]) for c in who) % (1 << bits) for i in range(D)]


def _check_exact(result: CohortSum, setup: RoundSetup, encoded: dict[str, np.ndarray]) -> None:
    assert result.aborted is None and result.total is not None
    assert [int(v) for v in result.total] == _plain_sum(
        encoded, result.survivors, setup.modulus_bits
    )


@pytest.mark.parametrize("scheme", ["secagg", "secagg+"])
@pytest.mark.parametrize("stage", [ADVERTISE, SHARE, MASKED, CONSISTENCY, UNMASK])
def test_a_client_dropping_at_any_stage_leaves_the_exact_sum_of_the_survivors(
    scheme: str, stage: int
) -> None:
    # Prepare: ten clients; client-004 sends nothing from `stage` on
    setup, _, encoded = _cohort(scheme, 10)
    # Execute
    result = run_cohort_round(
        setup, encoded, round_id=setup.round_id, dropouts={"client-004": stage}
    )
    # Assert: its input is in the sum iff it uploaded its masked input (stage > MASKED)
    _check_exact(result, setup, encoded)
    expected = set(setup.cohort) - ({"client-004"} if stage <= MASKED else set())
    assert set(result.survivors) == expected
    assert result.left == {"client-004": result.left["client-004"]}
    assert "(injected)" in result.left["client-004"]
    assert result.mode == scheme and result.secure and result.stats["secure"] == 1.0


@pytest.mark.parametrize(
    ("scheme", "n", "bits"),
    [("secagg", 50, 32), ("secagg+", 50, 48), ("secagg", 100, 32), ("secagg+", 100, 32)],
)
def test_large_cohorts_sum_exactly_with_dropouts_spread_over_every_stage(
    scheme: str, n: int, bits: int
) -> None:
    # Prepare: n/10 clients drop (the configured dropout_fraction), spread over the five stages
    setup, _, encoded = _cohort(scheme, n, bits=bits, seed=n)
    order = list(np.random.default_rng(n).permutation(setup.cohort))
    drops = {str(c): i % 5 for i, c in enumerate(order[: n // 10])}
    # Execute
    result = run_cohort_round(setup, encoded, round_id=setup.round_id, dropouts=drops)
    # Assert: the sum of exactly those that uploaded, bit for bit; SecAgg+ is sparse
    _check_exact(result, setup, encoded)
    assert set(result.survivors) == {c for c in setup.cohort if drops.get(c, DONE) > MASKED}
    assert set(result.left) == set(drops)
    assert result.stats["n"] == n and result.stats["survivors"] == len(result.survivors)
    assert (result.stats["k"] < n - 1) == (scheme == "secagg+")
    # every client uploaded its masked vector: the bytes it sent include it
    word = 4 if bits <= 32 else 8
    assert result.stats["bytes_masked_per_client"] == D * word
    assert result.stats["bytes_up_max"] > D * word


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(10, 24),
    scheme=st.sampled_from(["secagg", "secagg+"]),
    drops=st.lists(st.integers(ADVERTISE, UNMASK), max_size=10),
    seed=st.integers(0, 2**16),
)
def test_any_dropouts_give_the_exact_sum_or_no_sum_at_all(
    n: int, scheme: str, drops: list[int], seed: int
) -> None:
    setup, _, encoded = _cohort(scheme, n, seed=seed)
    order = np.random.default_rng(seed).permutation(setup.cohort)
    dropouts = {str(c): s for c, s in zip(order, drops, strict=False)}
    result = run_cohort_round(setup, encoded, round_id=setup.round_id, dropouts=dropouts)
    if result.aborted:  # nothing released
        assert result.total is None and result.decoded is None and result.survivors == ()
    else:  # only those that uploaded are in it, and exactly
        _check_exact(result, setup, encoded)
        assert set(result.survivors) <= {c for c in setup.cohort if dropouts.get(c, DONE) > 2}
        assert len(result.survivors) >= setup.threshold + 1


def test_too_many_dropouts_abort_with_no_total() -> None:
    # Prepare: SecAgg, ten clients, c = 2: the consistency check needs 7 signatures
    setup, _, encoded = _cohort("secagg", 10)
    late = dict.fromkeys(_ids(10)[:4], CONSISTENCY)  # uploaded, then never sign: 6 signers
    few = dict.fromkeys(_ids(10)[:6], MASKED)  # only 4 upload
    # Execute
    unsigned = run_cohort_round(setup, encoded, round_id=setup.round_id, dropouts=late)
    setup2, _, encoded2 = _cohort("secagg", 10)
    unmasked = run_cohort_round(setup2, encoded2, round_id=setup2.round_id, dropouts=few)
    # Assert: no sum, no survivors, and why
    for result in (unsigned, unmasked):
        assert result.total is None and result.decoded is None and result.survivors == ()
        assert result.stats["survivors"] == 0
        with pytest.raises(RoundAborted):
            mean_update(result, [TensorSpec("w", "float32", (D,))])
    assert unsigned.aborted is not None and "consistency" in unsigned.aborted
    assert unmasked.aborted is not None and "aborted" in unmasked.aborted


def test_the_clients_own_consistency_check_runs_and_a_withholding_server_gets_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: a hostile server relays only two of the ten signatures
    real = SecAggServer.route_signatures
    monkeypatch.setattr(SecAggServer, "route_signatures", lambda self: real(self)[:2])
    setup, _, encoded = _cohort("secagg", 10)
    # Execute
    result = run_cohort_round(setup, encoded, round_id=setup.round_id)
    # Assert: every client refused to reveal a share (it withdrew), so no sum was unmasked
    assert result.total is None and result.aborted is not None
    assert "too few unmasking responses" in result.aborted
    assert set(result.left) == set(setup.cohort)
    assert all(w.startswith("withdrew at unmasking") for w in result.left.values())


@pytest.mark.parametrize("scheme", ["secagg", "secagg+"])
def test_the_dequantized_mean_is_the_float_mean_within_the_rounding_bound(scheme: str) -> None:
    # Prepare: 2-D float tensors as the engine has them; two clients drop
    setup, floats, _ = _cohort(scheme, 20, seed=7)
    specs = [TensorSpec("w", "float32", (6, 8))]
    tensors = {
        c: OrderedDict([("w", x.reshape(6, 8).astype(np.float32))]) for c, x in floats.items()
    }
    encoded = {c: encode_update(setup, t) for c, t in tensors.items()}
    drops = {"client-001": MASKED, "client-002": UNMASK}
    # Execute
    result = run_cohort_round(setup, encoded, round_id=setup.round_id, dropouts=drops)
    mean = mean_update(result, specs)["w"]
    # Assert: stochastic rounding moves each input by < 1/scale per coordinate, so the mean
    # of the m survivors is within 1/scale of the float mean (and not identical to it)
    survivors = result.survivors
    assert "client-001" not in survivors and "client-002" in survivors
    truth = np.mean([tensors[c]["w"].astype(np.float64) for c in survivors], axis=0)
    assert mean.dtype == np.float32 and mean.shape == (6, 8)
    error = np.abs(mean.astype(np.float64) - truth)
    assert error.max() <= 1.0 / setup.scale + 1e-6
    assert error.max() > 0  # rounded, not passed through
    np.testing.assert_allclose(
        result.decoded, truth.ravel() * len(survivors), atol=20 / setup.scale
    )


def test_the_distributed_discrete_gaussian_encoding_sums_within_its_noise() -> None:
    # Prepare: distributed DP (z = 1, C = 1, t = 15): each client adds integer noise
    cfg = SecureAggregationConfig(scheme="secagg+", modulus_bits=48, scale_bits=10)
    ids = _ids(20)
    setup = cohort_setup(cfg, ids, D, round_id=secrets.token_bytes(16), ddg=(1.0, 1.0, 15))
    assert setup.encoding == "ddg" and setup.ddg_sigma > 0
    rng = np.random.default_rng(3)
    floats = {c: rng.normal(0, 0.05, D) for c in ids}  # norms below C = 1: no clipping
    encoded = {c: encode_update(setup, x) for c, x in floats.items()}
    # Execute
    result = run_cohort_round(setup, encoded, round_id=setup.round_id)
    # Assert: the decoded sum is the float sum plus noise of std sqrt(20) sigma / scale
    assert result.aborted is None and result.decoded is not None
    noise_std = np.sqrt(20) * setup.ddg_sigma / setup.scale
    error = np.abs(result.decoded - np.sum(list(floats.values()), axis=0))
    assert error.max() < 6 * noise_std and error.std() > 0.3 * noise_std


def test_cost_only_mode_says_it_is_not_secure_and_sums_what_a_real_round_would() -> None:
    # Prepare: the same cohort and dropouts for a real round and a cost-only one
    cfg = SecureAggregationConfig(scheme="secagg+")
    setup = cohort_setup(cfg, _ids(30), D, round_id=secrets.token_bytes(16))
    rng = np.random.default_rng(11)
    encoded = {c: encode_update(setup, rng.uniform(-1, 1, D)) for c in setup.cohort}
    drops = {"client-000": ADVERTISE, "client-010": MASKED, "client-020": CONSISTENCY}
    # Execute
    real = run_cohort_round(setup, encoded, round_id=setup.round_id, dropouts=drops)
    plain = cost_only_round(cfg, encoded, round_id=setup.round_id, dropouts=drops, probe_size=12)
    # Assert: the same survivors and the same sum bit for bit, clearly labelled insecure
    assert real.secure and not plain.secure
    assert plain.mode == COST_ONLY and "NOT secure aggregation" in plain.mode
    assert plain.survivors == real.survivors
    assert plain.total is not None and real.total is not None
    np.testing.assert_array_equal(plain.total, real.total)
    np.testing.assert_array_equal(plain.decoded, real.decoded)
    # the modelled cost comes from a real probe round of 12 at the same length
    assert plain.stats["probe.n"] == 12 and plain.stats["probe.secure"] == 1.0
    assert (
        plain.stats["modelled.bytes_up_per_client"] > plain.stats["probe.bytes_masked_per_client"]
    )
    assert plain.stats["modelled.seconds_round"] > 0
    assert probe_costs(cfg, D, 12) == {
        k[6:]: v for k, v in plain.stats.items() if k[:6] == "probe."
    }
    # too few uploads: a modelled abort, nothing released
    many = dict.fromkeys(_ids(30)[:20], MASKED)
    aborted = cost_only_round(cfg, encoded, round_id=setup.round_id, dropouts=many, probe_size=12)
    assert aborted.total is None and aborted.aborted is not None
    assert aborted.aborted.startswith(COST_ONLY)


def test_bad_input_is_refused_naming_the_problem() -> None:
    setup, _, encoded = _cohort("secagg", 10)
    rid = setup.round_id
    with pytest.raises(ValueError, match="round id of the setup"):
        run_cohort_round(setup, encoded, round_id=b"another-round")
    with pytest.raises(ValueError, match="one vector per cohort member"):
        run_cohort_round(setup, {**encoded, "stranger": encoded["client-000"]}, round_id=rid)
    short = {**encoded, "client-003": encoded["client-003"][:-1]}
    with pytest.raises(ValueError, match=r"encoded\['client-003'\].*entries, expected 48"):
        run_cohort_round(setup, short, round_id=rid)
    too_big = {**encoded, "client-003": np.full(D, 2**40, np.uint64)}
    with pytest.raises(ValueError, match="below 2\\^32"):
        run_cohort_round(setup, too_big, round_id=rid)
    with pytest.raises(ValueError, match="outside the cohort"):
        run_cohort_round(setup, encoded, round_id=rid, dropouts={"ghost": 1})
    with pytest.raises(ValueError, match="dropout stages"):
        run_cohort_round(setup, encoded, round_id=rid, dropouts={"client-001": 9})
    with pytest.raises(ValueError, match="ckks"):
        cohort_setup(SecureAggregationConfig(scheme="ckks"), _ids(4), D, round_id=rid)


def test_from_the_run_config_the_setup_is_the_coordinators_and_given_keys_sign() -> None:
    # Prepare: the engine passes the run's config and the sites' own identity keys
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from privacy.secagg.round_setup import make_setup

    cfg = SecureAggregationConfig(scheme="secagg+")
    ids = _ids(40)
    keys = {c: Ed25519PrivateKey.generate() for c in ids}
    rid = secrets.token_bytes(16)
    coordinator = make_setup(cfg, run_id="r", round_=1, attempt=0, cohort=ids, vector_length=D)
    encoded = {c: encode_update(coordinator, np.full(D, 0.25)) for c in ids}
    # Execute
    result = run_cohort_round(cfg, encoded, round_id=rid, signing_keys=keys)
    # Assert: k and t are the gRPC coordinator's for this cohort; the sum is 40 x 0.25
    assert (result.stats["k"], result.stats["t"]) == (coordinator.neighbours, coordinator.threshold)
    _check_exact(result, coordinator, encoded)
    np.testing.assert_allclose(result.decoded, np.full(D, 10.0), atol=40 / coordinator.scale)
    with pytest.raises(ValueError, match="a key for every cohort member"):
        run_cohort_round(cfg, encoded, round_id=rid, signing_keys={ids[0]: keys[ids[0]]})


def test_shared_verification_still_refuses_an_altered_advert_relayed_to_one_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: a hostile server relays client-001's advert with a forged signature to
    # client-005 only; every other client verifies (and the cohort remembers) the genuine one
    import dataclasses

    real = SecAggServer.route_adverts

    def forge(self: SecAggServer) -> dict:
        routed = dict(real(self))
        ads = routed["client-005"]
        forged = tuple(
            dataclasses.replace(a, signature=bytes(64)) if a.client_id == "client-001" else a
            for a in ads
        )
        routed["client-005"] = forged
        return routed

    monkeypatch.setattr(SecAggServer, "route_adverts", forge)
    setup, _, encoded = _cohort("secagg", 10)
    # Execute
    result = run_cohort_round(setup, encoded, round_id=setup.round_id)
    # Assert: client-005 refused it (and withdrew); the other nine finish with their sum
    assert "not signed by its enrolled identity key" in result.left["client-005"]
    assert set(result.left) == {"client-005"}
    assert result.stats["shared_checks"] == 1.0
    _check_exact(result, setup, encoded)
    assert set(result.survivors) == set(setup.cohort) - {"client-005"}


def test_a_shared_verification_key_remembers_only_pairs_that_verified() -> None:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from privacy.secagg.sharing import SharedVerificationKey

    secret = Ed25519PrivateKey.generate()
    key = SharedVerificationKey(secret.public_key())
    signature = secret.sign(b"message")
    key.verify(signature, b"message")
    key.verify(signature, b"message")  # remembered
    for sig, data in ((signature, b"other"), (bytes(64), b"message"), (bytes(64), b"message")):
        with pytest.raises(InvalidSignature):
            key.verify(sig, data)
    assert (
        key == secret.public_key()
        and key.public_bytes_raw() == secret.public_key().public_bytes_raw()
    )


def test_only_a_cohort_in_one_process_remembers_graphs_and_key_checks() -> None:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from privacy.secagg import graph, keys
    from privacy.secagg.sharing import cohort_in_one_process

    ids = tuple(_ids(12))
    low_order = bytes(32)  # the identity point: every agreement with it is refused
    good = keys.public_bytes(X25519PrivateKey.generate())
    graph._remembered_graph.cache_clear()
    keys._remembered_usable.cache_clear()
    # outside: nothing remembered (a real client's and the server's compute is their own)
    assert len(graph.neighbour_graph(ids, 4, b"seed")) == 12
    assert keys.usable_x25519(good) and not keys.usable_x25519(low_order)
    assert graph._remembered_graph.cache_info().currsize == 0
    assert keys._remembered_usable.cache_info().currsize == 0
    with cohort_in_one_process():
        first = graph.neighbour_graph(ids, 4, b"seed")
        first.clear()  # a member's copy: the next member's graph is whole
        again = graph.neighbour_graph(list(ids), 4, b"seed")
        assert len(again) == 12 and all(len(v) == 4 for v in again.values())
        for _ in range(2):  # the low-order key stays refused when remembered
            assert keys.usable_x25519(good) and not keys.usable_x25519(low_order)
    assert graph._remembered_graph.cache_info().hits == 1
    assert keys._remembered_usable.cache_info().hits == 2


def test_random_dropouts_pick_the_fraction_at_stages_before_done() -> None:
    import random

    from privacy.secagg.in_process import random_dropouts

    ids = _ids(200)
    drops = random_dropouts(ids, 0.1, rng=random.Random(5))
    assert len(drops) == 20 and set(drops) <= set(ids)
    assert set(drops.values()) <= set(range(ADVERTISE, DONE)) and len(set(drops.values())) > 1
    assert drops == random_dropouts(ids, 0.1, rng=random.Random(5))  # seeded: reproducible
    assert len(random_dropouts(ids, 0.25)) == 50  # the CSPRNG
    with pytest.raises(ValueError, match="expected 0..1"):
        random_dropouts(ids, 1.5)
