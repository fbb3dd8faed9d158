"""Shared pieces of the TofuStrategy tests: models, data and a single-device reference run."""

import dataclasses

import numpy as np
import tf_keras as keras

from tofu_tf import models
from tofu_tf.tf import keras_adapter

BATCH = 8
STEPS = 3


@dataclasses.dataclass(frozen=True)
class HandPlan:
    """A plan written by hand, for lowering tests that must not depend on the planner."""

    mesh_shape: dict
    variable_layouts: dict
    input_layouts: dict


MODELS = {
    "mlp": lambda: models.mlp(width=32, depth=2),
    "cnn_bn": lambda: models.cnn(channels=8),
    "lstm": lambda: models.rnn(cell="lstm", hidden=16, seq_len=5),
    "gru": lambda: models.rnn(cell="gru", hidden=16, seq_len=5, num_layers=1),
    # Embedding rows get a sparse gradient (ResourceScatterAdd under Adam).
    "embedding": lambda: keras.Sequential([keras.Input((4,), dtype="int32"),
                                           keras.layers.Embedding(32, 16, name="embedding"),
                                           keras.layers.Dense(32, name="head")], name="embedding_lm"),
    "transformer": lambda: models.gpt(num_layers=1, d_model=16, num_heads=4, seq_len=8, vocab_size=32),
}


def build(name: str):
    keras.utils.set_random_seed(7)
    return MODELS[name]()


def data_for(model, *, steps: int = STEPS, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = BATCH * steps
    shape = tuple(model.input_shape[1:])
    if str(getattr(model.inputs[0].dtype, "name", model.inputs[0].dtype)).startswith("int"):
        vocab = model.output_shape[-1]
        x = rng.integers(0, vocab, (n,) + shape).astype("int32")
        y = rng.integers(0, vocab, (n,) + shape).astype("int32")
    else:
        x = rng.normal(size=(n,) + shape).astype("float32")
        y = rng.integers(0, model.output_shape[-1], (n,)).astype("int32")
    return x, y


def compile_model(model, optimizer=None):
    """SGD with momentum by default: its slot is written then read in one step
    (the path DTensor reorders), and, unlike Adam, it does not magnify
    last-bit differences of tiny gradients into update-sized ones."""
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def reference_run(name: str, optimizer=None):
    """Initial weights and the weights after STEPS steps on one device."""
    model = build(name)
    initial = model.get_weights()
    compile_model(model, optimizer)
    x, y = data_for(model)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return initial, model.get_weights(), history.history["loss"], (x, y)


def assert_same_update(got, want, initial, name, *, within=0.1):
    """Half-precision steps agree with one device's up to rounding: the two updates
    differ by at most ``within`` of the update's norm. Rounding alone moves a step that
    much: on the tests' MLP one device's bfloat16 update differs from its float32 update
    by 1-7% of its norm, and a sharded reduction rounds differently again (elementwise
    tolerances do not fit: a unit whose pre-activation rounds across 0 flips its ReLU and
    its whole gradient column). A wrong step (an update lost, a gradient scaled) is off by
    the update's size."""
    update = np.linalg.norm(want - initial)
    assert update > 0, f"{name}: one device did not change it"
    assert np.linalg.norm(got - want) <= within * update, (name, np.linalg.norm(got - want), update)


def subclassed_mlp(keras_module):
    """A subclassed MLP (no symbolic inputs; weights made at its first call), wide
    enough that the plan splits weights."""
    class SubclassedMLP(keras_module.Model):
        def __init__(self):
            super().__init__(name="subclassed_mlp")
            self.hidden = [keras_module.layers.Dense(256, activation="relu", name=f"dense_{i}") for i in range(2)]
            self.head = keras_module.layers.Dense(10, name="head")

        def call(self, x):
            for layer in self.hidden:
                x = layer(x)
            return self.head(x)

    keras_module.utils.set_random_seed(7)
    return SubclassedMLP()


class InitialWeights:
    """A callback keeping the weights a fit starts from (once the strategy made them)."""

    def __init__(self, keras_module):
        outer = self
        self.weights = None

        class Keep(keras_module.callbacks.Callback):
            def on_train_begin(self, logs=None):
                outer.weights = self.model.get_weights()

        self.callback = Keep()


def train_beside_one_device(build, x, y, *, compile_fn=compile_model):
    """One epoch of ``build()`` on one device and under ``TofuStrategy(8)``, planned first,
    from the same initial weights: (model, reference, its losses, the reference's)."""
    from tofu_tf.strategies import TofuStrategy
    reference = build()
    initial = reference.get_weights()
    compile_fn(reference)
    expected = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = build()
        compile_fn(model)
    strategy.plan_model(model, batch_size=BATCH)
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    return model, reference, loss, expected


def train_from_weights_read_before_the_plan(build, weights_file, *, compile_fn=compile_model):
    """``build()`` under ``TofuStrategy(8)``, its weights read (``get_weights``, ``numpy()``)
    and saved to ``weights_file`` before the planner has run, then one epoch, in which the
    planner must shard a weight; and one device trained from the weights read, which the
    file holds too. (model, reference, its losses, the reference's)."""
    from tofu_tf.strategies import TofuStrategy
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = build()
        compile_fn(model)
    initial = model.get_weights()
    np.testing.assert_array_equal(model.weights[0].numpy(), initial[0])
    model.save_weights(weights_file)
    x, y = data_for(model)
    loss = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    layouts = [keras_adapter.tf_variable(w).layout for w in model.weights]
    assert any(not layout.is_fully_replicated() for layout in layouts), layouts
    reference = build()
    reference.load_weights(weights_file)
    for saved, read in zip(reference.get_weights(), initial):
        np.testing.assert_array_equal(saved, read)
    reference.set_weights(initial)
    compile_fn(reference)
    expected = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    return model, reference, loss, expected


def train_beside_one_device_under(plan, build, x, y, *, compile_fn=compile_model):
    """One epoch of ``build()`` on one device and under ``TofuStrategy(8, plan=plan)`` (a
    ``HandPlan``) from the same initial weights: (model, reference, its losses, the reference's)."""
    from tofu_tf.strategies import TofuStrategy
    reference = build()
    initial = reference.get_weights()
    compile_fn(reference)
    expected = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8, plan=plan)
    with strategy.scope():
        model = build()
        compile_fn(model)
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    return model, reference, loss, expected


def assert_trained_alike(model, reference, loss, expected, *, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def model_around_a_sequence_layer(keras_module, layer):
    """Dense -> ``layer`` (a layer of a (5, 4) sequence) -> Flatten -> Dense head, seeded: the
    model the recurrence tests (TensorArrays, scans) train beside one device."""
    keras_module.utils.set_random_seed(7)
    inputs = keras_module.Input((5, 4))
    x = keras_module.layers.Flatten()(layer(keras_module.layers.Dense(4, name="d1")(inputs)))
    return keras_module.Model(inputs, keras_module.layers.Dense(4, name="head")(x))


def compile_with_momentum(keras_module, model):
    """SGD with momentum and a sparse cross-entropy on logits; the model, for chaining."""
    model.compile(optimizer=keras_module.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras_module.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit_beside_one_device(build, compile_fn, x, y, *, rtol=1e-6, atol=1e-6):
    """One epoch of ``build()`` on one device and under ``TofuStrategy(8)``, planned from the
    first batch (the weights set to the reference's initial ones inside the scope); asserts the
    losses (rtol) and the weights (rtol, atol) equal. (strategy, model, reference)."""
    from tofu_tf.strategies import TofuStrategy
    reference = build()
    initial = reference.get_weights()
    compile_fn(reference)
    want = reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = build()
        model.set_weights(initial)
        compile_fn(model)
    got = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=rtol)
    for g, w in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    return strategy, model, reference
