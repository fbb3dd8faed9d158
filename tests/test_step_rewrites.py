"""What a strategy step rewrites so DTensor runs a custom ``train_step`` as one device does
(``tofu_tf.tf.compat.batch_concat``, ``tofu_tf.tf.compat.random_draws``), checked on one DTensor
program each, with and without the rewrite: each probe also shows TensorFlow still needs it."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from tofu_tf.tf.compat import batch_concat, random_draws


@pytest.fixture(scope="module")
def mesh():
    return dtensor.create_mesh([("batch", 2), ("model", 4)], devices=[f"CPU:{i}" for i in range(8)])


def _batch_split(mesh, value):
    replicated = dtensor.copy_to_mesh(tf.constant(value), dtensor.Layout.replicated(mesh, 2))
    return dtensor.relayout(replicated, dtensor.Layout.batch_sharded(mesh, "batch", 2))


def _host(value, mesh):
    return dtensor.unpack(dtensor.relayout(value, dtensor.Layout.replicated(mesh, value.shape.rank)))[0].numpy()


def test_a_concatenation_along_the_split_batch_runs_and_joins_as_one_device(mesh):
    real = np.arange(32, dtype="float32").reshape(8, 4)
    made = -np.arange(32, dtype="float32").reshape(8, 4)
    scale = np.arange(64, dtype="float32").reshape(16, 4)
    x, y, z = _batch_split(mesh, real), _batch_split(mesh, made), _batch_split(mesh, scale)

    @tf.function
    def joined(a, b, c):          # the joined batch meets a batch-split tensor, as a GAN's discriminator input
        return tf.concat([a * 2.0, b], axis=0) * c

    with pytest.raises(Exception, match="concat dimension in sharded dimension is not supported"):
        joined(x, y, z)                           # TF 2.21's DTensor, as a GAN's step met it
    with batch_concat.batch_concats_gathered(mesh):
        got = tf.function(joined.python_function)(x, y, z)
    np.testing.assert_array_equal(_host(got, mesh), np.concatenate([real * 2.0, made]) * scale)


def test_a_stateless_draw_consumed_split_is_one_devices_draw(mesh):
    x = _batch_split(mesh, np.ones((16, 8), "float32"))
    want = tf.random.stateless_normal((16, 8), seed=[1, 2]).numpy()

    def scaled(a):
        return tf.random.stateless_normal((16, 8), seed=[1, 2]) * a

    folded = _host(tf.function(scaled)(x), mesh)
    assert np.abs(folded - want).max() > 0.1      # DTensor folds each device's coordinates into the seed
    with random_draws.draws_replicated(mesh):
        drawn = _host(tf.function(scaled)(x), mesh)
    np.testing.assert_array_equal(drawn, want)
