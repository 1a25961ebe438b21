"""Embedding lookups: 0 FLOPs, a copy of the gathered rows (FLOPS.md).

``embedding(W, idx)`` is linear in the table ``W``: its tangent looks the tangent table up at the
same indices, and its transpose adds each row's cotangent back into a zero table with
``index_put(..., accumulate=True)`` (1 FLOP per added element, FLOPS.md's "embedding backward"),
an ordinary forward op that exports to ONNX (ScatterND with add). Rows at ``padding_idx`` get no
gradient, as in PyTorch; the JVP masks them too, so that JVP and VJP stay transposes of each
other (PyTorch's own forward-mode derivative does not mask them).
"""

from __future__ import annotations

import torch

from graphflop.ops._common import free, shape
from graphflop.ops.registry import def_jvp, def_transpose, register

aten = torch.ops.aten
F = "embedding"

register(aten.embedding.default, F, free, bytes="gather")


def _embedding_args(args, kwargs):
    weight, indices = args[0], args[1]
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    scale = args[3] if len(args) > 3 else kwargs.get("scale_grad_by_freq", False)
    if scale:
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
