"""A ``tf.function`` of the user's, called eagerly with host tensors on a model TofuStrategy
trained, computes what it computes on one device (``tofu_tf.tf.compat.function_calls``).

Before, DTensor refused the call: "The op/function ... got a regular tensor for input 0 ...
but was expecting a DTensor" (a serving function, or any library's ``tf.function``, reading
the plan's variables). The model's first kernel is split by columns, the second by rows.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from tests import strategy_helpers as h
from tofu_tf.strategies import TofuStrategy

pytestmark = pytest.mark.slow   # trains models under TofuStrategy

PLAN = h.HandPlan({"batch": 2, "model": 4}, {"hidden/kernel": (None, "model"), "hidden/bias": ("model",),
                                             "logits/kernel": ("model", None)}, {"x": ("batch",)})


def _mlp(framework):
    framework.utils.set_random_seed(3)
    return framework.Sequential([framework.Input((8,), name="x"),
                                 framework.layers.Dense(32, activation="relu", name="hidden"),
                                 framework.layers.Dense(4, name="logits")])


@pytest.fixture(scope="module", params=[keras, tf_keras], ids=["keras3", "tf_keras"])
def trained(request):
    framework = request.param
    strategy = TofuStrategy(num_gpus=8, plan=PLAN)
    with strategy.scope():
        model = _mlp(framework)
        model.compile(optimizer=framework.optimizers.SGD(0.1),
                      loss=framework.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    model.fit(rng.randn(16, 8).astype("float32"), rng.randint(0, 4, 16), batch_size=8, verbose=0)
    single = _mlp(framework)
    single.set_weights(model.get_weights())
    return strategy, model, single


@pytest.mark.parametrize("batch", [16, 3])         # split over the batch axis; 3 does not divide: replicated
def test_a_serving_function_called_with_host_tensors_computes_one_devices_values(trained, batch):
    strategy, model, single = trained
    assert any(any(spec) for spec in strategy.plan.variable_layouts.values())
    x = np.random.RandomState(1).randn(batch, 8).astype("float32")
    serve = tf.function(lambda inputs: tf.nn.softmax(model(inputs)))
    for call in (lambda: serve(x), lambda: serve(tf.constant(x))):     # the second call: remembered
        out = call()
        assert not dtensor.is_dtensor(out), "results come back on the host, as one device returns them"
        np.testing.assert_allclose(out.numpy(), tf.nn.softmax(single(x)).numpy(), rtol=1e-5, atol=1e-6)


def test_python_arguments_stay_trace_time_constants(trained):
    _, model, single = trained
    x = np.random.RandomState(2).randn(8, 8).astype("float32")

    @tf.function
    def scaled(inputs, factor, squash):
        out = model(inputs) * factor
        return tf.tanh(out) if squash else out

    np.testing.assert_allclose(scaled(x, 2.0, True).numpy(), np.tanh(single(x).numpy() * 2.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scaled(x, 3.0, False).numpy(), single(x).numpy() * 3.0, rtol=1e-5, atol=1e-6)


def test_a_function_failing_for_another_reason_raises_as_it_would(trained):
    _, model, _ = trained

    @tf.function
    def broken(inputs):
        return model(tf.reshape(inputs, (-1, 7)))          # the model takes 8 features

    with pytest.raises(Exception) as raised:
        broken(np.zeros((7, 8), "float32"))
    assert "expecting a DTensor" not in str(raised.value)
