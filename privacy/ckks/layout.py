"""How an update is packed into CKKS ciphertexts: its layers, which are encrypted, the chunks.

Packing
-------
The selected (encrypted) layers are flattened in the order of the update, concatenated and cut
into chunks of ``poly_modulus_degree / 2`` slots, one ciphertext each: a layer larger than one
ciphertext spans several, and small layers share ciphertexts. Layers not selected travel as
float64 plaintext (already multiplied by the weight) next to the ciphertexts and are summed in
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fl_secure.errors import PrivacyError, ProtocolError
from fl_secure.messages import TensorSpec

#: Dtypes a layer may have; encrypted layers must be floating point (CKKS is approximate).
ALLOWED_DTYPES = ("float16", "float32", "float64", "int32", "int64", "uint8", "bool")


@dataclass(frozen=True)
class LayerLayout:
    """One layer of an encrypted update: what it is and whether it is encrypted."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    encrypted: bool

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def spec(self) -> TensorSpec:
        """The layer's :class:`TensorSpec`."""
        return TensorSpec(self.name, self.dtype, self.shape)


@dataclass(frozen=True)
class CkksLayout:
    """How an update is packed: its layers in order and the ciphertext slot count.

    Encrypted layers are concatenated (in order) into one vector of :attr:`encrypted_size`
    values cut into :attr:`chunk_sizes`; plaintext layers are carried apart.

    Raises:
        ProtocolError: If the layout is inconsistent (duplicate names, unknown dtypes,
            negative dimensions, a non-float encrypted layer, nothing to encrypt).
    """

    slots: int
    layers: tuple[LayerLayout, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or self.slots < 1 or self.slots & (self.slots - 1):
            raise ProtocolError(f"slots must be a positive power of two, got {self.slots!r}")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ProtocolError(f"layer names must be distinct non-empty strings, got {names}")
        for layer in self.layers:
            if layer.dtype.name not in ALLOWED_DTYPES:
                raise ProtocolError(
                    f"layer {layer.name!r}: dtype {layer.dtype} is not allowed; allowed: "
                    f"{', '.join(ALLOWED_DTYPES)}"
                )
            if not all(isinstance(s, int) and s >= 0 for s in layer.shape):
                raise ProtocolError(f"layer {layer.name!r}: invalid shape {layer.shape}")
            if layer.encrypted and layer.dtype.kind != "f":
                raise ProtocolError(
                    f"layer {layer.name!r} has dtype {layer.dtype}: only floating-point layers "
                    "can be encrypted (CKKS is approximate); leave it out of `layers`"
                )
        if self.encrypted_size == 0:
            raise ProtocolError("no encrypted values: an encrypted update needs at least one")

    @classmethod
    def plan(
        cls, specs: Sequence[TensorSpec], layers: Iterable[str] | None, slots: int
    ) -> CkksLayout:
        """Layout of updates with ``specs`` where ``layers`` (all when None) are encrypted.

        Raises:
            PrivacyError: If ``layers`` names unknown or non-float layers or nothing at all.
        """
        names = [s.name for s in specs]
        if layers is None:
            selected = set(names)
        else:
            wanted = list(layers)
            selected = set(wanted)
            unknown = [n for n in wanted if n not in set(names)]
            if unknown:
                raise PrivacyError(f"layers to encrypt {unknown} are not in the update {names}")
            if len(selected) != len(wanted):
                raise PrivacyError(f"layers to encrypt are listed twice: {wanted}")
        if not any(s.name in selected and math.prod(s.shape) > 0 for s in specs):
            raise PrivacyError("no layer (with any element) selected for encryption")
        for s in specs:
            if s.name in selected and np.dtype(s.dtype).kind != "f":
                raise PrivacyError(
                    f"layer {s.name!r} has dtype {s.dtype}: CKKS only encrypts floating-point "
                    "layers; leave it out of `layers` to send it as plaintext"
                )
        try:
            return cls(
                slots=slots,
                layers=tuple(
                    LayerLayout(s.name, np.dtype(s.dtype), tuple(s.shape), s.name in selected)
                    for s in specs
                ),
            )
        except ProtocolError as exc:
            raise PrivacyError(str(exc)) from exc

    @cached_property
    def offsets(self) -> dict[str, int]:
        """Offset of each encrypted layer in the concatenated encrypted vector."""
        out: dict[str, int] = {}
        pos = 0
        for layer in self.layers:
            if layer.encrypted:
                out[layer.name] = pos
                pos += layer.size
        return out

    @property
    def encrypted_size(self) -> int:
        """Number of encrypted values."""
        return sum(layer.size for layer in self.layers if layer.encrypted)

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """Values in each ciphertext (all ``slots`` but the last)."""
        full, rest = divmod(self.encrypted_size, self.slots)
        return (self.slots,) * full + ((rest,) if rest else ())

    @property
    def num_ciphertexts(self) -> int:
        """Number of ciphertexts of an update."""
        return -(-self.encrypted_size // self.slots)

    @property
    def encrypted_layers(self) -> list[str]:
        """Names of the encrypted layers, in order."""
        return [layer.name for layer in self.layers if layer.encrypted]

    @property
    def plain_layers(self) -> list[str]:
        """Names of the layers carried as plaintext, in order."""
        return [layer.name for layer in self.layers if not layer.encrypted]

    @property
    def specs(self) -> list[TensorSpec]:
        """Specs of all layers, in order."""
        return [layer.spec for layer in self.layers]

    def chunks_of(self, name: str) -> range:
        """Indices of the ciphertexts that hold (part of) encrypted layer ``name``."""
        if name not in self.offsets:
            raise KeyError(f"{name!r} is not an encrypted layer of this layout")
        start, size = self.offsets[name], self.layer(name).size
        if size == 0:
            return range(0)
        return range(start // self.slots, (start + size - 1) // self.slots + 1)

    def layer(self, name: str) -> LayerLayout:
        """The layer called ``name``."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def mismatch(self, expected: CkksLayout) -> str | None:
        """How this layout differs from ``expected`` (the first difference), or None."""
        if self.slots != expected.slots:
            return f"{self.slots} slots per ciphertext, expected {expected.slots}"
        got = [layer.name for layer in self.layers]
        want = [layer.name for layer in expected.layers]
        if got != want:
            return f"layers {got}, expected {want}"
        for mine, theirs in zip(self.layers, expected.layers, strict=True):
            for attr in ("dtype", "shape", "encrypted"):
                if getattr(mine, attr) != getattr(theirs, attr):
                    return (
                        f"layer {mine.name!r} has {attr} {getattr(mine, attr)!r}, expected "
                        f"{getattr(theirs, attr)!r}"
                    )
        return None
