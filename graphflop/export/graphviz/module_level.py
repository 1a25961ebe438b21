"""Module level: one box per ``nn.Module`` path, built into a :class:`~.scene.Scene`.

Each box lists its module's forward, backward (input / weight), update and JVP FLOPs, ratios,
bytes saved for backward and measured time, filled by FLOPs; boxes nest in clusters along the
path; edges follow the forward data flow; pruned and skipped work are dashed boxes beside their
module. With more than :data:`ROW_LAYOUT_MIN_BOXES` boxes, the boxes directly inside one parent
cluster are laid out in one row.

Reads: the report's layer rows (:func:`.facts.layer_rows`) and, through :mod:`.facts`,
``val``, ``MODULE``, ``RESIDUAL``, ``GHOSTS``, ``SIGNATURE`` and ``nn_module_stack``.
"""

from __future__ import annotations

from typing import Any

from graphflop.export.graphviz import captions, facts
from graphflop.export.graphviz.palette import RESIDUAL_COLOUR, ROLE_COLOURS, FlopScale
from graphflop.export.graphviz.scene import Box, Canvas, Edge, LegendItem, Scene, Stat, StatCard
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


def module_scene(a: Any, graph: str, profile: dict[str, float], clusters: bool = True) -> Scene:
    """The module-level picture ``graph`` of analysis ``a``.

    Args:
        a: the analysis (only read).
        graph: one of ``forward``, ``backward``, ``jvp``, ``train``, ``all``.
        profile: measured seconds per module path (``""``: the model's own ops).
        clusters: module clusters; without, each box is named by its whole path.
    """
    return _ModuleScene(a, graph, profile, clusters).build()


def box_id(path: str) -> str:
    """The drawn id of module ``path``'s box (``m_model`` for the model's own ops)."""
    return f"m_{sanitize_name(path) or 'model'}"


def _prefixes(path: str) -> list[str]:
    """``a.b.c`` → ``["a", "a.b"]`` (proper prefixes; none for ``""`` and ``loss``)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _ratio(r: float | None) -> str:
    return "–" if r is None else f"{r:.2f}"


class _ModuleScene:
    def __init__(self, a: Any, graph: str, profile: dict[str, float], clusters: bool):
        self.a = a
        self.graph = graph
        self.profile = profile
        self.clusters = clusters
        self.cv = Canvas()
        self.show_b = graph in ("backward", "train", "all")
        self.show_u = graph in ("train", "all")
        self.show_j = graph in ("jvp", "all")
        self.layers = facts.layer_rows(a)
        # modules with nodes in the forward graph, in forward order, then any other with
        # parameters or FLOPs
        self.order = facts.forward_modules(a)
        for m, row in self.layers.items():
            if m not in self.order and (row.params or self._flops(row)):
                self.order.append(m)
        # modules with ops of their own and child modules (a residual block's ``add``)
        self.parents = {p for m in self.order for p in _prefixes(m) if p in self.order}
        self.cluster_of = {m: m if m in self.parents else m.rpartition(".")[0] for m in self.order}
        self.cluster_of[""] = self.cluster_of["loss"] = ""
        self.ids = {m: box_id(m) for m in self.order}

    def _flops(self, row: LayerRow) -> int:
        return facts.picture_flops(row, self.graph)

    def build(self) -> Scene:
        types = facts.module_types(self.a.forward)
        scale = FlopScale([self._flops(self.layers[m]) for m in self.order if m in self.layers])
        self._boxes(types, scale)
        words = self._ghosts()
        self._inputs()
        self._flows()
        rows = [
            c for c in dict.fromkeys(self.cluster_of[m] for m in self.order) if c in self.cv.rows
        ]
        for row in rows:  # keep each row in forward order
            members = [self.ids[m] for m in self.order if self.cluster_of[m] == row]
            for x, y in zip(members, members[1:]):
                self.cv.edge(Edge(x, y, "order"))
        for path in self.cv.paths() + list(self.parents):
            label = path
            if path in types and path not in ("", "loss"):
                label = f"{path} · {types[path]}"
            self.cv.cluster_label[path] = label
        legend = captions.legend(scale, WHAT[self.graph], self._roles(), self._legend_items(words))
        return self.cv.scene(captions.title(self.a, self.graph, "module"), legend, self.clusters)

    def _roles(self) -> list[str]:
        roles = ["forward"]
        if self.show_b:
            roles += ["grad_input", "grad_weight"]
        if self.show_u:
            roles.append("update")
        if self.show_j:
            roles += ["tangent_from_input", "tangent_from_param"]
        return roles

    def _legend_items(self, words: list[str]) -> list[LegendItem]:
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
        items = captions.legend_items(words, False, False)
        return items + [LegendItem("box rows: " + ", ".join(rows))]

    # boxes -----------------------------------------------------------------------------------
    def _boxes(self, types: dict[str, str], scale: FlopScale) -> None:
        saved = facts.saved_bytes(self.a)
        own = self._own_ops()
        row_layout = len(self.order) > ROW_LAYOUT_MIN_BOXES
        for m in self.order:
            row = self.layers.get(m) or LayerRow(m or "(model)")
            box = self._box(m, row, types, saved.get(m, 0), scale, own.get(m))
            self.cv.add(box)
            if row_layout and self.cluster_of[m]:
                self.cv.rows.add(self.cluster_of[m])

    def _own_ops(self) -> dict[str, str]:
        """Parent module → its own ops, named ("add", at most three), for its box's title."""
        ops = facts.own_ops(self.a, self.parents)
        text = {
            m: ", ".join(v[:3]) + (", …" if len(v) > 3 else "") or "own ops" for m, v in ops.items()
        }
        return text | {m: "own ops" for m in self.parents if m not in ops}

    def _box(
        self,
        m: str,
        row: LayerRow,
        types: dict[str, str],
        saved: int,
        scale: FlopScale,
        own_ops: str | None,
    ) -> Box:
        short = m.rpartition(".")[2] if m not in ("", "loss") else (m or "(model)")
        if not self.clusters:
            short = m or "(model)"
        if own_ops:
            short = f"{m} ({own_ops})"
        typ = types.get(m, "") if m not in ("", "loss") and not own_ops else ""
        fill = scale.colour(self._flops(row))
        label = StatCard(short, typ, fill, tuple(self._stats(m, row, saved)))
        tip = (
            f"{m or '(model)'}: forward {row.forward_flops} FLOPs, backward "
            f"{row.backward_flops}, update {row.update_flops}, jvp "
            f"{row.jvp_flops}, saved {saved} B"
        )
        return Box(self.ids[m], "module", label, module=self.cluster_of[m], tooltip=tip)

    def _stats(self, m: str, row: LayerRow, saved: int) -> list[Stat]:
        stats = [Stat(ROLE_COLOURS["forward"], "fwd", human(row.forward_flops))]
        if self.show_b:
            stats.append(
                Stat(ROLE_COLOURS["grad_input"], "bwd∂x", human(facts.grad_input_flops(row)))
            )
            stats.append(Stat(ROLE_COLOURS["grad_weight"], "bwd∂W", human(row.grad_weight_flops)))
        if self.show_u:
            stats.append(Stat(ROLE_COLOURS["update"], "upd", human(row.update_flops)))
        if self.show_b:
            r = row.ratio if self.show_u else row.ratio_no_update
            stats.append(Stat(None, "ratio", _ratio(r)))
            stats.append(Stat(RESIDUAL_COLOUR, "saved", human_bytes(saved)))
        if self.show_j:
            jvp = human(row.jvp_flops)
            stats.append(Stat(ROLE_COLOURS["tangent_from_param"], "jvp", jvp))
            stats.append(Stat(None, "jvp/fwd", _ratio(row.jvp_ratio)))
        if self.graph == "forward":
            stats.append(Stat(None, "share", f"{100 * row.share:.1f}%"))
        if self.profile:
            stats.append(Stat(None, "time", captions.time_text(self.profile.get(m))))
        return stats

    def _ghosts(self) -> list[str]:
        """Pruned (backward) and skipped (JVP) work per module, as dashed boxes beside it."""
        words = []
        for gm, word, show in (
            (self.a.backward, "pruned", self.show_b),
            (self.a.jvp, "skipped", self.show_j),
        ):
            if gm is None or not show:
                continue
            for (m, role), flops in facts.ghost_flops(gm).items():
                if flops <= 0 or m not in self.ids:
                    continue
                if word not in words:
                    words.append(word)
                gid = f"ghost_{word}_{sanitize_name(m) or 'model'}_{role}"
                text = f"{word}: {human(flops)} FLOPs\n{role} of {m or '(model)'}"
                self.cv.add(Box(gid, "ghost_note", text, module=self.cluster_of[m], role=role))
                self.cv.edge(Edge(self.ids[m], gid, "ghost_link"))
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

    def _flows(self) -> None:
        """Forward data flow between boxes: width and label by the largest value carried."""
        flows: dict[tuple[str, str], int] = {}
        for (what, name), dst_module, nbytes in facts.forward_reads(self.a):
            src = f"in_{sanitize_name(name)}" if what == "input" else self.ids[name]
            dst = self.ids[dst_module]
            if src != dst:
                flows[(src, dst)] = max(flows.get((src, dst), 0), nbytes)
        cluster_of_id = {self.ids[m]: self.cluster_of[m] for m in self.order}
        big = max(flows.values(), default=0)
        for (src, dst), nbytes in flows.items():
            row = cluster_of_id.get(src)
            self.cv.edge(
                Edge(
                    src,
                    dst,
                    width=1 + 2 * (nbytes / big if big else 0),
                    label=human_bytes(nbytes) if big and nbytes >= big / 4 else None,
                    reverse=self.graph == "backward",
                    # in a row: the order comes from the chain of invisible edges
                    free=bool(row and row in self.cv.rows and cluster_of_id.get(dst) == row),
                    bytes=nbytes,
                )
            )
