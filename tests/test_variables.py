"""Variables TofuStrategy creates: optimizer slots start as shards, never as a full-size tensor."""

import numpy as np
import tensorflow as tf
import tf_keras as keras
from tensorflow.experimental import dtensor

from tofu_tf.tf import devices, keras_adapter, lowering
from tofu_tf.tf import variables as variables_lib


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


def test_tf_keras_slots_are_requested_as_deferred_zeros():
    """The optimizer asks for slots without computing them: no full-size tf.zeros."""
    weight = tf.Variable(tf.ones((16, 4)), name="w")
    optimizer = keras.optimizers.Adam(0.1)
    keras_adapter.defer_slot_zeros(optimizer)
    keras_adapter.defer_slot_zeros(optimizer)  # idempotent: one wrapper, not two
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
    moved = variables_lib.rehome(variable, dtensor.Layout(["model", "batch"], mesh))
    assert moved is variable and [tuple(s.shape) for s in dtensor.unpack(moved.read_value())] == [(1, 4)] * 8
    np.testing.assert_array_equal(moved.numpy(), full)
