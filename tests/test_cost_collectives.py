"""Collective pricing and hardware links."""

import pytest

from tofu_tf.cost.collectives import Collective, collective_for, transfer
from tofu_tf.cost.hardware import CPU_VIRTUAL, H100_NVLINK, PROFILES, Link, profile
from tofu_tf.mesh import MeshSpec
from tofu_tf.semantics.strategy import REPLICATED, Reduction, TensorSplit

S0, S1, P = TensorSplit(0), TensorSplit(1), TensorSplit(partial=Reduction.SUM)
LINK = Link(bandwidth=1e9, latency=1e-6, gathers_by_all_reduce=False)   # ring collectives


@pytest.mark.parametrize("src,dst,kind", [
    (P, REPLICATED, Collective.ALL_REDUCE), (P, S0, Collective.REDUCE_SCATTER),
    (S0, REPLICATED, Collective.ALL_GATHER), (S0, S1, Collective.ALL_TO_ALL),
    (REPLICATED, S0, None), (S0, S0, None), (REPLICATED, P, None), (S0, P, None), (P, P, None)])
def test_collective_for_each_conversion(src, dst, kind):
    assert collective_for(src, dst) == kind


def test_ring_bytes_and_seconds():
    n, nbytes = 4, 1000.0
    ar = transfer(P, REPLICATED, nbytes, n, LINK)
    assert ar.bytes == pytest.approx(2 * 3 / 4 * 1000) and ar.seconds == pytest.approx(6e-6 + 1500 / 1e9)
    assert transfer(P, S0, nbytes, n, LINK).bytes == pytest.approx(750)
    assert transfer(S0, REPLICATED, nbytes, n, LINK).bytes == pytest.approx(750)
    assert transfer(S0, S1, nbytes, n, LINK).bytes == pytest.approx(750 / 4)
    assert transfer(S0, REPLICATED, nbytes, 1, LINK) is None


def test_dtensor_gathers_and_reduce_scatters_are_priced_as_the_all_reduces_it_runs():
    """DTensor lowers an all-gather to an all-reduce of the zero-padded gathered tensor and a
    reduce-scatter to an all-reduce and a slice (bench/executed.py reads so in its program): a
    DTensor link prices them as that all-reduce, with the relayout's own kind."""
    dtensor = Link(bandwidth=1e9, latency=1e-6)
    n, nbytes = 4, 1000.0
    all_reduce = transfer(P, REPLICATED, nbytes, n, dtensor)
    for src, dst, kind in ((S0, REPLICATED, Collective.ALL_GATHER), (P, S0, Collective.REDUCE_SCATTER)):
        moved = transfer(src, dst, nbytes, n, dtensor)
        assert moved.kind == kind
        assert (moved.bytes, moved.seconds) == (all_reduce.bytes, all_reduce.seconds)
        assert moved.bytes == 2 * transfer(src, dst, nbytes, n, LINK).bytes
    assert transfer(S0, S1, nbytes, n, dtensor) == transfer(S0, S1, nbytes, n, LINK)
    for name in PROFILES:
        assert profile(name).intra_node.gathers_by_all_reduce and profile(name).inter_node.gathers_by_all_reduce


def test_latency_per_collective_is_paid_once_whatever_the_group():
    """DTensor on CPU: one executor call per collective, so group size does not multiply latency."""
    per_call = Link(bandwidth=1e9, latency=1e-3, latency_per_collective=True, gathers_by_all_reduce=False)
    for n in (2, 4, 8):
        ar = transfer(P, REPLICATED, 1000.0, n, per_call)
        assert ar.seconds == pytest.approx(1e-3 + 2 * (n - 1) / n * 1000 / 1e9)
        assert ar.bytes == transfer(P, REPLICATED, 1000.0, n, LINK).bytes
    ring = Link(bandwidth=1e9, latency=1e-3, gathers_by_all_reduce=False)
    assert transfer(S0, REPLICATED, 0.5, 8, ring).seconds == pytest.approx(7e-3 + 0.5 * 7 / 8 / 1e9)


def test_cpu_profile_prefers_one_collective_over_two_smaller_groups():
    """Two collectives on 4- and 2-device axes cost more than one on 8 under the CPU profile
    (the measured DTensor behaviour), unlike a GPU ring where latency grows with the group."""
    link = CPU_VIRTUAL.intra_node
    one = transfer(P, REPLICATED, 4096.0, 8, link).seconds
    two = transfer(P, REPLICATED, 4096.0, 4, link).seconds + transfer(P, REPLICATED, 4096.0, 2, link).seconds
    assert one < two
    gpu = H100_NVLINK.intra_node
    small = 64.0  # latency-bound
    assert transfer(P, REPLICATED, small, 8, gpu).seconds > (transfer(P, REPLICATED, small, 4, gpu).seconds
                                                           + transfer(P, REPLICATED, small, 2, gpu).seconds)


def test_axis_link_follows_node_boundaries():
    mesh = MeshSpec((("a", 8), ("b", 8)))          # 64 devices, 8 per node
    assert H100_NVLINK.axis_link(mesh, 1) == H100_NVLINK.intra_node
    assert H100_NVLINK.axis_link(mesh, 0) == H100_NVLINK.inter_node
    assert CPU_VIRTUAL.axis_link(mesh, 0) == CPU_VIRTUAL.intra_node


def test_profiles_by_name():
    assert {"h100-nvlink", "h200-nvlink", "pcie-gpu", "cpu-virtual"} <= set(PROFILES)
    assert profile("h200-nvlink").memory_bytes > profile("h100-nvlink").memory_bytes
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'"):
        profile("tpu")


@pytest.mark.parametrize("nbytes", [4 * 2**10, 4 * 2**20])
def test_an_axis_problem_prices_a_gradients_all_reduce_the_smaller_of_its_packing_and_its_latency(nbytes):
    """The axis problems price each conversion alone: a gradient's all-reduce on the CPU profile,
    whose combined all-reduce pays one latency for all, pays the copy of its bytes into the
    combined buffer (4 KiB: 0.01 ms), or its own latency where that copy costs more (4 MiB:
    10.8 ms against 2 ms), as the step's price then runs the all-reduces one by one."""
    from tofu_tf.cost.collectives import collective_cost, transfer_seconds
    link = CPU_VIRTUAL.intra_node
    moved = collective_cost(Collective.ALL_REDUCE, nbytes, 8, link)
    packing = nbytes / link.combine_copy_bandwidth
    fixed = min(link.latency, packing)
    assert transfer_seconds(P, REPLICATED, nbytes, 8, link, gradient=True) == pytest.approx(
        moved.seconds - link.latency + fixed, rel=1e-12)
    assert (fixed == packing) is (nbytes < link.latency * link.combine_copy_bandwidth)
    assert transfer_seconds(P, REPLICATED, nbytes, 8, link) == pytest.approx(moved.seconds, rel=1e-12)
