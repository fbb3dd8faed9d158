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
import subprocess
import sys
import time

import tensorflow as tf
from absl import logging

from tofu_tf.errors import TofuError
from tofu_tf.tf import cluster as cluster_lib


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
# How long a client of a multi-client run waits for the others to join before it gives up.
JOIN_TIMEOUT_ENV = "TOFU_TF_CLUSTER_JOIN_TIMEOUT_S"
DEFAULT_JOIN_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class DeviceSet:
    """The devices a strategy will place its mesh on: ``names`` in this process,
    the same number in every other client of ``cluster``."""

    device_type: str      # "GPU" or "CPU"
    names: tuple[str, ...]  # this process's, e.g. ("CPU:0", ..., "CPU:7")
    virtual: bool
    cluster: cluster_lib.Cluster = cluster_lib.LOCAL

    @property
    def count(self) -> int:
        """Devices of the whole mesh, every client's."""
        return len(self.names) * max(1, self.cluster.num_clients)

    @property
    def local_count(self) -> int:
        return len(self.names)


def provide_devices(num_devices: int) -> DeviceSet:
    """GPUs if at least ``num_devices`` are visible, else ``num_devices`` virtual CPUs,
    in this process; as many in every other client where the environment describes a
    multi-client cluster (``tofu_tf.tf.cluster``), which then joins DTensor's runtime.

    Falling back to CPUs is logged as a warning: it is right for trying
    tofu_tf on a laptop and wrong on a GPU node with a broken driver.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    cluster = cluster_lib.from_environment()
    gpus = visible_gpu_count()
    device_type = "GPU" if gpus >= num_devices else "CPU"
    if device_type == "CPU":
        check_virtual_cpu_count(num_devices)
        logging.warning(
            "%d GPU(s) visible, %d requested: using %d virtual CPU devices instead.",
            gpus, num_devices, num_devices)
    if cluster.is_multi_client:
        join_cluster(cluster, device_type, num_devices)
    elif device_type == "CPU":
        configure_virtual_cpus(num_devices)
    return DeviceSet(device_type, tuple(f"{device_type}:{i}" for i in range(num_devices)),
                     virtual=device_type == "CPU", cluster=cluster)


def visible_gpu_count() -> int:
    """The GPUs this process can place on: each physical GPU counts as the logical GPUs it
    was split into (``tf.config.set_logical_device_configuration``, e.g. one large GPU as
    8 devices of a memory limit each, as ``bench/gpu_check.py`` does), else as one."""
    return sum(len(tf.config.get_logical_device_configuration(gpu) or [gpu])
               for gpu in tf.config.list_physical_devices("GPU"))


def join_cluster(cluster: cluster_lib.Cluster, device_type: str, num_devices: int) -> None:
    """Start TF's runtime as client ``cluster.client_id`` of a multi-client DTensor cluster.

    DTensor must create the runtime itself (``initialize_accelerator_system``), with
    this process's virtual CPUs when there are no GPUs: if anything started TF
    first, say so. Joining waits for every client (the coordination service's
    registration); where one never comes, ``_JoinWatchdog`` ends this process after
    ``join_timeout_s()`` rather than let it wait forever.
    """
    from tensorflow.experimental import dtensor
    logging.info("TofuStrategy: client %d of %d (%s) joining the cluster %s with %d %s device(s)",
                 cluster.client_id, cluster.num_clients, cluster.job_name, ",".join(cluster.jobs),
                 num_devices, device_type)
    watchdog = _JoinWatchdog(cluster, join_timeout_s())
    try:
        dtensor.initialize_accelerator_system(
            device_type, num_logical_cpu_devices=num_devices if device_type == "CPU" else None)
    except ValueError as error:
        if "Accelerator system has already been initialized" in str(error):
            _check_joined(cluster, device_type, num_devices)   # an earlier strategy of this process joined
            return
        if "TensorFlow has already been initialized" not in str(error):
            raise
        raise DeviceSetupError(
            "TensorFlow already started in this process, so it can no longer join a multi-client cluster "
            f"({cluster_lib.JOBS_ENV} is set): create the TofuStrategy before running any TensorFlow op, e.g. "
            "at the top of your script.") from error
    finally:
        watchdog.cancel()
    logging.info("TofuStrategy: client %d joined the cluster in %.1f s", cluster.client_id, watchdog.elapsed_s())


def join_timeout_s() -> float:
    """How long a client waits for the others to join: ``TOFU_TF_CLUSTER_JOIN_TIMEOUT_S``, else 300 s."""
    value = os.environ.get(JOIN_TIMEOUT_ENV, "").strip()
    try:
        seconds = float(value) if value else DEFAULT_JOIN_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise DeviceSetupError(f"{JOIN_TIMEOUT_ENV}={value!r} is not a positive number of seconds; set it to how "
                               "long a client waits for the others to start, or unset it.")
    return seconds


class _JoinWatchdog:
    """Ends this process, saying why, when joining the cluster takes longer than ``timeout_s``.

    TF's join (``initialize_accelerator_system``) waits inside the runtime, holding
    Python's lock, for every client to register, with no timeout of its own; TF's
    preemption handling also catches SIGTERM. So no Python thread, exception or
    SIGTERM can end a client whose peer never starts: it would wait forever. A
    separate small process watches instead, and past the deadline prints what to
    check and ends this one (SIGKILL).
    """

    EXIT_MESSAGE = (
        "TofuStrategy: client {client} of {clients} could not join the cluster within {timeout:.0f} s: not every "
        "client started. Start the same script on every client ({others}), each with its own DTENSOR_CLIENT_ID "
        "and the same DTENSOR_JOBS, and check that the hosts reach each other on those ports; "
        + JOIN_TIMEOUT_ENV + " sets how long to wait.")
    _WATCH = ("import os, signal, sys, time\n"
              "pid, deadline, message = int(sys.argv[1]), time.monotonic() + float(sys.argv[2]), sys.argv[3]\n"
              "while time.monotonic() < deadline:\n"
              "    time.sleep(0.5)\n"
              "    try: os.kill(pid, 0)\n"
              "    except OSError: sys.exit(0)\n"
              "sys.stderr.write('E ' + message + '\\n'); sys.stderr.flush()\n"
              "os.kill(pid, signal.SIGKILL)\n")

    def __init__(self, cluster: cluster_lib.Cluster, timeout_s: float):
        others = ", ".join(job for i, job in enumerate(cluster.jobs) if i != cluster.client_id)
        message = self.EXIT_MESSAGE.format(client=cluster.client_id, clients=cluster.num_clients,
                                           timeout=timeout_s, others=others)
        self._start = time.monotonic()
        self._watcher = subprocess.Popen([sys.executable, "-c", self._WATCH, str(os.getpid()), str(timeout_s),
                                          message], stdin=subprocess.DEVNULL)

    def cancel(self) -> None:
        self._watcher.kill()
        self._watcher.wait()

    def elapsed_s(self) -> float:
        return time.monotonic() - self._start


def _check_joined(cluster: cluster_lib.Cluster, device_type: str, num_devices: int) -> None:
    from tensorflow.experimental import dtensor
    have = dtensor.num_local_devices(device_type)
    if have != num_devices or dtensor.num_clients() != cluster.num_clients:
        raise DeviceSetupError(
            f"DTensor's runtime already runs with {have} {device_type} device(s) per client on "
            f"{dtensor.num_clients()} client(s), and this TofuStrategy asks for {num_devices} on "
            f"{cluster.num_clients}: give every TofuStrategy of a process the same num_gpus.")


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


def host_device() -> str:
    """This process's host CPU as a full device name (``/job:worker/replica:0/task:1/device:CPU:0``
    on client 1 of a cluster; ``/job:localhost/...`` in one process): where a value is
    built whole before it is split over the mesh."""
    from tensorflow.experimental import dtensor
    return f"/job:{dtensor.job_name()}/replica:0/task:{dtensor.client_id()}/device:CPU:0"


_agreements = 0   # checks made so far in this process: each one's keys are its own


class ClientsDisagreeError(TofuError, RuntimeError):
    """The clients of a multi-client run computed different values where they must agree."""


def check_clients_agree(what: str, digest: bytes, device_set: DeviceSet, *, timeout_s: float = 300.0) -> None:
    """Raise ``ClientsDisagreeError`` unless every client of ``device_set``'s cluster passed
    the same ``digest`` for ``what``; nothing to do in one process.

    Every client must call this at the same point, in the same order. The digests go
    through the key-value store of TF's coordination service (which DTensor's
    multi-client runtime starts), not through a collective: a collective over clients
    that disagree on the mesh would itself be malformed, and a second mesh would meet
    the first one's variables in DTensor's programs, which refuse mixed meshes.
    """
    cluster = device_set.cluster
    if not cluster.is_multi_client:
        return
    from tensorflow.python.eager import context
    global _agreements
    _agreements += 1
    key = f"tofu_tf/{what}/{_agreements}"
    context.context().set_config_key_value(f"{key}/{cluster.client_id}", digest.hex())
    per_client = [bytes.fromhex(context.context().get_config_key_value(f"{key}/{client}", int(timeout_s * 1000)))
                  for client in range(cluster.num_clients)]
    groups: dict[bytes, list[int]] = {}
    for client, row in enumerate(per_client):
        groups.setdefault(row, []).append(client)
    if len(groups) > 1:
        described = "; ".join(f"client{'s' if len(clients) > 1 else ''} {', '.join(map(str, clients))}: {value[:6].hex()}"
                              for value, clients in groups.items())
        raise ClientsDisagreeError(
            f"the clients of this run made different {what} ({described}), so they would run different "
            "programs on one mesh. Run the same script with the same flags, data shapes and package versions on "
            "every client, or make the plan once (tofu-plan) and pass it to every client: "
            "TofuStrategy(plan='plan.json').")
