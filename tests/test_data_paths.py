"""Every batch the user's data makes trains, evaluates and predicts as on one device.

tf.data pipelines as users write them (``.batch(b)`` without ``drop_remainder``,
unknown cardinality after ``.filter``) and numpy arrays whose length the batch
size does not divide: the partial last batch is part of the epoch. Before,
``fit`` trained the epoch and then failed, or (unknown cardinality) dropped the
partial batch silently every epoch; evaluate and predict refused it.

The plan is the hand-written 2x4 one (batch split over ``batch``, the MLP's
kernels over ``model``): a batch of 12 or 4 splits over the batch axis, a batch
of 5 or 3 does not and runs replicated, so both placements are exercised.
"""

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests import strategy_helpers as h
from tofu_tf import models
from tofu_tf.strategies import TofuStrategy

pytestmark = pytest.mark.slow   # trains models under TofuStrategy end to end

FRAMEWORKS = {"tf_keras": tf_keras, "keras3": keras3}
LAYOUTS = {"dense_0/kernel": (None, "model"), "dense_0/bias": ("model",), "dense_1/kernel": ("model", None)}


def _plan(framework):
    prefix = "" if framework == "tf_keras" else "mlp/"
    layouts = {prefix + path: layout for path, layout in LAYOUTS.items()}
    return h.HandPlan(mesh_shape={"batch": 2, "model": 4}, variable_layouts=layouts, input_layouts={"x": ("batch",)})


def _build(framework):
    keras = FRAMEWORKS[framework]
    keras.utils.set_random_seed(5)
    return models.mlp(width=32, depth=2, keras=keras)


def _compile(framework, model):
    keras = FRAMEWORKS[framework]
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 16)).astype("float32"), rng.integers(0, 10, (n,)).astype("int32")


def _pair(framework):
    """A one-device model and a TofuStrategy one with the same initial weights."""
    reference = _build(framework)
    initial = reference.get_weights()
    _compile(framework, reference)
    strategy = TofuStrategy(8, plan=_plan(framework))
    with strategy.scope():
        model = _build(framework)
        _compile(framework, model)
    model.set_weights(initial)
    return reference, model


def _pipeline(x, y, batch, cardinality):
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if cardinality == "unknown":
        dataset = dataset.filter(lambda *_: True)
    return dataset.batch(batch)


def _assert_alike(model, reference, history, expected):
    for key in expected.history:
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-5, err_msg=key)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
@pytest.mark.parametrize("cardinality", ["known", "unknown"])
def test_a_batched_pipeline_with_a_partial_last_batch_trains_every_sample(framework, cardinality):
    """100 samples in batches of 12 for 2 epochs: 9 steps per epoch, the last of 4
    samples. With unknown cardinality the epoch ends when the data does."""
    reference, model = _pair(framework)
    x, y = _data(100)
    expected = reference.fit(_pipeline(x, y, 12, cardinality), epochs=2, verbose=0)
    history = model.fit(_pipeline(x, y, 12, cardinality), epochs=2, verbose=0)
    _assert_alike(model, reference, history, expected)
    assert int(model.optimizer.iterations.numpy()) == 18


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_numpy_with_partial_batches_fits_evaluates_and_predicts_as_one_device(framework):
    """21 samples at batch 8: the last batch of 5 does not split over the batch axis and
    runs replicated; validation (13 samples: a batch of 5), evaluate and predict too,
    and predict on fewer samples than one batch."""
    reference, model = _pair(framework)
    x, y = _data(21)
    x_val, y_val = _data(13, seed=1)
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, validation_data=(x_val, y_val), verbose=0)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, validation_data=(x_val, y_val), verbose=0)
    _assert_alike(model, reference, history, expected)
    np.testing.assert_allclose(model.evaluate(x_val, y_val, batch_size=8, verbose=0),
                               reference.evaluate(x_val, y_val, batch_size=8, verbose=0), rtol=1e-5)
    for count in (13, 3):
        np.testing.assert_allclose(model.predict(x[:count], batch_size=8, verbose=0),
                                   reference.predict(x[:count], batch_size=8, verbose=0), rtol=1e-5, atol=1e-6)


def test_a_new_input_signature_is_traced_once_and_logged(caplog):
    """The partial batch is a second signature of the train step: traced once, named in
    the log once, whatever the number of epochs."""
    _, model = _pair("tf_keras")
    x, y = _data(21)
    with caplog.at_level("INFO", logger="absl"):   # absl may be at WARNING once its flags were parsed
        model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    new = [r.getMessage() for r in caplog.records if "new input signature" in r.getMessage()]
    assert len(new) == 1 and "(5, 16)" in new[0], new



def test_small_replicated_inputs_reach_the_step_through_variables():
    """DTensor compiles a small replicated int/float input into the program as a constant,
    so a classifier's labels (one int per sample) compiled the whole step again at step 2
    (seconds on keras-hub's BERT and ViT classifiers). With the batch replicated, the labels
    reach the step through a variable: one program, and the step as on one device."""
    from tofu_tf.strategies import step_functions

    reference = _build("tf_keras")
    initial = reference.get_weights()
    _compile("tf_keras", reference)
    replicated = h.HandPlan(mesh_shape={"batch": 2, "model": 4}, variable_layouts={}, input_layouts={"x": (None,)})
    strategy = TofuStrategy(8, plan=replicated)
    with strategy.scope():
        model = _build("tf_keras")
        _compile("tf_keras", model)
    model.set_weights(initial)
    x, y = _data(24)
    expected = reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    _assert_alike(model, reference, history, expected)
    (program,) = model.train_function._tofu_steps.programs  # pylint: disable=protected-access
    assert program.held_inputs == 1                          # the (8,) labels; the (8, 16) features are not small
    labels = step_functions.batches_lib.BatchPlacer(strategy.mesh, None).place(y[:8])
    assert step_functions.folded_by_dtensor(labels)
