"""Every change tofu_tf makes to TensorFlow and Keras objects, in one package.

TensorFlow's DTensor cannot expand some ops Keras emits, and some Keras internals assume a
strategy that is not TofuStrategy; so tofu_tf changes a few framework objects. Each change is
registered in ``registry.CHANGES`` (what it replaces, how far it reaches, when it is undone,
why, the releases it was checked on) and listed in docs/compatibility.md; a TensorFlow or Keras
upgrade starts here.

* ``registry``: the entries (``Change``) and the record of one applied to an object (``Applied``);
* ``patching``: how a shared class or module attribute is replaced and put back;
* ``process``: the changes to shared attributes (a class's method, a module's function);
* ``calls``: the options the strategy's step programs are called with (grappler off on CPU meshes);
* ``layers`` and ``optimizers``: the changes the strategy makes to its model's layers and
  optimizer, each returned as ``Applied`` records (``TofuStrategy.changes``).

Changes made during capture to capture's own objects stay beside capture's code
(``tofu_tf.tf.keras_adapter``, ``tofu_tf.tf.update_stamps``), and the strategy's changes to
a model's step functions and saving beside them (``tofu_tf.strategies.step_functions``,
``tofu_tf.strategies.export``): registered here all the same, each naming its site.
"""

from tofu_tf.tf.compat.registry import CHANGES, Applied, Change, Scope, change, resolve

__all__ = ["CHANGES", "Applied", "Change", "Scope", "change", "resolve"]
