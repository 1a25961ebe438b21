"""The activity-perturbed step graph (graphflop/passes/activity_gradient.py): FLOPs counted by
hand, and its gradient estimate equal to graphflop.train.activity's for the same tangents."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphflop.frontend.trace import trace
from graphflop.meta import COST, FORWARD_GRADIENT, SIGNATURE
from graphflop.passes.activity_gradient import build_activity_gradient_step
from graphflop.passes.flops import annotate_flops
from graphflop.runtime.verify import real_arguments
from graphflop.train.activity import ActivityPerturbation


def _totals(gm):
    annotate_flops(gm)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    return tuple(
        sum(getattr(n.meta[COST], k) for n in ops) for k in ("flops", "mm_flops", "random_elements")
    )


def test_mlp_step_flops_by_hand():
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    fwd = trace(model, (torch.randn(4, 6),), loss="sum")
    # B = 4, 6 -> 5 -> 3, loss = sum of the logits, K = 1, SGD:
    # primal: addmm 2·4·6·5 + 4·5 = 260, relu 20, addmm 2·4·5·3 + 12 = 132, loss sum 12,
    #   per-example sum 12                                              = 436
    # tangent: relu mask 20 + mask·u0 20, W2·t 2·4·5·3 = 120, + u1 12,
    #   per-example sum 12                                              = 184
    # estimate d_b·u: 20 + 12                                           =  32
    # local grads: ĝ0ᵀx 2·5·4·6 = 240, Σ_b ĝ0 20, ĝ1ᵀh 2·3·4·5 = 120, Σ_b ĝ1 12 = 392
    # SGD: 2 per parameter, 2·(30 + 5 + 15 + 3)                         = 106
    # total 436 + 184 + 32 + 392 + 106 = 1150; mm: 240 + 120 (primal) + 120 + 240 + 120 = 840;
    # random numbers: one per layer-output element, 4·5 + 4·3 = 32 (weight perturbation: 53)
    assert _totals(build_activity_gradient_step(fwd)) == (1150, 840, 32)
    # K = 2: the tangent work again except the relu mask (a coefficient, shared): 184 − 20 =
    # 164; estimate 2·32 multiplies + 32 adds + 32 divides; 64 random numbers
    assert _totals(build_activity_gradient_step(fwd, directions=2)) == (
        1150 + 164 + 32 + 32 + 32,
        840 + 120,
        64,
    )


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 3 * 3, 4)
    )


def _mlp():
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))


@pytest.mark.parametrize(
    ("make", "shape"), [(_mlp, (8, 6)), (_cnn, (8, 2, 6, 6))], ids=["mlp", "cnn"]
)
@pytest.mark.parametrize("k", [1, 2])
def test_estimate_equals_train_activity(make, shape, k):
    torch.manual_seed(0)
    model = make()
    fwd = trace(model, (torch.randn(*shape),), loss="cross_entropy")
    step = build_activity_gradient_step(fwd, directions=k, direction_inputs=True)
    values = real_arguments(fwd, model, seed=1)
    sig = fwd.meta[SIGNATURE]
    x, y = values[sig.inputs[0]], values[sig.targets[0]]
    # the reference draws its tangents layer by layer, direction by direction, from its generator
    ref = ActivityPerturbation(model, torch.Generator().manual_seed(5))
    loss, grads = ref.estimate(x, y, k)
    shapes = [ref._shapes[q] for q, _ in ref.layers]
    gen = torch.Generator().manual_seed(5)
    u = {(i, j): torch.randn(s, generator=gen) for i in range(k) for j, s in enumerate(shapes)}
    args = []
    for name in step.meta[FORWARD_GRADIENT].inputs:
        if name == "lr":
            args.append(torch.tensor(1.0))
        elif name.startswith("u") and name not in values:
            i, _, j = name[1:].partition("_")
            args.append(u[(int(i), int(j))])
        else:
            args.append(values[name])
    out = step(*args)
    assert float(out[0]) == pytest.approx(loss, rel=1e-6)
    by_qual = dict(model.named_parameters())
    for (p, q), new in zip(sig.trainable(), out[1:]):
        # SGD with lr 1: the estimate is old − new
        torch.testing.assert_close(values[p] - new, grads[by_qual[q]], rtol=1e-4, atol=1e-5)


def test_a_parameter_outside_linear_and_conv_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    fwd = trace(model, (torch.randn(3, 4),))
    with pytest.raises(ValueError, match="Linear and Conv"):
        build_activity_gradient_step(fwd)


def test_a_shared_layer_adds_its_uses_gradients():
    # the same Linear applied twice: its weight gradient is the sum over both uses, each formed
    # locally from its own output's estimate; checked against the reverse-mode estimate for the
    # same tangents: d_b = Σ_l g_{l,b}·u_{l,b} with g_l = ∂L/∂z_l, ĝ_l = d u_l per use
    torch.manual_seed(0)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(torch.tanh(self.fc(x)))

    model = Twice()
    x = torch.randn(3, 4)
    fwd = trace(model, (x,), loss="sum")
    step = build_activity_gradient_step(fwd, direction_inputs=True)
    u = [torch.randn(3, 4), torch.randn(3, 4)]
    names = step.meta[FORWARD_GRADIENT].inputs
    values = {"lr": torch.tensor(1.0), "u0_0": u[0], "u0_1": u[1]}
    values[fwd.meta[SIGNATURE].inputs[0]] = x
    values.update({p: model.get_parameter(q).detach() for p, q in fwd.meta[SIGNATURE].params})
    out = step(*[values[n] for n in names])
    z1 = model.fc(x).detach().requires_grad_()
    h = torch.tanh(z1)
    z2 = model.fc(h)
    (g1, g2) = torch.autograd.grad(z2.sum(), (z1, z2))
    d = (g1 * u[0]).sum(1, keepdim=True) + (g2 * u[1]).sum(1, keepdim=True)
    e1, e2 = d * u[0], d * u[1]
    want_w = e1.T @ x + e2.T @ h.detach()
    torch.testing.assert_close(model.fc.weight.detach() - out[1], want_w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("conv", "shape"),
    [(nn.Conv1d(2, 3, 2), (4, 2, 8)), (nn.Conv3d(2, 3, 1), (4, 2, 4, 4, 4))],
    ids=["conv1d", "conv3d"],
)
def test_a_convolution_other_than_2d_is_refused(conv, shape):
    # the weight gradient is formed for Conv2d only (as graphflop.train.activity does); a
    # Conv3d followed by pooling had crashed the whole analysis (permute of a 5-D tensor)
    model = nn.Sequential(conv, nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(*shape))
    fwd = trace(model, (torch.randn(*shape),), loss="cross_entropy")
    with pytest.raises(ValueError, match="not 2-D"):
        build_activity_gradient_step(fwd)


def test_a_failing_pass_logs_no_traceback(monkeypatch):
    # FakeTensorMode logs a kernel's traceback before re-raising; analyze raises the error
    # alone (the CLI turns it into one line)
    import logging

    import graphflop.passes.activity_gradient as ag
    from graphflop.analysis import analyze

    def bad(b, lay, op, x, est):
        return {lay.weight: b.call(torch.ops.aten.permute.default, x, [1, 0, 2, 3])}

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(handler)
    monkeypatch.setattr(ag, "_layer_grads", bad)
    try:
        with pytest.raises(RuntimeError, match="permute"):
            analyze(
                nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), (torch.randn(4, 6),)
            )
    finally:
        logger.removeHandler(handler)
    assert records == []


class _TiedLM(nn.Module):
    """An embedding and a head sharing one weight (every parameter is a Linear's), the loss
    over tokens: per-token terms, [2·5] rows, not per example."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_token_level_loss_is_refused_not_a_crash():
    """A tester's finding: the tied model passed the Linear-only check, and separating its
    loss per example raised a broadcast error out of ``analyze`` (internal error). It is
    refused (the step is left out) and the rest of the analysis stands."""
    from graphflop.analysis import analyze
    from graphflop.passes.activity_gradient import NotPerturbable

    ids = torch.randint(0, 11, (2, 5))
    gm = annotate_flops(trace(_TiedLM(), (ids,)))
    with pytest.raises(NotPerturbable, match="per-example terms could not be kept apart"):
        build_activity_gradient_step(gm)
    a = analyze(_TiedLM(), ids)
    assert a.activity_gradient is None and a.forward_gradient is not None
