"""The server's side of one SecAgg round: verify, relay, sum and unmask (Bonawitz et al.).

The server relays adverts and encrypted shares, folds the masked inputs into a running sum
mod ``2^bits`` and removes the masks from the shares the survivors reveal (Round 4); see
:mod:`privacy.secagg` for the protocol and its equations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted
from privacy.secagg.arithmetic import check_vector, modulus_mask, word_dtype
from privacy.secagg.codec import MAX_CIPHERTEXT_BYTES, NONCE_BYTES
from privacy.secagg.config import SecAggConfig
from privacy.secagg.consistency import (
    ConsistencySignature,
    advert_set_digest,
    statement,
    verify_signature,
)
from privacy.secagg.graph import advert_seed, describe_groups, survivor_groups
from privacy.secagg.keys import SECRET_BYTES, agree, kdf, public_bytes, verify_advert
from privacy.secagg.masks import apply_keystreams
from privacy.secagg.messages import (
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    UnmaskRequest,
    UnmaskResponse,
)
from privacy.secagg.shamir import PRIME, shamir_interpolate


class SecAggServer:
    """The server's side of one round: verifies, relays, sums and unmasks.

    Stages (each ``add_*`` may be called once per client; a message that fails validation
    raises and is not recorded, so its sender counts as dropped):

    0. :meth:`add_advert` for each client, then :meth:`route_adverts` (Round 0),
    1. :meth:`add_shares` for each client, then :meth:`route_shares` (Round 1),
    2. :meth:`add_masked_input` for each client (folded into a running sum mod ``2^bits``,
       memory ``O(d)``), then :meth:`unmask_request` (Round 2),
    3. :meth:`add_consistency` for each survivor, then :meth:`route_signatures` (Round 3),
    4. :meth:`add_unmask_response` for each signer, then :meth:`finish` (Round 4).

    Args:
        config: The round's configuration.
        registry: Enrolled Ed25519 identity public keys by client id.
        vector_length: ``d``.
    """

    def __init__(
        self,
        config: SecAggConfig,
        registry: Mapping[str, Ed25519PublicKey],
        vector_length: int,
    ) -> None:
        if vector_length < 1:
            raise PrivacyError(f"vector_length = {vector_length}: expected >= 1")
        self.config = config
        self.vector_length = vector_length
        self._registry = registry
        self._graph: dict[str, frozenset[str]] = {}  # fixed by the adverts (route_adverts)
        self._adverts: dict[str, AdvertiseKeys] = {}
        self._keys_in_use: set[bytes] = set()
        self._shares: dict[str, tuple[EncryptedShare, ...]] = {}
        self._u1: frozenset[str] = frozenset()
        self._u2: frozenset[str] = frozenset()
        self._u3: set[str] = set()
        self._dropped: frozenset[str] = frozenset()
        self._sum: np.ndarray | None = None
        self._b_shares: dict[str, list[tuple[int, int]]] = {}
        self._s_shares: dict[str, list[tuple[int, int]]] = {}
        self._u1_digest = b""
        self._statement = b""
        self._signatures: dict[str, ConsistencySignature] = {}
        self._u4: frozenset[str] = frozenset()  # survivors whose consistency signature came in
        self._responders: set[str] = set()
        self._result: np.ndarray | None = None
        self._stage = 0

    # -- helpers ----------------------------------------------------------------------------

    def _expect_stage(self, stage: int, what: str) -> None:
        if self._stage == -1:
            raise RoundAborted("the round was aborted")
        if self._stage != stage:
            raise ProtocolError(f"server: {what} called out of order")

    def _abort(self, message: str) -> RoundAborted:
        self._stage = -1
        self._sum = None
        self._b_shares.clear()
        self._s_shares.clear()
        return RoundAborted(message)

    def _require_participants(self, group: Iterable[str], stage: str) -> None:
        m, t = len(list(group)), self.config.threshold
        if m < t + 1:
            raise self._abort(
                f"only {m} clients {stage}; at least t + 1 = {t + 1} are needed "
                f"(every survivor needs t = {t} surviving neighbours)"
            )
        if m < self.config.min_inputs:
            raise self._abort(
                f"only {m} clients {stage}; the round needs at least {self.config.min_inputs} "
                "inputs in its sum, so it is aborted before any share is revealed"
            )
        need = self.config.consistency_threshold
        if m < need:
            raise self._abort(
                f"only {m} clients {stage}; the consistency check needs {need} signatures on "
                f"the survivor set (more than half of the {len(self.config.cohort)} in the "
                "cohort plus its corrupt allowance), so it is aborted before any share is revealed"
            )

    def _require_holders(self, holders: frozenset[str], who: str) -> None:
        """Abort unless every secret to rebuild has ``t`` share holders among ``holders``."""
        t = self.config.threshold
        counts = {u: len(self._graph[u] & holders) for u in sorted(self._u3 | self._dropped)}
        detail = ", ".join(f"{u!r} ({m})" for u, m in counts.items() if m < t)
        if detail:
            raise self._abort(
                f"too few {who} hold shares of {detail}; t = {t} are needed; round aborted "
                "before any share was revealed"
            )

    @property
    def graph(self) -> dict[str, frozenset[str]]:
        """The round's graph, once :meth:`route_adverts` fixed it (empty before)."""
        return dict(self._graph)

    @property
    def signers(self) -> tuple[str, ...]:
        """``U4``: survivors whose consistency signature arrived (sorted; after Round 3)."""
        return tuple(sorted(self._u4))

    @property
    def survivors(self) -> tuple[str, ...]:
        """``U3``: clients whose masked input is in the sum (sorted)."""
        return tuple(sorted(self._u3))

    @property
    def result(self) -> np.ndarray | None:
        """The unmasked sum once :meth:`finish` succeeded; None before and after an abort."""
        return None if self._result is None else self._result.copy()

    # -- Round 0 ----------------------------------------------------------------------------

    def add_advert(self, advert: AdvertiseKeys) -> None:
        """Verify and record one client's key advertisement (Round 0).

        Raises:
            PrivacyError: If the signature does not verify against the registry.
            ProtocolError: If malformed, repeated, for another round or reusing a key.
        """
        self._expect_stage(0, "add_advert")
        verify_advert(advert, self.config, self._registry)
        if advert.client_id in self._adverts:
            raise ProtocolError(f"client {advert.client_id!r} advertised keys twice")
        if {advert.c_pk, advert.s_pk} & self._keys_in_use:
            raise ProtocolError(f"client {advert.client_id!r} reuses a public key")
        self._keys_in_use |= {advert.c_pk, advert.s_pk}
        self._adverts[advert.client_id] = advert

    def route_adverts(self) -> dict[str, tuple[AdvertiseKeys, ...]]:
        """Close Round 0: ``U1``; every ``u`` in ``U1`` gets all of ``U1``'s adverts.

        The graph is seeded by the hash of these adverts (:func:`advert_seed`), which each
        client recomputes from what it receives, so every client gets the whole set (``O(n)``
        adverts of 150 bytes each) rather than only its neighbours'.

        Raises:
            RoundAborted: If fewer than ``t + 1`` clients advertised keys.
        """
        self._expect_stage(0, "route_adverts")
        self._u1 = frozenset(self._adverts)
        self._require_participants(self._u1, "advertised keys")
        adverts = tuple(self._adverts[v] for v in sorted(self._u1))
        self._u1_digest = advert_set_digest(adverts, self.config.cohort)
        self._graph = self.config.graph(advert_seed(a.signed_payload() for a in adverts))
        self._stage = 1
        return dict.fromkeys(sorted(self._u1), adverts)

    # -- Round 1 ----------------------------------------------------------------------------

    def add_shares(self, sender: str, shares: Sequence[EncryptedShare]) -> None:
        """Record one client's encrypted shares: exactly one per neighbour in ``U1``.

        Raises:
            ProtocolError: If the sender is unknown or repeated, or the shares do not cover
                exactly its neighbours that advertised keys.
        """
        self._expect_stage(1, "add_shares")
        if sender not in self._u1:
            raise ProtocolError(f"shares from {sender!r}, which did not advertise keys")
        if sender in self._shares:
            raise ProtocolError(f"client {sender!r} sent its shares twice")
        receivers = []
        for s in shares:
            if s.sender != sender or s.round_id != self.config.round_id:
                raise ProtocolError(f"a share sent by {sender!r} has the wrong sender or round")
            if len(s.nonce) != NONCE_BYTES or len(s.ciphertext) > MAX_CIPHERTEXT_BYTES:
                raise ProtocolError(f"a share sent by {sender!r} is malformed")
            receivers.append(s.receiver)
        expected = self._graph[sender] & self._u1
        if len(receivers) != len(set(receivers)) or set(receivers) != expected:
            raise ProtocolError(
                f"client {sender!r} must send exactly one share to each of its {len(expected)} "
                f"neighbours with keys, got {len(receivers)}"
            )
        self._shares[sender] = tuple(shares)

    def route_shares(self) -> dict[str, tuple[EncryptedShare, ...]]:
        """Close Round 1: ``U2``; each client in ``U2`` gets the shares sent to it from ``U2``.

        Raises:
            RoundAborted: If fewer than ``t + 1`` clients shared their keys.
        """
        self._expect_stage(1, "route_shares")
        self._u2 = frozenset(self._shares)
        self._require_participants(self._u2, "shared their keys")
        inbox: dict[str, list[EncryptedShare]] = {u: [] for u in sorted(self._u2)}
        for sender in sorted(self._u2):
            for s in self._shares[sender]:
                if s.receiver in inbox:
                    inbox[s.receiver].append(s)
        self._shares.clear()
        self._sum = np.zeros(self.vector_length, dtype=word_dtype(self.config.modulus_bits))
        self._stage = 2
        return {u: tuple(v) for u, v in inbox.items()}

    # -- Round 2 ----------------------------------------------------------------------------

    def add_masked_input(self, masked: MaskedInput) -> None:
        """Fold one masked input into the running sum mod ``2^bits`` (it is not kept).

        Raises:
            ProtocolError: If the sender is not in ``U2``, repeated, or the vector malformed.
        """
        self._expect_stage(2, "add_masked_input")
        assert self._sum is not None
        who = masked.client_id
        if who not in self._u2:
            raise ProtocolError(f"masked input from {who!r}, which did not share its keys")
        if who in self._u3:
            raise ProtocolError(f"client {who!r} sent its masked input twice")
        if masked.round_id != self.config.round_id:
            raise ProtocolError(f"masked input from {who!r} is for another round")
        if masked.modulus_bits != self.config.modulus_bits:
            raise ProtocolError(f"masked input from {who!r} uses another modulus")
        vector = check_vector(
            masked.vector, self.config.modulus_bits, self.vector_length, f"input from {who!r}"
        )
        self._sum += vector  # wraps mod 2^32 or 2^64 (word_dtype); reduced mod 2^bits at the end
        self._u3.add(who)

    def unmask_request(self) -> UnmaskRequest:
        """Close Round 2: ask the survivors for the shares needed to remove the masks.

        Before asking, checks that every client whose secret must be rebuilt has at least
        ``t`` neighbours in ``U3`` that hold a share; otherwise aborts without asking.

        Raises:
            RoundAborted: If a neighbourhood has fewer than ``t`` surviving share holders.
        """
        self._expect_stage(2, "unmask_request")
        self._require_participants(self._u3, "sent masked inputs")
        u3 = frozenset(self._u3)
        self._dropped = frozenset(u for u in self._u2 - u3 if self._graph[u] & u3)
        self._require_holders(u3, "surviving neighbours")
        groups = survivor_groups(self._graph, u3)
        if len(groups) > 1:
            raise self._abort(
                f"the {len(u3)} survivors split into {len(groups)} groups no pairwise mask "
                f"joins ({describe_groups(groups)}): unmasking would reveal each group's own "
                "sum; round aborted before any share was revealed"
            )
        self._statement = statement(self.config.round_id, self._u1_digest, u3)
        self._stage = 3
        return UnmaskRequest(self.config.round_id, tuple(sorted(u3)), tuple(sorted(self._dropped)))

    # -- Round 3 ----------------------------------------------------------------------------

    def add_consistency(self, sig: ConsistencySignature) -> None:
        """Record one survivor's signature on ``(round id, U1 digest, U3)`` after verifying it.

        Raises:
            ProtocolError: If the signer is not a survivor, repeated or for another round.
            PrivacyError: If the signature does not verify (naming the signer).
        """
        self._expect_stage(3, "add_consistency")
        who = sig.client_id
        if who not in self._u3:
            raise ProtocolError(f"consistency signature from {who!r}, which is not a survivor")
        if who in self._signatures:
            raise ProtocolError(f"client {who!r} sent its consistency signature twice")
        verify_signature(sig, self._statement, self.config.round_id, self._registry)
        self._signatures[who] = sig

    def route_signatures(self) -> tuple[ConsistencySignature, ...]:
        """Close Round 3: ``U4``, the signers; every one of them gets every signature.

        Raises:
            RoundAborted: If fewer than ``config.consistency_threshold`` survivors signed, or
                a secret has fewer than ``t`` holders among the signers (nothing was revealed).
        """
        self._expect_stage(3, "route_signatures")
        self._u4 = frozenset(self._signatures)
        need = self.config.consistency_threshold
        if len(self._u4) < need:
            raise self._abort(
                f"too few survivors signed the survivor set ({len(self._u4)}); the "
                f"consistency check needs {need}; round aborted before any share was revealed"
            )
        self._require_holders(self._u4, "signers")
        self._stage = 4
        return tuple(self._signatures[u] for u in sorted(self._u4))

    # -- Round 4 ----------------------------------------------------------------------------

    def add_unmask_response(self, response: UnmaskResponse) -> None:
        """Record one survivor's revealed shares after checking they are what was asked.

        Raises:
            ProtocolError: If the responder is not a survivor, repeated, or the shares are not
                exactly those requested from it (owners, kinds, abscissa, field range).
        """
        self._expect_stage(4, "add_unmask_response")
        who = response.client_id
        if who not in self._u4:
            raise ProtocolError(
                f"unmask response from {who!r}, which did not sign the survivor set"
            )
        if who in self._responders:
            raise ProtocolError(f"client {who!r} responded twice")
        if response.round_id != self.config.round_id:
            raise ProtocolError(f"unmask response from {who!r} is for another round")
        x = self.config.share_x(who)
        groups = (
            (response.self_mask_shares, self._graph[who] & self._u3, self._b_shares),
            (response.key_shares, self._graph[who] & self._dropped, self._s_shares),
        )
        for shares, expected, _ in groups:
            owners = [s.owner for s in shares]
            if len(owners) != len(set(owners)) or set(owners) != expected:
                raise ProtocolError(f"unmask response from {who!r} has the wrong owners")
            if any(s.x != x or not 0 <= s.y < PRIME for s in shares):
                raise ProtocolError(f"unmask response from {who!r} has malformed shares")
        for shares, _, store in groups:
            for s in shares:
                store.setdefault(s.owner, []).append((s.x, s.y))
        self._responders.add(who)

    def finish(self) -> np.ndarray:
        """Close Round 4: rebuild the secrets, remove the masks, return the sum.

        Returns:
            ``sum_{u in U3} encode(x_u) mod 2^bits`` as ``uint64`` (decode with
            ``config.decode(result, len(server.survivors))``).

        Raises:
            RoundAborted: If some secret has fewer than ``t`` shares (nothing is unmasked and
                no sum is ever produced).
            ProtocolError: If rebuilt secrets are inconsistent (a bad share).
        """
        self._expect_stage(4, "finish")
        assert self._sum is not None
        t = self.config.threshold
        short = {u: len(self._b_shares.get(u, ())) for u in self._u3}
        short.update({u: len(self._s_shares.get(u, ())) for u in self._dropped})
        short = {u: m for u, m in sorted(short.items()) if m < t}
        if short:
            detail = ", ".join(f"{u!r} ({m})" for u, m in short.items())
            raise self._abort(
                f"too few unmasking responses: shares of {detail}, t = {t} needed; round aborted"
            )
        total = self._sum
        seeds: list[tuple[bytes, bool]] = []  # every mask to remove, applied in one pass
        try:
            for u in sorted(self._u3):
                b = shamir_interpolate(sorted(self._b_shares[u])[:t])
                if b >= 1 << (8 * SECRET_BYTES):
                    raise ProtocolError(f"the shares of {u!r}'s self-mask seed are inconsistent")
                seeds.append((b.to_bytes(SECRET_BYTES, "big"), True))
            for u in sorted(self._dropped):
                s = shamir_interpolate(sorted(self._s_shares[u])[:t])
                if s >= 1 << (8 * SECRET_BYTES):
                    raise ProtocolError(f"the shares of {u!r}'s mask key are inconsistent")
                s_sk = X25519PrivateKey.from_private_bytes(s.to_bytes(SECRET_BYTES, "big"))
                if public_bytes(s_sk) != self._adverts[u].s_pk:
                    raise ProtocolError(f"the rebuilt mask key of {u!r} is not the advertised one")
                for v in sorted(self._graph[u] & self._u3):
                    shared = agree(s_sk, self._adverts[v].s_pk, v)
                    seed = kdf(b"mask-seed", shared, self.config.round_id, u, v)
                    # v added PRG(s_uv) if v < u, subtracted it if v > u: undo that
                    seeds.append((seed, v < u))
        except ProtocolError:
            self._abort("inconsistent shares")
            raise
        apply_keystreams(total, seeds)
        total = total.astype(np.uint64) & modulus_mask(self.config.modulus_bits)
        self._result, self._sum = total, None
        self._stage = 5
        return total.copy()
