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

from strategies import TofuStrategy
from strategies.tofu_strategy import PlanningError

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
    keras, legacy = LOOPS[framework], framework.endswith("legacy_sgd")
    reference = _Loop(keras, None, legacy=legacy)
    expected = reference.train(reference.strategy.experimental_distribute_dataset(_dataset()))
    strategy = TofuStrategy(8)
    loop = _Loop(keras, strategy, legacy=legacy)
    if distribute == "dataset":
        dist = strategy.experimental_distribute_dataset(_dataset())
    else:
        dist = strategy.distribute_datasets_from_function(lambda context: _dataset())
    losses = loop.train(dist)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for got, want in zip(loop.model.get_weights(), reference.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    path = str(tmp_path / "after_the_loop.weights.h5")          # the data ended; weights still read and save
    loop.model.save_weights(path)
    reference.model.load_weights(path)
    for got, want in zip(reference.model.get_weights(), loop.model.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_reduce_gather_and_local_results_inside_and_outside_tf_function():
    """Per-sample values reduce over the global batch as MirroredStrategy reduces its
    replicas' slices: SUM/MEAN with axis=None leave a step's (global) value, axis=0
    reduces along the batch."""
    strategy = TofuStrategy(8)
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


def test_a_loop_that_distributes_its_data_before_any_plan_is_told_how_to_plan():
    """No guess: the strategy names plan_model and what to pass (was: planned the
    script's model with an "mse" loss, then a shape error)."""
    strategy = TofuStrategy(8)
    _Loop(tf_keras, strategy, plan=False)
    with pytest.raises(PlanningError, match=r"strategy.plan_model\(model, batch_size=.*loss=.*optimizer="):
        strategy.experimental_distribute_dataset(_dataset())
