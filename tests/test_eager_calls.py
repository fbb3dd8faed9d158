"""An eager training loop under the scope (GradientTape, model(x), apply_gradients; no
tf.function, no strategy.run) trains as one device (tofu_tf.strategies.eager_calls)."""

import numpy as np
import pytest
import tensorflow as tf

from tests import strategy_helpers as h
from tofu_tf import TofuStrategy
from tofu_tf.strategies import eager_calls
from tofu_tf.tf import keras_adapter

FLAVORS = ("tf_keras", "keras3")
BATCH, STEPS = 8, 3


def _keras(flavor):
    return pytest.importorskip("tf_keras" if flavor == "tf_keras" else "keras")


def _model(keras):
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((16,), name="x"), keras.layers.Dense(64, activation="relu", name="d1"),
                             keras.layers.Dense(8, name="d2")], name="net")


def _split_plan(flavor):
    prefix = "" if flavor == "tf_keras" else "net/"
    return h.HandPlan(mesh_shape={"batch": 2, "model": 4},
                      variable_layouts={prefix + "d1/kernel": (None, "model"), prefix + "d1/bias": ("model",),
                                        prefix + "d2/kernel": ("model", None)},
                      input_layouts={"x": ("batch",)})


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(BATCH * STEPS, 16)).astype("float32"),
            rng.normal(size=(BATCH * STEPS, 8)).astype("float32"))


def _eager_loop(model, optimizer):
    """keras.io's loop before it adds @tf.function."""
    x, y = _data()
    losses = []
    for step in range(STEPS):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        with tf.GradientTape() as tape:
            predictions = model(xb, training=True)
            loss = tf.reduce_mean(tf.square(predictions - yb))
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("split", [False, True], ids=["planned_at_first_call", "split_plan"])
@pytest.mark.parametrize("flavor", FLAVORS)
def test_an_eager_loop_under_the_scope_trains_as_one_device(flavor, split):
    keras = _keras(flavor)
    reference = _model(keras)
    initial = reference.get_weights()
    want = _eager_loop(reference, keras.optimizers.SGD(0.1))

    strategy = TofuStrategy(num_gpus=8, plan=_split_plan(flavor) if split else None,
                            mesh_shape=None if split else {"batch": 2, "model": 4})
    with strategy.scope():
        model = _model(keras)
        model.set_weights(initial)
        got = _eager_loop(model, keras.optimizers.SGD(0.1))
    assert strategy.plan is not None
    kernel = keras_adapter.backing_variable(model.get_layer("d1").kernel)
    assert kernel.layout.is_fully_replicated() is not split
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for got_weight, want_weight in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got_weight, want_weight, rtol=1e-5, atol=1e-6)


def test_an_eager_call_returns_one_devices_outputs_and_leaves_symbolic_calls_alone():
    keras = _keras("keras3")
    strategy = TofuStrategy(num_gpus=8, plan=_split_plan("keras3"))
    with strategy.scope():
        model = _model(keras)
        nested = keras.Sequential([keras.Input((16,)), model])          # a symbolic call: built as usual
    x, _ = _data()
    reference = _model(keras)
    reference.set_weights(model.get_weights())
    outputs = model(x[:BATCH])                                           # outside the scope too
    assert not tf.experimental.dtensor.is_dtensor(outputs)
    np.testing.assert_allclose(outputs, reference(x[:BATCH]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(nested(x[:BATCH]), reference(x[:BATCH]), rtol=1e-5, atol=1e-6)


def test_a_pipelined_strategy_refuses_an_eager_call_naming_fit():
    keras = _keras("keras3")
    strategy = TofuStrategy(num_gpus=8, pipeline=2)
    with strategy.scope():
        model = _model(keras)
    with pytest.raises(eager_calls.EagerCallError, match=r"model\.fit"):
        model(_data()[0][:BATCH])


@pytest.mark.parametrize("flavor", FLAVORS)
def test_an_eager_call_of_a_layer_holding_its_own_constants_is_one_devices(flavor):
    from tests import test_mesh_captures as constants
    keras = _keras(flavor)
    strategy = TofuStrategy(num_gpus=8, plan=constants._split_plan(flavor))
    with strategy.scope():
        model = constants._model(keras)
    reference = constants._model(keras)
    reference.set_weights(model.get_weights())
    x, _ = constants._data()
    np.testing.assert_allclose(model(x[:BATCH]), reference(x[:BATCH]), rtol=1e-5, atol=1e-6)


def test_a_model_of_no_tofu_strategy_called_in_the_scope_runs_as_it_is():
    keras = _keras("keras3")
    outside = _model(keras)                      # its weights are plain variables (a one-device copy's kind)
    x, _ = _data()
    want = outside(x[:BATCH])
    strategy = TofuStrategy(num_gpus=8)
    with strategy.scope():
        got = outside(x[:BATCH])
    assert strategy.plan is None, "a model whose weights are not the strategy's must not be planned"
    np.testing.assert_array_equal(got, want)
