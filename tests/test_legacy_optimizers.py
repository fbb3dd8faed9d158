"""tf-keras's legacy optimizers (``tf_keras.optimizers.legacy``) train sharded as on one device.

Before, the first ``fit`` failed: ``'SGD' object has no attribute
'add_variable_from_reference'`` (slot recording assumed the new optimizer API), then
capture refused (a legacy optimizer will not apply in cross-replica context), then the
strategy (``extended.update`` unimplemented), then DTensor died: a legacy optimizer
updates a weight and its slots in one fused op, and a slot laid out otherwise than
its weight (the lowering moved a bias to its kernel's axis and not the bias's slot)
segfaults DTensor's expander. Each optimizer here runs under a memory budget that
makes the plan shard a kernel, its bias and their slots.

Optimizer: each one's defaults where they are stable in fp32 over four steps; Adam-like
updates turn a near-zero gradient's rounding into a learning-rate step, so weights
are compared at 1e-4 (updates are about 1e-2), losses at 1e-5 relative.
"""

import numpy as np
import pytest
import tf_keras as keras

from tofu_tf.search import UnsupportedOpError
from tofu_tf.strategies import TofuStrategy

pytestmark = pytest.mark.slow   # trains models under TofuStrategy end to end

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.legacy.Adam(0.01),
    "rmsprop_centered": lambda: keras.optimizers.legacy.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.legacy.Adagrad(0.05),
    # Their fused kernels DTensor cannot run: computed in elementwise ops (legacy_fused_updates_unfused).
    "adadelta": lambda: keras.optimizers.legacy.Adadelta(1.0),
    "adamax": lambda: keras.optimizers.legacy.Adamax(0.01, epsilon=1.0),
    "ftrl": lambda: keras.optimizers.legacy.Ftrl(0.05, l1_regularization_strength=0.001, beta=0.1),
    "ftrl_shrinkage": lambda: keras.optimizers.legacy.Ftrl(0.05, l2_shrinkage_regularization_strength=0.01),
    "rmsprop_momentum": lambda: keras.optimizers.legacy.RMSprop(0.01, momentum=0.5),
}
BUDGET = 300_000          # bytes per device: the unconstrained plan replicates this model (about 0.3 MB)


def _build(optimizer):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Input((32,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_legacy_optimizer_trains_sharded_as_on_one_device(name):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 32)).astype("float32"), rng.integers(0, 10, 64)
    reference = _build(OPTIMIZERS[name]())
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8, memory_budget_bytes=BUDGET)
    with strategy.scope():
        model = _build(OPTIMIZERS[name]())
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    slots = [v for v in model.optimizer.variables() if v.shape.rank]
    assert slots and any(not v.layout.is_fully_replicated() for v in slots), "no slot is sharded"
    for weight in model.trainable_weights:             # each slot laid out as its weight
        for slot_name in model.optimizer.get_slot_names():
            slot = model.optimizer.get_slot(weight, slot_name)
            assert slot.layout == weight.layout, (weight.name, slot_name, slot.layout, weight.layout)


def test_a_legacy_update_dtensor_cannot_run_is_refused_before_the_first_step():
    """Adam's amsgrad update (ResourceApplyAdamWithAmsgrad) has no layout propagation in DTensor
    and keeps its kernel: the first step failed with DTensor's text. Refused before any step,
    naming the new optimizer to use. (Ftrl's and Adadelta's were refused so too; they now run,
    above.)"""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 32)).astype("float32"), rng.integers(0, 10, 32)
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = _build(keras.optimizers.legacy.Adam(0.01, amsgrad=True))
    with pytest.raises(UnsupportedOpError, match=r"tf_keras.optimizers.legacy.Adam \(amsgrad=True\).*"
                                                 r"tf_keras.optimizers.Adam"):
        model.fit(x, y, batch_size=16, verbose=0)


def test_a_tensorflow_1_optimizer_is_refused_with_the_keras_optimizer_to_use():
    """tf-keras wraps a tf.compat.v1.train optimizer in a TFOptimizer (tf-keras's own
    distribute_strategy_test compiles with one): it has neither Keras' slot API nor a config.
    Was: AttributeError ('TFOptimizer' object has no attribute 'add_variable_from_reference')."""
    import tensorflow as tf
    from tofu_tf.tf.keras_adapter import UnsupportedModelError
    x = np.arange(8, dtype=np.float32).reshape(8, 1)
    with TofuStrategy(8).scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(tf.compat.v1.train.RMSPropOptimizer(learning_rate=0.001), "mse")
    with pytest.raises(UnsupportedModelError, match=r"TensorFlow 1 optimizer \(RMSPropOptimizer.*tf_keras.optimizers"):
        model.evaluate(x, 2 * x, batch_size=8, verbose=0)


def _embedding_model(optimizer):
    """tf-keras's mixed-precision LSTM correctness test's model, the LSTM left out: under
    "mixed_float16" compile wraps the legacy optimizer in the legacy LossScaleOptimizer, and the
    Embedding's gradient is sparse (IndexedSlices)."""
    keras.utils.set_random_seed(1)
    words = keras.layers.Input((10,), dtype="int32")
    x = keras.layers.Embedding(20, 16)(words)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(2)(x)
    model = keras.Model(words, keras.layers.Softmax(dtype="float32")(x))
    model.compile(optimizer, loss="sparse_categorical_crossentropy")
    return model


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_a_legacy_loss_scale_optimizer_trains_an_embedding_as_on_one_device(mixed_float16):
    """Was refused: the legacy LossScaleOptimizer is itself a legacy optimizer, and the sparse
    gradient's check looked at it, not at the SGD it applies with (plain SGD, whose dense update
    of the densified gradient is the sparse one). Trains as one device, losses and weights."""
    del mixed_float16
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 20, (64, 10)).astype("int32"), rng.integers(0, 2, 64).astype("int32")
    reference = _embedding_model(keras.optimizers.legacy.SGD(0.5))
    assert isinstance(reference.optimizer, keras.mixed_precision.LossScaleOptimizer)
    assert isinstance(reference.optimizer.inner_optimizer, keras.optimizers.legacy.SGD)
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = _embedding_model(keras.optimizers.legacy.SGD(0.5))
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-3)
    for got, want, start in zip(model.get_weights(), reference.get_weights(), initial):
        assert np.abs(want - start).max() > 1e-3                    # every weight moved
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


SPARSE_OPTIMIZERS = {
    "rmsprop": lambda: keras.optimizers.legacy.RMSprop(0.01),
    "rmsprop_centered_momentum": lambda: keras.optimizers.legacy.RMSprop(0.01, momentum=0.5, centered=True),
    "sgd_momentum": lambda: keras.optimizers.legacy.SGD(0.5, momentum=0.9),
    "adam": lambda: keras.optimizers.legacy.Adam(0.01),
    "nadam": lambda: keras.optimizers.legacy.Nadam(0.01),
}


@pytest.mark.parametrize("name", sorted(SPARSE_OPTIMIZERS))
def test_a_legacy_optimizer_updates_an_embedding_row_for_row_as_on_one_device(name):
    """tf-keras's mirrored_strategy_test trains an Embedding with legacy RMSprop. Was refused
    ("its dense update would move rows the sparse one leaves alone"): the sparse update runs on the
    variable's handle (ResourceScatterAdd, ResourceSparseApplyRMSProp ...), which DTensor cannot run.
    Now rewritten (``legacy_sparse_updates_dense``): losses, weights and every slot as one device,
    and the rows no batch names (14..19) untouched."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 14, (64, 10)).astype("int32"), rng.integers(0, 2, 64).astype("int32")
    reference = _embedding_model(SPARSE_OPTIMIZERS[name]())
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = _embedding_model(SPARSE_OPTIMIZERS[name]())
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    assert "legacy_sparse_updates_dense" in [applied.change.name for applied in strategy.changes]
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    embedding = model.get_weights()[0]
    assert np.abs(embedding[:14] - initial[0][:14]).min(axis=1).max() > 0     # the rows named moved
    np.testing.assert_array_equal(embedding[14:], initial[0][14:])
    slots = [(got, want) for got, want in zip(model.optimizer.variables(), reference.optimizer.variables())
             if want.shape.rank]
    assert slots and all(got.shape == want.shape for got, want in slots)
    for got, want in slots:
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)


def test_a_legacy_loss_scale_optimizer_over_momentum_trains_an_embedding_as_on_one_device(mixed_float16):
    """Was refused (momentum decays every row under a dense update, the sparse one only the
    gathered ones), naming the SGD inside the wrapper. Its fused sparse update is now its dense
    update with the untouched rows put back: trains as one device."""
    del mixed_float16
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 20, (64, 10)).astype("int32"), rng.integers(0, 2, 64).astype("int32")
    reference = _embedding_model(keras.optimizers.legacy.SGD(0.5, momentum=0.9))
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    with TofuStrategy(8).scope():
        model = _embedding_model(keras.optimizers.legacy.SGD(0.5, momentum=0.9))
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-3)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
