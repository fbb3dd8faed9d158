"""An EinsumDense layer gets its input in the layout its kernel contracts with.

keras-hub's attention projections are ``EinsumDense`` layers. On a 2-D mesh the planner may
split their kernels over both axes (a query kernel ``(hidden, heads, head_dim)`` as
``('batch', 'model', None)``) and the activation reaching the next projection over the other
axis; DTensor's matmul expander then refuses the contraction ("Contracting dimension for
matmul has sharding dimension model for the left input and batch for the right input")
instead of relaying one operand out. The plan priced that relayout; the strategy makes it
explicit at the layer's input (``keras_hooks.relayout_layer_inputs``), as it does for Dense.
Before, such a plan failed at its first step.
"""

import keras
import numpy as np
import pytest

from tests import strategy_helpers as h
from tofu_tf import TofuStrategy
from tofu_tf.tf import keras_adapter

pytestmark = pytest.mark.slow     # a keras-hub Llama of width 256, planned and trained twice

VOCAB, WIDTH, SEQ, BATCH = 1024, 256, 32, 16


def _llama():
    import keras_hub
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=8,
                                              num_key_value_heads=4, hidden_dim=WIDTH, intermediate_dim=2 * WIDTH)
    model = keras.Model(backbone.input, keras.layers.Dense(VOCAB, name="lm_head")(backbone.output))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_plan_splitting_attention_kernels_over_two_axes_trains_as_one_device():
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, VOCAB, (2 * BATCH, SEQ)).astype("int32"),
         "padding_mask": np.ones((2 * BATCH, SEQ), "int32")}
    y = rng.integers(0, VOCAB, (2 * BATCH, SEQ)).astype("int32")
    keras.utils.set_random_seed(0)
    reference = _llama()
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]
    # The query kernels are pinned over both axes (the planner's own choice moves with the cost
    # model); every other layout, the activations' included, is the planner's.
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices=[f"cpu:{i}" for i in range(8)])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*self_attention/query/kernel"] = ("batch", "model", None)
    strategy = TofuStrategy(8, layout_map=layout_map, plan_cache=False)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = _llama()
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]
    query = next(w for w in model.weights if w.path.endswith("self_attention/query/kernel"))
    specs = {a for a in keras_adapter.tf_variable(query).layout.sharding_specs if a != "unsharded"}
    assert specs == {"batch", "model"}, strategy.plan.summary()      # the case: split over both axes
    h.assert_trained_alike(model, reference, loss, expected, rtol=1e-4, atol=2e-5)
