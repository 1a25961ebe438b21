"""Optimizer-state bytes in ``inspect`` and ``plan`` against what ``torch.optim`` allocates: one
eager step of the model on the CPU, the bytes of every tensor in ``optimizer.state`` summed
(Adam's and AdamW's per-parameter ``step`` counts included; tester's finding: ``inspect``
left them out, 28,752 B against ``plan``'s 28,792 B)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli

from graphflop.passes.optimizer import optimizer_state_bytes, step_count_bytes
from graphflop.runtime.optim import torch_optimizer

TNET = """
import torch, torch.nn as nn


class TNet(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.SiLU(), nn.Linear(hidden, 10),
        )

    def forward(self, x):
        return self.net(x)


def example_inputs():
    return (torch.randn(4, 1, 8, 8),)
"""

# TNet's parameters, 10 tensors: Linear(64, 32) 64·32 + 32 = 2,080; BatchNorm1d(32) 2·32 = 64;
# Linear(32, 32) 1,056; LayerNorm(32) 64; Linear(32, 10) 330: 3,594 float32 elements, 14,376 B
PARAM_BYTES, TENSORS = 3594 * 4, 10
# Adam/AdamW: two moments like each parameter, and a float32 step count per parameter tensor;
# momentum: one buffer like each parameter; plain SGD: nothing
EXPECTED = {
    "adam": 2 * PARAM_BYTES + TENSORS * 4,  # 28,792
    "adamw": 2 * PARAM_BYTES + TENSORS * 4,
    "momentum": PARAM_BYTES,  # 14,376
    "sgd": 0,
}


@pytest.fixture(scope="module")
def tnet(tmp_path_factory):
    f = tmp_path_factory.mktemp("tnet") / "tnet.py"
    f.write_text(TNET)
    return f


def _measured_state_bytes(path, optimizer: str) -> int:
    """One eager training step on the CPU; the bytes of every tensor ``optimizer.state``
    holds after it (on whatever device torch put it: Adam's steps are on the CPU)."""
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    torch.manual_seed(0)
    model = ns["TNet"]()
    opt = torch_optimizer(optimizer, model.parameters(), lr=1e-3)
    model(*ns["example_inputs"]()).sum().backward()
    opt.step()
    return sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


@pytest.mark.parametrize("optimizer", sorted(EXPECTED))
def test_inspect_and_plan_count_what_torch_optim_allocates(capsys, tmp_path, tnet, optimizer):
    measured = _measured_state_bytes(tnet, optimizer)
    assert measured == EXPECTED[optimizer]
    rc, out, err = cli(capsys, "inspect", tnet, "--optimizer", optimizer, "--format", "json")
    assert rc == 0, err
    assert json.loads(out)["memory"]["optimizer_state_bytes"] == measured
    plan = tmp_path / "plan.json"
    # plan's memory figures describe cuda by default, inspect's cpu: the count is the same
    for device in ("cuda", "cpu"):
        argv = ("plan", tnet, "--optimizer", optimizer, "--memory-device", device)
        rc, _, err = cli(capsys, *argv, "--json", plan)
        assert rc == 0, err
        ranks = json.loads(plan.read_text())["ranks"]
        assert ranks[0]["memory_bytes"]["optimizer_state"] == measured


def test_the_state_formula():
    # 2 moments of 1,000 B and 3 float32 step counts; momentum one buffer; SGD none
    assert optimizer_state_bytes("adam", 1000, 3) == 2 * 1000 + 3 * 4
    assert optimizer_state_bytes("adamw", 1000, 3) == 2012
    assert optimizer_state_bytes("momentum", 1000, 3) == 1000
    assert optimizer_state_bytes("sgd", 1000, 3) == 0
    assert (step_count_bytes("adam"), step_count_bytes("momentum")) == (4, 0)
