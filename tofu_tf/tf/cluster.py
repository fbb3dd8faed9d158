"""Which processes train together: DTensor's multi-client cluster, read from the
environment.

A run across hosts is the same training script started once per host (a
*client*). DTensor joins the clients into one runtime from four environment
variables, which this module reads and checks before anything starts, so a
typo fails at once with the variable's name instead of as a hang or a TF
"unknown device" at the first step:

* ``DTENSOR_JOBS``: ``host:port`` of every client, in client order, the same
  list on every client (its length is the number of clients);
* ``DTENSOR_CLIENT_ID``: this client's index into that list;
* ``DTENSOR_NUM_CLIENTS`` (optional): the number of clients, checked against
  ``DTENSOR_JOBS``;
* ``DTENSOR_JOB_NAME`` (optional): the TF job name, ``worker`` by default.

A ``TF_CONFIG`` as TF's multi-worker strategies read it (``{"cluster":
{"worker": [...]}, "task": {"type": "worker", "index": i}}``) is mapped onto
them when they are not set. With neither, the run is one client: DTensor's
local mode.

DTensor reads these variables itself (``tf.experimental.dtensor.jobs()``,
``client_id()``); this module only validates them and fills them from
``TF_CONFIG``, so the two never disagree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from tofu_tf.errors import TofuError

JOBS_ENV = "DTENSOR_JOBS"
CLIENT_ID_ENV = "DTENSOR_CLIENT_ID"
NUM_CLIENTS_ENV = "DTENSOR_NUM_CLIENTS"
JOB_NAME_ENV = "DTENSOR_JOB_NAME"
TF_CONFIG_ENV = "TF_CONFIG"

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


class ClusterConfigError(TofuError, ValueError):
    """The environment describes a multi-client cluster that cannot be formed."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The clients of one run and which of them this process is."""

    jobs: tuple[str, ...]     # "host:port" per client, in client order
    client_id: int
    job_name: str = "worker"

    @property
    def num_clients(self) -> int:
        return len(self.jobs)

    @property
    def is_multi_client(self) -> bool:
        return self.num_clients > 1

    @property
    def is_leader(self) -> bool:
        """Client 0: the one that writes files every client would write alike."""
        return self.client_id == 0


LOCAL = Cluster(jobs=(), client_id=0, job_name="localhost")


def from_environment(environ=None) -> Cluster:
    """The cluster the environment describes (``LOCAL`` when it describes none).

    ``TF_CONFIG`` is mapped onto the ``DTENSOR_*`` variables of ``environ`` (by
    default ``os.environ``, which DTensor reads) when ``DTENSOR_JOBS`` is unset.
    Raises ``ClusterConfigError`` naming the variable that is wrong and its fix.
    """
    environ = os.environ if environ is None else environ
    if not environ.get(JOBS_ENV) and environ.get(TF_CONFIG_ENV):
        environ.update(_dtensor_variables_from_tf_config(environ[TF_CONFIG_ENV]))
    raw_jobs = environ.get(JOBS_ENV, "").strip()
    if not raw_jobs:
        for name, alone in ((CLIENT_ID_ENV, "0"), (NUM_CLIENTS_ENV, "1")):
            if environ.get(name, "").strip() not in ("", alone):
                raise ClusterConfigError(
                    f"{name}={environ[name]!r} is set but {JOBS_ENV} is not: set {JOBS_ENV} to the "
                    "comma-separated host:port of every client (the same list on every client), or unset "
                    f"{name} to train in one process.")
        return LOCAL
    jobs = tuple(job.strip() for job in raw_jobs.split(","))
    bad = [job for job in jobs if not _ADDRESS.match(job) or not 0 < int(job.rsplit(":", 1)[1]) < 65536]
    if bad:
        raise ClusterConfigError(
            f"{JOBS_ENV}={raw_jobs!r}: {', '.join(repr(job) for job in bad)} is not host:port. Give every client "
            f"as host:port, comma-separated, e.g. {JOBS_ENV}=host0:12345,host1:12345.")
    if len(set(jobs)) != len(jobs):
        raise ClusterConfigError(f"{JOBS_ENV}={raw_jobs!r} names an address twice: each client needs its own "
                                 "host:port.")
    num_clients = environ.get(NUM_CLIENTS_ENV, "").strip()
    if num_clients and num_clients != str(len(jobs)):
        raise ClusterConfigError(
            f"{NUM_CLIENTS_ENV}={num_clients!r} but {JOBS_ENV} lists {len(jobs)} client(s): make them agree "
            f"(or unset {NUM_CLIENTS_ENV}; the length of {JOBS_ENV} is the number of clients).")
    raw_id = environ.get(CLIENT_ID_ENV, "").strip()
    if not raw_id.isdigit() or int(raw_id) >= len(jobs):
        raise ClusterConfigError(
            f"{CLIENT_ID_ENV}={raw_id!r}: each client needs its index into {JOBS_ENV}, an integer from 0 to "
            f"{len(jobs) - 1}, different on every client.")
    return Cluster(jobs=jobs, client_id=int(raw_id), job_name=environ.get(JOB_NAME_ENV, "").strip() or "worker")


def _dtensor_variables_from_tf_config(text: str) -> dict[str, str]:
    """``DTENSOR_*`` values for a ``TF_CONFIG`` of workers (its chief, if any, first)."""
    try:
        config = json.loads(text)
        cluster, task = config["cluster"], config["task"]
        order = [kind for kind in ("chief", "worker") if kind in cluster]
        if set(cluster) - {"chief", "worker"} or not order or task["type"] not in order:
            raise ValueError
        jobs = [address for kind in order for address in cluster[kind]]
        offset = sum(len(cluster[kind]) for kind in order[: order.index(task["type"])])
        client_id = offset + int(task.get("index", 0))
    except (ValueError, KeyError, TypeError) as error:
        raise ClusterConfigError(
            f"{TF_CONFIG_ENV} does not describe a cluster of workers: TofuStrategy reads "
            '{"cluster": {"worker": ["host0:port", ...]}, "task": {"type": "worker", "index": i}} '
            f"(a \"chief\" list may precede the workers; parameter servers are not supported). "
            f"Fix it or set {JOBS_ENV} and {CLIENT_ID_ENV} instead.") from error
    return {JOBS_ENV: ",".join(jobs), CLIENT_ID_ENV: str(client_id)}
