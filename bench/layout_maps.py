"""tofu against keras-hub's own hand-written layout maps (``Backbone.get_layout_map``).

For every keras-hub backbone that ships a layout map, a language model (the backbone and
a vocabulary head) is captured once and planned three ways on the map's 2-D mesh
(``batch`` x ``model``) under the ``h100-nvlink`` profile:

* ``expert``: the map's layouts pinned (``plan_graph(pinned_layouts=...)``), the rest
  (other weights, activations, relayouts) planned by the same cost model;
* ``tofu``: the planner unconstrained on the same mesh, and again within the expert
  plan's modeled peak (``tofu@expert peak``), the comparison the targets name;
* ``data_parallel``: the baseline, every weight replicated.

It prints modeled step time and peak memory per device, and tofu's ratio to the expert
plan. All three use the ``ideal`` target, where the map's layouts are computed with as
written (on DTensor, TofuStrategy stores them so but gathers a weight over the data axis
where it is read, as GSPMD does: docs/design.md).

Then (``--measure``) each family trains for real on 8 virtual CPUs, one fresh process per
method (``TofuStrategy(layout_map=get_layout_map(mesh))``, ``TofuStrategy`` on the map's
mesh, and data parallel), side by side in one run: peak resident memory of the process,
the training state per device as placed (weights and Adam's slots), and the median step
time (steps 3 onwards).

    python bench/layout_maps.py                       # 8 and 64 devices, then measured on 8 CPUs
    python bench/layout_maps.py --devices=8 --families=llama,gemma --nomeasure
"""

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

flags.DEFINE_list("devices", ["8", "64"], "Device counts; the mesh is batch=2 x model=n/2 (8) or 8 x n/8.")
flags.DEFINE_list("families", ["llama", "gemma", "qwen", "qwen_moe", "qwen3_moe"], "keras-hub backbones.")
flags.DEFINE_integer("hidden", 1024, "Hidden width of every backbone.")
flags.DEFINE_integer("layers", 2, "Transformer layers.")
flags.DEFINE_integer("vocab", 16384, "Vocabulary size.")
flags.DEFINE_integer("seq", 256, "Sequence length.")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
flags.DEFINE_bool("modeled", True, "Plan each family under h100-nvlink (the modeled table).")
flags.DEFINE_bool("measure", True, "Also train each family on 8 virtual CPUs under each method (a process each).")
flags.DEFINE_integer("measure_hidden", 256, "Hidden width of the measured models.")
flags.DEFINE_integer("measure_vocab", 8192, "Vocabulary of the measured models.")
flags.DEFINE_integer("measure_seq", 64, "Sequence length of the measured models.")
flags.DEFINE_integer("measure_batch", 16, "Global batch of the measured models.")
flags.DEFINE_integer("measure_steps", 8, "Training steps measured.")
flags.DEFINE_string("child", "", "Internal: 'family,method' to train and measure in this process.")
FLAGS = flags.FLAGS

METHODS = ("expert", "tofu", "data_parallel")


def _backbone(family):
    import keras_hub
    h, layers, vocab = FLAGS.hidden, FLAGS.layers, FLAGS.vocab
    common = dict(vocabulary_size=vocab, num_layers=layers, hidden_dim=h)
    if family == "llama":
        return keras_hub.models.LlamaBackbone, dict(common, num_query_heads=16, num_key_value_heads=8,
                                                     intermediate_dim=4 * h)
    if family == "gemma":
        return keras_hub.models.GemmaBackbone, dict(common, num_query_heads=16, num_key_value_heads=8,
                                                     intermediate_dim=8 * h, head_dim=h // 16)
    if family == "qwen":
        return keras_hub.models.QwenBackbone, dict(common, num_query_heads=16, num_key_value_heads=8,
                                                    intermediate_dim=4 * h)
    if family == "qwen_moe":
        return keras_hub.models.QwenMoeBackbone, dict(common, num_query_heads=16, num_key_value_heads=8,
                                                       intermediate_dim=4 * h, moe_intermediate_dim=h,
                                                       shared_expert_intermediate_dim=2 * h, num_experts=8,
                                                       top_k=2)
    if family == "qwen3_moe":
        return keras_hub.models.Qwen3MoeBackbone, dict(common, num_query_heads=16, num_key_value_heads=8,
                                                        head_dim=h // 16, intermediate_dim=4 * h,
                                                        moe_intermediate_dim=h, num_experts=8, top_k=2)
    raise app.UsageError(f"unknown family {family!r}")


def _row(family, n):
    import keras
    import tensorflow as tf

    from tofu_tf.strategies import layout_maps
    from tofu_tf import capture_training_step
    from tofu_tf.search import plan_graph

    cls, config = _backbone(family)
    backbone = cls(**config)
    model = keras.Model(backbone.input, keras.layers.Dense(FLAGS.vocab, name="lm_head")(backbone.output))
    features = {name: tf.TensorSpec((FLAGS.batch_size, FLAGS.seq), tf.int32) for name in ("token_ids", "padding_mask")}
    graph = capture_training_step(model, batch_size=FLAGS.batch_size, features=features, optimizer=keras.optimizers.Adam(),
                                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = 2 if n <= 8 else 8
    mesh = keras.distribution.DeviceMesh((batch, n // batch), ("batch", "model"),
                                         devices=[f"cpu:{i}" for i in range(n)])
    spec = layout_maps.read_layout_map(cls.get_layout_map(mesh))
    pinned = spec.pinned_layouts([v.path for v in graph.weights()])
    common = dict(num_devices=n, hardware="h100-nvlink", target="ideal")
    plans = {}
    for method, options in (("expert", dict(mesh_shape=spec.mesh_shape, pinned_layouts=pinned)),
                            ("tofu", dict(mesh_shape=spec.mesh_shape)),
                            ("data_parallel", dict(method="data_parallel"))):
        start = time.perf_counter()
        plans[method] = (plan_graph(graph, **common, **options), time.perf_counter() - start)
    start = time.perf_counter()     # tofu held to the expert plan's peak, as the target compares them
    budgeted = plan_graph(graph, **common, mesh_shape=spec.mesh_shape,
                          memory_budget_bytes=plans["expert"][0].peak_memory_bytes)
    plans["tofu@expert peak"] = (budgeted, time.perf_counter() - start)
    return plans, len(pinned), sum(math.prod(v.shape) for v in graph.weights())


def _lm(family, hidden, vocab, layers):
    """A keras-hub backbone with a vocabulary head, and its class (which holds the map)."""
    import keras
    saved = FLAGS.hidden, FLAGS.vocab, FLAGS.layers
    FLAGS.hidden, FLAGS.vocab, FLAGS.layers = hidden, vocab, layers
    try:
        cls, config = _backbone(family)
    finally:
        FLAGS.hidden, FLAGS.vocab, FLAGS.layers = saved
    backbone = cls(**config)
    return cls, keras.Model(backbone.input, keras.layers.Dense(vocab, name="lm_head")(backbone.output))


def _measure_here(family, method):
    """Train ``family`` under ``method`` in this process; print one JSON line of figures."""
    import json
    import statistics

    from tofu_tf.tf import devices
    devices.provide_devices(8)
    import keras
    import numpy as np

    from tofu_tf import TofuStrategy
    from tofu_tf.tf import keras_adapter

    mesh_shape = {"batch": 2, "model": 4}
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices=[f"cpu:{i}" for i in range(8)])
    keras.utils.set_random_seed(0)
    cls, _ = _backbone(family)            # the class, for its map
    if method == "expert":
        strategy = TofuStrategy(8, layout_map=cls.get_layout_map(mesh), plan_cache=False)
    elif method == "tofu":
        strategy = TofuStrategy(8, mesh_shape=mesh_shape, plan_cache=False)
    else:
        strategy = TofuStrategy(8, method="data_parallel", plan_cache=False)
    with strategy.scope():
        _, model = _lm(family, FLAGS.measure_hidden, FLAGS.measure_vocab, FLAGS.layers)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    n, seq = FLAGS.measure_batch * FLAGS.measure_steps, FLAGS.measure_seq
    x = {"token_ids": rng.integers(0, FLAGS.measure_vocab, (n, seq)).astype("int32"),
         "padding_mask": np.ones((n, seq), "int32")}
    y = rng.integers(0, FLAGS.measure_vocab, (n, seq)).astype("int32")
    ends = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())
    model.fit(x, y, batch_size=FLAGS.measure_batch, epochs=1, shuffle=False, verbose=0, callbacks=[Steps()])
    steps = [b - a for a, b in zip(ends, ends[1:])][1:]
    per_device = total = 0
    for variable in list(model.weights) + list(model.optimizer.variables):
        tensor = keras_adapter.tf_variable(variable)
        nbytes = tensor.shape.num_elements() * tensor.dtype.size
        sizes = dict(zip(tensor.layout.mesh.dim_names, tensor.layout.mesh.shape()))
        total += nbytes
        per_device += nbytes // math.prod(sizes.get(axis, 1) for axis in tensor.layout.sharding_specs)
    print(json.dumps({"peak_rss_mib": _peak_rss_mib(),
                      "state_mib": total / 2**20, "state_per_device_mib": per_device / 2**20,
                      "step_ms": statistics.median(steps) * 1e3, "mesh": strategy.plan.mesh_shape}), flush=True)


def _peak_rss_mib() -> float:
    """This process's peak resident memory (``VmHWM``; ``ru_maxrss`` survives ``exec`` on Linux,
    so a child would report its parent's peak)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _measured_rows(families):
    """Each family under each method, one fresh process each, side by side."""
    import json
    import subprocess
    print(f"\nmeasured on 8 virtual CPUs (hidden {FLAGS.measure_hidden}, vocab {FLAGS.measure_vocab}, "
          f"{FLAGS.layers} layers, seq {FLAGS.measure_seq}, batch {FLAGS.measure_batch}, Adam; a process each)")
    print(f"{'family':<11}{'method':<15}{'peak RSS MiB':>13}{'state MiB':>11}{'state/dev MiB':>15}{'step ms':>9}  mesh")
    for family in families:
        for method in METHODS:
            command = [sys.executable, os.path.abspath(__file__), f"--child={family},{method}"] + [
                f"--{name}={getattr(FLAGS, name)}" for name in ("measure_hidden", "measure_vocab", "measure_seq",
                                                               "measure_batch", "measure_steps", "layers")]
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                error = [line for line in done.stderr.splitlines() if "Error" in line][-1:] or ["no output"]
                print(f"{family:<11}{method:<15}  failed: {error[0][:300]}")
                continue
            row = json.loads(lines[-1])
            print(f"{family:<11}{method:<15}{row['peak_rss_mib']:>13.0f}{row['state_mib']:>11.1f}"
                  f"{row['state_per_device_mib']:>15.1f}{row['step_ms']:>9.1f}  {row['mesh']}", flush=True)


def main(argv):
    del argv
    if FLAGS.child:
        family, method = FLAGS.child.split(",")
        _measure_here(family, method)
        return
    print(f"{'family':<11}{'devices':>8}{'params':>12}{'pinned':>8}  {'method':<18}{'step ms':>9}"
          f"{'peak MiB':>10}{'search s':>10}{'vs expert':>11}")
    for family in FLAGS.families if FLAGS.modeled else ():
        for n in map(int, FLAGS.devices):
            try:
                plans, pinned, params = _row(family, n)
            except Exception as error:  # a family this keras-hub lacks, or a model tofu cannot capture
                lines = getattr(error, "problems", None) or str(error).splitlines()[:1]
                print(f"{family:<11}{n:>8}  failed: {type(error).__name__}: {'; '.join(lines)[:400]}")
                continue
            expert = plans["expert"][0]
            for method, (plan, seconds) in plans.items():
                ratio = plan.step_seconds / expert.step_seconds
                print(f"{family:<11}{n:>8}{params:>12,}{pinned:>8}  {method:<18}{plan.step_seconds * 1e3:>9.3f}"
                      f"{plan.peak_memory_bytes / 2**20:>10.1f}{seconds:>10.2f}{ratio:>10.2f}x")
    if FLAGS.measure:
        _measured_rows(FLAGS.families)


if __name__ == "__main__":
    app.run(main)
