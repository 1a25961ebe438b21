"""Hand-worked FLOP counts: per layer for seed A's networks, single ops, grouped convolutions,
optimizer updates and memory."""

from __future__ import annotations

import pytest
import torch
from conftest import analysis, layer
from torch import nn

from graphflop.analysis import analyze
from graphflop.frontend.errors import TraceError
from graphflop.frontend.trace import trace
from graphflop.meta import COST, GHOSTS, SOURCE
from graphflop.passes.flops import annotate_flops


def test_linearnet_per_layer_batch_4():
    B = 4
    s = analysis("linearnet.py", B).to_dict()
    fc1, fc2, fc3 = layer(s, "fc1"), layer(s, "fc2"), layer(s, "fc3")
    assert fc1["forward_mm_flops"] == 2 * 150528 * 4096 * B  # 2·in·out·batch
    assert fc1["forward_flops"] == 2 * 150528 * 4096 * B + 4096 * B  # + bias adds
    assert fc2["forward_flops"] == 2 * 4096 * 128 * B + 128 * B
    assert fc3["forward_flops"] == 2 * 128 * 10 * B + 10 * B
    assert layer(s, "relu1")["forward_flops"] == 4096 * B
    # first layer: weight gradient (2·in·out·B) + bias gradient (out·B sums); no input gradient
    assert fc1["grad_weight_flops"] == 2 * 150528 * 4096 * B + 4096 * B
    assert fc1["grad_input_flops"] == 0
    assert fc1["pruned_flops"] == 2 * 150528 * 4096 * B  # the input gradient it did not compute
    # later layers: weight gradient and input gradient, each 2·in·out·B
    assert fc2["grad_weight_flops"] == 2 * 4096 * 128 * B + 128 * B
    assert fc2["grad_input_flops"] == 2 * 4096 * 128 * B
    assert fc1["update_flops"] == 2 * (150528 * 4096 + 4096)  # SGD: 2 per parameter
    assert fc1["ratio_no_update"] == 1.0  # 1:1: the weight gradient and bias sum = the forward
    # 2:1 but for the bias: (2·2·4096·128·B + 128·B) / (2·4096·128·B + 128·B) = 16385 / 8193
    assert fc2["ratio_no_update"] == pytest.approx(16385 / 8193, rel=1e-12)


def test_onenet_per_layer_batch_1():
    s = analysis("onenet.py", 1).to_dict()
    fc1, fc2, fc3 = layer(s, "fc1"), layer(s, "fc2"), layer(s, "fc3")
    assert fc1["forward_flops"] == 2 * 1 * 4096 + 4096  # 12,288
    assert fc2["forward_flops"] == 2 * 4096 * 128 + 128  # 1,048,704
    assert fc3["forward_flops"] == 2 * 128 * 10 + 10  # 2,570
    assert fc2["grad_input_flops"] == 2 * 4096 * 128
    assert fc2["update_flops"] == 2 * (4096 * 128 + 128)
    # at batch 1 the update is as large as a forward product: later layers reach 3:1, exactly
    # (4·4096·128 + 128 + 2·(4096·128 + 128)) / (2·4096·128 + 128) = 3·(2·4096 + 1) / (2·4096 + 1)
    assert fc2["ratio"] == pytest.approx(3.0, rel=1e-12)


def test_convnet_per_layer_batch_1():
    s = analysis("convnet.py", 1).to_dict()
    c1, c2 = layer(s, "conv1"), layer(s, "conv2")
    # conv1: 3→32, k7 s2 p3, 224→112, no bias (seed's code): 2·N·Cout·Hout·Wout·Cin·k²
    assert c1["forward_mm_flops"] == 2 * 32 * 112 * 112 * 3 * 49  # 118,013,952
    assert c1["forward_flops"] == 2 * 32 * 112 * 112 * 3 * 49
    assert layer(s, "pool1")["forward_flops"] == (9 - 1) * 32 * 56 * 56  # (k²−1) per output
    # conv2: 32→64, k7 s2 p3, 56→28
    assert c2["forward_mm_flops"] == 2 * 64 * 28 * 28 * 32 * 49  # 157,351,936
    assert layer(s, "avgpool")["forward_flops"] == 64 * 14 * 14 + 64  # mean: in + out
    assert layer(s, "fc")["forward_flops"] == 2 * 64 * 10 + 10
    assert s["params"] == 3 * 32 * 49 + 32 * 64 * 49 + 64 * 10 + 10  # 105,706
    # backward: conv1 has only its weight gradient, conv2 both
    assert c1["grad_weight_flops"] == 2 * 32 * 112 * 112 * 3 * 49
    assert c1["grad_input_flops"] == 0
    assert c1["pruned_flops"] == 2 * 32 * 112 * 112 * 3 * 49
    assert c2["grad_input_flops"] == 2 * 64 * 28 * 28 * 32 * 49
    assert c1["ratio_no_update"] == 1.0 and c2["ratio_no_update"] == 2.0  # no biases: exact


class _One(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _forward_flops(fn, *shapes):
    xs = tuple(torch.randn(s) for s in shapes)
    gm = annotate_flops(trace(_One(fn), xs, loss="none"))
    return sum(n.meta[COST].flops for n in gm.graph.nodes), gm


def test_elementwise_counts():
    for fn in (torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.maximum):
        flops, _ = _forward_flops(fn, (2, 3), (2, 3))
        assert flops == 6, fn  # one per output element
    flops, _ = _forward_flops(lambda a, b: a + b, (4, 3), (3,))  # broadcast: 12 outputs
    assert flops == 12
    flops, gm = _forward_flops(torch.exp, (5, 7))
    assert flops == 35
    assert sum(n.meta[COST].transcendentals for n in gm.graph.nodes) == 35
    flops, _ = _forward_flops(torch.relu, (2, 8))
    assert flops == 16


def test_reduction_counts():
    assert _forward_flops(lambda x: x.sum(1), (4, 6))[0] == 24  # 1 per input element
    assert _forward_flops(lambda x: x.mean(1), (4, 6))[0] == 24 + 4  # + 1 per output (divide)
    assert _forward_flops(lambda x: x.amax(0), (4, 6))[0] == 24
    # var_mean: a mean and a variance, 2 per input element + 2 per output element
    assert _forward_flops(lambda x: torch.var_mean(x, 1), (4, 6))[0] == 2 * 24 + 2 * 4
    # views cost nothing and move no bytes
    flops, gm = _forward_flops(lambda x: x.view(6, 4).permute(1, 0), (4, 6))
    assert flops == 0
    assert all(n.meta[COST].bytes_read == 0 for n in gm.graph.nodes)


def test_lookups_read_the_rows_they_gather():
    """docs/flops_conventions.md: an embedding lookup reads the gathered rows and the indices, not
    the table."""
    from graphflop.analysis import analyze

    a = analyze(nn.Embedding(1000, 16), (torch.zeros(2, 3, dtype=torch.long),), loss="sum")
    lookup = next(n for n in a.forward.graph.nodes if n.target is torch.ops.aten.embedding.default)
    cost = lookup.meta[COST]
    # rows: 2·3·16 float32 = 384 bytes; indices: 2·3 int64 = 48 bytes (the table is 64,000)
    assert (cost.flops, cost.bytes_read, cost.bytes_written) == (0, 384 + 48, 384)


def test_grouped_conv_backward_keeps_the_group_factor():
    conv = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)
    x = torch.randn(4, 16, 16, 16, requires_grad=True)
    a = analyze(_One(conv), (x,), loss="sum", jvp=False)
    t = a.to_dict()["totals"]
    # forward: 2·N·Cout·H·W·(Cin/G)·k² = 2·4·16·16·16·1·9 = 294,912
    assert t["forward"]["mm_flops"] == 294_912
    # backward with the input gradient asked for: input + weight gradient, each = forward
    from graphflop.ad.vjp import build_vjp
    from graphflop.passes.flops import annotate_flops as af

    b = af(build_vjp(a.forward, input_grads=True))
    assert sum(n.meta[COST].mm_flops for n in b.graph.nodes) == 589_824
    # FlopCounterMode in torch 2.13 counts the weight gradient without the 1/G factor
    from torch.utils.flop_counter import FlopCounterMode

    y = conv(x)
    with FlopCounterMode(display=False) as fc:
        y.sum().backward()
    assert fc.get_total_flops() == 5_013_504  # = 294,912 + 16 · 294,912


def test_update_flops_per_optimizer_do_not_depend_on_batch():
    for opt, per in (("sgd", 2), ("momentum", 4), ("adam", 18), ("adamw", 20)):
        u1 = analysis("mlp.py", 1, optimizer=opt).to_dict()
        u2 = analysis("mlp.py", 64, optimizer=opt).to_dict()
        n = u1["params"]
        assert u1["totals"]["update"]["flops"] == per * n + (1 if opt == "adamw" else 0), opt
        assert u1["totals"]["update"]["flops"] == u2["totals"]["update"]["flops"]


def test_saved_for_backward_of_a_bias_free_linear_stack():
    B = 8
    stack = nn.Sequential(
        nn.Linear(32, 64, bias=False), nn.Linear(64, 16, bias=False), nn.Linear(16, 4, bias=False)
    )
    a = analyze(stack, (torch.randn(B, 32),), loss="sum", jvp=False)
    # the weight gradients read the layer inputs: x (B·32), h1 (B·64), h2 (B·16), fp32
    assert a.to_dict()["memory"]["saved_for_backward_bytes"] == 4 * B * (32 + 64 + 16)


def test_nonlinearity_before_the_first_parameter():
    # tanh(x)·W: x needs no gradient, so tanh's backward is pruned, and its coefficient
    # (1 − tanh²) must not be mistaken for a tangent while transposing
    from graphflop.ad.vjp import build_vjp
    from graphflop.runtime.verify import verify_gradients

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 2, dtype=torch.float64))

        def forward(self, x):
            return torch.tanh(x) @ self.w

    m = M()
    fwd = trace(m, (torch.randn(4, 3, dtype=torch.float64),), loss="sum")
    bwd = annotate_flops(build_vjp(fwd))
    assert verify_gradients(fwd, bwd, m, tolerance=1e-12).ok
    # pruned: the input gradient of the product, 2·4·2·3 = 48, and tanh's multiply, 4·3 = 12
    assert sorted(g.cost.flops for g in bwd.meta[GHOSTS]) == [0, 12, 48]


class _QkvSplit(nn.Module):
    """An attention block's projection: Linear(d, 3d) split into q, k, v along the last dim."""

    def __init__(self, d: int, use_k: bool = True):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.use_k = use_k

    def forward(self, x):
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        return (q * k + v) if self.use_k else (q * v)


def _split_backward_nodes(a):
    split = next(n.name for n in a.forward.graph.nodes if "split" in str(n.target))
    return [
        n for n in a.backward.graph.nodes if n.op == "call_function" and n.meta.get(SOURCE) == split
    ]


def test_split_transposes_to_one_concatenation():
    # B=2, T=5, d=4: the split's input is (2, 5, 12), N = 120 float32 elements, 480 bytes.
    # Its cotangent is one cat of the three (2, 5, 4) piece cotangents: 0 FLOPs, the pieces
    # read (3 · 160 = 480 bytes) and the input written (480 bytes). Before, each piece was
    # written into zeros (a full: 480 written; a slice_scatter: 480 + 160 read, 480 written)
    # and the three summed (2 adds: 2 · 120 FLOPs, 2 · 960 read, 2 · 480 written).
    a = analyze(_QkvSplit(4), (torch.randn(2, 5, 4),), loss="sum")
    nodes = _split_backward_nodes(a)
    assert [str(n.target) for n in nodes] == ["aten.cat.default"]
    cost = nodes[0].meta[COST]
    assert (cost.flops, cost.bytes_read, cost.bytes_written) == (0, 480, 480)
    # no other value has two uses: nothing is summed (the three slice_scatters' 2 adds were
    # 2 · 120 = 240 grad_accum FLOPs)
    assert a.report.totals.backward.grad_accum_flops == 0


def test_split_transpose_fills_unused_pieces_with_zeros():
    # k unused: its cotangent is zeros of the piece's shape (a full: 2·5·4·4 = 160 bytes
    # written), concatenated with q's and v's: the cat reads 3 · 160 and writes 480 bytes
    a = analyze(_QkvSplit(4, use_k=False), (torch.randn(2, 5, 4),), loss="sum")
    nodes = _split_backward_nodes(a)
    assert [str(n.target) for n in nodes] == ["aten.full.default", "aten.cat.default"]
    full, cat = (n.meta[COST] for n in nodes)
    assert (full.flops, full.bytes_read, full.bytes_written) == (0, 0, 160)
    assert (cat.flops, cat.bytes_read, cat.bytes_written) == (0, 480, 480)
    assert list(nodes[0].args[0]) == [2, 5, 4]


class _InputMeanPlusLinear(nn.Module):
    """``x.mean(0) + fc(x)``: a value of the input alone, broadcast into a sum with a layer."""

    def __init__(self, mean_first: bool):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.mean_first = mean_first

    def forward(self, x):
        return x.mean(0) + self.fc(x) if self.mean_first else self.fc(x) + x.mean(0)


@pytest.mark.parametrize("tangents", ["params", "all"])
def test_input_term_broadcast_into_a_sum_is_pruned(tangents):
    """A tester's finding: ``x.mean(0) + fc(x)`` ([8] + [4, 8]) raised in the backward build:
    the pruned cotangent of the input's mean arrived with the sum's shape [4, 8] and its
    transpose could not expand it. It now arrives summed back to [8]. The backward is the
    same with the operands swapped, and so is the pruned work, the input gradient eager
    autograd skips: fc's input-gradient mm 2·4·8·8 = 512, the sum back to [8] over 4·8 = 32 elements,
    the mean's division over 8, and the add merging the two paths into x's gradient, 32:
    512 + 32 + 8 + 32 = 584."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    first = analyze(_InputMeanPlusLinear(True), x, tangents=tangents).report.totals.backward
    second = analyze(_InputMeanPlusLinear(False), x, tangents=tangents).report.totals.backward
    assert first.flops == second.flops and first.grad_weight_flops == second.grad_weight_flops
    # swapped, the sum is the addmm's tangent, logged before the mean's ghost: the ghost took
    # no cotangent and its 32 + 8 were missing (544)
    assert first.pruned_flops == second.pruned_flops == 512 + 32 + 8 + 32


class _NormedInputPlusMean(nn.Module):
    """``x.mean(0) + fc(LayerNorm(x))`` (or ``fc(LayerNorm(x)) + x.mean(0)``): the input's
    mean broadcast into a sum with a layer behind a LayerNorm."""

    def __init__(self, mean_first: bool):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.mean_first = mean_first

    def forward(self, x):
        h = self.ln(x)
        return x.mean(0) + self.fc(h) if self.mean_first else self.fc(h) + x.mean(0)


class _NormedBlocks(nn.Module):
    def __init__(self, mean_first: bool, n: int):
        super().__init__()
        self.b = nn.Sequential(*[_NormedInputPlusMean(mean_first) for _ in range(n)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.b(x))


@pytest.mark.parametrize("record", [False, True])
@pytest.mark.parametrize("n", [1, 4])
def test_input_term_beside_a_layer_norm_is_pruned_once(n, record):
    """A profiler's finding: with 4 blocks ``fc(LayerNorm(x)) + x.mean(0)`` counted 400 pruned
    FLOPs and ``x.mean(0) + fc(LayerNorm(x))`` 368 (1 block: 368 both). Only block 0's input
    path is pruned (x needs no gradient; blocks 1-3 read block 0's output, which depends on
    parameters); fc's input gradient is not (LayerNorm's weight and bias gradients need it).
    Hand count, x and the cotangent [4, 8], LayerNorm as decomposed (var_mean, rsqrt(var + eps),
    sub = x - mean, x̂ = sub·rstd, x̂·w + b), its coefficients (-rstd³/2, 2·sub/8) not counted,
    as tanh's 1 - tanh² is not (test_nonlinearity_before_the_first_parameter):

    * LayerNorm (b.0.ln): ·w 32; ·rstd 32, and ·sub + sum to [4, 1] 32 + 32; rsqrt's ·coefficient
      4; sub's second operand: negate 32 + sum to [4, 1] 32; the mean's /8 on [4, 1] 4 (expand
      0); var's expand 0 + ·coefficient 32; x read four times (mean(0), sub, var_mean's mean and
      var): 3 merging adds, 3·32 = 96. 32 + 32 + 64 + 4 + 64 + 4 + 32 + 96 = 328.
    * x.mean(0) (b.0): the add's sum of the [4, 8] cotangent back to [8], 32; the mean's /4 on
      [8], 8 (expand 0): 40.

    368 in both orders and both builds. The 32 too many was the pruned sum back to [8] made
    twice: with call sites the log is transposed an entry (a call's run) at a time, and the
    ghost credited at its own entry was credited again at the addmm's (and filed under the
    model's root, role ``forward``, not under block 0)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    runs = [
        analyze(_NormedBlocks(mean_first, n), x, record_derivatives=record).to_dict()
        for mean_first in (True, False)
    ]
    for s in runs:
        bwd = s["totals"]["backward"]
        assert bwd["pruned_flops"] == 328 + 40
        rows = {L["name"]: L["pruned_flops"] for L in s["layers"] if L["pruned_flops"]}
        assert rows == {"b.0.ln": 328, "b.0": 40}
    assert runs[0]["totals"]["backward"]["flops"] == runs[1]["totals"]["backward"]["flops"]


def test_input_term_beside_a_layer_norm_keeps_the_gradients():
    """The same model's backward, swapped order and 4 blocks (the case whose pruned work was
    counted twice), still gives autograd's parameter gradients."""
    from graphflop.ad.vjp import build_vjp
    from graphflop.runtime.verify import verify_gradients

    torch.manual_seed(0)
    m = _NormedBlocks(False, 4).double()
    fwd = trace(m, (torch.randn(4, 8, dtype=torch.float64),), loss="sum")
    assert verify_gradients(fwd, annotate_flops(build_vjp(fwd)), m, tolerance=1e-10).ok


class _InputMeanInTwoSums(nn.Module):
    """``m = x.mean(0)`` dropped into two sums with layers, each in either operand order."""

    def __init__(self, order: tuple[bool, bool]):
        super().__init__()
        self.f1 = nn.Linear(8, 8)
        self.f2 = nn.Linear(8, 8)
        self.order = order

    def forward(self, x):
        m = x.mean(0)
        a = m + self.f1(x) if self.order[0] else self.f1(x) + m
        c = m + self.f2(x) if self.order[1] else self.f2(x) + m
        return a * c


@pytest.mark.parametrize("n", [1, 3])
def test_input_term_in_two_sums_takes_both_cotangents(n):
    """A ghost dropped into two sums takes the sum of both cotangents, as eager accumulates
    m's gradient (one of them used to be dropped, and the merging add with it: 1,160). Pruned,
    block 0 only, x [4, 8]: f1's and f2's input-gradient mm 2·4·8·8 = 512 each; each add's sum
    of the [4, 8] cotangent back to [8], 32 each; their merge into m's gradient, 8; the mean's
    /4 on [8], 8; x read three times (mean, f1, f2): 2 merging adds, 2·32 = 64.
    512 + 512 + 32 + 32 + 8 + 8 + 64 = 1,168, in every operand order."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for order in [(True, True), (True, False), (False, True), (False, False)]:
        model = nn.Sequential(*[_InputMeanInTwoSums(order) for _ in range(n)])
        bwd = analyze(model, x).report.totals.backward
        assert bwd.pruned_flops == 512 + 512 + 32 + 32 + 8 + 8 + 64, order


class _ComplexRotation(nn.Module):
    """A RoPE in complex form, its real view transposed on the way out (the original LLaMA's
    ``view_as_real(...)`` then a reshape of a transpose)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
        self.register_buffer("rot", torch.polar(torch.ones(4), torch.arange(4.0)))

    def forward(self, x):
        c = torch.view_as_complex(self.fc(x).reshape(2, 4, 2)) * self.rot
        return self.head(torch.view_as_real(c).transpose(1, 2).reshape(2, 8))


def test_view_as_real_takes_a_transposed_cotangent():
    """A tester's finding: the cotangent of ``view_as_real`` arrives transposed (strides
    (8, 1, 2)), and ``view_as_complex`` needs a last dim of stride 1: the transpose crashed.
    It is made contiguous first, as PyTorch's ``view_as_complex(grad.contiguous())``: one
    copy of the [2, 4, 2] float32 cotangent, 64 bytes read and written; the gradients are
    autograd's."""
    from graphflop.runtime.verify import verify_gradients

    torch.manual_seed(0)
    model, x = _ComplexRotation(), torch.randn(2, 8)
    a = analyze(model, x)
    clones = [
        n
        for n in a.backward.graph.nodes
        if n.target is torch.ops.aten.clone.default
        and any(u.target is torch.ops.aten.view_as_complex.default for u in n.users)
    ]
    assert len(clones) == 1
    c = clones[0].meta[COST]
    assert (c.flops, c.bytes_read, c.bytes_written) == (0, 64, 64)
    assert clones[0].meta["val"].is_contiguous()
    check = verify_gradients(a.forward, a.backward, model, examples=(x,))
    assert check.ok, check


PLAIN_ATTRIBUTE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.scale = torch.ones(8)  # a plain tensor attribute, not a buffer

    def forward(self, x):
        return self.fc(x * self.scale)

def example_inputs():
    return (torch.randn(2, 8),)
"""


def test_plain_tensor_attribute_of_a_model_built_on_meta(tmp_path):
    """A tester's finding: a model built on the meta device (as the CLI builds it) whose
    forward reads a tensor attribute that is not a buffer failed to trace (a meta constant
    beside CPU inputs). It is traced as on the CPU: the forward counts x·scale, 2·8 = 16
    multiplications, and the linear layer, 2·2·8·3 = 96 for the product plus 2·3 = 6 for the
    bias: 118 FLOPs, the same as the model built on the CPU."""
    from graphflop.load import load, make_inputs

    f = tmp_path / "plain.py"
    f.write_text(PLAIN_ATTRIBUTE)
    loaded = load(str(f), meta=True)
    a = analyze(loaded.model, make_inputs(loaded), loss="none")
    assert a.report.totals.forward.flops == 16 + 96 + 6
    assert loaded.model.scale.device.type == "meta"  # put back
    real = load(str(f))
    assert analyze(real.model, real.example_inputs, loss="none").report.totals.forward.flops == 118


SHARED_ATTRIBUTE = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.__dict__["shared"] = shared  # a plain attribute: a submodule of no module
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(self.shared(x)))

class Net(nn.Module):
    def __init__(self, frozen=False):
        super().__init__()
        shared = nn.Linear(8, 8)
        if frozen:  # the same math with it registered, frozen
            self.shared = shared.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(shared) for _ in range(3)])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)

def example_inputs():
    return (torch.randn(2, 8),)
"""


@pytest.mark.parametrize("outline", [True, False])
def test_a_module_held_only_as_a_plain_attribute_on_meta(tmp_path, outline):
    """A tester's finding: blocks sharing a Linear held only as a plain attribute (registered
    nowhere), built on the meta device as the CLI builds it, failed to trace even with
    --no-outline (its meta weights met the trace's CPU tensors: "FakeTensorDeviceMismatch").
    Its parameters are none of the model's (model.parameters() lacks them): read as
    constants, as on the CPU, with a line saying so. Forward, 3 blocks × (shared 2·2·8·8 +
    16 bias, fc the same, ReLU 16) + head 2·2·8·4 + 8 + the sum's 8: 3·560 + 136 + 8 = 1824;
    weight gradients fc's and the head's only: 3·(256 + 16) + (128 + 8) = 952 (eager
    autograd would add the shared Linear's 3·272); parameters 3·72 + 36 = 252. Every figure
    is the CPU model's, and the totals those of the shared Linear registered but frozen
    (outlined or not: blocks holding it are traced in full, outline.held_apart)."""
    from graphflop.load import load, make_inputs

    f = tmp_path / "shared.py"
    f.write_text(SHARED_ATTRIBUTE)
    loaded = load(str(f), meta=True)
    x = make_inputs(loaded)
    a = analyze(loaded.model, x, loss="sum", outline=outline, name="n")
    r = a.report
    assert (r.totals.forward.flops, r.totals.backward.grad_weight_flops) == (1824, 952)
    assert (r.params, r.trainable_params) == (252, 252)
    assert r.memory.params_bytes + r.memory.buffers_bytes == (252 + 72) * 4
    assert any(s.startswith("blocks.0.shared (Linear) is a module held as") for s in r.assumptions)
    assert loaded.model.blocks[0].shared.weight.device.type == "meta"  # put back
    real = load(str(f))
    assert analyze(real.model, x, loss="sum", outline=outline, name="n").report.to_dict() == (
        r.to_dict()
    )
    frozen = load(str(f), meta=True, ctor_kwargs={"frozen": True})
    b = analyze(frozen.model, x, loss="sum", outline=outline, name="n").report
    assert b.to_dict()["totals"] == r.to_dict()["totals"]
    assert (b.params, b.frozen_params, b.memory.params_bytes) == (324, 72, 324 * 4)


class _HeldTied(nn.Module):
    """A Linear held as a plain attribute whose weight is the model's ``a.weight``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        sh = nn.Linear(8, 8)
        sh.weight = self.a.weight
        self.__dict__["sh"] = sh
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.sh(torch.tanh(self.a(x)))))


def test_a_module_held_as_a_plain_attribute_sharing_a_parameter_is_refused():
    """A tester's finding: a held module whose weight is (by identity) the model's a.weight
    was read as a constant, so a.weight's gradient left out its use there: grad_weight_flops
    748 against 1292 with sh registered (sh.weight's use 2·4·8·8 = 512 missing), and the line
    said its 72 elements were none of the model's. Refused now, naming both places."""
    with pytest.raises(TraceError) as e:
        analyze(_HeldTied(), (torch.randn(4, 8),), loss="sum")
    assert str(e.value).startswith(
        "sh is held as a plain attribute and shares a.weight with the model (as its weight): "
        "register it as a submodule"
    )


class _HeldSeveral(nn.Module):
    def __init__(self):
        super().__init__()
        self.__dict__["bn"] = nn.BatchNorm1d(8)
        self.__dict__["l"] = nn.Linear(8, 4)
        self.lst = [nn.Linear(8, 8)]

    def forward(self, x):
        return self.l(self.lst[0](self.bn(x)))


def test_the_line_on_modules_held_as_plain_attributes_names_each():
    """A tester's finding: with bn and l held so the line named bn only ("bn is a
    BatchNorm1d") with both modules' elements, and a module in a list was named by the list.
    Elements: bn 8 + 8 (weight, bias) + 8 + 8 + 1 (running stats, num_batches_tracked) = 33,
    l 8·4 + 4 = 36, lst[0] 8·8 + 8 = 72: 141."""
    r = analyze(_HeldSeveral(), (torch.randn(4, 8),), loss="sum").report
    line = next(s for s in r.assumptions if "plain attribute" in s)
    assert line.startswith(
        "bn (BatchNorm1d), l (Linear), lst[0] (Linear) are modules held as plain attributes"
    )
    assert "their 141 parameter and buffer elements" in line
    assert r.params == 0


class _InputPlusNarrowLinear(nn.Module):
    def forward(self, x):
        return x + self.fc(x)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)


@pytest.mark.parametrize("record", [True, False])
def test_input_plus_a_narrower_layer_output_is_pruned(record):
    """A tester's finding: ``x + fc(x)`` with ``fc(x)`` of shape [2, 1] broadcast to x's [2, 8]
    raised in the backward build (the ghost x took the [2, 1] cotangent of the narrower real
    term and could not sum it to [2, 8]). The pruned work is x's gradient: fc's input-gradient
    mm 2·2·1·8 = 32, and the add merging it with the sum's own cotangent, 2·8 = 16: 48."""
    torch.manual_seed(0)
    t = analyze(_InputPlusNarrowLinear(), torch.randn(2, 8), record_derivatives=record)
    assert t.report.totals.backward.pruned_flops == 32 + 16


class _PlainMaskTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.mask = torch.ones(8)  # a plain tensor attribute, read twice

    def forward(self, x):
        return self.a(x * self.mask) * self.mask


def test_a_constant_read_twice_is_one_input():
    """A tester's finding: a plain tensor attribute read twice became two constant inputs
    with one argument name, so the JVP graph's code did not compile (verify: NOT RUN,
    'duplicate argument'). It is one input; the JVP runs and equals torch.func.jvp's."""
    from graphflop.runtime.verify_tangent import verify_jvp

    torch.manual_seed(0)
    model, x = _PlainMaskTwice(), torch.randn(2, 8)
    a = analyze(model, x)
    consts = [n for n in a.forward.graph.nodes if n.op == "placeholder" and n.name.startswith("c_")]
    assert len(consts) == 1
    check = verify_jvp(a.forward, a.jvp, model, examples=(x,))
    assert check.ok, check
