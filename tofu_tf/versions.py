"""The releases of TensorFlow and Keras tofu_tf is tested with, and the check of the installed ones.

tofu_tf relies on the behaviour of particular releases: which ops TensorFlow's DTensor can
expand (``tofu_tf.search.targets``), the Keras internals the strategy works around
(docs/internals.md). Outside the tested releases a run may fail in ways that look like
tofu_tf's bugs, so ``check_installed`` runs when the TF-facing part (``tofu_tf.tf``) is first
imported and says so first:

* a package outside its tested range: an absl warning naming the package, its installed
  version, the tested range and the ``pip install`` that gives a tested one. Setting
  ``TOFU_TF_SKIP_VERSION_CHECK=1`` silences it, for whoever runs another release on purpose;
* a package below its ``MINIMUM``, a release tofu_tf cannot run on at all:
  ``UnsupportedVersionError``, with the same facts and the reason. The variable does not
  silence it: the run would only fail later, less clearly;
* a package that is not installed (keras-hub is optional): nothing.

``TESTED`` is the one copy of the ranges: setup.py reads it from this file's text (it runs
before the dependencies are installed, so it cannot import the package), which is why it must
stay a plain literal. Nothing here imports TensorFlow: versions come from the installed
distributions' metadata.
"""

from __future__ import annotations

import importlib.metadata
import os
import re

from tofu_tf.errors import TofuError

# Distribution name -> the release range tofu_tf is tested with (a pip specifier).
TESTED = {
    "tensorflow": ">=2.21,<2.22",
    "tf-keras": ">=2.21,<2.22",
    "keras": ">=3.10,<4",
    "keras-hub": ">=0.32,<0.33",
    "tensorboard": ">=2.21,<2.22",
}

# Distribution name -> (the oldest release tofu_tf can run on at all, why). keras-hub has no
# minimum: only the tests, the benchmarks and tofu_tf.hub_models use it.
MINIMUM = {
    "tensorflow": ("2.16", "TensorFlow 2.15 and older require Keras 2 under the name keras, "
                           "and tofu_tf needs Keras 3 beside tf-keras"),
    "tf-keras": ("2.16", "tf-keras 2.N runs on TensorFlow 2.N only, and TensorFlow must be 2.16 or newer"),
    "keras": ("3.0", "Keras 2 under the name keras is tf.keras, whose models tofu_tf would take for Keras 3's"),
}

SKIP_ENV = "TOFU_TF_SKIP_VERSION_CHECK"
_SKIP_VALUES = ("1", "true", "yes", "on")

_SPECIFIER = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")
_RELEASE = re.compile(r"\s*v?(?:\d+!)?(\d+(?:\.\d+)*)")


class UnsupportedVersionError(TofuError, RuntimeError):
    """An installed package is older than the oldest release tofu_tf can run on."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.21.0rc1"`` -> ``(2, 21, 0)``.

    Pre-, post- and dev-release tags and local labels are dropped, so a release candidate
    counts as the release it leads to.

    Raises:
        ValueError: ``version`` does not start with a release number.
    """
    match = _RELEASE.match(version)
    if not match:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _compare(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (a > b) - (a < b)


_OPERATORS = {
    ">=": lambda c: c >= 0, ">": lambda c: c > 0, "<=": lambda c: c <= 0,
    "<": lambda c: c < 0, "==": lambda c: c == 0, "!=": lambda c: c != 0,
}


def in_range(version: str, specifier: str) -> bool:
    """Whether ``version`` meets every clause of ``specifier`` (``">=2.21,<2.22"``), comparing
    release numbers only (see ``release``)."""
    installed = release(version)
    for clause in specifier.split(","):
        match = _SPECIFIER.match(clause)
        if not match:
            raise ValueError(f"unsupported version clause {clause!r} in {specifier!r}")
        operator, bound = match.groups()
        if not _OPERATORS[operator](_compare(installed, release(bound))):
            return False
    return True


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _install_hint(distribution: str) -> str:
    return f"pip install '{distribution}{TESTED[distribution]}'"


def check_installed() -> list[str]:
    """Checks the installed TensorFlow and Keras packages against ``TESTED`` and ``MINIMUM``.

    Returns:
        The warnings logged (empty when every installed package is in its tested range, or when
        ``TOFU_TF_SKIP_VERSION_CHECK`` is set).

    Raises:
        UnsupportedVersionError: an installed package is older than its ``MINIMUM``, whatever
            the environment says.
    """
    from absl import logging

    skip = os.environ.get(SKIP_ENV, "").strip().lower() in _SKIP_VALUES
    warnings = []
    for distribution, tested in TESTED.items():
        version = installed_version(distribution)
        if version is None:
            continue
        if distribution in MINIMUM:
            minimum, why = MINIMUM[distribution]
            if _compare(release(version), release(minimum)) < 0:
                raise UnsupportedVersionError(
                    f"tofu_tf cannot run on {distribution} {version}: it needs {distribution} {minimum} "
                    f"or newer ({why}) and is tested with {distribution}{tested}. Install a tested "
                    f"version: {_install_hint(distribution)}")
        if skip or in_range(version, tested):
            continue
        message = (
            f"tofu_tf is tested with {distribution}{tested}, and {distribution} {version} is "
            f"installed: it may work, but TofuStrategy and capture rely on the behaviour of the tested "
            f"releases. Install a tested version ({_install_hint(distribution)}), or set "
            f"{SKIP_ENV}=1 to silence this warning.")
        logging.warning(message)
        warnings.append(message)
    return warnings
