"""tf-keras's own ways of feeding ``fit``/``evaluate``/``predict``, under TofuStrategy as on one device.

From tf-keras's ``dataset_creator_model_fit_test.py`` (keras-team/tf-keras), whose cases passed
under MirroredStrategy and failed under TofuStrategy:

- a ``tf.keras.utils.experimental.DatasetCreator``: tf-keras distributes its dataset with
  ``distribute_datasets_from_function`` and then once more, as any dataset that is not one of
  TF's distributed types (before: ``'DistributedBatches' object has no attribute 'options'``);
- ``predict`` with ``steps_per_execution`` above one: tf-keras's predict function returns the
  outputs of every step it runs, concatenated; TofuStrategy's returned the last step's only
  (before: a third of the predictions, silently; the test's ``IndexError``);
- a ``binary_crossentropy`` model with one sigmoid output, ``(b, 1)``, and labels ``(b,)``:
  ``compile`` wraps the loss function so that it expands the labels to the predictions' rank;
  the step TofuStrategy captured for planning called the bare function (before: a shape error,
  ``logits and labels must have the same shape``).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tofu_tf.strategies import TofuStrategy

pytestmark = pytest.mark.slow   # fit/evaluate/predict end to end under TofuStrategy

_BATCH = 16


def _data(label_shape):
    rng = np.random.default_rng(0)
    return rng.random((64, 10)).astype("float32"), rng.random((64,) + label_shape).astype("float32")


def _model(strategy, *, activation=None, loss="mse"):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1, activation=activation)])
        model.compile(keras.optimizers.legacy.SGD(0.1), loss=loss)
    return model


def test_a_dataset_creator_fits_evaluates_and_predicts_as_one_device():
    x, y = _data((1,))

    def dataset(context=None):
        del context
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(_BATCH)

    strategy = TofuStrategy(8)
    model = _model(strategy)
    reference = _model(tf.distribute.get_strategy())
    reference.set_weights(model.get_weights())
    creator = keras.utils.experimental.DatasetCreator(dataset)
    history = model.fit(creator, epochs=2, steps_per_epoch=4, verbose=0).history["loss"]
    want = reference.fit(dataset(), epochs=2, steps_per_epoch=4, verbose=0).history["loss"]
    np.testing.assert_allclose(history, want, rtol=1e-5)
    np.testing.assert_allclose(model.evaluate(creator, steps=4, verbose=0),
                               reference.evaluate(dataset(), steps=4, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(creator, steps=4, verbose=0),
                               reference.predict(dataset(), steps=4, verbose=0), rtol=1e-5, atol=1e-6)
    assert strategy.plan is not None


def test_binary_crossentropy_with_labels_of_one_rank_less_than_the_outputs_trains_as_one_device():
    x, y = _data(())
    y = (y > 0.5).astype("float32")                     # labels (b,), outputs (b, 1)
    strategy = TofuStrategy(8)
    model = _model(strategy, activation="sigmoid", loss="binary_crossentropy")
    reference = _model(tf.distribute.get_strategy(), activation="sigmoid", loss="binary_crossentropy")
    reference.set_weights(model.get_weights())
    history = model.fit(x, y, batch_size=_BATCH, epochs=2, verbose=0, shuffle=False).history["loss"]
    want = reference.fit(x, y, batch_size=_BATCH, epochs=2, verbose=0, shuffle=False).history["loss"]
    assert strategy.plan is not None
    np.testing.assert_allclose(history, want, rtol=1e-5)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_predict_with_several_steps_per_execution_returns_every_steps_predictions():
    x, _ = _data((1,))
    strategy = TofuStrategy(8)
    model = _model(strategy)
    model.compile(keras.optimizers.legacy.SGD(0.1), loss="mse", steps_per_execution=3)
    reference = _model(tf.distribute.get_strategy())
    reference.set_weights(model.get_weights())
    got = model.predict(x, batch_size=_BATCH, verbose=0)          # 4 batches: one execution of 3, one of 1
    assert got.shape == (64, 1)
    np.testing.assert_allclose(got, reference.predict(x, batch_size=_BATCH, verbose=0), rtol=1e-5, atol=1e-6)
