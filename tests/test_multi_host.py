"""TofuStrategy across processes: DTensor's multi-client runtime on loopback.

Every run here is ``tests/multi_host_worker.py`` started as two clients of four
virtual CPUs each (one mesh of eight devices) by ``tofu_tf.launch.launch_local``:
127.0.0.1, ports picked at run time, a bound on the time, and every process
ended by its id. The reference is one device, trained in this process on the
global batch. Those runs are marked slow; the checks of the cluster environment are not.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tofu_tf import launch
from tofu_tf.tf import cluster as cluster_lib
from tests import strategy_helpers as h

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = [sys.executable, "-m", "tests.multi_host_worker"]
# A two-client run of a small model takes 10-20 s on two cores; the bound leaves room for a
# loaded CI machine without letting a hang stall the suite.
TIMEOUT_S = 240


def _env():
    return {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "TF_CPP_MIN_LOG_LEVEL": "2",
            "TOFU_PLAN_CACHE": "off"}


def _run_clients(work_dir, *flags, clients=2, grace_s=90.0):
    results = launch.launch_local(WORKER + [f"--work_dir={work_dir}", *flags], clients, timeout_s=TIMEOUT_S,
                                  grace_s=grace_s, env=_env())
    return results


def _run_one(work_dir, *flags):
    """The worker as one process (DTensor's local mode) with eight devices."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DTENSOR_")}
    env.update(_env())
    return subprocess.run(WORKER + [f"--work_dir={work_dir}", "--num_gpus=8", *flags], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def _assert_ok(results):
    for result in results:
        assert result.returncode == 0, f"client {result.client_id}:\n{result.output[-4000:]}"


def _weights(work_dir, client=0):
    return list(np.load(os.path.join(work_dir, f"weights_{client}.npz")).values())


def _prepare(work_dir, name):
    """initial.npz and data.npz for the workers; one device's weights after STEPS steps."""
    initial, final, _, (x, y) = h.reference_run(name)
    np.savez(os.path.join(work_dir, "initial.npz"), *initial)
    np.savez(os.path.join(work_dir, "data.npz"), x=x, y=y)
    return initial, final


@pytest.mark.slow
@pytest.mark.parametrize("name,method,mesh,data", [("mlp", "megatron", "model=8", "--nodataset"),
                                                    ("transformer", "tofu", "batch=2,model=4", "--dataset")])
def test_two_clients_train_as_one_device(tmp_path, name, method, mesh, data):
    """Two clients of four devices train three steps as one device does on the global batch
    (numpy arrays; a tf.data.Dataset), and end with the same weights, bit for bit. The MLP's
    kernels are split over all eight devices, across the two clients. Each client plans for
    nodes of its own four devices."""
    initial, final = _prepare(tmp_path, name)
    _assert_ok(_run_clients(tmp_path, f"--model={name}", f"--method={method}", f"--mesh={mesh}", data))
    mine, theirs = _weights(tmp_path, 0), _weights(tmp_path, 1)
    for got, other in zip(mine, theirs):
        np.testing.assert_array_equal(got, other)
    for got, want, start in zip(mine, final, initial):
        assert not np.array_equal(want, start)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for client in (0, 1):                       # save_weights on every client, read on one device
        saved = h.build(name)
        saved.load_weights(str(tmp_path / f"weights_{client}.h5"))
        for got, want in zip(saved.get_weights(), mine):
            np.testing.assert_array_equal(got, want)
    layouts = (tmp_path / "layouts_0.txt").read_text()
    specs = [line.split()[1:] for line in layouts.splitlines()[2:]]
    assert any(axis != "unsharded" for spec in specs for axis in spec), layouts   # some weight is split
    assert layouts.startswith("# devices per node 4\n"), layouts
    # Model Garden's and Orbit's questions: every client checkpoints (its shards, one directory),
    # only the first writes summaries, every client initializes.
    for client, summary in ((0, True), (1, False)):
        asked = (tmp_path / f"layouts_{client}.txt").read_text().splitlines()[1]
        assert asked == f"# checkpoint True summary {summary} init True", asked


@pytest.mark.slow
def test_checkpoint_moves_between_two_clients_and_one_process(tmp_path):
    """A checkpoint written by two clients restores in one process of eight devices and on one
    device without the strategy, and one written by the eight-device process restores in two
    clients: weights and optimizer slots bit-exact."""
    _prepare(tmp_path, "mlp")
    _assert_ok(_run_clients(tmp_path, "--model=mlp", "--method=megatron", "--mesh=model=8", f"--save={tmp_path / 'two' / 'ckpt'}"))
    two = _weights(tmp_path)
    one = _run_one(tmp_path, "--model=mlp", "--method=megatron", "--mesh=model=8", f"--restore={tmp_path / 'two' / 'ckpt'}", "--steps=0",
                   f"--save={tmp_path / 'one' / 'ckpt'}")
    assert one.returncode == 0, one.stderr[-4000:]
    restored = _weights(tmp_path)
    assert len(restored) == len(two) > 6    # weights and momentum slots
    for got, want in zip(restored, two):
        np.testing.assert_array_equal(got, want)
    alone = h.build("mlp")                   # one device, no strategy
    h.compile_model(alone)
    alone.optimizer.build(alone.trainable_variables)
    tf.train.Checkpoint(model=alone, optimizer=alone.optimizer).read(str(tmp_path / "two" / "ckpt")).assert_consumed()
    values = alone.get_weights() + [v.numpy() for v in alone.optimizer.variables()[1:]]
    for got, want in zip(values, two):
        np.testing.assert_array_equal(got, want)
    _assert_ok(_run_clients(tmp_path, "--model=mlp", "--method=megatron", "--mesh=model=8", f"--restore={tmp_path / 'one' / 'ckpt'}", "--steps=0"))
    for client in (0, 1):
        for got, want in zip(_weights(tmp_path, client), two):
            np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_a_client_that_dies_fails_the_other_in_bounded_time(tmp_path):
    """Client 1 exits after planning; client 0, waiting in its first step's collectives,
    fails (TF's coordination service misses client 1's heartbeats) instead of hanging."""
    _prepare(tmp_path, "mlp")
    results = _run_clients(tmp_path, "--model=mlp", "--method=megatron", "--mesh=model=8", "--die_after_plan", grace_s=60.0)
    assert results[1].returncode == 3
    assert results[0].returncode not in (0, None), results[0].output[-4000:]
    assert "unhealthy" in results[0].output or "heartbeat" in results[0].output, results[0].output[-4000:]


@pytest.mark.slow
def test_clients_that_plan_differently_are_refused(tmp_path):
    """Client 1 plans another mesh: both refuse before any variable is laid out on it."""
    _prepare(tmp_path, "mlp")
    results = _run_clients(tmp_path, "--model=mlp", "--mesh=batch=2,model=4", "--client1_mesh=model=8")
    for result in results:
        assert result.returncode == 1, result.output[-4000:]
        assert "ClientsDisagreeError: the clients of this run made different plans (client 0: " in result.output


@pytest.mark.slow
def test_a_client_whose_peer_never_starts_ends_in_bounded_time(tmp_path):
    """Only client 0 of two starts: TF's join waits forever (holding Python's lock, SIGTERM
    caught), so the strategy's watchdog ends the process after the join timeout, saying why."""
    _prepare(tmp_path, "mlp")
    env = dict(os.environ, **_env(), TOFU_TF_CLUSTER_JOIN_TIMEOUT_S="5",
               **launch.client_environment([f"127.0.0.1:{port}" for port in launch.free_ports(2)], 0))
    result = subprocess.run(WORKER + [f"--work_dir={tmp_path}"], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert result.returncode == -9, result.stderr[-4000:]
    assert "client 0 of 2 could not join the cluster within 5 s" in result.stderr, result.stderr[-4000:]


@pytest.mark.parametrize("environ,message", [
    ({"DTENSOR_JOBS": "127.0.0.1:1234,127.0.0.1", "DTENSOR_CLIENT_ID": "0"}, "is not host:port"),
    ({"DTENSOR_JOBS": "127.0.0.1:1234,127.0.0.1:1235", "DTENSOR_CLIENT_ID": "2"}, "from 0 to 1"),
    ({"DTENSOR_JOBS": "127.0.0.1:1234,127.0.0.1:1235"}, "DTENSOR_CLIENT_ID=''"),
    ({"DTENSOR_JOBS": "127.0.0.1:1234,127.0.0.1:1235", "DTENSOR_CLIENT_ID": "1", "DTENSOR_NUM_CLIENTS": "3"},
     "lists 2 client"),
    ({"DTENSOR_JOBS": "127.0.0.1:1234,127.0.0.1:1234", "DTENSOR_CLIENT_ID": "1"}, "names an address twice"),
    ({"DTENSOR_CLIENT_ID": "1"}, "DTENSOR_JOBS is not"),
    ({"TF_CONFIG": '{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}'}, "parameter servers"),
])
def test_malformed_cluster_environment_is_refused(environ, message):
    with pytest.raises(cluster_lib.ClusterConfigError, match=message):
        cluster_lib.from_environment(dict(environ))


def test_tf_config_maps_onto_dtensor_variables():
    environ = {"TF_CONFIG": '{"cluster": {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]}, '
                            '"task": {"type": "worker", "index": 1}}'}
    cluster = cluster_lib.from_environment(environ)
    assert cluster.jobs == ("h0:1", "h1:1", "h2:1") and cluster.client_id == 2
    assert environ["DTENSOR_JOBS"] == "h0:1,h1:1,h2:1" and environ["DTENSOR_CLIENT_ID"] == "2"
    assert cluster_lib.from_environment({}) is cluster_lib.LOCAL


@pytest.mark.slow
def test_two_clients_start_from_one_devices_seeded_weights(tmp_path):
    """Two clients of four devices, the MLP's kernels split over all eight (issue #39): the
    weights the seeded initializers draw are one device's, bit for bit, on both clients.
    Each client draws a split weight whole on its host and keeps its own devices' shards."""
    expected = h.build("mlp").get_weights()
    _assert_ok(_run_clients(tmp_path, "--model=mlp", "--method=megatron", "--mesh=model=8", "--steps=0",
                            "--seeded_initial"))
    layouts = open(os.path.join(tmp_path, "layouts_0.txt")).read()
    assert " model" in layouts, layouts
    for client in (0, 1):
        got = _weights(tmp_path, client)[:len(expected)]
        for value, want in zip(got, expected):
            np.testing.assert_array_equal(value, want)
