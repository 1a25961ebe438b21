"""A table of cases other FLOP counters get wrong, each with its correct count.

2 FLOPs per multiply-add; bias adds are listed separately; fp32. Every count is checked on the
meta device at the table's full size (no memory), in the forward graph and, where the table says,
in the backward graph, and in the JVP graph (tangent products; the arithmetic is in the
comments). Then every case passes ``--verify``'s checks (``verify_analysis``: backward-graph
gradients vs ``torch.func.grad``, JVP-graph tangent vs ``torch.func.jvp``) in float64 at a small
size, input gradients included where the table's input requires grad.

FlopCounterMode, for comparison: it counts the transposed convolutions' input gradient that case
1 does not need (backward 2x), drops the 1/G factor of grouped and depthwise weight gradients
(cases 4, 5, 13), and counts 0 for ``mv`` (case 9) and for scaled dot-product attention on the
CPU and fake-tensor kernels (case 8).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphflop.ad.jvp import build_jvp
from graphflop.ad.vjp import build_vjp
from graphflop.analysis import analyze
from graphflop.frontend.trace import trace
from graphflop.load import LoadedModel
from graphflop.meta import (
    CONSTANTS,
    COST,
    FORWARD_GRADIENT,
    JVP,
    KIND,
    LOSS_KIND,
    ROLE,
    SIGNATURE,
    TRAIN_STEP,
    VJP,
)
from graphflop.passes.flops import annotate_flops, total_cost
from graphflop.runtime.verify import (
    real_arguments,
    rel_error,
    run_backward,
    run_forward,
    verify_analysis,
)

pytestmark = pytest.mark.filterwarnings("ignore")


class Fn(nn.Module):
    """``forward(*xs) = fn(self, *xs)``, with the given submodules and parameters."""

    def __init__(self, fn, **children: Any):
        super().__init__()
        self.fn = fn
        for k, v in children.items():
            if isinstance(v, nn.Module):
                self.add_module(k, v)
            else:
                self.register_parameter(k, nn.Parameter(v))

    def forward(self, *xs):
        return self.fn(self, *xs)


@dataclass
class Counts:
    forward_mm: int
    forward_flops: int  # the model's own nodes (the traced sum loss excluded)
    backward_mm: int
    backward_by_role: dict[str, int]
    jvp_mm: int  # tangent products only (the primal forward is not counted again)
    n_grads: int


def counts(
    build, shapes, *, input_grads: bool = False, tangents: str = "params", dtypes=None
) -> Counts:
    """Trace ``build()`` on the meta device on inputs of ``shapes`` and count every graph."""
    with torch.device("meta"):
        model = build()
    model.train()
    dtypes = dtypes or [torch.float32] * len(shapes)
    inputs = tuple(torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes))
    fwd = annotate_flops(trace(model, inputs, loss="sum"))
    fnodes = [n for n in fwd.graph.nodes if n.meta.get(ROLE) == "forward"]
    fcost = total_cost(fnodes)
    bwd = annotate_flops(build_vjp(fwd, input_grads=input_grads))
    by_role: dict[str, int] = {}
    for n in bwd.graph.nodes:
        if n.op == "call_function":
            role = n.meta.get(ROLE, "")
            by_role[role] = by_role.get(role, 0) + n.meta[COST].flops
    jvp = annotate_flops(build_jvp(fwd, tangents))
    tnodes = [n for n in jvp.graph.nodes if n.meta.get(KIND) == "tangent"]
    info = bwd.meta[VJP]
    return Counts(
        fcost.mm_flops,
        fcost.flops,
        total_cost(bwd.graph.nodes).mm_flops,
        by_role,
        total_cost(tnodes).mm_flops,
        len(info.grads) + len(info.input_grads),
    )


# --- 1-6: transposed convolutions ------------------------------------------------------------


def test_case1_conv_transpose_weight_gradient_only():
    """ConvTranspose2d(192, 384, 2, stride=2) on (6, 192, 30, 96), input without grad:
    2·N·Cin·∏S·(Cout/G)·∏k = 2·6·192·(30·96)·384·4 = 10,192,158,720 forward; the backward is
    the weight gradient alone, the same count (FlopCounterMode: 2x, the unneeded input
    gradient too); ratio 1.0."""
    c = counts(lambda: nn.ConvTranspose2d(192, 384, 2, stride=2), [(6, 192, 30, 96)])
    f = 2 * 6 * 192 * (30 * 96) * 384 * 4
    assert f == 10_192_158_720
    assert c.forward_mm == f
    assert c.forward_flops == f + 6 * 384 * 60 * 192  # + bias adds on (6, 384, 60, 192)
    assert c.backward_mm == f
    assert c.backward_mm / c.forward_mm == 1.0
    assert c.jvp_mm == f  # conv(x, W_dot): one product (x carries no tangent)


@pytest.mark.parametrize(
    "build,shape,mm,bias",
    [
        # case 2: 2·1·32·(1·1)·1·9 = 576; out (1, 1, 3, 3)
        (lambda: nn.ConvTranspose2d(32, 1, 3), (1, 32, 1, 1), 576, 9),
        # case 3: 2·1·3·(2·2)·1·4 = 96; out (1, 1, 4, 4): 16
        (lambda: nn.ConvTranspose2d(3, 1, 2, stride=2), (1, 3, 2, 2), 96, 16),
        # case 4: 2·2·4·64·(4/4)·9 = 9,216; out (2, 4, 16, 16): 2,048
        (
            lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=4),
            (2, 4, 8, 8),
            9_216,
            2_048,
        ),
        # case 5: 2·2·6·64·(6/3)·4 = 12,288; out (2, 6, 16, 16): 3,072
        (lambda: nn.ConvTranspose2d(6, 6, 2, stride=2, groups=3), (2, 6, 8, 8), 12_288, 3_072),
        # case 6: 2·2·4·64·6·16 = 98,304; out (2, 6, 16, 16): 3,072
        (lambda: nn.ConvTranspose2d(4, 6, 4, stride=2, padding=1), (2, 4, 8, 8), 98_304, 3_072),
    ],
    ids=["case2", "case3", "case4", "case5", "case6"],
)
def test_cases2to6_conv_transpose(build, shape, mm, bias):
    c = counts(build, [shape], input_grads=True, tangents="all")
    assert c.forward_mm == mm
    assert c.forward_flops == mm + bias
    # input gradient (a convolution) and weight gradient, each the forward's count, 1/G included
    assert c.backward_mm == 2 * mm
    assert c.jvp_mm == 2 * mm  # conv_T(x_dot, W) + conv_T(x, W_dot)


# --- 7, 8: attention ---------------------------------------------------------------------------


def test_case7_multihead_attention():
    """nn.MultiheadAttention(100, 1), q = k = v (1, 1000, 100): in-projection 2·1000·100·300
    = 60 M; scores 2·1000·1000·100 = 200 M; weights·v 200 M; out-projection 20 M: 480 M."""
    c = counts(
        lambda: Fn(
            lambda s, x: s.mha(x, x, x)[0], mha=nn.MultiheadAttention(100, 1, batch_first=True)
        ),
        [(1, 1000, 100)],
    )
    assert c.forward_mm == 60_000_000 + 2 * 200_000_000 + 20_000_000 == 480_000_000
    # backward: in-projection weight gradient 60 M (no input gradient); both operands of both
    # attention products 4·200 M; out-projection input and weight gradients 2·20 M
    assert c.backward_mm == 60_000_000 + 800_000_000 + 40_000_000
    # JVP: the same products with one operand's tangent each
    assert c.jvp_mm == 60_000_000 + 800_000_000 + 40_000_000


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_case8_sdpa(causal):
    """F.scaled_dot_product_attention on (1, 8, 1024, 64) q, k, v: 2·8·1024·1024·64 for the
    scores and again for weights·v = 2,147,483,648, causal or not (the dense kernel computes
    the full matrix; docs/flops_conventions.md)."""
    c = counts(
        lambda: Fn(lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
        [(1, 8, 1024, 64)] * 3,
        input_grads=True,
        tangents="all",
    )
    f = 2 * 8 * 1024 * 1024 * 64 * 2
    assert f == 2_147_483_648
    assert c.forward_mm == f
    assert c.backward_mm == 2 * f  # q̄, k̄ from the scores; p̄, v̄ from weights·v
    assert c.jvp_mm == 2 * f


# --- 9, 10, 11: matmul with 1-D and broadcast operands, Conv1d, a shared Linear -----------------


def test_case9_matmul_vector_and_broadcast():
    # (64, 128) @ (128,): mv, 2·64·128 = 16,384 (FlopCounterMode: 0)
    c = counts(lambda: Fn(lambda s, x: x @ s.w, w=torch.empty(128)), [(64, 128)])
    assert c.forward_mm == 2 * 64 * 128 == 16_384
    assert c.backward_mm == 16_384 and c.jvp_mm == 16_384  # x̄ not needed; w̄ = xᵀ·ct
    # (32, 64) @ (8, 64, 16): broadcast to 8 products (32×64)(64×16): 2·8·32·64·16 = 524,288
    c = counts(lambda: Fn(lambda s, x: x @ s.w, w=torch.empty(8, 64, 16)), [(32, 64)])
    assert c.forward_mm == 2 * 8 * 32 * 64 * 16 == 524_288
    assert c.backward_mm == 524_288 and c.jvp_mm == 524_288


def test_case10_conv1d_64bit():
    """Conv1d(1000, 1000, 3, padding=1) on (1, 1000, 512): 2·512·1000·1000·3 = 3,072,000,000
    (> 2³¹) and 512,000 bias adds; totals stay exact through the JSON summary."""
    c = counts(lambda: nn.Conv1d(1000, 1000, 3, padding=1), [(1, 1000, 512)])
    assert c.forward_mm == 3_072_000_000
    assert c.forward_flops == 3_072_000_000 + 512_000
    assert c.backward_mm == 3_072_000_000  # weight gradient only
    with torch.device("meta"):
        model = nn.Conv1d(1000, 1000, 3, padding=1)
    a = analyze(model, (torch.empty(1, 1000, 512, device="meta"),), loss="sum", jvp=False)
    doc = json.loads(json.dumps(a.to_dict()))
    assert doc["totals"]["forward"]["mm_flops"] == 3_072_000_000
    assert doc["totals"]["forward"]["flops"] == 3_072_000_000 + 512_000 + 512_000  # + sum loss


def test_case11_shared_linear_accumulates_one_gradient():
    """One Linear(100, 100) on three (1, 100) slices of a (1, 300) input: 3·2·100·100 = 60,000
    and 3·100 bias adds; the backward computes three weight-gradient products (60,000) and adds
    them into one gradient (2 adds of 100·100, 2 of 100 for the bias)."""
    c = counts(
        lambda: Fn(
            lambda s, x: torch.cat([s.fc(x[:, i * 100 : (i + 1) * 100]) for i in range(3)], 1),
            fc=nn.Linear(100, 100),
        ),
        [(1, 300)],
    )
    assert c.forward_mm == 60_000
    assert c.forward_flops == 60_000 + 300
    assert c.backward_mm == 60_000
    assert c.backward_by_role["grad_accum"] == 2 * (100 * 100 + 100)
    assert c.n_grads == 2  # one weight gradient, one bias gradient
    assert c.jvp_mm == 60_000


@pytest.mark.parametrize("op", ["add", "sub", "div", "pow"])
def test_case12_binary_ops(op):
    fn = {"add": torch.add, "sub": torch.sub, "div": torch.div, "pow": torch.pow}[op]
    c = counts(lambda: Fn(lambda s, a, b: fn(a, b)), [(2, 3), (2, 3)], tangents="all")
    assert c.forward_flops == 6  # 1 per output element (docs/flops_conventions.md)
    assert c.forward_mm == 0


def test_case13_depthwise_conv_with_input_grad():
    """Conv2d(64, 64, 3, padding=1, groups=64) on (1, 64, 56, 56) requiring grad:
    2·1·64·(56·56)·(64/64)·9 = 3,612,672 forward; input and weight gradients the same each:
    7,225,344 (FlopCounterMode: 3,612,672 + 64x the weight gradient)."""
    c = counts(
        lambda: nn.Conv2d(64, 64, 3, padding=1, groups=64),
        [(1, 64, 56, 56)],
        input_grads=True,
        tangents="all",
    )
    assert c.forward_mm == 3_612_672
    assert c.backward_mm == 7_225_344
    assert c.jvp_mm == 7_225_344


# --- every case passes --verify's checks, in small ----------------------------------------------


def _math_sdpa(q, k, v, **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


SMALL = {
    "case1": (lambda: nn.ConvTranspose2d(4, 6, 2, stride=2), [(2, 4, 3, 5)], False),
    "case2": (lambda: nn.ConvTranspose2d(32, 1, 3), [(1, 32, 1, 1)], True),
    "case3": (lambda: nn.ConvTranspose2d(3, 1, 2, stride=2), [(1, 3, 2, 2)], True),
    "case4": (
        lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=4),
        [(2, 4, 8, 8)],
        True,
    ),
    "case5": (lambda: nn.ConvTranspose2d(6, 6, 2, stride=2, groups=3), [(2, 6, 8, 8)], True),
    "case6": (lambda: nn.ConvTranspose2d(4, 6, 4, stride=2, padding=1), [(2, 4, 8, 8)], True),
    "case7": (
        lambda: Fn(
            lambda s, x: s.mha(x, x, x)[0], mha=nn.MultiheadAttention(10, 1, batch_first=True)
        ),
        [(1, 7, 10)],
        True,
    ),
    # (q · a: a parameter before the attention, so that --verify's parameter-only backward
    # graph has a tangent to transpose; the input-gradient check below covers q, k, v. The
    # math backend: PyTorch's CPU flash kernel has no forward-mode derivative for the
    # torch.func.jvp reference; graphflop traces the same math form either way)
    "case8": (
        lambda: Fn(lambda s, q, k, v: _math_sdpa(q * s.a, k, v), a=torch.randn(1, 2, 6, 4)),
        [(1, 2, 6, 4)] * 3,
        True,
    ),
    "case8_causal": (
        lambda: Fn(
            lambda s, q, k, v: _math_sdpa(q * s.a, k, v, is_causal=True), a=torch.randn(1, 2, 6, 4)
        ),
        [(1, 2, 6, 4)] * 3,
        True,
    ),
    "case9_mv": (
        lambda: Fn(lambda s, x: (x @ s.w) * s.r, w=torch.randn(5), r=torch.randn(4)),
        [(4, 5)],
        True,
    ),
    "case9_broadcast": (lambda: Fn(lambda s, x: x @ s.w, w=torch.randn(3, 5, 2)), [(4, 5)], True),
    "case10": (lambda: nn.Conv1d(6, 6, 3, padding=1), [(1, 6, 8)], True),
    "case11": (
        lambda: Fn(
            lambda s, x: torch.cat([s.fc(x[:, i * 4 : (i + 1) * 4]) for i in range(3)], 1) * s.r,
            fc=nn.Linear(4, 4),
            r=torch.randn(1, 12),
        ),
        [(1, 12)],
        True,
    ),
    "case12": (
        lambda: Fn(
            lambda s, a, b: (lambda a, b: (a + b) * (a - b) / (b * b + 1) + (a * a + 1) ** b)(
                a * s.p, b * s.q
            ),
            p=torch.randn(2, 3),
            q=torch.randn(2, 3),
        ),
        [(2, 3), (2, 3)],
        True,
    ),
    "case13": (lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8), [(1, 8, 6, 6)], True),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_case_passes_verify(name):
    build, shapes, input_grads = SMALL[name]
    torch.manual_seed(0)
    model = build().double()
    for p in model.parameters():  # random biases too (PyTorch initialises some to zero)
        p.data.normal_()
    model.train()
    inputs = tuple(torch.empty(s, dtype=torch.float64) for s in shapes)
    a = analyze(model, inputs, loss="sum", tangents="all")
    for check in verify_analysis(LoadedModel(name, model, None), inputs, a):
        assert check.ok, (check.name, check.worst_rel_error, check.where)
    if input_grads:  # the input's cotangent, which --verify does not compare
        fwd = trace(model, inputs, loss="sum")
        bwd = build_vjp(fwd, input_grads=True)
        values = real_arguments(fwd, model, seed=1)
        grads = run_backward(bwd, run_forward(fwd, values))
        sig = fwd.meta[SIGNATURE]
        xs = tuple(values[n] for n in sig.inputs)
        params = {q: values[n] for n, q in sig.params}

        def f(xs_):
            return torch.func.functional_call(copy.deepcopy(model), params, xs_).sum()

        ref = torch.func.grad(f)(xs)
        for pos, n in bwd.meta[VJP].input_grads:
            assert rel_error(grads[pos], ref[sig.inputs.index(n)]) < 1e-9, n


# --- GPT-2 ---------------------------------------------------------------------------------------


def _gpt2(name: str, **ctor):
    from conftest import spec

    from graphflop.load import load

    return load(spec(f"gpt2.py:{name}"), ctor_kwargs=ctor, meta=True)


@pytest.mark.parametrize(
    "size,params",
    [
        ("gpt2_small", 124_439_808),
        ("gpt2_medium", 354_823_168),
        ("gpt2_large", 774_030_080),
        ("gpt2_xl", 1_557_611_200),
    ],
)
def test_gpt2_parameter_counts(size, params):
    """Token and position embeddings, per block 12·d² + 13·d, final LayerNorm 2·d; the head is
    tied to the token embedding (counted once). small: 38,597,376 + 786,432 + 12·7,087,872 +
    1,536 = 124,439,808."""
    loaded = _gpt2(size)
    assert sum(p.numel() for p in loaded.model.parameters()) == params
    assert all(p.is_meta for p in loaded.model.parameters())  # no parameter memory


def test_gpt2_small_forward_matrix_flops():
    """Per layer 24·T·d² (q, k, v, output projection and the 4x MLP) + 4·T²·d (scores and
    weights·v, causal or not); the tied head 2·T·d·V. T = 1024, d = 768, V = 50257:
    12·(14,495,514,624 + 3,221,225,472) + 79,047,426,048 = 291,648,307,200."""
    from graphflop.load import make_inputs

    loaded = _gpt2("gpt2_small")
    a = analyze(loaded.model.train(), make_inputs(loaded), backward=False, jvp=False)
    t, d, v = 1024, 768, 50257
    expected = 12 * (24 * t * d * d + 4 * t * t * d) + 2 * t * d * v
    assert expected == 291_648_307_200
    assert a.report.totals.forward.mm_flops == expected
    assert a.report.loss == "cross_entropy"  # (N·T, V) logits: the language-model loss


TINY_GPT2 = {"n_layer": 2, "n_head": 4, "n_embd": 32, "vocab_size": 101, "n_positions": 16}


def test_tiny_gpt2_verifies_with_token_inputs():
    """The GPT-2 code path (embeddings, causal SDPA, tanh GELU, tied head, cross-entropy over
    N·T positions) against torch.func in float64: --verify's gradient check, and its JVP check
    with the integer token ids held fixed (see test_cli_verify_gpt2)."""
    from conftest import spec

    from graphflop.ad.jvp import build_jvp
    from graphflop.load import load, make_inputs
    from graphflop.runtime.verify import reference_loss_fn, run_jvp, verify_gradients

    meta = load(spec("gpt2.py:GPT2"), ctor_kwargs=TINY_GPT2, meta=True)
    inputs = make_inputs(meta, shapes=[(2, 16)])
    assert inputs[0].dtype == torch.int64  # --input-shape keeps token ids integer
    torch.manual_seed(0)
    model = load(spec("gpt2.py:GPT2"), ctor_kwargs=TINY_GPT2).model.double().train()
    fwd = trace(model, (torch.randint(0, 101, (2, 16)),))
    assert fwd.meta[LOSS_KIND] == "cross_entropy"
    check = verify_gradients(fwd, build_vjp(fwd), model)
    assert check.ok, check
    jvp = build_jvp(fwd, "params")
    values = real_arguments(fwd, model, seed=0)
    info = jvp.meta[JVP]
    gen = torch.Generator().manual_seed(1)
    tangents = {
        p: torch.randn(values[p].shape, generator=gen, dtype=values[p].dtype)
        for _, p in info.tangent_inputs
    }
    got = run_jvp(jvp, values, tangents)[info.primal_outputs]
    sig = fwd.meta[SIGNATURE]
    params = {q: values[n] for n, q in sig.params}
    _, ref = torch.func.jvp(
        reference_loss_fn(fwd, model, values), (params,), ({q: tangents[n] for n, q in sig.params},)
    )
    assert rel_error(got, ref) < 1e-9


def test_token_embedding_is_data_the_position_embedding_is_not():
    """Parameter-derived means computed from parameters and constants only: the lookup at the
    token ids depends on the data (its cotangent is an activation gradient and it is saved for
    nothing), the lookup at arange positions does not."""
    from conftest import spec

    from graphflop.load import load, make_inputs
    from graphflop.meta import PARAM_DERIVED

    loaded = load(spec("gpt2.py:GPT2"), ctor_kwargs=TINY_GPT2, meta=True)
    fwd = trace(loaded.model.train(), make_inputs(loaded, shapes=[(2, 16)]))
    lookups = {
        n.args[0].name: n.meta[PARAM_DERIVED]
        for n in fwd.graph.nodes
        if n.target is torch.ops.aten.embedding.default
    }
    assert lookups == {"p_model_wte_weight": False, "p_model_wpe_weight": True}


def test_cli_verify_gpt2():
    """``inspect --verify`` on a GPT-2: the JVP check holds the integer token ids fixed (only
    floating inputs get tangents in torch.func.jvp)."""
    from conftest import spec

    from graphflop.cli import main

    args = [f"--arg={k}={v}" for k, v in TINY_GPT2.items()]
    assert (
        main(
            [
                "inspect",
                spec("gpt2.py:GPT2"),
                *args,
                "--input-shape",
                "1,16",
                "--verify",
                "--verify-samples",
                "0",
                "--format",
                "json",
            ]
        )
        == 0
    )


# --- model libraries ------------------------------------------------------------------------------


def _library(spec_: str):
    from graphflop.load import SpecError, load

    try:
        return load(spec_, meta=True)
    except SpecError as e:
        if "not installed" in str(e):
            pytest.skip(str(e))
        raise


@pytest.mark.slow  # 10 s
def test_torchvision_resnet50_matches_models_resnet50():
    from conftest import spec

    from graphflop.load import load, make_inputs

    ours = load(spec("resnet.py:resnet50"), meta=True)
    theirs = _library("torchvision:resnet50")
    assert theirs.name == "torchvision:resnet50"
    totals = []
    for loaded in (ours, theirs):
        a = analyze(loaded.model.train(), make_inputs(loaded), name=loaded.name)
        t = a.report.totals
        totals.append((t.forward, t.backward, t.update, t.jvp, a.report.params))
    assert totals[0] == totals[1]
    assert totals[0][-1] == 25_557_032


def test_timm_vit_loads():
    from graphflop.load import make_inputs

    loaded = _library("timm:vit_base_patch16_224")
    assert sum(p.numel() for p in loaded.model.parameters()) == 86_567_656
    assert [tuple(x.shape) for x in make_inputs(loaded)] == [(1, 3, 224, 224)]


def test_library_spec_errors():
    from graphflop.load import SpecError, load

    with pytest.raises(SpecError, match="give a model name"):
        load("torchvision:")
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001
        with pytest.raises(SpecError, match="not installed"):
            load("timm:vit_base_patch16_224")
    else:
        with pytest.raises(SpecError, match="timm has no model"):
            load("timm:no_such_model_xyz")


# --- ops models use that need no numerics check of their own --------------------------------------


def test_dropout_train_counts_its_mask():
    """Training-mode dropout decomposes to rand_like (random elements, 0 FLOPs), a comparison
    and two multiplies (the mask and the 1/(1-p) scale): 3 FLOPs per element
    (docs/flops_conventions.md); its random mask makes torch.func comparisons meaningless, so the op
    database checks it in eval mode."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    a = analyze(model.train(), (torch.empty(2, 4, device="meta"),), loss="sum")
    fwd = a.report.totals.forward
    assert fwd.random_elements == 8
    assert fwd.flops == (2 * 2 * 4 * 4 + 8) + 3 * 8 + 8  # addmm; dropout; sum loss


def test_constants_made_in_forward_trace_as_buffers():
    """torch.tensor(...) inside forward is a lifted constant: traced as a fixed buffer (its
    value in gm.meta[CONSTANTS]), so analysis works."""

    class WithConstants(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            scale = torch.tensor([1.0, 2.0, 3.0])
            return self.fc(x) * scale + x.index_select(1, torch.tensor([2, 0, 1]))

    a = analyze(WithConstants(), (torch.randn(2, 3),), loss="sum")
    sig = a.forward.meta[SIGNATURE]
    consts = a.forward.meta[CONSTANTS]
    assert set(consts) <= {n for n, _ in sig.buffers} and len(consts) == 2
    # addmm 2·2·3·3 + 6; mul 6; add 6 (index_select: 0)
    assert a.report.totals.forward.flops - 6 == 36 + 6 + 6 + 6
    backward = a.report.totals.backward
    assert backward is not None and backward.mm_flops == 2 * 2 * 3 * 3


def test_parameter_names_that_are_not_identifiers():
    """Module names with '-' and capitals (torchvision's RegNet, Inception) reach every graph:
    the update, train-step and forward-gradient graphs match parameters by qualified name."""
    from graphflop.passes.optimizer import update_param_count
    from graphflop.passes.train_step import build_train_step

    model = nn.Module()
    model.add_module("block-1", nn.Linear(3, 4))
    model.add_module("Head", nn.Linear(4, 2))
    model.forward = lambda x: model.Head(torch.relu(getattr(model, "block-1")(x)))
    a = analyze(model, (torch.randn(5, 3),), optimizer="adam")
    assert update_param_count(a.update) == 3 * 4 + 4 + 4 * 2 + 2
    step = build_train_step(a.forward, a.backward, a.update)
    assert len(step.meta[TRAIN_STEP].params) == 4
    assert {q for q in a.forward_gradient.meta[FORWARD_GRADIENT].params} == {
        "block-1.weight",
        "block-1.bias",
        "Head.weight",
        "Head.bias",
    }


def test_library_model_whose_constructor_computes_with_tensors_loads_on_meta():
    """torchvision's RegNet computes its widths with tensors in __init__ (which the meta device
    cannot give back): the loader builds it on the CPU with every parameter and buffer moved to
    the meta device as it is registered."""
    loaded = _library("torchvision:regnet_y_400mf")
    assert all(t.is_meta for t in [*loaded.model.parameters(), *loaded.model.buffers()])
    assert sum(p.numel() for p in loaded.model.parameters()) == 4_344_144


ITEM_IN_CTOR = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self, reads: str = "tensor"):
        super().__init__()
        if reads == "tensor":  # a width computed with a tensor and read back
            width = int(torch.tensor([3.0, 5.0]).sum().item())
            self.fc = nn.Linear(4, width)
        else:  # an initialisation reading the registered weight's values
            self.fc = nn.Linear(4, 8)
            with torch.no_grad():
                self.fc.weight.mul_(1.0 / float(self.fc.weight.abs().max().item()))
        self.out = nn.Linear(self.fc.out_features, 2)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def example_inputs():
    return (torch.randn(3, 4),)
"""


@pytest.mark.parametrize("reads", ["tensor", "weight"])
def test_model_file_whose_constructor_reads_tensor_values_loads_on_meta(reads, tmp_path):
    """A model file's constructor that reads a tensor's value (``.item()``, which the meta
    device cannot give: ``parametrizations.orthogonal`` does so) is built on the CPU, its
    parameters and buffers then on the meta device: the loader used to stop at the meta
    device's refusal. Parameters 4·8 + 8 + 8·2 + 2 = 58 either way."""
    from graphflop.load import load

    path = tmp_path / "m.py"
    path.write_text(ITEM_IN_CTOR)
    loaded = load(f"{path}:M", ctor_kwargs={"reads": reads}, meta=True)
    params = list(loaded.model.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == 4 * 8 + 8 + 8 * 2 + 2
