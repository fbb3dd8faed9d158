"""SavedModel exports of TofuStrategy models serve on one device, as one device's exports do.

Each export is loaded in a fresh process with one CPU device and no DTensor mesh
(as TF Serving would load it) and its ``serving_default`` signature called; its
outputs must equal the strategy model's ``predict`` in float32.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tofu_tf import models
from tofu_tf.strategies import TofuStrategy
from tofu_tf.strategies import export as export_lib
from tofu_tf.strategies import keras_hooks

pytestmark = pytest.mark.slow   # trains, saves and serves models under TofuStrategy

BATCH = 8

# Loads a SavedModel in a process without virtual devices, calls serving_default on the
# saved batch and writes what it returns; also reports what the SavedModel holds.
_SERVE = r"""
import json, sys
import numpy as np
import tensorflow as tf
from tensorflow.python.saved_model import loader_impl

directory, batch, out = sys.argv[1:4]
graph = loader_impl.parse_saved_model(directory).meta_graphs[0]
ops = {node.op for function in graph.graph_def.library.function for node in function.node_def}
ops |= {node.op for node in graph.graph_def.node}
loaded = tf.saved_model.load(directory)
signature = loaded.signatures["serving_default"]
(name,) = signature.structured_input_signature[1]
outputs = signature(**{name: tf.constant(np.load(batch))})
(value,) = outputs.values()
np.save(out, value.numpy())
print(json.dumps({"devices": len(tf.config.list_logical_devices("CPU")),
                  "dtensor_ops": sorted(op for op in ops if "Relayout" in op or "DTensor" in op or "Mesh" in op),
                  "variables": sorted({type(v).__name__ for v in signature.variables})}))
"""


def serve(directory, x, tmp_path):
    """``serving_default(x)`` of the SavedModel at ``directory``, computed in a fresh one-device process."""
    np.save(tmp_path / "batch.npy", x)
    env = {key: value for key, value in os.environ.items() if not key.startswith("DTENSOR")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    done = subprocess.run([sys.executable, "-c", _SERVE, str(directory), str(tmp_path / "batch.npy"),
                           str(tmp_path / "served.npy")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == 1 and report["dtensor_ops"] == []
    assert set(report["variables"]) <= {"ResourceVariable", "UninitializedVariable"}, report  # as TF loads any
    return np.load(tmp_path / "served.npy")


def train_sharded(keras, *, metrics=None):
    """An MLP (width 256, depth 2) trained 2 steps under TofuStrategy(8), its plan splitting weights."""
    keras.utils.set_random_seed(3)
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = models.mlp(width=256, depth=2, keras=keras if keras is not tf_keras else None)
        model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=metrics,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * BATCH, 16)).astype("float32")
    y = rng.integers(0, 10, 2 * BATCH).astype("int32")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    split = [path for path, spec in strategy.plan.variable_layouts.items() if any(axis for axis in spec)]
    assert any(path.endswith("kernel") and "Adam" not in path for path in split), strategy.plan.variable_layouts
    return strategy, model, x


@pytest.fixture(scope="module")
def tf_keras_model():
    return train_sharded(tf_keras, metrics=["accuracy"])


def checkpoint_keys(directory):
    return sorted(name for name, _ in tf.train.list_variables(os.path.join(directory, "variables", "variables")))


def test_tf_keras_model_save_serves_on_one_device(tf_keras_model, tmp_path):
    """model.save(dir): a plain SavedModel holding the trained weights and optimizer state."""
    _, model, x = tf_keras_model
    model.save(str(tmp_path / "model"))
    np.testing.assert_allclose(serve(tmp_path / "model", x, tmp_path), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
    checkpoint = os.path.join(tmp_path, "model", "variables", "variables")
    for index, weight in enumerate(model.weights):
        key = f"layer_with_weights-{index // 2}/{'kernel' if index % 2 == 0 else 'bias'}/.ATTRIBUTES/VARIABLE_VALUE"
        np.testing.assert_array_equal(tf.train.load_variable(checkpoint, key), weight.numpy())
    for index, variable in enumerate(model.optimizer.variables[1:], start=1):       # the slots
        key = f"optimizer/_variables/{index}/.ATTRIBUTES/VARIABLE_VALUE"
        np.testing.assert_array_equal(tf.train.load_variable(checkpoint, key), variable.numpy())
    restored = tf_keras.models.load_model(str(tmp_path / "model"))
    np.testing.assert_allclose(restored.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_tf_keras_savedmodel_holds_what_one_device_saves(tf_keras_model, tmp_path):
    """The same checkpoint keys (weights, optimizer slots, metric totals) and Keras metadata
    as a one-device model of the same architecture and compile arguments saves."""
    _, model, x = tf_keras_model
    reference = models.mlp(width=256, depth=2)
    reference.compile(optimizer=tf_keras.optimizers.Adam(0.01), metrics=["accuracy"],
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(x, np.zeros(len(x), "int32"), batch_size=BATCH, verbose=0)
    model.save(str(tmp_path / "sharded"))
    reference.save(str(tmp_path / "one_device"))
    assert checkpoint_keys(tmp_path / "sharded") == checkpoint_keys(tmp_path / "one_device")

    def metadata(directory):
        from tf_keras.protobuf import saved_metadata_pb2
        proto = saved_metadata_pb2.SavedMetadata()
        proto.ParseFromString((directory / "keras_metadata.pb").read_bytes())
        nodes = [(node.node_path, node.identifier, json.loads(node.metadata)) for node in proto.nodes]
        return nodes

    def named_alike(nodes, input_name):               # the two models' inputs were named apart in this process
        return json.loads(json.dumps(nodes).replace(f'"{input_name}"', '"INPUT"'))

    assert named_alike(metadata(tmp_path / "sharded"), model.input_names[0]) == \
        named_alike(metadata(tmp_path / "one_device"), reference.input_names[0])


def test_tf_keras_tf_saved_model_save_serves_on_one_device(tf_keras_model, tmp_path):
    """tf.saved_model.save(model, dir), called directly, and inside the strategy's scope."""
    strategy, model, x = tf_keras_model
    tf.saved_model.save(model, str(tmp_path / "direct"))
    np.testing.assert_allclose(serve(tmp_path / "direct", x, tmp_path), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
    with strategy.scope():
        model.save(str(tmp_path / "in_scope"))
    assert checkpoint_keys(tmp_path / "in_scope") == checkpoint_keys(tmp_path / "direct")


def test_a_signature_traced_on_the_mesh_serves_on_one_device(tmp_path):
    """tf-keras's mirrored_strategy_test saves a serving signature it traced itself: a tf.function
    that maps strings through a lookup layer attached to the model, then calls the model. Traced
    on the strategy's model it captures the mesh's variables; before, the save failed with TF's
    AssertionError about an 'untracked' resource. Where the traced graph holds no op of the mesh
    (a data-parallel plan), the signature is called from a function of the one-device copy with
    the copy's variables, the lookup attached to the copy: it serves as the model computes."""
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((3,), dtype="int64"), tf_keras.layers.Embedding(5, 4),
                                     tf_keras.layers.Flatten(), tf_keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    model.fit(np.ones((8, 3), "int64"), np.zeros((8, 2), "float32"), batch_size=8, verbose=0)
    model.lookup = tf_keras.layers.StringLookup(vocabulary=["a", "b", "c"])

    @tf.function(input_signature=[tf.TensorSpec((None, 3), tf.string, name="words")])
    def serve_fn(words):
        return {"scores": model(model.lookup(words))}
    words = tf.constant([["a", "c", "zz"], ["b", "b", "a"]])
    want = model.predict(model.lookup(words).numpy(), verbose=0)
    model.save(str(tmp_path / "model"), signatures=serve_fn.get_concrete_function())
    served = tf.saved_model.load(str(tmp_path / "model")).signatures["serving_default"](words=words)
    np.testing.assert_allclose(served["scores"].numpy(), want, rtol=1e-6, atol=1e-7)


def test_a_signature_that_relays_out_is_refused_naming_the_copy_that_serves(tf_keras_model, tmp_path):
    """A signature traced on a sharded plan's model holds DTensor's relayouts, which no one-device
    runtime runs: refused naming the signature and one_device_copy; that way serves on one device."""
    _, model, x = tf_keras_model

    def signature_of(net):
        @tf.function(input_signature=[tf.TensorSpec((None, 16), tf.float32, name="features")])
        def serve_fn(features):
            return {"logits": net(features)}
        return serve_fn.get_concrete_function()

    with pytest.raises(export_lib.DTensorExportError, match=r"signature 'serving_default' was traced on .*"
                                                            r"relays out.*tofu_tf.one_device_copy\(model\)"):
        model.save(str(tmp_path / "refused"), signatures=signature_of(model))
    copy = export_lib.one_device_copy(model)
    copy.save(str(tmp_path / "copy"), signatures=signature_of(copy))
    np.testing.assert_allclose(serve(tmp_path / "copy", x, tmp_path), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_tf_keras_save_without_optimizer(tf_keras_model, tmp_path):
    """include_optimizer=False, through model.save and through keras.models.save_model
    (which reaches the model's SavedModel children, not its save method)."""
    _, model, x = tf_keras_model
    model.save(str(tmp_path / "method"), include_optimizer=False)
    tf_keras.models.save_model(model, str(tmp_path / "function"), include_optimizer=False)
    keys = checkpoint_keys(tmp_path / "method")
    assert keys == checkpoint_keys(tmp_path / "function")
    assert not [key for key in keys if key.startswith("optimizer")] and any("metrics" in key for key in keys)
    assert model.optimizer is not None
    np.testing.assert_allclose(serve(tmp_path / "function", x, tmp_path), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_keras3_export_serves_on_one_device(tmp_path):
    """Keras 3 model.export(dir) (format tf_saved_model), and tf.saved_model.save."""
    import keras
    _, model, x = train_sharded(keras)
    model.export(str(tmp_path / "export"), verbose=False)
    np.testing.assert_allclose(serve(tmp_path / "export", x, tmp_path), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
    tf.saved_model.save(model, str(tmp_path / "saved"))
    np.testing.assert_allclose(serve(tmp_path / "saved", x, tmp_path), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)

    archive = keras.export.ExportArchive()       # traced on the mesh: refused, with the way out
    archive.track(model)
    archive.add_endpoint("serve", model.__call__, input_signature=[tf.TensorSpec((None, 16), tf.float32)])
    with pytest.raises(export_lib.DTensorExportError, match="one_device_copy"):
        archive.write_out(str(tmp_path / "archive"))
    copy = export_lib.one_device_copy(model)
    assert not any(isinstance(variable.value, tf.experimental.dtensor.DVariable) for variable in copy.weights)
    np.testing.assert_allclose(copy.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_unrolled_rnn_config_says_what_the_user_built():
    """The strategy unrolls an LSTM for DTensor; its config (what saves and the export copy
    rebuild from) keeps the user's unroll=False."""
    model = tf_keras.Sequential([tf_keras.Input((5, 4)), tf_keras.layers.LSTM(8, name="lstm")])
    changes = keras_hooks.prepare_for_dtensor(model)
    assert model.layers[0].unroll is True and model.layers[0].get_config()["unroll"] is False
    assert [applied.change.name for applied in changes] == ["rnn_unrolled", "new_axis_slices_spelled_out",
                                                         "savedmodel_from_copy"]


@pytest.mark.parametrize("framework", ["tf_keras", "keras"])
def test_subclassed_model_exports_from_its_config(framework, tmp_path):
    """A subclassed model is rebuilt from get_config() and called on its first call's inputs."""
    keras = tf_keras if framework == "tf_keras" else __import__("keras")

    class Net(keras.Model):
        def __init__(self, width=256, **kwargs):
            super().__init__(**kwargs)
            self.width = width
            self.hidden = keras.layers.Dense(width, activation="relu")
            self.head = keras.layers.Dense(10)

        def call(self, inputs):
            return self.head(self.hidden(inputs))

        def get_config(self):
            return {"width": self.width, "name": self.name}

    keras.utils.set_random_seed(5)
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = Net()
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(2 * BATCH, 16)).astype("float32")
    model.fit(x, np.arange(2 * BATCH) % 10, batch_size=BATCH, verbose=0)
    if framework == "tf_keras":
        model.save(str(tmp_path / "model"))
    else:
        model.export(str(tmp_path / "model"), verbose=False)
    np.testing.assert_allclose(serve(tmp_path / "model", x, tmp_path), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
