"""FLOP and byte pass: writes ``COST`` (:class:`~graphflop.meta.NodeCost`) on every node.

Reads ``val`` (output FakeTensors), ``COMPOSITE`` and the rule table. Placeholders, outputs and
``getitem`` cost nothing. A ``call_function`` node whose op has no rule costs 0 (the summary lists
it as uncounted); inside :func:`graphflop.ops.strict_rules` it raises
:class:`~graphflop.ops.MissingRuleError` naming the op, the node and the rule file.

A composite op eager PyTorch runs as one kernel (layer norm, softmax, GELU, ...: the ops of
:data:`~graphflop.frontend.composite.EAGER_SAVES`, whose decompositions tracing tags with
``COMPOSITE``) moves the bytes of that kernel, not those of its decomposition's parts
(:func:`one_kernel_bytes`): its inputs from outside read once, its outputs written once, in
their dtypes; the parts' temporaries (a 16-bit input's float32 upcast and the float32 values
computed from it, the per-row statistics a softmax keeps on the way) are not counted. Its FLOPs
stay the sum of its parts' (docs/flops_conventions.md, One kernel's bytes).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphflop.frontend import outline  # noqa: F401  (defines graphflop::repeat)
from graphflop.frontend.composite import EAGER_SAVES, composite_regions
from graphflop.meta import (
    CALL_SITE,
    COMPOSITE,
    COST,
    DERIVED_HIERARCHY,
    HIERARCHY,
    ZERO_COST,
    Hierarchy,
    NodeCost,
)
from graphflop.ops import has_rule, lookup
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
    "flat_costs",
    "one_kernel_bytes",
    "one_kernel_costs",
    "op_cost",
    "read_shares",
    "rule_cost",
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
    nodes carry the costs, each call node their sum and its getitems nothing. The parts of a
    composite op eager runs as one kernel carry that kernel's bytes (:func:`one_kernel_bytes`),
    in a template as in the flat graph, so a copy's cost is the one it has on its own.

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
    fresh: dict[Node, NodeCost] = {}  # the nodes costed by their rules here
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
            n.meta[COST] = fresh[n] = op_cost(n.target, n.args, n.kwargs, n, node=n.name)
        else:
            n.meta[COST] = ZERO_COST
    # a composite op whose nodes all took their template's (or template derivative's) costs
    # has its one kernel's bytes from there already
    one_kernel_bytes(gm.graph.nodes, fresh)
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
            tpl = dh.templates[c.template].graph.nodes
            raw = {
                t: op_cost(t.target, t.args, t.kwargs, t, node=t.name)
                for t in tpl
                if t.op == "call_function"
            }
            for t, cost in raw.items():
                t.meta[COST] = cost
            one_kernel_bytes(tpl, raw)
            cs = costs[c.template] = [t.meta[COST] for t in raw]
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
    fresh: dict[Node, NodeCost] = {}
    for x in t.graph.nodes:
        if COST not in x.meta:
            if x.op == "call_function":
                x.meta[COST] = fresh[x] = op_cost(x.target, x.args, x.kwargs, x, node=x.name)
            else:
                x.meta[COST] = ZERO_COST
    if fresh:
        one_kernel_bytes(t.graph.nodes, fresh)
    return sum_costs(x.meta[COST] for x in t.graph.nodes)


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
        fresh: dict[Node, NodeCost] = {}
        for n in tpl.nodes:
            if COST in n.meta:
                continue
            if n.op == "call_function":
                n.meta[COST] = fresh[n] = op_cost(n.target, n.args, n.kwargs, n, node=n.name)
            else:
                n.meta[COST] = ZERO_COST
        if fresh:
            one_kernel_bytes(tpl.nodes, fresh)


def in_one_kernel(n: Node) -> bool:
    """Whether ``n`` is a part of a composite op eager PyTorch runs as one kernel (a
    ``call_function`` node tagged with an op of
    :data:`~graphflop.frontend.composite.EAGER_SAVES`): its ``COST``'s bytes are its share of
    that kernel's (:func:`one_kernel_bytes`), not its rule's."""
    tag = n.meta.get(COMPOSITE)
    return tag is not None and n.op == "call_function" and tag.op in EAGER_SAVES


def rule_cost(n: Node) -> NodeCost:
    """``n``'s cost by its op's rule alone: its ``COST``, or where that holds its share of a
    composite op's one kernel (:func:`in_one_kernel`), its rule's cost made anew."""
    if in_one_kernel(n):
        return op_cost(n.target, n.args, n.kwargs, n)
    return n.meta.get(COST, ZERO_COST)


def _is_view(n: Node) -> bool:
    return n.op == "call_function" and has_rule(n.target) and lookup(n.target).bytes == "view"


def read_shares(n: Node, cost: NodeCost) -> dict[Node, float]:
    """The fraction of each input of ``n`` that ``n`` reads, ``cost`` its rule's: all of each,
    but where its byte rule reads less than its inputs hold (a gather, an embedding: the rows
    it picks), the difference comes off its largest input (the table the rows are picked
    from). A view reads nothing itself, and what reads through it is not known here: all of
    its input."""
    ins = n.all_input_nodes
    sizes = [tensor_bytes(a.meta.get("val")) for a in ins]
    out = dict.fromkeys(ins, 1.0)
    excess = sum(sizes) - cost.bytes_read
    if _is_view(n) or not has_rule(n.target) or excess <= 0 or not ins:
        return out
    big = max(range(len(ins)), key=lambda i: sizes[i])
    if sizes[big]:
        out[ins[big]] = max(0.0, sizes[big] - excess) / sizes[big]
    return out


def one_kernel_bytes(nodes: Iterable[Node], fresh: Mapping[Node, NodeCost]) -> None:
    """Write :func:`one_kernel_costs` on its nodes (``COST``)."""
    for n, cost in one_kernel_costs(nodes, fresh).items():
        n.meta[COST] = cost


def flat_costs(nodes: Iterable[Node]) -> dict[Node, NodeCost]:
    """Each node's cost as :func:`annotate_flops` gives it when every node is costed on its own
    (no template): its rule's, with a composite op's one kernel's bytes
    (:func:`one_kernel_costs`); written nowhere (tests check a template copy's ``COST``
    against it)."""
    nodes = list(nodes)
    out = {
        n: op_cost(n.target, n.args, n.kwargs, n) if n.op == "call_function" else ZERO_COST
        for n in nodes
    }
    return out | one_kernel_costs(nodes, out)


def one_kernel_costs(nodes: Iterable[Node], fresh: Mapping[Node, NodeCost]) -> dict[Node, NodeCost]:
    """The costs of the parts of each composite op among ``nodes`` that eager PyTorch runs as
    one kernel (:func:`in_one_kernel`) with that kernel's bytes: the FLOPs stay the rules',
    the bytes become each part's share of

    * read: each tensor the op takes from outside its parts, once, whole (or the share its
      readers' byte rules read of it: :func:`read_shares`), charged to its first reader;
    * written: each of the op's outputs (a part its tag names an output, or one another
      ``call_function`` node reads: a derivative rule's coefficient), once, at its dtype,
      charged to the part that makes its storage (the base of a view, the multi-output part
      behind a ``getitem``); the parts' temporaries are not written.

    ``fresh``: the nodes whose ``COST`` is their rule's (just costed); an op none of whose parts
    is among them already has its kernel's bytes (a template's copy) and is left as it is, one
    with some is costed from its parts' rules. An op traced as one node (training-mode batch
    norm, :data:`~graphflop.frontend.composite.KEPT_WHOLE`; a GELU in one part) has its rule's
    bytes, its kernel's already; one with a part without a cost rule keeps its parts' costs
    (the phase is incomplete anyway). A layer norm over [B, T, D] in bfloat16: read
    B·T·D·2 + γ and β D·2 each, written B·T·D·2 (its output; μ and rstd where the graph has
    them as outputs), where the decomposition read and wrote its float32 upcast and
    temporaries."""
    out: dict[Node, NodeCost] = {}
    for region in composite_regions(nodes):
        parts = [n for n in region if in_one_kernel(n)]
        if not parts or not any(n in fresh for n in parts):
            continue
        ops = [n for n in parts if n.target is not operator.getitem]
        if len(ops) < 2 or not all(has_rule(n.target) for n in ops):
            continue
        rules = {n: fresh[n] if n in fresh else rule_cost(n) for n in parts}
        inside = set(parts)
        read = dict.fromkeys(parts, 0.0)
        taken: dict[Node, float] = {}
        for n in parts:
            outer = [a for a in n.all_input_nodes if a not in inside]
            if not outer:
                continue
            shares = read_shares(n, rules[n])
            for a in outer:
                size = tensor_bytes(a.meta.get("val"))
                got = taken.get(a, 0.0)
                part = min(size - got, shares[a] * size)
                if part > 0:
                    taken[a] = got + part
                    read[n] += part
        written = dict.fromkeys(parts, 0)
        seen: set[Node] = set()
        for n in parts:
            # (a graph's output node is no reader: a template derivative returns inner values
            # its calls' flat nodes never read)
            if n.meta[COMPOSITE].output is None and all(
                u in inside or u.op != "call_function" for u in n.users
            ):
                continue
            m = n  # the storage the output is: through views to their base
            while _is_view(m) and m.all_input_nodes and m.all_input_nodes[0] in inside:
                m = m.all_input_nodes[0]
            if _is_view(m) or m in seen:  # a view of an input from outside: nothing written
                continue
            seen.add(m)
            owner = m
            if m.target is operator.getitem:
                base = m.args[0]
                if not isinstance(base, Node) or base not in inside:
                    continue
                owner = base
            written[owner] += tensor_bytes(m.meta.get("val"))
        for n in parts:
            out[n] = replace(rules[n], bytes_read=round(read[n]), bytes_written=written[n])
    return out


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
