"""A decryptor's own sum of the survivors' signed uploads: the only thing it will decrypt.

The server sends a chosen decryptor the survivors' signed uploads
(:mod:`privacy.ckks.signed`), not a sum of its own making. The decryptor checks every
signature against the CA-signed registry, that each is for this round (attempt), from a
member of its cohort and from a distinct client, that its own upload is among them unaltered,
and that at least ``max(server.min_clients, setup.min_count)`` distinct clients contributed;
then it adds the ciphertexts itself (TenSEAL's addition is deterministic, so both decryptors
get the same sum). Anything else is refused with an error naming the problem; the client then
withdraws from the round (``WITHDRAW_REASON_MESSAGE_REFUSED``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from fl_secure.errors import PrivacyError
from fl_secure.messages import TensorSpec
from privacy.ckks.aggregator import CkksAggregator
from privacy.ckks.round_setup import CkksSetup
from privacy.ckks.signed import SignedUpload, decode_bundle
from privacy.ckks.update import EncryptedUpdate

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


def verified_sum(
    bundle: bytes,
    *,
    setup: CkksSetup,
    public_ctx: bytes,
    specs: Sequence[TensorSpec],
    registry: Mapping[str, Ed25519PublicKey],
    own: SignedUpload,
    min_clients: int,
) -> EncryptedUpdate:
    """The encrypted sum of a bundle of signed uploads, after checking every one of them.

    Args:
        bundle: :func:`~privacy.ckks.signed.encode_bundle` bytes from the server.
        setup: This round's setup (round id, cohort, ``min_count``, encrypted layers).
        public_ctx: The CKKS context without the secret key (summing needs none).
        specs: The shared parameters (this client's own update's layers).
        registry: The CA-signed registry of the clients' Ed25519 public keys.
        own: What this client uploaded: it must be in the bundle, bit for bit.
        min_clients: The run config's ``server.min_clients``.

    Returns:
        The sum (``count`` = the distinct clients in it).

    Raises:
        PrivacyError: A signature, round, sender, duplicate or count check fails.
        ProtocolError: The bundle or an update in it is malformed.
    """
    uploads = decode_bundle(bundle, max_count=len(setup.cohort))
    aggregator = CkksAggregator(public_ctx, specs, layers=setup.layers)
    seen: set[str] = set()
    own_bytes = own.to_bytes()
    for i, raw in enumerate(uploads):
        signed = SignedUpload.from_bytes(raw)
        who = signed.client_id
        if signed.round_id != setup.round_id:
            raise PrivacyError(
                f"upload {i} ({who!r}) is signed for round id {signed.round_id.hex()}, not this "
                f"round's {setup.round_id.hex()}: another round's or attempt's ciphertext"
            )
        if who not in setup.cohort:
            raise PrivacyError(f"upload {i} comes from {who!r}, who is not in this round's cohort")
        if who in seen:
            raise PrivacyError(f"upload {i} is a second one from {who!r}: refusing duplicates")
        if who == own.client_id and raw != own_bytes:
            raise PrivacyError(f"upload {i} claims to be this client's own but differs from it")
        signed.verify(registry)
        update = EncryptedUpdate.from_bytes(signed.update)
        if update.count != 1 or update.weight != 1.0:
            raise PrivacyError(
                f"upload {i} ({who!r}) has count {update.count} and weight {update.weight:g}; "
                "a client's upload is one unweighted update"
            )
        aggregator.add(update)
        seen.add(who)
    required = max(min_clients, setup.min_count)
    if own.client_id not in seen:
        raise PrivacyError(
            "the uploads to decrypt do not include this client's own: refusing (a decryptor "
            "is chosen among the clients whose update is in the sum)"
        )
    if len(seen) < max(required, 2):
        raise PrivacyError(
            f"refusing to decrypt a sum of {len(seen)} distinct clients' updates, fewer than "
            f"{max(required, 2)} (server.min_clients {min_clients}, the round's minimum "
            f"{setup.min_count}, and never this client's own alone)"
        )
    return aggregator.result()
