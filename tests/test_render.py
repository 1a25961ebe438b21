"""Graphviz renders: every graph kind through the real ``dot`` to SVG, checked in the SVG text;
the "what to draw" scenes checked without Graphviz.

What the pictures must show (the render issue): the first layer's pruned input gradient as a
ghost node with its FLOPs, backward and tangent nodes in their role colours, residual edges from
forward values to the backward nodes reading them with their bytes, and a legend.
"""

from __future__ import annotations

import re
import shutil
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import analysis

import graphflop.export.graphviz as gv
from graphflop.export.graphviz import (
    GRAPHS,
    NO_DOT,
    ROLE_COLOURS,
    RenderError,
    count_op_nodes,
    render,
)
from graphflop.export.graphviz.draw import card_html, legend_html, stat_card_html
from graphflop.export.graphviz.module_level import module_scene
from graphflop.export.graphviz.op_level import op_scene
from graphflop.export.graphviz.scene import Card, Legend, LegendItem, Stat, StatCard
from graphflop.export.report import human, human_bytes
from graphflop.meta import GHOSTS

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")
SVG = "{http://www.w3.org/2000/svg}"

# First-layer input gradient, worked by hand (one multiply-add = 2 FLOPs):
#   ConvNet, batch 1: transposed conv1, 2 · (N·C_out·H_out·W_out) · (C_in·k·k)
#                     = 2 · 32·112·112 · 3·7·7 = 118,013,952 → "118 M"
#   seed B MLP, batch 64: δ @ W1, 2 · 64 · 1024 · 784 = 102,760,448 → "103 M"
FIRST_LAYER = {
    ("convnet.py", 1): ("conv1", 2 * 32 * 112 * 112 * 3 * 49, "118 M"),
    ("mlp.py", 64): ("layers.fc1", 2 * 64 * 1024 * 784, "103 M"),
}
# A residual every backward reads: the first ReLU's output, in bytes (fp32)
#   ConvNet: 1·32·112·112·4 = 1,605,632 B = 1.53 MiB;  MLP: 64·1024·4 = 262,144 B = 256 KiB
FIRST_RELU_BYTES = {("convnet.py", 1): 1 * 32 * 112 * 112 * 4, ("mlp.py", 64): 64 * 1024 * 4}
FIRST_RELU = {("convnet.py", 1): "relu1", ("mlp.py", 64): "layers.relu1"}
MODELS = sorted(FIRST_LAYER)


def _svg(path):
    return ET.parse(path).getroot()


def _by_class(root, cls):
    return [g for g in root.iter(f"{SVG}g") if cls in (g.get("class") or "").split()]


def _text(el) -> str:
    return " ".join((t.text or "") for t in el.iter(f"{SVG}text"))


def _first_layer_ghost(a, gm_name, module):
    """The largest ghost of ``module`` in that graph (the first layer's input gradient/tangent)."""
    ghosts = [g for g in getattr(a, gm_name).meta[GHOSTS] if g.module == module]
    return max(ghosts, key=lambda g: g.cost.flops)


@needs_dot
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m[0])
@pytest.mark.parametrize("graph", GRAPHS)
def test_every_graph_kind_renders_to_svg(tmp_path, model, graph):
    name, batch = model
    a = analysis(name, batch)
    out = tmp_path / f"{graph}.svg"
    src = render(a, out, graph=graph, level="op")
    assert src.startswith("digraph") and out.stat().st_size > 0
    root = _svg(out)
    svg = out.read_text()
    nodes = {g.get("id"): g for g in _by_class(root, "node")}

    # the legend: the FLOP colour scale and the role colours present
    legend = _text(nodes["legend"])
    assert "legend" in legend and "log scale" in legend
    if graph != "backward":
        assert "role: forward" in legend

    module, flops, shown = FIRST_LAYER[model]
    assert human(flops) == shown
    if graph in ("backward", "train", "all"):
        g = _first_layer_ghost(a, "backward", module)
        assert (g.role, g.cost.flops) == ("grad_input", flops)
        ghost = nodes[f"b_{g.name}"]
        assert "ghost" in ghost.get("class").split()
        assert f"pruned: {shown} FLOPs" in _text(ghost)
        assert "stroke-dasharray" in ET.tostring(ghost, encoding="unicode")  # dashed outline
        for role in ("grad_input", "grad_weight"):
            assert f"role: {role}" in legend
            assert _by_class(root, f"role-{role}"), role
            assert ROLE_COLOURS[role].lower() in svg, role
        # residual edges carry their bytes; the first ReLU's output is one of them
        residual_labels = [_text(e) for e in _by_class(root, "residual")]
        assert residual_labels and any(t.startswith("saved ") for t in residual_labels)
        assert f"saved {human_bytes(FIRST_RELU_BYTES[model])}" in residual_labels
    if graph in ("train", "all"):
        assert _by_class(root, "role-update") and ROLE_COLOURS["update"].lower() in svg
    if graph in ("jvp", "all"):
        g = _first_layer_ghost(a, "jvp", module)
        assert (g.role, g.cost.flops) == ("tangent_from_input", flops)
        assert f"skipped: {shown} FLOPs" in _text(nodes[f"j_{g.name}"])
        for role in ("tangent_from_input", "tangent_from_param"):
            assert f"role: {role}" in legend
            assert _by_class(root, f"role-{role}"), role
            assert ROLE_COLOURS[role].lower() in svg, role
    if graph == "forward":
        assert not _by_class(root, "ghost") and not _by_class(root, "residual")


@needs_dot
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m[0])
@pytest.mark.parametrize("graph", GRAPHS)
def test_module_level_renders_to_svg(tmp_path, model, graph):
    name, batch = model
    a = analysis(name, batch)
    out = tmp_path / "m.svg"
    render(a, out, graph=graph, level="module")
    root = _svg(out)
    nodes = {g.get("id"): g for g in _by_class(root, "node")}
    module, flops, shown = FIRST_LAYER[model]
    box = _text(nodes["m_" + module.replace(".", "_")])
    assert human(a.report.layer(module).forward_flops) in box
    assert "log scale" in _text(nodes["legend"])
    ghosts = {_text(g) for g in _by_class(root, "ghost")}
    if graph in ("backward", "train", "all"):
        relu = _text(nodes["m_" + FIRST_RELU[model].replace(".", "_")])
        assert f"saved {human_bytes(FIRST_RELU_BYTES[model])}" in relu
        assert any(t.startswith(f"pruned: {shown} FLOPs") for t in ghosts)
        assert "ratio" in box
    if graph in ("jvp", "all"):
        assert any(t.startswith(f"skipped: {shown} FLOPs") for t in ghosts)
        assert "jvp/fwd" in box


@needs_dot
def test_resnet50_module_level_png(tmp_path):
    """(Its time is a benchmark's business: tools/render_docs.py prints each render's.)"""
    a = analysis("resnet.py:resnet50")
    assert count_op_nodes(a, "train") > 400  # so "auto" picks the module level
    out = tmp_path / "resnet50.png"
    src = render(a, out)  # graph="train", level="auto"
    head = out.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    # one row per bottleneck block: a tall, narrow picture whose text stays readable at 96 dpi
    assert 800 < width < 4000 and height < 12000, (width, height)
    assert "m_layer4_2_conv3" in src and "b_convolution" not in src  # module boxes, no op nodes
    conv1 = a.report.layer("conv1")
    # conv1's input gradient: 2 · 64·112·112 · 3·7·7 = 236,027,904 FLOPs, pruned
    assert conv1.pruned_flops == 2 * 64 * 112 * 112 * 3 * 49
    assert f"pruned: {human(conv1.pruned_flops)} FLOPs" in src


def test_dot_source_works_without_graphviz(tmp_path, monkeypatch):
    a = analysis("convnet.py", 1)
    empty = tmp_path / "no-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert shutil.which("dot") is None
    src = render(a, tmp_path / "g.dot", graph="train")
    assert (tmp_path / "g.dot").read_text() == src and src.startswith("digraph")
    stale = tmp_path / "g.png"
    stale.write_bytes(b"old")
    with pytest.raises(RenderError) as e:
        render(a, stale)
    assert str(e.value) == NO_DOT and "\n" not in str(e.value)
    assert "apt-get install graphviz" in str(e.value) and ".dot output works" in str(e.value)
    assert stale.read_bytes() == b"old"  # nothing written on failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.dot", "g.png", "no-bin"]


def test_bad_arguments():
    a = analysis("convnet.py", 1)
    for kwargs, word in (({"graph": "sideways"}, "graph"), ({"level": "layer"}, "level")):
        with pytest.raises(RenderError, match=word):
            render(a, **kwargs)
    with pytest.raises(RenderError, match="suffix"):
        render(a, "picture.jpg")
    with pytest.raises(ValueError, match="suffix"):  # callers may catch it as a ValueError
        render(a, "picture.jpg")


def test_auto_level_and_profile():
    a = analysis("convnet.py", 1)
    # ConvNet's train graphs: well under 400 call nodes → op level
    assert count_op_nodes(a, "train") <= 400
    assert "b_convolution" in render(a, graph="train")
    module = render(a, graph="train", max_op_nodes=10, profile={"conv1": 0.00123})
    assert "m_conv1" in module and "b_convolution" not in module
    assert "1.23 ms" in module
    # the JSON of `graphflop bench --profile --json`: the train picture shows the train step
    bench = {
        "runtimes": {
            "onnxruntime": {
                "profile": {
                    "forward": {"top_nodes": [], "modules": {"conv1": 0.000456}},
                    "train_step": {
                        "top_nodes": [],
                        "modules": {"conv1": 0.000789, "(model)": 1e-5},
                    },
                }
            }
        }
    }
    assert "789 µs" in render(a, graph="train", level="module", profile=bench)
    assert "456 µs" in render(a, graph="forward", level="module", profile=bench)
    with pytest.raises(RenderError, match="profile"):
        render(a, level="module", profile={"conv1": "fast"})


def test_render_only_reads():
    a = analysis("mlp.py", 64)

    def snapshot():
        out = []
        for k in ("forward", "backward", "update", "jvp"):
            gm = getattr(a, k)
            out.append((k, sorted(gm.meta), [(n.name, sorted(n.meta)) for n in gm.graph.nodes]))
        return out

    before = snapshot()
    for graph in GRAPHS:
        render(a, graph=graph, level="op")
        render(a, graph=graph, level="module")
    assert snapshot() == before


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m[0])
def test_op_scene_without_graphviz(model):
    """The "what to draw" layer alone: the train picture as boxes and edges, no ``dot``."""
    name, batch = model
    a = analysis(name, batch)
    scene = op_scene(a, "train", {}, collapse_loss=True)
    boxes = {b.id: b for b in scene.boxes}
    assert len(boxes) == len(scene.boxes)  # ids are unique
    assert all(e.src in boxes and e.dst in boxes for e in scene.edges)
    module, flops, shown = FIRST_LAYER[model]
    g = _first_layer_ghost(a, "backward", module)
    ghost = boxes[f"b_{g.name}"]
    assert (ghost.kind, ghost.role, ghost.module, ghost.phase) == (
        "ghost",
        "grad_input",
        module,
        "backward",
    )
    assert ghost.label.headline == f"pruned: {shown} FLOPs"
    # the first ReLU's output: one residual edge per backward reader, its bytes printed once
    saved = f"saved {human_bytes(FIRST_RELU_BYTES[model])}"
    assert saved in {e.label for e in scene.edges if e.style == "residual"}
    assert {b.phase for b in scene.boxes} == {"forward", "backward"}
    assert [p.name for p in scene.phases] == ["forward", "backward"]
    assert scene.legend is not None and ("update", ROLE_COLOURS["update"]) in scene.legend.roles


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m[0])
def test_module_scene_without_graphviz(model):
    name, batch = model
    a = analysis(name, batch)
    module, flops, shown = FIRST_LAYER[model]
    scene = module_scene(a, "all", {module: 0.00123})
    boxes = {b.id: b for b in scene.boxes}
    layer = a.report.layer(module)
    stats = {s.key: s.value for s in boxes["m_" + module.replace(".", "_")].label.stats}
    assert stats["fwd"] == human(layer.forward_flops) and stats["time"] == "1.23 ms"
    relu = boxes["m_" + FIRST_RELU[model].replace(".", "_")].label.stats
    assert Stat("#882255", "saved", human_bytes(FIRST_RELU_BYTES[model])) in relu
    notes = {b.label for b in scene.boxes if b.kind == "ghost_note"}
    assert f"pruned: {shown} FLOPs\ngrad_input of {module}" in notes
    assert f"skipped: {shown} FLOPs\ntangent_from_input of {module}" in notes


def test_only_draw_imports_graphviz():
    pkg = Path(gv.__file__).parent
    pattern = re.compile(r"^\s*(import graphviz|from graphviz )", re.M)
    users = sorted(p.name for p in pkg.glob("*.py") if pattern.search(p.read_text()))
    assert users == ["draw.py"]


def test_labels_escape_text():
    card = card_html(Card("a<b", " · x&y", "#000000", "#FFFFFF", ('"q"',)))
    assert "<B>a&lt;b</B> · x&amp;y" in card and "&quot;q&quot;" in card
    stats = stat_card_html(StatCard("m<", "T>", "#000000", (Stat(None, "k&", "v<"),)))
    assert "m&lt;" in stats and "T&gt;" in stats and "k&amp;" in stats and "v&lt;" in stats
    assert '<TD COLSPAN="3"></TD>' in stats  # an odd stat fills its row
    legend = legend_html(Legend("x<y", "viridis", (), (), (LegendItem("a&b", "#123456", "<"),)))
    assert "fill: x&lt;y" in legend and '<FONT COLOR="#123456"><B>&lt;</B>a&amp;b</FONT>' in legend
