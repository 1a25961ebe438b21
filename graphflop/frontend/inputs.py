"""Model calls with keyword and non-tensor arguments, as graphs with tensor inputs only.

A traced graph takes one placeholder per tensor input. A model whose ``forward`` also takes
keyword arguments (``attention_mask=...``) or non-tensor arguments (``use_cache=False``) is
*bound*: :func:`bind_call` flattens ``(args, kwargs)`` (``torch.utils._pytree``), keeps the
non-tensor leaves as constants and gives the model a ``forward`` taking the tensor leaves
positionally, in flattening order (positional arguments, then keyword arguments in their
order). Parameter and module names do not change: the model's class is swapped for a subclass
of the same name whose ``forward`` rebuilds the call.

Writes no meta key.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

#: class attribute of a bound model's class: the class it was bound from
BOUND_FROM = "_graphflop_bound_from"


def split_example(example: Any) -> tuple[tuple, dict]:
    """``example_inputs()``'s value → ``(args, kwargs)``.

    Accepted forms: a tensor; a tuple or list of positional arguments; a dict of keyword
    arguments; ``(args, kwargs)``, a 2-tuple of a tuple/list and a dict.

    Raises:
        TypeError: for anything else (a bare int, a set, ...), and for an input that is an
            array but not a tensor (a NumPy array: the model would run NumPy's methods on it;
            :func:`array_inputs`), naming it.
    """
    if isinstance(example, torch.Tensor):
        return (example,), {}
    args: tuple
    if isinstance(example, dict):
        args, kwargs = (), dict(example)
    elif (
        isinstance(example, tuple)
        and len(example) == 2
        and isinstance(example[0], (tuple, list))
        and isinstance(example[1], dict)
    ):
        args, kwargs = tuple(example[0]), dict(example[1])
    elif isinstance(example, (tuple, list)):
        args, kwargs = tuple(example), {}
    elif _is_array(example):
        args, kwargs = (example,), {}
    else:
        raise TypeError(
            f"example_inputs() returned a {type(example).__name__}: return a tensor, a tuple of "
            "arguments, a dict of keyword arguments or (args, kwargs)"
        )
    arrays = array_inputs(args, kwargs)
    if arrays:
        where, x = arrays[0]
        raise TypeError(
            f"{where} is a {type(x).__module__.partition('.')[0]}.{type(x).__name__}, not a "
            "torch.Tensor: convert it with torch.as_tensor"
            + (f" ({len(arrays)} inputs are arrays)" if len(arrays) > 1 else "")
        )
    return args, kwargs


def _is_array(x: Any) -> bool:
    """An array of another library (NumPy, CuPy, JAX...) with at least one dimension: it has
    ``__array__`` or ``__dlpack__`` and a ``shape``, and is not a tensor."""
    return (
        not isinstance(x, torch.Tensor)
        and (hasattr(x, "__array__") or hasattr(x, "__dlpack__"))
        and len(getattr(x, "shape", ()) or ()) > 0
    )


def array_inputs(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The inputs of the call ``model(*args, **kwargs)`` that are arrays but not tensors, in
    flattening order, each with its place in words (``input 0``, ``input 1[2]``, ``keyword
    input 'mask'``). A non-tensor leaf is kept as a constant of the graph (``use_cache=False``);
    an array cannot be one: the model would call NumPy's methods on it (``x.flatten(1)``:
    "order must be str, not int")."""
    out = []
    for path, x in tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        if not _is_array(x):
            continue
        head, *rest = path
        first = rest[0] if rest else None
        idx = getattr(first, "idx", getattr(first, "key", "?"))
        where = f"input {idx}" if getattr(head, "idx", 0) == 0 else f"keyword input {idx!r}"
        out.append((where + keystr(tuple(rest[1:])), x))
    return out


def bind_call(model: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """Bind ``model`` to the call ``model(*args, **kwargs)`` (see the module docstring).

    Returns:
        The tensor leaves of ``(args, kwargs)``: the positional inputs of the bound model.
        A call of tensors only, positionally, leaves the model as it is.
    """
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = tuple(leaves[i] for i in slots)
    cls = getattr(type(model), BOUND_FROM, type(model))
    if not kwargs and len(slots) == len(leaves) == len(args):
        if cls is not type(model):
            model.__class__ = cls  # unbind: a plain call again
        return tensors
    template = [None if isinstance(x, torch.Tensor) else x for x in leaves]

    def forward(self: nn.Module, *ts: torch.Tensor) -> Any:
        if len(ts) != len(slots):
            raise TypeError(f"{cls.__name__} is bound to {len(slots)} tensor inputs, got {len(ts)}")
        values = list(template)
        for i, t in zip(slots, ts):
            values[i] = t
        a, kw = tree_unflatten(values, spec)
        return cls.forward(self, *a, **kw)

    bound = type(
        cls.__name__,
        (cls,),
        {
            "forward": forward,
            "__qualname__": cls.__qualname__,
            "__module__": cls.__module__,
            BOUND_FROM: cls,
        },
    )
    model.__class__ = bound
    return tensors
