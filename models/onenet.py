"""Fully connected network with a single scalar input feature.

Source: M. Hobbhahn and J. Sevilla, "What's the backward-forward FLOP ratio
for neural networks?", Appendix A (the "one" network).

Sizes: input (N, 1), Linear(1 -> 4096) -> ReLU -> Linear(4096 -> 128)
-> ReLU -> Linear(128 -> 10). Parameters: 533,898.
"""

from __future__ import annotations

import torch
from torch import nn


class OneNet(nn.Module):
    """Three-layer MLP whose input is a single feature."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1, 4096)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(4096, 128)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (N, 1) inputs to (N, num_classes) logits."""
        x = self.relu1(self.fc1(x))
        x = self.relu2(self.fc2(x))
        return self.fc3(x)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """One fp32 sample with a single feature."""
    return (torch.randn(1, 1),)
