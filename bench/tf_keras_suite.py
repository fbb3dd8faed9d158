"""tf-keras's own distribution tests, run with TofuStrategy in place of MirroredStrategy.

tf-keras's ``tf_keras/distribute/*_test.py`` (keras-team/tf-keras; not installed with the
``tf_keras`` wheel) choose their strategies from ``tf.__internal__.distribute.combinations``'
named distributions. This script loads each test module from a tf-keras checkout (its imports
rewritten to the wheel's ``tf_keras.src`` layout, as tf-keras's own ``pip_build.py`` does), points
every multi-device MirroredStrategy distribution (``Mirrored2CPUs``, ``MirroredCPUAndGPU``,
``Mirrored2GPUs`` ...) at one strategy over 8 virtual CPUs, and runs the test cases that use one
of them in eager mode twice, each module in a subprocess of its own per strategy:

- the control: ``tf.distribute.MirroredStrategy`` over the 8 CPUs;
- ``TofuStrategy(8)``.

Test cases that differ only in which Mirrored distribution they name run once (they run the same
strategy here). The ratio counted is, of the cases the control passes, how many TofuStrategy
passes; cases TofuStrategy refuses by design (TensorFlow 1's per-replica input,
``make_input_fn_iterator``; TensorFlow 1 optimizers from ``tf.compat.v1.train``) are listed apart
and left out of it.

    python bench/tf_keras_suite.py --tf_keras_src=/path/to/tf-keras/tf_keras [--modules=a_test,b_test]
"""

import collections
import json
import os
import re
import subprocess
import sys
import time
import traceback
import types
import unittest

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_string("tf_keras_src", None, "a tf-keras checkout's tf_keras directory (holds distribute/*_test.py)")
flags.DEFINE_list("modules", [], "test modules to run (names without .py); all of distribute/*_test.py if empty")
flags.DEFINE_enum("strategies", "both", ["both", "tofu", "mirrored"], "which side(s) to run")
flags.DEFINE_integer("num_devices", 8, "virtual CPU devices")
flags.DEFINE_integer("module_timeout", 1800, "seconds one module may run under one strategy")
flags.DEFINE_string("filter", "", "a regular expression test ids must match (to rerun a few)")
flags.DEFINE_bool("show_failures", True, "list every TofuStrategy failure the control passes, with its error")
flags.DEFINE_string("json_out", "", "write every case's outcome under both strategies to this file")
flags.DEFINE_string("control_json", "", "take MirroredStrategy's outcomes from this earlier --json_out "
                    "(with --strategies=tofu)")
flags.DEFINE_string("tofu_json", "", "take TofuStrategy's outcomes from this earlier --json_out too: only the table")
# Internal: one module under one strategy, in a subprocess of its own.
flags.DEFINE_bool("tracebacks", False, "with --child: print each failing case's whole traceback on stderr")
flags.DEFINE_string("child", "", "internal: run --child_module under this strategy and print outcomes as JSON")
flags.DEFINE_string("child_module", "", "internal")
flags.DEFINE_string("child_skip_file", "", "internal: test ids (one a line) a restarted child skips")
FLAGS = flags.FLAGS

# The multi-device, single-worker MirroredStrategy distributions of
# tensorflow/python/distribute/strategy_combinations.py, by attribute.
_MIRRORED = ("mirrored_strategy_with_gpu_and_cpu", "mirrored_strategy_with_two_cpus",
             "mirrored_strategy_with_two_gpus", "mirrored_strategy_with_two_gpus_no_merge_call",
             "mirrored_strategy_with_cpu_1_and_2")

# Refusals by design: TofuStrategy runs one SPMD program over the global batch and plans from the
# optimizer's config; these name the supported way.
_BY_DESIGN = (("make_input_fn_iterator", "TF1 per-replica input (make_input_fn_iterator)"),
              ("TensorFlow 1 optimizer", "TF1 optimizer (tf.compat.v1.train)"))


def convert_imports(source: str) -> str:
    """tf-keras's source imports ``tf_keras.x``; the wheel holds it as ``tf_keras.src.x``
    (the rewrite of tf-keras's ``pip_build.py``)."""
    out, in_string = [], False
    for line in source.split("\n"):
        stripped = line.strip()
        if stripped.startswith('"""') or stripped.endswith('"""'):
            if line.count('"') % 2 == 1:
                in_string = not in_string
            out.append(line)
            continue
        if "tf_keras.protobuf" not in line:
            if stripped == "import tf_keras":
                line = line.replace("import tf_keras", "import tf_keras.src as tf_keras")
            else:
                line = line.replace("import tf_keras.", "import tf_keras.src.")
                line = line.replace("from tf_keras.", "from tf_keras.src.")
                line = line.replace("from tf_keras import", "from tf_keras.src import")
                line = line.replace("import tf_keras as ", "import tf_keras.src as ")
                line = line.replace('globals(), "tf_keras.', 'globals(), "tf_keras.src.')
        out.append(line)
    return "\n".join(out)


def _canonical(test_id: str, names) -> str:
    for name in names:
        test_id = test_id.replace(f"distribution_{name}", "distribution_Mirrored")
    return test_id


def _error_line(err_text: str) -> str:
    """The exception's type and the last line of its message (TensorFlow's "in user code"
    errors put the traceback of the traced function first and the message last); of an error
    with several root errors ("2 root error(s) found."), the first one's line."""
    lines = [line.strip() for line in err_text.strip().splitlines() if line.strip()]
    first_root = next((i for i, line in enumerate(lines) if line.startswith("(0)")), None)
    if first_root is not None and "root error(s) found" in lines[first_root - 1]:   # several: the first
        kind = lines[first_root - 1].split(":")[0]
        return f"{kind}: {lines[first_root][4:]}"[:400]
    kind = next((line.split(":")[0] for line in reversed(lines)
                 if re.match(r"^[\w.]+(Error|Exception|Failure|Exit)\b", line)), "")
    last = lines[-1] if lines else ""
    return (last if last.startswith(kind) else f"{kind}: {last}")[:400]


def _load(module, path) -> None:
    with open(path) as f:
        source = convert_imports(f.read())
    module.__file__ = path
    sys.modules[module.__name__] = module
    exec(compile(source, path, "exec"), module.__dict__)   # pylint: disable=exec-used


class _SiblingTests:
    """Imports of another test module (``keras_utils_test`` imports ``distribute_strategy_test``),
    which the wheel does not hold, from the checkout."""

    _PREFIX = "tf_keras.src.distribute."

    def __init__(self, src):
        self.src = src

    def find_spec(self, name, path=None, target=None):  # pylint: disable=unused-argument
        import importlib.util
        leaf = name[len(self._PREFIX):] if name.startswith(self._PREFIX) else ""
        file = os.path.join(self.src, "distribute", leaf + ".py")
        if not leaf.endswith("_test") or not os.path.exists(file):
            return None
        return importlib.util.spec_from_loader(name, self, origin=file)

    def create_module(self, spec):  # pylint: disable=unused-argument
        return None

    def exec_module(self, module):
        source = convert_imports(open(module.__spec__.origin).read())
        module.__file__ = module.__spec__.origin
        exec(compile(source, module.__file__, "exec"), module.__dict__)   # pylint: disable=exec-used


def _run_child(strategy_name: str, module_name: str) -> None:
    sys.path.insert(0, ROOT)
    os.environ["TOFU_PLAN_CACHE"] = "off"
    from tofu_tf.tf import devices
    devices.configure_virtual_cpus(FLAGS.num_devices)
    import tensorflow as tf
    from tensorflow.python.distribute import strategy_combinations as combos

    def make():
        if strategy_name == "tofu":
            from tofu_tf import TofuStrategy
            return TofuStrategy(FLAGS.num_devices)
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(FLAGS.num_devices)])

    from tensorflow.python.distribute import combinations as tf_combinations
    names, patched = [], []
    for attr in _MIRRORED:
        named = getattr(combos, attr)
        named._distribution_fn = make   # pylint: disable=protected-access
        names.append(named._name)        # pylint: disable=protected-access
        patched.append(named)
    # The test modules choose strategies by their GPU needs (``required_gpus``) when they build
    # their cases, so those stay; the check that skips a case without GPUs lets these run.
    gpu_check = tf_combinations.GPUCombination.should_execute_combination

    def should_execute(self, kwargs):
        given = [v for v in kwargs.values() if isinstance(v, tf_combinations.NamedDistribution)]
        if given and all(any(v is p for p in patched) for v in given):
            return True, None
        return gpu_check(self, kwargs)

    tf_combinations.GPUCombination.should_execute_combination = should_execute
    sys.meta_path.insert(0, _SiblingTests(FLAGS.tf_keras_src))
    path = os.path.join(FLAGS.tf_keras_src, "distribute", module_name + ".py")
    module = types.ModuleType(module_name)
    results = []
    try:
        _load(module, path)
    except Exception:  # pylint: disable=broad-except
        print("RESULT " + json.dumps({"id": module_name + ".<import>", "outcome": "import_error",
                                      "message": _error_line(traceback.format_exc())}), flush=True)
        return
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    seen = set()

    def cases(s):
        for t in s:
            if isinstance(t, unittest.TestSuite):
                yield from cases(t)
            else:
                yield t

    pattern = re.compile(FLAGS.filter) if FLAGS.filter else None
    skip = set()
    if FLAGS.child_skip_file:
        with open(FLAGS.child_skip_file) as f:
            skip = set(f.read().split())
    after_async_error = False
    for case in cases(suite):
        test_id = case.id()
        if not any(f"distribution_{name}" in test_id for name in names) or "mode_graph" in test_id:
            continue
        canonical = _canonical(test_id, names)
        if canonical in seen or (pattern and not pattern.search(canonical)):
            continue
        seen.add(canonical)
        if canonical in skip:
            continue
        print("START " + canonical, flush=True)
        result = unittest.TestResult()
        start = time.time()
        case.run(result)
        if after_async_error and _cancelled(result):
            result = unittest.TestResult()          # cancelled by the last case's error: run it again
            case.run(result)
        after_async_error = _wait_for_pending(case, result)
        if result.errors or result.failures:
            outcome, message = "fail", _error_line((result.errors + result.failures)[0][1])
            if FLAGS.tracebacks:
                print(f"{canonical}\n{(result.errors + result.failures)[0][1]}", file=sys.stderr, flush=True)
        elif result.skipped:
            outcome, message = "skip", result.skipped[0][1][:200]
        elif result.expectedFailures:
            outcome, message = "xfail", ""
        else:
            outcome, message = "pass", ""
        results.append(canonical)
        print("RESULT " + json.dumps({"id": canonical, "outcome": outcome, "message": message,
                                      "seconds": round(time.time() - start, 1)}), flush=True)


def _wait_for_pending(case, result) -> bool:
    """Wait for what ``case`` left running: DTensor runs programs asynchronously (its device's
    ``is_async``), so an error raised inside a case's last program reaches the next op that waits
    on it, in the next case. It is counted as the case's own failure. True when there was one:
    DTensor then cancels the next program it is given ("Function was cancelled before it was
    started"), so the next case runs again when that is how it failed (``_cancelled``)."""
    from tensorflow.python.eager import context
    try:
        context.async_wait()
    except Exception:  # pylint: disable=broad-except
        if not (result.errors or result.failures):
            result.addError(case, sys.exc_info())
        return True
    return False


def _cancelled(result) -> bool:
    return any("cancelled before it was started" in text or "CancelledError" in text
               for _, text in result.errors + result.failures)


def _run_module(strategy_name: str, module_name: str) -> dict:
    """The module's cases under one strategy, in a subprocess; where the process dies (DTensor
    aborts the process on some errors) or times out, the case it was running is recorded as a
    crash and a new process runs the cases after it."""
    import tempfile
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TOFU_PLAN_CACHE="off")
    outcomes = {}
    for _ in range(20):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as skip_file:
            skip_file.write("\n".join(outcomes))
        cmd = [sys.executable, os.path.abspath(__file__), f"--child={strategy_name}", f"--child_module={module_name}",
               f"--tf_keras_src={FLAGS.tf_keras_src}", f"--num_devices={FLAGS.num_devices}",
               f"--child_skip_file={skip_file.name}"]
        if FLAGS.filter:
            cmd.append(f"--filter={FLAGS.filter}")
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=FLAGS.module_timeout,
                                  check=False)
            stdout, crashed = proc.stdout, proc.returncode != 0
            tail = proc.stderr.strip().splitlines()[-1:] if crashed else []
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            crashed, tail = True, [f"timed out after {FLAGS.module_timeout} s"]
        finally:
            os.unlink(skip_file.name)
        started = None
        for line in stdout.splitlines():
            if line.startswith("START "):
                started = line[len("START "):]
            elif line.startswith("RESULT "):
                record = json.loads(line[len("RESULT "):])
                outcomes[record["id"]] = record
                started = None
        if not crashed:
            break
        key = started or f"{module_name}.<crash>"
        outcomes[key] = {"id": key, "outcome": "crash", "message": " ".join(tail)[:400]}
        if started is None:      # died outside a case (its import): nothing to resume
            break
    return outcomes


def _modules() -> list:
    if FLAGS.modules:
        return FLAGS.modules
    folder = os.path.join(FLAGS.tf_keras_src, "distribute")
    return sorted(name[:-3] for name in os.listdir(folder) if name.endswith("_test.py"))


def main(argv):
    del argv
    if FLAGS.child:
        _run_child(FLAGS.child, FLAGS.child_module)
        return
    if not FLAGS.tf_keras_src or not os.path.isdir(os.path.join(FLAGS.tf_keras_src, "distribute")):
        raise app.UsageError("--tf_keras_src: a tf-keras checkout's tf_keras directory (with distribute/*_test.py)")
    sides = ["mirrored", "tofu"] if FLAGS.strategies == "both" else [FLAGS.strategies]
    control = None
    if FLAGS.control_json:
        if "mirrored" in sides:
            raise app.UsageError("--control_json gives MirroredStrategy's outcomes: pass --strategies=tofu with it")
        with open(FLAGS.control_json) as f:
            control = json.load(f)
        sides = sides + ["mirrored"]
    earlier = None
    if FLAGS.tofu_json:
        with open(FLAGS.tofu_json) as f:
            earlier = json.load(f)
    rows, everything = [], {}
    totals = collections.Counter()
    by_design_all, failures_all = [], []
    for module_name in _modules():
        start = time.time()
        if earlier is not None:
            got = {"tofu": earlier.get(module_name, {}).get("tofu", {})}
        else:
            got = {side: _run_module(side, module_name) for side in sides if control is None or side != "mirrored"}
        if control is not None:
            got["mirrored"] = control.get(module_name, {}).get("mirrored", {})
        everything[module_name] = got
        mirrored, tofu = got.get("mirrored", {}), got.get("tofu", {})
        ids = sorted(set(mirrored) | set(tofu))
        control_pass = [i for i in ids if mirrored.get(i, {}).get("outcome") == "pass"] if mirrored else \
            [i for i in ids if not i.endswith(">")]
        by_design = []
        for i in control_pass:
            record = tofu.get(i, {})
            if record.get("outcome") != "pass":
                reason = next((label for needle, label in _BY_DESIGN if needle in record.get("message", "")), None)
                if reason:
                    by_design.append((i, reason))
        counted = [i for i in control_pass if i not in dict(by_design)]
        tofu_pass = [i for i in counted if tofu.get(i, {}).get("outcome") == "pass"]
        for i in counted:
            if i not in tofu_pass:
                failures_all.append((i, tofu.get(i, {}).get("outcome", "not run (crash)"), tofu.get(i, {}).get("message", "")))
        by_design_all += by_design
        row = dict(module=module_name, cases=len(ids), control=len(control_pass), by_design=len(by_design),
                   counted=len(counted), tofu=len(tofu_pass), seconds=time.time() - start,
                   notes="; ".join(f"{side}: {r['message'][:80]}" for side in sides
                                   for r in got.get(side, {}).values() if r["outcome"] in ("crash", "import_error")))
        rows.append(row)
        for key in ("cases", "control", "by_design", "counted", "tofu"):
            totals[key] += row[key]
        print(f"{module_name}: {row['tofu']}/{row['counted']} ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
    print("| module | cases (eager, Mirrored) | control passes | refused by design | counted | TofuStrategy passes | notes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["cases"] or r["notes"]:
            print(f"| {r['module']} | {r['cases']} | {r['control']} | {r['by_design']} | {r['counted']} | {r['tofu']} "
                  f"| {r['notes']} |")
    ratio = totals["tofu"] / totals["counted"] if totals["counted"] else float("nan")
    print(f"| **all** | {totals['cases']} | {totals['control']} | {totals['by_design']} | {totals['counted']} "
          f"| {totals['tofu']} | **{ratio:.1%}** |")
    if FLAGS.show_failures:
        print("\nRefused by design:")
        for i, reason in by_design_all:
            print(f"- {i}: {reason}")
        print("\nTofuStrategy failures (the control passes):")
        for i, outcome, message in failures_all:
            print(f"- {i} [{outcome}]: {message}")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    app.run(main)
