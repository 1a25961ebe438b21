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


def _measured_state_bytes(path, optimizer: str, name: str = "TNet") -> int:
    """One eager training step on the CPU; the bytes of every tensor ``optimizer.state``
    holds after it (on whatever device torch put it: Adam's steps are on the CPU)."""
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    torch.manual_seed(0)
    model = ns[name]()
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


PARTIAL = """
import torch, torch.nn as nn


class Partial(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.gate = nn.Linear(8, 16)  # read only under no_grad: no gradient
        self.spare = nn.Linear(16, 4)  # never read: no gradient
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        with torch.no_grad():
            g = torch.sigmoid(self.gate(x))
        return self.head(self.fc(x) * g)


def example_inputs():
    return (torch.randn(4, 8),)
"""

# Partial's parameters with a gradient: fc 8·16 + 16 = 144 and head 16·4 + 4 = 68, 212 float32
# elements (848 B) in 4 tensors; gate (144) and spare (68) keep .grad None: torch.optim makes
# no state for them
GRADED_BYTES, GRADED_TENSORS = 212 * 4, 4
EXPECTED_PARTIAL = {
    "adam": 2 * GRADED_BYTES + GRADED_TENSORS * 4,  # 1,712
    "adamw": 2 * GRADED_BYTES + GRADED_TENSORS * 4,
    "momentum": GRADED_BYTES,  # 848
    "sgd": 0,
}


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    f = tmp_path_factory.mktemp("partial") / "partial.py"
    f.write_text(PARTIAL)
    return f


@pytest.mark.parametrize("optimizer", sorted(EXPECTED_PARTIAL))
def test_no_state_for_parameters_without_a_gradient(capsys, tmp_path, partial, optimizer):
    """A parameter read only under no_grad and one never read keep ``.grad`` None, and
    ``torch.optim`` skips them (no state); inspect and plan counted theirs (Adam 2,264 B
    against torch's 1,712)."""
    measured = _measured_state_bytes(partial, optimizer, "Partial")
    assert measured == EXPECTED_PARTIAL[optimizer]
    rc, out, err = cli(capsys, "inspect", partial, "--optimizer", optimizer, "--format", "json")
    assert rc == 0, err
    assert json.loads(out)["memory"]["optimizer_state_bytes"] == measured
    plan = tmp_path / "plan.json"
    for device in ("cuda", "cpu"):
        argv = ("plan", partial, "--optimizer", optimizer, "--memory-device", device)
        rc, _, err = cli(capsys, *argv, "--json", plan)
        assert rc == 0, err
        ranks = json.loads(plan.read_text())["ranks"]
        assert ranks[0]["memory_bytes"]["optimizer_state"] == measured
