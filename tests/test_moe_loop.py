"""Mixture-of-experts layers written as a loop over their experts (``torch.where(idx == e)``,
``x[mask]``): their data-dependent dispatch traced under a routing assumption
(:mod:`graphflop.frontend.dispatch`), counted against hand counts and against the same layer
written as one grouped product per layer (transformers' ``grouped_mm_fallback``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
D, H = 16, 32  # model width, expert hidden width


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(D, H), nn.SiLU(), nn.Linear(H, D))


class LoopMoE(nn.Module):
    """Top-k routing, each expert's pairs picked with ``torch.where(idx == e)``."""

    def __init__(self, experts: int = 4, k: int = 2):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(D, experts, bias=False)
        self.experts = nn.ModuleList(_expert() for _ in range(experts))

    def forward(self, x):  # x: (T, D)
        w, idx = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


class MaskTop1(nn.Module):
    """Top-1 routing, each expert's tokens picked with a boolean mask."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(D, experts, bias=False)
        self.experts = nn.ModuleList(_expert() for _ in range(experts))

    def forward(self, x):
        w, idx = self.gate(x).softmax(-1).topk(1, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = (idx == e).any(-1)
            out[mask] = expert(x[mask]) * w[mask]
        return out


class GroupedMoE(nn.Module):
    """The layer of :class:`LoopMoE` as transformers' grouped path computes it: the T·k pairs
    sorted by expert, one grouped product per expert layer."""

    def __init__(self, op, experts: int = 4, k: int = 2):
        super().__init__()
        self.op, self.k, self.e = op, k, experts
        self.gate = nn.Linear(D, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, D, H))
        self.b1 = nn.Parameter(torch.zeros(experts, H))
        self.w2 = nn.Parameter(torch.randn(experts, H, D))
        self.b2 = nn.Parameter(torch.zeros(experts, D))

    def forward(self, x):
        w, idx = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        flat = idx.reshape(-1)
        order = flat.argsort()
        ex = flat[order]
        xs = x[order // self.k]
        counts = torch.histc(flat.float(), bins=self.e, min=0, max=self.e - 1)
        offs = counts.cumsum(0).to(torch.int32)
        h = nn.functional.silu(self.op(xs, self.w1, offs) + self.b1[ex])
        y = (self.op(h, self.w2, offs) + self.b2[ex]) * w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, order // self.k, y)


def _totals(model, tokens):
    from graphflop.analysis import analyze

    report = analyze(model, (torch.randn(tokens, D),), name="moe").report
    assert not report.uncounted
    t = report.totals
    return report, (t.forward.mm_flops, t.backward.mm_flops, t.jvp.mm_flops)


def _hand(tokens: int, experts: int, k: int) -> tuple[int, int, int]:
    """Forward, backward and weight-JVP mm FLOPs of the layer: the router 2·T·D·E; each of the
    T·k token-expert rows 2·D·H + 2·H·D through its expert. Backward: the router's weight
    gradient 2·T·D·E; per row the two weight gradients (2·D·H each) and the hidden cotangent
    through the second layer (2·H·D); no cotangent of the input x (it needs none). JVP with
    parameter tangents: x·dWg (2·T·D·E); per row x·dW1, h'·W2 and h·dW2 (2·D·H each)."""
    router = 2 * tokens * D * experts
    rows = tokens * k
    per_row = 2 * D * H
    return router + rows * 2 * per_row, router + rows * 3 * per_row, router + rows * 3 * per_row


def test_where_loop_balanced_counts_the_rows_of_the_grouped_path():
    # T = 8, k = 2, E = 4: 16 rows, 4 per expert. Forward 2·8·16·4 = 1,024 (router)
    # + 16·(1,024 + 1,024) = 32,768; backward and JVP 1,024 + 16·3·1,024 = 50,176
    report, got = _totals(LoopMoE(), 8)
    assert got == _hand(8, 4, 2) == (33_792, 50_176, 50_176)
    # every expert's first linear: 4 rows · (2·16·32 + 32 bias) = 4,224 FLOPs
    for e in range(4):
        assert report.layer(f"experts.{e}.0").forward_flops == 4 * (2 * D * H + H)
    (line,) = report.assumptions
    assert "routing balanced" in line and "16 token-expert rows over 4 experts" in line
    assert "{0: 4, 1: 4, 2: 4, 3: 4}" in line


def test_where_loop_equals_the_grouped_formulation():
    pytest.importorskip("transformers")
    from graphflop.load import _preload_torchvision

    _preload_torchvision()
    import transformers.integrations.moe  # noqa: F401  (defines the op)

    op = torch.ops.transformers.grouped_mm_fallback
    _, loop = _totals(LoopMoE(), 8)
    _, grouped = _totals(GroupedMoE(op), 8)
    assert loop == grouped == _hand(8, 4, 2)


def test_top1_mask_loop():
    # T = 8, k = 1, E = 4: 8 rows, 2 per expert. Forward 1,024 + 8·2,048 = 17,408;
    # backward and JVP 1,024 + 8·3,072 = 25,600
    report, got = _totals(MaskTop1(), 8)
    assert got == _hand(8, 4, 1) == (17_408, 25_600, 25_600)
    assert "{0: 2, 1: 2, 2: 2, 3: 2}" in report.assumptions[0]


def test_eq_nonzero_form():
    """``idx.eq(e).nonzero()``: the same rows as ``torch.where(idx == e)``."""

    class EqNonzero(LoopMoE):
        def forward(self, x):
            w, idx = self.gate(x).softmax(-1).topk(self.k, dim=-1)
            out = torch.zeros_like(x)
            for e in range(len(self.experts)):
                tok, slot = idx.eq(e).nonzero().unbind(1)
                out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
            return out

    _, got = _totals(EqNonzero(), 8)
    assert got == _hand(8, 4, 2)


def test_experts_not_dividing_the_rows():
    # T = 5, k = 2, E = 4: 10 rows, ⌊10/4⌋ = 2 each and the 10 mod 4 = 2 left over one each to
    # experts 0 and 1: 3, 3, 2, 2 (summing to T·k). Forward 2·5·16·4 = 640 + 10·2,048 =
    # 21,120; backward and JVP 640 + 10·3,072 = 31,360
    report, got = _totals(LoopMoE(), 5)
    assert got == _hand(5, 4, 2) == (21_120, 31_360, 31_360)
    assert "{0: 3, 1: 3, 2: 2, 3: 2}" in report.assumptions[0]
    assert report.layer("experts.0.0").forward_flops == 3 * (2 * D * H + H)
    assert report.layer("experts.3.0").forward_flops == 2 * (2 * D * H + H)


def test_repeated_blocks_traced_once_get_the_same_sizes():
    """Three identical residual blocks (traced once and copied): each counts as one."""

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(LoopMoE() for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    # T = 5: forward 3·21,120 = 63,360. Backward: the first block as alone (31,360); the
    # others also need their input's cotangent, through the router (2·5·4·16 = 640) and each
    # row's first linear (10·2·32·16 = 10,240): 31,360 + 2·(31,360 + 640 + 10,240) = 115,840;
    # the JVP with parameter tangents carries the tangent through the inputs of blocks 2 and
    # 3 the same way: 115,840
    report, got = _totals(Stack(), 5)
    assert got == (63_360, 115_840, 115_840)
    assert "{0: 3, 1: 3, 2: 2, 3: 2}" in report.assumptions[0]


def test_histogram_routing():
    from graphflop.ops.transformers_ops import Routing, routing

    # counts 5:1:1:1 of the 16 rows: 10, 2, 2, 2; the mm FLOPs are those of the 16 rows still
    with routing(Routing("histogram", counts=(5.0, 1.0, 1.0, 1.0))):
        report, got = _totals(LoopMoE(), 8)
    assert got == _hand(8, 4, 2)
    assert report.layer("experts.0.0").forward_flops == 10 * (2 * D * H + H)
    assert report.layer("experts.1.0").forward_flops == 2 * (2 * D * H + H)
    assert "histogram [5, 1, 1, 1]" in report.assumptions[0]
    assert "{0: 10, 1: 2, 2: 2, 3: 2}" in report.assumptions[0]


def test_apportioning_sums_to_the_rows():
    from graphflop.ops.transformers_ops import Routing

    # 7 rows by 1:1:1: shares 2.33 each; the one left over goes to expert 0
    hist = Routing("histogram", counts=(1.0, 1.0, 1.0))
    assert [hist.expert_rows(7, 3, e) for e in range(3)] == [3, 2, 2]
    assert [Routing().expert_rows(7, 3, e) for e in range(3)] == [3, 2, 2]
    assert Routing().expert_rows(7, 3, 3) == 0  # no index equals E
    with pytest.raises(ValueError, match="one count per expert"):
        hist.expert_rows(8, 4, 0)


def test_capacity_is_refused_for_a_loop():
    from graphflop.analysis import analyze
    from graphflop.frontend.trace import TraceError
    from graphflop.ops.transformers_ops import Routing, routing

    with routing(Routing("capacity", factor=1.25)), pytest.raises(TraceError) as e:
        analyze(LoopMoE(), (torch.randn(8, D),), name="moe")
    assert "capacity" in str(e.value) and "balanced" in str(e.value)


def _write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "m.py"
    p.write_text("import torch\nfrom torch import nn\n" + textwrap.dedent(body))
    return p


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "graphflop.cli", "inspect", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


_LOOP_FILE = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        w, idx = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out

def example_inputs():
    return (torch.zeros(8, 16),)
"""


@pytest.mark.slow
def test_cli_reports_the_routing_and_refuses_what_it_cannot_tie(tmp_path):
    model = _write(tmp_path, _LOOP_FILE)
    hist = tmp_path / "hist.json"
    hist.write_text("[5, 1, 1, 1]")
    out = tmp_path / "r.json"
    r = _cli(str(model), "--routing", str(hist), "--json", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    (line,) = doc["assumptions"]
    assert "histogram [5, 1, 1, 1]" in line and "{0: 10, 1: 2, 2: 2, 3: 2}" in line
    assert "assumption: data-dependent expert dispatch" in r.stderr
    # router 2·8·16·4 = 1,024; 16 rows · 2·16·16 = 8,192
    assert doc["totals"]["forward"]["mm_flops"] == 1_024 + 8_192

    r = _cli(str(model), "--routing", "capacity:1.25", "--json", str(tmp_path / "c.json"))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "capacity buffer" in r.stderr and "balanced or a histogram" in r.stderr
    assert not (tmp_path / "c.json").exists()

    # a nonzero tied to no router is refused as before, in one line
    other = _write(
        tmp_path,
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(x[x > 0].reshape(-1, 4))

        def example_inputs():
            return (torch.zeros(2, 4),)
        """,
    )
    r = _cli(str(other))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "shape depends on a tensor's values" in r.stderr
    r = _cli(str(other), "--routing", str(hist))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "shape depends on a tensor's values" in r.stderr

    # a histogram for a model that routes nothing: refused after the trace, no output file
    dense = _write(
        tmp_path,
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(x)

        def example_inputs():
            return (torch.zeros(2, 4),)
        """,
    )
    r = _cli(str(dense), "--routing", str(hist), "--json", str(tmp_path / "d.json"))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "has none: drop it" in r.stderr
    assert not (tmp_path / "d.json").exists()


@pytest.mark.slow
def test_transformers_eager_experts_are_refused_with_the_fix():
    """transformers' ``eager`` experts loop over the tensor of experts hit and branch on its
    values (``if expert_idx == num_experts``), which no routing size makes traceable: refused
    in one line naming the grouped implementation."""
    pytest.importorskip("transformers")
    tiny = ["num_hidden_layers=1", "hidden_size=64", "intermediate_size=128"]
    tiny += ["num_attention_heads=4", "num_key_value_heads=2", "vocab_size=100"]
    args = [a for t in tiny for a in ("--arg", t)]
    r = _cli("hf:mixtral", *args, "--arg", "experts_implementation=eager", "--seq", "16")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "MixtralExperts" in r.stderr
    assert "--arg experts_implementation=grouped_mm" in r.stderr


def test_a_dispatch_not_tied_to_the_routing_says_how_to_write_it():
    from graphflop.analysis import analyze
    from graphflop.frontend.trace import TraceError

    class CountMask(LoopMoE):
        def forward(self, x):
            w, idx = self.gate(x).softmax(-1).topk(self.k, dim=-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                chosen = (idx == e).sum(-1) > 0  # not followed: a sum, then a comparison
                out[chosen] = expert(x[chosen])
            return out

    class Shifted(LoopMoE):
        def forward(self, x):
            w, idx = self.gate(x).softmax(-1).topk(self.k, dim=-1)
            idx.add_(1)  # written in place: no longer the router's indices
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                tok, slot = torch.where(idx == e)
                out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
            return out

    with pytest.raises(TraceError, match="not tied to the routing"):
        analyze(Shifted(), (torch.randn(8, D),), name="moe")
    with pytest.raises(TraceError) as e:
        analyze(CountMask(), (torch.randn(8, D),), name="moe")
    msg = str(e.value)
    assert "\n" not in msg and "not tied to the routing" in msg
    assert "torch.where(idx == e)" in msg and "test_moe_loop.py" in msg


@pytest.mark.slow  # (moved out of the default suite: its 300 s budget)
def test_forward_gradient_check_runs_on_the_real_routing(monkeypatch):
    """A tester's finding: the forward-gradient check batched its directions into one step whose
    tangents reshape K directions' rows to the traced (balanced) row count, and the real inputs'
    routing gave others: NOT RUN. The check runs one direction per step on such a graph, with
    the rows the real inputs route, and its χ² test still has power (a quartered estimate
    fails: u·ḡ/‖∇L‖ ≈ 0.25, below the acceptance interval's 0.454 for M = 100)."""
    import graphflop.passes.forward_gradient as fg
    from graphflop.frontend.trace import trace
    from graphflop.passes.forward_gradient import data_dependent
    from graphflop.runtime.verify import real_arguments
    from graphflop.runtime.verify_fg import verify_forward_gradient

    torch.manual_seed(0)
    model = LoopMoE()
    with torch.no_grad():  # a router that sends most pairs to expert 0: rows far from 4 each
        model.gate.weight[0] += 2.0
    fwd = trace(model, (torch.randn(8, D),), loss="sum")
    assert data_dependent(fwd)
    # the check's input: N(0, 1) drawn from seed 0 (real_arguments, as the check draws it)
    (x,) = [v for n, v in real_arguments(fwd, model).items() if n == "args_0"]
    idx = model.gate(x).topk(2, dim=-1).indices
    rows = [int((idx == e).sum()) for e in range(4)]
    assert rows != [4, 4, 4, 4] and sum(rows) == 16, rows  # not the traced routing
    c = verify_forward_gradient(fwd, model, samples=100)
    assert c.ran and c.ok, c
    assert "100 steps of 1" in c.where

    real = fg._estimate

    def quartered(b, info, ds, vs):
        grads = real(b, info, ds, vs)
        return {p: b.call(torch.ops.aten.mul.Tensor, g, 0.25) for p, g in grads.items()}

    monkeypatch.setattr(fg, "_estimate", quartered)
    c = verify_forward_gradient(fwd, model, samples=100)
    assert c.ran and not c.ok, c


@pytest.mark.slow
def test_cli_verify_runs_every_check_on_the_real_routing(tmp_path):
    """``inspect --verify`` of a loop over experts: the example inputs (zeros: every token's
    top 2 are experts 0 and 1, 8 rows each) route otherwise than the traced balanced 4 each,
    and all three checks run and pass (the forward-gradient one was NOT RUN, exit 1)."""
    model = _write(tmp_path, _LOOP_FILE)
    r = _cli(str(model), "--verify", "--format", "json")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("verify: ")]
    assert len(lines) == 4 and lines[-1] == "verify: 3 of 3 checks passed", r.stderr
    assert "forward-gradient estimate unbiased" in lines[2] and ": passed:" in lines[2]


def test_a_forward_gradient_step_of_several_directions_runs_on_the_real_routing(monkeypatch):
    """A step of K = 3 directions batched into one tangent pass reshaped the directions' rows to
    the traced (balanced) count and failed on inputs routed otherwise (``train --method fgd
    --directions K``: an internal error). Such a graph takes K copies: the same FLOPs as the
    batched pass (built on the traced sizes, where it runs), and on unbalanced inputs each
    direction's derivative d_k = ∇L·v_k equals torch.func.jvp's along v_k."""
    import graphflop.passes.forward_gradient as fg
    from graphflop.frontend.trace import trace
    from graphflop.meta import FORWARD_GRADIENT, SIGNATURE
    from graphflop.passes.flops import annotate_flops
    from graphflop.runtime.verify import real_arguments

    torch.manual_seed(0)
    model = LoopMoE()
    fwd = trace(model, (torch.randn(8, D),), loss="sum")
    step = annotate_flops(
        fg.build_forward_gradient_step(fwd, "sgd", directions=3, direction_inputs=True)
    )
    info = step.meta[FORWARD_GRADIENT]
    assert info.tangent_pass.startswith("copies: a size that depends on values")
    monkeypatch.setattr(fg, "data_dependent", lambda gm: False)
    batched = annotate_flops(
        fg.build_forward_gradient_step(fwd, "sgd", directions=3, direction_inputs=True)
    )
    monkeypatch.undo()
    assert batched.meta[FORWARD_GRADIENT].tangent_pass == "one batched tangent pass"
    assert _step_flops(step) == _step_flops(batched) > 0

    with torch.no_grad():  # most pairs to expert 0: rows far from the traced 4 each
        model.gate.weight[0] += 2.0
    x = torch.randn(8, D).abs()
    values = real_arguments(fwd, model)  # by placeholder: the parameters, args_0
    values["args_0"] = x
    qual = dict(fwd.meta[SIGNATURE].trainable())  # placeholder -> parameter name
    gen = torch.Generator().manual_seed(1)
    vs = [{p: torch.randn(values[p].shape, generator=gen) for p in qual} for _ in range(3)]
    args = []
    for n in info.inputs:
        if n == "lr":
            args.append(torch.tensor(1.0))
        elif n in values:
            args.append(values[n])
        else:  # v{k}_<placeholder>
            k, _, p = n[1:].partition("_")
            args.append(vs[int(k)][p])
    ds = step(*args)[-3:]

    def loss(params):
        return torch.func.functional_call(model, params, (x,)).sum()

    primal = {qual[p]: values[p] for p in qual}
    for d, v in zip(ds, vs):
        _, ref = torch.func.jvp(loss, (primal,), ({qual[p]: t for p, t in v.items()},))
        torch.testing.assert_close(d.reshape(()), ref, rtol=1e-4, atol=1e-4)


def _step_flops(gm) -> int:
    from graphflop.train.model import graph_flops

    return graph_flops(gm)
