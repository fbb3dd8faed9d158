"""Reference Keras models: the workloads of the Tofu paper and its successors.

Examples, benchmarks and tests build their models here so that "a 12-layer
GPT" means the same network everywhere. Each builder takes the Keras module to
build with (``tf_keras`` by default, or ``keras`` for Keras 3) and returns an
uncompiled, built model with a fixed input shape (the planner needs static
shapes). Sizes are arguments: tests use widths of 16-256, benches the paper's.
"""

from __future__ import annotations


def _keras(keras):
    if keras is None:
        import tf_keras
        return tf_keras
    return keras


def mlp(*, input_dim: int = 16, width: int = 64, depth: int = 2, num_classes: int = 10,
        batch_size: int | None = None, keras=None):
    """``depth`` x Dense(width, relu) + Dense(num_classes): the NOTES.md anchor at width 4096."""
    keras = _keras(keras)
    layers = [keras.Input((input_dim,), batch_size=batch_size)]
    layers += [keras.layers.Dense(width, activation="relu", name=f"dense_{i}") for i in range(depth)]
    layers.append(keras.layers.Dense(num_classes, name="head"))
    return keras.Sequential(layers, name="mlp")


def cnn(*, image_size: int = 16, channels: int = 8, num_classes: int = 10, keras=None):
    """Conv2D + BatchNormalization + pooling: the smallest network with every CNN op kind."""
    keras = _keras(keras)
    inputs = keras.Input((image_size, image_size, 3))
    x = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False, name="conv_0")(inputs)
    x = keras.layers.BatchNormalization(name="bn_0")(x)
    x = keras.layers.ReLU(name="relu_0")(x)
    x = keras.layers.MaxPooling2D(pool_size=2, name="pool_0")(x)
    x = keras.layers.Conv2D(2 * channels, 3, padding="same", name="conv_1")(x)
    x = keras.layers.AveragePooling2D(pool_size=2, name="pool_1")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    outputs = keras.layers.Dense(num_classes, name="head")(x)
    return keras.Model(inputs, outputs, name="cnn")


def wide_resnet(*, depth: int = 10, width: int = 2, image_size: int = 32, num_classes: int = 10,
                keras=None):
    """Wide ResNet (Zagoruyko & Komodakis), the CNN Tofu trains: ``depth = 6n + 4``,
    three groups of n basic blocks with 16*width, 32*width, 64*width channels."""
    keras = _keras(keras)
    if (depth - 4) % 6:
        raise ValueError(f"wide_resnet depth must be 6n + 4 (10, 16, 22, ...), got {depth}")
    blocks = (depth - 4) // 6
    inputs = keras.Input((image_size, image_size, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="stem")(inputs)
    for group, channels in enumerate((16 * width, 32 * width, 64 * width)):
        for block in range(blocks):
            stride = 2 if group > 0 and block == 0 else 1
            x = _wide_block(keras, x, channels, stride, f"g{group}b{block}")
    x = keras.layers.BatchNormalization(name="final_bn")(x)
    x = keras.layers.ReLU(name="final_relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    outputs = keras.layers.Dense(num_classes, name="head")(x)
    return keras.Model(inputs, outputs, name=f"wrn_{depth}_{width}")


def _wide_block(keras, x, channels, stride, name):
    shortcut = x
    y = keras.layers.BatchNormalization(name=f"{name}_bn1")(x)
    y = keras.layers.ReLU(name=f"{name}_relu1")(y)
    y = keras.layers.Conv2D(channels, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_conv1")(y)
    y = keras.layers.BatchNormalization(name=f"{name}_bn2")(y)
    y = keras.layers.ReLU(name=f"{name}_relu2")(y)
    y = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    if stride != 1 or shortcut.shape[-1] != channels:
        shortcut = keras.layers.Conv2D(channels, 1, strides=stride, use_bias=False, name=f"{name}_proj")(x)
    return keras.layers.Add(name=f"{name}_add")([y, shortcut])


def rnn(*, num_layers: int = 2, hidden: int = 32, seq_len: int = 8, input_dim: int = 16,
        num_classes: int = 10, cell: str = "lstm", unroll: bool = False, keras=None):
    """A stack of LSTM (or GRU) layers, Tofu's RNN workload, with a Dense head."""
    keras = _keras(keras)
    layer_class = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU}.get(cell)
    if layer_class is None:
        raise ValueError(f"cell must be 'lstm' or 'gru', got {cell!r}")
    inputs = keras.Input((seq_len, input_dim))
    x = inputs
    for i in range(num_layers):
        x = layer_class(hidden, return_sequences=i < num_layers - 1, unroll=unroll, name=f"{cell}_{i}")(x)
    outputs = keras.layers.Dense(num_classes, name="head")(x)
    return keras.Model(inputs, outputs, name=f"{cell}_stack")


def gpt(*, num_layers: int = 2, d_model: int = 64, num_heads: int = 4, seq_len: int = 16,
        vocab_size: int = 128, dropout: float = 0.0, keras=None):
    """A GPT-style decoder: token + position embeddings, pre-LayerNorm blocks of
    causal MultiHeadAttention and a 4x MLP, a final LayerNorm and an LM head.
    Labels are next-token ids (sparse categorical cross-entropy)."""
    keras = _keras(keras)
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab_size, d_model, name="token_embedding")(tokens)
    x = _PositionEmbedding(keras)(seq_len, d_model)(x)
    for i in range(num_layers):
        x = _gpt_block(keras, x, d_model, num_heads, dropout, f"block_{i}")
    x = keras.layers.LayerNormalization(name="final_ln")(x)
    logits = keras.layers.Dense(vocab_size, name="lm_head")(x)
    return keras.Model(tokens, logits, name=f"gpt_{num_layers}")


def _gpt_block(keras, x, d_model, num_heads, dropout, name):
    h = keras.layers.LayerNormalization(name=f"{name}_ln1")(x)
    h = keras.layers.MultiHeadAttention(num_heads, d_model // num_heads, dropout=dropout, name=f"{name}_attn")(
        h, h, use_causal_mask=True)
    x = keras.layers.Add(name=f"{name}_res1")([x, h])
    h = keras.layers.LayerNormalization(name=f"{name}_ln2")(x)
    h = keras.layers.Dense(4 * d_model, activation="gelu", name=f"{name}_mlp_in")(h)
    h = keras.layers.Dense(d_model, name=f"{name}_mlp_out")(h)
    if dropout:
        h = keras.layers.Dropout(dropout, name=f"{name}_drop")(h)
    return keras.layers.Add(name=f"{name}_res2")([x, h])


def _PositionEmbedding(keras):
    """A learned position embedding added to the token embedding (one class per Keras module)."""

    class PositionEmbedding(keras.layers.Layer):
        def __init__(self, seq_len, d_model, name="position_embedding", **kwargs):
            super().__init__(name=name, **kwargs)
            self.seq_len, self.d_model = seq_len, d_model

        def get_config(self):
            # Rebuilt from its config by clone_model (the numerics check's one-device copy).
            return {**super().get_config(), "seq_len": self.seq_len, "d_model": self.d_model}

        def build(self, input_shape):
            self.positions = self.add_weight(name="positions", shape=(self.seq_len, self.d_model),
                                             initializer="random_normal", trainable=True)
            super().build(input_shape)

        def call(self, x):
            return x + self.positions

    return PositionEmbedding
