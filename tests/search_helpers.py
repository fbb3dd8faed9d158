"""Test helpers for the search: a small strategy provider and random graphs.

The real provider is ``tofu_tf.semantics.strategies``; the search takes the
provider as a parameter, so tests can run on synthetic graphs with this stub,
which knows MatMul, Einsum, element-wise ops, BiasAdd(Grad), Sum/Mean and
sparse softmax cross-entropy, and replicates everything else.

The search, cost and fold tests import it; it holds no tests (hence not a
``test_*.py`` name, which pytest would collect).
"""

from __future__ import annotations

from tofu_tf import ir
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, Reduction, TensorSplit, replicate_all

ELEMENTWISE = frozenset({
    "Relu", "ReluGrad", "AddV2", "Add", "Sub", "Mul", "RealDiv", "Sqrt", "Square", "Neg", "Exp", "Log",
    "Tanh", "Sigmoid", "Cast", "Minimum", "Maximum", "SelectV2", "GreaterEqual", "LessEqual", "Erfc",
    "Pow", "Reciprocal", "AddN", "SquaredDifference", "Rsqrt", "TanhGrad", "SigmoidGrad", "BiasAdd",
    "Identity", "Softmax", "MatrixBandPart", "Erf"})
P_SUM = TensorSplit(partial=Reduction.SUM)


def stub_strategies(op: ir.Op, graph: ir.Graph, n: int) -> list[OpStrategy]:
    tensors = graph.tensors
    ins = [tensors.get(t) for t in op.inputs]
    outs = [tensors[t] for t in op.outputs]
    found = [replicate_all(len(ins), len(outs))]
    rule = {"MatMul": _matmul, "Einsum": _einsum, "BiasAddGrad": _bias_add_grad, "Sum": _reduce,
            "Mean": _reduce, "SparseSoftmaxCrossEntropyWithLogits": _xent}.get(op.type)
    if rule is None and op.type in ELEMENTWISE:
        rule = _elementwise
    if rule is not None and outs:
        for strategy in rule(op, ins, outs):
            if _divides(strategy, ins, outs, n) and strategy not in found:
                found.append(strategy)
    return found


def _divides(strategy, ins, outs, n) -> bool:
    for tensor, split in list(zip(ins, strategy.inputs)) + list(zip(outs, strategy.outputs)):
        if split.dim is not None and (tensor is None or tensor.shape[split.dim] % n):
            return False
    return True


def _split(dim):
    return REPLICATED if dim is None else TensorSplit(dim)


def _matmul(op, ins, outs):
    ta, tb = op.attrs.get("transpose_a", False), op.attrs.get("transpose_b", False)
    a_i, a_k = (1, 0) if ta else (0, 1)
    b_k, b_j = (1, 0) if tb else (0, 1)
    yield OpStrategy("i", (_split(a_i), REPLICATED), (TensorSplit(0),))
    yield OpStrategy("j", (REPLICATED, _split(b_j)), (TensorSplit(1),))
    yield OpStrategy("k(reduce)", (_split(a_k), _split(b_k)), (P_SUM,))


def _einsum(op, ins, outs):
    equation = op.attrs.get("equation", "")
    if "->" not in equation or "." in equation:
        return
    lhs, out = equation.split("->")
    operands = lhs.split(",")
    for letter in sorted(set("".join(operands))):
        in_splits = tuple(_split(o.index(letter) if letter in o else None) for o in operands)
        out_split = TensorSplit(out.index(letter)) if letter in out else P_SUM
        yield OpStrategy(letter if letter in out else f"{letter}(reduce)", in_splits, (out_split,))


def _elementwise(op, ins, outs):
    out = outs[0]
    for d in range(out.rank):
        in_splits = []
        for t in ins:
            if t is None or not t.rank:
                in_splits.append(REPLICATED)
                continue
            dd = d - (out.rank - t.rank)
            in_splits.append(TensorSplit(dd) if dd >= 0 and t.shape[dd] == out.shape[d] else REPLICATED)
        yield OpStrategy(f"d{d}", tuple(in_splits), tuple(TensorSplit(d) if o.rank == out.rank else REPLICATED
                                                           for o in outs))


def _bias_add_grad(op, ins, outs):
    x = ins[0]
    for d in range(x.rank):
        yield OpStrategy(f"d{d}", (TensorSplit(d),), (TensorSplit(0) if d == x.rank - 1 else P_SUM,))


def _reduce(op, ins, outs):
    x, axes_t = ins[0], ins[1] if len(ins) > 1 else None
    axes = axes_t.const_value if axes_t is not None else None
    if axes is None or op.attrs.get("keep_dims", False):
        return
    axes = {a % x.rank for a in ((axes,) if isinstance(axes, int) else axes)}
    kept = [d for d in range(x.rank) if d not in axes]
    for d in range(x.rank):
        out = P_SUM if d in axes else TensorSplit(kept.index(d))
        if d in axes and op.type == "Mean":
            continue
        yield OpStrategy(f"d{d}", (TensorSplit(d), REPLICATED), (out,))


def _xent(op, ins, outs):
    yield OpStrategy("batch", (TensorSplit(0), TensorSplit(0)), (TensorSplit(0), TensorSplit(0)))


# -- synthetic graphs ---------------------------------------------------------

class GraphBuilder:
    """Builds small training-step-like IR graphs by hand."""

    def __init__(self, batch: int = 8):
        self.ops, self.tensors, self.variables, self.batch = [], {}, {}, batch

    def tensor(self, name, shape, role=ir.Role.ACTIVATION, producer="", variable_path=None, dtype="float32",
               const_value=None):
        self.tensors[name] = ir.Tensor(name, tuple(shape), dtype, role, producer, variable_path=variable_path,
                                       const_value=const_value)
        return name

    def op(self, name, type_, inputs, out_shapes, *, attrs=None, layer=None, role=ir.Role.ACTIVATION,
           variable_path=None):
        outputs = tuple(self.tensor(f"{name}:{i}", s, role, name, variable_path) for i, s in enumerate(out_shapes))
        self.ops.append(ir.Op(name, type_, tuple(inputs), outputs, attrs or {}, layer=layer))
        return outputs[0] if len(outputs) == 1 else outputs

    def input(self, name, shape):
        out = f"{name}:0"
        self.tensors[out] = ir.Tensor(out, tuple(shape), "float32", ir.Role.INPUT, name)
        self.ops.append(ir.Op(name, "Placeholder", (), (out,)))
        return out

    def weight(self, path, shape, layer, slots=("m", "v")):
        """A trainable weight with Adam-like slots; returns the read tensor."""
        self.variables[path] = ir.Variable(path, tuple(shape), "float32", ir.VariableKind.WEIGHT, trainable=True)
        for slot in slots:
            spath = f"opt/{slot}/{path}"
            self.variables[spath] = ir.Variable(spath, tuple(shape), "float32", ir.VariableKind.OPTIMIZER_SLOT,
                                                slot_of=path, slot_name=slot)
        handle = self.tensor(f"{path}/handle", (), ir.Role.RESOURCE, "", path, dtype="resource")
        del handle
        return self.op(f"{path}/read", "ReadVariableOp", (f"{path}/handle",), [shape], layer=layer,
                       role=ir.Role.WEIGHT, variable_path=path)

    def update(self, path, grad):
        """SGD-with-momentum-like update: m = m + g; w -= m (element-wise, outside layers)."""
        shape = self.variables[path].shape
        for slot in ("m", "v"):
            spath = f"opt/{slot}/{path}"
            if spath not in self.variables:
                continue
            h = self.tensor(f"{spath}/handle", (), ir.Role.RESOURCE, "", spath, dtype="resource")
            read = self.op(f"{spath}/read", "ReadVariableOp", (h,), [shape], role=ir.Role.OPTIMIZER_SLOT,
                           variable_path=spath)
            new = self.op(f"{spath}/add", "AddV2", (read, grad), [shape])
            self.op(f"{spath}/assign", "AssignVariableOp", (h, new), [])
        step = self.op(f"{path}/step", "Mul", (grad, grad), [shape])
        self.op(f"{path}/assign", "AssignSubVariableOp", (f"{path}/handle", step), [])

    def build(self, gradients: dict | None = None) -> ir.Graph:
        consumers = {}
        for op in self.ops:
            for t in op.inputs:
                consumers.setdefault(t, []).append(op.name)
        tensors = {}
        for name, t in self.tensors.items():
            role = ir.Role.GRADIENT if gradients and name in gradients else t.role
            path = gradients[name] if gradients and name in gradients else t.variable_path
            tensors[name] = ir.Tensor(t.name, t.shape, t.dtype, role, t.producer, tuple(consumers.get(name, ())),
                                      path, t.const_value)
        variables = dict(self.variables)
        for name, path in (gradients or {}).items():
            v = variables[path]
            variables[path] = ir.Variable(v.path, v.shape, v.dtype, v.kind, v.trainable, name, v.slot_of, v.slot_name)
        return ir.Graph(tuple(self.ops), tensors, variables, batch_size=self.batch, framework="synthetic")


def mlp_graph(batch=8, widths=(16, 32, 32, 8), *, reshaped_gradients=False) -> ir.Graph:
    """Forward, backward and update of a ReLU MLP, shaped like a captured step
    (backward ops named ``gradient_tape/<forward op>/...`` as TF's tape names them).
    ``reshaped_gradients``: each kernel gradient reaches the optimizer through two reshapes
    (flat and back), as an einsum's does through ``BroadcastGradientArgs``."""
    b = GraphBuilder(batch)
    x = b.input("x", (batch, widths[0]))
    acts, kernels = [x], []
    for i, (w_in, w_out) in enumerate(zip(widths, widths[1:])):
        layer = f"dense_{i}"
        k = b.weight(f"{layer}/kernel", (w_in, w_out), layer)
        kernels.append(k)
        h = b.op(f"{layer}/matmul", "MatMul", (acts[-1], k), [(batch, w_out)], layer=layer)
        if i < len(widths) - 2:
            h = b.op(f"{layer}/relu", "Relu", (h,), [(batch, w_out)], layer=layer)
        acts.append(h)
    grad = b.op("gradient_tape/loss/grad", "Mul", (acts[-1], acts[-1]), [(batch, widths[-1])])
    gradients = {}
    for i in range(len(widths) - 2, -1, -1):
        layer = f"dense_{i}"
        if i < len(widths) - 2:
            grad = b.op(f"gradient_tape/{layer}/relu/grad", "ReluGrad", (grad, acts[i + 1]), [(batch, widths[i + 1])],
                        layer=layer)
        dk = b.op(f"gradient_tape/{layer}/matmul/grad_k", "MatMul", (acts[i], grad), [(widths[i], widths[i + 1])],
                  attrs={"transpose_a": True}, layer=layer)
        if reshaped_gradients:
            flat = b.op(f"gradient_tape/{layer}/matmul/flat", "Reshape", (dk,), [(widths[i] * widths[i + 1],)],
                        layer=layer)
            dk = b.op(f"gradient_tape/{layer}/matmul/shaped", "Reshape", (flat,), [(widths[i], widths[i + 1])],
                      layer=layer)
        gradients[dk] = f"{layer}/kernel"
        if i > 0:
            grad = b.op(f"gradient_tape/{layer}/matmul/grad_x", "MatMul", (grad, kernels[i]), [(batch, widths[i])],
                        attrs={"transpose_b": True}, layer=layer)
    for dk, path in gradients.items():
        b.update(path, dk)
    return b.build(gradients)
