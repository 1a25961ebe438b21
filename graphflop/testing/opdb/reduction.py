"""Op-database cases: reductions, normalisation and losses. FLOPs worked out by hand in each comment
(docs/flops_conventions.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphflop.testing.opdb.core import OpCase, W, X, index, module_of, randomized, readout_of


def with_zeros(shape, *zeros):
    """A parameter initialiser: ``randn(shape)`` with exact zeros at the ``zeros`` positions."""

    def make():
        w = torch.randn(shape)
        for at in zeros:
            w[at] = 0.0
        return w

    return make


# ---------------------------------------------------------------------------------------------
# reductions (with a readout r of the output's shape): 1 per input element, mean +1 per output
# ---------------------------------------------------------------------------------------------
REDUCTION = [
    # topk of the last dimension (k = 2 of 4): mul 24, topk numel·⌈log2 k⌉ = 24·1
    # (docs/flops_conventions.md's comparison count), readout 3·2·2 = 12
    OpCase(
        "topk",
        module_of(
            lambda s, x: torch.topk(x * s.w, 2, dim=-1).values * s.r, {"w": W}, {"r": (2, 3, 2)}
        ),
        (X,),
        flops=24 + 24 + 12,
        aten=("aten.topk.default",),
    ),
    OpCase(
        "sum_dim",
        module_of(lambda s, x: (x * s.w).sum(1) * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 24 + 8,
        aten=("aten.sum.dim_IntList",),
    ),
    OpCase(
        "sum_keepdim",
        module_of(
            lambda s, x: (x * s.w).sum((0, 2), keepdim=True) * s.r, {"w": W}, {"r": (1, 3, 1)}
        ),
        (X,),
        flops=24 + 24 + 3,
        aten=("aten.sum.dim_IntList",),
    ),
    OpCase(
        "mean_dim",
        module_of(lambda s, x: (x * s.w).mean(-1) * s.r, {"w": W}, {"r": (2, 3)}),
        (X,),
        flops=24 + (24 + 6) + 6,
        aten=("aten.mean.dim",),
    ),
    OpCase(
        "mean_keepdim",
        module_of(
            lambda s, x: (x * s.w).mean((0, 2), keepdim=True) * s.r, {"w": W}, {"r": (1, 3, 1)}
        ),
        (X,),
        flops=24 + (24 + 3) + 3,
        aten=("aten.mean.dim",),
    ),
    OpCase(
        "mean_all",
        module_of(lambda s, x: (x * s.w).mean(), {"w": W}),
        (X,),
        flops=24 + (24 + 1),
        aten=("aten.mean.default",),
    ),
    OpCase(
        "amax",
        module_of(lambda s, x: (x * s.w).amax(1) * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 24 + 8,
        aten=("aten.amax.default",),
    ),
    OpCase(
        "max_all",
        module_of(lambda s, x: (x * s.w).max() * s.w, {"w": W}),
        (X,),
        flops=24 + 24 + 12,  # mul; max over all 1 per input element; * w 12
        aten=("aten.max.default",),
    ),
    OpCase(
        "min_all",
        module_of(lambda s, x: (x * s.w).min() * s.w, {"w": W}),
        (X,),
        flops=24 + 24 + 12,  # mul; min over all 1 per input element; * w 12
        aten=("aten.min.default",),
    ),
    OpCase(
        "amin",
        module_of(lambda s, x: (x * s.w).amin(-1) * s.r, {"w": W}, {"r": (2, 3)}),
        (X,),
        flops=24 + 24 + 6,
        aten=("aten.amin.default",),
    ),
    OpCase(
        "var_mean",
        module_of(
            lambda s, x: (lambda vm: vm[0] * s.r + vm[1])(torch.var_mean(x * s.w, 1)),
            {"w": W},
            {"r": (2, 4)},
        ),
        (X,),
        flops=24 + (2 * 24 + 2 * 8) + 8 + 8,  # mul; var_mean; *r; +mean -> 104
        aten=("aten.var_mean.correction",),
    ),
    OpCase(
        "var_mean_keepdim_c0",
        module_of(
            lambda s, x: (lambda vm: vm[0] * s.r + vm[1])(
                torch.var_mean(x * s.w, (0, 2), correction=0, keepdim=True)
            ),
            {"w": W},
            {"r": (1, 3, 1)},
        ),
        (X,),
        flops=24 + (2 * 24 + 2 * 3) + 3 + 3,  # 84
        aten=("aten.var_mean.correction",),
    ),
]

# ---------------------------------------------------------------------------------------------
# normalisation and losses (decomposed; counted as the sum of their parts)
# ---------------------------------------------------------------------------------------------
NORM_LOSS = [
    OpCase(
        "batchnorm2d_train",
        readout_of(lambda: randomized(nn.BatchNorm2d(3)), (4, 3, 2, 2)),
        ((4, 3, 2, 2),),
        # num_batches_tracked += 1: 1; var_mean over 48 elements, 3 outputs: 2*48 + 2*3 = 102;
        # +eps 3, rsqrt 3; x - mean 48, * rstd 48; running_mean: *0.1, *0.9, + : 9;
        # running_var: *n/(n-1), *0.1, *0.9, + : 12; *weight 48, +bias 48; readout 48
        # (one op, _native_batch_norm_legit_functional, counted as these parts)
        flops=1 + 102 + 3 + 3 + 48 + 48 + 9 + 12 + 48 + 48 + 48,
        aten=("aten._native_batch_norm_legit_functional.default",),
    ),
    OpCase(
        "batchnorm2d_eval",
        readout_of(lambda: randomized(nn.BatchNorm2d(3)).eval(), (4, 3, 2, 2)),
        ((4, 3, 2, 2),),
        # one op: per element − mean, × rsqrt, × weight, + bias: 4*48; per channel + eps
        # and rsqrt: 2*3; readout 48
        flops=4 * 48 + 2 * 3 + 48,
        aten=("aten._native_batch_norm_legit_no_training.default",),
    ),
    OpCase(
        "layernorm",
        readout_of(lambda: randomized(nn.LayerNorm(4)), (2, 3, 4)),
        (X,),
        # var_mean 2*24 + 2*6 = 60; +eps 6; rsqrt 6; sub 24; mul 24; *weight 24; +bias 24;
        # readout 24
        flops=60 + 6 + 6 + 24 * 4 + 24,
        aten=("aten.var_mean.correction", "aten.rsqrt.default"),
    ),
    OpCase(
        "groupnorm",
        readout_of(lambda: randomized(nn.GroupNorm(2, 4)), (2, 4, 2, 2)),
        ((2, 4, 2, 2),),
        # 32 elements in 4 groups of 8: var_mean 2*32 + 2*4 = 72; +eps 4, rsqrt 4; sub 32,
        # mul 32; *weight 32, +bias 32; readout 32
        flops=72 + 4 + 4 + 32 * 4 + 32,
        aten=("aten.var_mean.correction", "aten.rsqrt.default", "aten.view.default"),
    ),
    OpCase(
        "log_softmax",
        module_of(lambda s, x: F.log_softmax(x * s.w, -1), {"w": W}),
        (X,),
        # mul 24; amax 24, sub 24, exp 24, sum 24, log 6, sub 24
        flops=24 + 24 * 5 + 6,
        aten=("aten.amax.default", "aten.exp.default", "aten.log.default"),
    ),
    OpCase(
        "softmax",
        module_of(lambda s, x: F.softmax(x * s.w, -1) * s.r, {"w": W}, {"r": X}),
        (X,),
        # mul 24; amax 24, sub 24, exp 24, sum 24, div 24; readout 24
        flops=24 + 24 * 5 + 24,
        aten=("aten.amax.default", "aten.exp.default", "aten.div.Tensor"),
    ),
    OpCase(
        "cross_entropy",
        module_of(
            lambda s, x: F.cross_entropy(F.linear(x, s.w, s.b), s.target),
            {"w": (5, 4), "b": (5,)},
            {"target": index(5, 3)},
        ),
        ((3, 4),),
        # addmm (3x4)(4x5): 120 + 15 bias; log_softmax on (3,5): amax 15, sub 15, exp 15,
        # sum 15, log 3, sub 15 = 78; nll_loss (mean): ne 3, where 3, neg 3, ne 3, where 3,
        # ne 3, sum 3, sum 3, div 1 = 25 (gather, _to_copy: 0)
        flops=135 + 78 + 25,
        aten=(
            "aten.addmm.default",
            "aten.gather.default",
            "aten.scatter_add.default",
            "aten.log.default",
            "aten.where.self",
            "aten._to_copy.default",
        ),
    ),
    OpCase(
        "mse_loss",
        module_of(lambda s, x: F.mse_loss(x * s.w, s.y), {"w": W}, {"y": X}),
        (X,),
        flops=24 + 24 + 24 + (24 + 1),  # mul; sub; pow 2; mean
        aten=("aten.pow.Tensor_Scalar", "aten.mean.default"),
    ),
]

# ---------------------------------------------------------------------------------------------
# more reductions
# ---------------------------------------------------------------------------------------------
REDUCTION_MORE = [
    OpCase(
        "std",
        module_of(
            lambda s, x: torch.std(x * s.w, (0, 2), keepdim=True) * s.r, {"w": W}, {"r": (1, 3, 1)}
        ),
        (X,),
        # mul; std kept whole, as var (1 per input, divide per output) and sqrt; r
        flops=24 + (24 + 3) + 3 + 3,
        aten=("aten.std.correction",),
    ),
    OpCase(
        "min_dim_keepdim",
        module_of(
            lambda s, x: (x * s.w).min(-1, keepdim=True).values * s.r, {"w": W}, {"r": (2, 3, 1)}
        ),
        (X,),
        flops=24 + 24 + 6,
        aten=("aten.min.dim",),
    ),
    OpCase(
        "argmax",
        module_of(
            lambda s, x: (x * s.w) * s.r * (x * s.w).argmax(1, keepdim=True), {"w": W}, {"r": X}
        ),
        (X,),
        flops=24 + 24 + 24 + 24 + 24,  # two mul; readout; argmax 1 per input; mul
        aten=("aten.argmax.default",),
    ),
    OpCase(
        "cumsum",
        module_of(lambda s, x: (x * s.w).cumsum(1) * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24 + 24,
        aten=("aten.cumsum.default", "aten.flip.default"),
    ),
    OpCase(
        "cummax",
        module_of(lambda s, x: torch.cummax(x * s.w, 1).values * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24 + 24,  # mul; cummax 1 comparison per element; readout
        aten=("aten.cummax.default", "aten.gather.default", "aten.scatter_add.default"),
    ),
    OpCase(
        "cummin_last_dim",
        module_of(lambda s, x: torch.cummin(x * s.w, -1).values * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24 + 24,  # mul; cummin 1 comparison per element; readout
        aten=("aten.cummin.default",),
    ),
    OpCase(
        "logcumsumexp",
        module_of(lambda s, x: torch.logcumsumexp(x * s.w, 1) * s.r, {"w": W}, {"r": X}),
        (X,),
        # mul 24; logcumsumexp 5 per element (max, sub, exp, log1p, add) 120; readout 24
        flops=24 + 5 * 24 + 24,
        aten=("aten.logcumsumexp.default", "aten.cumsum.default"),
    ),
    OpCase(
        "logcumsumexp_large",
        module_of(lambda s, x: torch.logcumsumexp(x * s.w + 800.0, 0) * s.r, {"w": W}, {"r": X}),
        (X,),
        # inputs near 800, where exp overflows float64 (exp(709.8) is its largest): the JVP
        # scales by the maximum, so nothing overflows; mul 24, add 24; logcumsumexp 120;
        # readout 24
        flops=24 + 24 + 5 * 24 + 24,
        aten=("aten.logcumsumexp.default",),
    ),
    OpCase(
        "vector_norm",
        module_of(
            lambda s, x: torch.linalg.vector_norm(x * s.w, dim=-1) * s.r, {"w": W}, {"r": (2, 3)}
        ),
        (X,),
        # mul 24; the 2-norm kept whole, as x ** 2: 24; sum 24; ** 0.5: 6; readout 6
        flops=24 + 24 + 24 + 6 + 6,
        aten=("aten.linalg_vector_norm.default",),
    ),
]

NORM_MORE = [
    OpCase(
        "layernorm_no_affine",
        readout_of(lambda: nn.LayerNorm(4, elementwise_affine=False), (2, 3, 4)),
        (X,),
        flops=60 + 6 + 6 + 24 * 2 + 24,  # var_mean 60; +eps, rsqrt; sub, mul; readout
        aten=("aten.var_mean.correction",),
    ),
    OpCase(
        "batchnorm1d_train",
        readout_of(lambda: randomized(nn.BatchNorm1d(3)), (4, 3)),
        ((4, 3),),
        # as batchnorm2d_train on 12 elements, 3 channels: 1 + (2*12 + 2*3) + 3 + 3 + 12 + 12
        # + 9 + 12 + 12 + 12; readout 12
        flops=1 + 30 + 3 + 3 + 12 + 12 + 9 + 12 + 12 + 12 + 12,
        aten=("aten._native_batch_norm_legit_functional.default",),
    ),
    OpCase(
        "instancenorm2d",
        readout_of(lambda: randomized(nn.InstanceNorm2d(3, affine=True)), (2, 3, 2, 2)),
        ((2, 3, 2, 2),),
        # batch norm over (1, 6, 2, 2) (repeat: 0): var_mean 2*24 + 2*6 = 60; +eps 6, rsqrt 6;
        # sub 24, mul 24; *weight 24, +bias 24; readout 24
        flops=60 + 6 + 6 + 24 * 4 + 24,
        aten=("aten.var_mean.correction",),
    ),
    OpCase(
        "groupnorm_1d",
        readout_of(lambda: randomized(nn.GroupNorm(3, 6)), (2, 6, 5)),
        ((2, 6, 5),),
        # 60 elements in 6 groups of 10: var_mean 2*60 + 2*6 = 132; +eps 6, rsqrt 6; sub 60,
        # mul 60; *weight 60, +bias 60; readout 60
        flops=132 + 6 + 6 + 60 * 4 + 60,
        aten=("aten.var_mean.correction",),
    ),
]

# ---------------------------------------------------------------------------------------------
# vector norms of order 1, inf, and 2 over a tuple of dims
# ---------------------------------------------------------------------------------------------
VECTOR_NORM_MORE = [
    OpCase(
        "vector_norm_ord1",
        module_of(
            lambda s, x: torch.linalg.vector_norm(x * s.w, 1, dim=-1) * s.r,
            {"w": W},
            {"r": (2, 3)},
        ),
        (X,),
        # mul 24; abs 24; ** 1: 24; sum 24; ** 1: 6; readout 6
        flops=24 + 24 + 24 + 24 + 6 + 6,
        aten=("aten.abs.default", "aten.sum.dim_IntList"),
    ),
    OpCase(
        "vector_norm_inf",
        module_of(
            lambda s, x: torch.linalg.vector_norm(x * s.w, float("inf"), dim=-1) * s.r,
            {"w": W},
            {"r": (2, 3)},
        ),
        (X,),
        flops=24 + 24 + 24 + 6,  # mul; abs; amax 1 per input; readout
        aten=("aten.abs.default", "aten.amax.default"),
    ),
    OpCase(
        "vector_norm_dims",
        module_of(
            lambda s, x: torch.linalg.vector_norm(x * s.w, 2, dim=(0, 2)) * s.r,
            {"w": W},
            {"r": (3,)},
        ),
        (X,),
        flops=24 + 24 + 24 + 3 + 3,  # mul; the 2-norm as x ** 2, sum, ** 0.5 on 3; readout
        aten=("aten.linalg_vector_norm.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# product along a dim and over everything: 1 multiply per input element (as a sum's adds);
# inputs are randn (no exact zeros, where the tangent out · sum(dx / x) is undefined)
# ---------------------------------------------------------------------------------------------
PROD = [
    OpCase(
        "prod_dim",
        module_of(lambda s, x: (x * s.w).prod(1) * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 24 + 8,  # mul; prod 1 per input element; readout (2, 4)
        aten=("aten.prod.dim_int", "aten.div.Tensor", "aten.sum.dim_IntList"),
    ),
    OpCase(
        "prod_keepdim",
        module_of(lambda s, x: (x * s.w).prod(-1, keepdim=True) * s.r, {"w": W}, {"r": (2, 3, 1)}),
        (X,),
        flops=24 + 24 + 6,  # mul; prod 1 per input element; readout (2, 3, 1)
        aten=("aten.prod.dim_int",),
    ),
    OpCase(
        "prod_all",
        module_of(lambda s, x: (x * s.w).prod() * s.r, {"w": W}, {"r": ()}),
        (X,),
        flops=24 + 24 + 1,  # mul; prod 1 per input element; readout (a scalar)
        aten=("aten.prod.default", "aten.sum.dim_IntList"),
    ),
    # exact zeros in a parameter (so the zero's own tangent, x·dw, is not zero): the tangent's
    # coefficient at an element is the product of the others (exact at zeros, as PyTorch's
    # prod_backward), not out / x (nan there). Same counts as the cases above.
    OpCase(
        "prod_dim_zeros",
        # w's columns are the reduced rows of x·w (dim 1, 3 long): column 0 holds one zero,
        # column 1 two, column 2 three, column 3 none
        module_of(
            lambda s, x: (x * s.w).prod(1) * s.r,
            {"w": with_zeros(W, (1, 0), (0, 1), (2, 1), (0, 2), (1, 2), (2, 2))},
            {"r": (2, 4)},
        ),
        (X,),
        flops=24 + 24 + 8,  # mul; prod 1 per input element; readout (2, 4)
        aten=("aten.prod.dim_int", "aten.eq.Scalar", "aten.where.ScalarOther"),
    ),
    OpCase(
        "prod_keepdim_zeros",
        # reduced along w's rows (dim -1, 4 long): row 0 holds one zero, row 1 two, row 2 none
        module_of(
            lambda s, x: (x * s.w).prod(-1, keepdim=True) * s.r,
            {"w": with_zeros(W, (0, 1), (1, 0), (1, 3))},
            {"r": (2, 3, 1)},
        ),
        (X,),
        flops=24 + 24 + 6,  # mul; prod 1 per input element; readout (2, 3, 1)
        aten=("aten.prod.dim_int",),
    ),
    OpCase(
        "prod_all_one_zero",
        # one zero among the 24 elements: the gradient is the product of the other 23 there
        module_of(lambda s, x: (x * s.w).prod() * s.r, {"w": with_zeros(X, (1, 2, 3))}, {"r": ()}),
        (X,),
        flops=24 + 24 + 1,  # mul; prod 1 per input element; readout (a scalar)
        aten=("aten.prod.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# cosine similarity, as ATen's composite computes it (graphflop.frontend.composite): each
# input's norm cloned and clamped to eps with grad mode off, the derivative through the norm
# ---------------------------------------------------------------------------------------------
_COSINE_FORWARD_MODE = (
    "where a norm is clamped to eps, eager's reverse mode (torch.func.grad, loss.backward) "
    "differentiates through the norm (the clamp under NoGradGuard is not recorded) while its "
    "forward mode (torch.func.jvp, and finite differences) sees the clamp (forward AD ignores "
    "grad mode): graphflop's one linearization follows the gradient (vjp and dot checks)"
)

COSINE = [
    OpCase(
        "cosine_similarity",
        module_of(
            lambda s, x: F.cosine_similarity(x * s.w, x * s.v, dim=-1) * s.r,
            {"w": W, "v": W},
            {"r": (2, 3)},
        ),
        (X,),
        # two mul 48; two 2-norms (x ** 2 24, sum 24, ** 0.5 6): 108; clones 0; clamp_min
        # 2·6; two divides 48; product 24; sum 24; readout 6
        flops=48 + 108 + 12 + 48 + 24 + 24 + 6,
        aten=("aten.clamp.default", "aten.clone.default", "aten.div.Tensor"),
    ),
    OpCase(
        "cosine_similarity_clamped",
        module_of(
            lambda s, x: nn.CosineSimilarity(dim=0, eps=100.0)(x * s.w, s.v) * s.r,
            {"w": W, "v": (3, 4)},
            {"r": (3, 4)},
        ),
        (X,),
        # every norm below eps (clamped; the derivative still through the norm, as eager's):
        # mul 24; v broadcast to X: a view; norms over dim 0 (x ** 2 24, sum 24, ** 0.5 12)
        # twice: 120; clamp_min 2·12; divides 48; product 24; sum 24; readout 12
        flops=24 + 120 + 24 + 48 + 24 + 24 + 12,
        aten=("aten.clamp.default",),
        xfail={"jvp": _COSINE_FORWARD_MODE, "fd": _COSINE_FORWARD_MODE},
    ),
]
