"""BUILD names every Python file of the packages, examples, benches and tests; setup.py and
BUILD both make the strategies/ folder the package tofu_tf.strategies."""

import glob
import os
import re
import runpy
import sys

import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tofu_tf", "strategies", "examples", "bench", "tests")


def _python_files():
    found = set()
    for package in PACKAGES:
        for path in glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True):
            found.add(os.path.relpath(path, ROOT))
    return found


def _named_in_build():
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as handle:
        return set(re.findall(r'"([^"]+\.py)"', handle.read()))


def test_every_python_file_has_a_build_target():
    missing = sorted(_python_files() - _named_in_build())
    assert not missing, f"add these files to a BUILD target: {missing}"


def test_build_names_no_missing_file():
    stale = sorted(p for p in _named_in_build() if not os.path.exists(os.path.join(ROOT, p)))
    assert not stale, f"BUILD names files that do not exist: {stale}"


def test_every_test_file_is_a_py_test():
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as handle:
        text = handle.read()
    for path in glob.glob(os.path.join(ROOT, "tests", "test_*.py")):
        name = os.path.splitext(os.path.basename(path))[0]
        assert re.search(r'py_test\(\s*name = "%s"' % name, text), f"{name} has no py_test target"


def test_the_genrule_copies_every_file_of_the_strategies_folder():
    """setup.py installs strategies/ as tofu_tf.strategies; BUILD copies STRATEGIES_SRCS to
    tofu_tf/strategies/ for the same: a file missing from the list would not be importable."""
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as handle:
        text = handle.read()
    listed = re.search(r"^STRATEGIES_SRCS = \[(.*?)\]", text, re.S | re.M).group(1)
    on_disk = {p for p in _python_files() if p.startswith("strategies" + os.sep)}
    assert set(re.findall(r'"([^"]+\.py)"', listed)) == on_disk
    assert 'outs = ["tofu_tf/" + src for src in STRATEGIES_SRCS]' in text
    assert re.search(r'py_library\(\s*name = "tofu_tf_strategies",\s*srcs = \[":tofu_tf_strategies_files"\]', text)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_pip_requirement_build_names_is_pinned_in_the_lock_module_bazel_reads():
    """BUILD's requirement("x") labels resolve through MODULE.bazel's pip hub, which installs
    requirements_lock.txt: a name missing there would fail only when Bazel runs."""
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as handle:
        build = handle.read()
    with open(os.path.join(ROOT, "MODULE.bazel"), encoding="utf-8") as handle:
        module = handle.read()
    with open(os.path.join(ROOT, "requirements_lock.txt"), encoding="utf-8") as handle:
        pinned = {_canonical(line.split("==")[0]) for line in handle if "==" in line and not line.startswith("#")}
    hub = re.search(r'load\("@(\w+)//:requirements.bzl"', build).group(1)
    assert f'hub_name = "{hub}"' in module and 'requirements_lock = "//:requirements_lock.txt"' in module
    missing = sorted({_canonical(n) for n in re.findall(r'requirement\("([^"]+)"\)', build)} - pinned)
    assert not missing, f"pin these in requirements_lock.txt: {missing}"


def test_setup_installs_the_strategies_folder_as_tofu_tf_strategies_and_no_top_level_package(monkeypatch):
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **arguments: captured.update(arguments))
    monkeypatch.setattr(sys, "argv", ["setup.py"])
    monkeypatch.chdir(ROOT)         # find_packages reads the current directory
    runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
    packages = set(captured["packages"])
    assert {"tofu_tf", "tofu_tf.tf", "tofu_tf.strategies"} <= packages
    assert all(name == "tofu_tf" or name.startswith("tofu_tf.") for name in packages), sorted(packages)
    assert captured["package_dir"] == {"tofu_tf.strategies": "strategies"}
    # setuptools >= 69 builds the PEP 660 editable install whose finder maps that entry.
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as handle:
        assert 'requires = ["setuptools>=69", "wheel"]' in handle.read()
