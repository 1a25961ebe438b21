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


def _transpose_avg_pool2d(b, ct, args, kwargs, linear):
    x = args[0]
    xs = shape(x)
    k = _kernel(args, 2)
    stride = list(args[2]) if len(args) > 2 and args[2] else k
    stride = stride * 2 if len(stride) == 1 else stride
    padding = list(args[3]) if len(args) > 3 else [0, 0]
    padding = padding * 2 if len(padding) == 1 else padding
    ceil_mode = args[4] if len(args) > 4 else False
    count_include_pad = args[5] if len(args) > 5 else True
    divisor = args[6] if len(args) > 6 else None
    if ceil_mode or (not count_include_pad and any(padding)) or divisor is not None:
        raise NotImplementedError(
            "avg_pool2d transpose with ceil_mode, count_include_pad=False or divisor_override: "
            "add it in graphflop/ops/pool.py"
        )
    c = xs[1]
    weight = b.full([c, 1] + k, 1.0 / math.prod(k), x)
    cs = shape(ct)
    op = [
        i - ((o - 1) * s - 2 * p + (kk - 1) + 1)
        for i, o, kk, s, p in zip(xs[2:], cs[2:], k, stride, padding)
    ]
    gx = b.call(aten.convolution.default, ct, weight, None, stride, padding, [1, 1], True, op, c)
    return [gx] + [None] * (len(args) - 1)


def_linear(aten.avg_pool2d.default, _transpose_avg_pool2d)
