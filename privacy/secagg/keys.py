"""Keys of a SecAgg round: X25519 agreements, HKDF derivation, signed advertisements.

X25519 key agreement and HKDF-SHA256 (context binding the round id and both client ids in
canonical order) give 32-byte keys: one AES-256-GCM key per pair for the shares, one mask
seed ``s_uv`` per pair. Key advertisements are signed with each client's long-term Ed25519
identity key and checked against the enrolled registry (:func:`verify_advert`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fl_secure.errors import PrivacyError, ProtocolError
from privacy.secagg.codec import DOMAIN, length_prefixed
from privacy.secagg.config import SecAggConfig
from privacy.secagg.messages import AdvertiseKeys
from privacy.secagg.sharing import shared

SECRET_BYTES = 32  # seeds and X25519 private keys


def kdf(label: bytes, shared: bytes, round_id: bytes, a: str, b: str) -> bytes:
    """HKDF-SHA256 of a key agreement, bound to the round and the two ids in canonical order."""
    lo, hi = sorted((a, b))
    info = DOMAIN + label + length_prefixed(round_id, lo.encode("utf-8"), hi.encode("utf-8"))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def agree(private: X25519PrivateKey, public: bytes, peer: str) -> bytes:
    """The X25519 shared secret with ``peer``'s advertised key (refused for a low-order one)."""
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:  # low-order point: the shared secret would be all zeros
        raise PrivacyError(f"client {peer!r} advertised an invalid X25519 public key") from exc


def share_ad(round_id: bytes, sender: str, receiver: str) -> bytes:
    """AES-GCM associated data of a share: binds the round, the sender and the receiver."""
    return (
        DOMAIN
        + b"share"
        + length_prefixed(round_id, sender.encode("utf-8"), receiver.encode("utf-8"))
    )


def public_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32-byte public key of ``key``."""
    return key.public_key().public_bytes_raw()


#: The scalar of the low-order check in :func:`verify_advert`. Every X25519 scalar is
#: clamped to a multiple of 8, which sends a point of order dividing 8 to the identity (the
#: all-zero output ``exchange`` refuses) whatever the scalar, and a point with a large-order
#: part elsewhere unless the scalar is a multiple of that order (probability ~2^-252 for a
#: random key): so one key drawn per process gives every check the verdict a fresh key would,
#: without a key generation per advertised key (two per client and round, on every client
#: and the server). Its agreements are thrown away.
_LOW_ORDER_PROBE = X25519PrivateKey.generate()


def verify_advert(
    advert: AdvertiseKeys, config: SecAggConfig, registry: Mapping[str, Ed25519PublicKey]
) -> None:
    """Check an advertisement's round, sender, key sizes and Ed25519 signature."""
    if not isinstance(advert, AdvertiseKeys):
        raise ProtocolError(f"expected AdvertiseKeys, got {type(advert).__name__}")
    who = advert.client_id
    if advert.round_id != config.round_id:
        raise ProtocolError(f"advertisement of {who!r} is for another round")
    if who not in config.cohort:
        raise ProtocolError(f"advertisement of {who!r}, which is not in the cohort")
    if len(advert.c_pk) != 32 or len(advert.s_pk) != 32 or advert.c_pk == advert.s_pk:
        raise ProtocolError(f"advertisement of {who!r} has malformed or equal public keys")
    identity = registry.get(who)
    if identity is None:
        raise PrivacyError(f"client {who!r} has no enrolled identity key; cannot verify its keys")
    try:
        identity.verify(advert.signature, advert.signed_payload())
    except InvalidSignature as exc:
        raise PrivacyError(
            f"the key advertisement of client {who!r} is not signed by its enrolled identity "
            "key: substituted or unsigned public keys; refusing to use them"
        ) from exc
    for name, key in (("c_pk", advert.c_pk), ("s_pk", advert.s_pk)):
        if not usable_x25519(key):  # a low-order point: every agreement with it fails
            raise ProtocolError(
                f"advertisement of {who!r}: {name} is not a usable X25519 public key (a "
                "low-order point); the client is left out of the round"
            )


def usable_x25519(key: bytes) -> bool:
    """Whether ``key`` is an X25519 public key of large order (see :data:`_LOW_ORDER_PROBE`).

    Every member of a round checks every advertisement: a process that runs a whole cohort
    (:func:`~privacy.secagg.sharing.cohort_in_one_process`) checks each key once.
    """
    return _remembered_usable(key) if shared() else _usable(key)


@functools.lru_cache(maxsize=1 << 16)
def _remembered_usable(key: bytes) -> bool:
    return _usable(key)


def _usable(key: bytes) -> bool:
    try:
        _LOW_ORDER_PROBE.exchange(X25519PublicKey.from_public_bytes(key))
    except ValueError:
        return False
    return True
