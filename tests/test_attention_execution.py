"""Which attention execution ``inspect`` and ``plan`` count, pinned against FlopCounterMode.

graphflop's graph holds scaled dot-product attention in its math form: forward q·kᵀ and P·v,
backward dP = dO·vᵀ, dV = Pᵀ·dO, dQ = dS·k, dK = dSᵀ·q (four products, twice the forward's
two). Eager PyTorch on CPU runs the same call on its fused kernel
(``_scaled_dot_product_flash_attention_for_cpu``), whose backward recomputes q·kᵀ from the saved
logsumexp: five products, 2.5 times. ``inspect``'s totals count the graph (and name the fused
kernel's extra work in ``eager_attention``); ``plan``'s ranks count eager PyTorch. The same
small Llama, batch 1 per rank, every figure worked out by hand and measured.
"""

from __future__ import annotations

import json

import pytest
import torch

from graphflop.cli import main

#: hidden 64, 4 query heads and 2 key/value heads of 16, MLP 128, vocabulary 128, 4 layers
CFG = {
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
SEQ = 32
T = SEQ  # tokens per rank: batch 1 (hf: default inputs) x 32
# per layer, forward linear products 2·T·in·out: q 64→64, k 64→32, v 64→32, o 64→64,
# gate/up 64→128, down 128→64
LINEAR_FWD = 4 * 2 * T * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128) + 2 * T * 64 * 128
# = 4 · 2,359,296 + 524,288 (lm_head) = 9,961,472
PRODUCT = 2 * 1 * 4 * SEQ * SEQ * 16  # one attention product over the 4 query heads: 131,072
ATTN_FWD = 4 * 2 * PRODUCT  # q·kᵀ and P·v in 4 layers: 1,048,576
MATH_BWD = 2 * LINEAR_FWD + 4 * 4 * PRODUCT  # input and weight grads + 4 products: 22,020,096
FUSED_BWD = MATH_BWD + 4 * PRODUCT  # + the recomputed q·kᵀ per call: 22,544,384


def _argv(cmd: str, out, *extra: str, cfg: dict | None = None) -> list[str]:
    argv = [cmd, "hf:llama", "--seq", str(SEQ), "--json", str(out), *extra]
    return argv + [a for k, v in (cfg or CFG).items() for a in ("--arg", f"{k}={v}")]


def _flop_counter_mm(math: bool) -> tuple[int, int]:
    """FlopCounterMode's forward and backward FLOPs of one eager step of the same model on
    CPU (its formulas count only matrix-class ops), on the fused kernel or the math path; the
    CPU fused kernel, which torch's registry lacks, gets its SDPA formulas (as
    graphflop.runtime.parallel_probe does)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop, sdpa_flop

    from graphflop.load import load

    aten = torch.ops.aten
    loaded = load("hf:llama", ctor_kwargs=CFG, seq=SEQ)
    model, inputs = loaded.model, loaded.example_inputs

    def counter() -> FlopCounterMode:
        fc = FlopCounterMode(display=False)
        fc.flop_registry[aten._scaled_dot_product_flash_attention_for_cpu] = sdpa_flop
        fc.flop_registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
            sdpa_backward_flop
        )
        return fc

    ctx = sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext()
    with ctx:
        with counter() as fwd:
            logits = model(*inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), inputs[0].flatten())
        with counter() as bwd:
            loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def test_arithmetic() -> None:
    assert LINEAR_FWD == 9_961_472 and ATTN_FWD == 1_048_576
    assert (MATH_BWD, FUSED_BWD) == (22_020_096, 22_544_384)
    # the attention products alone: backward 2x the forward on the math path, 2.5x fused
    assert (MATH_BWD - 2 * LINEAR_FWD) / ATTN_FWD == 2.0
    assert (FUSED_BWD - 2 * LINEAR_FWD) / ATTN_FWD == 2.5


def test_flop_counter_counts_both_paths() -> None:
    # eager PyTorch on CPU runs this Llama's attention (no mask, causal, GQA, float32) on the
    # fused kernel: its backward is the 2.5x one; sdpa_kernel(MATH) gives graphflop's graph's
    assert _flop_counter_mm(math=False) == (LINEAR_FWD + ATTN_FWD, FUSED_BWD)
    assert _flop_counter_mm(math=True) == (LINEAR_FWD + ATTN_FWD, MATH_BWD)


@pytest.mark.slow  # (over 10 s on 2 cores: run in CI's slow pass)
def test_inspect_and_plan_name_the_execution_they_count(tmp_path, capsys) -> None:
    assert main(_argv("inspect", tmp_path / "i.json")) == 0
    text = " ".join(capsys.readouterr().out.split())
    doc = json.loads((tmp_path / "i.json").read_text())
    assert doc["inputs"][0]["shape"] == [1, SEQ]  # batch 1
    assert doc["totals"]["forward"]["mm_flops"] == LINEAR_FWD + ATTN_FWD
    # inspect: graphflop's graph, attention in its math form
    assert doc["totals"]["backward"]["mm_flops"] == MATH_BWD
    ea = doc["eager_attention"]
    assert (ea["calls"], ea["backward_recompute_mm_flops"]) == (4, 4 * PRODUCT)
    assert ea["kernel"] == "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert f"+{4 * PRODUCT:,} = {FUSED_BWD:,} as eager runs it" in text
    for dp in (1, 2):
        out = tmp_path / f"p{dp}.json"
        assert main(_argv("plan", out, "--dp", str(dp))) == 0
        text = " ".join(capsys.readouterr().out.split())
        p = json.loads(out.read_text())
        assert (p["micro_batch"], p["global_batch"]) == (1, dp)  # batch 1 per rank
        for rank in p["ranks"]:
            # plan: eager PyTorch, the fused kernel's recomputed q·kᵀ counted
            assert rank["mm_flops"]["forward"] == LINEAR_FWD + ATTN_FWD
            assert rank["mm_flops"]["backward"] == FUSED_BWD
            # = inspect's backward + what inspect says eager adds
            assert rank["mm_flops"]["backward"] == MATH_BWD + ea["backward_recompute_mm_flops"]
        assert p["eager_attention"]["backward_recompute_mm_flops"] == 4 * PRODUCT
        assert f"{4 * PRODUCT:,} mm FLOPs per micro-batch" in text


@pytest.mark.slow  # (over 10 s on 2 cores in all: run in CI's slow pass)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_no_eager_attention_where_the_math_path_runs(tmp_path, dropout) -> None:
    # attention dropout sends PyTorch's CPU attention to the math path: nothing to add, and
    # inspect's JSON has no eager_attention key
    out = tmp_path / "i.json"
    argv = _argv("inspect", out, "--arg", f"attention_dropout={dropout}")
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    if dropout:
        assert "eager_attention" not in doc
    else:
        assert doc["eager_attention"]["calls"] == 4


def test_plan_blocks_counts_every_copy(tmp_path) -> None:
    # --blocks num_hidden_layers=8: one layer analysed, standing for 8; eager attention's
    # recomputed q·kᵀ counted 8 times, as the 8-layer model's own plan has it
    out = tmp_path / "p.json"
    cfg = {k: v for k, v in CFG.items() if k != "num_hidden_layers"}
    assert main(_argv("plan", out, "--blocks", "num_hidden_layers=8", cfg=cfg)) == 0
    p = json.loads(out.read_text())
    ea = p["eager_attention"]
    assert (ea["calls"], ea["backward_recompute_mm_flops"]) == (8, 8 * PRODUCT)
    linear_fwd_8 = 8 * (LINEAR_FWD - 2 * T * 64 * 128) // 4 + 2 * T * 64 * 128  # 19,398,656
    assert p["ranks"][0]["mm_flops"]["backward"] == 2 * linear_fwd_8 + 8 * 5 * PRODUCT
