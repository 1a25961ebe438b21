"""Scatters beyond ``scatter_add`` (which lives with ``gather`` in ``shape.py``): ``scatter.src``
and ``scatter.value`` (copies: 0 FLOPs, docs/flops_conventions.md), ``scatter_reduce.two``, and
``index_reduce`` (traced as ``scatter_reduce``, the index broadcast over the source).

``scatter.src``/``scatter.value`` are linear in the destination and the source jointly (for a
fixed index): the JVP scatters the tangents, the transpose gives the destination the cotangent
with the written positions zeroed and the source the cotangent gathered at the index. As in
PyTorch's own derivative (``derivatives.yaml``), this assumes the index writes each position
once: with repeated positions the result (and which source element wins) is unspecified.

``scatter_reduce.two`` with ``reduce="sum"``/``"mean"`` is traced as ``scatter_add`` (after a
``scatter.value`` zeroing the hit positions when ``include_self=False``); ``"mean"`` then
divides by the count of the elements reduced into each position (a ``scatter_add`` of ones,
clamped to at least 1 where nothing is reduced, as PyTorch keeps those positions), so its FLOPs
are the parts': numel(src) adds, numel(src) count adds, numel(out) clamps and numel(out)
divides. ``"amax"``/``"amin"``/``"prod"`` keep the op whole: one comparison or multiply per
source element (numel(src) FLOPs). ``amax``/``amin`` with ``include_self=True`` have PyTorch's
JVP (``scatter_reduce_jvp``: the tangents of the elements equal to the result, averaged over
ties), built from ``eq``, ``scatter_add``, multiplies and a divide, whose transposes give the
backward; with ``include_self=False`` self's tangent is left out where the index writes, and a
self element equal to the result still counts among the ties there, as eager's backward
(``N_to_distribute``; eager's forward mode leaves it out of the count: graphflop's JVP is its
backward's map). ``prod`` refuses (a model using it is analysed with its JVP and backward cut
there, and the gap reported).
"""

from __future__ import annotations

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import bind, dtype, free, numel, shape
from graphflop.ops.registry import (
    MissingRuleError,
    def_jvp,
    def_transpose,
    register,
    register_decomposition,
)

aten = torch.ops.aten
F = "shape"  # the family: listed with gather and scatter_add in docs/op_coverage.md

register(aten.scatter.src, F, free, bytes="copy")
register(aten.scatter.value, F, free, bytes="copy")


@def_jvp(aten.scatter.src)
def _jvp_scatter_src(b, out, args, tangents, kwargs):
    """d scatter(x, dim, i, src) = scatter(dx, dim, i, dsrc) (a zero tangent materialised)."""
    x, dim, index, src = args[:4]
    tx, tsrc = tangents[0], tangents[3]
    if tx is None and tsrc is None:
        return None
    tx = b.zeros(shape(x), x) if tx is None else tx
    tsrc = b.zeros(shape(src), src) if tsrc is None else tsrc
    return b.call(aten.scatter.src, tx, dim, index, tsrc)


@def_transpose(aten.scatter.src)
def _transpose_scatter_src(b, ct, args, kwargs, linear):
    """x̄ = ct with the written positions zeroed; src̄ = ct gathered at the index."""
    _, dim, index = args[:3]
    cts = [None] * len(args)
    if linear[0]:
        cts[0] = b.call(aten.scatter.value, ct, dim, index, 0.0)
    if linear[3]:
        cts[3] = b.call(aten.gather.default, ct, dim, index)
    return cts


@def_jvp(aten.scatter.value)
def _jvp_scatter_value(b, out, args, tangents, kwargs):
    """d scatter(x, dim, i, v) = dx with the written positions zeroed (v is a constant)."""
    if tangents[0] is None:
        return None
    return b.call(aten.scatter.value, tangents[0], args[1], args[2], 0.0)


@def_transpose(aten.scatter.value)
def _transpose_scatter_value(b, ct, args, kwargs, linear):
    """Self-adjoint in x: x̄ = ct with the written positions zeroed."""
    return [b.call(aten.scatter.value, ct, args[1], args[2], 0.0)] + [None] * (len(args) - 1)


def _scatter_reduce_cost(out, x, dim, index, src, reduce, *args, **kwargs) -> NodeCost:
    """amax/amin/prod (sum and mean are decomposed): one comparison or multiply per source
    element."""
    return NodeCost(flops=numel(src))


register(aten.scatter_reduce.two, F, _scatter_reduce_cost)


@register_decomposition(aten.scatter_reduce.two)
def _scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    """``sum``/``mean`` as ``scatter_add`` (see the module docstring); other reductions kept
    whole (``NotImplemented`` makes the tracer keep the op)."""
    if reduce not in ("sum", "mean") or not x.is_floating_point():
        return NotImplemented
    base = x if include_self else aten.scatter.value(x, dim, index, 0.0)
    total = aten.scatter_add.default(base, dim, index, src)
    if reduce == "sum":
        return total
    start = aten.full_like.default(x, 1.0 if include_self else 0.0)
    count = aten.scatter_add.default(start, dim, index, aten.full_like.default(src, 1.0))
    return aten.div.Tensor(total, aten.clamp.default(count, 1.0))


@def_jvp(aten.scatter_reduce.two)
def _jvp_scatter_reduce(b, out, args, tangents, kwargs):
    """amax/amin: (Σ of the tangents of self and src elements equal to the result) / (their
    count), per output position; without ``include_self`` self's tangent is left out where the
    index writes, its count kept (eager's backward)."""
    a = bind(aten.scatter_reduce.two, args, kwargs)
    x, dim, index, src = a.self, a.dim, a.index, a.src
    if a.reduce not in ("amax", "amin"):
        raise MissingRuleError(aten.scatter_reduce.two, ("jvp",))
    tx, tsrc = tangents[0], tangents[3]
    if tx is None and tsrc is None:
        return None
    dt = dtype(x)
    mx = b.call(aten._to_copy.default, b.call(aten.eq.Tensor, x, out), dtype=dt)
    value = b.call(aten.gather.default, out, dim, index)
    msrc = b.call(aten._to_copy.default, b.call(aten.eq.Tensor, src, value), dtype=dt)
    count = b.call(aten.scatter_add.default, mx, dim, index, msrc)
    if tx is not None and not a.include_self:
        # self's tangent left out where the index writes (eager's backward zeroes self's
        # gradient there, ``grad_self.scatter(dim, index, 0)``; its count of ties still holds
        # a self element equal to the result, as eager's ``N_to_distribute``)
        tx = b.call(aten.scatter.value, tx, dim, index, 0.0)
    tx = b.zeros(shape(x), x) if tx is None else b.call(aten.mul.Tensor, tx, mx)
    tsrc = b.zeros(shape(src), src) if tsrc is None else b.call(aten.mul.Tensor, tsrc, msrc)
    return b.call(aten.div.Tensor, b.call(aten.scatter_add.default, tx, dim, index, tsrc), count)


@register_decomposition(aten.index_reduce.default)
def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """``index_reduce(x, dim, index, source, reduce)`` (``Tensor.index_reduce_``): slice i of
    ``source`` along ``dim`` reduced into slice ``index[i]`` of x, which is ``scatter_reduce``
    with the index broadcast over ``source``'s other dims (the same reductions, ``prod``,
    ``mean``, ``amax``, ``amin``, and ``include_self``), so its FLOPs and derivatives are
    those of ``scatter_reduce``."""
    d = dim % max(source.dim(), 1)
    view = [1] * source.dim()
    view[d] = index.shape[0]
    expanded = aten.expand.default(aten.view.default(index, view), list(source.shape))
    return aten.scatter_reduce.two(x, d, expanded, source, reduce, include_self=include_self)
