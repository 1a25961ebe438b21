"""Layer norm, softmax, log-softmax and GELU in bfloat16 and float16 traced as graphflop's lean
decompositions in the 16-bit dtype, as eager's one kernel reads and writes 16-bit tensors (a
tester's finding: PyTorch's decompositions upcast to float32, so a bfloat16 model's forward bytes
were 1.2× float32's where half is right): the same FLOPs as in float32, bytes at the tensors'
dtype, what autograd saves as eager saves it, the 16-bit JVP and transpose matching
``torch.func``; mixed dtypes (a float32 γ on a bfloat16 input) keep PyTorch's decomposition."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from graphflop.frontend.trace import trace


class _LnGeluSoftmax(nn.Module):
    """A tester's model: layer norm, GELU, softmax, a linear layer."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(64)
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        h = self.ln(x)
        return self.fc(torch.nn.functional.gelu(h).softmax(-1))


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _analyze(dtype: torch.dtype):
    from graphflop import analyze

    torch.manual_seed(0)
    model = _LnGeluSoftmax().to(dtype)
    return analyze(model, (torch.randn(8, 128, 64).to(dtype),), jvp=False)


def test_tester_model_forward_bytes_in_bfloat16_are_half_of_float32s():
    # x: 8·128·64 = 65,536 elements, X = 262,144 B in float32; 1,024 rows (a per-row statistic
    # 4,096 B); γ, β, the linear's bias 64 elements (256 B), its weight 64·64 (16,384 B).
    # read:  layer norm  var_mean X, + eps 4,096, rsqrt 4,096, x − μ X + 4,096, · rstd X + 4,096,
    #                    · γ X + 256, + β X + 256                        = 5X + 16,896
    #        GELU        x·½ X, x·√½ X, erf X, + 1 X, ½x·(…) 2X          = 6X
    #        softmax     amax X, − max X + 4,096, exp X, Σ X, ÷ X + 4,096 = 5X + 8,192
    #        addmm       X + 256 + 16,384; the sum loss X                 = 2X + 16,640
    #        total 18X + 41,728 = 4,760,320
    # written: layer norm var and μ 8,192, + eps 4,096, rsqrt 4,096, four of X;
    #          GELU five of X; softmax amax 4,096, three of X, Σ 4,096; addmm X; the loss 4 B
    #          total 13X + 24,580 = 3,432,452
    # bfloat16: every tensor half as large, the loss a 2 B scalar: 18·X/2 + 20,864 = 2,380,160
    # read, 13·X/2 + 12,290 = 1,716,226 written (PyTorch's decompositions, float32 upcasts and
    # temporaries included: 5,669,248 and 4,481,026)
    X = 8 * 128 * 64 * 4
    f32, bf16 = _analyze(torch.float32), _analyze(torch.bfloat16)
    a, b = f32.report.totals.forward, bf16.report.totals.forward
    assert (a.bytes_read, a.bytes_written) == (18 * X + 41_728, 13 * X + 24_580)
    assert (b.bytes_read, b.bytes_written) == (18 * X // 2 + 20_864, 13 * X // 2 + 12_290)
    assert (b.bytes_read, b.bytes_written) == (2_380_160, 1_716_226)
    # the same FLOPs (and transcendentals: erf, exp per element, rsqrt per row)
    assert b.flops == a.flops and b.transcendentals == a.transcendentals == 2 * 65_536 + 1_024
    assert "aten._to_copy.default" not in _targets(bf16.forward)
    assert _targets(bf16.forward) == _targets(f32.forward)


def _eager_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages eager autograd saves, parameters left out."""
    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tester_model_saves_what_eager_saves(dtype):
    # eager saves x, layer norm's μ and rstd (per row, in x's dtype on CPU with γ and β of that
    # dtype), GELU's input (the layer norm's output), softmax's output (also the linear's
    # input): 3 activations of 65,536 elements and 2 of 1,024. PyTorch's bfloat16
    # decomposition's μ and rstd were not counted (393,216 B).
    size = torch.empty((), dtype=dtype).element_size()
    want = (3 * 65_536 + 2 * 1_024) * size
    assert _analyze(dtype).report.memory.saved_for_backward_bytes == want
    torch.manual_seed(0)
    model = _LnGeluSoftmax().to(dtype)
    assert _eager_saved_bytes(model, torch.randn(8, 128, 64).to(dtype)) == want


def test_mixed_dtype_layer_norm_keeps_pytorchs_parts():
    # a float32 γ and β on a bfloat16 input: PyTorch's decomposition (its float32 statistics)
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)

        def forward(self, x):
            return self.ln(x.to(torch.bfloat16))

    gm = trace(Mixed(), (torch.randn(4, 16),), loss="sum")
    ops = _targets(gm)
    # x's own cast, then PyTorch's upcast of the bfloat16 input and the downcast of the output
    assert ops.count("aten._to_copy.default") == 3, ops
    var_mean = next(n for n in gm.graph.nodes if str(n.target) == "aten.var_mean.correction")
    assert [v.dtype for v in var_mean.meta["val"]] == [torch.float32] * 2
    ln = nn.LayerNorm(16).to(torch.bfloat16)
    plain = trace(ln, (torch.randn(4, 16).bfloat16(),), loss="sum")
    assert "aten._to_copy.default" not in _targets(plain)
    var_mean = next(n for n in plain.graph.nodes if str(n.target) == "aten.var_mean.correction")
    assert [v.dtype for v in var_mean.meta["val"]] == [torch.bfloat16] * 2


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


_MODULES = {
    "layer_norm": lambda: nn.LayerNorm(16),
    "softmax": lambda: nn.Softmax(-1),
    "log_softmax": lambda: nn.LogSoftmax(-1),
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU("tanh"),
}


@pytest.mark.parametrize("name", sorted(_MODULES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_jvp_and_vjp_against_torch_func(name, dtype):
    """The 16-bit parts' JVP and transpose against ``torch.func`` on the same model, as for
    batch norm (tests/test_batch_norm_whole.py): the float64 model's JVP and gradients are the
    reference; graphflop's 16-bit graphs must be about as close to it as ``torch.func``'s own
    16-bit run (at most 4× its error, with a floor of one unit in the last place of the dtype,
    2⁻⁷ for bfloat16 and 2⁻¹⁰ for float16: graphflop's graph rounds each part to 16 bits where
    eager's one kernel keeps them in float32, so a result may land one ulp off, e.g. a float16
    layer norm's JVP -34.5 where float64 gives -34.4686 and ``torch.func`` -34.4688), and the
    dot-product test holds to that rounding."""
    from graphflop.ad.jvp import build_jvp
    from graphflop.ad.vjp import build_vjp
    from graphflop.meta import JVP, SIGNATURE, VJP
    from graphflop.runtime.verify import run_backward, run_forward, run_jvp
    from graphflop.testing.opdb.core import Readout, randomized

    torch.manual_seed(0)
    shape = (6, 5, 16)
    model = Readout(randomized(_MODULES[name]()), shape).double()
    x64 = 3 * torch.randn(*shape, dtype=torch.float64) + 1
    low = copy.deepcopy(model).to(dtype)
    fwd = trace(low, (x64.to(dtype),), loss="sum")
    assert "aten._to_copy.default" not in _targets(fwd)
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
            return torch.func.functional_call(m, {**params, **buffers}, xs).sum()

        params = {q: values[n].to(dt) for n, q in sig.params}
        p_dot = {q: tangents[n].to(dt) for n, q in sig.params}
        xs, x_dot = (values[sig.inputs[0]].to(dt),), (tangents[sig.inputs[0]].to(dt),)
        _, jv = torch.func.jvp(f, (params, xs), (p_dot, x_dot))
        grads_p, grads_x = torch.func.grad(f, argnums=(0, 1))(params, xs)
        grads = {n: grads_p[q] for n, q in sig.params} | {sig.inputs[0]: grads_x[0]}
        return jv, grads

    exact_jv, exact = reference(model, torch.float64)
    low_jv, low_grads = reference(low, dtype)
    floor = torch.finfo(dtype).eps

    jvp = build_jvp(fwd, "all")
    info = jvp.meta[JVP]
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

    def gap(jv: torch.Tensor, grads: dict[str, torch.Tensor]) -> float:
        rhs = sum(float((tangents[n].double() * g.double()).sum()) for n, g in grads.items())
        return abs(float(jv) - rhs) / abs(float(exact_jv))

    assert gap(jv, got) <= max(4 * gap(low_jv, low_grads), floor), (
        gap(jv, got),
        gap(low_jv, low_grads),
    )
