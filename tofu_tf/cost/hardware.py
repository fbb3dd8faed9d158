"""Hardware profiles: what a byte costs to move on each mesh axis, and what a
FLOP or a byte touched costs on one device.

A profile describes one node kind (devices per node, device memory) and two
link classes: inside a node (NVLink, PCIe, shared memory) and between nodes
(InfiniBand, Ethernet). A mesh axis gets the intra-node link when each of its
device groups lies inside one node, else the inter-node link; devices are
numbered row-major over the mesh (the last axis varies fastest), as DTensor's
``create_mesh`` does. Numbers are per device, one direction, as a ring
collective sees them. ``flops`` (FLOP/s of one device on the step's dtype,
sustained on large contractions) and ``memory_bandwidth`` (bytes/s) price the
compute term (``tofu_tf.cost.compute``). Users pass their own ``HardwareProfile``.
"""

from __future__ import annotations

import dataclasses

from tofu_tf.mesh import MeshSpec

GIB = 2**30
GB = 10**9


@dataclasses.dataclass(frozen=True)
class Link:
    """A link class: bytes per second per device (one direction) and a latency.

    A GPU collective library runs a ring collective as n-1 (all-reduce: 2(n-1))
    pipelined steps, each paying ``latency``, so a collective over a large group
    costs more fixed time than one over a small group. DTensor on CPU hands the
    whole collective to one call of TF's collective executor, whose fixed cost
    hardly grows with the group (bench/calibrate_cpu.py: 2-3 ms for a 4 KiB
    all-gather over 2, 4 or 8 devices alike); ``latency_per_collective=True``
    charges ``latency`` once per collective for such links.

    ``all_reduces_combined=False`` says DTensor's all-reduce combining pass is off in the
    process that runs the plan (a pipelined TofuStrategy switches it off, as its stage functions
    need): each collective then pays its own latency.

    ``combine_copy_bandwidth``: bytes per second per device at which DTensor's combining pass
    packs the all-reduces it combines into one buffer and slices them back out (it writes each
    into a zero-filled buffer with ``TensorStridedSliceUpdate``); None: free. Where it is set,
    a step's price weighs that copy against the latencies combining saves and runs its
    all-reduces the cheaper way (``tofu_tf.cost.combining``).

    DTensor runs an all-gather as an all-reduce of a zero-padded buffer and a
    reduce-scatter as an all-reduce and a slice, on GPUs and CPUs alike
    (``tofu_tf.cost.collectives``); ``gathers_by_all_reduce=True``, the default,
    prices them so. ``False`` prices the ring collectives of the table there
    (a runtime with native gathers, or Tofu's ideal).
    """

    bandwidth: float
    latency: float
    latency_per_collective: bool = False
    gathers_by_all_reduce: bool = True
    all_reduces_combined: bool = True
    combine_copy_bandwidth: float | None = None

    @property
    def combines_gradient_all_reduces(self) -> bool:
        """Whether the all-reduces DTensor combines share one latency in a plan's price (the
        gradients' all-reduces, and any others of one level of dependence: priced so where the
        latency is per collective, ``tofu_tf.cost.combining``, and the process runs DTensor's
        combining pass: ``all_reduces_combined``, off in ``without_combining``'s profiles)."""
        return self.latency_per_collective and self.all_reduces_combined

    def __post_init__(self):
        if self.bandwidth <= 0 or self.latency < 0 or (self.combine_copy_bandwidth is not None
                                                        and self.combine_copy_bandwidth <= 0):
            raise ValueError(f"a link needs bandwidth > 0, latency >= 0 and a combine_copy_bandwidth "
                             f"> 0 or None, got {self}")


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """A node kind: ``devices_per_node`` devices of ``memory_bytes`` each, joined by
    ``intra_node`` links, nodes joined by ``inter_node`` links; each device runs
    ``flops`` FLOP/s on contractions and touches ``memory_bandwidth`` bytes/s."""

    name: str
    devices_per_node: int
    memory_bytes: int
    intra_node: Link
    inter_node: Link
    flops: float = 100e12
    memory_bandwidth: float = 2e12

    def __post_init__(self):
        if self.flops <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"profile {self.name!r} needs flops > 0 and memory_bandwidth > 0")

    def axis_link(self, mesh: MeshSpec, axis_index: int) -> Link:
        """The link a collective over ``mesh``'s axis ``axis_index`` runs on."""
        stride = 1
        for size in mesh.sizes[axis_index + 1:]:
            stride *= size
        span = stride * mesh.sizes[axis_index]
        if span <= self.devices_per_node and self.devices_per_node % span == 0:
            return self.intra_node
        return self.inter_node


H100_NVLINK = HardwareProfile(
    "h100-nvlink", devices_per_node=8, memory_bytes=80 * GIB,
    intra_node=Link(bandwidth=450 * GB, latency=5e-6),     # NVLink 4: 900 GB/s bidirectional
    inter_node=Link(bandwidth=50 * GB, latency=10e-6),     # 400 Gb/s InfiniBand per GPU
    flops=400e12,                                           # TF32 tensor cores, ~80% of 495 dense
    memory_bandwidth=3.35e12)                               # HBM3
H200_NVLINK = dataclasses.replace(H100_NVLINK, name="h200-nvlink", memory_bytes=141 * GB,
                                  memory_bandwidth=4.8e12)  # HBM3e
PCIE_GPU = HardwareProfile(
    "pcie-gpu", devices_per_node=8, memory_bytes=24 * GIB,
    intra_node=Link(bandwidth=25 * GB, latency=10e-6),     # PCIe 4.0 x16, effective
    inter_node=Link(bandwidth=12.5 * GB, latency=20e-6),   # 100 Gb/s Ethernet/IB
    flops=50e12, memory_bandwidth=600 * GB)                 # a 24 GiB PCIe card (A10/L4 class), TF32
# Calibrated on the project's 2-core machine, 8 virtual CPU devices, TF 2.21 DTensor
# (bench/calibrate_cpu.py, other jobs sharing the cores, load average ~2): all-gathers and
# all-reduces of 4 KiB / 256 KiB / 4 MiB over groups of 2, 4 and 8 devices fit
# 2.1 ms per collective + ring bytes at 0.36 GB/s (19% mean error; charging the latency
# per ring step instead fits at 47%); a replicated 16x4096x4096 matmul on every device
# ran at 3.4 GFLOP/s per device and an Adam-like element-wise update at 0.47 GB/s
# per device (quiet machine: 7.8 GFLOP/s). Profiles rank plans, so the round figures
# below keep the measured ratios. DTensor's all-reduce combining packed and unpacked its
# buffers at 0.39 GB/s per device (2026-12-08; combined against one-by-one all-reduces of
# 2-32 gradients of 0.5-16 MiB: bench/calibrate_cpu.py).
CPU_VIRTUAL = HardwareProfile(
    "cpu-virtual", devices_per_node=1024, memory_bytes=3 * GIB,
    intra_node=Link(bandwidth=0.35 * GB, latency=2e-3,     # DTensor collectives between virtual CPUs
                    latency_per_collective=True, combine_copy_bandwidth=0.39 * GB),
    inter_node=Link(bandwidth=0.1 * GB, latency=20e-3),    # loopback gRPC between processes (not measured)
    flops=4e9, memory_bandwidth=0.5 * GB)                   # two host cores shared by the devices

PROFILES = {p.name: p for p in (H100_NVLINK, H200_NVLINK, PCIE_GPU, CPU_VIRTUAL)}


def without_combining(chosen: HardwareProfile) -> HardwareProfile:
    """``chosen`` priced for a process whose DTensor runs every all-reduce alone (its combining
    pass off): the same links with ``all_reduces_combined=False``."""
    return dataclasses.replace(
        chosen, intra_node=dataclasses.replace(chosen.intra_node, all_reduces_combined=False),
        inter_node=dataclasses.replace(chosen.inter_node, all_reduces_combined=False))


def profile(value: "HardwareProfile | str") -> HardwareProfile:
    """A profile by name, or the profile itself."""
    if isinstance(value, HardwareProfile):
        return value
    try:
        return PROFILES[value]
    except KeyError:
        raise ValueError(f"unknown hardware profile {value!r}; known: {sorted(PROFILES)}, "
                         "or pass a tofu_tf.cost.HardwareProfile") from None
