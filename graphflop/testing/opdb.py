"""The op database: one :class:`OpCase` per op (or pattern) graphflop has rules for.

In the style of PyTorch's OpInfo (STYLE.md): each entry is a tiny ``nn.Module`` whose forward
exercises mainly one core-ATen op, with example input shapes, the forward FLOPs worked out by
hand from FLOPS.md (arithmetic in the comment; the model's own forward only, the traced ``sum``
loss excluded) and the ATen ops it is meant to exercise. :mod:`graphflop.testing.checks` runs
every entry through the same checks (FLOPs, JVP vs ``torch.func.jvp`` and finite differences, VJP vs
``torch.func.grad``, the dot-product test, rule coverage).

Conventions:

* Modules are built in float64 by :func:`build_module` under a fixed seed. Parameters are random
  (``randn``) unless a case needs them positive, so weight tangents and cotangents are exercised;
  model inputs are differentiated too.
* The traced loss is ``output.sum()``. Where that sum would hide a wrong derivative (shape ops,
  reductions, pooling, normalisation: the sum is invariant under a permutation, or its gradient
  is zero), the module multiplies its output by a fixed random ``readout`` buffer ``r``.
* Inputs are ``randn``; ops that need positive arguments (log, sqrt, ...) make them positive
  inside the module (``exp(x) + 1``, ``x*x + w`` with positive ``w``).
* ``xfail`` maps a check name of :mod:`graphflop.testing.checks` (one of :data:`CHECKS`, or
  ``*`` for all) to the reason: a graphflop bug or missing rule, documented precisely.
  ``tests/test_ops.py`` marks those checks ``xfail(strict=True)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
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
        flops: expected forward FLOPs of the model (FLOPS.md), or None when not worked out.
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


def _fn(f, params=None, buffers=None):
    return lambda: Fn(f, params, buffers)


def _ro(factory, out_shape):
    return lambda: Readout(factory(), out_shape)


def _scale_slice(h):
    h[:, :2] *= 2
    return h


def _set_row(h, v):
    h[:, 1] = v
    return h


aten = torch.ops.aten
X = (2, 3, 4)  # the elementwise cases' input: 24 elements
W = (3, 4)  # their weight, broadcast over the batch
_ALL = "*"

# ---------------------------------------------------------------------------------------------
# matrix products
# ---------------------------------------------------------------------------------------------
LINALG = [
    OpCase(
        "linear_nobias",
        lambda: nn.Linear(4, 3, bias=False),
        ((2, 4),),
        flops=2 * 2 * 4 * 3,  # mm (2x4)(4x3): 48
        aten=("aten.mm.default", "aten.permute.default"),
    ),
    OpCase(
        "linear",
        lambda: nn.Linear(4, 3),
        ((2, 4),),
        flops=2 * 2 * 4 * 3 + 2 * 3,  # addmm: 48 matrix + 6 bias adds = 54
        aten=("aten.addmm.default",),
    ),
    OpCase(
        "bmm",
        _fn(lambda s, x: torch.bmm(x, s.w), {"w": (2, 4, 3)}),
        ((2, 3, 4),),
        flops=2 * 2 * 3 * 4 * 3,  # bmm 2x(3x4)(4x3): 144
        aten=("aten.bmm.default",),
    ),
    OpCase(
        "attention",
        _fn(
            lambda s, x: (
                torch.softmax((x @ s.wq) @ (x @ s.wk).transpose(-2, -1) / 2.0, -1) @ (x @ s.wv)
            ),
            {"wq": (4, 4), "wk": (4, 4), "wv": (4, 4)},
        ),
        ((2, 3, 4),),
        # 3 projections mm (6x4)(4x4): 3*192 = 576; scores bmm 2x(3x4)(4x3): 144; /2: 18;
        # softmax on 18 elements: amax 18 + sub 18 + exp 18 + sum 18 + div 18 = 90;
        # bmm 2x(3x3)(3x4): 144 -> 576 + 144 + 18 + 90 + 144 = 972
        flops=576 + 144 + 18 + 90 + 144,
        aten=("aten.mm.default", "aten.bmm.default", "aten.expand.default", "aten.amax.default"),
    ),
]

# ---------------------------------------------------------------------------------------------
# convolutions: 2*N*Cout*prod(out)*(Cin/G)*prod(k), + N*Cout*prod(out) for a bias
# ---------------------------------------------------------------------------------------------
CONV = [
    OpCase(
        "conv2d",
        lambda: nn.Conv2d(2, 3, 3),
        ((2, 2, 5, 5),),
        flops=2 * 2 * 3 * 9 * 2 * 9 + 2 * 3 * 9,  # out (2,3,3,3): 1944 + 54 = 1998
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv2d_groups2",
        lambda: nn.Conv2d(4, 6, 3, groups=2, bias=False),
        ((1, 4, 5, 5),),
        flops=2 * 1 * 6 * 9 * (4 // 2) * 9,  # out (1,6,3,3): 1944
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv2d_depthwise",
        lambda: nn.Conv2d(3, 3, 3, groups=3, padding=1),
        ((2, 3, 4, 4),),
        flops=2 * 2 * 3 * 16 * 1 * 9 + 2 * 3 * 16,  # out (2,3,4,4): 1728 + 96 = 1824
        aten=("aten.convolution.default",),
    ),
    # (H + 2p - k) % stride = (6 + 2 - 3) % 2 = 1: the last input row is read by no output
    OpCase(
        "conv2d_stride2_pad1",
        lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1),
        ((1, 2, 6, 6),),
        flops=2 * 1 * 3 * 9 * 2 * 9 + 1 * 3 * 9,  # out (1,3,3,3): 972 + 27 = 999
        aten=("aten.convolution.default", "aten.constant_pad_nd.default"),
    ),
    OpCase(
        "conv2d_dilation2",
        lambda: nn.Conv2d(2, 2, 3, dilation=2),
        ((1, 2, 7, 7),),
        flops=2 * 1 * 2 * 9 * 2 * 9 + 1 * 2 * 9,  # out (1,2,3,3): 648 + 18 = 666
        aten=("aten.convolution.default",),
    ),
    # H: (6+2-3)//2+1 = 3, W: (5-2*(2-1)-1)//1+1 = 3; (6+2-3) % 2 = 1
    OpCase(
        "conv2d_mixed",
        lambda: nn.Conv2d(4, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2),
        ((1, 4, 6, 5),),
        flops=2 * 1 * 4 * 9 * 2 * 6 + 1 * 4 * 9,  # out (1,4,3,3): 864 + 36 = 900
        aten=("aten.convolution.default",),
    ),
    # an even kernel with padding="same" pads asymmetrically (1 left, 2 right): pad + conv
    OpCase(
        "conv2d_same_even",
        lambda: nn.Conv2d(2, 2, 4, padding="same"),
        ((1, 2, 5, 5),),
        flops=2 * 1 * 2 * 25 * 2 * 16 + 1 * 2 * 25,  # out (1,2,5,5): 3200 + 50 = 3250
        aten=("aten.convolution.default", "aten.constant_pad_nd.default"),
    ),
    OpCase(
        "conv1d",
        lambda: nn.Conv1d(2, 3, 3),
        ((2, 2, 8),),
        flops=2 * 2 * 3 * 6 * 2 * 3 + 2 * 3 * 6,  # out (2,3,6): 432 + 36 = 468
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv3d",
        lambda: nn.Conv3d(2, 2, 2),
        ((1, 2, 3, 3, 3),),
        flops=2 * 1 * 2 * 8 * 2 * 8 + 1 * 2 * 8,  # out (1,2,2,2,2): 512 + 16 = 528
        aten=("aten.convolution.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# unary elementwise ops on x * w (x (2,3,4), w (3,4)): mul 24 + op 24 unless noted
# ---------------------------------------------------------------------------------------------
UNARY = [
    OpCase(
        "relu",
        _fn(lambda s, x: torch.relu(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.relu.default",),
    ),
    OpCase(
        "exp",
        _fn(lambda s, x: torch.exp(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.exp.default",),
    ),
    OpCase(
        "log",
        _fn(lambda s, x: torch.log(torch.exp(x * s.w) + 1), {"w": W}),
        (X,),
        flops=24 * 4,  # mul, exp, add, log
        aten=("aten.log.default",),
    ),
    OpCase(
        "tanh",
        _fn(lambda s, x: torch.tanh(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.tanh.default", "aten.rsub.Scalar"),
    ),
    OpCase(
        "sigmoid",
        _fn(lambda s, x: torch.sigmoid(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.sigmoid.default",),
    ),
    OpCase(
        "sqrt",
        _fn(lambda s, x: torch.sqrt(x * x + s.w), {"w": pos(*W)}),
        (X,),
        flops=24 * 3,  # mul, add, sqrt
        aten=("aten.sqrt.default",),
    ),
    OpCase(
        "rsqrt",
        _fn(lambda s, x: torch.rsqrt(x * x + s.w), {"w": pos(*W)}),
        (X,),
        flops=24 * 3,
        aten=("aten.rsqrt.default",),
    ),
    OpCase(
        "pow2",
        _fn(lambda s, x: (x * s.w) ** 2, {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.pow.Tensor_Scalar",),
    ),
    OpCase(
        "pow3",
        _fn(lambda s, x: (x * s.w) ** 3, {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.pow.Tensor_Scalar",),
    ),
    OpCase(
        "abs",
        _fn(lambda s, x: torch.abs(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.abs.default",),
    ),
    OpCase(
        "neg",
        _fn(lambda s, x: -(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.neg.default",),
    ),
    OpCase(
        "reciprocal",
        _fn(lambda s, x: (x * x + s.w).reciprocal(), {"w": pos(*W)}),
        (X,),
        flops=24 * 3,
        aten=("aten.reciprocal.default",),
    ),
    OpCase(
        "erf",
        _fn(lambda s, x: torch.erf(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.erf.default",),
    ),
    OpCase(
        "gelu",
        _fn(lambda s, x: F.gelu(x * s.w), {"w": W}),
        (X,),
        flops=24 * 6,  # mul; 0.5*x, x/sqrt(2), erf, +1, product
        aten=("aten.erf.default",),
    ),
    OpCase(
        "silu",
        _fn(lambda s, x: F.silu(x * s.w), {"w": W}),
        (X,),
        flops=24 * 3,  # mul; sigmoid, product
        aten=("aten.sigmoid.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# binary elementwise ops with broadcasting and scalars: 1 FLOP per output element
# ---------------------------------------------------------------------------------------------
BINARY = [
    OpCase(
        "add_broadcast",
        _fn(lambda s, x: x + s.w, {"w": (3, 1)}),
        (X,),
        flops=24,
        aten=("aten.add.Tensor", "aten.expand.default"),
    ),
    OpCase(
        "add_alpha",
        _fn(lambda s, x: torch.add(x, s.w, alpha=2.0), {"w": (3, 1)}),
        (X,),
        flops=24,
        aten=("aten.add.Tensor",),
    ),
    OpCase(
        "sub_broadcast",
        _fn(lambda s, x: x - s.w, {"w": (3, 1)}),
        (X,),
        flops=24,
        aten=("aten.sub.Tensor",),
    ),
    OpCase(
        "sub_broadcast_lhs",
        _fn(lambda s, x: s.w - x, {"w": (3, 1)}),
        (X,),
        flops=24,
        aten=("aten.sub.Tensor",),
    ),
    OpCase(
        "mul_broadcast",
        _fn(lambda s, x: x * s.w, {"w": (3, 1)}),
        (X,),
        flops=24,
        aten=("aten.mul.Tensor",),
    ),
    OpCase(
        "mul_broadcast_both",
        _fn(lambda s, x, y: x * y * s.w, {"w": (1, 4)}),
        ((2, 1, 4), (3, 1)),
        flops=24 + 24,  # (2,1,4) * (3,1) -> (2,3,4): 24; * w (1,4): 24
        aten=("aten.mul.Tensor",),
    ),
    OpCase(
        "div_broadcast",
        _fn(lambda s, x: x / s.w, {"w": pos(3, 1)}),
        (X,),
        flops=24,
        aten=("aten.div.Tensor",),
    ),
    OpCase(
        "div_by_input",
        _fn(lambda s, x: s.w / (x * x + 1), {"w": W}),
        (X,),
        flops=24 * 3,  # mul, add, div
        aten=("aten.div.Tensor",),
    ),
    OpCase(
        "scalar_arith",
        _fn(lambda s, x: 1.0 - ((x * s.w) * 2.5 + 1.5) / 4.0, {"w": W}),
        (X,),
        flops=24 * 5,  # mul, *2.5, +1.5, /4, 1-
        aten=("aten.mul.Tensor", "aten.add.Tensor", "aten.div.Tensor", "aten.sub.Tensor"),
    ),
    OpCase(
        "reuse",
        _fn(lambda s, x: (lambda y: y * y + y)(x * s.w), {"w": W}),
        (X,),
        flops=24 * 3,  # y = x*w used three times: mul, mul, add
        aten=("aten.mul.Tensor", "aten.add.Tensor"),
    ),
    # the Scalar overloads survive tracing only when called explicitly (x + 1 is add.Tensor)
    OpCase(
        "aten_scalar_overloads",
        _fn(
            lambda s, x: aten.div.Scalar(
                aten.mul.Scalar(aten.sub.Scalar(aten.add.Scalar(x * s.w, 1.5), 0.5), 2.0), 4.0
            ),
            {"w": W},
        ),
        (X,),
        flops=24 * 5,  # mul, add, sub, mul, div
        aten=("aten.add.Scalar", "aten.sub.Scalar", "aten.mul.Scalar", "aten.div.Scalar"),
    ),
    OpCase(
        "where",
        _fn(lambda s, x, y: torch.where(x > 0, x * s.w, y), {"w": W}),
        (X, (4,)),
        flops=24 * 3,  # gt, mul, where (y broadcast from (4,))
        aten=(
            "aten.where.self",
            "aten.gt.Scalar",
            "aten.where.ScalarOther",
            "aten.where.ScalarSelf",
        ),
    ),
    OpCase(
        "where_scalar_other",
        _fn(lambda s, x: torch.where(x > 0, x * s.w, 0.0), {"w": W}),
        (X,),
        flops=24 * 3,
        aten=("aten.where.self", "aten.where.ScalarOther"),
    ),
    OpCase(
        "where_scalar_self",
        _fn(lambda s, x: torch.where(x > 0, 0.0, x * s.w), {"w": W}),
        (X,),
        flops=24 * 3,
        aten=("aten.where.self", "aten.where.ScalarSelf"),
    ),
]

# ---------------------------------------------------------------------------------------------
# reductions (with a readout r of the output's shape): 1 per input element, mean +1 per output
# ---------------------------------------------------------------------------------------------
REDUCTION = [
    OpCase(
        "sum_dim",
        _fn(lambda s, x: (x * s.w).sum(1) * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 24 + 8,
        aten=("aten.sum.dim_IntList",),
    ),
    OpCase(
        "sum_keepdim",
        _fn(lambda s, x: (x * s.w).sum((0, 2), keepdim=True) * s.r, {"w": W}, {"r": (1, 3, 1)}),
        (X,),
        flops=24 + 24 + 3,
        aten=("aten.sum.dim_IntList",),
    ),
    OpCase(
        "mean_dim",
        _fn(lambda s, x: (x * s.w).mean(-1) * s.r, {"w": W}, {"r": (2, 3)}),
        (X,),
        flops=24 + (24 + 6) + 6,
        aten=("aten.mean.dim",),
    ),
    OpCase(
        "mean_keepdim",
        _fn(lambda s, x: (x * s.w).mean((0, 2), keepdim=True) * s.r, {"w": W}, {"r": (1, 3, 1)}),
        (X,),
        flops=24 + (24 + 3) + 3,
        aten=("aten.mean.dim",),
    ),
    OpCase(
        "mean_all",
        _fn(lambda s, x: (x * s.w).mean(), {"w": W}),
        (X,),
        flops=24 + (24 + 1),
        aten=("aten.mean.default",),
    ),
    OpCase(
        "amax",
        _fn(lambda s, x: (x * s.w).amax(1) * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 24 + 8,
        aten=("aten.amax.default",),
    ),
    OpCase(
        "amin",
        _fn(lambda s, x: (x * s.w).amin(-1) * s.r, {"w": W}, {"r": (2, 3)}),
        (X,),
        flops=24 + 24 + 6,
        aten=("aten.amin.default",),
    ),
    OpCase(
        "var_mean",
        _fn(
            lambda s, x: (lambda vm: vm[0] * s.r + vm[1])(torch.var_mean(x * s.w, 1)),
            {"w": W},
            {"r": (2, 4)},
        ),
        (X,),
        flops=24 + (2 * 24 + 2 * 8) + 8 + 8,  # mul; var_mean; *r; +mean -> 104
        aten=("aten.var_mean.correction",),
    ),
    OpCase(
        "var_mean_keepdim_c0",
        _fn(
            lambda s, x: (lambda vm: vm[0] * s.r + vm[1])(
                torch.var_mean(x * s.w, (0, 2), correction=0, keepdim=True)
            ),
            {"w": W},
            {"r": (1, 3, 1)},
        ),
        (X,),
        flops=24 + (2 * 24 + 2 * 3) + 3 + 3,  # 84
        aten=("aten.var_mean.correction",),
    ),
]

# ---------------------------------------------------------------------------------------------
# normalisation and losses (decomposed; counted as the sum of their parts)
# ---------------------------------------------------------------------------------------------
NORM_LOSS = [
    OpCase(
        "batchnorm2d_train",
        _ro(lambda: randomized(nn.BatchNorm2d(3)), (4, 3, 2, 2)),
        ((4, 3, 2, 2),),
        # num_batches_tracked += 1: 1; var_mean over 48 elements, 3 outputs: 2*48 + 2*3 = 102;
        # +eps 3, rsqrt 3; x - mean 48, * rstd 48; running_mean: *0.1, *0.9, + : 9;
        # running_var: *n/(n-1), *0.1, *0.9, + : 12; *weight 48, +bias 48; readout 48
        flops=1 + 102 + 3 + 3 + 48 + 48 + 9 + 12 + 48 + 48 + 48,
        aten=(
            "aten.var_mean.correction",
            "aten.rsqrt.default",
            "aten.squeeze.dims",
            "aten.unsqueeze.default",
        ),
    ),
    OpCase(
        "batchnorm2d_eval",
        _ro(lambda: randomized(nn.BatchNorm2d(3)).eval(), (4, 3, 2, 2)),
        ((4, 3, 2, 2),),
        # one op: per element − mean, × rsqrt, × weight, + bias: 4*48; per channel + eps
        # and rsqrt: 2*3; readout 48
        flops=4 * 48 + 2 * 3 + 48,
        aten=("aten._native_batch_norm_legit_no_training.default",),
    ),
    OpCase(
        "layernorm",
        _ro(lambda: randomized(nn.LayerNorm(4)), (2, 3, 4)),
        (X,),
        # var_mean 2*24 + 2*6 = 60; +eps 6; rsqrt 6; sub 24; mul 24; *weight 24; +bias 24;
        # readout 24
        flops=60 + 6 + 6 + 24 * 4 + 24,
        aten=("aten.var_mean.correction", "aten.rsqrt.default"),
    ),
    OpCase(
        "groupnorm",
        _ro(lambda: randomized(nn.GroupNorm(2, 4)), (2, 4, 2, 2)),
        ((2, 4, 2, 2),),
        # 32 elements in 4 groups of 8: var_mean 2*32 + 2*4 = 72; +eps 4, rsqrt 4; sub 32,
        # mul 32; *weight 32, +bias 32; readout 32
        flops=72 + 4 + 4 + 32 * 4 + 32,
        aten=("aten.var_mean.correction", "aten.rsqrt.default", "aten.view.default"),
    ),
    OpCase(
        "log_softmax",
        _fn(lambda s, x: F.log_softmax(x * s.w, -1), {"w": W}),
        (X,),
        # mul 24; amax 24, sub 24, exp 24, sum 24, log 6, sub 24
        flops=24 + 24 * 5 + 6,
        aten=("aten.amax.default", "aten.exp.default", "aten.log.default"),
    ),
    OpCase(
        "softmax",
        _fn(lambda s, x: F.softmax(x * s.w, -1) * s.r, {"w": W}, {"r": X}),
        (X,),
        # mul 24; amax 24, sub 24, exp 24, sum 24, div 24; readout 24
        flops=24 + 24 * 5 + 24,
        aten=("aten.amax.default", "aten.exp.default", "aten.div.Tensor"),
    ),
    OpCase(
        "cross_entropy",
        _fn(
            lambda s, x: F.cross_entropy(F.linear(x, s.w, s.b), s.target),
            {"w": (5, 4), "b": (5,)},
            {"target": index(5, 3)},
        ),
        ((3, 4),),
        # addmm (3x4)(4x5): 120 + 15 bias; log_softmax on (3,5): amax 15, sub 15, exp 15,
        # sum 15, log 3, sub 15 = 78; nll_loss (mean): ne 3, where 3, neg 3, ne 3, where 3,
        # ne 3, sum 3, sum 3, div 1 = 25 (gather, _to_copy: 0)
        flops=135 + 78 + 25,
        aten=(
            "aten.addmm.default",
            "aten.gather.default",
            "aten.scatter_add.default",
            "aten.log.default",
            "aten.where.self",
            "aten._to_copy.default",
        ),
    ),
    OpCase(
        "mse_loss",
        _fn(lambda s, x: F.mse_loss(x * s.w, s.y), {"w": W}, {"y": X}),
        (X,),
        flops=24 + 24 + 24 + (24 + 1),  # mul; sub; pow 2; mean
        aten=("aten.pow.Tensor_Scalar", "aten.mean.default"),
    ),
]

# ---------------------------------------------------------------------------------------------
# pooling (x * w first, so the weight has a tangent; readout after)
# ---------------------------------------------------------------------------------------------
POOL = [
    OpCase(
        "maxpool2d_k3s2p1",
        _fn(lambda s, x: F.max_pool2d(x * s.w, 3, 2, 1) * s.r, {"w": (5, 5)}, {"r": (2, 2, 3, 3)}),
        ((2, 2, 5, 5),),
        flops=100 + 8 * 36 + 36,  # mul 100; out (2,2,3,3): (9-1)*36 = 288; readout 36
        aten=(
            "aten.max_pool2d_with_indices.default",
            "aten.gather.default",
            "aten.scatter_add.default",
        ),
    ),
    OpCase(
        "maxpool2d_k2",
        lambda: Readout(Fn(lambda s, x: nn.MaxPool2d(2)(x * s.w), {"w": (4, 4)}), (2, 2, 2, 2)),
        ((2, 2, 4, 4),),
        flops=64 + 3 * 16 + 16,  # mul 64; out (2,2,2,2): (4-1)*16 = 48; readout 16
        aten=("aten.max_pool2d_with_indices.default",),
    ),
    OpCase(
        "maxpool3d",
        _fn(lambda s, x: F.max_pool3d(x * s.w, 2) * s.r, {"w": (4, 4, 4)}, {"r": (1, 2, 2, 2, 2)}),
        ((1, 2, 4, 4, 4),),
        flops=128 + 7 * 16 + 16,  # mul 128; out 16 elements: (8-1)*16 = 112; readout 16
        aten=("aten.max_pool3d_with_indices.default",),
    ),
    OpCase(
        "avgpool2d_k2",
        _fn(lambda s, x: F.avg_pool2d(x * s.w, 2) * s.r, {"w": (4, 4)}, {"r": (2, 2, 2, 2)}),
        ((2, 2, 4, 4),),
        flops=64 + 4 * 16 + 16,  # mul 64; 4 per output element; readout 16
        aten=("aten.avg_pool2d.default", "aten.convolution.default"),
    ),
    OpCase(
        "avgpool2d_k3s2p1",
        _fn(lambda s, x: F.avg_pool2d(x * s.w, 3, 2, 1) * s.r, {"w": (5, 5)}, {"r": (2, 2, 3, 3)}),
        ((2, 2, 5, 5),),
        flops=100 + 9 * 36 + 36,  # mul 100; out (2,2,3,3): 9*36 = 324; readout 36
        aten=("aten.avg_pool2d.default",),
    ),
    OpCase(
        "adaptive_avgpool1",
        _fn(
            lambda s, x: F.adaptive_avg_pool2d(x * s.w, 1) * s.r, {"w": (4, 4)}, {"r": (2, 3, 1, 1)}
        ),
        ((2, 3, 4, 4),),
        flops=96 + (96 + 6) + 6,  # mul 96; mean over H,W: 96 + 6; readout 6
        aten=("aten.mean.dim",),
    ),
    OpCase(
        "adaptive_avgpool1_channels_last",  # PyTorch restrides the mean with as_strided_
        _fn(
            lambda s, x: (
                F.adaptive_avg_pool2d(
                    (x * s.w).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), 1
                )
                * s.r
            ),
            {"w": (4, 4)},
            {"r": (2, 3, 1, 1)},
        ),
        ((2, 3, 4, 4),),
        flops=96 + (96 + 6) + 6,  # mul 96; mean over H,W: 96 + 6; readout 6
        aten=("aten.mean.dim",),
    ),
    OpCase(
        "adaptive_avgpool2",
        _fn(
            lambda s, x: F.adaptive_avg_pool2d(x * s.w, 2) * s.r, {"w": (4, 4)}, {"r": (2, 3, 2, 2)}
        ),
        ((2, 3, 4, 4),),
        flops=96 + 4 * 24 + 24,  # mul 96; avg_pool2d k2: 4*24; readout 24
        aten=("aten.avg_pool2d.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# views, copies, index ops: 0 FLOPs; mul 24 before (x * w) and the readout after
# ---------------------------------------------------------------------------------------------
SHAPE = [
    OpCase(
        "flatten",
        _fn(lambda s, x: (x * s.w).flatten(1) * s.r, {"w": W}, {"r": (2, 12)}),
        (X,),
        flops=24 + 24,
        aten=("aten.view.default", "aten.reshape.default"),
    ),
    OpCase(
        "view",
        _fn(lambda s, x: (x * s.w).view(6, 4) * s.r, {"w": W}, {"r": (6, 4)}),
        (X,),
        flops=24 + 24,
        aten=("aten.view.default",),
    ),
    OpCase(
        "permute",
        _fn(lambda s, x: (x * s.w).permute(2, 0, 1) * s.r, {"w": W}, {"r": (4, 2, 3)}),
        (X,),
        flops=24 + 24,
        aten=("aten.permute.default",),
    ),
    OpCase(
        "transpose",
        _fn(lambda s, x: (x * s.w).transpose(0, 2) * s.r, {"w": W}, {"r": (4, 3, 2)}),
        (X,),
        flops=24 + 24,
        aten=("aten.permute.default",),
    ),
    OpCase(
        "reshape_noncontig",
        _fn(lambda s, x: (x * s.w).transpose(1, 2).reshape(2, 12) * s.r, {"w": W}, {"r": (2, 12)}),
        (X,),
        flops=24 + 24,
        aten=("aten.clone.default", "aten.view.default"),
    ),
    OpCase(
        "unsqueeze",
        _fn(lambda s, x: (x * s.w).unsqueeze(1) * s.r, {"w": W}, {"r": (2, 1, 3, 4)}),
        (X,),
        flops=24 + 24,
        aten=("aten.unsqueeze.default", "aten.squeeze.dims"),
    ),
    OpCase(
        "squeeze",
        _fn(lambda s, x: (x * s.w).squeeze(1) * s.r, {"w": (1, 4)}, {"r": (2, 4)}),
        ((2, 1, 4),),
        flops=8 + 8,
        aten=("aten.squeeze.dims",),
    ),
    OpCase(
        "expand",
        _fn(lambda s, x: x.expand(2, 3, 4) * s.w, {"w": W}),
        ((2, 1, 4),),
        flops=24,
        aten=("aten.expand.default", "aten.sum.dim_IntList"),
    ),
    OpCase(
        "slice",
        _fn(lambda s, x: (x * s.w)[:, 1:3] * s.r, {"w": W}, {"r": (2, 2, 4)}),
        (X,),
        flops=24 + 16,
        aten=("aten.slice.Tensor", "aten.slice_scatter.default"),
    ),
    OpCase(
        "slice_step_neg",
        _fn(lambda s, x: (x * s.w)[..., ::2][:, -2:] * s.r, {"w": W}, {"r": (2, 2, 2)}),
        (X,),
        flops=24 + 8,
        aten=("aten.slice.Tensor",),
    ),
    OpCase(
        "select",
        _fn(lambda s, x: (x * s.w)[:, 1] * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 8,
        aten=("aten.select.int", "aten.select_scatter.default"),
    ),
    OpCase(
        "alias",
        _fn(lambda s, x: (x * s.w)[...] * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24,
        aten=("aten.alias.default",),
    ),
    OpCase(
        "cat",
        _fn(lambda s, x, y: torch.cat([x * s.w, y], 1) * s.r, {"w": W}, {"r": (2, 5, 4)}),
        (X, (2, 2, 4)),
        flops=24 + 40,
        aten=("aten.cat.default", "aten.slice.Tensor"),
    ),
    OpCase(
        "cat_param",
        _fn(lambda s, x: torch.cat([s.b, x, s.b], 0) * s.r, {"b": (1, 4)}, {"r": (5, 4)}),
        ((3, 4),),
        flops=20,
        aten=("aten.cat.default",),
    ),
    OpCase(
        "gather",
        _fn(
            lambda s, x: torch.gather(x * s.w, 2, s.idx) * s.r,
            {"w": W},
            {"idx": index(4, 2, 3, 5), "r": (2, 3, 5)},
        ),
        (X,),
        flops=24 + 30,  # gather: 0 FLOPs (FLOPS.md); readout 30
        aten=("aten.gather.default", "aten.scatter_add.default"),
    ),
    OpCase(
        "scatter_add",
        _fn(
            lambda s, x: s.base.scatter_add(2, s.idx, x * s.w) * s.r,
            {"base": X, "w": (3, 3)},
            {"idx": index(4, 2, 3, 3), "r": X},
        ),
        ((2, 3, 3),),
        flops=18 + 18 + 24,  # mul 18; scatter_add: 1 per added element (18); readout 24
        aten=("aten.scatter_add.default", "aten.gather.default"),
    ),
    OpCase(
        "pad",
        _fn(lambda s, x: F.pad(x * s.w, (1, 2)) * s.r, {"w": W}, {"r": (2, 3, 7)}),
        (X,),
        flops=24 + 42,
        aten=("aten.constant_pad_nd.default",),
    ),
    OpCase(
        "pad_2d",
        _fn(lambda s, x: F.pad(x * s.w, (0, 1, 2, 0)) * s.r, {"w": W}, {"r": (2, 5, 5)}),
        (X,),
        flops=24 + 50,
        aten=("aten.constant_pad_nd.default",),
    ),
    OpCase(
        "to_float64",
        _fn(lambda s, x: x.to(torch.float64) * s.w, {"w": W}),
        ((X, torch.float32),),
        flops=24,  # the cast is a copy: 0 FLOPs; mul 24
        aten=("aten._to_copy.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# small real-model patterns
# ---------------------------------------------------------------------------------------------


class _BasicBlock(nn.Module):
    """A ResNet basic block with stride 2 and a 1x1 stride-2 downsample, then the head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=False)
        self.bn1 = randomized(nn.BatchNorm2d(3))
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn2 = randomized(nn.BatchNorm2d(3))
        self.down = nn.Sequential(
            nn.Conv2d(2, 3, 1, stride=2, bias=False), randomized(nn.BatchNorm2d(3))
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)) + self.down(x))
        return self.fc(torch.flatten(self.pool(out), 1))


class _LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(2 * 3 * 3, 3)
        self.register_buffer("target", torch.tensor([2, 0]))

    def forward(self, x):
        h = self.pool(torch.relu(self.conv(x)))
        return F.cross_entropy(self.fc(h.flatten(1)), self.target)


def _mlp() -> nn.Module:
    m = Fn(
        lambda s, x: F.cross_entropy(s.l2(torch.relu(s.l1(x))), s.target),
        buffers={"target": index(3, 4)},
    )
    m.l1 = nn.Linear(4, 5)
    m.l2 = nn.Linear(5, 3)
    return m


MODELS = [
    OpCase(
        "mlp_cross_entropy",
        _mlp,
        ((4, 4),),
        # addmm (4x4)(4x5): 160 + 20 bias; relu 20; addmm (4x5)(5x3): 120 + 12 bias;
        # log_softmax on (4,3): amax 12, sub 12, exp 12, sum 12, log 4, sub 12 = 64;
        # nll (mean): ne 4, where 4, neg 4, ne 4, where 4, ne 4, sum 4, sum 4, div 1 = 33
        flops=180 + 20 + 132 + 64 + 33,
        aten=("aten.addmm.default", "aten.relu.default", "aten.gather.default"),
    ),
    # 6x6 input: both stride-2 convs leave the last input row unread (weight-gradient crop)
    OpCase(
        "resnet_block",
        _BasicBlock,
        ((2, 2, 6, 6),),
        # conv1 -> (2,3,3,3): 2*2*3*9*2*9 = 1944; each BatchNorm on 54 elements, 3
        # channels: 1 + (2*54 + 2*3) + 3 + 3 + 54 + 54 + 9 + 12 + 54 + 54 = 358 (see
        # batchnorm2d_train); relu 54; conv2: 2*2*3*9*3*9 = 2916; downsample 1x1 conv:
        # 2*2*3*9*2*1 = 216; add 54; relu 54; mean over 3x3: 54 + 6; fc addmm: 48 + 8
        flops=1944 + 358 + 54 + 2916 + 358 + 216 + 358 + 54 + 54 + 60 + 56,
        aten=(
            "aten.convolution.default",
            "aten.var_mean.correction",
            "aten.mean.dim",
            "aten.addmm.default",
            "aten.constant_pad_nd.default",
        ),
    ),
    OpCase(
        "lenet",
        _LeNet,
        ((2, 1, 8, 8),),
        # conv -> (2,2,6,6): 2*2*2*36*1*9 = 2592, bias 2*2*36 = 144; relu 144;
        # maxpool 2 -> 36 outputs: 3*36 = 108;
        # fc addmm (2x18)(18x3): 216 + 6; log_softmax on (2,3): 6*5 + 2 = 32;
        # nll (mean): 8*2 + 1 = 17
        flops=2592 + 144 + 144 + 108 + 222 + 32 + 17,
        aten=(
            "aten.convolution.default",
            "aten.max_pool2d_with_indices.default",
            "aten.addmm.default",
        ),
    ),
]

# ---------------------------------------------------------------------------------------------
# ops real models use (formerly gaps: their rules were missing)
# ---------------------------------------------------------------------------------------------
GAPS = [
    OpCase(
        "chunk",
        _fn(lambda s, x: (x * s.w).chunk(2, -1)[1] * s.r, {"w": W}, {"r": (2, 3, 2)}),
        (X,),
        flops=24 + 12,
        aten=("aten.split_with_sizes.default", "aten.slice.Tensor"),
    ),
    OpCase(
        "relu6",
        _fn(lambda s, x: F.relu6(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.clamp.default", "aten.logical_and.default"),
    ),
    OpCase(
        "leaky_relu",
        _fn(lambda s, x: F.leaky_relu(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.leaky_relu.default",),
    ),
    OpCase(
        "var",
        _fn(lambda s, x: torch.var(x * s.w, 1) * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + (24 + 8) + 8,
        aten=("aten.var.correction",),
    ),
    OpCase(
        "conv_transpose2d",
        lambda: nn.ConvTranspose2d(2, 3, 3, stride=2),
        ((1, 2, 3, 3),),
        # 2*N*Cin*prod(in)*(Cout/G)*prod(k) = 2*1*2*9*3*9 = 972; bias on (1,3,7,7): 147
        flops=972 + 147,
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "avgpool2d_ceil_mode",
        _fn(
            lambda s, x: F.avg_pool2d(x * s.w, 2, ceil_mode=True) * s.r,
            {"w": (5, 5)},
            {"r": (1, 2, 3, 3)},
        ),
        ((1, 2, 5, 5),),
        flops=50 + 4 * 18 + 18,  # mul 50; out (1,2,3,3): 4 per output element; readout 18
        aten=("aten.avg_pool2d.default",),
    ),
    OpCase(
        "embedding",
        _fn(lambda s, x: F.embedding(s.idx, s.w) * x, {"w": (5, 4)}, {"idx": index(5, 2, 3)}),
        (X,),
        flops=24,  # embedding: 0 FLOPs (FLOPS.md); mul 24
        aten=("aten.embedding.default", "aten.index_put.default"),
    ),
    OpCase(
        "max_dim",
        _fn(lambda s, x: (x * s.w).max(1).values * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 24 + 8,  # like amax: 1 per input element
        aten=("aten.max.dim", "aten.gather.default"),
    ),
]

# ---------------------------------------------------------------------------------------------
# transposed, 1-D, 3-D and dilated convolutions (the transposed ones: 2*N*Cin*prod(in)*(Cout/G)*
# prod(k), + N*Cout*prod(out) for the bias); the first five are the table cases 2-6
# ---------------------------------------------------------------------------------------------
CONV_MORE = [
    OpCase(
        "conv_transpose2d_1x1_input",
        lambda: nn.ConvTranspose2d(32, 1, 3),
        ((1, 32, 1, 1),),
        flops=2 * 1 * 32 * 1 * 1 * 9 + 9,  # 576; bias on (1,1,3,3): 9
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose2d_k2s2",
        lambda: nn.ConvTranspose2d(3, 1, 2, stride=2),
        ((1, 3, 2, 2),),
        flops=2 * 1 * 3 * 4 * 1 * 4 + 16,  # 96; bias on (1,1,4,4): 16
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose2d_depthwise_outpad",
        lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=4),
        ((2, 4, 8, 8),),
        # 2*2*4*64*(4/4)*9 = 9216; out (2,4,16,16): bias 2048; the weight gradient crops the
        # output_padding row and column
        flops=9216 + 2048,
        aten=("aten.convolution.default", "aten.constant_pad_nd.default"),
    ),
    OpCase(
        "conv_transpose2d_groups3",
        lambda: nn.ConvTranspose2d(6, 6, 2, stride=2, groups=3),
        ((2, 6, 8, 8),),
        flops=2 * 2 * 6 * 64 * 2 * 4 + 3072,  # 12288; out (2,6,16,16): bias 3072
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose2d_k4s2p1",
        lambda: nn.ConvTranspose2d(4, 6, 4, stride=2, padding=1),
        ((2, 4, 8, 8),),
        flops=2 * 2 * 4 * 64 * 6 * 16 + 3072,  # 98304; out (2,6,16,16): bias 3072
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose2d_dilation2",
        lambda: nn.ConvTranspose2d(2, 2, 3, dilation=2),
        ((1, 2, 4, 4),),
        # out (4-1) + 2*(3-1) + 1 = 8: 2*1*2*16*2*9 = 1152; bias 1*2*64 = 128
        flops=1152 + 128,
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose1d_outpad",
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, output_padding=1),
        ((2, 2, 5),),
        # out (5-1)*2 + 3 + 1 = 12: 2*2*2*5*3*3 = 360; bias 2*3*12 = 72
        flops=360 + 72,
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose3d",
        lambda: nn.ConvTranspose3d(2, 2, 2, stride=2),
        ((1, 2, 2, 2, 2),),
        flops=2 * 1 * 2 * 8 * 2 * 8 + 2 * 64,  # 512; out (1,2,4,4,4): bias 128
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv1d_pad1",
        lambda: nn.Conv1d(6, 6, 3, padding=1),
        ((1, 6, 8),),
        flops=2 * 1 * 6 * 8 * 6 * 3 + 6 * 8,  # table case 10 in small: 1728 + 48
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv3d_groups_stride",
        lambda: nn.Conv3d(4, 4, 3, stride=2, padding=1, groups=2),
        ((1, 4, 5, 5, 5),),
        # out (1,4,3,3,3): 2*1*4*27*(4/2)*27 = 11664; bias 108
        flops=11664 + 108,
        aten=("aten.convolution.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# matmul with broadcasting and 1-D operands, einsum, baddbmm
# ---------------------------------------------------------------------------------------------
_MV_FLOPS = (
    "FlopCounterMode counts 0 for {} (it has no formula for aten.{}); graphflop "
    "decomposes it to mm and counts {}: tests/test_cases.py checks it"
)
LINALG_MORE = [
    OpCase(
        "matmul_broadcast",
        _fn(lambda s, x: x @ s.w, {"w": (2, 4, 5)}),
        ((3, 4),),
        flops=2 * 2 * 3 * 4 * 5,  # (3,4) broadcast against (2,4,5): bmm 2x(3x4)(4x5): 240
        aten=("aten.bmm.default", "aten.expand.default"),
    ),
    OpCase(
        "matmul_4d_2d",
        _fn(lambda s, x: x @ s.w, {"w": (5, 6)}),
        ((2, 3, 4, 5),),
        flops=2 * 24 * 5 * 6,  # folded to mm (24x5)(5x6): 1440
        aten=("aten.mm.default", "aten.view.default"),
    ),
    OpCase(
        "matmul_vector_matrix",
        _fn(lambda s, x: (x @ s.w) * s.r, {"w": (4, 5)}, {"r": (5,)}),
        ((4,),),
        flops=2 * 4 * 5 + 5,  # (1x4)(4x5): 40; readout 5
        aten=("aten.mm.default",),
    ),
    OpCase(
        "matmul_matrix_vector",
        _fn(lambda s, x: (s.w @ x) * s.r, {"w": (3, 4)}, {"r": (3,)}),
        ((4,),),
        flops=2 * 3 * 4 + 3,  # mv -> mm (3x4)(4x1): 24; readout 3
        aten=("aten.mm.default", "aten.squeeze.dims"),
        xfail={"flops": _MV_FLOPS.format("torch.mv", "mv", "2*M*K")},
    ),
    OpCase(
        "matmul_dot",
        _fn(lambda s, x: x @ s.w, {"w": (5,)}),
        ((5,),),
        flops=2 * 5,  # dot -> mm (1x5)(5x1): 10
        aten=("aten.mm.default",),
        xfail={"flops": _MV_FLOPS.format("torch.dot", "dot", "2*K")},
    ),
    OpCase(
        "einsum_bmm",
        _fn(lambda s, x: torch.einsum("bij,bjk->bik", x, s.w), {"w": (2, 4, 5)}),
        (X,),
        flops=2 * 2 * 3 * 4 * 5,  # bmm 2x(3x4)(4x5): 240
        aten=("aten.bmm.default",),
    ),
    OpCase(
        "einsum_heads",
        _fn(
            lambda s, q: torch.einsum("bhqd,bhkd->bhqk", q, s.k) * s.r,
            {"k": (1, 2, 5, 4)},
            {"r": (1, 2, 3, 5)},
        ),
        ((1, 2, 3, 4),),
        flops=2 * 2 * 3 * 4 * 5 + 30,  # bmm 2x(3x4)(4x5): 240; readout 30
        aten=("aten.bmm.default", "aten.permute.default"),
    ),
    OpCase(
        "baddbmm",
        _fn(
            lambda s, x: torch.baddbmm(s.b, x, s.w, beta=0.5, alpha=2.0),
            {"b": (3, 5), "w": (2, 4, 5)},
        ),
        (X,),
        # bmm 240; alpha*: 30; beta*b: 15; add 30
        flops=240 + 30 + 15 + 30,
        aten=("aten.bmm.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# attention: scaled dot-product attention decomposes to PyTorch's math form (two bmm, a softmax,
# masks as where/add); nn.MultiheadAttention to addmm/bmm. The modules run SDPA under the math
# backend: the CPU flash kernel PyTorch picks otherwise has no forward-mode derivative (so
# torch.func.jvp, the reference, fails) and FlopCounterMode counts 0 FLOPs for it. graphflop's
# trace is the same either way; tests/test_cases.py checks the counts at full size.
# ---------------------------------------------------------------------------------------------


def _math_sdpa(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` run with scaled dot-product attention restricted to the math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(*args):
        with sdpa_kernel(SDPBackend.MATH):
            return fn(*args)

    return run


Q4 = (1, 2, 4, 3)  # (batch, heads, L, E)


def _mha(need_weights: bool) -> nn.Module:
    """Self-attention with nn.MultiheadAttention(8, 2), random in- and out-projection biases."""
    m = Fn(_math_sdpa(lambda s, x: s.mha(x, x, x, need_weights=need_weights)[0]))
    m.mha = randomized(nn.MultiheadAttention(8, 2, batch_first=True))
    return m


KV5 = (1, 2, 5, 3)  # (batch, heads, S, E)
SDPA = F.scaled_dot_product_attention
ATTENTION = [
    # graphflop's decomposition (trace.py's _sdpa): scores (1,2,4,5): 40 elements. q scaled:
    # 24; bmm 2*2*4*3*5 = 240 twice: 480; softmax: amax, sub, exp, sum, div: 5*40 = 200;
    # readout 24
    OpCase(
        "sdpa",
        _fn(_math_sdpa(lambda s, q, k, v: SDPA(q, k, v) * s.r), buffers={"r": Q4}),
        (Q4, KV5, KV5),
        flops=24 + 480 + 200 + 24,
        aten=("aten.bmm.default", "aten.amax.default"),
    ),
    # scores (1,2,4,4): 32. q scaled 24; the 4x4 causal mask rows >= cols: 16, where 32;
    # bmm 2*2*4*3*4 = 192 twice: 384; softmax 5*32 = 160; readout 24
    OpCase(
        "sdpa_causal",
        _fn(_math_sdpa(lambda s, q, k, v: SDPA(q, k, v, is_causal=True) * s.r), buffers={"r": Q4}),
        (Q4, Q4, Q4),
        flops=24 + 16 + 32 + 384 + 160 + 24,
        aten=("aten.bmm.default", "aten.ge.Tensor", "aten.where.self"),
    ),
    # as sdpa (728), + the mask add (40), + the guard for rows the mask hides entirely: scores
    # != -inf 40, any 40, where 40
    OpCase(
        "sdpa_float_mask",
        _fn(
            _math_sdpa(lambda s, q, k, v: SDPA(q, k, v, attn_mask=s.m) * s.r),
            {"m": (4, 5)},
            {"r": Q4},
        ),
        (Q4, KV5, KV5),
        flops=728 + 40 + 120,
        aten=("aten.bmm.default", "aten.add.Tensor", "aten.any.dim"),
    ),
    # as sdpa (728), + m > 0 (20), the mask applied with where (40), the guard (120)
    OpCase(
        "sdpa_bool_mask",
        _fn(
            _math_sdpa(lambda s, q, k, v: SDPA(q, k, v, attn_mask=s.m > 0) * s.r),
            buffers={"m": (4, 5), "r": Q4},
        ),
        (Q4, KV5, KV5),
        flops=728 + 20 + 40 + 120,
        aten=("aten.bmm.default", "aten.where.self"),
    ),
    # E=8, 2 heads of 4, L=5: in-projection addmm (5x8)(8x24): 1920 + 120 bias; out-projection
    # (5x8)(8x8): 640 + 40; q scaling 40; bmm 2*2*5*4*5 = 400 twice; softmax on 50: 250;
    # readout 40
    OpCase(
        "multihead_attention",
        _ro(lambda: _mha(need_weights=True), (1, 5, 8)),
        ((1, 5, 8),),
        flops=2040 + 680 + 40 + 800 + 250 + 40,
        aten=("aten.addmm.default", "aten.bmm.default"),
    ),
    # through SDPA (graphflop's decomposition): the same parts as multihead_attention
    OpCase(
        "multihead_attention_sdpa",
        _ro(lambda: _mha(need_weights=False), (1, 5, 8)),
        ((1, 5, 8),),
        flops=2040 + 680 + 40 + 800 + 250 + 40,
        aten=("aten.addmm.default", "aten.bmm.default"),
    ),
]

# ---------------------------------------------------------------------------------------------
# activations, pow with tensor exponents
# ---------------------------------------------------------------------------------------------
UNARY_MORE = [
    OpCase(
        "gelu_tanh",
        _fn(lambda s, x: F.gelu(x * s.w, approximate="tanh"), {"w": W}),
        (X,),
        # mul; x*x*x (2 mul), *0.044715, +x, *sqrt(2/pi), tanh, +1, *0.5x (2 mul): 9 ops
        flops=24 + 24 * 9,
        aten=("aten.tanh.default",),
    ),
    OpCase(
        "softplus",
        _fn(lambda s, x: F.softplus(x * s.w), {"w": W}),
        (X,),
        # mul; exp, log1p, > threshold, where (beta = 1: no scaling): 4
        flops=24 + 24 * 4,
        aten=("aten.log1p.default", "aten.exp.default"),
    ),
    OpCase(
        "elu",
        _fn(lambda s, x: F.elu(x * s.w), {"w": W}),
        (X,),
        # mul; > 0, * input_scale, expm1, * alpha, * scale, where: 6
        flops=24 + 24 * 6,
        aten=("aten.expm1.default", "aten.where.self"),
    ),
    OpCase(
        "hardswish",
        _fn(lambda s, x: F.hardswish(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24 * 5,  # mul; +3, clamp (min 0), clamp (max 6), * x, / 6
        aten=("aten.clamp.default",),
    ),
    OpCase(
        "mish",
        _fn(lambda s, x: F.mish(x * s.w), {"w": W}),
        (X,),
        # mul; softplus (exp, log1p, >20, where), tanh, *x: 6
        flops=24 + 24 * 6,
        aten=("aten.tanh.default", "aten.log1p.default"),
    ),
    OpCase(
        "clamp_min_max",
        _fn(lambda s, x: torch.clamp_min(x * s.w, -0.5) + torch.clamp_max(x * s.w, 0.5), {"w": W}),
        (X,),
        flops=24 * 5,  # two mul, clamp_min, clamp_max, add
        aten=("aten.clamp.default", "aten.ge.Scalar", "aten.le.Scalar"),
    ),
    OpCase(
        "pow_tensor_tensor",
        _fn(lambda s, x: (x * x + s.a) ** (x * s.w), {"a": pos(*W), "w": W}),
        (X,),
        flops=24 * 4,  # mul, add, mul, pow
        aten=("aten.pow.Tensor_Tensor", "aten.log.default"),
    ),
    OpCase(
        "pow_scalar_base",
        _fn(lambda s, x: 2.0 ** (x * s.w), {"w": W}),
        (X,),
        flops=24 * 2,  # mul, pow
        aten=("aten.pow.Scalar",),
    ),
    OpCase(
        "remainder",
        _fn(lambda s, x: (x * s.w) % 1.5 + torch.fmod(x * s.w, 0.7), {"w": W}),
        (X,),
        flops=24 * 5,  # two mul, remainder, fmod, add
        aten=("aten.remainder.Scalar", "aten.fmod.Scalar"),
    ),
    OpCase(
        "dropout_eval",
        lambda: Fn(lambda s, x: F.dropout(x * s.w, 0.5, s.training), {"w": W}).eval(),
        (X,),
        flops=24,  # eval mode: dropout is the identity (mul 24)
        aten=("aten.mul.Tensor",),
    ),
]

# ---------------------------------------------------------------------------------------------
# more views and index ops (mul 24 before, readout after)
# ---------------------------------------------------------------------------------------------
SHAPE_MORE = [
    OpCase(
        "split_uneven",
        _fn(
            lambda s, x: (lambda p: torch.cat([p[1], p[0]], -1))((x * s.w).split(3, -1)) * s.r,
            {"w": W},
            {"r": X},
        ),
        (X,),
        flops=24 + 24,  # mul; readout (split and cat: 0 FLOPs)
        aten=("aten.split_with_sizes.default", "aten.cat.default"),
    ),
    OpCase(
        "unbind",
        _fn(lambda s, x: (x * s.w).unbind(1)[2] * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 8,
        aten=("aten.slice.Tensor", "aten.squeeze.dims"),
    ),
    # in-place writes into views of an intermediate, functionalised
    OpCase(
        "setitem_slice_scale",
        _fn(lambda s, x: _scale_slice(x * s.w) * s.r, {"w": W}, {"r": X}),
        (X,),
        # mul 24; slice (2,2,4) *2: 16; readout 24
        flops=24 + 16 + 24,
        aten=("aten.slice_scatter.default",),
    ),
    OpCase(
        "setitem_select_src",
        _fn(lambda s, x: _set_row(x * s.w, s.v) * s.r, {"w": W, "v": (4,)}, {"r": X}),
        (X,),
        # mul 24; h[:, 1] = v: a copy of v broadcast (0 FLOPs), then core ATen's
        # select_scatter: arange == 1 (3) and a where (24); readout 24
        flops=24 + 3 + 24 + 24,
        aten=("aten.copy.default", "aten.where.self"),
    ),
    OpCase(
        "flip",
        _fn(lambda s, x: (x * s.w).flip(1, 2) * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24,
        aten=("aten.flip.default",),
    ),
    OpCase(
        "roll",
        _fn(lambda s, x: (x * s.w).roll(1, 2) * s.r, {"w": W}, {"r": X}),
        (X,),
        # mul 24; index arithmetic on arange(4): add 4, fmod 4; readout 24
        flops=24 + 8 + 24,
        aten=("aten.index_select.default", "aten.fmod.Scalar", "aten.index_add.default"),
    ),
    OpCase(
        "index_select",
        _fn(
            lambda s, x: (x * s.w).index_select(2, s.idx) * s.r,
            {"w": W},
            {"idx": lambda: torch.tensor([3, 0, 3]), "r": (2, 3, 3)},
        ),
        (X,),
        flops=24 + 18,
        aten=("aten.index_select.default", "aten.index_add.default"),
    ),
    OpCase(
        "index_tensor",
        _fn(
            lambda s, x: (x * s.w)[:, s.idx] * s.r,
            {"w": W},
            {"idx": lambda: torch.tensor([[2, 0], [2, 1]]), "r": (2, 2, 2, 4)},
        ),
        (X,),
        flops=24 + 32,
        aten=("aten.index.Tensor", "aten.index_put.default"),
    ),
    OpCase(
        "index_put_accumulate",
        _fn(
            lambda s, x: (x * s.w).index_put((s.idx,), s.v, accumulate=True) * s.r,
            {"w": W, "v": (3, 3, 4)},
            {"idx": lambda: torch.tensor([1, 0, 1]), "r": X},
        ),
        (X,),
        flops=24 + 36 + 24,  # mul; 36 added elements; readout
        aten=("aten.index_put.default", "aten.index.Tensor"),
    ),
    OpCase(
        "index_put_overwrite",
        _fn(
            lambda s, x: (x * s.w).index_put((s.i, s.j), s.v) * s.r,
            {"w": W, "v": (2, 4)},
            {"i": lambda: torch.tensor([0, 1]), "j": lambda: torch.tensor([2, 0]), "r": X},
        ),
        (X,),
        flops=24 + 24,  # mul; the copy costs 0; readout
        aten=("aten.index_put.default",),
    ),
    OpCase(
        "upsample_nearest",
        _fn(
            lambda s, x: F.interpolate(x * s.w, scale_factor=2) * s.r,
            {"w": (3, 3)},
            {"r": (1, 2, 6, 6)},
        ),
        ((1, 2, 3, 3),),
        # mul 18; source indices of the 6 output rows and 6 columns: a mul and an add each
        # (24); gather 0; readout 72
        flops=18 + 24 + 72,
        aten=("aten.index.Tensor",),
    ),
    OpCase(
        "upsample_bilinear",
        _fn(
            lambda s, x: F.interpolate(x * s.w, size=(5, 4), mode="bilinear") * s.r,
            {"w": (3, 3)},
            {"r": (1, 2, 5, 4)},
        ),
        ((1, 2, 3, 3),),
        # sum of the parts (PyTorch's decomposition): mul 187, add 138, sub 138, clamp 27
        flops=187 + 138 + 138 + 27,
        aten=("aten.index.Tensor", "aten.clamp.default"),
    ),
    OpCase(
        "upsample_bilinear_align_corners",
        _fn(
            lambda s, x: (
                F.interpolate(x * s.w, scale_factor=2, mode="bilinear", align_corners=True) * s.r
            ),
            {"w": (3, 3)},
            {"r": (1, 2, 6, 6)},
        ),
        ((1, 2, 3, 3),),
        # sum of the parts: mul 318, add 228, sub 228, clamp 36
        flops=318 + 228 + 228 + 36,
        aten=("aten.index.Tensor",),
    ),
    OpCase(
        "pad_reflect",
        _fn(
            lambda s, x: F.pad(x * s.w, (1, 2, 2, 1), mode="reflect") * s.r,
            {"w": (3, 4)},
            {"r": (1, 2, 6, 7)},
        ),
        ((1, 2, 3, 4),),
        # mul 24; reflected indices for 6 rows and 7 columns (13 positions), two abs and two
        # sub each: abs 26, sub 26; gather 0; readout 84
        flops=24 + 26 + 26 + 84,
        aten=("aten.index.Tensor",),
    ),
    OpCase(
        "pad_replicate",
        _fn(
            lambda s, x: F.pad(x * s.w, (1, 2, 0, 1), mode="replicate") * s.r,
            {"w": (3, 4)},
            {"r": (1, 2, 4, 7)},
        ),
        ((1, 2, 3, 4),),
        # mul 24; clamped indices on 4 rows and 7 columns: 11; gather 0; readout 56
        flops=24 + 11 + 56,
        aten=("aten.index.Tensor", "aten.clamp.default"),
    ),
]

# ---------------------------------------------------------------------------------------------
# more reductions
# ---------------------------------------------------------------------------------------------
REDUCTION_MORE = [
    OpCase(
        "std",
        _fn(
            lambda s, x: torch.std(x * s.w, (0, 2), keepdim=True) * s.r, {"w": W}, {"r": (1, 3, 1)}
        ),
        (X,),
        flops=24 + (24 + 3) + 3 + 3,  # mul; var (1 per input, divide per output); sqrt; r
        aten=("aten.var.correction", "aten.sqrt.default"),
    ),
    OpCase(
        "min_dim_keepdim",
        _fn(lambda s, x: (x * s.w).min(-1, keepdim=True).values * s.r, {"w": W}, {"r": (2, 3, 1)}),
        (X,),
        flops=24 + 24 + 6,
        aten=("aten.min.dim",),
    ),
    OpCase(
        "argmax",
        _fn(lambda s, x: (x * s.w) * s.r * (x * s.w).argmax(1, keepdim=True), {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24 + 24 + 24 + 24,  # two mul; readout; argmax 1 per input; mul
        aten=("aten.argmax.default",),
    ),
    OpCase(
        "cumsum",
        _fn(lambda s, x: (x * s.w).cumsum(1) * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24 + 24,
        aten=("aten.cumsum.default", "aten.flip.default"),
    ),
    OpCase(
        "vector_norm",
        _fn(lambda s, x: torch.linalg.vector_norm(x * s.w, dim=-1) * s.r, {"w": W}, {"r": (2, 3)}),
        (X,),
        # mul 24; x ** 2: 24; sum 24; ** 0.5: 6; readout 6
        flops=24 + 24 + 24 + 6 + 6,
        aten=("aten.sum.dim_IntList", "aten.pow.Tensor_Scalar"),
    ),
]

# ---------------------------------------------------------------------------------------------
# more pooling and normalisation
# ---------------------------------------------------------------------------------------------
POOL_MORE = [
    OpCase(
        "avgpool2d_exclude_pad",
        _fn(
            lambda s, x: F.avg_pool2d(x * s.w, 3, 2, 1, count_include_pad=False) * s.r,
            {"w": (5, 5)},
            {"r": (1, 2, 3, 3)},
        ),
        ((1, 2, 5, 5),),
        flops=50 + 9 * 18 + 18,  # mul 50; 9 per output element; readout 18
        aten=("aten.avg_pool2d.default", "aten.div.Tensor"),
    ),
    # k3 s2 p1 on 4x4 with ceil_mode: 3x3 windows starting at -1, 1, 3; the last one runs past
    # the padded extent (5), so its divisor is 3*2 (or 2*2 in the corner), not 9
    OpCase(
        "avgpool2d_ceil_pad",
        _fn(
            lambda s, x: F.avg_pool2d(x * s.w, 3, 2, 1, ceil_mode=True) * s.r,
            {"w": (4, 4)},
            {"r": (1, 2, 3, 3)},
        ),
        ((1, 2, 4, 4),),
        flops=32 + 9 * 18 + 18,  # mul 32; 9 per output element; readout 18
        aten=("aten.avg_pool2d.default", "aten.div.Tensor", "aten.full.default"),
    ),
    OpCase(
        "avgpool2d_divisor",
        _fn(
            lambda s, x: F.avg_pool2d(x * s.w, 2, divisor_override=3) * s.r,
            {"w": (4, 4)},
            {"r": (1, 2, 2, 2)},
        ),
        ((1, 2, 4, 4),),
        flops=32 + 4 * 8 + 8,
        aten=("aten.avg_pool2d.default",),
    ),
    OpCase(
        "avgpool1d",
        _fn(lambda s, x: F.avg_pool1d(x * s.w, 3, 2) * s.r, {"w": (7,)}, {"r": (2, 3, 3)}),
        ((2, 3, 7),),
        flops=42 + 3 * 18 + 18,
        aten=("aten.avg_pool2d.default",),
    ),
    OpCase(
        "avgpool3d",
        _fn(lambda s, x: F.avg_pool3d(x * s.w, 2) * s.r, {"w": (4, 4, 4)}, {"r": (1, 2, 2, 2, 2)}),
        ((1, 2, 4, 4, 4),),
        flops=128 + 8 * 16 + 16,
        aten=("aten.avg_pool3d.default",),
    ),
    OpCase(
        "maxpool1d",
        _fn(lambda s, x: F.max_pool1d(x * s.w, 2) * s.r, {"w": (6,)}, {"r": (2, 3, 3)}),
        ((2, 3, 6),),
        flops=36 + 1 * 18 + 18,
        aten=("aten.max_pool2d_with_indices.default",),
    ),
    OpCase(
        "adaptive_avgpool_uneven",
        _fn(
            lambda s, x: F.adaptive_avg_pool2d(x * s.w, 3) * s.r, {"w": (5, 5)}, {"r": (1, 2, 3, 3)}
        ),
        ((1, 2, 5, 5),),
        # PyTorch's decomposition for uneven windows (sum of the parts): mul 89, add 174,
        # where 324, div 18, div (floor) 12, minimum 18, ge 18, sub 12
        flops=89 + 174 + 324 + 18 + 12 + 18 + 18 + 12,
        aten=("aten.index.Tensor", "aten.div.Tensor_mode"),
    ),
]

NORM_MORE = [
    OpCase(
        "layernorm_no_affine",
        _ro(lambda: nn.LayerNorm(4, elementwise_affine=False), (2, 3, 4)),
        (X,),
        flops=60 + 6 + 6 + 24 * 2 + 24,  # var_mean 60; +eps, rsqrt; sub, mul; readout
        aten=("aten.var_mean.correction",),
    ),
    OpCase(
        "batchnorm1d_train",
        _ro(lambda: randomized(nn.BatchNorm1d(3)), (4, 3)),
        ((4, 3),),
        # as batchnorm2d_train on 12 elements, 3 channels: 1 + (2*12 + 2*3) + 3 + 3 + 12 + 12
        # + 9 + 12 + 12 + 12; readout 12
        flops=1 + 30 + 3 + 3 + 12 + 12 + 9 + 12 + 12 + 12 + 12,
        aten=("aten.var_mean.correction",),
    ),
    OpCase(
        "instancenorm2d",
        _ro(lambda: randomized(nn.InstanceNorm2d(3, affine=True)), (2, 3, 2, 2)),
        ((2, 3, 2, 2),),
        # batch norm over (1, 6, 2, 2) (repeat: 0): var_mean 2*24 + 2*6 = 60; +eps 6, rsqrt 6;
        # sub 24, mul 24; *weight 24, +bias 24; readout 24
        flops=60 + 6 + 6 + 24 * 4 + 24,
        aten=("aten.var_mean.correction",),
    ),
    OpCase(
        "groupnorm_1d",
        _ro(lambda: randomized(nn.GroupNorm(3, 6)), (2, 6, 5)),
        ((2, 6, 5),),
        # 60 elements in 6 groups of 10: var_mean 2*60 + 2*6 = 132; +eps 6, rsqrt 6; sub 60,
        # mul 60; *weight 60, +bias 60; readout 60
        flops=132 + 6 + 6 + 60 * 4 + 60,
        aten=("aten.var_mean.correction",),
    ),
]

OP_DB: list[OpCase] = (
    LINALG
    + CONV
    + UNARY
    + BINARY
    + REDUCTION
    + NORM_LOSS
    + POOL
    + SHAPE
    + MODELS
    + GAPS
    + CONV_MORE
    + LINALG_MORE
    + ATTENTION
    + UNARY_MORE
    + SHAPE_MORE
    + REDUCTION_MORE
    + POOL_MORE
    + NORM_MORE
)

assert len({c.name for c in OP_DB}) == len(OP_DB), "case names must be unique"
