"""tf-keras's own distribution correctness harness, run with TofuStrategy as the distribution.

tf-keras ships the harness its distribution tests are built on
(``tf_keras/src/distribute/keras_correctness_test_base.py``): a model is built once, its
initial weights saved, then trained twice for two epochs (fit, evaluate, predict, fit,
evaluate) with the distribution and without it, from numpy arrays or ``tf.data``
datasets, with or without validation data; every history, evaluation, prediction and
weight must agree (``compare_results``: 4e-5 absolute and relative). The test modules
that use it are not installed with tf-keras; the models below follow tf-keras's DNN,
embedding, image and RNN correctness tests (``keras_dnn_correctness_test.py``,
``keras_embedding_model_correctness_test.py``, ``keras_image_model_correctness_test.py``,
``keras_rnn_model_correctness_test.py`` in keras-team/tf-keras), with the optimizer
they use, tf-keras's legacy ``SGD``, and with the new ``SGD``; the data is smaller
(the harness's default is 9,984 or 1,280 samples, two epochs), to keep the suite short.

TofuStrategy plans each model under half its peak on one device, as a user whose model
does not fit would run it: weights shard or the batch splits (the test checks one does).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from absl.testing import parameterized
from tf_keras.src.distribute import keras_correctness_test_base as harness

from tofu_tf.search import plan_graph
from tofu_tf.strategies import TofuStrategy, keras_hooks
from tofu_tf.tf.capture import capture_training_step

pytestmark = pytest.mark.slow   # tf-keras's own harness: every model and distribution combination it generates

_SAMPLES = 320        # five batches of the harness's global batch (64)


def _optimizer(kind: str):
    return keras.optimizers.legacy.SGD(0.05) if kind == "legacy" else keras.optimizers.SGD(0.05)


_CASES = [dict(testcase_name=f"{optimizer}_{'numpy' if numpy else 'dataset'}{'_validation' if validation else ''}",
               optimizer=optimizer, use_numpy=numpy, use_validation_data=validation)
          for optimizer in ("legacy", "new") for numpy in (True, False) for validation in (False, True)]


class _Harness:
    """Runs the harness's test with TofuStrategy (mixed into one of its test cases); a model
    gives ``build`` (the layers), the loss and metrics, and the data."""

    optimizer = "legacy"
    loss = "sparse_categorical_crossentropy"
    metrics = ("sparse_categorical_accuracy",)

    def build(self):
        raise NotImplementedError

    def get_model(self, initial_weights=None, distribution=None, input_shapes=None, **kwargs):
        with harness.MaybeDistributionScope(distribution):
            model = self.build()
            if initial_weights:
                model.set_weights(initial_weights)
            model.compile(optimizer=_optimizer(self.optimizer), loss=self.loss, metrics=list(self.metrics))
        return model

    def run_with_tofu(self, optimizer, use_numpy, use_validation_data):
        """The harness's test, TofuStrategy planning under half the peak of one device for this
        model: weights shard or the batch splits."""
        self.optimizer = optimizer
        strategy = TofuStrategy(8, memory_budget_bytes=self._half_one_devices_peak())
        self.run_correctness_test(strategy, use_numpy, use_validation_data)
        plan = strategy.plan
        sharded = [path for path, layout in plan.variable_layouts.items() if any(layout)]
        split_batch = all(layout and layout[0] for layout in plan.input_layouts.values())
        self.assertTrue(sharded or split_batch, "the plan under the budget keeps every variable and batch whole")

    def _half_one_devices_peak(self) -> int:
        x, y, _ = self.get_data()
        model = self.get_model(input_shapes=harness.get_shapes(x))
        keras_hooks.prepare_for_dtensor(model)                     # as TofuStrategy trains it
        batch = harness._GLOBAL_BATCH_SIZE  # pylint: disable=protected-access
        spec = lambda a: tf.TensorSpec((batch,) + a.shape[1:], tf.as_dtype(a.dtype))  # noqa: E731
        graph = capture_training_step(model, batch_size=batch, loss=model.loss, optimizer=model.optimizer,
                                      features=spec(x), labels=spec(y))
        return plan_graph(graph, num_devices=1, hardware="cpu-virtual").peak_memory_bytes // 2


class DnnCorrectnessTest(_Harness, harness.TestDistributionStrategyCorrectnessBase):
    loss, metrics = "mean_squared_error", ("mse",)

    def build(self):
        return keras.Sequential([
            keras.layers.Dense(16, activation="relu", input_shape=(1,)),
            keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-4)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1)])

    def get_data(self):
        x_train = np.random.rand(_SAMPLES, 1).astype("float32")
        return x_train, 3 * x_train, np.array([[1.0], [2.0], [3.0], [4.0]], dtype=np.float32)

    @parameterized.named_parameters(*_CASES)
    def test_correctness(self, optimizer, use_numpy, use_validation_data):
        self.run_with_tofu(optimizer, use_numpy, use_validation_data)


class _WordsHarness(_Harness):
    """Padded word ids (the harness's embedding data) -> an Embedding -> ``encode`` -> two classes."""

    output_dim = 16

    def encode(self, embedded):
        raise NotImplementedError

    def build(self, max_words=10):
        word_ids = keras.layers.Input(shape=(max_words,), dtype=np.int32, name="words")
        embedded = keras.layers.Embedding(input_dim=20, output_dim=self.output_dim)(word_ids)
        return keras.Model(word_ids, keras.layers.Dense(2, activation="softmax")(self.encode(embedded)))

    def get_data(self, **kwargs):
        return super().get_data(count=_SAMPLES, **kwargs)


class EmbeddingCorrectnessTest(_WordsHarness, harness.TestDistributionStrategyEmbeddingModelCorrectnessBase):
    def encode(self, embedded):
        return keras.layers.GlobalAveragePooling1D()(embedded)

    @parameterized.named_parameters(*_CASES)
    def test_correctness(self, optimizer, use_numpy, use_validation_data):
        self.run_with_tofu(optimizer, use_numpy, use_validation_data)


class RnnCorrectnessTest(_WordsHarness, harness.TestDistributionStrategyEmbeddingModelCorrectnessBase):
    output_dim = 10

    def encode(self, embedded):
        return keras.layers.LSTM(units=4, return_sequences=False)(embedded)

    @parameterized.named_parameters(*_CASES)
    def test_correctness(self, optimizer, use_numpy, use_validation_data):
        self.run_with_tofu(optimizer, use_numpy, use_validation_data)


class ImageCorrectnessTest(_Harness, harness.TestDistributionStrategyCorrectnessBase):
    def build(self):
        image = keras.layers.Input(shape=(8, 8, 3), name="image")
        features = keras.layers.Conv2D(8, (3, 3), activation="relu", padding="same")(image)
        features = keras.layers.MaxPooling2D(pool_size=(2, 2))(features)
        flat = keras.layers.Flatten()(features)
        return keras.Model(image, keras.layers.Dense(10, activation="softmax")(flat))

    def get_data(self):
        x_train = np.random.rand(_SAMPLES, 8, 8, 3).astype("float32")
        y_train = np.random.randint(0, 10, size=(_SAMPLES, 1)).astype("int32")
        return x_train, y_train, x_train[:64]

    @parameterized.named_parameters(*_CASES)
    def test_correctness(self, optimizer, use_numpy, use_validation_data):
        self.run_with_tofu(optimizer, use_numpy, use_validation_data)


def _premade(kind: str, optimizers: int = 1, built: bool = True):
    from tf_keras.src.premade_models import linear, wide_deep
    keras.utils.set_random_seed(5)
    if kind == "linear":
        model = linear.LinearModel(units=1)
        optimizer = keras.optimizers.legacy.SGD(0.1)
    else:
        dnn = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        model = wide_deep.WideDeepModel(linear.LinearModel(units=1), dnn)
        optimizer = keras.optimizers.legacy.SGD(0.1)
        if optimizers == 2:
            optimizer = [optimizer, keras.optimizers.legacy.Adam(0.01)]
    if built:
        model.build((None, 4))
    model.compile(optimizer, "mse")
    return model


@pytest.mark.parametrize("kind", ["linear", "wide_deep"])
def test_a_premade_model_trains_as_on_one_device(kind):
    """tf-keras's premade LinearModel and WideDeepModel (tf-keras's distribute tests train them
    under every strategy): finding the model in the call stack asked an unbuilt model for its
    ``trainable_variables``, which raises ValueError, not AttributeError ("Weights for model
    'linear_model' have not yet been created")."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x @ np.array([[1.0], [2.0], [-1.0], [0.5]], np.float32)
    reference = _premade(kind)
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    with TofuStrategy(8).scope():
        model = _premade(kind)
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_wide_deep_model_with_an_optimizer_per_sub_model_trains_as_on_one_device():
    """tf-keras's distribute tests compile WideDeepModel with two optimizers, one per sub-model
    (``compile(optimizer=[linear_opt, dnn_opt])``), which its own ``train_step`` applies each to
    its sub-model's weights. Capture planned Keras' one-optimizer step and refused the list
    ("the model is compiled with 2 optimizers"); the strategy now plans that ``train_step``, with
    both optimizers (SGD and Adam: Adam's slots are made for the deep part only)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x @ np.array([[1.0], [2.0], [-1.0], [0.5]], np.float32)
    reference = _premade("wide_deep", optimizers=2)
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    with TofuStrategy(8).scope():
        model = _premade("wide_deep", optimizers=2)
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    linear_optimizer, dnn_optimizer = model.optimizer
    assert int(linear_optimizer.iterations) == int(dnn_optimizer.iterations) == 8
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=16, verbose=0),
                               reference.evaluate(x, y, batch_size=16, verbose=0), rtol=1e-5)


def test_an_unbuilt_wide_deep_model_with_two_optimizers_is_built_from_its_first_batch():
    """As tf-keras's distribute test makes it: never built before ``fit``. Its own ``train_step``
    is traced to plan it, and the strategy read its weights first ("Weights for model
    'linear_model' have not yet been created"): it is built from the first batch's features, as a
    compiled model is. Seeded, its initial weights are one device's, so the run is too."""
    rng = np.random.default_rng(2)
    x = rng.uniform(-5, 5, size=(64, 4)).astype("float32")
    y = x @ np.array([[0.3], [0.2], [0.0], [-0.1]], np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    reference = _premade("wide_deep", optimizers=2, built=False)
    expected = reference.fit(dataset, epochs=2, verbose=0).history["loss"]
    with TofuStrategy(8).scope():
        model = _premade("wide_deep", optimizers=2, built=False)
    loss = model.fit(dataset, epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_plan_model_plans_a_wide_deep_models_own_step_from_a_batch_and_refuses_one_without_it():
    """Only the model's own ``train_step`` says which optimizer updates which weights, so
    ``plan_model`` traces it on a batch as ``fit`` passes it (``(x, y)``); without one it names that."""
    from tofu_tf.tf.keras_adapter import UnsupportedModelError
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = _premade("wide_deep", optimizers=2)
    with pytest.raises(UnsupportedModelError, match=r"compiled with 2 optimizers.*features="):
        strategy.plan_model(model, batch_size=16)
    plan = strategy.plan_model(model, batch_size=16, features=(x, y))
    adam_slots = {path.split("/")[1] for path in plan.variable_layouts if path.startswith("Adam/")}
    assert plan is strategy.plan and adam_slots == {layer.name for layer in model.dnn_model.layers}  # its own only
    assert f"{model.linear_model.name}/kernel" in plan.variable_layouts


class _MeanMetricBias(keras.layers.Layer):
    """tf-keras's distribute test's layer: a metric of its input added in its own call."""

    def build(self, input_shape):
        self.bias = self.add_weight(name="bias", initializer="ones", shape=())

    def call(self, inputs):
        self.add_metric(tf.reduce_mean(inputs), name="mean_input", aggregation="mean")
        return inputs + self.bias


def _model_with_added_metrics():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((10,))
    hidden = _MeanMetricBias()(keras.layers.Dense(10)(inputs))
    outputs = keras.layers.Dense(1)(hidden)
    model = keras.Model(inputs, outputs)
    model.add_metric(tf.reduce_sum(outputs), name="sum_output", aggregation="mean")
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def test_metrics_added_in_a_layers_call_and_on_a_functional_model_train_as_on_one_device():
    """``add_metric`` in a layer's ``call`` and on a functional model's symbolic output update the
    metric while tf-keras builds the model (its scratch graph) and while the strategy captures
    the step, through ``call_for_each_replica``: both planned there, with no model to plan
    ("no Keras model is reachable from that function"). Neither runs anything: the metric is
    called as is."""
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(64, 10)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    reference = _model_with_added_metrics()
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), shuffle=False, verbose=0).history
    with TofuStrategy(8).scope():
        model = _model_with_added_metrics()
    model.set_weights(initial)
    history = model.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), shuffle=False, verbose=0).history
    assert set(history) == set(expected) >= {"mean_input", "sum_output", "val_mean_input"}
    for name, values in expected.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("distributed", ["dataset", "from_function"])
def test_fit_takes_the_strategys_own_distributed_dataset_as_one_device_trains(distributed):
    """TensorFlow's guide feeds ``fit`` a dataset the user distributed
    (``strategy.experimental_distribute_dataset``, ``distribute_datasets_from_function``) with
    ``steps_per_epoch``; tf-keras recognizes only TensorFlow's distributed datasets ("Failed to
    find data adapter that can handle input"), and ``if validation_data:`` asked the length of
    one of unknown length (TypeError). Without steps it is refused as MirroredStrategy's is."""
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(40, 10)).astype("float32"), rng.normal(size=(40, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(6)
        model = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
        model.build((None, 10))
        model.compile(keras.optimizers.SGD(0.05), "mse")
        return model

    def dataset(_=None):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()

    reference = build()
    initial = reference.get_weights()
    expected = reference.fit(dataset(), steps_per_epoch=5, validation_data=dataset(), validation_steps=2, epochs=2,
                             verbose=0).history
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = build()
    model.set_weights(initial)
    distribute = (strategy.experimental_distribute_dataset if distributed == "dataset"
                  else lambda ds: strategy.distribute_datasets_from_function(lambda _: ds))
    history = model.fit(distribute(dataset()), steps_per_epoch=5, validation_data=distribute(dataset()),
                        validation_steps=2, epochs=2, verbose=0).history
    for name, values in expected.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)
    with pytest.raises(ValueError, match="distributed dataset, you must specify"):
        model.fit(distribute(dataset()), epochs=1, verbose=0)


def _model_with_only_added_losses():
    """tf-keras's distribute test's segmentation model: compiled with no loss, its per-pixel
    weighted cross-entropy computed by a layer from the labels and weights it takes as inputs
    and added with ``model.add_loss``."""
    keras.utils.set_random_seed(1)
    image = keras.layers.Input([8, 8, 3], name="img")
    label = keras.layers.Input([8, 8, 1], name="lbl")
    weight = keras.layers.Input([8, 8], name="weight")
    predict = keras.layers.Conv2D(1, [1, 1], padding="same", activation="sigmoid")(image)
    weighted = keras.layers.Lambda(lambda t: tf.reduce_mean(keras.losses.binary_crossentropy(t[1], t[0]) * t[2]),
                                   name="my_loss")([predict, label, weight])
    model = keras.Model(inputs=[image, label, weight], outputs=[predict, weighted])
    model.add_loss(model.get_layer("my_loss").output)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def test_a_model_compiled_without_a_loss_trains_on_the_losses_it_adds_as_one_device():
    """The plan was captured with mean squared error standing in for the missing compiled loss,
    over both outputs ("Shapes must be equal rank, but are 4 and 0" packing them); Keras trains
    such a model on its added losses only, and so is it planned."""
    rng = np.random.default_rng(7)
    images = rng.uniform(size=[48, 8, 8, 3]).astype("float32")
    labels = (rng.uniform(size=[48, 8, 8, 1]) > 0.5).astype("float32")
    weights = rng.uniform(size=[48, 8, 8]).astype("float32")

    def data():
        return tf.data.Dataset.from_tensor_slices((images, labels, weights)).map(
            lambda i, l, w: ({"img": i, "lbl": l, "weight": w},)).batch(16)

    reference = _model_with_only_added_losses()
    initial = reference.get_weights()
    expected = reference.fit(data(), epochs=2, verbose=0).history["loss"]
    with TofuStrategy(8).scope():
        model = _model_with_only_added_losses()
    model.set_weights(initial)
    np.testing.assert_allclose(model.fit(data(), epochs=2, verbose=0).history["loss"], expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
