"""The parallel probe (:mod:`graphflop.runtime.parallel_probe`): what torch's own engines do per
rank, checked against hand counts.

The model is models/llama.py at a tiny size: vocabulary V = 128, width d = 64, 4 blocks, 4 query
heads and 2 key/value heads of 16, SwiGLU width 128; global batch 4 x 16 tokens. Parameters:
embedding 128·64 = 8192; per block two norms 2·64 + q 64·64 + k 64·32 + v 64·32 + o 64·64 +
gate/up/down 3·64·128 = 128 + 36,864 = 36,992; final norm 64; head 64·128 = 8192; total
8192 + 4·36,992 + 64 + 8192 = 164,416. The torchrun tests take 20-40 s each on 2 cores.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from graphflop.runtime.parallel_probe import ProbeError, parse_ctor_args, run_probe

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "models" / "llama.py")
TINY = ["vocab=128", "dim=64", "n_layers=4", "n_heads=4", "n_kv_heads=2", "ffn_dim=128"]
V, D, L, H, HKV, HD, FFN = 128, 64, 4, 4, 2, 16, 128
B, T = 4, 16
BLOCK = 2 * D + D * D + 2 * D * HKV * HD + D * D + 3 * D * FFN  # 36,992
PARAMS = V * D + L * BLOCK + D + D * V  # 164,416
# weights of the matmuls of one block and of the head (all but norms and embedding)
BLOCK_MM = D * D + 2 * D * HKV * HD + D * D + 3 * D * FFN  # 36,864


def _multiset(rec: dict) -> Counter:
    return Counter(
        (c["kind"], c["group_size"], c["elements"], c["dtype"], c["phase"])
        for c in rec["collectives"]
    )


_CACHE: dict[str, list[dict]] = {}


def _probe(mode: str, nproc: int = 2, tmp: Path | None = None) -> list[dict]:
    if mode not in _CACHE:
        _CACHE[mode] = run_probe(LLAMA, mode, nproc, args=TINY, batch=B, seq=T, micro_batches=2)
    return _CACHE[mode]


def test_parse_ctor_args():
    assert parse_ctor_args(["dim=64", "rope=False", "name=x"]) == {
        "dim": 64,
        "rope": False,
        "name": "x",
    }
    with pytest.raises(ProbeError, match="NAME=VALUE"):
        parse_ctor_args(["dim"])


def test_unknown_mode_is_refused_before_launching():
    with pytest.raises(ProbeError, match="unknown mode 'dpp'"):
        run_probe(LLAMA, "dpp", 2)


@pytest.mark.slow
def test_ddp_one_bucket_all_reduce_and_local_flops():
    recs = _probe("ddp")
    for r, rec in enumerate(recs):
        assert (rec["rank"], rec["world"], rec["step"]) == (r, 2, 3)
        assert rec["dims"] == {"dp": 2, "tp": 1, "pp": 1}
        assert rec["params_local"] == PARAMS
        # 164,416 fp32 parameters = 658 kB fit DDP's one 25 MB bucket: one all-reduce of all
        # the gradients, in the backward (the reducer calls it through the dispatcher)
        assert _multiset(rec) == Counter({("all_reduce", 2, PARAMS, "float32", "backward"): 1})
        # each rank: 2 rows x 16 tokens = 32 tokens; forward mm FLOPs 2·32·(4·36,864 + 64·128)
        # = 9,961,472; backward twice that (input and weight gradients of every matmul: the
        # embedding's output needs a gradient, so the first block's input gradients run)
        fwd = 2 * 32 * (L * BLOCK_MM + D * V)
        assert rec["flops_by_op"]["aten.mm"] == 3 * fwd == 29_884_416
        # torch's SDPA formula: forward 4·b·h·T²·hd per block (QK^T and PV, full square),
        # backward 2.5 times that
        sdpa = 4 * 2 * H * T * T * HD * L
        assert rec["flops_by_op"]["aten._scaled_dot_product_flash_attention_for_cpu"] == sdpa
        back = rec["flops_by_op"]["aten._scaled_dot_product_flash_attention_for_cpu_backward"]
        assert back == 5 * sdpa // 2
        # live at the step start: parameters, DDP's gradient bucket, AdamW's two moments and
        # step counts (one fp32 scalar per parameter tensor: 39 tensors), the batch rows (two
        # int64 (2, 16) tensors); gradients were set to None after the last step
        assert rec["live_by_kind"] == {
            "parameters": 4 * PARAMS,
            "gradients": 0,
            "optimizer": 2 * 4 * PARAMS + 4 * (1 + 4 * 9 + 2),
            "buffers": 0,
            "batch": 2 * (2 * T * 8),
            "engine": 4 * PARAMS,
        }
        assert rec["live_at_step_start"] == sum(rec["live_by_kind"].values())
        # the gradients (658 kB) are live at the peak, on top of what the step started with
        assert rec["peak_bytes"] > rec["live_at_step_start"] + 4 * PARAMS


def _check_llama_flops(rec: dict, tokens: int) -> None:
    """mm and attention FLOPs of a rank that runs the whole model on ``tokens`` tokens."""
    fwd = 2 * tokens * (L * BLOCK_MM + D * V)
    assert rec["flops_by_op"]["aten.mm"] == 3 * fwd
    sdpa = 4 * (tokens // T) * H * T * T * HD * L
    assert rec["flops_by_op"]["aten._scaled_dot_product_flash_attention_for_cpu"] == sdpa


@pytest.mark.slow
def test_zero3_gathers_each_unit_twice_and_reduce_scatters_it_once():
    recs = _probe("zero3")
    root = V * D + D + D * V  # the root unit: embedding, final norm, head: 16,448
    assert root + L * BLOCK == PARAMS
    for rec in recs:
        assert rec["dims"] == {"dp": 2, "tp": 1, "pp": 1}
        assert rec["params_local"] == PARAMS // 2  # every dim 0 is even: no padding
        # FSDP2: each block is gathered (gathered elements = its whole size) before its
        # forward and again before its backward (resharded after forward); the root is not
        # resharded after forward (its backward comes first), so it is gathered once; every
        # unit's gradient is reduce-scattered once (elements = the unsharded gradient)
        assert _multiset(rec) == Counter(
            {
                ("all_gather", 2, root, "float32", "forward"): 1,
                ("all_gather", 2, BLOCK, "float32", "forward"): L,
                ("all_gather", 2, BLOCK, "float32", "backward"): L,
                ("reduce_scatter", 2, BLOCK, "float32", "backward"): L,
                ("reduce_scatter", 2, root, "float32", "backward"): 1,
            }
        )
        _check_llama_flops(rec, 2 * T)
        # at the step start: the parameter shards and AdamW's moments of them (+ 39 steps)
        assert rec["live_by_kind"]["parameters"] == 4 * PARAMS // 2
        assert rec["live_by_kind"]["optimizer"] == 4 * PARAMS + 4 * 39
        # the step gathers at least one block's parameters on top
        assert rec["peak_bytes"] >= rec["live_at_step_start"] + 4 * BLOCK


@pytest.mark.slow
def test_tp_all_reduces_row_outputs_forward_and_column_input_grads_backward():
    recs = _probe("tp")
    act = B * T * D  # one (4, 16, 64) activation: 4,096 elements
    for rec in recs:
        assert rec["dims"] == {"dp": 1, "tp": 2, "pp": 1}
        # every weight is halved but the norms' (4·2·64 + 64 = 576 replicated elements)
        assert rec["params_local"] == (PARAMS - 576) // 2 + 576
        assert _multiset(rec) == Counter(
            {
                # forward: the vocab-parallel embedding's partial sum, o_proj's and down_proj's
                # (row-wise) partial outputs in each block; the head's logits gathered
                ("all_reduce", 2, act, "float32", "forward"): 1 + 2 * L,
                ("all_gather", 2, B * T * V, "float32", "forward"): 1,
                # backward: the input gradient of every column-wise Linear (q, k, v, gate, up
                # each all-reduce their own) and of the head; none for the embedding, whose
                # input (token ids) needs no gradient
                ("all_reduce", 2, act, "float32", "backward"): 5 * L + 1,
            }
        )
        # each rank runs every matmul at half width on the whole batch (64 tokens): the same
        # FLOPs as a data-parallel rank on 32 tokens, half the whole model's
        _check_llama_flops(rec, 2 * T)


@pytest.mark.slow
def test_tp_sp_reduce_scatters_and_gathers_the_sequence():
    recs = _probe("tp_sp")
    act = B * T * D
    for rec in recs:
        assert rec["dims"] == {"dp": 1, "tp": 2, "pp": 1}
        assert _multiset(rec) == Counter(
            {
                # forward: the embedding's and each o/down's partial output reduce-scattered
                # over the sequence; each attention / MLP input and the head's input gathered
                ("reduce_scatter", 2, act, "float32", "forward"): 1 + 2 * L,
                ("all_gather", 2, act, "float32", "forward"): 2 * L + 1,
                ("all_gather", 2, B * T * V, "float32", "forward"): 1,
                # backward: each of those transposed
                ("all_gather", 2, act, "float32", "backward"): 1 + 2 * L,
                ("reduce_scatter", 2, act, "float32", "backward"): 2 * L + 1,
                # the sequence-parallel norms' weight gradients stay Partial through the
                # backward; AdamW (foreach=False) all-reduces each of the 9 norms' gradient
                # at each of its 3 uses (the two moments' updates read it three times)
                ("all_reduce", 2, D, "float32", "optimizer"): 3 * (2 * L + 1),
            }
        )
        _check_llama_flops(rec, 2 * T)


@pytest.mark.slow
def test_zero1_broadcasts_every_parameter_from_its_owner_after_the_step():
    recs = _probe("zero1")
    for rec in recs:
        assert rec["params_local"] == PARAMS  # parameters replicated, optimizer states not
        assert _multiset(rec) == Counter(
            {
                # DDP's one bucket, as in ddp
                ("all_reduce", 2, PARAMS, "float32", "backward"): 1,
                # ZeroRedundancyOptimizer: after each rank steps the parameters it owns, every
                # parameter is broadcast from its owner: 9 norms of 64, 8 k/v of 64·32, 8 q/o of
                # 64·64, 12 gate/up/down of 64·128 + the embedding and the head of 128·64
                ("broadcast", 2, D, "float32", "optimizer"): 2 * L + 1,
                ("broadcast", 2, D * HKV * HD, "float32", "optimizer"): 2 * L,
                ("broadcast", 2, D * D, "float32", "optimizer"): 2 * L,
                ("broadcast", 2, D * FFN, "float32", "optimizer"): 3 * L + 2,
            }
        )
        _check_llama_flops(rec, 2 * T)
    # the AdamW moments are split between the ranks (by parameter, not evenly)
    moments = [rec["live_by_kind"]["optimizer"] for rec in recs]
    assert 2 * 4 * PARAMS < sum(moments) < 2 * 4 * PARAMS + 4 * 39 + 8


@pytest.mark.slow
def test_zero2_gathers_each_unit_once_and_reduce_scatters_its_gradient():
    recs = _probe("zero2")
    root = V * D + D + D * V
    for rec in recs:
        assert rec["params_local"] == PARAMS // 2
        # FSDP1 SHARD_GRAD_OP: parameters stay gathered from the forward through the
        # backward (no second all-gather); gradients reduce-scattered per unit
        assert _multiset(rec) == Counter(
            {
                ("all_gather", 2, root, "float32", "forward"): 1,
                ("all_gather", 2, BLOCK, "float32", "forward"): L,
                ("reduce_scatter", 2, BLOCK, "float32", "backward"): L,
                ("reduce_scatter", 2, root, "float32", "backward"): 1,
            }
        )
        _check_llama_flops(rec, 2 * T)


@pytest.mark.parametrize("mode", ["pp_gpipe", "pp_1f1b"])
@pytest.mark.slow
def test_pipeline_sends_each_micro_batch_activation_and_its_gradient(mode):
    recs = _probe(mode)
    mb = (B // 2) * T * D  # 2 micro-batches of 2 rows: (2, 16, 64) = 2,048 elements
    first, last = recs
    # stage 0 = embedding + blocks 0-1, stage 1 = blocks 2-3 + norm + head
    assert first["params_local"] == V * D + 2 * BLOCK
    assert last["params_local"] == 2 * BLOCK + D + D * V
    assert first["dims"] == {"dp": 1, "tp": 1, "pp": 2}
    assert _multiset(first) == Counter(
        {("send", 2, mb, "float32", "forward"): 2, ("recv", 2, mb, "float32", "backward"): 2}
    )
    assert _multiset(last) == Counter(
        {("recv", 2, mb, "float32", "forward"): 2, ("send", 2, mb, "float32", "backward"): 2}
    )
    # each stage runs the whole batch (64 tokens) through its own matmuls, backward twice the
    # forward: the received activations need a gradient to send back
    assert first["flops_by_op"]["aten.mm"] == 3 * 2 * B * T * (2 * BLOCK_MM)
    assert last["flops_by_op"]["aten.mm"] == 3 * 2 * B * T * (2 * BLOCK_MM + D * V)
    # the receive buffers of the two micro-batches are the engine's, live between steps
    assert first["live_by_kind"]["engine"] == last["live_by_kind"]["engine"] == 2 * 4 * mb


@pytest.mark.slow
def test_interleaved_1f1b_two_stages_per_rank():
    recs = _probe("pp_interleaved")
    mb = (B // 2) * T * D
    r0, r1 = recs
    # looped placement: rank 0 holds stages 0 (embedding + block 0) and 2 (block 2),
    # rank 1 stages 1 (block 1) and 3 (block 3 + norm + head)
    assert r0["params_local"] == V * D + 2 * BLOCK
    assert r1["params_local"] == 2 * BLOCK + D + D * V
    # rank 0 sends stage 0 -> 1 and 2 -> 3 activations, receives 1 -> 2; gradients reversed
    assert _multiset(r0) == Counter(
        {
            ("send", 2, mb, "float32", "forward"): 4,
            ("recv", 2, mb, "float32", "forward"): 2,
            ("send", 2, mb, "float32", "backward"): 2,
            ("recv", 2, mb, "float32", "backward"): 4,
        }
    )
    assert _multiset(r1) == Counter(
        {
            ("recv", 2, mb, "float32", "forward"): 4,
            ("send", 2, mb, "float32", "forward"): 2,
            ("recv", 2, mb, "float32", "backward"): 2,
            ("send", 2, mb, "float32", "backward"): 4,
        }
    )


@pytest.mark.slow
def test_fsdp_tp_on_a_2d_mesh():
    recs = _CACHE.setdefault(
        "fsdp_tp", run_probe(LLAMA, "fsdp_tp", 4, args=TINY, batch=B, seq=T, micro_batches=2)
    )
    act = (B // 2) * T * D  # each data-parallel pair takes 2 rows: 2,048 elements
    # a unit's tensor-parallel shard: its weights halved, its norms whole
    block = (BLOCK - 2 * D) // 2 + 2 * D  # 18,560
    root = (V * D + D * V) // 2 + D  # 8,256
    for rec in recs:
        assert rec["dims"] == {"dp": 2, "tp": 2, "pp": 1}
        assert rec["params_local"] == (block * L + root) // 2
        assert _multiset(rec) == Counter(
            {
                # tensor parallelism inside each pair (group of 2), as in tp on 2 rows
                ("all_reduce", 2, act, "float32", "forward"): 1 + 2 * L,
                ("all_gather", 2, (B // 2) * T * V, "float32", "forward"): 1,
                ("all_reduce", 2, act, "float32", "backward"): 5 * L + 1,
                # FSDP2 over the data-parallel pairs (group of 2), of the tensor-parallel shards
                ("all_gather", 2, root, "float32", "forward"): 1,
                ("all_gather", 2, block, "float32", "forward"): L,
                ("all_gather", 2, block, "float32", "backward"): L,
                ("reduce_scatter", 2, block, "float32", "backward"): L,
                ("reduce_scatter", 2, root, "float32", "backward"): 1,
            }
        )
        # half the matmul widths on 32 tokens: a quarter of the whole model's step
        assert rec["flops_by_op"]["aten.mm"] == 3 * 2 * (B // 2) * T * (L * BLOCK_MM + D * V) // 2


def test_one_rank_peak_is_params_states_and_adamw_temporaries_by_hand():
    """The memory definition on one in-process rank (gloo, world 1): an MLP 784 -> 32 -> 10,
    batch 8, DDP, AdamW."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from graphflop.runtime.memory_probe import SavedBytes
    from graphflop.runtime.parallel_probe import probe_rank

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rec = probe_rank(
            str(ROOT / "models" / "mlp.py"),
            "ddp",
            ctor_kwargs={"hidden": 32, "depth": 1},
            batch=8,
            seq=1,
            micro_batches=1,
            steps=3,
        )
    finally:
        dist.destroy_process_group()
    w1, b1, w2, b2 = 784 * 32, 32, 32 * 10, 10
    params = w1 + b1 + w2 + b2  # 25,450
    assert rec["params_local"] == params
    assert _multiset(rec) == Counter({("all_reduce", 1, params, "float32", "backward"): 1})
    # live at the start: parameters, DDP's bucket (one gradient's size), AdamW's two moments
    # and 4 fp32 step counts, the batch (8 x 1 x 28 x 28 fp32 images + 8 int64 targets)
    assert rec["live_by_kind"] == {
        "parameters": 4 * params,
        "gradients": 0,
        "optimizer": 2 * 4 * params + 4 * 4,
        "buffers": 0,
        "batch": 8 * 784 * 4 + 8 * 8,
        "engine": 4 * params,
    }
    # the peak is in AdamW (foreach=False) at the largest parameter, W1: every gradient is
    # live (4·25,450 B) and exp_avg_sq.sqrt() and its division by the bias correction make two
    # W1-sized temporaries (2·4·25,088 B); a few scalar temporaries on top (< 64 B)
    rise = rec["peak_bytes"] - rec["live_at_step_start"]
    assert 0 <= rise - (4 * params + 2 * 4 * w1) < 64
    # which is above the end of the forward: what the graph saves for the backward
    # (saved_tensors_hooks: the ReLU output, the log-softmax output...) + the gradients
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    with SavedBytes(model, exclude=(x, y)) as saved:
        nn.functional.cross_entropy(model(x), y)
    assert saved.nbytes == 8 * 32 * 4 + 8 * 10 * 4 + 4  # ReLU out, log-softmax, weight
    assert saved.nbytes + 4 * params < rise


@pytest.mark.slow
def test_more_stages_than_blocks_is_one_line_from_every_rank():
    one_block = [a if not a.startswith("n_layers") else "n_layers=1" for a in TINY]
    with pytest.raises(ProbeError) as e:
        run_probe(LLAMA, "pp_gpipe", 2, args=one_block)
    assert str(e.value).endswith(
        "rank 0: 2 pipeline stages but only 1 blocks\nrank 1: 2 pipeline stages but only 1 blocks\n"
    )


def _fake_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_plan_fake", ROOT / "tools" / "bench_plan_fake.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fake_world_of_3_pads_fsdp2_shards_to_a_multiple_of_the_group():
    """tools/bench_plan_fake.py: FSDP2 under the fake process group and FakeTensorMode, world 3,
    2 rows of 16 tokens per rank."""
    ctor = dict(vocab=V, dim=D, n_layers=L, n_heads=H, n_kv_heads=HKV, ffn_dim=FFN)
    rec = _fake_tool().run_world(LLAMA, "zero3", 3, ctor, 2, T)
    # FSDP2 pads each parameter's dim 0 to a multiple of 3: 64 -> 66, 32 -> 33, 128 -> 129;
    # block: norms 2·66 + q, o 2·66·64 + k, v 2·33·64 + gate, up 2·129·64 + down 66·128
    block = 2 * 66 + 2 * 66 * 64 + 2 * 33 * 64 + 2 * 129 * 64 + 66 * 128  # 37,764
    root = 129 * 64 + 66 + 129 * 64  # embedding, final norm, head: 16,578
    assert rec["params_local"] == (L * block + root) // 3
    assert _multiset(rec) == Counter(
        {
            ("all_gather", 3, root, "float32", "forward"): 1,
            ("all_gather", 3, block, "float32", "forward"): L,
            ("all_gather", 3, block, "float32", "backward"): L,
            ("reduce_scatter", 3, block, "float32", "backward"): L,
            ("reduce_scatter", 3, root, "float32", "backward"): 1,
        }
    )
    _check_llama_flops(rec, 2 * T)  # fake tensors counted by their shapes
    assert rec["live_by_kind"]["parameters"] == 4 * (L * block + root) // 3
    assert rec["peak_bytes"] > rec["live_at_step_start"]
