"""What a decoding program (keras-hub's ``generate``) needs changed so DTensor runs it.

keras-hub's samplers and cached attention update tensors in place inside a ``while`` loop,
and draw tokens with TensorFlow's stateless multinomial sampler. DTensor (TF 2.21) has no
layout propagation for either op it lowers to, even with every input replicated: the
program fails to compile ("'tf.XlaDynamicUpdateSlice' op does not implement layout
propagation", then the same for ``tf.StatelessMultinomial``). The changes, each registered:

* ``slice_update_as_select`` (while a decoding program is traced, on the calling thread; the
  change a step's trace makes too, ``tofu_tf.tf.compat.keras_ops``): Keras 3's TensorFlow
  ``slice_update`` (``dynamic_update_slice``, which lowers to ``XlaDynamicUpdateSlice``) is
  written as a select between the input and the update padded to its shape, with XLA's
  clamped starts, which DTensor lays out like the input, so a key/value cache keeps the layout
  DTensor gives it (split over the batch, or over heads); the values are the same bits. ``roll`` likewise (``roll_as_slices``).
* ``dtensor_replicated_ops`` (process-wide): ops listed in ``REPLICATED_OPS`` are enrolled in
  DTensor's default replicated expansion (its ``DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_<OP>``
  switch, read at each compile): DTensor gathers their inputs and runs the op whole on every
  device. A stateless random op run so draws exactly one device's values (the same seed and
  counter on every device; checked in tests/test_generation.py). The ops listed work on
  small tensors in decoding (a batch of next-token probabilities), where a gather is cheap.
  A training step's ops of ``tofu_tf.search.targets.ENROLLED_REPLICATED`` (``MatrixDiagV3``: a
  ``tf.eye`` too large for DTensor to fold, keras-hub Qwen3.5's) are enrolled the same way when a
  TofuStrategy plans a step holding one (``enroll_step_ops``); the planner keeps them replicated.

And one to keras-hub's class, so a model no step prepared is still decoded on the mesh:

* ``generate_before_plan`` (process-wide, while a TofuStrategy is alive): keras-hub's
  ``CausalLM.make_generate_function`` hands a model made in a TofuStrategy's scope to the
  strategy first (``hold_generate_router``).
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change

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


def enroll_step_ops(op_types) -> tuple[str, ...]:
    """Enroll the op types of ``op_types`` (a step's) that the planner keeps replicated for DTensor's
    replicated expansion (``tofu_tf.search.targets.ENROLLED_REPLICATED``); the ops newly enrolled."""
    from tofu_tf.search import targets
    return enroll_replicated_ops(tuple(f"tf.{op_type}" for op_type in sorted(targets.ENROLLED_REPLICATED & set(op_types))))


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
