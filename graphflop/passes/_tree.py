"""Mapping over op arguments: tuples, lists and dicts of graph values and constants.

``torch.utils._pytree`` does the same for any registered container, at several times the cost;
the passes call these once or more per emitted node, so they stay small and plain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def tree_map(fn: Callable[[Any], Any], x: Any) -> Any:
    """``x`` with ``fn`` applied to every leaf (anything but a tuple, list or dict)."""
    t = type(x)
    if t is tuple or t is list:
        return t(tree_map(fn, y) for y in x)
    if t is dict:
        return {k: tree_map(fn, v) for k, v in x.items()}
    if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
        return type(x)(tree_map(fn, y) for y in x)  # fx's immutable_list, named tuples aside
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
