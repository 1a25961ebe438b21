"""A composite op eager PyTorch runs as one kernel (layer norm, softmax, GELU, ...) moves that
kernel's bytes: its inputs from outside read once, its outputs written once, in their dtypes,
its decomposition's temporaries not counted (graphflop.passes.flops, one_kernel_costs). A
tester's finding: in bfloat16 the upcasting decompositions (float32 inside, as eager's kernels
compute) counted their float32 copies and temporaries, so a small model's forward read 5.67 MB
in bfloat16 against 4.76 MB in float32. The graph and its FLOPs are unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphflop import analyze
from graphflop.frontend.trace import trace
from graphflop.meta import COMPOSITE, COST, HIERARCHY
from graphflop.ops.cost import op_cost
from graphflop.passes.flops import annotate_flops, flat_costs
from graphflop.passes.summary import Graphs, summarize

B, T, D = 4, 8, 16
N = B * T * D  # elements of the activation


def _op_bytes(module: nn.Module, dtype: torch.dtype, op: str) -> tuple[int, int, int, int]:
    """(bytes read, bytes written, FLOPs, the parts' rules' FLOPs) of composite op ``op``'s
    parts in the forward of ``module`` on a [B, T, D] input of ``dtype`` (sum loss)."""
    torch.manual_seed(0)
    gm = annotate_flops(trace(module.to(dtype), (torch.randn(B, T, D).to(dtype),), loss="sum"))
    parts = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.meta.get(COMPOSITE), "op", None) == op
    ]
    assert len(parts) > 1, [str(n.target) for n in gm.graph.nodes]
    rules = sum(op_cost(n.target, n.args, n.kwargs, n).flops for n in parts)
    c = [n.meta[COST] for n in parts]
    return (
        sum(x.bytes_read for x in c),
        sum(x.bytes_written for x in c),
        sum(x.flops for x in c),
        rules,
    )


LN = "aten.native_layer_norm.default"
SOFTMAX = "aten._softmax.default"
LOG_SOFTMAX = "aten._log_softmax.default"
GELU = "aten.gelu.default"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_is_one_kernel(dtype):
    # LayerNorm(D) over [B, T, D], s = the dtype's element size:
    # read  x B·T·D·s + γ and β D·s each
    # written: out B·T·D·s; in float32 also μ and rstd, B·T·4 each: outputs 1 and 2 of the
    # decomposition (eager's CPU kernel writes and autograd saves them). In bfloat16 the
    # upcasting decomposition computes μ and rstd in float32 and casts them back to bfloat16
    # as outputs 1 and 2, casts nothing reads in the forward, removed from the graph: not
    # counted (eager's CPU kernel writes them in bfloat16, 2·B·T·2 bytes)
    # (the decomposition counted its parts: 5·B·T·D·4 + … read in float32, its upcast of x and
    # float32 temporaries in bfloat16)
    s = torch.empty((), dtype=dtype).element_size()
    read, written, flops, rules = _op_bytes(nn.LayerNorm(D), dtype, LN)
    assert read == N * s + 2 * D * s
    stats = 2 * B * T * 4 if dtype == torch.float32 else 0
    assert written == N * s + stats
    assert flops == rules


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op,module", [(SOFTMAX, nn.Softmax(-1)), (LOG_SOFTMAX, nn.LogSoftmax(-1))])
def test_softmax_is_one_kernel(dtype, op, module):
    # read x B·T·D·s, written the output B·T·D·s: the row maxima, the exponentials and their
    # sums (and in bfloat16 the float32 upcast) stay in the kernel
    s = torch.empty((), dtype=dtype).element_size()
    read, written, flops, rules = _op_bytes(module, dtype, op)
    assert (read, written) == (N * s, N * s)
    assert flops == rules


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_one_kernel(dtype, approximate):
    # read x B·T·D·s, written the output B·T·D·s (x/2, x/√2 and erf's or tanh's terms stay in
    # the kernel)
    s = torch.empty((), dtype=dtype).element_size()
    read, written, flops, rules = _op_bytes(nn.GELU(approximate), dtype, GELU)
    assert (read, written) == (N * s, N * s)
    assert flops == rules


class _LnGeluSoftmax(nn.Module):
    """A tester's model: layer norm, GELU, softmax, a linear layer."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(64)
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(torch.nn.functional.gelu(self.ln(x)).softmax(-1))


def _tester(dtype: torch.dtype):
    torch.manual_seed(0)
    model = _LnGeluSoftmax().to(dtype)
    x = torch.randn(8, 128, 64).to(dtype)
    return model, x, analyze(model, (x,), jvp=False)


def test_tester_model_forward_bytes():
    # x 8·128·64 = 65,536 elements, X = 262,144 B in float32; 1,024 rows; γ, β and the linear's
    # bias 64 elements (256 B in float32), its weight 64·64 (16,384 B).
    # read:    layer norm X + 512, GELU X, softmax X, addmm X + 256 + 16,384, the sum loss X
    #          = 5X + 17,152 = 1,327,872 (its parts' rules: 4,760,320)
    # written: layer norm X + μ and rstd 2·4,096, GELU X, softmax X, addmm X, the loss 4 B
    #          = 4X + 8,196 = 1,056,772 (its parts' rules: 3,432,452)
    # bfloat16: every tensor half as large, the loss a 2 B scalar, no μ and rstd (outputs the
    # graph does not have: test_layer_norm_is_one_kernel): read 5·X/2 + 8,576 = 663,936, written
    # 4·X/2 + 2 = 524,290 (its parts' rules, float32 upcasts and temporaries: 5,669,248 and
    # 4,481,026)
    X = 8 * 128 * 64 * 4
    _, _, f32 = _tester(torch.float32)
    _, _, bf16 = _tester(torch.bfloat16)
    a, b = f32.report.totals.forward, bf16.report.totals.forward
    assert (a.bytes_read, a.bytes_written) == (5 * X + 17_152, 4 * X + 8_196)
    assert (b.bytes_read, b.bytes_written) == (5 * X // 2 + 8_576, 4 * X // 2 + 2)
    assert (b.bytes_read, b.bytes_written) == (663_936, 524_290)
    # FLOPs are the parts' (erf and exp per element, rsqrt per row among the transcendentals)
    assert b.flops == a.flops == 9_572_352
    assert b.transcendentals == a.transcendentals == 2 * 65_536 + 1_024
    # the per-op rows sum to the totals
    rows = [r for r in bf16.report.ops if r.phase == "forward"]
    assert sum(r.bytes_read for r in rows) == b.bytes_read
    assert sum(r.bytes_written for r in rows) == b.bytes_written


def test_tester_model_graph_and_numerics_unchanged():
    """Only the byte counts change: the bfloat16 graph keeps its float32 upcasts (eager's
    kernels compute in float32 inside), and running it gives eager's output."""
    from graphflop.meta import SIGNATURE
    from graphflop.runtime.verify import run_forward

    model, x, a = _tester(torch.bfloat16)
    fwd = a.forward
    targets = [str(n.target) for n in fwd.graph.nodes if n.op == "call_function"]
    # x's upcast and the output's cast back, for each of layer norm, GELU and softmax
    assert targets.count("aten._to_copy.default") == 6
    sig = fwd.meta[SIGNATURE]
    by_q = dict(model.named_parameters())
    values = {n: by_q[q].detach() for n, q in sig.params}
    values[sig.inputs[0]] = x
    got = run_forward(fwd, values)[sig.loss]
    with torch.no_grad():
        want = model(x).sum()
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want), (got, want)


def test_templates_give_each_copy_its_one_kernel_bytes():
    """Blocks outlined as a template: every copy's parts carry the costs they have costed on
    their own (flat_costs), and the hierarchical report is the flat one, in bfloat16."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(D)
            self.fc = nn.Linear(D, D)

        def forward(self, x):
            return x + self.fc(torch.nn.functional.gelu(self.ln(x))).softmax(-1)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    a = analyze(Stack().to(torch.bfloat16), (torch.randn(B, T, D).bfloat16(),))
    h = a.forward.meta.get(HIERARCHY)
    assert h is not None and len(h.sites) == 3
    alone = flat_costs(a.forward.graph.nodes)
    parts = 0
    for n in a.forward.graph.nodes:
        if n.op == "call_function":
            assert n.meta[COST] == alone[n], n.name
            parts += COMPOSITE in n.meta
    assert parts > 0
    g = Graphs(a.forward, a.backward, a.update, a.jvp, a.forward_gradient, a.activity_gradient)
    r = a.report
    flat = summarize(
        g,
        name=r.model,
        optimizer=r.optimizer or "sgd",
        tangents=r.totals.jvp.tangents,
        memory_model=r.memory.memory_model,
        device=r.memory.device,
        keep_grads=r.memory.keep_grads,
        hierarchical=False,
    )
    assert r.to_dict() == flat.to_dict()
    # three blocks, each: layer norm read N·2 + 2·D·2, written N·2; GELU and softmax N·2 each
    # way; the residual add N·2·2 read, N·2 written (the linear and the loss apart)
    fwd = r.totals.forward
    ln_gelu_softmax = sum(
        n.meta[COST].bytes_read
        for n in a.forward.graph.nodes
        if getattr(n.meta.get(COMPOSITE), "op", None) in (LN, GELU, SOFTMAX)
    )
    assert ln_gelu_softmax == 3 * (N * 2 + 2 * D * 2 + N * 2 + N * 2)
    assert fwd.bytes_read > ln_gelu_softmax
