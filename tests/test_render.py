"""Graphviz renders: every graph kind through the real ``dot`` to SVG, checked in the SVG text;
the "what to draw" scenes checked without Graphviz.

What the pictures must show (the render issue): the first layer's pruned input gradient as a
ghost node with its FLOPs, backward and tangent nodes in their role colours, residual edges from
forward values to the backward nodes reading them with their bytes, and a legend.
"""

from __future__ import annotations

import functools
import math
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from conftest import ROOT, analysis
from torch import nn

import graphflop.export.graphviz as gv
from graphflop.analysis import analyze
from graphflop.export.graphviz import (
    GRAPHS,
    NO_DOT,
    ROLE_COLOURS,
    RenderError,
    captions,
    count_op_nodes,
    render,
)
from graphflop.export.graphviz.draw import card_html, legend_html, stat_card_html
from graphflop.export.graphviz.module_level import module_scene
from graphflop.export.graphviz.op_level import op_scene
from graphflop.export.graphviz.scene import Card, Legend, LegendItem, Stat, StatCard
from graphflop.export.report import human, human_bytes
from graphflop.io import sanitize_name
from graphflop.load import load, make_inputs
from graphflop.meta import GHOSTS, MODULE

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


@pytest.mark.slow  # 8 s; the GPT-2 and ViT module-level renders stay in the default suite
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
    # module boxes, no op nodes; layer4.2 is identical to layer4.1: drawn once, as "× 2"
    assert "m_layer4_1_conv3" in src and "m_layer4_2_conv3" not in src
    assert "b_convolution" not in src and "<B>× 2</B>" in src
    conv1 = a.report.layer("conv1")
    # conv1's input gradient: 2 · 64·112·112 · 3·7·7 = 236,027,904 FLOPs, pruned
    assert conv1.pruned_flops == 2 * 64 * 112 * 112 * 3 * 49
    assert f"pruned: {human(conv1.pruned_flops)} FLOPs" in src


@needs_dot
def test_all_graph_keeps_the_backward_beside_its_forward(tmp_path):
    """ConvNet's ``all`` picture: Graphviz 2.43 refuses the layout aligning forward, backward
    and tangents rank by rank ("trouble in init_rank"); the backward is then aligned alone
    (invisible minlen=0 edges from each forward op to its largest backward node) rather than
    drawn unaligned, with its column shifted far from the forward it comes from."""
    a = analysis("convnet.py", 1)
    src = render(a, tmp_path / "c.svg", graph="all")
    aligned = re.findall(r"(\w+) -> (\w+) \[arrowhead=none minlen=0 style=invis weight=4", src)
    assert aligned and {y[:2] for _, y in aligned} == {"b_"}  # the tangents not aligned
    # conv1's weight gradient, the backward's largest node from conv1, is pulled level
    assert any(x.startswith("f_convolution") and y.startswith("b_convolution") for x, y in aligned)


def _phase_x(svg: str, phase: str) -> tuple[float, float]:
    """Left and right x of a phase cluster's frame in a rendered SVG."""
    m = re.search(
        rf"<title>cluster_phase_{phase}</title>\s*<(?:path|polygon)[^>]*?(?:points|d)=\"([^\"]+)",
        svg,
    )
    assert m, phase
    xs = [float(v) for v in re.findall(r"-?[\d.]+", m[1])[0::2]]
    return min(xs), max(xs)


@needs_dot
@pytest.mark.parametrize(
    "spec,graph", [("linearnet.py", "train"), ("cnn.py", "all"), ("convnet.py", "all")]
)
def test_backward_is_left_of_forward_for_every_model(tmp_path, spec, graph):
    """dot picks one of two mirror images of a train or all picture, the backward on the left
    for ConvNet and on the right for LinearNet's train graph and the CNN's all graph; the
    layout is mirrored where needed, so the backward is on the forward's left and the tangents
    on its right for every model."""
    a = analysis(spec)
    out = tmp_path / "p.svg"
    render(a, out, graph=graph)
    svg = out.read_text()
    backward, forward = _phase_x(svg, "backward"), _phase_x(svg, "forward")
    assert backward[1] <= forward[0], (backward, forward)
    if graph == "all":
        assert _phase_x(svg, "tangent")[0] >= forward[1]
    # the mirrored picture keeps its nodes and their tooltips
    assert svg.count("<title>") > 50


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


def test_too_many_op_nodes_refused_before_dot(tmp_path, monkeypatch):
    """Above ``MAX_DOT_OP_NODES`` an op-level picture is refused at once, naming the count,
    with no ``dot`` run and no file; the ``.dot`` source is still written, and a module's
    subtree (``module=``) and the module level are not counted against the whole graph.
    The limit is lowered to the ConvNet's size here: its train graph has
    count_op_nodes(a, "train") call nodes."""
    import graphflop.export.graphviz.output as output

    a = analysis("convnet.py", 1)
    n = count_op_nodes(a, "train")
    monkeypatch.setattr(output, "MAX_DOT_OP_NODES", n - 1)
    ran = []
    monkeypatch.setattr(output, "run_dot", lambda *args: ran.append(args))
    with pytest.raises(RenderError) as e:
        render(a, tmp_path / "g.svg", graph="train", level="op")
    assert f"{n:,} op nodes are more than dot can lay out" in str(e.value)
    assert "--level module" in str(e.value) and "\n" not in str(e.value)
    assert ran == [] and list(tmp_path.iterdir()) == []
    assert render(a, tmp_path / "g.dot", graph="train", level="op").startswith("digraph")
    monkeypatch.undo()
    if shutil.which("dot"):
        monkeypatch.setattr(output, "MAX_DOT_OP_NODES", n - 1)
        render(a, tmp_path / "m.svg", graph="train", level="module")
        render(a, tmp_path / "c.svg", graph="train", module="conv1")
        assert (tmp_path / "m.svg").exists() and (tmp_path / "c.svg").exists()


def test_large_graph_first_layout_gets_the_whole_budget(tmp_path, monkeypatch):
    """From ``LARGE_OP_NODES`` on, the first layout runs with ``DOT_TIMEOUT_S`` and its timeout
    ends the render (measured: on GPT-2's train graph the later layouts are the slower ones);
    below it, each layout but the last gets ``DOT_FIRST_TRY_S`` and a timeout tries the next."""
    import graphflop.export.graphviz.output as output

    a = analysis("convnet.py", 1)
    n = count_op_nodes(a, "train")
    if shutil.which("dot") is None:
        monkeypatch.setattr(output.shutil, "which", lambda name: "/usr/bin/dot")
    calls = []

    def timing_out(src, fmt, timeout_s, last):
        calls.append((timeout_s, last))
        if last:
            raise RenderError(f"dot took more than {timeout_s:g} s: try the module level")
        return None

    monkeypatch.setattr(output, "run_dot", timing_out)
    monkeypatch.setattr(output, "LARGE_OP_NODES", n)
    with pytest.raises(RenderError, match="more than 90 s"):
        render(a, tmp_path / "g.svg", graph="train", level="op")
    assert calls == [(output.DOT_TIMEOUT_S, True)]
    calls.clear()
    monkeypatch.setattr(output, "LARGE_OP_NODES", n + 1)  # small: the ladder of four layouts
    with pytest.raises(RenderError, match="more than 90 s"):
        render(a, tmp_path / "g.svg", graph="train", level="op")
    assert calls == [(output.DOT_FIRST_TRY_S, False)] * 3 + [(output.DOT_TIMEOUT_S, True)]
    assert list(tmp_path.iterdir()) == []


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
    # tester's finding: a profile of another model was drawn as no times at all
    with pytest.raises(RenderError, match="names no module of this model"):
        render(a, level="module", profile={"a": 1})


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


# -- transformers: repeated blocks folded, composite names, one module at op level ----------


@functools.lru_cache(maxsize=4)
def _lm(spec: str, ctor: tuple = (), t: int = 128):
    """GPT-2 (token ids (1, t), int64) or another model with its example inputs, on meta."""
    import torch

    loaded = load(str(ROOT / "models" / spec), ctor_kwargs=dict(ctor), meta=True)
    loaded.model.train()
    kw = {"shapes": [(1, t)], "dtype": torch.int64} if "gpt2" in spec else {}
    return analyze(loaded.model, make_inputs(loaded, **kw), name=spec)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


def test_gpt2_small_blocks_fold_into_one_box_x12():
    a = _lm("gpt2.py:gpt2_small")
    scene = module_scene(a, "train", {})
    (fold,) = scene.folds()
    assert fold.count == 12 and fold.members == tuple(f"h.{i}" for i in range(12))
    # the other eleven blocks are not drawn
    assert not [b for b in scene.boxes if b.id.startswith("m_h_") and not b.id.startswith("m_h_0")]
    rows = a.report.layers
    per = sum(r.forward_flops for r in rows if _under(r.name, "h.0"))
    total = sum(r.forward_flops for r in rows if re.fullmatch(r"h\.\d+(\..*)?", r.name))
    # matrix products of one block, T = 128, d = 768: four linears 2·T·d·(3d + d + 4d + 4d)
    # = 1,811,939,328, two attention bmm 2 · (2·12·128·128·64) = 50,331,648
    mm = sum(r.forward_mm_flops for r in rows if _under(r.name, "h.0"))
    assert mm == 2 * 128 * 768 * 12 * 768 + 2 * 2 * 12 * 128 * 128 * 64 == 1_862_270_976
    fwd = fold.row("fwd")
    assert (fwd.per_block, fwd.total) == (per, total) and total == 12 * per
    for key in ("bwd∂x", "bwd∂W", "upd", "jvp", "saved"):
        assert fold.row(key).total == 12 * fold.row(key).per_block, key
    # the boxes drawn inside the fold add up to one block
    inside = [b for b in scene.boxes if b.kind == "module" and b.id.startswith("m_h_0")]
    shown = {b.label.title for b in inside}
    assert {"ln_1", "ln_2", "attention", "c_attn", "c_fc", "gelu", "residual add"} <= shown
    assert sum(_flops(b.label.stats[0].value) for b in inside) == pytest.approx(per, rel=0.01)


def test_tied_embedding_gradient_sum_is_a_weight_gradient():
    """GPT-2 ties wte's weight to the output projection: the weight's two cotangents (the
    lookup's scatter, T·d = 8·64 = 512 adds, and the projection's matrix product) are summed in
    wte, one add per element, V·d = 50257·64 = 3,216,448 FLOPs. That sum is a weight gradient:
    token ids have no input gradient."""
    a = _lm("gpt2.py:gpt2_small", (("n_layer", 2), ("n_embd", 64), ("n_head", 4)), 8)
    row = a.report.layer("wte")
    assert (row.grad_accum_flops, row.grad_weight_flops) == (50257 * 64, 8 * 64)
    boxes = {b.id: b for b in module_scene(a, "train", {}).boxes}
    box = boxes["m_wte"]
    stats = {s.key: s.value for s in box.label.stats}
    assert (stats["bwd∂x"], stats["bwd∂W"]) == ("0", human(50257 * 64 + 8 * 64))
    assert "input gradient 0, weight gradient 3216960," in box.tooltip
    # an accumulation of activation cotangents stays an input gradient: ln_f's input is read
    # by its mean, its variance and its normalisation
    ln_f = a.report.layer("ln_f")
    assert ln_f.grad_accum_flops > 0
    stats = {s.key: s.value for s in boxes["m_ln_f"].label.stats}
    assert stats["bwd∂x"] == human(ln_f.grad_input_flops + ln_f.grad_accum_flops)


def test_one_module_title_gives_that_modules_totals():
    """``--module h.0``'s title sums h.0's subtree, not the whole model: the same figures as
    the per-block column of the fold of h.0 and h.1 (computed there from the boxes)."""
    a = _lm("gpt2.py:gpt2_small", (("n_layer", 2), ("n_embd", 64), ("n_head", 4)), 8)
    (fold,) = module_scene(a, "train", {}).folds()
    per = {r.key: r.per_block for r in fold.rows}
    want = (
        f"h.0 (Block): forward {human(per['fwd'])} FLOPs · backward "
        f"{human(per['bwd∂x'] + per['bwd∂W'])} (input {human(per['bwd∂x'])}, weight "
        f"{human(per['bwd∂W'])}, pruned 0)"
    )
    for scene in (
        op_scene(a, "train", {}, True, module="h.0"),
        module_scene(a, "train", {}, module="h.0"),
    ):
        head, *totals = scene.title.split("\n")
        assert "module h.0, train graph" in head
        text = " · ".join(totals)
        assert text.startswith(want), text
        assert f"update {human(per['upd'])}" in text
        assert f"saved for backward {human_bytes(per['saved'])}" in text
    assert per["fwd"] < a.report.totals.forward.flops / 2  # two blocks and the head


@needs_dot
def test_title_fits_a_1200_px_window(tmp_path):
    """The title's totals wrap, so a narrow picture is not widened past 1,200 px by its title
    (the SVG's width is in points: 1 pt = 4/3 px)."""
    a = _lm("gpt2.py:gpt2_small", (("n_layer", 2), ("n_embd", 64), ("n_head", 4)), 8)
    out = tmp_path / "m.svg"
    render(a, out, graph="all", level="module")
    width_pt = float(re.search(r'<svg width="([\d.]+)pt"', out.read_text())[1])
    assert width_pt * 4 / 3 <= 1200, width_pt
    assert max(map(len, captions.title(a, "all", "module").split("\n"))) <= captions.TITLE_WIDTH


def test_a_fold_says_per_block_and_x_n_total_everywhere():
    """The fold's table heads its columns "per block" and "× 2 = total", the legend explains
    those words, the boxes inside say they are per block, and without clusters the box names
    the fold with the same mark."""
    from graphflop.export.graphviz.draw import fold_html

    a = _lm("gpt2.py:gpt2_small", (("n_layer", 2), ("n_embd", 64), ("n_head", 4)), 8)
    scene = module_scene(a, "train", {})
    (fold,) = scene.folds()
    header = fold_html(fold)
    assert "<B>× 2</B>" in header
    assert "<I>per block</I>" in header and "<I>× 2 = total</I>" in header
    legend = " ".join(i.lead + i.text for i in scene.legend.items)
    assert "× N cluster" in legend and "per block, × N = total" in legend
    tips = [b.tooltip for b in scene.boxes if b.kind == "module" and b.id.startswith("m_h_0")]
    assert tips and all(
        "(per block: one of 2 identical, h.0 … h.1; × 2 = total)" in t for t in tips
    )
    flat = module_scene(a, "train", {}, clusters=False)
    titles = {b.label.title for b in flat.boxes if b.kind == "module"}
    assert "h.0.attn (× 2) · attention" in titles or "h.0.attn (× 2)" in titles, titles


def _flops(text: str) -> float:
    num, _, unit = text.partition(" ")
    return float(num) * {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[unit]


@needs_dot
@pytest.mark.parametrize("spec", ["gpt2.py:gpt2_small", "vit.py:vit_b_16"])
def test_transformer_module_png_fits_4000px(tmp_path, spec):
    a = _lm(spec)
    out = tmp_path / "m.png"
    src = render(a, out, level="module")
    width, height = struct.unpack(">II", out.read_bytes()[16:24])
    assert max(width, height) <= 4000, (width, height)
    assert src.count("<B>× 12</B>") == 1  # the twelve blocks drawn once


def test_composite_names():
    from graphflop.export.graphviz.composite import composite_name

    # the ATen ops GPT-2's modules trace to (see models/gpt2.py)
    ln = ["var_mean", "getitem", "getitem", "add", "rsqrt", "sub", "mul", "mul", "add"]
    gelu = ["mul", "mul", "mul", "add", "mul", "mul", "tanh", "add", "mul"]
    attn = ["split_with_sizes", "view", "permute", "mul", "expand", "bmm", "ge", "where"]
    attn += ["amax", "sub", "exp", "sum", "div", "expand", "view", "bmm", "clone", "view"]
    ce = ["amax", "sub", "exp", "sum", "log", "sub", "ne", "where", "gather", "neg", "div"]
    assert composite_name(ln) == "layer norm" and composite_name(gelu) == "GELU"
    assert composite_name(attn) == "attention" and composite_name(ce) == "cross-entropy"
    assert composite_name(["add", "add"]) == "residual add"
    assert composite_name(["permute", "view", "addmm", "view"]) == "linear"
    assert composite_name(ln, "BatchNorm2d") == "batch norm"
    assert composite_name(["convolution"]) is None
    assert composite_name(["exp", "sum", "div"]) == "softmax"


def test_one_module_at_op_level():
    a = _lm("gpt2.py:gpt2_small", (("n_layer", 2), ("n_embd", 64), ("n_head", 4)), 8)
    scene = op_scene(a, "train", {}, True, module="h.1")
    op_boxes = [b for b in scene.boxes if b.kind == "op"]
    assert op_boxes and all(b.module.startswith("h.1") or b.module == "" for b in op_boxes)
    fwd = {b.id for b in op_boxes if b.id.startswith("f_")}
    names = {n.name for n in a.forward.graph.nodes if str(n.meta.get(MODULE, "")).startswith("h.1")}
    assert fwd == {f"f_{n}" for n in names}  # every forward op of h.1, nothing else
    # edges crossing the border end in boxes naming the module outside
    border = {b.label.split("\n")[0] for b in scene.boxes if b.id.startswith("x_")}
    assert "from h.0" in border and "to ln_f" in border
    assert "h.1.attn · CausalSelfAttention · attention" in {c.label for c in scene.clusters()}
    with pytest.raises(RenderError, match="no module 'h.9'"):
        render(a, graph="train", module="h.9")


def test_unknown_module_lists_the_children_of_its_nearest_prefix():
    """``--module h.9`` of a 2-layer model named the top-level modules (emb, h, ln, head);
    where a prefix (``h``) has ops under it, its children are listed instead, a long list
    shortened; where none has, the top-level modules."""
    from graphflop.export.graphviz.op_level import check_module

    a = _lm("gpt2.py:gpt2_small", (("n_layer", 2), ("n_embd", 64), ("n_head", 4)), 8)
    with pytest.raises(RenderError) as e:
        render(a, graph="train", module="h.9")
    assert str(e.value) == (
        "no module 'h.9' with ops in the forward graph: the modules under 'h' with ops are h.0, h.1"
    )
    with pytest.raises(RenderError, match=r"under 'h.1.attn' with ops are h.1.attn.c_attn, h"):
        check_module(a, "h.1.attn.nope")
    with pytest.raises(RenderError, match=r": 'h.0.ln_1' has no submodule with ops$"):
        check_module(a, "h.0.ln_1.weight")
    with pytest.raises(RenderError, match=r": top-level modules are wte, wpe, h, ln_f$"):
        check_module(a, "blocks.0")
    a = _lm("gpt2.py:gpt2_small", (("n_layer", 14), ("n_embd", 32), ("n_head", 2)), 4)
    layers = ", ".join(f"h.{i}" for i in range(8))
    with pytest.raises(RenderError, match=rf"are {layers}, \.\.\., h\.12, h\.13 \(14 in all\)$"):
        check_module(a, "h.14")


# Machado, Oliveira & Fernandes (2009), severity 1.0, applied to linear RGB
CVD = {
    "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216),
                   (-0.003882, -0.048116, 1.051998)),
    "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413),
                     (-0.011820, 0.042940, 0.968881)),
    "tritanopia": ((1.255528, -0.076749, -0.178779), (-0.078411, 0.930809, 0.147602),
                   (0.004733, 0.691367, 0.303900)),
}  # fmt: skip


def _lab(hex_colour: str, matrix=None) -> tuple[float, float, float]:
    """CIELAB (D65) of a colour, after a colour-vision-deficiency matrix."""
    srgb = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in srgb]
    if matrix:
        lin = [min(1.0, max(0.0, sum(m * c for m, c in zip(row, lin)))) for row in matrix]
    xyz = [
        sum(m * c for m, c in zip(row, lin))
        for row in ((0.4124, 0.3576, 0.1805), (0.2126, 0.7152, 0.0722), (0.0193, 0.1192, 0.9505))
    ]
    f = [
        t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29
        for t in (xyz[0] / 0.95047, xyz[1], xyz[2] / 1.08883)
    ]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def _worst_pair(colours: dict[str, str]) -> tuple[float, str]:
    """The smallest CIE76 difference between two colours, over normal vision and the three
    simulated dichromacies, and where it occurs."""
    worst = (1e9, "")
    names = list(colours)
    for kind, matrix in [("normal", None), *CVD.items()]:
        labs = {n: _lab(colours[n], matrix) for n in names}
        for i, x in enumerate(names):
            for y in names[i + 1 :]:
                d = math.dist(labs[x], labs[y])
                worst = min(worst, (d, f"{x}/{y} ({kind})"))
    return worst


def _hue_gap(colours: dict[str, str]) -> tuple[float, str]:
    """The smallest CIELAB hue-angle gap (degrees, normal vision) between two chromatic
    colours."""
    hue = {}
    for n, c in colours.items():
        _, a_, b_ = _lab(c)
        if math.hypot(a_, b_) > 10:  # black and greys have no hue
            hue[n] = math.degrees(math.atan2(b_, a_)) % 360
    names = list(hue)
    gaps = [
        (min(abs(hue[x] - hue[y]), 360 - abs(hue[x] - hue[y])), f"{x}/{y}")
        for i, x in enumerate(names)
        for y in names[i + 1 :]
    ]
    return min(gaps)


def test_role_colours_differ_in_hue_and_under_colour_blindness():
    from graphflop.export.graphviz.palette import RESIDUAL_COLOUR

    colours = dict(ROLE_COLOURS) | {"residual": RESIDUAL_COLOUR}
    d, where = _worst_pair(colours)
    assert d >= 15, where  # CIE76: about 2.3 is just noticeable; 15 is plainly different
    gap, where = _hue_gap(ROLE_COLOURS)
    assert gap >= 25, where
    # the checks can fail: the previous palette's two gradients were two oranges
    old = {"grad_input": "#D55E00", "grad_weight": "#E69F00"}
    assert _hue_gap(old)[0] < 25
    # and its two tangents two blues
    assert _hue_gap({"t_in": "#56B4E9", "t_param": "#0072B2"})[0] < 25


def _nearest_viridis(colour: str) -> float:
    """The CIE76 difference (normal vision) from ``colour`` to the closest of viridis' 256."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    lab = _lab(colour)
    cmap = colormaps["viridis"]
    return min(math.dist(lab, _lab(to_hex(cmap(i / 255)))) for i in range(256))


def test_role_colours_stay_clear_of_the_flop_scale():
    """A role is a box's strip and border around a viridis fill: no role may look like a FLOP
    count (CIE76 difference of at least 20 from every viridis colour)."""
    from graphflop.export.graphviz.palette import COLORMAP, RESIDUAL_COLOUR

    assert COLORMAP == "viridis"
    near = {r: round(_nearest_viridis(c), 1) for r, c in ROLE_COLOURS.items()}
    near["residual"] = round(_nearest_viridis(RESIDUAL_COLOUR), 1)
    assert min(near.values()) >= 20, near
    # the check can fail: the earlier tangents, Tol's teal and indigo, sat on viridis
    assert _nearest_viridis("#44AA99") < 10 and _nearest_viridis("#332288") < 20


def test_legend_explains_edges():
    a = analysis("convnet.py", 1)
    scene = op_scene(a, "train", {}, True)
    text = " ".join(i.text for i in scene.legend.items)
    assert "residual" in text and "data flow" in text and "parameter read by the backward" in text


chromium = shutil.which("chromium") or shutil.which("chromium-browser")


@needs_dot
@pytest.mark.skipif(chromium is None, reason="chromium not installed")
def test_html_page_searches_in_headless_chromium(tmp_path):
    a = _lm("gpt2.py:gpt2_small", (("n_layer", 2), ("n_embd", 64), ("n_head", 4)), 8)
    out = tmp_path / "model.html"
    render(a, out, level="module")
    root_svg = out.read_text()
    # what the page's search should find: node groups whose id, text or tooltip holds "attn"
    svg = ET.fromstring(root_svg[root_svg.index("<svg") : root_svg.index("</svg>") + 6])
    want = 0
    for g in _by_class(svg, "node"):
        tips = " ".join(v for el in g.iter() for k, v in el.attrib.items() if k.endswith("title"))
        blob = " ".join([g.get("id") or "", "".join(g.itertext()), tips]).lower()
        want += "attn" in blob
    assert want >= 3
    cmd = _chromium(tmp_path)
    url = out.as_uri() + "#q=attn"
    dom = subprocess.run(
        [*cmd, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert f'data-matches="{want}"' in dom
    assert dom.count('class="node hit') + dom.count('class="node current hit') >= 1
    shot = tmp_path / "shot.png"
    subprocess.run(
        [*cmd, f"--screenshot={shot}", "--window-size=1200,900", url],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _chromium(tmp_path) -> list[str]:
    return [
        chromium, "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
    ]  # fmt: skip


def _classes(dom: str, kind: str) -> list[list[str]]:
    """The class lists of the page's ``kind`` groups (``node``, ``cluster``) after a search."""
    return [c.split() for c in re.findall(rf'<g [^>]*class="({kind}(?: [^"]*)?)"', dom)]


@needs_dot
@pytest.mark.skipif(chromium is None, reason="chromium not installed")
def test_html_search_finds_a_member_of_a_fold(tmp_path):
    """GPT-2 with 12 blocks draws h.0 for all twelve: searching h.5 finds the fold, says h.5 is
    one of its blocks, highlights the boxes of the block drawn and dims everything else, the
    clusters holding no match included; a search for another module dims the fold."""
    a = _lm("gpt2.py:gpt2_small", (("n_layer", 12), ("n_embd", 64), ("n_head", 4)), 8)
    out = tmp_path / "model.html"
    render(a, out, level="module")
    page = out.read_text()
    svg = ET.fromstring(page[page.index("<svg") : page.index("</svg>") + 6])
    # the boxes the search should light: those of the block drawn, h.0 (their tooltips)
    inside = {
        g.get("id")
        for g in _by_class(svg, "node")
        for el in g.iter()
        for k, v in el.attrib.items()
        if k.endswith("title") and v.startswith("h.0")
    }
    assert len(inside) >= 8
    dom = subprocess.run(
        [*_chromium(tmp_path), "--dump-dom", out.as_uri() + "#q=h.5"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    note = re.search(r'data-folds="([^"]*)"', dom)
    assert note and note[1] == "h.5 is one of the × 12 blocks h.0 … h.11, drawn once as h.0"
    lit = set(re.findall(r'<g id="([^"]+)" class="node hit', dom))
    assert lit >= inside and f'data-matches="{len(lit) + 1}"' in dom  # the boxes and the fold
    assert re.search(r'<g id="fold_h_0" class="cluster hit"', dom)
    nodes = _classes(dom, "node")
    assert all(("hit" in c) != ("dim" in c) for c in nodes)  # every box lit or dimmed
    assert any("dim" in c for c in nodes)
    # a search outside the fold dims it with every other cluster
    dom = subprocess.run(
        [*_chromium(tmp_path), "--dump-dom", out.as_uri() + "#q=wte"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert re.search(r'<g id="fold_h_0" class="cluster dim"', dom)
    assert all("dim" in c for c in _classes(dom, "cluster"))
    assert 'data-folds=""' in dom


def test_module_folds_come_from_the_hierarchy():
    """The tiny Llama's four decoder layers are one template called four times (the tracer's
    hierarchy): the module level folds them, where comparing their ops alone finds only the
    layers' k/v and gate/up projection pairs (8 small folds)."""
    from graphflop.export.graphviz import structure
    from graphflop.meta import HIERARCHY

    tiny = dict(vocab=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128)
    loaded = load(str(ROOT / "models" / "llama.py"), ctor_kwargs=tiny, meta=True)
    a = analyze(loaded.model, make_inputs(loaded, shapes=[(2, 8)]), backward=False, jvp=False)
    assert [f.members for f in structure.folds(a.forward)] == [
        ("layers.0", "layers.1", "layers.2", "layers.3")
    ]
    h = a.forward.meta.pop(HIERARCHY)
    try:
        by_ops = [f.members for f in structure.folds(a.forward)]
    finally:
        a.forward.meta[HIERARCHY] = h
    assert len(by_ops) == 8 and ("layers.0.attention.k_proj", "layers.0.attention.v_proj") in by_ops


class _Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(x)))


class _Stack(nn.Module):
    """Four identical blocks reading the model's input directly: the first block's input
    needs no gradient, so its backward differs from the others'."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_Block() for _ in range(4)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


def test_fold_splits_only_on_figures_the_picture_shows():
    """A forward picture folds all four blocks (their forward FLOPs are equal); a train
    picture draws the first apart, whose input gradient is not computed (3 folded)."""
    a = analyze(_Stack(), (torch.randn(2, 8),))
    fwd = [f.count for f in module_scene(a, "forward", {}).folds()]
    train = [f.count for f in module_scene(a, "train", {}).folds()]
    assert fwd == [4] and train == [3]


class _Inner(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.n, self.a = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.a(self.n(x)))


class _Outer(nn.Module):
    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.inner = nn.ModuleList(_Inner(d) for _ in range(k))
        self.mix = nn.Linear(d, d)

    def forward(self, x):
        for m in self.inner:
            x = m(x)
        return self.mix(x)


class _NestedRep(nn.Module):
    """Four inner blocks inside each of three outer blocks (d = 12, batch 3)."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.stem = nn.Linear(10, d)
        self.stages = nn.ModuleList(_Outer(d, 4) for _ in range(3))
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        x = self.stem(x)
        for s in self.stages:
            x = s(x)
        return self.head(x)


@functools.lru_cache(maxsize=2)
def _nested(outline: bool = True):
    """_NestedRep analysed with its hierarchy (three calls of one outer block), or flat: every
    call traced, the reference for the figures."""
    torch.manual_seed(0)
    return analyze(_NestedRep(), (torch.randn(3, 10),), outline=outline)


def _fwd_under(a, root: str) -> int:
    return sum(r.forward_flops for r in a.report.layers if _under(r.name, root))


def test_nested_repeats_fold_inside_their_fold():
    """A tester's finding: the inner blocks (× 4) of the repeated outer blocks (× 3) were drawn
    four times. Both repeats fold: one inner block is drawn, inside the one outer block drawn;
    the tables' figures are the flat analysis's (every call traced)."""
    a, flat = _nested(), _nested(False)
    scene = module_scene(a, "train", {})
    inner = tuple(f"stages.0.inner.{i}" for i in range(4))
    assert [f.members for f in scene.folds()] == [("stages.0", "stages.1", "stages.2"), inner]
    outer_fold, inner_fold = scene.folds()
    assert (outer_fold.row("fwd").per_block, outer_fold.row("fwd").total) == (
        _fwd_under(flat, "stages.0"),
        _fwd_under(flat, "stages"),
    )
    assert (inner_fold.row("fwd").per_block, inner_fold.row("fwd").total) == (
        _fwd_under(flat, "stages.0.inner.0"),
        _fwd_under(flat, "stages.0.inner"),
    )
    assert inner_fold.row("upd").total == 4 * inner_fold.row("upd").per_block > 0
    boxes = {b.id: b for b in scene.boxes if b.kind == "module"}
    assert set(boxes) == {
        "m_stem",
        "m_stages_0_inner_0",  # the residual add and tanh
        "m_stages_0_inner_0_n",
        "m_stages_0_inner_0_a",
        "m_stages_0_mix",
        "m_head",
        "m_loss",
    }
    # Linear(12, 12) on 3 × 12: 2 · 3 · 12 · 12 + 3 · 12 (bias) = 900 FLOPs per inner block
    assert boxes["m_stages_0_inner_0_a"].label.stats[0].value == human(900)
    assert "(in each of 3 identical stages.0 … stages.2)" in boxes["m_stages_0_inner_0_a"].tooltip
    edges = {(e.src, e.dst) for e in scene.edges if e.style == "data"}
    assert ("m_stages_0_inner_0", "m_stages_0_mix") in edges
    assert ("m_stages_0_mix", "m_head") in edges
    # flows from one member into the next (inner k into k + 1, outer into outer) not drawn
    assert ("m_stages_0_inner_0", "m_stages_0_inner_0_n") not in edges
    assert ("m_stages_0_mix", "m_stages_0_inner_0_n") not in edges
    flat_titles = {b.label.title for b in module_scene(a, "train", {}, clusters=False).boxes}
    assert {"stages.0.inner.0.a (× 3 · × 4)", "stages.0.mix (× 3)"} <= flat_titles
    src = render(a, graph="train", level="module")
    assert src.count("<B>× 3</B>") == src.count("<B>× 4</B>") == 1
    assert "m_stages_0_inner_1" not in src and "m_stages_1" not in src


class _Stage(nn.Module):
    """``k`` identical residual blocks of two Linear(8, 8) around a tanh; no ops of its own."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_TanhBlock() for _ in range(k))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _TanhBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class _Stages(nn.Module):
    def __init__(self, counts: tuple[int, ...]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(_Stage(k) for k in counts)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for s in self.stages:
            x = s(x)
        return self.head(x)


def _dot_accounting(src: str) -> tuple[float, list[tuple[int, str, str]]]:
    """A module-level forward .dot read back: the sum of every box's forward FLOPs times the
    counts of the folds around it, and each fold table's (count, per block, total)."""
    shown, stack, folds = 0.0, [], []
    for line in src.splitlines():
        if re.match(r"\s*subgraph cluster_", line):
            stack.append(1)
        elif line.strip() == "}" and stack:
            stack.pop()
        elif m := re.search(r" id=cluster_\S+ label=\"× (\d+) ", line):
            stack[-1] = int(m[1])
        elif " id=fold_" in line:
            cells = re.findall(r">([^<>]+)</TD>", line.replace("<B>", "").replace("</B>", ""))
            count = re.search(r"× (\d+)", line)
            assert count is not None and "fwd" in cells, line
            i = cells.index("fwd")
            folds.append((int(count[1]), cells[i + 1], cells[i + 2]))
        elif m := re.search(
            r'^\s*m_\w+ \[label=<.*?>fwd</FONT></TD><TD ALIGN="RIGHT">([^<]+)<', line
        ):
            shown += _flops(m[1]) * math.prod(stack)
    return shown, folds


@pytest.mark.parametrize(
    ("counts", "folds"),
    [
        # 3 stages × 3 blocks: the stages fold (× 3, 4.32 k each), inside it the blocks (× 3)
        ((3, 3, 3), [(3, "4.32 k", "13 k"), (3, "1.44 k", "4.32 k")]),
        # stages of 3, 3, 2 blocks: stages.0 and .1 fold (× 2); stages.2 apart, its blocks × 2
        ((3, 3, 2), [(2, "4.32 k", "8.64 k"), (3, "1.44 k", "4.32 k"), (2, "1.44 k", "2.88 k")]),
    ],
)
def test_outer_fold_of_clusters_only_is_drawn(counts, folds):
    """A tester's finding: stages whose own ops are none (all in their inner blocks) lost their
    "× 3": the picture showed stages.0 and its inner fold only, 8.64 k of the title's 13.4 k
    FLOPs nowhere. Every FLOP of the title is in the .dot: boxes times their folds' counts.
    By hand, on 5 × 8 (one multiply-add = 2 FLOPs): a block is two Linear(8, 8),
    2 · (2 · 5 · 8 · 8 + 5 · 8) = 1,360, its tanh 40 and residual add 40: 1,440;
    the head Linear(8, 4): 2 · 5 · 8 · 4 + 5 · 4 = 340; the loss: its report row."""
    torch.manual_seed(0)
    a = analyze(_Stages(counts), (torch.randn(5, 8),))
    loss = next(r.forward_flops for r in a.report.layers if r.name == "loss")
    total = sum(counts) * 1440 + 340 + loss
    assert a.report.totals.forward.flops == total
    src = render(a, graph="forward", level="module")
    assert f"forward {human(total)} FLOPs" in src
    shown, tables = _dot_accounting(src)
    assert shown == total
    assert tables == folds


def test_siblings_apart_inside_a_fold_stay_apart():
    """Inside the folded blocks of _Stack, l1 and l2 compute the same ops but are not a run of
    blocks (the parent's ReLU lies between them): each keeps its box."""
    a = analyze(_Stack(), (torch.randn(2, 8),))
    scene = module_scene(a, "forward", {})
    assert [f.count for f in scene.folds()] == [4]
    ids = {b.id for b in scene.boxes}
    assert {"m_blocks_0_l1", "m_blocks_0_l2"} <= ids


@pytest.mark.parametrize(
    ("model", "first", "other"),
    [
        ("gpt2", "h.0", "h.1"),
        ("nested", "stages.0", "stages.1"),
        ("nested", "stages.0.inner.0", "stages.2.inner.3"),
    ],
)
def test_module_level_draws_any_copy_of_a_repeated_block(model, first, other):
    """A tester's finding: ``--module h.1 --level module`` drew the legend and the input only
    (h.1's boxes stood for by h.0's, which lay outside the picture). Any copy draws as the
    first does, with its own names and the flat analysis's figures."""
    if model == "gpt2":
        a = flat = _lm("gpt2.py:gpt2_small", (("n_layer", 2), ("n_embd", 64), ("n_head", 4)), 8)
    else:
        a, flat = _nested(), _nested(False)
    scenes = {m: module_scene(a, "train", {}, module=m) for m in (first, other)}
    boxes = {m: {b.id: b for b in s.boxes if b.kind == "module"} for m, s in scenes.items()}
    key = sanitize_name(first), sanitize_name(other)
    assert boxes[other] and set(boxes[other]) == {i.replace(*key) for i in boxes[first]}
    for i, b in boxes[first].items():
        assert boxes[other][i.replace(*key)].label == b.label
    # a box inside a fold stands for each of its members
    folds = scenes[other].folds()
    shown = sum(
        _flops(b.label.stats[0].value)
        * math.prod(
            f.count for f in folds if f"{i}_".startswith(f"m_{sanitize_name(f.members[0])}_")
        )
        for i, b in boxes[other].items()
    )
    assert shown == pytest.approx(_fwd_under(flat, other), rel=0.01)
    assert [f.count for f in scenes[other].folds()] == [f.count for f in scenes[first].folds()]
    dots = {m: render(a, graph="train", level="module", module=m) for m in (first, other)}
    assert dots[other].count("label=") == dots[first].count("label=")


def test_render_module_alias_names_the_first_name(capsys, tmp_path):
    """One block registered twice (``blocks.0`` and ``blocks.1``) traces under its first name:
    ``--module blocks.1`` says so and draws blocks.0 (it said "no module 'blocks.1'")."""
    from conftest import cli

    model = tmp_path / "alias.py"
    model.write_text(
        "import torch, torch.nn as nn\n"
        "class Blk(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = nn.Linear(8, 8)\n"
        "    def forward(self, x): return x + torch.relu(self.l(x))\n"
        "class Alias(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); b = Blk()\n"
        "        self.blocks = nn.ModuleList([b, b, Blk()]); self.head = nn.Linear(8, 3)\n"
        "    def forward(self, x):\n"
        "        for m in self.blocks: x = m(x)\n"
        "        return self.head(x)\n"
        "def example_inputs(): return (torch.randn(2, 8),)\n"
    )
    for path, first in (("blocks.1", "blocks.0"), ("blocks.1.l", "blocks.0.l")):
        out = tmp_path / f"{path}.dot"
        rc, _, err = cli(capsys, "render", model, "--module", path, "--level", "module", "-o", out)
        assert rc == 0, err
        text = " ".join(err)
        assert f"{path} is the same module object as {first}" in text
        assert f"m_{sanitize_name(first)}" in out.read_text()
    rc, _, err = cli(capsys, "render", model, "--module", "blocks.2", "-o", tmp_path / "b2.dot")
    assert rc == 0 and not any("same module object" in line for line in err)


@needs_dot
@pytest.mark.skipif(chromium is None, reason="chromium not installed")
def test_html_search_finds_a_member_of_a_nested_fold(tmp_path):
    """Searching stages.2.inner.3.a, inside the × 4 inner blocks of the × 3 outer blocks,
    names both folds and lights the box drawn for it, stages.0.inner.0.a."""
    out = tmp_path / "nested.html"
    render(_nested(), out, level="module")
    dom = subprocess.run(
        [*_chromium(tmp_path), "--dump-dom", out.as_uri() + "#q=stages.2.inner.3.a"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    note = re.search(r'data-folds="([^"]*)"', dom)
    assert note and note[1] == (
        "stages.2 is one of the × 3 blocks stages.0 … stages.2, drawn once as stages.0; "
        "stages.0.inner.3 is one of the × 4 blocks stages.0.inner.0 … stages.0.inner.3, drawn "
        "once as stages.0.inner.0"
    )
    lit = set(re.findall(r'<g id="([^"]+)" class="node hit', dom))
    assert "m_stages_0_inner_0_a" in lit and "m_stages_0_mix" not in lit


class _SiluBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class _Reused(nn.Module):
    """Blocks ``a`` and ``b`` (``x + fc2(silu(fc1(x)))``, d = 8) each called twice."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.c = _SiluBlock(d), _SiluBlock(d), _SiluBlock(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.b(self.c(self.a(self.b(self.a(x))))))


def test_reused_module_boxes_split_its_figures_without_negatives():
    """Each call of a reused module is its own box; the figures of its residual add, batch 4,
    d = 8: forward 4·8 = 32 adds, no weight gradient, its tangent one add of the two
    tangents, 32 FLOPs (the JVP graph's node names, ``add_tensor_9``, used to be looked up in
    the backward's weight-gradient sums: b's first add showed weight gradient +32, its second
    -32)."""
    a = analyze(_Reused(), (torch.randn(4, 8),))
    tips = {b.id: b.tooltip for b in module_scene(a, "all", {}, clusters=False).boxes if b.tooltip}
    figures = {
        k: [int(v) for v in re.findall(r"-?\d+", t.split("\n")[-1].split(";")[0])]
        for k, t in tips.items()
    }
    assert all(v >= 0 for fig in figures.values() for v in fig), figures
    # forward, input gradient, weight gradient, update, jvp
    assert figures["m_b"] == figures["m_b__2"] == [32, 0, 0, 0, 32]
