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
plan. All three use the ``ideal`` target: keras-hub's maps split the token embedding's
rows, which TF's DTensor cannot run (``TofuStrategy(layout_map=...)`` refuses them), so
on the ``dtensor`` target the expert plan does not exist.

    python bench/layout_maps.py                       # 8 and 64 devices
    python bench/layout_maps.py --devices=8 --families=llama,gemma
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
FLAGS = flags.FLAGS


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


def main(argv):
    del argv
    print(f"{'family':<11}{'devices':>8}{'params':>12}{'pinned':>8}  {'method':<18}{'step ms':>9}"
          f"{'peak MiB':>10}{'search s':>10}{'vs expert':>11}")
    for family in FLAGS.families:
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


if __name__ == "__main__":
    app.run(main)
