"""Custom ``torch.autograd.Function`` calls in the AD passes: their tangent is their own
``jvp``, their transpose their own ``backward``.

Tracing leaves each call's forward ops in the forward graph, tagged
:data:`~graphflop.meta.FUNCTION`, and the class's ``backward`` and ``jvp`` traced as graphs
(:mod:`graphflop.frontend.custom_function`). The JVP builder does not differentiate the
region's ops: at the call's last node it emits the call's ``jvp`` graph on the tangents of the
call's inputs (:func:`emit_tangent`) and logs one :class:`FunctionEntry` in place of those
nodes; the transpose pass turns the entry into the call's ``backward`` graph on the cotangents
of its outputs (:func:`transpose`), reading the saved tensors as residuals. A class without
``jvp`` has no tangent: the JVP graph is cut there (a gap naming it, as PyTorch's forward AD
refuses it), and the linearization the backward is built from instead holds one opaque node
per output (:func:`no_jvp`, never run, only transposed).

Reads ``FUNCTION``, ``MODULE``, ``KIND``, ``PARAM_DERIVED``; writes nothing of its own (the
builders tag what they emit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from graphflop.ad.builder import Builder, emit
from graphflop.meta import (
    FUNCTION,
    FUNCTION_LABEL,
    KIND,
    MODULE,
    PARAM_DERIVED,
    ROLE,
    SOURCE,
    Gap,
    occurrences,
)
from graphflop.ops.ghost import is_ghost

aten = torch.ops.aten

#: how a Function is named where its derivative is missing (``Gap.op``, ``report.uncounted``)
LABEL = FUNCTION_LABEL


@dataclass
class FunctionCall:
    """One call of a Function in a forward graph: its record, its nodes in order, its input
    aliases, outputs and saved tensors by position."""

    record: Any
    nodes: list[Node]
    inputs: dict[int, Node]
    outputs: dict[int, Node]
    saved: dict[int, Node]

    @property
    def label(self) -> str:
        return LABEL + self.record.name

    @property
    def source(self) -> Node:
        """The node the call's derivative work is attributed to: its first output."""
        return self.outputs[min(self.outputs)] if self.outputs else self.nodes[-1]


def function_calls(forward: GraphModule) -> dict[Node, FunctionCall]:
    """Forward node → the Function call it belongs to (every node of every call)."""
    out: dict[Node, FunctionCall] = {}
    calls: dict[int, FunctionCall] = {}
    for n, c in occurrences(forward.graph.nodes, FUNCTION).items():
        tag = n.meta[FUNCTION]
        call = calls.get(c)
        if call is None:
            call = calls[c] = FunctionCall(tag.function, [], {}, {}, {})
        call.nodes.append(n)
        if tag.input is not None:
            call.inputs[tag.input] = n
        if tag.output is not None:
            call.outputs[tag.output] = n
        for j in tag.saved:
            call.saved.setdefault(j, n)
        out[n] = call
    return out


@dataclass(eq=False)
class FunctionEntry:
    """A JVP-log entry standing for one Function call's tangent work.

    Attributes:
        call: the forward's :class:`FunctionCall`.
        inputs: the tangent (node, ghost or None) of each of ``apply``'s arguments.
        outputs: the JVP graph's tangent node of each tensor output (None: none).
        saved: the JVP graph's primal nodes of the saved tensors, by slot.
        name: for messages.
    """

    call: FunctionCall
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    saved: dict[int, Node]
    name: str


def missing(call: FunctionCall, kind: str) -> Gap:
    """The :class:`~graphflop.meta.Gap` of a call whose ``kind`` (``jvp`` or ``transpose``)
    derivative cannot be built."""
    src = call.source
    return Gap(call.label, src.name, src.meta.get(MODULE, ""), kind)


def _complete(call: FunctionCall) -> bool:
    """Whether every tensor input and saved tensor of the call has its node in the graph
    (tracing keeps them: dead-code elimination spares them)."""
    rec = call.record
    inputs = all(call.inputs.get(k) is not None for k, t in enumerate(rec.tensor_inputs) if t)
    saved = all(j in call.saved for j, t in enumerate(rec._saved) if t is not None)
    return inputs and saved


def no_jvp(*args: Any) -> Any:
    """The target of a Function's tangent in a linearization built only to be transposed
    (its class has no ``jvp``): never run."""
    raise NotImplementedError("a custom autograd.Function without jvp has no tangent")


def emit_tangent(
    b: Builder,
    call: FunctionCall,
    env: dict[Node, Node],
    tan: dict[Node, Any],
    opaque: bool,
) -> tuple[FunctionEntry | None, Gap | None]:
    """Emit the tangents of ``call``'s outputs into ``tan`` (``env``: forward node → JVP-graph
    primal; ``opaque``: a class without ``jvp`` gets :func:`no_jvp` nodes instead of a gap).
    Returns the log entry (None when no input carries a real tangent, or on a gap) and the
    gap (None without one). The nodes emitted are taken out of ``b.log``."""
    rec = call.record
    in_t: list[Any] = [None] * rec.n_inputs
    for k, alias in call.inputs.items():
        source = alias.args[0]
        in_t[k] = tan.get(source) if isinstance(source, Node) else None
    if not any(t is not None and not is_ghost(t) for t in in_t):
        return None, None  # a symbolic zero (or pruned work: not recorded for the region)
    kind = "transpose" if opaque else "jvp"  # what the graph being built misses
    if rec.reason is not None or not _complete(call):
        return None, missing(call, kind)
    if rec.jvp is None and not opaque:
        return None, missing(call, "jvp")
    src = call.source
    start = len(b.log)
    with b.context(
        source=src.name,
        module=src.meta.get(MODULE, ""),
        param_derived=src.meta.get(PARAM_DERIVED, False),
        ghost=False,
    ):
        real = [
            (t if t is not None and not is_ghost(t) else b.zeros_like(env[call.inputs[k]]))
            for k, t in enumerate(in_t)
            if rec.tensor_inputs[k]
        ]
        if rec.jvp is None:
            outs = [_opaque(b, call, k, env, real) for k in range(rec.n_outputs)]
        else:
            saved = [env[call.saved[j]] for j in sorted(call.saved)]
            outs = run_graph(b, rec.jvp, saved + real)
            made = set(b.log[start:])
            # a tangent the jvp passes through (an input's) gets a node of its own: its
            # cotangent must not mix with the input tangent's other uses
            outs = [o if o in made else b.call(aten.alias.default, o) for o in outs]
    del b.log[start:]
    entry_out: list[Any] = [None] * rec.n_outputs
    for k, node in call.outputs.items():
        entry_out[k] = outs[k]
        if isinstance(outs[k], Node) and outs[k].meta.get(KIND) == "tangent":
            tan[node] = outs[k]
    saved_env = {j: env[n] for j, n in call.saved.items()}
    entry = FunctionEntry(call, tuple(in_t), tuple(entry_out), saved_env, call.label)
    b.log.append(entry)  # type: ignore[arg-type]  # the log's one entry of its kind
    return entry, None


def _opaque(b: Builder, call: FunctionCall, k: int, env: dict, real: list) -> Node:
    out = call.outputs.get(k)
    val = out.meta.get("val") if out is not None else call.record._outputs[k]
    node = emit(b.graph, no_jvp, (k, *real), {})
    node.meta.update(
        {
            "val": val,
            KIND: "tangent",
            ROLE: b.role_for("tangent", real),
            SOURCE: b.ctx.source,
            MODULE: b.ctx.module,
            PARAM_DERIVED: False,
        }
    )
    return node


def run_graph(b: Builder, gm: GraphModule, args: list[Any]) -> list[Any]:
    """Emit ``gm``'s nodes through ``b`` on ``args`` (one per placeholder); returns its
    outputs' values."""
    env: dict[Node, Any] = {}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    env.update(zip(phs, args))
    outs: list[Any] = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            a = map_arg(n.args, env.__getitem__)
            kw = map_arg(n.kwargs, env.__getitem__)
            env[n] = b.call(n.target, *a, **kw)
        elif n.op == "output":
            res = n.args[0]
            outs = list(res) if isinstance(res, (tuple, list)) else [res]
            outs = [env[o] if isinstance(o, Node) else o for o in outs]
        elif n.op == "get_attr":
            raise ValueError(f"{n.format_node()}: a constant in a Function's derivative")
    return outs


def transpose(b: Builder, entry: FunctionEntry, cts: list[Any], ct: dict[Any, Any]) -> None:
    """The call's ``backward`` graph on the cotangents ``cts`` of its outputs (zeros where
    None), adding a gradient into ``ct`` for each input whose tangent is a real node."""
    call, rec = entry.call, entry.call.record
    src = call.source
    pd = all(t.meta.get(PARAM_DERIVED, False) for t in entry.inputs if isinstance(t, Node))
    role = "grad_weight" if pd else "grad_input"
    with b.context(source=src.name, module=src.meta.get(MODULE, ""), role=role, ghost=False):
        grads = [
            c if c is not None else b.zeros_like(_output_val(entry, k)) for k, c in enumerate(cts)
        ]
        saved = [b.import_arg(entry.saved[j]) for j in sorted(entry.saved) if j < rec.n_saved]
        outs = run_graph(b, rec.backward, saved + grads)
        for k, g in zip(rec.grad_inputs, outs):
            target = entry.inputs[k] if k < len(entry.inputs) else None
            if not isinstance(target, Node) or g is None:
                continue
            prev = ct.get(target)
            if prev is not None:
                with b.context(role="grad_accum"):
                    g = b.call(aten.add.Tensor, prev, g)
            ct[target] = g


def _output_val(entry: FunctionEntry, k: int) -> Any:
    out = entry.outputs[k]
    if out is not None:
        return out
    return entry.call.record._outputs[k]
