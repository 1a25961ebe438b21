"""Pooling. Max pooling costs (∏k − 1) comparisons per output element, average pooling ∏k
(adds and one divide) per output element (FLOPS.md). Max pooling's tangent gathers the input
tangent at the saved indices, so its transpose is a scatter-add of those indices; average
pooling is linear and transposes to a depthwise transposed convolution with a constant kernel.
"""

from __future__ import annotations

import math

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import numel, shape
from graphflop.ops.registry import def_jvp, def_linear, register

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
    op = {2: aten.avg_pool2d.default, 3: aten.avg_pool3d.default}[nd]

    def rule(b, ct, args, kwargs, linear):
        """Average pooling is ``y = (1/d) · Σ_window x``; its transpose spreads ``ct/d`` over each
        window: a depthwise transposed convolution with a kernel of ones (the divisor folded into
        the kernel when it is the constant ∏k). Each window's divisor ``d`` is PyTorch's: the
        override, or the count of (padded, when ``count_include_pad``) input positions it covers,
        computed by sum-pooling ones. The transposed convolution runs unpadded over the whole
        padded extent; a ``constant_pad_nd`` crops the padding (and pads the trailing positions
        no window reads with zeros)."""
        x = args[0]
        xs, cs = shape(x), shape(ct)
        k, stride, padding, ceil_mode, count_include_pad, divisor = _pool_args(args, nd)
        c = math.prod(xs[: len(xs) - nd])  # channels (and batch), pooled independently
        sp_in = list(xs[len(xs) - nd:])
        constant = divisor is not None or (
            count_include_pad and not ceil_mode) or (not any(padding) and not ceil_mode)
        if constant:
            scale = 1.0 / (divisor if divisor is not None else math.prod(k))
            z = ct
        else:
            lead = [1] * (len(xs) - nd)
            ones = b.full(lead + sp_in, 1.0, x)
            if count_include_pad:  # the padding counts, positions past it do not
                pad = []
                for p in reversed(padding):
                    pad += [p, p]
                ones = b.call(aten.constant_pad_nd.default, ones, pad, 1.0)
                d = b.call(op, ones, k, stride, [0] * nd, ceil_mode, True, 1)
                for i, o in enumerate(cs[len(cs) - nd:]):  # ceil_mode may add a window here
                    if shape(d)[len(lead) + i] != o:
                        d = b.call(aten.slice.Tensor, d, len(lead) + i, 0, o)
            else:
                d = b.call(op, ones, k, stride, padding, ceil_mode, True, 1)
            z = b.call(aten.div.Tensor, ct, d)
            scale = 1.0
        z = b.call(aten.view.default, z, [1, c] + list(cs[len(cs) - nd:]))
        weight = b.full([c, 1] + k, scale, x)
        full = b.call(aten.convolution.default, z, weight, None, stride, [0] * nd, [1] * nd,
                      True, [0] * nd, c)
        crop = []
        for p, n, f in reversed(list(zip(padding, sp_in, shape(full)[2:]))):
            crop += [-p, p + n - f]
        if any(crop):
            full = b.call(aten.constant_pad_nd.default, full, crop, 0.0)
        gx = b.call(aten.view.default, full, list(xs))
        return [gx] + [None] * (len(args) - 1)

    return rule


register(aten.avg_pool3d.default, F, _avg_pool_cost(3))
def_linear(aten.avg_pool2d.default, _transpose_avg_pool(2))
def_linear(aten.avg_pool3d.default, _transpose_avg_pool(3))
