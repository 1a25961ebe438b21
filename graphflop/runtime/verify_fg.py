"""The ``--verify`` forward-gradient check: a χ² test that the forward-gradient step's estimate
is unbiased, its directions batched into a few steps (:func:`verify_forward_gradient`; one
direction per step for a graph with a data-dependent size, :func:`data_dependent`)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.fx import GraphModule

from graphflop.meta import FORWARD_GRADIENT, SIGNATURE, VJP, Signature
from graphflop.passes.forward_gradient import data_dependent
from graphflop.runtime.verify import (
    Check,
    _dtype_name,
    backward_reads,
    gradient_floor,
    loss_magnitude,
    loss_scale,
    loss_terms_name,
    nonfinite,
    real_arguments,
    run_backward,
    run_forward,
    seeded,
)

#: the forward-gradient check's false-alarm rate (two-sided χ² test)
FG_ALPHA = 1e-6
#: bytes the batched directions of one forward-gradient step may take (tangents of the
#: parameters and of every forward value, as an upper bound)
FG_BATCH_BYTES = 1 << 30


def verify_forward_gradient(
    forward: GraphModule,
    model: nn.Module,
    *,
    samples: int = 128,
    seed: int = 0,
    examples: tuple[torch.Tensor, ...] | None = None,
) -> Check:
    """Statistical check that the forward-gradient step estimates the gradient without bias.

    Runs the step graph (SGD, lr = 1) with ``K`` Gaussian directions per step given as inputs
    (one batched tangent pass; as many steps as ``samples`` directions need, ``K`` chosen so a
    step's tangents fit :data:`FG_BATCH_BYTES`, ``K = 1`` for a graph whose sizes depend on
    values (:func:`data_dependent`), all from the same generator state so dropout masks are
    the reference's), so ``w − w_new`` is the step's estimate
    ``ḡ = (1/K) Σ (∇L·v_k) v_k``, and compares the mean of the estimates with the backward
    graph's gradient ``∇L`` along ``u = ∇L/‖∇L‖``. For Gaussian ``v``, ``u·(∇L·v) v =
    ‖∇L‖ (u·v)²`` with ``u·v ~ N(0, 1)``, so for ``M`` directions ``T = M · u·ḡ/‖∇L‖`` is
    exactly χ²-distributed with ``M`` degrees of freedom when the step is right, whatever the
    parameter count. Test: two-sided, pass when ``T`` lies between the χ²_M quantiles
    ``α/2`` and ``1 − α/2``, ``α =`` :data:`FG_ALPHA` (the false-alarm rate). ``worst_rel_error``
    reports ``|u·ḡ/‖∇L‖ − 1|`` and ``tolerance`` the half-width of the acceptance interval on
    that side. The check has power against a wrong scale: with ``M = 100`` a factor outside
    about [0.55, 1.6] fails. A NaN or infinity in the estimate fails the check (infinite
    error); one in the gradient makes it not comparable (``Check.comparable``). ``examples``: the model's example inputs (:func:`real_arguments`).
    """
    from scipy.stats import chi2

    from graphflop.ad.vjp import build_vjp
    from graphflop.passes.forward_gradient import build_forward_gradient_step

    name = f"forward-gradient estimate unbiased over {samples} directions"
    values = real_arguments(forward, model, seed=seed, examples=examples)
    sig: Signature = forward.meta[SIGNATURE]
    if not sig.trainable() or samples < 1:
        return Check(name, 0.0, "no parameters: nothing to estimate", 1.0)
    backward = build_vjp(forward)
    assert sig.loss is not None, "build_vjp refuses a forward graph without a loss"
    with seeded():
        fwd_values = run_forward(
            forward, values, backward_reads(backward) | {loss_terms_name(forward)}
        )
    grads = run_backward(backward, fwd_values)
    # the parameters' gradients (not those of leaves the model made, which follow them)
    true = torch.cat([grads[pos].flatten() for pos, _ in backward.meta[VJP].grads]).double()
    steps = -(-samples // _directions_per_step(forward, samples))
    k = -(-samples // steps)  # the directions spread evenly: M = steps · K ≥ samples
    m = steps * k
    step = build_forward_gradient_step(forward, "sgd", directions=k, direction_inputs=True)
    info = step.meta[FORWARD_GRADIENT]
    trainable = [p for p, _ in sig.trainable()]
    w = torch.cat([values[p].flatten() for p in trainable]).double()
    gen = torch.Generator().manual_seed(seed + 2)
    total = torch.zeros_like(true)
    for _ in range(steps):
        args = []
        for n in info.inputs:
            if n == "lr":
                args.append(torch.tensor(1.0, dtype=torch.float32))
            elif n in values:
                args.append(values[n])
            else:  # v{k}_<param>: a Gaussian direction
                ref = values[n.partition("_")[2]]
                args.append(torch.randn(ref.shape, generator=gen, dtype=ref.dtype))
        with seeded():
            out = step(*args)
        new_w = torch.cat([t.flatten() for t in out[1 : 1 + len(trainable)]]).double()
        total += w - new_w
    bad = nonfinite(total, true)
    if not true.isfinite().all():
        # the gradient the estimate is tested against is not finite (graphflop's backward,
        # which the gradient check compares with PyTorch's): no test can be made
        return Check(
            name,
            math.nan,
            f"the gradient the estimate is tested against is NaN or inf at "
            f"{int((~true.isfinite()).sum()):,} of its {true.numel():,} elements (see the "
            "gradient check)",
            1e-6,
            comparable=False,
        )
    if bad:
        return Check(name, math.inf, bad, 1e-6)
    norm = float(true.norm())
    if norm == 0.0:  # no parameter reaches the loss (a detached model): the estimate is 0 too
        worst = float(total.abs().max()) / steps
        return Check(name, worst, "‖∇L‖ = 0: the loss does not depend on the parameters", 1e-6)
    # FLOOR_ULPS·eps·Σ|ℓ|/‖p‖: a gradient made of rounding errors (the gradient check's floor)
    scale = loss_scale(loss_magnitude(forward, fwd_values), [values[p] for p in trainable])
    noise = gradient_floor(values[trainable[0]].dtype, scale, 1.0)
    if norm <= noise:
        # the gradient is rounding noise (a loss constant in exact arithmetic): so is the
        # estimate, and the ratio u·ḡ/‖∇L‖ means nothing. Each direction's term (∇L·v)v has a
        # norm of about ‖∇L‖·√n (n parameters), so the estimate must stay within 10·noise·√n
        worst = float((total / steps).norm()) / (noise * math.sqrt(w.numel()))
        return Check(
            name,
            worst,
            f"‖∇L‖ = {norm:.1e} is rounding noise (≤ {noise:.1e}): the loss does not depend on "
            "the parameters; ‖ḡ‖ compared with noise·√n",
            10.0,
        )
    ratio = float((total / steps) @ true) / max(norm * norm, 1e-300)
    lo = float(chi2.ppf(FG_ALPHA / 2, m)) / m
    hi = float(chi2.ppf(1 - FG_ALPHA / 2, m)) / m
    return Check(
        name,
        abs(ratio - 1.0),
        f"u·ḡ/‖∇L‖ = {ratio:.3f}, {steps} step{'s' if steps > 1 else ''} of {k}",
        (hi - 1.0) if ratio >= 1.0 else (1.0 - lo),
        f"χ²_{m} test (false-alarm rate {FG_ALPHA:.0e}), |u·ḡ/‖∇L‖ − 1| =",
        _dtype_name(values[trainable[0]].dtype),
    )


def _directions_per_step(forward: GraphModule, samples: int) -> int:
    """Directions per step: as many as fit :data:`FG_BATCH_BYTES` (one direction's tangents are
    at most the parameters' and every forward value's bytes), at most ``samples``; one when the
    graph has a data-dependent size (:func:`data_dependent`)."""
    if data_dependent(forward):  # K > 1 would be K copies of the tangent pass: one each
        return 1
    per = 0
    for n in forward.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            per += v.numel() * v.element_size()
    return max(1, min(samples, FG_BATCH_BYTES // max(per, 1)))
