"""The op database: one :class:`OpCase` per op (or pattern) graphflop has rules for.

In the style of PyTorch's OpInfo (STYLE.md): each entry is a tiny ``nn.Module`` whose forward
exercises mainly one core-ATen op, with example input shapes, the forward FLOPs worked out by
hand from FLOPS.md (arithmetic in the comment; the model's own forward only, the traced ``sum``
loss excluded) and the ATen ops it is meant to exercise. ``tests/test_ops.py`` runs every entry
through the same checks (FLOPs, JVP vs ``torch.func.jvp`` and finite differences, VJP vs
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
* ``xfail`` maps a check name of ``tests/test_ops.py`` (one of :data:`CHECKS`, or ``*`` for
  all) to the reason: a graphflop bug or missing rule, documented precisely. The tests mark those
  checks ``xfail(strict=True)``.
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

#: the per-case checks of tests/test_ops.py (keys of ``OpCase.xfail``)
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

    def __init__(self, fn: Callable[..., torch.Tensor], params: Mapping[str, Any] | None = None,
                 buffers: Mapping[str, Any] | None = None):
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


aten = torch.ops.aten
X = (2, 3, 4)  # the elementwise cases' input: 24 elements
W = (3, 4)  # their weight, broadcast over the batch
_ALL = "*"

# ---------------------------------------------------------------------------------------------
# matrix products
# ---------------------------------------------------------------------------------------------
LINALG = [
    OpCase("linear_nobias", lambda: nn.Linear(4, 3, bias=False), ((2, 4),),
           flops=2 * 2 * 4 * 3,  # mm (2x4)(4x3): 48
           aten=("aten.mm.default", "aten.permute.default")),
    OpCase("linear", lambda: nn.Linear(4, 3), ((2, 4),),
           flops=2 * 2 * 4 * 3 + 2 * 3,  # addmm: 48 matrix + 6 bias adds = 54
           aten=("aten.addmm.default",)),
    OpCase("bmm", _fn(lambda s, x: torch.bmm(x, s.w), {"w": (2, 4, 3)}), ((2, 3, 4),),
           flops=2 * 2 * 3 * 4 * 3,  # bmm 2x(3x4)(4x3): 144
           aten=("aten.bmm.default",)),
    OpCase("attention",
           _fn(lambda s, x: torch.softmax((x @ s.wq) @ (x @ s.wk).transpose(-2, -1) / 2.0, -1)
               @ (x @ s.wv), {"wq": (4, 4), "wk": (4, 4), "wv": (4, 4)}),
           ((2, 3, 4),),
           # 3 projections mm (6x4)(4x4): 3*192 = 576; scores bmm 2x(3x4)(4x3): 144; /2: 18;
           # softmax on 18 elements: amax 18 + sub 18 + exp 18 + sum 18 + div 18 = 90;
           # bmm 2x(3x3)(3x4): 144 -> 576 + 144 + 18 + 90 + 144 = 972
           flops=576 + 144 + 18 + 90 + 144,
           aten=("aten.mm.default", "aten.bmm.default", "aten.expand.default",
                 "aten.amax.default")),
]

# ---------------------------------------------------------------------------------------------
# convolutions: 2*N*Cout*prod(out)*(Cin/G)*prod(k), + N*Cout*prod(out) for a bias
# ---------------------------------------------------------------------------------------------
CONV = [
    OpCase("conv2d", lambda: nn.Conv2d(2, 3, 3), ((2, 2, 5, 5),),
           flops=2 * 2 * 3 * 9 * 2 * 9 + 2 * 3 * 9,  # out (2,3,3,3): 1944 + 54 = 1998
           aten=("aten.convolution.default",)),
    OpCase("conv2d_groups2", lambda: nn.Conv2d(4, 6, 3, groups=2, bias=False), ((1, 4, 5, 5),),
           flops=2 * 1 * 6 * 9 * (4 // 2) * 9,  # out (1,6,3,3): 1944
           aten=("aten.convolution.default",)),
    OpCase("conv2d_depthwise", lambda: nn.Conv2d(3, 3, 3, groups=3, padding=1), ((2, 3, 4, 4),),
           flops=2 * 2 * 3 * 16 * 1 * 9 + 2 * 3 * 16,  # out (2,3,4,4): 1728 + 96 = 1824
           aten=("aten.convolution.default",)),
    # (H + 2p - k) % stride = (6 + 2 - 3) % 2 = 1: the last input row is read by no output
    OpCase("conv2d_stride2_pad1", lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1),
           ((1, 2, 6, 6),),
           flops=2 * 1 * 3 * 9 * 2 * 9 + 1 * 3 * 9,  # out (1,3,3,3): 972 + 27 = 999
           aten=("aten.convolution.default", "aten.constant_pad_nd.default")),
    OpCase("conv2d_dilation2", lambda: nn.Conv2d(2, 2, 3, dilation=2), ((1, 2, 7, 7),),
           flops=2 * 1 * 2 * 9 * 2 * 9 + 1 * 2 * 9,  # out (1,2,3,3): 648 + 18 = 666
           aten=("aten.convolution.default",)),
    # H: (6+2-3)//2+1 = 3, W: (5-2*(2-1)-1)//1+1 = 3; (6+2-3) % 2 = 1
    OpCase("conv2d_mixed",
           lambda: nn.Conv2d(4, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2),
                             groups=2),
           ((1, 4, 6, 5),),
           flops=2 * 1 * 4 * 9 * 2 * 6 + 1 * 4 * 9,  # out (1,4,3,3): 864 + 36 = 900
           aten=("aten.convolution.default",)),
    # an even kernel with padding="same" pads asymmetrically (1 left, 2 right): pad + conv
    OpCase("conv2d_same_even", lambda: nn.Conv2d(2, 2, 4, padding="same"), ((1, 2, 5, 5),),
           flops=2 * 1 * 2 * 25 * 2 * 16 + 1 * 2 * 25,  # out (1,2,5,5): 3200 + 50 = 3250
           aten=("aten.convolution.default", "aten.constant_pad_nd.default")),
    OpCase("conv1d", lambda: nn.Conv1d(2, 3, 3), ((2, 2, 8),),
           flops=2 * 2 * 3 * 6 * 2 * 3 + 2 * 3 * 6,  # out (2,3,6): 432 + 36 = 468
           aten=("aten.convolution.default",)),
    OpCase("conv3d", lambda: nn.Conv3d(2, 2, 2), ((1, 2, 3, 3, 3),),
           flops=2 * 1 * 2 * 8 * 2 * 8 + 1 * 2 * 8,  # out (1,2,2,2,2): 512 + 16 = 528
           aten=("aten.convolution.default",)),
]

# ---------------------------------------------------------------------------------------------
# unary elementwise ops on x * w (x (2,3,4), w (3,4)): mul 24 + op 24 unless noted
# ---------------------------------------------------------------------------------------------
UNARY = [
    OpCase("relu", _fn(lambda s, x: torch.relu(x * s.w), {"w": W}), (X,),
           flops=24 + 24, aten=("aten.relu.default",)),
    OpCase("exp", _fn(lambda s, x: torch.exp(x * s.w), {"w": W}), (X,),
           flops=24 + 24, aten=("aten.exp.default",)),
    OpCase("log", _fn(lambda s, x: torch.log(torch.exp(x * s.w) + 1), {"w": W}), (X,),
           flops=24 * 4,  # mul, exp, add, log
           aten=("aten.log.default",)),
    OpCase("tanh", _fn(lambda s, x: torch.tanh(x * s.w), {"w": W}), (X,),
           flops=24 + 24, aten=("aten.tanh.default", "aten.rsub.Scalar")),
    OpCase("sigmoid", _fn(lambda s, x: torch.sigmoid(x * s.w), {"w": W}), (X,),
           flops=24 + 24, aten=("aten.sigmoid.default",)),
    OpCase("sqrt", _fn(lambda s, x: torch.sqrt(x * x + s.w), {"w": pos(*W)}), (X,),
           flops=24 * 3,  # mul, add, sqrt
           aten=("aten.sqrt.default",)),
    OpCase("rsqrt", _fn(lambda s, x: torch.rsqrt(x * x + s.w), {"w": pos(*W)}), (X,),
           flops=24 * 3, aten=("aten.rsqrt.default",)),
    OpCase("pow2", _fn(lambda s, x: (x * s.w) ** 2, {"w": W}), (X,),
           flops=24 + 24, aten=("aten.pow.Tensor_Scalar",)),
    OpCase("pow3", _fn(lambda s, x: (x * s.w) ** 3, {"w": W}), (X,),
           flops=24 + 24, aten=("aten.pow.Tensor_Scalar",)),
    OpCase("abs", _fn(lambda s, x: torch.abs(x * s.w), {"w": W}), (X,),
           flops=24 + 24, aten=("aten.abs.default",)),
    OpCase("neg", _fn(lambda s, x: -(x * s.w), {"w": W}), (X,),
           flops=24 + 24, aten=("aten.neg.default",)),
    OpCase("reciprocal", _fn(lambda s, x: (x * x + s.w).reciprocal(), {"w": pos(*W)}), (X,),
           flops=24 * 3, aten=("aten.reciprocal.default",)),
    OpCase("erf", _fn(lambda s, x: torch.erf(x * s.w), {"w": W}), (X,),
           flops=24 + 24, aten=("aten.erf.default",)),
    OpCase("gelu", _fn(lambda s, x: F.gelu(x * s.w), {"w": W}), (X,),
           flops=24 * 6,  # mul; 0.5*x, x/sqrt(2), erf, +1, product
           aten=("aten.erf.default",)),
    OpCase("silu", _fn(lambda s, x: F.silu(x * s.w), {"w": W}), (X,),
           flops=24 * 3,  # mul; sigmoid, product
           aten=("aten.sigmoid.default",)),
]

# ---------------------------------------------------------------------------------------------
# binary elementwise ops with broadcasting and scalars: 1 FLOP per output element
# ---------------------------------------------------------------------------------------------
BINARY = [
    OpCase("add_broadcast", _fn(lambda s, x: x + s.w, {"w": (3, 1)}), (X,),
           flops=24, aten=("aten.add.Tensor", "aten.expand.default")),
    OpCase("add_alpha", _fn(lambda s, x: torch.add(x, s.w, alpha=2.0), {"w": (3, 1)}), (X,),
           flops=24, aten=("aten.add.Tensor",)),
    OpCase("sub_broadcast", _fn(lambda s, x: x - s.w, {"w": (3, 1)}), (X,),
           flops=24, aten=("aten.sub.Tensor",)),
    OpCase("sub_broadcast_lhs", _fn(lambda s, x: s.w - x, {"w": (3, 1)}), (X,),
           flops=24, aten=("aten.sub.Tensor",)),
    OpCase("mul_broadcast", _fn(lambda s, x: x * s.w, {"w": (3, 1)}), (X,),
           flops=24, aten=("aten.mul.Tensor",)),
    OpCase("mul_broadcast_both", _fn(lambda s, x, y: x * y * s.w, {"w": (1, 4)}),
           ((2, 1, 4), (3, 1)),
           flops=24 + 24,  # (2,1,4) * (3,1) -> (2,3,4): 24; * w (1,4): 24
           aten=("aten.mul.Tensor",)),
    OpCase("div_broadcast", _fn(lambda s, x: x / s.w, {"w": pos(3, 1)}), (X,),
           flops=24, aten=("aten.div.Tensor",)),
    OpCase("div_by_input", _fn(lambda s, x: s.w / (x * x + 1), {"w": W}), (X,),
           flops=24 * 3,  # mul, add, div
           aten=("aten.div.Tensor",)),
    OpCase("scalar_arith",
           _fn(lambda s, x: 1.0 - ((x * s.w) * 2.5 + 1.5) / 4.0, {"w": W}), (X,),
           flops=24 * 5,  # mul, *2.5, +1.5, /4, 1-
           aten=("aten.mul.Tensor", "aten.add.Tensor", "aten.div.Tensor", "aten.sub.Tensor")),
    OpCase("reuse", _fn(lambda s, x: (lambda y: y * y + y)(x * s.w), {"w": W}), (X,),
           flops=24 * 3,  # y = x*w used three times: mul, mul, add
           aten=("aten.mul.Tensor", "aten.add.Tensor")),
    # the Scalar overloads survive tracing only when called explicitly (x + 1 is add.Tensor)
    OpCase("aten_scalar_overloads",
           _fn(lambda s, x: aten.div.Scalar(aten.mul.Scalar(aten.sub.Scalar(aten.add.Scalar(
               x * s.w, 1.5), 0.5), 2.0), 4.0), {"w": W}), (X,),
           flops=24 * 5,  # mul, add, sub, mul, div
           aten=("aten.add.Scalar", "aten.sub.Scalar", "aten.mul.Scalar", "aten.div.Scalar")),
    OpCase("where", _fn(lambda s, x, y: torch.where(x > 0, x * s.w, y), {"w": W}), (X, (4,)),
           flops=24 * 3,  # gt, mul, where (y broadcast from (4,))
           aten=("aten.where.self", "aten.gt.Scalar", "aten.where.ScalarOther",
                 "aten.where.ScalarSelf")),
    OpCase("where_scalar_other", _fn(lambda s, x: torch.where(x > 0, x * s.w, 0.0), {"w": W}),
           (X,), flops=24 * 3, aten=("aten.where.self", "aten.where.ScalarOther")),
    OpCase("where_scalar_self", _fn(lambda s, x: torch.where(x > 0, 0.0, x * s.w), {"w": W}),
           (X,), flops=24 * 3, aten=("aten.where.self", "aten.where.ScalarSelf")),
]

# ---------------------------------------------------------------------------------------------
# reductions (with a readout r of the output's shape): 1 per input element, mean +1 per output
# ---------------------------------------------------------------------------------------------
REDUCTION = [
    OpCase("sum_dim", _fn(lambda s, x: (x * s.w).sum(1) * s.r, {"w": W}, {"r": (2, 4)}), (X,),
           flops=24 + 24 + 8, aten=("aten.sum.dim_IntList",)),
    OpCase("sum_keepdim",
           _fn(lambda s, x: (x * s.w).sum((0, 2), keepdim=True) * s.r, {"w": W},
               {"r": (1, 3, 1)}), (X,),
           flops=24 + 24 + 3, aten=("aten.sum.dim_IntList",)),
    OpCase("mean_dim", _fn(lambda s, x: (x * s.w).mean(-1) * s.r, {"w": W}, {"r": (2, 3)}),
           (X,), flops=24 + (24 + 6) + 6, aten=("aten.mean.dim",)),
    OpCase("mean_keepdim",
           _fn(lambda s, x: (x * s.w).mean((0, 2), keepdim=True) * s.r, {"w": W},
               {"r": (1, 3, 1)}), (X,),
           flops=24 + (24 + 3) + 3, aten=("aten.mean.dim",)),
    OpCase("mean_all", _fn(lambda s, x: (x * s.w).mean(), {"w": W}), (X,),
           flops=24 + (24 + 1), aten=("aten.mean.default",)),
    OpCase("amax", _fn(lambda s, x: (x * s.w).amax(1) * s.r, {"w": W}, {"r": (2, 4)}), (X,),
           flops=24 + 24 + 8, aten=("aten.amax.default",)),
    OpCase("amin", _fn(lambda s, x: (x * s.w).amin(-1) * s.r, {"w": W}, {"r": (2, 3)}), (X,),
           flops=24 + 24 + 6, aten=("aten.amin.default",)),
    OpCase("var_mean",
           _fn(lambda s, x: (lambda vm: vm[0] * s.r + vm[1])(torch.var_mean(x * s.w, 1)),
               {"w": W}, {"r": (2, 4)}), (X,),
           flops=24 + (2 * 24 + 2 * 8) + 8 + 8,  # mul; var_mean; *r; +mean -> 104
           aten=("aten.var_mean.correction",)),
    OpCase("var_mean_keepdim_c0",
           _fn(lambda s, x: (lambda vm: vm[0] * s.r + vm[1])(
               torch.var_mean(x * s.w, (0, 2), correction=0, keepdim=True)),
               {"w": W}, {"r": (1, 3, 1)}), (X,),
           flops=24 + (2 * 24 + 2 * 3) + 3 + 3,  # 84
           aten=("aten.var_mean.correction",)),
]

# ---------------------------------------------------------------------------------------------
# normalisation and losses (decomposed; counted as the sum of their parts)
# ---------------------------------------------------------------------------------------------
NORM_LOSS = [
    OpCase("batchnorm2d_train", _ro(lambda: randomized(nn.BatchNorm2d(3)), (4, 3, 2, 2)),
           ((4, 3, 2, 2),),
           # num_batches_tracked += 1: 1; var_mean over 48 elements, 3 outputs: 2*48 + 2*3 = 102;
           # +eps 3, rsqrt 3; x - mean 48, * rstd 48; running_mean: *0.1, *0.9, + : 9;
           # running_var: *n/(n-1), *0.1, *0.9, + : 12; *weight 48, +bias 48; readout 48
           flops=1 + 102 + 3 + 3 + 48 + 48 + 9 + 12 + 48 + 48 + 48,
           aten=("aten.var_mean.correction", "aten.rsqrt.default", "aten.squeeze.dims",
                 "aten.unsqueeze.default")),
    OpCase("batchnorm2d_eval",
           _ro(lambda: randomized(nn.BatchNorm2d(3)).eval(), (4, 3, 2, 2)), ((4, 3, 2, 2),),
           # one op: per element − mean, × rsqrt, × weight, + bias: 4*48; per channel + eps
           # and rsqrt: 2*3; readout 48
           flops=4 * 48 + 2 * 3 + 48,
           aten=("aten._native_batch_norm_legit_no_training.default",)),
    OpCase("layernorm", _ro(lambda: randomized(nn.LayerNorm(4)), (2, 3, 4)), (X,),
           # var_mean 2*24 + 2*6 = 60; +eps 6; rsqrt 6; sub 24; mul 24; *weight 24; +bias 24;
           # readout 24
           flops=60 + 6 + 6 + 24 * 4 + 24,
           aten=("aten.var_mean.correction", "aten.rsqrt.default")),
    OpCase("groupnorm", _ro(lambda: randomized(nn.GroupNorm(2, 4)), (2, 4, 2, 2)),
           ((2, 4, 2, 2),), flops=None, aten=("aten.var_mean.correction",),
           xfail={_ALL: "nn.GroupNorm traces (native_group_norm decomposition) to "
                        "aten.as_strided.default, which has no rule: MissingRuleError in "
                        "annotate_flops and build_jvp"}),
    OpCase("log_softmax", _fn(lambda s, x: F.log_softmax(x * s.w, -1), {"w": W}), (X,),
           # mul 24; amax 24, sub 24, exp 24, sum 24, log 6, sub 24
           flops=24 + 24 * 5 + 6,
           aten=("aten.amax.default", "aten.exp.default", "aten.log.default")),
    OpCase("softmax", _fn(lambda s, x: F.softmax(x * s.w, -1) * s.r, {"w": W}, {"r": X}), (X,),
           # mul 24; amax 24, sub 24, exp 24, sum 24, div 24; readout 24
           flops=24 + 24 * 5 + 24,
           aten=("aten.amax.default", "aten.exp.default", "aten.div.Tensor")),
    OpCase("cross_entropy",
           _fn(lambda s, x: F.cross_entropy(F.linear(x, s.w, s.b), s.target),
               {"w": (5, 4), "b": (5,)}, {"target": index(5, 3)}), ((3, 4),),
           # addmm (3x4)(4x5): 120 + 15 bias; log_softmax on (3,5): amax 15, sub 15, exp 15,
           # sum 15, log 3, sub 15 = 78; nll_loss (mean): ne 3, where 3, neg 3, ne 3, where 3,
           # ne 3, sum 3, sum 3, div 1 = 25 (gather, _to_copy: 0)
           flops=135 + 78 + 25,
           aten=("aten.addmm.default", "aten.gather.default", "aten.scatter_add.default",
                 "aten.log.default", "aten.where.self", "aten._to_copy.default")),
    OpCase("mse_loss",
           _fn(lambda s, x: F.mse_loss(x * s.w, s.y), {"w": W}, {"y": X}), (X,),
           flops=24 + 24 + 24 + (24 + 1),  # mul; sub; pow 2; mean
           aten=("aten.pow.Tensor_Scalar", "aten.mean.default")),
]

# ---------------------------------------------------------------------------------------------
# pooling (x * w first, so the weight has a tangent; readout after)
# ---------------------------------------------------------------------------------------------
POOL = [
    OpCase("maxpool2d_k3s2p1",
           _fn(lambda s, x: F.max_pool2d(x * s.w, 3, 2, 1) * s.r, {"w": (5, 5)},
               {"r": (2, 2, 3, 3)}), ((2, 2, 5, 5),),
           flops=100 + 8 * 36 + 36,  # mul 100; out (2,2,3,3): (9-1)*36 = 288; readout 36
           aten=("aten.max_pool2d_with_indices.default", "aten.gather.default",
                 "aten.scatter_add.default")),
    OpCase("maxpool2d_k2", lambda: Readout(Fn(lambda s, x: nn.MaxPool2d(2)(x * s.w),
                                              {"w": (4, 4)}), (2, 2, 2, 2)),
           ((2, 2, 4, 4),),
           flops=64 + 3 * 16 + 16,  # mul 64; out (2,2,2,2): (4-1)*16 = 48; readout 16
           aten=("aten.max_pool2d_with_indices.default",)),
    OpCase("maxpool3d",
           _fn(lambda s, x: F.max_pool3d(x * s.w, 2) * s.r, {"w": (4, 4, 4)},
               {"r": (1, 2, 2, 2, 2)}), ((1, 2, 4, 4, 4),),
           flops=128 + 7 * 16 + 16,  # mul 128; out 16 elements: (8-1)*16 = 112; readout 16
           aten=("aten.max_pool3d_with_indices.default",)),
    OpCase("avgpool2d_k2",
           _fn(lambda s, x: F.avg_pool2d(x * s.w, 2) * s.r, {"w": (4, 4)},
               {"r": (2, 2, 2, 2)}), ((2, 2, 4, 4),),
           flops=64 + 4 * 16 + 16,  # mul 64; 4 per output element; readout 16
           aten=("aten.avg_pool2d.default", "aten.convolution.default")),
    OpCase("avgpool2d_k3s2p1",
           _fn(lambda s, x: F.avg_pool2d(x * s.w, 3, 2, 1) * s.r, {"w": (5, 5)},
               {"r": (2, 2, 3, 3)}), ((2, 2, 5, 5),),
           flops=100 + 9 * 36 + 36,  # mul 100; out (2,2,3,3): 9*36 = 324; readout 36
           aten=("aten.avg_pool2d.default",)),
    OpCase("adaptive_avgpool1",
           _fn(lambda s, x: F.adaptive_avg_pool2d(x * s.w, 1) * s.r, {"w": (4, 4)},
               {"r": (2, 3, 1, 1)}), ((2, 3, 4, 4),),
           flops=96 + (96 + 6) + 6,  # mul 96; mean over H,W: 96 + 6; readout 6
           aten=("aten.mean.dim",)),
    OpCase("adaptive_avgpool2",
           _fn(lambda s, x: F.adaptive_avg_pool2d(x * s.w, 2) * s.r, {"w": (4, 4)},
               {"r": (2, 3, 2, 2)}), ((2, 3, 4, 4),),
           flops=96 + 4 * 24 + 24,  # mul 96; avg_pool2d k2: 4*24; readout 24
           aten=("aten.avg_pool2d.default",)),
]

# ---------------------------------------------------------------------------------------------
# views, copies, index ops: 0 FLOPs; mul 24 before (x * w) and the readout after
# ---------------------------------------------------------------------------------------------
SHAPE = [
    OpCase("flatten", _fn(lambda s, x: (x * s.w).flatten(1) * s.r, {"w": W}, {"r": (2, 12)}),
           (X,), flops=24 + 24, aten=("aten.view.default", "aten.reshape.default")),
    OpCase("view", _fn(lambda s, x: (x * s.w).view(6, 4) * s.r, {"w": W}, {"r": (6, 4)}), (X,),
           flops=24 + 24, aten=("aten.view.default",)),
    OpCase("permute",
           _fn(lambda s, x: (x * s.w).permute(2, 0, 1) * s.r, {"w": W}, {"r": (4, 2, 3)}), (X,),
           flops=24 + 24, aten=("aten.permute.default",)),
    OpCase("transpose",
           _fn(lambda s, x: (x * s.w).transpose(0, 2) * s.r, {"w": W}, {"r": (4, 3, 2)}), (X,),
           flops=24 + 24, aten=("aten.permute.default",)),
    OpCase("reshape_noncontig",
           _fn(lambda s, x: (x * s.w).transpose(1, 2).reshape(2, 12) * s.r, {"w": W},
               {"r": (2, 12)}), (X,),
           flops=24 + 24, aten=("aten.clone.default", "aten.view.default")),
    OpCase("unsqueeze",
           _fn(lambda s, x: (x * s.w).unsqueeze(1) * s.r, {"w": W}, {"r": (2, 1, 3, 4)}), (X,),
           flops=24 + 24, aten=("aten.unsqueeze.default", "aten.squeeze.dims")),
    OpCase("squeeze",
           _fn(lambda s, x: (x * s.w).squeeze(1) * s.r, {"w": (1, 4)}, {"r": (2, 4)}),
           ((2, 1, 4),), flops=8 + 8, aten=("aten.squeeze.dims",)),
    OpCase("expand",
           _fn(lambda s, x: x.expand(2, 3, 4) * s.w, {"w": W}), ((2, 1, 4),),
           flops=24, aten=("aten.expand.default", "aten.sum.dim_IntList")),
    OpCase("slice", _fn(lambda s, x: (x * s.w)[:, 1:3] * s.r, {"w": W}, {"r": (2, 2, 4)}),
           (X,), flops=24 + 16, aten=("aten.slice.Tensor", "aten.slice_scatter.default")),
    OpCase("slice_step_neg",
           _fn(lambda s, x: (x * s.w)[..., ::2][:, -2:] * s.r, {"w": W}, {"r": (2, 2, 2)}),
           (X,), flops=24 + 8, aten=("aten.slice.Tensor",)),
    OpCase("select", _fn(lambda s, x: (x * s.w)[:, 1] * s.r, {"w": W}, {"r": (2, 4)}), (X,),
           flops=24 + 8, aten=("aten.select.int", "aten.select_scatter.default")),
    OpCase("alias", _fn(lambda s, x: (x * s.w)[...] * s.r, {"w": W}, {"r": X}), (X,),
           flops=24 + 24, aten=("aten.alias.default",)),
    OpCase("cat",
           _fn(lambda s, x, y: torch.cat([x * s.w, y], 1) * s.r, {"w": W}, {"r": (2, 5, 4)}),
           (X, (2, 2, 4)), flops=24 + 40, aten=("aten.cat.default", "aten.slice.Tensor")),
    OpCase("cat_param",
           _fn(lambda s, x: torch.cat([s.b, x, s.b], 0) * s.r, {"b": (1, 4)}, {"r": (5, 4)}),
           ((3, 4),), flops=20, aten=("aten.cat.default",)),
    OpCase("gather",
           _fn(lambda s, x: torch.gather(x * s.w, 2, s.idx) * s.r, {"w": W},
               {"idx": index(4, 2, 3, 5), "r": (2, 3, 5)}), (X,),
           flops=24 + 30,  # gather: 0 FLOPs (FLOPS.md); readout 30
           aten=("aten.gather.default", "aten.scatter_add.default")),
    OpCase("scatter_add",
           _fn(lambda s, x: s.base.scatter_add(2, s.idx, x * s.w) * s.r,
               {"base": X, "w": (3, 3)}, {"idx": index(4, 2, 3, 3), "r": X}), ((2, 3, 3),),
           flops=18 + 18 + 24,  # mul 18; scatter_add: 1 per added element (18); readout 24
           aten=("aten.scatter_add.default", "aten.gather.default")),
    OpCase("pad", _fn(lambda s, x: F.pad(x * s.w, (1, 2)) * s.r, {"w": W}, {"r": (2, 3, 7)}),
           (X,), flops=24 + 42, aten=("aten.constant_pad_nd.default",)),
    OpCase("pad_2d",
           _fn(lambda s, x: F.pad(x * s.w, (0, 1, 2, 0)) * s.r, {"w": W}, {"r": (2, 5, 5)}),
           (X,), flops=24 + 50, aten=("aten.constant_pad_nd.default",)),
    OpCase("to_float64",
           _fn(lambda s, x: x.to(torch.float64) * s.w, {"w": W}), ((X, torch.float32),),
           flops=24,  # the cast is a copy: 0 FLOPs; mul 24
           aten=("aten._to_copy.default",),
           xfail={k: "x.to(dtype) traces to aten._assert_tensor_metadata.default (beside "
                     "_to_copy), which has no rule: annotate_flops raises MissingRuleError"
                  for k in ("flops", "rules")}),
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
        self.down = nn.Sequential(nn.Conv2d(2, 3, 1, stride=2, bias=False),
                                  randomized(nn.BatchNorm2d(3)))
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
    m = Fn(lambda s, x: F.cross_entropy(s.l2(torch.relu(s.l1(x))), s.target),
           buffers={"target": index(3, 4)})
    m.l1 = nn.Linear(4, 5)
    m.l2 = nn.Linear(5, 3)
    return m


MODELS = [
    OpCase("mlp_cross_entropy", _mlp, ((4, 4),),
           # addmm (4x4)(4x5): 160 + 20 bias; relu 20; addmm (4x5)(5x3): 120 + 12 bias;
           # log_softmax on (4,3): amax 12, sub 12, exp 12, sum 12, log 4, sub 12 = 64;
           # nll (mean): ne 4, where 4, neg 4, ne 4, where 4, ne 4, sum 4, sum 4, div 1 = 33
           flops=180 + 20 + 132 + 64 + 33,
           aten=("aten.addmm.default", "aten.relu.default", "aten.gather.default")),
    # 6x6 input: both stride-2 convs leave the last input row unread (weight-gradient crop)
    OpCase("resnet_block", _BasicBlock, ((2, 2, 6, 6),),
           # conv1 -> (2,3,3,3): 2*2*3*9*2*9 = 1944; each BatchNorm on 54 elements, 3
           # channels: 1 + (2*54 + 2*3) + 3 + 3 + 54 + 54 + 9 + 12 + 54 + 54 = 358 (see
           # batchnorm2d_train); relu 54; conv2: 2*2*3*9*3*9 = 2916; downsample 1x1 conv:
           # 2*2*3*9*2*1 = 216; add 54; relu 54; mean over 3x3: 54 + 6; fc addmm: 48 + 8
           flops=1944 + 358 + 54 + 2916 + 358 + 216 + 358 + 54 + 54 + 60 + 56,
           aten=("aten.convolution.default", "aten.var_mean.correction", "aten.mean.dim",
                 "aten.addmm.default", "aten.constant_pad_nd.default")),
    OpCase("lenet", _LeNet, ((2, 1, 8, 8),),
           # conv -> (2,2,6,6): 2*2*2*36*1*9 = 2592, bias 2*2*36 = 144; relu 144;
           # maxpool 2 -> 36 outputs: 3*36 = 108;
           # fc addmm (2x18)(18x3): 216 + 6; log_softmax on (2,3): 6*5 + 2 = 32;
           # nll (mean): 8*2 + 1 = 17
           flops=2592 + 144 + 144 + 108 + 222 + 32 + 17,
           aten=("aten.convolution.default", "aten.max_pool2d_with_indices.default",
                 "aten.addmm.default")),
]

# ---------------------------------------------------------------------------------------------
# ops real models use whose derivative rules are missing (the checks that need them xfail)
# ---------------------------------------------------------------------------------------------
_NO_JVP = "no JVP rule for {}: build_jvp raises MissingRuleError"
GAPS = [
    OpCase("chunk", _fn(lambda s, x: (x * s.w).chunk(2, -1)[1] * s.r, {"w": W},
                        {"r": (2, 3, 2)}), (X,),
           flops=24 + 12, aten=("aten.split_with_sizes.default",),
           xfail={k: _NO_JVP.format("aten.split_with_sizes.default (torch.chunk / split)")
                  for k in GRAPH_CHECKS}),
    OpCase("relu6", _fn(lambda s, x: F.relu6(x * s.w), {"w": W}), (X,),
           flops=24 + 24, aten=("aten.clamp.default",),
           xfail={k: _NO_JVP.format("aten.clamp.default (nn.ReLU6, nn.Hardtanh, "
                                    "torch.clamp)")
                  for k in GRAPH_CHECKS}),
    OpCase("leaky_relu", _fn(lambda s, x: F.leaky_relu(x * s.w), {"w": W}), (X,),
           flops=24 + 24, aten=("aten.leaky_relu.default",),
           xfail={_ALL: "aten.leaky_relu.default (F.leaky_relu, nn.LeakyReLU) has no rule at "
                        "all: MissingRuleError in annotate_flops and build_jvp"}),
    OpCase("var", _fn(lambda s, x: torch.var(x * s.w, 1) * s.r, {"w": W}, {"r": (2, 4)}),
           (X,), flops=24 + (24 + 8) + 8, aten=("aten.var.correction",),
           xfail={k: _NO_JVP.format("aten.var.correction (torch.var, torch.std)")
                  for k in GRAPH_CHECKS}),
]

_NO_TRANSPOSE = ("vjp", "dot", "rules", "no_backward", "mm_ratio", "aten")
GAPS += [
    OpCase("conv_transpose2d", lambda: nn.ConvTranspose2d(2, 3, 3, stride=2), ((1, 2, 3, 3),),
           # 2*N*Cin*prod(in)*(Cout/G)*prod(k) = 2*1*2*9*3*9 = 972; bias on (1,3,7,7): 147
           flops=972 + 147, aten=("aten.convolution.default",),
           xfail={k: "the transpose rule of aten.convolution.default raises NotImplementedError "
                     "for transposed=True (nn.ConvTranspose2d): build_vjp fails"
                  for k in _NO_TRANSPOSE}),
    OpCase("avgpool2d_ceil_mode",
           _fn(lambda s, x: F.avg_pool2d(x * s.w, 2, ceil_mode=True) * s.r, {"w": (5, 5)},
               {"r": (1, 2, 3, 3)}), ((1, 2, 5, 5),),
           flops=50 + 4 * 18 + 18,  # mul 50; out (1,2,3,3): 4 per output element; readout 18
           aten=("aten.avg_pool2d.default",),
           xfail={k: "the avg_pool2d transpose rule raises NotImplementedError for ceil_mode=True "
                     "(and count_include_pad=False): build_vjp fails"
                  for k in _NO_TRANSPOSE}),
    OpCase("embedding",
           _fn(lambda s, x: F.embedding(s.idx, s.w) * x, {"w": (5, 4)},
               {"idx": index(5, 2, 3)}), (X,),
           flops=24,  # embedding: 0 FLOPs (FLOPS.md); mul 24
           aten=("aten.embedding.default",),
           xfail={_ALL: "aten.embedding.default (nn.Embedding) has no rule: MissingRuleError in "
                        "annotate_flops and build_jvp"}),
    OpCase("max_dim",
           _fn(lambda s, x: (x * s.w).max(1).values * s.r, {"w": W}, {"r": (2, 4)}), (X,),
           flops=24 + 24 + 8,  # like amax: 1 per input element
           aten=("aten.max.dim",),
           xfail={_ALL: "aten.max.dim (torch.max(x, dim)) has no rule: MissingRuleError in "
                        "annotate_flops and build_jvp"}),
]

OP_DB: list[OpCase] = (
    LINALG + CONV + UNARY + BINARY + REDUCTION + NORM_LOSS + POOL + SHAPE + MODELS + GAPS
)

assert len({c.name for c in OP_DB}) == len(OP_DB), "case names must be unique"
