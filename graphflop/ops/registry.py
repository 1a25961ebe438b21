"""The rule table: one :class:`OpRule` per ATen op overload.

Each rule holds the op's cost (a pure function of shapes), how it moves bytes, and, where the op
is differentiable, its JVP rule and, for ops linear in some inputs, its transpose rule. Every pass
(FLOPs, memory, JVP, VJP, export) reads this table and nothing else, so an op's rules live in one
place and cannot disagree between passes (docs/architecture.md, "Adding an op").

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

Ops without rules of their own are traced as their parts: :func:`register_decomposition` gives an
op graphflop's decomposition, :func:`use_torch_decomposition` PyTorch's, and
:func:`decomposition_table` assembles the table tracing uses from both, over PyTorch's core-ATen
set. So an op's cost, JVP, transpose and decomposition all sit in its family's file.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch._ops import OpOverload

from graphflop.meta import NodeCost
from graphflop.ops.ghost import is_ghost

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
    "sorting",
    "spectral",
    "recurrent",
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
    #: what else than the nodes' metadata the cost depends on (a hashable value, e.g. the
    #: routing assumption of mixture-of-experts products), for the cost cache; None: nothing
    context: Callable[[], Any] | None = None


class MissingRuleError(LookupError):
    """Raised when an op has no rule (or lacks the kind of rule a pass needs)."""

    def __init__(self, op: Any, kinds: tuple[str, ...] = ("cost",), node: str | None = None):
        self.op, self.kinds, self.node = op, kinds, node
        where = f" (node {node})" if node else ""
        fam = guess_family(op)
        new = "" if (Path(__file__).parent / f"{fam}.py").exists() else "a new "
        super().__init__(
            f"no {'/'.join(kinds)} rule for {op_name(op)}{where}: add one in "
            f"{new}graphflop/ops/{fam}.py, or register it with graphflop.register_rule"
        )


_TABLE: dict[Any, OpRule] = {}
#: op namespaces whose rules are registered when an op of theirs is first looked up (the ops
#: exist only once their library has defined them): namespace -> "module:function"
_LIBRARY_RULES = {"transformers": "graphflop.ops.transformers_ops:register_transformers_rules"}
#: ops whose rule a user registered (``graphflop.register_rule``) rather than graphflop
_USER_OPS: set[Any] = set()
#: op overload -> graphflop's decomposition (see :func:`register_decomposition`)
_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {}
#: ops (overloads or packets) traced with PyTorch's own decomposition
_TORCH_DECOMPOSED: list[Any] = []

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _rule(op: Any) -> OpRule | None:
    """``op``'s rule, registering its library's rules first when ``op`` is a library's op
    that has none yet (:data:`_LIBRARY_RULES`)."""
    rule = _TABLE.get(op)
    if rule is None and isinstance(op, OpOverload) and op.namespace in _LIBRARY_RULES:
        module, _, fn = _LIBRARY_RULES[op.namespace].partition(":")
        getattr(importlib.import_module(module), fn)()
        rule = _TABLE.get(op)
    return rule


def op_name(op: Any) -> str:
    """``aten.mm.default`` style name of an op overload (or ``repr`` for other callables)."""
    if isinstance(op, OpOverload):
        return f"{op.namespace}.{op._schema.name.split('::')[-1]}.{op._overloadname}"
    return getattr(op, "__name__", repr(op))


#: (name fragments, rule file) in the order :func:`guess_family` tries them
_FAMILY_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("conv",), "conv"),
    (("fft", "view_as_real", "view_as_complex", "conj", "complex"), "spectral"),
    (("sort", "topk", "kthvalue", "median"), "sorting"),
    (("lstm", "gru", "rnn"), "recurrent"),
    (("embedding",), "embedding"),
    (("svd", "solve", "linalg", "cholesky", "qr", "eig", "inverse", "det"), "linalg"),
    (("mm", "matmul", "dot", "einsum", "linear"), "linalg"),
    (("attention",), "attention"),
    (("pool",), "pool"),
    (("norm",), "norm"),
    (("loss", "nll", "softmax"), "loss"),
    (("sum", "mean", "amax", "amin", "var", "prod", "max", "min", "cum", "std"), "reduction"),
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
)


def guess_family(op: Any) -> str:
    """The rule file (``graphflop/ops/<name>.py``) an op most likely belongs in, for error
    messages: sorting ops in ``sorting``, the FFT family in ``spectral``, recurrent layers in
    ``recurrent``, decompositions and solvers in ``linalg``, in-place ops with their functional
    form; ``elementwise`` when nothing else fits."""
    name = op_name(op).split(".")
    base = name[1] if len(name) > 1 else name[0]
    if base.endswith("_") and not base.startswith("_"):
        base = base[:-1]
    for keys, fam in _FAMILY_HINTS:
        if any(k in base for k in keys):
            return fam
    return "elementwise"


#: whether a missing rule raises (``--strict``) or is reported as a gap (the default)
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("graphflop_strict", default=False)


@contextlib.contextmanager
def strict_rules(strict: bool = True) -> Iterator[None]:
    """Within the block, an op without a rule raises :class:`MissingRuleError` (``strict``) or
    is counted as 0 FLOPs and cuts the JVP/backward at its node (partial results, the
    default outside the block)."""
    token = _STRICT.set(strict)
    try:
        yield
    finally:
        _STRICT.reset(token)


def is_strict() -> bool:
    """True inside :func:`strict_rules`: a missing rule is an error, not a gap."""
    return _STRICT.get()


def missing_kinds(op: Any) -> tuple[str, ...]:
    """The kinds of rule ``op`` lacks: ``cost`` (no rule at all), ``jvp``, ``transpose``."""
    rule = _rule(op)
    if rule is None:
        return ("cost", "jvp", "transpose")
    out = []
    if rule.jvp is None and not rule.zero_derivative:
        out.append("jvp")
    if rule.transpose is None:
        out.append("transpose")
    return tuple(out)


def register(
    op: Any,
    family: str,
    cost: Callable[..., NodeCost],
    *,
    bytes: str = "compute",
    jvp: Callable[..., Any] | None = None,
    transpose: Callable[..., Any] | None = None,
    zero_derivative: bool = False,
    context: Callable[[], Any] | None = None,
) -> OpRule:
    """Add or replace the rule for ``op``. Returns the rule. ``context``: what the cost
    depends on besides the nodes' metadata (:attr:`OpRule.context`).

    Raises:
        ValueError: on an unknown family or byte policy.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown op family {family!r}; one of {FAMILIES}")
    if bytes not in BYTE_POLICIES:
        raise ValueError(f"unknown byte policy {bytes!r}; one of {BYTE_POLICIES}")
    rule = OpRule(op, family, cost, bytes, jvp, transpose, zero_derivative, context)
    _TABLE[op] = rule
    return rule


def register_user(
    op: Any,
    family: str,
    cost: Callable[..., NodeCost],
    *,
    override: bool = False,
    **rules: Any,
) -> OpRule:
    """:func:`register` for a user's rule (``graphflop.register_rule``): an op that already has a
    rule is refused unless ``override``; with ``override`` the given fields replace the old
    rule's and the others (``None`` ones: ``jvp``, ``transpose``) are kept.

    Raises:
        ValueError: ``op`` has a rule and ``override`` is false; an unknown family or policy.
    """
    old = _TABLE.get(op)
    if old is None:
        _USER_OPS.add(op)
        return register(op, family, cost, **rules)
    if not override:
        raise ValueError(
            f"{op_name(op)} already has a rule (family {old.family}); pass override=True to "
            "replace its cost (its other rules are kept unless given)"
        )
    kept = {k: v for k, v in rules.items() if v is not None}
    merged = {"jvp": old.jvp, "transpose": old.transpose, "zero_derivative": old.zero_derivative}
    return register(op, family, cost, **{**merged, **kept})


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
    rule = _rule(op)
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
    """True when ``op`` has a rule (of any kind)."""
    return _rule(op) is not None


def all_rules(*, user: bool = True, library: bool = True) -> dict[Any, OpRule]:
    """A copy of the table, for coverage reports; ``user=False``: without the ops only a
    user's rule covers (``graphflop.register_rule`` of an op graphflop has no rule for);
    ``library=False``: without the ops of other libraries (:data:`_LIBRARY_RULES`), whose
    rules are in the table only once a graph has held one."""
    return {
        op: r
        for op, r in _TABLE.items()
        if (user or op not in _USER_OPS)
        and (library or getattr(op, "namespace", None) not in _LIBRARY_RULES)
    }


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
    return isinstance(a, torch.fx.Node) or is_ghost(a)


# --- decompositions ----------------------------------------------------------------------------


def register_decomposition(
    *ops: Any, dtypes: Sequence[torch.dtype] | None = None
) -> Callable[[_Fn], _Fn]:
    """Decorator: trace each of ``ops`` (overloads) as the decorated function, which takes the
    op's arguments and returns its outputs computed with other ATen ops (each with a rule).

    ``dtypes``: use it only when the first argument has one of these dtypes; otherwise PyTorch's
    own decomposition of the op (a lean float32/float64 version of a decomposition whose
    reference implementation also handles reduced precision). Returns the function unchanged.
    A plain op overload may be given as the function (an in-place view traced as its
    functional form).
    """

    def deco(fn: _Fn) -> _Fn:
        for op in ops:
            _DECOMPOSITIONS[op] = fn if dtypes is None else _by_dtype(op, fn, tuple(dtypes))
        return fn

    return deco


def use_torch_decomposition(*ops: Any) -> None:
    """Trace ``ops`` (overloads or overload packets) with PyTorch's own decompositions
    (``torch._decomp``), where PyTorch's core-ATen set keeps them whole."""
    _TORCH_DECOMPOSED.extend(ops)


def torch_decomposition(op: Any) -> Callable[..., Any] | None:
    """PyTorch's decomposition of the overload ``op``, or ``None`` when it has none."""
    from torch._decomp import decomposition_table as torch_table

    return torch_table.get(op)


def decomposition_table() -> dict[Any, Callable[..., Any]]:
    """The decomposition table tracing uses (a new dict): PyTorch's core-ATen decompositions,
    PyTorch's own for the ops given to :func:`use_torch_decomposition`, and graphflop's
    (:func:`register_decomposition`) over both. Import :mod:`graphflop.ops` first: the rule
    files register them."""
    from torch._decomp import get_decompositions

    key = tuple(_TORCH_DECOMPOSED)
    if _TORCH_TABLE.get("key") != key:  # PyTorch's part: built once per process
        base = core_aten_table()
        base.update(get_decompositions(_TORCH_DECOMPOSED))
        _TORCH_TABLE.update(key=key, table=base)
    table: dict[Any, Callable[..., Any]] = dict(_TORCH_TABLE["table"])
    table.update(_DECOMPOSITIONS)
    for op in _KEPT:
        table.pop(op, None)
    return table


#: ops PyTorch's core-ATen table decomposes that tracing keeps (:func:`keep_in_graph`)
_KEPT: set[Any] = set()


def keep_in_graph(op: Any) -> None:
    """Trace ``op`` as itself although PyTorch's core-ATen table decomposes it: ``detach``
    becomes ``alias`` there, a view through which gradients would flow, so a model's
    ``.detach()`` (a stop-gradient) would be differentiated through."""
    _KEPT.add(op)


#: PyTorch's part of :func:`decomposition_table`, for the ``use_torch_decomposition`` list
#: it was built with
_TORCH_TABLE: dict[str, Any] = {}


def core_aten_table() -> dict[Any, Callable[..., Any]]:
    """PyTorch's core-ATen decomposition table, ``dict(torch._decomp.core_aten_decompositions())``
    (the same keys, and the same functions or the same CompositeImplicitAutograd kernels), built
    without walking every op of every namespace.

    ``torch.export``'s table holds PyTorch's post-autograd decompositions plus, for each
    CompositeImplicitAutograd (CIA) op that export would preserve and that is not among them
    (nor in export's preserved list, for ATen ops), its CIA kernel. Export finds the CIA ops by
    creating and checking all ~2,600 overloads of every namespace (0.2-0.3 s of CPU); a CIA op is
    either registered with the C++ dispatcher (listed by
    ``torch._C._dispatch_get_registrations_for_dispatch_key``) or has a Python CIA kernel, which
    only an overload object that already exists can have, so only those are checked here.
    ``tests/test_imports.py`` compares the two tables.
    """
    from torch._decomp import _core_aten_decompositions_post_autograd
    from torch._export.utils import _get_decomp_for_cia, _is_preservable_cia_op
    from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS

    table: dict[Any, Callable[..., Any]] = dict(_core_aten_decompositions_post_autograd())
    cia = [op for op in _cia_candidates() if _is_preservable_cia_op(op)]
    # ATen's first (export builds them at construction), then the other namespaces'
    for aten_first in (True, False):
        for op in cia:
            if (op.namespace == "aten") != aten_first or op in table:
                continue
            if not aten_first or op not in PRESERVED_ATEN_CIA_OPS:
                table[op] = _get_decomp_for_cia(op)
    return table


def _cia_candidates() -> list[Any]:
    """Overloads that may have a CompositeImplicitAutograd kernel: those registered in C++, then
    the existing overloads with a Python one (the C++ ones created first, as export does)."""
    found: dict[Any, None] = {}
    for name in torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"):
        namespace, _, rest = name.partition("::")
        op, _, overload = rest.partition(".")
        found[getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")] = None
    cia = torch._C.DispatchKey.CompositeImplicitAutograd
    for namespace in list(torch.ops):
        ns = getattr(torch.ops, namespace)
        if not isinstance(ns, torch._ops._OpNamespace):
            continue
        for packet_name in list(ns):
            packet = getattr(ns, packet_name)
            for overload in list(vars(packet).values()):
                if isinstance(overload, OpOverload) and cia in overload.py_kernels:
                    found[overload] = None
    return list(found)


def _by_dtype(op: Any, fn: Callable[..., Any], dtypes: tuple[torch.dtype, ...]) -> Callable:
    """``fn`` for a first argument of one of ``dtypes``, PyTorch's decomposition otherwise."""
    fallback = torch_decomposition(op)
    if fallback is None:
        raise ValueError(f"{op_name(op)} has no PyTorch decomposition to fall back to")

    def decomposed(x: Any, *args: Any, **kwargs: Any) -> Any:
        if x.dtype in dtypes:
            return fn(x, *args, **kwargs)
        return fallback(x, *args, **kwargs)

    decomposed.__name__ = getattr(fn, "__name__", "decomposed")
    decomposed.__doc__ = fn.__doc__
    return decomposed
