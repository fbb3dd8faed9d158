"""The description language: golden one-line texts of builtin descriptions,
the index-lambda front end and its errors. No TensorFlow."""

import functools

import pytest

from tofu_tf import semantics
from tofu_tf.semantics import OpView, Sum, Where
from tofu_tf.semantics.language import Affine, Digit
from tofu_tf.semantics.tdl import Ix, Max, Position, Program, trace

V = OpView.build
I32 = "int32"


def _int_view(op_type, shapes, values, out, **kw):
    dtypes = ["float32"] + [I32] * (len(shapes) - 1)
    return V(op_type, input_shapes=shapes, input_values=[None] + list(values), input_dtypes=dtypes,
             output_shapes=out, **kw)


GOLDEN = [
    (V("MatMul", input_shapes=[(8, 8), (8, 16)], output_shapes=[(8, 16)]),
     "([i, k],[k, j])->([i, j]) {i=8, j=16, k=8} sum(k)"),
    (V("MatMul", attrs={"transpose_a": True, "transpose_b": True}, input_shapes=[(8, 4), (16, 8)],
       output_shapes=[(4, 16)]),
     "([k, i],[j, k])->([i, j]) {i=4, j=16, k=8} sum(k)"),
    (V("BatchMatMulV2", attrs={"adj_y": True}, input_shapes=[(2, 1, 4, 8), (3, 16, 8)], output_shapes=[(2, 3, 4, 16)]),
     "([l, 0, i, k],[m, j, k])->([l, m, i, j]) {l=2, m=3, i=4, j=16, k=8} sum(k)"),
    (V("Einsum", attrs={"equation": "abc,cde->abde"}, input_shapes=[(8, 64, 256), (256, 8, 32)],
       output_shapes=[(8, 64, 8, 32)]),
     "([a, b, c],[c, d, e])->([a, b, d, e]) {a=8, b=64, d=8, e=32, c=256} sum(c)"),
    (V("AddV2", input_shapes=[(8, 1), (10,)], output_shapes=[(8, 10)]),
     "([i, 0],[j])->([i, j]) {i=8, j=10}"),
    (V("BiasAdd", attrs={"data_format": "NCHW"}, input_shapes=[(2, 8, 4, 4), (8,)], output_shapes=[(2, 8, 4, 4)]),
     "([i, j, k, l],[j])->([i, j, k, l]) {i=2, j=8, k=4, l=4}"),
    (_int_view("Sum", [(8, 64, 256), (2,)], [(0, 1)], [(1, 1, 256)], attrs={"keep_dims": True}),
     "([r0, r1, k],#)->([0, 0, k]) {k=256, r0=8, r1=64} sum(r0,r1)"),
    (_int_view("Mean", [(4, 4, 4, 16), (2,)], [(1, 2)], [(4, 16)]),
     "([i, r0, r1, j],#)->([i, j]) {i=4, j=16, r0=4, r1=4} mean(r0,r1)"),
    (V("Softmax", input_shapes=[(4, 10)], output_shapes=[(4, 10)]),
     "([i, r]|[i, j])->([i, j]) {i=4, j=10, r=10} fixed(r)"),
    (V("SparseSoftmaxCrossEntropyWithLogits", input_shapes=[(8, 10), (8,)], input_dtypes=["float32", "int64"],
       output_shapes=[(8,), (8, 10)]),
     "([b, r]|[b, $1[b]]|[b, c],[b])->([b],[b, c]) {b=8, c=10, r=10} fixed(c,r)"),
    (V("Conv2D", attrs={"strides": (1, 1, 1, 1), "padding": "SAME", "data_format": "NHWC"},
       input_shapes=[(4, 16, 16, 3), (3, 3, 3, 8)], output_shapes=[(4, 16, 16, 8)]),
     "([n, h+r-1, w+q-1, c],[r, q, c, o])->([n, h, w, o]) {n=4, h=16, w=16, o=8, r=3, q=3, c=3} sum(r,q,c)"),
    (V("Conv2D", attrs={"strides": (1, 2, 2, 1), "padding": "VALID", "data_format": "NHWC"},
       input_shapes=[(4, 16, 16, 8), (1, 1, 8, 16)], output_shapes=[(4, 8, 8, 16)]),
     "([n, h*2, w*2, c],[r, q, c, o])->([n, h, w, o]) {n=4, h=8, w=8, o=16, r=1, q=1, c=8} sum(r,q,c)"),
    (V("Conv2DBackpropInput", attrs={"strides": (1, 1, 1, 1), "padding": "SAME", "data_format": "NHWC"},
       input_shapes=[(4,), (3, 3, 8, 16), (4, 8, 8, 16)], input_dtypes=[I32, "float32", "float32"],
       output_shapes=[(4, 8, 8, 8)]),
     "(#,[r, q, c, o],[n, h, w, o])->([n, h+r-1, w+q-1, c]) {n=4, c=8, h=8, w=8, r=3, q=3, o=16} sum(o)"),
    (V("Conv2DBackpropFilter", attrs={"strides": (1, 1, 1, 1), "padding": "SAME", "data_format": "NHWC"},
       input_shapes=[(4, 8, 8, 8), (4,), (4, 8, 8, 16)], input_dtypes=["float32", I32, "float32"],
       output_shapes=[(3, 3, 8, 16)]),
     "([n, h+r-1, w+q-1, c],#,[n, h, w, o])->([r, q, c, o]) {r=3, q=3, c=8, o=16, n=4, h=8, w=8} sum(n,h,w)"),
    (V("DepthwiseConv2dNative", attrs={"strides": (1, 1, 1, 1), "padding": "SAME", "data_format": "NHWC"},
       input_shapes=[(2, 8, 8, 4), (3, 3, 4, 2)], output_shapes=[(2, 8, 8, 8)]),
     "([n, h+r-1, w+q-1, c],[r, q, c, m])->([n, h, w, c*2+m]) {n=2, h=8, w=8, r=3, q=3, c=4, m=2} sum(r,q)"),
    (V("MaxPool", attrs={"ksize": (1, 2, 2, 1), "strides": (1, 2, 2, 1), "padding": "VALID", "data_format": "NHWC"},
       input_shapes=[(4, 16, 16, 8)], output_shapes=[(4, 8, 8, 8)]),
     "([n, h*2+r, w*2+q, c])->([n, h, w, c]) {n=4, h=8, w=8, c=8, r=2, q=2} max(r,q) fixed(r,q)"),
    (V("MaxPoolGrad", attrs={"ksize": (1, 3, 3, 1), "strides": (1, 2, 2, 1), "padding": "SAME",
                             "data_format": "NHWC"},
       input_shapes=[(4, 16, 16, 8), (4, 8, 8, 8), (4, 8, 8, 8)], output_shapes=[(4, 16, 16, 8)]),
     "([n, h*2+r, w*2+q, c],[n, h, w, c],[n, h, w, c])->([n, h*2+r, w*2+q, c]) "
     "{n=4, c=8, h=8, w=8, r=3, q=3} fixed(r,q)"),
    (V("FusedBatchNormV3", attrs={"is_training": True, "data_format": "NCHW", "exponential_avg_factor": 1.0},
       input_shapes=[(1, 512, 256, 1), (512,), (512,), (0,), (0,)],
       output_shapes=[(1, 512, 256, 1), (512,), (512,), (), (), ()]),
     "([n, c, h, w]|[:, c, :, :],[c],[c],#,#)->([n, c, h, w],[c],[c],_,_,_) {n=1, c=512, h=256, w=1}"),
    (V("FusedBatchNormGradV3", attrs={"is_training": False, "data_format": "NHWC"},
       input_shapes=[(4, 8, 8, 16), (4, 8, 8, 16), (16,), (16,), (16,), ()],
       output_shapes=[(4, 8, 8, 16), (16,), (16,), (0,), (0,)]),
     "([n, h, w, c],[n, h, w, c],[c],[c],[c],_)->([n, h, w, c],[c],[c],_,_) {n=4, h=8, w=8, c=16} sum(n,h,w)"),
    (_int_view("Reshape", [(8, 64, 256), (2,)], [None], [(512, 256)]),
     "([i//64, i%64, j],#)->([i, j]) {i=512, j=256}"),
    (_int_view("Reshape", [(512, 256), (3,)], [None], [(8, 64, 256)]),
     "([i*64+j, k],#)->([i, j, k]) {i=8, j=64, k=256}"),
    (_int_view("Reshape", [(6, 4), (2,)], [None], [(3, 8)]),
     "([(i*8+j)//4, j%4],#)->([i, j]) {i=3, j=8}"),
    (_int_view("Transpose", [(8, 4, 16), (3,)], [(1, 0, 2)], [(4, 8, 16)]),
     "([j, i, k],#)->([i, j, k]) {i=4, j=8, k=16}"),
    (V("ConcatV2", input_shapes=[(4, 32), (4, 96), ()], input_values=[None, None, 1],
       input_dtypes=["float32", "float32", I32], output_shapes=[(4, 128)]),
     "([i, j],[i, j-32],#)->([i, j]) {i=4, j=128} fixed(j)"),
    (_int_view("Slice", [(4, 8, 1024), (3,), (3,)], [None, (4, 8, 992)], [(4, 8, 992)]),
     "([i, j, :],#,#)->([i, j, k]) {i=4, j=8, k=992} fixed(k)"),
    (_int_view("StridedSlice", [(8, 4, 16), (3,), (3,), (3,)], [(0, 3, 0), (8, 4, 16), (1, 1, 1)], [(8, 16)],
               attrs={"shrink_axis_mask": 2}),
     "([i, 3, j],#,#,#)->([i, j]) {i=8, j=16}"),
    (_int_view("Pad", [(2, 32, 32, 3), (4, 2)], [(0, 0, 3, 3, 3, 3, 0, 0)], [(2, 38, 38, 3)]),
     "([i, j-3, k-3, l],#)->([i, j, k, l]) {i=2, j=38, k=38, l=3} fixed(j,k)"),
    (_int_view("Tile", [(4, 1, 1, 16), (4,)], [(1, 4, 4, 1)], [(4, 4, 4, 16)]),
     "([i, 0, 0, l],#)->([i, j, k, l]) {i=4, j=4, k=4, l=16}"),
    (V("ResourceGather", input_shapes=[(128, 64), (4, 16)], input_dtypes=["resource", I32],
       output_shapes=[(4, 16, 64)]),
     "(&[$1[i, j], k],[i, j])->([i, j, k]) {i=4, j=16, k=64}"),
    (V("UnsortedSegmentSum", input_shapes=[(64, 64), (64,), ()], input_dtypes=["float32", I32, I32],
       output_shapes=[(128, 64)]),
     "([n, i],[n],#)->([$1[n], i]) {i=64, n=64} sum(n)"),
    (V("GatherNd", input_shapes=[(8, 6, 16), (4, 2)], input_dtypes=["float32", I32], output_shapes=[(4, 16)]),
     "([$1[i, 0], $1[i, 1], j],[i, 0]|[i, 1])->([i, j]) {i=4, j=16}"),
    (V("ScatterNd", input_shapes=[(64, 1), (64,), (1,)], input_dtypes=[I32, "float32", I32],
       output_shapes=[(128,)]),
     "([n0, 0],[n0],#)->([$0[n0, 0]]) {n0=64} sum(n0)"),
    (V("TensorScatterUpdate", input_shapes=[(8, 16), (4, 1), (4, 16)], input_dtypes=["float32", I32, "float32"],
       output_shapes=[(8, 16)]),
     "([i, j],[:, :],[:, j])->([i, j]) {i=8, j=16} fixed(i)"),
    (V("OneHot", input_shapes=[(16, 2), (), (), ()], input_dtypes=[I32, I32, "float32", "float32"],
       output_shapes=[(16, 2, 8)]),
     "([i, j],#,[],[])->([i, j, k]) {i=16, j=2, k=8} fixed(k)"),
    (V("TopKV2", input_shapes=[(16, 8), ()], input_dtypes=["float32", I32], output_shapes=[(16, 2), (16, 2)],
       output_dtypes=["float32", I32]),
     "([i, :],#)->([i, j],[i, j]) {i=16, j=2} fixed(j)"),
    (V("ConcatOffset", input_shapes=[(), (4,), (4,)], input_dtypes=[I32, I32, I32], output_shapes=[(4,), (4,)],
       output_dtypes=[I32, I32]),
     "(#,#,#)->(#,#) {}"),
    (V("AssignAddVariableOp", input_shapes=[(16, 64), (16, 64)], input_dtypes=["resource", "float32"],
       output_shapes=[]),
     "(&[i, j],[i, j])->() {i=16, j=64} update(0:[i, j])"),
    (V("ShapeN", input_shapes=[(4, 8), (8, 2)], output_shapes=[(2,), (2,)], output_dtypes=[I32, I32]),
     "(~,~)->(#,#) {}"),
    (V("RandomUniform", input_shapes=[(2,)], input_dtypes=[I32], output_shapes=[(4, 16)]),
     "(#)->([i, j]) {i=4, j=16}"),
    (V("Const", output_shapes=[(4,)]), "()->(#) replicated(constant)"),
    (V("StatelessWhile", input_shapes=[(), (4, 32)], output_shapes=[(), (4, 32)]),
     "(#,#)->(#,#) replicated(runs whole)"),
    (V("MatrixBandPart", input_shapes=[(1, 16, 16), (), ()], input_values=[None, -1, 0],
       input_dtypes=["bool", "int64", "int64"], output_shapes=[(1, 16, 16)]),
     "([i, j, k],#,#)->([i, j, k]) {i=1, j=16, k=16} fixed(j,k)"),
]


@pytest.mark.parametrize("view,text", GOLDEN, ids=[f"{v.type}-{n}" for n, (v, _) in enumerate(GOLDEN)])
def test_builtin_description_text_is_golden(view, text):
    assert semantics.default_registry().describe_view(view).text() == text


def test_a_program_traces_to_its_text():
    desc = trace(lambda a, b: lambda i, j: Sum(lambda k: a[i, k] * b[k, j]), op="MyMatMul",
                 input_shapes=[(8, 8), (8, 16)], output_shapes=[(8, 16)])
    assert str(desc) == "([i, k],[k, j])->([i, j]) {i=8, j=16, k=8} sum(k)"
    assert desc.size_of == {"i": 8, "j": 16, "k": 8}


def _indexed(fn):
    @functools.wraps(fn)
    def wrapper(*indices):
        return fn(*indices)
    return wrapper


def test_index_names_come_from_each_lambda_even_through_a_shared_wrapper():
    # Parameters are kept per code object; every wrapper shares one (``*indices``), so its
    # names must come from the function it wraps, each time.
    for program, text in [(lambda a: _indexed(lambda i, j: a[i, j]), "([i, j])->([i, j]) {i=2, j=3}"),
                          (lambda a: _indexed(lambda p, q: a[p, q]), "([p, q])->([p, q]) {p=2, q=3}"),
                          (lambda a: lambda x, y: a[x, y], "([x, y])->([x, y]) {x=2, y=3}")]:
        assert trace(program, op="Copy", input_shapes=[(2, 3)], output_shapes=[(2, 3)]).text() == text


def test_where_writes_the_scatter_form_and_removes_placed_indices_from_the_reduction():
    # dx[y] += dy[h] * f[r] with y = h*2 + r: the stride-2 transposed convolution of a vector
    desc = trace(lambda dy, f: lambda y: Sum(lambda h, r: Where(dy[h] * f[r], (y, h * 2 + r))), op="Up",
                 input_shapes=[(4,), (2,)], output_shapes=[(8,)])
    assert desc.text() == "([h],[r])->([h*2+r]) {h=4, r=2}"
    assert desc.outputs[0].reduce == ()


def test_nested_reductions_are_internal_and_fixed():
    desc = trace(lambda x: lambda i: Sum(lambda j: x[i, j]) / Max(lambda r: x[i, r]), op="Ratio",
                 input_shapes=[(4, 6)], output_shapes=[(4,)])
    assert desc.fixed == frozenset({"j", "r"})
    assert desc.outputs[0].reduce == ()


def test_position_fixes_indices_whose_global_value_matters():
    desc = trace(lambda x: lambda i, j: Position(i, j, args=(x[i, j],)), op="Band",
                 input_shapes=[(4, 4)], output_shapes=[(4, 4)])
    assert desc.fixed == frozenset({"i", "j"})


def test_digits_simplify_to_plain_indices_where_the_reshape_lines_up():
    i, j = Ix("i"), Ix("j")
    from tofu_tf.semantics.tdl import bind_digit
    flat = (i * 256 + j)._affine()
    extent = {"i": 512, "j": 256}
    assert bind_digit(Digit(flat, 16384), extent) == Digit(Affine((("i", 1),)), 64)
    assert bind_digit(Digit(flat, 256, 64), extent) == Digit(Affine((("i", 1),)), 1, 64)
    assert bind_digit(Digit(flat, 1, 256), extent) == Affine((("j", 1),))


def test_rank_mismatch_names_the_op_and_the_input():
    with pytest.raises(semantics.DescriptionError, match=r"MyOp: input 1 has rank 2 .* indexed with 1"):
        trace(lambda a, b: lambda i: a[i] * b[i], op="MyOp", input_shapes=[(4,), (4, 4)], output_shapes=[(4,)])


def test_output_rank_mismatch_is_an_error():
    with pytest.raises(semantics.DescriptionError, match=r"MyOp: output 0 has rank 2 .* takes 1 indices"):
        trace(lambda a: lambda i: a[i], op="MyOp", input_shapes=[(4,)], output_shapes=[(4, 4)])


def test_an_index_without_extent_asks_for_sizes():
    with pytest.raises(semantics.DescriptionError, match=r"index 'r' has no extent.*sizes="):
        trace(lambda x: lambda i: Sum(lambda r: x[i * 2 + r]), op="Pool1D", input_shapes=[(8,)],
              output_shapes=[(4,)])


def test_reduction_indices_must_not_shadow_output_indices():
    with pytest.raises(semantics.DescriptionError, match=r"'i' shadows an output index"):
        trace(lambda x: lambda i: Sum(lambda i: x[i]), op="Bad", input_shapes=[(8,)], output_shapes=[(4,)])


def test_wrong_number_of_outputs_is_an_error():
    with pytest.raises(semantics.DescriptionError, match=r"states 1 outputs, the op has 2"):
        trace(lambda x: lambda i: x[i], op="Two", input_shapes=[(4,)], output_shapes=[(4,), (4,)])


def test_unaccessed_inputs_are_static_metadata_unless_declared():
    desc = trace(Program(lambda x, shape: lambda i, j: x[i, j], meta={1: semantics.MetaKind.OUTPUT_SHAPE}),
                 op="R", input_shapes=[(4, 4), (2,)], output_shapes=[(4, 4)])
    assert desc.inputs[1].use is semantics.Use.META and desc.inputs[1].meta is semantics.MetaKind.OUTPUT_SHAPE
