"""Op-database cases: sorting and selection (sort, argsort, kthvalue, median, nanmedian) and
cumprod. FLOPs worked out by hand in each comment: comparisons count (docs/flops_conventions.md),
sort numel·⌈log2 N⌉ with N the sorted dim's size, kthvalue numel·⌈log2 k⌉ as topk, median as
kthvalue of the lower median k = ⌊(N - 1) / 2⌋ + 1; cumprod 1 per element. Inputs are
``randn`` (no ties, no zeros), so finite differences do not cross an order change."""

from __future__ import annotations

import torch

from graphflop.testing.opdb.core import OpCase, W, X, module_of

SORTING = [
    OpCase(
        "sort",
        module_of(lambda s, x: torch.sort(x * s.w, -1).values * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24 * 2 + 24,  # mul; sort of rows of 4: 24·⌈log2 4⌉ = 48; readout
        aten=("aten.sort.default", "aten.gather.default", "aten.scatter_add.default"),
    ),
    OpCase(
        "sort_descending_dim1",
        module_of(
            lambda s, x: torch.sort(x * s.w, 1, descending=True).values * s.r, {"w": W}, {"r": X}
        ),
        (X,),
        flops=24 + 24 * 2 + 24,  # mul; rows of 3: 24·⌈log2 3⌉ = 48; readout
        aten=("aten.sort.default",),
    ),
    OpCase(
        "sort_stable",
        module_of(
            lambda s, x: torch.sort(x * s.w, dim=0, stable=True).values * s.r, {"w": W}, {"r": X}
        ),
        (X,),
        flops=24 + 24 * 1 + 24,  # mul; rows of 2: 24·⌈log2 2⌉ = 24; readout
        aten=("aten.sort.stable",),
    ),
    OpCase(
        "argsort",
        module_of(
            lambda s, x: (lambda y: y.gather(-1, torch.argsort(y, -1)))(x * s.w) * s.r,
            {"w": W},
            {"r": X},
        ),
        (X,),
        flops=24 + 24 * 2 + 24,  # mul; argsort = sort, 24·2; gather 0; readout
        aten=("aten.sort.default", "aten.gather.default"),
    ),
    OpCase(
        "kthvalue",
        module_of(
            lambda s, x: torch.kthvalue(x * s.w, 3, -1).values * s.r, {"w": W}, {"r": (2, 3)}
        ),
        (X,),
        flops=24 + 24 * 2 + 6,  # mul; k = 3: 24·⌈log2 3⌉ = 48; readout 6
        aten=("aten.kthvalue.default", "aten.squeeze.dims"),
    ),
    OpCase(
        "kthvalue_keepdim",
        module_of(
            lambda s, x: torch.kthvalue(x * s.w, 2, 1, keepdim=True).values * s.r,
            {"w": W},
            {"r": (2, 1, 4)},
        ),
        (X,),
        flops=24 + 24 * 1 + 8,  # mul; k = 2: 24·⌈log2 2⌉ = 24; readout 8
        aten=("aten.kthvalue.default",),
    ),
    OpCase(
        "median_dim",
        module_of(lambda s, x: torch.median(x * s.w, -1).values * s.r, {"w": W}, {"r": (2, 3)}),
        (X,),
        flops=24 + 24 * 1 + 6,  # mul; rows of 4: k = 2, 24·⌈log2 2⌉ = 24; readout 6
        aten=("aten.median.dim", "aten.gather.default", "aten.squeeze.dims"),
    ),
    OpCase(
        "median_dim_keepdim",
        module_of(
            lambda s, x: torch.median(x * s.w, 0, keepdim=True).values * s.r,
            {"w": W},
            {"r": (1, 3, 4)},
        ),
        (X,),
        flops=24 + 24 * 0 + 12,  # mul; rows of 2: k = 1, 24·⌈log2 1⌉ = 0; readout 12
        aten=("aten.median.dim",),
    ),
    OpCase(
        "nanmedian_dim",
        module_of(lambda s, x: torch.nanmedian(x * s.w, 1).values * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 24 * 1 + 8,  # mul; rows of 3: k = 2, 24·⌈log2 2⌉ = 24; readout 8
        aten=("aten.nanmedian.dim",),
    ),
    OpCase(
        "median_all",
        module_of(lambda s, x: torch.median(x * s.w) * s.r, {"w": W}, {"r": ()}),
        (X,),
        flops=24 + 24 * 4 + 1,  # mul; 24 elements: k = 12, 24·⌈log2 12⌉ = 96; readout 1
        aten=("aten.median.default", "aten.eq.Tensor"),
    ),
    OpCase(
        "nanmedian_all",
        module_of(lambda s, x: torch.nanmedian(x * s.w) * s.r, {"w": W}, {"r": ()}),
        (X,),
        flops=24 + 24 * 4 + 1,  # as median: 24 elements, k = 12; readout 1
        aten=("aten.nanmedian.default",),
    ),
    OpCase(
        "cumprod",
        module_of(lambda s, x: (x * s.w).cumprod(1) * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24 + 24,  # mul; cumprod 1 per element; readout
        aten=("aten.cumprod.default", "aten.cumsum.default", "aten.div.Tensor"),
    ),
]
