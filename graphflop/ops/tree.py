"""Mapping over op arguments: tuples, lists and dicts of graph values and constants.

``torch.utils._pytree`` does the same for any registered container, at several times the cost;
the passes call these once or more per emitted node, so they stay small and plain.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Node

from graphflop.ops.ghost import GhostValue


def tree_map(fn: Callable[[Any], Any], x: Any) -> Any:
    """``x`` with ``fn`` applied to every leaf (anything but a tuple, list or dict)."""
    t = type(x)
    if t is tuple:
        return tuple([tree_map(fn, y) for y in x])
    if t is list:
        return [tree_map(fn, y) for y in x]
    if t is dict:
        return {k: tree_map(fn, v) for k, v in x.items()}
    if t in _LEAF_TYPES:
        return fn(x)
    if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
        return type(x)([tree_map(fn, y) for y in x])  # fx's immutable_list
    return fn(x)


def leaves(x: Any) -> list[Any]:
    """Every leaf of ``x``, depth first."""
    out: list[Any] = []
    _leaves(x, out)
    return out


def _leaves(x: Any, out: list[Any]) -> None:
    t = type(x)
    if t in _LEAF_TYPES:
        out.append(x)
    elif (
        t is tuple or t is list or (isinstance(x, (tuple, list)) and not isinstance(x, torch.Size))
    ):
        for y in x:
            _leaves(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _leaves(y, out)
    else:
        out.append(x)


def meta_key(a: Any) -> Any:
    """A hashable key of ``a`` by metadata: a tensor by shape, strides, offset, dtype and
    device; containers by their items; a float, bool or other non-integer number by its type
    and exact value (:func:`scalar_key`); anything else as itself (``TypeError`` on hashing
    when it is not hashable). A FakeTensor that carries a constant value raises
    ``TypeError``: its consumers may read the value."""
    t = type(a)
    if t is FakeTensor:  # memoised on the tensor: graphs share their FakeTensors
        key = a.__dict__.get(_KEY)
        if key is None:
            key = a.__dict__[_KEY] = _tensor_key(a)
        return key
    if t is float or t is bool:
        return scalar_key(a)
    if t in _LEAF_TYPES:
        return a
    if isinstance(a, torch.Tensor):
        return _tensor_key(a)
    if isinstance(a, (list, tuple)):
        return tuple([meta_key(x) for x in a])
    if isinstance(a, dict):  # (most are an op's empty keyword arguments)
        return tuple([(k, meta_key(v)) for k, v in sorted(a.items())]) if a else ()
    if isinstance(a, numbers.Number) and t is not int:
        return scalar_key(a)
    return a


def scalar_key(a: Any) -> tuple:
    """A non-integer scalar by type and exact value: ``1``, ``1.0`` and ``True`` are equal in
    Python (one hash), ``0.0`` and ``-0.0`` too, but an op given one or the other can differ
    (``1 - m`` on an int64 tensor is int64, ``1.0 - m`` float32)."""
    return (type(a).__name__, repr(a))


def value_key(a: Any) -> Any:
    """:func:`meta_key` of ``a`` with every fx node (and ghost) standing for its value: the
    same as ``meta_key(tree_map(value_of, a))`` without building the mapped copy (the FLOP
    pass keys every node's cost by it)."""
    t = type(a)
    if t is Node:
        v = a.meta.get("val")
        if type(v) is FakeTensor:  # (meta_key's memo, read in line: most are)
            key = v.__dict__.get(_KEY)
            if key is not None:
                return key
        return meta_key(v)
    if t is float or t is bool:
        return scalar_key(a)
    if t in _LEAF_TYPES:
        return a
    if t is tuple or t is list or (isinstance(a, (list, tuple)) and not isinstance(a, torch.Size)):
        out = []  # (an op's arguments: nodes and integers, most of them, keyed in line)
        for x in a:
            tx = type(x)
            if tx is int:
                out.append(x)
                continue
            if tx is Node:
                v = x.meta.get("val")
                if type(v) is FakeTensor:
                    key = v.__dict__.get(_KEY)
                    if key is not None:
                        out.append(key)
                        continue
            out.append(value_key(x))
        return tuple(out)
    if t is dict:  # (most are an op's empty keyword arguments)
        return tuple([(k, value_key(v)) for k, v in sorted(a.items())]) if a else ()
    if t is GhostValue:
        return meta_key(a.val)
    return meta_key(a)


#: types that are leaves for :func:`tree_map`, :func:`leaves` and :func:`meta_key` (checked by
#: exact type first: most arguments are one of these)
_LEAF_TYPES = frozenset({int, float, bool, str, type(None), Node, torch.dtype, torch.device})


def _tensor_key(a: torch.Tensor) -> tuple:
    if getattr(a, "constant", None) is not None:
        raise TypeError("a value-carrying FakeTensor")
    return ("T", tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device)


#: where a FakeTensor's :func:`meta_key` is kept (a graph value's metadata does not change:
#: graph values are never resized in place)
_KEY = "_graphflop_meta_key"
