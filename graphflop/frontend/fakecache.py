"""FakeTensorMode's dispatch cache made cheaper to hit while a model is traced, its keys and its
results unchanged.

Every ATen op a trace records runs once more in the FakeTensorMode for its output's metadata,
and FakeTensorMode answers it from its dispatch cache (process-wide: from a model's second
trace on, nearly every op is a hit: ResNet-50 b8's 386 of 386). A hit costs more than the op's
recording: the key lists each tensor argument's metadata (``extract_tensor_metadata``, then
``TensorMetadata._flatten_into``, which walks the dataclass's fields by
``dataclasses.fields`` and each shape and stride element through ``_prep_args_for_hash``), and
the output is a new ``FakeTensor`` made by its constructor (about 25 us of Python). While
:func:`fast_cache_hits` is in force, four of PyTorch's functions are replaced by versions
that give the same values for what tracing meets (static shapes, strided tensors, plain
arguments) and hand everything else to the original:

* ``extract_tensor_metadata`` of a strided tensor of static shape: the same
  ``TensorMetadata``, without asking four times whether the tensor is sparse (a strided one is
  not), its memory format kept per shape and strides (a function of the two);
* ``TensorMetadata._flatten_into``: the same key entries, in the same order (a shape or stride
  of plain ints flattened as ``_prep_args_for_hash`` flattens it: its type, ``length_<n>``,
  then ``int`` and the value per element), so that keys made here and elsewhere meet in the
  one cache;
* ``FakeTensorMode._prep_args_for_hash`` of an op's arguments that are all of the plain kinds
  (this mode's strided FakeTensors without a constant value, scalars, dtypes and devices,
  sequences of ints), told before anything is appended: the same entries;
* ``FakeTensorMode._get_output_tensor_from_cache_entry`` for a cached output that is a new
  tensor or a view of its input (not an in-place op's argument, no symbolic size, not
  conjugate or negative, not requiring grad, no shape environment): the same meta tensor
  (a view's on its input's storage), made into a FakeTensor by
  :func:`graphflop.meta.new_fake` (``FakeTensor.__new__``'s tensor without its Python).

``tests/test_fakecache.py`` compares keys and outputs with PyTorch's own. Only for the
PyTorch releases these were written against (:data:`TESTED_TORCH`, whose functions they
mirror); elsewhere, or with :data:`ENABLED` off, nothing is replaced. Like the trace's other
process-wide patches (:mod:`graphflop.frontend.composite`), not thread-safe. A hit costs about
half (an ``add`` of two tensors: 0.18 -> 0.10 ms, a loaded machine); with the stop-55 trace
changes beside it, ResNet-50 b8's trace 184 -> 154 ms and ResNet-18 b8's 96 -> 87 ms (CPU
time, medians of 20 alternated runs against the code before, a loaded machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Iterator
from typing import Any

import torch

from graphflop.meta import new_fake

__all__ = ["ENABLED", "TESTED_TORCH", "fast_cache_hits"]

#: False: PyTorch's own functions throughout (to compare; the results are the same)
ENABLED = True

#: the PyTorch releases whose fake-tensor cache these functions mirror
TESTED_TORCH = ("2.13.",)

#: ``TensorMetadata``'s fields in the order its ``_flatten_into`` walks them
_FIELDS = (
    "dtype",
    "shape",
    "stride",
    "device",
    "layout",
    "memory_format",
    "storage_offset",
    "storage_bytes",
    "requires_grad",
    "is_quantized",
    "is_conj",
    "is_neg",
    "is_inference",
    "is_sparse",
    "is_coalesced",
    "dense_dim",
    "sparse_dim",
)
#: the values of a ``TensorMetadata``'s fields, in :data:`_FIELDS`' order
_fields = operator.attrgetter(*_FIELDS)

_SEQUENCES = (tuple, list, torch.Size)
_STRIDED = torch.strided

#: the argument types whose cache-key entries are their type and value (PyTorch's last case)
_PLAIN_ARGS = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout}
    | {torch.memory_format}
)
_TENSOR_ARG, _PLAIN_ARG, _INTS_ARG = object(), object(), object()

#: per (shape, strides) of a strided tensor, the memory format its cache key names (a pure
#: function of the two: ``suggest_memory_format``, None where the tensor is not contiguous in
#: it); emptied when it reaches :data:`_FORMATS_KEPT` entries
_FORMATS: dict[tuple, Any] = {}
_FORMATS_KEPT = 4096
_UNKNOWN = object()

#: PyTorch's own functions and classes while :func:`fast_cache_hits` is in force (empty
#: otherwise)
_ORIGINAL: dict[str, Any] = {}


def _originals() -> dict[str, Any] | None:
    """PyTorch's fake-tensor functions and classes the replacements use, by name, or None
    where this PyTorch is not one of :data:`TESTED_TORCH` or they are not as expected."""
    if not ENABLED or not torch.__version__.startswith(TESTED_TORCH):
        return None
    try:
        from torch._subclasses import fake_tensor as ft
    except ImportError:  # pragma: no cover - a PyTorch that moved it
        return None
    meta_cls = getattr(ft, "TensorMetadata", None)
    mode_cls = getattr(ft, "FakeTensorMode", None)
    if meta_cls is None or mode_cls is None or not dataclasses.is_dataclass(meta_cls):
        return None
    if tuple(f.name for f in dataclasses.fields(meta_cls)) != _FIELDS:
        return None
    found = {
        "module": ft,
        "meta_cls": meta_cls,
        "mode_cls": mode_cls,
        "fake_cls": getattr(ft, "FakeTensor", None),
        "extract": getattr(ft, "extract_tensor_metadata", None),
        "suggest": getattr(ft, "suggest_memory_format", None),
        "in_kernel": getattr(ft, "in_kernel_invocation_manager", None),
        "flatten": getattr(meta_cls, "_flatten_into", None),
        "prep": getattr(mode_cls, "_prep_args_for_hash", None),
        "output": getattr(mode_cls, "_get_output_tensor_from_cache_entry", None),
    }
    return found if all(v is not None for v in found.values()) else None


@contextlib.contextmanager
def fast_cache_hits() -> Iterator[None]:
    """While active, FakeTensorMode's cache keys and hits are made by the functions above
    (where this PyTorch is one they mirror; nothing changes otherwise); PyTorch's own are put
    back on leaving. Nested, the outermost replaces them."""
    found = None if _ORIGINAL else _originals()
    if found is None:
        yield
        return
    ft, meta_cls, mode_cls = found["module"], found["meta_cls"], found["mode_cls"]
    _ORIGINAL.update(found)
    ft.extract_tensor_metadata = _extract_tensor_metadata
    meta_cls._flatten_into = _flatten_into
    mode_cls._prep_args_for_hash = _prep_args_for_hash
    mode_cls._get_output_tensor_from_cache_entry = _get_output_tensor_from_cache_entry
    try:
        yield
    finally:
        ft.extract_tensor_metadata = found["extract"]
        meta_cls._flatten_into = found["flatten"]
        mode_cls._prep_args_for_hash = found["prep"]
        mode_cls._get_output_tensor_from_cache_entry = found["output"]
        _ORIGINAL.clear()


def _extract_tensor_metadata(t: torch.Tensor) -> Any:
    """PyTorch's ``extract_tensor_metadata(t)``; for a strided tensor of static shape
    ``is_sparse_any(t)`` and ``t.is_sparse`` are False, and the memory format is kept per
    shape and strides."""
    if t.layout is not _STRIDED or t._has_symbolic_sizes_strides:
        return _ORIGINAL["extract"](t)
    shape, stride = t.shape, t.stride()
    memory_format = _FORMATS.get((shape, stride), _UNKNOWN)
    if memory_format is _UNKNOWN:
        memory_format = _ORIGINAL["suggest"](t)
        if not t.is_contiguous(memory_format=memory_format):
            memory_format = None
        if len(_FORMATS) >= _FORMATS_KEPT:
            _FORMATS.clear()
        _FORMATS[shape, stride] = memory_format
    return _ORIGINAL["meta_cls"](
        t.dtype,
        shape,
        stride,
        t.device,
        _STRIDED,
        memory_format,
        t.storage_offset(),
        t.untyped_storage().nbytes(),
        t.requires_grad,
        t.is_quantized,
        t.is_conj(),
        t.is_neg(),
        t.is_inference(),
        False,
        None,
        None,
        None,
    )


def _append_ints(result: list, value: Any) -> None:
    """What ``_prep_args_for_hash`` appends for a sequence of plain ints: its type, its
    length, then ``int`` and the value per element."""
    flat: list[Any] = [int] * (2 * len(value))
    flat[1::2] = value
    result.append(type(value))
    result.append(f"length_{len(value)}")
    result.extend(flat)


def _flatten_into(self: Any, result: list, mode: Any, state: Any) -> None:
    """PyTorch's ``TensorMetadata._flatten_into``: the same entries."""
    for value in _fields(self):
        if isinstance(value, _SEQUENCES):
            if all(type(v) is int for v in value):
                _append_ints(result, value)
            else:
                mode._prep_args_for_hash(result, value, state, [])
        elif isinstance(value, torch.SymInt):
            state.convert_sym_int(result, value)
        else:
            result.append(value)


def _prep_args_for_hash(self: Any, result: list, args: Any, state: Any, ids: list) -> None:
    """PyTorch's ``FakeTensorMode._prep_args_for_hash``: for a tuple or list of arguments of
    the plain kinds only, its entries; anything else to PyTorch's."""
    if type(args) is tuple or type(args) is list:
        kinds = _plain_kinds(self, args)
        if kinds is not None:
            result.append(type(args))
            result.append(f"length_{len(args)}")
            for a, kind in zip(args, kinds):
                if kind is _TENSOR_ARG:
                    _extract_tensor_metadata(a)._flatten_into(result, self, state)
                elif kind is _PLAIN_ARG:
                    result.append(type(a))
                    result.append(a)
                else:
                    _append_ints(result, a)
            return
    _ORIGINAL["prep"](self, result, args, state, ids)


def _plain_kinds(mode: Any, args: Any) -> list | None:
    """Per argument, how :func:`_prep_args_for_hash` flattens it; None where one is of
    another kind (PyTorch's own function then flattens them all)."""
    fake_cls = _ORIGINAL["fake_cls"]
    kinds = []
    for a in args:
        t = type(a)
        if t is fake_cls:
            if a.fake_mode is not mode or a.constant is not None or a.layout is not _STRIDED:
                return None
            kinds.append(_TENSOR_ARG)
        elif t in _PLAIN_ARGS:
            kinds.append(_PLAIN_ARG)
        elif (t is list or t is tuple) and all(type(v) is int for v in a):
            kinds.append(_INTS_ARG)
        else:
            return None
    return kinds


def _get_output_tensor_from_cache_entry(
    self: Any, state: Any, entry: Any, key: Any, func: Any, args: Any
) -> Any:
    """PyTorch's ``FakeTensorMode._get_output_tensor_from_cache_entry``; a new tensor or a
    view of static shape made into a FakeTensor by :func:`~graphflop.meta.new_fake`."""
    md = entry.metadata
    view = isinstance(func, torch._ops.OpOverload) and func.is_view
    if (
        md is None
        or entry.inplace_idx is not None
        or (entry.view_idx is not None) != view
        or self.shape_env is not None
        or md.layout is not _STRIDED
        or md.requires_grad
        or md.is_conj
        or md.is_neg
        or type(md.storage_offset) is not int
        or not all(type(v) is int for v in (*md.shape, *md.stride))
        or (view and type(args[entry.view_idx]) is not _ORIGINAL["fake_cls"])
    ):
        return _ORIGINAL["output"](self, state, entry, key, func, args)
    shape, stride = tuple(md.shape), tuple(md.stride)
    storage = args[entry.view_idx].untyped_storage() if view else None
    with _ORIGINAL["in_kernel"](self):
        empty = torch.empty_strided(shape, stride, dtype=md.dtype, layout=md.layout, device="meta")
        if storage is not None:  # (a view's storage is its input's, as PyTorch's sets it)
            empty.set_(storage, md.storage_offset, shape, stride)
    return new_fake(self, empty, md.device)
