"""Module level: one box per stretch of a module's own ops, built into a :class:`~.scene.Scene`.

Each box lists its forward, input-gradient, weight-gradient, update and JVP FLOPs, ratios, bytes
saved for backward and measured time, filled by FLOPs; boxes nest in clusters along the module
path; edges follow the forward data flow, top to bottom; pruned and skipped work are dashed boxes
beside their module. A box is named by its module and, where its ATen ops are one known
composite, by what they compute (:mod:`.composite`: attention, layer norm, GELU, ...).

Repeated identical modules (:func:`.structure.folds`: a transformer's blocks) are drawn once:
the first member's boxes with their per-block figures, in a cluster whose label is a table of
per-block and total figures and the multiplicity ("× 12"). Folds nest: the inner blocks of
the block drawn fold inside it ("× 4" inside "× 3"), each box standing for one inner block of
one outer block. A fold is split where its members' figures differ (a first block whose input
gradient is pruned stays apart). With ``module``, only the folds inside that module are drawn:
``h.1`` (a copy of ``h.0``) draws its own boxes, as ``h.0`` does.

With more than :data:`ROW_LAYOUT_MIN_BOXES` boxes, the boxes directly inside one parent cluster
are laid out in one row (ResNet-50: one row per bottleneck block).

Reads: the report's layer rows (:func:`.facts.layer_rows`) and, through :mod:`.facts` and
:mod:`.structure`, ``val``, ``MODULE``, ``COST``, ``ROLE``, ``SOURCE``, ``RESIDUAL``, ``GHOSTS``,
``SIGNATURE`` and ``nn_module_stack``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from graphflop.export.graphviz import captions, facts, structure
from graphflop.export.graphviz.composite import VIEWS, composite_name, says_the_same
from graphflop.export.graphviz.errors import RenderError
from graphflop.export.graphviz.palette import RESIDUAL_COLOUR, ROLE_COLOURS, FlopScale
from graphflop.export.graphviz.scene import (
    FOLD_LEGEND,
    Box,
    Canvas,
    Edge,
    Fold,
    FoldRow,
    LegendItem,
    Scene,
    Stat,
    StatCard,
    fold_mark,
)
from graphflop.export.graphviz.structure import Folded, Unit
from graphflop.export.report import human, human_bytes
from graphflop.io import sanitize_name
from graphflop.meta import SIGNATURE
from graphflop.report import LayerRow

#: boxes above which module level lays out each parent's children in one row
ROW_LAYOUT_MIN_BOXES = 40
#: what a box's fill measures, per picture
WHAT = {
    "forward": "forward FLOPs",
    "backward": "backward FLOPs",
    "jvp": "primal + tangent FLOPs",
    "train": "forward + backward + update FLOPs",
    "all": "forward + backward + update + JVP FLOPs",
}


@dataclass
class Figures:
    """A box's figures: FLOPs per phase (each gradient with the accumulation of its
    cotangents), saved bytes."""

    forward: int = 0
    grad_input: int = 0
    grad_weight: int = 0
    update: int = 0
    jvp: int = 0
    saved: int = 0

    @classmethod
    def of_row(cls, row: LayerRow, saved: int, weight_accum: int = 0) -> Figures:
        """A module's figures from its report row; ``weight_accum``: FLOPs of its gradient
        accumulations that sum weight gradients (counted as weight, not input, gradient)."""
        return cls(
            row.forward_flops,
            facts.grad_input_flops(row, weight_accum),
            row.grad_weight_flops + weight_accum,
            row.update_flops,
            row.jvp_flops,
            saved,
        )

    def __add__(self, o: Figures) -> Figures:
        return Figures(*(getattr(self, f.name) + getattr(o, f.name) for f in fields(self)))

    def __sub__(self, o: Figures) -> Figures:
        return Figures(*(getattr(self, f.name) - getattr(o, f.name) for f in fields(self)))

    @property
    def backward(self) -> int:
        return self.grad_input + self.grad_weight

    def picture(self, graph: str) -> int:
        """FLOPs in the phases picture ``graph`` draws (the box's fill)."""
        if graph == "forward":
            return self.forward
        if graph == "backward":
            return self.backward
        if graph == "jvp":
            return self.forward + self.jvp
        total = self.forward + self.backward + self.update
        return total + (self.jvp if graph == "all" else 0)

    def ratio(self, with_update: bool) -> str:
        """(backward [+ update]) / forward, two decimals ("–" without forward FLOPs)."""
        num = self.backward + (self.update if with_update else 0)
        return f"{num / self.forward:.2f}" if self.forward else "–"

    def jvp_ratio(self) -> str:
        return f"{self.jvp / self.forward:.2f}" if self.forward else "–"


def module_scene(
    a: Any, graph: str, profile: dict[str, float], clusters: bool = True, module: str | None = None
) -> Scene:
    """The module-level picture ``graph`` of analysis ``a``.

    Args:
        a: the analysis (only read).
        graph: one of ``forward``, ``backward``, ``jvp``, ``train``, ``all``.
        profile: measured seconds per module path (``""``: the model's own ops).
        clusters: module clusters; without, each box is named by its whole path.
        module: draw only this module path's subtree (None: the whole model).

    Raises:
        RenderError: ``module`` has no ops in the forward graph.
    """
    scene = _ModuleScene(a, graph, profile, clusters, module)
    if len(scene.drawn) > ROW_LAYOUT_MIN_BOXES:  # rows: a reused module keeps one box
        scene = _ModuleScene(a, graph, profile, clusters, module, split_leaves=False)
    return scene.build()


def under(path: str, root: str | None) -> bool:
    """``path`` is ``root`` or inside it (any path when ``root`` is None)."""
    return root is None or path == root or path.startswith(root + ".")


class _ModuleScene:
    def __init__(
        self,
        a: Any,
        graph: str,
        profile: dict[str, float],
        clusters: bool,
        module: str | None,
        split_leaves: bool = True,
    ):
        self.a = a
        self.graph = graph
        self.profile = profile
        self.clusters = clusters
        self.root = module  # draw only this module's subtree (None: the whole model)
        self.cv = Canvas()
        self.show_b = graph in ("backward", "train", "all")
        self.show_u = graph in ("train", "all")
        self.show_j = graph in ("jvp", "all") or (graph == "train" and a.jvp is not None)
        self.layers = facts.layer_rows(a)
        self.units, self.unit_of = structure.units(a.forward, split_leaves)
        if module is not None:
            for u in self.units:
                u.drawn = u.drawn and under(u.module, module)
            if not any(u.drawn for u in self.units):
                raise RenderError(f"no module {module!r} with ops in the forward graph")
        self.figures = self._figures()
        # outer folds before inner ones; with ``module``, only the folds inside it (the root
        # drawn is the module asked for, whichever copy of a repeated block it is)
        self.folds = sorted(
            (f for f in self._folds() if all(under(m, module) for m in f.members)),
            key=lambda f: f.template.count("."),
        )
        self.fold_of: dict[str, Folded] = {}  # module path → the innermost fold holding it
        for f in self.folds:
            for u in self.units:
                for p in (u.module, *_prefixes(u.module)):
                    if f.member_of(p) is not None:
                        self.fold_of[p] = f
        self.drawn = [u for u in self.units if u.drawn and self._rep(u) is u]
        self.drawn_ids = {id(u) for u in self.drawn}
        modules = {u.module for u in self.drawn}
        # modules with ops of their own and child modules (a residual block's ``add``)
        self.parents = {p for m in modules for p in _prefixes(m) if p in modules}
        self.cluster_of = {m: m if m in self.parents else m.rpartition(".")[0] for m in modules}
        self.cluster_of[""] = self.cluster_of["loss"] = ""
        self.types = facts.module_types(a.forward)
        self.nodes = {n.name: n for n in a.forward.graph.nodes}

    # figures ---------------------------------------------------------------------------------
    def _figures(self) -> dict[int, Figures]:
        """id(unit) → its figures: the module's report row when it is one box, else the sum
        over its nodes, the remainder of the row on its last box (so boxes add up to rows)."""
        saved = facts.saved_bytes(self.a)
        weight_accum = facts.weight_accum_flops(self.a)
        per_module: dict[str, list[Unit]] = {}
        for u in self.units:
            per_module.setdefault(u.module, []).append(u)
        costs = facts.node_costs(self.a) if any(len(v) > 1 for v in per_module.values()) else {}
        out: dict[int, Figures] = {}
        for m, us in per_module.items():
            row = self.layers.get(m)
            whole = (
                Figures.of_row(row, saved.get(m, 0), weight_accum.get(m, 0))
                if row is not None
                else Figures()
            )
            if len(us) == 1:
                out[id(us[0])] = whole
                continue
            parts = [
                Figures(
                    *(
                        sum(costs.get(n, {}).get(f.name, 0) for n in u.nodes)
                        for f in fields(Figures)
                    )
                )
                for u in us
            ]
            parts[0].update = whole.update  # parameters' updates: on the first box
            last = max((i for i, u in enumerate(us) if u.drawn), default=len(us) - 1)
            rest = whole - sum(parts, Figures())
            parts[last] = parts[last] + rest
            out.update({id(u): p for u, p in zip(us, parts)})
        return out

    def _fig(self, u: Unit) -> Figures:
        return self.figures[id(u)]

    def _member_figures(self, f: Folded) -> list[Figures]:
        return [
            sum((self._fig(u) for u in self.units if f.member_of(u.module) == i), Figures())
            for i in range(f.count)
        ]

    def _folds(self) -> list[Folded]:
        """The folds of the forward graph, split where the figures this picture shows differ
        between members (saved bytes may: the last block's output is often not kept; so may
        the first block's input gradient, which a forward picture does not show)."""
        out = []
        for f in structure.folds(self.a.forward):
            figs = [self._shown(g) for g in self._member_figures(f)]
            i = 0
            while i < f.count:
                j = i + 1
                while j < f.count and figs[j] == figs[i]:
                    j += 1
                if j - i >= 2:
                    out.append(Folded(f.members[i:j]))
                i = j
        return out

    def _shown(self, g: Figures) -> tuple[int, ...]:
        """The FLOPs of ``g`` this picture's fold table and boxes show."""
        return (
            g.forward,
            *((g.grad_input, g.grad_weight) if self.show_b else ()),
            *((g.update,) if self.show_u else ()),
            *((g.jvp,) if self.show_j else ()),
        )

    def _twin(self, path: str) -> str:
        """``path`` moved into the template of each fold holding it, outer folds first
        (``stages.2.inner.3.a`` → ``stages.0.inner.3.a`` → ``stages.0.inner.0.a``)."""
        for f in self.folds:
            path = f.to_template(path)
        return path

    def _rep(self, u: Unit) -> Unit:
        """The drawn box standing for ``u``: its twin in its folds' templates, else itself."""
        twin = self._twin(u.module)
        if twin == u.module:
            return u
        return next(v for v in self.units if v.module == twin and v.seg == u.seg)

    def _marks(self, path: str) -> str:
        """The multiplicities of the folds holding ``path``, outer first ("× 3 · × 4")."""
        return " · ".join(fold_mark(f.count) for f in self.folds if f.member_of(path) is not None)

    # building --------------------------------------------------------------------------------
    def build(self) -> Scene:
        scale = FlopScale([self._fig(u).picture(self.graph) for u in self.drawn])
        row_layout = len(self.drawn) > ROW_LAYOUT_MIN_BOXES
        for u in self.drawn:
            self.cv.add(self._box(u, scale))
            if row_layout and self.cluster_of[u.module]:
                self.cv.rows.add(self.cluster_of[u.module])
        words = self._ghosts()
        self._inputs()
        self._flows()
        for row in dict.fromkeys(self.cluster_of[u.module] for u in self.drawn):
            if row in self.cv.rows:  # keep each row in forward order
                members = [u.id for u in self.drawn if self.cluster_of[u.module] == row]
                for x, y in zip(members, members[1:]):
                    self.cv.edge(Edge(x, y, "order"))
        # every cluster, those holding only clusters too (an outer fold's template, whose
        # boxes all lie in its inner fold's template)
        paths = self.cv.paths() + list(self.parents)
        for path in dict.fromkeys(q for p in paths if p for q in (*_prefixes(p), p)):
            self.cv.cluster_label[path] = self._cluster_label(path)
        for f in self.folds:
            if f.template in self.cv.cluster_label:
                self.cv.folds[f.template] = self._fold(f)
        legend = captions.legend(scale, WHAT[self.graph], self._roles(), self._legend_items(words))
        return self.cv.scene(
            captions.title(self.a, self.graph, "module", self.root), legend, self.clusters
        )

    def _cluster_label(self, path: str) -> str:
        f = self.fold_of.get(path)
        if f is not None and f.template == path:
            return f"{fold_mark(f.count)} {path} … {f.members[-1]}"
        label = path
        if path in self.types and path not in ("", "loss"):
            label = f"{path} · {self.types[path]}"
        return label

    def _fold(self, f: Folded) -> Fold:
        figs = self._member_figures(f)
        per, total = figs[0], sum(figs, Figures())
        rows = [FoldRow(ROLE_COLOURS["forward"], "fwd", per.forward, total.forward)]
        if self.show_b:
            rows.append(
                FoldRow(ROLE_COLOURS["grad_input"], "bwd∂x", per.grad_input, total.grad_input)
            )
            rows.append(
                FoldRow(ROLE_COLOURS["grad_weight"], "bwd∂W", per.grad_weight, total.grad_weight)
            )
        if self.show_u:
            rows.append(FoldRow(ROLE_COLOURS["update"], "upd", per.update, total.update))
        if self.show_j:
            rows.append(FoldRow(ROLE_COLOURS["tangent_from_param"], "jvp", per.jvp, total.jvp))
        if self.show_b:
            rows.append(FoldRow(RESIDUAL_COLOUR, "saved", per.saved, total.saved, "B"))
        ratios = []
        if self.show_b:
            ratios.append(("(bwd+upd)/fwd" if self.show_u else "bwd/fwd", per.ratio(self.show_u)))
        if self.show_j:
            ratios.append(("jvp/fwd", per.jvp_ratio()))
        same = all(g == per for g in figs)
        kind = self.types.get(f.template, "")
        per_block = "per block" if same else f"block {f.members[0]}"
        return Fold(f.members, kind, tuple(rows), tuple(ratios), per_block)

    def _roles(self) -> list[str]:
        roles = ["forward"]
        if self.show_b:
            roles += ["grad_input", "grad_weight"]
        if self.show_u:
            roles.append("update")
        if self.show_j:
            roles += ["tangent_from_param"]
        return roles

    def _legend_items(self, words: list[str]) -> list[LegendItem]:
        rows = ["FLOPs per phase (colour strip: the role)"]
        if self.show_b:
            rows += ["(bwd+upd)/fwd" if self.show_u else "bwd/fwd", "bytes saved for backward"]
        if self.show_j:
            rows.append("jvp/fwd")
        if self.profile:
            rows.append("measured time")
        items = captions.legend_items(words, False, False)
        items.append(LegendItem("box rows: " + ", ".join(rows)))
        if self.folds:
            items.append(LegendItem(FOLD_LEGEND, lead="× N cluster"))
        styles = {"data"} | ({"ghost_link"} if words else set())
        return items + captions.edge_items(styles, module_level=True)

    # boxes -----------------------------------------------------------------------------------
    def _title(self, u: Unit) -> tuple[str, str]:
        """(title, class name) of ``u``'s box: the module's last name and what its ops compute
        (a parent module's own ops: only what they compute; its cluster names it)."""
        m = u.module
        short = m.rpartition(".")[2] if m not in ("", "loss") else (m or "(model)")
        if not self.clusters:
            short = m or "(model)"
            if m in self.fold_of:
                short = f"{short} ({self._marks(m)})"
        ops = [facts.op_short(self.nodes[n].target) for n in u.nodes]
        name = composite_name(ops, self.types.get(m, ""))
        if m == "loss":
            name = facts.loss_kind(self.a).replace("_", "-")
        if name is None and (m in self.parents or m in ("", "loss") or u.seg):
            real = list(dict.fromkeys(op for op in ops if op not in VIEWS))
            name = ", ".join(real[:3]) + (", …" if len(real) > 3 else "") or "views"
        typ = self.types.get(m, "") if m not in ("", "loss", *self.parents) else ""
        if name and typ and says_the_same(name, typ):
            name = None
        if m in self.parents and self.clusters and name:
            return name, ""
        return (f"{short} · {name}" if name else short), typ

    def _box(self, u: Unit, scale: FlopScale) -> Box:
        fig = self._fig(u)
        title, typ = self._title(u)
        label = StatCard(title, typ, scale.colour(fig.picture(self.graph)), tuple(self._stats(u)))
        m = u.module or "(model)"
        held = [f for f in self.folds if f.member_of(u.module) is not None][::-1]
        rep = "".join(
            f" (per block: one of {f.count} identical, {f.members[0]} … {f.members[-1]}; "
            f"{fold_mark(f.count)} = total)"
            if i == 0
            else f" (in each of {f.count} identical {f.members[0]} … {f.members[-1]})"
            for i, f in enumerate(held)
        )
        tip = (
            f"{m}{rep}: {typ or title}; ops {', '.join(u.nodes[:8])}"
            f"{' …' if len(u.nodes) > 8 else ''}\nforward {fig.forward} FLOPs, input gradient "
            f"{fig.grad_input}, weight gradient {fig.grad_weight}, update {fig.update}, jvp "
            f"{fig.jvp}; saved for backward {fig.saved} B"
        )
        return Box(u.id, "module", label, module=self.cluster_of[u.module], tooltip=tip)

    def _stats(self, u: Unit) -> list[Stat]:
        fig = self._fig(u)
        stats = [Stat(ROLE_COLOURS["forward"], "fwd", human(fig.forward))]
        if self.show_b:
            stats.append(Stat(ROLE_COLOURS["grad_input"], "bwd∂x", human(fig.grad_input)))
            stats.append(Stat(ROLE_COLOURS["grad_weight"], "bwd∂W", human(fig.grad_weight)))
        if self.show_u:
            stats.append(Stat(ROLE_COLOURS["update"], "upd", human(fig.update)))
        if self.show_b:
            stats.append(Stat(None, "ratio", fig.ratio(self.show_u)))
            stats.append(Stat(RESIDUAL_COLOUR, "saved", human_bytes(fig.saved)))
        if self.show_j:
            stats.append(Stat(ROLE_COLOURS["tangent_from_param"], "jvp", human(fig.jvp)))
            stats.append(Stat(None, "jvp/fwd", fig.jvp_ratio()))
        if self.graph == "forward":
            row = self.layers.get(u.module)
            if row is not None and u.seg == 0:
                stats.append(Stat(None, "share", f"{100 * row.share:.1f}%"))
        if self.profile and u.seg == 0:
            stats.append(Stat(None, "time", captions.time_text(self.profile.get(u.module))))
        return stats

    def _ghosts(self) -> list[str]:
        """Pruned (backward) and skipped (JVP) work per module, as dashed boxes beside its
        first box (in a fold: the template's)."""
        words: list[str] = []
        first: dict[str, str] = {}
        for u in self.drawn:
            first.setdefault(u.module, u.id)
        for gm, word, show in (
            (self.a.backward, "pruned", self.show_b),
            (self.a.jvp, "skipped", self.show_j),
        ):
            if gm is None or not show:
                continue
            for (m, role), flops in facts.ghost_flops(gm).items():
                if flops <= 0 or m not in first:
                    continue
                if word not in words:
                    words.append(word)
                gid = f"ghost_{word}_{sanitize_name(m) or 'model'}_{role}"
                text = f"{word}: {human(flops)} FLOPs\n{role} of {m or '(model)'}"
                self.cv.add(Box(gid, "ghost_note", text, module=self.cluster_of[m], role=role))
                self.cv.edge(Edge(first[m], gid, "ghost_link"))
        return words

    # data flow -------------------------------------------------------------------------------
    def _inputs(self) -> None:
        fwd = self.a.forward
        sig = fwd.meta.get(SIGNATURE)
        inputs = set(sig.inputs) if sig else set()
        for n in fwd.graph.nodes:
            if n.op == "placeholder" and n.name in inputs:
                iid = f"in_{sanitize_name(n.name)}"
                v = n.meta.get("val")
                text = f"input {n.name}\n{facts.shape_of(v)} · {human_bytes(facts.bytes_of(v))}"
                self.cv.add(Box(iid, "input", text))

    def _end(self, node: str) -> tuple[str, str] | None:
        """A forward node's drawn box id and module (None: not drawn)."""
        u = self.unit_of[node]
        rep = self._rep(u)
        if id(rep) not in self.drawn_ids:
            return None
        return rep.id, u.module

    def _across(self, src: str, dst: str) -> bool:
        """Modules ``src`` and ``dst`` lie in two members of one fold."""
        for f in self.folds:
            i, j = f.member_of(src), f.member_of(dst)
            if i is not None and j is not None and i != j:
                return True
        return False

    def _flows(self) -> None:
        """Forward data flow between boxes: width and label by the largest value carried.
        Flows between two members of one fold (block k's output into block k+1) are not drawn:
        the fold's "× N" says it."""
        flows: dict[tuple[str, str], int] = {}
        inputs = facts.model_inputs(self.a.forward)
        for n in self.a.forward.graph.nodes:
            if n.op != "call_function":
                continue
            dst = self._end(n.name)
            if dst is None:
                continue
            for v in n.all_input_nodes:
                if v.op == "placeholder":
                    if v.name not in inputs:
                        continue
                    src: tuple[str, str] | None = (f"in_{sanitize_name(v.name)}", "")
                else:
                    src = self._end(v.name)
                if src is None or src[0] == dst[0]:
                    continue
                if self._across(src[1], dst[1]):
                    continue
                key = (src[0], dst[0])
                flows[key] = max(flows.get(key, 0), facts.bytes_of(v.meta.get("val")))
        cluster_of_id = {u.id: self.cluster_of[u.module] for u in self.drawn}
        big = max(flows.values(), default=0)
        for (src_id, dst_id), nbytes in flows.items():
            row = cluster_of_id.get(src_id)
            self.cv.edge(
                Edge(
                    src_id,
                    dst_id,
                    width=1 + 2 * (nbytes / big if big else 0),
                    label=human_bytes(nbytes) if big and nbytes >= big / 4 else None,
                    reverse=self.graph == "backward",
                    # in a row: the order comes from the chain of invisible edges
                    free=bool(row and row in self.cv.rows and cluster_of_id.get(dst_id) == row),
                    bytes=nbytes,
                )
            )


def _prefixes(path: str) -> list[str]:
    """``a.b.c`` → ``["a", "a.b"]`` (proper prefixes; none for ``""`` and ``loss``)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts))]
