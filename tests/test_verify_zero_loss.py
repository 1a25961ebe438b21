"""A loss identically zero (the sum of a layer norm's output without affine: 0 for every input)
is rounding noise, and so are its gradient and tangent, in graphflop's graphs and in eager alike:
relative to each other they differ by 100 % or more. verify's floors scaled with ``|L|`` (itself
noise) and failed all three checks of a correct analysis. They scale with ``Σ|ℓ|``, the
magnitudes of the terms the loss adds up (``verify.loss_magnitude``), now: a correct analysis
passes, and a broken derivative rule still fails."""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from graphflop.ad.jvp import build_jvp
from graphflop.ad.vjp import build_vjp
from graphflop.cli import main
from graphflop.frontend.trace import trace
from graphflop.ops import registry
from graphflop.runtime import verify
from graphflop.runtime.verify_fg import verify_forward_gradient
from graphflop.runtime.verify_tangent import verify_jvp

aten = torch.ops.aten

MODEL = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16, elementwise_affine=False)

    def forward(self, x):
        return self.ln(self.fc(x)){tail}


def example_inputs():
    return (torch.randn(4, 8),)
"""


class SumOfLayerNorm(nn.Module):
    """Linear → layer norm without affine, summed (by the model itself, or by graphflop's sum
    loss): 0 for every input in exact arithmetic."""

    def __init__(self, own_sum: bool):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16, elementwise_affine=False)
        self.own_sum = own_sum

    def forward(self, x):
        y = self.ln(self.fc(x))
        return y.sum() if self.own_sum else y


def _checks(model, x):
    fwd = trace(model, (x,), loss="sum")
    grads = verify.verify_gradients(fwd, build_vjp(fwd), model)
    tangent = verify_jvp(fwd, build_jvp(fwd, "params"), model)
    return fwd, grads, tangent


@pytest.mark.parametrize("own_sum", [False, True], ids=["sum_loss", "model_sums"])
def test_a_zero_loss_passes_every_check(own_sum):
    torch.manual_seed(0)
    model = SumOfLayerNorm(own_sum).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    fwd, grads, tangent = _checks(model, x)
    assert grads.ran and grads.ok, grads.line()
    assert tangent.ran and tangent.ok, tangent.line()
    fg = verify_forward_gradient(fwd, model, samples=20)
    assert fg.ok and "rounding noise" in fg.where, fg.line()


def test_the_loss_terms_scale_is_eagers():
    # Σ|ℓ| from graphflop's forward against eager's layer norm on the same random arguments
    torch.manual_seed(0)
    model = SumOfLayerNorm(True).double()
    fwd = trace(model, (torch.randn(4, 8, dtype=torch.float64),), loss="sum")
    values = verify.real_arguments(fwd, model)
    (x,) = (values[n] for n in fwd.meta[verify.SIGNATURE].inputs)
    keep = {verify.loss_terms_name(fwd), fwd.meta[verify.SIGNATURE].loss}
    got = verify.loss_magnitude(fwd, verify.run_forward(fwd, values, keep))
    with torch.no_grad():
        ref = float(model.ln(model.fc(x)).abs().sum())
        loss = float(model(x))
    assert abs(loss) < 1e-12 and ref > 10  # 64 terms of size ~0.8 cancel
    assert got == pytest.approx(ref, rel=1e-12)


def test_loss_terms_walk_back_through_means_and_scalars():
    # sum(mean(y, -1) · 3): y's 4·16 elements enter with 3/16 each
    class M(nn.Module):
        def forward(self, x):
            return (x.mean(-1) * 3).sum()

    fwd = trace(M(), (torch.randn(4, 16),), loss="sum")
    name, factor = verify.loss_terms(fwd)
    assert next(n for n in fwd.graph.nodes if n.name == name).op == "placeholder"  # x
    assert factor == pytest.approx(3 / 16)
    # a cross-entropy ends the walk at the loss itself
    fwd = trace(nn.Linear(4, 3), (torch.randn(2, 4),), loss="cross_entropy")
    assert verify.loss_terms(fwd) == (fwd.meta[verify.SIGNATURE].loss, 1.0)


def _broken_sub(b, out, args, tangents, kwargs):
    """``x − y``'s tangent without y's: the layer norm's mean no longer moves with x."""
    t = tangents[0]
    return t if tuple(t.meta["val"].shape) == tuple(out.meta["val"].shape) else None


@pytest.mark.parametrize("own_sum", [False, True], ids=["sum_loss", "model_sums"])
def test_a_broken_rule_still_fails_on_a_zero_loss(monkeypatch, own_sum):
    torch.manual_seed(0)
    model = SumOfLayerNorm(own_sum).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    rule = registry._TABLE[aten.sub.Tensor]
    monkeypatch.setitem(registry._TABLE, aten.sub.Tensor, replace(rule, jvp=_broken_sub))
    _, grads, tangent = _checks(model, x)
    assert grads.ran and not grads.ok and grads.worst_rel_error > 1e3, grads.line()
    assert tangent.ran and not tangent.ok and tangent.worst_rel_error > 1e3, tangent.line()


def test_inspect_verify_passes_a_zero_loss(tmp_path: Path, capsys):
    # the model sums its layer norm's output (0 of 3 checks passed before)
    path = tmp_path / "zero.py"
    path.write_text(textwrap.dedent(MODEL.replace("{tail}", ".sum()")))
    rc = main(["inspect", f"{path}:M", "--verify", "--format", "json"])
    doc = json.loads(capsys.readouterr()[0])
    assert [c["ok"] for c in doc["verify"]] == [True, True, True], doc["verify"]
    assert all(math.isfinite(c["worst_rel_error"]) for c in doc["verify"])
    assert rc == 0
