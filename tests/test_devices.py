"""Virtual CPU devices are bounded by the host's cores, refused with the reason before any exists.

Devices are configured once per process (conftest made 8), so the requests that would create
devices run in subprocesses."""

import os
import subprocess
import sys

import pytest

from tofu_tf.tf import devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_REQUEST = """
import sys
import tensorflow as tf
from tofu_tf.tf import devices
count = int(sys.argv[1])
try:
    {call}
except devices.DeviceSetupError as error:
    print("refused:", error)
print("cpu devices:", len(tf.config.list_logical_devices("CPU")))
"""


def _over_the_bound() -> int:
    """One more device than this host's default bound."""
    return max(devices.MIN_VIRTUAL_CPUS, devices.VIRTUAL_CPUS_PER_CORE * devices.host_cores()) + 1


def _request(count: int, call: str, **env) -> str:
    environment = {k: v for k, v in os.environ.items() if k != devices.MAX_VIRTUAL_CPUS_ENV}
    environment.update(env, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", _REQUEST.format(call=call), str(count)], cwd=ROOT, env=environment,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_bound_is_eight_per_core_and_never_below_eight(monkeypatch):
    monkeypatch.delenv(devices.MAX_VIRTUAL_CPUS_ENV, raising=False)
    monkeypatch.setattr(devices, "host_cores", lambda: 1)
    assert devices.max_virtual_cpus() == 8
    monkeypatch.setattr(devices, "host_cores", lambda: 2)
    assert devices.max_virtual_cpus() == 16
    devices.check_virtual_cpu_count(16)
    with pytest.raises(devices.DeviceSetupError,
                       match="1000 virtual CPU devices requested .*this host has 2 CPU cores, and virtual devices "
                             "share them: past 16 \\(8 per core, at least 8\\).*Ask for at most 16 devices, run where "
                             "1000 GPUs are visible, or set TOFU_TF_MAX_VIRTUAL_CPUS=1000 to create them anyway"):
        devices.check_virtual_cpu_count(1000)


def test_the_environment_variable_sets_the_bound(monkeypatch):
    monkeypatch.setenv(devices.MAX_VIRTUAL_CPUS_ENV, "1000")
    devices.check_virtual_cpu_count(1000)
    monkeypatch.setenv(devices.MAX_VIRTUAL_CPUS_ENV, "12")
    with pytest.raises(devices.DeviceSetupError, match="TOFU_TF_MAX_VIRTUAL_CPUS allows 12"):
        devices.check_virtual_cpu_count(13)
    monkeypatch.setenv(devices.MAX_VIRTUAL_CPUS_ENV, "many")
    with pytest.raises(devices.DeviceSetupError, match="'many' is not a positive integer"):
        devices.max_virtual_cpus()


@pytest.mark.slow   # starts TensorFlow in a fresh Python
def test_a_strategy_over_the_bound_is_refused_before_any_device_is_made():
    out = _request(_over_the_bound(), "from tofu_tf.strategies import TofuStrategy; TofuStrategy(count)")
    assert "refused:" in out and "virtual devices share them" in out and "TOFU_TF_MAX_VIRTUAL_CPUS=" in out
    assert "cpu devices: 1" in out


@pytest.mark.slow   # starts TensorFlow in a fresh Python
def test_the_opt_in_creates_devices_over_the_bound():
    count = _over_the_bound()
    out = _request(count, "devices.provide_devices(count)", **{devices.MAX_VIRTUAL_CPUS_ENV: str(count)})
    assert "refused" not in out and f"cpu devices: {count}" in out


@pytest.mark.slow   # starts TensorFlow in a fresh Python
def test_eight_devices_are_made_on_any_host():
    assert "cpu devices: 8" in _request(8, "devices.provide_devices(count)")


def test_a_gpu_split_into_logical_gpus_counts_as_that_many(monkeypatch):
    """One large GPU split into 8 logical GPUs (bench/gpu_check.py) gives 8 devices, not a fallback
    to virtual CPUs; an unsplit GPU counts as one. (The machine has no GPU: TF's two answers are
    stood in for.)"""
    import tensorflow as tf
    split, whole = object(), object()
    configurations = {split: [tf.config.LogicalDeviceConfiguration(memory_limit=1024)] * 8, whole: None}
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [split, whole] if kind == "GPU" else [])
    monkeypatch.setattr(tf.config, "get_logical_device_configuration", lambda device: configurations[device])
    assert devices.visible_gpu_count() == 9
