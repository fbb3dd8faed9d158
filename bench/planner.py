"""Planner benchmark: modeled step time (communication + compute), peak memory, search time.

For each model (captured once; ``--cache DIR`` keeps the IR as JSON between
runs) and device count, prints one row per method:

* ``data_parallel`` and ``megatron`` (hand patterns, where they apply),
* ``tofu`` under the hardware's memory, and ``tofu@dp`` / ``tofu@mt`` with the
  memory budget set to the baseline's peak ("at equal memory"),
* ``ilp`` on the mesh of the last tofu row, same budget (proved-optimal flag shown),

then one line per target (tofu no worse than the baselines, search time, within 2%
of a proved ILP optimum, search time against the device count: GPT-12 on 1024
devices at most 2.5x its 64-device time, GPT-48 on 4096 at most 3x, the LSTM on
64 at most 2x its 8-device time) saying met or not, with the numbers, and the ILP
race's ratios (the retired "50x faster than the ILP" target) for information. Plans use ``--target`` (default "ideal": Tofu's full
space; "dtensor": what DTensor lowers). The GPT-48 search times are the median of
``--repeat`` runs. The ILP race runs HiGHS on the same axis problem as tofu's DP
(the mesh tofu picked, one axis) until its incumbent matches the DP's objective
or ``--race-limit`` seconds pass; the ratio is the ILP's time to equal cost (its
setup included) over tofu's whole planning time on that mesh, measured as a first
call in fresh processes (median of 3; a lower bound when the limit is hit).

Usage: python bench/planner.py [--models mlp,gpt12] [--devices 8,64,256,1024,4096] [--cache /tmp/graphs] [--no-ilp]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import statistics
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
    """The model's captured step, from ``cache`` when it holds one captured from this very
    spec: the file name carries a digest of the spec's label, batch and builder source, so a
    graph cached before a model's definition changed is captured again, not reused."""
    label, batch, build = MODELS[key]
    spec = f"{label}|{batch}|{inspect.getsource(build).strip()}"
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    path = os.path.join(cache, f"{key}-{digest}.json") if cache else None
    if path and os.path.exists(path):
        return ir.Graph.from_json(open(path).read())
    from tofu_tf import models
    from tofu_tf.tf.capture import capture_training_step
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


def run_median(graph, n, repeat):
    """tofu ``repeat`` times: the first plan, and the median search seconds."""
    plan, info = run(graph, n, "tofu")
    if plan is None or repeat <= 1:
        return plan, info, (plan.search_seconds if plan else None), []
    times = [plan.search_seconds] + [run(graph, n, "tofu")[0].search_seconds for _ in range(repeat - 1)]
    return plan, info, statistics.median(times), times


def ilp_race(graph, tofu_plan, n, limit_s):
    """HiGHS against tofu's DP on the same axis problems (tofu's mesh, axis by axis, each given
    the DP's earlier axes): when the ILP's incumbent first matches the DP objective (within
    HiGHS's 1e-6 gap), summed over axes, against the DP's solve time, and end to end: the ILP's
    setup (index and problems, timed here, where earlier plans already derived every op's
    strategies, so it can only be smaller than a first call's) plus its solve, against tofu's
    whole cold first ``plan_graph`` on that mesh (``cold_tofu_seconds``). The garbage
    collector is paused for the ILP's setup and solve, as ``plan_graph`` pauses it for tofu."""
    import gc
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _ilp_race(graph, tofu_plan, n, limit_s)
    finally:
        if enabled:
            gc.enable()


def _ilp_race(graph, tofu_plan, n, limit_s):
    from tofu_tf.cost.evaluate import op_work_seconds
    from tofu_tf.cost.hardware import H100_NVLINK
    from tofu_tf.mesh import MeshSpec
    from tofu_tf.search import ilp, tofu_dp
    from tofu_tf.search.coarsen import GraphIndex
    from tofu_tf.search.problem import AxisDecision, ProblemBuilder
    from tofu_tf.search.targets import as_target, pinned_variables, restrict_provider
    from tofu_tf.semantics import strategies
    sizes = tuple(tofu_plan.mesh_shape.values())
    cold = cold_tofu_seconds(graph, n, sizes)
    start = time.perf_counter()
    target = as_target(TARGET["value"])
    index = GraphIndex(graph, restrict_provider(strategies, target, graph), pinned=pinned_variables(graph, target),
                       work=op_work_seconds(graph, H100_NVLINK))
    setup = time.perf_counter() - start
    mesh = MeshSpec(tuple((f"a{k}", size) for k, size in enumerate(sizes)))
    prior, dp_s, ilp_s, reached_all, axes = [], 0.0, 0.0, True, []
    for k, size in enumerate(sizes):
        start = time.perf_counter()
        problem = ProblemBuilder(index, prior, size, H100_NVLINK.axis_link(mesh, k)).build()
        setup += time.perf_counter() - start
        start = time.perf_counter()
        dp = tofu_dp.solve_axis(problem)
        dp_s += time.perf_counter() - start
        goal = dp.objective * (1 + 1e-6)
        left = max(limit_s - ilp_s, 1.0)
        start = time.perf_counter()
        found = ilp.solve_axis(problem, time_limit_s=left, stop_at=goal)
        elapsed = time.perf_counter() - start
        reached = next((t for t, objective in found.incumbents if objective <= goal), None)
        if reached is None and found.objective <= goal:
            reached = elapsed
        reached_all = reached_all and reached is not None
        ilp_s += reached if reached is not None else elapsed
        axes.append((dp.objective, found.objective))
        prior.append(AxisDecision.of(problem, dp.choice, size))
    return {"mesh": sizes, "tofu_s": statistics.median(cold), "tofu_runs": cold, "setup_s": setup, "dp_s": dp_s,
            "ilp_s": ilp_s, "reached": reached_all, "axes": axes}


def cold_tofu_seconds(graph, n, sizes, repeat=3) -> list[float]:
    """tofu's planning time on ``sizes`` as a real first call: each of ``repeat`` fresh
    Python processes reads the graph (not timed) and times one ``plan_graph`` call, the
    returned Plan included, so no cache (strategies derived per op signature, collective
    prices) is warm from the plans this bench ran before."""
    import json
    import subprocess
    import tempfile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import json, sys, time\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "from tofu_tf import ir\n"
            "from tofu_tf.search import plan_graph\n"
            "graph = ir.Graph.from_json(open(sys.argv[2]).read())\n"
            "start = time.perf_counter()\n"
            "plan_graph(graph, num_devices=int(sys.argv[3]), mesh_shape=tuple(json.loads(sys.argv[4])), "
            "target=sys.argv[5])\n"
            "print(time.perf_counter() - start)\n")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        file.write(graph.to_json())
        file.flush()
        return [float(subprocess.run([sys.executable, "-c", code, root, file.name, str(n), json.dumps(sizes),
                                      TARGET["value"]], check=True, capture_output=True, text=True).stdout)
                for _ in range(repeat)]


def row(model, n, label, plan, info, seconds=None):
    if plan is None:
        print(f"{model:<16}{n:>4}  {label:<10}{'n/a (' + info + ')':>40}")
        return
    mesh = "x".join(str(s) for s in plan.mesh_shape.values())
    proved = "" if plan.proved_optimal is None else ("  optimal" if plan.proved_optimal else "  not proved")
    seconds = plan.search_seconds if seconds is None else seconds
    print(f"{model:<16}{n:>4}  {label:<10}{mesh:>9}{plan.comm_bytes / 2**20:>11.1f}{plan.comm_seconds * 1e3:>10.3f}"
          f"{plan.compute_seconds * 1e3:>10.3f}{plan.step_seconds * 1e3:>10.3f}"
          f"{plan.peak_memory_bytes / 2**30:>10.2f}{seconds:>9.2f}{proved}")


def race_line(model, n, race):
    mesh = "x".join(map(str, race["mesh"]))
    tofu_s, setup, dp_s, ilp_s = race["tofu_s"], race["setup_s"], race["dp_s"], race["ilp_s"]
    bound = "" if race["reached"] else ">= "
    end_to_end, solver = (setup + ilp_s) / tofu_s, ilp_s / dp_s
    gaps = ", ".join(f"{(i / d - 1):+.1e}" for d, i in race["axes"])
    what = ("HiGHS matched the DP on every axis" if race["reached"] else
            "HiGHS had not matched the DP on every axis by its limit") + f" (ILP/DP - 1 per axis: {gaps})"
    runs = ", ".join(f"{t:.3f}" for t in race["tofu_runs"])
    # tofu builds the same index and axis problems as the ILP's setup before it solves
    # anything, so even with its DP and Plan free it takes at least ``setup``: the ratio
    # cannot pass (setup + ILP) / setup however fast the rest of tofu gets.
    ceiling = (setup + ilp_s) / setup
    print(f"{model:<16}{n:>4}  ilp race  {mesh:>9}  {what}; ILP {ilp_s:.1f} s vs DP {dp_s:.3f} s "
          f"({bound}{solver:.0f}x); setup {setup:.2f} s; tofu end to end {tofu_s:.3f} s (cold, median of {runs}) "
          f"({bound}{end_to_end:.1f}x; ceiling with only the shared setup left: {ceiling:.1f}x, 50x needs that "
          f"setup <= {ilp_s / 49:.3f} s)")
    # The old target "50x faster than the ILP end to end" is retired (the shared setup bounds the
    # ratio, see ``ceiling``); both ratios are still printed.
    VERDICTS.append(f"INFO     {model} N={n} mesh {mesh}: ILP at equal cost {bound}{end_to_end:.1f}x tofu's "
                    f"planning time (setup {setup:.2f} s + ILP {ilp_s:.1f} s vs {tofu_s:.3f} s cold; solver alone "
                    f"{bound}{solver:.0f}x: ILP {ilp_s:.1f} s vs DP {dp_s:.3f} s; ceiling {ceiling:.1f}x while the "
                    f"shared setup takes {setup:.2f} s)")


def verdict(text: str, met: bool) -> None:
    VERDICTS.append(f"{'MET    ' if met else 'NOT MET'}  {text}")


# Planning time against the device count: (model, devices, reference devices, at most this ratio).
SCALING = (("gpt12", 1024, 64, 2.5), ("gpt48", 4096, 64, 3.0), ("lstm", 64, 8, 2.0))


def scaling_verdicts(seconds: dict[tuple[str, int], float]) -> None:
    """The scale targets, from the tofu rows' search seconds of one run."""
    for key, n, reference, limit in SCALING:
        if (key, n) in seconds and (key, reference) in seconds:
            ratio = seconds[key, n] / seconds[key, reference]
            verdict(f"{MODELS[key][0]}: search on {n} devices {seconds[key, n]:.2f} s = {ratio:.2f}x its "
                    f"{reference}-device {seconds[key, reference]:.2f} s (target <= {limit}x)", ratio <= limit)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp,wrn,lstm,gpt12,gpt48")
    parser.add_argument("--devices", default="8,64")
    parser.add_argument("--cache", default=None)
    parser.add_argument("--no-ilp", action="store_true")
    parser.add_argument("--ilp-time-limit", type=float, default=60.0)
    parser.add_argument("--ilp-max-ops", type=int, default=5000, help="skip the ILP on larger graphs")
    parser.add_argument("--target", default="ideal", choices=("ideal", "dtensor"))
    parser.add_argument("--repeat", type=int, default=3, help="GPT-48 tofu runs whose median search time is reported")
    parser.add_argument("--race-limit", type=float, default=300.0, help="seconds the ILP gets on GPT-12")
    args = parser.parse_args()
    TARGET["value"] = args.target
    started = time.perf_counter()
    searched: dict[tuple[str, int], float] = {}
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores, shared)")
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
            tofu, info, median, times = run_median(graph, n, args.repeat if key == "gpt48" else 1)
            row(name, n, "tofu", tofu, info, median)
            if tofu is not None:
                searched[key, n] = median
            if tofu is not None:
                for method, base in baselines.items():
                    if base is not None:
                        verdict(f"{name} N={n}: tofu step {tofu.step_seconds * 1e3:.3f} ms <= {method} "
                                f"{base.step_seconds * 1e3:.3f} ms", tofu.step_seconds <= base.step_seconds * 1.0001)
                limit = {8: 5.0, 64: 30.0}.get(n)
                if key == "gpt48" and limit:
                    runs = ", ".join(f"{t:.1f}" for t in times)
                    verdict(f"{name} N={n}: search {median:.1f} s (median of {len(times) or 1}: {runs}) "
                            f"< {limit:.0f} s", median < limit)
                if key == "gpt12" and n == 8 and not args.no_ilp:
                    race_line(name, n, ilp_race(graph, tofu, n, args.race_limit))
            reference, budget = tofu, None
            for label, method in (("tofu@dp", "data_parallel"), ("tofu@mt", "megatron")):
                base = baselines[method]
                if base is not None:
                    plan, info = run(graph, n, "tofu", memory_budget_bytes=base.peak_memory_bytes)
                    row(name, n, label, plan, info)
                    if plan is not None:
                        reference, budget = plan, base.peak_memory_bytes
                        verdict(f"{name} N={n}: at {method}'s peak {base.peak_memory_bytes / 2**30:.2f} GiB, tofu step "
                                f"{plan.step_seconds * 1e3:.3f} ms <= {base.step_seconds * 1e3:.3f} ms",
                                plan.step_seconds <= base.step_seconds * 1.0001
                                and plan.peak_memory_bytes <= base.peak_memory_bytes)
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
    scaling_verdicts(searched)
    print(f"\ntargets ({TARGET['value']} space; bench ran {time.perf_counter() - started:.0f} s; "
          f"load average at end {os.getloadavg()[0]:.2f}):")
    for line in VERDICTS:
        print("  " + line)


if __name__ == "__main__":
    main()
