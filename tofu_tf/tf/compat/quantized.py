"""Keras 3's quantized models (``model.quantize("int8")``) under TofuStrategy.

Quantizing replaces each quantized layer's float kernel by an int8 kernel and a float scale,
both new variables, and the layer's call then multiplies int8 by int8 into int32. Two things
stop DTensor there, and this module owns both:

* **The int8 matmul.** Keras' TensorFlow backend computes ``matmul`` and ``einsum`` of two int8
  tensors as ``tf.matmul(a, b, output_type=int32)``, a ``BatchMatMulV3``, which DTensor has no
  layout propagation for (TF 2.21: "'tf.BatchMatMulV3' op does not implement layout
  propagation"), whatever the layouts. ``exact_int8_matmuls()`` (the change
  ``int8_matmul_exact``) computes that product in a float type instead, which DTensor splits
  like any matmul: each product of two int8 values is an integer of at most 2^14 in magnitude,
  so every partial sum of ``k`` of them is an integer below ``k * 2^14``, exact in float32 while
  that stays under 2^24 (float32's integer range; ``k <= 1024``) and in float64 beyond (2^53);
  a split contraction adds exact integers. The result, cast to int32, is the int32 one device's
  ``BatchMatMulV3`` returns, bit for bit. It is in force on the thread running a strategy step
  (``strategy.run``), only for int8 x int8 operands; every other matmul, and every other thread,
  calls Keras' own.
* **The new variables' layouts.** ``quantize_in_scope`` (the change ``quantize_in_scope``) makes
  ``model.quantize`` create the new variables through the strategy (in or out of its scope,
  as the user called it; out of it they were plain host variables beside the mesh's), and tells
  the strategy what layout each should take (``new_variable_layout``): the int8 kernel its float
  kernel's layout (same shape), and its scale the kernel's split on the dims it shares with the
  kernel (Dense: the output units), replicated where that match is ambiguous (a square kernel):
  a layout changes where values live, never what a step computes.

``"int8"`` and ``"float8"`` (whose kernels stay float, with scalar scales) run so. ``int4`` is
refused before any layer changes (Keras packs two int4 values per byte from the kernel read whole
as numpy, which a sharded kernel is not: "Trying to copy a non-single-device and non-replicated
DTensor"), as are ``gptq`` and ``awq`` (calibrated on data, layer by layer, outside any step); the
error names int8, or quantizing a one-device copy (``tofu_tf.one_device_copy(model)``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import tensorflow as tf
from absl import logging

from tofu_tf.errors import TofuError
from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import Applied, change

SUPPORTED_MODES = ("int8", "float8")
# Partial sums of int8 x int8 products stay integers below this in float32 (2^24 / 2^14).
_FLOAT32_EXACT_CONTRACTION = 1 << 10


class QuantizationModeError(TofuError, NotImplementedError):
    """A quantization TofuStrategy does not run on its mesh (a mode, or weights quantized off it)."""


def _keras_numpy(name: str):
    def locate():
        from keras.src.backend.tensorflow import numpy as keras_numpy
        return keras_numpy, name
    return locate


_INT8 = change("int8_matmul_exact")
_MATMUL = patching.ThreadScopedPatch(_INT8, _keras_numpy("matmul"))
_EINSUM = patching.ThreadScopedPatch(_INT8, _keras_numpy("einsum"))


def _is_dense_int8(value) -> bool:
    if isinstance(value, tf.SparseTensor):
        return False
    try:
        return tf.as_dtype(getattr(value, "dtype", None)) == tf.int8
    except TypeError:
        return False


def _exact_float(contraction: int | None) -> tf.DType:
    """The float type in which int8 x int8 sums over ``contraction`` terms are exact integers."""
    return tf.float32 if contraction is not None and contraction <= _FLOAT32_EXACT_CONTRACTION else tf.float64


def _matmul(original, x1, x2):
    if not (_is_dense_int8(x1) and _is_dense_int8(x2)) or len(x1.shape) < 2 or len(x2.shape) < 2:
        return original(x1, x2)
    dtype = _exact_float(x1.shape[-1])
    return tf.cast(original(tf.cast(x1, dtype), tf.cast(x2, dtype)), tf.int32)


def _contraction(subscripts: str, operands) -> int | None:
    """How many products one output element of the einsum sums; None when it cannot be read."""
    if "->" not in subscripts or "." in subscripts:
        return None
    inputs, output = subscripts.replace(" ", "").split("->")
    sizes: dict[str, int] = {}
    for term, operand in zip(inputs.split(","), operands):
        for letter, size in zip(term, operand.shape):
            if size is None:
                return None
            sizes.setdefault(letter, int(size))
    total = 1
    for letter in set(sizes) - set(output):
        total *= sizes[letter]
    return total


def _einsum(original, subscripts, *operands, **kwargs):
    if kwargs or not operands or not all(_is_dense_int8(x) for x in operands):
        return original(subscripts, *operands, **kwargs)
    dtype = _exact_float(_contraction(subscripts, operands))
    return tf.cast(original(subscripts, *[tf.cast(x, dtype) for x in operands]), tf.int32)


@contextlib.contextmanager
def exact_int8_matmuls() -> Iterator[None]:
    """While active, on this thread, Keras' int8 x int8 ``matmul``/``einsum`` are computed in an
    exact float type and cast to int32 (see the module docstring); other threads call Keras' own."""
    with _MATMUL.active(_matmul), _EINSUM.active(_einsum):
        yield


# -- model.quantize under the strategy ---------------------------------------------------------

class _Hints(threading.local):
    """The layouts the variables a layer's ``quantize`` makes should take, on this thread: by the
    leaf name of the layer's weight they replace or scale, its (shape, sharding specs)."""

    def __init__(self):
        self.weights: dict[str, tuple[tuple, tuple]] | None = None


_HINTS = _Hints()


def new_variable_layout(path: str, shape) -> tuple | None:
    """The sharding specs (``dtensor.UNSHARDED`` or a mesh axis per dim) for a variable made at
    ``path`` while a layer is being quantized under the strategy; None otherwise (the plan's
    rule applies). The int8 kernel keeps its float kernel's specs; a scale (``<leaf>_scale``)
    takes the kernel's split on each dim it shares with it (matched by size, where exactly one
    dim of each has that size), and is replicated elsewhere."""
    weights = _HINTS.weights
    if weights is None:
        return None
    leaf = path.rsplit("/", 1)[-1]
    shape = tuple(int(d) for d in shape)
    if leaf in weights and weights[leaf][0] == shape:
        return weights[leaf][1]
    if not leaf.endswith("_scale") or leaf[: -len("_scale")] not in weights:
        return None
    kernel_shape, kernel_specs = weights[leaf[: -len("_scale")]]
    from tensorflow.experimental import dtensor
    specs = [dtensor.UNSHARDED] * len(shape)
    for size, axis in zip(kernel_shape, kernel_specs):
        if axis == dtensor.UNSHARDED or kernel_shape.count(size) != 1 or shape.count(size) != 1:
            continue
        specs[shape.index(size)] = axis
    return tuple(specs)


def _weight_layouts(layer) -> dict[str, tuple[tuple, tuple]]:
    out = {}
    for weight in getattr(layer, "weights", ()):
        variable = getattr(weight, "value", weight)
        layout = getattr(variable, "layout", None)
        if layout is not None:
            out[weight.name.split("/")[-1].split(":")[0]] = (tuple(int(d) for d in weight.shape),
                                                             tuple(layout.sharding_specs))
    return out


@contextlib.contextmanager
def _layer_hints(layer) -> Iterator[None]:
    saved = _HINTS.weights
    _HINTS.weights = _weight_layouts(layer)
    try:
        yield
    finally:
        _HINTS.weights = saved


def _hinting_quantize(layer):
    original = layer.quantize

    def quantize(*args, **kwargs):
        with _layer_hints(layer):
            return original(*args, **kwargs)
    return quantize


def install(model, strategy) -> Applied | None:
    """Make ``model.quantize`` run under ``strategy``: its new variables made through the strategy
    with the layouts ``new_variable_layout`` gives, and modes other than int8 refused before any
    layer changes. Keras 3 only (tf-keras has no ``quantize``); once per model."""
    if getattr(model, "_tofu_quantize", False) or getattr(type(model), "quantize", None) is None \
            or any(base.__module__.startswith("tf_keras") for base in type(model).__mro__):
        return None
    quantized_layers = [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
                        if getattr(layer, "quantization_mode", None)]
    off_mesh = [weight.path for layer in quantized_layers for weight in layer.weights
                if not strategy.extended.variable_created_in_scope(weight.value)]
    if off_mesh:
        raise QuantizationModeError(
            f"{model.name} was quantized outside strategy.scope() before TofuStrategy first saw it: its quantized "
            f"weights ({', '.join(off_mesh[:3])}) are host variables the plan cannot lay out. Quantize it inside "
            "strategy.scope(), or after its first fit (or strategy.plan_model), when TofuStrategy makes them.")
    original = model.quantize

    def quantize(mode=None, *args, **kwargs):
        if mode not in SUPPORTED_MODES:
            raise QuantizationModeError(
                f"{model.name}.quantize({mode!r}) under TofuStrategy: only {' and '.join(SUPPORTED_MODES)} run on "
                "the strategy's mesh (their kernels keep their layouts; int4 packs a kernel read whole, which a "
                "sharded kernel is not, and gptq/awq calibrate outside any step). Quantize with 'int8', or "
                "quantize a one-device copy: copy = tofu_tf.one_device_copy(model); copy.quantize(mode).")
        layers = [layer for layer in model._flatten_layers() if hasattr(type(layer), "quantize")]  # pylint: disable=protected-access
        for layer in layers:
            layer.__dict__["quantize"] = _hinting_quantize(layer)   # past Keras' attribute tracking
        try:
            with strategy.scope():
                result = original(mode, *args, **kwargs)
        finally:
            for layer in layers:
                layer.__dict__.pop("quantize", None)
        logging.info("TofuStrategy: %s quantized (%s); int8 kernels keep their float kernels' layouts",
                     model.name, mode)
        return result

    model.__dict__["quantize"] = quantize
    model.__dict__["_tofu_quantize"] = True
    return Applied(change("quantize_in_scope"), model.name, "quantize makes its variables through the strategy")
