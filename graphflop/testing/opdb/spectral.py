"""Op-database cases: the FFT family (``_fft_r2c``, ``_fft_c2r``, ``_fft_c2c`` after tracing).
FLOPs by hand in each comment (docs/flops_conventions.md): 5·N·log2 N per complex transform of N
points, 2.5·N·log2 N per real one (r2c, c2r), times the number of transforms, rounded over the
node; complex elementwise ops 1 per output element. The input x is (2, 8) (two signals of 8) times a
weight w of 8, unless a case says otherwise; its loss weighs the output by a readout r."""

from __future__ import annotations

import torch

from graphflop.testing.opdb.core import OpCase, module_of

_W = {"w": (8,)}

SPECTRAL = [
    OpCase(
        "rfft_abs",
        module_of(lambda s, x: torch.fft.rfft(x * s.w).abs() * s.r, _W, {"r": (2, 5)}),
        ((2, 8),),
        flops=16 + 120 + 10 + 10,  # mul; r2c 2.5·16·log2 8 = 120; |z| 2·5; readout
        aten=("aten._fft_r2c.default", "aten.abs.default", "aten._fft_c2c.default"),
    ),
    OpCase(
        "rfft_filter_irfft",
        module_of(
            lambda s, x: torch.fft.irfft(torch.fft.rfft(x * s.w) * s.g, n=8) * s.r,
            {"w": (8,), "g": (5,)},
            {"r": (2, 8)},
        ),
        ((2, 8),),
        # mul 16; r2c 120; × real filter g 10; c2r 2.5·16·3 = 120; readout 16
        flops=16 + 120 + 10 + 120 + 16,
        aten=("aten._fft_r2c.default", "aten._fft_c2r.default", "aten.cat.default"),
    ),
    OpCase(
        "irfft_odd",
        module_of(
            lambda s, x: torch.fft.irfft(torch.fft.rfft(x * s.w), n=7) * s.r,
            {"w": (7,)},
            {"r": (2, 7)},
        ),
        ((2, 7),),
        # mul 14; r2c 2.5·14·log2 7 = 98.26 -> 98; c2r the same 98; readout 14
        flops=14 + 98 + 98 + 14,
        aten=("aten._fft_r2c.default", "aten._fft_c2r.default", "aten.constant_pad_nd.default"),
    ),
    OpCase(
        "fft_ifft_real",
        module_of(
            lambda s, x: torch.fft.ifft(torch.fft.fft(x * s.w) * s.g).real * s.r,
            {"w": (8,), "g": (8,)},
            {"r": (2, 8)},
        ),
        ((2, 8),),
        # mul 16; fft of a real input = two-sided r2c 2.5·16·3 = 120; × g 16;
        # ifft c2c 5·16·3 = 240; .real 0; readout 16
        flops=16 + 120 + 16 + 240 + 16,
        aten=("aten._fft_r2c.default", "aten._fft_c2c.default", "aten.view_as_real.default"),
    ),
    OpCase(
        "fft2_imag",
        module_of(lambda s, x: torch.fft.fft2(x * s.w).imag * s.r, _W, {"r": (2, 8)}),
        ((2, 8),),
        # mul 16; cast to complex 0; c2c over both dims, N = 16: 5·16·log2 16 = 320; readout 16
        flops=16 + 320 + 16,
        aten=("aten._fft_c2c.default", "aten._to_copy.default"),
        # its backward graph (c2c of a real-part cotangent made complex) exports to ONNX
    ),
    OpCase(
        "rfftn_ortho",
        module_of(
            lambda s, x: torch.fft.rfftn(x * s.w, norm="ortho").abs() * s.r, _W, {"r": (2, 5)}
        ),
        ((2, 8),),
        # mul 16; r2c over both dims, N = 16: 2.5·16·4 = 160 (scaling not counted); |z| 10;
        # readout 10
        flops=16 + 160 + 10 + 10,
        aten=("aten._fft_r2c.default",),
    ),
]

SPECTRAL += [
    OpCase(
        "complex_mul_conj",
        module_of(
            lambda s, x: (
                torch.view_as_real(torch.conj_physical(torch.fft.rfft(x * s.w)) * torch.fft.rfft(x))
                * s.r
            ),
            _W,
            {"r": (2, 5, 2)},
        ),
        ((2, 8),),
        # mul 16; two r2c of 16 elements, 120 each; conj 10; complex product 10; view 0;
        # readout 20
        flops=16 + 120 + 120 + 10 + 10 + 20,
        aten=(
            "aten._conj_physical.default",
            "aten.conj_physical.default",
            "aten.view_as_real.default",
        ),
    ),
    OpCase(
        "view_as_complex_ifft",
        module_of(
            lambda s, x: torch.fft.ifft(torch.view_as_complex(x * s.w)).abs() * s.r,
            {"w": (8, 2)},
            {"r": (2, 8)},
        ),
        ((2, 8, 2),),
        # mul 32; c2c of 16 points in 2 signals of 8: 5·16·3 = 240; |z| 16; readout 16
        flops=32 + 240 + 16 + 16,
        aten=("aten.view_as_complex.default", "aten._fft_c2c.default"),
    ),
]

SPECTRAL += [
    OpCase(
        "complex_parts",
        module_of(
            lambda s, x: torch.view_as_real(torch.complex(x * s.w, x * s.v)) * s.r,
            {"w": (8,), "v": (8,)},
            {"r": (2, 8, 2)},
        ),
        ((2, 8),),
        # two muls 16 each; complex(re, im) a copy 0; view 0; readout 2·8·2 = 32
        flops=16 + 16 + 32,
        aten=("aten.complex.default", "aten.select.int"),
        # its backward (the real and imaginary parts of a cotangent) exports to ONNX
    ),
    OpCase(
        "complex_learnable_filter",
        module_of(
            lambda s, x: torch.fft.ifft(torch.fft.fft(x) * torch.complex(s.a, s.b)).real * s.r,
            {"a": (8,), "b": (8,)},
            {"r": (2, 8)},
        ),
        ((2, 8),),
        # fft of a real input: two-sided r2c 2.5·16·log2 8 = 120; complex(a, b) 0; complex
        # product 16; ifft c2c 5·16·3 = 240; .real 0; readout 16
        flops=120 + 16 + 240 + 16,
        aten=("aten.complex.default", "aten._fft_c2c.default"),
    ),
    OpCase(
        "conj_view",
        module_of(
            lambda s, x: torch.view_as_real(torch.fft.fft(x * s.w).conj() * s.g) * s.r,
            {"w": (8,), "g": (8,)},
            {"r": (2, 8, 2)},
        ),
        ((2, 8),),
        # mul 16; fft of a real input 120; .conj() (_conj) 16; × real g 16; view 0; readout 32
        flops=16 + 120 + 16 + 16 + 32,
        aten=("aten._conj.default",),
    ),
]
