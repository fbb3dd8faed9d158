"""The DTensor expanders ``tofu_tf.search.targets`` lists as broken or limited,
each with a minimal DTensor program that shows the breakage and a test that the
strategy avoids it.

The DTensor programs run in subprocesses: a broken expander may segfault, and a
segfault must fail its test, not the suite. They also tell when a TF upgrade
fixes an expander (the program then runs, and its entry can go).
"""

import os
import subprocess
import sys

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tests import strategy_helpers as h
from tofu_tf.search import UnsupportedOpError, plan_graph
from tofu_tf.strategies.expansion_errors import PlanNotRunnableError
from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf.capture import DynamicShapeError, capture_training_step

pytestmark = pytest.mark.slow   # runs DTensor programs and trains under TofuStrategy, many in fresh Pythons

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MESH = """
import sys
from tofu_tf.tf import devices
devices.configure_virtual_cpus(8)
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
mesh = dtensor.create_mesh([("model", 8)], devices=[f"CPU:{i}" for i in range(8)])
U = dtensor.UNSHARDED
replicated = dtensor.Layout.replicated
"""


def _run(script: str, *args: str, timeout: int = 300, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


def _tail(out: subprocess.CompletedProcess) -> str:
    return f"rc={out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


# -- StridedSlice: a new axis before implicit axes ------------------------------

_NEW_AXIS = _MESH + """
value = tf.reshape(tf.range(128.0), (8, 16))
layout = replicated(mesh, 2) if sys.argv[1] == "replicated" else dtensor.Layout([U, "model"], mesh)
table = dtensor.relayout(dtensor.copy_to_mesh(value, replicated(mesh, 2)), layout)
for name, spec in (("spelled out", lambda t: t[None, :, :]), ("implicit axes", lambda t: t[None])):
    result = dtensor.relayout(tf.function(spec)(table), replicated(mesh, 3))
    assert np.array_equal(dtensor.unpack(result)[0].numpy(), value.numpy()[None])
    print(name, "ran", flush=True)
"""


@pytest.mark.parametrize("layout", ["replicated", "feature-split"])
def test_dtensor_crashes_on_a_new_axis_before_implicit_axes_in_every_layout(layout):
    """``t[None]`` dies inside DTensor (a segfault, or an error of garbage bytes) even
    on a replicated tensor; ``t[None, :, :]``, the same slice, runs."""
    out = _run(_NEW_AXIS, layout)
    assert "spelled out ran" in out.stdout, _tail(out)
    assert out.returncode != 0 and "implicit axes ran" not in out.stdout, _tail(out)


@pytest.mark.parametrize("spec, rank, want", [
    (None, 2, (None, slice(None), slice(None))),
    ((slice(None), None), 2, (slice(None), None, slice(None))),
    ((None, Ellipsis), 3, (None, slice(None), slice(None), slice(None))),
    ((Ellipsis, None), 2, (slice(None), slice(None), None)),
    ((None, 0), 3, (None, 0, slice(None), slice(None))),
    (0, 2, 0), ((slice(1, 3),), 2, (slice(1, 3),)),   # no new axis: left as written
])
def test_variable_slices_name_every_axis(spec, rank, want):
    assert variables_lib.spelled_out(spec, rank) == want


_POSITION_TABLE = _MESH + """
import tf_keras as keras
from tests import strategy_helpers as h
from tofu_tf.strategies import TofuStrategy
write, layouts = sys.argv[1], sys.argv[2]


class PositionTable(keras.layers.Layer):
    def build(self, shape):
        self.table = self.add_weight("table", shape=tuple(shape[1:]), initializer="random_normal")

    def call(self, x):
        return x + (self.table[None] if write == "slice" else tf.expand_dims(self.table, 0))


def build():
    keras.utils.set_random_seed(7)
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(32, 16, name="embedding")(tokens)
    x = PositionTable(name="position")(x)
    return keras.Model(tokens, keras.layers.Dense(32, name="head")(x))


def compile_adam(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


x, y = h.data_for(build())
if layouts == "planned":
    model, reference, loss, expected = h.train_beside_one_device(build, x, y, compile_fn=compile_adam)
    print("plan", dict(model.distribute_strategy.plan.variable_layouts), flush=True)
else:
    split = {"embedding/embeddings": (None, "model")}
    if layouts == "table-split":
        split["position/table"] = (None, "model")
    reference = build()
    initial = reference.get_weights()
    compile_adam(reference)
    expected = reference.fit(x, y, batch_size=h.BATCH, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8, plan=h.HandPlan({"model": 8}, split, {"x": (None,)}))
    with strategy.scope():
        model = build()
        compile_adam(model)
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=h.BATCH, shuffle=False, verbose=0).history["loss"]
h.assert_trained_alike(model, reference, loss, expected, rtol=1e-4)
print("trained alike", flush=True)
"""


@pytest.mark.parametrize("write, layouts", [
    ("slice", "planned"),         # the planner splits the embedding's features
    ("slice", "table-split"),     # and a feature-split position table
    ("expand_dims", "embedding-split"),
])
def test_position_table_trains_as_on_one_device(write, layouts):
    """A learned position table added as ``x + table[None]`` (or ``tf.expand_dims``)
    after a feature-split Embedding, trained with Adam, as one device trains it.
    ``table[None]`` is spelled out by the variable; the Embedding's sparse gradient
    is laid out like the table before Keras deduplicates its rows."""
    out = _run(_POSITION_TABLE, write, layouts, timeout=600)
    assert out.returncode == 0 and "trained alike" in out.stdout, _tail(out)


# -- relayout of a tensor whose size depends on the data ------------------------

_DATA_SIZED = _MESH + """
split = dtensor.Layout([U, "model"], mesh)
x = dtensor.copy_to_mesh(tf.reshape(tf.range(160.0), (10, 16)), replicated(mesh, 2))


def summed_rows(x, source_layout):
    ids = tf.cast(tf.math.floormod(x[:, 0], 7.0), tf.int32)   # data-dependent: nothing to fold
    unique, position = tf.unique(ids)
    x = dtensor.relayout(x, source_layout)
    rows = tf.math.unsorted_segment_sum(x, position, tf.shape(unique)[0])   # (?, 16)
    dense = tf.math.unsorted_segment_sum(rows, unique, 8)
    return tf.reduce_sum(dtensor.relayout(dense, split))


for name, source in (("source split like the result", split), ("source replicated", replicated(mesh, 2))):
    total = tf.function(lambda x: summed_rows(x, source))(x)
    assert float(dtensor.unpack(total)[0]) == float(sum(range(160)))
    print(name, "ran", flush=True)
"""


def test_dtensor_cannot_split_a_tensor_whose_size_depends_on_the_data():
    """An Embedding's deduplicated sparse gradient has a row count known only at run
    time. Laid out like the table it updates from the start, it needs no relayout
    and sums right; replicated, DTensor splits it and each shard has no rows
    ("data.shape = [0,2] does not start with segment_ids.shape = [7]")."""
    out = _run(_DATA_SIZED)
    assert "source split like the result ran" in out.stdout, _tail(out)
    assert out.returncode != 0 and "source replicated ran" not in out.stdout, _tail(out)
    # The kernel's error, or, when DTensor's async executor reports it at the next read
    # of the result, that read's cancellation.
    assert ("does not start with segment_ids.shape" in out.stderr
            or "Function was cancelled before it was started" in out.stderr), _tail(out)


# -- layout propagation that does not converge, and the reduce expander ------------

_RESIDUAL_BLOCKS = _MESH + """
# Tokens -> embedding -> residual blocks x + norm(x) @ w (w's output dim split) -> norm -> head,
# trained one SGD-with-momentum step. The scaled norm is an RMSNorm: its scale's gradient is a Sum.
blocks = int(sys.argv[1])
rng = np.random.default_rng(0)
tokens = dtensor.copy_to_mesh(tf.constant(rng.integers(0, 64, (8, 8)), tf.int32), replicated(mesh, 2))
labels = dtensor.copy_to_mesh(tf.constant(rng.integers(0, 64, (8, 8)), tf.int32), replicated(mesh, 2))


def variable(value, spec):
    value = tf.constant(value, tf.float32)
    return dtensor.DVariable(dtensor.relayout(dtensor.copy_to_mesh(value, replicated(mesh, value.shape.rank)),
                                              dtensor.Layout(spec, mesh)))


weights = [variable(rng.normal(size=(64, 32)) * 0.1, [U, U]), variable(np.zeros(32), [U])]
for _ in range(blocks):
    weights += [variable(np.zeros(32), [U]), variable(rng.normal(size=(32, 32)) * 0.1, [U, "model"])]
weights.append(variable(rng.normal(size=(32, 64)) * 0.1, [U, U]))
layouts = [w.layout for w in weights]
slots = [dtensor.DVariable(dtensor.call_with_layout(tf.zeros, layout, w.shape))
         for w, layout in zip(weights, layouts)]


def norm(x, scale):
    return x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + 1e-6) * (1.0 + scale)


@tf.function
def step(tokens, labels):
    with tf.GradientTape() as tape:
        x = tf.gather(weights[0], tokens)
        for i in range(blocks):
            x = x + tf.matmul(norm(x, weights[2 + 2 * i]), weights[3 + 2 * i])
        logits = tf.matmul(norm(x, weights[1]), weights[-1])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    for w, m, layout, g in zip(weights, slots, layouts, tape.gradient(loss, weights)):
        update = dtensor.relayout(0.9 * m - 0.1 * tf.convert_to_tensor(g), layout)
        m.assign(update)
        w.assign(dtensor.relayout(w + update, layout))
    return loss


step(tokens, labels)
print(blocks, "blocks ran", flush=True)
"""


def test_dtensor_reduce_expander_cannot_gather_what_a_non_converging_propagation_asks_for():
    """DTensor's layout propagation iterates producer and consumer requests to a fixed
    point. Two residual blocks, each adding a feature-split projection to a whole residual,
    make it oscillate; it gives up ("Failed to converge", logged at vmodule 2), clears the
    changing layouts and locks the rest, and then asks a Sum for an output less split than
    its input, which the reduce expander cannot make: it only splits further. One block
    converges and runs."""
    verbose = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "layout_propagation_v2=2"}
    one = _run(_RESIDUAL_BLOCKS, "1", env=verbose)
    assert one.returncode == 0 and "1 blocks ran" in one.stdout, _tail(one)
    assert "Failed to converge" not in one.stderr, _tail(one)
    two = _run(_RESIDUAL_BLOCKS, "2", env=verbose)
    assert two.returncode != 0 and "blocks ran" not in two.stdout, _tail(two)
    assert "Failed to converge" in two.stderr, _tail(two)
    assert "EmitAllScatter" in two.stderr, _tail(two)
    assert "was not more sharded than the original_layout" in two.stderr, _tail(two)


class _RMSNorm(keras3.layers.Layer):
    """An RMSNorm with a ``scale`` weight, as Gemma's and Llama's."""

    def build(self, shape):
        self.scale = self.add_weight(name="scale", shape=(shape[-1],), initializer="zeros")

    def call(self, x):
        x = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + 1e-6)
        return x * (1.0 + self.scale)


def _residual_lm():
    """Keras 3: embedding, two residual blocks x + Dense(norm(x)), a norm and a head."""
    keras3.utils.set_random_seed(7)
    tokens = keras3.Input((8,), dtype="int32")
    x = keras3.layers.Embedding(64, 32, name="embedding")(tokens)
    for i in range(2):
        x = x + keras3.layers.Dense(32, use_bias=False, name=f"out_{i}")(_RMSNorm(name=f"norm_{i}")(x))
    x = _RMSNorm(name="norm")(x)
    return keras3.Model(tokens, keras3.layers.Dense(64, use_bias=False, name="head")(x))


def _compile_keras3(model):
    model.compile(optimizer=keras3.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras3.losses.SparseCategoricalCrossentropy(from_logits=True))


def _tokens(steps: int = 3):
    rng = np.random.default_rng(0)
    return tuple(rng.integers(0, 64, (8 * steps, 8)).astype("int32") for _ in range(2))


def test_one_axis_splitting_the_batch_and_the_weights_fails_where_the_weights_alone_train():
    """Why the DTensor target gives each mesh axis the batch or the weights: the same
    feature-split projections train as one device with the batch whole, and fail in the
    first step (the reduce expander, after a propagation that did not converge) with the
    batch split on their axis."""
    split = {f"out_{i}/kernel": (None, "model") for i in range(2)}
    x, y = _tokens()
    whole = h.HandPlan({"model": 8}, split, {"x": (None, None)})
    h.assert_trained_alike(*h.train_beside_one_device_under(whole, _residual_lm, x, y, compile_fn=_compile_keras3))
    batch = h.HandPlan({"model": 8}, split, {"x": ("model", None)})
    # DTensor refuses it while compiling the step: the strategy says which op and what to try
    # (tofu_tf.strategies.expansion_errors).
    with pytest.raises(PlanNotRunnableError, match="a Sum op .*EmitAllScatter was passed a desired_layout "
                                                   r"\(unsharded, unsharded, unsharded\)"):
        h.train_beside_one_device_under(batch, _residual_lm, x, y, compile_fn=_compile_keras3)


# -- convolution gradients ------------------------------------------------------

_FILTER_GRADIENT = _MESH + """
rng = np.random.default_rng(0)
images = dtensor.copy_to_mesh(tf.constant(rng.normal(size=(8, 16, 16, 3)), tf.float32), replicated(mesh, 4))
grad = dtensor.copy_to_mesh(tf.constant(rng.normal(size=(8, 4, 4, 32)), tf.float32), replicated(mesh, 4))


def filter_gradient(x, dy):
    return tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=[4, 4, 3, 32], out_backprop=dy,
                                           strides=[1, 4, 4, 1], padding="VALID")


want = filter_gradient(dtensor.unpack(images)[0], dtensor.unpack(grad)[0]).numpy()
for name, spec in (("batch-split", ["model", U, U, U]), ("channel-split", [U, U, U, "model"])):
    got = tf.function(filter_gradient)(images, dtensor.relayout(grad, dtensor.Layout(spec, mesh)))
    assert np.allclose(dtensor.unpack(dtensor.relayout(got, replicated(mesh, 4)))[0].numpy(), want, atol=1e-4)
    print(name, "ran", flush=True)
"""


def test_dtensor_filter_gradient_takes_a_batch_parallel_output_gradient_only():
    """A patch embedding's filter gradient (stride 4): an output gradient split on the batch
    runs, one split on the channels is refused."""
    out = _run(_FILTER_GRADIENT)
    assert "batch-split ran" in out.stdout, _tail(out)
    assert out.returncode != 0 and "channel-split ran" not in out.stdout, _tail(out)
    assert "only supports batch parallel layouts.tf.Conv2DBackpropFilter" in out.stderr, _tail(out)


def _patch_classifier():
    """Keras 3: a ViT-style patch embedding (Conv2D, stride 4) -> tokens -> LayerNorm -> pool -> head."""
    keras3.utils.set_random_seed(7)
    images = keras3.Input((16, 16, 3))
    x = keras3.layers.Conv2D(32, 4, strides=4, name="patches")(images)
    x = keras3.layers.LayerNormalization(name="ln")(keras3.layers.Reshape((16, 32))(x))
    x = keras3.layers.GlobalAveragePooling1D()(x)
    return keras3.Model(images, keras3.layers.Dense(4, name="head")(x))


def test_a_patch_embedding_trains_under_a_feature_split_head():
    """The head's row split reaches the convolution's output gradient through the reshape;
    the strategy relays that gradient out batch-parallel, as the plan priced it (before:
    "only supports batch parallel layouts" in the first step)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 16, 16, 3)).astype("float32"), rng.integers(0, 4, (24,)).astype("int32")
    plan = h.HandPlan({"model": 8}, {"head/kernel": ("model", None)}, {"x": (None, None, None, None)})
    h.assert_trained_alike(*h.train_beside_one_device_under(plan, _patch_classifier, x, y,
                                                            compile_fn=_compile_keras3))


# -- gathers and contractions ------------------------------------------------------

_TABLE_ROWS = _MESH + """
value = tf.reshape(tf.range(64 * 16.0), (64, 16))
ids = [[3, 60, 7, 33]] * 8
for name, spec in (("features split", [U, "model"]), ("rows split", ["model", U])):
    table = dtensor.DVariable(dtensor.relayout(dtensor.copy_to_mesh(value, replicated(mesh, 2)),
                                               dtensor.Layout(spec, mesh)))
    rows = tf.function(table.sparse_read)(dtensor.copy_to_mesh(tf.constant(ids), replicated(mesh, 2)))
    got = dtensor.unpack(dtensor.relayout(rows, replicated(mesh, 3)))[0].numpy()
    assert np.array_equal(got, tf.gather(value, ids).numpy())
    print(name, "ran", flush=True)
"""


def test_dtensor_resource_gather_refuses_split_rows():
    """An Embedding's lookup (ResourceGather) on a table split by features runs; split by
    rows it is refused."""
    out = _run(_TABLE_ROWS)
    assert "features split ran" in out.stdout, _tail(out)
    assert out.returncode != 0 and "rows split ran" not in out.stdout, _tail(out)
    assert "does not support sharded 0th dimension for the resource tensor" in out.stderr, _tail(out)


_CONTRACTION = _MESH + """
mesh = dtensor.create_mesh([("a", 2), ("b", 4)], devices=[f"CPU:{i}" for i in range(8)])
x = tf.reshape(tf.range(8 * 32.0) / 100, (8, 32))
w = tf.reshape(tf.range(32 * 16.0) / 100, (32, 16))
on = lambda value, spec: dtensor.relayout(dtensor.copy_to_mesh(value, replicated(mesh, 2)),
                                         dtensor.Layout(spec, mesh))
for name, spec in (("same axis", [U, "b"]), ("different axes", [U, "a"])):
    got = tf.function(tf.matmul)(on(x, spec), on(w, ["b", U]))
    assert np.allclose(dtensor.unpack(dtensor.relayout(got, replicated(mesh, 2)))[0].numpy(), (x @ w).numpy())
    print(name, "ran", flush=True)
"""


def test_dtensor_matmul_refuses_a_contraction_split_on_two_axes():
    """The contracted dim split on the same mesh axis in both operands runs (partial sums,
    then a reduction); split on different axes it is refused, not relaid."""
    out = _run(_CONTRACTION)
    assert "same axis ran" in out.stdout, _tail(out)
    assert out.returncode != 0 and "different axes ran" not in out.stdout, _tail(out)
    assert "Contracting dimension for matmul has sharding dimension a" in out.stderr, _tail(out)


# -- fused optimizer updates: a weight and its slots in one op --------------------

_FUSED_MISMATCH = _MESH + """
bias = dtensor.DVariable(dtensor.call_with_layout(tf.ones, dtensor.Layout(["model"], mesh), shape=(256,)))
layout = dtensor.Layout(["model"], mesh) if sys.argv[1] == "alike" else replicated(mesh, 1)
momentum = dtensor.DVariable(dtensor.call_with_layout(tf.zeros, layout, shape=(256,)))
grad = dtensor.call_with_layout(tf.ones, dtensor.Layout(["model"], mesh), shape=(256,))


@tf.function
def update(grad):
    tf.raw_ops.ResourceApplyKerasMomentum(var=bias.handle, accum=momentum.handle, lr=tf.constant(0.1), grad=grad,
                                          momentum=tf.constant(0.9), use_locking=False, use_nesterov=False)


update(grad)
assert np.allclose(dtensor.unpack(bias.read_value())[0].numpy(), 0.9)
print("updated", flush=True)
"""


def test_dtensor_dies_when_a_fused_update_meets_a_slot_laid_out_otherwise():
    """tf-keras's legacy SGD updates a weight and its momentum in one op. DTensor's expander
    runs it when both share a layout and segfaults when the slot's differs (the lowering
    once moved a bias to its kernel's axis and not the bias's slot); slots now follow their
    weights (``tests/test_legacy_optimizers.py`` trains each such optimizer sharded)."""
    alike = _run(_FUSED_MISMATCH, "alike")
    assert alike.returncode == 0 and "updated" in alike.stdout, _tail(alike)
    mismatched = _run(_FUSED_MISMATCH, "mismatched")
    assert mismatched.returncode != 0 and "updated" not in mismatched.stdout, _tail(mismatched)


def test_lowered_slots_follow_their_weights_layout():
    from tofu_tf.tf import lowering
    layouts = {"dense/kernel": (None, "model"), "dense/bias": (None,),
               "SGD/dense/kernel/momentum": (None, "model"), "SGD/dense/bias/momentum": (None,),
               "Adam/m/dense/bias": (None,), "Adam/m/dense/kernel": (None, "model"), "optimizer/SGD/iter": ()}
    adjusted = lowering.dtensor_natural(layouts)
    assert adjusted["dense/bias"] == ("model",)
    assert adjusted["SGD/dense/bias/momentum"] == ("model",) and adjusted["Adam/m/dense/bias"] == ("model",)
    assert adjusted["optimizer/SGD/iter"] == ()


# -- ops without layout propagation ----------------------------------------------

_NO_PROPAGATION = _MESH + """
square = dtensor.copy_to_mesh(tf.eye(4) * 2.0 + 1.0, replicated(mesh, 2))
written = {
    "Svd": lambda a: tf.linalg.svd(a)[0], "MatrixDeterminant": tf.linalg.det,
    "LogMatrixDeterminant": lambda a: tf.linalg.slogdet(a)[1], "MatrixInverse": tf.linalg.inv,
    "SelfAdjointEigV2": lambda a: tf.linalg.eigh(a)[0], "MatrixSolve": lambda a: tf.linalg.solve(a, a),
    "MatrixTriangularSolve": lambda a: tf.linalg.triangular_solve(a, a),
    "MatrixBandPart": lambda a: tf.linalg.band_part(a, 0, -1), "MatrixDiagPartV3": tf.linalg.diag_part,
    "MatrixDiagV3": lambda a: tf.linalg.diag(a[0]), "MatrixSetDiagV3": lambda a: tf.linalg.set_diag(a, a[0]),
    "Cumprod": lambda a: tf.math.cumprod(a, axis=1),
    "DenseBincount": lambda a: tf.math.bincount(tf.cast(a, tf.int32), minlength=4, maxlength=4, dtype=tf.float32),
    "EagerPyFunc": lambda a: tf.py_function(lambda t: t * 2, [a], tf.float32),
    "PyFunc": lambda a: tf.numpy_function(lambda t: t * 2, [a], tf.float32, stateful=True),
    "PyFuncStateless": lambda a: tf.numpy_function(lambda t: t * 2, [a], tf.float32, stateful=False),
    # Stateful draws, from a constant shape: a custom train_step's tf.random.normal(...).
    "RandomStandardNormal": lambda a: a + tf.random.normal((4, 4)), "RandomUniform": lambda a: a + tf.random.uniform((4, 4)),
    "RandomUniformInt": lambda a: a + tf.cast(tf.random.uniform((4, 4), 0, 3, tf.int32), tf.float32),
    "TruncatedNormal": lambda a: a + tf.random.truncated_normal((4, 4)),
    "Multinomial": lambda a: a + tf.cast(tf.random.categorical(tf.zeros((4, 3)), 4), tf.float32),
}
# The fused updates of tf-keras's legacy optimizers: (inputs, the gradient's position, variables written).
import inspect
slots = [dtensor.DVariable(dtensor.copy_to_mesh(tf.ones((4, 4)), replicated(mesh, 2))) for _ in range(4)]
FUSED = {"ResourceApplyProximalGradientDescent": (5, 4, 1), "ResourceApplyAdagrad": (4, 3, 2),
         "ResourceApplyProximalAdagrad": (6, 5, 2), "ResourceApplyAdaMax": (9, 8, 3),
         "ResourceApplyAdadelta": (7, 6, 3), "ResourceApplyRMSProp": (8, 7, 3), "ResourceApplyFtrl": (8, 3, 3),
         "ResourceApplyFtrlV2": (9, 3, 3), "ResourceApplyAdamWithAmsgrad": (11, 10, 4)}


def fused(op_type, count, grad_at, written):
    raw = getattr(tf.raw_ops, op_type)
    params = [p for p in inspect.signature(raw).parameters
              if p not in ("use_locking", "use_nesterov", "name", "multiply_linear_by_lr", "update_slots")][:count]

    def run(grad):
        raw(**{p: slots[i].handle if i < written else grad if i == grad_at else tf.constant(-0.5 if "power" in p else 0.5)
               for i, p in enumerate(params)})
        return slots[0].read_value()
    return run


written.update({op_type: fused(op_type, *spec) for op_type, spec in FUSED.items()})
assert set(sys.argv[1:]) <= set(written), sorted(set(sys.argv[1:]) - set(written))
for op_type, fn in [(op_type, written[op_type]) for op_type in sys.argv[1:]]:
    try:
        tf.function(fn)(square)
        print(op_type, "ran", flush=True)
    except Exception as error:
        if (f"'tf.{op_type}' op does not implement layout propagation" in str(error)
                or f"'tf.{op_type}' op ComputeLayoutForward error: Stateful random operations are not supported"
                in str(error)):
            print(op_type, "refused", flush=True)
        else:
            print(op_type, "failed otherwise:", str(error)[:300], flush=True)
"""


# Which op types DTensor refuses even replicated (``NO_LAYOUT_PROPAGATION``) is derived by probing
# one-op programs (bench/dtensor_support.py) and checked against the checked-in table by
# tests/test_dtensor_support.py.


def test_dtensor_refuses_the_stateful_draws_a_custom_train_step_is_refused_for():
    """Every stateful draw ``tofu_tf.strategies.custom_steps`` refuses in a model's own train_step is
    refused by DTensor, even from a constant shape on a replicated input."""
    from tofu_tf.strategies.custom_steps import STATEFUL_DRAWS
    out = _run(_NO_PROPAGATION, *sorted(STATEFUL_DRAWS))
    assert out.returncode == 0, _tail(out)
    assert sorted(out.stdout.split()) == sorted([word for op in STATEFUL_DRAWS for word in (op, "refused")]), _tail(out)


class _Spectral(keras.layers.Layer):
    """A square weight scaled by its largest singular value (spectral normalization)."""

    def build(self, shape):
        self.w = self.add_weight("w", shape=(shape[-1], shape[-1]), initializer="random_normal")

    def call(self, x):
        return tf.matmul(x, self.w) / tf.linalg.svd(self.w, compute_uv=False)[0]


class _Doubled(keras.layers.Layer):
    """A Python function in the step (tf.py_function), with its static shape set."""

    def call(self, x):
        out = tf.py_function(lambda t: t * 2.0, [x], tf.float32)
        out.set_shape(x.shape)
        return out


def _model(*layers):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((16,))
    x = inputs
    for layer in layers:
        x = layer(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))


def test_svd_is_refused_before_the_first_step_with_the_layer_and_a_way_out():
    from tofu_tf.strategies import TofuStrategy
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = _model(keras.layers.Dense(16, name="d1"), _Spectral(name="spectral"))
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(UnsupportedOpError,
                       match=r"Svd '[^']*' \(Keras layer 'spectral', from tf\.linalg\.svd.*callback"):
        strategy.plan_model(model, batch_size=8)


def test_a_py_function_on_the_data_is_refused_with_its_layer():
    """No gradient flows through it (it reads the features), so capture succeeds; the plan refuses it."""
    graph = capture_training_step(_model(_Doubled(name="doubled")), batch_size=8,
                                  loss="sparse_categorical_crossentropy", optimizer="adam")
    with pytest.raises(UnsupportedOpError, match=r"EagerPyFunc .*'doubled'.*tf\.py_function.*TensorFlow ops"):
        plan_graph(graph, num_devices=8, hardware="cpu-virtual")


def test_a_py_function_gradient_explains_itself_at_capture():
    """Through a weight, the gradient is a second Python function, of unknown shape."""
    model = _model(keras.layers.Dense(16, name="d1"), _Doubled(name="doubled"))
    with pytest.raises(DynamicShapeError, match=r"EagerPyFunc.*'doubled'.*tf\.py_function.*TensorFlow ops"):
        capture_training_step(model, batch_size=8, loss="sparse_categorical_crossentropy", optimizer="adam")


def test_constant_inputs_are_not_refused():
    """A causal mask's band_part computes on constants only, which DTensor folds."""
    from tofu_tf import models
    graph = capture_training_step(models.gpt(num_layers=1, d_model=16, num_heads=4, seq_len=8, vocab_size=32),
                                  batch_size=8, loss="sparse_categorical_crossentropy", optimizer="adam")
    assert any(op.type == "MatrixBandPart" for op in graph.ops)
    plan_graph(graph, num_devices=8, hardware="cpu-virtual")
