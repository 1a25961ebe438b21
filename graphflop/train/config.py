"""What a training run is asked to do: :class:`TrainConfig`, checked once when it is made.

The default learning rates were tuned on digits: backprop with momentum reaches ≥ 95 %
validation accuracy with the MLP and the CNN in 4-5 epochs; forward gradients need ~500× smaller
steps with these models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from graphflop.passes.forward_gradient import MAX_DIRECTIONS
from graphflop.passes.optimizer import OPTIMIZERS
from graphflop.runtime.timing import threads_problem

METHODS = ("fgd", "backprop", "torch")
RUNTIMES = ("torch", "onnxruntime")
DISTRIBUTIONS = ("normal", "rademacher")
PERTURB = ("weights", "activations")
DEVICES = ("cpu", "cuda")
#: default learning rates: (method family, optimizer) → lr. Backprop and torch share theirs.
DEFAULT_LR = {
    ("backprop", "sgd"): 0.1,
    ("backprop", "momentum"): 0.05,
    ("backprop", "adam"): 1e-3,
    ("backprop", "adamw"): 1e-3,
    ("fgd", "sgd"): 1e-3,
    ("fgd", "momentum"): 1e-4,
    ("fgd", "adam"): 1e-4,
    ("fgd", "adamw"): 1e-4,
}
DEFAULT_OPTIMIZER = "momentum"
DEFAULT_EPOCHS = 10


class TrainError(ValueError):
    """Options or a model that cannot be trained; the message says what to change."""


def default_lr(method: str, optimizer: str) -> float:
    """The learning rate used when none is given (tuned on digits)."""
    return DEFAULT_LR[("fgd" if method == "fgd" else "backprop", optimizer)]


@dataclass(frozen=True)
class TrainConfig:
    """The settings of one training run (see :func:`graphflop.train.loop.train`).

    Attributes:
        method: ``backprop`` (graphflop's train-step graph), ``fgd`` (its forward-gradient step
            graph) or ``torch`` (autograd and ``torch.optim``).
        runtime: where a step graph runs: ``torch`` (the GraphModule is called) or
            ``onnxruntime``; ``method="torch"`` runs in PyTorch only.
        optimizer: ``sgd``, ``momentum``, ``adam``, ``adamw`` (PyTorch's algorithms).
        lr: learning rate; None: :func:`default_lr` (see :meth:`learning_rate`).
        lr_decay: factor applied to the learning rate after every epoch.
        batch: training batch size (incomplete batches are dropped).
        steps, epochs: length of training (at most one; default :data:`DEFAULT_EPOCHS` epochs).
        directions, distribution: forward-gradient directions per step and their law.
        orthogonal: the ``K`` directions of a step orthogonal (Gaussian, scaled to ``√n``;
            :func:`graphflop.train.runners.draw_directions`).
        perturb: ``weights`` (Baydin et al.: tangents on the parameters, graphflop's step
            graph) or ``activations`` (Ren et al. 2023: tangents on layer outputs, weight
            gradients formed locally; :mod:`graphflop.train.activity`, PyTorch only).
        local_losses: with ``perturb="activations"``, each block's activity gradient from its
            own local classifier loss (Ren et al. 2023; :mod:`graphflop.train.activity`).
        seed: model initialisation, batch order and directions.
        eval_every: validate every N steps (None: once per epoch) and at the end; 0: never
            (not even at step 0 or at the end, and no eval graph is built).
        eval_batch: validation chunk size.
        dataset, data_dir: ``digits`` or ``mnist`` (with its folder), used when no data set is
            passed to ``train``.
        ctor_kwargs: extra constructor keywords for the model.
        device: ONNX Runtime execution provider (``cpu`` or ``cuda``); PyTorch runs on the CPU.
        threads: ``torch.set_num_threads`` (and ONNX Runtime's intra-op threads) for the run,
            restored afterwards; None leaves PyTorch's setting.

    Raises:
        TrainError: on construction, for any value out of range or a combination that cannot
            run (``method="torch"`` with ``runtime="onnxruntime"``, both steps and epochs).
    """

    method: str = "backprop"
    runtime: str = "torch"
    optimizer: str = DEFAULT_OPTIMIZER
    lr: float | None = None
    lr_decay: float = 1.0
    batch: int = 64
    steps: int | None = None
    epochs: float | None = None
    directions: int = 1
    distribution: str = "normal"
    orthogonal: bool = False
    perturb: str = "weights"
    local_losses: bool = False
    seed: int = 0
    eval_every: int | None = None
    eval_batch: int = 500
    dataset: str = "digits"
    data_dir: str | Path | None = None
    ctor_kwargs: dict[str, Any] | None = field(default_factory=dict)
    device: str = "cpu"
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.ctor_kwargs is None:
            object.__setattr__(self, "ctor_kwargs", {})
        _check_names(self)
        _check_numbers(self)
        _check_method_options(self)

    @property
    def learning_rate(self) -> float:
        """``lr``, or the default for the method and optimizer."""
        return default_lr(self.method, self.optimizer) if self.lr is None else float(self.lr)

    def total_steps(self, steps_per_epoch: int) -> int:
        """Training steps: ``steps``, else ``epochs`` (default 10) × ``steps_per_epoch``
        rounded, at least 1."""
        if self.steps is not None:
            return self.steps
        return max(1, round((self.epochs or DEFAULT_EPOCHS) * steps_per_epoch))


def _one_of(value: Any, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise TrainError(f"unknown {what} {value!r}; one of {', '.join(choices)}")


def _check_names(c: TrainConfig) -> None:
    _one_of(c.method, METHODS, "method")
    _one_of(c.runtime, RUNTIMES, "runtime")
    if c.method == "torch" and c.runtime != "torch":
        raise TrainError(
            "--method torch is PyTorch autograd; --runtime onnxruntime runs "
            "graphflop's graphs (--method backprop or fgd)"
        )
    _one_of(c.optimizer, OPTIMIZERS, "optimizer")
    if c.distribution not in DISTRIBUTIONS:
        raise TrainError(f"unknown distribution {c.distribution!r}; normal or rademacher")
    _one_of(c.perturb, PERTURB, "perturbation")
    if c.perturb == "activations" and (
        c.method != "fgd" or c.runtime != "torch" or c.orthogonal or c.distribution != "normal"
    ):
        raise TrainError(
            "--perturb activations is forward-gradient training in PyTorch with independent "
            "Gaussian tangents: use it with --method fgd, without --runtime onnxruntime, "
            "--orthogonal or --distribution rademacher"
        )
    if c.local_losses and c.perturb != "activations":
        raise TrainError("--local-losses is an option of --perturb activations (with --method fgd)")
    if c.orthogonal and c.distribution != "normal":
        raise TrainError("--orthogonal directions are drawn Gaussian; use --distribution normal")
    if c.device not in DEVICES:
        raise TrainError(f"unknown device {c.device!r}; cpu or cuda")


def _check_method_options(c: TrainConfig) -> None:
    """Refuse forward-gradient options a backprop or torch run would drop (after the other
    checks, so a malformed value is named as such first)."""
    if c.method != "fgd":
        default = {f.name: f.default for f in fields(c)}
        given = [
            f"--{name}"
            for name in ("directions", "distribution", "orthogonal", "perturb")
            if getattr(c, name) != default[name]
        ]
        if given:  # the run would drop it, and summary.json would say so only by a null
            raise TrainError(
                f"{given[0]} sets forward-gradient directions, which --method {c.method} does "
                "not draw: use it with --method fgd (or drop it)"
            )


def _check_numbers(c: TrainConfig) -> None:
    if c.steps is not None and c.epochs is not None:
        raise TrainError("give --steps or --epochs, not both")
    for option, value in (
        ("--batch", c.batch),
        ("--directions", c.directions),
        ("--steps", c.steps),
        ("--epochs", c.epochs),
    ):
        if value is not None and not 0 < value < math.inf:
            raise TrainError(f"bad {option} {value}: must be positive (and finite)")
    if c.directions > MAX_DIRECTIONS:
        raise TrainError(
            f"bad --directions {c.directions}: give 1 to {MAX_DIRECTIONS:,} (each step holds a "
            "tangent of every parameter per direction)"
        )
    for option, value in (("--lr", c.lr), ("--lr-decay", c.lr_decay)):
        if value is not None and not 0 < value < math.inf:
            raise TrainError(f"bad {option} {value:g}: must be positive and finite")
    if c.eval_every is not None and c.eval_every < 0:
        raise TrainError("--eval-every must be 0 (never) or positive")
    if c.eval_batch < 1:
        raise TrainError("the validation chunk size must be positive")
    problem = threads_problem(c.threads)
    if problem:
        raise TrainError(problem)
