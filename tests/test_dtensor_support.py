"""The ops DTensor cannot lay out, derived by probing (``tofu_tf.search.dtensor_support``,
``bench/dtensor_support.py``), and the strategy refusing them before the first step.

Before, the list was written by hand and missed ``TensorListStack`` (a ``tf.scan`` in
keras-hub RWKV-7), ``DepthwiseConv2dNativeBackpropFilter`` (a layer's own depthwise
convolution) and ``BatchMatMulV3`` (an int8 matmul): each failed inside the first step
with DTensor's ``UnknownError`` ("op does not implement layout propagation") instead of
a refusal naming the layer.
"""

import json
import os
import subprocess
import sys

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf

from tofu_tf import semantics
from tofu_tf.search import UnsupportedOpError, dtensor_support, targets
from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf.capture import capture_training_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 8


def test_the_table_covers_every_described_op_type_and_was_derived_on_this_tensorflow():
    """A newly described op type has no outcome until the table is derived again; a TensorFlow
    upgrade asks for that too (``python bench/dtensor_support.py --write``)."""
    table = dtensor_support.load()
    described = set(semantics.default_registry().op_types())
    assert described - set(table.ops) == set(), "described op types the table has not probed"
    assert set(table.ops) - described == set(table.sweep)
    assert all(set(per) == set(table.layouts) for per in table.ops.values())
    assert table.tensorflow == tf.__version__, (
        f"the table was derived on TensorFlow {table.tensorflow}, this is {tf.__version__}: "
        "run python bench/dtensor_support.py --write and review the diff")


def test_the_ops_the_hand_written_list_missed_are_derived():
    refused = dtensor_support.load().refused_in_every_layout()
    assert {"TensorListStack", "MatrixDiagV3", "DepthwiseConv2dNativeBackpropFilter", "BatchMatMulV3"} <= refused
    assert not refused & {"MatMul", "BatchMatMulV2", "Conv2D", "Conv2DBackpropFilter", "While", "SelectV2"}
    # what the strategy has DTensor run replicated is planned replicated, not refused
    assert targets.ENROLLED_REPLICATED <= refused & targets.REPLICATED_ONLY
    assert not targets.ENROLLED_REPLICATED & targets.NO_LAYOUT_PROPAGATION


def _same(recorded: dict, probed: dict) -> bool:
    """Outcomes agree; a crash seen in only some runs agrees with what the other runs give."""
    if "intermittent" in (recorded["outcome"], probed["outcome"]):
        return True
    return (recorded["outcome"], recorded.get("refuses")) == (probed["outcome"], probed.get("refuses"))


@pytest.mark.slow
def test_probing_again_gives_the_checked_in_table(tmp_path):
    """Fails when TensorFlow changes what DTensor lays out (an op gains or loses a rule): the
    message names the ops and how to derive the table again. Every probe runs in child
    processes; a segfault is an outcome."""
    out = tmp_path / "probed.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "dtensor_support.py"), f"--out={out}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    probed = json.loads(out.read_text())["ops"]
    with open(dtensor_support.TABLE_PATH, encoding="utf-8") as handle:
        recorded = json.load(handle)["ops"]
    changed = {f"{key}@{layout}": (recorded[key][layout], probed[key][layout])
               for key in recorded for layout in recorded[key] if not _same(recorded[key][layout], probed[key][layout])}
    assert not changed, ("DTensor lays these ops out otherwise than the checked-in table says; review and run "
                         f"python bench/dtensor_support.py --write:\n{json.dumps(changed, indent=1)}")


# -- refused before the first step, naming the op, its layer and what to do -----------------------

class _Scan(keras3.layers.Layer):
    """A running sum over the sequence, as a recurrence written with tf.scan (RWKV's time mixing)."""

    def call(self, x):
        return tf.transpose(tf.scan(lambda acc, step: acc * 0.5 + step, tf.transpose(x, (1, 0, 2))), (1, 0, 2))


class _MapFn(keras3.layers.Layer):
    """Each example through its own small function, with tf.map_fn (a While loop over TensorArrays)."""

    def call(self, x):
        return tf.map_fn(lambda row: tf.math.cumsum(row, axis=0), x)


class _OwnDepthwise(keras3.layers.Layer):
    """A depthwise convolution through tf.nn, not keras.layers.DepthwiseConv2D nor keras.ops.depthwise_conv
    (which TofuStrategy computes as grouped convolutions, tests/test_depthwise.py)."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(3, 3, shape[-1], 1), initializer="glorot_uniform")

    def call(self, x):
        return tf.nn.depthwise_conv2d(x, self.kernel, (1, 1, 1, 1), "SAME")


class _Int8Matmul(keras3.layers.Layer):
    """An int8 matmul of the features with themselves (as an int8-quantized layer computes)."""

    def call(self, x):
        q = tf.cast(tf.clip_by_value(tf.round(x * 10.0), -127.0, 127.0), tf.int8)
        return x + tf.cast(tf.linalg.matmul(q, q, transpose_b=True, output_type=tf.int32)[:, :, :1], tf.float32)


def _refused(layer, shape, match):
    keras3.utils.set_random_seed(7)
    strategy = TofuStrategy(8)
    with strategy.scope():
        inputs = keras3.Input(shape)
        x = keras3.layers.Dense(shape[-1], name="d1")(inputs)
        x = keras3.layers.Flatten()(layer(x))
        model = keras3.Model(inputs, keras3.layers.Dense(4, name="head")(x))
        model.compile(optimizer=keras3.optimizers.SGD(0.05),
                      loss=keras3.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(BATCH, *shape)).astype("float32"), rng.integers(0, 4, BATCH).astype("int32")
    with pytest.raises(UnsupportedOpError, match=match):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_loop_over_tensor_arrays_in_a_layer_is_refused_naming_the_layer():
    """The strategy's strict check refuses a tf.map_fn's TensorListStack by name (a tf.scan of static
    length it unrolls, tests/test_scans.py); so does it a scan's on a step captured without the strategy."""
    _refused(_MapFn(name="per_row"), (6, 4),
             r"TensorListStack '[^']*' \(Keras layer 'per_row', from a tf\.while_loop, tf\.scan.*unroll the loop")
    keras3.utils.set_random_seed(7)
    inputs = keras3.Input((6, 4))
    model = keras3.Model(inputs, keras3.layers.Dense(4, name="head")(
        keras3.layers.Flatten()(_Scan(name="time_mix")(keras3.layers.Dense(4, name="d1")(inputs)))))
    graph = capture_training_step(model, batch_size=BATCH, loss="mse", optimizer="sgd")
    with pytest.raises(UnsupportedOpError, match=r"TensorListStack '[^']*' \(Keras layer 'time_mix', from a "
                                                 r"tf\.while_loop, tf\.scan.*unroll the loop"):
        targets.check_lowerable(graph, targets.Target.DTENSOR, exempt=frozenset())


def test_a_layers_own_depthwise_convolution_is_refused_naming_the_layer():
    _refused(_OwnDepthwise(name="own_dw"), (6, 6, 4),
             r"DepthwiseConv2dNativeBackprop(Filter|Input) '[^']*' \(Keras layer 'own_dw'.*"
             r"keras\.layers\.DepthwiseConv2D.*keras\.ops\.depthwise_conv")


def test_an_int8_matmul_is_refused_naming_the_layer():
    _refused(_Int8Matmul(name="int8"), (4, 4), r"BatchMatMulV3 '[^']*' \(Keras layer 'int8'.*quantize it after")


# -- ops the strategy enrolls in DTensor's replicated expansion (targets.ENROLLED_REPLICATED) -------

_EYE = """
import os, sys
from tofu_tf.tf import devices
devices.configure_virtual_cpus(8)
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tofu_tf.tf.compat import decoding
mesh = dtensor.create_mesh([("batch", 2), ("model", 4)], devices=[f"CPU:{i}" for i in range(8)])
if sys.argv[1] == "enrolled":
    print("ENROLLED", decoding.enroll_step_ops({"MatrixDiagV3": 1, "MatMul": 1}))
x = np.arange(8 * 48, dtype="float32").reshape(8, 48)
on_mesh = dtensor.relayout(dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, 2)),
                           dtensor.Layout.batch_sharded(mesh, "batch", rank=2))
for name, fn in (("eye 48 (not folded)", lambda t: t @ tf.eye(48) + tf.linalg.diag(t[0])[:8]),):
    try:
        got = dtensor.relayout(tf.function(fn)(on_mesh), dtensor.Layout.replicated(mesh, 2))
        print("RAN", np.array_equal(dtensor.unpack(got)[0].numpy(), fn(tf.constant(x)).numpy()))
    except tf.errors.UnknownError as error:
        print("REFUSED", str(error).splitlines()[0][-160:])
"""


@pytest.mark.parametrize("how", ["as_is", "enrolled"])
def test_dtensor_runs_an_eye_too_large_to_fold_only_enrolled(how):
    """``tf.eye(48)`` (9 KiB) is not folded by DTensor and ``MatrixDiagV3`` has no layout
    propagation; enrolled in DTensor's replicated expansion it runs, as on one device. The probe
    of ``targets.ENROLLED_REPLICATED``, both sides of the switch (a fresh Python each: the switch
    is process-wide)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_")}
    out = subprocess.run([sys.executable, "-c", _EYE, how], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**env, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"})
    tail = f"rc={out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    if how == "as_is":     # when TensorFlow gains a rule for it, this fails: the enrollment can go
        assert "REFUSED" in out.stdout and "MatrixDiagV3' op does not implement layout propagation" in out.stdout, tail
    else:
        assert "ENROLLED ('tf.MatrixDiagV3',)" in out.stdout and "RAN True" in out.stdout, tail


class _Eye(keras3.layers.Layer):
    """Scaled features through an identity of their width (a ``keras.ops.eye`` too large for DTensor
    to fold, as keras-hub Qwen3.5's gated delta rule adds one of its chunk size)."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return keras3.ops.matmul(x * self.scale, keras3.ops.eye(x.shape[-1]))


_EYE_STEP = """
import os
from tofu_tf.tf import devices
devices.configure_virtual_cpus(8)
import numpy as np
from tests import strategy_helpers as helpers
from tests.test_dtensor_support import eye_model
import keras
rng = np.random.default_rng(0)
x, y = rng.normal(size=(24, 48)).astype("float32"), rng.integers(0, 4, 24).astype("int32")
strategy, _, _ = helpers.fit_beside_one_device(eye_model, lambda m: helpers.compile_with_momentum(keras, m), x, y,
                                               rtol=1e-5, atol=1e-6)
print("TRAINED", os.environ.get("DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.MATRIXDIAGV3"))
"""


def eye_model():
    keras3.utils.set_random_seed(7)
    inputs = keras3.Input((48,))
    x = _Eye(name="eye")(keras3.layers.Dense(48, name="d1")(inputs))
    return keras3.Model(inputs, keras3.layers.Dense(4, name="head")(x))


@pytest.mark.slow
def test_a_layer_adding_a_large_eye_trains_as_one_device():
    """Before, the planner took ``keras.ops.eye(48)`` for folded and the first step failed inside
    DTensor ("'tf.MatrixDiagV3' op does not implement layout propagation"); the strategy now enrolls
    the op (``dtensor_replicated_ops``) and plans it replicated. A fresh Python: the switch is
    process-wide."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_")}
    out = subprocess.run([sys.executable, "-c", _EYE_STEP], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**env, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert "TRAINED 1" in out.stdout, f"rc={out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
