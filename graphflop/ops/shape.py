"""Views, copies and index ops: 0 FLOPs. Views move no bytes; copies read and write their bytes
(docs/flops_conventions.md). All are linear; their transposes are other shape ops: ``scatter_add``
for ``gather``, ``index_add`` for ``index_select``, ``index_put(accumulate=True)`` for advanced
indexing (``index``: upsampling, reflection and replication padding, uneven adaptive pooling
decompose to it, and ``as_strided``'s tangent is an indexing: its windows may overlap), one
concatenation of the pieces' cotangents for ``split_with_sizes`` (``chunk``, ``split``, and
``unbind``, traced as a split), a flip for ``flip``, a sum over the tiles for ``repeat``.
``index_put`` and ``index_add`` with accumulation cost 1 FLOP per added element. A masked write
(``index_put`` with a boolean mask, ``masked_scatter``) sends its value the cotangent at the
mask's set elements without the data-dependent count of them: a select, then a sum or a
scatter-add at each set element's rank (:func:`_masked_values_cotangent`). In-place views
on temporaries and upsampling are traced as functional views and index ops (decompositions at
the end). Antialiased resizing (``_upsample_bilinear2d_aa``, ``_upsample_bicubic2d_aa``) is kept
whole, 2 FLOPs per filter tap (:func:`_aa_cost`), its transpose PyTorch's backward kernel."""

from __future__ import annotations

import operator
from typing import Any

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import bind, dtype, free, norm_dims, numel, shape, value
from graphflop.ops.registry import (
    MissingRuleError,
    def_jvp,
    def_linear,
    def_transpose,
    def_zero,
    keep_in_graph,
    register,
    register_decomposition,
    update,
    use_torch_decomposition,
)

aten = torch.ops.aten
F = "shape"

VIEWS = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
    aten.alias.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.t.default,
    aten.transpose.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.detach.default,
    aten.lift_fresh_copy.default,
    aten.diagonal.default,
)
COPIES = (
    aten.clone.default,
    aten._to_copy.default,
    aten.cat.default,
    aten.constant_pad_nd.default,
    aten.slice_scatter.default,
    aten.select_scatter.default,
    aten.diagonal_scatter.default,
    aten.copy.default,
    aten.stack.default,
    aten.repeat.default,
)
#: lookups read the rows they gather (and the indices), not the whole source
#: (docs/flops_conventions.md)
GATHERS = (aten.index_select.default, aten.gather.default)
for _op in VIEWS:
    register(_op, F, free, bytes="view")
for _op in COPIES:
    register(_op, F, free, bytes="copy")
for _op in GATHERS:
    register(_op, F, free, bytes="gather")


def _per_src(out, self, dim, index, src, *args, **kwargs) -> NodeCost:
    return NodeCost(flops=numel(src))


register(aten.scatter_add.default, F, _per_src)
register(
    aten.index_add.default,
    F,
    lambda out, self, dim, index, src, *a, **k: NodeCost(flops=numel(src)),
)
def_zero(aten.detach.default)
keep_in_graph(aten.detach.default)  # a stop-gradient, not the alias core ATen makes of it
def_zero(aten.lift_fresh_copy.default)


def _reshape_back(b, ct, args, kwargs, linear):
    return [b.call(aten.reshape.default, ct, list(shape(args[0])))] + [None] * (len(args) - 1)


for _op in (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
):
    def_linear(_op, _reshape_back)


def _jvp_strict_view(op):
    """JVP of ``view``/``_unsafe_view``: the same view of the tangent. A tangent laid out unlike
    its primal (a residual sum of a transposed attention output, ``batch_first`` attention) may
    not be viewable as the primal was, so unless it has the primal's strides or is contiguous it
    is first copied contiguous (an explicit ``clone``, whose bytes the cost model counts), as
    ``reshape`` would copy it."""

    def jvp(b, out, args, tangents, kwargs):
        t = tangents[0]
        if t is None:
            return None
        tv = value(t)
        if tv.stride() != value(args[0]).stride() and not tv.is_contiguous():
            t = b.call(aten.clone.default, t, memory_format=torch.contiguous_format)
        return b.call(op, t, *args[1:], **kwargs)

    return jvp


for _op in (aten.view.default, aten._unsafe_view.default):
    update(_op, jvp=_jvp_strict_view(_op))


def _transpose_permute(b, ct, args, kwargs, linear):
    perm = [d % len(args[1]) for d in args[1]]
    inverse = [perm.index(i) for i in range(len(perm))]
    return [b.call(aten.permute.default, ct, inverse), None]


def_linear(aten.permute.default, _transpose_permute)


def _transpose_t(b, ct, args, kwargs, linear):
    return [b.call(aten.t.default, ct)]


def_linear(aten.t.default, _transpose_t)


def _transpose_transpose(b, ct, args, kwargs, linear):
    return [b.call(aten.transpose.int, ct, args[1], args[2]), None, None]


def_linear(aten.transpose.int, _transpose_transpose)


def _transpose_unsqueeze(b, ct, args, kwargs, linear):
    d = args[1] % (len(shape(args[0])) + 1)
    return [b.call(aten.squeeze.dims, ct, [d]), None]


def_linear(aten.unsqueeze.default, _transpose_unsqueeze)


def _transpose_expand(b, ct, args, kwargs, linear):
    return [b.sum_to(ct, shape(args[0])), None]


def_linear(aten.expand.default, _transpose_expand)


def _transpose_identity(b, ct, args, kwargs, linear):
    return [ct] + [None] * (len(args) - 1)


def_linear(aten.alias.default, _transpose_identity)
def_linear(aten.clone.default, _transpose_identity)


@def_jvp(aten._to_copy.default)
def _jvp_to_copy(b, out, args, tangents, kwargs):
    val = out.meta["val"]
    if not (val.dtype.is_floating_point or val.dtype.is_complex):
        return None
    return b.call(aten._to_copy.default, tangents[0], **kwargs)


@def_transpose(aten._to_copy.default)
def _transpose_to_copy(b, ct, args, kwargs, linear):
    """The cast back to the source's dtype; a real source's cotangent is the real part of a
    complex one (``view_as_real`` and ``select``: the transpose of ``x ↦ x + 0i``)."""
    src = args[0].meta["val"] if isinstance(args[0], torch.fx.Node) else args[0].val
    if dtype(ct).is_complex and not src.dtype.is_complex:
        ct = b.call(aten.select.int, b.call(aten.view_as_real.default, ct), -1, 0)
        if dtype(ct) == src.dtype:
            return [ct]
    return [b.call(aten._to_copy.default, ct, dtype=src.dtype)]


def _transpose_slice(b, ct, args, kwargs, linear):
    a = bind(aten.slice.Tensor, args, kwargs)
    zeros = b.zeros(shape(a.self), a.self)
    scatter = b.call(aten.slice_scatter.default, zeros, ct, a.dim, a.start, a.end, a.step)
    return [scatter] + [None] * (len(args) - 1)


def_linear(aten.slice.Tensor, _transpose_slice)


def _transpose_select(b, ct, args, kwargs, linear):
    x, dim, index = args
    zeros = b.zeros(shape(x), x)
    return [b.call(aten.select_scatter.default, zeros, ct, dim, index), None, None]


def_linear(aten.select.int, _transpose_select)


def _transpose_diagonal(b, ct, args, kwargs, linear):
    """``diagonal(x, offset, dim1, dim2)`` (einsum ``"ii->i"``, ``.diagonal()``) is a view: its
    cotangent is ``ct`` written onto the diagonal of zeros of ``x``'s shape."""
    a = bind(aten.diagonal.default, args, kwargs)
    zeros = b.zeros(shape(a.self), a.self)
    out = b.call(aten.diagonal_scatter.default, zeros, ct, a.offset, a.dim1, a.dim2)
    return [out] + [None] * (len(args) - 1)


def_linear(aten.diagonal.default, _transpose_diagonal)


def _transpose_diagonal_scatter(b, ct, args, kwargs, linear):
    """``diagonal_scatter(x, src, offset, dim1, dim2)`` (a write into a diagonal,
    functionalised) is linear in ``(x, src)`` jointly: ``x``'s cotangent is ``ct`` with the
    diagonal zeroed, ``src``'s the diagonal of ``ct``."""
    a = bind(aten.diagonal_scatter.default, args, kwargs)
    src, offset, dim1, dim2 = a.src, a.offset, a.dim1, a.dim2
    ct_x = (
        b.call(aten.diagonal_scatter.default, ct, b.zeros(shape(src), src), offset, dim1, dim2)
        if linear[0]
        else None
    )
    ct_src = b.call(aten.diagonal.default, ct, offset, dim1, dim2) if linear[1] else None
    return [ct_x, ct_src] + [None] * (len(args) - 2)


def_linear(aten.diagonal_scatter.default, _transpose_diagonal_scatter)


def _transpose_slice_scatter(b, ct, args, kwargs, linear):
    """``slice_scatter(x, src, ...)`` (an in-place write into a slice, functionalised) is linear
    in ``(x, src)`` jointly: ``x``'s cotangent is ``ct`` with the slice zeroed, ``src``'s the
    slice of ``ct``."""
    a = bind(aten.slice_scatter.default, args, kwargs)
    src, dim, start, end, step = a.src, a.dim, a.start, a.end, a.step
    ct_x = (
        b.call(aten.slice_scatter.default, ct, b.zeros(shape(src), src), dim, start, end, step)
        if linear[0]
        else None
    )
    ct_src = b.call(aten.slice.Tensor, ct, dim, start, end, step) if linear[1] else None
    return [ct_x, ct_src] + [None] * (len(args) - 2)


def_linear(aten.slice_scatter.default, _transpose_slice_scatter)


def _transpose_copy(b, ct, args, kwargs, linear):
    """``copy(x, src)`` is ``src`` broadcast into ``x``'s shape and dtype (``x[...] = src``,
    functionalised): ``x``'s values do not reach the output (a zero cotangent), ``src``'s
    cotangent is ``ct`` summed back to its shape, in its dtype."""
    src = args[1]
    if not linear[1]:
        return [None] * len(args)
    g = b.sum_to(ct, shape(src))
    if dtype(g) != dtype(src):
        g = b.call(aten._to_copy.default, g, dtype=dtype(src))
    return [None, g] + [None] * (len(args) - 2)


def_linear(aten.copy.default, _transpose_copy)


def _transpose_pad(b, ct, args, kwargs, linear):
    pad = list(args[1])
    return [b.call(aten.constant_pad_nd.default, ct, [-p for p in pad]), None, None]


@def_jvp(aten.constant_pad_nd.default)
def _jvp_pad(b, out, args, tangents, kwargs):
    return b.call(aten.constant_pad_nd.default, tangents[0], args[1], 0.0)


def_transpose(aten.constant_pad_nd.default)(_transpose_pad)


@def_jvp(aten.cat.default)
def _jvp_cat(b, out, args, tangents, kwargs):
    ts = tangents[0]
    if all(t is None for t in ts):
        return None
    parts = [b.zeros(shape(a), a) if t is None else t for a, t in zip(args[0], ts)]
    return b.call(aten.cat.default, parts, *args[1:], **kwargs)


@def_transpose(aten.cat.default)
def _transpose_cat(b, ct, args, kwargs, linear):
    dim = bind(aten.cat.default, args, kwargs).dim % len(shape(args[0][0]))
    cts, offset = [], 0
    for a, is_lin in zip(args[0], linear[0]):
        size = shape(a)[dim]
        cts.append(b.call(aten.slice.Tensor, ct, dim, offset, offset + size) if is_lin else None)
        offset += size
    return [cts] + [None] * (len(args) - 1)


@def_jvp(aten.gather.default)
def _jvp_gather(b, out, args, tangents, kwargs):
    return b.call(aten.gather.default, tangents[0], *args[1:], **kwargs)


@def_transpose(aten.gather.default)
def _transpose_gather(b, ct, args, kwargs, linear):
    x, dim, index = args[0], args[1], args[2]
    zeros = b.zeros(shape(x), x)
    return [b.call(aten.scatter_add.default, zeros, dim, index, ct), None, None]


@def_jvp(aten.scatter_add.default)
def _jvp_scatter_add(b, out, args, tangents, kwargs):
    base, dim, index, src = args
    ts, tsrc = tangents[0], tangents[3]
    if ts is None and tsrc is None:
        return None
    ts = b.zeros(shape(base), base) if ts is None else ts
    tsrc = b.zeros(shape(src), src) if tsrc is None else tsrc
    return b.call(aten.scatter_add.default, ts, dim, index, tsrc)


@def_transpose(aten.scatter_add.default)
def _transpose_scatter_add(b, ct, args, kwargs, linear):
    _, dim, index, _ = args
    cts = [None, None, None, None]
    if linear[0]:
        cts[0] = ct
    if linear[3]:
        cts[3] = b.call(aten.gather.default, ct, dim, index)
    return cts


def reduced_dims(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Dims of ``src`` to sum so it broadcasts back to ``dst``: (leading dims, kept dims)."""
    lead = len(src) - len(dst)
    kept = [i + lead for i, d in enumerate(dst) if d == 1 and src[i + lead] != 1]
    return list(range(lead)), kept


__all__ = ["reduced_dims", "norm_dims"]


# --- metadata checks, multi-output views, flips, index ops ------------------------------------

# x.to(dtype) leaves a metadata assertion beside _to_copy: no output, nothing computed
register(aten._assert_tensor_metadata.default, F, free, bytes="view")
def_zero(aten._assert_tensor_metadata.default)


@def_jvp(aten.split_with_sizes.default)
def _jvp_split_with_sizes(b, out, args, tangents, kwargs):
    """The same split of the input tangent, one ``getitem`` per piece: the pieces stay one op,
    so the transpose joins their cotangents with one concatenation."""
    a = bind(aten.split_with_sizes.default, args, kwargs)
    x, sizes = a.self, list(a.split_sizes)
    dim = a.dim % len(shape(x))
    pieces = b.call(aten.split_with_sizes.default, tangents[0], sizes, dim)
    return tuple(b.call(operator.getitem, pieces, i) for i in range(len(sizes)))


@def_transpose(aten.split_with_sizes.default)
def _transpose_split_with_sizes(b, ct, args, kwargs, linear):
    """``ct`` holds one cotangent per piece (``None`` where a piece has none): the input's
    cotangent is their concatenation along the split dim, zeros in place of the missing ones
    (0 FLOPs; the pieces read and the input written once)."""
    a = bind(aten.split_with_sizes.default, args, kwargs)
    x, sizes = a.self, list(a.split_sizes)
    dim = a.dim % len(shape(x))
    parts = []
    for size, c in zip(sizes, ct):
        if c is None:
            piece = list(shape(x))
            piece[dim] = size
            c = b.zeros(piece, x)
        parts.append(c)
    return [b.call(aten.cat.default, parts, dim), None, None]


@register_decomposition(aten.unbind.int)
def _unbind_as_split(x, dim=0):
    """``unbind`` as a split into pieces of 1 along ``dim``, each squeezed: one op whose
    transpose is one concatenation (PyTorch's decomposition slices once per piece, and each
    slice transposes to a ``slice_scatter`` into zeros, summed)."""
    pieces = aten.split_with_sizes.default(x, [1] * x.shape[dim], dim)
    return tuple(aten.squeeze.dims(p, [dim]) for p in pieces)


register(aten.flip.default, F, free, bytes="copy")


def _transpose_flip(b, ct, args, kwargs, linear):
    return [b.call(aten.flip.default, ct, list(args[1])), None]


def_linear(aten.flip.default, _transpose_flip)


@def_jvp(aten.index_select.default)
def _jvp_index_select(b, out, args, tangents, kwargs):
    return b.call(aten.index_select.default, tangents[0], *args[1:])


@def_transpose(aten.index_select.default)
def _transpose_index_select(b, ct, args, kwargs, linear):
    """``index_select``'s transpose adds each selected slice back: ``index_add`` (1 FLOP per
    added element, docs/flops_conventions.md)."""
    x, dim, index = args
    zeros = b.zeros(shape(x), x)
    return [b.call(aten.index_add.default, zeros, dim, index, ct), None, None]


# advanced indexing x[i, :, j] (upsampling, reflection padding, adaptive pooling decompose to it;
# the core-ATen decompositions turn _unsafe_index into index, so only index has derivatives)
for _op in (aten.index.Tensor, aten._unsafe_index.Tensor):
    register(_op, F, free, bytes="gather")


def _index_put_cost(out, x, indices, values, accumulate=False, *args, **kwargs) -> NodeCost:
    """``index_put``: a copy, or with ``accumulate`` 1 FLOP per added element
    (docs/flops_conventions.md)."""
    return NodeCost(flops=numel(values) if accumulate else 0)


register(aten.index_put.default, F, _index_put_cost, bytes="copy")
register(aten._unsafe_index_put.default, F, _index_put_cost, bytes="copy")


def _transpose_index(b, ct, args, kwargs, linear):
    """``x[indices]`` transposes to adding the cotangent back at the indices: ``index_put`` with
    ``accumulate=True`` into zeros (repeated indices add up)."""
    x, indices = args[0], args[1]
    zeros = b.zeros(shape(x), x)
    return [b.call(aten.index_put.default, zeros, list(indices), ct, True), None]


def_linear(aten.index.Tensor, _transpose_index)


def _index_put_args(args, kwargs):
    a = bind(aten.index_put.default, args, kwargs)
    return a.self, list(a.indices), a.values, bool(a.accumulate)


@def_jvp(aten.index_put.default)
def _jvp_index_put(b, out, args, tangents, kwargs):
    """Linear in ``self`` and ``values`` jointly: the op applied to their tangents."""
    x, indices, values, accumulate = _index_put_args(args, kwargs)
    tx, tv = tangents[0], tangents[2]
    if tx is None and tv is None:
        return None
    tx = b.zeros(shape(x), x) if tx is None else tx
    tv = b.zeros(shape(values), values) if tv is None else tv
    return b.call(aten.index_put.default, tx, indices, tv, accumulate)


def _bool_mask(indices) -> tuple[int, Any] | None:
    """``(p, mask)`` when the one tensor among ``indices`` is a boolean mask of at least one
    dim at position ``p`` (``x[:, m]``, ``x[m]``); None when there is no boolean mask."""
    masks = [i for i, t in enumerate(indices) if t is not None and dtype(t) == torch.bool]
    if not masks:
        return None
    tensors = [i for i, t in enumerate(indices) if t is not None]
    p = masks[0]
    if len(tensors) != 1 or not shape(indices[p]):
        # a mask beside other index tensors, or a 0-dim mask: the written positions pair up
        # with the values in ways these rules do not reproduce without the mask's values
        raise MissingRuleError(aten.index_put.default, ("transpose",))
    return p, indices[p]


def _viewed(b, t, sizes: list[int]):
    """``t`` viewed as ``sizes``, copied to a contiguous tensor first when it is not one (an
    expanded mask)."""
    if not value(t).is_contiguous():
        t = b.call(aten.clone.default, t, memory_format=torch.contiguous_format)
    return b.call(aten.view.default, t, sizes)


def _flat(b, t):
    """``t`` as one dim (:func:`_viewed`)."""
    return _viewed(b, t, [numel(value(t))])


def _mask_ranks(b, flat_mask):
    """For a 1-D boolean mask, each set element's rank among the set ones (0, 1, …), 0 at the
    others: ``where(m, cumsum(m) − 1, 0)`` (cumsum, subtract, select: 3 FLOPs per element). The
    k-th set element of a mask receives the k-th value of a masked write (``x[m] = v`` with one
    value per set element, ``masked_scatter``), so these are the positions its cotangent goes
    back to, found without the data-dependent count of set elements."""
    rank = b.call(aten.sub.Tensor, b.call(aten.cumsum.default, flat_mask, 0), 1)
    return b.call(aten.where.ScalarOther, flat_mask, rank, 0)


def _masked_values_cotangent(b, ct, p, mask, values):
    """``v̄`` of ``out = index_put(x, [None]*p + [mask], v)``: the cotangent at the set elements
    of ``mask`` (dims p … p+d−1 of ``x``), as PyTorch's ``ct[:, mask]`` (``ct`` indexed like the
    write, shape ``pre + (K,) + post`` with K the count of set elements) summed to ``v``'s
    shape, but without that data-dependent K. ``kept = where(mask, ct, 0)`` (a select: a NaN
    cotangent at an element the write did not reach gives nothing); then, when ``v`` has one
    value for all set elements (size 1, or no dim, at K's place), ``kept``'s sum over the mask's
    dims and the other dims ``v`` was broadcast along; otherwise (one value per set element, in
    order) a ``scatter_add`` of ``kept`` at each element's rank (:func:`_mask_ranks`) into
    zeros of ``pre + (K,) + post``, K read from ``v``'s shape. FLOPs: the select and the sum
    (or scatter-add) 1 each per element of ``x``; the ranks 3 per element of ``mask``."""
    xs, ms = shape(ct), shape(mask)
    d = len(ms)
    pre, post = list(xs[:p]), list(xs[p + d :])
    indexed = len(pre) + 1 + len(post)  # rank of x[..., mask, ...]
    vs = ([1] * indexed + list(shape(values)))[-indexed:]  # v's shape against x[..., mask, ...]
    kept = b.call(
        aten.where.ScalarOther,
        _viewed(b, mask, [1] * p + list(ms) + [1] * len(post)),
        ct,
        0.0,
    )
    if vs[p] == 1:
        at = [i for i in range(p) if vs[i] == 1] + list(range(p, p + d))
        at += [p + d + j for j in range(len(post)) if vs[p + 1 + j] == 1]
        g = b.call(aten.sum.dim_IntList, kept, at, True)
        return b.call(aten.view.default, g, list(shape(values)))
    m = numel(value(mask))
    ranks = b.call(
        aten.view.default, _mask_ranks(b, _flat(b, mask)), [1] * p + [m] + [1] * len(post)
    )
    ranks = b.call(aten.expand.default, ranks, pre + [m] + post)
    kept = b.call(aten.view.default, kept, pre + [m] + post)
    g = b.call(aten.scatter_add.default, b.zeros(pre + [vs[p]] + post, ct), p, ranks, kept)
    return b.sum_to(g, shape(values))


@def_transpose(aten.index_put.default)
def _transpose_index_put(b, ct, args, kwargs, linear):
    """``out = index_put(x, i, v, accumulate)``: ``x̄ = ct`` (with ``accumulate``) or ``ct`` with
    the overwritten positions zeroed; ``v̄ = ct[i]`` (exact for unique indices, as PyTorch's
    own derivative), or with a boolean mask among ``i`` :func:`_masked_values_cotangent` (no
    data-dependent shape)."""
    x, indices, values, accumulate = _index_put_args(args, kwargs)
    masked = _bool_mask(indices) if linear[2] else None
    cts = [None] * len(args)
    if linear[0]:
        cts[0] = (
            ct
            if accumulate
            else b.call(aten.index_put.default, ct, indices, b.zeros(shape(values), values), False)
        )
    if masked is not None:
        cts[2] = _masked_values_cotangent(b, ct, *masked, values)
    elif linear[2]:
        g = b.call(aten.index.Tensor, ct, indices)
        cts[2] = b.sum_to(g, shape(values))
    return cts


# x.masked_scatter(mask, source): the k-th set element of mask (broadcast to x, in row-major
# order) takes source's k-th element; a copy, 0 FLOPs
register(aten.masked_scatter.default, F, free, bytes="copy")


@def_jvp(aten.masked_scatter.default)
def _jvp_masked_scatter(b, out, args, tangents, kwargs):
    """Linear in ``self`` and ``source`` jointly: the op applied to their tangents."""
    x, mask, source = args
    tx, ts = tangents[0], tangents[2]
    if tx is None and ts is None:
        return None
    tx = b.zeros(shape(x), x) if tx is None else tx
    ts = b.zeros(shape(source), source) if ts is None else ts
    return b.call(aten.masked_scatter.default, tx, mask, ts)


@def_transpose(aten.masked_scatter.default)
def _transpose_masked_scatter(b, ct, args, kwargs, linear):
    """``x̄ = where(mask, 0, ct)``; ``sourcē``: the cotangent at the k-th set element of
    ``mask`` goes to ``source``'s k-th element, the rest of ``source`` gets 0 (PyTorch's
    ``masked_scatter_backward``: ``masked_select`` padded with zeros), built as a
    ``scatter_add`` at each set element's rank (:func:`_mask_ranks`) of ``where(mask, ct, 0)``
    into zeros, with no data-dependent shape. FLOPs per element of ``x``: 1 for ``x̄``; for
    ``sourcē`` 1 (select) + 3 (ranks) + 1 (scatter-add)."""
    x, mask, source = args
    cts = [None, None, None]
    if linear[0]:
        cts[0] = b.call(aten.where.ScalarSelf, mask, 0.0, ct)
    if linear[2]:
        if shape(mask) != shape(ct):
            mask = b.call(aten.expand.default, mask, list(shape(ct)))
        flat_mask = _flat(b, mask)
        kept = b.call(aten.where.ScalarOther, flat_mask, _flat(b, ct), 0.0)
        g = b.call(
            aten.scatter_add.default,
            b.zeros([numel(value(source))], ct),
            0,
            _mask_ranks(b, flat_mask),
            kept,
        )
        cts[2] = b.call(aten.view.default, g, list(shape(source)))
    return cts


def _transpose_repeat(b, ct, args, kwargs, linear):
    """``repeat`` tiles ``x`` ``r_i`` times along each dim: view the cotangent as
    (r₀, s₀, r₁, s₁, …) and sum over the tile dims."""
    x, reps = args[0], list(args[1])
    xs = list(shape(x))
    padded = [1] * (len(reps) - len(xs)) + xs
    inter = []
    for r, n in zip(reps, padded):
        inter += [r, n]
    g = b.call(aten.view.default, ct, inter)
    g = b.call(aten.sum.dim_IntList, g, list(range(0, 2 * len(reps), 2)))
    return [b.call(aten.view.default, g, xs), None]


def_linear(aten.repeat.default, _transpose_repeat)


# --- decompositions ----------------------------------------------------------------------------
# nearest, (bi/tri)linear and bicubic upsampling: PyTorch's decompositions into index ops and
# elementwise arithmetic
use_torch_decomposition(
    aten.upsample_nearest1d,
    aten.upsample_nearest2d,
    aten.upsample_nearest3d,
    aten.upsample_linear1d,
    aten.upsample_bilinear2d,
    aten.upsample_trilinear3d,
    aten.upsample_bicubic2d,
)
# grid sampling (F.grid_sample: spatial transformers, deformable attention, optical flow):
# PyTorch's decomposition into coordinate arithmetic, gathers and weighted sums, for every
# mode (bilinear, nearest, bicubic) and padding mode
use_torch_decomposition(aten.grid_sampler_2d)


@register_decomposition(aten.as_strided_.default)
def _restride(x, size, stride, storage_offset=None):
    """``as_strided_`` that only changes strides (adaptive average pooling to 1×1 restrides its
    fresh result to channels-last): the same values, so the tensor itself; any other use is
    traced as is (and has no rule)."""
    if list(x.shape) == list(size) and not storage_offset:
        return x
    return NotImplemented


# --- as_strided: a view with any strides (torch.stft's frames), overlapping ones included --------

register(aten.as_strided.default, F, free, bytes="view")


def _as_strided_reads(xv, size, stride, offset):
    """The flat indices into ``x`` (``xv``, its value) of the elements ``as_strided(x, size,
    stride, offset)`` reads, as a real int64 tensor of shape ``size``, or None when the view
    reads a storage element that is not one of ``x``'s (then no tangent of ``x`` gives it)."""
    base = xv.storage_offset()
    start = base if offset is None else int(offset)
    ends = [base + sum((n - 1) * s for n, s in zip(xv.shape, xv.stride()) if n > 0)]
    ends.append(start + sum((n - 1) * s for n, s in zip(size, stride) if n > 0))
    span = max(ends) + 1
    positions = torch.arange(span)
    inverse = torch.full((span,), -1, dtype=torch.int64)
    mine = torch.as_strided(positions, tuple(xv.shape), tuple(xv.stride()), base)
    inverse[mine.reshape(-1)] = torch.arange(mine.numel())
    reads = inverse[torch.as_strided(positions, tuple(size), tuple(stride), start)]
    return None if bool((reads < 0).any()) else reads


@def_jvp(aten.as_strided.default)
def _jvp_as_strided(b, out, args, tangents, kwargs):
    """``as_strided(x, size, stride, offset)`` picks elements of ``x``'s storage; windows may
    overlap (``stft``'s frames with a hop below the frame length), so a view of the tangent and
    a scatter back would lose the overlaps. Its tangent is the flat tangent indexed at the
    elements of ``x`` the view reads: ``tx.view(-1)[idx]``, with ``idx = as_strided(arange(
    numel(x)), size, stride, offset − x's offset)`` for a contiguous ``x``, and for a strided
    ``x`` (``.real`` of a complex tensor) the storage positions read mapped back through the
    inverse of ``x``'s layout; ``idx`` is a constant of the graph. The transpose of that
    indexing is ``index_put`` with accumulation, the overlaps summed (PyTorch's
    ``as_strided_backward`` does the same over the storage). A view reading storage outside
    ``x`` refuses (``MissingRuleError``: the JVP and backward are cut there and the gap
    reported)."""
    from graphflop.ops.registry import MissingRuleError

    a = bind(aten.as_strided.default, args, kwargs)
    x, size, stride, offset = a.self, list(a.size), list(a.stride), a.storage_offset
    xv = value(x)
    device = xv.device
    if xv.is_contiguous():
        base = xv.storage_offset()
        start = (base if offset is None else int(offset)) - base
        positions = b.call(aten.arange.default, xv.numel(), dtype=torch.int64, device=device)
        idx = b.call(aten.as_strided.default, positions, size, stride, start)
    else:
        # x is itself a strided view (``.real`` of a complex tensor): the storage positions the
        # view reads, mapped back to x's flat indices through the inverse of x's own layout
        # (checked here on real integers: a position outside x refuses)
        if _as_strided_reads(xv, size, stride, offset) is None:
            raise MissingRuleError(aten.as_strided.default, ("jvp",))
        base = xv.storage_offset()
        start = base if offset is None else int(offset)
        span = 1 + max(
            base + sum((n - 1) * st for n, st in zip(xv.shape, xv.stride()) if n > 0),
            start + sum((n - 1) * st for n, st in zip(size, stride) if n > 0),
        )
        positions = b.call(aten.arange.default, span, dtype=torch.int64, device=device)
        mine = b.call(aten.as_strided.default, positions, list(xv.shape), list(xv.stride()), base)
        mine = b.call(aten.clone.default, mine, memory_format=torch.contiguous_format)
        flat_index = b.call(aten.arange.default, xv.numel(), dtype=torch.int64, device=device)
        inverse = b.call(aten.full.default, [span], -1, dtype=torch.int64, device=device)
        inverse = b.call(
            aten.index_put.default,
            inverse,
            [b.call(aten.view.default, mine, [-1])],
            flat_index,
        )
        read = b.call(aten.as_strided.default, positions, size, stride, start)
        idx = b.call(aten.index.Tensor, inverse, [read])
    dense = b.call(aten.clone.default, tangents[0], memory_format=torch.contiguous_format)
    flat = b.call(aten.view.default, dense, [-1])
    return b.call(aten.index.Tensor, flat, [idx])


# --- antialiased bilinear and bicubic resizing (F.interpolate(..., antialias=True)) --------------
#: op -> (its backward, the filter's size: 2 taps bilinear, 4 bicubic, before scaling)
_RESIZE_AA = {
    aten._upsample_bilinear2d_aa.default: (aten._upsample_bilinear2d_aa_backward.default, 2),
    aten._upsample_bicubic2d_aa.default: (aten._upsample_bicubic2d_aa_backward.default, 4),
}


def _aa_taps(n_in: int, n_out: int, align_corners: bool, scale: float | None, interp: int) -> int:
    """The taps of one dim's antialiased filter summed over its outputs, as PyTorch's CPU
    kernel computes its windows (``_compute_indices_min_size_weights_aa``): the scale
    ``in/out`` (``(in − 1)/(out − 1)`` with ``align_corners``, ``1/scale`` where given), the
    support ``interp/2``, times the scale when downsampling, each window ``[center − support +
    1/2, center + support + 1/2)`` clipped to the input."""
    if align_corners:
        s = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    else:
        s = 1.0 / scale if scale is not None and scale > 0 else n_in / n_out
    support = interp * 0.5 * s if s >= 1.0 else interp * 0.5
    taps = 0
    for i in range(n_out):
        center = s * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        taps += min(int(center + support + 0.5), n_in) - lo
    return taps


def _aa_cost(op: Any, backward: bool):
    """2 FLOPs (a multiply-add) per filter tap. The kernel resizes one dim at a time, the
    width first, skipping a dim whose size does not change: N·C·H_in·(W taps) +
    N·C·W_out·(H taps). The backward (``…_aa_backward``) spreads each output's gradient over
    the same taps: the same count."""

    def cost(out, *args, **kwargs) -> NodeCost:
        a = bind(op, args, kwargs)
        if backward:
            n, c, h_in, w_in = a.input_size
        else:
            n, c, h_in, w_in = shape(a.self)
        h_out, w_out = a.output_size
        interp = _RESIZE_AA[_AA_FORWARD[op] if backward else op][1]
        flops = 0
        if w_in != w_out:
            flops += 2 * n * c * h_in * _aa_taps(w_in, w_out, a.align_corners, a.scales_w, interp)
        if h_in != h_out:
            flops += 2 * n * c * w_out * _aa_taps(h_in, h_out, a.align_corners, a.scales_h, interp)
        return NodeCost(flops=flops)

    return cost


#: an antialiased resize's backward -> the resize
_AA_FORWARD = {bwd: fwd for fwd, (bwd, _) in _RESIZE_AA.items()}


def _transpose_resize_aa(op: Any):
    """The transpose of a resize (linear in its input): PyTorch's own backward kernel."""
    bwd = _RESIZE_AA[op][0]

    def transpose(b, ct, args, kwargs, linear):
        a = bind(op, args, kwargs)
        g = b.call(
            bwd,
            ct,
            list(a.output_size),
            list(shape(a.self)),
            a.align_corners,
            a.scales_h,
            a.scales_w,
        )
        return [g] + [None] * (len(args) - 1)

    return transpose


def _transpose_resize_aa_backward(op: Any):
    """The backward's transpose: the resize itself (for a derivative of the backward)."""
    fwd = _AA_FORWARD[op]

    def transpose(b, ct, args, kwargs, linear):
        a = bind(op, args, kwargs)
        g = b.call(fwd, ct, list(a.output_size), a.align_corners, a.scales_h, a.scales_w)
        return [g] + [None] * (len(args) - 1)

    return transpose


for _op, (_bwd, _) in _RESIZE_AA.items():
    register(_op, F, _aa_cost(_op, backward=False))
    def_linear(_op, _transpose_resize_aa(_op))
    register(_bwd, F, _aa_cost(_bwd, backward=True))
    def_linear(_bwd, _transpose_resize_aa_backward(_bwd))
