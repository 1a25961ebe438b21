"""In-place writes that a decomposition leaves in the traced graph (below functionalization).

Tester's finding: ``nn.Conv2d(..., padding_mode="circular")`` pads with ``aten._pad_circular``,
whose kernel copies slices of its input, then of its own output, into a new (``empty``) tensor
with ``copy_``; ``torch.func.functionalize`` under ``make_fx`` leaves those writes in the graph.
Nothing read the ``copy_`` nodes (the convolution reads the ``empty``), so the derivative
never passed through them: the convolution's input had no tangent, c1's weight gradient and
c2's input gradient were 0, and backward and JVP still said complete.

* ``ops/recurrent.py`` ``functionalize_inplace`` now rewrites a write into slices (and selects)
  of a tensor the graph made into the functional op and a ``slice_scatter`` of its
  result into that tensor, as functionalization does (any op, circular padding is one case);
* ``ad/jvp.py`` treats an in-place write left in the graph that a needed node reads through
  another alias (``ops/recurrent.py`` ``hidden_writes``) as a cut: a gap, so the phase is
  incomplete (or, strict, an error), never a silent zero.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import graphflop
from graphflop.analysis import AnalyzeOptions
from graphflop.meta import GAPS, OUTLINED
from graphflop.ops import MissingRuleError, registry, strict_rules
from graphflop.runtime.memory_probe import SavedBytes
from graphflop.runtime.verify import verify_analysis

sys.path.insert(0, str(Path(__file__).parent))
from test_hierarchy import _flat_report  # noqa: E402

aten = torch.ops.aten


class Circular(nn.Module):
    """Two circularly padded 3×3 convolutions and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, padding_mode="circular")
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular")
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


def _blocks() -> nn.Module:
    """Four blocks, the last one's convolution circularly padded (the tester's second model)."""
    m = nn.Sequential(*[Block() for _ in range(4)])
    m[1].conv.stride = (2, 2)
    m[2].conv.dilation = (2, 2)
    m[2].conv.padding = (2, 2)
    m[3].conv.padding_mode = "circular"
    return nn.Sequential(m, Mean(), nn.Linear(8, 4))


class Mean(nn.Module):
    def forward(self, x):
        return x.mean((2, 3))


def _eager_mm_flops(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """FlopCounterMode's forward and backward FLOPs (matrix-class ops only) of ``model(x).sum()``."""
    with FlopCounterMode(display=False) as fwd:
        loss = model(x).sum()
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def _eager_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """The bytes of the distinct storages eager autograd saves for ``model(x).sum()``,
    parameters and buffers excluded."""
    with SavedBytes(model) as saved:
        model(x).sum()
    return saved.nbytes


def _verified(model: nn.Module, x: torch.Tensor, a) -> None:
    """verify's gradient (vs torch.func.grad), JVP (vs torch.func.jvp) and forward-gradient
    checks all pass, in float64."""
    checks = verify_analysis(types.SimpleNamespace(model=model), (x,), a)
    assert checks and all(c.ok for c in checks), [(c.name, c.worst_rel_error) for c in checks]


def test_circular_conv_backward_and_jvp_are_exact():
    torch.manual_seed(0)
    model = Circular()
    x = torch.randn(2, 3, 8, 8)
    a = graphflop.analyze(model, (x,), AnalyzeOptions(loss="sum"))
    t = a.report.totals
    # per output element of an 8×8 map, batch 2: c1 2·(2·8·64)·(3·9) = 55,296;
    # c2 2·(2·8·64)·(8·9) = 147,456; head 2·2·8·4 = 128
    assert t.forward.mm_flops == 55_296 + 147_456 + 128 == 202_880
    # c1's weight gradient (its input needs none) 55,296; c2's input and weight gradients
    # 2·147,456; head's input and weight gradients 2·128
    assert t.backward.mm_flops == 55_296 + 2 * 147_456 + 2 * 128 == 350_464
    # weight perturbation: c1 and c2 each one product with the parameter tangent, c2 one
    # with its input's tangent, head two: the same products as the backward
    assert t.jvp is not None and t.jvp.mm_flops == 350_464
    assert (t.forward.mm_flops, t.backward.mm_flops) == _eager_mm_flops(model, x)
    assert t.backward.complete and t.jvp.complete and t.forward.complete
    assert a.report.uncounted == ()
    targets = {n.target for n in a.forward.graph.nodes}
    assert aten.copy_.default not in targets and aten.slice_scatter.default in targets
    # eager autograd saves each convolution's padded input (2·3·10·10·4 = 2,400 and
    # 2·8·10·10·4 = 6,400 bytes), both ReLU outputs (2·8·8·8·4 = 4,096 each) and the head's
    # input (2·8·4 = 64): 17,056 bytes, as saved_tensors_hooks measures
    assert a.report.memory.saved_for_backward_bytes == 17_056 == _eager_saved_bytes(model, x)
    _verified(model.double(), x.double(), graphflop.analyze(model, (x.double(),)))


def test_circular_conv_in_blocks_exact_and_flat_equals_hierarchical():
    torch.manual_seed(0)
    model = _blocks()
    x = torch.randn(2, 8, 16, 16)
    a = graphflop.analyze(model, (x,), AnalyzeOptions(loss="sum"))
    t = a.report.totals
    # block 0: 16×16 out, 2·(2·8·256)·(8·9) = 589,824; blocks 1-3: 8×8 out, 147,456 each;
    # head 128
    assert t.forward.mm_flops == 589_824 + 3 * 147_456 + 128 == 1_032_320
    # block 0's weight gradient; blocks 1-3 input and weight gradients; head's two
    assert t.backward.mm_flops == 589_824 + 6 * 147_456 + 256 == 1_474_816
    assert t.jvp is not None and t.jvp.mm_flops == 1_474_816
    assert (t.forward.mm_flops, t.backward.mm_flops) == _eager_mm_flops(model, x)
    assert t.backward.complete and t.jvp.complete
    assert a.report.to_dict() == _flat_report(a).to_dict()
    _verified(model.double(), x.double(), graphflop.analyze(model, (x.double(),)))


class Repeated(nn.Module):
    """A circularly padded 3×3 convolution and a 1×1 one, the block repeated four times."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular")
        self.proj = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return self.proj(torch.relu(self.conv(x)))


def test_circular_conv_in_an_outlined_block():
    """The block is outlined (its writes into its own temporary are made functional in its
    template too), and the hierarchical report is the flat one."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 1), nn.Sequential(*[Repeated() for _ in range(4)]), Mean(), nn.Linear(8, 4)
    )
    x = torch.randn(2, 3, 8, 8)
    a = graphflop.analyze(model, (x,), AnalyzeOptions(loss="sum"))
    assert a.forward.meta[OUTLINED].calls == 4
    t = a.report.totals
    # stem 2·(2·8·64)·3 = 6,144; per block 3×3 2·(2·8·64)·72 = 147,456 + 1×1 2·(2·8·64)·8 =
    # 16,384; head 128
    assert t.forward.mm_flops == 6_144 + 4 * (147_456 + 16_384) + 128 == 661_632
    # the stem's weight gradient; every block's input and weight gradients; the head's two
    assert t.backward.mm_flops == 6_144 + 2 * 4 * (147_456 + 16_384) + 256 == 1_317_120
    assert t.jvp is not None and t.jvp.mm_flops == 1_317_120
    assert (t.forward.mm_flops, t.backward.mm_flops) == _eager_mm_flops(model, x)
    assert t.backward.complete and t.jvp.complete
    assert a.report.to_dict() == _flat_report(a).to_dict()
    _verified(model.double(), x.double(), graphflop.analyze(model, (x.double(),)))


def test_circular_pad_of_a_value_without_derivative():
    """Padding a tensor no gradient flows through (the input): complete, exact as before."""
    torch.manual_seed(0)
    model = nn.Sequential(Pad(), nn.Conv2d(3, 8, 3), Mean(), nn.Linear(8, 4))
    x = torch.randn(2, 3, 8, 8)
    a = graphflop.analyze(model, (x,), AnalyzeOptions(loss="sum"))
    t = a.report.totals
    # conv 2·(2·8·64)·27 = 55,296 + head 128; backward: conv weight gradient + head's two
    assert (t.forward.mm_flops, t.backward.mm_flops) == (55_424, 55_296 + 256)
    assert (t.forward.mm_flops, t.backward.mm_flops) == _eager_mm_flops(model, x)
    assert t.backward.complete and t.jvp is not None and t.jvp.complete
    _verified(model.double(), x.double(), graphflop.analyze(model, (x.double(),)))


class Pad(nn.Module):
    def forward(self, x):
        return F.pad(x, (1, 1, 1, 1), mode="circular")


def _write_copy(x, pad, value=0.0):
    """``constant_pad_nd`` decomposed with a write the trace cannot make functional: the
    padded tensor's middle is written with ``copy_`` (no rule), and a view of it taken before
    the write is read after it."""
    out = x.new_zeros((*x.shape[:-1], x.shape[-1] + pad[0] + pad[1]))
    middle, right = out[..., pad[0] : pad[0] + x.shape[-1]], out[..., 2:]
    middle.copy_(x)
    return out + right.sum(-1, keepdim=True)


def _write_mul(x, pad, value=0.0):
    """As :func:`_write_copy`, with ``mul_`` (whose functional twin has a rule) on a slice of
    a functional padding."""
    out = torch.cat([x[..., -pad[0] :], x, x[..., : pad[1]]], -1)
    middle, right = out[..., 1:3], out[..., 2:4]
    middle.mul_(2)
    return out + right.sum(-1, keepdim=True)


class ConstantPad(nn.Module):
    def forward(self, x):
        return F.pad(x, (1, 1))


@pytest.mark.parametrize(
    ("write", "op"), [(_write_copy, aten.copy_.default), (_write_mul, aten.mul_.Tensor)]
)
def test_in_place_write_the_trace_keeps_cuts_visibly(monkeypatch, write, op):
    """An in-place write left in the graph, read afterwards through another view: the
    derivative through it is not followed, and backward and JVP say so (a gap at the write;
    strict, an error) instead of counting as complete."""
    monkeypatch.setitem(registry._DECOMPOSITIONS, aten.constant_pad_nd.default, write)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), ConstantPad(), nn.Linear(8, 3))
    x = torch.randn(2, 4)
    a = graphflop.analyze(model, (x,), AnalyzeOptions(loss="sum"))
    (write_node,) = [n for n in a.forward.graph.nodes if n.target is op]  # kept in place
    t = a.report.totals
    assert not t.backward.complete and t.jvp is not None and not t.jvp.complete
    for g in (a.backward, a.jvp):
        assert [(gap.op, gap.node) for gap in g.meta[GAPS]] == [(str(op), write_node.name)]
    with strict_rules(), pytest.raises(MissingRuleError, match=re.escape(str(op))):
        graphflop.analyze(model, (x,), AnalyzeOptions(loss="sum"))


class _DataWrite(nn.Module):
    """``where``: a write through ``.data`` into the tanh's output (which tanh's backward
    saved), or into a parameter before any op read it (weight clipping)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.l, self.head = nn.Linear(8, 8), nn.Linear(8, 4)
        self.where = where

    def forward(self, x):
        if self.where == "parameter":
            self.l.weight.data.clamp_(-0.2, 0.2)
        y = torch.tanh(self.l(x))
        if self.where == "saved":
            y.data.mul_(2)
        return self.head(y * x)


def test_a_data_write_over_a_saved_value_is_refused():
    """A tester's finding: ``y = tanh(l(x)); y.data.mul_(2)`` gave a wrong gradient silently
    (eager's tanh backward reads the doubled y through the saved output; graphflop's graph
    differentiated the product by 2 instead). Now refused in one line, with advice."""
    with pytest.raises(graphflop.TraceError, match=r"through \.data into the value of tanh"):
        graphflop.analyze(_DataWrite("saved"), (torch.randn(4, 8),))


def test_a_data_write_into_a_parameter_as_eager_autograd():
    """``w.data.clamp_(-0.2, 0.2)`` before any op reads w: eager autograd sees neither the
    write nor a version change, so w's gradient is that of the clamped values read, with no
    clamp derivative (was: the clamp's mask applied). Gradients and the JVP against eager
    autograd in float64."""
    from test_no_grad import _against_eager_autograd

    torch.manual_seed(0)
    model, x = _DataWrite("parameter").double(), torch.randn(4, 8, dtype=torch.float64)
    _against_eager_autograd(graphflop.analyze(model, x), model, x)


def test_circular_pad_as_the_model_output_names_its_last_write():
    """With a circular pad the model's last op, the forward's ``SIGNATURE.outputs`` named the
    ``empty`` the decomposition writes into (the output node was rewritten to the last
    ``slice_scatter`` after the signature was taken): ``run_forward``'s model output, the
    exported forward.onnx's and the JVP's differentiated output read uninitialised memory.
    The signature now names what the output node holds, and its value is eager's."""
    from graphflop.meta import SIGNATURE
    from graphflop.runtime.verify import real_arguments, run_forward

    class Pad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return F.pad(self.fc(x).view(1, 1, 3, 4), (2, 1, 1, 2), mode="circular")

    torch.manual_seed(0)
    m, x = Pad(), torch.randn(3, 4)
    a = graphflop.analyze(m, x, loss="sum", outline=False, jvp=False)
    sig = a.forward.meta[SIGNATURE]
    out_node = next(n for n in a.forward.graph.nodes if n.op == "output")
    assert sig.outputs == (out_node.args[0][1].name,) and sig.loss == out_node.args[0][0].name
    (node,) = [n for n in a.forward.graph.nodes if n.name == sig.outputs[0]]
    assert node.target is torch.ops.aten.slice_scatter.default
    values = real_arguments(a.forward, m)
    values[sig.inputs[0]] = x
    assert torch.equal(run_forward(a.forward, values)[sig.outputs[0]], m(x).detach())


class _EagerAdds(TorchDispatchMode):
    """The output elements of the ``add`` kernels eager PyTorch runs (1 FLOP each)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (aten.add.Tensor, aten.add_.Tensor):
            self.elements += out.numel()
        return out


def test_circular_pad_backward_counts_eager_autograds_adds():
    """A helper's finding said circular padding's backward (276 FLOPs here) overcounts: its
    four full-size adds, where eager would sum only the wrapped borders. Eager autograd runs
    exactly those adds (measured): each wrapped border is ``out[..., o] = out[..., i]``, a
    ``CopySlices`` whose base gradient (the cotangent, border zeroed) and the border source's
    ``slice_backward`` (zeros, the border's cotangent at ``i``) autograd's input buffer sums
    into one full-size gradient of ``out``. graphflop's transpose of ``slice_scatter`` builds
    the same two and the same add, so the count stands."""
    from test_no_grad import _against_eager_autograd

    from graphflop.meta import VJP

    class PadNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return F.pad(self.fc(x).view(1, 1, 3, 4), (2, 1, 1, 2), mode="circular")

    torch.manual_seed(0)
    model, x = PadNet().double(), torch.randn(3, 4, dtype=torch.float64)
    a = graphflop.analyze(model, x, loss="sum", outline=False)
    b = a.report.totals.backward
    # the padded map is (3+1+2)×(4+2+1) = 6×7 = 42 elements; every pad > 0, so four wrapped
    # borders (top, bottom, left, right), each one add of 42: 4·42 = 168
    assert b.grad_accum_flops == 4 * 42 == 168
    # fc's weight gradient 2·4·3·4 = 96 (a product), its bias gradient a sum of 3 rows of 4: 12
    assert b.grad_weight_flops == 96 + 12 and b.mm_flops == 96
    assert b.flops == 168 + 96 + 12 == 276 and b.complete
    assert a.backward.meta[VJP].grads  # fc's two parameters have gradients
    loss = model(x).sum()
    with _EagerAdds() as eager:
        loss.backward()
    assert eager.elements == 168  # eager's backward: the same four adds of 42
    _against_eager_autograd(a, model, x)  # gradients and the loss tangent, float64
