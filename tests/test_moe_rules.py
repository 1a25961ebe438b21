"""Mixture-of-experts ops: the rules of transformers' grouped matrix product
(``transformers::grouped_mm_fallback``, the routed experts of transformers' default experts
implementation when ``torch._grouped_mm`` cannot run) and of ``histc`` (its token count per
expert), checked against transformers' own autograd formula and finite differences in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


def _grouped_op():
    pytest.importorskip("transformers")
    from graphflop.load import _preload_torchvision

    _preload_torchvision()  # transformers' imports reach torchvision
    import transformers.integrations.moe  # noqa: F401  (defines the op)

    return torch.ops.transformers.grouped_mm_fallback


class Experts(nn.Module):
    """x (6, 4) → h = x·P (6, 4) → rows 0-1 through expert 0, none through expert 1, rows 2-5
    through expert 2 of W (3, 4, 5)."""

    def __init__(self, op):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.op = op
        self.proj = nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64))
        self.w = nn.Parameter(torch.randn(3, 4, 5, generator=g, dtype=torch.float64))

    def forward(self, x):
        offs = torch.tensor([2, 2, 6], dtype=torch.int32)
        return self.op(x @ self.proj, self.w, offs)


def test_grouped_mm_rules_count_and_differentiate():
    from graphflop.ad.jvp import build_jvp
    from graphflop.ad.vjp import build_vjp
    from graphflop.analysis import analyze
    from graphflop.frontend.trace import trace
    from graphflop.meta import JVP, SIGNATURE, VJP
    from graphflop.runtime.verify import real_arguments, run_backward, run_forward, run_jvp

    model = Experts(_grouped_op())
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    report = analyze(model, (x,), name="experts").report
    assert not report.uncounted
    # forward: x·P 2·6·4·4 = 192; every row times its expert's (4, 5): 2·6·4·5 = 240
    assert report.totals.forward.mm_flops == 192 + 240
    # backward: h's cotangent ct·Wᵀ per expert 2·6·5·4 = 240, W's xᵀ·ct per expert 240,
    # P's hᵀ... xᵀ·ct_h 2·4·6·4 = 192 (the input's gradient is not needed)
    assert report.totals.backward.mm_flops == 240 + 240 + 192
    # the JVP with parameter tangents: dh = x·dP (192), op(dh, W) + op(h, dW) (240 each)
    assert report.totals.jvp.mm_flops == 192 + 240 + 240

    fwd = trace(model, (x,), loss="sum")
    values = real_arguments(fwd, model, seed=0)
    sig = fwd.meta[SIGNATURE]
    xs = [values[n] for n in sig.inputs]
    # the gradients against transformers' own backward formula (torch.autograd; torch.func
    # cannot run its autograd.Function)
    bwd = build_vjp(fwd)
    grads = run_backward(bwd, run_forward(fwd, values))
    model.zero_grad()
    model(*xs).sum().backward()
    for pos, q in bwd.meta[VJP].grads:
        ref = dict(model.named_parameters())[q].grad
        torch.testing.assert_close(grads[pos], ref, rtol=1e-12, atol=1e-12)

    jvp = build_jvp(fwd, "params")
    info = jvp.meta[JVP]
    gen = torch.Generator().manual_seed(2)
    tangents = {
        p: torch.randn(values[p].shape, generator=gen, dtype=values[p].dtype)
        for _, p in info.tangent_inputs
    }
    got = float(run_jvp(jvp, values, tangents)[info.primal_outputs])
    by_param = {q: tangents[n] for n, q in sig.params}

    def loss(step: float) -> float:
        with torch.no_grad():
            moved = {q: p + step * by_param[q] for q, p in model.named_parameters()}
            return float(torch.func.functional_call(model, moved, tuple(xs)).sum())

    eps = 1e-6
    fd = (loss(eps) - loss(-eps)) / (2 * eps)
    assert abs(got - fd) <= 1e-6 * max(1.0, abs(fd)), (got, fd)


def test_histc_counts_one_flop_per_element_and_has_no_derivative():
    from graphflop.analysis import analyze

    class Route(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

        def forward(self, x):
            counts = torch.histc(x.argmax(-1).float(), bins=4, min=0, max=3)
            return (x * self.w).sum() * counts.sum()

    report = analyze(Route(), (torch.randn(10, 8),), name="route").report
    assert not report.uncounted
    # argmax 80, histc 10 (one bin increment per element), x·w 80, the sums 80 and 4 (1 per
    # input element), the product 1, the loss's sum of the one element 1
    assert report.totals.forward.flops == 80 + 10 + 80 + 80 + 4 + 1 + 1
