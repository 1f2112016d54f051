"""A client's side of one CKKS round: train, encrypt, sign, upload; decrypt if chosen.

A chosen decryptor decrypts only a sum it made itself from the survivors' signed uploads
(:func:`~privacy.ckks.verified_sum.verified_sum`), and floods the decryption with Gaussian
noise that hides the CKKS decryption error (:mod:`privacy.ckks.flooding`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fl_secure.messages import Tensors
from privacy.ckks.context import load_context, public_context
from privacy.ckks.encryption import decrypt_sum, encrypt_update
from privacy.ckks.flooding import DEFAULT_FLOODING_BITS, flooding_std
from privacy.ckks.round_setup import CkksSetup
from privacy.ckks.signed import SignedUpload
from privacy.ckks.verified_sum import verified_sum
from privacy.secagg.stages import MASKED, UNMASK, Exchange
from privacy.secagg.vectors import flatten

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )


@dataclass(frozen=True)
class CkksMember:
    """Who this client is in a CKKS round, and what it demands before it decrypts.

    Attributes:
        client_id: Its id (its certificate's).
        identity: Its long-term Ed25519 signing key (signs its upload).
        registry: The CA-signed registry of the clients' signing keys.
        min_clients: The run config's ``server.min_clients``: fewer distinct clients' updates
            are never decrypted.
        flooding_bits: ``secure_aggregation.ckks_flooding_bits``.
    """

    client_id: str
    identity: Ed25519PrivateKey
    registry: Mapping[str, Ed25519PublicKey]
    min_clients: int
    flooding_bits: int = DEFAULT_FLOODING_BITS


def client_ckks_update(
    setup: CkksSetup,
    secret_ctx: bytes,
    member: CkksMember,
    exchange: Exchange,
    compute_update: Callable[[], Tensors],
    upload: Callable[[np.ndarray], None],
) -> None:
    """A client's CKKS round: train, encrypt, sign, upload; decrypt the sum if chosen.

    Raises:
        PrivacyError: The server's request to decrypt fails a check of
            :func:`~privacy.ckks.verified_sum.verified_sum` (nothing is decrypted).
        ProtocolError: The request is malformed.
    """
    update = compute_update()
    encrypted = encrypt_update(update, secret_ctx, layers=setup.layers)
    signed = SignedUpload.sign(
        member.identity, member.client_id, setup.round_id, encrypted.to_bytes()
    )
    upload(np.frombuffer(signed.to_bytes(), dtype=np.uint8))
    request = exchange(MASKED, b"")
    if not request:
        return  # another client decrypts this round's sum
    specs = encrypted.layout.specs
    total = verified_sum(
        request,
        setup=setup,
        public_ctx=public_context(secret_ctx),
        specs=specs,
        registry=member.registry,
        own=signed,
        min_clients=member.min_clients,
    )
    std = flooding_std(
        load_context(secret_ctx, what="the secret context"),
        summed=total.count,
        ciphertexts=total.layout.num_ciphertexts,
        bits=member.flooding_bits,
    )
    plain = decrypt_sum(total, secret_ctx, specs=specs, flooding_std=std)
    exchange(UNMASK, flatten(plain).astype("<f8").tobytes())
