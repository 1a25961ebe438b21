"""The traced forward graph seen as a hierarchy: a top level whose repeated blocks are calls of
one template graph per distinct block (:class:`~graphflop.meta.Hierarchy`).

:func:`graphflop.frontend.outline.inline` (and :class:`~graphflop.frontend.outline.Expansion`,
which tracing uses) tags every node it copies from a template with its call site and the
template node it copies (:data:`~graphflop.meta.CALL_SITE`). After the graph
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
from typing import Any, cast

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from graphflop.ad.builder import base_name, copy_node, emit_named
from graphflop.frontend import outline  # noqa: F401  (defines graphflop::repeat)
from graphflop.meta import CALL_SITE, MODULE, CallSite, Hierarchy, graph_module

__all__ = ["build", "expand"]


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
    members: dict[int, list[Node]] = {}
    top: list[Any] = []
    runs = True  # each site's nodes one run of gm's (see Hierarchy.runs)
    previous: int | None = None  # the site of the node before, None for a top-level one
    for n in gm.graph.nodes:
        tag = n.meta.get(CALL_SITE)
        if tag is None:
            top.append(n)
            previous = None
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
            previous = None
            continue
        if site not in items:
            items[site] = []
            members[site] = []
            top.append(site)
        elif previous != site:
            runs = False
        previous = site
        items[site].append(item)
        members[site].append(n)
    graph = _top_graph(gm, top, members, [tnodes[k] for k in keys], [position[k] for k, _ in sites])
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
        graph=graph,
        runs=runs,
    )


def _top_graph(
    gm: GraphModule,
    top: list,
    members: dict[int, list[Node]],
    templates: list[list[Node]],
    of_site: list[int],
) -> GraphModule | None:
    """The top level as a graph of its own: ``gm``'s nodes outside every call, and per call
    site one ``graphflop::repeat`` node, ``repeat([values for the template's placeholders],
    site)`` (None for a placeholder no node of the call reads), whose ``getitem(call, i)``
    nodes stand for the template's output ``i`` where read outside the call (with the copied
    node's ``val`` and annotations). None when a call's values do not map onto its template's
    placeholders and outputs (a rewritten copy) or its nodes are not one run. A value the
    template writes into a buffer (``copy_`` into a placeholder: batch norm's running
    statistics) counts as an output after the template's own."""
    g = Graph()
    env: dict[Node, Node] = {}
    inside = {n: site for site, ns in members.items() for n in ns}
    call_op = torch.ops.graphflop.repeat.default
    for x in top:
        if isinstance(x, Node):
            # sharing the flat node's meta dict: what passes annotate on the flat graph later
            # (COST: annotate_flops) is read at the top level too, as on the templates
            new = env[x] = copy_node(g, x, env.__getitem__)
            object.__setattr__(new, "meta", x.meta)
            continue
        tnodes = templates[of_site[x]]
        phs = {t: i for i, t in enumerate(n for n in tnodes if n.op == "placeholder")}
        results = _results(tnodes, phs)
        # (a node returned twice: read as its first index)
        outputs = {t: i for i, t in reversed(list(enumerate(results)))}
        args: list[Node | None] = [None] * len(phs)
        read: dict[int, Node] = {}
        for n in members[x]:
            tag = n.meta[CALL_SITE]
            t = tnodes[tag[1]]
            parent = n.args[0] if n.args else None
            if n.target is operator.getitem and isinstance(parent, Node):
                if parent.meta.get(CALL_SITE) == tag:  # a getitem added afterwards
                    if any(inside.get(u) != x for u in n.users):
                        return None
                    continue
            inputs, tinputs = _input_nodes(n), _input_nodes(t)
            if len(inputs) != len(tinputs):
                return None
            for a, ta in zip(inputs, tinputs):
                if inside.get(a) == x:
                    continue
                j = phs.get(ta)
                if j is None or a not in env or args[j] not in (None, env[a]):
                    return None
                args[j] = env[a]
            if any(inside.get(u) != x for u in n.users):
                if t not in outputs:
                    return None
                read[outputs[t]] = n
        call = emit_named(g, call_op, (args, x), base_name(g, call_op))
        call.meta[CALL_SITE] = (x, -1)
        vals = [None] * len(results)
        for i, n in read.items():
            vals[i] = n.meta.get("val")
        call.meta["val"] = tuple(vals)
        for i, n in sorted(read.items()):
            item = emit_named(g, operator.getitem, (call, i), "getitem")
            item.meta = {k: v for k, v in n.meta.items() if k != CALL_SITE}
            env[n] = item
    return graph_module(torch.nn.Module(), g)


def _results(tnodes: list[Node], phs: Any) -> list:
    """A template's results as its call returns them: the outputs, then the values written
    into buffers (a ``copy_`` into a placeholder, which the flat graph returns as the buffer's
    update)."""
    copy_ = torch.ops.aten.copy_.default
    written = [t.args[1] for t in tnodes if t.target is copy_ and t.args[0] in phs]
    return [*cast(list, tnodes[-1].args[0]), *written]


def _input_nodes(n: Node) -> list[Node]:
    """The nodes ``n`` reads, each where its arguments name it (one node read twice is listed
    twice, unlike torch.fx's ``all_input_nodes``): a copy's and its template node's line up
    one for one where a call passes one value for two placeholders."""
    found: list[Node] = []
    map_arg((n.args, n.kwargs), found.append)
    return found


def expand(h: Hierarchy) -> GraphModule:
    """The flat graph rebuilt from the hierarchy alone: :attr:`Hierarchy.graph` with every
    call replaced by its variant's template nodes (the call's arguments standing for the
    template's placeholders, each node's :data:`~graphflop.meta.MODULE` the call site's path
    for it, ``val`` the template's). Node for node the traced forward graph's ops, arguments,
    output layouts and module paths (``tests/test_hierarchy.py``); other annotations are the
    template's.

    Raises:
        ValueError: ``h`` has no top-level graph.
    """
    if h.graph is None:
        raise ValueError("this hierarchy has no top-level graph (a call's nodes are not one run)")
    g = Graph()
    env: dict[Node, Any] = {}
    results: dict[Node, list] = {}
    call_op = torch.ops.graphflop.repeat.default
    for n in h.graph.graph.nodes:
        if n.target is call_op:
            args, number = n.args
            site = h.sites[number]
            t, items = h.variants[site.variant]
            tnodes = list(h.templates[t].nodes)
            phs = [x for x in tnodes if x.op == "placeholder"]
            tenv: dict[Node, Any] = {p: env[a] for p, a in zip(phs, args) if a is not None}
            modules = dict(site.modules)
            for index, out in items:
                x = tnodes[index]
                if out is None:
                    new = copy_node(g, x, tenv.__getitem__)
                    tenv[x] = new
                else:
                    new = emit_named(g, operator.getitem, (tenv[x], out), "getitem")
                    new.meta = dict(x.meta)
                    new.meta["val"] = x.meta["val"][out]
                new.meta[MODULE] = modules[x.meta[MODULE]]
                new.meta[CALL_SITE] = (number, index)
            results[n] = [tenv.get(x) for x in _results(tnodes, phs)]
        elif n.target is operator.getitem and n.args[0] in results:
            env[n] = results[n.args[0]][n.args[1]]
        else:
            env[n] = copy_node(g, n, env.__getitem__)
    return graph_module(torch.nn.Module(), g)
