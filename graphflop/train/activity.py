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

Local losses (``local_losses=True``, ``--local-losses``; Ren et al. 2023, section 4): each
perturbed layer and what follows it up to the next perturbed layer is a block; the next layer
reads the block's output detached (a stop-gradient), and a linear classifier head on the
flattened output (``nn.Linear(features, classes)``, created on the first batch) gives the block
its own per-example cross-entropy. Layer ``l``'s activity gradient is then estimated from its
block's loss alone, ``d_{l,b} = ∇_{z_{l,b}}L_l · u_{l,b}`` (the last block's loss is the model's
loss); the heads are trained with their exact gradients (one linear layer each, from the
block's detached output: no backward pass through the network).

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
import torch.nn.grad
from torch import nn

from graphflop.runtime.attention import math_attention
from graphflop.train.config import TrainError

LAYERS = (nn.Linear, nn.Conv2d)


def perturbed_layers(model: nn.Module) -> list[tuple[str, nn.Linear | nn.Conv2d]]:
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
    layers: list[tuple[str, nn.Linear | nn.Conv2d]],
    inputs: dict[str, torch.Tensor],
    act_grads: dict[str, torch.Tensor],
) -> dict[torch.Tensor, torch.Tensor]:
    """Each layer's parameter gradients from its input ``x`` and an (estimated) gradient of the
    loss with respect to its output, by the layer's own chain rule: ``Linear`` ``dW = gᵀx``,
    ``db = Σ g`` over all leading dimensions; ``Conv2d`` ``dW = conv2d_weight(x, g)``,
    ``db = Σ g`` over batch and space. Exact activity gradients give exactly backprop's."""
    out: dict[torch.Tensor, torch.Tensor] = {}  # keyed by the parameters
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

    def __init__(
        self,
        model: nn.Module,
        gen: torch.Generator,
        *,
        local_losses: bool = False,
        head_seed: int = 0,
    ):
        self.model, self.gen = model, gen
        self.layers = perturbed_layers(model)
        self.local_losses, self.head_seed = local_losses, head_seed
        #: the local classifier heads, one per block but the last (built on the first batch)
        self.heads: list[nn.Linear] = []
        self._eps: dict[str, torch.Tensor] = {}
        self._inputs: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._block_out: list[torch.Tensor] = []
        self._active = False
        for i, (q, m) in enumerate(self.layers):
            m.register_forward_hook(self._hook(q))
            if i > 0:
                m.register_forward_pre_hook(self._cut)

    def _cut(self, module, args):
        """Local losses: keep the block output (with its tangent) for the block's head and
        pass it on detached, so that no tangent crosses into the next block."""
        if not (self._active and self.local_losses):
            return None
        self._block_out.append(args[0])
        return (args[0].detach(), *args[1:])

    def _hook(self, q: str):
        def hook(module, args, output):
            if not self._active:  # validation and other calls: untouched
                return output
            if q in self._inputs:
                raise TrainError(
                    f"--perturb activations: layer {q} is applied more than once per forward "
                    "(weight sharing); its uses need perturbations of their own"
                )
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
                self._inputs, self._block_out = {}, []
                out = self.model(x)
                if self.local_losses and not self.heads:
                    self._make_heads(out.shape[-1])
        est = {q: torch.zeros(self._shapes[q]) for q in names}
        loss, inputs = 0.0, {}
        for _ in range(directions):
            us = tuple(torch.randn(self._shapes[q], generator=self.gen) for q in names)

            def f(*eps):
                self._eps = dict(zip(names, eps))
                self._inputs, self._block_out = {}, []
                # per-example terms of the mean cross-entropy: example b's term depends only
                # on example b's activations, so its tangent is ∇_{z_b}L · u_b alone
                out = F.cross_entropy(self.model(x), y, reduction="none") / len(y)
                if self.local_losses:  # one row per block: its own loss, the model's last
                    out = torch.stack([*self._local(y), out])
                return out, (dict(self._inputs), list(self._block_out))

            zeros = tuple(torch.zeros_like(u) for u in us)
            # (RNN layers, whose fused kernels have no forward AD either, are refused here)
            with math_attention():  # the fused CPU attention kernel has no forward derivative
                # torch.func.jvp's return type is a 2- or 3-tuple whatever has_aux says
                value, d, (inputs, blocks) = torch.func.jvp(f, zeros, us, has_aux=True)  # type: ignore[misc]
            loss = float(value[-1].sum()) if self.local_losses else float(value.sum())
            for i, (q, u) in enumerate(zip(names, us)):
                di = d[i] if self.local_losses else d
                est[q] += di.reshape(-1, *[1] * (u.dim() - 1)) * u / directions
        self._block_out = [h.detach() for h in blocks]
        return loss, est, {q: t.detach() for q, t in inputs.items()}

    def _make_heads(self, classes: int) -> None:
        gen = torch.Generator().manual_seed(self.head_seed + 0x4EAD)
        for h in self._block_out:
            head = nn.Linear(h[0].numel(), classes)
            with torch.no_grad():  # nn.Linear's default initialisation, from our generator
                bound = 1.0 / h[0].numel() ** 0.5
                head.weight.uniform_(-bound, bound, generator=gen)
                head.bias.uniform_(-bound, bound, generator=gen)
            self.heads.append(head)

    def _local(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Each block's per-example local loss terms (cross-entropy of its head / batch)."""
        return [
            F.cross_entropy(head(h.flatten(1)), y, reduction="none") / len(y)
            for head, h in zip(self.heads, self._block_out)
        ]

    def head_grads(self, y: torch.Tensor) -> dict[torch.Tensor, torch.Tensor]:
        """The heads' exact gradients of their local losses on the last estimate's block
        outputs (detached: one linear layer each)."""
        out: dict[torch.Tensor, torch.Tensor] = {}
        with torch.enable_grad():
            for head, h in zip(self.heads, self._block_out):
                loss = F.cross_entropy(head(h.flatten(1)), y)
                out.update(
                    zip(head.parameters(), torch.autograd.grad(loss, list(head.parameters())))
                )
        return out

    def estimate(
        self, x: torch.Tensor, y: torch.Tensor, directions: int = 1
    ) -> tuple[float, dict[torch.Tensor, torch.Tensor]]:
        """``(loss, {parameter: estimated gradient})`` for the batch ``(x, y)``."""
        with torch.no_grad():
            loss, act, inputs = self.activity_estimate(x, y, directions)
            grads = local_weight_grads(self.layers, inputs, act)
        if self.local_losses:
            grads.update(self.head_grads(y))
        return loss, grads


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
        local_losses: bool = False,
        head_seed: int = 0,
    ):
        self.model, self.directions = model, directions
        self.perturb = ActivityPerturbation(
            model,
            torch.Generator().manual_seed(seed + 0x5EED),
            local_losses=local_losses,
            head_seed=head_seed,
        )
        self.optimizer, self.lr, self.lr_decay = optimizer, lr, lr_decay
        self.opt: torch.optim.Optimizer | None = None
        self.sched: Any = None

    def _params(self) -> list[nn.Parameter]:
        heads = [p for h in self.perturb.heads for p in h.parameters()]
        return [*self.model.parameters(), *heads]

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """``torch.optim``'s optimizer over the model's parameters and the local heads' (the
        heads exist after the first batch's shapes are known)."""
        from graphflop.runtime.optim import torch_optimizer

        opt = torch_optimizer(self.optimizer, self._params(), self.lr)
        if self.lr_decay != 1.0:
            self.sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=self.lr_decay)
        return opt

    def step(self, x, y, lr, t) -> float:
        """One estimate and update on ``(x, y)``; returns the loss before it."""
        from graphflop.train.distributed import mean_over_ranks

        loss, grads = self.perturb.estimate(x, y, self.directions)
        if self.opt is None:
            self.opt = self._make_optimizer()
        for p in self._params():
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
