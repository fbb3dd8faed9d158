"""Small helpers the builtin descriptions share: index names, numpy
broadcasting, data formats and convolution windows. No op knowledge here."""

from __future__ import annotations

import dataclasses

from tofu_tf.semantics.language import DescriptionError, replicated
from tofu_tf.semantics.tdl import default_names
from tofu_tf.semantics.view import OpView


def names(rank: int, taken: str = "") -> tuple[str, ...]:
    return default_names(rank, taken)


def suffixed(rank: int, k: int, taken: str = "") -> tuple[str, ...]:
    """Index names of tensor ``k`` of several with unrelated shapes: i0, j0 ..."""
    return tuple(f"{n}{k}" for n in default_names(rank, taken))


def broadcast(idx, shape, out_shape):
    """The coordinates of an operand of ``shape`` at output ``idx`` under numpy
    broadcasting: leading dims dropped, size-1 dims read at 0."""
    lead = len(out_shape) - len(shape)
    return tuple(0 if (s == 1 and out_shape[lead + d] != 1) else idx[lead + d] for d, s in enumerate(shape))


def conservative(op: OpView, reason: str):
    """Replicated description for an op whose metadata is not static."""
    return replicated(op.num_inputs, op.num_outputs, reason,
                      input_shapes=[s or () for s in op.input_shapes],
                      output_shapes=[s or () for s in op.output_shapes])


def normalize_axis(axis, rank: int, op: OpView) -> int:
    if not isinstance(axis, int) or not -max(rank, 1) <= axis < max(rank, 1):
        raise DescriptionError(f"{op.type}: axis {axis!r} is out of range for rank {rank}")
    return axis % max(rank, 1)


def as_tuple(value) -> tuple | None:
    if value is None:
        return None
    return value if isinstance(value, tuple) else (value,)


# -- data formats ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Format:
    """Where batch, spatial and channel dims sit in a tensor (``NHWC``, ``NCHW`` ...)."""

    text: str

    @property
    def channel(self) -> int:
        return self.text.index("C")

    @property
    def spatial(self) -> tuple[int, ...]:
        return tuple(d for d, c in enumerate(self.text) if c not in "NC")

    def place(self, n, spatial, c) -> tuple:
        """A tuple in this format's order from batch, spatial and channel items."""
        out = [None] * len(self.text)
        out[self.text.index("N")] = n
        out[self.channel] = c
        for d, value in zip(self.spatial, spatial):
            out[d] = value
        return tuple(out)

    def split(self, items) -> tuple:
        """Inverse of ``place``: (batch, spatial tuple, channel)."""
        items = tuple(items)
        return items[self.text.index("N")], tuple(items[d] for d in self.spatial), items[self.channel]


def data_format(op: OpView, default: str = "NHWC") -> Format:
    fmt = op.attr("data_format", default) or default
    if fmt not in ("NHWC", "NCHW", "NDHWC", "NCDHW", "NWC", "NCW"):
        raise DescriptionError(f"{op.type}: data_format {fmt!r} is not supported")
    return Format(fmt)


# -- windows --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Window:
    """One spatial dim of a convolution or pooling: input coordinate
    ``out * stride + k * dilation - pad`` for window offset ``k``."""

    kernel: int
    stride: int
    dilation: int
    pad: int

    def at(self, out, k):
        return out * self.stride + k * self.dilation - self.pad


def windows(op: OpView, fmt: Format, in_spatial, out_spatial, kernel) -> tuple[Window, ...]:
    """The windows of each spatial dim from the op's strides, dilations and padding."""
    rank = len(fmt.text)
    strides = op.attr("strides") or (1,) * rank
    dilations = op.attr("dilations") or (1,) * rank
    padding = op.attr("padding", "VALID")
    explicit = op.attr("explicit_paddings") or ()
    out = []
    for j, d in enumerate(fmt.spatial):
        s, dil, k = int(strides[d]), int(dilations[d]), int(kernel[j])
        if padding == "SAME":
            total = max((out_spatial[j] - 1) * s + (k - 1) * dil + 1 - in_spatial[j], 0)
            pad = total // 2
        elif padding == "VALID":
            pad = 0
        elif padding == "EXPLICIT" and len(explicit) == 2 * rank:
            pad = int(explicit[2 * d])
        else:
            raise DescriptionError(f"{op.type}: padding {padding!r} is not supported")
        out.append(Window(k, s, dil, pad))
    return tuple(out)
