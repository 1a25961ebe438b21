"""Derivatives that select, element by element against eager PyTorch: where ReLU, clamp (scalar
and tensor bounds) and threshold pass nothing on (a masked-off element), eager's
``threshold_backward`` and ``clamp_backward`` *select* 0 rather than multiply by a 0/1 mask, so a
NaN or infinite cotangent there gives a gradient of exactly 0, not NaN; and ``torch.func.jvp``
does the same with a NaN or infinite tangent. Hardtanh (and ReLU6) passes nothing at its bounds
themselves, as eager's ``hardtanh_backward``. ``torch.hypot(torch.relu(a), torch.relu(b))`` at
a, b ≤ 0 is such a point: hypot's cotangent is 0/0 = NaN. Leaky ReLU multiplies in eager too
(``where(x > 0, g, g·slope)``): graphflop's NaN there is eager's. And the FLOPs of ReLU's JVP and
backward graphs, counted by hand (docs/flops_conventions.md): the select costs what the product
it replaced did. Maximum and minimum (``masked_fill`` in eager's backward) and hardswish
(``hardswish_backward``'s regions) select too, their counts by hand, and so does hardsigmoid
(0 at ±3, as ``hardsigmoid_backward``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphflop.passes.flops import annotate_flops, total_cost
from graphflop.testing.real_derivatives import eager_derivatives as _eager
from graphflop.testing.real_derivatives import graphflop_derivatives as _derivatives
from graphflop.testing.real_derivatives import graphs as _graphs

NAN, INF = float("nan"), float("inf")


def _same(got, ref):
    """Equal to rounding, NaN where eager's is NaN and nowhere else, infinities equal."""
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0.0, equal_nan=True)


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


# elements 0-3 of a and b are at or below 0, so ReLU's output is 0 at both and hypot's
# cotangent there is 0/0 = NaN; elements 4 and 5 pass. Clamp passes its bound itself (x = 0)
# and a NaN there, as eager's clamp_backward does
A = _t(-1.0, -0.0, 0.0, -3.0, 2.0, 0.25)
B = _t(-2.0, 0.0, -0.5, -0.0, 1.0, 0.5)
TA = _t(NAN, INF, -INF, NAN, 1.5, -0.5)
TB = _t(INF, NAN, NAN, -INF, 0.5, 2.0)

HYPOT_OF_MASKED = {
    "relu": lambda a, b: torch.hypot(torch.relu(a), torch.relu(b)),
    "clamp_min": lambda a, b: torch.hypot(a.clamp(min=0.0), b.clamp(min=0.0)),
    "clamp_both": lambda a, b: torch.hypot(a.clamp(0.0, 4.0), b.clamp(0.0, 0.75)),
    "clamp_max_of_negated": lambda a, b: torch.hypot((-a).clamp(max=0.0), (-b).clamp(max=0.0)),
    "threshold": lambda a, b: torch.hypot(F.threshold(a, 0.0, 0.0), F.threshold(b, 0.0, 0.0)),
    "hardtanh_relu6": lambda a, b: torch.hypot(F.hardtanh(a, 0.0, 4.0), F.relu6(b)),
    "relu_inplace": lambda a, b: torch.hypot(F.relu(a * 1.0, inplace=True), torch.relu(b)),
}


@pytest.mark.parametrize("case", list(HYPOT_OF_MASKED))
def test_nan_cotangent_at_masked_off_elements_gives_zero_as_eager(case):
    f = HYPOT_OF_MASKED[case]
    _, got = _derivatives(f, (A, B), (TA, TB))
    _, ref = _eager(f, (A, B), (TA, TB))
    nan_cotangent = f(A, B) == 0  # hypot's cotangent is 0/0 = NaN there
    assert int(nan_cotangent.sum()) == 4
    for g, r in zip(got, ref):
        # eager's gradient is exactly 0 at an element masked off (strictly past the bound),
        # NaN where the value passed; graphflop's the same, and equal elsewhere
        assert (r[nan_cotangent] == 0).any() and r[~nan_cotangent].isfinite().all()
        _same(g, r)


def test_hypot_of_relu_at_negative_points_by_hand():
    # the brief's example: a, b < 0, so relu gives 0 at both and hypot's cotangent is NaN;
    # eager's gradient (threshold_backward selects) is 0, and graphflop's generated backward
    # gave NaN before ReLU's rule selected
    a, b = _t(-1.0, -2.0, 3.0), _t(-0.5, -4.0, 4.0)
    _, (ga, gb) = _derivatives(
        lambda a, b: torch.hypot(torch.relu(a), torch.relu(b)), (a, b), (a, b)
    )
    # at (3, 4): 3/5 and 4/5
    assert torch.equal(ga, _t(0.0, 0.0, 0.6)) and torch.equal(gb, _t(0.0, 0.0, 0.8))


SELECTS = {
    "relu": torch.relu,
    "clamp_min": lambda x: x.clamp(min=0.0),
    "clamp_max": lambda x: x.clamp(max=0.0),
    "clamp_both": lambda x: x.clamp(-0.5, 0.5),
    "threshold": lambda x: F.threshold(x, 0.1, -1.0),
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.5),
    "relu6": F.relu6,
    "relu6_inplace": lambda x: torch.nn.ReLU6(inplace=True)(x * 1.0),
}


@pytest.mark.parametrize("case", list(SELECTS))
def test_nan_and_inf_tangents_at_masked_off_elements_as_torch_func_jvp(case):
    # x below, at and above the bounds, and NaN (but for hardtanh, where eager's kernel
    # gives 0 or passes the tangent at a NaN x depending on the tensor's length); NaN and
    # infinite tangents everywhere but at the last x; w weighs the outputs (its tangent 0)
    x = _t(-2.0, -0.5, 0.0, 0.05, 0.5, 3.0, 6.0 if "relu6" in case or "hardtanh" in case else NAN)
    tx = _t(NAN, INF, -INF, NAN, INF, NAN, 1.0)
    w = _t(1, 2, 3, 4, 5, 6, 7)
    f = SELECTS[case]

    def g(u, w):
        return f(u) * w

    got_t, got_g = _derivatives(g, (x, w), (tx, torch.zeros(7, dtype=torch.float64)))
    ref_t, ref_g = _eager(g, (x, w), (tx, torch.zeros(7, dtype=torch.float64)))
    assert (ref_t == 0).any()  # some NaN or infinite tangent was masked off
    _same(got_t, ref_t)
    _same(got_g[0], ref_g[0])


def test_relu_tangent_and_gradient_by_hand():
    # relu(x) at x = [-1, 0, 2, NaN]: the tangent passes where relu's output is > 0 or NaN
    # (threshold_backward selects 0 where out <= 0; NaN <= 0 is false), so tangents
    # [NaN, inf, 1, 2] give [0, 0, 1, 2]; the gradient of Σ relu(x) is [0, 0, 1, 1]
    x = _t(-1.0, 0.0, 2.0, NAN)
    out_t, (grad,) = _derivatives(torch.relu, (x,), (_t(NAN, INF, 1.0, 2.0),))
    assert torch.equal(out_t, _t(0.0, 0.0, 1.0, 2.0))
    assert torch.equal(grad, _t(0.0, 0.0, 1.0, 1.0))


def test_hardtanh_passes_nothing_at_its_bounds_as_eager():
    # hardtanh_backward passes the cotangent strictly inside (min_val, max_val) only: relu6 at
    # x = 0 and x = 6 has gradient 0 (clamp's would be 1 there; hardtanh was traced as a clamp
    # before), 1 at 3; the tangent likewise (torch.func.jvp: the same formula)
    x = _t(-1.0, 0.0, 3.0, 6.0, 7.0, -0.0)
    out_t, (grad,) = _derivatives(F.relu6, (x,), (_t(NAN, INF, 2.0, NAN, 1.0, 1.0),))
    assert torch.equal(grad, _t(0.0, 0.0, 1.0, 0.0, 0.0, 0.0))
    assert torch.equal(out_t, _t(0.0, 0.0, 2.0, 0.0, 0.0, 0.0))
    ref_t, (ref_g,) = _eager(F.relu6, (x,), (_t(NAN, INF, 2.0, NAN, 1.0, 1.0),))
    assert torch.equal(grad, ref_g) and torch.equal(out_t, ref_t)
    # at a NaN x the tangent passes, as torch._decomp's hardtanh_backward and the scalar loop
    # of eager's CPU kernel (its vectorized loop gives 0: eager itself depends on the length)
    out_t, (grad,) = _derivatives(F.relu6, (_t(NAN),), (_t(2.0),))
    assert torch.equal(grad, _t(1.0)) and torch.equal(out_t, _t(2.0))
    # hardtanh is kept whole in the graph (1 FLOP per element, as the clamp it was traced as)
    fwd, _, _ = _graphs(F.relu6, (x,))
    assert torch.ops.aten.hardtanh.default in {n.target for n in fwd.graph.nodes}
    # forward 30, JVP 30 + (<=, >=, or, select) 4·15 + 15 = 105, backward 60: the clamp's
    assert _flops(F.relu6, (torch.randn(3, 5, dtype=torch.float64),)) == (30, 105, 60)


def test_clamp_tensor_bounds_select_as_eager_backward():
    # clamp(x, lo, hi) with tensor bounds: x's cotangent where lo <= x <= hi, lo's where
    # x < lo, hi's where x > hi (clamp_backward_min_max), each a select; a NaN cotangent
    # (hypot at (0, 0)) gives 0 to the arguments not chosen there
    x = _t(-1.0, 0.0, 2.0, 0.5)
    lo = _t(0.0, -1.0, 0.0, 0.0)
    hi = _t(1.0, 0.0, 1.0, 1.0)
    y = _t(0.0, 0.0, 0.0, 0.5)  # hypot(0, 0) at elements 0 and 1: a NaN cotangent

    def f(x, lo, hi, y):
        return torch.hypot(torch.clamp(x, lo, hi), y)

    tangents = (_t(NAN, 1.0, INF, 1.0), _t(1.0, NAN, 1.0, 1.0), _t(INF, NAN, 1.0, 1.0))
    tangents += (torch.zeros(4, dtype=torch.float64),)
    got_t, got = _derivatives(f, (x, lo, hi, y), tangents)
    ref_t, ref = _eager(f, (x, lo, hi, y), tangents)
    for g, r in zip(got[:3], ref[:3]):
        _same(g, r)
    # element 0 (x < lo): x's and hi's gradient 0, lo's NaN (hypot's); element 1 (x = hi):
    # x's NaN, lo's and hi's 0
    assert torch.equal(ref[0][:2].isnan(), torch.tensor([False, True]))
    assert torch.equal(ref[1][:2].isnan(), torch.tensor([True, False]))
    assert torch.equal(ref[2][:2], _t(0.0, 0.0))
    # the JVP: torch.func.jvp's clamp_jvp gives a tie (x = hi, element 1) the bound's
    # tangent where the backward gives x the cotangent; graphflop's JVP is its backward's
    # map: x's tangent there (1 · 0/0 = NaN, as eager's NaN hi tangent gives)
    _same(got_t, ref_t)


def test_leaky_relu_multiplies_as_eager():
    # eager's leaky_relu_backward is where(x > 0, g, g·slope): a NaN cotangent stays NaN on
    # both sides (slope 0 included), graphflop's coefficient product the same
    a, b = _t(-1.0, 0.0, 2.0), _t(-2.0, -0.0, 0.0)
    for slope in (0.0, 0.01):

        def f(a, b, slope=slope):
            return torch.hypot(F.leaky_relu(a, slope), F.leaky_relu(b, slope))

        got_t, got = _derivatives(f, (a, b), (_t(NAN, 1.0, 1.0), _t(1.0, INF, 1.0)))
        ref_t, ref = _eager(f, (a, b), (_t(NAN, 1.0, 1.0), _t(1.0, INF, 1.0)))
        assert ref[0][1].isnan()
        for g, r in zip(got, ref):
            _same(g, r)
        _same(got_t, ref_t)


def _flops(f, inputs):
    """FLOPs of the (forward, JVP, backward) graphs of ``f`` traced with the sum loss."""
    return tuple(total_cost(annotate_flops(g).graph.nodes).flops for g in _graphs(f, inputs))


def test_relu_and_clamp_jvp_and_backward_flops_by_hand():
    x = torch.randn(3, 5, dtype=torch.float64)  # N = 15 elements
    # forward: relu 15 + the sum loss 15 = 30
    # JVP: the primal 30; out <= 0 15, the select 15; the loss tangent's sum 15: 75
    # backward: out <= 0 15, the select 15 (the loss's cotangent an expand, 0): 30
    assert _flops(torch.relu, (x,)) == (30, 75, 30)
    # clamp(x, -0.5, 0.5): forward 30; JVP 30 + (>=, <=, and, select) 4·15 + 15 = 105;
    # backward 60
    assert _flops(lambda u: u.clamp(-0.5, 0.5), (x,)) == (30, 105, 60)


# maximum/minimum: eager's backward selects (derivatives.yaml: ``where(self == other, grad / 2,
# grad).masked_fill_(self < other, 0)`` for maximum's self), so hypot's NaN cotangent at
# hypot(maximum(a, b), c) = hypot(0, 0) gives the argument not chosen exactly 0. Elements: a
# chosen (0 > -1, output 0, NaN cotangent), b chosen (0 > -1, NaN cotangent), a tie (2 = 2,
# half each), a chosen with a finite cotangent, a tie at 0 (NaN cotangent, half of NaN each).
# minimum runs on the negated values: the same elements chosen, the same gradients
EXT_A = _t(0.0, -1.0, 2.0, 1.0, 0.0)
EXT_B = _t(-1.0, 0.0, 2.0, 0.0, 0.0)
EXT_C = _t(0.0, 0.0, 0.0, 1.0, 0.0)


@pytest.mark.parametrize("op", [torch.maximum, torch.minimum], ids=["maximum", "minimum"])
def test_extremum_gradient_selects_as_eager(op):
    sign = 1.0 if op is torch.maximum else -1.0

    def f(a, b, c):
        return torch.hypot(op(sign * a, sign * b), c)

    ones = torch.ones(5, dtype=torch.float64)
    _, got = _derivatives(f, (EXT_A, EXT_B, EXT_C), (ones, ones, ones))
    leaves = [v.clone().requires_grad_() for v in (EXT_A, EXT_B, EXT_C)]
    ref = torch.autograd.grad(f(*leaves).sum(), leaves)
    for g, r in zip(got, ref):
        _same(g, r)
    # by hand: a's gradient [NaN, 0, 1/2, 1/√2, NaN], b's [0, NaN, 1/2, 0, NaN]: element 1
    # (a not chosen, a NaN cotangent) is 0, where a 0/1 mask gives NaN · 0 = NaN
    _same(got[0], _t(NAN, 0.0, 0.5, 0.5**0.5, NAN))
    _same(got[1], _t(0.0, NAN, 0.5, 0.0, NAN))


@pytest.mark.parametrize("op", [torch.maximum, torch.minimum], ids=["maximum", "minimum"])
def test_extremum_nan_and_inf_upstream_gradient_as_eager(op):
    # a custom upstream gradient (the loss weighs by w, NaN or inf where one argument is not
    # chosen): the gradient of Σ w · op(a, b) is w selected onto the chosen argument, halved at
    # ties; eager's masked_fill gives 0 to the other, a 0/1 mask would give NaN · 0 = NaN. At a
    # NaN primal (element 5) neither argument is less than the other: eager's masked_fill passes
    # w to both
    a = _t(1.0, -1.0, 3.0, 2.0, 0.0, NAN)
    b = _t(-1.0, 1.0, 3.0, -2.0, 0.5, 1.0)
    w = _t(NAN, INF, 4.0, -INF, NAN, 3.0)

    def f(a, b, w):
        return op(a, b) * w

    zeros = torch.zeros(6, dtype=torch.float64)
    _, got = _derivatives(f, (a, b, w), (zeros, zeros, zeros))
    leaves = [v.clone().requires_grad_() for v in (a, b, w)]
    ref = torch.autograd.grad(f(*leaves).sum(), leaves)
    _same(got[0], ref[0])
    _same(got[1], ref[1])
    first_wins = a > b if op is torch.maximum else a < b
    # by hand: the chosen argument gets w, the other 0, each half of 4 at the tie (element 2),
    # both 3 at the NaN primal
    expect_a = torch.where(first_wins, w, torch.zeros_like(w))
    expect_b = torch.where(~first_wins, w, torch.zeros_like(w))
    expect_a[2] = expect_b[2] = 2.0
    expect_a[5] = expect_b[5] = 3.0
    _same(got[0], expect_a)
    _same(got[1], expect_b)


def test_extremum_tangent_selects():
    # graphflop's JVP is the map its backward transposes: the chosen argument's tangent, half
    # each at a tie, and a NaN or infinite tangent of the argument not chosen gives nothing.
    # Eager's forward formula multiplies (other_t + c · (self_t − other_t)): torch.func.jvp
    # agrees with finite tangents and is NaN where the argument not chosen has a NaN tangent
    a, b = _t(1.0, -1.0, 3.0, 2.0), _t(-1.0, 1.0, 3.0, -2.0)
    ta, tb = _t(2.0, 3.0, 4.0, 5.0), _t(7.0, 11.0, 13.0, 17.0)
    got_t, _ = _derivatives(torch.maximum, (a, b), (ta, tb))
    ref_t, _ = _eager(torch.maximum, (a, b), (ta, tb))
    _same(got_t, ref_t)
    assert torch.equal(got_t, _t(2.0, 11.0, 8.5, 5.0))  # a, b, (4 + 13)/2, a
    nan_t, inf_t = _t(2.0, NAN, 4.0, 5.0), _t(INF, 11.0, 13.0, -INF)
    got_t, _ = _derivatives(torch.maximum, (a, b), (nan_t, inf_t))
    assert torch.equal(got_t, _t(2.0, 11.0, 8.5, 5.0))  # as with finite tangents
    ref_t, _ = _eager(torch.maximum, (a, b), (nan_t, inf_t))
    assert ref_t[[0, 1, 3]].isnan().all()  # eager's product: 0 · NaN, inf − inf


def test_extremum_jvp_and_backward_flops_by_hand():
    x = torch.randn(3, 5, dtype=torch.float64)  # N = 15 elements
    y = torch.randn(3, 5, dtype=torch.float64)
    # forward: maximum 15 + the sum loss 15 = 30
    # JVP, both tangents: the primal 30; x < y, y < x, x == y, h = where(x == y, 0.5, 1) 4·15,
    # the two selects, their sum, the product by h 4·15; the loss tangent's sum 15: 165
    # backward: the same four coefficients 60, the product by h 15, the two selects 30: 105
    assert _flops(torch.maximum, (x, y)) == (30, 165, 105)
    assert _flops(torch.minimum, (x, y)) == (30, 165, 105)
    # one tangent (y a constant): coefficients (x < y, x == y, h) 3·15, select and product
    # 2·15: JVP 30 + 75 + 15 = 120, backward 75
    assert _flops(lambda u: torch.maximum(u, y), (x,)) == (30, 120, 75)


# hardswish: eager's hardswish_backward selects by region (0 from -3 down, x/3 + 1/2 strictly
# between -3 and 3, 1 from 3 up); graphflop traced PyTorch's decomposition x·clamp(x + 3, 0, 6)/6
# and differentiated its product: NaN · 0 at a NaN cotangent below -3, and -1/2 at x = -3,
# 3/2 at x = 3 (the clamp passes its bounds)
HS_X = _t(-4.0, -3.0, -1.5, 0.0, 1.0, 3.0, 5.0)


def test_hardswish_gradient_selects_as_eager():
    # hypot(hardswish(x), c) with c = 0: hypot's cotangent is NaN where hardswish(x) = 0
    # (x = -4, -3, 0); eager's gradient is 0 below and at -3, NaN at 0
    c = torch.zeros(7, dtype=torch.float64)

    def f(x, c):
        return torch.hypot(F.hardswish(x), c)

    _, got = _derivatives(f, (HS_X, c), (torch.ones(7, dtype=torch.float64), c))
    leaves = [v.clone().requires_grad_() for v in (HS_X, c)]
    ref = torch.autograd.grad(f(*leaves).sum(), leaves)
    _same(got[0], ref[0])
    assert torch.equal(got[0][:2], _t(0.0, 0.0)) and got[0][3].isnan()


def test_hardswish_derivatives_by_region_as_eager():
    # the gradient of Σ hardswish(x) by hand: 0 at -4 and -3, x/3 + 1/2 at -1.5, 0, 1
    # (0, 1/2, 5/6), 1 at 3 and 5
    x = HS_X
    out_t, (grad,) = _derivatives(F.hardswish, (x,), (torch.ones(7, dtype=torch.float64),))
    leaf = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad(F.hardswish(leaf).sum(), [leaf])
    expect = _t(0.0, 0.0, 0.0, 0.5, 1.0 / 3.0 + 0.5, 1.0, 1.0)
    _same(grad, expect)
    _same(ref, expect)
    # NaN and infinite tangents below -3 give 0 (torch.func.jvp: hardswish_backward(t, x))
    tx = _t(NAN, INF, 2.0, 2.0, 2.0, 2.0, NAN)
    got_t, _ = _derivatives(F.hardswish, (x,), (tx,))
    ref_t, _ = _eager(F.hardswish, (x,), (tx,))
    _same(got_t, ref_t)
    assert torch.equal(got_t[:2], _t(0.0, 0.0)) and got_t[6].isnan()
    # in place (nn.Hardswish(inplace=True)) alike
    inplace = torch.nn.Hardswish(inplace=True)
    _, (grad,) = _derivatives(lambda u: inplace(u * 1.0), (x,), (tx,))
    _same(grad, expect)


# hardswish at the infinities, its bounds, 0 and ordinary points: torch.func.jvp and
# torch.func.vjp give hardswish_backward(t, x), 0 at -inf (the coefficient x/3 + 1/2 there is
# -inf, and 0 · -inf NaN), t at +inf, 0 at -3, t at 3, t/2 at 0
HS_INF_X = _t(-INF, -4.0, -3.0, -1.5, 0.0, 1.0, 2.0, 3.0, 5.0, INF)


@pytest.mark.parametrize(
    "t",
    [
        _t(2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0),
        _t(NAN, INF, -INF, 2.0, -1.0, 0.5, 3.0, -2.0, 7.0, 1.5),
    ],
    ids=["finite", "nan-inf-below"],
)
def test_hardswish_derivatives_at_infinities_as_torch_func(t):
    x = HS_INF_X
    got_t, _ = _derivatives(F.hardswish, (x,), (t,))
    ref_t = torch.func.jvp(F.hardswish, (x,), (t,))[1]
    _same(got_t, ref_t)
    # by hand: 0 from -inf to -3, x/3 + 1/2 at -1.5, 0, 1, 2 (0, 1/2, 5/6, 7/6), 1 from 3 up
    coef = _t(0.0, 0.0, 0.0, 0.0, 0.5, 1.0 / 3.0 + 0.5, 2.0 / 3.0 + 0.5, 1.0, 1.0, 1.0)
    _same(got_t, torch.where(coef == 0, 0.0, coef * t))
    assert not got_t[:3].signbit().any()  # +0 from -inf to -3, as eager's select
    # the backward with t as the cotangent (Σ hardswish(x)·w, w = t: x's cotangent is
    # hardswish_backward(w, x)) as torch.func.vjp's
    _, (grad, _) = _derivatives(lambda u, w: F.hardswish(u) * w, (x, t), (t, t))
    _same(grad, torch.func.vjp(F.hardswish, x)[1](t)[0])
    assert not grad[:3].signbit().any()


def test_hardswish_kept_whole_and_its_flops_by_hand():
    x = torch.randn(3, 5, dtype=torch.float64)  # N = 15 elements
    fwd, _, _ = _graphs(F.hardswish, (x,))
    assert torch.ops.aten.hardswish.default in {n.target for n in fwd.graph.nodes}
    # forward: hardswish 5·15 (the parts it was traced as: + 3, two clamps, ·x, /6) + loss 15
    # = 90; JVP: the primal 90; x <= -3, x < 3, the select of x (-3/2 below -3), /3, + 1/2,
    # the coefficient's select, the select and the product 8·15; the loss tangent's sum 15:
    # 225; backward 8·15 = 120
    assert _flops(F.hardswish, (x,)) == (90, 225, 120)


# hardsigmoid: eager's hardsigmoid_backward selects (1/6 strictly between -3 and 3, 0 elsewhere,
# the bounds included); graphflop traced PyTorch's decomposition clamp(x + 3, 0, 6)/6, whose
# clamps pass their bounds: 1/6 at x = ±3
HSIG_X = _t(-4.0, -3.0, 0.0, 3.0, 4.0)


def test_hardsigmoid_derivatives_at_its_bounds_as_eager():
    # the gradient of Σ hardsigmoid(x) by hand: 1/6 at 0 only
    x = HSIG_X
    _, (grad,) = _derivatives(F.hardsigmoid, (x,), (torch.ones(5, dtype=torch.float64),))
    leaf = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad(F.hardsigmoid(leaf).sum(), [leaf])
    expect = _t(0.0, 0.0, 1.0 / 6.0, 0.0, 0.0)
    _same(grad, expect)
    # eager's CPU kernel multiplies by 1/6 rounded to float32, in float64 too: 3e-8 relative
    torch.testing.assert_close(ref, expect, rtol=1e-7, atol=0.0)
    # NaN and infinite tangents outside give 0 (torch.func.jvp), inside NaN stays NaN
    tx = _t(NAN, INF, NAN, -INF, 2.0)
    got_t, _ = _derivatives(F.hardsigmoid, (x,), (tx,))
    ref_t, _ = _eager(F.hardsigmoid, (x,), (tx,))
    torch.testing.assert_close(got_t, ref_t, rtol=1e-7, atol=0.0, equal_nan=True)
    assert torch.equal(got_t[[0, 1, 3, 4]], _t(0.0, 0.0, 0.0, 0.0)) and got_t[2].isnan()
    # a NaN cotangent outside gives 0: hypot(hardsigmoid(x), 0) at hardsigmoid(x) = 0 (x = -4, -3)
    c = torch.zeros(5, dtype=torch.float64)

    def f(u, c):
        return torch.hypot(F.hardsigmoid(u), c)

    _, got = _derivatives(f, (x, c), (torch.ones(5, dtype=torch.float64), c))
    leaves = [v.clone().requires_grad_() for v in (x, c)]
    ref = torch.autograd.grad(f(*leaves).sum(), leaves)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-7, atol=0.0, equal_nan=True)
    assert torch.equal(got[0][:2], _t(0.0, 0.0))


def test_hardsigmoid_kept_whole_and_its_flops_by_hand():
    x = torch.randn(3, 5, dtype=torch.float64)  # N = 15 elements
    fwd, _, _ = _graphs(F.hardsigmoid, (x,))
    assert torch.ops.aten.hardsigmoid.default in {n.target for n in fwd.graph.nodes}
    # forward: hardsigmoid 4·15 (the parts it was traced as: + 3, two clamps, /6) + loss 15
    # = 75; JVP: the primal 75; x > -3, x < 3, logical_and, /6, the select 5·15; the loss
    # tangent's sum 15: 165; backward 5·15 = 75
    assert _flops(F.hardsigmoid, (x,)) == (75, 165, 75)


def test_clamp_min_from_aten_composites_selects_as_eager():
    # hinge_embedding_loss and margin_ranking_loss call clamp_min_ from C++: the trace has
    # aten.clamp_min.default (Python's clamp_min is traced as clamp), which had a cost rule but
    # no JVP rule, so the backward stopped there (gradient 0). Its derivative is clamp's with
    # one bound (where(x >= min, g, 0)): at the bound itself the cotangent passes. hinge at
    # margin 1: elements 1 (x = 1, target -1: margin - x = 0, the bound) and 3 (x = 2, past it)
    x, y = _t(-1.0, 1.0, 0.5, 2.0, 1.0, -0.25), _t(1, -1, -1, -1, 1, -1)
    tx = _t(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)

    def hinge(x, y):
        return F.hinge_embedding_loss(x, y, margin=1.0, reduction="none")

    fwd, _, _ = _graphs(hinge, (x, y))
    assert torch.ops.aten.clamp_min.default in {n.target for n in fwd.graph.nodes}
    got_t, (got_g, _) = _derivatives(hinge, (x, y), (tx, torch.zeros(6, dtype=torch.float64)))
    ref_t, (ref_g,) = _eager(lambda u: hinge(u, y), (x,), (tx,))
    # target 1: x's own derivative 1; target -1: -1 up to the bound (x <= 1), 0 past it
    assert torch.equal(ref_g, _t(1.0, -1.0, -1.0, 0.0, 1.0, -1.0))
    assert torch.equal(got_g, ref_g) and torch.equal(got_t, ref_t)

    # margin_ranking_loss = clamp_min(-y·(a − c) + margin, 0): element 0 at the bound (passes)
    a, c, s = _t(1.0, 2.0, 3.0, 0.5), _t(0.5, 2.5, 1.0, 0.5), _t(1.0, 1.0, -1.0, -1.0)

    def ranking(a, c, s):
        return F.margin_ranking_loss(a, c, s, margin=0.5, reduction="none")

    ta, tc = _t(1.0, 2.0, 3.0, 4.0), _t(1.0, 1.0, 1.0, 1.0)
    got_t, got = _derivatives(ranking, (a, c, s), (ta, tc, torch.zeros(4, dtype=torch.float64)))
    ref_t, ref = _eager(lambda a, c: ranking(a, c, s), (a, c), (ta, tc))
    assert torch.equal(ref[0], _t(-1.0, -1.0, 1.0, 1.0))
    for g, r in zip(got[:2], ref):
        assert torch.equal(g, r)
    assert torch.equal(got_t, ref_t)
    # N = 4: forward sub, neg, mul, + margin, clamp_min, the sum loss: 6·4 = 24; JVP the
    # primal 24, the tangents of sub, neg, the product (2 products and an add), clamp_min's
    # (>=, select) and the sum: 8·4 = 32, 56; backward clamp_min's (>=, select) 8, the
    # product's two 8, neg's and sub's second operand negated 8: 24
    assert _flops(ranking, (a, c, s)) == (24, 56, 24)


CLAMP_ONE_BOUND = {
    # (op as ATen's C++ calls it, the clamp the same call traces to from Python, bound, the
    # gradients by hand: x's 1 up to and at the bound, 0 past it; a tensor bound's where x is
    # strictly past it, derivatives.yaml's clamp_min/clamp_max(.Tensor))
    "clamp_min": ("default", lambda x, lo: torch.clamp(x, 0.5), ((0, 1, 1, 1), None)),
    "clamp_max": ("default", lambda x, lo: torch.clamp(x, None, 0.5), ((1, 1, 0, 0), None)),
    "clamp_min_tensor": ("Tensor", lambda x, lo: torch.clamp(x, lo), ((0, 1, 1, 1), (1, 0, 0, 0))),
    "clamp_max_tensor": (
        "Tensor",
        lambda x, lo: torch.clamp(x, None, lo),
        ((1, 1, 0, 0), (0, 0, 1, 1)),
    ),
}


@pytest.mark.parametrize("case", list(CLAMP_ONE_BOUND))
def test_clamp_min_max_overloads_derivatives_by_hand(case):
    # aten.clamp_min/clamp_max (.default, .Tensor) as ATen's C++ calls them: no Python call
    # traces to them (clamp_min(x) is traced as clamp), so the clamp node of the Python call
    # is rewritten to the overload and the graphs built from it; x = [0, 0.5, 1, 2] around
    # the bound 0.5 (a tensor bound [0.5, 0.5, 0.5, 1])
    from graphflop.ad.jvp import build_jvp
    from graphflop.ad.vjp import build_vjp
    from graphflop.frontend.trace import trace
    from graphflop.meta import SIGNATURE, VJP
    from graphflop.runtime.verify import run_backward, run_forward
    from graphflop.testing.opdb.core import Fn

    overload, f, (dx, dlo) = CLAMP_ONE_BOUND[case]
    name = case.removesuffix("_tensor")
    op = getattr(getattr(torch.ops.aten, name), overload)
    x, lo = _t(0.0, 0.5, 1.0, 2.0), _t(0.5, 0.5, 0.5, 1.0)
    fwd = trace(Fn(lambda s, x, lo: f(x, lo)), (x, lo), loss="sum")
    (node,) = [
        n
        for n in fwd.graph.nodes
        if n.target in (torch.ops.aten.clamp.default, torch.ops.aten.clamp.Tensor)
    ]
    bound = node.args[2] if name == "clamp_max" and len(node.args) > 2 else node.args[1]
    node.target, node.args, node.kwargs = op, (node.args[0], bound), {}
    fwd.recompile()
    bwd = build_vjp(fwd, input_grads=True)
    sig = fwd.meta[SIGNATURE]
    grads = run_backward(bwd, run_forward(fwd, dict(zip(sig.inputs, (x, lo)))))
    by_name = {n: grads[pos] for pos, n in bwd.meta[VJP].input_grads}
    assert torch.equal(by_name[sig.inputs[0]], _t(*dx))
    if dlo is not None:
        assert torch.equal(by_name[sig.inputs[1]], _t(*dlo))
    # eager's gradient, the same
    leaves = (x.clone().requires_grad_(), lo.clone().requires_grad_())
    out = op(leaves[0], leaves[1] if overload == "Tensor" else 0.5)
    ref = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    assert torch.equal(ref[0], _t(*dx))
    # N = 4: forward the clamp and the sum loss, 8; JVP 8 + the comparison and select 8 (a
    # tensor bound: x's and lo's, 2 comparisons, 2 selects and their add, 20) + the sum 4
    jvp_flops = 8 + (20 if dlo is not None else 8) + 4
    assert _flops_of((fwd, build_jvp(fwd, "all", wrt_outputs="outputs"))) == (8, jvp_flops)


def _flops_of(graphs):
    return tuple(total_cost(annotate_flops(g).graph.nodes).flops for g in graphs)
