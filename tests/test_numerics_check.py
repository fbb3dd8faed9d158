"""TofuStrategy.check_numerics: sharded steps against one device's, and the model left as it was."""

import types

import keras as keras3
import numpy as np
import pytest
import tf_keras as keras

from tests import strategy_helpers as h
from tofu_tf import models
from tofu_tf.strategies import TofuStrategy
from tofu_tf.strategies import numerics
from tofu_tf.tf import keras_adapter

pytestmark = pytest.mark.slow   # trains models under TofuStrategy end to end


def state_of(model):
    """Weights and optimizer variables (step count, slots) as host values."""
    return ([np.array(w) for w in model.get_weights()],
            [np.array(keras_adapter.tf_variable(v).numpy()) for v in model.optimizer.variables])


def assert_same_state(before, after):
    for kind, want, got in zip(("weight", "optimizer variable"), before, after):
        assert len(want) == len(got), kind
        for i, (a, b) in enumerate(zip(want, got)):
            np.testing.assert_array_equal(a, b, err_msg=f"{kind} {i}")


def on_strategy(build, plan, *, compile_fn=h.compile_model):
    strategy = TofuStrategy(8, plan=plan)
    with strategy.scope():
        model = build()
        compile_fn(model)
    return strategy, model


def mesh_plan(layouts):
    """Weights sharded by hand on a (batch=2, model=4) mesh, whatever the planner would choose."""
    return h.HandPlan({"batch": 2, "model": 4}, layouts, {"x": ("batch",)})


# Paths match tf-keras' and, as suffixes, Keras 3's model-prefixed ones.
MLP_LAYOUTS = {"dense_0/kernel": (None, "model"), "dense_0/bias": ("model",), "dense_1/kernel": ("model", None)}
MODELS = {
    "mlp": (lambda: h.build("mlp"), mesh_plan(MLP_LAYOUTS)),
    "transformer": (lambda: h.build("transformer"),
                    mesh_plan({"block_0_attn/value/kernel": (None, "model", None),
                               "block_0_attn/attention_output/kernel": ("model", None, None),
                               "block_0_mlp_in/kernel": (None, "model"), "block_0_mlp_out/kernel": ("model", None),
                               "token_embedding/embeddings": (None, "model")})),
    "cnn": (lambda: h.build("cnn_bn"), mesh_plan({})),      # DTensor runs convolutions batch-split only
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_two_sgd_steps_agree_and_the_model_is_left_as_it_was(name):
    build, plan = MODELS[name]
    strategy, model = on_strategy(build, plan)
    x, y = h.data_for(model, steps=3)
    model.fit(x[:h.BATCH], y[:h.BATCH], batch_size=h.BATCH, verbose=0)    # slots and step count not at their start
    before = state_of(model)
    report = strategy.check_numerics(model, x[h.BATCH:], y[h.BATCH:], steps=2)
    assert_same_state(before, state_of(model))
    assert report.max_relative_difference < 1e-5, report.summary()
    assert report.ok(rtol=1e-5)
    assert len(report.losses_sharded) == len(report.losses_one_device) == 2
    assert not any(d.noise_driven for d in report.by_variable.values())     # SGD does not magnify noise
    # A key bias under softmax attention has no gradient in exact arithmetic: reported, left out of the verdict.
    noise = [path for path, d in report.by_variable.items() if d.noise_gradient]
    assert noise == (["block_0_attn/key/bias"] if name == "transformer" else []), report.summary()
    assert len(report.by_variable) == len(model.weights)


def test_keras3_mlp_agrees_and_is_left_as_it_was():
    def build():
        keras3.utils.set_random_seed(11)
        return models.mlp(width=32, depth=2, keras=keras3)

    def compile_fn(model):
        model.compile(optimizer=keras3.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras3.losses.SparseCategoricalCrossentropy(from_logits=True))

    strategy, model = on_strategy(build, mesh_plan(MLP_LAYOUTS), compile_fn=compile_fn)
    x, y = h.data_for(model, steps=3)
    model.fit(x[:h.BATCH], y[:h.BATCH], batch_size=h.BATCH, verbose=0)
    before = state_of(model)
    report = strategy.check_numerics(model, x[h.BATCH:], y[h.BATCH:], steps=2)
    assert_same_state(before, state_of(model))
    assert report.ok(rtol=1e-5), report.summary()
    assert report.by_variable["mlp/dense_0/kernel"].layout == "(-, model)"


def bn_dropout_model():
    """A Dense bias feeding BatchNormalization (zero gradient in exact arithmetic), and a dropout."""
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="pre_bn"),
                             keras.layers.BatchNormalization(name="bn"), keras.layers.ReLU(name="relu"),
                             keras.layers.Dropout(0.25, name="drop"), keras.layers.Dense(10, name="head")],
                            name="bn_mlp")


@pytest.fixture(scope="module")
def bn_adam_report():
    """Not planned before the check: the check plans it (the planner's own layouts)."""
    strategy, model = on_strategy(bn_dropout_model, None,
                                  compile_fn=lambda m: h.compile_model(m, keras.optimizers.Adam(0.01)))
    x, y = h.data_for(model)
    report = strategy.check_numerics(model, x, y, steps=2)
    assert strategy.plan is not None
    return report


def test_a_pre_batch_norm_bias_under_adam_is_flagged_as_rounding_noise(bn_adam_report):
    flagged = sorted(path for path, d in bn_adam_report.by_variable.items() if d.noise_driven)
    assert flagged == ["pre_bn/bias"], bn_adam_report.summary()
    assert bn_adam_report.normalizes_gradient
    assert "pre_bn/bias: gradient zero in exact arithmetic" in bn_adam_report.summary()


def test_dropout_layers_are_named_and_their_masks_called_random(bn_adam_report):
    assert [(layer.path, layer.rate) for layer in bn_adam_report.random_layers] == [("drop", 0.25)]
    assert bn_adam_report.random_masks
    text = bn_adam_report.summary()
    assert "random layers: drop (Dropout, rate 0.25)" in text
    assert "the comparison includes random masks" in text


def test_a_corrupted_gradient_is_named_as_the_worst_variable():
    """A test-only fault in the sharded step: dense_1/kernel's gradient halved, as a reduction
    lost over the batch axis (size 2) would leave it. One device trains the true step."""
    strategy, model = on_strategy(MODELS["mlp"][0], MODELS["mlp"][1])
    apply_gradients = model.optimizer.apply_gradients

    def halved(self, grads_and_vars, *args, **kwargs):
        pairs = [(g * 0.5 if v.name.startswith("dense_1/kernel") else g, v) for g, v in grads_and_vars]
        return apply_gradients(pairs, *args, **kwargs)

    model.optimizer.apply_gradients = types.MethodType(halved, model.optimizer)
    x, y = h.data_for(model)
    report = strategy.check_numerics(model, x, y, steps=1)
    worst, *rest = report.worst_first
    assert worst.path == "dense_1/kernel", report.summary()
    assert worst.max_relative > 1e-3 and all(d.max_relative < 1e-5 for d in rest), report.summary()
    assert not report.ok()
    # The optimizer had not made its slots: the check made them, and left them as a first step finds them.
    iterations, *slots = state_of(model)[1]
    assert iterations == 0 and slots and all(not slot.any() for slot in slots)


def test_a_model_too_large_for_the_host_is_refused_before_any_copy():
    strategy, model = on_strategy(MODELS["mlp"][0], MODELS["mlp"][1])
    x, y = h.data_for(model)
    weights = sum(w.size * 4 for w in model.get_weights())
    before = state_of(model)
    with pytest.raises(numerics.HostMemoryError, match=r"needs at least [\d,]+ bytes .* host has 1,000 bytes"):
        strategy.check_numerics(model, x, y, max_host_bytes=1000)
    assert_same_state(before, state_of(model))            # not even the optimizer's slots made
    model.fit(x[:h.BATCH], y[:h.BATCH], batch_size=h.BATCH, verbose=0)
    slots = sum(np.size(v) * 4 for v in state_of(model)[1][1:])
    # Weights, slots and the two int64 step counts (the optimizer's, tf-keras' own) twice: kept to
    # restore them, and in the copy; gradients once.
    needed = 2 * (weights + slots + 2 * 8) + weights
    message = f"needs {needed:,} bytes"
    with pytest.raises(numerics.HostMemoryError, match=message):
        strategy.check_numerics(model, x, y, max_host_bytes=needed - 1)


def test_inside_the_scope_the_check_says_where_to_call_it():
    strategy, model = on_strategy(MODELS["mlp"][0], MODELS["mlp"][1])
    x, y = h.data_for(model)
    with strategy.scope(), pytest.raises(numerics.NumericsCheckError, match="outside strategy.scope"):
        strategy.check_numerics(model, x, y)


def difference(path, rel, *, noise=False):
    return numerics.VariableDifference(path=path, layout="(-, model)", max_abs=rel, max_relative=rel,
                                       gradient_norm=0.0 if noise else 1.0, noise_gradient=noise, noise_driven=noise)


def test_ok_leaves_out_noise_driven_variables_and_the_summary_lists_worst_first():
    report = numerics.NumericsReport(
        steps=1, batch_size=8, optimizer="Adam", normalizes_gradient=True, mesh="batch=2 x model=4",
        losses_sharded=(1.0,), losses_one_device=(1.0,),
        by_variable=types.MappingProxyType({d.path: d for d in (difference("a/kernel", 1e-7),
                                                                difference("b/bias", 0.5, noise=True),
                                                                difference("c/kernel", 1e-6))}),
        random_layers=())
    assert report.ok(rtol=1e-5) and not report.ok(rtol=1e-7)
    assert report.max_relative_difference == 1e-6
    rows = [line.split()[0] for line in report.summary().splitlines() if line.strip().startswith(("a/", "b/", "c/"))]
    assert rows == ["b/bias", "c/kernel", "a/kernel"]
    assert "rounding noise" in report.summary()


class TwoLayers(keras.Model):
    """A subclassed model whose constructor takes an object no config can carry."""

    def __init__(self, sizes):
        super().__init__(name="two_layers")
        self.hidden = keras.layers.Dense(sizes.width, activation="relu", name="hidden")
        self.head = keras.layers.Dense(10, name="head")

    def call(self, x):
        return self.head(self.hidden(x))


def test_a_model_not_rebuilt_from_its_config_is_checked_with_a_clone_function():
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = TwoLayers(types.SimpleNamespace(width=64))
        h.compile_model(model)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 16)).astype("float32"), rng.integers(0, 10, 16)
    with pytest.raises(numerics.NumericsCheckError, match="Pass clone=a function that builds the same model"):
        strategy.check_numerics(model, x, y)
    report = strategy.check_numerics(model, x, y, clone=lambda: TwoLayers(types.SimpleNamespace(width=64)))
    assert report.ok(rtol=1e-5), report.summary()


@pytest.mark.parametrize("kind", ["tf_keras", "keras3"])
def test_a_model_with_dropout_is_compared_with_the_same_masks(kind):
    """The one-device copy draws the masks TofuStrategy draws (issue #39): the same seeds (a Keras 3
    model's SeedGenerator states copied, a tf-keras copy's dropout seeded per step as the strategy
    seeds it), drawn whole, so the check passes with two active dropout layers. Before, the masks
    were other draws on each side and the check reported differences of 0.1-0.5."""
    import keras as keras3
    kit = keras if kind == "tf_keras" else keras3
    kit.utils.set_random_seed(3)
    strategy = TofuStrategy(8, method="megatron")
    with strategy.scope():
        model = kit.Sequential([kit.Input((16,)), kit.layers.Dense(32, name="a"), kit.layers.Dropout(0.4, name="drop"),
                                kit.layers.Dense(32, name="b"), kit.layers.Dropout(0.2, seed=5, name="drop2"),
                                kit.layers.Dense(10, name="head")])
        model.compile(optimizer=kit.optimizers.SGD(0.1),
                      loss=kit.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 16)).astype("float32"), rng.integers(0, 10, 64)
    model.fit(x[:32], y[:32], batch_size=16, verbose=0)
    seeds = [np.array(keras_adapter.tf_variable(v).numpy()) for v in keras_adapter.seed_states(model)]
    report = strategy.check_numerics(model, x[32:], y[32:], steps=2)
    assert report.random_masks
    assert report.ok(rtol=1e-5), report.summary()
    for value, variable in zip(seeds, keras_adapter.seed_states(model)):    # restored with the rest
        np.testing.assert_array_equal(keras_adapter.tf_variable(variable).numpy(), value)
    assert len(seeds) == (2 if kind == "keras3" else 0)
