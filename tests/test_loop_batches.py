"""Batches taken inside a loop the graph runs train as one device (``traced_batches.MeshBatches``).

``for _ in tf.range(n): strategy.run(step, args=(next(iterator),))`` inside one ``tf.function``
is Orbit's and Model Garden's default training loop. Before, the trace failed in TensorFlow's
``while_v2`` ("body_graph has 19 outputs; Expected: 20"): the batch became an input captured
at call time inside the loop body. Orbit and Model Garden themselves: tests/test_orbit.py.

The step is TF's custom-training tutorial's (``compute_average_loss`` over the global batch)
with SGD, compared with one device at rtol 1e-5 / atol 1e-6.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tofu_tf.strategies import TofuStrategy
from tofu_tf.strategies.batches import to_host
from tofu_tf.strategies.traced_batches import TracedBatchError

pytestmark = pytest.mark.slow   # trains under TofuStrategy

BATCH = 8
PLAN_MESH = {"batch": 2, "model": 4}


def _model():
    keras.utils.set_random_seed(4)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])


def _dataset(repeat=True):
    rng = np.random.RandomState(0)
    data = tf.data.Dataset.from_tensor_slices((rng.randn(64, 16).astype("float32"), rng.randint(0, 4, 64)))
    data = data.batch(BATCH, drop_remainder=True)
    return data.repeat() if repeat else data


def _step(model, optimizer):
    def step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            per_example = keras.losses.sparse_categorical_crossentropy(y, model(x, training=True), from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def _one_device(steps):
    model, optimizer = _model(), keras.optimizers.SGD(0.1)
    step = _step(model, optimizer)
    for batch in _dataset().take(steps):
        step(batch)
    return model.get_weights()


def _under_strategy():
    strategy = TofuStrategy(num_gpus=8, mesh_shape=PLAN_MESH)
    with strategy.scope():
        model, optimizer = _model(), keras.optimizers.SGD(0.1)
    step = _step(model, optimizer)

    @tf.function
    def train(iterator, num_steps):
        for _ in tf.range(num_steps):
            strategy.run(step, args=(next(iterator),))
    return strategy, model, step, train


def test_a_tf_range_loop_takes_a_batch_per_iteration_as_one_device():
    strategy, model, step, train = _under_strategy()
    iterator = iter(strategy.experimental_distribute_dataset(_dataset()))
    train(iterator, tf.constant(3))                     # plans at the first run, inside the loop's trace
    traces = train.experimental_get_tracing_count()     # (twice: the first trace made the plan's variables)
    train(iterator, tf.constant(2))                     # the same trace, the next two batches
    assert train.experimental_get_tracing_count() == traces
    for got, want in zip(model.get_weights(), _one_device(5)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    strategy.run(step, args=(next(iterator),))          # eagerly after the loop: the 6th batch, one stream
    for got, want in zip(model.get_weights(), _one_device(6)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_batch_split_over_a_later_mesh_axis_reaches_each_device_as_the_mesh_lays_it_out():
    """A batch split over ``batch``, the second axis of a ``model=2 x batch=4`` mesh: device d
    (mesh coordinates d // 4, d % 4) holds part d % 4. TensorFlow's DTensorDataset hands a split
    batch's parts to the devices in device order, right only over a mesh's first axis: devices 0
    and 1 got part 0, so copies DTensor treats as one value held other samples, and a step trained
    on them (Model Garden's ``run_experiment``, whose loop reads batches so, moved 5% from one
    device's loss in its first step under a plan splitting its batch over ``model`` of
    ``batch=2 x model=4``). Each device now reads the whole batch and keeps its part."""
    from tensorflow.experimental import dtensor
    from tofu_tf.strategies.batches import BatchPlacer
    from tofu_tf.strategies.traced_batches import MeshBatches
    mesh = dtensor.create_mesh([("model", 2), ("batch", 4)], devices=[f"CPU:{i}" for i in range(8)])
    samples = np.arange(16, dtype="float32").reshape(8, 2)
    data = tf.data.Dataset.from_tensor_slices((samples, np.arange(8))).batch(8).repeat()
    batches = MeshBatches(data, lambda: BatchPlacer(mesh, "batch"))
    batches.start(next(iter(data)))

    @tf.function
    def read_in_the_graph():
        return batches.next_in_trace()

    for x, y in (batches.next_eager(), read_in_the_graph()):
        for device, (x_part, y_part) in enumerate(zip(dtensor.unpack(x), dtensor.unpack(y))):
            part = device % 4
            np.testing.assert_array_equal(x_part.numpy(), samples[2 * part:2 * part + 2], err_msg=f"device {device}")
            np.testing.assert_array_equal(y_part.numpy(), [2 * part, 2 * part + 1], err_msg=f"device {device}")


def test_a_loop_after_batches_taken_another_way_is_refused():
    strategy, _, step, train = _under_strategy()
    iterator = iter(strategy.experimental_distribute_dataset(_dataset()))
    strategy.run(step, args=(next(iterator),))          # one batch taken eagerly, outside the loop
    with pytest.raises(TracedBatchError, match="already gave 1 batch"):
        train(iterator, tf.constant(2))                 # raised while tracing, passed through by AutoGraph unchanged


def test_a_new_iterator_per_call_reuses_the_trace_and_two_in_one_call_stay_apart():
    """Each call's batches come from the iterators that call passes (``IteratorTraceType`` keys a
    trace by the dataset and the batch signature, and binds each argument's iterator at the call):
    a new iterator over the same dataset reuses the trace (issue #36: Orbit's evaluator makes one
    per round), and two iterators of one dataset in one call each give their own batch."""
    strategy, _, step, _ = _under_strategy()
    dist = strategy.experimental_distribute_dataset(_dataset(repeat=False))
    strategy.run(step, args=(next(iter(dist)),))        # plans
    traces = []

    @tf.function
    def sums(first, second):
        traces.append(1)
        return tf.reduce_sum(next(first)[0]), tf.reduce_sum(next(second)[0])
    want = [float(x.numpy().sum()) for x, _ in _dataset(repeat=False)]
    first, second = iter(dist), iter(dist)
    next(second)
    np.testing.assert_allclose([float(to_host(v)) for v in sums(first, second)], [want[0], want[1]], rtol=1e-6)
    first, second = iter(dist), iter(dist)
    next(first), next(first)
    np.testing.assert_allclose([float(to_host(v)) for v in sums(first, second)], [want[2], want[0]], rtol=1e-6)
    assert len(traces) == 1


def test_a_loop_the_graph_runs_traces_again_for_a_new_iterator():
    """A trace whose loop reads its batches in the graph holds the first iterator's DTensor iterator:
    a new iterator traces again and trains on its own batches, from the dataset's start."""
    strategy, model, _, train = _under_strategy()
    train(iter(strategy.experimental_distribute_dataset(_dataset())), tf.constant(2))
    traces = train.experimental_get_tracing_count()
    train(iter(strategy.experimental_distribute_dataset(_dataset())), tf.constant(2))
    assert train.experimental_get_tracing_count() > traces
    one_model, optimizer = _model(), keras.optimizers.SGD(0.1)
    one_step = _step(one_model, optimizer)
    for batch in _dataset().take(2).concatenate(_dataset().take(2)):
        one_step(batch)
    for got, want in zip(model.get_weights(), one_model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _regression(samples):
    rng = np.random.RandomState(1)
    return tf.data.Dataset.from_tensor_slices(
        (rng.randn(samples, 3).astype("float32"), rng.randn(samples, 4).astype("float32"))).batch(10)


def _regression_run(strategy, steps, samples):
    """tf-keras's custom_training_loop_models_test loop (a Dense over 3 features, its per-sample
    mean squared error as the loss, the batches taken in a ``tf.range`` loop), with SGD so that it
    compares exactly (the test's legacy RMSprop: tests/test_legacy_optimizers.py)."""
    with strategy.scope():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(4)(inputs))
        optimizer = keras.optimizers.SGD(0.1)

    @tf.function
    def train(iterator):
        def step(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                loss = keras.losses.mean_squared_error(y, model(x))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        for _ in tf.range(steps):
            strategy.run(step, args=(next(iterator),))
    train(iter(strategy.experimental_distribute_dataset(_regression(samples))))
    return model


def test_a_replicated_batch_in_a_loop_keeps_its_layout_where_the_plan_shards_its_consumer():
    """Batches of 10 on a mesh with no axis dividing them run replicated; the targets meet an
    output the plan shards on its last dimension. DTensor inferred the loop's batch layout from
    that consumer and the loop failed ("Incompatible shapes at component 1: expected [10,2] but
    got [10,4]"), asynchronously, at the next eager op; now every step computes one device's."""
    model = _regression_run(TofuStrategy(num_gpus=8, mesh_shape={"model": 2, "model1": 4}), steps=3, samples=30)
    want = _regression_run(tf.distribute.get_strategy(), steps=3, samples=30)
    for got, expected in zip(model.get_weights(), want.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_loop_reaching_a_partial_last_batch_fails_naming_it():
    """31 samples in batches of 10 and four iterations (tf-keras's test as written): the loop's
    program is compiled for 10 samples, so the fourth batch (1 sample) cannot run in it. Before,
    DTensor's iterator dropped it and the loop failed with a bare "End of sequence" (and an eager
    ``next`` after a shorter loop ended the data there); now the error names it and the fix. The
    error surfaces at the next op that waits on the loop (DTensor runs the program asynchronously)."""
    with pytest.raises(tf.errors.InvalidArgumentError, match="reached a partial last batch"):
        model = _regression_run(TofuStrategy(num_gpus=8, mesh_shape={"model": 2, "model1": 4}), steps=4, samples=31)
        model.get_weights()
    assert float(tf.reduce_sum(tf.ones(3))) == 3.0        # the process goes on
