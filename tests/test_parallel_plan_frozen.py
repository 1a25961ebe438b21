"""``graphflop plan`` with frozen parameters (the LoRA / QLoRA set-up), a TP degree that shards
nothing, and the analysis's assumptions: hand counts, the arithmetic in the comments; the
ZeRO figures equal what torch's engines did on the same model (gloo, 2 ranks, logged with
``graphflop.runtime.parallel_probe``; the probe itself is run in
tests/test_parallel_plan_probe.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import ROOT
from torch import nn

from graphflop.analysis import analyze
from graphflop.cli import main
from graphflop.load import load, make_inputs
from graphflop.parallel import Plan, PlanError, predict

# the tester's model: a frozen input Linear(4, 8); 3 blocks, each a frozen Linear(8, 8) `a`
# and a trainable Linear(8, 8) `b`; a trainable head Linear(8, 3)
PART_FROZEN = """
import torch
from torch import nn


class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.a.requires_grad_(False)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class PartFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.emb.requires_grad_(False)
        self.blocks = nn.ModuleList(Blk() for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def example_inputs():
    return (torch.randn(2, 4),)
"""


@pytest.fixture(scope="module")
def part_frozen(tmp_path_factory):
    f = tmp_path_factory.mktemp("frozen") / "partfrozen.py"
    f.write_text(PART_FROZEN)
    loaded = load(str(f), meta=True)
    a = analyze(loaded.model, make_inputs(loaded, shapes=[(2, 4)]), optimizer="adamw", jvp=False)
    return loaded.model, a


# trainable: 3 × b (64 + 8 = 72) + head (24 + 3 = 27) = 243 elements, 8 tensors; frozen: emb
# (32 + 8 = 40) + 3 × a (72) = 256 elements
TRAINABLE, TENSORS, FROZEN = 243, 8, 256


def test_optimizer_state_is_the_trainable_parameters(part_frozen):
    """Adam's state is two moments of each trainable element plus a float32 step count per
    trainable tensor: 243 · 8 + 8 · 4 = 1,976 B (torch's DDP + AdamW logged 1,976 B of
    optimizer state on each rank). Divided by all parameter bytes it was 979 B."""
    model, a = part_frozen
    for zero in (0, 1):
        r = predict(a, model, Plan(dp=2, zero=zero), micro_batch=2).ranks[0]
        assert r.memory_bytes["parameters"] == (TRAINABLE + FROZEN) * 4 == 1_996
        assert r.memory_bytes["gradients"] == TRAINABLE * 4 == 972
        if zero == 0:
            assert r.memory_bytes["optimizer_state"] == TRAINABLE * 8 + TENSORS * 4 == 1_976
        else:
            # ZeroRedundancyOptimizer over the trainable tensors, largest first to the rank
            # with fewer elements: 64 → r0, 64 → r1, 64 → r0 (128), 24, 8, 8, 8, 3 → r1 (115);
            # the fullest, rank 0: 128 · 8 + 2 · 4 = 1,032 B
            assert r.memory_bytes["optimizer_state"] == 128 * 8 + 2 * 4 == 1_032


def test_lora_optimizer_state(tmp_path):
    """models/lora.py, Adam: 2,344 trainable elements (the adapters) in 4 tensors:
    2,344 · 8 + 4 · 4 = 18,768 B (it was 2,055 B: 18,752 B spread over all 21,554 parameters
    and taken back at the trainable share)."""
    out = tmp_path / "p.json"
    assert main(["plan", "models/lora.py", "--json", str(out)]) == 0
    mem = json.loads(out.read_text())["ranks"][0]["memory_bytes"]
    assert mem["optimizer_state"] == 2_344 * 8 + 4 * 4 == 18_768
    assert mem["gradients"] == 2_344 * 4


def test_zero3_shards_and_gathers_frozen_parameters(part_frozen):
    """FSDP2 (fully_shard per block, then the root) shards every parameter, frozen ones too,
    gathers them with the trainable ones, and reduce-scatters the trainable gradients only.
    At dp 2 (dim 0 padded to a multiple of 2): a block gathers a (64 + 8) and b (64 + 8) =
    144 elements, forward and backward, and reduce-scatters b's 72; the root gathers emb
    (32 + 8) and head (4 rows · 8 + 4 = 36) = 76 and reduce-scatters head's 36. Parameters
    per rank (3 · 144 + 76) / 2 = 254 elements = 1,016 B; gradients and state of the trainable
    shard (3 · 72 + 36) / 2 = 126 elements: 504 B and 126 · 8 + 8 · 4 = 1,040 B. All equal
    torch's (gloo, 2 ranks: 254 local elements, 1,016 B of parameters, 1,040 B of AdamW state
    on rank 0, and these collectives); before, frozen weights stayed whole (1,528 B) and were
    never gathered (72 and 36)."""
    model, a = part_frozen
    r = predict(a, model, Plan(dp=2, zero=3), micro_batch=2).ranks[0]
    assert Counter(c.key() for c in r.collectives) == Counter(
        {
            ("all_gather", 2, 144, "float32", "forward"): 3,
            ("all_gather", 2, 144, "float32", "backward"): 3,
            ("reduce_scatter", 2, 72, "float32", "backward"): 3,
            ("all_gather", 2, 76, "float32", "forward"): 1,
            ("reduce_scatter", 2, 36, "float32", "backward"): 1,
        }
    )
    assert r.memory_bytes["parameters"] == 254 * 4 == 1_016
    assert r.memory_bytes["gradients"] == 126 * 4
    assert r.memory_bytes["optimizer_state"] == 126 * 8 + TENSORS * 4 == 1_040


def test_zero2_gathers_and_reduces_whole_units(part_frozen):
    """FSDP1 SHARD_GRAD_OP (use_orig_params) puts a block's frozen and trainable parameters in
    one flat parameter and reduce-scatters its whole flat gradient: 144 per block gathered and
    reduce-scattered (torch logged both), the parameters sharded (254 elements as above),
    gradients of whole units (254 · 4 = 1,016 B); a note says what is not counted."""
    model, a = part_frozen
    rep = predict(a, model, Plan(dp=2, zero=2), micro_batch=2)
    r = rep.ranks[0]
    keys = Counter(c.key() for c in r.collectives if c.elements == 144)
    assert keys == Counter(
        {
            ("all_gather", 2, 144, "float32", "forward"): 3,
            ("reduce_scatter", 2, 144, "float32", "backward"): 3,
        }
    )
    assert r.memory_bytes["parameters"] == r.memory_bytes["gradients"] == 1_016
    assert any(n.startswith("ZeRO-2 (FSDP SHARD_GRAD_OP") for n in rep.notes)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_parameter_frozen(zero):
    """Linear(3, 3) frozen: no gradient, no state, no reduction. ZeRO 2/3 shard and gather its
    3 · 3 + 3 parameters, dim 0 padded to 4: (4 · 3 + 4) = 16 elements gathered once in the
    forward (nothing is differentiated, so no backward gather), 8 per rank, 32 B. It raised
    KeyError '(root)' under ZeRO 2 and 3."""
    m = nn.Linear(3, 3)
    m.requires_grad_(False)
    a = analyze(m, (torch.randn(2, 3),), jvp=False)
    r = predict(a, m, Plan(dp=2, zero=zero), micro_batch=2).ranks[0]
    assert r.memory_bytes["gradients"] == r.memory_bytes["optimizer_state"] == 0
    assert r.flops["update"] == 0
    keys = Counter(c.key() for c in r.collectives)
    if zero >= 2:
        assert keys == Counter({("all_gather", 2, 16, "float32", "forward"): 1})
        assert r.memory_bytes["parameters"] == 8 * 4
    else:
        assert r.memory_bytes["parameters"] == 12 * 4
        assert not [k for k in keys if k[0] in ("all_reduce", "reduce_scatter")]


CONV1D_NET = """
import torch
from torch import nn


class Conv1D(nn.Module):
    # HF GPT-2's layer: a Linear with its weight stored (in, out), applied with addmm
    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = Conv1D(16, 8)
        self.c_proj = Conv1D(4, 16)

    def forward(self, x):
        return self.c_proj(torch.relu(self.c_fc(x)))


def example_inputs():
    return (torch.randn(2, 8),)
"""


def test_tp_that_shards_nothing_is_refused(tmp_path, capsys):
    """No nn.Linear or nn.Embedding: TP 2 would give every rank the whole model (it printed
    100 % per rank, 0 TP bytes, exit 0): refused in one line, exit 2, naming the classes."""
    f, out = tmp_path / "conv1d.py", tmp_path / "p.json"
    f.write_text(CONV1D_NET)
    assert main(["plan", str(f), "--tp", "2", "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--tp 2 shards nothing" in err[0] and "Conv1D ×2" in err[0]
    assert "drop --tp" in err[0] and "build the model from nn.Linear layers" in err[0]
    assert not out.exists()
    assert main(["plan", str(f), "--dp", "2"]) == 0


def test_tp_refusal_says_the_root_s_own_linears_are_not_paired(tmp_path, capsys):
    """A tester's finding: models/cnn.py --tp 2 was refused as sharding nothing although the
    CNN has two Linears (fc1, fc2, held by the root module, which the default plan does not
    pair). The line says so and gives the plan that pairs them; that plan runs (exit 0)."""
    cnn = str(ROOT / "models/cnn.py")
    assert main(["plan", cnn, "--tp", "2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--tp 2 shards nothing" in line and "Linear ×2" in line, line
    assert "not those the root module holds itself (fc1, fc2)" in line, line
    assert '{"fc1": "colwise", "fc2": "rowwise"}' in line, line
    plan = tmp_path / "plan.json"
    plan.write_text('{"fc1": "colwise", "fc2": "rowwise"}')
    assert main(["plan", cnn, "--tp", "2", "--tp-plan", str(plan)]) == 0


def test_unsharded_convolutions_refused_by_class():
    # a convolution stack: neither Conv2d weight can be sharded and no Linear or Embedding
    # exists, so TP shards nothing
    m = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten())
    a = analyze(m, (torch.randn(2, 2, 6, 6),), jvp=False)
    with pytest.raises(PlanError, match=r"--tp 2 shards nothing.*Conv2d ×2"):
        predict(a, m, Plan(tp=2), micro_batch=2)


MOE_NET = """
import torch
from torch import nn
import torch.nn.functional as F


class MoE(nn.Module):
    def __init__(self, d=8, e=4, k=2):
        super().__init__()
        self.router = nn.Linear(d, e, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(e))
        self.k = k

    def forward(self, x):
        w, idx = torch.topk(self.router(x).softmax(-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            out = out.index_add(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


def example_inputs():
    return (torch.randn(6, 8),)
"""


def test_plan_states_the_routing_assumption(tmp_path, capsys):
    """A routed mixture of experts: the dispatch's rows per expert are an assumption
    (balanced: 6 tokens · top-2 = 12 rows over 4 experts, 3 each). ``plan`` prints it as
    ``inspect`` does and records it in its JSON."""
    f, out = tmp_path / "moe.py", tmp_path / "p.json"
    f.write_text(MOE_NET)
    assert main(["plan", str(f), "--json", str(out)]) == 0
    err = capsys.readouterr().err
    said = json.loads(out.read_text())["assumptions"]
    assert len(said) == 1 and "12 token-expert rows over 4 experts" in said[0]
    assert f"assumption: {said[0]}" in err
    assert main(["plan", "models/lora.py", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["assumptions"] == []


def test_pipeline_blocks_are_the_outermost_list():
    """A tester's finding: a mixture of experts' 4 experts (layers.0.experts, the longest list
    of one class) were taken for the pipeline's blocks, and a stage boundary cut layer 0 in
    two; its 3 layers are the blocks."""
    from torch import nn

    from graphflop.parallel.predict import find_blocks

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(2, 2)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(2, 4)
            self.experts = nn.ModuleList(Expert() for _ in range(4))

    class Model(nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.emb = nn.Linear(2, 2)
            self.layers = nn.ModuleList(Layer() for _ in range(n))

    assert find_blocks(Model(3)) == ["layers.0", "layers.1", "layers.2"]
    assert find_blocks(Model(1)) == [
        "layers.0.experts.0",
        "layers.0.experts.1",
        "layers.0.experts.2",
        "layers.0.experts.3",
    ]
