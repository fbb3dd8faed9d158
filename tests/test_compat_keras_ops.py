"""Keras 3 ops rewritten with ops DTensor can lay out while a step is traced
(tofu_tf.tf.compat.keras_ops): same values as Keras' own, on the tracing thread only."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla
from tensorflow.experimental import dtensor

from tofu_tf.tf.compat import keras_ops

keras = pytest.importorskip("keras")


@pytest.mark.parametrize("start", [(0, 0), (2, 3), (5, 6), (-2, 9)])   # the last two are clamped as XLA clamps
def test_a_slice_update_writes_what_xla_writes(start):
    inputs = tf.reshape(tf.range(48, dtype=tf.float32), (6, 8))
    updates = -tf.ones((3, 4))
    want = xla.dynamic_update_slice(inputs, updates, tf.constant(start))
    np.testing.assert_array_equal(keras_ops.slice_update_as_select(inputs, list(start), updates), want)


@pytest.mark.parametrize("shift,axis", [(1, 1), (-3, 2), ((2, -1), (1, 2)), (7, 0), (0, 1)])
def test_a_roll_by_slices_is_tf_roll(shift, axis):
    x = tf.reshape(tf.range(2 * 5 * 4, dtype=tf.float32), (2, 5, 4))
    got = keras_ops.roll_as_slices(tf.roll, x, shift, axis)
    np.testing.assert_array_equal(got, tf.roll(x, shift=shift, axis=axis))


def _graph_ops(fn):
    return {op.type for op in tf.function(fn).get_concrete_function(tf.TensorSpec((8, 8, 8, 2))).graph.get_operations()}


def _shifted_mask(x):
    mask = keras.ops.slice_update(keras.ops.zeros((1, 8, 8, 1), "int32"), [0, 4, 4, 0],
                                  keras.ops.ones((1, 4, 4, 1), "int32"))
    return keras.ops.roll(x, shift=(-2, -2), axis=(1, 2)) * keras.ops.cast(mask, x.dtype)


def test_only_the_thread_inside_builds_the_rewritten_ops():
    assert {"Roll", "XlaDynamicUpdateSlice"} <= _graph_ops(_shifted_mask)
    with keras_ops.dtensor_expandable_ops():
        inside = _graph_ops(_shifted_mask)
    assert not {"Roll", "XlaDynamicUpdateSlice"} & inside
    assert {"Roll", "XlaDynamicUpdateSlice"} <= _graph_ops(_shifted_mask)      # Keras' own again


def test_the_rewritten_ops_run_on_a_batch_split_mesh_as_on_one_device():
    mesh = dtensor.create_mesh([("batch", 8)], devices=[f"CPU:{i}" for i in range(8)])
    host = tf.random.stateless_normal((8, 8, 8, 2), seed=(1, 2))
    x = dtensor.relayout(dtensor.copy_to_mesh(host, dtensor.Layout.replicated(mesh, rank=4)),
                         dtensor.Layout.batch_sharded(mesh, "batch", rank=4))
    with pytest.raises(tf.errors.UnknownError, match="does not implement layout propagation"):
        tf.function(_shifted_mask)(x)
    with keras_ops.dtensor_expandable_ops():
        step = tf.function(_shifted_mask)
        got = step(x)
    got = np.concatenate([shard.numpy() for shard in dtensor.unpack(got)])
    np.testing.assert_array_equal(got, _shifted_mask(host))


@pytest.mark.parametrize("spec", [["batch", "unsharded"], ["unsharded", "unsharded"]])
def test_a_slice_update_at_a_tensor_start_writes_on_the_mesh(spec):
    """keras-hub's decoding loop writes its next token at a start that is a tensor. The first
    rewrite (TensorStridedSliceUpdate) left the input unchanged under DTensor there, silently."""
    mesh = dtensor.create_mesh([("batch", 2), ("model", 4)], devices=[f"CPU:{i}" for i in range(8)])
    layout = dtensor.Layout(spec, mesh)
    prompt = dtensor.relayout(dtensor.copy_to_mesh(tf.zeros((4, 12), tf.int32), dtensor.Layout.replicated(mesh, 2)),
                              layout)
    token = dtensor.relayout(dtensor.copy_to_mesh(tf.constant([[1], [2], [3], [4]]), dtensor.Layout.replicated(mesh, 2)),
                             layout)

    @tf.function
    def write(prompt, token, index):
        return keras_ops.slice_update_as_select(prompt, [0, index], token)

    out = write(prompt, token, dtensor.copy_to_mesh(tf.constant(5), dtensor.Layout.replicated(mesh, 0)))
    from tofu_tf.tf.variables import gather_to_host
    value = gather_to_host(out, dtensor.fetch_layout(out))
    assert value[:, 5].tolist() == [1, 2, 3, 4] and value.sum() == 10
    assert dtensor.fetch_layout(out).sharding_specs == spec


@pytest.mark.parametrize("dtype", [None, "float32", "int32", "bool"])
def test_a_one_hot_by_comparison_is_keras_one_hot(dtype):
    indices = tf.constant([[0, 3], [2, 2], [-1, 4], [1, 0]])     # -1 and 4 (out of range) give a row of zeros
    want = keras.ops.one_hot(indices, 4, dtype=dtype)
    got = keras_ops.one_hot_as_equal(None, indices, 4, dtype=dtype)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_a_sparse_or_inner_one_hot_keeps_keras_own():
    calls = []
    original = lambda *args, **kwargs: calls.append(kwargs) or "kept"     # noqa: E731
    assert keras_ops.one_hot_as_equal(original, tf.constant([0, 1]), 3, sparse=True) == "kept"
    assert keras_ops.one_hot_as_equal(original, tf.constant([[0, 1]]), 3, axis=0) == "kept"
    assert len(calls) == 2


_ROUTER = """
import sys
from tofu_tf.tf import devices
devices.configure_virtual_cpus(8)
import numpy as np
import keras
import tensorflow as tf
from tensorflow.experimental import dtensor
from tofu_tf.tf.compat import keras_ops
mesh = dtensor.create_mesh([("model", 4), ("other", 2)], devices=[f"CPU:{i}" for i in range(8)])
rng = np.random.default_rng(0)
h, w, e = (tf.constant(rng.normal(size=s).astype("float32")) for s in ((64, 16), (16, 4), (4, 64, 16)))


def route(h, w, e):
    # Qwen3-MoE's router (keras-hub Qwen3SparseMoeBlock): top-2 of 4 experts, one-hot encoded,
    # weighting the experts' outputs, whose expert axis is split
    top_p, top_i = keras.ops.top_k(tf.nn.softmax(h @ w), k=2)
    full = keras.ops.transpose(keras.ops.sum(keras.ops.one_hot(top_i, 4) * top_p[..., None], axis=1))
    return keras.ops.sum(e * full[:, :, None], axis=0)


want = route(h, w, e).numpy()
args = [dtensor.copy_to_mesh(t, dtensor.Layout.replicated(mesh, t.shape.rank)) for t in (h, w, e)]
args[2] = dtensor.relayout(args[2], dtensor.Layout(["model", dtensor.UNSHARDED, dtensor.UNSHARDED], mesh))
if sys.argv[1] == "rewritten":
    with keras_ops.dtensor_expandable_ops():
        step = tf.function(route)
        got = step(*args)
else:
    try:
        got = tf.function(route)(*args)
    except tf.errors.UnknownError as error:
        print("REFUSED", [line for line in str(error).splitlines() if "error:" in line][:2])
        raise SystemExit(0)
got = dtensor.relayout(got, dtensor.Layout.replicated(mesh, 2))
print("RAN", np.abs(dtensor.unpack(got)[0].numpy() - want).max())
"""


@pytest.mark.parametrize("how", ["keras", "rewritten"])
def test_a_router_one_hot_meeting_split_experts_runs_rewritten(how):
    """DTensor's OneHot expander mis-shapes its output when propagation splits the one-hot
    (experts) axis, as in Qwen3-MoE's router; compared by ``Equal`` it runs as on one device.
    In a fresh Python: a broken expander may abort the process."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _ROUTER, how], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": root, "TF_CPP_MIN_LOG_LEVEL": "2"})
    tail = f"rc={out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    if how == "keras":      # when a TF upgrade fixes the expander, this fails: the rewrite can go
        assert "REFUSED" in out.stdout and "inconsistent with the provided layout" in out.stdout, tail
    else:
        assert out.returncode == 0 and "RAN" in out.stdout, tail
        assert float(out.stdout.split("RAN")[1]) < 1e-5, tail


@pytest.mark.parametrize("sorted_", [True, False])
def test_a_top_k_gradient_by_comparison_is_tf_own(sorted_):
    x = tf.constant(np.random.default_rng(0).normal(size=(6, 3, 8)).astype("float32"))
    weights = tf.constant(np.random.default_rng(1).normal(size=(6, 3, 3)).astype("float32"))

    def run(top_k):
        with tf.GradientTape() as tape:
            tape.watch(x)
            values, indices = top_k(x)
            loss = tf.reduce_sum(values * weights)
        return values, indices, tape.gradient(loss, x)
    want = run(lambda t: tf.math.top_k(t, 3, sorted=sorted_))
    got = run(lambda t: keras_ops.top_k_gradient_by_comparison(None, t, 3, sorted=sorted_))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_an_integer_top_k_keeps_keras_own():
    assert keras_ops.top_k_gradient_by_comparison(lambda *a, **k: "kept", tf.constant([[3, 1, 2]]), 2) == "kept"


_TOP_K_GRADIENT = """import sys
from tofu_tf.tf import devices
devices.configure_virtual_cpus(8)
import numpy as np
import keras
import tensorflow as tf
from tensorflow.experimental import dtensor
from tofu_tf.tf.compat import keras_ops
# a router's top-2 over the tokens of a batch split 8 ways (data parallel), its gradient
mesh = dtensor.create_mesh([("batch", 8)], devices=[f"CPU:{i}" for i in range(8)])
rng = np.random.default_rng(0)
x = tf.constant(rng.normal(size=(64, 4)).astype("float32"))
w = tf.constant(rng.normal(size=(64, 2)).astype("float32"))


def gradient(x, w):
    with tf.GradientTape() as tape:
        tape.watch(x)
        top_p, _ = keras.ops.top_k(tf.nn.softmax(x), k=2)
        loss = tf.reduce_sum(top_p * w)
    return tape.gradient(loss, x)


want = gradient(x, w).numpy()
args = [dtensor.relayout(dtensor.copy_to_mesh(t, dtensor.Layout.replicated(mesh, 2)),
                         dtensor.Layout.batch_sharded(mesh, "batch", rank=2)) for t in (x, w)]
try:
    if sys.argv[1] == "rewritten":
        with keras_ops.dtensor_expandable_ops():
            step = tf.function(gradient)
            got = step(*args)
    else:
        got = tf.function(gradient)(*args)
    got = dtensor.relayout(got, dtensor.Layout.replicated(mesh, 2))
    print("RAN", np.abs(dtensor.unpack(got)[0].numpy() - want).max())
except (tf.errors.UnknownError, tf.errors.InvalidArgumentError, tf.errors.CancelledError) as error:
    # DTensor runs the shards asynchronously: the shard's own error or the cancelled rendezvous of
    # another may surface first (the shard's is logged either way)
    print("REFUSED", str(error).splitlines()[0][-200:])
    raise SystemExit(0)
"""


@pytest.mark.parametrize("how", ["keras", "rewritten"])
def test_a_top_k_gradient_on_a_split_batch_runs_rewritten(how):
    """TopKV2's gradient scatters at global flat positions; under a batch split DTensor's ScatterNd
    indexes each shard with them (Qwen3.5-MoE's router, data parallel). By comparison it runs as on
    one device. In a fresh Python."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _TOP_K_GRADIENT, how], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": root, "TF_CPP_MIN_LOG_LEVEL": "2"})
    tail = f"rc={out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    if how == "keras":      # when a TF upgrade fixes the expander, this fails: the rewrite can go
        assert "REFUSED" in out.stdout and "does not index into shape" in out.stdout + out.stderr, tail
    else:
        assert out.returncode == 0 and "RAN 0.0" in out.stdout, tail


@pytest.mark.parametrize("sections, axis", [(2, -1), (3, 1), ([1, 4], 0), ([2], -1), ([0, 5], 1)])
def test_a_split_by_slices_is_keras_split(sections, axis):
    x = tf.reshape(tf.range(6 * 6 * 4, dtype=tf.float32), (6, 6, 4))
    want = keras.ops.split(x, sections, axis=axis)
    got = keras_ops.split_as_slices(None, x, sections, axis=axis)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_split_it_cannot_slice_statically_keeps_keras_own():
    kept = lambda *args, **kwargs: "kept"       # noqa: E731
    assert keras_ops.split_as_slices(kept, tf.zeros((6, 5)), 2, axis=1) == "kept"        # 5 does not divide
    assert keras_ops.split_as_slices(kept, tf.zeros((6, 4)), tf.constant([1]), axis=0) == "kept"


_EXPERT_SPLIT = """
import sys
from tofu_tf.tf import devices
devices.configure_virtual_cpus(8)
import numpy as np
import keras
import tensorflow as tf
from tensorflow.experimental import dtensor
from tofu_tf.tf.compat import keras_ops
mesh = dtensor.create_mesh([("batch", 2), ("model", 4)], devices=[f"CPU:{i}" for i in range(8)])
U = dtensor.UNSHARDED
rng = np.random.default_rng(0)
h, kernel = tf.constant(rng.normal(size=(16, 8)).astype("float32")), tf.constant(rng.normal(size=(4, 8, 16)).astype("float32"))


def experts(h, kernel):
    # keras-hub Qwen-MoE's expert bank: gate and up projections of every expert in one einsum, then split
    gate, up = keras.ops.split(keras.ops.einsum("th,ehm->etm", h, kernel), 2, axis=-1)
    return up * keras.ops.silu(gate)


want = experts(h, kernel).numpy()
args = [dtensor.copy_to_mesh(h, dtensor.Layout.replicated(mesh, 2)),
        dtensor.relayout(dtensor.copy_to_mesh(kernel, dtensor.Layout.replicated(mesh, 3)),
                         dtensor.Layout([U, U, "model"], mesh))]          # the kernel split on its last axis
try:
    if sys.argv[1] == "rewritten":
        with keras_ops.dtensor_expandable_ops():
            step = tf.function(experts)
            got = step(*args)
    else:
        got = tf.function(experts)(*args)
except tf.errors.UnknownError as error:
    print("REFUSED", [line for line in str(error).splitlines() if "error:" in line][:1])
    raise SystemExit(0)
got = dtensor.relayout(got, dtensor.Layout.replicated(mesh, 3))
print("RAN", np.abs(dtensor.unpack(got)[0].numpy() - want).max())
"""


@pytest.mark.parametrize("how", ["keras", "rewritten"])
def test_an_expert_split_after_a_split_kernel_runs_rewritten(how):
    """DTensor's Split expander refuses an input split along its axis, which propagation gives it from
    an einsum whose kernel is split on that axis (Qwen-MoE's experts); as slices it runs as on one
    device. In a fresh Python."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _EXPERT_SPLIT, how], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": root, "TF_CPP_MIN_LOG_LEVEL": "2"})
    tail = f"rc={out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    if how == "keras":      # when a TF upgrade fixes the expander, this fails: the rewrite can go
        assert "REFUSED" in out.stdout and "Spliting over sharded dimension" in out.stdout, tail
    else:
        assert out.returncode == 0 and "RAN" in out.stdout, tail
        assert float(out.stdout.split("RAN")[1]) < 1e-5, tail
