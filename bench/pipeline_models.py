"""The models ``bench/pipeline_runs.py`` pipelines, importable by name so the profiling
subprocesses of ``layer_stats(profile=True)`` can rebuild them (a builder is pickled by reference)."""


def gpt_model():
    """A GPT whose embedding and head hold most parameters: parameter balance puts few blocks with them."""
    from tofu_tf import models
    return models.gpt(num_layers=6, d_model=128, num_heads=4, seq_len=64, vocab_size=8192)


def cnn_model():
    """A VGG-style CNN: convolutions with large activations, then a large dense head."""
    import tf_keras as keras
    layers = [keras.Input((64, 64, 3))]
    for group, width in enumerate((32, 64, 128, 128)):
        layers += [keras.layers.Conv2D(width, 3, padding="same", activation="relu", name=f"conv{group}_{i}")
                   for i in range(2)]
        layers.append(keras.layers.MaxPooling2D(2, name=f"pool{group}"))
    layers += [keras.layers.Flatten(name="flatten"), keras.layers.Dense(1024, activation="relu", name="fc1"),
               keras.layers.Dense(1024, activation="relu", name="fc2"), keras.layers.Dense(100, name="classifier")]
    return keras.Sequential(layers, name="vgg_head")
