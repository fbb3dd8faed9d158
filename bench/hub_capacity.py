"""Capacity on keras-hub: the widest Llama (or ViT) that trains 3 steps on 8 virtual CPUs under a
per-device budget and a process memory cap, by method.

Tofu's claim is the size of model it can train. ``bench/capacity.py`` measures it on an MLP;
this script measures it on keras-hub models as users build them: ``LlamaBackbone`` with a
vocabulary head (``--layers`` blocks, head size 64, MLP 4x), or ``ViTImageClassifier`` (32x32
images, patch 4), grown by width. Three methods:

* ``data_parallel``: ``TofuStrategy(method="data_parallel")``, every device holds the whole
  model, its gradients and Adam's slots (what MirroredStrategy does; TF's own DTensor
  MirroredStrategy cannot build Keras 3 models);
* ``tofu``: ``TofuStrategy(memory_budget_bytes=budget)``, no layout written;
* ``layout_map``: keras-hub's own ``LlamaBackbone.get_layout_map`` on a 2 x 4 batch/model mesh
  given as ``layout_map=``, the planner deciding the rest under the same budget (ViT has no map).

A size fits when its plan's modeled peak per device is within ``--budget_gib`` (data parallel's
too: the plan is checked, not trusted), it trains ``--steps`` steps to a finite loss, and the
process never passes ``--memory_gib`` of resident memory (a watchdog samples it and kills the
child). The 8 virtual CPUs share the process, so its resident memory is the 8 devices' together:
measured against predicted (8 x the modeled per-device peak, over the process's resident memory
before the model was built). Widths double from ``--start_width`` until one fails, then bisect
to ``--precision``.

    python bench/hub_capacity.py --family=llama [--memory_gib=6] [--methods=data_parallel,tofu,layout_map]
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

from bench import capacity_search  # noqa: E402

flags.DEFINE_enum("family", "llama", ["llama", "vit"], "keras-hub family.")
flags.DEFINE_list("methods", ["data_parallel", "tofu", "layout_map"], "Methods to size.")
flags.DEFINE_float("memory_gib", 6.0, "Resident-memory cap for one training process (8 virtual CPUs), GiB.")
flags.DEFINE_float("budget_gib", None, "Per-device budget, GiB (default: 3/4 of memory_gib / 8, leaving the "
                   "rest to the runtime and to host copies).")
flags.DEFINE_integer("layers", 4, "Transformer blocks.")
flags.DEFINE_integer("vocab", 4096, "Llama's vocabulary.")
flags.DEFINE_integer("start_width", 512, "First width tried (doubled until a size fails).")
flags.DEFINE_float("precision", 0.15, "Bisection stops when the failing width is within this fraction of the fit.")
flags.DEFINE_integer("batch_size", 8, "Global batch size.")
flags.DEFINE_integer("seq_len", 32, "Llama's sequence length.")
flags.DEFINE_integer("steps", 3, "Training steps per size.")
flags.DEFINE_integer("run_width", None, "Internal: train at this width here and print JSON.")
flags.DEFINE_string("run_method", None, "Internal: method of --run_width.")
FLAGS = flags.FLAGS

NUM_DEVICES = 8
WIDTH_STEP = 256          # widths are multiples of this: head size 64, heads a multiple of 4
# What a child refused memory prints (InfeasibleBudgetError: the planner found no plan within the
# budget and said so before allocating; "modeled peak": a fixed plan over the budget).
OUT_OF_MEMORY_SIGNS = ("ResourceExhaustedError", "MemoryError", "std::bad_alloc", "OOM when allocating",
                       "InfeasibleBudgetError", "OverBudget")


def _budget_bytes() -> int:
    gib = FLAGS.budget_gib if FLAGS.budget_gib is not None else 0.75 * FLAGS.memory_gib / NUM_DEVICES
    return int(gib * 2**30)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One size under one method: whether it fit, its parameters, and memory measured and modeled."""
    method: str
    width: int
    fits: bool
    peak_rss_bytes: int
    seconds: float
    parameters: int = 0
    predicted_rss_bytes: int = 0     # process baseline + 8 x the plan's modeled per-device peak
    why: str = ""


# -- the child: build, plan, train ----------------------------------------------------


def _model(width: int):
    import keras
    import keras_hub
    heads = width // 64
    if FLAGS.family == "vit":
        backbone = keras_hub.models.ViTBackbone(image_shape=(32, 32, 3), patch_size=4, num_layers=FLAGS.layers,
                                                num_heads=heads, hidden_dim=width, mlp_dim=4 * width)
        return keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=10, preprocessor=None)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=FLAGS.vocab, num_layers=FLAGS.layers,
                                              num_query_heads=heads, num_key_value_heads=heads, hidden_dim=width,
                                              intermediate_dim=4 * width)
    return keras.Model(backbone.input, keras.layers.Dense(FLAGS.vocab, name="lm_head")(backbone.output))


def _data():
    import numpy as np
    rng = np.random.default_rng(0)
    n = FLAGS.batch_size * FLAGS.steps
    if FLAGS.family == "vit":
        return rng.normal(size=(n, 32, 32, 3)).astype("float32"), rng.integers(0, 10, n).astype("int32")
    x = {"token_ids": rng.integers(0, FLAGS.vocab, (n, FLAGS.seq_len)).astype("int32"),
         "padding_mask": np.ones((n, FLAGS.seq_len), "int32")}
    return x, rng.integers(0, FLAGS.vocab, (n, FLAGS.seq_len)).astype("int32")


def _strategy(method: str):
    from tofu_tf import TofuStrategy
    if method == "data_parallel":
        return TofuStrategy(NUM_DEVICES, method="data_parallel", plan_cache=False)
    if method == "tofu":
        return TofuStrategy(NUM_DEVICES, memory_budget_bytes=_budget_bytes(), plan_cache=False)
    import keras
    import keras_hub
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices=[f"cpu:{i}" for i in range(8)])
    return TofuStrategy(NUM_DEVICES, layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh),
                        memory_budget_bytes=_budget_bytes(), plan_cache=False)


def _train_here(method: str, width: int) -> None:
    from tofu_tf.tf import devices
    devices.provide_devices(NUM_DEVICES)
    import keras
    import numpy as np
    baseline = _resident_now()
    keras.utils.set_random_seed(0)
    x, y = _data()
    strategy = _strategy(method)
    with strategy.scope():
        model = _model(width)
        model.compile(optimizer=keras.optimizers.Adam(1e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    first = {k: v[:FLAGS.batch_size] for k, v in x.items()} if isinstance(x, dict) else x[:FLAGS.batch_size]
    plan = strategy.plan_model(model, batch_size=FLAGS.batch_size, features=first)
    if plan.peak_memory_bytes > _budget_bytes():
        raise SystemExit(f"OverBudget: the {method} plan's modeled peak, {plan.peak_memory_bytes / 2**30:.2f} GiB "
                         f"per device, is over the {_budget_bytes() / 2**30:.2f} GiB budget")
    history = model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=0, shuffle=False)
    loss = history.history["loss"][-1]
    if not np.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} after {FLAGS.steps} steps")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"peak_rss_bytes": peak, "loss": float(loss), "parameters": int(model.count_params()),
                      "predicted_rss_bytes": baseline + NUM_DEVICES * plan.peak_memory_bytes}))


def _resident_now() -> int:
    return capacity_search.resident_bytes(os.getpid())


# -- the parent: watchdog and search --------------------------------------------------


def _reason(stderr: str) -> str:
    for line in reversed(stderr.strip().splitlines()):
        if any(sign in line for sign in OUT_OF_MEMORY_SIGNS):
            return line.strip()[:160]
    return stderr.strip().splitlines()[-1][:160] if stderr.strip() else ""


def try_size(method: str, width: int, cap_bytes: int) -> Trial:
    """One size in a child process, killed if it passes the cap."""
    args = [sys.executable, os.path.abspath(__file__), f"--run_method={method}", f"--run_width={width}",
            *(f"--{name}={getattr(FLAGS, name)}" for name in
              ("family", "layers", "vocab", "batch_size", "seq_len", "steps", "memory_gib")),
            *([f"--budget_gib={FLAGS.budget_gib}"] if FLAGS.budget_gib is not None else [])]
    run = capacity_search.run_capped(args, cap_bytes, dict(os.environ, PYTHONPATH=ROOT))
    peak, seconds = run.peak_rss_bytes, run.seconds
    if run.over_cap:
        return Trial(method, width, False, peak, seconds, why=f"passed the {cap_bytes / 2**30:.1f} GiB cap")
    if run.returncode < 0:
        return Trial(method, width, False, peak, seconds, why=f"killed by signal {-run.returncode} (out of memory)")
    if run.returncode != 0:
        if not any(sign in run.stderr for sign in OUT_OF_MEMORY_SIGNS):
            raise RuntimeError(f"{method} at width {width} failed for a reason other than memory:\n"
                               f"{run.stderr[-3000:]}")
        return Trial(method, width, False, peak, seconds, why=_reason(run.stderr))
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return Trial(method, width, True, max(peak, result["peak_rss_bytes"]), seconds, result["parameters"],
                 result["predicted_rss_bytes"])


def largest_fit(method: str, cap_bytes: int) -> tuple[Trial | None, Trial | None, list[Trial]]:
    """Doubling then bisection on width: (largest fit, smallest failure, every trial)."""
    def attempt(width):
        trial = try_size(method, width, cap_bytes)
        logging.info("%s width %d: %s, peak %.2f GiB, %.0f s%s", method, width, "fits" if trial.fits else "fails",
                     trial.peak_rss_bytes / 2**30, trial.seconds, f" ({trial.why})" if trial.why else "")
        return trial
    return capacity_search.largest_fit(attempt, start_width=FLAGS.start_width, precision=FLAGS.precision,
                                       step=WIDTH_STEP)


def main(argv):
    del argv
    if FLAGS.run_width:
        _train_here(FLAGS.run_method, FLAGS.run_width)
        return
    logging.set_verbosity(logging.INFO)
    methods = [m for m in FLAGS.methods if not (m == "layout_map" and FLAGS.family == "vit")]
    if len(methods) < len(FLAGS.methods):
        print("layout_map: keras-hub's ViTBackbone has no get_layout_map; not sized")
    cap = int(FLAGS.memory_gib * 2**30)
    rows = {method: largest_fit(method, cap) for method in methods}
    print(f"Widest keras-hub {FLAGS.family} ({FLAGS.layers} layers, head size 64, MLP 4x, Adam, batch "
          f"{FLAGS.batch_size}) training {FLAGS.steps} steps on {NUM_DEVICES} virtual CPUs: per-device budget "
          f"{_budget_bytes() / 2**30:.2f} GiB, process cap {FLAGS.memory_gib:g} GiB")
    print(f"{'method':<15}{'width':>7}{'params':>10}{'vs DP':>7}{'RSS GiB':>9}{'predicted':>11}{'runs':>6}"
          "   first failure")
    dp = rows.get("data_parallel", (None,))[0]
    for method, (fit, fail, trials) in rows.items():
        ratio = f"{fit.parameters / dp.parameters:.1f}x" if fit and dp else "-"
        failure = f"width {fail.width}: {fail.why}" if fail else ""
        print(f"{method:<15}{fit.width if fit else 0:>7}{f'{fit.parameters / 1e6:.0f}M' if fit else 'none':>10}"
              f"{ratio:>7}{f'{fit.peak_rss_bytes / 2**30:.2f}' if fit else '-':>9}"
              f"{f'{fit.predicted_rss_bytes / 2**30:.2f}' if fit else '-':>11}{len(trials):>6}   {failure}")
    print("params: the model's parameters; vs DP: over data parallel's largest; RSS: the process's peak resident "
          "memory (8 devices); predicted: resident memory before the model + 8 x the plan's modeled per-device peak.")


if __name__ == "__main__":
    app.run(main)
