"""Models whose class writes its own ``train_step`` train under TofuStrategy as on one device.

keras.io's "Customizing what happens in fit()" GAN (a ``keras.Model`` with no ``call``, two
sub-models, two optimizers, ``Mean`` metrics of its own), a VAE-style step (encoder and decoder,
KL + reconstruction loss computed in ``train_step``) and tf-keras's custom ``train_step`` (the
GAN too). Before, planning called the model (``NotImplementedError: ... GAN.call()``) and traced
a compiled loss the model never uses.

Each run is compared with the same class built outside the strategy from the same initial
weights, after 3 steps of SGD with momentum (each optimizer's slots written then read in a step):
weights to 1e-6, metrics to 1e-5. The GAN's latent vectors and label noise are random: Keras 3's
``keras.random.normal(seed=self.seed_generator)`` and tf-keras's ``tf.random.stateless_normal``
draw with TensorFlow's stateless ops, which TofuStrategy draws replicated inside a step
(``tofu_tf.tf.compat.random_draws``): the same numbers one device draws from the same seed, so the
comparison is exact. The plans split the kernels (a hand plan on a 2 x 4 mesh, batch split, and
the planner under a memory budget).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests import strategy_helpers as h
from tofu_tf.strategies import TofuStrategy
from tofu_tf.strategies import custom_steps, pipelined

pytestmark = pytest.mark.slow   # trains models under TofuStrategy end to end

LATENT = 16
FEATURES = 32
BATCH = 16
STEPS = 3
# Megatron-style: each sub-model's first kernel split by columns, its second by rows.
GAN_LAYOUTS = {"d_hidden/kernel": (None, "model"), "d_hidden/bias": ("model",), "d_out/kernel": ("model", None),
               "g_hidden/kernel": (None, "model"), "g_hidden/bias": ("model",), "g_out/kernel": ("model", None)}


def _hand_plan(layouts):
    return h.HandPlan({"batch": 2, "model": 4}, layouts, {"x": ("batch",)})


def _images(n=BATCH * STEPS, seed=0):
    return np.random.default_rng(seed).normal(size=(n, FEATURES)).astype("float32")


class Keras3GAN(keras.Model):
    """keras.io's GAN (TensorFlow backend version), as written there."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


class TfKerasGAN(tf_keras.Model):
    """keras.io's GAN in tf-keras, its latents drawn statelessly, seeded by the step count
    (``stateful=True``: ``tf.random.normal``, as the older tf.keras version of the guide wrote it)."""

    def __init__(self, discriminator, generator, latent_dim, stateful=False):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.stateful = stateful
        self.d_loss_tracker = tf_keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = tf_keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def _latents(self, batch_size, salt):
        if self.stateful:
            return tf.random.normal(shape=(batch_size, self.latent_dim))
        seed = tf.stack([tf.cast(self.d_optimizer.iterations, tf.int32), tf.constant(salt)])
        return tf.random.stateless_normal((batch_size, self.latent_dim), seed=seed)

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        generated_images = self.generator(self._latents(batch_size, 0))
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(self._latents(batch_size, 1)))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def _gan(framework, width=64, stateful=False):
    k = keras if framework == "keras3" else tf_keras
    k.utils.set_random_seed(3)
    discriminator = k.Sequential([k.Input((FEATURES,)), k.layers.Dense(width, activation="relu", name="d_hidden"),
                                  k.layers.Dense(1, name="d_out")], name="discriminator")
    generator = k.Sequential([k.Input((LATENT,)), k.layers.Dense(width, activation="relu", name="g_hidden"),
                              k.layers.Dense(FEATURES, name="g_out")], name="generator")
    if framework == "keras3":
        gan = Keras3GAN(discriminator, generator, LATENT)
    else:
        gan = TfKerasGAN(discriminator, generator, LATENT, stateful=stateful)
    gan.compile(d_optimizer=k.optimizers.SGD(0.05, momentum=0.9), g_optimizer=k.optimizers.SGD(0.05, momentum=0.9),
                loss_fn=k.losses.BinaryCrossentropy(from_logits=True))
    return gan


def _path(weight) -> str:
    """A weight's path: Keras 3's ``path``, tf-keras's variable name."""
    return getattr(weight, "path", None) or weight.name.split(":")[0]


def _specs(weight):
    variable = weight.value if isinstance(weight, keras.Variable) else weight   # Keras 3 wraps a tf.Variable
    return tuple(variable.layout.sharding_specs)


def _compare(model, reference, history, expected_history):
    for name, values in expected_history.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)
    for got, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(np.asarray(got.numpy()), np.asarray(want.numpy()), atol=1e-6,
                                   err_msg=_path(got))


def _train_both(build, x, *, plan=None, **strategy_options):
    """``build()`` trained on one device and under TofuStrategy from the same initial weights."""
    reference = build()
    initial = [np.asarray(w.numpy()) for w in reference.weights]
    expected = reference.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    strategy = TofuStrategy(8, plan=plan, **strategy_options)
    with strategy.scope():
        model = build()
    model.set_weights(initial)
    history = model.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    return strategy, model, reference, history, expected


@pytest.mark.parametrize("framework", ["keras3", "tf_keras"])
def test_keras_io_gan_trains_as_one_device_with_its_kernels_split(framework):
    strategy, model, reference, history, expected = _train_both(lambda: _gan(framework), _images(),
                                                                plan=_hand_plan(GAN_LAYOUTS))
    _compare(model, reference, history, expected)
    split = {_path(w).split("/")[-2] for w in model.discriminator.weights + model.generator.weights
             if "model" in _specs(w)}
    assert split == {"d_hidden", "d_out", "g_hidden", "g_out"}


def test_the_planner_plans_a_gans_train_step_with_both_optimizers_under_a_memory_budget():
    """Planned from the GAN's own train_step (no plan given): the captured step holds both
    sub-models' gradients and both optimizers' updates, and under a budget the plan splits them."""
    strategy, model, reference, history, expected = _train_both(
        lambda: _gan("keras3", width=256), _images(), mesh_shape={"model": 8}, memory_budget_bytes=100_000)
    _compare(model, reference, history, expected)
    layouts = strategy.plan.variable_layouts
    assert any("model" in spec for path, spec in layouts.items() if path.startswith("discriminator/"))
    assert any("model" in spec for path, spec in layouts.items() if path.startswith("generator/"))
    # Each optimizer made its momentum slots in its own sub-model's weights' layouts, as planned.
    for optimizer, sub_model in ((model.d_optimizer, model.discriminator), (model.g_optimizer, model.generator)):
        kernel = sub_model.weights[0]
        slots = [v for v in optimizer.variables if tuple(v.shape) == tuple(kernel.shape)]
        assert len(slots) == 1 and _specs(slots[0]) == _specs(kernel) == ("unsharded", "model")
    assert "train_step_model_built" in [applied.change.name for applied in strategy.changes]


class Sampling(keras.layers.Layer):
    """keras.io's VAE sampling layer: z = mean + exp(log_var / 2) * epsilon."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=tf.shape(z_mean), seed=self.seed_generator)
        return z_mean + tf.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    """keras.io's VAE step on dense sub-models: KL and reconstruction losses in train_step."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        if isinstance(data, tuple):
            data = data[0]
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = keras.ops.mean(keras.ops.sum(keras.ops.square(data - reconstruction), axis=1))
            kl_loss = -0.5 * (1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var))
            kl_loss = keras.ops.mean(keras.ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {m.name: m.result() for m in self.metrics}


def _vae():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(64, activation="relu", name="enc_hidden")(inputs)
    z_mean = keras.layers.Dense(8, name="z_mean")(hidden)
    z_log_var = keras.layers.Dense(8, name="z_log_var")(hidden)
    encoder = keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])], name="encoder")
    latent = keras.Input((8,))
    decoder = keras.Model(latent, keras.layers.Dense(FEATURES, name="dec_out")(
        keras.layers.Dense(64, activation="relu", name="dec_hidden")(latent)), name="decoder")
    vae = VAE(encoder, decoder)
    vae.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    return vae


def test_a_vae_step_with_its_own_kl_and_reconstruction_loss_trains_as_one_device():
    layouts = {"enc_hidden/kernel": (None, "model"), "enc_hidden/bias": ("model",), "z_mean/kernel": ("model", None),
               "dec_hidden/kernel": (None, "model"), "dec_hidden/bias": ("model",), "dec_out/kernel": ("model", None)}
    strategy, model, reference, history, expected = _train_both(_vae, _images(seed=1), plan=_hand_plan(layouts))
    assert set(history) == {"total_loss", "reconstruction_loss", "kl_loss"}
    _compare(model, reference, history, expected)
    assert _specs(model.encoder.get_layer("enc_hidden").kernel) == ("unsharded", "model")


class TfKerasCustomModel(tf_keras.Model):
    """tf-keras's "Customizing what happens in fit()" first example: its own tape, the compiled
    loss and metrics, the compiled optimizer."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compiled_loss(y, y_pred, regularization_losses=self.losses)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.compiled_metrics.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def test_a_tf_keras_custom_train_step_trains_as_one_device():
    def build():
        tf_keras.utils.set_random_seed(9)
        inputs = tf_keras.Input((FEATURES,))
        hidden = tf_keras.layers.Dense(64, activation="relu", name="hidden")(inputs)
        model = TfKerasCustomModel(inputs, tf_keras.layers.Dense(4, name="out")(hidden))
        model.compile(optimizer=tf_keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"])
        return model

    x = _images(seed=2)
    y = np.random.default_rng(3).normal(size=(len(x), 4)).astype("float32")
    reference = build()
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    strategy = TofuStrategy(8, plan=_hand_plan({"hidden/kernel": (None, "model"), "hidden/bias": ("model",),
                                                "out/kernel": ("model", None)}))
    with strategy.scope():
        model = build()
    model.set_weights(initial)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    _compare(model, reference, history, expected)
    assert _specs(model.get_layer("hidden").kernel) == ("unsharded", "model")


def test_a_stateful_random_draw_in_a_custom_step_is_refused_before_it_runs_naming_the_stateless_one():
    strategy = TofuStrategy(8, mesh_shape={"model": 8})
    with strategy.scope():
        gan = _gan("tf_keras", stateful=True)
    with pytest.raises(custom_steps.UnsupportedStepError,
                       match=r"(?s)train_step draws .* stateful .*tf\.random\.normal.*tf\.random\.stateless_normal"):
        gan.fit(_images(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def test_a_pipelined_strategy_refuses_a_model_that_writes_its_own_train_step():
    strategy = TofuStrategy(8, pipeline=2)
    with strategy.scope():
        gan = _gan("keras3")
    with pytest.raises(pipelined.PipelineError, match=r"own train_step.*drop pipeline="):
        gan.fit(_images(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def test_plan_model_plans_a_gan_from_its_train_step_on_a_batch_and_refuses_one_without_it():
    strategy = TofuStrategy(8, mesh_shape={"model": 8}, memory_budget_bytes=100_000)
    with strategy.scope():
        gan = _gan("keras3", width=256)
    with pytest.raises(TypeError, match=r"no call and writes its own train_step.*features="):
        strategy.plan_model(gan, batch_size=BATCH)
    plan = strategy.plan_model(gan, batch_size=BATCH, features=_images(BATCH))
    assert plan is not None and any("model" in spec for spec in plan.variable_layouts.values())
    gan.fit(_images(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
