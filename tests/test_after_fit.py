"""What users do around ``fit`` keeps working under TofuStrategy, as on one device.

Issue #35 measured these workflows working on a small keras-hub model and Keras 3 models;
none had a test. Each trains under ``TofuStrategy(num_gpus=8, mesh_shape={"batch": 2,
"model": 4})`` (the plan splits weights over "model") and compares with the same model built
outside the strategy from the same initial weights:

* LoRA (``backbone.enable_lora``) with AdamW excluding biases and norms from weight decay;
* ``save_to_preset`` under the strategy then ``from_preset`` outside it, and back into a scope;
* gradient accumulation, EMA with ``clipnorm``, ``jit_compile=True``, ``steps_per_execution``;
* ``BackupAndRestore`` resuming a preempted ``fit``; ``EarlyStopping(restore_best_weights=True)``;
* a frozen backbone under a trainable head.

Tolerances: SGD runs are compared at rtol 1e-5 / atol 1e-6 (a sharded reduction rounds
differently from one device's, about 1e-7 relative, and SGD carries that along at its size).
The AdamW run divides each update by the root of its second moment, which turns that rounding
on near-zero gradients (LoRA's B starts at zero, so A's first gradient is exactly zero) into
steps of the learning rate: it is compared at 1e-3 absolute with a learning rate of 1e-3.
"""

import os

import keras
import numpy as np
import pytest

from tests import strategy_helpers as h
from tofu_tf.strategies import TofuStrategy

pytestmark = pytest.mark.slow   # trains models under TofuStrategy end to end

MESH = {"batch": 2, "model": 4}
BATCH, WIDTH, CLASSES = 8, 32, 4


def _mlp():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((16,), name="x"), keras.layers.Dense(WIDTH, activation="relu", name="hidden_0"),
                             keras.layers.Dense(WIDTH, activation="relu", name="hidden_1"),
                             keras.layers.Dense(CLASSES, name="logits")])


# Megatron-style: the first kernel split by columns, the second by rows (the MLP is too small for
# the planner to split anything on its own).
MLP_PLAN = h.HandPlan(MESH, {"hidden_0/kernel": (None, "model"), "hidden_0/bias": ("model",),
                             "hidden_1/kernel": ("model", None)}, {"x": ("batch",)})


def _data(samples=32, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(samples, 16).astype("float32"), rng.randint(0, CLASSES, samples)


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _strategy(build):
    return TofuStrategy(num_gpus=8, plan=MLP_PLAN) if build is _mlp else TofuStrategy(num_gpus=8, mesh_shape=MESH)


def _both(build, compile_fn):
    """The model under TofuStrategy and its one-device twin, from the same initial weights."""
    strategy = _strategy(build)
    with strategy.scope():
        sharded = build()
        compile_fn(sharded)
    single = build()
    compile_fn(single)
    single.set_weights(sharded.get_weights())
    return strategy, sharded, single


def _assert_same_weights(sharded, single, rtol=1e-5, atol=1e-6):
    for got, want in zip(sharded.weights, single.weights):
        np.testing.assert_allclose(np.asarray(got.numpy()), np.asarray(want.numpy()), rtol=rtol, atol=atol,
                                   err_msg=got.path)


def _assert_something_split(strategy):
    assert any(any(spec) for spec in strategy.plan.variable_layouts.values()), "the plan should split weights"


@pytest.mark.parametrize("optimizer", [
    pytest.param(lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), id="gradient_accumulation"),
    pytest.param(lambda: keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3,
                                              clipnorm=0.5), id="ema_clipnorm"),
])
def test_optimizer_options_train_as_one_device(optimizer):
    x, y = _data()
    strategy, sharded, single = _both(_mlp, lambda m: m.compile(optimizer=optimizer(), loss=_loss()))
    for model in (sharded, single):
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    _assert_something_split(strategy)
    _assert_same_weights(sharded, single)
    assert int(sharded.optimizer.iterations.numpy()) == int(single.optimizer.iterations.numpy())


@pytest.mark.parametrize("options", [{"jit_compile": True}, {"steps_per_execution": 2}], ids=lambda o: next(iter(o)))
def test_compile_options_train_as_one_device(options):
    x, y = _data()
    strategy, sharded, single = _both(
        _mlp, lambda m: m.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=_loss(), **options))
    history = [m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history["loss"]
               for m in (sharded, single)]
    np.testing.assert_allclose(history[0], history[1], rtol=1e-5)
    _assert_something_split(strategy)
    _assert_same_weights(sharded, single)


class _Preempted(Exception):
    pass


class _PreemptAt(keras.callbacks.Callback):
    """Raises at the start of ``epoch`` once, as a preempted job stops."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch, self.fired = epoch, False

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch and not self.fired:
            self.fired = True
            raise _Preempted()


def test_backup_and_restore_resumes_a_preempted_fit_as_one_device(tmp_path):
    x, y = _data()
    compile_fn = lambda m: m.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=_loss())  # noqa: E731
    strategy, sharded, single = _both(_mlp, compile_fn)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    preempt = _PreemptAt(2)
    with pytest.raises(_Preempted):
        sharded.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[backup, preempt])
    # The job restarts: a new process would build the model again under a new strategy and fit again.
    restarted_strategy = _strategy(_mlp)
    with restarted_strategy.scope():
        restarted = _mlp()
        compile_fn(restarted)
    history = restarted.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[backup])
    assert len(history.history["loss"]) == 2, "the restarted fit should run only the epochs left"
    single.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    _assert_something_split(restarted_strategy)
    _assert_same_weights(restarted, single)


def test_early_stopping_restores_the_best_weights_as_one_device():
    x, y = _data()
    xv, yv = _data(16, seed=3)
    strategy, sharded, single = _both(
        _mlp, lambda m: m.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9), loss=_loss()))
    epochs = []
    for model in (sharded, single):
        stop = keras.callbacks.EarlyStopping(patience=1, restore_best_weights=True)
        history = model.fit(x, y, validation_data=(xv, yv), batch_size=BATCH, epochs=12, shuffle=False, verbose=0,
                            callbacks=[stop])
        epochs.append(len(history.history["loss"]))
    assert epochs[0] == epochs[1]
    _assert_same_weights(sharded, single, rtol=1e-4, atol=1e-5)


# -- keras-hub --------------------------------------------------------------------------------

VOCAB, SEQ = 64, 8


def _gpt2():
    import keras_hub
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=64,
                                             intermediate_dim=128, max_sequence_length=SEQ)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _tokens(samples=16, seed=0):
    rng = np.random.RandomState(seed)
    return ({"token_ids": rng.randint(0, VOCAB, (samples, SEQ)), "padding_mask": np.ones((samples, SEQ), "int32")},
            rng.randint(0, VOCAB, (samples, SEQ)))


def test_lora_with_adamw_excluding_norms_trains_as_one_device():
    def build():
        lm = _gpt2()
        lm.backbone.enable_lora(rank=2)
        return lm

    def compile_fn(lm):
        optimizer = keras.optimizers.AdamW(1e-3, weight_decay=0.01)
        optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
        lm.compile(optimizer=optimizer, loss=_loss())

    x, y = _tokens()
    strategy, sharded, single = _both(build, compile_fn)
    for model in (sharded, single):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    frozen = [w for w in sharded.weights if not w.trainable and w.path.endswith("kernel")]
    assert frozen, "LoRA freezes the attention kernels"
    _assert_same_weights(sharded, single, rtol=0, atol=1e-3)
    for got, want in zip(sharded.weights, single.weights):      # frozen kernels did not move at all
        if got.path.endswith("kernel") and not got.trainable:
            np.testing.assert_array_equal(np.asarray(got.numpy()), np.asarray(want.numpy()))


def test_a_frozen_backbone_under_a_trainable_head_trains_as_one_device():
    import keras_hub

    def build():
        keras.utils.set_random_seed(2)
        backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=64,
                                                 intermediate_dim=128, max_sequence_length=SEQ)
        backbone.trainable = False
        return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=CLASSES, preprocessor=None)

    rng = np.random.RandomState(0)
    x = {"token_ids": rng.randint(0, VOCAB, (16, SEQ)), "segment_ids": np.zeros((16, SEQ), "int32"),
         "padding_mask": np.ones((16, SEQ), "int32")}
    y = rng.randint(0, CLASSES, 16)
    strategy, sharded, single = _both(build, lambda m: m.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss()))
    before = {id(w): np.asarray(w.numpy()) for w in sharded.weights}
    for model in (sharded, single):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(sharded, single)
    for weight in sharded.backbone.weights:
        np.testing.assert_array_equal(np.asarray(weight.numpy()), before[id(weight)])
    assert sharded.trainable_weights and all(
        not np.array_equal(np.asarray(w.numpy()), before[id(w)]) for w in sharded.trainable_weights), \
        "the head should train"


def test_a_model_with_nothing_to_train_fits_as_one_device():
    """Keras' train_step skips the update when no weight is trainable; capture traced
    ``apply_gradients`` on no gradients and failed before the first step."""
    def build():
        lm = _gpt2()
        lm.backbone.trainable = False       # GPT-2's head is the tied embedding: nothing trains
        return lm

    x, y = _tokens()
    strategy, sharded, single = _both(build, lambda m: m.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss()))
    losses = [m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
              for m in (sharded, single)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    _assert_same_weights(sharded, single, rtol=0, atol=0)


def _gpt2_layout_map():
    """The MLPs' first kernels split by columns over the model axis (GPT-2 has no keras-hub map)."""
    mesh = keras.distribution.DeviceMesh(tuple(MESH.values()), tuple(MESH), devices=[f"cpu:{i}" for i in range(8)])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*feedforward_intermediate_dense.*kernel"] = (None, "model")
    return layout_map


def test_save_to_preset_then_from_preset_both_ways(tmp_path):
    import keras_hub
    x, y = _tokens()
    # A layout map: the planner's GPT-2 plan at this size splits only the batch, and the test
    # is about weights saved from their shards.
    strategy = TofuStrategy(num_gpus=8, layout_map=_gpt2_layout_map())
    with strategy.scope():
        lm = _gpt2()
        lm.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    lm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_something_split(strategy)
    expected = lm.predict(x, batch_size=BATCH, verbose=0)
    preset = str(tmp_path / "preset")
    lm.save_to_preset(preset)
    assert os.path.exists(os.path.join(preset, "model.weights.h5"))

    loaded = keras_hub.models.GPT2CausalLM.from_preset(preset)                  # one device
    np.testing.assert_allclose(loaded.predict(x, batch_size=BATCH, verbose=0), expected, rtol=1e-4, atol=1e-4)

    again = TofuStrategy(num_gpus=8, layout_map=_gpt2_layout_map())
    with again.scope():
        reloaded = keras_hub.models.GPT2CausalLM.from_preset(preset)            # and back under a strategy
    np.testing.assert_allclose(reloaded.predict(x, batch_size=BATCH, verbose=0), expected, rtol=1e-4, atol=1e-4)
    _assert_something_split(again)
