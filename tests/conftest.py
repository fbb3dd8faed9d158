"""Test session setup: 8 virtual CPU devices, configured before TF starts.

TensorFlow fixes its logical devices when its runtime starts, so this runs at
import time, before any test module can run an op.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Not TF_CPU_ALLOCATOR_USE_BFC: with it DTensor fails to fill scalars on CPU
# ("TF_TensorData returned nullptr"); memory tests run it in a subprocess.

from tofu_tf.tf import devices  # noqa: E402  (TF is imported here, once)

NUM_DEVICES = 8
devices.configure_virtual_cpus(NUM_DEVICES)
