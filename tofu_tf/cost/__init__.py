"""Cost model of a plan: hardware profiles, collectives, and memory by liveness.

Imports no TensorFlow; everything here prices plain data (shapes, layouts,
schedules) so the search can call it millions of times.
"""

from tofu_tf.cost.collectives import Collective, Transfer, transfer
from tofu_tf.cost.hardware import CPU_VIRTUAL, H100_NVLINK, H200_NVLINK, PCIE_GPU, PROFILES, HardwareProfile, Link
from tofu_tf.cost.memory import Liveness, MemoryReport

__all__ = ["Collective", "Transfer", "transfer", "HardwareProfile", "Link", "PROFILES",
           "H100_NVLINK", "H200_NVLINK", "PCIE_GPU", "CPU_VIRTUAL", "Liveness", "MemoryReport"]
