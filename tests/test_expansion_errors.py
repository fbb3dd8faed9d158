"""DTensor's refusal to compile a planned step is raised as ``PlanNotRunnableError``, naming
the op, its layers, the plan's mesh and what to try, not as a page of MLIR.

keras-hub Gemma planned under 40% of its data-parallel peak (mesh model=4 x model1=2) failed in
its first step with DTensor's ``UnknownError`` ("SPMD expansion resulted in op output
inconsistent with the provided layout"): propagation carried a head split onto the stacked dim
of the rotary embedding's ``tf.stack``. That case runs in a child process (DTensor's state after
a refused program is not this suite's to share).
"""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tofu_tf.strategies import expansion_errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# DTensor's text for the Gemma case (TF 2.21), its mesh's device list shortened.
_REFUSAL = (
    "/tmp/train.py:35:1: error: SPMD expansion resulted in op output inconsistent with the provided layout. "
    "Expected shape: <8,8,1,4,8> got shape: <8,8,1,2,8>\n"
    '<unknown>:0: note: loc(fused["StatefulPartitionedCall:", "eager_operation"]): called from\n'
    '/tmp/train.py:35:1: note: see current operation: %1295 = "tf.Pack"(%1294, %1289) <{axis = -2 : i64}> '
    '{_global_shape = [#tf_type.shape<8x8x1x2x8>], _layout = ["sharding_specs:unsharded,unsharded,unsharded,'
    'model1,unsharded, mesh:|model=4,model1=2|0,1,2,3,4,5,6,7|0,1,2,3,4,5,6,7|/job:localhost/replica:0/task:0/'
    'device:CPU:0"]} : (tensor<8x8x1x8xf32>, tensor<8x8x1x8xf32>) -> tensor<8x8x1x2x8xf32>\n')


def _explain(error, op_layers=None):
    return expansion_errors.explained(error, model_name="gemma", kind="train", mesh_text="(model=4, model1=2)",
                                      budget_text="213.94 KiB", op_layers=op_layers)


def test_a_refused_layout_names_the_op_its_layout_its_layers_the_mesh_and_what_to_try():
    layers = expansion_errors.OpLayers({("Pack", (8, 8, 1, 2, 8)): ("rotary_embedding", "rotary_embedding_1")})
    error = _explain(tf.errors.UnknownError(None, None, _REFUSAL), layers)
    assert isinstance(error, expansion_errors.PlanNotRunnableError)
    text = str(error)
    for part in ("train step of 'gemma'", "(model=4, model1=2)", "213.94 KiB", "a Pack op of global shape (8, 8, 1, 2, 8)",
                 "in layer 'rotary_embedding' or 'rotary_embedding_1'",
                 "as (unsharded, unsharded, unsharded, model1, unsharded)", "SPMD expansion resulted",
                 "no weight changed", "memory_budget_bytes", "mesh_shape="):
        assert part in text, part
    assert "sharding_specs" not in text and "/job:" not in text


def test_layouts_in_the_reason_are_shown_without_their_device_lists():
    reason = ("/tmp/train.py:3:1: error: EmitAllScatter was passed a desired_layout sharding_specs:unsharded,"
              "unsharded, mesh:|model=8|0,1,2,3,4,5,6,7|0,1,2,3,4,5,6,7|/job:localhost/replica:0/task:0/device:CPU:0 "
              "which was not more sharded than the original_layout sharding_specs:model,unsharded, mesh:|model=8|"
              "0,1|0,1|/job:localhost/replica:0/task:0/device:CPU:0\n")
    text = str(_explain(tf.errors.UnknownError(None, None, reason)))
    assert ("EmitAllScatter was passed a desired_layout (unsharded, unsharded) which was not more sharded than "
            "the original_layout (model, unsharded)") in text, text
    assert "/job:" not in text


def test_other_errors_pass_through():
    assert _explain(tf.errors.UnknownError(None, None, "error: the file system is full")) is None
    assert _explain(tf.errors.UnknownError(None, None, "SPMD expansion, but no error line")) is None


def test_op_layers_come_from_the_captured_step(tiny_mlp_graph):
    layers = expansion_errors.OpLayers.of(tiny_mlp_graph)
    matmuls = [op for op in tiny_mlp_graph.ops if op.type == "MatMul" and op.layer]
    assert matmuls
    op = matmuls[0]
    assert op.layer in layers.layers("MatMul", tuple(tiny_mlp_graph.tensors[op.outputs[0]].shape))


_GEMMA_UNDER_40_PERCENT_OF_ITS_PEAK = """
from tofu_tf.tf import devices
devices.configure_virtual_cpus(8)
import keras, numpy as np, tensorflow as tf
from tofu_tf import hub_models
from tofu_tf.search import plan_graph
from tofu_tf.strategies import TofuStrategy
from tofu_tf.strategies.expansion_errors import PlanNotRunnableError
from tofu_tf.tf.capture import capture_training_step

family = hub_models.FAMILIES["gemma"]
x, y = hub_models.data(family, 8)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
keras.utils.set_random_seed(3)
reference = family.build(64)
spec = lambda a: tf.TensorSpec(a.shape, tf.as_dtype(a.dtype))
optimizer = lambda: keras.optimizers.SGD(0.05, momentum=0.9)
graph = capture_training_step(reference, batch_size=8, loss=loss, optimizer=optimizer(),
                              features=tf.nest.map_structure(spec, x), labels=spec(y))
budget = int(plan_graph(graph, num_devices=8, hardware="cpu-virtual").peak_memory_bytes * 0.4)
strategy = TofuStrategy(8, memory_budget_bytes=budget)
with strategy.scope():
    model = family.build(64)
    model.set_weights(reference.get_weights())
    model.compile(optimizer=optimizer(), loss=loss)
try:
    model.fit(x, y, batch_size=8, verbose=0)
except PlanNotRunnableError as error:
    print("REFUSED", error)
    same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), reference.get_weights()))
    print("WEIGHTS UNCHANGED", same)
print("MESH", strategy.plan.mesh_shape)
"""


@pytest.mark.slow
def test_gemma_under_40_percent_of_its_data_parallel_peak_is_refused_with_the_reason_and_keeps_its_weights():
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", "TOFU_PLAN_CACHE": "off"}
    out = subprocess.run([sys.executable, "-c", _GEMMA_UNDER_40_PERCENT_OF_ITS_PEAK], cwd=ROOT, capture_output=True,
                         text=True, env=env, timeout=600)
    tail = f"rc={out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert out.returncode == 0, tail
    if "MESH {'model': 4, 'model1': 2}" not in out.stdout:
        pytest.skip(f"the plan under this budget is no longer model=4 x model1=2; this case lost its plan:\n{tail}")
    assert "REFUSED DTensor cannot run the planned train step" in out.stdout, tail
    assert "a Pack op of global shape (8, 8, 1, 2, 8) in layer 'rotary_embedding" in out.stdout, tail
    assert "WEIGHTS UNCHANGED True" in out.stdout, tail
