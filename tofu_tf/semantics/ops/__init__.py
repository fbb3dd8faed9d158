"""The builtin operator descriptions, one module per description family.

``register_builtin_ops(registry)`` is the only way they enter a registry:
nothing registers on import.
"""

from __future__ import annotations

from tofu_tf.semantics.ops import contraction, elementwise, gather, layout, normalization, reduction, state, window

_FAMILIES = (elementwise, reduction, contraction, window, normalization, gather, layout, state)


def register_builtin_ops(registry) -> None:
    """Register every builtin op type into ``registry`` (raises if one is already there)."""
    for module in _FAMILIES:
        module.register(registry)
