"""Unary and binary elementwise ops: 1 FLOP per output element (docs/flops_conventions.md),
transcendentals tallied separately (trigonometric, hyperbolic, base-2, atan2, hypot, polygamma and
the modified Bessel functions i0 and i1 included:
one math-library call each, as pow); maximum and minimum split the derivative half/half at ties,
as PyTorch; comparisons, sign, rounding and integer bookkeeping (floor
division, logical and bitwise ops) have zero derivative. Leaky ReLU is one op (1 FLOP per element,
like ReLU), and so is hardtanh (1, as the clamp PyTorch decomposes it to; its derivative is not
clamp's at the bounds), hardswish (5, its decomposition's parts; its derivative selects),
hardsigmoid (4, its decomposition's parts; its derivative selects, 0 at ±3) and sinc (5, its
decomposition's parts, float32/float64; its derivative 0 where πx·x is 0, as eager's ``sinc_backward``);
GELU, SiLU, ELU, dropout, softplus and mish decompose into the ops
here (the decompositions graphflop chooses are at the end of this file).

JVP rules write the tangent as ``tangent * coefficient``, where the coefficient is a primal-only
value (``coef`` node), or, where PyTorch's derivative selects rather than multiplies by a 0/1
mask (ReLU, clamp, hardtanh, hardswish, hardsigmoid, maximum, minimum), as ``where(mask, tangent, 0)``, so
that a NaN or infinite tangent or cotangent at a masked-off element gives 0 there as in
PyTorch; every tangent node is linear in the tangents and transposes with the rules of
``mul``/``div``/``where``.
"""

from __future__ import annotations

import cmath
import math

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import FULL_PRECISION, bind, dtype, numel, per_output, shape
from graphflop.ops.registry import (
    def_jvp,
    def_transpose,
    def_zero,
    is_tensor_arg,
    keep_in_graph,
    register,
    register_decomposition,
    torch_decomposition,
    use_torch_decomposition,
)

aten = torch.ops.aten

F = "elementwise"
_one = per_output(1)
_trans = per_output(1, transcendental=True)
#: comparisons and logical ops: 1 FLOP per output element, a zero derivative (with sign)
_PIECEWISE_CONSTANT = (
    aten.eq.Scalar,
    aten.eq.Tensor,
    aten.ne.Scalar,
    aten.ne.Tensor,
    aten.gt.Scalar,
    aten.gt.Tensor,
    aten.ge.Scalar,
    aten.ge.Tensor,
    aten.lt.Scalar,
    aten.lt.Tensor,
    aten.le.Scalar,
    aten.le.Tensor,
    aten.logical_not.default,
    aten.logical_and.default,
    aten.bitwise_not.default,
    aten.isnan.default,  # nan_to_num traces to isnan, where and comparisons
    aten.isinf.default,
)

for _op in (
    aten.add.Tensor,
    aten.add.Scalar,
    aten.sub.Tensor,
    aten.sub.Scalar,
    aten.rsub.Scalar,
    aten.rsub.Tensor,
    aten.mul.Tensor,
    aten.mul.Scalar,
    aten.div.Tensor,
    aten.div.Scalar,
    aten.neg.default,
    aten.relu.default,
    aten.abs.default,
    aten.where.self,
    aten.where.ScalarOther,
    aten.where.ScalarSelf,
    aten.maximum.default,
    aten.minimum.default,
    aten.clamp.default,
    aten.clamp_min.default,
    aten.clamp_max.default,
    aten.sign.default,
    aten.reciprocal.default,
    *_PIECEWISE_CONSTANT,
):
    register(_op, F, _one)

for _op in (
    aten.exp.default,
    aten.log.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.sqrt.default,
    aten.rsqrt.default,
    aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor,
    aten.pow.Scalar,
    aten.erf.default,
    aten.sin.default,
    aten.cos.default,
    aten.log1p.default,
    aten.expm1.default,
    # math-library functions, one evaluation per output element, as pow: 1 FLOP, a transcendental
    aten.tan.default,
    aten.atan.default,
    aten.sinh.default,
    aten.cosh.default,
    aten.asinh.default,
    aten.log2.default,
    aten.exp2.default,
    aten.atan2.default,
    aten.hypot.default,
):
    register(_op, F, _trans)

for _op in (*_PIECEWISE_CONSTANT, aten.sign.default):
    def_zero(_op)


def _fit(b, t, out):
    """Broadcast a tangent up to the output's shape when the op broadcast its input."""
    if t is not None and shape(t) != shape(out):
        return b.call(aten.expand.default, t, list(shape(out)))
    return t


# --- add / sub: linear in both arguments ------------------------------------------------------


@def_jvp(aten.add.Tensor)
def _jvp_add(b, out, args, tangents, kwargs):
    alpha = bind(aten.add.Tensor, args, kwargs).alpha
    ty = tangents[1] if len(tangents) > 1 else None
    if ty is not None and alpha != 1:
        ty = b.call(aten.mul.Tensor, ty, alpha)
    return _fit(b, b.add(tangents[0], ty), out)


@def_jvp(aten.sub.Tensor)
def _jvp_sub(b, out, args, tangents, kwargs):
    alpha = bind(aten.sub.Tensor, args, kwargs).alpha
    tx, ty = tangents[0], tangents[1] if len(tangents) > 1 else None
    if ty is not None and alpha != 1:
        ty = b.call(aten.mul.Tensor, ty, alpha)
    if ty is None:
        return _fit(b, tx, out)
    if tx is None:
        return _fit(b, b.call(aten.neg.default, ty), out)
    return b.sub(tx, ty)


def _transpose_add_sub(op, sign: int):
    def rule(b, ct, args, kwargs, linear):
        a = bind(op, args, kwargs)
        cts = [None] * len(args)
        if linear[0]:
            cts[0] = b.sum_to(_complex_adjoint(b, ct, a.self), shape(a.self))
        if linear[1]:
            c = ct
            if sign * a.alpha != 1:
                # a complex alpha is conjugated, as a product's scalar factor
                c = b.call(aten.mul.Tensor, ct, _conj_if_complex(b, sign * a.alpha))
            cts[1] = b.sum_to(_complex_adjoint(b, c, a.other), shape(a.other))
        return cts

    return rule


def_transpose(aten.add.Tensor)(_transpose_add_sub(aten.add.Tensor, 1))
def_transpose(aten.sub.Tensor)(_transpose_add_sub(aten.sub.Tensor, -1))


@def_jvp(aten.add.Scalar)
def _jvp_add_scalar(b, out, args, tangents, kwargs):
    return tangents[0]


def_jvp(aten.sub.Scalar)(_jvp_add_scalar)


@def_jvp(aten.rsub.Scalar)
def _jvp_rsub_scalar(b, out, args, tangents, kwargs):
    # other - alpha * x
    t = b.call(aten.neg.default, tangents[0])
    alpha = bind(aten.rsub.Scalar, args, kwargs).alpha
    return t if alpha == 1 else b.call(aten.mul.Tensor, t, alpha)


# --- mul / div ----------------------------------------------------------------------------------


@def_jvp(aten.mul.Tensor)
def _jvp_mul(b, out, args, tangents, kwargs):
    x, y = args
    tx, ty = tangents
    t1 = b.call(aten.mul.Tensor, tx, y) if tx is not None else None
    t2 = b.call(aten.mul.Tensor, x, ty) if ty is not None else None
    return _fit(b, b.add(t1, t2), out)


def _is_complex(v) -> bool:
    return is_tensor_arg(v) and dtype(v).is_complex


def _complex_adjoint(b, g, like):
    """Over complex numbers the transpose (the real adjoint, PyTorch's gradient convention) of
    ``t ↦ t·c`` is ``ct ↦ ct·conj(c)`` (:func:`_conj_if_complex` conjugates ``c``), and a real
    argument's cotangent is the real part: ``g`` (``ct·conj(c)`` or ``ct/conj(c)``) is kept
    whole for a complex ``like``, its real part for a real one."""
    if dtype(g).is_complex and not dtype(like).is_complex:
        g = b.call(aten.select.int, b.call(aten.view_as_real.default, g), -1, 0)
    return g


def _conj_if_complex(b, v):
    """``conj(v)`` for a complex tensor (a ``conj_physical`` node) or a complex Python scalar
    (``1j * w``, ``w / (1+2j)``: PyTorch's gradient of a product is ``grad * other.conj()``
    whether ``other`` is a tensor or a scalar); ``v`` itself otherwise."""
    if isinstance(v, complex):
        return v.conjugate()
    return b.call(aten.conj_physical.default, v) if _is_complex(v) else v


@def_transpose(aten.mul.Tensor)
def _transpose_mul(b, ct, args, kwargs, linear):
    cts = [None, None]
    for i in (0, 1):
        if linear[i]:
            other = _conj_if_complex(b, args[1 - i])
            g = _complex_adjoint(b, b.call(aten.mul.Tensor, ct, other), args[i])
            cts[i] = b.sum_to(g, shape(args[i]))
    return cts


@def_jvp(aten.mul.Scalar)
def _jvp_mul_scalar(b, out, args, tangents, kwargs):
    return b.call(aten.mul.Scalar, tangents[0], args[1])


@def_transpose(aten.mul.Scalar)
def _transpose_mul_scalar(b, ct, args, kwargs, linear):
    g = b.call(aten.mul.Scalar, ct, _conj_if_complex(b, args[1]))
    return [_complex_adjoint(b, g, args[0]), None]


@def_jvp(aten.div.Tensor)
def _jvp_div(b, out, args, tangents, kwargs):
    x, y = args
    tx, ty = tangents
    t1 = b.call(aten.div.Tensor, tx, y) if tx is not None else None
    t2 = None
    if ty is not None:  # d(x/y) = dx/y - dy * (out / y)
        coef = b.call(aten.div.Tensor, out, y)
        t2 = b.call(aten.mul.Tensor, ty, coef)
    if t2 is None:
        return _fit(b, t1, out)
    if t1 is None:
        return _fit(b, b.call(aten.neg.default, t2), out)
    return b.sub(t1, t2)


@def_transpose(aten.div.Tensor)
def _transpose_div(b, ct, args, kwargs, linear):
    if linear[1]:
        raise ValueError("div is not linear in its divisor")
    y = _conj_if_complex(b, args[1])
    g = _complex_adjoint(b, b.call(aten.div.Tensor, ct, y), args[0])
    return [b.sum_to(g, shape(args[0])), None]


@def_jvp(aten.div.Scalar)
def _jvp_div_scalar(b, out, args, tangents, kwargs):
    return b.call(aten.div.Scalar, tangents[0], args[1])


@def_transpose(aten.div.Scalar)
def _transpose_div_scalar(b, ct, args, kwargs, linear):
    g = b.call(aten.div.Scalar, ct, _conj_if_complex(b, args[1]))
    return [_complex_adjoint(b, g, args[0]), None]


@def_jvp(aten.neg.default)
def _jvp_neg(b, out, args, tangents, kwargs):
    return b.call(aten.neg.default, tangents[0])


@def_transpose(aten.neg.default)
def _transpose_neg(b, ct, args, kwargs, linear):
    return [b.call(aten.neg.default, ct)]


# --- unary nonlinear ops: tangent * coefficient -------------------------------------------------


def _scale(b, t, coef):
    return b.call(aten.mul.Tensor, t, coef)


def _keep(b, t, mask):
    """``t`` where ``mask``, 0 elsewhere: a select, not a product with the mask, so a NaN or
    infinite tangent (cotangent, through the transpose of ``where``) at a masked-off element
    gives 0 there, as eager PyTorch's ``threshold_backward`` and ``clamp_backward`` select."""
    return b.call(aten.where.ScalarOther, mask, t, 0.0)


@def_jvp(aten.relu.default)
def _jvp_relu(b, out, args, tangents, kwargs):
    """``where(out <= 0, 0, dx)``: PyTorch's ``threshold_backward(grad, result, 0)``, which is
    also its forward-mode rule (``auto_element_wise``). A select, so a NaN or infinite tangent
    or cotangent where ``out <= 0`` gives 0 there, and ``out <= 0`` rather than ``out > 0`` so
    that a NaN primal passes the tangent on, as PyTorch's does. 2 FLOPs per element (the
    comparison and the select), as the mask and the product it replaced."""
    return b.call(aten.where.ScalarSelf, b.call(aten.le.Scalar, out, 0), 0.0, tangents[0])


@def_jvp(aten.exp.default)
def _jvp_exp(b, out, args, tangents, kwargs):
    return _scale(b, tangents[0], out)


@def_jvp(aten.log.default)
def _jvp_log(b, out, args, tangents, kwargs):
    return b.call(aten.div.Tensor, tangents[0], args[0])


@def_jvp(aten.sqrt.default)
def _jvp_sqrt(b, out, args, tangents, kwargs):
    return b.call(aten.div.Tensor, tangents[0], b.call(aten.mul.Tensor, out, 2.0))


@def_jvp(aten.rsqrt.default)
def _jvp_rsqrt(b, out, args, tangents, kwargs):
    # d x^{-1/2} = -1/2 x^{-3/2} = -1/2 out^3
    cube = b.call(aten.pow.Tensor_Scalar, out, 3)
    return _scale(b, tangents[0], b.call(aten.mul.Tensor, cube, -0.5))


@def_jvp(aten.tanh.default)
def _jvp_tanh(b, out, args, tangents, kwargs):
    sq = b.call(aten.mul.Tensor, out, out)
    return _scale(b, tangents[0], b.call(aten.rsub.Scalar, sq, 1))


@def_jvp(aten.sigmoid.default)
def _jvp_sigmoid(b, out, args, tangents, kwargs):
    one_minus = b.call(aten.rsub.Scalar, out, 1)
    return _scale(b, tangents[0], b.call(aten.mul.Tensor, out, one_minus))


@def_jvp(aten.pow.Tensor_Scalar)
def _jvp_pow_scalar(b, out, args, tangents, kwargs):
    x, n = args
    if n == 0:
        return None
    if n == 2:
        coef = b.call(aten.mul.Tensor, x, 2.0)
    elif n == 1:
        return tangents[0]
    else:
        coef = b.call(aten.mul.Tensor, b.call(aten.pow.Tensor_Scalar, x, n - 1), n)
    return _scale(b, tangents[0], coef)


@def_jvp(aten.abs.default)
def _jvp_abs(b, out, args, tangents, kwargs):
    """Real x: sign(x)·dx. Complex z: d|z| = Re(conj(z)·dz)/|z| = (Re z·Re dz + Im z·Im dz)/|z|,
    with ``view_as_real`` pairs (linear in dz: a product with a primal, a sum, a divide)."""
    if dtype(args[0]).is_complex:
        pairs = b.call(
            aten.mul.Tensor,
            b.call(aten.view_as_real.default, tangents[0]),
            b.call(aten.view_as_real.default, args[0]),
        )
        return b.call(aten.div.Tensor, b.call(aten.sum.dim_IntList, pairs, [-1]), out)
    return _scale(b, tangents[0], b.call(aten.sign.default, args[0]))


@def_jvp(aten.reciprocal.default)
def _jvp_reciprocal(b, out, args, tangents, kwargs):
    coef = b.call(aten.neg.default, b.call(aten.mul.Tensor, out, out))
    return _scale(b, tangents[0], coef)


@def_jvp(aten.erf.default)
def _jvp_erf(b, out, args, tangents, kwargs):
    # d erf(x) = 2/sqrt(pi) exp(-x^2)
    x = args[0]
    e = b.call(aten.exp.default, b.call(aten.neg.default, b.call(aten.mul.Tensor, x, x)))
    return _scale(b, tangents[0], b.call(aten.mul.Tensor, e, 1.1283791670955126))


@def_jvp(aten.sin.default)
def _jvp_sin(b, out, args, tangents, kwargs):
    return _scale(b, tangents[0], b.call(aten.cos.default, args[0]))


@def_jvp(aten.cos.default)
def _jvp_cos(b, out, args, tangents, kwargs):
    return _scale(b, tangents[0], b.call(aten.neg.default, b.call(aten.sin.default, args[0])))


@def_jvp(aten.tan.default)
def _jvp_tan(b, out, args, tangents, kwargs):
    # d tan(x) = 1 + tan²(x) = 1 + out²
    sq = b.call(aten.mul.Tensor, out, out)
    return _scale(b, tangents[0], b.call(aten.add.Tensor, sq, 1))


@def_jvp(aten.atan.default)
def _jvp_atan(b, out, args, tangents, kwargs):
    # d atan(x) = 1 / (1 + x²)
    x = args[0]
    return b.call(
        aten.div.Tensor, tangents[0], b.call(aten.add.Tensor, b.call(aten.mul.Tensor, x, x), 1)
    )


@def_jvp(aten.sinh.default)
def _jvp_sinh(b, out, args, tangents, kwargs):
    return _scale(b, tangents[0], b.call(aten.cosh.default, args[0]))


@def_jvp(aten.cosh.default)
def _jvp_cosh(b, out, args, tangents, kwargs):
    return _scale(b, tangents[0], b.call(aten.sinh.default, args[0]))


@def_jvp(aten.asinh.default)
def _jvp_asinh(b, out, args, tangents, kwargs):
    # d asinh(x) = 1 / sqrt(x² + 1)
    x = args[0]
    sq1 = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, x, x), 1)
    return _scale(b, tangents[0], b.call(aten.rsqrt.default, sq1))


@def_jvp(aten.log2.default)
def _jvp_log2(b, out, args, tangents, kwargs):
    # d log2(x) = 1 / (x · ln 2)
    return b.call(aten.div.Tensor, tangents[0], b.call(aten.mul.Tensor, args[0], math.log(2.0)))


@def_jvp(aten.exp2.default)
def _jvp_exp2(b, out, args, tangents, kwargs):
    # d 2ˣ = 2ˣ · ln 2
    return _scale(b, tangents[0], b.call(aten.mul.Tensor, out, math.log(2.0)))


@def_jvp(aten.atan2.default)
def _jvp_atan2(b, out, args, tangents, kwargs):
    """``atan2(y, x)``: d = (x·dy − y·dx) / (x² + y²), the coefficients ``x / (x² + y²)`` and
    ``−y / (x² + y²)`` primal-only and 0 where ``x² + y² = 0``, as PyTorch's ``atan2_backward``
    (at (0, 0), and where both squares underflow): eager's gradient is 0 there.
    ``torch.func.jvp`` gives NaN there (derivatives.yaml's forward formula divides by
    ``x² + y²``); graphflop's JVP, the linear map its backward transposes, gives 0. Dividing
    rather than multiplying by a reciprocal keeps the coefficient finite where ``x² + y²`` is
    a subnormal number (eager's gradient is inf there, its JVP finite, and graphflop's agree
    with the finite one). Per output element: ``x² + y²`` 3 FLOPs, the zero test 1, each
    coefficient a divide and a select (``−y`` one more), each tangent term a product, their
    sum 1: 12 with both tangents (9 of them the coefficients')."""
    y, x = args
    ty, tx = tangents
    r2 = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, x, x), b.call(aten.mul.Tensor, y, y))
    origin = b.call(aten.eq.Scalar, r2, 0)

    def coef(num):
        return b.call(aten.where.ScalarSelf, origin, 0.0, b.call(aten.div.Tensor, num, r2))

    t1 = _scale(b, ty, coef(x)) if ty is not None else None
    t2 = _scale(b, tx, coef(b.call(aten.neg.default, y))) if tx is not None else None
    return _fit(b, b.add(t1, t2), out)


@def_jvp(aten.hypot.default)
def _jvp_hypot(b, out, args, tangents, kwargs):
    """``hypot(x, y) = √(x² + y²)``: d = (x·dx + y·dy) / out (PyTorch's derivative formula:
    ``grad · self / result``, ``grad · other / result``; nan where both are 0, as PyTorch)."""
    x, y = args
    tx, ty = tangents
    t1 = _scale(b, tx, b.call(aten.div.Tensor, x, out)) if tx is not None else None
    t2 = _scale(b, ty, b.call(aten.div.Tensor, y, out)) if ty is not None else None
    return _fit(b, b.add(t1, t2), out)


def _jvp_extremum2(loses):
    """``maximum``/``minimum``: the tangent of the chosen argument, ties split half and half,
    selected as PyTorch's backward selects (derivatives.yaml, ``maximum``: self's gradient
    ``where(self == other, grad / 2, grad).masked_fill_(self < other, 0)``, other's with
    ``self > other``; ``minimum`` the other way round). ``loses(x, y)`` is where x is not
    chosen (``lt`` for maximum, ``gt`` for minimum). The tangent is
    ``h · (where(x loses, 0, dx) + where(y loses, 0, dy))`` with ``h = where(x == y, 0.5, 1)``
    a primal-only coefficient, so its transpose is eager's gradient exactly: a NaN or infinite
    cotangent gives 0 to the argument not chosen, and at a NaN primal (neither loses) both
    arguments get the cotangent, as eager's ``masked_fill``. PyTorch's forward-mode formula
    multiplies instead (``other_t + c · (self_t − other_t)``), so ``torch.func.jvp`` gives NaN
    where the argument not chosen has a NaN or infinite tangent, and the second argument's
    tangent alone at a NaN primal; graphflop's JVP is the map its backward transposes (as for
    clamp with tensor bounds and fmax). Per element with both tangents: the two comparisons,
    the tie test and ``h`` (4), the two selects, their sum and the product by ``h`` (4): 8 in
    the JVP, 7 in the backward (the sum's transpose is free); with one tangent 5 in both
    (docs/flops_conventions.md)."""

    def jvp(b, out, args, tangents, kwargs):
        x, y = args
        tx, ty = tangents
        if tx is None and ty is None:
            return None
        one = b.full([], 1.0, like=out)
        h = b.call(aten.where.ScalarSelf, b.call(aten.eq.Tensor, x, y), 0.5, one)
        sx = None if tx is None else _fit(b, _keep_unless(b, tx, b.call(loses, x, y)), out)
        sy = None if ty is None else _fit(b, _keep_unless(b, ty, b.call(loses, y, x)), out)
        return _scale(b, b.add(sx, sy), h)

    return jvp


def _keep_unless(b, t, mask):
    """``t`` where ``mask`` is false, 0 where it is true (a select: :func:`_keep`)."""
    return b.call(aten.where.ScalarSelf, mask, 0.0, t)


def_jvp(aten.maximum.default)(_jvp_extremum2(aten.lt.Tensor))
def_jvp(aten.minimum.default)(_jvp_extremum2(aten.gt.Tensor))


# --- where: linear in the two branches ----------------------------------------------------------


@def_jvp(aten.where.self)
def _jvp_where(b, out, args, tangents, kwargs):
    c = args[0]
    ta, tb = tangents[1], tangents[2]
    if ta is None and tb is None:
        return None
    if tb is None:
        r = b.call(aten.where.ScalarOther, c, ta, 0.0)
    elif ta is None:
        r = b.call(aten.where.ScalarSelf, c, 0.0, tb)
    else:
        r = b.call(aten.where.self, c, ta, tb)
    return _fit(b, r, out)


@def_transpose(aten.where.self)
def _transpose_where(b, ct, args, kwargs, linear):
    c = args[0]
    cts = [None, None, None]
    if linear[1]:
        cts[1] = b.sum_to(b.call(aten.where.ScalarOther, c, ct, 0.0), shape(args[1]))
    if linear[2]:
        cts[2] = b.sum_to(b.call(aten.where.ScalarSelf, c, 0.0, ct), shape(args[2]))
    return cts


@def_jvp(aten.where.ScalarOther)
def _jvp_where_so(b, out, args, tangents, kwargs):
    if tangents[1] is None:
        return None
    return _fit(b, b.call(aten.where.ScalarOther, args[0], tangents[1], 0.0), out)


@def_transpose(aten.where.ScalarOther)
def _transpose_where_so(b, ct, args, kwargs, linear):
    return [None, b.sum_to(b.call(aten.where.ScalarOther, args[0], ct, 0.0), shape(args[1])), None]


@def_jvp(aten.where.ScalarSelf)
def _jvp_where_ss(b, out, args, tangents, kwargs):
    if tangents[2] is None:
        return None
    return _fit(b, b.call(aten.where.ScalarSelf, args[0], 0.0, tangents[2]), out)


@def_transpose(aten.where.ScalarSelf)
def _transpose_where_ss(b, ct, args, kwargs, linear):
    return [None, None, b.sum_to(b.call(aten.where.ScalarSelf, args[0], 0.0, ct), shape(args[2]))]


# --- leaky ReLU, clamp, pow with tensor exponents, integer helpers ------------------------------

register(aten.leaky_relu.default, F, _one)


@def_jvp(aten.leaky_relu.default)
def _jvp_leaky_relu(b, out, args, tangents, kwargs):
    """d leaky_relu(x) = dx · (1 if x > 0 else slope); the coefficient is
    ``(x > 0)·(1 − slope) + slope``."""
    slope = bind(aten.leaky_relu.default, args, kwargs).negative_slope
    mask = b.call(aten._to_copy.default, b.call(aten.gt.Scalar, args[0], 0), dtype=dtype(args[0]))
    coef = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, mask, 1.0 - slope), slope)
    return _scale(b, tangents[0], coef)


#: randomized leaky ReLU in training: ``rrelu_with_noise`` writes each element's factor into
#: ``noise`` (a draw from U[lower, upper] where x < 0, 1 elsewhere) and returns x · noise;
#: ``rrelu_with_noise_functional`` (the traced form of ``rrelu_with_noise_``) returns both
_RRELU = (aten.rrelu_with_noise.default, aten.rrelu_with_noise_functional.default)


def _rrelu_cost(out, x, *args, **kwargs):
    """1 FLOP per element (the select and product, as ``leaky_relu``), and in training one
    random number per element drawn (as dropout's mask; PyTorch's CPU kernel draws only where
    x ≤ 0, a count the shapes cannot give, so every element is counted)."""
    n = numel(x)
    training = bind(aten.rrelu_with_noise.default, (x, *args), kwargs).training
    return NodeCost(flops=n, random_elements=n if training else 0)


def _jvp_rrelu(op):
    """d rrelu(x) = dx · noise in training (derivatives.yaml's ``rrelu_with_noise_backward``),
    the noise written by the op (output 1 of the functional form); in evaluation it is
    ``leaky_relu`` with slope (lower + upper) / 2. The noise carries no tangent."""

    def jvp(b, out, args, tangents, kwargs):
        if tangents[0] is None:
            return None
        a = bind(op, args, kwargs)
        functional = op is aten.rrelu_with_noise_functional.default
        if a.training:
            noise = b.getitem(out, 1) if functional else a.noise
            t = _scale(b, tangents[0], noise)
        else:
            slope = (a.lower + a.upper) / 2
            x = a.self
            mask = b.call(aten._to_copy.default, b.call(aten.gt.Scalar, x, 0), dtype=dtype(x))
            coef = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, mask, 1.0 - slope), slope)
            t = _scale(b, tangents[0], coef)
        return (t, None) if functional else t

    return jvp


for _op in _RRELU:
    register(_op, F, _rrelu_cost)
    def_jvp(_op)(_jvp_rrelu(_op))


def _clamp_bounds(op, args, kwargs):
    a = bind(op, args, kwargs)
    return a.min, a.max


def _clamp_tangent(b, t, x, lo, hi):
    """dx where lo ≤ x ≤ hi, 0 outside (PyTorch's convention at the bounds), selected as
    PyTorch's ``clamp_backward`` does (:func:`_keep`)."""
    mask = None
    if lo is not None:
        mask = b.call(aten.ge.Scalar, x, lo)
    if hi is not None:
        upper = b.call(aten.le.Scalar, x, hi)
        mask = upper if mask is None else b.call(aten.logical_and.default, mask, upper)
    return t if mask is None else _keep(b, t, mask)


# hardtanh (ReLU6 traces to it) is kept whole rather than traced as PyTorch's decomposition,
# a clamp: its derivative passes nothing at the bounds themselves, clamp's passes them
register(aten.hardtanh.default, F, _one)


@def_jvp(aten.hardtanh.default)
def _jvp_hardtanh(b, out, args, tangents, kwargs):
    """``where(x <= min_val | x >= max_val, 0, dx)``: PyTorch's ``hardtanh_backward`` (its
    decomposition in ``torch._decomp``), also its forward-mode rule (``auto_element_wise``). At
    x equal to a bound the derivative is 0 (eager's gradient of ``relu6`` at 0 and 6 is 0),
    unlike clamp's, which passes its bounds. A select, so a NaN or infinite tangent or
    cotangent outside gives 0. A NaN x passes the tangent on, as the decomposition and the
    scalar loop of PyTorch's CPU kernel (its vectorized loop gives 0 there). Per element: two
    comparisons, ``logical_or`` and the select, 4 FLOPs, as clamp's with both bounds; the
    forward 1, as the clamp it was traced as."""
    a = bind(aten.hardtanh.default, args, kwargs)
    outside = b.call(
        aten.logical_or.default,
        b.call(aten.le.Scalar, a.self, a.min_val),
        b.call(aten.ge.Scalar, a.self, a.max_val),
    )
    return b.call(aten.where.ScalarSelf, outside, 0.0, tangents[0])


# hardswish is kept whole rather than traced as PyTorch's decomposition (x·clamp(x + 3, 0, 6)/6),
# whose derivative multiplies (NaN · 0 where a NaN or infinite cotangent meets x < -3) and passes
# the clamp's bounds (-0.5 at x = -3, 1.5 at x = 3, where eager's hardswish_backward gives 0 and 1)
keep_in_graph(aten.hardswish.default)
#: 5 FLOPs per element, the parts of the decomposition it was traced as (+ 3, the two clamps,
#: the product and the divide)
register(aten.hardswish.default, F, per_output(5))


@def_jvp(aten.hardswish.default)
def _jvp_hardswish(b, out, args, tangents, kwargs):
    """``where(x <= -3, 0, dx) · c`` with ``c = where(x < 3, where(x <= -3, -3/2, x)/3 + 1/2,
    1)``: PyTorch's ``hardswish_backward`` (its CPU kernel's scalar loop and
    ``torch._decomp``'s), also its forward-mode rule (``auto_element_wise``): 0 from x = -3 down
    (-inf included), ``x/3 + 1/2`` strictly between -3 and 3, 1 from 3 up (+inf included). A
    select below -3, so a NaN or infinite tangent or cotangent there gives 0, as eager; above,
    the product by the coefficient is eager's own (``grad · (x/3 + 1/2)``, ``grad``). The
    coefficient is 0 below -3 (x moved to -3/2 there), not x/3 + 1/2, which is -inf at x = -inf,
    where the selected 0 times it would be NaN (in the JVP, the product coming last there); the
    derivative below -3 is +0 in the JVP and the backward, as eager's. A NaN x passes the
    tangent on (the comparisons false), as the scalar loop (the vectorized one gives NaN there).
    Per element: two comparisons, the select of x, the divide, the add and the coefficient's
    select (6), the product and the select (2): 8 in the JVP and in the backward, as the
    decomposition's derivative counted."""
    x = args[0]
    below = b.call(aten.le.Scalar, x, -3)
    coef = b.call(
        aten.where.ScalarOther,
        b.call(aten.lt.Scalar, x, 3),
        b.call(
            aten.add.Tensor,
            b.call(aten.div.Tensor, b.call(aten.where.ScalarSelf, below, -1.5, x), 3),
            0.5,
        ),
        1.0,
    )
    # the select before the product (with the coefficient 0 below -3, either order gives +0
    # there, and no NaN from a NaN or infinite tangent or cotangent)
    return _scale(b, _keep_unless(b, tangents[0], below), coef)


# hardsigmoid is kept whole rather than traced as PyTorch's decomposition (clamp(x + 3, 0, 6)/6),
# whose clamps pass their bounds (1/6 at x = ±3, where eager's hardsigmoid_backward gives 0)
keep_in_graph(aten.hardsigmoid.default)
#: 4 FLOPs per element, the parts of the decomposition it was traced as (+ 3, the two clamps,
#: the divide)
register(aten.hardsigmoid.default, F, per_output(4))


@def_jvp(aten.hardsigmoid.default)
def _jvp_hardsigmoid(b, out, args, tangents, kwargs):
    """``where(-3 < x < 3, dx / 6, 0)``: PyTorch's ``hardsigmoid_backward`` (``torch._decomp``'s
    and the CPU kernel's), also its forward-mode rule (``auto_element_wise``): 1/6 strictly
    between -3 and 3, 0 elsewhere, the bounds included (the decomposition's clamps passed them:
    1/6 at x = ±3). A select, so a NaN or infinite tangent or cotangent outside gives 0, as
    eager; a NaN x gives 0 (both comparisons false), as eager. Per element: two comparisons,
    ``logical_and``, the divide and the select, 5 in the JVP and in the backward, as the
    decomposition's derivative counted (two clamps' comparison and select, the divide)."""
    x = args[0]
    inside = b.call(
        aten.logical_and.default, b.call(aten.gt.Scalar, x, -3), b.call(aten.lt.Scalar, x, 3)
    )
    return _keep(b, b.call(aten.div.Tensor, tangents[0], 6.0), inside)


# sinc is kept whole (float32/float64) rather than traced as PyTorch's decomposition,
# where(πx == 0, 1, sin(πx)/(πx)), whose derivative at 0 is the unselected quotient's 0·inf (NaN)
@register_decomposition(aten.sinc.default)
def _sinc(x):
    """``sinc`` of a float32/float64 tensor stays one op (its rules below); other dtypes as
    PyTorch's decomposition (computed in float32)."""
    if x.dtype in FULL_PRECISION:
        return NotImplemented
    fallback = torch_decomposition(aten.sinc.default)
    assert fallback is not None  # PyTorch decomposes it (torch._refs)
    return fallback(x)


#: 5 FLOPs per element, one a transcendental: the parts of the decomposition it was traced as
#: (π·x, the test against 0, sin, the divide, the select)
register(
    aten.sinc.default,
    F,
    lambda out, *a, **k: NodeCost(flops=5 * numel(out), transcendentals=numel(out)),
)


@def_jvp(aten.sinc.default)
def _jvp_sinc(b, out, args, tangents, kwargs):
    """``dx · c``, ``c = where(πx·x == 0, 0, (πx·cos(πx) − sin(πx)) / (πx·x))``: PyTorch's
    ``sinc_backward`` (derivatives.yaml: the coefficient masked to 0 where the product πx·x is
    0, which is also where a tiny non-zero x underflows it, 1e-300 in float64, |x| below about
    1e-23 in float32; then multiplied by the gradient), also its forward-mode rule. The coefficient is primal-only. Per element:
    πx, cos, the product, sin, the subtract, πx·x, the divide, the test and the select (9, two
    transcendentals), and the product by the tangent (1): 10 in the JVP and in the backward."""
    x = args[0]
    px = b.call(aten.mul.Tensor, x, math.pi)
    num = b.call(
        aten.sub.Tensor,
        b.call(aten.mul.Tensor, px, b.call(aten.cos.default, px)),
        b.call(aten.sin.default, px),
    )
    pxx = b.call(aten.mul.Tensor, px, x)
    ratio = b.call(aten.div.Tensor, num, pxx)
    coef = b.call(aten.where.ScalarSelf, b.call(aten.eq.Scalar, pxx, 0), 0.0, ratio)
    return _scale(b, tangents[0], coef)


@def_jvp(aten.clamp.default)
def _jvp_clamp(b, out, args, tangents, kwargs):
    lo, hi = _clamp_bounds(aten.clamp.default, args, kwargs)
    return _clamp_tangent(b, tangents[0], args[0], lo, hi)


register(aten.clamp.Tensor, F, _one)


@def_jvp(aten.clamp.Tensor)
def _jvp_clamp_tensor(b, out, args, tangents, kwargs):
    """``clamp(x, lo, hi)`` with tensor bounds (either may be None), the selects of PyTorch's
    ``clamp_backward`` (x's part) and ``clamp_backward_min_max`` (the bounds'), so that the
    transpose is eager's gradient. Both bounds: dx where lo ≤ x ≤ hi; dlo where x < lo and
    lo < hi; dhi where x > hi or hi < lo: where lo > hi the output is hi and only hi gets a
    derivative, and where lo == hi > x none of the three does, as eager. One bound: dx where
    x ≥ lo (x ≤ hi), dlo where x < lo (dhi where x > hi); at a tie eager's forward mode gives
    the bound's tangent instead (``clamp_jvp``); graphflop follows the gradient. Each term a
    select (:func:`_keep`), so a NaN or infinite tangent or cotangent of one argument gives 0
    where another is chosen."""
    lo, hi = _clamp_bounds(aten.clamp.Tensor, args, kwargs)
    tx, tlo, thi = (list(tangents) + [None, None])[:3]
    return _clamp_tensor_tangent(b, out, args[0], lo, hi, tx, tlo, thi)


# ATen's own composites call ``clamp_min_``/``clamp_max_`` from C++ (margin_ranking_loss,
# hinge_embedding_loss, cosine_embedding_loss: ``clamp_min_(0)``), which reach the trace as
# ``clamp_min``/``clamp_max`` rather than as the clamp Python's ``clamp_min`` is traced as; some
# with a tensor bound under a C++ ``NoGradGuard`` (``clamp_min_(scalar_tensor(eps))``), nodes the
# trace tags grad-mode-off. 1 FLOP per element (as clamp); derivatives clamp's with one bound.
register(aten.clamp_min.Tensor, F, _one)
register(aten.clamp_max.Tensor, F, _one)


@def_jvp(aten.clamp_min.default)
def _jvp_clamp_min(b, out, args, tangents, kwargs):
    """dx where x ≥ min, 0 elsewhere (derivatives.yaml's ``clamp_min``: ``where(self >= min,
    grad, 0)``, eager's convention at the bound: the bound itself passes), as clamp's."""
    a = bind(aten.clamp_min.default, args, kwargs)
    return _clamp_tangent(b, tangents[0], a.self, a.min, None)


@def_jvp(aten.clamp_max.default)
def _jvp_clamp_max(b, out, args, tangents, kwargs):
    """dx where x ≤ max, 0 elsewhere (derivatives.yaml's ``clamp_max``), as clamp's."""
    a = bind(aten.clamp_max.default, args, kwargs)
    return _clamp_tangent(b, tangents[0], a.self, None, a.max)


@def_jvp(aten.clamp_min.Tensor)
def _jvp_clamp_min_tensor(b, out, args, tangents, kwargs):
    """dx where x ≥ min, dmin where x < min (derivatives.yaml's ``clamp_min.Tensor``), as
    :func:`_jvp_clamp_tensor` with no upper bound."""
    a = bind(aten.clamp_min.Tensor, args, kwargs)
    tx, tlo = (list(tangents) + [None])[:2]
    return _clamp_tensor_tangent(b, out, a.self, a.min, None, tx, tlo, None)


@def_jvp(aten.clamp_max.Tensor)
def _jvp_clamp_max_tensor(b, out, args, tangents, kwargs):
    """dx where x ≤ max, dmax where x > max (derivatives.yaml's ``clamp_max.Tensor``)."""
    a = bind(aten.clamp_max.Tensor, args, kwargs)
    tx, thi = (list(tangents) + [None])[:2]
    return _clamp_tensor_tangent(b, out, a.self, None, a.max, tx, None, thi)


def _clamp_tensor_tangent(b, out, x, lo, hi, tx, tlo, thi):
    """The tangent of ``clamp(x, lo, hi)`` with tensor bounds (:func:`_jvp_clamp_tensor`)."""
    parts = []
    if tx is not None:
        mask = None
        if lo is not None:
            mask = b.call(aten.ge.Tensor, x, lo)
        if hi is not None:
            upper = b.call(aten.le.Tensor, x, hi)
            mask = upper if mask is None else b.call(aten.logical_and.default, mask, upper)
        parts.append(tx if mask is None else _keep(b, tx, mask))
    both = lo is not None and hi is not None
    if tlo is not None:
        mask = b.call(aten.lt.Tensor, x, lo)
        if both:
            mask = b.call(aten.logical_and.default, mask, b.call(aten.lt.Tensor, lo, hi))
        parts.append(_keep(b, tlo, mask))
    if thi is not None:
        mask = b.call(aten.gt.Tensor, x, hi)
        if both:
            mask = b.call(aten.logical_or.default, mask, b.call(aten.lt.Tensor, hi, lo))
        parts.append(_keep(b, thi, mask))
    t = None
    for p in parts:
        t = b.add(t, p)
    return _fit(b, t, out)


@def_jvp(aten.pow.Tensor_Tensor)
def _jvp_pow_tensor(b, out, args, tangents, kwargs):
    """d(xʸ) = dx · y·x^(y−1) + dy · xʸ·log x."""
    x, y = args
    tx, ty = tangents
    t1 = t2 = None
    if tx is not None:
        coef = b.call(
            aten.mul.Tensor, y, b.call(aten.pow.Tensor_Tensor, x, b.call(aten.sub.Tensor, y, 1))
        )
        t1 = b.call(aten.mul.Tensor, tx, coef)
    if ty is not None:
        t2 = b.call(aten.mul.Tensor, ty, b.call(aten.mul.Tensor, out, b.call(aten.log.default, x)))
    return _fit(b, b.add(t1, t2), out)


@def_jvp(aten.pow.Scalar)
def _jvp_pow_scalar_base(b, out, args, tangents, kwargs):
    """d(sˣ) = dx · sˣ·log s."""
    log_s = cmath.log(args[0]) if isinstance(args[0], complex) else math.log(args[0])
    return _scale(b, tangents[1], b.call(aten.mul.Tensor, out, log_s))


# integer bookkeeping in decompositions (torch.roll, adaptive pooling): 1 FLOP per element;
# rounding is piecewise constant (zero derivative); fmod/remainder by a constant shift their
# argument (their JVP rules are elsewhere)
_INTEGER_BOOKKEEPING = (
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.trunc.default,
    aten.logical_or.default,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.bitwise_and.Scalar,  # grid sampling's reflection padding: flips & 1
    aten.bitwise_or.Scalar,
)
for _op in (aten.fmod.Scalar, aten.remainder.Scalar, aten.div.Tensor_mode, *_INTEGER_BOOKKEEPING):
    register(_op, F, _one)
for _op in _INTEGER_BOOKKEEPING:
    def_zero(_op)


def _jvp_shift(b, out, args, tangents, kwargs):
    """``fmod(x, c)`` and ``remainder(x, c)`` for a constant ``c`` are ``x`` minus a piecewise
    constant: the tangent passes through."""
    return tangents[0]


def_jvp(aten.fmod.Scalar)(_jvp_shift)
def_jvp(aten.remainder.Scalar)(_jvp_shift)


@def_jvp(aten.div.Tensor_mode)
def _jvp_div_mode(b, out, args, tangents, kwargs):
    """Floor and truncating division are piecewise constant (zero tangent); without a rounding
    mode it is ``div``."""
    if bind(aten.div.Tensor_mode, args, kwargs).rounding_mode is not None:
        return None
    return _jvp_div(b, out, args[:2], tangents[:2], {})


@def_jvp(aten.log1p.default)
def _jvp_log1p(b, out, args, tangents, kwargs):
    return b.call(aten.div.Tensor, tangents[0], b.call(aten.add.Tensor, args[0], 1))


@def_jvp(aten.expm1.default)
def _jvp_expm1(b, out, args, tangents, kwargs):
    return _scale(b, tangents[0], b.call(aten.add.Tensor, out, 1))


# --- decompositions ----------------------------------------------------------------------------
# SiLU, ELU and training-mode dropout as PyTorch decomposes them
use_torch_decomposition(aten.gelu, aten.silu, aten.elu, aten.native_dropout)


@register_decomposition(aten.gelu.default, dtypes=FULL_PRECISION)
def _gelu(x, approximate: str = "none"):
    """``x/2·(1 + erf(x/√2))``, or with ``approximate="tanh"``
    ``x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``."""
    if approximate == "tanh":
        inner = aten.mul.Tensor(aten.mul.Tensor(aten.mul.Tensor(x, x), x), 0.044715)
        inner = aten.mul.Tensor(aten.add.Tensor(x, inner), math.sqrt(2 / math.pi))
        half = aten.mul.Tensor(x, 0.5)
        return aten.mul.Tensor(half, aten.add.Tensor(aten.tanh.default(inner), 1))
    half = aten.mul.Tensor(x, 0.5)
    return aten.mul.Tensor(
        half, aten.add.Tensor(aten.erf.default(aten.mul.Tensor(x, math.sqrt(0.5))), 1)
    )


# --- erfinv, fmax / fmin, copysign ----------------------------------------------------------------

register(aten.erfinv.default, F, _trans)  # a math-library function: 1 FLOP, a transcendental


@def_jvp(aten.erfinv.default)
def _jvp_erfinv(b, out, args, tangents, kwargs):
    """d erfinv(x) = √π/2 · exp(erfinv(x)²) dx (derivatives.yaml: ``0.5 * sqrt(M_PI) *
    exp(self.erfinv().pow(2)) * grad``); the coefficient reads the output."""
    coef = b.call(aten.exp.default, b.call(aten.mul.Tensor, out, out))
    return _scale(b, tangents[0], b.call(aten.mul.Tensor, coef, math.sqrt(math.pi) / 2))


for _op in (aten.fmax.default, aten.fmin.default, aten.copysign.Tensor):
    register(_op, F, _one)  # 1 FLOP per output element, as maximum/minimum and abs


def _jvp_nan_extremum(pick):
    """``fmax``/``fmin``: the tangent of the argument chosen, NaNs ignored (derivatives.yaml:
    ``other_t + c · (self_t − other_t)`` with ``c = (self >= other) | isnan(other)`` for
    ``fmax``, ``self <= other`` for ``fmin``; at a tie the first argument's, unlike maximum's
    half and half). ``c`` is a primal-only coefficient."""

    def jvp(b, out, args, tangents, kwargs):
        x, y = args
        tx, ty = tangents
        if tx is None and ty is None:
            return None
        first = b.call(aten.logical_or.default, b.call(pick, x, y), b.call(aten.isnan.default, y))
        if ty is None:
            t = _keep(b, tx, first)
        elif tx is None:
            t = b.call(aten.where.ScalarSelf, first, 0.0, ty)
        else:
            t = b.call(aten.where.self, first, tx, ty)
        return _fit(b, t, out)

    return jvp


def_jvp(aten.fmax.default)(_jvp_nan_extremum(aten.ge.Tensor))
def_jvp(aten.fmin.default)(_jvp_nan_extremum(aten.le.Tensor))


@def_jvp(aten.copysign.Tensor)
def _jvp_copysign(b, out, args, tangents, kwargs):
    """``copysign(x, y) = |x|·sign(y)``: dx · out/x, 0 where x = 0 (derivatives.yaml's
    ``copysign_tensor_self_backward``: ``ratio = result / self``, masked to 0 where ``self ==
    0``); y's tangent does not reach the output (its sign is piecewise constant)."""
    x = args[0]
    if tangents[0] is None:
        return None
    ratio = b.call(aten.div.Tensor, out, x)
    coef = b.call(aten.where.ScalarSelf, b.call(aten.eq.Scalar, x, 0), 0.0, ratio)
    return _fit(b, _scale(b, tangents[0], coef), out)


# --- polygamma and the modified Bessel functions i0, i1 -------------------------------------------
# math-library functions, one evaluation per output element: 1 FLOP, a transcendental (as erfinv)
for _op in (aten.polygamma.default, aten.i0.default, aten.special_i1.default):
    register(_op, F, _trans)


@def_jvp(aten.polygamma.default)
def _jvp_polygamma(b, out, args, tangents, kwargs):
    """d ψ⁽ⁿ⁾(x) = ψ⁽ⁿ⁺¹⁾(x) dx (derivatives.yaml: ``grad * polygamma(n + 1, self)``)."""
    n, x = args
    if tangents[1] is None:
        return None
    return _scale(b, tangents[1], b.call(aten.polygamma.default, n + 1, x))


@def_jvp(aten.i0.default)
def _jvp_i0(b, out, args, tangents, kwargs):
    """d I₀(x) = I₁(x) dx (derivatives.yaml: ``grad * at::special_i1(self)``)."""
    return _scale(b, tangents[0], b.call(aten.special_i1.default, args[0]))


@def_jvp(aten.special_i1.default)
def _jvp_i1(b, out, args, tangents, kwargs):
    """d I₁(x) = (I₀(x) − I₁(x)/x) dx, 1/2 where |x| ≤ eps (PyTorch's ``i1_backward``: x
    replaced by eps there so that the unused branch stays finite, then the select). Per element:
    |x|, the comparison, the safe x's select, I₀, the divide, the subtract, the coefficient's
    select (7, I₀ transcendental), the product."""
    x = args[0]
    eps = torch.finfo(dtype(x)).eps
    big = b.call(aten.gt.Scalar, b.call(aten.abs.default, x), eps)
    safe = b.call(aten.where.ScalarOther, big, x, eps)
    coef = b.call(
        aten.sub.Tensor,
        b.call(aten.i0.default, safe),
        b.call(aten.div.Tensor, out, safe),
    )
    return _scale(b, tangents[0], b.call(aten.where.ScalarOther, big, coef, 0.5))
