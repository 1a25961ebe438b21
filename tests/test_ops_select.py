"""Derivatives that select, element by element against eager PyTorch: where ReLU, clamp (scalar
and tensor bounds) and threshold pass nothing on (a masked-off element), eager's
``threshold_backward`` and ``clamp_backward`` *select* 0 rather than multiply by a 0/1 mask, so a
NaN or infinite cotangent there gives a gradient of exactly 0, not NaN; and ``torch.func.jvp``
does the same with a NaN or infinite tangent. Hardtanh (and ReLU6) passes nothing at its bounds
themselves, as eager's ``hardtanh_backward``. ``torch.hypot(torch.relu(a), torch.relu(b))`` at
a, b ≤ 0 is such a point: hypot's cotangent is 0/0 = NaN. Leaky ReLU multiplies in eager too
(``where(x > 0, g, g·slope)``): graphflop's NaN there is eager's. And the FLOPs of ReLU's JVP and
backward graphs, counted by hand (docs/flops_conventions.md): the select costs what the product
it replaced did."""

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
