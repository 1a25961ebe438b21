"""A leaf's ``requires_grad`` turned off and on inside the model's forward
(``p.requires_grad_(False)`` ... ``p.requires_grad_(True)``): eager autograd records no use of
``p`` meanwhile, so only the reads outside that stretch give ``p`` a gradient. graphflop's
trace reads it through a stop-gradient meanwhile. The gradients are checked against eager
``loss.backward()`` on the same model (``verify_gradients``, float64), the JVP against
``<gradient, direction>`` (eager forward-mode AD ignores ``requires_grad``), and the update
against a hand count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphflop.analysis import analyze
from graphflop.frontend import trace as trace_module
from graphflop.frontend.errors import TraceError
from graphflop.meta import OUTLINED, SIGNATURE
from graphflop.runtime.verify import verify_gradients
from graphflop.runtime.verify_tangent import verify_jvp

D = 6


class _Toggling(nn.Module):
    """``fc`` is read three times: before its weight is turned off (a gradient), while off (none),
    after it is on again (a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(h))
        self.fc.weight.requires_grad_(False)
        h = torch.tanh(self.fc(h))
        self.fc.weight.requires_grad_(True)
        return torch.tanh(self.fc(h))


class _Stack(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Toggling() for _ in range(blocks))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class _FrozenInForward(nn.Module):
    """``a``'s weight turned off for the rest of the forward: it gets no gradient at all."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a.weight.requires_grad_(False)
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("recorder", ["own", "make_fx"])
def test_reads_while_off_carry_no_gradient_as_in_eager(recorder, monkeypatch):
    """Gradients equal eager's (before the fix: 1e8 relative error at the first block's weight,
    every read differentiated); the blocks that toggle are traced in full (whether a read is
    stopped is each call's own state)."""
    monkeypatch.setattr(trace_module, "RECORDER", recorder)
    torch.manual_seed(0)
    model, x = _Stack().double(), torch.randn(4, D, dtype=torch.double)
    a = analyze(model, (x,))
    assert verify_gradients(a.forward, a.backward, model, examples=(x,)).ok
    assert verify_jvp(a.forward, a.jvp, model, examples=(x,)).ok
    assert a.forward.meta[OUTLINED].traced_once == 0
    assert all(p.requires_grad for p in model.parameters())  # the model's flags as they were


def test_a_parameter_off_for_the_whole_forward_is_frozen():
    """No gradient, no update: SGD's update is 2 FLOPs per updated parameter, a's bias (6) and
    b's weight and bias (7): 2·13 = 26; a's weight (36) is frozen."""
    torch.manual_seed(0)
    model, x = _FrozenInForward().double(), torch.randn(4, D, dtype=torch.double)
    a = analyze(model, (x,))
    assert verify_gradients(a.forward, a.backward, model, examples=(x,)).ok
    assert a.forward.meta[SIGNATURE].frozen == ("p_model_a_weight",)
    assert a.report.totals.update.flops == 26


def test_turning_a_computed_value_off_is_refused_as_in_eager():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(D, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x).requires_grad_(False)

    x = torch.randn(2, D)
    with pytest.raises(RuntimeError, match="leaf"):  # eager PyTorch's refusal
        M()(x)
    with pytest.raises(TraceError, match=r"requires_grad_\(False\).*\.detach\(\)"):
        analyze(M(), (x,))


class _LeftOff(nn.Module):
    """``fc``'s bias read with its flag on, then turned off and left so: eager's backward
    gives it no gradient at all (AccumulateGrad reads the flag when it runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        self.fc.bias.requires_grad_(False)
        return self.head(h)


def test_a_parameter_left_off_gets_no_gradient_as_in_eager():
    """Frozen: SGD's update 2 FLOPs per updated parameter, fc's weight (36) and the head's 7:
    2·43 = 86 (fc's bias, 6, was updated before the fix: 98)."""
    torch.manual_seed(0)
    model, x = _LeftOff().double(), torch.randn(4, D, dtype=torch.double)
    a = analyze(model, (x,))
    assert model.fc.bias.requires_grad  # the model's flags as they were
    assert a.forward.meta[SIGNATURE].frozen == ("p_model_fc_bias",)
    assert a.report.totals.update.flops == 86
    assert verify_gradients(a.forward, a.backward, model, examples=(x,)).ok


def test_turning_a_frozen_parameter_on_is_refused():
    """Eager would give it the gradient of the reads after the call only: not modelled, one
    line naming the parameter and what to do."""
    model = _LeftOff()
    model.fc.weight.requires_grad_(False)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(model.fc(x))
        model.fc.weight.requires_grad_(True)
        return model.head(torch.tanh(model.fc(h)))

    model.forward = forward  # type: ignore[method-assign]
    with pytest.raises(TraceError, match=r"frozen parameter fc\.weight on .* before analysing"):
        analyze(model, (torch.randn(2, D),))
