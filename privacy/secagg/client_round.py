"""A client's side of one secure round over the wire: keys, shares, training, upload, unmasking."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fl_secure.errors import UpdateError
from fl_secure.messages import Tensors
from privacy.dp.discrete_gaussian import ddg_encode
from privacy.dp.noise import SecureGaussian
from privacy.secagg.client import SecAggClient
from privacy.secagg.consistency import ConsistencySignature
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
    client = SecAggClient(client_id, identity_key, setup.config(), registry, setup.vector_length)
    adverts = [
        AdvertiseKeys.from_bytes(b)
        for b in unpack(exchange(ADVERTISE, client.advertise_keys().to_bytes()), "adverts")
    ]
    shares = client.share_keys(adverts)
    incoming = [
        EncryptedShare.from_bytes(b)
        for b in unpack(exchange(SHARE, pack([s.to_bytes() for s in shares])), "shares")
    ]
    update = compute_update()
    # fixed point encodes chunk by chunk in float64: no float64 copy of the whole update here
    vector = flatten(update) if setup.encoding == "ddg" else concatenate(update)
    if vector.size != setup.vector_length:
        raise UpdateError(
            f"update has {vector.size} values, the round expects {setup.vector_length}"
        )
    encoded = None
    if setup.encoding == "ddg":  # integer noise: round, add N_Z(0, sigma^2), reduce mod 2^k
        norm = float(np.linalg.norm(vector))
        if not math.isfinite(norm):  # NaN would pass the clip below and wrap to garbage
            raise UpdateError("the update contains NaN or infinity; refusing to encode it")
        if norm > setup.clip_norm:  # the sensitivity bound D2 assumes ||x|| <= C
            vector = vector * (setup.clip_norm / norm)
        encoded = ddg_encode(
            SecureGaussian(),
            vector,
            gamma=1.0 / setup.scale,
            sigma=setup.ddg_sigma,
            modulus_bits=setup.modulus_bits,
        )
    masked = client.masked_input(incoming, vector, encoded=encoded)
    upload(masked.vector)
    request = UnmaskRequest.from_bytes(exchange(MASKED, b""))
    # the consistency check: sign U3, get the survivors' signatures; nothing revealed before
    signed = exchange(CONSISTENCY, client.sign_survivors(request).to_bytes())
    signatures = [ConsistencySignature.from_bytes(b) for b in unpack(signed, "signatures")]
    exchange(UNMASK, client.unmask(request, signatures).to_bytes())
