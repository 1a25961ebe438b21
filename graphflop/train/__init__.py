"""``graphflop train``: train a model with graphflop's generated step graphs (backprop train step,
forward-gradient step) in PyTorch or on ONNX Runtime, next to plain PyTorch autograd.

See :func:`graphflop.train.loop.train` and :class:`graphflop.train.config.TrainConfig`; data
sets in :mod:`graphflop.train.data`.
"""

from graphflop.train.config import TrainConfig, TrainError
from graphflop.train.data import DataError, Dataset, load_dataset, read_idx
from graphflop.train.loop import TrainResult, train
from graphflop.train.variance import estimator_variance

__all__ = [
    "DataError",
    "Dataset",
    "TrainConfig",
    "TrainError",
    "TrainResult",
    "estimator_variance",
    "load_dataset",
    "read_idx",
    "train",
]
