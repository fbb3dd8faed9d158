"""Normalizations: batch norm, softmax, cross-entropy. Each normalizes over a
set of dims with statistics computed *inside* its expression (a softmax's
denominator, a batch's mean and variance), so those dims are read whole and
never split; the other dims split freely.

Fused batch norm in training mode reads its batch statistics over N, H, W:
only channels split (a tf-keras LayerNormalization runs it with the tokens as
channels, so tokens split). In inference mode it is element-wise, and the
gradient's scale/offset parts become partial sums over the batch.
Reserve-space tensors whose captured shape is not ``[C]`` are backend
workspace: they follow the kernel, not the plan.
"""

from __future__ import annotations

from tofu_tf.semantics.family import Family
from tofu_tf.semantics.ops._util import data_format, names
from tofu_tf.semantics.tdl import WORKSPACE_OUTPUT, Apply, Out, Position, Program, Sum
from tofu_tf.semantics.view import OpView


def _bn_layout(op: OpView):
    fmt = data_format(op)
    x_shape = op.input_shapes[0]
    channels = x_shape[fmt.channel]
    idx_names = tuple(c.lower() for c in fmt.text)
    whole = lambda c: tuple(c if d == fmt.channel else slice(None) for d in range(len(fmt.text)))
    return fmt, channels, idx_names, whole


def batch_norm(op: OpView):
    """y[n, h, w, c] = (x[n, h, w, c] - mean_c) * rsqrt(var_c + eps) * scale[c] + offset[c]; training: mean_c, var_c from x[:, :, :, c]"""
    fmt, channels, idx_names, whole = _bn_layout(op)
    training = bool(op.attr("is_training", True))
    factor = op.attr("exponential_avg_factor", 1.0)
    is_stat = [s == (channels,) for s in op.input_shapes]
    out_stat = [s == (channels,) for s in op.output_shapes]

    def program(x, scale, offset, mean, var):
        ch = fmt.channel

        def y(*idx):
            c = idx[ch]
            if training:
                return Apply("batch_norm", x[idx], x[whole(c)], scale[c], offset[c])
            return Apply("batch_norm", x[idx], mean[c], var[c], scale[c], offset[c])

        def stat(source):
            def out(c):
                if not training:
                    return source[c]
                value = Apply("moment", x[whole(c)])
                if factor != 1.0 and is_stat[source.position]:
                    value = Apply("running", value, source[c])
                return value
            return out
        reserve = {3: mean, 4: var}  # reserve_space_1/2 hold the batch mean and variance
        outputs = [Out(y, idx_names), stat(mean), stat(var)]
        for k in range(3, op.num_outputs):
            # (in inference mode the kernel leaves them unset)
            outputs.append(stat(reserve[k]) if k in reserve and out_stat[k] and training else WORKSPACE_OUTPUT)
        return tuple(outputs)
    return program


def batch_norm_grad(op: OpView):
    """dx[n, h, w, c] = f(dy[n, h, w, c], x[n, h, w, c], dy[:, :, :, c], x[:, :, :, c], scale[c], stats[c]); dscale[c], doffset[c] = sum_{n, h, w} ...; inference mode: dx element-wise"""
    fmt, channels, idx_names, whole = _bn_layout(op)
    training = bool(op.attr("is_training", True))
    is_stat = [s == (channels,) for s in op.input_shapes]
    workspace = frozenset(p for p in range(3, op.num_inputs) if not is_stat[p])
    others = tuple(n for d, n in enumerate(idx_names) if d != fmt.channel)

    def program(dy, x, scale, r1, r2, *rest):
        ch = fmt.channel
        stats = lambda c: tuple(t[c] for t in (r1, r2) if is_stat[t.position])

        def around(c, body):
            def at(*o):
                idx = list(o)
                idx.insert(ch, c)
                return body(tuple(idx))
            return Sum(at, names=others)

        def dx(*idx):
            c = idx[ch]
            if training:
                return Apply("bn_grad", dy[idx], x[idx], dy[whole(c)], x[whole(c)], scale[c], *stats(c))
            return Apply("bn_grad", dy[idx], scale[c], *stats(c))

        def dscale(c):
            return around(c, lambda idx: dy[idx] * Apply("normalized", x[idx], *stats(c)))

        def doffset(c):
            return around(c, lambda idx: dy[idx])
        outputs = [Out(dx, idx_names), dscale, doffset]
        outputs += [WORKSPACE_OUTPUT] * (op.num_outputs - 3)
        return tuple(outputs)
    return Program(program, workspace=workspace)


def softmax(op: OpView):
    """out[i, j] = exp(x[i, j]) / sum_r exp(x[i, r]) (log of it for LogSoftmax): the sum is internal"""
    rank = len(op.output_shapes[0])

    def program(x):
        def out(*idx):
            total = Sum(lambda r: Apply("exp", x[idx[:-1] + (r,)]))
            return Apply(op.type, x[idx], total)
        return Out(out, names(rank, taken="r"))
    return program


def sparse_xent(op: OpView):
    """loss[b] = log sum_r exp(x[b, r]) - x[b, labels[b]]; grad[b, c] = softmax(x)[b, c] - (labels[b] == c)"""
    def program(logits, labels):
        def loss(b):
            return Apply("log", Sum(lambda r: Apply("exp", logits[b, r]))) - logits[b, labels[b]]

        def grad(b, c):
            return Apply("softmax", logits[b, c], Sum(lambda r: Apply("exp", logits[b, r]))) \
                - Apply("onehot", labels[b], Position(c))
        return loss, grad
    return program


def xent(op: OpView):
    """loss[b] = -sum_r labels[b, r] * log_softmax(x)[b, r]; grad[b, c] = softmax(x)[b, c] - labels[b, c]"""
    def program(features, labels):
        def log_softmax(b, r):
            return Apply("log_softmax", features[b, r], Sum(lambda s: Apply("exp", features[b, s])))

        def loss(b):
            return Sum(lambda r: -labels[b, r] * log_softmax(b, r))

        def grad(b, c):
            return Apply("softmax", features[b, c], Sum(lambda s: Apply("exp", features[b, s]))) - labels[b, c]
        return loss, grad
    return program


def register(registry) -> None:
    for op_type in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"):
        registry.register(op_type, family=Family.NORMALIZATION)(batch_norm)
    for op_type in ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"):
        registry.register(op_type, family=Family.NORMALIZATION)(batch_norm_grad)
    registry.register("Softmax", family=Family.NORMALIZATION)(softmax)
    registry.register("LogSoftmax", family=Family.NORMALIZATION)(softmax)
    registry.register("SparseSoftmaxCrossEntropyWithLogits", family=Family.NORMALIZATION)(sparse_xent)
    registry.register("SoftmaxCrossEntropyWithLogits", family=Family.NORMALIZATION)(xent)
