"""The module level's structure: which boxes to draw and which module calls are repeats.

Boxes (:class:`Unit`)
    One per stretch of a module's own forward ops: a module whose ops resume after another
    module's ops (GPT-2's model-level ``add`` of the embeddings and, much later, its output head;
    a block's two residual ``add``; a ReLU module called three times in a ResNet bottleneck) gets
    one box per stretch, so the boxes form a chain in forward order instead of a cycle. A stretch
    that reads no call node's value and does no FLOPs (an ``arange`` of positions) is not drawn.

Folds (:class:`Folded`)
    Sibling modules called one after the other whose forward ops are identical (the same
    sequence of op, output shape and dtype, module path relative to the sibling, and the same
    wiring: which earlier op of the sibling, or which outside value of which shape, each op
    reads) are one fold, drawn once with its multiplicity; a fold's first member is its template.
    Repeats nest: inside each member of a fold, runs of identical numbered siblings each reading
    the one before (the inner blocks of repeated outer blocks, ``stages.0.inner.0`` …
    ``stages.0.inner.3``) are folds too; a block's identical ``q``, ``k`` and ``v`` are not.
    Blocks the tracer's outliner (``graphflop.frontend.outline``) traced once are
    taken from the forward graph's hierarchy (sibling calls of one template that kept the same
    nodes); the op-by-op test folds the modules the outliner keeps apart (batch norm in
    training mode, which writes its statistics).

Reads ``MODULE``, ``COST`` and ``val`` of the forward graph's call nodes.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from graphflop.export.graphviz import facts
from graphflop.io import sanitize_name
from graphflop.meta import COST, HIERARCHY, MODULE, ZERO_COST


@dataclass
class Unit:
    """One module-level box: stretch ``seg`` (0, 1, ...) of module ``module``'s own forward ops
    (``nodes``, forward call node names in order)."""

    module: str
    seg: int
    nodes: list[str] = field(default_factory=list)
    drawn: bool = True

    @property
    def id(self) -> str:
        base = f"m_{sanitize_name(self.module) or 'model'}"
        return base if self.seg == 0 else f"{base}__{self.seg + 1}"


@dataclass(frozen=True)
class Folded:
    """Repeated sibling modules: ``members`` (module paths, in call order), ``members[0]`` drawn."""

    members: tuple[str, ...]

    @property
    def template(self) -> str:
        return self.members[0]

    @property
    def count(self) -> int:
        return len(self.members)

    def member_of(self, path: str) -> int | None:
        """Index of the member whose subtree holds ``path`` (None: outside the fold)."""
        for i, m in enumerate(self.members):
            if path == m or path.startswith(m + "."):
                return i
        return None

    def to_template(self, path: str) -> str:
        """``path`` inside a member, moved into the template (``h.7.attn`` → ``h.0.attn``)."""
        i = self.member_of(path)
        if i is None:
            return path
        return self.template + path[len(self.members[i]) :]


def _calls(gm: Any) -> list[Any]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def units(gm: Any, split_leaves: bool = True) -> tuple[list[Unit], dict[str, Unit]]:
    """The boxes of forward graph ``gm`` in forward order, and call node name → its box.
    ``split_leaves`` false: a module without submodules keeps one box however often it is
    called (for row layouts, where each row is laid out by order, not by data flow)."""
    paths = {n.meta.get(MODULE, "") for n in _calls(gm)}
    parents = {p for m in paths for p in paths if m.startswith(p + ".") or (p == "" and m)}
    out: list[Unit] = []
    of: dict[str, Unit] = {}
    current: dict[str, Unit] = {}
    count: dict[str, int] = defaultdict(int)
    prev = None
    for n in _calls(gm):
        m = n.meta.get(MODULE, "")
        if prev != m and (m not in current or split_leaves or m in parents):  # a new stretch
            current[m] = Unit(m, count[m])
            count[m] += 1
            out.append(current[m])
        current[m].nodes.append(n.name)
        of[n.name] = current[m]
        prev = m
    nodes = {n.name: n for n in _calls(gm)}
    for u in out:
        reads_call = any(
            v.op == "call_function" and of.get(v.name) is not u
            for name in u.nodes
            for v in nodes[name].all_input_nodes
        )
        flops = sum(nodes[name].meta.get(COST, ZERO_COST).flops for name in u.nodes)
        if count[u.module] > 1 and not reads_call and flops == 0:
            u.drawn = False
    return out, of


def _signature(gm: Any, path: str, nodes: list[Any]) -> tuple:
    """What the ops of module ``path``'s subtree compute: per op, its module relative to
    ``path``, target, output shape and dtype, and what it reads."""
    index = {n.name: i for i, n in enumerate(nodes)}
    sig = []
    for n in nodes:
        m = n.meta.get(MODULE, "")
        rel = m[len(path) :]
        val = n.meta.get("val")
        reads = tuple(
            index[u.name] if u.name in index else ("out", facts.shape_of(u.meta.get("val")))
            for u in n.all_input_nodes
        )
        consts = tuple(a for a in n.args if isinstance(a, (int, float, bool, str, tuple, list)))
        sig.append(
            (rel, str(n.target), facts.shape_of(val), str(getattr(val, "dtype", "")), reads, consts)
        )
    return tuple(sig)


def _called_blocks(gm: Any) -> dict[str, tuple]:
    """Module path → ``("call", template, variant)`` for each block the forward graph's
    hierarchy (:data:`~graphflop.meta.HIERARCHY`) calls: calls of one template that kept the
    same nodes are repeats without comparing their ops."""
    h = gm.meta.get(HIERARCHY) if hasattr(gm, "meta") else None
    if h is None:
        return {}
    out = {}
    for site in h.sites:
        root = dict(site.modules).get("@")
        if root:
            out[root] = ("call", site.template, site.variant)
    return out


def folds(gm: Any) -> list[Folded]:
    """The runs of identical sibling modules in forward graph ``gm`` (see the module
    docstring), outer before inner, in forward order. Where the graph has a hierarchy, its calls
    of one template (and variant) are taken as repeats from it; the other modules are compared
    op by op. Inside each member of a fold, runs of identical numbered siblings each reading
    the one before (``inner.0``, ``inner.1``: a ``ModuleList``'s or ``Sequential``'s blocks)
    are folds of their own; a member's named siblings (``q``, ``k``, ``v``) and siblings
    apart (``l1``, then its parent's ReLU, then ``l2``) stay apart there."""
    subtree: dict[str, list[Any]] = defaultdict(list)
    children: dict[str, list[str]] = defaultdict(list)
    for n in _calls(gm):
        m = n.meta.get(MODULE, "")
        if not m or m == "loss":
            continue
        parts = m.split(".")
        for i in range(1, len(parts) + 1):
            p = ".".join(parts[:i])
            subtree[p].append(n)
            parent = ".".join(parts[: i - 1])
            if p not in children[parent]:
                children[parent].append(p)
    out: list[Folded] = []
    called = _called_blocks(gm)

    def walk(parent: str, nested: bool) -> None:
        kids = children.get(parent, [])

        def _reads(j: int) -> bool:
            """Sibling ``j`` reads a value of sibling ``j - 1``."""
            before = {n.name for n in subtree[kids[j - 1]]}
            return any(v.name in before for n in subtree[kids[j]] for v in n.all_input_nodes)

        # a call of the hierarchy's block is known by its template and variant; other
        # modules by their ops (the call's key never equals an ops signature)
        sigs: list[Any] = [called.get(k) or _signature(gm, k, subtree[k]) for k in kids]
        # inside a fold's member: numbered siblings of one name stem, each reading the one
        # before it (a ModuleList's blocks, not two linears around their parent's activation)
        if nested:
            stems = [re.fullmatch(r"(.*?)\d+", k.rpartition(".")[2]) for k in kids]
            sigs = [(s[1], g) if s else k for s, g, k in zip(stems, sigs, kids)]
        i = 0
        while i < len(kids):
            j = i + 1
            while j < len(kids) and sigs[j] == sigs[i] and (not nested or _reads(j)):
                j += 1
            if j - i >= 2:
                out.append(Folded(tuple(kids[i:j])))
            for k in kids[i:j]:  # repeats inside each member (inner blocks of outer blocks)
                walk(k, nested or j - i >= 2)
            i = j

    walk("", False)
    return out
