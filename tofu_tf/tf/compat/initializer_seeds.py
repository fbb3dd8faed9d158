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

This module owns only that seed choice; it draws nothing. Keras 3 initializers choose their
seed when they are constructed (``keras.src.initializers.random_initializers``): nothing to do.
"""

from __future__ import annotations

import functools

from tofu_tf.tf.compat.registry import change

_CHANGE = change("initializer_seed_pinned")
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
