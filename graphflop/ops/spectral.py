"""The FFT family after tracing: ``_fft_r2c`` (``rfft``, ``rfftn``, and ``fft`` of a real
input), ``_fft_c2r`` (``irfft``), ``_fft_c2c`` (``fft``/``ifft``/``fft2`` of complex inputs), and
the complex views around them (``view_as_real``, ``view_as_complex``), ``complex`` (a complex
tensor from its real and imaginary parts) and the conjugates (``conj_physical``, ``_conj``).

Cost (docs/flops_conventions.md): ``5·N·log2 N`` per complex transform of N points (N the product of
the transformed dims' sizes, the signal's, not the one-sided spectrum's), half that for a real
transform (``r2c``, ``c2r``: ``2.5·N·log2 N``), times the number of transforms (the other dims),
rounded to the nearest integer over the node; outside ``mm_flops``. The normalisation's scaling
(``norm="ortho"``/``"forward"``/``"backward"``) is not counted separately. FlopCounterMode counts no
FFT.

Derivatives: every transform is linear (over the reals), so its JVP is the same transform of the
tangent; the transposes are PyTorch's backward formulas (``tools/autograd/derivatives.yaml``):
``c2c``'s is ``c2c`` in the other direction with the same normalisation; ``r2c``'s pads a
one-sided cotangent with zeros to the full length, runs ``c2c`` backwards and keeps the real
part; ``c2r``'s is a one-sided ``r2c`` with the entries that stand for a mirrored pair
(indices 1 … n − (n/2 + 1) along the last transformed dim) doubled.
"""

from __future__ import annotations

import math

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import free, numel, per_output, shape
from graphflop.ops.registry import def_linear, register

aten = torch.ops.aten
F = "spectral"


def _signal(sizes, dims) -> int:
    return math.prod(sizes[d % len(sizes)] for d in dims)


def _fft_flops(elements: int, n: int, per: float) -> int:
    """``per · N · log2 N`` per transform of ``n`` points over ``elements`` signal elements."""
    return round(per * elements * math.log2(n)) if n > 1 else 0


def _c2c_cost(out, x, dim, *args, **kwargs) -> NodeCost:
    """``5·N·log2 N`` per complex transform: ``5 · numel · log2 N``."""
    return NodeCost(flops=_fft_flops(numel(x), _signal(tuple(x.shape), dim), 5.0))


def _r2c_cost(out, x, dim, *args, **kwargs) -> NodeCost:
    """A real input's transform, half a complex one: ``2.5 · numel(x) · log2 N``."""
    return NodeCost(flops=_fft_flops(numel(x), _signal(tuple(x.shape), dim), 2.5))


def _c2r_cost(out, x, dim, *args, **kwargs) -> NodeCost:
    """A real output's transform (N from the output's sizes): ``2.5 · numel(out) · log2 N``."""
    return NodeCost(flops=_fft_flops(numel(out), _signal(tuple(out.shape), dim), 2.5))


register(aten._fft_c2c.default, F, _c2c_cost)
register(aten._fft_r2c.default, F, _r2c_cost)
register(aten._fft_c2r.default, F, _c2r_cost)
register(aten.view_as_real.default, F, free, bytes="view")
register(aten.view_as_complex.default, F, free, bytes="view")
#: complex conjugate (1 FLOP per element: the imaginary part's negation); emitted by the
#: transposes of products with a complex coefficient (ops/elementwise.py)
for _op in (aten.conj_physical.default, aten._conj_physical.default):
    register(_op, F, per_output(1))
#: ``.conj()`` of a complex tensor: PyTorch sets a conjugate bit on a view and negates the
#: imaginary part when something reads it; the value is conj_physical's, counted as it (1 per
#: element) so a model counts the same whichever form it uses
register(aten._conj.default, F, per_output(1))
#: ``torch.complex(re, im)``: a copy of the two real tensors into one complex tensor (0 FLOPs)
register(aten.complex.default, F, free)


def _real_part(b, z):
    """The real part of complex ``z`` (``view_as_real`` and a ``select``, as ``z.real``
    traces)."""
    return b.call(aten.select.int, b.call(aten.view_as_real.default, z), -1, 0)


def _imag_part(b, z):
    """The imaginary part of complex ``z`` (``view_as_real`` and a ``select``)."""
    return b.call(aten.select.int, b.call(aten.view_as_real.default, z), -1, 1)


def _transpose_complex(b, ct, args, kwargs, linear):
    """``complex(re, im) = re + i·im`` is linear in ``(re, im)`` over the reals: the cotangent
    of ``re`` is ``ct``'s real part, that of ``im`` its imaginary part (PyTorch's
    ``at::real(grad)``, ``at::imag(grad)``)."""
    return [
        _real_part(b, ct) if linear[0] else None,
        _imag_part(b, ct) if linear[1] else None,
    ]


def _transpose_c2c(b, ct, args, kwargs, linear):
    x, dim, normalization, forward = args[:4]
    return [b.call(aten._fft_c2c.default, ct, dim, normalization, not forward), None, None, None]


def _transpose_r2c(b, ct, args, kwargs, linear):
    """PyTorch's ``fft_r2c_backward``: zero-pad a one-sided cotangent to the input's length
    along the last transformed dim, ``c2c`` backwards, real part."""
    x, dim, normalization, onesided = args[:4]
    xs, cs = shape(x), shape(ct)
    last = dim[-1] % len(xs)
    missing = xs[last] - cs[last]
    if onesided and missing > 0:
        pad = [0, 0] * (len(xs) - 1 - last) + [0, missing]
        ct = b.call(aten.constant_pad_nd.default, ct, pad, 0.0)
    full = b.call(aten._fft_c2c.default, ct, dim, normalization, False)
    return [_real_part(b, full), None, None, None]


def _transpose_c2r(b, ct, args, kwargs, linear):
    """PyTorch's ``fft_c2r_backward``: one-sided ``r2c`` of the cotangent, the entries 1 …
    n − half along the last transformed dim doubled (each stands for itself and its mirror)."""
    x, dim, normalization = args[:3]
    g = b.call(aten._fft_r2c.default, ct, dim, normalization, True)
    last = dim[-1] % len(shape(ct))
    half = shape(g)[last]
    doubled = shape(ct)[last] - half
    if doubled > 0:
        parts = [
            b.call(aten.slice.Tensor, g, last, 0, 1),
            b.call(aten.mul.Tensor, b.call(aten.slice.Tensor, g, last, 1, 1 + doubled), 2.0),
        ]
        if 1 + doubled < half:
            parts.append(b.call(aten.slice.Tensor, g, last, 1 + doubled, half))
        g = b.call(aten.cat.default, parts, last)
    return [g, None, None, None]


def _transpose_view_as_real(b, ct, args, kwargs, linear):
    """PyTorch's ``view_as_complex(grad.contiguous())``: a cotangent transposed on its way
    back (a RoPE's ``view_as_real(c).transpose(1, 2)``) is copied into row-major order first,
    which ``view_as_complex`` needs (a last dim of stride 1)."""
    dense = b.call(aten.clone.default, ct, memory_format=torch.contiguous_format)
    return [b.call(aten.view_as_complex.default, dense)]


def _transpose_view_as_complex(b, ct, args, kwargs, linear):
    return [b.call(aten.view_as_real.default, ct)]


def_linear(aten._fft_c2c.default, _transpose_c2c)
def_linear(aten._fft_r2c.default, _transpose_r2c)
def_linear(aten._fft_c2r.default, _transpose_c2r)
def_linear(aten.view_as_real.default, _transpose_view_as_real)
def_linear(aten.view_as_complex.default, _transpose_view_as_complex)


def _transpose_conj(b, ct, args, kwargs, linear):
    """Conjugation is its own transpose (over the reals it negates the imaginary part)."""
    return [b.call(aten.conj_physical.default, ct)]


for _op in (aten.conj_physical.default, aten._conj_physical.default, aten._conj.default):
    def_linear(_op, _transpose_conj)
def_linear(aten.complex.default, _transpose_complex)
