"""Softmax, log-softmax and the losses: no rules of their own, they are traced as their parts
(docs/flops_conventions.md counts a composite op as the sum of its parts).

* softmax and log-softmax: :func:`_softmax`, :func:`_log_softmax` (a max, a subtraction, ``exp``,
  a sum and a division or ``log``) for float32/float64, PyTorch's decompositions otherwise;
* the NLL loss (cross-entropy is log-softmax then NLL) and the MSE loss: PyTorch's
  decompositions (``gather``, ``mean``, elementwise ops).
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
