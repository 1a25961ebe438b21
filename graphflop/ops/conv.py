"""Convolutions (1-, 2-, 3-D; grouped, dilated, transposed) as ``aten.convolution``.

Cost (docs/flops_conventions.md): a convolution N×Cin×S → N×Cout×O with kernel k and G groups costs
2·N·Cout·∏O·(Cin/G)·∏k FLOPs (all ``mm_flops``), plus N·Cout·∏O for a bias; a transposed one
2·N·Cin·∏S·(Cout/G)·∏k. The JVP is bilinear in input and weight, linear in the bias. The
transposes are convolutions again, so backward graphs export to ONNX: the input cotangent is a
transposed convolution, the weight cotangent a grouped convolution with batch and channels
swapped (its cost keeps the 1/G factor). For a transposed convolution the roles swap: its input
cotangent is a convolution with the same weight, its weight cotangent the weight gradient of that
convolution; both cost what the forward costs.
"""

from __future__ import annotations

import math

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import shape
from graphflop.ops.registry import def_jvp, def_transpose, register

aten = torch.ops.aten
F = "conv"


def conv_flops(x_shape, w_shape, out_shape, transposed: bool) -> int:
    """Multiply-add FLOPs of a convolution (bias excluded).

    Shapes: x (N, Cin, *S), w (Cout, Cin/G, *k) or, transposed, (Cin, Cout/G, *k),
    out (N, Cout, *O). Source: docs/flops_conventions.md; 2 FLOPs per multiply-add.
    """
    n = x_shape[0]
    k = math.prod(w_shape[2:])
    if transposed:
        return 2 * n * x_shape[1] * math.prod(x_shape[2:]) * w_shape[1] * k
    return 2 * n * out_shape[1] * math.prod(out_shape[2:]) * w_shape[1] * k


def _conv_cost(out, x, w, bias, stride, padding, dilation, transposed, *args, **kwargs):
    f = conv_flops(x.shape, w.shape, out.shape, bool(transposed))
    bias_adds = math.prod(out.shape) if bias is not None else 0
    return NodeCost(flops=f + bias_adds, mm_flops=f)


register(aten.convolution.default, F, _conv_cost)


def _conv_args(args):
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
    return (
        x,
        w,
        bias,
        list(stride),
        list(padding),
        list(dilation),
        bool(transposed),
        list(output_padding),
        int(groups),
    )


@def_jvp(aten.convolution.default)
def _jvp_conv(b, out, args, tangents, kwargs):
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = _conv_args(args)
    tx, tw, tb = tangents[0], tangents[1], tangents[2]
    rest = (stride, padding, dilation, transposed, output_padding, groups)
    t1 = b.call(aten.convolution.default, tx, w, None, *rest) if tx is not None else None
    t2 = b.call(aten.convolution.default, x, tw, None, *rest) if tw is not None else None
    t = b.add(t1, t2)
    if tb is not None:
        nd = len(shape(out)) - 2
        tb = b.call(aten.view.default, tb, [1, shape(tb)[0]] + [1] * nd)
        t = b.add(t, tb)
    if t is not None and shape(t) != shape(out):
        t = b.call(aten.expand.default, t, list(shape(out)))
    return t


def _output_padding(in_sp, out_sp, w_sp, stride, padding, dilation):
    return [
        i - ((o - 1) * s - 2 * p + d * (k - 1) + 1)
        for i, o, k, s, p, d in zip(in_sp, out_sp, w_sp, stride, padding, dilation)
    ]


def _weight_grad(b, x, ct, w_shape, stride, padding, dilation, groups):
    """Weight cotangent of a (non-transposed) convolution, as one grouped convolution.

    With x (N, G·ci, *S) and ct (N, G·co, *O): X' = x as (ci, G·N, *S), W' = ct as (G·co, N, *O);
    conv(X', W', stride=dilation, dilation=stride, groups=G) gives (ci, G·co, *k), permuted to
    (G·co, ci, *k). The input is cropped so the output is exactly k: the FLOPs equal the
    forward's, 1/G factor included.
    """
    xs, cs = shape(x), shape(ct)
    n, cin = xs[0], xs[1]
    cout = cs[1]
    nd = len(xs) - 2
    ci, co = cin // groups, cout // groups
    sp = list(range(3, 3 + nd))
    if groups == 1:
        xp = b.call(aten.permute.default, x, [1, 0] + [d - 1 for d in sp])
        wp = b.call(aten.permute.default, ct, [1, 0] + [d - 1 for d in sp])
    else:
        xv = b.call(aten.view.default, x, [n, groups, ci] + list(xs[2:]))
        xp = b.call(
            aten.reshape.default,
            b.call(aten.permute.default, xv, [2, 1, 0] + sp),
            [ci, groups * n] + list(xs[2:]),
        )
        cv = b.call(aten.view.default, ct, [n, groups, co] + list(cs[2:]))
        wp = b.call(
            aten.reshape.default,
            b.call(aten.permute.default, cv, [1, 2, 0] + sp),
            [cout, n] + list(cs[2:]),
        )
    k = list(w_shape[2:])
    # crop the trailing input rows that no output position reads
    excess = [
        s_ + 2 * p - (st * (o - 1) + d * (kk - 1) + 1)
        for s_, p, st, o, d, kk in zip(xs[2:], padding, stride, cs[2:], dilation, k)
    ]
    conv_padding = list(padding)
    if any(e > 0 for e in excess):
        pad = []
        for p, e in reversed(list(zip(padding, excess))):
            pad += [p, p - e]
        xp = b.call(aten.constant_pad_nd.default, xp, pad, 0.0)
        conv_padding = [0] * nd
    gw = b.call(
        aten.convolution.default,
        xp,
        wp,
        None,
        list(dilation),
        conv_padding,
        list(stride),
        False,
        [0] * nd,
        groups,
    )
    return b.call(aten.permute.default, gw, [1, 0] + list(range(2, 2 + nd)))


@def_transpose(aten.convolution.default)
def _transpose_conv(b, ct, args, kwargs, linear):
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = _conv_args(args)
    if linear[2]:
        raise ValueError("convolution tangents carry the bias as a separate add")
    cts = [None] * 9
    xs, ws, cs = shape(x), shape(w), shape(ct)
    if transposed:
        # y = conv_transpose(x, W) is the input-gradient map of conv(·, W), so
        # <ct, y> = <conv(ct, W), x>: the input cotangent is that convolution (its output has
        # x's spatial size because output_padding < stride), the weight cotangent the weight
        # gradient of a convolution with input ct and output-gradient x (the crop in
        # _weight_grad drops the output_padding rows no input position reaches).
        if linear[0]:
            cts[0] = b.call(
                aten.convolution.default,
                ct,
                w,
                None,
                stride,
                padding,
                dilation,
                False,
                [0] * len(stride),
                groups,
            )
        if linear[1]:
            cts[1] = _weight_grad(b, ct, x, ws, stride, padding, dilation, groups)
        return cts
    if linear[0]:
        op = _output_padding(xs[2:], cs[2:], ws[2:], stride, padding, dilation)
        cts[0] = b.call(
            aten.convolution.default, ct, w, None, stride, padding, dilation, True, op, groups
        )
    if linear[1]:
        cts[1] = _weight_grad(b, x, ct, ws, stride, padding, dilation, groups)
    return cts
