"""What TofuStrategy needs from a Keras training loop, kept in one module.

Keras hands the strategy a step function (``strategy.run(step, args)``), not
the model. Planning needs the model, its loss and optimizer, so the model is
found in the step function's closure (tf-keras ``fit``/``evaluate``/
``predict`` close over it; Keras 3 binds it as ``self``). A Keras upgrade that
changes this touches only this file.
"""

from __future__ import annotations

import dataclasses
import inspect

import tensorflow as tf

_MAX_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The features and labels of one step, as Keras passes them to the step function."""

    features: tuple
    labels: object | None


def find_model(step_fn):
    """The Keras model a step function trains, or None."""
    return _search(step_fn, depth=0, seen=set())


def find_model_in_stack(max_frames: int = 12):
    """The Keras model whose fit/evaluate/predict is distributing a dataset.

    tf-keras distributes the dataset (``strategy.experimental_distribute_dataset``)
    before it builds the step function, from its DataHandler, which holds the
    model in a local variable; the plan must exist by then because the
    distributed dataset is laid out on the planned mesh.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(max_frames):
            frame = frame.f_back
            if frame is None:
                return None
            for name in ("model", "self"):
                candidate = frame.f_locals.get(name)
                if candidate is not None and _is_model(candidate):
                    return candidate
    finally:
        del frame
    return None


def _is_model(obj) -> bool:
    return hasattr(obj, "train_step") and hasattr(obj, "trainable_variables") and hasattr(obj, "inputs")


def _search(obj, depth, seen):
    if obj is None or id(obj) in seen or depth > _MAX_DEPTH:
        return None
    seen.add(id(obj))
    if _is_model(obj):
        return obj
    candidates = []
    candidates.append(getattr(obj, "__self__", None))
    candidates.append(getattr(obj, "__wrapped__", None))
    candidates.append(getattr(obj, "_python_function", None))
    closure = getattr(obj, "__closure__", None) or ()
    for cell in closure:
        try:
            candidates.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for candidate in candidates:
        found = _search(candidate, depth + 1, seen)
        if found is not None:
            return found
    return None


def split_step_data(args) -> StepInputs:
    """Keras calls the step with ``(data,)``; data is ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, w)``."""
    data = args[0] if len(args) == 1 else args
    if isinstance(data, (tuple, list)):
        features = data[0]
        labels = data[1] if len(data) > 1 else None
    else:
        features, labels = data, None
    return StepInputs(features=tuple(tf.nest.flatten(features)), labels=labels)


def compiled_loss(model):
    """The loss the model was compiled with (what capture traces), or None."""
    return getattr(model, "loss", None)
