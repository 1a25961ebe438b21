"""FLOP and byte pass: writes ``COST`` (:class:`~graphflop.meta.NodeCost`) on every node.

Reads ``val`` (output FakeTensors) and the rule table. Placeholders, outputs and ``getitem``
cost nothing. A ``call_function`` node whose op has no rule costs 0 (the summary lists it as
uncounted); inside :func:`graphflop.ops.strict_rules` it raises
:class:`~graphflop.ops.MissingRuleError` naming the op, the node and the rule file.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphflop.ad._tree import leaves, tree_map, value_key
from graphflop.ad.ghost import is_ghost
from graphflop.meta import COST, ZERO_COST, NodeCost
from graphflop.ops import MissingRuleError, is_strict, lookup
from graphflop.passes.infra import GraphPass


def tensor_bytes(v: Any) -> int:
    """Bytes of every tensor in ``v`` (a tensor, or a nested tuple/list): numel × element size."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    return sum(t.numel() * t.element_size() for t in leaves(v) if isinstance(t, torch.Tensor))


def value_of(a: Any) -> Any:
    """The FakeTensor behind a graph value (fx node or ghost); constants pass through."""
    if isinstance(a, Node):
        return a.meta.get("val")
    if is_ghost(a):
        return a.val
    return a


def op_cost(op: Any, args: tuple, kwargs: dict, out: Any, node: str | None = None) -> NodeCost:
    """Cost of calling ``op`` on ``args``/``kwargs`` (graph values or tensors) giving ``out``.

    FLOPs come from the op's rule; bytes from its byte policy (``view``: none; otherwise the tensor
    inputs read and the outputs written).

    An op without a rule costs :data:`~graphflop.meta.ZERO_COST` (partial results).

    Raises:
        MissingRuleError: when ``op`` has no rule, inside :func:`graphflop.ops.strict_rules`.
    """
    if op is operator.getitem:
        return ZERO_COST
    try:
        rule = lookup(op, node=node)
    except MissingRuleError:
        if is_strict():
            raise
        return ZERO_COST
    key: tuple | None
    try:  # costs are functions of metadata (and the rule's context): repeated blocks hit the cache
        context = rule.context() if rule.context is not None else None
        key = (rule, context, value_key(args), value_key(kwargs), value_key(out))
        hit = _COSTS.get(key)
    except TypeError:
        key = hit = None
    if hit is not None:
        return hit
    cost = _cost(rule, tree_map(value_of, args), tree_map(value_of, kwargs), value_of(out))
    if key is not None:
        if len(_COSTS) > 100_000:
            _COSTS.clear()
        _COSTS[key] = cost
    return cost


#: (rule, argument metadata) -> NodeCost
_COSTS: dict = {}


def _cost(rule, a: tuple, k: dict, o: Any) -> NodeCost:
    c = rule.cost(o, *a, **k)
    if rule.bytes == "view":
        return NodeCost(c.flops, c.mm_flops, c.transcendentals, c.random_elements, 0, 0)
    if rule.bytes == "gather":  # the rows gathered (as many as written) and the indices
        return NodeCost(
            c.flops,
            c.mm_flops,
            c.transcendentals,
            c.random_elements,
            tensor_bytes(o) + tensor_bytes((a[1:], k)),
            tensor_bytes(o),
        )
    return NodeCost(
        c.flops,
        c.mm_flops,
        c.transcendentals,
        c.random_elements,
        tensor_bytes((a, k)),
        tensor_bytes(o),
    )


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
