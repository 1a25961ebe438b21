"""Logistic regression on MNIST.

Source: A. G. Baydin, B. A. Pearlmutter, D. Syme, F. Wood and P. Torr,
"Gradients without Backpropagation", arXiv:2202.08587 (2022), MNIST
logistic regression experiment.

Sizes: input (N, 1, 28, 28) flattened to 784 features, Linear(784 -> 10).
Parameters: 7,850. Example batch size 64.
"""

from __future__ import annotations

import torch
from torch import nn


class LogReg(nn.Module):
    """Multinomial logistic regression: a single linear layer producing logits."""

    def __init__(self, in_features: int = 784, num_classes: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (N, 1, 28, 28) images to (N, num_classes) logits."""
        return self.fc(x.flatten(1))


def example_inputs() -> tuple[torch.Tensor, ...]:
    """A batch of 64 fp32 MNIST-sized images."""
    return (torch.randn(64, 1, 28, 28),)
