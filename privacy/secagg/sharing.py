"""What one process running a whole cohort's round may compute once for every member.

Every member of a round verifies every signature, checks every advertised key and derives the
same graph, pure functions of public data: a simulation that runs the cohort in one process
(:mod:`privacy.secagg.in_process`) verifies each distinct signature once
(:class:`SharedVerificationKey` in the cohort's registry) and computes the rest once inside
:func:`cohort_in_one_process`.
Outside it (a real client, the server, the benchmarks against Flower) nothing is remembered,
so each party's compute is its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

_SHARED: ContextVar[bool] = ContextVar("privacy_secagg_shared", default=False)


def shared() -> bool:
    """Whether the running code is a whole cohort in one process (:func:`cohort_in_one_process`)."""
    return _SHARED.get()


@contextlib.contextmanager
def cohort_in_one_process() -> Iterator[None]:
    """Within it, the members' identical checks and derivations are computed once."""
    token = _SHARED.set(True)
    try:
        yield
    finally:
        _SHARED.reset(token)


class SharedVerificationKey(Ed25519PublicKey):
    """An enrolled identity key whose successful verifications a simulated cohort shares.

    In a cohort of ``n`` every client verifies every advertisement and every consistency
    signature: ``2 n^2`` Ed25519 verifications a round, the bulk of an in-process round's time
    (measured at ``n = 100``). Verification is deterministic, so a ``(signature, message)``
    pair that verified once under this key verifies again: the clients still check every
    signature they receive (an altered one is a new pair and is verified, and refused), but
    the cohort, sharing one process, verifies each distinct pair once. Failures are not
    remembered.
    """

    def __init__(self, key: Ed25519PublicKey) -> None:
        self._key = key
        self._verified: set[tuple[bytes, bytes]] = set()

    def verify(
        self, signature: bytes | bytearray | memoryview, data: bytes | bytearray | memoryview
    ) -> None:
        """``key.verify``; raises ``InvalidSignature`` unless the pair verifies (or did)."""
        pair = (bytes(signature), bytes(data))
        if pair not in self._verified:
            self._key.verify(signature, data)
            self._verified.add(pair)

    def public_bytes(
        self, encoding: serialization.Encoding, format: serialization.PublicFormat
    ) -> bytes:
        """The wrapped key's encoding."""
        return self._key.public_bytes(encoding, format)

    def public_bytes_raw(self) -> bytes:
        """The wrapped key's 32 raw bytes."""
        return self._key.public_bytes_raw()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SharedVerificationKey):
            other = other._key
        return bool(self._key == other)

    def __hash__(self) -> int:
        return hash(self.public_bytes_raw())

    def __copy__(self) -> SharedVerificationKey:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> SharedVerificationKey:
        return self
