"""``tf.scan`` over a static number of elements unrolled while the strategy's model is called.

This module owns the change "scans_unrolled": while a model the strategy prepared is called
(``tofu_tf.tf.compat.slices`` wraps the call and enters ``scans_unrolled``), on the calling
thread only, ``tf.scan`` over elements whose leading dim is static runs ``fn`` once per
element in a Python loop and stacks the accumulators, as an unrolled Keras RNN does. A scan
of unknown length, and every scan outside the model's call or on another thread, is
TensorFlow's. It changes nothing else (``keras.ops.scan``, ``tf.map_fn``, ``tf.while_loop``
keep their loops).

Why: TensorFlow runs a scan as a ``While`` loop over TensorLists, which TF 2.21's DTensor
cannot lay out, not even replicated (``TensorListStack``, ``tofu_tf.search.dtensor_support``):
a recurrence written with ``tf.scan`` in a layer failed in the first step, then was refused
before it. Unrolled, ``fn`` computes the same ops on the same values, step by step, and
``tf.stack`` gathers them; the trip count of a strategy-planned step is always static.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import tensorflow as tf

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change


def _functional_scan():
    from tensorflow.python.ops import functional_ops
    return functional_ops, "scan"          # tf.scan (scan_v2) calls it by this module-level name


_SCAN = patching.ThreadScopedPatch(change("scans_unrolled"), _functional_scan)


@contextlib.contextmanager
def scans_unrolled() -> Iterator[None]:
    """While active, ``tf.scan`` over a static number of elements on this thread is unrolled."""
    with _SCAN.active(_unrolled_scan):
        yield


def _unrolled_scan(original, fn, elems, initializer=None, parallel_iterations=10, back_prop=True,
                   swap_memory=False, infer_shape=True, reverse=False, name=None):
    flat = [tf.convert_to_tensor(e) for e in tf.nest.flatten(elems)]
    lengths = {e.shape[0] if e.shape.rank else None for e in flat}
    if len(lengths) != 1 or None in lengths or not next(iter(lengths)):
        return original(fn, elems, initializer=initializer, parallel_iterations=parallel_iterations,
                        back_prop=back_prop, swap_memory=swap_memory, infer_shape=infer_shape, reverse=reverse,
                        name=name)
    n = next(iter(lengths))
    with tf.name_scope(name or "scan"):
        steps = [tf.nest.pack_sequence_as(elems, [e[i] for e in flat]) for i in range(n)]
        order = list(range(n - 1, -1, -1) if reverse else range(n))
        outputs = {}
        if initializer is None:       # tf.scan: the first element is the first accumulator
            accumulator = steps[order[0]]
            outputs[order[0]] = accumulator
            order = order[1:]
        else:
            accumulator = initializer
        for i in order:
            accumulator = fn(accumulator, steps[i])
            outputs[i] = accumulator
        return tf.nest.map_structure(lambda *xs: tf.stack(xs), *[outputs[i] for i in range(n)])
