"""Grad mode turned off inside a model's forward (``torch.no_grad()``,
``torch.set_grad_enabled(False)``, ``torch.inference_mode()``, a method decorated with
``@torch.no_grad()``): as in eager PyTorch, what is computed there carries no derivative (as
after ``detach``), and a parameter read only there gets no gradient and no update."""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch
from test_hierarchy import _check
from torch import nn

from graphflop.ad.jvp import build_jvp
from graphflop.ad.vjp import build_vjp
from graphflop.analysis import analyze
from graphflop.frontend.trace import trace
from graphflop.meta import ASSUMPTIONS, HIERARCHY, NO_GRAD, OUTLINED, SIGNATURE
from graphflop.runtime.verify import verify_gradients
from graphflop.runtime.verify_tangent import verify_jvp

B, D, C = 2, 8, 3


class Net(nn.Module):
    """The tester's model: layer b runs under ``no_grad``; its output joins the graph."""

    def __init__(self, mode: str = "no_grad"):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.head = nn.Linear(D, C)
        self.mode = mode

    def forward(self, x):
        x = self.a(x)
        if self.mode == "no_grad":
            with torch.no_grad():
                w = self.b(x)
        elif self.mode == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                w = self.b(x)
        elif self.mode == "inference_mode":
            with torch.inference_mode():
                w = self.b(x)
            w = w.clone()  # eager refuses an inference tensor in a graph that records
        elif self.mode == "decorated":
            w = self.off(x)
        elif self.mode == "detach":  # the reference: the same graph, b's output detached
            w = self.b(x).detach()
        else:
            raise ValueError(self.mode)
        return self.head(x + w)

    @torch.no_grad()
    def off(self, x):
        return self.b(x)


def _layers(a) -> dict[str, dict]:
    return {row["name"]: row for row in a.report.to_dict()["layers"]}


def test_repro_figures_by_hand():
    """Per layer, with B=2 rows of D=8 features and C=3 classes (1 multiply-add = 2 FLOPs):
    a: weight gradient xᵀ·g 2·B·D·D = 256 plus the bias gradient (a sum over the batch of a
    B×D tensor) 16 = 272; its input gradient is pruned (the model input needs none); update
    (SGD) 2 FLOPs per parameter: 2·(64+8) = 144. b: nothing (eager gives it no .grad).
    head: input gradient g·W 2·B·C·D = 96, weight gradient 96 + bias 6 = 102, update
    2·(24+3) = 54. JVP: a: x·Ẇᵀ 256 + ḃ 16 = 272; b: 0 (no tangent in a no_grad region);
    head: ẋ·Wᵀ 96 + x·Ẇᵀ 96 + their sum 6 + ḃ 6 = 204; the residual add x + w: 0 (w has
    no tangent, x's passes through)."""
    a = analyze(Net(), torch.randn(B, D))
    rows = _layers(a)
    assert rows["a"]["grad_weight_flops"] == 2 * B * D * D + B * D == 272
    assert rows["a"]["update_flops"] == 2 * (D * D + D) == 144
    assert rows["a"]["jvp_flops"] == 272
    for key in ("backward_flops", "grad_weight_flops", "grad_input_flops", "jvp_flops"):
        assert rows["b"][key] == 0, key
    assert not rows["b"]["update_flops"]
    assert rows["head"]["grad_input_flops"] == 2 * B * C * D == 96
    assert rows["head"]["grad_weight_flops"] == 2 * B * C * D + B * C == 102
    assert rows["head"]["update_flops"] == 2 * (C * D + C) == 54
    assert rows["head"]["jvp_flops"] == 96 + 96 + 6 + 6 == 204
    assert rows["(model)"]["jvp_flops"] == 0
    sig = a.forward.meta[SIGNATURE]
    assert {q for p, q in sig.params if p in sig.frozen} == {"b.weight", "b.bias"}


def test_backward_and_update_equal_detached():
    """The backward and update figures are those of the same model with b's output detached
    (the stop-gradient graphflop already handled), layer by layer."""
    got = analyze(Net(), torch.randn(B, D))
    ref = analyze(Net("detach"), torch.randn(B, D))
    keys = ("backward_flops", "grad_input_flops", "grad_weight_flops", "update_flops")
    ref_rows = _layers(ref)
    for name, row in _layers(got).items():
        assert {k: row[k] for k in keys} == {k: ref_rows[name][k] for k in keys}, name
    assert got.report.totals.backward.flops == ref.report.totals.backward.flops
    assert got.report.totals.update.flops == ref.report.totals.update.flops


@pytest.mark.parametrize("mode", ["no_grad", "set_grad_enabled", "inference_mode", "decorated"])
def test_gradients_and_jvp_match_torch(mode):
    """Gradients against torch.func.grad (which keeps the region's stop-gradient: a's gradient
    through w would otherwise differ); eager autograd gives b no .grad, and the trace counts it
    frozen; the JVP's loss tangent is <∇L, direction>."""
    torch.manual_seed(0)
    model = Net(mode).double()
    x = torch.randn(B, D, dtype=torch.float64)
    fwd = trace(model, (x,))
    assert any(n.meta.get(NO_GRAD) for n in fwd.graph.nodes)
    sig = fwd.meta[SIGNATURE]
    assert {q for p, q in sig.params if p in sig.frozen} == {"b.weight", "b.bias"}
    check = verify_gradients(fwd, build_vjp(fwd), model, tolerance=1e-10)
    assert check.ok, check
    jvp_check = verify_jvp(fwd, build_jvp(fwd, "params"), model, tolerance=1e-10)
    assert jvp_check.ok, jvp_check
    model(x).sum().backward()
    assert model.b.weight.grad is None and model.a.weight.grad is not None


@torch.library.custom_op("gfnograd::scale", mutates_args=())
def _scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


@_scale.register_fake
def _(x, w):
    return torch.empty_like(x)


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class Calls(nn.Module):
    """A custom op (PyTorch's autograd wrapper runs its kernel with grad mode off, the model's
    mode being on) and a custom Function, each once with grad mode on and once off."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        y = _scale(x, self.w) + Square.apply(x * self.w)
        with torch.no_grad():
            z = _scale(y, self.w) + Square.apply(y)
        return y * z


def test_custom_op_and_function_tagged_by_the_models_mode():
    """Only the calls made under no_grad are tagged: the grad-mode custom op's node is not (its
    grad mode off is autograd's), and the Function called with grad mode on keeps its tangent;
    with the Function alone, the gradient matches eager autograd's."""
    fwd = trace(Calls(), (torch.randn(B, D),))
    ops = [n for n in fwd.graph.nodes if n.target is torch.ops.gfnograd.scale.default]
    assert [bool(n.meta.get(NO_GRAD)) for n in ops] == [False, True]
    muls = [n for n in fwd.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert any(n.meta.get(NO_GRAD) for n in muls) and not all(n.meta.get(NO_GRAD) for n in muls)
    torch.manual_seed(0)
    model = Squares().double()
    fwd = trace(model, (torch.randn(B, D, dtype=torch.float64),))
    check = verify_gradients(fwd, build_vjp(fwd), model, tolerance=1e-10)
    assert check.ok, check


class Squares(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        y = Square.apply(x * self.w)
        with torch.no_grad():
            z = Square.apply(y * self.w)
        return y * z


class Shared(nn.Module):
    """One layer used twice, once under no_grad: its gradient is the grad-mode use's only."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        with torch.no_grad():
            w = torch.tanh(self.lin(h))
        return self.head(h * w)


def test_shared_parameter_gradient_matches_torch():
    """lin stays trainable (read outside no_grad too); its gradient, compared with
    torch.func.grad, leaves out the no_grad use (without the stop-gradient it would not
    match)."""
    torch.manual_seed(0)
    model = Shared().double()
    fwd = trace(model, (torch.randn(B, D, dtype=torch.float64),))
    assert not fwd.meta[SIGNATURE].frozen
    check = verify_gradients(fwd, build_vjp(fwd), model, tolerance=1e-10)
    assert check.ok, check
    assert verify_jvp(fwd, build_jvp(fwd, "params"), model, tolerance=1e-10).ok


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class FrozenEncoder(nn.Module):
    """Identical blocks: three run under no_grad (a frozen encoder), two train."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList(Block() for _ in range(3))
        self.decoder = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, C)

    def forward(self, x):
        with torch.no_grad():
            for blk in self.encoder:
                x = blk(x)
        for blk in self.decoder:
            x = blk(x)
        return self.head(x)


def test_repeated_blocks_under_no_grad(monkeypatch):
    """The encoder's blocks (outlined: traced once) get no backward, update nor JVP and their
    parameters count as frozen; the decoder's identical blocks do; the hierarchical report
    equals the flat one; and the figures are those of the model traced without outlining."""
    model, x = FrozenEncoder(), torch.randn(B, D)
    a = analyze(model, x)
    assert a.forward.meta[OUTLINED].calls == 5 and a.forward.meta[OUTLINED].traced_once == 2
    _check(a)
    rows = _layers(a)
    for i in range(3):
        for sub in ("fc1", "fc2"):
            row = rows[f"encoder.{i}.{sub}"]
            assert row["backward_flops"] == row["jvp_flops"] == 0
            assert not row["update_flops"]
    for i in range(2):
        # fc2: input gradient 2·B·2D·D = 512, weight gradient 512 + bias 16
        assert rows[f"decoder.{i}.fc2"]["grad_weight_flops"] == 2 * B * 2 * D * D + B * D
        assert rows[f"decoder.{i}.fc2"]["update_flops"] == 2 * (2 * D * D + D)
    sig = a.forward.meta[SIGNATURE]
    frozen = {q for p, q in sig.params if p in sig.frozen}
    assert frozen == {q for q, _ in FrozenEncoder().named_parameters() if q.startswith("enc")}
    from graphflop.frontend import outline

    with monkeypatch.context() as m:  # every block traced in full, no hierarchy
        m.setattr(outline, "plan", lambda *a, **k: {})
        flat = analyze(model, x)
    assert HIERARCHY not in flat.forward.meta
    assert a.report.to_dict() == flat.report.to_dict()
    torch.manual_seed(0)
    model = FrozenEncoder().double()
    fwd = trace(model, (torch.randn(B, D, dtype=torch.float64),))
    assert verify_gradients(fwd, build_vjp(fwd), model, tolerance=1e-10).ok


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_caller_s_grad_mode_changes_nothing(mode):
    """The graphs describe a training step whatever mode the caller is in: under its
    ``no_grad`` the model's own region is still told apart (it was hidden: every node made
    with grad off, none tagged, b differentiated), under its ``inference_mode`` the trace
    works (it failed: inference tensors track no version counter), and inputs made under
    inference mode are fine. The update counts a's and the head's parameters only, 2 FLOPs
    per element (SGD): (D·D + D) + (D·C + C)."""
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(B, D)
    want = analyze(model, (x,)).report
    with mode():
        fwd = trace(model, (x,))
        got = analyze(model, (x,)).report
        x_inference = torch.randn(B, D)
    assert any(n.meta.get(NO_GRAD) for n in fwd.graph.nodes)
    assert got.totals == want.totals and got.memory == want.memory
    assert got.totals.update.flops == 2 * ((D * D + D) + (D * C + C))
    assert analyze(model, (x_inference,)).report.totals == want.totals


@pytest.mark.slow  # (about 2 s: a transformers model analysed twice; CI's slow pass)
def test_hf_llama_unchanged(monkeypatch):
    """A tiny Llama (its rotary embedding computes cos/sin from positions only) has nothing
    computed with grad mode off on the way to the loss: its report is the one of the model
    with no region tagged."""
    pytest.importorskip("transformers")
    import graphflop.frontend.trace as trace_module
    from graphflop.load import load, make_inputs

    kw = dict(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load("hf:llama-3.1-8b", ctor_kwargs=kw, meta=True, seq=8)
        got = analyze(loaded.model, make_inputs(loaded, batch=2), name="llama")
        monkeypatch.setattr(trace_module, "grad_mode_tagged", _untagged)
        ref = analyze(loaded.model, make_inputs(loaded, batch=2), name="llama")
    dump = lambda a: json.dumps(a.report.to_dict(), sort_keys=True, default=str)  # noqa: E731
    assert dump(got) == dump(ref)
    assert got.report.totals.backward.flops > 0


def _untagged():
    return contextlib.nullcontext()


class _InPlaceUnderNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            h.mul_(2)  # autograd does not see the write: a's gradient flows as if it were not
        return self.b(h)


def test_an_in_place_write_under_no_grad_keeps_the_derivative():
    """A tester's finding: ``h.mul_(2)`` under ``no_grad`` on a tensor that requires grad cut
    ``a``'s whole derivative (its node tagged as made without grad). Eager autograd does not
    record the write, so the tensor keeps its derivative (scaled values, the same gradient
    path): ``a`` is trained, its gradient and the JVP are torch's."""
    torch.manual_seed(0)
    model, x = _InPlaceUnderNoGrad(), torch.randn(2, 8)
    a = analyze(model, x)
    assert a.report.frozen_params == 0
    assert verify_gradients(a.forward, a.backward, model, examples=(x,)).ok
    assert verify_jvp(a.forward, a.jvp, model, examples=(x,)).ok


class _MarksInput(nn.Module):
    """``requires_grad_()`` in forward on the input (depends on no parameter) and, with
    ``on_hidden``, on a value that already depends on one (a no-op in eager)."""

    def __init__(self, on_hidden: bool = False):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, C)
        self.on_hidden = on_hidden

    def forward(self, x):
        if self.on_hidden:
            return self.head(self.fc(x).requires_grad_())
        return self.head(self.fc(x.clone().requires_grad_()))


@pytest.mark.parametrize(("on_hidden", "mm"), [(False, 704), (True, 448)])
def test_requires_grad_on_a_new_leaf_is_differentiated(on_hidden, mm):
    """Eager autograd computes the gradient of a value the model makes require grad that
    depends on no parameter, and so fc's input gradient: the backward's matrix FLOPs are
    head's input and weight gradients 2 · 2·B·D·C = 192, fc's weight gradient 2·B·D·D = 256,
    and fc's input gradient 256 more (704). On a value that already requires grad the call
    changes nothing (448). No assumption line either way."""
    a = analyze(_MarksInput(on_hidden), (torch.randn(B, D),))
    assert a.report.totals.backward.mm_flops == mm
    assert not [x for x in a.forward.meta[ASSUMPTIONS] if "requires_grad_()" in x]


#: in-place writes made under ``no_grad`` into ``h`` (which requires grad), into ``t`` (a view
#: of ``h`` taken with grad on) or into a view taken there; ``v`` is another layer's output,
#: computed there
_WRITES = {
    "setitem column": lambda h, t, v: h.__setitem__((slice(None), 0), v[:, 0]),
    "setitem slice step": lambda h, t, v: h.__setitem__((slice(None), slice(0, 8, 2)), v[:, ::2]),
    "setitem index": lambda h, t, v: h.__setitem__((slice(None), torch.tensor([0, 3])), v[:, :2]),
    "setitem mask": lambda h, t, v: h.__setitem__(v > 0, 0.0),
    "setitem from itself": lambda h, t, v: h.__setitem__((slice(None), 0), h[:, 1]),
    "setitem nested view": lambda h, t, v: h[0].__setitem__(slice(1, 3), v[0, 1:3]),
    "setitem transposed": lambda h, t, v: h.t().__setitem__(0, v[:, 0]),
    "index_put_": lambda h, t, v: h.index_put_((torch.tensor([1]),), v[1:2]),
    "masked_fill_": lambda h, t, v: h.masked_fill_(v > 0, 0.0),
    "copy_ into a view": lambda h, t, v: h[:, 2:4].copy_(v[:, :2]),
    "copy_ into a diagonal": lambda h, t, v: h[:, :2].diagonal().copy_(v[0, :2]),
    "mul_ on a flat view": lambda h, t, v: h.view(-1).mul_(2),
    "lerp_": lambda h, t, v: h.lerp_(v, 0.3),
    "setitem on a view": lambda h, t, v: t.__setitem__((slice(None), 0), v[:, 0]),
    "mul_ on a view": lambda h, t, v: t.mul_(2),
    "two writes": lambda h, t, v: (h.__setitem__((slice(None), 0), v[:, 0]), t.mul_(2)),
    # a tester's finding: a write through out= cut h's whole derivative
    "mul out=": lambda h, t, v: torch.mul(h, 3.0, out=h),
    "add out= into a view": lambda h, t, v: torch.add(t, v[:, :4], out=t),
}


class _Write(nn.Module):
    """``h = a(x)`` and ``t = h[:, 1:5]`` require grad; ``write`` (one of :data:`_WRITES`, or
    None: no write) writes into them under ``no_grad``; both are read afterwards."""

    def __init__(self, write: str | None):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, C)
        self.write = write

    def forward(self, x):
        h = self.a(x)
        t = h[:, 1:5]
        if self.write is not None:
            with torch.no_grad():
                _WRITES[self.write](h, t, self.b(x))
        return self.head(h) + t.sum(1, keepdim=True)


def _against_eager_autograd(a, model, x) -> None:
    """Every trainable parameter's gradient from graphflop's backward graph, and the JVP
    graph's loss tangent, against eager autograd on the model itself (``torch.autograd.grad``
    and ``<∇L, direction>``; not ``torch.func.jvp``, whose forward mode differentiates through
    ``no_grad``), in float64, on the same inputs and targets."""
    from graphflop.meta import JVP, VJP
    from graphflop.runtime.verify import (
        backward_reads,
        real_arguments,
        reference_loss_fn,
        run_backward,
        run_forward,
    )
    from graphflop.runtime.verify_tangent import run_jvp

    fwd, sig = a.forward, a.forward.meta[SIGNATURE]
    values = real_arguments(fwd, model, examples=(x,))
    grads = run_backward(a.backward, run_forward(fwd, values, backward_reads(a.backward)))
    got = {qual: grads[pos] for pos, qual in a.backward.meta[VJP].grads}
    params = {q: values[n].clone().requires_grad_(True) for n, q in sig.params}
    loss = reference_loss_fn(fwd, model, values)(params)
    eager = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in eager)
    ref = {q: torch.zeros_like(params[q]) if g is None else g for q, g in zip(params, eager)}
    for q, r in ref.items():
        g = got.get(q, torch.zeros_like(r))
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12), q
    info = a.jvp.meta[JVP]
    gen = torch.Generator().manual_seed(1)
    dirs = {
        p: torch.randn(values[p].shape, generator=gen, dtype=values[p].dtype)
        for _, p in info.tangent_inputs
    }
    tangent = run_jvp(a.jvp, values, dirs)[info.primal_outputs]
    qual = dict(sig.params)
    expected = sum((ref[qual[p]] * d).sum() for p, d in dirs.items())
    assert torch.allclose(tangent, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("write", list(_WRITES))
def test_a_write_under_no_grad_keeps_the_derivative_as_eager_autograd(write):
    """A tester's finding: ``h[:, 0] = b(x)[:, 0]`` under ``no_grad``, with ``h`` requiring
    grad, cut ``h``'s whole derivative (the trace makes the write a scatter, made with grad mode
    off). Eager autograd does not record the write: ``h`` (and a view of it taken with grad on)
    keeps the derivative it had, column 0 included, as if the write were not there; the values
    written get none. Gradients and the JVP against eager autograd, for each kind of write."""
    torch.manual_seed(0)
    model, x = _Write(write).double(), torch.randn(B, D, dtype=torch.float64)
    _against_eager_autograd(analyze(model, x), model, x)


@pytest.mark.parametrize("write", ["setitem column", "copy_ into a view", "mul_ on a view"])
def test_a_write_under_no_grad_costs_no_derivative_work(write):
    """Eager autograd does no derivative work for the write: the backward and JVP totals, and
    each layer's input-gradient, weight-gradient and JVP FLOPs, are those of the same model
    without it (a: weight gradient 2·B·D·D + B·D = 272, now that h keeps its derivative). The
    sum of h's two cotangents (head's and t's, 16 FLOPs) is met at head's use instead of t's:
    functionalization reads t again, from h's new value, where the model reads it after the
    write."""
    models = _Write(write), _Write(None)
    for m in models:  # b, read under no_grad or not at all, gets no gradient in either
        m.b.requires_grad_(False)
    got, ref = (analyze(m, torch.randn(B, D)) for m in models)
    assert got.report.totals.backward == ref.report.totals.backward
    assert got.report.totals.jvp == ref.report.totals.jvp
    rows, ref_rows = _layers(got), _layers(ref)
    assert rows["a"]["grad_weight_flops"] == 2 * B * D * D + B * D
    keys = ("grad_input_flops", "grad_weight_flops", "jvp_flops")
    for name, row in ref_rows.items():
        assert {k: rows[name][k] for k in keys} == {k: row[k] for k in keys}, name


class _WriteBlock(nn.Module):
    """The tester's block: a setitem under no_grad into a tensor that requires grad."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            h[:, 0] = self.b(x)[:, 0]
        return x + self.b(h)


class _WriteBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_WriteBlock() for _ in range(4))
        self.head = nn.Linear(D, C)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def test_repeated_blocks_writing_under_no_grad(monkeypatch):
    """The tester's model (n16): its blocks outlined, the hierarchical report equals the flat
    one and the one traced without outlining; gradients and JVP against eager autograd."""
    torch.manual_seed(0)
    model, x = _WriteBlocks().double(), torch.randn(B, D, dtype=torch.float64)
    a = analyze(model, x)
    assert a.forward.meta[OUTLINED].traced_once == 1
    _check(a)
    _against_eager_autograd(a, model, x)
    from graphflop.frontend import outline

    with monkeypatch.context() as m:
        m.setattr(outline, "plan", lambda *a, **k: {})
        flat = analyze(model, x)
    assert a.report.to_dict() == flat.report.to_dict()


class _InferenceWrite(nn.Module):
    """A write under ``torch.inference_mode()`` into a tensor made outside it, which requires
    grad and which a layer reads afterwards (eager writes into it and it stays a normal
    tensor)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x):
        h = self.a(x)
        t = h[:, 1:5]
        with torch.inference_mode():
            h[:, 0] = self.b(x)[:, 0]
            t.mul_(2)
        return self.head(h) + t.sum(1, keepdim=True)


def test_a_write_under_inference_mode_keeps_the_derivative():
    """The same under ``torch.inference_mode()``: it failed to trace (the written tensor's new
    value made an inference tensor, which head's matrix product could not save for
    backward); eager writes into the normal tensor and does not record it."""
    torch.manual_seed(0)
    model, x = _InferenceWrite().double(), torch.randn(B, D, dtype=torch.float64)
    _against_eager_autograd(analyze(model, x), model, x)


class _ReadUnderNoGrad(nn.Module):
    """b's output, computed with grad on, is read only under ``no_grad`` (``unread``: b is not
    called; the zeros its output would add to nothing)."""

    def __init__(self, unread: bool = False):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, C)
        self.unread = unread

    def forward(self, x):
        h = self.a(x)
        if self.unread:
            return self.head(h + torch.zeros(B, D))
        v = self.b(x)
        with torch.no_grad():
            w = v * 2
        return self.head(h + w)


def test_a_tangent_read_only_under_no_grad_is_not_built():
    """b's output carries a tangent, but its only reader is made under ``no_grad`` and takes
    none: the JVP built it anyway, for nothing (2·B·D·D + B·D = 272 FLOPs). The JVP figures are
    those of the model that does not call b, layer by layer."""
    got = analyze(_ReadUnderNoGrad(), torch.randn(B, D))
    ref = analyze(_ReadUnderNoGrad(unread=True), torch.randn(B, D))
    rows, ref_rows = _layers(got), _layers(ref)
    assert rows["b"]["jvp_flops"] == 0
    assert rows["a"]["jvp_flops"] == ref_rows["a"]["jvp_flops"] == 2 * B * D * D + B * D
    assert rows["head"]["jvp_flops"] == ref_rows["head"]["jvp_flops"]
    assert got.report.totals.jvp.flops == ref.report.totals.jvp.flops
    torch.manual_seed(0)
    model, x = _ReadUnderNoGrad().double(), torch.randn(B, D, dtype=torch.float64)
    _against_eager_autograd(analyze(model, x), model, x)


class _MaxNorm(nn.Module):
    """``nn.Embedding(max_norm=...)``: ``F.embedding`` renormalizes the rows it reads in place
    (``torch.embedding_renorm_`` on ``weight.detach()``, not recorded by autograd); ``tied``:
    the head reads the whole (written) weight afterwards, as a tied output layer does."""

    def __init__(self, tied: bool):
        super().__init__()
        self.emb = nn.Embedding(V, D, max_norm=1.0)
        self.fc = nn.Linear(D, V)
        self.tied = tied

    def forward(self, ids):
        h = self.emb(ids)
        return h @ self.emb.weight.t() if self.tied else self.fc(h)


class _ParamWrite(nn.Module):
    """A parameter written in place under ``no_grad`` (HF RWKV's eval-mode rescaling:
    ``weight.div_(2)``), then read."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x):
        with torch.no_grad():
            self.a.weight.div_(2)
        return self.head(torch.relu(self.a(x)))


V = 10


@pytest.mark.parametrize("tied", [False, True])
def test_max_norm_embedding_as_eager_autograd(tied):
    """A tester's finding: autograd refused functionalisation's write of the renormalized
    weight back into the parameter (a leaf that requires grad); then the write into the
    detached alias cut the weight's derivative. As eager: the weight is trained (its
    gradient, through the embedding and, tied, through the head that reads the renormalized
    rows), the forward reads the written value. Gradients and JVP against eager autograd in
    float64; the rows' norms (about √D ≈ 2.8) exceed max_norm, so the write matters."""
    torch.manual_seed(0)
    model, ids = _MaxNorm(tied).double(), torch.randint(0, V, (B, 5))
    a = analyze(model, ids)
    assert a.forward.meta[SIGNATURE].params_written == ("emb.weight",)
    assert a.report.frozen_params == 0
    _against_eager_autograd(a, model, ids)


def test_max_norm_embedding_figures_by_hand():
    """Untied, B=2 rows of 5 ids, D=8, V=10: the embedding's weight gradient is the
    scatter-add of the B·5·D = 80 cotangent elements (80 FLOPs); SGD's update 2 FLOPs per
    parameter: emb 2·V·D = 160, fc 2·(D·V + V) = 180. The renormalization, per looked-up
    index (N = B·5 = 10; graphflop/ops/embedding.py): the row's 2-norm D squares + D adds
    + 1 square root, + 1e-7, its reciprocal, × max_norm, the comparison, the select (6), the
    row scaled (D): 3·D + 6 = 30 per index, 300; the lookup itself 0."""
    rows = _layers(analyze(_MaxNorm(False), torch.randint(0, V, (B, 5))))
    assert rows["emb"]["forward_flops"] == B * 5 * (3 * D + 6) == 300
    assert rows["emb"]["grad_weight_flops"] == B * 5 * D == 80
    assert rows["emb"]["update_flops"] == 2 * V * D == 160
    assert rows["fc"]["update_flops"] == 2 * (D * V + V) == 180


def test_a_parameter_written_under_no_grad_as_eager_autograd():
    """``a.weight.div_(2)`` under ``no_grad``: the forward reads the halved weight, whose
    derivative is the parameter's (autograd does not record the write); against eager
    autograd, which differentiates at the halved values. a is trained: its weight gradient
    2·B·D·D = 256 plus its bias's B·D = 16 (272), its update 2·(D·D + D) = 144."""
    torch.manual_seed(0)
    model, x = _ParamWrite().double(), torch.randn(B, D, dtype=torch.float64)
    a = analyze(model, x)
    assert a.forward.meta[SIGNATURE].params_written == ("a.weight",)
    _against_eager_autograd(a, model, x)
    rows = _layers(a)
    assert a.report.frozen_params == 0
    assert rows["a"]["grad_weight_flops"] == 2 * B * D * D + B * D == 272
    assert rows["a"]["update_flops"] == 2 * (D * D + D) == 144


def test_a_parameter_write_is_said():
    """The report says which parameter the forward writes into (once), and nothing for a
    model that writes into none."""
    said = analyze(_MaxNorm(False), torch.randint(0, V, (B, 5))).report.assumptions
    lines = [s for s in said if "writes in place into" in s]
    assert len(lines) == 1 and "emb.weight" in lines[0]
    plain = analyze(_InPlaceUnderNoGrad(), torch.randn(2, 8)).report.assumptions
    assert not [s for s in plain if "writes in place into" in s]


class _MaxNormBag(nn.Module):
    """``nn.EmbeddingBag(max_norm=...)`` (``F.embedding_bag`` renormalizes the same way) and a
    head reading the bags' means."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(V, D, max_norm=1.0, mode="mean")
        self.fc = nn.Linear(D, C)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_max_norm_embedding_bag_as_eager_autograd():
    """The bag's weight written and trained as eager does: gradients and JVP against eager
    autograd in float64."""
    torch.manual_seed(0)
    model, ids = _MaxNormBag().double(), torch.randint(0, V, (B, 5))
    a = analyze(model, ids)
    assert a.forward.meta[SIGNATURE].params_written == ("emb.weight",)
    assert a.report.frozen_params == 0
    _against_eager_autograd(a, model, ids)


class _MlpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc(x)))


class _CutOff(nn.Module):
    """Four blocks and a head; block 1 runs under ``no_grad`` (``cut="no_grad"``) or on its
    input detached (``cut="detach"``): either way block 0 gets no gradient."""

    def __init__(self, cut: str) -> None:
        super().__init__()
        self.bs = nn.ModuleList(_MlpBlock() for _ in range(4))
        self.head = nn.Linear(32, 10)
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bs[0](x)
        if self.cut == "no_grad":
            with torch.no_grad():
                x = self.bs[1](x)
        else:
            x = self.bs[1](x.detach())
        x = self.bs[2](x)
        x = self.bs[3](x)
        return self.head(x)


@pytest.mark.parametrize("cut", ["no_grad", "detach"])
def test_gradient_bytes_count_the_parameters_eager_gives_a_gradient(cut):
    """A tester's finding: the gradients' bytes counted every trainable parameter (no_grad:
    26,664 B, detach: 35,112 B), where eager autograd leaves ``.grad`` None for the
    parameters no gradient reaches (block 0, cut off; block 1 under no_grad) and makes no
    gradient memory for them; momentum's state already counted only the others. A block is
    2 · (32·32 + 32) = 2,112 parameters, the head 330: blocks 2, 3 and the head get one,
    4,554 · 4 = 18,216 B, and block 1 too after a detach, 6,666 · 4 = 26,664 B. frozen_params
    counts the parameters that cannot get one by construction (``requires_grad=False``, or
    read only under no_grad: block 1 there), trainable_params the rest."""
    from graphflop.runtime.memory_probe import _loss_fn

    torch.manual_seed(0)
    model, x = _CutOff(cut), torch.randn(8, 32)
    _, run = _loss_fn(model, (x,), "auto")
    run().backward()
    with_grad = [p for p in model.parameters() if p.grad is not None]
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in with_grad)
    assert grad_bytes == {"no_grad": 18_216, "detach": 26_664}[cut]
    a = analyze(model, (x,), jvp=False, optimizer="momentum")
    m = a.report.memory
    assert m.grads_bytes == grad_bytes
    assert m.optimizer_state_bytes == grad_bytes  # one momentum buffer per gradient
    assert a.report.frozen_params == {"no_grad": 2_112, "detach": 0}[cut]
    assert a.report.trainable_params == 8_778 - a.report.frozen_params
    # kept gradients (zero_grad(set_to_none=False)): live from the start, the same ones
    # (before: every trainable parameter's, 1.09 of the measured peak; 0.99 now)
    from graphflop.runtime.memory_probe import measure_train_peak

    k = analyze(model, (x,), jvp=False, optimizer="momentum", keep_grads=True).report.memory
    measured = measure_train_peak(model, (x,), optimizer="momentum", keep_grads=True)
    assert abs(k.train_peak_bytes / measured - 1) < 0.03, (k.train_peak_bytes, measured)
