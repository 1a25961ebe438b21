"""``plan --pp``: the units a stage boundary may fall between come from the analysis's
hierarchy (the chain of outlined block calls), the split is balanced by their FLOPs, and
``--blocks`` (one block per stage analysed, the others counted from it) gives the full
analysis's figures."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch
from torch import nn

from graphflop.analysis import analyze
from graphflop.cli import main
from graphflop.load import load, make_inputs
from graphflop.meta import HIERARCHY
from graphflop.parallel import Plan, find_blocks, pipeline_units, predict

# ResNet-50: layer1..layer4 hold 3, 4, 6 and 3 bottlenecks
R50_UNITS = [
    f"layer{i}.{j}" for i, n in zip(range(1, 5), (3, 4, 6, 3), strict=True) for j in range(n)
]


@pytest.fixture(scope="module")
def resnet50():
    loaded = load("models/resnet.py:resnet50", meta=True)
    inputs = make_inputs(loaded, shapes=[(2, 3, 64, 64)])
    return loaded.model, analyze(loaded.model, inputs, optimizer="adam", jvp=False)


def test_resnet50_units_are_its_16_bottlenecks(resnet50):
    """The outlined calls are the 12 bottlenecks after each layer's first (the first has a
    downsampling branch, a structure of its own, traced in full); the units are all 16, the
    first ones added as modules of the calls' class in the chain, in execution order. The
    module structure alone gives one layer's list (layer3's 6)."""
    model, a = resnet50
    sites = a.forward.meta[HIERARCHY].sites
    assert len(sites) == 12
    assert pipeline_units(a.forward, model) == (R50_UNITS, "calls")
    assert find_blocks(model) == [f"layer3.{j}" for j in range(6)]


def _unit_costs(a):
    """FLOPs (forward + backward) of each bottleneck, of what runs before them (the stem) and
    after (pooling, fc, the loss), from the analysis's per-module rows."""
    cost = dict.fromkeys(R50_UNITS, 0)
    pre = post = 0
    for row in a.report.layers:
        c = row.forward_flops + row.backward_flops
        unit = next((u for u in R50_UNITS if row.name == u or row.name.startswith(u + ".")), None)
        if unit is not None:
            cost[unit] += c
        elif row.name in ("conv1", "bn1", "relu", "maxpool"):
            pre += c
        else:
            post += c
    return [cost[u] for u in R50_UNITS], pre, post


@pytest.mark.parametrize("pp, by_count", [(3, (6, 5, 5)), (5, (4, 3, 3, 3, 3))])
def test_resnet50_split_balanced_by_flops(resnet50, pp, by_count):
    """The stages' FLOPs are the module rows' sums for the split, and the split's costliest
    stage is the least of every split of the 16 bottlenecks into ``pp`` runs (searched here
    over all of them); the split by count is costlier."""
    model, a = resnet50
    rep = predict(a, model, Plan(pp=pp, micro_batches=pp), micro_batch=2)
    costs, pre, post = _unit_costs(a)

    def stage_costs(counts):
        out, i = [], 0
        for k in counts:
            out.append(sum(costs[i : i + k]))
            i += k
        out[0] += pre
        out[-1] += post
        return out

    counts = [len(st) for st in rep.stages]
    assert [u for st in rep.stages for u in st] == R50_UNITS
    per_mb = [(r.flops["forward"] + r.flops["backward"]) // pp for r in rep.ranks]
    assert per_mb == stage_costs(counts)
    least = min(
        max(stage_costs([b - a_ for a_, b in itertools.pairwise((0, *cuts, 16))]))
        for cuts in itertools.combinations(range(1, 16), pp - 1)
    )
    assert max(per_mb) == least
    assert max(stage_costs(by_count)) > least
    assert f"16 blocks (the chain of repeated block calls) into {pp} stages of " in rep.split


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Layer(nn.Module):
    """A dense mixture of 4 experts (each token to every expert, weighted by the gate); a
    residual scale of its own, so no two layers share a structure and only the experts are
    outlined."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(_Expert() for _ in range(4))

    def forward(self, x):
        w = torch.softmax(self.gate(x), dim=-1)
        mixed = sum(w[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))
        return x + self.scale * mixed


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.layers = nn.ModuleList(_Layer(0.5 + i) for i in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_experts_outlined_inside_layers_lift_to_the_layers():
    """Only the experts are outlined (12 calls); one expert per layer would chain through the
    layers' own nodes, and a boundary there would cut a layer: the units are the 3 layers."""
    model = _MoE()
    a = analyze(model, (torch.randn(5, 4),), optimizer="sgd", jvp=False)
    sites = a.forward.meta[HIERARCHY].sites
    assert sorted(dict(s.modules)["@.up"].rpartition(".")[0] for s in sites) == sorted(
        f"layers.{i}.experts.{j}" for i in range(3) for j in range(4)
    )
    assert pipeline_units(a.forward, model) == (["layers.0", "layers.1", "layers.2"], "calls")
    rep = predict(a, model, Plan(pp=3, micro_batches=3), micro_batch=5)
    assert rep.stages == (("layers.0",), ("layers.1",), ("layers.2",))


GPT2 = ("models/gpt2.py:GPT2", dict(n_head=2, n_embd=32, vocab_size=64, n_positions=16), "n_layer")
LLAMA = (
    "models/llama.py",
    dict(vocab=128, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128),
    "n_layers",
)


@pytest.mark.parametrize(
    "model, total, plan",
    [
        (GPT2, 7, Plan(pp=3, micro_batches=3)),
        (GPT2, 7, Plan(pp=2, micro_batches=4, schedule="gpipe")),
        (LLAMA, 6, Plan(pp=2, micro_batches=2, schedule="interleaved", chunks=2)),
        (LLAMA, 5, Plan(pp=2, micro_batches=2, dp=2, tp=2)),
    ],
)
def test_blocks_equal_the_full_analysis(model, total, plan):
    """The model built with one block per virtual stage, each standing for the blocks the
    full model's split gives its stage, has the full model's per-stage FLOPs, memory (every
    term, the peak's step rise among them: each stage's pipeline replay with the copies of its
    block offset in) and collectives, and the same split line."""
    spec, kw, name = model
    reports = []
    for n, total_blocks in ((total, None), (plan.virtual_stages, total)):
        loaded = load(spec, ctor_kwargs={**kw, name: n}, meta=True)
        inputs = make_inputs(loaded, shapes=[(2, 16)], dtype=torch.int64)
        a = analyze(loaded.model, inputs, optimizer="adam", jvp=False)
        reports.append(predict(a, loaded.model, plan, micro_batch=2, total_blocks=total_blocks))
    full, per_block = reports
    assert per_block.split == full.split
    assert f"{total} blocks (the chain of repeated block calls)" in full.split
    for f, b in zip(full.ranks, per_block.ranks, strict=True):
        assert b.flops == f.flops
        assert b.memory_bytes == f.memory_bytes
        assert Counter(c.key() for c in b.collectives) == Counter(c.key() for c in f.collectives)


def test_cli_blocks_equals_full(tmp_path, capsys):
    """``plan --pp 3 --blocks n_layer=7`` writes the per-stage memory and FLOPs and the split of
    ``plan --pp 3`` on the 7-block model (before: peaks 0.8 %, 14.0 % and 13.7 % lower, and a
    split line of 3 blocks, the analysed ones); the line's counts are the full model's stages'
    blocks."""
    spec, kw, _ = GPT2
    base = ["plan", spec, *[f"--arg={k}={v}" for k, v in kw.items()]]
    base += ["--input-shape", "2,16", "--dtype", "int64", "--pp", "3", "--micro-batches", "3"]
    docs = []
    for extra in (["--arg=n_layer=7"], ["--blocks", "n_layer=7"]):
        out = tmp_path / "plan.json"
        assert main([*base, *extra, "--json", str(out)]) == 0
        docs.append(json.loads(out.read_text()))
    full, per_block = docs
    assert per_block["split"] == full["split"]
    sizes = ", ".join(str(len(st)) for st in full["stages"])
    assert (
        f"7 blocks (the chain of repeated block calls) into 3 stages of {sizes} blocks"
        in (full["split"])
    )
    assert sum(len(st) for st in full["stages"]) == 7
    for f, b in zip(full["ranks"], per_block["ranks"], strict=True):
        assert b["memory_bytes"] == f["memory_bytes"]
        assert b["flops"] == f["flops"]
    assert " 7 blocks " in " ".join(capsys.readouterr().out.split())


def _transformers():
    pytest.importorskip("transformers")
    from graphflop.load import _preload_torchvision

    _preload_torchvision()  # transformers imports torchvision (graphflop.load's note)
    import transformers

    torch.manual_seed(0)
    return transformers


def test_t5_units_are_both_stacks_blocks():
    """T5's first block of each stack computes the position bias (a parameter of its own):
    only its feed-forward and cross-attention layers are outlined, with blocks 1 and 2 of each
    stack. The units are the 6 blocks, encoder's then decoder's (the decoder's first reads the
    encoder's last through the final norm); the module structure alone gives the encoder's 3."""
    transformers = _transformers()
    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_ff=32, num_layers=3, num_heads=2, d_kv=8, use_cache=False
    )
    model = transformers.T5ForConditionalGeneration(config).train()
    ids = torch.zeros(2, 8, dtype=torch.long)
    a = analyze(model, ((ids,), {"decoder_input_ids": ids}), jvp=False)
    blocks = [f"{stack}.block.{i}" for stack in ("encoder", "decoder") for i in range(3)]
    assert pipeline_units(a.forward, model) == (blocks, "calls")
    assert find_blocks(model) == blocks[:3]


def test_dense_first_layer_before_moe_layers():
    """Qwen2-MoE with layer 0 dense (``mlp_only_layers``) and layers 1-3 mixtures of experts:
    layers 1-3 are outlined, and layer 0's attention with them (the same structure); layer 0,
    of the layers' class and enclosing that call, is the unit, not its attention (a boundary
    after which would cut layer 0): 4 layers."""
    transformers = _transformers()
    config = transformers.Qwen2MoeConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        use_cache=False,
    )
    model = transformers.Qwen2MoeForCausalLM(config).train()
    a = analyze(model, (torch.zeros(2, 8, dtype=torch.long),), jvp=False)
    called = {
        dict(s.modules).get("@.q_proj", "").rpartition(".")[0]
        for s in a.forward.meta[HIERARCHY].sites
    }
    assert "model.layers.0.self_attn" in called
    layers = [f"model.layers.{i}" for i in range(4)]
    assert pipeline_units(a.forward, model) == (layers, "calls")


def test_balanced_split_by_hand():
    """Identical units, nothing around them: the split by count, the first stages taking the
    remainder (7 into 3: 3, 2, 2, not 3, 3, 1, whose costliest stage ties); costs 5, 1, 1, 1, 5
    into 3: 1, 3, 1 (stages 5, 3, 5); a head of 3 after 4 units of 2 into 2: 3, 1 would cost
    6 and 5, 2, 2 cost 4 and 7: 3, 1 (its costliest 6)."""
    from graphflop.parallel.predict import _balanced_split

    assert _balanced_split([1] * 7, 3, 0, 0) == [3, 2, 2]
    assert _balanced_split([5, 1, 1, 1, 5], 3, 0, 0) == [1, 3, 1]
    assert _balanced_split([2] * 4, 2, 0, 3) == [3, 1]
    with pytest.raises(ValueError):
        _balanced_split([1, 1], 3, 0, 0)
