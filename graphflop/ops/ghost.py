"""The ghost type: a value the AD passes decided not to compute.

A :class:`GhostValue` stands for a symbolic zero that would have been non-zero had the value
required a gradient (the model input's tangent, the first layer's input cotangent). Rules receive
ghosts as arguments like any graph value; the builder (:mod:`graphflop.ad.builder`) turns a call
whose tensor arguments are ghosts (and no real tangent) into another ghost and records the
:class:`~graphflop.meta.Ghost` of the work saved, so it can be reported.

:func:`is_ghost` is the one check for a ghost; nothing else should test for the type.
:class:`~graphflop.meta.GhostLinks` (the frozen value of ``gm.meta[GHOST_LINKS]`` on a JVP graph)
is re-exported here.

Writes no meta key itself; a ghost's ``meta`` mapping mirrors the two keys rules read from graph
values (``val`` and ``PARAM_DERIVED``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from graphflop.meta import PARAM_DERIVED, Ghost, GhostLinks

__all__ = ["GHOST_KINDS", "GhostLinks", "GhostValue", "ghost_ids", "is_ghost"]

#: numbering of ghosts (``ghost_<n>``), shared by every builder in the process
ghost_ids = itertools.count()

#: kinds a ghost can have: ``tangent``/``cotangent`` (linear in the differentiated data) or
#: ``coef`` (a primal-only value)
GHOST_KINDS = ("tangent", "cotangent", "coef")


@dataclass(frozen=True, eq=False)
class GhostValue:
    """A value that was not computed.

    Attributes:
        val: its FakeTensor (shape, dtype and device of the value it stands for).
        op: the op overload that would have made it (``None`` for a ghost input).
        args: that op's arguments (graph values, ghosts and constants).
        kwargs: that op's keyword arguments.
        record: its :class:`~graphflop.meta.Ghost` record (``None`` for a ghost input).
        param_derived: computed from parameters only (its cotangent is a weight gradient).
        kind: one of :data:`GHOST_KINDS`.
        name: ``record.name``, else a fresh ``ghost_<n>``.
        meta: ``{"val": val, PARAM_DERIVED: param_derived}``, so rules can read a ghost as they
            read a node (read it only).

    Compared and hashed by identity.
    """

    val: Any
    op: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    record: Ghost | None = None
    param_derived: bool = False
    kind: str = "tangent"
    name: str = field(init=False)
    meta: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        name = self.record.name if self.record else f"ghost_{next(ghost_ids)}"
        if self.kwargs is None:
            object.__setattr__(self, "kwargs", {})
        object.__setattr__(self, "name", name)
        meta = {"val": self.val, PARAM_DERIVED: self.param_derived}
        object.__setattr__(self, "meta", meta)


def is_ghost(a: Any) -> TypeGuard[GhostValue]:
    """True when ``a`` is a :class:`GhostValue` (the one ghost check)."""
    return isinstance(a, GhostValue)
