"""Repeated blocks as ONNX local functions: each distinct block's nodes written once as a
``FunctionProto`` and called once per block.

The exporter converts a flat graph; this pass folds its result. Every ONNX node is assigned the
call site (the repeated block, :data:`~graphflop.meta.CALL_SITE`) of the graphflop node it came
from: a forward node's own, a derivative node's through the forward node it differentiates
(:data:`~graphflop.meta.SOURCE`). The ONNX nodes of one call site are then a candidate
function body. A site is folded only when its nodes can be replaced by one call without
changing what the graph computes:

* convex: no path leaves the site's nodes and comes back into them (else one call node could
  not be placed anywhere);
* no node with a subgraph attribute (``If``, ``Loop``, ``Scan``: their bodies read outer names);
* structurally equal to the other sites of its function: the same op types, domains and
  attributes in the same order, wired the same way, each node reading the same position of the
  site's external values. Sites with equal structure share one function.

A function's inputs are the site's external values in order of first use (graph inputs,
initializers and values other nodes compute); its outputs, the union over its sites of the
values read outside the site. The call nodes keep the graph's values' names, so the folded
model's inputs, outputs and every value read outside a block are unchanged, and
``onnx.inliner.inline_local_functions`` gives back a graph computing the same (checked in
``tests/test_onnx_functions.py`` on ONNX Runtime).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: the ONNX domain of the block functions
DOMAIN = "graphflop.blocks"


@dataclass
class FoldReport:
    """What :func:`fold_blocks` did: per function, the sites it calls, and the sites that
    stayed inline with the reason."""

    functions: dict[str, list[Any]] = field(default_factory=dict)
    #: call node name -> function name
    calls: dict[str, str] = field(default_factory=dict)
    #: flat ONNX node name -> the call node now computing it
    folded: dict[str, str] = field(default_factory=dict)
    inline: dict[Any, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``{"functions": {name: {"calls": [...]}}, "inline": {site: why}}``."""
        by_fn: dict[str, list[str]] = {}
        for call, fn in self.calls.items():
            by_fn.setdefault(fn, []).append(call)
        return {
            "functions": {f: {"calls": c} for f, c in by_fn.items()},
            "inline": {str(k): v for k, v in self.inline.items()},
        }


def _attr_key(a) -> tuple:
    import onnx

    if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        raise ValueError("subgraph")
    return (a.name, a.SerializeToString())


def _convex(members: set[int], producers: dict[str, int], nodes) -> bool:
    """No path from a member out of ``members`` and back in: walk backwards from the members'
    inputs through non-members; reaching a member that way means a path member → outside →
    member."""
    seen: set[int] = set()
    stack = [
        producers[x]
        for i in members
        for x in nodes[i].input
        if x in producers and producers[x] not in members
    ]
    while stack:
        j = stack.pop()
        if j in seen:
            continue
        seen.add(j)
        for x in nodes[j].input:
            k = producers.get(x)
            if k is None:
                continue
            if k in members:
                return False
            if k not in seen:
                stack.append(k)
    return True


def _subgraph_reads(n) -> set[str]:
    """The names the subgraph attributes of node ``n`` (``If``/``Loop``/``Scan`` bodies) read,
    outer-scope names among them."""
    import onnx

    out: set[str] = set()
    for a in n.attribute:
        bodies = (
            [a.g]
            if a.type == onnx.AttributeProto.GRAPH
            else list(a.graphs)
            if a.type == onnx.AttributeProto.GRAPHS
            else []
        )
        for b in bodies:
            for m in b.node:
                out.update(x for x in m.input if x)
                out |= _subgraph_reads(m)
    return out


@dataclass
class _Site:
    """One call site's nodes (indices into the graph, in order) and structure."""

    key: Any
    idx: list[int]
    sig: tuple
    ext: list[str]  # external values, in order of first use
    local: dict[str, tuple[int, int]]  # value name -> (node position, output)


def _signature(
    idx: list[int], nodes, consts: dict[str, Any]
) -> tuple[tuple, list[str], dict[str, tuple[int, int]]]:
    """The structure of the nodes ``idx`` (in graph order): per node its op, domain,
    attributes and inputs as ('in', position of the external value), ('v', node, output) or
    ('c', the constant's attributes) for a value a ``Constant`` node outside makes; the
    external values in order of first use; and each output name's (node, output)."""
    local: dict[str, tuple[int, int]] = {}
    ext: dict[str, int] = {}
    sig = []
    for p, i in enumerate(idx):
        n = nodes[i]
        ins: list[tuple] = []
        for x in n.input:
            if x == "":
                ins.append(("none",))
            elif x in local:
                ins.append(("v", *local[x]))
            elif x in consts:
                ins.append(("c", _attrs(consts[x])))
            else:
                ins.append(("in", ext.setdefault(x, len(ext))))
        sig.append((n.op_type, n.domain, n.overload, _attrs(n), tuple(ins), len(n.output)))
        for o, y in enumerate(n.output):
            if y:
                local[y] = (p, o)
    return tuple(sig), list(ext), local


def _attrs(n) -> tuple:
    return tuple(sorted(_attr_key(a) for a in n.attribute))


def _candidates(nodes, site_of, consts, report, min_nodes) -> dict[tuple, list]:
    """The sites that can be folded, grouped by structure; the others into ``report.inline``."""
    producers = {y: i for i, n in enumerate(nodes) for y in n.output if y}
    groups: dict[Any, list[int]] = {}
    for i, s in enumerate(site_of):
        if s is not None and nodes[i].output[0] not in consts:
            groups.setdefault(s, []).append(i)
    by_sig: dict[tuple, list[_Site]] = {}
    for key, idx in groups.items():
        if len(idx) < min_nodes:
            report.inline[key] = f"{len(idx)} node(s)"
        elif not _convex(set(idx), producers, nodes):
            report.inline[key] = "not convex: a path leaves the block and comes back"
        else:
            try:
                sig, ext, local = _signature(idx, nodes, consts)
            except ValueError:
                report.inline[key] = "a node with a subgraph"
                continue
            by_sig.setdefault(sig, []).append(_Site(key, idx, sig, ext, local))
    return by_sig


def _function(model, fname: str, site: _Site, nodes, consts, out_pos) -> Any:
    """The ``FunctionProto`` of ``site``'s nodes: inputs ``x<j>`` (its external values),
    outputs ``y<node>_<output>`` (``out_pos``), constants made inside."""
    import onnx

    fn = onnx.FunctionProto()
    fn.name, fn.domain = fname, DOMAIN
    fn.input.extend(f"x{j}" for j in range(len(site.ext)))
    fn.output.extend(f"y{p}_{o}" for p, o in out_pos)
    fn.opset_import.extend(model.opset_import)
    inner = {x: f"x{j}" for j, x in enumerate(site.ext)}
    outs = set(out_pos)
    for y, pos in site.local.items():
        inner[y] = ("y{}_{}" if pos in outs else "v{}_{}").format(*pos)
    for i in site.idx:
        src = nodes[i]
        for x in src.input:
            if x in consts and x not in inner:
                c = onnx.NodeProto()
                c.CopyFrom(consts[x])
                inner[x] = c.output[0] = f"c{len(fn.node)}"
                c.name = f"n{len(fn.node)}_Constant"
                del c.metadata_props[:]
                fn.node.append(c)
        n = onnx.NodeProto()
        n.CopyFrom(src)
        n.name = f"n{len(fn.node)}_{src.op_type}"
        del n.input[:]
        n.input.extend(inner[x] if x else "" for x in src.input)
        del n.output[:]
        n.output.extend(inner[y] if y else "" for y in src.output)
        del n.metadata_props[:]
        fn.node.append(n)
    return fn


def fold_blocks(model, site_of: Sequence[Any], *, min_nodes: int = 2) -> FoldReport:
    """Fold ``model`` (an ``onnx.ModelProto``, changed in place) so that each group of
    structurally equal call sites is one local function called per site. ``Constant`` nodes
    stay outside the sites (the exporter makes one per value and lets every block read it); a
    function makes the constants it reads itself.

    Args:
        model: the exported model; its ``graph.node[i]`` belongs to call site ``site_of[i]``
            (None: the top level).
        site_of: one entry per node of ``model.graph``, any hashable site key or None.
        min_nodes: sites with fewer nodes stay inline.

    Returns:
        The :class:`FoldReport`.

    Raises:
        ValueError: ``site_of`` does not have one entry per node.
    """
    import onnx

    g = model.graph
    nodes = list(g.node)
    if len(site_of) != len(nodes):
        raise ValueError(f"site_of has {len(site_of)} entries for {len(nodes)} nodes")
    report = FoldReport()
    consts = {n.output[0]: n for n in nodes if n.op_type == "Constant" and not n.input}
    read_outside: dict[str, set[int]] = {o.name: {-1} for o in g.output}
    for i, n in enumerate(nodes):
        for x in n.input:
            read_outside.setdefault(x, set()).add(i)
        for x in _subgraph_reads(n):  # a body reads its outer scope by name: keep those names
            read_outside.setdefault(x, set()).add(-1)
    by_sig = _candidates(nodes, site_of, consts, report, min_nodes)

    functions = []
    replaced: dict[int, Any] = {}  # a site's last node -> its call; its other nodes dropped
    dropped: set[int] = set()
    for k, sites in enumerate(by_sig.values()):
        fname = f"block{k}"
        # the function's outputs: the positions any of its sites lets a value out from
        out_pos = sorted(
            {
                pos
                for site, members in ((site, set(site.idx)) for site in sites)
                for y, pos in site.local.items()
                if not read_outside.get(y, set()) <= members
            }
        )
        functions.append(_function(model, fname, sites[0], nodes, consts, out_pos))
        report.functions[fname] = [site.key for site in sites]
        for site in sites:
            name_at = {pos: y for y, pos in site.local.items()}
            call = onnx.helper.make_node(
                fname,
                inputs=site.ext,
                outputs=[
                    name_at.get(p, f"{fname}.unused.{site.key}.{p[0]}_{p[1]}") for p in out_pos
                ],
                name=f"{fname}.{site.key}",
                domain=DOMAIN,
            )
            replaced[site.idx[-1]] = call
            dropped.update(site.idx[:-1])
            report.calls[call.name] = fname
            for i in site.idx:
                report.folded[nodes[i].name] = call.name
    if not functions:
        return report
    items = [replaced.get(i, n) for i, n in enumerate(nodes) if i not in dropped]
    read = {x for n in items for x in n.input} | {o.name for o in g.output}
    read |= {x for n in items for x in _subgraph_reads(n)}
    items = [n for n in items if not (n.op_type == "Constant" and n.output[0] not in read)]
    g.ClearField("node")
    g.node.extend(_toposort(items, {i.name for i in g.input} | {i.name for i in g.initializer}))
    model.functions.extend(functions)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    kept = {y for n in g.node for y in n.output}  # value_info of values now inside a function
    vi = [v for v in g.value_info if v.name in kept]
    g.ClearField("value_info")
    g.value_info.extend(vi)
    return report


def _toposort(items: list, available: set[str]) -> list:
    """``items`` (nodes) in a topological order: among the nodes whose inputs are ready, the
    earliest in the given order first (each call where its block's last node was; a top-level
    node between a block's nodes may feed it or read it)."""
    import heapq

    producer = {y: i for i, n in enumerate(items) for y in n.output if y}
    waiting: list[int] = [0] * len(items)
    users: dict[int, list[int]] = {}
    for i, n in enumerate(items):
        deps = {producer[x] for x in n.input if x in producer and x not in available}
        deps.discard(i)
        waiting[i] = len(deps)
        for d in deps:
            users.setdefault(d, []).append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(items[i])
        for u in users.get(i, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(out) != len(items):
        raise ValueError("the folded graph has a cycle")
    return out
