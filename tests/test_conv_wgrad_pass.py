"""``passes/conv_wgrad.py``: weight-gradient convolutions rewritten as one matrix product per
output position keep every FLOP count and every value (the ONNX Runtime side of the same
rewrite is tests/test_onnx.py::test_weight_gradient_convolutions_as_matrix_products)."""

from __future__ import annotations

import torch
from torch import nn

from graphflop.ad.vjp import build_vjp
from graphflop.frontend.trace import trace
from graphflop.meta import COST, ROLE, SIGNATURE
from graphflop.passes.conv_wgrad import conv_weight_grads_as_mm
from graphflop.passes.flops import annotate_flops
from graphflop.runtime.verify import real_arguments, run_backward, run_forward

aten = torch.ops.aten


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 3, 3, padding=1, bias=False),
        nn.Flatten(),
        nn.Linear(3 * 6 * 6, 5),
    ).double()
    fwd = trace(model, (torch.randn(2, 2, 6, 6, dtype=torch.float64),), loss="sum")
    bwd = build_vjp(fwd)
    annotate_flops(bwd)
    return model, fwd, bwd


def _convs(gm):
    return [n for n in gm.graph.nodes if n.target is aten.convolution.default]


def _total(gm, field="flops"):
    return sum(getattr(n.meta[COST], field) for n in gm.graph.nodes if n.op == "call_function")


def test_flops_and_gradients_unchanged():
    model, fwd, bwd = _problem()
    before = {n.name for n in _convs(bwd)}
    new, count = conv_weight_grads_as_mm(bwd)
    # both convolutions' weight gradients (3×3 outputs ≤ 64 positions, 6×6 kernels ≥ 9); the
    # second layer's input gradient is a transposed convolution and stays
    assert count == 2
    assert {n.name for n in _convs(bwd)} == before  # the graph given is left as it is
    assert len(_convs(new)) == len(before) - 2
    # FLOPs: dW of conv1 is 2·k²·Cin·Cout·(B·H·W) = 2·9·2·4·72 = 10,368 and of conv2
    # 2·9·4·3·72 = 15,552; rewritten, each is 9 mm (one per 3×3 output position) of
    # 2·Cin·(B·6·6)·Cout, the same 9·2·2·72·4 = 10,368 and 9·2·4·72·3 = 15,552
    old = {n.name for n in bwd.graph.nodes}
    added = [n for n in new.graph.nodes if n.op == "call_function" and n.name not in old]
    mms = [n for n in added if n.target is aten.mm.default]
    assert len(mms) == 2 * 9
    assert sum(n.meta[COST].flops for n in mms) == 10_368 + 15_552
    for field in ("flops", "mm_flops"):
        assert _total(new, field) == _total(bwd, field), field
    # the new nodes inherit the convolution's role
    assert {n.meta.get(ROLE) for n in added} == {"grad_weight"}
    # the same gradients, and both equal torch.autograd's
    values = real_arguments(fwd, model)
    recorded = run_forward(fwd, values)
    got, ref = run_backward(new, recorded), run_backward(bwd, recorded)
    sig = fwd.meta[SIGNATURE]
    x = values[sig.inputs[0]]
    model.zero_grad()
    model(x).sum().backward()
    for g, r, (_, q) in zip(got, ref, sig.params):
        assert torch.allclose(g, r, rtol=1e-12, atol=1e-12), q
        assert torch.allclose(g, model.get_parameter(q).grad, rtol=1e-10, atol=1e-12), q


def test_a_graph_without_weight_gradient_convolutions_is_copied_unchanged():
    _, fwd, _ = _problem()
    annotate_flops(fwd)
    new, count = conv_weight_grads_as_mm(fwd)  # forward convolutions: 36 positions, 3×3 kernels
    assert count == 0 and new is not fwd
    assert [n.target for n in new.graph.nodes] == [n.target for n in fwd.graph.nodes]
