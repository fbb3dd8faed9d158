"""What a decoding program (keras-hub's ``generate``) needs changed so DTensor runs it.

keras-hub's samplers and cached attention update tensors in place inside a ``while`` loop,
and draw tokens with TensorFlow's stateless multinomial sampler. DTensor (TF 2.21) has no
layout propagation for either op it lowers to, even with every input replicated: the
program fails to compile ("'tf.XlaDynamicUpdateSlice' op does not implement layout
propagation", then the same for ``tf.StatelessMultinomial``). Two changes, each registered:

* ``slice_update_as_select`` (during a decoding call, on the calling thread): Keras 3's
  TensorFlow ``slice_update`` (``dynamic_update_slice``, which lowers to
  ``XlaDynamicUpdateSlice``) is written as a select between the input and the update padded
  to the input's shape. Both are element-wise or padding ops that DTensor lays out like the
  input, so a key/value cache keeps the layout DTensor gives it (split over the batch, or
  over heads) instead of being gathered. Start indices are clamped as XLA clamps them, so the
  values are the same bits.
* ``dtensor_replicated_ops`` (process-wide): ops listed in ``REPLICATED_OPS`` are enrolled in
  DTensor's default replicated expansion (its ``DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_<OP>``
  switch, read at each compile): DTensor gathers their inputs and runs the op whole on every
  device. A stateless random op run so draws exactly one device's values (the same seed and
  counter on every device; checked in tests/test_generation.py). The ops listed work on
  small tensors in decoding (a batch of next-token probabilities), where a gather is cheap.

And one to keras-hub's class, so a model no step prepared is still decoded on the mesh:

* ``generate_before_plan`` (process-wide, while a TofuStrategy is alive): keras-hub's
  ``CausalLM.make_generate_function`` hands a model made in a TofuStrategy's scope to the
  strategy first (``hold_generate_router``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

import tensorflow as tf

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change

SELECT_CHANGE = change("slice_update_as_select")
REPLICATED_CHANGE = change("dtensor_replicated_ops")

# DTensor's switch, one per op: its MLIR name, upper-cased (tensorflow/dtensor/cc/dtensor_utils.cc).
REPLICATED_ENV_PREFIX = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_"

# Ops a decoding step runs that DTensor cannot lay out, each run replicated. StatelessMultinomial:
# keras.random.categorical, which the top-k, top-p and random samplers draw with.
REPLICATED_OPS = ("tf.StatelessMultinomial",)


def replicated_op_switch(op_name: str) -> str:
    """The environment variable that enrolls ``op_name`` (``"tf.StatelessMultinomial"``) in
    DTensor's default replicated expansion."""
    return REPLICATED_ENV_PREFIX + op_name.upper()


def enroll_replicated_ops(op_names=REPLICATED_OPS) -> tuple[str, ...]:
    """Enroll ``op_names`` in DTensor's replicated expansion for this process (the change
    ``dtensor_replicated_ops``); the ops newly enrolled. A switch the user set is left as set."""
    enrolled = []
    for name in op_names:
        switch = replicated_op_switch(name)
        if switch not in os.environ:
            os.environ[switch] = "1"
            enrolled.append(name)
    return tuple(enrolled)


def slice_update_as_select(inputs, start_indices, updates):
    """``keras.ops.slice_update(inputs, start_indices, updates)`` without ``XlaDynamicUpdateSlice``:
    ``updates`` padded to ``inputs``' shape at the start indices, selected where it lands. The
    starts are clamped into ``[0, size - update size]`` per dimension, as XLA's
    ``DynamicUpdateSlice`` clamps them."""
    inputs = tf.convert_to_tensor(inputs)
    updates = tf.cast(tf.convert_to_tensor(updates), inputs.dtype)
    if isinstance(start_indices, (list, tuple)):
        starts = tf.stack([tf.cast(tf.convert_to_tensor(start), tf.int32) for start in start_indices])
    else:
        starts = tf.cast(tf.convert_to_tensor(start_indices), tf.int32)
    size = tf.shape(inputs, out_type=tf.int32)
    update_size = tf.shape(updates, out_type=tf.int32)
    starts = tf.clip_by_value(starts, 0, size - update_size)
    paddings = tf.stack([starts, size - starts - update_size], axis=1)
    landed = tf.pad(tf.ones(update_size, tf.int8), paddings) > 0
    return tf.where(landed, tf.pad(updates, paddings), inputs)


def _keras3_slice_update():
    from keras.src.backend.tensorflow import core
    return core, "slice_update"


_SLICE_UPDATE = patching.ThreadScopedPatch(SELECT_CHANGE, _keras3_slice_update)


@contextlib.contextmanager
def slice_updates_as_selects() -> Iterator[None]:
    """While active, Keras 3's ``slice_update`` traced on this thread is
    ``slice_update_as_select``; other threads trace Keras' own."""
    def select(original, inputs, start_indices, updates):
        del original
        return slice_update_as_select(inputs, start_indices, updates)

    with _SLICE_UPDATE.active(select):
        yield


def _keras_hub_causal_lm():
    if "keras_hub" not in sys.modules:        # a user without keras-hub does not pay its import
        return None
    from keras_hub.src.models import causal_lm
    return causal_lm.CausalLM, "make_generate_function"


def _routed_to_the_strategy(original: Callable) -> Callable:
    def make_generate_function(self):
        extended = getattr(getattr(self, "_distribute_strategy", None), "extended", None)
        if hasattr(extended, "prepare_generation") and "_tofu_generation" not in vars(self):
            extended.prepare_generation(self)         # wraps this model's make_generate_function
            if vars(self).get("_tofu_generation"):
                return self.make_generate_function()
        return original(self)
    return make_generate_function


GENERATE_ROUTER = patching.HeldPatch(change("generate_before_plan"), _keras_hub_causal_lm, _routed_to_the_strategy)


def hold_generate_router(strategy) -> None:
    """While ``strategy`` is alive, a keras-hub text generator made in a TofuStrategy's scope
    that no step prepared yet (a model built or loaded under the scope, asked to ``generate``
    before any ``fit``) is handed to its strategy at its first ``make_generate_function``, which
    wraps it as a step would (``tofu_tf.strategies.generation``) and plans it from the first
    prompts. Without it the decoding program read the variables the plan had not made yet
    (a reshape of a 0-element tensor deep in the first layer). Other models call keras-hub's
    own. Installed once keras-hub is imported (``GENERATE_ROUTER.refresh()``)."""
    GENERATE_ROUTER.hold(strategy)
