"""``graphflop train``: train a model with graphflop's generated step graphs (backprop train step,
forward-gradient step) in PyTorch or on ONNX Runtime, next to plain PyTorch autograd.

See :func:`graphflop.train.loop.train`; data sets in :mod:`graphflop.train.data`.
"""

from graphflop.train.data import DataError, Dataset, load_dataset, read_idx
from graphflop.train.loop import TrainError, TrainResult, estimator_variance, train

__all__ = [
    "DataError",
    "Dataset",
    "TrainError",
    "TrainResult",
    "estimator_variance",
    "load_dataset",
    "read_idx",
    "train",
]
