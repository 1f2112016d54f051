"""A running sum of encrypted updates (a decryptor's, or the server's check of each upload).

It adds ciphertexts and cannot decrypt them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import tenseal as ts

from fl_secure.errors import PrivacyError, ProtocolError
from fl_secure.messages import Tensors, TensorSpec
from privacy.ckks.context import Vector, context_slots, load_context
from privacy.ckks.layout import CkksLayout
from privacy.ckks.update import EncryptedUpdate


class CkksAggregator:
    """Server-side running sum of encrypted updates; needs only the public context.

    Each :meth:`add` deserializes an update's ciphertexts and adds them to the running
    encrypted sum (memory O(d): one sum, plus the update being added); plaintext layers are
    summed in float64. An update is either added completely or not at all.

    Args:
        public_ctx_bytes: From :func:`~privacy.ckks.context.public_context`. A context with
            the secret key is refused: the server must not be able to decrypt.
        specs: The shared parameters, in order.
        layers: Names of the layers the clients encrypt (all when None), as given to
            :func:`~privacy.ckks.encryption.encrypt_update`; an update encrypting a different
            set is refused.

    Raises:
        PrivacyError: If the context is not a public CKKS context or ``layers`` is invalid.
    """

    def __init__(
        self,
        public_ctx_bytes: bytes,
        specs: Sequence[TensorSpec],
        *,
        layers: Iterable[str] | None = None,
    ) -> None:
        self._ctx = load_context(public_ctx_bytes, what="the public context")
        if self._ctx.has_secret_key() or self._ctx.is_private():
            raise PrivacyError(
                "the aggregator was given a context with the secret key; the server must hold "
                "only public_context(...)"
            )
        self.layout = CkksLayout.plan(specs, layers, context_slots(self._ctx))
        self._scale = float(self._ctx.global_scale)
        self._top_level = self._ctx.seal_context().data.first_parms_id()
        self._sum: list[Vector] | None = None
        self._plain: Tensors = OrderedDict()
        self.total_weight = 0.0
        self.count = 0

    def check(self, update: EncryptedUpdate) -> None:
        """Check an update as :meth:`add` does, without adding it.

        Raises:
            ProtocolError: As :meth:`add`.
        """
        self._vectors(update)

    def add(self, update: EncryptedUpdate) -> None:
        """Add one (client's or partial) encrypted update to the running sum.

        Raises:
            ProtocolError: If its layout differs from the aggregation layout, a ciphertext
                cannot be parsed under the public context, holds the wrong number of values,
                is not a fresh top-level ciphertext at the global scale, or a plaintext layer
                is not finite.
        """
        vectors = self._vectors(update)
        if self._sum is None:
            new_sum = vectors
            new_plain = OrderedDict(
                (k, np.array(v, dtype=np.float64)) for k, v in update.plain.items()
            )
        else:
            new_sum = []
            for i, (total, vector) in enumerate(zip(self._sum, vectors, strict=True)):
                try:
                    new_sum.append(total + vector)
                except Exception as exc:
                    raise ProtocolError(f"ciphertext {i} cannot be added: {exc}") from exc
            new_plain = OrderedDict((k, v + update.plain[k]) for k, v in self._plain.items())
        self._sum, self._plain = new_sum, new_plain
        self.total_weight += update.weight
        self.count += update.count

    def result(self) -> EncryptedUpdate:
        """The encrypted sum so far (``weight`` = summed weights, ``count`` = updates).

        Raises:
            ProtocolError: If no update was added.
        """
        if self._sum is None:
            raise ProtocolError("no encrypted update to aggregate")
        return EncryptedUpdate(
            layout=self.layout,
            ciphertexts=tuple(bytes(v.serialize()) for v in self._sum),
            plain=OrderedDict((k, v.copy()) for k, v in self._plain.items()),
            weight=self.total_weight,
            count=self.count,
        )

    def _vectors(self, update: EncryptedUpdate) -> list[Vector]:
        problem = update.layout.mismatch(self.layout)
        if problem is not None:
            raise ProtocolError(f"encrypted update does not match the aggregation: {problem}")
        return [
            self._load(i, blob, size)
            for i, (blob, size) in enumerate(
                zip(update.ciphertexts, self.layout.chunk_sizes, strict=True)
            )
        ]

    def _load(self, index: int, blob: bytes, size: int) -> Vector:
        try:
            vector = ts.ckks_vector_from(self._ctx, blob)
            n_values = int(vector.size())
            ciphertexts = vector.data.ciphertext()
        except Exception as exc:
            raise ProtocolError(
                f"ciphertext {index} is not a CKKS vector under the aggregation context: {exc}"
            ) from exc
        if n_values != size:
            raise ProtocolError(f"ciphertext {index} holds {n_values} values, expected {size}")
        if len(ciphertexts) != 1:
            raise ProtocolError(
                f"ciphertext {index} spans {len(ciphertexts)} SEAL ciphertexts, expected 1"
            )
        ct = ciphertexts[0]
        if ct.size() != 2 or ct.is_transparent():
            raise ProtocolError(
                f"ciphertext {index} is not a well-formed fresh ciphertext (size {ct.size()})"
            )
        if ct.scale != self._scale:
            raise ProtocolError(
                f"ciphertext {index} has scale {ct.scale!r}, expected the global {self._scale!r}"
            )
        if ct.parms_id() != self._top_level:
            raise ProtocolError(
                f"ciphertext {index} is not at the top modulus level (it was rescaled or "
                "mod-switched); clients must send freshly encrypted values"
            )
        return vector
