"""FLOP and byte pass: writes ``COST`` (:class:`~graphflop.meta.NodeCost`) on every node.

Reads ``val`` (output FakeTensors) and the rule table. Placeholders, outputs and ``getitem``
cost nothing. A ``call_function`` node whose op has no rule costs 0 (the summary lists it as
uncounted); inside :func:`graphflop.ops.strict_rules` it raises
:class:`~graphflop.ops.MissingRuleError` naming the op, the node and the rule file.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphflop.frontend import outline  # noqa: F401  (defines graphflop::repeat)
from graphflop.meta import (
    CALL_SITE,
    COST,
    DERIVED_HIERARCHY,
    HIERARCHY,
    ZERO_COST,
    Hierarchy,
    NodeCost,
)
from graphflop.ops.cost import op_cost, tensor_bytes, value_of
from graphflop.passes.infra import GraphPass

#: a call of a template derivative in a recorded top level (``graphflop::repeat``)
_REPEAT = torch.ops.graphflop.repeat.default

# op_cost, tensor_bytes and value_of live with the rule table (graphflop.ops.cost), below the
# graph builder that also needs them; the passes import them from here
__all__ = [
    "AnnotateFlops",
    "annotate_flops",
    "annotate_templates",
    "op_cost",
    "sum_costs",
    "tensor_bytes",
    "total_cost",
    "value_of",
]


def annotate_flops(gm: GraphModule) -> GraphModule:
    """Write ``COST`` on every node of ``gm`` (in place) and return it.

    A graph with a :class:`~graphflop.meta.Hierarchy` (outlined blocks) has each template
    costed once (:func:`annotate_templates`) and each copy of a template node given its
    template node's cost; every other node is costed on its own. A derivative graph whose
    blocks are calls (:data:`~graphflop.meta.DERIVED_HIERARCHY`) has each template derivative
    costed once: with the flat graph (``runs``), each call's node gets its template node's
    cost; where ``gm`` is the recorded top level itself (``direct=True``), the template's
    nodes carry the costs, each call node their sum and its getitems nothing.

    Raises:
        MissingRuleError: for a ``call_function`` node whose op has no rule, inside
            :func:`graphflop.ops.strict_rules` (else such a node costs 0).
    """
    h: Hierarchy | None = gm.meta.get(HIERARCHY)
    templates: list[list[Node]] = []  # each template's nodes
    of_site: list[int] = []  # each call site's template
    if h is not None:
        annotate_templates(h)
        templates = [list(t.nodes) for t in h.templates]
        of_site = [s.template for s in h.sites]
    done = _cost_calls(gm)
    recorded = _cost_recorded(gm)
    if recorded:
        done = recorded
    for n in gm.graph.nodes:
        if n in done:
            continue
        tag = n.meta.get(CALL_SITE) if of_site else None
        if tag is not None and tag[0] < len(of_site):
            t = templates[of_site[tag[0]]][tag[1]]
            if n.target is operator.getitem and (
                isinstance(n.args[0], Node) and n.args[0].meta.get(CALL_SITE) == tag
            ):
                n.meta[COST] = ZERO_COST  # a getitem tracing added to the copy
                continue
            if n.target is t.target and _same_out(n, t):
                n.meta[COST] = t.meta[COST]
                continue
        if n.op == "call_function":
            n.meta[COST] = op_cost(n.target, n.args, n.kwargs, n, node=n.name)
        else:
            n.meta[COST] = ZERO_COST
    return gm


def _cost_calls(gm: GraphModule) -> set[Node]:
    """Where derivative graph ``gm`` keeps its blocks as calls (:data:`DERIVED_HIERARCHY`,
    :mod:`graphflop.passes.calls`): cost each template derivative's nodes once and give every
    node of each call its template node's ``COST`` (a call's node and its template node have
    the same op, constants and argument layouts). Returns the nodes so costed."""
    dh = gm.meta.get(DERIVED_HIERARCHY)
    if dh is None or not dh.runs:
        return set()
    costs: dict[int, list[NodeCost]] = {}
    done: set[Node] = set()
    for c, run in zip(dh.calls, dh.runs):
        cs = costs.get(c.template)
        if cs is None:
            cs = costs[c.template] = []
            for t in dh.templates[c.template].graph.nodes:
                if t.op == "call_function":
                    t.meta[COST] = op_cost(t.target, t.args, t.kwargs, t, node=t.name)
                    cs.append(t.meta[COST])
        for n, cost in zip(run, cs):
            n.meta[COST] = cost
        done.update(run)
    return done


def _cost_recorded(gm: GraphModule) -> set[Node]:
    """Where ``gm`` is the top level of a recorded derivative hierarchy (its
    :data:`DERIVED_HIERARCHY`'s ``graph`` is ``gm`` itself: built with ``direct=True``, there is
    no flat graph): cost each template derivative's nodes once (``COST`` on the template's
    nodes, placeholders and output :data:`ZERO_COST`), give each ``graphflop::repeat`` call node
    its template's total (so that a node-by-node sum over the top level is the flat graph's
    total) and each getitem of a call :data:`ZERO_COST`. The per-role, per-module and per-op
    figures come from the templates (``calls.derived_figures``). Returns the nodes so costed."""
    dh = gm.meta.get(DERIVED_HIERARCHY)
    if dh is None or dh.graph is not gm:
        return set()
    totals: dict[int, NodeCost] = {}
    done: set[Node] = set()
    for n in gm.graph.nodes:
        if n.target is _REPEAT and n.op == "call_function":
            t = dh.calls[n.args[1]].template
            total = totals.get(t)
            if total is None:
                total = totals[t] = _cost_template(dh.templates[t])
            n.meta[COST] = total
            done.add(n)
        elif n.target is operator.getitem and getattr(n.args[0], "target", None) is _REPEAT:
            n.meta[COST] = ZERO_COST
            done.add(n)
    return done


def _cost_template(t: GraphModule) -> NodeCost:
    """Write ``COST`` on every node of template derivative ``t`` (once: a template already
    costed is left as it is) and return the sum over its nodes."""
    costs = []
    for x in t.graph.nodes:
        c = x.meta.get(COST)
        if c is None:
            if x.op == "call_function":
                c = op_cost(x.target, x.args, x.kwargs, x, node=x.name)
            else:
                c = ZERO_COST
            x.meta[COST] = c
        costs.append(c)
    return sum_costs(costs)


def _same_out(n: Node, t: Node) -> bool:
    a, b = n.meta.get("val"), t.meta.get("val")
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)


def annotate_templates(h: Hierarchy) -> None:
    """Write ``COST`` on every node of every template of ``h`` (once: a template already
    costed is left as it is).

    Raises:
        MissingRuleError: as :func:`annotate_flops`.
    """
    for tpl in h.templates:
        for n in tpl.nodes:
            if COST in n.meta:
                continue
            if n.op == "call_function":
                n.meta[COST] = op_cost(n.target, n.args, n.kwargs, n, node=n.name)
            else:
                n.meta[COST] = ZERO_COST


class AnnotateFlops(GraphPass):
    """:func:`annotate_flops` as a pass: requires ``val``, provides ``flops``.

    Raises ``MissingRuleError`` for an op without a rule inside
    :func:`graphflop.ops.strict_rules`.
    """

    name = "annotate_flops"
    required = ("val",)
    provided = ("flops",)

    def call(self, graph_module: GraphModule) -> PassResult:
        return PassResult(annotate_flops(graph_module), False)


def total_cost(nodes) -> NodeCost:
    """Sum of ``COST`` over nodes (missing costs count as zero)."""
    return sum_costs(n.meta.get(COST, ZERO_COST) for n in nodes)


def sum_costs(costs) -> NodeCost:
    """Sum of an iterable of :class:`~graphflop.meta.NodeCost`, field by field (one NodeCost
    made, not one per term: the summary sums every node of every graph)."""
    f = mm = tr = rnd = br = bw = 0
    for c in costs:
        f += c.flops
        mm += c.mm_flops
        tr += c.transcendentals
        rnd += c.random_elements
        br += c.bytes_read
        bw += c.bytes_written
    return NodeCost(f, mm, tr, rnd, br, bw)
