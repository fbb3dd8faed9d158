"""Eager tensors a layer makes for itself and a step captures are put on the mesh
(tofu_tf.tf.mesh_captures), and the step computes what one device computes."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from tests import strategy_helpers as h
from tofu_tf import TofuStrategy
from tofu_tf.tf import keras_adapter, mesh_captures

BATCH, STEPS, WIDTH = 8, 3, 16


def _constant_layer(keras):
    class Scrambled(keras.layers.Layer):
        """A layer that makes two eager tensors in ``build`` (over TensorFlow's 128-element
        limit for embedding a constant in a program) and uses them in ``call``: a float mask
        multiplied into its kernel and an int permutation of its input's features."""

        def build(self, input_shape):
            n = int(input_shape[-1])
            self.kernel = self.add_weight(name="kernel", shape=(n, 4 * n), initializer="glorot_uniform")
            self.mask = tf.constant(np.linspace(-1.0, 1.0, n * 4 * n).reshape(n, 4 * n).astype("float32"))
            order = np.random.default_rng(3).permutation(n * 16) % n
            self.order = tf.constant(order.reshape(16, n).astype("int32"))

        def call(self, x):
            gathered = tf.gather(x, self.order[0], axis=-1)
            return tf.matmul(gathered, self.kernel * self.mask)

    return Scrambled


def _model(keras):
    return keras.Sequential([keras.Input((WIDTH,), name="x"), _constant_layer(keras)(name="scrambled"),
                             keras.layers.Dense(8, name="head")], name="scrambler")


def _split_plan(flavor):
    """The layer's kernel split by columns, the head's by rows (the planner keeps a model this
    small replicated)."""
    prefix = "" if flavor == "tf_keras" else "scrambler/"
    return h.HandPlan(mesh_shape={"batch": 2, "model": 4},
                      variable_layouts={prefix + "scrambled/kernel": (None, "model"),
                                        prefix + "head/kernel": ("model", None)},
                      input_layouts={"x": ("batch",)})


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(BATCH * STEPS, WIDTH)).astype("float32"),
            rng.normal(size=(BATCH * STEPS, 8)).astype("float32"))


@pytest.mark.parametrize("flavor", ["tf_keras", "keras3"])
def test_a_layers_own_constants_train_as_on_one_device(flavor):
    keras = pytest.importorskip(flavor if flavor == "tf_keras" else "keras")
    keras.utils.set_random_seed(1)
    reference = _model(keras)
    initial = reference.get_weights()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = _data()
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    strategy = TofuStrategy(num_gpus=8, plan=_split_plan(flavor))
    with strategy.scope():
        model = _model(keras)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.set_weights(initial)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    kernel = keras_adapter.backing_variable(model.get_layer("scrambled").kernel)
    assert not kernel.layout.is_fully_replicated(), "the plan should split the layer's kernel"
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_step_captures_a_replicated_copy_once_and_the_graph_is_restored():
    mesh = dtensor.create_mesh([("batch", 8)], devices=[f"CPU:{i}" for i in range(8)])
    table = tf.constant(np.arange(256, dtype="float32").reshape(16, 16))
    small = tf.constant(np.arange(4, dtype="float32"))
    seen = {}

    @tf.function
    def step(x):
        graph = tf.compat.v1.get_default_graph()
        with mesh_captures.on_mesh(mesh):
            out = tf.reduce_sum(x) + tf.reduce_sum(table) + tf.reduce_sum(table * 2.0) + tf.reduce_sum(small)
        seen["restored"] = getattr(graph.capture, "_tofu_change", None) is None
        seen["captured"] = [value for value in graph.external_captures if tf.is_tensor(value)]
        return out

    x = dtensor.copy_to_mesh(tf.ones((8, 4)), dtensor.Layout.replicated(mesh, rank=2))
    x = dtensor.relayout(x, dtensor.Layout.batch_sharded(mesh, "batch", rank=2))
    total = step(x)
    assert float(dtensor.unpack(total)[0]) == pytest.approx(32 + 3 * 255 * 128 + 6)
    assert seen["restored"]
    assert len(seen["captured"]) == 2, "the table is captured once, the small tensor too"
    for captured in seen["captured"]:
        assert dtensor.is_dtensor(captured) and dtensor.fetch_layout(captured).is_fully_replicated()


def test_only_eager_tensors_a_program_takes_as_inputs_are_copied():
    assert mesh_captures.needs_mesh_copy(tf.zeros((16, 16)))
    assert not mesh_captures.needs_mesh_copy(dtensor.copy_to_mesh(tf.zeros((4, 4)), dtensor.Layout.replicated(
        dtensor.create_mesh([("batch", 8)], devices=[f"CPU:{i}" for i in range(8)]), rank=2)))
    assert not mesh_captures.needs_mesh_copy(tf.constant(["a"] * 200))  # DTensor cannot replicate strings
    assert not mesh_captures.needs_mesh_copy(np.zeros((16, 16)))
    assert not mesh_captures.needs_mesh_copy(tf.Variable(tf.zeros((16, 16))).handle)


@pytest.mark.slow
def test_swin_transformer_trains_as_on_one_device():
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")

    def build():
        backbone = keras_hub.models.SwinTransformerBackbone(
            image_shape=(32, 32, 3), embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, patch_size=4,
            drop_path=0.0)
        return keras_hub.models.SwinTransformerImageClassifier(backbone=backbone, num_classes=4, preprocessor=None)

    keras.utils.set_random_seed(0)
    reference = build()
    initial = reference.get_weights()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.random((BATCH * STEPS, 32, 32, 3)).astype("float32")
    y = (np.arange(BATCH * STEPS) % 4).astype("int32")
    want = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]

    strategy = TofuStrategy(num_gpus=8)
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    model.set_weights(initial)
    got = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for got_weight, want_weight in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got_weight, want_weight, rtol=1e-4, atol=1e-5)
