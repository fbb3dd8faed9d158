"""The DTensor expanders ``tofu_tf.search.targets`` lists as broken, each with a
minimal DTensor program that shows the breakage and a test that the strategy
avoids it.

The DTensor programs run in subprocesses: a broken expander may segfault, and a
segfault must fail its test, not the suite. They also tell when a TF upgrade
fixes an expander (the program then runs, and its entry can go).
"""

import os
import subprocess
import sys

import pytest
import tensorflow as tf
import tf_keras as keras

from tofu_tf.search import UnsupportedOpError, plan_graph
from tofu_tf.search.targets import NO_LAYOUT_PROPAGATION
from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf.capture import DynamicShapeError, capture_training_step

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


def _run(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"), timeout=timeout)


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
from strategies import TofuStrategy
from tests import strategy_helpers as h
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
}
assert sorted(written) == sorted(sys.argv[1:]), sorted(set(written) ^ set(sys.argv[1:]))
for op_type, fn in written.items():
    try:
        tf.function(fn)(square)
        print(op_type, "ran", flush=True)
    except Exception as error:
        if f"'tf.{op_type}' op does not implement layout propagation" in str(error):
            print(op_type, "refused", flush=True)
        else:
            print(op_type, "failed otherwise:", str(error)[:300], flush=True)
"""


def test_dtensor_has_no_layout_propagation_for_the_listed_ops():
    """Every op type of ``NO_LAYOUT_PROPAGATION`` is refused by DTensor on a replicated input."""
    out = _run(_NO_PROPAGATION, *sorted(NO_LAYOUT_PROPAGATION))
    assert out.returncode == 0, _tail(out)
    assert sorted(out.stdout.split()) == sorted(
        [word for op in NO_LAYOUT_PROPAGATION for word in (op, "refused")]), _tail(out)


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
    from strategies import TofuStrategy
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
