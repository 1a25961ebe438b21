"""Weight-gradient convolutions as matrix products: a graph rewrite that changes no FLOP count
but spares ONNX Runtime's CPU provider its slow skinny-GEMM ``Conv`` (``bench``'s ONNX Runtime
train step, through :func:`graphflop.runtime.graphs.step_graphs` with ``wgrad_mm=True``).

``conv_weight_grads_as_mm``: every weight-gradient-shaped 2-D ``aten.convolution`` becomes one
``mm`` per output position on a shifted window of the (padded) input, with the same multiply-adds.
Reads ``val`` and writes ``val``, ``COST`` and the graphflop provenance keys (copied from the
convolution replaced) on a copy; the graph given is not changed.
"""

from __future__ import annotations

import copy

import torch
from torch.fx import GraphModule

from graphflop.passes.flops import annotate_flops

__all__ = ["conv_weight_grads_as_mm"]

#: a convolution whose output has at most this many positions per channel and a kernel with at
#: least as many is weight-gradient shaped (the backward's ``dW = conv(xᵀ, gᵀ)``)
_WGRAD_MAX_OUT = 64


def conv_weight_grads_as_mm(gm: GraphModule) -> tuple[GraphModule, int]:
    """A copy of ``gm`` in which every weight-gradient-shaped 2-D convolution (stride 1,
    dilation 1, one group, no bias, not transposed; at most 64 output positions and a kernel of
    at least as many) is written as one matrix product per output position, FLOP-annotated;
    and how many were rewritten. ``gm`` is left as it is.

    The backward's weight gradient ``dW = conv(x.permute(1, 0, 2, 3), g.permute(1, 0, 2, 3))``
    has a kernel as large as the feature map and a k×k output; ONNX Runtime's CPU ``Conv``
    computes it as one skinny GEMM per (output position) column block and runs it several times
    slower than the forward convolution of the same FLOPs (see ``docs/seed-b/bench.md``). Here
    each output position (i, j) becomes ``pad(x)[:, :, i:i+Hk, j:j+Wk]`` flattened to
    ``(B, Cin·Hk·Wk)`` times the flattened kernel's transpose ``(Cin·Hk·Wk, Cout)``: the same
    multiply-adds (graphflop's count is unchanged: 2·B·Cout·Cin·Hk·Wk per position), as
    well-shaped GEMMs, at the price of copying each shifted window (B·Cin·Hk·Wk values per
    position). New nodes inherit the convolution's role, module and source.
    """
    g = copy.deepcopy(gm.graph)
    count = 0
    for n in list(g.nodes):
        if _wgrad_shaped(n):
            n.replace_all_uses_with(_as_mm(g, n))
            g.erase_node(n)
            count += 1
    out = GraphModule(gm, g)
    out.meta.update(gm.meta)
    if count:  # the copied nodes keep their COST; the new ones need theirs
        annotate_flops(out)
    return out, count


def _wgrad_shaped(n: torch.fx.Node) -> bool:
    if n.op != "call_function" or n.target is not torch.ops.aten.convolution.default:
        return False
    _, wt, bias, stride, _, dilation, transposed, _, groups = n.args
    if not isinstance(wt, torch.fx.Node) or not isinstance(stride, (list, tuple)):
        return False
    if not isinstance(dilation, (list, tuple)):
        return False
    if bias is not None or transposed or groups != 1 or len(stride) != 2:
        return False
    if any(s != 1 for s in stride) or any(d != 1 for d in dilation):
        return False
    oh, ow = n.meta["val"].shape[2:]
    hk, wk = wt.meta["val"].shape[2:]
    return oh * ow <= _WGRAD_MAX_OUT and hk * wk >= oh * ow


def _as_mm(g: torch.fx.Graph, n: torch.fx.Node) -> torch.fx.Node:
    """The nodes computing convolution ``n`` as one ``mm`` per output position."""
    aten = torch.ops.aten
    inp, wt, _, _, padding, *_ = n.args
    # aten.convolution's schema: input and weight are tensors, padding an int list
    assert isinstance(wt, torch.fx.Node) and isinstance(padding, (list, tuple)), n.format_node()
    b, cout, oh, ow = n.meta["val"].shape
    hk, wk = wt.meta["val"].shape[2:]
    keep = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}

    def add(target, *args, **kwargs):
        node = g.call_function(target, args, kwargs)
        node.meta.update(keep)
        node.meta["val"] = target(*_meta_args(args), **kwargs)
        return node

    with g.inserting_before(n):
        ph, pw = padding
        x = add(aten.constant_pad_nd.default, inp, [pw, pw, ph, ph], 0.0) if ph or pw else inp
        w = add(aten.clone.default, wt, memory_format=torch.contiguous_format)
        wt_t = add(aten.permute.default, add(aten.view.default, w, [cout, -1]), [1, 0])
        cols = []
        for i in range(oh):
            for j in range(ow):
                s = add(aten.slice.Tensor, add(aten.slice.Tensor, x, 2, i, i + hk), 3, j, j + wk)
                # contiguous: a window of a permuted input cloned in its own layout (what
                # torch.export's fake tensors do) cannot be viewed as (B, Cin·Hk·Wk)
                s = add(aten.clone.default, s, memory_format=torch.contiguous_format)
                s = add(aten.view.default, s, [b, -1])
                cols.append(add(aten.unsqueeze.default, add(aten.mm.default, s, wt_t), 2))
        out = add(aten.cat.default, cols, 2)
        return add(aten.view.default, out, [b, cout, oh, ow])


def _meta_args(args):
    """``args`` with every node replaced by an empty meta tensor of its value's shape and
    dtype (to compute a new node's ``val``)."""

    def one(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta["val"]
            return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
        return a

    return torch.fx.node.map_aggregate(args, one)
