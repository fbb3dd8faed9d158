"""Step programs run without grappler on CPU meshes (``tofu_tf.tf.compat.calls``), and only they.

What is checked is what TensorFlow attaches to each function call it issues (the calling
thread's ``FunctionCallOptions``, sent as the call's ``config_proto``): the step programs of a
CPU-mesh TofuStrategy carry grappler's meta-optimizer disabled, ``graph_optimizations=True``
keeps TensorFlow's options, and nothing outside a step call sees the change. The training
itself is compared with one device's.
"""

import threading

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


@pytest.fixture
def function_calls(monkeypatch):
    """(function name, grappler disabled) of every function call TensorFlow issues meanwhile."""
    seen = []
    original = context.Context.call_function

    def call_function(self, name, *args, **kwargs):
        seen.append((name.decode() if isinstance(name, bytes) else name, _grappler_disabled()))
        return original(self, name, *args, **kwargs)
    monkeypatch.setattr(context.Context, "call_function", call_function)
    return seen


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
