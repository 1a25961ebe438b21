"""Figures of a forward graph composed from its hierarchy: each template's once, then per call.

A traced forward graph with outlined blocks carries a :class:`~graphflop.meta.Hierarchy` (the
top level's nodes, one template graph per distinct block, the call sites). Here each template
is costed once (:func:`annotate_templates`: ``COST`` on its nodes, by the same rule table as
:mod:`graphflop.passes.flops`), each *variant* (the nodes a call site kept) is rolled up once
(:class:`VariantFigures`: cost, per relative module, per op), and :func:`forward_figures` adds
the top level's nodes and, per call site, its variant's figures under the site's module paths.

The composed figures equal those the flat graph's nodes sum to: the totals, each module's row
(forward FLOPs, the last output's shape and bytes), and each op's count and cost, in the order
the flat graph first meets them (``tests/test_hierarchy.py`` checks it on the zoo).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from graphflop.frontend import outline  # noqa: F401  (defines graphflop::repeat)
from graphflop.meta import COST, HIERARCHY, MODULE, ROLE, ZERO_COST, Hierarchy, NodeCost
from graphflop.ops import has_rule, op_name
from graphflop.ops.cost import tensor_bytes
from graphflop.passes.flops import annotate_templates, sum_costs

__all__ = [
    "ForwardFigures",
    "VariantFigures",
    "compose",
    "forward_figures",
    "hierarchy_of",
]


def hierarchy_of(gm: GraphModule) -> Hierarchy | None:
    """The hierarchy of a traced forward graph, or None (no outlined block)."""
    return gm.meta.get(HIERARCHY)


@dataclass
class _Row:
    """One module's forward counters."""

    flops: int = 0
    mm_flops: int = 0
    output_shape: list[int] | None = None
    output_bytes: int = 0
    has_output: bool = False


@dataclass
class VariantFigures:
    """A variant's figures, relative to its call site.

    Attributes:
        total: the summed cost of its nodes.
        rows: per relative module path (``@``, ``@.attn``), in the order its nodes first meet
            them, the forward counters.
        ops: per op name, in the order first met, ``(count, costs summed)``.
        rule_less: its nodes whose op has no rule.
    """

    total: NodeCost
    rows: dict[str, _Row]
    ops: dict[str, tuple[int, NodeCost]]
    rule_less: int


def _variant(h: Hierarchy, v: int) -> VariantFigures:
    t, items = h.variants[v]
    nodes = list(h.templates[t].nodes)
    rows: dict[str, _Row] = {}
    ops: dict[str, list[NodeCost]] = {}
    costs: list[NodeCost] = []
    rule_less = 0
    for index, out in items:
        n = nodes[index]
        row = rows.setdefault(n.meta[MODULE], _Row())
        val = n.meta.get("val")
        if out is not None:  # a getitem tracing added afterwards: no cost
            val = val[out] if isinstance(val, (tuple, list)) else None
            c = ZERO_COST
        else:
            c = n.meta[COST]
            if n.target is not operator.getitem:
                ops.setdefault(op_name(n.target), []).append(c)
                rule_less += not has_rule(n.target)
        costs.append(c)
        row.flops += c.flops
        row.mm_flops += c.mm_flops
        if isinstance(val, torch.Tensor):
            row.output_shape = list(val.shape)
            row.output_bytes = tensor_bytes(val)
            row.has_output = True
    return VariantFigures(
        total=sum_costs(costs),
        rows=rows,
        ops={k: (len(cs), sum_costs(cs)) for k, cs in ops.items()},
        rule_less=rule_less,
    )


@dataclass
class ForwardFigures:
    """A forward graph's figures composed from its hierarchy.

    Attributes:
        total: every node's cost summed (the forward's totals, loss included).
        loss: the loss nodes' cost summed.
        rows: per module path, in the order the flat graph first meets it, its counters.
        ops: per op name, in the order first met, ``(count, costs summed)``.
        rule_less: nodes whose op has no rule.
        in_order: each row's output is its module's last node's in the flat graph (the
            calls' nodes are each one run of it: :attr:`~graphflop.meta.Hierarchy.runs`;
            else a top-level node among a call's nodes was met after the call).
    """

    total: NodeCost
    loss: NodeCost
    rows: dict[str, _Row] = field(default_factory=dict)
    ops: dict[str, tuple[int, NodeCost]] = field(default_factory=dict)
    rule_less: int = 0
    in_order: bool = True


def forward_figures(gm: GraphModule, h: Hierarchy) -> ForwardFigures:
    """The totals, per-module rows and per-op table of ``gm``'s forward nodes, each template's
    nodes rolled up once (see the module docstring). ``gm`` must have been through
    ``annotate_flops``."""
    annotate_templates(h)
    figures: dict[int, VariantFigures] = {}
    rows: dict[str, _Row] = {}
    ops: dict[str, list] = {}
    totals: list[NodeCost] = []
    loss: list[NodeCost] = []
    rule_less = 0
    for x in h.top:
        if isinstance(x, int):
            site = h.sites[x]
            f = figures.get(site.variant)
            if f is None:
                f = figures[site.variant] = _variant(h, site.variant)
            totals.append(f.total)
            rule_less += f.rule_less
            paths = dict(site.modules)  # (site.module(rel), the pairs read once per call)
            for rel, r in f.rows.items():
                row = rows.get(paths[rel])
                if row is None:
                    row = rows[paths[rel]] = _Row()
                row.flops += r.flops
                row.mm_flops += r.mm_flops
                if r.has_output:
                    row.output_shape, row.output_bytes = r.output_shape, r.output_bytes
                    row.has_output = True
            for op, (count, cost) in f.ops.items():
                acc = ops.setdefault(op, [0, []])
                acc[0] += count
                acc[1].append(cost)
            continue
        n = x
        if n.op != "call_function":
            continue
        c = n.meta[COST]
        totals.append(c)
        if n.meta.get(ROLE) == "loss":
            loss.append(c)
        row = rows.setdefault(n.meta.get(MODULE, ""), _Row())
        row.flops += c.flops
        row.mm_flops += c.mm_flops
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            row.output_shape, row.output_bytes = list(v.shape), tensor_bytes(v)
            row.has_output = True
        if n.target is not operator.getitem:
            acc = ops.setdefault(op_name(n.target), [0, []])
            acc[0] += 1
            acc[1].append(c)
            rule_less += not has_rule(n.target)
    if not h.runs:
        ops, rows = _in_flat_order(gm, ops, rows)
    return ForwardFigures(
        total=sum_costs(totals),
        loss=sum_costs(loss),
        rows=rows,
        ops={k: (count, sum_costs(cs)) for k, (count, cs) in ops.items()},
        rule_less=rule_less,
        in_order=h.runs,
    )


def _in_flat_order(gm: GraphModule, ops: dict, rows: dict) -> tuple[dict, dict]:
    """``ops`` and ``rows`` reordered as the flat graph ``gm`` first meets each op and module
    path: where a call's nodes are not one run (:attr:`Hierarchy.runs`), a top-level node among
    them comes after the call in the composed order, not where it stands."""
    op_order: dict[str, int] = {}
    row_order: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        row_order.setdefault(n.meta.get(MODULE, ""), len(row_order))
        if n.target is not operator.getitem:
            op_order.setdefault(op_name(n.target), len(op_order))
    return (
        {k: ops[k] for k in sorted(ops, key=op_order.__getitem__)},
        {k: rows[k] for k in sorted(rows, key=row_order.__getitem__)},
    )


def compose(
    source: Hierarchy | GraphModule, value: Callable[[Node], float], *, by_module: bool = False
) -> float | dict[str, float]:
    """``value(node)`` summed over every node of the flat forward graph, computed on the
    hierarchy: each variant's template nodes once, times its calls, plus the top level's
    nodes, its placeholders and output included (the call nodes of :attr:`Hierarchy.graph`
    and their ``getitem`` nodes left out). ``value`` must depend only on the node and its
    arguments' metadata (a template node then has its copies' value). One kind of flat node
    has no node here and counts 0: a ``getitem`` tracing added inside a call for an output
    nothing reads (eval batch norm's saved statistics; ``(index, i)`` in
    :attr:`Hierarchy.variants`), whose cost is 0. Given a flat graph instead, the plain sum
    over its nodes: what
    :meth:`graphflop.analysis.Analysis.compose` does for a model without outlined blocks,
    where :meth:`~graphflop.analysis.Analysis.run_pass` runs a pass on the flat forward graph.

    Args:
        source: the forward graph's hierarchy (needs :attr:`Hierarchy.graph`), or a flat graph
            (``Analysis.forward``: every node of it; its hierarchy, if any, is not used).
        value: a number per node (a node of the top level or of a template).
        by_module: return ``{module path: sum}`` instead, in the order the flat graph first
            meets each module (template nodes under their call site's paths).

    Raises:
        TypeError: ``source`` is neither (``None``: the analysis outlined no block, its
            ``hierarchy`` is None; use ``Analysis.compose`` or pass ``Analysis.forward``).
        ValueError: ``source`` is a hierarchy with no top-level graph.
    """
    if isinstance(source, GraphModule):
        return _flat_sum(source, value, by_module)
    if not isinstance(source, Hierarchy):
        raise TypeError(
            f"compose takes a Hierarchy or a flat graph, not {type(source).__name__}"
            + (
                ": the analysis outlined no repeated block (Analysis.hierarchy is None); use "
                "Analysis.compose(value), or pass the flat graph Analysis.forward"
                if source is None
                else ""
            )
        )
    h = source
    if h.graph is None:
        raise ValueError("this hierarchy has no top-level graph (a call's nodes are not one run)")
    call_op = torch.ops.graphflop.repeat.default
    per_variant: dict[int, dict[str, float]] = {}
    out: dict[str, float] = {}
    for n in h.graph.graph.nodes:
        if n.target is call_op:
            site = h.sites[n.args[1]]
            sums = per_variant.get(site.variant)
            if sums is None:
                t, items = h.variants[site.variant]
                tnodes = list(h.templates[t].nodes)
                sums = per_variant[site.variant] = {}
                for index, part in items:
                    x = tnodes[index]
                    rel = x.meta[MODULE]
                    sums[rel] = sums.get(rel, 0) + (value(x) if part is None else 0)
            for rel, v in sums.items():
                path = site.module(rel)
                out[path] = out.get(path, 0) + v
        elif n.target is operator.getitem and getattr(n.args[0], "target", None) is call_op:
            continue  # a call's value: computed inside the template
        else:
            path = n.meta.get(MODULE, "")
            out[path] = out.get(path, 0) + value(n)
    return out if by_module else sum(out.values())


def _flat_sum(
    gm: GraphModule, value: Callable[[Node], float], by_module: bool
) -> float | dict[str, float]:
    """``value`` summed over every node of the flat graph ``gm`` (per module path with
    ``by_module``, in the order the graph first meets each)."""
    out: dict[str, float] = {}
    for n in gm.graph.nodes:
        path = n.meta.get(MODULE, "")
        out[path] = out.get(path, 0) + value(n)
    return out if by_module else sum(out.values())
