"""The budgeted plan's local repair (``tofu_tf.search.repair``, issue #38 item 1).

Unit tests drive ``repair.repair`` on small hand-made axis problems with a pricing
function of their own, standing in for the step's cost model where it disagrees with the
problem (a conversion two readers share, priced once); the slow test is the issue's case."""

import numpy as np
import pytest

from tofu_tf.search import repair
from tofu_tf.search.problem import AxisDecision, AxisProblem, Edge, Node, Option
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, TensorSplit

SPLIT0, SPLIT1 = TensorSplit(0), TensorSplit(1)


def _node(name, strategies, memory=(0.0, 0.0), paths=(), var_splits=None):
    options = tuple(Option(s.name, (s,), None if var_splits is None else var_splits[k], 0.0, memory[k])
                    for k, s in enumerate(strategies))
    return Node(name, options, (name,), paths)


def _chain():
    """Three ops a -> b -> c, each "replicate" (option 0) or "split" (option 1) on dim 0.
    The problem prices a's and c's options alike and b's split 1 ms dearer: to it, every
    choice that keeps b whole ties."""
    whole, split = OpStrategy("replicate", (REPLICATED,), (REPLICATED,)), OpStrategy("i", (SPLIT0,), (SPLIT0,))
    nodes = tuple(_node(name, (whole, split), memory=(1.0, 4.0)) for name in "abc")
    unary = (np.zeros(2), np.array([0.0, 1e-3]), np.zeros(2))
    edges = (Edge(0, 1, np.zeros((2, 2))), Edge(1, 2, np.zeros((2, 2))))
    return AxisProblem(nodes, edges, unary, tuple(np.array([1.0, 4.0]) for _ in nodes))


class _Pricer:
    """A step whose price the problem does not see: 3 ms, less 1 ms where a is split (its
    conversion is one another reader makes already), less 1.5 ms where b is; its peak the
    sum of the chosen options' memory."""

    def __init__(self, problem):
        self.problem, self.calls = problem, 0

    def __call__(self, decisions):
        self.calls += 1
        split = {name for name, s in decisions[0].op_strategies.items() if s.name == "i"}
        seconds = 3e-3 - (1e-3 if "a" in split else 0.0) - (1.5e-3 if "b" in split else 0.0)
        peak = sum(4.0 if name in split else 1.0 for name in "abc")
        return _Cost(seconds, peak)


class _Cost:
    def __init__(self, seconds, peak):
        self.step_seconds, self.peak = seconds, peak


def _repair(problem, choice, budget, tolerance=1e-6):
    axis = repair.AxisChoice(problem, choice, 2, 0)
    pricer = _Pricer(problem)

    def better(new, old):
        return new.peak <= budget and new.step_seconds < old.step_seconds

    return repair.repair([axis], [axis.decision()], pricer([axis.decision()]), pricer, better, [tolerance]), pricer


def test_moves_the_problem_ties_are_priced_and_kept_where_the_step_gains():
    repaired, _ = _repair(_chain(), (0, 0, 0), budget=12.0)
    assert repaired.axes[0].choice == (1, 0, 0), repaired.axes[0].choice    # c's split gains nothing: not kept
    assert repaired.cost.step_seconds == pytest.approx(2e-3)
    assert repaired.moves == 1
    assert repaired.decisions[0].op_strategies["a"].name == "i"


def test_a_move_over_the_budget_is_not_kept():
    repaired, _ = _repair(_chain(), (0, 0, 0), budget=6.0)       # a split: peak 4 + 1 + 1
    assert repaired.axes[0].choice == (1, 0, 0) and repaired.cost.peak == 6.0
    repaired, _ = _repair(_chain(), (0, 0, 0), budget=5.0)
    assert repaired.moves == 0 and repaired.axes[0].choice == (0, 0, 0)


def test_moves_the_problem_prices_above_the_tolerance_are_not_priced():
    repaired, pricer = _repair(_chain(), (0, 0, 0), budget=12.0, tolerance=1e-6)
    assert repaired.axes[0].choice[1] == 0
    tied = pricer.calls
    repaired, pricer = _repair(_chain(), (0, 0, 0), budget=12.0, tolerance=1e-2)
    assert pricer.calls > tied      # b's split (1 ms dearer to the problem) is priced only under the wider tolerance
    assert repaired.axes[0].choice == (1, 1, 0) and repaired.cost.step_seconds == pytest.approx(0.5e-3)


def _linked(seconds, pairs=((0, 1), (1, 2))):
    """a, b, c joined by edges (``pairs``) that cost 1 ms where the two ends differ (one split,
    one whole), and a step priced by ``seconds(split names)`` plus that 1 ms per differing
    joined pair; peak as _Pricer's."""
    whole, split = OpStrategy("replicate", (REPLICATED,), (REPLICATED,)), OpStrategy("i", (SPLIT0,), (SPLIT0,))
    nodes = tuple(_node(name, (whole, split), memory=(1.0, 4.0)) for name in "abc")
    mismatch = np.array([[0.0, 1e-3], [1e-3, 0.0]])
    problem = AxisProblem(nodes, tuple(Edge(u, v, mismatch) for u, v in pairs), tuple(np.zeros(2) for _ in nodes),
                          tuple(np.array([1.0, 4.0]) for _ in nodes))

    def price(decisions):
        on = {name for name, s in decisions[0].op_strategies.items() if s.name == "i"}
        differ = sum(("abc"[u] in on) != ("abc"[v] in on) for u, v in pairs)
        return _Cost(seconds(on) + 1e-3 * differ, sum(4.0 if name in on else 1.0 for name in "abc"))
    return problem, price


def _better(budget):
    return lambda new, old: new.peak <= budget and new.step_seconds < old.step_seconds


def test_two_nodes_an_edge_joins_move_together_where_either_alone_breaks_it():
    problem, price = _linked(lambda on: 3e-3 - (2e-3 if {"a", "b"} <= on else 0.0), pairs=((0, 1),))
    axis = repair.AxisChoice(problem, (0, 0, 0), 2, 0)
    repaired = repair.repair([axis], [axis.decision()], price([axis.decision()]), price, _better(12.0), [1e-6])
    assert repaired.axes[0].choice == (1, 1, 0) and repaired.moves == 1


def test_the_nodes_a_faster_plan_differs_in_move_as_one_set():
    """All three must split to gain; no single or pair move keeps the edges whole, and the
    faster plan over the budget names the set."""
    problem, price = _linked(lambda on: 3e-3 - (2.5e-3 if {"a", "b", "c"} <= on else 0.0))
    axis = repair.AxisChoice(problem, (0, 0, 0), 2, 0)
    start = price([axis.decision()])
    alone = repair.repair([axis], [axis.decision()], start, price, _better(12.0), [1e-6])
    assert alone.moves == 0
    faster = repair.AxisChoice(problem, (1, 1, 1), 2, 0)
    repaired = repair.repair([axis], [axis.decision()], start, price, _better(12.0), [1e-6], toward=[faster])
    assert repaired.axes[0].choice == (1, 1, 1) and repaired.cost.step_seconds == pytest.approx(0.5e-3)
    # a plan of another problem (other earlier decisions) offers nothing
    other = repair.AxisChoice(_linked(lambda on: 0.0)[0], (1, 1, 1), 2, 0)
    assert repair.repair([axis], [axis.decision()], start, price, _better(12.0), [1e-6], toward=[other]).moves == 0


def test_a_move_never_splits_a_dim_another_axis_splits():
    """On a two-axis plan whose other axis already splits a's and c's dim 0, splitting them
    again would break DTensor's rule: those moves are not offered at all."""
    problem = _chain()
    other = AxisDecision.of(problem, (1, 1, 1), 2)
    moves = repair._moves([repair.AxisChoice(problem, (0, 0, 0), 2, 0)], [AxisDecision.of(problem, (0, 0, 0), 2),
                                                                           other], [1.0, 1.0])
    assert moves == []
    var_node = _node("w", (OpStrategy("read", (REPLICATED,), (REPLICATED,)), OpStrategy("read", (REPLICATED,),
                                                                                     (SPLIT1,))),
                     paths=("w",), var_splits=(REPLICATED, SPLIT1))
    assert repair._splits_a_dim_twice(var_node, 1, [AxisDecision(2, {}, {"w": SPLIT1})])
    assert not repair._splits_a_dim_twice(var_node, 1, [AxisDecision(2, {}, {"w": SPLIT0})])


@pytest.mark.slow   # captures the GPT with TensorFlow and runs HiGHS on one mesh
def test_the_budgeted_gpt_is_within_two_percent_of_the_ilp():
    """The issue's case: the 2-layer GPT at half its free peak. Tofu's search picked mesh
    2 x 2 x 2 at 0.2645 ms where the ILP on that mesh finds 0.2545 ms: the DP's plan makes
    one scalar all-reduce more, a tie to the per-axis problem (which prices the ids'
    all-gather once per reader, the step once per tensor). The repair finds the ILP's plan."""
    from tofu_tf import models
    from tofu_tf.search import plan_graph
    from tofu_tf.search.legality import check_plan
    from tofu_tf.tf.capture import capture_training_step
    graph = capture_training_step(models.gpt(num_layers=2, d_model=64, num_heads=4, seq_len=32, vocab_size=256),
                                  batch_size=16, loss="sparse_categorical_crossentropy", optimizer="adam")
    budget = int(plan_graph(graph, num_devices=8).peak_memory_bytes * 0.5)
    tofu = plan_graph(graph, num_devices=8, memory_budget_bytes=budget)
    check_plan(graph, tofu, num_devices=8)
    assert tofu.peak_memory_bytes <= budget
    ilp = plan_graph(graph, num_devices=8, memory_budget_bytes=budget, method="ilp", mesh_shape=(2, 2, 2))
    assert tofu.step_seconds <= 1.02 * ilp.step_seconds, (tofu.step_seconds, ilp.step_seconds)
