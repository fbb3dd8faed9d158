"""Budget sweep: tofu against the ILP under memory budgets from 0.2 to 1.0 of the free peak.

For each model (captured once; ``--cache DIR`` keeps the IR as JSON between runs)
the unconstrained tofu plan's modeled peak per device is the reference; at each
fraction of it (``--fractions``, default 0.2, 0.3, ..., 1.0) both ``method="tofu"``
and ``method="ilp"`` plan the step under that ``memory_budget_bytes`` (same device
count, hardware profile, target and mesh search), each plan is checked legal
(``tofu_tf.search.legality``) and its modeled step is recomputed from its layouts by
the cost model (``tofu_tf.cost.evaluate.step_cost``), and one row prints: both
meshes, modeled steps, peaks and search seconds, and tofu's step over the ILP's.
The target: tofu's step <= 1.02x the ILP's at every budget where the ILP finishes
(HiGHS gets ``--ilp-time-limit`` seconds per axis problem). A summary line per
model gives the worst ratio and the total search seconds of each method.

Models: ``gpt`` (tf-keras GPT, 2 layers, d_model 64, 4 heads, seq 32, vocab 256,
batch 16), ``mlp`` (4 x Dense(1024) MLP, batch 64), ``lstm`` (2-layer LSTM, hidden
128, unrolled over 8 steps, batch 32), ``llama`` (keras-hub Llama from
``tofu_tf.hub_models.llama``, width 32, seq 8, batch 16).

Usage: python bench/budget_sweep.py [--models gpt,mlp,lstm,llama] [--devices 8] [--cache /tmp/graphs]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tofu_tf import ir  # noqa: E402
from tofu_tf.errors import InfeasibleBudgetError  # noqa: E402
from tofu_tf.search import plan_graph  # noqa: E402
from tofu_tf.search.ilp import ILPError  # noqa: E402
from tofu_tf.search.legality import check_plan  # noqa: E402


def _gpt():
    from tofu_tf import models
    return models.gpt(num_layers=2, d_model=64, num_heads=4, seq_len=32, vocab_size=256), 16, None


def _mlp():
    from tofu_tf import models
    return models.mlp(input_dim=1024, width=1024, depth=4, num_classes=1000), 64, None


def _lstm():
    from tofu_tf import models
    return models.rnn(num_layers=2, hidden=128, seq_len=8, input_dim=128, num_classes=100, unroll=True), 32, None


def _llama():
    import tensorflow as tf
    from tofu_tf import hub_models
    family = hub_models.FAMILIES["llama"]
    x, _ = hub_models.data(family, 16)
    features = tf.nest.map_structure(lambda a: tf.TensorSpec((16,) + a.shape[1:], tf.as_dtype(a.dtype)), x)
    return family.build(32), 16, features


MODELS = {
    "gpt": ("GPT 2L d64 s32", _gpt),
    "mlp": ("MLP 4x1024", _mlp),
    "lstm": ("LSTM 2x128 T8", _lstm),
    "llama": ("Llama (hub) w32", _llama),
}


def load_graph(key: str, cache: str | None) -> ir.Graph:
    """The model's captured step, from ``cache`` when it holds one captured from this very
    builder (the file name carries a digest of its source)."""
    label, build = MODELS[key]
    digest = hashlib.sha256(f"{label}|{inspect.getsource(build)}".encode()).hexdigest()[:12]
    path = os.path.join(cache, f"sweep-{key}-{digest}.json") if cache else None
    if path and os.path.exists(path):
        return ir.Graph.from_json(open(path).read())
    from tofu_tf.tf.capture import capture_training_step
    model, batch, features = build()
    loss = "sparse_categorical_crossentropy"
    if features is not None:
        import keras
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    graph = capture_training_step(model, batch_size=batch, loss=loss, optimizer="adam", features=features)
    if path:
        os.makedirs(cache, exist_ok=True)
        open(path, "w").write(graph.to_json())
    return graph


def recomputed_step(graph: ir.Graph, plan) -> float:
    """The plan's modeled step, priced again by ``cost.evaluate.step_cost`` from what the plan
    records alone: per op its strategy names per axis (looked up among the op's derived
    strategies for that axis size), per variable its layout."""
    from tofu_tf.cost.evaluate import op_work_seconds, step_cost
    from tofu_tf.cost.hardware import profile
    from tofu_tf.mesh import MeshSpec
    from tofu_tf.semantics import strategies as provider
    from tofu_tf.search.coarsen import split_of
    from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, TensorSplit, replicate_all
    hardware = profile(plan.hardware)
    mesh = MeshSpec(tuple(plan.mesh_axes))
    ops = {op.name: op for op in graph.ops}
    splits = {path: tuple(TensorSplit(layout.index(axis)) if axis in layout else REPLICATED
                          for axis, _ in plan.mesh_axes)
              for path, layout in plan.variable_layouts.items()}
    chosen = {}
    for name, names in plan.op_strategies.items():
        op = ops[name]
        per_axis = []
        for k, ((_, size), wanted) in enumerate(zip(plan.mesh_axes, names)):
            if wanted in ("read", "assign"):     # a variable's read or update: as its layout says
                split = splits[graph.tensors[op.inputs[0]].variable_path][k]
                per_axis.append(OpStrategy("read", (REPLICATED,), (split,)) if wanted == "read" else OpStrategy(
                    "assign", (REPLICATED,) + tuple(split_of(graph.tensors[t], split) for t in op.inputs[1:]), ()))
                continue
            if wanted == "input":                 # a batch input: as the plan lays it out
                layout, axis = plan.input_layouts[op.outputs[0]], plan.mesh_axes[k][0]
                split = TensorSplit(layout.index(axis)) if axis in layout else REPLICATED
                per_axis.append(OpStrategy("input", (), (split,) + (REPLICATED,) * (len(op.outputs) - 1)))
                continue
            found = [replicate_all(len(op.inputs), len(op.outputs))] + list(provider(op, graph, size))
            per_axis.append(next(s for s in found if s.name == wanted))
        chosen[name] = tuple(per_axis)
    return step_cost(graph, mesh, hardware, chosen, splits, work_seconds=op_work_seconds(graph, hardware)).step_seconds


def solve(graph, n, method, budget, args):
    start = time.perf_counter()
    try:
        plan = plan_graph(graph, num_devices=n, method=method, memory_budget_bytes=budget, target=args.target,
                          time_limit_s=args.ilp_time_limit)
    except (InfeasibleBudgetError, ILPError) as error:
        return None, type(error).__name__, time.perf_counter() - start
    check_plan(graph, plan, num_devices=n)
    assert budget is None or plan.peak_memory_bytes <= budget, (plan.peak_memory_bytes, budget)
    again = recomputed_step(graph, plan)
    assert abs(again - plan.step_seconds) <= 1e-9 + 1e-6 * plan.step_seconds, (again, plan.step_seconds)
    return plan, None, time.perf_counter() - start


def _mesh(plan) -> str:
    return "x".join(f"{name}{size}" for name, size in plan.mesh_axes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt,mlp,lstm,llama")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--fractions", default="0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0")
    parser.add_argument("--cache", default=None)
    parser.add_argument("--target", default="dtensor", choices=("ideal", "dtensor"))
    parser.add_argument("--ilp-time-limit", type=float, default=60.0)
    parser.add_argument("--no-ilp", action="store_true")
    args = parser.parse_args()
    n, started = args.devices, time.perf_counter()
    fractions = [float(f) for f in args.fractions.split(",")]
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {n} devices, target {args.target}, h100-nvlink")
    print(f"| model | budget | tofu mesh | tofu step ms | tofu peak MiB | tofu s | ilp mesh | ilp step ms "
          f"| ilp peak MiB | ilp s | tofu / ilp |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    for key in args.models.split(","):
        graph = load_graph(key, args.cache)
        name = MODELS[key][0]
        free, _, _ = solve(graph, n, "tofu", None, args)
        worst, seconds = 0.0, {"tofu": 0.0, "ilp": 0.0}
        for fraction in fractions:
            budget = int(free.peak_memory_bytes * fraction)
            cells = []
            plans = {}
            for method in ("tofu",) + (() if args.no_ilp else ("ilp",)):
                plan, error, took = solve(graph, n, method, budget, args)
                seconds[method] += took
                plans[method] = plan
                if plan is None:
                    cells += [f"n/a ({error})", "", "", f"{took:.1f}"]
                else:
                    cells += [_mesh(plan), f"{plan.step_seconds * 1e3:.4f}",
                              f"{plan.peak_memory_bytes / 2**20:.2f}", f"{took:.1f}"]
            if args.no_ilp:
                cells += ["", "", "", ""]
            tofu, ilp = plans.get("tofu"), plans.get("ilp")
            ratio = tofu.step_seconds / ilp.step_seconds if tofu is not None and ilp is not None else None
            if ratio is not None:
                worst = max(worst, ratio)
            print(f"| {name} | {fraction:.1f} | " + " | ".join(cells)
                  + f" | {'' if ratio is None else f'{ratio:.3f}'} |", flush=True)
        summary.append(f"{name}: worst tofu/ilp {worst:.3f} ({'MET' if worst <= 1.02 else 'NOT MET'} <= 1.02); "
                       f"search seconds tofu {seconds['tofu']:.1f}, ilp {seconds['ilp']:.1f}; "
                       f"free peak {free.peak_memory_bytes / 2**20:.2f} MiB on {_mesh(free)}")
    print(f"\nbench ran {time.perf_counter() - started:.0f} s; load average at end {os.getloadavg()[0]:.2f}")
    for line in summary:
        print("  " + line)


if __name__ == "__main__":
    main()
