"""SecAgg / SecAgg+: exact sums under dropouts, aborts, uniform masks, Shamir, attacks, encoding."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted
from privacy.secagg import (
    PRIME,
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    RevealedShare,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    SecureUniform,
    UnmaskRequest,
    UnmaskResponse,
    check_modulus,
    decode,
    encode,
    neighbour_graph,
    prg_mask,
    shamir_interpolate,
    shamir_split,
    survivor_groups,
)

ROUND = b"round-0007"
# A client with drop stage s completes the stages before s and sends nothing from s on:
# 0 = never advertises, 1 = advertised only, 2 = shared keys but no masked input,
# 3 = sent its masked input but does not answer the unmask request, 4 = completes the round.
COMPLETES = 4


class SeededUniform:
    """Reproducible rounding uniforms, so a test can recompute a client's encoding."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def uniform(self, n: int) -> np.ndarray:
        return self._rng.random(n)


def _ids(n: int) -> list[str]:
    return [f"client-{i:03d}" for i in range(n)]


def _config(n: int, t: int, k: int = 0, bits: int = 32, scale: float = 2.0**10) -> SecAggConfig:
    return SecAggConfig(
        round_id=ROUND,
        cohort=tuple(_ids(n)),
        threshold=t,
        clip_range=1.0,
        scale=scale,
        neighbours=k,
        modulus_bits=bits,
    )


def _identities(config: SecAggConfig) -> dict[str, Ed25519PrivateKey]:
    return {u: Ed25519PrivateKey.generate() for u in config.cohort}


@dataclasses.dataclass
class Round:
    """Clients and server of one round, driven stage by stage through serialised messages."""

    config: SecAggConfig
    updates: dict[str, np.ndarray]
    keys: dict[str, Ed25519PrivateKey]
    server: SecAggServer
    clients: dict[str, SecAggClient]

    @classmethod
    def start(cls, config: SecAggConfig, d: int, seed: int = 0) -> Round:
        rng = np.random.default_rng(seed)
        keys = _identities(config)
        registry = {u: k.public_key() for u, k in keys.items()}
        updates = {u: rng.uniform(-1.5, 1.5, d) for u in config.cohort}  # some get clipped
        clients = {
            u: SecAggClient(u, keys[u], config, registry, d, rounding=SeededUniform(i))
            for i, u in enumerate(config.cohort)
        }
        return cls(config, updates, keys, SecAggServer(config, registry, d), clients)

    def encoded(self, u: str) -> np.ndarray:
        """What client ``u`` encoded: same rounding stream as the one it was given."""
        return self.config.encode(self.updates[u], SeededUniform(self.config.cohort.index(u)))

    def adverts(self, drop: Mapping[str, int]) -> dict[str, tuple[AdvertiseKeys, ...]]:
        for u, c in self.clients.items():
            if drop.get(u, COMPLETES) > 0:
                self.server.add_advert(AdvertiseKeys.from_bytes(c.advertise_keys().to_bytes()))
        return self.server.route_adverts()

    def shares(self, drop: Mapping[str, int]) -> dict[str, tuple[EncryptedShare, ...]]:
        for u, inbox in self.adverts(drop).items():
            if drop.get(u, COMPLETES) > 1:
                relayed = [AdvertiseKeys.from_bytes(a.to_bytes()) for a in inbox]
                try:
                    out = self.clients[u].share_keys(relayed)
                except RoundAborted:
                    continue  # too few neighbours: the client drops out by itself
                self.server.add_shares(u, [EncryptedShare.from_bytes(s.to_bytes()) for s in out])
        return self.server.route_shares()

    def masked(self, drop: Mapping[str, int]) -> UnmaskRequest:
        for u, inbox in self.shares(drop).items():
            if drop.get(u, COMPLETES) > 2:
                relayed = [EncryptedShare.from_bytes(s.to_bytes()) for s in inbox]
                try:
                    m = self.clients[u].masked_input(relayed, self.updates[u])
                except RoundAborted:
                    continue
                self.server.add_masked_input(MaskedInput.from_bytes(m.to_bytes()))
        return UnmaskRequest.from_bytes(self.server.unmask_request().to_bytes())

    def run(self, drop: Mapping[str, int]) -> np.ndarray:
        request = self.masked(drop)
        for u in request.survivors:
            if drop.get(u, COMPLETES) > 3:
                response = self.clients[u].unmask(request)
                self.server.add_unmask_response(UnmaskResponse.from_bytes(response.to_bytes()))
        return self.server.finish()


def _plain_sum(encoded: list[np.ndarray], bits: int) -> list[int]:
    """Reference sum mod 2^bits in Python integers (no numpy wraparound involved)."""
    return [sum(int(e[i]) for e in encoded) % (1 << bits) for i in range(encoded[0].size)]


def _predicted_success(config: SecAggConfig, drop: Mapping[str, int]) -> bool:
    """Independent statement of when the round must succeed (thresholds of every stage)."""
    g, t = config.graph(), config.threshold
    stage = {u: drop.get(u, COMPLETES) for u in config.cohort}
    u1 = {u for u in config.cohort if stage[u] >= 1}
    u2 = {u for u in u1 if stage[u] >= 2 and len(g[u] & u1) >= t}
    u3 = {u for u in u2 if stage[u] >= 3 and len(g[u] & u2) >= t}
    if min(len(u1), len(u2), len(u3)) < t + 1:
        return False
    dropped = {u for u in u2 - u3 if g[u] & u3}
    responders = {u for u in u3 if stage[u] >= 4}
    if _components(g, u3) > 1:  # masks cancel only within one connected group
        return False
    return all(len(g[u] & u3) >= t and len(g[u] & responders) >= t for u in u3 | dropped)


def _components(graph: Mapping[str, frozenset[str]], nodes: set[str]) -> int:
    """Connected components of ``graph`` restricted to ``nodes`` (scipy's, not ours)."""
    from scipy.sparse import csr_array
    from scipy.sparse.csgraph import connected_components

    order = sorted(nodes)
    index = {u: i for i, u in enumerate(order)}
    edges = [(index[u], index[v]) for u in order for v in graph[u] if v in index]
    rows, cols = zip(*edges, strict=True) if edges else ((), ())
    adjacency = csr_array((np.ones(len(edges)), (rows, cols)), shape=(len(order),) * 2)
    return int(connected_components(adjacency, directed=False)[0])


@st.composite
def _scenarios(draw: st.DrawFn, within_budget: bool) -> tuple[SecAggConfig, dict[str, int], int]:
    n = draw(st.integers(2, 20))
    if n >= 4 and draw(st.booleans()):  # SecAgg+: a sparse k-regular graph
        k = draw(st.integers(2, n - 2))
        k -= (k * n) % 2  # no k-regular graph when k and n are both odd
        neighbours = k
    else:  # SecAgg: the complete graph
        k, neighbours = n - 1, 0
    t = draw(st.integers(k // 2 + 1, k))
    bits = draw(st.sampled_from([16, 20, 32, 48, 63, 64]))
    config = _config(n, t, neighbours, bits=bits, scale=2.0 ** min(bits - 7, 40))
    order = draw(st.permutations(list(config.cohort)))
    if within_budget:  # shrinks towards using the whole budget k - t
        n_drop = draw(st.integers(0, k - t).map(lambda i: k - t - i))
    else:
        n_drop = draw(st.integers(0, n))
    drop = {u: draw(st.integers(0, 3)) for u in order[:n_drop]}
    return config, drop, draw(st.integers(1, 8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=_scenarios(within_budget=True), seed=st.integers(0, 2**32 - 1))
def test_sum_is_bit_exact_under_dropouts_at_every_stage(
    scenario: tuple[SecAggConfig, dict[str, int], int], seed: int
) -> None:
    # Prepare: at most k - t dropouts in all, so every neighbourhood keeps t holders
    config, drop, d = scenario
    rnd = Round.start(config, d, seed)
    # Execute
    result = rnd.run(drop)
    # Assert: exactly the survivors' encoded inputs, summed mod 2^bits
    survivors = [u for u in config.cohort if drop.get(u, COMPLETES) >= 3]
    assert rnd.server.survivors == tuple(survivors)
    assert result.dtype == np.uint64
    assert result.tolist() == _plain_sum([rnd.encoded(u) for u in survivors], config.modulus_bits)
    clipped = sum(np.clip(rnd.updates[u], -1.0, 1.0) for u in survivors)
    decoded = config.decode(result, len(survivors))
    assert np.all(np.abs(decoded - clipped) <= len(survivors) / config.scale)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=_scenarios(within_budget=False), seed=st.integers(0, 2**32 - 1))
def test_any_dropout_pattern_gives_the_exact_sum_or_aborts_without_output(
    scenario: tuple[SecAggConfig, dict[str, int], int], seed: int
) -> None:
    # Prepare: dropouts anywhere, possibly far beyond what the thresholds tolerate
    config, drop, d = scenario
    rnd = Round.start(config, d, seed)
    # Execute
    try:
        result: np.ndarray | None = rnd.run(drop)
    except RoundAborted:
        result = None
    # Assert: success exactly when every stage's thresholds hold; no output otherwise
    assert (result is not None) == _predicted_success(config, drop)
    if result is None:
        assert rnd.server.result is None
    else:
        survivors = [rnd.encoded(u) for u in rnd.server.survivors]
        assert result.tolist() == _plain_sum(survivors, config.modulus_bits)
        np.testing.assert_array_equal(rnd.server.result, result)


@pytest.mark.parametrize("neighbours", [0, 14])
def test_hundred_clients_with_ten_percent_dropout(neighbours: int) -> None:
    # Prepare: n = 100, SecAgg (t = 51 of 99) and SecAgg+ (t = 8 of 14); 10 dropouts spread
    # over the stages, within what every neighbourhood tolerates
    t = 51 if neighbours == 0 else 8
    config = _config(100, t, neighbours, bits=32, scale=2.0**16)
    rnd = Round.start(config, d=5, seed=1)
    g = config.graph()
    drop: dict[str, int] = {}
    for u in config.cohort[::7]:  # greedily: at most k - t dropouts in any neighbourhood
        if len(drop) < 10 and all(len(g[v] & {*drop, u}) <= config.degree - t for v in g):
            drop[u] = len(drop) % 4
    assert len(drop) == 10
    # Execute
    result = rnd.run(drop)
    # Assert
    survivors = [u for u in config.cohort if drop.get(u, COMPLETES) >= 3]
    assert rnd.server.survivors == tuple(survivors)
    assert result.tolist() == _plain_sum([rnd.encoded(u) for u in survivors], 32)


def test_too_few_holders_abort_before_any_share_is_revealed() -> None:
    # Prepare: SecAgg+, n = 10, k = 4, t = 3; two neighbours of client-000 drop after sharing
    # keys, so only two surviving neighbours hold shares of its self mask
    config = _config(10, 3, 4)
    rnd = Round.start(config, d=4)
    drop = dict.fromkeys(sorted(config.graph()["client-000"])[:2], 2)
    # Execute / Assert: aborted when the unmask request is built, i.e. before anybody is asked
    with pytest.raises(RoundAborted, match="too few surviving neighbours.*'client-000' \\(2\\)"):
        rnd.masked(drop)
    assert rnd.server.result is None
    with pytest.raises(RoundAborted, match="aborted"):
        rnd.server.unmask_request()
    with pytest.raises(RoundAborted, match="aborted"):
        rnd.server.finish()


def test_survivors_split_into_unjoined_groups_abort_and_clients_refuse_to_unmask() -> None:
    # Prepare: SecAgg+, n = 12, k = 3 (odd: a ring plus one chord each), t = 2; four
    # clients that share keys and then drop can leave every survivor with t neighbours yet
    # cut the survivors into two groups, each of whose sums the server could unmask
    import itertools

    config = _config(12, 2, 3)
    graph, t = config.graph(), config.threshold
    cut = next(
        set(four)
        for four in itertools.combinations(config.cohort, 4)
        if _components(graph, set(config.cohort) - set(four)) > 1
        and all(len(graph[u] & (set(config.cohort) - set(four))) >= t for u in config.cohort)
    )
    survivors = set(config.cohort) - cut
    groups = survivor_groups(graph, survivors)
    assert len(groups) == 2 and set().union(*groups) == survivors
    assert not any(graph[u] & groups[1] for u in groups[0])  # no mask joins them
    rnd = Round.start(config, d=4)
    # Execute / Assert: the server aborts before asking for any share ...
    with pytest.raises(RoundAborted, match="split into 2 groups no pairwise mask joins"):
        rnd.masked(dict.fromkeys(cut, 2))
    assert rnd.server.result is None
    # ... and a client asked by a server that does not refuses to reveal anything
    request = UnmaskRequest(config.round_id, tuple(sorted(survivors)), tuple(sorted(cut)))
    for u in survivors:
        with pytest.raises(PrivacyError, match="refuses to unmask: the survivors split"):
            rnd.clients[u].unmask(request)


def test_too_few_unmask_responses_abort_and_no_sum_exists() -> None:
    # Prepare: everybody sends its masked input, only two of five answer the request (t = 3)
    config = _config(5, 3)
    rnd = Round.start(config, d=4)
    drop = {"client-002": 3, "client-003": 3, "client-004": 3}
    # Execute / Assert
    with pytest.raises(RoundAborted, match="too few unmasking responses"):
        rnd.run(drop)
    assert rnd.server.result is None
    with pytest.raises(RoundAborted, match="aborted"):
        rnd.server.finish()


def test_too_few_clients_advertising_abort_the_round() -> None:
    config = _config(5, 3)
    rnd = Round.start(config, d=4)
    with pytest.raises(RoundAborted, match="only 3 clients advertised keys; at least t \\+ 1 = 4"):
        rnd.adverts({"client-000": 0, "client-001": 0})


def test_a_sum_of_fewer_than_min_inputs_is_never_unmasked() -> None:
    # Prepare: n = 10, t = 5, and the round needs 8 inputs in its sum (under distributed DP,
    # the noise shares the accounting assumes); three clients drop after sharing keys, so 7
    # masked inputs arrive: enough for the protocol (t + 1 = 6), too few for the round
    config = dataclasses.replace(_config(10, 5), min_inputs=8)
    rnd = Round.start(config, d=4)
    gone = ["client-007", "client-008", "client-009"]
    # Execute / Assert: the server aborts when it would build the unmask request, before it
    # asks anybody for a share
    with pytest.raises(RoundAborted, match="only 7 clients sent masked inputs; the round needs "
                       "at least 8 inputs in its sum"):  # fmt: skip
        rnd.masked(dict.fromkeys(gone, 2))
    assert rnd.server.result is None
    # and a client asked anyway (a server that skips the check) refuses to reveal a share
    request = UnmaskRequest(ROUND, tuple(_ids(7)), tuple(gone))
    with pytest.raises(PrivacyError, match="refuses to unmask a sum of 7 inputs.*at least 8"):
        rnd.clients["client-000"].unmask(request)
    # with all 8 needed inputs, the same round unmasks the exact sum
    rnd = Round.start(config, d=4)
    result = rnd.run(dict.fromkeys(gone[1:], 2))
    survivors = _ids(8)
    assert result.tolist() == _plain_sum([rnd.encoded(u) for u in survivors], 32)
    with pytest.raises(PrivacyError, match="min_inputs = 11: expected 0..10"):
        dataclasses.replace(config, min_inputs=11)


def test_client_refuses_to_go_on_with_fewer_than_t_neighbours() -> None:
    # Prepare: n = 5, t = 3; the server relays only two neighbours' adverts / shares
    config = _config(5, 3)
    rnd = Round.start(config, d=4)
    for c in rnd.clients.values():
        rnd.server.add_advert(c.advertise_keys())
    relayed = rnd.server.route_adverts()
    routed: dict[str, list[EncryptedShare]] = {u: [] for u in config.cohort}
    for u in config.cohort[1:]:
        for share in rnd.clients[u].share_keys(relayed[u]):
            routed[share.receiver].append(share)
    # Execute / Assert
    with pytest.raises(RoundAborted, match="only 2 neighbours advertised keys.*t = 3"):
        rnd.clients["client-000"].share_keys(relayed["client-000"][:3])  # itself + 2
    with pytest.raises(RoundAborted, match="only 2 neighbours shared keys.*t = 3"):
        rnd.clients["client-001"].masked_input(routed["client-001"][:2], rnd.updates["client-001"])


@pytest.mark.parametrize("bits", [20, 32])
def test_masked_vector_is_uniform_and_the_encoded_one_is_not(bits: int) -> None:
    # Prepare: 3 clients, d = 100 000, small updates (encoded values cluster near 0 mod 2^bits)
    d = 100_000
    config = _config(3, 2, bits=bits, scale=2.0**8)
    rnd = Round.start(config, d=d, seed=3)
    rnd.updates = {u: np.random.default_rng(4).normal(0, 0.05, d) for u in config.cohort}
    # Execute: what the server sees of client-000
    routed = rnd.shares({})
    masked = rnd.clients["client-000"].masked_input(routed["client-000"], rnd.updates["client-000"])
    encoded = rnd.encoded("client-000")
    # Assert: chi-square over the 256 values of the top 8 bits and of the low 8 bits
    for values in (masked.vector, encoded):
        assert int(values.max()) < 1 << bits
    top = np.bincount((masked.vector >> np.uint64(bits - 8)).astype(np.int64), minlength=256)
    low = np.bincount((masked.vector & np.uint64(255)).astype(np.int64), minlength=256)
    assert stats.chisquare(top).pvalue > 1e-4
    assert stats.chisquare(low).pvalue > 1e-4
    control = np.bincount((encoded >> np.uint64(bits - 8)).astype(np.int64), minlength=256)
    assert stats.chisquare(control).pvalue < 1e-100
    assert control[1:255].sum() == 0  # only "just above 0" and "just below 2^bits"


@settings(max_examples=60, deadline=None)
@given(
    secret=st.integers(0, 2**256 - 1),
    other=st.integers(0, 2**256 - 1),
    t=st.integers(1, 8),
    extra=st.integers(0, 5),
    order=st.randoms(use_true_random=False),
)
def test_shamir_t_minus_one_shares_fit_every_secret_and_t_reconstruct(
    secret: int, other: int, t: int, extra: int, order: random.Random
) -> None:
    # Prepare
    xs = list(range(3, 3 + t + extra))
    ys = shamir_split(secret, xs, t)
    points = list(zip(xs, ys, strict=True))
    order.shuffle(points)
    # Execute / Assert: any t shares give the secret exactly
    assert shamir_interpolate(points[:t]) == secret
    assert all(0 <= y < PRIME for y in ys)
    if t == 1:
        return
    # t - 1 shares plus the point (0, other) define a polynomial of degree t - 1 ...
    seen = points[: t - 1]
    fake = [(0, other), *seen]
    completed = [*seen, (1, shamir_interpolate(fake, 1))]  # x = 1 is never a real abscissa
    # ... which is a complete, consistent sharing of `other`: the t - 1 shares cannot tell
    assert shamir_interpolate(completed) == other
    for x, y in seen:
        assert shamir_interpolate(completed, x) == y
    assert shamir_interpolate(completed, 2) == shamir_interpolate(fake, 2)  # same polynomial


@pytest.mark.parametrize("secret", [0, 5])
def test_shamir_t_minus_one_shares_are_uniform_whatever_the_secret(secret: int) -> None:
    # Prepare: GF(7), t = 3: two shares; 49 possible share pairs
    prime, samples = 7, 9800
    # Execute
    pairs = [shamir_split(secret, [1, 2, 3], 3, prime=prime)[:2] for _ in range(samples)]
    # Assert: the pair (f(1), f(2)) is uniform over GF(7)^2 for either secret
    counts = np.zeros(49)
    for a, b in pairs:
        counts[a * prime + b] += 1
    assert stats.chisquare(counts).pvalue > 1e-4


def test_shamir_rejects_bad_arguments() -> None:
    with pytest.raises(PrivacyError, match="distinct"):
        shamir_split(1, [1, 1], 2)
    with pytest.raises(PrivacyError, match="threshold 3"):
        shamir_split(1, [1, 2], 3)
    with pytest.raises(PrivacyError, match="element"):
        shamir_split(PRIME, [1, 2], 2)


@pytest.mark.parametrize("attack", ["bit_flip", "readdressed", "reflected"])
def test_tampered_share_is_detected_and_names_the_sender(attack: str) -> None:
    # Prepare: the server tampers with the share client-002 -> client-001 before relaying it
    config = _config(4, 2)
    rnd = Round.start(config, d=3)
    routed = rnd.shares({})
    victim, sender = "client-001", "client-002"
    inbox = [s for s in routed[victim] if s.sender != sender]
    genuine = next(s for s in routed[victim] if s.sender == sender)
    if attack == "bit_flip":
        flipped = bytearray(genuine.ciphertext)
        flipped[10] ^= 1
        forged = dataclasses.replace(genuine, ciphertext=bytes(flipped))
    elif attack == "readdressed":  # the share client-002 encrypted for client-003
        other = next(s for s in routed["client-003"] if s.sender == sender)
        forged = dataclasses.replace(other, receiver=victim)
    else:  # the victim's own share for client-002, sent back as if from client-002 (same key)
        own = next(s for s in routed[sender] if s.sender == victim)
        forged = dataclasses.replace(own, sender=sender, receiver=victim)
    # Execute / Assert
    with pytest.raises(PrivacyError, match="share from 'client-002' fails authentication"):
        rnd.clients[victim].masked_input([*inbox, forged], rnd.updates[victim])


@pytest.mark.parametrize("attack", ["resigned", "unsigned", "replayed_round"])
def test_substituted_advertised_key_is_detected_by_server_and_clients(attack: str) -> None:
    # Prepare: the attacker replaces client-002's mask key by its own
    config = _config(4, 2)
    rnd = Round.start(config, d=3)
    adverts = {u: c.advertise_keys() for u, c in rnd.clients.items()}
    genuine = adverts["client-002"]
    evil_key = Ed25519PrivateKey.generate()
    forged = dataclasses.replace(genuine, s_pk=bytes(range(32)))
    if attack == "resigned":
        forged = dataclasses.replace(forged, signature=evil_key.sign(forged.signed_payload()))
    elif attack == "unsigned":
        forged = dataclasses.replace(forged, signature=bytes(64))
    else:  # a genuine signature, but over another round's payload
        forged = dataclasses.replace(genuine, round_id=b"round-0006")
    expected_error = ProtocolError if attack == "replayed_round" else PrivacyError
    # Execute / Assert: the server refuses it, naming the client ...
    with pytest.raises(expected_error, match="'client-002'"):
        rnd.server.add_advert(forged)
    # ... and so does a client to which a malicious server relays it
    relayed = [a for u, a in adverts.items() if u != "client-002"] + [forged]
    with pytest.raises(expected_error, match="'client-002'"):
        rnd.clients["client-000"].share_keys(relayed)


@pytest.mark.parametrize("field", ["c_pk", "s_pk"])
def test_a_signed_low_order_key_leaves_only_its_client_out(field: str) -> None:
    # Prepare: client-002 signs a valid advertisement of the all-zero X25519 point (low
    # order: cryptography refuses any exchange with it); n = 5, t = 3
    from privacy.secagg import _advert_payload

    config = _config(5, 3)
    rnd = Round.start(config, d=3)
    genuine = rnd.clients["client-002"].advertise_keys()
    keys = {"c_pk": genuine.c_pk, "s_pk": genuine.s_pk, field: bytes(32)}
    payload = _advert_payload("client-002", config.round_id, keys["c_pk"], keys["s_pk"])
    bad = AdvertiseKeys("client-002", config.round_id, keys["c_pk"], keys["s_pk"],
                        rnd.keys["client-002"].sign(payload))  # fmt: skip
    # Execute / Assert: refused at the advertisement, naming the client and the key ...
    with pytest.raises(ProtocolError, match=f"'client-002': {field} is not a usable X25519"):
        rnd.server.add_advert(bad)
    # ... so the other four finish the round without it (it counts as never advertising)
    result = rnd.run({"client-002": 0})
    survivors = [u for u in config.cohort if u != "client-002"]
    assert result.tolist() == _plain_sum([rnd.encoded(u) for u in survivors], 32)


def test_client_refuses_to_reveal_both_shares_of_a_client() -> None:
    # Prepare: everybody sends its masked input
    config = _config(4, 2)
    rnd = Round.start(config, d=3)
    request = rnd.masked({})
    everyone = request.survivors
    holder = rnd.clients["client-000"]
    # Execute / Assert: in one request
    both = UnmaskRequest(ROUND, everyone, ("client-001",))
    with pytest.raises(PrivacyError, match="both.*'client-001'"):
        holder.unmask(both)
    # ... and across requests: first b_u of client-001, then its s_sk
    first = holder.unmask(UnmaskRequest(ROUND, everyone, ()))
    assert {s.owner for s in first.self_mask_shares} == {"client-001", "client-002", "client-003"}
    assert first.key_shares == ()
    rest = tuple(u for u in everyone if u != "client-001")
    with pytest.raises(PrivacyError, match="both.*'client-001'"):
        holder.unmask(UnmaskRequest(ROUND, rest, ("client-001",)))
    # a request that lists the responder itself as dropped is refused too
    with pytest.raises(PrivacyError, match="lists 'client-003' as dropped"):
        rnd.clients["client-003"].unmask(
            UnmaskRequest(ROUND, ("client-000", "client-001"), ("client-003",))
        )


def test_server_rejects_responses_that_are_not_what_it_asked() -> None:
    # Prepare
    config = _config(4, 2)
    rnd = Round.start(config, d=3)
    request = rnd.masked({"client-003": 2})
    response = rnd.clients["client-000"].unmask(request)
    # Execute / Assert: a missing share, a wrong abscissa, a duplicate
    missing = dataclasses.replace(response, self_mask_shares=response.self_mask_shares[1:])
    with pytest.raises(ProtocolError, match="wrong owners"):
        rnd.server.add_unmask_response(missing)
    s = response.self_mask_shares[0]
    moved = (dataclasses.replace(s, x=s.x + 1), *response.self_mask_shares[1:])
    with pytest.raises(ProtocolError, match="malformed shares"):
        rnd.server.add_unmask_response(dataclasses.replace(response, self_mask_shares=moved))
    rnd.server.add_unmask_response(response)
    with pytest.raises(ProtocolError, match="twice"):
        rnd.server.add_unmask_response(response)


def test_messages_round_trip_and_parsing_is_strict() -> None:
    # Prepare
    config = _config(3, 2, bits=32)
    rnd = Round.start(config, d=6)
    advert = rnd.clients["client-000"].advertise_keys()
    share = EncryptedShare("a", "b", ROUND, bytes(12), b"\x01" * 40)
    masked = MaskedInput("a", ROUND, 32, np.array([0, 1, 2**32 - 1], dtype=np.uint64))
    request = UnmaskRequest(ROUND, ("a", "b"), ("c",))
    response = UnmaskResponse("a", ROUND, (RevealedShare("b", 2, PRIME - 1),), ())
    # Execute / Assert: round trips
    assert AdvertiseKeys.from_bytes(advert.to_bytes()) == advert
    assert EncryptedShare.from_bytes(share.to_bytes()) == share
    back = MaskedInput.from_bytes(masked.to_bytes())
    assert (back.client_id, back.round_id, back.modulus_bits) == ("a", ROUND, 32)
    assert back.vector.dtype == np.uint32 and back.vector.tolist() == [0, 1, 2**32 - 1]
    assert len(masked.to_bytes()) == 6 + (4 + 1) + (4 + len(ROUND)) + 1 + 4 + 3 * 4
    assert UnmaskRequest.from_bytes(request.to_bytes()) == request
    assert UnmaskResponse.from_bytes(response.to_bytes()) == response
    # strictness
    raw = advert.to_bytes()
    with pytest.raises(ProtocolError, match="truncated"):
        AdvertiseKeys.from_bytes(raw[:-1])
    with pytest.raises(ProtocolError, match="trailing"):
        AdvertiseKeys.from_bytes(raw + b"\x00")
    with pytest.raises(ProtocolError, match="version 2"):
        AdvertiseKeys.from_bytes(raw[:4] + b"\x02" + raw[5:])
    with pytest.raises(ProtocolError, match="kind"):
        EncryptedShare.from_bytes(raw)
    with pytest.raises(ProtocolError, match="magic"):
        AdvertiseKeys.from_bytes(b"JSON" + raw[4:])
    with pytest.raises(ProtocolError, match="signature has 0 bytes"):
        AdvertiseKeys.from_bytes(dataclasses.replace(advert, signature=b"").to_bytes())
    wide = MaskedInput("a", ROUND, 40, np.array([2**40], dtype=np.uint64))
    with pytest.raises(ProtocolError, match="below 2\\^40"):
        wide.to_bytes()
    out_of_field = bytearray(response.to_bytes())
    out_of_field[-70:-4] = b"\xff" * 66  # the last share's ordinate, before the empty group
    with pytest.raises(ProtocolError, match="not an element"):
        UnmaskResponse.from_bytes(bytes(out_of_field))


@settings(max_examples=50, deadline=None)
@given(
    bits=st.integers(16, 64),
    log_scale=st.integers(0, 12),
    values=st.lists(st.floats(-3.0, 3.0), min_size=1, max_size=50),
    seed=st.integers(0, 1000),
)
def test_encode_decode_round_trip_within_one_unit(
    bits: int, log_scale: int, values: list[float], seed: int
) -> None:
    # Prepare
    scale, clip = 2.0**log_scale, 2.0
    x = np.array(values)
    # Execute
    enc = encode(x, clip, scale, bits, rounding=SeededUniform(seed))
    dec = decode(enc, 1, clip, scale, bits)
    # Assert: clipped, then within one fixed-point unit; values below 2^bits
    assert enc.dtype == np.uint64 and int(enc.max()) < 1 << bits
    assert np.all(np.abs(dec - np.clip(x, -clip, clip)) < 1.0 / scale)
    assert np.all(np.abs(dec) <= clip)


@pytest.mark.parametrize(("value", "scale"), [(0.37, 1.0), (-1.3, 2.0)])
def test_stochastic_rounding_is_unbiased(value: float, scale: float) -> None:
    # Prepare: the real CSPRNG; 200 000 copies of a value between two grid points
    n = 200_000
    # Execute
    dec = decode(encode(np.full(n, value), 2.0, scale, 32), 1, 2.0, scale, 32)
    # Assert: only the two neighbouring grid points; mean within 5 standard errors
    lo, hi = math.floor(value * scale) / scale, math.ceil(value * scale) / scale
    assert set(np.unique(dec).tolist()) == {lo, hi}
    p = (value - lo) / (hi - lo)
    assert abs(dec.mean() - value) < 5 * (hi - lo) * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_encode_is_clip_scale_and_round_up_below_the_fraction(dtype: type) -> None:
    # Prepare: values inside and beyond the clip range, at a scale that leaves fractions,
    # longer than one encoding chunk (65 536 values)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(70_000) * 1.5).astype(dtype)
    clip, scale, bits = 2.0, 2.0**20 / 3, 32
    # Execute
    enc = encode(x, clip, scale, bits, rounding=SeededUniform(9))
    # Assert: bit-exact against the definition, with the same uniforms
    scaled = np.clip(x.astype(np.float64), -clip, clip) * scale
    low = np.floor(scaled)
    want = (low + (SeededUniform(9).uniform(x.size) < scaled - low)).astype(np.int64)
    np.testing.assert_array_equal(enc, want.view(np.uint64) & np.uint64(2**bits - 1))


def test_encode_refuses_non_finite_values_and_clips_huge_finite_ones() -> None:
    for bad in (np.nan, np.inf, -np.inf):
        for dtype in (np.float32, np.float64):
            x = np.zeros(100, dtype=dtype)
            x[57] = bad
            with pytest.raises(PrivacyError, match="NaN or infinity"):
                encode(x, 2.0, 4.0, 32)
    # finite float64 values whose sum overflows are clipped like any other value
    huge = np.array([1e308, 1e308, -1e308, 0.5])
    dec = decode(encode(huge, 2.0, 4.0, 32), 1, 2.0, 4.0, 32)
    np.testing.assert_array_equal(dec, [2.0, 2.0, -2.0, 0.5])


@pytest.mark.parametrize("bits", [8, 31, 32, 33, 63, 64])
def test_decode_is_the_centred_lift(bits: int) -> None:
    # Prepare: the largest bound n B the modulus allows (B <= 2^52), residues at 0, +/-1 and
    # +/- n B, and one just beyond
    n = 1 if bits <= 53 else 1 << (bits - 55)
    b = min((1 << (bits - 1)) - 1, 1 << 52)
    top, nb = 1 << bits, n * b
    residues = [0, 1, nb, top - 1, top - nb]
    want = [0, 1, nb, -1, -nb]
    for dtype in (np.uint32, np.uint64) if bits <= 32 else (np.uint64,):
        # Execute
        got = decode(np.array(residues, dtype=dtype), n, float(b), 1.0, bits)
        # Assert: exact, in float64; one unit more than n B is refused
        np.testing.assert_array_equal(got, np.array(want, dtype=np.float64))
        with pytest.raises(ProtocolError, match=f"magnitude {nb + 1} > {nb}"):
            decode(np.array([top - nb - 1], dtype=dtype), n, float(b), 1.0, bits)


def test_check_modulus_refuses_a_wrapping_configuration() -> None:
    # Prepare / Execute / Assert: 2 n B < 2^bits exactly at the boundary
    assert check_modulus(1, 2.0**31 - 1, 1.0, 32) == 2**31 - 1
    with pytest.raises(PrivacyError, match=r"spans \+/-2147483648 .*use modulus_bits >= 33"):
        check_modulus(1, 2.0**31, 1.0, 32)
    with pytest.raises(PrivacyError, match=r"100 inputs.*2\^32"):
        check_modulus(100, 1.0, 2.0**25, 32)
    with pytest.raises(PrivacyError, match="64 bits are too few"):
        check_modulus(2**20, 1.0, 2.0**50, 64)
    with pytest.raises(PrivacyError, match="100 inputs"):
        _config(100, 51, bits=32, scale=2.0**25)
    # a sum outside +/- n B cannot come from n clipped inputs
    with pytest.raises(ProtocolError, match="corrupted"):
        decode(np.array([2**20], dtype=np.uint64), 2, 1.0, 2.0**10, 32)


def test_masks_are_the_aes_ctr_keystream() -> None:
    # Prepare: an independent AES-256-CTR keystream, IV 0, over a chunk boundary
    seed, other = bytes(range(32)), bytes(range(1, 33))
    n = (1 << 20) + 5
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(8 * n))
    # Execute
    mask = prg_mask(seed, n, 64)
    # Assert: same seed, same mask; little-endian words; reduced mod 2^bits; other seed differs
    assert mask[:3].tolist() == [
        int.from_bytes(stream[8 * i : 8 * i + 8], "little") for i in range(3)
    ]
    np.testing.assert_array_equal(mask, np.frombuffer(stream, dtype="<u8"))
    np.testing.assert_array_equal(prg_mask(seed, 1000, 64), mask[:1000])
    # moduli up to 2^32: the same keystream read as little-endian u32 words (word_dtype)
    words32 = np.frombuffer(stream[: 4 * n], dtype="<u4").astype(np.uint64)
    np.testing.assert_array_equal(prg_mask(seed, n, 32), words32)
    np.testing.assert_array_equal(prg_mask(seed, 1000, 20), words32[:1000] & np.uint64(2**20 - 1))
    assert prg_mask(seed, 10, 33).tolist() == (mask[:10] & np.uint64(2**33 - 1)).tolist()
    assert np.mean(prg_mask(other, 1000, 64) == mask[:1000]) == 0.0


@pytest.mark.parametrize(("n", "k"), [(10, 4), (10, 3), (11, 6), (7, 0), (7, 6)])
def test_neighbour_graph_is_k_regular_symmetric_and_seeded(n: int, k: int) -> None:
    # Prepare
    ids = _ids(n)
    # Execute
    g = neighbour_graph(ids, k, b"seed-a")
    # Assert
    degree = n - 1 if k == 0 else k
    assert sorted(g) == ids
    assert all(len(g[u]) == degree and u not in g[u] for u in ids)
    assert all(u in g[v] for u in ids for v in g[u])
    assert neighbour_graph(ids, k, b"seed-a") == g
    if 0 < k < n - 1:
        assert any(neighbour_graph(ids, k, s.encode()) != g for s in ("b", "c", "d"))


def test_config_refuses_bad_graphs_and_thresholds() -> None:
    with pytest.raises(PrivacyError, match="no 3-regular graph on 11"):
        _config(11, 2, 3)
    with pytest.raises(PrivacyError, match="threshold = 2: expected 3..4"):
        _config(10, 2, 4)
    with pytest.raises(PrivacyError, match="neighbours = 12"):
        _config(10, 7, 12)
    with pytest.raises(PrivacyError, match="more than once"):
        SecAggConfig(ROUND, ("a", "a", "b"), 1, 1.0, 1.0)


def test_secure_uniform_is_uniform() -> None:
    u = SecureUniform().uniform(100_000)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-4


def test_a_client_seen_to_go_is_not_waited_for_and_counts_as_dropped() -> None:
    # Prepare: the server's session of a 4-client SecAgg round (t = 2) on a clock that never
    # moves, so no deadline can close a stage; client-003 never advertises
    from fl_secure.config import SecureAggregationConfig
    from privacy.secagg_session import ADVERTISE, SHARE, ServerSecureRound, make_setup

    ids = _ids(4)
    setup = make_setup(
        SecureAggregationConfig(scheme="secagg"), run_id="gone", round_=1, attempt=0,
        cohort=ids, vector_length=8,
    )  # fmt: skip
    keys = {u: Ed25519PrivateKey.generate() for u in ids}
    registry = {u: k.public_key() for u, k in keys.items()}
    session = ServerSecureRound(setup, registry, stage_timeout=60.0, clock=lambda: 0.0)
    for u in ids[:3]:
        client = SecAggClient(u, keys[u], setup.config(), registry, setup.vector_length)
        session.submit(ADVERTISE, u, client.advertise_keys().to_bytes())
    waiting = session.ready()
    # Execute: its connection is seen to close
    session.mark_gone(ids[3])
    # Assert: the stage closes now, without a deadline, with client-003 dropped at that stage
    assert not waiting and session.ready()
    session.close_stage()
    assert session.stage == SHARE and session.dropped == {ids[3]: "advertise keys"}
    assert set(session.expected()) == set(ids[:3])  # the next stage asks only the others


@pytest.mark.parametrize("encoding", ["fixed_point", "ddg"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_client_refuses_to_mask_an_update_that_is_not_finite(encoding: str, bad: float) -> None:
    # Prepare: a 3-client round driven in-process; client-000's update has one bad value.
    # With the distributed discrete Gaussian ("ddg") a NaN norm would pass the clip and wrap
    # to garbage integers in the sum, so the session must check it itself.
    from collections import OrderedDict

    from fl_secure.config import SecureAggregationConfig
    from fl_secure.errors import UpdateError
    from privacy.secagg_session import (
        ADVERTISE,
        SHARE,
        ServerSecureRound,
        client_secure_update,
        make_setup,
        pack,
        unpack,
    )

    ids = _ids(3)
    setup = make_setup(
        SecureAggregationConfig(scheme="secagg"), run_id="nan", round_=1, attempt=0,
        cohort=ids, vector_length=8, ddg=(1.0, 1.0, 2) if encoding == "ddg" else None,
    )  # fmt: skip
    assert setup.encoding == encoding
    keys = {u: Ed25519PrivateKey.generate() for u in ids}
    registry = {u: k.public_key() for u, k in keys.items()}
    session = ServerSecureRound(setup, registry, stage_timeout=60.0, clock=lambda: 0.0)
    others = {
        u: SecAggClient(u, keys[u], setup.config(), registry, setup.vector_length) for u in ids[1:]
    }

    def exchange(stage: int, payload: bytes) -> bytes:  # the other two answer in step
        session.submit(stage, ids[0], payload)
        for u, c in others.items():
            if stage == ADVERTISE:
                session.submit(stage, u, c.advertise_keys().to_bytes())
            else:
                adverts = [
                    AdvertiseKeys.from_bytes(b)
                    for b in unpack(session.reply(ADVERTISE, u), "adverts")
                ]
                session.submit(stage, u, pack([s.to_bytes() for s in c.share_keys(adverts)]))
        session.close_stage()
        return session.reply(stage, ids[0])

    update = np.zeros(8, np.float32)
    update[3] = bad
    uploaded: list[np.ndarray] = []
    # Execute / Assert: refused after the key stages, before anything is uploaded
    with pytest.raises(UpdateError, match="NaN or infinity"):
        client_secure_update(
            setup, ids[0], keys[ids[0]], registry, exchange,
            lambda: OrderedDict([("w", update)]), uploaded.append,
        )  # fmt: skip
    assert session.stage == SHARE + 1 and uploaded == []


def test_round_setups_round_trip_and_malformed_ones_are_protocol_errors() -> None:
    from fl_secure.config import SecureAggregationConfig
    from privacy.ckks_session import CkksSetup, is_ckks_setup
    from privacy.secagg_session import RoundSetup, make_setup

    setup = make_setup(
        SecureAggregationConfig(scheme="secagg"), run_id="rt", round_=1, attempt=0,
        cohort=_ids(5), vector_length=8, min_inputs=4,
    )  # fmt: skip
    assert RoundSetup.from_bytes(setup.to_bytes()) == setup
    assert setup.config().min_inputs == 4
    raw = setup.to_bytes()
    malformed = [
        raw.replace(b'"threshold":3', b'"threshold":Infinity'),  # int(inf): OverflowError
        raw.replace(b'"min_inputs":4', b'"min_inputs":1e999'),
        raw.replace(b'"version":2', b'"version":1'),  # an older release's setup
        b"[" * 100_000,  # nesting beyond the parser's recursion limit
    ]
    assert all(m != raw for m in malformed[:3])
    for data in malformed:
        with pytest.raises(ProtocolError, match="invalid secure-aggregation setup"):
            RoundSetup.from_bytes(data)
    ckks = CkksSetup(ROUND, tuple(_ids(3)), None, min_count=2, decryptors=1)
    assert CkksSetup.from_bytes(ckks.to_bytes()) == ckks
    for data in (ckks.to_bytes().replace(b'"min_count":2', b'"min_count":1e999'), b"[" * 100_000):
        assert data != ckks.to_bytes()
        with pytest.raises(ProtocolError, match="invalid CKKS round setup"):
            CkksSetup.from_bytes(data)
    assert not is_ckks_setup(b"[" * 100_000)


# ------------------------------------------- a client holds each setup to its joined config


def _joined(placement: str = "distributed") -> object:
    from fl_secure.config import config_from_dict

    return config_from_dict(
        {
            "partition": {"num_clients": 5},
            "server": {"min_clients": 3},
            "privacy": {"unit": "client", "noise_placement": placement,
                        "noise_multiplier": 1.2, "clip_norm": 1.0},
            "secure_aggregation": {"scheme": "secagg+", "neighbours": 4, "clip_range": 8.0},
        }
    )  # fmt: skip


def test_a_client_accepts_the_setup_its_config_gives_and_refuses_a_weaker_one() -> None:
    from privacy.secagg_session import check_setup, make_setup

    config = _joined()
    cohort = [f"client-{i}" for i in range(5)]
    honest = make_setup(
        config.secure_aggregation, run_id="run", round_=4, attempt=1, cohort=cohort,
        vector_length=1000, ddg=(1.2, 1.0, 3), min_inputs=3,
    )  # fmt: skip
    check_setup(honest, config)  # what the coordinator sends: accepted
    assert honest.encoding == "ddg" and honest.ddg_sigma > 0
    weaker = {
        "encoding": dataclasses.replace(honest, encoding="fixed_point", ddg_sigma=0.0),
        "noise sigma": dataclasses.replace(honest, ddg_sigma=honest.ddg_sigma / 2),
        "threshold": dataclasses.replace(honest, threshold=1),
        "min_inputs": dataclasses.replace(honest, min_inputs=0),
        "clip_norm": dataclasses.replace(honest, clip_norm=100.0),
    }
    for name, setup in weaker.items():
        with pytest.raises(
            ProtocolError, match=f"weaker than the run this client joined: .*{name}"
        ):
            check_setup(setup, config)
    # more noise or a larger floor is not weaker
    check_setup(dataclasses.replace(honest, ddg_sigma=2 * honest.ddg_sigma, min_inputs=5), config)


def test_a_client_refuses_a_cohort_without_it_or_with_clients_not_enrolled() -> None:
    from privacy.secagg_session import check_setup, make_setup

    config = _joined()
    enrolled = [f"client-{i}" for i in range(5)]

    def setup(cohort: list[str]):  # noqa: ANN202
        return make_setup(
            config.secure_aggregation, run_id="run", round_=1, attempt=0, cohort=cohort,
            vector_length=100, ddg=(1.2, 1.0, 3), min_inputs=3,
        )  # fmt: skip

    check_setup(setup(enrolled), config, "client-2", enrolled)  # accepted
    with pytest.raises(ProtocolError, match=r"does not list this client \(client-9\)"):
        check_setup(setup(enrolled), config, "client-9", enrolled)
    # made-up members (each would cost this client memory; none can sign an advert)
    made_up = [*enrolled, *(f"ghost-{i}" for i in range(5))]
    with pytest.raises(ProtocolError, match="lists 5 client\\(s\\) not in the CA-signed registry"):
        check_setup(setup(made_up), config, "client-2", enrolled)
    twice = dataclasses.replace(setup(enrolled), cohort=(*enrolled, "client-0"))
    with pytest.raises(ProtocolError, match="lists a client twice"):
        check_setup(twice, config, "client-2", enrolled)


def test_a_ckks_client_refuses_a_setup_that_leaves_layers_in_the_clear() -> None:
    from fl_secure.config import config_from_dict
    from privacy.ckks_session import CkksSetup, check_ckks_setup

    config = config_from_dict(
        {"partition": {"num_clients": 4}, "server": {"min_clients": 3},
         "secure_aggregation": {"scheme": "ckks"}}
    )  # fmt: skip
    names = ["w", "b"]
    honest = CkksSetup(round_id=b"r" * 16, cohort=("a", "b", "c"), layers=None, min_count=3)
    check_ckks_setup(honest, config, names)
    with pytest.raises(ProtocolError, match=r"encrypted layers \['b'\] \(the run config gives all"):
        check_ckks_setup(dataclasses.replace(honest, layers=("b",)), config, names)
    with pytest.raises(ProtocolError, match="min_count 1 < server.min_clients 3"):
        check_ckks_setup(dataclasses.replace(honest, min_count=1), config, names)
