"""Embedding lookups: 0 FLOPs, a copy of the gathered rows (docs/flops_conventions.md).

``embedding(W, idx)`` is linear in the table ``W``: its tangent looks the tangent table up at the
same indices, and its transpose adds each row's cotangent back into a zero table with
``index_put(..., accumulate=True)`` (1 FLOP per added element, docs/flops_conventions.md's
"embedding backward"), an ordinary forward op that exports to ONNX (ScatterND with add). Rows at
``padding_idx`` get no gradient, as in PyTorch; the JVP masks them too, so that JVP and VJP stay
transposes of each other (PyTorch's own forward-mode derivative does not mask them).
"""

from __future__ import annotations

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import bind, free, numel, shape
from graphflop.ops.registry import (
    MissingRuleError,
    def_jvp,
    def_transpose,
    register,
    register_decomposition,
)

aten = torch.ops.aten
F = "embedding"

register(aten.embedding.default, F, free, bytes="gather")


def _embedding_args(args, kwargs):
    a = bind(aten.embedding.default, args, kwargs)
    weight, indices, padding_idx = a.weight, a.indices, a.padding_idx
    if a.scale_grad_by_freq:
        raise NotImplementedError(
            "embedding with scale_grad_by_freq=True has no derivative rule: add it in "
            "graphflop/ops/embedding.py"
        )
    return weight, indices, padding_idx


def _mask_padding(b, t, indices, padding_idx):
    if padding_idx is None or padding_idx < 0:
        return t
    keep = b.call(aten.unsqueeze.default, b.call(aten.ne.Scalar, indices, padding_idx), -1)
    return b.call(aten.mul.Tensor, t, keep)


@def_jvp(aten.embedding.default)
def _jvp_embedding(b, out, args, tangents, kwargs):
    weight, indices, padding_idx = _embedding_args(args, kwargs)
    if tangents[0] is None:
        return None
    t = b.call(aten.embedding.default, tangents[0], indices)
    return _mask_padding(b, t, indices, padding_idx)


@def_transpose(aten.embedding.default)
def _transpose_embedding(b, ct, args, kwargs, linear):
    weight, indices, padding_idx = _embedding_args(args, kwargs)
    zeros = b.zeros(shape(weight), weight)
    g = b.call(aten.index_put.default, zeros, [indices], ct, True)
    return [g] + [None] * (len(args) - 1)


# --- EmbeddingBag --------------------------------------------------------------------------------


@register_decomposition(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    """``_embedding_bag`` (sum and mean; 1-D ``indices`` with ``offsets``, as
    ``F.embedding_bag`` passes them) as ops with rules: the rows looked up (``embedding``, 0
    FLOPs), scaled by ``per_sample_weights`` (1 per element), padding rows masked (1 per
    element), then summed into their bags with ``index_add`` (1 per added element); ``mean``
    divides by each bag's count (``index_add`` of the n row flags, a ``clamp_min`` and a divide
    per bag element). Each index's bag comes from the offsets: ``index_add`` of ones at
    ``offsets[1:]`` (B − 1 adds, integers) and a ``cumsum`` (n + 1). Returns PyTorch's four
    outputs (offset2bag, bag sizes and max indices as PyTorch's CPU kernel fills them for
    sum/mean). ``max`` mode and ``scale_grad_by_freq`` are not decomposed: they are traced whole
    (see :func:`_bag_cost` and :func:`_jvp_bag`)."""
    if mode not in (0, 1) or scale_grad_by_freq or indices.dim() != 1:
        return NotImplemented
    n, d = indices.shape[0], weight.shape[1]
    nb = offsets.shape[0] - (1 if include_last_offset else 0)
    marks = aten.zeros.default([n + 1], dtype=torch.int64, device=indices.device)
    ones = aten.ones.default([nb - 1], dtype=torch.int64, device=indices.device)
    marks = aten.index_add.default(marks, 0, aten.slice.Tensor(offsets, 0, 1, nb), ones)
    bag = aten.slice.Tensor(aten.cumsum.default(marks, 0), 0, 0, n)
    rows = aten.embedding.default(weight, indices)
    if per_sample_weights is not None:
        rows = aten.mul.Tensor(rows, aten.unsqueeze.default(per_sample_weights, 1))
    keep = None
    if padding_idx is not None and padding_idx >= 0:
        keep = aten._to_copy.default(aten.ne.Scalar(indices, padding_idx), dtype=weight.dtype)
        rows = aten.mul.Tensor(rows, aten.unsqueeze.default(keep, 1))
    zeros = aten.zeros.default([nb, d], dtype=weight.dtype, device=weight.device)
    out = aten.index_add.default(zeros, 0, bag, rows)
    counts = aten.index_add.default(
        aten.zeros.default([nb], dtype=weight.dtype, device=weight.device),
        0,
        bag,
        keep
        if keep is not None
        else aten.ones.default([n], dtype=weight.dtype, device=weight.device),
    )
    if mode == 1:
        out = aten.div.Tensor(out, aten.unsqueeze.default(aten.clamp_min.default(counts, 1), 1))
    sizes = aten._to_copy.default(counts, dtype=torch.int64)
    max_idx = aten.zeros.default([nb], dtype=torch.int64, device=indices.device)
    return out, bag, sizes, max_idx


_BAG_OPS = (aten._embedding_bag.default, aten._embedding_bag_forward_only.default)


def _bag_args(args, kwargs) -> dict:
    names = (
        "weight",
        "indices",
        "offsets",
        "scale_grad_by_freq",
        "mode",
        "sparse",
        "per_sample_weights",
        "include_last_offset",
        "padding_idx",
    )
    defaults = (None, None, None, False, 0, False, None, False, -1)
    got = dict(zip(names, defaults))
    got.update(zip(names, args))
    got.update(kwargs)
    return got


def _bag_cost(out, *args, **kwargs) -> NodeCost:
    """``_embedding_bag`` traced whole (max mode; sum/mean with ``scale_grad_by_freq``), with
    ``n = numel(indices)`` looked-up rows of width ``d`` into ``B`` bags: max 1 comparison per
    looked-up element (``n·d``, as ``amax``); sum 1 add per looked-up element (``n·d``, as
    ``index_add``), mean also 1 divide per output element (``B·d``); per-sample weights 1
    multiply per looked-up element (``n·d``)."""
    a = _bag_args(args, kwargs)
    n, d = numel(a["indices"]), shape(a["weight"])[1]
    flops = n * d
    if a["mode"] == 1:
        flops += numel(out[0])
    if a["per_sample_weights"] is not None:
        flops += n * d
    return NodeCost(flops=flops)


def _jvp_bag(b, out, args, tangents, kwargs):
    """Max mode: each output element is the table element at ``max_indices`` (the op's fourth
    output), so its tangent is the table tangent gathered there (``gather`` along dim 0, 0
    FLOPs), zeroed for empty bags (bag size 0: PyTorch returns 0 there and index 0), 1 FLOP per
    output element; ``gather``'s transpose (``scatter_add``) gives the backward. Ties take the
    first maximum, as PyTorch's kernels. Sum/mean with ``scale_grad_by_freq`` have no rule:
    PyTorch's gradient is then not the derivative (it is divided by each index's frequency).

    Raises:
        MissingRuleError: a mode other than max (``scale_grad_by_freq`` sum/mean): the
            JVP is cut there and the op reported, as for an op without a JVP rule.
    """
    a = _bag_args(args, kwargs)
    if a["mode"] != 2:
        raise MissingRuleError(aten._embedding_bag.default, ("jvp",))
    if tangents[0] is None:
        return None
    t = b.call(aten.gather.default, tangents[0], 0, b.getitem(out, 3))
    nonempty = b.call(aten.gt.Scalar, b.getitem(out, 2), 0)
    t = b.call(aten.mul.Tensor, t, b.call(aten.unsqueeze.default, nonempty, 1))
    return (t, None, None, None)


for _op in _BAG_OPS:
    register(_op, F, _bag_cost)
    def_jvp(_op)(_jvp_bag)


@register_decomposition(aten.embedding_renorm.default)
def _embedding_renorm(weight, indices, max_norm: float, norm_type: float):
    """``F.embedding(max_norm=...)``'s renormalization of the rows it reads (the functional
    form of ``embedding_renorm_``): each looked-up row whose ``norm_type``-norm exceeds
    ``max_norm`` scaled by ``max_norm / (norm + 1e-7)``, written back into the table. Counted
    per looked-up index, every one scaled (eager's kernel: per distinct row, and scales only
    the rows over the limit: an upper bound); the same values, a repeated index writing the
    same row again."""
    flat = aten.reshape.default(indices, [-1])
    rows = aten.embedding.default(weight, flat)
    norm = aten.linalg_vector_norm.default(rows, norm_type, [-1], True)
    scale = aten.reciprocal.default(aten.add.Tensor(norm, 1e-7))
    scale = aten.mul.Tensor(scale, max_norm)
    over = aten.gt.Scalar(norm, max_norm)
    scale = aten.where.self(over, scale, aten.ones_like.default(scale))
    return aten.index_put.default(weight, [flat], aten.mul.Tensor(rows, scale))
