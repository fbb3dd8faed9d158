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
flags.DEFINE_integer("seed", 0, "Seed for the initial weights (the same for every method compared).")
flags.DEFINE_bool("check_numerics", False, "After training, run one more step sharded and on one device "
                  "(strategy.check_numerics) and print the per-variable differences; the run is unchanged.")
FLAGS = flags.FLAGS


def run(build_model, *, loss=None):
    """Train ``build_model()`` under TofuStrategy (and the comparison method), print a report.

    The reference models end in a Dense layer without activation, so the default loss
    reads logits. With ``--compare`` every method trains the first one's initial weights
    on the same data, so their final losses agree (to float32 rounding): a sharded
    initializer draws each shard itself, so the same seed gives other values under
    another layout."""
    if loss is None:
        import tf_keras
        loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    methods = [FLAGS.method] + ([FLAGS.compare] if FLAGS.compare else [])
    rows, initial = [], None
    for method in methods:
        row, initial = _train_once(build_model, loss, method, initial)
        rows.append(row)
    print()
    print(f"{'method':<16}{'mesh':<28}{'state MiB/device':>18}{'modeled peak MiB':>18}{'fit s':>9}{'final loss':>12}")
    for row in rows:
        print(f"{row['method']:<16}{row['mesh']:<28}{row['state_mib']:>18.2f}{row['peak_mib']:>18.2f}"
              f"{row['seconds']:>9.2f}{row['loss']:>12.4f}")


def _train_once(build_model, loss, method, initial):
    """One method's run and its report row; also the initial weights the next method starts from."""
    import tf_keras

    from tofu_tf import TofuStrategy

    tf_keras.utils.set_random_seed(FLAGS.seed)
    strategy = TofuStrategy(FLAGS.num_gpus, method=method)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=FLAGS.optimizer, loss=loss)
    x, y = synthetic_data(model, FLAGS.batch_size * FLAGS.steps)
    if FLAGS.plan_only:
        plan = strategy.plan_model(model, batch_size=FLAGS.batch_size)
        print(plan.summary())
        return _row(method, strategy, model, 0.0, float("nan")), initial
    logging.info("training %s (%s parameters) for %d steps with %s", model.name,
                 f"{model.count_params():,}", FLAGS.steps, method)
    start = time.perf_counter()
    if FLAGS.compare:
        # Plan before fit (fit would plan at its first step) to start from the same weights.
        strategy.plan_model(model, batch_size=FLAGS.batch_size)
        moved = time.perf_counter()
        if initial is None:
            initial = model.get_weights()  # full values, assembled on the host
        else:
            model.set_weights(initial)
        start += time.perf_counter() - moved  # the report times planning and training only
    history = model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=2, shuffle=False)
    seconds = time.perf_counter() - start  # the strategy logged its plan when training started
    if FLAGS.check_numerics:
        print(strategy.check_numerics(model, x[:FLAGS.batch_size], y[:FLAGS.batch_size]).summary())
    return _row(method, strategy, model, seconds, history.history["loss"][-1]), initial


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
