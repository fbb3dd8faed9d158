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
