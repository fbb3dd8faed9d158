"""Mesh specs, factorizations and DTensor layout rules (no TensorFlow)."""

import pytest

from tofu_tf.mesh import LayoutError, MeshSpec, check_layout, ordered_factorizations, shard_shape


def test_ordered_factorizations_cover_every_mesh_shape():
    assert ordered_factorizations(8) == [(2, 2, 2), (2, 4), (4, 2), (8,)]
    assert len(ordered_factorizations(64)) == 32          # compositions of 6
    assert ordered_factorizations(1) == [()]
    assert (3, 2) in ordered_factorizations(6) and (6,) in ordered_factorizations(6)


def test_mesh_spec_normalizes_user_input():
    assert MeshSpec.from_user_input({"batch": 2, "model": 4}).names == ("batch", "model")
    assert MeshSpec.from_user_input((2, 4)).as_dict() == {"a0": 2, "a1": 4}
    assert MeshSpec.from_user_input((2, 4)).num_devices == 8
    with pytest.raises(LayoutError, match="cannot read a mesh shape"):
        MeshSpec.from_user_input("2x4")
    with pytest.raises(LayoutError, match="unique"):
        MeshSpec((("x", 2), ("x", 2)))


def test_layout_rules_are_dtensors():
    mesh = MeshSpec((("batch", 2), ("model", 4)))
    check_layout((8, 16), ("batch", "model"), mesh)
    assert shard_shape((8, 16), ("batch", "model"), mesh) == (4, 4)
    with pytest.raises(LayoutError, match="uses a mesh axis twice"):
        check_layout((8, 16), ("model", "model"), mesh)
    with pytest.raises(LayoutError, match=r"dim 1 .* does not divide evenly over mesh axis 'model'"):
        check_layout((8, 10), (None, "model"), mesh)
    with pytest.raises(LayoutError, match="not in mesh"):
        check_layout((8,), ("data",), mesh)
    with pytest.raises(LayoutError, match="entries for rank-2"):
        check_layout((8, 8), (None,), mesh)
