"""The communication graph of a round: complete (SecAgg) or ``k``-regular (SecAgg+).

Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020:
each client shares its secrets with, and masks against, only its ``k`` neighbours.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence

from fl_secure.errors import PrivacyError
from privacy.secagg.codec import DOMAIN, length_prefixed
from privacy.secagg.sharing import shared


def neighbour_graph(ids: Sequence[str], k: int, seed: bytes) -> dict[str, frozenset[str]]:
    """The communication graph: complete (SecAgg) or a random ``k``-regular graph (SecAgg+).

    For ``0 < k < n - 1`` the graph is a Harary graph ``H_{k,n}`` (the ``n`` clients on a
    ring, each joined to the ``k // 2`` nearest on either side, plus the diametrically
    opposite client when ``k`` is odd) whose vertices are labelled by a uniformly random
    permutation of the clients: the ring order sorts the clients by
    ``SHA-256(domain, seed, id)``. This is the graph of Google's SecAgg+ implementation of
    Bell et al. The seed must be public and agreed (the round id), so every party derives the
    same graph.

    Args:
        ids: The cohort (distinct ids).
        k: Neighbours per client; ``0`` or ``n - 1`` for the complete graph.
        seed: Public randomness for the permutation.

    Returns:
        Each id mapped to the set of its neighbours (never itself).

    Raises:
        PrivacyError: If ids repeat, ``k`` is out of range or no ``k``-regular graph exists.
    """
    if shared():  # a whole cohort in one process: derived once (a copy for each caller)
        return dict(_remembered_graph(tuple(ids), k, seed))
    return _graph(ids, k, seed)


def _graph(ids: Sequence[str], k: int, seed: bytes) -> dict[str, frozenset[str]]:
    nodes = sorted(set(ids))
    n = len(nodes)
    if n != len(ids):
        raise PrivacyError("the cohort lists a client more than once")
    if k == 0 or k == n - 1:
        return {u: frozenset(v for v in nodes if v != u) for u in nodes}
    if not 1 <= k < n - 1:
        raise PrivacyError(f"neighbours = {k}: expected 0 (all) or 1..{n - 1} for {n} clients")
    if k % 2 == 1 and n % 2 == 1:
        raise PrivacyError(
            f"no {k}-regular graph on {n} clients exists (both odd); use {k + 1} neighbours"
        )
    ring = sorted(
        nodes,
        key=lambda u: hashlib.sha256(
            DOMAIN + b"graph" + length_prefixed(seed, u.encode("utf-8"))
        ).digest(),
    )
    offsets = list(range(1, k // 2 + 1)) + list(range(n - k // 2, n))
    if k % 2 == 1:
        offsets.append(n // 2)
    return {u: frozenset(ring[(i + o) % n] for o in offsets) for i, u in enumerate(ring)}


@functools.lru_cache(maxsize=8)
def _remembered_graph(ids: tuple[str, ...], k: int, seed: bytes) -> dict[str, frozenset[str]]:
    return _graph(ids, k, seed)


def advert_seed(signed_payloads: Iterable[bytes]) -> bytes:
    """The graph's seed: SHA-256 of every advertisement of the round, in canonical order.

    Each payload is the signed part of one client's key advertisement (round id, client id,
    its two fresh public keys); they are sorted, so the seed depends on the set only. The
    server cannot pick it: it is fixed by keys the clients drew after the round id was set,
    and a client computes it itself from the advertisements it receives. The server still
    chooses which advertisements are in the set (and sees the others' before a client it
    colludes with draws its own), see ``docs/secure-aggregation.md``.
    """
    h = hashlib.sha256(DOMAIN + b"graph-seed")
    for payload in sorted(signed_payloads):
        h.update(length_prefixed(payload))
    return h.digest()


def survivor_groups(
    graph: dict[str, frozenset[str]], survivors: Iterable[str]
) -> list[frozenset[str]]:
    """The connected parts of the neighbour graph restricted to ``survivors``, largest first.

    Pairwise masks cancel only along edges between survivors, so unmasking a round whose
    survivors fall into more than one part would give the server each part's own sum (a
    SecAgg+ graph with odd ``k`` can split while every survivor keeps ``t`` neighbours).
    Both the server and every client refuse to unmask unless there is exactly one part.
    """
    left = set(survivors)
    groups: list[frozenset[str]] = []
    while left:
        frontier = [min(left)]
        group: set[str] = set()
        while frontier:
            u = frontier.pop()
            if u in group:
                continue
            group.add(u)
            frontier.extend(graph[u] & left - group)
        left -= group
        groups.append(frozenset(group))
    return sorted(groups, key=lambda g: (-len(g), min(g)))


def describe_groups(groups: list[frozenset[str]]) -> str:
    """The groups of :func:`survivor_groups` for an error message."""
    return "; ".join("{" + ", ".join(sorted(g)) + "}" for g in groups)
