"""Train one family of ``tofu_tf.hub_families`` under TofuStrategy beside one device, in a child process.

Issue #37 asks that every keras-hub backbone family either trains under
TofuStrategy as it does on one device, or is refused before its first step by a
``TofuError`` naming the layer, the op and what works instead; never that it fails
inside TensorFlow. This module measures which, one family at a time:

* ``run_family(name)``, in this process: the family's model trains ``steps``
  steps on one device and under ``TofuStrategy(num_devices)`` from the same
  initial weights (SGD with momentum, as tests/test_zoo.py does and says why),
  then evaluates and predicts a partial last batch on both; the result is a
  dict with a ``status``;
* ``run_in_subprocess(name)``: the same in a fresh Python (DTensor can abort
  the process: a crash is a result, ``crash``), under a timeout (``timeout``).

Statuses: ``trains`` (losses within 1e-5 relative, evaluation 1e-5, predictions
1e-4); ``refused`` (a ``TofuError`` before the first step; its text is kept);
``differs`` (it ran and its numbers differ from one device's, in float64 too);
``rounding`` (fp32 numbers differ beyond those tolerances, and the same run in float64
agrees with one device to 1e-10: rounding that BatchNorm over a few values per channel
amplifies, as in tf_keras' ResNet50 at 32x32, not a different computation; the float32 run
then also says how far one device moves from itself when every weight moves by one ulp,
the size of difference such a model makes of rounding alone); ``fails`` (any
other exception, or a refusal after the first step); ``crash``; ``timeout``;
``not built`` (the family's entry says why it is not built small). Run one
family by hand with ``python -m tofu_tf.strategies.hub_sweep gpt2``; ``bench/zoo.py --all``
prints the whole sweep.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

RESULT = "HUB_SWEEP_RESULT "
PASSING = frozenset({"trains", "rounding", "refused", "not built"})
LOSS_RTOL, EVAL_RTOL, PREDICT_TOL = 1e-5, 1e-5, 1e-4
# In float64 (``rounding``'s check) the sides agree to about 1e-16 where the math is the same.
TOLERANCES = {"float32": (LOSS_RTOL, EVAL_RTOL, PREDICT_TOL), "float64": (1e-10, 1e-10, 1e-9)}


def _framework(entry):
    if entry.framework == "tf_keras":
        import tf_keras
        return tf_keras
    import keras
    return keras


def _compile(model, keras, learning_rate=0.05):
    """SGD with momentum and one loss; no metrics (keras-hub tasks' "auto" metrics assume
    their preprocessors' labels: a segmenter's accuracy breaks on per-pixel ones)."""
    model.compile(optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=[],
                  weighted_metrics=[])


def _fit(model, x, y, batch, keras):
    """(per-step losses, first fit seconds, per-step seconds); ``steps_done`` on the callback
    tells how many steps ended before an exception."""
    class Steps(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.losses, self.ends = [], []

        def on_train_begin(self, logs=None):
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, step, logs=None):
            self.ends.append(time.perf_counter())
            self.losses.append(float(logs["loss"]))
    steps = Steps()
    start = time.perf_counter()
    try:
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[steps])
    except Exception as error:          # noqa: BLE001 (the caller classifies it)
        error.steps_done = len(steps.losses)
        raise
    return steps.losses, time.perf_counter() - start, [b - a for a, b in zip(steps.ends, steps.ends[1:])]


def state_bytes(model):
    """(total bytes, largest per-device bytes) of the weights and optimizer variables as placed."""
    total = per_device = 0
    slots = model.optimizer.variables
    for variable in list(model.weights) + list(slots() if callable(slots) else slots):
        value = getattr(variable, "value", variable)
        if callable(value):         # tf_keras: the variable itself (its value is a method)
            value = variable
        nbytes = value.shape.num_elements() * value.dtype.size
        layout = getattr(value, "layout", None)
        shards = 1
        if layout is not None:
            sizes = dict(zip(layout.mesh.dim_names, layout.mesh.shape()))
            for axis in layout.sharding_specs:
                shards *= sizes.get(axis, 1)
        total += nbytes
        per_device += nbytes // shards
    return total, per_device


def _first_line(error) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:400] if text else ''}"


def _close(got, want, rtol, atol=0.0) -> bool:
    import numpy as np
    if hasattr(got, "flat_values") or hasattr(want, "flat_values"):
        # ragged: CLIP-style logits over each batch's own texts (8x8, then 5x5)
        if not (hasattr(got, "flat_values") and hasattr(want, "flat_values")):
            return False
        return (np.array_equal(got.nested_row_lengths()[0], want.nested_row_lengths()[0])
                and _close(got.flat_values, want.flat_values, rtol, atol))
    got, want = np.asarray(got, "float64"), np.asarray(want, "float64")
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=rtol, atol=atol))


def run_family(name: str, *, width: int = 32, steps: int = 2, batch: int = 8, num_devices: int = 8,
               learning_rate: float = 0.05, floatx: str = "float32") -> dict:
    """Train, evaluate and predict family ``name`` on one device and under TofuStrategy; the
    module docstring lists the statuses of the dict returned."""
    from tofu_tf import hub_families
    entry = hub_families.SWEEP[name]
    result = {"family": name, "backbone": entry.backbone}
    if entry.skip:
        return dict(result, status="not built", detail=entry.skip)
    from tofu_tf.tf import devices
    devices.provide_devices(num_devices)
    from tofu_tf.errors import TofuError
    from tofu_tf.strategies import TofuStrategy
    keras = _framework(entry)
    keras.backend.set_floatx(floatx)
    loss_rtol, eval_rtol, predict_tol = TOLERANCES[floatx]

    try:
        keras.utils.set_random_seed(3)
        reference = entry.build(width)
        initial = reference.get_weights()
        data = x, y, x_eval, y_eval, x_predict = _data(entry, reference, batch, steps)
        result["params"] = int(reference.count_params())
        _compile(reference, keras, learning_rate)
        expected, one_first, one_steps = _fit(reference, x, y, batch, keras)
    except Exception as error:          # noqa: BLE001 (the family, not the strategy, fails)
        return dict(result, status="fails", phase="one device", error=type(error).__name__,
                    detail="on one device: " + _first_line(error))

    strategy = TofuStrategy(num_devices)
    phase = "build"
    try:
        with strategy.scope():
            model = entry.build(width)
            model.set_weights(initial)
            _compile(model, keras, learning_rate)
        phase = "fit"
        losses, first, step_times = _fit(model, x, y, batch, keras)
        trained = [w.numpy() if hasattr(w, "numpy") else w for w in reference.get_weights()]
        # Evaluated and predicted from the weights both sides hold after training, the strategy's: two
        # SGD steps carry one device's rounding differences along (large-logit families such as EdRec
        # and RetinaNet by 1e-5 of their weights), and the partial batches are compared here, not those.
        reference.set_weights(model.get_weights())
        expected_eval = reference.evaluate(x_eval, y_eval, batch_size=batch, verbose=0)
        expected_predict = reference.predict(x_predict, batch_size=batch, verbose=0)
        phase = "evaluate"
        evaluated = model.evaluate(x_eval, y_eval, batch_size=batch, verbose=0)
        phase = "predict"
        predicted = model.predict(x_predict, batch_size=batch, verbose=0)
    except Exception as error:          # noqa: BLE001 (classified here: the sweep's purpose)
        before_first_step = phase == "build" or (phase == "fit" and getattr(error, "steps_done", 0) == 0)
        refused = isinstance(error, TofuError) and before_first_step
        return dict(result, status="refused" if refused else "fails", phase=phase, error=type(error).__name__,
                    detail=str(error).strip()[:2000] if refused else _first_line(error))
    total, per_device = state_bytes(model)
    import numpy as np
    result["weights_max_abs_diff"] = max((float(np.max(np.abs(np.asarray(g, "float64") - np.asarray(w, "float64"))))
                                          for g, w in zip(model.get_weights(), trained) if np.size(w)),
                                         default=0.0)
    result.update(
        losses=losses, expected=expected, mesh=dict(strategy.plan.mesh_shape),
        sharded=1 - per_device / total if total else 0.0, state_per_device=per_device / total if total else 1.0,
        first_fit_s=first, one_first_fit_s=one_first,
        steady_s=statistics.median(step_times[min(2, len(step_times) - 1):]),
        one_steady_s=statistics.median(one_steps[min(2, len(one_steps) - 1):]))
    mismatches = []
    if not _close(losses, expected, loss_rtol):
        mismatches.append(f"losses {losses} vs one device {expected}")
    if not _close(evaluated, expected_eval, eval_rtol):
        mismatches.append(f"evaluate {evaluated} vs one device {expected_eval}")
    if not _close(predicted, expected_predict, predict_tol, predict_tol):
        mismatches.append(f"predict (shape {getattr(predicted, 'shape', None)}) differs from one device's "
                          f"(shape {getattr(expected_predict, 'shape', None)})")
    result["status"] = "differs" if mismatches else "trains"
    if mismatches:
        result["detail"] = "; ".join(mismatches) + _reproducible(entry, width, initial, x_predict, batch)
    if mismatches and floatx == "float32":
        gap = {"losses": _difference(losses, expected), "evaluate": _difference(evaluated, expected_eval),
               "predict": _difference(predicted, expected_predict)}
        spread = one_ulp_spread(entry, width, keras, learning_rate, batch, initial, data)
        result.update(float32_gap=gap, one_ulp_spread=spread)
        result["detail"] += ("; one device against itself with every weight one ulp away: " + ", ".join(
            f"{key} {spread[key]:.1e} (TofuStrategy {gap[key]:.1e})" for key in gap if gap[key] > 0))
    return result


def _data(entry, reference, batch: int, steps: int) -> tuple:
    """(x, y, x_eval, y_eval, x_predict): ``steps`` training batches, then an evaluation set with
    a last batch of 3 and a prediction set with a last batch of 5."""
    from tofu_tf import hub_families
    x = hub_families.features(entry, reference, batch * steps)
    x_eval = hub_families.features(entry, reference, batch + 3, seed=1)
    x_predict = hub_families.features(entry, reference, batch + 5, seed=2)
    out = reference.predict(hub_families.features(entry, reference, batch, seed=3), verbose=0)
    in_batch = batch if entry.in_batch_labels else 0
    y = hub_families.labels(out.shape, batch * steps, in_batch=in_batch)
    y_eval = hub_families.labels(out.shape, batch + 3, seed=1, in_batch=in_batch)
    return x, y, x_eval, y_eval, x_predict


def _difference(got, want) -> float:
    """The largest difference of two results, relative where they are over 1: the scale the
    tolerances above measure, as one number (``inf`` where the shapes differ)."""
    import numpy as np
    got, want = (value.flat_values if hasattr(value, "flat_values") else value for value in (got, want))
    got, want = np.asarray(got, "float64"), np.asarray(want, "float64")
    if got.shape != want.shape:
        return float("inf")
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1.0), initial=0.0))


def one_ulp_spread(entry, width, keras, learning_rate, batch, initial, data) -> dict:
    """How far one device's own results move when every weight moves by one ulp (up, then down;
    the larger of the two), by the measure of ``_difference``: {"losses", "evaluate", "predict"}.

    A sharded step sums in another order than one device, a rounding-sized change in every op;
    where a model amplifies such changes (BatchNorm over a few values per channel, a loss that
    jumps in one SGD step), one device moves as far from itself as the strategy moves from it,
    and this says how far. Training starts from ``initial`` moved; evaluation and prediction use
    the weights one device trained to, moved (the sweep compares those at equal weights too)."""
    import numpy as np
    x, y, x_eval, y_eval, x_predict = data

    def run(model, weights, train):
        model.set_weights(weights)
        if not train:
            return None, model.evaluate(x_eval, y_eval, batch_size=batch, verbose=0), \
                model.predict(x_predict, batch_size=batch, verbose=0)
        _compile(model, keras, learning_rate)
        return _fit(model, x, y, batch, keras)[0], None, None

    reference = entry.build(width)
    losses, _, _ = run(reference, initial, train=True)
    trained = reference.get_weights()
    _, evaluated, predicted = run(reference, trained, train=False)
    spread = {"losses": 0.0, "evaluate": 0.0, "predict": 0.0}
    for direction in (np.inf, -np.inf):
        def moved(weights):
            return [np.nextafter(w, np.asarray(direction, w.dtype)) if np.asarray(w).dtype.kind == "f" else w
                    for w in weights]
        moved_losses, _, _ = run(entry.build(width), moved(initial), train=True)
        _, moved_evaluated, moved_predicted = run(reference, moved(trained), train=False)
        spread = {"losses": max(spread["losses"], _difference(moved_losses, losses)),
                  "evaluate": max(spread["evaluate"], _difference(moved_evaluated, evaluated)),
                  "predict": max(spread["predict"], _difference(moved_predicted, predicted))}
    return spread


def _reproducible(entry, width, initial, x, batch) -> str:
    """Whether two one-device builds given the same weights predict alike: a family that does
    not (state outside its weights) cannot be compared with one device at all."""
    first, second = entry.build(width), entry.build(width)
    first.set_weights(initial)
    second.set_weights(initial)
    if _close(first.predict(x, batch_size=batch, verbose=0), second.predict(x, batch_size=batch, verbose=0),
              PREDICT_TOL, PREDICT_TOL):
        return ""
    return (" (but two one-device builds given the same weights predict differently too: the model "
            "computes from state outside its weights, so it cannot be compared with one device)")


def run_in_subprocess(name: str, *, timeout: float = 600, **options) -> dict:
    """``run_family(name, **options)`` in a fresh Python: a process DTensor aborts is ``crash``,
    one that outlives ``timeout`` seconds ``timeout``; a float32 run that ``differs`` runs again
    in float64, and is ``rounding`` where that one trains."""
    result = _child(name, timeout, options)
    if result["status"] == "differs" and options.get("floatx", "float32") == "float32":
        wide = _child(name, timeout, dict(options, floatx="float64"))
        if wide["status"] == "trains":
            result = dict(result, status="rounding", detail=f"float32: {result['detail']}; float64 trains as one "
                          f"device (losses within 1e-10, weights within {wide['weights_max_abs_diff']:.0e})")
        else:
            result["detail"] += f"; float64: {wide['status']}: {wide.get('detail')}"
    return result


def _child(name, timeout, options) -> dict:
    args = [sys.executable, "-m", "tofu_tf.strategies.hub_sweep", name, "--json"]
    args += [f"--{key}={value}" for key, value in options.items()]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TOFU_PLAN_CACHE="off")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    except subprocess.TimeoutExpired:
        return {"family": name, "status": "timeout", "detail": f"no result within {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-3:]
    status = "crash" if done.returncode < 0 or done.returncode > 128 else "fails"
    return {"family": name, "status": status, "detail": f"exit {done.returncode}: " + " | ".join(tail)[-600:]}


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--num_devices", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--floatx", default="float32", choices=sorted(TOLERANCES))
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TOFU_PLAN_CACHE", "off")
    result = run_family(args.family, width=args.width, steps=args.steps, batch=args.batch,
                        num_devices=args.num_devices, learning_rate=args.learning_rate, floatx=args.floatx)
    print(RESULT + json.dumps(result) if args.json else json.dumps(result, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
