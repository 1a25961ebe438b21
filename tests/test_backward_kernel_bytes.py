"""A composite op's backward eager PyTorch runs as one kernel (``native_layer_norm_backward``,
``_softmax_backward_data``, ``_log_softmax_backward_data``, ``gelu_backward``) moves that
kernel's bytes: the backward nodes graphflop's rules make for the op's parts (``SOURCE``)
read what they take from outside them once (the cotangent, the forward values they read) and
write the values that leave them once (the gradients), in their dtypes; their intermediates
are not counted (graphflop.passes.flops, backward_kernel_costs). FLOPs, the graph and its
numerics are unchanged; the JVP graph is left as it was.

The reads are the forward values graphflop's derivative rules read, which are more than the
eager kernel's: eager's layer norm backward reads x, μ and rstd and recomputes x̂ and x - μ,
graphflop's rules read both (and in bfloat16 the float32 values of the upcasting
decomposition). The comments give eager's kernel signature beside each count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from graphflop import analyze
from graphflop.meta import (
    BACKWARD_KERNELS,
    COMPOSITE,
    COST,
    DERIVED_HIERARCHY,
    JVP,
    KIND,
    SOURCE,
)
from graphflop.ops.cost import op_cost
from graphflop.passes.autodiff import BuildVjp
from graphflop.passes.flops import AnnotateFlops, backward_kernels_of, flat_costs
from graphflop.passes.infra import run_passes

sys.path.insert(0, str(Path(__file__).parent))
from test_one_kernel_bytes import _tester  # noqa: E402

B, T, D = 4, 8, 16
N = B * T * D  # elements of the activation
R = B * T  # rows

LN = "aten.native_layer_norm.default"
SOFTMAX = "aten._softmax.default"
LOG_SOFTMAX = "aten._log_softmax.default"
GELU = "aten.gelu.default"


def _analysis(module: nn.Module, dtype: torch.dtype):
    """``Linear(D, D)`` then ``module`` on a [B, T, D] input of ``dtype``, sum loss (the
    linear layer makes the op's input need a gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), module).to(dtype)
    x = torch.randn(B, T, D).to(dtype)
    return model, x, analyze(model, (x,))


def _backward_of(a, op: str) -> list[torch.fx.Node]:
    """The backward nodes made for composite op ``op``'s parts."""
    fwd = {n.name: n for n in a.forward.graph.nodes}
    out = []
    for n in a.backward.graph.nodes:
        f = fwd.get(n.meta.get(SOURCE, ""))
        tag = f.meta.get(COMPOSITE) if f is not None else None
        if n.op == "call_function" and COMPOSITE not in n.meta and tag is not None:
            if tag.op == op:
                out.append(n)
    return out


def _bytes(module: nn.Module, dtype: torch.dtype, op: str) -> tuple[int, int]:
    """(bytes read, bytes written) of ``op``'s backward nodes; checks on the way that their
    FLOPs are their rules' and that they were more bytes by their rules."""
    _, _, a = _analysis(module, dtype)
    nodes = _backward_of(a, op)
    assert len(nodes) > 1
    rules = [op_cost(n.target, n.args, n.kwargs, n) for n in nodes]
    costs = [n.meta[COST] for n in nodes]
    assert [c.flops for c in costs] == [r.flops for r in rules]
    assert [c.transcendentals for c in costs] == [r.transcendentals for r in rules]
    read, written = sum(c.bytes_read for c in costs), sum(c.bytes_written for c in costs)
    assert read < sum(r.bytes_read for r in rules)
    assert written < sum(r.bytes_written for r in rules)
    return read, written


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_backward_is_one_kernel(dtype):
    # s = the dtype's element size; F = 4 in float32, and in bfloat16 too for the values the
    # upcasting decomposition computes in float32 (x's upcast, x̂, x - μ, μ, rstd):
    # read:    the cotangent N·s; x N·F, x̂ N·F, x - μ N·F; μ and rstd R·4 each; γ D·s
    #          (eager's native_layer_norm_backward(grad_out, input, mean, rstd, weight):
    #          grad_out and x N·s each, μ and rstd R·4 each, γ D·s: it recomputes x̂)
    # written: the input gradient N·s, γ's and β's gradients D·s each (eager's the same)
    s = _size(dtype)
    read, written = _bytes(nn.LayerNorm(D), dtype, LN)
    assert read == N * s + 3 * N * 4 + 2 * R * 4 + D * s
    assert written == N * s + 2 * D * s
    if dtype == torch.float32:
        assert (read, written) == (8_512, 2_176)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_backward_is_one_kernel(dtype):
    # read:    the cotangent N·s; the output, exp(x - max) and x (its upcast in bfloat16) N·4
    #          each; the row sums and maxima R·4 each (graphflop's rules differentiate through
    #          the max; eager's _softmax_backward_data(grad_out, output) reads 2·N·s)
    # written: the input gradient N·s
    s = _size(dtype)
    read, written = _bytes(nn.Softmax(-1), dtype, SOFTMAX)
    assert (read, written) == (N * s + 3 * N * 4 + 2 * R * 4, N * s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_softmax_backward_is_one_kernel(dtype):
    # read:    the cotangent N·s; exp(x - max) and x N·4 each; the row sums and maxima R·4
    #          each (eager's _log_softmax_backward_data(grad_out, output): 2·N·s)
    # written: the input gradient N·s
    s = _size(dtype)
    read, written = _bytes(nn.LogSoftmax(-1), dtype, LOG_SOFTMAX)
    assert (read, written) == (N * s + 2 * N * 4 + 2 * R * 4, N * s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate,saved", [("none", 3), ("tanh", 5)])
def test_gelu_backward_is_one_kernel(dtype, approximate, saved):
    # read:    the cotangent N·s; the forward values the rules read, N·4 each: x/2, x/√2 and
    #          1 + erf (exact); x, x³'s product, the tanh argument, tanh and x/2 (tanh)
    #          (eager's gelu_backward(grad_out, self): 2·N·s)
    # written: the input gradient N·s
    s = _size(dtype)
    read, written = _bytes(nn.GELU(approximate), dtype, GELU)
    assert (read, written) == (N * s + saved * N * 4, N * s)


def test_tester_model_backward_bytes():
    # LayerNorm(64), GELU, softmax, Linear(64, 64) on x 8×128×64, sum loss: X = 65,536
    # elements · 4 = 262,144 B; 1,024 rows (R4 = 4,096 B); W 16,384 B, b 256 B.
    # The model's input needs no gradient: layer norm's backward makes γ's and β's only.
    # read:    linear: input gradient X + W, weight gradient 2X, bias gradient X;
    #          softmax 4X + 2·R4; GELU 4X; layer norm the cotangent and x̂ 2X
    #          = 14X + 24,576 = 3,694,592 (the rules: 10,653,696)
    # written: linear X + W + b; softmax X; GELU X; layer norm 2·256
    #          = 3X + 17,152 = 803,584 (the rules: 5,866,240)
    # bfloat16: the 16-bit tensors half as large, the float32 residuals as large:
    # read:    (X/2 + W/2) + X + X/2; X/2 + 3X + 2·R4; X/2 + 3X; X/2 + X
    #          = 10.5X + 16,384 = 2,768,896 (the rules: 11,039,232)
    # written: X/2 + W/2 + b/2; X/2; X/2; 2·128 = 1.5X + 8,576 = 401,792 (the rules: 6,775,680)
    X = 8 * 128 * 64 * 4
    _, _, f32 = _tester(torch.float32)
    _, _, bf16 = _tester(torch.bfloat16)
    a, b = f32.report.totals.backward, bf16.report.totals.backward
    assert (a.bytes_read, a.bytes_written) == (14 * X + 24_576, 3 * X + 17_152)
    assert (b.bytes_read, b.bytes_written) == (21 * X // 2 + 16_384, 3 * X // 2 + 8_576)
    assert (b.bytes_read, b.bytes_written) == (2_768_896, 401_792)
    assert a.flops == b.flops == 18_612_224  # unchanged
    rows = [r for r in bf16.report.ops if r.phase == "backward"]
    assert sum(r.bytes_read for r in rows) == b.bytes_read
    assert sum(r.bytes_written for r in rows) == b.bytes_written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_unchanged(dtype):
    """Only the byte counts change: the backward graph's gradients are torch.func's."""
    from graphflop.runtime.verify import verify_gradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.GELU(), nn.Softmax(-1))
    model = model.to(dtype)
    x = torch.randn(B, T, D).to(dtype)
    a = analyze(model, (x,))
    check = verify_gradients(a.forward, a.backward, model, examples=(x,))
    assert check.ok, check


def test_jvp_left_as_it_was():
    """The JVP's tangent nodes keep their rules' bytes (eager's forward-mode formulas for layer
    norm and softmax are several kernels: docs/flops_conventions.md)."""
    _, _, a = _analysis(nn.LayerNorm(D), torch.float32)
    assert BACKWARD_KERNELS not in a.jvp.meta and JVP in a.jvp.meta
    for n in a.jvp.graph.nodes:
        if n.op == "call_function" and n.meta.get(KIND) in ("tangent", "coef"):
            assert n.meta[COST] == op_cost(n.target, n.args, n.kwargs, n), n.name


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + self.fc(torch.nn.functional.gelu(self.ln(x))).softmax(-1)


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_backward_as_flat(dtype):
    """Blocks whose backward is a template derivative: every call's node costs what the flat
    graph, built call by call, gives it (and what it costs on its own: flat_costs), and each
    block's three one-kernel backward groups are there."""
    torch.manual_seed(0)
    a = analyze(_Stack().to(dtype), (torch.randn(B, T, D).to(dtype),))
    bwd = a.backward
    dh = bwd.meta[DERIVED_HIERARCHY]
    assert dh.runs and max(dh.uses()) == 3  # one template derivative, called three times
    flat = run_passes(a.forward, [BuildVjp(per_template=False), AnnotateFlops()])
    flat_nodes = {n.name: n for n in flat.graph.nodes}
    kernels = bwd.meta[BACKWARD_KERNELS]
    alone = flat_costs(bwd.graph.nodes, kernels)
    for n in bwd.graph.nodes:
        assert n.meta.get(COST) == flat_nodes[n.name].meta.get(COST), n.name
        if n.op == "call_function":
            assert n.meta[COST] == alone[n], n.name
    groups = backward_kernels_of(bwd.graph.nodes, kernels)
    assert len(groups) == 3 * 3  # layer norm, GELU, softmax per block
