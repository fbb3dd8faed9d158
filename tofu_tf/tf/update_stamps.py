"""Trace an optimizer's per-weight update once per weight shape; stamp it for the rest.

Why: TensorFlow builds graph ops at about a millisecond each while tracing, and
a Keras optimizer builds 20-40 of them per weight. Tracing Adam's update was
0.32 s of the 0.43 s it took to trace a 4-layer MLP's step, and a GPT has a
dozen weights per block, all of the same few shapes. A built-in Keras
optimizer's ``update_step(gradient, variable)`` depends on the weight only
through its shape, its dtype and the slots it owns, so the ops one traced
update builds -- with the weight, its slots and its gradient renamed -- are
the ops tracing the next weight of that shape would build. Capture traces the
first update of every (shape, dtype) and records, for each further weight,
where its update would have been; translation then copies the first update's
IR ops there (``stamp``), so op order, and with it activation liveness, is the
order a full trace gives.

Stamping is only used where that reasoning holds, and checked where it can be:

* only for ``update_step`` as Keras' own optimizers define it; a subclass that
  overrides it is traced weight by weight;
* a traced update may read from outside itself nothing but its gradient, its
  weight, its own slots, the optimizer's shared variables (step counter,
  learning rate) and scalars; one that reads anything else (another weight, a
  tensor of the forward pass) is not stamped, and every weight of its shape
  is traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Mapping, Sequence

import tensorflow as tf
from tensorflow.python.framework import func_graph

from tofu_tf import ir
from tofu_tf.tf import keras_adapter

# Where Keras defines its built-in optimizers.
_BUILTIN_OPTIMIZER_MODULES = ("tf_keras.src.optimizers.", "keras.src.optimizers.")
# Inserted into a stamped op's name after the optimizer's name scope:
# "Adam/mul_3" stamped for "d2/kernel" is "Adam/stamped/d2/kernel/mul_3".
STAMP_SCOPE = "stamped"


@dataclasses.dataclass(frozen=True)
class UpdateTemplate:
    """A traced update: the traced graph's ops ``[start, end)``."""

    start: int
    end: int
    gradient: str        # tensor name in the traced graph
    weight_handle: int   # id() of the weight's eager handle (capture maps it to a path)


@dataclasses.dataclass(frozen=True)
class UpdateStamp:
    """An update not traced: ``template``'s ops, copied for ``weight``, go
    where the traced graph's op ``at`` is (before it)."""

    template: UpdateTemplate
    at: int
    gradient: str
    weight_handle: int


class UpdateRecorder:
    """Wraps an optimizer's ``update_step`` while a step is traced (see the module docstring)."""

    def __init__(self, optimizer, weights: Sequence[tf.Variable], slots: Sequence[keras_adapter.SlotRecord]):
        self._optimizer = optimizer
        self._weight_handles = {id(weight.handle) for weight in weights}
        self._slots = slots             # filled while tracing, as the optimizer builds
        self._templates: dict[tuple, UpdateTemplate | None] = {}
        self.stamps: list[UpdateStamp] = []

    @contextlib.contextmanager
    def recording(self, enabled: bool = True) -> Iterator["UpdateRecorder"]:
        """While active, updates are traced once per weight shape (if ``enabled`` and safe)."""
        if not enabled or not _stamps_safely(self._optimizer):
            yield self
            return
        original = self._optimizer.update_step           # the change "update_step_stamped"

        def update_step(gradient, variable, *args, **kwargs):
            return self._update(original, gradient, variable, args, kwargs)

        self._optimizer.update_step = update_step
        try:
            yield self
        finally:
            del self._optimizer.update_step

    def _update(self, original, gradient, variable, args, kwargs):
        graph = tf.compat.v1.get_default_graph()
        if tf.executing_eagerly() or not isinstance(gradient, tf.Tensor) or _nested(graph):
            # Stamps are placed among the step graph's own ops: an update traced inside a
            # function of its own (tf-keras' XLA update on GPUs) is traced weight by weight.
            return original(gradient, variable, *args, **kwargs)
        tf_var = keras_adapter.tf_variable(variable)
        # Extra arguments (Keras 3 passes the learning rate) must be the same objects.
        key = (tuple(tf_var.shape.as_list()), tf_var.dtype.name, gradient.dtype.name,
               tuple(id(a) for a in args), tuple(sorted((k, id(v)) for k, v in kwargs.items())))
        handle = id(tf_var.handle)
        template = self._templates.get(key, _UNSEEN)
        if template is _UNSEEN:
            start = len(graph.get_operations())
            result = original(gradient, variable, *args, **kwargs)
            ops = graph.get_operations()[start:]
            self_contained = result is None and ops and self._reads_only_its_own(ops, gradient, tf_var, graph)
            self._templates[key] = UpdateTemplate(start, start + len(ops), gradient.name, handle) if self_contained else None
            return result
        if template is None:
            return original(gradient, variable, *args, **kwargs)
        self.stamps.append(UpdateStamp(template, len(graph.get_operations()), gradient.name, handle))
        return None

    def _reads_only_its_own(self, ops, gradient, weight: tf.Variable, graph) -> bool:
        """Whether the ops of one traced update read, from outside themselves, only
        its gradient, scalars and the handles of its weight, its slots or a shared
        optimizer variable."""
        inside = {op.name for op in ops}
        captured = {internal.name: id(external) for external, internal in graph.captures}
        foreign = {id(record.slot.handle) for record in self._slots if record.weight is not weight}
        foreign |= self._weight_handles - {id(weight.handle)}
        for op in ops:
            for tensor in op.inputs:
                if tensor.dtype == tf.resource:
                    if captured.get(tensor.name) in foreign:
                        return False
                elif tensor.op.name not in inside and tensor.name != gradient.name and tensor.shape.rank != 0:
                    return False
        return True


_UNSEEN = object()


def _nested(graph) -> bool:
    """Whether ``graph`` is a function traced inside another one (not the step's graph)."""
    return isinstance(getattr(graph, "outer_graph", None), func_graph.FuncGraph)


def _stamps_safely(optimizer) -> bool:
    """Keras' own ``update_step`` (not a user's override of it)."""
    update_step = getattr(type(optimizer), "update_step", None)
    module = getattr(update_step, "__module__", "") or ""
    return module.startswith(_BUILTIN_OPTIMIZER_MODULES)


def stamp(template_ops: Sequence[ir.Op], tensors: Mapping[str, ir.Tensor], *, weight: str,
          inputs: Mapping[str, str], paths: Mapping[str, str]) -> tuple[list[ir.Op], list[ir.Tensor]]:
    """Copies of ``template_ops`` for ``weight``: every op and output renamed,
    each outside input in ``inputs`` replaced (the gradient, the weight's and
    its slots' handles), every variable path in ``paths`` replaced; other
    outside inputs (shared scalars and handles) kept."""
    op_names = {op.name: _stamped_name(op.name, weight) for op in template_ops}
    renamed = {output: f"{op_names[op.name]}:{output.rpartition(':')[2]}"
               for op in template_ops for output in op.outputs}
    ops, new_tensors = [], []
    for op in template_ops:
        ops.append(dataclasses.replace(
            op, name=op_names[op.name], outputs=tuple(renamed[o] for o in op.outputs),
            inputs=tuple(renamed.get(i, inputs.get(i, i)) for i in op.inputs)))
        for output in op.outputs:
            tensor = tensors[output]
            new_tensors.append(dataclasses.replace(
                tensor, name=renamed[output], producer=op_names[op.name], consumers=(),
                variable_path=paths.get(tensor.variable_path, tensor.variable_path)))
    return ops, new_tensors


def _stamped_name(name: str, weight: str) -> str:
    scope, slash, rest = name.partition("/")
    if not slash:
        return f"{STAMP_SCOPE}/{weight}/{name}"
    return f"{scope}/{STAMP_SCOPE}/{weight}/{rest}"
