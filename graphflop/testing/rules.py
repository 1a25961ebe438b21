"""Temporary changes to the rule table, for tests: add, replace or remove a rule inside a
``with`` block and get the table back exactly as it was afterwards, whatever the block raised.

    from graphflop.testing import temporary_rule, without_rule

    with temporary_rule(torch.ops.aten.i0.default, cost=per_output(1), family="elementwise"):
        ...  # i0 is counted here
    with without_rule(torch.ops.mylib.scale.default):
        ...  # and has no rule here (MissingRuleError)

These restore the one op they touch. :func:`restored_rules` snapshots the whole table, for a block
that registers rules through the public API (``graphflop.register_rule``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from graphflop.meta import NodeCost
from graphflop.ops import registry


def _restore(op: Any, saved: registry.OpRule | None) -> None:
    # the table is module state read by every pass: edit it in place, never rebind it
    if saved is None:
        registry._TABLE.pop(op, None)
    else:
        registry._TABLE[op] = saved


@contextmanager
def temporary_rule(
    op: Any,
    *,
    cost: Callable[..., NodeCost],
    family: str = "custom",
    bytes: str = "compute",
    jvp: Callable[..., Any] | None = None,
    transpose: Callable[..., Any] | None = None,
    zero_derivative: bool = False,
) -> Iterator[registry.OpRule]:
    """Register a rule for ``op`` for the duration of the block (replacing any it had) and yield
    it; afterwards ``op`` has the rule it had before, or none. Arguments as for
    :func:`graphflop.ops.registry.register`.

    Raises:
        ValueError: on an unknown family or byte policy (the table is left unchanged).
    """
    saved = registry._TABLE.get(op)
    rule = registry.register(
        op,
        family,
        cost,
        bytes=bytes,
        jvp=jvp,
        transpose=transpose,
        zero_derivative=zero_derivative,
    )
    try:
        yield rule
    finally:
        _restore(op, saved)


@contextmanager
def without_rule(op: Any) -> Iterator[None]:
    """Remove ``op``'s rule (if any) for the duration of the block; afterwards ``op`` has the
    rule it had before, or none. Rules registered for ``op`` inside the block are dropped."""
    saved = registry._TABLE.pop(op, None)
    try:
        yield
    finally:
        _restore(op, saved)


@contextmanager
def restored_rules() -> Iterator[None]:
    """Snapshot the whole rule table; on leaving the block, put it back exactly (rules added
    inside are removed, replaced or removed ones come back)."""
    saved = dict(registry._TABLE)
    try:
        yield
    finally:
        registry._TABLE.clear()
        registry._TABLE.update(saved)
