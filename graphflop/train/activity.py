"""Activity-perturbed forward gradients (Ren, Kornblith, Liao, Hinton 2023, "Scaling forward
gradient with local losses", ICLR 2023): ``graphflop train --method fgd --perturb activations``.

Weight perturbation (Baydin et al. 2022) draws a tangent for every parameter, ``n`` numbers,
and the estimate's error grows as ``(n + 1)‖∇L‖²``. Activity perturbation draws the tangent on
the *outputs* of the linear layers instead: for each ``nn.Linear``/``nn.Conv2d`` layer ``l``
with input ``x_l`` and output ``z_l``, a Gaussian ``u_l`` shaped like ``z_l``. One forward-mode
pass (``torch.func.jvp`` with the ``u_l`` as tangents of additive zero perturbations of the
``z_l``) gives, for every example ``b`` of the batch, ``d_b = Σ_l ∇_{z_{l,b}}L · u_{l,b}`` (the
tangent of example ``b``'s term of the mean loss, which no other example's activations touch);
``d_b·u_{l,b}`` is an unbiased estimate of the activity gradient ``∇_{z_{l,b}}L``, and each layer forms its weight gradient *locally* from it with the exact
chain rule of its own op — ``ĝ_zᵀ x`` for a linear layer (``torch.nn.grad.conv2d_weight`` for a
convolution), bias: ``ĝ_z`` summed — as backprop's weight-gradient products do, but without any
backward pass through the network. Each example's estimate carries the noise of its own activations only (MLP 64-1024-1024-10:
2,058 per example) rather than of all the weights (1,126,410), which is where the variance
reduction comes from. This per-example separation assumes the examples of a batch do not
interact (no batch normalisation in training mode).

``K`` directions average ``K`` such estimates. The update is ``torch.optim``'s (graphflop's
constants, :func:`graphflop.runtime.optim.torch_optimizer`) with the estimate as ``.grad``. This
runs in PyTorch (torch.func), not as a graphflop step graph. Models: every trainable parameter
must belong to an ``nn.Linear`` or a zero-padded ``nn.Conv2d`` (the layers whose weight gradient
is formed locally here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphflop.train.config import TrainError

LAYERS = (nn.Linear, nn.Conv2d)


def perturbed_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``nn.Linear``/``nn.Conv2d`` layers whose outputs are perturbed, by qualified name.

    Raises:
        TrainError: a trainable parameter outside them, or a convolution this module cannot
            differentiate locally (padding mode other than zeros, string padding).
    """
    layers = [(q, m) for q, m in model.named_modules() if isinstance(m, LAYERS)]
    owned = {id(p) for _, m in layers for p in m.parameters(recurse=False)}
    stray = [q for q, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
    if stray:
        raise TrainError(
            f"--perturb activations forms weight gradients for nn.Linear and nn.Conv2d layers "
            f"only; {stray[0]} belongs to another module (use --perturb weights)"
        )
    for q, m in layers:
        if isinstance(m, nn.Conv2d) and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
            raise TrainError(
                f"--perturb activations: convolution {q} has padding {m.padding!r} "
                f"({m.padding_mode}); only numeric zero padding is supported"
            )
    return layers


def local_weight_grads(
    layers: list[tuple[str, nn.Module]],
    inputs: dict[str, torch.Tensor],
    act_grads: dict[str, torch.Tensor],
) -> dict[nn.Parameter, torch.Tensor]:
    """Each layer's parameter gradients from its input ``x`` and an (estimated) gradient of the
    loss with respect to its output, by the layer's own chain rule: ``Linear`` ``dW = gᵀx``,
    ``db = Σ g`` over all leading dimensions; ``Conv2d`` ``dW = conv2d_weight(x, g)``,
    ``db = Σ g`` over batch and space. Exact activity gradients give exactly backprop's."""
    out: dict[nn.Parameter, torch.Tensor] = {}
    for q, m in layers:
        x, g = inputs[q], act_grads[q]
        if isinstance(m, nn.Linear):
            g2, x2 = g.reshape(-1, m.out_features), x.reshape(-1, m.in_features)
            out[m.weight] = g2.T @ x2
            bias_dims: tuple[int, ...] = (0,)
        else:
            assert isinstance(m, nn.Conv2d)
            out[m.weight] = torch.nn.grad.conv2d_weight(
                x, m.weight.shape, g, m.stride, m.padding, m.dilation, m.groups
            )
            g2, bias_dims = g, (0, 2, 3)
        if m.bias is not None:
            out[m.bias] = g2.sum(bias_dims)
    return out


class ActivityPerturbation:
    """One step's activity-perturbed estimate for ``model`` (see the module docstring).

    Forward hooks on the perturbed layers record each layer's input and add the current
    perturbation to its output; they are inert outside :meth:`estimate`.
    """

    def __init__(self, model: nn.Module, gen: torch.Generator):
        self.model, self.gen = model, gen
        self.layers = perturbed_layers(model)
        self._eps: dict[str, torch.Tensor] = {}
        self._inputs: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._active = False
        for q, m in self.layers:
            m.register_forward_hook(self._hook(q))

    def _hook(self, q: str):
        def hook(module, args, output):
            if not self._active:  # validation and other calls: untouched
                return output
            self._inputs[q] = args[0]
            self._shapes[q] = tuple(output.shape)
            e = self._eps.get(q)
            return output if e is None else output + e

        return hook

    def activity_estimate(
        self, x: torch.Tensor, y: torch.Tensor, directions: int = 1
    ) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(loss, {layer: estimated ∇_z L}, {layer: its input})`` from ``directions``
        forward-mode passes, each with fresh Gaussian tangents on every layer output."""
        self._active = True
        try:
            return self._estimate(x, y, directions)
        finally:
            self._active, self._eps = False, {}

    def _estimate(self, x, y, directions):
        names = [q for q, _ in self.layers]
        if not self._shapes or next(iter(self._shapes.values()))[0] != len(x):
            with torch.no_grad():  # output shapes, once per batch size
                self.model(x)
        est = {q: torch.zeros(self._shapes[q]) for q in names}
        loss, inputs = 0.0, {}
        for _ in range(directions):
            us = tuple(torch.randn(self._shapes[q], generator=self.gen) for q in names)

            def f(*eps):
                self._eps = dict(zip(names, eps))
                self._inputs = {}
                # per-example terms of the mean cross-entropy: example b's term depends only
                # on example b's activations, so its tangent is ∇_{z_b}L · u_b alone
                out = F.cross_entropy(self.model(x), y, reduction="none") / len(y)
                return out, dict(self._inputs)

            zeros = tuple(torch.zeros_like(u) for u in us)
            value, d, inputs = torch.func.jvp(f, zeros, us, has_aux=True)
            loss = float(value.sum())
            for q, u in zip(names, us):
                est[q] += d.reshape(-1, *[1] * (u.dim() - 1)) * u / directions
        return loss, est, {q: t.detach() for q, t in inputs.items()}

    def estimate(
        self, x: torch.Tensor, y: torch.Tensor, directions: int = 1
    ) -> tuple[float, dict[nn.Parameter, torch.Tensor]]:
        """``(loss, {parameter: estimated gradient})`` for the batch ``(x, y)``."""
        with torch.no_grad():
            loss, act, inputs = self.activity_estimate(x, y, directions)
            return loss, local_weight_grads(self.layers, inputs, act)


class ActivityStepper:
    """A training stepper (see :mod:`graphflop.train.runners`): activity-perturbed estimate,
    then ``torch.optim``'s update; ``ExponentialLR(gamma=lr_decay)`` per epoch. In a
    distributed run the estimates are averaged over the ranks (each with its own tangents)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: str,
        lr: float,
        lr_decay: float,
        *,
        directions: int = 1,
        seed: int = 0,
    ):
        from graphflop.runtime.optim import torch_optimizer

        self.model, self.directions = model, directions
        self.perturb = ActivityPerturbation(model, torch.Generator().manual_seed(seed + 0x5EED))
        self.opt = torch_optimizer(optimizer, model.parameters(), lr)
        self.sched = (
            torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma=lr_decay)
            if lr_decay != 1.0
            else None
        )

    def step(self, x, y, lr, t) -> float:
        """One estimate and update on ``(x, y)``; returns the loss before it."""
        from graphflop.train.distributed import mean_over_ranks

        loss, grads = self.perturb.estimate(x, y, self.directions)
        for p in self.model.parameters():
            p.grad = mean_over_ranks(grads[p]) if p.requires_grad and p in grads else None
        self.opt.step()
        return loss

    def end_epoch(self) -> None:
        """Step the learning-rate schedule."""
        if self.sched is not None:
            self.sched.step()

    def state_by_qual(self) -> dict[str, Any]:
        """The model's parameters and buffers by qualified name."""
        return {
            **{q: p.detach() for q, p in self.model.named_parameters()},
            **{q: b for q, b in self.model.named_buffers()},
        }
