"""The forward-gradient estimator's variance around the true gradient, per number of
directions ``K`` (:func:`estimator_variance`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphflop.frontend.trace import loss_value
from graphflop.meta import KIND, SIGNATURE, Signature
from graphflop.runtime.graphs import forward_gradient_graph
from graphflop.train.data import Dataset, load_dataset
from graphflop.train.model import build_model, trace_forward
from graphflop.train.runners import FxRunner


def estimator_variance(
    spec_or_model: str | nn.Module | Callable[..., nn.Module] = "models/logreg.py",
    *,
    directions: tuple[int, ...] = (1, 8),
    samples: int = 200,
    dataset: str = "digits",
    data: Dataset | None = None,
    batch: int = 64,
    distribution: str = "normal",
    seed: int = 0,
    ctor_kwargs: dict | None = None,
) -> dict[str, Any]:
    """Variance of the forward-gradient estimate around the true gradient, per ``K``.

    At the seed's initial parameters and one fixed batch, runs graphflop's forward-gradient step
    graph (``K`` directions as inputs) ``samples`` times per ``K`` and forms the estimate
    ``ĝ = (1/K) Σ d_k v_k`` from the directional derivatives it outputs; the true gradient is
    ``torch.func.grad`` of the model's own loss. For Gaussian directions
    ``E‖ĝ − ∇L‖² = (n + 1)‖∇L‖² / K`` (``n`` parameters), so it falls as ``1/K``.

    Returns:
        ``{"params": n, "grad_norm_sq": ‖∇L‖², "variance": {K: E‖ĝ−∇L‖²},
        "relative_variance": {K: variance / ‖∇L‖²}, "bias_rel": {K: ‖mean ĝ − ∇L‖/‖∇L‖},
        "theory_relative": {K: (n+1)/K}}`` (Gaussian theory), plus ``ratio`` = variance at
        the smallest K / at the largest.
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
        for _ in range(samples):
            for n in dir_phs:
                d = torch.randn(tuple(n.meta["val"].shape), generator=dgen)
                values[n.name] = d.sign() if distribution == "rademacher" else d
            ds = run(values)[-k:]
            est = {q: torch.zeros_like(params[q]) for q in params}
            for n in dir_phs:
                kk = int(n.name[1:].split("_", 1)[0])
                q = qual[n.name.split("_", 1)[1]]
                est[q] += ds[kk] * values[n.name] / k
            flat = torch.cat([est[q].reshape(-1) for q in params]).double()
            err_sum += float(((flat - true_flat) ** 2).sum())
            mean += flat / samples
        var = err_sum / samples
        out["variance"][k] = var
        out["relative_variance"][k] = var / gsq
        out["bias_rel"][k] = float((mean - true_flat).norm()) / math.sqrt(gsq)
        n_par = out["params"]
        out["theory_relative"][k] = (
            (n_par + 1) / k if distribution == "normal" else (n_par - 1) / k
        )  # Rademacher: E‖(g·v)v−g‖² = (n−1)…
    ks = sorted(directions)
    out["ratio"] = out["variance"][ks[0]] / out["variance"][ks[-1]]
    return out
