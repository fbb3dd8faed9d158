"""The models ``bench/vs_mirrored.py`` and ``bench/executed.py`` measure, by name: the reference
models of ``tofu_tf.models`` at sizes where the choice of plan shows, and the keras-hub families of
``tofu_tf.hub_models`` (small configurations, random weights), each with its data."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

HUB_WIDTH = 64


@dataclasses.dataclass(frozen=True)
class Model:
    """A model to measure: how to build it (called inside a strategy's scope) and its data."""
    name: str
    build: object            # () -> keras.Model, not compiled
    data: object             # (samples) -> (x, y) numpy arrays


_GROUP_KEY_BASES = itertools.count(7_000_000, 100_000)


def mirrored_strategy(devices):
    """``tf.distribute.MirroredStrategy`` over ``devices`` whose collectives take group keys no
    other program of the process does. Every MirroredStrategy numbers its collective groups from 1,
    and the runtime keeps a key's group size for the process: after another program gathered over
    4 devices under key 1, an 8-replica all-gather under key 1 is refused ("joining a group with
    size 8, but that group has size 4"), and the refusal poisons the process's later collectives
    (tests/test_compared_models.py met it). Each strategy made here numbers its groups from a base
    of its own (``_collective_key_base``, which MirroredStrategy reads from its class)."""
    import tensorflow as tf

    class OwnGroupKeysMirroredStrategy(tf.distribute.MirroredStrategy):
        _collective_key_base = next(_GROUP_KEY_BASES)

    return OwnGroupKeysMirroredStrategy(devices)


def _classes(x, n=10):
    import numpy as np
    return x, np.random.default_rng(1).integers(0, n, size=(len(x),)).astype("int32")


def _tokens(n, seq_len, vocab):
    import numpy as np
    tokens = np.random.default_rng(0).integers(0, vocab, size=(n, seq_len)).astype("int32")
    return tokens, np.roll(tokens, -1, axis=1)


def _normal(*shape):
    import numpy as np
    return np.random.default_rng(0).normal(size=shape).astype("float32")


def reference_models() -> dict:
    from tofu_tf import models
    return {
        # A 2 x 1024 MLP: sharding it pays on 8 CPUs.
        "mlp": Model("mlp", lambda: models.mlp(input_dim=256, width=1024, depth=2),
                     lambda n: _classes(_normal(n, 256))),
        # A small conv net with batch normalization.
        "cnn": Model("cnn", lambda: models.cnn(image_size=16, channels=8),
                     lambda n: _classes(_normal(n, 16, 16, 3))),
        "gpt": Model("gpt", lambda: models.gpt(num_layers=2, seq_len=32, vocab_size=256),
                     lambda n: _tokens(n, 32, 256)),
    }


def hub_models() -> dict:
    from tofu_tf import hub_models as hub
    return {name: Model(name, lambda family=family: family.build(HUB_WIDTH),
                        lambda n, family=family: hub.data(family, n))
            for name, family in hub.FAMILIES.items()}


def all_models() -> dict:
    return {**reference_models(), **hub_models()}


def compile_for_training(model, optimizer="adam"):
    """Compiles ``model`` with its own Keras (tf-keras for the reference models, Keras 3 for
    keras-hub's) and a sparse cross-entropy on logits; returns that Keras module."""
    import keras
    import tf_keras
    api = tf_keras if isinstance(model, tf_keras.Model) else keras
    model.compile(optimizer=optimizer, loss=api.losses.SparseCategoricalCrossentropy(from_logits=True))
    return api


def synchronize_batch_norms(model) -> int:
    """Makes every BatchNormalization layer of ``model`` (tf-keras or Keras 3) compute its batch
    statistics over the global batch, as one device and TofuStrategy do; returns how many.

    MirroredStrategy's default normalizes each replica's batch by its own statistics: a
    different, cheaper step (no all-reduce in the forward and backward passes). Comparing step
    times is fair only against the same computation, ``synchronized=True``. tf-keras decides
    whether to use its fused kernel when the layer is built, and the fused kernel has no
    synchronized form, so it is turned off too (as tf-keras's constructor does)."""
    from tofu_tf.tf.keras_adapter import layer_paths
    count = 0
    for _, layer in layer_paths(model):
        if "BatchNormalization" in type(layer).__name__ and hasattr(layer, "synchronized"):
            layer.synchronized = True
            if getattr(layer, "fused", False):
                layer.fused = False
            count += 1
    return count


def load_balancing_modules(model) -> list:
    """The keras-hub modules whose ``compute_load_balancing_loss`` a layer of ``model`` calls (the
    mixture-of-experts decoders of Mixtral and the Qwen MoE families)."""
    import sys
    from tofu_tf.tf.keras_adapter import layer_paths
    modules = {}
    for _, layer in layer_paths(model):
        module = sys.modules.get(type(layer).__module__)
        if module is not None and callable(getattr(module, "compute_load_balancing_loss", None)):
            modules[module.__name__] = module
    return list(modules.values())


@contextlib.contextmanager
def global_load_balancing(model):
    """While inside, the load-balancing loss of ``model``'s mixture-of-experts layers is computed
    over the global batch under MirroredStrategy, as one device and TofuStrategy compute it.

    keras-hub's loss multiplies the fraction of tokens routed to each expert by the mean router
    probability of that expert, both means over the batch's tokens: under MirroredStrategy each
    replica takes them over its own tokens, a different step (and cheaper: no collective in the
    forward pass), the analogue of an unsynchronized BatchNormalization. Here each replica
    all-gathers the router logits and the mask over the replicas and calls keras-hub's own function
    on the global batch (the gradient of ``all_gather`` hands each replica its slice back). The
    patch must hold while the training step is traced (``fit``), and is undone on leaving."""
    import tensorflow as tf
    patched = []

    def gathered(original):
        def compute_load_balancing_loss(router_logits, num_experts, top_k, attention_mask=None):
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                return original(router_logits, num_experts, top_k, attention_mask)
            router_logits = context.all_gather(router_logits, axis=0)
            if attention_mask is not None:
                attention_mask = context.all_gather(attention_mask, axis=0)
            return original(router_logits, num_experts, top_k, attention_mask)
        return compute_load_balancing_loss

    try:
        for module in load_balancing_modules(model):
            original = module.compute_load_balancing_loss
            patched.append((module, original))
            module.compute_load_balancing_loss = gathered(original)
        yield len(patched)
    finally:
        for module, original in patched:
            module.compute_load_balancing_loss = original
