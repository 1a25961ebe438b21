"""The op database's case type, sample-input makers and module helpers (see :mod:`graphflop.testing.opdb`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: one example input: a shape (float64 ``randn``) or a (shape, dtype) pair
InputSpec = tuple[int, ...] | tuple[tuple[int, ...], torch.dtype]

#: the per-case checks of graphflop.testing.checks (keys of ``OpCase.xfail``)
CHECKS = ("flops", "jvp", "fd", "vjp", "dot", "rules", "no_backward", "mm_ratio", "aten")
#: the checks that need the JVP and backward graphs
GRAPH_CHECKS = tuple(c for c in CHECKS if c != "flops")


@dataclass(frozen=True)
class OpCase:
    """One entry of the op database.

    Attributes:
        name: test id.
        module: builds the module (called under a fixed seed; :func:`build_module` casts it to
            float64).
        inputs: example inputs, one :data:`InputSpec` per positional input, or a function of a
            ``torch.Generator`` returning the input tensors.
        flops: expected forward FLOPs of the model (docs/flops_conventions.md), or None when not worked out.
        aten: the op overloads (``aten.mm.default`` names) the case is meant to exercise; each
            must appear in one of its traced or generated graphs.
        xfail: check name (or ``*``) -> reason, for known graphflop bugs and missing rules.
    """

    name: str
    module: Callable[[], nn.Module]
    inputs: tuple[InputSpec, ...] | Callable[[torch.Generator], tuple[torch.Tensor, ...]]
    flops: int | None = None
    aten: tuple[str, ...] = ()
    xfail: Mapping[str, str] = field(default_factory=dict)


class Fn(nn.Module):
    """``forward(*xs) = fn(self, *xs)`` with the given parameters and buffers."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        params: Mapping[str, Any] | None = None,
        buffers: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        self.fn = fn
        for k, v in (params or {}).items():
            self.register_parameter(k, nn.Parameter(_make(v)))
        for k, v in (buffers or {}).items():
            self.register_buffer(k, _make(v))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(self, *xs)


class Readout(nn.Module):
    """``inner(x) * r`` with a fixed random buffer ``r`` of the output's shape, so that the sum
    loss weighs every output element differently."""

    def __init__(self, inner: nn.Module, out_shape: tuple[int, ...]):
        super().__init__()
        self.inner = inner
        self.register_buffer("r", torch.randn(out_shape))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.inner(*xs) * self.r


def _make(v: Any) -> torch.Tensor:
    if callable(v):
        return v()
    if isinstance(v, torch.Tensor):
        return v
    return torch.randn(v)


def pos(*shape: int) -> Callable[[], torch.Tensor]:
    """A parameter initialiser with values in [0.5, 1.5) (divisors, sqrt arguments)."""
    return lambda: torch.rand(shape) + 0.5


def index(high: int, *shape: int) -> Callable[[], torch.Tensor]:
    """A fixed int64 index buffer with values in [0, high)."""
    return lambda: torch.randint(0, high, shape)


def randomized(m: nn.Module) -> nn.Module:
    """``m`` with every parameter redrawn from randn (LayerNorm/BatchNorm start at 1 and 0)."""
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    return m


def build_module(case: OpCase, seed: int = 0) -> nn.Module:
    """The case's module, in float64, built under ``seed``."""
    torch.manual_seed(seed)
    return case.module().double()


def make_inputs(case: OpCase, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The case's example inputs (float64 unless the spec says otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    if callable(case.inputs):
        return tuple(case.inputs(gen))
    out = []
    for spec in case.inputs:
        if len(spec) == 2 and isinstance(spec[1], torch.dtype):
            shape, dtype = spec
        else:
            shape, dtype = spec, torch.float64
        out.append(torch.randn(tuple(shape), generator=gen, dtype=dtype))
    return tuple(out)


def module_of(f, params=None, buffers=None):
    """A factory of :class:`Fn` modules computing ``f(self, *inputs)`` with the given parameter
    and buffer shapes."""
    return lambda: Fn(f, params, buffers)


def readout_of(factory, out_shape):
    """A factory wrapping ``factory()``'s module in a :class:`Readout` of ``out_shape``."""
    return lambda: Readout(factory(), out_shape)


def scale_slice(h):
    """An in-place write into a view of an intermediate (``h[:, :2] *= 2``)."""
    h[:, :2] *= 2
    return h


def set_row(h, v):
    """An in-place assignment into a view of an intermediate (``h[:, 1] = v``)."""
    h[:, 1] = v
    return h


aten = torch.ops.aten
X = (2, 3, 4)  # the elementwise cases' input: 24 elements
W = (3, 4)  # their weight, broadcast over the batch
ALL = "*"
