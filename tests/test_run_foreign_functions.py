"""``strategy.run`` with functions that are not a Keras training step (tf-keras's distribution
tests: a SavedModel's serving signature run under the strategy).

Before: a loaded SavedModel's signature passed to ``run`` was refused ("no Keras model
reachable") or, where a Keras model sat in a local of tf-keras's test harness, planned that
model and ran the signature against its mesh ("In[1] is not a matrix").
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tofu_tf import TofuError, TofuStrategy
from tofu_tf.strategies import keras_hooks, tofu_strategy


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


def _saved_dense_model(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    tf.saved_model.save(model, str(tmp_path))
    serve = tf.saved_model.load(str(tmp_path)).signatures["serving_default"]
    return serve


@pytest.mark.parametrize("batch,planned_first", [(16, False), (10, False), (16, True)])
def test_a_savedmodel_loaded_inside_the_scope_serves_under_the_strategy(tmp_path, batch, planned_first, caplog):
    """tf-keras's saved_model_save_load_test loads in the scope. Before: the loaded variables were
    deferred, the restored functions held their buffer-less handles, and the first run found no
    model to plan ("no Keras model reachable"). Now they are kept as loaded (host, unpartitioned,
    a warning says so) and the signature runs once per device on its shard: one device's output.
    A batch of 10 does not divide over 8 devices: it runs whole. ``planned_first``: loaded in the
    scope of a strategy that has planned a model already (the loaded variables were laid out at
    once, with no initial value)."""
    x = np.random.default_rng(1).normal(size=(batch, 3)).astype("float32")
    (name, expected), = _saved_dense_model(tmp_path)(tf.constant(x)).items()
    strategy = TofuStrategy(8)
    if planned_first:
        with strategy.scope():
            trained = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            trained.compile("sgd", "mse")
        strategy.plan_model(trained, batch_size=16)
    with caplog.at_level("WARNING", logger="absl"), strategy.scope():
        serve = tf.saved_model.load(str(tmp_path)).signatures["serving_default"]
        data = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(batch))))
        result = strategy.run(serve, args=(data,))
    got = tf.concat(strategy.experimental_local_results(result[name]), 0).numpy()
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-6, atol=1e-6)
    assert "loaded from a SavedModel in strategy.scope()" in caplog.text and "unpartitioned" in caplog.text


class _Scaled(tf.Module):
    def __init__(self):
        self.v = tf.Variable(3.0)

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
    def __call__(self, x):
        return self.v * x


def test_a_loaded_tf_module_is_called_under_the_strategy(tmp_path):
    """A tf.Module loaded (in the scope, or in that of a strategy that already trained a model) and
    passed to run itself: its restored ``__call__`` reads the loaded variable off the mesh and runs
    once per device (before: "no Keras model reachable", or a DTensor program reading a host
    variable)."""
    tf.saved_model.save(_Scaled(), str(tmp_path))
    x = np.arange(16, dtype="float32").reshape(16, 1)
    strategy = TofuStrategy(8)
    with strategy.scope():
        loaded = tf.saved_model.load(str(tmp_path))
        data = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(16))))
        result = strategy.run(loaded, args=(data,))
    np.testing.assert_array_equal(tf.concat(strategy.experimental_local_results(result), 0).numpy(), 3.0 * x)


class _Counter(tf.Module):
    def __init__(self):
        self.total = tf.Variable(0.0)

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
    def add(self, x):
        self.total.assign_add(tf.reduce_sum(x))
        return self.total


@pytest.mark.parametrize("in_scope", [True, False])
def test_a_loaded_function_that_writes_its_variables_is_refused_off_the_mesh(tmp_path, in_scope):
    """Run once per device, each device would add its shard to the one loaded variable: refused,
    naming the way to train a loaded model (before, loaded outside the scope: run per device,
    the total taking eight updates)."""
    tf.saved_model.save(_Counter(), str(tmp_path))
    x = np.ones((16, 1), "float32")
    strategy = TofuStrategy(8)
    with strategy.scope() if in_scope else contextlib.nullcontext():
        loaded = tf.saved_model.load(str(tmp_path))
    with strategy.scope():
        data = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(16))))
        with pytest.raises(tofu_strategy.PlanningError, match=r"writes variables that are not on TofuStrategy's mesh"
                                                                r".*model.load_weights"):
            strategy.run(loaded.add, args=(data,))


def test_make_input_fn_iterator_is_refused_naming_the_v2_input_apis():
    """tf-keras's minimize_loss, metrics and mirrored_variable tests feed replicas through TF1's
    make_input_fn_iterator. Before: TensorFlow's "deprecated, and only available in the V1 API",
    which names no way out. TofuStrategy runs one program over the global batch: no replica pulls
    a batch of its own; the refusal names the dataset APIs that feed run."""
    strategy = TofuStrategy(8)
    with pytest.raises(NotImplementedError,
                       match=r"make_input_fn_iterator.*one SPMD program over the global batch.*"
                             r"experimental_distribute_dataset\(dataset\).*distribute_datasets_from_function") as error:
        strategy.make_input_fn_iterator(lambda context: tf.data.Dataset.from_tensors([[1.0]]).repeat(10))
    assert isinstance(error.value, TofuError)


def test_a_tf_module_made_in_the_scope_runs_data_parallel_and_saves_as_one_device(tmp_path, caplog):
    """tf-keras's SavedModelTFModuleTest: a tf.Module (``tf.Variable(3.0)``, no Keras layer) made in
    the scope, called through run, then saved with a signature traced on it. Before: its trainable
    variable made the first run demand a Keras model ("no Keras model reachable"). Now a run that
    reaches no Keras model, with no Keras layer's weight made in the scope, runs data parallel (a
    warning names the variable); its replicated variables save as one device's variables."""
    x = np.random.default_rng(2).normal(size=(10, 3)).astype("float32")
    strategy = TofuStrategy(8)
    with strategy.scope():
        module = _Scaled()
    with caplog.at_level("WARNING", logger="absl"), strategy.scope():
        data = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(10))))
        result = tf.concat(strategy.experimental_local_results(strategy.run(module, args=(data,))), 0).numpy()
    np.testing.assert_array_equal(result, 3.0 * x)
    assert "trains no Keras model" in caplog.text and "not a Keras layer's: Variable" in caplog.text

    @tf.function
    def bump():
        strategy.run(lambda: module.v.assign_add(1.0))
    bump()                                      # the SavedModel holds the value as it is now
    tf.saved_model.save(module, str(tmp_path), signatures=module.__call__.get_concrete_function())
    loaded = tf.saved_model.load(str(tmp_path))
    np.testing.assert_array_equal(loaded(tf.constant(x)).numpy(), 4.0 * x)


def test_a_bare_variable_trained_in_a_custom_loop_runs_data_parallel_as_one_device():
    """A step that trains a bare tf.Variable made in the scope (checkpointing_test's) reaches no
    Keras model: one global data-parallel program, the update one device's."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16,)).astype("float32")
    start = rng.normal(size=(4,)).astype("float32")

    def train(strategy):
        with strategy.scope():
            weights = tf.Variable(start)

        @tf.function
        def step(features, labels):
            def replica(features, labels):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((tf.linalg.matvec(features, weights) - labels) ** 2)
                weights.assign_sub(0.1 * tape.gradient(loss, weights))
            strategy.run(replica, args=(features, labels))
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        for features, labels in strategy.experimental_distribute_dataset(data):
            step(features, labels)
            step(features, labels)
        return weights.numpy()
    np.testing.assert_allclose(train(TofuStrategy(8)), train(tf.distribute.get_strategy()), rtol=1e-6, atol=1e-6)


def _variable_argument_loop(strategy, features_for):
    """tf-keras's test_variable_run_argument (custom_training_loop_models_test.py): a Dense built
    inside the step's first trace, its trainable_variables read before that build and passed to
    run; two steps. Returns the losses and the weights after each step."""
    with strategy.scope():
        optimizer = keras.optimizers.legacy.SGD(0.1)
        net = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(1.5))

    def replica_step(trainable_variables, features):
        with tf.GradientTape() as tape:
            out = net(features, training=True)
            loss = tf.reduce_sum((out - 1.0) * (out - 1.0))
        optimizer.apply_gradients(zip(tape.gradient(loss, trainable_variables), trainable_variables))
        return loss

    @tf.function
    def step(features):
        losses = strategy.run(replica_step, (net.trainable_variables, features))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    history = []
    for _ in range(2):
        loss = step(features_for(strategy))
        history.append((float(loss), [v.numpy().copy() for v in net.trainable_variables]))
    return history


@pytest.mark.parametrize("given", ["host_tensor", "distributed_batch"])
def test_a_layer_built_in_the_first_trace_of_the_function_that_plans_trains_as_one_device(given):
    """Was: a host tensor passed to the function whose first call plans (a model-free plan here)
    was refused by DTensor ("got a regular tensor for input 0 (shape [2,1,1])"): the function was
    called before the strategy had a plan to lay it out with; it is now called again on the plan's
    mesh. And, with either input, the step applied no gradient: the strategy's variables never
    reached the function's own creator, so the function kept its first trace, which read the
    Dense's trainable_variables before the Dense was built (an empty list); it now traces again,
    as for variables it makes itself (function_told_of_variables)."""
    data = np.array([[1.0], [2.0]], np.float32)

    def features_for(strategy):
        if given == "host_tensor" or strategy is tf.distribute.get_strategy():
            return tf.constant(data)
        return next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(data))))

    expected = _variable_argument_loop(tf.distribute.get_strategy(), features_for)
    got = _variable_argument_loop(TofuStrategy(8), features_for)
    assert np.abs(expected[0][1][0] - 1.5).max() > 0.01          # the reference trained
    for (loss, weights), (want_loss, want_weights) in zip(got, expected):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        for weight, want in zip(weights, want_weights):
            np.testing.assert_allclose(weight, want, rtol=1e-6)
