"""Liveness-based memory: tensors live from producer to last consumer."""

from tests.search_helpers import GraphBuilder

from tofu_tf import ir
from tofu_tf.cost.memory import Liveness


def _chain():
    b = GraphBuilder()
    x = b.input("x", (4, 4))                         # 64 B, op 0, used by op 1 and op 3
    a = b.op("a", "Relu", (x,), [(4, 4)])            # op 1, used by op 2
    c = b.op("c", "Relu", (a,), [(4, 4)])            # op 2, used by op 3
    i = b.op("i", "Identity", (c,), [(4, 4)])        # alias of c: costs nothing, extends c
    b.op("d", "AddV2", (x, i), [(4, 4)])             # op 4
    b.variables["w"] = ir.Variable("w", (8,), "float32", ir.VariableKind.WEIGHT)
    return b.build()


def test_peak_counts_live_values_and_persistent_state():
    graph = _chain()
    live = Liveness(graph)
    assert "i:0" not in live.names                   # aliases are not values of their own
    sizes = {n: graph.tensors[n].num_bytes for n in live.names}
    report = live.report(sizes, {"w": 32})
    # at op "c": x (until d), a (until c), c -> 3 x 64 B, plus the 32 B weight
    assert report.peak_bytes == 3 * 64 + 32
    assert report.weight_bytes == 32 and report.activation_bytes_at_peak == 192
    assert report.top_contributors[0][1] == 64


def test_sharded_bytes_lower_the_peak():
    graph = _chain()
    live = Liveness(graph)
    half = {n: graph.tensors[n].num_bytes / 2 for n in live.names}
    assert live.report(half, {"w": 16}).peak_bytes == 3 * 32 + 16
