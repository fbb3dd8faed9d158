"""Step programs run without grappler on CPU meshes (``tofu_tf.tf.compat.calls``), and only they.

What is checked is what TensorFlow attaches to each function call it issues (the calling
thread's ``FunctionCallOptions``, sent as the call's ``config_proto``): the step programs of a
CPU-mesh TofuStrategy carry grappler's meta-optimizer disabled, ``graph_optimizations=True``
keeps TensorFlow's options, and nothing outside a step call sees the change. The training
itself is compared with one device's.
"""

import os
import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context

from tofu_tf import models
from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf.compat import calls
from tests import strategy_helpers


def _grappler_disabled() -> bool:
    """Whether the calling thread's next function call would go out with grappler disabled."""
    serialized = context.context().function_call_options.config_proto_serialized
    return config_pb2.ConfigProto.FromString(serialized).graph_options.rewrite_options.disable_meta_optimizer


def _record_calls(monkeypatch, probe) -> list:
    """(function name, ``probe()`` as the call goes out) of every function call TensorFlow issues."""
    seen = []
    original = context.Context.call_function

    def call_function(self, name, *args, **kwargs):
        seen.append((name.decode() if isinstance(name, bytes) else name, probe()))
        return original(self, name, *args, **kwargs)
    monkeypatch.setattr(context.Context, "call_function", call_function)
    return seen


@pytest.fixture
def function_calls(monkeypatch):
    """(function name, grappler disabled) of every function call TensorFlow issues meanwhile."""
    return _record_calls(monkeypatch, _grappler_disabled)


def _mlp():
    return models.mlp(input_dim=16, width=32, depth=2, num_classes=8)


def _step_calls(seen):
    """The step programs' calls: ``_Program``'s ``run`` function."""
    return [disabled for name, disabled in seen if name.startswith("__inference_run_")]


def test_a_cpu_mesh_runs_its_steps_without_grappler_and_trains_as_one_device(function_calls):
    x, y = strategy_helpers.data_for(_mlp())
    trained = strategy_helpers.train_beside_one_device(_mlp, x, y)
    steps = _step_calls(function_calls)
    assert len(steps) == strategy_helpers.STEPS and all(steps), function_calls
    assert not _grappler_disabled()            # the thread's options are TensorFlow's again
    strategy_helpers.assert_trained_alike(*trained)


def test_graph_optimizations_true_keeps_tensorflow_options(function_calls):
    strategy = TofuStrategy(8, graph_optimizations=True)
    with strategy.scope():
        model = _mlp()
        strategy_helpers.compile_model(model)
    x, y = strategy_helpers.data_for(model)
    model.fit(x, y, batch_size=strategy_helpers.BATCH, epochs=1, shuffle=False, verbose=0)
    steps = _step_calls(function_calls)
    assert len(steps) == strategy_helpers.STEPS and not any(steps), function_calls


def test_the_options_are_the_calling_threads_and_come_back_on_error():
    inside = threading.Event()
    release = threading.Event()
    other = []

    def elsewhere():
        inside.wait(10)
        other.append(_grappler_disabled())
        release.set()
    thread = threading.Thread(target=elsewhere)
    thread.start()
    with pytest.raises(ValueError, match="step failed"):
        with calls.step_call_options(False):
            assert _grappler_disabled()
            inside.set()
            release.wait(10)
            raise ValueError("step failed")
    thread.join(10)
    assert other == [False]
    assert not _grappler_disabled()
    with calls.step_call_options(True):
        assert not _grappler_disabled()


def test_cpu_meshes_default_to_no_grappler_and_gpu_meshes_to_tensorflows():
    assert calls.graph_optimizations_default("CPU") is False
    assert calls.graph_optimizations_default("GPU") is True
    tf.debugging.assert_equal(tf.constant(1), 1)   # TF's eager calls outside any step are untouched
    assert not _grappler_disabled()


def test_graph_optimizations_takes_a_bool_or_none():
    with pytest.raises(ValueError, match="graph_optimizations='auto'"):
        TofuStrategy(8, graph_optimizations="auto")


@pytest.fixture
def group_sizes(monkeypatch):
    """(function name, DTensor's combining cap as the environment holds it) of every function call."""
    monkeypatch.delenv(calls.GROUP_SIZE_ENV, raising=False)
    return _record_calls(monkeypatch, lambda: os.environ.get(calls.GROUP_SIZE_ENV))


@pytest.mark.parametrize("width, combined", [(1024, False), (32, True)])
def test_a_plan_that_runs_its_all_reduces_one_by_one_compiles_its_training_step_so(group_sizes, width, combined):
    """A data-parallel 2 x 1024 MLP's 7 gradients (5 MiB) cost more to pack into DTensor's
    combined all-reduce than the 6 latencies combining saves on the CPU profile: its plan runs
    them one by one, and the training step is called (so compiled) with DTensor's cap on combined
    all-reduces at 1 (bench/executed.py then reads 7 all-reduces where it read 1). A narrow MLP's
    plan combines them, and nothing is set. Evaluation and prediction keep DTensor's default, and
    the switch is gone after the calls."""
    def build():
        return models.mlp(input_dim=256, width=width, depth=2, num_classes=8)
    strategy = TofuStrategy(8, method="data_parallel", plan_cache=False)
    with strategy.scope():
        model = build()
        strategy_helpers.compile_model(model)
    x, y = strategy_helpers.data_for(model)
    model.fit(x, y, batch_size=strategy_helpers.BATCH, epochs=1, shuffle=False, verbose=0)
    model.evaluate(x, y, batch_size=strategy_helpers.BATCH, verbose=0)
    assert strategy.plan.all_reduces_combined is combined
    steps = [size for name, size in group_sizes if name.startswith("__inference_run_")]
    expected = None if combined else "1"
    assert len(steps) == 2 * strategy_helpers.STEPS
    assert steps[:strategy_helpers.STEPS] == [expected] * strategy_helpers.STEPS, group_sizes
    assert steps[strategy_helpers.STEPS:] == [None] * strategy_helpers.STEPS, group_sizes     # evaluate's
    assert calls.GROUP_SIZE_ENV not in os.environ
    if not combined:
        assert "one by one" in strategy.plan.summary()


def test_a_cap_the_user_set_is_left_as_set(monkeypatch):
    monkeypatch.setenv(calls.GROUP_SIZE_ENV, "4")
    with calls.all_reduces_one_by_one(True):
        assert os.environ[calls.GROUP_SIZE_ENV] == "4"
    assert os.environ[calls.GROUP_SIZE_ENV] == "4"


def test_the_cap_is_undone_when_the_last_call_that_set_it_returns(monkeypatch):
    monkeypatch.delenv(calls.GROUP_SIZE_ENV, raising=False)
    with pytest.raises(ValueError, match="step failed"):
        with calls.all_reduces_one_by_one(True):
            with calls.all_reduces_one_by_one(True):
                assert os.environ[calls.GROUP_SIZE_ENV] == "1"
            assert os.environ[calls.GROUP_SIZE_ENV] == "1"        # the outer call still runs
            with calls.all_reduces_one_by_one(False):
                assert os.environ[calls.GROUP_SIZE_ENV] == "1"
            raise ValueError("step failed")
    assert calls.GROUP_SIZE_ENV not in os.environ


def test_a_custom_loop_whose_plan_runs_all_reduces_one_by_one_is_told_how_to_run_it_so(caplog):
    """A custom loop's step is compiled at the user's first call of their tf.function, where the
    strategy sets nothing: the log says the plan runs its all-reduces one by one and names the
    switch that makes DTensor compile it so."""
    import tf_keras
    strategy = TofuStrategy(8, method="data_parallel", plan_cache=False)
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((256,)), tf_keras.layers.Dense(1024, activation="relu"),
                                     tf_keras.layers.Dense(1024, activation="relu"), tf_keras.layers.Dense(8)])
        optimizer = tf_keras.optimizers.SGD(0.1)
        loss_object = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices((rng.normal(size=(16, 256)).astype("float32"),
                                               rng.integers(0, 8, (16,)).astype("int32"))).batch(16)

    def step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(labels, model(features, training=True)), global_batch_size=16)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def train_step(inputs):
        return strategy.reduce("SUM", strategy.run(step, args=(inputs,)), axis=None)

    with caplog.at_level("INFO", logger="absl"):
        for batch in strategy.experimental_distribute_dataset(data):
            assert np.isfinite(train_step(batch).numpy())
    assert strategy.plan.all_reduces_combined is False
    assert "runs its all-reduces one by one" in caplog.text and f"{calls.GROUP_SIZE_ENV}=1" in caplog.text
