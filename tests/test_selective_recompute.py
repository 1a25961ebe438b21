"""Selective recompute of attention cores (``recompute="attention"``, ``--recompute``): saved
bytes and recompute FLOPs worked out by hand and measured on real eager runs with the core
wrapped in ``torch.utils.checkpoint`` (``saved_tensors_hooks``, counted by
:class:`graphflop.runtime.memory_probe.SavedBytes` as ``measure_saved`` counts: once per storage,
parameters and buffers excluded, inputs included)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from graphflop.runtime.memory_probe import SavedBytes, _loss_fn


class TinyAttention(nn.Module):
    """x (2, 4, 8) -> Linear(8, 24) -> q, k, v of 2 heads of 4 -> the core
    ``dropout(softmax(q·4^-½ @ kᵀ)) @ v`` -> Linear(8, 8). ``wrap(core, q, k, v)``, when set,
    runs the core (a checkpoint in the measurements)."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)
        self.p = p
        self.wrap = None

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        w = torch.softmax((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1), dim=-1)
        return F.dropout(w, self.p, self.training) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, 2, d // 2).transpose(1, 2) for t in self.qkv(x).split(d, dim=2))
        y = self.core(q, k, v) if self.wrap is None else self.wrap(self.core, q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


def _tiny() -> tuple[TinyAttention, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return TinyAttention().train(), (torch.randn(2, 4, 8),)


def _measure_saved(model: TinyAttention, x: tuple, wrap) -> int:
    """Bytes saved by one forward and a sum loss: the packed tensors' storages outside the
    checkpointed core plus the storages of the core's arguments (the recompute keeps them)."""
    saved = SavedBytes(model)

    def wrapped(f, *args):
        for a in args:
            saved.keep(a)
        return wrap(f, *args)

    _, run = _loss_fn(model, x, "sum")  # runs the model once, without the checkpoint
    model.wrap = wrapped if wrap is not None else None
    with saved:
        loss = run()
    del loss
    model.wrap = None
    return saved.nbytes


def _reentrant(f, *args):
    return tuc.checkpoint(f, *args, use_reentrant=True)


def _non_reentrant(f, *args):
    return tuc.checkpoint(f, *args, use_reentrant=False)


def _backward_mm_flops_and_grads(model: TinyAttention, x: tuple, wrap):
    """(FlopCounterMode's FLOPs over ``backward()``, the parameters' gradients), with the
    same dropout mask in every run (seeded; checkpoint restores the generator state)."""
    model.wrap = wrap
    torch.manual_seed(1)
    loss = model(*x).sum()
    with FlopCounterMode(display=False) as fc:
        loss.backward()
    model.wrap = None
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops(), grads


def test_tiny_attention_by_hand_and_measured():
    """float32, CPU, sum loss (saves nothing). Eager saves, in bytes: x (qkv's input,
    2·4·8·4 = 256); the score product's operands, q·scale and kᵀ, each copied by matmul's
    reshape of a transposed tensor ((2·2)·4·4 elements: 256 each); the softmax output
    (2·2·4·4·4 = 256); the dropout's float mask on CPU (256) and its output (the product
    with v's operand, 256); v's copy (256); the context's copy (transpose + reshape, proj's
    input, 256): 8·256 = 2048. Selective recompute drops the softmax output, the mask and the
    dropout output (768) and keeps the core's inputs, the q·scale, kᵀ and v copies, saved
    anyway: 2048 − 768 = 1280. Recomputing the scaling of q with the core would save
    q, k, v's storage instead (the Linear's output, 2·4·24·4 = 768 = the three copies):
    no gain, so the core alone is rerun. A checkpoint around ``core(q, k, v)`` saves x, the
    qkv storage its arguments view (768) and the context copy: 1280, measured.

    Recompute FLOPs (graphflop's counting): the score product 2·(2·2)·4·4·4 = 512; softmax
    5 per element (max, subtract, exp, sum, divide) × 64 = 320; dropout 3 × 64 = 192
    (compare, mask, scale); the product with v 512: 1536, of which matrix products 1024 —
    what FlopCounterMode counts over a backward with the core checkpointed reentrantly, less
    one without (the whole core reruns). Non-reentrant checkpoint stops early, before the
    product with v (it saves only its inputs): 512 more. Gradients are the same in all three
    runs."""
    from graphflop import analyze

    model, x = _tiny()
    rc = analyze(model, x, jvp=False, loss="sum", recompute="attention").report.memory.recompute
    assert rc is not None
    assert rc.eager_saved_for_backward_bytes == 2048
    assert rc.saved_for_backward_bytes == 1280
    assert rc.recompute_input_bytes == 768
    assert rc.prologue_recomputed is False
    assert rc.recompute_flops == 1536 and rc.recompute_mm_flops == 1024
    assert rc.cores == ("(root)",) and rc.fused_cores == 0
    assert [(c.module, c.recompute_flops) for c in rc.per_core] == [("(root)", 1536)]
    assert _measure_saved(model, x, None) == 2048
    assert _measure_saved(model, x, _non_reentrant) == 1280

    base, g0 = _backward_mm_flops_and_grads(model, x, None)
    full, g1 = _backward_mm_flops_and_grads(model, x, _reentrant)
    early, g2 = _backward_mm_flops_and_grads(model, x, _non_reentrant)
    assert full - base == rc.recompute_mm_flops == 1024
    assert early - base == 512
    for a, b, c in zip(g0, g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_the_scaled_query_is_recomputed_when_that_saves_bytes():
    """GPT-2's attention (math path: dropout 0.1), fp16 on the CUDA eager model, 1 block,
    width 32, 2 heads, T = 16 (sbh = 16·32 = 512 elements). Eager keeps q·d^-½ (2·sbh bytes)
    beside the fused q, k, v projection output (6·sbh), which the products' operands view on
    CUDA: recomputing the scaling with the core saves those 2·sbh, so the prologue is rerun
    and the what-if drops softmax output (2·as/h·sbh, as/h = 2·16/32 = 1), dropout mask (1)
    and output (2) and the scaled q (2): 7·512 = 3584 bytes; the core's input is the
    projection output, 6·512 = 3072."""
    sys.path.insert(0, "models")
    from gpt2 import GPT2

    from graphflop import analyze

    torch.manual_seed(0)
    m = GPT2(vocab_size=64, n_positions=16, n_embd=32, n_head=2, n_layer=1, dropout=0.1)
    x = (torch.randint(0, 64, (1, 16)),)
    rc = analyze(
        m.train().half(), x, jvp=False, device="cuda", recompute="attention"
    ).report.memory.recompute
    assert rc.prologue_recomputed is True
    assert rc.eager_saved_for_backward_bytes - rc.saved_for_backward_bytes == 7 * 512
    assert rc.recompute_input_bytes == 6 * 512


def test_fused_attention_needs_nothing():
    """GPT-2 without dropout on CPU runs PyTorch's fused attention kernel, which saves only
    q, k, v, its output and the logsumexp: no core to recompute, the saved bytes unchanged."""
    sys.path.insert(0, "models")
    from gpt2 import GPT2

    from graphflop import analyze

    m = GPT2(vocab_size=64, n_positions=16, n_embd=32, n_head=2, n_layer=2).train()
    a = analyze(m, (torch.randint(0, 64, (2, 16)),), jvp=False, recompute="attention")
    rc = a.report.memory.recompute
    assert rc.cores == () and rc.fused_cores == 2 and rc.recompute_flops == 0
    assert rc.saved_for_backward_bytes == rc.eager_saved_for_backward_bytes
    assert rc.eager_saved_for_backward_bytes == a.report.memory.saved_for_backward_bytes


def test_options_and_cli_errors(capsys):
    import graphflop
    from graphflop.cli import main
    from graphflop.passes.selective_recompute import RecomputePolicyError

    model, x = _tiny()
    with pytest.raises(RecomputePolicyError, match="unknown recompute policy 'mlp'"):
        graphflop.analyze(model, x, recompute="mlp")
    with pytest.raises(ValueError, match="recompute= is a what-if on the backward"):
        graphflop.analyze(model, x, recompute="attention", backward=False)
    with pytest.raises(ValueError, match="recompute= is a what-if on the eager memory model"):
        graphflop.analyze(model, x, recompute="attention", memory_model="graph")
    assert main(["inspect", "models/mlp.py", "--arg", "hidden=32", "--recompute", "attention"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no attention core" in err
    gpt = ["models/gpt2.py:GPT2", "--arg", "n_layer=1", "--arg", "n_embd=8", "--arg", "n_head=2"]
    gpt += ["--arg", "vocab_size=16", "--arg", "n_positions=4", "--input-shape", "2,4"]
    gpt += ["--dtype", "int64"]
    assert main(["plan", *gpt, "--recompute", "attention", "--checkpoint", "h.*"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give one of them" in err


def test_inspect_json_and_table(capsys):
    """The CLI's memory.recompute equals the API's, and the table line repeats it."""
    sys.path.insert(0, "models")
    from gpt2 import GPT2

    from graphflop import analyze
    from graphflop.cli import main
    from graphflop.export.report import human, human_bytes

    args = ["n_layer=2", "n_embd=16", "n_head=2", "vocab_size=32", "n_positions=8", "dropout=0.1"]
    argv = ["inspect", "models/gpt2.py:GPT2", "--input-shape", "2,8", "--dtype", "int64"]
    argv += [a for kv in args for a in ("--arg", kv)] + ["--no-jvp", "--recompute", "attention"]
    assert main([*argv, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)["memory"]["recompute"]
    torch.manual_seed(0)
    m = GPT2(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8, dropout=0.1)
    api = analyze(m.train(), (torch.randint(0, 32, (2, 8)),), jvp=False, recompute="attention")
    assert doc == api.report.memory.recompute.to_dict()
    assert doc["cores"] == ["h.0.attn", "h.1.attn"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        f"recompute attention (2 cores): saved for backward "
        f"{human_bytes(doc['saved_for_backward_bytes'])} (eager "
        f"{human_bytes(doc['eager_saved_for_backward_bytes'])}), train peak "
        f"{human_bytes(doc['train_peak_bytes'])}, recompute {human(doc['recompute_flops'])} FLOPs"
    ) in out
    # the peak falls by the dropped residuals and rises by the generator state each core keeps
    # for its rerun (5,056 bytes on CPU), which outweighs them in a model this small
    rng = 2 * torch.get_rng_state().numel()
    assert doc["train_peak_bytes"] - rng < api.report.memory.train_peak_bytes


def test_plan_under_tp_and_sp_counts_local_bytes_and_flops(tmp_path):
    """``plan --tp 2 --sp`` of a 1-block GPT-2 (width 8, 2 heads, T = 4, batch 2, dropout 0.1,
    the CPU eager model): the core's dropped residuals are the softmax output, the float
    dropout mask and its output, (2·2·4·4)·4 = 256 bytes each, 768 in all, split over the
    heads: activations fall by 384 per rank. Its rerun per rank: the score product and the
    product with v (512 FLOPs each), the causal mask's select (64), softmax (320) and dropout
    (192): 1600 in all, half per rank = 800; the matrix part 1024 / 2 = 512."""
    from graphflop.cli import main

    gpt = ["models/gpt2.py:GPT2", "--arg", "n_layer=1", "--arg", "n_embd=8", "--arg", "n_head=2"]
    gpt += ["--arg", "vocab_size=16", "--arg", "n_positions=4", "--arg", "dropout=0.1"]
    gpt += ["--input-shape", "2,4", "--dtype", "int64", "--memory-device", "cpu"]
    gpt += ["--tp", "2", "--sp"]

    def rank(*extra: str) -> dict:
        path = tmp_path / "plan.json"
        assert main(["plan", *gpt, *extra, "--json", str(path)]) == 0
        return json.loads(path.read_text())["ranks"][0]

    base, rec = rank(), rank("--recompute", "attention")
    assert base["memory_bytes"]["activations"] - rec["memory_bytes"]["activations"] == 384
    assert rec["flops"]["recompute"] - base["flops"]["recompute"] == 800
    assert rec["mm_flops"]["recompute"] - base["mm_flops"]["recompute"] == 512
    assert rec["flops"]["forward"] == base["flops"]["forward"]


def test_gpt2_matches_a_checkpointed_attention_core():
    """GPT-2, 2 blocks, width 32, 2 heads, T = 16, batch 2, dropout 0.1 (the math attention),
    CPU float32: graphflop's saved bytes without and with selective recompute against eager
    runs, the second with ``F.scaled_dot_product_attention`` replaced by
    ``torch.utils.checkpoint`` around graphflop's math attention (the same ops PyTorch's math
    kernel runs). Both equal eager's, the position ids (``arange(T)``, T int64s = 128 bytes,
    which the position embedding saves) included."""
    sys.path.insert(0, "models")
    import gpt2
    from gpt2 import GPT2

    from graphflop import analyze
    from graphflop.ops.attention import sdpa
    from graphflop.runtime.memory_probe import measure_saved

    torch.manual_seed(0)
    m = GPT2(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, dropout=0.1)
    x = (torch.randint(0, 100, (2, 16)),)
    rc = analyze(m.train(), x, jvp=False, recompute="attention").report.memory.recompute
    assert measure_saved(m, x) == rc.eager_saved_for_backward_bytes
    saved = SavedBytes(m)

    def attention(q, k, v, *args, **kwargs):
        for t in (q, k, v):
            saved.keep(t)
        return tuc.checkpoint(sdpa, q, k, v, *args, use_reentrant=False, **kwargs)

    _, run = _loss_fn(m, x, "auto")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpt2.F, "scaled_dot_product_attention", attention)
        with saved:
            loss = run()
    del loss
    assert saved.nbytes == rc.saved_for_backward_bytes
    assert rc.saved_for_backward_bytes < rc.eager_saved_for_backward_bytes


class _Gram(nn.Module):
    """x (2, 4, 4): g = x·xᵀ, then a Linear(4, 4) over g, then (that)·x — two products of
    activations with a parameterised product between them: not an attention core."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x @ x.transpose(-2, -1)) @ x


def test_products_with_a_projection_between_them_are_not_a_core():
    from graphflop import analyze
    from graphflop.passes.selective_recompute import RecomputePolicyError

    x = torch.randn(2, 4, 4, requires_grad=False)
    with pytest.raises(RecomputePolicyError, match="has no attention core"):
        analyze(_Gram(), (x,), jvp=False, loss="sum", recompute="attention")


def test_memory_plot_draws_the_recompute_peak():
    from matplotlib.text import Text

    from graphflop import analyze
    from graphflop.export.memory_plot import _figure
    from graphflop.export.memory_timeline import memory_timeline

    model, x = _tiny()
    a = analyze(model, x, jvp=False, loss="sum", recompute="attention")
    fig = _figure(a, memory_timeline(a))
    texts = "\n".join(t.get_text() for t in fig.findobj(Text))
    peak = a.report.memory.recompute.train_peak_bytes
    assert f"what-if --recompute attention: peak {peak / 2**10:.2f} KiB" in texts


def test_train_peak_keeps_no_generator_state_without_a_random_op():
    """A core with no dropout (p = 0: no random op is traced) keeps no generator state for its
    rerun: the predicted peak (3,488 B) against a measured step with the core checkpointed
    without RNG state (``preserve_rng_state=False``, nothing to replay): 4,272 B (PyTorch 2.13
    CPU). Before, each core added the CPU generator's state (5,056 B) anyway: 8,544 B."""
    from graphflop import analyze
    from graphflop.runtime.memory_probe import measure_train_peak

    torch.manual_seed(0)
    model, x = TinyAttention(p=0.0).train(), (torch.randn(2, 4, 8),)
    rc = analyze(model, x, jvp=False, loss="sum", recompute="attention").report.memory.recompute
    assert len(rc.cores) == 1
    model.wrap = lambda f, *a: tuc.checkpoint(f, *a, use_reentrant=False, preserve_rng_state=False)
    measured = measure_train_peak(model, x, "sum", "sgd")
    model.wrap = None
    assert abs(rc.train_peak_bytes - measured) < torch.get_rng_state().numel() / 2, (
        rc.train_peak_bytes,
        measured,
    )
