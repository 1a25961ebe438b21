"""The op level's parts: op, value and ghost boxes, data and residual edges, and assembling
them into a :class:`~.scene.Scene` (the graph walks are in :mod:`.op_level`).

Reads: ``val``, ``KIND``, ``ROLE``, ``SOURCE``, ``MODULE``, ``COST``, ``PARAM``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from graphflop.export.graphviz import captions, facts
from graphflop.export.graphviz.composite import composite_name, says_the_same
from graphflop.export.graphviz.palette import (
    PARAM_COLOUR,
    ROLE_COLOURS,
    FlopScale,
    role_colour,
)
from graphflop.export.graphviz.scene import Box, Canvas, Card, Edge, GhostCard, Scene
from graphflop.export.report import human, human_bytes
from graphflop.meta import COST, KIND, MODULE, PARAM, ROLE, SOURCE, TIME, ZERO_COST

#: graph key → phase column in the combined (``train``/``all``) pictures
PHASES = {"f": "forward", "b": "backward", "u": "backward", "j": "tangent"}
PHASE_LABELS = {
    "forward": "forward (model and loss)",
    "backward": "backward, drawn upward (each module beside its forward), and update",
    "tangent": "JVP tangents (forward mode)",
}
#: smallest data edge labelled with its bytes, and the fraction of the largest one
EDGE_LABEL_MIN_BYTES = 1024
EDGE_LABEL_FRACTION = 16


@dataclass
class _Op:
    """An op box waiting for the FLOP scale (its fill needs every op's FLOPs first)."""

    key: str  # graph key: f(orward), b(ackward), u(pdate), j(vp)
    module: str
    source: str | None
    op: str
    role: str
    shape: str
    cost: Any
    tooltip: str
    ops: int = 0  # a collapsed loss: ops drawn as this one box
    seconds: float | None = None  # predicted time (TIME), when the analysis has one
    bound: str = ""


@dataclass
class _Residual:
    """A residual edge being gathered: a parameter read only (``light``), its bytes."""

    light: bool
    bytes: int = 0  # printed on the edge: residuals first read here
    size: int = 0  # carried by the edge
    label: bool = False


class OpParts:
    """Boxes and edges of an op-level picture, gathered per graph key, then assembled."""

    def __init__(
        self,
        a: Any,
        graph: str,
        profile: dict[str, float],
        collapse_loss: bool,
        color: str = "flops",
    ):
        self.a = a
        self.color = color  # what fills the op boxes: "flops" or "time" (predicted)
        self.graph = graph
        self.profile = profile
        self.collapse_loss = collapse_loss
        self.clusters = True
        self.cv = Canvas()
        self.ids: dict[tuple[str, str], str] = {}  # (graph key, node name) → drawn box id
        self.pending: dict[str, _Op] = {}  # op box id → its label's facts
        self.data_edges: list[Edge] = []
        self.residuals: dict[tuple[str, str], _Residual] = {}
        self.roles: set[str] = set()
        self.ghost_words: list[str] = []
        self.has_residuals = False
        self.types: dict[str, str] = {}
        self.combined = graph in ("train", "all")
        self.reversed_backward = self.combined
        self.phase = PHASES if self.combined else {}
        self.cv.phase_label = dict(PHASE_LABELS)
        self.root: str | None = None  # draw only this module's subtree
        self.home: dict[str, str] = {}  # box id → its module path

    def _add(self, key: str, module: str, box: Box) -> str:
        self.home[box.id] = module
        if key == "u" and self.phase:
            module = ""  # outside module clusters: a cluster stretched below a module's
            # gradients would push the next module's backward sideways
        return self.cv.add(replace(box, module=module, phase=self.phase.get(key, "")))

    # boxes -----------------------------------------------------------------------------------
    def op_node(self, key: str, n) -> str:
        """An op box for call node ``n`` of graph ``key`` (or its share of the loss box)."""
        cost = n.meta.get(COST, ZERO_COST)
        role = n.meta.get(ROLE) or ("forward" if key == "f" else "grad_input")
        module = n.meta.get(MODULE, "")
        if self.collapse_loss and module == "loss":
            return self._loss_node(key, n, cost)
        self.roles.add(role)
        nid = f"{key}_{n.name}"
        self.pending[nid] = _Op(
            key=key,
            module=module,
            source=n.meta.get(SOURCE),
            op=facts.op_short(n.target),
            role=role,
            shape=facts.shape_of(n.meta.get("val")),
            cost=cost,
            tooltip=self._tooltip(n, role, cost),
        )
        t = n.meta.get(TIME)
        if t is not None:
            self.pending[nid].seconds = t.seconds
            self.pending[nid].bound = t.bound
        self.ids[(key, n.name)] = nid
        return nid

    def _loss_node(self, key: str, n, cost) -> str:
        """The loss's ops, one box per graph (primal and tangent apart in the JVP)."""
        tangent = n.meta.get(KIND) in ("tangent", "coef") and key == "j"
        nid = f"{key}_loss" + ("_tangent" if tangent else "")
        if nid not in self.pending:
            kind = facts.loss_kind(self.a)
            op = f"∂ loss: {kind}" if key == "b" else f"loss: {kind}"
            role = "loss"
            if tangent:
                op, role = f"tangent of loss: {kind}", "tangent_from_input"
            self.pending[nid] = _Op(key, "loss", None, op, role, "", ZERO_COST, "")
            self.roles.add(role)
        a = self.pending[nid]
        a.ops += 1
        a.cost = a.cost + cost
        t = n.meta.get(TIME)
        if t is not None:
            a.seconds = (a.seconds or 0.0) + t.seconds
        a.shape = f"{a.ops} ops (drawn as one node)"
        a.tooltip = (
            f"{a.ops} loss ops, {a.cost.flops} FLOPs, "
            f"{a.cost.bytes_read + a.cost.bytes_written} bytes"
        )
        self.ids[(key, n.name)] = nid
        return nid

    def _tooltip(self, n, role: str, cost) -> str:
        """Name, op, shapes, FLOPs, bytes, module and provenance of call node ``n``."""
        v = n.meta.get("val")
        ins = ", ".join(facts.shape_of(u.meta.get("val")) for u in n.all_input_nodes) or "–"
        return (
            f"{n.name}: {n.target}\n"
            f"output {facts.shape_of(v)} {str(getattr(v, 'dtype', '')).replace('torch.', '')}"
            f"; inputs {ins}\n"
            f"{cost.flops} FLOPs ({cost.mm_flops} in matrix products), read {cost.bytes_read} B,"
            f" written {cost.bytes_written} B\n"
            f"module {n.meta.get(MODULE) or '(model)'} · role {role} · kind {n.meta.get(KIND)}"
            f" · from forward node {n.meta.get(SOURCE) or n.name}"
        )

    def small_node(
        self,
        key: str,
        n,
        module: str,
        text: str,
        colour: str = PARAM_COLOUR,
        shape: str = "box",
        bold: bool = False,
    ) -> str:
        """A small value box (parameter, input, state, residual): ``text``, shape and bytes."""
        nid = f"{key}_{n.name}"
        v = n.meta.get("val")
        label = f"{text}\n{facts.shape_of(v)} · {human_bytes(facts.bytes_of(v))}"
        box = Box(nid, "value", label, colour=colour, shape=shape, bold=bold)
        self._add(key, module, box)
        self.ids[(key, n.name)] = nid
        return nid

    def ghost_node(self, key: str, g, word: str) -> str:
        """A ghost box: work ``word`` (pruned, skipped) not emitted, with the FLOPs it saved."""
        nid = f"{key}_{g.name}"
        saved = f"{human(g.cost.flops)} FLOPs" if g.cost.flops else "0 FLOPs (view)"
        shape = "×".join(map(str, g.shape)) or "scalar"
        label = GhostCard(
            f"{word}: {saved}", f"{facts.op_short(g.op)} → {shape}", f"{g.role} of {g.source}"
        )
        tip = (
            f"{g.name}: {g.op} not emitted ({g.role}, {g.cost.flops} FLOPs, "
            f"{g.cost.bytes_read + g.cost.bytes_written} bytes)"
        )
        self._add(key, g.module, Box(nid, "ghost", label, role=g.role, tooltip=tip))
        self.ids[(key, g.name)] = nid
        return nid

    def zero_node(self, key: str, module: str, nid: str) -> str:
        """A tangent that is zero (not chosen), read by a skipped JVP op."""
        return self._add(key, module, Box(nid, "zero", "0 (tangent not chosen)"))

    def tangent_placeholder(self, key: str, n) -> None:
        """A tangent input: a bold value box in its role's colour."""
        role = n.meta.get(ROLE) or "tangent_from_param"
        self.roles.add(role)
        q = n.meta.get(PARAM)
        module = q.rpartition(".")[0] if q else ""
        self.small_node(
            key, n, module, f"tangent of {q or n.name}", colour=role_colour(role), bold=True
        )

    # edges -----------------------------------------------------------------------------------
    def data_edge(
        self,
        src: str,
        dst: str,
        nbytes: int,
        backward: bool = False,
        style: str = "data",
        colour: str | None = None,
    ) -> None:
        """A value flowing ``src`` → ``dst`` (drawn reversed in the combined backward)."""
        reverse = backward and self.reversed_backward
        if reverse:
            src, dst = dst, src
        self.data_edges.append(Edge(src, dst, style, colour=colour, reverse=reverse, bytes=nbytes))

    def residual_edge(self, src: str, dst: str, kind: str, nbytes: int, first: bool) -> None:
        """A backward node reading a forward value; ``first``: the first reader of it."""
        light = kind in facts.PARAM_RESIDUALS
        r = self.residuals.setdefault((src, dst), _Residual(light))
        r.light = r.light and light
        if not light:
            r.size += nbytes  # what this edge carries
            if first:  # each residual's bytes are printed once, on its first reader
                r.bytes += nbytes
                r.label = True

    def _emit_residuals(self) -> None:
        loose = self.reversed_backward
        for (src, dst), r in self.residuals.items():
            if src == dst:
                continue
            if r.light:
                self.cv.edge(Edge(src, dst, "param_residual", loose=loose))
                continue
            self.has_residuals = True
            width = 1.0 + 0.3 * max(0.0, math.log2(max(r.size, 1) / 4096))
            self.cv.edge(
                Edge(
                    src,
                    dst,
                    "residual",
                    label=f"saved {human_bytes(r.bytes)}" if r.label else None,
                    width=min(width, 3.5),
                    tooltip=f"residual: {r.size} bytes saved for backward",
                    loose=loose,
                    bytes=r.size,
                )
            )

    def _emit_data_edges(self) -> None:
        """Data edges, merged per (ends, style) with their largest bytes; the big ones labelled."""
        big = max((e.bytes for e in self.data_edges), default=0)
        threshold = max(EDGE_LABEL_MIN_BYTES, big / EDGE_LABEL_FRACTION)
        merged: dict[Edge, int] = {}
        for e in self.data_edges:
            if e.src != e.dst:
                merged[e] = max(e.bytes, merged.get(e, 0))
        for e, nbytes in merged.items():
            label = human_bytes(nbytes) if nbytes >= threshold else None
            self.cv.edge(
                Edge(
                    e.src,
                    e.dst,
                    e.style,
                    label=label,
                    colour=e.colour,
                    reverse=e.reverse,
                    bytes=nbytes,
                )
            )

    # assembling ------------------------------------------------------------------------------
    def _composite_names(self) -> dict[str, str]:
        """Module path → what its forward ops compute together (attention, layer norm, ...)."""
        ops: dict[str, list[str]] = defaultdict(list)
        for a in self.pending.values():
            if a.key == "f":
                ops[a.module].append(a.op)
        names = {m: composite_name(v, self.types.get(m, "")) for m, v in ops.items()}
        return {
            m: n
            for m, n in names.items()
            # a block's own residual adds do not name the block
            if n and not (n == "residual add" and any(p.startswith(m + ".") for p in ops))
        }

    def _keep_only(self, root: str) -> None:
        """Drop the boxes outside module ``root``; an edge crossing its border keeps a small
        box naming the module at the other end ("from h.0.ln_1", "to h.1")."""
        keep = {b.id for own in self.cv.groups.values() for b in own}
        keep = {i for i in keep if _under(self.home.get(i, ""), root)}
        phases = list(dict.fromkeys(ph for ph, _ in self.cv.groups))
        phase_of = {b.id: b.phase for own in self.cv.groups.values() for b in own}
        for k in list(self.cv.groups):
            self.cv.groups[k] = [b for b in self.cv.groups[k] if b.id in keep]
            if not self.cv.groups[k]:
                del self.cv.groups[k]
        edges, outside = [], {}
        for e in self.cv.edges:
            if e.src in keep and e.dst in keep:
                edges.append(e)
                continue
            if e.style in ("align", "order", "ghost_link", "ghost_source") or (
                e.src not in keep and e.dst not in keep
            ):
                continue
            inner, outer = (e.dst, e.src) if e.dst in keep else (e.src, e.dst)
            word = "from" if (outer == e.src) != e.reverse else "to"
            bid = f"x_{word}_{outer}"
            if bid not in outside:
                module = self.home.get(outer, "") or "(model)"
                text = f"{word} {module}" + (f"\n{human_bytes(e.bytes)}" if e.bytes else "")
                outside[bid] = Box(bid, "value", text, phase=phase_of.get(inner, ""))
                self.cv.groups[(phase_of.get(inner, ""), "")].append(outside[bid])
            edges.append(replace(e, src=bid) if outer == e.src else replace(e, dst=bid))
        self.cv.edges = edges
        order = sorted(self.cv.groups.items(), key=lambda kv: phases.index(kv[0][0]))
        self.cv.groups = defaultdict(list, order)

    def _op_box(self, nid: str, a: _Op, scale: FlopScale) -> Box:
        cost = a.cost
        lines = [a.shape]
        if cost.flops or cost.bytes_written:
            fl = f"{human(cost.flops)} FLOPs" if cost.flops else "0 FLOPs"
            lines.append(f"{fl} · {human_bytes(cost.bytes_read + cost.bytes_written)}")
        if self.color == "time" and a.seconds is not None:
            lines.append(f"{captions.time_text(a.seconds)}" + (f" · {a.bound}" if a.bound else ""))
        where = "" if self.clusters or not a.module else f" · {a.module}"
        label = Card(a.op, where, role_colour(a.role), scale.colour(self._fill(a)), tuple(lines))
        return Box(nid, "op", label, role=a.role, tooltip=a.tooltip)

    def _fill(self, a: _Op) -> int:
        """What a box's fill measures: its FLOPs, or its predicted time in nanoseconds."""
        if self.color == "time":
            return round((a.seconds or 0.0) * 1e9)
        return a.cost.flops

    def _align(self, tangents: bool = True) -> None:
        """Pull each forward op onto the rank of the largest backward (and, with ``tangents``,
        tangent) node derived from it, so each module's backward sits beside its forward
        (invisible ``minlen=0`` edges, which Graphviz's ``newrank`` ranker honours across
        clusters)."""
        keys = ("b", "j") if tangents else ("b",)
        best: dict[tuple[str, str], tuple[int, str]] = {}
        for nid, a in self.pending.items():
            if a.key not in keys or not a.source:
                continue
            k = (a.key, a.source)
            if k not in best or a.cost.flops > best[k][0]:
                best[k] = (a.cost.flops, nid)
        fwd = {nid for nid, a in self.pending.items() if a.key == "f"}
        groups: dict[str, list[str]] = defaultdict(list)
        for (_, src), (_, nid) in best.items():
            fid = self.ids.get(("f", src))
            if fid in fwd:
                groups[fid].append(nid)
        for fid, others in groups.items():
            for o in others:  # soft alignment: same rank or below, pulled together
                self.cv.edge(Edge(fid, o, "align"))

    def assemble(self, aligned: bool, align_tangents: bool = True) -> Scene:
        """The scene of everything gathered: op boxes filled on one FLOP scale, residual and
        data edges, cluster labels (class name, measured time), title and legend."""
        self.home.update({nid: a.module for nid, a in self.pending.items()})
        kept = {nid: a for nid, a in self.pending.items() if _under(a.module, self.root)}
        scale = FlopScale([self._fill(a) for a in kept.values()])
        if self.phase and aligned:
            self._align(align_tangents)
        for nid, a in kept.items():
            self._add(a.key, a.module, self._op_box(nid, a, scale))
        self._emit_residuals()
        self._emit_data_edges()
        if self.root is not None:
            self._keep_only(self.root)
        names = self._composite_names()
        for path in self.cv.paths():
            label = path
            if path in self.types and path not in ("", "loss"):
                label = f"{path} · {self.types[path]}"
            if names.get(path) and not says_the_same(names[path], self.types.get(path, "")):
                label += f" · {names[path]}"
            if path in self.profile:
                label += f" · {captions.time_text(self.profile[path])}"
            self.cv.cluster_label[path] = label
        roles = [r for r in ROLE_COLOURS if r in self.roles]
        items = captions.legend_items(self.ghost_words, self.has_residuals, True)
        items += captions.edge_items({e.style for e in self.cv.edges})
        if self.color == "time":
            t = self.a.report.time
            what = f"predicted time per node on {t.device if t is not None else '?'}"
            legend = captions.legend(scale, what, roles, items, captions.nanoseconds_text)
        else:
            legend = captions.legend(scale, "FLOPs per node", roles, items)
        return self.cv.scene(
            captions.title(self.a, self.graph, "op", self.root), legend, self.clusters
        )


def _under(path: str, root: str | None) -> bool:
    """``path`` is ``root`` or inside it (any path when ``root`` is None)."""
    return root is None or path == root or path.startswith(root + ".")
