"""Custom ``torch.autograd.Function`` s in a traced model: traced through their ``forward``.

``torch.func.functionalize`` (the trace's first step) runs a custom Function only when the class
overrides ``setup_context`` and supports functionalization, which few do (transformers' Bloom
``GeLUFunction`` does not; ``RuntimeError: In order to use an autograd.Function with functorch
transforms ...``). graphflop builds its backward and JVP graphs from rules for ATen ops, not from
a Function's own ``backward``, so while tracing, :func:`inline_functions` makes
``Function.apply`` of a class defined outside PyTorch call the class's ``forward`` directly:
its ATen ops land in the graph, and graphflop differentiates them. The Function's own backward
is not used: where it is not the derivative of its forward (a straight-through estimator), the
graphs differ from what the model trains with, which the trace's warning says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import Function, _SingleLevelFunction
from torch.utils.checkpoint import CheckpointFunction

from graphflop.frontend.regions import run_checkpoint_function


class _Context:
    """What a Function's ``forward(ctx, ...)`` may call on ``ctx`` (nothing is kept for a
    backward: graphflop does not run it)."""

    def __init__(self, args: tuple) -> None:
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        pass

    def mark_dirty(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _own(cls: type) -> bool:
    """A Function class of the model's code, not one of PyTorch's own (checkpointing and
    friends keep their behaviour)."""
    module = getattr(cls, "__module__", "") or ""
    return module != "torch" and not module.startswith("torch.")


def _has_setup_context(cls: type) -> bool:
    return cls.setup_context is not _SingleLevelFunction.setup_context


@contextlib.contextmanager
def inline_functions(functorch_unsupported_only: bool = False) -> Iterator[list[str]]:
    """While active, ``Function.apply`` of a class outside PyTorch runs its ``forward`` (with
    a stand-in ``ctx`` for the ``forward(ctx, ...)`` form). Yields the list of the inlined
    classes' qualified names (each once), filled as they are met.

    ``functorch_unsupported_only``: inline only the classes without ``setup_context``, which
    ``torch.func`` cannot run at all (``--verify``'s reference: the others run with their own
    backward, against which graphflop's graphs are then checked)."""
    seen: list[str] = []
    original = Function.__dict__["apply"]

    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is CheckpointFunction:  # the reentrant checkpoint: args (function, rng, *args)
            return run_checkpoint_function(args[0], *args[2:])
        if not _own(cls) or (functorch_unsupported_only and _has_setup_context(cls)):
            return original.__get__(None, cls)(*args, **kwargs)
        name = cls.__qualname__
        if name not in seen:
            seen.append(name)
        if _has_setup_context(cls):
            return cls.forward(*args, **kwargs)
        return cls.forward(_Context(args), *args, **kwargs)

    Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield seen
    finally:
        Function.apply = original  # type: ignore[method-assign]
