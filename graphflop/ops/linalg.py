"""Matrix products: ``mm``, ``bmm``, ``addmm``, ``_grouped_mm`` (cost only). 2 FLOPs per multiply-add, all in ``mm_flops``;
``addmm``'s bias add (M·N) is counted outside ``mm_flops`` (docs/flops_conventions.md); with beta or alpha
other than 1 it is traced as ``mm``, the scalings and the add (as PyTorch decomposes ``baddbmm``). ``mv`` and ``dot`` are
traced as ``mm``, ``addbmm`` as one ``mm`` over the batch folded into K, ``_trilinear``
(``nn.Bilinear``) as two contractions (decompositions at the end). Linear solves:
``_linalg_solve_ex`` (``torch.linalg.solve``) and ``linalg_lu_solve``, by the LU convention of
docs/flops_conventions.md, outside ``mm_flops``."""

from __future__ import annotations

import math

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import bind, numel, shape
from graphflop.ops.registry import (
    MissingRuleError,
    def_bilinear,
    def_jvp,
    def_transpose,
    register,
    register_decomposition,
)

aten = torch.ops.aten
F = "linalg"


def mm_flops(m: int, k: int, n: int, batch: int = 1) -> int:
    """FLOPs of a (batched) matrix product (M×K)·(K×N): 2·B·M·K·N."""
    return 2 * batch * m * k * n


def _mm_cost(out, a, b, *args, **kwargs) -> NodeCost:
    f = mm_flops(a.shape[0], a.shape[1], b.shape[1])
    return NodeCost(flops=f, mm_flops=f)


def _bmm_cost(out, a, b, *args, **kwargs) -> NodeCost:
    f = mm_flops(a.shape[1], a.shape[2], b.shape[2], a.shape[0])
    return NodeCost(flops=f, mm_flops=f)


def _addmm_cost(out, bias, a, b, *args, **kwargs) -> NodeCost:
    f = mm_flops(a.shape[0], a.shape[1], b.shape[1])
    return NodeCost(flops=f + out.shape[0] * out.shape[1], mm_flops=f)


def _grouped_mm_cost(out, a, b, offs=None, bias=None, *args, **kwargs) -> NodeCost:
    """``_grouped_mm(a, b, offs, bias)``, G groups of products (mixture-of-experts layers):
    2·M·K·N per group, summed. 3-D × 3-D ``(G, M, K)·(G, K, N)``, 2-D × 3-D (``offs`` splits
    a's M_total rows), 3-D × 2-D (``offs`` splits b's N_total columns): every output element
    takes K = ``a.shape[-1]`` multiply-adds, 2·numel(out)·K. 2-D × 2-D (``offs`` splits the
    shared K_total): 2·M·K_total·N. A bias adds 1 per output element, outside ``mm_flops``.
    Cost only: no JVP or transpose rule (PyTorch's CPU kernel takes no float64, so the op
    database cannot check one), so a model using it is reported with the backward cut there."""
    if a.dim() == 2 and b.dim() == 2:
        f = mm_flops(a.shape[0], a.shape[1], b.shape[1])
    else:
        f = 2 * out.numel() * a.shape[-1]
    return NodeCost(flops=f + (out.numel() if bias is not None else 0), mm_flops=f)


register(aten.mm.default, F, _mm_cost)
register(aten.bmm.default, F, _bmm_cost)
register(aten.addmm.default, F, _addmm_cost)
register(aten._grouped_mm.default, F, _grouped_mm_cost)


def _transpose_mm(b, ct, args, kwargs, linear):
    x, y = args
    cts = [None, None]
    if linear[0]:  # ct_x = ct · yᵀ
        cts[0] = b.call(aten.mm.default, ct, b.call(aten.permute.default, y, [1, 0]))
    if linear[1]:  # ct_y = xᵀ · ct
        cts[1] = b.call(aten.mm.default, b.call(aten.permute.default, x, [1, 0]), ct)
    return cts


def _transpose_bmm(b, ct, args, kwargs, linear):
    x, y = args
    cts = [None, None]
    if linear[0]:
        cts[0] = b.call(aten.bmm.default, ct, b.call(aten.permute.default, y, [0, 2, 1]))
    if linear[1]:
        cts[1] = b.call(aten.bmm.default, b.call(aten.permute.default, x, [0, 2, 1]), ct)
    return cts


def_bilinear(aten.mm.default, _transpose_mm)
def_bilinear(aten.bmm.default, _transpose_bmm)


@def_jvp(aten.addmm.default)
def _jvp_addmm(b, out, args, tangents, kwargs):
    """d(beta·bias + alpha·x·W) = beta·dbias + alpha·(dx·W + x·dW); with ``beta == 0`` the
    bias is not read (PyTorch's ``addmm`` ignores it, NaN included, and gives it a zero
    gradient). Traced models never reach the scaled form (:func:`_addmm_scaled` decomposes
    it); a rule that builds one does."""
    a = bind(aten.addmm.default, args, kwargs)
    bias, x, w = args
    tb, tx, tw = tangents
    t1 = b.call(aten.mm.default, tx, w) if tx is not None else None
    t2 = b.call(aten.mm.default, x, tw) if tw is not None else None
    t = b.add(t1, t2)
    if t is not None and a.alpha != 1:
        t = b.call(aten.mul.Tensor, t, a.alpha)
    if tb is not None and a.beta != 0:
        t = b.add(t, tb if a.beta == 1 else b.call(aten.mul.Tensor, tb, a.beta))
    if t is not None and shape(t) != shape(out):
        t = b.call(aten.expand.default, t, list(shape(out)))
    return t


# --- decompositions ----------------------------------------------------------------------------
# matrix-vector and vector-vector products as matrix products, so that they are counted in
# ``mm_flops`` like every other product (PyTorch's decompositions make them a multiply and a sum)


@register_decomposition(aten.mv.default)
def _mv(a, v):
    """(M×K)·(K) as an (M×K)·(K×1) matrix product."""
    return aten.squeeze.dims(aten.mm.default(a, aten.unsqueeze.default(v, 1)), [1])


@register_decomposition(aten.dot.default)
def _dot(a, v):
    """(K)·(K) as a (1×K)·(K×1) matrix product."""
    prod = aten.mm.default(aten.unsqueeze.default(a, 0), aten.unsqueeze.default(v, 1))
    return aten.squeeze.dims(prod, [0, 1])


@register_decomposition(aten.addmm.default)
def _addmm_scaled(bias, x, w, *, beta=1, alpha=1):
    """``beta·bias + alpha·x·W`` with ``beta`` or ``alpha`` other than 1 as the ops PyTorch's
    decomposition of ``baddbmm`` uses: the product (``mm``, 2·M·K·N in ``mm_flops``),
    ``alpha·`` on the product (M·N), ``beta·`` on the bias (its own elements) and the add
    (M·N); with ``beta == 0`` the bias is left out (PyTorch's ``addmm`` does not read it: a
    NaN there stays out of the result). The plain form (``nn.Linear``) is traced whole
    (``NotImplemented``), so the passes that read an ``addmm`` as a layer see only that form."""
    if beta == 1 and alpha == 1:
        return NotImplemented
    prod = aten.mm.default(x, w)
    return _scaled_sum(bias, prod, beta, alpha)


def _scaled_sum(bias, prod, beta, alpha):
    """``beta·bias + alpha·prod`` as ``addmm``/``addbmm`` compute it: each scaling 1 FLOP per
    element where it is not 1, the add 1 per element; with ``beta == 0`` the bias is left out
    (a NaN there stays out of the result)."""
    if alpha != 1:
        prod = aten.mul.Tensor(prod, alpha)
    if beta == 0:
        return prod
    if beta != 1:
        bias = aten.mul.Tensor(bias, beta)
    return aten.add.Tensor(bias, prod)


@register_decomposition(aten.addbmm.default)
def _addbmm(bias, x, y, *, beta=1, alpha=1):
    """``beta·bias + alpha·Σ_b x[b]·y[b]`` for x (B×M×K), y (B×K×N): the sum over the batch is
    part of the contraction, one (M×B·K)·(B·K×N) product (2·B·M·K·N, PyTorch accumulates the
    batch in place the same way); the scalings and the add 1 FLOP per element, as ``baddbmm``."""
    bsz, m, k = x.shape
    n = y.shape[2]
    a = aten.reshape.default(aten.permute.default(x, [1, 0, 2]), [m, bsz * k])
    prod = aten.mm.default(a, aten.reshape.default(y, [bsz * k, n]))
    return _scaled_sum(bias, prod, beta, alpha)


# --- linear solves -------------------------------------------------------------------------------


def solve_flops(n: int, k: int, batch: int = 1) -> int:
    """FLOPs of solving A·X = B, A (n×n), B (n×k), ``batch`` times: an LU factorisation,
    ⌊2·n³/3⌋, and a forward and a back substitution per right-hand side, 2·n²·k (Golub & Van
    Loan, *Matrix Computations*, 4th ed., §3.1-3.2; docs/flops_conventions.md)."""
    return batch * (2 * n**3 // 3 + 2 * n * n * k)


def _solve_cost(out, a, rhs, *args, **kwargs) -> NodeCost:
    """``_linalg_solve_ex(A, B, left=True)``: one LU per matrix of A's batch, the substitutions
    for every column of the result (``left=False`` solves for rows: the same count)."""
    n = a.shape[-1]
    lu = numel(a) // (n * n) * (2 * n**3 // 3)
    return NodeCost(flops=lu + 2 * n * numel(out[0]))


def _lu_solve_cost(out, lu, pivots, rhs, *args, **kwargs) -> NodeCost:
    """``linalg_lu_solve(LU, pivots, B)``: the substitutions only, 2·n² per column."""
    return NodeCost(flops=2 * lu.shape[-1] * numel(out))


register(aten._linalg_solve_ex.default, F, _solve_cost)
register(aten.linalg_lu_solve.default, F, _lu_solve_cost)


@register_decomposition(aten._linalg_check_errors.default)
def _no_error_check(info, api_name, *, is_matrix):
    """The error check after a solve (it reads ``info``, returns nothing) is left out of the
    trace: its node would carry no value, and tracing runs on fake tensors, with no values to
    check."""
    return None


def _matmul(b, x, y):
    """x·y for 2-D or equally batched 3-D operands."""
    return b.call(aten.mm.default if len(shape(x)) == 2 else aten.bmm.default, x, y)


@def_jvp(aten._linalg_solve_ex.default)
def _jvp_solve(b, out, args, tangents, kwargs):
    """X = A⁻¹B: dX = A⁻¹(dB − dA·X) (PyTorch's ``linalg_solve_jvp``), solved with the
    primal's LU factors (``linalg_lu_solve``, no second factorisation). The LU, pivots and
    info outputs get no tangent (``torch.linalg.solve`` returns X only). ``left=True``, A 2-D
    or 3-D, B of A's rank (matrix right-hand sides) or one less (a vector); other forms refuse
    (``MissingRuleError``: the JVP and backward are cut there and the gap reported)."""
    a, rhs = args[0], args[1]
    ta, tb = tangents[0], tangents[1]
    left = bind(aten._linalg_solve_ex.default, args, kwargs).left
    ra, rb = len(shape(a)), len(shape(rhs))
    if not left or ra not in (2, 3) or rb not in (ra, ra - 1):
        raise MissingRuleError(aten._linalg_solve_ex.default, ("jvp",))
    vector = rb == ra - 1
    x = b.getitem(out, 0)
    if vector:  # solve for one column: (…, n) -> (…, n, 1)
        x = b.call(aten.unsqueeze.default, x, -1)
        tb = None if tb is None else b.call(aten.unsqueeze.default, tb, -1)
    r = tb
    if ta is not None:
        prod = _matmul(b, ta, x)
        r = b.sub(r, prod) if r is not None else b.call(aten.neg.default, prod)
    if r is None:
        return (None, None, None, None)
    dx = b.call(aten.linalg_lu_solve.default, b.getitem(out, 1), b.getitem(out, 2), r)
    if vector:
        dx = b.call(aten.squeeze.dims, dx, [-1])
    return (dx, None, None, None)


@def_transpose(aten.linalg_lu_solve.default)
def _transpose_lu_solve(b, ct, args, kwargs, linear):
    """Linear in B: B̄ = A⁻ᵀ·ct, the adjoint solve with the same factors."""
    a = bind(aten.linalg_lu_solve.default, args, kwargs)
    lu, pivots, adjoint = a.LU, a.pivots, a.adjoint
    rest = [None] * (len(args) - 2)
    ct_b = b.call(aten.linalg_lu_solve.default, lu, pivots, ct, adjoint=not adjoint)
    return [None, None, ct_b] + rest[1:]


@register_decomposition(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``nn.Bilinear``'s product (``F.bilinear``): each input unsqueezed at its ``expand`` dims
    to a common rank, the three multiplied and summed over ``sumdim``. Traced as ATen computes
    it, a contraction of ``i1`` with ``i2`` keeping the dims ``i3`` or the output needs, then
    with ``i3`` (two two-operand ``einsum`` calls, which trace to ``bmm`` with permutes and
    reshapes): for ``nn.Bilinear`` (N, in1) × (out, in1, in2) × (N, in2), 2·N·out·in1·in2 matrix
    FLOPs and 2·N·out·in2 for the second product. ``unroll_dim`` (how ATen loops) changes
    nothing computed."""
    rank = i1.dim() + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:rank]

    def dims(expand) -> list[int]:
        gone = {d % rank for d in expand}
        return [d for d in range(rank) if d not in gone]

    def sub(ds) -> str:
        return "".join(letters[d] for d in ds)

    d1, d2, d3 = dims(expand1), dims(expand2), dims(expand3)
    summed = {d % rank for d in sumdim}
    out = [d for d in range(rank) if d not in summed]
    keep = sorted((set(d1) | set(d2)) & (set(d3) | set(out)))
    pair = torch.einsum(f"{sub(d1)},{sub(d2)}->{sub(keep)}", i1, i2)
    present = [d for d in out if d in set(keep) | set(d3)]
    result = torch.einsum(f"{sub(keep)},{sub(d3)}->{sub(present)}", pair, i3)
    for k, d in enumerate(out):  # an output dim that every input expanded: size 1
        if d not in present:
            result = result.unsqueeze(k)
    return result


# --- pairwise distances: torch.cdist's direct kernel ----------------------------------------------


def _cdist_p(args, kwargs) -> float:
    return float(bind(aten._cdist_forward.default, args, kwargs).p)


def _cdist_cost(out, x1, x2, *args, **kwargs) -> NodeCost:
    """``_cdist_forward(x1 (…, P, M), x2 (…, R, M), p)``, the kernel ``torch.cdist`` runs when it
    does not use a matrix product (p ≠ 2, or at most 25 rows): per pair and feature a
    subtract, an ``|·|``/square/``|·|^p`` and an add (a max for p = ∞), 3·(…)·P·R·M; per
    distance a root for p ∉ {0, 1, ∞} (transcendental), and for p ∉ {0, 1, 2, ∞} the power
    per pair and feature is transcendental too. No ``mm_flops``."""
    p = _cdist_p((x1, x2, *args), kwargs)
    pairs = numel(out)
    per_pair = shape(x1)[-1] if shape(x1) else 1
    flops = 3 * pairs * per_pair
    trans = 0
    if p not in (0.0, 1.0, 2.0, math.inf):
        trans += pairs * per_pair
    if p not in (0.0, 1.0, math.inf):
        flops += pairs
        trans += pairs
    return NodeCost(flops=flops, transcendentals=trans)


register(aten._cdist_forward.default, F, _cdist_cost)


@def_jvp(aten._cdist_forward.default)
def _jvp_cdist(b, out, args, tangents, kwargs):
    """d dᵢⱼ = Σ_k cᵢⱼₖ (dx1ᵢₖ − dx2ⱼₖ), cᵢⱼₖ = ∂dᵢⱼ/∂diffᵢⱼₖ for diff = x1ᵢ − x2ⱼ: sign(diff) for
    p = 1; diff·|diff|^(p−2) / d^(p−1) otherwise (diff / d for p = 2), taken as 0 where d = 0
    or diff = 0, as PyTorch's ``_cdist_backward`` (so ``cdist(x, x)`` has finite derivatives
    on its zero diagonal). p = 0 counts nonzeros: no tangent. p = ∞ refuses
    (``MissingRuleError``: the JVP and backward are cut there and the gap reported). Linear in
    the tangents: broadcast multiplies by ``c`` and sums over the features."""
    x1, x2 = args[0], args[1]
    p = _cdist_p(args, kwargs)
    if p == 0.0:
        return None
    if math.isinf(p):
        raise MissingRuleError(aten._cdist_forward.default, ("jvp",))
    diff = b.call(
        aten.sub.Tensor,
        b.call(aten.unsqueeze.default, x1, -2),
        b.call(aten.unsqueeze.default, x2, -3),
    )
    if p == 1.0:
        coef = b.call(aten.sign.default, diff)
    else:
        zero_d = b.call(aten.eq.Scalar, out, 0.0)
        ones = b.call(aten.where.ScalarSelf, zero_d, 1.0, out)  # d, with 1 where it is 0
        inv = b.call(aten.pow.Tensor_Scalar, ones, 1.0 - p)
        inv = b.call(aten.where.ScalarSelf, zero_d, 0.0, inv)
        coef = b.call(aten.mul.Tensor, diff, b.call(aten.unsqueeze.default, inv, -1))
        if p != 2.0:
            mag = b.call(aten.abs.default, diff)
            zero_diff = b.call(aten.eq.Scalar, mag, 0.0)
            safe = b.call(aten.where.ScalarSelf, zero_diff, 1.0, mag)
            powed = b.call(aten.pow.Tensor_Scalar, safe, p - 2.0)
            powed = b.call(aten.where.ScalarSelf, zero_diff, 0.0, powed)
            coef = b.call(aten.mul.Tensor, coef, powed)
    t1, t2 = tangents[0], tangents[1]
    parts = []
    if t1 is not None:
        prod = b.call(aten.mul.Tensor, coef, b.call(aten.unsqueeze.default, t1, -2))
        parts.append(b.call(aten.sum.dim_IntList, prod, [-1]))
    if t2 is not None:
        prod = b.call(aten.mul.Tensor, coef, b.call(aten.unsqueeze.default, t2, -3))
        parts.append(b.call(aten.neg.default, b.call(aten.sum.dim_IntList, prod, [-1])))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else b.add(parts[0], parts[1])


# --- pdist: the pairs i < j of one matrix's rows, as cdist's kernel over those pairs -------------


@register_decomposition(aten._pdist_forward.default)
def _pdist(x, p: float = 2.0):
    """``_pdist_forward(x (N, M), p)`` (``F.pdist``, no rule of its own): the distances of rows
    i < j in row-major order, as ``_cdist_forward`` of each pair's two rows (gathered by
    ``triu_indices``; a batch of N·(N − 1)/2 one-row pairs), so its FLOPs are cdist's convention
    over those pairs and its derivative cdist's (0 where two rows coincide, as eager's
    ``_pdist_backward``; p = ∞ refuses, as cdist's)."""
    n, m = x.shape
    ij = aten.triu_indices.default(n, n, 1, dtype=torch.int64, device=x.device)
    rows_i = aten.index_select.default(x, 0, aten.select.int(ij, 0, 0))
    rows_j = aten.index_select.default(x, 0, aten.select.int(ij, 0, 1))
    pairs = n * (n - 1) // 2
    d = aten._cdist_forward.default(
        aten.view.default(rows_i, [pairs, 1, m]), aten.view.default(rows_j, [pairs, 1, m]), p, None
    )
    return aten.view.default(d, [pairs])
