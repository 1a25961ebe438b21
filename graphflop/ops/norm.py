"""Normalisation ops. Layer norm, group norm, vector norms and batch norm without running
statistics decompose into elementwise ops and reductions (counted as the sum of their parts,
docs/flops_conventions.md; the decompositions are at the end of this file). The vector norm
of a float32/float64 tensor of order 2 or another finite order but 0 and 1 stays one op,
counted as the parts it was traced as, whose derivative is 0 where the norm is 0 (and for
p < 1 at a zero element), as eager's (the decomposition's ``pow(s, 1/p)`` gave 0·inf there).

Batch norm stays one op, as eager PyTorch runs it (one kernel), counted as the parts PyTorch's
decomposition (``torch._decomp``) makes of it:

* eval mode, ``_native_batch_norm_legit_no_training``: per element a subtract and a multiply
  (and a multiply by γ, an add of β), per channel an add of ε and an rsqrt;
* training mode, ``_native_batch_norm_legit_functional`` (any floating input whose γ, β and
  running statistics share its dtype: a 16-bit one too, which eager runs as one kernel reading
  and writing 16-bit tensors; mixed dtypes are traced as PyTorch's decomposition, which
  computes in float32): per element the
  ``var_mean`` (2), a subtract and a multiply (and a multiply by γ, an add of β); per channel
  ``var_mean``'s two divides, the add of ε and the rsqrt, the running mean's update
  (``m·μ + (1 − m)·r``: 3) and the running variance's (Bessel's correction n/(n − 1), then 3).

Its JVP is the decomposition's, written over the op's own outputs (the batch mean μ and the
inverse standard deviation ``rstd``; ``x − μ`` is recomputed, as the eager backward kernel
does); the weight's tangent enters as ``(x − μ)·(rstd·γ̇)`` since ``x̂`` is not a forward value
(so the backward's weight gradient is ``Σ ct·(x − μ)`` times ``rstd``, the eager kernel's). A
16-bit batch norm's tangent and cotangent ops run in its dtype (eager's backward kernel reads
and writes 16-bit tensors too).
"""

from __future__ import annotations

import math

import torch

from graphflop.meta import PARAM_DERIVED, NodeCost
from graphflop.ops._common import FULL_PRECISION, bind, norm_dims, numel, shape, value
from graphflop.ops.registry import (
    def_jvp,
    register,
    register_decomposition,
    torch_decomposition,
    use_torch_decomposition,
)

aten = torch.ops.aten
F = "norm"


def _bn_eval_cost(out, x, weight, bias, running_mean, running_var, *args, **kwargs):
    per_elem = 2 + (weight is not None) + (bias is not None)
    c = numel(running_var)
    return NodeCost(flops=per_elem * numel(x) + 2 * c, transcendentals=c)


register(aten._native_batch_norm_legit_no_training.default, F, _bn_eval_cost)


@def_jvp(aten._native_batch_norm_legit_no_training.default)
def _jvp_bn_eval(b, out, args, tangents, kwargs):
    """out = (x − μ)·rsqrt(σ² + ε)·γ + β with running μ, σ² (constants):
    d out = dx·(rsqrt·γ) + x̂·dγ + dβ, x̂ = (x − μ)·rsqrt."""
    x, weight, bias, mean, var, _momentum, eps = args
    tx, tw, tb = tangents[0], tangents[1], tangents[2]
    view = [1, shape(x)[1]] + [1] * (len(shape(x)) - 2)
    inv = b.call(aten.rsqrt.default, b.call(aten.add.Tensor, var, eps))
    t = None
    if tx is not None:
        scale = inv if weight is None else b.call(aten.mul.Tensor, inv, weight)
        t = b.call(aten.mul.Tensor, tx, b.call(aten.view.default, scale, view))
    if tw is not None:
        xhat = b.call(
            aten.mul.Tensor,
            b.call(aten.sub.Tensor, x, b.call(aten.view.default, mean, view)),
            b.call(aten.view.default, inv, view),
        )
        t = b.add(t, b.call(aten.mul.Tensor, xhat, b.call(aten.view.default, tw, view)))
    if tb is not None:
        t = b.add(t, b.call(aten.view.default, tb, view))
    if t is not None and shape(t) != shape(out.meta["val"][0]):
        t = b.call(aten.expand.default, t, list(shape(out.meta["val"][0])))
    return (t, None, None)


_BN_TRAIN = aten._native_batch_norm_legit_functional.default


def _bn_train_cost(out, x, *args, **kwargs):
    """The parts of PyTorch's decomposition (module docstring): per element ``var_mean`` (2), a
    subtract, a multiply, γ's multiply and β's add; per channel 11, one an rsqrt."""
    a = bind(_BN_TRAIN, (x, *args), kwargs)
    per_elem = 4 + (a.weight is not None) + (a.bias is not None)
    c = numel(out[1])
    return NodeCost(flops=per_elem * numel(x) + 11 * c, transcendentals=c)


register(_BN_TRAIN, F, _bn_train_cost)


@def_jvp(_BN_TRAIN)
def _jvp_bn_train(b, out, args, tangents, kwargs):
    """The tangents of (out, μ, rstd, new running mean, new running variance), as the
    decomposition's rules give them (``var_mean``, rsqrt, subtract, multiply, the affine):
    with ``c = x − μ`` (recomputed) and ``n`` elements per channel,
    ``μ̇ = mean(ẋ)``, ``σ̇² = Σ ẋ·c·2/n``, ``rstḋ = σ̇²·(−½·rstd³)``,
    ``ẋ̂ = (ẋ − μ̇)·rstd + c·rstḋ``, ``ȯut = ẋ̂·γ + c·(rstd·γ̇) + β̇``. The new running
    statistics get none (nothing but the buffers reads them, as in the decomposition)."""
    a = bind(_BN_TRAIN, args, kwargs)
    x, weight = a.input, a.weight
    tx, tw, tb = tangents[0], tangents[1], tangents[2]
    xs = shape(x)
    dims = [0, *range(2, len(xs))]
    c = xs[1]
    n = math.prod(xs) // max(c, 1)
    view = [1, c] + [1] * (len(xs) - 2)

    def chan(v):
        return b.call(aten.view.default, v, view)

    rstd = chan(b.getitem(out, 2))
    if tx is None and tw is None and tb is None:
        return (None,) * 5
    centred = b.call(aten.sub.Tensor, x, chan(b.getitem(out, 1)))
    t = t_w = t_mean = t_rstd = None
    if tw is not None:
        # emitted before the input's terms, so that the transpose (in reverse order) reaches
        # x − μ from the input's cotangent first, as it did through the decomposition
        scale = b.call(aten.mul.Tensor, rstd, chan(tw))
        # rstd·γ̇ carries the weight's tangent alone: its cotangent is a weight gradient
        scale.meta[PARAM_DERIVED] = True
        t_w = b.call(aten.mul.Tensor, centred, scale)
    if tx is not None:
        coef = b.call(aten.mul.Tensor, centred, 2.0 / max(n, 1))
        t_var = b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, tx, coef), dims, True)
        t_mean = b.call(aten.mean.dim, tx, dims, True)
        cube = b.call(aten.pow.Tensor_Scalar, rstd, 3)
        t_rstd = b.call(aten.mul.Tensor, t_var, b.call(aten.mul.Tensor, cube, -0.5))
        t = b.add(
            b.call(aten.mul.Tensor, b.sub(tx, t_mean), rstd),
            b.call(aten.mul.Tensor, centred, t_rstd),
        )
        if weight is not None:
            t = b.call(aten.mul.Tensor, t, chan(weight))
    t = b.add(t, t_w)
    if tb is not None:
        t = b.add(t, chan(tb))
    if t is not None and shape(t) != xs:
        t = b.call(aten.expand.default, t, list(xs))
    if t_mean is None:
        return (t, None, None, None, None)
    # the new running statistics' tangents are left out: only the buffers read them
    t_mean = b.call(aten.view.default, t_mean, [c])
    return (t, t_mean, b.call(aten.view.default, t_rstd, [c]), None, None)


# --- decompositions ----------------------------------------------------------------------------
# Layer norm and batch norm without running statistics as PyTorch decomposes them; vector norms.
use_torch_decomposition(
    aten._native_batch_norm_legit.no_stats,
    aten.native_layer_norm,
)

# --- the 2-norm and other finite orders: one op, derivative 0 where the norm is 0 ------------
_VECTOR_NORM = aten.linalg_vector_norm.default


def _is_kept_norm(x, ord, dim, dtype) -> bool:
    """Whether ``linalg_vector_norm(x, ord, dim, dtype=dtype)`` is kept whole: a float32 or
    float64 tensor computed in its own dtype, of order 2, or of another finite order but 0 and
    1 (whose decompositions, a count and ``sum(|x|)``, differentiate as eager) reduced over some
    dim longer than 1 (over dims of length 1 PyTorch's decomposition is ``|x|``, whose
    derivative is eager's)."""
    if x.dtype not in FULL_PRECISION or (dtype is not None and dtype != x.dtype):
        return False
    if ord == 2:
        return True
    if not math.isfinite(ord) or ord in (0, 1):
        return False
    return any(x.shape[d] != 1 for d in norm_dims(dim, x.dim())) if x.dim() else False


@register_decomposition(_VECTOR_NORM)
def _vector_norm(x, ord=2, dim=None, keepdim: bool = False, *, dtype=None):
    """The 2-norm and the other finite orders (:func:`_is_kept_norm`) of a float32/float64
    tensor stay one op (its rules below); the rest are traced as PyTorch's decomposition.
    Through the decomposition, ``pow(sum(pow(|x|, p)), 1/p)``, the derivative at a zero norm
    is ``0·inf`` (NaN), and for p < 1 at a zero element too, where eager's
    ``linalg_vector_norm_backward`` gives 0 (it masks them)."""
    if _is_kept_norm(x, ord, dim, dtype):
        return NotImplemented
    if dtype in FULL_PRECISION and dtype != x.dtype and x.is_floating_point():
        # computed in ``dtype``, as eager: the conversion, then the kept norm of that dtype
        return _VECTOR_NORM(aten._to_copy.default(x, dtype=dtype), ord, dim, keepdim)
    fallback = torch_decomposition(_VECTOR_NORM)
    assert fallback is not None  # PyTorch decomposes it (torch._decomp)
    return fallback(x, ord, dim, keepdim, dtype=dtype)


def _vector_norm_cost(out, x, *args, **kwargs):
    """The parts of the decomposition it was traced as, ``pow(sum(pow(|x|, p)), 1/p)``: per
    input element ``|x|`` (not for an even p, whose decomposition leaves it out), the power and
    the add of the sum (2 or 3), per output element the root (1); the two ``pow`` are
    transcendentals (n + m), as ``pow`` is everywhere."""
    n, m = numel(x), numel(out)
    ord = bind(_VECTOR_NORM, (x, *args), kwargs).ord
    per_input = 2 if ord % 2 == 0 else 3
    return NodeCost(flops=per_input * n + m, transcendentals=n + m)


register(_VECTOR_NORM, F, _vector_norm_cost)


@def_jvp(_VECTOR_NORM)
def _jvp_vector_norm(b, out, args, tangents, kwargs):
    """PyTorch's ``linalg_vector_norm_backward`` (``norm_backward``), also its forward-mode
    rule (``norm_jvp``), over the reduced dims:

    * p = 2: ``where(‖x‖ == 0, 0, Σ x·ẋ / ‖x‖)``. Per input element the product and the sum
      (2), per output element the comparison, the safe norm, the divide and the select (4).
    * p > 1: ``where(‖x‖ == 0, 0, Σ c·ẋ / ‖x‖^(p−1))``, ``c = x·|x|^(p−2)`` for p > 2 (3 per
      input element: ``|x|``, the power, the product), ``sign(x)·|x|^(p−1)`` for 1 < p < 2 (4:
      the sign too); then the product and the sum (2); per output element the comparison, the
      power (a transcendental), the safe value, the divide and the select (5).
    * p < 1: ``Σ c·ẋ · ‖x‖^(1−p)``, ``c = where(x == 0, 0, sign(x)·|x|^(p−1))`` (6 per input
      element; the power a transcendental), the product and the sum (2); per output element
      the power and the product (2).

    The divides are by ``where(‖x‖ == 0, 1, ·)``, so that the transpose (the backward) divides
    the selected cotangent by a finite value; the select makes a NaN or infinite tangent or
    cotangent at a zero norm give 0, as eager."""
    a = bind(_VECTOR_NORM, args, kwargs)
    x, p = a.self, a.ord
    assert _is_kept_norm(value(x), p, a.dim, a.dtype)
    if tangents[0] is None:
        return None
    dims = norm_dims(a.dim, len(shape(x)))
    if p == 2:
        coef, root = x, out
    elif p > 2:
        coef = b.call(
            aten.mul.Tensor, x, b.call(aten.pow.Tensor_Scalar, b.call(aten.abs.default, x), p - 2)
        )
        root = b.call(aten.pow.Tensor_Scalar, out, p - 1)
    else:
        power = b.call(aten.pow.Tensor_Scalar, b.call(aten.abs.default, x), p - 1)
        coef = b.call(aten.mul.Tensor, b.call(aten.sign.default, x), power)
        if p < 1:
            coef = b.call(aten.where.ScalarSelf, b.call(aten.eq.Scalar, x, 0), 0.0, coef)
        else:
            root = b.call(aten.pow.Tensor_Scalar, out, p - 1)
    s = b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, tangents[0], coef), dims, a.keepdim)
    if p < 1:
        return b.call(aten.mul.Tensor, s, b.call(aten.pow.Tensor_Scalar, out, 1 - p))
    zero = b.call(aten.eq.Scalar, out, 0)
    safe = b.call(aten.where.ScalarSelf, zero, 1.0, root)
    return b.call(aten.where.ScalarSelf, zero, 0.0, b.call(aten.div.Tensor, s, safe))


@register_decomposition(aten.native_layer_norm.default, dtypes=FULL_PRECISION)
def _layer_norm(x, normalized_shape, weight, bias, eps: float):
    """``(x - mean)·rsqrt(var + eps)·weight + bias`` over the trailing ``normalized_shape``
    dims; returns ``(out, mean, rstd)`` with mean and rstd kept as reduced dims. (PyTorch's
    decomposition, less its type-promotion wrappers: tracing GPT-2 XL spent half its time in
    those.)"""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    var, mean = aten.var_mean.correction(x, dims, correction=0, keepdim=True)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    out = aten.mul.Tensor(aten.sub.Tensor(x, mean), rstd)
    if weight is not None:
        out = aten.mul.Tensor(out, weight)
    if bias is not None:
        out = aten.add.Tensor(out, bias)
    return out, mean, rstd


@register_decomposition(aten.native_group_norm.default)
def _group_norm(x, weight, bias, n: int, c: int, hxw: int, groups: int, eps: float):
    """``native_group_norm`` as views, ``var_mean`` and elementwise ops: returns
    ``(out, mean, rstd)`` with mean and rstd of shape (N, groups), as PyTorch does (PyTorch's
    decomposition goes through ``as_strided``, which has no rule)."""
    xshape = list(x.shape)
    xg = x.reshape(n, groups, -1)
    var, mean = aten.var_mean.correction(xg, [2], correction=0, keepdim=True)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    out = aten.mul.Tensor(aten.sub.Tensor(xg, mean), rstd).reshape(xshape)
    chan = [1, c] + [1] * (len(xshape) - 2)
    if weight is not None:
        out = aten.mul.Tensor(out, aten.view.default(weight, chan))
    if bias is not None:
        out = aten.add.Tensor(out, aten.view.default(bias, chan))
    return out, aten.view.default(mean, [n, groups]), aten.view.default(rstd, [n, groups])


@register_decomposition(aten.native_batch_norm.default, aten._native_batch_norm_legit.default)
def _batch_norm(
    x, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float
):
    """``native_batch_norm`` with its running-statistics update made visible: the functional
    form, then ``copy_`` of the new statistics into the buffers (which tracing turns into buffer
    updates). Functionalisation cannot see this update: the op's schema does not mark the
    running statistics as written."""
    if not training:
        return aten._native_batch_norm_legit_no_training.default(
            x, weight, bias, running_mean, running_var, momentum, eps
        )
    if running_mean is None:
        return aten._native_batch_norm_legit.no_stats(x, weight, bias, True, momentum, eps)
    # one op (its rules above) where the statistics and the affine share the input's dtype,
    # as eager runs it: one kernel, whatever the dtype (bfloat16 and float16 read and write
    # 16-bit tensors and accumulate in float32 inside the kernel); PyTorch's parts for mixed
    # dtypes (a float32 γ on a bfloat16 input), whose dtypes the rules do not follow
    same = all(t is None or t.dtype == x.dtype for t in (weight, bias, running_mean, running_var))
    functional = _BN_TRAIN if same else torch_decomposition(_BN_TRAIN)
    assert functional is not None  # PyTorch decomposes it (torch._decomp)
    out, mean, rstd, new_mean, new_var = functional(
        x, weight, bias, running_mean, running_var, True, momentum, eps
    )
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd


@register_decomposition(aten._weight_norm_interface.default)
def _weight_norm_interface(v, g, dim: int = 0):
    """Weight norm's fused op: returns ``(v·(g / ‖v‖), ‖v‖)``, the norms over every dim of ``v``
    but ``dim``, kept (``g``'s shape). PyTorch's decomposition, but for the norms' dtype:
    float32 for a float16 ``g`` as for a bfloat16 one, as eager's kernels make them
    (``weight_norm_cpu`` in aten/src/ATen/native/WeightNorm.cpp, and the CUDA kernel; the
    decomposition in ``torch._decomp``, PyTorch 2.13, keeps a float16 ``g``'s dtype, 2 bytes a
    norm where autograd saves 4)."""
    keep = [i for i in range(v.dim()) if i != dim]
    low = g.dtype in (torch.float16, torch.bfloat16)
    norm = v.norm(2, keep, keepdim=True, dtype=torch.float32 if low else None)
    return v * (g / norm.to(g.dtype)), norm
