"""Softmax, log-softmax and the losses: no rules of their own, they are traced as their parts
(docs/flops_conventions.md counts a composite op as the sum of its parts).

* softmax and log-softmax: :func:`_softmax`, :func:`_log_softmax` (a max, a subtraction, ``exp``,
  a sum and a division or ``log``) for float32/float64, PyTorch's decompositions otherwise;
* the NLL loss (cross-entropy is log-softmax then NLL) and the MSE loss: PyTorch's
  decompositions (``gather``, ``mean``, elementwise ops);
* the multilabel margin loss: :func:`_multilabel_margin_loss_forward`, PyTorch's decomposition
  less its error (it counts the target slots after a sample's first ``-1``).
"""

from __future__ import annotations

import torch

from graphflop.ops._common import FULL_PRECISION
from graphflop.ops.registry import (
    register_decomposition,
    torch_decomposition,
    use_torch_decomposition,
)

aten = torch.ops.aten

use_torch_decomposition(aten._log_softmax, aten._softmax, aten.nll_loss_forward, aten.mse_loss)


@register_decomposition(aten._softmax.default, dtypes=FULL_PRECISION)
def _softmax(x, dim: int, half_to_float: bool):
    """``exp(x - max) / Σ exp(x - max)`` along ``dim``."""
    if half_to_float:
        torch_softmax = torch_decomposition(aten._softmax.default)
        assert torch_softmax is not None, "PyTorch decomposes aten._softmax"
        return torch_softmax(x, dim, half_to_float)
    e = aten.exp.default(aten.sub.Tensor(x, aten.amax.default(x, [dim], True)))
    return aten.div.Tensor(e, aten.sum.dim_IntList(e, [dim], True))


@register_decomposition(aten._log_softmax.default, dtypes=FULL_PRECISION)
def _log_softmax(x, dim: int, half_to_float: bool):
    """``(x - max) - log Σ exp(x - max)`` along ``dim``."""
    if half_to_float:
        torch_log_softmax = torch_decomposition(aten._log_softmax.default)
        assert torch_log_softmax is not None, "PyTorch decomposes aten._log_softmax"
        return torch_log_softmax(x, dim, half_to_float)
    shifted = aten.sub.Tensor(x, aten.amax.default(x, [dim], True))
    total = aten.sum.dim_IntList(aten.exp.default(shifted), [dim], True)
    return aten.sub.Tensor(shifted, aten.log.default(total))


@register_decomposition(aten.multilabel_margin_loss_forward.default)
def _multilabel_margin_loss_forward(
    input: torch.Tensor, target: torch.Tensor, reduction: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, is_target)`` of ``F.multilabel_margin_loss``: per sample, over its targets ``j``
    (the entries of its row of ``target`` before the first ``-1``) and its classes ``i`` that
    are no target, ``sum max(0, 1 - (x[j] - x[i])) / C`` (PyTorch's documented formula, and
    its CPU kernel). PyTorch's decomposition (``torch._decomp``, 2.13) leaves the slots after
    the first ``-1`` in the sum, reading class 0 there (``[3, 0, -1, 1]`` over ``[.1, .2, .4,
    .8]``: 2.05 where eager gives 0.85); here they are masked out (docs/flops_conventions.md:
    ``N·C + N·C²`` FLOPs more, the mask's negation and union).

    Shapes: ``input`` and ``target`` ``(C,)`` or ``(N, C)``; ``loss`` a scalar (mean, sum) or
    ``(N,)`` (none, ``()`` for a vector input); ``is_target`` like ``target``, ``input``'s dtype.
    """
    x, t = torch.atleast_2d(input), torch.atleast_2d(target)
    classes = x.shape[1]
    torch._check(
        input.dim() <= 2 and classes != 0 and target.shape == input.shape,
        lambda: f"multilabel_margin_loss: input {tuple(input.shape)}, target {tuple(target.shape)}",
    )
    slot = torch.arange(classes, device=t.device)
    first_end = torch.amin(torch.where(t == -1, slot, classes), dim=-1, keepdim=True)
    held = slot < first_end  # (N, C): slot j holds one of the sample's targets
    picked = torch.gather(x, -1, torch.where(held, t, 0))  # x[y_j], (N, C)
    is_target = torch.any(slot == torch.where(held, t, -1).unsqueeze(-1), dim=1)  # (N, C)
    # terms (j, N, i): 1 - x[y_j] + x[i], kept where slot j holds a target and i is none
    terms = (1.0 - picked.T.unsqueeze(-1) + x).clamp_min(0) / classes
    terms = torch.where(is_target | ~held.T.unsqueeze(-1), 0, terms)
    if reduction == 1:  # mean
        loss = terms.sum(dim=(0, -1)).mean()
    elif reduction == 2:  # sum
        loss = terms.sum()
    else:
        loss = terms.sum(dim=(0, -1)).reshape(input.shape[:-1])
    return loss, is_target.to(input.dtype).reshape(target.shape)
