"""What a function given to ``TofuStrategy.run`` holds before it runs.

``run`` calls a function once on the global tensors where it can, and once per device on each
device's shard where it must; which, it decides from the function's concrete functions when they
are known before the call (a SavedModel's signature, a restored function, a loaded object):
whether one captures a variable that is not on the mesh (a program on the mesh cannot read it)
and whether one writes a variable (a function run once per device must not: each device would
apply its own update to the one variable).
"""

from __future__ import annotations

import weakref

import tensorflow as tf
from tensorflow.experimental import dtensor


def _concrete_functions_of(fn) -> list:
    """The concrete functions behind ``fn`` whose captures are known before it runs: ``fn`` itself
    (a SavedModel's signature), a function restored by ``tf.saved_model.load`` (a loaded module's
    method; its ``concrete_functions``, the change "restored_function_read"), or a loaded object
    called as a function (its ``__call__``). ``strategy.run``'s autograph wrapper holds ``fn`` in its
    closure. A tf.function of the user's traces at its call, under the plan: none."""
    candidates = [fn] + [cell.cell_contents for cell in getattr(fn, "__closure__", None) or ()]
    for candidate in candidates:
        if hasattr(candidate, "captured_inputs"):
            return [candidate]
        restored = _restored_concrete_functions(candidate)
        if restored is None and not isinstance(candidate, type) and hasattr(type(candidate), "__call__"):
            restored = _restored_concrete_functions(getattr(candidate, "__call__", None))
        if restored:
            return restored
    return []


def _restored_concrete_functions(fn):
    from tensorflow.python.saved_model import function_deserialization   # the change "restored_function_read"
    if isinstance(fn, function_deserialization.RestoredFunction):
        return list(fn.concrete_functions)
    return None


def _off_mesh_resources(concrete) -> bool:
    return any(tf.is_tensor(value) and value.dtype == tf.resource and not dtensor.is_dtensor(value)
               for value in concrete.captured_inputs)


def captures_off_mesh(fn) -> bool:
    """Whether ``fn`` (a SavedModel's signature, a loaded module or its method) captures a variable
    that is not a DTensor, which a program on the mesh cannot read."""
    return any(_off_mesh_resources(concrete) for concrete in _concrete_functions_of(fn))


# Ops that write a resource variable: a function running once per device on its shard must not
# (each device would apply its own update to the one variable).
_WRITE_OPS = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
_WRITE_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter")


# Whether each concrete function writes a variable, read once: ``run`` asks at every call.
_WRITES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def writes_variables(fn) -> bool:
    """Whether a concrete function behind ``fn`` (or a function it calls) writes a variable."""
    return any(_concrete_writes(concrete) for concrete in _concrete_functions_of(fn))


def _concrete_writes(concrete) -> bool:
    if concrete not in _WRITES:
        graph_def = concrete.graph.as_graph_def()
        nodes = list(graph_def.node) + [node for function in graph_def.library.function for node in function.node_def]
        _WRITES[concrete] = any(node.op in _WRITE_OPS or node.op.startswith(_WRITE_PREFIXES) for node in nodes)
    return _WRITES[concrete]
