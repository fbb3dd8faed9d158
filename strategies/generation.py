"""keras-hub's ``generate()`` on a model TofuStrategy planned: the decoding program on the mesh.

keras-hub compiles its own decoding program (``CausalLM.make_generate_function``: a
``tf.function`` of ``generate_step``, a key/value-cache ``while`` loop around the sampler)
and calls it itself, outside ``strategy.run``, on host tensors it made from the prompts. Its
variables are the plan's DTensor variables, so DTensor refused the call ("got a regular
tensor for input 0 ... but was expecting a DTensor"). Here the model's
``make_generate_function`` is wrapped (the change ``generate_function_placed``): the program
keras-hub makes is kept, and each call

* lays the prompts out on the plan's mesh replicated, so the decoding program runs with the
  weights where the plan put them: a weight the plan splits is never gathered whole for
  decoding, and the cache takes the layout DTensor propagates from the prompts and the weights.
  Not split over the batch axis: keras-hub's loop makes tensors whose batch dim is dynamic
  (``ones_like`` of the sampled tokens), and DTensor cannot split those to meet a split batch
  ("EmitAllScatter requires slice on input axis 0 which is dynamic"): a GPT-2 trained data
  parallel failed there at its first ``generate`` of 8 prompts. Each device so decodes every
  prompt (the work of the batch axis repeated; the memory of the prompts, not of the weights),
  and the layers' input hints keep the batch whole too (``compat.layers.batch_whole``);
* runs with Keras' ``slice_update`` written as a select of the padded update
  (``tofu_tf.tf.compat.keras_ops``): the cache's in-place update lowers to an op DTensor cannot
  lay out; the sampler's multinomial draw runs replicated (``tofu_tf.tf.compat.decoding``),
  drawing one device's values;
* is called with the options of the strategy's step programs (grappler off on CPU meshes,
  ``tofu_tf.tf.compat.calls``), and returns the tokens assembled on the host, where keras-hub's
  post-processing (``strip_prompt``, detokenizing) runs as on one device.

The decoding program is traced once per prompt shape and kept by keras-hub, as on one device;
``compile(sampler=...)`` clears it and the next ``generate`` wraps the new one.
"""

from __future__ import annotations

import sys
from typing import Callable

import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from tofu_tf import plan_check
from tofu_tf.errors import TofuError
from tofu_tf.strategies import batches as batches_lib
from tofu_tf.strategies import expansion_errors
from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf.compat import calls
from tofu_tf.tf.compat import decoding
from tofu_tf.tf.compat import keras_ops as compat_keras_ops
from tofu_tf.tf.compat import layers as compat_layers

CHANGE_NAME = "generate_function_placed"


def is_generating_model(model) -> bool:
    """Whether ``model`` is a keras-hub text generator (``CausalLM``, ``Seq2SeqLM``), whose
    ``generate()`` calls the decoding program this module places."""
    if "keras_hub" not in sys.modules:
        return False
    from keras_hub.src.models import causal_lm
    return isinstance(model, causal_lm.CausalLM)


def install(model, placer_of: Callable[[], "batches_lib.BatchPlacer"], plan_from_prompts: Callable[[object], None],
            *, optimize_graph: bool = True) -> bool:
    """Wrap ``model``'s ``make_generate_function`` (a keras-hub ``CausalLM`` or ``Seq2SeqLM``).
    ``placer_of()``: the strategy's batch placer once planned; ``plan_from_prompts(prompts)``:
    plans the model from a first batch of prompts when nothing planned it yet (a model
    loaded under the scope and asked to generate before any ``fit``). True when it changed
    the model (the change ``generate_function_placed``); False for a model that does not
    generate text, or one already wrapped."""
    if not is_generating_model(model) or getattr(model, "_tofu_generation", False):
        return False
    make_original = model.make_generate_function

    def make_generate_function():
        function = make_original()
        if isinstance(function, PlacedGeneration):
            return function
        placed = PlacedGeneration(function, placer_of, plan_from_prompts, optimize_graph=optimize_graph,
                                  model_name=model.name, sampler=getattr(model, "sampler", None))
        model.generate_function = placed
        return placed

    model.make_generate_function = make_generate_function
    model.generate_function = None           # a program made before the plan read no layouts
    model._tofu_generation = True  # pylint: disable=protected-access
    return True


class GenerationNotRunnableError(TofuError, RuntimeError):
    """DTensor refused to compile keras-hub's decoding program on the plan's layouts: nothing of
    it ran, no weight changed."""


class PlacedGeneration:
    """keras-hub's decoding program, called with its prompts on the mesh (see the module)."""

    def __init__(self, function, placer_of, plan_from_prompts, *, optimize_graph: bool, model_name: str,
                 sampler=None):
        self._function = function
        self._plan_from_prompts = plan_from_prompts
        self._sampler = sampler
        self._placer_of = placer_of
        self._optimize_graph = optimize_graph
        self._model_name = model_name
        self._logged = False

    @property
    def program(self):
        """The function keras-hub compiled (a ``tf.function`` unless ``run_eagerly``)."""
        return self._function

    def __call__(self, inputs, stop_token_ids=None):
        self._plan_from_prompts(inputs)
        placer = self._placer_of()
        enrolled = decoding.enroll_replicated_ops()
        if enrolled:
            logging.info("TofuStrategy: %s: ops DTensor cannot lay out run replicated in decoding: %s (%s)",
                         decoding.REPLICATED_CHANGE.name, ", ".join(enrolled), decoding.REPLICATED_CHANGE.why)
        if not self._logged:
            self._logged = True
            mesh = {name: placer.mesh.dim_size(name) for name in placer.mesh.dim_names}
            logging.info("TofuStrategy: %s generates with its prompts replicated on mesh %s (keras-hub's decoding "
                         "makes tensors of a dynamic batch size, which DTensor cannot split), the weights in their "
                         "planned layouts", self._model_name, mesh)
        moved = sampler_state_on_mesh(self._sampler, placer.mesh)
        if moved:
            logging.info("TofuStrategy: %s: the sampler's state (%s) moved onto the mesh, replicated",
                         self._model_name, ", ".join(moved))
        placed = tf.nest.map_structure(batches_lib.BatchPlacer(placer.mesh, batch_axis=None).place, inputs)
        with compat_keras_ops.dtensor_expandable_ops(), compat_layers.batch_whole(), \
                calls.step_call_options(self._optimize_graph):
            try:
                outputs = self._function(placed, stop_token_ids=stop_token_ids)
            except tf.errors.OpError as error:
                refused = expansion_errors.refusal(error)
                if refused is None:
                    raise
                raise self._not_runnable(refused, placer.mesh) from None
        return tf.nest.map_structure(batches_lib.to_host, outputs)

    def _not_runnable(self, refused: "expansion_errors.Refusal", mesh) -> GenerationNotRunnableError:
        """The refusal named, with the ways that work. The decoding program is not planned: it runs
        on the training plan's weight layouts, and keras-hub's key/value cache loop meets ops in
        layouts the training step never had (a Transpose of a head-split cache: "SPMD needs
        communication is not supported yet", keras-hub Gemma under its own layout map)."""
        shape = plan_check.mesh_text({name: mesh.dim_size(name) for name in mesh.dim_names})
        return GenerationNotRunnableError(
            f"DTensor cannot run keras-hub's decoding program of {self._model_name!r} on the plan's weight layouts "
            f"(mesh {shape}): its layout propagation laid out {refused.what}, which its SPMD expander refuses "
            f"(\"{refused.reason}\"). Nothing of it ran and no weight changed. Decoding runs on the weights where "
            "training placed them; to generate now, generate from a one-device copy, its weights assembled on the "
            "host: tofu_tf.strategies.export.one_device_copy(model).generate(...). A plan that splits fewer of "
            "the attention weights (no layout_map, or another mesh_shape) may decode on the mesh.")


def sampler_state_on_mesh(sampler, mesh: dtensor.Mesh) -> list[str]:
    """Move the variables of ``sampler`` (a keras-hub sampler: its ``SeedGenerator``'s state)
    that are not on ``mesh`` onto it, replicated, keeping their values; the names of those moved
    (``variables_lib.host_variable_on_mesh``). A sampler made outside ``strategy.scope()``
    (``compile(sampler=TopKSampler(seed=42))`` after training, as keras-hub's guides write it)
    holds a plain host variable, which each device advanced once per token."""
    return [variable.path if hasattr(variable, "path") else variable.name
            for variable in getattr(sampler, "variables", ()) or ()
            if variables_lib.host_variable_on_mesh(variable, mesh)]
