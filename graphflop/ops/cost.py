"""What calling an op costs under the rule table: :func:`op_cost` (FLOPs from the op's cost
rule, bytes from its byte policy) for graph values, ghosts or tensors, and the helpers it reads
them with (:func:`value_of`, :func:`tensor_bytes`).

The FLOP pass (:mod:`graphflop.passes.flops`) writes this cost on every node; the graph builder
(:mod:`graphflop.ad.builder`) records it for the work a ghost stands for.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from graphflop.meta import ZERO_COST, NodeCost
from graphflop.ops.ghost import is_ghost
from graphflop.ops.registry import MissingRuleError, is_strict, lookup
from graphflop.ops.tree import leaves, tree_map, value_key

__all__ = ["op_cost", "tensor_bytes", "value_of"]


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
    key: tuple[Any, ...] | None
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
