"""``--directions K``: one batched tangent pass (tangents with a leading K dimension) instead of
K copies of the tangent nodes; same FLOPs, fewer nodes, same values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphflop.passes.forward_gradient as fgmod
from graphflop.frontend.trace import trace
from graphflop.meta import COST, FORWARD_GRADIENT, KIND, SIGNATURE
from graphflop.passes.flops import annotate_flops
from graphflop.passes.forward_gradient import build_forward_gradient_step
from graphflop.runtime.verify import real_arguments

aten = torch.ops.aten
K = 3


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    return model, trace(model, (torch.randn(4, 6, dtype=torch.float64),), loss="sum")


def _conv_bn():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)
    ).double()
    return model, trace(model, (torch.randn(2, 2, 4, 4, dtype=torch.float64),))


class _TwoBranches(nn.Module):
    """Two tangents of equal metadata added (a·w1 + a·w2 shapes alike): their nodes share one
    FakeTensor (the builder's shape cache), which the batched pass once traced as add(b, b)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.w1 = nn.Parameter(torch.randn(4))
        self.w2 = nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = self.conv(x).transpose(1, 3)
        return (h * self.w1 + (h * 2) * self.w2).flatten(1)[:, :3]


def _two_branches():
    torch.manual_seed(0)
    model = _TwoBranches().double()
    return model, trace(model, (torch.randn(2, 2, 4, 4, dtype=torch.float64),))


def _bicubic():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.Upsample(scale_factor=2, mode="bicubic"),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 3),
    ).double()
    return model, trace(model, (torch.randn(2, 2, 4, 4, dtype=torch.float64),))


def _flops(gm):
    annotate_flops(gm)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    return (
        sum(n.meta[COST].flops for n in ops),
        sum(n.meta[COST].mm_flops for n in ops),
        sum(n.meta[COST].random_elements for n in ops),
    )


@pytest.mark.parametrize("make", [_mlp, _conv_bn], ids=["mlp", "conv_bn"])
def test_batched_step_has_the_flops_of_k_copies_and_fewer_nodes(make):
    _, fwd = make()
    one = build_forward_gradient_step(fwd, directions=1)
    copies = build_forward_gradient_step(fwd, directions=K, batched=False)
    batched = build_forward_gradient_step(fwd, directions=K)
    assert batched.meta[FORWARD_GRADIENT].tangent_pass == "one batched tangent pass"
    assert copies.meta[FORWARD_GRADIENT].tangent_pass.startswith("copies")
    f1, fc, fb = _flops(one), _flops(copies), _flops(batched)
    assert fb == fc
    # independently of the copy path: the K = 1 step's tangent FLOPs K times, its direction
    # FLOPs (n multiplies for g = d·v) become K multiplies + (K−1) adds + 1 divide per element,
    # K·n random numbers
    n = sum(p.numel() for p in make()[0].parameters())

    def by_kind(gm, kind):
        return sum(x.meta[COST].flops for x in gm.graph.nodes if x.meta.get(KIND) == kind)

    assert by_kind(batched, "tangent") == K * by_kind(one, "tangent")
    assert fb[0] == f1[0] + (K - 1) * by_kind(one, "tangent") + (K + (K - 1) + 1 - 1) * n
    assert fb[2] == K * f1[2] == K * n


@pytest.mark.parametrize("make", [_mlp, _conv_bn], ids=["mlp", "conv_bn"])
def test_the_batched_tangent_pass_does_not_grow_with_k(make):
    _, fwd = make()

    def tangent_nodes(gm):
        return sum(1 for x in gm.graph.nodes if x.meta.get(KIND) == "tangent")

    b4, b8 = (build_forward_gradient_step(fwd, directions=k) for k in (4, 8))
    c4 = build_forward_gradient_step(fwd, directions=4, batched=False)
    c1 = build_forward_gradient_step(fwd, directions=1)
    assert tangent_nodes(b4) == tangent_nodes(b8)  # one pass, whatever K
    assert tangent_nodes(c4) == 4 * tangent_nodes(c1)  # K copies
    assert len(b8.graph.nodes) < len(
        build_forward_gradient_step(fwd, directions=8, batched=False).graph.nodes
    )
    assert len(b4.graph.nodes) < len(c4.graph.nodes)


@pytest.mark.parametrize(
    "make",
    [_mlp, _conv_bn, _two_branches, _bicubic],
    ids=["mlp", "conv_bn", "two_branches", "bicubic"],
)
def test_batched_step_computes_the_same_values_as_copies(make):
    model, fwd = make()
    values = real_arguments(fwd, model)
    sig = fwd.meta[SIGNATURE]
    gen = torch.Generator().manual_seed(3)
    v = {
        (k, p): torch.randn(values[p].shape, generator=gen, dtype=torch.float64)
        for k in range(K)
        for p, _ in sig.trainable()
    }
    outs = []
    for batched in (False, True):
        step = build_forward_gradient_step(
            fwd, directions=K, direction_inputs=True, batched=batched
        )
        info = step.meta[FORWARD_GRADIENT]
        args = []
        for name in info.inputs:
            if name == "lr":
                args.append(torch.tensor(0.1, dtype=torch.float64))
            elif (
                name.startswith("v") and name.partition("_")[0][1:].isdigit() and name not in values
            ):
                k, _, p = name.partition("_")
                args.append(v[(int(k[1:]), p)])
            else:
                args.append(values[name])
        outs.append(step(*args))
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # and each directional derivative is torch.func.jvp's along its direction
    params = {q: values[p] for p, q in sig.trainable()}
    x = values[sig.inputs[0]]
    m = model.train()
    buffers = {q: values[p].clone() for p, q in sig.buffers}
    targets = [values[t] for t in sig.targets]
    from graphflop.frontend.trace import loss_value
    from graphflop.meta import LOSS_KIND

    def loss(p):
        out = torch.func.functional_call(
            m, {**p, **{k: b.clone() for k, b in buffers.items()}}, (x,)
        )
        return loss_value(fwd.meta.get(LOSS_KIND, "sum"), out, targets)

    for k in range(K):
        ref = torch.func.jvp(loss, (params,), ({q: v[(k, p)] for p, q in sig.trainable()},))[1]
        torch.testing.assert_close(info.derivatives(outs[1])[k], ref, rtol=1e-9, atol=1e-12)


def test_an_op_the_batching_cannot_take_is_copied_per_direction(monkeypatch):
    _, fwd = _mlp()
    # refuse vmap's form of the matrix products (view, mm, view): they are traced as K
    # select-ed copies and stacked instead
    real = fgmod._traceable

    def has(g, op):
        return any(n.target is op for n in g.nodes)

    monkeypatch.setattr(
        fgmod,
        "_traceable",
        lambda g: real(g) and not (has(g, aten.mm.default) and not has(g, aten.select.int)),
    )
    step = build_forward_gradient_step(fwd, directions=K)
    how = step.meta[FORWARD_GRADIENT].tangent_pass
    assert how.startswith("one batched tangent pass; K copies of ") and "aten.mm" in how
    assert _flops(step) == _flops(build_forward_gradient_step(fwd, directions=K, batched=False))


class _MaskedScatter(nn.Module):
    """A Linear's output scattered into zeros at a mask: ``masked_scatter`` has no batching
    rule in functorch (PyTorch 2.13), so vmap would run its slow per-slice fallback."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        m = torch.arange(12).reshape(2, 6) % 3 == 0  # 4 set elements: fc's first 4 outputs
        return torch.zeros(2, 6, dtype=x.dtype).masked_scatter(m, self.fc(x))


def test_an_op_without_a_batching_rule_is_copied_without_raw_warnings(capfd):
    torch.manual_seed(0)
    model = _MaskedScatter().double()
    fwd = trace(model, (torch.randn(2, 4, dtype=torch.float64),), loss="sum")
    capfd.readouterr()
    step = build_forward_gradient_step(fwd, directions=K)
    # the fallback detected: masked_scatter traced as K copies, and named (before: "one
    # batched tangent pass", the fallback's warning printed to stderr and never detected)
    assert step.meta[FORWARD_GRADIENT].tangent_pass == (
        "one batched tangent pass; K copies of aten.masked_scatter.default"
    )
    # no raw C++ line on file descriptor 2 (functorch's "[W... BatchedFallback.cpp:82]
    # Warning: There is a performance drop because we have not yet implemented the batching
    # rule for aten::masked_scatter")
    err = capfd.readouterr().err
    assert "batching rule" not in err and "BatchedFallback" not in err, err
    assert _flops(step) == _flops(build_forward_gradient_step(fwd, directions=K, batched=False))


def test_a_failing_batched_pass_falls_back_to_copies(monkeypatch):
    _, fwd = _mlp()

    def fail(*a, **k):
        raise RuntimeError("no batching here")

    monkeypatch.setattr(fgmod._Batcher, "run", fail)
    step = build_forward_gradient_step(fwd, directions=K)
    assert step.meta[FORWARD_GRADIENT].tangent_pass == (
        "copies: the batched pass failed (RuntimeError: no batching here)"
    )
    assert _flops(step) == _flops(build_forward_gradient_step(fwd, directions=K, batched=False))
