"""tf-keras normalization layers under TofuStrategy compute what the fused kernel computes.

The strategy runs tf-keras's BatchNormalization and LayerNormalization unfused (DTensor cannot
lay out ``FusedBatchNormV3``), and ``tf.nn.batch_normalization``, which the unfused path calls,
loses float32 digits where a channel's mean is large against its spread
(``tofu_tf.tf.compat.normalization``). The inputs here are such: features around 300 that vary
by about 0.01, as deep nets' late activations can be (NASNetMobile's last cells trained another
model under the strategy than on one device before the fix).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_keras.src.dtensor import utils as dtensor_utils

from tofu_tf.tf.compat import normalization
from tests.strategy_helpers import BATCH, fit_beside_one_device


def _offset_features(rows: int, shape=(16,), seed: int = 0):
    rng = np.random.default_rng(seed)
    return (300.0 + 0.01 * rng.normal(size=(rows, *shape))).astype("float32")


def test_centered_formula_keeps_the_digits_tf_nn_loses():
    """Against float64: the centered formula is float32-accurate, TensorFlow's own formula is not
    (which is why the strategy uses the first)."""
    x = _offset_features(64)
    mean, variance = np.mean(x, axis=0), np.var(x, axis=0)
    scale, offset = np.full(16, 1.5, "float32"), np.full(16, 0.25, "float32")
    truth = (x.astype("float64") - mean) / np.sqrt(variance.astype("float64") + 1e-3) * 1.5 + 0.25
    args = [tf.constant(a) for a in (x, mean, variance, offset, scale)]
    centered = normalization.centered_batch_normalization(*args, variance_epsilon=1e-3).numpy()
    uncentered = tf.nn.batch_normalization(*args, variance_epsilon=1e-3).numpy()
    assert np.max(np.abs(centered - truth)) < 1e-5
    assert np.max(np.abs(uncentered - truth)) > 1e-4


def _compile_sgd(model, learning_rate=0.5):
    model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


# tf-keras fuses a BatchNormalization of NHWC images and a LayerNormalization over the last axis
SHAPES = {"BatchNormalization": (4, 4, 2), "LayerNormalization": (16,)}


def _head_after(norm_layer):
    def build():
        keras.utils.set_random_seed(11)
        inputs = keras.Input(SHAPES[norm_layer.__name__])
        normalized = keras.layers.Flatten()(norm_layer()(inputs))
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(normalized))
    return build


@pytest.mark.parametrize("norm_layer", [keras.layers.BatchNormalization, keras.layers.LayerNormalization],
                         ids=["batch_norm", "layer_norm"])
def test_centered_normalization_trains_as_one_device(norm_layer):
    """Three SGD steps under TofuStrategy equal one device's, whose layer runs fused (losses,
    weights, BatchNormalization's moving statistics), the change recorded."""
    reference = _head_after(norm_layer)()
    assert getattr(reference.layers[1], "fused", None) or getattr(reference.layers[1], "_fused", None)
    rng = np.random.default_rng(1)
    x = (3.0 + rng.normal(size=(3 * BATCH, *SHAPES[norm_layer.__name__]))).astype("float32")
    y = rng.integers(0, 4, size=(3 * BATCH,))
    strategy, _, _ = fit_beside_one_device(_head_after(norm_layer), _compile_sgd, x, y, rtol=1e-5, atol=1e-6)
    assert "normalization_centered" in {applied.change.name for applied in strategy.changes}


def test_batch_statistics_are_taken_over_the_batch_with_one_devices_ops():
    """tf-keras takes the strategy for a DTensor strategy (it has a mesh) and then computes a
    BatchNormalization's statistics per replica group: a reshape, moments, a ``Repeat`` back over
    the batch and, for the moving averages, a mean of that repeat, which DTensor runs as more
    all-reduces than one device's ops need, in a run more than the plan priced
    (tests/test_executed.py). Under the strategy the layer computes ``tf.nn.moments`` over the
    batch, as one device does; the step equals one device's."""
    rng = np.random.default_rng(3)
    x = (3.0 + rng.normal(size=(3 * BATCH, *SHAPES["BatchNormalization"]))).astype("float32")
    y = rng.integers(0, 4, size=(3 * BATCH,))
    strategy, model, _ = fit_beside_one_device(_head_after(keras.layers.BatchNormalization), _compile_sgd, x, y,
                                               rtol=1e-5, atol=1e-6)
    assert "batch_norm_global_moments" in {applied.change.name for applied in strategy.changes}
    norm = model.layers[1]
    assert not normalization.compute_global_moments(norm)        # once a layer, however often prepared
    with strategy.scope():
        assert dtensor_utils.running_with_dtensor_strategy()                  # the premise
        graph = tf.function(lambda batch: norm(batch, training=True)).get_concrete_function(
            tf.TensorSpec((BATCH, *SHAPES["BatchNormalization"]))).graph
    names = [op.name for op in graph.get_operations()]
    assert any("/moments/mean" in name for name in names), names
    assert not any("Repeat" in name or op_type == "Tile" for name, op_type in
                   ((op.name, op.type) for op in graph.get_operations())), names


class _ConvBlock(keras.layers.Layer):
    """A convolution and a BatchNormalization named ``bn`` in every block, as Model Garden's
    residual blocks name theirs alike."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)
        self.bn = keras.layers.BatchNormalization(name="bn")

    def call(self, inputs, training=None):
        return tf.nn.relu(self.bn(self.conv(inputs), training=training))


def _blocks_named_alike():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.BatchNormalization(name="bn")(keras.layers.Conv2D(8, 3, padding="same")(inputs))
    x = _ConvBlock(name="block_a")(_ConvBlock(name="block_b")(x))
    return keras.Model(inputs, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(x)))


def test_every_batch_normalization_the_plan_gathers_is_gathered_whatever_its_name():
    """Three BatchNormalization layers all named ``bn`` (the model's own and one in each block), the
    plan computing each one's statistics whole (data parallel on the CPU profile): each takes its
    input replicated, found by its path, and the step trains as one device does. Before, the layer
    was found by its name alone: three ops ended in ``bn/moments/mean``, none was hinted, and DTensor
    all-reduced partial sums the plan had not priced."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3 * BATCH, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 4, size=(3 * BATCH,))
    strategy, _, _ = fit_beside_one_device(_blocks_named_alike, _compile_sgd, x, y, rtol=1e-5, atol=1e-6)
    plan = strategy.extended._plan  # pylint: disable=protected-access
    means = {name: specs for name, specs in plan.op_strategies.items() if name.endswith("/moments/mean")}
    assert len(means) == 3 and all(set(specs) == {"replicate"} for specs in means.values()), means  # the premise
    hinted = {applied.target for applied in strategy.changes if applied.change.name == "statistics_input_relayout"}
    assert hinted == {"bn", "block_b/bn", "block_a/bn"}, hinted


def _sgd_steps(model, x, y, weight_sets):
    """From each of ``weight_sets`` in turn, one SGD step of learning rate 1: [(each trainable
    weight's gradient, the moving statistics after)]. One compile and one trace of the step serve
    every set (SGD without momentum keeps no state between the steps)."""
    _compile_sgd(model, learning_rate=1.0)
    steps = []
    for weights in weight_sets:
        model.set_weights(weights)
        before = [w.numpy() for w in model.trainable_weights]
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        gradients = [b.astype("float64") - w.numpy().astype("float64") for b, w in zip(before, model.trainable_weights)]
        steps.append((gradients, [w.numpy() for w in model.non_trainable_weights]))
    return steps


def _largest_relative(got, want) -> list[float]:
    """Per weight: the largest difference over the largest value of ``want`` (0 where it is all 0)."""
    return [float(np.max(np.abs(g - w)) / np.max(np.abs(w))) if np.max(np.abs(w)) > 0 else 0.0
            for g, w in zip(got, want)]


@pytest.mark.slow
def test_nasnet_layers_as_the_strategy_prepares_them_step_as_in_float64():
    """tf-keras's NASNetMobile at 32x32, batch 8 (its last cells normalize 8 values a channel): one
    SGD step with its layers as the strategy prepares them (``prepare_layers``: BatchNormalization
    unfused and centered, depthwise convolutions grouped, poolings as sums) on one device changes
    every trainable weight as the model computed in float64 does: within 1e-3 of each weight's
    largest gradient, or, for a weight whose gradient the model itself turns rounding into, within
    twice what one device's fused float32 step moves it by when every initial weight moves by one
    ulp (``hub_sweep.one_ulp_spread``'s measure). On an AMD EPYC with AVX-512 the fused step, its
    weights moved one ulp down, changes ``normal_left5_12``'s separable convolution's gradients by
    up to 53% (a ReLU flips in the last cell, whose BatchNormalization sees 8 values a channel),
    and the prepared step lands there; on other CPUs both are within 1e-4. The moving statistics
    equal the fused step's. Unfused without the
    centering, the last cells' gradients differed from float64's by up to 53% where one ulp moves
    them by 1e-4, and the strategy trained another NASNet than one device did."""
    from tofu_tf.tf.compat import layers

    def build(dtype="float32"):
        keras.utils.set_random_seed(3)
        keras.backend.set_floatx(dtype)
        try:
            return keras.applications.NASNetMobile(input_shape=(32, 32, 3), weights=None, classes=10,
                                                   classifier_activation=None)
        finally:
            keras.backend.set_floatx("float32")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 32, 32, 3))
    y = rng.integers(0, 10, size=(8,))
    prepared = build()
    initial = prepared.get_weights()
    [(want, _)] = _sgd_steps(build("float64"), x, y, [[w.astype("float64") for w in initial]])
    nudged = [[np.nextafter(w, np.asarray(direction, w.dtype)) for w in initial] for direction in (np.inf, -np.inf)]
    (fused_gradients, fused_statistics), *moved = _sgd_steps(build(), x.astype("float32"), y, [initial, *nudged])
    spread = [max(relative) for relative in zip(*(_largest_relative(gradients, fused_gradients) for gradients, _ in moved))]
    applied = {record.change.name for record in layers.prepare_layers(prepared)}
    assert {"batch_norm_unfused", "normalization_centered"} <= applied, applied
    [(got, statistics)] = _sgd_steps(prepared, x.astype("float32"), y, [initial])
    off = [(difference, allowed, v.name) for difference, allowed, v in
           zip(_largest_relative(got, want), [max(1e-3, 2 * s) for s in spread], prepared.trainable_weights)
           if difference >= allowed]
    assert not off, off
    # The moving statistics as the fused kernel keeps them (its moving variance takes the batch's
    # with Bessel's correction, as the strategy's centered layer does; tf-keras's unfused float64
    # path takes it without).
    for got_statistic, want_statistic in zip(statistics, fused_statistics):
        np.testing.assert_allclose(got_statistic, want_statistic, rtol=1e-5, atol=1e-6)
