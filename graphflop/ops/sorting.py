"""Sorting and selection: sort (and argsort, which traces to it), topk, kthvalue.

Costs count comparisons as FLOPs (docs/flops_conventions.md): ``sort`` N·⌈log2 N⌉ per sorted row of
N, ``topk`` N·⌈log2 k⌉ per row, ``kthvalue`` the same as ``topk`` of the k smallest (N·⌈log2 k⌉ per
row: it returns the last of them). Over every row: ``numel · ⌈log2 N⌉`` and ``numel · ⌈log2 k⌉``.

Derivatives: the values are the input at the returned indices, so the values' tangent is the
input tangent gathered at those indices (``gather``, 0 FLOPs) and the indices' tangent is zero;
the transpose is ``gather``'s (``scatter_add`` into zeros, 1 FLOP per added element). Ties get
the derivative at the index PyTorch returns, as PyTorch's own derivative formulas do.
"""

from __future__ import annotations

import math

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import bind, numel, shape
from graphflop.ops.registry import def_jvp, register

aten = torch.ops.aten
F = "sorting"


def _log2_ceil(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _dim(x, dim) -> int:
    return dim % max(len(shape(x)), 1)


def _sort_cost(op):
    """Cost of ``sort.default(x, dim=-1, descending=False)`` or ``sort.stable(x, *, stable,
    dim=-1, descending=False)``: numel·⌈log2 n⌉, n the sorted dim's size."""

    def cost(out, *args, **kwargs) -> NodeCost:
        a = bind(op, args, kwargs)
        xs = tuple(a.self.shape)
        n = xs[_dim(a.self, a.dim)] if xs else 1
        return NodeCost(flops=numel(a.self) * _log2_ceil(n))

    return cost


def _jvp_sort(op):
    """values' tangent: the input tangent gathered at the returned indices."""

    def jvp(b, out, args, tangents, kwargs):
        a = bind(op, args, kwargs)
        dim = _dim(a.self, a.dim)
        return (b.call(aten.gather.default, tangents[0], dim, b.getitem(out, 1)), None)

    return jvp


for _op in (aten.sort.default, aten.sort.stable):
    register(_op, F, _sort_cost(_op))
    def_jvp(_op)(_jvp_sort(_op))


def _topk_cost(out, x, k, *args, **kwargs) -> NodeCost:
    """N·⌈log2 k⌉ comparisons per row of N, over every row: numel·⌈log2 k⌉
    (docs/flops_conventions.md, Everything else)."""
    return NodeCost(flops=numel(x) * _log2_ceil(k))


register(aten.topk.default, F, _topk_cost)


@def_jvp(aten.topk.default)
def _jvp_topk(b, out, args, tangents, kwargs):
    """The values' tangent is the input tangent gathered at the returned indices (MoE routing)."""
    a = bind(aten.topk.default, args, kwargs)
    dim = _dim(a.self, a.dim)
    return (b.call(aten.gather.default, tangents[0], dim, b.getitem(out, 1)), None)


register(aten.kthvalue.default, F, _topk_cost)


@def_jvp(aten.kthvalue.default)
def _jvp_kthvalue(b, out, args, tangents, kwargs):
    """``kthvalue(x, k, dim=-1, keepdim=False)``: the tangent gathered at the returned index
    (unsqueezed along ``dim`` unless kept, squeezed back after)."""
    a = bind(aten.kthvalue.default, args, kwargs)
    dim = _dim(a.self, a.dim)
    keepdim = bool(a.keepdim)
    idx = b.getitem(out, 1)
    if not keepdim:
        idx = b.call(aten.unsqueeze.default, idx, dim)
    t = b.call(aten.gather.default, tangents[0], dim, idx)
    if not keepdim:
        t = b.call(aten.squeeze.dims, t, [dim])
    return (t, None)
