"""Stateless random draws inside a strategy step, drawn as one device draws them.

A custom ``train_step`` draws its own random tensors: keras.io's GAN samples its latent vectors
and label noise with ``keras.random.normal(..., seed=self.seed_generator)``, which Keras 3's
TensorFlow backend draws with ``tf.random.stateless_normal``; a tf-keras step writes
``tf.random.stateless_normal(shape, seed)`` itself. DTensor gives such an op the layout its
consumers ask for, and with a split layout it folds each device's mesh coordinates into the seed
(TF 2.21), so the latents a batch-split generator received were other numbers than one device
draws from the same seed, and training left one device's path at the first step. While a strategy
step runs (``strategy.run``), on that thread, TensorFlow's stateless draws (``tf.random.
stateless_normal``, ``stateless_uniform``, ``stateless_truncated_normal``, ``stateless_categorical``,
``stateless_gamma``, ``stateless_binomial``, ``stateless_poisson``) relay their result to a
replicated layout on the strategy's mesh right after the draw (the change
``stateless_draws_replicated``): DTensor then draws the whole tensor unsplit, from the seed as
given, and the ops after it split it as their layouts ask. The values are one device's; each device
holds the whole draw (a batch of latents). ``tf.nn.experimental.stateless_dropout`` (Keras 3's
``keras.random.dropout``, and tf-keras Dropout under the strategy: ``tofu_tf.tf.compat.layers``)
draws its uniform noise inside TensorFlow; it is replaced likewise by the same computation
(TensorFlow's own ``general_dropout``) with the noise drawn replicated, so a mask is one device's
for the seed whatever the plan splits the dropped tensor by; each device holds the whole mask for a
moment (one activation's noise) before its slice is taken. A Keras 3 ``SeedGenerator`` made
outside ``strategy.scope()`` holds its state on the host, where each device's part of the step
advanced it once per draw (the seed moved 8 steps a draw on 8 devices, and the draws were not one
device's): its ``next`` moves that state onto the mesh, replicated, before drawing. Stateful draws (``tf.random.normal``) have no DTensor layout propagation at
all; the planner refuses them before the first step (``tofu_tf.search.targets``). Other threads
draw as TensorFlow does.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.ops import stateless_random_ops

from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change

DRAWS = ("stateless_normal", "stateless_uniform", "stateless_truncated_normal", "stateless_categorical",
         "stateless_gamma", "stateless_binomial", "stateless_poisson")


def _tf_random(name: str):
    return lambda: (tf.random, name)


def _seed_generator_next():
    from keras.src.random import seed_generator
    return seed_generator.SeedGenerator, "next"


_CHANGE = change("stateless_draws_replicated")
_PATCHES = tuple(patching.ThreadScopedPatch(_CHANGE, _tf_random(name)) for name in DRAWS)
_DROPOUT = patching.ThreadScopedPatch(_CHANGE, lambda: (tf.nn.experimental, "stateless_dropout"))
_SEED_NEXT = patching.ThreadScopedPatch(_CHANGE, _seed_generator_next)


@contextlib.contextmanager
def draws_replicated(mesh: dtensor.Mesh) -> Iterator[None]:
    """While active, on this thread, stateless random draws in a traced step are laid out
    replicated on ``mesh`` (see the module docstring)."""
    def replicated(original, *args, **kwargs):
        value = original(*args, **kwargs)
        if tf.executing_eagerly() or not tf.is_tensor(value) or value.shape.rank is None:
            return value
        return dtensor.relayout(value, dtensor.Layout.replicated(mesh, rank=value.shape.rank))

    def dropout(original, x, rate, seed, rng_alg=None, noise_shape=None, name=None):
        rank = getattr(getattr(x, "shape", None), "rank", None)
        if tf.executing_eagerly() or rank is None:
            return original(x, rate, seed, rng_alg=rng_alg, noise_shape=noise_shape, name=name)

        def uniform_noise(shape, dtype):       # what stateless_dropout draws, from the same seed, unsplit
            noise = stateless_random_ops.stateless_random_uniform(shape, seed=seed, dtype=dtype, alg=rng_alg)
            return dtensor.relayout(noise, dtensor.Layout.replicated(mesh, rank=rank))
        return tf.nn.experimental.general_dropout(x, rate, uniform_noise, noise_shape=noise_shape,
                                                  name=name or "stateless_dropout")

    def next_on_mesh(original, generator, *args, **kwargs):
        # A generator made outside the scope holds its state on the host: each device would
        # advance it (and read it) once per draw. Moved onto the mesh, it advances once.
        if not tf.executing_eagerly():
            variables_lib.host_variable_on_mesh(generator.state, mesh)
        return original(generator, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        for patch in _PATCHES:
            stack.enter_context(patch.active(replicated))
        stack.enter_context(_DROPOUT.active(dropout))
        stack.enter_context(_SEED_NEXT.active(next_on_mesh))
        yield
