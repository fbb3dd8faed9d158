"""Summaries of weights on the mesh are written as one device writes them
(tofu_tf.tf.compat.summaries): TensorBoard's callback with histograms, and tf.summary called
on a split weight."""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from tests import strategy_helpers as h
from tofu_tf import TofuStrategy
from tofu_tf.tf import keras_adapter

pytest.importorskip("tensorboard")

FLAVORS = ("tf_keras", "keras3")


def _keras(flavor):
    return pytest.importorskip("tf_keras" if flavor == "tf_keras" else "keras")


def _split_plan(flavor):
    prefix = "" if flavor == "tf_keras" else "net/"
    return h.HandPlan(mesh_shape={"batch": 2, "model": 4},
                      variable_layouts={prefix + "d1/kernel": (None, "model"), prefix + "d2/kernel": ("model", None)},
                      input_layouts={"x": ("batch",)})


def _model(keras):
    keras.utils.set_random_seed(2)
    return keras.Sequential([keras.Input((16,), name="x"), keras.layers.Dense(64, name="d1"),
                             keras.layers.Dense(8, name="d2")], name="net")


def _strategy_model(flavor):
    keras = _keras(flavor)
    strategy = TofuStrategy(num_gpus=8, plan=_split_plan(flavor))
    with strategy.scope():
        model = _model(keras)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return strategy, model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 16)).astype("float32"), rng.normal(size=(16, 8)).astype("float32")


def _summaries(directory) -> dict:
    """tag -> (step -> tensor) of every summary in the event files under ``directory``."""
    found: dict = {}
    for path in glob.glob(os.path.join(directory, "**", "events.out.tfevents.*"), recursive=True):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.HasField("tensor"):
                    found.setdefault(value.tag, {})[event.step] = tf.make_ndarray(value.tensor)
    return found


def _one_device_summaries(directory, write) -> dict:
    """What ``write()`` writes on one device (host values, no strategy involved)."""
    writer = tf.summary.create_file_writer(directory)
    with writer.as_default():
        write()
    writer.close()
    return _summaries(directory)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_tensorboard_histograms_of_split_weights_are_one_devices(flavor, tmp_path):
    keras = _keras(flavor)
    strategy, model = _strategy_model(flavor)
    x, y = _data()
    callback = keras.callbacks.TensorBoard(str(tmp_path / "run"), histogram_freq=1, write_images=True)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    assert len(history.history["loss"]) == 2
    kernel = model.get_layer("d1").kernel
    assert not keras_adapter.backing_variable(kernel).layout.is_fully_replicated()

    written = _summaries(str(tmp_path / "run"))
    tags = [tag for tag in written if "d1" in tag and "kernel" in tag and "image" not in tag]
    assert len(tags) == 1, sorted(written)
    tag = tags[0]
    assert sorted(written[tag]) == [0, 1]
    values = kernel.numpy()                    # the weights the last epoch's histogram was taken of
    want = _one_device_summaries(str(tmp_path / "one"), lambda: tf.summary.histogram(tag, values, step=1))
    np.testing.assert_array_equal(written[tag][1], want[tag][1])
    assert any("d1" in t and "image" in t for t in written), sorted(written)


def test_tf_summary_of_a_split_weight_is_one_devices(tmp_path):
    strategy, model = _strategy_model("keras3")
    model.fit(*_data(), batch_size=8, epochs=1, verbose=0)
    kernel = model.get_layer("d1").kernel
    assert not keras_adapter.backing_variable(kernel).layout.is_fully_replicated()

    def write(weight):
        tf.summary.histogram("kernel", weight, step=0)
        tf.summary.scalar("kernel_mean", tf.reduce_mean(weight), step=0)
        tf.summary.image("kernel_image", tf.reshape(weight, (1, 16, 64, 1)), step=0)
        tf.summary.write("kernel_raw", weight, step=0)

    written = _one_device_summaries(str(tmp_path / "mesh"), lambda: write(kernel))
    want = _one_device_summaries(str(tmp_path / "one"), lambda: write(tf.constant(kernel.numpy())))
    assert sorted(written) == sorted(want) == ["kernel", "kernel_image", "kernel_mean", "kernel_raw"]
    for tag in want:            # equal: the same values on the host (an image's PNG bytes included)
        np.testing.assert_array_equal(written[tag][0], want[tag][0])
