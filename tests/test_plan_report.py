"""plan_report: the plan's page names every variable and reads offline; the PNG is an image."""

import dataclasses
import html.parser
import struct
import sys

import pytest

from tofu_tf import plan_report
from tofu_tf.search import plan_graph


class _Page(html.parser.HTMLParser):
    """The page's text, tags and the attributes that could fetch something."""

    def __init__(self):
        super().__init__()
        self.text, self.tags, self.fetches = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.fetches += [value for name, value in attrs if name in ("src", "href") and value]

    def handle_data(self, data):
        self.text.append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    return page


@pytest.fixture(scope="module")
def plans(tiny_mlp_graph):
    """The tofu plan and a Megatron plan (which communicates) of the tiny MLP on 4 devices."""
    return {method: plan_graph(tiny_mlp_graph, num_devices=4, method=method, hardware="h100-nvlink")
            for method in ("tofu", "megatron")}


def test_the_page_names_every_variable_activation_layer_and_collective(plans, tiny_mlp_graph, tmp_path):
    plan = plans["megatron"]
    assert plan.comm_by_layer and plan.comm_by_collective
    path = tmp_path / "plan.html"
    plan.to_html(path, graph=tiny_mlp_graph)
    page = _parse(path.read_text(encoding="utf-8"))
    text = "\n".join(page.text)
    assert set(plan.variable_layouts) <= set(t.strip() for t in page.text)
    assert any("Adam/m/dense_0/kernel" in t for t in page.text)
    activations = [name for name, t in tiny_mlp_graph.tensors.items()
                   if t.role.value == "activation" and name in plan.tensor_layouts]
    assert activations and all(name in text for name in activations)
    assert all(layer in text for layer in plan.comm_by_layer)
    assert all(kind in text for kind in plan.comm_by_collective)
    assert all(f"{name} = {size}" in text for name, size in plan.mesh_axes)
    for role in ("weights", "optimizer slots", "gradients", "activations"):
        assert role in text
    assert {"html", "table", "svg", "rect"} <= set(page.tags)
    assert page.fetches == [] and "script" not in page.tags     # opens with no network


def test_each_slot_is_listed_with_its_weight_with_or_without_the_graph(plans, tiny_mlp_graph):
    plan = plans["tofu"]
    for graph in (tiny_mlp_graph, None):
        rows = plan_report.layer_rows(plan, graph)
        kernel = [path for path, _ in rows["dense_0"]["variables"]]
        assert kernel[:2] == ["dense_0/kernel", "dense_0/bias"]
        assert {"Adam/m/dense_0/kernel", "Adam/v/dense_0/kernel"} <= set(kernel)
        listed = [path for row in rows.values() for path, _ in row["variables"]]
        assert sorted(listed) == sorted(plan.variable_layouts)


def test_activations_go_to_the_layer_whose_scope_they_carry(plans, tiny_mlp_graph):
    rows = plan_report.layer_rows(plans["tofu"], tiny_mlp_graph)
    head = [name for name, _, _ in rows["head"]["activations"]]
    assert head and all("/head/" in f"/{name}" for name in head)
    assert all(t.role.value == "activation" for row in rows.values()
               for name, _, _ in row["activations"] for t in [tiny_mlp_graph.tensors[name]])


def test_memory_roles_make_up_the_peak_and_the_budget_is_marked(plans, tiny_mlp_graph):
    plan = plans["tofu"]
    assert sum(plan_report.memory_by_role(plan).values()) == plan.peak_memory_bytes
    far = plan_report.html_fragment(plan)
    assert "80.00 GiB (off scale)" in far and "stroke-dasharray" not in far
    near = dataclasses.replace(plan, memory_budget_bytes=2 * plan.peak_memory_bytes)
    assert "stroke-dasharray" in plan_report.html_fragment(near)


def test_methods_side_by_side_and_a_method_that_does_not_apply(plans):
    page = plan_report.render_html(plans["tofu"], comparison={"megatron": plans["megatron"],
                                                              "data_parallel": "the model has no batch input"})
    text = "\n".join(_parse(page).text)
    assert "Methods side by side" in text and "megatron" in text
    assert "no plan: the model has no batch input" in text


def test_a_notebook_shows_the_page_without_a_document_around_it(plans):
    fragment = plans["tofu"]._repr_html_()
    assert not fragment.lstrip().startswith("<!DOCTYPE") and "<html" not in fragment
    assert "dense_0/kernel" in fragment


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def test_the_png_is_an_image_of_memory_and_communication(plans, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib import image
    path = tmp_path / "plan.png"
    plans["megatron"].to_png(path, comparison={"tofu": plans["tofu"], "data_parallel": "not here"})
    width, height = _png_size(path.read_bytes())
    assert width > 300 and height > 200
    pixels = image.imread(path)
    assert pixels.shape[:2] == (height, width) and pixels.std() > 0.05     # drawn on, not blank


def test_without_matplotlib_the_png_names_the_extra(plans, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(plan_report.PlotUnavailableError, match=r"pip install 'tofu_tf\[plot\]'"):
        plans["tofu"].to_png(tmp_path / "plan.png")
    assert not (tmp_path / "plan.png").exists()
