"""DTensor's refusal to compile a planned step, as an error naming the op, its layers, the plan
and what to try.

The plan fixes the layouts of the weights and of the batch; DTensor's layout propagation
chooses the layouts of every op between them, merging what producers and consumers ask for,
and may give an op a layout the plan did not and its SPMD expander refuses. keras-hub Gemma
under half its data-parallel peak (mesh ``model=4 x model1=2``): a head split carried back
through a reshape onto the stacked dim of the rotary embedding's ``tf.stack``, and the first
step failed with DTensor's ``UnknownError`` ("SPMD expansion resulted in op output inconsistent
with the provided layout"), a page of MLIR naming neither the layer nor a way out.

DTensor compiles a step's program at its first call, before any op of it runs: no weight has
changed when it refuses. ``explained`` turns that refusal into ``PlanNotRunnableError``, which
names the op type, its global shape and the layout DTensor gave it, the Keras layers whose ops
have that type and shape in the captured step (``OpLayers``), the plan's mesh and budget, and
what to try; never a tensor's values (DTensor's text holds shapes and layouts only). Other
errors pass through unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

from tofu_tf import ir
from tofu_tf.errors import TofuError

# What DTensor's SPMD expansion and layout propagation say when they refuse an op's layout
# (TF 2.21); an error without one of these is not a layout refusal and passes through.
_REFUSALS = ("SPMD expansion", "layout propagation", "sharded dimension", "sharding dimension",
             "incompatible mesh dimensions", "SPMD needs communication", "not more sharded")
_ERROR_LINE = re.compile(r"error: (.*)")
_OPERATION = re.compile(r'see current operation: [^=]*= "tf\.(\w+)".*?_global_shape = \[#tf_type\.shape<([\dx]*)>')
_SPECS = re.compile(r'_layout = \["sharding_specs:([^ ]*), mesh:')
# A layout as DTensor writes it: its sharding specs, then the mesh with every device's name.
_LAYOUT_TEXT = re.compile(r"sharding_specs:([^ ]*), mesh:\|[^ \"]*")
_MOST_LAYERS = 4


class PlanNotRunnableError(TofuError, RuntimeError):
    """DTensor refused to compile a planned step: nothing of it ran, no weight changed."""


@dataclasses.dataclass(frozen=True)
class OpLayers:
    """The Keras layers of the captured step's ops, by op type and first output's shape: what
    DTensor's refusal can be traced back to (its program names no layer)."""

    by_signature: Mapping[tuple[str, tuple[int, ...]], tuple[str, ...]]

    @classmethod
    def of(cls, graph: ir.Graph) -> "OpLayers":
        found: dict[tuple[str, tuple[int, ...]], list[str]] = {}
        for op in graph.ops:
            if not op.outputs or not op.layer or op.outputs[0] not in graph.tensors:
                continue
            layers = found.setdefault((op.type, tuple(graph.tensors[op.outputs[0]].shape)), [])
            if op.layer not in layers:
                layers.append(op.layer)
        return cls({key: tuple(layers) for key, layers in found.items()})

    def layers(self, op_type: str, shape: tuple[int, ...]) -> tuple[str, ...]:
        return self.by_signature.get((op_type, shape), ())


@dataclasses.dataclass(frozen=True)
class Refusal:
    """What DTensor refused, as its text says: ``what`` (the op type, its global shape, its layers
    and the layout it was given, as far as the text names them) and ``reason`` (DTensor's line,
    each layout shortened to its sharding specs)."""

    what: str
    reason: str


def refusal(error: Exception, op_layers: OpLayers | None = None) -> Refusal | None:
    """The layout refusal ``error`` reports, or None for any other error."""
    text = str(error)
    lines = _ERROR_LINE.findall(text)
    if not lines or not any(marker in text for marker in _REFUSALS):
        return None
    reason = _LAYOUT_TEXT.sub(lambda m: "(" + m.group(1).replace(",", ", ") + ")", lines[0].strip())
    operation = _OPERATION.search(text)
    what = "an op"
    if operation is not None:
        op_type = operation.group(1)
        shape = tuple(int(d) for d in operation.group(2).split("x") if d)
        what = f"a {op_type} op of global shape {shape}"
        layers = op_layers.layers(op_type, shape) if op_layers is not None else ()
        if layers:
            shown = " or ".join(repr(layer) for layer in layers[:_MOST_LAYERS])
            more = f" (or {len(layers) - _MOST_LAYERS} more)" if len(layers) > _MOST_LAYERS else ""
            what += f" in layer {shown}{more}"
        specs = _SPECS.search(text[operation.start():])
        if specs is not None:
            what += f" as ({specs.group(1).replace(',', ', ')})"
    return Refusal(what, reason[:300])


def explained(error: Exception, *, model_name: str, kind: str, mesh_text: str, budget_text: str | None,
              op_layers: OpLayers | None) -> PlanNotRunnableError | None:
    """``PlanNotRunnableError`` for DTensor's refusal ``error`` of the ``kind`` step of
    ``model_name`` under a plan on ``mesh_text``; None for any other error."""
    refused = refusal(error, op_layers)
    if refused is None:
        return None
    budget = f" under the memory budget of {budget_text} per device" if budget_text else ""
    return PlanNotRunnableError(
        f"DTensor cannot run the planned {kind} step of {model_name!r} on the mesh {mesh_text}{budget}: its "
        f"layout propagation laid out {refused.what}, which its SPMD expander refuses (\"{refused.reason}\"). "
        "Nothing of the step ran and no weight changed. The plan fixes the layouts of the weights and the batch; "
        "DTensor lays out the ops between them, and on this mesh it chose one it cannot run. A plan on another "
        "mesh may avoid it: give TofuStrategy a larger memory_budget_bytes (or none), or a mesh_shape= with one "
        "model axis; strategy.plan.summary() shows the plan that failed.")
