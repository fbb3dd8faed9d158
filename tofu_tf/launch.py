"""Run one training script as several DTensor clients on this machine.

    tofu-launch --clients=2 -- python examples/train_mlp.py --num_gpus=4
    python -m tofu_tf.launch --clients=2 -- python examples/train_mlp.py --num_gpus=4   # the same

starts the command once per client with the ``DTENSOR_*`` environment a
multi-host run gives each host (``tofu_tf.tf.cluster``), on 127.0.0.1 with
free ports picked now, prefixes each client's output with its id, and waits.
It is for trying a multi-host run on one machine (and for the tests); on real
hosts start the same command on each host with the environment set as this
module sets it (``client_environment``; see README, "More than one host").

A client that fails leaves the others waiting on collectives that will never
complete; they are given ``grace_s`` to fail on their own and are then ended,
every process group by its id, as are all clients when ``timeout_s`` passes.
The exit status is the first failing client's, or 0.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from absl import app, flags, logging


@dataclasses.dataclass(frozen=True)
class ClientResult:
    client_id: int
    returncode: int | None    # None: ended by the launcher
    output: str               # stdout and stderr together


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (the OS picks them)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def client_environment(jobs: Sequence[str], client_id: int, job_name: str = "worker") -> dict[str, str]:
    """The environment variables client ``client_id`` of ``jobs`` (``host:port`` each) runs with."""
    return {"DTENSOR_JOBS": ",".join(jobs), "DTENSOR_CLIENT_ID": str(client_id),
            "DTENSOR_NUM_CLIENTS": str(len(jobs)), "DTENSOR_JOB_NAME": job_name}


def launch_local(command: Sequence[str], num_clients: int, *, timeout_s: float = 600.0, grace_s: float = 90.0,
                 env: dict[str, str] | None = None, echo: bool = False) -> list[ClientResult]:
    """Run ``command`` as ``num_clients`` clients of one cluster on 127.0.0.1 and wait for them.

    ``env`` adds to this process's environment. With ``echo``, each client's output is
    printed as it comes, prefixed ``[client i]``. Every process started is ended by the
    time this returns.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    jobs = [f"127.0.0.1:{port}" for port in free_ports(num_clients)]
    processes, outputs, readers = [], [], []
    for client_id in range(num_clients):
        client_env = dict(os.environ, **(env or {}), **client_environment(jobs, client_id))
        process = subprocess.Popen(list(command), env=client_env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        processes.append(process)
        outputs.append([])
        reader = threading.Thread(target=_collect, args=(process.stdout, outputs[-1], client_id, echo),
                                  daemon=True)
        reader.start()
        readers.append(reader)
    ended = _wait(processes, timeout_s=timeout_s, grace_s=grace_s)
    for reader in readers:
        reader.join(timeout=10)
    return [ClientResult(i, None if i in ended else process.returncode, "".join(outputs[i]))
            for i, process in enumerate(processes)]


def _collect(stream, lines: list, client_id: int, echo: bool) -> None:
    for line in stream:
        lines.append(line)
        if echo:
            sys.stdout.write(f"[client {client_id}] {line}")
            sys.stdout.flush()


def _wait(processes, *, timeout_s: float, grace_s: float) -> set[int]:
    """Wait for every process; end the rest ``grace_s`` after one fails, or all at
    ``timeout_s``. Returns the indices of the processes this ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [process.poll() for process in processes]
        if all(code is not None for code in codes):
            return set()
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.monotonic() + grace_s)
            grace_s = float("inf")   # the first failure sets the deadline
        if time.monotonic() >= deadline:
            return _end(processes)
        time.sleep(0.2)


def _end(processes) -> set[int]:
    ended = set()
    for index, process in enumerate(processes):
        if process.poll() is None:
            ended.add(index)
            logging.warning("ending client %d (pid %d), still running", index, process.pid)
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in processes:
        process.wait()
    return ended


def define_flags() -> None:
    """The launcher's flags (defined when it runs, not when this module is imported)."""
    flags.DEFINE_integer("clients", 2, "Clients (processes) to start.")
    flags.DEFINE_float("timeout_s", 3600.0, "End every client after this many seconds.")
    flags.DEFINE_float("grace_s", 90.0, "After a client fails, end the others after this many seconds.")


def main(argv) -> int:
    command = argv[1:]
    if not command:
        raise app.UsageError("give the command to run after --, e.g. "
                             "tofu-launch --clients=2 -- python examples/train_mlp.py --num_gpus=4")
    results = launch_local(command, flags.FLAGS.clients, timeout_s=flags.FLAGS.timeout_s,
                           grace_s=flags.FLAGS.grace_s, echo=True)
    for result in results:
        state = "ended by the launcher" if result.returncode is None else f"exit status {result.returncode}"
        print(f"client {result.client_id}: {state}")
    failed = [r for r in results if r.returncode != 0]
    return (failed[0].returncode or 1) if failed else 0


def entry_point() -> None:
    """The ``tofu-launch`` console script."""
    define_flags()
    app.run(main)


if __name__ == "__main__":
    entry_point()
