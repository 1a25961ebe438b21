"""Rules for the custom ops HuggingFace ``transformers`` defines (namespace ``transformers``),
registered when a graph first holds one (the ops exist only once transformers has defined
them: :func:`register_transformers_rules`, called by the rule table's lookup).

``transformers::grouped_mm_fallback(x, W, offs)``: the routed experts of a mixture-of-experts
layer on a CPU (or any device where ``torch._grouped_mm`` cannot be used): x (S, K) holds the S
token-expert pairs sorted by expert, W (E, K, N) the E experts' weights, offs (E,) the running
count of rows per expert; row r of the output is ``x[r] · W[e(r)]``. Every row meets exactly one
expert, so the cost is 2·S·K·N FLOPs (all in ``mm_flops``) whatever the split of rows among
experts: the routing changes which weights a row meets, not how many multiply-adds it takes.
The op is bilinear in (x, W) with ``offs`` constant: its JVP is ``op(dx, W) + op(x, dW)``; its
transpose gives x's cotangent ``op(ct, Wᵀ)`` (2·S·N·K) and W's, per expert ``x_gᵀ·ct_g``
(2·S·K·N), with graphflop's op ``graphflop::grouped_mm_weight_grad(x, ct, offs, E)`` (the
product transformers' backward computes; its backward op needs W, which the transpose of
``op(x, dW)`` does not have).
"""

from __future__ import annotations

from typing import Any

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import shape
from graphflop.ops.registry import def_bilinear, register

F = "linalg"


def _grouped_cost(out, x, w, offs, *args, **kwargs) -> NodeCost:
    """2·S·K·N for x (S, K) and W (E, K, N): one K-long product per output element."""
    s, k = shape(x)
    f = 2 * s * k * shape(w)[-1]
    return NodeCost(flops=f, mm_flops=f)


@torch.library.custom_op("graphflop::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(
    x: torch.Tensor, ct: torch.Tensor, offs: torch.Tensor, experts: int
) -> torch.Tensor:
    """Per group g of rows (``offs``: running row counts, one per group), ``x_gᵀ · ct_g``:
    (experts, K, N) for x (S, K) and ct (S, N); a group with no rows gets zeros."""
    out = x.new_zeros(experts, x.shape[1], ct.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[g] = x[start:end].T @ ct[start:end]
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _(x: torch.Tensor, ct: torch.Tensor, offs: torch.Tensor, experts: int) -> torch.Tensor:
    return x.new_empty(experts, x.shape[1], ct.shape[1])


def _weight_grad_cost(out, x, ct, offs, experts, *args, **kwargs) -> NodeCost:
    """2·S·K·N: every row's outer product x_r ⊗ ct_r added into its group's (K, N)."""
    s, k = shape(x)
    f = 2 * s * k * shape(ct)[-1]
    return NodeCost(flops=f, mm_flops=f)


def _transpose_grouped(op: Any):
    def transpose(b, ct, args, kwargs, linear):
        x, w, offs = args[:3]
        cts: list[Any] = [None, None, None]
        if linear[0]:  # op(dx, W): W is a primal
            wt = b.call(torch.ops.aten.transpose.int, w, 1, 2)
            cts[0] = b.call(op, ct, wt, offs)
        if linear[1]:  # op(x, dW): x is a primal
            grad = torch.ops.graphflop.grouped_mm_weight_grad.default
            cts[1] = b.call(grad, x, ct, offs, shape(w)[0])
        return cts

    return transpose


def register_transformers_rules() -> None:
    """Register the rules of the transformers ops that exist now (idempotent)."""
    ns = getattr(torch.ops, "transformers", None)
    if ns is None:
        return
    try:
        op = ns.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):  # a transformers without it
        return
    from graphflop.ops import registry

    if op in registry._TABLE:
        return
    register(torch.ops.graphflop.grouped_mm_weight_grad.default, F, _weight_grad_cost)
    register(op, F, _grouped_cost)
    def_bilinear(op, _transpose_grouped(op))
