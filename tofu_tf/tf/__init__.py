"""The only part of tofu_tf that touches TensorFlow and Keras internals:
capture (tf.function -> IR), and later lowering and profiling."""

from tofu_tf import versions as _versions

# Before any TF-facing module runs: warns about an untested TensorFlow or Keras, refuses one
# too old to run on (tofu_tf/versions.py).
_versions.check_installed()
