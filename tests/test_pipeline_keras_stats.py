"""Tests for tofu_tf.pipeline.keras_stats and graph_stats on small Keras models (TF)."""

import keras
import pytest

from tofu_tf import models
from tofu_tf.pipeline import keras_stats, layer_stats, recommend_hybrid, factorizations

LOSS = "sparse_categorical_crossentropy"
F32 = 4


def _mlp(keras_module=None):
    return models.mlp(input_dim=16, width=32, depth=2, num_classes=10, keras=keras_module)


@pytest.fixture(scope="module")
def mlp_adam():
    return layer_stats(_mlp(), batch_size=8, loss=LOSS, optimizer="adam", num_microbatches=2)


def test_mlp_bytes_match_hand_computation(mlp_adam):
    micro = 4
    dense_0, dense_1, head = mlp_adam
    assert [s.name for s in mlp_adam] == ["dense_0", "dense_1", "head"]
    # weights, gradients and Adam's two slots: 4 copies of each parameter
    assert dense_0.state_bytes == 4 * (16 * 32 + 32) * F32 == 8704
    assert dense_1.state_bytes == 4 * (32 * 32 + 32) * F32
    assert head.state_bytes == 4 * (32 * 10 + 10) * F32
    assert [s.param_count for s in mlp_adam] == [544, 1056, 330]
    # kept for backward: the input (kernel gradient) and the ReLU output (ReLU gradient);
    # dense_1's input is dense_0's ReLU output, billed once, to dense_0
    assert dense_0.activation_bytes == micro * 16 * F32 + micro * 32 * F32 == 768
    assert dense_1.activation_bytes == micro * 32 * F32
    assert head.activation_bytes >= micro * 10 * F32  # logits, plus what the loss keeps
    assert all(s.transient_bytes > 0 and s.compute_seconds > 0 for s in mlp_adam)
    assert all(s.workspace_bytes == 0 for s in mlp_adam)  # no convolution


def test_convolution_workspace_is_tf_cpu_gradient_im2col_buffer():
    # models.cnn at micro-batch 8: conv_0 is 3x3, 3 -> 8 channels on 16x16 pixels.
    # Its filter gradient multiplies A = im2col (256 pixels x 27 patch values),
    # B = output gradient (256 x 8) and C = filter (27 x 8): 9176 floats per image;
    # the kernel buffers ceil(30 MiB / 4 / 9176) = 858 images' im2col at once.
    analysis = keras_stats.analyze_model(models.cnn(image_size=16, channels=8), micro_batch=8,
                                         loss=LOSS, optimizer="adam")
    by_name = {s.name: s for s in analysis.stats}
    assert by_name["conv_0"].workspace_bytes == 858 * 256 * 27 * F32
    # conv_1, 3x3, 8 -> 16 on 8x8: the input gradient (A = 64 x 16, B = 72 x 16,
    # C = 64 x 72: 6784 floats) needs 1160 images' buffers, the filter gradient
    # (A = 64 x 72, B = 64 x 16, C = 72 x 16: 6784 too) as many: 1160 x 64 x 72
    assert by_name["conv_1"].workspace_bytes == 1160 * 64 * 72 * F32
    assert all(s.workspace_bytes == 0 for name, s in by_name.items()
               if not name.startswith("conv"))


def test_optimizer_slots_are_part_of_state():
    sgd = layer_stats(_mlp(), batch_size=8, loss=LOSS, optimizer="sgd", num_microbatches=2)
    # weights, gradients and one slot: tf-keras' SGD builds its momentum slot even at momentum 0
    assert sgd[0].state_bytes == 3 * (16 * 32 + 32) * F32


def test_keras3_model_gets_the_same_figures(mlp_adam):
    stats = layer_stats(_mlp(keras), batch_size=8, loss=LOSS, optimizer="adam",
                        num_microbatches=2)
    assert [s.name for s in stats] == ["dense_0", "dense_1", "head"]
    for mine, theirs in zip(stats[:2], mlp_adam[:2]):
        assert (mine.state_bytes, mine.activation_bytes, mine.param_count) == (
            theirs.state_bytes, theirs.activation_bytes, theirs.param_count)


def test_gpt_blocks_become_units_at_single_tensor_cuts():
    model = models.gpt(num_layers=2, d_model=32, num_heads=2, seq_len=8, vocab_size=64)
    analysis = keras_stats.analyze_model(model, micro_batch=2, loss=LOSS, optimizer="adam")
    names = [u.name for u in analysis.units]
    assert names == ["token_embedding", "position_embedding", "block_0(ln1..res1)",
                     "block_0(ln2..res2)", "block_1(ln1..res1)", "block_1(ln2..res2)",
                     "final_ln", "lm_head"]
    layers = [name for unit in analysis.units for name in unit.layers]
    assert layers == [layer.name for layer in model.layers[1:]]  # all but the Input, once
    assert analysis.boundary_bytes == (2 * 8 * 32 * F32,) * 7 + (0,)
    assert analysis.stats[0].state_bytes == 4 * 64 * 32 * F32
    # identical blocks share a signature (the profiler measures one of them)
    assert analysis.units[2].signature == analysis.units[4].signature
    assert analysis.units[2].signature != analysis.units[3].signature


def test_batch_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="does not split into num_microbatches=3"):
        layer_stats(_mlp(), batch_size=8, loss=LOSS, optimizer="adam", num_microbatches=3)


def test_recommend_hybrid_on_a_keras_model():
    result = recommend_hybrid(_mlp(), num_devices=4, batch_size=8, loss=LOSS, optimizer="adam")
    shapes = {(c.pp, c.tp, c.dp) for c in result.candidates}
    assert shapes == {s for s in factorizations(4) if s[0] <= 3}
    peaks = [c.predicted_peak_bytes for c in result.candidates]
    assert peaks == sorted(peaks) and peaks[0] > 0
    assert result.unit_names == ("dense_0", "dense_1", "head")
