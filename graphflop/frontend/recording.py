"""The graph being recorded while a model is traced, behind one seam.

graphflop's tracing hooks (module scopes, composite-op tags, checkpoint and grad-mode tags,
custom Functions, decomposition replays, library workarounds) read and extend the graph that
the recorder under them is building: whether a graph is being recorded, the graph itself, the
node that made a tensor, a tensor bound to a node they made, the nodes a block of code added,
and a hook on every node made. Today that recorder is ``make_fx``'s proxy mode, whose
bookkeeping is private PyTorch API (``get_proxy_mode``, ``get_proxy_slot``,
``track_tensor_tree``, ``PythonKeyTracer``); every use of it by those hooks is here, so that
it can move between PyTorch releases, or another recorder take its place (issue 33 item 4: a
dispatch-level recorder of graphflop's own, docs/analysis_scale.md Round 21), in one module.

The outliner (:mod:`graphflop.frontend.outline`) still reads ``make_fx``'s tracer itself: a
call it copies is recorded through the tracer's own proxies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx import Graph, Node, Proxy
from torch.fx.experimental.proxy_tensor import (
    PythonKeyTracer,
    get_proxy_mode,
    get_proxy_slot,
    track_tensor_tree,
)

__all__ = ["Recording", "current", "each_node", "node_of", "nodes_added", "recording"]


class Recording:
    """The graph one recorder is building (``make_fx``'s tracer), as the hooks use it.

    Attributes:
        tracer: the recorder's tracer (``make_fx``'s ``PythonKeyTracer``).
    """

    __slots__ = ("tracer",)

    def __init__(self, tracer: Any):
        self.tracer = tracer

    @property
    def graph(self) -> Graph:
        """The graph being built; nodes are appended at its end."""
        return self.tracer.graph

    def node_of(self, t: Any, sync: bool = False) -> Node | None:
        """The node that made tensor ``t`` (through functionalization's wrappers), or None:
        ``t`` is not a tensor, or has no node (a constant). ``sync``: bring a functional
        wrapper up to date with the writes into its base first (``torch._sync``: after an
        in-place write through a view, the node of the value as written)."""
        if not isinstance(t, torch.Tensor):
            return None
        if sync and torch._is_functional_tensor(t):
            torch._sync(t)
        while torch._is_functional_tensor(t):
            t = torch._from_functional_tensor(t)
        slot = get_proxy_slot(t, self.tracer, None)
        node = getattr(getattr(slot, "proxy", None), "node", None)
        return node if isinstance(node, Node) else None

    def bind(self, t: torch.Tensor, node: Node) -> None:
        """Record ``node`` as the value of tensor ``t`` from now on (a node the caller added:
        later ops reading ``t`` read ``node``)."""
        track_tensor_tree(t, Proxy(node, self.tracer), constant=None, tracer=self.tracer)


def current() -> Recording | None:
    """The graph being recorded, or None when nothing is traced."""
    mode = get_proxy_mode()
    return Recording(mode.tracer) if mode is not None else None


def recording() -> bool:
    """Whether a graph is being recorded."""
    return get_proxy_mode() is not None


def node_of(t: Any, sync: bool = False) -> Node | None:
    """The node that made tensor ``t`` in the graph being recorded (:meth:`Recording.node_of`),
    or None: nothing is recorded, ``t`` is not a tensor, or has no node."""
    rec = current()
    return rec.node_of(t, sync) if rec is not None else None


@contextlib.contextmanager
def nodes_added() -> Iterator[list[Node]]:
    """Yields a list that, on leaving, holds the nodes the block added to the graph being
    recorded, in order (empty when nothing is recorded)."""
    rec = current()
    made: list[Node] = []
    if rec is None:
        yield made
        return
    graph = rec.graph
    last = next(iter(reversed(graph.nodes)), None)
    yield made
    for n in reversed(graph.nodes):
        if n is last:
            break
        made.append(n)
    made.reverse()


@contextlib.contextmanager
def each_node(hook: Callable[[Node], None]) -> Iterator[None]:
    """While active, ``hook(node)`` is called for every node the recorder makes, right after it
    is made (nested hooks all run, the innermost last)."""
    outer = PythonKeyTracer.create_node

    def create_node(self: PythonKeyTracer, *args: Any, **kwargs: Any) -> Node:
        node = outer(self, *args, **kwargs)
        hook(node)
        return node

    PythonKeyTracer.create_node = create_node  # type: ignore[method-assign]
    try:
        yield
    finally:
        PythonKeyTracer.create_node = outer  # type: ignore[method-assign]
