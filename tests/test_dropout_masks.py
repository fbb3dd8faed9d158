"""Dropout masks and keras.random draws in layers are the same for the same seed and step
whatever the plan and device count (issue #39): a split mask's noise used to be drawn under
the split layout, and DTensor folds each device's coordinates into the seed, so 2, 4 and 8
devices trained apart (weights 0.5 apart after 3 steps). The noise is now drawn unsplit and
sliced (tofu_tf.tf.compat.random_draws); Keras 3's masks are then a plain one-device run's."""

import contextlib

import keras as keras3
import numpy as np
import pytest
import tf_keras as keras

from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf import keras_adapter

DEVICES = [2, 4, 8]
ONE_TO_EIGHT = [1, *DEVICES]          # num_gpus=1: a plan on a one-device mesh, drawing as the others


def _fit(kind, num_gpus):
    """Three SGD steps of a seeded MLP with two Dropout layers (one unseeded, one seeded), on
    ``num_gpus`` devices or (None) plain Keras."""
    kit = keras if kind == "tf_keras" else keras3
    kit.utils.set_random_seed(6)
    strategy = TofuStrategy(num_gpus=num_gpus, method="megatron") if num_gpus else None
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = kit.Sequential([kit.Input((32,)), kit.layers.Dense(64, name="a"), kit.layers.Dropout(0.5),
                                kit.layers.Dense(64, name="b"), kit.layers.Dropout(0.3, seed=3),
                                kit.layers.Dense(8, name="c")])
        model.compile(optimizer=kit.optimizers.SGD(0.1),
                      loss=kit.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 32)).astype("float32"), rng.integers(0, 8, 48)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)          # 3 steps
    if strategy and num_gpus > 1:
        assert any(not keras_adapter.tf_variable(w).layout.is_fully_replicated() for w in model.weights)
    return [np.asarray(w.numpy()) for w in model.weights]


def _assert_close(got, expected):
    # Equal masks: only summation order differs between meshes (about 1e-7); other masks
    # put the weights 0.07 (Keras 3) to 0.5 (tf-keras) apart.
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["tf_keras", "keras3"])
def test_a_seeded_run_with_dropout_trains_alike_on_any_device_count(kind):
    runs = {n: _fit(kind, n) for n in ONE_TO_EIGHT}
    for n in ONE_TO_EIGHT[:-1]:
        _assert_close(runs[n], runs[ONE_TO_EIGHT[-1]])
    if kind == "keras3":      # Keras 3 draws its masks statelessly on one device too: the same masks
        _assert_close(runs[DEVICES[-1]], _fit(kind, None))


def _fit_pipelined(kind, num_gpus):
    """The same run in two pipeline stages of num_gpus / 2 devices each, two micro-batches, each
    stage splitting its micro-batch over its devices."""
    kit = keras if kind == "tf_keras" else keras3
    kit.utils.set_random_seed(6)
    mesh = {"batch": num_gpus // 2} if num_gpus > 2 else None     # each stage splits its micro-batches
    strategy = TofuStrategy(num_gpus=num_gpus, pipeline=2, num_microbatches=2, mesh_shape=mesh)
    with strategy.scope():
        model = kit.Sequential([kit.Input((32,)), kit.layers.Dense(64, name="a"), kit.layers.Dropout(0.5),
                                kit.layers.Dense(64, name="b"), kit.layers.Dropout(0.3, seed=3),
                                kit.layers.Dense(8, name="c")])
        model.compile(optimizer=kit.optimizers.SGD(0.1),
                      loss=kit.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 32)).astype("float32"), rng.integers(0, 8, 48)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for stage in strategy.plan.stages:          # each SeedGenerator's state on its own stage's mesh
        for state in [v for v in stage.model.variables if "seed_generator_state" in getattr(v, "path", "")]:
            assert keras_adapter.tf_variable(state).layout.mesh == stage.mesh, (state.path, stage.index)
    return [np.asarray(keras_adapter.tf_variable(w).numpy()) for w in model.weights]


@pytest.mark.parametrize("kind", ["tf_keras", "keras3"])
def test_pipeline_stages_draw_the_same_masks_on_any_device_count(kind):
    """Each stage draws its masks unsplit on its own mesh, and a Keras 3 SeedGenerator's state lives
    on the mesh of the stage that draws from it. Before, Keras 3 dropout in a pipeline failed (the
    state was on the last stage's mesh: 'All inputs to tf_device.Cluster must have same mesh');
    on the host, each of a stage's devices advanced it once per draw."""
    runs = {n: _fit_pipelined(kind, n) for n in DEVICES}
    for n in DEVICES[:-1]:
        _assert_close(runs[n], runs[DEVICES[-1]])


def _fit_with_outside_generator(num_gpus):
    """Four SGD steps of a Keras 3 model whose layer adds noise drawn from a SeedGenerator made
    outside any strategy scope (a plain host variable); the losses and the generator's state."""
    keras3.utils.set_random_seed(6)
    generator = keras3.random.SeedGenerator(7)

    class Noisy(keras3.layers.Layer):
        def call(self, x, training=None):
            return x + keras3.random.normal(keras3.ops.shape(x), seed=generator) if training else x

    strategy = TofuStrategy(num_gpus=num_gpus, method="megatron") if num_gpus else None
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras3.Sequential([keras3.Input((16,)), keras3.layers.Dense(32, name="a"), Noisy(),
                                   keras3.layers.Dense(4, name="b")])
        model.compile(optimizer=keras3.optimizers.SGD(0.1), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 16)).astype("float32"), rng.normal(size=(32, 4)).astype("float32")
    losses = model.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"]
    return losses, np.asarray(keras_adapter.tf_variable(generator.state).numpy())


def test_a_seed_generator_made_outside_the_scope_advances_once_per_draw():
    """Before: its state stayed on the host, each of 8 devices advanced it once per draw (state
    [7, 32] after 4 steps, one device's [7, 4]) and the loss was another (3.62 against 3.21)."""
    losses, state = _fit_with_outside_generator(None)
    for n in (1, 8):
        got_losses, got_state = _fit_with_outside_generator(n)
        np.testing.assert_array_equal(got_state, state)
        np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
