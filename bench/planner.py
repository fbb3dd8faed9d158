"""Planner benchmark: modeled communication and peak memory per method, and search time.

For each model (captured once; ``--cache DIR`` keeps the IR as JSON between
runs) and device count, prints one row per method:

* ``data_parallel`` and ``megatron`` (hand patterns, where they apply),
* ``tofu`` under the hardware's memory, and ``tofu@dp`` / ``tofu@mt`` with the
  memory budget set to the baseline's peak ("at equal memory"),
* ``ilp`` on the mesh of the last tofu row, same budget (proved-optimal flag shown).

Usage: python bench/planner.py [--models mlp,gpt12] [--devices 8,64] [--cache /tmp/graphs] [--no-ilp]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tofu_tf import ir  # noqa: E402
from tofu_tf.search import InfeasibleBudgetError, plan_graph  # noqa: E402
from tofu_tf.search.baselines import BaselineNotApplicableError  # noqa: E402
from tofu_tf.search.legality import check_plan  # noqa: E402

MODELS = {
    "mlp": ("MLP 4x4096", 256, lambda m: m.mlp(input_dim=4096, width=4096, depth=4, num_classes=1000)),
    "wrn": ("WResNet-28-10", 128, lambda m: m.wide_resnet(depth=28, width=10, image_size=32)),
    "lstm": ("LSTM 4x1024 T16", 128, lambda m: m.rnn(num_layers=4, hidden=1024, seq_len=16, input_dim=1024,
                                                     num_classes=1000, unroll=True)),
    "gpt12": ("GPT 12L d1024", 64, lambda m: m.gpt(num_layers=12, d_model=1024, num_heads=16, seq_len=512,
                                                   vocab_size=32768)),
    "gpt48": ("GPT 48L d1024", 64, lambda m: m.gpt(num_layers=48, d_model=1024, num_heads=16, seq_len=512,
                                                   vocab_size=32768)),
}


def load_graph(key: str, cache: str | None) -> ir.Graph:
    path = os.path.join(cache, f"{key}.json") if cache else None
    if path and os.path.exists(path):
        return ir.Graph.from_json(open(path).read())
    from tofu_tf import models
    from tofu_tf.tf.capture import capture_training_step
    _, batch, build = MODELS[key]
    graph = capture_training_step(build(models), batch_size=batch, loss="sparse_categorical_crossentropy",
                                  optimizer="adam")
    if path:
        os.makedirs(cache, exist_ok=True)
        open(path, "w").write(graph.to_json())
    return graph


def run(graph, n, method, **kwargs):
    start = time.perf_counter()
    try:
        plan = plan_graph(graph, num_devices=n, method=method, **kwargs)
    except (BaselineNotApplicableError, InfeasibleBudgetError) as error:
        return None, type(error).__name__
    check_plan(graph, plan, num_devices=n)
    return plan, time.perf_counter() - start


def row(model, n, label, plan, info):
    if plan is None:
        print(f"{model:<16}{n:>4}  {label:<10}{'n/a (' + info + ')':>40}")
        return
    mesh = "x".join(str(s) for s in plan.mesh_shape.values())
    proved = "" if plan.proved_optimal is None else ("  optimal" if plan.proved_optimal else "  not proved")
    print(f"{model:<16}{n:>4}  {label:<10}{mesh:>9}{plan.comm_bytes / 2**20:>12.1f}{plan.comm_seconds * 1e3:>10.3f}"
          f"{plan.peak_memory_bytes / 2**30:>10.2f}{plan.search_seconds:>9.2f}{proved}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp,wrn,lstm,gpt12,gpt48")
    parser.add_argument("--devices", default="8,64")
    parser.add_argument("--cache", default=None)
    parser.add_argument("--no-ilp", action="store_true")
    parser.add_argument("--ilp-time-limit", type=float, default=120.0)
    args = parser.parse_args()
    print(f"{'model':<16}{'N':>4}  {'method':<10}{'mesh':>9}{'comm MiB':>12}{'comm ms':>10}{'peak GiB':>10}"
          f"{'search s':>9}")
    for key in args.models.split(","):
        graph = load_graph(key, args.cache)
        name = MODELS[key][0]
        for n in (int(d) for d in args.devices.split(",")):
            baselines = {}
            for method in ("data_parallel", "megatron"):
                plan, info = run(graph, n, method)
                baselines[method] = plan
                row(name, n, method, plan, info)
            tofu, info = run(graph, n, "tofu")
            row(name, n, "tofu", tofu, info)
            reference, budget = tofu, None
            for label, base in (("tofu@dp", baselines["data_parallel"]), ("tofu@mt", baselines["megatron"])):
                if base is not None:
                    plan, info = run(graph, n, "tofu", memory_budget_bytes=base.peak_memory_bytes)
                    row(name, n, label, plan, info)
                    if plan is not None:
                        reference, budget = plan, base.peak_memory_bytes
            if not args.no_ilp and reference is not None:
                plan, info = run(graph, n, "ilp", mesh_shape=tuple(reference.mesh_shape.values()),
                                 memory_budget_bytes=budget, time_limit_s=args.ilp_time_limit)
                row(name, n, "ilp", plan, info)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
