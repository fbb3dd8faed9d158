"""The ``Family`` of an op's description: what kind of computation it is.

A leaf module (it imports nothing from tofu_tf) because both sides of the
registry need it: the builtin descriptions in ``tofu_tf.semantics.ops`` tag
each op type with its family when they register it, and the registry
(``tofu_tf.semantics.registry``) stores the tag and filters by it. Were the
enum defined in the registry, which also loads the builtin descriptions, the
two would import each other.
"""

from __future__ import annotations

import enum


class Family(enum.Enum):
    """The kind of description an op has; tests and docs group ops by it."""

    ELEMENTWISE = "elementwise"      # out[i..] = f(x[i..], ...) with broadcasting
    REDUCTION = "reduction"          # out[i..] = sum/max/mean_k x[i.., k]
    CONTRACTION = "contraction"      # einsum-like: matmul, batched matmul, einsum
    WINDOW = "window"                # convolution and pooling: output index -> input range
    NORMALIZATION = "normalization"  # batch norm, softmax, cross-entropy
    GATHER = "gather"                # data-dependent coordinates: lookups, segment sums
    LAYOUT = "layout"                # reshape, transpose, concat, slice, pad, tile
    VARIABLE = "variable"            # resource reads and updates, element-wise on the value
    SHAPE = "shape"                  # read only static shapes
    GENERATOR = "generator"          # fill / random / fed values: every part makes its block
    REPLICATED = "replicated"        # run whole: constants, loops, tensor lists, no-ops
    CUSTOM = "custom"                # registered by a user
