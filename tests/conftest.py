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
# Every test plans afresh and writes nothing under the user's cache directory; the
# plan cache's own tests give it a directory of their own.
os.environ["TOFU_PLAN_CACHE"] = "off"
# DTensor reads its all-reduce combining switch at its first compile, and the pipeline tests'
# stage functions need it off (tofu_tf.tf.compat.process.uncombine_all_reduces): a pipelined
# TofuStrategy sets it when it is the process's first DTensor user; here other tests come first.
os.environ["DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"] = "0"
# Not TF_CPU_ALLOCATOR_USE_BFC: with it DTensor fails to fill scalars on CPU
# ("TF_TensorData returned nullptr"); memory tests run it in a subprocess.

from tofu_tf.tf import devices  # noqa: E402  (TF is imported here, once)

NUM_DEVICES = 8
devices.configure_virtual_cpus(NUM_DEVICES)


# -- shared by the plan view tests (test_plan_report, test_plan_cache, test_plan_command) ------

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_mlp_graph():
    """A captured training step small enough to plan in a fraction of a second."""
    from tofu_tf import models
    from tofu_tf.tf.capture import capture_training_step
    model = models.mlp(input_dim=16, width=32, depth=2, num_classes=8)
    return capture_training_step(model, batch_size=8, loss="sparse_categorical_crossentropy", optimizer="adam")
