"""Op-database cases: convolutions (plain, grouped, transposed, 1-D/3-D, dilated). FLOPs worked out
by hand in each comment (docs/flops_conventions.md)."""

from __future__ import annotations

from torch import nn

from graphflop.testing.opdb.core import OpCase

# ---------------------------------------------------------------------------------------------
# convolutions: 2*N*Cout*prod(out)*(Cin/G)*prod(k), + N*Cout*prod(out) for a bias
# ---------------------------------------------------------------------------------------------
CONV = [
    OpCase(
        "conv2d",
        lambda: nn.Conv2d(2, 3, 3),
        ((2, 2, 5, 5),),
        flops=2 * 2 * 3 * 9 * 2 * 9 + 2 * 3 * 9,  # out (2,3,3,3): 1944 + 54 = 1998
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv2d_groups2",
        lambda: nn.Conv2d(4, 6, 3, groups=2, bias=False),
        ((1, 4, 5, 5),),
        flops=2 * 1 * 6 * 9 * (4 // 2) * 9,  # out (1,6,3,3): 1944
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv2d_depthwise",
        lambda: nn.Conv2d(3, 3, 3, groups=3, padding=1),
        ((2, 3, 4, 4),),
        flops=2 * 2 * 3 * 16 * 1 * 9 + 2 * 3 * 16,  # out (2,3,4,4): 1728 + 96 = 1824
        aten=("aten.convolution.default",),
    ),
    # (H + 2p - k) % stride = (6 + 2 - 3) % 2 = 1: the last input row is read by no output
    OpCase(
        "conv2d_stride2_pad1",
        lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1),
        ((1, 2, 6, 6),),
        flops=2 * 1 * 3 * 9 * 2 * 9 + 1 * 3 * 9,  # out (1,3,3,3): 972 + 27 = 999
        aten=("aten.convolution.default", "aten.constant_pad_nd.default"),
    ),
    OpCase(
        "conv2d_dilation2",
        lambda: nn.Conv2d(2, 2, 3, dilation=2),
        ((1, 2, 7, 7),),
        flops=2 * 1 * 2 * 9 * 2 * 9 + 1 * 2 * 9,  # out (1,2,3,3): 648 + 18 = 666
        aten=("aten.convolution.default",),
    ),
    # H: (6+2-3)//2+1 = 3, W: (5-2*(2-1)-1)//1+1 = 3; (6+2-3) % 2 = 1
    OpCase(
        "conv2d_mixed",
        lambda: nn.Conv2d(4, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2),
        ((1, 4, 6, 5),),
        flops=2 * 1 * 4 * 9 * 2 * 6 + 1 * 4 * 9,  # out (1,4,3,3): 864 + 36 = 900
        aten=("aten.convolution.default",),
    ),
    # an even kernel with padding="same" pads asymmetrically (1 left, 2 right): pad + conv
    OpCase(
        "conv2d_same_even",
        lambda: nn.Conv2d(2, 2, 4, padding="same"),
        ((1, 2, 5, 5),),
        flops=2 * 1 * 2 * 25 * 2 * 16 + 1 * 2 * 25,  # out (1,2,5,5): 3200 + 50 = 3250
        aten=("aten.convolution.default", "aten.constant_pad_nd.default"),
    ),
    OpCase(
        "conv1d",
        lambda: nn.Conv1d(2, 3, 3),
        ((2, 2, 8),),
        flops=2 * 2 * 3 * 6 * 2 * 3 + 2 * 3 * 6,  # out (2,3,6): 432 + 36 = 468
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv3d",
        lambda: nn.Conv3d(2, 2, 2),
        ((1, 2, 3, 3, 3),),
        flops=2 * 1 * 2 * 8 * 2 * 8 + 1 * 2 * 8,  # out (1,2,2,2,2): 512 + 16 = 528
        aten=("aten.convolution.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# transposed, 1-D, 3-D and dilated convolutions (the transposed ones: 2*N*Cin*prod(in)*(Cout/G)*
# prod(k), + N*Cout*prod(out) for the bias); the first five are tests/test_cases.py's cases 2-6
# ---------------------------------------------------------------------------------------------
CONV_MORE = [
    OpCase(
        "conv_transpose2d_1x1_input",
        lambda: nn.ConvTranspose2d(32, 1, 3),
        ((1, 32, 1, 1),),
        flops=2 * 1 * 32 * 1 * 1 * 9 + 9,  # 576; bias on (1,1,3,3): 9
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose2d_k2s2",
        lambda: nn.ConvTranspose2d(3, 1, 2, stride=2),
        ((1, 3, 2, 2),),
        flops=2 * 1 * 3 * 4 * 1 * 4 + 16,  # 96; bias on (1,1,4,4): 16
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose2d_depthwise_outpad",
        lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=4),
        ((2, 4, 8, 8),),
        # 2*2*4*64*(4/4)*9 = 9216; out (2,4,16,16): bias 2048; the weight gradient crops the
        # output_padding row and column
        flops=9216 + 2048,
        aten=("aten.convolution.default", "aten.constant_pad_nd.default"),
    ),
    OpCase(
        "conv_transpose2d_groups3",
        lambda: nn.ConvTranspose2d(6, 6, 2, stride=2, groups=3),
        ((2, 6, 8, 8),),
        flops=2 * 2 * 6 * 64 * 2 * 4 + 3072,  # 12288; out (2,6,16,16): bias 3072
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose2d_k4s2p1",
        lambda: nn.ConvTranspose2d(4, 6, 4, stride=2, padding=1),
        ((2, 4, 8, 8),),
        flops=2 * 2 * 4 * 64 * 6 * 16 + 3072,  # 98304; out (2,6,16,16): bias 3072
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose2d_dilation2",
        lambda: nn.ConvTranspose2d(2, 2, 3, dilation=2),
        ((1, 2, 4, 4),),
        # out (4-1) + 2*(3-1) + 1 = 8: 2*1*2*16*2*9 = 1152; bias 1*2*64 = 128
        flops=1152 + 128,
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose1d_outpad",
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, output_padding=1),
        ((2, 2, 5),),
        # out (5-1)*2 + 3 + 1 = 12: 2*2*2*5*3*3 = 360; bias 2*3*12 = 72
        flops=360 + 72,
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv_transpose3d",
        lambda: nn.ConvTranspose3d(2, 2, 2, stride=2),
        ((1, 2, 2, 2, 2),),
        flops=2 * 1 * 2 * 8 * 2 * 8 + 2 * 64,  # 512; out (1,2,4,4,4): bias 128
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv1d_pad1",
        lambda: nn.Conv1d(6, 6, 3, padding=1),
        ((1, 6, 8),),
        flops=2 * 1 * 6 * 8 * 6 * 3 + 6 * 8,  # table case 10 in small: 1728 + 48
        aten=("aten.convolution.default",),
    ),
    OpCase(
        "conv3d_groups_stride",
        lambda: nn.Conv3d(4, 4, 3, stride=2, padding=1, groups=2),
        ((1, 4, 5, 5, 5),),
        # out (1,4,3,3,3): 2*1*4*27*(4/2)*27 = 11664; bias 108
        flops=11664 + 108,
        aten=("aten.convolution.default",),
    ),
]
