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
    ({"token_embedding/embeddings": ("model", None)}, r"DTensor cannot split dim 0 of a table a gather reads"),
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


@pytest.mark.slow
def test_keras_hubs_llama_map_is_refused_where_dtensor_cannot_run_it():
    """keras-hub's own Llama map splits the token embedding's rows (vocabulary) over 'model';
    DTensor's gather cannot run a table split on its rows, so the map is refused naming that
    entry instead of training a plan other than the map's."""
    import keras_hub
    mesh = keras3.distribution.DeviceMesh((2, 4), ("batch", "model"), devices=[f"cpu:{i}" for i in range(8)])
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    strategy = TofuStrategy(8, layout_map=layout_map)
    with strategy.scope():
        model = hub_models.llama()
        model.compile(optimizer=keras3.optimizers.SGD(0.1),
                      loss=keras3.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = hub_models.data(hub_models.FAMILIES["llama"], 8)
    with pytest.raises(PinError, match=r"token_embedding/embeddings \(\d+, 32\).*DTensor cannot split dim 0"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
