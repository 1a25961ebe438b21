"""What loading a model spec gives, shared by every kind of spec (:mod:`graphflop.load`'s
files, modules, ``torchvision:`` and ``timm:``; :mod:`graphflop.hf`'s ``hf:``): the loaded model
(:class:`LoadedModel`), the one error a bad spec raises (:class:`SpecError`) and
:func:`onto_meta`. :mod:`graphflop.load` re-exports the first two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LoadedModel", "SpecError", "onto_meta"]


class SpecError(ValueError):
    """A model spec, input shape or dtype that cannot be used; the message says what to do."""


@dataclass
class LoadedModel:
    """A model ready to trace.

    Attributes:
        name: display name (``file.py:Name``).
        model: the module (in train mode unless asked otherwise).
        example_inputs: tuple of real tensors (small, from ``example_inputs()``) or None: the
            tensor arguments of the call, when ``example_inputs()`` gives keyword or
            non-tensor arguments too (the model is then bound to them,
            :mod:`graphflop.frontend.inputs`).
        notes: what loading changed that the user should know (one line each).
        seq_inputs: the names of the default inputs whose length a sequence length sets
            (``hf:`` models: token ids, audio samples; empty for a vision model), or None for
            a spec that takes no sequence length.
    """

    name: str
    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...] | None
    notes: tuple[str, ...] = ()
    seq_inputs: tuple[str, ...] | None = None


def onto_meta(model: nn.Module) -> tuple[str, ...]:
    """Move parameters and buffers a constructor made off the meta device (``torch.Tensor(n)``
    ignores the default device) onto it; one note naming them."""
    moved = []
    for path, m in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            table = getattr(m, kind)
            for k, t in table.items():
                if t is None or t.is_meta:
                    continue
                table[k] = (
                    nn.Parameter(t.to("meta"), t.requires_grad)
                    if isinstance(t, nn.Parameter)
                    else t.to("meta")
                )
                moved.append(f"{path}.{k}" if path else k)
    if not moved:
        return ()
    shown = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
    return (
        f"{len(moved)} parameter(s)/buffer(s) were built off the meta device ({shown}); "
        "moved onto it",
    )
