"""``tf.scan`` of static length unrolled while the strategy's model is called
(``tofu_tf.tf.compat.scans``): a recurrence written with tf.scan in a layer trains as one device.

Before, it failed in the first step with DTensor's "'tf.TensorListStack' op does not implement
layout propagation" (a scan is a While loop over TensorLists), then was refused before it.
"""

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests import strategy_helpers as helpers
from tofu_tf.tf.compat import scans

BATCH, STEPS = 8, 3


def _op_types(fn, *specs):
    return {op.type for op in tf.function(fn).get_concrete_function(*specs).graph.get_operations()}


@pytest.mark.parametrize("form", ["plain", "initializer", "reverse", "nested"])
def test_a_static_scan_is_unrolled_inside_and_only_inside(form):
    scan = {
        "plain": lambda x: tf.scan(lambda acc, row: acc * 0.5 + row, x),
        "initializer": lambda x: tf.scan(lambda acc, row: acc + tf.reduce_sum(row), x, initializer=tf.constant(1.0)),
        "reverse": lambda x: tf.scan(lambda acc, row: acc * 0.5 + row, x, reverse=True),
        "nested": lambda x: tf.scan(lambda acc, rows: (acc[0] + rows[0], acc[1] * rows[1]), (x, x + 1.0),
                                    initializer=(tf.zeros(4), tf.ones(4))),
    }[form]
    spec, value = tf.TensorSpec((5, 4)), tf.reshape(tf.range(20.0), (5, 4)) / 10.0
    assert "While" in _op_types(scan, spec) or "StatelessWhile" in _op_types(scan, spec)
    with scans.scans_unrolled():
        types = _op_types(scan, spec)
        unrolled = tf.function(scan)(value)
    assert not types & {"While", "StatelessWhile"} and not any(t.startswith("TensorList") for t in types)
    for got, want in zip(tf.nest.flatten(unrolled), tf.nest.flatten(tf.function(scan)(value))):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert "While" in _op_types(scan, spec) or "StatelessWhile" in _op_types(scan, spec)


def _layer(keras):
    class Recurrence(keras.layers.Layer):
        """A decaying running sum over the sequence, written with tf.scan (time-major)."""

        def call(self, x):
            return tf.transpose(tf.scan(lambda acc, step: acc * 0.5 + step, tf.transpose(x, (1, 0, 2))), (1, 0, 2))
    return Recurrence(name="recurrence")


def _model(keras):
    return helpers.model_around_a_sequence_layer(keras, _layer(keras))


_compile = helpers.compile_with_momentum


@pytest.mark.parametrize("keras", [tf_keras, keras3], ids=["tf_keras", "keras3"])
def test_a_layer_with_a_scan_trains_as_one_device(keras):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 5, 4)).astype("float32")
    y = rng.integers(0, 4, BATCH * STEPS).astype("int32")
    helpers.fit_beside_one_device(lambda: _model(keras), lambda m: _compile(keras, m), x, y)
