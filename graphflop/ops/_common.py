"""Shared pieces of the rule files: element counts, the common cost shapes, and an op call's
arguments by the names its ATen schema gives them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from graphflop.meta import NodeCost
from graphflop.ops.ghost import is_ghost

#: dtypes the lean decompositions handle; others use PyTorch's (which computes half precision
#: in float32)
FULL_PRECISION = (torch.float32, torch.float64)


def numel(t: Any) -> int:
    """Number of elements of a (fake) tensor; 0 for anything else."""
    return int(math.prod(t.shape)) if isinstance(t, torch.Tensor) else 0


def first_tensor(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def per_output(k: int = 1, transcendental: bool = False):
    """Cost: ``k`` FLOPs per element of the (first) output."""

    def cost(out, *args, **kwargs) -> NodeCost:
        n = numel(first_tensor(out))
        return NodeCost(flops=k * n, transcendentals=n if transcendental else 0)

    return cost


def per_input(k: int = 1, plus_per_output: int = 0):
    """Cost: ``k`` FLOPs per element of the first input (+ some per output element)."""

    def cost(out, x, *args, **kwargs) -> NodeCost:
        return NodeCost(flops=k * numel(x) + plus_per_output * numel(first_tensor(out)))

    return cost


def free(out, *args, **kwargs) -> NodeCost:
    """Cost of views, copies, creation and integer bookkeeping: 0 FLOPs."""
    return NodeCost()


def norm_dims(dims: Sequence[int] | int | None, ndim: int) -> list[int]:
    """Reduction dims as sorted non-negative ints; ``None``/``[]`` means all dims."""
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return list(range(ndim))
    return sorted(d % max(ndim, 1) for d in dims)


def value(v: Any) -> Any:
    """The tensor (a FakeTensor in the graphs) behind a graph value: an fx node's ``val``, a
    ghost's value, or a tensor itself."""
    if isinstance(v, torch.fx.Node):
        return v.meta["val"]
    if is_ghost(v):
        return v.val
    return v


def shape(v: Any) -> tuple[int, ...]:
    """Shape of a graph value (fx node with ``val``, ghost, or tensor)."""
    return tuple(value(v).shape)


def dtype(v: Any) -> torch.dtype:
    return value(v).dtype


def device(v: Any) -> torch.device:
    return value(v).device


class Arguments(SimpleNamespace):
    """An op call's arguments by schema name (``a.dim`` or ``a["dim"]``), defaults filled in.
    A namespace, not a dict, so that names such as ``values`` or ``indices`` are arguments."""

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)


def bind(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> Arguments:
    """The arguments of a call of the ATen overload ``op`` by the names in its schema
    (``op._schema.arguments``): positional ``args`` first, then ``kwargs``, then the schema's
    defaults for those not given (``aten.slice.Tensor(x)`` gives ``dim=0, start=None,
    end=None, step=1``).

    Raises:
        TypeError: for an argument the schema does not name, or a required one not given.
    """
    kwargs = kwargs or {}
    schema = op._schema
    names = [a.name for a in schema.arguments]
    if len(args) > len(names) or any(k not in names for k in kwargs):
        raise TypeError(f"{schema.name} takes ({', '.join(names)}): got {len(args)} and {kwargs}")
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            raise TypeError(f"{schema.name}: required argument {a.name!r} not given")
    return Arguments(**out)
