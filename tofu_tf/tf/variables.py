"""Variables that TofuStrategy creates: deferred until planned, then sharded.

Two problems live here, and only here:

* **Never materialize a full-size weight.** Under ``TofuStrategy.scope()`` a
  variable is first a ``DeferredVariable``: an uninitialized handle with a
  shape, a dtype, a path and the initializer Keras gave it, and no buffer.
  Once the plan exists, ``materialize`` runs the initializer under the planned
  DTensor layout, so each device computes only its own shard, and turns the
  same Python object into a ``TofuVariable`` (layers, optimizers and
  checkpoints keep the object they hold). A constant fill (zeros, ones) is
  filled shard by shard on the mesh, and so is a tf-keras uniform draw split by
  rows, by global index (``tofu_tf.tf.compat.counter_draws``). Any other random
  initial value is drawn whole on the host, one variable at a time, and each
  device receives its shard: a
  draw under a split layout is another random stream than one device's
  (DTensor folds each device's coordinates into the seed), and the run must
  not depend on the plan (docs/numerics.md). A weight read, set or loaded
  before the plan also exists whole on the host, and the plan lays that value out.
* **Read-after-write inside one step.** DTensor does not keep the order of a
  write and a later read of the same variable when the step's inputs are
  batch-sharded: an optimizer that writes a slot and then reads it (SGD with
  momentum, Adam) reads the old value, so the first update is lost and every
  later one lags by a step (checked on TF 2.21; ../shared/NOTES.md reports the
  symptom for TF's own DTensor strategy). A ``TofuVariable`` therefore
  forwards its last written value to later reads in the same graph: the read
  depends on the write by data, which no scheduler can reorder.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.dtensor.python import d_variable
from tensorflow.experimental import dtensor
from tensorflow.python.eager import record
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import constants as trackable_constants

from tofu_tf.errors import TofuError
from tofu_tf.tf import devices, keras_adapter
from tofu_tf.tf.compat import counter_draws as compat_counter_draws
from tofu_tf.tf.compat import initializer_seeds as compat_initializer_seeds
from tofu_tf.tf.compat import process as compat_process


# The debug name every TofuVariable's handle op carries: DTensor runs each eager op as a small
# SPMD program, cached by the op's attributes, and TensorFlow gives a variable's VarHandleOp the
# variable's name as its debug_name, so every variable missed the cache and compiled its own
# handle program, a noticeable part of a small model's first fit. With one debug name the
# program is compiled once per shape and layout.
# The variable's ``name`` is unchanged. The change "handle_debug_name" (tofu_tf.tf.compat).
HANDLE_DEBUG_NAME = "tofu_variable"


class TofuVariable(d_variable.DVariable):
    """A DTensor variable whose in-graph reads see its in-graph writes."""

    def __init__(self, *args, **kwargs):
        with compat_process.one_handle_debug_name(HANDLE_DEBUG_NAME):
            super().__init__(*args, **kwargs)

    def __getitem__(self, spec):
        return super().__getitem__(spelled_out(spec, self.shape.rank))

    def _written_values(self) -> weakref.WeakKeyDictionary:
        written = self.__dict__.get("_tofu_written")
        if written is None:
            written = weakref.WeakKeyDictionary()
            self.__dict__["_tofu_written"] = written
        return written

    def _read_variable_op(self, no_copy=False):
        if not tf.executing_eagerly():
            value = self._written_values().get(tf.compat.v1.get_default_graph())
            if value is not None:
                return self._forwarded_read(value)
        return super()._read_variable_op(no_copy=no_copy)

    def _forwarded_read(self, value):
        """The last written value as a read of this variable, to a gradient tape too: a second
        step traced in the same function (a loop over batches inside a tf.function) reads
        forwarded values, and a tape asked for the gradient of this variable found no read of
        it (every gradient None). It is recorded as TF records a ReadVariableOp: a leaf whose
        gradient is the variable's; the write's own inputs get none through it."""
        resource_variable_ops.variable_accessed(self)
        result = tf.identity(tf.stop_gradient(value))
        record.record_operation("ReadVariableOp", [result], [self.handle],
                                backward_function=lambda x: [x], forward_function=lambda x: [x])
        return result

    def _as_read(self, value):
        """``value`` (a read of this variable) in the layout it is computed with, where that
        differs from how it is stored (``Lowered.read_layouts``: a weight a layout map splits
        over its data axis, gathered over it; a table split by rows, read whole). The
        relayout's gradient lays the dense gradient out as the variable is stored, so the
        optimizer updates shards."""
        read = self.__dict__.get("_tofu_read_layout")
        if read is None:
            return value
        computed = dtensor.Layout([dtensor.UNSHARDED if a is None else a for a in read], self.layout.mesh)
        stored = self.layout

        @tf.custom_gradient
        def gathered(x):
            def gradient(dy):
                # A lookup's gradient stays sparse, as on one device: Keras 3's Adam squares
                # the sparse gradient's rows before summing duplicates, a dense one after.
                if isinstance(dy, tf.IndexedSlices):
                    return dy
                # First as computed: DTensor would otherwise carry the stored layout back
                # into the matmul that makes dy, whose expander refuses it.
                return dtensor.relayout(dtensor.relayout(tf.convert_to_tensor(dy), computed), stored)
            return dtensor.relayout(x, computed), gradient
        return gathered(value)

    def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
        value = super()._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)
        return value if as_ref else self._as_read(value)

    def numpy(self):
        """The full value on the host, assembled from the shards.

        DTensor refuses to copy a sharded tensor off its mesh; assembling on
        the host keeps one full copy there and none on any device.
        """
        if not tf.executing_eagerly():
            raise NotImplementedError("numpy() is only available eagerly")
        return gather_to_host(self.read_value(), self.layout)

    # A pipeline's stages live on several meshes, and TensorFlow's checkpoint writer saves the
    # variables of several meshes in one function, which DTensor cannot compile (one mesh per
    # program): a stage's variable (``_tofu_host_checkpoint``) is written and read through the
    # host, as one device's checkpoint holds it.
    def _serialize_to_tensors(self):
        if not (self.__dict__.get("_tofu_host_checkpoint") and tf.executing_eagerly()):
            return super()._serialize_to_tensors()
        with tf.device(devices.host_device()):
            return {trackable_constants.VARIABLE_VALUE_KEY: tf.constant(self.numpy())}

    def _restore_from_tensors(self, restored_tensors):
        if not (self.__dict__.get("_tofu_host_checkpoint") and tf.executing_eagerly()):
            return super()._restore_from_tensors(restored_tensors)
        value = restored_tensors[trackable_constants.VARIABLE_VALUE_KEY]
        return super().assign(scatter_from_host(np.asarray(value), self.layout))

    def _write(self, value, use_locking, name, read_value):
        value = dtensor.relayout(tf.convert_to_tensor(value, dtype=self.dtype), self.layout)
        result = super().assign(value, use_locking, name, read_value)
        if not tf.executing_eagerly():
            self._written_values()[tf.compat.v1.get_default_graph()] = value
        return result

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return self._write(value, use_locking, name, read_value)

    # Sparse updates (an Embedding's gradient under Adam) become dense ones:
    # DTensor has no layout propagation for ResourceScatterAdd, and adding a
    # densified IndexedSlices (duplicates summed) is the same update.
    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        return self.assign_add(self._densify(sparse_delta), use_locking, name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        return self.assign_sub(self._densify(sparse_delta), use_locking, name)

    def _densify(self, sparse_delta):
        return tf.math.unsorted_segment_sum(sparse_delta.values, sparse_delta.indices, self.shape[0])

    def sparse_read(self, indices, name=None):
        """A gather of rows (an Embedding's lookup) whose gradient arrives laid out
        like this variable's rows: unsplit over the gathered positions, its
        feature dims split as this variable's.

        Keras sums duplicate rows of the sparse gradient into a tensor whose row
        count depends on the data, and DTensor cannot relayout such a tensor:
        splitting one of its dims leaves every shard with zero rows, gathering one
        aborts the process. Left to itself, DTensor's layout propagation asks for
        that relayout whenever the gradient reaching the lookup is not split like
        the variable it updates (a replicated head after a feature-split
        embedding). Laying the gradient out before the rows are deduplicated keeps
        every later tensor in the variable's layout."""
        read = self.__dict__.get("_tofu_read_layout")
        if read is not None:
            value = tf.gather(self._as_read(self._read_variable_op()), indices, name=name)
        else:
            value = super().sparse_read(indices, name=name)
        if value.shape.rank is None:
            return value
        positions = value.shape.rank - (self.shape.rank - 1)
        features = list(self.layout.sharding_specs[1:]) if read is None else \
            [dtensor.UNSHARDED if a is None else a for a in read[1:]]
        rows = dtensor.Layout([dtensor.UNSHARDED] * positions + features, self.layout.mesh)
        return _gradient_relaid(value, rows)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        if tf.executing_eagerly():
            return super().assign_add(delta, use_locking, name, read_value)
        return self._write(self._read_variable_op() + delta, use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        if tf.executing_eagerly():
            return super().assign_sub(delta, use_locking, name, read_value)
        return self._write(self._read_variable_op() - delta, use_locking, name, read_value)

    def _export_to_saved_model_graph(self, object_map, tensor_map, options, **kwargs):
        """Refuse to enter a SavedModel: a DTensor resource (and the ``Relayout`` ops of the
        functions that read it) cannot run in a one-device runtime or TF Serving. A model's
        own exports go through a one-device copy (``tofu_tf.strategies.export``); reaching here means
        something else tracked this variable directly. Except a variable of a strategy that runs no
        plan (``_tofu_exportable``: data parallel, every variable replicated, no layer relaid): its
        SavedModel holds a plain variable, as one device's, and the saved value is the one value."""
        if self.__dict__.get("_tofu_exportable") and self.layout.is_fully_replicated():
            return super()._export_to_saved_model_graph(object_map, tensor_map, options, **kwargs)
        raise DTensorExportError.for_variable(_base_name(self.name))


def spelled_out(spec, rank: int | None):
    """A slice spec with a new axis (``None``) made to name every axis: the
    ellipsis and the axes after the spec's end become ``:``. ``table[None]`` and
    ``table[None, :, :]`` are the same slice, but TF 2.21's DTensor crashes on the
    first in every layout (``tofu_tf.search.targets`` lists why). Any other spec is
    returned as it is."""
    items = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
    if rank is None or not any(item is None for item in items) or not all(map(_basic_index, items)):
        return spec
    missing = rank - sum(1 for item in items if item is not None and item is not Ellipsis)
    if missing < 0:
        return spec  # too many indices: TF says so
    full = (slice(None),) * missing
    at = next((i for i, item in enumerate(items) if item is Ellipsis), None)
    return items + full if at is None else items[:at] + full + items[at + 1:]


def _basic_index(item) -> bool:
    if item is None or item is Ellipsis or isinstance(item, slice):
        return True
    if isinstance(item, (bool, np.bool_)):
        return False
    if isinstance(item, (int, np.integer)):
        return True
    return isinstance(item, tf.Tensor) and item.shape.rank == 0 and item.dtype.is_integer


def _gradient_relaid(value, layout: dtensor.Layout):
    """``value`` unchanged; its gradient relaid to ``layout``."""
    @tf.custom_gradient
    def identity(x):
        return tf.identity(x), lambda dy: dtensor.relayout(tf.convert_to_tensor(dy), layout)
    return identity(value)


def gather_to_host(value, layout: dtensor.Layout) -> np.ndarray:
    """Assemble a DTensor's full value in host memory from its device shards.

    On a mesh spanning several clients this process holds only its own shards, so
    the value is first replicated over the mesh (an all-gather every client joins:
    every client must gather the same values in the same order, as the same
    training script on every client does)."""
    if not layout.is_fully_replicated() and len(layout.mesh.local_device_ids()) < layout.mesh.size:
        value = dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, rank=layout.rank))
        layout = dtensor.fetch_layout(value)
    if layout.is_fully_replicated():
        return dtensor.unpack(value)[0].numpy()
    shards = dtensor.unpack(value)
    out = np.empty(value.shape, dtype=value.dtype.as_numpy_dtype)
    for shard, location in zip(shards, layout.mesh.local_device_locations()):
        out[_shard_index(layout, location, shard.shape)] = shard.numpy()
    return out


def scatter_from_host(value, layout: dtensor.Layout) -> tf.Tensor:
    """Lay a full host value out by ``layout``: each device receives only its shard.

    The inverse of ``gather_to_host``. ``copy_to_mesh`` followed by a relayout
    would first put a full copy on every device of the mesh.
    """
    value = np.asarray(value)
    local_shape = layout.local_shape_from_global_shape(value.shape)
    return _pack_per_device(layout, lambda location: tf.constant(value[_shard_index(layout, location, local_shape)]))


def sharded_zeros(shape, dtype, layout: dtensor.Layout) -> tf.Tensor:
    """Zeros laid out by ``layout``, each device allocating only its own shard.

    An optimizer slot starts here. ``dtensor.call_with_layout(tf.zeros, ...)``
    gives the same value but holds two slot-sized buffers at its peak (measured
    on 8 virtual CPUs); packing per-device zeros holds one.
    """
    local_shape = layout.local_shape_from_global_shape(tuple(shape))
    return _pack_per_device(layout, lambda location: tf.zeros(local_shape, dtype))


def _pack_per_device(layout: dtensor.Layout, make_shard) -> tf.Tensor:
    """A DTensor whose shard on each device is ``make_shard(location)``, built on that device."""
    shards = []
    for device, location in zip(layout.mesh.local_devices(), layout.mesh.local_device_locations()):
        with tf.device(device):
            shards.append(make_shard(location))
    return dtensor.pack(shards, layout)


def _shard_index(layout: dtensor.Layout, location: dict, local_shape) -> tuple:
    """The slice of the full value that the device at mesh ``location`` holds."""
    index = []
    for dim, axis in enumerate(layout.sharding_specs):
        size = local_shape[dim]
        start = location[axis] * size if axis != dtensor.UNSHARDED else 0
        index.append(slice(start, start + size))
    return tuple(index)


class DeferredVariable(resource_variable_ops.UninitializedVariable):
    """A variable waiting for its layout: shape, dtype and initializer, no buffer.

    It can be traced (capture only needs shapes). Read eagerly before the plan
    exists, it takes a value on the host (see ``_host_value``), which the plan
    then lays out.
    """

    def __init__(self, *, initial_value, shape, dtype, name, trainable, extra_kwargs):
        super().__init__(shape=shape, dtype=dtype, name=name, trainable=trainable)
        # The seed one device's creation gives an unseeded tf-keras initializer, chosen now,
        # in creation order, whatever order the value is later read or planned in.
        compat_initializer_seeds.pin_seed(initial_value)
        # A Keras 3 initializer seeded with a SeedGenerator takes the generator's state now,
        # as one device's creation does (None: one whose draws are unknown, drawn now).
        pinned = compat_initializer_seeds.pin_generator_state(initial_value)
        self._tofu_initial_value = initial_value if pinned is None else pinned
        self._tofu_kwargs = dict(extra_kwargs)
        self._tofu_host = None
        if pinned is None:
            self._host_value()

    def _host_value(self) -> np.ndarray:
        """The variable's value in host memory, computed from its initializer at the first eager use.

        Keras reads and sets bookkeeping variables (step counters, the learning
        rate, a metric's total) before the first step, and capture reads the
        optimizer's configuration. Giving each a buffer on a provisional mesh and
        moving it to the planned one cost 0.03-0.1 s per variable; a host value
        costs nothing. Users read weights before the plan too, to copy, save or
        log them (``get_weights``, ``numpy()``, ``save_weights``): the variable
        read, and only it, is then computed whole on the host, once, and
        ``materialize`` lays out that value, so what was read is what trains. It
        is the value the plan would draw (the same initializer and seed, drawn on
        the host either way), so reading changes nothing, but a ``SeedGenerator``
        seed or a plain callable could give other numbers a second time; the host
        therefore holds it until the plan, so reading every weight before the plan
        keeps a full copy of the model's weights in host memory until the plan
        replaces them with their shards.
        """
        if self._tofu_host is None:
            if not self.shape.is_fully_defined():
                raise DeferredVariableError(self.name)
            initial = self._tofu_initial_value
            self._set_host_value(initial() if callable(initial) else initial)
        return self._tofu_host

    def _set_host_value(self, value) -> None:
        with tf.device(devices.host_device()):
            host = tf.convert_to_tensor(value, dtype=self.dtype).numpy()
        self._tofu_host = np.array(np.broadcast_to(host, self.shape.as_list()))
        self._tofu_initial_value = self._tofu_host  # what ``materialize`` lays out

    def numpy(self):
        return self._host_value().copy()

    def __getitem__(self, spec):
        return super().__getitem__(spelled_out(spec, self.shape.rank))

    def _read_variable_op(self, no_copy=False):
        if not tf.executing_eagerly():
            return super()._read_variable_op(no_copy=no_copy)
        with tf.device(devices.host_device()):
            return tf.constant(self._host_value())

    def _write(self, method: str, combine, value, use_locking, name, read_value):
        """Traced writes go into the graph; eager ones update the host value
        (``_host_value``), where ``materialize`` lays it out. A whole new value (loading
        weights before the plan: ``load_weights``, a checkpoint restore) computes
        nothing from the initializer."""
        if not tf.executing_eagerly():
            return getattr(super(), method)(value, use_locking, name, read_value)
        if method == "assign":
            self._set_host_value(value)
        else:
            self._set_host_value(combine(self._host_value(), np.asarray(value)))
        return self if read_value else None

    def _serialize_to_tensors(self):
        """A checkpoint saved before the plan holds the value the plan will lay out.

        TensorFlow leaves an uninitialized variable out of a checkpoint without a word, and
        restoring the checkpoint then fails (``Key ... not found in checkpoint``). The saved
        value is the host value a read before the plan takes (``_host_value``)."""
        if not tf.executing_eagerly() or (self._tofu_host is None and self._tofu_initial_value is None):
            return super()._serialize_to_tensors()   # nothing to save yet (a SavedModel loader's variable)
        return {trackable_constants.VARIABLE_VALUE_KEY: tf.constant(self._host_value())}

    def _restore_from_tensors(self, restored_tensors):
        """A checkpoint restore writes the handle directly, which ``materialize``
        replaces: it goes through ``assign`` instead, so the restored value is kept."""
        value = restored_tensors[trackable_constants.VARIABLE_VALUE_KEY]
        self.assign(value)
        return self.handle

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return self._write("assign", lambda old, new: new, value, use_locking, name, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self._write("assign_add", np.add, delta, use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self._write("assign_sub", np.subtract, delta, use_locking, name, read_value)


class DeferredVariableError(TofuError, RuntimeError):
    def __init__(self, name):
        super().__init__(
            f"variable {name!r} has no value yet: TofuStrategy creates variables once the model "
            "is planned, at the first fit/evaluate/predict call or at strategy.plan_model(model, ...). "
            "Call one of those before reading weights.")


class DTensorExportError(TofuError, RuntimeError):
    """A SavedModel export of a TofuStrategy model that cannot be made as one device would make it."""

    @classmethod
    def for_variable(cls, name: str) -> "DTensorExportError":
        return cls(
            f"variable {name!r} lives on TofuStrategy's DTensor mesh, and a SavedModel holding it (with the "
            "Relayout ops of the functions reading it) would not run on one device or in TF Serving. Export the "
            "model itself (model.save(dir), tf.saved_model.save(model, dir), model.export(dir) save a one-device "
            "copy of it), or build tofu_tf.one_device_copy(model) and trace your signatures or archive on that.")


def materialize(variable: DeferredVariable, layout: dtensor.Layout, *, drawn_value=None) -> TofuVariable:
    """Give ``variable`` its buffer, sharded by ``layout``, in place.

    A tf-keras constant fill (zeros, ones) is called with its layout inside a
    function, so each device fills only its shard; a tf-keras uniform draw split by
    rows is drawn by each device from the counter at its rows (``_uniform_by_index``).
    Every other initial value
    (random initializers, Orthogonal, Identity, Constant, Keras 3's, plain
    callables) is computed whole on the host, as one device computes it (the same
    kernels, seed and order of draws: its values, bit for bit, whatever the plan),
    and each device receives its shard; the full value never exists on a device.
    A random draw under the split layout would be another stream: DTensor folds
    each device's coordinates into the seed. A value the variable took before the
    plan (read, set or loaded on the host: ``DeferredVariable._host_value``) is
    sharded as it is.
    ``drawn_value``: the sharded value ``materialize_all`` already drew.
    """
    initial_value = variable._tofu_initial_value
    dtype = variable.dtype
    shape = variable.shape

    def sharded_initial_value():
        if drawn_value is not None:
            return drawn_value
        if variable._tofu_host is not None:   # read, set or loaded before the plan: that value, as it is
            return scatter_from_host(variable._tofu_host, layout)
        if isinstance(initial_value, keras_adapter.DeferredZeros):
            return sharded_zeros(shape, dtype, layout)
        if _draws_shards(variable, layout):
            return _draw_together([(variable, layout)])[0]
        by_index = _uniform_by_index(variable, layout)
        if by_index is not None:
            return by_index
        if _on_mesh(initial_value):       # a copy of a sharded variable: EMA's average starts as its weight
            return dtensor.relayout(tf.identity(initial_value), layout)
        if not layout.is_fully_replicated() and shape.num_elements() > _WHOLE_VALUE_LOG_ELEMENTS:
            logging.info("drawing %s whole on the host, as one device draws it, before sharding it",
                         variable.name)
        with tf.device(devices.host_device()):
            value = tf.convert_to_tensor(initial_value() if callable(initial_value) else initial_value, dtype=dtype)
        return scatter_from_host(value.numpy(), layout)

    fresh = TofuVariable(sharded_initial_value, dtype=dtype, name=_base_name(variable.name),
                         trainable=variable.trainable, layout=layout)
    return _become(variable, fresh)


def _uniform_by_index(variable: DeferredVariable, layout: dtensor.Layout):
    """A tf-keras uniform draw (RandomUniform; Glorot, He, LeCun uniform) split by its first
    dimension only, each device drawing its rows from the Philox counter at their flat offset
    (``tofu_tf.tf.compat.counter_draws``): one device's bits, and only the shard on each device.
    None for any other layout or initializer (drawn whole on the host)."""
    specs = layout.sharding_specs
    if not specs or specs[0] == dtensor.UNSHARDED or any(s != dtensor.UNSHARDED for s in specs[1:]) \
            or variable.dtype != tf.float32:
        return None
    draw = compat_counter_draws.uniform_draw(variable._tofu_initial_value)
    if draw is None or draw.shape != tuple(variable.shape.as_list()):
        return None
    local_shape = layout.local_shape_from_global_shape(draw.shape)
    row = int(np.prod(draw.shape[1:], dtype=np.int64))
    count = int(np.prod(local_shape, dtype=np.int64))

    def shard(location):
        start = location[specs[0]] * local_shape[0] * row
        return tf.reshape(draw.flat_run(start, count), local_shape)
    return _pack_per_device(layout, shard)


def _on_mesh(value) -> bool:
    """Whether ``value`` already lives on the mesh (a sharded variable or DTensor), so a
    variable starting from it is relaid device to device; reading it to the host
    would fail (a sharded DTensor has no single-device copy) and gather it whole."""
    return isinstance(value, d_variable.DVariable) or (tf.is_tensor(value) and dtensor.is_dtensor(value))


def materialize_all(variables_and_layouts) -> None:
    """``materialize`` each (variable, layout) pair; the shards of every
    variable a Keras initializer draws are drawn by one DTensor program.

    DTensor expands and compiles every program it runs for the mesh, so one
    program per variable spends most of its time compiling; one program for all
    of them compiles once. The values are the ones ``materialize`` draws alone
    (same initializer, seed and layout; tested).
    Each drawn value is released once its variable holds it, so the peak is
    one variable above the weights themselves, as one at a time.
    """
    pairs = list(variables_and_layouts)
    drawn = [(variable, layout) for variable, layout in pairs if _draws_shards(variable, layout)]
    values = _draw_together(drawn)
    for index, (variable, layout) in enumerate(drawn):
        value, values[index] = values[index], None
        materialize(variable, layout, drawn_value=value)
    for variable, layout in pairs:
        if not isinstance(variable, TofuVariable):
            materialize(variable, layout)


def _draws_shards(variable: DeferredVariable, layout: dtensor.Layout) -> bool:
    """Whether the variable's initializer fills its shards itself, under ``layout``: a tf-keras
    constant fill (zeros, ones), whose shards are one device's values wherever they are
    filled. A random initializer's sharded draw is another stream than one device's, and a
    matrix-wide one (Orthogonal's QR) would be computed whole on every device inside a
    function (16x its size at the peak on 8 virtual CPUs): both are drawn whole on the host."""
    initial_value = variable._tofu_initial_value
    return (not layout.is_fully_replicated() and _takes_layout(initial_value)
            and keras_adapter.fills_shards(initial_value.func))


def _draw_together(drawn) -> list:
    """The sharded initial values of ``drawn`` (variable, layout) pairs, from one function per mesh."""
    initializers = [variable._tofu_initial_value for variable, _ in drawn]
    values = [None] * len(drawn)
    for mesh in {layout.mesh for _, layout in drawn}:
        indices = [i for i, (_, layout) in enumerate(drawn) if layout.mesh == mesh]

        @tf.function(autograph=False)
        def draw(indices=indices):
            return [initializers[i](layout=drawn[i][1]) for i in indices]

        with dtensor.default_mesh(mesh):
            for index, value in zip(indices, draw()):
                values[index] = value
    return values


def materialize_on_host(variable: DeferredVariable) -> resource_variable_ops.ResourceVariable:
    """Give ``variable`` a plain buffer in host memory, in place, holding its host value.

    For the variables every stage of a pipeline reads (the optimizer's step counter and
    learning rate): a DTensor lives on one mesh, and an op on another stage's mesh cannot
    read it, while DTensor reads a plain host scalar on any mesh."""
    with tf.device(devices.host_device()):
        fresh = resource_variable_ops.ResourceVariable(variable._host_value(), dtype=variable.dtype,
                                                       name=_base_name(variable.name), trainable=variable.trainable)
    return _become(variable, fresh)


def _become(variable, fresh):
    """Turn ``variable`` into ``fresh`` (a ``TofuVariable``, or a host variable) in place, so
    every holder sees the new buffer."""
    state = dict(fresh.__dict__)
    # Keep the name the variable was created with: the fresh one was made
    # inside the layer's name scope again and would be called "dense/dense/kernel";
    # and its checkpoint bookkeeping (``_self_*``: which restore wrote it, checked
    # after a restore made before the plan).
    for key in ("_handle_name", "_unique_id", "_shared_name", "_tofu_path", "_tofu_read_layout", "_distribute_strategy"):
        if key in variable.__dict__:
            state[key] = variable.__dict__[key]
    state.update((key, value) for key, value in variable.__dict__.items() if key.startswith("_self_"))
    variable.__dict__.clear()
    variable.__dict__.update(state)
    variable.__class__ = type(fresh)                 # the change "variable_reads_forward_writes"
    return variable


_WHOLE_VALUE_LOG_ELEMENTS = 1 << 16


def _takes_layout(initial_value) -> bool:
    """A Keras initializer bound to its shape (``functools.partial(init, shape, dtype=...)``)."""
    if not isinstance(initial_value, functools.partial):
        return False
    func = initial_value.func
    call = getattr(func, "__call__", None)
    try:
        parameters = inspect.signature(call if not inspect.isfunction(func) else func).parameters
    except (TypeError, ValueError):
        return False
    return "layout" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()) and hasattr(func, "get_config")


def _base_name(name: str) -> str:
    return name[:-2] if name.endswith(":0") else name


def host_variable_on_mesh(variable, mesh: dtensor.Mesh) -> bool:
    """Move a Keras variable whose backing ``tf.Variable`` is a plain host variable onto
    ``mesh``, replicated, keeping its value; whether it moved. The Keras variable keeps its
    identity: its backing variable (``_value``) is replaced.

    A random state made outside ``strategy.scope()`` (a keras-hub sampler's, a
    ``keras.random.SeedGenerator`` of the user's) is such a host variable. Read and advanced
    inside a DTensor program, each device's part of the program advanced it once (8 steps of the
    seed per draw on 8 devices) and read its own value, so the draws differed from one device's.
    On the mesh, replicated, it advances once per draw, as on one device."""
    backing = getattr(variable, "_value", None)
    if not isinstance(backing, tf.Variable) or isinstance(backing, d_variable.DVariable):
        return False
    layout = dtensor.Layout.replicated(mesh, rank=backing.shape.rank)
    with tf.init_scope():
        value = backing.numpy()
        variable._value = TofuVariable(  # pylint: disable=protected-access
            lambda: scatter_from_host(value, layout), dtype=backing.dtype,
            name=backing.name.split(":")[0], trainable=False, layout=layout)
    return True
