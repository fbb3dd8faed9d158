"""A plan as a picture: one self-contained HTML page, a PNG, and a notebook view.

A plan of a real model names thousands of tensors; its text summary shows the top
ten of each table. This module owns the views a person scans instead: the mesh and
its axes, a per-layer table of every variable's layout (by its unique path,
optimizer slots beside their weight) and of the activations' layouts, per-device
memory by role against the budget, and communication by layer and by collective
kind. Plans of other methods (``--compare`` in ``tofu-plan``) sit beside it.

The HTML has no scripts, fonts or images from elsewhere (inline CSS and SVG
only), so it opens from a file on a machine with no network and can be mailed.
The PNG needs matplotlib (the ``plot`` extra), imported only when one is drawn.
This module reads plans and graphs; it never plans, and imports no TensorFlow.
"""

from __future__ import annotations

import collections
import html
import os
from typing import Mapping

from tofu_tf import ir
from tofu_tf.cost import hardware as hardware_profiles
from tofu_tf.errors import TofuError
from tofu_tf.executed import comparison_rows
from tofu_tf.plan import Plan, format_bytes

# Memory roles in the order the bars stack them, with their colours (HTML and PNG alike).
_ROLES = (("weights", "#4e79a7"), ("optimizer slots", "#f28e2b"), ("gradients", "#e15759"),
          ("activations", "#76b7b2"), ("other", "#bab0ac"))
# A budget this many times the peak or more is drawn off scale: bars scaled to it would vanish.
_BUDGET_OFF_SCALE = 4.0
_TOP_LAYERS = 30
_NO_LAYER = "(loss and optimizer bookkeeping)"


class PlotUnavailableError(TofuError, ImportError):
    """matplotlib, which draws the PNG, is not installed."""


# -- what the views show, from the plan (and the graph when there is one) ----------------

def memory_by_role(plan: Plan) -> dict[str, int]:
    """Bytes per device at the peak, by role; "other" is what the roles leave of the peak
    (batch inputs, scalars), never negative."""
    mem = plan.memory
    roles = {"weights": mem.weight_bytes, "optimizer slots": mem.optimizer_slot_bytes,
             "gradients": mem.gradient_bytes_at_peak, "activations": mem.activation_bytes_at_peak}
    roles["other"] = max(0, mem.peak_bytes - sum(roles.values()))
    return roles


def budget_bytes(plan: Plan) -> int | None:
    """The budget the plan was searched under: the one given, else the hardware profile's
    device memory (None for a profile this tofu_tf does not know by name)."""
    if plan.memory_budget_bytes is not None:
        return plan.memory_budget_bytes
    known = hardware_profiles.PROFILES.get(plan.hardware)
    return None if known is None else known.memory_bytes


def variable_layer(path: str, paths, graph: ir.Graph | None) -> str:
    """The layer a variable belongs to: its weight's path without the last component. An
    optimizer slot goes with its weight: the graph says which; without it, the longest
    tail of the slot's path that is another variable's path (``Adam/m/d/kernel``)."""
    weight = path
    if graph is not None and path in graph.variables:
        weight = graph.variables[path].slot_of or path
    else:
        parts = path.split("/")
        weight = next(("/".join(parts[i:]) for i in range(1, len(parts)) if "/".join(parts[i:]) in paths), path)
    return weight.rsplit("/", 1)[0] if "/" in weight else weight


def layer_rows(plan: Plan, graph: ir.Graph | None = None) -> dict[str, dict[str, list]]:
    """Per layer (in the plan's variable order, then the graph's op order): its variables
    as (path, layout) and its activations as (tensor, shape or None, layout).

    A tensor goes to the longest variable layer whose path appears, between slashes, in
    the tensor's name (forward and backward ops carry their layer's scope), else to the
    graph's layer of its producing op. With the graph only activations are listed;
    without it every tensor the plan lays out is (their roles are not in the plan)."""
    rows: dict[str, dict[str, list]] = {}

    def row(layer):
        return rows.setdefault(layer, {"variables": [], "activations": []})

    paths = set(plan.variable_layouts)
    for path, layout in plan.variable_layouts.items():
        row(variable_layer(path, paths, graph))["variables"].append((path, layout))
    scopes = set(rows)
    op_layers = {} if graph is None else {op.name: op.layer for op in graph.ops}
    for name, layout in plan.tensor_layouts.items():
        tensor = None if graph is None else graph.tensors.get(name)
        if tensor is not None and tensor.role is not ir.Role.ACTIVATION:
            continue
        layer = _longest_scope(name.rsplit(":", 1)[0].split("/"), scopes)
        if layer is None:
            layer = op_layers.get(tensor.producer) if tensor is not None else None
        row(layer or _NO_LAYER)["activations"].append((name, None if tensor is None else tensor.shape, layout))
    return rows


def _longest_scope(parts: list[str], scopes) -> str | None:
    """The longest run of consecutive name components that is one of ``scopes``."""
    found = None
    for i in range(len(parts)):
        for j in range(i + 1, len(parts) + 1):
            candidate = "/".join(parts[i:j])
            if candidate in scopes and (found is None or len(candidate) > len(found)):
                found = candidate
    return found


def layout_text(layout) -> str:
    return "(" + ", ".join("-" if axis is None else axis for axis in layout) + ")"


# -- HTML ---------------------------------------------------------------------------------

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { padding: 2px 10px; text-align: left; vertical-align: top; border-bottom: 1px solid #eee; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
code, .path { font-family: ui-monospace, monospace; font-size: 12.5px; }
.layer { background: #f4f6f8; font-weight: 600; }
.axis { display: inline-block; padding: 2px 8px; margin-right: 6px; border-radius: 4px; color: #fff; }
.legend span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; vertical-align: -1px; }
.bar { height: 14px; background: #4e79a7; display: inline-block; vertical-align: middle; }
.note { color: #666; }
details summary { cursor: pointer; }
"""
_AXIS_COLOURS = ("#59a14f", "#af7aa1", "#edc948", "#9c755f", "#ff9da7")


def render_html(plan: Plan, *, graph: ir.Graph | None = None,
                comparison: Mapping[str, "Plan | str"] | None = None, title: str | None = None) -> str:
    """The whole page: ``html_fragment`` in a document with its own styles."""
    title = title or f"tofu_tf plan: {plan.method.value} on {plan.num_devices} devices"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n<h1>{_e(title)}</h1>\n"
            + html_fragment(plan, graph=graph, comparison=comparison) + "\n</body></html>\n")


def write_html(plan: Plan, path, *, graph: ir.Graph | None = None,
               comparison: Mapping[str, "Plan | str"] | None = None, title: str | None = None) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(render_html(plan, graph=graph, comparison=comparison, title=title))


def html_fragment(plan: Plan, *, graph: ir.Graph | None = None,
                  comparison: Mapping[str, "Plan | str"] | None = None) -> str:
    """The views without a document around them (what a notebook shows)."""
    plans = {plan.method.value: plan, **dict(comparison or {})}
    parts = [_overview(plan), _mesh(plan)]
    if len(plans) > 1:
        parts.append(_comparison(plans))
    parts += [_memory(plans), _communication(plan), _layers(plan, graph)]
    if plan.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in plan.notes) + "</ul>")
    return "<div class=\"tofu-plan\"><style>" + _CSS + "</style>\n" + "\n".join(parts) + "</div>"


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _overview(plan: Plan) -> str:
    rows = [("method", plan.method.value), ("objective", plan.objective.value), ("hardware", plan.hardware),
            ("target", plan.target), ("modeled step", f"{plan.step_seconds * 1e3:.3f} ms (compute "
                                                      f"{plan.compute_seconds * 1e3:.3f} ms, communication "
                                                      f"{plan.comm_seconds * 1e3:.3f} ms)"),
            ("communication", f"{format_bytes(plan.comm_bytes)} per device per step"),
            *([("all-reduces", plan.all_reduces_combining)] if plan.all_reduces_combining is not None else []),
            ("peak memory", f"{format_bytes(plan.peak_memory_bytes)} per device (at {plan.memory.peak_op})"),
            ("search", f"{plan.search_seconds:.2f} s"
             + ("" if plan.proved_optimal is None else f", proved optimal: {plan.proved_optimal}"))]
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows) + "</table>"


def _mesh(plan: Plan) -> str:
    axes = "".join(f"<span class=\"axis\" style=\"background:{_AXIS_COLOURS[i % len(_AXIS_COLOURS)]}\">"
                   f"{_e(name)} = {size}</span>" for i, (name, size) in enumerate(plan.mesh_axes))
    inputs = "".join(f"<tr><td class=\"path\">{_e(name)}</td><td><code>{_e(layout_text(layout))}</code></td></tr>"
                     for name, layout in plan.input_layouts.items())
    return (f"<h2>Mesh</h2><p>{axes or '(one device)'} &nbsp; {plan.num_devices} devices; the first axis is "
            "outermost. A layout names, per tensor dim, the mesh axis that splits it (<code>-</code>: whole)."
            f"</p><table><tr><th>batch input</th><th>layout</th></tr>{inputs}</table>")


def _comparison(plans: Mapping[str, "Plan | str"]) -> str:
    head = ("<tr><th>method</th><th>mesh</th><th class=\"num\">step ms</th><th class=\"num\">comm MiB</th>"
            "<th class=\"num\">peak MiB</th><th>fits budget</th></tr>")
    rows = []
    for name, other in plans.items():
        if isinstance(other, str):
            rows.append(f"<tr><td>{_e(name)}</td><td colspan=\"5\" class=\"note\">no plan: {_e(other)}"
                        "</td></tr>")
            continue
        budget = budget_bytes(other)
        fits = "-" if budget is None else ("yes" if other.peak_memory_bytes <= budget else "no")
        mesh = " x ".join(f"{n}={s}" for n, s in other.mesh_axes) or "(1 device)"
        rows.append(f"<tr><td>{_e(name)}</td><td>{_e(mesh)}</td><td class=\"num\">{other.step_seconds * 1e3:.3f}"
                    f"</td><td class=\"num\">{other.comm_bytes / 2**20:,.2f}</td><td class=\"num\">"
                    f"{other.peak_memory_bytes / 2**20:,.2f}</td><td>{fits}</td></tr>")
    return "<h2>Methods side by side</h2><table>" + head + "".join(rows) + "</table>"


def _memory(plans: Mapping[str, "Plan | str"]) -> str:
    """One stacked bar per plan: every device of a plan holds the same (DTensor splits evenly)."""
    priced = {name: p for name, p in plans.items() if isinstance(p, Plan)}
    peak = max(p.peak_memory_bytes for p in priced.values()) or 1
    budgets = {name: budget_bytes(p) for name, p in priced.items()}
    on_scale = [b for b in budgets.values() if b is not None and b < _BUDGET_OFF_SCALE * peak]
    scale = max([peak] + on_scale)
    width, label_width, bar_height = 640, 130, 22
    svg = [f"<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{label_width + width + 20}\" "
           f"height=\"{len(priced) * (bar_height + 14) + 10}\" role=\"img\">"]
    for row, (name, plan) in enumerate(priced.items()):
        y, x = 5 + row * (bar_height + 14), label_width
        svg.append(f"<text x=\"0\" y=\"{y + 15}\" font-size=\"12\">{_e(name)}</text>")
        for role, colour in _ROLES:
            size = memory_by_role(plan)[role]
            w = width * size / scale
            if w > 0:
                svg.append(f"<rect x=\"{x:.1f}\" y=\"{y}\" width=\"{w:.1f}\" height=\"{bar_height}\" "
                           f"fill=\"{colour}\"><title>{_e(role)}: {_e(format_bytes(size))}</title></rect>")
            x += w
        budget = budgets[name]
        if budget is not None and budget in on_scale:
            bx = label_width + width * budget / scale
            svg.append(f"<line x1=\"{bx:.1f}\" x2=\"{bx:.1f}\" y1=\"{y - 3}\" y2=\"{y + bar_height + 3}\" "
                       "stroke=\"#000\" stroke-width=\"2\" stroke-dasharray=\"4 2\"><title>budget</title></line>")
    svg.append("</svg>")
    legend = "".join(f"<span style=\"background:{c}\"></span>{_e(r)}" for r, c in _ROLES)
    table = ["<table><tr><th>method</th>" + "".join(f"<th class=\"num\">{_e(r)}</th>" for r, _ in _ROLES)
             + "<th class=\"num\">peak</th><th class=\"num\">budget</th></tr>"]
    for name, plan in priced.items():
        budget = budgets[name]
        shown = "none" if budget is None else format_bytes(budget) + (
            "" if budget in on_scale else " (off scale)")
        table.append(f"<tr><td>{_e(name)}</td>" + "".join(
            f"<td class=\"num\">{_e(format_bytes(v))}</td>" for v in memory_by_role(plan).values())
            + f"<td class=\"num\">{_e(format_bytes(plan.peak_memory_bytes))}</td><td class=\"num\">{_e(shown)}"
            "</td></tr>")
    return ("<h2>Memory per device at the peak</h2><p class=\"note\">Each device of a plan holds the same bytes "
            "(layouts split evenly); the dashed line is the memory budget.</p>"
            f"<div class=\"legend\">{legend}</div>" + "".join(svg) + "".join(table) + "</table>")


def _cost_table(title: str, costs, *, top: int | None = None) -> str:
    items = sorted(costs.items(), key=lambda kv: -kv[1].seconds)
    shown = items if top is None else items[:top]
    if not shown:
        return f"<h3>{_e(title)}</h3><p class=\"note\">none: this plan communicates nothing.</p>"
    longest = max(c.seconds for _, c in shown) or 1.0
    rows = "".join(
        f"<tr><td class=\"path\">{_e(name)}</td><td class=\"num\">{c.bytes / 2**20:,.3f}</td>"
        f"<td class=\"num\">{c.seconds * 1e3:.3f}</td><td><span class=\"bar\" "
        f"style=\"width:{300 * c.seconds / longest:.0f}px\"></span></td></tr>" for name, c in shown)
    more = "" if len(items) == len(shown) else f"<p class=\"note\">... and {len(items) - len(shown)} more</p>"
    return (f"<h3>{_e(title)}</h3><table><tr><th>name</th><th class=\"num\">MiB</th><th class=\"num\">ms</th>"
            f"<th></th></tr>{rows}</table>{more}")


def _communication(plan: Plan) -> str:
    return ("<h2>Communication per device per step</h2>" + _cost_table("by collective kind", plan.comm_by_collective)
            + _executed(plan) + _cost_table(f"by layer (top {_TOP_LAYERS})", plan.comm_by_layer, top=_TOP_LAYERS))


def _executed(plan: Plan) -> str:
    """What DTensor compiled for the step, beside the model, once measured (``tofu-plan --measure``)."""
    if plan.executed is None:
        return ""
    memory = plan.memory
    rows = comparison_rows(plan.executed, {k: c.bytes for k, c in plan.comm_by_collective.items()},
                           memory.weight_bytes + memory.optimizer_slot_bytes)
    cells = "".join(
        f"<tr><td class=\"path\">{_e(what)}</td><td class=\"num\">{_e(count)}</td>"
        f"<td class=\"num\">{done / 2**20:,.3f}</td><td class=\"num\">{modeled / 2**20:,.3f}</td>"
        f"<td class=\"num\">{gap:.0%}</td></tr>" for what, count, done, modeled, gap in rows)
    return ("<h3>executed (measured): DTensor's program against the model</h3><table><tr><th>what</th>"
            "<th class=\"num\">ops</th><th class=\"num\">executed MiB</th><th class=\"num\">modeled MiB</th>"
            f"<th class=\"num\">gap</th></tr>{cells}</table>")


def _layers(plan: Plan, graph: ir.Graph | None) -> str:
    kind = "activations" if graph is not None else "tensors (the plan alone does not say which are activations)"
    out = [f"<h2>Layouts by layer</h2><p class=\"note\">Every variable by its path (optimizer slots with their "
           f"weight); {_e(kind)} summarized by layout, each listed under its layer.</p>",
           "<table><tr><th>variable / values</th><th>layout</th></tr>"]
    for layer, found in layer_rows(plan, graph).items():
        out.append(f"<tr class=\"layer\"><td colspan=\"2\">{_e(layer)}</td></tr>")
        out.extend(f"<tr><td class=\"path\">{_e(path)}</td><td><code>{_e(layout_text(layout))}</code></td></tr>"
                   for path, layout in found["variables"])
        values = found["activations"]
        if values:
            counts = collections.Counter(layout_text(layout) for _, _, layout in values)
            tally = ", ".join(f"{_e(text)} x{n}" for text, n in counts.most_common())
            listed = "".join(f"<li><code>{_e(name)}</code> {_e(shape) if shape is not None else ''} "
                             f"<code>{_e(layout_text(layout))}</code></li>" for name, shape, layout in values)
            out.append(f"<tr><td colspan=\"2\"><details><summary>{len(values)} {_e(kind.split(' ')[0])}: "
                       f"<code>{tally}</code></summary><ul>{listed}</ul></details></td></tr>")
    out.append("</table>")
    return "".join(out)


# -- PNG ----------------------------------------------------------------------------------

def write_png(plan: Plan, path, *, comparison: Mapping[str, "Plan | str"] | None = None) -> None:
    """Memory per device by role against the budget, and communication by layer, as a PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailableError("Plan.to_png draws with matplotlib, which is not installed: "
                                   "pip install 'tofu_tf[plot]' (or matplotlib), or write HTML with "
                                   "Plan.to_html instead.") from None
    plans = {name: p for name, p in {plan.method.value: plan, **dict(comparison or {})}.items()
             if isinstance(p, Plan)}
    layers = sorted(plan.comm_by_layer.items(), key=lambda kv: -kv[1].seconds)[:20]
    figure = Figure(figsize=(10, 3 + 0.35 * (len(plans) + len(layers))), layout="constrained")
    memory_axes, comm_axes = figure.subplots(2, 1, height_ratios=[max(1, len(plans)), max(2, len(layers))])
    names = list(plans)
    left = [0.0] * len(names)
    for role, colour in _ROLES:
        sizes = [memory_by_role(plans[n])[role] / 2**20 for n in names]
        memory_axes.barh(names, sizes, left=left, color=colour, label=role)
        left = [a + b for a, b in zip(left, sizes)]
    peak = max(left) or 1.0
    for i, name in enumerate(names):
        budget = budget_bytes(plans[name])
        if budget is not None and budget / 2**20 < _BUDGET_OFF_SCALE * peak:
            memory_axes.plot([budget / 2**20] * 2, [i - 0.45, i + 0.45], "k--", linewidth=2)
    memory_axes.set_xlabel("MiB per device at the peak (dashed: budget, when within 4x the peak)")
    memory_axes.set_title(f"{plan.method.value} on {' x '.join(f'{n}={s}' for n, s in plan.mesh_axes) or '1 device'}"
                          f", {plan.hardware}")
    memory_axes.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    memory_axes.invert_yaxis()
    if layers:
        comm_axes.barh([name for name, _ in layers], [c.seconds * 1e3 for _, c in layers], color="#4e79a7")
        comm_axes.invert_yaxis()
    else:
        comm_axes.text(0.5, 0.5, "no communication", ha="center", va="center", transform=comm_axes.transAxes)
        comm_axes.set_yticks([])
    comm_axes.set_xlabel("communication ms per step, by layer (top 20)")
    FigureCanvasAgg(figure).print_png(os.fspath(path))
