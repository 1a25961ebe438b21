"""Training-mode batch norm traced as one node (``_native_batch_norm_legit_functional``) with
rules of its own: its cost equals the sum of the parts of PyTorch's decomposition, other dtypes
are still traced as those parts, and ONNX-style consumers can have the parts back."""

from __future__ import annotations

import torch
from torch import nn

from graphflop.frontend.composite import decompose_kept_whole
from graphflop.frontend.trace import trace
from graphflop.meta import COST
from graphflop.passes.flops import annotate_flops

BN = "aten._native_batch_norm_legit_functional.default"


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _model(dtype=torch.float32):
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).to(dtype).train()


def test_float32_batch_norm_is_one_node_costing_its_parts():
    gm = annotate_flops(trace(_model(), (torch.randn(2, 3, 8, 8),), loss="sum"))
    ops = _targets(gm)
    assert ops.count(BN) == 1 and "aten.var_mean.correction" not in ops
    node = next(n for n in gm.graph.nodes if str(n.target) == BN)
    # N = 2·4·6·6 = 288 elements, C = 4: var_mean 2N + 2C, +eps C, rsqrt C, x − μ N, · rstd N,
    # · γ N, + β N, running mean 3C, running variance (Bessel, momentum) 4C: 6N + 11C
    assert node.meta[COST].flops == 6 * 288 + 11 * 4
    assert node.meta[COST].transcendentals == 4
    # the same as the parts of PyTorch's decomposition, counted by their own rules
    parts = annotate_flops(decompose_kept_whole(gm))
    assert BN not in _targets(parts) and "aten.var_mean.correction" in _targets(parts)
    assert sum(n.meta[COST].flops for n in parts.graph.nodes if COST in n.meta) == sum(
        n.meta[COST].flops for n in gm.graph.nodes if COST in n.meta
    )


def test_decomposed_graph_computes_the_same_values():
    model = _model(torch.float64)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    gm = trace(model, (x,), loss="sum")
    state = [*model.parameters(), *model.buffers()]
    whole = gm(*[t.clone() for t in state], x)
    parts = decompose_kept_whole(gm)(*[t.clone() for t in state], x)
    for a, b in zip(whole, parts):
        torch.testing.assert_close(a, b)


def test_bfloat16_batch_norm_is_traced_as_pytorchs_parts():
    # PyTorch's decomposition computes half precision in float32: its parts are traced
    gm = trace(_model(torch.bfloat16), (torch.randn(2, 3, 8, 8, dtype=torch.bfloat16),))
    ops = _targets(gm)
    assert BN not in ops and "aten.var_mean.correction" in ops
