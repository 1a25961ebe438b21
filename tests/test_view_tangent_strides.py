"""JVP and backward of ``nn.TransformerEncoderLayer``, whose ``batch_first`` attention makes a
tangent laid out unlike its primal: the residual sum ``x + attn(x)`` adds a contiguous ``x`` to
a transposed attention output, so the primal sum is contiguous while the tangent sum (built from
the tangents in another order) has strides (16, 32, 1), and the feed-forward's ``view`` to
(10, 16) is impossible on it. The view's JVP copies such a tangent contiguous first
(graphflop/ops/shape.py). References: ``torch.func.jvp`` and ``torch.func.vjp`` on the module."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphflop.ad.jvp import build_jvp
from graphflop.ad.vjp import build_vjp
from graphflop.frontend.trace import trace
from graphflop.meta import JVP, SIGNATURE
from graphflop.ops import strict_rules
from graphflop.runtime.verify import real_arguments, run_backward, run_forward, run_jvp

aten = torch.ops.aten


class _Layer(nn.Module):
    """One encoder layer (d_model 16, 2 heads, no dropout); the output is weighted by a fixed
    random buffer so that the scalar loss ``sum`` depends on every element's position."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            16, 2, dim_feedforward=32, dropout=0.0, batch_first=batch_first
        )
        self.register_buffer("w", torch.randn(2, 5, 16) if batch_first else torch.randn(5, 2, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * self.w


def _problem(batch_first: bool):
    torch.manual_seed(0)
    model = _Layer(batch_first).double()
    x = torch.randn((2, 5, 16) if batch_first else (5, 2, 16), dtype=torch.float64)
    fwd = trace(model, (x,), loss="sum")
    return model, fwd, real_arguments(fwd, model)


def _call(model, fwd, values):
    sig = fwd.meta[SIGNATURE]
    x = values[sig.inputs[0]]
    return lambda p: torch.func.functional_call(model, p, (x,)).sum()


@pytest.mark.parametrize("batch_first", [True, False])
def test_jvp_matches_torch_func_jvp(batch_first):
    model, fwd, values = _problem(batch_first)
    sig = fwd.meta[SIGNATURE]
    with strict_rules():
        jvp = build_jvp(fwd, "params")
    info = jvp.meta[JVP]
    gen = torch.Generator().manual_seed(1)
    v = {
        p: torch.randn(values[p].shape, generator=gen, dtype=torch.float64)
        for _, p in info.tangent_inputs
    }
    d = run_jvp(jvp, values, v)[info.primal_outputs]
    with sdpa_kernel(SDPBackend.MATH):  # CPU's fused attention has no forward-mode AD
        ref = torch.func.jvp(
            _call(model, fwd, values),
            ({q: values[p] for p, q in sig.params},),
            ({q: v[p] for p, q in sig.params},),
        )[1]
    assert torch.allclose(d, ref, rtol=1e-10, atol=1e-12), (float(d), float(ref))
    if batch_first:  # the case that needed the copy: a contiguous clone feeding a view
        clones = [
            n
            for n in jvp.graph.nodes
            if n.target is aten.clone.default
            and n.kwargs.get("memory_format") == torch.contiguous_format
            and any(u.target in (aten.view.default, aten._unsafe_view.default) for u in n.users)
        ]
        assert clones


@pytest.mark.parametrize("batch_first", [True, False])
def test_backward_matches_torch_func_vjp(batch_first):
    model, fwd, values = _problem(batch_first)
    sig = fwd.meta[SIGNATURE]
    with strict_rules():
        bwd = build_vjp(fwd)
    grads = run_backward(bwd, run_forward(fwd, values))
    primals = {q: values[p] for p, q in sig.params}
    with sdpa_kernel(SDPBackend.MATH):
        _, pull = torch.func.vjp(_call(model, fwd, values), primals)
        (ref,) = pull(torch.ones((), dtype=torch.float64))
    assert len(grads) == len(sig.params)
    for g, (_, q) in zip(grads, sig.params):
        assert torch.allclose(g, ref[q], rtol=1e-9, atol=1e-12), q
