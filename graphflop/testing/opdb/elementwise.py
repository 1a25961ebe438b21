"""Op-database cases: unary and binary elementwise ops and activations. FLOPs worked out by hand in
each comment (docs/flops_conventions.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphflop.testing.opdb.core import Fn, OpCase, W, X, aten, module_of, pos

#: eager's hardsigmoid_backward (and forward mode) multiplies by 1/6 rounded to float32, in
#: float64 too: a relative 3e-8 off, over the 1e-9 of the torch.func checks; graphflop's is 1/6
#: (the finite-difference and dot-product checks pass; tests/test_ops_select.py by hand)
_SIXTH_IN_FLOAT32 = (
    "eager's hardsigmoid_backward multiplies by 1/6 rounded to float32, in float64 too "
    "(relative 3e-8, over rtol 1e-9); graphflop's derivative is 1/6"
)

#: the ONNX exporter has no function for the Bessel functions and polygamma (i0's derivative is
#: i1, i1's reads i0, polygamma's polygamma of the next order): their backward graphs do not export
_NO_ONNX_FUNCTION = "PyTorch's ONNX exporter has no function for i0, special_i1 or polygamma"

# ---------------------------------------------------------------------------------------------
# unary elementwise ops on x * w (x (2,3,4), w (3,4)): mul 24 + op 24 unless noted
# ---------------------------------------------------------------------------------------------
UNARY = [
    OpCase(
        "relu",
        module_of(lambda s, x: torch.relu(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.relu.default",),
    ),
    OpCase(
        "exp",
        module_of(lambda s, x: torch.exp(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.exp.default",),
    ),
    OpCase(
        "log",
        module_of(lambda s, x: torch.log(torch.exp(x * s.w) + 1), {"w": W}),
        (X,),
        flops=24 * 4,  # mul, exp, add, log
        aten=("aten.log.default",),
    ),
    OpCase(
        "tanh",
        module_of(lambda s, x: torch.tanh(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.tanh.default", "aten.rsub.Scalar"),
    ),
    OpCase(
        "sigmoid",
        module_of(lambda s, x: torch.sigmoid(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.sigmoid.default",),
    ),
    OpCase(
        "sqrt",
        module_of(lambda s, x: torch.sqrt(x * x + s.w), {"w": pos(*W)}),
        (X,),
        flops=24 * 3,  # mul, add, sqrt
        aten=("aten.sqrt.default",),
    ),
    OpCase(
        "rsqrt",
        module_of(lambda s, x: torch.rsqrt(x * x + s.w), {"w": pos(*W)}),
        (X,),
        flops=24 * 3,
        aten=("aten.rsqrt.default",),
    ),
    OpCase(
        "pow2",
        module_of(lambda s, x: (x * s.w) ** 2, {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.pow.Tensor_Scalar",),
    ),
    OpCase(
        "pow3",
        module_of(lambda s, x: (x * s.w) ** 3, {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.pow.Tensor_Scalar",),
    ),
    OpCase(
        "abs",
        module_of(lambda s, x: torch.abs(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.abs.default",),
    ),
    OpCase(
        "neg",
        module_of(lambda s, x: -(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.neg.default",),
    ),
    OpCase(
        "reciprocal",
        module_of(lambda s, x: (x * x + s.w).reciprocal(), {"w": pos(*W)}),
        (X,),
        flops=24 * 3,
        aten=("aten.reciprocal.default",),
    ),
    OpCase(
        "erf",
        module_of(lambda s, x: torch.erf(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.erf.default",),
    ),
    OpCase(
        "gelu",
        module_of(lambda s, x: F.gelu(x * s.w), {"w": W}),
        (X,),
        flops=24 * 6,  # mul; 0.5*x, x/sqrt(2), erf, +1, product
        aten=("aten.erf.default",),
    ),
    OpCase(
        "silu",
        module_of(lambda s, x: F.silu(x * s.w), {"w": W}),
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
        module_of(lambda s, x: x + s.w, {"w": (3, 1)}),
        (X,),
        flops=24,
        aten=("aten.add.Tensor", "aten.expand.default"),
    ),
    OpCase(
        "add_alpha",
        module_of(lambda s, x: torch.add(x, s.w, alpha=2.0), {"w": (3, 1)}),
        (X,),
        flops=24,
        aten=("aten.add.Tensor",),
    ),
    OpCase(
        "sub_broadcast",
        module_of(lambda s, x: x - s.w, {"w": (3, 1)}),
        (X,),
        flops=24,
        aten=("aten.sub.Tensor",),
    ),
    OpCase(
        "sub_broadcast_lhs",
        module_of(lambda s, x: s.w - x, {"w": (3, 1)}),
        (X,),
        flops=24,
        aten=("aten.sub.Tensor",),
    ),
    OpCase(
        "mul_broadcast",
        module_of(lambda s, x: x * s.w, {"w": (3, 1)}),
        (X,),
        flops=24,
        aten=("aten.mul.Tensor",),
    ),
    OpCase(
        "mul_broadcast_both",
        module_of(lambda s, x, y: x * y * s.w, {"w": (1, 4)}),
        ((2, 1, 4), (3, 1)),
        flops=24 + 24,  # (2,1,4) * (3,1) -> (2,3,4): 24; * w (1,4): 24
        aten=("aten.mul.Tensor",),
    ),
    OpCase(
        "div_broadcast",
        module_of(lambda s, x: x / s.w, {"w": pos(3, 1)}),
        (X,),
        flops=24,
        aten=("aten.div.Tensor",),
    ),
    OpCase(
        "div_by_input",
        module_of(lambda s, x: s.w / (x * x + 1), {"w": W}),
        (X,),
        flops=24 * 3,  # mul, add, div
        aten=("aten.div.Tensor",),
    ),
    OpCase(
        "scalar_arith",
        module_of(lambda s, x: 1.0 - ((x * s.w) * 2.5 + 1.5) / 4.0, {"w": W}),
        (X,),
        flops=24 * 5,  # mul, *2.5, +1.5, /4, 1-
        aten=("aten.mul.Tensor", "aten.add.Tensor", "aten.div.Tensor", "aten.sub.Tensor"),
    ),
    OpCase(
        "reuse",
        module_of(lambda s, x: (lambda y: y * y + y)(x * s.w), {"w": W}),
        (X,),
        flops=24 * 3,  # y = x*w used three times: mul, mul, add
        aten=("aten.mul.Tensor", "aten.add.Tensor"),
    ),
    # the Scalar overloads survive tracing only when called explicitly (x + 1 is add.Tensor)
    OpCase(
        "aten_scalar_overloads",
        module_of(
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
        module_of(lambda s, x, y: torch.where(x > 0, x * s.w, y), {"w": W}),
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
        module_of(lambda s, x: torch.where(x > 0, x * s.w, 0.0), {"w": W}),
        (X,),
        flops=24 * 3,
        aten=("aten.where.self", "aten.where.ScalarOther"),
    ),
    OpCase(
        "where_scalar_self",
        module_of(lambda s, x: torch.where(x > 0, 0.0, x * s.w), {"w": W}),
        (X,),
        flops=24 * 3,
        aten=("aten.where.self", "aten.where.ScalarSelf"),
    ),
]

# ---------------------------------------------------------------------------------------------
# activations, pow with tensor exponents
# ---------------------------------------------------------------------------------------------
UNARY_MORE = [
    OpCase(
        "gelu_tanh",
        module_of(lambda s, x: F.gelu(x * s.w, approximate="tanh"), {"w": W}),
        (X,),
        # mul; x*x*x (2 mul), *0.044715, +x, *sqrt(2/pi), tanh, +1, *0.5x (2 mul): 9 ops
        flops=24 + 24 * 9,
        aten=("aten.tanh.default",),
    ),
    OpCase(
        "softplus",
        module_of(lambda s, x: F.softplus(x * s.w), {"w": W}),
        (X,),
        # mul; exp, log1p, > threshold, where (beta = 1: no scaling): 4
        flops=24 + 24 * 4,
        aten=("aten.log1p.default", "aten.exp.default"),
    ),
    OpCase(
        "elu",
        module_of(lambda s, x: F.elu(x * s.w), {"w": W}),
        (X,),
        # mul; > 0, * input_scale, expm1, * alpha, * scale, where: 6
        flops=24 + 24 * 6,
        aten=("aten.expm1.default", "aten.where.self"),
    ),
    OpCase(
        "hardswish",
        module_of(lambda s, x: F.hardswish(x * s.w), {"w": W}),
        (X,),
        # mul; hardswish kept whole, 5 per element (the decomposition it was traced as: +3,
        # clamp (min 0), clamp (max 6), * x, / 6)
        flops=24 + 24 * 5,
        aten=("aten.hardswish.default", "aten.le.Scalar"),
    ),
    OpCase(
        "hardsigmoid",
        module_of(lambda s, x: F.hardsigmoid(x * s.w), {"w": W}),
        (X,),
        # mul; hardsigmoid kept whole, 4 per element (the decomposition it was traced as: +3,
        # clamp (min 0), clamp (max 6), / 6)
        flops=24 + 24 * 4,
        aten=("aten.hardsigmoid.default", "aten.logical_and.default"),
        xfail={"jvp": _SIXTH_IN_FLOAT32, "vjp": _SIXTH_IN_FLOAT32},
    ),
    OpCase(
        "sinc",
        module_of(lambda s, x: torch.sinc(x * s.w), {"w": W}),
        (X,),
        # mul; sinc kept whole, 5 per element (the decomposition it was traced as: π·x, == 0,
        # sin, the divide, the select)
        flops=24 + 24 * 5,
        aten=("aten.sinc.default", "aten.cos.default"),
    ),
    OpCase(
        "i0",
        module_of(lambda s, x: torch.i0(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; i0 1 per element (a transcendental)
        aten=("aten.i0.default",),
        xfail={"onnx": _NO_ONNX_FUNCTION},
    ),
    OpCase(
        "special_i1",
        module_of(lambda s, x: torch.special.i1(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; i1 1 per element (a transcendental)
        aten=("aten.special_i1.default",),
        xfail={"onnx": _NO_ONNX_FUNCTION},
    ),
    OpCase(
        "polygamma",
        module_of(lambda s, x: torch.polygamma(1, x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; trigamma 1 per element (a transcendental)
        aten=("aten.polygamma.default",),
        xfail={"onnx": _NO_ONNX_FUNCTION},
    ),
    OpCase(
        "margin_ranking_loss",
        module_of(
            lambda s, x: F.margin_ranking_loss(x * s.w, x, torch.sign(x), reduction="none"),
            {"w": W},
        ),
        (X,),
        # mul 24; sign 24; ATen's composite: x1 - x2 24, neg 24, * y 24, + margin 24, its C++
        # clamp_min_ (clamp_min.default) 24
        flops=24 + 24 + 5 * 24,
        aten=("aten.clamp_min.default",),
    ),
    OpCase(
        "mish",
        module_of(lambda s, x: F.mish(x * s.w), {"w": W}),
        (X,),
        # mul; softplus (exp, log1p, >20, where), tanh, *x: 6
        flops=24 + 24 * 6,
        aten=("aten.tanh.default", "aten.log1p.default"),
    ),
    OpCase(
        "clamp_min_max",
        module_of(
            lambda s, x: torch.clamp_min(x * s.w, -0.5) + torch.clamp_max(x * s.w, 0.5), {"w": W}
        ),
        (X,),
        flops=24 * 5,  # two mul, clamp_min, clamp_max, add
        aten=("aten.clamp.default", "aten.ge.Scalar", "aten.le.Scalar"),
    ),
    OpCase(
        "pow_tensor_tensor",
        module_of(lambda s, x: (x * x + s.a) ** (x * s.w), {"a": pos(*W), "w": W}),
        (X,),
        flops=24 * 4,  # mul, add, mul, pow
        aten=("aten.pow.Tensor_Tensor", "aten.log.default"),
    ),
    OpCase(
        "pow_scalar_base",
        module_of(lambda s, x: 2.0 ** (x * s.w), {"w": W}),
        (X,),
        flops=24 * 2,  # mul, pow
        aten=("aten.pow.Scalar",),
    ),
    OpCase(
        "remainder",
        module_of(lambda s, x: (x * s.w) % 1.5 + torch.fmod(x * s.w, 0.7), {"w": W}),
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
    OpCase(
        "rrelu_train",
        # lower == upper: the drawn factors are fixed (0.2), so the checks that rerun the
        # model see the same noise as the traced graph
        lambda: Fn(lambda s, x: F.rrelu(x * s.w, 0.2, 0.2, s.training), {"w": W}).train(),
        (X,),
        flops=24 + 24,  # mul 24; rrelu 1 per element 24 (and 24 random numbers drawn)
        aten=("aten.rrelu_with_noise.default",),
    ),
    OpCase(
        "rrelu_eval",  # evaluation: leaky ReLU with slope (lower + upper) / 2, no draw
        lambda: Fn(lambda s, x: F.rrelu(x * s.w, 0.1, 0.3, s.training), {"w": W}).eval(),
        (X,),
        flops=24 + 24,  # mul 24; rrelu 24
        aten=("aten.rrelu_with_noise.default",),
    ),
    OpCase(
        "rrelu_train_inplace",  # rrelu_with_noise_, traced functional
        lambda: Fn(
            lambda s, x: F.rrelu(x * s.w, 0.2, 0.2, s.training, inplace=True), {"w": W}
        ).train(),
        (X,),
        flops=24 + 24,  # mul 24; rrelu 24 (and 24 random numbers drawn)
        aten=("aten.rrelu_with_noise_functional.default",),
        # the reference, not graphflop: torch.func.jvp has no forward AD for rrelu_with_noise_
        # (finite differences check this case's JVP)
        xfail={"jvp": "PyTorch implements no forward AD for rrelu_with_noise_"},
    ),
    OpCase(
        "nan_to_num",
        module_of(lambda s, x: torch.nan_to_num(x * s.w) * s.r, {"w": W}, {"r": X}),
        (X,),
        # mul 24; traced as isnan, where (nan), eq, where (+inf), eq, where (−inf): 6·24 = 144;
        # readout 24
        flops=24 + 6 * 24 + 24,
        aten=("aten.isnan.default", "aten.where.self", "aten.eq.Scalar"),
    ),
]

# ---------------------------------------------------------------------------------------------
# masked_fill (traced as where), clamp with both bounds, hardtanh (kept whole),
# clamp with tensor bounds (crossed, lo > hi: eager gives hi and only hi a gradient)
# ---------------------------------------------------------------------------------------------
MASK_CLAMP = [
    OpCase(
        "masked_fill_scalar",
        module_of(
            lambda s, x: (x * s.w).masked_fill(s.m > 0, -1.0) * s.r, {"w": W}, {"m": X, "r": X}
        ),
        (X,),
        flops=24 * 4,  # mul; m > 0; where (the fill value a 0-FLOP scalar_tensor); readout
        aten=("aten.where.self", "aten.scalar_tensor.default", "aten.gt.Scalar"),
    ),
    OpCase(
        "masked_fill_tensor",
        module_of(
            lambda s, x: (x * s.w).masked_fill(s.m > 0, s.v) * s.r,
            {"w": W, "v": ()},
            {"m": X, "r": X},
        ),
        (X,),
        flops=24 * 4,  # mul; m > 0; where (v broadcast); readout
        aten=("aten.where.self",),
    ),
    OpCase(
        "clamp_both",
        module_of(lambda s, x: torch.clamp(x * s.w, -0.5, 0.5) * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 * 3,  # mul; clamp 1 per element; readout
        aten=("aten.clamp.default", "aten.logical_and.default"),
    ),
    OpCase(
        "hardtanh",
        module_of(lambda s, x: F.hardtanh(x * s.w, -0.5, 0.7) * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 * 3,  # mul; hardtanh (kept whole) 1 per element; readout
        aten=("aten.hardtanh.default", "aten.logical_or.default"),
    ),
]

CLAMP_TENSOR = [
    OpCase(
        "clamp_tensor_bounds",
        module_of(
            lambda s, x: torch.clamp(x * s.w, s.lo, s.lo + s.gap) * s.r,
            {"w": W, "lo": (4,), "gap": pos(3, 1)},
            {"r": X},
        ),
        (X,),
        # mul 24; lo + gap broadcast to (3,4): 12; clamp 1 per output element 24; readout 24
        flops=24 + 12 + 24 + 24,
        aten=("aten.clamp.Tensor", "aten.lt.Tensor", "aten.gt.Tensor"),
    ),
    OpCase(
        "clamp_tensor_crossed_bounds",
        module_of(
            lambda s, x: torch.clamp(x * s.w, s.lo, s.hi) * s.r,
            {"w": W, "lo": W, "hi": W},
            {"r": X},
        ),
        (X,),
        flops=24 * 3,  # mul; clamp 1 per output element; readout
        aten=("aten.clamp.Tensor", "aten.logical_or.default"),
    ),
    OpCase(
        "clamp_min_max_tensor",
        module_of(
            lambda s, x: (torch.clamp_min(x * s.w, s.lo) + torch.clamp_max(x * s.w, s.hi)) * s.r,
            {"w": W, "lo": W, "hi": W},
            {"r": X},
        ),
        (X,),
        flops=24 * 6,  # two mul; clamp_min; clamp_max (each traced as a clamp); add; readout
        aten=("aten.clamp.Tensor", "aten.ge.Tensor", "aten.le.Tensor"),
    ),
]

# ---------------------------------------------------------------------------------------------
# trigonometric, hyperbolic, base-2 and two-argument math functions (1 FLOP per output element,
# a transcendental, as pow), maximum/minimum (1 per output element) with ties split half/half
# ---------------------------------------------------------------------------------------------


def _ones(*shape: int):
    """A parameter initialiser of ones: two such weights make ``x·w`` and ``x·v`` tie exactly."""
    return lambda: torch.ones(shape)


MATH_MORE = [
    OpCase(
        "sin",
        module_of(lambda s, x: torch.sin(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; sin
        aten=("aten.sin.default", "aten.cos.default"),
    ),
    OpCase(
        "cos",
        module_of(lambda s, x: torch.cos(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; cos
        aten=("aten.cos.default", "aten.sin.default"),
    ),
    OpCase(
        "tan",
        module_of(lambda s, x: torch.tan(torch.tanh(x * s.w)), {"w": W}),
        (X,),
        flops=24 * 3,  # mul, tanh (keeps tan's argument inside (-1, 1)), tan
        aten=("aten.tan.default",),
    ),
    OpCase(
        "atan",
        module_of(lambda s, x: torch.atan(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; atan
        aten=("aten.atan.default",),
    ),
    OpCase(
        "sinh",
        module_of(lambda s, x: torch.sinh(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; sinh
        aten=("aten.sinh.default", "aten.cosh.default"),
    ),
    OpCase(
        "cosh",
        module_of(lambda s, x: torch.cosh(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; cosh
        aten=("aten.cosh.default", "aten.sinh.default"),
    ),
    OpCase(
        "asinh",
        module_of(lambda s, x: torch.asinh(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; asinh
        aten=("aten.asinh.default", "aten.rsqrt.default"),
    ),
    OpCase(
        "log2",
        module_of(lambda s, x: torch.log2(x * x + s.w), {"w": pos(*W)}),
        (X,),
        flops=24 * 3,  # mul, add, log2
        aten=("aten.log2.default",),
    ),
    OpCase(
        "exp2",
        module_of(lambda s, x: torch.exp2(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; exp2
        aten=("aten.exp2.default",),
    ),
    OpCase(
        "atan2_broadcast",
        module_of(lambda s, x: torch.atan2(s.v, x * s.w), {"w": W, "v": (3, 1)}),
        (X,),
        flops=24 + 24,  # mul; atan2 (v broadcast from (3, 1)) 1 per output element
        aten=("aten.atan2.default",),
    ),
    OpCase(
        "hypot",
        module_of(lambda s, x, y: torch.hypot(x * s.w, y), {"w": W}),
        (X, (4,)),
        flops=24 + 24,  # mul; hypot (y broadcast from (4,)) 1 per output element
        aten=("aten.hypot.default",),
    ),
    OpCase(
        "hypot_constant",
        module_of(lambda s, x: torch.hypot(x * s.w, s.b), {"w": W}, {"b": (4,)}),
        (X,),
        flops=24 + 24,  # mul; hypot against a buffer (no tangent): 1 per output element
        aten=("aten.hypot.default",),
    ),
    OpCase(
        "maximum_broadcast",
        module_of(lambda s, x, y: torch.maximum(x * s.w, y), {"w": W}),
        (X, (4,)),
        flops=24 + 24,  # mul; maximum 1 per output element
        aten=("aten.maximum.default", "aten.lt.Tensor", "aten.eq.Tensor"),
    ),
    OpCase(
        "maximum_constant",
        module_of(lambda s, x: torch.maximum(x * s.w, s.b), {"w": W}, {"b": (4,)}),
        (X,),
        flops=24 + 24,  # mul; maximum against a buffer (no tangent): 1 per output element
        aten=("aten.maximum.default",),
    ),
    OpCase(
        "minimum_constant_first",
        module_of(lambda s, x: torch.minimum(s.b, x * s.w), {"w": W}, {"b": (3, 1)}),
        (X,),
        flops=24 + 24,  # mul; minimum with a buffer first (only the second has a tangent)
        aten=("aten.minimum.default", "aten.gt.Tensor", "aten.where.ScalarSelf"),
    ),
    # every element ties (w = v = 1) with different tangents: PyTorch splits the derivative
    # half/half there, and so do central finite differences of max(a + εda, a + εdb)
    OpCase(
        "maximum_ties",
        module_of(lambda s, x: torch.maximum(x * s.w, x * s.v), {"w": _ones(*W), "v": _ones(*W)}),
        (X,),
        flops=24 * 3,  # two mul; maximum
        aten=("aten.maximum.default", "aten.where.ScalarSelf"),
    ),
    OpCase(
        "minimum_ties",
        module_of(lambda s, x: torch.minimum(x * s.w, x * s.v), {"w": _ones(*W), "v": _ones(*W)}),
        (X,),
        flops=24 * 3,  # two mul; minimum
        aten=("aten.minimum.default", "aten.where.ScalarSelf"),
    ),
    # all of them in one graph (the ONNX round trip's cover runs this one)
    OpCase(
        "math_mix",
        module_of(
            lambda s, x: (
                lambda a: (
                    torch.sin(a)
                    + torch.cos(a)
                    + torch.tan(torch.tanh(a))
                    + torch.atan(a)
                    + torch.atan2(a, s.v)
                    + torch.sinh(a)
                    + torch.cosh(a)
                    + torch.asinh(a)
                    + torch.hypot(a, s.v)
                    + torch.log2(a * a + 1)
                    + torch.exp2(a)
                    + torch.maximum(a, s.v)
                    + torch.minimum(a, s.v)
                    + a.prod(-1, keepdim=True)
                    + a.prod()
                )
            )(x * s.w),
            {"w": W, "v": (4,)},
        ),
        (X,),
        # a = x·w 24; on a's 24 elements: sin, cos, tanh and tan, atan, atan2, sinh, cosh, asinh,
        # hypot, a·a, + 1 and log2, exp2, maximum, minimum, prod along a dim (1 per input
        # element), prod of everything: 18·24 = 432; 15 terms, 14 adds of 24: 336
        flops=24 + 18 * 24 + 14 * 24,
        aten=("aten.atan2.default", "aten.hypot.default", "aten.prod.default"),
    ),
    OpCase(
        "erfinv",
        module_of(lambda s, x: torch.erfinv(torch.tanh(x * s.w) * 0.9), {"w": W}),
        (X,),
        flops=24 * 4,  # mul, tanh, · 0.9, erfinv (a transcendental): 1 per element each
        aten=("aten.erfinv.default",),
    ),
    OpCase(
        "fmax_broadcast",
        module_of(lambda s, x, y: torch.fmax(x * s.w, y * s.v), {"w": W, "v": (4,)}),
        (X, (4,)),
        flops=24 + 4 + 24,  # mul; y·v (4); fmax 1 per output element
        aten=("aten.fmax.default", "aten.ge.Tensor", "aten.isnan.default"),
    ),
    OpCase(
        "fmin_constant",
        module_of(lambda s, x: torch.fmin(x * s.w, s.b), {"w": W}, {"b": (4,)}),
        (X,),
        flops=24 + 24,  # mul; fmin against a buffer (no tangent): 1 per output element
        aten=("aten.fmin.default", "aten.le.Tensor"),
    ),
    OpCase(
        "copysign",
        module_of(lambda s, x, y: torch.copysign(x * s.w, y), {"w": W}),
        (X, (4,)),
        flops=24 + 24,  # mul; copysign (y broadcast from (4,)) 1 per output element
        aten=("aten.copysign.Tensor",),
    ),
]

# ---------------------------------------------------------------------------------------------
# products, quotients and sums with a complex Python scalar (the cotangent takes its
# conjugate, as PyTorch's gradient of ``x * c`` is ``grad * conj(c)``)
# ---------------------------------------------------------------------------------------------

_TORCH_POW_SCALAR_JVP = (
    "torch.func.jvp of torch.pow(complex scalar, real tensor) drops the tangent's imaginary "
    "part (torch 2.13; finite differences agree with graphflop's s^x·log(s)·dx, the fd check)"
)

COMPLEX_SCALAR = [
    OpCase(
        "mul_complex_scalar",
        module_of(lambda s, x: (1j * (x * s.w)).imag * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 * 3,  # mul; 1j · (complex result); .imag a view; readout
        aten=("aten.mul.Tensor",),
    ),
    OpCase(
        "div_complex_scalar",
        module_of(lambda s, x: ((x * s.w) / (1 + 2j)).imag * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 * 3,  # mul; / (1+2j); .imag a view; readout
        aten=("aten.div.Tensor",),
    ),
    OpCase(
        "complex_phase",
        module_of(lambda s, x: (x * torch.exp(1j * s.w)).real * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=12 + 12 + 24 + 24,  # 1j · w; exp; x · (broadcast); .real a view; readout
        aten=("aten.exp.default", "aten.mul.Tensor"),
    ),
    OpCase(
        "complex_alpha",
        module_of(
            lambda s, x: (
                (
                    torch.add(x * s.w * 1j, x * s.v * (1 - 1j), alpha=2 - 3j).imag
                    + torch.sub(x * s.w * 1j, x * s.v * (1 - 1j), alpha=0.5 + 1j).real
                    + torch.rsub(x * s.v * (1 - 1j), 3, alpha=1j).imag
                )
                * s.r
            ),
            {"w": W, "v": W},
            {"r": X},
        ),
        (X,),
        # x·w·1j (2 muls of 24) twice and x·v·(1−1j) three times, as written: 10·24; add,
        # sub and rsub with alpha one op each (the scaling inside it): 3·24; two adds of the
        # three terms 2·24; readout 24
        flops=10 * 24 + 3 * 24 + 2 * 24 + 24,
        aten=("aten.add.Tensor", "aten.sub.Tensor"),
    ),
    OpCase(
        "pow_complex_base",
        module_of(lambda s, x: torch.pow(2 + 1j, x * s.w).imag * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 * 3,  # mul; pow; readout
        aten=("aten.pow.Scalar",),
        xfail={"jvp": _TORCH_POW_SCALAR_JVP},
    ),
    OpCase(
        "pow_complex_exponent",
        module_of(
            lambda s, x: torch.pow((x * s.w) ** 2 + 1, 0.5 + 1j).real * s.r, {"w": W}, {"r": X}
        ),
        (X,),
        flops=24 * 5,  # mul; ** 2; + 1; ** (0.5+1j); readout
        aten=("aten.pow.Tensor_Scalar",),
    ),
]
