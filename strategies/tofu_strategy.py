"""TofuStrategy: plan a Keras model's training step and train it sharded on DTensor.

The user writes::

    with TofuStrategy(num_gpus=8).scope():
        model = build_model()
        model.compile(optimizer="adam", loss=...)
    model.fit(x, y, batch_size=64)

What happens, in order:

1. ``TofuStrategy(...)`` picks devices: ``num_gpus`` GPUs when visible, else
   as many virtual CPU devices (logged).
2. Variables created under ``scope()`` are *deferred*
   (``tofu_tf.tf.variables.DeferredVariable``): shape, dtype, initializer, no
   buffer.
3. At the first step Keras runs (``fit``, ``evaluate`` or ``predict``), the
   strategy finds the model in the step function, captures its training step
   for the real batch shape, plans it (``tofu_tf.search``), lowers the plan to a
   DTensor mesh and layouts, and materializes every deferred variable shard by
   shard in its planned layout. The plan is logged and kept in
   ``strategy.plan``.
4. Each step runs once, in DTensor's global view: inputs are relaid to the
   plan's batch layout, Keras sees one replica (so it does not rescale the
   loss: DTensor gradients are already global), and variables forward their
   in-step writes to later reads (see ``tofu_tf.tf.variables``).

Built on TF's DTensor strategy machinery
(``tensorflow/python/distribute/experimental``), whose Keras integration
loses updates; the differences are marked where they are made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import time
import weakref

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute.experimental import dtensor_strategy_extended
from tensorflow.python.distribute.experimental import dtensor_util

from tofu_tf import plan as plan_lib
from tofu_tf import plan_check
from tofu_tf.cost import hardware as hardware_lib
from tofu_tf.errors import TofuError
from tofu_tf.strategies import batches as batches_lib
from tofu_tf.strategies import generation
from tofu_tf.strategies import eager_calls
from tofu_tf.strategies import expansion_errors
from tofu_tf.strategies import custom_steps
from tofu_tf.strategies import keras_hooks
from tofu_tf.strategies import layout_maps
from tofu_tf.strategies import metric_runs
from tofu_tf.strategies import pipeline_runner
from tofu_tf.strategies import pipelined
from tofu_tf.strategies import step_functions
from tofu_tf.strategies import run_functions
from tofu_tf.strategies import traced_batches
from tofu_tf.strategies import variable_requests
from tofu_tf.tf import devices as devices_lib
from tofu_tf.tf import keras_adapter
from tofu_tf.tf import lowering
from tofu_tf.tf import mesh_captures
from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf import compat
from tofu_tf.tf.compat import batch_concat as compat_batch_concat
from tofu_tf.tf.compat import calls as compat_calls
from tofu_tf.tf.compat import decoding as compat_decoding
from tofu_tf.tf.compat import distributed_inputs as compat_distributed_inputs
from tofu_tf.tf.compat import function_calls as compat_function_calls
from tofu_tf.tf.compat import function_variables as compat_function_variables
from tofu_tf.tf.compat import keras_ops as compat_keras_ops
from tofu_tf.tf.compat import layers as compat_layers
from tofu_tf.tf.compat import optimizers as compat_optimizers
from tofu_tf.tf.compat import process as compat_process
from tofu_tf.tf.compat import summaries as compat_summaries
from tofu_tf.tf.compat import random_draws as compat_random_draws
from tofu_tf.tf.compat import quantized as compat_quantized


class PlanningError(TofuError, RuntimeError):
    """The strategy could not make a plan for the model it was asked to train."""


class UnsupportedInputError(TofuError, NotImplementedError):
    """An input API of ``tf.distribute`` that one SPMD program over the global batch cannot offer."""


class TofuStrategy(distribute_lib.Strategy):
    """Trains a Keras model partitioned across ``num_gpus`` devices by the Tofu planner.

    Args:
      num_gpus: devices to train on. GPUs when that many are visible, else the
        same number of virtual CPU devices (logged as a warning).
      memory_budget_bytes: per-device budget the plan must fit (default: the
        hardware profile's device memory).
      mesh_shape: fix the mesh, e.g. ``{"batch": 2, "model": 4}``; default:
        the planner searches all factorizations of ``num_gpus``. With ``pipeline=`` a stage
        count, each stage's mesh.
      hardware: a ``tofu_tf.cost`` hardware profile or its name; default:
        CPU virtual devices on CPU, H100 NVLink on GPUs.
      method: planner, ``"tofu"`` (default), ``"ilp"``, ``"data_parallel"``
        or ``"megatron"``.
      plan: use this plan instead of planning: a ``tofu_tf.Plan``, its JSON text, the
        path of a JSON file holding it, its dict (``Plan.to_dict()``), or anything with
        ``mesh_shape``, ``variable_layouts`` and ``input_layouts``. It is checked before any
        device or variable is made (every problem named in one ``tofu_tf.PlanError``), each
        variable against its layout as it is made, and its entries against the model's
        variables at the first training step (``tofu_tf.plan_check``).
      plan_cache: where plans are kept between runs (``tofu_tf.plan_cache``): True (default)
        for ``$TOFU_PLAN_CACHE`` or the user's cache directory, a directory, or False for no
        cache. A run that plans the same captured step with the same options takes its plan
        from there instead of searching again, and logs so.
      layout_map: an expert's layouts to keep: a Keras 3 ``keras.distribution.LayoutMap``
        (keras-hub's ``Backbone.get_layout_map(mesh)``) or a tf-keras
        ``tf_keras.dtensor.experimental.LayoutMap``. Its mesh is the plan's mesh; every
        weight a key matches (its optimizer slots with it) gets the key's layout, and the
        planner decides the rest. A key matching no weight, or a layout the weight or
        DTensor cannot take, is refused at planning (``tofu_tf.search.pins.PinError``).
      pipeline: train the model as a pipeline of stages on disjoint groups of devices
        (``tofu_tf.strategies.pipelined``): a stage count (the exact memory partitioner cuts
        the model's units), ``"auto"`` (``tofu_tf.pipeline.recommend_hybrid``'s best PP x TP x DP
        plan for the memory budget), or a plan from ``recommend_hybrid`` (a candidate) or
        ``tofu_tf.pipeline.partition``, used as given. Each stage's sharding over its devices is
        planned by the Tofu planner. None (default): no pipeline.
      num_microbatches: micro-batches per step of a pipeline (default: the plan's, else the
        smallest divisor of the batch that gives every stage one); it divides the batch.
      schedule: the pipeline's schedule, ``"1f1b"`` (default) or ``"gpipe"``.
      graph_optimizations: whether TensorFlow's grappler optimizes the strategy's step programs.
        None (default): not on a mesh of CPU devices, where it runs once per device on the
        host's shared cores and was most of a first step without making steps faster; on GPUs,
        TensorFlow's default (``tofu_tf.tf.compat.calls``).
    """

    def __init__(self, num_gpus: int = 8, *, memory_budget_bytes: int | None = None,
                 mesh_shape=None, hardware=None, method: str = "tofu", plan=None, plan_cache=True, layout_map=None,
                 pipeline=None, num_microbatches: int | None = None, schedule: str = "1f1b",
                 graph_optimizations: bool | None = None):
        pipeline = pipelined.PipelineRequest.read(pipeline, num_microbatches=num_microbatches, schedule=schedule,
                                                  num_devices=num_gpus)
        if pipeline is not None and (plan is not None or layout_map is not None):
            raise pipelined.PipelineError("pipeline= plans each stage itself: drop plan= and layout_map= "
                                          "(or pipeline=)")
        if pipeline is not None:
            pipelined.check_stage_mesh(pipeline, mesh_shape, num_gpus)
        if pipeline is not None and compat_process.uncombine_all_reduces():
            logging.info("TofuStrategy: %s", compat.Applied(compat.change("dtensor_all_reduces_uncombined"), "process",
                                                            f"{compat_process.COMBINE_ALL_REDUCES_ENV}=0"))
        if plan is not None:
            plan = plan_lib.read_plan(plan)
            plan_check.check_plan(plan, num_gpus)   # before devices: a wrong plan costs nothing
        layout_map = None if layout_map is None else layout_maps.read_layout_map(layout_map)
        if layout_map is not None:
            if mesh_shape is not None and dict(mesh_shape) != dict(layout_map.mesh_shape):
                raise ValueError(f"mesh_shape {dict(mesh_shape)} differs from the layout map's mesh "
                                 f"{dict(layout_map.mesh_shape)}: drop mesh_shape (the map's mesh is the plan's)")
            if plan is not None or method not in ("tofu", "ilp"):
                raise ValueError("layout_map= constrains the planner's search: use it with method='tofu' or 'ilp' "
                                 "and without plan=")
            mesh_shape = dict(layout_map.mesh_shape)
        if graph_optimizations not in (None, True, False):
            raise ValueError(f"graph_optimizations={graph_optimizations!r}: pass True (grappler optimizes the step "
                             "programs), False (it does not) or None (the default: not on CPU meshes)")
        device_set = devices_lib.provide_devices(num_gpus)
        if graph_optimizations is None:
            graph_optimizations = compat_calls.graph_optimizations_default(device_set.device_type)
        if not graph_optimizations:
            logging.info("TofuStrategy: %s", compat.Applied(compat_calls.CHANGE, "step programs",
                                                            f"grappler off ({device_set.device_type} mesh)"))
        options = _PlanOptions(memory_budget_bytes=memory_budget_bytes, mesh_shape=mesh_shape,
                               hardware=_hardware_for(hardware, device_set, combined=pipeline is None),
                               method=method, plan_cache=plan_cache, layout_map=layout_map, pipeline=pipeline,
                               graph_optimizations=graph_optimizations)
        super().__init__(_TofuExtended(self, device_set, options, plan))

    @property
    def plan(self):
        """The plan in force (None until the first step or ``plan_model``)."""
        return self.extended._plan

    @property
    def pipeline(self) -> "pipeline_runner.PipelineRunner | None":
        """The runner of a pipelined run once planned (its ``plan`` and the micro-batches each
        stage held at once in the last step, ``inflight_peaks``); None without ``pipeline=``."""
        return self.extended._pipeline

    @property
    def changes(self) -> tuple:
        """What this strategy changed on the user's objects so DTensor can run them, in the order
        made: ``tofu_tf.tf.compat.Applied`` records (the registered change, the layer, model or
        optimizer it was made to, and how), each also logged at INFO when made. Every change
        tofu_tf can make is listed in docs/compatibility.md."""
        return tuple(self.extended._changes)

    @property
    def _mesh(self):
        # tf-keras switches BatchNormalization and its optimizers to DTensor's
        # global view when the strategy has a `_mesh` (dtensor/utils.py).
        return self.extended.mesh

    @property
    def mesh(self) -> dtensor.Mesh:
        return self.extended.mesh

    def plan_model(self, model, *, batch_size: int, loss=None, optimizer=None, features=None):
        """Plan ``model`` now (instead of at its first step) and materialize its variables.

        ``features``: a batch of inputs, or its ``tf.TensorSpec`` structure, for a model
        whose declared inputs leave a dimension open (``keras.Input(shape=(None,))``). For a
        model that writes its own ``train_step`` (a GAN), a batch as ``fit`` passes it to that
        step, which is planned (``tofu_tf.strategies.custom_steps``); required when it has no ``call``.
        """
        if features is not None:
            features = tf.nest.map_structure(_spec_of, features)
        if custom_steps.plans_own_step(model) and (features is not None or custom_steps.plans_only_from_a_batch(model)):
            if features is None:
                custom_steps.refuse_plan_without_data(model)
            if self.plan is None:        # planned from its own train_step, traced on ``features``
                self.extended._prepare(model)  # pylint: disable=protected-access
                self.extended._plan_from_specs(model, keras_hooks.split_step_data((features,)))  # pylint: disable=protected-access
            return self.plan
        self.extended.plan_for(model, batch_size=batch_size, loss=loss, optimizer=optimizer, labels=None,
                               features=features)
        return self.plan

    def check_numerics(self, model, x, y, *, steps: int = 1, batch_size: int | None = None,
                       max_host_bytes: int | None = None, clone=None):
        """Train ``steps`` batches sharded and on one device (the host CPU) from the model's
        current state, compare the weights, and restore the sharded model: a
        ``tofu_tf.strategies.numerics.NumericsReport`` (``print(report.summary())``)."""
        from tofu_tf.strategies import numerics
        return numerics.check_numerics(self, model, x, y, steps=steps, batch_size=batch_size,
                                       max_host_bytes=max_host_bytes, clone=clone)

    def reduce(self, reduce_op, value, axis):
        """``reduce`` in DTensor's global view, in and out of ``tf.function``.

        A step runs once over the whole batch (one replica), so a value ``run``
        returns is already the global one: reducing across replicas leaves it as it
        is, and ``axis`` reduces it along that dim (the batch, for per-sample values),
        as MirroredStrategy's sum or mean over its replicas' slices would. TF's
        DTensor reduce reads layouts, which only works eagerly.
        """
        if isinstance(reduce_op, str):
            reduce_op = tf.distribute.ReduceOp(reduce_op.upper())
        value = tf.nest.map_structure(_global_value, value)
        if axis is None:
            return tf.nest.map_structure(self._whole, value)
        reduce = tf.reduce_mean if reduce_op == tf.distribute.ReduceOp.MEAN else tf.reduce_sum
        return tf.nest.map_structure(lambda v: reduce(v, axis=axis), value)

    def gather(self, value, axis):
        """The global value: with one replica over the whole batch, the concatenation of
        the replicas' values along ``axis`` is the value itself."""
        del axis
        return tf.nest.map_structure(lambda v: self._whole(_global_value(v)), value)

    def _whole(self, value):
        """``value`` as every replica's results together: readable on the host, as
        MirroredStrategy's reduced and gathered values are. A per-sample value a data-parallel
        step leaves split over the batch cannot be copied off the mesh as it is ("Trying to copy
        a non-single-device and non-replicated DTensor"): eagerly it is assembled on the host, in
        a function made replicated on the mesh."""
        if not tf.is_tensor(value) or isinstance(value, tf.Variable) or self.extended._lowered is None:  # pylint: disable=protected-access
            return value
        if tf.executing_eagerly():
            split = dtensor.is_dtensor(value) and not dtensor.fetch_layout(value).is_fully_replicated()
            return batches_lib.to_host(value) if split else value
        return dtensor.relayout(value, dtensor.Layout.replicated(self.mesh, rank=value.shape.rank))


@dataclasses.dataclass(frozen=True)
class ModelFreePlan:
    """The plan of a strategy whose first ``run`` trained no model: one ``batch`` axis over every
    device, no variable split (``_TofuExtended._adopt_data_parallel``)."""

    num_devices: int

    @property
    def mesh_shape(self) -> dict:
        return {"batch": self.num_devices}

    @property
    def variable_layouts(self) -> dict:
        return {}

    @property
    def input_layouts(self) -> dict:
        return {"batch": ("batch",)}

    def summary(self) -> str:
        return (f"data parallel on mesh batch={self.num_devices}, every variable replicated "
                "(the first strategy.run trained no model)")


def _hardware_for(hardware, device_set, *, combined: bool) -> "hardware_lib.HardwareProfile":
    """The profile to plan for: the user's (default: CPU virtual devices on CPU, H100 NVLink on
    GPUs), its node being one client of a multi-client run. The planner prices a mesh axis
    whose device groups span clients at the profile's inter-node link, so it keeps the
    heavy splits inside a client. Not ``combined``: a pipelined strategy, whose process runs
    each all-reduce alone (``compat.process.uncombine_all_reduces``), and is priced so."""
    chosen = hardware_lib.profile(hardware or ("cpu-virtual" if device_set.device_type == "CPU" else "h100-nvlink"))
    if not combined:
        chosen = hardware_lib.without_combining(chosen)
    if device_set.cluster.is_multi_client and chosen.devices_per_node != device_set.local_count:
        logging.info("TofuStrategy: planning for %s with %d devices per node (one client's), not %d",
                     chosen.name, device_set.local_count, chosen.devices_per_node)
        chosen = dataclasses.replace(chosen, devices_per_node=device_set.local_count)
    return chosen


def _layout_digest(plan) -> bytes:
    """SHA-256 of what a plan lowers to (mesh, variable and input layouts): equal on every
    client that would run the same program, whatever each spent searching."""
    content = [list(plan.mesh_shape.items()), sorted((path, list(spec)) for path, spec in plan.variable_layouts.items()),
               sorted((str(key), list(spec)) for key, spec in getattr(plan, "input_layouts", {}).items())]
    return hashlib.sha256(json.dumps(content, default=str).encode()).digest()


@dataclasses.dataclass(frozen=True)
class _PlanOptions:
    """How the strategy plans and runs: what the user passed to TofuStrategy."""

    memory_budget_bytes: int | None
    mesh_shape: object
    hardware: object
    method: str
    plan_cache: object = True     # True: the default directory; a directory; False: none
    layout_map: "layout_maps.LayoutMapSpec | None" = None
    pipeline: "pipelined.PipelineRequest | None" = None
    graph_optimizations: bool = True   # grappler on the step programs (tofu_tf.tf.compat.calls)


class _TofuExtended(dtensor_strategy_extended.DTensorStrategyExtended):
    """DTensor strategy internals with deferred, planned variables."""

    def __init__(self, container_strategy, device_set, options, plan):
        self._devices = device_set
        self._options = options
        compat_function_calls.hold(self)     # a tf.function whose call makes the first plan is called again
        self._plan = None
        self._lowered = None
        self._op_layers = None        # the captured step's layers by op (expansion_errors.OpLayers)
        self._deferred: list[variables_lib.DeferredVariable] = []
        self._passthrough = False
        self._warned_loaded = False
        self._changes: list[compat.Applied] = []
        # The models prepared for DTensor, weakly: an id() would outlive its model, and a new model
        # given the same id after garbage collection would skip its preparation.
        self._prepared: weakref.WeakSet = weakref.WeakSet()
        self._batch_placer: batches_lib.BatchPlacer | None = None
        # A pipelined run (``pipeline=``): its runner once planned, the optimizer's own variables
        # (host variables every stage reads), and whether the optimizer is making its state now.
        self._pipeline: pipeline_runner.PipelineRunner | None = None
        self._optimizer_owned: set[int] = set()
        self._making_optimizer_state = False
        # The plan's unique names (keras_adapter.UniquePaths) of the planned model's weights, by
        # id of their variable, and how often each path shared by several planned variables was made.
        self._plan_names: dict[int, str] = {}
        self._twin_counts: dict[str, int] = {}
        # Which plan entries the variables took: after the first training step, entries no
        # variable took are reported (an error for a plan the user gave).
        self._plan_given = plan is not None
        self._ledger: plan_check.EntryLedger | None = None
        self._entries_checked = False
        # Before a plan exists Keras still asks for a mesh; a 1-D batch mesh over
        # the same devices answers until the planned mesh replaces it.
        self._provisional = lowering.make_mesh({"batch": device_set.count}, device_set)
        super().__init__(container_strategy, self._provisional)
        # tf-keras keeps a fixed `keras.Input(batch_size=...)` global when this is set.
        self._global_batch_size = True
        compat_process.hold_summary_printer(container_strategy)   # undone when no TofuStrategy is alive
        compat_decoding.hold_generate_router(container_strategy)   # likewise
        compat_summaries.hold_summaries(container_strategy)       # tf.summary of a value on the mesh: gathered
        compat_distributed_inputs.hold_distributed_inputs(container_strategy)   # fit(its distributed dataset)
        eager_calls.hold_eager_calls(container_strategy)          # a model called eagerly: on the mesh
        if plan is not None:
            self._adopt(plan)

    # -- mesh and plan ---------------------------------------------------------
    @property
    def mesh(self) -> dtensor.Mesh:
        return self._lowered.mesh if self._lowered is not None else self._provisional

    def _adopt(self, plan) -> None:
        plan_check.check_plan(plan, self._devices.count)
        self._ledger = plan_check.EntryLedger(plan.variable_layouts)
        inputs = list(getattr(plan, "input_layouts", {}).values())
        lowered = lowering.lower(plan.mesh_shape, plan.variable_layouts, inputs, self._devices,
                                 pinned=getattr(plan, "pinned_variables", ()),
                                 gathered_axis=None if self._options.layout_map is None
                                 else self._options.layout_map.data_axis)
        devices_lib.check_clients_agree("plans", _layout_digest(plan), self._devices)
        self._lowered = lowered
        self._mesh = self._lowered.mesh
        self._plan = plan
        compat_function_calls.offer(self, lambda value: self._placer().place(value), batches_lib.to_host)
        summary = plan.summary() if hasattr(plan, "summary") else repr(plan)
        logging.info("TofuStrategy plan:\n%s", summary)
        self._materialize_deferred()
        for model in list(self._prepared):
            self._hint_layouts(model)

    def _explain_refusal(self, error, model_name: str, kind: str):
        """DTensor's refusal to compile a planned step, as ``PlanNotRunnableError``; None for
        another error, or before a plan (``tofu_tf.strategies.expansion_errors``)."""
        if self._plan is None:
            return None
        budget = self._options.memory_budget_bytes
        return expansion_errors.explained(error, model_name=model_name, kind=kind,
                                          mesh_text=plan_check.mesh_text(self._plan.mesh_shape),
                                          budget_text=plan_lib.format_bytes(budget) if budget else None,
                                          op_layers=self._op_layers)

    def plan_for(self, model, *, batch_size, loss, optimizer, labels, features=None) -> None:
        """Plan ``model``'s compiled training step (or one made of ``loss`` and ``optimizer``)."""
        if self._plan is not None:
            return
        if features is not None:
            with self._container_strategy().scope():
                if keras_adapter.build_from_features(model, features):
                    logging.info("TofuStrategy: built %s from its first batch to plan it", model.name)
        from tofu_tf.tf.capture import capture_training_step

        loss = loss if loss is not None else keras_hooks.compiled_loss(model) or "mse"
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None) or "sgd"
        if self._options.pipeline is not None:
            self._plan_pipeline(model, batch_size=batch_size, loss=loss, optimizer=optimizer, labels=labels,
                                features=features)
            return
        self._plan_captured(model, optimizer, batch_size, lambda: capture_training_step(
            model, batch_size=batch_size, loss=loss, optimizer=optimizer, labels=labels, features=features))

    def plan_step_function(self, step_fn, arg_specs, *, model, optimizer) -> None:
        """Plan what a custom loop's step function trains, traced on the specs of its arguments."""
        from tofu_tf.tf.capture import capture_step_function

        batch_size = _batch_size_of(arg_specs)
        self._plan_captured(model, optimizer, batch_size, lambda: capture_step_function(
            step_fn, arg_specs, model=model, optimizer=optimizer))
        if self._all_reduces_combined() is False:
            logging.info("TofuStrategy: the plan of %s runs its all-reduces one by one (%s). A custom loop's "
                         "step is compiled when your tf.function first runs, where the strategy cannot set that: "
                         "DTensor combines them as by default. To run the step as priced, set %s=1 in the "
                         "environment (DTensor reads it at each compile).", model.name,
                         self._plan.all_reduces_combining, compat_calls.GROUP_SIZE_ENV)

    def _all_reduces_combined(self) -> bool | None:
        """The plan's ``all_reduces_combined`` (None before a plan, or for one that does not say:
        a hand-written plan, data parallelism of a run that trains no model)."""
        return getattr(self._plan, "all_reduces_combined", None)

    def _plan_captured(self, model, optimizer, batch_size: int, capture) -> None:
        """Plan the step ``capture()`` traces for ``model``, adopt the plan and make the variables."""
        logging.info("TofuStrategy: planning %s for batch %d on %d %s devices", model.name, batch_size,
                     self._devices.count, self._devices.device_type)
        self._prepare(model)
        for own in _listed(optimizer):
            if not isinstance(own, str):       # a custom loop's own optimizer
                self._record(compat_optimizers.relayout_gradients(own), compat_optimizers.sparse_updates_dense(own),
                             compat_optimizers.unfuse_dense_updates(own))
        self._plan_names = keras_adapter.weight_paths(model)
        start = time.perf_counter()
        with self._creating_plain_variables():
            graph = capture()
            self._op_layers = expansion_errors.OpLayers.of(graph)
            captured = time.perf_counter()
            plan = self._search(graph)
        planned = time.perf_counter()
        self._adopt(plan)
        logging.info("TofuStrategy: captured the step (%d ops) in %.2f s, planned in %.2f s, lowered and "
                     "created the variables shard by shard in %.2f s", len(graph.ops), captured - start,
                     planned - captured, time.perf_counter() - planned)

    def _plan_pipeline(self, model, *, batch_size, loss, optimizer, labels, features) -> None:
        """Cut ``model`` into the requested stages, plan each on its devices, make the variables
        there and run ``fit``/``evaluate``/``predict`` through the pipeline."""
        logging.info("TofuStrategy: planning %s as a pipeline for batch %d on %d %s devices", model.name,
                     batch_size, self._devices.count, self._devices.device_type)
        self._prepare(model)
        start = time.perf_counter()
        with self._creating_plain_variables():
            plan = pipelined.build_plan(
                model, self._options.pipeline, batch_size=batch_size, loss=loss, optimizer=optimizer, labels=labels,
                features=features, device_set=self._devices, search=self._search,
                memory_budget_bytes=self._options.memory_budget_bytes, hardware=self._options.hardware)
        compiled_optimizer = getattr(model, "optimizer", None)
        self._optimizer_owned = set() if compiled_optimizer is None else {
            id(keras_adapter.backing_variable(v)) for v in keras_adapter.optimizer_variables(compiled_optimizer)
            + [v for v in vars(compiled_optimizer).values() if isinstance(v, tf.Variable)]}   # tf-keras' learning rate
        self._plan = plan
        self._lowered = plan.stages[-1].lowered          # metrics and Keras' counters live on the last stage
        self._mesh = self._lowered.mesh
        self._entries_checked = True
        self._pipeline = pipeline_runner.PipelineRunner(model, plan, optimizer_scope=self._optimizer_making_state,
                                                        optimize_graph=self._options.graph_optimizations)
        logging.info("TofuStrategy pipeline:\n%s", plan.summary())
        self._materialize_deferred()
        for stage in plan.stages:
            self._hint_layouts(stage.model, stage.lowered)
        logging.info("TofuStrategy: pipeline planned and its variables made in %.2f s", time.perf_counter() - start)

    @contextlib.contextmanager
    def _optimizer_making_state(self):
        """While a pipelined step applies its gradients: variables the optimizer makes that no
        stage plan names (its step counter) go to the host, where every stage reads them."""
        self._making_optimizer_state = True
        try:
            yield
        finally:
            self._making_optimizer_state = False

    def _search(self, graph, *, num_devices: int | None = None, mesh_shape=None):
        """The plan of ``graph`` under the user's options: from the plan cache when it holds it.
        ``num_devices`` and ``mesh_shape``: a pipeline stage's, in place of the strategy's."""
        from tofu_tf import plan_cache
        from tofu_tf.search import plan_graph, targets

        # Strict: what remains of the ops its layer changes remove is a layer's own use of them.
        targets.check_lowerable(graph, targets.Target.DTENSOR, exempt=frozenset())
        enrolled = compat_decoding.enroll_step_ops(graph.op_type_counts())
        if enrolled:
            logging.info("TofuStrategy: %s: ops DTensor cannot lay out run replicated: %s (%s)",
                         compat_decoding.REPLICATED_CHANGE.name, ", ".join(enrolled), compat_decoding.REPLICATED_CHANGE.why)
        options = dict(num_devices=num_devices or self._devices.count, method=self._options.method,
                       memory_budget_bytes=self._options.memory_budget_bytes,
                       mesh_shape=mesh_shape or self._options.mesh_shape, hardware=self._options.hardware)
        layout_map, stored = self._options.layout_map, {}
        if layout_map is not None:
            stored = layout_map.pinned_layouts([v.path for v in graph.weights()])
            options["pinned_layouts"] = {path: layout_map.computed_layout(layout) for path, layout in stored.items()}
        directory = self._options.plan_cache
        if directory is False or (directory is True and plan_cache.cache_disabled()):
            plan = plan_graph(graph, **options)
        else:
            cache = plan_cache.PlanCache(None if directory is True else directory)
            plan = plan_cache.plan_with_cache(graph, cache=cache, **options).plan
        if stored:       # the map's own layouts are how the weights are stored, their slots with them
            slots = {var.path: stored[var.slot_of] for var in graph.variables.values()
                     if var.slot_of in stored and var.shape == graph.variables[var.slot_of].shape}
            plan = dataclasses.replace(plan, variable_layouts={**plan.variable_layouts, **stored, **slots})
        return plan

    def _prepare(self, model) -> None:
        optimizer = getattr(model, "optimizer", None)
        self._record(compat_optimizers.adopt_optimizer(optimizer, self._container_strategy()),
                     compat_optimizers.defer_slot_zeros(optimizer),
                     compat_optimizers.relayout_gradients(optimizer),
                     compat_optimizers.sparse_updates_dense(optimizer),
                     compat_optimizers.unfuse_dense_updates(optimizer),
                     compat_optimizers.update_moving_averages(optimizer))
        if model in self._prepared:
            self._hint_layouts(model)
            return
        if isinstance(self._plan, ModelFreePlan) and model.weights:
            raise PlanningError(
                f"this TofuStrategy's first strategy.run trained no model, so it runs data parallel with every "
                f"variable replicated, and {model.name} would train unpartitioned: plan {model.name} before that "
                "first run (strategy.plan_model(model, batch_size=...)), or train it under a TofuStrategy of its own.")
        self._prepared.add(model)
        self._record(*keras_hooks.prepare_for_dtensor(model),
                     compat_quantized.install(model, self._container_strategy()),
                     *custom_steps.prepare(model, self._container_strategy()))
        if self._options.pipeline is not None:
            if pipeline_runner.install(model, lambda: self._pipeline):
                self._record(compat.Applied(compat.change("pipeline_step_functions"), model.name,
                                            "fit/evaluate/predict run the pipeline's schedule"))
        else:
            if step_functions.install(model, self._placer, optimize_graph=self._options.graph_optimizations,
                                      explain=self._explain_refusal,
                                      combined_of=self._all_reduces_combined):
                self._record(compat.Applied(compat.change("step_functions"), model.name,
                                            "fit/evaluate/predict run one batch at a time, one program per "
                                            "input signature (a partial last batch included)"))
            if generation.install(model, self._placer, functools.partial(self._plan_from_prompts, model),
                                  optimize_graph=self._options.graph_optimizations):
                self._record(compat.Applied(compat.change(generation.CHANGE_NAME), model.name,
                                            "generate() runs keras-hub's decoding program on the mesh"))
        self._hint_layouts(model)

    def _record(self, *changes) -> None:
        """Log the changes made to the user's objects (None: nothing changed) and keep them
        for ``TofuStrategy.changes``."""
        for applied in changes:
            if applied is not None:
                logging.info("TofuStrategy: %s", applied)
                self._changes.append(applied)

    def _hint_layouts(self, model, lowered: lowering.Lowered | None = None) -> None:
        """Once the plan exists: explicit input relayouts at sharded Dense layers and at convolutions.
        ``lowered``: the plan of the mesh ``model`` runs on (a pipeline stage's)."""
        if self._pipeline is not None and lowered is None:
            return                      # a pipeline hints each stage's layers on its own mesh
        lowered = lowered or self._lowered
        if lowered is None:
            return

        def kernel_specs(kernel):
            variable = keras_adapter.backing_variable(kernel)
            read = getattr(variable, "_tofu_read_layout", None)     # stored split, computed gathered
            if read is not None:
                return tuple(read)
            layout = getattr(variable, "layout", None)
            return None if layout is None else tuple(layout.sharding_specs)

        self._record(*compat_layers.relayout_layer_inputs(model, kernel_specs, lowered.batch_axis, lowered.mesh))
        # A pipeline stage's plan is its own; a hand-written plan (mesh and layouts only) has no op strategies.
        op_strategies = getattr(self._plan, "op_strategies", None) if lowered is self._lowered else None
        if op_strategies:
            self._record(*compat_layers.relayout_statistics_inputs(model, op_strategies, lowered.mesh))

    @contextlib.contextmanager
    def _creating_plain_variables(self):
        """While capturing, variables (the capture's own optimizer) are not the model's."""
        self._passthrough = True
        try:
            yield
        finally:
            self._passthrough = False

    # -- variables -------------------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        for key in ("use_resource", "colocate_with", "expected_shape", "synchronization", "aggregation"):
            kwargs.pop(key, None)
        if self._passthrough:
            return next_creator(**kwargs)
        if kwargs.get("initial_value") is None:
            return self._loaded_variable(next_creator, kwargs)
        variable = self._create_own_variable(kwargs)
        # A tf.function tracing its first call traces again when that trace made variables; this
        # creator never reaches the function's, so the function is told (function_told_of_variables).
        compat_function_variables.tell_tracing_functions(variable)
        return variable

    def _create_own_variable(self, kwargs):
        initial_value = kwargs.pop("initial_value")
        dtype = kwargs.pop("dtype", None)
        shape = variable_requests.initial_shape(initial_value, kwargs.pop("shape", None))
        dtype = tf.as_dtype(dtype) if dtype is not None else variable_requests.initial_dtype(initial_value)
        path = variable_requests.scoped_path(kwargs.get("name"))
        if self._lowered is None:
            compat_process.SUMMARY_PRINTER.refresh()    # tf-keras may be imported after the strategy was made
            compat_distributed_inputs.DISTRIBUTED_INPUTS.refresh()
            compat_decoding.GENERATE_ROUTER.refresh()   # and keras-hub
            eager_calls.refresh_eager_calls()
            variable = variables_lib.DeferredVariable(
                initial_value=initial_value, shape=shape, dtype=dtype, name=kwargs.get("name"),
                trainable=kwargs.get("trainable", True), extra_kwargs=kwargs)
            variable._tofu_path = path  # pylint: disable=protected-access
            variable._distribute_strategy = self._container_strategy()  # pylint: disable=protected-access
            self._deferred.append(variable)
            return variable
        with tf.init_scope():
            deferred = variables_lib.DeferredVariable(
                initial_value=initial_value, shape=shape, dtype=dtype, name=kwargs.get("name"),
                trainable=kwargs.get("trainable", True), extra_kwargs=kwargs)
            deferred._tofu_path = path  # pylint: disable=protected-access
            deferred._distribute_strategy = self._container_strategy()  # pylint: disable=protected-access
            if self._pipeline is not None:
                return self._materialize_in_pipeline([deferred])[0]
            variable = variables_lib.materialize(deferred, self._layout_of(deferred))
            if isinstance(self._plan, ModelFreePlan):
                variable._tofu_exportable = True  # pylint: disable=protected-access
            return variable

    def _loaded_variable(self, next_creator, kwargs):
        """A variable made with no initial value: ``tf.saved_model.load`` (and tf-keras's loader of
        revived objects) makes each variable so, under a creator of its own that leaves it
        uninitialized, and restores the checkpoint's value into it. The functions it restores
        capture each variable's handle as it is made. A deferred variable's handle is replaced when
        the plan materializes it, so those functions read an uninitialized handle and find no model
        to plan ("no Keras model reachable"). The loaded variable is therefore kept as the loader
        makes it: one unpartitioned copy on the host, holding the saved value, as a SavedModel
        loaded outside the scope; under ``strategy.run`` a function reading it runs once per device
        on that device's shard of the batch (``_run_per_device``), which computes what one device
        computes."""
        if not self._warned_loaded:
            self._warned_loaded = True
            logging.warning(
                "TofuStrategy: variables loaded from a SavedModel in strategy.scope() (tf.saved_model.load) are kept "
                "as loaded, unpartitioned on the host: a function reading them runs once per device under "
                "strategy.run, as MirroredStrategy runs a replica. To train a Keras model partitioned, rebuild it "
                "in the scope and load its weights (model.load_weights(<SavedModel directory>/variables/variables)).")
        return next_creator(**kwargs)

    def _default_device_scope(self):
        # No default mesh: Keras 3 computes initial values itself under the
        # scope, with plain ops that must run as ordinary tensors; every
        # variable and step input is put on the mesh explicitly instead.
        return None

    def variable_created_in_scope(self, v):
        ours = (variables_lib.TofuVariable, variables_lib.DeferredVariable)
        if not isinstance(v, ours):        # tf-keras mixed precision wraps float weights in an AutoCastVariable
            v = getattr(v, "_variable", v)
        return isinstance(v, ours)

    def _materialize_deferred(self) -> None:
        with tf.init_scope():
            if self._pipeline is not None:
                self._materialize_in_pipeline(self._deferred)
            else:
                variables_lib.materialize_all((variable, self._layout_of(variable)) for variable in self._deferred)
        self._deferred.clear()

    def _materialize_in_pipeline(self, deferred: list) -> list:
        """Each variable where the pipeline keeps it: a stage's weight or slot on its stage's
        mesh; the optimizer's own (step counter, learning rate) on the host, where ops of every
        stage read them; the rest (metrics, Keras' counters) on the last stage."""
        placed, on_stages = [], []
        for variable in deferred:
            layout = self._plan.layout_for(variable, variable_requests.keras_path(variable))
            if layout is None and variable_requests.is_seed_state(variable):
                layout = self._plan.seed_state_layout(variable)
            if layout is None and (id(variable) in self._optimizer_owned or self._making_optimizer_state):
                placed.append(variables_lib.materialize_on_host(variable))
                continue
            if layout is None:
                layout = dtensor.Layout.replicated(self._lowered.mesh, rank=variable.shape.rank)
            on_stages.append((variable, layout))
            placed.append(variable)
        variables_lib.materialize_all(on_stages)
        for variable, _ in on_stages:
            variable._tofu_host_checkpoint = True  # pylint: disable=protected-access
        return placed

    def _layout_of(self, variable) -> dtensor.Layout:
        quantized = compat_quantized.new_variable_layout(variable_requests.keras_path(variable), variable.shape)
        if quantized is not None:       # an int8 kernel or its scale, made by model.quantize
            return dtensor.Layout(list(quantized), self._lowered.mesh)
        path = self._plan_names.get(id(variable)) or self._twin_name(variable_requests.keras_path(variable))
        path = variable_requests.plan_path(path, self._plan, variable.shape)
        self._ledger.took(variable, path, variable.shape)
        read = self._lowered.read_layouts.get(path)
        if read is not None:
            variable._tofu_read_layout = read  # pylint: disable=protected-access
        return self._lowered.layout_for(path, variable.shape)

    def _check_entries_taken(self, model) -> None:
        """Once a step has made the model's variables: the plan's entries that split a tensor
        and that no variable took. Such an entry was written for another name (a renamed layer,
        another model, a wrong rank under a Keras 3 model prefix) and its variable runs
        replicated: for a plan the user gave, an error before the step runs (it is raised while
        the step is traced); for the planner's own, a warning (a naming bug of tofu_tf's, which
        should not stop training). Waits for the optimizer's first training step: plans name its
        slots, which Keras makes there."""
        optimizer = getattr(model, "optimizer", None) if model is not None else None
        if self._entries_checked or self._plan is None or (
                optimizer is not None and not keras_adapter.optimizer_built(optimizer)):
            return
        created = None if model is None else [variable_requests.created_variable(w) for w in model.weights]
        problems = self._ledger.problems(created)
        if problems and self._plan_given:
            plan_check.raise_problems(
                problems, "the plan given to TofuStrategy",
                "Name each entry by a variable's path (plans from tofu_tf.plan_model use the model's own names; "
                "a suffix of a Keras 3 path matches too), or drop the entry.")
        self._entries_checked = True
        if problems:
            logging.warning("TofuStrategy: the plan has entries no variable took; those variables run "
                            "replicated:\n  %s", "\n  ".join(problems))

    def _twin_name(self, path: str) -> str:
        """The plan's name for a variable made at ``path`` (an optimizer slot made after the
        plan): the path, or where the plan holds several variables at that path (``path``,
        ``path#2``, ...: slots of weights that share a Keras path), the next in creation
        order, as capture named them."""
        layouts = self._plan.variable_layouts
        twins = 1
        while f"{path}#{twins + 1}" in layouts:
            twins += 1
        if twins == 1:
            return path
        count = self._twin_counts.get(path, 0)
        self._twin_counts[path] = count + 1
        return path if count % twins == 0 else f"{path}#{count % twins + 1}"

    # -- what a training library asks of a strategy --------------------------------
    # TensorFlow's V1 strategy base defines these; its DTensor strategy, which this class
    # extends, does not, and Model Garden's run_experiment and Orbit read them.
    @property
    def should_checkpoint(self) -> bool:
        """Every client writes checkpoints, into the same directory: each holds only its own
        shards, which DTensor's checkpoint writes beside the others' (a shared filesystem,
        docs/multi_host.md). A client told not to would write its shards elsewhere (Model
        Garden then saves to a temporary directory) and the checkpoint would miss them."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """Only the first client writes summaries: every client computes the same global values
        (one SPMD program), and one writer keeps the event files free of duplicates."""
        return self._devices.cluster.is_leader

    @property
    def experimental_should_init(self) -> bool:
        """Every client runs initialization: each makes its own shards of every variable."""
        return True
    # -- a model called eagerly outside strategy.run (tofu_tf.strategies.eager_calls) --------
    pipelined = property(lambda self: self._options.pipeline is not None)
    planned = property(lambda self: self._lowered is not None)

    def prepare_model(self, model) -> None:
        self._prepare(model)

    def batch_placer(self) -> batches_lib.BatchPlacer:
        return self._placer()

    def call_model_eagerly(self, model, call, args, kwargs):
        return eager_calls.call_on_mesh(self, model, call, args, kwargs)

    # -- running steps -----------------------------------------------------------
    @property
    def _num_replicas_in_sync(self):
        # DTensor computes the global loss and global gradients in one program;
        # Keras must not divide the loss by a replica count.
        return 1

    def _experimental_distribute_dataset(self, dataset, options):
        """The dataset's batches, each laid out on the planned mesh as it comes.

        Keras distributes the dataset before its first step, so this is where a model is
        planned when ``fit``/``evaluate``/``predict`` start: from the static shapes of
        the batches themselves (``tofu_tf.strategies.batches``), whatever the model declares. A
        custom training loop distributes its data before its first ``run``, which is
        where the strategy learns what the loop trains: until then batches wait on the
        host (``batches.PendingValue``).
        """
        if isinstance(dataset, batches_lib.DistributedBatches):
            # tf-keras distributes a DatasetCreator's dataset (distribute_datasets_from_function)
            # and then again, as it does any dataset not of TF's distributed types: already ours.
            return dataset
        if self._prepare_model_in_stack(dataset) is None and self._lowered is None:
            logging.info("TofuStrategy: a dataset distributed before any plan: its batches stay on the host "
                         "until the first strategy.run plans the model its function trains")
        return batches_lib.DistributedBatches(_without_autotune_thread(dataset), self._placer_if_planned,
                                              on_taken=self._prepare_model_in_stack)

    def _prepare_model_in_stack(self, dataset):
        """The model whose fit/evaluate/predict takes ``dataset`` (Keras distributing it, or taking
        one the user distributed), prepared and, before any plan, planned from its first batch;
        None outside Keras' loops (a custom loop distributing its data)."""
        model = keras_hooks.find_model_in_stack()
        if model is not None:
            self._prepare(model)
            if self._lowered is None:
                self._plan_from_specs(model, keras_hooks.split_step_data((_first_batch_spec(dataset),)))
        return model

    def _make_input_fn_iterator(self, input_fn, replication_mode=None):
        """``strategy.make_input_fn_iterator``: TensorFlow 1's per-replica input, where each replica
        pulls its own batch from the iterator (``experimental_run``, ``call_for_each_replica`` on
        ``get_next()``). TofuStrategy runs one program over the global batch, which DTensor splits
        as the plan says: no replica pulls a batch of its own. Refused, naming the V2 ways to feed
        ``run`` (TensorFlow's own error says only that the API is deprecated)."""
        raise UnsupportedInputError(
            "strategy.make_input_fn_iterator (TensorFlow 1's per-replica input: each replica pulls its own batch) "
            "is not available on TofuStrategy, which runs one SPMD program over the global batch and lays it out "
            "as the plan says. Feed strategy.run from strategy.experimental_distribute_dataset(dataset) (a dataset "
            "of global batches) or strategy.distribute_datasets_from_function(dataset_fn), e.g. "
            "`for batch in strategy.experimental_distribute_dataset(dataset): strategy.run(step, args=(batch,))`.")

    def _distribute_datasets_from_function(self, dataset_fn, options):
        return self._experimental_distribute_dataset(dataset_fn(distribute_lib.InputContext()), options)

    def _placer(self) -> batches_lib.BatchPlacer:
        if self._pipeline is not None:
            return pipeline_runner.HostPlacer()
        if self._batch_placer is None or self._batch_placer.mesh is not self.mesh:
            self._batch_placer = batches_lib.BatchPlacer(self.mesh, self._lowered.batch_axis)
        return self._batch_placer

    def _placer_if_planned(self) -> batches_lib.BatchPlacer | None:
        return None if self._lowered is None else self._placer()

    def call_for_each_replica(self, fn, args=(), kwargs=None):
        kwargs = kwargs or {}
        traced_batches.refuse_run_in_dataset_function()
        if self._options.pipeline is not None:
            raise pipelined.PipelineError(
                "a pipelined TofuStrategy trains through Keras' fit, evaluate and predict, and strategy.run "
                "(a custom training loop, train_on_batch under a strategy.run) is not pipelined: train with "
                "model.fit, or drop pipeline= to run the loop with the tensor plan")
        if keras_adapter.building_functional_model() or self._passthrough:
            # A metric a layer adds in its call (add_metric), updated while tf-keras traces the call
            # to build a functional model or while the step is captured to plan it: symbolic, never run.
            with self._container_strategy().scope(), _GlobalReplicaContext(self._container_strategy()):
                return fn(*args, **kwargs)
        model = keras_hooks.find_model(fn)
        if model is not None:
            self._prepare(model)
        if self._lowered is None:
            with tf.init_scope():                  # capture and the variables' creation run outside any trace
                self._plan_from_step(fn, model, args, kwargs)
        if tf.executing_eagerly():
            args, kwargs = batches_lib.number_lists_as_tensors((args, kwargs))
            fn = metric_runs.metric_as_function(fn)
        args = tf.nest.map_structure(self._to_batch_layout, args)
        kwargs = tf.nest.map_structure(self._to_batch_layout, kwargs)
        if run_functions.captures_off_mesh(fn):
            return self._run_per_device(fn, args, kwargs)
        with self._container_strategy().scope(), _GlobalReplicaContext(self._container_strategy()), \
                self._step_rewrites():
            result = fn(*args, **kwargs)
        self._check_entries_taken(model)
        return tf.nest.map_structure(_as_distributed_value, result)

    @contextlib.contextmanager
    def _step_rewrites(self):
        """While a step runs, on this thread: what DTensor cannot run as Keras or a custom step writes
        it, written as it can (int8 products, batch concatenations, stateless random draws, eager
        tensors the trace captures, Keras 3's slice_update and roll; each a registered change in
        ``tofu_tf.tf.compat`` or ``tofu_tf.tf.mesh_captures``)."""
        with compat_quantized.exact_int8_matmuls(), compat_batch_concat.batch_concats_gathered(self.mesh), \
                compat_random_draws.draws_replicated(self.mesh), mesh_captures.on_mesh(self.mesh), \
                compat_keras_ops.dtensor_expandable_ops():
            yield

    def _run_per_device(self, fn, args, kwargs):
        """Run ``fn`` once per device on its shard of the inputs, as MirroredStrategy runs a
        replica (once, on the whole batch, where the batch is not split): for a function whose
        variables are not on the mesh (a SavedModel loaded, in or outside the strategy's scope), which
        a DTensor program cannot read. The shards' results are joined on the host: ``run``
        returns the global value. Eager only: DTensor unpacks shards eagerly."""
        if not tf.executing_eagerly():
            raise PlanningError(
                "the function passed to strategy.run reads variables that are not on TofuStrategy's mesh (made or "
                "loaded outside strategy.scope()), inside a tf.function: load or create them inside "
                "strategy.scope(), or call strategy.run eagerly (it then runs once per device)")
        name = getattr(fn, "name", getattr(fn, "__name__", "the function"))
        if run_functions.writes_variables(fn):
            raise PlanningError(
                f"the function passed to strategy.run ({name}) writes variables that are not on TofuStrategy's mesh "
                "(a SavedModel loaded with tf.saved_model.load, in or outside strategy.scope()): run once per device, "
                "each device would apply its own update to the one variable, which is not what one device computes. "
                "Rebuild the model in strategy.scope() and load its weights (model.load_weights(<SavedModel "
                "directory>/variables/variables)) to train it.")
        logging.info("TofuStrategy: %s reads variables that are not on the mesh; it runs once per device on "
                     "that device's shard of the batch", name)
        flat = tf.nest.flatten((args, kwargs))
        layout = next((dtensor.fetch_layout(value) for value in flat if tf.is_tensor(value)
                       and dtensor.is_dtensor(value) and value.shape.rank), None)
        if layout is None:
            raise PlanningError("the function passed to strategy.run reads variables that are not on TofuStrategy's "
                                "mesh, and none of its inputs is a batch on the mesh to run it per device on")
        names = list(layout.mesh.local_devices())
        shards = [dtensor.unpack(value) if tf.is_tensor(value) and dtensor.is_dtensor(value) else [value] * len(names)
                  for value in flat]
        if layout.sharding_specs[0] == dtensor.UNSHARDED:
            names = names[:1]
        outputs = []
        for i, name in enumerate(names):
            step_args, step_kwargs = tf.nest.pack_sequence_as((args, kwargs), [shard[i] for shard in shards])
            with tf.device(name), _GlobalReplicaContext(self._container_strategy()):   # a loaded function reads
                outputs.append(fn(*step_args, **step_kwargs))          # its variables only in a replica context
        if layout.sharding_specs[0] == dtensor.UNSHARDED:      # a batch the mesh does not divide: run whole
            return outputs[0]

        def joined(*values):            # the global value, as ``run`` returns it (``_local_results``)
            if not tf.is_tensor(values[0]) or not values[0].shape.rank:
                return values[0]
            with tf.device(devices_lib.host_device()):
                return tf.concat(values, 0)
        return tf.nest.map_structure(joined, *outputs)

    def _plan_from_step(self, fn, model, args, kwargs) -> None:
        """Plan at the first ``run``: Keras' own step function (``train_on_batch``) as the model
        is compiled; a custom loop's function as it is written (``capture_step_function``)."""
        model = keras_hooks.find_model(fn, strict=True) if model is not None else None
        if model is None and not any(variable.trainable and variable_requests.is_keras_weight(variable)
                                     for variable in self._deferred):
            self._adopt_data_parallel()
            return
        if model is None:
            raise PlanningError(
                "TofuStrategy plans at the first strategy.run what the function passed to it trains, and no "
                "Keras model is reachable from that function (its closure, its object's attributes or the "
                "globals it names): call strategy.plan_model(model, batch_size=<global batch size>, "
                "loss=<the step's loss>, optimizer=<the step's optimizer>) before the first run.")
        if keras_hooks.runs_keras_step(fn, model) and (keras_hooks.compiled_loss(model) is not None
                                                       or custom_steps.plans_own_step(model)):
            self._plan_from_specs(model, keras_hooks.split_step_data(tf.nest.map_structure(_spec_of, args)))
            return
        optimizer = keras_hooks.find_optimizer(fn) or getattr(model, "optimizer", None)
        specs = tf.nest.map_structure(_spec_of, (tuple(args), dict(kwargs)))
        if optimizer is None:
            # The function evaluates the model (a loss, a prediction) and trains nothing: plan the
            # model's training step for this run's batch, as predict or an eager call before any fit
            # plans it (its compiled loss or mse, plain SGD).
            logging.warning(
                "TofuStrategy: the function passed to strategy.run reaches %s and no optimizer: planning %s's "
                "training step with plain SGD for this run's batch. To plan the step that will train it, call "
                "strategy.plan_model(model, batch_size=..., loss=..., optimizer=...) before the first run.",
                model.name, model.name)
            self.plan_for(model, batch_size=_batch_size_of(specs), loss=None, optimizer=None, labels=None)
            return
        strategy = self._container_strategy()
        # A step that is a tf.function of its own is traced through its Python function: a trace
        # of the tf.function itself would stay in its cache, holding capture's optimizer slots.
        python_step = getattr(fn, "python_function", fn)

        def in_replica(step_args, step_kwargs):
            with _GlobalReplicaContext(strategy):
                return python_step(*step_args, **step_kwargs)
        with strategy.scope():
            if keras_adapter.build_from_step(model, in_replica, specs, _listed(optimizer)):
                logging.info("TofuStrategy: built %s by tracing the step on its first batch, to plan it", model.name)
        self.plan_step_function(in_replica, specs, model=model, optimizer=optimizer)

    def _plan_train_step(self, model, data) -> None:
        """A model whose class writes its own ``train_step`` (a GAN, a VAE): planned from that step,
        with every optimizer the model holds (``tofu_tf.strategies.custom_steps``)."""
        optimizers = custom_steps.optimizers_of(model)
        strategy = self._container_strategy()

        def in_replica(step_data):
            with _GlobalReplicaContext(strategy):
                return model.train_step(step_data)
        from tofu_tf.tf.capture import capture_step_function
        specs = (tf.nest.map_structure(_spec_of, data),)
        with strategy.scope():      # as under strategy.run: capture's optimizers record this strategy
            self._plan_captured(model, optimizers, _batch_size_of(specs), lambda: custom_steps.refuse_stateful_draws(
                capture_step_function(in_replica, specs, model=model, optimizer=optimizers), model))

    def _adopt_data_parallel(self) -> None:
        """A first ``run`` whose function trains nothing a plan could split: it reaches no Keras
        model and no Keras layer's weight was made in the scope (metrics, a reduction, a custom
        loop's evaluation, a SavedModel loaded in or outside the scope, a ``tf.Module``'s or a bare
        ``tf.Variable``). It runs as MirroredStrategy would: variables replicated, each batch
        split over all devices where it divides; one global DTensor program, so a step computes
        what one device computes. No model can be planned by this strategy
        after that (its mesh is fixed): ``_prepare`` refuses one, naming what to do.
        Its variables (replicated, read by functions that carry no layouts of a plan) can be
        saved in a SavedModel as one device's (``TofuVariable._export_to_saved_model_graph``)."""
        plan = ModelFreePlan(self._devices.count)
        trainable = [variable_requests.keras_path(variable) for variable in self._deferred if variable.trainable]
        logging.warning("TofuStrategy: the function passed to strategy.run trains no Keras model (it reaches none, "
                        "and no Keras layer's weight was made in strategy.scope()): it runs data parallel over %d "
                        "devices, variables replicated%s. Plan a model before such a run to partition it.",
                        self._devices.count,
                        f" (trainable, not a Keras layer's: {', '.join(trainable[:5])})" if trainable else "")
        model_free = list(self._deferred)
        self._adopt(plan)
        for variable in model_free:
            variable._tofu_exportable = True  # pylint: disable=protected-access

    def _plan_from_prompts(self, model, prompts) -> None:
        """Plan ``model`` from its first prompts when ``generate`` comes before any step (a
        model loaded under the scope): its training step for a batch of their shape, as
        ``predict`` before ``fit`` plans it."""
        if self._lowered is None:
            features = tf.nest.map_structure(_spec_of, prompts)
            self.plan_for(model, batch_size=_batch_size_of(features), loss=None, optimizer=None, labels=None,
                          features=features)

    def prepare_generation(self, model) -> None:
        """Give a keras-hub text generator made in this strategy's scope its placed decoding
        program before any step prepared it (``tofu_tf.strategies.generation``)."""
        if self._options.pipeline is not None:
            raise pipelined.PipelineError(
                f"{model.name}.generate() runs one decoding program over the whole model, and a pipelined "
                "TofuStrategy keeps its stages on separate devices: generate under a TofuStrategy without "
                "pipeline= (the weights load into it with model.load_weights), or on one device")
        self._prepare(model)

    def _plan_from_specs(self, model, step: keras_hooks.StepInputs) -> None:
        if custom_steps.plans_own_step(model):
            if self._options.pipeline is not None:
                custom_steps.refuse_pipeline(model)
            if custom_steps.has_call(model) and step.features is not None:
                with self._container_strategy().scope():     # unbuilt (a WideDeepModel fit as made): its weights
                    if keras_adapter.build_from_features(model, step.features):
                        logging.info("TofuStrategy: built %s from its first batch to plan it", model.name)
            self._plan_train_step(model, step.data)
            return
        labels = step.labels if isinstance(step.labels, tf.TensorSpec) else None
        self.plan_for(model, batch_size=_batch_size_of(step.features), loss=None, optimizer=None,
                      labels=labels, features=step.features)

    def _to_batch_layout(self, value):
        """Inputs of a step, on the planned mesh in the plan's batch layout.

        In a graph, inputs come from the distributed dataset and already carry
        layouts; eager tensors passed to ``run`` are copied onto the mesh.
        """
        if isinstance(value, (batches_lib.PendingValue, traced_batches.PendingLoopValue)):   # taken before the plan
            return value.placed()
        if not tf.executing_eagerly():
            return value
        return self._placer().place(value)

    def _update(self, var, fn, args, kwargs, group):
        """``extended.update`` in the global view: the one global variable updated once.
        tf-keras's legacy optimizers update every weight through it. Ungrouped, each result
        comes as its local results (one: the global value), as every strategy returns them."""
        result = fn(var, *args, **(kwargs or {}))
        return result if group else tf.nest.map_structure(lambda value: (value,), result)

    def _reduce_to(self, reduce_op, value, destinations, options):
        return value

    def _local_results(self, value):
        """One local result: the global value (one replica runs over the whole batch); eagerly,
        readable on the host (``TofuStrategy._whole``). In a function it stays in its layout:
        Keras reads a step's outputs there, and a sharded head's logits made whole on every
        device would cost what sharding saved."""
        value = _global_value(value)
        return (self._container_strategy()._whole(value) if tf.executing_eagerly() else value,)  # pylint: disable=protected-access


def _spec_of(value):
    """The spec of a batch's value (a tensor, an array or a spec); other values pass through."""
    if isinstance(value, tf.TensorSpec):
        return value
    if isinstance(value, (batches_lib.PendingValue, traced_batches.PendingLoopValue)):
        return value.spec
    if tf.is_tensor(value) or hasattr(value, "shape") and hasattr(value, "dtype"):
        return tf.TensorSpec(value.shape, tf.as_dtype(value.dtype))
    return value


def _first_batch_spec(dataset):
    """The specs of the dataset's batches: its element spec when every dim is static,
    else the shapes of its first batch (a ``.batch(b)`` pipeline leaves the batch dim
    open; keras-hub task models build such pipelines from numpy)."""
    spec = dataset.element_spec
    if all(s.shape.is_fully_defined() for s in tf.nest.flatten(spec) if isinstance(s, tf.TensorSpec)):
        return spec
    for batch in dataset.take(1):
        return tf.nest.map_structure(_spec_of, batch)
    raise PlanningError("TofuStrategy was given an empty dataset: it plans from the shapes of the first batch.")


def _listed(optimizer) -> list:
    """One optimizer or several (a list, or the ListWrapper of a model's list attribute) as a list."""
    return list(optimizer) if keras_adapter.is_sequence(optimizer) else [optimizer]


def _batch_size_of(features) -> int:
    leaves = [s for s in tf.nest.flatten(features) if isinstance(s, tf.TensorSpec)]
    if not leaves or leaves[0].shape.rank in (None, 0) or leaves[0].shape[0] is None:
        raise PlanningError(
            "TofuStrategy plans from the static shapes of a batch, and this batch's size is unknown: "
            "pass tensors or numpy arrays whose first dimension is the batch.")
    return int(leaves[0].shape[0])


def _without_autotune_thread(dataset):
    """Turn tf.data's autotuning off unless the user chose a setting.

    An autotuned iterator runs a model thread that sleeps between tuning
    rounds, each round twice as long as the last (up to a minute), and on
    TF 2.21 deleting the iterator waits for that sleep to end: ``fit`` and
    ``evaluate`` returned 1-9 s after their last step on 8 virtual CPUs, and
    up to 50 s on a third ``fit`` (measured; the main thread blocks in
    ``RootDataset::Iterator``'s destructor). DTensor makes one iterator per
    device. With autotuning off, ``AUTOTUNE`` parallelism falls back to the
    core count and prefetch buffers keep their own (legacy) tuning; the
    steps took as long as before.
    """
    if dataset.options().autotune.enabled is not None:
        return dataset
    logging.log_first_n(logging.INFO, "TofuStrategy: tf.data autotuning off for distributed datasets (an "
                        "autotuned iterator delays the end of fit/evaluate by seconds); set "
                        "tf.data.Options().autotune.enabled on your dataset to choose", 1)
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


class _GlobalReplicaContext(dtensor_util.DTensorReplicaContext):
    """The replica context of one global DTensor program.

    TF's DTensor replica context raises on all_reduce/merge_call. In the global
    view a value is already reduced over the batch, so all_reduce returns it and
    merge_call runs the function once, in cross-replica mode.
    """

    def merge_call(self, merge_fn, args=(), kwargs=None):
        with _cross_replica(self._strategy):
            return merge_fn(self._strategy, *args, **(kwargs or {}))

    def all_reduce(self, reduce_op, value, options=None):
        return value

    def _update(self, var, fn, args=(), kwargs=None, group=True):
        return fn(var, *args, **(kwargs or {}))


@contextlib.contextmanager
def _cross_replica(strategy):
    distribute_lib._push_per_thread_mode(distribute_lib._CrossReplicaThreadMode(strategy))  # pylint: disable=protected-access
    try:
        yield
    finally:
        distribute_lib._pop_per_thread_mode()  # pylint: disable=protected-access


def _global_value(value):
    """The one global tensor behind a value ``run`` returned."""
    return value.get_dtensor() if isinstance(value, dtensor_util.DTensorDistributedValue) else value


class _GlobalDistributedValue(dtensor_util.DTensorDistributedValue):
    """A value ``run`` returned, which reads as its global value on the host (``numpy()``), as a
    tensor does: ``tf.test.TestCase.evaluate`` of a run's result (a metric's) read none."""

    def numpy(self):
        return np.asarray(batches_lib.to_host(self.get_dtensor()))


def _as_distributed_value(value):
    if tf.is_tensor(value) and not isinstance(value, tf.Variable):
        return _GlobalDistributedValue(value)
    return value
