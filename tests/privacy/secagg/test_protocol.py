"""SecAgg / SecAgg+: exact sums under dropouts, aborts, uniform masks, attacks, messages, graphs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted
from privacy.secagg.client import SecAggClient
from privacy.secagg.config import SecAggConfig
from privacy.secagg.consistency import ConsistencySignature
from privacy.secagg.graph import advert_seed, neighbour_graph, survivor_groups
from privacy.secagg.messages import (
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    RevealedShare,
    UnmaskRequest,
    UnmaskResponse,
    advert_payload,
)
from privacy.secagg.server import SecAggServer
from privacy.secagg.shamir import PRIME
from tests.privacy.secagg.helpers import ROUND, SeededUniform
from tests.privacy.secagg.helpers import config as _config
from tests.privacy.secagg.helpers import ids as _ids

# A client with drop stage s completes the stages before s and sends nothing from s on:
# 0 = never advertises, 1 = advertised only, 2 = shared keys but no masked input,
# 3 = sent its masked input but does not sign the survivor set (consistency check),
# 4 = signed it but does not answer the unmask request, 5 = completes the round.
COMPLETES = 5


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
    advertised: dict[str, AdvertiseKeys] = dataclasses.field(default_factory=dict)

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

    def advert(self, u: str) -> AdvertiseKeys:
        """Client ``u``'s advertisement (drawn once: the graph is seeded by it)."""
        if u not in self.advertised:
            self.advertised[u] = self.clients[u].advertise_keys()
        return self.advertised[u]

    def graph(self, drop: Mapping[str, int] | None = None) -> dict[str, frozenset[str]]:
        """The graph the round will have: seeded by the adverts of those not dropped at 0."""
        drop = drop or {}
        payloads = [
            self.advert(u).signed_payload()
            for u in self.config.cohort
            if drop.get(u, COMPLETES) > 0
        ]
        return self.config.graph(advert_seed(payloads))

    def adverts(self, drop: Mapping[str, int]) -> dict[str, tuple[AdvertiseKeys, ...]]:
        for u in self.clients:
            if drop.get(u, COMPLETES) > 0:
                self.server.add_advert(AdvertiseKeys.from_bytes(self.advert(u).to_bytes()))
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

    def consistency(
        self, request: UnmaskRequest, drop: Mapping[str, int]
    ) -> list[ConsistencySignature]:
        """Round 3: the survivors not dropped there sign ``U3``; the signatures relayed."""
        for u in request.survivors:
            if drop.get(u, COMPLETES) > 3:
                sig = self.clients[u].sign_survivors(request)
                self.server.add_consistency(ConsistencySignature.from_bytes(sig.to_bytes()))
        relayed = self.server.route_signatures()
        return [ConsistencySignature.from_bytes(s.to_bytes()) for s in relayed]

    def run(self, drop: Mapping[str, int]) -> np.ndarray:
        request = self.masked(drop)
        signatures = self.consistency(request, drop)
        for u in self.server.signers:
            if drop.get(u, COMPLETES) > 4:
                response = self.clients[u].unmask(request, signatures)
                self.server.add_unmask_response(UnmaskResponse.from_bytes(response.to_bytes()))
        return self.server.finish()


def _plain_sum(encoded: list[np.ndarray], bits: int) -> list[int]:
    """Reference sum mod 2^bits in Python integers (no numpy wraparound involved)."""
    return [sum(int(e[i]) for e in encoded) % (1 << bits) for i in range(encoded[0].size)]


def _predicted_success(rnd: Round, drop: Mapping[str, int]) -> bool:
    """Independent statement of when the round must succeed (thresholds of every stage)."""
    config = rnd.config
    g, t = rnd.graph(drop), config.threshold
    stage = {u: drop.get(u, COMPLETES) for u in config.cohort}
    # signatures on U3: more than (n + c) / 2 of the cohort, c = config.corrupt
    signed = (len(config.cohort) + config.corrupt) // 2 + 1
    u1 = {u for u in config.cohort if stage[u] >= 1}
    u2 = {u for u in u1 if stage[u] >= 2 and len(g[u] & u1) >= t}
    u3 = {u for u in u2 if stage[u] >= 3 and len(g[u] & u2) >= t}
    if min(len(u1), len(u2), len(u3)) < max(t + 1, signed):
        return False
    dropped = {u for u in u2 - u3 if g[u] & u3}
    signers = {u for u in u3 if stage[u] >= 4}
    responders = {u for u in signers if stage[u] >= 5}
    if _components(g, u3) > 1 or len(signers) < signed:  # masks cancel only within a group
        return False
    return all(
        len(g[u] & u3) >= t and len(g[u] & signers) >= t and len(g[u] & responders) >= t
        for u in u3 | dropped
    )


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
    drop = {u: draw(st.integers(0, 4)) for u in order[:n_drop]}
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
    assert (result is not None) == _predicted_success(rnd, drop)
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
    # three drop before advertising (the graph is seeded by the others' adverts), then
    # greedily: at most k - t dropouts in any neighbourhood
    drop: dict[str, int] = dict.fromkeys(config.cohort[:21:7], 0)
    g = rnd.graph(drop)
    assert all(len(g[v] & set(drop)) <= config.degree - t for v in g)
    for u in config.cohort[21::7]:
        if len(drop) < 10 and all(len(g[v] & {*drop, u}) <= config.degree - t for v in g):
            drop[u] = 1 + len(drop) % 3
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
    drop = dict.fromkeys(sorted(rnd.graph()["client-000"])[:2], 2)
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
    rnd = Round.start(config, d=4)
    graph, t = rnd.graph(), config.threshold
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
    # Execute / Assert: the server aborts before asking for any share ...
    with pytest.raises(RoundAborted, match="split into 2 groups no pairwise mask joins"):
        rnd.masked(dict.fromkeys(cut, 2))
    assert rnd.server.result is None
    # ... and a client asked by a server that does not refuses to reveal anything
    request = UnmaskRequest(config.round_id, tuple(sorted(survivors)), tuple(sorted(cut)))
    for u in survivors:
        with pytest.raises(PrivacyError, match="refuses to unmask: the survivors split"):
            rnd.clients[u].sign_survivors(request)


def test_too_few_unmask_responses_abort_and_no_sum_exists() -> None:
    # Prepare: everybody sends its masked input, only two of five answer the request (t = 3)
    config = _config(5, 3)
    rnd = Round.start(config, d=4)
    drop = {"client-002": 4, "client-003": 4, "client-004": 4}
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
        rnd.clients["client-000"].sign_survivors(request)
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

    config = _config(5, 3)
    rnd = Round.start(config, d=3)
    genuine = rnd.clients["client-002"].advertise_keys()
    keys = {"c_pk": genuine.c_pk, "s_pk": genuine.s_pk, field: bytes(32)}
    payload = advert_payload("client-002", config.round_id, keys["c_pk"], keys["s_pk"])
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
    # Execute / Assert: a request naming a client both survived and dropped is not signed
    both = UnmaskRequest(ROUND, everyone, ("client-001",))
    with pytest.raises(PrivacyError, match="both.*'client-001'"):
        holder.sign_survivors(both)
    # a request that lists the responder itself as dropped is refused too
    with pytest.raises(PrivacyError, match="lists 'client-003' as dropped"):
        rnd.clients["client-003"].sign_survivors(
            UnmaskRequest(ROUND, ("client-000", "client-001", "client-002"), ("client-003",))
        )
    # ... and across requests: once it signed U3 (and revealed b_u of client-001), it signs
    # no other set and answers no request but the signed one
    signatures = rnd.consistency(request, {})
    first = holder.unmask(request, signatures)
    assert {s.owner for s in first.self_mask_shares} == {"client-001", "client-002", "client-003"}
    assert first.key_shares == ()
    rest = tuple(u for u in everyone if u != "client-001")
    with pytest.raises(ProtocolError, match="sign_survivors called out of order"):
        holder.sign_survivors(UnmaskRequest(ROUND, rest, ("client-001",)))
    with pytest.raises(ProtocolError, match="unmask called out of order"):
        holder.unmask(UnmaskRequest(ROUND, rest, ("client-001",)), signatures)
    # another holder, asked with a request other than the one it signed, refuses
    with pytest.raises(PrivacyError, match="differs from the survivor set it signed"):
        rnd.clients["client-002"].unmask(UnmaskRequest(ROUND, rest, ("client-001",)), signatures)


def test_server_rejects_responses_that_are_not_what_it_asked() -> None:
    # Prepare
    config = _config(4, 2)
    rnd = Round.start(config, d=3)
    request = rnd.masked({"client-003": 2})
    response = rnd.clients["client-000"].unmask(request, rnd.consistency(request, {}))
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
