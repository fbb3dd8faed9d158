"""Planner benchmark: modeled step time (communication + compute), peak memory, search time.

For each model (captured once; ``--cache DIR`` keeps the IR as JSON between
runs) and device count, prints one row per method:

* ``data_parallel`` and ``megatron`` (hand patterns, where they apply),
* ``tofu`` under the hardware's memory, and ``tofu@dp`` / ``tofu@mt`` with the
  memory budget set to the baseline's peak ("at equal memory"),
* ``ilp`` on the mesh of the last tofu row, same budget (proved-optimal flag shown),

then one line per target (tofu no worse than the baselines, search time, within 2%
of a proved ILP optimum) saying met or not, with the numbers. Plans use
``--target`` (default "ideal": Tofu's full space; "dtensor": what DTensor lowers).

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


TARGET = {"value": "ideal"}
VERDICTS: list[str] = []


def run(graph, n, method, **kwargs):
    start = time.perf_counter()
    try:
        plan = plan_graph(graph, num_devices=n, method=method, target=TARGET["value"], **kwargs)
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
    print(f"{model:<16}{n:>4}  {label:<10}{mesh:>9}{plan.comm_bytes / 2**20:>11.1f}{plan.comm_seconds * 1e3:>10.3f}"
          f"{plan.compute_seconds * 1e3:>10.3f}{plan.step_seconds * 1e3:>10.3f}"
          f"{plan.peak_memory_bytes / 2**30:>10.2f}{plan.search_seconds:>9.2f}{proved}")


def verdict(text: str, met: bool) -> None:
    VERDICTS.append(f"{'MET    ' if met else 'NOT MET'}  {text}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp,wrn,lstm,gpt12,gpt48")
    parser.add_argument("--devices", default="8,64")
    parser.add_argument("--cache", default=None)
    parser.add_argument("--no-ilp", action="store_true")
    parser.add_argument("--ilp-time-limit", type=float, default=60.0)
    parser.add_argument("--ilp-max-ops", type=int, default=5000, help="skip the ILP on larger graphs")
    parser.add_argument("--target", default="ideal", choices=("ideal", "dtensor"))
    args = parser.parse_args()
    TARGET["value"] = args.target
    started = time.perf_counter()
    print(f"{'model':<16}{'N':>4}  {'method':<10}{'mesh':>9}{'comm MiB':>11}{'comm ms':>10}{'comp ms':>10}"
          f"{'step ms':>10}{'peak GiB':>10}{'search s':>9}")
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
            if tofu is not None:
                for method, base in baselines.items():
                    if base is not None:
                        verdict(f"{name} N={n}: tofu step {tofu.step_seconds * 1e3:.3f} ms <= {method} "
                                f"{base.step_seconds * 1e3:.3f} ms", tofu.step_seconds <= base.step_seconds * 1.0001)
                limit = {8: 5.0, 64: 30.0}.get(n)
                if key == "gpt48" and limit:
                    verdict(f"{name} N={n}: search {tofu.search_seconds:.1f} s < {limit:.0f} s",
                            tofu.search_seconds < limit)
            reference, budget = tofu, None
            for label, base in (("tofu@dp", baselines["data_parallel"]), ("tofu@mt", baselines["megatron"])):
                if base is not None:
                    plan, info = run(graph, n, "tofu", memory_budget_bytes=base.peak_memory_bytes)
                    row(name, n, label, plan, info)
                    if plan is not None:
                        reference, budget = plan, base.peak_memory_bytes
            if args.no_ilp or reference is None:
                pass
            elif len(graph.ops) > args.ilp_max_ops:
                print(f"{name:<16}{n:>4}  {'ilp':<10}  skipped: {len(graph.ops)} ops > --ilp-max-ops")
            else:
                mesh = tuple(reference.mesh_shape.values())
                plan, info = run(graph, n, "ilp", mesh_shape=mesh, memory_budget_bytes=budget,
                                 time_limit_s=args.ilp_time_limit)
                row(name, n, "ilp", plan, info)
                same, _ = run(graph, n, "tofu", mesh_shape=mesh, memory_budget_bytes=budget)
                if plan is not None and same is not None and plan.proved_optimal:
                    gap = same.step_seconds / plan.step_seconds - 1
                    verdict(f"{name} N={n} mesh {mesh}: tofu {same.step_seconds * 1e3:.3f} ms vs ILP optimum "
                            f"{plan.step_seconds * 1e3:.3f} ms ({gap:+.2%}, target <= +2%)", gap <= 0.02)
            sys.stdout.flush()
    print(f"\ntargets ({TARGET['value']} space; bench ran {time.perf_counter() - started:.0f} s):")
    for line in VERDICTS:
        print("  " + line)


if __name__ == "__main__":
    main()
