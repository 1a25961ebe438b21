"""Pass contracts on torch.fx's pass infrastructure.

Every graphflop pass is a :class:`GraphPass`, a ``torch.fx.passes.infra.pass_base.PassBase``:
its constructor takes the pass's options, ``pass_(gm)`` returns a ``PassResult`` whose
``graph_module`` is the same graph annotated or a new one, and it runs in torch.fx's
``PassManager``. A pass declares the *facts* it requires of its input and the facts its output
has afterwards:

========================  ===================================================================
fact                      holds when
========================  ===================================================================
``traced``                recorded by ``trace``/``from_exported`` and ``gm.meta`` has
                          ``SIGNATURE``
``val``                   every placeholder and ``call_function`` node has a ``val`` (but
                          a template's call, ``graphflop::repeat``, in a top level)
``flops``                 every node has ``COST``
``memory``, ``jvp``,      ``gm.meta`` has ``MEMORY``, ``JVP``, ``VJP``, ``UPDATE``,
``vjp``, ``update``, ...  ``FORWARD_GRADIENT``, ``TRAIN_STEP``
========================  ===================================================================

The facts a graph has are recorded in ``gm.meta[FACTS]``. Running a pass whose prerequisite is
missing raises :class:`PassOrderError` naming the pass, the missing fact and the pass that
provides it, instead of failing deep inside with a ``KeyError``.

A pass also declares its *scope* (:attr:`GraphPass.scope`), how it runs on a model whose
repeated blocks were outlined (a :class:`~graphflop.meta.Hierarchy` on the forward graph):
:data:`TEMPLATE` (the default) once on each distinct block's template graph and once on the top
level, whose call nodes stand for the blocks (right for a pass whose annotation of a node depends
only on that node and its arguments' metadata, as FLOPs do; the figures then compose over the
calls: :mod:`graphflop.passes.hierarchy`), or :data:`FLAT` on the inlined graph, every node of
every block (a pass that relates nodes of different blocks). ``Analysis.run_pass`` dispatches
on it.

torch.fx's ``PassManager`` wraps any error a pass raises in a bare ``Exception``;
:func:`run_passes` runs a manager and re-raises the pass's own error (``PassOrderError``,
``MissingRuleError``, ``ValueError``, ...) with the manager's message as a note.
"""

from __future__ import annotations

import sys
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.infra.pass_manager import PassManager

from graphflop.meta import (
    COST,
    FACTS,
    FORWARD_GRADIENT,
    JVP,
    MEMORY,
    SIGNATURE,
    TRAIN_STEP,
    UPDATE,
    VJP,
)

#: which public pass establishes each fact
PROVIDERS = {
    "traced": "trace (or from_exported)",
    "val": "trace (or from_exported, or make_fx)",
    "flops": "annotate_flops",
    "memory": "annotate_memory",
    "jvp": "build_jvp",
    "vjp": "build_vjp",
    "update": "add_optimizer_update",
    "forward_gradient": "build_forward_gradient_step",
    "train_step": "build_train_step",
}

#: facts shown by a graph-level meta key
GRAPH_EVIDENCE = {
    "memory": MEMORY,
    "jvp": JVP,
    "vjp": VJP,
    "update": UPDATE,
    "forward_gradient": FORWARD_GRADIENT,
    "train_step": TRAIN_STEP,
}


#: scopes of a pass (:attr:`GraphPass.scope`): once per template graph and on the top level,
#: or on the inlined (flat) graph
TEMPLATE = "template"
FLAT = "flat"
SCOPES = (TEMPLATE, FLAT)


class PassOrderError(RuntimeError):
    """A pass ran before a pass it depends on."""


class PassContractError(RuntimeError):
    """A pass did not establish a fact it promised (a bug in the pass)."""


def _has_values(gm: GraphModule) -> bool:
    """Every placeholder and ``call_function`` node has a ``val``, but a call of a template
    (``graphflop::repeat`` in a hierarchy's top level: its values are its template's)."""
    return all(
        "val" in n.meta  # first: most nodes have one, and are not asked what they are
        or not (n.op == "placeholder" or (n.op == "call_function" and not _is_call(n)))
        for n in gm.graph.nodes
    )


def _is_call(n) -> bool:
    t = n.target
    return getattr(t, "namespace", None) == "graphflop" and getattr(t, "_opname", None) == "repeat"


def _has_costs(gm: GraphModule) -> bool:
    return all(COST in n.meta for n in gm.graph.nodes)


#: graph-level facts of a graph derived from a forward graph (a JVP, backward, update,
#: forward-gradient step or train step graph is not itself a forward graph to build from)
DERIVED = ("train_step", "forward_gradient", "vjp", "jvp", "update")  # most specific first


def derived_kind(gm: GraphModule) -> str | None:
    """The kind of derived graph ``gm`` is (one of :data:`DERIVED`), or None."""
    return next((f for f in DERIVED if GRAPH_EVIDENCE[f] in gm.meta), None)


def _traced(gm: GraphModule) -> bool:
    return "traced" in recorded(gm) and SIGNATURE in gm.meta and derived_kind(gm) is None


#: facts checked on the graph itself rather than by a meta key
_PREDICATES: dict[str, Callable[[GraphModule], bool]] = {
    "traced": _traced,
    "val": _has_values,
    "flops": _has_costs,
}


def recorded(gm: GraphModule) -> set[str]:
    """The facts recorded in ``gm.meta[FACTS]`` (empty when none)."""
    return set(gm.meta.get(FACTS, ()))


def has_fact(gm: GraphModule, fact: str) -> bool:
    """Whether ``gm`` has ``fact`` (see the module docstring); an unknown fact must be recorded."""
    if fact in _PREDICATES:
        return _PREDICATES[fact](gm)
    if fact in GRAPH_EVIDENCE:
        return GRAPH_EVIDENCE[fact] in gm.meta
    return fact in recorded(gm)


def facts(gm: GraphModule) -> set[str]:
    """Every fact ``gm`` has: those recorded and those its annotations show."""
    known = set(_PREDICATES) | set(GRAPH_EVIDENCE)
    return {f for f in known | recorded(gm) if has_fact(gm, f)}


def check(gm: GraphModule, requires: Sequence[str], name: str) -> None:
    """Raise :class:`PassOrderError` unless ``gm`` has every fact in ``requires``.

    The message names the pass, the missing fact and the pass that provides it, e.g.
    ``build_vjp requires 'traced', which this graph lacks: run trace (or from_exported) first``.
    """
    for fact in requires:
        if fact == "traced" and derived_kind(gm) is not None:
            raise PassOrderError(
                f"{name} requires 'traced', a forward graph, but this is a {derived_kind(gm)} "
                "graph derived from one: pass the forward graph from trace (or from_exported)"
            )
        if not has_fact(gm, fact):
            raise PassOrderError(
                f"{name} requires '{fact}', which this graph lacks: run "
                f"{PROVIDERS.get(fact, fact)} first"
            )


def record_facts(out: GraphModule, source: GraphModule, provided: Sequence[str]) -> None:
    """Record ``provided`` on ``out``; a new graph made from a traced one is ``traced`` too
    (derived from a trace), as far as the record goes."""
    have = recorded(out)
    if out is not source and "traced" in recorded(source):
        have.add("traced")
    out.meta[FACTS] = have | set(provided)


class GraphPass(PassBase):
    """A graphflop pass: a torch.fx ``PassBase`` with declared facts.

    Subclasses set :attr:`name` (the public function's name, used in errors),
    :attr:`required` and :attr:`provided`, and implement :meth:`call`. Unlike ``PassBase``,
    :meth:`ensures` checks the *output* graph (a pass may return a new one). :attr:`scope`
    says whether the pass runs per template (:data:`TEMPLATE`, the default) or needs the flat
    graph (:data:`FLAT`); see the module docstring.
    """

    name: ClassVar[str] = ""
    required: ClassVar[tuple[str, ...]] = ()
    provided: ClassVar[tuple[str, ...]] = ()
    scope: ClassVar[str] = TEMPLATE

    def __call__(self, graph_module: GraphModule) -> PassResult:
        self.requires(graph_module)
        res = self.call(graph_module)
        record_facts(res.graph_module, graph_module, self.provided)
        self.ensures(res.graph_module)
        return res

    @abstractmethod
    def call(self, graph_module: GraphModule) -> PassResult:
        """Run the pass on ``graph_module``; the result holds the (possibly new) graph."""

    def requires(self, graph_module: GraphModule) -> None:
        """Raise :class:`PassOrderError` unless the input has every :attr:`required` fact."""
        check(graph_module, self.required, self.name)

    def ensures(self, graph_module: GraphModule) -> None:
        """Raise :class:`PassContractError` unless the output has every :attr:`provided` fact."""
        for fact in self.provided:
            if not has_fact(graph_module, fact):
                raise PassContractError(f"{self.name} did not establish '{fact}'")

    def apply(self, graph_module: GraphModule) -> GraphModule:
        """Run the pass (with its checks) and return the resulting graph."""
        return self(graph_module).graph_module


def run_passes(graph_module: GraphModule, passes: Sequence[PassBase]) -> GraphModule:
    """Run ``passes`` in order through torch.fx's ``PassManager``; returns the last graph.

    Raises:
        The error the failing pass raised (not the manager's wrapper), with the manager's
        message added as a note.
    """
    pm = PassManager(list(passes))
    try:
        return pm(graph_module).graph_module
    except Exception as e:
        cause = e.__cause__
        if cause is None or type(e) is not Exception:
            raise
        if sys.version_info >= (3, 11):  # exception notes are new in 3.11
            cause.add_note(str(e))
        raise cause from cause.__cause__  # the pass's own chain, without the wrapper


__all__ = [
    "FLAT",
    "SCOPES",
    "TEMPLATE",
    "GraphPass",
    "PassContractError",
    "PassManager",
    "PassOrderError",
    "PassResult",
    "check",
    "facts",
    "has_fact",
    "record_facts",
    "recorded",
    "run_passes",
]
