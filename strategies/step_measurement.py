"""The measuring run of ``tofu-plan --measure``: a model trained two steps under a given plan.

``tofu_tf.executed.measure`` starts this module as a program, in a process whose environment
makes TensorFlow write DTensor's programs (``tofu_tf.executed.dump_environment``), with a
request file: the model's builder and keyword arguments as ``tofu-plan`` took them, the batch,
loss, optimizer and device count, and the plan. It builds the model under
``TofuStrategy(plan=...)``, trains two steps of synthetic data (the program DTensor compiles
depends on shapes, not values: integer inputs are zeros, which index any table; float inputs
are seeded normal draws), and prints the training state as placed, one line the parent finds
by ``tofu_tf.executed.RESULT_MARK``. The parent reads the programs.

    python -m tofu_tf.strategies.step_measurement REQUEST.json
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def placed_state_bytes(model) -> int:
    """Bytes of ``model``'s weights and its optimizer's variables that each device holds, from
    the layouts the variables were placed with (a variable without one counts whole)."""
    from tofu_tf.tf import keras_adapter
    state = 0
    for variable in list(model.weights) + keras_adapter.optimizer_variables(model.optimizer):
        value = keras_adapter.tf_variable(variable)
        shards = 1
        layout = getattr(value, "layout", None)
        if layout is not None:
            sizes = dict(zip(layout.mesh.dim_names, layout.mesh.shape()))
            for axis in layout.sharding_specs:
                shards *= sizes.get(axis, 1)
        state += value.shape.num_elements() * value.dtype.size // shards
    return state


def synthetic_batch(model, loss: str, samples: int, seed: int = 0):
    """``samples`` inputs and labels of ``model``'s shapes: zeros for integer inputs and for
    labels a sparse loss reads, seeded normal draws for float inputs, zeros for other labels."""
    import tensorflow as tf
    rng = np.random.default_rng(seed)

    def array(spec):
        shape = (samples,) + tuple(int(d) for d in spec.shape[1:])
        dtype = tf.as_dtype(spec.dtype)
        if dtype.is_integer or dtype == tf.bool:
            return np.zeros(shape, dtype.as_numpy_dtype)
        return rng.standard_normal(shape).astype(dtype.as_numpy_dtype)

    x = tf.nest.map_structure(array, model.input)
    outputs = tf.nest.flatten(model.output)
    sparse = "sparse" in loss

    def label(output):
        shape = (samples,) + tuple(int(d) for d in output.shape[1:(-1 if sparse else None)])
        return np.zeros(shape, "int32" if sparse else "float32")
    y = label(outputs[0]) if len(outputs) == 1 else [label(o) for o in outputs]
    return x, y


def run(request: dict) -> int:
    """Train two steps under the request's plan; the state bytes as placed."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    from tofu_tf.tf import devices
    devices.provide_devices(int(request["num_devices"]))
    from tofu_tf import plan_command
    from tofu_tf.plan import Plan
    from tofu_tf.strategies import TofuStrategy
    plan = Plan.from_dict(request["plan"], source="the plan to measure")
    strategy = TofuStrategy(int(request["num_devices"]), plan=plan, plan_cache=False)
    batch = int(request["batch_size"])
    plan_command.fresh_keras_names()      # as the planning process named the layers
    with strategy.scope():
        model = plan_command.build_model(request["model"], request.get("model_kwargs", {}), fresh_names=False)
        model.compile(optimizer=request["optimizer"], loss=request["loss"])
    x, y = synthetic_batch(model, request["loss"], 2 * batch)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return placed_state_bytes(model)


def main(argv) -> None:
    from tofu_tf.executed import RESULT_MARK
    with open(argv[1], encoding="utf-8") as handle:
        request = json.load(handle)
    print(RESULT_MARK + json.dumps({"state_bytes": run(request)}), flush=True)


if __name__ == "__main__":
    main(sys.argv)
