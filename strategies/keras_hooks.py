"""What TofuStrategy needs from a Keras training loop, kept in one module.

Keras hands the strategy a step function (``strategy.run(step, args)``), not
the model. Planning needs the model, its loss and optimizer, so the model is
found in the step function's closure (tf-keras ``fit``/``evaluate``/
``predict`` close over it; Keras 3 binds it as ``self``). A Keras upgrade that
changes this touches only this file. What the strategy changes on the model it finds
(``prepare_for_dtensor``) is ``tofu_tf.tf.compat``'s, where every such change is registered.
"""

from __future__ import annotations

import dataclasses
import inspect
import types

from tofu_tf.strategies import export as export_lib
from tofu_tf.tf import compat, keras_adapter
from tofu_tf.tf.compat import layers as compat_layers
from tofu_tf.tf.compat import revived_functions as compat_revived
from tofu_tf.tf.compat import slices as compat_slices

_MAX_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The features and labels of one step, as Keras passes them to the step function."""

    features: object
    labels: object | None
    data: object = None          # the step's data as Keras passes it to train_step


def find_model(step_fn, *, strict: bool = False):
    """The Keras model a step function trains, or None: where the function reaches several
    (a task model and its backbone), the one holding all the others' weights. Where none
    holds all (two models trained side by side), the first found, or with ``strict`` (the
    step is about to be planned from it) an error."""
    models = _reachable(step_fn, _is_model)
    if not models:
        return None
    outermost = max(models, key=lambda m: len(m.weights))
    held = {id(w) for w in outermost.weights}
    if all({id(w) for w in m.weights} <= held for m in models):
        return outermost
    if not strict:
        return models[0]
    names = ", ".join(sorted(m.name for m in models))
    raise keras_adapter.UnsupportedModelError(
        f"the function passed to strategy.run trains several models ({names}), and TofuStrategy plans one: "
        "give each model its own TofuStrategy, or plan one model that holds them all.")


def find_optimizer(step_fn):
    """The optimizer a custom loop's step function applies its gradients with, or None."""
    optimizers = _reachable(step_fn, _is_optimizer)
    if len(optimizers) > 1:
        raise keras_adapter.UnsupportedModelError(
            f"the function passed to strategy.run reaches {len(optimizers)} optimizers, and TofuStrategy plans "
            "a step with one: plan the model explicitly with strategy.plan_model(model, batch_size=..., "
            "loss=..., optimizer=...).")
    return optimizers[0] if optimizers else None


_KERAS_STEPS = frozenset({"train_step", "test_step", "predict_step"})


def runs_keras_step(step_fn, model) -> bool:
    """Whether ``step_fn`` runs ``model``'s own train/test/predict step: Keras' step functions
    (``fit``, ``train_on_batch``) and the strategy's (``tofu_tf.strategies.step_functions``) call the
    model's bound ``train_step``; a custom loop runs its own code."""
    function = getattr(step_fn, "__func__", step_fn)
    function = getattr(function, "_python_function", function)
    if str(getattr(function, "__module__", "")).startswith(_KERAS_MODULES):
        return True

    def model_step(obj) -> bool:
        return getattr(obj, "__self__", None) is model and getattr(obj, "__name__", None) in _KERAS_STEPS
    return bool(_reachable(step_fn, model_step))


def find_model_in_stack(max_frames: int = 12):
    """The Keras model whose fit/evaluate/predict is distributing a dataset, or None.

    tf-keras distributes the dataset (``strategy.experimental_distribute_dataset``)
    before it builds the step function, from its DataHandler, which holds the
    model in a local variable; Keras 3 from its epoch iterator, inside ``fit``. The
    plan must exist by then because the batches are laid out on the planned mesh.
    Only Keras' own frames count: a model in the user's script (a custom training
    loop distributing its dataset) says nothing about what the loop trains.
    """
    for frame in _calling_frames(max_frames):
        if not str(frame.f_globals.get("__name__", "")).startswith(_KERAS_TRAINING_FRAMES):
            continue
        for name in ("model", "self"):
            candidate = frame.f_locals.get(name)
            if candidate is not None and _is_model(candidate):
                return candidate
    return None


_KERAS_MODULES = ("tf_keras.", "keras.", "keras_hub.")
# Keras' training machinery, where fit/evaluate/predict hold the model: tf-keras's engine
# (DataHandler, train_on_batch), Keras 3's trainers, keras-hub's task models. Not all of
# ``tf_keras``: its distribution test harness (``tf_keras.src.distribute``) holds a local
# ``model`` too, while it distributes a dataset for another (a loaded SavedModel).
_KERAS_TRAINING_FRAMES = ("tf_keras.src.engine.", "keras.src.trainers.", "keras.src.backend.", "keras_hub.")


def _calling_frames(max_frames: int):
    """The frames that called the function iterating this, innermost first."""
    frame = inspect.currentframe().f_back
    try:
        for _ in range(max_frames):
            frame = frame.f_back
            if frame is None:
                return
            yield frame
    finally:
        del frame


def _is_model(obj) -> bool:
    # Not ``inputs``: a subclassed Keras 3 model has no such attribute.
    # Looked up on the class: an unbuilt tf-keras model's trainable_variables raises ValueError
    # ("Weights for model 'linear_model' have not yet been created"), which hasattr lets through.
    kind = type(obj)
    return hasattr(kind, "train_step") and hasattr(kind, "trainable_variables") and callable(getattr(kind, "fit", None))


def is_optimizer(obj) -> bool:
    """Whether ``obj`` is a Keras optimizer (tf-keras, its legacy ones, Keras 3)."""
    return _is_optimizer(obj)


def _is_optimizer(obj) -> bool:
    kind = type(obj)
    return (callable(getattr(kind, "apply_gradients", None)) and callable(getattr(kind, "get_config", None))
            and any(str(base.__module__).startswith(_KERAS_MODULES) for base in kind.__mro__))


def _reachable(step_fn, wanted) -> list:
    """The objects ``wanted`` accepts that ``step_fn`` reaches, in the order found.

    What a step function can touch: its bound object (and that object's attributes: a
    loop class holding ``self.model``), a wrapped or traced function's Python function,
    its closure cells, and the module globals its code names (TF's tutorial keeps
    ``model`` and ``optimizer`` at module level). Found objects are not searched further.
    """
    found, seen = [], set()

    def visit(obj, depth):
        if obj is None or id(obj) in seen or depth > _MAX_DEPTH or isinstance(obj, types.ModuleType):
            return
        seen.add(id(obj))
        if wanted(obj):
            found.append(obj)
            return
        if _is_model(obj) or _is_optimizer(obj):
            return
        for candidate in _neighbours(obj):
            visit(candidate, depth + 1)

    visit(step_fn, 0)
    return found


def _neighbours(obj):
    yield getattr(obj, "__self__", None)
    yield getattr(obj, "__wrapped__", None)
    yield getattr(obj, "_python_function", None)
    yield getattr(obj, "__func__", None)
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    code = getattr(obj, "__code__", None)
    module_globals = getattr(obj, "__globals__", None)
    if code is not None and module_globals is not None:
        for name in _names_used(code):
            yield module_globals.get(name)
    elif not callable(obj) and hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from list(vars(obj).values())        # a loop object: self.model, self.optimizer


def _names_used(code) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):        # a nested function or comprehension
            names.extend(_names_used(const))
    return names


def split_step_data(args) -> StepInputs:
    """Keras calls the step with ``(data,)``; data is ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, w)``,
    and ``x`` keeps its structure (a dict of inputs stays a dict)."""
    data = args[0] if len(args) == 1 else args
    if isinstance(data, tuple):
        features = data[0]
        labels = data[1] if len(data) > 1 else None
    else:
        features, labels = data, None
    return StepInputs(features=features, labels=labels, data=data)


def compiled_loss(model):
    """The loss the model was compiled with (what capture traces), or None; for a model compiled
    without one that adds its own losses (``add_loss``), a zero loss (the step adds them)."""
    if keras_adapter.compiled_without_loss(model):
        return keras_adapter.no_compiled_loss
    return getattr(model, "loss", None)


def prepare_for_dtensor(model) -> list[compat.Applied]:
    """Prepare ``model``'s own objects for DTensor, and say what changed (``compat.Applied``).

    Its layers DTensor cannot expand as written are rewritten without changing their math
    (``tofu_tf.tf.compat.layers.prepare_layers``: fused normalizations, average pooling, RNN
    loops, stateful dropout, depthwise convolutions), its call slices new axes with every axis
    named (``tofu_tf.tf.compat.slices``, the change "new_axis_slices_spelled_out"), and its
    SavedModel exports are made from a one-device copy
    (``tofu_tf.strategies.export``, the change "savedmodel_from_copy"): one traced on the mesh
    holds DTensor ops no one-device runtime can run. A model tf-keras revived from a SavedModel's
    functions has them read the planned variables (``tofu_tf.tf.compat.revived_functions``).
    """
    changes = compat_layers.prepare_layers(model)
    deferred = compat_revived.defer_saved_function_captures(model)
    if deferred is not None:
        changes.append(deferred)
    spelled = compat_slices.spell_out_new_axes(model)
    if spelled is not None:
        changes.append(spelled)
    if export_lib.install(model):
        changes.append(compat.Applied(compat.change("savedmodel_from_copy"), model.name,
                                      "SavedModel export from a one-device copy"))
    return changes
