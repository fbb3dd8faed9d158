"""Concatenations along the batch dimension inside a strategy step, gathered first.

A custom ``train_step`` may join tensors along the batch: keras.io's GAN feeds its discriminator
``tf.concat([generated_images, real_images], axis=0)`` and labels made the same way. The real
images arrive split over the plan's batch axis, and DTensor's concat expander refuses a
concatenation along a split dimension (TF 2.21: "Concat op SPMD with concat dimension in sharded
dimension is not supported"): the first step failed. While a strategy step runs
(``strategy.run``), on that thread, ``tf.concat`` along dimension 0 of floating-point tensors (values, not shapes: a shape
vector must stay a constant DTensor can read) of rank 1 or more, in a traced step,
relays its inputs and its result to a replicated layout on the strategy's mesh (the change
``batch_concat_gathered``): the inputs are gathered, joined as on one device, and the ops after it
split the result again as their own layouts ask (a slice, no communication). The values are one
device's; the cost is one gather of the joined tensors, which in such steps are a batch's
activations. Concatenations along other dimensions, and every other thread, are TensorFlow's own.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change


def _tf_concat():
    return tf, "concat"


_CONCAT = patching.ThreadScopedPatch(change("batch_concat_gathered"), _tf_concat)


def _static_axis(axis) -> int | None:
    try:
        return int(tf.get_static_value(axis)) if tf.is_tensor(axis) else int(axis)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def batch_concats_gathered(mesh: dtensor.Mesh) -> Iterator[None]:
    """While active, on this thread, ``tf.concat(values, 0)`` on ``mesh`` joins replicated values
    and returns a replicated result (see the module docstring)."""
    def concat(original, values, axis, name="concat"):
        if tf.executing_eagerly() or not isinstance(values, (list, tuple)) or not values:
            return original(values, axis, name=name)
        tensors = [tf.convert_to_tensor(value) for value in values]
        rank = tensors[0].shape.rank
        index = _static_axis(axis)
        if not rank or index is None or index not in (0, -rank) or not tensors[0].dtype.is_floating:
            return original(values, axis, name=name)
        replicated = dtensor.Layout.replicated(mesh, rank=rank)
        joined = original([dtensor.relayout(t, replicated) for t in tensors], axis, name=name)
        return dtensor.relayout(joined, replicated)

    with _CONCAT.active(concat):
        yield
