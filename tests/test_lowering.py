"""Lowering plans to DTensor: layouts DTensor's expanders accept, legal meshes, clear errors."""

import pytest

from tofu_tf.tf import devices, lowering


def test_bias_follows_its_kernels_output_axis_and_slots_follow_weights():
    adjusted = lowering.dtensor_natural({
        "d/kernel": ("model", "model1"), "d/bias": ("model",),
        "Adam/m/d/kernel": ("model", "model1"), "Adam/m/d/bias": ("model",)})
    assert adjusted["d/bias"] == ("model1",)
    assert adjusted["Adam/m/d/bias"] == ("model1",)
    assert adjusted["d/kernel"] == ("model", "model1")


def test_norm_parameters_replicated_and_embedding_rows_whole():
    adjusted = lowering.dtensor_natural({"ln/gamma": ("model",), "bn/moving_mean": ("batch",),
                                         "tok/embeddings": ("model", "model1")})
    assert adjusted == {"ln/gamma": (None,), "bn/moving_mean": (None,), "tok/embeddings": (None, "model1")}


def test_layout_that_does_not_divide_is_refused_with_the_variable_named():
    device_set = devices.DeviceSet("CPU", tuple(f"CPU:{i}" for i in range(8)), virtual=True)
    lowered = lowering.lower({"batch": 2, "model": 4}, {"head/kernel": (None, "model")}, [("batch",)], device_set)
    assert lowered.batch_axis == "batch"
    with pytest.raises(ValueError, match="'head/kernel' of shape \\(16, 10\\) is not legal"):
        lowered.layout_for("head/kernel", (16, 10))
    assert lowered.layout_for("other", (3,)).is_fully_replicated()


def test_mesh_must_use_every_device():
    device_set = devices.DeviceSet("CPU", tuple(f"CPU:{i}" for i in range(8)), virtual=True)
    with pytest.raises(ValueError, match="has 4 devices but 8 are available"):
        lowering.make_mesh({"batch": 2, "model": 2}, device_set)
