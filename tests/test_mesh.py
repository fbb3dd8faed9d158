"""Mesh specs, factorizations and DTensor layout rules (no TensorFlow)."""

import pytest

import math

from tofu_tf.cost.hardware import H100_NVLINK
from tofu_tf.mesh import (LayoutError, MeshSpec, check_layout, host_aligned_factorizations, ordered_factorizations,
                          shard_shape)


def test_ordered_factorizations_cover_every_mesh_shape():
    assert ordered_factorizations(8) == [(2, 2, 2), (2, 4), (4, 2), (8,)]
    assert len(ordered_factorizations(64)) == 32          # compositions of 6
    assert ordered_factorizations(1) == [()]
    assert (3, 2) in ordered_factorizations(6) and (6,) in ordered_factorizations(6)


def _prefixes(shapes):
    return {shape[: k + 1] for shape in shapes for k in range(len(shape))}


@pytest.mark.parametrize("n", [16, 64, 256, 1024, 4096])
def test_meshes_beyond_one_host_follow_the_hosts(n):
    """Each axis either stays inside a host of 8 or spans whole hosts (so the profile prices it
    on one link), at most two cross hosts, at most three in all; the one flat axis is there."""
    shapes = host_aligned_factorizations(n, 8)
    assert (n,) in shapes and len(set(shapes)) == len(shapes)
    for shape in shapes:
        assert math.prod(shape) == n and all(size > 1 for size in shape)
        mesh = MeshSpec(tuple((f"a{k}", size) for k, size in enumerate(shape)))
        inner = math.prod(shape[len(shape) - sum(1 for k in range(len(shape))
                                                 if H100_NVLINK.axis_link(mesh, k) is H100_NVLINK.intra_node):])
        assert shape == (n,) or inner == 8, shape     # the host's axes are exactly the trailing ones
        assert len(shape) <= 3
        assert sum(1 for k in range(len(shape)) if H100_NVLINK.axis_link(mesh, k) is H100_NVLINK.inter_node) <= 2


def test_the_meshes_searched_grow_with_the_log_of_the_device_count():
    """The search solves one axis problem per distinct mesh prefix: every ordered factorization
    has n - 1 of them; the host-aligned ones about a fixed number per doubling of the hosts."""
    counts = {n: len(_prefixes(host_aligned_factorizations(n, 8))) for n in (64, 1024, 4096)}
    assert len(_prefixes(ordered_factorizations(1024))) == 1023
    assert counts[1024] <= 2 * counts[64] and counts[4096] <= 2.5 * counts[64], counts


def test_within_one_host_every_mesh_shape_is_searched():
    assert host_aligned_factorizations(8, 8) == ordered_factorizations(8)
    assert host_aligned_factorizations(12, 8) == ordered_factorizations(12)     # hosts do not divide 12


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
