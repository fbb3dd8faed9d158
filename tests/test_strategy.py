"""TofuStrategy trains tf-keras models sharded across 8 devices and computes what one device computes."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from tensorflow.experimental import dtensor

from tests import strategy_helpers as h
from tofu_tf import models
from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf import lowering
from tofu_tf.tf import variables as variables_lib

pytestmark = pytest.mark.slow   # trains models under TofuStrategy end to end

# Megatron-style hand layouts on a forced (batch=2, model=4) mesh: the lowering
# and the training path are checked independently of the planner.
HAND_LAYOUTS = {
    "mlp": {"dense_0/kernel": (None, "model"), "dense_0/bias": ("model",),
            "dense_1/kernel": ("model", None), "head/kernel": (None, None)},
    # DTensor (TF 2.21) requires convolution filters replicated and conv output
    # channels unsplit (it propagates a BN parameter's split back into the conv);
    # the CNN is batch-split on the 2x4 mesh.
    "cnn_bn": {},
    # DTensor cannot split an LSTM's weights: gate columns are cut apart by
    # tf.split (no split of a sharded dim), and a row split propagates into the
    # unrolled inputs, where its Unpack expander produces wrong shapes. The LSTM
    # is batch-split on the 2x4 mesh.
    "lstm": {},
    "gru": {},  # as the LSTM: its gates are tf.split apart
    # DTensor's ResourceGather refuses a split of the rows; the features split.
    "embedding": {"embedding/embeddings": (None, "model"), "head/kernel": ("model", None)},
    "transformer": {"block_0_attn/query/kernel": (None, "model", None),
                    "block_0_attn/key/kernel": (None, "model", None),
                    "block_0_attn/value/kernel": (None, "model", None),
                    "block_0_attn/attention_output/kernel": ("model", None, None),
                    "block_0_mlp_in/kernel": (None, "model"), "block_0_mlp_out/kernel": ("model", None),
                    "token_embedding/embeddings": (None, "model")},
}


def hand_plan(name):
    return h.HandPlan(mesh_shape={"batch": 2, "model": 4}, variable_layouts=HAND_LAYOUTS[name],
                      input_layouts={"x": ("batch",)})


@pytest.fixture(scope="module", params=sorted(h.MODELS))
def trained_on_hand_plan(request):
    name = request.param
    initial, expected, expected_loss, (x, y) = h.reference_run(name)
    strategy = TofuStrategy(8, plan=hand_plan(name))
    with strategy.scope():
        model = h.build(name)
        h.compile_model(model)
    model.set_weights(initial)
    history = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0)
    return name, strategy, model, expected, expected_loss, history.history["loss"]


def test_three_steps_match_one_device(trained_on_hand_plan):
    name, _, model, expected, expected_loss, loss = trained_on_hand_plan
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for variable, want in zip(model.weights, expected):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=f"{name}: {variable.name}")


def test_shards_have_the_planned_shapes(trained_on_hand_plan):
    name, strategy, model, *_ = trained_on_hand_plan
    sizes = strategy.plan.mesh_shape
    for variable in model.weights:
        path = variable.name[:-2]
        spec = HAND_LAYOUTS[name].get(path, (None,) * variable.shape.rank)
        want = tuple(d // sizes[a] if a else d for d, a in zip(variable.shape, spec))
        shards = dtensor.unpack(variable.read_value())
        assert len(shards) == 8
        assert all(tuple(s.shape) == want for s in shards), (path, want, shards[0].shape)
        shard_bytes = sum(s.shape.num_elements() * 4 for s in shards)
        replicas = 8 // int(np.prod([sizes[a] for a in spec if a]))
        assert shard_bytes == variable.shape.num_elements() * 4 * replicas


def test_optimizer_slots_follow_their_weights(trained_on_hand_plan):
    name, _, model, *_ = trained_on_hand_plan
    layouts = {v.name[:-2]: tuple(v.layout.sharding_specs) for v in model.weights}
    for slot in model.optimizer.variables[1:]:
        weight = next((w for w in layouts if slot.name[:-2].endswith("/" + w)), None)
        if weight is not None and slot.shape.rank:
            assert tuple(slot.layout.sharding_specs) == layouts[weight], slot.name


def test_evaluate_and_predict_match_one_device(trained_on_hand_plan):
    name, _, model, expected, *_ = trained_on_hand_plan
    reference = h.build(name)
    h.compile_model(reference)
    reference.set_weights(expected)
    x, y = h.data_for(reference, seed=1)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=h.BATCH, verbose=0),
                               reference.evaluate(x, y, batch_size=h.BATCH, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=h.BATCH, verbose=0),
                               reference.predict(x, batch_size=h.BATCH, verbose=0), rtol=1e-4, atol=1e-5)


def test_variables_are_deferred_until_planned():
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = h.build("mlp")
    assert all(isinstance(v, variables_lib.DeferredVariable) for v in model.weights)
    model.weights[0].numpy()          # reading one computes that one, on the host, and no other
    assert model.weights[0]._tofu_host is not None
    assert all(v._tofu_host is None for v in model.weights[1:])


def test_weights_read_before_the_plan_are_the_ones_trained(tmp_path):
    """get_weights / numpy() / save_weights right after building under the scope (before
    any plan) gave DeferredVariableError; they give the values the plan lays out, and the
    run trains from them as one device does."""
    def build():
        keras.utils.set_random_seed(7)
        return models.mlp(width=256)     # wide enough that the planner splits weights

    h.assert_trained_alike(*h.train_from_weights_read_before_the_plan(build, str(tmp_path / "initial.h5")))


@pytest.fixture(scope="module", params=sorted(h.MODELS))
def trained_on_planner_plan(request):
    """The planner picks the mesh and the layouts; nothing is written by hand."""
    name = request.param
    initial, expected, expected_loss, (x, y) = h.reference_run(name)
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = h.build(name)
        h.compile_model(model)
    strategy.plan_model(model, batch_size=h.BATCH)
    model.set_weights(initial)
    history = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0)
    return name, strategy, model, expected, expected_loss, history.history["loss"]


def test_planner_plan_matches_one_device(trained_on_planner_plan):
    name, strategy, model, expected, expected_loss, loss = trained_on_planner_plan
    assert int(np.prod(list(strategy.plan.mesh_shape.values()))) == 8
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for variable, want in zip(model.weights, expected):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=f"{name}: {variable.name}")


def test_batch_statistics_are_relaid_where_the_planner_computes_them_whole(trained_on_planner_plan):
    """A BatchNormalization whose moments the plan computes whole takes its input replicated
    (``statistics_input_relayout``), and one whose moments are partial sums is left as DTensor runs
    it; the weights above equal one device's either way. The CNN's plan on 8 virtual CPUs is data
    parallel (partial sums) since 2026-12-07; until then it gathered ``bn_0``'s input
    (tests/test_normalization.py keeps a plan that gathers)."""
    name, strategy, *_ = trained_on_planner_plan
    if name != "cnn_bn":
        pytest.skip("the BatchNormalization model only")
    plan = strategy.plan
    whole = sorted(op.rsplit("/moments/mean", 1)[0] for op, specs in plan.op_strategies.items()
                   if op.endswith("/moments/mean") and set(specs) == {"replicate"})
    relaid = sorted(a.target for a in strategy.changes if a.change.name == "statistics_input_relayout")
    assert len(relaid) == len(whole), (relaid, whole, plan.summary())


def test_planner_layouts_are_the_variables_layouts(trained_on_planner_plan):
    """Every variable carries the plan's layout, as lowering adjusts it for DTensor."""
    _, strategy, model, *_ = trained_on_planner_plan
    lowered = lowering.dtensor_natural(strategy.plan.variable_layouts)
    for variable in model.weights:
        planned = lowered.get(variable.name[:-2])
        if planned is not None:
            actual = tuple(None if a == dtensor.UNSHARDED else a for a in variable.layout.sharding_specs)
            assert actual == tuple(planned), variable.name


@pytest.mark.parametrize("name", ["mlp", "embedding"])
def test_adam_steps_match_one_device(name):
    """Adam writes two slots and reads them back in one step; on the embedding model
    it also takes the Embedding's sparse gradient (densified for DTensor)."""
    initial, expected, expected_loss, (x, y) = h.reference_run(name, keras.optimizers.Adam(0.01))
    strategy = TofuStrategy(8, plan=hand_plan(name))
    with strategy.scope():
        model = h.build(name)
        h.compile_model(model, keras.optimizers.Adam(0.01))
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for variable, want in zip(model.weights, expected):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-4, atol=1e-6, err_msg=variable.name)


def test_tf_data_callbacks_and_checkpoints(tmp_path):
    """tf.data input, ModelCheckpoint/EarlyStopping, save/load of weights and checkpoints."""
    strategy = TofuStrategy(8, plan=hand_plan("mlp"))
    with strategy.scope():
        model = h.build("mlp")
        h.compile_model(model)
    x, y = h.data_for(model)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(h.BATCH, drop_remainder=True)
    callbacks = [keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt_{epoch}"), save_weights_only=True),
                 keras.callbacks.EarlyStopping(monitor="loss", patience=5)]
    model.fit(dataset, epochs=2, verbose=0, callbacks=callbacks)
    assert (tmp_path / "ckpt_2.index").exists()
    trained = model.get_weights()

    model.save_weights(str(tmp_path / "weights.h5"))
    plain = h.build("mlp")
    plain.load_weights(str(tmp_path / "weights.h5"))
    for got, want in zip(plain.get_weights(), trained):
        np.testing.assert_array_equal(got, want)

    checkpoint = tf.train.Checkpoint(model=model)
    path = checkpoint.save(str(tmp_path / "tf_ckpt"))
    model.set_weights([np.zeros_like(w) for w in trained])
    checkpoint.restore(path)
    for got, want in zip(model.get_weights(), trained):
        np.testing.assert_array_equal(got, want)

    model.save(str(tmp_path / "model.keras"))
    restored = keras.models.load_model(str(tmp_path / "model.keras"))
    for got, want in zip(restored.get_weights(), trained):
        np.testing.assert_array_equal(got, want)


def test_fixed_input_batch_size_trains():
    """keras.Input(batch_size=...) is the global batch (TF's own DTensor strategy fails here)."""
    strategy = TofuStrategy(8, plan=hand_plan("mlp"))
    with strategy.scope():
        model = models.mlp(width=32, depth=2, batch_size=h.BATCH)
        h.compile_model(model)
    x, y = h.data_for(model)
    history = model.fit(x, y, batch_size=h.BATCH, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_too_late_for_virtual_devices_names_the_fix():
    from tofu_tf.tf import devices
    with pytest.raises(devices.DeviceSetupError, match="before running any TensorFlow op"):
        devices.configure_virtual_cpus(16)


@pytest.mark.parametrize("user_choice", [None, True])
def test_distributed_dataset_autotunes_only_when_asked(user_choice):
    """Autotuned iterators make fit/evaluate wait seconds at their end (see
    _without_autotune_thread); a user's explicit choice is kept."""
    strategy = TofuStrategy(8, plan=hand_plan("mlp"))
    with strategy.scope():
        model = h.build("mlp")
        h.compile_model(model)
    strategy.plan_model(model, batch_size=h.BATCH)
    x, y = h.data_for(model)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(h.BATCH, drop_remainder=True)
    if user_choice is not None:
        options = tf.data.Options()
        options.autotune.enabled = user_choice
        dataset = dataset.with_options(options)
    distributed = strategy.experimental_distribute_dataset(dataset)
    # DistributedBatches keeps the dataset it iterates as _dataset.
    enabled = distributed._dataset.options().autotune.enabled  # pylint: disable=protected-access
    assert enabled is (False if user_choice is None else user_choice)
    assert int(distributed.cardinality()) == h.STEPS
    features, _ = next(iter(distributed))
    np.testing.assert_array_equal(variables_lib.gather_to_host(features, dtensor.fetch_layout(features)),
                                  x[:h.BATCH])


def test_a_loss_object_compiled_by_the_user_plans_at_the_first_step():
    """The common case: ``compile(loss=SparseCategoricalCrossentropy(from_logits=True))``
    and then ``evaluate``/``fit``, which plan the model inside the strategy's scope.
    tf-keras refuses to run a Loss with AUTO reduction under a strategy until compile's
    loss container has marked it, which happens only at the first step."""
    initial_reference = h.build("mlp")
    x, y = h.data_for(initial_reference)
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = h.build("mlp")
        h.compile_model(model)
    before = model.evaluate(x, y, batch_size=h.BATCH, verbose=0)  # plans: capture runs under the scope
    assert strategy.plan is not None
    initial = model.get_weights()
    reference = h.build("mlp")
    reference.set_weights(initial)
    h.compile_model(reference)
    np.testing.assert_allclose(before, reference.evaluate(x, y, batch_size=h.BATCH, verbose=0), rtol=1e-5)
    expected = reference.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for variable, want in zip(model.weights, reference.get_weights()):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=variable.name)


def test_an_optimizer_created_before_the_scope_trains_as_one_created_inside():
    """``opt = Adam(...)`` before ``strategy.scope()``, compiled inside it: tf-keras
    recorded the default strategy in the optimizer, whose merge_call path fails under
    TofuStrategy's global step. Adam's bias correction reads the step counter, so the
    weights only match one device if the counter advanced once per step."""
    optimizer = keras.optimizers.Adam(0.01)
    initial, expected, expected_loss, (x, y) = h.reference_run("mlp", keras.optimizers.Adam(0.01))
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = h.build("mlp")
        h.compile_model(model, optimizer)
    strategy.plan_model(model, batch_size=h.BATCH)
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for variable, want in zip(model.weights, expected):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-4, atol=1e-6, err_msg=variable.name)
    assert int(optimizer.iterations.numpy()) == h.STEPS
    assert optimizer.variables[0] is optimizer.iterations


def test_dropout_masks_are_stateless_fresh_each_step_and_at_the_rate():
    """On one device: the replacement generator's masks repeat for the same step and
    call, change with the step, keep 1 - rate of the elements and scale them by
    1 / (1 - rate)."""
    from tofu_tf.tf.compat.layers import step_seeded_dropout
    step = tf.Variable(0, dtype=tf.int64)
    layer = keras.layers.Dropout(0.5, seed=1234)
    config = layer.get_config()
    layer._random_generator = step_seeded_dropout(layer._random_generator, step)
    assert layer.get_config() == config
    x = tf.ones((64, 64))

    def mask():
        layer._random_generator._calls.clear()  # the same place in the step (calls are counted per graph)
        return layer(x, training=True).numpy()

    first, again = mask(), mask()
    np.testing.assert_array_equal(first, again)
    assert set(np.unique(first)) == {0.0, 2.0}
    assert abs((first != 0).mean() - 0.5) < 0.05
    step.assign_add(1)
    assert (mask() != first).mean() > 0.3
    np.testing.assert_array_equal(layer(x, training=False).numpy(), x.numpy())


def test_a_model_with_dropout_trains():
    """tf-keras Dropout draws with a stateful op, which DTensor refuses; the strategy
    swaps in stateless masks seeded per step (the block's Dropout and MultiHeadAttention's own)."""
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = models.gpt(num_layers=1, d_model=32, num_heads=4, seq_len=8, vocab_size=64, dropout=0.5)
        h.compile_model(model)
    x, y = h.data_for(model)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=2, shuffle=False, verbose=0).history["loss"]
    assert np.all(np.isfinite(loss))
    assert int(model.optimizer.iterations.numpy()) == 2 * len(x) // h.BATCH
    dropouts = [layer for layer in model._flatten_layers() if "Dropout" in type(layer).__name__]
    assert len(dropouts) == 2 and all(type(d._random_generator).__name__ == "StepSeededDropout" for d in dropouts)
    # training=False is the identity through every dropout: predict matches a single-device copy
    reference = models.gpt(num_layers=1, d_model=32, num_heads=4, seq_len=8, vocab_size=64, dropout=0.5)
    reference.set_weights(model.get_weights())
    np.testing.assert_allclose(model.predict(x, batch_size=h.BATCH, verbose=0),
                               reference.predict(x, batch_size=h.BATCH, verbose=0), rtol=1e-4, atol=1e-5)


@pytest.fixture(params=["mixed_bfloat16", "mixed_float16"])
def mixed_policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def test_mixed_precision_trains_sharded_as_one_device(mixed_policy):
    """Under a mixed policy tf-keras wraps each float weight in an AutoCastVariable
    (compile refused them as made outside the scope) and, for float16, the optimizer in
    a LossScaleOptimizer, whose update runs inside a tf.cond the planner cannot see
    into (every weight stayed replicated). Capture traces the update the cond guards,
    so weights shard, and the step matches one device's within half precision."""
    def build():  # wide enough that the plan splits weights
        keras.utils.set_random_seed(7)
        return models.mlp(input_dim=32, width=256, depth=2)

    reference = build()
    initial = reference.get_weights()
    h.compile_model(reference)
    x, y = h.data_for(reference)
    expected_loss = reference.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    expected = reference.get_weights()
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = build()
        h.compile_model(model)
    assert model.layers[0].compute_dtype == mixed_policy.split("_")[1]
    strategy.plan_model(model, batch_size=h.BATCH)
    assert any(axis for layout in strategy.plan.variable_layouts.values() for axis in layout)
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-2)
    for variable, want, start in zip(model.weights, expected, initial):
        assert variable.dtype == tf.float32
        h.assert_same_update(variable.numpy(), want, start, variable.name)


def test_mixed_float16_skips_overflowing_steps_as_one_device():
    """Inputs scaled so every step's scaled gradients overflow float16: the
    LossScaleOptimizer skips each step and halves its scale, sharded as on one device."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def build():
            keras.utils.set_random_seed(7)
            model = models.mlp(input_dim=32, width=256, depth=2)
            model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return model

        x, y = h.data_for(models.mlp(input_dim=32, width=256, depth=2))
        x = x * 300
        reference = build()
        initial = reference.get_weights()
        reference.fit(x, y, batch_size=h.BATCH, shuffle=False, verbose=0)
        strategy = TofuStrategy(8)
        with strategy.scope():
            model = build()
        strategy.plan_model(model, batch_size=h.BATCH)
        model.set_weights(initial)
        model.fit(x, y, batch_size=h.BATCH, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert float(reference.optimizer.loss_scale) == 2.0 ** 15 / 2 ** h.STEPS
    assert float(model.optimizer.loss_scale) == float(reference.optimizer.loss_scale)
    for got, want in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("overwrite_every", [None, 2])
def test_use_ema_moving_averages_match_one_device(overwrite_every):
    """tf-keras' DTensor path never updated use_ema's averages, and fit ends by writing
    the averages into the weights: the run was lost (weights back to their initial
    values). Averages, the periodic overwrite and the final weights now match one device."""
    def optimizer():
        return keras.optimizers.SGD(0.05, momentum=0.9, use_ema=True, ema_momentum=0.5,
                                    ema_overwrite_frequency=overwrite_every)

    initial, expected, expected_loss, (x, y) = h.reference_run("mlp", optimizer())
    strategy = TofuStrategy(8, plan=hand_plan("mlp"))
    with strategy.scope():
        model = h.build("mlp")
        h.compile_model(model, optimizer())
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    assert max(float(np.max(np.abs(w - i))) for w, i in zip(expected, initial)) > 1e-3
    for variable, want in zip(model.weights, expected):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=variable.name)


def test_adafactor_trains_as_one_device():
    """Adafactor keeps placeholder state as ``tf.Variable(0)`` (a Python int), which
    capture's shape-only variables could not take."""
    x, y = h.data_for(h.build("mlp"))
    trained = h.train_beside_one_device(  # planned: the step is captured
        lambda: h.build("mlp"), x, y, compile_fn=lambda m: h.compile_model(m, keras.optimizers.Adafactor(0.05)))
    h.assert_trained_alike(*trained, rtol=1e-4)


@pytest.mark.parametrize("built", [False, True])
def test_a_subclassed_model_trains_as_one_device(built):
    """A subclassed model names no inputs: the strategy plans it from the first batch's
    specs (building it, as its first call would) or from the shape it was built with."""
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = h.subclassed_mlp(keras)
        if built:
            model.build((None, 32))
        h.compile_model(model)
    x, y = h.data_for(models.mlp(input_dim=32))
    if built:
        strategy.plan_model(model, batch_size=h.BATCH)
    start = h.InitialWeights(keras)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0,
                     callbacks=[start.callback]).history["loss"]
    assert any(axis for layout in strategy.plan.variable_layouts.values() for axis in layout)
    reference = h.subclassed_mlp(keras)
    reference.build((None, 32))
    reference.set_weights(start.weights)
    h.compile_model(reference)
    expected = reference.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_summary_before_and_after_the_plan():
    """tf-keras' summary divided by the weights' per-device size, 0 before the plan
    (ZeroDivisionError); it now says when layouts come, then reports the sharding."""
    strategy = TofuStrategy(8, plan=hand_plan("mlp"))
    lines = []
    with strategy.scope():
        model = h.build("mlp")
        h.compile_model(model)
    unplanned = TofuStrategy(8)
    with unplanned.scope():
        waiting = h.build("mlp")
        h.compile_model(waiting)
        waiting.summary(print_fn=lines.append)
    assert any("TofuStrategy plans them at the first fit" in line for line in lines)
    lines.clear()
    model.summary(print_fn=lines.append)
    assert any("are sharded based on spec" in line for line in lines)


def test_a_bidirectional_lstm_trains_as_one_device():
    """Bidirectional runs its forward and backward LSTMs inside its own call, so they
    have no symbolic input to read a sequence length from: they are unrolled with the
    wrapper's (was: refused as having no static sequence length)."""
    def build():
        keras.utils.set_random_seed(7)
        return keras.Sequential([keras.Input((5, 16)), keras.layers.Bidirectional(keras.layers.LSTM(16)),
                                 keras.layers.Dense(10)])

    x, y = h.data_for(build())
    h.assert_trained_alike(*h.train_beside_one_device(build, x, y))


@pytest.mark.parametrize("run", ["fit", "predict"])
def test_a_tf_keras_convolutional_rnn_is_refused_naming_the_layer(run):
    """tf-keras' ConvLSTM2D loops over TensorLists, which DTensor cannot expand, and its
    call ignores unroll: refused before the first step (was: DTensor's UnknownError
    "'tf.TensorListStack' op does not implement layout propagation" from predict)."""
    from tofu_tf.tf.keras_adapter import UnsupportedModelError
    x = np.random.default_rng(0).random((8, 4, 8, 8, 3), dtype=np.float32)
    with TofuStrategy(8).scope():
        model = keras.Sequential([keras.Input(x.shape[1:]), keras.layers.ConvLSTM2D(4, 3, padding="same"),
                                  keras.layers.GlobalMaxPooling2D(), keras.layers.Dense(2)])
        model.compile(loss="mse", optimizer="adam")
    with pytest.raises(UnsupportedModelError, match=r"conv_lstm2d.*ConvLSTM2D.*Keras 3"):
        if run == "fit":
            model.fit(x, np.zeros((8, 2), np.float32), batch_size=8, verbose=0)
        else:
            model.predict(x, batch_size=8, verbose=0)


@pytest.mark.parametrize("weights_file", ["pretrained.weights.h5", "pretrained_checkpoint"])
def test_weights_loaded_before_the_plan_are_trained_from(tmp_path, weights_file):
    """Fine-tuning: load_weights under the scope, before any step. The h5 path assigned
    to weights that had no value yet (an error); a TF checkpoint restore wrote the
    handles that the plan then replaced, and training silently started from random
    weights. Both are kept on the host and laid out by the plan."""
    x, y = h.data_for(h.build("mlp"))
    pretrained = h.build("mlp")
    pretrained.set_weights([w + 0.5 for w in pretrained.get_weights()])
    pretrained.save_weights(str(tmp_path / weights_file))
    reference = h.build("mlp")
    reference.load_weights(str(tmp_path / weights_file))
    h.compile_model(reference)
    expected = reference.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8)     # no plan yet: the weights wait for one
    with strategy.scope():
        model = h.build("mlp")
        model.load_weights(str(tmp_path / weights_file))
        h.compile_model(model)
    for got, want in zip(model.get_weights(), pretrained.get_weights()):
        np.testing.assert_array_equal(got, want)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_training_resumes_from_a_checkpoint_restored_before_the_plan(tmp_path):
    """Resuming a run: a tf.train.Checkpoint of model and optimizer restored under the scope
    before any step. Its save counter came with no shape (planning failed), the restore
    wrote handles the plan replaced, and the restore's bookkeeping was lost with them.
    Weights, Adam's slots and step counter carry on as on one device."""
    def optimizer():
        return keras.optimizers.Adam(0.01)

    x, y = h.data_for(h.build("mlp"))
    first = h.build("mlp")
    h.compile_model(first, optimizer())
    first.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "run"))

    def resume(model):
        h.compile_model(model, optimizer())
        return tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path)

    reference = h.build("mlp")
    resume(reference)
    expected = reference.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = h.build("mlp")
        status = resume(model)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    status.assert_existing_objects_matched()
    assert int(model.optimizer.iterations.numpy()) == 2 * h.STEPS
    h.assert_trained_alike(model, reference, loss, expected, rtol=1e-4)


def test_predict_takes_any_number_of_samples():
    """13 samples at batch 8: the last batch is padded and the copies' outputs dropped,
    so the outputs are one device's for exactly those 13."""
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = h.build("mlp")
        h.compile_model(model)
    x, y = h.data_for(model)
    model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0)
    reference = h.build("mlp")
    reference.set_weights(model.get_weights())
    got = model.predict(x[:13], batch_size=h.BATCH, verbose=0)
    assert got.shape[0] == 13
    np.testing.assert_allclose(got, reference.predict(x[:13], batch_size=h.BATCH, verbose=0), rtol=1e-5, atol=1e-6)


def test_an_lstm_with_dropout_trains():
    """An LSTM cell's input and recurrent dropout masks come from the same stateful
    draw as Dropout's; they are swapped for stateless ones too."""
    def build():
        return keras.Sequential([keras.Input((6, 8)), keras.layers.LSTM(16, dropout=0.3, recurrent_dropout=0.3),
                                 keras.layers.Dense(4)])

    strategy = TofuStrategy(8)
    with strategy.scope():
        model = build()
        h.compile_model(model)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6, 8)).astype("float32"), rng.integers(0, 4, 32).astype("int32")
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=2, shuffle=False, verbose=0).history["loss"]
    assert np.all(np.isfinite(loss))
    cells = [layer for layer in model._flatten_layers() if type(layer).__name__ == "LSTMCell"]
    assert cells and type(cells[0]._random_generator).__name__ == "StepSeededDropout"
    reference = build()
    reference.set_weights(model.get_weights())
    np.testing.assert_allclose(model.predict(x, batch_size=h.BATCH, verbose=0),
                               reference.predict(x, batch_size=h.BATCH, verbose=0), rtol=1e-4, atol=1e-5)


SMALL_TEXT_CNN = dict(vocab=64, width=32, filters=16, padding="valid", pooling="GlobalAveragePooling1D", hidden=())
LARGE_TEXT_CNN = dict(vocab=512, width=128, filters=128, padding="same", pooling="GlobalMaxPooling1D", hidden=(256,))


@pytest.mark.parametrize("spec", [SMALL_TEXT_CNN, LARGE_TEXT_CNN], ids=["small", "large"])
def test_a_convolution_after_a_feature_split_layer_matches_one_device(spec):
    """A Conv1D after an Embedding: the planner may split the embedding's features,
    and DTensor refuses a convolution input whose channels are split; the strategy
    relays the input to the batch-split or replicated layout the plan priced. At the
    larger size the plan also split the Conv1D's bias, added to 3-D tensors after the
    convolution, which DTensor propagated back into it (the target now keeps a
    convolution layer's ops batch-split or replicated)."""
    def build():
        keras.utils.set_random_seed(3)
        return keras.Sequential([
            keras.Input((12,), dtype="int32"), keras.layers.Embedding(spec["vocab"], spec["width"]),
            keras.layers.Conv1D(spec["filters"], 3, padding=spec["padding"], activation="relu"),
            getattr(keras.layers, spec["pooling"])(),
            *[keras.layers.Dense(n, activation="relu") for n in spec["hidden"]], keras.layers.Dense(4)])

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, spec["vocab"], (24, 12)).astype("int32"), rng.integers(0, 4, 24).astype("int32")
    h.assert_trained_alike(*h.train_beside_one_device(build, x, y), rtol=1e-4)


@pytest.mark.parametrize("framework", ["tf_keras", "keras3"])
def test_logs_name_layers_by_their_path(framework):
    """Two blocks with the same layer names (a MultiHeadAttention's query/key/value in every
    block, nested models reusing names): the strategy's log lines named both "norm" or
    "proj"; they name each layer by its path in the layer tree."""
    from tofu_tf.strategies import keras_hooks
    from tofu_tf.tf import keras_adapter
    from tofu_tf.tf.compat import layers as compat_layers
    k = keras_adapter.keras_module(framework)

    def block(i):
        x = k.Input((4, 8))
        h = k.layers.LayerNormalization(name="norm")(x)
        h = k.layers.MultiHeadAttention(2, 4, name="attention")(h, h)
        return k.Model(x, k.layers.Dense(8, name="proj")(h), name=f"block_{i}")

    x = k.Input((4, 8))
    model = k.Model(x, block(1)(block(0)(x)))
    paths = dict(keras_adapter.layer_paths(model))
    assert {"block_0/attention/query", "block_1/attention/query"} <= set(paths)
    assert len(paths) == len(list(model._flatten_layers(include_self=False, recursive=True)))
    changed = [applied.target for applied in keras_hooks.prepare_for_dtensor(model)
               if applied.change.name == "layer_norm_unfused"]
    assert changed == (["block_0/norm", "block_1/norm"] if framework == "tf_keras" else [])   # Keras 3 does not fuse
    hinted = compat_layers.relayout_layer_inputs(model, lambda kernel: ("model", None), "batch", mesh=None)
    assert [applied.target for applied in hinted] == ["block_0/proj", "block_1/proj"]


def test_the_strategy_holds_the_models_it_prepared_weakly():
    """Before, it kept their id()s: once a model was collected, a new model given the same id
    was taken as prepared and skipped its rewrites for DTensor."""
    import gc
    import weakref
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = h.build("mlp")
        h.compile_model(model)
    strategy.extended._prepare(model)
    assert model in strategy.extended._prepared
    collected = weakref.ref(model)
    del model
    gc.collect()
    assert collected() is None and len(strategy.extended._prepared) == 0


def test_training_libraries_questions_are_answered_on_one_client():
    """Model Garden's run_experiment reads ``should_checkpoint`` to build its checkpoint manager,
    Orbit ``should_save_summary``; TF's DTensor strategy had neither (AttributeError). The
    two-client answers are checked in tests/test_multi_host.py."""
    extended = TofuStrategy(num_gpus=8).extended
    assert (extended.should_checkpoint, extended.should_save_summary, extended.experimental_should_init) == \
        (True, True, True)
