"""graphflop.parallel and ``graphflop plan``: the plan's collectives, FLOPs and memory on a tiny
GPT-2 against hand counts, and bad input refused in one line with exit status 2."""

from __future__ import annotations

import functools
import json
import re
from collections import Counter

import pytest
import torch

from graphflop.analysis import analyze
from graphflop.cli import main
from graphflop.load import load, make_inputs
from graphflop.parallel import Plan, PlanError, predict

# GPT-2 with 2 blocks, 2 heads, width 8, vocabulary 16, 8 positions; tokens (2, 4)
ARGS = dict(n_layer=2, n_head=2, n_embd=8, vocab_size=16, n_positions=8)


def _cli(**over) -> list[str]:
    return [
        "models/gpt2.py:GPT2",
        *[f"--arg={k}={v}" for k, v in {**ARGS, **over}.items()],
        "--input-shape",
        "2,4",
        "--dtype",
        "int64",
    ]


CLI = _cli()


@pytest.fixture(scope="module")
def tiny():
    loaded = load("models/gpt2.py:GPT2", ctor_kwargs=ARGS, meta=True)
    inputs = make_inputs(loaded, shapes=[(2, 4)])
    return loaded.model, analyze(loaded.model, inputs, optimizer="adam", jvp=False)


def _plan(tiny, **kw):
    model, a = tiny
    return predict(a, model, Plan(**kw), micro_batch=2)


def _keys(rank, group):
    return Counter(c.key() for c in rank.collectives if c.group == group)


# matrix products of one micro-batch (M = 2·4 = 8 rows): per block c_attn 2·8·8·24 = 3072,
# attn c_proj 2·8·8·8 = 1024, c_fc 2·8·8·32 = 4096, mlp c_proj 2·8·32·8 = 4096, attention's two
# bmm 2·(2·4·4·4·2) = 1024: 13,312; two blocks 26,624; tied head 2·8·8·16 = 2048: 28,672
FORWARD_MM = 28_672


def test_tp_halves_every_matrix_product(tiny):
    one = _plan(tiny)
    two = _plan(tiny, tp=2)
    assert one.ranks[0].mm_flops["forward"] == FORWARD_MM
    # heads, MLP width and vocabulary all split: each product's local contraction or output
    # is half: 28,672 / 2
    assert two.ranks[0].mm_flops["forward"] == FORWARD_MM // 2


def test_tp_collectives_megatron(tiny):
    r = _plan(tiny, tp=2).ranks[0]
    # forward: the embedding's and each row-wise layer's partial sums, (2, 4, 8) = 64 elements:
    # 1 + 2·2 = 5; the vocabulary-parallel cross-entropy's max, sum of exp and picked logit,
    # 8 rows each: 3
    # backward: each column-wise layer's input cotangent (2·2) and the head's (1): 5 × 64; the
    # loss's sum of exp (float) and the count of each row's maxima (the max's derivative
    # divides by it; a sum of booleans, int64): 8 each
    assert _keys(r, "tp") == Counter(
        {
            ("all_reduce", 2, 64, "float32", "forward"): 5,
            ("all_reduce", 2, 8, "float32", "forward"): 3,
            ("all_reduce", 2, 64, "float32", "backward"): 5,
            ("all_reduce", 2, 8, "float32", "backward"): 1,
            ("all_reduce", 2, 8, "int64", "backward"): 1,
        }
    )


def test_ddp_one_bucket(tiny):
    r = _plan(tiny, dp=2).ranks[0]
    # every trainable parameter: wte 16·8 + wpe 8·8 + ln_f 16 + 2 blocks × 872 (ln_1 16,
    # c_attn 24·8+24, c_proj 8·8+8, ln_2 16, c_fc 32·8+32, c_proj 8·32+8) = 1952 elements,
    # 7,808 bytes: under DDP's first 1 MiB bucket, one all_reduce
    assert _keys(r, "dp") == Counter({("all_reduce", 2, 1952, "float32", "backward"): 1})


def test_zero3_units(tiny):
    r = _plan(tiny, dp=2, zero=3).ranks[0]
    # units h.0 and h.1 (872 elements, every dim 0 even: no padding) and the root (208):
    # forward all_gather of each, backward all_gather of the blocks only, reduce_scatter of each
    assert _keys(r, "dp") == Counter(
        {
            ("all_gather", 2, 872, "float32", "forward"): 2,
            ("all_gather", 2, 208, "float32", "forward"): 1,
            ("all_gather", 2, 872, "float32", "backward"): 2,
            ("reduce_scatter", 2, 872, "float32", "backward"): 2,
            ("reduce_scatter", 2, 208, "float32", "backward"): 1,
        }
    )
    mem = r.memory_bytes
    # parameters, gradients: 1952 · 4 / 2 = 3904 bytes; Adam's two moments 7808 plus its
    # float32 step count per parameter, 28 · 4 = 112
    assert (mem["parameters"], mem["gradients"], mem["optimizer_state"]) == (3904, 3904, 7920)
    # gathered at the peak (a block's backward): the root, which FSDP2 keeps gathered from its
    # forward to the end of the backward, 208 · 4, the block running and the one its
    # pre-backward prefetched, 2 × 872 · 4: 832 + 6976
    assert mem["all_gather_buffers"] == 7808


def test_zero1_state_sharded(tiny):
    r = _plan(tiny, dp=2, zero=1).ranks[0]
    # one broadcast per trainable parameter (28) after the step
    assert sum(c.kind == "broadcast" for c in r.collectives) == 28
    assert r.memory_bytes["gradients"] == 7808
    assert r.memory_bytes["optimizer_state"] < 2 * 7808


def test_pipeline_sends_and_bubble(tiny):
    rep = _plan(tiny, pp=2, micro_batches=2)
    first, last = rep.ranks
    # the residual stream (2, 4, 8) = 64 elements crosses once per micro-batch each way; the
    # tied token embedding (16 × 8 = 128), read by the first stage's embedding and the last
    # stage's head, has its gradient all-reduced between them once per step
    tied = ("all_reduce", 2, 128, "float32", "backward")
    assert _keys(first, "pp") == Counter(
        {
            ("send", 2, 64, "float32", "forward"): 2,
            ("recv", 2, 64, "float32", "backward"): 2,
            tied: 1,
        }
    )
    assert _keys(last, "pp") == Counter(
        {
            ("recv", 2, 64, "float32", "forward"): 2,
            ("send", 2, 64, "float32", "backward"): 2,
            tied: 1,
        }
    )
    assert any("wte.weight (stages [0, 1])" in n for n in rep.notes)
    # 1F1B, p = 2, m = 2: (p - 1) / (m + p - 1) = 1/3; stage 0 holds 2 micro-batches, 1 the last
    assert rep.bubble == pytest.approx(1 / 3)
    assert (first.in_flight, last.in_flight) == (2, 1)
    assert first.blocks == ("h.0",) and last.blocks == ("h.1",)


@pytest.mark.parametrize(
    "kw",
    [
        dict(pp=2, micro_batches=1),
        dict(schedule="zigzag"),
        dict(sp=True),
        dict(zero=4),
        dict(tp=0),
        dict(tp=2, tp_plan=(("*", "diagonal"),)),
    ],
)
def test_plan_refuses(kw):
    with pytest.raises(PlanError):
        Plan(**kw)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--tp", "3"], "--tp 3 does not divide"),
        # 2 heads over 4 ranks (hidden 8, fused qkv 24 and vocabulary 16 divide by 4)
        (["--tp", "4"], "--tp 4 cannot shard h.0.attn"),
        (["--pp", "3"], "3 pipeline stages but the model has 2 blocks: use at most --pp 2"),
        # 2 × 2 virtual stages on 2 blocks: no pp × chunks fits, a non-interleaved one does
        (
            ["--pp", "2", "--schedule", "interleaved", "--micro-batches", "2"],
            "at least 4 blocks; use --schedule 1f1b or gpipe with --pp at most 2",
        ),
        # 7 blocks: pp 2 × 3 chunks and pp 3 × 2 chunks fit in 7, 2 × 4 = 8 does not
        (
            [
                "--pp",
                "2",
                "--schedule",
                "interleaved",
                "--chunks",
                "4",
                "--micro-batches",
                "2",
                "--blocks",
                "n_layer=7",
            ],
            "8 pipeline stages (2 × 4 chunks) but --blocks gives 7 blocks: --pp × --chunks must "
            "be at most 7 (e.g. --pp 2 --chunks 3, --pp 3 --chunks 2)",
        ),
        (["--dp", "2", "--world", "3"], "not --world 3"),
        (["--pp", "2", "--micro-batches", "1"], "needs at least 2 micro-batches"),
        (["--schedule", "zigzag"], "unknown --schedule"),
        (["--schedule", "gpipe"], "give --pp 2 or more"),
        (["--pp", "2", "--blocks", "nope=4"], "--blocks nope=4: cannot construct"),
        # inspect's time profiles have no memory size to judge fits by
        (["--device", "cpu"], "which the cpu guess does not give: use --memory-gib GIB, or one of"),
        (["--device", "prof.json"], "which a profile file does not give"),
        (["--memory-gib", "nan"], "--memory-gib must be a positive number of GiB"),
        (["--blocks", "n_layer=0"], "--blocks n_layer=0: N must be at least 1"),
        (["--tp-plan", "plan.yaml"], "--tp-plan shards modules across tensor-parallel ranks"),
        (["--render-stage", "0"], "--render-stage picks the stage --render draws"),
        # dropout is a constructor argument, but not the one that sets the number of blocks
        (["--blocks", "dropout=4"], "the argument --blocks names does not set the number"),
        (["--memory-gib", "inf"], "--memory-gib must be a positive number of GiB"),
    ],
)
def test_cli_bad_input_one_line(capsys, tmp_path, extra, says):
    out = tmp_path / "p.json"
    assert main(["plan", *CLI, *extra, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not out.exists()


def test_cli_sequence_not_divisible_under_sp(capsys, tmp_path):
    # --sp shards the sequence: 3 tokens over 2 ranks (hidden 8 and the 2 heads divide by 2)
    out = tmp_path / "p.json"
    args = [*CLI[: CLI.index("--input-shape")], "--input-shape", "2,3", "--dtype", "int64"]
    assert main(["plan", *args, "--tp", "2", "--sp", "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp 2 does not divide dim 1 (3)" in err[0], err
    assert not out.exists()
    # without --sp the sequence stays whole on every rank: the same plan is accepted
    assert main(["plan", *args, "--tp", "2"]) == 0


def test_cli_plan_file_not_text(capsys, tmp_path):
    f = tmp_path / "plan.json"
    f.write_bytes(b"\xff\xfe")
    assert main(["plan", *CLI, "--tp", "2", "--tp-plan", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not text (byte 0 is not UTF-8)" in err[0], err


def test_cli_unknown_plan_entry(capsys, tmp_path):
    f = tmp_path / "plan.json"
    f.write_text('{"*.attn.c_attn": "diagonal"}')
    assert main(["plan", *CLI, "--tp", "2", "--tp-plan", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown TP plan entry 'diagonal'" in err[0]


def test_cli_heads_not_divisible(capsys):
    # 3 heads of width 16: hidden 48 and vocabulary 16 divide by 2, the heads do not
    assert main(["plan", *_cli(n_head=3, n_embd=48), "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "heads" in err[0] and "--tp 2" in err[0], err


def test_cli_json(tmp_path, capsys):
    import json

    out = tmp_path / "p.json"
    assert (
        main(["plan", *CLI, "--dp", "2", "--zero", "3", "--memory-gib", "1", "--json", str(out)])
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["plan"]["world"] == 2 and doc["ranks"][0]["fits"] is True
    assert {c["kind"] for c in doc["ranks"][0]["collectives"]} == {"all_gather", "reduce_scatter"}


@pytest.mark.parametrize("kw", [dict(pp=2, micro_batches=2, tp=2, dp=2), dict(dp=2, zero=3)])
def test_per_block_equals_whole(kw):
    """A 4-block model analysed whole and analysed with one block per stage (each counted
    from it) give the same FLOPs, collectives, parameters and activations."""

    def run(n_layer, counts):
        loaded = load("models/gpt2.py:GPT2", ctor_kwargs={**ARGS, "n_layer": n_layer}, meta=True)
        a = analyze(loaded.model, make_inputs(loaded, shapes=[(2, 4)]), optimizer="adam", jvp=False)
        return predict(a, loaded.model, Plan(**kw), micro_batch=2, block_counts=counts)

    stages = kw.get("pp", 1)
    whole = run(4, None)
    per_block = run(stages, (4 // stages,) * stages)
    for w, b in zip(whole.ranks, per_block.ranks, strict=True):
        assert w.flops == b.flops and w.mm_flops == b.mm_flops
        assert Counter(c.key() for c in w.collectives) == Counter(c.key() for c in b.collectives)
        for kind in ("parameters", "gradients", "optimizer_state", "activations"):
            assert w.memory_bytes[kind] == b.memory_bytes[kind], kind


@functools.cache
def _llama_analysed(n_layers: int, shape: tuple[int, int]):
    loaded = load("models/llama.py", ctor_kwargs={**LLAMA_TINY, "n_layers": n_layers}, meta=True)
    inputs = make_inputs(loaded, shapes=[shape])
    return loaded.model, analyze(loaded.model, inputs, optimizer="adamw", jvp=False)


@pytest.mark.parametrize(
    "kw, shape",
    [
        (dict(tp=2), (4, 16)),
        (dict(dp=2), (4, 16)),
        (dict(), (1, 2)),
        (dict(dp=2, zero=3), (4, 16)),
        (dict(dp=4, zero=3), (1, 2)),
        (dict(dp=2, zero=3, tp=2), (1, 2)),
        (dict(dp=2, zero=2), (4, 16)),
        (dict(dp=2, zero=2), (1, 2)),
    ],
)
def test_per_block_peak_equals_whole(kw, shape):
    """The step's rise (hence the peak) of a 4-block tiny Llama analysed with one block and
    the others counted from it equals the eager schedule of all 4 blocks, node by node, both
    where the peak falls in the backward (tokens (4, 16): the saved activations of the blocks
    not yet differentiated beside the gradients made so far) and where it falls in the
    update (tokens (1, 2): every gradient and AdamW's temporaries). Under ZeRO 2/3 the whole
    model's schedule has each block as an FSDP unit with its buffers (gathered parameters,
    under ZeRO 3 the next block's prefetched all-gather output and the previous block's
    reduce-scatter input held while a block runs its backward, each block's gradient shard
    after it, the root's whole gradient until its reduce-scatter): the gathered bytes at the
    peak are equal too."""

    def run(n_layers, counts):
        model, a = _llama_analysed(n_layers, shape)
        return predict(a, model, Plan(**kw), micro_batch=shape[0], block_counts=counts)

    whole = run(4, None).ranks[0].memory_bytes
    per_block = run(1, (4,)).ranks[0].memory_bytes
    # one block's gradients: the analysed model's rise is below the whole one's
    assert run(1, None).ranks[0].memory_bytes["step_rise"] < whole["step_rise"]
    assert per_block["step_rise"] == whole["step_rise"]
    assert per_block["all_gather_buffers"] == whole["all_gather_buffers"]
    assert per_block["peak"] == whole["peak"]


def test_default_tp_plan_from_structure():
    """Megatron's pattern found from the module structure: a Linear feeding a sibling Linear
    is column-wise, the last one row-wise, even with a dropout module between the row-wise
    layer and the residual add (inside the attention module); the token embedding
    vocabulary-parallel, the position embedding replicated; norms sequence-parallel."""
    from graphflop.parallel.tp_plan import default_tp_plan

    loaded = load(
        "models/gpt2.py:GPT2", ctor_kwargs={**ARGS, "n_layer": 1, "dropout": 0.1}, meta=True
    )
    a = analyze(loaded.model, make_inputs(loaded, shapes=[(2, 4)]), jvp=False)
    assert dict(default_tp_plan(loaded.model, a.forward, sp=True)) == {
        "h.0.attn.c_attn": "colwise",
        "h.0.attn.c_proj": "rowwise",
        "h.0.mlp.c_fc": "colwise",
        "h.0.mlp.c_proj": "rowwise",
        "wte": "rowwise",
        "h.0.ln_1": "sequence_parallel",
        "h.0.ln_2": "sequence_parallel",
        "ln_f": "sequence_parallel",
        # the modules holding column-wise layers gather their sequence-sharded input once
        "h.0.attn": "prepare_input",
        "h.0.mlp": "prepare_input",
    }


LLAMA_TINY = dict(vocab=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128)


@pytest.fixture(scope="module")
def llama():
    loaded = load("models/llama.py", ctor_kwargs=LLAMA_TINY, meta=True)
    return loaded.model, analyze(
        loaded.model, make_inputs(loaded, shapes=[(4, 16)]), optimizer="adamw", jvp=False
    )


def test_llama_tp_as_parallelize_module(llama):
    """Tiny Llama (vocabulary 128, width 64, 4 blocks, 4 query / 2 key-value heads, SwiGLU
    128), tokens (4, 16), TP 2 with the default plan: q/k/v, gate/up column-wise, o/down
    row-wise, the embedding vocabulary-parallel, the head column-wise with its logits gathered."""
    model, a = llama
    whole = predict(a, model, Plan(), micro_batch=4).ranks[0]
    r = predict(a, model, Plan(tp=2), micro_batch=4).ranks[0]
    # forward: the embedding's and each row-wise layer's partial sums, 4·16·64 = 4096
    # elements, 1 + 2·4 = 9; the logits gathered, 4·16·128 = 8192
    # backward: each column-wise module's input cotangent reduced on its own (q, k, v, gate,
    # up: 5 per block, as DTensor's from_local backward does) and the head's: 5·4 + 1 = 21
    assert Counter(c.key() for c in r.collectives) == Counter(
        {
            ("all_reduce", 2, 4096, "float32", "forward"): 9,
            ("all_gather", 2, 8192, "float32", "forward"): 1,
            ("all_reduce", 2, 4096, "float32", "backward"): 21,
        }
    )
    # every matrix product (attention over the local heads included) halves
    assert 2 * r.mm_flops["total"] == whole.mm_flops["total"]


def test_llama_tp_kv_heads_not_divisible(llama):
    model, a = llama
    # 2 key/value heads over 4 ranks (4 query heads, width 64, vocabulary 128 all divide)
    with pytest.raises(PlanError, match="--tp 4 cannot shard layers.0.attention"):
        predict(a, model, Plan(tp=4), micro_batch=4)


def test_render_stage_dot(tmp_path, capsys):
    # TP 2 with SP on the tiny GPT-2: each block's norms gather the sequence before the
    # column-wise layers and each row-wise layer reduce-scatters its output
    out = tmp_path / "stage.dot"
    assert main(["plan", *CLI, "--tp", "2", "--sp", "--render", str(out)]) == 0
    text = out.read_text()
    assert "h.0.attn" in text and "h.1.mlp" in text
    assert "reduce_scatter ×1" in text and "all_gather ×1" in text


class _Twice(torch.nn.Module):
    """Blocks a.0, a.1 run, then a.0 again: no pipeline can hand that on in one direction."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        for m in (*self.a, self.a[0]):
            x = torch.relu(m(x))
        return x


class _NoBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (_Twice, "block a.0 runs again after a.1"),
        (_NoBlocks, "no repeated blocks to split into pipeline stages"),
    ],
)
def test_pipeline_refuses_models_it_cannot_split(model, says):
    m = model()
    a = analyze(m, (torch.randn(2, 4),), jvp=False)
    with pytest.raises(PlanError, match=says):
        predict(a, m, Plan(pp=2, micro_batches=2), micro_batch=2)


def test_matrix_parameters_the_tp_plan_leaves_whole_are_noted():
    """nn.TransformerEncoderLayer's attention holds q, k, v in one fused in_proj_weight
    (and its out_proj is the only Linear of its parent): the default plan shards neither and
    says so, naming them."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        8, 2, dim_feedforward=16, dropout=0.0, batch_first=True
    )
    m = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    a = analyze(m, (torch.randn(2, 3, 8),), jvp=False)
    rep = predict(a, m, Plan(tp=2), micro_batch=2)
    note = next(n for n in rep.notes if "matrix parameter" in n)
    assert note.startswith("2 matrix parameter(s)")
    assert "layers.0.self_attn.in_proj_weight" in note
    assert "layers.0.self_attn.out_proj.weight" in note and "linear1" not in note
    # each named with its module's class, not a guess
    assert "layers.0.self_attn.in_proj_weight (MultiheadAttention)" in note
    assert "by module class: MultiheadAttention ×1, NonDynamicallyQuantizableLinear ×1" in note


# a convolution stack under --tp: refused (TP shards nothing), tests/test_parallel_plan_frozen.py


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        # a LayerNorm is neither nn.Linear nor nn.Embedding: torch's ColwiseParallel refuses it
        ({"h.*.ln_1": "colwise"}, "colwise on h.0.ln_1 (LayerNorm)"),
        ({"h.0": "rowwise"}, "rowwise on h.0 (Block)"),
        ({"ln_f": {"style": "colwise", "output_layouts": "replicate"}}, "on ln_f (LayerNorm)"),
        # a pattern that matches nothing would silently leave the model unsharded
        ({"nonexistent.*": "colwise"}, "'nonexistent.*' matches no module; module paths: wte"),
    ],
)
def test_cli_tp_plan_refused_against_modules(capsys, tmp_path, entries, says):
    import json

    f, out = tmp_path / "plan.json", tmp_path / "p.json"
    f.write_text(json.dumps(entries))
    assert main(["plan", *CLI, "--tp", "2", "--tp-plan", str(f), "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not out.exists()
    # the same plan on the Linears it names is accepted
    f.write_text(json.dumps({"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise"}))
    assert main(["plan", *CLI, "--tp", "2", "--tp-plan", str(f)]) == 0


@pytest.mark.parametrize(
    ("entry", "result"),
    [
        ({"style": "colwise", "output_layouts": "replicate"}, "colwise:replicate"),
        ({"style": "ColwiseParallel", "output_layouts": "Replicate()"}, "colwise:replicate"),
        # ColwiseParallel's default output layout: the plain column-wise style
        ({"style": "colwise", "output_layouts": "Shard(-1)"}, "colwise"),
        ("PrepareModuleInput", "prepare_input"),
        ("SequenceParallel", "sequence_parallel"),
        # each refusal names what is wrong: the layout, the style, the key
        ({"style": "colwise", "output_layouts": "shard"}, "output_layouts 'shard' is not supp"),
        ({"style": "rowwise", "output_layouts": "replicate"}, "colwise entry only, not rowwise"),
        ({"style": "colwise", "input_layouts": "shard"}, "style and output_layouts, not input"),
    ],
)
def test_read_tp_plan_mapping_entries(tmp_path, entry, result):
    import json

    from graphflop.parallel import read_tp_plan

    f = tmp_path / "plan.json"
    f.write_text(json.dumps({"h.*.attn.c_attn": entry}))
    if result in ("colwise", "colwise:replicate", "prepare_input", "sequence_parallel"):
        assert read_tp_plan(str(f)) == (("h.*.attn.c_attn", result),)
    else:
        with pytest.raises(PlanError, match=re.escape(result)):
            read_tp_plan(str(f))


def test_plan_help_lists_every_tp_plan_style(capsys):
    from graphflop.parallel.plan import COLWISE_REPLICATE, PLAN_STYLES, PREPARE_INPUT

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for style in (*PLAN_STYLES, COLWISE_REPLICATE, PREPARE_INPUT, "output_layouts: replicate"):
        assert style in text, style


def test_cli_schedule_any_case(tmp_path):
    import json

    out = tmp_path / "p.json"
    args = ["plan", *CLI, "--pp", "2", "--micro-batches", "2", "--json", str(out)]
    assert main([*args, "--schedule", "GPipe"]) == 0
    assert json.loads(out.read_text())["plan"]["schedule"] == "gpipe"


class _InlineBlock(torch.nn.Module):
    """Attention and MLP Linears held directly by the block: o's output joins the residual
    stream and also feeds up (through the add), so the sibling search makes o column-wise."""

    def __init__(self, d=8):
        super().__init__()
        self.q, self.o = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.o(torch.relu(self.q(x)))
        return x + self.down(torch.relu(self.up(x)))


class _Blocks(torch.nn.Module):
    def __init__(self, block=_InlineBlock):
        super().__init__()
        self.blocks = torch.nn.ModuleList(block() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _NoRowBlock(torch.nn.Module):
    """Two Linears whose outputs are multiplied and leave the block: neither feeds the other,
    so both are row-wise with no column-wise Linear before them."""

    def __init__(self, d=8):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        return x + self.a(x) * torch.tanh(self.b(x))


def test_default_plan_notes_blocks_without_a_column_row_pattern():
    m = _Blocks()
    a = analyze(m, (torch.randn(2, 3, 8),), jvp=False)
    rep = predict(a, m, Plan(tp=2), micro_batch=2)
    assert rep.plan.tp_plan[:4] == (
        ("blocks.0.q", "colwise"),
        ("blocks.0.o", "colwise"),
        ("blocks.0.up", "colwise"),
        ("blocks.0.down", "rowwise"),
    )
    note = next(n for n in rep.notes if "default TP plan" in n)
    assert "in blocks.0, blocks.1 (_InlineBlock, Linears held directly)" in note
    assert "column-wise blocks.0.o, blocks.1.o also feed the module's output" in note
    assert "--tp-plan" in note
    # a block where no Linear feeds another
    m = _Blocks(_NoRowBlock)
    a = analyze(m, (torch.randn(2, 3, 8),), jvp=False)
    note = next(n for n in predict(a, m, Plan(tp=2), micro_batch=2).notes if "default TP" in n)
    assert "in blocks.0, blocks.1 no Linear feeds another, so all are row-wise" in note


def test_default_plan_notes_nothing_on_gpt2(tiny):
    # GPT-2's attention and MLP modules each close their column-wise Linears row-wise
    assert not [n for n in _plan(tiny, tp=2).notes if "default TP plan" in n]


@pytest.mark.slow
def test_fsdp_tp_peak_under_the_fake_process_group():
    """FSDP2 × TP (dp 4 × tp 2, world 8) on a 2-block tiny Llama with a vocabulary large
    enough (2,048 × 64) that the peak falls at the root's post-backward, run by torch under the
    fake process group (tools/bench_plan_fake.py, rank 0, step 2): the predicted collectives
    equal the logged ones as a multiset and the peak is FSDPMemTracker's within 0.01 %. There
    the embedding's gradient, made whole (2,048 · 64 · 4 = 524,288 B), is live beside its
    redistribution to the vocabulary shard (1,024 · 64 · 4 = 262,144 B) that FSDP2 makes
    before it reshards:
    without that step the prediction is 257,928 B (12 %) under (measured)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_plan import plan_side, torch_side

    cfg = dict(vocab=2048, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    p = plan_side("models/llama.py", cfg, "n_layers", 2, "fsdp_tp", 8, 1, 16, tp=2)
    t = torch_side("models/llama.py", {**cfg, "n_layers": 2}, "fsdp_tp", 8, 1, 16, tp=2)
    assert p["collectives"] == t["collectives"]
    assert abs(p["peak"] - t["peak"]) <= t["peak"] * 1e-4, (p["peak"], t["peak"])


_BUFFERED = """
import torch
from torch import nn


class Blk(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.l = nn.Linear(d, d)
        self.register_buffer("scale", torch.ones(d))
        self.register_buffer("table", torch.zeros(1000, d))  # never read

    def forward(self, x):
        return x + self.l(x) * self.scale


class Net(nn.Module):
    def __init__(self, d=24, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(Blk(d) for _ in range(n))
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def example_inputs():
    return (torch.randn(5, 24),)
"""


def test_buffers_held_by_the_stage_that_owns_them(tmp_path):
    # each block holds a 1,000 × 24 table it never reads and a 24-element scale it reads:
    # (24,000 + 24) × 4 = 96,096 B a block. Every pipeline stage holds its own block's; one
    # rank without a pipeline holds all three (288,288 B), whole at any --tp/--dp, and with
    # --blocks the analysed block's count for its copies
    f = tmp_path / "buffered.py"
    f.write_text(_BUFFERED)

    def buffers(*extra):
        out = tmp_path / "p.json"
        assert main(["plan", f"{f}:Net", *extra, "--json", str(out)]) == 0
        ranks = json.loads(out.read_text())["ranks"]
        return [(r["memory_bytes"]["buffers"], r["memory_bytes"]["peak"]) for r in ranks]

    assert [b for b, _ in buffers("--pp", "3")] == [96_096] * 3
    whole = buffers()
    assert whole[0][0] == 3 * 96_096 == 288_288
    assert buffers("--dp", "2", "--zero", "3")[0][0] == 288_288
    assert buffers("--blocks", "n=3")[0] == whole[0]


@pytest.mark.parametrize("what_if", [dict(checkpoint="h.*"), dict(amp="bf16")])
def test_a_what_if_moves_the_peak_by_its_own_change(tiny, what_if):
    """One rank, no parallelism: the plan's peak under a what-if is its eager peak plus what the
    what-if changes of the one-device train peak (the report's own what-if peak less its eager
    peak, same optimizer); before, only the activations column moved and the peak and the
    fits verdict ignored --checkpoint and --amp."""
    model, a = tiny
    loaded = load("models/gpt2.py:GPT2", ctor_kwargs=ARGS, meta=True)
    inputs = make_inputs(loaded, shapes=[(2, 4)])
    w = analyze(loaded.model, inputs, optimizer="adam", jvp=False, **what_if)
    mem = w.report.memory
    alt = mem.checkpoint if "checkpoint" in what_if else mem.amp
    delta = alt.train_peak_bytes - mem.train_peak_bytes
    # on this tiny model checkpointing both blocks raises the peak (+11,360 B: the recompute
    # of a block outweighs the few activations it drops); autocast lowers it
    assert delta != 0
    eager = _plan(tiny).ranks[0].memory_bytes["peak"]
    assert predict(w, loaded.model, Plan(), micro_batch=2).ranks[0].memory_bytes["peak"] == (
        eager + delta
    )


class _EmbLin(torch.nn.Module):
    """Embedding(vocab, width) -> [LayerNorm(width)] -> Linear(width -> 96)."""

    def __init__(self, vocab: int = 511, width: int = 96, norm: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.norm = torch.nn.LayerNorm(width) if norm else torch.nn.Identity()
        self.out = torch.nn.Linear(width, 96)

    def forward(self, ids):
        return self.out(self.norm(self.emb(ids)))


def test_colwise_embedding_shards_its_width():
    """torch's ColwiseParallel shards an nn.Embedding's weight on dim 1, its width
    (``style.py``: ``_partition_embedding_fn``, ``[Shard(1)]``); RowwiseParallel on dim 0, the
    vocabulary. A vocabulary of 511 does not divide by 2, the width 96 does."""
    ids = torch.randint(0, 511, (2, 8))
    model = _EmbLin()
    a = analyze(model, (ids,), optimizer="sgd", jvp=False)
    plan = (("emb", "colwise"), ("out", "rowwise"))
    r = predict(a, model, Plan(tp=2, tp_plan=plan), micro_batch=2).ranks[0]
    # per rank: the embedding's 511 × 48 columns, 98,112 B; the row-wise weight's 96 × 48,
    # 18,432 B; its bias whole, 384 B: 116,928 B
    assert r.memory_bytes["parameters"] == 511 * 48 * 4 + 96 * 48 * 4 + 96 * 4 == 116_928
    # the embedding's output is sharded on its width, the row-wise layer's input: the only
    # collective is the row-wise output's partial sums, 2 × 8 × 96 = 1,536 elements; the
    # backward scatters each rank's columns of the weight cotangent (no gather)
    assert _keys(r, "tp") == Counter({("all_reduce", 2, 1536, "float32", "forward"): 1})
    # row-wise: the vocabulary is sharded, and 511 rows do not split over 2 ranks
    with pytest.raises(PlanError, match=r"--tp 2 does not divide dim 0 \(511\) of emb.weight"):
        predict(a, model, Plan(tp=2, tp_plan=(("emb", "rowwise"),)), micro_batch=2)
    # column-wise: the width is sharded, and 95 columns do not split over 2 ranks
    narrow = _EmbLin(width=95)
    a95 = analyze(narrow, (ids,), optimizer="sgd", jvp=False)
    with pytest.raises(PlanError, match=r"--tp 2 does not divide dim 1 \(95\) of emb.weight"):
        predict(a95, narrow, Plan(tp=2, tp_plan=plan), micro_batch=2)


def test_colwise_output_read_whole_is_noted():
    """torch's ColwiseParallel hands on the local slice of its Shard(-1) output
    (use_local_output=True, style.py _prepare_output_fn); a row-wise Linear reads it as the
    shard (its input layout Shard(-1)), a LayerNorm or a column-wise Linear (input layout
    Replicate()) gets the (…, 48) slice: torch fails ("Given normalized_shape=[96], expected
    input with shape [*, 96], but got input of size[4, 16, 48]", the probe's engine). graphflop
    gathers the slice there and says so in a note."""
    ids = torch.randint(0, 511, (2, 8))
    plan = (("emb", "colwise"), ("out", "rowwise"))
    model = _EmbLin()
    a = analyze(model, (ids,), optimizer="sgd", jvp=False)
    assert not predict(a, model, Plan(tp=2, tp_plan=plan), micro_batch=2).notes
    cols = Plan(tp=2, tp_plan=(("emb", "colwise"), ("out", "colwise")))
    both = predict(a, model, cols, micro_batch=2)
    assert [n for n in both.notes if n.startswith("out, loss read a column-wise module's")]
    normed = _EmbLin(norm=True)
    a = analyze(normed, (ids,), optimizer="sgd", jvp=False)
    r = predict(a, normed, Plan(tp=2, tp_plan=plan), micro_batch=2)
    assert [n for n in r.notes if n.startswith("norm reads a column-wise module's output")]
    # what graphflop predicts there: the 2 × 8 × 96 = 1,536 slice gathered for the norm
    assert ("all_gather", 2, 1536, "float32", "forward") in _keys(r.ranks[0], "tp")


class _BNNet(torch.nn.Module):
    """Conv(3 -> 8) -> BatchNorm(8) -> ReLU -> mean over pixels -> Linear(8 -> 10), and a
    float buffer of 5 (tests/test_parallel_plan_probe.py runs the same under torch's DDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 10)
        self.register_buffer("scale", torch.ones(5))

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.mean(dim=(2, 3))) * self.scale[0]


@pytest.mark.parametrize("zero", [0, 1])
def test_ddp_broadcasts_the_buffers_before_every_forward(zero):
    """DDP (and ZeRO-1, which wraps DDP) broadcasts the module's buffers from rank 0 before
    each forward (broadcast_buffers=True), coalesced into one broadcast per dtype: float32
    running mean 8 + running variance 8 + the model's own 5 = 21 elements; int64 batch
    counter 1. Then the gradients' all_reduce: conv 8·3·3·3 + 8, batch norm 8 + 8, linear
    10·8 + 10 = 330 elements (one bucket)."""
    model = _BNNet()
    a = analyze(model, (torch.randn(2, 3, 8, 8),), optimizer="adamw", jvp=False)
    r = predict(a, model, Plan(dp=2, zero=zero), micro_batch=2).ranks[0]
    dp = Counter(c.key() for c in r.collectives if c.kind != "broadcast" or c.phase != "optimizer")
    assert dp == Counter(
        {
            ("broadcast", 2, 21, "float32", "forward"): 1,
            ("broadcast", 2, 1, "int64", "forward"): 1,
            ("all_reduce", 2, 330, "float32", "backward"): 1,
        }
    )
    # FSDP does not broadcast buffers
    fsdp = predict(a, model, Plan(dp=2, zero=3), micro_batch=2).ranks[0]
    assert not [c for c in fsdp.collectives if c.kind == "broadcast"]


class _BNBlocks(torch.nn.Module):
    """Four blocks of Linear(16 -> 16) + BatchNorm1d(16), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)) for _ in range(4)
        )
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def test_no_buffer_broadcast_under_a_pipeline():
    """torch's PipelineStage runs every forward under DDP's no_sync, which leaves
    require_forward_param_sync False: after the first micro-batch DDP broadcasts no buffers
    (stage.py forward_maybe_with_nosync; distributed.py); without a pipeline each step's
    first forward broadcasts them: 4 × (16 + 16) float32 and 4 int64 counters."""
    model = _BNBlocks()
    a = analyze(model, (torch.randn(8, 16),), optimizer="sgd", jvp=False)
    flat = predict(a, model, Plan(dp=2), micro_batch=8).ranks[0]
    assert Counter(c.key() for c in flat.collectives if c.kind == "broadcast") == Counter(
        {("broadcast", 2, 128, "float32", "forward"): 1, ("broadcast", 2, 4, "int64", "forward"): 1}
    )
    piped = predict(a, model, Plan(dp=2, pp=2, micro_batches=2), micro_batch=4)
    assert not [c for r in piped.ranks for c in r.collectives if c.kind == "broadcast"]


class _FusedAttn(torch.nn.Module):
    """timm's ViT attention: one Linear for q, k and v, its output reshaped to
    (B, N, 3, heads, head_dim) and unbound."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, n, c))


class _FusedMlp(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _FusedBlock(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn, self.mlp = _FusedAttn(width, heads), _FusedMlp(width)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class _FusedVit(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(_FusedBlock(width, heads) for _ in range(2)))
        self.head = torch.nn.Linear(width, 5)

    def forward(self, x):
        return self.head(self.blocks(x))


@pytest.mark.parametrize(("width", "heads", "tp"), [(16, 4, 2), (16, 4, 4), (12, 3, 3)])
def test_fused_qkv_refusal_names_the_fused_linear(width, heads, tp):
    """A tester's finding: on timm's ViTs every --tp was refused with "choose a --tp that
    divides them" (or "divides 1") though it divided the heads and the width. The cause is the
    fused qkv Linear: ColwiseParallel gives rank r the contiguous 3·width/tp output features
    r·3·width/tp …, not its heads' q, k and v, so the reshape to (…, 3, heads, head_dim) splits
    q/k/v across ranks whatever the --tp. The refusal names the Linear and the reshape and
    suggests a plan sharding the MLP only, which runs."""
    torch.manual_seed(0)
    model = _FusedVit(width, heads)
    a = analyze(model, (torch.randn(2, 5, width),), optimizer="sgd", jvp=False)
    with pytest.raises(PlanError) as e:
        predict(a, model, Plan(tp=tp), micro_batch=2)
    msg = str(e.value)
    dims = (2, 5, 3, heads, width // heads)
    assert f"cannot shard blocks.0.attn.qkv column-wise: its output (2, 5, {3 * width})" in msg
    assert f"is reshaped to {dims}: a column-wise shard splits the fused q/k/v dimension" in msg
    assert f"each rank {3 * width // tp} contiguous of its {3 * width} output features" in msg
    assert "choose a --tp" not in msg
    suggested = "blocks.*.mlp.fc1: colwise; blocks.*.mlp.fc2: rowwise"
    assert (
        f"keep blocks.*.attn whole with a --tp-plan file sharding the others, as: {suggested}"
        in msg
    )
    plan = tuple(tuple(kv.split(": ")) for kv in suggested.split("; "))
    r = predict(a, model, Plan(tp=tp, tp_plan=plan), micro_batch=2).ranks[0]
    # float32 parameters per rank: each block's fc1 weight (4w × w) and bias (4w) and fc2
    # weight (w × 4w) split tp ways; whole: qkv (3w × w + 3w), proj (w × w + w), fc2's bias
    # (w) in each of the 2 blocks, and the head (5 × w + 5)
    w = width
    sharded = 2 * (4 * w * w + 4 * w + 4 * w * w) // tp
    whole = 2 * (3 * w * w + 3 * w + w * w + w + w) + (w * 5 + 5)
    assert r.memory_bytes["parameters"] == 4 * (sharded + whole)


class _GatedMix(torch.nn.Module):
    """Mamba's pattern: one Linear for two parts, its output chunked in two, both halves used
    (h · sigmoid(g)), then an out-projection."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = torch.nn.Linear(16, 2 * 32)
        self.out_proj = torch.nn.Linear(32, 16)

    def forward(self, x):
        h, g = self.in_proj(x).chunk(2, dim=-1)
        return self.out_proj(h * torch.sigmoid(g))


class _GatedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix, self.head = _GatedMix(), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(x + self.mix(x))


@pytest.mark.parametrize("user_plan", [False, True])
def test_colwise_output_chunked_into_parts_is_noted(user_plan):
    """A tester's finding (HF Mamba, --tp 2): the default plan shards in_proj column-wise and
    Mamba chunks its output in two; torch's ColwiseParallel hands on rank r's contiguous 32 of
    the 64 features (rank 0: all of h, rank 1: all of g), and the local chunk(2) mixes them
    (no shape error here: out_proj, row-wise, reads 16 + 16 = 32 … of the wrong features).
    graphflop's figures take Megatron's layout (each rank 16 of h and 16 of g) and said
    nothing, with the default plan or the same plan given as a file. Now a note names the
    Linear and where its output is split; none without the chunk (a plain MLP, fc1 → fc2)."""
    torch.manual_seed(0)
    model = _GatedNet()
    a = analyze(model, (torch.randn(2, 5, 16),), optimizer="sgd", jvp=False)
    megatron = (("mix.in_proj", "colwise"), ("mix.out_proj", "rowwise"))
    r = predict(a, model, Plan(tp=2, tp_plan=megatron if user_plan else ()), micro_batch=2)
    notes = [n for n in r.notes if n.startswith("column-wise mix.in_proj (at mix): output split")]
    assert len(notes) == 1 and "use_local_output=True" in notes[0]
    # the default plan is that plan: in_proj feeds out_proj (column-wise), out_proj feeds no
    # sibling (row-wise); the row-wise output's partial sums, 2 · 5 · 16 = 160 elements
    assert ("all_reduce", 2, 160, "float32", "forward") in _keys(r.ranks[0], "tp")
    plain = _FusedMlp(16)
    a = analyze(plain, (torch.randn(2, 5, 16),), optimizer="sgd", jvp=False)
    mlp = (("fc1", "colwise"), ("fc2", "rowwise"))
    r = predict(a, plain, Plan(tp=2, tp_plan=mlp), micro_batch=2)
    assert not [n for n in r.notes if "split into parts" in n or "as a whole" in n]


class _HeadsAttn(torch.nn.Module):
    """Separate q, k and v Linears of width 24 in 6 heads (Llama's layout, no fused Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(24, 24) for _ in range(3))
        self.o = torch.nn.Linear(24, 24)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (m(x).view(b, n, 6, 4).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return self.o((a @ v).transpose(1, 2).reshape(b, n, 24))


def test_heads_tp_does_not_divide_keep_their_refusal():
    """6 heads over --tp 4 (which divides the width 24): the reshape of q's column-wise output
    to (…, 6, 4) splits heads across ranks. The refusal still says to choose a --tp that
    divides the heads; no fused projection is named."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_HeadsAttn(), torch.nn.Linear(24, 3))
    a = analyze(model, (torch.randn(2, 5, 24),), optimizer="sgd", jvp=False)
    with pytest.raises(PlanError, match="choose a --tp that divides them") as e:
        predict(a, model, Plan(tp=4), micro_batch=2)
    assert "fused" not in str(e.value)
    predict(a, model, Plan(tp=2), micro_batch=2)  # 2 divides the 6 heads: planned
