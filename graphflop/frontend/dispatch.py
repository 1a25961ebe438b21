"""Data-dependent expert dispatch traced under a routing assumption: the row counts of
``torch.where(idx == e)`` (and of ``x[mask]``, ``mask.nonzero()``) where ``idx`` is a router's
top-k expert indices, taken from the routing model instead of the values.

A mixture-of-experts layer written as a loop over its experts picks each expert's tokens with
``nonzero`` of the comparison ``idx == e``: how many rows come out depends on the router's
values, which a trace on FakeTensors does not have. :class:`RoutedDispatch`, active while
tracing, follows a router's indices from ``topk`` (E experts: the size of the dimension the
top k are taken over; T·k token-expert pairs: the indices' elements) through ``== e`` (a Python
int e), views and ``any`` over the top-k dimension, and gives the ``nonzero`` behind a
function that reads such a mask the rows the routing model assigns to expert e
(:meth:`graphflop.ops.transformers_ops.Routing.expert_rows`): balanced, T·k/E each, the
remainder of T·k mod E one row each to the first experts, so that the rows sum to T·k; a
measured histogram, its counts apportioned to T·k by largest remainders. A capacity factor
is refused (a loop computes the rows it receives: no buffer, no padding, no drop), and so is a
``nonzero`` of anything not tied to a router's indices (the trace fails as before). Every size
given is recorded (:attr:`RoutedDispatch.lines`) for the report.

The ``nonzero`` node stays in the graph, with the size as its value's first dimension; the ops
after it trace with static shapes.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses import fake_impls
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from graphflop.frontend.errors import TraceError
from graphflop.ops.transformers_ops import Routing, current_routing

aten = torch.ops.aten

#: the pending size of the mask a function reads: (its shape, the rows its nonzero gives)
_PENDING: contextvars.ContextVar[tuple[tuple[int, ...], int] | None] = contextvars.ContextVar(
    "routed_nonzero", default=None
)


@dataclass(frozen=True)
class _Indices:
    """A router's top-k indices: ``experts`` (E) to choose from, ``k`` per token, the top-k
    dimension ``dim``."""

    experts: int
    k: int
    dim: int


@dataclass(frozen=True)
class _Mask:
    """A boolean mask of the pairs (or tokens) routed to ``expert`` (None: not known) among
    ``pairs`` (T·k) token-expert pairs over ``experts``."""

    experts: int
    pairs: int
    expert: int | None
    k_dim: int | None  # the top-k dimension while the mask keeps it


#: functions whose output has the same True elements as their tensor input
_VIEWS = {
    torch.Tensor.view,
    torch.Tensor.reshape,
    torch.reshape,
    torch.Tensor.flatten,
    torch.flatten,
    torch.Tensor.contiguous,
    torch.Tensor.clone,
    torch.clone,
}
_EQ = {torch.eq, torch.Tensor.eq, torch.Tensor.__eq__}
_TOPK = {torch.topk, torch.Tensor.topk}
_ANY = {torch.any, torch.Tensor.any}


#: how each of :attr:`RoutedDispatch.lines` starts (the report's other assumptions do not)
ROUTED_LINE = "data-dependent expert dispatch"


class RoutedDispatch(TorchFunctionMode):
    """While active, the ``nonzero`` of a mask ``idx == e`` (``idx`` a router's top-k indices)
    gets its size from ``routing`` (default: :func:`current_routing`).

    Raises (from the model's call):
        TraceError: such a mask under a capacity routing, or one whose expert or histogram
            count cannot be found (a compared tensor rather than an int; a histogram of
            another number of experts).
    """

    def __init__(self, routing: Routing | None = None) -> None:
        super().__init__()
        self.routing = routing or current_routing()
        self._indices: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._masks: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._routers = 0  # topk index tensors seen
        #: (E, T·k) → {expert: rows} of every size given
        self.sizes: dict[tuple[int, int], dict[int | None, int]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # no mask made yet (the common case): no argument to look for
        masks = (
            [
                (t, self._masks[t])
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t in self._masks
            ]
            if len(self._masks)
            else []
        )
        if len(masks) == 1 and func not in _VIEWS and func not in _ANY:
            t, mask = masks[0]
            with _pending(tuple(t.shape), self._rows(mask)):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        self._follow(func, args, kwargs, out)
        return out

    def following_masks(self) -> bool:
        """Whether a mask of a router's indices is known (an op given one runs inside its
        sizing)."""
        return len(self._masks) > 0

    def refusal(self, e: BaseException) -> str | None:
        """The one-line reason for a trace that failed on a ``nonzero`` (or another op whose
        output size is the values') after a router's ``topk``: the dispatch is not one this
        mode can size, and how to write it so that it is; None otherwise."""
        from graphflop.frontend.errors import exception_chain
        from graphflop.frontend.libraries import model_source_line

        chain = exception_chain(e)
        if not self._routers or not any(
            type(c).__name__ == "DynamicOutputShapeException" for c in chain
        ):
            return None
        where = next((w for w in (model_source_line(c) for c in chain) if w), None)
        at = f" at {where}" if where else ""
        return (
            f"a data-dependent size after a router's topk{at} is not tied to the routing: "
            "graphflop sizes the rows of torch.where(idx == e), idx.eq(e).nonzero() and "
            "x[(idx == e).any(-1)] (idx the topk indices, e a Python int) by --routing; pick "
            "each expert's rows that way"
        )

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.pop()
        return super().__exit__(*exc)

    @property
    def lines(self) -> list[str]:
        """One line per routed dispatch (E experts among T·k rows) sized under the routing."""
        out = []
        for (experts, pairs), rows in sorted(self.sizes.items()):
            per = ", ".join(
                f"{'?' if e is None else e}: {n}"
                for e, n in sorted(rows.items(), key=lambda x: -1 if x[0] is None else x[0])
            )
            out.append(
                f"{ROUTED_LINE} (nonzero of a router's top-k indices == e) "
                f"sized by routing {self.routing.name()}: {pairs} token-expert rows over "
                f"{experts} experts, rows per expert {{{per}}}"
            )
        return out

    def _rows(self, mask: _Mask) -> int:
        """The rows routed to the mask's expert (records them)."""
        try:
            n = self.routing.expert_rows(mask.pairs, mask.experts, mask.expert)
        except ValueError as e:
            raise TraceError(f"data-dependent expert dispatch: {e}") from None
        self.sizes.setdefault((mask.experts, mask.pairs), {})[mask.expert] = n
        return n

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Record ``out`` when it is a router's indices or a mask of them; forget a tensor
        written in place (its values are no longer the router's)."""
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and args:
            for table in (self._indices, self._masks):
                if isinstance(args[0], torch.Tensor) and args[0] in table:
                    del table[args[0]]
            return
        if func in _TOPK and isinstance(out, tuple) and len(out) == 2:
            x = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if isinstance(x, torch.Tensor) and x.dim() > 0 and isinstance(k, int):
                dim %= x.dim()
                self._indices[out[1]] = _Indices(int(x.shape[dim]), k, dim)
                self._routers += 1
            return
        if not isinstance(out, torch.Tensor):
            return
        if func in _EQ and len(args) == 2:
            a, b = args
            idx, other = (a, b) if isinstance(a, torch.Tensor) and a in self._indices else (b, a)
            if not (isinstance(idx, torch.Tensor) and idx in self._indices):
                return
            info = self._indices[idx]
            if isinstance(other, bool) or not isinstance(other, (int, torch.Tensor)):
                return
            if isinstance(other, torch.Tensor) and other.dim() != 0:
                return  # a broadcast comparison: one mask for several experts
            expert = other if isinstance(other, int) else None
            self._masks[out] = _Mask(info.experts, idx.numel(), expert, info.dim)
            return
        masks = [a for a in args[:1] if isinstance(a, torch.Tensor) and a in self._masks]
        if not masks:
            return
        mask = self._masks[masks[0]]
        if func in _VIEWS:
            self._masks[out] = _Mask(mask.experts, mask.pairs, mask.expert, None)
        elif func in _ANY and mask.k_dim is not None:
            # a token holds expert e at most once among its top k (distinct indices): the
            # tokens routed to e are as many as the pairs
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int) and dim % masks[0].dim() == mask.k_dim:
                self._masks[out] = _Mask(mask.experts, mask.pairs, mask.expert, None)


_ACTIVE: list[RoutedDispatch] = []


@contextlib.contextmanager
def routed_again() -> Iterator[None]:
    """The active :class:`RoutedDispatch` in force again where PyTorch has left the function
    modes: a custom op's fake kernel that runs a module's forward (an outlined module call,
    :mod:`graphflop.frontend.outline`). Nothing when none is active or it is in force."""
    from torch.overrides import _get_current_function_mode_stack

    if not _ACTIVE or _ACTIVE[-1] in _get_current_function_mode_stack():
        yield
        return
    with _ACTIVE[-1]:
        yield


@contextlib.contextmanager
def _pending(shape: tuple[int, ...], rows: int) -> Iterator[None]:
    token = _PENDING.set((shape, rows))
    try:
        yield
    finally:
        _PENDING.reset(token)


@contextlib.contextmanager
def routed_nonzero() -> Iterator[None]:
    """While active, FakeTensor's ``aten.nonzero`` of a tensor of the shape a
    :class:`RoutedDispatch` has made pending returns that many rows, (rows, dim) int64 with
    nonzero's column-major strides; any other ``nonzero`` fails as before (no ShapeEnv)."""
    table = fake_impls.op_implementations_dict
    original = table[aten.nonzero.default]

    def nonzero(fake_mode, func, arg):
        pending = _PENDING.get()
        if pending is None or tuple(arg.shape) != pending[0]:
            return original(fake_mode, func, arg)
        n = pending[1]
        return arg.new_empty_strided((n, arg.dim()), (1, max(n, 1)), dtype=torch.int64)

    table[aten.nonzero.default] = nonzero
    try:
        yield
    finally:
        table[aten.nonzero.default] = original


def routed_index_decompositions() -> dict[Any, Any]:
    """Decompositions of boolean-mask indexing (``x[mask]``, ``x[mask] = v``) where the mask
    is a routed one (its rows pending): the mask becomes ``nonzero(mask).unbind(1)``, integer
    indices, so that the graph's one data-dependent size is the ``nonzero``'s and the ops
    after it (their JVP and transpose too) have static shapes. Any other call is left to the
    next decomposition (NotImplemented)."""

    def index(x: torch.Tensor, indices: list) -> Any:
        ints = _mask_positions(indices)
        if ints is None:
            return NotImplemented
        return aten.index.Tensor(x, ints)

    def index_put(x: torch.Tensor, indices: list, values: torch.Tensor, accumulate=False) -> Any:
        ints = _mask_positions(indices)
        if ints is None:
            return NotImplemented
        return aten.index_put.default(x, ints, values, accumulate)

    return {aten.index.Tensor: index, aten.index_put.default: index_put}


def _mask_positions(indices: list) -> list | None:
    """``indices`` with each boolean mask of the pending shape replaced by its nonzero
    positions, one integer index per mask dimension; None when none is."""
    pending = _PENDING.get()
    if pending is None:
        return None
    out: list = []
    found = False
    for i in indices:
        if (
            isinstance(i, torch.Tensor)
            and i.dtype in (torch.bool, torch.uint8)
            and tuple(i.shape) == pending[0]
        ):
            out.extend(aten.unbind.int(aten.nonzero.default(i), 1))
            found = True
        else:
            out.append(i)
    return out if found else None
