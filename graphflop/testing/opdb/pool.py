"""Op-database cases: pooling. FLOPs worked out by hand in each comment
(docs/flops_conventions.md)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from graphflop.testing.opdb.core import Fn, OpCase, Readout, module_of

# ---------------------------------------------------------------------------------------------
# pooling (x * w first, so the weight has a tangent; readout after)
# ---------------------------------------------------------------------------------------------
POOL = [
    OpCase(
        "maxpool2d_k3s2p1",
        module_of(
            lambda s, x: F.max_pool2d(x * s.w, 3, 2, 1) * s.r, {"w": (5, 5)}, {"r": (2, 2, 3, 3)}
        ),
        ((2, 2, 5, 5),),
        flops=100 + 8 * 36 + 36,  # mul 100; out (2,2,3,3): (9-1)*36 = 288; readout 36
        aten=(
            "aten.max_pool2d_with_indices.default",
            "aten.gather.default",
            "aten.scatter_add.default",
        ),
    ),
    OpCase(
        "maxpool2d_k2",
        lambda: Readout(Fn(lambda s, x: nn.MaxPool2d(2)(x * s.w), {"w": (4, 4)}), (2, 2, 2, 2)),
        ((2, 2, 4, 4),),
        flops=64 + 3 * 16 + 16,  # mul 64; out (2,2,2,2): (4-1)*16 = 48; readout 16
        aten=("aten.max_pool2d_with_indices.default",),
    ),
    OpCase(
        "maxpool3d",
        module_of(
            lambda s, x: F.max_pool3d(x * s.w, 2) * s.r, {"w": (4, 4, 4)}, {"r": (1, 2, 2, 2, 2)}
        ),
        ((1, 2, 4, 4, 4),),
        flops=128 + 7 * 16 + 16,  # mul 128; out 16 elements: (8-1)*16 = 112; readout 16
        aten=("aten.max_pool3d_with_indices.default",),
    ),
    OpCase(
        "adaptive_maxpool2d_uneven",
        module_of(
            lambda s, x: F.adaptive_max_pool2d(x * s.w, (2, 3)) * s.r,
            {"w": (5, 7)},
            {"r": (2, 3, 2, 3)},
        ),
        ((2, 3, 5, 7),),
        # mul 210; windows H 5→2: [0,3) [2,5), W 7→3: [0,3) [2,5) [4,7): every window 3×3,
        # 8 comparisons × 6 outputs × 6 planes = 288; readout 36
        flops=210 + 288 + 36,
        aten=("aten.adaptive_max_pool2d.default", "aten.gather.default"),
    ),
    OpCase(
        "adaptive_maxpool3d",
        module_of(
            lambda s, x: F.adaptive_max_pool3d(x * s.w, (1, 2, 3)) * s.r,
            {"w": (2, 4, 6)},
            {"r": (1, 2, 1, 2, 3)},
        ),
        ((1, 2, 2, 4, 6),),
        # mul 96; windows D 2→1 [0,2), H 4→2 [0,2) [2,4), W 6→3 pairs: every window 2·2·2 = 8,
        # 7 comparisons × 6 outputs × 2 planes = 84; readout 12
        flops=96 + 84 + 12,
        aten=("aten.adaptive_max_pool3d.default",),
    ),
    OpCase(
        "avgpool2d_k2",
        module_of(lambda s, x: F.avg_pool2d(x * s.w, 2) * s.r, {"w": (4, 4)}, {"r": (2, 2, 2, 2)}),
        ((2, 2, 4, 4),),
        flops=64 + 4 * 16 + 16,  # mul 64; 4 per output element; readout 16
        aten=("aten.avg_pool2d.default", "aten.col2im.default"),
    ),
    OpCase(
        # the pooled map flattened to tokens and transposed (EfficientFormer): the cotangent
        # reaching the pool is not contiguous (a tester's timm:efficientformer_l1 failed here)
        "avgpool2d_tokens",
        module_of(
            lambda s, x: F.avg_pool2d(x * s.w, 2).flatten(2).transpose(1, 2) * s.r,
            {"w": (4, 4)},
            {"r": (2, 4, 2)},
        ),
        ((2, 2, 4, 4),),
        flops=64 + 4 * 16 + 16,  # mul 64; 4 per output element (16); readout 16
        aten=("aten.avg_pool2d.default", "aten.col2im.default"),
    ),
    OpCase(
        "avgpool2d_k3s2p1",
        module_of(
            lambda s, x: F.avg_pool2d(x * s.w, 3, 2, 1) * s.r, {"w": (5, 5)}, {"r": (2, 2, 3, 3)}
        ),
        ((2, 2, 5, 5),),
        flops=100 + 9 * 36 + 36,  # mul 100; out (2,2,3,3): 9*36 = 324; readout 36
        aten=("aten.avg_pool2d.default",),
    ),
    OpCase(
        "adaptive_avgpool1",
        module_of(
            lambda s, x: F.adaptive_avg_pool2d(x * s.w, 1) * s.r, {"w": (4, 4)}, {"r": (2, 3, 1, 1)}
        ),
        ((2, 3, 4, 4),),
        flops=96 + (96 + 6) + 6,  # mul 96; mean over H,W: 96 + 6; readout 6
        aten=("aten.mean.dim",),
    ),
    OpCase(
        "adaptive_avgpool1_channels_last",  # PyTorch restrides the mean with as_strided_
        module_of(
            lambda s, x: (
                F.adaptive_avg_pool2d(
                    (x * s.w).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), 1
                )
                * s.r
            ),
            {"w": (4, 4)},
            {"r": (2, 3, 1, 1)},
        ),
        ((2, 3, 4, 4),),
        flops=96 + (96 + 6) + 6,  # mul 96; mean over H,W: 96 + 6; readout 6
        aten=("aten.mean.dim",),
    ),
    OpCase(
        "adaptive_avgpool2",
        module_of(
            lambda s, x: F.adaptive_avg_pool2d(x * s.w, 2) * s.r, {"w": (4, 4)}, {"r": (2, 3, 2, 2)}
        ),
        ((2, 3, 4, 4),),
        flops=96 + 4 * 24 + 24,  # mul 96; avg_pool2d k2: 4*24; readout 24
        aten=("aten.avg_pool2d.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# more pooling and normalisation
# ---------------------------------------------------------------------------------------------
POOL_MORE = [
    OpCase(
        "avgpool2d_exclude_pad",
        module_of(
            lambda s, x: F.avg_pool2d(x * s.w, 3, 2, 1, count_include_pad=False) * s.r,
            {"w": (5, 5)},
            {"r": (1, 2, 3, 3)},
        ),
        ((1, 2, 5, 5),),
        flops=50 + 9 * 18 + 18,  # mul 50; 9 per output element; readout 18
        aten=("aten.avg_pool2d.default", "aten.div.Tensor"),
    ),
    # k3 s2 p1 on 4x4 with ceil_mode: 3x3 windows starting at -1, 1, 3; the last one runs past
    # the padded extent (5), so its divisor is 3*2 (or 2*2 in the corner), not 9
    OpCase(
        "avgpool2d_ceil_pad",
        module_of(
            lambda s, x: F.avg_pool2d(x * s.w, 3, 2, 1, ceil_mode=True) * s.r,
            {"w": (4, 4)},
            {"r": (1, 2, 3, 3)},
        ),
        ((1, 2, 4, 4),),
        flops=32 + 9 * 18 + 18,  # mul 32; 9 per output element; readout 18
        aten=("aten.avg_pool2d.default", "aten.div.Tensor", "aten.col2im.default"),
    ),
    OpCase(
        "avgpool2d_divisor",
        module_of(
            lambda s, x: F.avg_pool2d(x * s.w, 2, divisor_override=3) * s.r,
            {"w": (4, 4)},
            {"r": (1, 2, 2, 2)},
        ),
        ((1, 2, 4, 4),),
        flops=32 + 4 * 8 + 8,
        aten=("aten.avg_pool2d.default",),
    ),
    OpCase(
        "avgpool1d",
        module_of(lambda s, x: F.avg_pool1d(x * s.w, 3, 2) * s.r, {"w": (7,)}, {"r": (2, 3, 3)}),
        ((2, 3, 7),),
        flops=42 + 3 * 18 + 18,
        aten=("aten.avg_pool2d.default",),
    ),
    OpCase(
        "avgpool3d",
        module_of(
            lambda s, x: F.avg_pool3d(x * s.w, 2) * s.r, {"w": (4, 4, 4)}, {"r": (1, 2, 2, 2, 2)}
        ),
        ((1, 2, 4, 4, 4),),
        flops=128 + 8 * 16 + 16,
        aten=("aten.avg_pool3d.default", "aten.col2im.default"),
    ),
    OpCase(
        "avgpool3d_tokens",
        module_of(
            lambda s, x: F.avg_pool3d(x * s.w, 2).flatten(2).transpose(1, 2) * s.r,
            {"w": (4, 4, 4)},
            {"r": (1, 8, 2)},
        ),
        ((1, 2, 4, 4, 4),),
        flops=128 + 8 * 16 + 16,  # mul 128; 8 per output element (16); readout 16
        aten=("aten.avg_pool3d.default", "aten.col2im.default"),
    ),
    OpCase(
        "avgpool3d_overlap_exclude_pad",
        module_of(
            lambda s, x: (
                F.avg_pool3d(x * s.w, (3, 2, 3), (2, 1, 2), (1, 0, 1), count_include_pad=False)
                * s.r
            ),
            {"w": (5, 4, 5)},
            {"r": (1, 2, 3, 3, 3)},
        ),
        ((1, 2, 5, 4, 5),),
        # mul 200; output D (5 + 2 − 3)/2 + 1 = 3, H 3, W 3: 54 outputs, 18 each: 972; readout 54
        flops=200 + 18 * 54 + 54,
        aten=("aten.avg_pool3d.default", "aten.col2im.default", "aten.arange.start_step"),
    ),
    OpCase(
        "avgpool3d_ceil",
        module_of(
            lambda s, x: F.avg_pool3d(x * s.w, 2, 2, ceil_mode=True) * s.r,
            {"w": (5, 4, 5)},
            {"r": (1, 2, 3, 2, 3)},
        ),
        ((1, 2, 5, 4, 5),),
        # mul 200; output D ⌈3/2⌉ + 1 = 3, H 2, W 3: 36 outputs, 8 each: 288; readout 36
        flops=200 + 8 * 36 + 36,
        aten=("aten.avg_pool3d.default", "aten.col2im.default"),
    ),
    OpCase(
        "maxpool1d",
        module_of(lambda s, x: F.max_pool1d(x * s.w, 2) * s.r, {"w": (6,)}, {"r": (2, 3, 3)}),
        ((2, 3, 6),),
        flops=36 + 1 * 18 + 18,
        aten=("aten.max_pool2d_with_indices.default",),
    ),
    OpCase(
        "adaptive_avgpool_uneven",
        module_of(
            lambda s, x: F.adaptive_avg_pool2d(x * s.w, 3) * s.r, {"w": (5, 5)}, {"r": (1, 2, 3, 3)}
        ),
        ((1, 2, 5, 5),),
        # PyTorch's decomposition for uneven windows (sum of the parts): mul 89, add 174,
        # where 324, div 18, div (floor) 12, minimum 18, ge 18, sub 12
        flops=89 + 174 + 324 + 18 + 12 + 18 + 18 + 12,
        aten=("aten.index.Tensor", "aten.div.Tensor_mode"),
    ),
    OpCase(
        "adaptive_avgpool3d_uneven",  # kept whole: _adaptive_avg_pool3d
        module_of(
            lambda s, x: F.adaptive_avg_pool3d(x * s.w, (3, 4, 2)) * s.r,
            {"w": (5, 6, 4)},
            {"r": (1, 2, 3, 4, 2)},
        ),
        ((1, 2, 5, 6, 4),),
        # mul 240; pooling: N·C·∏_d Σ_j window lengths, D 5→3: 2+3+2 = 7, H 6→4: 2+2+2+2 = 8,
        # W 4→2: 2+2 = 4, so 2·7·8·4 = 448; readout 2·3·4·2 = 48
        flops=240 + 448 + 48,
        aten=("aten._adaptive_avg_pool3d.default",),
    ),
]
