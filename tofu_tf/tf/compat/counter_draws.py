"""A tf-keras uniform initializer's value drawn shard by shard, by global index, as one device draws it.

tf-keras' ``RandomUniform`` and ``VarianceScaling(distribution="uniform")`` (Glorot, He and LeCun
uniform) draw with ``tf.random.stateless_uniform(shape, seed=[seed, 0])``: Philox, one 32-bit word
per float32 element, four elements per counter value, in the flat (row-major) order of the value.
The element at flat index ``k`` is therefore word ``k % 4`` of the counter advanced by ``k // 4``
(checked on TF 2.21: ``tests/test_initial_values.py``). A shard that is one contiguous run of the
flat value (a weight split by its first dimension only) is drawn on its own device from the
counter at its offset: the same bits as one device's whole draw, and no device ever holds more
than its shard. Drawn under a split layout instead, DTensor folds each device's coordinates into
the seed (another stream). Other layouts (a column split is one run per row) and other dtypes and
distributions are drawn whole on the host (``tofu_tf.tf.variables.materialize``).

What the initializer would draw (its shape, bounds and seed) is read by calling the initializer
with its generator's ``random_uniform`` replaced on that instance by a recorder that stops the
call before anything is drawn (the change "uniform_draws_by_index"): tf-keras' own arithmetic
computes the bounds, so a Glorot limit is the one it computes.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_stateless_random_ops_v2, random_ops_util

from tofu_tf.errors import TofuError
from tofu_tf.tf.compat.registry import change

_CHANGE = change("uniform_draws_by_index")
_ELEMENTS_PER_COUNTER = 4          # Philox: four 32-bit words per counter value, one per float32


@dataclasses.dataclass(frozen=True)
class UniformDraw:
    """``tf.random.stateless_uniform(shape, seed, minval, maxval, float32)``, as a tf-keras initializer calls it."""

    shape: tuple[int, ...]
    seed: tuple[int, int]
    minval: float
    maxval: float

    def flat_run(self, start: int, count: int) -> tf.Tensor:
        """The draw's flat elements ``start .. start + count``, drawn on the current device from
        the Philox counter at ``start``; the same bits as the whole draw's."""
        key, counter, alg = random_ops_util.get_key_counter_alg(tf.constant(self.seed, tf.int64), None)
        skip, lead = divmod(start, _ELEMENTS_PER_COUNTER)
        low, high = (int(word) for word in counter.numpy())
        low += skip
        high, low = (high + (low >> 64)) % (1 << 64), low % (1 << 64)     # a 128-bit counter: carry
        moved = tf.constant(np.array([low, high], dtype=np.uint64))
        words = gen_stateless_random_ops_v2.stateless_random_uniform_v2(
            [lead + count], key=key, counter=moved, dtype=tf.float32, alg=alg)[lead:]
        minval = tf.constant(self.minval, tf.float32)
        maxval = tf.constant(self.maxval, tf.float32)
        return words * (maxval - minval) + minval    # stateless_uniform's own arithmetic, op for op


class _Recorded(TofuError):
    """Internal: stops the initializer at its draw and carries the draw's arguments out (never
    reaches a user)."""

    def __init__(self, arguments):
        super().__init__("recorded")
        self.arguments = arguments


def uniform_draw(initial_value) -> UniformDraw | None:
    """What the tf-keras initializer bound in ``initial_value`` would draw, when it is one float32
    ``stateless_uniform`` draw of its seeded stateless generator; else None (drawn on the host)."""
    initializer = initial_value.func if isinstance(initial_value, functools.partial) else None
    if not _draws_uniform(initializer):
        return None
    generator = initializer._random_generator  # pylint: disable=protected-access
    if getattr(generator, "_rng_type", None) != getattr(generator, "RNG_STATELESS", object()):
        return None

    def record(shape, minval=0.0, maxval=None, dtype=None, nonce=None):
        raise _Recorded((shape, minval, maxval, dtype, nonce))

    generator.random_uniform = record              # this instance only, for this one call
    try:
        initial_value()
    except _Recorded as recorded:
        shape, minval, maxval, dtype, nonce = recorded.arguments
    else:
        return None                                # it drew nothing uniform
    finally:
        del generator.random_uniform
    if nonce or maxval is None or tf.as_dtype(dtype or tf.float32) != tf.float32:
        return None
    seed = generator.make_seed_for_stateless_op()
    return UniformDraw(tuple(int(d) for d in shape), (int(seed[0]), int(seed[1])), float(minval), float(maxval))


def _draws_uniform(initializer) -> bool:
    """A tf-keras initializer whose call is one ``random_uniform`` of its generator."""
    if initializer is None or not type(initializer).__module__.startswith("tf_keras."):
        return False
    import tf_keras
    kinds = tf_keras.initializers
    if isinstance(initializer, kinds.RandomUniform):
        return True
    return isinstance(initializer, kinds.VarianceScaling) and initializer.distribution == "uniform"
