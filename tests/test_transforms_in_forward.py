"""A model whose forward starts a ``torch.func`` transform of its own (``torch.vmap``, or
``associative_scan``'s generic mode, which runs its combine function under ``vmap``: the
scan transformers' Mamba layers take when traced) inside repeated blocks, which graphflop
traces once (:mod:`graphflop.frontend.outline`): the block's first call runs from the
``repeat`` op's fake kernel, below functionalisation, where the transform's batched tensors
reached the fake mode unbatched (a tester's finding: "NYI: querying is_contiguous inside of
vmap" on every transformers Mamba model)."""

from __future__ import annotations

import operator

import pytest
import torch
from test_no_grad import _against_eager_autograd
from torch import nn
from torch._higher_order_ops.associative_scan import associative_scan

from graphflop.analysis import analyze
from graphflop.frontend import outline
from graphflop.meta import OUTLINED

B, T, D, N = 2, 4, 8, 3


def _gated(left, right):
    """The linear recurrence h_t = a_t·h_{t-1} + b_t as an associative combine (Mamba's)."""
    a_l, b_l = left
    a_r, b_r = right
    return a_l * a_r, a_r * b_l + b_r


class _Block(nn.Module):
    """``u = a(x)``; then ``how``: ``vmap`` (u·u by ``torch.vmap`` over the batch), ``cumsum``
    (an additive scan over time, generic mode), ``gated`` (Mamba's recurrence with the gate
    sigmoid(g(x))); then ``x + b(h)``."""

    def __init__(self, how: str):
        super().__init__()
        self.a, self.b, self.g = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.how = how

    def forward(self, x):
        u = self.a(x)
        if self.how == "vmap":
            h = torch.vmap(torch.mul)(u, u)
        elif self.how == "cumsum":
            h = associative_scan(operator.add, u, dim=1, combine_mode="generic")
        else:
            gate = torch.sigmoid(self.g(x))
            h = associative_scan(_gated, (gate, u), dim=1, combine_mode="generic")[1]
        return x + self.b(h)


class _Blocks(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(how) for _ in range(N))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def _flat(model, x, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(outline, "plan", lambda *a, **k: {})
        return analyze(model, x)


@pytest.mark.parametrize("how", ["vmap", "cumsum", "gated"])
def test_repeated_blocks_with_a_transform_trace(how, monkeypatch):
    """Outlined (one block traced), the report equals the one traced without outlining;
    gradients and the JVP against eager autograd in float64 (eager runs the same scan and
    vmap)."""
    torch.manual_seed(0)
    model, x = _Blocks(how).double(), torch.randn(B, T, D, dtype=torch.float64)
    a = analyze(model, x)
    assert a.forward.meta[OUTLINED].traced_once == 1
    _against_eager_autograd(a, model, x)
    assert a.report.to_dict() == _flat(model, x, monkeypatch).report.to_dict()


@pytest.mark.parametrize(
    ("how", "transform_flops"),
    [
        # u·u: 1 FLOP per element, B·T·D = 64
        ("vmap", B * T * D),
        # the generic scan over T = 4 steps: pairs (0,1), (2,3) combined (2 adds per row of D),
        # then their sums (1 add), then step 2 with the pair sum (1 add): 4 adds of B×D each
        # = 4·B·D = 64 (a sequential cumsum would take T−1 = 3)
        ("cumsum", 4 * B * D),
    ],
)
def test_forward_flops_by_hand(how, transform_flops):
    """Forward FLOPs per block: a and b are 2·B·T·D·D + B·T·D each (a product and the bias)
    = 2·(1024 + 64) = 2176, the residual add B·T·D = 64, plus the transform's; N blocks; the
    loss is the output's sum (B·T·D = 64, graphflop's count for a sum of 64 elements). g is
    unused by these two: 3·(2176 + 64 + 64) + 64 = 6976."""
    model, x = _Blocks(how), torch.randn(B, T, D)
    a = analyze(model, x)
    per_block = 2 * (2 * B * T * D * D + B * T * D) + B * T * D + transform_flops
    assert a.report.totals.loss.flops == B * T * D
    assert a.report.totals.forward.flops == N * per_block + B * T * D == 6976
