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

import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from bench import compared_models  # noqa: E402

flags.DEFINE_list("models", ["mlp", "gpt", "cnn", "llama", "bert", "mixtral"], "Models to measure.")
flags.DEFINE_float("tolerance", 0.1, "Largest relative gap between executed and modeled figures.")
flags.DEFINE_integer("batch_size", 16, "Global batch size.")
flags.DEFINE_string("method", "tofu", "TofuStrategy's planning method (tofu, data_parallel, ...).")
flags.DEFINE_integer("num_devices", 8, "Devices (virtual CPUs when no GPU is visible).")
flags.DEFINE_string("run_model", None, "Internal: train --run_model here and print the plan's figures as JSON.")
FLAGS = flags.FLAGS

# DTensor's collectives after SPMD expansion (how it expressed the plan's relayouts) and the
# collectives its lowering passes leave in the program (what runs: on CPU an all-gather becomes an
# all-reduce of a zero-padded buffer, a reduce-scatter an all-reduce and a slice).
DTENSOR_KINDS = {"DTensorAllReduce": "all-reduce", "DTensorReduceScatter": "reduce-scatter",
                 "DTensorAllGather": "all-gather", "DTensorAllToAll": "all-to-all"}
RUN_KINDS = {"CollectiveReduceV2": "all-reduce", "CollectiveReduceScatterV2": "reduce-scatter",
             "CollectiveGatherV2": "all-gather", "CollectiveAllToAllV2": "all-to-all"}
_OP = re.compile(r'"tf\.(' + "|".join(list(DTENSOR_KINDS) + list(RUN_KINDS)) + r')"\(([^)]*)\)')
_TYPES = re.compile(r":\s*\((.*)\)\s*->\s*(.*)$")
_TENSOR = re.compile(r"tensor<([^>]*)>")
_DEFINES = r'^\s*(%[\w#]+)(?:, %[\w#]+)* = (?:tf_executor\.island wraps )?'
_SCALAR = re.compile(_DEFINES + r'"tf.Const"\(\) <\{value = dense<(\d+)> : tensor<i32>\}>')
_GROUPS = re.compile(_DEFINES + r'"tf.Const"\(\).*:\s*\(\)\s*->\s*tensor<(\d+)x(\d+)xi32>')
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i32": 4, "i64": 8, "i8": 1, "i1": 1}


def _tensor_bytes(text: str) -> int:
    """Bytes of an MLIR ``tensor<AxBxf32>`` (element type last)."""
    *dims, dtype = text.split("x")
    size = DTYPE_BYTES.get(dtype, 4)
    for dim in dims:
        size *= int(dim)
    return size


def collectives(mlir: str, kinds: dict, link) -> dict:
    """Per collective kind: [count, bytes each device sends per step] of the ops named in
    ``kinds`` in one DTensor program text, priced by the cost model's own
    ``collective_cost`` on ``link`` (so an all-gather DTensor expresses is priced as the
    all-reduce it lowers to, as the plan prices it)."""
    from tofu_tf.cost.collectives import Collective, collective_cost
    sizes = {}
    for line in mlir.splitlines():
        scalar, groups = _SCALAR.match(line), _GROUPS.match(line)
        if scalar:
            sizes[scalar.group(1)] = int(scalar.group(2))
        elif groups:
            sizes[groups.group(1)] = int(groups.group(3))
    found = collections.defaultdict(lambda: [0, 0.0])
    for line in mlir.splitlines():
        op, types = _OP.search(line), _TYPES.search(line)
        if not op or not types or op.group(1) not in kinds:
            continue
        kind = kinds[op.group(1)]
        operands = [name.strip() for name in op.group(2).split(",")]
        local_in = _tensor_bytes(_TENSOR.findall(types.group(1))[0])
        local_out = _tensor_bytes(_TENSOR.findall(types.group(2))[0])
        group = operands[1] if len(operands) > 1 else None
        n = sizes.get(group) or max(1, round(max(local_in, local_out) / max(min(local_in, local_out), 1)))
        # B of tofu_tf/cost/collectives.py: the tensor's bytes when replicated on the axis.
        whole = {"all-gather": local_out, "all-to-all": local_in * n}.get(kind, local_in)
        found[kind][0] += 1
        found[kind][1] += collective_cost(Collective(kind), whole, n, link).bytes
    return dict(found)


def _training_step_programs(dump_dir: str):
    """The training step's program (the function DTensor compiled with the largest program) as
    DTensor expanded it (after SPMD expansion and CSE) and as its last pass left it."""
    dumps = glob.glob(os.path.join(dump_dir, "dtensor.*.__inference_*"))
    if not dumps:
        raise RuntimeError(f"DTensor wrote no program to {dump_dir}: is TF_DUMP_GRAPH_PREFIX honoured by this "
                           "TensorFlow?")
    step = max(dumps, key=os.path.getsize).rsplit(".__inference_", 1)[1]
    stages = sorted(path for path in dumps if path.endswith(".__inference_" + step))
    expanded = [path for path in stages if ".after_CSE." in path]

    def read(path):
        with open(path) as program:
            return program.read()
    return read(expanded[0] if expanded else stages[-1]), read(stages[-1])


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
    state = 0
    for variable in list(model.weights) + list(model.optimizer.variables):
        value = getattr(variable, "value", variable)
        value = variable if callable(value) else value
        shards = 1
        layout = getattr(value, "layout", None)
        if layout is not None:
            sizes = dict(zip(layout.mesh.dim_names, layout.mesh.shape()))
            for axis in layout.sharding_specs:
                shards *= sizes.get(axis, 1)
        state += value.shape.num_elements() * value.dtype.size // shards
    memory = plan.memory
    print(json.dumps({
        "modeled": {kind: cost.bytes for kind, cost in plan.comm_by_collective.items() if cost.bytes},
        "modeled_state": memory.weight_bytes + memory.optimizer_slot_bytes,
        "modeled_peak": plan.peak_memory_bytes,
        "state": state, "mesh": dict(plan.mesh_shape), "hardware": plan.hardware}))


def _measure(name: str) -> dict:
    with tempfile.TemporaryDirectory() as dump_dir:
        env = {**os.environ, "TF_DUMP_GRAPH_PREFIX": dump_dir, "TF_CPP_VMODULE": "dtensor_mlir_passes=4",
               "TF_CPP_MIN_LOG_LEVEL": "0"}
        out = subprocess.run([sys.executable, os.path.abspath(__file__), f"--run_model={name}",
                              f"--batch_size={FLAGS.batch_size}", f"--num_devices={FLAGS.num_devices}",
                              f"--method={FLAGS.method}"],
                             env=env, capture_output=True, text=True, timeout=1800)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode or not lines:
            raise RuntimeError(f"{name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        row = json.loads(lines[-1])
        expanded, lowered = _training_step_programs(dump_dir)
        from tofu_tf.cost import hardware
        link = hardware.profile(row["hardware"]).intra_node
        row["dtensor"] = collectives(expanded, DTENSOR_KINDS, link)
        row["runs"] = collectives(lowered, RUN_KINDS, link)
    return row


def _gap(executed: float, modeled: float) -> float:
    if not executed and not modeled:
        return 0.0
    return abs(executed - modeled) / max(executed, modeled)


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
            gap = _gap(expressed, modeled)
            share = abs(expressed - modeled) / step_bytes
            if share > FLAGS.tolerance:
                gaps.append(f"{name} {kind} {gap:.0%} ({share:.0%} of the step)")
            print(f"{name:<9}{kind:<16}{count:>12}{expressed / 1024:>13.1f}{modeled / 1024:>13.1f}{gap:>7.0%}"
                  f"{share:>9.0%}")
        runs = sum(count for count, _ in row["runs"].values())
        sent = sum(nbytes for _, nbytes in row["runs"].values())
        modeled = sum(row["modeled"].values())
        gap = _gap(sent, modeled)
        if gap > FLAGS.tolerance:
            gaps.append(f"{name} total {gap:.0%}")
        kinds = "+".join(f"{count} {kind}" for kind, (count, _) in sorted(row["runs"].items())) or "none"
        print(f"{name:<9}{'runs (lowered)':<16}{runs:>12}{sent / 1024:>13.1f}{modeled / 1024:>13.1f}{gap:>7.0%}"
              f"   {kinds}")
        state_gap = _gap(row["state"], row["modeled_state"])
        if state_gap > FLAGS.tolerance:
            gaps.append(f"{name} state {state_gap:.0%}")
        print(f"{name:<9}{'state/device':<16}{'':>12}{row['state'] / 1024:>13.1f}{row['modeled_state'] / 1024:>13.1f}"
              f"{state_gap:>7.0%}   modeled peak {row['modeled_peak'] / 2 ** 20:.1f} MiB/device, mesh {row['mesh']}",
              flush=True)
    print("dtensor ops: the collectives of DTensor's training-step program after SPMD expansion and CSE, priced "
          "as the cost model prices the plan's (bytes each device sends per step); runs (lowered): the collectives "
          "left after DTensor's lowering and all-reduce combining, against the plan's total; state/device: weights "
          "+ optimizer slots as placed; of step: a kind's gap as a share of the step's collective bytes (what "
          "--tolerance judges for a kind).")
    if gaps:
        print("gaps over the tolerance: " + ", ".join(gaps))
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
