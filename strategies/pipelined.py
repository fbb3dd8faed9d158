"""Pipelined training under TofuStrategy: stages on disjoint sub-meshes, micro-batches
under a schedule, one optimizer update per step.

``TofuStrategy(num_gpus=N, pipeline=...)`` cuts the Keras model at the first step into
``pp`` stages at pipeline-unit boundaries (where exactly one tensor crosses, as
``tofu_tf.pipeline.layer_stats`` defines units), gives stage ``s`` the devices
``[s * N / pp, (s + 1) * N / pp)`` as a mesh of its own, and plans each stage's sharding
with the Tofu planner on that mesh: the stage's step is captured as a model of its own
whose loss is ``sum(output * output_gradient)``, so its backward is the vector-Jacobian
product the next stage sends back. Each weight, its gradient and its optimizer slots live
only on their stage's devices.

How a step runs the stages is ``tofu_tf.strategies.pipeline_runner``'s.

What stays off the stage meshes: the optimizer's own scalars (step counter, learning
rate) are plain host variables, which DTensor reads on any mesh as a scalar; the
metrics, the loss tracker and Keras' step counters live on the last stage's mesh, where
the loss and the outputs are.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from tofu_tf.errors import TofuError
from tofu_tf.pipeline import hybrid as hybrid_lib
from tofu_tf.pipeline.partition import StagePlan, partition
from tofu_tf.pipeline.stage_model import Schedule
from tofu_tf.tf import devices as devices_lib
from tofu_tf.tf import keras_adapter
from tofu_tf.tf import lowering


class PipelineError(TofuError, ValueError):
    """A pipeline TofuStrategy cannot build for this model, batch or device count."""


@dataclasses.dataclass(frozen=True)
class PipelineRequest:
    """What ``TofuStrategy(pipeline=..., num_microbatches=..., schedule=...)`` asked for,
    checked when the strategy is made.

    ``num_stages`` is None for ``pipeline="auto"`` (the hybrid recommendation decides);
    ``boundaries`` the first unit of each stage, when a plan fixed them; ``mesh_shape`` the
    ``{"batch": dp, "model": tp}`` of every stage, when a hybrid candidate fixed it."""

    num_stages: int | None
    schedule: Schedule
    num_microbatches: int | None
    boundaries: tuple[int, ...] | None = None
    mesh_shape: Mapping[str, int] | None = None

    @classmethod
    def read(cls, pipeline, *, num_microbatches, schedule, num_devices: int) -> "PipelineRequest | None":
        """The request, or None without ``pipeline``; a ``PipelineError`` names what is wrong."""
        if pipeline is None:
            if num_microbatches is not None:
                raise PipelineError("num_microbatches= splits a pipeline's batch: give it with pipeline= "
                                    "(a stage count, 'auto', or a plan of tofu_tf.pipeline)")
            return None
        schedule = Schedule.from_user(schedule)
        if num_microbatches is not None and (isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int)
                                             or num_microbatches < 1):
            raise PipelineError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        if isinstance(pipeline, str):
            if pipeline != "auto":
                raise PipelineError(f"pipeline={pipeline!r}: expected 'auto', a stage count, or a plan from "
                                    "tofu_tf.pipeline.recommend_hybrid / partition")
            return cls(None, schedule, num_microbatches)
        if isinstance(pipeline, hybrid_lib.HybridCandidate):
            if pipeline.pp * pipeline.tp * pipeline.dp != num_devices:
                raise PipelineError(
                    f"the hybrid plan {pipeline.shape} (pp x tp x dp) uses {pipeline.pp * pipeline.tp * pipeline.dp} "
                    f"devices and the strategy has {num_devices}: take a candidate of "
                    f"recommend_hybrid(num_devices={num_devices}, ...)")
            return cls(pipeline.pp, schedule, num_microbatches or pipeline.num_microbatches,
                       tuple(pipeline.boundaries), stage_mesh(pipeline.dp, pipeline.tp))
        if isinstance(pipeline, StagePlan):
            stages = pipeline.num_stages
            cls._check_divides(stages, num_devices)
            return cls(stages, schedule, num_microbatches or pipeline.num_microbatches, tuple(pipeline.boundaries))
        if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1:
            raise PipelineError(f"pipeline={pipeline!r}: expected a stage count >= 1, 'auto', or a plan from "
                                "tofu_tf.pipeline.recommend_hybrid / partition")
        cls._check_divides(pipeline, num_devices)
        return cls(pipeline, schedule, num_microbatches)

    @staticmethod
    def _check_divides(stages: int, num_devices: int) -> None:
        if num_devices % stages:
            raise PipelineError(
                f"{stages} pipeline stages do not split {num_devices} devices evenly (pp x tp x dp must equal the "
                f"device count): choose a stage count that divides {num_devices}")


@dataclasses.dataclass(frozen=True)
class OneDevicePlan:
    """The plan of a stage given one device: nothing to split, nothing to search."""

    variable_layouts: Mapping[str, tuple]
    mesh_shape: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"batch": 1})
    input_layouts: Mapping[str, tuple] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, graph) -> "OneDevicePlan":
        return cls({path: (None,) * len(var.shape) for path, var in graph.variables.items()})


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: its layers, the Keras model that runs them, its plan on its own mesh."""

    index: int
    layers: tuple[str, ...]
    model: object
    plan: object                       # tofu_tf.Plan on this stage's mesh
    lowered: lowering.Lowered
    weight_paths: Mapping[int, str]    # id(variable) -> the stage plan's name for it

    @property
    def mesh(self) -> dtensor.Mesh:
        return self.lowered.mesh

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.local_devices())


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """``TofuStrategy.plan`` of a pipelined run: the stages, each with its own ``tofu_tf.Plan``."""

    schedule: Schedule
    num_microbatches: int
    micro_batch_size: int
    stages: tuple[Stage, ...]
    recommendation: hybrid_lib.HybridCandidate | None = None    # what pipeline="auto" took

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def variable_layouts(self) -> dict:
        """Every stage plan's layouts, by path (stages hold disjoint weights)."""
        return {path: layout for stage in self.stages for path, layout in stage.plan.variable_layouts.items()}

    @property
    def mesh_shape(self) -> dict:
        return dict(self.stages[0].plan.mesh_shape)

    def layout_for(self, variable, path: str) -> dtensor.Layout | None:
        """The layout of a stage's weight (by identity) or optimizer slot (by its plan path);
        None for a variable no stage holds."""
        for stage in self.stages:
            name = stage.weight_paths.get(id(variable))
            if name is not None:
                return stage.lowered.layout_for(name, variable.shape)
        for stage in self.stages:
            name = lowering.planned_name(path, stage.plan.variable_layouts, variable.shape)
            if name is not None:
                return stage.lowered.layout_for(name, variable.shape)
        return None

    def seed_state_layout(self, variable) -> dtensor.Layout | None:
        """Replicated on the mesh of the stage whose model holds ``variable`` (a Keras 3
        ``SeedGenerator``'s state, which no stage plan lays out); None when no stage holds it."""
        for stage in self.stages:
            if any(keras_adapter.tf_variable(held) is variable for held in getattr(stage.model, "variables", ())):
                return dtensor.Layout.replicated(stage.mesh, rank=variable.shape.rank)
        return None

    def summary(self) -> str:
        lines = [f"pipeline of {self.num_stages} stages, {self.schedule.value}, {self.num_microbatches} micro-batches "
                 f"of {self.micro_batch_size}"]
        if self.recommendation is not None:
            best = self.recommendation
            lines.append(f"  pipeline='auto': recommend_hybrid's best split {best.shape} (pp x tp x dp), predicted "
                         f"peak {best.predicted_peak_bytes / 2**20:.1f} MiB per device")
        for stage in self.stages:
            devices = ", ".join(stage.device_names)
            split = sum(1 for layout in stage.plan.variable_layouts.values() if any(layout))
            lines.append(f"  stage {stage.index}: {stage.layers[0]} .. {stage.layers[-1]} ({len(stage.layers)} "
                         f"layers) on mesh {dict(stage.plan.mesh_shape)} [{devices}], {split} of "
                         f"{len(stage.plan.variable_layouts)} variables split")
        return "\n".join(lines)


def stage_mesh(dp: int, tp: int) -> dict[str, int] | None:
    """A stage's mesh for ``dp`` x ``tp`` devices: the axes of more than one device (None for one
    device, which needs no search)."""
    mesh = {name: size for name, size in (("batch", dp), ("model", tp)) if size > 1}
    return mesh or None


def check_stage_mesh(request: "PipelineRequest", mesh_shape, num_devices: int) -> None:
    """``mesh_shape`` given beside ``pipeline=`` is each stage's mesh: its devices must be a stage's."""
    if mesh_shape is None:
        return
    if request.num_stages is None or request.mesh_shape is not None:
        raise PipelineError("mesh_shape= beside pipeline='auto' or a hybrid plan: the plan fixes each stage's "
                            "mesh; drop mesh_shape")
    size = int(np.prod(list(dict(mesh_shape).values())))
    if size * request.num_stages != num_devices:
        raise PipelineError(
            f"mesh_shape {dict(mesh_shape)} is each pipeline stage's mesh, and {request.num_stages} stages of "
            f"{size} devices are not the {num_devices} devices of the strategy: give a mesh of "
            f"{num_devices // request.num_stages} devices")


def output_gradient_loss(output_gradient, output):
    """The loss a middle stage is captured with: its gradient with respect to ``output`` is
    ``output_gradient``, so the captured backward is the stage's backward in the pipeline."""
    return tf.reduce_sum(tf.cast(output_gradient, output.dtype) * output)


# -- building the stages ---------------------------------------------------------------------

def choose_microbatches(request: PipelineRequest, num_stages: int, batch_size: int) -> int:
    """The request's count, checked against the batch; by default the smallest divisor of the
    batch that fills the pipeline (at least one micro-batch per stage)."""
    if request.num_microbatches is not None:
        if batch_size % request.num_microbatches:
            raise PipelineError(
                f"num_microbatches={request.num_microbatches} does not divide the batch of {batch_size}: choose a "
                "micro-batch count that divides the global batch size, or a batch size it divides")
        return request.num_microbatches
    return next(d for d in range(min(num_stages, batch_size), batch_size + 1) if batch_size % d == 0)


def stage_layers(units, boundaries: tuple[int, ...]) -> list[tuple[str, ...]]:
    """The top-level layer names of each stage, from its units."""
    stops = boundaries[1:] + (len(units),)
    return [tuple(name for unit in units[start:stop] for name in unit.layers)
            for start, stop in zip(boundaries, stops)]


def cut_stage_models(model, layers_per_stage: list[tuple[str, ...]]) -> list:
    """A Keras model per stage, sharing the model's layers: from the tensor entering the
    stage (the model's inputs for the first) to the one leaving it (the outputs for the last)."""
    keras = keras_adapter.keras_of(model)
    if not hasattr(model, "inputs") or not model.inputs or not getattr(model, "_is_graph_network", True):
        raise PipelineError(f"{model.name} has no functional graph (a subclassed model): a pipeline cuts a "
                            "Sequential or functional model between its layers; build it functionally")
    models = []
    entering = model.inputs[0] if len(model.inputs) == 1 else model.input
    for index, names in enumerate(layers_per_stage):
        last = index == len(layers_per_stage) - 1
        leaving = (model.outputs[0] if len(model.outputs) == 1 else model.outputs) if last \
            else model.get_layer(names[-1]).output
        if isinstance(leaving, (list, tuple, dict)):
            raise PipelineError(f"layer {names[-1]!r} ends pipeline stage {index} but has several outputs: "
                                "a stage boundary carries one tensor")
        try:
            models.append(keras.Model(entering, leaving, name=f"{model.name}_stage_{index}"))
        except (ValueError, TypeError) as error:
            raise PipelineError(
                f"pipeline stage {index} ({names[0]} .. {names[-1]}) of {model.name} does not depend on the tensor "
                f"entering it alone ({type(error).__name__}); cut the model where one tensor crosses") from error
        entering = leaving
    return models


def check_disjoint_weights(model, stage_models) -> None:
    """Every weight in exactly one stage: a weight two stages read (tied embeddings) would
    have to live on both stages' devices."""
    owner: dict[int, int] = {}
    for index, stage_model in enumerate(stage_models):
        for weight in stage_model.weights:
            variable = keras_adapter.backing_variable(weight)
            if owner.setdefault(id(variable), index) != index:
                raise PipelineError(
                    f"weight {keras_adapter.variable_path(weight)!r} is read by pipeline stages {owner[id(variable)]} "
                    f"and {index}: each stage holds its own weights; untie the weight or choose stage "
                    "boundaries that keep its readers in one stage")
    missing = {id(keras_adapter.backing_variable(w)) for w in model.weights} - set(owner)
    if missing:
        names = [keras_adapter.variable_path(w) for w in model.weights if id(keras_adapter.backing_variable(w)) in missing]
        raise PipelineError(f"weights {names[:4]} of {model.name} belong to no pipeline stage: a pipeline needs "
                            "every layer on the path from the inputs to the outputs")


def stage_devices(device_set: devices_lib.DeviceSet, index: int, num_stages: int) -> devices_lib.DeviceSet:
    per_stage = device_set.local_count // num_stages
    return dataclasses.replace(device_set, names=device_set.names[index * per_stage:(index + 1) * per_stage])


def at_batch(spec_tree, batch: int):
    """``spec_tree`` with its leading (batch) dims set to ``batch``."""
    def one(spec):
        if not isinstance(spec, tf.TensorSpec) or spec.shape.rank in (None, 0):
            return spec
        return tf.TensorSpec([batch] + spec.shape.as_list()[1:], spec.dtype)
    return tf.nest.map_structure(one, spec_tree)


def boundary_spec(stage_model, batch: int) -> tf.TensorSpec:
    output = stage_model.output
    return tf.TensorSpec([batch] + list(output.shape)[1:], output.dtype)


def build_plan(model, request: PipelineRequest, *, batch_size: int, loss, optimizer, labels, features,
               device_set: devices_lib.DeviceSet, search, memory_budget_bytes, hardware) -> PipelinePlan:
    """Cut ``model`` into the requested stages and plan each on its devices.

    ``search(graph, num_devices=..., mesh_shape=...)`` is the strategy's planner (its method,
    budget and hardware); ``labels`` and ``features`` the specs of one global batch (or None)."""
    from tofu_tf.pipeline import keras_stats

    num_devices = device_set.count
    if device_set.cluster.is_multi_client:
        raise PipelineError("pipeline= runs in one process: a multi-client TofuStrategy plans one mesh over all "
                            "clients; drop pipeline= or run on one host")
    request, recommendation = _resolved(model, request, batch_size=batch_size, loss=loss, optimizer=optimizer,
                                        num_devices=num_devices, memory_budget_bytes=memory_budget_bytes)
    num_stages = request.num_stages
    count = choose_microbatches(request, num_stages, batch_size)
    micro = batch_size // count
    analysis = keras_stats.analyze_model(model, micro_batch=micro, loss=loss, optimizer=optimizer, hardware=hardware)
    units = analysis.units
    if num_stages > len(units):
        raise PipelineError(
            f"{num_stages} pipeline stages need at least {num_stages} pipeline units, and {model.name} has "
            f"{len(units)} (a unit ends where one tensor crosses to the next layer): use at most {len(units)} stages")
    boundaries = request.boundaries
    if boundaries is None:
        boundaries = partition(list(analysis.stats), num_stages, schedule=request.schedule,
                                             num_microbatches=count).boundaries
    elif len(boundaries) != num_stages or boundaries[0] != 0 or list(boundaries) != sorted(set(boundaries)) \
            or boundaries[-1] >= len(units):
        raise PipelineError(f"the plan's stage boundaries {tuple(boundaries)} do not cut {model.name}'s "
                            f"{len(units)} pipeline units into {num_stages} stages: plan this model again")
    layers = stage_layers(units, tuple(boundaries))
    stage_models = cut_stage_models(model, layers)
    check_disjoint_weights(model, stage_models)
    if model.losses:
        raise PipelineError(f"{model.name} adds losses of its own (regularizers, add_loss), which read weights of "
                            "several stages in one op; a pipeline cannot run that yet: drop them or train "
                            "without pipeline=")
    stages = []
    for index, stage_model in enumerate(stage_models):
        devices = stage_devices(device_set, index, num_stages)
        graph = _capture_stage(stage_model, index == num_stages - 1, micro=micro, loss=loss, optimizer=optimizer,
                               labels=labels, features=features if index == 0 else None,
                               entering=None if index == 0 else stage_models[index - 1])
        plan = (OneDevicePlan.of(graph) if devices.count == 1
                else search(graph, num_devices=devices.count, mesh_shape=request.mesh_shape))
        lowered = lowering.lower(plan.mesh_shape, plan.variable_layouts, list(plan.input_layouts.values()), devices)
        stages.append(Stage(index=index, layers=layers[index], model=stage_model, plan=plan, lowered=lowered,
                            weight_paths=keras_adapter.weight_paths(stage_model)))
    return PipelinePlan(schedule=request.schedule, num_microbatches=count, micro_batch_size=micro,
                        stages=tuple(stages), recommendation=recommendation)


def _resolved(model, request: PipelineRequest, *, batch_size, loss, optimizer, num_devices,
              memory_budget_bytes) -> tuple[PipelineRequest, "hybrid_lib.HybridCandidate | None"]:
    """``pipeline="auto"``: the hybrid recommendation's best candidate for the budget, and that
    candidate (None for any other request)."""
    if request.num_stages is not None:
        return request, None
    from tofu_tf.pipeline import keras_stats

    best = keras_stats.recommend_hybrid(model, num_devices=num_devices, batch_size=batch_size, loss=loss,
                                        optimizer=optimizer, memory_budget_bytes=memory_budget_bytes,
                                        num_microbatches=request.num_microbatches,
                                        schedule=request.schedule).best
    logging.info("TofuStrategy: pipeline='auto' takes the recommended %s (pp x tp x dp), %d micro-batches",
                 best.shape, best.num_microbatches)
    return PipelineRequest(best.pp, request.schedule, request.num_microbatches or best.num_microbatches,
                           tuple(best.boundaries), stage_mesh(best.dp, best.tp)), best


def _capture_stage(stage_model, last: bool, *, micro, loss, optimizer, labels, features, entering):
    """The training step of one stage at the micro-batch size, for the planner."""
    from tofu_tf.tf.capture import capture_training_step

    if entering is not None:
        features = boundary_spec(entering, micro)
    elif features is not None:
        features = at_batch(features, micro)
    if last:
        stage_labels = at_batch(labels, micro) if isinstance(labels, tf.TensorSpec) else None
        stage_loss = loss
    else:
        stage_labels, stage_loss = boundary_spec(stage_model, micro), output_gradient_loss
    return capture_training_step(stage_model, batch_size=micro, loss=stage_loss, optimizer=optimizer,
                                 labels=stage_labels, features=features)


__all__ = ["OneDevicePlan", "PipelineError", "PipelinePlan", "PipelineRequest", "Stage", "at_batch",
           "boundary_spec", "build_plan", "check_disjoint_weights", "check_stage_mesh", "choose_microbatches",
           "cut_stage_models", "output_gradient_loss", "stage_devices", "stage_layers", "stage_mesh"]
