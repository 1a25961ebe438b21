"""``totals.forward_gradient_step.tangent_pass`` in the ``inspect --json`` document: how the K
directions' tangents were built (``ForwardGradientInfo.tangent_pass``), for K = 1, for a
batched K = 3 pass, and for the K-copies fallback when the batched pass fails."""

from __future__ import annotations

import json

import torch
from torch import nn

import graphflop.passes.forward_gradient as fgmod
from graphflop.analysis import analyze
from graphflop.meta import FORWARD_GRADIENT
from graphflop.report import Report


def _step(directions: int) -> tuple[dict, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    a = analyze(model, (torch.randn(4, 6),), loss="sum", directions=directions)
    doc = json.loads(json.dumps(a.to_dict()))  # what --json writes
    return doc["totals"]["forward_gradient_step"], a


def test_k1_is_one_tangent_pass_and_round_trips():
    fg, a = _step(1)
    assert fg["tangent_pass"] == "one tangent pass"
    assert fg["directions"] == 1
    # the key sits with the step's own keys, before the late cost keys (macs, complete)
    keys = list(fg)
    assert keys.index("update_flops") + 1 == keys.index("tangent_pass") < keys.index("macs")
    back = Report.from_dict(a.to_dict())
    assert back.totals.forward_gradient_step.tangent_pass == "one tangent pass"


def test_k3_reports_the_batched_pass_the_graph_was_built_with():
    fg, a = _step(3)
    assert fg["directions"] == 3
    assert fg["tangent_pass"] == "one batched tangent pass"
    assert fg["tangent_pass"] == a.forward_gradient.meta[FORWARD_GRADIENT].tangent_pass


def test_a_failed_batched_pass_reports_copies_and_why(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("no batching here")

    monkeypatch.setattr(fgmod, "_batched_pass", fail)
    fg, _ = _step(3)
    assert fg["tangent_pass"] == "copies: the batched pass failed (RuntimeError: no batching here)"


def test_inspect_notes_a_step_without_one_batched_pass(monkeypatch):
    """``inspect`` notes K copies (read off the report's totals), and nothing for K = 1 or a
    batched pass."""
    from graphflop.cli.inspect import _tangent_pass_notes

    assert _tangent_pass_notes(_step(1)[1]) == []
    assert _tangent_pass_notes(_step(3)[1]) == []

    def fail(*args, **kwargs):
        raise RuntimeError("no batching here")

    monkeypatch.setattr(fgmod, "_batched_pass", fail)
    assert _tangent_pass_notes(_step(3)[1]) == [
        "note: forward-gradient step with 3 directions: copies: the batched pass failed "
        "(RuntimeError: no batching here)"
    ]
