"""Reductions: sum, mean, amax/amin, max/min along a dim and over all elements, argmax/argmin, any/all, var,
var_mean, prod, cumsum, cumprod, cummax, cummin, logcumsumexp, histc. 1 FLOP per input element; mean
adds 1 per output element (docs/flops_conventions.md). ``var_mean`` is counted as a mean plus a
variance: 2 per input element and 2 per output element (the two divides); ``std`` of a
float32/float64 tensor is one op, ``var`` and a square root, its derivative 0 where it is 0 (as
eager's ``std_backward``; the decomposition's sqrt gave 0·inf there), and ``std_mean`` is that
``std`` and a ``mean``. ``cumsum`` and
``cumprod`` are 1 per input element, and so is ``prod`` (one multiply each, as a sum's one add
each); ``prod``'s tangent is ``sum(dx · ∏ of the others)``, the product of the others exact at
zeros (7 FLOPs per input element, :func:`_others_product`); cumsum's transpose is a reversed
cumsum (flip, cumsum, flip); cumprod's tangent is ``out · cumsum(dx / x)`` (not finite at an
exact zero). ``cummax`` and ``cummin`` are 1 comparison per element, their values' tangent the
input tangent gathered at the returned indices.
``logcumsumexp`` is 5 FLOPs per element, 2 of them transcendental (each step is PyTorch's
``log_add_exp(acc, x) = max + log1p(exp(min − max))``: a comparison, a subtract, exp, log1p, an
add). Sorting and selection (topk, sort, kthvalue, median) are in :mod:`graphflop.ops.sorting`.
``histc`` (mixture-of-experts layers count the tokens each expert receives with it) is 1 per
input element, the increment of its bin (the bin's index is address arithmetic, as in indexing,
not counted); its counts are piecewise constant in the input: a zero derivative. ``nonzero``
(the positions of the nonzero elements: a mixture-of-experts loop's tokens of one expert) is 1
per input element, its test against zero (writing the positions is data movement), with an
integer output: a zero derivative. Its row count is the values'; a trace gives it only under a
routing assumption (:mod:`graphflop.frontend.dispatch`).
"""

from __future__ import annotations

import math

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import FULL_PRECISION, bind, norm_dims, numel, per_input, shape
from graphflop.ops._common import dtype as dtype_of
from graphflop.ops.registry import (
    def_jvp,
    def_transpose,
    def_zero,
    register,
    register_decomposition,
    torch_decomposition,
)

aten = torch.ops.aten
F = "reduction"

register(aten.sum.dim_IntList, F, per_input(1))
register(aten.sum.default, F, per_input(1))
register(aten.mean.dim, F, per_input(1, plus_per_output=1))
register(aten.mean.default, F, per_input(1, plus_per_output=1))
register(aten.amax.default, F, per_input(1))
register(aten.amin.default, F, per_input(1))
register(aten.cumsum.default, F, per_input(1))
register(aten.cumprod.default, F, per_input(1))
register(aten.prod.dim_int, F, per_input(1))
register(aten.prod.default, F, per_input(1))
register(aten.cummax.default, F, per_input(1))
register(aten.cummin.default, F, per_input(1))


def _logcumsumexp_cost(out, x, *args, **kwargs) -> NodeCost:
    """``log_add_exp`` per element: max, subtract, exp, log1p, add (2 transcendentals)."""
    return NodeCost(flops=5 * numel(x), transcendentals=2 * numel(x))


register(aten.logcumsumexp.default, F, _logcumsumexp_cost)


def _var_mean_cost(out, x, *args, **kwargs) -> NodeCost:
    return NodeCost(flops=2 * numel(x) + 2 * numel(out[0]))


register(aten.var_mean.correction, F, _var_mean_cost)
register(aten.var.correction, F, per_input(1, plus_per_output=1))


def _reduce_args(op, x_shape, args, kwargs):
    """A reduction's dims (sorted, non-negative; none given means all) and ``keepdim``."""
    a = bind(op, args, kwargs)
    return norm_dims(a.dim, len(x_shape)), bool(a.keepdim)


def expand_back(b, ct, x_shape, dims, keepdim):
    """Cotangent of a reduction: unsqueeze the reduced dims (unless kept) and expand."""
    if not keepdim:
        for d in dims:
            ct = b.call(aten.unsqueeze.default, ct, d)
    return b.call(aten.expand.default, ct, list(x_shape))


def _count(x_shape, dims) -> int:
    return int(math.prod(x_shape[d] for d in dims)) if x_shape else 1


@def_jvp(aten.sum.dim_IntList)
def _jvp_sum(b, out, args, tangents, kwargs):
    return b.call(aten.sum.dim_IntList, tangents[0], *args[1:], **kwargs)


@def_transpose(aten.sum.dim_IntList)
def _transpose_sum(b, ct, args, kwargs, linear):
    xs = shape(args[0])
    dims, keepdim = _reduce_args(aten.sum.dim_IntList, xs, args, kwargs)
    return [expand_back(b, ct, xs, dims, keepdim)] + [None] * (len(args) - 1)


@def_jvp(aten.sum.default)
def _jvp_sum_all(b, out, args, tangents, kwargs):
    return b.call(aten.sum.default, tangents[0], **kwargs)


@def_transpose(aten.sum.default)
def _transpose_sum_all(b, ct, args, kwargs, linear):
    xs = shape(args[0])
    return [expand_back(b, ct, xs, list(range(len(xs))), False)]


@def_jvp(aten.mean.dim)
def _jvp_mean(b, out, args, tangents, kwargs):
    return b.call(aten.mean.dim, tangents[0], *args[1:], **kwargs)


def _mean_back(b, ct, xs, dims, keepdim):
    """A mean's transpose: the cotangent divided by the count, broadcast back over ``dims``."""
    return expand_back(b, b.call(aten.div.Tensor, ct, _count(xs, dims)), xs, dims, keepdim)


@def_transpose(aten.mean.dim)
def _transpose_mean(b, ct, args, kwargs, linear):
    xs = shape(args[0])
    dims, keepdim = _reduce_args(aten.mean.dim, xs, args, kwargs)
    return [_mean_back(b, ct, xs, dims, keepdim)] + [None] * (len(args) - 1)


@def_jvp(aten.mean.default)
def _jvp_mean_all(b, out, args, tangents, kwargs):
    return b.call(aten.mean.default, tangents[0], **kwargs)


@def_transpose(aten.mean.default)
def _transpose_mean_all(b, ct, args, kwargs, linear):
    xs = shape(args[0])
    return [_mean_back(b, ct, xs, list(range(len(xs))), False)]


def _jvp_extremum(op):
    """d amax(x) = sum(dx * m) / sum(m), m = (x == amax(x)) (ties share the derivative)."""

    def jvp(b, out, args, tangents, kwargs):
        x = args[0]
        xs = shape(x)
        dims, keepdim = _reduce_args(op, xs, args, kwargs)
        kept = out if keepdim else expand_back(b, out, xs, dims, False)
        mask = b.call(aten.eq.Tensor, x, kept)
        count = b.call(aten.sum.dim_IntList, mask, dims, True)
        coef = b.call(aten.div.Tensor, mask, count)
        t = b.call(aten.mul.Tensor, tangents[0], coef)
        return b.call(aten.sum.dim_IntList, t, dims, keepdim)

    return jvp


def_jvp(aten.amax.default)(_jvp_extremum(aten.amax.default))
def_jvp(aten.amin.default)(_jvp_extremum(aten.amin.default))

# torch.max(x) / torch.min(x) with no dim: the full reduction, 1 comparison per input element as
# amax; eager's derivative (derivatives.yaml: ``evenly_distribute_backward``, forward mode
# ``evenly_read_jvp``) spreads it evenly over the tied extrema, amax's rule over every dim
register(aten.max.default, F, per_input(1))
register(aten.min.default, F, per_input(1))


def _jvp_extremum_all(b, out, args, tangents, kwargs):
    """d max(x) = sum(dx · m) / sum(m) over every element, ``m = (x == max(x)) | isnan(x)``:
    ``evenly_distribute_backward``'s mask (``isnan(x)`` where the maximum is NaN, else ``x ==
    max``; the maximum is NaN exactly where some element is, and no element equals a NaN, so
    the union is that mask), which sends the gradient to the NaN elements (split evenly)
    rather than NaN everywhere. A union, not a select: ONNX Runtime has no ``Where`` over
    bools. Per input element the comparison, ``isnan``, the union, the count's sum, the
    divide, the product and the sum (7; the backward 6, the last sum's transpose an expand).
    Eager's forward mode (``evenly_read_jvp``) keeps ``x == max(x)`` and is NaN there, where
    the output is NaN anyway."""
    x = args[0]
    dims = list(range(len(shape(x))))
    kept = expand_back(b, out, shape(x), dims, False)
    mask = b.call(
        aten.logical_or.default,
        b.call(aten.eq.Tensor, x, kept),
        b.call(aten.isnan.default, x),
    )
    coef = b.call(aten.div.Tensor, mask, b.call(aten.sum.default, mask))
    return b.call(aten.sum.default, b.call(aten.mul.Tensor, tangents[0], coef))


def_jvp(aten.max.default)(_jvp_extremum_all)
def_jvp(aten.min.default)(_jvp_extremum_all)


def _var_args(op, args, kwargs):
    """``var``/``var_mean``'s input shape, reduced dims, keepdim, element count per output and
    correction (1 when unset, as PyTorch)."""
    a = bind(op, args, kwargs)
    xs = shape(a.self)
    dims = norm_dims(a.dim, len(xs))
    correction = 1 if a.correction is None else a.correction
    return xs, dims, bool(a.keepdim), _count(xs, dims), correction


@def_jvp(aten.var_mean.correction)
def _jvp_var_mean(b, out, args, tangents, kwargs):
    """mean' = mean(dx); var' = sum(dx * 2 (x - mean) / (n - correction))."""
    x = args[0]
    xs, dims, keepdim, n, correction = _var_args(aten.var_mean.correction, args, kwargs)
    tx = tangents[0]
    mean = b.getitem(out, 1)
    mean_k = mean if keepdim else expand_back(b, mean, xs, dims, False)
    centred = b.call(aten.sub.Tensor, x, mean_k)
    coef = b.call(aten.mul.Tensor, centred, 2.0 / max(n - correction, 1))
    t_var = b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, tx, coef), dims, keepdim)
    t_mean = b.call(aten.mean.dim, tx, dims, keepdim)
    return (t_var, t_mean)


@def_jvp(aten.var.correction)
def _jvp_var(b, out, args, tangents, kwargs):
    """var' = sum(dx · 2 (x − mean) / (n − correction)) over the reduced dims."""
    x = args[0]
    xs, dims, keepdim, n, correction = _var_args(aten.var.correction, args, kwargs)
    mean = b.call(aten.mean.dim, x, dims, True)
    coef = b.call(aten.mul.Tensor, b.call(aten.sub.Tensor, x, mean), 2.0 / max(n - correction, 1))
    return b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, tangents[0], coef), dims, keepdim)


# --- standard deviation: one op, whose derivative is 0 where it is 0 ------------------------------


@register_decomposition(aten.std.correction)
def _std(x, *args, **kwargs):
    """``std`` of a float32/float64 tensor stays one op (its rules below); other dtypes are
    traced as PyTorch's decomposition (``sqrt(var(x))`` computed in float32). Through the
    decomposition, the derivative at a zero standard deviation (a constant row) is ``0·inf``
    (NaN) from sqrt's, where eager's ``std_backward`` gives 0 (it masks ``std == 0``)."""
    if x.dtype in FULL_PRECISION:
        return NotImplemented
    fallback = torch_decomposition(aten.std.correction)
    assert fallback is not None  # PyTorch decomposes it (torch._decomp)
    return fallback(x, *args, **kwargs)


@register_decomposition(aten.std_mean.correction)
def _std_mean(x, dim=None, *, correction=None, keepdim: bool = False):
    """``std_mean`` of a float32/float64 tensor as the kept-whole ``std`` and a ``mean``, so
    that its standard deviation's derivative is 0 where it is 0, as eager's (``std_backward``);
    PyTorch's decomposition, ``var_mean`` and a square root, gave 0·inf there. Counted the
    same: ``std`` (1 per input element, 2 per output element) and ``mean`` (1 and 1) are
    ``var_mean`` (2 and 2) and the square root (1 per output element, a transcendental). Other
    dtypes are traced as PyTorch's decomposition."""
    if x.dtype not in FULL_PRECISION:
        fallback = torch_decomposition(aten.std_mean.correction)
        assert fallback is not None  # PyTorch decomposes it (torch._refs)
        return fallback(x, dim, correction=correction, keepdim=keepdim)
    dims = list(range(x.dim())) if dim is None else dim
    std = aten.std.correction(x, dims, correction=correction, keepdim=keepdim)
    return std, aten.mean.dim(x, dims, keepdim)


#: the parts of the decomposition it was traced as: ``var`` (1 per input element, 1 per output
#: element) and the square root (1 per output element, a transcendental)
def _std_cost(out, x, *args, **kwargs) -> NodeCost:
    m = numel(out)
    return NodeCost(flops=numel(x) + 2 * m, transcendentals=m)


register(aten.std.correction, F, _std_cost)


@def_jvp(aten.std.correction)
def _jvp_std(b, out, args, tangents, kwargs):
    """``where(std == 0, 0, var' / (2·std))``, ``var'`` as :func:`_jvp_var`: PyTorch's
    ``std_backward`` (``var_backward((grad / (result · 2)).masked_fill_(result == 0, 0))``), and
    its forward-mode rule. The divide is by ``where(std == 0, 1, 2·std)``, so that the transpose
    divides the selected cotangent by a finite value; the select makes a NaN or infinite tangent
    or cotangent at a zero standard deviation give 0, as eager. Per output element the
    comparison, the doubling, the safe value, the divide and the select (5), where sqrt's rule
    had the doubling and the divide (2); ``var'`` unchanged."""
    if tangents[0] is None:
        return None
    t_var = _jvp_var(b, out, args, tangents, kwargs)
    zero = b.call(aten.eq.Scalar, out, 0)
    safe = b.call(aten.where.ScalarSelf, zero, 1.0, b.call(aten.mul.Tensor, out, 2.0))
    return b.call(aten.where.ScalarSelf, zero, 0.0, b.call(aten.div.Tensor, t_var, safe))


# --- max/min along a dim (values and indices), argmax/argmin, any/all ---------------------------

#: integer results: their derivative is zero
_INTEGER_VALUED = (
    aten.argmax.default,
    aten.argmin.default,
    aten.any.dim,
    aten.any.dims,
    aten.any.default,
    aten.all.dim,
    aten.all.default,
)
for _op in (aten.max.dim, aten.min.dim, *_INTEGER_VALUED):
    register(_op, F, per_input(1))
for _op in _INTEGER_VALUED:
    def_zero(_op)
register(aten.histc.default, F, per_input(1))
def_zero(aten.histc.default)
register(aten.nonzero.default, F, per_input(1))
def_zero(aten.nonzero.default)


def _jvp_max_min_dim(op):
    """The tangent of the values is the input tangent gathered at the returned indices (the
    first extremum, as PyTorch's derivative); gather transposes to scatter_add."""

    def jvp(b, out, args, tangents, kwargs):
        a = bind(op, args, kwargs)
        dim = a.dim % max(len(shape(a.self)), 1)
        idx = b.getitem(out, 1)
        if not a.keepdim:
            idx = b.call(aten.unsqueeze.default, idx, dim)
        t = b.call(aten.gather.default, tangents[0], dim, idx)
        if not a.keepdim:
            t = b.call(aten.squeeze.dims, t, [dim])
        return (t, None)

    return jvp


def_jvp(aten.max.dim)(_jvp_max_min_dim(aten.max.dim))
def_jvp(aten.min.dim)(_jvp_max_min_dim(aten.min.dim))


# --- cumulative sum: linear; its transpose is a reversed cumulative sum --------------------------


@def_jvp(aten.cumsum.default)
def _jvp_cumsum(b, out, args, tangents, kwargs):
    return b.call(aten.cumsum.default, tangents[0], *args[1:], **kwargs)


@def_transpose(aten.cumsum.default)
def _transpose_cumsum(b, ct, args, kwargs, linear):
    """x̄ᵢ = Σ_{j ≥ i} ct_j: flip, cumsum, flip back along the dim."""
    dim = bind(aten.cumsum.default, args, kwargs).dim
    rev = b.call(aten.flip.default, ct, [dim])
    out = b.call(aten.flip.default, b.call(aten.cumsum.default, rev, dim), [dim])
    if dtype_of(out) != dtype_of(args[0]):
        out = b.call(aten._to_copy.default, out, dtype=dtype_of(args[0]))
    return [out] + [None] * (len(args) - 1)


# --- cumulative product: 1 multiply per element; its tangent is out · cumsum(dx / x) -----------


@def_jvp(aten.cumprod.default)
def _jvp_cumprod(b, out, args, tangents, kwargs):
    """d cumprod(x)ᵢ = Σ_{j ≤ i} (∏_{k ≤ i, k ≠ j} x_k) dx_j = cumprod(x)ᵢ · Σ_{j ≤ i} dx_j / x_j
    (PyTorch's ``cumprod_jvp`` for inputs without zeros; at an exact zero of ``x`` this gives
    nan/inf, where PyTorch takes a slower exact path). Linear in the tangent: divide, cumsum,
    multiply, each with its transpose."""
    a = bind(aten.cumprod.default, args, kwargs)
    x, dim = a.self, a.dim
    ratio = b.call(aten.div.Tensor, tangents[0], x)
    return b.call(aten.mul.Tensor, b.call(aten.cumsum.default, ratio, dim), out)


# --- product: 1 multiply per input element; its tangent is Σⱼ (∏_{k ≠ j} x_k) dxⱼ ----------------


def _others_product(b, x, dim):
    """``∏_{k ≠ j} x_k`` over the reduced elements, for every element ``j`` of ``x`` (``x``'s
    shape; ``dim`` the reduced dim, ``None`` for all), exact at zeros: ``p / x̃ⱼ`` where no other
    element is zero and 0 where one is, with ``x̃`` the input with its zeros replaced by 1 and
    ``p = ∏ x̃`` the product of the nonzero elements. So a reduction without zeros gets
    ``out / xⱼ`` (PyTorch's ``prod_backward`` for such inputs, ``result / input``); one with a
    single zero gets, at the zero, the product of the others and 0 elsewhere; one with two or
    more zeros 0 everywhere (what PyTorch's exact path, ``prod_safe_zeros_backward``, gives).

    7 FLOPs per element of ``x``: the zero test, the replacement, ``p`` (a prod, 1 per input
    element), the zero count (a sum, 1 per input element), the divide, the test that no other
    element is zero (the zero count equals the element's own) and the select. PyTorch's
    exclusive-product form (a prefix times a suffix ``cumprod``: 3 per element) is cheaper,
    but ONNX has no cumulative product, and a backward graph holding one would not export."""
    zero = b.call(aten.eq.Scalar, x, 0)
    nonzero = b.call(aten.where.ScalarSelf, zero, 1.0, x)
    if dim is None:  # 0-d results, broadcast against x
        p = b.call(aten.prod.default, nonzero)
        zeros = b.call(aten.sum.dim_IntList, zero, list(range(len(shape(x)))))
    else:
        p = b.call(aten.prod.dim_int, nonzero, dim, True)
        zeros = b.call(aten.sum.dim_IntList, zero, [dim], True)
    ratio = b.call(aten.div.Tensor, p, nonzero)
    alone = b.call(aten.eq.Tensor, zeros, zero)  # no zero among the others
    return b.call(aten.where.ScalarOther, alone, ratio, 0.0)


@def_jvp(aten.prod.dim_int)
def _jvp_prod(b, out, args, tangents, kwargs):
    """d ∏ⱼ xⱼ = Σⱼ (∏_{k ≠ j} x_k) dxⱼ: the coefficient exact at zeros
    (:func:`_others_product`, 7 FLOPs per input element, primal-only), then a multiply and a
    sum, linear in the tangent: 9 FLOPs per input element. Its transpose (the backward) is the
    cotangent expanded back and multiplied by the coefficient: 8 per input element."""
    a = bind(aten.prod.dim_int, args, kwargs)
    coef = _others_product(b, a.self, a.dim % max(len(shape(a.self)), 1))
    t = b.call(aten.mul.Tensor, tangents[0], coef)
    return b.call(aten.sum.dim_IntList, t, [a.dim], a.keepdim)


@def_jvp(aten.prod.default)
def _jvp_prod_all(b, out, args, tangents, kwargs):
    """The product of every element, as :func:`_jvp_prod` (9 FLOPs per input element, 8 in the
    backward)."""
    coef = _others_product(b, args[0], None)
    every = list(range(len(shape(args[0]))))  # as x.sum() traces: sum.dim_IntList over all dims
    return b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, tangents[0], coef), every)


# --- cumulative max/min: the tangent at the running extremum's index -----------------------------


def _jvp_cummax_cummin(op):
    """The values' tangent is the input tangent gathered at the returned indices (the
    extremum each prefix keeps, as PyTorch's ``cummaxmin_backward`` scatters there); gather
    transposes to scatter_add. The indices have no tangent."""

    def jvp(b, out, args, tangents, kwargs):
        dim = bind(op, args, kwargs).dim
        return (b.call(aten.gather.default, tangents[0], dim, b.getitem(out, 1)), None)

    return jvp


def_jvp(aten.cummax.default)(_jvp_cummax_cummin(aten.cummax.default))
def_jvp(aten.cummin.default)(_jvp_cummax_cummin(aten.cummin.default))


# --- log of the cumulative sum of exponentials ----------------------------------------------------


@def_jvp(aten.logcumsumexp.default)
def _jvp_logcumsumexp(b, out, args, tangents, kwargs):
    """d outᵢ = Σ_{j ≤ i} exp(x_j − outᵢ) dx_j = cumsum(exp(x − m) · dx)ᵢ · exp(m − outᵢ), with
    m the maximum of ``x`` along the dim, so no exponential overflows (m ≥ every x_j, and
    outᵢ ≥ x_j for j ≤ i). Linear in the tangent: multiply, cumsum, multiply."""
    a = bind(aten.logcumsumexp.default, args, kwargs)
    x, dim = a.self, a.dim
    m = b.call(aten.amax.default, x, [dim], True)
    weights = b.call(aten.exp.default, b.call(aten.sub.Tensor, x, m))
    scale = b.call(aten.exp.default, b.call(aten.sub.Tensor, m, out))
    acc = b.call(aten.cumsum.default, b.call(aten.mul.Tensor, tangents[0], weights), dim)
    return b.call(aten.mul.Tensor, acc, scale)
