"""Graphviz pictures of an analysis: where the backward cost and the forward-mode savings come from.

:func:`render` draws one of five pictures (``graph=``) at one of two levels (``level=``):

* ``forward`` — the traced forward graph (model and loss);
* ``backward`` — the backward graph alone; the residuals it reads are small "saved" nodes;
* ``jvp`` — the JVP graph: primal nodes, tangent nodes by role, skipped zero-tangent work;
* ``train`` — forward, backward and update in one picture, with residual edges from the forward
  values to the backward nodes that read them;
* ``all`` — ``train`` plus the JVP graph's tangent nodes, which read the same forward values.

``level="op"`` draws one node per graph node; ``level="module"`` one box per ``nn.Module`` path
with its forward, backward, update and JVP FLOPs, ratios, saved bytes and (with ``profile``)
measured time. ``level="auto"`` picks ``op`` up to ``max_op_nodes`` call nodes, else ``module``.

Drawing choices (op level)
    * Node fill: FLOPs on matplotlib's perceptually uniform ``viridis`` scale, log10, from the
      smallest to the largest non-zero count in the picture; nodes with no FLOPs (views) are
      white. The header strip and the border carry the node's role colour (:data:`ROLE_COLOURS`:
      roles differ in hue and stay apart under simulated colour blindness, see :mod:`.palette`). Each label:
      op name, output shape, FLOPs and bytes moved (read + written).
    * Clusters: one per ``nn.Module`` path, nested along the path.
    * ``train``/``all``: one column per graph (forward, backward with the update, JVP
      tangents), each with its own module clusters. Backward edges are drawn reversed
      (``dir=back``), so the backward also runs from the first layer at the top to the loss at
      the bottom, and each forward op is pulled onto the rank of the largest backward (and
      tangent) node derived from it: a module's backward sits beside its forward (each node's
      tooltip names its forward source). Update nodes hang below the gradient they read.
    * Residuals: an edge (wine, width growing with size) from the forward value to each backward
      node reading it, labelled "saved <bytes>" on the first such edge: the memory a
      forward-mode (JVP) step does not keep. Parameters read by the backward are dotted grey.
    * Parameters, inputs and targets are small grey rounded nodes; scalar hyper-parameters
      (``lr``, ``step``) are omitted. Data edges are labelled with the bytes of the tensor they
      carry when it is at least 1/16 of the largest one drawn.
    * The loss (about twenty scalar-sized ops per graph for a cross-entropy) is one node per
      graph unless ``collapse_loss=False``.
    * Ghosts (work not emitted): dashed grey nodes, "pruned: <FLOPs>" in the backward (the first
      layer's input gradient), "skipped: <FLOPs>" in the JVP (zero-tangent work), with dashed
      edges from what they would have read and, in the JVP, to the tangent sum they were
      dropped from.
    * A legend node lists the FLOP scale, the role colours present, ghosts and residuals.
    * Graphviz 2.43 rejects some cluster layouts ("trouble in init_rank"); :func:`render` then
      falls back to simpler layouts (see its Returns).

Drawing choices (module level)
    One box per stretch of a module's own ops (a module whose ops resume after another's, e.g.
    a block's two residual ``add``, gets one box per stretch, so a deep chain reads top to
    bottom), named by the module and by what its ops compute where they are a known composite
    (attention, layer norm, GELU, cross-entropy: :mod:`.composite`), nested in clusters along
    the path, filled by FLOPs (viridis, log) and listing forward, input-gradient,
    weight-gradient, update and JVP FLOPs, ratios, bytes saved for backward and measured time;
    edges follow the forward data flow. Repeated identical modules (a transformer's blocks:
    :mod:`.structure`) are drawn once, in a cluster marked "×N" whose label tables per-block and
    total figures; repeats inside the block drawn (the inner blocks of repeated outer blocks)
    fold inside it. With more than 40 boxes, the boxes directly inside one parent cluster are
    laid out in one row (ResNet-50: one row per bottleneck block). Pruned and skipped work are
    dashed ghost boxes beside their module.

Output
    SVG boxes and edges carry tooltips (node name, op, shapes, FLOPs, bytes, module and the
    forward node it derives from); ``.html`` embeds the SVG in a page with a search box
    (:mod:`.page`). ``module=`` draws one module's subtree (at op level by default).

Package layout ("what to draw", then "how to draw"):
    * :mod:`.scene` — a Graphviz-free model of a picture: boxes, edges, clusters, legend;
    * :mod:`.op_level` (with :mod:`.op_parts`) and :mod:`.module_level` (with
      :mod:`.structure`: boxes and repeated modules) — build a scene from an analysis, one per
      level; :mod:`.composite` — names of groups of ATen ops; :mod:`.captions` — title and legend text; :mod:`.palette` —
      colours; :mod:`.facts` — analysis facts read from node annotations and the typed report
      (``analysis.report``);
    * :mod:`.draw` — the only user of the ``graphviz`` library: a scene as a ``Digraph``, with
      its HTML-like labels; :mod:`.output` — runs ``dot`` and writes the file atomically;
      :mod:`.page` — the HTML page around an SVG.

Reads (never writes): ``val``, ``KIND``, ``ROLE``, ``SOURCE``, ``MODULE``,
``COST``, ``PARAM``, ``RESIDUAL``, PyTorch's ``nn_module_stack`` (module class names,
optional); ``gm.meta`` keys ``SIGNATURE``, ``GHOSTS``, ``GHOST_LINKS``, ``UPDATE``;
``analysis.report``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from graphflop.export.graphviz import facts
from graphflop.export.graphviz.draw import to_digraph
from graphflop.export.graphviz.errors import NO_DOT, RenderError
from graphflop.export.graphviz.module_level import module_scene
from graphflop.export.graphviz.op_level import check_module, op_scene
from graphflop.export.graphviz.output import write
from graphflop.export.graphviz.palette import ROLE_COLOURS
from graphflop.export.graphviz.profile import PROFILE_PHASE, load_profile, normalise_profile
from graphflop.meta import MODULE

__all__ = [
    "FORMATS",
    "GRAPHS",
    "LEVELS",
    "NO_DOT",
    "PROFILE_PHASE",
    "ROLE_COLOURS",
    "RenderError",
    "count_op_nodes",
    "load_profile",
    "render",
]

GRAPHS = ("forward", "backward", "jvp", "train", "all")
LEVELS = ("auto", "op", "module")
#: output suffix → Graphviz output format ("dot" = the source itself)
FORMATS = {
    ".svg": "svg",
    ".png": "png",
    ".pdf": "pdf",
    ".html": "html",
    ".htm": "html",
    ".dot": "dot",
    ".gv": "dot",
}
#: graph → the analysis graphs it needs besides the forward
NEEDS = {
    "backward": ("backward",),
    "train": ("backward", "update"),
    "jvp": ("jvp",),
    "all": ("backward", "update", "jvp"),
}
#: graph → the analysis graphs it draws
DRAWS = {
    "forward": ("forward",),
    "backward": ("backward",),
    "jvp": ("jvp",),
    "train": ("forward", "backward", "update"),
    "all": ("forward", "backward", "update", "jvp"),
}


def render(
    analysis: Any,
    path: str | os.PathLike | None = None,
    *,
    graph: str = "train",
    level: str = "auto",
    profile: Mapping[str, Any] | None = None,
    max_op_nodes: int = 400,
    collapse_loss: bool = True,
    module: str | None = None,
    color: str = "flops",
) -> str:
    """Draw ``analysis``'s graphs with Graphviz; return the DOT source, and write ``path``.

    Args:
        analysis: an :class:`~graphflop.analysis.Analysis` (only its annotations and
            typed report are read).
        path: output file; its suffix picks the format: ``.svg`` (every box and edge with a
            tooltip: node name, op, shapes, FLOPs, bytes, module, provenance), ``.png``,
            ``.pdf``, ``.html`` (a page embedding the SVG, with a search box; see
            :mod:`.page`), or ``.dot``/``.gv`` for the source. Written atomically (a temporary file in the same
            folder, then :func:`os.replace`); nothing is left behind on failure.
        graph: ``forward``, ``backward``, ``jvp``, ``train`` (forward + backward + update) or
            ``all`` (``train`` + the JVP's tangent nodes).
        level: ``op``, ``module`` or ``auto`` (``op`` when the chosen graphs have at most
            ``max_op_nodes`` call nodes).
        profile: measured seconds per module path (``""`` or ``"(model)"`` for the model's own
            ops), shown in module boxes and op-level cluster labels; or the JSON of
            ``graphflop bench --profile --json`` (see :func:`load_profile`).
        max_op_nodes: the ``auto`` threshold.
        collapse_loss: at op level, draw the loss's ops (a cross-entropy is about twenty tiny
            ops in each graph) as one node per graph.
        module: draw one module's subtree only (``"h.0"``, ``"layer3.1"``); ``auto`` then means
            ``op``. Edges crossing its border end in small boxes naming the module outside.
        color: what fills the op boxes: ``flops`` (log scale) or ``time`` (each node's
            predicted time on the analysis's device, log scale, with its bound in the label;
            the analysis needs a time profile, and the picture is at op level).

    Returns:
        The DOT source that was rendered (without ``path``: the first layout below).
        ``train``/``all`` at op level first try a layout aligning each forward node with its
        backward and tangent nodes (Graphviz's ``newrank``); when ``dot`` rejects a layout or
        takes over 20 s, the next is tried: for ``all`` the backward aligned alone, then
        unaligned with the classic ranker, with newrank,
        then without module clusters (the module path moves into each label). A ``train`` or
        ``all`` picture at op level is laid out, mirrored when ``dot`` put the backward on the
        forward's right, and drawn with ``neato -n2``: the backward on the left, the tangents
        on the right, for every model. From 1,500 op
        nodes (``output.LARGE_OP_NODES``) the first layout gets 90 s and a timeout ends the
        render; above 5,000 (``output.MAX_DOT_OP_NODES``) only a ``.dot`` source is written.

    Raises:
        RenderError: unknown ``graph``/``level``/suffix/``module``/``color``, a graph the
            analysis did not build, ``color="time"`` without predicted times or at module level,
            ``dot`` missing for a non-``.dot`` format (one line saying how to install it),
            ``dot`` failing or timing out, more op nodes than ``dot`` can lay out in time.
    """
    if graph not in GRAPHS:
        raise RenderError(f"unknown graph {graph!r}: choose one of {', '.join(GRAPHS)}")
    if level not in LEVELS:
        raise RenderError(f"unknown level {level!r}: choose one of {', '.join(LEVELS)}")
    fmt = None
    if path is not None:
        fmt = FORMATS.get(Path(path).suffix.lower())
        if fmt is None:
            raise RenderError(
                f"cannot tell the format of {os.fspath(path)!r}: use a .svg, .png, .pdf, .html "
                "or .dot suffix"
            )
    missing = [k for k in NEEDS.get(graph, ()) if getattr(analysis, k, None) is None]
    if missing:
        raise RenderError(f"the analysis has no {' or '.join(missing)} graph to draw")
    check_module(analysis, module)
    if level == "auto":
        small = module is not None or count_op_nodes(analysis, graph) <= max_op_nodes
        level = "op" if small else "module"
    if color not in ("flops", "time"):
        raise RenderError(f"unknown color {color!r}: choose flops or time")
    if color == "time" and getattr(analysis.report, "time", None) is None:
        raise RenderError(
            "color by time needs predicted times: analyse with a device (--device NAME|FILE)"
        )
    if color == "time" and level != "op":
        raise RenderError(
            "color by time is drawn at op level: add --level op (with --module PATH for a large "
            "model)"
        )
    prof = normalise_profile(profile, graph)
    if prof:
        modules = {n.meta.get(MODULE) for n in analysis.forward.graph.nodes} - {None}
        if not any(path in modules or path == "(model)" for path in prof):
            shown = ", ".join(repr(p) for p in list(prof)[:3])
            raise RenderError(
                f"the profile names no module of this model ({shown}{', ...' if len(prof) > 3 else ''}"
                "): give the JSON that graphflop bench --profile --json wrote for this model"
            )
    variants = _variants(analysis, graph, level, prof, collapse_loss, module, color)
    if path is None:
        return variants[0]()
    assert fmt is not None, "set from path's suffix above"
    whole = level == "op" and module is None  # a module's subtree is counted by its scene
    return write(variants, Path(path), fmt, count_op_nodes(analysis, graph) if whole else None)


def count_op_nodes(analysis: Any, graph: str) -> int:
    """Number of ``call_function`` nodes in the graphs ``graph`` draws (the ``auto`` measure)."""
    return facts.count_call_nodes(analysis, DRAWS[graph])


def _variants(
    analysis: Any,
    graph: str,
    level: str,
    profile: dict[str, float],
    collapse_loss: bool,
    module: str | None = None,
    color: str = "flops",
) -> list[Callable[[], str]]:
    """The layouts to try, in order, each a callable returning its DOT source.

    Graphviz 2.43 rejects some cluster layouts ("trouble in init_rank") with one ranker and not
    the other; aligning forward and backward rank by rank needs newrank. So, at op level:
    aligned (``train``/``all``; for ``all`` then the backward aligned without the tangents,
    which 2.43 rejects for convolution networks), then unaligned with the classic ranker, with
    newrank, and last
    without module clusters (the module path moves into each label); at module level: classic,
    newrank, no clusters.
    """
    if level == "op":

        def op(
            aligned: bool, newrank: bool = False, clusters: bool = True, tangents: bool = True
        ) -> str:
            scene = op_scene(
                analysis, graph, profile, collapse_loss, aligned, clusters, module, tangents, color
            )
            return to_digraph(scene, newrank=newrank or aligned).source

        first = [lambda: op(True)] if graph in ("train", "all") else []
        if graph == "all":  # the backward beside the forward, when the tangents cannot be too
            first.append(lambda: op(True, tangents=False))
        return first + [
            lambda: op(False),
            lambda: op(False, newrank=True),
            lambda: op(False, clusters=False),
        ]

    def boxes(newrank: bool = False, clusters: bool = True) -> str:
        scene = module_scene(analysis, graph, profile, clusters, module)
        return to_digraph(scene, newrank=newrank).source

    return [lambda: boxes(), lambda: boxes(newrank=True), lambda: boxes(clusters=False)]
