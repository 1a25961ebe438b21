"""Rules checked outside the op database: ``aten._grouped_mm`` (cost only: PyTorch's
CPU kernel takes no float64, so the database's float64 checks cannot run it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphflop


class Grouped(nn.Module):
    """``torch._grouped_mm(x, w, offs)``: 2-D × 3-D with row offsets, or 3-D × 3-D."""

    def __init__(self, three_d: bool):
        super().__init__()
        self.three_d = three_d
        self.w = nn.Parameter(torch.randn(2, 16, 8))
        self.register_buffer("offs", torch.tensor([2, 6], dtype=torch.int32))

    def forward(self, x):
        if self.three_d:
            return torch._grouped_mm(x, self.w)
        return torch._grouped_mm(x, self.w, self.offs)


@pytest.mark.parametrize(
    ("three_d", "x_shape", "flops"),
    [
        # 2-D × 3-D: 6 rows split 2 + 4 over 2 experts of 16×8: 2·(2 + 4)·16·8 = 1,536
        (False, (6, 16), 2 * 6 * 16 * 8),
        # 3-D × 3-D: 2 groups of (5×16)·(16×8): 2·2·5·16·8 = 2,560
        (True, (2, 5, 16), 2 * 2 * 5 * 16 * 8),
    ],
)
def test_grouped_mm_cost_by_hand(three_d, x_shape, flops):
    with torch.device("meta"):  # the meta kernel takes bfloat16 only
        model = Grouped(three_d).to(torch.bfloat16)
    x = torch.empty(x_shape, device="meta", dtype=torch.bfloat16)
    a = graphflop.analyze(model, (x,), loss="sum", jvp=False)
    fwd = [r for r in a.report.ops if r.phase == "forward" and r.op == "aten._grouped_mm.default"]
    assert [(r.flops, r.mm_flops) for r in fwd] == [(flops, flops)]
    # no derivative rules: the backward is cut there and says so
    (gap,) = a.report.uncounted
    assert gap.op == "aten._grouped_mm.default" and "cost" not in gap.missing
    assert not a.report.totals.backward.complete


def test_addbmm_counts_one_product_by_hand():
    """FlopCounterMode counts 0 for torch.addbmm (no formula), so the op database's FLOPs check
    of the ``addbmm`` case is an xfail; the hand figure is checked here. x (2,3,4), w (2,4,5):
    one (3×8)·(8×5) product 2·3·8·5 = 240 (all matrix FLOPs); alpha· 15, beta·b 15, add 15."""

    class AddBmm(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Parameter(torch.randn(3, 5))
            self.w = nn.Parameter(torch.randn(2, 4, 5))

        def forward(self, x):
            return torch.addbmm(self.b, x, self.w, beta=0.5, alpha=2.0)

    a = graphflop.analyze(AddBmm(), (torch.randn(2, 3, 4),), loss="none", jvp=False)
    fwd = a.report.totals.forward
    assert (fwd.flops, fwd.mm_flops) == (240 + 15 + 15 + 15, 240)


def test_bilinear_counts_two_products_by_hand():
    """FlopCounterMode counts 0 for nn.Bilinear (no formula for aten._trilinear, which had no
    rule: the backward stopped there), so the ``bilinear`` case's FLOPs check is an xfail; the
    hand figure is checked here. nn.Bilinear(6, 5, 3) at batch 4: x1 (4×6) with the weight
    (3×6×5) over in1, 2·4·3·6·5 = 720, then with x2 (4×5) over in2, 2·4·3·5 = 120 (all matrix
    FLOPs); the bias add 4·3 = 12; the forward total also holds the sum loss's 12 adds. Every
    phase complete, nothing uncounted."""
    torch.manual_seed(0)
    m = nn.Bilinear(6, 5, 3)
    a = graphflop.analyze(m, (torch.randn(4, 6), torch.randn(4, 5)), loss="sum")
    fwd = a.report.totals.forward
    assert (fwd.flops, fwd.mm_flops) == (720 + 120 + 12 + 12, 720 + 120)
    assert a.report.totals.loss.flops == 12
    assert not a.report.uncounted
    assert a.report.totals.backward.complete and a.report.totals.jvp.complete


def test_linalg_solve_analyses_end_to_end():
    """torch.linalg.solve through analyze (its error-check node left out of the trace): A 4×4
    (a parameter + 6·I), B (4, 3): add 16; LU ⌊2·4³/3⌋ = 42; substitutions 2·4²·3 = 96. Every
    phase complete, no gap; the backward's solves reuse the LU (linalg_lu_solve)."""

    class Solve(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(4, 4))

        def forward(self, rhs):
            return torch.linalg.solve(self.a + 6.0 * torch.eye(4), rhs)

    a = graphflop.analyze(Solve(), (torch.randn(4, 3),), loss="sum")
    r = a.report
    solve = [x for x in r.ops if x.phase == "forward" and x.op == "aten._linalg_solve_ex.default"]
    assert [(x.flops, x.mm_flops) for x in solve] == [(42 + 96, 0)]
    assert not r.uncounted
    assert r.totals.forward.complete and r.totals.backward.complete and r.totals.jvp.complete


class _MultilabelMargin(nn.Module):
    """``F.multilabel_margin_loss`` of a parameter row: its value is the loss."""

    def __init__(self, target: list[int]):
        super().__init__()
        self.x = nn.Parameter(torch.tensor([[0.1, 0.2, 0.4, 0.8]], dtype=torch.double))
        self.register_buffer("y", torch.tensor([target]))

    def forward(self, z):
        return nn.functional.multilabel_margin_loss(self.x * z, self.y)


@pytest.mark.parametrize(
    ("target", "by_hand"),
    [
        # targets {3, 0}, others {1, 2}: (1 - (.8 - .2)) + (1 - (.8 - .4)) + (1 - (.1 - .2))
        # + (1 - (.1 - .4)) = .4 + .6 + 1.1 + 1.3 = 3.4, over 4 classes: 0.85 (PyTorch's
        # decomposition read the slots after -1 as class 0: 2.05)
        ([3, 0, -1, 1], 0.85),
        # target {3}, others {0, 1, 2}: .3 + .4 + .6 = 1.3, / 4 = 0.325 (it gave 2.875)
        ([3, -1, 0, 1], 0.325),
        ([-1, 0, 1, 2], 0.0),  # no target: no term (it gave 5.1)
    ],
)
def test_multilabel_margin_loss_stops_at_the_first_minus_one(target, by_hand):
    """The traced loss's value (graphflop's forward graph run on the model's values) is the
    hand-worked one and eager's; its gradient is eager's (verify, float64)."""
    from graphflop.meta import SIGNATURE
    from graphflop.runtime.verify import real_arguments, run_forward, verify_gradients

    model, z = _MultilabelMargin(target), torch.ones(1, 4, dtype=torch.double)
    a = graphflop.analyze(model, (z,), loss="output", jvp=False, outline=False)
    sig = a.forward.meta[SIGNATURE]
    values = real_arguments(a.forward, model, examples=(z,))
    values[sig.inputs[0]] = z  # (a floating input is drawn at random otherwise)
    got = run_forward(a.forward, values)[sig.outputs[0]]
    assert got.item() == pytest.approx(by_hand, abs=1e-12)
    assert model(z).item() == pytest.approx(by_hand, abs=1e-12)
    assert verify_gradients(a.forward, a.backward, model, examples=(z,)).ok


def test_max_min_full_reduction_spread_over_ties_as_eager():
    """``torch.max(x)``/``torch.min(x)`` with no dim (``aten.max.default``) had no rule: the
    backward was cut there (the tester's ``x / x.max()``: eager -2.86 at each tied maximum,
    graphflop 0). Eager's ``evenly_distribute_backward`` splits the derivative evenly over the
    ties, as amax's rule; the tangent (``evenly_read_jvp``) the same."""
    from graphflop.passes.flops import annotate_flops, total_cost
    from graphflop.testing.real_derivatives import eager_derivatives, graphflop_derivatives, graphs

    x = torch.tensor([[1.0, 3.0], [3.0, -2.0]], dtype=torch.float64)
    tx = torch.tensor([[0.5, 2.0], [4.0, 8.0]], dtype=torch.float64)
    for f, at in ((torch.max, (0, 1, 1, 0)), (torch.min, (0, 0, 0, 1))):
        got_t, (got_g,) = graphflop_derivatives(f, (x,), (tx,))
        ref_t, (ref_g,) = eager_derivatives(f, (x,), (tx,))
        # max: the two 3s share it, 1/2 each, tangent (2 + 4)/2 = 3; min: -2 alone, tangent 8
        share = torch.tensor(at, dtype=torch.float64) / sum(at)
        assert torch.equal(ref_g.flatten(), share) and torch.equal(got_g, ref_g)
        assert torch.equal(got_t, ref_t) and float(ref_t) == (3.0 if f is torch.max else 8.0)
        # N = 4: forward the comparisons 4 + the 0-d sum loss 1 = 5; backward ==, isnan, their
        # union (the NaN mask, tests/test_ops_zeros.py), the count, the divide, the product
        # 6·4: 24; JVP the primal 5, those 24, the tangent's sum 4 and the loss tangent's 1: 34
        if f is torch.max:  # min's rule is the same function
            flops = tuple(total_cost(annotate_flops(g).graph.nodes).flops for g in graphs(f, (x,)))
            assert flops == (5, 34, 24)
    # the tester's case: x / x.max(), the two tied maxima
    y = torch.tensor([3.0, -1.0, 3.0, 0.5], dtype=torch.float64)
    _, (got_g,) = graphflop_derivatives(lambda u: u / u.max(), (y,), (y,))
    _, (ref_g,) = eager_derivatives(lambda u: u / u.max(), (y,), (y,))
    torch.testing.assert_close(got_g, ref_g, rtol=1e-14, atol=0.0)
    assert ref_g[0] == ref_g[2] != 0


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
def test_pdist_gradient_as_eager_and_flops_by_hand(p):
    """``F.pdist`` (``aten._pdist_forward``) had no rule; it is traced as ``_cdist_forward`` of
    the N·(N − 1)/2 row pairs i < j. Gradient against eager's ``_pdist_backward`` (rows 0 and 2
    coincide: their distance's derivative is 0, not NaN), the tangent against eager's Jacobian
    (eager has no forward-mode rule for pdist)."""
    from graphflop.passes.flops import annotate_flops, total_cost
    from graphflop.testing.real_derivatives import graphflop_derivatives, graphs

    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64)
    x[2] = x[0]
    tx = torch.randn(4, 3, dtype=torch.float64)

    def f(u):
        return nn.functional.pdist(u, p)

    got_t, (got_g,) = graphflop_derivatives(f, (x,), (tx,))
    leaf = x.clone().requires_grad_()
    (ref_g,) = torch.autograd.grad(f(leaf).sum(), leaf)
    ref_t = torch.einsum("pnm,nm->p", torch.autograd.functional.jacobian(f, x), tx)
    assert got_g.isfinite().all() and ref_t[1] == 0  # pair (0, 2): coincident rows
    torch.testing.assert_close(got_g, ref_g, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(got_t, ref_t, rtol=1e-13, atol=1e-15)
    # forward: 6 pairs · 3 features · 3 (subtract, |·|^p, add) = 54, a root per pair for
    # p ≠ 1 (6), the sum loss 6: 66 (p = 1: 60)
    fwd = total_cost(annotate_flops(graphs(f, (x,))[0]).graph.nodes).flops
    assert fwd == (60 if p == 1.0 else 66)


@pytest.mark.parametrize(
    "case",
    ["polygamma1", "polygamma2", "i0", "i1"],
)
def test_polygamma_i0_i1_derivatives_as_eager(case):
    """``polygamma``, ``i0`` and ``special_i1`` had no rule (the tester's op sweep: gradient
    cut, 0). Their derivatives (derivatives.yaml): ψ⁽ⁿ⁺¹⁾, I₁, and ``i1_backward``'s
    ``I₀(x) − I₁(x)/x`` with 1/2 at x = 0; against eager's gradient and ``torch.func.jvp``."""
    from graphflop.passes.flops import annotate_flops, total_cost
    from graphflop.testing.real_derivatives import eager_derivatives, graphflop_derivatives, graphs

    f = {
        "polygamma1": lambda u: torch.special.polygamma(1, u),
        "polygamma2": lambda u: torch.polygamma(2, u),
        "i0": torch.i0,
        "i1": torch.special.i1,
    }[case]
    x = torch.tensor([0.5, 1.25, 3.0, 0.0 if case == "i1" else 2.0], dtype=torch.float64)
    tx = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    got_t, (got_g,) = graphflop_derivatives(f, (x,), (tx,))
    ref_t, (ref_g,) = eager_derivatives(f, (x,), (tx,))
    torch.testing.assert_close(got_g, ref_g, rtol=1e-13, atol=0.0)
    torch.testing.assert_close(got_t, ref_t, rtol=1e-13, atol=0.0)
    if case == "i1":
        assert ref_g[3] == 0.5
    # N = 4: forward the function 4 (transcendental) + the sum loss 4; backward: polygamma
    # and i0 the derivative's function and the product, 2·4 = 8; i1 (|x|, >, two selects,
    # I₀, /, −, ·) 8·4 = 32
    fwd, _, bwd = (total_cost(annotate_flops(g).graph.nodes) for g in graphs(f, (x,)))
    assert (fwd.flops, fwd.transcendentals) == (8, 4)
    assert bwd.flops == (32 if case == "i1" else 8)


@pytest.mark.parametrize("reduce", ["amax", "amin"])
def test_scatter_reduce_extremum_exclude_self_gradient_as_eager(reduce):
    """``scatter_reduce(..., "amax"/"amin", include_self=False)`` had no JVP (a gap, gradient
    0). Rows of x (2×4) receive src (2×4) at index [[0, 1, 2, 0], [1, 2, 0, 1]]; column 3 is
    never written (x passes there). Row 0, column 0: src 3 and 3 tie, and x's own 3 equals the
    result: eager's backward counts x in the ties (``N_to_distribute`` = 3, each src 1/3) yet
    gives x nothing (``grad_self.scatter(dim, index, 0)``); graphflop's gradient is the same.
    Its JVP is that map's (1/3 each); eager's forward mode averages the two src tangents there
    (1/2), so the tangents are compared off that element."""
    from graphflop.passes.flops import annotate_flops, total_cost
    from graphflop.testing.real_derivatives import eager_derivatives, graphflop_derivatives, graphs

    x = torch.tensor([[3.0, 5.0, 1.0, 7.0], [2.0, -1.0, 0.0, 4.0]], dtype=torch.float64)
    src = torch.tensor([[3.0, 0.0, 3.0, 3.0], [0.0, -1.0, -2.0, 0.0]], dtype=torch.float64)

    def f(x, s):
        index = torch.arange(8).view(2, 4) % 3  # made in the graph: no constant
        out = x.scatter_reduce(1, index, s, reduce, include_self=False)
        return out * torch.arange(1.0, 5.0, dtype=torch.float64)

    tx = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], dtype=torch.float64)
    ts = torch.tensor([[0.5, -1.0, 2.0, 1.5], [1.0, 3.0, -2.0, 0.25]], dtype=torch.float64)
    got_t, got = graphflop_derivatives(f, (x, src), (tx, ts))
    ref_t, ref = eager_derivatives(f, (x, src), (tx, ts))
    # weights 1..4: x's gradient only where nothing is written (column 3: 4); src's the
    # weight of its position, shared 1/3 at row 0 column 0 (ties of values 0 in row 1 column 1:
    # 2 src of value 0 and x's -1 ≠ 0, so 1/2 each, times 2)
    assert torch.equal(ref[0], torch.tensor([[0.0, 0, 0, 4], [0, 0, 0, 4]], dtype=torch.float64))
    torch.testing.assert_close(ref[1][0], torch.tensor([1 / 3, 2, 3, 1 / 3], dtype=torch.float64))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-15, atol=0.0)
    off = torch.ones(2, 4, dtype=torch.bool)
    off[0, 0] = False
    torch.testing.assert_close(got_t[off], ref_t[off], rtol=1e-15, atol=0.0)
    assert float(got_t[0, 0]) == (0.5 + 1.5) / 3 and float(ref_t[0, 0]) == (0.5 + 1.5) / 2
    # forward: the index's remainder 8, one comparison per source element 8, the weights 8,
    # the sum loss 8: 32. Backward: the weights' product 8; the coefficients x == out 8,
    # src == out gathered 8, their count (a scatter_add of 8 source elements) 8; the divide by
    # the count 8, the two masks' products 8 + 8: 56
    fwd, _, bwd = (total_cost(annotate_flops(g).graph.nodes).flops for g in graphs(f, (x, src)))
    assert (fwd, bwd) == (32, 56)


@pytest.mark.parametrize(
    ("reduce", "include_self", "fwd_flops"),
    [
        # remainder 5, one comparison per source element 20, the weights 12, the sum loss 12
        ("amax", False, 5 + 20 + 12 + 12),
        ("amin", True, 5 + 20 + 12 + 12),
        # remainder 5, the sums 20 and the counts 20 (scatter_add), clamp 12, divide 12, the
        # weights 12, the sum loss 12
        ("mean", True, 5 + 20 + 20 + 12 + 12 + 12 + 12),
    ],
)
def test_index_reduce_as_scatter_reduce_gradient_as_eager(reduce, include_self, fwd_flops):
    """``index_reduce`` had no rule (gradient cut, 0); it is traced as ``scatter_reduce`` with
    the index broadcast over the source, so its gradient is eager's (eager has no forward
    mode for it). x 3×4, source 5×4 into rows [0, 1, 2, 0, 1]."""
    from graphflop.passes.flops import annotate_flops, total_cost
    from graphflop.testing.real_derivatives import graphflop_derivatives, graphs

    torch.manual_seed(0)
    x, src = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)

    def f(x, s):
        index = torch.arange(5) % 3  # made in the graph: no constant
        out = x.index_reduce(0, index, s, reduce, include_self=include_self)
        return out * torch.arange(1.0, 5.0, dtype=torch.float64)

    _, got = graphflop_derivatives(f, (x, src), (x, src))
    leaves = (x.clone().requires_grad_(), src.clone().requires_grad_())
    ref = torch.autograd.grad(f(*leaves).sum(), leaves)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-14, atol=0.0)
    assert (ref[1] != 0).any()
    fwd = graphs(f, (x, src))[0]
    assert (
        torch.ops.aten.scatter_reduce.two in {n.target for n in fwd.graph.nodes} or reduce == "mean"
    )
    assert total_cost(annotate_flops(fwd).graph.nodes).flops == fwd_flops


@pytest.mark.parametrize(
    ("mode", "size", "resize_flops"),
    [
        # x 1×2×6×5 to 4×5: the width unchanged (skipped); the height 6 → 4, scale 1.5,
        # support 1·1.5: windows [0, 2), [1, 4), [2, 5), [4, 6): 2 + 3 + 3 + 2 = 10 taps,
        # 2·(N·C·W_out = 10)·10 = 200
        ("bilinear", (4, 5), 200),
        # to 4×3, bicubic (filter 4): the width 5 → 3 first (scale 5/3, support 10/3):
        # windows [0, 4), [0, 5), [1, 5): 13 taps, 2·(N·C·H_in = 12)·13 = 312; then the height
        # 6 → 4 (support 3): [0, 4), [0, 5), [1, 6), [2, 6): 18 taps, 2·(N·C·W_out = 6)·18 = 216
        ("bicubic", (4, 3), 312 + 216),
    ],
)
def test_antialiased_resize_derivatives_as_eager_and_flops_by_hand(mode, size, resize_flops):
    """``F.interpolate(..., antialias=True)`` (``_upsample_bilinear2d_aa``/``_bicubic2d_aa``)
    had no rule (gradient cut, 0). Linear in its input: its JVP is the resize of the tangent,
    its transpose PyTorch's own backward kernel; 2 FLOPs per filter tap, the windows as
    PyTorch's CPU kernel computes them (docs/flops_conventions.md)."""
    from graphflop.passes.flops import annotate_flops, total_cost
    from graphflop.testing.real_derivatives import eager_derivatives, graphflop_derivatives, graphs

    torch.manual_seed(0)
    x = torch.randn(1, 2, 6, 5, dtype=torch.float64)
    tx = torch.randn(1, 2, 6, 5, dtype=torch.float64)

    def f(u):
        return nn.functional.interpolate(u, size=size, mode=mode, antialias=True)

    got_t, (got_g,) = graphflop_derivatives(f, (x,), (tx,))
    ref_t, (ref_g,) = eager_derivatives(f, (x,), (tx,))
    torch.testing.assert_close(got_g, ref_g, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(got_t, ref_t, rtol=1e-14, atol=1e-15)
    fwd, _, bwd = (total_cost(annotate_flops(g).graph.nodes).flops for g in graphs(f, (x,)))
    # the forward also holds the sum loss (N·C·H_out·W_out); the backward is the resize's
    # backward kernel alone, over the same taps
    assert (fwd, bwd) == (resize_flops + 2 * size[0] * size[1], resize_flops)
