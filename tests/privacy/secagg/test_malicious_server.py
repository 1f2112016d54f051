"""A malicious server that splits the survivor set cannot unmask one client's update.

Without the consistency round, each client checks only its own unmask request: the server
tells the target ``u``'s neighbours "``u`` survived" (they reveal shares of ``b_u``) and
tells each neighbour ``v``'s other holders "``v`` dropped" (they reveal shares of
``s_v^SK``). No holder is asked for both shares of one client, yet the server ends with
``b_u`` and every pairwise seed of ``u`` and so with ``u``'s update. The scripted server
below runs that attack against the real :class:`~privacy.secagg.client.SecAggClient`; with
the consistency round (:mod:`privacy.secagg.consistency`) every client refuses to reveal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted
from privacy.secagg.arithmetic import modulus_mask, word_dtype
from privacy.secagg.client import SecAggClient
from privacy.secagg.config import SecAggConfig
from privacy.secagg.graph import survivor_groups
from privacy.secagg.keys import SECRET_BYTES, agree, kdf
from privacy.secagg.masks import apply_keystreams
from privacy.secagg.messages import AdvertiseKeys, UnmaskRequest, UnmaskResponse
from privacy.secagg.server import SecAggServer
from privacy.secagg.shamir import shamir_interpolate
from tests.privacy.secagg.helpers import SeededUniform
from tests.privacy.secagg.helpers import config as _config

TARGET = "client-000"
SCALE = 2.0**20  # one quantum: 2^-20
CASES = [(10, 5, 0), (4, 2, 0), (10, 3, 4)]  # (n, t, k): SecAgg n = 10 and 4, SecAgg+ k = 4


@dataclasses.dataclass
class Setting:
    """A round run honestly up to the masked inputs; the server's view of it."""

    config: SecAggConfig
    clients: dict[str, SecAggClient]
    keys: dict[str, Ed25519PrivateKey]
    graph: dict[str, frozenset[str]]
    adverts: dict[str, AdvertiseKeys]
    masked: dict[str, np.ndarray]
    updates: dict[str, np.ndarray]


def _setting(n: int, t: int, k: int, corrupt: int = 0, d: int = 16) -> Setting:
    config = _config(n, t, k, bits=32, scale=SCALE)
    if corrupt:
        config = dataclasses.replace(config, corrupt=corrupt)
    rng = np.random.default_rng(n + k)
    keys = {u: Ed25519PrivateKey.generate() for u in config.cohort}
    registry = {u: key.public_key() for u, key in keys.items()}
    clients = {
        u: SecAggClient(u, keys[u], config, registry, d, rounding=SeededUniform(i))
        for i, u in enumerate(config.cohort)
    }
    updates = {u: rng.uniform(-0.9, 0.9, d) for u in config.cohort}
    server = SecAggServer(config, registry, d)
    for c in clients.values():
        server.add_advert(c.advertise_keys())
    routed = server.route_adverts()
    for u, inbox in routed.items():
        server.add_shares(u, clients[u].share_keys(inbox))
    masked = {}
    for u, inbox in server.route_shares().items():
        m = clients[u].masked_input(inbox, updates[u])
        masked[u] = m.vector
        server.add_masked_input(m)
    adverts = {a.client_id: a for a in routed[TARGET]}
    return Setting(config, clients, keys, server.graph, adverts, masked, updates)


def _split(s: Setting) -> dict[str, UnmaskRequest]:
    """The review's attack: per holder, which of ``u``'s neighbours it is told dropped.

    Every holder is told ``u`` survived (shares of ``b_u``); each neighbour ``v`` of ``u`` is
    told dropped to ``t`` of its holders (shares of ``s_v^SK``), spread over the holders so
    that every request passes a client's own checks (enough survivors, one connected group).
    """
    cfg, g, t = s.config, s.graph, s.config.threshold
    dropped: dict[str, set[str]] = {w: set() for w in cfg.cohort}

    def valid(w: str, d: set[str]) -> bool:
        alive = set(cfg.cohort) - d
        return len(alive) >= max(t, cfg.min_inputs) and len(survivor_groups(g, alive)) == 1

    for v in sorted(g[TARGET]):
        told = 0
        for w in sorted(g[v], key=lambda w: (len(dropped[w]), w)):
            if told < t and w != v and valid(w, dropped[w] | {v}):
                dropped[w].add(v)
                told += 1
        assert told == t, f"the attack cannot tell {t} holders of {v} that it dropped"
    return {
        w: UnmaskRequest(cfg.round_id, tuple(sorted(set(cfg.cohort) - d)), tuple(sorted(d)))
        for w, d in dropped.items()
    }


def _ask(s: Setting, requests: Mapping[str, UnmaskRequest], corrupt: Sequence[str]) -> list[Any]:
    """Run the unmasking with one request per client; the responses the server obtains.

    With a consistency round, the server hands each client every signature made on the same
    request as its own (those of the corrupt clients too: they sign whatever it asks) -- the
    most it can give a client that verifies them against its own statement.
    """
    honest = [u for u in s.config.cohort if u not in corrupt]
    if not hasattr(SecAggClient, "sign_survivors"):  # no consistency round: ask directly
        return [s.clients[u].unmask(requests[u]) for u in honest]
    from privacy.secagg.consistency import ConsistencySignature, statement

    signed: dict[UnmaskRequest, list[Any]] = {}
    for u in honest:
        try:
            signed.setdefault(requests[u], []).append(s.clients[u].sign_survivors(requests[u]))
        except (PrivacyError, ProtocolError, RoundAborted):
            continue
    round_id = s.config.round_id
    for u in corrupt:  # a corrupt client signs every statement the server made
        for request, sigs in signed.items():
            if u not in request.survivors:  # clients count only survivors' signatures
                continue
            claim = statement(round_id, s.clients[u]._u1_digest, request.survivors)
            sigs.append(ConsistencySignature(u, round_id, s.keys[u].sign(claim)))
    responses = []
    for u in honest:
        try:
            responses.append(s.clients[u].unmask(requests[u], signed.get(requests[u], [])))
        except (PrivacyError, ProtocolError):
            continue  # refused: too few signatures on its survivor set
    return responses


def _recover(s: Setting, responses: Sequence[UnmaskResponse], corrupt: Sequence[str]) -> Any:
    """The server's best reconstruction of the target's update, or None (too few shares)."""
    cfg, t = s.config, s.config.threshold
    b_shares: list[tuple[int, int]] = []
    s_shares: dict[str, list[tuple[int, int]]] = {}
    for r in responses:
        b_shares += [(x.x, x.y) for x in r.self_mask_shares if x.owner == TARGET]
        for x in r.key_shares:
            s_shares.setdefault(x.owner, []).append((x.x, x.y))
    for u in corrupt:  # what corrupt holders give the server: both shares they hold
        for owner, (x, b_y, s_y) in s.clients[u]._held.items():
            if owner == TARGET:
                b_shares.append((x, b_y))
            s_shares.setdefault(owner, []).append((x, s_y))
    b_shares = sorted(set(b_shares))
    if len(b_shares) < t:
        return None
    b = shamir_interpolate(b_shares[:t]).to_bytes(SECRET_BYTES, "big")
    seeds = [(b, True)]
    for v in sorted(s.graph[TARGET]):
        held = sorted(set(s_shares.get(v, [])))
        if len(held) < t:
            return None
        s_v = shamir_interpolate(held[:t]).to_bytes(SECRET_BYTES, "big")
        shared = agree(X25519PrivateKey.from_private_bytes(s_v), s.adverts[TARGET].s_pk, TARGET)
        seeds.append((kdf(b"mask-seed", shared, cfg.round_id, v, TARGET), v > TARGET))
    total = s.masked[TARGET].astype(word_dtype(cfg.modulus_bits))
    apply_keystreams(total, seeds)
    total = total.astype(np.uint64) & np.uint64(modulus_mask(cfg.modulus_bits))
    return cfg.decode(total, 1)


@pytest.mark.parametrize(("n", "t", "k"), CASES)
def test_a_split_survivor_set_does_not_unmask_one_update(n: int, t: int, k: int) -> None:
    # Prepare: an honest round up to the masked inputs, then a server that tells each holder
    # its own survivor set (feasible: every request passes the holder's local checks)
    s = _setting(n, t, k)
    requests = _split(s)
    assert len(set(requests.values())) > 1  # the server splits the survivors
    # Execute: the server asks, and reconstructs what it can
    recovered = _recover(s, _ask(s, requests, corrupt=()), corrupt=())
    # Assert: the target's update is not recovered (without the consistency round it is,
    # within one quantum: the clients reveal b_u and every s_v^SK of u's neighbours)
    truth = np.clip(s.updates[TARGET], -1.0, 1.0)
    if recovered is not None:
        error = float(np.max(np.abs(recovered - truth)))
        assert error > 0.1, f"the target's update was recovered to within {error:.3g}"
    assert recovered is None


@pytest.mark.parametrize(("n", "t", "k"), CASES)
def test_a_majority_told_u3_and_corrupt_signers_still_recover_nothing(
    n: int, t: int, k: int
) -> None:
    # Prepare: c corrupt clients (not the target) sign every statement and hand the server
    # both shares they hold; a majority of the honest ones is told the true U3 (they accept
    # and reveal b_u), the rest get the split requests (to reveal the s_v^SK of u's
    # neighbours)
    corrupt_n = (n - 1) // 4
    s = _setting(n, t, k, corrupt=corrupt_n)
    corrupt = [u for u in s.config.cohort if u != TARGET][-corrupt_n:] if corrupt_n else []
    split = _split(s)
    everyone = UnmaskRequest(s.config.round_id, s.config.cohort, ())
    need = s.config.consistency_threshold
    honest = [u for u in s.config.cohort if u not in corrupt]
    majority = set(honest[: need - len(corrupt)])
    requests = {u: everyone if u in majority or u in corrupt else split[u] for u in split}
    # Execute
    responses = _ask(s, requests, corrupt)
    recovered = _recover(s, responses, corrupt)
    # Assert: the majority's statement gathers its signatures and only it is answered (b
    # shares of every survivor); the split requests gather too few, so no s_v^SK of u's
    # neighbours can be rebuilt and the update stays masked
    answered = {r.client_id for r in responses}
    assert answered == {u for u in honest if requests[u] == everyone} >= majority
    assert all(r.key_shares == () for r in responses)
    assert recovered is None
