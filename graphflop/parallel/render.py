"""A picture of one pipeline stage's forward graph on a plan: its modules in order, each with
its local FLOPs and the tensor-parallel collectives its values take part in, the stage's
data-parallel and pipeline collectives per step in the caption (Graphviz ``.dot``, ``.svg``,
``.png`` or ``.pdf``). Reads ``MODULE``."""

from __future__ import annotations

from collections import Counter

from graphflop.io import atomic_write
from graphflop.meta import MODULE

__all__ = ["RENDER_SUFFIXES", "render_stage"]

RENDER_SUFFIXES = (".dot", ".svg", ".png", ".pdf")


def _group(module: str, blocks: list[str]) -> str:
    """A module path cut to one level below its block (``layers.0.attention``), or to its
    first component outside the blocks."""
    for b in blocks:
        if module == b or module.startswith(b + "."):
            rest = module[len(b) + 1 :].split(".")[0]
            return f"{b}.{rest}" if rest else b
    return module.split(".")[0] if module else "(model)"


def _si(n: float) -> str:
    for unit, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:g}"


def render_stage(report, path: str, stage: int = 0) -> None:
    """Draw ``stage``'s forward graph of ``report`` (a
    :class:`~graphflop.parallel.predict.PlanReport`) to ``path`` (suffix: one of
    :data:`RENDER_SUFFIXES`).

    Raises:
        ValueError: no such stage, or an unknown suffix.
    """
    import graphviz

    if report.detail is None or not 0 <= stage < len(report.ranks):
        raise ValueError(f"no stage {stage}: the plan has {len(report.ranks)}")
    suffix = path.rsplit(".", 1)[-1].lower()
    if f".{suffix}" not in RENDER_SUFFIXES:
        raise ValueError(f"render {path}: use one of {', '.join(RENDER_SUFFIXES)}")
    fwd, placements, stage_of = report.detail
    rank = report.ranks[stage]
    blocks = [b.split(" ×")[0] for b in rank.blocks]
    order: list[str] = []
    flops: Counter = Counter()
    colls: dict[str, Counter] = {}
    by_node = Counter((c.at, c.kind, c.elements, c.dtype) for c in placements.collectives)
    for n in fwd.graph.nodes:
        if n.op != "call_function" or stage_of.get(n.name, 0) != stage:
            continue
        g = _group(n.meta.get(MODULE) or "", blocks)
        if g not in flops:
            order.append(g)
        flops[g] += placements.cost[n.name].flops
        for (at, kind, el, dt), k in by_node.items():
            if at == n.name:
                colls.setdefault(g, Counter())[(kind, el, dt)] += k
    dot = graphviz.Digraph("stage", graph_attr={"rankdir": "TB", "fontsize": "10"})
    dot.attr("node", shape="box", style="rounded", fontsize="10")
    prev = None
    for i, g in enumerate(order):
        dot.node(f"m{i}", f"{g}\\n{_si(flops[g])} FLOPs (local, forward)")
        if prev is not None:
            dot.edge(prev, f"m{i}")
        for j, ((kind, el, dt), k) in enumerate(sorted(colls.get(g, {}).items())):
            cid = f"c{i}_{j}"
            label = f"{kind} ×{k}\\n{el:,} {dt} (tp {report.plan.tp})"
            dot.node(cid, label, shape="ellipse", color="firebrick", fontcolor="firebrick")
            dot.edge(f"m{i}", cid, style="dashed", color="firebrick", arrowhead="none")
        prev = f"m{i}"
    per_step = Counter((c.group, c.kind, c.phase) for c in rank.collectives if c.group != "tp")
    caption = [
        f"{report.model}: {rank.name}, dp {report.plan.dp} × tp {report.plan.tp} × pp "
        f"{report.plan.pp}, ZeRO {report.plan.zero}; forward of one micro-batch"
    ]
    caption += [f"{grp} {kind} ({ph}) ×{k} per step" for (grp, kind, ph), k in per_step.items()]
    dot.attr(label="\\l".join(caption) + "\\l", labelloc="t", fontsize="11")
    if suffix == "dot":
        atomic_write(path, dot.source)
    else:
        data = dot.pipe(format=suffix)
        atomic_write(path, data)
