"""keras-hub families under TofuStrategy beside one device: what is sharded, and what the first fit costs.

For each family of ``tofu_tf.hub_models`` (small configs, random weights), in
one process on 8 virtual CPUs (or ``--num_devices`` GPUs), side by side with
the same model on one device:

* ``params``: parameter count;
* ``sharded``: the fraction of the training state (weights and optimizer
  slots, by bytes) that the plan splits, and the per-device state bytes against
  one device's, as placed on the mesh;
* the same two modeled by the planner under the ``h100-nvlink`` profile
  (planned only, not run);
* ``first fit``: seconds of the first ``fit`` (one epoch of ``--steps`` steps:
  planning, tracing and compiling included), against one device's first fit;
* ``step 2``: the second step's seconds over the steady step (median of steps
  3..n): a second compile shows here;
* ``steady``: the steady step against one device's.

Each run's figures are medians over ``--repeats`` fresh models. Run:
    python bench/zoo.py [--families=gpt2,bert] [--repeats=3] [--memory_fraction=0.5]

``--all`` runs the sweep instead (issue #37): every keras-hub backbone family and
the tf_keras.applications of ``tofu_tf.hub_families``, each in its own process
(``tofu_tf.strategies.hub_sweep.run_in_subprocess``: DTensor can abort a process) for
``--steps`` steps at ``--width``, and prints per family its parameters, the
fraction of the training state the plan shards, per-device state over one
device's, first fit and steady step against one device's, and its status
(trains, refused with the reason, fails, differs, crash, timeout, not built):
    python bench/zoo.py --all [--jobs=2] [--timeout=600] [--out=results.jsonl]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

flags.DEFINE_list("families", [], "keras-hub families (default: all of tofu_tf.hub_models).")
flags.DEFINE_integer("repeats", 3, "Fresh models per family and side; medians are reported.")
flags.DEFINE_integer("steps", 6, "Steps in the measured fit (one epoch).")
flags.DEFINE_integer("batch_size", 8, "Global batch size.")
flags.DEFINE_integer("width", 64, "Hidden width of every family.")
flags.DEFINE_float("memory_fraction", 0.0, "Plan under this fraction of the unconstrained plan's peak "
                   "(0: no budget, the planner's cheapest plan).")
flags.DEFINE_integer("num_devices", 8, "Devices (virtual CPUs when no GPU is visible).")
flags.DEFINE_bool("all", False, "Run the sweep of every family of tofu_tf.hub_families, one process each.")
flags.DEFINE_integer("jobs", 1, "--all: families run at once.")
flags.DEFINE_integer("timeout", 600, "--all: seconds a family may take.")
flags.DEFINE_string("out", "", "--all: also write each family's result as a JSON line here.")
FLAGS = flags.FLAGS


def sweep_row(r) -> str:
    """One row of the sweep's table (markdown)."""
    def ratio(a, b):
        return f"{r[a] / r[b]:.1f}x" if r.get(a) and r.get(b) else "-"
    if r["status"] in ("trains", "rounding") and "sharded" in r:
        figures = (f"{r['sharded']:.0%}", f"{r['state_per_device']:.2f}", ratio("first_fit_s", "one_first_fit_s"),
                   ratio("steady_s", "one_steady_s"))
    else:
        figures = ("-",) * 4
    params = f"{r['params']:,}" if r.get("params") else "-"
    status = r["status"]
    if r.get("detail") and status != "trains":
        detail = r["detail"].replace("\n", " ").replace("|", "/")
        if r.get("float32_gap") and r.get("one_ulp_spread"):
            # (losses, evaluate, predict) beside what one device does to itself; the float64 verdict
            def triple(values):
                return "/".join(f"{values[key]:.1e}" if values[key] else "0"
                                for key in ("losses", "evaluate", "predict"))
            wide = detail[detail.rfind("; float64") + 2:] if "; float64" in detail else ""
            detail = (f"float32 differs by {triple(r['float32_gap'])} (losses/evaluate/predict); one device "
                      f"differs from itself by {triple(r['one_ulp_spread'])} with every weight one ulp away"
                      + (f"; {wide}" if wide else ""))
        status += ": " + (detail if len(detail) < 240 else detail[:237] + "...")
    return f"| {r['family']} | {params} | " + " | ".join(figures) + f" | {status} |"


def run_sweep():
    """``--all``: the sweep's table, one family per child process."""
    import concurrent.futures
    import json
    from tofu_tf import hub_families
    from tofu_tf.strategies import hub_sweep
    names = FLAGS.families or list(hub_families.SWEEP)
    print("| family | params | state sharded | state/device vs 1 device | first fit vs 1 device "
          "| steady step vs 1 device | status |")
    print("|---|---|---|---|---|---|---|", flush=True)
    out = open(FLAGS.out, "a", encoding="utf-8") if FLAGS.out else None
    counts = {}
    with concurrent.futures.ThreadPoolExecutor(FLAGS.jobs) as pool:
        runs = {name: pool.submit(hub_sweep.run_in_subprocess, name, timeout=FLAGS.timeout, width=FLAGS.width,
                                  steps=FLAGS.steps, batch=FLAGS.batch_size, num_devices=FLAGS.num_devices)
                for name in names}
        for name in names:
            result = runs[name].result()
            counts[result["status"]] = counts.get(result["status"], 0) + 1
            print(sweep_row(result), flush=True)
            if out:
                out.write(json.dumps(result) + "\n")
                out.flush()
    print("\n" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1])), flush=True)


def _step_times(keras):
    """A callback that records each training step's end time."""
    class StepTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_begin(self, logs=None):
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())
    return StepTimes()


def _fit(model, x, y, keras):
    """(first fit seconds, per-step seconds) of one epoch."""
    times = _step_times(keras)
    start = time.perf_counter()
    model.fit(x, y, batch_size=FLAGS.batch_size, shuffle=False, verbose=0, callbacks=[times])
    steps = [b - a for a, b in zip(times.ends, times.ends[1:])]
    return time.perf_counter() - start, steps


def _modeled(graph, hardware, budget):
    from tofu_tf.search import plan_graph
    plan = plan_graph(graph, num_devices=FLAGS.num_devices, hardware=hardware, memory_budget_bytes=budget)
    total = split = per_device = 0
    sizes = plan.mesh_shape
    for path, layout in plan.variable_layouts.items():
        variable = graph.variables[path]
        nbytes = variable.num_bytes
        shards = 1
        for axis in layout:
            shards *= sizes.get(axis, 1) if axis else 1
        total += nbytes
        split += nbytes if shards > 1 else 0
        per_device += nbytes // shards
    return plan, split / max(total, 1), per_device / max(total, 1)


def main(argv):
    del argv
    if FLAGS.all:
        return run_sweep()
    from absl import logging
    logging.set_verbosity(logging.WARNING)        # the strategy's plan summaries would bury the table
    from tofu_tf.tf import devices
    devices.provide_devices(FLAGS.num_devices)
    import keras

    from tofu_tf.strategies import hub_sweep
    import tensorflow as tf

    from tofu_tf.strategies import TofuStrategy
    from tofu_tf import hub_models
    from tofu_tf.tf.capture import capture_training_step

    names = FLAGS.families or sorted(hub_models.FAMILIES)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    print(f"{'family':<9}{'params':>10}{'sharded':>9}{'state/dev':>10}{'h100 sharded':>13}{'h100 state/dev':>15}"
          f"{'first fit s':>12}{'1 dev s':>8}{'ratio':>7}{'step2/steady':>13}{'steady ms':>10}{'1 dev ms':>9}"
          f"{'ratio':>7}  mesh")
    for name in names:
        family = hub_models.FAMILIES[name]
        x, y = hub_models.data(family, FLAGS.batch_size * FLAGS.steps)
        rows = {"one": [], "tofu": []}
        sharded = state = None
        for _ in range(FLAGS.repeats):
            keras.utils.set_random_seed(0)
            reference = family.build(FLAGS.width)
            params = reference.count_params()
            first = tf.nest.map_structure(lambda a: tf.TensorSpec((FLAGS.batch_size,) + a.shape[1:],
                                                                  tf.as_dtype(a.dtype)), x)
            graph = capture_training_step(reference, batch_size=FLAGS.batch_size, loss=loss, optimizer="adam",
                                          features=first, labels=tf.TensorSpec((FLAGS.batch_size,) + y.shape[1:],
                                                                               tf.int32))
            budget = None
            if FLAGS.memory_fraction:
                from tofu_tf.search import plan_graph
                peak = plan_graph(graph, num_devices=FLAGS.num_devices, hardware="cpu-virtual").peak_memory_bytes
                budget = int(peak * FLAGS.memory_fraction)
            reference.compile(optimizer="adam", loss=loss)
            rows["one"].append(_fit(reference, x, y, keras))
            # No plan cache: the first fit measured here includes its search, every repeat.
            strategy = TofuStrategy(FLAGS.num_devices, memory_budget_bytes=budget, plan_cache=False)
            with strategy.scope():
                keras.utils.set_random_seed(0)
                model = family.build(FLAGS.width)
                model.compile(optimizer="adam", loss=loss)
            rows["tofu"].append(_fit(model, x, y, keras))
            total, per_device = hub_sweep.state_bytes(model)
            sharded = 1 - per_device / total if total else 0.0
            state = per_device / total
            mesh = strategy.plan.mesh_shape
        h100_plan, h100_split, h100_state = _modeled(graph, "h100-nvlink", None)

        def medians(side):
            first_fit = statistics.median(r[0] for r in rows[side])
            step2 = statistics.median(r[1][1] for r in rows[side])
            steady = statistics.median(statistics.median(r[1][2:]) for r in rows[side])
            return first_fit, step2, steady
        one, tofu = medians("one"), medians("tofu")
        print(f"{name:<9}{params:>10,}{sharded:>9.0%}{state:>10.2f}{h100_split:>13.0%}{h100_state:>15.2f}"
              f"{tofu[0]:>12.1f}{one[0]:>8.1f}{tofu[0] / one[0]:>7.1f}{tofu[1] / tofu[2]:>13.1f}"
              f"{tofu[2] * 1e3:>10.1f}{one[2] * 1e3:>9.1f}{tofu[2] / one[2]:>7.1f}  {mesh}"
              f" (h100: {h100_plan.mesh_shape})", flush=True)
    print("sharded: fraction of the training state split by the plan, as placed (weights + optimizer "
          "variables, bytes); state/dev: per-device state over one device's; h100: modeled by the planner "
          "under h100-nvlink (not run); ratios: TofuStrategy over one device, medians of --repeats runs.")


if __name__ == "__main__":
    app.run(main)
