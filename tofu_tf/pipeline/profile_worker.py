"""The profiling subprocess: run stages of a real Keras model, report their peaks.

Started by ``tofu_tf.pipeline.profile.run_worker`` as
``python -m tofu_tf.pipeline.profile_worker OUT`` with a pickled
``WorkerRequest`` on stdin and ``TF_CPU_ALLOCATOR_USE_BFC=true`` in the
environment; writes the list of peak bytes (one per stage) to ``OUT``. This is
the only module of ``tofu_tf.pipeline`` that runs TensorFlow ops.

How one stage is measured:

1. The stage is a Keras sub-model of the rebuilt model, from the input of its
   first layer (or the model inputs) to the output of its last layer (or the
   model outputs): the layers outside it are trimmed, they never run.
2. Stand-ins replace them: random inputs of the right shapes and dtypes in
   place of the previous stage's activations, and, unless the stage ends with
   the model output (then the real loss runs on random labels), a random
   gradient for its output, made when its backward pass starts (when the next
   stage would send it).
3. One training step runs eagerly in pipeline order: the forward passes of
   ``inflight`` micro-batches, each on its own tape (as a pipeline stage keeps
   them), then their backward passes one by one, each adding in place into
   gradient accumulators allocated once, then the optimizer update. A first
   step creates the optimizer slots; then one measured step per in-flight
   count asked for. Eager, because its frees are deterministic: the same
   block measured twice agrees to 0.1%, where ``tf.function`` steps varied by
   a few percent from the executor's choice of order.
4. Peak: ``get_memory_info("CPU:0")["peak"]`` after ``reset_memory_stats``,
   minus what was allocated before the stage existed, plus the stage's own
   weights, which the rebuilt model had already allocated (rounded up to the
   BFC allocator's 256-byte granularity, as the allocator counts them).

Threads are limited to one per pool so that kernels allocate the same scratch
memory in every run, and the allocator first gets one large free region so
that its bookkeeping does not depend on the stages measured before
(``_reserve_ballast``).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import pickle
import sys

from tofu_tf.errors import TofuError

_BFC_GRANULE = 256
# Address space reserved (not touched) up front; see _reserve_ballast.
_BALLAST_BYTES = 1 << 30


class StageBuildError(TofuError, ValueError):
    """A stage cannot be cut out of the model where it was asked to start or end."""


@dataclasses.dataclass(frozen=True)
class ConfigBuilder:
    """Rebuilds a Keras model from its config in another process (picklable)."""

    framework: str
    class_path: str
    config_json: str

    @classmethod
    def of(cls, model) -> "ConfigBuilder":
        from tofu_tf.tf import keras_adapter
        framework = keras_adapter.framework_of(model)
        model_class = type(model)
        try:
            config = json.dumps(model.get_config())
            builder = cls(framework, f"{model_class.__module__}:{model_class.__qualname__}", config)
            builder()  # fail here, with the fix in the message, rather than in the subprocess
        except Exception as error:  # Keras raises several types for unserializable layers
            raise ValueError(
                f"model {model.name!r} cannot be rebuilt from its Keras config for profiling "
                f"({type(error).__name__}: {error}). Pass model_fn, a picklable zero-argument "
                "callable that builds it, e.g. functools.partial(tofu_tf.models.gpt, "
                "num_layers=4)") from error
        return builder

    def __call__(self):
        module_name, qualname = self.class_path.split(":")
        model_class = importlib.import_module(module_name)
        for part in qualname.split("."):
            model_class = getattr(model_class, part)
        return model_class.from_config(json.loads(self.config_json))


def main(out_path: str) -> None:
    request = pickle.load(sys.stdin.buffer)
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    _reserve_ballast(tf)
    model = request.builder()
    peaks = [measure_stage(model, job, request) for job in request.stages]
    with open(out_path, "wb") as handle:
        pickle.dump(peaks, handle)


def _reserve_ballast(tf) -> None:
    """Give the BFC allocator one large free region before anything else runs.

    BFC serves a request from a free chunk without splitting it when the chunk
    is less than twice the request, and counts the whole chunk as in use; what
    a stage "uses" then depends on which chunks earlier stages left free (a
    convolution's 19 MB workspace was counted as 19 or 32 MB depending on the
    stages run before it). Allocating and freeing one never-touched region
    (``Empty`` with ``init=False``: no page is written, so it costs address
    space, not memory) first makes every later chunk split, so peaks count
    what the kernels asked for, rounded to 256 bytes, whatever ran before.
    """
    ballast = tf.raw_ops.Empty(shape=[_BALLAST_BYTES // 4], dtype=tf.float32, init=False)
    del ballast


def measure_stage(model, job, request) -> tuple[int, ...]:
    """Peak bytes of one training step of ``job``'s stage with each of
    ``job.inflights`` micro-batches in flight (see the module docstring)."""
    import tensorflow as tf
    from tofu_tf.tf import keras_adapter

    framework = keras_adapter.framework_of(model)
    keras = keras_adapter.keras_module(framework)
    gc.collect()
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    stage = _stage_model(keras, model, job)
    own_weights = sum(_rounded(_nbytes(tf, v)) for v in stage.weights)
    optimizer = keras_adapter.fresh_optimizer(framework, request.optimizer)
    loss_fn = keras_adapter.get_loss(framework, request.loss)
    step = _pipeline_step(tf, stage, optimizer, loss_fn, job.last)
    step([_stand_ins(tf, stage, job, request)])  # creates the optimizer's slots
    peaks = []
    for inflight in job.inflights:
        batches = [_stand_ins(tf, stage, job, request) for _ in range(inflight)]
        gc.collect()
        tf.config.experimental.reset_memory_stats("CPU:0")
        step(batches)
        peaks.append(int(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
                         + own_weights))
        del batches
    del stage, optimizer, step
    gc.collect()
    return tuple(peaks)


def _stage_model(keras, model, job):
    if isinstance(model, keras.Sequential):
        return _sequential_stage(keras, model, job)
    if job.first:
        inputs = list(model.inputs)
    else:
        inputs = model.get_layer(job.layers[0]).input
        if isinstance(inputs, (list, tuple, dict)):
            raise StageBuildError(
                f"a stage cannot start at layer {job.layers[0]!r}: it takes several inputs; "
                "start stages where one tensor flows (tofu_tf.pipeline.layer_stats' units)")
        inputs = [inputs]
    outputs = list(model.outputs) if job.last else [model.get_layer(job.layers[-1]).output]
    stage = keras.Model(inputs if len(inputs) > 1 else inputs[0],
                        outputs if len(outputs) > 1 else outputs[0])
    inner = {layer.name for layer in stage.layers if type(layer).__name__ != "InputLayer"}
    if not inner <= set(job.layers):
        raise StageBuildError(
            f"the stage {job.layers[0]!r} .. {job.layers[-1]!r} also needs layers "
            f"{sorted(inner - set(job.layers))}: stages must be cut where one tensor flows")
    return stage


def _sequential_stage(keras, model, job):
    """The stage as a new Sequential of the model's own layers (shared weights).

    A Sequential rebuilt from its config may have called its layers on more
    than one symbolic input, so ``layer.input`` does not name the stage's
    input; the earlier layers are replayed symbolically to find its shape.
    """
    source = model.inputs[0]
    x = keras.Input(shape=tuple(source.shape[1:]), dtype=source.dtype)
    for layer in model.layers:
        if layer.name == job.layers[0]:
            break
        x = layer(x)
    head = keras.Input(shape=tuple(x.shape[1:]), dtype=x.dtype)
    return keras.Sequential([head] + [model.get_layer(name) for name in job.layers])


def _nbytes(tf, variable) -> int:
    shape = [int(d) for d in variable.shape]
    size = 1
    for d in shape:
        size *= d
    return size * tf.as_dtype(variable.dtype).size


def _rounded(nbytes: int) -> int:
    return -(-nbytes // _BFC_GRANULE) * _BFC_GRANULE


def _random(tf, shape, dtype):
    dtype = tf.as_dtype(dtype)
    if dtype.is_integer:
        return tf.random.uniform(shape, 0, 2, dtype=dtype)
    return tf.random.normal(shape, dtype=dtype)


def _spec_shape(tensor, micro_batch: int) -> list[int]:
    return [micro_batch] + [int(d) for d in tensor.shape[1:]]


def _stand_ins(tf, stage, job, request) -> dict:
    """One micro-batch: the stage's inputs, and labels when it runs the loss."""
    micro = request.micro_batch
    inputs = [_random(tf, _spec_shape(t, micro), t.dtype) for t in stage.inputs]
    if not job.last:
        return {"x": inputs}
    out_shape = _spec_shape(stage.outputs[0], micro)
    loss_name = request.loss if isinstance(request.loss, str) else getattr(request.loss, "name", "")
    if "sparse" in str(loss_name).lower():
        labels = tf.random.uniform(out_shape[:-1], 0, 2, dtype=tf.int32)
    else:
        labels = tf.random.uniform(out_shape, 0, 1, dtype=tf.float32)
    return {"x": inputs, "labels": labels}


def _pipeline_step(tf, stage, optimizer, loss_fn, last: bool):
    """A step in a pipeline stage's order: all forwards in flight, then the backwards.

    Each backward adds its gradients in place into accumulators allocated once
    (as pipeline runtimes keep ``.grad`` buffers), so a further micro-batch in
    flight costs its activations and nothing else. A middle stage receives its
    output's gradient from the next stage when its backward starts, so the
    stand-in gradient is made only then.
    """
    variables = stage.trainable_variables
    accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in variables]

    def step(batches):
        for accumulator in accumulators:
            accumulator.assign(tf.zeros(accumulator.shape, accumulator.dtype))
        tapes, targets = [], []
        for batch in batches:
            with tf.GradientTape() as tape:
                x = batch["x"] if len(batch["x"]) > 1 else batch["x"][0]
                y = stage(x, training=True)
                targets.append(loss_fn(batch["labels"], y) if last else y)
            tapes.append(tape)
        for index, tape in enumerate(tapes):
            upstream = None if last else tf.random.normal(tf.shape(targets[index]))
            grads = tape.gradient(targets[index], variables, output_gradients=upstream)
            tapes[index] = targets[index] = upstream = None
            for accumulator, grad in zip(accumulators, grads):
                accumulator.assign_add(tf.convert_to_tensor(grad))
            del grads
        optimizer.apply_gradients(zip([a.read_value() for a in accumulators], variables))

    return step


if __name__ == "__main__":
    main(sys.argv[1])
