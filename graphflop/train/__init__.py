"""``graphflop train``: train a model with graphflop's generated step graphs (backprop train step,
forward-gradient step) in PyTorch or on ONNX Runtime, next to plain PyTorch autograd.

See :func:`graphflop.train.loop.train` and :class:`graphflop.train.config.TrainConfig`; data
sets in :mod:`graphflop.train.data`.

The names below load their modules on first access (PEP 562), so that importing one submodule
(the command line reads :mod:`graphflop.train.config`'s defaults to build ``--help``) does not
load the training loop, the data readers and ONNX Runtime's glue, which cost seconds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphflop.train.config import TrainConfig, TrainError
    from graphflop.train.data import DataError, Dataset, load_dataset, read_idx
    from graphflop.train.loop import train
    from graphflop.train.outputs import TrainResult
    from graphflop.train.variance import estimator_variance

#: public name -> the submodule that defines it
_WHERE = {
    "TrainConfig": "config",
    "TrainError": "config",
    "DataError": "data",
    "Dataset": "data",
    "load_dataset": "data",
    "read_idx": "data",
    "TrainResult": "outputs",
    "train": "loop",
    "estimator_variance": "variance",
}

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


#: this module's own imports, not part of what it offers
_PLUMBING = {"Any", "TYPE_CHECKING", "annotations", "importlib"}


def __getattr__(name: str) -> Any:
    """Load :data:`_WHERE`'s names, and the submodules (``graphflop.train.loop``), on first
    access."""
    if name in _WHERE:
        value = getattr(importlib.import_module(f"graphflop.train.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"graphflop.train.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"graphflop.train.{name}":
                raise
    raise AttributeError(f"module 'graphflop.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, *(k for k in globals() if not k.startswith("_"))} - _PLUMBING)
