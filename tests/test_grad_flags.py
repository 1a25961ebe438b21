"""A model whose code reads a traced value's ``requires_grad``, ``is_leaf`` or ``grad_fn``
(``if x.requires_grad: ...``) is traced as eager training runs it: a value computed
differentiably from a trainable parameter requires grad and is no leaf; the model's inputs,
parameters, values made under ``no_grad`` or by ``detach`` and integer values are leaves
(:func:`graphflop.frontend.regions.eager_flags`). An outlined block whose graph depends on its
inputs' flags, which differ between its calls, is traced in full; one whose graph does not
stays outlined. Gradients are checked against ``torch.func.grad`` in float64 (which reads the
flags as eager does); the JVP against ``<gradient, direction>`` (forward-mode AD reads every
value as a leaf that requires no grad)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphflop.analysis import analyze
from graphflop.meta import OUTLINED
from graphflop.runtime.verify import verify_gradients
from graphflop.runtime.verify_tangent import verify_jvp

D = 8


class _Branching(nn.Module):
    """A tester's model (m40): extra work where the input requires grad, +1 where a leaf."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(self.act(self.fc1(x)))
        if x.requires_grad:
            h = h * torch.sigmoid(h)
        if x.is_leaf:
            h = h + 1.0
        return x + h


class _Net(nn.Module):
    def __init__(self, block: type[nn.Module] = _Branching, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[block() for _ in range(n)])
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


@pytest.mark.parametrize("outline", [True, False])
def test_block_branching_on_its_inputs_flags_counts_as_eager(outline):
    """Block 0 reads its input (the model's: requires_grad False, is_leaf True), blocks 1-3 a
    value computed from parameters (True, False). Hand count, batch 4, d 8:
    per block fc1 + fc2 = 2 · (4·8·8 multiply-adds · 2 + 4·8 bias) = 1,088, relu 32, x + h 32:
    1,152; block 0's +1.0: 32; blocks 1-3's h·sigmoid(h): 32 sigmoid (1 FLOP each, one
    transcendental) + 32 products = 64 each; head 4·8·3·2 + 12 = 204; cross-entropy 97 (12
    exp + 4 log transcendentals). 4 · 1,152 + 32 + 3 · 64 + 204 + 97 = 5,133 FLOPs,
    3 · 32 + 16 = 112 transcendentals (before the fix: 5,037 and 16 traced, every flag read
    as the fake's False/True; 5,293 outlined with the template taking its inputs to require
    grad)."""
    torch.manual_seed(0)
    model, x = _Net().double(), torch.randn(4, D, dtype=torch.double)
    a = analyze(model, (x,), outline=outline)
    fwd = a.report.totals.forward
    assert (fwd.flops, fwd.transcendentals) == (5133, 112)
    # the blocks' graphs differ by their inputs' flags: traced in full
    assert a.forward.meta[OUTLINED].traced_once == 0
    assert verify_gradients(a.forward, a.backward, model, examples=(x,)).ok
    assert verify_jvp(a.forward, a.jvp, model, examples=(x,)).ok


class _Gated(nn.Module):
    """Flags of values that require no grad although computed from parameters: under
    ``no_grad``, through ``detach``, integer; a parameter is a leaf that requires grad; a
    computed value's ``grad_fn`` is not None."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.fc = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            g = self.gate(x)
        h = self.fc(x)
        ids = h.argmax(-1)
        assert not g.requires_grad and g.is_leaf and g.grad_fn is None
        assert not h.detach().requires_grad and not ids.requires_grad and ids.is_leaf
        assert self.fc.weight.requires_grad and self.fc.weight.is_leaf
        assert h.requires_grad and not h.is_leaf and h.grad_fn is not None
        if g.requires_grad:  # never (eager: g made with grad mode off)
            h = torch.exp(h)
        return torch.tanh(h) * g


@pytest.mark.parametrize("outline", [True, False])
def test_no_grad_detach_and_integer_values_read_as_eager(outline):
    """Two gated blocks on the model's input, then the head. Hand count, batch 4, d 8: per
    block gate and fc 2 · (512 + 32) = 1,088, tanh 32 (transcendentals), product 32: 1,152;
    head 204; cross-entropy 97 (16 transcendentals): 2 · 1,152 + 204 + 97 = 2,605 FLOPs and
    2 · 32 + 16 = 80 transcendentals (the exp not taken). Both blocks read their input alike
    (the model's, then a computed one, but each block's flags are of values it computes):
    outlined once."""
    torch.manual_seed(0)
    model, x = _Net(_Gated, 2).double(), torch.randn(4, D, dtype=torch.double)
    a = analyze(model, (x,), outline=outline)
    fwd = a.report.totals.forward
    assert (fwd.flops, fwd.transcendentals) == (2605, 80)
    if outline:
        assert a.forward.meta[OUTLINED].traced_once == 1
    assert verify_gradients(a.forward, a.backward, model, examples=(x,)).ok


class _Checks(nn.Module):
    """Reads its input's flag without its graph depending on it (as
    ``nn.TransformerEncoderLayer``'s fast-path checks do)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad or self.fc.weight.requires_grad:  # always (the weight)
            return self.out(torch.relu(self.fc(x)))
        return self.out(self.fc(x))


def test_a_read_that_changes_no_graph_keeps_the_block_outlined():
    """Blocks 0 (input: no grad) and 1-2 (grad) give one graph: outlined once. Hand count:
    3 · (2 · (512 + 32) + 32) + 204 + 97 = 3,661 FLOPs."""
    torch.manual_seed(0)
    model, x = _Net(_Checks, 3), torch.randn(4, D)
    a = analyze(model, (x,))
    assert a.report.totals.forward.flops == 3661
    assert a.forward.meta[OUTLINED].traced_once == 1
