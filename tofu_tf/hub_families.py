"""Every keras-hub backbone family (and a set of ``tf_keras.applications``) from a small configuration.

``tofu_tf.strategies.hub_sweep`` trains each of these under TofuStrategy beside one device,
to find out which families a user can partition and which the strategy refuses
(issue #37). This module only builds: each ``Sweep`` entry names the keras-hub
backbone class it covers, a builder taking a hidden width, and what its data
looks like; the data itself is drawn from the built model's own ``keras.Input``
specs (``data``), so that a family is fed what its backbone declares.

How each family is built, and why:

* the keras-hub *task* model where one exists (``XCausalLM``,
  ``XTextClassifier``, ``XImageClassifier``, ``XSeq2SeqLM``, ``XImageSegmenter``,
  ...), called as keras-hub's docs call it with ``preprocessor=None``;
* otherwise the backbone with a small head (``with_head``): a vocabulary
  projection on a sequence output, a class projection on pooled image
  features, or the backbone's own logits (CLIP-style similarity matrices);
* constructor arguments are those of keras-hub 0.32's ``__init__`` signatures,
  at widths of 16-64, two layers, 8 tokens, 32x32 images (or the smallest size
  the family accepts);
* dropout and stochastic depth off (``_no_dropout``): DTensor draws a sharded
  op's random masks per device, so a comparison with one device would compare
  different random steps (tofu_tf/hub_models.py says more).

Families that cannot be built small, or only from pretrained parts, are
``Sweep`` entries with a ``skip`` reason: the sweep's table lists them instead
of dropping them. keras-hub and tf_keras are imported when a builder runs (test
and bench dependencies, not the library's).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Mapping

import numpy as np

VOCAB = 64          # token ids and vocabulary heads
SEQ = 8             # tokens per sequence
CLASSES = 4
IMAGE = 32          # image side (a family that needs more says so in its entry)

# Constructor arguments that draw random masks or drop paths: set to zero wherever a class takes them.
_RANDOM_ARGS = ("dropout", "dropout_rate", "attention_dropout", "attention_dropout_rate", "drop_path_rate",
                "drop_path", "max_drop_path_rate", "attention_dropout_rate", "feedforward_dropout_rate",
                "router_jitter_noise")


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One family of the sweep.

    ``backbone``: the keras-hub class (or ``tf_keras.applications`` function) it covers;
    ``build(width)``: the model to train (None when ``skip``); ``shapes``: per input
    name, the shape of one example where the model's Input leaves dims unknown
    (sequence lengths, image sides); ``skip``: why the family is not built."""

    name: str
    backbone: str
    build: Callable[[int], object] | None = None
    shapes: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    skip: str | None = None
    framework: str = "keras"            # "tf_keras" for tf_keras.applications
    in_batch_labels: bool = False       # logits over the batch's own examples (CLIP-style): label i % batch


def _hub():
    import keras_hub
    return keras_hub


def _no_dropout(cls, kwargs):
    """``kwargs`` with every random-mask argument ``cls`` takes set to zero (unless given)."""
    params = inspect.signature(cls.__init__).parameters
    out = dict(kwargs)
    for name in _RANDOM_ARGS:
        if name in params and name not in out:
            out[name] = 0.0
    return out


def _make(cls_name, **kwargs):
    cls = getattr(_hub().models, cls_name)
    return cls(**_no_dropout(cls, kwargs))


def with_head(backbone, key=None, *, raw=False):
    """``keras.Model(backbone.input, head(output))``: ``key`` picks a dict output (default:
    ``sequence_output``-like, else the last); a rank-3 output gets a vocabulary projection, a
    rank-4 feature map global pooling and a class projection, rank 2 a class projection;
    ``raw`` keeps the output as it is (logits already)."""
    import keras
    out = backbone.output
    if isinstance(out, dict):
        if key is None:
            for candidate in ("sequence_output", "decoder_sequence_output", "last_hidden_state"):
                if candidate in out:
                    key = candidate
                    break
            else:
                key = sorted(out)[-1]
        out = out[key]
    elif isinstance(out, (list, tuple)):
        out = out[-1 if key is None else key]
    if not raw:
        rank = len(out.shape)
        if rank == 4:
            out = keras.layers.GlobalAveragePooling2D(name="sweep_pool")(out)
        if rank == 5:
            out = keras.layers.GlobalAveragePooling3D(name="sweep_pool")(out)
        out = keras.layers.Dense(VOCAB if rank == 3 else CLASSES, name="sweep_head")(out)
    return keras.Model(backbone.input, out, name=f"{backbone.name}_head")


def _task(task_name, backbone, **kwargs):
    cls = getattr(_hub().models, task_name)
    return cls(backbone=backbone, preprocessor=None, **_no_dropout(cls, kwargs))


def _gemma3n_lm(backbone):
    """Gemma 3n's causal LM, its tied head read at call time.

    keras-hub's ``Gemma3nCausalLM`` builds its logits with ``language_model.token_embedding(hidden,
    reverse=True)`` on the symbolic output, and that method multiplies by the embedding *variable*
    outside any layer: Keras computes the transpose eagerly and the functional graph keeps the
    table's values at construction as a constant. Its head then neither trains nor follows
    ``set_weights`` (two builds given the same weights predicted differently, in float64 too; the
    logits match the construction-time table to 1e-7), so it could not be compared with one device.
    The same method called inside a layer's call reads the variable each step."""
    import keras
    head = keras.layers.Lambda(lambda hidden: backbone.language_model.token_embedding(hidden, reverse=True),
                               name="tied_logits")
    return keras.Model(backbone.input, head(backbone.output))


# -- builders by kind ------------------------------------------------------------------------------

def _at(value, w):
    """``value`` with every width function in it (``_w``, ``_mlp``, ``_hd``) applied to ``w``."""
    if callable(value):
        return value(w)
    if isinstance(value, (list, tuple)):
        return type(value)(_at(v, w) for v in value)
    return value


def _causal(backbone_name, task_name, **kwargs):
    return lambda w: _task(task_name, _make(backbone_name, vocabulary_size=VOCAB, num_layers=2,
                                            **{k: _at(v, w) for k, v in kwargs.items()}))


def _classifier(backbone_name, task_name, **kwargs):
    return lambda w: _task(task_name, _make(backbone_name, **{k: _at(v, w) for k, v in kwargs.items()}),
                           num_classes=CLASSES)


def _headed(backbone_name, key=None, raw=False, **kwargs):
    return lambda w: with_head(_make(backbone_name, **{k: _at(v, w) for k, v in kwargs.items()}), key, raw=raw)


def _hd(w):
    return w // 4


def _mlp(w):
    return 2 * w


def _w(w):
    return w


_LM = dict(num_query_heads=4, num_key_value_heads=2, hidden_dim=_w, intermediate_dim=_mlp)
_ENC = dict(vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=_w, intermediate_dim=_mlp,
            max_sequence_length=16)
_IMG = (IMAGE, IMAGE, 3)


def _resnet(w, image_shape=_IMG):
    return _make("ResNetBackbone", input_conv_filters=[64], input_conv_kernel_sizes=[3],
                 stackwise_num_filters=[64, w], stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2],
                 block_type="basic_block", image_shape=image_shape)


def _mit(w):
    return _make("MiTBackbone", image_shape=_IMG, num_layers=2, hidden_dims=[16, w], layerwise_depths=[1, 1],
                 layerwise_num_heads=[1, 2], layerwise_sr_ratios=[2, 1], layerwise_patch_sizes=[7, 3],
                 layerwise_strides=[4, 2])


def _segformer(w):
    return _task("SegFormerImageSegmenter", _make("SegFormerBackbone", image_encoder=_mit(w), projection_filters=16),
                 num_classes=CLASSES)


def _deeplab(w):
    backbone = _make("DeepLabV3Backbone", image_encoder=_resnet(w), spatial_pyramid_pooling_key="P3",
                     upsampling_size=2, dilation_rates=[1, 2], low_level_feature_key="P2", projection_filters=8,
                     image_shape=_IMG)
    return _task("DeepLabV3ImageSegmenter", backbone, num_classes=CLASSES)


def _retinanet(w):
    encoder = _make("ResNetBackbone", input_conv_filters=[64], input_conv_kernel_sizes=[3],
                    stackwise_num_filters=[64, 16, w], stackwise_num_blocks=[1, 1, 1],
                    stackwise_num_strides=[1, 2, 2], block_type="basic_block", image_shape=(64, 64, 3))
    return with_head(_make("RetinaNetBackbone", image_encoder=encoder, min_level=3, max_level=4, use_p5=False,
                           image_shape=(64, 64, 3)), "P3")


def _dual(vision, text, backbone_name, **extra):
    def build(w):
        vision_encoder = _make(vision, patch_size=8, hidden_dim=w, num_layers=2, num_heads=4,
                               intermediate_dim=2 * w, image_shape=_IMG)
        text_encoder = _make(text, vocabulary_size=VOCAB, embedding_dim=w, hidden_dim=w, num_layers=2,
                             num_heads=4, intermediate_dim=2 * w, max_sequence_length=SEQ)
        backbone = _make(backbone_name, vision_encoder=vision_encoder, text_encoder=text_encoder,
                         **{k: v(w) if callable(v) else v for k, v in extra.items()})
        return with_head(backbone, "vision_logits", raw=True)
    return build


def _depth_anything(w):
    encoder = _make("DINOV2Backbone", patch_size=4, num_layers=4, hidden_dim=w, num_heads=2, intermediate_dim=2 * w,
                    image_shape=(28, 28, 3), position_embedding_shape=(28, 28))
    return with_head(_make("DepthAnythingBackbone", image_encoder=encoder, reassemble_factors=[4, 2, 1, 0.5],
                           neck_hidden_dims=[8, 8, 16, 16], fusion_hidden_dim=16, head_hidden_dim=8,
                           head_in_index=-1, feature_keys=["stage1", "stage2", "stage3", "stage4"]))


def _parseq(w):
    encoder = _make("ViTBackbone", image_shape=(16, 32, 3), patch_size=4, num_layers=1, num_heads=2,
                    hidden_dim=w, mlp_dim=2 * w, use_class_token=False)
    backbone = _make("PARSeqBackbone", image_encoder=encoder, vocabulary_size=VOCAB, max_label_length=SEQ,
                     decoder_hidden_dim=w, num_decoder_layers=1, num_decoder_heads=2, decoder_mlp_dim=2 * w)
    # PARSeqCausalLM reads its preprocessor's tokenizer when built: the backbone with a vocabulary head.
    return with_head(backbone)


def _tf_keras_app(name, size, **kwargs):
    def build(w):
        del w     # the applications fix their widths
        import tf_keras
        return getattr(tf_keras.applications, name)(input_shape=(size, size, 3), weights=None, classes=CLASSES,
                                                    classifier_activation=None, **kwargs)
    return build


_SWEEP = [
    # decoder language models: keras-hub's XCausalLM(preprocessor=None)
    Sweep("bloom", "BloomBackbone", _causal("BloomBackbone", "BloomCausalLM", num_heads=4, hidden_dim=_w,
                                            intermediate_dim=_mlp)),
    Sweep("falcon", "FalconBackbone", _causal("FalconBackbone", "FalconCausalLM", num_attention_heads=4,
                                              hidden_dim=_w, intermediate_dim=_mlp)),
    Sweep("gpt2", "GPT2Backbone", _causal("GPT2Backbone", "GPT2CausalLM", num_heads=4, hidden_dim=_w,
                                          intermediate_dim=_mlp, max_sequence_length=16)),
    Sweep("gpt_neo_x", "GPTNeoXBackbone", _causal("GPTNeoXBackbone", "GPTNeoXCausalLM", num_heads=4, hidden_dim=_w,
                                                  intermediate_dim=_mlp, max_sequence_length=16)),
    Sweep("gemma", "GemmaBackbone", _causal("GemmaBackbone", "GemmaCausalLM", num_query_heads=4,
                                            num_key_value_heads=1, hidden_dim=_w, intermediate_dim=_mlp,
                                            head_dim=_hd)),
    Sweep("gemma3", "Gemma3Backbone", _causal("Gemma3Backbone", "Gemma3CausalLM", image_size=IMAGE,
                                              num_query_heads=4, num_key_value_heads=2, hidden_dim=_w,
                                              intermediate_dim=_mlp, head_dim=_hd)),
    Sweep("gemma4", "Gemma4Backbone", _causal("Gemma4Backbone", "Gemma4CausalLM", image_size=IMAGE,
                                              num_query_heads=4, num_key_value_heads=2, hidden_dim=_w,
                                              intermediate_dim=_mlp, head_dim=_hd, sliding_window_size=SEQ,
                                              sliding_window_pattern=2)),
    Sweep("gemma3n", "Gemma3nBackbone", lambda w: _gemma3n_lm(_make(
        "Gemma3nBackbone", text_vocab_size=VOCAB, text_hidden_size=w, num_hidden_layers=2, pad_token_id=0,
        num_attention_heads=4, num_key_value_heads=2, head_dim=w // 4, intermediate_size=[2 * w, 2 * w],
        hidden_activation="gelu", layer_types=["sliding_attention", "full_attention"],
        sliding_window=SEQ, rope_theta=10000.0, max_position_embeddings=32, vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8, altup_num_inputs=2, laurel_rank=4))),
    Sweep("gpt_oss", "GptOssBackbone", _causal("GptOssBackbone", "GptOssCausalLM", num_query_heads=4,
                                               num_key_value_heads=2, hidden_dim=_w, intermediate_dim=_mlp,
                                               num_experts=4, top_k=2, sliding_window=SEQ, head_dim=_hd)),
    Sweep("llama", "LlamaBackbone", _causal("LlamaBackbone", "LlamaCausalLM", **_LM)),
    Sweep("llama3", "Llama3Backbone", _causal("Llama3Backbone", "Llama3CausalLM", **_LM)),
    Sweep("mistral", "MistralBackbone", _causal("MistralBackbone", "MistralCausalLM", sliding_window=SEQ, **_LM)),
    Sweep("mixtral", "MixtralBackbone", _causal("MixtralBackbone", "MixtralCausalLM", num_experts=4, top_k=2,
                                                sliding_window=SEQ, **_LM)),
    Sweep("opt", "OPTBackbone", _causal("OPTBackbone", "OPTCausalLM", num_heads=4, hidden_dim=_w,
                                        intermediate_dim=_mlp, max_sequence_length=16)),
    Sweep("phi3", "Phi3Backbone", _causal("Phi3Backbone", "Phi3CausalLM", max_sequence_length=16,
                                          pretraining_sequence_length=16, **_LM)),
    Sweep("qwen", "QwenBackbone", _causal("QwenBackbone", "QwenCausalLM", **_LM)),
    Sweep("qwen2", "Qwen2Backbone", _causal("Qwen2Backbone", "Qwen2CausalLM", **_LM)),
    Sweep("qwen3", "Qwen3Backbone", _causal("Qwen3Backbone", "Qwen3CausalLM", head_dim=_hd, **_LM)),
    Sweep("qwen_moe", "QwenMoeBackbone", _causal("QwenMoeBackbone", "QwenMoeCausalLM", moe_intermediate_dim=_w,
                                                 shared_expert_intermediate_dim=_w, num_experts=4, top_k=2, **_LM)),
    Sweep("qwen3_moe", "Qwen3MoeBackbone", _causal("Qwen3MoeBackbone", "Qwen3MoeCausalLM", head_dim=_hd,
                                                   moe_intermediate_dim=_w, num_experts=4, top_k=2, **_LM)),
    Sweep("qwen3_5", "Qwen3_5Backbone", _causal(
        "Qwen3_5Backbone", "Qwen3_5CausalLM", head_dim=_hd, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, **_LM)),
    Sweep("qwen3_5_moe", "Qwen3_5MoeBackbone", _causal(
        "Qwen3_5MoeBackbone", "Qwen3_5MoeCausalLM", num_query_heads=4, num_key_value_heads=2, head_dim=_hd,
        hidden_dim=_w, moe_intermediate_dim=_w, shared_expert_intermediate_size=_w, num_experts=4, top_k=2,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8)),
    Sweep("rwkv7", "RWKV7Backbone", lambda w: _task("RWKV7CausalLM", _make(
        "RWKV7Backbone", hidden_size=w, head_size=8, num_layers=2, vocabulary_size=VOCAB, intermediate_dim=2 * w,
        gate_lora=8, mv_lora=8, aaa_lora=8, decay_lora=8))),
    Sweep("smollm", "SmolLMBackbone", lambda w: _task("SmolLMCausalLM", _smollm("SmolLMBackbone", w))),
    Sweep("smollm3", "SmolLM3Backbone", lambda w: _task("SmolLM3CausalLM", _smollm("SmolLM3Backbone", w))),
    # text encoders: XTextClassifier(preprocessor=None), else a vocabulary head
    Sweep("albert", "AlbertBackbone", _classifier("AlbertBackbone", "AlbertTextClassifier", embedding_dim=16,
                                                  **_ENC)),
    Sweep("bert", "BertBackbone", _classifier("BertBackbone", "BertTextClassifier", **_ENC)),
    Sweep("deberta_v3", "DebertaV3Backbone", _classifier("DebertaV3Backbone", "DebertaV3TextClassifier",
                                                         bucket_size=8, **_ENC)),
    Sweep("distil_bert", "DistilBertBackbone", _classifier("DistilBertBackbone", "DistilBertTextClassifier",
                                                           **_ENC)),
    Sweep("electra", "ElectraBackbone", _headed("ElectraBackbone", vocab_size=VOCAB, num_layers=2, num_heads=4,
                                                hidden_dim=_w, embedding_dim=16, intermediate_dim=_mlp,
                                                max_sequence_length=16)),
    Sweep("esm", "ESMBackbone", _classifier("ESMBackbone", "ESMProteinClassifier", **_ENC)),
    Sweep("esm2", "ESM2Backbone", _headed("ESM2Backbone", **_ENC)),
    Sweep("f_net", "FNetBackbone", _classifier("FNetBackbone", "FNetTextClassifier", vocabulary_size=VOCAB,
                                               num_layers=2, hidden_dim=_w, intermediate_dim=_mlp,
                                               max_sequence_length=16)),
    Sweep("roberta", "RobertaBackbone", _classifier("RobertaBackbone", "RobertaTextClassifier", **_ENC)),
    Sweep("roformer_v2", "RoformerV2Backbone", _classifier(
        "RoformerV2Backbone", "RoformerV2TextClassifier", vocabulary_size=VOCAB, num_layers=2, num_heads=4,
        hidden_dim=_w, intermediate_dim=_mlp, head_size=8)),
    Sweep("xlm_roberta", "XLMRobertaBackbone", _classifier("XLMRobertaBackbone", "XLMRobertaTextClassifier",
                                                           **_ENC)),
    Sweep("xlnet", "XLNetBackbone", _headed("XLNetBackbone", vocabulary_size=VOCAB, num_layers=2, num_heads=4,
                                            hidden_dim=_w, intermediate_dim=_mlp)),
    # encoder-decoders
    Sweep("bart", "BartBackbone", lambda w: _task("BartSeq2SeqLM", _make(
        "BartBackbone", vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=w, intermediate_dim=2 * w,
        max_sequence_length=16))),
    Sweep("t5", "T5Backbone", _headed("T5Backbone", "decoder_sequence_output", vocabulary_size=VOCAB,
                                      num_layers=2, num_heads=4, hidden_dim=_w, intermediate_dim=_mlp,
                                      key_value_dim=_hd)),
    Sweep("t5gemma", "T5GemmaBackbone", lambda w: _task("T5GemmaSeq2SeqLM", _make("T5GemmaBackbone",
                                                                                  **_t5gemma(w)))),
    Sweep("t5gemma2", "T5Gemma2Backbone", lambda w: _task("T5Gemma2Seq2SeqLM", _make("T5Gemma2Backbone",
                                                                                    **_t5gemma(w)))),
    Sweep("edrec", "EdRecBackbone", lambda w: _task("EdRecSeq2SeqLM", _make(
        "EdRecBackbone", vocab_size=VOCAB, num_layers_enc=2, num_layers_dec=2, hidden_dim=w, intermediate_dim=2 * w,
        num_heads=4))),
    Sweep("whisper", "WhisperBackbone", _headed("WhisperBackbone", "decoder_sequence_output", vocabulary_size=VOCAB,
                                                num_layers=2, num_heads=4, hidden_dim=_w, intermediate_dim=_mlp,
                                                num_mels=16, max_encoder_sequence_length=16,
                                                max_decoder_sequence_length=16),
          shapes={"encoder_features": (16, 16)}),
    Sweep("moonshine", "MoonshineBackbone", lambda w: _task("MoonshineAudioToText", _make(
        "MoonshineBackbone", vocabulary_size=VOCAB, filter_dim=w, encoder_num_layers=1, decoder_num_layers=1,
        hidden_dim=w, intermediate_dim=2 * w, encoder_num_heads=4, decoder_num_heads=4,
        max_position_embeddings=64)), shapes={"encoder_input_values": (1600, 1), "encoder_padding_mask": (1600,)}),
    # image classifiers: XImageClassifier(preprocessor=None), else a pooled class head
    Sweep("cspnet", "CSPNetBackbone", _classifier(
        "CSPNetBackbone", "CSPNetImageClassifier", stem_filters=16, stem_kernel_size=3, stem_strides=1,
        stackwise_depth=[1, 1], stackwise_strides=[1, 2], stackwise_num_filters=[16, _w], block_type="dark_block", stage_type="dark",
        image_shape=_IMG)),
    Sweep("deit", "DeiTBackbone", _classifier("DeiTBackbone", "DeiTImageClassifier", image_shape=_IMG, patch_size=8,
                                              num_layers=2, num_heads=4, hidden_dim=_w, intermediate_dim=_mlp)),
    Sweep("densenet", "DenseNetBackbone", _classifier("DenseNetBackbone", "DenseNetImageClassifier",
                                                      stackwise_num_repeats=[2, 2], growth_rate=8, image_shape=_IMG)),
    Sweep("dinov2", "DINOV2Backbone", _headed("DINOV2Backbone", patch_size=4, num_layers=2, hidden_dim=_w,
                                              num_heads=4, intermediate_dim=_mlp, image_shape=_IMG,
                                              position_embedding_shape=(IMAGE, IMAGE))),
    Sweep("dinov3", "DINOV3Backbone", _headed("DINOV3Backbone", patch_size=4, num_layers=2, hidden_dim=_w,
                                              num_heads=4, intermediate_dim=_mlp, image_shape=_IMG,
                                              num_register_tokens=0)),
    Sweep("efficientnet", "EfficientNetBackbone", _classifier(
        "EfficientNetBackbone", "EfficientNetImageClassifier", stackwise_width_coefficients=[1.0, 1.0],
        stackwise_depth_coefficients=[1.0, 1.0], stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1],
        stackwise_input_filters=[16, 16], stackwise_output_filters=[16, 24], stackwise_expansion_ratios=[1, 4],
        stackwise_squeeze_and_excite_ratios=[0.25, 0.25], stackwise_strides=[1, 2], stackwise_block_types=["v1", "v1"],
        stackwise_force_input_filters=[0, 0], stackwise_nores_option=[False, False], input_shape=_IMG,
        num_features=_w)),
    Sweep("hgnetv2", "HGNetV2Backbone", _classifier(
        "HGNetV2Backbone", "HGNetV2ImageClassifier", depths=[1, 1], embedding_size=16, hidden_sizes=[16, _w],
        stem_channels=[3, 8, 16], hidden_act="relu", use_learnable_affine_block=False,
        stackwise_stage_filters=[[16, 8, 16, 1, 2, 3], [16, 8, _w, 1, 2, 3]], apply_downsample=[False, True],
        use_lightweight_conv_block=[False, False], image_shape=_IMG)),
    Sweep("mit", "MiTBackbone", lambda w: _task("MiTImageClassifier", _mit(w), num_classes=CLASSES)),
    Sweep("mobilenet", "MobileNetBackbone", _classifier(
        "MobileNetBackbone", "MobileNetImageClassifier", stackwise_expansion=[[4], [4]],
        stackwise_num_blocks=[1, 1], stackwise_num_filters=[[16], [_w]], stackwise_kernel_size=[[3], [3]],
        stackwise_num_strides=[[2], [2]], stackwise_se_ratio=[[None], [0.25]],
        stackwise_activation=[["relu"], ["hard_swish"]], stackwise_padding=[[1], [1]], output_num_filters=_w,
        depthwise_filters=8, depthwise_stride=2, depthwise_residual=False, last_layer_filter=_w, image_shape=_IMG)),
    Sweep("resnet", "ResNetBackbone", lambda w: _task("ResNetImageClassifier", _resnet(w), num_classes=CLASSES)),
    Sweep("swin_transformer", "SwinTransformerBackbone", _classifier(
        "SwinTransformerBackbone", "SwinTransformerImageClassifier", image_shape=_IMG, embed_dim=16, depths=[2, 2],
        num_heads=[2, 4], window_size=4, patch_size=4)),
    Sweep("vgg", "VGGBackbone", lambda w: _task("VGGImageClassifier", _make(
        "VGGBackbone", stackwise_num_repeats=[1, 1], stackwise_num_filters=[8, w], image_shape=_IMG),
        num_classes=CLASSES, pooling_hidden_dim=w)),
    Sweep("vit", "ViTBackbone", _classifier("ViTBackbone", "ViTImageClassifier", image_shape=_IMG, patch_size=8,
                                            num_layers=2, num_heads=4, hidden_dim=_w, mlp_dim=_mlp)),
    Sweep("vit_det", "ViTDetBackbone", _headed("ViTDetBackbone", hidden_size=_w, num_layers=2, intermediate_dim=_mlp,
                                               num_heads=4, global_attention_layer_indices=[1], image_shape=_IMG,
                                               patch_size=4, num_output_channels=16, window_size=4)),
    Sweep("xception", "XceptionBackbone", _classifier(
        "XceptionBackbone", "XceptionImageClassifier", stackwise_conv_filters=[[8, 16], [32, 32], [_w, _w]],
        stackwise_pooling=[False, True, False], image_shape=_IMG)),
    Sweep("video_prism", "VideoPrismBackbone", _headed(
        "VideoPrismBackbone", num_frames=2, patch_size=8, hidden_dim=_w, intermediate_dim=_mlp, num_heads=4,
        num_spatial_layers=1, num_temporal_layers=1, num_auxiliary_layers=0, image_shape=_IMG)),
    # dense prediction and detection: the segmenter task where there is one, else a head on one feature map
    Sweep("segformer", "SegFormerBackbone", _segformer),
    Sweep("deeplab_v3", "DeepLabV3Backbone", _deeplab),
    Sweep("basnet", "BASNetBackbone", skip="not small: its prediction and refinement heads are fixed at up to 512 "
          "filters (49M parameters over the smallest ResNet encoder BASNet accepts), and its segmenter ends in "
          "sigmoids for a binary-mask loss"),
    Sweep("retinanet", "RetinaNetBackbone", _retinanet),
    Sweep("depth_anything", "DepthAnythingBackbone", _depth_anything),
    # multimodal
    Sweep("clip", "CLIPBackbone", _dual("CLIPVisionEncoder", "CLIPTextEncoder", "CLIPBackbone", projection_dim=_w),
          in_batch_labels=True),
    Sweep("metaclip_2", "MetaCLIP2Backbone", _dual("MetaCLIP2VisionEncoder", "MetaCLIP2TextEncoder",
                                                   "MetaCLIP2Backbone", projection_dim=_w), in_batch_labels=True),
    Sweep("siglip", "SigLIPBackbone", _dual("SigLIPVisionEncoder", "SigLIPTextEncoder", "SigLIPBackbone"), in_batch_labels=True),
    Sweep("pali_gemma", "PaliGemmaBackbone", lambda w: _task("PaliGemmaCausalLM", _make(
        "PaliGemmaBackbone", vocabulary_size=VOCAB, image_size=16, num_layers=2, num_query_heads=4,
        num_key_value_heads=1, hidden_dim=w, intermediate_dim=2 * w, head_dim=w // 4, vit_patch_size=4,
        vit_num_heads=2, vit_hidden_dim=16, vit_num_layers=1))),
    Sweep("parseq", "PARSeqBackbone", _parseq),
    Sweep("blip2", "BLIP2Backbone", skip="needs an OPT or Flan-T5 language model, a Q-Former and an EVA vision "
          "encoder built together (keras-hub documents it from presets only)"),
    Sweep("sam", "SAMBackbone", skip="its image encoder's relative-position tables and prompt encoder are sized "
          "for 1024x1024 images (keras-hub documents it from presets only)"),
    Sweep("sam3", "SAM3PromptableConceptBackbone", skip="six sub-models (vision, text, geometry, DETR encoder and "
          "decoder, mask decoder); keras-hub documents it from presets only"),
    Sweep("d_fine", "DFineBackbone", skip="an object detector whose step needs box labels and denoising queries "
          "(27 required arguments); keras-hub documents it from presets only"),
    Sweep("flux", "FluxBackbone", skip="a diffusion transformer trained through a text-to-image pipeline with "
          "CLIP and T5 encoders and a VAE (presets only)"),
    Sweep("stable_diffusion_3", "StableDiffusion3Backbone", skip="needs a VAE and CLIP-L/CLIP-G text encoders "
          "built together; keras-hub documents it from presets only"),
    Sweep("mobilenetv5", "MobileNetV5Backbone", skip="17 per-block argument lists (Gemma 3n's vision tower); "
          "keras-hub documents it from presets only"),
    Sweep("backbone", "Backbone", skip="the base class of every backbone, not a family"),
    Sweep("feature_pyramid", "FeaturePyramidBackbone", skip="the base class of the image backbones with "
          "pyramid outputs, not a family"),
    # tf_keras.applications at small input sizes, weights=None
    Sweep("tfk_resnet50", "tf_keras.applications.ResNet50", _tf_keras_app("ResNet50", 32), framework="tf_keras"),
    Sweep("tfk_efficientnetb0", "tf_keras.applications.EfficientNetB0", _tf_keras_app("EfficientNetB0", 32),
          framework="tf_keras"),
    Sweep("tfk_mobilenetv3small", "tf_keras.applications.MobileNetV3Small", _tf_keras_app("MobileNetV3Small", 32),
          framework="tf_keras"),
    Sweep("tfk_convnexttiny", "tf_keras.applications.ConvNeXtTiny", _tf_keras_app("ConvNeXtTiny", 32),
          framework="tf_keras"),
    Sweep("tfk_xception", "tf_keras.applications.Xception", _tf_keras_app("Xception", 71), framework="tf_keras"),
    Sweep("tfk_densenet121", "tf_keras.applications.DenseNet121", _tf_keras_app("DenseNet121", 32),
          framework="tf_keras"),
    Sweep("tfk_inceptionv3", "tf_keras.applications.InceptionV3", _tf_keras_app("InceptionV3", 75),
          framework="tf_keras"),
    Sweep("tfk_nasnetmobile", "tf_keras.applications.NASNetMobile", _tf_keras_app("NASNetMobile", 32),
          framework="tf_keras"),
]


def _smollm(name, w):
    return _make(name, vocabulary_size=VOCAB, hidden_dim=w, intermediate_dim=2 * w, num_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, attention_bias=False, attention_dropout=0.0,
                 rope_layer_enabled_list=[True, True], layer_types=["attention", "attention"], mlp_bias=False,
                 layer_norm_epsilon=1e-6, max_position_embeddings=32, rope_theta=10000.0, partial_rotary_factor=1.0)


def _t5gemma(w):
    layers = ["sliding_attention", "full_attention"]
    return dict(vocabulary_size=VOCAB, encoder_hidden_dim=w, encoder_intermediate_dim=2 * w, encoder_num_layers=2,
                encoder_num_attention_heads=4, encoder_num_key_value_heads=2, encoder_head_dim=w // 4,
                encoder_layer_types=layers, decoder_hidden_dim=w, decoder_intermediate_dim=2 * w,
                decoder_num_layers=2, decoder_num_attention_heads=4, decoder_num_key_value_heads=2,
                decoder_head_dim=w // 4, decoder_layer_types=layers, sliding_window=SEQ)


def without_random_masks(model):
    """``model`` with every ``Dropout`` layer's rate set to zero: some keras-hub layers build one at
    a fixed rate no constructor argument reaches (MiT's attention, so SegFormer: 0.1), and
    tf_keras' EfficientNet and MobileNetV3 end in one."""
    for layer in _sublayers(model):
        if type(layer).__name__ == "Dropout" and getattr(layer, "rate", 0):
            layer.rate = 0.0
    return model


def _sublayers(root):
    """Every layer reachable from ``root`` through its attributes, lists and dicts (public
    attributes only: no framework's private layer walk)."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "trainable_weights") and hasattr(obj, "call"):
            found.append(obj)
            stack.extend(v for v in vars(obj).values() if isinstance(v, (dict, list, tuple)) or
                         (hasattr(v, "trainable_weights") and hasattr(v, "call")))
    return found


def _masks_off(build):
    return None if build is None else (lambda w: without_random_masks(build(w)))


SWEEP = {entry.name: dataclasses.replace(entry, build=_masks_off(entry.build)) for entry in _SWEEP}


def keras_hub_backbones() -> list[str]:
    """Every ``*Backbone`` class keras-hub exports (what the sweep must cover)."""
    keras_hub = _hub()
    return sorted(n for n in dir(keras_hub.models) if n.endswith("Backbone"))


def _inputs(model):
    """``(structure, [(name, shape without batch, dtype)])`` of ``model``'s inputs: structure
    is "dict" (keyed by name), "list" or "single"."""
    spec = model.input
    if isinstance(spec, dict):
        return "dict", [(k, tuple(v.shape[1:]), str(v.dtype)) for k, v in spec.items()]
    if isinstance(spec, (list, tuple)):
        return "list", [(v.name, tuple(v.shape[1:]), str(v.dtype)) for v in spec]
    return "single", [(getattr(spec, "name", "x"), tuple(spec.shape[1:]), str(spec.dtype))]


def _dtype_name(dtype: str) -> str:
    return dtype.split("'")[1] if "'" in dtype else dtype.replace("tf.", "").replace("<dtype: ", "")


def features(entry: Sweep, model, samples: int, *, seed: int = 0):
    """Inputs for ``samples`` examples, drawn from ``model``'s Input specs: token ids in
    [1, VOCAB), masks all ones (``*mask*``), segment ids zero, float inputs normal; unknown
    dims from ``entry.shapes`` (per input name), else SEQ tokens."""
    rng = np.random.default_rng(seed)
    structure, specs = _inputs(model)
    values = []
    for name, shape, dtype in specs:
        dtype = _dtype_name(dtype)
        known = entry.shapes.get(name) or tuple(SEQ if d is None else d for d in shape)
        shape = (samples,) + tuple(known)
        if "mask" in name:
            values.append(np.ones(shape, "bool" if dtype == "bool" else dtype))
        elif "segment" in name:
            values.append(np.zeros(shape, dtype))
        elif dtype.startswith("int"):
            values.append(rng.integers(1, VOCAB, shape).astype(dtype))
        else:
            values.append(rng.normal(size=shape).astype(dtype))
    if structure == "dict":
        return {name: value for (name, _, _), value in zip(specs, values)}
    return values if structure == "list" else values[0]


def labels(output_shape, samples: int, *, seed: int = 0, in_batch: int = 0):
    """Integer labels for a logits output of ``output_shape`` (batch first, classes last):
    one class per position of every dim between; ``in_batch`` (a batch size): each example's
    own index in its batch (CLIP-style image-text logits, whose classes are the batch's texts)."""
    if in_batch:
        return (np.arange(samples) % in_batch).astype("int32")
    rng = np.random.default_rng(seed + 100)
    return rng.integers(0, output_shape[-1], (samples,) + tuple(output_shape[1:-1])).astype("int32")
