"""What a variable the strategy is asked to create is: its Keras path, its shape and dtype before
its initial value exists, and the name the plan knows it by.

The strategy creates every variable in its planned layout (a weight the plan splits never exists
whole on one device), so it must learn a variable's shape and dtype from the creator's request
(tf-keras binds an initializer to the shape with ``functools.partial``, Keras 3 wraps one in a
closure over the Keras variable, a user's ``tf.Variable`` passes a value) without evaluating the
initializer where it can.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from absl import logging

from tofu_tf.tf import keras_adapter
from tofu_tf.tf import lowering


def created_variable(weight):
    """The variable this strategy created behind a model's weight (Keras 3 wraps it in
    ``.value``; tf-keras mixed precision in an ``AutoCastVariable``)."""
    variable = keras_adapter.backing_variable(weight)
    return getattr(variable, "_variable", variable)


def is_keras_weight(variable) -> bool:
    """Whether a deferred variable is a Keras layer's (or optimizer's) weight: tf-keras's
    ``add_weight`` binds its initializer to the shape (``functools.partial``), Keras 3 wraps it in a
    closure over the Keras variable. A ``tf.Variable(value)`` of the user's (a ``tf.Module``'s, a
    bare one) starts from a value."""
    initial_value = variable._tofu_initial_value  # pylint: disable=protected-access
    return isinstance(initial_value, functools.partial) or keras_adapter.keras3_shape_and_dtype(initial_value) is not None


def is_seed_state(variable) -> bool:
    """A Keras 3 ``SeedGenerator``'s state (a Dropout's, a GaussianNoise's): in a pipeline it lives
    on the mesh of the stage whose layer draws from it (``PipelinePlan.seed_state_layout``). On
    another stage's mesh that stage's program could not read it (DTensor: "All inputs to
    tf_device.Cluster must have same mesh"); on the host, each device's part of the program
    advanced it once (8 draws a step on 8 devices)."""
    return keras_path(variable).rsplit("/", 1)[-1].startswith("seed_generator_state")


def keras_path(variable) -> str:
    """The Keras path of a variable this strategy created (``dense/kernel``;
    Keras 3 adds the model: ``sequential/dense/kernel``)."""
    path = getattr(variable, "_tofu_path", None)
    if path:
        return path
    name = variable.name
    return name[:-2] if name.endswith(":0") else name


def scoped_path(name) -> str:
    """The path a variable is being created under: the current name scope + its name."""
    name = (name or "Variable").split(":")[0]
    scope = tf.get_current_name_scope()
    if scope and not name.startswith(scope + "/"):
        return f"{scope}/{name}"
    return name


def plan_path(path: str, plan, shape) -> str:
    """The plan's name for a variable: its own path, or for an optimizer slot
    (``Adam/m/dense/kernel``) the weight it tracks when the slot is unplanned."""
    return lowering.planned_name(path, plan.variable_layouts, shape) or path


def initial_shape(initial_value, shape):
    """The shape of the variable ``initial_value`` starts (``shape``: the creator's, where given),
    read from the request where it says it; an initializer of unknown shape is evaluated, with a
    warning."""
    if shape is not None:
        return tf.TensorShape(shape)
    if isinstance(initial_value, functools.partial) and initial_value.args and initial_value.args[0] is not None:
        return tf.TensorShape(initial_value.args[0])  # (a checkpoint's save_counter passes shape None)
    if isinstance(initial_value, functools.partial) and initial_value.keywords.get("shape") is not None:
        return tf.TensorShape(initial_value.keywords["shape"])   # a legacy tf-keras optimizer's slot
    inner = getattr(initial_value, "shape", None)
    if inner is not None:
        return tf.TensorShape(inner)
    keras3 = keras_adapter.keras3_shape_and_dtype(initial_value)
    if keras3 is not None:
        return keras3[0]
    if callable(initial_value):
        logging.warning("TofuStrategy: evaluating an initializer of unknown shape to learn its shape")
        return tf.convert_to_tensor(initial_value()).shape
    return tf.convert_to_tensor(initial_value).shape


def initial_dtype(initial_value):
    """The dtype of the variable ``initial_value`` starts, read from the request where it says it."""
    if isinstance(initial_value, functools.partial):
        dtype = initial_value.keywords.get("dtype")
        if dtype is not None:
            return tf.as_dtype(dtype)
    dtype = getattr(initial_value, "dtype", None)
    if dtype is not None:
        return tf.as_dtype(dtype)
    keras3 = keras_adapter.keras3_shape_and_dtype(initial_value)
    if keras3 is not None:
        return keras3[1]
    return tf.convert_to_tensor(initial_value() if callable(initial_value) else initial_value).dtype
