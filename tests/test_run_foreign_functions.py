"""``strategy.run`` with functions that are not a Keras training step (tf-keras's distribution
tests: a SavedModel's serving signature run under the strategy).

Before: a loaded SavedModel's signature passed to ``run`` was refused ("no Keras model
reachable") or, where a Keras model sat in a local of tf-keras's test harness, planned that
model and ran the signature against its mesh ("In[1] is not a matrix").
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tofu_tf import TofuStrategy
from tofu_tf.strategies import keras_hooks


def _frame_holding_a_model(module_name: str, model):
    """Call find_model_in_stack from a function whose module is ``module_name`` and that holds
    ``model`` in a local, as Keras' DataHandler and tf-keras's test harness both do."""
    namespace = {"__name__": module_name, "keras_hooks": keras_hooks}
    exec("def distribute(model):\n    return keras_hooks.find_model_in_stack(2)\n", namespace)  # noqa: S102
    return namespace["distribute"](model)


def test_only_keras_training_frames_are_read_for_the_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert _frame_holding_a_model("tf_keras.src.engine.data_adapter", model) is model
    assert _frame_holding_a_model("keras.src.backend.tensorflow.trainer", model) is model
    assert _frame_holding_a_model("tf_keras.src.distribute.saved_model_test_base", model) is None
    assert _frame_holding_a_model("my_training_script", model) is None


@pytest.mark.parametrize("batch", [16, 8])
def test_a_savedmodel_loaded_outside_the_scope_serves_under_the_strategy(tmp_path, batch):
    """Its variables are not on the mesh: the signature runs once per device on that device's
    shard (as MirroredStrategy runs a replica), and the shards together are its output."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    tf.saved_model.save(model, str(tmp_path))
    serve = tf.saved_model.load(str(tmp_path)).signatures["serving_default"]
    x = np.random.default_rng(0).normal(size=(batch, 3)).astype("float32")
    (name, expected), = serve(tf.constant(x)).items()
    strategy = TofuStrategy(8)
    data = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(batch))))
    result = strategy.run(serve, args=(data,))
    got = tf.concat(strategy.experimental_local_results(result[name]), 0).numpy()
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-6, atol=1e-6)


def test_a_tf_keras_model_in_a_module_named_keras_something_is_tf_keras():
    """Before, a subclass defined in ``keras_dnn_correctness_test.py`` (tf-keras's own tests) was
    taken for Keras 3 by its module's name prefix, and failed compiling a Keras 3 optimizer."""
    from tofu_tf.tf.keras_adapter import framework_of

    class Net(keras.Model):
        def call(self, x):
            return x
    Net.__module__ = "keras_my_models"
    assert framework_of(Net()) == "tf_keras"
    import keras as keras3
    assert framework_of(keras3.Sequential([keras3.layers.Dense(1)])) == "keras3"
