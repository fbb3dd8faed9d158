"""keras-hub models from small configurations, with data shaped as their users pass it.

The tests and ``bench/zoo.py`` train these beside one device. Each family is
built the way keras-hub's documentation builds it, from a config with random
weights (no download): the task models (``GPT2CausalLM``, ``GemmaCausalLM``,
``BertTextClassifier``, ``ViTImageClassifier``, ``Qwen3MoeCausalLM``,
``Qwen3_5MoeCausalLM``) with ``preprocessor=None`` on
numpy dict inputs, and the Llama, Mistral, Mixtral and T5 backbones with a
vocabulary head on the backbone's own dict inputs. keras-hub is imported when
a builder runs (it is a test and bench dependency, not the library's).

Dropout is off (GPT-2, BERT, its classifier head and T5 default to 0.1): under a sharded layout
DTensor folds each device's coordinates into a random op's seed, so masks are
independent draws at the rate, not one device's masks, and a comparison with
one device would compare different random steps.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

VOCAB = 64          # token ids and head width
SEQ = 8             # sequence length of the data (the backbones declare Input((None,)))
CLASSES = 4


@dataclasses.dataclass(frozen=True)
class Family:
    """One keras-hub model family: how to build it and what its data looks like."""

    name: str
    build: Callable[[], object]
    inputs: tuple[str, ...]            # dict keys of the model's inputs ("images": one array)
    labels: str                        # "tokens" (one id per position) or "classes"


def _hub():
    import keras_hub
    return keras_hub


def _with_head(backbone, output_key=None):
    """``keras.Model(backbone.input, head(backbone.output))``: a vocabulary head on a backbone."""
    import keras
    hidden = backbone.output if output_key is None else backbone.output[output_key]
    return keras.Model(backbone.input, keras.layers.Dense(VOCAB, name="lm_head")(hidden), name=f"{backbone.name}_lm")


def gpt2(width: int = 32):
    backbone = _hub().models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=width,
                                          intermediate_dim=2 * width, max_sequence_length=16, dropout=0.0)
    return _hub().models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def gemma(width: int = 32):
    backbone = _hub().models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                           num_key_value_heads=1, hidden_dim=width, intermediate_dim=2 * width,
                                           head_dim=width // 4)
    return _hub().models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def bert(width: int = 32):
    backbone = _hub().models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=width,
                                          intermediate_dim=2 * width, max_sequence_length=16, dropout=0.0)
    return _hub().models.BertTextClassifier(backbone=backbone, num_classes=CLASSES, preprocessor=None, dropout=0.0)


def vit(width: int = 32):
    backbone = _hub().models.ViTBackbone(image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=4,
                                         hidden_dim=width, mlp_dim=2 * width)
    return _hub().models.ViTImageClassifier(backbone=backbone, num_classes=CLASSES, preprocessor=None)


def llama(width: int = 32):
    return _with_head(_hub().models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                                  num_key_value_heads=2, hidden_dim=width,
                                                  intermediate_dim=2 * width))


def mistral(width: int = 32):
    return _with_head(_hub().models.MistralBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                                    num_key_value_heads=2, hidden_dim=width,
                                                    intermediate_dim=2 * width, sliding_window=SEQ))


def mixtral(width: int = 32):
    return _with_head(_hub().models.MixtralBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                                    num_key_value_heads=2, hidden_dim=width,
                                                    intermediate_dim=2 * width, num_experts=4, top_k=2,
                                                    sliding_window=SEQ))


def qwen3_moe(width: int = 32):
    """Qwen3-MoE: a router picks 2 of 4 experts per token (top_k, one_hot), an expert bank
    of einsums over the stacked experts' kernels."""
    backbone = _hub().models.Qwen3MoeBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=2, head_dim=width // 4, hidden_dim=width,
                                              intermediate_dim=2 * width, moe_intermediate_dim=width,
                                              num_experts=4, top_k=2)
    return _hub().models.Qwen3MoeCausalLM(backbone=backbone, preprocessor=None)


def qwen3_5_moe(width: int = 32):
    """Qwen3.5-MoE: a linear-attention layer (a gated delta net: a causal depthwise convolution
    through ``keras.ops.depthwise_conv`` and a chunked delta rule adding ``keras.ops.eye(64)``)
    and a full-attention one, each with a routed MoE (2 of 4 experts) and a shared expert."""
    backbone = _hub().models.Qwen3_5MoeBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2, head_dim=width // 4,
        hidden_dim=width, moe_intermediate_dim=width, shared_expert_intermediate_size=width, num_experts=4, top_k=2,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8)
    return _hub().models.Qwen3_5MoeCausalLM(backbone=backbone, preprocessor=None)


def t5(width: int = 32):
    backbone = _hub().models.T5Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=width,
                                        intermediate_dim=2 * width, key_value_dim=width // 4, dropout=0.0)
    return _with_head(backbone, "decoder_sequence_output")


_TOKENS = ("token_ids", "padding_mask")
FAMILIES = {family.name: family for family in (
    Family("gpt2", gpt2, _TOKENS, "tokens"),
    Family("gemma", gemma, _TOKENS, "tokens"),
    Family("bert", bert, ("token_ids", "segment_ids", "padding_mask"), "classes"),
    Family("vit", vit, ("images",), "classes"),
    Family("llama", llama, _TOKENS, "tokens"),
    Family("mistral", mistral, _TOKENS, "tokens"),
    Family("mixtral", mixtral, _TOKENS, "tokens"),
    Family("qwen3_moe", qwen3_moe, _TOKENS, "tokens"),
    Family("qwen3_5_moe", qwen3_5_moe, _TOKENS, "tokens"),
    Family("t5", t5, ("encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask"),
           "tokens"),
)}


def data(family: Family, samples: int, *, seed: int = 0):
    """``(x, y)`` numpy data for ``family``: a dict of int32 token arrays (masks all ones,
    segments zero) or an image array, and token or class labels."""
    rng = np.random.default_rng(seed)
    if family.inputs == ("images",):
        x = rng.normal(size=(samples, 16, 16, 3)).astype("float32")
    else:
        x = {}
        for key in family.inputs:
            if key.endswith("padding_mask"):
                x[key] = np.ones((samples, SEQ), "int32")
            elif key == "segment_ids":
                x[key] = np.zeros((samples, SEQ), "int32")
            else:
                x[key] = rng.integers(1, VOCAB, (samples, SEQ)).astype("int32")
    shape = (samples, SEQ) if family.labels == "tokens" else (samples,)
    y = rng.integers(0, VOCAB if family.labels == "tokens" else CLASSES, shape).astype("int32")
    return x, y
