"""Module paths of traced nodes: which ``nn.Module`` call each node of a ``make_fx`` trace comes
from.

:class:`ModuleScopes` keeps the stack of module calls with global forward hooks while tracing and
writes it on each new node as PyTorch's ``nn_module_stack`` (the format ``torch.export`` writes);
:func:`module_path` reads it back as graphflop's ``MODULE`` path. Writes ``nn_module_stack``
(PyTorch's key) on the nodes of the graph being traced; no graphflop key.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import Node

from graphflop.frontend import recording


class ModuleScopes:
    """Records, while ``make_fx`` traces, which module call each new graph node comes from.

    Global forward hooks keep a stack of the module paths being run; at every hook the nodes
    added since the last one are given the stack as PyTorch's ``nn_module_stack`` (paths
    prefixed ``model.``, the loss at the root ``""``), the format ``torch.export`` writes.
    """

    def __init__(
        self,
        model: nn.Module,
        prefix: str = "model",
        base: list | None = None,
        paths: dict[int, str] | None = None,
    ):
        """``paths``: per module (by ``id``), its path under ``prefix`` as made here, where the
        caller has them (:meth:`graphflop.frontend.outline.Walk.paths`)."""
        self.prefix = prefix
        if paths is None:
            paths = {}
            for name, m in model.named_modules(remove_duplicate=False):
                paths.setdefault(id(m), f"{prefix}.{name}" if name else prefix)
        self.paths: dict[int, str] = paths
        # the root scope holds the loss ("Objective" in renders, as the model-plus-loss wrapper
        # torch.export traced was called)
        self.stack = (
            list(base)
            if base is not None
            else [("", "graphflop.trace.Objective"), (prefix, qualname(model))]
        )
        self.graph: torch.fx.Graph | None = None
        self.cursor: Node | None = None

    def __enter__(self) -> ModuleScopes:
        rec = recording.current()
        self.graph = rec.graph if rec is not None else None
        self.cursor = self._last()
        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        self._flush()
        for h in self.handles:
            h.remove()

    def _last(self) -> Node | None:
        if self.graph is None:
            return None
        return next(iter(reversed(self.graph.nodes)), None)

    def _flush(self) -> None:
        if self.graph is None:
            return
        n = self.cursor.next if self.cursor is not None else next(iter(self.graph.nodes), None)
        stack = {path: (path, cls) for path, cls in self.stack if path is not None}
        while n is not None and n.op != "root":
            n.meta.setdefault("nn_module_stack", stack)
            n = n.next
        self.cursor = self._last()

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._flush()
        path = self.paths.get(id(module))
        if path != self.prefix:  # the root itself is already on the stack
            self.stack.append((path, qualname(module)))

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.paths.get(id(module)) == self.prefix:
            return
        self._flush()
        self.stack.pop()

    def leave_model(self) -> None:
        """The model's forward has returned: what follows (the loss) is at the root scope."""
        self._flush()
        self.stack = self.stack[:1]

    def mark(self, t: torch.Tensor) -> Node | None:
        """The graph node that made ``t`` (the last one added)."""
        self._flush()
        return self.cursor


def qualname(m: nn.Module) -> str:
    """``module.QualName`` of ``m``'s class (the class name ``nn_module_stack`` records)."""
    return f"{type(m).__module__}.{type(m).__qualname__}"


def module_path(node: Node, wrapped: bool = True) -> str:
    """``node``'s ``nn.Module`` path from its ``nn_module_stack``: ``""`` for the model itself,
    ``loss`` for the loss (``wrapped``: the stack's paths are prefixed ``model.``, the loss at the
    root, as :class:`ModuleScopes` writes them; else the paths as they are)."""
    return stack_path(node.meta.get("nn_module_stack") or {}, wrapped)


def stack_path(stack: dict, wrapped: bool = True) -> str:
    """:func:`module_path` of a node whose ``nn_module_stack`` is ``stack``."""
    if not stack:
        return ""
    path = next(iter(reversed(stack.values())))[0]
    if not wrapped:
        return path
    if path == "":
        return "loss"
    if path == "model":
        return ""
    return path[len("model.") :] if path.startswith("model.") else path
