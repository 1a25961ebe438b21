"""Normalisation ops left after decomposition. Training-mode batch norm, layer norm and group
norm decompose into elementwise ops and reductions (counted as the sum of their parts, FLOPS.md);
eval-mode batch norm stays one op, ``_native_batch_norm_legit_no_training``, counted as the same
parts: per element a subtract and a multiply (and a multiply by γ, an add of β), per channel an
add of ε and an rsqrt.
"""

from __future__ import annotations

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import numel, shape
from graphflop.ops.registry import def_jvp, register

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
