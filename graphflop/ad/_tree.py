"""Mapping over op arguments: tuples, lists and dicts of graph values and constants.

``torch.utils._pytree`` does the same for any registered container, at several times the cost;
the passes call these once or more per emitted node, so they stay small and plain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor


def tree_map(fn: Callable[[Any], Any], x: Any) -> Any:
    """``x`` with ``fn`` applied to every leaf (anything but a tuple, list or dict)."""
    t = type(x)
    if t is tuple or t is list:
        return t(tree_map(fn, y) for y in x)
    if t is dict:
        return {k: tree_map(fn, v) for k, v in x.items()}
    if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
        return type(x)(tree_map(fn, y) for y in x)  # fx's immutable_list
    return fn(x)


def leaves(x: Any) -> Iterator[Any]:
    """Every leaf of ``x``, depth first."""
    if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
        for y in x:
            yield from leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from leaves(y)
    else:
        yield x


def meta_key(a: Any) -> Any:
    """A hashable key of ``a`` by metadata: a tensor by shape, strides, offset, dtype and
    device; containers by their items; anything else as itself (``TypeError`` on hashing
    when it is not hashable). A FakeTensor that carries a constant value raises
    ``TypeError``: its consumers may read the value."""
    if type(a) is FakeTensor:  # memoised on the tensor: graphs share their FakeTensors
        key = a.__dict__.get(_KEY)
        if key is None:
            key = a.__dict__[_KEY] = _tensor_key(a)
        return key
    if isinstance(a, torch.Tensor):
        return _tensor_key(a)
    if isinstance(a, (list, tuple)):
        return tuple(meta_key(x) for x in a)
    if isinstance(a, dict):
        return tuple((k, meta_key(v)) for k, v in sorted(a.items()))
    return a


def _tensor_key(a: torch.Tensor) -> tuple:
    if getattr(a, "constant", None) is not None:
        raise TypeError("a value-carrying FakeTensor")
    return ("T", tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device)


#: where a FakeTensor's :func:`meta_key` is kept (a graph value's metadata does not change:
#: graph values are never resized in place)
_KEY = "_graphflop_meta_key"
