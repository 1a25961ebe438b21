"""The loss a language model is traced with: token-level cross-entropy over (B, T, V) logits.

A causal LM returns logits (B, T, V) from token ids (B, T); its training loss is the mean over
the B·T tokens of -log_softmax at the target token, the logits flattened to (B·T, V) (as
transformers' own loss computes it). ``auto`` picks it by shapes, ``--loss cross_entropy``
makes (B, T) targets, and the plan says which loss it counted.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphflop
from graphflop.frontend.loss import class_target_shape, default_loss, make_targets
from graphflop.load import load
from graphflop.meta import COST, LOSS_KIND, MODULE, SIGNATURE

TINY_LLAMA = {
    "vocab_size": 50,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def test_auto_picks_token_cross_entropy_by_shapes() -> None:
    ids = torch.zeros(2, 3, dtype=torch.long)
    logits = torch.zeros(2, 3, 50)
    # (B, T, V) logits of (B, T) integer ids over an embedding of V rows: a language model's
    assert default_loss(logits, (ids,), [50]) == "cross_entropy"
    # hidden states (B, T, D) of the same ids: no embedding of D rows, so the sum
    assert default_loss(logits, (ids,), [7]) == "sum"
    # no integer input of shape (B, T) (a float input, or ids of another length)
    assert default_loss(logits, (ids.float(),), [50]) == "sum"
    assert default_loss(logits, (torch.zeros(2, 4, dtype=torch.long),), [50]) == "sum"
    assert default_loss(torch.zeros(4, 10)) == "cross_entropy"  # (N, C) as before
    assert class_target_shape(logits) == (2, 3)
    assert class_target_shape(torch.zeros(4, 10)) == (4,)
    assert class_target_shape(torch.zeros(4, 10, 5, 6)) == (4, 5, 6)
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    (t,) = make_targets("cross_entropy", logits, mode)
    assert tuple(t.shape) == (2, 3) and t.dtype == torch.long


def _tiny_llama(seq: int = 3) -> nn.Module:
    loaded = load("hf:llama", ctor_kwargs=TINY_LLAMA, seq=seq)  # real weights
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    return loaded.model.double().train()


@pytest.mark.parametrize("loss", ["auto", "cross_entropy"])
def test_hf_causal_lm_is_traced_with_token_cross_entropy(loss: str) -> None:
    from graphflop.runtime.verify import real_arguments, run_backward, run_forward

    model = _tiny_llama()
    ids = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(0))
    fwd = graphflop.annotate_flops(graphflop.trace(model, (ids,), loss=loss))
    sig = fwd.meta[SIGNATURE]
    assert fwd.meta[LOSS_KIND] == "cross_entropy"
    (target,) = sig.targets
    phs = {n.name: n for n in fwd.graph.nodes if n.op == "placeholder"}
    assert tuple(phs[target].meta["val"].shape) == (2, 3)

    # the loss's FLOPs by hand, N = B·T = 6 tokens, V = 50:
    # log_softmax over V: amax N·V, x - max N·V, exp N·V, sum N·V, log N, - logsumexp N·V
    #   = 5·N·V + N = 1506;
    # nll (mean, ignore_index handled): 3 `ne` against ignore_index, 2 `where`, `neg` (N each,
    #   6·N), the count of kept tokens N, the sum of the picked losses N, the division 1
    #   = 8·N + 1 = 49
    n, v = 6, 50
    loss_flops = sum(c.meta[COST].flops for c in fwd.graph.nodes if c.meta.get(MODULE) == "loss")
    assert loss_flops == (5 * n * v + n) + (8 * n + 1) == 1555

    # the gradient against torch.func.grad of the model's own logits and F.cross_entropy over
    # the flattened tokens (the mean over B·T), at graphflop's random targets
    bwd = graphflop.build_vjp(fwd)
    values = real_arguments(fwd, model, examples=(ids,))
    fv = run_forward(fwd, values)
    grads = run_backward(bwd, fv)
    targets = values[target]
    assert targets.shape == (2, 3) and int(targets.max()) < v
    names = [q for _, q in sig.params]
    params = {q: values[p] for p, q in sig.params}

    def f(ps: dict) -> torch.Tensor:
        logits = torch.func.functional_call(model, ps, (values[sig.inputs[0]],)).logits
        return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1))

    ref = torch.func.grad(f)(params)
    assert float(fv[sig.loss]) == pytest.approx(float(f(params)), rel=1e-12)
    for q, g in zip(names, grads, strict=True):
        torch.testing.assert_close(g, ref[q], rtol=1e-9, atol=1e-12)


def test_hf_plan_says_the_loss(tmp_path, capsys) -> None:
    from graphflop.cli import main

    out = tmp_path / "plan.json"
    argv = ["plan", "hf:llama", "--seq", "8", "--tp", "2", "--json", str(out)]
    argv += [a for k, v in TINY_LLAMA.items() for a in ("--arg", f"{k}={v}")]
    assert main(argv) == 0
    assert "loss cross_entropy" in " ".join(capsys.readouterr().out.split())
    assert json.loads(out.read_text())["plan"]["loss"] == "cross_entropy"


def test_hf_causal_lm_train_peak_against_a_measured_step() -> None:
    # with a vocabulary of 2,000 over B·T = 32 tokens the loss's tensors dominate: logits,
    # log-probabilities and nll_loss_backward's dense gradient are 32·2000·4 = 256,000 B each.
    # measure_train_peak runs the same token-level loss eagerly (its targets (B, T)), the
    # profiler's allocator events give the peak: 1,076,584 B measured, 1,075,296 predicted
    from graphflop.analysis import analyze
    from graphflop.runtime.memory_probe import measure_train_peak

    cfg = {**TINY_LLAMA, "vocab_size": 2000}
    model = load("hf:llama", ctor_kwargs=cfg, seq=16).model.train()
    ids = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    got = analyze(model, (ids,), jvp=False).report.memory.train_peak_bytes
    measured = measure_train_peak(model, (ids,))
    assert got > 3 * 256_000
    assert abs(got / measured - 1) < 0.01, (got, measured)
