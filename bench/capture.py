"""Capture time and graph size for GPT-style training steps (12 and 24 layers).

Prints one row per model: median capture seconds over --repeats runs (each a
fresh trace; the model is built once), the split between tracing (TF) and
translation into the IR, and op/tensor counts; then the same captured with the
optimizer's update traced for every weight (``trace_each_update``) instead of
once per weight shape, alternating with the default capture run by run, and
the ratio of the medians. Run:
    python bench/capture.py [--repeats=3] [--layers=12,24]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

flags.DEFINE_integer("repeats", 3, "Captures per model; the median is reported.")
flags.DEFINE_list("layers", ["12", "24"], "GPT depths to capture.")
flags.DEFINE_integer("d_model", 512, "GPT width.")
flags.DEFINE_integer("seq_len", 128, "Sequence length.")
flags.DEFINE_integer("batch_size", 8, "Global batch size.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from tofu_tf import models
    from tofu_tf.tf import capture, keras_adapter

    print(f"{'model':<10}{'updates':>10}{'params':>12}{'capture s':>11}{'trace s':>9}{'to IR s':>9}{'ops':>8}"
          f"{'in loops':>9}{'tensors':>9}")
    for depth in (int(d) for d in FLAGS.layers):
        model = models.gpt(num_layers=depth, d_model=FLAGS.d_model, num_heads=8, seq_len=FLAGS.seq_len, vocab_size=1024)
        runs = {"stamped": ([], [], []), "each": ([], [], [])}
        for _ in range(FLAGS.repeats):
            for updates, (totals, traces, translations) in runs.items():
                start = time.perf_counter()
                with keras_adapter.recording_layer_scopes("tf_keras", model) as layers:
                    traced = capture._trace(model, "tf_keras", FLAGS.batch_size, "sparse_categorical_crossentropy",
                                            "adam", None, None, stamp_updates=updates == "stamped")
                mid = time.perf_counter()
                graph = capture._Translator(traced, layers).translate()
                end = time.perf_counter()
                traces.append(mid - start)
                translations.append(end - mid)
                totals.append(end - start)
        counts = graph.op_type_counts(recursive=False)
        all_counts = graph.op_type_counts()
        for updates, (totals, traces, translations) in runs.items():
            label = "per shape" if updates == "stamped" else "per weight"
            print(f"{'gpt-' + str(depth):<10}{label:>10}{model.count_params():>12,}{statistics.median(totals):>11.2f}"
                  f"{statistics.median(traces):>9.2f}{statistics.median(translations):>9.2f}"
                  f"{sum(counts.values()):>8}{sum(all_counts.values()) - sum(counts.values()):>9}{len(graph.tensors):>9}")
        ratio = statistics.median(runs["each"][0]) / statistics.median(runs["stamped"][0])
        print(f"gpt-{depth}: the optimizer's update traced once per weight shape: capture {ratio:.2f}x faster "
              "than tracing it for every weight")


if __name__ == "__main__":
    app.run(main)
