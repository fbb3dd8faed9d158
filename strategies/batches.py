"""Batches on the planned mesh: TofuStrategy's distributed datasets.

DTensor's own dataset (``DTensorDataset``) re-batches every dataset with
``drop_remainder=True`` to one global batch size, so a partial last batch
vanished (silently, where the cardinality was unknown) or surfaced as an error
after the epoch had trained. Here the user's dataset is iterated as it is, and
each batch is laid out on the mesh as it comes: split over the plan's batch
axis when that axis divides its size, else replicated over the mesh (the
weights keep their layouts either way). Each batch then computes exactly what
it computes on one device, the partial last one included.

The steps that consume these batches run one batch at a time
(``tofu_tf.strategies.step_functions``), so the batches can differ in shape. A custom
loop that takes its batches inside its ``tf.function`` gets each as an input of the
function, laid out at each call (``tofu_tf.strategies.traced_batches``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from tofu_tf.errors import TofuError
from tofu_tf.strategies import traced_batches
from tofu_tf.tf import variables as variables_lib


class UnplaceableBatchError(TofuError, TypeError):
    """A batch holds a value TofuStrategy cannot lay out on the mesh."""


@dataclasses.dataclass
class BatchPlacer:
    """Lays a step's input values out on ``mesh``: the batch dim over ``batch_axis``
    when it divides, else replicated."""

    mesh: dtensor.Mesh
    batch_axis: str | None
    _replicated_sizes: set = dataclasses.field(default_factory=set)

    def layout(self, shape) -> dtensor.Layout:
        rank = len(shape)
        if rank == 0 or self.batch_axis is None:
            return dtensor.Layout.replicated(self.mesh, rank=rank)
        size = self.mesh.dim_size(self.batch_axis)
        if shape[0] is not None and shape[0] % size == 0:
            return dtensor.Layout.batch_sharded(self.mesh, self.batch_axis, rank=rank)
        if shape[0] not in self._replicated_sizes:
            self._replicated_sizes.add(shape[0])
            logging.info("TofuStrategy: a batch of %s samples does not split over mesh axis %r (size %d); "
                         "it runs with the batch replicated over the mesh, weights in their planned layouts",
                         shape[0], self.batch_axis, size)
        return dtensor.Layout.replicated(self.mesh, rank=rank)

    def place(self, value):
        """``value`` on the mesh (each device receives only its part); DTensors and
        non-tensors pass through."""
        if value is None or isinstance(value, tf.Variable):
            return value
        if isinstance(value, (tf.RaggedTensor, tf.SparseTensor)):
            raise UnplaceableBatchError(
                f"TofuStrategy lays out dense batches only, and a batch holds a {type(value).__name__}: "
                "pad it to a dense tensor in the input pipeline (e.g. .padded_batch or .to_tensor()).")
        if tf.is_tensor(value) and dtensor.is_dtensor(value):
            return value
        if not (tf.is_tensor(value) or isinstance(value, (np.ndarray, np.generic, int, float, bool))):
            return value
        array = value.numpy() if tf.is_tensor(value) else np.asarray(value)
        return variables_lib.scatter_from_host(array, self.layout(array.shape))


def number_lists_as_tensors(structure):
    """Each list of Python numbers in ``structure`` (nested lists too) as the one tensor
    ``tf.convert_to_tensor`` makes of it; other values as they are.

    tf-keras's tests pass a metric its labels and predictions as lists (``strategy.run(metric,
    args=([0, 1, 1], [0.2, 0.6, 0.9]))``), which a function converts to one tensor, as
    MirroredStrategy's replicas do. Laid out number by number, they came as scalars of mixed
    dtypes (int64 and double: DTensor's Pack refused them)."""
    def numbers(value):
        if isinstance(value, list):
            return bool(value) and all(numbers(item) for item in value)
        return isinstance(value, (int, float))          # bool is an int

    def convert(value):
        if isinstance(value, list) and numbers(value):
            return tf.convert_to_tensor(value)
        if isinstance(value, dict):
            return type(value)((key, convert(item)) for key, item in value.items())
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(convert(item) for item in value))
        if isinstance(value, (list, tuple)):
            return type(value)(convert(item) for item in value)
        return value
    return convert(structure)


def place_batch(placer: BatchPlacer, batch):
    """Every tensor of a (nested) batch on the mesh."""
    return tf.nest.map_structure(placer.place, batch)


def to_host(value):
    """A step's output as one device has it: a DTensor's full value assembled in host
    memory from its shards (a sharded vocabulary head's logits cannot be copied off
    the mesh as they are). Other values pass through."""
    if not (tf.is_tensor(value) and dtensor.is_dtensor(value)):
        return value
    return tf.constant(variables_lib.gather_to_host(value, dtensor.fetch_layout(value)))


class PendingValue:
    """A batch's value distributed before any plan exists, held on the host.

    A custom training loop distributes its dataset and takes the first batch before
    its first ``strategy.run``, which is where the strategy sees what the loop trains
    and plans it. Until then there is no mesh to lay a batch out on, so the batches
    taken before the plan travel as these. To ``tf.function`` one traces as a tensor
    of its spec (``__tf_tracing_type__``), so ``run`` plans from that spec inside the
    trace, and the function is called with the value laid out on the planned mesh
    (``__tf_tensor__``): the trace is the one later batches of that shape reuse, and
    the step compiles once. Eagerly, ``run`` lays it out itself.
    """

    def __init__(self, value: tf.Tensor, placer: Callable[[], "BatchPlacer | None"]):
        self.value = value
        self._placer = placer

    @property
    def spec(self) -> tf.TensorSpec:
        return tf.TensorSpec(self.value.shape, self.value.dtype)

    def placed(self):
        """The value on the planned mesh, or on the host while there is no plan."""
        placer = self._placer()
        return self.value if placer is None else placer.place(self.value)

    def __tf_tracing_type__(self, signature_context):
        del signature_context
        return self.spec

    def __tf_tensor__(self, dtype=None, name=None):
        del name
        value = self.placed()
        if dtype is not None and dtype != value.dtype:
            raise TypeError(f"a batch value of dtype {value.dtype.name} was asked for as {tf.as_dtype(dtype).name}")
        return value

    def __repr__(self):
        return f"PendingValue(shape={self.value.shape}, dtype={self.value.dtype.name})"


class DistributedBatches:
    """The user's dataset, batch by batch, each batch laid out on the mesh.

    Both Keras versions iterate it in Python and hand each batch to the step
    function (``tofu_tf.strategies.step_functions``). It keeps the dataset's batch count:
    unknown when the dataset's is (``.filter``), and then the epoch ends when the
    data does, as on one device. ``placer`` gives the mesh's placer, or None while no
    plan exists: batches taken then are ``PendingValue``s.
    """

    def __init__(self, dataset: tf.data.Dataset, placer: Callable[[], BatchPlacer | None],
                 on_taken: Callable[[tf.data.Dataset], None] | None = None):
        self._dataset = dataset
        self._placer = placer
        self._on_taken = on_taken
        self._batches = int(dataset.cardinality().numpy())

    def tofu_taken_by_keras(self) -> None:
        """tf-keras' fit/evaluate/predict takes this as its data (the change
        "distributed_batches_accepted"), before it makes its step function: ``on_taken``
        prepares the model it runs."""
        if self._on_taken is not None:
            self._on_taken(self._dataset)

    def __bool__(self):
        return True       # present, whatever its length (``if validation_data:`` asks; len may be unknown)

    def __iter__(self):
        if traced_batches.in_trace():            # iter(dist) or `for x in dist` inside a tf.function
            return traced_batches.EpochInTrace(self._dataset, functools.partial(_place_now, self._placer))
        return _PlacingIterator(iter(self._dataset), self._placer, self._dataset, source=self)

    def __len__(self):
        if self._batches < 0:
            raise TypeError("the number of batches of this dataset is unknown")
        return self._batches

    def cardinality(self):
        return tf.constant(self._batches, tf.int64)

    @property
    def element_spec(self):
        return self._dataset.element_spec


def _place_now(placer: Callable[[], BatchPlacer | None], batch):
    """A host batch laid out on the mesh (on the host while no plan exists)."""
    current = placer()
    return batch if current is None else place_batch(current, batch)


class _PlacingIterator:
    """The batches of an iterator made eagerly. Taken eagerly, each comes laid out on the mesh
    (or pending, before the plan); taken inside a tf.function the iterator is passed to, each
    becomes an input of the function (``traced_batches.ReadAhead``)."""

    def __init__(self, iterator, placer: Callable[[], BatchPlacer | None], dataset: tf.data.Dataset | None = None,
                 *, source=None):
        self._placer = placer
        self._source = self if source is None else source       # what the traces of this iterator key on
        self._batches = traced_batches.ReadAhead(iterator, functools.partial(_place_now, placer), dataset=dataset,
                                                 placer_of=placer)

    @property
    def read_ahead(self) -> traced_batches.ReadAhead:
        return self._batches

    def __iter__(self):
        return self

    def __next__(self):
        if traced_batches.in_trace():
            return self._batches.next_in_trace()
        batch = self._batches.next_eager()
        placer = self._placer()
        if placer is None:
            return tf.nest.map_structure(
                lambda value: PendingValue(value, self._placer) if tf.is_tensor(value) else value, batch)
        return place_batch(placer, batch)

    def get_next(self):
        return next(self)

    def next_bound(self, bound: traced_batches.IteratorTraceType):
        """The next batch in a function this iterator was passed to as the argument of type ``bound``."""
        return self._batches.next_in_trace(bound)

    def __tf_tracing_type__(self, context):
        del context
        signature = self._batches.peek_signature()
        return traced_batches.IteratorTraceType(self, self._source, signature, self._batches.on_mesh)
