"""Derivatives at exact zeros, element by element against eager PyTorch: ``prod`` (one zero, two
zeros, a whole row or column of zeros, along the reduced dim and across it), ``atan2`` and
``hypot`` at the origin (signed zeros, underflowing and subnormal squares), the 2-norm
(``F.normalize``, ``F.cosine_similarity``) and ``std`` at a zero row, ``sinc`` at 0. Gradients against
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


@pytest.mark.parametrize("case", list(PROD_CASES))
def test_prod_derivatives_at_zeros_match_eager(case):
    f, x = PROD_CASES[case]
    tangents = _tangents((x,))
    got_t, (got_g,) = _derivatives(f, (x,), tangents)
    ref_t, (ref_g,) = _eager(f, (x,), tangents)
    assert ref_g.isfinite().all() and ref_t.isfinite().all()  # eager's are finite here
    _same(got_g, ref_g)
    _same(got_t, ref_t)


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
