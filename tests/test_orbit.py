"""Orbit's ``Controller`` over a ``StandardTrainer`` with its defaults trains under TofuStrategy
as on one device (Orbit under the default strategy).

Orbit (TensorFlow Model Garden's loop library, in the ``tf-models-nightly`` wheel) runs
``for _ in tf.range(num_steps): strategy.run(step_fn, args=(next(iterator),))`` in one
``tf.function`` (``use_tf_while_loop=True``, its default). Before, the trace failed in
``while_v2`` ("body_graph has 19 outputs; Expected: 20"). The step follows TF's
custom-training tutorial (``compute_average_loss`` over the global batch); weights and the loss
metric are compared at rtol 1e-5 / atol 1e-6 (SGD). MirroredStrategy on the same 8 CPUs gives the
same weights (checked by hand); it is not the reference here because its collectives share group
keys with other MirroredStrategies of the test process ("joining a group with size8, but that
group has size 2"), and its Mean metric adds each replica's share of the loss (1/8 of the value).

``tf-models-nightly`` pins a nightly TensorFlow, so it is installed without its dependencies
(``.ci/run``); Orbit itself needs only TensorFlow and tf-keras. Without it these tests skip.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tofu_tf.strategies import TofuStrategy

orbit = pytest.importorskip("orbit", reason="Orbit comes with tf-models-nightly: "
                                            "pip install --no-deps tf-models-nightly (see .ci/run)")

pytestmark = pytest.mark.slow   # trains under two strategies

BATCH, STEPS_PER_LOOP, STEPS = 8, 3, 6


def _dataset(repeat=True):
    rng = np.random.RandomState(0)
    data = tf.data.Dataset.from_tensor_slices((rng.randn(64, 16).astype("float32"), rng.randint(0, 4, 64)))
    data = data.batch(BATCH, drop_remainder=True)
    return data.repeat() if repeat else data


class _Trainer(orbit.StandardTrainer):
    """keras.io / Orbit's own example trainer, as a user writes it."""

    def __init__(self, strategy):
        self.strategy = strategy
        with strategy.scope():
            keras.utils.set_random_seed(1)
            self.model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                           keras.layers.Dense(4)])
            self.optimizer = keras.optimizers.SGD(0.1)
            self.train_loss = keras.metrics.Mean("loss")
        super().__init__(strategy.experimental_distribute_dataset(_dataset()))   # options: Orbit's defaults

    def train_loop_begin(self):
        self.train_loss.reset_states()

    def train_step(self, iterator):
        def step_fn(inputs):
            x, y = inputs
            with tf.GradientTape() as tape:
                per_example = keras.losses.sparse_categorical_crossentropy(y, self.model(x, training=True),
                                                                           from_logits=True)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH)
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
            self.train_loss.update_state(loss)
        self.strategy.run(step_fn, args=(next(iterator),))

    def train_loop_end(self):
        return {"loss": self.train_loss.result()}


def _train(strategy):
    trainer = _Trainer(strategy)
    assert trainer._train_options.use_tf_while_loop      # pylint: disable=protected-access
    controller = orbit.Controller(trainer=trainer, strategy=strategy, steps_per_loop=STEPS_PER_LOOP,
                                  global_step=trainer.optimizer.iterations)
    controller.train(steps=STEPS)
    return trainer


def test_orbit_default_loop_trains_as_one_device():
    one_device = _train(tf.distribute.get_strategy())
    tofu = _train(TofuStrategy(num_gpus=8, mesh_shape={"batch": 2, "model": 4}))
    assert int(tofu.optimizer.iterations.numpy()) == STEPS
    for got, want in zip(tofu.model.get_weights(), one_device.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(tofu.train_loss.result()), float(one_device.train_loss.result()), rtol=1e-5)


class _Evaluator(orbit.StandardEvaluator):
    """Orbit's evaluator with its defaults: each round makes a new iterator over the evaluation
    dataset and calls the ``tf.function``-wrapped ``eval_step`` with it, step by step."""

    def __init__(self, strategy, model):
        self.strategy = strategy
        self.model = model
        self.traces = 0
        with strategy.scope():
            self.eval_loss = keras.metrics.Mean("loss")
        super().__init__(strategy.experimental_distribute_dataset(_dataset(repeat=False)))

    def eval_begin(self):
        self.eval_loss.reset_states()

    def eval_step(self, iterator):
        self.traces += 1                                 # runs in Python only while tf.function traces
        def step_fn(inputs):
            x, y = inputs
            per_example = keras.losses.sparse_categorical_crossentropy(y, self.model(x, training=False),
                                                                       from_logits=True)
            self.eval_loss.update_state(tf.nn.compute_average_loss(per_example, global_batch_size=BATCH))
        self.strategy.run(step_fn, args=(next(iterator),))

    def eval_end(self):
        return {"loss": self.eval_loss.result()}


def _train_and_evaluate(strategy, rounds=3):
    trainer = _Trainer(strategy)
    evaluator = _Evaluator(strategy, trainer.model)
    assert evaluator._eval_options.use_tf_function          # pylint: disable=protected-access
    controller = orbit.Controller(trainer=trainer, evaluator=evaluator, strategy=strategy,
                                  steps_per_loop=STEPS_PER_LOOP, global_step=trainer.optimizer.iterations)
    losses = []
    for _ in range(rounds):
        controller.train(steps=int(trainer.optimizer.iterations.numpy()) + STEPS_PER_LOOP)
        losses.append(float(controller.evaluate(steps=4)["loss"]))
    return evaluator, losses


def test_evaluation_rounds_reuse_their_trace_and_match_one_device():
    """Each round's new iterator traces ``eval_step`` again under TofuStrategy, 4 s a round on 8 CPUs
    (issue #36): its trace now binds the iterator passed at each call, so rounds after the first
    reuse it, as under the default strategy."""
    one_device, want = _train_and_evaluate(tf.distribute.get_strategy())
    tofu, got = _train_and_evaluate(TofuStrategy(num_gpus=8, mesh_shape={"batch": 2, "model": 4}))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert tofu.traces == one_device.traces == 1
