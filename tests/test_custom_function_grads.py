"""Custom ``torch.autograd.Function`` s honoured: the backward graph is the class's own
``backward``, the JVP graph its own ``jvp``; a class without ``jvp`` leaves the JVP phase
incomplete, naming it (PyTorch's forward AD refuses it too). References: eager autograd
(``loss.backward()`` runs the Function's backward) and eager forward-mode AD (dual tensors run
its ``jvp``), on the real model in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwad
import torch.nn.functional as F
from torch import nn

from graphflop import analyze
from graphflop.frontend.trace import trace
from graphflop.meta import FUNCTION, VJP
from graphflop.runtime.verify import real_arguments, run_backward, run_forward, seeded
from graphflop.runtime.verify_tangent import run_jvp


class RoundSTE(torch.autograd.Function):
    """Straight-through round: forward round(x), backward the identity."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class GradReverse(torch.autograd.Function):
    """Gradient reversal with a scale kept on ctx: forward the identity (a view), backward
    -scale · g."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.scale * g, None


class CubeWithJvp(torch.autograd.Function):
    """x³ with its own backward (3 x² g, from x saved) and jvp (3 x² t, from x saved for
    forward): the derivative, written by hand."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x * x * t


class Net(nn.Module):
    def __init__(self, fn: str):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.fn = fn

    def forward(self, x):
        h = self.fc1(x)
        if self.fn == "ste":
            h = RoundSTE.apply(h * 4)
        elif self.fn == "grl":
            h = GradReverse.apply(h, 0.5)
        else:
            h = CubeWithJvp.apply(h)
        return self.fc2(h)


def _setup(fn: str):
    torch.manual_seed(0)
    model = Net(fn).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    target = torch.randint(0, 4, (4,))
    return model, x, target


def _graph_grads(model, x):
    """graphflop's backward graph run on real tensors: parameter name -> gradient, loss."""
    fwd = trace(model, (x,), loss="cross_entropy")
    a = analyze(model, (x,), loss="cross_entropy")
    values = real_arguments(fwd, model, examples=(x,))
    with seeded():
        fv = run_forward(fwd, values)
    from graphflop.ad.vjp import build_vjp

    bwd = build_vjp(fwd)
    grads = run_backward(bwd, fv)
    return {q: grads[pos] for pos, q in bwd.meta[VJP].grads}, fwd, values, a


def _eager_grads(model, x, target):
    model.zero_grad()
    F.cross_entropy(model(x), target).backward()
    return {q: p.grad.clone() for q, p in model.named_parameters()}


def test_straight_through_round_gradient_is_its_own_backward():
    """round's derivative is zero almost everywhere, so differentiating the forward's ops cut
    every gradient before it (fc1's: zero); the Function's backward passes g straight
    through. The backward's matrix FLOPs by hand (batch 4): fc2's input and weight gradients
    2*4*4*16 = 512 each, the identity 0, fc1's weight gradient 2*4*8*16 = 1,024 (its input
    gradient, 1,024, pruned): 2,048."""
    model, x, _ = _setup("ste")
    got, fwd, values, a = _graph_grads(model, x)
    ref = _reference(model, fwd, values)
    for q in ref:
        torch.testing.assert_close(got[q], ref[q], rtol=1e-12, atol=1e-12)
    assert float(got["fc1.weight"].abs().sum()) > 0  # not cut
    b = a.report.totals.backward
    assert b.complete
    assert b.mm_flops == 512 + 512 + 1024
    assert b.pruned_flops == 1024
    assert any(FUNCTION in n.meta for n in a.forward.graph.nodes)


def _reference(model, fwd, values):
    """Eager autograd on the graph's own arguments (its random targets included)."""
    from graphflop.meta import SIGNATURE

    sig = fwd.meta[SIGNATURE]
    x = values[sig.inputs[0]]
    target = values[sig.targets[0]]
    return _eager_grads(model, x, target)


def test_gradient_reversal_with_a_scale():
    """fc1's gradients are -0.5 times what they would be without the reversal; the reversal
    itself costs 4*16 = 64 FLOPs (the product by -0.5) in the backward."""
    model, x, _ = _setup("grl")
    got, fwd, values, a = _graph_grads(model, x)
    ref = _reference(model, fwd, values)
    for q in ref:
        torch.testing.assert_close(got[q], ref[q], rtol=1e-12, atol=1e-12)
    assert a.report.totals.backward.complete
    # the reversal's cost: the product by -0.5 over fc1's 4x16 output
    rows = {r.name: r for r in a.report.layers}
    assert rows["(model)"].backward_flops >= 64


def test_function_with_jvp_tangent_and_gradient():
    """CubeWithJvp's JVP graph is its jvp (3·x·x·t: 3 products per element, 4*16 elements:
    192 FLOPs beside fc1's and fc2's tangents); the loss tangent equals eager forward-mode
    AD's (dual tensors run the jvp), the gradients eager autograd's."""
    model, x, _ = _setup("cube")
    got, fwd, values, a = _graph_grads(model, x)
    ref = _reference(model, fwd, values)
    for q in ref:
        torch.testing.assert_close(got[q], ref[q], rtol=1e-10, atol=1e-12)
    assert a.report.totals.jvp.complete and a.report.totals.backward.complete
    # the loss tangent along a random parameter direction
    from graphflop.ad.jvp import build_jvp
    from graphflop.meta import JVP, SIGNATURE

    jvp = build_jvp(fwd, "params")
    gen = torch.Generator().manual_seed(1)
    tangents = {
        p: torch.randn(values[p].shape, generator=gen, dtype=torch.float64)
        for _, p in jvp.meta[JVP].tangent_inputs
    }
    with seeded():
        outs = run_jvp(jvp, values, tangents)
    graph_tangent = outs[jvp.meta[JVP].primal_outputs]
    sig = fwd.meta[SIGNATURE]
    names = dict(sig.params)
    with fwad.dual_level():
        duals = {names[p]: fwad.make_dual(values[p], t) for p, t in tangents.items()}
        out = torch.func.functional_call(model, duals, (values[sig.inputs[0]],))
        loss = F.cross_entropy(out, values[sig.targets[0]])
        eager_tangent = fwad.unpack_dual(loss).tangent
    torch.testing.assert_close(graph_tangent, eager_tangent, rtol=1e-10, atol=1e-12)


def test_function_without_jvp_makes_the_jvp_incomplete_naming_it():
    """RoundSTE has no jvp: PyTorch's forward AD refuses it, and graphflop's JVP phase is
    incomplete with the Function named; its backward stays complete."""
    model, x, _ = _setup("ste")
    a = analyze(model, (x,), loss="cross_entropy")
    assert not a.report.totals.jvp.complete
    assert a.report.totals.backward.complete
    gaps = [u for u in a.report.uncounted if "RoundSTE" in u.op]
    assert gaps and gaps[0].missing == ("jvp",), a.report.uncounted
    try:
        with fwad.dual_level():
            RoundSTE.apply(fwad.make_dual(torch.ones(2), torch.ones(2)))
        refused = False
    except RuntimeError:
        refused = True
    assert refused  # as PyTorch


class CubeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(CubeWithJvp.apply(torch.tanh(self.fc(x))))


class CubeStack(nn.Module):
    """Three identical blocks, each calling CubeWithJvp: traced once and copied."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(CubeBlock() for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_functions_in_repeated_blocks():
    """The copies of an outlined block are three calls, each differentiated with its own
    backward and jvp: the gradients and the loss tangent check against eager autograd and
    eager forward-mode AD (torch.func cannot run the class: it has no setup_context)."""
    from graphflop.meta import OUTLINED
    from graphflop.runtime.verify import verify_gradients
    from graphflop.runtime.verify_tangent import verify_jvp

    torch.manual_seed(0)
    model = CubeStack().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    a = analyze(model, (x,), loss="cross_entropy")
    assert a.forward.meta[OUTLINED].calls == 3  # traced once, copied
    from graphflop.ad.functions import function_calls

    assert len({id(c) for c in function_calls(a.forward).values()}) == 3
    grad = verify_gradients(a.forward, a.backward, model, examples=(x,))
    assert grad.ok and grad.name == "gradients vs torch.autograd.backward", grad
    tangent = verify_jvp(a.forward, a.jvp, model, examples=(x,))
    assert tangent.ok and tangent.name == "JVP loss tangent vs torch.autograd.forward_ad", tangent


def test_function_saving_its_input_in_an_outlined_block_warns_nothing():
    """A tester's finding: an outlined block's forward, run once on FakeTensors for its
    outputs' metadata (nothing recorded), made a record of its Function call whose saved
    input had no node, and the trace warned "it saves a tensor its forward did not compute
    from its inputs". No warning now; the forward and backward FLOPs are full tracing's."""
    import warnings

    from graphflop.ad.vjp import build_vjp
    from graphflop.meta import OUTLINED
    from graphflop.passes.flops import annotate_flops, total_cost

    torch.manual_seed(0)
    model = CubeStack().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        once = trace(model, (x,), loss="sum")
    assert once.meta[OUTLINED].calls == 3
    assert [str(w.message) for w in caught if "autograd.Function" in str(w.message)] == []
    full = trace(model, (x,), loss="sum", reuse=False)
    for a, b in ((once, full), (build_vjp(once), build_vjp(full))):
        assert total_cost(annotate_flops(a).graph.nodes) == total_cost(
            annotate_flops(b).graph.nodes
        )


# -- Functions in repeated blocks, transposed from the recorded JVP -----------------------------


class WeightCube(torch.autograd.Function):
    """A parameter's cube (the block's weight is W³): :class:`CubeWithJvp` on a weight, so the
    Function's input tangent is a parameter's tangent, an argument of the block's call."""

    @staticmethod
    def forward(ctx, w):
        ctx.save_for_backward(w)
        ctx.save_for_forward(w)
        return w * w * w

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return 3 * w * w * g

    @staticmethod
    def jvp(ctx, t):
        (w,) = ctx.saved_tensors
        return 3 * w * w * t


class StopGradient(torch.autograd.Function):
    """2x with no gradient (backward returns None: a zero cotangent) and a zero tangent."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return None

    @staticmethod
    def jvp(ctx, t):
        return t * 0


class FnBlock(nn.Module):
    """A residual block calling a Function (``fn``): ``cube`` (with jvp), ``round`` and
    ``reverse`` (without: the JVP graph is cut there), ``twice`` (its output read twice, its
    input also outside it), ``input`` (on the block's input), ``weight`` (on a weight),
    ``stop`` (no gradient: no cotangent reaches the block's work before it), ``plain`` (none:
    the same cube written out)."""

    def __init__(self, fn: str, d: int = 6):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.fn = fn

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.fn == "cube":
            return x + self.out(CubeWithJvp.apply(h))
        if self.fn == "round":
            return x + self.out(RoundSTE.apply(h * 4))
        if self.fn == "reverse":
            return x + self.out(GradReverse.apply(h, 0.5))
        if self.fn == "twice":
            y = CubeWithJvp.apply(h)
            return x + self.out(y) + y * h
        if self.fn == "input":
            return x + self.out(h) * CubeWithJvp.apply(x)
        if self.fn == "stop":
            return x + self.out(StopGradient.apply(h))
        if self.fn == "weight":
            return x + F.linear(h, WeightCube.apply(self.out.weight), self.out.bias)
        return x + self.out(h * h * h)


class FnStack(nn.Module):
    """A layer, then residual blocks, one per entry of ``fns`` (so the backward is recorded:
    no fold across a call), then a head; ``top``: a Function before the head too."""

    def __init__(self, fns: list[str], top: bool = False, d: int = 6):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(FnBlock(f, d) for f in fns)
        self.head = nn.Linear(d, 3)
        self.top = top

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        if self.top:
            x = CubeWithJvp.apply(x)
        return self.head(x)


#: name -> (the blocks' Functions, a Function at the top level too)
FN_STACKS = {
    "with_jvp": (["cube"] * 4, True),
    "without_jvp": (["round"] * 3, False),
    "without_jvp_scaled": (["reverse"] * 3, False),
    "some_blocks": (["cube", "plain", "cube", "plain"], False),
    "output_twice": (["twice"] * 3, False),
    "on_input_and_weight": (["input", "weight", "input", "weight"], False),
    # the rules emit nothing for the work before the Function: no call (an empty one was
    # recorded, and DirectRecorder.finish raised IndexError)
    "stopping_the_gradient": (["stop"] * 3, False),
}


@pytest.mark.parametrize("case", FN_STACKS)
def test_functions_in_blocks_transposed_from_the_recorded_jvp(case, monkeypatch):
    """Blocks calling custom Functions: the backward transposed from the recorded JVP's
    repeat nodes (each JVP template's first call made flat, its other calls read from their
    repeat nodes; the Function's entry reads the nodes standing for the call's values) equals
    the one transposed from the flat JVP node for node, names included, with and without a
    recorder of the backward (which keeps it recorded); its gradients are eager autograd's
    (the Functions' own backward)."""
    from test_derived_direct import _check_transposed
    from test_recorded_analysis import _graphs_equal

    from graphflop.ad import blocks
    from graphflop.ad.jvp import build_jvp
    from graphflop.ad.vjp import build_vjp
    from graphflop.meta import DERIVED_HIERARCHY, LINEARIZED
    from graphflop.passes import calls
    from graphflop.passes.calls import DirectRecorder
    from graphflop.runtime.verify import verify_gradients

    fns, top = FN_STACKS[case]
    torch.manual_seed(0)
    model = FnStack(fns, top).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    fwd = trace(model, (x,), loss="cross_entropy")
    for input_grads in (False, True):
        got = _check_transposed(fwd, input_grads)  # read from the repeat nodes, as flat
        check = verify_gradients(fwd, got, model, examples=(x,))
        assert check.ok and check.name == "gradients vs torch.autograd.backward", check

    made_flat: list = []
    flat = blocks.RecordedCalls.flat

    def counted(self, rep, run, ct):
        made_flat.append(rep)
        return flat(self, rep, run, ct)

    monkeypatch.setattr(blocks.RecordedCalls, "flat", counted)
    rec = build_jvp(fwd, "all", for_transpose=True, recorder=DirectRecorder(fwd))
    bwd = build_vjp(fwd, input_grads=True, linearized=rec, recorder=DirectRecorder(fwd))
    assert bwd.meta[LINEARIZED] is rec
    dh = bwd.meta[DERIVED_HIERARCHY]
    assert dh.graph is bwd  # recorded
    # tangents on the input too: every block's calls one variant per JVP template, whose
    # first call transposed is made flat and the others read (where the Function's entry
    # splits a call's run, the first run's cotangents are settled on the nodes the second
    # reads: it found none there, and every call on a weight or input was made flat)
    jvp_calls = rec.meta[DERIVED_HIERARCHY].calls
    assert len(set(made_flat)) == len({c.template for c in jvp_calls}) < len(jvp_calls)
    check = verify_gradients(fwd, calls.flat_view(bwd), model, examples=(x,))
    assert check.ok, check

    # analyze: the same report and graphs, names included, as the flat analysis; the
    # backward recorded, transposed from the recorded JVP (with a Function without jvp,
    # which cuts it, from one recorded through the Function)
    flat_a = analyze(model, (x,), loss="cross_entropy", record_derivatives=False)
    rec_a = analyze(model, (x,), loss="cross_entropy", record_derivatives=True)
    assert rec_a.report.to_dict() == flat_a.report.to_dict()
    _graphs_equal(rec_a, flat_a)
    built = rec_a.as_built()
    lin = built.backward.meta[LINEARIZED]
    assert calls.is_recorded(built.backward) and calls.is_recorded(lin)
    assert (lin is built.jvp) == rec_a.report.totals.jvp.complete
    assert rec_a.report.totals.backward.complete


# -- tied weights where verify falls back to eager autograd -------------------------------------


class _Identity(torch.autograd.Function):
    """The identity with a backward of its own and no ``setup_context``: torch.func refuses
    it, so verify's reference is eager autograd."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class _TiedLM(nn.Module):
    """An embedding whose weight is also the output head's (tied), a Function between."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(_Identity.apply(self.mid(self.emb(ids))))


def test_eager_reference_sees_tied_weights_as_one_parameter():
    """The eager reference puts the one leaf of a tied weight at both its names (the
    embedding's and the head's), so the gradient it compares with is the sum of both uses:
    with only the first name replaced the head's share was lost and verify reported a
    failure (relative error ~1) for graphflop's correct gradient."""
    from graphflop.runtime.verify import verify_gradients

    torch.manual_seed(0)
    model = _TiedLM().double()
    ids = torch.randint(0, 20, (2, 5))
    a = analyze(model, (ids,))
    grad = verify_gradients(a.forward, a.backward, model, examples=(ids,))
    assert grad.name == "gradients vs torch.autograd.backward", grad
    assert grad.ok, grad


class ExpInPlace(torch.autograd.Function):
    """exp written into its input (``ctx.mark_dirty``), the result saved: backward g · exp(x)."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        x.exp_()
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class DirtyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(ExpInPlace.apply(self.fc1(x)))


def test_function_writing_its_input_in_place_marked_dirty():
    """A tester's finding: a Function that writes into its input (``ctx.mark_dirty(x);
    x.exp_()``) lost its input and output in the trace (functionalization gives the written
    tensor new nodes), so the loss did not depend on fc1: backward 0 FLOPs, nothing saved.
    Now its own backward runs: gradients as eager autograd's; saved bytes as eager's
    (SavedBytes, float64, batch 4: fc1's input 4·8·8 = 256, the exp'd h 4·16·8 = 512, which
    fc2 saves too, cross-entropy's log-softmax 4·4·8 = 128, its int64 target 4·8 = 32 and
    total weight 8: 936)."""
    torch.manual_seed(0)
    model = DirtyNet().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    a = analyze(model, (x,), loss="cross_entropy")
    values = real_arguments(a.forward, model, examples=(x,))
    grads = run_backward(a.backward, run_forward(a.forward, values))
    got = {q: grads[pos] for pos, q in a.backward.meta[VJP].grads}
    ref = _reference(model, a.forward, values)
    for q in ref:
        torch.testing.assert_close(got[q], ref[q], rtol=1e-12, atol=1e-12)
    assert float(got["fc1.weight"].abs().sum()) > 0
    assert a.report.totals.backward.complete
    from graphflop.meta import SIGNATURE
    from graphflop.runtime.memory_probe import SavedBytes

    sig = a.forward.meta[SIGNATURE]
    with SavedBytes(model) as saved:
        F.cross_entropy(model(x), values[sig.targets[0]])
    assert saved.nbytes == 256 + 512 + 128 + 32 + 8
    assert a.report.memory.saved_for_backward_bytes == saved.nbytes
