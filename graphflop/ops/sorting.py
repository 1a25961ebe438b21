"""Sorting and selection: sort (and argsort, which traces to it), topk, kthvalue, median and
nanmedian (along a dim and over all elements).

Costs count comparisons as FLOPs (docs/flops_conventions.md): ``sort`` N·⌈log2 N⌉ per sorted row of
N, ``topk`` N·⌈log2 k⌉ per row, ``kthvalue`` the same as ``topk`` of the k smallest (N·⌈log2 k⌉ per
row: it returns the last of them). Over every row: ``numel · ⌈log2 N⌉`` and ``numel · ⌈log2 k⌉``.
``median`` is the ``kthvalue`` of the lower median, k = ⌊(N - 1) / 2⌋ + 1 (PyTorch returns the
lower of the two middle values of an even N), N the row's size (``median.dim``) or every element
(``median.default``); ``nanmedian`` is counted as ``median`` (its NaNs are not known from the
shapes).

Derivatives: the values are the input at the returned indices, so the values' tangent is the
input tangent gathered at those indices (``gather``, 0 FLOPs) and the indices' tangent is zero;
the transpose is ``gather``'s (``scatter_add`` into zeros, 1 FLOP per added element). Ties get
the derivative at the index PyTorch returns, as PyTorch's own derivative formulas do.
``median.default`` returns no index: as PyTorch's ``evenly_read_jvp``, its tangent is the mean
of the input tangent over the elements equal to the median (``amax``'s rule).
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


def _jvp_selected(op):
    """``kthvalue(x, k, dim=-1, keepdim=False)``, ``median.dim(x, dim, keepdim=False)``: the
    tangent gathered at the returned index (unsqueezed along ``dim`` unless kept, squeezed back
    after)."""

    def jvp(b, out, args, tangents, kwargs):
        a = bind(op, args, kwargs)
        dim = _dim(a.self, a.dim)
        keepdim = bool(a.keepdim)
        idx = b.getitem(out, 1)
        if not keepdim:
            idx = b.call(aten.unsqueeze.default, idx, dim)
        t = b.call(aten.gather.default, tangents[0], dim, idx)
        if not keepdim:
            t = b.call(aten.squeeze.dims, t, [dim])
        return (t, None)

    return jvp


def_jvp(aten.kthvalue.default)(_jvp_selected(aten.kthvalue.default))


def _lower_median_k(n: int) -> int:
    """The rank k (1-based) of the median PyTorch returns among n values: the lower middle."""
    return (n - 1) // 2 + 1


def _median_dim_cost(op):
    """``median.dim(x, dim, keepdim=False)``: ``kthvalue`` of k = ⌊(N - 1) / 2⌋ + 1 along
    ``dim`` of size N, numel·⌈log2 k⌉."""

    def cost(out, *args, **kwargs) -> NodeCost:
        a = bind(op, args, kwargs)
        xs = tuple(a.self.shape)
        n = xs[_dim(a.self, a.dim)] if xs else 1
        return NodeCost(flops=numel(a.self) * _log2_ceil(_lower_median_k(n)))

    return cost


def _median_all_cost(out, x, *args, **kwargs) -> NodeCost:
    """``median.default(x)``: ``kthvalue`` of k = ⌊(N - 1) / 2⌋ + 1 over all N = numel
    elements, N·⌈log2 k⌉."""
    n = numel(x)
    return NodeCost(flops=n * _log2_ceil(_lower_median_k(n)))


def _jvp_median_all(b, out, args, tangents, kwargs):
    """d median(x) = sum(dx · m) / sum(m), m = (x == median(x)): the mean of the tangent over
    the elements equal to the median (PyTorch's ``evenly_read_jvp``)."""
    x = args[0]
    dims = list(range(len(shape(x))))
    mask = b.call(aten.eq.Tensor, x, out)
    count = b.call(aten.sum.dim_IntList, mask, dims)
    coef = b.call(aten.div.Tensor, mask, count)
    return b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, tangents[0], coef), dims)


for _op in (aten.median.dim, aten.nanmedian.dim):
    register(_op, F, _median_dim_cost(_op))
    def_jvp(_op)(_jvp_selected(_op))
for _op in (aten.median.default, aten.nanmedian.default):
    register(_op, F, _median_all_cost)
    def_jvp(_op)(_jvp_median_all)
