"""Composite ops routed to graphflop's decompositions while :func:`~graphflop.frontend.trace.trace`
runs (a ``TorchFunctionMode`` plus, while it is on, ``torch.nn.functional``'s names pointed at the
same functions: a process-wide patch, undone on leaving).

Writes no meta key.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from graphflop.ops.attention import sdpa

aten = torch.ops.aten

_F_DROPOUT = F.dropout
_F_SDPA = F.scaled_dot_product_attention


def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    """``F.dropout`` whose training mode is ``native_dropout`` on every device."""
    if training and 0 < p < 1 and not inplace:
        return aten.native_dropout.default(input, p, True)[0]
    return _F_DROPOUT(input, p, training, inplace)


class CompositeOps(TorchFunctionMode):
    """Routes composite ops that :func:`~graphflop.frontend.trace.trace` must see whole to
    graphflop's decompositions.

    ``torch.func.functionalize`` (which tracing uses) lets composite ops decompose in C++ before
    the tracer sees them, skipping the decomposition table:

    * scaled dot-product attention would become the CPU kernel's math form (PyTorch scales q and
      k and guards fully masked rows); it goes to :func:`graphflop.ops.attention.sdpa`;
    * training-mode dropout would become ``bernoulli_`` and a division on CPU and meta tensors;
      it goes to ``native_dropout`` (:func:`dropout`), as ``torch.export`` and CUDA have it.

    So a model counts the same on every device. Calls made directly are caught by this mode;
    calls from inside other ``torch.nn.functional`` functions (multi-head attention), which run
    with the mode switched off, by pointing ``torch.nn.functional``'s names at the same
    functions while the mode is on.
    """

    def __enter__(self) -> CompositeOps:
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        F.scaled_dot_product_attention, F.dropout = _F_SDPA, _F_DROPOUT
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _F_SDPA:
            return sdpa(*args, **kwargs)
        if func is _F_DROPOUT:
            return dropout(*args, **kwargs)
        if func is torch.dropout:
            return dropout(
                *args, **{"training" if k == "train" else k: v for k, v in kwargs.items()}
            )
        return func(*args, **kwargs)
