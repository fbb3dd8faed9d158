"""What every tofu_tf example shares: flags, synthetic data, and the training
run with its report (plan, time, per-device state bytes).

Examples train on synthetic data the size of the model's inputs, so they run
anywhere with no download.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags, logging  # noqa: E402

flags.DEFINE_integer("num_gpus", 8, "Devices to train on (virtual CPU devices when there are fewer GPUs).")
flags.DEFINE_integer("batch_size", 16, "Global batch size.")
flags.DEFINE_integer("steps", 4, "Training steps.")
flags.DEFINE_bool("plan_only", False, "Print the plan and exit without training.")
flags.DEFINE_enum("compare", None, ["data_parallel"], "Also train with this method and compare side by side.")
flags.DEFINE_enum("method", "tofu", ["tofu", "ilp", "data_parallel", "megatron"], "Planner.")
flags.DEFINE_string("optimizer", "adam", "Keras optimizer name.")
FLAGS = flags.FLAGS


def run(build_model, *, loss="sparse_categorical_crossentropy"):
    """Train ``build_model()`` under TofuStrategy (and the comparison method), print a report."""
    methods = [FLAGS.method] + ([FLAGS.compare] if FLAGS.compare else [])
    rows = [_train_once(build_model, loss, method) for method in methods]
    print()
    print(f"{'method':<16}{'mesh':<28}{'state MiB/device':>18}{'modeled peak MiB':>18}{'fit s':>9}{'final loss':>12}")
    for row in rows:
        print(f"{row['method']:<16}{row['mesh']:<28}{row['state_mib']:>18.2f}{row['peak_mib']:>18.2f}"
              f"{row['seconds']:>9.2f}{row['loss']:>12.4f}")


def _train_once(build_model, loss, method):
    from tofu_tf import TofuStrategy

    strategy = TofuStrategy(FLAGS.num_gpus, method=method)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=FLAGS.optimizer, loss=loss)
    x, y = synthetic_data(model, FLAGS.batch_size * FLAGS.steps)
    if FLAGS.plan_only:
        plan = strategy.plan_model(model, batch_size=FLAGS.batch_size)
        print(plan.summary())
        return _row(method, strategy, model, 0.0, float("nan"))
    logging.info("training %s (%s parameters) for %d steps with %s", model.name,
                 f"{model.count_params():,}", FLAGS.steps, method)
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=2, shuffle=False)
    seconds = time.perf_counter() - start  # the strategy logged its plan when training started
    return _row(method, strategy, model, seconds, history.history["loss"][-1])


def _row(method, strategy, model, seconds, loss):
    from tensorflow.experimental import dtensor
    state = 0
    variables = list(model.weights) + list(getattr(model.optimizer, "variables", []))
    for variable in variables:
        if hasattr(variable, "layout"):
            shard = dtensor.unpack(variable.read_value())[0]
            state += shard.shape.num_elements() * shard.dtype.size
    mesh = " x ".join(f"{k}={v}" for k, v in strategy.plan.mesh_shape.items())
    return {"method": method, "mesh": mesh, "state_mib": state / 2**20,
            "peak_mib": strategy.plan.peak_memory_bytes / 2**20, "seconds": seconds, "loss": loss}


def synthetic_data(model, n: int, seed: int = 0):
    """Inputs shaped like the model's, and integer class labels shaped like its output."""
    import numpy as np
    rng = np.random.default_rng(seed)
    shape = tuple(model.input_shape[1:])
    classes = model.output_shape[-1]
    if str(getattr(model.inputs[0].dtype, "name", model.inputs[0].dtype)).startswith("int"):
        x = rng.integers(0, classes, (n,) + shape).astype("int32")
        y = rng.integers(0, classes, (n,) + shape).astype("int32")
    else:
        x = rng.normal(size=(n,) + shape).astype("float32")
        y = rng.integers(0, classes, (n,) + tuple(model.output_shape[1:-1])).astype("int32")
    return x, y
