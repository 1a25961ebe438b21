"""A LoRA-style adapter on a frozen two-layer network: what freezing saves.

Source: E. J. Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685 (2021): a frozen weight W plus a trainable low-rank update B·A, scaled by
alpha / rank.

Sizes (defaults): input (N, 64) -> LoRALinear(64 -> 256, rank 4) -> ReLU
-> LoRALinear(256 -> 10, rank 4) -> logits (N, 10). Parameters: 21,554, of which 2,344
train (the adapters: 4·64 + 256·4 + 4·256 + 10·4) and 19,210 are frozen (the base layers:
64·256 + 256 + 256·10 + 10). Example batch 8.

``graphflop inspect models/lora.py`` shows the frozen bases with no weight gradient, no update
and no gradient or optimizer-state bytes; ``--arg frozen=False`` trains everything, for
comparison.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRALinear(nn.Module):
    """``base(x) + up(down(x)) · alpha / rank`` with ``base`` frozen.

    ``down`` (rank × in) and ``up`` (out × rank) have no bias; ``up`` starts at zero, as in
    the paper, so the adapter starts as the identity change.
    """

    def __init__(
        self, in_features: int, out_features: int, rank: int = 4, alpha: float = 4.0
    ) -> None:
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=False)
        nn.init.zeros_(self.up.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x)) * self.scale


class LoRANet(nn.Module):
    """Two LoRA linear layers with a ReLU between them; the bases frozen unless ``frozen``
    is False."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 256,
        num_classes: int = 10,
        rank: int = 4,
        frozen: bool = True,
    ) -> None:
        super().__init__()
        self.fc1 = LoRALinear(in_features, hidden, rank)
        self.relu = nn.ReLU()
        self.fc2 = LoRALinear(hidden, num_classes, rank)
        if frozen:
            self.fc1.base.requires_grad_(False)
            self.fc2.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(8, 64),)
