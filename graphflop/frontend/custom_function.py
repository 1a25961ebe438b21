"""Custom ``torch.autograd.Function`` s in a traced model: their forward traced as a tagged
region, their own ``backward`` and ``jvp`` traced as graphs of their own.

``torch.func.functionalize`` (the trace's first step) runs a custom Function only when the class
overrides ``setup_context`` and supports functionalization, which few do (transformers' Bloom
``GeLUFunction`` does not). While tracing, :func:`inline_functions` makes ``Function.apply`` of
a class defined outside PyTorch call the class's ``forward`` (and ``setup_context``) with a
stand-in ``ctx``: its ATen ops land in the graph, between an ``aten.alias`` of each tensor
input and of each tensor output, and every node the call made is tagged
:data:`~graphflop.meta.FUNCTION` (:class:`~graphflop.meta.FunctionTag`: the inputs, outputs and
the tensors ``ctx`` keeps for ``backward`` and ``jvp``; an input written in place, as with
``ctx.mark_dirty(x); x.mul_(2); return x``, is the input's node before the write and the
output's after it, so the call's own ``backward`` gives the input's gradient, as in eager). After the model's trace,
:func:`trace_records` traces each call's ``backward(ctx, *grad_outputs)`` and, where the class
defines one, ``jvp(ctx, *grad_inputs)`` with ``make_fx`` on fake tensors of the saved tensors'
and outputs' (or inputs') shapes, ``ctx`` holding the call's other attributes as the forward
left them. A call that records nothing (an outlined block's forward run on FakeTensors for its
outputs' metadata, :meth:`~graphflop.frontend.outline.Outliner.fake_call`) leaves no record. The AD passes (:mod:`graphflop.ad.functions`) then differentiate the region with
those graphs, not with the rules of its forward's ops: what eager autograd runs (a
straight-through estimator's identity, a gradient reversal's negation).

A Function without ``jvp`` has no forward-mode derivative, as in PyTorch (whose forward AD
refuses it): the JVP phase is incomplete and names it. A call whose ``backward`` cannot be
traced (it reads data-dependent values, keeps a tensor ``forward`` did not make) leaves both
phases incomplete with the reason (:attr:`FunctionRecord.reason`). PyTorch's own Functions keep
their behaviour, but for the reentrant checkpoint's (:mod:`graphflop.frontend.regions`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import Function, _SingleLevelFunction
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointFunction

from graphflop.frontend import recording
from graphflop.frontend.regions import region_ids, run_checkpoint_function
from graphflop.meta import FUNCTION, FunctionTag, fresh_fake

aten = torch.ops.aten

#: the attributes of the stand-in ``ctx`` itself (not the Function's own)
_OWN = ("needs_input_grad", "saved_tensors", "materialize_grads", "_for_forward")


class _Context:
    """What a Function's ``forward(ctx, ...)`` (or ``setup_context``) may call on ``ctx``."""

    def __init__(self, args: tuple) -> None:
        self.needs_input_grad = tuple(
            isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()) for a in args
        )
        self.saved_tensors: tuple = ()
        self._for_forward: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        self._for_forward = tensors

    def mark_dirty(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


@dataclass(eq=False)
class FunctionRecord:
    """One ``Function.apply`` call met while tracing (shared by the copies of an outlined
    block that holds it).

    Attributes:
        name: the class's qualified name.
        cls: the class.
        n_inputs: arguments of ``apply``; ``tensor_inputs``: which of them are tensors.
        n_outputs: tensors among the outputs.
        n_saved: slots of ``ctx.saved_tensors`` and of tensors kept as ``ctx`` attributes
            (the backward graph's first placeholders, in this order); ``n_for_forward``: the
            tensors of ``ctx.save_for_forward`` (slots after those, the JVP graph's first
            placeholders).
        backward: ``backward`` traced: placeholders the saved tensors then one cotangent per
            output; outputs one gradient per input in ``grad_inputs``.
        grad_inputs: the inputs (by position) ``backward`` returns a tensor for.
        jvp: ``jvp`` traced, or None (the class has none): placeholders the tensors saved for
            forward then one tangent per tensor input; outputs one tangent per output.
        reason: why the call's derivatives cannot be built from its own graphs (None: they
            can).
    """

    name: str
    cls: Any
    n_inputs: int = 0
    tensor_inputs: tuple[bool, ...] = ()
    n_outputs: int = 0
    n_saved: int = 0
    n_for_forward: int = 0
    backward: GraphModule | None = None
    grad_inputs: tuple[int, ...] = ()
    jvp: GraphModule | None = None
    reason: str | None = None
    # what tracing the backward and jvp needs: the values' fakes and ctx's other attributes
    _saved: list = field(default_factory=list, repr=False)
    _attrs: dict = field(default_factory=dict, repr=False)
    _inputs: list = field(default_factory=list, repr=False)
    _outputs: list = field(default_factory=list, repr=False)
    _slots: list = field(default_factory=list, repr=False)

    @property
    def has_jvp(self) -> bool:
        return self.cls.jvp is not _SingleLevelFunction.jvp


def _own(cls: type) -> bool:
    """A Function class of the model's code, not one of PyTorch's own (checkpointing and
    friends keep their behaviour)."""
    module = getattr(cls, "__module__", "") or ""
    return module != "torch" and not module.startswith("torch.")


def _has_setup_context(cls: Any) -> bool:
    return cls.setup_context is not _SingleLevelFunction.setup_context


def _call(cls: Any, ctx: _Context, args: tuple) -> Any:
    if _has_setup_context(cls):
        out = cls.forward(*args)
        cls.setup_context(ctx, args, out)
        return out
    return cls.forward(ctx, *args)


def _apply_traced(cls: Any, args: tuple, records: list[FunctionRecord]) -> Any:
    """``cls.apply(*args)`` while tracing: the forward's nodes between aliases of the inputs
    and of the outputs, tagged as one region."""
    rec = FunctionRecord(cls.__qualname__, cls, len(args))
    records.append(rec)
    ctx = _Context(args)
    with recording.nodes_added() as made:
        ins = tuple(aten.alias.default(a) if isinstance(a, torch.Tensor) else a for a in args)
        # the inputs' nodes before the call: a write into an input (``ctx.mark_dirty(x);
        # x.mul_(2)``) makes functionalization give ``x`` a new node from the written value
        in_nodes = [recording.node_of(a) for a in ins]
        flat, spec = tree_flatten(_call(cls, ctx, ins))
        outs = [aten.alias.default(t) if isinstance(t, torch.Tensor) else t for t in flat]
        # a tensor written in place (the dirty input, returned and saved) is made again from
        # the written value lazily, where it is next read: made here, inside the region
        for t in (*outs, *ctx.saved_tensors, *ctx._for_forward, *vars(ctx).values()):
            recording.node_of(t, sync=True)
    if not made:
        # nothing recorded though a recorder is active: the outliner's first run of a block's
        # forward on FakeTensors, inside its ``repeat`` op's fake kernel, for the outputs'
        # metadata only; the block's template trace records the call. No record of this run
        # (its tensors have no node: every saved one would seem not computed from the inputs)
        records.remove(rec)
        return tree_unflatten(outs, spec)
    rec.tensor_inputs = tuple(isinstance(a, torch.Tensor) for a in args)
    roles: dict[Any, dict[str, Any]] = {}

    def mark(t: Any, what: str, k: int, node: Any = None) -> bool:
        node = recording.node_of(t) if node is None else node
        if node is None or node not in made:
            return False
        role = roles.setdefault(node, {"saved": ()})
        if what == "saved":
            role["saved"] += (k,)
        else:
            role[what] = k
        return True

    for k, a in enumerate(ins):
        if isinstance(a, torch.Tensor):
            mark(a, "input", k, in_nodes[k])
            rec._inputs.append(a)
    tensors_out = [t for t in outs if isinstance(t, torch.Tensor)]
    rec.n_outputs = len(tensors_out)
    for k, t in enumerate(tensors_out):
        mark(t, "output", k)
        rec._outputs.append(t)
    # what backward reads: saved_tensors, then tensors kept as attributes of ctx
    attrs = {k: v for k, v in vars(ctx).items() if k not in _OWN}
    kept: list[tuple[str | None, Any]] = [(None, t) for t in ctx.saved_tensors]
    kept += [(name, v) for name, v in attrs.items() if isinstance(v, torch.Tensor)]
    if any(_holds_tensor(v) for v in attrs.values() if not isinstance(v, torch.Tensor)):
        rec.reason = "its ctx keeps tensors inside a container"
    rec.n_saved = len(kept)
    kept += [(None, t) for t in ctx._for_forward]
    rec.n_for_forward = len(ctx._for_forward)
    for j, (name, t) in enumerate(kept):
        rec._slots.append(name)
        if t is None:
            rec._saved.append(None)
            continue
        if not isinstance(t, torch.Tensor) or not mark(t, "saved", j):
            rec.reason = rec.reason or (
                "it saves a tensor its forward did not compute from its inputs"
            )
        rec._saved.append(t)
    rec._attrs = {k: v for k, v in attrs.items() if not isinstance(v, torch.Tensor)}
    region = next(region_ids)
    for i, n in enumerate(made):
        role = roles.get(n, {})
        n.meta[FUNCTION] = FunctionTag(
            rec, region, i, role.get("input"), role.get("output"), role.get("saved", ())
        )
    return tree_unflatten(outs, spec)


def _holds_tensor(v: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in tree_flatten(v)[0])


@contextlib.contextmanager
def inline_functions() -> Iterator[list[FunctionRecord]]:
    """While active (tracing), ``Function.apply`` of a class outside PyTorch runs its
    ``forward`` as a tagged region (:func:`_apply_traced`), and the reentrant checkpoint's
    Function runs its function as a checkpoint region. Yields the list of the calls'
    :class:`FunctionRecord` s, filled as they are met (:func:`trace_records` completes
    them)."""
    records: list[FunctionRecord] = []
    original = Function.__dict__["apply"]

    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is CheckpointFunction:  # the reentrant checkpoint: args (function, rng, *args)
            return run_checkpoint_function(args[0], *args[2:])
        if not _own(cls) or kwargs or not recording.recording():
            return original.__get__(None, cls)(*args, **kwargs)
        return _apply_traced(cls, args, records)

    Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield records
    finally:
        Function.apply = original  # type: ignore[method-assign]


def _fake_like(fake_mode: Any, t: torch.Tensor) -> torch.Tensor:
    return fresh_fake(fake_mode, t.shape, t.stride(), t.dtype, t.device)


def _replayed_ctx(rec: FunctionRecord, saved: list, for_forward: list) -> _Context:
    """A ``ctx`` as the forward left it, its tensors replaced by ``saved`` (the backward's or
    the JVP graph's placeholders)."""
    ctx = _Context(tuple(rec._inputs))
    vars(ctx).update(rec._attrs)
    plain = [t for name, t in zip(rec._slots, saved) if name is None]
    ctx.saved_tensors = tuple(plain)
    for name, t in zip(rec._slots[: rec.n_saved], saved):
        if name is not None:
            setattr(ctx, name, t)
    if for_forward:  # within jvp, ctx.saved_tensors are the tensors saved for forward
        ctx.saved_tensors = tuple(for_forward)
    return ctx


def trace_records(records: list[FunctionRecord], table: dict, fake_mode: Any) -> None:
    """Trace each record's ``backward`` and ``jvp`` (module docstring) with the trace's
    decomposition ``table`` in ``fake_mode``; a failure becomes the record's ``reason``."""
    from graphflop.frontend.errors import first_line

    for rec in records:
        # fresh fakes in place of the trace's own (functionalised, proxied) tensors
        rec._saved = [
            _fake_like(fake_mode, t) if isinstance(t, torch.Tensor) else None for t in rec._saved
        ]
        rec._inputs = [_fake_like(fake_mode, t) for t in rec._inputs]
        rec._outputs = [_fake_like(fake_mode, t) for t in rec._outputs]
        if rec.reason is not None:
            continue
        try:
            _trace_backward(rec, table, fake_mode)
            if rec.has_jvp:
                _trace_jvp(rec, table, fake_mode)
        except Exception as e:
            why = f"{type(e).__name__}: {first_line(e)}"
            if "DataDependent" in type(e).__name__:
                why += "; its backward or jvp reads tensor values in Python (.item(), if on a "
                why += "tensor): write it with tensor ops (torch.where) to have it counted"
            rec.reason = f"tracing its own derivative failed ({why})"


def _trace_backward(rec: FunctionRecord, table: dict, fake_mode: Any) -> None:
    saved = rec._saved[: rec.n_saved]
    returned: list[int] = []

    def backward(*flat: Any) -> tuple:
        it = iter(flat)
        ctx = _replayed_ctx(rec, [None if s is None else next(it) for s in saved], [])
        grads = list(it)
        res = rec.cls.backward(ctx, *grads)
        res = res if isinstance(res, tuple) else (res,)
        returned[:] = [k for k, r in enumerate(res) if isinstance(r, torch.Tensor)]
        return tuple(r for r in res if isinstance(r, torch.Tensor))

    fakes = [_fake_like(fake_mode, t) for t in saved if t is not None]
    fakes += [_fake_like(fake_mode, t) for t in rec._outputs]
    rec.backward = make_fx(torch.func.functionalize(backward), decomposition_table=table)(*fakes)
    rec.grad_inputs = tuple(returned)


def _trace_jvp(rec: FunctionRecord, table: dict, fake_mode: Any) -> None:
    saved = rec._saved[: rec.n_saved]
    for_forward = rec._saved[rec.n_saved :]

    def jvp(*flat: Any) -> tuple:
        it = iter(flat)
        ctx = _replayed_ctx(
            rec,
            [None if s is None else next(it) for s in saved],
            [None if s is None else next(it) for s in for_forward],
        )
        tangents = [next(it) if is_t else None for is_t in rec.tensor_inputs]
        res = rec.cls.jvp(ctx, *tangents)
        res = res if isinstance(res, tuple) else (res,)
        return tuple(r for r in res if isinstance(r, torch.Tensor))

    fakes = [_fake_like(fake_mode, t) for t in saved + for_forward if t is not None]
    fakes += [_fake_like(fake_mode, t) for t in rec._inputs]
    rec.jvp = make_fx(torch.func.functionalize(jvp), decomposition_table=table)(*fakes)
