"""Coverage of real training steps: every op of the captured train-step graphs
of the reference workloads (forward, backward, Adam and SGD updates, loop
bodies) has a description, and the descriptions hold on the ops as captured
(their real attributes and shapes), checked against TF as in
``test_semantics_ops``. Graphs are captured once per module.

Beside tofu_tf's own models the workloads include tf_keras.applications
(DenseNet121's concatenations bring ConcatOffset into the gradient) and a
Keras 3 mixture-of-experts router shaped like keras-hub's Mixtral (top-k,
one-hot and scatter ops), at small inputs so capture stays quick; the larger
applications are captured by their own test, outside the shared captures.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tofu_tf
from tofu_tf import models, semantics
from tofu_tf.semantics import Family, Position, Prod, Use
from tofu_tf.semantics.view import view_key

from tests.test_semantics_ops import Case, check_case

LOSS = "sparse_categorical_crossentropy"
_WORKLOADS = {
    "mlp-adam": (lambda: models.mlp(), 8, "adam"),
    "mlp-sgd": (lambda: models.mlp(), 8, "sgd"),
    "cnn": (lambda: models.cnn(), 4, "adam"),
    "lstm": (lambda: models.rnn(cell="lstm"), 4, "adam"),
    "gru": (lambda: models.rnn(cell="gru"), 4, "sgd"),
    "transformer": (lambda: models.gpt(dropout=0.1), 4, "adam"),
    "resnet50": (lambda: tf_keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10), 2,
                 "adam"),
    "mobilenetv2": (lambda: tf_keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10),
                    2, "sgd"),
    "moe-router-keras3": (lambda: _moe_router(), 2, "adam"),
}
# Larger graphs, each captured by its own test so the module's shared captures stay quick.
_APPLICATIONS = {
    "densenet121": tf_keras.applications.DenseNet121,
    "efficientnetb0": tf_keras.applications.EfficientNetB0,
}


class _TopKRouter(keras.layers.Layer):
    """Routing weights of each token over all experts from its top-k router
    probabilities, spread twice: by ``tf.one_hot`` of the chosen experts, and by
    ``tf.scatter_nd`` at (token, expert) coordinates, so both lookups and their
    gradients are in the step. (TensorFlow's own ``one_hot``: Keras 3's
    ``ops.one_hot``, which keras-hub's Mixtral calls, is traced as an equality, as
    the strategy's step runs it: ``tofu_tf.tf.compat.keras_ops``.)"""

    def __init__(self, experts: int, k: int, **kwargs):
        super().__init__(**kwargs)
        self.experts, self.k = experts, k

    def call(self, logits):
        ops = keras.ops
        tokens = ops.shape(logits)[0]
        top_p, top_i = ops.top_k(ops.softmax(logits, axis=-1), k=self.k)
        top_p = top_p / ops.sum(top_p, axis=-1, keepdims=True)
        by_one_hot = ops.sum(tf.one_hot(top_i, self.experts) * top_p[..., None], axis=1)
        rows = ops.broadcast_to(ops.arange(tokens)[:, None], (tokens, self.k))
        by_scatter = tf.scatter_nd(ops.stack([rows, top_i], axis=-1), top_p, (tokens, self.experts))
        return by_one_hot + by_scatter


def _moe_router(tokens=4, hidden=8, experts=4, k=2, classes=10):
    """A Keras 3 mixture of experts over flattened tokens: a router picks each
    token's experts, whose outputs are mixed by the routing weights."""
    ops = keras.ops
    x = keras.Input((tokens, hidden))
    flat = ops.reshape(x, (-1, hidden))
    weights = _TopKRouter(experts, k)(keras.layers.Dense(experts, use_bias=False)(flat))
    expert_out = ops.reshape(keras.layers.Dense(experts * hidden)(flat), (-1, experts, hidden))
    mixed = ops.reshape(ops.sum(expert_out * weights[..., None], axis=1), (-1, tokens * hidden))
    return keras.Model(x, keras.layers.Dense(classes, activation="softmax")(mixed))


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name, (build, batch, optimizer) in _WORKLOADS.items():
        out[name] = tofu_tf.capture_training_step(build(), batch_size=batch, loss=LOSS, optimizer=optimizer)
        tf_keras.backend.clear_session()
    return out


def _walk(graph):
    for op in graph.ops:
        yield op, graph
        if op.body is not None:
            yield from _walk(op.body)


def test_the_reference_workloads_have_no_unsupported_op(graphs):
    for name, graph in graphs.items():
        report = semantics.coverage(graph)
        assert report.unsupported == {}, f"{name}:\n{report}"
        assert report.total == sum(graph.op_type_counts().values())


@pytest.mark.slow   # captures whole Keras applications (DenseNet-121, EfficientNet-B0)
@pytest.mark.parametrize("name", sorted(_APPLICATIONS))
def test_tf_keras_applications_have_no_unsupported_op(name):
    model = _APPLICATIONS[name](weights=None, input_shape=(32, 32, 3), classes=10)
    graph = tofu_tf.capture_training_step(model, batch_size=2, loss=LOSS, optimizer="adam")
    tf_keras.backend.clear_session()
    report = semantics.coverage(graph)
    assert report.unsupported == {}, f"{name}:\n{report}"
    if name == "densenet121":
        assert report.counts["ConcatOffset"] > 0  # the gradient of each dense block's concatenation
    # the gradients of concatenation and padding slice at begins computed in the step: still splittable
    slices = [op for op in graph.ops if op.type == "Slice"]
    assert slices and all(semantics.describe(op, graph).replicated is None for op in slices)


def test_the_workloads_use_the_op_kinds_the_issue_lists(graphs):
    types = set()
    for graph in graphs.values():
        types |= set(graph.op_type_counts())
    expected = {"MatMul", "Conv2D", "Conv2DBackpropFilter", "FusedBatchNormV3", "FusedBatchNormGradV3", "MaxPool",
                "AvgPool", "StatelessWhile", "TensorListGetItem", "Einsum", "Softmax", "ResourceGather",
                "RandomUniform", "DepthwiseConv2dNative", "AssignSubVariableOp", "AssignVariableOp", "ReadVariableOp",
                "TopKV2", "OneHot", "ScatterNd", "GatherNd"}
    assert expected <= types


def _case_from(op, graph, registry, rng) -> Case | None:
    """The op as captured, with random values (constants where the graph knows them)."""
    semantics_of = registry.get(op.type)
    if semantics_of is None or semantics_of.family in (Family.REPLICATED, Family.GENERATOR) or op.body is not None:
        return None
    if any(d.use is Use.WORKSPACE for d in registry.describe(op, graph).inputs):
        return None  # checked with real reserve tensors in test_semantics_ops
    inputs, variables = [], set()
    for k, name in enumerate(op.inputs):
        t = graph.tensors.get(name)
        if t is None:
            return None
        if t.dtype == "resource":
            var = graph.variables.get(t.variable_path)
            if var is None:
                return None
            inputs.append(rng.uniform(0.1, 0.9, var.shape).astype(var.dtype))
            variables.add(k)
        elif t.dtype in ("float32", "float64"):
            inputs.append(rng.uniform(0.1, 0.9, t.shape).astype(t.dtype))
        elif t.dtype == "bool":
            inputs.append(rng.random(t.shape) < 0.5)
        elif t.const_value is not None and t.dtype in ("int32", "int64"):
            inputs.append(np.array(t.const_value, dtype=t.dtype).reshape(t.shape))
        else:
            return None  # integer data (labels, token ids) the graph does not know: see test_semantics_ops
    return Case(op.type, tuple(inputs), dict(op.attrs), frozenset(variables), num_parts=2)


def test_descriptions_hold_on_the_ops_as_captured(graphs):
    registry = semantics.default_registry()
    rng = np.random.default_rng(0)
    seen, per_type, checked = set(), {}, 0
    for graph in graphs.values():
        for op, owner in _walk(graph):
            key = view_key(op, owner)
            if key in seen or per_type.get(op.type, 0) >= 3:
                continue
            seen.add(key)
            case = _case_from(op, owner, registry, rng)
            if case is None:
                continue
            per_type[op.type] = per_type.get(op.type, 0) + 1
            check_case(case)
            checked += 1
    assert checked > 100 and len(per_type) > 40


def test_a_custom_op_is_reported_until_registered():
    x = tf_keras.Input((6, 4), batch_size=None)
    y = tf_keras.layers.Lambda(lambda t: tf.math.cumprod(t, axis=1), name="cumprod")(x)
    model = tf_keras.Model(x, tf_keras.layers.Dense(3)(tf_keras.layers.Flatten()(y)))
    graph = tofu_tf.capture_training_step(model, batch_size=4, loss=LOSS, optimizer="sgd")
    registry = semantics.Registry()
    semantics.register_builtin_ops(registry)
    report = semantics.coverage(graph, registry)
    assert report.unsupported == {"Cumprod": 1}
    assert "Cumprod" in str(report)

    # out[b, t, d] = prod_{s <= t} x[b, s, d]: the scanned axis depends on global positions
    @registry.register("Cumprod")
    def cumprod(op):
        axis = op.value(1) % len(op.output_shapes[0])

        def program(x, axis_tensor):
            def out(*idx):
                return Prod(lambda s: Position(s, idx[axis], args=(x[idx[:axis] + (s,) + idx[axis + 1:]],)))
            return semantics.Out(out, ("b", "t", "d"))
        return program

    assert semantics.coverage(graph, registry).complete
    op = next(o for o in graph.ops if o.type == "Cumprod")
    assert [s.name for s in registry.strategies(op, graph, 2)] == ["replicate", "b", "d"]
    check_case(Case("Cumprod", (np.random.rand(4, 6, 4).astype("float32"), np.array(1, np.int32)), {}),
               registry=registry)
