"""The forward-gradient estimator's variance around the true gradient, per number of
directions ``K`` (:func:`estimator_variance`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphflop.frontend.trace import loss_value
from graphflop.meta import FORWARD_GRADIENT, KIND, SIGNATURE, Signature
from graphflop.runtime.graphs import forward_gradient_graph
from graphflop.train.data import Dataset, load_dataset
from graphflop.train.model import build_model, trace_forward
from graphflop.train.runners import FxRunner, direction_index, draw_directions


def theory_relative(n: int, k: int, distribution: str = "normal", orthogonal: bool = False):
    """``E‖ĝ − ∇L‖² / ‖∇L‖²`` of the ``K``-direction estimate ``ĝ = (1/K) Σ (∇L·v_k) v_k``
    with ``n`` parameters.

    Independent Gaussian ``v``: ``E‖(g·v)v‖² = (n + 2)‖g‖²`` (Isserlis), so one direction's
    error is ``(n + 1)‖g‖²`` and ``K`` averaged ones ``(n + 1)/K``. Rademacher: ``(n − 1)/K``
    (``v_i² = 1``). Orthogonal ``v_k = √n·q_k`` (a random orthonormal frame): ``ĝ = (n/K) Q Qᵀ g``
    with ``E‖Qᵀg‖² = (K/n)‖g‖²``, so ``n/K − 1``, which is 0 at ``K = n``.
    """
    if orthogonal:
        return n / k - 1
    return (n + 1) / k if distribution == "normal" else (n - 1) / k


def estimator_variance(
    spec_or_model: str | nn.Module | Callable[..., nn.Module] = "models/logreg.py",
    *,
    directions: tuple[int, ...] = (1, 8),
    samples: int = 200,
    dataset: str = "digits",
    data: Dataset | None = None,
    batch: int = 64,
    distribution: str = "normal",
    orthogonal: bool = False,
    seed: int = 0,
    ctor_kwargs: dict | None = None,
) -> dict[str, Any]:
    """Variance of the forward-gradient estimate around the true gradient, per ``K``.

    At the seed's initial parameters and one fixed batch, runs graphflop's forward-gradient step
    graph (``K`` directions as inputs) ``samples`` times per ``K`` and forms the estimate
    ``ĝ = (1/K) Σ d_k v_k`` from the directional derivatives it outputs; the true gradient is
    ``torch.func.grad`` of the model's own loss. Directions are drawn by
    :func:`~graphflop.train.runners.draw_directions` (``orthogonal``: one orthonormal frame
    per sample); the theory is :func:`theory_relative`.

    Returns:
        ``{"params": n, "grad_norm_sq": ‖∇L‖², "variance": {K: E‖ĝ−∇L‖²},
        "relative_variance": {K: variance / ‖∇L‖²}, "bias_rel": {K: ‖mean ĝ − ∇L‖/‖∇L‖},
        "theory_relative": {K: theory}}``, plus ``ratio`` = variance at the smallest K / at
        the largest. The second moment follows: ``E‖ĝ‖²/‖∇L‖² = 1 + relative variance``
        (``n + 2`` for one Gaussian direction).
    """
    data = data if data is not None else load_dataset(dataset)
    model, _, _ = build_model(spec_or_model, data, seed=seed, ctor_kwargs=ctor_kwargs)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(data.y_train), generator=gen)[:batch]
    x, y = data.x_train[idx], data.y_train[idx]
    params = {q: p.detach().clone() for q, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss_fn(p):
        return loss_value(
            "cross_entropy", torch.func.functional_call(model, (p, buffers), (x,)), (y,)
        )

    true = torch.func.grad(loss_fn)(params)
    true_flat = torch.cat([true[q].reshape(-1) for q in params]).double()
    gsq = float(true_flat @ true_flat)
    fwd = trace_forward(model, batch, data.image_shape, train_mode=True)
    sig: Signature = fwd.meta[SIGNATURE]
    out: dict[str, Any] = {
        "params": int(true_flat.numel()),
        "grad_norm_sq": gsq,
        "variance": {},
        "relative_variance": {},
        "bias_rel": {},
        "theory_relative": {},
        "samples": samples,
        "distribution": distribution,
        "orthogonal": orthogonal,
    }
    dgen = torch.Generator().manual_seed(seed + 1)
    for k in directions:
        gm = forward_gradient_graph(fwd, "sgd", directions=k, distribution=distribution)
        run = FxRunner(gm)
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        values = {p: params[q] for p, q in sig.params}
        values.update({p: buffers[q] for p, q in sig.buffers})
        values[sig.inputs[0]], values[sig.targets[0]] = x, y
        values["lr"] = torch.tensor(0.0)
        dir_phs = [n for n in phs if n.meta.get(KIND) == "direction"]
        for n in phs:  # optimizer state (none for SGD) and anything else: zeros
            if n.name not in values and n.meta.get(KIND) != "direction":
                values[n.name] = torch.zeros(tuple(n.meta["val"].shape))
        qual = dict(sig.params)
        err_sum, mean = 0.0, torch.zeros_like(true_flat)
        dirs = [(n.name, tuple(n.meta["val"].shape)) for n in dir_phs]
        for _ in range(samples):
            values.update(
                draw_directions(dirs, dgen, distribution=distribution, orthogonal=orthogonal)
            )
            ds = gm.meta[FORWARD_GRADIENT].derivatives(run(values))
            est = {q: torch.zeros_like(params[q]) for q in params}
            for n in dir_phs:
                kk = direction_index(n.name)
                q = qual[n.name.split("_", 1)[1]]
                est[q] += ds[kk] * values[n.name] / k
            flat = torch.cat([est[q].reshape(-1) for q in params]).double()
            err_sum += float(((flat - true_flat) ** 2).sum())
            mean += flat / samples
        var = err_sum / samples
        out["variance"][k] = var
        out["relative_variance"][k] = var / gsq
        out["bias_rel"][k] = float((mean - true_flat).norm()) / math.sqrt(gsq)
        out["theory_relative"][k] = theory_relative(out["params"], k, distribution, orthogonal)
    ks = sorted(directions)
    out["ratio"] = out["variance"][ks[0]] / out["variance"][ks[-1]]
    return out
