"""Reader of dlib's portable serialization of a ``loss_metric`` DNN (dlib's face ResNet).

dlib (King, "Dlib-ml: A Machine Learning Toolkit", JMLR 10, 2009) writes a network with
``dlib::serialize(net)``. This module reads such a file without dlib, for the layer types of
``dlib_face_recognition_resnet_model_v1.dat``: ``input_rgb_image[_sized]``, ``con_``,
``affine_``, ``relu_``, ``max_pool_``, ``avg_pool_``, ``add_prev_``, ``fc_``, tag and skip
layers, under a ``loss_metric_`` loss. What it knows of the format, from dlib's public headers
(``serialize.h``, ``float_details.h``, ``cuda/tensor.h``, ``dnn/core.h``, ``dnn/layers.h``,
``dnn/input.h``, ``dnn/loss.h``) and the bytes of that file:

* An integer is a control byte -- bit 7 set for a negative number, bits 0-3 the count ``n``
  of bytes that follow, bits 4-6 zero -- then ``|value|`` in ``n`` little-endian bytes.
* A scalar float is two integers, the mantissa (int64) then the exponent (int16): the value
  is ``mantissa * 2**exponent``; exponents 32000, 32001 and 32002 stand for +inf, -inf and
  NaN. (``serialize.h``'s comment says the exponent comes first; its code writes the mantissa
  first, and so do the files.)
* A string is its length (an integer) then its bytes; a bool is the ASCII byte ``1`` or ``0``.
* A tensor (version 2) is its version, its dims ``num_samples, k, nr, nc`` and then its
  values as raw little-endian IEEE float32 (not the scalar float encoding above); an
  ``alias_tensor`` (a view into a layer's parameter tensor) is a version and dims, no data.
* Each layer writes its version and then its *subnetwork* before its own details, so a file
  holds the loss layer, then one version number per layer from the output down to the input,
  then the input layer, then each layer's details from the input up.
* Tag and skip layers write only their version (1) and their subnetwork: neither their kind
  nor their ID is stored, and an ``add_prev_`` layer does not store which tag it adds. The
  file alone cannot tell a tag from a skip, so both read as :class:`TagOrSkip`, and the
  caller checks them against the architecture it expects.

Parameter arrays are copied out as float32 numpy arrays in PyTorch's layouts: a convolution
``[out, in, kh, kw]`` (dlib's filter layout already), a fully connected weight
``[out, in]`` (dlib stores ``[in, out]``). The layers are the dataclasses of
:mod:`fl_secure.models.dlib_layers`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Final

import numpy as np

from fl_secure.errors import CheckpointError
from fl_secure.models.dlib_layers import (
    AddPrev,
    Affine,
    Conv,
    DlibLayer,
    DlibNet,
    Fc,
    InputRGB,
    LossMetric,
    Pool,
    Relu,
    TagOrSkip,
)

FLOAT_SPECIALS: Final = {32000: float("inf"), 32001: float("-inf"), 32002: float("nan")}
"""Exponents that ``dlib::float_details`` uses for +inf, -inf and NaN."""

LAYER_VERSION: Final = 2
"""Version written by ``add_layer`` over another layer (version 1 lacks ``params_grad``)."""
INPUT_LAYER_VERSIONS: Final = (2, 3)
"""Versions of ``add_layer`` directly over the input layer (3 adds the expansion factor)."""
TAG_OR_SKIP_VERSION: Final = 1
TENSOR_VERSION: Final = 2
ALIAS_TENSOR_VERSION: Final = 1
CONV_MODE: Final = 0  # dlib's layer_mode: CONV_MODE = 0, FC_MODE = 1
FC_NO_BIAS: Final = 1  # dlib's fc_bias_mode: FC_HAS_BIAS = 0, FC_NO_BIAS = 1


def read_dlib_net(path: str | os.PathLike[str]) -> DlibNet:
    """Read a file written by ``dlib::serialize(net)`` for a ``loss_metric`` network.

    Args:
        path: the ``.dat`` file, e.g. ``dlib_face_recognition_resnet_model_v1.dat``.

    Returns:
        The network's layers with their hyper-parameters and float32 parameter arrays.

    Raises:
        CheckpointError: if the file cannot be read, is not a ``loss_metric`` network (a
            shape predictor, a face detector), is truncated, holds a layer type this reader
            does not know, or has bytes after the network. The message names the file, the
            byte offset, what was expected and what was found.
    """
    source = Path(path)
    try:
        data = source.read_bytes()
    except OSError as error:
        raise CheckpointError(f"cannot read dlib network {source}: {error}") from error
    return _NetReader(_Bytes(data, source)).read()


class _Bytes:
    """A cursor over the file's bytes with dlib's primitive decoders."""

    def __init__(self, data: bytes, source: Path):
        self.data = data
        self.pos = 0
        self.source = source

    def error(self, message: str, at: int | None = None) -> CheckpointError:
        """A CheckpointError naming the file and the byte offset."""
        offset = self.pos if at is None else at
        return CheckpointError(f"{self.source}: at byte {offset}: {message}")

    def take(self, count: int, what: str) -> bytes:
        """The next ``count`` bytes, or an error saying the file is truncated."""
        end = self.pos + count
        if count < 0 or end > len(self.data):
            raise self.error(
                f"the file ends after {len(self.data)} bytes, inside {what} ({count} bytes "
                "from here): the file is truncated"
            )
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def integer(self, what: str, *, signed: bool = True, limit: int = 8) -> int:
        """One of dlib's variable-length integers of at most ``limit`` bytes."""
        start = self.pos
        control = self.take(1, what)[0]
        size = control & 0x0F
        if control & 0x70 or size > limit or (control & 0x80 and not signed):
            raise self.error(
                f"expected {what} (a dlib integer of at most {limit} bytes), found the "
                f"control byte {control:#04x}",
                at=start,
            )
        value = int.from_bytes(self.take(size, what), "little")
        return -value if control & 0x80 else value

    def count(self, what: str) -> int:
        """A non-negative integer: a size, a count or a dimension."""
        return self.integer(what, signed=False)

    def scalar(self, what: str) -> float:
        """A float written as ``float_details``: mantissa then exponent."""
        start = self.pos
        if self.pos < len(self.data) and self.data[self.pos] & 0x70:
            raise self.error(
                f"expected {what} as a binary float, found the byte {self.data[self.pos]:#04x} "
                "(dlib's old text encoding of floats is not supported)",
                at=start,
            )
        mantissa = self.integer(f"the mantissa of {what}")
        exponent = self.integer(f"the exponent of {what}", limit=2)
        if exponent in FLOAT_SPECIALS:
            return FLOAT_SPECIALS[exponent]
        try:
            return math.ldexp(float(mantissa), exponent)
        except OverflowError:
            raise self.error(f"{what} is out of the range of a double", at=start) from None

    def string(self, what: str, *, max_length: int = 256) -> str:
        """A length-prefixed ASCII string (dlib's version and type tags)."""
        start = self.pos
        length = self.count(f"the length of {what}")
        if length > max_length:
            raise self.error(f"expected {what}, found a string length of {length}", at=start)
        raw = self.take(length, what)
        if not all(32 <= b < 127 for b in raw):
            raise self.error(f"expected {what}, found the non-text bytes {raw[:16]!r}", at=start)
        return raw.decode("ascii")

    def string_ahead(self, prefix: bytes) -> bool:
        """Whether a string starting with ``prefix`` is at the cursor (the cursor stays).

        In a truncated file, True as long as the bytes there agree with ``prefix``, so that
        reading the string reports the truncation.
        """
        if self.pos >= len(self.data):
            return True
        control = self.data[self.pos]
        size = control & 0x0F
        if control & 0xF0 or size > 8:
            return False
        start = self.pos + 1 + size
        if start > len(self.data):
            return True
        length = int.from_bytes(self.data[self.pos + 1 : start], "little")
        if length < len(prefix):
            return False
        text = self.data[start : start + len(prefix)]
        return text == prefix[: len(text)]

    def boolean(self, what: str) -> bool:
        """A bool: the ASCII byte ``1`` or ``0``."""
        start = self.pos
        raw = self.take(1, what)
        if raw not in (b"0", b"1"):
            raise self.error(f"expected {what} (ASCII '0' or '1'), found {raw!r}", at=start)
        return raw == b"1"

    def version(self, expected: tuple[int, ...], what: str) -> int:
        """An integer version that must be one of ``expected``."""
        start = self.pos
        found = self.integer(f"the version of {what}")
        if found not in expected:
            raise self.error(f"expected {what} version {expected}, found {found}", at=start)
        return found

    def dims(self, what: str) -> tuple[int, int, int, int]:
        """The four dims of a tensor: num_samples, k, nr, nc."""
        n, k, nr, nc = (self.count(f"a dimension of {what}") for _ in range(4))
        return n, k, nr, nc

    def tensor(self, what: str) -> np.ndarray:
        """A resizable_tensor (version 2) as a flat float32 array."""
        self.version((TENSOR_VERSION,), what)
        n, k, nr, nc = self.dims(what)
        size = n * k * nr * nc
        raw = self.take(4 * size, f"the {size} float32 values of {what}")
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)

    def alias(self, what: str) -> tuple[int, int, int, int]:
        """An alias_tensor: only its dims are stored."""
        self.version((ALIAS_TENSOR_VERSION,), what)
        return self.dims(what)


_INPUT_NAMES: Final = ("input_rgb_image_sized", "input_rgb_image")
_COMPUTATIONAL: Final = "layer"
_MARKER: Final = "tag/skip"


class _NetReader:
    """Walks a serialized ``add_loss_layer<loss_metric_, ...>``."""

    def __init__(self, cursor: _Bytes):
        self.at = cursor

    def read(self) -> DlibNet:
        """The whole file: loss, layer versions, input, layer details, nothing after."""
        self.at.version((1,), "add_loss_layer")
        loss = self._loss()
        wrappers = self._wrappers()
        input_layer = self._input()
        layers: list[DlibLayer] = []
        innermost = len(wrappers) - 1
        for index in range(innermost, -1, -1):
            kind, version = wrappers[index]
            if kind == _MARKER:
                layers.append(TagOrSkip())
                continue
            layers.append(self._details())
            self._layer_state(over_input=index == innermost, version=version)
        if self.at.pos != len(self.at.data):
            raise self.at.error(
                f"expected the end of the file after the network, found "
                f"{len(self.at.data) - self.at.pos} more bytes"
            )
        return DlibNet(self.at.source, input_layer, tuple(layers), loss)

    def _loss(self) -> LossMetric:
        start = self.at.pos
        if not self.at.string_ahead(b"loss_"):
            found = self.at.data[start : start + 8].hex(" ")
            raise self.at.error(
                "expected a dlib DNN whose loss layer is loss_metric_ (a face-recognition "
                "network such as dlib_face_recognition_resnet_model_v1.dat), found the bytes "
                f"{found or '(none)'} where the loss layer's name should be: this is not a "
                "serialized dlib network (a shape predictor or another dlib object?)",
                at=start,
            )
        name = self.at.string("the loss layer name")
        if name == "loss_metric_":  # dlib's first version: margin and threshold hard-coded
            return LossMetric(0.1, 0.75)
        if name != "loss_metric_2":
            raise self.at.error(
                f"expected the loss layer loss_metric_ (a face-recognition network), found "
                f"{name!r}: this network is of another kind",
                at=start,
            )
        margin = self.at.scalar("the loss margin")
        threshold = self.at.scalar("the loss distance threshold")
        return LossMetric(margin, threshold)

    def _wrappers(self) -> list[tuple[str, int]]:
        """The layer versions from the output down, until the input layer's name."""
        wrappers: list[tuple[str, int]] = []
        while True:
            if self.at.string_ahead(b"input"):
                break
            start = self.at.pos
            version = self.at.integer("a layer version")
            if version == TAG_OR_SKIP_VERSION:
                wrappers.append((_MARKER, version))
            elif version in (LAYER_VERSION, *INPUT_LAYER_VERSIONS):
                wrappers.append((_COMPUTATIONAL, version))
            else:
                raise self.at.error(
                    f"expected a layer version ({TAG_OR_SKIP_VERSION} for a tag or skip "
                    f"layer, {LAYER_VERSION} for a layer, {INPUT_LAYER_VERSIONS} for the "
                    f"layer over the input) or the input layer, found {version}",
                    at=start,
                )
        if not wrappers or wrappers[-1][0] != _COMPUTATIONAL:
            raise self.at.error("expected a computational layer directly over the input layer")
        for kind, version in wrappers[:-1]:
            if kind == _COMPUTATIONAL and version != LAYER_VERSION:
                raise self.at.error(
                    f"expected layer version {LAYER_VERSION} above the first layer, found {version}"
                )
        return wrappers

    def _input(self) -> InputRGB:
        start = self.at.pos
        name = self.at.string("the input layer name")
        if name not in _INPUT_NAMES:
            raise self.at.error(f"expected the input layer {_INPUT_NAMES}, found {name!r}", start)
        r, g, b = (self.at.scalar(f"the {c} mean of the input") for c in ("red", "green", "blue"))
        size = None
        if name == "input_rgb_image_sized":
            size = (self.at.count("the input rows"), self.at.count("the input columns"))
        return InputRGB((r, g, b), size)

    def _layer_state(self, *, over_input: bool, version: int) -> None:
        """Skip what ``add_layer`` writes after its details (training state, not weights)."""
        for flag in ("this_layer_setup_called", "gradient_input_is_stale", "output_disabled"):
            self.at.boolean(flag)
        self.at.tensor("x_grad")
        self.at.tensor("cached_output")
        if over_input:
            self.at.tensor("grad_final")
            if version >= 3:
                self.at.count("the sample expansion factor")
        else:
            self.at.tensor("params_grad")

    def _details(self) -> DlibLayer:
        start = self.at.pos
        name = self.at.string("a layer type")
        if name in ("con_4", "con_5", "con_6"):
            return self._conv(name)
        if name in ("affine_", "affine_2"):
            return self._affine(name)
        if name in ("relu_", "relu_2"):
            return Relu(self.at.boolean("relu disabled") if name == "relu_2" else False)
        if name in ("max_pool_2", "avg_pool_2"):
            kernel = (self.at.count("pool rows"), self.at.count("pool columns"))
            stride = (self.at.count("pool stride y"), self.at.count("pool stride x"))
            padding = (self.at.count("pool padding y"), self.at.count("pool padding x"))
            return Pool("max" if name.startswith("max") else "avg", kernel, stride, padding)
        if name == "add_prev_":
            return AddPrev()
        if name in ("fc_2", "fc_3"):
            return self._fc(name)
        raise self.at.error(
            f"found the layer type {name!r}; this reader knows con_4-6, affine_(2), relu_(2), "
            "max_pool_2, avg_pool_2, add_prev_ and fc_2-3 (batch-norm layers must be "
            "converted to affine_ first, as dlib does for inference)",
            at=start,
        )

    def _conv(self, name: str) -> Conv:
        params = self.at.tensor("the convolution parameters")
        num_filters = self.at.count("the number of filters")
        kernel = (self.at.count("the filter rows"), self.at.count("the filter columns"))
        stride = (self.at.count("the stride y"), self.at.count("the stride x"))
        padding = (self.at.count("the padding y"), self.at.count("the padding x"))
        out_ch, in_ch, nr, nc = self.at.alias("the filters")
        _, bias_k, bias_nr, bias_nc = self.at.alias("the biases")
        for what in ("learning rate", "weight decay", "bias learning rate", "bias weight decay"):
            self.at.scalar(f"the {what} multiplier")
        if name in ("con_5", "con_6"):
            self.at.boolean("use_bias")
        if name == "con_6" and self.at.boolean("use_relu"):
            raise self.at.error("found a convolution with a fused relu (con_6 use_relu)")
        filters = out_ch * in_ch * nr * nc
        biases = bias_k * bias_nr * bias_nc
        if params.size != filters + biases or (nr, nc) != kernel or out_ch != num_filters:
            raise self.at.error(
                f"expected {num_filters} filters of {kernel} ({filters} values) and "
                f"{biases} biases, found filters {(out_ch, in_ch, nr, nc)} and "
                f"{params.size} convolution parameters"
            )
        weight = params[:filters].reshape(out_ch, in_ch, nr, nc)
        return Conv(kernel, stride, padding, weight, params[filters:] if biases else None)

    def _affine(self, name: str) -> Affine:
        params = self.at.tensor("the affine parameters")
        gamma_dims = self.at.alias("gamma")
        beta_dims = self.at.alias("beta")
        mode = self.at.integer("the affine mode")
        disabled = self.at.boolean("affine disabled") if name == "affine_2" else False
        _, k, nr, nc = gamma_dims
        size = k * nr * nc
        if beta_dims != gamma_dims or (not disabled and params.size != 2 * size):
            raise self.at.error(
                f"expected gamma and beta of {gamma_dims} in {2 * size} parameters, found "
                f"beta {beta_dims} and {params.size} parameters"
            )
        shape = (k,) if mode == CONV_MODE else (k, nr, nc)
        if disabled:
            empty = np.zeros(0, dtype=np.float32)
            return Affine("conv" if mode == CONV_MODE else "fc", True, empty, empty)
        gamma = params[:size].reshape(shape)
        beta = params[size:].reshape(shape)
        return Affine("conv" if mode == CONV_MODE else "fc", False, gamma, beta)

    def _fc(self, name: str) -> Fc:
        outputs = self.at.count("the number of outputs")
        inputs = self.at.count("the number of inputs")
        params = self.at.tensor("the fully connected parameters")
        weight_dims = self.at.alias("the weights")
        _, bias_k, bias_nr, bias_nc = self.at.alias("the biases")
        bias_mode = self.at.integer("the bias mode")
        for what in ("learning rate", "weight decay", "bias learning rate", "bias weight decay"):
            self.at.scalar(f"the {what} multiplier")
        use_bias = self.at.boolean("use_bias") if name == "fc_3" else True
        has_bias = bias_mode != FC_NO_BIAS and use_bias
        expected = inputs * outputs + (outputs if has_bias else 0)
        if params.size != expected or weight_dims != (inputs, outputs, 1, 1):
            raise self.at.error(
                f"expected {expected} fully connected parameters ({inputs} inputs, {outputs} "
                f"outputs), found {params.size} with weights {weight_dims}"
            )
        weight = np.ascontiguousarray(params[: inputs * outputs].reshape(inputs, outputs).T)
        return Fc(weight, params[inputs * outputs :] if has_bias else None)
