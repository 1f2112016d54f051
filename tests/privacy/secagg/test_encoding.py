"""Fixed-point encoding, its centred lift and modulus check, the AES-CTR masks and uniforms."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fl_secure.errors import PrivacyError, ProtocolError
from privacy.secagg.encoding import SecureUniform, check_modulus, decode, encode
from privacy.secagg.masks import prg_mask
from tests.privacy.secagg.helpers import SeededUniform
from tests.privacy.secagg.helpers import config as _config


@settings(max_examples=50, deadline=None)
@given(
    bits=st.integers(16, 64),
    log_scale=st.integers(0, 12),
    values=st.lists(st.floats(-3.0, 3.0), min_size=1, max_size=50),
    seed=st.integers(0, 1000),
)
def test_encode_decode_round_trip_within_one_unit(
    bits: int, log_scale: int, values: list[float], seed: int
) -> None:
    # Prepare
    scale, clip = 2.0**log_scale, 2.0
    x = np.array(values)
    # Execute
    enc = encode(x, clip, scale, bits, rounding=SeededUniform(seed))
    dec = decode(enc, 1, clip, scale, bits)
    # Assert: clipped, then within one fixed-point unit; values below 2^bits
    assert enc.dtype == np.uint64 and int(enc.max()) < 1 << bits
    assert np.all(np.abs(dec - np.clip(x, -clip, clip)) < 1.0 / scale)
    assert np.all(np.abs(dec) <= clip)


@pytest.mark.parametrize(("value", "scale"), [(0.37, 1.0), (-1.3, 2.0)])
def test_stochastic_rounding_is_unbiased(value: float, scale: float) -> None:
    # Prepare: the real CSPRNG; 200 000 copies of a value between two grid points
    n = 200_000
    # Execute
    dec = decode(encode(np.full(n, value), 2.0, scale, 32), 1, 2.0, scale, 32)
    # Assert: only the two neighbouring grid points; mean within 5 standard errors
    lo, hi = math.floor(value * scale) / scale, math.ceil(value * scale) / scale
    assert set(np.unique(dec).tolist()) == {lo, hi}
    p = (value - lo) / (hi - lo)
    assert abs(dec.mean() - value) < 5 * (hi - lo) * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_encode_is_clip_scale_and_round_up_below_the_fraction(dtype: type) -> None:
    # Prepare: values inside and beyond the clip range, at a scale that leaves fractions,
    # longer than one encoding chunk (65 536 values)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(70_000) * 1.5).astype(dtype)
    clip, scale, bits = 2.0, 2.0**20 / 3, 32
    # Execute
    enc = encode(x, clip, scale, bits, rounding=SeededUniform(9))
    # Assert: bit-exact against the definition, with the same uniforms
    scaled = np.clip(x.astype(np.float64), -clip, clip) * scale
    low = np.floor(scaled)
    want = (low + (SeededUniform(9).uniform(x.size) < scaled - low)).astype(np.int64)
    np.testing.assert_array_equal(enc, want.view(np.uint64) & np.uint64(2**bits - 1))


def test_encode_refuses_non_finite_values_and_clips_huge_finite_ones() -> None:
    for bad in (np.nan, np.inf, -np.inf):
        for dtype in (np.float32, np.float64):
            x = np.zeros(100, dtype=dtype)
            x[57] = bad
            with pytest.raises(PrivacyError, match="NaN or infinity"):
                encode(x, 2.0, 4.0, 32)
    # finite float64 values whose sum overflows are clipped like any other value
    huge = np.array([1e308, 1e308, -1e308, 0.5])
    dec = decode(encode(huge, 2.0, 4.0, 32), 1, 2.0, 4.0, 32)
    np.testing.assert_array_equal(dec, [2.0, 2.0, -2.0, 0.5])


@pytest.mark.parametrize("bits", [8, 31, 32, 33, 63, 64])
def test_decode_is_the_centred_lift(bits: int) -> None:
    # Prepare: the largest bound n B the modulus allows (B <= 2^52), residues at 0, +/-1 and
    # +/- n B, and one just beyond
    n = 1 if bits <= 53 else 1 << (bits - 55)
    b = min((1 << (bits - 1)) - 1, 1 << 52)
    top, nb = 1 << bits, n * b
    residues = [0, 1, nb, top - 1, top - nb]
    want = [0, 1, nb, -1, -nb]
    for dtype in (np.uint32, np.uint64) if bits <= 32 else (np.uint64,):
        # Execute
        got = decode(np.array(residues, dtype=dtype), n, float(b), 1.0, bits)
        # Assert: exact, in float64; one unit more than n B is refused
        np.testing.assert_array_equal(got, np.array(want, dtype=np.float64))
        with pytest.raises(ProtocolError, match=f"magnitude {nb + 1} > {nb}"):
            decode(np.array([top - nb - 1], dtype=dtype), n, float(b), 1.0, bits)


def test_check_modulus_refuses_a_wrapping_configuration() -> None:
    # Prepare / Execute / Assert: 2 n B < 2^bits exactly at the boundary
    assert check_modulus(1, 2.0**31 - 1, 1.0, 32) == 2**31 - 1
    with pytest.raises(PrivacyError, match=r"spans \+/-2147483648 .*use modulus_bits >= 33"):
        check_modulus(1, 2.0**31, 1.0, 32)
    with pytest.raises(PrivacyError, match=r"100 inputs.*2\^32"):
        check_modulus(100, 1.0, 2.0**25, 32)
    with pytest.raises(PrivacyError, match="64 bits are too few"):
        check_modulus(2**20, 1.0, 2.0**50, 64)
    with pytest.raises(PrivacyError, match="100 inputs"):
        _config(100, 51, bits=32, scale=2.0**25)
    # a sum outside +/- n B cannot come from n clipped inputs
    with pytest.raises(ProtocolError, match="corrupted"):
        decode(np.array([2**20], dtype=np.uint64), 2, 1.0, 2.0**10, 32)


def test_masks_are_the_aes_ctr_keystream() -> None:
    # Prepare: an independent AES-256-CTR keystream, IV 0, over a chunk boundary
    seed, other = bytes(range(32)), bytes(range(1, 33))
    n = (1 << 20) + 5
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(8 * n))
    # Execute
    mask = prg_mask(seed, n, 64)
    # Assert: same seed, same mask; little-endian words; reduced mod 2^bits; other seed differs
    assert mask[:3].tolist() == [
        int.from_bytes(stream[8 * i : 8 * i + 8], "little") for i in range(3)
    ]
    np.testing.assert_array_equal(mask, np.frombuffer(stream, dtype="<u8"))
    np.testing.assert_array_equal(prg_mask(seed, 1000, 64), mask[:1000])
    # moduli up to 2^32: the same keystream read as little-endian u32 words (word_dtype)
    words32 = np.frombuffer(stream[: 4 * n], dtype="<u4").astype(np.uint64)
    np.testing.assert_array_equal(prg_mask(seed, n, 32), words32)
    np.testing.assert_array_equal(prg_mask(seed, 1000, 20), words32[:1000] & np.uint64(2**20 - 1))
    assert prg_mask(seed, 10, 33).tolist() == (mask[:10] & np.uint64(2**33 - 1)).tolist()
    assert np.mean(prg_mask(other, 1000, 64) == mask[:1000]) == 0.0


def test_secure_uniform_is_uniform() -> None:
    u = SecureUniform().uniform(100_000)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-4
