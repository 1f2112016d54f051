"""CKKS homomorphic aggregation: accuracy, chunking, key separation, wire format, layouts."""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tenseal as ts

from fl_secure.aggregation import StreamingMean
from fl_secure.errors import PrivacyError, ProtocolError
from fl_secure.messages import Tensors, TensorSpec
from privacy.ckks.aggregator import CkksAggregator
from privacy.ckks.context import CkksParams, make_secret_context, public_context
from privacy.ckks.encryption import decrypt_sum, encrypt_update
from privacy.ckks.layout import CkksLayout
from privacy.ckks.update import EncryptedUpdate

SLOTS = 4096  # default poly_modulus_degree 8192
SPECS = [
    TensorSpec("conv", np.dtype(np.float32), (16, 3, 3, 3)),  # 432
    TensorSpec("fc", np.dtype(np.float32), (10_000,)),  # larger than one ciphertext
    TensorSpec("bias", np.dtype(np.float64), (7,)),
]
FRAME = struct.Struct("<8sHII")


@pytest.fixture(scope="module")
def secret_ctx() -> bytes:
    return make_secret_context()


@pytest.fixture(scope="module")
def public_ctx(secret_ctx: bytes) -> bytes:
    return public_context(secret_ctx)


def _update(rng: np.random.Generator, specs: list[TensorSpec] = SPECS) -> Tensors:
    return OrderedDict((s.name, rng.standard_normal(s.shape).astype(s.dtype)) for s in specs)


def _flat(tensors: Tensors) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in tensors.values()])


def _rewrite(data: bytes, edit: Callable[[dict[str, Any]], None], version: int = 1) -> bytes:
    """Re-frame ``data`` with an edited JSON header and a valid digest (a 'clean' forgery)."""
    magic, _, header_len, num_blobs = FRAME.unpack_from(data)
    header = json.loads(data[FRAME.size : FRAME.size + header_len])
    edit(header)
    new_header = json.dumps(header).encode()
    blobs = data[FRAME.size + header_len : -32]
    body = FRAME.pack(magic, version, len(new_header), num_blobs) + new_header + blobs
    return body + hashlib.sha256(body).digest()


def test_params_are_validated() -> None:
    # Prepare / Execute / Assert: defaults, then each rule
    params = CkksParams()
    assert (params.poly_modulus_degree, params.coeff_mod_bit_sizes) == (8192, (60, 40, 40, 60))
    assert (params.slots, params.scale) == (4096, 2.0**100)
    assert CkksParams(coeff_mod_bit_sizes=(60, 40, 60), scale_bits=40).coeff_mod_bit_sizes == (
        60,
        40,
        60,
    )
    with pytest.raises(PrivacyError, match="poly_modulus_degree must be one of"):
        CkksParams(poly_modulus_degree=5000)
    with pytest.raises(PrivacyError, match="128-bit security"):
        CkksParams(coeff_mod_bit_sizes=(60, 60, 60, 60))  # 240 > 218 bits at N = 8192
    with pytest.raises(PrivacyError, match="at least two prime sizes"):
        CkksParams(coeff_mod_bit_sizes=(60,))
    with pytest.raises(PrivacyError, match="at least two prime sizes"):
        CkksParams(coeff_mod_bit_sizes=(61, 40, 60))
    with pytest.raises(PrivacyError, match="scale_bits"):
        CkksParams(coeff_mod_bit_sizes=(30, 30), scale_bits=30)


def test_server_context_has_no_secret_key_and_cannot_decrypt(
    secret_ctx: bytes, public_ctx: bytes
) -> None:
    # Prepare
    update = _update(np.random.default_rng(1))
    encrypted = encrypt_update(update, secret_ctx)
    # Execute
    server_ctx = ts.context_from(public_ctx)
    client_ctx = ts.context_from(secret_ctx)
    # Assert: no key material on the server side (parameters and scale only)
    assert client_ctx.has_secret_key() and client_ctx.is_private()
    assert not server_ctx.has_secret_key() and not server_ctx.is_private()
    assert server_ctx.global_scale == 2.0**100
    assert len(public_ctx) < 1000 < 100_000 < len(secret_ctx)
    # Assert: the ciphertext parses under the public context, but does not decrypt
    vector = ts.ckks_vector_from(server_ctx, encrypted.ciphertexts[0])
    with pytest.raises(ValueError, match="secret_key"):
        vector.decrypt()
    with pytest.raises(PrivacyError, match="no secret key"):
        decrypt_sum(encrypted, public_ctx)
    with pytest.raises(PrivacyError, match="without a secret key"):
        encrypt_update(update, public_ctx)
    # Assert: the aggregator refuses a context that could decrypt
    with pytest.raises(PrivacyError, match="secret key"):
        CkksAggregator(secret_ctx, SPECS)
    with pytest.raises(PrivacyError, match="not a serialized TenSEAL context"):
        CkksAggregator(b"not a context", SPECS)


def test_decrypted_aggregate_of_five_clients_matches_the_plaintext_sum(
    secret_ctx: bytes, public_ctx: bytes
) -> None:
    # Prepare: five clients' random updates, the server holds only the public context
    rng = np.random.default_rng(2)
    updates = [_update(rng) for _ in range(5)]
    aggregator = CkksAggregator(public_ctx, SPECS)
    # Execute: encrypt, ship as bytes, add as they arrive, ship the sum back, decrypt
    for update in updates:
        wire = encrypt_update(update, secret_ctx).to_bytes()
        aggregator.add(EncryptedUpdate.from_bytes(wire))
    summed = EncryptedUpdate.from_bytes(aggregator.result().to_bytes())
    decrypted = decrypt_sum(summed, secret_ctx, specs=SPECS)
    # Assert: count, weight, dtypes, shapes
    assert (summed.count, summed.weight, aggregator.count) == (5, 5.0, 5)
    assert [(k, v.dtype, v.shape) for k, v in decrypted.items()] == [
        (s.name, s.dtype, s.shape) for s in SPECS
    ]
    # Assert: within 1e-4 of the float64 plaintext sum, relative to its norm and per element
    expected = np.sum([_flat(u) for u in updates], axis=0)
    got = _flat(decrypted)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-4
    not_near_zero = np.abs(expected) > 1e-2
    assert not_near_zero.mean() > 0.99
    rel = np.abs(got - expected)[not_near_zero] / np.abs(expected)[not_near_zero]
    assert rel.max() < 1e-4
    assert np.abs(got - expected).max() < 1e-5


def test_weighted_sum_divided_by_the_summed_weight_is_the_weighted_mean(
    secret_ctx: bytes, public_ctx: bytes
) -> None:
    # Prepare: num_examples as weights; the plaintext server's StreamingMean as reference
    rng = np.random.default_rng(3)
    updates = [_update(rng) for _ in range(4)]
    weights = [10.0, 250.0, 3.0, 41.0]
    reference = StreamingMean(SPECS)
    aggregator = CkksAggregator(public_ctx, SPECS)
    # Execute
    for update, weight in zip(updates, weights, strict=True):
        reference.add(update, weight)
        aggregator.add(encrypt_update(update, secret_ctx, weight=weight))
    result = aggregator.result()
    mean = decrypt_sum(result, secret_ctx, divide_by=result.weight)
    # Assert
    assert result.weight == pytest.approx(sum(weights))
    for name, expected in reference.mean().items():
        assert mean[name].dtype == expected.dtype
        np.testing.assert_allclose(mean[name], expected, rtol=1e-4, atol=1e-6)


def test_a_layer_larger_than_one_ciphertext_is_split_into_chunks(secret_ctx: bytes) -> None:
    # Prepare: layers packed back to back: 100 + 10_000 + 5_000 values in 4096-slot chunks
    specs = [
        TensorSpec("a", np.dtype(np.float32), (100,)),
        TensorSpec("big", np.dtype(np.float32), (100, 100)),
        TensorSpec("c", np.dtype(np.float32), (5_000,)),
    ]
    update = _update(np.random.default_rng(4), specs)
    # Execute
    encrypted = encrypt_update(update, secret_ctx)
    alone = encrypt_update(OrderedDict(big=update["big"]), secret_ctx)
    ctx = ts.context_from(secret_ctx)
    sizes = [ts.ckks_vector_from(ctx, c).size() for c in encrypted.ciphertexts]
    decrypted = decrypt_sum(encrypted, secret_ctx)
    # Assert: ceil(15_100 / 4096) = 4 ciphertexts; which ones hold each layer
    layout = encrypted.layout
    assert layout.chunk_sizes == (SLOTS, SLOTS, SLOTS, 15_100 - 3 * SLOTS)
    assert sizes == list(layout.chunk_sizes)
    assert layout.offsets == {"a": 0, "big": 100, "c": 10_100}
    assert layout.chunks_of("a") == range(0, 1)
    assert layout.chunks_of("big") == range(0, 3)
    assert layout.chunks_of("c") == range(2, 4)
    assert alone.layout.num_ciphertexts == 3 and alone.layout.chunks_of("big") == range(0, 3)
    assert alone.layout.chunk_sizes == (SLOTS, SLOTS, 10_000 - 2 * SLOTS)
    for name, value in update.items():
        np.testing.assert_allclose(decrypted[name], value, rtol=0, atol=1e-5)


def test_subset_encryption_sends_only_the_selected_layers_as_ciphertexts(
    secret_ctx: bytes, public_ctx: bytes
) -> None:
    # Prepare
    rng = np.random.default_rng(5)
    updates = [_update(rng) for _ in range(3)]
    aggregator = CkksAggregator(public_ctx, SPECS, layers=["fc"])
    # Execute
    encrypted = [encrypt_update(u, secret_ctx, layers=["fc"], weight=2.0) for u in updates]
    wire = encrypted[0].to_bytes()
    for e in encrypted:
        aggregator.add(EncryptedUpdate.from_bytes(e.to_bytes()))
    total = decrypt_sum(aggregator.result(), secret_ctx, divide_by=2.0)
    # Assert: only fc is ciphertext (3 chunks of it); conv and bias are weighted float64
    assert encrypted[0].encrypted_layers == ["fc"]
    assert encrypted[0].plain_layers == ["conv", "bias"]
    assert encrypted[0].layout.num_ciphertexts == 3
    np.testing.assert_array_equal(encrypted[0].plain["conv"], updates[0]["conv"] * 2.0)
    assert encrypted[0].plain["bias"].dtype == np.float64
    # Assert: plaintext layers are readable in the bytes, the encrypted one is not
    assert (updates[0]["conv"].astype("<f8") * 2.0).tobytes() in wire
    assert (updates[0]["bias"].astype("<f8") * 2.0).tobytes() in wire
    assert (updates[0]["fc"][:16].astype("<f8") * 2.0).tobytes() not in wire
    assert updates[0]["fc"][:16].astype("<f4").tobytes() not in wire
    # Assert: plaintext layers are summed exactly, the encrypted one approximately
    for name in ("conv", "bias"):
        expected = np.sum([u[name].astype(np.float64) for u in updates], axis=0)
        np.testing.assert_allclose(total[name], expected.astype(total[name].dtype), rtol=1e-6)
    fc_sum = np.sum([u["fc"].astype(np.float64) for u in updates], axis=0)
    np.testing.assert_allclose(total["fc"], fc_sum, rtol=0, atol=1e-5)


def test_encrypted_update_round_trips_through_bytes(secret_ctx: bytes) -> None:
    # Prepare
    update = _update(np.random.default_rng(6))
    encrypted = encrypt_update(update, secret_ctx, layers=["fc", "bias"], weight=3.5)
    # Execute
    data = encrypted.to_bytes()
    loaded = EncryptedUpdate.from_bytes(data)
    # Assert: identical fields, identical bytes, identical decryption
    assert loaded.layout == encrypted.layout
    assert loaded.ciphertexts == encrypted.ciphertexts
    assert (loaded.weight, loaded.count) == (3.5, 1)
    np.testing.assert_array_equal(loaded.plain["conv"], encrypted.plain["conv"])
    assert loaded.to_bytes() == data
    assert data[:8] == b"FLSCKKS\x00"
    assert encrypted.ciphertext_bytes == sum(len(c) for c in encrypted.ciphertexts)
    a, b = decrypt_sum(loaded, secret_ctx), decrypt_sum(encrypted, secret_ctx)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda d: d[:-1], "truncated: blob 2 declares"),  # one byte short
        (lambda d: d[: len(d) // 2], "truncated: blob"),
        (lambda d: d[:20], "truncated"),
        (lambda d: d + b"\x00" * 40, "unexpected bytes after its last blob"),
        (lambda d: d[:5000] + bytes([d[5000] ^ 1]) + d[5001:], "digest mismatch"),
        (lambda d: b"NOTCKKS\x00" + d[8:], "bad magic"),
        (lambda d: _rewrite(d, lambda h: None, version=2), "unsupported .* version 2"),
    ],
    ids=["one-byte-short", "half", "frame-only", "trailing", "flipped-bit", "magic", "version"],
)
def test_tampered_or_truncated_bytes_raise_protocol_error(
    secret_ctx: bytes, corrupt: Callable[[bytes], bytes], message: str
) -> None:
    # Prepare
    data = encrypt_update(_update(np.random.default_rng(7)), secret_ctx).to_bytes()
    # Execute / Assert
    with pytest.raises(ProtocolError, match=message):
        EncryptedUpdate.from_bytes(corrupt(data))


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: h.__setitem__(key, value)


def _set_layer(index: int, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: h["layers"][index].__setitem__(key, value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("num_ciphertexts", 4), "declares 4 ciphertexts .* into 3"),
        (_set_layer(2, "shape", [8]), "plaintext layer 'bias': 56 bytes, expected 64"),
        (_set_layer(0, "dtype", "complex64"), "dtype 'complex64' is not allowed"),
        (_set_layer(1, "dtype", "int32"), "only floating-point layers can be encrypted"),
        (_set_layer(1, "shape", [-10_000]), "must be a non-negative integer"),
        (_set_layer(1, "name", "conv"), "distinct"),
        (_set_layer(2, "encrypted", True), "4 blobs, expected 3 ciphertexts and 0 plaintext"),
        (_set("weight", -1.0), "weight must be a positive finite number"),
        (_set("count", 0), "count must be a positive integer"),
        (_set("slots", 3000), "power of two"),
        (_set("extra", 1), "header keys"),
    ],
)
def test_inconsistent_header_is_refused_with_a_named_problem(
    secret_ctx: bytes, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    # Prepare: a valid update with a plaintext bias layer, then a re-signed edited header
    update = _update(np.random.default_rng(8))
    data = encrypt_update(update, secret_ctx, layers=["conv", "fc"]).to_bytes()
    # Execute / Assert
    with pytest.raises(ProtocolError, match=message):
        EncryptedUpdate.from_bytes(_rewrite(data, edit))


def test_aggregator_refuses_a_layout_mismatch_and_keeps_its_sum(
    secret_ctx: bytes, public_ctx: bytes
) -> None:
    # Prepare
    rng = np.random.default_rng(9)
    first, second = _update(rng), _update(rng)
    aggregator = CkksAggregator(public_ctx, SPECS)
    aggregator.add(encrypt_update(first, secret_ctx))
    good = encrypt_update(second, secret_ctx)
    other_specs = [SPECS[0], TensorSpec("fc", np.dtype(np.float32), (9_999,)), SPECS[2]]
    reshaped = OrderedDict(
        (s.name, rng.standard_normal(s.shape).astype(s.dtype)) for s in other_specs
    )
    small_key = make_secret_context(CkksParams(4096, (40, 20, 40), 20))
    # Execute / Assert: a layer left in plaintext, another shape, another ring size
    with pytest.raises(ProtocolError, match="layer 'bias' has encrypted False, expected True"):
        aggregator.add(encrypt_update(second, secret_ctx, layers=["conv", "fc"]))
    with pytest.raises(ProtocolError, match=r"layer 'fc' has shape \(9999,\)"):
        aggregator.add(encrypt_update(reshaped, secret_ctx))
    with pytest.raises(ProtocolError, match="2048 slots per ciphertext, expected 4096"):
        aggregator.add(encrypt_update(second, small_key))
    # Execute / Assert: right layout, but a ciphertext of the wrong size in the last chunk
    swapped = EncryptedUpdate(
        layout=good.layout,
        ciphertexts=good.ciphertexts[:-1] + good.ciphertexts[:1],
        plain=good.plain,
    )
    with pytest.raises(ProtocolError, match="ciphertext 2 holds 4096 values, expected 2247"):
        aggregator.add(swapped)
    # Assert: nothing of the refused updates entered the sum
    result = aggregator.result()
    assert result.count == 1
    decrypted = decrypt_sum(result, secret_ctx)
    np.testing.assert_allclose(_flat(decrypted), _flat(first), rtol=0, atol=1e-6)


def test_aggregator_refuses_foreign_or_rescaled_ciphertexts(
    secret_ctx: bytes, public_ctx: bytes
) -> None:
    # Prepare: one-chunk updates; ciphertexts under other parameters or at a lower level
    specs = [TensorSpec("w", np.dtype(np.float32), (100,))]
    update = OrderedDict(w=np.linspace(-1, 1, 100, dtype=np.float32))
    good = encrypt_update(update, secret_ctx)
    small_key = make_secret_context(CkksParams(4096, (40, 20, 40), 20))
    foreign = encrypt_update(update, small_key).ciphertexts
    values = update["w"].astype(np.float64)  # at 2^30, so that the product's scale fits
    rescaled = ts.ckks_vector(ts.context_from(secret_ctx), values, scale=2.0**30)
    rescaled.mul_(1.0)  # multiplies then rescales: one level down
    aggregator = CkksAggregator(public_ctx, specs)
    # Execute / Assert
    with pytest.raises(ProtocolError, match="ciphertext 0 is not a CKKS vector"):
        aggregator.add(EncryptedUpdate(layout=good.layout, ciphertexts=foreign))
    with pytest.raises(ProtocolError, match="ciphertext 0 (has scale|is not at the top)"):
        aggregator.add(EncryptedUpdate(good.layout, (bytes(rescaled.serialize()),)))
    with pytest.raises(ProtocolError, match="no encrypted update"):
        aggregator.result()


def test_encrypt_and_decrypt_refuse_invalid_requests(secret_ctx: bytes) -> None:
    # Prepare
    update = _update(np.random.default_rng(10))
    with_nan = OrderedDict(update, bias=np.array([np.nan] * 7))
    with_int = OrderedDict(update, steps=np.array([3], dtype=np.int64))
    # Execute / Assert
    with pytest.raises(PrivacyError, match="'bias' contains NaN"):
        encrypt_update(with_nan, secret_ctx)
    with pytest.raises(PrivacyError, match="'steps' has dtype int64"):
        encrypt_update(with_int, secret_ctx)
    with pytest.raises(PrivacyError, match=r"\['nope'\] are not in the update"):
        encrypt_update(update, secret_ctx, layers=["fc", "nope"])
    with pytest.raises(PrivacyError, match="no layer"):
        encrypt_update(update, secret_ctx, layers=[])
    with pytest.raises(PrivacyError, match="weight must be a positive"):
        encrypt_update(update, secret_ctx, weight=0.0)
    with pytest.raises(PrivacyError, match="cannot encrypt chunk 0"):
        encrypt_update(OrderedDict(w=np.full(4, 1e300)), secret_ctx)
    # Assert: an integer layer can travel as plaintext next to encrypted ones
    mixed = decrypt_sum(encrypt_update(with_int, secret_ctx, layers=["fc"]), secret_ctx)
    assert mixed["steps"].dtype == np.int64 and mixed["steps"].tolist() == [3]
    encrypted = encrypt_update(update, secret_ctx)
    with pytest.raises(PrivacyError, match="divide_by"):
        decrypt_sum(encrypted, secret_ctx, divide_by=0.0)
    with pytest.raises(ProtocolError, match="not the expected"):
        decrypt_sum(encrypted, secret_ctx, specs=SPECS[:2])


def test_layout_plan_matches_specs_order_not_selection_order() -> None:
    # Prepare / Execute
    layout = CkksLayout.plan(SPECS, ["bias", "conv"], SLOTS)
    # Assert
    assert layout.encrypted_layers == ["conv", "bias"]
    assert layout.plain_layers == ["fc"]
    assert layout.offsets == {"conv": 0, "bias": 432}
    assert layout.chunk_sizes == (439,)
    assert layout.specs == SPECS


def test_a_header_nested_beyond_the_parsers_limit_is_a_protocol_error() -> None:
    # deep nesting makes json raise RecursionError, which must not escape as a crash
    with pytest.raises(ProtocolError, match="header is not valid JSON"):
        EncryptedUpdate._from_parts(b"[" * 100_000, [])
