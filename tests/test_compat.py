"""The compatibility layer (tofu_tf.tf.compat): every change to TensorFlow and Keras objects
registered, its targets present in the installed releases, listed in docs/compatibility.md,
undone when its scope ends, and listed on the strategy that made it."""

import gc
import importlib.util
import logging
import os
import re
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tofu_tf import versions
from tofu_tf.tf import compat
from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat import process as compat_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = [entry.name for entry in compat.CHANGES]


def test_change_names_are_unique_identifiers():
    assert len(NAMES) == len(set(NAMES))
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", name) for name in NAMES), NAMES
    with pytest.raises(KeyError, match="no registered change 'no_such_change'"):
        compat.change("no_such_change")


@pytest.mark.parametrize("name", NAMES)
def test_every_target_exists_in_the_installed_releases(name):
    """A TensorFlow or Keras upgrade that renames or moves what a change relies on fails here,
    naming the change and the releases, before any model trains on the missing attribute."""
    entry = compat.change(name)
    assert entry.targets and entry.packages
    installed = ", ".join(f"{package} {versions.installed_version(package)}" for package in entry.packages)
    for target in entry.targets:
        try:
            compat.resolve(target)
        except (ImportError, AttributeError) as error:
            pytest.fail(f"the change {name!r} relies on {target}, which the installed releases ({installed}) "
                        f"do not have ({error}); it was checked on {entry.checked_on}. Update "
                        f"{entry.site} and tofu_tf/tf/compat/registry.py for the new release.")


@pytest.mark.parametrize("name", NAMES)
def test_the_module_making_each_change_names_it(name):
    """The registry names the module that makes a change, and that module names the change back."""
    entry = compat.change(name)
    spec = importlib.util.find_spec(entry.site)
    assert spec is not None and spec.origin, entry.site
    with open(spec.origin, encoding="utf-8") as handle:
        assert f'"{name}"' in handle.read(), f"{entry.site} does not name the change {name!r}"


def _documented() -> dict[str, str]:
    """change name -> scope, from the rows of docs/compatibility.md's table of changes."""
    with open(os.path.join(ROOT, "docs", "compatibility.md"), encoding="utf-8") as handle:
        text = handle.read()
    section = text.split("## The changes", 1)[1]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|[^\n]*?\| ([a-z -]+) \|", section, flags=re.MULTILINE)
    return dict(rows)


def test_the_documentation_lists_every_registered_change():
    documented = _documented()
    assert list(documented) == NAMES, (
        f"docs/compatibility.md lists {sorted(set(documented) - set(NAMES))} that are not registered and "
        f"misses {sorted(set(NAMES) - set(documented))} (the table follows the registry's order)")
    assert documented == {entry.name: entry.scope.value for entry in compat.CHANGES}


def test_checked_on_reads_the_tested_ranges():
    entry = compat.change("summary_before_plan")
    assert entry.checked_on == f"tf-keras{versions.TESTED['tf-keras']}"


# -- how shared attributes are replaced and put back ---------------------------------------------

class _Owner:
    def greet(self):
        return "original"


class _Child(_Owner):
    pass


def test_a_thread_scoped_patch_reaches_only_the_threads_inside_it():
    patch = patching.ThreadScopedPatch(compat.change("layer_scopes_recorded"), lambda: (_Child, "greet"))
    seen_elsewhere = []

    def other_thread():
        seen_elsewhere.append(_Child().greet())

    with patch.active(lambda original, self: "hooked " + original(self)):
        assert _Child().greet() == "hooked original"
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        with patch.active(lambda original, self: "inner"):
            assert _Child().greet() == "inner"
        assert _Child().greet() == "hooked original"
    assert seen_elsewhere == ["original"]
    assert "greet" not in vars(_Child) and _Child().greet() == "original"   # inherited: removed, not copied
    assert not patch.installed


def test_a_held_patch_is_undone_when_its_last_holder_is_collected():
    module = types.SimpleNamespace(summary=lambda: "original")
    patch = patching.HeldPatch(compat.change("summary_before_plan"), lambda: (module, "summary"),
                               lambda original: lambda: "replaced")

    class Holder:
        pass

    first, second = Holder(), Holder()
    patch.hold(first)
    patch.hold(second)
    assert module.summary() == "replaced" and patch.holders == 2
    del first
    gc.collect()
    assert module.summary() == "replaced"
    del second
    gc.collect()
    assert module.summary() == "original" and not patch.installed and patch.holders == 0


def test_a_held_patch_waits_for_its_owner():
    """tf-keras's summary printer is replaced only once tf-keras is imported (a Keras 3 user does not
    pay its import): ``refresh`` installs it later for the strategies alive then."""
    module = types.SimpleNamespace(summary=lambda: "original")
    available = []
    patch = patching.HeldPatch(compat.change("summary_before_plan"),
                               lambda: (module, "summary") if available else None,
                               lambda original: lambda: "replaced")
    holder = _Owner()
    patch.hold(holder)
    assert module.summary() == "original"
    available.append(True)
    patch.refresh()
    assert module.summary() == "replaced"
    del holder
    gc.collect()
    assert module.summary() == "original"


_SUMMARY_PROBE = """
import gc
import tf_keras
from tf_keras.src.utils import layer_utils
from tofu_tf.tf import devices
devices.configure_virtual_cpus(2)
from tofu_tf.strategies import TofuStrategy
original = layer_utils.print_dtensor_variable_summary
first, second = TofuStrategy(2), TofuStrategy(2)
states = [layer_utils.print_dtensor_variable_summary is not original]
del first
gc.collect()
states.append(layer_utils.print_dtensor_variable_summary is not original)
del second
gc.collect()
states.append(layer_utils.print_dtensor_variable_summary is original)
print(states)
"""


def test_the_summary_printer_is_restored_when_no_strategy_is_alive():
    """In a fresh process: the suite's other strategies may still be alive in this one."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", _SUMMARY_PROBE], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "[True, True, True]", out.stdout


def test_keras3_scopes_are_recorded_on_the_capturing_thread_only():
    from keras.src.backend.tensorflow import core
    original = vars(core.name_scope)["__enter__"]
    recorded, caller = [], types.SimpleNamespace(name="dense")

    def enter_elsewhere():
        with tf.Graph().as_default(), core.name_scope("elsewhere", caller=caller):
            pass

    with tf.Graph().as_default(), compat_process.recording_keras3_scopes(lambda c, path: recorded.append(path)):
        worker = threading.Thread(target=enter_elsewhere)
        worker.start()
        worker.join()
        with core.name_scope("here", caller=caller):
            pass
    assert recorded == ["here"]
    assert vars(core.name_scope)["__enter__"] is original


# -- what the strategy lists --------------------------------------------------------------------

def test_the_strategy_lists_the_changes_it_made_to_the_model(caplog):
    from tofu_tf.strategies import TofuStrategy
    tf_keras.utils.set_random_seed(3)
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((4, 4, 2)), tf_keras.layers.Conv2D(4, 3, name="conv"),
                                     tf_keras.layers.BatchNormalization(name="norm"),    # fused: 4-D input
                                     tf_keras.layers.Flatten(), tf_keras.layers.Dense(2, name="head")],
                                    name="bn_model")
        model.compile(optimizer="adam", loss="mse")
    assert strategy.changes == ()
    with caplog.at_level(logging.INFO, logger="absl"):
        model.fit(np.ones((16, 4, 4, 2), np.float32), np.ones((16, 2), np.float32), batch_size=8, epochs=1,
                  verbose=0)
    made = [(applied.change.name, applied.target) for applied in strategy.changes]
    assert ("batch_norm_unfused", "norm") in made
    assert ("step_functions", "bn_model") in made and ("savedmodel_from_copy", "bn_model") in made
    assert any(name == "gradients_relaid" for name, _ in made)
    assert all(applied.change.scope in (compat.Scope.LAYER, compat.Scope.MODEL, compat.Scope.OPTIMIZER)
               for applied in strategy.changes)
    norm = [applied for applied in strategy.changes if applied.change.name == "batch_norm_unfused"][0]
    assert str(norm).startswith("norm: batch_norm_unfused: fused=False (DTensor has no layout propagation")
    assert f"TofuStrategy: {norm}" in caplog.text              # logged when made
