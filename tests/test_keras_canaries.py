"""Canaries for what TofuStrategy reads from Keras' own frames, per installed Keras version.

Keras distributes a dataset (``strategy.experimental_distribute_dataset``) before it builds
its step function, and hands the strategy nothing else: the strategy finds the model that
is training in the frames of Keras' own fit/evaluate/predict (``keras_hooks.
find_model_in_stack``: a local ``model`` or ``self`` of a ``tf_keras.``/``keras.`` module).
That is the one place the strategy reads Python frames, because no explicit hand-off exists.
A Keras release that renames those locals or moves the call would make the strategy plan
later, from the first ``run``; these tests fail first, naming the version and the place.
"""

import keras as keras3
import numpy as np
import pytest
import tf_keras

from tofu_tf.strategies import TofuStrategy, keras_hooks

pytestmark = pytest.mark.slow   # trains under TofuStrategy

FRAMEWORKS = {"tf_keras": tf_keras, "keras3": keras3}


@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_the_training_model_is_found_in_keras_own_frames(framework, call, monkeypatch):
    keras = FRAMEWORKS[framework]
    found = []
    original = keras_hooks.find_model_in_stack

    def spy(max_frames: int = 12):
        model = original(max_frames + 1)       # this wrapper adds one frame
        found.append(model)
        return model
    monkeypatch.setattr(keras_hooks, "find_model_in_stack", spy)
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(16, 16)).astype("float32")
    y = np.zeros((16,), "int32")
    if call == "fit":
        model.fit(x, y, batch_size=8, verbose=0)
    elif call == "evaluate":
        model.evaluate(x, y, batch_size=8, verbose=0)
    else:
        model.predict(x, batch_size=8, verbose=0)
    assert found and found[0] is model, (
        f"{keras.__name__} {keras.__version__}: keras_hooks.find_model_in_stack no longer finds the model "
        f"in {call}'s frames (found {found[:1]}): Keras changed where it distributes the dataset or what it "
        "names the model there; update _KERAS_MODULES or the local names it reads")
