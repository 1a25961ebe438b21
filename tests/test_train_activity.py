"""Activity-perturbed forward gradients (``--perturb activations``, Ren et al. 2023;
:mod:`graphflop.train.activity`): local weight gradients, the estimator against its theory, and
training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import spec

from graphflop.train.activity import ActivityPerturbation, local_weight_grads
from graphflop.train.config import TrainConfig, TrainError
from graphflop.train.data import load_dataset
from graphflop.train.loop import train
from graphflop.train.model import build_model


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _autograd(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return {p: p.grad.clone() for p in model.parameters()}


@pytest.mark.parametrize("name,kw", [("mlp.py", {"hidden": 32}), ("cnn.py", {})])
def test_exact_activity_gradients_give_backprops_weight_gradients(digits, name, kw):
    model, _, _ = build_model(spec(name), digits, seed=0, ctor_kwargs=kw)
    x, y = digits.x_train[:16], digits.y_train[:16]
    true = _autograd(model, x, y)
    ap = ActivityPerturbation(model, torch.Generator())
    seen = {}

    def keep(q):
        def hook(m, args, out):
            out.retain_grad()
            seen[q] = (args[0].detach(), out)

        return hook

    hooks = [m.register_forward_hook(keep(q)) for q, m in ap.layers]
    F.cross_entropy(model(x), y).backward()
    for h in hooks:
        h.remove()
    local = local_weight_grads(
        ap.layers, {q: v[0] for q, v in seen.items()}, {q: v[1].grad for q, v in seen.items()}
    )
    assert set(local) == set(true)
    for p, g in true.items():
        torch.testing.assert_close(local[p], g, rtol=1e-4, atol=1e-6)


def test_logreg_estimate_is_unbiased_with_the_per_example_variance(digits):
    # one layer z_b = W x_b + c (10 outputs per example), per-example tangent u_b ~ N(0, I_10):
    # ĝ_b = (g_b·u_b) u_b has E‖ĝ_b − g_b‖² = (10 + 1)‖g_b‖² (Isserlis), independent over b, so
    # the weight-and-bias estimate Σ_b ĝ_b [x_b, 1]ᵀ errs by 11 Σ_b ‖g_b‖² (‖x_b‖² + 1)
    model, _, _ = build_model(spec("logreg.py"), digits, seed=0)
    x, y = digits.x_train[:32], digits.y_train[:32]
    true = _autograd(model, x, y)
    logits = model(x).detach()
    g_b = (logits.softmax(1) - F.one_hot(y, 10)) / len(y)  # ∂(mean CE)/∂z_b
    theory = 11 * float((g_b.pow(2).sum(1) * (x.flatten(1).pow(2).sum(1) + 1)).sum())
    gsq = sum(float(g.pow(2).sum()) for g in true.values())
    ap = ActivityPerturbation(model, torch.Generator().manual_seed(0))
    n, err = 600, 0.0
    mean = {p: torch.zeros_like(g) for p, g in true.items()}
    for _ in range(n):
        loss, est = ap.estimate(x, y)
        err += sum(float((est[p] - g).pow(2).sum()) for p, g in true.items())
        for p in mean:
            mean[p] += est[p] / n
    assert loss == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)
    assert err / n == pytest.approx(theory, rel=0.2)
    bias = sum(float((mean[p] - g).pow(2).sum()) for p, g in true.items())
    assert bias < 16 * theory / n  # within 4 standard errors of the true gradient
    assert theory / gsq < 651  # far below weight perturbation's (n + 1) with n = 650


def test_activity_perturbed_training_lowers_the_loss(digits):
    c = TrainConfig(method="fgd", perturb="activations", optimizer="sgd", lr=0.05, steps=40)
    r = train(spec("logreg.py"), digits, TrainConfig(**{**c.__dict__, "eval_every": 40}))
    assert r.summary["perturb"] == "activations"
    assert r.summary["final_val_loss"] < 0.8 * r.summary["initial_val_loss"]


@pytest.mark.parametrize(
    "kw",
    [
        dict(method="backprop", perturb="activations"),
        dict(method="fgd", perturb="activations", runtime="onnxruntime"),
        dict(method="fgd", perturb="activations", orthogonal=True),
    ],
)
def test_activity_perturbation_options_are_checked(kw):
    with pytest.raises(TrainError, match="--perturb activations is forward-gradient training"):
        TrainConfig(**kw)
    with pytest.raises(TrainError, match="unknown perturbation 'inputs'"):
        TrainConfig(method="fgd", perturb="inputs")


def test_a_parameter_outside_linear_and_conv_layers_is_refused(digits):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 10))
    c = TrainConfig(method="fgd", perturb="activations", steps=1, eval_every=0)
    with pytest.raises(TrainError, match="1.weight belongs to another module"):
        train(model, digits, c)


def test_local_loss_estimate_equals_an_autograd_reference(digits):
    # Ren et al. 2023 local losses: blocks cut by a stop-gradient, each with a linear head.
    # Reference by reverse mode: each block's exact activity gradient g_l = ∂L_l/∂z_l of its
    # own local loss, then the estimate for the same tangents, ĝ_{l,b} = (g_{l,b}·u_{l,b}) u_{l,b}
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 10)
    )
    x, y = digits.x_train[:16], digits.y_train[:16]
    ap = ActivityPerturbation(model, torch.Generator().manual_seed(3), local_losses=True)
    loss, grads = ap.estimate(x, y)
    gen = torch.Generator().manual_seed(3)
    us = [torch.randn(16, n, generator=gen) for n in (16, 12, 10)]
    lin = [model[1], model[3], model[5]]
    acts = [torch.relu, torch.tanh]
    h = x.flatten(1)
    want = {}
    for i, layer in enumerate(lin):
        z = layer(h.detach()).detach().requires_grad_()
        if i < 2:
            out = acts[i](z)
            local = F.cross_entropy(ap.heads[i](out), y)
            head_g = torch.autograd.grad(local, list(ap.heads[i].parameters()), retain_graph=True)
            want.update(zip(ap.heads[i].parameters(), head_g))
        else:
            out = z
            local = F.cross_entropy(z, y)
            assert loss == pytest.approx(float(local.detach()), rel=1e-6)
        (g,) = torch.autograd.grad(local, z)
        est = (g * us[i]).sum(1, keepdim=True) * us[i]
        want[layer.weight] = est.T @ h.detach()
        want[layer.bias] = est.sum(0)
        h = out.detach()
    assert set(grads) == set(want)
    for p, g in want.items():
        torch.testing.assert_close(grads[p], g, rtol=1e-4, atol=1e-6)


def test_local_losses_training_lowers_the_loss(digits):
    c = TrainConfig(
        method="fgd",
        perturb="activations",
        local_losses=True,
        optimizer="sgd",
        lr=0.1,
        steps=60,
        eval_every=60,
        ctor_kwargs={"hidden": 32},
    )
    r = train(spec("mlp.py"), digits, c)
    assert r.summary["local_losses"] is True
    assert r.summary["final_val_loss"] < 0.8 * r.summary["initial_val_loss"]


def test_local_losses_need_activity_perturbation():
    with pytest.raises(TrainError, match="--local-losses is an option of --perturb activations"):
        TrainConfig(method="fgd", local_losses=True)


def test_a_layer_applied_twice_is_refused(digits):
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)
            self.out = torch.nn.Linear(64, 10)

        def forward(self, x):
            return self.out(self.fc(torch.tanh(self.fc(x.flatten(1)))))

    ap = ActivityPerturbation(Twice(), torch.Generator())
    with pytest.raises(TrainError, match="fc is applied more than once"):
        ap.estimate(digits.x_train[:8], digits.y_train[:8])
