"""What TensorFlow's DTensor can lay out, op type by op type: a table derived by probing.

This module owns reading ``dtensor_support.json`` (beside it), which
``bench/dtensor_support.py`` derives: every op type the semantics registry describes, and
the programs the keras-hub sweep met that it does not describe, each run as a one-op DTensor
program replicated and in the batch-split layout the planner gives it, in a child process
(a segfault is an outcome, not the end of the probe). It imports no TensorFlow: the planner
reads the facts, ``tofu_tf.search.targets`` decides with them, and
``tests/test_dtensor_support.py`` probes again and fails when TensorFlow changes one.

Why a table and not a list written by hand: the hand-written list missed ops DTensor
refuses (``TensorListStack``, ``DepthwiseConv2dNativeBackpropFilter``, ``BatchMatMulV3``),
and those failed inside the first step with DTensor's own ``UnknownError`` instead of a
refusal naming the layer.

Outcomes (per layout): ``ok``; ``no_layout_propagation`` (DTensor has no rule for the op;
``refuses`` names the op); ``error`` (another refusal, its text in ``detail``); ``wrong``
(it ran, and its value differs from one device's); ``crash`` (the process died every time);
``intermittent`` (it died in some runs only); ``n/a`` (nothing to probe in that layout).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Mapping

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dtensor_support.json")
# Outcomes that mean DTensor cannot run the op in that layout.
FAILING = frozenset({"no_layout_propagation", "error", "wrong", "crash"})


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one probe gave: ``outcome`` (see the module docstring), the op DTensor named
    (``refuses``) and DTensor's text (``detail``)."""

    outcome: str
    refuses: str | None = None
    detail: str = ""

    @property
    def fails(self) -> bool:
        return self.outcome in FAILING


@dataclasses.dataclass(frozen=True)
class SupportTable:
    """The probed table: TensorFlow's version it was derived on, and per key (an op type, or a
    sweep program's name) its outcome per layout (``"replicated"``, ``"batch"``)."""

    tensorflow: str
    layouts: tuple[str, ...]
    sweep: tuple[str, ...]
    ops: Mapping[str, Mapping[str, Outcome]]

    def refused_in_every_layout(self) -> frozenset[str]:
        """Op types DTensor cannot run even replicated: the probed op type itself, or the op a
        sweep program's refusal named."""
        refused = set()
        for key, outcomes in self.ops.items():
            replicated = outcomes.get("replicated")
            if replicated is not None and replicated.fails:
                refused.add(replicated.refuses or key.split(" ")[0])
        return frozenset(refused)

    def refused_when_batch_split(self) -> frozenset[str]:
        """Op types DTensor runs replicated but not in the batch-split layout the planner gives."""
        out = set()
        for key, outcomes in self.ops.items():
            replicated, batch = outcomes.get("replicated"), outcomes.get("batch")
            if replicated is not None and batch is not None and not replicated.fails and batch.fails \
                    and key not in self.sweep:
                out.add(key)
        return frozenset(out)

    def outcome(self, op_type: str, layout: str = "replicated") -> Outcome | None:
        """The outcome probed for ``op_type`` in ``layout`` (None: not probed)."""
        return self.ops.get(op_type, {}).get(layout)


def parse(data: dict) -> SupportTable:
    """A ``SupportTable`` from the JSON ``bench/dtensor_support.py`` writes."""
    ops = {key: {layout: Outcome(o["outcome"], o.get("refuses"), o.get("detail", "")) for layout, o in per.items()}
           for key, per in data["ops"].items()}
    return SupportTable(data["tensorflow"], tuple(data["layouts"]), tuple(data.get("sweep", ())), ops)


@functools.lru_cache(maxsize=1)
def load() -> SupportTable:
    """The checked-in table (read once)."""
    with open(TABLE_PATH, encoding="utf-8") as handle:
        return parse(json.load(handle))


__all__ = ("Outcome", "SupportTable", "FAILING", "TABLE_PATH", "parse", "load")
