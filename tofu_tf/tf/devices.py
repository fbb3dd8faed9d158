"""Which devices a run trains on: real GPUs when there are enough, else
virtual CPU devices.

TensorFlow fixes its logical devices when the runtime starts (the first op
that runs), so the CPU fallback must be set up before anything else touches
TF. This module is the one place that does it; callers get a clear error
instead of TF's ``RuntimeError`` when it is too late.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf
from absl import logging


class DeviceSetupError(RuntimeError):
    """The devices a run asked for cannot be provided."""


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
    logging.warning(
        "%d GPU(s) visible, %d requested: using %d virtual CPU devices instead.",
        len(gpus), num_devices, num_devices)
    configure_virtual_cpus(num_devices)
    return DeviceSet("CPU", tuple(f"CPU:{i}" for i in range(num_devices)), virtual=True)


def configure_virtual_cpus(num_devices: int) -> None:
    """Split the host CPU into ``num_devices`` logical devices (idempotent).

    Must run before the TF runtime starts; if it already started with a
    different split, raise with what to do instead.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) >= num_devices:
        return
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
