"""The check of the installed TensorFlow and Keras releases (tofu_tf/versions.py): silent in the
tested ranges, a warning outside them, an error below the minimum; setup.py pins the same ranges.
Installed versions are faked through ``versions.installed_version``, never installed."""

import logging
import os
import runpy
import subprocess
import sys

import pytest
import setuptools

from tofu_tf import versions
from tofu_tf.errors import TofuError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN_RANGE = {"tensorflow": "2.21.0", "tf-keras": "2.21.0", "keras": "3.15.1", "keras-hub": "0.32.0"}


@pytest.fixture
def installed(monkeypatch):
    """Fakes the installed versions: returns the dict the check reads (None: not installed)."""
    monkeypatch.delenv(versions.SKIP_ENV, raising=False)
    fake = dict(IN_RANGE)
    monkeypatch.setattr(versions, "installed_version", lambda name: fake.get(name))
    return fake


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_tested_releases_pass_silently(installed, caplog):
    with caplog.at_level(logging.WARNING, logger="absl"):
        assert versions.check_installed() == []
    assert _warnings(caplog) == []


def test_the_installed_packages_are_in_their_tested_ranges():
    # The real lookup: the environment the tests run in is a tested one.
    for name, tested in versions.TESTED.items():
        version = versions.installed_version(name)
        assert version is None or versions.in_range(version, tested), (name, version, tested)


@pytest.mark.parametrize("name, version", [("tensorflow", "2.22.0"), ("tensorflow", "2.20.1"),
                                           ("keras", "4.0.0"), ("keras-hub", "0.33.0rc1"),
                                           ("tf-keras", "2.19.0")])
def test_a_release_outside_the_tested_range_warns_with_what_to_do(installed, caplog, name, version):
    installed[name] = version
    with caplog.at_level(logging.WARNING, logger="absl"):
        logged = versions.check_installed()
    assert len(logged) == 1 and _warnings(caplog) == logged
    message = logged[0]
    tested = versions.TESTED[name]
    assert f"{name} {version}" in message and f"{name}{tested}" in message
    assert f"pip install '{name}{tested}'" in message and "TOFU_TF_SKIP_VERSION_CHECK=1" in message


def test_each_package_out_of_range_gets_its_own_warning(installed):
    installed.update({"tensorflow": "2.23.0", "keras": "4.1"})
    logged = versions.check_installed()
    assert len(logged) == 2
    assert "tensorflow 2.23.0 is installed" in logged[0] and "keras 4.1 is installed" in logged[1]


@pytest.mark.parametrize("name, version", [("tensorflow", "2.15.1"), ("tf-keras", "2.15.0"),
                                           ("keras", "2.15.0"), ("tensorflow", "1.15.5")])
def test_a_release_below_the_minimum_raises(installed, monkeypatch, name, version):
    installed[name] = version
    for environment in ({}, {versions.SKIP_ENV: "1"}):      # the variable does not silence it
        for key, value in environment.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(versions.UnsupportedVersionError) as raised:
            versions.check_installed()
        message = str(raised.value)
        minimum, _ = versions.MINIMUM[name]
        assert f"{name} {version}" in message and f"{name} {minimum} or newer" in message
        assert f"{name}{versions.TESTED[name]}" in message and "pip install" in message
    assert issubclass(versions.UnsupportedVersionError, TofuError)
    assert issubclass(versions.UnsupportedVersionError, RuntimeError)


def test_the_minimum_release_itself_only_warns(installed):
    installed.update({"tensorflow": "2.16.0", "tf-keras": "2.16.0", "keras": "3.0.0"})
    assert len(versions.check_installed()) == 3


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_the_environment_variable_silences_the_warning(installed, monkeypatch, caplog, value):
    installed.update({"tensorflow": "2.22.0", "keras": "4.0.0"})
    monkeypatch.setenv(versions.SKIP_ENV, value)
    with caplog.at_level(logging.WARNING, logger="absl"):
        assert versions.check_installed() == []
    assert _warnings(caplog) == []


def test_a_package_not_installed_is_skipped(installed):
    installed.update({"keras-hub": None})
    assert versions.check_installed() == []
    installed.update({"tensorflow": None, "tf-keras": None, "keras": None})
    assert versions.check_installed() == []


def test_versions_compare_by_release_numbers():
    assert versions.release("2.21.0rc1") == (2, 21, 0)
    assert versions.release("3.15.1.dev20250101+local") == (3, 15, 1)
    assert versions.in_range("2.21", ">=2.21,<2.22") and versions.in_range("2.21.7", ">=2.21,<2.22")
    assert not versions.in_range("2.22.0", ">=2.21,<2.22") and not versions.in_range("2.20.9", ">=2.21,<2.22")
    assert versions.in_range("3.99", ">=3.10,<4") and not versions.in_range("3.9.2", ">=3.10,<4")
    with pytest.raises(ValueError):
        versions.in_range("2.21", "~=2.21")
    with pytest.raises(ValueError):
        versions.release("unknown")


_FAKE_AND_IMPORT = """
import importlib.metadata, sys
real = importlib.metadata.version
importlib.metadata.version = lambda name: sys.argv[1] if name == "tensorflow" else real(name)
import tofu_tf.tf
print("imported")
"""


@pytest.mark.parametrize("version, outcome", [("2.21.0", "silent"), ("2.22.0", "warns"), ("2.15.0", "raises")])
def test_importing_the_tf_facing_part_runs_the_check(version, outcome):
    # A fresh interpreter: tofu_tf.tf runs the check once, when it is first imported.
    environment = {k: v for k, v in os.environ.items() if k != versions.SKIP_ENV}
    done = subprocess.run([sys.executable, "-c", _FAKE_AND_IMPORT, version], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=120)
    if outcome == "raises":
        assert done.returncode != 0 and "UnsupportedVersionError" in done.stderr
        assert "tensorflow 2.15.0" in done.stderr
    else:
        assert done.returncode == 0 and "imported" in done.stdout, done.stderr
        assert ("tensorflow 2.22.0 is installed" in done.stderr) == (outcome == "warns"), done.stderr


def _setup_arguments(monkeypatch):
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **arguments: captured.update(arguments))
    monkeypatch.setattr(sys, "argv", ["setup.py"])
    runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
    return captured


def test_setup_pins_the_tested_ranges(monkeypatch):
    arguments = _setup_arguments(monkeypatch)
    requirements = list(arguments["install_requires"])
    for extra in arguments["extras_require"].values():
        requirements += extra
    pins = {}
    for requirement in requirements:
        name = requirement.split(">")[0].split("<")[0].split("=")[0]
        if name in versions.TESTED:
            pins.setdefault(name, set()).add(requirement[len(name):])
    assert pins == {name: {tested} for name, tested in versions.TESTED.items()}
    for name in ("tensorflow", "tf-keras", "keras"):
        assert name + versions.TESTED[name] in arguments["install_requires"]
