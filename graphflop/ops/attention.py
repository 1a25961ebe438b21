"""Attention: no rules of its own. Scaled dot-product attention is traced in its math form by
:func:`sdpa`, so its two batched products are counted in ``mm_flops`` and its softmax, mask and
scaling as elementwise work (docs/flops_conventions.md: the dense kernel computes the full score
matrix).

:func:`sdpa` is also what :mod:`graphflop.frontend.composite` routes
``F.scaled_dot_product_attention`` to while tracing, so every device counts the same.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from graphflop.ops.registry import register_decomposition

aten = torch.ops.aten


@register_decomposition(aten.scaled_dot_product_attention.default)
def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """``scaled_dot_product_attention`` in its math form: ``softmax(q·kᵀ·scale + mask)·v``.

    Shapes as PyTorch's: q (…, L, E), k (…, S, E), v (…, S, Ev) → (…, L, Ev). The causal mask
    is a ``where`` over the scores built from two ``arange``; a given ``attn_mask`` is added
    (float) or applied with ``where`` (bool), and rows it masks entirely give zeros, as
    PyTorch's kernels do. One scaling of q (PyTorch's decomposition scales q and k, and builds a
    guard for fully masked rows even where no mask can make one). Grouped-query attention
    (``enable_gqa``, k/v with Hk heads dividing q's Hq) repeats each k/v head Hq/Hk times.
    """
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        # grouped-query attention: each k/v head serves Hq / Hk consecutive q heads (PyTorch's
        # math kernel repeats them the same way); copies, no FLOPs
        groups = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    neg_inf = float("-inf")
    if is_causal:
        rows = torch.arange(L, device=q.device).unsqueeze(1)
        cols = torch.arange(S, device=q.device).unsqueeze(0)
        scores = torch.where(rows >= cols, scores, neg_inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = torch.where(attn_mask, scores, neg_inf)
        else:
            scores = scores + attn_mask
    if attn_mask is not None:  # a row the mask hides entirely: zeros, not NaN
        weights = aten._safe_softmax.default(scores, -1)
    else:
        weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = aten.native_dropout.default(weights, dropout_p, True)[0]
    return torch.matmul(weights, v)


@register_decomposition(aten._safe_softmax.default)
def safe_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``_safe_softmax``, the softmax PyTorch's math attention kernel takes of masked scores:
    ``softmax(x, dim)`` with the rows (along ``dim``) that are all ``-inf`` set to zeros rather
    than NaN. One op in eager autograd: it saves its output only
    (tools/autograd/derivatives.yaml: ``_softmax_backward_data(grad, result, dim, ...)``), not
    the row guard (:data:`graphflop.frontend.composite.EAGER_SAVES`)."""
    weights = torch.softmax(x, dim=dim, dtype=dtype)
    live = torch.any(x != float("-inf"), dim=dim, keepdim=True)
    return torch.where(live, weights, 0.0)
