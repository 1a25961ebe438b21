"""Op-database cases: small real-model patterns and ops real models use. FLOPs worked out by hand in
each comment (docs/flops_conventions.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphflop.testing.opdb.core import Fn, OpCase, W, X, index, module_of, randomized


class _BasicBlock(nn.Module):
    """A ResNet basic block with stride 2 and a 1x1 stride-2 downsample, then the head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=False)
        self.bn1 = randomized(nn.BatchNorm2d(3))
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn2 = randomized(nn.BatchNorm2d(3))
        self.down = nn.Sequential(
            nn.Conv2d(2, 3, 1, stride=2, bias=False), randomized(nn.BatchNorm2d(3))
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)) + self.down(x))
        return self.fc(torch.flatten(self.pool(out), 1))


class _LeNet(nn.Module):
    target: torch.Tensor  # a buffer

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(2 * 3 * 3, 3)
        self.register_buffer("target", torch.tensor([2, 0]))

    def forward(self, x):
        h = self.pool(torch.relu(self.conv(x)))
        return F.cross_entropy(self.fc(h.flatten(1)), self.target)


def _mlp() -> nn.Module:
    m = Fn(
        lambda s, x: F.cross_entropy(s.l2(torch.relu(s.l1(x))), s.target),
        buffers={"target": index(3, 4)},
    )
    m.l1 = nn.Linear(4, 5)
    m.l2 = nn.Linear(5, 3)
    return m


MODELS = [
    OpCase(
        "mlp_cross_entropy",
        _mlp,
        ((4, 4),),
        # addmm (4x4)(4x5): 160 + 20 bias; relu 20; addmm (4x5)(5x3): 120 + 12 bias;
        # log_softmax on (4,3): amax 12, sub 12, exp 12, sum 12, log 4, sub 12 = 64;
        # nll (mean): ne 4, where 4, neg 4, ne 4, where 4, ne 4, sum 4, sum 4, div 1 = 33
        flops=180 + 20 + 132 + 64 + 33,
        aten=("aten.addmm.default", "aten.relu.default", "aten.gather.default"),
    ),
    # 6x6 input: both stride-2 convs leave the last input row unread (weight-gradient crop)
    OpCase(
        "resnet_block",
        _BasicBlock,
        ((2, 2, 6, 6),),
        # conv1 -> (2,3,3,3): 2*2*3*9*2*9 = 1944; each BatchNorm on 54 elements, 3
        # channels: 1 + (2*54 + 2*3) + 3 + 3 + 54 + 54 + 9 + 12 + 54 + 54 = 358 (see
        # batchnorm2d_train); relu 54; conv2: 2*2*3*9*3*9 = 2916; downsample 1x1 conv:
        # 2*2*3*9*2*1 = 216; add 54; relu 54; mean over 3x3: 54 + 6; fc addmm: 48 + 8
        flops=1944 + 358 + 54 + 2916 + 358 + 216 + 358 + 54 + 54 + 60 + 56,
        aten=(
            "aten.convolution.default",
            "aten._native_batch_norm_legit_functional.default",
            "aten.mean.dim",
            "aten.addmm.default",
            "aten.constant_pad_nd.default",
        ),
    ),
    OpCase(
        "lenet",
        _LeNet,
        ((2, 1, 8, 8),),
        # conv -> (2,2,6,6): 2*2*2*36*1*9 = 2592, bias 2*2*36 = 144; relu 144;
        # maxpool 2 -> 36 outputs: 3*36 = 108;
        # fc addmm (2x18)(18x3): 216 + 6; log_softmax on (2,3): 6*5 + 2 = 32;
        # nll (mean): 8*2 + 1 = 17
        flops=2592 + 144 + 144 + 108 + 222 + 32 + 17,
        aten=(
            "aten.convolution.default",
            "aten.max_pool2d_with_indices.default",
            "aten.addmm.default",
        ),
    ),
]

# ---------------------------------------------------------------------------------------------
# ops real models use (formerly gaps: their rules were missing)
# ---------------------------------------------------------------------------------------------
GAPS = [
    OpCase(
        "chunk",
        module_of(lambda s, x: (x * s.w).chunk(2, -1)[1] * s.r, {"w": W}, {"r": (2, 3, 2)}),
        (X,),
        flops=24 + 12,
        aten=("aten.split_with_sizes.default", "aten.cat.default"),
    ),
    OpCase(
        "relu6",
        module_of(lambda s, x: F.relu6(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,  # mul; relu6 traced as hardtanh(0, 6), 1 per element
        aten=("aten.hardtanh.default", "aten.logical_or.default"),
    ),
    OpCase(
        "leaky_relu",
        module_of(lambda s, x: F.leaky_relu(x * s.w), {"w": W}),
        (X,),
        flops=24 + 24,
        aten=("aten.leaky_relu.default",),
    ),
    OpCase(
        "var",
        module_of(lambda s, x: torch.var(x * s.w, 1) * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + (24 + 8) + 8,
        aten=("aten.var.correction",),
    ),
    OpCase(
        "conv_transpose2d",
        lambda: nn.ConvTranspose2d(2, 3, 3, stride=2),
        ((1, 2, 3, 3),),
        # 2*N*Cin*prod(in)*(Cout/G)*prod(k) = 2*1*2*9*3*9 = 972; bias on (1,3,7,7): 147
        flops=972 + 147,
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "avgpool2d_ceil_mode",
        module_of(
            lambda s, x: F.avg_pool2d(x * s.w, 2, ceil_mode=True) * s.r,
            {"w": (5, 5)},
            {"r": (1, 2, 3, 3)},
        ),
        ((1, 2, 5, 5),),
        flops=50 + 4 * 18 + 18,  # mul 50; out (1,2,3,3): 4 per output element; readout 18
        aten=("aten.avg_pool2d.default",),
    ),
    OpCase(
        "embedding",
        module_of(lambda s, x: F.embedding(s.idx, s.w) * x, {"w": (5, 4)}, {"idx": index(5, 2, 3)}),
        (X,),
        flops=24,  # embedding: 0 FLOPs (docs/flops_conventions.md); mul 24
        aten=("aten.embedding.default", "aten.index_put.default"),
    ),
    OpCase(
        "max_dim",
        module_of(lambda s, x: (x * s.w).max(1).values * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 24 + 8,  # like amax: 1 per input element
        aten=("aten.max.dim", "aten.gather.default"),
    ),
]
