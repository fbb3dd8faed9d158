"""The planner maps the mesh onto hosts: model splits inside a host, the batch across hosts.

A hardware profile describes a node (``devices_per_node`` devices joined by ``intra_node``
links) and the network between nodes (``inter_node``); DTensor numbers devices row-major
over the mesh, so a mesh axis whose device groups span nodes runs its collectives on the
network. A Transformer layer's model splits all-reduce activations every layer, its batch
split only the gradients once: where one host's devices suffice for the model splits the
planner chooses, a plan keeps them inside the host and puts the batch across hosts.

Beyond one host the search keeps to meshes whose axes stay inside a host or span whole
hosts (``tofu_tf.mesh.host_aligned_factorizations``), so an axis never mixes the two links;
which axes split the model is still the cost model's choice: where the planner wants more
model splits than a host holds (GPT-12 on 64 devices of 8 per host), an axis across hosts
splits the model too (bench/README.md).
"""

import dataclasses

import pytest
import tf_keras

from tofu_tf import capture_training_step, models
from tofu_tf.cost.hardware import H100_NVLINK
from tofu_tf.mesh import MeshSpec
from tofu_tf.search import plan_graph
from tofu_tf.search.legality import check_plan


@pytest.fixture(scope="module")
def gpt_graph():
    model = models.gpt(num_layers=2, d_model=1024, num_heads=16, seq_len=256, vocab_size=8192)
    return capture_training_step(model, batch_size=64, optimizer=tf_keras.optimizers.Adam(),
                                 loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.slow      # captures a 2-layer GPT of width 1024
@pytest.mark.parametrize("num_devices,devices_per_node", [(16, 8), (32, 8), (16, 4)])
def test_model_splits_stay_inside_a_host_and_the_batch_spans_hosts(gpt_graph, num_devices, devices_per_node):
    hardware = dataclasses.replace(H100_NVLINK, devices_per_node=devices_per_node)
    plan = plan_graph(gpt_graph, num_devices=num_devices, hardware=hardware)
    check_plan(gpt_graph, plan)
    mesh = MeshSpec(tuple(plan.mesh_shape.items()))
    inside = {name for k, name in enumerate(mesh.names) if hardware.axis_link(mesh, k) is hardware.intra_node}
    splitting = {axis for layout in plan.variable_layouts.values() for axis in layout if axis is not None}
    assert splitting, plan.summary()                      # the model is split ...
    assert splitting <= inside, (plan.mesh_shape, inside, splitting)    # ... inside a host
    batch_axes = {layout[0] for layout in plan.input_layouts.values() if layout and layout[0]}
    assert batch_axes and batch_axes - inside, (plan.mesh_shape, plan.input_layouts)   # the batch across hosts


@pytest.fixture(scope="module")
def small_gpt_graph():
    model = models.gpt(num_layers=2, d_model=256, num_heads=8, seq_len=64, vocab_size=1024)
    return capture_training_step(model, batch_size=512, optimizer=tf_keras.optimizers.Adam(),
                                 loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("mesh_shape", [(64, 8, 8), (2, 2048), (4096,), (16, 16, 16), (8, 8, 8, 8)])
def test_plans_on_4096_devices_are_legal(small_gpt_graph, mesh_shape):
    """The search on 4096 devices (one mesh each; searching every mesh of 4096 takes minutes, a
    bench's job) gives plans the independent legality checker accepts: every split divides, no
    mesh axis splits two dims of a tensor, slots follow their weights, each read its variable."""
    plan = plan_graph(small_gpt_graph, num_devices=4096, mesh_shape=mesh_shape)
    check_plan(small_gpt_graph, plan)
    assert list(plan.mesh_shape.values()) == list(mesh_shape)


def test_the_whole_search_on_4096_devices_gives_a_legal_plan(small_gpt_graph):
    """No mesh given: the search over the meshes that follow hosts of 8 (12 shapes of 4096
    devices, of 2048 ordered factorizations) plans, and the plan is legal."""
    plan = plan_graph(small_gpt_graph, num_devices=4096)
    check_plan(small_gpt_graph, plan)
    assert any("searched 12 of the 2048 mesh shapes of 4096 devices" in note for note in plan.notes), plan.notes
