"""Which devices a run trains on: real GPUs when there are enough, else
virtual CPU devices.

TensorFlow fixes its logical devices when the runtime starts (the first op
that runs), so the CPU fallback must be set up before anything else touches
TF. This module is the one place that does it; callers get a clear error
instead of TF's ``RuntimeError`` when it is too late.

Virtual CPU devices share the host's cores, so their number is bounded by
the cores (``max_virtual_cpus``): past it a run does not fail, it just never
gets anywhere (1000 on a 2-core host spent 66 s creating variables and did not
finish a step in 4 minutes), so asking for more is refused before any device
exists, unless ``TOFU_TF_MAX_VIRTUAL_CPUS`` raises the bound.
"""

from __future__ import annotations

import dataclasses
import os

import tensorflow as tf
from absl import logging

from tofu_tf.errors import TofuError


class DeviceSetupError(TofuError, RuntimeError):
    """The devices a run asked for cannot be provided."""


# Virtual CPU devices allowed per host core, and at least this many on any host. Every op of a
# step runs once per device, so each core serializes that many programs per op. Measured on a
# 2-core host, a small MLP's first fit (tracing + 2 steps): 3.2 s on 8 devices, 4.8 s on 16,
# 13.1 s on 64, 22.5 s on 128; 1000 did not finish a step in 4 minutes. 8 per core keeps a run
# within a few times the 8-device one; the floor keeps the tests' and the README's 8 devices on
# any host.
VIRTUAL_CPUS_PER_CORE = 8
MIN_VIRTUAL_CPUS = 8
# An explicit opt-in: the largest number of virtual CPU devices to create, whatever the cores.
MAX_VIRTUAL_CPUS_ENV = "TOFU_TF_MAX_VIRTUAL_CPUS"


@dataclasses.dataclass(frozen=True)
class DeviceSet:
    """The devices a strategy will place its mesh on."""

    device_type: str      # "GPU" or "CPU"
    names: tuple[str, ...]  # e.g. ("CPU:0", ..., "CPU:7")
    virtual: bool

    @property
    def count(self) -> int:
        return len(self.names)


def provide_devices(num_devices: int) -> DeviceSet:
    """GPUs if at least ``num_devices`` are visible, else ``num_devices`` virtual CPUs.

    Falling back to CPUs is logged as a warning: it is right for trying
    tofu_tf on a laptop and wrong on a GPU node with a broken driver.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= num_devices:
        return DeviceSet("GPU", tuple(f"GPU:{i}" for i in range(num_devices)), virtual=False)
    configure_virtual_cpus(num_devices)
    logging.warning(
        "%d GPU(s) visible, %d requested: using %d virtual CPU devices instead.",
        len(gpus), num_devices, num_devices)
    return DeviceSet("CPU", tuple(f"CPU:{i}" for i in range(num_devices)), virtual=True)


def configure_virtual_cpus(num_devices: int) -> None:
    """Split the host CPU into ``num_devices`` logical devices (idempotent).

    Must run before the TF runtime starts; if it already started with a
    different split, raise with what to do instead. More devices than
    ``max_virtual_cpus()`` are refused before any is created.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) >= num_devices:
        return
    check_virtual_cpu_count(num_devices)
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
    except RuntimeError as error:
        have = len(tf.config.list_logical_devices("CPU"))
        raise DeviceSetupError(
            f"TensorFlow already started with {have} CPU device(s), so {num_devices} virtual CPU "
            "devices can no longer be created. Create the TofuStrategy (or call "
            "tofu_tf.tf.devices.configure_virtual_cpus) before running any TensorFlow op, "
            "e.g. at the top of your script.") from error
    tf.config.list_logical_devices("CPU")  # start the runtime with the new split


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity, which containers restrict)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def max_virtual_cpus() -> int:
    """How many virtual CPU devices this host is allowed: ``TOFU_TF_MAX_VIRTUAL_CPUS`` when
    set, else ``VIRTUAL_CPUS_PER_CORE`` per core, at least ``MIN_VIRTUAL_CPUS``."""
    value = os.environ.get(MAX_VIRTUAL_CPUS_ENV)
    if value is None or value == "":
        return max(MIN_VIRTUAL_CPUS, VIRTUAL_CPUS_PER_CORE * host_cores())
    try:
        bound = int(value)
    except ValueError:
        bound = 0
    if bound < 1:
        raise DeviceSetupError(f"{MAX_VIRTUAL_CPUS_ENV}={value!r} is not a positive integer; set it to the "
                               "largest number of virtual CPU devices to create, or unset it.")
    return bound


def check_virtual_cpu_count(num_devices: int) -> None:
    """Refuse more virtual CPU devices than ``max_virtual_cpus()``, saying why and what to do."""
    bound = max_virtual_cpus()
    if num_devices <= bound:
        return
    cores = host_cores()
    if os.environ.get(MAX_VIRTUAL_CPUS_ENV):
        reason = f"{MAX_VIRTUAL_CPUS_ENV} allows {bound}"
    else:
        reason = (f"this host has {cores} CPU core{'s' if cores != 1 else ''}, and virtual devices share them: "
                  f"past {bound} ({VIRTUAL_CPUS_PER_CORE} per core, at least {MIN_VIRTUAL_CPUS}) a step spends "
                  "its time running one program per device (1000 on 2 cores did not finish a step in 4 minutes)")
    raise DeviceSetupError(
        f"{num_devices} virtual CPU devices requested (TofuStrategy(num_gpus={num_devices}) makes them when "
        f"fewer GPUs are visible), and {reason}. Ask for at most {bound} devices, run where {num_devices} GPUs "
        f"are visible, or set {MAX_VIRTUAL_CPUS_ENV}={num_devices} to create them anyway.")
