"""Derivatives at exact zeros, element by element against eager PyTorch: ``prod`` (one zero, two
zeros, a whole row or column of zeros, along the reduced dim and across it), ``atan2`` and
``hypot`` at the origin (signed zeros, underflowing and subnormal squares), the 2-norm
(``F.normalize``, ``F.cosine_similarity``), other finite orders of the vector norm, ``std`` and
``std_mean`` at a zero row, ``sinc`` at 0 and at tiny x, ``max``/``min`` over all elements with
a NaN. Gradients against
``torch.autograd.grad`` of the summed output, tangents against ``torch.func.jvp``; where eager's
value is NaN or infinite graphflop's must be the same unless the other mode of eager's is finite
there (then it must agree with that one). And the FLOPs of the JVP and backward graphs of
``prod`` and ``atan2``, counted by hand (docs/flops_conventions.md)."""

from __future__ import annotations

import pytest
import torch

from graphflop.passes.flops import annotate_flops, total_cost
from graphflop.testing.real_derivatives import eager_derivatives as _eager
from graphflop.testing.real_derivatives import graphflop_derivatives as _derivatives
from graphflop.testing.real_derivatives import graphs as _graphs


def _same(got, ref):
    """Equal to rounding where ``ref`` is finite (a relative 1e-12 in float64, 1e-5 in float32:
    graphflop's products are taken in another order than eager's), the same NaN and inf (signs
    included) where it is not."""
    rtol = 1e-12 if ref.dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, ref, rtol=rtol, atol=1e-300, equal_nan=True)


def _tangents(inputs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in inputs)


def _with_zeros(shape, *zeros, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    for at in zeros:
        x[at] = 0.0
    return x


# rows of a (3, 4) input: row 0 one zero, row 1 two zeros, row 2 none; its columns: column 0
# one zero, column 1 one, column 2 one, column 3 none
_ROWS = ((0, 1), (1, 0), (1, 2))
PROD_CASES = {
    "dim1_one_two_none": (lambda x: x.prod(1), _with_zeros((3, 4), *_ROWS)),
    "dim0_across_the_zeros": (lambda x: x.prod(0), _with_zeros((3, 4), *_ROWS)),
    "keepdim_negative_dim": (lambda x: x.prod(-1, keepdim=True), _with_zeros((3, 4), *_ROWS)),
    # a whole column of zeros: one zero in every row reduced along dim 1, three in one column
    # reduced along dim 0
    "zero_column_dim1": (lambda x: x.prod(1), _with_zeros((3, 4), (0, 2), (1, 2), (2, 2))),
    "zero_column_dim0": (lambda x: x.prod(0), _with_zeros((3, 4), (0, 2), (1, 2), (2, 2))),
    "middle_dim_3d": (lambda x: x.prod(1), _with_zeros((2, 3, 2), (0, 0, 1), (1, 1, 0), (1, 2, 0))),
    "reduced_dim_of_one": (lambda x: x.prod(1), _with_zeros((3, 1), (1, 0))),
    "all_one_zero": (lambda x: x.prod(), _with_zeros((3, 4), (2, 3))),
    "all_two_zeros": (lambda x: x.prod(), _with_zeros((3, 4), (0, 0), (2, 3))),
    "all_no_zero": (lambda x: x.prod(), _with_zeros((3, 4))),
}


def _matches_finite_eager(f, x: torch.Tensor) -> None:
    """graphflop's gradient and tangent of ``f`` at ``x`` are eager's, which are finite."""
    tangents = _tangents((x,))
    got_t, (got_g,) = _derivatives(f, (x,), tangents)
    ref_t, (ref_g,) = _eager(f, (x,), tangents)
    assert ref_g.isfinite().all() and ref_t.isfinite().all()  # eager's are finite here
    _same(got_g, ref_g)
    _same(got_t, ref_t)


@pytest.mark.parametrize("case", list(PROD_CASES))
def test_prod_derivatives_at_zeros_match_eager(case):
    _matches_finite_eager(*PROD_CASES[case])


def test_prod_gradient_at_zeros_by_hand():
    # x = [[2, 0, 3], [0, 0, 5], [1, 2, 3]], prod along dim 1: row 0 has one zero, whose
    # gradient is the product of the others, 2·3 = 6, and 0 elsewhere (they multiply the zero);
    # row 1 has two, so every element's others hold a zero: 0; row 2 none: 2·3, 1·3, 1·2
    x = torch.tensor([[2.0, 0.0, 3.0], [0.0, 0.0, 5.0], [1.0, 2.0, 3.0]], dtype=torch.float64)
    t = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, -1.0, 2.0]], dtype=torch.float64)
    out_t, (grad,) = _derivatives(lambda u: u.prod(1), (x,), (t,))
    expected = torch.tensor([[0.0, 6.0, 0.0], [0.0, 0.0, 0.0], [6.0, 3.0, 2.0]])
    assert torch.equal(grad, expected.double())
    # the tangent is Σⱼ gradⱼ·tⱼ per row: 6·1; 0; 6·1 + 3·(−1) + 2·2 = 7
    assert torch.equal(out_t, torch.tensor([6.0, 0.0, 7.0], dtype=torch.float64))


def _points(dtype):
    """(y, x) pairs for atan2(y, x) and hypot(y, x): the origin with signed zeros, one argument
    zero, ordinary points, squares that underflow to 0 (``tiny``) and a sum of squares that is
    subnormal (``small``: eager's gradient overflows to inf there, its JVP stays finite)."""
    tiny, small = (1e-200, 1e-160) if dtype == torch.float64 else (1e-23, 1e-20)
    y = [0.0, 0.0, -0.0, -0.0, 0.0, 2.0, 3.0, 1.5, -0.5, tiny, 0.0, small]
    x = [0.0, -0.0, 0.0, -0.0, 2.0, 0.0, 4.0, -2.0, -0.7, 0.0, tiny, small]
    return torch.tensor(y, dtype=dtype), torch.tensor(x, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_atan2_at_the_origin_matches_eager_where_finite(dtype):
    y, x = _points(dtype)
    tangents = _tangents((y, x))
    got_t, got_g = _derivatives(torch.atan2, (y, x), tangents)
    ref_t, ref_g = _eager(torch.atan2, (y, x), tangents)
    origin = (y * y + x * x) == 0  # the origin and the underflowing squares: 6 points
    assert int(origin.sum()) == 6
    # eager's gradient is 0 there (atan2_backward zeroes its reciprocal), graphflop's too
    for g, r in zip(got_g, ref_g):
        assert torch.equal(r[origin], torch.zeros(6, dtype=dtype))
        finite = r.isfinite()
        _same(g[finite], r[finite])
        # eager's gradient is inf only at the subnormal sum of squares, where graphflop's is
        # finite: its JVP (below) is what eager's finite value there is
        assert torch.equal(~finite, torch.arange(12) == 11)
        assert g.isfinite().all()
    # torch.func.jvp is NaN or inf exactly at the origin; graphflop's JVP is its backward's
    # map, 0 there (eager's gradient · tangent), and eager's JVP elsewhere (the subnormal
    # point included)
    assert torch.equal(~ref_t.isfinite(), origin)
    assert torch.equal(got_t[origin], torch.zeros(6, dtype=dtype))
    _same(got_t[~origin], ref_t[~origin])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_hypot_at_the_origin_is_nan_as_eager(dtype):
    # eager's derivative of hypot is x / out: 0 / 0 = NaN at the origin in both modes, and
    # graphflop's the same; every other point (underflowing squares included: hypot does not
    # square) is finite and equal
    y, x = _points(dtype)
    tangents = _tangents((y, x))
    got_t, got_g = _derivatives(torch.hypot, (y, x), tangents)
    ref_t, ref_g = _eager(torch.hypot, (y, x), tangents)
    nan = torch.arange(12) < 4  # the four signed origins
    assert torch.equal(ref_t.isnan(), nan) and ref_t[~nan].isfinite().all()
    _same(got_t, ref_t)
    for g, r in zip(got_g, ref_g):
        assert torch.equal(r.isnan(), nan) and r[~nan].isfinite().all()
        _same(g, r)


def _flops(f, inputs):
    """FLOPs of the (forward, JVP, backward) graphs of ``f`` traced with the sum loss."""
    return tuple(total_cost(annotate_flops(g).graph.nodes).flops for g in _graphs(f, inputs))


def test_prod_jvp_and_backward_flops_by_hand():
    x = _with_zeros((3, 5), (0, 1))  # N = 15 elements, R = 3 outputs
    # forward: prod 15 (1 per input element) + the sum loss 3 = 18
    # JVP: the primal forward 18; the coefficient (the product of the others) 7 per element:
    # == 0, where, prod, sum (zero count), divide, == (no other zero), where: 7·15 = 105; the
    # tangent: mul 15, sum 15; the loss tangent's sum 3: 18 + 105 + 30 + 3 = 156
    # backward: the coefficient 105 and the cotangent's product 15 (expands cost 0): 120
    assert _flops(lambda u: u.prod(1), (x,)) == (18, 156, 120)
    # over everything: the loss sums 1 element: 16; JVP 16 + 105 + 30 + 1 = 152; backward 120
    assert _flops(lambda u: u.prod(), (x,)) == (16, 152, 120)


def test_atan2_jvp_and_backward_flops_by_hand():
    y, x = _with_zeros((3, 5), (0, 0)), _with_zeros((3, 5), (0, 0), seed=2)  # 15 elements
    # forward: atan2 15 + the sum loss 15 = 30
    # JVP: the primal 30; x² + y² 3·15, == 0 15, x / r², where 2·15, −y / r², where 3·15 (the
    # coefficients: 9·15 = 135); the tangent: two products and their sum 3·15 = 45; the loss
    # tangent's sum 15: 30 + 135 + 45 + 15 = 225
    # backward: the coefficients 135, one product per argument 2·15: 165
    assert _flops(torch.atan2, (y, x)) == (30, 225, 165)


# the 2-norm, normalize, cosine similarity and std at a zero (std: constant) row, sinc at 0:
# eager's backward masks the zero (linalg_vector_norm_backward, std_backward, sinc_backward
# give 0 there, normalize and cosine_similarity then finite through their eps clamp), where
# PyTorch's decompositions (sqrt of a sum of squares, sqrt of var, a where over sin(πx)/(πx))
# differentiated give 0·inf = NaN. Rows of a (3, 4) input: row 1 exactly zero (std: row 1
# constant, 2.0)
def _zero_row(value=0.0):
    x = _with_zeros((3, 4))
    x[1] = value
    return x


NORM_CASES = {
    "norm_dim": (lambda x: x.norm(dim=1), _zero_row()),
    "norm_keepdim_times_x": (lambda x: x.norm(dim=1, keepdim=True) * x, _zero_row()),
    "vector_norm_all": (lambda x: torch.linalg.vector_norm(x * 0.0), _zero_row()),
    "normalize": (lambda x: torch.nn.functional.normalize(x, dim=1), _zero_row()),
    "cosine_similarity": (
        lambda x: torch.nn.functional.cosine_similarity(x, x.flip(0) + 0.5, dim=1),
        _zero_row(),
    ),
    "std_dim": (lambda x: x.std(dim=1), _zero_row(2.0)),
    "std_keepdim_times_x": (lambda x: x.std(dim=1, keepdim=True) * x, _zero_row(2.0)),
    "sinc": (torch.sinc, _with_zeros((3, 4), (0, 1), (2, 3))),
}


@pytest.mark.parametrize("case", list(NORM_CASES))
def test_norm_std_sinc_gradients_at_zero_match_eager(case):
    f, x = NORM_CASES[case]
    tangents = _tangents((x,))
    got_t, (got_g,) = _derivatives(f, (x,), tangents)
    ref_t, (ref_g,) = _eager(f, (x,), tangents)
    # eager's are finite here (its forward mode masks the zero as its backward does)
    assert ref_g.isfinite().all() and ref_t.isfinite().all()
    _same(got_g, ref_g)
    _same(got_t, ref_t)


def test_norm_std_sinc_gradient_at_zero_by_hand():
    x = _zero_row()
    # d Σ‖xᵢ‖ / dx = xᵢ / ‖xᵢ‖, 0 on the zero row (norm_backward's mask)
    _, (g,) = _derivatives(lambda u: u.norm(dim=1), (x,), _tangents((x,)))
    _same(g, x / x.norm(dim=1, keepdim=True).clamp_min(1e-300))
    assert torch.equal(g[1], torch.zeros(4, dtype=torch.float64))
    # std of a constant row: 0 (std_backward's mask)
    _, (g,) = _derivatives(lambda u: u.std(dim=1), (_zero_row(2.0),), _tangents((x,)))
    assert torch.equal(g[1], torch.zeros(4, dtype=torch.float64)) and g.isfinite().all()
    # sinc'(0) = 0; sinc'(1/2) = (π/2·cos(π/2) − sin(π/2)) / (π/2 · 1/2) = −4/π
    pts = torch.tensor([0.0, 0.5], dtype=torch.float64)
    _, (g,) = _derivatives(torch.sinc, (pts,), _tangents((pts,)))
    _same(g, torch.tensor([0.0, -4.0 / torch.pi], dtype=torch.float64))


def test_norm_std_sinc_kept_whole_and_their_flops_by_hand():
    x = _with_zeros((3, 5))  # N = 15 elements, R = 3 rows
    aten = torch.ops.aten
    for f, op in (
        (lambda u: u.norm(dim=1), aten.linalg_vector_norm.default),
        (lambda u: u.std(dim=1), aten.std.correction),
        (torch.sinc, aten.sinc.default),
    ):
        fwd, _, _ = _graphs(f, (x,))
        assert op in {n.target for n in fwd.graph.nodes}
    # norm: forward x² and the sum 2·15, the square root 3, + the sum loss 3 = 36
    # JVP: the primal 36; x·ẋ 15, its sum 15; == 0, the safe norm, the divide, the select 4·3;
    # the loss tangent's sum 3: 36 + 30 + 12 + 3 = 81
    # backward: the select, the divide, == 0, the safe norm 4·3; ·x 15 (expands 0): 27
    assert _flops(lambda u: u.norm(dim=1), (x,)) == (36, 81, 27)
    # std: forward var 15 + 3, sqrt 3, + the loss 3 = 24
    # JVP: the primal 24; var's tangent: mean 15 + 3, x − mean 15, ·2/(n − 1) 15, ·ẋ 15, sum
    # 15 = 78; == 0, 2·std, the safe value, the divide, the select 5·3 = 15; the loss tangent 3:
    # 24 + 78 + 15 + 3 = 120
    # backward: 5·3 = 15; var's: mean 18, x − mean 15, ·2/(n − 1) 15, the product 15: 78
    assert _flops(lambda u: u.std(dim=1), (x,)) == (24, 120, 78)
    # sinc: forward 5·15 (πx, == 0, sin, the divide, the select) + the loss 15 = 90
    # JVP: the primal 90; πx, cos, the product, sin, −, πx·x, the divide, == 0, where: 9·15;
    # ·ẋ 15; the loss tangent 15: 90 + 135 + 15 + 15 = 255; backward 10·15 = 150
    assert _flops(torch.sinc, (x,)) == (90, 255, 150)


# siblings of the above: the vector norm's other finite orders (p = 3, 4 keepdim, 1.5, 0.5 and
# -1 at a zero row; p < 1 also at a zero element of a non-zero row, row 2's element 1, where
# eager's norm_backward masks |x|^(p-1) = inf), std_mean's standard deviation at a constant row
# (std_backward's mask, as std's), and sinc at tiny non-zero x whose π·x·x underflows to 0
# (sinc_backward masks that product, not x)
def _zero_row_and_element():
    x = _zero_row()
    x[2, 1] = 0.0
    return x


SIBLING_CASES = {
    "vector_norm_p3": (lambda x: torch.linalg.vector_norm(x, 3, dim=1), _zero_row_and_element()),
    "vector_norm_p4_keepdim_times_x": (
        lambda x: torch.linalg.vector_norm(x, 4.0, dim=1, keepdim=True) * x,
        _zero_row(),
    ),
    "vector_norm_p1_5": (lambda x: x.norm(p=1.5, dim=1), _zero_row_and_element()),
    "vector_norm_p0_5": (
        lambda x: torch.linalg.vector_norm(x, 0.5, dim=1),
        _zero_row_and_element(),
    ),
    "vector_norm_p_minus_1": (lambda x: torch.linalg.vector_norm(x, -1, dim=1), _zero_row()),
    "vector_norm_p3_all_zero": (lambda x: torch.linalg.vector_norm(x * 0.0, 3), _zero_row()),
    "vector_norm_p2_5_dtype": (
        # computed in float64, compared at float32's rounding (eager's forward mode takes
        # the coefficient from the float32 input)
        lambda x: torch.linalg.vector_norm(x, 2.5, dim=1, dtype=torch.float64).float(),
        _zero_row().float(),
    ),
    "std_mean_dim": (lambda x: torch.std_mean(x, dim=1)[0], _zero_row(2.0)),
    "std_mean_both_keepdim": (
        lambda x: (lambda s, m: s * x + m)(*torch.std_mean(x, dim=1, keepdim=True)),
        _zero_row(2.0),
    ),
    "std_mean_all_constant": (lambda x: torch.std_mean(x * 0.0 + 1.0)[0], _zero_row()),
    "sinc_tiny_float64": (
        torch.sinc,
        torch.tensor([1e-300, -1e-170, 0.0, 0.5, 1e-100], dtype=torch.float64),
    ),
    "sinc_tiny_float32": (torch.sinc, torch.tensor([1e-30, -1e-24, 0.0, 0.5, 1e-10])),
}


@pytest.mark.parametrize("case", list(SIBLING_CASES))
def test_norm_orders_std_mean_sinc_tiny_match_eager(case):
    _matches_finite_eager(*SIBLING_CASES[case])


def test_norm_orders_std_mean_sinc_tiny_by_hand():
    d = torch.float64
    x = torch.tensor([[0.0, 0.0], [1.0, 2.0], [1.0, 0.0], [4.0, 1.0]], dtype=d)
    t = _tangents((x,))
    # p = 3: d‖x‖₃/dx = x·|x| / ‖x‖₃², ‖(1, 2)‖₃ = 9^(1/3): (1, 4) / 9^(2/3); the zero row 0
    _, (g,) = _derivatives(lambda u: torch.linalg.vector_norm(u, 3, dim=1), (x,), t)
    assert torch.equal(g[0], torch.zeros(2, dtype=d))
    _same(g[1], torch.tensor([1.0, 4.0], dtype=d) / 9.0 ** (2.0 / 3.0))
    _same(g[2], torch.tensor([1.0, 0.0], dtype=d))
    # p = 1/2: sign(x)·|x|^(-1/2)·‖x‖^(1/2); ‖(4, 1)‖ = (2 + 1)² = 9: (1/2·3, 1·3) = (1.5, 3);
    # ‖(1, 0)‖ = 1: (1, 0), the zero element 0 (not 0·inf); the zero row 0
    _, (g,) = _derivatives(lambda u: torch.linalg.vector_norm(u, 0.5, dim=1), (x,), t)
    assert torch.equal(g[0], torch.zeros(2, dtype=d))
    _same(g[2:], torch.tensor([[1.0, 0.0], [1.5, 3.0]], dtype=d))
    # std_mean's std of (2, 2, 2): 0; of (1, 2, 4): mean 7/3, var (16 + 1 + 25)/9/2 = 7/3,
    # d std/dx = (x − 7/3) / (2·√(7/3))
    y = torch.tensor([[2.0, 2.0, 2.0], [1.0, 2.0, 4.0]], dtype=d)
    _, (g,) = _derivatives(lambda u: torch.std_mean(u, dim=1)[0], (y,), _tangents((y,)))
    assert torch.equal(g[0], torch.zeros(3, dtype=d))
    _same(g[1], (y[1] - 7.0 / 3.0) / (2.0 * (7.0 / 3.0) ** 0.5))
    # sinc at 1e-300 (π·x·x = 0 in float64) and 1e-30 in float32: 0, as at 0
    for pts in (torch.tensor([1e-300, 0.5], dtype=d), torch.tensor([1e-30, 0.5])):
        out_t, (g,) = _derivatives(torch.sinc, (pts,), _tangents((pts,)))
        _same(g, torch.tensor([0.0, -4.0 / torch.pi], dtype=pts.dtype))
        assert out_t.isfinite().all()


def test_max_min_all_with_nan_spread_over_the_nans():
    # eager's evenly_distribute_backward: the NaN elements share the gradient, the rest 0
    nan = float("nan")
    for f, x, expected in (
        (torch.max, [[1.0, nan], [3.0, 3.0]], [[0.0, 1.0], [0.0, 0.0]]),
        (torch.min, [[1.0, nan], [3.0, nan]], [[0.0, 0.5], [0.0, 0.5]]),
        (torch.max, [[1.0, 3.0], [3.0, 2.0]], [[0.0, 0.5], [0.5, 0.0]]),  # ties, no NaN
    ):
        x = torch.tensor(x, dtype=torch.float64)
        tangents = _tangents((x,))
        got_t, (got_g,) = _derivatives(f, (x,), tangents)
        _, (ref_g,) = _eager(f, (x,), tangents)
        assert torch.equal(got_g, torch.tensor(expected, dtype=torch.float64))
        assert torch.equal(got_g, ref_g)
        # the tangent: the mean of the tangent over the mask (eager's forward mode keeps
        # x == max and is NaN where the maximum is NaN; the output is NaN there anyway)
        _same(got_t, (tangents[0] * got_g).sum())


def test_norm_orders_std_mean_max_flops_by_hand():
    x = _with_zeros((3, 5))  # N = 15 elements, R = 3 rows
    # p = 3: forward |x|, pow, the sum 3·15, the root 3, the loss 3 = 51
    # JVP: the primal 51; |x|, pow, ·x 3·15; ·ẋ, the sum 2·15; == 0, the root's pow, the safe
    # value, the divide, the select 5·3; the loss tangent 3: 51 + 45 + 30 + 15 + 3 = 144
    # backward: the coefficient 45, ·ct 15, the per-row 15: 75
    assert _flops(lambda u: torch.linalg.vector_norm(u, 3, dim=1), (x,)) == (51, 144, 75)
    # p = 1/2: forward 51; JVP: sign, |x|, pow, ·, == 0, where 6·15; ·ẋ, sum 2·15; ‖x‖^(1/2),
    # the product 2·3; the loss 3: 51 + 90 + 30 + 6 + 3 = 180; backward 90 + 15 + 6 = 111
    assert _flops(lambda u: torch.linalg.vector_norm(u, 0.5, dim=1), (x,)) == (51, 180, 111)

    def std_mean_sum(u):
        s, m = torch.std_mean(u, dim=1)
        return s + m

    # std_mean, both used: forward std 15 + 2·3, mean 15 + 3, s + m 3, the loss 3 = 45
    # JVP: the primal 45; std's 78 + 15 (the std table above); mean's 15 + 3; + 3; the loss 3:
    # 45 + 93 + 18 + 3 + 3 = 162; backward: std's 78, mean's 18
    assert _flops(std_mean_sum, (x,)) == (45, 162, 96)
    # max over all: forward 15 + the loss 1 = 16; JVP: ==, isnan, their union, the count's
    # sum, the divide, ·ẋ, the sum 7·15; the loss 1: 16 + 105 + 1 = 122; backward 6·15 = 90
    assert _flops(lambda u: u.max().reshape(1), (x,)) == (16, 122, 90)
