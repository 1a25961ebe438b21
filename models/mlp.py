"""Multi-layer perceptron on MNIST.

Source: A. G. Baydin, B. A. Pearlmutter, D. Syme, F. Wood and P. Torr,
"Gradients without Backpropagation", arXiv:2202.08587 (2022), MNIST
multi-layer network experiment.

Sizes (defaults): input (N, 1, 28, 28) flattened to 784 features,
Linear(784 -> 1024) -> ReLU -> Linear(1024 -> 1024) -> ReLU
-> Linear(1024 -> 10). Parameters: 1,863,690. Example batch size 64.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``depth`` hidden ReLU layers of width ``hidden`` followed by a linear classifier.

    Layers live in ``self.layers`` (an ``nn.Sequential``) with readable names:
    ``fc1``, ``relu1``, ..., ``fc{depth}``, ``relu{depth}``, ``out``.
    """

    def __init__(
        self,
        in_features: int = 784,
        hidden: int = 1024,
        depth: int = 2,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.layers = nn.Sequential()
        width = in_features
        for i in range(1, depth + 1):
            self.layers.add_module(f"fc{i}", nn.Linear(width, hidden))
            self.layers.add_module(f"relu{i}", nn.ReLU())
            width = hidden
        self.layers.add_module("out", nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (N, 1, 28, 28) images to (N, num_classes) logits."""
        return self.layers(x.flatten(1))


def example_inputs() -> tuple[torch.Tensor, ...]:
    """A batch of 64 fp32 MNIST-sized images."""
    return (torch.randn(64, 1, 28, 28),)
