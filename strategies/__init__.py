"""tf.distribute strategies built on the tofu_tf engine: the package ``tofu_tf.strategies``.

This folder is installed as ``tofu_tf.strategies`` (setup.py's ``package_dir``; BUILD copies
it to ``tofu_tf/strategies/``); there is no top-level ``strategies`` package. Dependencies flow
one way: these modules import tofu_tf's, never the reverse (``tofu_tf.TofuStrategy`` is a lazy
re-export resolved at attribute access; tests/test_imports.py checks both).
"""

if __name__ != "tofu_tf.strategies":
    # Imported as a top-level ``strategies`` (the repository root on sys.path): its modules
    # would load a second time, beside tofu_tf.strategies', with their own Keras hooks.
    raise ImportError(f"{__file__} is the package tofu_tf.strategies, imported here as {__name__!r}: "
                      "import tofu_tf.strategies (or `from tofu_tf import TofuStrategy`)")

from tofu_tf.strategies.tofu_strategy import TofuStrategy  # noqa: E402

__all__ = ["TofuStrategy"]
