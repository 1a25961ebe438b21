"""Pooling. Max pooling costs (∏k − 1) comparisons per output element, average pooling ∏k
(adds and one divide) per output element (docs/flops_conventions.md). Max pooling's tangent gathers
the input tangent at the saved indices, so its transpose is a scatter-add of those indices; average
pooling (2-D and 3-D; 1-D decomposes to 2-D) is linear: its transpose copies each scaled output
gradient over its window and sums them back with ``col2im`` (pooling-class FLOPs, never matrix
FLOPs; 3-D as two ``col2im`` over pairs of dims), dividing by each window's own divisor first where
PyTorch's differs between windows (``ceil_mode``, ``count_include_pad=False``). ``col2im`` and
``im2col`` (``fold``/``unfold``) are linear and transpose to each other. Adaptive average pooling is
traced as a mean or an ``avg_pool2d`` where it can be (decomposition at the end).
"""

from __future__ import annotations

import math

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import bind, device, dtype, first_tensor, numel, shape, value
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


def _adaptive_windows(n_in: int, n_out: int) -> list[int]:
    """Window lengths of adaptive pooling along one dim: output ``i`` reads
    ``[⌊i·n_in/n_out⌋, ⌈(i+1)·n_in/n_out⌉)`` (ATen's ``start_index``/``end_index``)."""
    return [-((-(i + 1) * n_in) // n_out) - (i * n_in) // n_out for i in range(n_out)]


def _adaptive_max_pool_cost(nd):
    def cost(out, x, output_size, *args, **kwargs):
        """(window size − 1) comparisons per output element (docs/flops_conventions.md's max
        pooling), each window's size from the adaptive bounds, times the leading (batch, channel)
        planes."""
        xs = tuple(x.shape)
        lead = math.prod(xs[: len(xs) - nd])
        per_dim = [
            _adaptive_windows(n, o) for n, o in zip(xs[len(xs) - nd :], tuple(out[0].shape)[-nd:])
        ]
        total = 1
        count = 1
        for w in per_dim:  # Σ over windows of ∏ lengths = ∏ over dims of Σ lengths
            total *= sum(w)
            count *= len(w)
        return NodeCost(flops=lead * (total - count))

    return cost


register(aten.adaptive_max_pool2d.default, F, _adaptive_max_pool_cost(2))
register(aten.adaptive_max_pool3d.default, F, _adaptive_max_pool_cost(3))
def_jvp(aten.adaptive_max_pool2d.default)(_jvp_max_pool(2))
def_jvp(aten.adaptive_max_pool3d.default)(_jvp_max_pool(3))


def _pool_args(op, args, kwargs, nd):
    """Average pooling's window, by schema name; an empty ``stride`` (the default) is the
    kernel, and one-element sizes apply to every pooled dim."""
    a = bind(op, args, kwargs)
    k = _kernel((a.self, a.kernel_size), nd)
    stride = list(a.stride) or k
    stride = stride * nd if len(stride) == 1 else stride
    padding = list(a.padding)
    padding = padding * nd if len(padding) == 1 else padding
    return k, stride, padding, bool(a.ceil_mode), bool(a.count_include_pad), a.divisor_override


def _transpose_avg_pool(op, nd):
    def rule(b, ct, args, kwargs, linear):
        """Average pooling is ``y = (1/d) · Σ_window x``; its transpose spreads ``ct/d`` over each
        window. Each window's divisor ``d`` is PyTorch's: the override, or the count of (padded,
        when ``count_include_pad``) input positions it covers (:func:`_window_counts`).

        2-D: scale ``ct`` by ``1/d`` (1 FLOP per output-gradient element), copy each value to its
        window's ∏k positions (expand, a copy) and sum the overlapping windows back into place
        with ``col2im`` (1 add per value it places, docs/flops_conventions.md's scatter convention):
        ∏k + 1 FLOPs per output-gradient element, none of them matrix FLOPs, as PyTorch's own
        ``avg_pool2d_backward`` (which ONNX cannot export) spends them. 3-D (``col2im`` is 2-D
        only): the same scale, then the window spread one pair of dims at a time
        (:func:`_spread_3d`): 1 + kD·kH FLOPs per output-gradient element plus kW per element of the
        (D, H)-spread planes (c·eD·eH·oW·kW; for windows that tile the input, k = s and no padding:
        1 + kD·kH + ∏k per output-gradient element), no matrix FLOPs. Both run unpadded over the
        whole padded extent; a ``constant_pad_nd`` crops the padding (and pads the trailing
        positions no window reads with zeros)."""
        x = args[0]
        xs, cs = shape(x), shape(ct)
        k, stride, padding, ceil_mode, count_include_pad, divisor = _pool_args(op, args, kwargs, nd)
        c = math.prod(xs[: len(xs) - nd])  # channels (and batch), pooled independently
        sp_in, sp_out = list(xs[len(xs) - nd :]), list(cs[len(cs) - nd :])
        constant = (
            divisor is not None
            or (count_include_pad and not ceil_mode)
            or (not any(padding) and not ceil_mode)
        )
        if constant:
            scale = 1.0 / (divisor if divisor is not None else math.prod(k))
            z = b.call(aten.mul.Tensor, ct, scale)
        else:
            d = _window_counts(b, x, xs, sp_out, k, stride, padding, count_include_pad)
            z, scale = b.call(aten.div.Tensor, ct, d), 1.0
        if not value(z).is_contiguous():
            # a cotangent laid out unlike the output (the pooled map flattened to tokens and
            # transposed, as in EfficientFormer) cannot be viewed as windows: copied contiguous
            # first (an explicit clone, whose bytes the cost model counts), as reshape would
            z = b.call(aten.clone.default, z, memory_format=torch.contiguous_format)
        extent = [(o - 1) * s_ + kk for o, s_, kk in zip(sp_out, stride, k)]
        if nd == 2:
            full = _spread_2d(b, z, c, k, stride, sp_out, extent)
        else:
            full = _spread_3d(b, z, c, k, stride, sp_out, extent)
        crop = []
        for p, n, f in reversed(list(zip(padding, sp_in, extent))):
            crop += [-p, p + n - f]
        if any(crop):
            full = b.call(aten.constant_pad_nd.default, full, crop, 0.0)
        gx = b.call(aten.view.default, full, list(xs))
        return [gx] + [None] * (len(args) - 1)

    return rule


def _spread_2d(b, z, c, k, stride, sp_out, extent):
    """Every value of ``z`` (``c`` planes of ``sp_out``) added over its ``k`` window in a
    ``[1, c, *extent]`` tensor, windows ``stride`` apart: ``col2im`` of the values copied ∏k
    times (its column layout is ``[1, c·∏k, L]``, channel-major)."""
    kk, L = math.prod(k), math.prod(sp_out)
    cols = b.call(aten.view.default, z, [1, c, 1, L])
    cols = b.call(aten.expand.default, cols, [1, c, kk, L])
    cols = b.call(aten.clone.default, cols)
    cols = b.call(aten.view.default, cols, [1, c * kk, L])
    return b.call(aten.col2im.default, cols, extent, k, [1, 1], [0, 0], stride)


def _spread_3d(b, z, c, k, stride, sp_out, extent):
    """:func:`_spread_2d` in 3-D, one pair of dims at a time (a box window is separable): over
    (D, H) with W folded into the planes (``col2im`` of N·kD·kH values, N = ``z``'s element
    count), then over W with (D, H) folded in (``col2im`` of c·eD·eH·oW·kW values, ``e`` the
    extent). Returns ``[1, c, *extent]``."""
    (od, oh, ow), (ed, eh, ew) = sp_out, extent
    z = b.call(aten.permute.default, b.call(aten.view.default, z, [c, od, oh, ow]), [0, 3, 1, 2])
    z = b.call(aten.reshape.default, z, [c * ow, od, oh])
    dh = _spread_2d(b, z, c * ow, k[:2], stride[:2], [od, oh], [ed, eh])  # [1, c·oW, eD, eH]
    dh = b.call(aten.permute.default, b.call(aten.view.default, dh, [c, ow, ed, eh]), [0, 2, 3, 1])
    dh = b.call(aten.reshape.default, dh, [c * ed * eh, ow, 1])
    full = _spread_2d(b, dh, c * ed * eh, [k[2], 1], [stride[2], 1], [ow, 1], [ew, 1])
    return b.call(aten.view.default, full, [1, c, ed, eh, ew])


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
def_linear(aten.avg_pool2d.default, _transpose_avg_pool(aten.avg_pool2d.default, 2))
def_linear(aten.avg_pool3d.default, _transpose_avg_pool(aten.avg_pool3d.default, 3))


# --- 3-D adaptive average pooling (kept whole) --------------------------------------------------


def _adaptive_avg_pool3d_cost(out, x, *args, **kwargs):
    """Each output element sums its window and divides once: its window's volume in FLOPs (as
    ``avg_pool3d``'s ∏k, and 2-D adaptive pooling's decompositions), summed over the output:
    N·C·∏_d Σ_j len_j(d)."""
    xs, os_ = shape(x), shape(first_tensor(out))
    lead = math.prod(xs[:-3])
    return NodeCost(
        flops=lead * math.prod(sum(_adaptive_windows(n, o)) for n, o in zip(xs[-3:], os_[-3:]))
    )


def _adaptive_spread(b, ct, dim: int, n: int, o: int):
    """The transpose of adaptive average pooling along one dim (``o`` windows over ``n``):
    each cotangent element divided by its window's length, copied to its window's positions and
    summed into place with ``index_add`` (overlapping windows add). The windows' bounds come
    from ``arange`` as the forward's: start_j = ⌊j·n/o⌋, end_j = ⌊((j+1)·n + o − 1)/o⌋; the
    widest window's length L is fixed by the shapes, and the positions a shorter window does
    not reach are zeroed before the sum."""
    cs = list(shape(ct))
    rank = len(cs)
    lens = _adaptive_windows(n, o)
    width = max(lens)
    idx64 = {"dtype": torch.int64, "device": device(ct)}
    j = b.call(aten.arange.default, o, **idx64)
    start = b.call(aten.div.Tensor_mode, b.call(aten.mul.Scalar, j, n), o, rounding_mode="floor")
    end_num = b.call(aten.add.Scalar, b.call(aten.mul.Scalar, j, n), n + o - 1)
    end = b.call(aten.div.Tensor_mode, end_num, o, rounding_mode="floor")
    length = b.call(aten._to_copy.default, b.call(aten.sub.Tensor, end, start), dtype=dtype(ct))
    after = [1] * (rank - 1 - dim)
    scaled = b.call(aten.div.Tensor, ct, b.call(aten.view.default, length, [o] + after))
    # (..., o, L, ...): every window's value repeated over its L positions
    k = b.call(aten.arange.default, width, **idx64)
    pos = b.call(aten.add.Tensor, b.call(aten.unsqueeze.default, start, 1), k)
    spread_shape = list(cs[:dim]) + [o, width] + list(cs[dim + 1 :])
    vals = b.call(
        aten.expand.default, b.call(aten.unsqueeze.default, scaled, dim + 1), spread_shape
    )
    if min(lens) != width:
        inside = b.call(aten.lt.Tensor, pos, b.call(aten.unsqueeze.default, end, 1))
        mask = b.call(aten._to_copy.default, inside, dtype=dtype(ct))
        vals = b.call(aten.mul.Tensor, vals, b.call(aten.view.default, mask, [o, width] + after))
        pos = b.call(aten.clamp_max.default, pos, n - 1)
    merged = list(cs[:dim]) + [o * width] + list(cs[dim + 1 :])
    vals = b.call(aten.reshape.default, vals, merged)
    pos = b.call(aten.reshape.default, pos, [o * width])
    out_shape = list(cs[:dim]) + [n] + list(cs[dim + 1 :])
    return b.call(aten.index_add.default, b.zeros(out_shape, ct), dim, pos, vals)


def _transpose_adaptive_avg_pool3d(b, ct, args, kwargs, linear):
    """Adaptive average pooling is separable: one window average per dim (D, H, W), so its
    transpose spreads the cotangent back one dim at a time (:func:`_adaptive_spread`), in forward
    ops (ARCHITECTURE principle 4) rather than ``_adaptive_avg_pool3d_backward``."""
    xs = shape(args[0])
    rank = len(xs)
    for d in range(rank - 3, rank):
        ct = _adaptive_spread(b, ct, d, xs[d], shape(ct)[d])
    return [ct, None]


register(aten._adaptive_avg_pool3d.default, F, _adaptive_avg_pool3d_cost)
def_linear(aten._adaptive_avg_pool3d.default, _transpose_adaptive_avg_pool3d)


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
    uneven = torch_decomposition(aten._adaptive_avg_pool2d.default)
    assert uneven is not None, "PyTorch decomposes aten._adaptive_avg_pool2d"
    return uneven(x, output_size)


# --- fold / unfold (col2im / im2col) -----------------------------------------------------------


def _col2im_cost(out, cols, *args, **kwargs):
    """``col2im`` adds every column value into its place: 1 FLOP per input element
    (docs/flops_conventions.md's scatter convention, as ``scatter_add`` and ``index_add``)."""
    return NodeCost(flops=numel(cols))


def _im2col_cost(out, *args, **kwargs):
    """``im2col`` copies windows: 0 FLOPs."""
    return NodeCost(flops=0)


def _transpose_col2im(b, ct, args, kwargs, linear):
    """``col2im``'s transpose gathers each window back into columns: ``im2col``."""
    _, _, kernel, dilation, padding, stride = args[:6]
    return [b.call(aten.im2col.default, ct, kernel, dilation, padding, stride)] + [None] * (
        len(args) - 1
    )


def _transpose_im2col(b, ct, args, kwargs, linear):
    """``im2col``'s transpose sums the columns back over their windows: ``col2im``."""
    x, kernel, dilation, padding, stride = args[:5]
    out_size = list(shape(x)[-2:])
    return [b.call(aten.col2im.default, ct, out_size, kernel, dilation, padding, stride)] + [
        None
    ] * (len(args) - 1)


register(aten.col2im.default, F, _col2im_cost)
register(aten.im2col.default, F, _im2col_cost, bytes="copy")
def_linear(aten.col2im.default, _transpose_col2im)
def_linear(aten.im2col.default, _transpose_im2col)
