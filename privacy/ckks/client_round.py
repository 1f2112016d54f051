"""A client's side of one CKKS round: train, encrypt, upload; decrypt the sum if chosen."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fl_secure.errors import PrivacyError
from fl_secure.messages import Tensors
from privacy.ckks.encryption import decrypt_sum, encrypt_update
from privacy.ckks.round_setup import CkksSetup
from privacy.ckks.update import EncryptedUpdate
from privacy.secagg.stages import MASKED, UNMASK, Exchange
from privacy.secagg.vectors import flatten


def client_ckks_update(
    setup: CkksSetup,
    secret_ctx: bytes,
    exchange: Exchange,
    compute_update: Callable[[], Tensors],
    upload: Callable[[np.ndarray], None],
) -> None:
    """A client's CKKS round: train, encrypt, upload; decrypt the sum if chosen."""
    update = compute_update()
    encrypted = encrypt_update(update, secret_ctx, layers=setup.layers)
    upload(np.frombuffer(encrypted.to_bytes(), dtype=np.uint8))
    request = exchange(MASKED, b"")
    if not request:
        return  # another client decrypts this round's sum
    total = EncryptedUpdate.from_bytes(request)
    if total.count < setup.min_count:
        raise PrivacyError(
            f"refusing to decrypt a sum of {total.count} updates, fewer than {setup.min_count}"
        )
    plain = decrypt_sum(total, secret_ctx, specs=encrypted.layout.specs)
    exchange(UNMASK, flatten(plain).astype("<f8").tobytes())
