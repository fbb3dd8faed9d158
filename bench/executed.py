"""The plan is what runs: the collectives DTensor executes in a training step, against the plan's model.

The planner prices each collective its layouts imply; DTensor's SPMD expansion inserts its own
(relayouts, all-gathers before ops its expanders refuse, all-reduces of partial sums). This
script reads what DTensor compiled. Each model trains 2 steps under ``TofuStrategy`` (no layout
written) in a fresh process with TensorFlow's MLIR dumps on (``TF_DUMP_GRAPH_PREFIX``: DTensor
writes its program after each of its passes); the training step's program right after SPMD
expansion and common-subexpression elimination is read back, and every DTensor collective in it
(``DTensorAllReduce``, ``DTensorReduceScatter``, ``DTensorAllGather``, ``DTensorAllToAll``) is
counted with its per-device tensor types and group size. Its bytes are priced as the cost model
prices them (``tofu_tf/cost/collectives.py``: ring bytes each device sends; all-reduce 2(n-1)/n B,
reduce-scatter and all-gather (n-1)/n B, all-to-all (n-1)/n of the local part), and set beside the
plan's ``comm_by_collective``.

Memory: the training state as placed (each variable's per-device bytes from its layout, weights and
optimizer slots) against the plan's weights + slots per device. TF keeps no per-device peak on CPU
(its BFC statistics need ``TF_CPU_ALLOCATOR_USE_BFC``, under which DTensor misbehaves), so the peak
with activations is shown as modeled only; ``bench/gpu_check.py`` measures it on a GPU.

    python bench/executed.py [--models=mlp,gpt,llama,bert,mixtral,cnn] [--tolerance=0.1]

Exits non-zero while a gap over ``--tolerance`` remains: a collective kind whose executed bytes
differ from the modeled by more than that fraction of the step's collective bytes, a step total
that differs by more than that fraction, or state bytes that do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from bench import compared_models  # noqa: E402
from tofu_tf import executed  # noqa: E402
from tofu_tf.strategies import step_measurement  # noqa: E402

flags.DEFINE_list("models", ["mlp", "gpt", "cnn", "llama", "bert", "mixtral"], "Models to measure.")
flags.DEFINE_float("tolerance", 0.1, "Largest relative gap between executed and modeled figures.")
flags.DEFINE_integer("batch_size", 16, "Global batch size.")
flags.DEFINE_string("method", "tofu", "TofuStrategy's planning method (tofu, data_parallel, ...).")
flags.DEFINE_integer("num_devices", 8, "Devices (virtual CPUs when no GPU is visible).")
flags.DEFINE_string("run_model", None, "Internal: train --run_model here and print the plan's figures as JSON.")
FLAGS = flags.FLAGS

def _run_here():
    """--run_model: two steps under TofuStrategy; the plan's figures and the state as placed."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    from tofu_tf.tf import devices
    devices.provide_devices(FLAGS.num_devices)
    import keras
    from tofu_tf.strategies import TofuStrategy
    spec = compared_models.all_models()[FLAGS.run_model]
    x, y = spec.data(2 * FLAGS.batch_size)
    strategy = TofuStrategy(FLAGS.num_devices, plan_cache=False, method=FLAGS.method)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = spec.build()
        compared_models.compile_for_training(model)
    model.fit(x, y, batch_size=FLAGS.batch_size, shuffle=False, verbose=0)
    plan = strategy.plan
    state = step_measurement.placed_state_bytes(model)
    memory = plan.memory
    print(json.dumps({
        "modeled": {kind: cost.bytes for kind, cost in plan.comm_by_collective.items() if cost.bytes},
        "modeled_runs": _modeled_runs(plan),
        "modeled_state": memory.weight_bytes + memory.optimizer_slot_bytes,
        "modeled_peak": plan.peak_memory_bytes,
        "state": state, "mesh": dict(plan.mesh_shape), "hardware": plan.hardware}))


def _modeled_runs(plan) -> int | None:
    """How many collectives the plan's price says the step runs, where the link pays its latency
    once per collective (the CPU profile): each paid latency is one run (``tofu_tf.cost.combining``
    makes the all-reduces DTensor combines share one; the seconds of packing them, the plan's
    ``packing_seconds``, are not latencies). None on other links."""
    from tofu_tf.cost import hardware
    link = hardware.profile(plan.hardware).intra_node
    if not link.latency_per_collective or not link.latency:
        return None
    return round((plan.comm_seconds - plan.packing_seconds - plan.comm_bytes / link.bandwidth) / link.latency)


def _measure(name: str) -> dict:
    with tempfile.TemporaryDirectory() as dump_dir:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), f"--run_model={name}",
                              f"--batch_size={FLAGS.batch_size}", f"--num_devices={FLAGS.num_devices}",
                              f"--method={FLAGS.method}"],
                             env=executed.dump_environment(dump_dir), capture_output=True, text=True, timeout=1800)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode or not lines:
            raise RuntimeError(f"{name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        row = json.loads(lines[-1])
        from tofu_tf.cost import hardware
        figures = executed.figures_from_dumps(dump_dir, hardware.profile(row["hardware"]).intra_node, row["state"])
        row["dtensor"], row["runs"], row["padding"] = figures.collectives, figures.lowered, figures.lowered_padding
    return row


def main(argv):
    del argv
    if FLAGS.run_model:
        _run_here()
        return
    print(f"{'model':<9}{'collective':<16}{'dtensor ops':>12}{'dtensor KiB':>13}{'modeled KiB':>13}{'gap':>7}"
          f"{'of step':>9}")
    gaps = []
    for name in FLAGS.models:
        row = _measure(name)
        # A kind's gap counts against the tolerance as a share of the step's traffic (the larger of
        # the executed and modeled totals): 1 KiB of all-gathers modeled and none run is a 100% gap
        # of its kind but nothing a step's time could show.
        step_bytes = max(sum(nbytes for _, nbytes in row["dtensor"].values()), sum(row["modeled"].values()), 1.0)
        for kind in sorted(set(row["dtensor"]) | set(row["modeled"])):
            count, expressed = row["dtensor"].get(kind, [0, 0.0])
            modeled = row["modeled"].get(kind, 0.0)
            gap = executed.gap(expressed, modeled)
            share = abs(expressed - modeled) / step_bytes
            if share > FLAGS.tolerance:
                gaps.append(f"{name} {kind} {gap:.0%} ({share:.0%} of the step)")
            print(f"{name:<9}{kind:<16}{count:>12}{expressed / 1024:>13.1f}{modeled / 1024:>13.1f}{gap:>7.0%}"
                  f"{share:>9.0%}")
        runs = sum(count for count, _ in row["runs"].values())
        # The zeros DTensor's combining pass pads each combined buffer with are shown, not judged.
        sent = sum(nbytes for _, nbytes in row["runs"].values()) - row["padding"]
        modeled = sum(row["modeled"].values())
        gap = executed.gap(sent, modeled)
        if gap > FLAGS.tolerance:
            gaps.append(f"{name} total {gap:.0%}")
        kinds = "+".join(f"{count} {kind}" for kind, (count, _) in sorted(row["runs"].items())) or "none"
        if row["padding"]:
            kinds += f", and {row['padding'] / 1024:.1f} KiB of combine padding"
        if row.get("modeled_runs") is not None:
            kinds += f"; modeled: {row['modeled_runs']} runs"
        print(f"{name:<9}{'runs (lowered)':<16}{runs:>12}{sent / 1024:>13.1f}{modeled / 1024:>13.1f}{gap:>7.0%}"
              f"   {kinds}")
        state_gap = executed.gap(row["state"], row["modeled_state"])
        if state_gap > FLAGS.tolerance:
            gaps.append(f"{name} state {state_gap:.0%}")
        print(f"{name:<9}{'state/device':<16}{'':>12}{row['state'] / 1024:>13.1f}{row['modeled_state'] / 1024:>13.1f}"
              f"{state_gap:>7.0%}   modeled peak {row['modeled_peak'] / 2 ** 20:.1f} MiB/device, mesh {row['mesh']}",
              flush=True)
    print("dtensor ops: the collectives of DTensor's training-step program after SPMD expansion and CSE, priced "
          "as the cost model prices the plan's (bytes each device sends per step); runs (lowered): the collectives "
          "left after DTensor's lowering and all-reduce combining (less the zeros that pad each combined buffer to a "
          "multiple of 1024 elements), against the plan's total, and the runs the plan's price pays a latency for; "
          "state/device: weights "
          "+ optimizer slots as placed; of step: a kind's gap as a share of the step's collective bytes (what "
          "--tolerance judges for a kind).")
    if gaps:
        print("gaps over the tolerance: " + ", ".join(gaps))
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
