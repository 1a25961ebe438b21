"""Custom ``torch.autograd.Function`` s honoured: the backward graph is the class's own
``backward``, the JVP graph its own ``jvp``; a class without ``jvp`` leaves the JVP phase
incomplete, naming it (PyTorch's forward AD refuses it too). References: eager autograd
(``loss.backward()`` runs the Function's backward) and eager forward-mode AD (dual tensors run
its ``jvp``), on the real model in float64.
"""

from __future__ import annotations

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
