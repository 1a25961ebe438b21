"""Op-database cases: matrix products, matmul/einsum/baddbmm and attention. FLOPs worked out by hand
in each comment (docs/flops_conventions.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from graphflop.testing.opdb.core import Fn, OpCase, X, module_of, randomized, readout_of

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
        module_of(lambda s, x: torch.bmm(x, s.w), {"w": (2, 4, 3)}),
        ((2, 3, 4),),
        flops=2 * 2 * 3 * 4 * 3,  # bmm 2x(3x4)(4x3): 144
        aten=("aten.bmm.default",),
    ),
    OpCase(
        "attention",
        module_of(
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
# matmul with broadcasting and 1-D operands, einsum, baddbmm
# ---------------------------------------------------------------------------------------------
_MV_FLOPS = (
    "FlopCounterMode counts 0 for {} (it has no formula for aten.{}); graphflop "
    "decomposes it to mm and counts {}: tests/test_cases.py checks it"
)

LINALG_MORE = [
    OpCase(
        "matmul_broadcast",
        module_of(lambda s, x: x @ s.w, {"w": (2, 4, 5)}),
        ((3, 4),),
        flops=2 * 2 * 3 * 4 * 5,  # (3,4) broadcast against (2,4,5): bmm 2x(3x4)(4x5): 240
        aten=("aten.bmm.default", "aten.expand.default"),
    ),
    OpCase(
        "matmul_4d_2d",
        module_of(lambda s, x: x @ s.w, {"w": (5, 6)}),
        ((2, 3, 4, 5),),
        flops=2 * 24 * 5 * 6,  # folded to mm (24x5)(5x6): 1440
        aten=("aten.mm.default", "aten.view.default"),
    ),
    OpCase(
        "matmul_vector_matrix",
        module_of(lambda s, x: (x @ s.w) * s.r, {"w": (4, 5)}, {"r": (5,)}),
        ((4,),),
        flops=2 * 4 * 5 + 5,  # (1x4)(4x5): 40; readout 5
        aten=("aten.mm.default",),
    ),
    OpCase(
        "matmul_matrix_vector",
        module_of(lambda s, x: (s.w @ x) * s.r, {"w": (3, 4)}, {"r": (3,)}),
        ((4,),),
        flops=2 * 3 * 4 + 3,  # mv -> mm (3x4)(4x1): 24; readout 3
        aten=("aten.mm.default", "aten.squeeze.dims"),
        xfail={"flops": _MV_FLOPS.format("torch.mv", "mv", "2*M*K")},
    ),
    OpCase(
        "matmul_dot",
        module_of(lambda s, x: x @ s.w, {"w": (5,)}),
        ((5,),),
        flops=2 * 5,  # dot -> mm (1x5)(5x1): 10
        aten=("aten.mm.default",),
        xfail={"flops": _MV_FLOPS.format("torch.dot", "dot", "2*K")},
    ),
    OpCase(
        "einsum_bmm",
        module_of(lambda s, x: torch.einsum("bij,bjk->bik", x, s.w), {"w": (2, 4, 5)}),
        (X,),
        flops=2 * 2 * 3 * 4 * 5,  # bmm 2x(3x4)(4x5): 240
        aten=("aten.bmm.default",),
    ),
    OpCase(
        "einsum_heads",
        module_of(
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
        module_of(
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
        module_of(_math_sdpa(lambda s, q, k, v: SDPA(q, k, v) * s.r), buffers={"r": Q4}),
        (Q4, KV5, KV5),
        flops=24 + 480 + 200 + 24,
        aten=("aten.bmm.default", "aten.amax.default"),
    ),
    # scores (1,2,4,4): 32. q scaled 24; the 4x4 causal mask rows >= cols: 16, where 32;
    # bmm 2*2*4*3*4 = 192 twice: 384; softmax 5*32 = 160; readout 24
    OpCase(
        "sdpa_causal",
        module_of(
            _math_sdpa(lambda s, q, k, v: SDPA(q, k, v, is_causal=True) * s.r), buffers={"r": Q4}
        ),
        (Q4, Q4, Q4),
        flops=24 + 16 + 32 + 384 + 160 + 24,
        aten=("aten.bmm.default", "aten.ge.Tensor", "aten.where.self"),
    ),
    # as sdpa (728), + the mask add (40), + the guard for rows the mask hides entirely: scores
    # != -inf 40, any 40, where 40
    OpCase(
        "sdpa_float_mask",
        module_of(
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
        module_of(
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
        readout_of(lambda: _mha(need_weights=True), (1, 5, 8)),
        ((1, 5, 8),),
        flops=2040 + 680 + 40 + 800 + 250 + 40,
        aten=("aten.addmm.default", "aten.bmm.default"),
    ),
    # through SDPA (graphflop's decomposition): the same parts as multihead_attention
    OpCase(
        "multihead_attention_sdpa",
        readout_of(lambda: _mha(need_weights=False), (1, 5, 8)),
        ((1, 5, 8),),
        flops=2040 + 680 + 40 + 800 + 250 + 40,
        aten=("aten.addmm.default", "aten.bmm.default"),
    ),
]


# ---------------------------------------------------------------------------------------------
# einsum paths (outer and bilinear products as broadcast multiplies, a
# contraction over two axes needing permutes, a three-operand bilinear form), addbmm
# ---------------------------------------------------------------------------------------------
#: the reference, not graphflop: its JVP is checked against finite differences instead
_NO_CDIST_FWD_AD = "torch.func.jvp: PyTorch has no forward-mode derivative for aten._cdist_forward"


def _bilinear() -> nn.Module:
    m = Fn(lambda s, x: s.b(x, x[:, :5] * s.w), {"w": (5,)})
    m.b = randomized(nn.Bilinear(6, 5, 3))
    return m


BILINEAR = [
    OpCase(
        "bilinear",
        readout_of(_bilinear, (4, 3)),
        ((4, 6),),
        # nn.Bilinear(6, 5, 3) at batch 4 (_trilinear): x[:, :5]·w 20; x (4×6) with the weight
        # (3×6×5) over in1: 2·4·3·6·5 = 720 matrix FLOPs; with x2 (4×5) over in2: 2·4·3·5 = 120;
        # bias 12; readout 12
        flops=20 + 720 + 120 + 12 + 12,
        aten=("aten.bmm.default",),
        xfail={
            "flops": "FlopCounterMode counts 0 for nn.Bilinear (it has no formula for "
            "aten._trilinear); graphflop decomposes it to two bmm and counts them: "
            "tests/test_ops_extra.py checks it"
        },
    ),
]

CDIST = [
    OpCase(
        "cdist",
        module_of(
            lambda s, x: torch.cdist(x * s.w, s.v) * s.r,
            {"w": (3, 4), "v": (2, 5, 4)},
            {"r": (2, 3, 5)},
        ),
        (X,),
        # mul 24; _cdist_forward of (2, 3, 4) and (2, 5, 4), 30 distances of 4 features:
        # subtract, square, add 3·30·4 = 360, sqrt 30; readout 30
        flops=24 + 360 + 30 + 30,
        aten=("aten._cdist_forward.default", "aten.where.ScalarSelf"),
        xfail={"jvp": _NO_CDIST_FWD_AD},
    ),
    OpCase(
        "cdist_self",
        module_of(
            lambda s, x: torch.cdist(x * s.w, x * s.w) * s.r, {"w": (3, 4)}, {"r": (2, 3, 3)}
        ),
        (X,),
        # cdist(h, h): a zero diagonal, where d's derivative is taken as 0 (PyTorch's too);
        # two muls 48; 2·3·3 = 18 distances: 3·18·4 = 216 + sqrt 18; readout 18
        flops=48 + 216 + 18 + 18,
        aten=("aten._cdist_forward.default",),
        xfail={"jvp": _NO_CDIST_FWD_AD},
    ),
    OpCase(
        "cdist_p1",
        module_of(
            lambda s, x: torch.cdist(x * s.w, s.v, p=1.0) * s.r,
            {"w": (3, 4), "v": (2, 5, 4)},
            {"r": (2, 3, 5)},
        ),
        (X,),
        # mul 24; 30 distances of 4 features: subtract, |·|, add 360, no root; readout 30
        flops=24 + 360 + 30,
        aten=("aten._cdist_forward.default", "aten.sign.default"),
        xfail={"jvp": _NO_CDIST_FWD_AD},
    ),
    OpCase(
        "cdist_p3",
        module_of(
            lambda s, x: torch.cdist(x * s.w, s.v, p=3.0) * s.r,
            {"w": (3, 4), "v": (2, 5, 4)},
            {"r": (2, 3, 5)},
        ),
        (X,),
        # mul 24; 30 distances of 4 features: subtract, |·|³, add 360, cube root 30; readout 30
        flops=24 + 360 + 30 + 30,
        aten=("aten._cdist_forward.default", "aten.pow.Tensor_Scalar"),
        xfail={"jvp": _NO_CDIST_FWD_AD},
    ),
]

EINSUM_MORE = [
    OpCase(
        "einsum_outer",
        module_of(lambda s, x: torch.einsum("i,j->ij", x, s.w) * s.r, {"w": (4,)}, {"r": (3, 4)}),
        ((3,),),
        flops=12 + 12,  # broadcast mul (3,1)*(1,4): 12; readout 12
        aten=("aten.mul.Tensor", "aten.unsqueeze.default"),
    ),
    OpCase(
        "einsum_batched_outer",
        module_of(
            lambda s, x: torch.einsum("bi,bj->bij", x, s.w) * s.r, {"w": (2, 4)}, {"r": (2, 3, 4)}
        ),
        ((2, 3),),
        flops=24 + 24,  # broadcast mul to (2,3,4): 24; readout 24
        aten=("aten.mul.Tensor", "aten.unsqueeze.default"),
    ),
    OpCase(
        "einsum_two_axes",
        module_of(
            lambda s, x: torch.einsum("ijk,kjl->li", x, s.w) * s.r, {"w": (4, 3, 5)}, {"r": (5, 2)}
        ),
        (X,),
        # j and k contracted: one product (2×12)·(12×5) as bmm: 2·2·12·5 = 240; readout 10
        flops=240 + 10,
        aten=("aten.bmm.default", "aten.permute.default"),
    ),
    OpCase(
        "einsum_bilinear_form",
        module_of(
            lambda s, x, y: torch.einsum("bi,ij,bj->b", x, s.w, y) * s.r, {"w": (3, 4)}, {"r": (2,)}
        ),
        ((2, 3), (2, 4)),
        # x·W: bmm 2·2·3·4 = 48; then per b (1×4)·(4×1): bmm 2·2·4 = 16; readout 2
        flops=48 + 16 + 2,
        aten=("aten.bmm.default",),
    ),
]

_NO_ADDBMM_FORMULA = (
    "FlopCounterMode counts 0 for torch.addbmm (it has no formula for aten.addbmm); graphflop "
    "decomposes it to one mm and counts 2*B*M*K*N: tests/test_ops_extra.py checks it"
)

_NO_ONNX_SOLVE = (
    "ONNX has no linear solve: the exporter has no function for aten.linalg_lu_solve (the "
    "JVP's and backward's solves with the forward's LU factors)"
)

SOLVE_ADDBMM = [
    OpCase(
        "addbmm",
        module_of(
            lambda s, x: torch.addbmm(s.b, x, s.w, beta=0.5, alpha=2.0) * s.r,
            {"b": (3, 5), "w": (2, 4, 5)},
            {"r": (3, 5)},
        ),
        (X,),
        # mm (3×8)(8×5): 2·3·8·5 = 240; alpha·: 15; beta·b: 15; add 15; readout 15
        flops=240 + 15 + 15 + 15 + 15,
        aten=("aten.mm.default", "aten.permute.default"),
        xfail={"flops": _NO_ADDBMM_FORMULA},
    ),
    OpCase(
        "linalg_solve",
        module_of(
            lambda s, a, rhs: torch.linalg.solve(a + s.d, rhs) * s.r,
            buffers={"d": lambda: 6.0 * torch.eye(4), "r": (4, 3)},
        ),
        ((4, 4), (4, 3)),
        # add 16; LU ⌊2·4³/3⌋ = 42, substitutions 2·4²·3 = 96; readout 12
        flops=16 + 42 + 96 + 12,
        aten=("aten._linalg_solve_ex.default", "aten.linalg_lu_solve.default"),
        xfail={"onnx": _NO_ONNX_SOLVE},
    ),
    OpCase(
        "linalg_solve_batched",
        module_of(
            lambda s, a, rhs: torch.linalg.solve(a + s.d, rhs) * s.r,
            buffers={"d": lambda: 6.0 * torch.eye(3), "r": (2, 3, 2)},
        ),
        ((2, 3, 3), (2, 3, 2)),
        # add 18; LU 2·⌊2·3³/3⌋ = 36, substitutions 2·(2·3²·2) = 72; readout 12
        flops=18 + 36 + 72 + 12,
        aten=("aten._linalg_solve_ex.default", "aten.linalg_lu_solve.default"),
        xfail={"onnx": _NO_ONNX_SOLVE},
    ),
    OpCase(
        "linalg_solve_vector",
        module_of(
            lambda s, a, rhs: torch.linalg.solve(a + s.d, rhs) * s.r,
            buffers={"d": lambda: 6.0 * torch.eye(4), "r": (4,)},
        ),
        ((4, 4), (4,)),
        # add 16; LU ⌊2·4³/3⌋ = 42, substitutions 2·4²·1 = 32; readout 4
        flops=16 + 42 + 32 + 4,
        aten=("aten._linalg_solve_ex.default", "aten.linalg_lu_solve.default"),
        xfail={"onnx": _NO_ONNX_SOLVE},
    ),
]

# ---------------------------------------------------------------------------------------------
# addmm with beta/alpha other than 1 (decomposed as baddbmm is: mm, alpha·, beta·bias, add),
# and the pairwise-distance form of cdist written with addmm(alpha=-2)
# ---------------------------------------------------------------------------------------------
ADDMM_SCALED = [
    OpCase(
        "addmm_beta_alpha",
        module_of(
            lambda s, x: torch.addmm(s.b, x, s.w, beta=0.5, alpha=2.0) * s.r,
            {"b": (5,), "w": (8, 5)},
            {"r": (4, 5)},
        ),
        ((4, 8),),
        # mm (4×8)(8×5): 2·4·8·5 = 320; alpha· 20; beta·b 5; add 20; readout 20
        flops=320 + 20 + 5 + 20 + 20,
        aten=("aten.mm.default", "aten.mul.Tensor", "aten.add.Tensor"),
    ),
    OpCase(
        "addmm_alpha",
        module_of(
            lambda s, x: torch.addmm(s.b, x, s.w, alpha=-2) * s.r,
            {"b": (5,), "w": (8, 5)},
            {"r": (4, 5)},
        ),
        ((4, 8),),
        flops=320 + 20 + 20 + 20,  # mm; alpha· 20; add 20; readout 20
        aten=("aten.mm.default", "aten.mul.Tensor"),
    ),
    OpCase(
        "addmm_beta0",
        module_of(
            lambda s, x: torch.addmm(s.b, x, s.w, beta=0) * s.r,
            {"b": (5,), "w": (8, 5)},
            {"r": (4, 5)},
        ),
        ((4, 8),),
        flops=320 + 20,  # mm; the bias not read (no add); readout 20
        aten=("aten.mm.default",),
    ),
    OpCase(
        "addmm_sq_distances",
        module_of(
            lambda s, x: (
                (
                    torch.addmm((s.y * s.y).sum(-1), x, s.y.T, alpha=-2)
                    + (x * x).sum(-1, keepdim=True)
                )
                * s.r
            ),
            {"y": (3, 8)},
            {"r": (4, 3)},
        ),
        ((4, 8),),
        # y·y 24, sum 24; mm (4×8)(8×3): 192; alpha· 12; add 12; x·x 32, sum 32; add 12;
        # readout 12
        flops=24 + 24 + 192 + 12 + 12 + 32 + 32 + 12 + 12,
        aten=("aten.mm.default", "aten.mul.Tensor"),
    ),
]
