"""A client's side of one secure round over the wire: keys, shares, training, upload, unmasking.

:class:`SecureRoundMember` is the client's protocol one stage at a time, on the payloads the
wire carries (it parses what the server relays and packs what it sends);
:func:`client_secure_update` runs it over a gRPC exchange, and
:mod:`privacy.secagg.in_process` runs a whole simulated cohort of them in one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fl_secure.errors import ProtocolError, UpdateError
from fl_secure.messages import Tensors
from privacy.dp.discrete_gaussian import ddg_encode
from privacy.dp.noise import SecureGaussian
from privacy.secagg.client import SecAggClient
from privacy.secagg.consistency import ConsistencySignature
from privacy.secagg.encoding import UniformSource
from privacy.secagg.messages import AdvertiseKeys, EncryptedShare, UnmaskRequest
from privacy.secagg.round_setup import RoundSetup
from privacy.secagg.stages import (
    ADVERTISE,
    CONSISTENCY,
    MASKED,
    SHARE,
    UNMASK,
    Exchange,
    pack,
    unpack,
)
from privacy.secagg.vectors import concatenate, flatten


def ddg_encoded(setup: RoundSetup, vector: np.ndarray) -> np.ndarray:
    """The distributed discrete Gaussian's integer vector of a flat float update.

    Clipped to L2 norm ``setup.clip_norm`` (the sensitivity bound assumes it), rounded, with
    this client's ``N_Z(0, sigma^2)`` added (CSPRNG), reduced mod ``2^bits``.

    Raises:
        UpdateError: The update holds NaN or infinity.
    """
    norm = float(np.linalg.norm(vector))
    if not math.isfinite(norm):  # NaN would pass the clip below and wrap to garbage
        raise UpdateError("the update contains NaN or infinity; refusing to encode it")
    if norm > setup.clip_norm:  # the sensitivity bound D2 assumes ||x|| <= C
        vector = vector * (setup.clip_norm / norm)
    return ddg_encode(
        SecureGaussian(),
        vector,
        gamma=1.0 / setup.scale,
        sigma=setup.ddg_sigma,
        modulus_bits=setup.modulus_bits,
    )


class SecureRoundMember:
    """One client's side of a secure round, one stage per call, in wire payloads.

    Call :meth:`advertise`, :meth:`share`, :meth:`receive_shares`, :meth:`mask` (or
    :meth:`mask_encoded`), :meth:`sign` and :meth:`unmask` in this order, each with the
    server's reply to the stage before. Every check is :class:`SecAggClient`'s.

    Args:
        setup: The round's setup (checked by the caller against its run config).
        client_id: This client's id.
        identity_key: Its Ed25519 identity key (enrolled in ``registry``).
        registry: Enrolled identity public keys by client id.
        rounding: Stochastic-rounding uniforms of the fixed-point encoding (tests seed them);
            a CSPRNG when None.
    """

    def __init__(
        self,
        setup: RoundSetup,
        client_id: str,
        identity_key: Ed25519PrivateKey,
        registry: Mapping[str, Ed25519PublicKey],
        *,
        rounding: UniformSource | None = None,
    ) -> None:
        self.setup = setup
        self.client = SecAggClient(
            client_id, identity_key, setup.config(), registry, setup.vector_length,
            rounding=rounding,
        )  # fmt: skip
        self._incoming: list[EncryptedShare] | None = None
        self._request: UnmaskRequest | None = None

    def advertise(self) -> bytes:
        """The signed key advertisement (the ADVERTISE payload)."""
        return self.client.advertise_keys().to_bytes()

    def share(self, adverts: bytes) -> bytes:
        """The encrypted shares for the neighbours (SHARE payload), from the relayed adverts."""
        parsed = [AdvertiseKeys.from_bytes(b) for b in unpack(adverts, "adverts")]
        return pack([s.to_bytes() for s in self.client.share_keys(parsed)])

    def receive_shares(self, shares: bytes) -> None:
        """Parse the shares the server routed to this client (before local training)."""
        self._incoming = [EncryptedShare.from_bytes(b) for b in unpack(shares, "shares")]

    def mask(self, update: Tensors) -> np.ndarray:
        """The masked input of the float ``update`` (encoded as the setup says)."""
        setup = self.setup
        # fixed point encodes chunk by chunk in float64: no float64 copy of the whole update
        vector = flatten(update) if setup.encoding == "ddg" else concatenate(update)
        if vector.size != setup.vector_length:
            raise UpdateError(
                f"update has {vector.size} values, the round expects {setup.vector_length}"
            )
        encoded = ddg_encoded(setup, vector) if setup.encoding == "ddg" else None
        return self._masked(vector, encoded)

    def mask_encoded(self, encoded: np.ndarray) -> np.ndarray:
        """The masked input of an update already encoded mod ``2^bits`` (checked as one)."""
        return self._masked(encoded, np.asarray(encoded))

    def _masked(self, vector: np.ndarray, encoded: np.ndarray | None) -> np.ndarray:
        if self._incoming is None:
            raise ProtocolError(f"{self.client.client_id!r}: masked before receiving its shares")
        return self.client.masked_input(self._incoming, vector, encoded=encoded).vector

    def sign(self, request: bytes) -> bytes:
        """This client's signature on the survivor set (CONSISTENCY payload), after its checks."""
        self._request = UnmaskRequest.from_bytes(request)
        return self.client.sign_survivors(self._request).to_bytes()

    def unmask(self, signatures: bytes) -> bytes:
        """The shares it reveals (UNMASK payload), once enough survivors signed the same set."""
        if self._request is None:
            raise ProtocolError(f"{self.client.client_id!r}: unmask before signing")
        parsed = [ConsistencySignature.from_bytes(b) for b in unpack(signatures, "signatures")]
        return self.client.unmask(self._request, parsed).to_bytes()


def client_secure_update(
    setup: RoundSetup,
    client_id: str,
    identity_key: Ed25519PrivateKey,
    registry: Mapping[str, Ed25519PublicKey],
    exchange: Exchange,
    compute_update: Callable[[], Tensors],
    upload: Callable[[np.ndarray], None],
) -> None:
    """A client's whole secure round: keys, shares, training, masked upload, consistency, unmasking.

    Keys are exchanged before training, so a client that drops while training is recovered
    by its neighbours' shares.
    """
    member = SecureRoundMember(setup, client_id, identity_key, registry)
    adverts = exchange(ADVERTISE, member.advertise())
    member.receive_shares(exchange(SHARE, member.share(adverts)))
    upload(member.mask(compute_update()))
    # the consistency check: sign U3, get the survivors' signatures; nothing revealed before
    signatures = exchange(CONSISTENCY, member.sign(exchange(MASKED, b"")))
    exchange(UNMASK, member.unmask(signatures))
