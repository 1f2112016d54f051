"""A client's side of one SecAgg round (Bonawitz et al., CCS 2017, Figure 4, client steps).

Advertise two fresh X25519 keys (Round 0), share ``b_u`` and ``s_u^SK`` with the neighbours
(Round 1), send the masked input ``y_u`` (Round 2), sign the survivor set (Round 3,
:mod:`privacy.secagg.consistency`) and reveal the shares the server may have (Round 4); see
:mod:`privacy.secagg` for the protocol and its equations.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted, UpdateError
from privacy.secagg.arithmetic import CHUNK, check_vector, modulus_mask, word_dtype
from privacy.secagg.codec import KIND_SHARE_PLAINTEXT, NONCE_BYTES, Reader, Writer
from privacy.secagg.config import SecAggConfig
from privacy.secagg.consistency import (
    ConsistencySignature,
    advert_set_digest,
    check_signatures,
    check_survivor_set,
    statement,
)
from privacy.secagg.encoding import FixedPointEncoder, UniformSource
from privacy.secagg.graph import advert_seed
from privacy.secagg.keys import SECRET_BYTES, agree, kdf, public_bytes, share_ad, verify_advert
from privacy.secagg.masks import Keystreams
from privacy.secagg.messages import (
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    RevealedShare,
    UnmaskRequest,
    UnmaskResponse,
    advert_payload,
)
from privacy.secagg.shamir import FIELD_BYTES, shamir_split


class SecAggClient:
    """One client's side of one round (create a new one per round: all keys are fresh).

    Call :meth:`advertise_keys`, :meth:`share_keys`, :meth:`masked_input`,
    :meth:`sign_survivors`, :meth:`unmask` in this order, each with what the server relayed.
    Every incoming message is verified.

    Args:
        client_id: This client's id (in ``config.cohort``).
        identity_key: Its long-term Ed25519 identity key (enrolled in ``registry``).
        config: The round's configuration.
        registry: Enrolled Ed25519 identity public keys by client id.
        vector_length: ``d``, the length of the flattened update.
        rounding: Source of stochastic-rounding uniforms (tests inject a seeded one);
            a fresh :class:`~privacy.secagg.encoding.SecureUniform` if None.
    """

    def __init__(
        self,
        client_id: str,
        identity_key: Ed25519PrivateKey,
        config: SecAggConfig,
        registry: Mapping[str, Ed25519PublicKey],
        vector_length: int,
        *,
        rounding: UniformSource | None = None,
    ) -> None:
        if client_id not in config.cohort:
            raise PrivacyError(f"client {client_id!r} is not in the round's cohort")
        enrolled = registry.get(client_id)
        mine = identity_key.public_key().public_bytes_raw()
        if enrolled is None or enrolled.public_bytes_raw() != mine:
            raise PrivacyError(f"the identity key of {client_id!r} is not the enrolled one")
        if vector_length < 1:
            raise PrivacyError(f"vector_length = {vector_length}: expected >= 1")
        self.client_id = client_id
        self.config = config
        self.vector_length = vector_length
        self._identity = identity_key
        self._registry = registry
        self._rounding = rounding
        # the round's whole graph (unmasking checks survivors): computed in share_keys from
        # the advertisements, so the server, which picks the round id, cannot pick it
        self._graph: dict[str, frozenset[str]] = {}
        self._neighbours: frozenset[str] = frozenset()
        self._c_sk = X25519PrivateKey.generate()
        self._s_sk: X25519PrivateKey | None = X25519PrivateKey.generate()
        self._b: bytes | None = None
        self._advert: AdvertiseKeys | None = None
        self._peers: dict[str, AdvertiseKeys] = {}
        self._share_keys: dict[str, bytes] = {}  # peer -> AES-GCM key (see _share_key)
        self._held: dict[str, tuple[int, int, int]] = {}  # sender -> (x, y of b, y of s_sk)
        self._u1: frozenset[str] = frozenset()
        self._u1_digest = b""  # the advertisement set this client saw (consistency check)
        self._request: UnmaskRequest | None = None  # the survivor set it signed
        self._statement = b""
        self._stage = 0

    def _expect_stage(self, stage: int, what: str) -> None:
        if self._stage != stage:
            raise ProtocolError(f"{self.client_id!r}: {what} called out of order")

    def advertise_keys(self) -> AdvertiseKeys:
        """Round 0 (*AdvertiseKeys*): sign and return ``(c_u^PK, s_u^PK)``."""
        self._expect_stage(0, "advertise_keys")
        assert self._s_sk is not None
        c_pk, s_pk = public_bytes(self._c_sk), public_bytes(self._s_sk)
        payload = advert_payload(self.client_id, self.config.round_id, c_pk, s_pk)
        self._advert = AdvertiseKeys(
            self.client_id, self.config.round_id, c_pk, s_pk, self._identity.sign(payload)
        )
        self._stage = 1
        return self._advert

    def share_keys(self, adverts: Sequence[AdvertiseKeys]) -> tuple[EncryptedShare, ...]:
        """Round 1 (*ShareKeys*): verify adverts, derive the graph, send neighbours shares.

        The graph is seeded by :func:`~privacy.secagg.graph.advert_seed` of the adverts
        received, this client's own (unaltered) included: keys drawn after the round id was
        fixed, so a server choosing round ids cannot choose anyone's neighbours.

        Draws the self-mask seed ``b_u`` and splits it and ``s_u^SK`` ``t``-out-of-``k'``
        among the ``k'`` neighbours that advertised keys; each neighbour's pair of shares is
        encrypted under the key agreed from ``c_u^SK`` and its ``c_v^PK``.

        Args:
            adverts: The advertisements relayed by the server: every client that advertised.

        Returns:
            One encrypted share per neighbour that advertised keys.

        Raises:
            PrivacyError: If a signature does not verify (naming the client) or the server
                altered this client's own advertisement.
            ProtocolError: If an advertisement is malformed, repeated or for another round.
            RoundAborted: If fewer than ``t`` neighbours advertised keys.
        """
        self._expect_stage(1, "share_keys")
        assert self._advert is not None and self._s_sk is not None
        seen: dict[str, AdvertiseKeys] = {}
        keys: set[bytes] = set()
        for advert in adverts:
            verify_advert(advert, self.config, self._registry)
            who = advert.client_id
            if who in seen:
                raise ProtocolError(f"client {who!r} advertised keys twice")
            seen[who] = advert
            if who == self.client_id:
                if advert != self._advert:
                    raise PrivacyError(f"the server altered the advertisement of {who!r}")
                continue
            if {advert.c_pk, advert.s_pk} & (keys | {self._advert.c_pk, self._advert.s_pk}):
                raise ProtocolError(f"client {who!r} advertised a public key already in use")
            keys |= {advert.c_pk, advert.s_pk}
        if self.client_id not in seen:
            raise PrivacyError(
                f"the server left out the advertisement of {self.client_id!r} (this client): "
                "the graph must be seeded by it"
            )
        self._u1, self._u1_digest = (
            frozenset(seen),
            advert_set_digest(seen.values(), self.config.cohort),
        )
        self._graph = self.config.graph(advert_seed(a.signed_payload() for a in seen.values()))
        self._neighbours = self._graph[self.client_id]
        self._peers = {v: seen[v] for v in sorted(self._neighbours & set(seen))}
        t = self.config.threshold
        if len(self._peers) < t:
            raise RoundAborted(
                f"{self.client_id!r}: only {len(self._peers)} neighbours advertised keys, "
                f"fewer than the threshold t = {t}"
            )
        if len(seen) < self.config.min_adverts:
            raise PrivacyError(
                f"{self.client_id!r} refuses an advertisement set of {len(seen)} clients: the "
                f"round needs at least {self.config.min_adverts} (threshold, fewest inputs and "
                "consistency check)"
            )
        peers = sorted(self._peers)
        xs = [self.config.share_x(v) for v in peers]
        self._b = secrets.token_bytes(SECRET_BYTES)
        b_ys = shamir_split(int.from_bytes(self._b, "big"), xs, t)
        s_ys = shamir_split(int.from_bytes(self._s_sk.private_bytes_raw(), "big"), xs, t)
        out = []
        for v, x, b_y, s_y in zip(peers, xs, b_ys, s_ys, strict=True):
            key = self._share_key(v)
            plaintext = (
                Writer(KIND_SHARE_PLAINTEXT)
                .text(self.client_id)
                .text(v)
                .u32(x)
                .raw(b_y.to_bytes(FIELD_BYTES, "big"))
                .raw(s_y.to_bytes(FIELD_BYTES, "big"))
                .done()
            )
            nonce = os.urandom(NONCE_BYTES)
            ad = share_ad(self.config.round_id, self.client_id, v)
            ct = AESGCM(key).encrypt(nonce, plaintext, ad)
            out.append(EncryptedShare(self.client_id, v, self.config.round_id, nonce, ct))
        self._stage = 2
        return tuple(out)

    def _share_key(self, peer: str) -> bytes:
        """The AES-GCM key of the pair's shares, one per pair for both directions.

        :func:`kdf` orders the two ids, so the key that sealed this client's shares for
        ``peer`` also opens ``peer``'s shares for it (each direction has its own associated
        data and random nonces); it is derived once per round.
        """
        key = self._share_keys.get(peer)
        if key is None:
            shared = agree(self._c_sk, self._peers[peer].c_pk, peer)
            key = kdf(b"share-key", shared, self.config.round_id, self.client_id, peer)
            self._share_keys[peer] = key
        return key

    def _open_share(self, share: EncryptedShare) -> tuple[int, int, int]:
        sender = share.sender
        if share.round_id != self.config.round_id:
            raise ProtocolError(f"share from {sender!r} is for another round")
        if share.receiver != self.client_id:
            raise ProtocolError(f"share from {sender!r} is addressed to {share.receiver!r}")
        if sender not in self._peers:
            raise ProtocolError(f"share from {sender!r}, which is not a neighbour with keys")
        key = self._share_key(sender)
        ad = share_ad(self.config.round_id, sender, self.client_id)
        try:
            plaintext = AESGCM(key).decrypt(share.nonce, share.ciphertext, ad)
        except (InvalidTag, ValueError) as exc:
            raise PrivacyError(
                f"the encrypted share from {sender!r} fails authentication (tampered, "
                "re-addressed or not encrypted for this client)"
            ) from exc
        r = Reader(plaintext, KIND_SHARE_PLAINTEXT, f"share from {sender!r}")
        inner_sender, inner_receiver, x = r.text("sender"), r.text("receiver"), r.u32()
        b_y, s_y = r.element("share of b"), r.element("share of s_sk")
        r.end()
        expected = (sender, self.client_id, self.config.share_x(self.client_id))
        if (inner_sender, inner_receiver, x) != expected:
            raise ProtocolError(f"share from {sender!r} names the wrong parties or abscissa")
        return x, b_y, s_y

    def masked_input(
        self,
        shares: Sequence[EncryptedShare],
        update: np.ndarray,
        *,
        encoded: np.ndarray | None = None,
    ) -> MaskedInput:
        """Round 2 (*MaskedInputCollection*): store the shares received, send ``y_u``.

        ``y_u = encode(x_u) + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)``
        mod ``2^bits``, over the neighbours ``v`` whose shares arrived (the server routed the
        shares of exactly ``U2``, so both ends of every pair agree on who masks with whom).

        Args:
            shares: The encrypted shares the server routed to this client.
            update: The float update (``vector_length`` values, any shape).
            encoded: The update already encoded as integers mod ``2^bits`` (for example by
                the distributed discrete Gaussian); replaces the fixed-point encoding.

        Returns:
            The masked input.

        Raises:
            PrivacyError: If a share fails authentication (naming its sender) or the update
                is not finite.
            ProtocolError: If a share is malformed, repeated or from a non-neighbour.
            RoundAborted: If fewer than ``t`` neighbours' shares arrived.
        """
        self._expect_stage(2, "masked_input")
        assert self._b is not None and self._s_sk is not None
        update = np.asarray(update)
        if update.size != self.vector_length:
            raise UpdateError(f"update has {update.size} values, expected {self.vector_length}")
        for share in shares:
            if share.sender in self._held:
                raise ProtocolError(f"two shares from {share.sender!r}")
            self._held[share.sender] = self._open_share(share)
        t = self.config.threshold
        if len(self._held) < t:
            raise RoundAborted(
                f"{self.client_id!r}: only {len(self._held)} neighbours shared keys, fewer "
                f"than the threshold t = {t}"
            )
        cfg, bits = self.config, self.config.modulus_bits
        seeds = [(self._b, False)]
        for v in sorted(self._held):
            shared = agree(self._s_sk, self._peers[v].s_pk, v)
            seed = kdf(b"mask-seed", shared, cfg.round_id, self.client_id, v)
            seeds.append((seed, v < self.client_id))
        masks = Keystreams(seeds, word_dtype(bits))
        if encoded is None:  # encode a chunk, mask it, next chunk (it stays in cache)
            encoder = FixedPointEncoder(cfg.clip_range, cfg.scale, bits, self._rounding)
            x = update.ravel()
            acc = np.empty(self.vector_length, dtype=word_dtype(bits))
            for start in range(0, acc.size, CHUNK):
                part = acc[start : start + CHUNK]
                encoder.encode_into(x[start : start + CHUNK], part)
                masks.apply(part)
        else:
            acc = check_vector(
                np.array(encoded, dtype=np.uint64), bits, self.vector_length, "encoded update"
            ).astype(word_dtype(bits))
            masks.apply_all(acc)
        acc &= acc.dtype.type(modulus_mask(bits))
        self._b, self._s_sk = None, None  # no longer needed by this client
        self._share_keys.clear()
        self._stage = 3
        return MaskedInput(self.client_id, self.config.round_id, self.config.modulus_bits, acc)

    def sign_survivors(self, request: UnmaskRequest) -> ConsistencySignature:
        """Round 3 (*ConsistencyCheck*): check the survivor set ``U3``, sign it (once a round).

        The signature binds the round id, the digest of the advertisement set this client
        received (``U1``) and the sorted ``U3`` (:mod:`privacy.secagg.consistency`). Every check
        on what the unmasking would reveal is made here, before anything is signed.

        Args:
            request: The server's request (``U3`` and the clients it counts as dropped).

        Returns:
            This client's signature on ``(round id, U1 digest, U3)``.

        Raises:
            PrivacyError: If the request would reveal both shares of a client, counts this
                client as dropped, lists fewer than the fewest inputs, or splits the survivors.
            ProtocolError: If the request is malformed, out of order, or names a client
                that did not advertise keys.
            RoundAborted: If fewer than ``t`` survivors are listed.
        """
        self._expect_stage(3, "sign_survivors")
        check_survivor_set(request, self.config, self.client_id, self._u1, self._graph)
        survivors = frozenset(request.survivors)
        self._request = request
        self._statement = statement(self.config.round_id, self._u1_digest, survivors)
        self._stage = 4
        return ConsistencySignature(
            self.client_id, self.config.round_id, self._identity.sign(self._statement)
        )

    def unmask(
        self, request: UnmaskRequest, signatures: Sequence[ConsistencySignature]
    ) -> UnmaskResponse:
        """Round 4 (*Unmasking*): once ``U3`` is consistent, reveal ``b_v`` or ``s_v^SK`` shares.

        Reveals nothing unless ``request`` is the one this client signed and ``signatures``
        holds valid signatures on the same statement from at least
        ``config.consistency_threshold`` distinct survivors. Then it reveals shares of ``b_v``
        exactly for its neighbours in ``U3`` and of ``s_v^SK`` only for its neighbours
        outside ``U3`` (never both for one client); it answers once.

        Args:
            request: The server's request (the one signed in :meth:`sign_survivors`).
            signatures: The consistency signatures the server relayed.

        Returns:
            The shares this client holds for the requested clients.

        Raises:
            PrivacyError: If the request differs from the signed one, or the consistency
                check fails (:class:`~privacy.secagg.consistency.ConsistencyFailed`).
            ProtocolError: If a signature is malformed or repeated, or out of order.
        """
        if self._stage != 4:
            raise ProtocolError(
                f"{self.client_id!r}: unmask called out of order (it answers one request, "
                "after signing its survivor set)"
            )
        if request != self._request:
            raise PrivacyError(
                f"{self.client_id!r} refuses an unmask request that differs from the survivor "
                "set it signed"
            )
        survivors = frozenset(request.survivors)
        check_signatures(
            signatures, self._statement, round_id=self.config.round_id, survivors=survivors,
            registry=self._registry, needed=self.config.consistency_threshold,
            who=self.client_id,
        )  # fmt: skip
        b_out, s_out = [], []
        for owner in sorted(self._held):
            x, b_y, s_y = self._held[owner]
            if owner in survivors:
                b_out.append(RevealedShare(owner, x, b_y))
            else:  # a neighbour that shared its keys but is not in the signed U3
                s_out.append(RevealedShare(owner, x, s_y))
        self._stage = 5
        return UnmaskResponse(self.client_id, self.config.round_id, tuple(b_out), tuple(s_out))
