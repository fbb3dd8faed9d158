"""Print the recommended pipeline partition and hybrid PP x TP x DP plans for a Keras model.

    python examples/plan_pipeline.py                                # GPT-8, 4 stages, 8 devices
    python examples/plan_pipeline.py --model=wide_resnet --num_stages=3 --schedule=gpipe
    python examples/plan_pipeline.py --model=gpt --profile          # measured (CPU) statistics
    python examples/plan_pipeline.py --memory_budget_mib=512        # fastest plan under a budget

Nothing trains: the model's training step is captured (no model-sized
allocation beyond the model's own weights), its layers grouped into pipeline
units, and the partitioner and recommender run on their statistics. With
``--profile`` each distinct stage is also run for real on CPU, in
subprocesses, to measure mCAP's isolated/added figures and fit the memory
regression on this model.
"""

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

flags.DEFINE_enum("model", "gpt", ["gpt", "mlp", "cnn", "wide_resnet", "rnn"],
                  "A model of tofu_tf.models.")
flags.DEFINE_integer("num_layers", 8, "Blocks (gpt), hidden layers (mlp), recurrent layers (rnn), "
                     "or depth (wide_resnet: 6n + 4).")
flags.DEFINE_integer("width", 256, "d_model (gpt), hidden width (mlp, rnn), channels (cnn), "
                     "widening factor (wide_resnet).")
flags.DEFINE_integer("seq_len", 128, "Sequence length (gpt, rnn).")
flags.DEFINE_integer("vocab_size", 8192, "Vocabulary (gpt).")
flags.DEFINE_integer("image_size", 32, "Image side (cnn, wide_resnet).")
flags.DEFINE_integer("num_devices", 8, "Devices for the hybrid PP x TP x DP recommendation.")
flags.DEFINE_integer("num_stages", 4, "Pipeline stages for the partition.")
flags.DEFINE_integer("batch_size", 32, "Global batch size.")
flags.DEFINE_integer("num_microbatches", 8, "Micro-batches per step for the partition.")
flags.DEFINE_enum("schedule", "1f1b", ["1f1b", "gpipe"], "Pipeline schedule.")
flags.DEFINE_string("optimizer", "adam", "Keras optimizer name.")
flags.DEFINE_bool("profile", False, "Measure the statistics by running stages on CPU.")
flags.DEFINE_integer("memory_budget_mib", None,
                     "Per-device budget: rank the fastest plans that fit.")
flags.DEFINE_integer("top", 8, "Hybrid candidates to print.")
FLAGS = flags.FLAGS

LOSS = "sparse_categorical_crossentropy"


def model_builder():
    """A picklable zero-argument builder of the chosen model (profiling rebuilds it)."""
    from tofu_tf import models
    n, width = FLAGS.num_layers, FLAGS.width
    if FLAGS.model == "gpt":
        heads = max(1, width // 64)
        return functools.partial(models.gpt, num_layers=n, d_model=width, num_heads=heads,
                                 seq_len=FLAGS.seq_len, vocab_size=FLAGS.vocab_size)
    if FLAGS.model == "mlp":
        return functools.partial(models.mlp, input_dim=width, width=width, depth=n)
    if FLAGS.model == "cnn":
        return functools.partial(models.cnn, image_size=FLAGS.image_size, channels=width)
    if FLAGS.model == "wide_resnet":
        return functools.partial(models.wide_resnet, depth=n if (n - 4) % 6 == 0 else 10,
                                 width=max(1, width // 64), image_size=FLAGS.image_size)
    return functools.partial(models.rnn, num_layers=n, hidden=width, seq_len=FLAGS.seq_len,
                             input_dim=width)


def stats_table(stats) -> str:
    mib = 2**20
    rows = [f"{'unit':<28} {'params':>12} {'state MiB':>10} {'act MiB/mb':>11} "
            f"{'transient MiB':>13} {'isolated MiB':>12} {'added MiB':>10}"]
    for s in stats:
        iso = "-" if s.isolated_bytes is None else f"{s.isolated_bytes / mib:.2f}"
        added = "-" if s.added_bytes is None else f"{s.added_bytes / mib:.2f}"
        rows.append(f"{s.name[:28]:<28} {s.param_count:>12,} {s.state_bytes / mib:>10.2f} "
                    f"{s.activation_bytes / mib:>11.2f} {s.transient_bytes / mib:>13.2f} "
                    f"{iso:>12} {added:>10}")
    return "\n".join(rows)


def main(argv):
    del argv
    from tofu_tf import pipeline

    build = model_builder()
    model = build()
    print(f"{model.name}: {model.count_params():,} parameters, batch {FLAGS.batch_size} in "
          f"{FLAGS.num_microbatches} micro-batches, optimizer {FLAGS.optimizer}")
    stats = pipeline.layer_stats(model, batch_size=FLAGS.batch_size, loss=LOSS,
                                 optimizer=FLAGS.optimizer,
                                 num_microbatches=FLAGS.num_microbatches,
                                 profile=FLAGS.profile, model_fn=build)
    print(f"\nPipeline units ({'measured' if FLAGS.profile else 'analytic'} statistics, "
          "per micro-batch):")
    print(stats_table(stats))

    stages = min(FLAGS.num_stages, len(stats))
    plan = pipeline.partition(stats, stages, schedule=FLAGS.schedule,
                              num_microbatches=FLAGS.num_microbatches)
    print("\nRecommended pipeline partition:")
    print(plan.summary())
    print("\nLargest stage peak by method:")
    for method in ("optimal", "uniform", "parameters", "time"):
        peak = pipeline.partition(stats, stages, schedule=FLAGS.schedule,
                                  num_microbatches=FLAGS.num_microbatches,
                                  method=method).max_peak_bytes
        print(f"  {method:<10} {peak / 2**20:>10.2f} MiB  ({peak / plan.max_peak_bytes:.2f}x)")

    budget = None if FLAGS.memory_budget_mib is None else FLAGS.memory_budget_mib * 2**20
    recommendation = pipeline.recommend_hybrid(
        model, num_devices=FLAGS.num_devices, batch_size=FLAGS.batch_size, loss=LOSS,
        optimizer=FLAGS.optimizer, memory_budget_bytes=budget, schedule=FLAGS.schedule,
        profile=FLAGS.profile, model_fn=build)
    print()
    print(recommendation.table(top=FLAGS.top))
    best = recommendation.best
    print(f"\nRecommended: pp={best.pp} x tp={best.tp} x dp={best.dp}, "
          f"{best.num_microbatches} micro-batches of {best.micro_batch_size}, predicted peak "
          f"{best.predicted_peak_bytes / 2**20:.2f} MiB per device")


if __name__ == "__main__":
    app.run(main)
