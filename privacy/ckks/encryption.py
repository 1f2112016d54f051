"""A client encrypts its update and decrypts the aggregate (symmetric-key CKKS, TenSEAL)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import tenseal as ts

from fl_secure.errors import PrivacyError, ProtocolError, UpdateError
from fl_secure.messages import Tensors, TensorSpec
from privacy.ckks.context import context_slots, load_context
from privacy.ckks.layout import CkksLayout
from privacy.ckks.update import EncryptedUpdate
from privacy.dp.noise import NoiseSource, SecureGaussian, gaussian_like


def encrypt_update(
    tensors: Mapping[str, np.ndarray],
    secret_ctx_bytes: bytes,
    *,
    layers: Iterable[str] | None = None,
    weight: float = 1.0,
) -> EncryptedUpdate:
    """Encrypt a client's update, optionally multiplied by ``weight`` first.

    Args:
        tensors: The update (name to array, in the order of the shared parameters).
        secret_ctx_bytes: The clients' context from
            :func:`~privacy.ckks.context.make_secret_context`.
        layers: Names of the layers to encrypt (all when None); the others are sent as
            float64 plaintext.
        weight: Multiplies every value before encryption (e.g. the number of examples) so
            the server computes a weighted sum; the clients divide by the summed weight.

    Returns:
        The encrypted update.

    Raises:
        PrivacyError: If the context has no secret key, a layer is not finite, ``layers``
            is invalid, or a value is too large for the scale.
    """
    if isinstance(weight, bool) or not (math.isfinite(weight) and weight > 0):
        raise PrivacyError(f"weight must be a positive finite number, got {weight!r}")
    ctx = load_context(secret_ctx_bytes, what="the secret context")
    if not ctx.has_secret_key():
        raise PrivacyError(
            "encrypting needs the clients' secret context (symmetric CKKS); got a context "
            "without a secret key"
        )
    arrays = OrderedDict((name, np.asarray(value)) for name, value in tensors.items())
    layout = CkksLayout.plan(
        [TensorSpec.of(name, a) for name, a in arrays.items()], layers, context_slots(ctx)
    )
    for name, a in arrays.items():
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            raise UpdateError(f"layer {name!r} contains NaN or infinity; refusing to encrypt it")
    flat = np.empty(layout.encrypted_size, dtype=np.float64)
    plain: Tensors = OrderedDict()
    for layer in layout.layers:
        values = arrays[layer.name].astype(np.float64) * weight
        if layer.encrypted:
            start = layout.offsets[layer.name]
            flat[start : start + layer.size] = values.ravel()
        else:
            plain[layer.name] = values
    ciphertexts = []
    start = 0
    for i, size in enumerate(layout.chunk_sizes):
        try:
            vector = ts.ckks_vector(ctx, flat[start : start + size])
        except Exception as exc:
            raise PrivacyError(
                f"cannot encrypt chunk {i} (values {start}..{start + size - 1}): {exc}; values "
                f"up to {np.abs(flat[start : start + size]).max():.3g} in magnitude (after the "
                "weight) may exceed what the scale and coefficient modulus allow"
            ) from exc
        ciphertexts.append(bytes(vector.serialize()))
        start += size
    return EncryptedUpdate(
        layout=layout, ciphertexts=tuple(ciphertexts), plain=plain, weight=float(weight)
    )


def decrypt_sum(
    encrypted: EncryptedUpdate,
    secret_ctx_bytes: bytes,
    divide_by: float = 1.0,
    *,
    specs: Sequence[TensorSpec] | None = None,
    flooding_std: float = 0.0,
    noise: NoiseSource | None = None,
) -> Tensors:
    """Decrypt an (aggregated) encrypted update on a client.

    Args:
        encrypted: Usually :meth:`~privacy.ckks.aggregator.CkksAggregator.result`.
        secret_ctx_bytes: The clients' context with the secret key.
        divide_by: Divides every value (``encrypted.weight`` for a weighted mean, the cohort
            size for a plain mean).
        specs: When given, the layout must have exactly these layers, dtypes and shapes.
        flooding_std: Standard deviation of the Gaussian noise added to every decrypted
            value before it is divided and cast (:func:`~privacy.ckks.flooding.flooding_std`:
            it hides the decryption error); 0 adds none.
        noise: Where that noise comes from (a fresh
            :class:`~privacy.dp.noise.SecureGaussian` when None).

    Returns:
        The tensors, reshaped and cast to each layer's dtype.

    Raises:
        PrivacyError: If the context has no secret key, ``divide_by`` is not positive or
            ``flooding_std`` is negative.
        ProtocolError: If the layout or a ciphertext does not match.
    """
    if isinstance(divide_by, bool) or not (math.isfinite(divide_by) and divide_by > 0):
        raise PrivacyError(f"divide_by must be a positive finite number, got {divide_by!r}")
    if not (math.isfinite(flooding_std) and flooding_std >= 0):
        raise PrivacyError(f"flooding_std must be a finite number >= 0, got {flooding_std!r}")
    ctx = load_context(secret_ctx_bytes, what="the secret context")
    if not ctx.has_secret_key():
        raise PrivacyError(
            "decrypting needs the clients' secret context; this context has no secret key "
            "(the server's public context cannot decrypt)"
        )
    layout = encrypted.layout
    if layout.slots != context_slots(ctx):
        raise ProtocolError(
            f"the update packs {layout.slots} slots per ciphertext, the context "
            f"{context_slots(ctx)}"
        )
    if specs is not None and layout.specs != list(specs):
        raise ProtocolError(
            f"the encrypted update's layers {layout.specs} are not the expected {list(specs)}"
        )
    flat = np.empty(layout.encrypted_size, dtype=np.float64)
    start = 0
    for i, (blob, size) in enumerate(zip(encrypted.ciphertexts, layout.chunk_sizes, strict=True)):
        try:
            values = np.asarray(ts.ckks_vector_from(ctx, blob).decrypt(), dtype=np.float64)
        except Exception as exc:
            raise ProtocolError(f"ciphertext {i} cannot be decrypted: {exc}") from exc
        if values.shape != (size,):
            raise ProtocolError(f"ciphertext {i} holds {values.size} values, expected {size}")
        flat[start : start + size] = values
        start += size
    if flooding_std > 0:  # before any rounding: the cast below only post-processes
        flat += gaussian_like(noise or SecureGaussian(), flat, flooding_std)
    out: Tensors = OrderedDict()
    for layer in layout.layers:
        if layer.encrypted:
            offset = layout.offsets[layer.name]
            values = flat[offset : offset + layer.size].reshape(layer.shape)
        else:
            values = encrypted.plain[layer.name]
        out[layer.name] = (values / divide_by).astype(layer.dtype)
    return out
