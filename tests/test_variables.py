"""Variables TofuStrategy creates: optimizer slots start as shards, never as a full-size tensor."""

import contextlib
import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from tensorflow.experimental import dtensor

from tofu_tf.tf import devices, keras_adapter, lowering
from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf.compat import optimizers as compat_optimizers


def _mesh():
    device_set = devices.DeviceSet("CPU", tuple(f"CPU:{i}" for i in range(8)), virtual=True)
    return lowering.make_mesh({"batch": 2, "model": 4}, device_set)


def test_deferred_zeros_materialize_shard_by_shard():
    mesh = _mesh()
    layout = dtensor.Layout(["model", "batch"], mesh)
    deferred = variables_lib.DeferredVariable(
        initial_value=keras_adapter.DeferredZeros((8, 6), tf.float32), shape=tf.TensorShape((8, 6)),
        dtype=tf.float32, name="slot", trainable=False, extra_kwargs={})
    variable = variables_lib.materialize(deferred, layout)
    assert isinstance(variable, variables_lib.TofuVariable) and variable.layout == layout
    shards = dtensor.unpack(variable.read_value())
    assert len(shards) == 8 and all(tuple(s.shape) == (2, 3) for s in shards)
    np.testing.assert_array_equal(variable.numpy(), np.zeros((8, 6), np.float32))


def test_variable_handles_share_one_debug_name(monkeypatch):
    """DTensor caches each eager op's program by the op's attributes; a handle named after its
    variable compiled a program per variable (about 9 ms each on 8 virtual CPUs). Handles get
    one debug name; the variables keep their names. Fails if TF stops passing ``debug_name``
    to ``var_handle_op`` by keyword (the patch would then do nothing)."""
    from tensorflow.python.ops import gen_resource_variable_ops
    seen = []
    original = gen_resource_variable_ops.var_handle_op

    def recording(*args, **kwargs):
        seen.append(kwargs.get("debug_name"))
        return original(*args, **kwargs)
    monkeypatch.setattr(gen_resource_variable_ops, "var_handle_op", recording)
    layout = dtensor.Layout(["model", "batch"], _mesh())
    names = []
    for index in range(2):
        variable = variables_lib.TofuVariable(variables_lib.sharded_zeros((8, 6), tf.float32, layout),
                                              name=f"weight_{index}", layout=layout)
        names.append(variable.name)
    assert seen == [variables_lib.HANDLE_DEBUG_NAME] * 2
    assert names == ["weight_0:0", "weight_1:0"]
    assert gen_resource_variable_ops.var_handle_op is recording      # restored after each creation


def test_tf_keras_slots_are_requested_as_deferred_zeros():
    """The optimizer asks for slots without computing them: no full-size tf.zeros."""
    weight = tf.Variable(tf.ones((16, 4)), name="w")
    optimizer = keras.optimizers.Adam(0.1)
    assert compat_optimizers.defer_slot_zeros(optimizer).change.name == "slot_zeros_deferred"
    assert compat_optimizers.defer_slot_zeros(optimizer) is None  # idempotent: one wrapper, not two
    requested = []

    def creator(next_creator, **kwargs):
        requested.append((kwargs["name"], kwargs["initial_value"]))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        optimizer.build([weight])
    slots = [value for name, value in requested if name.startswith(("m/", "v/"))]
    assert len(slots) == 2
    assert all(isinstance(value, keras_adapter.DeferredZeros) and value.shape == (16, 4) for value in slots)
    optimizer.apply_gradients([(tf.ones((16, 4)), weight)])  # the slots still work as zeros
    np.testing.assert_allclose(weight.numpy(), np.full((16, 4), 0.9), rtol=1e-5)


def test_whole_initial_values_are_scattered_shard_by_shard():
    """A value with no sharded initializer is built on the host and each device gets its slice."""
    mesh = _mesh()
    layout = dtensor.Layout(["batch", "model"], mesh)
    full = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    deferred = variables_lib.DeferredVariable(
        initial_value=lambda: tf.constant(full), shape=tf.TensorShape((4, 8)), dtype=tf.float32,
        name="table", trainable=True, extra_kwargs={})
    variable = variables_lib.materialize(deferred, layout)
    shards = dtensor.unpack(variable.read_value())
    for shard, location in zip(shards, mesh.local_device_locations()):
        rows, cols = location["batch"] * 2, location["model"] * 2
        np.testing.assert_array_equal(shard.numpy(), full[rows:rows + 2, cols:cols + 2])
    np.testing.assert_array_equal(variable.numpy(), full)


def test_drawing_together_gives_the_values_drawn_one_by_one():
    """materialize_all draws Keras initializers in one DTensor function; each value, its
    layout and its shards equal what materialize draws for that variable alone."""
    mesh = _mesh()
    specs = [("k0", (8, 12), dtensor.Layout([dtensor.UNSHARDED, "model"], mesh), keras.initializers.GlorotUniform(seed=3)),
             ("k1", (12, 8), dtensor.Layout(["model", "batch"], mesh), keras.initializers.RandomNormal(seed=4)),
             ("b0", (12,), dtensor.Layout(["model"], mesh), keras.initializers.Zeros()),
             ("b1", (8,), dtensor.Layout.replicated(mesh, 1), keras.initializers.RandomUniform(seed=5)),
             ("c", (4, 8), dtensor.Layout(["batch", "model"], mesh), lambda: tf.reshape(tf.range(32.0), (4, 8)))]

    def deferred():
        made = []
        for name, shape, layout, init in specs:
            value = init if not isinstance(init, keras.initializers.Initializer) else \
                functools.partial(init, shape, dtype=tf.float32)
            made.append((variables_lib.DeferredVariable(
                initial_value=value, shape=tf.TensorShape(shape), dtype=tf.float32, name=name, trainable=True,
                extra_kwargs={}), layout))
        return made

    alone = [variables_lib.materialize(variable, layout) for variable, layout in deferred()]
    together = deferred()
    variables_lib.materialize_all(together)
    for one, (other, layout) in zip(alone, together):
        assert isinstance(other, variables_lib.TofuVariable) and other.layout == layout == one.layout
        for a, b in zip(dtensor.unpack(one.read_value()), dtensor.unpack(other.read_value())):
            assert a.shape == b.shape
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=one.name)
    assert np.abs(together[0][0].numpy()).max() > 0  # drawn, not left at zero


_DRAW_PROBE = """
import functools
import sys
from tofu_tf.tf import devices
devices.configure_virtual_cpus(8)
import tensorflow as tf
import tf_keras as keras
from tensorflow.experimental import dtensor
from tofu_tf.tf import lowering
from tofu_tf.tf import variables as variables_lib
mesh = lowering.make_mesh({"model": 8}, devices.DeviceSet("CPU", tuple(f"CPU:{i}" for i in range(8)), virtual=True))
shape = (2048, 2048)
kind = getattr(keras.initializers, sys.argv[1])
init = functools.partial(kind() if sys.argv[1] == "Zeros" else kind(seed=1), shape, dtype=tf.float32)
deferred = variables_lib.DeferredVariable(initial_value=init, shape=tf.TensorShape(shape), dtype=tf.float32,
                                          name="kernel", trainable=True, extra_kwargs={})
tf.config.experimental.reset_memory_stats("CPU:0")
start = tf.config.experimental.get_memory_info("CPU:0")["current"]
specs = ["model", dtensor.UNSHARDED] if sys.argv[2] == "rows" else [dtensor.UNSHARDED, "model"]
variables_lib.materialize(deferred, dtensor.Layout(specs, mesh))
print(4 * shape[0] * shape[1], tf.config.experimental.get_memory_info("CPU:0")["peak"] - start)
"""


# Scalars and shapes the runtime allocates beside the values (a run under load once peaked 256
# bytes over the 1.25x of a shard-by-shard fill).
SMALL_BYTES = 64 * 1024


@pytest.mark.slow   # a fresh Python per initializer, measuring its allocations
@pytest.mark.parametrize("initializer, split, most", [("Zeros", "cols", 1.5), ("GlorotUniform", "rows", 1.5),
                                                     ("GlorotUniform", "cols", 3.5), ("Orthogonal", "cols", 6.0)])
def test_sharded_draw_allocates_only_the_shards(initializer, split, most):
    """A kernel sharded on 8 devices. A constant fill is filled shard by shard: the process
    (all 8 virtual CPUs share one allocator) peaks at the kernel's size once, its shards, plus
    the fills in flight on the devices filling at the same moment (1.375x in a loaded CI run of
    2026-12-07: three shards' temporaries; filled whole on the host it would be 2x at least). So
    does a uniform draw split by rows, each device drawing its rows by global index (plus one
    shard's temporaries, the scaling of the drawn words: 1.25x). Split
    by columns it is drawn whole on the host, as one device draws it (its values must not
    depend on the plan, tests/test_initial_values.py), then each device receives its shard:
    3.0x in this shared allocator (the host value, its host copy, the shards; drawn under
    the split layout it was 1.0x, but other numbers). On accelerators the devices hold only
    their shards either way. Orthogonal needs the whole matrix (a QR): built once on the
    host, about 4x; drawn inside a DTensor function it was computed on every device, 16x.

    Runs in a subprocess: the allocator statistics need TF_CPU_ALLOCATOR_USE_BFC set before
    TF starts, and that allocator is not used by the rest of the suite.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", _DRAW_PROBE, initializer, split], env=env, capture_output=True,
                         text=True, check=True, timeout=300)
    full_bytes, peak = (int(v) for v in out.stdout.split()[-2:])
    assert peak < most * full_bytes + SMALL_BYTES, (peak, full_bytes)


def test_deferred_variables_keep_eager_values_on_the_host_until_planned():
    """Keras sets and reads counters before the plan, users read and load weights: a
    deferred variable computes its value on the host at its first eager use, keeps it
    there, and is laid out with whatever it holds when the plan comes. Only a variable
    whose shape is not known has no value to give."""
    counter = variables_lib.DeferredVariable(
        initial_value=lambda: tf.constant(5, tf.int64), shape=tf.TensorShape(()), dtype=tf.int64,
        name="counter", trainable=False, extra_kwargs={})
    assert counter.numpy() == 5
    counter.assign(2)
    counter.assign_add(tf.constant(7, tf.int64))
    counter.assign_sub(1)
    assert int(counter.read_value()) == 8 and counter.numpy().dtype == np.int64
    big = variables_lib.DeferredVariable(
        initial_value=keras_adapter.DeferredZeros((16, 8), tf.float32), shape=tf.TensorShape((16, 8)),
        dtype=tf.float32, name="big", trainable=True, extra_kwargs={})
    np.testing.assert_array_equal(big.numpy(), np.zeros((16, 8), np.float32))
    big.assign_add(tf.ones((16, 8)))
    np.testing.assert_array_equal(big.read_value(), np.ones((16, 8), np.float32))
    loaded = np.arange(128, dtype=np.float32).reshape(16, 8)
    big.assign(loaded)
    np.testing.assert_array_equal(big.numpy(), loaded)
    mesh = _mesh()
    planned = variables_lib.materialize(counter, dtensor.Layout.replicated(mesh, 0))
    assert isinstance(planned, variables_lib.TofuVariable) and planned.numpy() == 8
    assert all(int(shard) == 8 for shard in dtensor.unpack(planned.read_value()))
    sharded = variables_lib.materialize(big, dtensor.Layout(["model", dtensor.UNSHARDED], mesh))
    np.testing.assert_array_equal(sharded.numpy(), loaded)
    assert {tuple(shard.shape) for shard in dtensor.unpack(sharded.read_value())} == {(4, 8)}
    unknown = variables_lib.DeferredVariable(
        initial_value=lambda: tf.zeros((3,)), shape=tf.TensorShape(None), dtype=tf.float32,
        name="unknown", trainable=False, extra_kwargs={})
    with pytest.raises(variables_lib.DeferredVariableError, match="no value yet"):
        unknown.numpy()


def test_a_weight_read_before_the_plan_is_laid_out_as_read():
    """A random initializer read before the plan is computed whole on the host once;
    the plan shards that value instead of drawing shards of its own (which would be
    other numbers), so what was read is what trains."""
    keras.utils.set_random_seed(5)
    initializer = keras.initializers.GlorotUniform()
    kernel = variables_lib.DeferredVariable(
        initial_value=functools.partial(initializer, (16, 8), dtype=tf.float32), shape=tf.TensorShape((16, 8)),
        dtype=tf.float32, name="kernel", trainable=True, extra_kwargs={})
    read = kernel.numpy()
    np.testing.assert_array_equal(kernel.numpy(), read)
    layout = dtensor.Layout(["model", "batch"], _mesh())
    variables_lib.materialize_all([(kernel, layout)])
    assert kernel.layout == layout
    np.testing.assert_array_equal(kernel.numpy(), read)


def test_an_unseeded_fit_leaves_the_users_random_state(monkeypatch):
    """Unseeded, tf-keras refuses sharded draws; the strategy used to call
    ``set_random_seed`` for the user, reseeding Python's ``random``, numpy and TensorFlow.
    Now Python's and numpy's generators go on as after the same fit on one device (tf-keras
    takes an unseeded initializer's seed from Python's ``random`` there too), TensorFlow's
    global seed is not set, and tf-keras is left unseeded."""
    import random

    from tensorflow.python.eager import context
    from tf_keras.src import backend as tf_keras_backend

    from tofu_tf.strategies import TofuStrategy
    monkeypatch.delattr(tf_keras_backend._SEED_GENERATOR, "generator", raising=False)
    tf_seed = context.global_seed()

    def fit_then_draw(strategy):
        random.seed(11)
        np.random.seed(12)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, name="wide"),
                                      keras.layers.Dense(256, name="wider"), keras.layers.Dense(4, name="head")])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((16, 32), np.float32), np.ones((16, 4), np.float32), batch_size=8, verbose=0)
        return (random.random(), float(np.random.rand())), model

    drawn, model = fit_then_draw(TofuStrategy(8))
    assert any(not variable.layout.is_fully_replicated() for variable in model.weights)    # drawn sharded
    assert drawn == fit_then_draw(None)[0]
    assert context.global_seed() == tf_seed
    assert not getattr(tf_keras_backend._SEED_GENERATOR, "generator", None)


def test_a_checkpoint_saved_before_the_plan_holds_every_variable(tmp_path):
    """TensorFlow leaves an uninitialized variable out of a checkpoint silently; a variable
    waiting for its plan was one, so restoring failed (``Key v/.ATTRIBUTES/VARIABLE_VALUE not
    found``; tf-keras's checkpointing_test). The checkpoint holds the value the plan lays out."""
    import tf_keras
    from tofu_tf.strategies import TofuStrategy
    strategy = TofuStrategy(8)
    with strategy.scope():
        counter = tf.Variable(3.0)
        model = tf_keras.Sequential([tf_keras.Input((16,)), tf_keras.layers.Dense(128)])
    path = tf.train.Checkpoint(v=counter, model=model).save(str(tmp_path / "ckpt"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert "v/.ATTRIBUTES/VARIABLE_VALUE" in names
    restored_counter = tf.Variable(0.0)
    restored_model = tf_keras.Sequential([tf_keras.Input((16,)), tf_keras.layers.Dense(128)])
    tf.train.Checkpoint(v=restored_counter, model=restored_model).restore(path).assert_consumed()
    assert float(restored_counter.numpy()) == 3.0
    strategy.plan_model(model, batch_size=8, loss="mse", optimizer="sgd")    # the plan lays out what was saved
    for got, want in zip(model.get_weights(), restored_model.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_the_strategys_variables_name_it_and_legacy_slots_restored_outside_its_scope_are_refused(tmp_path):
    """Each variable the strategy makes records it (``_distribute_strategy``), as MirroredStrategy's
    do, so outside the scope the default strategy does not take it for its own: tf-keras's legacy
    optimizer then refuses to make or restore a slot for it there, naming the scope (before: the
    slot was made as a plain host variable beside a DTensor weight; tf-keras's
    checkpointing_test.testCheckpointRestoreOptimizerSlots)."""
    from tofu_tf import TofuStrategy
    from tf_keras.src.optimizers.legacy import adam

    strategy = TofuStrategy(8)

    def state():
        with strategy.scope():
            weight = tf.Variable(tf.ones([]))
        optimizer = adam.Adam(0.001)

        @tf.function
        def step():
            def replica():
                with tf.GradientTape() as tape:
                    loss = weight + weight
                optimizer.apply_gradients(zip(tape.gradient(loss, [weight]), [weight]))
            strategy.run(replica)
        return weight, optimizer, step

    weight, optimizer, step = state()
    step()
    assert weight._distribute_strategy is strategy
    assert optimizer.get_slot(weight, "m")._distribute_strategy is strategy
    saved = tf.train.Checkpoint(v=weight, opt=optimizer).save(str(tmp_path / "ckpt"))
    weight, optimizer, _ = state()
    with pytest.raises(ValueError, match="optimizer slot variable under the scope"):
        tf.train.Checkpoint(v=weight, opt=optimizer).restore(saved)
