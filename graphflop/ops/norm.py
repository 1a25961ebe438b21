"""Normalisation ops left after decomposition. Training-mode batch norm, layer norm, group norm
and vector norms decompose into elementwise ops and reductions (counted as the sum of their parts,
docs/flops_conventions.md; the decompositions are at the end of this file);
eval-mode batch norm stays one op, ``_native_batch_norm_legit_no_training``, counted as the same
parts: per element a subtract and a multiply (and a multiply by γ, an add of β), per channel an
add of ε and an rsqrt.
"""

from __future__ import annotations

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import FULL_PRECISION, numel, shape
from graphflop.ops.registry import (
    def_jvp,
    register,
    register_decomposition,
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


# --- decompositions ----------------------------------------------------------------------------
# Training-mode batch norm and layer norm as PyTorch decomposes them; vector norms too.
use_torch_decomposition(
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit.no_stats,
    aten.native_layer_norm,
    aten.linalg_vector_norm,
)


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
    out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        x, weight, bias, running_mean, running_var, True, momentum, eps
    )
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd
