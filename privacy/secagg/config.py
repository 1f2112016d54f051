"""The parameters of one SecAgg round, known to the server and every client."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fl_secure.errors import PrivacyError
from privacy.secagg.codec import check_id
from privacy.secagg.consistency import signature_threshold
from privacy.secagg.encoding import UniformSource, check_modulus, decode, encode
from privacy.secagg.graph import neighbour_graph


@dataclass(frozen=True)
class SecAggConfig:
    """Parameters of one secure-aggregation round, known to the server and every client.

    Attributes:
        round_id: Public, never-repeated round identifier (1..255 bytes); it is bound into
            every signature, KDF context and AEAD associated data (the graph is seeded by the
            round's key advertisements, :func:`~privacy.secagg.graph.advert_seed`).
        cohort: The ids of the clients selected for the round (stored sorted).
        threshold: ``t``: shares needed to rebuild a secret, ``k // 2 < t <= k``. A strict
            majority of each neighbourhood prevents a server from collecting ``t`` shares of
            both ``b_u`` and ``s_u^SK`` from two disjoint groups.
        clip_range: Per-coordinate clipping bound of the fixed-point encoding.
        scale: Fixed-point scale (one integer unit = ``1 / scale``).
        neighbours: ``k``: 0 for SecAgg (complete graph, ``k = n - 1``), else SecAgg+.
        modulus_bits: Arithmetic is mod ``2^modulus_bits`` (1..64); checked by
            :func:`check_modulus` so the cohort's sum cannot wrap.
        min_inputs: The fewest masked inputs a sum may be unmasked with (0: the protocol's
            own ``t + 1``). Under distributed DP each input carries a share of the noise, so a
            sum of fewer than the shares it needs would be under-noised: the server aborts
            before asking for shares, and a client refuses an unmask request listing fewer.
        corrupt: ``c``: the most cohort members that may collude with the server; a client
            reveals shares only once more than ``(n + c) / 2`` of them signed the same
            survivor set (:attr:`consistency_threshold`, :mod:`~privacy.secagg.consistency`).
    """

    round_id: bytes
    cohort: tuple[str, ...]
    threshold: int
    clip_range: float
    scale: float
    neighbours: int = 0
    modulus_bits: int = 32
    min_inputs: int = 0
    corrupt: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.round_id, bytes) or not 1 <= len(self.round_id) <= 255:
            raise PrivacyError("round_id must be 1..255 bytes")
        for u in self.cohort:
            check_id(u, "SecAggConfig")
        object.__setattr__(self, "cohort", tuple(sorted(self.cohort)))
        n = len(self.cohort)
        if len(set(self.cohort)) != n:
            raise PrivacyError("the cohort lists a client more than once")
        if n < 2:
            raise PrivacyError(f"secure aggregation needs at least 2 clients, got {n}")
        if self.neighbours not in (0, n - 1):
            neighbour_graph(self.cohort, self.neighbours, b"")  # validates k
        k = self.degree
        if not k // 2 < self.threshold <= k:
            raise PrivacyError(
                f"threshold = {self.threshold}: expected {k // 2 + 1}..{k} for {k} neighbours "
                "(a strict majority, at most the neighbourhood)"
            )
        if not 0 <= self.min_inputs <= n:
            raise PrivacyError(f"min_inputs = {self.min_inputs}: expected 0..{n} for {n} clients")
        if not 0 <= self.corrupt < n:
            raise PrivacyError(f"corrupt = {self.corrupt}: expected 0..{n - 1} for {n} clients")
        check_modulus(n, self.clip_range, self.scale, self.modulus_bits)

    @property
    def degree(self) -> int:
        """Neighbours per client ``k`` (``n - 1`` for SecAgg)."""
        n = len(self.cohort)
        return n - 1 if self.neighbours == 0 else self.neighbours

    @property
    def consistency_threshold(self) -> int:
        """Signatures on one survivor set a client needs before it reveals a share."""
        return signature_threshold(len(self.cohort), self.corrupt)

    @property
    def min_adverts(self) -> int:
        """The smallest advertisement set ``U1`` a round can finish with (clients refuse less)."""
        return max(self.threshold + 1, self.min_inputs, self.consistency_threshold)

    def graph(self, seed: bytes) -> dict[str, frozenset[str]]:
        """The round's communication graph (see :func:`neighbour_graph`).

        Args:
            seed: :func:`~privacy.secagg.graph.advert_seed` of the round's advertisements
                (the complete graph of SecAgg ignores it).
        """
        return neighbour_graph(self.cohort, self.neighbours, seed)

    def share_x(self, client_id: str) -> int:
        """Shamir abscissa of the shares a client holds: its cohort position plus one."""
        return self.cohort.index(client_id) + 1

    def encode(
        self, update: np.ndarray, rounding: UniformSource | None = None, *, words: bool = False
    ) -> np.ndarray:
        """:func:`encode` with this round's clip range, scale and modulus."""
        return encode(
            update, self.clip_range, self.scale, self.modulus_bits, rounding=rounding, words=words
        )

    def decode(self, sum_vector: np.ndarray, num_inputs: int) -> np.ndarray:
        """:func:`decode` with this round's clip range, scale and modulus (float sum)."""
        return decode(sum_vector, num_inputs, self.clip_range, self.scale, self.modulus_bits)
