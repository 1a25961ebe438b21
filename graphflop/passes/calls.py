"""The JVP and backward graphs of a model with repeated blocks, kept as calls of one template
derivative per block variant (:class:`DerivedHierarchy`), and the flat graph rebuilt from them
(:func:`expand`).

A derivative graph of a traced forward graph with outlined blocks
(:data:`~graphflop.meta.HIERARCHY`) does each call's derivative work in one run of nodes:
the JVP copies a call's forward nodes and emits their tangents in forward order, and the
transpose walks that log back, one call after the other (:mod:`graphflop.ad.blocks`). Each node
emitted for a forward node carries its :data:`~graphflop.meta.SOURCE`, so a *call* of the
derivative graph is a maximal run of consecutive nodes whose forward sources belong to one
call site of the forward graph.

:func:`build` reads those runs off the finished graph (after the backward's clean-ups:
dead-code elimination, folded transposed products) and describes each one relative to its
call site: ops, constants, output layouts, the other graphflop annotations, each argument
either a node of the run (by position) or the run's *j*-th value from outside (a residual, a
cotangent arriving at the block's outputs, the tangent or primal of its inputs, a value of an
earlier call), the module paths relative to the block (``@``, ``@.attn``), the forward sources
by their place in the block, the parameters by their path in it. Runs described alike are
calls of one *template derivative*, stored once as a graph whose placeholders are the run's
arguments from outside (named by their role: ``residual_0``, ``cotangent_1``, ``tangent_2``,
...) and whose output is every node of the run; the top level keeps the other nodes and one
``graphflop::repeat(arguments, call)`` node per call, whose ``getitem(call, i)`` nodes are the
run's node ``i`` where read outside the run.

Since two calls share a template only where every node agrees in all of this, a figure that
depends only on a node and its arguments' metadata (its cost, role, kind, module) is the
template node's figure at each of its calls: :func:`derived_figures` composes the totals by
role, per-module rows and op table from each template once, times its calls, plus the top
level, equal to the flat graph's sums (``tests/test_hierarchy.py``).
"""

from __future__ import annotations

import copy
import itertools
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from graphflop.ad.blocks import CallRun, call_keys, checkpointed, forget_tables
from graphflop.ad.builder import (
    NO_KWARGS,
    NamePlan,
    base_name,
    copy_node,
    emit_named,
    new_node,
    take_name,
)
from graphflop.ad.functions import FunctionEntry
from graphflop.ad.simplify import fold_graph
from graphflop.frontend import outline  # noqa: F401  (defines graphflop::repeat)
from graphflop.meta import (
    CALL_SITE,
    CHECKPOINT,
    COST,
    DERIVED_HIERARCHY,
    GHOST_LINKS,
    HIERARCHY,
    JVP_LOG,
    KIND,
    MODULE,
    NODE_KEYS,
    PACKED,
    PARAM,
    RESIDUAL,
    ROLE,
    SLOT,
    SOURCE,
    ZERO_COST,
    GhostLinks,
    Hierarchy,
    NodeCost,
    graph_module,
)
from graphflop.ops import has_rule, op_name
from graphflop.ops.cost import op_cost
from graphflop.ops.ghost import GhostValue, is_ghost
from graphflop.passes.flops import sum_costs

__all__ = [
    "DerivedCall",
    "DerivedFigures",
    "DerivedHierarchy",
    "DirectRecorder",
    "attach",
    "build",
    "derived_figures",
    "expand",
    "flat_view",
    "is_recorded",
    "rule_less_calls",
    "unpack",
    "unpacked",
]

#: the annotations relativized to the call (the others must be equal at every call)
_RELATIVE = (MODULE, SOURCE, PARAM, CALL_SITE, COST, CHECKPOINT)
_COMPARED = frozenset(NODE_KEYS) - set(_RELATIVE)
#: a template derivative's :data:`~graphflop.meta.CHECKPOINT` that is its source's: each call's
#: forward node's own (a block run inside ``torch.utils.checkpoint``: every call its own region)
OWN_TAG = "@call"


def forward_tags(forward: GraphModule) -> dict[str, Any]:
    """The forward nodes' :data:`~graphflop.meta.CHECKPOINT` tags by node name."""
    return {n.name: n.meta[CHECKPOINT] for n in checkpointed(forward)}


def tags_of(tags: dict[str, Any], sources: tuple[str, ...]) -> tuple[Any, ...]:
    """:attr:`DerivedCall.tags` of a call with ``sources``, ``tags`` the forward's
    (:func:`forward_tags`)."""
    return tuple(tags.get(x) for x in sources) if tags else ()


def relative_tag(m: dict, own: bool, tags: dict[str, Any]) -> Any:
    """A derivative node's checkpoint tag (annotations ``m``) relative to its call:
    :data:`OWN_TAG` where it is its source's, a forward node of the call (``own``), else as it
    is."""
    tag = m.get(CHECKPOINT)
    if tag is not None and own and tags.get(m.get(SOURCE, "")) == tag:
        return OWN_TAG
    return tag


#: markers of an argument that is the run's node ``i`` or its ``j``-th value from outside
_IN, _OUT = object(), object()
_SCALARS = frozenset({int, float, bool, str, type(None)})


class FlatNames:
    """A copy of a graph's fx names (its namespace: the names used, the count per base name),
    for naming nodes as that graph would name the ones it made next (:meth:`name`)."""

    def __init__(self, g: Graph | None = None) -> None:
        self._g = Graph()  # names only: its namespace is the copy
        if g is not None:
            ns, mine = g._graph_namespace, self._g._graph_namespace
            mine._used_names = set(ns._used_names)
            mine._base_count = dict(ns._base_count)

    def copy(self) -> FlatNames:
        """A copy, to name from without changing this one."""
        return FlatNames(self._g)

    def name(self, target: Any) -> str:
        """The name a ``call_function`` node of ``target`` made now would be given, taken."""
        return take_name(self._g, base_name(self._g, target))


@dataclass(frozen=True, eq=False)
class DerivedCall:
    """One call of a template derivative in a derivative graph.

    Attributes:
        site: the forward graph's call site (:attr:`Hierarchy.sites`) whose derivative it is.
        template: its template derivative's position in :attr:`DerivedHierarchy.templates`.
        modules: ``(relative path, path in the model)`` pairs, as the forward call site's.
        sources: per source slot of the template (its nodes' :data:`~graphflop.meta.SOURCE`
            ``@k``), the name of this call's forward node.
        tags: per source slot, that forward node's :data:`~graphflop.meta.CHECKPOINT` tag
            (a template node's :data:`OWN_TAG` is it); empty where the forward has none.
    """

    site: int
    template: int
    modules: tuple[tuple[str, str], ...]
    sources: tuple[str, ...]
    tags: tuple[Any, ...] = ()


#: a call's run of :class:`CallLog` entries: ``(rep, k)`` for each ``k`` of ``positions`` (its
#: template's logged positions, shared by the template's calls); defined with the transpose,
#: which takes such a run whole (:func:`graphflop.ad.blocks.transpose_log`)
_Run = CallRun


class CallLog(Sequence[Any]):
    """A recorded JVP's whole log (:attr:`DerivedHierarchy.log`): reads as the tuple of its
    entries in order, each call's run of ``(repeat node, position)`` entries held as one
    :class:`_Run` and its pairs made on reading. The log is kept with the analysis (for
    :func:`expand_jvp`); held as pairs, a GPT-2 block's call kept about 110 tuples, 7% of the
    objects an analysis keeps per block, which the collector's pass after ``analyze`` visits
    (docs/analysis_scale.md); read only twice (the transpose, a flat view)."""

    __slots__ = ("_len", "_parts")

    def __init__(self, parts: Iterable[Any]):
        self._parts = tuple(parts)
        self._len = sum(len(p.positions) if type(p) is _Run else 1 for p in self._parts)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Any]:
        for p in self._parts:
            if type(p) is _Run:
                rep = p.rep
                for k in p.positions:
                    yield (rep, k)
            else:
                yield p

    def __reversed__(self) -> Iterator[Any]:
        for p in reversed(self._parts):
            if type(p) is _Run:
                rep = p.rep
                for k in reversed(p.positions):
                    yield (rep, k)
            else:
                yield p

    def __getitem__(self, i: Any) -> Any:
        return tuple(self)[i]

    def holds(self, cls: type) -> bool:
        """Whether an entry is an instance of ``cls``, for a class the calls' ``(repeat
        node, position)`` pairs are not instances of (a custom Function's entry): read a part
        at a time, a call's run one part, its pairs not made."""
        return any(type(p) is not _Run and isinstance(p, cls) for p in self._parts)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CallLog):
            other = tuple(other)
        return isinstance(other, tuple) and tuple(self) == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CallLog({tuple(self)!r})"


@dataclass(frozen=True, eq=False)
class DerivedHierarchy:
    """A JVP or backward graph as a top level calling one template derivative per variant.

    Attributes:
        templates: one graph per template derivative: a placeholder per argument from outside
            the run (``val``, :data:`~graphflop.meta.KIND` and :data:`~graphflop.meta.ROLE` of
            the first call's value; named by role), the run's nodes with their annotations
            relative to the block (:data:`~graphflop.meta.MODULE` ``@...``,
            :data:`~graphflop.meta.SOURCE` ``@k`` for source slot ``k``,
            :data:`~graphflop.meta.PARAM` ``@....weight``, a forward
            :data:`~graphflop.meta.CALL_SITE` with call site -1), and an output returning every
            node.
        calls: the calls, in graph order.
        graph: the top level: the graph's other nodes (placeholders, output, work outside
            every block; each shares its ``meta`` dict with the flat graph's node, so the
            annotations passes write later, ``COST`` say, are read here too) and per call one ``graphflop::repeat(arguments, call)`` node with
            ``getitem(call, i)`` for the run's node ``i`` read outside it.
    """

    templates: tuple[GraphModule, ...]
    calls: tuple[DerivedCall, ...]
    graph: GraphModule
    #: per call, the flat graph's nodes of its run, in its template's node order (so a pass on
    #: the flat graph can give each the figure of its template node: ``annotate_flops``)
    runs: tuple[list[Node], ...] = field(default=(), repr=False)
    #: a recorded JVP's whole log (:data:`~graphflop.meta.JVP_LOG`, in order): the top level's
    #: entries (nodes, ghosts, custom Functions' entries) and ``(repeat node, i)`` for the
    #: call's template node ``i`` logged, so that :func:`expand_jvp` rebuilds the flat log
    #: (a :class:`CallLog`: a call's entries held as one)
    log: Sequence[Any] | None = field(default=None, repr=False)
    #: with :attr:`log`: each first call's node (erased from the top level, still read by the
    #: ghosts' arguments) -> ``(repeat node, i)``
    moved: dict[Node, tuple[Node, int]] = field(default_factory=dict, repr=False)
    #: a recorded hierarchy's (:class:`DirectRecorder`) flat names: per call, per node of its
    #: template, the name the graph built flat gives the call's node, or None for a node the
    #: backward's fold of transposed products made (named as below)
    names: tuple[tuple[str | None, ...], ...] | None = field(default=None, repr=False)
    #: with :attr:`names`: the top level's nodes that fold made, and fx's names as they were
    #: when it began (:class:`FlatNames`), from which the flat graph's fold named its nodes
    folded: frozenset[Node] = field(default=frozenset(), repr=False)
    fold_names: FlatNames | None = field(default=None, repr=False)

    def localize(self, m: dict, c: DerivedCall, absolute: dict[str, str]) -> None:
        """Make a template node's relative annotations ``m`` call ``c``'s (in place): for the
        derivative builders, which sit below this module's layer."""
        _localize(m, c, absolute)

    def localized(self, m: dict, plan: tuple, c: DerivedCall, absolute: dict[str, str]) -> dict:
        """:func:`localized`: for the derivative builders, which sit below this module's
        layer."""
        return localized(m, plan, c, absolute)

    def localize_plan(self, m: dict) -> tuple:
        """:func:`localize_plan`: for the derivative builders, which sit below this module's
        layer."""
        return localize_plan(m)

    def expand_jvp(self, gm: GraphModule) -> GraphModule:
        """:func:`expand_jvp` of ``gm``, this hierarchy's recorded JVP top level: for the
        transpose, which sits below this module's layer."""
        return expand_jvp(gm)

    def uses(self) -> list[int]:
        """How many calls each template derivative has."""
        out = [0] * len(self.templates)
        for c in self.calls:
            out[c.template] += 1
        return out


#: per forward graph, what the describers of its derivative graphs read of it (the JVP's, the
#: backward's, the update's and the step's: worked out once), with the graph's identity and
#: size then (a graph replaced or grown is read again); the values name no node, so nothing
#: here keeps a graph alive
_FORWARD_FACTS: weakref.WeakKeyDictionary[
    GraphModule,
    tuple[tuple[int, int], tuple[dict[str, tuple[int, tuple]], set[int], dict[str, Any]]],
] = weakref.WeakKeyDictionary()


def forward_facts(
    forward: GraphModule,
) -> tuple[dict[str, tuple[int, tuple]], set[int], dict[str, Any]]:
    """(:func:`_forward_keys` of ``forward``, its sites with a key shared, :func:`forward_tags`),
    worked out once per forward graph. Shared by every caller: read, never written."""
    stamp = (id(forward.graph), len(forward.graph.nodes))
    got = _FORWARD_FACTS.get(forward)
    if got is not None and got[0] == stamp:
        return got[1]
    keys, dup = _forward_keys(forward)
    facts = (keys, dup, forward_tags(forward))
    _FORWARD_FACTS[forward] = (stamp, facts)
    return facts


#: per forward graph, the inverse of its keys and per call site its module paths (absolute ->
#: relative): what every :class:`_Describer` of it reads (the JVP's, the backward's, the
#: update's, the step's), with the stamp of :data:`_FORWARD_FACTS` and the hierarchy's identity
_DESCRIBER_FACTS: weakref.WeakKeyDictionary[
    GraphModule,
    tuple[tuple[int, int, int], tuple[dict[tuple[int, tuple], str], list[dict[str, str]]]],
] = weakref.WeakKeyDictionary()


def _describer_facts(
    forward: GraphModule, h: Hierarchy
) -> tuple[dict[tuple[int, tuple], str], list[dict[str, str]]]:
    """(``(site, key)`` -> forward node name, per call site its module paths absolute ->
    relative), worked out once per forward graph and hierarchy. Shared: read, never written."""
    stamp = (id(forward.graph), len(forward.graph.nodes), id(h))
    got = _DESCRIBER_FACTS.get(forward)
    if got is not None and got[0] == stamp:
        return got[1]
    keys = forward_facts(forward)[0]
    facts = ({v: k for k, v in keys.items()}, [{a: r for r, a in s.modules} for s in h.sites])
    _DESCRIBER_FACTS[forward] = (stamp, facts)
    return facts


def forget_forward_facts(forward: GraphModule) -> None:
    """Drop what was worked out once per forward graph for the describers of its derivative
    graphs (:func:`forward_facts`, :func:`call_keys` and the like): a reader after that works
    it out again."""
    _FORWARD_FACTS.pop(forward, None)
    _DESCRIBER_FACTS.pop(forward, None)
    forget_tables(forward)


def _forward_keys(forward: GraphModule) -> tuple[dict[str, tuple[int, tuple]], set[int]]:
    """Per forward node copied from a template, ``(site, key)`` (key: the template index, and
    the output of a ``getitem`` tracing added afterwards); the sites where two nodes share a
    key (a rewritten graph). The derivative builders' walk (:func:`~graphflop.ad.blocks.call_keys`,
    shared: read only)."""
    keys = call_keys(forward)
    return keys.names, set(keys.dup)


def _layout(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_layout(x) for x in v)
    return None


class _Unshared(Exception):
    """A run that cannot be described relative to its call site."""


class _Describer:
    """Describes runs of a derivative graph relative to their call sites."""

    def __init__(self, forward: GraphModule, h: Hierarchy) -> None:
        self.keys, self.dup, self.tags = forward_facts(forward)  # shared: read only
        self.names, self.rel = _describer_facts(forward, h)  # shared: read only
        self.h = h

    def tags_of(self, sources: tuple[str, ...]) -> tuple[Any, ...]:
        """:attr:`DerivedCall.tags` of a call with ``sources``."""
        return tags_of(self.tags, sources)

    def site(self, n: Node) -> int | None:
        if n.op != "call_function":
            return None
        k = self.keys.get(n.meta.get(SOURCE, ""))
        if k is not None:
            return None if k[0] in self.dup else k[0]
        cs = n.meta.get(CALL_SITE)  # a copy of a forward node without a source
        return None if cs is None or cs[0] in self.dup else cs[0]

    def describe(self, run: list[Node], s: int) -> tuple[tuple, list[Node], list[tuple]]:
        """The run's description (hashable), its values from outside in order, and its source
        slots' keys (:class:`_Unshared` where it cannot be described)."""
        pos = {n: i for i, n in enumerate(run)}
        ext: dict[Node, int] = {}
        slots: dict[tuple, int] = {}
        rel = self.rel[s]

        def arg(a: Any) -> Any:
            c = a.__class__
            if c is Node:
                i = pos.get(a)
                return (_IN, i) if i is not None else (_OUT, ext.setdefault(a, len(ext)))
            if c in _SCALARS:
                return a
            if isinstance(a, (list, tuple)):  # fx's immutable_list, torch.Size too
                return (c, tuple([arg(b) for b in a]))
            if isinstance(a, dict):
                return (c, tuple([(k, arg(v)) for k, v in a.items()]))
            if isinstance(a, Node):
                raise _Unshared
            return a

        rows = []
        for n in run:
            m = n.meta
            module = m.get(MODULE, "")
            r_module = rel.get(module, ("abs", module))
            src = m.get(SOURCE)
            k = self.keys.get(src) if src is not None else None
            r_src = ("slot", slots.setdefault(k[1], len(slots))) if k and k[0] == s else src
            r_param = None
            if PARAM in m:
                owner, _, leaf = m[PARAM].rpartition(".")
                r_owner = _relative_owner(owner, rel)
                r_param = (r_owner, leaf) if r_owner is not None else ("abs", m[PARAM])
            cs = m.get(CALL_SITE)
            r_cs = ("own",) + tuple(cs[1:]) if cs is not None and cs[0] == s else cs
            others = tuple([(key, v) for key, v in m.items() if key in _COMPARED])
            r_tag = relative_tag(m, bool(k and k[0] == s), self.tags)
            rows.append(
                (
                    n.target,
                    arg(n.args),
                    arg(n.kwargs),
                    _layout(m.get("val")),
                    r_module,
                    r_src,
                    r_param,
                    r_cs,
                    others,
                    r_tag,
                )
            )
        sig = (tuple(rows), len(ext))
        try:
            hash(sig)
        except TypeError:
            raise _Unshared from None
        order = sorted(slots, key=slots.__getitem__)
        return sig, list(ext), order


def _relative_owner(owner: str, rel: dict[str, str]) -> str | None:
    """The path relative to a call's block (``@...``) of module ``owner``, the owner of a
    parameter (``rel``: the call's module paths, absolute -> relative): a module the call ran,
    or one under the block it did not run (its parameters read directly, as
    ``nn.MultiheadAttention`` reads ``out_proj``'s); None outside the block."""
    r = rel.get(owner)
    if r is not None:
        return r
    for a, r in rel.items():
        if r == "@" and a and owner.startswith(a + "."):
            return "@" + owner[len(a) :]
    return None


def _placeholder_name(v: Node) -> str:
    if v.op == "placeholder" and RESIDUAL in v.meta:
        return "residual"
    return v.meta.get(KIND) or "value"


def _template(
    run: list[Node],
    ext: list[Node],
    s: int,
    d: Any,
    root: torch.nn.Module,
    relative_owner: Callable[[str, dict[str, str]], str | None] = _relative_owner,
) -> GraphModule:
    """The template derivative of ``run`` (call site ``s``): see :class:`DerivedHierarchy`.
    ``d``: a describer with the call sites' relative module paths (``rel``) and the forward
    sources' places (``keys``), as :class:`_Describer` has them; ``relative_owner``: a
    parameter's owner module's path in the block, or None to keep it absolute."""
    g = Graph()
    env: dict[Node, Node] = {}
    for j, v in enumerate(ext):
        p = g.placeholder(f"{_placeholder_name(v)}_{j}")
        p.meta = {k: v.meta[k] for k in ("val", KIND, ROLE) if k in v.meta}
        env[v] = p
    rel = d.rel[s]
    slots: dict[tuple, int] = {}
    made = []
    for n in run:
        new = copy_node(g, n, env.__getitem__)
        m = new.meta
        m.pop(COST, None)
        if m.get(MODULE, "") in rel:
            m[MODULE] = rel[m.get(MODULE, "")]
        k = d.keys.get(m.get(SOURCE, ""))
        if CHECKPOINT in m:
            m[CHECKPOINT] = relative_tag(m, k is not None and k[0] == s, d.tags)
        if k is not None and k[0] == s:
            m[SOURCE] = f"@{slots.setdefault(k[1], len(slots))}"
        if PARAM in m:
            owner, _, leaf = m[PARAM].rpartition(".")
            r_owner = relative_owner(owner, rel)
            if r_owner is not None:
                m[PARAM] = f"{r_owner}.{leaf}"
        cs = m.get(CALL_SITE)
        if cs is not None and cs[0] == s:
            m[CALL_SITE] = (-1, *cs[1:])
        env[n] = new
        made.append(new)
    g.output(tuple(made))
    return graph_module(root, g)


def build(gm: GraphModule, forward: GraphModule) -> DerivedHierarchy | None:
    """The hierarchy of derivative graph ``gm`` of ``forward`` (see the module docstring), or
    None when ``forward`` has no hierarchy or ``gm`` no call."""
    h: Hierarchy | None = forward.meta.get(HIERARCHY)
    if h is None:
        return None
    d = _Describer(forward, h)
    items: list[Any] = []  # nodes of the top level, and per call (run, ext, call number)
    variants: dict[tuple, int] = {}
    templates: list[GraphModule] = []
    calls: list[DerivedCall] = []
    runs: list[list[Node]] = []

    def close(run: list[Node], s: int) -> None:
        try:
            sig, ext, order = d.describe(run, s)
        except _Unshared:
            items.extend(run)
            return
        t = variants.get(sig)
        if t is None:
            t = variants[sig] = len(templates)
            templates.append(_template(run, ext, s, d, gm))
        sources = tuple(d.names[(s, k)] for k in order)
        calls.append(DerivedCall(s, t, d.h.sites[s].modules, sources, d.tags_of(sources)))
        runs.append(run)
        items.append((run, ext, len(calls) - 1))

    run: list[Node] = []
    at: int | None = None
    for n in gm.graph.nodes:
        s = d.site(n)
        if run and s != at:
            close(run, at)  # type: ignore[arg-type]
            run = []
        if s is None:
            items.append(n)
        else:
            run.append(n)
        at = s
    if run:
        close(run, at)  # type: ignore[arg-type]
    if not calls:
        return None
    return DerivedHierarchy(tuple(templates), tuple(calls), _top(gm, items), tuple(runs))


def _top(gm: GraphModule, items: list[Any]) -> GraphModule:
    g = Graph()
    env: dict[Node, Node] = {}
    call_op = torch.ops.graphflop.repeat.default
    for x in items:
        if isinstance(x, Node):
            new = env[x] = copy_node(g, x, env.__getitem__)
            # shared: what later passes write on the node (COST) shows here; set without fx's
            # Node.__setattr__, which re-files the node in the find_nodes table
            object.__setattr__(new, "meta", x.meta)
            continue
        run, ext, number = x
        inside = set(run)
        call = emit_named(g, call_op, ([env[v] for v in ext], number), base_name(g, call_op))
        for i, n in enumerate(run):
            if any(u not in inside for u in n.users):
                item = emit_named(g, operator.getitem, (call, i), "getitem")
                object.__setattr__(item, "meta", dict(n.meta))
                env[n] = item
    return graph_module(gm, g)


def expand(dh: DerivedHierarchy) -> GraphModule:
    """The flat derivative graph rebuilt from ``dh`` alone: the top level with each call
    replaced by its template derivative's nodes, the call's arguments standing for the
    placeholders and its module paths, forward sources, parameters and call site for the
    relative ones. Node for node the graph :func:`build` read: ops, arguments, output layouts
    and every graphflop annotation (``tests/test_hierarchy.py``). A hierarchy recorded while
    it was built (:class:`DirectRecorder`) gives every node the name the graph built flat
    gives it (:attr:`DerivedHierarchy.names`); for one :func:`build` read, the names of a
    call's nodes are made anew (unique, not necessarily the flat graph's), the top level's are
    kept."""
    return _expanded(dh)[0]


def _expanded(
    dh: DerivedHierarchy,
) -> tuple[GraphModule, dict[Node, Any], dict[Node, list[Node]]]:
    """:func:`expand`'s graph, with per top-level node its copy (a getitem of a call: the
    call's node) and per repeat node the call's nodes in template order.

    A call's copy of a forward node (:data:`~graphflop.meta.KIND` ``primal``; not a
    ``getitem``, which fx numbers) is named after that forward node, as the JVP built flat
    names it (the eager memory schedules pair a forward node with its tangents by that name);
    no other node takes those names. A recorded hierarchy's calls take their names from
    :attr:`DerivedHierarchy.names`; the nodes the backward's fold made are named in graph
    order, the order the flat graph's fold made them in, from the names as they were when it
    began (:attr:`DerivedHierarchy.fold_names`)."""
    g = Graph()
    env: dict[Node, Any] = {}
    results: dict[Node, list[Node]] = {}
    call_op = torch.ops.graphflop.repeat.default
    names = dh.names
    used = g._graph_namespace._used_names  # reserved names are claimed only by their node
    primal_slots = [_primal_slots(t) for t in dh.templates] if names is None else []
    if names is None:
        used.update(c.sources[k] for c in dh.calls for k in primal_slots[c.template].values())
    fold = dh.fold_names.copy() if dh.fold_names is not None else None
    for n in dh.graph.graph.nodes:
        if n.target is call_op:
            args, number = n.args
            c = dh.calls[number]
            tg = dh.templates[c.template].graph
            own = names[number] if names is not None else None
            slots = primal_slots[c.template] if names is None else {}
            absolute = dict(c.modules)
            tenv: dict[Node, Any] = {}
            made: list[Node] = []
            it = iter(args)
            for i, x in enumerate(tg.nodes):
                if x.op == "placeholder":
                    a = next(it)  # a node, or (a PACKED placeholder, position)
                    tenv[x] = env[a] if type(a) is not tuple else env[a[0]][a[1]]
                    continue
                if x.op == "output":
                    break
                name: str | None = None
                if own is not None:
                    name = own[len(made)]
                    if name is None:
                        assert fold is not None
                        name = fold.name(x.target)
                elif (k := slots.get(i)) is not None:
                    name = c.sources[k]
                    used.discard(name)
                new = copy_node(g, x, tenv.__getitem__, name)
                _localize(new.meta, c, absolute)
                tenv[x] = new
                made.append(new)
            results[n] = made
        elif n.target is operator.getitem and n.args[0] in results:
            env[n] = results[n.args[0]][n.args[1]]
        elif n in dh.folded:
            assert fold is not None
            env[n] = copy_node(g, n, env.__getitem__, fold.name(n.target))
        elif n.op == "placeholder" and PACKED in n.meta:
            env[n] = unpack(g, n)
        else:
            env[n] = copy_node(g, n, env.__getitem__)
    return graph_module(dh.graph, g), env, results


def _primal_slots(t: GraphModule) -> dict[int, int]:
    """Per position in template derivative ``t``'s nodes, the source slot of its copies of a
    forward node (:data:`~graphflop.meta.KIND` ``primal``, :data:`~graphflop.meta.SOURCE`
    ``@k``; not the getitems)."""
    out = {}
    for i, x in enumerate(t.graph.nodes):
        src = x.meta.get(SOURCE)
        if (
            x.op == "call_function"
            and x.target is not operator.getitem  # named by fx's counter in the flat JVP too
            and x.meta.get(KIND) == "primal"
            and src
            and src[0] == "@"
        ):
            out[i] = int(src[1:])
    return out


def is_recorded(gm: GraphModule | None) -> bool:
    """Whether ``gm`` is the top level of a derivative hierarchy recorded while it was built
    (``direct=True``: :class:`DirectRecorder`), i.e. there is no flat graph beside it."""
    dh = gm.meta.get(DERIVED_HIERARCHY) if gm is not None else None
    return dh is not None and dh.graph is gm


def release_names(gm: GraphModule | None) -> None:
    """Free the names a recorded top level ``gm`` (:func:`is_recorded`; anything else is left
    as it is) took for the nodes its calls' flat copies are given, and the nodes erased from
    it: its namespace keeps its own nodes' names and its count per base name, not the names it
    took for its calls (kept in :attr:`DerivedHierarchy.names` where the flat view reads them;
    about 30,000 of Llama-3.1-405B's JVP, a 2 MiB set), nor the erased nodes fx's
    ``erase_node`` leaves in it (``_obj_to_name``, which held each erased node and its
    annotations: about 1,700 of that backward's). For a top level that is built, whose calls
    take no more names (its flat view, :func:`expand`, names its nodes in a graph of its own):
    a node made in it later is named as fx names it, its base's count numbering on."""
    if not is_recorded(gm):
        return
    assert gm is not None
    ns = gm.graph._graph_namespace
    named = ns._obj_to_name  # each node made -> its name (erased ones too)
    if len(named) > len(gm.graph.nodes):
        for k in [k for k in named if getattr(k, "_erased", False)]:
            del named[k]
    if len(named) < len(ns._used_names):
        ns._used_names = set(named.values())


#: the attribute of a recorded top level holding its kept flat view (on the object itself: a
#: table keyed by the top level would hold it for good, the view's hierarchy naming it)
_FLAT_VIEW = "_graphflop_flat_view"


def flat_view(gm: GraphModule) -> GraphModule:
    """The flat derivative graph of ``gm`` for the consumers that need every node (memory
    schedules, the forward-gradient step, verify, bench, export, renders): ``gm`` itself unless
    it is a recorded top level (:func:`is_recorded`); else :func:`expand` of its hierarchy
    (:func:`expand_jvp` for a recorded JVP: the whole log, ghosts and links), made once per
    top level and kept, with ``gm``'s graph annotations and a
    :data:`~graphflop.meta.DERIVED_HIERARCHY` whose ``runs`` are each call's nodes (so the
    memory schedules compose its calls, as on a graph :func:`attach` described). Where ``gm``
    was costed (:data:`~graphflop.meta.COST` on its nodes: ``annotate_flops``), its copies
    carry their template nodes' costs, and the view is kept; before that it is made anew
    each time."""
    if not is_recorded(gm):
        return gm
    got = gm.__dict__.get(_FLAT_VIEW)
    if got is not None:
        return got
    dh: DerivedHierarchy = gm.meta[DERIVED_HIERARCHY]
    if dh.log is not None:
        flat, results = _expand_jvp(gm)
    else:
        flat, _, results = _expanded(dh)
        for k, v in gm.meta.items():
            if k != DERIVED_HIERARCHY:
                flat.meta[k] = v
    runs: list[list[Node]] = [[] for _ in dh.calls]
    for rep, made in results.items():
        number: Any = rep.args[1]
        runs[number] = made
    flat.meta[DERIVED_HIERARCHY] = replace(dh, runs=tuple(runs))
    if all(COST in n.meta for n in gm.graph.nodes):  # costed: the view is final
        object.__setattr__(gm, _FLAT_VIEW, flat)  # not a submodule: nn.Module's setattr
    return flat


def expand_jvp(gm: GraphModule) -> GraphModule:
    """The flat JVP graph of a recorded JVP hierarchy's top level ``gm`` (built with a
    :class:`DirectRecorder`): :func:`expand`'s graph with the JVP's annotations the transpose
    reads (:data:`~graphflop.meta.JVP`, :data:`~graphflop.meta.JVP_LOG` whole, in the order the
    flat build logged it, :data:`~graphflop.meta.GHOST_LINKS`, ghosts, gaps, signature).

    Raises:
        ValueError: where ``gm`` is not such a top level, or its hierarchy has no whole log.
    """
    return _expand_jvp(gm)[0]


def _expand_jvp(gm: GraphModule) -> tuple[GraphModule, dict[Node, list[Node]]]:
    """:func:`expand_jvp`'s graph, with per repeat node the call's nodes in template order."""
    dh = gm.meta.get(DERIVED_HIERARCHY)
    if dh is None or dh.graph is not gm or dh.log is None:
        raise ValueError("expand_jvp needs the top level of a JVP recorded with direct=True")
    flat, env, results = _expanded(dh)
    ghosts: dict[int, GhostValue] = {}

    def value(x: Any) -> Any:
        if isinstance(x, Node):
            if x in env:
                return env[x]
            rep, i = dh.moved[x]
            return results[rep][i]
        if isinstance(x, (list, tuple)):
            return type(x)(value(y) for y in x)
        if isinstance(x, dict):
            return {k: value(y) for k, y in x.items()}
        if is_ghost(x):  # its arguments read the flat graph's nodes (one copy per ghost)
            got = ghosts.get(id(x))
            if got is None:
                got = ghosts[id(x)] = copy.copy(x)
                object.__setattr__(got, "args", value(x.args))
                object.__setattr__(got, "kwargs", value(x.kwargs))
            return got
        if isinstance(x, FunctionEntry):  # a custom Function's: its tangents and saved values
            return replace(
                x, inputs=value(x.inputs), outputs=value(x.outputs), saved=value(x.saved)
            )
        return x

    log = [results[e[0]][e[1]] if isinstance(e, tuple) else value(e) for e in dh.log]
    for k, v in gm.meta.items():
        if k not in (DERIVED_HIERARCHY, JVP_LOG, GHOST_LINKS):
            flat.meta[k] = v
    flat.meta[JVP_LOG] = tuple(log)
    links = gm.meta.get(GHOST_LINKS)
    if links is not None:
        flat.meta[GHOST_LINKS] = GhostLinks.of({value(n): value(gs) for n, gs in links.items()})
    return flat, results


def _localize(m: dict, c: DerivedCall, absolute: dict[str, str]) -> None:
    """Make a template node's relative annotations ``m`` call ``c``'s (in place)."""
    module = m.get(MODULE)
    if module is not None and module.startswith("@"):
        m[MODULE] = absolute[module]
    src = m.get(SOURCE)
    if src is not None and src.startswith("@"):
        m[SOURCE] = c.sources[int(src[1:])]
        if m.get(CHECKPOINT) is OWN_TAG:
            m[CHECKPOINT] = c.tags[int(src[1:])]
    p = m.get(PARAM)
    if p is not None and p.startswith("@"):
        owner, _, leaf = p.rpartition(".")
        a = absolute.get(owner)
        m[PARAM] = f"{a if a is not None else absolute['@'] + owner[1:]}.{leaf}"
    cs = m.get(CALL_SITE)
    if cs is not None and cs[0] == -1:
        m[CALL_SITE] = (c.site, *cs[1:])


def localize_plan(m: dict) -> tuple:
    """What :func:`_localize` changes in a template node's annotations ``m``, worked out once
    (for :func:`localized`): its relative module path, its source slot and whether its
    checkpoint tag is the source's own, its parameter path's ``(owner, leaf)``, the rest of
    its forward call site; each None (False) where :func:`_localize` leaves it."""
    module = m.get(MODULE)
    src = m.get(SOURCE)
    slot = int(src[1:]) if src is not None and src.startswith("@") else None
    p = m.get(PARAM)
    param = p.rpartition(".")[::2] if p is not None and p.startswith("@") else None
    cs = m.get(CALL_SITE)
    return (
        module if module is not None and module.startswith("@") else None,
        slot,
        slot is not None and m.get(CHECKPOINT) is OWN_TAG,
        param,
        cs[1:] if cs is not None and cs[0] == -1 else None,
    )


def localized(m: dict, plan: tuple, c: DerivedCall, absolute: dict[str, str]) -> dict:
    """A copy of a template node's annotations ``m`` made call ``c``'s: :func:`_localize` of
    the copy, by ``plan`` (:func:`localize_plan` of ``m``)."""
    out = dict(m)
    module, slot, own, param, rest = plan
    if module is not None:
        out[MODULE] = absolute[module]
    if slot is not None:
        out[SOURCE] = c.sources[slot]
        if own:
            out[CHECKPOINT] = c.tags[slot]
    if param is not None:
        owner, leaf = param
        a = absolute.get(owner)
        out[PARAM] = f"{a if a is not None else absolute['@'] + owner[1:]}.{leaf}"
    if rest is not None:
        out[CALL_SITE] = (c.site, *rest)
    return out


def attach(gm: GraphModule, forward: GraphModule) -> GraphModule:
    """Store :func:`build`'s hierarchy of ``gm`` in ``gm.meta[DERIVED_HIERARCHY]`` (when it has
    calls) and return ``gm``."""
    dh = build(gm, forward)
    if dh is not None:
        gm.meta[DERIVED_HIERARCHY] = dh
    return gm


# -- figures composed per template --------------------------------------------------------------
@dataclass
class DerivedFigures:
    """A derivative graph's figures over the nodes a selection keeps, composed per template.

    Attributes:
        total: their costs summed.
        by_role: per role (a node without one counts as the ``default_role`` given), FLOPs.
        rows: per module path, in the order the flat graph first meets it, ``[flops, mm_flops,
            {role: flops}]``.
        ops: per op name, in the order first met, ``(count, costs summed)`` (``getitem``
            left out).
        rule_less: nodes whose op has no rule.
        ruled: every ``call_function`` node of the flat graph has an op with a rule, whether
            the selection keeps it or not (``getitem`` left out): :func:`rule_less_calls`
            finds none (None: not worked out).
    """

    total: NodeCost
    by_role: dict[str, int] = field(default_factory=dict)
    rows: dict[str, list] = field(default_factory=dict)
    ops: dict[str, tuple[int, NodeCost]] = field(default_factory=dict)
    rule_less: int = 0
    ruled: bool | None = None


def _cost(n: Node) -> NodeCost:
    c = n.meta.get(COST)
    if c is None:
        if n.op != "call_function":
            return ZERO_COST
        c = n.meta[COST] = op_cost(n.target, n.args, n.kwargs, n, node=n.name)
    return c


def _sum_times(costs: list[tuple[NodeCost, int]]) -> NodeCost:
    """:func:`~graphflop.passes.flops.sum_costs` of each ``(cost, k)``'s cost taken ``k``
    times, in order: ``k`` times its fields where they are integers (exact), else added ``k``
    times over."""

    def terms() -> Iterator[NodeCost]:
        for c, k in costs:
            fields = (
                c.flops,
                c.mm_flops,
                c.transcendentals,
                c.random_elements,
                c.bytes_read,
                c.bytes_written,
            )
            if k != 1 and all(type(x) is int for x in fields):
                yield NodeCost(*(k * x for x in fields))
            else:
                yield from itertools.repeat(c, k)

    return sum_costs(terms())


class _Acc:
    """Sums of costs by role, module and op (see :class:`DerivedFigures`); each cost is kept
    with how many times it counts (a template's, once per call)."""

    def __init__(self) -> None:
        self.costs: list[tuple[NodeCost, int]] = []
        self.by_role: dict[str, int] = {}
        self.rows: dict[str, list] = {}
        self.ops: dict[str, list] = {}
        self.rule_less = 0
        #: op -> (its name, whether it has no rule), looked up once per op
        self._known: dict[Any, tuple[str, bool]] = {}

    def node(self, n: Node, module: str, role: str) -> None:
        c = _cost(n)
        self.costs.append((c, 1))
        self.by_role[role] = self.by_role.get(role, 0) + c.flops
        row = self.rows.setdefault(module, [0, 0, {}])
        row[0] += c.flops
        row[1] += c.mm_flops
        row[2][role] = row[2].get(role, 0) + c.flops
        t = n.target
        if t is not operator.getitem:
            known = self._known.get(t)
            if known is None:
                known = self._known[t] = (op_name(t), not has_rule(t))
            acc = self.ops.setdefault(known[0], [0, []])
            acc[0] += 1
            acc[1].append((c, 1))
            self.rule_less += known[1]

    def freeze(self) -> _Acc:
        """The same sums with each op's costs (and all costs) summed into one."""
        self.costs = [(_sum_times(self.costs), 1)]
        self.ops = {k: [count, [(_sum_times(cs), 1)]] for k, (count, cs) in self.ops.items()}
        return self

    def add_rows(self, other: _Acc, module: dict[str, str], first: bool = True) -> None:
        """Add a frozen template's rows (their module paths mapped by ``module``), and, at its
        ``first`` call, enter its roles and ops where they are new (the order first met; at
        its later calls they are all entered already): its other sums are the same at every
        call, added for all its calls at once (:meth:`add_times`)."""
        rows = self.rows
        for rel, (f, mm, roles) in other.rows.items():
            path = module.get(rel, rel)
            row = rows.get(path)
            if row is None:  # (the common case: a call's modules are its own)
                rows[path] = [f, mm, roles.copy()]
                continue
            row[0] += f
            row[1] += mm
            by = row[2]
            for r, x in roles.items():
                by[r] = by.get(r, 0) + x
        if first:
            for r in other.by_role:
                self.by_role.setdefault(r, 0)
            for op in other.ops:
                self.ops.setdefault(op, [0, []])

    def add_times(self, other: _Acc, k: int) -> None:
        """Add a frozen template's sums but its rows ``k`` times (its calls' share, each call's
        rows added by :meth:`add_rows`): FLOPs and counts are integers, so the sums do not
        depend on the order they are added in; each cost is kept once, counted ``k`` times
        (:func:`_sum_times`)."""
        self.costs.extend((c, m * k) for c, m in other.costs)
        for r, f in other.by_role.items():
            self.by_role[r] = self.by_role.get(r, 0) + k * f
        for op, (count, costs) in other.ops.items():
            acc = self.ops.setdefault(op, [0, []])
            acc[0] += k * count
            acc[1].extend((c, m * k) for c, m in costs)
        self.rule_less += k * other.rule_less


def derived_figures(
    dh: DerivedHierarchy,
    keep: Callable[[Node], bool] = lambda n: True,
    default_role: str = "",
) -> DerivedFigures:
    """The figures of the flat derivative graph's ``call_function`` nodes that ``keep``
    selects, composed from ``dh``: each template's nodes rolled up once, added per call under
    its module paths, plus the top level's nodes. ``keep`` must depend only on a node's own
    annotations other than its module, source and parameter (the JVP's ``KIND`` in
    ``("tangent", "coef")``, say). A node without :data:`~graphflop.meta.COST` is costed by
    its op's rule (:func:`graphflop.ops.cost.op_cost`), as ``annotate_flops`` costs it."""
    call_op = torch.ops.graphflop.repeat.default
    getitem = operator.getitem
    per_template: dict[int, _Acc] = {}
    calls: dict[int, int] = {}  # per template, its calls
    acc = _Acc()
    # the top level's ops (those of the getitems of calls apart), for ``ruled``
    top_ops: dict[int, Any] = {}
    outputs: set[Node] = set()  # the calls' getitems met so far (a call's users)
    for n in dh.graph.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        if t is call_op:
            c = dh.calls[n.args[1]]
            tf = per_template.get(c.template)
            if tf is None:
                tf = per_template[c.template] = _Acc()
                for x in _nodes(dh.templates[c.template]):
                    if keep(x):
                        tf.node(x, x.meta.get(MODULE, ""), x.meta.get(ROLE, default_role))
                tf.freeze()
            # the rest once per template, below
            acc.add_rows(tf, dict(c.modules), c.template not in calls)
            calls[c.template] = calls.get(c.template, 0) + 1
            outputs.update(n.users)
            continue
        if t is getitem and n in outputs:
            continue
        top_ops[id(t)] = t
        if keep(n):
            acc.node(n, n.meta.get(MODULE, ""), n.meta.get(ROLE, default_role))
    for template, k in calls.items():
        acc.add_times(per_template[template], k)
    ruled = not any(t is not getitem and not has_rule(t) for t in top_ops.values()) and not any(
        _rule_less_nodes(dh.templates[template]) for template in calls
    )
    return DerivedFigures(
        total=_sum_times(acc.costs),
        by_role=acc.by_role,
        rows=acc.rows,
        ops={k: (count, _sum_times(cs)) for k, (count, cs) in acc.ops.items()},
        rule_less=acc.rule_less,
        ruled=ruled,
    )


def _rule_less_nodes(t: GraphModule) -> list[Node]:
    """Template ``t``'s ``call_function`` nodes whose op has no rule (``getitem`` left out)."""
    return [x for x in _nodes(t) if x.target is not operator.getitem and not has_rule(x.target)]


def rule_less_calls(gm: GraphModule) -> list[tuple[Node, str | None, str]]:
    """The nodes of the flat graph of recorded top level ``gm`` (:func:`is_recorded`) whose op
    has no rule, in the flat graph's order, without making it: ``(node, forward source,
    module path)`` with a call's template node standing for its node at that call (its
    source and module made the call's)."""
    dh: DerivedHierarchy = gm.meta[DERIVED_HIERARCHY]
    call_op = torch.ops.graphflop.repeat.default
    per_template: dict[int, list[Node]] = {}
    out: list[tuple[Node, str | None, str]] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if n.target is call_op:
            c = dh.calls[n.args[1]]
            xs = per_template.get(c.template)
            if xs is None:
                xs = per_template[c.template] = _rule_less_nodes(dh.templates[c.template])
            if not xs:  # (the common case: every op has a rule)
                continue
            absolute = dict(c.modules)
            for x in xs:
                m = {k: x.meta[k] for k in (SOURCE, MODULE) if k in x.meta}
                _localize(m, c, absolute)
                out.append((x, m.get(SOURCE), m.get(MODULE, "")))
        elif not has_rule(n.target):
            out.append((n, n.meta.get(SOURCE), n.meta.get(MODULE, "")))
    return out


def unpacked(n: Node) -> Iterable[tuple[str, dict]]:
    """The placeholders of the flat graph that top-level placeholder ``n`` stands for, as
    ``(name, meta)``: those :data:`~graphflop.meta.PACKED` holds (a recorded update's block
    call's parameters, gradients or a state, no node made for them), else ``n``'s own."""
    packed = n.meta.get(PACKED)
    return zip(*packed) if packed is not None else ((n.name, n.meta),)


def unpack(g: Graph, n: Node) -> list[Node]:
    """The flat graph's placeholders of :data:`~graphflop.meta.PACKED` placeholder ``n``, made
    in ``g`` under their names: each its annotations as packed, then those written on ``n``
    since (its ``COST``) but its own."""
    extra = {k: v for k, v in n.meta.items() if k not in _PACK_OWN}
    out = []
    for name, meta in zip(*n.meta[PACKED]):
        p = new_node(g, "placeholder", name, name, (), NO_KWARGS)
        p.meta.update(meta)
        p.meta.update(extra)
        out.append(p)
    return out


#: a :data:`~graphflop.meta.PACKED` placeholder's own annotations (not its placeholders')
_PACK_OWN = frozenset({"val", PACKED, SLOT})


def _nodes(t: GraphModule) -> Iterable[Node]:
    return (x for x in t.graph.nodes if x.op == "call_function")


# -- the hierarchy recorded while the derivative graph is built -----------------------------------
@dataclass(eq=False)
class _First:
    """A variant's first, rule-built call, still flat in the graph being built."""

    run: list[Node]
    ext: list[Node]
    template: int
    site: int
    order: list[tuple]


_FAST_ARGS = hasattr(Node, "_update_args_kwargs")


def _set_arg(n: Node, idx: int, value: Any) -> None:
    """``n.update_arg(idx, value)`` without fx's re-filing of ``n`` in its graph's find_nodes
    table (``Node.__setattr__``), whose key (op and target) an argument does not change: a
    fifth of a getitem's update, done per getitem of every call when the calls are numbered
    (:meth:`DirectRecorder.finish`, :meth:`DirectRecorder.clean`)."""
    if not _FAST_ARGS:  # pragma: no cover - a PyTorch without the private setter
        n.update_arg(idx, value)
        return
    args = list(n.args)
    args[idx] = value
    n._update_args_kwargs(tuple(args), n.kwargs)


def _outside(inside: set[Node]) -> Callable[[Node], bool]:
    return lambda u: u not in inside


class DirectRecorder:
    """Records a derivative graph's calls while the graph is built, so that the flat graph is
    never made (the ``direct`` option of :class:`~graphflop.passes.autodiff.BuildJvp` and
    :class:`~graphflop.passes.autodiff.BuildVjp`).

    The expanders of :mod:`graphflop.ad.blocks` hand it each variant's first call (its nodes,
    built by the rules: :meth:`template` describes them as :func:`build` would and makes the
    template derivative from them) and, at every other call of that variant, the call's values
    from outside (:meth:`call` emits the ``graphflop::repeat`` node and its getitems in place of
    the nodes the expander would have copied). :meth:`finish` then turns each first call into a
    call too. The result is a :class:`DerivedHierarchy` whose top level is the graph built
    (``runs`` empty: there is no flat graph); :func:`expand` rebuilds the flat graph, equal
    node for node to the one built without the recorder, names included
    (``tests/test_derived_direct.py``).

    Names. fx names a node after its op (``mm_default``) and numbers those names per op in the
    order the nodes are made, erased ones included (``mm_default_7``: the eighth ``mm`` made).
    The graph built flat makes each expanded call's nodes where the call is; recorded, the call
    is one ``graphflop::repeat`` node, so without more every later node would take a lower
    number, and the copies :func:`expand` makes would be numbered in its own order. So
    :meth:`call` takes in the graph being built the names the copies would have taken, in the
    order the expander copies (which keeps every later name the flat build's) and keeps them
    as the call's (:attr:`DerivedHierarchy.names`); a first call's nodes keep the names the
    rules gave them. The backward's fold of transposed products names the nodes it makes last,
    in graph order over the flat graph, where per template it makes them once: :meth:`clean`
    keeps the names as they were when it began (:class:`FlatNames`), from which
    :func:`expand` names those nodes in graph order.

    Args:
        forward: the traced forward graph, with :data:`~graphflop.meta.HIERARCHY`.
    """

    def __init__(self, forward: GraphModule) -> None:
        h: Hierarchy = forward.meta[HIERARCHY]
        self.h = h
        self.d = _Describer(forward, h)
        self.variants: dict[tuple, int] = {}
        self.templates: list[GraphModule] = []
        self.firsts: list[_First] = []
        self.calls: list[DerivedCall] = []
        self.call_op = torch.ops.graphflop.repeat.default
        self._in_firsts: list[set[Node]] = []  # per first call, its nodes (for inside)
        #: per expanded call whose log entries were asked for: (log length before the call's
        #: entries, its repeat node, template positions logged)
        self.marks: list[tuple[int, Node, list[int]]] = []
        #: after :meth:`finish`: each first call's node -> (its repeat node, position)
        self.first_at: dict[Node, tuple[Node, int]] = {}
        #: per repeat node, per node of its template, the name the graph built flat gives
        #: the call's node (None: made by the backward's fold); per call in order after
        #: :meth:`finish` (:attr:`DerivedHierarchy.names`)
        self.names: dict[Node, list[str | None]] = {}
        self.call_names: list[tuple[str | None, ...]] = []
        #: after :meth:`clean`: the top level's nodes its fold made, and the names before it
        self.folded: frozenset[Node] = frozenset()
        self.fold_names: FlatNames | None = None
        self._bodies: dict[int, tuple[list[Node], list[tuple | None]]] = {}
        self._paths: dict[int, dict[str, str]] = {}

    def template(
        self, run: list[Node], site: int, root: torch.nn.Module, refs: dict[Node, Any] | None
    ) -> tuple | None:
        """Describe a call the rules built, ``run`` (its nodes in the graph being built, one
        unbroken run of it, call site ``site``), make it a call of its template derivative
        (:meth:`finish` replaces the nodes) and return a handle for :meth:`call`:
        ``(template, per value from outside in order its reference in refs, source slots)``.
        None where ``refs`` is None or a value from outside has no reference in it (no other
        call expands it; the run is still made a call), or where the run cannot be described
        (it stays at the top level, as :func:`build` would leave it), or is empty (the rules
        emitted nothing for the call: a custom Function's backward gave no cotangent to the
        work before it; :meth:`finish` has no node to put the call at)."""
        if not run:
            return None
        try:
            sig, ext, order = self.d.describe(run, site)
        except _Unshared:
            return None
        t = self.variants.get(sig)
        if t is None:
            t = self.variants[sig] = len(self.templates)
            self.templates.append(_template(run, ext, site, self.d, root))
        self.firsts.append(_First(run, ext, t, site, order))
        if refs is None or any(e not in refs for e in ext):
            return None
        return t, [refs[e] for e in ext], order

    def _call(
        self, site: int, handle: tuple, sources: tuple[str, ...] | None = None
    ) -> DerivedCall:
        t, _, order = handle
        if sources is None:
            names = self.d.names
            sources = tuple([names[(site, k)] for k in order])
        return DerivedCall(site, t, self.h.sites[site].modules, sources, self.d.tags_of(sources))

    def call(
        self,
        g: Graph,
        handle: tuple,
        site: int,
        args: list[Any],
        exposed: list[int],
        names: NamePlan,
        given: Sequence[str] = (),
        logged: tuple[int, list[int]] | None = None,
        sources: tuple[str, ...] | None = None,
    ) -> dict:
        """Emit at the end of ``g`` the call of ``handle``'s template at call site ``site``
        with values from outside ``args`` (in the handle's order): its ``graphflop::repeat``
        node and one getitem per template node in ``exposed`` (ascending; getitems nobody
        reads are dropped by :meth:`finish`). ``names`` (with ``given``, the call's names of
        its gaps): per template node, the name the expander would have asked fx for in
        copying it (its op's base name, or the forward node's name of a primal copy): the
        names fx gives are taken in ``g`` as the copies would have taken them
        (:meth:`~graphflop.ad.builder.NamePlan.take`), so every later node of ``g`` is named
        as in the graph built flat, and kept as the call's flat names. ``logged``: (the JVP log's length before the
        call, the template positions the call logs), kept for :attr:`DerivedHierarchy.log`.
        ``sources``: the call's :attr:`DerivedCall.sources`, where the caller has them (read
        off the forward's node names per source slot of the handle otherwise).
        Returns template node position -> getitem, each with that node's annotations made the
        call's."""
        c = self._call(site, handle, sources)
        number = len(self.calls)
        self.calls.append(c)
        taken: list[str | None] = names.take(g, given)  # type: ignore[assignment]
        rep = emit_named(g, self.call_op, (list(args), number), "repeat_call")
        self.names[rep] = taken
        if logged is not None:
            self.marks.append((logged[0], rep, logged[1]))
        items = {}
        if exposed:
            nodes, plans = self._body(c.template)
            absolute = self._absolute(site)
            for i in exposed:
                item = emit_named(g, operator.getitem, (rep, i), "repeat_item")
                plan = plans[i]
                if plan is None:
                    plan = plans[i] = localize_plan(nodes[i].meta)
                object.__setattr__(item, "meta", localized(nodes[i].meta, plan, c, absolute))
                items[i] = item
        return items

    def _body(self, template: int) -> tuple[list[Node], list[tuple | None]]:
        """Template derivative ``template``'s nodes other than its placeholders, in order, and
        per node its :func:`localize_plan` (None until first needed); listed once per
        template: a template derivative is not changed while calls of it are recorded."""
        got = self._bodies.get(template)
        if got is None:
            nodes = [x for x in self.templates[template].graph.nodes if x.op != "placeholder"]
            got = self._bodies[template] = (nodes, [None] * len(nodes))
        return got

    def _absolute(self, site: int) -> dict[str, str]:
        """Call site ``site``'s module paths, relative -> in the model (made once per site)."""
        got = self._paths.get(site)
        if got is None:
            got = self._paths[site] = dict(self.h.sites[site].modules)
        return got

    def finish(self, g: Graph, keep: Iterable[Any] = ()) -> dict[Node, Node]:
        """Turn each first call into a call of its template (a ``graphflop::repeat`` node where
        its first node was, a getitem per node read after it or in ``keep``), drop the
        getitems nobody reads (other than ``keep``'s) and number the calls in graph order.
        Returns the first calls' nodes in ``keep`` -> their getitems."""
        keep = set(keep)
        moved: dict[Node, Node] = {}
        firsts = []
        for f in self.firsts:
            c = self._call(f.site, (f.template, f.ext, f.order))
            firsts.append(c)
            inside = set(f.run)
            with g.inserting_before(f.run[0]):
                rep = emit_named(
                    g, self.call_op, ([moved.get(e, e) for e in f.ext], -len(firsts)), "repeat_call"
                )
            self.names[rep] = [n.name for n in f.run]
            prev = rep
            for i, n in enumerate(f.run):
                self.first_at[n] = (rep, i)
                if n in keep or any(u not in inside for u in n.users):
                    with g.inserting_after(prev):
                        item = emit_named(g, operator.getitem, (rep, i), "repeat_item")
                    object.__setattr__(item, "meta", n.meta)
                    n.replace_all_uses_with(item, delete_user_cb=_outside(inside))
                    moved[n] = item
                    prev = item
            for n in reversed(f.run):
                g.erase_node(n)
        made = set(moved.values())
        calls: list[DerivedCall] = []
        self.call_names = []
        for n in list(g.nodes):
            if n.target is operator.getitem and n.args[0].target is self.call_op:
                if not n.users and n not in keep and n not in made:
                    g.erase_node(n)
            elif n.target is self.call_op:
                number = n.args[1]
                calls.append(self.calls[number] if number >= 0 else firsts[-1 - number])
                self.call_names.append(tuple(self.names[n]))
                _set_arg(n, 1, len(calls) - 1)
        self.calls = calls
        return moved

    def log(self, raw: list[Any]) -> CallLog:
        """The JVP's whole log (:attr:`DerivedHierarchy.log`, a :class:`CallLog`) from the log
        built, ``raw`` (its entries before :meth:`finish`: a first call's nodes, an expanded
        call's getitems), after :meth:`finish`."""
        marks = iter(self.marks)
        mark = next(marks, None)
        out: list[Any] = []
        call_op = self.call_op
        for i, e in enumerate([*raw, None]):
            while mark is not None and mark[0] == i:
                if mark[2]:
                    out.append(_Run(mark[1], mark[2]))  # its (repeat node, k) entries
                mark = next(marks, None)
            if i == len(raw):
                break
            if isinstance(e, Node):
                at = self.first_at.get(e)
                if at is not None:
                    out.append(at)
                    continue
                if e.target is operator.getitem and (
                    getattr(e.args[0], "target", None) is call_op
                    # one :meth:`finish` erased, read by nothing (erasing it emptied its args)
                    or getattr(e, "_erased", False)
                ):
                    continue  # an expanded call's entry: its mark's
            out.append(e)
        return CallLog(out)

    def inside(self, n: Node) -> bool:
        """Whether ``n`` is a node of a call (a getitem of one, or a node of a first call
        :meth:`finish` has not yet made a call)."""
        if n.target is operator.getitem and getattr(n.args[0], "target", None) is self.call_op:
            return True
        if len(self._in_firsts) != len(self.firsts):
            self._in_firsts = [{x for x in f.run} for f in self.firsts]
        return any(n in run for run in self._in_firsts)

    def name(self, named: list[tuple[Node, str]]) -> bool:
        """Give each node of ``named`` (the graph's output values: a getitem of a call, or a
        top-level node) the parameter path it is the gradient of (:data:`~graphflop.meta.PARAM`),
        as the flat graph gives it its node: a call's node through its template node, with the
        path relative to the block. False where that cannot equal the flat graph: a template
        node named at one call and not another, or under other relative paths."""
        want: dict[tuple[int, int], dict[int, str]] = {}
        rels: dict[int, dict[str, str]] = {}  # per call, its module paths in the model -> relative
        for item, param in named:
            args: Any = item.args
            if not (item.target is operator.getitem and args[0].target is self.call_op):
                item.meta.setdefault(PARAM, param)
                continue
            number = args[0].args[1]
            c = self.calls[number]
            owner, _, leaf = param.rpartition(".")
            rel = rels.get(number)
            if rel is None:
                rel = rels[number] = {a: r for r, a in c.modules}
            r_owner = _relative_owner(owner, rel)
            per = want.setdefault((c.template, args[1]), {})
            if r_owner is None or number in per:
                return False
            per[number] = f"{r_owner}.{leaf}"
            item.meta.setdefault(PARAM, param)
        uses = [0] * len(self.templates)
        for c in self.calls:
            uses[c.template] += 1
        for (t, i), per in want.items():
            if len(per) != uses[t] or len(set(per.values())) != 1:
                return False
            x = [x for x in self.templates[t].graph.nodes if x.op == "call_function"][i]
            x.meta.setdefault(PARAM, next(iter(per.values())))
        return True

    def clean(self, g: Graph, impure: Callable[[Node], bool] | None = None) -> bool:
        """The backward's clean-ups on the graph :meth:`finish` ended, as they would run on the
        flat graph: dead-code elimination (fx's, one pass in reverse order: a call's node is
        dead where no node after it reads it, in the call or through a getitem; a call whose
        nodes are all dead goes) and :func:`~graphflop.ad.simplify.fold_transposed_matmuls`
        (at the top level, and per template derivative where a product is not read after its
        call). Calls of one template whose getitems read differ get templates of their own.
        False (the graph half cleaned: build it flat instead) where a fold could cross a
        call's boundary (a permute outside a call of a product inside it, or inside of one
        outside), or where ``impure`` is given (checkpointed work kept)."""
        if impure is not None:
            return False
        bodies = [_Body(t) for t in self.templates]
        keys, group_of = self._dead_code(g, bodies)
        templates = [bodies[t].pruned(seeds) for t, seeds in keys]
        self.fold_names = FlatNames(g)  # the flat graph's fold names its nodes from here
        made = _made(fold_graph(g))
        if self._crossing(g, group_of, templates, made):
            return False
        self.folded = frozenset(made)
        calls: list[DerivedCall] = []
        call_names = []
        for n in g.nodes:
            if n.target is self.call_op:
                c = self.calls[n.args[1]]
                gi = group_of[n]
                calls.append(DerivedCall(c.site, gi, c.modules, c.sources, c.tags))
                was = self.call_names[n.args[1]]
                call_names.append(tuple([None if i is None else was[i] for i in templates[gi][3]]))
                _set_arg(n, 1, len(calls) - 1)
                index = templates[gi][1]
                for u in list(n.users):
                    _set_arg(u, 1, index[u.args[1]])
        self.templates = [t[0] for t in templates]
        self.calls = calls
        self.call_names = call_names
        # (no ``g.lint()`` here: a check of every top-level node, a sixth of the backward's
        # per-block time; ``tests/test_derived_direct.py`` checks the graphs node for node)
        return True

    def _dead_code(self, g: Graph, bodies: list[_Body]) -> tuple[list[tuple], dict[Node, int]]:
        """Dead-code elimination over the top level and, per call, its template's nodes (see
        :meth:`clean`). Returns per group of calls left (one template, the same getitems read)
        ``(template, getitems read)``, and each call's group."""
        groups: dict[tuple, int] = {}
        keys: list[tuple] = []
        group_of: dict[Node, int] = {}
        for n in reversed(g.nodes):
            if n.target is self.call_op and n.op == "call_function":
                t = self.calls[n.args[1]].template
                seeds = frozenset(u.args[1] for u in n.users)
                live, used = bodies[t].live(seeds)
                if not live:
                    g.erase_node(n)
                    continue
                group_of[n] = groups.setdefault((t, seeds), len(keys))
                if group_of[n] == len(keys):
                    keys.append((t, seeds))
                if len(used) != len(n.args[0]):
                    _set_arg(n, 0, [a for j, a in enumerate(n.args[0]) if j in used])
            elif not n.users and not n.is_impure():
                g.erase_node(n)
        return keys, group_of

    def _crossing(
        self, g: Graph, group_of: dict[Node, int], pruned: list[tuple], made: set[Node]
    ) -> bool:
        """Whether the flat graph would fold a transposed product across a call's boundary: a
        permute ``[1, 0]`` at the top level whose product is a call's node, or in a template
        derivative (``pruned``: per group, the template folded, its getitems' new positions
        and the nodes the folds made) whose product is passed to the call, the permute being
        the product's only reader in the flat graph. The folds at the top level are done
        (``made``: the nodes they made); a permute a fold made is never folded again (the
        flat graph's fold visits the nodes it had when it began), a product it made is."""
        mm, permute = torch.ops.aten.mm.default, torch.ops.aten.permute.default
        inner = [[x for x in t.graph.nodes if x.op == "call_function"] for t, *_ in pruned]
        phs = [[x for x in t.graph.nodes if x.op == "placeholder"] for t, *_ in pruned]

        def readers(v: Node) -> int | None:
            """How many nodes read product ``v`` in the flat graph (None: not a product)."""
            if v.target is operator.getitem and v.args[0] in group_of:
                gi = group_of[v.args[0]]  # type: ignore[index]
                x = inner[gi][pruned[gi][1][v.args[1]]]
                if x.target is not mm:
                    return None
                count = sum(1 for u in x.users if u.op != "output")
            elif v.target is mm:
                count = 0
            else:
                return None
            for u in v.users:
                if u in group_of:
                    passed: Any = u.args[0]
                    count += sum(
                        len(phs[group_of[u]][j].users) for j, a in enumerate(passed) if a is v
                    )
                else:
                    count += 1
            return count

        def folds(p: Node, v: Any) -> bool:
            if p.target is not permute:  # any reader of a placeholder: a cast has one argument
                return False
            dims: Any = p.args[1]
            return list(dims) == [1, 0] and isinstance(v, Node) and readers(v) == 1

        for n in g.nodes:
            if n.target is permute and n.args[0].target is operator.getitem and n not in made:
                if folds(n, n.args[0]):
                    return True
        # per group, its placeholders a permute outside the folds' nodes reads (the others'
        # readers cannot fold: worked out once per group, not per call and value)
        permuted = [
            [
                j
                for j, ph in enumerate(phs[gi])
                if any(u.target is permute and u not in pruned[gi][2] for u in ph.users)
            ]
            for gi in range(len(pruned))
        ]
        for n, gi in group_of.items():
            inside = pruned[gi][2]
            values: Any = n.args[0]
            for j in permuted[gi]:
                a = values[j]
                if any(folds(u, a) for u in phs[gi][j].users if u not in inside):
                    return True
        return False

    def hierarchy(self, gm: GraphModule) -> DerivedHierarchy | None:
        """The hierarchy of top level ``gm`` (the graph :meth:`finish` ended), None without
        calls."""
        if not self.calls:
            return None
        return DerivedHierarchy(
            tuple(self.templates),
            tuple(self.calls),
            gm,
            names=tuple(self.call_names),
            folded=self.folded,
            fold_names=self.fold_names,
        )


class _Body:
    """A template derivative's nodes, for the clean-ups of :meth:`DirectRecorder.clean`."""

    def __init__(self, t: GraphModule) -> None:
        self.t = t
        self.phs = [x for x in t.graph.nodes if x.op == "placeholder"]
        self.nodes = [x for x in t.graph.nodes if x.op == "call_function"]
        pos = {x: i for i, x in enumerate(self.nodes)}
        ph = {x: j for j, x in enumerate(self.phs)}
        self.deps = [[pos[a] for a in x.all_input_nodes if a in pos] for x in self.nodes]
        self.reads = [[ph[a] for a in x.all_input_nodes if a in ph] for x in self.nodes]
        self.impure = [i for i, x in enumerate(self.nodes) if x.is_impure()]
        self._live: dict[frozenset, tuple[list[int], set[int]]] = {}

    def live(self, seeds: frozenset) -> tuple[list[int], set[int]]:
        """The nodes (positions, ascending) that the getitems ``seeds`` read, directly or not,
        and the impure ones; the placeholders they read."""
        got = self._live.get(seeds)
        if got is None:
            live: set[int] = set()
            stack = [*seeds, *self.impure]
            while stack:
                i = stack.pop()
                if i not in live:
                    live.add(i)
                    stack.extend(self.deps[i])
            used = {j for i in live for j in self.reads[i]}
            got = self._live[seeds] = (sorted(live), used)
        return got

    def pruned(
        self, seeds: frozenset
    ) -> tuple[GraphModule, dict[int, int], set[Node], list[int | None]]:
        """The template with only :meth:`live`'s nodes and placeholders, its transposed
        products folded where not read after the call (``seeds``); old position -> new
        position of every node read after the call; the nodes the folds made; per new
        position, the old one (None for a node the folds made)."""
        live, used = self.live(seeds)
        g = Graph()
        env: dict[Node, Node] = {}
        for j, p in enumerate(self.phs):
            if j in used:
                env[p] = copy_node(g, p)
        for i in live:
            env[self.nodes[i]] = copy_node(g, self.nodes[i], env.__getitem__)
        read = {env[self.nodes[i]] for i in seeds}
        folded = fold_graph(g, read.__contains__)
        made = _made(folded)
        out = [x for x in g.nodes if x.op == "call_function"]
        at = {x: k for k, x in enumerate(out)}
        index = {}
        for i in seeds:
            x = env[self.nodes[i]]
            index[i] = at[folded.get(x, x)]
        old = {env[self.nodes[i]]: i for i in live}
        g.output(tuple(out))
        return graph_module(self.t, g), index, made, [old.get(x) for x in out]


def _made(folded: dict[Node, Node]) -> set[Node]:
    """The nodes :func:`~graphflop.ad.simplify.fold_graph`'s folds made: each new product
    and the two permutes it reads."""
    return {x for mm in folded.values() for x in (mm, *mm.all_input_nodes)}
