"""The losses a traced graph can end in, and the one place their values are computed.

:func:`loss_value` is used both while tracing (:func:`graphflop.frontend.trace.trace`) and by
``--verify``'s eager reference, so the two always compute the same loss. Writes no meta key
(tracing records the chosen kind in ``gm.meta[LOSS_KIND]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

#: the loss kinds :func:`graphflop.frontend.trace.trace` accepts (besides ``auto``)
LOSSES = ("cross_entropy", "mse", "sum", "output", "none")


def loss_value(
    kind: str, first: torch.Tensor, targets: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """The scalar loss of kind ``kind`` (one of :data:`LOSSES` but ``none``) of the model's
    first output: cross-entropy or MSE against ``targets[0]``, the sum, or the output itself
    (``output``: the model computes its own loss).

    The sum of a complex output is the sum of its real and imaginary parts
    (``view_as_real(first).sum()``): a loss must be a real scalar to have a gradient (PyTorch's
    ``backward`` refuses a complex one), and this one reaches every part of the output."""
    if kind == "cross_entropy":
        return F.cross_entropy(first, targets[0])
    if kind == "mse":
        return F.mse_loss(first, targets[0])
    if kind == "sum":
        return torch.view_as_real(first).sum() if first.is_complex() else first.sum()
    return first


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output: a tensor, or tuples, lists, dicts and namedtuples of
    them in ``torch.utils._pytree`` order (transformers' ``ModelOutput`` included), with a
    plain ``@dataclass`` read field by field, in declaration order."""
    tensors: list[torch.Tensor] = []
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for f in dataclasses.fields(leaf):
                tensors += output_tensors(getattr(leaf, f.name))
    return tensors


def loss_output(out: Any) -> Any:
    """The output the loss is computed from: the first floating-point (or complex) tensor of
    a model's output (:func:`output_tensors`), else its first tensor (a model may return its
    predicted classes first, then the logits); None when it holds no tensor."""
    tensors = output_tensors(out)
    return next(filter(differentiable, tensors), tensors[0] if tensors else None)


def default_loss(out: Any) -> str:
    """Cross-entropy for ``(N, C)`` floating logits (:func:`loss_output`); ``none`` when the
    output holds no floating-point or complex tensor (nothing to differentiate, e.g. a model
    ending in argmax); ``sum`` otherwise."""
    first = loss_output(out)
    if not differentiable(first):
        return "none"
    if first.dim() == 2 and first.is_floating_point():
        return "cross_entropy"
    return "sum"


#: why a model's output gives no loss: the wording every refusal and note shares
NO_FLOAT_OUTPUT = (
    "the model's output has no floating-point tensor to differentiate (e.g. it ends in argmax)"
)


def differentiable(t: Any) -> bool:
    """Whether ``t`` is a floating-point or complex tensor (one a loss can be taken of)."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def make_targets(
    loss: str, out: torch.Tensor, fake_mode: FakeTensorMode, inside: bool = False
) -> tuple:
    """Loss targets for ``out``: class indices of shape (N,) (cross-entropy) or a tensor like
    ``out`` (MSE); ``()`` for the other kinds. ``inside``: already under ``fake_mode`` (while
    tracing)."""
    with contextlib.nullcontext() if inside else fake_mode:
        if loss == "cross_entropy":
            return (torch.zeros(out.shape[0], dtype=torch.long, device=out.device),)
        if loss == "mse":
            return (torch.empty(out.shape, dtype=out.dtype, device=out.device),)
    return ()
