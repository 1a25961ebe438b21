"""Models as users have them: files with several classes, keyword inputs, frozen parameters,
library checks for tracing, data-dependent control flow, grouped-query attention."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, analysis, spec
from torch import nn

from graphflop.analysis import analyze
from graphflop.frontend.trace import TraceError, trace
from graphflop.load import SpecError, load, make_inputs
from graphflop.meta import JVP, SIGNATURE


def _write(tmp_path, body: str, name: str = "m.py"):
    p = tmp_path / name
    p.write_text("import torch\nfrom torch import nn\n" + textwrap.dedent(body))
    return p


BLOCK_NET = """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()


class Net(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])
        self.head = nn.Linear(4, 3)

    def forward(self, x, scale=1.0, mask=None):
        for b in self.blocks:
            x = b(x)
        if mask is not None:
            x = x * mask
        return self.head(x) * scale
"""


def test_root_of_the_composition_is_picked(tmp_path):
    # Block is used inside Net.__init__ (in a comprehension): Net is the only root
    p = _write(tmp_path, BLOCK_NET + "\ndef example_inputs():\n    return (torch.zeros(2, 4),)\n")
    loaded = load(str(p), meta=True)
    assert loaded.name == "m.py:Net"
    assert type(loaded.model).__name__ == "Net"


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))", "model"),
        (
            "def build(width=4):\n    return nn.Sequential(nn.Linear(3, width), nn.Linear(width, 2))",
            "build",
        ),
    ],
)
def test_a_file_without_a_class_gives_its_one_instance_or_factory(tmp_path, source, name):
    """A model file that defines no nn.Module class (a tester's finding: 'defines no nn.Module
    subclass' for ``model = nn.Sequential(...)`` or a ``def model()`` factory) loads its one
    module instance, else its one factory needing no arguments."""
    p = _write(tmp_path, source + "\n")
    loaded = load(str(p), meta=True)
    assert loaded.name.endswith(f":{name}")
    # Linear(3, 4) + Linear(4, 2): 3·4 + 4 + 4·2 + 2 = 26 parameters
    assert sum(t.numel() for t in loaded.model.parameters()) == 26


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("x = 1", "no nn.Module subclass, module instance or factory function"),
        (
            "def a():\n    return nn.Linear(1, 1)\ndef b():\n    return nn.Linear(1, 1)",
            "several candidates (function a(), function b())",
        ),
    ],
)
def test_a_file_without_a_class_and_no_single_candidate_says_so(tmp_path, source, message):
    p = _write(tmp_path, source + "\n")
    with pytest.raises(SpecError) as e:
        load(str(p), meta=True)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_several_roots_is_one_line_listing_roots_and_factories(tmp_path):
    p = _write(
        tmp_path,
        """
        class A(nn.Module):
            pass

        class B(nn.Module):
            pass

        def make_a():
            return A()
        """,
    )
    with pytest.raises(SpecError) as e:
        load(str(p), meta=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert "(A, B)" in msg and "factory functions: make_a" in msg
    assert f"pick one with {p}:Name" in msg
    with pytest.raises(SpecError) as e:  # "file.py:" (a tester's): the hint said file.py::Name
        load(f"{p}:", meta=True)
    assert f"pick one with {p}:Name" in str(e.value) and "::" not in str(e.value)


def test_subclass_base_is_not_a_root(tmp_path):
    p = _write(
        tmp_path,
        """
        class Base(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(2, 2)

        class Net(Base):
            def forward(self, x):
                return self.fc(x)
        """,
    )
    assert load(str(p), meta=True).name == "m.py:Net"


@pytest.mark.parametrize(
    "example",
    [
        "{'x': torch.zeros(2, 4), 'mask': torch.ones(2, 4), 'scale': 2.0}",
        "((torch.zeros(2, 4),), {'mask': torch.ones(2, 4), 'scale': 2.0})",
        "[torch.zeros(2, 4), 2.0, torch.ones(2, 4)]",
    ],
    ids=["kwargs", "args_kwargs", "args_with_float"],
)
def test_example_inputs_with_kwargs_and_non_tensors(tmp_path, example):
    p = _write(tmp_path, BLOCK_NET + f"\ndef example_inputs():\n    return {example}\n")
    loaded = load(str(p), meta=True)
    inputs = make_inputs(loaded, batch=5)
    assert [tuple(t.shape) for t in inputs] == [(5, 4), (5, 4)]  # x and mask; 2.0 is constant
    a = analyze(loaded.model, inputs, name="m")
    r = a.report
    # forward mm FLOPs: two Linear(4,4) and one Linear(4,3) at batch 5:
    # 2·5·4·4·2 + 2·5·4·3 = 320 + 120 = 440
    assert r.totals.forward.mm_flops == 440
    # the scale (2.0) is a constant and mask a graph input: one mul by mask (20), one by 2.0 (15)
    assert len(a.forward.meta[SIGNATURE].inputs) == 2
    # parameter names are the model's own (the binding renames nothing)
    assert [q for _, q in a.forward.meta[SIGNATURE].params][0] == "blocks.0.fc.weight"


def test_trace_takes_keyword_arguments():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x, *, bias=None, double=False):
            y = self.fc(x)
            return (y + bias) * (2 if double else 1)

    m = M()
    gm = trace(m, (torch.zeros(4, 3),), kwargs={"bias": torch.zeros(4, 2), "double": True})
    assert len(gm.meta[SIGNATURE].inputs) == 2
    assert type(m) is M  # the model's own class back after tracing


def test_example_inputs_of_a_bad_kind_is_a_spec_error(tmp_path):
    p = _write(tmp_path, BLOCK_NET + "\ndef example_inputs():\n    return 3\n")
    with pytest.raises(SpecError, match="example_inputs\\(\\) returned a int"):
        load(str(p), meta=True)


# --- frozen parameters -----------------------------------------------------------------


def test_frozen_linear_has_no_weight_gradient_update_or_grad_bytes():
    # Linear(6 -> 5) frozen, then Linear(5 -> 3) trainable, batch 4, loss sum
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        x = torch.empty(4, 6)
    model[0].requires_grad_(False)
    a = analyze(model, (x,), name="frozen", loss="sum", optimizer="adam")
    r = a.report
    first, second = r.layer("0"), r.layer("1")
    assert first.grad_weight_flops == 0 and first.update_flops == 0
    # nothing upstream of layer 0 trains: its input gradient is not computed either
    assert first.grad_input_flops == 0
    # layer 1's weight gradient: 2·4·3·5 = 120 (mm) + bias 4·3 = 12 summed over the batch
    assert second.grad_weight_flops == 120 + 12
    # ... but layer 1's input gradient (to layer 0's output) is not needed: nothing above trains
    assert second.grad_input_flops == 0
    assert (r.params, r.trainable_params, r.frozen_params) == (6 * 5 + 5 + 5 * 3 + 3, 18, 35)
    # Adam: 18 FLOPs per trainable element (docs/flops_conventions.md), 18·18 = 324
    assert r.totals.update.flops == 18 * 18
    assert r.memory.grads_bytes == 18 * 4
    # Adam's two moments of the 18 trainable elements and a float32 step count for each of
    # layer 1's 2 tensors (torch.optim.Adam's state["step"])
    assert r.memory.optimizer_state_bytes == 2 * 18 * 4 + 2 * 4
    assert r.memory.params_bytes == 53 * 4
    d = a.to_dict()
    assert (d["trainable_params"], d["frozen_params"]) == (18, 35)


def test_input_gradient_flows_through_a_frozen_layer_below_a_trainable_one():
    # trainable Linear(6 -> 5), frozen Linear(5 -> 3): the frozen layer's input gradient
    # (2·4·3·5 = 120) is needed for the first layer's weight gradient; its weight gradient not
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        x = torch.empty(4, 6)
    model[1].requires_grad_(False)
    r = analyze(model, (x,), name="frozen_top", loss="sum").report
    assert r.layer("1").grad_weight_flops == 0
    assert r.layer("1").grad_input_flops == 120
    # layer 0: 2·4·5·6 = 240 (mm) + bias 4·5 = 20
    assert r.layer("0").grad_weight_flops == 240 + 20


def test_lora_backward_update_and_gradient_bytes_by_hand():
    """models/lora.py at batch 8: x (8, 64) -> fc1 (64 -> 256, rank 4) -> ReLU
    -> fc2 (256 -> 10, rank 4); the bases frozen.

    Weight gradients (2·N·out·in per weight, N = 8):
      fc1.down 2·8·4·64 = 4,096; fc1.up 2·8·256·4 = 16,384; fc2.down 2·8·4·256 = 16,384;
      fc2.up 2·8·10·4 = 640; total 37,504; the bases 0 (unfrozen they would add
      2·8·256·64 + 8·256 = 264,192 and 2·8·10·256 + 8·10 = 41,040).
    Input gradients: fc2.base 2·8·10·256 = 40,960 (flows: fc1's adapters train below it);
      fc1.base 0 (the model input needs none).
    Trainable elements 4·64 + 256·4 + 4·256 + 10·4 = 2,344; frozen 64·256 + 256 + 256·10 + 10
      = 19,210. Adam: 18 FLOPs per trainable element = 42,192; gradients 2,344·4 = 9,376 bytes;
      Adam state 2·9,376 = 18,752 bytes and a float32 step count per trainable tensor (4):
      18,768 bytes.
    """
    r = analysis("lora.py", 8, "adam").report
    grad_w = {n: r.layer(n).grad_weight_flops for n in ("fc1.down", "fc1.up", "fc2.down", "fc2.up")}
    assert grad_w == {"fc1.down": 4096, "fc1.up": 16384, "fc2.down": 16384, "fc2.up": 640}
    assert r.totals.backward.grad_weight_flops == 37504
    assert r.layer("fc1.base").grad_weight_flops == r.layer("fc2.base").grad_weight_flops == 0
    assert r.layer("fc2.base").grad_input_flops == 40960
    assert r.layer("fc1.base").grad_input_flops == 0
    assert (r.trainable_params, r.frozen_params) == (2344, 19210)
    assert r.totals.update.flops == 42192
    assert r.memory.grads_bytes == 9376 and r.memory.optimizer_state_bytes == 18752 + 4 * 4
    full = analysis("lora.py", 8, "adam", (("frozen", False),)).report
    assert full.totals.backward.grad_weight_flops == 37504 + 264192 + 41040
    assert full.frozen_params == 0


@pytest.mark.slow  # (moved out of the default suite: its 300 s budget)
def test_lora_verifies_against_torch_func():
    from graphflop.runtime.verify import verify_analysis

    loaded = load(spec("lora.py"))
    inputs = make_inputs(loaded, batch=2)
    a = analyze(loaded.model, inputs, name="lora")
    checks = verify_analysis(loaded, inputs, a, forward_gradient_samples=50)
    assert all(c.ok for c in checks), checks


def test_jvp_check_of_an_embedding_with_padding_idx():
    # BERT's word embeddings have padding_idx=0 and the check's token ids are 0 or 1: PyTorch
    # gives the padding row no gradient and graphflop's JVP (the VJP's transpose) none either,
    # while torch.func.jvp differentiates it; the check's directions are zero on that row
    from graphflop.ad.jvp import build_jvp
    from graphflop.runtime.verify import (
        padding_rows,
        real_arguments,
        reference_loss_fn,
        run_jvp,
        verify_jvp,
    )

    model = nn.Sequential(nn.Embedding(5, 3, padding_idx=0), nn.Linear(3, 2)).double()
    fwd = trace(model, (torch.tensor([[0, 1, 0, 1]]),), loss="mse")
    jvp = build_jvp(fwd)
    assert padding_rows(fwd) == {"p_model_0_weight": [0]}
    assert verify_jvp(fwd, jvp, model).ok
    # along a direction on the padding row alone, graphflop's tangent is exactly zero and
    # torch.func.jvp's is not: the unmasked check failed (relative error ~0.1 on BERT)
    values = real_arguments(fwd, model)
    t = {p: torch.zeros_like(values[p]) for _, p in jvp.meta[JVP].tangent_inputs}
    t["p_model_0_weight"][0] = 1.0
    got = run_jvp(jvp, values, t)[jvp.meta[JVP].primal_outputs]
    assert float(got) == 0.0
    params = {q: values[n] for n, q in fwd.meta[SIGNATURE].params}
    p_t = {q: t.get(n, torch.zeros_like(values[n])) for n, q in fwd.meta[SIGNATURE].params}
    _, ref = torch.func.jvp(reference_loss_fn(fwd, model, values), (params,), (p_t,))
    assert float(ref) != 0.0


class _TopK(nn.Module):
    """Mixture-of-experts routing in miniature: the top-2 of 8 router scores, weighted."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 8, bias=False)

    def forward(self, x):
        vals, idx = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        return vals * idx.to(vals.dtype)


def test_topk_cost_and_jvp():
    from graphflop.ad.jvp import build_jvp
    from graphflop.ad.vjp import build_vjp
    from graphflop.meta import COST
    from graphflop.runtime.verify import verify_gradients, verify_jvp

    model = _TopK().double()
    fwd = trace(model, (torch.randn(3, 4, dtype=torch.float64),), loss="sum")
    a = analyze(model, (torch.randn(3, 4, dtype=torch.float64),), loss="sum")
    node = next(n for n in a.forward.graph.nodes if n.target is torch.ops.aten.topk.default)
    # docs/flops_conventions.md: N·⌈log2 k⌉ per row of N: 3 rows of 8, k = 2 -> 3·8·1
    assert node.meta[COST].flops == 24
    assert verify_jvp(fwd, build_jvp(fwd), model).ok
    assert verify_gradients(fwd, build_vjp(fwd), model).ok


# --- tracing as libraries see it --------------------------------------------------------


def test_libraries_see_tracing_and_the_flag_is_restored():
    seen = []

    class M(nn.Module):
        def forward(self, x):
            seen.append(torch.compiler.is_compiling())
            return x * 2

    trace(M(), (torch.zeros(2, 2),), loss="sum")
    assert seen and all(seen)
    assert torch.compiler.is_compiling() is False


def test_data_dependent_control_flow_is_one_line_with_the_source_line(tmp_path):
    p = _write(
        tmp_path,
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                if x.sum() > 0:
                    return self.fc(x)
                return x

        def example_inputs():
            return (torch.zeros(2, 4),)
        """,
    )
    r = subprocess.run(
        [sys.executable, "-m", "graphflop.cli", "inspect", str(p)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "m.py:10: if x.sum() > 0:" in r.stderr
    assert "reads a tensor's value" in r.stderr


def test_packed_sequence_names_the_padded_alternative():
    """Tester's finding: pack_padded_sequence failed with the generic advice on branches."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 8, batch_first=True)

        def forward(self, x):
            packed = pack_padded_sequence(x, torch.tensor([5, 3]), batch_first=True)
            return pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0]

    with pytest.raises(TraceError, match="packed sequence's shapes depend on its lengths"):
        trace(M(), (torch.randn(2, 5, 4),))


def test_batch_norm_with_a_cumulative_average_names_its_momentum():
    """Tester's finding: BatchNorm2d(momentum=None) got the generic advice about the model's
    own branches; the value is read inside PyTorch's batch norm (1 / num_batches_tracked)."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, momentum=None)).train()
    with pytest.raises(TraceError, match="momentum=None .* give momentum a number"):
        trace(model, (torch.randn(2, 2, 5, 5),))


def test_grouped_query_attention_counts_the_math_form():
    # q (1, 4 heads, 6, 8), k and v (1, 2 heads, 6, 8), enable_gqa: each k/v head serves two
    # q heads. Scores 2·(4·6·6·8) = 2,304 and weights·v another 2,304 mm FLOPs.
    class M(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    a = analyze(M(), (q, k, v), name="gqa", loss="sum")
    assert a.report.totals.forward.mm_flops == 2 * 2304
    gm = trace(M(), (q, k, v), loss="none")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = gm(q, k, v)[-1]
    torch.testing.assert_close(got, ref)


def test_trace_failure_still_raises_trace_error():
    class M(nn.Module):
        def forward(self, x):
            return x @ torch.zeros(3, 3)

    with pytest.raises(TraceError):
        trace(M(), (torch.zeros(2, 2),))


# --- hf: specs ----------------------------------------------------------------------------

SMALL_LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "vocab_size": 100,
}


def _hf_analysis(name: str, args: dict, seq: int, **kw):
    loaded = load(f"hf:{name}", ctor_kwargs=args, meta=True, seq=seq)
    loaded.model.train(not kw.pop("eval", False))
    inputs = make_inputs(loaded)
    return loaded, inputs, analyze(loaded.model, inputs, name=loaded.name, **kw)


def test_hf_llama_equals_the_same_model_built_in_a_file(tmp_path):
    pytest.importorskip("transformers")
    p = _write(
        tmp_path,
        f"""
        import transformers

        def llama():
            cfg = transformers.AutoConfig.for_model("llama", use_cache=False, **{SMALL_LLAMA!r})
            return transformers.AutoModelForCausalLM.from_config(cfg)

        def example_inputs():
            return (torch.zeros(1, 32, dtype=torch.long),)
        """,
    )
    _, _, a = _hf_analysis("llama", SMALL_LLAMA, 32)
    loaded = load(f"{p}:llama", meta=True)
    b = analyze(loaded.model, make_inputs(loaded), name="file")
    da, db = a.to_dict(), b.to_dict()
    da.pop("model"), db.pop("model")
    assert da == db
    # forward mm FLOPs by hand, per layer at S = 32, d = 64, kv width 32, ffn 128:
    # q, o 2·32·64·64 each; k, v 2·32·64·32 each; scores and weights·v 2·(4·32·32·16) each;
    # gate, up, down 2·32·64·128 each; the LM head 2·32·64·100
    layer = 2 * (2 * 32 * 64 * 64) + 2 * (2 * 32 * 64 * 32) + 2 * (2 * 4 * 32 * 32 * 16)
    layer += 3 * (2 * 32 * 64 * 128)
    assert da["totals"]["forward"]["mm_flops"] == 2 * layer + 2 * 32 * 64 * 100


def test_hf_sweep_honours_seq():
    """Tester's finding: sweep dropped --seq, so an hf: model was swept at 128
    tokens whatever was asked. The sweep's forward at 32 tokens is the analysis' at 32 (whose
    matrix FLOPs the test above counts by hand), not the one at 128."""
    pytest.importorskip("transformers")
    from graphflop.sweep import sweep

    (row,) = sweep("hf:llama", batches=[1], ctor_kwargs=SMALL_LLAMA, seq=32)
    _, _, a = _hf_analysis("llama", SMALL_LLAMA, 32)
    assert row["forward_flops"] == a.report.totals.forward.flops
    (default,) = sweep("hf:llama", batches=[1], ctor_kwargs=SMALL_LLAMA)  # 128 tokens
    assert default["forward_flops"] > 4 * row["forward_flops"]  # 4x the tokens, and attention


@pytest.mark.parametrize(
    "name,args,eval_",
    [
        ("llama", SMALL_LLAMA, False),
        # BERT in eval mode: training-mode dropout draws different masks than the reference
        (
            "bert",
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "vocab_size": 100,
            },
            True,
        ),
    ],
    ids=["llama", "bert"],
)
def test_hf_verify_passes_with_default_attention(name, args, eval_):
    pytest.importorskip("transformers")
    from graphflop.runtime.verify import verify_analysis

    real = load(f"hf:{name}", ctor_kwargs=args, seq=8)
    real.model.train(not eval_)
    assert real.model.config._attn_implementation == "sdpa"
    inputs = make_inputs(real)
    a = analyze(real.model, inputs, name=name)
    checks = verify_analysis(real, inputs, a, forward_gradient_samples=10)
    assert all(c.ok for c in checks), checks


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "graphflop.cli", "inspect", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.slow  # 19 s
def test_hf_bad_specs_are_one_line_exit_2(tmp_path):
    pytest.importorskip("transformers")
    r = _cli("hf:lama")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "no model type 'lama'" in r.stderr and "llama" in r.stderr
    r = _cli(f"hf:{tmp_path}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "no config.json" in r.stderr


def test_hf_a_config_field_that_does_not_exist_is_refused(tmp_path):
    """Tester's finding: transformers keeps an unknown keyword as an unread attribute, so
    --arg n_layers=2 (GPT-2's field is n_layer) analysed the 12-layer default silently."""
    pytest.importorskip("transformers")
    with pytest.raises(SpecError, match=r"no field 'n_layers'; did you mean n_layer"):
        load("hf:gpt2", ctor_kwargs={"n_layers": 2}, meta=True, seq=8)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(SpecError, match=r"no field 'n_layers'"):
        load(f"hf:{tmp_path}", ctor_kwargs={"n_layers": 2}, meta=True, seq=8)
    # a value the configuration's validator refuses: its reason, not only its heading
    with pytest.raises(SpecError, match=r"not a multiple of the number of attention heads"):
        load("hf:llama", ctor_kwargs={"num_attention_heads": 3}, meta=True, seq=8)
    # an alias of a field (num_hidden_layers is GPT-2's n_layer) is a field
    small = {"num_hidden_layers": 1, "n_embd": 32, "n_head": 2, "vocab_size": 50}
    loaded = load("hf:gpt2", ctor_kwargs=small, meta=True, seq=8)
    assert loaded.model.config.n_layer == 1


def test_hf_default_token_ids_are_real_tokens():
    """Tester's finding: the default input_ids were all 0, Gemma's (and BERT's) padding id, so
    every embedding was zero and --verify compared a zero gradient with zero ('3 of 3
    passed'). The ids are drawn from the vocabulary with a fixed seed, never the padding id."""
    pytest.importorskip("transformers")
    small = dict(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=7,
    )
    loaded = load("hf:gemma2", ctor_kwargs=small, seq=64)
    ids = loaded.example_inputs[0]  # the bound call's tensors: input_ids first
    assert loaded.model.config.pad_token_id == 0
    assert ids.shape == (1, 64) and int(ids.min()) >= 1 and int(ids.max()) <= 6
    assert len(set(ids.flatten().tolist())) == 6  # all six non-padding tokens occur
    again = load("hf:gemma2", ctor_kwargs=small, seq=64).example_inputs[0]
    torch.testing.assert_close(ids, again)  # the same every time


def test_hf_without_transformers_is_a_spec_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    with pytest.raises(SpecError, match=r"pip install 'graphflop\[hf\]'"):
        load("hf:llama", meta=True)


def test_hf_folder_with_config_json(tmp_path):
    pytest.importorskip("transformers")
    import transformers

    transformers.AutoConfig.for_model(
        "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=50
    ).save_pretrained(tmp_path)
    loaded = load(f"hf:{tmp_path}", ctor_kwargs={"n_positions": 64}, meta=True, seq=16)
    assert type(loaded.model).__name__ == "GPT2LMHeadModel"  # a decoder: the causal-LM head
    assert loaded.model.config.n_positions == 64
    assert [tuple(t.shape) for t in make_inputs(loaded)] == [(1, 16)]


@pytest.mark.parametrize("positions", ["default", "packed"])
def test_hf_causal_mask_is_traced_as_eager_runs_it(positions):
    """transformers builds no attention mask eagerly (``is_causal=True``, the fused CPU kernel,
    nothing saved for a mask) when positions run 0…T−1; tracing must not make one where eager
    does not (it used to: the packed-sequence check cannot read traced values). With positions
    given as an input (packed sequences) the mask stays."""
    pytest.importorskip("transformers")
    from graphflop.frontend import composite

    load("hf:llama", ctor_kwargs=SMALL_LLAMA, meta=True, seq=16)  # transformers importable
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "llama", use_cache=False, attn_implementation="sdpa", **SMALL_LLAMA
    )
    model = transformers.AutoModel.from_config(cfg).train()
    ids = torch.randint(0, 100, (2, 16))
    kwargs = {} if positions == "default" else {"position_ids": torch.arange(16).repeat(2, 1)}

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, ids, *pos):
            return self.m(ids, **({"position_ids": pos[0]} if pos else {})).last_hidden_state

    masks = []
    real = composite.sdpa

    def spy(q, k, v, attn_mask=None, *args, **kw):
        masks.append(attn_mask)
        return real(q, k, v, attn_mask, *args, **kw)

    inputs = (ids, *kwargs.values())
    try:
        composite.sdpa = spy
        analyze(Wrapped(), inputs, loss="sum")
    finally:
        composite.sdpa = real
    assert masks
    if positions == "default":
        assert all(m is None for m in masks)
    else:
        assert all(m is not None for m in masks)


def test_tensors_made_in_forward_without_a_device_meet_a_meta_model(tmp_path):
    """Tester's finding: the CLI builds models on the meta device, and a tensor the forward
    makes without ``device=`` (``torch.arange(T)``, a causal mask of ones) is a CPU tensor:
    tracing failed with a meta/CPU device mismatch. Meta tensors are traced as CPU
    FakeTensors; the figures equal those of the model built with memory."""
    p = _write(
        tmp_path,
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(10, 8)
                self.pos = nn.Embedding(6, 8)
                self.fc = nn.Linear(8, 3)

            def forward(self, idx):
                h = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))
                mask = torch.tril(torch.ones(idx.shape[1], idx.shape[1]))
                return self.fc(mask @ h).mean(1)

        def example_inputs():
            return (torch.randint(0, 10, (2, 6)),)
        """,
    )
    meta = load(str(p), meta=True)
    real = load(str(p))
    a = analyze(meta.model, make_inputs(meta), name="meta").report.totals
    b = analyze(real.model, make_inputs(real), name="real").report.totals
    # mask @ h: 2·(2·6·6·8) = 1,152 mm FLOPs; fc: 2·(12·8·3) = 576
    assert a.forward.mm_flops == b.forward.mm_flops == 1152 + 576
    assert a.to_dict() == b.to_dict()


def test_lazy_modules_are_initialised_and_unused_ones_left_out(tmp_path):
    """Tester's finding: a used nn.LazyLinear failed verify (uninitialised parameters) and an
    unused one failed every command with an internal error. Loading runs the forward once on
    the example inputs, as PyTorch initialises lazy modules; an unused one is left out."""
    p = _write(
        tmp_path,
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.LazyLinear(3)
                self.spare = nn.LazyLinear(5)  # never called

            def forward(self, x):
                return self.fc(x)

        def example_inputs():
            return (torch.randn(2, 4),)
        """,
    )
    for meta in (True, False):
        loaded = load(str(p), meta=meta)
        assert [n for n, _ in loaded.model.named_parameters()] == ["fc.weight", "fc.bias"]
        assert tuple(loaded.model.fc.weight.shape) == (3, 4)
        assert "lazy spare.weight is never used by forward: left out" in loaded.notes
        a = analyze(loaded.model, make_inputs(loaded), loss="sum")
        # fc: 2·(2·4·3) = 48 mm FLOPs
        assert a.report.totals.forward.mm_flops == 48


def test_hf_mamba_traces_its_eager_scan():
    """Tester's finding: hf:mamba failed by default ("NYI: querying
    is_contiguous inside of vmap"): transformers takes its associative_scan path under
    compilation, which the trace reports; graphflop builds it with the eager step-by-step scan,
    and --verify's gradients match PyTorch's."""
    pytest.importorskip("transformers")
    from graphflop.runtime.verify import verify_gradients

    args = {"num_hidden_layers": 1, "hidden_size": 32, "state_size": 4, "vocab_size": 50}
    real = load("hf:mamba", ctor_kwargs=args, seq=8)
    assert real.model.config.use_associative_scan is False
    inputs = make_inputs(real)
    a = analyze(real.model, inputs, name="mamba")
    check = verify_gradients(a.forward, a.backward, real.model)
    assert check.ok, check


@pytest.mark.slow  # about 10 s; run in CI with -m slow
def test_hf_bloom_with_its_custom_autograd_function_matches_flop_counter_mode():
    """A tester's finding: Bloom's MLP calls ``GeLUFunction.apply`` (a custom
    autograd.Function without setup_context, in train and eval mode alike), which tracing
    refused. Its forward is traced and its own backward is the backward; it has no jvp, so
    the JVP phase is incomplete and names it, as PyTorch's forward AD would refuse it.
    Independent count: FlopCounterMode over the same meta model and tokens counts the
    forward's matrix FLOPs (linear layers, the attention's baddbmm and bmm, the LM head) as
    graphflop's forward mm_flops."""
    pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    args = {"n_layer": 2, "hidden_size": 64, "n_head": 4, "vocab_size": 100}
    loaded, inputs, a = _hf_analysis("bloom", args, 16)
    assert a.backward is not None and a.jvp is not None
    assert a.report.totals.backward.complete and not a.report.totals.jvp.complete
    assert [(u.op, u.missing) for u in a.report.uncounted] == [
        ("autograd.Function GeLUFunction", ("jvp",))
    ]
    with FlopCounterMode(display=False) as counter:
        loaded.model(*inputs)
    assert a.report.totals.forward.mm_flops == counter.get_total_flops() > 0


def test_example_inputs_given_as_a_value(tmp_path):
    """A tester's finding: ``example_inputs = torch.randn(2, 4)`` (a value, not a function) got
    'no example_inputs() in its file'. The value is taken as the function's return would be;
    one that is no inputs is named."""
    body = "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    body += "        self.fc = nn.Linear(4, 3)\n    def forward(self, x):\n"
    body += "        return self.fc(x)\n"
    loaded = load(str(_write(tmp_path, body + "example_inputs = torch.randn(2, 4)\n")), meta=True)
    assert [tuple(t.shape) for t in loaded.example_inputs] == [(2, 4)]
    with pytest.raises(SpecError, match="example_inputs is an int: define it as a function"):
        load(str(_write(tmp_path, body + "example_inputs = 3\n", "n.py")), meta=True)
