"""Keras 3 models quantized after training (``model.quantize("int8")``) predict under
TofuStrategy as the same model quantized on one device, keep their kernels' layouts, and save
and export as a float model does.

Before: ``predict`` failed with "'tf.BatchMatMulV3' op does not implement layout propagation"
(Keras multiplies int8 by int8 into int32 with that op), and the int8 kernels and scales
``quantize`` made outside the scope were plain host variables beside the mesh's (in the scope:
replicated, whatever their float kernels' split).
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import strategy_helpers as h
from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf.compat import quantized

BATCH = 16
# Kernels split both ways: d1 by columns (its scale with it), ed by rows (its scale has no such
# dim: replicated), d2 by columns on the model axis.
LAYOUTS = {"d1/kernel": (None, "model"), "d1/bias": ("model",), "ed/kernel": ("model", None),
           "d2/kernel": (None, "model")}


def _build():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(64, activation="relu", name="d1")(inputs)
    hidden = keras.layers.EinsumDense("ab,bc->ac", output_shape=32, name="ed")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(8, name="d2")(hidden))
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(40, 16)).astype("float32"), rng.integers(0, 8, 40)   # a last batch of 8


def _trained_pair(mode="int8", *, in_scope=False):
    """The model trained under TofuStrategy and quantized, and the same weights quantized on one device."""
    x, y = _data()
    strategy = TofuStrategy(8, plan=h.HandPlan({"batch": 2, "model": 4}, LAYOUTS, {"x": ("batch",)}))
    with strategy.scope():
        model = _build()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    reference = _build()
    reference.set_weights([np.asarray(w.numpy()) for w in model.weights])
    if in_scope:
        with strategy.scope():
            model.quantize(mode)
    else:
        model.quantize(mode)
    reference.quantize(mode)
    return strategy, model, reference, x


@pytest.fixture(scope="module")
def int8_pair():
    return _trained_pair()


def _specs(weight):
    return tuple(getattr(weight, "value", weight).layout.sharding_specs)


@pytest.mark.parametrize("mode,in_scope", [("int8", False), ("int8", True), ("float8", False)])
def test_a_quantized_model_predicts_as_the_same_model_quantized_on_one_device(mode, in_scope):
    _, model, reference, x = _trained_pair(mode, in_scope=in_scope)
    # The int8 matmuls are exact integer sums either way; the rest is elementwise on this model.
    np.testing.assert_array_equal(model.predict(x, batch_size=BATCH, verbose=0),
                                  reference.predict(x, batch_size=BATCH, verbose=0))
    for got, want in zip(model.weights, reference.weights):
        assert got.dtype == want.dtype, got.path
        np.testing.assert_array_equal(np.asarray(got.numpy()), np.asarray(want.numpy()), err_msg=got.path)


def test_int8_kernels_keep_their_float_kernels_layouts_and_scales_go_with_them(int8_pair):
    strategy, model, _, _ = int8_pair
    by_path = {w.path: w for w in model.weights}
    assert by_path["d1/kernel"].dtype == "int8"
    assert _specs(by_path["d1/kernel"]) == ("unsharded", "model")
    assert _specs(by_path["d1/kernel_scale"]) == ("model",)           # per output unit, split with them
    assert _specs(by_path["ed/kernel"]) == ("model", "unsharded")
    assert _specs(by_path["ed/kernel_scale"]) == ("unsharded",) * len(by_path["ed/kernel_scale"].shape)
    assert _specs(by_path["d2/kernel"]) == ("unsharded", "model")
    assert _specs(by_path["d2/kernel_scale"]) == ("model",)
    assert all(getattr(w, "value", w).layout.mesh == strategy.mesh for w in model.weights)
    assert "quantize_in_scope" in [applied.change.name for applied in strategy.changes]


def test_a_quantized_model_saves_and_exports_as_one_devices(int8_pair, tmp_path):
    _, model, reference, x = int8_pair
    want = reference.predict(x, batch_size=BATCH, verbose=0)
    model.save_weights(str(tmp_path / "q.weights.h5"))
    loaded = _build()
    loaded.quantize("int8")
    loaded.load_weights(str(tmp_path / "q.weights.h5"))
    np.testing.assert_array_equal(loaded.predict(x, batch_size=BATCH, verbose=0), want)
    model.save(str(tmp_path / "q.keras"))
    np.testing.assert_array_equal(keras.models.load_model(str(tmp_path / "q.keras")).predict(x, verbose=0), want)
    model.export(str(tmp_path / "exported"), verbose=False)
    loaded_export = tf.saved_model.load(str(tmp_path / "exported"))
    served = loaded_export.serve(x).numpy()
    np.testing.assert_array_equal(served, want)


def test_quantize_modes_the_mesh_cannot_run_are_refused_before_any_layer_changes():
    x, y = _data()
    strategy = TofuStrategy(8, plan=h.HandPlan({"batch": 2, "model": 4}, LAYOUTS, {"x": ("batch",)}))
    with strategy.scope():
        model = _build()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    with pytest.raises(quantized.QuantizationModeError, match=r"quantize\('int4'\).*'int8'.*one_device_copy"):
        model.quantize("int4")
    assert all(w.dtype == "float32" for w in model.weights)


def test_a_model_quantized_outside_the_scope_before_the_strategy_saw_it_is_refused_naming_the_scope():
    """Quantized out of the scope before any fit, its int8 kernels were plain host variables, run
    unsplit beside the mesh's: silently not what the plan says."""
    x, y = _data()
    strategy = TofuStrategy(8, plan=h.HandPlan({"batch": 2, "model": 4}, LAYOUTS, {"x": ("batch",)}))
    with strategy.scope():
        model = _build()
    model.quantize("int8")
    with pytest.raises(quantized.QuantizationModeError, match=r"quantized outside strategy.scope\(\).*d1/kernel"):
        model.predict(x, batch_size=BATCH, verbose=0)


def test_a_model_quantized_in_the_scope_before_its_plan_takes_the_plans_layouts():
    x, _ = _data()
    strategy = TofuStrategy(8, plan=h.HandPlan({"batch": 2, "model": 4}, LAYOUTS, {"x": ("batch",)}))
    with strategy.scope():
        model = _build()
        model.quantize("int8")
    reference = _build()
    reference.quantize("int8")
    np.testing.assert_array_equal(model.predict(x, batch_size=BATCH, verbose=0),
                                  reference.predict(x, batch_size=BATCH, verbose=0))
    assert _specs(model.get_layer("d1").kernel) == ("unsharded", "model")


@pytest.mark.parametrize("contraction", [64, 1024, 4096])
def test_int8_products_are_the_exact_int32_sums_one_device_computes(contraction):
    """Extreme int8 values (-128, 127) at contractions past float32's exact range (1024 terms of 2^14)."""
    from keras.src.backend.tensorflow import numpy as keras_numpy
    rng = np.random.default_rng(contraction)
    a = rng.choice(np.array([-128, 127, -127, 126], "int8"), (4, contraction))
    b = rng.choice(np.array([-128, 127, -127, 126], "int8"), (contraction, 3))
    want = tf.matmul(a, b, output_type=tf.int32).numpy()
    with quantized.exact_int8_matmuls():
        got = keras_numpy.matmul(a, b)
        got_einsum = keras_numpy.einsum("ab,bc->ac", a, b)
    assert got.dtype == tf.int32 and got_einsum.dtype == tf.int32
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(got_einsum.numpy(), want)


def test_the_int8_rewrite_is_only_in_force_on_the_thread_inside():
    from keras.src.backend.tensorflow import numpy as keras_numpy
    original = keras_numpy.matmul
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def other_thread():
        inside.wait()
        with tf.Graph().as_default() as graph:      # the other thread's int8 product is Keras' own op
            a = tf.zeros((2, 2), tf.int8)
            keras_numpy.matmul(a, a)
            seen["ops"] = {op.type for op in graph.get_operations()}
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with quantized.exact_int8_matmuls():
        inside.set()
        done.wait()
    thread.join()
    assert "BatchMatMulV3" in seen["ops"]
    assert keras_numpy.matmul is original
    with tf.Graph().as_default() as graph, quantized.exact_int8_matmuls():    # this thread's: a float product
        a = tf.zeros((2, 2), tf.int8)
        keras_numpy.matmul(a, a)
        assert "BatchMatMulV3" not in {op.type for op in graph.get_operations()}


@pytest.mark.slow
def test_a_quantized_keras_hub_gpt2_predicts_as_one_device_and_exports(tmp_path):
    """GPT2CausalLM trained two steps, quantized to int8, predicts as the same weights quantized on
    one device. Its float layers (layer norms, attention, a split MLP's sums) round differently
    when sharded (1e-7 on the float model, checked first); an activation that then lands on the
    other side of a rounding boundary in int8's input quantizer becomes the neighbouring integer,
    which moves that sequence's later logits by about one quantization step (1/127 of the
    activations' range): so the quantized logits agree to 1e-5 but for at most a few sequences,
    and there within 1e-2."""
    keras_hub = pytest.importorskip("keras_hub")

    def build():
        keras.utils.set_random_seed(3)
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=128, num_layers=2, num_heads=4, hidden_dim=64,
                                                 intermediate_dim=128, max_sequence_length=16)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 128, (16, 16)).astype("int32"), "padding_mask": np.ones((16, 16), "bool")}
    y = rng.integers(0, 128, (16, 16)).astype("int32")
    strategy = TofuStrategy(8, mesh_shape={"batch": 2, "model": 4})
    with strategy.scope():
        model = build()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    split = [w.path for w in model.weights if "model" in _specs(w) or "batch" in _specs(w)]
    assert split, "the plan splits no kernel: the test would not check quantized layouts"
    reference = build()
    reference.set_weights([np.asarray(w.numpy()) for w in model.weights])
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                               reference.predict(x, batch_size=8, verbose=0), atol=1e-5)
    before = {w.path: _specs(w) for w in model.weights}
    model.quantize("int8")
    reference.quantize("int8")
    for weight in model.weights:
        if weight.dtype == "int8" and weight.path in before:
            assert _specs(weight) == before[weight.path], weight.path
    got = model.predict(x, batch_size=8, verbose=0)
    want = reference.predict(x, batch_size=8, verbose=0)
    np.testing.assert_allclose(got, want, atol=1e-2)
    off = np.abs(got - want).reshape(16, -1).max(axis=1) > 1e-5
    assert off.sum() <= 2, f"{off.sum()} of 16 sequences differ"
    model.export(str(tmp_path / "gpt2"), verbose=False)
    loaded_export = tf.saved_model.load(str(tmp_path / "gpt2"))
    served = loaded_export.serve(x).numpy()     # the export runs on one device: one device's logits
    np.testing.assert_allclose(served, want, atol=1e-5)
