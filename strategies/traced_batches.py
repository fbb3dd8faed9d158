"""Batches taken inside a tf.function: a custom loop's ``next(iterator)`` or ``for batch in dist``
written in the function it calls.

tf-keras's own custom loops take their batches inside the ``tf.function`` they call:
``train_step(iterator)`` calling ``next(iterator)``, or an epoch function running
``for x in dist``. Under MirroredStrategy the iterator is a resource the graph reads, and a
dataset batched without ``drop_remainder`` gives batches of unknown size (``None``) there.
A TofuStrategy step is planned and compiled for static shapes, and DTensor lays an input out
when it is passed to the function, so a batch read in the graph would have neither.

Here a batch taken while the function is traced becomes an input of the function instead: the
trace reads that batch on the host, ahead, for its static shape, and the function gets a
placeholder of that shape whose value at each call is the batch then due, laid out on the mesh
by the strategy's ``BatchPlacer`` (split over the batch axis where it divides the batch, else
replicated), through ``FuncGraph.capture_call_time_value``. Every batch so computes what it
computes on one device, a partial last batch included, and a batch whose shape differs from
the one traced is refused by name, never computed on a wrong shape:

- an iterator made outside the function and passed to it (``next(it)`` inside): its trace type
  (``IteratorTraceType``) holds its dataset and the shape of the batch it will give next, read
  ahead, so a batch of a new shape (the partial last one) traces the function again, as
  ``step_functions`` does for Keras' loops, and a new iterator over the same dataset (Orbit's
  evaluator makes one per round) reuses the trace: each call's batches are read from the
  iterator that call passed;
- an iterator made inside the function (``iter(dist)``, or ``for x in dist``): each call reads
  the dataset from its start, as MirroredStrategy's does, and its batches are the ones the trace
  read. A Python loop over it is unrolled in the trace, one copy of the body per batch, up to
  ``MAX_UNROLLED_BATCHES`` (beyond that: iterate outside the function); a call whose data gives
  fewer or more batches than the trace saw is refused.

Where a trace ends a loop at the end of the data, ``next`` raises ``StopIteration`` (what the
eager iterator raises), at trace time; MirroredStrategy raises ``OutOfRangeError`` when the
function runs.

A batch taken inside a loop the graph runs (``for _ in tf.range(n): strategy.run(step,
args=(next(iterator),))``, Orbit's and Model Garden's default training loop) cannot be an input
of the function: each iteration needs the next batch, and the count is known only when the
function runs. Such a batch comes from a DTensor iterator instead (``MeshBatches``): TensorFlow's
``DTensorDataset`` over the same dataset, whose iterator each iteration reads in the graph,
every device receiving its part of the batch in the plan's batch layout (split over the plan's
batch axis where it divides the batch, else replicated), as a fixed-shape distributed iterator
does (where that axis is not the mesh's first, each device reads the whole batch and keeps its
part: ``_splits_in_device_order``); a loop that reaches a partial last batch fails there, naming it (the loop's program has
one batch size). From then on every batch of that iterator, eager or traced, comes from it, so the stream
stays one; it starts from the dataset's first batch, so it is refused when the iterator already
gave batches another way. Taken before the plan exists (the loop's first ``run`` plans), the
batch is a ``PendingLoopValue`` until ``run`` has planned, and then read from the iterator.
"""

from __future__ import annotations

import collections
import functools
import weakref

import tensorflow as tf
from absl import logging

from tofu_tf.errors import TofuError

# A Python loop over a dataset inside a tf.function is unrolled at trace time, one copy of its
# body per batch: more batches than this are refused (iterate outside the function instead).
MAX_UNROLLED_BATCHES = 256


class TracedBatchError(TofuError, ValueError):
    """A batch taken inside a tf.function cannot be given to the program traced for it."""

    # Raised while a tf.function is traced: AutoGraph would re-raise it as a StagingError with its
    # own trace in the message; TF's marker (as on its op_selector.UnliftableError) lets it through.
    ag_pass_through = True


def in_trace() -> bool:
    """Whether a batch asked for now is taken by a ``tf.function`` being traced."""
    return not tf.executing_eagerly()


def signature(batch) -> tuple:
    """A batch's structure and its leaves' shapes and dtypes (what a traced program fixes)."""
    def leaf(value):
        if isinstance(value, (tf.RaggedTensor, tf.SparseTensor)):
            raise TracedBatchError(
                f"TofuStrategy lays out dense batches only, and a batch holds a {type(value).__name__}: "
                "pad it to a dense tensor in the input pipeline (e.g. .padded_batch or .to_tensor()).")
        if not tf.is_tensor(value):
            return ("python", repr(value))
        return (tuple(value.shape.as_list()), value.dtype.name)
    return (str(tf.nest.map_structure(lambda _: 0, batch)), tuple(leaf(v) for v in tf.nest.flatten(batch)))


def _spec(batch):
    return tf.nest.map_structure(lambda v: tf.TensorSpec(v.shape, v.dtype) if tf.is_tensor(v) else v, batch)


def _read(iterator):
    """The next host batch of an eager ``tf.data`` iterator, read eagerly; None at the end."""
    with tf.init_scope():
        try:
            return next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            return None


def _outermost_function_graph():
    """The graph of the outermost tf.function being traced (a nested function's graph sits in it)."""
    graph = tf.compat.v1.get_default_graph()
    while hasattr(getattr(graph, "outer_graph", None), "capture_call_time_value"):   # a FuncGraph
        graph = graph.outer_graph
    return graph


def _input_at_call(graph, batch, take):
    """Placeholders in ``graph`` for ``batch``'s tensors, given ``take()``'s value at each call."""
    spec = _spec(batch)
    tensors = [i for i, v in enumerate(tf.nest.flatten(spec)) if isinstance(v, tf.TensorSpec)]
    leaves = list(tf.nest.flatten(spec))

    def tensor_leaves():
        flat = tf.nest.flatten(take())
        return [flat[i] for i in tensors]
    placeholders = graph.capture_call_time_value(tensor_leaves, [leaves[i] for i in tensors])
    for i, placeholder in zip(tensors, placeholders):
        leaves[i] = placeholder
    return tf.nest.pack_sequence_as(spec, leaves)


def _check(batch, expected: tuple, where: str):
    if batch is None:
        raise TracedBatchError(
            f"the data ended before the batch {where} was due: TofuStrategy traced the function on a dataset "
            "that gave more batches than this call's. Keep the number of batches fixed, or iterate the "
            "distributed dataset outside the tf.function (for batch in dist: step(batch)).")
    got = signature(batch)
    if got != expected:
        raise TracedBatchError(
            f"the batch {where} has shapes {got[1]} where the tf.function was traced for {expected[1]}: "
            "TofuStrategy compiles a function for the batch shapes its trace read. Take batches of one shape "
            "inside the function (drop_remainder=True), pass the iterator itself to the function (it traces "
            "again for a new shape), or iterate outside the tf.function (for batch in dist: step(batch)).")


class ReadAhead:
    """The batches an eager iterator's traces read ahead, and what the calls take in order.

    ``next_in_trace`` gives the trace placeholders for the batch due at the matching call;
    ``next_eager`` and the calls take batches from the front. ``place`` lays a host batch out
    (the strategy's placer, once a plan exists)."""

    def __init__(self, iterator, place, *, dataset=None, placer_of=None):
        self._iterator = iterator
        self._place = place
        self._ahead: collections.deque = collections.deque()
        self._reserved = weakref.WeakKeyDictionary()      # outermost graph being traced: batches it took
        self._taken = 0                                   # batches given out, eagerly or at calls
        # Batches taken inside a loop the graph runs come from a DTensor iterator over the dataset.
        self._mesh = MeshBatches(dataset, placer_of) if dataset is not None and placer_of is not None else None

    def peek_signature(self):
        """The signature of the batch due next (None at the end of the data): it keys the traces
        of a function the iterator is passed to."""
        if self._mesh is not None and self._mesh.started:
            return self._mesh.signature
        if not self._ahead:
            batch = _read(self._iterator)
            if batch is None:
                return None
            self._ahead.append(batch)
        return signature(self._ahead[0])

    def next_eager(self):
        if self._mesh is not None and self._mesh.started:
            return self._mesh.next_eager()
        batch = self._ahead.popleft() if self._ahead else _read(self._iterator)
        if batch is None:
            raise StopIteration
        self._taken += 1
        return batch

    def next_in_trace(self, bound: IteratorTraceType | None = None):
        """Placeholders for the next batch in the function being traced. ``bound``: the type of the
        function's argument this iterator was passed as; each call then takes the batch from the
        iterator that call passed, read through ``bound``."""
        if self._mesh is not None and (self._mesh.started or in_graph_loop()):
            if not self._mesh.started:
                self._start_mesh_batches()
            if bound is not None:
                bound.pin()
            return self._mesh.next_in_trace()
        graph = _outermost_function_graph()
        index = self._reserved.get(graph, 0)
        if index >= MAX_UNROLLED_BATCHES:
            raise TracedBatchError(
                f"a tf.function took more than {MAX_UNROLLED_BATCHES} batches of a TofuStrategy iterator in "
                "one trace: TofuStrategy unrolls such a loop, one copy per batch. Iterate outside the "
                "tf.function (for batch in dist: step(batch)).")
        while len(self._ahead) <= index:
            batch = _read(self._iterator)
            if batch is None:
                raise StopIteration
            self._ahead.append(batch)
        self._reserved[graph] = index + 1
        expected = signature(self._ahead[index])
        take = (functools.partial(self.take, expected, index) if bound is None else
                lambda: bound.bound().read_ahead.take(expected, index))
        return _input_at_call(tf.compat.v1.get_default_graph(), self._ahead[index], take)

    @property
    def on_mesh(self) -> bool:
        """Whether the batches come from the DTensor iterator (a loop the graph runs took one)."""
        return self._mesh is not None and self._mesh.started

    def take(self, expected, index):
        """The batch due at a call, checked against the one traced at ``index``, laid out."""
        batch = self._ahead.popleft() if self._ahead else _read(self._iterator)
        _check(batch, expected, f"taken {index + 1}th in the tf.function")
        self._taken += 1
        return self._place(batch)

    def _start_mesh_batches(self):
        if self._taken:
            raise TracedBatchError(
                f"a batch is taken inside a loop the tf.function runs (a tf.range or tf.while_loop body) from an "
                f"iterator that already gave {self._taken} batch(es) outside such a loop: TofuStrategy reads a "
                "loop's batches from a DTensor iterator over the dataset, which starts at its first batch. Take "
                "every batch of this iterator inside the loop, or make a new iterator (iter(dist)) for the loop.")
        first = self._ahead[0] if self._ahead else _read(self._iterator)
        if first is None:
            raise StopIteration
        self._ahead.clear()                 # read ahead for shapes only: the mesh iterator starts there too
        self._mesh.start(first)


class IteratorTraceType(tf.types.experimental.TraceType):
    """An iterator of a distributed dataset passed to a tf.function: its trace is keyed by the
    dataset it iterates and the signature of the batch it gives next, not by the iterator.

    tf.data's own iterators and MirroredStrategy's are ``CompositeTensor``s whose type spec holds
    the element spec, and the graph reads the iterator resource passed as an input, so a new
    iterator over the same data reuses the trace (Orbit's evaluator makes one per round). Here
    the trace's batches are inputs captured at call time, read on the host and laid out on the
    mesh; so the trace reads them from the iterator *bound* to its argument: the trace-time
    iterator while tracing (``placeholder_value``), the call's at each call (``to_tensors``, which
    ``tf.function`` calls with the argument's value on the matched trace's own type before it reads
    the captured inputs). Each argument has its own type, so two iterators of one dataset passed
    in one call stay apart. A batch of another shape (a partial last batch) traces again.

    A trace that reads the batches in the graph (a loop the graph runs: ``MeshBatches``) holds the
    trace-time iterator's DTensor iterator as a capture, so it is ``pin``ned to that iterator:
    another iterator traces again, as before."""

    def __init__(self, iterator, source, next_signature, on_mesh: bool):
        self._ref = weakref.ref(iterator)
        self._source = weakref.ref(source)
        self._hash = hash((id(source), next_signature))      # fixed: a cache key outlives its iterator
        self._next = next_signature
        self._on_mesh = on_mesh
        self._bound = self._ref
        self._pinned = None             # the iterator a trace read in the graph, once it did

    def _key(self):
        return (self._source(), self._next)

    def is_subtype_of(self, other) -> bool:
        if not isinstance(other, IteratorTraceType) or self._source() is None or self._key() != other._key():
            return False
        if other._pinned is not None:           # the trace reads its iterator's DTensor iterator in the graph
            return other._pinned() is self._ref()
        return not self._on_mesh                # an iterator a graph loop read gives no more host batches

    def most_specific_common_supertype(self, others):
        return self if all(self == other for other in others) else None

    def placeholder_value(self, placeholder_context):
        del placeholder_context
        self._bound = self._ref
        return BoundIterator(self)

    def to_tensors(self, value):
        self._bound = weakref.ref(value)
        return []

    def cast(self, value, cast_context):
        del cast_context
        return value

    def bound(self):
        """The iterator the trace reads now: the trace-time one, then each call's."""
        iterator = self._bound()
        if iterator is None:
            raise TracedBatchError("the iterator a tf.function was called with is gone")
        return iterator

    def pin(self) -> None:
        """The trace reads the bound iterator in the graph: calls with another iterator trace again."""
        self._pinned = self._bound

    def __eq__(self, other) -> bool:
        return (isinstance(other, IteratorTraceType) and self._ref() is not None
                and self._ref() is other._ref() and self._key() == other._key() and self._on_mesh == other._on_mesh)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self):
        return f"IteratorTraceType(next batch {self._next})"


class BoundIterator:
    """The iterator argument as the traced function sees it: each batch it gives is read, at each
    call, from the iterator the call passed (``IteratorTraceType.bound``)."""

    def __init__(self, trace_type: IteratorTraceType):
        self._type = trace_type

    def __iter__(self):
        return self

    def __next__(self):
        return self._type.bound().next_bound(self._type)

    def get_next(self):
        return next(self)

    def __tf_tracing_type__(self, context):
        return self._type.bound().__tf_tracing_type__(context)

    def __getattr__(self, name):
        return getattr(self._type.bound(), name)


class EpochInTrace:
    """An iterator over a distributed dataset made inside a tf.function (``iter(dist)``,
    ``for x in dist``): each call of the function reads the dataset from its start.

    The trace reads the dataset on the host with an iterator of its own, for the shapes. Each
    call's first batch starts a new iterator; the batch that was the last at trace time checks
    that the call's data ended too, so an unrolled loop never skips batches silently."""

    def __init__(self, dataset, place):
        self._dataset = dataset
        self._place = place
        with tf.init_scope():
            self._trace_iterator = iter(dataset)
        self._lookahead = _read(self._trace_iterator)
        self._taken = 0
        self._call_iterator = None

    def __iter__(self):
        return self

    def __next__(self):
        batch = self._lookahead
        if batch is None:
            raise StopIteration
        if self._taken >= MAX_UNROLLED_BATCHES:
            raise TracedBatchError(
                f"a tf.function iterates more than {MAX_UNROLLED_BATCHES} batches of a TofuStrategy dataset: "
                "TofuStrategy unrolls a loop over a dataset inside a tf.function, one copy per batch. Iterate "
                "outside the tf.function (for batch in dist: step(batch)).")
        self._lookahead = _read(self._trace_iterator)
        index, self._taken = self._taken, self._taken + 1
        if index == 0:
            logging.info("TofuStrategy: a tf.function iterates a distributed dataset: each batch it takes is an "
                         "input of the function, laid out on the mesh at each call (a loop is unrolled per batch)")
        return _input_at_call(tf.compat.v1.get_default_graph(), batch, functools.partial(
            self._take, signature(batch), index, self._lookahead is None))

    def get_next(self):
        return next(self)

    def _take(self, expected, index, last):
        if index == 0:
            with tf.init_scope():
                self._call_iterator = iter(self._dataset)
        batch = _read(self._call_iterator)
        _check(batch, expected, f"{index + 1} of the dataset")
        if last and _read(self._call_iterator) is not None:
            raise TracedBatchError(
                f"the dataset gave more than the {index + 1} batches the tf.function was traced on: the "
                "function's loop over it would skip the rest. Keep the number of batches fixed, or iterate "
                "the distributed dataset outside the tf.function (for batch in dist: step(batch)).")
        return self._place(batch)


def dataset_function_name() -> str | None:
    """The name of the tf.data function being traced around the current trace, if any: AutoGraph
    writes ``for x in dataset`` over a ``tf.data.Dataset`` inside a ``tf.function`` as a
    ``Dataset.scan`` whose body tf.data traces as a function named after its transformation
    (``Dataset_scan_scan_body``; tf.data's ``StructuredFunctionWrapper`` names every dataset
    function ``Dataset_<transformation>_<function>``). tf.data runs such a function on the host."""
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if str(getattr(graph, "name", "")).startswith("Dataset_"):
            return graph.name
        graph = getattr(graph, "outer_graph", None)
    return None


def refuse_run_in_dataset_function() -> None:
    """Refuse ``strategy.run`` called in the body of a tf.data function, naming the fix. DTensor
    cannot compile such a function (its body runs on the host, in tf.data), and failed with
    "'tf_device.cluster' op failed to merge mesh cluster" when the step was first called."""
    if tf.executing_eagerly():
        return
    name = dataset_function_name()
    if name is not None:
        raise TracedBatchError(
            f"strategy.run was called inside the tf.data function {name!r}: AutoGraph writes a `for x in dataset` "
            "over a tf.data.Dataset inside a tf.function as a dataset scan, whose body tf.data runs on the host, "
            "where TofuStrategy's programs cannot run. Distribute the dataset and iterate that instead: "
            "dist = strategy.experimental_distribute_dataset(dataset), then `for x in dist: strategy.run(step, "
            "args=(x,))`, inside the tf.function or outside it.")


def in_graph_loop() -> bool:
    """Whether the graph being traced is the body of a loop the graph runs (``tf.range`` under
    AutoGraph, ``tf.while_loop``), inside the outermost ``tf.function``. TF-private: the body's
    graph class (the read "while_body_graph_read", ``tofu_tf.tf.compat.registry``)."""
    from tensorflow.python.ops import control_flow_v2_func_graphs
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if isinstance(graph, control_flow_v2_func_graphs.WhileBodyFuncGraph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


class PendingLoopValue:
    """One tensor of a batch taken inside a graph loop before the plan: ``run`` plans from its
    ``spec``, then ``placed()`` reads the whole batch from the DTensor iterator once (in the
    graph being traced) and gives this tensor of it."""

    def __init__(self, read_batch, index: int, spec: tf.TensorSpec):
        self._read_batch = read_batch
        self._index = index
        self.spec = spec

    def placed(self):
        return tf.nest.flatten(self._read_batch())[self._index]

    def __tf_tensor__(self, dtype=None, name=None):
        del dtype, name
        return self.placed()

    def __repr__(self):
        return f"PendingLoopValue(shape={self.spec.shape}, dtype={self.spec.dtype.name})"


class MeshBatches:
    """A dataset's batches read by a DTensor iterator (``DTensorDataset``), for loops the graph runs.

    ``start(first)`` fixes the batch signature from the dataset's first batch; the iterator itself
    is made once the plan exists (its layouts are the plan's batch layouts). Each batch has the
    first one's size: the dataset is unbatched and batched again at that size. The loop's program
    is compiled for that size, so a partial last batch cannot run in it (MirroredStrategy's loop
    runs it, on batches of unknown size): the loop that reaches one fails there with an error that
    says so (``_full_batches``), never ends early or skips it silently.

    Each batch read in the graph is relaid to the layout the iterator was made with
    (``dtensor.relayout``): DTensor reads an iterator's element layouts from the function
    argument that holds the iterator, which a loop body's argument does not carry, so inside the
    loop it would infer the batch's layout from its consumers and expect a part of another shape
    than the iterator gives ("Incompatible shapes at component 1: expected [10,2] but got [10,4]",
    a replicated batch whose targets meet an output sharded on its last dimension)."""

    def __init__(self, dataset, placer_of):
        self._dataset = dataset
        self._placer_of = placer_of
        self._iterator = None
        self._layouts = None          # the plan's batch layouts
        self._read_layouts = None     # the iterator's: the plan's, or whole where DTensorDataset cannot split
        self._first = None
        self.signature = None

    @property
    def started(self) -> bool:
        return self._first is not None

    def start(self, first) -> None:
        self._first = first
        self.signature = signature(first)
        leaves = [v for v in tf.nest.flatten(first) if tf.is_tensor(v)]
        if not leaves or any(v.shape.rank == 0 for v in leaves):
            raise TracedBatchError(
                "a batch taken inside a loop the tf.function runs holds a scalar: TofuStrategy reads a loop's "
                "batches from a DTensor iterator, which splits every tensor of a batch along its first dimension. "
                "Give every value of a batch a batch dimension.")
        logging.info("TofuStrategy: batches taken inside a loop the tf.function runs come from a DTensor iterator "
                     "over the dataset, %d samples each, laid out by the plan", int(leaves[0].shape[0]))

    def _mesh_iterator(self):
        if self._iterator is None:
            placer = self._placer_of()
            if placer is None:
                raise TracedBatchError("a batch taken inside a loop the tf.function runs was read before the plan "
                                       "existed: pass it to strategy.run, which plans, before using it")
            from tensorflow.experimental import dtensor
            size = int(tf.nest.flatten(self._first)[0].shape[0])
            layouts = tf.nest.map_structure(lambda v: placer.layout(tuple(v.shape)), self._first)
            split = all(layout.sharding_specs[0] == placer.batch_axis for layout in tf.nest.flatten(layouts))
            replicated = tf.nest.map_structure(lambda layout: dtensor.Layout.replicated(placer.mesh, layout.rank),
                                               layouts)
            self._layouts = layouts if split else replicated
            read_split = split and _splits_in_device_order(placer.mesh, placer.batch_axis)
            if split and not read_split:
                logging.info("TofuStrategy: the loop's batches are split over mesh axis %r, which is not the "
                             "mesh's first; each device reads the whole batch and keeps its part (DTensor's "
                             "dataset splits a batch right only over a mesh's first axis)", placer.batch_axis)
            self._read_layouts = layouts if read_split else replicated
            with tf.init_scope():
                dataset = dtensor.DTensorDataset(_full_batches(self._dataset, size), mesh=placer.mesh,
                                                 layouts=self._read_layouts, global_batch_size=size,
                                                 batch_dim=placer.batch_axis if read_split else None)
                self._iterator = iter(dataset)
        return self._iterator

    def next_eager(self):
        try:
            batch = next(self._mesh_iterator())
        except tf.errors.OutOfRangeError:
            raise StopIteration from None
        return self._in_plan_layouts(batch)

    def next_in_trace(self):
        if self._placer_of() is not None:
            return self._laid_out(self._mesh_iterator().get_next())
        read = {}

        def read_batch():               # once per batch, in the graph run's resolves the first tensor in
            graph = tf.compat.v1.get_default_graph()
            if read.get("graph") is not graph:
                read["graph"], read["batch"] = graph, self._laid_out(self._mesh_iterator().get_next())
            return read["batch"]
        flat = tf.nest.flatten(self._first)
        leaves = [PendingLoopValue(read_batch, i, tf.TensorSpec(v.shape, v.dtype)) for i, v in enumerate(flat)]
        return tf.nest.pack_sequence_as(self._first, leaves)

    def _laid_out(self, batch):
        """``batch``, read in the graph, pinned to the layouts its iterator gives (see the class),
        then in the plan's."""
        from tensorflow.experimental import dtensor
        return self._in_plan_layouts(tf.nest.map_structure(dtensor.relayout, batch, self._read_layouts))

    def _in_plan_layouts(self, batch):
        """``batch`` as its iterator gives it, in the plan's batch layouts: where the iterator gives
        it whole, each device keeps its part (a local slice, nothing moves)."""
        if self._read_layouts is self._layouts:
            return batch
        from tensorflow.experimental import dtensor
        return tf.nest.map_structure(dtensor.relayout, batch, self._layouts)


def _splits_in_device_order(mesh, axis: str) -> bool:
    """Whether ``DTensorDataset`` gives each device its part of a batch split over ``axis``.

    It hands the local devices their parts in device order, each part to as many consecutive
    devices as the mesh holds per batch part, which is the mesh's layout only where every axis
    before ``axis`` has size 1: on a ``batch=2 x model=4`` mesh split over ``model``, devices
    0 and 1 got part 0 where the mesh gives them parts 0 and 1, so copies DTensor treats as one
    replicated value held other samples, and Model Garden's ``run_experiment`` trained on them
    (tests/test_loop_batches.py)."""
    names = list(mesh.dim_names)
    return all(mesh.dim_size(name) == 1 for name in names[:names.index(axis)])


def _full_batches(dataset, size: int):
    """``dataset``'s samples, unbatched, for a DTensor iterator that batches them at ``size``; the
    samples of a partial last batch fail when the iterator reaches them, with a message naming
    the cause and the fix (DTensor's iterator drops them: a loop reading one more batch failed
    with a bare "End of sequence", and an eager ``next`` after a shorter loop ended the data)."""
    message = (f"TofuStrategy: a loop the tf.function runs reached a partial last batch (fewer than {size} "
               "samples): its program is compiled for the first batch's size, so that batch cannot run in "
               "it. Batch the dataset with drop_remainder=True, repeat it, or run fewer iterations.")

    def checked(*batch):
        batch = batch[0] if len(batch) == 1 else batch
        samples = tf.shape(tf.nest.flatten(batch)[0])[0]
        with tf.control_dependencies([tf.debugging.Assert(tf.equal(samples, size), [message])]):
            return tf.nest.map_structure(tf.identity, batch)
    return dataset.unbatch().batch(size).map(checked).unbatch()
