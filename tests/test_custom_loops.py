"""Custom training loops, written as TF's distributed custom-training tutorial writes them,
train under TofuStrategy as under the default (one-device) strategy.

The loop: model, optimizer and loss made under ``strategy.scope()``; the dataset
distributed with ``experimental_distribute_dataset``; a ``tf.function`` that calls
``strategy.run`` and ``strategy.reduce``; ``for batch in dist`` until the data
ends. Before: ``reduce`` inside the function raised ("fetch_layout must be called
eagerly"), and distributing the dataset before a plan guessed a model from the
script's variables and planned it with an "mse" loss (a shape error).
"""

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tofu_tf.strategies import TofuStrategy
from tofu_tf.strategies.tofu_strategy import PlanningError
from tofu_tf.tf.keras_adapter import UnsupportedModelError

pytestmark = pytest.mark.slow   # trains models under TofuStrategy end to end

FRAMEWORKS = {"tf_keras": tf_keras, "keras3": keras3}
# tf-keras's legacy optimizers too: before, their first update failed ('SGD' object has no
# attribute 'add_variable_from_reference').
LOOPS = {**FRAMEWORKS, "tf_keras_legacy_sgd": tf_keras}
GLOBAL_BATCH = 16


def _data(n=56, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 16)).astype("float32"), rng.integers(0, 10, (n,)).astype("int32")


class _Loop:
    """The tutorial's pieces for ``strategy`` (None: the default strategy, one device)."""

    def __init__(self, keras, strategy, *, plan=True, legacy=False):
        self.strategy = strategy or tf.distribute.get_strategy()
        with self.strategy.scope():
            keras.utils.set_random_seed(1)
            self.model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                           keras.layers.Dense(10)])
            self.optimizer = (keras.optimizers.legacy.SGD if legacy else keras.optimizers.SGD)(0.1, momentum=0.9)
            self.loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        if strategy is not None and plan:
            strategy.plan_model(self.model, batch_size=GLOBAL_BATCH, loss=self.loss_object, optimizer=self.optimizer)

    def train_step(self, inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            predictions = self.model(features, training=True)
            per_example = self.loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        gradients = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        return loss

    def train(self, dist, epochs=2):
        @tf.function
        def distributed_train_step(batch):
            per_replica = self.strategy.run(self.train_step, args=(batch,))
            return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        losses = []
        for _ in range(epochs):
            total, steps = 0.0, 0
            for batch in dist:
                total += float(distributed_train_step(batch))
                steps += 1
            losses.append(total / steps)
        return losses


def _dataset():
    x, y = _data()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)   # 56 samples: a last batch of 8


@pytest.mark.parametrize("framework", sorted(LOOPS))
@pytest.mark.parametrize("distribute", ["dataset", "from_function"])
def test_the_tutorial_loop_trains_as_one_device_and_its_weights_are_saved(framework, distribute, tmp_path):
    """As the tutorial writes it: no plan_model. The strategy plans at the first
    strategy.run what the function passed to it trains (before: refused, and before
    that a guessed "mse" step failed)."""
    keras, legacy = LOOPS[framework], framework.endswith("legacy_sgd")
    reference = _Loop(keras, None, legacy=legacy)
    expected = reference.train(reference.strategy.experimental_distribute_dataset(_dataset()))
    strategy = TofuStrategy(8)
    loop = _Loop(keras, strategy, legacy=legacy, plan=False)
    if distribute == "dataset":
        dist = strategy.experimental_distribute_dataset(_dataset())
    else:
        dist = strategy.distribute_datasets_from_function(lambda context: _dataset())
    assert strategy.plan is None
    losses = loop.train(dist)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for got, want in zip(loop.model.get_weights(), reference.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    path = str(tmp_path / "after_the_loop.weights.h5")          # the data ended; weights still read and save
    loop.model.save_weights(path)
    reference.model.load_weights(path)
    for got, want in zip(reference.model.get_weights(), loop.model.get_weights()):
        np.testing.assert_array_equal(got, want)
    tensors = [path for path, layout in strategy.plan.variable_layouts.items() if len(layout) > 0]
    # The loop's own optimizer was traced: each weight and its momentum slot are planned.
    assert len(tensors) == 2 * len(loop.model.trainable_variables), strategy.plan.variable_layouts


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_run_on_eager_numpy_batches_plans_at_the_first_call_and_trains_as_one_device(framework):
    """``strategy.run`` called eagerly on numpy batches, no tf.function and no compile (tf-keras's
    own custom-loop tests do this; with the legacy SGD it failed: 'SGD' object has no attribute
    'add_variable_from_reference')."""
    keras, legacy = LOOPS[framework], framework.endswith("legacy_sgd")
    x, y = _data(GLOBAL_BATCH)
    reference = _Loop(keras, None, legacy=legacy)
    expected = [float(reference.train_step((x, y))) for _ in range(3)]
    strategy = TofuStrategy(8)
    loop = _Loop(keras, strategy, legacy=legacy, plan=False)
    losses = [float(strategy.reduce("SUM", strategy.run(loop.train_step, args=((x, y),)), axis=None))
              for _ in range(3)]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for got, want in zip(loop.model.get_weights(), reference.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_step_function_that_is_a_tf_function_of_its_own_trains_as_one_device():
    """tf-keras's own custom-loop tests decorate the step passed to run with tf.function: its
    gradients live in an inner graph, which capture inlines (was: KeyError naming a gradient)."""
    expected_loop = _Loop(tf_keras, None)
    expected = expected_loop.train(expected_loop.strategy.experimental_distribute_dataset(_dataset()))
    strategy = TofuStrategy(8)
    loop = _Loop(tf_keras, strategy, plan=False)
    loop.train_step = tf.function(loop.train_step)
    np.testing.assert_allclose(loop.train(strategy.experimental_distribute_dataset(_dataset())), expected, rtol=1e-5)
    for got, want in zip(loop.model.get_weights(), expected_loop.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_loop_planned_with_plan_model_trains_as_one_device():
    reference = _Loop(tf_keras, None)
    expected = reference.train(reference.strategy.experimental_distribute_dataset(_dataset()))
    strategy = TofuStrategy(8)
    loop = _Loop(tf_keras, strategy, plan=True)
    np.testing.assert_allclose(loop.train(strategy.experimental_distribute_dataset(_dataset())), expected, rtol=1e-5)


@pytest.mark.parametrize("method", ["data_parallel", "megatron"])
def test_reduce_gather_and_local_results_inside_and_outside_tf_function(method):
    """Per-sample values reduce over the global batch as MirroredStrategy reduces its
    replicas' slices: SUM/MEAN with axis=None leave a step's (global) value, axis=0
    reduces along the batch. Under data parallelism the per-sample values stay split over
    the batch: before, reading the reduced (axis=None), gathered or local values failed
    ("Trying to copy a non-single-device and non-replicated DTensor")."""
    strategy = TofuStrategy(8, method=method)
    loop = _Loop(tf_keras, strategy)
    x, y = _data(GLOBAL_BATCH)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))))

    def per_sample(inputs):
        return tf.reduce_sum(loop.model(inputs[0]), axis=1)

    def reductions(values):
        return (strategy.reduce("SUM", values, axis=0), strategy.reduce("MEAN", values, axis=0),
                strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None), strategy.gather(values, axis=0))

    want = np.sum(loop.model.predict(x, batch_size=GLOBAL_BATCH, verbose=0), axis=1)
    eager = reductions(strategy.run(per_sample, args=(batch,)))
    traced = tf.function(lambda b: reductions(strategy.run(per_sample, args=(b,))))(batch)
    for got in (eager, traced):
        total, mean, whole, gathered = (np.asarray(v) for v in got)
        np.testing.assert_allclose(total, want.sum(), rtol=1e-5)
        np.testing.assert_allclose(mean, want.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gathered, want, rtol=1e-5, atol=1e-6)
    (local,) = strategy.experimental_local_results(strategy.run(per_sample, args=(batch,)))
    np.testing.assert_allclose(np.asarray(local), want, rtol=1e-5, atol=1e-6)


# tf-keras's custom_training_loop_metrics_test.py (keras-team/tf-keras), its steps as written
# with TofuStrategy as the distribution: the functions passed to run update metrics and reach
# no model. Before: PlanningError ("no Keras model is reachable").
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_runs_that_train_no_model_update_metrics_data_parallel(framework, caplog):
    keras = FRAMEWORKS[framework]
    distribution = TofuStrategy(8)
    with distribution.scope():
        loss_metric = keras.metrics.Mean("loss", dtype=np.float32)
        loss_metric_2 = keras.metrics.Mean("loss_2", dtype=np.float32)

    @tf.function
    def train_step():
        def step_fn():
            loss = tf.constant(5.0, dtype=np.float32)
            loss_metric.update_state(loss)
            loss_metric_2.update_state(loss)

        distribution.run(step_fn)

    with caplog.at_level("WARNING", logger="absl"):
        train_step()
    assert loss_metric.result().numpy() == loss_metric_2.result().numpy() == 5.0
    assert "trains no Keras model" in caplog.text and "data parallel over 8 devices" in caplog.text
    assert distribution.plan.mesh_shape == {"batch": 8}

    with distribution.scope():
        metric = keras.metrics.Mean("test_metric", dtype=np.float32)
    dataset = distribution.experimental_distribute_dataset(tf.data.Dataset.range(16).batch(8))

    @tf.function
    def update(i):
        metric.update_state(i)

    for i in dataset:                      # batches of 8: split over the 8 devices
        distribution.run(update, args=(i,))
    assert metric.result().numpy() == 7.5

    with distribution.scope():             # a model after that would train unpartitioned: refused
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(10)])
        model.compile(optimizer="sgd", loss="mse")
    x, _ = _data(GLOBAL_BATCH)
    with pytest.raises(PlanningError, match=r"first strategy.run trained no model.*plan .* before that first run"):
        model.fit(x, np.zeros((GLOBAL_BATCH, 10), "float32"), batch_size=GLOBAL_BATCH, verbose=0)


def test_a_first_run_that_reaches_no_model_or_several_is_told_how_to_plan():
    """No guess: where the function passed to run reaches no model while one made in the scope
    waits for its plan, or reaches two, the strategy names plan_model and what to pass,
    before anything runs."""
    strategy = TofuStrategy(8)
    loop = _Loop(tf_keras, strategy, plan=False)
    x, _ = _data(GLOBAL_BATCH)
    with pytest.raises(PlanningError, match=r"no Keras model is reachable.*strategy.plan_model\(model, batch_size="):
        strategy.run(lambda features: tf.reduce_sum(features), args=(x,))
    model = loop.model
    with strategy.scope():
        other = tf_keras.Sequential([tf_keras.Input((16,)), tf_keras.layers.Dense(10)])
    with pytest.raises(UnsupportedModelError, match=r"trains several models \(sequential.*\), and TofuStrategy plans one"):
        strategy.run(lambda features: model(features) + other(features), args=(x,))
    assert strategy.plan is None


@pytest.mark.parametrize("in_function", [False, True])
def test_a_first_run_that_evaluates_a_model_without_an_optimizer_plans_it(in_function):
    """tf-keras's test_reduce_loss (custom_training_loop_models_test.py): the first run computes a
    model's loss and reaches no optimizer. Was refused ("no optimizer of model is reachable");
    now plans the model's training step with plain SGD, as predict before fit does, and the
    loss is one device's; a training loop after it trains as one device."""
    x, y = _data(GLOBAL_BATCH * 2)
    tf_keras.utils.set_random_seed(3)
    reference = tf_keras.Sequential([tf_keras.Input((16,)), tf_keras.layers.Dense(10)])
    initial = reference.get_weights()
    losses = tf_keras.losses.sparse_categorical_crossentropy

    def expected_loss(model):
        return losses(y[:GLOBAL_BATCH], model(x[:GLOBAL_BATCH]), from_logits=True).numpy()

    want = expected_loss(reference)
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((16,)), tf_keras.layers.Dense(10)])
    model.set_weights(initial)
    dist = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)))

    def loss_step(batch):
        features, labels = batch
        return losses(labels, model(features), from_logits=True)

    def run(batch):
        return strategy.run(loss_step, args=(batch,))
    per_example = (tf.function(run) if in_function else run)(next(dist))
    assert strategy.plan is not None
    np.testing.assert_allclose(strategy.gather(per_example, axis=0).numpy(), want, rtol=1e-6, atol=1e-6)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_example, axis=0)
    np.testing.assert_allclose(total.numpy(), want.sum(), rtol=1e-5)

    with strategy.scope():                 # then trained by a loop with its own optimizer
        optimizer = tf_keras.optimizers.SGD(0.1)
    reference_optimizer = tf_keras.optimizers.SGD(0.1)

    def train_step(batch, on_model, with_optimizer):
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(losses(labels, on_model(features), from_logits=True))
        with_optimizer.apply_gradients(zip(tape.gradient(loss, on_model.trainable_variables),
                                           on_model.trainable_variables))
        return loss

    tf.function(lambda batch: strategy.run(lambda b: train_step(b, model, optimizer), args=(batch,)))(next(dist))
    train_step((x[GLOBAL_BATCH:], y[GLOBAL_BATCH:]), reference, reference_optimizer)
    for got, want_weight, start in zip(model.get_weights(), reference.get_weights(), initial):
        assert np.abs(want_weight - start).max() > 1e-4
        np.testing.assert_allclose(got, want_weight, rtol=1e-5, atol=1e-6)


# TF's "Custom training with tf.distribute.Strategy" tutorial, its code as written (the
# strategy, the Keras module and the data are what the tutorial makes itself; the model is
# its create_model at a smaller width, on 12x12 images): module-level model, optimizer,
# loss function and metrics, reached by train_step through its globals.
_TUTORIAL = '''
with strategy.scope():
  loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
  def compute_loss(labels, predictions, model_losses):
    per_example_loss = loss_object(labels, predictions)
    loss = tf.nn.compute_average_loss(per_example_loss)
    if model_losses:
      loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
    return loss

with strategy.scope():
  test_loss = keras.metrics.Mean(name='test_loss')
  train_accuracy = keras.metrics.SparseCategoricalAccuracy(name='train_accuracy')
  test_accuracy = keras.metrics.SparseCategoricalAccuracy(name='test_accuracy')

with strategy.scope():
  keras.utils.set_random_seed(3)
  model = create_model()
  optimizer = keras.optimizers.Adam(learning_rate=0.01)
  checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)

def train_step(inputs):
  images, labels = inputs
  with tf.GradientTape() as tape:
    predictions = model(images, training=True)
    loss = compute_loss(labels, predictions, model.losses)
  gradients = tape.gradient(loss, model.trainable_variables)
  optimizer.apply_gradients(zip(gradients, model.trainable_variables))
  train_accuracy.update_state(labels, predictions)
  return loss

def test_step(inputs):
  images, labels = inputs
  predictions = model(images, training=False)
  t_loss = loss_object(labels, predictions)
  test_loss.update_state(t_loss)
  test_accuracy.update_state(labels, predictions)

@tf.function
def distributed_train_step(dataset_inputs):
  per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
  return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

@tf.function
def distributed_test_step(dataset_inputs):
  return strategy.run(test_step, args=(dataset_inputs,))

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

history = []
for epoch in range(EPOCHS):
  total_loss = 0.0
  num_batches = 0
  for x in train_dist_dataset:
    total_loss += distributed_train_step(x)
    num_batches += 1
  train_loss = total_loss / num_batches
  for x in test_dist_dataset:
    distributed_test_step(x)
  checkpoint.save(checkpoint_prefix)
  history.append((float(train_loss), float(train_accuracy.result()), float(test_loss.result()),
                  float(test_accuracy.result())))
  test_loss.reset_state()
  train_accuracy.reset_state()
  test_accuracy.reset_state()
'''


def _run_the_tutorial(keras, strategy, checkpoint_prefix):
    def create_model():
        return keras.Sequential([
            keras.Input((12, 12, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10)])

    rng = np.random.default_rng(7)
    images = rng.normal(size=(72, 12, 12, 1)).astype("float32")
    labels = rng.integers(0, 10, (72,)).astype("int64")
    namespace = {
        "tf": tf, "keras": keras, "strategy": strategy, "create_model": create_model, "EPOCHS": 2,
        "checkpoint_prefix": checkpoint_prefix,
        "train_dataset": tf.data.Dataset.from_tensor_slices((images[:56], labels[:56])).batch(GLOBAL_BATCH),
        "test_dataset": tf.data.Dataset.from_tensor_slices((images[56:], labels[56:])).batch(GLOBAL_BATCH)}
    exec(compile(_TUTORIAL, "custom_training_tutorial", "exec"), namespace)  # pylint: disable=exec-used
    return namespace


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_tfs_custom_training_tutorial_as_written_trains_as_one_device(framework, tmp_path):
    """Losses, accuracies and weights of the tutorial's two epochs equal the default
    strategy's, and its checkpoints restore into a one-device model."""
    keras = FRAMEWORKS[framework]
    reference = _run_the_tutorial(keras, tf.distribute.get_strategy(), str(tmp_path / "one" / "ckpt"))
    tofu = _run_the_tutorial(keras, TofuStrategy(8), str(tmp_path / "tofu" / "ckpt"))
    assert tofu["strategy"].plan is not None            # planned at the first strategy.run
    np.testing.assert_allclose(tofu["history"], reference["history"], rtol=1e-5, atol=1e-6)
    for got, want in zip(tofu["model"].get_weights(), reference["model"].get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    restored = reference["create_model"]()
    tf.train.Checkpoint(model=restored).restore(tf.train.latest_checkpoint(str(tmp_path / "tofu"))).expect_partial()
    for got, want in zip(restored.get_weights(), tofu["model"].get_weights()):
        np.testing.assert_array_equal(got, want)


# tf-keras's ctl_correctness_test and custom_training_loop_models_test take their batches inside
# the tf.function they call, from a dataset batched without drop_remainder (batch size unknown
# to the graph; 40 samples in batches of 16 end with a partial batch of 8). Before: PlanningError
# ("this batch's size is unknown").
_IN_FUNCTION_BATCH = 16


def _in_function_data():
    rng = np.random.default_rng(5)
    x = rng.random((40, 3)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, 3 * x[:, :1])).batch(_IN_FUNCTION_BATCH)


def _train_taking_batches_in_function(strategy, how):
    """Train as ctl_correctness_test's iteration_inside_func does (``how``: "next_in_call" passes
    an iterator to a step taking next(); "iter_in_call" makes the iterator inside an epoch
    function and takes two batches; "for_in_call" loops over the whole dataset inside it)."""
    with strategy.scope():
        tf_keras.utils.set_random_seed(2)
        model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(8, activation="relu"),
                                     tf_keras.layers.BatchNormalization(), tf_keras.layers.Dense(1)])
        optimizer = tf_keras.optimizers.SGD(0.1)
    dist = strategy.experimental_distribute_dataset(_in_function_data())

    def step_fn(inputs):
        samples, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(tf_keras.losses.mean_squared_error(labels, model(samples, training=True)),
                                              global_batch_size=_IN_FUNCTION_BATCH)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    def run(inputs):
        return strategy.reduce("SUM", strategy.run(step_fn, args=(inputs,)), axis=None)

    @tf.function
    def step(iterator):
        return run(next(iterator))

    @tf.function
    def epoch(dataset):
        total = 0.0
        if how == "iter_in_call":
            iterator = iter(dataset)
            for _ in range(2):
                total += run(next(iterator))
        else:
            for inputs in dataset:
                total += run(inputs)
        return total

    if how == "next_in_call":
        iterator = iter(dist)
        losses = [float(step(iterator)) for _ in range(3)]             # 16, 16, then the partial 8
    else:
        losses = [float(epoch(dist)) for _ in range(2)]
    return losses, model.get_weights()


@pytest.mark.parametrize("how", ["next_in_call", "iter_in_call", "for_in_call"])
def test_batches_taken_inside_the_tf_function_train_as_one_device(how):
    want_losses, want_weights = _train_taking_batches_in_function(tf.distribute.get_strategy(), how)
    strategy = TofuStrategy(8)
    losses, weights = _train_taking_batches_in_function(strategy, how)
    assert strategy.plan is not None
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_batch_taken_inside_the_tf_function_of_another_shape_than_traced_is_refused(monkeypatch):
    """Never a silent wrong shape: a step taking two batches per call meets the partial batch
    second (the iterator keys the trace by its next batch only); an unrolled loop longer than
    the limit is refused, naming the way out."""
    from tofu_tf.strategies import traced_batches

    strategy = TofuStrategy(8)
    loop = _Loop(tf_keras, strategy)
    dist = strategy.experimental_distribute_dataset(_dataset())          # 16, 16, 16, then 8

    @tf.function
    def two_steps(iterator):
        return [strategy.run(loop.train_step, args=(next(iterator),)) for _ in range(2)]

    iterator = iter(dist)
    two_steps(iterator)
    with pytest.raises(traced_batches.TracedBatchError, match=r"has shapes .* where the tf.function was traced for"):
        two_steps(iterator)
    monkeypatch.setattr(traced_batches, "MAX_UNROLLED_BATCHES", 1)

    @tf.function
    def epoch(dataset):
        for batch in dataset:
            strategy.run(loop.train_step, args=(batch,))

    with pytest.raises(traced_batches.TracedBatchError, match=r"more than 1 batches.*Iterate outside the tf.function"):
        epoch(dist)                         # raised while tracing, passed through by AutoGraph unchanged


def test_a_bare_layer_run_on_a_batch_taken_inside_the_tf_function_computes_as_one_device():
    """custom_training_loop_models_test's single-layer and tf.Module runs: no Model, the layer
    built inside the step. Before: RuntimeError ('is_dtensor must be called eagerly'), the batch
    read in the graph being no DTensor."""
    x, y = _data(GLOBAL_BATCH * 2)
    targets = np.stack([y, y, y, y], axis=1).astype("float32")

    def gradients(strategy):
        dist = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, targets)).batch(GLOBAL_BATCH, drop_remainder=True))
        with strategy.scope():
            layer = tf_keras.layers.Dense(4, kernel_initializer="ones")

        @tf.function
        def step(iterator):
            def fn(features, labels):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf_keras.losses.mean_squared_error(labels, layer(features)))
                return tape.gradient(loss, layer.variables)
            return strategy.run(fn, args=next(iterator))
        iterator = iter(dist)
        return [[np.asarray(strategy.experimental_local_results(g)[0]) for g in step(iterator)] for _ in range(2)]

    for got, want in zip(gradients(TofuStrategy(8)), gradients(tf.distribute.get_strategy())):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5)


@pytest.mark.parametrize("make", [
    lambda: tf_keras.metrics.AUC(num_thresholds=3),
    lambda: tf_keras.metrics.Precision(),
    lambda: tf_keras.metrics.Recall(),
    lambda: tf_keras.metrics.PrecisionAtRecall(0.5, num_thresholds=10),
], ids=["auc", "precision", "recall", "precision_at_recall"])
def test_a_metric_run_eagerly_on_python_lists_gives_one_devices_result(make):
    """keras_metrics_test's steps: strategy.run(metric, args=(labels, predictions)) eagerly, the
    two as Python lists. Before: the lists were laid out number by number (Pack refused int64
    beside double), and Precision's thresholds, a host tensor, met the batch on the mesh in an
    eager op (Tile refused a regular tensor)."""
    labels, predictions = [0, 0, 1, 1, 0, 1], [0, 0.5, 0.3, 0.9, 0.6, 0.8]
    want = make()
    want.update_state(labels, predictions)
    strategy = TofuStrategy(8)
    with strategy.scope():
        metric = make()
    update = strategy.run(metric, args=(labels, predictions))
    np.testing.assert_allclose(update.numpy(), want.result().numpy(), rtol=1e-6)   # run's result reads on the host
    np.testing.assert_allclose(float(metric.result()), float(want.result()), rtol=1e-6)
    strategy.run(metric.update_state, args=(labels, predictions))               # a method, traced once more
    want.update_state(labels, predictions)
    np.testing.assert_allclose(float(metric.result()), float(want.result()), rtol=1e-6)


def test_a_dataset_iterated_inside_the_tf_function_is_refused_naming_the_distributed_one():
    """custom_training_loop_metrics_test's dynamic-shape case: ``for i in dataset`` over a plain
    tf.data.Dataset inside a tf.function, ``strategy.run`` in the body. AutoGraph writes that loop as
    a dataset scan whose body tf.data runs on the host; before, DTensor failed to compile the
    function ("'tf_device.cluster' op failed to merge mesh cluster", no word of the dataset). The
    remedy the error names, the distributed dataset iterated in the same function, gives one
    device's mean."""
    from tofu_tf.strategies import traced_batches
    strategy = TofuStrategy(8)
    with strategy.scope():
        metric = tf_keras.metrics.Mean("mean", dtype=np.float32)
    dataset = tf.data.Dataset.range(16).batch(8)

    @tf.function
    def train(data):
        for batch in data:
            strategy.run(metric.update_state, args=(batch,))

    with pytest.raises(traced_batches.TracedBatchError, match=r"inside the tf.data function 'Dataset_scan.*"
                                                              r"strategy.experimental_distribute_dataset"):
        train(dataset)
    train(strategy.experimental_distribute_dataset(dataset))
    assert float(metric.result()) == 7.5


def _subclassed_run(keras, strategy, legacy):
    """tf-keras's custom_training_loop_models_test ``test_keras_subclass_model_optimizer_run``: a
    subclassed model made in the scope, unbuilt until the step calls it, trained by a custom loop."""
    class KerasSubclassModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4, name="dense")

        def call(self, x):
            return self.dense(x)

    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = KerasSubclassModel()
        optimizer = keras.optimizers.legacy.RMSprop() if legacy else keras.optimizers.RMSprop()
    rng = np.random.default_rng(3)
    data = tf.data.Dataset.from_tensor_slices((rng.normal(size=(30, 3)).astype("float32"),
                                               rng.normal(size=(30, 4)).astype("float32"))).batch(10)

    @tf.function
    def train_step(iterator):
        def step_fn(inputs):
            images, targets = inputs
            with tf.GradientTape() as tape:
                loss = keras.losses.mean_squared_error(targets, model(images))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        strategy.run(step_fn, args=(next(iterator),))
    iterator = iter(strategy.experimental_distribute_dataset(data))
    for _ in range(2):
        train_step(iterator)
    return model.get_weights()


@pytest.mark.parametrize("framework,legacy", [("tf_keras", True), ("tf_keras", False), ("keras3", False)])
def test_a_subclassed_model_first_called_in_the_step_trains_as_one_device(framework, legacy):
    """Before, its weights were made in capture's trace (handles without buffers): a legacy optimizer
    refused to add slots for them ("Trying to create optimizer slot variable under the scope ...")
    and the others' gradients named no weight of the model ("applied no gradient of
    keras_subclass_model's weights"). The strategy now builds it by tracing the step first."""
    keras = FRAMEWORKS[framework]
    got = _subclassed_run(keras, TofuStrategy(num_gpus=8), legacy)
    for weight, expected in zip(got, _subclassed_run(keras, None, legacy)):
        np.testing.assert_allclose(weight, expected, rtol=1e-5, atol=1e-6)
