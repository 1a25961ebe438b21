"""The traced forward graph seen as a hierarchy: a top level whose repeated blocks are calls of
one template graph per distinct block (:class:`~graphflop.meta.Hierarchy`).

:func:`graphflop.frontend.outline.inline` tags every node it copies from a template with its
call site and the template node it copies (:data:`~graphflop.meta.CALL_SITE`). After the graph
is in graphflop's form (:func:`~graphflop.frontend.export_form.from_make_fx`: dead code removed,
``getitem`` nodes completed), :func:`build` reads those tags back: per call site, which of the
template's nodes survived (its *variant*; call sites that kept the same nodes share one), and
the top level (the nodes outside every call, each call site at the place its nodes begin).

A copy that is no longer what its template node was (another op after a rewrite) loses its tag
and counts as a top-level node, so a figure composed from the hierarchy (the template's once,
times its calls, plus the top level's) always equals the flat graph's.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from graphflop.meta import CALL_SITE, CallSite, Hierarchy

__all__ = ["build"]


def _same(n: Node, t: Node) -> bool:
    """``n`` still computes what template node ``t`` computes (same op and output layout)."""
    if n.target is not t.target:
        return False
    a, b = n.meta.get("val"), t.meta.get("val")
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
        )
    return True


def build(
    gm: GraphModule, templates: dict[int, Graph], sites: list[tuple[int, dict[str, str]]]
) -> Hierarchy | None:
    """The hierarchy of ``gm`` (a forward graph whose outlined calls ``inline`` copied from
    ``templates``, recording ``sites``), or None when it has no call sites. Tags that no longer
    hold (a rewritten copy) are removed from ``gm``'s nodes."""
    if not sites:
        return None
    keys = sorted(templates)
    position = {k: i for i, k in enumerate(keys)}
    tnodes = {k: list(templates[k].nodes) for k in keys}
    items: dict[int, list[tuple[int, int | None]]] = {}
    top: list[Any] = []
    for n in gm.graph.nodes:
        tag = n.meta.get(CALL_SITE)
        if tag is None:
            top.append(n)
            continue
        site, index = tag
        key = sites[site][0]
        if n.target is operator.getitem:
            parent = n.args[0]
            if isinstance(parent, Node) and parent.meta.get(CALL_SITE) == tag:
                item: tuple[int, int | None] = (index, n.args[1])  # completed afterwards
            else:
                item = (index, None)
        else:
            item = (index, None)
        if item[1] is None and not _same(n, tnodes[key][index]):
            del n.meta[CALL_SITE]
            top.append(n)
            continue
        if site not in items:
            items[site] = []
            top.append(site)
        items[site].append(item)
    variants: dict[tuple, int] = {}
    out_sites: list[CallSite] = []
    for site, (key, modules) in enumerate(sites):
        v = (position[key], tuple(items.get(site, ())))
        variant = variants.setdefault(v, len(variants))
        out_sites.append(CallSite(position[key], variant, tuple(modules.items())))
    return Hierarchy(
        templates=tuple(templates[k] for k in keys),
        variants=tuple(variants),
        sites=tuple(out_sites),
        top=tuple(top),
    )
