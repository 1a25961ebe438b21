"""Op level: one box per graph node, built into a :class:`~.scene.Scene`.

Walks the forward, backward, update and JVP graphs (whichever the picture draws) and turns their
nodes into boxes and their reads into edges; ghosts (work not emitted) become dashed boxes. The
boxes, edges and assembly are in :mod:`.op_parts`; the drawing choices are listed in the
package docstring.

Reads: ``val``, ``KIND``, ``ROLE``, ``SOURCE``, ``MODULE``, ``COST``, ``PARAM``, ``RESIDUAL``,
PyTorch's ``nn_module_stack``; ``gm.meta`` keys ``SIGNATURE``, ``GHOSTS``, ``GHOST_LINKS``,
``UPDATE``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from graphflop.export.graphviz import facts
from graphflop.export.graphviz.errors import RenderError
from graphflop.export.graphviz.op_parts import OpParts
from graphflop.export.graphviz.palette import RESIDUAL_COLOUR, ROLE_COLOURS
from graphflop.export.graphviz.scene import Edge, Scene
from graphflop.io import sanitize_name
from graphflop.meta import (
    GHOST_LINKS,
    GHOSTS,
    KIND,
    MODULE,
    PARAM,
    RESIDUAL,
    SIGNATURE,
    SOURCE,
    UPDATE,
)

#: placeholder → (drawn id of the value it stands for, residual kind, bytes)
Residuals = dict[str, tuple[str, str, int]]


class _Signature(NamedTuple):
    """A graph's placeholders by what they are (placeholder → qualified name for the first two)."""

    params: dict[str, str]
    buffers: dict[str, str]
    inputs: set[str]
    targets: set[str]


def op_scene(
    a: Any,
    graph: str,
    profile: dict[str, float],
    collapse_loss: bool,
    aligned: bool = False,
    clusters: bool = True,
    module: str | None = None,
    align_tangents: bool = True,
    color: str = "flops",
) -> Scene:
    """The op-level picture ``graph`` of analysis ``a``.

    Args:
        a: the analysis (only read).
        graph: one of ``forward``, ``backward``, ``jvp``, ``train``, ``all``.
        profile: measured seconds per module path (shown in cluster labels).
        collapse_loss: draw each graph's loss ops as one box.
        aligned: (``train``/``all``) invisible edges pulling each forward op level with the
            largest backward and tangent node derived from it.
        clusters: module clusters; without, the module path goes into each op's label.
        module: draw only the nodes of this module path's subtree (``h.0``, ``layer3.1``);
            an edge crossing its border ends in a small box naming the module outside.
        align_tangents: with ``aligned``, pull the tangent nodes level with their forward
            ops too (else only the backward's).
        color: what fills the op boxes: ``flops`` or ``time`` (each node's predicted time,
            ``TIME``, written when the analysis had a time profile).

    Raises:
        RenderError: ``module`` has no ops in the forward graph.
    """
    check_module(a, module)
    s = _OpScene(a, graph, profile, collapse_loss, color)
    s.root = module
    return s.build(aligned, clusters, align_tangents)


def check_module(a: Any, module: str | None) -> None:
    """Raise :class:`RenderError` unless ``module`` (when given) has forward ops."""
    if module is None:
        return
    paths = facts.forward_modules(a)
    if not any(p == module or p.startswith(module + ".") for p in paths):
        raise RenderError(
            f"no module {module!r} with ops in the forward graph: {_near(paths, module)}"
        )


def _near(paths: list[str], module: str) -> str:
    """What the forward graph has nearest ``module``: the children of its longest prefix
    that has ops under it (``h`` for ``h.9``: ``h.0``, ..., ``h.5``), else the top-level
    modules; a long list shortened to its first and last few."""
    parts = module.split(".")
    for k in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:k])
        below = [p[len(parent) + 1 :] for p in paths if p.startswith(parent + ".")]
        children = list(dict.fromkeys(f"{parent}.{p.split('.')[0]}" for p in below))
        if children:
            return f"the modules under {parent!r} with ops are {_shortened(children)}"
        if parent in paths:
            return f"{parent!r} has no submodule with ops"
    tops = list(dict.fromkeys(p.split(".")[0] for p in paths if p and p != "loss"))
    return f"top-level modules are {_shortened(tops)}"


def _shortened(names: list[str], most: int = 12) -> str:
    """``names`` joined by commas; past ``most``, the first 8, an ellipsis, the last 2 and
    the count."""
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[:8])}, ..., {', '.join(names[-2:])} ({len(names)} in all)"


class _OpScene(OpParts):
    """The graph walks of one op-level picture."""

    def build(self, aligned: bool, clusters: bool, align_tangents: bool = True) -> Scene:
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
        return self.assemble(aligned, align_tangents)

    # forward ---------------------------------------------------------------------------------
    def forward(self, key: str = "f", gm=None) -> None:
        """The forward graph (or, with ``gm``, the JVP graph drawn whole)."""
        gm = gm or self.a.forward
        self.types.update(facts.module_types(gm))
        sig = gm.meta.get(SIGNATURE)
        names = _Signature(
            dict(sig.params) if sig else {},
            dict(sig.buffers) if sig else {},
            set(sig.inputs) if sig else set(),
            set(sig.targets) if sig else set(),
        )
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                self._forward_placeholder(key, n, names)
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
                        facts.bytes_of(u.meta.get("val")),
                    )

    def _forward_placeholder(self, key: str, n, sig: _Signature) -> None:
        """Parameters, buffers, targets and inputs; scalar hyper-parameters are left out."""
        if n.meta.get(KIND) == "tangent":
            self.tangent_placeholder(key, n)
        elif n.name in sig.params:
            q = sig.params[n.name]
            self.small_node(key, n, q.rpartition(".")[0], q)
        elif n.name in sig.buffers:
            q = sig.buffers[n.name]
            self.small_node(key, n, q.rpartition(".")[0], f"buffer {q}")
        elif n.name in sig.targets:
            self.small_node(key, n, "loss", f"target {n.name}", shape="ellipse")
        elif n.name in sig.inputs or facts.numel(n.meta.get("val")) > 1:
            self.small_node(key, n, "", f"input {n.name}", shape="ellipse")

    # backward --------------------------------------------------------------------------------
    def backward(self, key: str = "b") -> None:
        """The backward graph; in the combined pictures its residuals are edges from the
        forward values, else small "saved" boxes."""
        gm = self.a.backward
        residual: Residuals = {}
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                self._backward_placeholder(key, n, residual)
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
                    nbytes = facts.bytes_of(u.meta.get("val"))
                    self.data_edge(self.ids[(key, u.name)], me, nbytes, backward=True)
        self.ghosts(key, gm, "pruned", residual)

    def _backward_placeholder(self, key: str, n, residual: Residuals) -> None:
        kind = n.meta.get(RESIDUAL)
        src = n.meta.get(SOURCE, n.name)
        nbytes = facts.bytes_of(n.meta.get("val"))
        if kind is None:  # the loss cotangent
            nid = self.small_node(key, n, "loss", "∂loss = 1 (seed)", colour=ROLE_COLOURS["loss"])
            sig = self.a.forward.meta.get(SIGNATURE)
            if self.combined and sig is not None and sig.loss and ("f", sig.loss) in self.ids:
                loss = self.ids[("f", sig.loss)]
                self.cv.edge(Edge(loss, nid, "seed", colour=ROLE_COLOURS["loss"]))
            return
        if self.combined and ("f", src) in self.ids:
            residual[n.name] = (self.ids[("f", src)], kind, nbytes)
            return
        module = n.meta.get(MODULE, "")
        if n.meta.get(PARAM):
            module = n.meta[PARAM].rpartition(".")[0]
            rid = self.small_node(key, n, module, f"param {n.meta[PARAM]}")
        else:
            rid = self.small_node(key, n, module, f"saved {src}", colour=RESIDUAL_COLOUR, bold=True)
        residual[n.name] = (rid, kind, nbytes)
        self.ids.pop((key, n.name))

    # ghosts ----------------------------------------------------------------------------------
    def ghosts(self, key: str, gm, word: str, residual: Residuals | None = None) -> None:
        """Ghost boxes (``word``: pruned, skipped) with dashed edges from what they would have
        read and, in the JVP, to the tangent sum they were dropped from."""
        records = list(gm.meta.get(GHOSTS, []))
        if not records:
            return
        self.ghost_words.append(word)
        for g in records:
            self.ghost_node(key, g, word)
        names = {g.name for g in records}
        zero_ids: dict[str, str] = {}
        for g in records:
            me = self.ids[(key, g.name)]
            for name in g.inputs:
                self._ghost_input(key, gm, g, me, name, names, residual, zero_ids)
            if g.source and self.combined and ("f", g.source) in self.ids:
                # in the combined pictures: link the ghost to the forward node it came from
                self.cv.edge(Edge(self.ids[("f", g.source)], me, "ghost_source", loose=True))
        self._dropped_from_sums(key, gm)

    def _ghost_input(
        self,
        key: str,
        gm,
        g,
        me: str,
        name: str,
        names: set[str],
        residual: Residuals | None,
        zero_ids: dict[str, str],
    ) -> None:
        backward = key == "b"
        if residual and name in residual:
            loose = self.reversed_backward and backward
            self.cv.edge(Edge(residual[name][0], me, "ghost_input", loose=loose))
        elif name in names or (key, name) in self.ids:
            self.data_edge(self.ids[(key, name)], me, 0, backward=backward, style="ghost_input")
        elif backward:  # an unrecorded ghost: the cotangent that reached g's source
            ct = facts.incoming_cotangent(gm, g.source)
            if ct is not None and (key, ct) in self.ids:
                self.data_edge(self.ids[(key, ct)], me, 0, backward=True, style="ghost_input")
        else:  # an unrecorded ghost in the JVP: a tangent that is zero
            if name not in zero_ids:
                zero_ids[name] = self.zero_node(key, g.module, f"{key}_{name}")
            self.cv.edge(Edge(zero_ids[name], me, "ghost_input"))

    def _dropped_from_sums(self, key: str, gm) -> None:
        nodes = {n.name for n in gm.graph.nodes}
        for real, gs in (gm.meta.get(GHOST_LINKS) or {}).items():
            rname = getattr(real, "name", None)
            if rname is None or (key, rname) not in self.ids or rname not in nodes:
                continue
            for gv in gs:
                gname = getattr(gv, "name", None)
                if gname is not None and (key, gname) in self.ids:
                    self.cv.edge(
                        Edge(
                            self.ids[(key, gname)],
                            self.ids[(key, rname)],
                            "dropped",
                            label="dropped from sum",
                        )
                    )

    # update ----------------------------------------------------------------------------------
    def update(self, key: str = "u") -> None:
        """The optimizer update: reads each parameter (dotted), its gradient and its state."""
        gm = self.a.update
        src = self._update_sources(key, gm)
        for n in gm.graph.nodes:
            if n.op == "call_function":
                self.op_node(key, n)
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            me = self.ids[(key, n.name)]
            for u in n.all_input_nodes:
                nbytes = facts.bytes_of(u.meta.get("val"))
                if u.name not in src:
                    if (key, u.name) in self.ids:
                        self.data_edge(self.ids[(key, u.name)], me, nbytes)
                    continue
                sid, kind = src[u.name]
                if kind == "param":
                    self.cv.edge(Edge(sid, me, "read", loose=True))
                else:
                    colour = ROLE_COLOURS["update"] if kind == "grad" else None
                    self.data_edge(sid, me, nbytes, colour=colour)

    def _update_sources(self, key: str, gm) -> dict[str, tuple[str, str]]:
        """Update placeholder → (drawn id, kind): its state (a new box), the forward's
        parameter, the backward's gradient, or another new box; scalars left out."""
        info = gm.meta.get(UPDATE)
        grads_of = {
            q: self.ids[("b", name)]
            for q, name in facts.param_gradients(self.a).items()
            if ("b", name) in self.ids
        }
        sig = self.a.forward.meta.get(SIGNATURE)
        fparams = (
            {q: self.ids[("f", p)] for p, q in sig.params if ("f", p) in self.ids}
            if sig is not None
            else {}
        )
        n_params = len(info.params) if info is not None else 0
        states = set(info.state_names) if info is not None else set()
        scalars = set(info.scalars) if info is not None else set()
        src: dict[str, tuple[str, str]] = {}
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, n in enumerate(phs):
            q = n.meta.get(PARAM)
            if n.name in scalars or q is None:
                continue
            module = q.rpartition(".")[0]
            if n.name in states:
                state = n.name.removesuffix("_" + sanitize_name(q))
                text = f"{state} of {q}"
                src[n.name] = (
                    self.small_node(key, n, module, text, colour=ROLE_COLOURS["update"]),
                    "state",
                )
            elif i < n_params and fparams.get(q):
                src[n.name] = (fparams[q], "param")
            elif i >= n_params and grads_of.get(q):
                src[n.name] = (grads_of[q], "grad")
            else:
                src[n.name] = (self.small_node(key, n, module, n.name), "other")
        return src

    # JVP -------------------------------------------------------------------------------------
    def jvp(self, key: str = "j", share_primal: bool = False) -> None:
        """The JVP graph: whole, or (``share_primal``) only its tangent nodes, reading the
        forward's boxes for its primal values."""
        gm = self.a.jvp
        self.types.update(facts.module_types(gm))
        if not share_primal:
            self.forward(key, gm)
            self.ghosts(key, gm, "skipped")
            return
        for n in gm.graph.nodes:
            self._shared_jvp_node(key, n)
        for n in gm.graph.nodes:
            if n.op != "call_function" or self.ids[(key, n.name)].startswith("f_"):
                continue
            me = self.ids[(key, n.name)]
            for u in n.all_input_nodes:
                if (key, u.name) not in self.ids:
                    continue
                sid = self.ids[(key, u.name)]
                if sid.startswith("f_"):  # a primal read: the forward value itself
                    self.cv.edge(Edge(sid, me, "read", loose=True))
                else:
                    self.data_edge(sid, me, facts.bytes_of(u.meta.get("val")))
        self.ghosts(key, gm, "skipped")

    def _shared_jvp_node(self, key: str, n) -> None:
        if n.op == "placeholder":
            if n.meta.get(KIND) == "tangent":
                self.tangent_placeholder(key, n)
            elif ("f", n.name) in self.ids:
                self.ids[(key, n.name)] = self.ids[("f", n.name)]
        elif n.op == "call_function":
            src = n.meta.get(SOURCE, n.name)
            if n.meta.get(KIND) == "primal" and ("f", src) in self.ids:
                self.ids[(key, n.name)] = self.ids[("f", src)]
            else:
                self.op_node(key, n)
