"""The one ``torch.optim`` factory: PyTorch's optimizers with the constants of graphflop's update
graphs (:class:`~graphflop.passes.optimizer.OptimizerConfig`), for the eager baselines of
``graphflop train --method torch`` and ``graphflop bench``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from graphflop.passes.optimizer import OPTIMIZERS, OptimizerConfig


def torch_optimizer(
    name: str,
    params: Iterable[torch.nn.Parameter],
    lr: float,
    cfg: OptimizerConfig | None = None,
) -> torch.optim.Optimizer:
    """``torch.optim`` running the update ``name`` with ``cfg``'s constants.

    Args:
        name: ``sgd``, ``momentum`` (SGD with ``cfg.momentum``), ``adam`` (``cfg.betas``,
            ``cfg.eps``) or ``adamw`` (and ``cfg.weight_decay``).
        params: the parameters to update.
        lr: learning rate.
        cfg: the hyper-parameters; default ``OptimizerConfig(name)`` (PyTorch's defaults, the
            ones graphflop's update graphs use).

    Raises:
        ValueError: an unknown optimizer name.
    """
    cfg = cfg or OptimizerConfig(name)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=cfg.betas, eps=cfg.eps)
    if name == "adamw":
        return torch.optim.AdamW(
            params, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    raise ValueError(f"unknown optimizer {name!r}; one of {', '.join(OPTIMIZERS)}")
