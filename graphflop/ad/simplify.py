"""Algebraic clean-ups of generated graphs that change no FLOP count but spare runtimes work.

``fold_transposed_matmuls``: ``permute(mm(a, b), [1, 0])`` → ``mm(permute(b), permute(a))``,
i.e. ``(A·B)ᵀ = Bᵀ·Aᵀ``. Transposing a linear layer's weight tangent produces exactly this
pattern (the weight gradient is computed as ``xᵀ·δ`` and then transposed to the weight's
layout); after the rewrite the permutes are on the operands, which runtimes fold into the
matrix product instead of copying the result (ONNX Runtime: ``MatMul`` with transposed inputs).

Reads and writes ``val`` and the graphflop provenance keys (:mod:`graphflop.meta`) (copied from the node replaced).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch.fx import GraphModule

from graphflop.ad.builder import fake_output
from graphflop.meta import fake_mode_of, graphflop_meta

aten = torch.ops.aten


def fold_transposed_matmuls(gm: GraphModule) -> GraphModule:
    """Rewrite ``permute(mm(a, b), [1, 0])`` when the product has no other user (in place)."""
    if fold_graph(gm.graph):
        gm.graph.lint()
        gm.recompile()
    return gm


def fold_graph(
    g: torch.fx.Graph, shared: Callable[[torch.fx.Node], bool] = lambda n: False
) -> dict[torch.fx.Node, torch.fx.Node]:
    """:func:`fold_transposed_matmuls` on graph ``g`` (in place, no lint), where a product
    ``shared`` says is also read from outside ``g`` counts as having another user (a template
    derivative's node read after its call). Returns each permute replaced -> its new product,
    in graph order."""
    folded: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.permute.default:
            continue
        src = n.args[0]
        if (
            not isinstance(src, torch.fx.Node)
            or src.target is not aten.mm.default
            or len(src.users) != 1
            or list(n.args[1]) != [1, 0]
            or shared(src)
        ):
            continue
        a, b = cast("tuple[torch.fx.Node, torch.fx.Node]", src.args)  # mm(a, b): two nodes
        with g.inserting_before(n):
            bt = g.call_function(aten.permute.default, (b, [1, 0]))
            at = g.call_function(aten.permute.default, (a, [1, 0]))
            mm = g.call_function(aten.mm.default, (bt, at))
        for new, like in ((bt, src), (at, src), (mm, n)):
            new.meta.update(graphflop_meta(like.meta))
        bt.meta["val"] = _transposed(b)
        at.meta["val"] = _transposed(a)
        mm.meta["val"] = n.meta["val"]
        mm.meta.update(graphflop_meta(src.meta))
        n.replace_all_uses_with(mm)
        g.erase_node(n)
        g.erase_node(src)
        folded[n] = mm
    return folded


def _transposed(n: torch.fx.Node) -> torch.Tensor | None:
    """The value of ``permute(n, [1, 0])``, from the builders' shape cache (a FakeTensor view
    costs about a millisecond; the folds of a transformer's backward repeat a few shapes)."""
    val = n.meta.get("val")
    if val is None:
        return None
    mode = fake_mode_of([val])
    if mode is None:
        return val.transpose(0, 1)
    return fake_output(mode, aten.permute.default, (val, [1, 0]), {})
