"""An encrypted update (or an encrypted sum of updates) and its strict, versioned byte format."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from fl_secure.errors import ProtocolError
from fl_secure.messages import Tensors
from privacy.ckks.layout import ALLOWED_DTYPES, CkksLayout, LayerLayout

#: Version of the :meth:`EncryptedUpdate.to_bytes` format this module writes and reads.
FORMAT_VERSION = 1
MAGIC = b"FLSCKKS\x00"
_FRAME = struct.Struct("<8sHII")  # magic, version, header length, number of blobs
_BLOB_LEN = struct.Struct("<Q")
_DIGEST_BYTES = 32
MAX_HEADER_BYTES = 16 * 1024 * 1024

_HEADER_KEYS = {"slots", "weight", "count", "num_ciphertexts", "layers"}
_LAYER_KEYS = {"name", "dtype", "shape", "encrypted"}


@dataclass(frozen=True)
class EncryptedUpdate:
    """A client's encrypted update or an encrypted sum of updates.

    Attributes:
        layout: Layers, dtypes, shapes, which are encrypted, slot count.
        ciphertexts: Serialized CKKS vectors, ``layout.num_ciphertexts`` of them.
        plain: The plaintext layers as float64, already multiplied by the weight (summed for
            an aggregate).
        weight: The weight the values were multiplied by (the sum of weights for an
            aggregate): divide by it for a weighted mean.
        count: Number of client updates summed (1 for a client's update).

    Raises:
        ProtocolError: If the fields do not agree with the layout.
    """

    layout: CkksLayout
    ciphertexts: tuple[bytes, ...]
    plain: Mapping[str, np.ndarray] = field(default_factory=OrderedDict)
    weight: float = 1.0
    count: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "ciphertexts", tuple(self.ciphertexts))
        if len(self.ciphertexts) != self.layout.num_ciphertexts:
            raise ProtocolError(
                f"{len(self.ciphertexts)} ciphertexts, but the layout packs "
                f"{self.layout.encrypted_size} values into {self.layout.num_ciphertexts}"
            )
        if not all(isinstance(c, bytes) and c for c in self.ciphertexts):
            raise ProtocolError("every ciphertext must be non-empty bytes")
        if list(self.plain) != self.layout.plain_layers:
            raise ProtocolError(
                f"plaintext layers {list(self.plain)}, expected {self.layout.plain_layers}"
            )
        for name, array in self.plain.items():
            spec = self.layout.layer(name)
            if not isinstance(array, np.ndarray) or array.dtype != np.float64:
                raise ProtocolError(f"plaintext layer {name!r} must be a float64 array")
            if array.shape != spec.shape:
                raise ProtocolError(
                    f"plaintext layer {name!r} has shape {array.shape}, expected {spec.shape}"
                )
            if not np.isfinite(array).all():
                raise ProtocolError(f"plaintext layer {name!r} contains NaN or infinity")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float):
            raise ProtocolError(f"weight must be a number, got {self.weight!r}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ProtocolError(f"weight must be a positive finite number, got {self.weight!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ProtocolError(f"count must be a positive integer, got {self.count!r}")

    @property
    def encrypted_layers(self) -> list[str]:
        """Names of the encrypted layers, in order."""
        return self.layout.encrypted_layers

    @property
    def plain_layers(self) -> list[str]:
        """Names of the plaintext layers, in order."""
        return self.layout.plain_layers

    @property
    def ciphertext_bytes(self) -> int:
        """Total size of the serialized ciphertexts."""
        return sum(len(c) for c in self.ciphertexts)

    def to_bytes(self) -> bytes:
        """Serialize (format version :data:`FORMAT_VERSION`, never pickle).

        Layout, all little-endian: ``MAGIC`` (8 bytes), version (u16), header length (u32),
        number of blobs (u32); the UTF-8 JSON header (``slots``, ``weight``, ``count``,
        ``num_ciphertexts``, ``layers``: ``name``, ``dtype``, ``shape``, ``encrypted``); the
        blobs, each a u64 length and its bytes (the ciphertexts, then each plaintext layer as
        raw float64); the SHA-256 of everything before it.
        """
        header = {
            "slots": self.layout.slots,
            "weight": float(self.weight),
            "count": self.count,
            "num_ciphertexts": self.layout.num_ciphertexts,
            "layers": [
                {
                    "name": layer.name,
                    "dtype": layer.dtype.name,
                    "shape": list(layer.shape),
                    "encrypted": layer.encrypted,
                }
                for layer in self.layout.layers
            ],
        }
        header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
        blobs = list(self.ciphertexts) + [
            np.ascontiguousarray(a, dtype="<f8").tobytes() for a in self.plain.values()
        ]
        parts = [_FRAME.pack(MAGIC, FORMAT_VERSION, len(header_bytes), len(blobs)), header_bytes]
        for blob in blobs:
            parts += [_BLOB_LEN.pack(len(blob)), blob]
        body = b"".join(parts)
        return body + hashlib.sha256(body).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> EncryptedUpdate:
        """Parse and validate :meth:`to_bytes` output.

        Checks framing (magic, version, lengths), then the digest, then the header against the
        blobs. Ciphertexts are only parsed by TenSEAL when they are used.

        Raises:
            ProtocolError: Naming what is wrong (truncated, tampered, inconsistent header).
        """
        data = bytes(data)
        if len(data) < _FRAME.size + _DIGEST_BYTES:
            raise ProtocolError(
                f"encrypted update truncated: {len(data)} bytes, shorter than any valid one"
            )
        magic, version, header_len, num_blobs = _FRAME.unpack_from(data)
        if magic != MAGIC:
            raise ProtocolError("not an fl-secure CKKS encrypted update (bad magic bytes)")
        if version != FORMAT_VERSION:
            raise ProtocolError(
                f"unsupported encrypted-update format version {version}; this build reads "
                f"version {FORMAT_VERSION}"
            )
        if header_len > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
        end = len(data) - _DIGEST_BYTES
        pos = _FRAME.size + header_len
        if pos > end:
            raise ProtocolError(
                f"encrypted update truncated: header declares {header_len} bytes, only "
                f"{end - _FRAME.size} remain"
            )
        header_bytes = data[_FRAME.size : pos]
        blobs: list[bytes] = []
        for i in range(num_blobs):
            if pos + _BLOB_LEN.size > end:
                raise ProtocolError(
                    f"encrypted update truncated: blob {i} of {num_blobs} is missing"
                )
            (length,) = _BLOB_LEN.unpack_from(data, pos)
            pos += _BLOB_LEN.size
            if pos + length > end:
                raise ProtocolError(
                    f"encrypted update truncated: blob {i} declares {length} bytes, only "
                    f"{end - pos} remain"
                )
            blobs.append(data[pos : pos + length])
            pos += length
        if pos != end:
            raise ProtocolError(
                f"encrypted update has {end - pos} unexpected bytes after its last blob"
            )
        if not hmac.compare_digest(hashlib.sha256(data[:end]).digest(), data[end:]):
            raise ProtocolError("encrypted update digest mismatch: the bytes are corrupted")
        return cls._from_parts(header_bytes, blobs)

    @classmethod
    def _from_parts(cls, header_bytes: bytes, blobs: list[bytes]) -> EncryptedUpdate:
        try:
            header = json.loads(
                header_bytes.decode("utf-8"),
                object_pairs_hook=_no_duplicate_keys,
                parse_constant=_reject_constant,
            )
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ProtocolError(f"encrypted update header is not valid JSON: {exc}") from exc
        if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
            keys = sorted(header) if isinstance(header, dict) else type(header).__name__
            raise ProtocolError(f"header keys {keys}, expected {sorted(_HEADER_KEYS)}")
        raw_layers = header["layers"]
        if not isinstance(raw_layers, list):
            raise ProtocolError("header 'layers' must be a list")
        layers = [_parse_layer(i, raw) for i, raw in enumerate(raw_layers)]
        layout = CkksLayout(slots=_strict_int(header["slots"], "slots"), layers=tuple(layers))
        declared = _strict_int(header["num_ciphertexts"], "num_ciphertexts")
        if declared != layout.num_ciphertexts:
            raise ProtocolError(
                f"header declares {declared} ciphertexts but its layers pack "
                f"{layout.encrypted_size} values into {layout.num_ciphertexts}"
            )
        plain_names = layout.plain_layers
        if len(blobs) != layout.num_ciphertexts + len(plain_names):
            raise ProtocolError(
                f"{len(blobs)} blobs, expected {layout.num_ciphertexts} ciphertexts and "
                f"{len(plain_names)} plaintext layers"
            )
        plain: Tensors = OrderedDict()
        for name, blob in zip(plain_names, blobs[layout.num_ciphertexts :], strict=True):
            spec = layout.layer(name)
            if len(blob) != spec.size * 8:
                raise ProtocolError(
                    f"plaintext layer {name!r}: {len(blob)} bytes, expected {spec.size * 8} "
                    f"(float64 of shape {spec.shape})"
                )
            plain[name] = np.frombuffer(blob, dtype="<f8").astype(np.float64).reshape(spec.shape)
        weight = header["weight"]
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ProtocolError(f"header 'weight' must be a number, got {weight!r}")
        return cls(
            layout=layout,
            ciphertexts=tuple(blobs[: layout.num_ciphertexts]),
            plain=plain,
            weight=float(weight),
            count=_strict_int(header["count"], "count"),
        )


def _parse_layer(index: int, raw: object) -> LayerLayout:
    if not isinstance(raw, dict) or set(raw) != _LAYER_KEYS:
        keys = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ProtocolError(f"header layer {index}: keys {keys}, expected {sorted(_LAYER_KEYS)}")
    name, dtype, shape, encrypted = raw["name"], raw["dtype"], raw["shape"], raw["encrypted"]
    if not isinstance(name, str):
        raise ProtocolError(f"header layer {index}: name must be a string, got {name!r}")
    if dtype not in ALLOWED_DTYPES:
        raise ProtocolError(
            f"layer {name!r}: dtype {dtype!r} is not allowed; allowed: {', '.join(ALLOWED_DTYPES)}"
        )
    if not isinstance(shape, list):
        raise ProtocolError(f"layer {name!r}: shape must be a list, got {shape!r}")
    if not isinstance(encrypted, bool):
        raise ProtocolError(f"layer {name!r}: 'encrypted' must be true or false")
    dims = tuple(_strict_int(s, f"layer {name!r} shape") for s in shape)
    return LayerLayout(name=name, dtype=np.dtype(dtype), shape=dims, encrypted=encrypted)


def _strict_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ProtocolError(f"duplicate keys in the header: {keys}")
    return dict(pairs)


def _reject_constant(name: str) -> NoReturn:
    raise ProtocolError(f"non-finite number {name} in the header")
