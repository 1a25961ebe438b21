"""Training-mode batch norm traced as one node (``_native_batch_norm_legit_functional``) with
rules of its own, in every floating dtype whose statistics and affine share the input's: its
cost equals the sum of the parts of PyTorch's decomposition, its 16-bit JVP and transpose match
``torch.func``, mixed dtypes are still traced as those parts, and ONNX-style consumers can have
the parts back."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from graphflop.frontend.composite import decompose_kept_whole
from graphflop.frontend.trace import trace
from graphflop.meta import COST
from graphflop.passes.flops import annotate_flops

BN = "aten._native_batch_norm_legit_functional.default"


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _model(dtype=torch.float32):
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).to(dtype).train()


def test_float32_batch_norm_is_one_node_costing_its_parts():
    gm = annotate_flops(trace(_model(), (torch.randn(2, 3, 8, 8),), loss="sum"))
    ops = _targets(gm)
    assert ops.count(BN) == 1 and "aten.var_mean.correction" not in ops
    node = next(n for n in gm.graph.nodes if str(n.target) == BN)
    # N = 2·4·6·6 = 288 elements, C = 4: var_mean 2N + 2C, +eps C, rsqrt C, x − μ N, · rstd N,
    # · γ N, + β N, running mean 3C, running variance (Bessel, momentum) 4C: 6N + 11C
    assert node.meta[COST].flops == 6 * 288 + 11 * 4
    assert node.meta[COST].transcendentals == 4
    # the same as the parts of PyTorch's decomposition, counted by their own rules
    parts = annotate_flops(decompose_kept_whole(gm))
    assert BN not in _targets(parts) and "aten.var_mean.correction" in _targets(parts)
    assert sum(n.meta[COST].flops for n in parts.graph.nodes if COST in n.meta) == sum(
        n.meta[COST].flops for n in gm.graph.nodes if COST in n.meta
    )


def test_decomposed_graph_computes_the_same_values():
    model = _model(torch.float64)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    gm = trace(model, (x,), loss="sum")
    state = [*model.parameters(), *model.buffers()]
    whole = gm(*[t.clone() for t in state], x)
    parts = decompose_kept_whole(gm)(*[t.clone() for t in state], x)
    for a, b in zip(whole, parts):
        torch.testing.assert_close(a, b)


def test_bfloat16_batch_norm_is_one_node_costing_what_float32_counts():
    # eager runs a bfloat16 batch norm as one kernel (16-bit x in, 16-bit out, float32 inside):
    # the same one node, the same FLOPs, bytes at the tensors' dtype (a tester's finding: the
    # parts, with their float32 upcasts, read 3.2× float32's bytes where half is right)
    x = torch.randn(2, 3, 8, 8)
    nodes = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        gm = annotate_flops(trace(_model(dt), (x.to(dt),), loss="sum"))
        ops = _targets(gm)
        assert ops.count(BN) == 1 and "aten.var_mean.correction" not in ops, dt
        assert "aten._to_copy.default" not in ops, dt
        nodes[dt] = next(n for n in gm.graph.nodes if str(n.target) == BN)
    f32 = nodes[torch.float32].meta[COST]
    for dt in (torch.bfloat16, torch.float16):
        n = nodes[dt]
        assert n.meta[COST].flops == f32.flops == 6 * 288 + 11 * 4
        assert n.meta[COST].transcendentals == f32.transcendentals == 4
        # x (2·4·6·6 = 288 elements), γ, β, the running statistics (4 each) in 16 bits;
        # out 288 elements and μ, rstd (4 each) in 16 bits, the new running statistics as the
        # traced op makes them (float32: PyTorch's decomposition, which the fake kernel runs)
        assert n.meta[COST].bytes_read == (288 + 4 * 4) * 2
        out, mean, rstd, new_mean, new_var = n.meta["val"]
        assert (out.dtype, mean.dtype, rstd.dtype) == (dt, dt, dt)
        assert n.meta[COST].bytes_written == (288 + 4 + 4) * 2 + 2 * 4 * new_mean.element_size()


def test_mixed_dtype_batch_norm_keeps_pytorchs_parts():
    # a float32 γ, β and statistics on a bfloat16 input: the parts (the rule follows one dtype)
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            return self.bn(x.to(torch.bfloat16))

    ops = _targets(trace(Mixed(), (torch.randn(2, 3, 4, 4),), loss="sum"))
    assert BN not in ops and "aten.var_mean.correction" in ops


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_batch_norm_jvp_and_vjp_against_torch_func(dtype):
    """The kept-whole rule's JVP and transpose in 16 bits against ``torch.func`` on the same
    model: the float64 model's JVP and gradients are the reference; graphflop's 16-bit graphs
    must be about as close to it as ``torch.func``'s own 16-bit run (at most 4× its error, with
    a floor of 16-bit rounding, 2⁻⁸ for bfloat16), and the dot-product test holds to that
    rounding."""
    from graphflop.ad.jvp import build_jvp
    from graphflop.ad.vjp import build_vjp
    from graphflop.meta import JVP, SIGNATURE, VJP
    from graphflop.runtime.verify import run_backward, run_forward, run_jvp
    from graphflop.testing.opdb.core import Readout, randomized

    torch.manual_seed(0)
    model = Readout(randomized(nn.BatchNorm2d(4)), (6, 4, 5, 5)).double()
    x64 = 3 * torch.randn(6, 4, 5, 5, dtype=torch.float64) + 1  # rstd ≈ 1/3, not 1
    low = copy.deepcopy(model).to(dtype)
    fwd = trace(low, (x64.to(dtype),), loss="sum")
    assert _targets(fwd).count(BN) == 1
    sig = fwd.meta[SIGNATURE]
    by_q = dict(low.named_parameters()) | dict(low.named_buffers())
    values = {n: by_q[q].detach().clone() for n, q in [*sig.params, *sig.buffers]}
    values[sig.inputs[0]] = x64.to(dtype)
    gen = torch.Generator().manual_seed(1)
    leaves = [n for n, _ in sig.params] + [sig.inputs[0]]
    tangents = {n: torch.randn(values[n].shape, generator=gen).to(dtype) for n in leaves}

    def reference(m, dt):
        buffers = {q: b.detach().to(dt) for q, b in m.named_buffers()}

        def f(params, xs):
            state = {**params, **{q: b.clone() for q, b in buffers.items()}}
            return torch.func.functional_call(m, state, xs).sum()

        params = {q: values[n].to(dt) for n, q in sig.params}
        p_dot = {q: tangents[n].to(dt) for n, q in sig.params}
        xs, x_dot = (values[sig.inputs[0]].to(dt),), (tangents[sig.inputs[0]].to(dt),)
        _, jv = torch.func.jvp(f, (params, xs), (p_dot, x_dot))
        grads_p, grads_x = torch.func.grad(f, argnums=(0, 1))(params, xs)
        grads = {n: grads_p[q] for n, q in sig.params} | {sig.inputs[0]: grads_x[0]}
        return jv, grads

    exact_jv, exact = reference(model, torch.float64)
    low_jv, low_grads = reference(low, dtype)
    floor = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11

    jvp = build_jvp(fwd, "all")
    info = jvp.meta[JVP]
    assert {p for _, p in info.tangent_inputs} == set(leaves)
    outs = run_jvp(jvp, values, tangents)
    jv = outs[info.primal_outputs]
    assert jv.dtype == dtype
    assert _error(jv, exact_jv) <= max(4 * _error(low_jv, exact_jv), floor), (jv, exact_jv)

    bwd = build_vjp(fwd, input_grads=True)
    vinfo = bwd.meta[VJP]
    got_all = run_backward(bwd, run_forward(fwd, values))
    name_of = {q: n for n, q in sig.params}
    got = {name_of[q]: got_all[pos] for pos, q in vinfo.grads}
    got |= {n: got_all[pos] for pos, n in vinfo.input_grads}
    assert sorted(got) == sorted(exact)
    for n, g in got.items():
        assert g.dtype == dtype and g.shape == exact[n].shape, n
        bound = max(4 * _error(low_grads[n], exact[n]), floor)
        assert _error(g, exact[n]) <= bound, (n, _error(g, exact[n]), bound)
    # <J·v, 1> = <v, Jᵀ·1> (sums in float64 over the 16-bit results): as close as torch.func's
    # own 16-bit JVP and gradients come to it (at most 4× their gap, with the rounding floor)

    def gap(jv: torch.Tensor, grads: dict[str, torch.Tensor]) -> float:
        rhs = sum(float((tangents[n].double() * g.double()).sum()) for n, g in grads.items())
        return abs(float(jv) - rhs) / abs(float(exact_jv))

    assert gap(jv, got) <= max(4 * gap(low_jv, low_grads), floor), (
        gap(jv, got),
        gap(low_jv, low_grads),
    )


class _BNHead(nn.Module):
    """A tester's model: batch norm, a spatial mean, a linear head (cross-entropy loss)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.bn(x).mean((2, 3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_forward_peak_holds_input_and_output(dtype, training):
    """A tester's finding: in training mode the forward peak (525,944 B in float32) was lower
    than x and the batch norm's output, which coexist while its kernel runs. The kept-whole
    node's input was freed at the node, before its outputs (its ``getitem`` steps) were
    allocated; it now lives until they are. Checked against eager PyTorch's forward measured
    with the profiler's allocator events."""
    from graphflop import analyze
    from graphflop.runtime.memory_probe import measure_forward_peak

    torch.manual_seed(0)
    model = _BNHead().to(dtype).train(training)
    x = torch.randn(8, 16, 32, 32).to(dtype)
    mem = analyze(model, (x,), jvp=False).report.memory
    size = x.element_size()
    act = 8 * 16 * 32 * 32 * size  # x, and the batch norm's output
    state = (16 * 2 + 16 * 10 + 10) * size + 16 * 2 * size + 8  # params; buffers + num_batches
    target = 8 * 8  # int64 class targets
    # training: + num_batches_tracked + 1 (8 B) and the two new running statistics (16
    # channels, float32 as the traced op makes them, 64 B each); eval: nothing per channel
    per_channel = 8 + 2 * 64 if training else 0
    assert mem.forward_peak_bytes == state + 2 * act + target + per_channel
    measured = measure_forward_peak(model, (x,))
    # eager holds the same x and output; it differs by per-channel and scalar temporaries
    # (under 1 KB), and in bfloat16 by the float32 copy of the output its CPU mean kernel
    # makes (an eager kernel temporary the graph model does not count: 4 bytes an element)
    upcast = 8 * 16 * 32 * 32 * 4 if dtype == torch.bfloat16 else 0
    assert abs(mem.forward_peak_bytes + upcast - measured) < 1024, (
        mem.forward_peak_bytes,
        measured,
    )
