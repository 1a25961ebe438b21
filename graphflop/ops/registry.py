"""The rule table: one :class:`OpRule` per ATen op overload.

Each rule holds the op's cost (a pure function of shapes), how it moves bytes, and, where the op
is differentiable, its JVP rule and, for ops linear in some inputs, its transpose rule. Every pass
(FLOPs, memory, JVP, VJP, export) reads this table and nothing else (ARCHITECTURE.md, principle 2).

Rule signatures (``b`` is a builder from :mod:`graphflop.ad.builder`):

``cost(out, *args, **kwargs) -> NodeCost``
    ``args``/``kwargs`` as in the call, with FakeTensors where the graph had nodes; ``out`` the
    output FakeTensor (or tuple). Only the FLOP fields are filled; bytes come from the policy.
``jvp(b, out, args, tangents, kwargs) -> tangent | tuple``
    ``args`` are the primal arguments (nodes of the new graph or constants), ``tangents`` one per
    positional argument (``None`` is a symbolic zero; lists for list arguments), ``out`` the primal
    output node. Returns the output tangent (``None`` for zero) or a tuple for multi-output ops.
``transpose(b, ct, args, kwargs, linear) -> list``
    ``ct`` is the cotangent of the node's output, ``linear[i]`` says whether positional argument
    ``i`` is a tangent. Returns one cotangent (or ``None``) per positional argument.

Registration helpers in the style of JAX's ``ad.py``: :func:`def_jvp`, :func:`def_linear`
(the JVP is the op itself applied to the tangents), :func:`def_bilinear` and :func:`def_zero`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._ops import OpOverload

from graphflop.meta import NodeCost

#: How an op moves memory: ``compute`` reads its tensor inputs and writes its outputs, ``view``
#: moves nothing (it aliases its input), ``copy`` reads and writes but costs no FLOPs,
#: ``gather`` (lookups: embedding, index_select, gather, advanced indexing) reads only the rows
#: it gathers (its output's bytes) and the index tensors, not the whole source.
BYTE_POLICIES = ("compute", "view", "copy", "gather")

FAMILIES = (
    "linalg",
    "conv",
    "elementwise",
    "reduction",
    "shape",
    "norm",
    "pool",
    "loss",
    "attention",
    "embedding",
    "creation",
    "custom",
)


@dataclass(frozen=True)
class OpRule:
    """Everything graphflop knows about one ATen op overload."""

    op: Any
    family: str
    cost: Callable[..., NodeCost]
    bytes: str = "compute"
    jvp: Callable[..., Any] | None = None
    transpose: Callable[..., Any] | None = None
    zero_derivative: bool = False


class MissingRuleError(LookupError):
    """Raised when an op has no rule (or lacks the kind of rule a pass needs)."""

    def __init__(self, op: Any, kinds: tuple[str, ...] = ("cost",), node: str | None = None):
        self.op, self.kinds, self.node = op, kinds, node
        where = f" (node {node})" if node else ""
        fam = guess_family(op)
        super().__init__(
            f"no {'/'.join(kinds)} rule for {op_name(op)}{where}: add one in "
            f"graphflop/ops/{fam}.py, or register it with graphflop.register_rule"
        )


_TABLE: dict[Any, OpRule] = {}


def op_name(op: Any) -> str:
    """``aten.mm.default`` style name of an op overload (or ``repr`` for other callables)."""
    if isinstance(op, OpOverload):
        return f"{op.namespace}.{op._schema.name.split('::')[-1]}.{op._overloadname}"
    return getattr(op, "__name__", repr(op))


def guess_family(op: Any) -> str:
    """The rule file an op most likely belongs in, for error messages."""
    name = op_name(op)
    table = [
        (("conv",), "conv"),
        (("mm", "matmul", "dot", "einsum", "linear", "baddbmm"), "linalg"),
        (("attention",), "attention"),
        (("pool",), "pool"),
        (("norm",), "norm"),
        (("loss", "nll", "softmax"), "loss"),
        (("embedding",), "embedding"),
        (
            ("sum", "mean", "amax", "amin", "var", "prod", "max", "min", "cumsum", "std"),
            "reduction",
        ),
        (
            (
                "view",
                "permute",
                "reshape",
                "squeeze",
                "expand",
                "cat",
                "slice",
                "select",
                "clone",
                "transpose",
                "alias",
                "split",
                "stack",
                "pad",
                "gather",
                "scatter",
                "index",
            ),
            "shape",
        ),
        (("full", "zeros", "ones", "empty", "arange", "rand", "scalar_tensor"), "creation"),
    ]
    for keys, fam in table:
        if any(k in name for k in keys):
            return fam
    return "elementwise"


def register(
    op: Any,
    family: str,
    cost: Callable[..., NodeCost],
    *,
    bytes: str = "compute",
    jvp: Callable[..., Any] | None = None,
    transpose: Callable[..., Any] | None = None,
    zero_derivative: bool = False,
) -> OpRule:
    """Add or replace the rule for ``op``. Returns the rule.

    Raises:
        ValueError: on an unknown family or byte policy.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown op family {family!r}; one of {FAMILIES}")
    if bytes not in BYTE_POLICIES:
        raise ValueError(f"unknown byte policy {bytes!r}; one of {BYTE_POLICIES}")
    rule = OpRule(op, family, cost, bytes, jvp, transpose, zero_derivative)
    _TABLE[op] = rule
    return rule


def update(op: Any, **changes: Any) -> OpRule:
    """Replace some fields of an existing rule (used by the JVP/transpose helpers)."""
    rule = replace(_TABLE[op], **changes)
    _TABLE[op] = rule
    return rule


def lookup(op: Any, *, need: tuple[str, ...] = ("cost",), node: str | None = None) -> OpRule:
    """The rule for ``op``, checked to have each of ``need`` (``cost``, ``jvp``, ``transpose``).

    Raises:
        MissingRuleError: naming the op, the node and the rule file it belongs in.
    """
    rule = _TABLE.get(op)
    if rule is None:  # nothing registered: every kind of rule is missing
        raise MissingRuleError(op, ("cost", "jvp", "transpose"), node)
    missing = tuple(
        k
        for k in need
        if (k == "jvp" and rule.jvp is None and not rule.zero_derivative)
        or (k == "transpose" and rule.transpose is None)
    )
    if missing:
        raise MissingRuleError(op, missing, node)
    return rule


def has_rule(op: Any) -> bool:
    return op in _TABLE


def all_rules() -> dict[Any, OpRule]:
    """A copy of the table, for coverage reports."""
    return dict(_TABLE)


# --- registration helpers (JAX style) -------------------------------------------------------


def def_jvp(op: Any) -> Callable[[Callable], Callable]:
    """Decorator: set ``op``'s JVP rule."""

    def deco(fn: Callable) -> Callable:
        update(op, jvp=fn)
        return fn

    return deco


def def_transpose(op: Any) -> Callable[[Callable], Callable]:
    """Decorator: set ``op``'s transpose rule."""

    def deco(fn: Callable) -> Callable:
        update(op, transpose=fn)
        return fn

    return deco


def def_linear(op: Any, transpose: Callable[..., Any]) -> None:
    """``op`` is linear in its tensor arguments jointly: its JVP applies ``op`` to the tangents
    (a symbolic zero in, a symbolic zero out) and ``transpose`` gives its transpose."""

    def jvp(b, out, args, tangents, kwargs):
        ts = [t for t in tangents if t is not None]
        if not ts:
            return None
        new_args = [tangents[i] if is_tensor_arg(a) else a for i, a in enumerate(args)]
        if any(t is None for a, t in zip(args, tangents) if is_tensor_arg(a)):
            # a linear op applied to a mix of zero and non-zero tangents: materialise the zeros
            new_args = [
                b.zeros_like(a) if is_tensor_arg(a) and t is None else na
                for a, t, na in zip(args, tangents, new_args)
            ]
        return b.call(op, *new_args, **kwargs)

    update(op, jvp=jvp, transpose=transpose)


def def_bilinear(op: Any, transpose: Callable[..., Any]) -> None:
    """``op(x, y)`` is linear in each argument separately: ``d op = op(dx, y) + op(x, dy)``."""

    def jvp(b, out, args, tangents, kwargs):
        x, y = args[0], args[1]
        tx, ty = tangents[0], tangents[1]
        rest = list(args[2:])
        t1 = b.call(op, tx, y, *rest, **kwargs) if tx is not None else None
        t2 = b.call(op, x, ty, *rest, **kwargs) if ty is not None else None
        return b.add(t1, t2)

    update(op, jvp=jvp, transpose=transpose)


def def_zero(op: Any) -> None:
    """``op``'s output does not depend differentiably on its inputs (comparisons, integer ops,
    random numbers, constants): its tangent is a symbolic zero."""
    update(op, zero_derivative=True)


def is_tensor_arg(a: Any) -> bool:
    """True for graph values standing for tensors (fx nodes and ghosts)."""
    return isinstance(a, torch.fx.Node) or getattr(a, "is_ghost", False)
