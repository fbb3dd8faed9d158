"""A model axis does not split the batch: which tensors carry it (``GraphIndex.batch_dims``).

The planner keeps a model axis off every dim that carries the batch (``problem._splits_the_batch``):
DTensor splits an activation only as its operands arrive split, so with the batch inputs whole on
that axis such a split never runs. Which dims carry the batch was read with a strict rule: an op's
output carried it only when every input the op's strategy splits carried it too, so an op reading
the batch beside a same-shaped tensor made from constants (an attention mask's select, the loss
gradient's scale) hid its output and everything after it. The planner then split those tensors'
batch on the model axis, priced collectives DTensor never ran (bench/executed.py: Mixtral's model=8
plan 140 KiB of all-gathers and 875 KiB of all-reduces a step where DTensor ran 672 KiB of
all-reduces; the MLP's plan an all-reduce of two bias gradients computed from batch slices).
"""

import keras
import tensorflow as tf

from tofu_tf import hub_models, models
from tofu_tf.search import plan_graph
from tofu_tf.tf.capture import capture_training_step

BATCH = 16


def _moved(plan):
    return {kind: cost.bytes for kind, cost in plan.comm_by_collective.items() if cost.bytes}


def test_a_wide_mlp_plan_all_reduces_only_its_row_parallel_partial_sums():
    """model=8: the first Dense column-parallel, the second row-parallel; one all-reduce of the
    second's partial sums (batch x width floats, a ring's 2(n-1)/n of them sent per device), and no
    reduction of bias gradients computed from batch slices the model axis never made."""
    model = models.mlp(input_dim=256, width=1024, depth=2)
    graph = capture_training_step(model, batch_size=BATCH, loss="sparse_categorical_crossentropy",
                                  optimizer="adam")
    plan = plan_graph(graph, num_devices=8, hardware="cpu-virtual")
    assert dict(plan.mesh_shape) == {"model": 8}, plan.mesh_shape
    assert _moved(plan) == {"all-reduce": 2 * 7 / 8 * BATCH * 1024 * 4}, _moved(plan)


def test_a_mixture_of_experts_plan_moves_only_what_dtensor_moves():
    """keras-hub Mixtral at width 64 under the planner's plan on a mesh of one 8-device axis, which
    splits the model (its free choice on the CPU profile is data parallelism since its price counts
    the all-reduces DTensor combines: tests/test_cost_combining.py): DTensor runs all-reduces only
    (bench/executed.py); the plan priced all-gathers of batch tensors it had split on the model axis
    after the attention mask's select."""
    family = hub_models.FAMILIES["mixtral"]
    model = family.build(64)
    x, y = hub_models.data(family, BATCH)
    features = tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)), x)
    graph = capture_training_step(model, batch_size=BATCH, optimizer="adam", features=features,
                                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                  labels=tf.TensorSpec(y.shape, tf.as_dtype(y.dtype)))
    plan = plan_graph(graph, num_devices=8, hardware="cpu-virtual", mesh_shape={"model": 8})
    assert any(layout != (None,) * len(layout) for layout in plan.variable_layouts.values())
    assert set(_moved(plan)) == {"all-reduce"}, _moved(plan)
