"""FLOP and byte pass: writes ``COST`` (:class:`~graphflop.meta.NodeCost`) on every node.

Reads ``val`` (output FakeTensors) and the rule table. Placeholders, outputs and ``getitem``
cost nothing. A ``call_function`` node whose op has no rule costs 0 (the summary lists it as
uncounted); inside :func:`graphflop.ops.strict_rules` it raises
:class:`~graphflop.ops.MissingRuleError` naming the op, the node and the rule file.
"""

from __future__ import annotations

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from graphflop.meta import COST, ZERO_COST, NodeCost
from graphflop.ops.cost import op_cost, tensor_bytes, value_of
from graphflop.passes.infra import GraphPass

# op_cost, tensor_bytes and value_of live with the rule table (graphflop.ops.cost), below the
# graph builder that also needs them; the passes import them from here
__all__ = [
    "AnnotateFlops",
    "annotate_flops",
    "op_cost",
    "sum_costs",
    "tensor_bytes",
    "total_cost",
    "value_of",
]


def annotate_flops(gm: GraphModule) -> GraphModule:
    """Write ``COST`` on every node of ``gm`` (in place) and return it.

    Raises:
        MissingRuleError: for a ``call_function`` node whose op has no rule, inside
            :func:`graphflop.ops.strict_rules` (else such a node costs 0).
    """
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta[COST] = op_cost(n.target, n.args, n.kwargs, n, node=n.name)
        else:
            n.meta[COST] = ZERO_COST
    return gm


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
