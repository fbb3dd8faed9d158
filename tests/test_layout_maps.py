"""Keras layout maps as constraints: ``TofuStrategy(layout_map=...)`` and ``plan_graph(pinned_layouts=...)``.

Before, TofuStrategy took no layout map, and Keras' own layout maps leave a variable no key
matches replicated and a key that matches nothing unnoticed.
"""

import keras as keras3
import pytest
import tf_keras
from tensorflow.experimental import dtensor

from tests import strategy_helpers as h
from tofu_tf import capture_training_step, hub_models, models
from tofu_tf.search import plan_graph
from tofu_tf.search.legality import check_plan
from tofu_tf.search.pins import PinError
from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf import keras_adapter

MESH = {"batch": 2, "model": 4}


@pytest.fixture(scope="module")
def gpt_graph():
    model = models.gpt(num_layers=1, d_model=64, num_heads=4, seq_len=16, vocab_size=128)
    return capture_training_step(model, batch_size=8, optimizer=tf_keras.optimizers.Adam(),
                                 loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def test_pinned_layouts_are_kept_with_their_slots_and_the_rest_is_planned(gpt_graph):
    pins = {"block_0_mlp_in/kernel": (None, "model"), "block_0_mlp_out/kernel": ("model", None),
            "lm_head/kernel": ("batch", "model")}
    plan = plan_graph(gpt_graph, num_devices=8, mesh_shape=MESH, pinned_layouts=pins)
    check_plan(gpt_graph, plan)
    for path, layout in pins.items():
        assert plan.variable_layouts[path] == layout
        assert plan.variable_layouts[f"Adam/m/{path}"] == plan.variable_layouts[f"Adam/v/{path}"] == layout
    assert list(plan.mesh_shape) == ["batch", "model"]
    assert "3 variable layouts fixed by the layout map" in plan.summary()
    marked = [line for line in plan.summary(top=200).splitlines() if line.endswith("(layout map)")]
    assert len(marked) == 9 and all(any(path in line for path in pins) for line in marked), marked
    assert type(plan).from_json(plan.to_json()).pinned_variables == tuple(pins)


@pytest.mark.parametrize("pins,message", [
    ({"nope/kernel": (None, "model")}, r"nope/kernel: no variable of the model has this path"),
    ({"lm_head/kernel": ("model",)}, r"lm_head/kernel \(64, 128\): layout \('model',\) has 1 entries for a rank-2"),
    ({"lm_head/kernel": ("x", None)}, r"names 'x', not an axis of the mesh"),
    ({"lm_head/kernel": ("model", "model")}, r"splits two dims on one mesh axis"),
])
def test_a_pin_that_cannot_be_planned_is_refused_by_name(gpt_graph, pins, message):
    with pytest.raises(PinError, match=message):
        plan_graph(gpt_graph, num_devices=8, mesh_shape=MESH, pinned_layouts=pins)


def _tf_keras_map(entries):
    mesh = dtensor.create_mesh(list(MESH.items()), devices=[f"CPU:{i}" for i in range(8)])
    layout_map = tf_keras.dtensor.experimental.LayoutMap(mesh=mesh)
    for key, specs in entries.items():
        layout_map[key] = dtensor.Layout([dtensor.UNSHARDED if s is None else s for s in specs], mesh)
    return layout_map


@pytest.mark.slow
def test_a_tf_keras_layout_map_trains_as_one_device_in_its_layouts():
    layout_map = _tf_keras_map({"dense_0/kernel": (None, "model"), "dense_1/kernel": ("model", None)})
    x, y = h.data_for(h.build("mlp"))
    reference = h.build("mlp")
    initial = reference.get_weights()
    h.compile_model(reference)
    expected = reference.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8, layout_map=layout_map)
    with strategy.scope():
        model = h.build("mlp")
        h.compile_model(model)
    strategy.plan_model(model, batch_size=h.BATCH)
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=h.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    h.assert_trained_alike(model, reference, loss, expected)
    layouts = {w.name.split(":")[0]: tuple(keras_adapter.tf_variable(w).layout.sharding_specs) for w in model.weights}
    assert layouts["dense_0/kernel"] == (dtensor.UNSHARDED, "model")
    assert layouts["dense_1/kernel"] == ("model", dtensor.UNSHARDED)
    assert strategy.plan.variable_layouts["SGD/m/dense_0/kernel"] == (None, "model")


@pytest.mark.slow
@pytest.mark.parametrize("entries,message", [
    ({"dense_0/kernel": (None, "model"), "conv.*": ("model", None)}, r"key 'conv\.\*': matches no weight"),
    ({"dense_0/kernel": ("model",)}, r"dense_0/kernel \(16, 32\): layout \('model',\) has 1 entries"),
])
def test_a_tf_keras_map_with_an_unmatched_key_or_a_wrong_rank_is_refused(entries, message):
    strategy = TofuStrategy(8, layout_map=_tf_keras_map(entries))
    with strategy.scope():
        model = h.build("mlp")
        h.compile_model(model)
    with pytest.raises(PinError, match=message):
        strategy.plan_model(model, batch_size=h.BATCH)


def test_a_table_pinned_by_rows_is_kept_and_the_plan_is_legal(gpt_graph):
    """DTensor's gather cannot read a table split by rows; such a pin is kept (the lowering
    stores the table so and reads it whole) instead of refused."""
    pins = {"token_embedding/embeddings": ("model", None)}
    plan = plan_graph(gpt_graph, num_devices=8, mesh_shape=MESH, pinned_layouts=pins)
    check_plan(gpt_graph, plan)
    assert plan.variable_layouts["token_embedding/embeddings"] == ("model", None)


def _hub_model(family):
    """Small configs the maps divide: keras-hub's Gemma map splits the key/value heads over
    'model', so Gemma gets 4 of them (hub_models' Gemma has one)."""
    import keras_hub
    if family == "llama":
        return hub_models.llama(32)
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=hub_models.VOCAB, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=4, hidden_dim=32, intermediate_dim=64, head_dim=8)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _hub_map(backbone):
    import keras_hub
    mesh = keras3.distribution.DeviceMesh((2, 4), ("batch", "model"), devices=[f"cpu:{i}" for i in range(8)])
    return getattr(keras_hub.models, backbone).get_layout_map(mesh)


@pytest.mark.slow
@pytest.mark.parametrize("family,backbone", [("llama", "LlamaBackbone"), ("gemma", "GemmaBackbone")])
def test_keras_hubs_own_maps_train_as_one_device_in_their_layouts(family, backbone):
    """keras-hub's hand-written maps (2x4 mesh: token embedding ``('model', 'batch')``, every
    attention and MLP kernel over both axes) train with Adam as one device trains: each mapped
    weight stored in the map's layout (its slots with it) and gathered over 'batch' where it is
    read (the table whole); whether 'batch' also splits the batch is the planner's choice.
    Before, the maps were refused: DTensor cannot read a table split by rows, nor contract
    over two different axes."""
    layout_map = _hub_map(backbone)
    x, y = hub_models.data(hub_models.FAMILIES[family], 16)

    def build():
        keras3.utils.set_random_seed(0)
        model = _hub_model(family)
        model.compile(optimizer=keras3.optimizers.Adam(0.01),
                      loss=keras3.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    reference = build()
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    strategy = TofuStrategy(8, layout_map=layout_map)
    with strategy.scope():
        model = build()
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    h.assert_trained_alike(model, reference, loss, expected, rtol=1e-4, atol=2e-5)
    stored = {w.path: tuple(keras_adapter.tf_variable(w).layout.sharding_specs) for w in model.weights}
    assert stored["token_embedding/embeddings"] == ("model", "batch")
    kernels = [path for path in stored if path.endswith("kernel") and ("ffw" in path or "feedforward" in path)]
    assert kernels and all(set(stored[path]) == {"batch", "model"} for path in kernels), stored
    slots = {v.path: tuple(keras_adapter.tf_variable(v).layout.sharding_specs) for v in model.optimizer.variables
             if "token_embedding_embeddings" in v.path}
    assert slots and set(slots.values()) == {("model", "batch")}, slots


@pytest.mark.slow
def test_keras_hubs_gemma_map_is_refused_where_its_heads_do_not_divide():
    """keras-hub's Gemma map splits the key/value heads over 'model' (4 devices); a Gemma with
    one key/value head cannot be laid out so, and the map is refused naming those kernels."""
    strategy = TofuStrategy(8, layout_map=_hub_map("GemmaBackbone"))
    with strategy.scope():
        model = hub_models.gemma(32)
        model.compile(optimizer=keras3.optimizers.SGD(0.1),
                      loss=keras3.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = hub_models.data(hub_models.FAMILIES["gemma"], 8)
    with pytest.raises(PinError, match=r"attention/key/kernel \(1, 32, 8\).*dim 0 \(1\) does not divide over 'model'"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
