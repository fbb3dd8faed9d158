"""Keras 3 (TensorFlow backend) models train unchanged under TofuStrategy and
compute what one device computes."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import strategy_helpers as h
from tofu_tf import models
from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf import lowering

pytestmark = pytest.mark.slow   # trains models under TofuStrategy end to end

BUILDERS = {
    "mlp": lambda: models.mlp(width=32, depth=2, keras=keras),
    "cnn_bn": lambda: models.cnn(channels=8, keras=keras),
    "lstm": lambda: models.rnn(cell="lstm", hidden=16, seq_len=5, keras=keras),
    "transformer": lambda: models.gpt(num_layers=1, d_model=16, num_heads=4, seq_len=8, vocab_size=32, keras=keras),
}

# Megatron-style layouts where DTensor can lower them (see test_strategy.py); the
# paths are matched as suffixes of Keras 3's model-prefixed variable paths.
HAND_LAYOUTS = {
    "mlp": {"dense_0/kernel": (None, "model"), "dense_0/bias": ("model",), "dense_1/kernel": ("model", None)},
    "cnn_bn": {},
    "lstm": {},
    "transformer": {"block_0_mlp_in/kernel": (None, "model"), "block_0_mlp_in/bias": ("model",),
                    "block_0_mlp_out/kernel": ("model", None)},
}


def build(name):
    keras.utils.set_random_seed(11)
    return BUILDERS[name]()


def compile_model(model):
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def reference(name):
    model = build(name)
    initial = model.get_weights()
    compile_model(model)
    x, y = h.data_for(model)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    return model, initial, (x, y), loss


# Every model on the forced 2x4 mesh; the planner's own choice for the two
# models where it has layouts to choose (keeps the suite's time in check).
CASES = [(m, "hand") for m in sorted(BUILDERS)] + [("mlp", "planner"), ("transformer", "planner")]


@pytest.fixture(scope="module", params=CASES,
                ids=lambda p: f"{p[0]}-{p[1]}")
def trained(request):
    name, planning = request.param
    ref, initial, (x, y), expected_loss = reference(name)
    plan = None
    if planning == "hand":
        plan = h.HandPlan({"batch": 2, "model": 4}, HAND_LAYOUTS[name], {"x": ("batch",)})
    strategy = TofuStrategy(8, plan=plan)
    with strategy.scope():
        model = build(name)
        compile_model(model)
    strategy.plan_model(model, batch_size=h.BATCH)
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    return name, strategy, model, ref, expected_loss, loss


def test_three_steps_match_one_device(trained):
    name, _, model, ref, expected_loss, loss = trained
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for variable, want in zip(model.weights, ref.weights):
        np.testing.assert_allclose(np.asarray(variable.numpy()), want.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}: {variable.path}")


def test_planned_layouts_reach_keras3_variables(trained):
    name, strategy, model, *_ = trained
    lowered = lowering.dtensor_natural(strategy.plan.variable_layouts)
    for variable in model.weights:
        planned = next((layout for path, layout in lowered.items()
                        if variable.path == path or variable.path.endswith("/" + path)), None)
        if planned is not None:
            actual = tuple(None if a == "unsharded" else a for a in variable.value.layout.sharding_specs)
            assert actual == tuple(planned), variable.path


def test_evaluate_and_predict_match(trained):
    name, _, model, ref, *_ = trained
    x, y = h.data_for(ref, seed=2)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=h.BATCH, verbose=0),
                               ref.evaluate(x, y, batch_size=h.BATCH, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=h.BATCH, verbose=0),
                               ref.predict(x, batch_size=h.BATCH, verbose=0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_keras3_mixed_precision_trains_sharded_as_one_device(policy):
    """Keras 3 wraps the optimizer in a LossScaleOptimizer under "mixed_float16";
    its update inside an ops.cond kept every weight replicated until capture traced
    the update the cond guards. Weights and their momentum shard; the step matches
    one device's within half precision."""
    def build_wide():
        keras.utils.set_random_seed(11)
        return models.mlp(input_dim=32, width=256, depth=2, keras=keras)

    keras.mixed_precision.set_global_policy(policy)
    try:
        ref = build_wide()
        initial = ref.get_weights()
        compile_model(ref)
        x, y = h.data_for(ref)
        expected_loss = ref.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
        strategy = TofuStrategy(8)
        with strategy.scope():
            model = build_wide()
            compile_model(model)
        strategy.plan_model(model, batch_size=h.BATCH)
        model.set_weights(initial)
        loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    momentum = [v for v in optimizer.variables if "momentum" in v.path]
    assert momentum and any("model" in v.value.layout.sharding_specs for v in momentum)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-2)
    for variable, want, start in zip(model.weights, ref.weights, initial):
        h.assert_same_update(np.asarray(variable.numpy()), want.numpy(), start, variable.path)


def test_keras3_subclassed_model_trains_as_one_device():
    """A subclassed Keras 3 model has no ``inputs`` attribute and makes its weights at
    its first call: the strategy finds it, builds it from the first batch's specs and
    plans it."""
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = h.subclassed_mlp(keras)
        compile_model(model)
    x, y = h.data_for(models.mlp(input_dim=32))
    start = h.InitialWeights(keras)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0,
                     callbacks=[start.callback]).history["loss"]
    assert any(axis for layout in strategy.plan.variable_layouts.values() for axis in layout)
    reference = h.subclassed_mlp(keras)
    reference(x[:1])
    reference.set_weights(start.weights)
    compile_model(reference)
    expected = reference.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _text_cnn():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((16,), dtype="int32"), keras.layers.Embedding(512, 128),
                             keras.layers.Conv1D(128, 3, padding="same", activation="relu"),
                             keras.layers.GlobalMaxPooling1D(), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(4)])


def test_keras3_ops_belong_to_the_layer_that_made_them():
    """Keras 3 opens a layer's name scope twice (build, then call), so its ops sit in
    ``dense_1/`` for layer ``dense`` and ``dense_1_2/`` for layer ``dense_1``: read from
    names, they went to the wrong layer or none (a convolution's to none, so the
    DTensor target's convolution rule missed them). Capture records the scopes."""
    from tofu_tf.tf.capture import capture_training_step
    model = _text_cnn()
    graph = capture_training_step(model, batch_size=8, loss="sparse_categorical_crossentropy", optimizer="sgd")
    dense, dense_1 = [layer.name for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    conv = next(layer.name for layer in model.layers if isinstance(layer, keras.layers.Conv1D))
    kernel_layer = {}
    for op in graph.ops:
        if op.type == "MatMul" and not op.name.startswith("gradient"):
            kernel_layer[graph.tensors[op.inputs[1]].shape] = op.layer
    assert kernel_layer == {(128, 256): dense, (256, 4): dense_1}
    convolutions = [op for op in graph.ops if op.type.startswith("Conv2D")]
    assert convolutions and all(op.layer == conv for op in convolutions)
    assert all(op.layer == conv for op in graph.ops if op.type in ("BiasAdd", "BiasAddGrad")
               and graph.tensors[op.outputs[0]].shape[-1:] == (128,))


@pytest.mark.parametrize("case", ["conv1d", "masked_lstm", "conv_lstm"])
def test_keras3_sequence_models_train_as_one_device(case):
    """Embedding -> Conv1D whose bias the plan would split (DTensor then failed), an
    LSTM reading a mask from Embedding(mask_zero=True) (Keras 3 lists the mask among
    the layer's inputs: its sequence length was not found), and the ConvLSTM2D that
    tf-keras users are pointed to (Keras 3's unrolls; tf-keras' is refused)."""
    def build():
        if case == "conv1d":
            return _text_cnn()
        if case == "conv_lstm":
            keras.utils.set_random_seed(3)
            return keras.Sequential([keras.Input((3, 6, 6, 2)), keras.layers.ConvLSTM2D(4, 3, padding="same"),
                                     keras.layers.GlobalMaxPooling2D(), keras.layers.Dense(4)])
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((12,), dtype="int32"), keras.layers.Embedding(64, 32, mask_zero=True),
                                 keras.layers.LSTM(16), keras.layers.Dense(4)])

    rng = np.random.default_rng(0)
    length = 16 if case == "conv1d" else 12
    x, y = rng.integers(0, 64, (24, length)).astype("int32"), rng.integers(0, 4, 24).astype("int32")
    x[:, 9:] = 0
    if case == "conv_lstm":
        x = rng.random((24, 3, 6, 6, 2), dtype=np.float32)
    h.assert_trained_alike(*h.train_beside_one_device(build, x, y, compile_fn=compile_model), rtol=1e-4)


def test_keras3_weights_loaded_before_the_plan_are_trained_from(tmp_path):
    """Fine-tuning: load_weights under the scope before any step failed (the weights had
    no value yet); the loaded values wait on the host for the plan."""
    pretrained = build("mlp")
    pretrained.set_weights([w + 0.5 for w in pretrained.get_weights()])
    pretrained.save_weights(str(tmp_path / "pretrained.weights.h5"))
    x, y = h.data_for(pretrained)
    reference = build("mlp")
    reference.load_weights(str(tmp_path / "pretrained.weights.h5"))
    compile_model(reference)
    expected = reference.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = build("mlp")
        model.load_weights(str(tmp_path / "pretrained.weights.h5"))
        compile_model(model)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_keras3_weights_read_before_the_plan_are_the_ones_trained(tmp_path):
    def wide_mlp():
        keras.utils.set_random_seed(11)
        return models.mlp(width=256, keras=keras)     # wide enough that the planner splits weights

    h.assert_trained_alike(*h.train_from_weights_read_before_the_plan(
        wide_mlp, str(tmp_path / "initial.weights.h5"), compile_fn=compile_model))


def test_callbacks_and_weight_files(tmp_path):
    strategy = TofuStrategy(8, plan=h.HandPlan({"batch": 2, "model": 4}, HAND_LAYOUTS["mlp"], {"x": ("batch",)}))
    with strategy.scope():
        model = build("mlp")
        compile_model(model)
    x, y = h.data_for(model)
    callbacks = [keras.callbacks.ModelCheckpoint(str(tmp_path / "e{epoch}.weights.h5"), save_weights_only=True),
                 keras.callbacks.EarlyStopping(monitor="loss", patience=5)]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(h.BATCH, drop_remainder=True)
    model.fit(dataset, epochs=2, verbose=0, callbacks=callbacks)
    assert (tmp_path / "e2.weights.h5").exists()
    trained_weights = model.get_weights()
    model.save_weights(str(tmp_path / "final.weights.h5"))
    plain = build("mlp")
    plain.load_weights(str(tmp_path / "final.weights.h5"))
    for got, want in zip(plain.get_weights(), trained_weights):
        np.testing.assert_array_equal(got, want)
    model.set_weights([np.zeros_like(w) for w in trained_weights])
    model.load_weights(str(tmp_path / "final.weights.h5"))
    for got, want in zip(model.get_weights(), trained_weights):
        np.testing.assert_array_equal(got, want)


class CountingInitializer(keras.initializers.Initializer):
    """Ones, counting the full-size values it is asked for."""

    def __init__(self):
        self.calls = 0

    def __call__(self, shape, dtype=None):
        self.calls += 1
        return keras.ops.ones(shape, dtype=dtype)


def test_keras3_initializers_run_once_when_the_plan_is_adopted():
    """Building under the scope computes no initial value; adopting the plan computes
    each once, on the host, and scatters it (the weight is never whole on a device)."""
    initializer = CountingInitializer()
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, kernel_initializer=initializer,
                                                                        name="wide")])
        model.compile(optimizer="sgd", loss="mse")
    assert initializer.calls == 0
    strategy.plan_model(model, batch_size=8)
    assert initializer.calls == 1
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), np.ones((8, 16), np.float32))


def test_keras3_weights_with_a_given_plan_are_scattered():
    strategy = TofuStrategy(8, plan=h.HandPlan(mesh_shape={"batch": 2, "model": 4},
                                               variable_layouts={"wide/kernel": (None, "model")},
                                               input_layouts={"x": ("batch",)}))
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, kernel_initializer="ones",
                                                                        name="wide")])
    shards = tf.experimental.dtensor.unpack(model.layers[0].kernel.value.read_value())
    assert [tuple(s.shape) for s in shards] == [(8, 4)] * 8
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), np.ones((8, 16), np.float32))
