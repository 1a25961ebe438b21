"""Masked writes whose value needs a gradient: ``h[:, m] = v`` and ``h[m] = v`` with a boolean
mask ``m`` (traced as ``index_put``) and ``h.masked_scatter_(m, v)``. The value's cotangent is
the output's cotangent at the set elements of ``m``, whose count depends on ``m``'s values:
PyTorch gathers it (``ct[:, m]``, a ``nonzero``), which fake tensors cannot size, and
``analyze`` died with a raw ``DynamicOutputShapeException``. graphflop's rules select and sum
(one value broadcast over the set elements) or scatter-add at each set element's rank (one value
per set element) instead (graphflop/ops/shape.py). Figures by hand and against
FlopCounterMode; gradients and JVPs against torch.func (verify); a mask beside another index
tensor is a transpose gap, not a crash."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import graphflop
from graphflop.ad.jvp import build_jvp
from graphflop.ad.vjp import build_vjp
from graphflop.analysis import AnalyzeOptions
from graphflop.cli import main
from graphflop.frontend.trace import trace
from graphflop.meta import SIGNATURE, VJP
from graphflop.passes.flops import annotate_flops, total_cost
from graphflop.runtime.verify import run_backward, run_forward, verify_analysis
from graphflop.testing.opdb.core import Fn

aten = torch.ops.aten
COLUMNS = [False, True, True, False, True, False]  # 3 of h's 6 columns


class Write(nn.Module):
    """``h = x @ w`` (x 3×4, w 4×6), a masked write into a copy of ``h``, ``h`` returned."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(4, 6))
        self.v = nn.Parameter(torch.randn(()))
        self.register_buffer("m", torch.tensor(COLUMNS))
        # rows 0 and 2 hold 3 and 2 set elements, row 1 none: 5 in all
        rows = [[True, False, True, False, False, True], [False] * 6, [True] * 2 + [False] * 4]
        self.register_buffer("m2", torch.tensor(rows))

    def forward(self, x):
        h = (x @ self.w).clone()
        if self.kind == "columns_from_h":  # the brief's form: the value read from h itself
            h[:, self.m] = 2 * h[:, :1]
        elif self.kind == "whole_mask_scalar":
            h[self.m2] = self.v * 3
        elif self.kind == "whole_mask_per_element":
            h[self.m2] = x[0, :1].repeat(5) * self.v  # one value per set element
        elif self.kind == "masked_scatter":
            h.masked_scatter_(self.m2, x.flip(0) * self.v)
        elif self.kind == "masked_scatter_broadcast_mask":
            h.masked_scatter_(self.m, (x @ self.w).flip(1).sin())
        return h


KINDS = [
    "columns_from_h",
    "whole_mask_scalar",
    "whole_mask_per_element",
    "masked_scatter",
    "masked_scatter_broadcast_mask",
]


def _analyze(model, x):
    return graphflop.analyze(model, (x,), AnalyzeOptions(loss="sum"))


@pytest.mark.parametrize("kind", KINDS)
def test_masked_write_analyzes_and_its_gradients_match_torch_func(kind):
    torch.manual_seed(0)
    model, x = Write(kind), torch.randn(3, 4)
    a = _analyze(model, x)
    t = a.report.totals
    assert t.backward.complete and t.jvp is not None and t.jvp.complete
    assert a.report.uncounted == ()
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    # FlopCounterMode counts the matrix products: x @ w (2·3·4·6 = 144, twice in the last
    # form) and w's gradient (one per product; x needs none)
    products = 2 if kind == "masked_scatter_broadcast_mask" else 1
    assert counter.get_total_flops() == 2 * 144 * products
    assert t.forward.mm_flops == 144 * products and t.backward.mm_flops == 144 * products
    model64, x64 = model.double(), x.double()
    checks = verify_analysis(types.SimpleNamespace(model=model64), (x64,), _analyze(model64, x64))
    assert len(checks) == 2 and all(c.ok for c in checks), [(c.name, c.where) for c in checks]


def test_the_briefs_write_figures_by_hand():
    a = _analyze(Write("columns_from_h"), torch.randn(3, 4))
    t = a.report.totals
    # forward: mm 144; 2·h[:, :1] 3; the write 0; the sum loss 18: 165
    assert (t.forward.flops, t.forward.mm_flops) == (165, 144)
    # backward: h's cotangent with the written columns zeroed (index_put of zeros, 0); the
    # value's: where(m, ct, 0) 18 and its sum over the columns 18; ·2 3; the slice's
    # cotangent added to h's 18; w's gradient 144: 201
    assert (t.backward.flops, t.backward.mm_flops) == (201, 144)


def _graphs(f, inputs):
    fwd = trace(Fn(lambda s, *xs: f(*xs)), inputs, loss="sum")
    return fwd, build_jvp(fwd, "all", wrt_outputs="outputs"), build_vjp(fwd, input_grads=True)


def _flops(f, inputs):
    """FLOPs of the (forward, JVP, backward) graphs of ``f`` traced with the sum loss."""
    return tuple(total_cost(annotate_flops(g).graph.nodes).flops for g in _graphs(f, inputs))


def _gradients(f, inputs):
    """graphflop's gradients of ``f``'s sum per input, its backward graph run."""
    fwd, _, bwd = _graphs(f, inputs)
    sig = fwd.meta[SIGNATURE]
    grads = run_backward(bwd, run_forward(fwd, dict(zip(sig.inputs, inputs))))
    by_name = {n: grads[pos] for pos, n in bwd.meta[VJP].input_grads}
    return tuple(by_name.get(n) for n in sig.inputs)


def _put(h, m, v):
    h = h * 1.0
    h[m] = v
    return h


def _scatter(h, m, v):
    return h.masked_scatter(m, v)


def test_per_element_and_masked_scatter_flops_by_hand():
    h, v = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    m = torch.tensor([[True, False, True, False], [False] * 4, [True, True, False, True]])
    # h[m] = v (5 set elements of 12): forward h·1 12, the write 0, the loss 12: 24
    # JVP: the primal 24; h's tangent ·1 12, the write of the tangents 0, the loss's 12: 48
    # backward: h's cotangent zeroed at the mask 0, ·1 12; v's: where(m, ct, 0) 12, the
    # ranks (cumsum, − 1, where) 3·12, the scatter-add 12: 72
    assert _flops(_put, (h, m, v)) == (24, 48, 72)
    # masked_scatter: forward the copy 0 + the loss 12; JVP 12 + 12; backward: h's
    # where(m, 0, ct) 12; v's 12 + 36 + 12 = 60: 72
    assert _flops(_scatter, (h, m, v)) == (12, 24, 72)


def test_nan_cotangent_outside_the_mask_gives_the_value_nothing():
    # the value's cotangent selects the set elements: a NaN cotangent elsewhere (hypot's at
    # (0, 0)) gives it nothing, as eager's gather does
    h = torch.tensor([[0.0, 3.0], [0.0, 1.0]], dtype=torch.float64)
    m = torch.tensor([[False, True], [False, True]])
    for write, v in ((_put, torch.tensor(2.0, dtype=torch.float64)), (_scatter, torch.ones(2))):
        v = v.double()

        def f(h, v, y, m, write=write):
            return torch.hypot(write(h, m, v), y)

        y = torch.zeros(2, 2, dtype=torch.float64)
        got = _gradients(f, (h, v, y, m))[:2]
        leaves = [h.clone().requires_grad_(), v.clone().requires_grad_()]
        ref = torch.autograd.grad(f(*leaves, y, m).sum(), leaves)
        assert ref[1].isfinite().all() and ref[0][:, 0].isnan().all()
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, equal_nan=True, rtol=1e-12, atol=0.0)


class MaskAndIndex(nn.Module):
    """``h[i, m] = v``: a boolean mask beside an integer index tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.v = nn.Parameter(torch.randn(()))
        self.register_buffer("m", torch.tensor(COLUMNS))
        self.register_buffer("i", torch.tensor([[0], [2]]))

    def forward(self, x):
        h = (x @ self.w).clone()
        h[self.i, self.m] = self.v
        return h


def test_mask_beside_an_index_tensor_is_a_visible_gap(tmp_path, capsys):
    a = _analyze(MaskAndIndex(), torch.randn(3, 4))
    # the value's cotangent is not built: the backward says incomplete and names index_put
    assert not a.report.totals.backward.complete
    assert any("index_put" in str(u) for u in a.report.uncounted)
    spec = tmp_path / "mask_and_index.py"
    spec.write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = nn.Parameter(torch.randn(4, 6))\n"
        "        self.v = nn.Parameter(torch.randn(()))\n"
        f"        self.register_buffer('m', torch.tensor({COLUMNS}))\n"
        "        self.register_buffer('i', torch.tensor([[0], [2]]))\n"
        "    def forward(self, x):\n"
        "        h = (x @ self.w).clone()\n"
        "        h[self.i, self.m] = self.v\n"
        "        return h\n"
        "def example_inputs():\n"
        "    return (torch.randn(3, 4),)\n"
    )
    # --strict: one line, exit 2, no traceback
    assert main(["inspect", f"{spec}:M", "--strict"]) == 2
    err = capsys.readouterr().err
    assert "no transpose rule for aten.index_put.default" in err and "Traceback" not in err
