"""Pooling. Max pooling costs (∏k − 1) comparisons per output element, average pooling ∏k
(adds and one divide) per output element (FLOPS.md). Max pooling's tangent gathers the input
tangent at the saved indices, so its transpose is a scatter-add of those indices; average
pooling (2-D and 3-D; 1-D decomposes to 2-D) is linear and transposes to a depthwise transposed
convolution with a constant kernel, dividing by each window's own divisor first where PyTorch's
differs between windows (``ceil_mode``, ``count_include_pad=False``). Adaptive average pooling
is traced as a mean or an ``avg_pool2d`` where it can be (decomposition at the end).
"""

from __future__ import annotations

import math

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import device, dtype, numel, shape
from graphflop.ops.registry import (
    def_jvp,
    def_linear,
    register,
    register_decomposition,
    torch_decomposition,
)

aten = torch.ops.aten
F = "pool"


def _kernel(args, nd):
    k = list(args[1])
    return k * nd if len(k) == 1 else k


def _max_pool_cost(nd):
    def cost(out, x, kernel_size, *args, **kwargs):
        k = math.prod(_kernel((x, kernel_size), nd))
        return NodeCost(flops=(k - 1) * numel(out[0]))

    return cost


def _avg_pool_cost(nd):
    def cost(out, x, kernel_size, *args, **kwargs):
        k = math.prod(_kernel((x, kernel_size), nd))
        return NodeCost(flops=k * numel(out))

    return cost


register(aten.max_pool2d_with_indices.default, F, _max_pool_cost(2))
register(aten.max_pool3d_with_indices.default, F, _max_pool_cost(3))
register(aten.avg_pool2d.default, F, _avg_pool_cost(2))
register(aten.avg_pool1d.default, F, _avg_pool_cost(1))


def _jvp_max_pool(nd):
    return lambda b, out, args, tangents, kwargs: _max_pool_tangent(b, out, args, tangents, nd)


def _max_pool_tangent(b, out, args, tangents, nd):
    """Tangent of the pooled values: the input tangent gathered at the argmax indices."""
    tx = tangents[0]
    xs = shape(args[0])
    idx = b.getitem(out, 1)
    os_ = shape(idx)
    lead = list(xs[: len(xs) - nd])
    flat_t = b.call(aten.view.default, tx, lead + [-1])
    flat_i = b.call(aten.view.default, idx, lead + [-1])
    g = b.call(aten.gather.default, flat_t, len(lead), flat_i)
    return (b.call(aten.view.default, g, list(os_)), None)


def_jvp(aten.max_pool2d_with_indices.default)(_jvp_max_pool(2))
def_jvp(aten.max_pool3d_with_indices.default)(_jvp_max_pool(3))


def _pool_args(args, nd):
    k = _kernel(args, nd)
    stride = list(args[2]) if len(args) > 2 and args[2] else k
    stride = stride * nd if len(stride) == 1 else stride
    padding = list(args[3]) if len(args) > 3 else [0] * nd
    padding = padding * nd if len(padding) == 1 else padding
    ceil_mode = bool(args[4]) if len(args) > 4 else False
    count_include_pad = bool(args[5]) if len(args) > 5 else True
    divisor = args[6] if len(args) > 6 else None
    return k, stride, padding, ceil_mode, count_include_pad, divisor


def _transpose_avg_pool(nd):
    def rule(b, ct, args, kwargs, linear):
        """Average pooling is ``y = (1/d) · Σ_window x``; its transpose spreads ``ct/d`` over each
        window: a depthwise transposed convolution with a kernel of ones (the divisor folded into
        the kernel when it is the constant ∏k). Each window's divisor ``d`` is PyTorch's: the
        override, or the count of (padded, when ``count_include_pad``) input positions it covers
        (:func:`_window_counts`). The transposed convolution runs unpadded over the whole padded
        extent; a ``constant_pad_nd`` crops the padding (and pads the trailing positions no
        window reads with zeros)."""
        x = args[0]
        xs, cs = shape(x), shape(ct)
        k, stride, padding, ceil_mode, count_include_pad, divisor = _pool_args(args, nd)
        c = math.prod(xs[: len(xs) - nd])  # channels (and batch), pooled independently
        sp_in = list(xs[len(xs) - nd :])
        constant = (
            divisor is not None
            or (count_include_pad and not ceil_mode)
            or (not any(padding) and not ceil_mode)
        )
        if constant:
            scale = 1.0 / (divisor if divisor is not None else math.prod(k))
            z = ct
        else:
            d = _window_counts(
                b, x, xs, list(cs[len(cs) - nd :]), k, stride, padding, count_include_pad
            )
            z = b.call(aten.div.Tensor, ct, d)
            scale = 1.0
        z = b.call(aten.view.default, z, [1, c] + list(cs[len(cs) - nd :]))
        weight = b.full([c, 1] + k, scale, x)
        full = b.call(
            aten.convolution.default, z, weight, None, stride, [0] * nd, [1] * nd, True, [0] * nd, c
        )
        crop = []
        for p, n, f in reversed(list(zip(padding, sp_in, shape(full)[2:]))):
            crop += [-p, p + n - f]
        if any(crop):
            full = b.call(aten.constant_pad_nd.default, full, crop, 0.0)
        gx = b.call(aten.view.default, full, list(xs))
        return [gx] + [None] * (len(args) - 1)

    return rule


def _window_counts(b, x, xs, out_sp, k, stride, padding, count_include_pad):
    """PyTorch's average-pooling divisor of every window, as a product of per-dim counts:
    window ``o`` spans ``[o·s − p, o·s − p + k)``, clipped to ``[−p, n + p)`` when the padding
    counts and to ``[0, n)`` when it does not (ATen's ``avg_pool2d`` kernel). Built from
    ``arange`` and elementwise ops, which every runtime has (ONNX's AveragePool has no divisor
    override)."""
    nd = len(out_sp)
    d = None
    for i, (o, kk, s_, p, n) in enumerate(zip(out_sp, k, stride, padding, xs[len(xs) - nd :])):
        start = b.call(
            aten.sub.Tensor,
            b.call(
                aten.mul.Tensor,
                b.call(aten.arange.start_step, 0, o, 1, dtype=dtype(x), device=device(x)),
                s_,
            ),
            p,
        )
        end = b.call(aten.add.Tensor, start, kk)
        if count_include_pad:
            cnt = b.call(aten.sub.Tensor, b.call(aten.clamp_max.default, end, n + p), start)
        else:
            cnt = b.call(
                aten.sub.Tensor,
                b.call(aten.clamp_max.default, end, n),
                b.call(aten.clamp_min.default, start, 0),
            )
        view = [1] * len(xs)
        view[len(xs) - nd + i] = o
        cnt = b.call(aten.view.default, cnt, view)
        d = cnt if d is None else b.call(aten.mul.Tensor, d, cnt)
    return d


register(aten.avg_pool3d.default, F, _avg_pool_cost(3))
def_linear(aten.avg_pool2d.default, _transpose_avg_pool(2))
def_linear(aten.avg_pool3d.default, _transpose_avg_pool(3))


# --- decompositions ----------------------------------------------------------------------------


@register_decomposition(aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(x, output_size):
    """``_adaptive_avg_pool2d``: a mean over H, W for a 1×1 output, an ``avg_pool2d`` with
    kernel = stride = input/output when the output divides the input, else PyTorch's
    decomposition (index arithmetic for uneven windows; PyTorch's restrides a channels-last
    result with ``as_strided``, which has no rule)."""
    h, w = x.shape[-2], x.shape[-1]
    oh, ow = output_size
    if oh == 1 and ow == 1:
        return aten.mean.dim(x, [-2, -1], True)
    if h % oh == 0 and w % ow == 0:
        k = [h // oh, w // ow]
        return aten.avg_pool2d.default(x, k, k)
    return torch_decomposition(aten._adaptive_avg_pool2d.default)(x, output_size)
