"""The options TofuStrategy's step programs are called with: grappler off on meshes of CPU devices.

TensorFlow optimizes a function with grappler when it first runs it. A DTensor program is
expanded into one program per mesh device, and TensorFlow's multi-device function runtime
runs grappler's whole pipeline on each device's part, in parallel. Virtual CPU devices share
the host's cores, so on a CPU mesh of N devices that is N times one device's optimization on
the same cores: on keras-hub's models it was the largest part of the first step (bench/README.md,
"What the first step compiles"). Without it a step there took about as long, a few percent
more on some models (same table); virtual CPUs are for trying a model, where
the first step is what is waited for, so the strategy calls its step programs with grappler's
meta-optimizer off on CPU meshes. GPU meshes keep TensorFlow's default: grappler's fusions and
layout rewrites are made for GPUs, and a host with GPUs has the cores to optimize the parts in
parallel (not measured: no GPU here). ``TofuStrategy(graph_optimizations=True | False)`` overrides.

The switch is the calling thread's ``FunctionCallOptions`` (``tensorflow.python.eager.context``),
which TensorFlow attaches to every function call it issues as the call's ``config_proto``:
only the programs called inside ``step_call_options(False)`` see it, on that thread. The change
"step_graph_optimizations_off" (``tofu_tf.tf.compat.registry``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context

from tofu_tf.tf.compat.registry import change

CHANGE = change("step_graph_optimizations_off")
ONE_BY_ONE = change("step_all_reduces_one_by_one")
# DTensor reads this cap on the all-reduces its combining pass merges into one each time it
# compiles a program (``DTensorMlirPassRunner::ImportGraphToMlir``, as a module attribute); 1
# runs every all-reduce alone, unset merges as many as it can.
GROUP_SIZE_ENV = "DTENSOR_ALLREDUCE_COMBINE_OPTIMIZATION_GROUP_SIZE"
_ONE_BY_ONE_LOCK = threading.Lock()
_one_by_one_calls = 0


def graph_optimizations_default(device_type: str) -> bool:
    """Whether step programs are optimized by grappler on a mesh of ``device_type`` devices
    when the user did not say: not on CPUs (see the module's docstring)."""
    return device_type != "CPU"


@contextlib.contextmanager
def step_call_options(optimize: bool) -> Iterator[None]:
    """While active, functions this thread calls are optimized by grappler only if ``optimize``
    (TensorFlow's configured options otherwise unchanged); the thread's options come back on exit."""
    if optimize:
        yield
        return
    eager = context.context()
    saved = eager.function_call_options
    config = config_pb2.ConfigProto.FromString(saved.config_proto_serialized)
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    eager.function_call_options = context.FunctionCallOptions(executor_type=saved.executor_type,
                                                              config_proto=config)
    try:
        yield
    finally:
        eager.function_call_options = saved


@contextlib.contextmanager
def all_reduces_one_by_one(active: bool) -> Iterator[None]:
    """While active, DTensor compiles the programs called with every all-reduce run alone, not
    combined into one (``tofu_tf.cost.combining``: a plan whose gradients cost more to pack than
    the collective launches combining saves; ``Plan.all_reduces_combined`` False). A program is
    compiled at its first call, so only that call needs it; the step calls of the strategy all
    enter it, which costs an environment lookup. The switch is the process's: a DTensor program
    another thread compiles meanwhile runs its all-reduces alone too (the same sums). A switch the
    user set is left as set. Undone when the last call that set it returns."""
    global _one_by_one_calls
    with _ONE_BY_ONE_LOCK:
        # a switch set with no call of ours inside is the user's own setting
        owns = active and (_one_by_one_calls > 0 or GROUP_SIZE_ENV not in os.environ)
        if owns:
            _one_by_one_calls += 1
            os.environ[GROUP_SIZE_ENV] = "1"
    try:
        yield
    finally:
        if owns:
            with _ONE_BY_ONE_LOCK:
                _one_by_one_calls -= 1
                if _one_by_one_calls == 0:
                    os.environ.pop(GROUP_SIZE_ENV, None)
