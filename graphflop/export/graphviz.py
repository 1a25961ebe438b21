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
      white. The header strip and the border carry the node's role colour (:data:`ROLE_COLOURS`,
      the Okabe–Ito colour-blind-safe palette plus wine and olive from Paul Tol's). Each label:
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
    One box per module path (its own ops only; a parent path with ops of its own, e.g. a residual
    block's ``add``, gets a box named after them), nested in clusters along the path, filled by
    FLOPs (viridis, log) and listing forward, backward (input/weight), update and JVP FLOPs,
    ratios, bytes saved for backward and measured time; edges follow the forward data flow. With more than 40 boxes, the boxes directly inside one
    parent cluster are laid out in one row (so ResNet-50 is one row per bottleneck block). Pruned
    and skipped work are dashed ghost boxes beside their module.

Reads (never writes): ``val``, ``KIND``, ``ROLE``, ``SOURCE``, ``MODULE``,
``COST``, ``PARAM``, ``RESIDUAL``, PyTorch's ``nn_module_stack`` (module class names,
optional); ``gm.meta`` keys ``SIGNATURE``, ``GHOSTS``, ``GHOST_LINKS``, ``VJP``,
``UPDATE``; ``analysis.summary``.
"""

from __future__ import annotations

import html
import math
import os
import re
import shutil
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import graphviz
import torch

from graphflop.export.report import human, human_bytes
from graphflop.meta import (
    COST,
    GHOST_LINKS,
    GHOSTS,
    KIND,
    MODULE,
    PARAM,
    RESIDUAL,
    ROLE,
    SIGNATURE,
    SOURCE,
    UPDATE,
    ZERO_COST,
)

GRAPHS = ("forward", "backward", "jvp", "train", "all")
LEVELS = ("auto", "op", "module")
#: output suffix → Graphviz output format ("dot" = the source itself)
FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf", ".dot": "dot", ".gv": "dot"}

NO_DOT = (
    "Graphviz's `dot` program is not installed: apt-get install graphviz (Debian/Ubuntu) or "
    "brew install graphviz (macOS); .dot output works without it"
)

#: role → colour: Okabe & Ito (2008) colour-blind-safe palette, plus wine and olive (Tol).
ROLE_COLOURS = {
    "forward": "#000000",
    "loss": "#999933",
    "grad_input": "#D55E00",
    "grad_weight": "#E69F00",
    "grad_accum": "#CC79A7",
    "update": "#009E73",
    "tangent_from_input": "#56B4E9",
    "tangent_from_param": "#0072B2",
    "direction": "#F0E442",
}
RESIDUAL_COLOUR = "#882255"
GHOST_COLOUR = "#8C8C8C"
PARAM_COLOUR = "#7F7F7F"
CLUSTER_FILL = "#F4F4F4"
FONT = "Helvetica,Arial,sans-serif"
COLORMAP = "viridis"
#: boxes above which module level lays out each parent's children in one row
ROW_LAYOUT_MIN_BOXES = 40
#: attributes of an edge between the forward and the backward/update/tangent nodes: its head
#: ranks level with or below its tail, with no pull. (``constraint=false`` would say "no
#: ranking at all", but Graphviz 2.43 fails on it inside clusters: "trouble in init_rank".)
LOOSE = {"minlen": "0", "weight": "0"}
#: render timeouts for ``dot``, seconds: each layout but the last (then the next is tried), the last
DOT_FIRST_TRY_S = 20
DOT_TIMEOUT_S = 90


class RenderError(ValueError):
    """A bad ``graph``/``level``/suffix, a missing ``dot`` program, or a failed render."""


# -- public API ------------------------------------------------------------------------------


def render(
    analysis: Any,
    path: str | os.PathLike | None = None,
    *,
    graph: str = "train",
    level: str = "auto",
    profile: Mapping[str, Any] | None = None,
    max_op_nodes: int = 400,
    collapse_loss: bool = True,
) -> str:
    """Draw ``analysis``'s graphs with Graphviz; return the DOT source, and write ``path``.

    Args:
        analysis: an :class:`~graphflop.analysis.Analysis` (only its annotations and
            summary are read).
        path: output file; its suffix picks the format: ``.svg``, ``.png``, ``.pdf``, or
            ``.dot``/``.gv`` for the source. Written atomically (a temporary file in the same
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

    Returns:
        The DOT source that was rendered (without ``path``: the first layout below).
        ``train``/``all`` at op level first try a layout aligning each forward node with its
        backward and tangent nodes (Graphviz's ``newrank``); when ``dot`` rejects a layout or
        takes over 20 s, the next is tried: unaligned with the classic ranker, with newrank,
        then without module clusters (the module path moves into each label).

    Raises:
        RenderError: unknown ``graph``/``level``/suffix, a graph the analysis did not build,
            ``dot`` missing for a non-``.dot`` format (one line saying how to install it), or
            ``dot`` failing.
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
                f"cannot tell the format of {os.fspath(path)!r}: use a .svg, .png, .pdf or .dot "
                "suffix"
            )
    needed = {
        "backward": ("backward",),
        "train": ("backward", "update"),
        "jvp": ("jvp",),
        "all": ("backward", "update", "jvp"),
    }.get(graph, ())
    missing = [k for k in needed if getattr(analysis, k, None) is None]
    if missing:
        raise RenderError(f"the analysis has no {' or '.join(missing)} graph to draw")
    if level == "auto":
        level = "op" if count_op_nodes(analysis, graph) <= max_op_nodes else "module"
    profile = _normalise_profile(profile, graph)
    if level == "op":
        combined = graph in ("train", "all")

        def variant(aligned: bool, newrank: bool = False, clusters: bool = True) -> str:
            pic = _OpPicture(analysis, graph, profile, collapse_loss)
            return pic.build(aligned, clusters, newrank=newrank or aligned).source

        # Graphviz 2.43 rejects some cluster layouts ("trouble in init_rank") with one ranker
        # and not the other; aligning forward and backward rank by rank needs newrank. So:
        # aligned (train/all), then unaligned with the classic ranker, with newrank, and last
        # without module clusters (the module path moves into each label).
        variants = [lambda: variant(True)] if combined else []
        variants += [
            lambda: variant(False),
            lambda: variant(False, newrank=True),
            lambda: variant(False, clusters=False),
        ]
    else:
        variants = [
            lambda: _ModulePicture(analysis, graph, profile).build().source,
            lambda: _ModulePicture(analysis, graph, profile).build(newrank=True).source,
            lambda: _ModulePicture(analysis, graph, profile).build(False).source,
        ]
    if path is None:
        return variants[0]()
    return _write(variants, Path(path), fmt)


def count_op_nodes(analysis: Any, graph: str) -> int:
    """Number of ``call_function`` nodes in the graphs ``graph`` draws (the ``auto`` measure)."""
    keys = {
        "forward": ("forward",),
        "backward": ("backward",),
        "jvp": ("jvp",),
        "train": ("forward", "backward", "update"),
        "all": ("forward", "backward", "update", "jvp"),
    }[graph]
    total = 0
    for k in keys:
        gm = getattr(analysis, k, None)
        if gm is not None:
            total += sum(1 for n in gm.graph.nodes if n.op == "call_function")
    return total


#: the bench phase whose per-module profile each picture shows
PROFILE_PHASE = {
    "forward": "forward",
    "backward": "train_step",
    "train": "train_step",
    "all": "train_step",
    "jvp": "forward_gradient_step",
}


def load_profile(data: Any, graph: str = "train") -> dict[str, float]:
    """A ``{module path: seconds}`` dict from a profile's JSON content.

    Accepts ``{path: seconds}``; ``{"modules": {path: seconds}}``; the output of
    ``graphflop bench --profile --json`` (``runtimes.onnxruntime.profile.<phase>.modules``, the
    phase picked by ``graph``: ``forward``, else ``train_step``, ``forward_gradient_step`` for
    ``jvp``) or its ``profile`` part; or ``{"layers": [{"name": path, "median_s": s}, ...]}``.

    Raises:
        RenderError: for anything else.
    """
    if isinstance(data, Mapping):
        runtimes = data.get("runtimes")
        if isinstance(runtimes, Mapping):
            data = (runtimes.get("onnxruntime") or {}).get("profile") or {}
        phases = {k: v for k, v in data.items() if isinstance(v, Mapping) and "modules" in v}
        if phases:
            want = PROFILE_PHASE.get(graph, "train_step")
            data = phases.get(want) or next(iter(phases.values()))
        if isinstance(data.get("layers"), list):
            out = {}
            for row in data["layers"]:
                if not isinstance(row, Mapping) or "name" not in row:
                    continue
                t = next((row[k] for k in ("median_s", "seconds", "time_s") if k in row), None)
                if isinstance(t, (int, float)):
                    out[str(row["name"])] = float(t)
            return out
        if isinstance(data.get("modules"), Mapping):
            data = data["modules"]
        if all(isinstance(v, (int, float)) for v in data.values()):
            return {str(k): float(v) for k, v in data.items()}
    raise RenderError(
        "a profile is {module path: seconds} or `graphflop bench --profile --json` output"
    )


# -- writing ---------------------------------------------------------------------------------


def _write(variants: list, path: Path, fmt: str) -> str:
    """Render the first of ``variants`` (callables returning DOT sources) that ``dot`` accepts
    to ``fmt`` and write it to ``path``; return its source."""
    src = variants[0]()
    if fmt == "dot":
        data = src.encode()
    else:
        if shutil.which("dot") is None:
            raise RenderError(NO_DOT)
        for i, make in enumerate(variants):
            src = src if i == 0 else make()
            last = i == len(variants) - 1
            proc = _run_dot(src, fmt, DOT_TIMEOUT_S if last else DOT_FIRST_TRY_S, last)
            if proc is not None and proc.returncode == 0 and proc.stdout:
                break
        if proc is None or proc.returncode != 0 or not proc.stdout:
            err = proc.stderr.decode(errors="replace").strip().splitlines() if proc else []
            msg = next((e for e in err if "rror" in e), err[0] if err else "no output")
            raise RenderError(f"dot failed: {msg.strip()}")
        data = proc.stdout
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise RenderError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return src


def _run_dot(
    src: str, fmt: str, timeout_s: float, last: bool
) -> subprocess.CompletedProcess | None:
    """Run ``dot``; None when it timed out and ``last`` is false (another layout to try)."""
    cmd = ["dot", f"-T{fmt}"] + (["-Gdpi=96"] if fmt == "png" else [])
    try:
        return subprocess.run(
            cmd, input=src.encode(), capture_output=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError:
        raise RenderError(NO_DOT) from None
    except subprocess.TimeoutExpired:
        if last:
            raise RenderError(f"dot took more than {timeout_s:g} s: try the module level") from None
        return None


# -- shared helpers --------------------------------------------------------------------------


def _normalise_profile(profile: Mapping[str, Any] | None, graph: str) -> dict[str, float]:
    if not profile:
        return {}
    prof = load_profile(profile, graph)
    if "(model)" in prof and "" not in prof:
        prof[""] = prof["(model)"]
    return prof


def _esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _shape_of(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return "×".join(map(str, v.shape)) if v.dim() else "scalar"
    if isinstance(v, (tuple, list)):
        return ", ".join(_shape_of(x) for x in v if isinstance(x, torch.Tensor)) or "–"
    return "–"


def _bytes_of(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_bytes_of(x) for x in v)
    return 0


def _numel(v: Any) -> int:
    return v.numel() if isinstance(v, torch.Tensor) else 0


def _op_short(target: Any) -> str:
    """``aten.convolution.default`` → ``convolution``; ``operator.getitem`` → ``getitem``."""
    if isinstance(target, str):
        parts = target.split(".")
        return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]
    name = getattr(target, "__name__", None) or str(target)
    return name.split(".")[0]


def _luminance(hex_colour: str) -> float:
    r, g, b = (int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _text_on(hex_colour: str) -> str:
    return "#FFFFFF" if _luminance(hex_colour) < 0.2 else "#000000"


def _id(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", s)


class _FlopScale:
    """log10(FLOPs) → viridis hex colour, over [lo, hi] FLOPs."""

    def __init__(self, values: list[int]):
        from matplotlib import colormaps
        from matplotlib.colors import to_hex

        self._cmap = colormaps[COLORMAP]
        self._hex = to_hex
        nz = [v for v in values if v > 0]
        self.lo = min(nz) if nz else 1
        self.hi = max(nz) if nz else 1

    def t(self, flops: int) -> float:
        a, b = math.log10(self.lo), math.log10(self.hi)
        return 1.0 if b <= a else min(1.0, max(0.0, (math.log10(flops) - a) / (b - a)))

    def colour(self, flops: int) -> str:
        if flops <= 0:
            return "#FFFFFF"
        return self._hex(self._cmap(self.t(flops))).upper()

    def ticks(self, n: int = 6) -> list[tuple[str, int]]:
        """``n`` evenly spaced (log) stops: (colour, FLOPs)."""
        if self.hi <= self.lo:
            return [(self.colour(self.hi), self.hi)]
        a, b = math.log10(self.lo), math.log10(self.hi)
        stops = [10 ** (a + (b - a) * i / (n - 1)) for i in range(n)]
        return [(self.colour(int(round(s))), int(round(s))) for s in stops]


def _legend_label(scale: _FlopScale, what: str, roles: list[str], extras: list[str]) -> str:
    ticks = scale.ticks()
    span = max(2, len(ticks))
    rows = [
        f'<TR><TD COLSPAN="{span}"><B>legend</B></TD></TR>',
        f'<TR><TD COLSPAN="{span}" ALIGN="LEFT">'
        f"fill: {_esc(what)} (log scale, {COLORMAP}; white: none)</TD></TR>",
    ]
    cells = "".join(
        f'<TD BGCOLOR="{c}"><FONT COLOR="{_text_on(c)}" POINT-SIZE="9">{_esc(human(v))}</FONT></TD>'
        for c, v in ticks
    )
    rows.append(f"<TR>{cells}</TR>")
    for r in roles:
        c = ROLE_COLOURS.get(r, "#000000")
        rows.append(
            f'<TR><TD COLSPAN="{span}" ALIGN="LEFT" BGCOLOR="{c}">'
            f'<FONT COLOR="{_text_on(c)}">role: {_esc(r)}</FONT></TD></TR>'
        )
    for e in extras:
        rows.append(f'<TR><TD COLSPAN="{span}" ALIGN="LEFT">{e}</TD></TR>')
    return (
        '<<TABLE BORDER="1" CELLBORDER="0" CELLSPACING="1" CELLPADDING="3" COLOR="#444444" '
        f'BGCOLOR="#FFFFFF">{"".join(rows)}</TABLE>>'
    )


def _legend_extras(ghost_words: list[str], residuals: bool, params: bool) -> list[str]:
    out = []
    for w in ghost_words:
        out.append(
            f'<FONT COLOR="{GHOST_COLOUR}">dashed grey: {_esc(w)} work (not emitted) '
            "with the FLOPs it saved</FONT>"
        )
    if residuals:
        out.append(
            f'<FONT COLOR="{RESIDUAL_COLOUR}"><B>wine edge</B>: residual saved for '
            "backward, with bytes (what forward mode does not keep)</FONT>"
        )
    if params:
        out.append(f'<FONT COLOR="{PARAM_COLOUR}">grey rounded: parameter / input</FONT>')
    return out


def _module_types(gm) -> dict[str, str]:
    """Module path → class name, from PyTorch's ``nn_module_stack`` (absent → no entry)."""
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        path = n.meta.get(MODULE)
        stack = n.meta.get("nn_module_stack")
        if path is None or path in out or not stack:
            continue
        try:
            typ = list(stack.values())[-1][1]
        except (IndexError, TypeError):
            continue
        out[path] = (typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))).rsplit(
            ".", 1
        )[-1]
    return out


def _time(s: float | None) -> str:
    if s is None:
        return "–"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def _title(analysis: Any, graph: str, level: str) -> str:
    s = analysis.summary or {}
    t = s.get("totals", {})
    r = s.get("ratios", {})
    m = s.get("memory", {})
    name = s.get("model") or getattr(analysis, "name", "model")
    inputs = ", ".join("×".join(map(str, i["shape"])) for i in s.get("inputs", []))
    parts = [f"{name}  [{inputs}]  — {graph} graph, {level} level"]
    f = t.get("forward", {}).get("flops")
    line = [f"forward {human(f)} FLOPs"] if f is not None else []
    if graph in ("backward", "train", "all") and "backward" in t:
        b = t["backward"]
        line.append(
            f"backward {human(b['flops'])} (input {human(b['grad_input_flops'])}, "
            f"weight {human(b['grad_weight_flops'])}, pruned {human(b['pruned_flops'])})"
        )
        if graph != "backward" and "update" in t:
            line.append(f"update {human(t['update']['flops'])} ({t['update']['optimizer']})")
        if r.get("backward_forward") is not None:
            line.append(f"(bwd+upd)/fwd {r['backward_forward']:.2f}")
        if m.get("saved_for_backward_bytes") is not None:
            line.append(f"saved for backward {human_bytes(m['saved_for_backward_bytes'])}")
    if graph in ("jvp", "all") and "jvp" in t:
        j = t["jvp"]
        line.append(
            f"JVP tangent {human(j['flops'])} (skipped {human(j['skipped_flops'])}, "
            f"tangents on {j['tangents']})"
        )
        if r.get("jvp_forward") is not None:
            line.append(f"jvp/fwd {r['jvp_forward']:.2f}")
    parts.append(" · ".join(line))
    return "\n".join(parts)


# -- canvas: nodes per module path, built into nested clusters --------------------------------


class _Canvas:
    """Nodes collected per module path and edges, turned into nested Graphviz clusters."""

    def __init__(self) -> None:
        #: (phase, module path) → nodes; phase "" = no phase cluster
        self.nodes: dict[tuple[str, str], list[tuple[str, dict[str, str]]]] = defaultdict(list)
        self.edges: list[tuple[str, str, dict[str, str]]] = []
        self.cluster_label: dict[str, str] = {}
        self.phase_label: dict[str, str] = {}
        self.rows: set[str] = set()  # module paths whose direct nodes go in one rank

    def node(self, module: str, nid: str, phase: str = "", **attrs: str) -> str:
        self.nodes[(phase, module)].append((nid, attrs))
        return nid

    def edge(self, a: str, b: str, **attrs: str) -> None:
        self.edges.append((a, b, attrs))

    def build(
        self, title: str, legend: str | None, newrank: bool = False, clusters: bool = True
    ) -> graphviz.Digraph:
        g = graphviz.Digraph(
            "graphflop",
            graph_attr={
                "rankdir": "TB",
                "label": title,
                "labelloc": "t",
                "labeljust": "l",
                "fontname": FONT,
                "fontsize": "16",
                "nodesep": "0.18",
                "ranksep": "0.28",
                "bgcolor": "white",
                "outputorder": "edgesfirst",
            },
            node_attr={"fontname": FONT, "fontsize": "10", "shape": "plain"},
            edge_attr={"fontname": FONT, "fontsize": "8", "arrowsize": "0.6", "color": "#555555"},
        )
        if newrank:  # Graphviz 2.43 reads any value, even "false", as on: set it only when on
            g.attr(newrank="true")
        if legend is not None:
            g.node("legend", label=legend, id="legend", shape="plain")
        if not clusters:
            for own in self.nodes.values():
                for nid, attrs in own:
                    g.node(nid, **attrs)
            phases = []
        else:
            phases = list(dict.fromkeys(ph for ph, _ in self.nodes))
        for phase in phases:
            if phase == "":
                self._emit_phase(g, phase)
                continue
            with g.subgraph(name=f"cluster_phase_{phase}") as pc:
                pc.attr(
                    label=self.phase_label.get(phase, phase),
                    style="dashed",
                    color="#777777",
                    fontname=FONT,
                    fontsize="14",
                    labeljust="l",
                    margin="10",
                )
                self._emit_phase(pc, phase)
        seen = set()
        for a, b, attrs in self.edges:
            k = (a, b, tuple(sorted(attrs.items())))
            if a != b and k not in seen:
                seen.add(k)
                g.edge(a, b, **attrs)
        return g

    def _emit_phase(self, g: graphviz.Digraph, phase: str) -> None:
        tree: dict[str, set[str]] = defaultdict(set)
        self._first: dict[str, int] = {}
        for k, (ph, p) in enumerate(self.nodes):
            if ph != phase or p == "":
                continue
            parts = p.split(".")
            for i in range(1, len(parts) + 1):
                parent = ".".join(parts[: i - 1])
                tree[parent].add(".".join(parts[:i]))
                self._first.setdefault(".".join(parts[:i]), k)
        self._emit(g, phase, "", tree)

    def _emit(self, g: graphviz.Digraph, phase: str, path: str, tree: dict[str, set[str]]) -> None:
        own = self.nodes.get((phase, path), [])
        if path in self.rows and len(own) > 1:
            with g.subgraph() as s:
                s.attr(rank="same")
                for nid, attrs in own:
                    s.node(nid, **attrs)
        else:
            for nid, attrs in own:
                g.node(nid, **attrs)
        for child in sorted(tree.get(path, ()), key=self._order_key):
            name = f"cluster_{_id(phase)}_{_id(child)}" if phase else f"cluster_{_id(child)}"
            with g.subgraph(name=name) as c:
                c.attr(
                    label=self.cluster_label.get(child, child),
                    style="rounded,filled",
                    fillcolor=CLUSTER_FILL,
                    color="#B0B0B0",
                    fontname=FONT,
                    fontsize="11",
                    labeljust="l",
                    margin="6",
                )
                self._emit(c, phase, child, tree)

    def _order_key(self, path: str) -> tuple[int, str]:
        return (self._first.get(path, 0), path)


# -- op level ----------------------------------------------------------------------------------


class _OpPicture:
    """One node per graph node (see the module docstring)."""

    def __init__(self, a: Any, graph: str, profile: dict[str, float], collapse_loss: bool):
        self.a = a
        self.graph = graph
        self.profile = profile
        self.collapse_loss = collapse_loss
        self.cv = _Canvas()
        self.ids: dict[tuple[str, str], str] = {}  # (graph key, node name) → drawn node id
        self.pending: dict[str, dict[str, Any]] = {}  # op node id → label arguments
        self.data_edges: list[tuple[str, str, int, dict[str, str]]] = []
        self.residuals: dict[tuple[str, str], dict[str, Any]] = {}
        self.roles: set[str] = set()
        self.ghost_words: list[str] = []
        self.has_residuals = False
        self.types: dict[str, str] = {}
        self.reversed_backward = graph in ("train", "all")
        combined = graph in ("train", "all")
        self.phase = (
            {"f": "forward", "b": "backward", "u": "backward", "j": "tangent"} if combined else {}
        )
        self.cv.phase_label = {
            "forward": "forward (model and loss)",
            "backward": "backward, drawn upward (each module beside its forward), and update",
            "tangent": "JVP tangents (forward mode)",
        }

    def _node(self, key: str, module: str, nid: str, **attrs: str) -> str:
        if key == "u" and self.phase:
            module = ""  # outside module clusters: a cluster stretched below a module's
            # gradients would push the next module's backward sideways
        return self.cv.node(module, nid, phase=self.phase.get(key, ""), **attrs)

    # nodes -----------------------------------------------------------------------------------
    def op_node(self, key: str, n) -> str:
        cost = n.meta.get(COST, ZERO_COST)
        role = n.meta.get(ROLE) or ("forward" if key == "f" else "grad_input")
        module = n.meta.get(MODULE, "")
        if self.collapse_loss and module == "loss":
            return self._loss_node(key, n, role, cost)
        self.roles.add(role)
        nid = f"{key}_{n.name}"
        self.pending[nid] = {
            "key": key,
            "module": module,
            "source": n.meta.get(SOURCE),
            "op": _op_short(n.target),
            "role": role,
            "shape": _shape_of(n.meta.get("val")),
            "cost": cost,
            "tooltip": self._tooltip(n, role, cost),
        }
        self.ids[(key, n.name)] = nid
        return nid

    def _loss_node(self, key: str, n, role: str, cost) -> str:
        """The loss's ops, one node per graph (primal and tangent apart in the JVP)."""
        tangent = n.meta.get(KIND) in ("tangent", "coef") and key == "j"
        nid = f"{key}_loss" + ("_tangent" if tangent else "")
        if nid not in self.pending:
            kind = (self.a.summary or {}).get("loss") or "loss"
            op, shown = {
                "f": (f"loss: {kind}", "loss"),
                "b": (f"∂ loss: {kind}", "loss"),
                "j": (f"loss: {kind}", "loss"),
            }[key]
            if tangent:
                op, shown = f"tangent of loss: {kind}", "tangent_from_input"
            self.pending[nid] = {
                "key": key,
                "module": "loss",
                "source": None,
                "op": op,
                "role": shown,
                "ops": 0,
                "cost": ZERO_COST,
                "tooltip": "",
            }
            self.roles.add(shown)
        a = self.pending[nid]
        a["ops"] += 1
        a["cost"] = a["cost"] + cost
        a["shape"] = f"{a['ops']} ops (drawn as one node)"
        a["tooltip"] = (
            f"{a['ops']} loss ops, {a['cost'].flops} FLOPs, "
            f"{a['cost'].bytes_read + a['cost'].bytes_written} bytes"
        )
        self.ids[(key, n.name)] = nid
        return nid

    def _tooltip(self, n, role: str, cost) -> str:
        return (
            f"{n.name} = {n.format_node()}\nrole {role}, kind {n.meta.get(KIND)}, "
            f"from {n.meta.get(SOURCE)} in {n.meta.get(MODULE) or '(model)'}\n"
            f"{cost.flops} FLOPs ({cost.mm_flops} mm), read {cost.bytes_read} B, "
            f"written {cost.bytes_written} B"
        )

    def small_node(
        self,
        key: str,
        n,
        module: str,
        text: str,
        colour: str = PARAM_COLOUR,
        style: str = "rounded,filled",
        fill: str = "#FFFFFF",
        shape: str = "box",
    ) -> str:
        nid = f"{key}_{n.name}"
        v = n.meta.get("val")
        label = f"{text}\n{_shape_of(v)} · {human_bytes(_bytes_of(v))}"
        self._node(
            key,
            module,
            nid,
            label=label,
            shape=shape,
            style=style,
            color=colour,
            fillcolor=fill,
            fontcolor="#333333",
            fontsize="8",
            margin="0.04,0.02",
            height="0.2",
            id=nid,
        )
        self.ids[(key, n.name)] = nid
        return nid

    def ghost_node(self, key: str, g, word: str) -> str:
        nid = f"{key}_{g.name}"
        saved = f"{human(g.cost.flops)} FLOPs" if g.cost.flops else "0 FLOPs (view)"
        shape = "×".join(map(str, g.shape)) or "scalar"
        label = (
            f'<<FONT COLOR="{GHOST_COLOUR}"><B>{_esc(word)}: {_esc(saved)}</B><BR/>'
            f"{_esc(_op_short(g.op))} → {_esc(shape)}<BR/>"
            f"<I>{_esc(g.role)} of {_esc(g.source)}</I></FONT>>"
        )
        self._node(
            key,
            g.module,
            nid,
            label=label,
            shape="box",
            style="dashed,rounded,filled",
            **{"class": f"ghost role-{g.role}"},
            fillcolor="#FFFFFF",
            penwidth="1.6",
            fontsize="11",
            color=GHOST_COLOUR,
            fontcolor=GHOST_COLOUR,
            margin="0.08,0.04",
            id=nid,
            tooltip=f"{g.name}: {g.op} not emitted ({g.role}, {g.cost.flops} FLOPs, "
            f"{g.cost.bytes_read + g.cost.bytes_written} bytes)",
        )
        self.ids[(key, g.name)] = nid
        return nid

    # edges -----------------------------------------------------------------------------------
    def data_edge(
        self, src: str, dst: str, nbytes: int, backward: bool = False, **attrs: str
    ) -> None:
        if backward and self.reversed_backward:
            attrs = {"dir": "back", **attrs}
            src, dst = dst, src
        self.data_edges.append((src, dst, nbytes, attrs))

    def residual_edge(self, src: str, dst: str, kind: str, nbytes: int, first: bool) -> None:
        """A backward node reading a forward value; ``first``: the first reader of it."""
        light = kind in ("param", "buffer", "param_derived")
        r = self.residuals.setdefault(
            (src, dst), {"light": light, "bytes": 0, "size": 0, "label": False}
        )
        r["light"] = r["light"] and light
        if not light:
            r["size"] += nbytes  # what this edge carries
            if first:  # each residual's bytes are printed once, on its first reader
                r["bytes"] += nbytes
                r["label"] = True

    def _emit_residuals(self) -> None:
        for (src, dst), r in self.residuals.items():
            if src == dst:
                continue
            if r["light"]:
                attrs = {
                    "color": PARAM_COLOUR,
                    "penwidth": "0.6",
                    "style": "dotted",
                    "arrowhead": "none",
                }
            else:
                self.has_residuals = True
                size = r["size"]
                width = 1.0 + 0.3 * max(0.0, math.log2(max(size, 1) / 4096))
                attrs = {
                    "color": RESIDUAL_COLOUR,
                    "penwidth": f"{min(width, 3.5):.2f}",
                    "fontcolor": RESIDUAL_COLOUR,
                    "class": "residual",
                    "tooltip": f"residual: {size} bytes saved for backward",
                }
                if r["label"]:
                    attrs["label"] = f"saved {human_bytes(r['bytes'])}"
            if self.reversed_backward:
                attrs.update(LOOSE)
            self.cv.edge(src, dst, **attrs)

    # graphs ----------------------------------------------------------------------------------
    def forward(self, key: str = "f", gm=None) -> None:
        gm = gm or self.a.forward
        self.types.update(_module_types(gm))
        sig = gm.meta.get(SIGNATURE)
        params = dict(sig.params) if sig else {}
        buffers = dict(sig.buffers) if sig else {}
        inputs = set(sig.inputs) if sig else set()
        targets = set(sig.targets) if sig else set()
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                if n.meta.get(KIND) == "tangent":
                    self._tangent_placeholder(key, n)
                elif n.name in params:
                    q = params[n.name]
                    self.small_node(key, n, q.rpartition(".")[0], q)
                elif n.name in buffers:
                    q = buffers[n.name]
                    self.small_node(key, n, q.rpartition(".")[0], f"buffer {q}")
                elif n.name in targets:
                    self.small_node(
                        key, n, "loss", f"target {n.name}", shape="ellipse", style="filled"
                    )
                elif n.name in inputs or _numel(n.meta.get("val")) > 1:
                    self.small_node(key, n, "", f"input {n.name}", shape="ellipse", style="filled")
            elif n.op == "call_function":
                self.op_node(key, n)
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            for u in n.all_input_nodes:
                if (key, u.name) in self.ids:
                    self.data_edge(
                        self.ids[(key, u.name)],
                        self.ids[(key, n.name)],
                        _bytes_of(u.meta.get("val")),
                    )

    def backward(self, key: str = "b") -> None:
        gm = self.a.backward
        train = self.reversed_backward
        sig = self.a.forward.meta.get(SIGNATURE)
        residual: dict[str, tuple[str, str, int]] = {}  # placeholder → (src id, kind, bytes)
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            kind = n.meta.get(RESIDUAL)
            src = n.meta.get(SOURCE, n.name)
            nbytes = _bytes_of(n.meta.get("val"))
            if kind is None:  # the loss cotangent
                nid = self.small_node(
                    key, n, "loss", "∂loss = 1 (seed)", colour=ROLE_COLOURS["loss"]
                )
                if train and sig is not None and sig.loss and ("f", sig.loss) in self.ids:
                    self.cv.edge(
                        self.ids[("f", sig.loss)], nid, color=ROLE_COLOURS["loss"], penwidth="1.5"
                    )
                continue
            if train and ("f", src) in self.ids:
                residual[n.name] = (self.ids[("f", src)], kind, nbytes)
                continue
            module = n.meta.get(MODULE, "")
            if n.meta.get(PARAM):
                module = n.meta[PARAM].rpartition(".")[0]
                text = f"param {n.meta[PARAM]}"
                rid = self.small_node(key, n, module, text)
            else:
                rid = self.small_node(
                    key,
                    n,
                    module,
                    f"saved {src}",
                    colour=RESIDUAL_COLOUR,
                    style="rounded,filled,bold",
                )
            residual[n.name] = (rid, kind, nbytes)
            self.ids.pop((key, n.name))
        for n in gm.graph.nodes:
            if n.op == "call_function":
                self.op_node(key, n)
        labelled: set[str] = set()
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            for u in n.all_input_nodes:
                me = self.ids[(key, n.name)]
                if u.name in residual:
                    rid, kind, nbytes = residual[u.name]
                    self.residual_edge(rid, me, kind, nbytes, u.name not in labelled)
                    labelled.add(u.name)
                elif (key, u.name) in self.ids:
                    self.data_edge(
                        self.ids[(key, u.name)], me, _bytes_of(u.meta.get("val")), backward=True
                    )
        self.ghosts(key, gm, "pruned", residual)

    def ghosts(self, key: str, gm, word: str, residual: dict | None = None) -> None:
        records = list(gm.meta.get(GHOSTS, []))
        if not records:
            return
        self.ghost_words.append(word)
        names = {g.name for g in records}
        backward = key == "b"
        nodes = {n.name: n for n in gm.graph.nodes}
        for g in records:
            self.ghost_node(key, g, word)
        dashed = {"style": "dashed", "color": GHOST_COLOUR}
        zero_ids: dict[str, str] = {}
        for g in records:
            me = self.ids[(key, g.name)]
            for name in g.inputs:
                if residual and name in residual:
                    rid = residual[name][0]
                    attrs = dict(dashed)
                    if self.reversed_backward and backward:
                        attrs.update(LOOSE)
                    self.cv.edge(rid, me, **attrs)
                elif name in names or (key, name) in self.ids:
                    self.data_edge(self.ids[(key, name)], me, 0, backward=backward, **dashed)
                elif backward:  # an unrecorded ghost: the cotangent that reached g's source
                    ct = _incoming_cotangent(gm, g.source)
                    if ct is not None and (key, ct) in self.ids:
                        self.data_edge(self.ids[(key, ct)], me, 0, backward=True, **dashed)
                else:  # an unrecorded ghost in the JVP: a tangent that is zero
                    if name not in zero_ids:
                        zid = f"{key}_{name}"
                        self._node(
                            key,
                            g.module,
                            zid,
                            label="0 (tangent not chosen)",
                            shape="box",
                            style="dashed,rounded",
                            color=GHOST_COLOUR,
                            fontcolor=GHOST_COLOUR,
                            fontsize="8",
                            id=zid,
                            margin="0.04,0.02",
                        )
                        zero_ids[name] = zid
                    self.cv.edge(zero_ids[name], me, **dashed)
            if g.source and (self.graph in ("train", "all")) and ("f", g.source) in self.ids:
                # in the combined pictures: link the ghost to the forward node it came from
                self.cv.edge(
                    self.ids[("f", g.source)],
                    me,
                    style="dotted",
                    color=GHOST_COLOUR,
                    arrowhead="none",
                    **LOOSE,
                )
        links = gm.meta.get(GHOST_LINKS) or {}
        for real, gs in links.items():
            rname = getattr(real, "name", None)
            if rname is None or (key, rname) not in self.ids or rname not in nodes:
                continue
            for gv in gs:
                gname = getattr(gv, "name", None)
                if (key, gname) in self.ids:
                    self.cv.edge(
                        self.ids[(key, gname)],
                        self.ids[(key, rname)],
                        label="dropped from sum",
                        fontcolor=GHOST_COLOUR,
                        **dashed,
                    )

    def update(self, key: str = "u") -> None:
        gm = self.a.update
        info = gm.meta.get(UPDATE)
        grads_of: dict[str, str] = {}
        if self.a.backward is not None:
            out = next(n for n in self.a.backward.graph.nodes if n.op == "output")
            for v in out.args[0]:
                if hasattr(v, "meta") and v.meta.get(PARAM) and ("b", v.name) in self.ids:
                    grads_of[v.meta[PARAM]] = self.ids[("b", v.name)]
        fparams = {}
        sig = self.a.forward.meta.get(SIGNATURE)
        if sig is not None:
            fparams = {q: self.ids.get(("f", p)) for p, q in sig.params}
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        n_params = len(info.params) if info is not None else 0
        states = set(info.state_names) if info is not None else set()
        scalars = set(info.scalars) if info is not None else set()
        src: dict[str, tuple[str, str]] = {}  # placeholder → (drawn id, kind)
        for i, n in enumerate(phs):
            q = n.meta.get(PARAM)
            if n.name in scalars or q is None:
                continue
            if n.name in states:
                state = n.name.removesuffix("_" + _id(q))
                nid = self.small_node(
                    key, n, q.rpartition(".")[0], f"{state} of {q}", colour=ROLE_COLOURS["update"]
                )
                src[n.name] = (nid, "state")
            elif i < n_params and fparams.get(q):
                src[n.name] = (fparams[q], "param")
            elif i >= n_params and grads_of.get(q):
                src[n.name] = (grads_of[q], "grad")
            else:
                nid = self.small_node(key, n, q.rpartition(".")[0], n.name)
                src[n.name] = (nid, "other")
        for n in gm.graph.nodes:
            if n.op == "call_function":
                self.op_node(key, n)
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            me = self.ids[(key, n.name)]
            for u in n.all_input_nodes:
                if u.name in src:
                    sid, kind = src[u.name]
                    if kind == "param":
                        self.cv.edge(
                            sid, me, color=PARAM_COLOUR, style="dotted", penwidth="0.6", **LOOSE
                        )
                    else:
                        self.data_edge(
                            sid,
                            me,
                            _bytes_of(u.meta.get("val")),
                            color=ROLE_COLOURS["update"] if kind == "grad" else "",
                        )
                elif (key, u.name) in self.ids:
                    self.data_edge(self.ids[(key, u.name)], me, _bytes_of(u.meta.get("val")))

    def jvp(self, key: str = "j", share_primal: bool = False) -> None:
        gm = self.a.jvp
        self.types.update(_module_types(gm))
        if not share_primal:
            self.forward(key, gm)
            self.ghosts(key, gm, "skipped")
            return
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                if n.meta.get(KIND) == "tangent":
                    self._tangent_placeholder(key, n)
                elif ("f", n.name) in self.ids:
                    self.ids[(key, n.name)] = self.ids[("f", n.name)]
            elif n.op == "call_function":
                src = n.meta.get(SOURCE, n.name)
                if n.meta.get(KIND) == "primal" and ("f", src) in self.ids:
                    self.ids[(key, n.name)] = self.ids[("f", src)]
                else:
                    self.op_node(key, n)
        for n in gm.graph.nodes:
            if n.op != "call_function" or self.ids[(key, n.name)].startswith("f_"):
                continue
            me = self.ids[(key, n.name)]
            for u in n.all_input_nodes:
                if (key, u.name) not in self.ids:
                    continue
                sid = self.ids[(key, u.name)]
                if sid.startswith("f_"):  # a primal read: the forward value itself
                    self.cv.edge(
                        sid, me, color=PARAM_COLOUR, style="dotted", penwidth="0.6", **LOOSE
                    )
                else:
                    self.data_edge(sid, me, _bytes_of(u.meta.get("val")))
        self.ghosts(key, gm, "skipped")

    def _ph_module(self, n) -> str:
        q = n.meta.get(PARAM)
        return q.rpartition(".")[0] if q else ""

    def _tangent_placeholder(self, key: str, n) -> None:
        role = n.meta.get(ROLE) or "tangent_from_param"
        self.roles.add(role)
        q = n.meta.get(PARAM)
        c = ROLE_COLOURS.get(role, "#000000")
        self.small_node(
            key,
            n,
            self._ph_module(n),
            f"tangent of {q or n.name}",
            colour=c,
            style="rounded,filled,bold",
        )

    # assembling ------------------------------------------------------------------------------
    def build(
        self, aligned: bool = False, clusters: bool = True, newrank: bool = False
    ) -> graphviz.Digraph:
        self.clusters = clusters
        g = self.graph
        if g in ("forward", "train", "all"):
            self.forward()
        if g in ("backward", "train", "all"):
            self.backward()
        if g in ("train", "all"):
            self.update()
        if g == "jvp":
            self.jvp(share_primal=False)
        if g == "all":
            self.jvp(share_primal=True)
        scale = _FlopScale([a["cost"].flops for a in self.pending.values()])
        if self.phase and aligned:
            self._align()
        for nid, a in self.pending.items():
            self._node(a["key"], a["module"], nid, **self._op_attrs(nid, a, scale))
        self._emit_residuals()
        big = max((b for *_, b, _ in self.data_edges), default=0)
        threshold = max(1024, big / 16)
        merged: dict[tuple, tuple[int, dict[str, str]]] = {}
        for src, dst, nbytes, attrs in self.data_edges:
            if src == dst:
                continue
            attrs = {k: v for k, v in attrs.items() if v}
            k = (src, dst, tuple(sorted(attrs.items())))
            merged[k] = (max(nbytes, merged.get(k, (0, attrs))[0]), attrs)
        for (src, dst, _), (nbytes, attrs) in merged.items():
            if nbytes >= threshold and "label" not in attrs:
                attrs = {**attrs, "label": human_bytes(nbytes)}
            self.cv.edge(src, dst, **attrs)
        for _, path in self.cv.nodes:
            label = path
            if path in self.types and path not in ("", "loss"):
                label = f"{path} · {self.types[path]}"
            if path in self.profile:
                label += f" · {_time(self.profile[path])}"
            self.cv.cluster_label[path] = label
        roles = [r for r in ROLE_COLOURS if r in self.roles]
        legend = _legend_label(
            scale,
            "FLOPs per node",
            roles,
            _legend_extras(self.ghost_words, self.has_residuals, True),
        )
        return self.cv.build(
            _title(self.a, self.graph, "op"), legend, newrank=newrank, clusters=clusters
        )

    def _align(self) -> None:
        """Pull each forward op onto the rank of the largest backward (and tangent) node derived
        from it, so each module's backward sits beside its forward (invisible ``minlen=0``
        edges, which Graphviz's ``newrank`` ranker honours across clusters)."""
        best: dict[tuple[str, str], tuple[int, str]] = {}
        for nid, a in self.pending.items():
            if a["key"] not in ("b", "j") or not a["source"]:
                continue
            k = (a["key"], a["source"])
            if k not in best or a["cost"].flops > best[k][0]:
                best[k] = (a["cost"].flops, nid)
        fwd = {nid for nid, a in self.pending.items() if a["key"] == "f"}
        groups: dict[str, list[str]] = defaultdict(list)
        for (_, src), (_, nid) in best.items():
            fid = self.ids.get(("f", src))
            if fid in fwd:
                groups[fid].append(nid)
        for fid, others in groups.items():
            for o in others:  # soft alignment: same rank or below, pulled together
                self.cv.edge(fid, o, style="invis", minlen="0", weight="4", arrowhead="none")

    def _op_attrs(self, nid: str, a: dict[str, Any], scale: _FlopScale) -> dict[str, str]:
        cost = a["cost"]
        rc = ROLE_COLOURS.get(a["role"], "#000000")
        fill = scale.colour(cost.flops)
        fc = _text_on(fill)
        where = "" if self.clusters or not a["module"] else f" · {a['module']}"
        rows = [
            f'<TR><TD BGCOLOR="{rc}"><FONT COLOR="{_text_on(rc)}"><B>{_esc(a["op"])}'
            f"</B>{_esc(where)}</FONT></TD></TR>",
            f'<TR><TD><FONT COLOR="{fc}" POINT-SIZE="9">{_esc(a["shape"])}</FONT></TD></TR>',
        ]
        if cost.flops or cost.bytes_written:
            fl = f"{human(cost.flops)} FLOPs" if cost.flops else "0 FLOPs"
            rows.append(
                f'<TR><TD><FONT COLOR="{fc}" POINT-SIZE="9">{_esc(fl)} · '
                f"{_esc(human_bytes(cost.bytes_read + cost.bytes_written))}"
                "</FONT></TD></TR>"
            )
        label = (
            f'<<TABLE BORDER="2" CELLBORDER="0" CELLSPACING="0" CELLPADDING="2" '
            f'COLOR="{rc}" BGCOLOR="{fill}">{"".join(rows)}</TABLE>>'
        )
        return {
            "label": label,
            "shape": "plain",
            "id": nid,
            "tooltip": a["tooltip"],
            "class": f"role-{a['role']}",
        }


def _prefixes(path: str) -> list[str]:
    """``a.b.c`` → ``["a", "a.b"]`` (proper prefixes; none for ``""`` and ``loss``)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _incoming_cotangent(gm, source: str) -> str | None:
    """Name of the cotangent that reached ``source``'s backward nodes from outside them."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get(SOURCE) != source:
            continue
        for u in n.all_input_nodes:
            if u.meta.get(SOURCE) != source and u.meta.get(KIND) == "cotangent":
                return u.name
    return None


# -- module level ----------------------------------------------------------------------------


class _ModulePicture:
    """One box per module path (see the module docstring)."""

    def __init__(self, a: Any, graph: str, profile: dict[str, float]):
        self.a = a
        self.graph = graph
        self.profile = profile
        self.cv = _Canvas()
        self.show_b = graph in ("backward", "train", "all")
        self.show_u = graph in ("train", "all")
        self.show_j = graph in ("jvp", "all")

    def _layers(self) -> dict[str, dict[str, Any]]:
        out = {}
        for L in (self.a.summary or {}).get("layers", []):
            path = "" if L["name"] == "(model)" else L["name"]
            out[path] = L
        return out

    def _box_flops(self, L: dict[str, Any]) -> int:
        f = L.get("forward_flops", 0)
        if self.graph == "forward":
            return f
        if self.graph == "backward":
            return L.get("backward_flops", 0)
        if self.graph == "jvp":
            return f + L.get("jvp_flops", 0)
        total = f + L.get("backward_flops", 0) + L.get("update_flops", 0)
        return total + (L.get("jvp_flops", 0) if self.graph == "all" else 0)

    def _what(self) -> str:
        return {
            "forward": "forward FLOPs",
            "backward": "backward FLOPs",
            "jvp": "primal + tangent FLOPs",
            "train": "forward + backward + update FLOPs",
            "all": "forward + backward + update + JVP FLOPs",
        }[self.graph]

    def build(self, clusters: bool = True, newrank: bool = False) -> graphviz.Digraph:
        a = self.a
        self.clusters = clusters
        layers = self._layers()
        fwd = a.forward
        types = _module_types(fwd)
        # modules with nodes in the forward graph, in forward order
        order: list[str] = []
        for n in fwd.graph.nodes:
            if n.op == "call_function":
                m = n.meta.get(MODULE, "")
                if m not in order:
                    order.append(m)
        for m in layers:
            if m not in order and (layers[m].get("params") or self._box_flops(layers[m])):
                order.append(m)
        saved = self._saved_bytes()
        # modules with ops of their own and child modules (a residual block's ``add``)
        parents = {p for m in order for p in _prefixes(m) if p in order}
        scale = _FlopScale([self._box_flops(layers[m]) for m in order if m in layers])
        nid = {m: f"m_{_id(m) or 'model'}" for m in order}
        cl_of = {m: m if m in parents else m.rpartition(".")[0] for m in order}
        cl_of[""] = cl_of["loss"] = ""
        row_layout = len(order) > ROW_LAYOUT_MIN_BOXES
        cluster_of_id = {nid[m]: cl_of[m] for m in order}
        own_ops = self._own_ops(parents)
        for m in order:
            L = layers.get(m, {"forward_flops": 0})
            self.cv.node(
                cl_of[m], nid[m], **self._box(m, L, types, saved.get(m, 0), scale, own_ops.get(m))
            )
            if row_layout and cl_of[m]:
                self.cv.rows.add(cl_of[m])
        # ghosts: pruned (backward) and skipped (JVP) work per module
        words = []
        for gm, word, show in (
            (a.backward, "pruned", self.show_b),
            (a.jvp, "skipped", self.show_j),
        ):
            if gm is None or not show:
                continue
            per: dict[tuple[str, str], int] = defaultdict(int)
            for g in gm.meta.get(GHOSTS, []):
                per[(g.module, g.role)] += g.cost.flops
            for (m, role), flops in per.items():
                if flops <= 0 or m not in nid:
                    continue
                if word not in words:
                    words.append(word)
                gid = f"ghost_{word}_{_id(m) or 'model'}_{role}"
                cl = cl_of[m]
                self.cv.node(
                    cl,
                    gid,
                    id=gid,
                    shape="box",
                    style="dashed,rounded",
                    **{"class": f"ghost role-{role}"},
                    color=GHOST_COLOUR,
                    fontcolor=GHOST_COLOUR,
                    fontsize="9",
                    label=f"{word}: {human(flops)} FLOPs\n{role} of {m or '(model)'}",
                )
                self.cv.edge(nid[m], gid, style="dashed", color=GHOST_COLOUR, arrowhead="none")
        # inputs and forward data flow between modules
        sig = fwd.meta.get(SIGNATURE)
        inputs = set(sig.inputs) if sig else set()
        mod_of: dict[str, str] = {}
        for n in fwd.graph.nodes:
            if n.op == "placeholder" and n.name in inputs:
                iid = f"in_{_id(n.name)}"
                v = n.meta.get("val")
                self.cv.node(
                    "",
                    iid,
                    label=f"input {n.name}\n{_shape_of(v)} · {human_bytes(_bytes_of(v))}",
                    shape="ellipse",
                    style="filled",
                    fillcolor="#FFFFFF",
                    color=PARAM_COLOUR,
                    fontsize="9",
                    id=iid,
                )
                mod_of[n.name] = iid
            elif n.op == "call_function":
                mod_of[n.name] = nid[n.meta.get(MODULE, "")]
        flows: dict[tuple[str, str], int] = {}
        for n in fwd.graph.nodes:
            if n.op != "call_function":
                continue
            dst = mod_of[n.name]
            for u in n.all_input_nodes:
                src = mod_of.get(u.name)
                if src is None or src == dst:
                    continue
                flows[(src, dst)] = max(flows.get((src, dst), 0), _bytes_of(u.meta.get("val")))
        big = max(flows.values(), default=0)
        for (src, dst), nbytes in flows.items():
            attrs = {"penwidth": f"{1 + 2 * (nbytes / big if big else 0):.2f}"}
            if big and nbytes >= big / 4:
                attrs["label"] = human_bytes(nbytes)
            if self.graph == "backward":
                attrs["dir"] = "back"
            row = cluster_of_id.get(src)
            if row and row in self.cv.rows and cluster_of_id.get(dst) == row:
                attrs["constraint"] = "false"  # in a row: the order comes from the chain below
            self.cv.edge(src, dst, **attrs)
        for row in self.cv.rows:  # keep each row in forward order
            members = [nid[m] for m in order if cl_of[m] == row]
            for x, y in zip(members, members[1:]):
                self.cv.edge(x, y, style="invis", weight="50")
        for path in [p for _, p in self.cv.nodes] + list(parents):
            label = path
            if path in types and path not in ("", "loss"):
                label = f"{path} · {types[path]}"
            self.cv.cluster_label[path] = label
        roles = ["forward"]
        if self.show_b:
            roles += ["grad_input", "grad_weight"]
        if self.show_u:
            roles.append("update")
        if self.show_j:
            roles += ["tangent_from_input", "tangent_from_param"]
        extras = _legend_extras(words, False, False)
        rows = ["FLOPs per phase"]
        if self.show_b:
            rows += [
                "(bwd+upd)/fwd" if self.show_u else "bwd/fwd",
                "bytes saved for backward (wine)",
            ]
        if self.show_j:
            rows.append("jvp/fwd")
        if self.profile:
            rows.append("measured time")
        extras.append("box rows: " + ", ".join(rows))
        legend = _legend_label(scale, self._what(), roles, extras)
        return self.cv.build(
            _title(a, self.graph, "module"), legend, newrank=newrank, clusters=clusters
        )

    def _saved_bytes(self) -> dict[str, int]:
        """Module → bytes of its forward values (activations, inputs) the backward reads."""
        out: dict[str, int] = defaultdict(int)
        if self.a.backward is None:
            return out
        for n in self.a.backward.graph.nodes:
            kind = n.meta.get(RESIDUAL)
            if n.op == "placeholder" and kind not in (None, "param", "buffer", "param_derived"):
                out[n.meta.get(MODULE, "")] += _bytes_of(n.meta.get("val"))
        return out

    def _own_ops(self, parents: set[str]) -> dict[str, str]:
        """Parent module → the op names of its own forward ops ("add")."""
        ops: dict[str, list[str]] = defaultdict(list)
        for n in self.a.forward.graph.nodes:
            m = n.meta.get(MODULE, "")
            if n.op == "call_function" and m in parents:
                name = _op_short(n.target)
                if name not in ops[m] and name not in ("getitem", "view", "reshape"):
                    ops[m].append(name)
        return {
            m: ", ".join(v[:3]) + (", …" if len(v) > 3 else "") or "own ops" for m, v in ops.items()
        } | {m: "own ops" for m in parents if m not in ops}

    def _box(
        self,
        m: str,
        L: dict[str, Any],
        types: dict[str, str],
        saved: int,
        scale: _FlopScale,
        own_ops: str | None,
    ) -> dict[str, str]:
        flops = self._box_flops(L)
        fill = scale.colour(flops)
        fc = _text_on(fill)
        short = m.rpartition(".")[2] if m not in ("", "loss") else (m or "(model)")
        if not self.clusters:
            short = m or "(model)"
        if own_ops:
            short = f"{m} ({own_ops})"
        typ = types.get(m, "") if m not in ("", "loss") and not own_ops else ""
        head = f"<B>{_esc(short)}</B>" + (
            f' <FONT POINT-SIZE="8">{_esc(typ)}</FONT>' if typ else ""
        )
        cells: list[tuple[str | None, str, str]] = []  # (swatch colour, key, value)
        cells.append((ROLE_COLOURS["forward"], "fwd", human(L.get("forward_flops", 0))))
        if self.show_b:
            cells.append(
                (
                    ROLE_COLOURS["grad_input"],
                    "bwd∂x",
                    human(L.get("grad_input_flops", 0) + L.get("grad_accum_flops", 0)),
                )
            )
            cells.append(
                (ROLE_COLOURS["grad_weight"], "bwd∂W", human(L.get("grad_weight_flops", 0)))
            )
        if self.show_u:
            cells.append((ROLE_COLOURS["update"], "upd", human(L.get("update_flops", 0))))
        if self.show_b:
            r = L.get("ratio") if self.show_u else L.get("ratio_no_update")
            cells.append((None, "ratio", "–" if r is None else f"{r:.2f}"))
            cells.append((RESIDUAL_COLOUR, "saved", human_bytes(saved)))
        if self.show_j:
            cells.append((ROLE_COLOURS["tangent_from_param"], "jvp", human(L.get("jvp_flops", 0))))
            jr = L.get("jvp_ratio")
            cells.append((None, "jvp/fwd", "–" if jr is None else f"{jr:.2f}"))
        if self.graph == "forward":
            cells.append((None, "share", f"{100 * L.get('share', 0):.1f}%"))
        if self.profile:
            cells.append((None, "time", _time(self.profile.get(m))))
        rows = [f'<TR><TD COLSPAN="6" BGCOLOR="{fill}"><FONT COLOR="{fc}">{head}</FONT></TD></TR>']
        for i in range(0, len(cells), 2):
            tds = []
            for sw, k, v in cells[i : i + 2]:
                swatch = (
                    f'<TD BGCOLOR="{sw}" WIDTH="4" FIXEDSIZE="FALSE"></TD>'
                    if sw
                    else '<TD WIDTH="4"></TD>'
                )
                tds.append(
                    f'{swatch}<TD ALIGN="LEFT"><FONT POINT-SIZE="8">{_esc(k)}</FONT></TD>'
                    f'<TD ALIGN="RIGHT">{_esc(v)}</TD>'
                )
            if len(tds) == 1:
                tds.append('<TD COLSPAN="3"></TD>')
            rows.append(f"<TR>{''.join(tds)}</TR>")
        label = (
            '<<TABLE BORDER="1" CELLBORDER="0" CELLSPACING="0" CELLPADDING="1" '
            f'COLOR="#444444" BGCOLOR="#FFFFFF">{"".join(rows)}</TABLE>>'
        )
        tip = (
            f"{m or '(model)'}: forward {L.get('forward_flops', 0)} FLOPs, backward "
            f"{L.get('backward_flops', 0)}, update {L.get('update_flops', 0)}, jvp "
            f"{L.get('jvp_flops', 0)}, saved {saved} B"
        )
        nid = f"m_{_id(m) or 'model'}"
        return {"label": label, "shape": "plain", "id": nid, "tooltip": tip}
