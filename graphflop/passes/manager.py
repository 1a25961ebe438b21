"""A small pass manager: passes declare the facts they require and ensure.

Facts are names recorded in ``gm.meta[FACTS]`` by the pass that established them
(``traced``, ``flops``, ``memory``, ``jvp``, ``vjp``, ``update``). Running a pass whose
prerequisite is missing raises :class:`PassOrderError` naming the pass, the missing fact and the
pass that provides it, instead of failing deep inside with a ``KeyError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule

from graphflop.meta import FACTS

FACTS = FACTS

#: which public pass establishes each fact
PROVIDERS = {
    "traced": "trace (or from_exported)",
    "flops": "annotate_flops",
    "memory": "annotate_memory",
    "jvp": "build_jvp",
    "vjp": "build_vjp",
    "update": "add_optimizer_update",
}


class PassOrderError(RuntimeError):
    """A pass ran before a pass it depends on."""


@dataclass(frozen=True)
class Pass:
    """A graph pass with its declared contract.

    Attributes:
        name: the pass's public name.
        fn: ``fn(gm, *args, **kwargs) -> GraphModule`` (the same graph, annotated, or a new one).
        requires: facts the input graph must have.
        ensures: facts the output graph has afterwards.
    """

    name: str
    fn: Callable[..., GraphModule]
    requires: tuple[str, ...] = ()
    ensures: tuple[str, ...] = ()

    def __call__(self, gm: GraphModule, *args: Any, **kwargs: Any) -> GraphModule:
        check(gm, self.requires, self.name)
        out = self.fn(gm, *args, **kwargs)
        facts = set(out.meta.get(FACTS, ()))
        if out is not gm:  # a new graph inherits nothing but what the pass ensures
            facts |= {"traced"} if "traced" in gm.meta.get(FACTS, ()) else set()
        out.meta[FACTS] = facts | set(self.ensures)
        return out


def facts(gm: GraphModule) -> set[str]:
    return set(gm.meta.get(FACTS, ()))


def check(gm: GraphModule, requires: Sequence[str], name: str) -> None:
    """Raise :class:`PassOrderError` unless ``gm`` has every fact in ``requires``."""
    have = facts(gm)
    for fact in requires:
        if fact not in have:
            raise PassOrderError(
                f"{name} requires '{fact}', which this graph lacks: run "
                f"{PROVIDERS.get(fact, fact)} first"
            )


class PassManager:
    """Runs passes in order on one graph, checking each pass's prerequisites.

    >>> pm = PassManager([annotate_flops_pass])  # doctest: +SKIP
    >>> gm = pm(gm)  # doctest: +SKIP
    """

    def __init__(self, passes: Sequence[Pass]):
        self.passes = list(passes)

    def __call__(self, gm: GraphModule) -> GraphModule:
        for p in self.passes:
            try:
                gm = p(gm)
            except PassOrderError:
                raise
            except Exception as e:
                raise RuntimeError(f"pass {p.name} failed: {e}") from e
        return gm
