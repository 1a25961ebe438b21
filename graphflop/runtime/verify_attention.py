"""Whether a model's attention runs with dropout, which ``--verify``'s references cannot match.

PyTorch's scaled dot-product attention kernels draw their dropout mask inside the kernel, a
different use of the generator than the ``native_dropout`` decomposition graphflop's graphs hold
(:mod:`graphflop.frontend.composite`), so for such a model a gradient or JVP comparison with
``torch.func`` measures the two masks' difference, not graphflop's derivatives.
:func:`graphflop.runtime.verify_all.verify_analysis` reports those checks as not run, with
:func:`attention_dropout_note`'s reason.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule
from torch.overrides import TorchFunctionMode

from graphflop.meta import SIGNATURE, Signature
from graphflop.runtime.verify import _cast, real_arguments, reference_loss_fn

_F_SDPA = F.scaled_dot_product_attention


class _AttentionDropoutProbe(TorchFunctionMode):
    """Records the largest ``dropout_p`` that ``F.scaled_dot_product_attention`` is called with
    while the block runs: calls made directly through this mode, calls from inside other
    ``torch.nn.functional`` functions (multi-head attention without weights, which run with
    the mode off) through ``torch.nn.functional``'s name pointed at :meth:`_sdpa`."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout_p = 0.0

    def _record(self, args: tuple, kwargs: dict) -> None:
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        self.dropout_p = max(self.dropout_p, float(p))

    def _sdpa(self, *args: Any, **kwargs: Any) -> Any:
        self._record(args, kwargs)
        return _F_SDPA(*args, **kwargs)

    def __enter__(self) -> _AttentionDropoutProbe:
        F.scaled_dot_product_attention = self._sdpa
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        F.scaled_dot_product_attention = _F_SDPA
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _F_SDPA:
            self._record(args, kwargs)
        return func(*args, **kwargs)


def attention_dropout(
    forward: GraphModule, model: nn.Module, examples: tuple[torch.Tensor, ...] | None = None
) -> float:
    """The largest ``dropout_p`` the reference's forward (:func:`reference_loss_fn`, one run
    without gradients on :func:`real_arguments`) passes to scaled dot-product attention; 0
    when it calls none with dropout (eval mode, ``dropout=0``, or attention that applies
    ``F.dropout`` to explicit weights, as ``nn.MultiheadAttention`` with ``need_weights``).

    PyTorch's attention kernels draw their dropout mask inside the kernel, in a different use
    of the generator than the ``native_dropout`` decomposition graphflop's graph holds, so a
    gradient or JVP comparison of such a model measures the two masks' difference, not
    graphflop's derivatives (:func:`attention_dropout_note`). ``examples``: the model's
    example inputs (:func:`real_arguments`).
    """
    values = real_arguments(forward, model, examples=examples)
    sig: Signature = forward.meta[SIGNATURE]
    params = {q: values[n] for n, q in sig.params}
    dtype = next(iter(params.values())).dtype if params else None
    probe = _AttentionDropoutProbe()
    # a probe's warnings are not the model's (checkpoint's: nothing requires grad here)
    with torch.no_grad(), probe, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference_loss_fn(forward, _cast(model, dtype), values)(params)
    return probe.dropout_p


def attention_dropout_note(dropout_p: float) -> str:
    """Why a comparison with a torch.func reference is not run for a model whose attention
    has dropout ``dropout_p`` > 0, and what to do, in one line."""
    return (
        f"attention with dropout_p={dropout_p:g}: PyTorch's attention kernel draws its dropout "
        "mask differently from graphflop's graph, so the two cannot agree; "
        "rerun with --eval or attention dropout 0"
    )
