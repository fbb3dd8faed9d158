"""BUILD names every Python file of the packages, examples, benches and tests."""

import glob
import os
import re

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
