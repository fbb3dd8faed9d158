"""Which ops TensorFlow's DTensor can lay out: probed, one-op program by one-op program.

For every op type the semantics registry describes (an example of each drawn from the
registry's property tests, ``tests/test_semantics_ops.py``: the smallest one hypothesis
finds with a float input of rank 2 or more) and for the programs of ``SWEEP`` (the ops the
keras-hub sweep met and the registry does not describe: linear algebra, TensorLists of a
``tf.scan``, an int8 matmul, ...), in two layouts the planner gives an op, on a mesh of two
virtual CPUs:

* ``replicated``: every input replicated;
* ``batch``: every float input whose dim 0 divides split on dim 0 (as a batch-split plan
  lays activations out), the rest replicated;

the one-op program is compiled and run by DTensor and its result compared with the op run
on one device. Each outcome is one of ``ok``, ``no_layout_propagation`` (DTensor's "op does
not implement layout propagation"), ``error`` (another error, its text kept),
``wrong`` (it ran and its value differs), ``crash`` (the process died: a segfault; the
probe runs in child processes and carries on in a fresh one), or ``n/a`` (no input to split,
or no program to run). A program of ``SWEEP`` names the op DTensor refused (``refuses``).

The table is checked in as ``tofu_tf/search/dtensor_support.json``; the planner reads it
(``tofu_tf.search.dtensor_support``) and ``tests/test_dtensor_support.py`` probes again and
fails when TensorFlow changes an outcome. Regenerate after a TensorFlow upgrade:

    python bench/dtensor_support.py --write

(``--out=path`` writes elsewhere; ``--ops=A,B`` probes only those keys.) About a minute
on two cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TABLE = os.path.join(ROOT, "tofu_tf", "search", "dtensor_support.json")
LAYOUTS = ("replicated", "batch")
_NO_PROPAGATION = re.compile(r"'tf\.(\w+)' op does not implement layout propagation")


# -- programs the registry does not describe (the sweep's), each on one float matrix ------------

def _sweep_programs(tf):
    """key -> (function of one float32 (4, 4) matrix, a second input or None)."""
    import numpy as np

    def scan(a):
        return tf.scan(lambda acc, row: acc + row, a)

    def tensor_array(a):
        ta = tf.TensorArray(tf.float32, size=2)
        return ta.write(0, a).write(1, a * 2.0).stack()

    def while_loop(a):
        return tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0), (tf.constant(0), a))[1]

    def int8_matmul(a):
        q = tf.cast(tf.clip_by_value(a * 100.0, -127.0, 127.0), tf.int8)
        return tf.cast(tf.raw_ops.BatchMatMulV3(x=q, y=q, Tout=tf.int32), tf.float32)

    def dilated_depthwise(a):
        x = tf.reshape(tf.tile(a, (2, 4)), (2, 4, 4, 4))
        return tf.nn.depthwise_conv2d(x, tf.ones((3, 3, 4, 1)), (1, 1, 1, 1), "SAME", dilations=(2, 2))

    del np
    return {
        "Svd": lambda a: tf.linalg.svd(a)[0], "MatrixDeterminant": tf.linalg.det,
        "LogMatrixDeterminant": lambda a: tf.linalg.slogdet(a)[1], "MatrixInverse": tf.linalg.inv,
        "SelfAdjointEigV2": lambda a: tf.linalg.eigh(a)[0], "MatrixSolve": lambda a: tf.linalg.solve(a, a),
        "MatrixTriangularSolve": lambda a: tf.linalg.triangular_solve(a, a),
        "MatrixDiagPartV3": tf.linalg.diag_part, "MatrixDiagV3": lambda a: tf.linalg.diag(a[0]),
        "MatrixSetDiagV3": lambda a: tf.linalg.set_diag(a, a[0]), "Cumprod": lambda a: tf.math.cumprod(a, axis=1),
        "DenseBincount": lambda a: tf.math.bincount(tf.cast(a * 2.0, tf.int32), minlength=4, maxlength=4,
                                                    dtype=tf.float32),
        "EagerPyFunc": lambda a: tf.py_function(lambda t: t * 2, [a], tf.float32),
        "PyFunc": lambda a: tf.numpy_function(lambda t: t * 2, [a], tf.float32, stateful=True),
        "PyFuncStateless": lambda a: tf.numpy_function(lambda t: t * 2, [a], tf.float32, stateful=False),
        "Qr": lambda a: tf.linalg.qr(a)[0], "Cholesky": lambda a: tf.linalg.cholesky(
            tf.matmul(a, a, transpose_b=True) + 4.0 * tf.eye(4)),
        "TensorListFromTensor (tf.scan)": scan, "TensorListStack (TensorArray)": tensor_array,
        "While (tf.while_loop)": while_loop, "BatchMatMulV3 (int8)": int8_matmul,
        "SpaceToBatchND (dilated depthwise)": dilated_depthwise,
        "ExtractImagePatches": lambda a: tf.image.extract_patches(
            tf.reshape(a, (1, 4, 4, 1)), (1, 2, 2, 1), (1, 2, 2, 1), (1, 1, 1, 1), "VALID"),
    }


SWEEP_KEYS = ("Svd", "MatrixDeterminant", "LogMatrixDeterminant", "MatrixInverse", "SelfAdjointEigV2", "MatrixSolve",
              "MatrixTriangularSolve", "MatrixDiagPartV3", "MatrixDiagV3", "MatrixSetDiagV3", "Cumprod",
              "DenseBincount", "EagerPyFunc", "PyFunc", "PyFuncStateless", "Qr", "Cholesky",
              "TensorListFromTensor (tf.scan)", "TensorListStack (TensorArray)", "While (tf.while_loop)",
              "BatchMatMulV3 (int8)",
              "SpaceToBatchND (dilated depthwise)", "ExtractImagePatches")
# What a sweep program's key says it probes, when DTensor names no op (it ran).
_SWEEP_OP = {key: key.split(" ")[0] for key in SWEEP_KEYS}


# -- the child: run the probes it is given, one line per outcome --------------------------------

def _child(units: list[str]) -> None:
    from tofu_tf.tf import devices
    devices.configure_virtual_cpus(2)
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    tf.get_logger().setLevel("ERROR")
    mesh = dtensor.create_mesh([("batch", 2)], devices=["CPU:0", "CPU:1"])
    sweep = _sweep_programs(tf)
    for unit in units:
        key, layout = unit.rsplit("@", 1)
        print("START", unit, sep="\t", flush=True)
        if key in sweep:
            outcome = _run_sweep(sweep[key], layout, mesh, tf, dtensor, np)
        else:
            outcome = _run_registry_op(key, layout, mesh, tf, dtensor, np)
        print("RESULT", unit, json.dumps(outcome), sep="\t", flush=True)


def _on_mesh(value, layout, tf, dtensor):
    replicated = dtensor.copy_to_mesh(tf.constant(value), dtensor.Layout.replicated(layout.mesh, layout.rank))
    return dtensor.relayout(replicated, layout)


def _classify(error: Exception) -> dict:
    text = str(error)
    named = _NO_PROPAGATION.search(text)
    if named:
        return {"outcome": "no_layout_propagation", "refuses": named.group(1)}
    first = next((line for line in text.splitlines() if "error:" in line), text.splitlines()[0] if text else "")
    first = first.split("error:", 1)[-1].strip()
    return {"outcome": "error", "detail": f"{type(error).__name__}: {first[:240]}"}


def _same(got, want, np) -> bool:
    if got.shape != want.shape:
        return False
    if want.dtype.kind in "fc":
        return bool(np.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True))
    return bool(np.array_equal(got, want))


def _gathered(outputs, tf, dtensor):
    values = []
    for out in tf.nest.flatten(outputs):
        if isinstance(out, tf.Tensor):
            out = dtensor.relayout(out, dtensor.Layout.replicated(dtensor.fetch_layout(out).mesh, out.shape.rank))
            values.append(dtensor.unpack(out)[0].numpy())
    return values


def _run_sweep(fn, layout, mesh, tf, dtensor, np) -> dict:
    value = (np.arange(16, dtype=np.float32).reshape(4, 4) % 5 + np.eye(4, dtype=np.float32)) / 4.0
    want = [np.asarray(v) for v in tf.nest.flatten(fn(tf.constant(value)))]
    placed = _split_layout(2, 0 if layout == "batch" else None, mesh, dtensor)
    try:
        got = _gathered(tf.function(fn)(_on_mesh(value, placed, tf, dtensor)), tf, dtensor)
    except Exception as error:  # pylint: disable=broad-except  (the outcome is what is recorded)
        return _classify(error)
    return {"outcome": "ok" if all(_same(g, w, np) for g, w in zip(got, want)) else "wrong"}


def _registry_case(op_type):
    from hypothesis import HealthCheck, find, settings
    from hypothesis import strategies as st
    from hypothesis.errors import NoSuchExample, Unsatisfiable
    from tests import test_semantics_ops as cases

    build = cases.CASES[op_type]
    strategy = st.composite(lambda draw: build(cases.Draw(draw), op_type))()
    quiet = settings(database=None, derandomize=True, max_examples=200, suppress_health_check=list(HealthCheck))

    def splittable(case):
        floats = [x for x in case.inputs if getattr(x, "ndim", 0) >= 1 and x.dtype.kind == "f"]
        return any(x.ndim >= 2 for x in floats) and all(x.shape[0] % 2 == 0 for x in floats)
    try:
        return find(strategy, splittable, settings=quiet), cases
    except (NoSuchExample, Unsatisfiable):
        return find(strategy, lambda case: True, settings=quiet), cases


def _batch_splits(case, outputs, cases):
    """Per input, the dim the registry's batch strategy splits (the first derived strategy the
    DTensor target keeps, ``tofu_tf.search.targets.dtensor_lowerable``, that splits the op's
    first output, or its first input for an op with no output, on dim 0), or None when the
    planner never splits that dim."""
    from tofu_tf import semantics
    from tofu_tf.search import targets
    op, graph = cases.build_ir(case, outputs)
    for strategy in semantics.strategies(op, graph, 2):
        lead = strategy.outputs[0] if strategy.outputs else (strategy.inputs[0] if strategy.inputs else None)
        if lead is not None and lead.dim == 0 and targets.dtensor_lowerable(op, graph, strategy):
            return [split.dim for split in strategy.inputs]
    return None


def _run_registry_op(op_type, layout, mesh, tf, dtensor, np) -> dict:
    case, cases = _registry_case(op_type)
    if case.check in (cases.Check.SHAPES, cases.Check.REPLICATED):
        return {"outcome": "n/a", "detail": "no eager kernel or no real inputs in its property test"}
    want, want_vars = cases.run_op(op_type, case.attrs, case.inputs, case.variables)
    dims = [None] * len(case.inputs)
    if layout == "batch":
        dims = _batch_splits(case, [(w.shape, w.dtype.name) for w in want], cases)
        if dims is None:
            return {"outcome": "n/a", "detail": "the registry derives no strategy splitting its output's dim 0"}
    placed = [_split_layout(np.asarray(x).ndim, dim, mesh, dtensor) for x, dim in zip(case.inputs, dims)]
    on_mesh = [_on_mesh(np.asarray(x), lay, tf, dtensor) for x, lay in zip(case.inputs, placed)]
    variables = {k: dtensor.DVariable(on_mesh[k]) for k in case.variables}
    fn, params, op_def = cases._raw_op(op_type)  # pylint: disable=protected-access

    def program(*values):
        kwargs = _kwargs(op_type, case, values, variables, params, op_def, cases)
        out = fn(**kwargs)
        if out is None or isinstance(out, tf.Operation):
            return [variables[k].read_value() for k in sorted(variables)] or [tf.constant(0.0)]
        return list(out) if isinstance(out, (list, tuple)) else [out]
    try:
        got = _gathered(tf.function(program)(*[v for k, v in enumerate(on_mesh) if k not in variables]), tf, dtensor)
    except Exception as error:  # pylint: disable=broad-except  (the outcome is what is recorded)
        return _classify(error)
    expected = want or [want_vars[k] for k in sorted(want_vars)]
    if case.check is not cases.Check.EXACT or not expected:
        return {"outcome": "ok"}
    same = all(_same(g, np.asarray(w), np) for g, w in zip(got, expected))
    return {"outcome": "ok" if same else "wrong"}


def _split_layout(rank, dim, mesh, dtensor):
    spec = [dtensor.UNSHARDED] * rank
    if dim is not None and dim < rank:
        spec[dim] = "batch"
    return dtensor.Layout(spec, mesh)


def _kwargs(op_type, case, values, variables, params, op_def, cases):
    values = list(values)
    inputs = [variables[k].handle if k in variables else values.pop(0) for k in range(len(case.inputs))]
    args = list(op_def.input_arg)
    names = params[:len(args)]
    n_list = len(inputs) - (len(args) - 1)
    kwargs, pos = {}, 0
    for arg, name in zip(args, names):
        if arg.number_attr or arg.type_list_attr:
            kwargs[name] = inputs[pos:pos + n_list]
            pos += n_list
        else:
            kwargs[name] = inputs[pos]
            pos += 1
    attrs = {cases._RENAMED.get((op_type, k), k): v for k, v in case.attrs.items()}  # pylint: disable=protected-access
    kwargs.update({k: v for k, v in attrs.items() if k in params and k not in kwargs})
    return kwargs


# -- the parent: children until every unit has an outcome ---------------------------------------

REPLICATED_SWITCH_PREFIX = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_"   # tofu_tf/tf/compat/decoding.py

def probe(keys, *, timeout: int = 900) -> dict:
    """{key: {layout: outcome}} for ``keys`` (op types of the registry or keys of ``SWEEP_KEYS``)."""
    pending = [f"{key}@{layout}" for key in keys for layout in LAYOUTS]
    results: dict[str, dict] = {}
    # DTensor's own behaviour: without the switches that enroll ops in its replicated expansion
    # (a TofuStrategy of this process may have set some, e.g. for MatrixDiagV3).
    env = {key: value for key, value in os.environ.items() if not key.startswith(REPLICATED_SWITCH_PREFIX)}
    env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    while pending:
        try:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *pending], cwd=ROOT,
                                 capture_output=True, text=True, env=env, timeout=timeout)
            stdout, died = out.stdout, out.returncode != 0
        except subprocess.TimeoutExpired as expired:
            out = None
            stdout, died = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) \
                else (expired.stdout or ""), True
        for line in stdout.splitlines():
            if line.startswith("RESULT\t"):
                _, unit, outcome = line.split("\t", 2)
                results[unit] = json.loads(outcome)
        done = [u for u in pending if u in results]
        pending = [u for u in pending if u not in results]
        if pending and died:
            unit = pending.pop(0)
            results[unit] = _crashed(unit, stderr_tail(out if not isinstance(out, str) else None), env, timeout)
        elif pending and not done:
            raise RuntimeError(f"the probe child ran nothing:\n{stdout[-2000:]}")
    table: dict[str, dict] = {}
    for unit, outcome in results.items():
        key, layout = unit.rsplit("@", 1)
        table.setdefault(key, {})[layout] = outcome
    return {key: table[key] for key in keys}


def stderr_tail(out) -> str:
    lines = [line for line in (getattr(out, "stderr", "") or "").splitlines()
             if line.strip() and not line.startswith(("I0000", "W0000", "WARNING"))]
    return lines[-1][:200] if lines else ""


def _crashed(unit, tail, env, timeout) -> dict:
    """A unit whose child died, run alone twice more: ``crash`` when it dies every time,
    ``intermittent`` (with what it gave otherwise) when a run survives."""
    for _ in range(2):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", unit], cwd=ROOT,
                             capture_output=True, text=True, env=env, timeout=timeout)
        for line in out.stdout.splitlines():
            if line.startswith("RESULT\t"):
                survived = json.loads(line.split("\t", 2)[2])
                return {"outcome": "intermittent", "detail": f"the process died in 1 of up to 3 runs; "
                        f"otherwise {survived['outcome']}"}
    return {"outcome": "crash", "detail": tail}


def all_keys() -> list[str]:
    from tofu_tf import semantics
    return sorted(semantics.default_registry().op_types()) + list(SWEEP_KEYS)


def derive(keys=None) -> dict:
    """The table as checked in: TensorFlow's version, the layouts and each key's outcomes."""
    import tensorflow as tf
    keys = list(keys or all_keys())
    ops = probe(keys)
    return {"tensorflow": tf.__version__, "layouts": list(LAYOUTS), "sweep": list(SWEEP_KEYS), "ops": ops}


def render(table: dict) -> str:
    """The table as JSON, one op per line (diffs name the ops that changed)."""
    head = {k: v for k, v in table.items() if k != "ops"}
    lines = [json.dumps(head)[:-1] + ', "ops": {']
    rows = [f"  {json.dumps(key)}: {json.dumps(outcomes, sort_keys=True)}" for key, outcomes in table["ops"].items()]
    return "\n".join(lines + [",\n".join(rows), "}}"]) + "\n"


def main(argv) -> None:
    if argv[:1] == ["--child"]:
        _child(argv[1:])
        return
    options = dict(arg[2:].split("=", 1) if "=" in arg else (arg[2:], "") for arg in argv if arg.startswith("--"))
    keys = options["ops"].split(",") if options.get("ops") else None
    table = derive(keys)
    text = render(table)
    if "write" in options or options.get("out"):
        with open(options.get("out") or TABLE, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
