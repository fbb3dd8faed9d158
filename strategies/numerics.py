"""A numerics check users run: does the sharded model compute what one device computes?

``TofuStrategy.check_numerics(model, x, y, steps=1)`` trains ``steps`` steps of a compiled
model under the strategy, sharded, and the same steps on one device (the host CPU), both
from the model's current weights and optimizer state, and compares the weights after
them, variable by variable. Then it puts the sharded model back where it was (weights,
optimizer slots, the step counters), so the check does not change the user's run.
Users of model-parallel systems ask for such a check (Megatron-LM#7452); the test suite
has always made this comparison (``tests/strategy_helpers.py``).

The one-device copy is built from the model's config outside the strategy's scope and
fed the sharded model's values one variable at a time through the host
(``TofuVariable.numpy`` assembles each from its shards). Both sides run Keras' own
``fit``, one batch per call, so each step's loss is that step's.

Two things differ without anything being wrong, and the report says which:

* A variable whose gradient is zero in exact arithmetic (a Dense bias feeding a
  BatchNormalization, a key bias under softmax attention) receives rounding noise as
  its gradient, different noise on each side. An optimizer that normalizes the
  gradient (Adam-like) magnifies that noise, up to steps of the full learning rate
  once the noise is above the optimizer's epsilon; under SGD the variable moves by
  noise-sized steps, as large as the variable itself when it started at zero. ``_NOISE_GRADIENT``
  says how it is recognized; such variables are reported and left out of the verdict.
* Nothing else: dropout masks are the same on both sides. The strategy draws a mask's noise
  unsplit, so it does not depend on the plan (``tofu_tf.tf.compat.random_draws``); the copy
  starts from the same seeds (a Keras 3 model's SeedGenerator states are copied with the
  weights) and a tf-keras copy draws its masks as the strategy does, statelessly from the
  layer's seed and the step (``tofu_tf.tf.compat.layers.same_masks_in_copy``), where plain
  tf-keras would draw them from a stateful stream no sharded run can follow. So a model with
  dropout is compared against a one-device run of it with the masks TofuStrategy draws.

This module owns the check and its report. It does not plan, lower, or run steps of
its own: the model is planned through the strategy's normal path and trained by Keras.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Callable, Mapping

import numpy as np
import tensorflow as tf
from absl import logging

from tofu_tf.errors import TofuError
from tofu_tf.plan import format_bytes
from tofu_tf.strategies import keras_hooks
from tofu_tf.tf import keras_adapter
from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf.compat import layers as compat_layers

# A gradient this small relative to its weight's scale is rounding noise:
# |g| <= _NOISE_GRADIENT * max(1, |w|) (Frobenius norms, float32 weights). float32
# carries a relative precision of 2^-23 (1.2e-7); a gradient that is zero in exact
# arithmetic comes out as the residue of terms that cancel, a few units of that
# precision at the scale of the values the step computes with. 1e-6 is about 8 such
# units: above the residue of a cancellation, and below any gradient that could move
# the weight under SGD (an update lr * g that small is within a few roundings of the
# weight itself, for lr <= 1). The floor of 1 keeps a weight that starts at zero (a
# bias) on the scale of the unit-sized activations and gradients it is trained with.
_NOISE_GRADIENT = 1e-6

# Optimizers whose step divides the gradient by a running measure of its own size
# (or takes its sign): a gradient of pure rounding noise takes a step of up to the
# learning rate.
_NORMALIZING_OPTIMIZERS = frozenset({"Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Lion", "Adafactor",
                                     "Lamb", "Muon"})


class NumericsCheckError(TofuError, ValueError):
    """The numerics check cannot run as called (what to change is in the message)."""


class HostMemoryError(TofuError, MemoryError):
    """The host cannot hold the one-device copy the numerics check needs."""


@dataclasses.dataclass(frozen=True)
class VariableDifference:
    """One weight after the steps, sharded against one device.

    ``max_relative`` is the largest elementwise difference over the largest magnitude
    of the one-device value: elementwise ratios are ruled by elements near zero (a
    bias that starts at zero), the variable's scale is not.
    """

    path: str
    layout: str                  # the sharded variable's layout, "(-, model)"
    max_abs: float
    max_relative: float
    gradient_norm: float | None  # at the first batch on one device; None when untrainable or unconnected
    noise_gradient: bool         # that gradient is rounding noise (zero in exact arithmetic)
    noise_driven: bool           # ... and the optimizer normalizes it into full-size steps


@dataclasses.dataclass(frozen=True)
class RandomLayer:
    """A layer that draws random values in training (dropout and kin)."""

    path: str
    kind: str
    rate: float | None           # None: random at every call (RandomFlip and other augmentations)

    @property
    def active(self) -> bool:
        return self.rate is None or self.rate > 0


@dataclasses.dataclass(frozen=True)
class NumericsReport:
    """What ``TofuStrategy.check_numerics`` found. ``summary()`` is the text a person reads."""

    steps: int
    batch_size: int
    optimizer: str
    normalizes_gradient: bool
    mesh: str
    losses_sharded: tuple[float, ...]
    losses_one_device: tuple[float, ...]
    by_variable: Mapping[str, VariableDifference]
    random_layers: tuple[RandomLayer, ...]

    @property
    def worst_first(self) -> list[VariableDifference]:
        return sorted(self.by_variable.values(), key=lambda d: (-d.max_relative, d.path))

    @property
    def max_relative_difference(self) -> float:
        """The largest ``max_relative`` of the variables whose gradient is not rounding noise.

        A variable whose gradient is zero in exact arithmetic changes by noise on both
        sides: by full steps under an Adam-like optimizer, by noise-sized ones under SGD,
        which relative to a weight that started at zero (a key bias) is as large as the
        weight. Its row in ``by_variable`` still says how far apart the two sides are."""
        return max((d.max_relative for d in self.by_variable.values() if not d.noise_gradient), default=0.0)

    @property
    def random_masks(self) -> bool:
        """Whether the comparison includes random draws (an active dropout layer)."""
        return any(layer.active for layer in self.random_layers)

    def loss_relative_differences(self) -> list[float]:
        return [_relative(abs(a - b), abs(b)) for a, b in zip(self.losses_sharded, self.losses_one_device)]

    def ok(self, rtol: float = 1e-5) -> bool:
        """Every step's loss and every variable whose gradient is not rounding noise agree
        within ``rtol``. Dropout layers draw the same masks on both sides (the module docstring)."""
        return self.max_relative_difference <= rtol and all(r <= rtol for r in self.loss_relative_differences())

    def summary(self) -> str:
        """Losses of each step on both sides, then every variable, worst first."""
        lines = [f"Numerics check: {self.steps} step(s) of {self.optimizer} at batch {self.batch_size}, "
                 f"sharded on mesh {self.mesh} vs one device (host CPU)",
                 f"  {'step':>4}  {'loss sharded':>14}  {'loss one device':>15}  {'rel. diff':>9}"]
        for step, (a, b, r) in enumerate(zip(self.losses_sharded, self.losses_one_device,
                                             self.loss_relative_differences()), start=1):
            lines.append(f"  {step:>4}  {a:>14.7g}  {b:>15.7g}  {r:>9.2e}")
        rows = self.worst_first
        width = max([len("variable")] + [len(d.path) for d in rows])
        layout_width = max([len("layout")] + [len(d.layout) for d in rows])
        lines.append(f"  {'variable':<{width}}  {'layout':<{layout_width}}  {'max abs':>9}  {'max rel':>9}  note")
        for d in rows:
            note = ("rounding noise, normalized by the optimizer" if d.noise_driven
                    else "gradient is rounding noise" if d.noise_gradient else "")
            lines.append(f"  {d.path:<{width}}  {d.layout:<{layout_width}}  {d.max_abs:>9.2e}  "
                         f"{d.max_relative:>9.2e}  {note}".rstrip())
        noise = [d.path for d in rows if d.noise_gradient]
        if noise:
            effect = (f"{self.optimizer} normalizes the gradient, magnifying that noise on each side"
                      if self.normalizes_gradient else "each side steps by its own noise")
            lines.append(f"  note: {', '.join(noise)}: gradient zero in exact arithmetic (|g| <= "
                         f"{_NOISE_GRADIENT:g} x max(1, |w|) on one device); {effect}: expected, not a bug; "
                         "left out of the max relative difference and ok()")
        if self.random_layers:
            described = ", ".join(f"{layer.path} ({layer.kind}"
                                  + ("" if layer.rate is None else f", rate {layer.rate:g}") + ")"
                                  for layer in self.random_layers)
            lines.append(f"  random layers: {described}")
            if self.random_masks:
                lines.append("  note: the comparison includes random masks, the same on both sides: the one-device "
                             "copy draws them as TofuStrategy does (same seeds and step, drawn whole)")
        lines.append(f"  ok at rtol=1e-05: {self.ok()}  (max relative difference "
                     f"{self.max_relative_difference:.2e})")
        return "\n".join(lines)


def check_numerics(strategy, model, x, y, *, steps: int = 1, batch_size: int | None = None,
                   max_host_bytes: int | None = None, clone: Callable | None = None) -> NumericsReport:
    """Train ``steps`` batches of ``x``, ``y`` sharded and on one device, compare, restore.

    ``batch_size``: default ``len(x) // steps``. ``max_host_bytes``: the host memory the
    check may use (default: what the host has free). ``clone``: a function building the
    same model, for a model that cannot be rebuilt from its config (a subclassed model
    without ``get_config``); called outside the strategy's scope. An unplanned model is
    planned first (``plan_model``), and an optimizer that has not made its slots makes
    them (as its first step would); they are left at their initial values.
    """
    if steps < 1:
        raise NumericsCheckError(f"check_numerics needs steps >= 1, got {steps}")
    if tf.distribute.has_strategy():
        raise NumericsCheckError(
            "check_numerics builds a one-device copy of the model, which must be made outside "
            "strategy.scope(): call it after the `with strategy.scope():` block")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise NumericsCheckError(f"{model.name} is not compiled: compile it under strategy.scope() first")
    batches = _batches(x, y, steps, batch_size)
    batch_size = _num_samples(batches[0][0])
    if strategy.plan is None:
        strategy.plan_model(model, batch_size=batch_size, features=batches[0][0])
    if not keras_adapter.optimizer_built(optimizer):
        _check_host_memory(_State.of(model), model, max_host_bytes, slots_made=False)
        with strategy.scope():
            optimizer.build(keras_adapter.trainable_variables(model))
    state = _State.of(model)
    _check_host_memory(state, model, max_host_bytes)
    snapshot = [_host_value(v) for v in state.variables]
    try:
        reference = _one_device_copy(model, clone, state, snapshot, batches[0][0])
        gradients = _gradient_norms(reference, model, batches[0], snapshot[:len(state.weights)])
        for variable, value in zip(keras_adapter.seed_states(reference), snapshot[len(snapshot) - len(state.seeds):]):
            _assign_from_host(variable, value)      # the gradients' forward pass drew masks: back to the model's
        with tf.device("/CPU:0"):
            losses_one_device = _train(reference, batches)
        history = getattr(model, "history", None)
        losses_sharded = _train(model, batches)
        if hasattr(model, "history"):
            model.history = history
        differences = _differences(model, reference, gradients, _normalizes(optimizer))
    finally:
        for variable, value in zip(state.variables, snapshot):
            _assign_from_host(variable, value)
    return NumericsReport(
        steps=steps, batch_size=batch_size, optimizer=type(_inner(optimizer)).__name__,
        normalizes_gradient=_normalizes(optimizer), mesh=_mesh_text(strategy.plan),
        losses_sharded=tuple(losses_sharded), losses_one_device=tuple(losses_one_device),
        by_variable=types.MappingProxyType(differences), random_layers=_random_layers(model))


@dataclasses.dataclass(frozen=True)
class _State:
    """Everything a training step changes: weights, optimizer variables (step count,
    slots), the model's own step counters (tf-keras), its seed generators' states (Keras 3)."""

    weights: tuple
    optimizer: tuple
    counters: tuple
    seeds: tuple = ()

    @classmethod
    def of(cls, model) -> "_State":
        return cls(tuple(keras_adapter.model_variables(model)), tuple(model.optimizer.variables),
                   tuple(keras_adapter.step_counters(model)), tuple(keras_adapter.seed_states(model)))

    @property
    def variables(self) -> tuple:
        return self.weights + self.optimizer + self.counters + self.seeds


def _batches(x, y, steps: int, batch_size: int | None) -> list:
    samples = _num_samples(x)
    batch_size = batch_size or samples // steps
    if batch_size < 1 or steps * batch_size > samples:
        raise NumericsCheckError(
            f"check_numerics needs steps x batch_size samples ({steps} x {batch_size}) and was given {samples}")

    def cut(structure, step):
        return tf.nest.map_structure(lambda a: np.asarray(a)[step * batch_size:(step + 1) * batch_size], structure)
    return [(cut(x, step), cut(y, step)) for step in range(steps)]


def _num_samples(structure) -> int:
    leaves = tf.nest.flatten(structure)
    if not leaves or np.ndim(leaves[0]) == 0:
        raise NumericsCheckError("check_numerics takes x and y as numpy arrays (or dicts of them) of samples")
    return len(leaves[0])


def _nbytes(variable) -> int:
    return int(variable.shape.num_elements()) * tf.as_dtype(variable.dtype).size


def _check_host_memory(state: _State, model, max_host_bytes: int | None, *, slots_made: bool = True) -> None:
    """Refuse before copying anything when the host cannot hold what the check keeps there:
    the sharded model's state (to restore it) and the one-device copy (weights, optimizer
    state, gradients). Activations come on top and are not counted. Before the optimizer
    has made its slots (``slots_made=False``) the count leaves them out: a model refused
    then is refused before its slots are made."""
    state_bytes = sum(_nbytes(v) for v in state.variables)
    gradient_bytes = sum(_nbytes(v) for v in keras_adapter.trainable_variables(model))
    needed = 2 * state_bytes + gradient_bytes
    available = max_host_bytes if max_host_bytes is not None else _free_host_bytes()
    if available is None:
        logging.info("check_numerics: free host memory unknown on this system; needs %s", format_bytes(needed))
        return
    if needed > available:
        raise HostMemoryError(
            f"check_numerics needs {'at least ' if not slots_made else ''}{needed:,} bytes "
            f"({format_bytes(needed)}) of host memory for {model.name}: "
            f"the sharded state kept to restore it ({format_bytes(state_bytes)}), and a one-device copy with its "
            f"optimizer state and gradients ({format_bytes(state_bytes + gradient_bytes)}), activations not "
            f"counted{'' if slots_made else ', optimizer slots not made yet'}; the host has {available:,} bytes ({format_bytes(available)}) available. Check a smaller "
            "configuration of the model (fewer layers, narrower) planned the same way, or free host memory.")


def _free_host_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _host_value(variable) -> np.ndarray:
    """The variable's full value on the host (a sharded one assembled from its shards)."""
    return np.array(keras_adapter.tf_variable(variable).numpy())


def _assign_from_host(variable, value) -> None:
    """Write a host value into a variable; into a sharded one shard by shard, so no
    device ever holds the full value."""
    target = keras_adapter.tf_variable(variable)
    layout = getattr(target, "layout", None)
    target.assign(variables_lib.scatter_from_host(value, layout) if layout is not None else value)


def _one_device_copy(model, clone, state: _State, snapshot: list, features):
    """The model rebuilt on the host CPU, with the sharded model's weights, its compiled
    loss and a copy of its optimizer holding the same state (step count and slots). A
    copy without weights yet (a subclassed model) makes them at a call on ``features``."""
    framework = keras_adapter.framework_of(model)
    keras = keras_adapter.keras_module(framework)
    with tf.device("/CPU:0"):
        reference = clone() if clone is not None else _rebuilt(keras, model)
        if state.weights and not keras_adapter.model_variables(reference):
            reference(features)
        weights = keras_adapter.model_variables(reference)
        _check_alike("weights", state.weights, weights, model.name)
        for variable, value in zip(weights, snapshot):
            _assign_from_host(variable, value)
        optimizer = keras_adapter.fresh_optimizer(framework, model.optimizer)
        optimizer.build(keras_adapter.trainable_variables(reference))
        _check_alike("optimizer variables", state.optimizer, optimizer.variables, model.name)
        offset = len(state.weights)
        for variable, value in zip(optimizer.variables, snapshot[offset:offset + len(state.optimizer)]):
            _assign_from_host(variable, value)
        reference.compile(optimizer=optimizer, loss=_loss_copy(keras_hooks.compiled_loss(model)), jit_compile=False)
        seeds = keras_adapter.seed_states(reference)
        _check_alike("seed generator states", state.seeds, seeds, model.name)
        for variable, value in zip(seeds, snapshot[len(snapshot) - len(state.seeds):]):
            _assign_from_host(variable, value)
        compat_layers.same_masks_in_copy(model, reference, optimizer.iterations)
    return reference


def _rebuilt(keras, model):
    """``clone_model`` (functional and sequential models: each layer from its config),
    else the model's class from its config; a rebuild sharing weights with the model is no
    copy. Model Garden's ``ClassificationModel`` holds its backbone object in its config, so
    both ways made a model around the same backbone (65 of its 67 weights the sharded ones):
    the check would have compared the model with itself."""
    errors = []
    ways = (("clone_model", keras.models.clone_model),
            ("from_config", lambda m: m.__class__.from_config(m.get_config())))
    own = {id(variable) for variable in keras_adapter.model_variables(model)}
    for way, rebuild in ways:
        try:
            copy = rebuild(model)
        except Exception as error:  # noqa: BLE001 (each way's failure is reported below)
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            errors.append(f"{way}: {type(error).__name__}: {first_line}")
            continue
        copied = keras_adapter.model_variables(copy)
        shared = sum(id(variable) in own for variable in copied)
        if not shared:
            return copy
        errors.append(f"{way}: the rebuilt model shares {shared} of its {len(copied)} weights with the model "
                      "(its config holds layer objects, not their configs)")
    raise NumericsCheckError(
        f"check_numerics could not rebuild {model.name} for one device. Pass clone=a function that builds "
        f"the same model, or give its custom layers a get_config ({'; '.join(errors)})")


def _check_alike(what: str, sharded, copied, name: str) -> None:
    got = [(tuple(v.shape), tf.as_dtype(v.dtype).name) for v in copied]
    want = [(tuple(v.shape), tf.as_dtype(v.dtype).name) for v in sharded]
    if got != want:
        raise NumericsCheckError(
            f"the one-device copy of {name} does not have the model's {what} (shapes and dtypes, in order): "
            f"copy {got}, model {want}. Pass clone=a function that builds the same model.")


def _loss_copy(loss):
    if hasattr(loss, "get_config") and hasattr(type(loss), "from_config"):
        return type(loss).from_config(loss.get_config())
    return loss


def _gradient_norms(reference, model, batch, weights_snapshot) -> dict[int, float]:
    """Gradient norm of each trainable weight (by index in ``model.weights``) at the first
    batch on one device. The forward pass runs in training mode, which moves
    BatchNormalization's statistics: the copy's weights are put back afterwards."""
    framework = keras_adapter.framework_of(model)
    loss_fn = keras_adapter.get_loss(framework, keras_hooks.compiled_loss(model))
    weights = keras_adapter.model_variables(reference)
    index = {id(keras_adapter.tf_variable(w)): i for i, w in enumerate(weights)}
    trainable = keras_adapter.trainable_variables(reference)
    x, y = batch
    with tf.device("/CPU:0"):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, reference(x, training=True))
            extra = keras_adapter.regularization_losses(reference)
            if extra:
                loss = loss + tf.add_n(extra)
        gradients = tape.gradient(loss, trainable)
        for variable, value in zip(weights, weights_snapshot):
            _assign_from_host(variable, value)
    return {index[id(keras_adapter.tf_variable(w))]: float(tf.norm(tf.convert_to_tensor(g)))
            for w, g in zip(trainable, gradients) if g is not None}


def _train(model, batches) -> list[float]:
    """One ``fit`` call per batch: each step's own loss (fit reports an epoch's mean)."""
    return [float(model.fit(x, y, batch_size=_num_samples(x), epochs=1, shuffle=False, verbose=0).history["loss"][0])
            for x, y in batches]


def _differences(model, reference, gradients: dict, normalizes: bool) -> dict[str, VariableDifference]:
    """Each weight compared, one gathered to the host at a time."""
    names = keras_adapter.UniquePaths()
    found = {}
    for i, (sharded, local) in enumerate(zip(keras_adapter.model_variables(model),
                                             keras_adapter.model_variables(reference))):
        path = names.name(sharded)
        got = _host_value(sharded).astype(np.float64)
        want = _host_value(local).astype(np.float64)
        max_abs = float(np.max(np.abs(got - want))) if got.size else 0.0
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        gradient = gradients.get(i)
        tiny = gradient is not None and gradient <= _NOISE_GRADIENT * max(1.0, float(np.linalg.norm(want)))
        found[path] = VariableDifference(path=path, layout=_layout_text(sharded), max_abs=max_abs,
                                         max_relative=_relative(max_abs, scale), gradient_norm=gradient,
                                         noise_gradient=bool(tiny), noise_driven=bool(tiny and normalizes))
    return found


def _relative(difference: float, scale: float) -> float:
    if difference == 0:
        return 0.0
    return difference / scale if scale > 0 else float("inf")


def _layout_text(variable) -> str:
    layout = getattr(keras_adapter.tf_variable(variable), "layout", None)
    if layout is None:
        return "(one device)"
    specs = ["-" if spec == "unsharded" else spec for spec in layout.sharding_specs]
    return "(" + ", ".join(specs) + ")"


def _mesh_text(plan) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in dict(plan.mesh_shape).items())


def _inner(optimizer):
    """The optimizer a loss-scale wrapper wraps, or the optimizer itself."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def _normalizes(optimizer) -> bool:
    return any(base.__name__ in _NORMALIZING_OPTIMIZERS for base in type(_inner(optimizer)).__mro__)


def _random_layers(model) -> tuple[RandomLayer, ...]:
    """Layers drawing random values in training, with their rate: Dropout and its kin,
    noise layers, random augmentations, and recurrent cells' dropout."""
    found = []
    for path, layer in keras_adapter.layer_paths(model):
        kind = type(layer).__name__
        if "Dropout" in kind:
            found.append(RandomLayer(path, kind, float(getattr(layer, "rate", 0.0))))
        elif "Noise" in kind:
            found.append(RandomLayer(path, kind, float(getattr(layer, "stddev", getattr(layer, "rate", 0.0)))))
        elif kind.startswith("Random"):
            found.append(RandomLayer(path, kind, None))
        elif hasattr(layer, "recurrent_dropout") and not hasattr(layer, "cell"):
            rate = max(float(getattr(layer, "dropout", 0.0)), float(layer.recurrent_dropout))
            found.append(RandomLayer(path, kind, rate))
    return tuple(found)
