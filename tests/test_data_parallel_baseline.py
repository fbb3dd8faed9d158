"""The data-parallel baseline plans what data parallelism runs (bench/executed.py --method=data_parallel).

Its plan is what ``TofuStrategy(method="data_parallel")`` lowers and what the planner's own plans
are compared with, so its modeled collectives should be DTensor's. They were not: the baseline let
no op run whole, so the reshapes after a kernel gradient's batch ``Sum`` had to split a tensor that
no longer carried the batch (keras-hub Llama: 168 KiB of all-gathers and 154 KiB of all-to-alls
modeled a step, none run; BERT likewise), and a BatchNormalization's moments could be computed
from their input moved to a split of its channels (the CNN: 28 KiB of all-to-alls modeled, none
run: DTensor all-reduces partial sums over the batch).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tofu_tf import hub_models, ir, models
from tofu_tf.search import plan_graph
from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf.capture import capture_training_step

BATCH = 16


def _captured_hub_step(name):
    family = hub_models.FAMILIES[name]
    model = family.build(32)
    x, y = hub_models.data(family, BATCH)
    features = tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)), x)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return capture_training_step(model, batch_size=BATCH, loss=loss, optimizer="adam", features=features,
                                 labels=tf.TensorSpec(y.shape, tf.as_dtype(y.dtype)))


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_a_kernel_gradients_reshapes_run_whole_after_its_all_reduce(name):
    """The plan moves gradients by all-reduce only, as DTensor runs them (bench/executed.py measured
    Llama's and BERT's data-parallel steps: all-reduces only, within 6% of these bytes)."""
    graph = _captured_hub_step(name)
    plan = plan_graph(graph, num_devices=8, method="data_parallel", hardware="cpu-virtual")
    moved = {kind: cost.bytes for kind, cost in plan.comm_by_collective.items() if cost.bytes}
    assert set(moved) == {"all-reduce"}, moved
    gradients = sum(t.num_bytes for t in graph.tensors.values() if t.role is ir.Role.GRADIENT)
    assert moved["all-reduce"] <= 2 * 7 / 8 * gradients * 1.1      # each gradient once, and little besides


@pytest.fixture(scope="module")
def cnn_data_parallel_plan():
    """The CNN's data-parallel plan as the strategy makes it (its BatchNormalization unfused)."""
    strategy = TofuStrategy(8, plan_cache=False, method="data_parallel")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(BATCH, 16, 16, 3)).astype("float32"), rng.integers(0, 10, BATCH)
    with strategy.scope():
        model = models.cnn(image_size=16, channels=8)
        model.compile(optimizer="adam", loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, verbose=0)
    return strategy.plan


def test_batch_normalization_moments_are_partial_sums_over_the_batch(cnn_data_parallel_plan):
    """Under the strategy (unfused BatchNormalization), data parallel: the moments' input stays
    split on the batch and their sums are partial, all-reduced; before, the plan moved the input
    to a split of its 8 channels (an all-to-all each way) to compute them per channel."""
    plan = cnn_data_parallel_plan
    means = [name for name in plan.op_strategies if name.endswith("bn_0/moments/mean")]
    assert len(means) == 1, sorted(plan.op_strategies)[:20]
    mean = plan.op_strategies[means[0]]
    assert means[0] + ":0" in plan.partial_tensors, (mean, plan.tensor_layouts.get(means[0] + ":0"))
    assert plan.comm_by_collective.get("all-to-all") is None or plan.comm_by_collective["all-to-all"].bytes < 1024


def test_batch_normalization_statistics_run_whole_after_their_all_reduce(cnn_data_parallel_plan):
    """After the moments' all-reduce, the per-channel statistics (the squeezes, the moving-average
    updates, the scale and offset folded with them) run whole on every device, as DTensor and
    MirroredStrategy run them: the plan moves tensors by all-reduce only. Before, the baseline let
    no op run whole, so it split those 8-channel tensors over the batch axis, a reduce-scatter after
    each moment and an all-gather before the normalization (bench/executed.py --models=cnn
    --method=data_parallel: modeled 10 collective runs, 5 run, none of them reduce-scatters or
    all-gathers); on the CPU profile their latencies priced data parallelism at twice its
    step, and the search's own plan, which gathers the first normalization's input instead,
    ranked ahead of it and measured slower (bench/vs_mirrored.py)."""
    plan = cnn_data_parallel_plan
    moved = {kind: cost.bytes for kind, cost in plan.comm_by_collective.items() if cost.bytes}
    assert set(moved) == {"all-reduce"}, moved
    squeezes = [name for name in plan.op_strategies if name.endswith("bn_0/moments/Squeeze")]
    assert len(squeezes) == 1, sorted(plan.op_strategies)[:20]
    assert plan.op_strategies[squeezes[0]] == ("replicate",)


def test_a_routers_top_k_gradient_is_captured_and_priced_as_the_step_runs_it():
    """keras-hub Mixtral's router: the strategy's step traces Keras 3's ``top_k`` with its gradient
    by comparison and ``one_hot`` as an equality (``tofu_tf.tf.compat.keras_ops``), and capture now
    traces them so too. Captured with the originals, ``top_k``'s gradient was a ``ScatterNd`` whose
    output, partial over the batch, was reshaped split: a reduce-scatter a layer priced (7 KiB and a
    2 ms latency each on the CPU profile) that DTensor never ran (bench/executed.py: 4 collective runs
    priced, 2 run)."""
    graph = _captured_hub_step("mixtral")
    kinds = graph.op_type_counts()
    assert "ScatterNd" not in kinds and "OneHot" not in kinds, sorted(kinds)
    assert "TopKV2" in kinds                                                   # the router is there
    plan = plan_graph(graph, num_devices=8, method="data_parallel", hardware="cpu-virtual")
    moved = {kind: cost.bytes for kind, cost in plan.comm_by_collective.items() if cost.bytes}
    assert set(moved) == {"all-reduce"}, moved
