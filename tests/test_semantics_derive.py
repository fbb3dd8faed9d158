"""Strategy derivation from descriptions: what splits, what reduces, what
stays whole, and how fast. No TensorFlow."""

import sys

import pytest

from tofu_tf import semantics
from tofu_tf.semantics import OpView, Reduction, TensorSplit, derive
from tofu_tf.semantics.tdl import trace

V = OpView.build
R = semantics.REPLICATED


def _texts(view, parts):
    return [s.text() for s in semantics.default_registry().strategies_for_view(view, parts)]


def test_matmul_splits_rows_columns_and_the_contraction():
    view = V("MatMul", input_shapes=[(8, 8), (8, 16)], output_shapes=[(8, 16)])
    assert _texts(view, 2) == [
        "replicate: (R,R)->(R)",
        "i: (S0,R)->(S0)",
        "j: (R,S1)->(S1)",
        "k(reduce): (S1,S0)->(partial(sum))",
    ]


def test_dims_not_divisible_by_the_parts_are_not_split():
    view = V("MatMul", input_shapes=[(6, 8), (8, 16)], output_shapes=[(6, 16)])
    assert [s.split(":")[0] for s in _texts(view, 4)] == ["replicate", "j", "k(reduce)"]
    assert [s.split(":")[0] for s in _texts(view, 3)] == ["replicate", "i"]


def test_one_part_is_replication_only():
    view = V("MatMul", input_shapes=[(8, 8), (8, 16)], output_shapes=[(8, 16)])
    assert _texts(view, 1) == ["replicate: (R,R)->(R)"]


def test_num_parts_must_be_a_positive_int():
    desc = semantics.default_registry().describe_view(V("Relu", input_shapes=[(4,)], output_shapes=[(4,)]))
    with pytest.raises(ValueError, match=r"num_parts must be a positive int \(a mesh axis size\), got 0"):
        derive(desc, 0)


def _conv(strides, padding, kernel, size=16):
    out = size // strides if padding == "SAME" else (size - kernel) // strides + 1
    return V("Conv2D", attrs={"strides": (1, strides, strides, 1), "padding": padding, "data_format": "NHWC"},
             input_shapes=[(4, size, size, 8), (kernel, kernel, 8, 16)], output_shapes=[(4, out, out, 16)])


def test_a_window_with_halo_is_not_split_spatially():
    names = [s.split(":")[0] for s in _texts(_conv(1, "SAME", 3), 2)]
    assert names == ["replicate", "n", "o", "c(reduce)"]


def test_non_overlapping_windows_split_spatially():
    assert "h: (S1,R)->(S1)" in _texts(_conv(2, "VALID", 2), 2)  # 2x2 stride 2: each part its own rows
    assert "h: (S1,R)->(S1)" in _texts(_conv(2, "SAME", 1), 2)   # 1x1 stride 2 projection
    assert not any(t.startswith("h") for t in _texts(_conv(1, "VALID", 3), 2))


def test_mean_leaves_partial_means():
    view = V("Mean", input_shapes=[(4, 8), (1,)], input_values=[None, (1,)], input_dtypes=["float32", "int32"],
             output_shapes=[(4,)])
    strategies = semantics.default_registry().strategies_for_view(view, 2)
    assert strategies[-1].outputs == (TensorSplit(partial=Reduction.MEAN),)


def test_batch_norm_in_training_splits_only_channels():
    view = V("FusedBatchNormV3", attrs={"is_training": True, "data_format": "NHWC"},
             input_shapes=[(4, 8, 8, 16), (16,), (16,), (0,), (0,)],
             output_shapes=[(4, 8, 8, 16), (16,), (16,), (16,), (16,), ()])
    assert [s.split(":")[0] for s in _texts(view, 2)] == ["replicate", "c"]


def test_reshape_splits_only_where_the_split_commutes():
    merge = V("Reshape", input_shapes=[(8, 64, 256), (2,)], input_dtypes=["float32", "int32"],
              output_shapes=[(512, 256)])
    assert _texts(merge, 8)[1] == "i: (S0,R)->(S0)"      # 512 rows in 8 blocks = 8 batches in 8 blocks
    assert _texts(merge, 16) == ["replicate: (R,R)->(R)", "j: (S2,R)->(S1)"]  # 8 batches do not split 16 ways
    odd = V("Reshape", input_shapes=[(6, 4), (2,)], input_dtypes=["float32", "int32"], output_shapes=[(3, 8)])
    assert _texts(odd, 2) == ["replicate: (R,R)->(R)"]
    assert _texts(odd, 3) == ["replicate: (R,R)->(R)", "i: (S0,R)->(S0)"]


def test_a_lookup_never_splits_the_looked_up_dim():
    view = V("ResourceGather", input_shapes=[(128, 64), (4, 16)], input_dtypes=["resource", "int32"],
             output_shapes=[(4, 16, 64)])
    texts = _texts(view, 2)
    assert all("(S0," not in t for t in texts)  # the vocabulary dim of the table
    assert "k: (S1,R)->(S2)" in texts


def test_a_diagonal_access_is_not_split():
    desc = trace(lambda x: lambda i: x[i, i], op="Diag", input_shapes=[(4, 4)], output_shapes=[(4,)])
    assert derive(desc, 2) == (semantics.replicate_all(1, 1),)


def test_shape_ops_accept_any_layout_of_their_inputs():
    view = V("Shape", input_shapes=[(4, 6)], output_shapes=[(2,)], output_dtypes=["int32"])
    assert _texts(view, 2) == ["replicate: (R)->(R)", "~0.0: (S0)->(R)", "~0.1: (S1)->(R)"]


def test_every_strategy_has_one_split_per_tensor_and_replicate_comes_first():
    view = V("Conv2DBackpropFilter", attrs={"strides": (1, 1, 1, 1), "padding": "SAME", "data_format": "NHWC"},
             input_shapes=[(4, 8, 8, 8), (4,), (4, 8, 8, 16)], input_dtypes=["float32", "int32", "float32"],
             output_shapes=[(3, 3, 8, 16)])
    strategies = semantics.default_registry().strategies_for_view(view, 2)
    assert strategies[0] == semantics.replicate_all(3, 1)
    assert all(len(s.inputs) == 3 and len(s.outputs) == 1 for s in strategies)
    assert len({(s.inputs, s.outputs) for s in strategies}) == len(strategies)


def test_many_independent_tensors_derive_in_linear_time():
    # tf-keras passes every gradient through one IdentityN: 780 tensors in a 24-layer GPT.
    # The work is counted, not timed (a timed ratio failed CI under load): the Python and builtin
    # calls the derivation makes are the same on every machine. Four times the tensors may make
    # at most five times the calls; a pass over every pair of tensors would make sixteen.
    strategies = semantics.Registry()
    semantics.register_builtin_ops(strategies)

    def calls_to_derive(count):
        shapes = [(256, 256)] * count
        view = V("IdentityN", input_shapes=shapes, output_shapes=shapes)
        calls = 0

        def count_calls(frame, event, arg):
            nonlocal calls
            if event in ("call", "c_call"):
                calls += 1

        sys.setprofile(count_calls)
        try:
            found = strategies.strategies_for_view(view, 8)
        finally:
            sys.setprofile(None)
        assert len(found) == 1 + 2 * count
        return calls

    calls_to_derive(50)                                 # caches filled
    small, large = calls_to_derive(200), calls_to_derive(800)
    assert large < 5 * small, (small, large)
