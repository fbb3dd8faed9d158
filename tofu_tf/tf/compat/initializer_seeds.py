"""tf-keras initializers' seeds fixed when their variable is created, as one device fixes them.

An unseeded tf-keras initializer (``GlorotUniform()``, every Dense kernel's default) takes its
seed at its first call (``RandomGenerator._maybe_init``: from the generator
``keras.utils.set_random_seed`` installs, else from Python's ``random``). On one device that first
call is the variable's creation, so the seeds follow the order in which the model creates its
weights. Under TofuStrategy a variable is created without a value
(``tofu_tf.tf.variables.DeferredVariable``) and its initializer runs later, at a read before the
plan or at the plan, in whatever order those come: a user reading the second layer's kernel first
gave it the seed one device gives the first kernel. ``pin_seed`` makes the first call's seed choice
at the variable's creation (the change "initializer_seed_pinned"), so the seed is one device's
whatever the order of reads; the initializer later draws from it (``tofu_tf.tf.initial_values``).

A Keras 3 initializer chooses an integer seed when it is constructed
(``keras.src.initializers.random_initializers``): nothing to do. One seeded with a
``keras.random.SeedGenerator`` object instead draws ``generator.next()`` at each call, which
advances the generator: on one device, at the variable's creation, so the variables sharing a
generator take its states in creation order. ``pin_generator_state`` takes that state at the
creation too (the change "seed_generator_state_pinned") and binds the deferred draw to it.

This module owns only those seed choices; it draws nothing.
"""

from __future__ import annotations

import copy
import functools

import numpy as np

from tofu_tf.tf import keras_adapter
from tofu_tf.tf.compat.registry import change

_CHANGE = change("initializer_seed_pinned")
_GENERATOR_CHANGE = change("seed_generator_state_pinned")
_TF_KERAS_GENERATOR = ("tf_keras.src.backend", "RandomGenerator")


def pin_seed(initial_value) -> bool:
    """Fix the seed of the tf-keras initializer ``initial_value`` is bound to
    (``functools.partial(initializer, shape, dtype=...)``, as tf-keras' ``add_weight`` passes
    it), as its first call on one device fixes it; whether there was one to fix. A seeded
    initializer keeps its seed; one already called keeps the seed it took then."""
    initializer = initial_value.func if isinstance(initial_value, functools.partial) else None
    generator = getattr(initializer, "_random_generator", None)  # pylint: disable=protected-access
    if generator is None or not any((kind.__module__, kind.__name__) == _TF_KERAS_GENERATOR
                                    for kind in type(generator).__mro__):
        return False
    generator._maybe_init()  # pylint: disable=protected-access
    return True


# Keras 3 initializers whose call draws once from their seed (``random.normal``,
# ``truncated_normal`` or ``uniform``), subclasses included (Glorot, He, LeCun): one
# ``generator.next()`` per call, so the state a call takes is known before it draws.
_ONE_DRAW_INITIALIZERS = ("RandomNormal", "TruncatedNormal", "RandomUniform", "VarianceScaling",
                          "Orthogonal", "OrthogonalInitializer")


def _one_draw(initializer) -> bool:
    from keras.src.initializers import random_initializers
    return any(kind.__module__ == random_initializers.__name__ and kind.__name__ in _ONE_DRAW_INITIALIZERS
               for kind in type(initializer).__mro__)


def pin_generator_state(initial_value):
    """The Keras 3 deferred initial value ``initial_value`` with its ``SeedGenerator`` seed's
    state taken now, as one device's creation takes it; ``initial_value`` itself where its
    initializer has no generator seed. ``None`` where the initializer is not one whose draws
    are known to take one state (a user's own ``RandomInitializer``): the caller then draws
    the value now, on the host, which advances the generator exactly as one device does."""
    call = keras_adapter.keras3_initializer_call(initial_value)
    if call is None or call[0] is None:
        return initial_value
    initializer, shape, dtype = call
    from keras.src.random import seed_generator
    generator = getattr(initializer, "seed", None)
    if not isinstance(generator, seed_generator.SeedGenerator):
        return initial_value
    if not _one_draw(initializer):
        return None
    pinned = copy.copy(initializer)
    pinned.seed = _state_replay_class()(np.asarray(generator.next()))
    return lambda: pinned(shape, dtype=dtype)


@functools.cache
def _state_replay_class():
    """A ``SeedGenerator`` (Keras' ``draw_seed`` accepts no other object) that starts from a
    given state and advances as an ordered generator does, holding no variable of its own."""
    from keras.src import backend
    from keras.src.random import seed_generator

    class StateReplay(seed_generator.SeedGenerator):
        def __init__(self, state: np.ndarray):  # pylint: disable=super-init-not-called
            self._replay_state = state

        def next(self, ordered=True):
            del ordered                      # an initializer's generator is an ordered one
            value = self._replay_state
            self._replay_state = value + np.array([0, 1], dtype=value.dtype)
            return backend.convert_to_tensor(value, dtype=backend.random_seed_dtype())

    return StateReplay
