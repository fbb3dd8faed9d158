"""Seeded initial values are one device's, bit for bit, whatever the plan, device count or
order of reads (issue #39): a split weight's random initial value is drawn whole on the host,
as one device draws it, and each device receives its shard (tofu_tf.tf.variables.materialize);
an unseeded tf-keras initializer's seed is chosen at its variable's creation, as one device
chooses it (tofu_tf.tf.compat.initializer_seeds)."""

import contextlib
import functools
import random

import keras as keras3
import numpy as np
import pytest
import tf_keras as keras

from tofu_tf import hub_models
from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf import keras_adapter

# (num_gpus, options): a memory budget that splits kernels over 8, Megatron's plan, the
# planner's own plan on 4 devices, Megatron's on 2, and TofuStrategy on one device (a plan on
# a one-device mesh, every weight whole) against plain Keras.
PLANS = [(8, dict(memory_budget_bytes=400_000)), (8, dict(method="megatron")), (4, {}), (2, dict(method="megatron")),
         (1, {})]
PLAN_IDS = ["tofu-8-budget", "megatron-8", "tofu-4", "megatron-2", "tofu-1"]


def _tf_keras_model():
    """Every tf-keras initializer family on weights a plan splits: uniform, normal, truncated
    normal, Glorot/He/LeCun, Orthogonal, Identity, Constant, zeros and ones; seeded and unseeded."""
    init = keras.initializers
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, name="glorot"),                                  # unseeded defaults
        keras.layers.Dense(256, kernel_initializer="he_normal", bias_initializer="ones", name="he"),
        keras.layers.Dense(128, kernel_initializer=init.LecunUniform(seed=3),
                           bias_initializer=init.RandomNormal(seed=4), name="lecun"),
        keras.layers.Dense(128, kernel_initializer=init.Orthogonal(seed=5),
                           bias_initializer=init.TruncatedNormal(seed=6), name="orthogonal"),
        keras.layers.Dense(128, kernel_initializer=init.Identity(), bias_initializer=init.Constant(0.5),
                           name="identity"),
        keras.layers.Dense(64, kernel_initializer=init.RandomUniform(-1.0, 1.0), name="uniform"),
        keras.layers.Dense(64, kernel_initializer=init.VarianceScaling(2.0, "fan_out", "truncated_normal"),
                           name="scaled"),
        keras.layers.Dense(10, kernel_initializer="glorot_normal", name="head")])


def _keras3_model():
    """The same families in Keras 3."""
    init = keras3.initializers
    return keras3.Sequential([
        keras3.Input((64,)),
        keras3.layers.Dense(256, name="glorot"),
        keras3.layers.Dense(256, kernel_initializer="he_normal", bias_initializer="ones", name="he"),
        keras3.layers.Dense(128, kernel_initializer=init.LecunUniform(seed=3),
                            bias_initializer=init.RandomNormal(seed=4), name="lecun"),
        keras3.layers.Dense(128, kernel_initializer=init.Orthogonal(seed=5),
                            bias_initializer=init.TruncatedNormal(seed=6), name="orthogonal"),
        keras3.layers.Dense(128, kernel_initializer=init.Identity(), bias_initializer=init.Constant(0.5),
                            name="identity"),
        keras3.layers.Dense(64, kernel_initializer=init.RandomUniform(-1.0, 1.0), name="uniform"),
        keras3.layers.Dense(64, kernel_initializer=init.VarianceScaling(2.0, "fan_out", "truncated_normal"),
                            name="scaled"),
        keras3.layers.Dense(10, kernel_initializer="glorot_normal", name="head")])


def _build(kind, strategy, *, seed=6):
    kit = keras if kind == "tf_keras" else keras3
    kit.utils.set_random_seed(seed)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = _tf_keras_model() if kind == "tf_keras" else _keras3_model()
        model.compile(optimizer="sgd", loss=kit.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _path(weight, model) -> str:
    """The weight's path below its model (the model's own name is uniquified per build)."""
    path = keras_adapter.variable_path(weight)
    return path[len(model.name) + 1:] if path.startswith(model.name + "/") else path


def _values(model) -> dict:
    values = {_path(w, model): np.asarray(keras_adapter.tf_variable(w).numpy()) for w in model.weights}
    assert len(values) == len(model.weights), sorted(values)
    return values


def _assert_bitwise_equal(got: dict, expected: dict):
    assert got.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def _split(model) -> list:
    return [keras_adapter.variable_path(w) for w in model.weights
            if not keras_adapter.tf_variable(w).layout.is_fully_replicated()]


@pytest.mark.parametrize("kind", ["tf_keras", "keras3"])
@pytest.mark.parametrize("num_gpus, options", PLANS, ids=PLAN_IDS)
def test_initial_values_are_one_devices_whatever_the_plan(kind, num_gpus, options):
    """Before: a kernel the plan split was drawn under its layout, and DTensor folds each
    device's coordinates into the seed: a 3-layer MLP's split kernels were 0.29 away from one
    device's (the biases kept whole were equal)."""
    expected = _values(_build(kind, None))
    strategy = TofuStrategy(num_gpus=num_gpus, **options)
    model = _build(kind, strategy)
    strategy.plan_model(model, batch_size=16)
    assert _split(model) or num_gpus == 1, "the plan splits no weight: the test would prove nothing"
    _assert_bitwise_equal(_values(model), expected)


def _assert_head_read_first_then_planned(model, strategy, expected):
    """The head's kernel read before the plan, then the plan (which splits some weight): the value
    read and every weight after the plan are one device's (``expected``)."""
    head = model.get_layer("head").kernel
    read_first = np.asarray(keras_adapter.tf_variable(head).numpy())
    strategy.plan_model(model, batch_size=16)
    assert _split(model)
    np.testing.assert_array_equal(read_first, expected[_path(head, model)])
    _assert_bitwise_equal(_values(model), expected)


@pytest.mark.parametrize("kind", ["tf_keras", "keras3"])
def test_reading_weights_before_the_plan_changes_nothing(kind):
    """A read before the plan draws that weight on the host then; the rest are drawn at the
    plan. Before, a tf-keras initializer took its seed when it first ran, so reading the last
    kernel first gave it the first kernel's seed (and every other weight another one)."""
    expected = _values(_build(kind, None))
    strategy = TofuStrategy(num_gpus=8, memory_budget_bytes=400_000)
    _assert_head_read_first_then_planned(_build(kind, strategy), strategy, expected)
    strategy = TofuStrategy(num_gpus=8, memory_budget_bytes=400_000)
    again = _build(kind, strategy)
    before = again.get_weights()                  # every weight read whole before the plan
    strategy.plan_model(again, batch_size=16)
    _assert_bitwise_equal(_values(again), expected)
    for value, path in zip(before, _values(again)):
        np.testing.assert_array_equal(value, expected[path], err_msg=path)


def test_unseeded_runs_stay_as_random_as_one_devices():
    """No seed set: tf-keras draws an unseeded initializer's seed from Python's ``random`` (at the
    variable's creation, under the strategy as on one device), so the same Python random state
    gives one device's values and another state other values; no fixed seed appears."""
    from tf_keras.src import backend as tf_keras_backend

    def build(strategy, state):
        tf_keras_backend._SEED_GENERATOR.__dict__.pop("generator", None)   # as if never seeded
        random.seed(state)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, name="a"),
                                      keras.layers.Dense(10, name="b")])
            model.compile(optimizer="sgd", loss="mse")
        if strategy:
            strategy.plan_model(model, batch_size=16)
        return _values(model)

    expected = build(None, 21)
    _assert_bitwise_equal(build(TofuStrategy(num_gpus=8, memory_budget_bytes=100_000), 21), expected)
    other = build(TofuStrategy(num_gpus=8, memory_budget_bytes=100_000), 22)
    assert all(not np.array_equal(other[p], expected[p]) for p in expected if "kernel" in p)


class _TwoDraws(keras3.initializers.Initializer):
    """A user's own Keras 3 initializer drawing twice from its seed (two generator states a call)."""

    def __init__(self, seed):
        self.seed = seed

    def __call__(self, shape, dtype=None):
        return (keras3.random.normal(shape, seed=self.seed, dtype=dtype)
                + keras3.random.uniform(shape, seed=self.seed, dtype=dtype))


def _shared_generator_model():
    """Keras 3 initializers seeded with one ``SeedGenerator`` object, shared by several weights:
    each call takes the generator's next state, in the order one device creates the weights."""
    generator = keras3.random.SeedGenerator(7)
    init = keras3.initializers
    shared = init.GlorotUniform(seed=generator)
    return keras3.Sequential([
        keras3.Input((64,)),
        keras3.layers.Dense(256, kernel_initializer=shared, name="glorot"),
        keras3.layers.Dense(128, kernel_initializer=shared, bias_initializer=init.RandomNormal(seed=generator),
                            name="normal"),
        keras3.layers.Dense(128, kernel_initializer=_TwoDraws(seed=generator), name="two_draws"),
        keras3.layers.Dense(10, kernel_initializer=init.Orthogonal(seed=generator), name="head")]), generator


def test_initializers_sharing_a_seed_generator_take_one_devices_states():
    """Before, a Keras 3 initializer seeded with a ``SeedGenerator`` drew ``generator.next()``
    when its deferred variable was first read or planned: reading the head's kernel first gave
    it the first kernel's state, and every split kernel took another's (0.27 away)."""
    def build(strategy):
        keras3.utils.set_random_seed(6)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model, generator = _shared_generator_model()
            model.compile(optimizer="sgd", loss="mse")
        return model, generator

    reference, generator = build(None)
    expected = _values(reference)
    strategy = TofuStrategy(num_gpus=8, memory_budget_bytes=400_000)
    model, tofu_generator = build(strategy)
    _assert_head_read_first_then_planned(model, strategy, expected)
    np.testing.assert_array_equal(np.asarray(keras_adapter.tf_variable(tofu_generator.state).numpy()),
                                  generator.state.numpy())    # advanced as far as one device's


@pytest.mark.parametrize("num_gpus", [8, 4])
def test_a_keras_hub_llama_starts_from_one_devices_weights(num_gpus):
    """keras-hub's own initializers (Llama's kernels: RandomNormal / VarianceScaling, its embedding),
    a small config, planned on 8 and 4 devices."""
    family = hub_models.FAMILIES["llama"]
    x, _ = hub_models.data(family, 16)

    def build(strategy):
        keras3.utils.set_random_seed(3)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = hub_models.llama(width=64)
            model.compile(optimizer="sgd", loss=keras3.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    expected = _values(build(None))
    strategy = TofuStrategy(num_gpus=num_gpus, method="megatron")
    model = build(strategy)
    strategy.plan_model(model, batch_size=8, features={k: v[:8] for k, v in x.items()})
    assert _split(model)
    _assert_bitwise_equal(_values(model), expected)


@pytest.mark.parametrize("initializer", ["glorot_uniform", "he_uniform", "lecun_uniform", "random_uniform"])
@pytest.mark.parametrize("shape, specs", [((16, 7), ("model", None)), ((12, 6), ("batch", None)),
                                          ((8, 3, 5), ("model", None, None))])
def test_uniform_shards_split_by_rows_are_drawn_by_index(monkeypatch, initializer, shape, specs):
    """A tf-keras uniform draw split by its first dimension: each device draws its rows from the
    Philox counter at their flat offset (offsets not multiples of four included: 7 and 15
    elements a row), never the whole value, and the bits are one device's."""
    from tensorflow.experimental import dtensor

    from tofu_tf.tf import devices, lowering
    from tofu_tf.tf import variables as variables_lib
    init = keras.initializers.get({"class_name": initializer, "config": {"seed": 11}})
    expected = init(shape, dtype="float32").numpy()
    device_set = devices.DeviceSet("CPU", tuple(f"CPU:{i}" for i in range(8)), virtual=True)
    mesh = lowering.make_mesh({"batch": 2, "model": 4}, device_set)
    layout = dtensor.Layout([dtensor.UNSHARDED if s is None else s for s in specs], mesh)

    def no_host_draw(*args, **kwargs):
        raise AssertionError("drawn whole on the host")
    monkeypatch.setattr(variables_lib, "scatter_from_host", no_host_draw)
    fresh = keras.initializers.get({"class_name": initializer, "config": {"seed": 11}})
    deferred = variables_lib.DeferredVariable(
        initial_value=functools.partial(fresh, shape, dtype="float32"), shape=shape, dtype="float32",
        name="kernel", trainable=True, extra_kwargs={})
    variables_lib.materialize_all([(deferred, layout)])
    monkeypatch.undo()
    np.testing.assert_array_equal(deferred.numpy(), expected)
