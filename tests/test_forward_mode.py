"""Forward mode: JVP FLOPs, memory without residuals, and the forward-gradient estimator."""

from __future__ import annotations

import torch
from conftest import analysis, layer
from torch import nn

from graphflop.ad.jvp import build_jvp
from graphflop.ad.vjp import build_vjp
from graphflop.analysis import analyze
from graphflop.frontend.trace import trace
from graphflop.meta import COST, FORWARD_GRADIENT, JVP, KIND, SIGNATURE
from graphflop.passes.flops import annotate_flops
from graphflop.passes.forward_gradient import build_forward_gradient_step
from graphflop.runtime.verify import real_arguments, run_backward, run_forward, run_jvp


def test_mlp_jvp_flops_hand_worked():
    B = 64
    s = analysis("mlp.py", B).to_dict()
    fc1, fc2, out = (layer(s, f"layers.{n}") for n in ("fc1", "fc2", "out"))
    # weight perturbation: a Linear's tangent is x·dWᵀ (+ db) for the first layer and
    # dx·Wᵀ + x·dWᵀ + db for later ones; each product is 2·B·in·out, each add B·out
    assert fc1["jvp_flops"] == 2 * B * 784 * 1024 + B * 1024  # x·dWᵀ, + db
    assert fc2["jvp_flops"] == 2 * (2 * B * 1024 * 1024) + 2 * B * 1024
    assert out["jvp_flops"] == 2 * (2 * B * 1024 * 10) + 2 * B * 10
    # the tangents over the forwards: (2·B·784·1024 + B·1024) / (2·B·784·1024 + B·1024) and
    # 2·(2·B·1024·1024 + B·1024) / (2·B·1024·1024 + B·1024), exactly 1 and 2
    assert fc1["jvp_ratio"] == 1.0 and fc2["jvp_ratio"] == 2.0
    # ReLU: a mask (1 per element) and a multiply (1 per element)
    assert layer(s, "layers.relu1")["jvp_flops"] == 2 * B * 1024
    # the first layer's input tangent is a symbolic zero: dx·Wᵀ is skipped, and recorded
    assert fc1["jvp_skipped_flops"] == 2 * B * 784 * 1024
    assert s["totals"]["jvp"]["skipped_flops"] == 2 * B * 784 * 1024


def test_jvp_and_train_peaks_of_the_mlp_hand_worked():
    B = 64
    s = analysis("mlp.py", B).to_dict()
    m, n = s["memory"], s["params"]
    assert n == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10  # 1,863,690
    # Training, eager model: gradients appear as the backward makes them and SGD
    # updates in place. Peak at fc1's weight gradient, the last one: parameters and all
    # gradients (2 · 4 B · n), the input x (B·784 fp32, saved) and fc1's output gradient
    # (B·1024 fp32). (Measured eager CPU step: 520 B more, the loss's scalars.)
    assert m["train_peak_bytes"] == 2 * 4 * n + 4 * B * 784 + 4 * B * 1024
    # JVP, eager model (torch.func.jvp: a value and its tangent are one dual tensor, freed
    # together): parameters and their tangents always live, 2 · 4 B · n. Peak while computing
    # fc2's weight term r1·dW2ᵀ: the int64 targets (8·B), relu1's output r1, its tangent dr1
    # (kept while r1 is read), fc2's primal output, dr1·W2ᵀ and r1·dW2ᵀ, each B·1024 fp32.
    assert m["jvp_peak_bytes"] == 2 * 4 * n + 8 * B + 5 * (4 * B * 1024)
    # so the eager JVP peaks above the eager train step here: 16·B·1024 + 8·B − 4·B·784
    assert m["jvp_peak_bytes"] - m["train_peak_bytes"] == 16 * B * 1024 + 8 * B - 4 * B * 784


def test_jvp_peak_of_the_cnn_hand_worked():
    B = 64
    s = analysis("cnn.py", B).to_dict()
    m, n = s["memory"], s["params"]
    assert n == 1 * 64 * 9 + 64 + 3 * (64 * 64 * 9 + 64) + 3136 * 1024 + 1024 + 1024 * 10 + 10
    # Eager model: parameters and tangents (2 · 4 B · n) and, while computing conv2's weight
    # term conv(r1, dW2): the int64 targets (8·B), relu1's output r1 and its tangent dr1 (one
    # dual tensor), conv2's primal output, conv(dr1, W2), conv(r1, dW2) and the oneDNN
    # kernel's output-sized buffer, each B·64·28·28 fp32 (torch.func.jvp measured: the same 6),
    # and beside them the kernel's reordered weight, 64·64·3·3 fp32 (the CPU convolution's
    # forward stage: eager_memory's kernel temporaries; docs/memory.md's CNN b64 JVP row,
    # 0.998 of the measured peak with it, 0.996 without)
    assert m["jvp_peak_bytes"] == 2 * 4 * n + 8 * B + 6 * (4 * B * 64 * 28 * 28) + 4 * 64 * 64 * 9
    # eagerly the JVP peaks above the training step (not hand-worked here), as measured on CPU
    # (torch.func.jvp 99.3 MiB, train step 86.9 MiB: docs/memory.md)
    assert m["jvp_peak_bytes"] > m["train_peak_bytes"]


def test_jvp_peak_of_a_linear_stack_hand_worked():
    B = 16
    stack = nn.Sequential(nn.Linear(8, 32, bias=False), nn.Linear(32, 4, bias=False))
    a = analyze(stack, (torch.randn(B, 8),), loss="sum", backward=False)
    # Always live: W1, W2 and their tangents: 2 · 4 B · (8·32 + 32·4) = 3,072 bytes.
    # Schedule (tangents of the weights only; eager model: h and dh are one dual tensor, freed
    # together; mm's tangent formula dx·W1ᵀ + x·dW1ᵀ multiplies the input's missing tangent
    # as zeros, and its partial results live until the formula ends):
    #   h = x·W1ᵀ (B·32); z = 0·W1ᵀ (B·32), p = x·dW1ᵀ (B·32), dh = z + p (B·32)  — x dies
    #   y = h·W2ᵀ (B·4), t1 = dh·W2ᵀ (B·4), t2 = h·dW2ᵀ (B·4), t1 + t2 (B·4)
    # Live while dh is made: x, h, z, p, dh = B·(8 + 4·32), the peak (the second layer's
    # h, dh, y and three tangent-sized tensors are smaller). torch.func.jvp measures the same
    # (11,776 B; tests/test_memory_jvp.py).
    m = a.to_dict()["memory"]
    assert m["jvp_peak_bytes"] == 3072 + 4 * B * (8 + 4 * 32)


def test_forward_gradient_step_flops_and_directions():
    a = analysis("mlp.py", 8)
    s = a.to_dict()["totals"]
    n = a.to_dict()["params"]
    fg = s["forward_gradient_step"]
    # one step = primal + tangent + g = d·v (n multiplies) + SGD update (2n); n random numbers
    assert fg["flops"] == s["forward"]["flops"] + s["jvp"]["flops"] + n + 2 * n
    assert fg["random_elements"] == n
    k4 = annotate_flops(build_forward_gradient_step(a.forward, directions=4))
    f4 = sum(x.meta[COST].flops for x in k4.graph.nodes)
    # K directions share the primal and the coefficients (ReLU masks, ...): only the tangent
    # nodes repeat; g takes K multiplies, K−1 adds and one divide per parameter element
    kinds = {"tangent": 0, "coef": 0}
    for x in a.jvp.graph.nodes:
        if x.meta.get(KIND) in kinds:
            kinds[x.meta[KIND]] += x.meta[COST].flops
    assert kinds["tangent"] + kinds["coef"] == s["jvp"]["flops"]
    assert f4 == (
        s["forward"]["flops"] + kinds["coef"] + 4 * kinds["tangent"] + (4 + 3 + 1) * n + 2 * n
    )


def _small_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    fwd = trace(model, (torch.randn(4, 6, dtype=torch.float64),), loss="sum")
    values = real_arguments(fwd, model)
    return model, fwd, values


def test_forward_gradient_is_unbiased():
    model, fwd, values = _small_problem()
    sig = fwd.meta[SIGNATURE]
    grads = run_backward(build_vjp(fwd), run_forward(fwd, values))
    true = torch.cat([g.flatten() for g in grads])
    n = true.numel()  # 53 parameters
    jvp = build_jvp(fwd, "params")
    info = jvp.meta[JVP]
    M = 4000
    gen = torch.Generator().manual_seed(1)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(M):
        v = {
            p: torch.randn(values[p].shape, generator=gen, dtype=torch.float64)
            for _, p in info.tangent_inputs
        }
        d = run_jvp(jvp, values, v)[info.primal_outputs]
        total += d * torch.cat([v[p].flatten() for p, _ in sig.params])
    est = total / M
    # E‖ḡ − ∇L‖² = (n + 1)‖∇L‖² / M for Gaussian v (E‖g‖² = (n + 2)‖∇L‖²); allow 3× that
    err2 = float((est - true).pow(2).sum())
    bound = 3 * (n + 1) * float(true.pow(2).sum()) / M
    assert err2 < bound, (err2, bound)
    # and the estimator is not trivially close: one direction alone is far off
    assert (
        float((d * torch.cat([v[p].flatten() for p, _ in sig.params]) - true).pow(2).sum()) > err2
    )


def test_forward_gradient_step_runs_sgd_on_the_estimate():
    model, fwd, values = _small_problem()
    sig = fwd.meta[SIGNATURE]
    step = build_forward_gradient_step(fwd, "sgd", direction_inputs=True)
    info = step.meta[FORWARD_GRADIENT]
    gen = torch.Generator().manual_seed(2)
    v = {p: torch.randn(values[p].shape, generator=gen, dtype=torch.float64) for p, _ in sig.params}
    args = []
    for name in info.inputs:
        if name == "lr":
            args.append(torch.tensor(0.1))
        elif name.startswith("v0_"):
            args.append(v[name[3:]])
        else:
            args.append(values[name])
    out = step(*args)
    d = out[-1]
    ref_d = torch.func.jvp(
        lambda p: torch.func.functional_call(model, p, (values[sig.inputs[0]],)).sum(),
        ({q: values[p] for p, q in sig.params},),
        ({q: v[p] for p, q in sig.params},),
    )[1]
    assert torch.allclose(d, ref_d, rtol=1e-10)
    for i, (p, _) in enumerate(sig.params):
        assert torch.allclose(out[1 + i], values[p] - 0.1 * d * v[p], rtol=1e-10)
