"""The optimizer update graph and the forward-gradient step graph of a model with repeated
blocks, kept as calls of one template per block variant: the same
:class:`~graphflop.passes.calls.DerivedHierarchy` the JVP and backward graphs get, so
:func:`~graphflop.passes.calls.expand` rebuilds the flat graph and
:func:`~graphflop.passes.calls.derived_figures` composes its figures per template.

A node of these graphs belongs to a call site of the forward hierarchy
(:data:`~graphflop.meta.HIERARCHY`) in one of two ways:

- its :data:`~graphflop.meta.SOURCE` is a forward node copied from a block's template, or it
  carries the forward :data:`~graphflop.meta.CALL_SITE` (the step's copies of the JVP graph's
  nodes, as in :mod:`graphflop.passes.calls`);
- its :data:`~graphflop.meta.SOURCE` names a parameter of the block: the forward graph's
  placeholder of the parameter (the step's sampled directions and gradient estimates) or the
  update graph's (``param_<name>``: every update node of that parameter), the parameter's
  module being one of the call site's modules.

A *call* is a maximal run of consecutive nodes of one call site; it is described relative to
its site (ops, constants, output layouts, the other annotations; arguments as nodes of the run
by position or the run's values from outside; module paths relative to the block; sources by
their place in the block, a parameter's by its path in the block; parameters by their path in
the block). Runs described alike are calls of one template, so a block variant's update (its
parameters' update nodes, by their path in the block) is stored once however many blocks
share it, and so is each direction's tangent work through the block in the step graph.
Every other node stays at the top level (the AdamW ``lr·λ`` node all parameters share, the
parameters outside the blocks, the loss).

How each is built: the update graph builds each block variant's update once and copies it to
the variant's other calls, recording its calls as built (:class:`BlockParams`); the step
graph takes the JVP graph's and the update graph's calls as it copies them
(:func:`known_calls`) and reads the rest off the finished graph (:func:`build`, describing
runs as :mod:`graphflop.passes.calls` does), so two calls share a template only where their
nodes agree and the composed figures equal the flat sums (``tests/test_step_calls.py``). A step
built from a recorded JVP is recorded as it is built (:class:`StepRecorder`): there is no flat
step, its top level is the graph built (``tests/test_step_recorded.py``).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from graphflop.ad.builder import (
    NamePlan,
    base_name,
    copy_node,
    emit_named,
    fits_numbered,
    new_node,
    numbered_names,
    take_names,
)
from graphflop.frontend import outline  # noqa: F401  (defines graphflop::repeat)
from graphflop.meta import (
    CALL_SITE,
    CHECKPOINT,
    COST,
    DERIVED_HIERARCHY,
    HIERARCHY,
    MODULE,
    NODE_KEYS,
    PACKED,
    PARAM,
    SIGNATURE,
    SLOT,
    SOURCE,
    Hierarchy,
    graph_module,
)
from graphflop.passes.calls import (
    DerivedCall,
    DerivedHierarchy,
    _template,
    forget_forward_facts,
    forward_facts,
    localize_plan,
    localized,
    relative_tag,
    tags_of,
)

__all__ = ["BlockParams", "StepRecorder", "attach", "build"]

#: the annotations relativized to the call (the others must be equal at every call)
_RELATIVE = (MODULE, SOURCE, PARAM, CALL_SITE, COST, CHECKPOINT)
_COMPARED = frozenset(NODE_KEYS) - set(_RELATIVE)
_IN, _OUT = object(), object()
_SCALARS = frozenset({int, float, bool, str, type(None)})


class _Unshared(Exception):
    """A run that cannot be described relative to its call site."""


def _layout(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_layout(x) for x in v)
    return None


def _tables(forward: GraphModule, h: Hierarchy) -> tuple[dict, dict, list, dict, dict]:
    """What :class:`_Describer` reads of ``forward`` (hierarchy ``h``), worked out once per
    forward graph: the update's and the step's describers share it (read, never written, but
    for the memo of layouts):

    - per source name that belongs to one call site, ``(site, key)``: a forward node copied
      from a template (key: its template index, and the output of a ``getitem`` tracing
      added), or a parameter of the block (key: its placeholder's kind and its path in the
      block). A site where two forward nodes share a key (a rewritten graph) gets none;
    - its inverse, ``(site, key)`` to the name;
    - per call site, its modules' paths in the block by their paths in the model;
    - per parameter of a call site, ``(site, path in the block)`` (:func:`_param_sites`);
    - a memo of the values' layouts (:func:`_layout_of`).

    Worked out again where the forward's facts (:func:`~graphflop.passes.calls.forward_facts`),
    hierarchy or signature changed."""
    facts = forward_facts(forward)  # shared: copied before it is added to
    sig = forward.meta[SIGNATURE]
    got = forward.graph.__dict__.get(_TABLES)
    if got is not None and got[0] is facts and got[1] is h and got[2] is sig:
        return got[3]
    fkeys, dup, _ = facts
    keys = dict(fkeys) if not dup else {n: v for n, v in fkeys.items() if v[0] not in dup}
    sites = _param_sites(forward, h)
    for p, q, (s, rel) in sites:
        keys.setdefault(p, (s, ("forward", rel)))
        keys.setdefault(slot_name("param", q), (s, ("update", rel)))
    names = dict(zip(keys.values(), keys))  # the inverse: the last name of a key, as a loop
    rel_paths = [{a: r for r, a in site.modules} for site in h.sites]
    tables: tuple[dict, dict, list, dict, dict] = (
        keys,
        names,
        rel_paths,
        {q: at for _, q, at in sites},
        {},
    )
    forward.graph.__dict__[_TABLES] = (facts, h, sig, tables)
    return tables


def forget_tables(forward: GraphModule) -> None:
    """Drop :func:`_tables` of ``forward`` and what the describers read of it
    (:func:`~graphflop.passes.calls.forget_forward_facts`): a reader after that works them
    out again."""
    forward.graph.__dict__.pop(_TABLES, None)
    forget_forward_facts(forward)


#: the attribute of a forward graph holding :func:`_tables` with the facts, hierarchy and
#: signature it was worked out from: kept on the graph, since it names the graph's values (in a
#: table beside the graphs, weakly keyed, it was freed only by the collector's pass after the
#: one that freed the graph, and with it the analysis's fake mode)
_TABLES = "_graphflop_step_tables"


def _layout_of(memo: dict[int, tuple], v: torch.Tensor) -> tuple:
    """``(shape, stride, dtype, device)`` of tensor ``v``, memoized in ``memo`` by identity (a
    parameter's value is read by the update's variants and the step's, the calls of one
    template share their nodes' values)."""
    got = memo.get(id(v))
    if got is None or got[0] is not v:
        got = memo[id(v)] = (v, (tuple(v.shape), v.stride(), v.dtype, v.device))
    return got[1]


def _param_sites(forward: GraphModule, h: Hierarchy) -> list[tuple[str, str, tuple[int, str]]]:
    """``(placeholder, qualified name, (site, path in the block))`` per parameter of a call
    site: the site whose modules hold the parameter's owner (one site only: a module two call
    sites share keeps its parameters at the top level)."""
    owners: dict[str, list[tuple[int, str]]] = {}
    for s, site in enumerate(h.sites):
        for rel, absolute in site.modules:
            owners.setdefault(absolute, []).append((s, rel))
    out = []
    for p, q in forward.meta[SIGNATURE].params:
        owner, _, leaf = q.rpartition(".")
        found = owners.get(owner, [])
        if len(found) == 1:
            s, rel = found[0]
            out.append((p, q, (s, f"{rel}.{leaf}")))
    return out


class _Describer:
    """Describes runs of an update or step graph relative to their call sites."""

    def __init__(self, forward: GraphModule, h: Hierarchy) -> None:
        # shared with the forward's other describers (:func:`_tables`): copied before
        # :meth:`update_sources` writes to them
        self.keys, self.names, self.rel, self.params, self.layouts = _tables(forward, h)
        self._own = False
        self.h = h
        self.tags = forward_facts(forward)[2]  # shared: read only

    def tags_of(self, sources: tuple[str, ...]) -> tuple[Any, ...]:
        """:attr:`~graphflop.passes.calls.DerivedCall.tags` of a call with ``sources``."""
        return tags_of(self.tags, sources)

    def update_sources(self, update: GraphModule | Graph) -> None:
        """Key the sources of ``update``'s nodes (an update graph, or its graph: each
        parameter's nodes have its placeholder's name, which fx may have spelled otherwise
        than :func:`slot_name`)."""
        for n in (update if isinstance(update, Graph) else update.graph).nodes:
            if n.op != "placeholder":
                break
            packed = n.meta.get(PACKED)  # (a recorded update's packed placeholders)
            if packed is not None:  # one kind per pack: a gradient's or state's is not read
                if not packed[1] or packed[1][0].get(SLOT) != "param":
                    continue
                entries: Any = zip(*packed)
            elif n.meta.get(SLOT) != "param":
                continue
            else:
                entries = ((n.name, n.meta),)
            for name, meta in entries:
                at = self.params.get(meta.get(PARAM)) if meta.get(SLOT) == "param" else None
                if at is None:
                    continue
                key = (at[0], ("update", at[1]))
                if self.keys.get(name) != key or self.names.get(key) != name:
                    if not self._own:  # the shared tables: this describer's own copies
                        self.keys, self.names, self._own = dict(self.keys), dict(self.names), True
                    self.keys[name] = key
                    self.names[key] = name

    def site(self, n: Node) -> int | None:
        if n.op != "call_function":
            return None
        k = self.keys.get(n.meta.get(SOURCE, ""))
        if k is not None:
            return k[0]
        cs = n.meta.get(CALL_SITE)  # a copy of a forward node without a source
        return None if cs is None or cs[0] >= len(self.rel) else cs[0]

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
            if isinstance(a, (list, tuple)):
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
            src = m.get(SOURCE)
            k = self.keys.get(src) if src is not None else None
            r_src = ("slot", slots.setdefault(k[1], len(slots))) if k and k[0] == s else src
            r_param = None
            if PARAM in m:
                owner, _, leaf = m[PARAM].rpartition(".")
                r_param = (rel[owner], leaf) if owner in rel else ("abs", m[PARAM])
            cs = m.get(CALL_SITE)
            r_cs = ("own",) + tuple(cs[1:]) if cs is not None and cs[0] == s else cs
            others = tuple([(key, v) for key, v in m.items() if key in _COMPARED])
            rows.append(
                (
                    n.target,
                    arg(n.args),
                    arg(n.kwargs),
                    _layout(m.get("val")),
                    rel.get(module, ("abs", module)),
                    r_src,
                    r_param,
                    r_cs,
                    others,
                    relative_tag(m, bool(k and k[0] == s), self.tags),
                )
            )
        sig = (tuple(rows), len(ext))
        try:
            hash(sig)
        except TypeError:
            raise _Unshared from None
        return sig, list(ext), sorted(slots, key=slots.__getitem__)

    def template(
        self, run: list[Node], ext: list[Node], s: int, root: torch.nn.Module
    ) -> GraphModule:
        """The template of ``run`` (call site ``s``): placeholders for its values from outside
        (named by role), its nodes with their annotations relative to the block, an output
        returning every node (as :class:`~graphflop.passes.calls.DerivedHierarchy` has it). A
        parameter's path is made relative only where its owner is a module the call ran."""
        return _template(run, ext, s, self, root, relative_owner=lambda owner, rel: rel.get(owner))


def slot_name(kind: str, qual: str) -> str:
    """The update graph's placeholder name for parameter ``qual``'s input ``kind`` (``param``,
    ``grad`` or a state kind), also the :data:`~graphflop.meta.SOURCE` of the parameter's
    update nodes. An identifier whatever the parameter's name (torchvision's RegNet has ``-``
    in them); nothing looks a placeholder up by name: its SLOT and PARAM say what it holds."""
    return kind + "_" + slot_suffix(qual)


def slot_suffix(qual: str) -> str:
    """What :func:`slot_name` puts after ``<kind>_`` for parameter ``qual`` (the same for
    every kind: worked out once per parameter where its slots are named together)."""
    flat = qual.replace(".", "_")
    if flat.isascii() and (flat.isidentifier() or flat.isalnum()):  # no other character
        return flat  # ASCII letters, digits and "_": all \w already
    return re.sub(r"\W", "_", qual)


class BlockParams:
    """The parameters of a forward graph's repeated blocks, for building the update graph per
    block variant (:func:`graphflop.passes.optimizer.build_update`).

    Args:
        forward: a traced forward graph with a :data:`~graphflop.meta.HIERARCHY`.
    """

    def __init__(self, forward: GraphModule) -> None:
        self.h: Hierarchy = forward.meta[HIERARCHY]
        self.d = _Describer(forward, self.h)
        self.sites = self.d.params

    def site_of(self, qual: str) -> int | None:
        """The call site parameter ``qual`` belongs to, or None."""
        at = self.sites.get(qual)
        return at[0] if at is not None else None

    def variant(
        self, params: list[tuple[str, torch.Tensor]], idx: list[int], no_gradient: frozenset[str]
    ) -> tuple:
        """The variant of the update of ``params[i]`` for ``i`` in ``idx`` (one call site's):
        the parameters' paths in the block and layouts; a call with a parameter without
        gradient is a variant of its own (its pass-through views are built, not copied)."""
        run = [params[k] for k in idx]
        if no_gradient and not no_gradient.isdisjoint([q for q, _ in run]):
            return ("own", idx[0])
        layouts, sites = self.d.layouts, self.sites
        out = []
        for q, t in run:  # (_layout_of, in line: a parameter at a time)
            got = layouts.get(id(t))
            if got is None or got[0] is not t:
                got = layouts[id(t)] = (t, (tuple(t.shape), t.stride(), t.dtype, t.device))
            out.append((sites[q][1], *got[1]))
        return tuple(out)

    def hierarchy(self, gm: GraphModule, made: list[tuple]) -> DerivedHierarchy:
        """The hierarchy of update graph ``gm`` from its calls as built, each a run of
        consecutive nodes: ``(site, variant, nodes, parameters, copied)`` each, variants
        numbered in the order first built, ``parameters`` the placeholders of the call's
        parameters in order; ``copied`` None for the first call of its variant, which
        becomes its template, else the map of the first call's nodes to the call's that
        copied it (its values from outside and sources are the first call's, mapped)."""
        d, h = self.d, self.h
        d.update_sources(gm)
        starts = {c[2][0]: i for i, c in enumerate(made)}
        items: list[Any] = []
        templates: list[GraphModule] = []
        calls: list[DerivedCall] = []
        #: per variant, its first call's values from outside and sources (by the position of
        #: their parameter in the call, None where one is not a parameter's)
        firsts: list[tuple[list[Node], tuple[str, ...], list[int] | None]] = []
        n = next(iter(gm.graph.nodes))
        while n.op != "root":
            c = starts.get(n)
            if c is None:
                items.append(n)
                n = n.next
                continue
            s, v, run, params, copied = made[c]
            if copied is None or firsts[v][2] is None:
                ext = _outside(run)
                sources = _call_sources(d, run, s)
                if copied is None:
                    pos = {p.name: a for a, p in enumerate(params)}
                    mapped = all(x in pos for x in sources)
                    firsts.append((ext, sources, [pos[x] for x in sources] if mapped else None))
            else:
                first_ext, _, at = firsts[v]
                ext = [copied.get(x, x) for x in first_ext]
                sources = tuple(params[a].name for a in at)
            if v == len(templates):
                templates.append(d.template(run, ext, s, gm))
            calls.append(DerivedCall(s, v, h.sites[s].modules, sources, d.tags_of(sources)))
            items.append((run, ext, c))
            n = run[-1].next
        return DerivedHierarchy(
            tuple(templates), tuple(calls), _top(gm, items), tuple(c[2] for c in made)
        )

    def recorded(
        self, g: Graph, made: list[tuple], w: list[Node], root: torch.nn.Module
    ) -> tuple[tuple[GraphModule, ...], tuple[DerivedCall, ...], tuple[tuple[str, ...], ...]]:
        """The recorded update's hierarchy (``build_update(direct=True)``) from its calls as
        recorded in update graph ``g`` (finished: its output made; ``w`` its parameters'
        placeholders): ``(site, first, idx, repeat node, names taken)`` each, in graph order,
        ``first`` the variant's first call as ``optimizer._first_call`` lists it, ``idx`` the
        call's parameters, the repeat node None for a variant's first call (its nodes still
        in ``g``, built op by op). Makes each first call a call (its template made from its
        nodes, a ``graphflop::repeat`` node where its first node was, a getitem per node read
        after it, its nodes erased) and numbers the calls in order. Returns the templates,
        the calls and per call its nodes' flat names: the templates, calls and sources
        :meth:`hierarchy` gives the graph built flat."""
        d, h = self.d, self.h
        d.update_sources(g)
        templates: list[GraphModule] = []
        calls: list[DerivedCall] = []
        names: list[tuple[str, ...]] = []
        #: per variant, the positions (in the call) of the parameters its sources are
        at: list[list[int]] = []
        for number, (s, first, idx, rep, taken) in enumerate(made):
            run, v, ext = first[0], first[4], first[5]
            if rep is None:  # the variant's first call: made a call here
                sources = _call_sources(d, run, s)
                assert v == len(templates), "a variant's first call comes before its others"
                pos = {w[k].name: a for a, k in enumerate(idx)}
                at.append([pos[x] for x in sources])
                templates.append(d.template(run, ext, s, root))
                names.append(tuple([x.name for x in run]))
                _make_call(g, run, ext, number)
            else:
                sources = tuple([w[idx[a]].name for a in at[v]])
                names.append(taken)
                rep.update_arg(1, number)
            calls.append(DerivedCall(s, v, h.sites[s].modules, sources, d.tags_of(sources)))
        return tuple(templates), tuple(calls), tuple(names)


def _make_call(g: Graph, run: list[Node], ext: list[Node], number: int) -> Node:
    """Make ``run`` (consecutive nodes of ``g``, reading ``ext`` from outside) call
    ``number``: a ``graphflop::repeat`` node where its first node was, a getitem (sharing the
    node's annotations) after it per node read outside the run, in the run's order, the
    run's nodes erased. Returns the repeat node."""
    inside = set(run)
    with g.inserting_before(run[0]):
        rep = emit_named(g, torch.ops.graphflop.repeat.default, (list(ext), number), "repeat_call")
    prev = rep
    for i, n in enumerate(run):
        if not inside.issuperset(n.users):
            with g.inserting_after(prev):
                item = emit_named(g, operator.getitem, (rep, i), "repeat_item")
            object.__setattr__(item, "meta", n.meta)
            n.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
            prev = item
    for n in reversed(run):
        g.erase_node(n)
    return rep


def _call_sources(d: _Describer, run: list[Node], site: int) -> tuple[str, ...]:
    """The forward sources (``SOURCE``) of ``run``'s nodes that ``d``'s keys place in call
    site ``site``, each once, in the order first met."""
    found: dict[str, None] = {}
    for x in run:
        src = x.meta.get(SOURCE, "")
        k = d.keys.get(src)
        if k is not None and k[0] == site:
            found[src] = None
    return tuple(found)


def _outside(run: list[Node]) -> list[Node]:
    """The values ``run`` reads from outside it, in the order first read (arguments, then
    keyword arguments, node after node: :meth:`_Describer.describe`'s order)."""
    inside = set(run)
    ext: dict[Node, None] = {}
    for n in run:
        for a in n._input_nodes:  # the nodes in (args, kwargs), in the order first read
            if a not in inside:
                ext[a] = None
    return list(ext)


#: a call ``gm`` was built with: its nodes, its template (shared by identity with the calls of
#: the same template), its call site and its sources (as :class:`DerivedCall` has them)
Known = tuple[list[Node], GraphModule, int, tuple[str, ...]]


def known_calls(dh: DerivedHierarchy, env: dict[Node, Node]) -> list[Known]:
    """The calls of ``dh`` (a graph's hierarchy, with its runs) as copied into another graph
    node for node, ``env`` mapping each node of a run to its copy: the copy's calls of the same
    templates (a copy has the op, arguments' layouts and annotations of its node, and distinct
    values from outside stay distinct). Empty where ``dh`` keeps no runs."""
    if len(dh.runs) != len(dh.calls):
        return []
    return [
        ([env[n] for n in run], dh.templates[c.template], c.site, c.sources)
        for c, run in zip(dh.calls, dh.runs)
    ]


def build(
    gm: GraphModule,
    forward: GraphModule,
    known: list[Known] | None = None,
    update: GraphModule | None = None,
) -> DerivedHierarchy | None:
    """The hierarchy of ``gm``, an update graph (:func:`~graphflop.passes.optimizer.build_update_for`)
    or forward-gradient step graph
    (:func:`~graphflop.passes.forward_gradient.build_forward_gradient_step`) of ``forward``
    (see the module docstring), or None when ``forward`` has no hierarchy or ``gm`` no call.

    ``known``: calls ``gm`` was built with (:func:`known_calls`: the step's copies of the JVP
    graph's and the update graph's calls), taken as they are; only the other nodes are read
    off and described. ``update``: the update graph ``gm``'s update nodes were copied from
    (their sources are its parameters' placeholders)."""
    h: Hierarchy | None = forward.meta.get(HIERARCHY)
    if h is None:
        return None
    d = _Describer(forward, h)
    d.update_sources(update if update is not None else gm)  # gm may be an update graph
    items: list[Any] = []  # nodes of the top level, and per call (run, ext, call number)
    variants: dict[Any, int] = {}  # a description, or the id of a known template -> its index
    templates: list[GraphModule] = []
    calls: list[DerivedCall] = []
    runs: list[list[Node]] = []

    def call(run: list[Node], ext: list[Node], s: int, t: int, sources: tuple[str, ...]) -> None:
        calls.append(DerivedCall(s, t, h.sites[s].modules, sources, d.tags_of(sources)))
        runs.append(run)
        items.append((run, ext, len(calls) - 1))

    for seg in _segments(gm, d, known or []):
        if isinstance(seg, Node):
            items.append(seg)
        elif len(seg) == 3:  # a known call and its arguments
            (run, tpl, s, sources), ext, _ = seg
            t = variants.get(id(tpl))
            if t is None:
                t = variants[id(tpl)] = len(templates)
                templates.append(_copy_template(tpl))
            call(run, ext, s, t, sources)
        else:  # a run to describe
            run, s = seg
            try:
                sig, ext, order = d.describe(run, s)
            except _Unshared:
                items.extend(run)
                continue
            t = variants.get(sig)
            if t is None:
                t = variants[sig] = len(templates)
                templates.append(d.template(run, ext, s, gm))
            call(run, ext, s, t, tuple(d.names[(s, k)] for k in order))
    if not calls:
        return None
    return DerivedHierarchy(tuple(templates), tuple(calls), _top(gm, items), tuple(runs))


def _segments(gm: GraphModule, d: _Describer, known: list[Known]) -> Iterator[Any]:
    """``gm``'s nodes in order as top-level nodes, known calls ``(known, arguments, None)``
    and maximal runs of one call site ``(run, site)``."""
    starts = {k[0][0]: k for k in known if k[0]}
    paths: dict[int, Any] = {}  # per known template, where its placeholders are read
    run: list[Node] = []
    at: int | None = None
    skip: set[Node] = set()
    for n in gm.graph.nodes:
        k = starts.get(n)
        ext = _arguments(k[1], k[0], paths) if k is not None else None
        if k is not None and ext is not None:
            if run:
                yield run, at
                run, at = [], None
            yield k, ext, None
            skip.update(k[0])
            continue
        if n in skip:
            continue
        s = d.site(n)
        if run and s != at:
            yield run, at
            run = []
        if s is None:
            yield n
        else:
            run.append(n)
        at = s
    if run:
        yield run, at


def _arguments(tpl: GraphModule, run: list[Node], paths: dict[int, Any]) -> list[Node] | None:
    """The values from outside that ``run`` (a call of template ``tpl``, its nodes in the
    template's node order) passes for the template's placeholders, in their order: each read
    where the template first reads the placeholder (:func:`_placeholder_paths`, cached in
    ``paths`` per template). None where the run does not match the template."""
    where = paths.get(id(tpl))
    if where is None:
        where = paths[id(tpl)] = _placeholder_paths(tpl)
    size, ends, found = where
    if found is None or size != len(run) or any(run[i].target is not t for i, t in ends):
        return None
    ext = []
    for i, path in found:
        v: Any = (run[i].args, run[i].kwargs)
        for step in path:
            v = v[step]
        if not isinstance(v, Node):
            return None
        ext.append(v)
    return ext


def _placeholder_paths(tpl: GraphModule) -> tuple[int, list[tuple[int, Any]], Any]:
    """For template ``tpl``: its body's size; its first and last body nodes' positions and ops
    (to check a run against); per placeholder, where the template first reads it (the body
    node's position and the path to it in ``(args, kwargs)``), or None where a placeholder is
    never read."""
    phs = [x for x in tpl.graph.nodes if x.op == "placeholder"]
    body = [x for x in tpl.graph.nodes if x.op == "call_function"]
    first: dict[Node, tuple[int, tuple]] = {}

    def visit(a: Any, i: int, path: tuple) -> None:
        if isinstance(a, Node):
            if a.op == "placeholder" and a not in first:
                first[a] = (i, path)
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                visit(b, i, (*path, j))
        elif isinstance(a, dict):
            for key, b in a.items():
                visit(b, i, (*path, key))

    for i, x in enumerate(body):
        visit((x.args, x.kwargs), i, ())
        if len(first) == len(phs):
            break
    ends = [(i, body[i].target) for i in sorted({0, len(body) - 1}) if body]
    found = [first[p] for p in phs] if len(first) == len(phs) else None
    return len(body), ends, found


def _copy_template(t: GraphModule) -> GraphModule:
    """A copy of template ``t`` (its nodes' ``meta`` copied: passes write on a graph's
    templates)."""
    g = Graph()
    env: dict[Node, Node] = {}
    for n in t.graph.nodes:
        env[n] = copy_node(g, n, env.__getitem__)
    return graph_module(t, g)


def _top(gm: GraphModule, items: list[Any]) -> GraphModule:
    """The top level: the other nodes (sharing their ``meta`` with ``gm``'s) and one
    ``graphflop::repeat(arguments, call)`` node per call, with ``getitem`` for the run's nodes
    read outside it."""
    g = Graph()
    env: dict[Node, Node] = {}
    call_op = torch.ops.graphflop.repeat.default
    for x in items:
        if isinstance(x, Node):
            if x.op == "placeholder" and not x.args and not x.kwargs:  # no arguments to map
                new = new_node(g, "placeholder", x.target, x.name, (), {}, x.type)
            else:
                new = copy_node(g, x, env.__getitem__)
            env[x] = new
            object.__setattr__(new, "meta", x.meta)  # shared; no find_nodes re-filing
            continue
        run, ext, number = x
        inside = set(run)
        call = emit_named(g, call_op, ([env[v] for v in ext], number), base_name(g, call_op))
        for i, n in enumerate(run):
            if not inside.issuperset(n.users):  # read outside the run
                item = emit_named(g, operator.getitem, (call, i), "getitem")
                object.__setattr__(item, "meta", dict(n.meta))  # no find_nodes re-filing
                env[n] = item
    return graph_module(gm, g)


def attach(gm: GraphModule, forward: GraphModule) -> GraphModule:
    """Store :func:`build`'s hierarchy of ``gm`` in ``gm.meta[DERIVED_HIERARCHY]`` (when it has
    calls) and return ``gm``."""
    dh = build(gm, forward)
    if dh is not None:
        gm.meta[DERIVED_HIERARCHY] = dh
    return gm


def _numbered_plan(names: Sequence[str]) -> tuple[tuple[str, ...], tuple] | None:
    """Where every name of ``names`` is of fx's numbered form ``<base>_<digits>`` (an ASCII
    identifier whose base does not end in ``_``: :func:`~graphflop.ad.builder.take_names`
    takes such a name as it is where it is free, else the next free number of its base), the
    plan :func:`_take_planned` takes them by: per name its prefix ``<base>_``, and per base
    ``(base, prefix, positions of its names)`` in the order first met. None where a name is
    of another form."""
    read = numbered_names(names)
    if read is None:
        return None
    prefixes, at = read
    return tuple(prefixes), tuple((b, b + "_", tuple(pos)) for b, pos in at.items())


def _take_planned(g: Graph, names: Sequence[str], plan: tuple) -> tuple[str, ...]:
    """``take_names(g, names)`` for ``names`` that fit ``plan``
    (:func:`~graphflop.ad.builder.fits_numbered`), a base at a time.

    The names of one base are taken apart from the others' (a name ``<base>_<digits>`` is only
    ever renamed ``<base>_<number>``), each base's in one step where they are all free (each
    taken as it is; the base's count the number of its last) or all taken with the next ones
    free (numbered on from the base's count), one by one otherwise, as taking the names in
    order would take them; all of them one by one where two are alike."""
    ns = g._graph_namespace
    used, count = ns._used_names, ns._base_count
    if used.isdisjoint(names):  # all free: the calls of a block's derivative after the first
        before = len(used)
        used.update(names)
        if len(used) - before == len(names):
            for base, prefix, pos in plan[1]:
                count[base] = int(names[pos[-1]][len(prefix) :])
            return tuple(names)
        used.difference_update(names)  # a name twice: the second is renamed
        return tuple(take_names(g, names))
    if len(set(names)) != len(names):
        return tuple(take_names(g, names))
    out = list(names)
    for base, prefix, pos in plan[1]:
        mine = [names[i] for i in pos]
        if used.isdisjoint(mine):  # taken as they are
            used.update(mine)
            count[base] = int(mine[-1][len(prefix) :])
            continue
        if used.issuperset(mine):  # renamed: the base's next numbers, where they are free
            c = count.get(base, 0)
            new = [f"{prefix}{c + j}" for j in range(1, len(mine) + 1)]
            if used.isdisjoint(new):
                used.update(new)
                count[base] = c + len(mine)
                for i, x in zip(pos, new):
                    out[i] = x
                continue
        for i, x in zip(pos, take_names(g, mine)):
            out[i] = x
    return tuple(out)


class StepRecorder:
    """Records a forward-gradient step's calls while the step is built from a recorded JVP
    (:func:`~graphflop.passes.calls.is_recorded`) and an update graph with its calls, so that
    the flat step is never made: the step's top level is the graph built, and
    :func:`~graphflop.passes.calls.flat_view` rebuilds the flat step from it, node for node
    and name for name the one built from the flat JVP (``tests/test_step_recorded.py``).

    The builder hands it each call it copies (:meth:`call`: a JVP call, with the flat names
    the JVP keeps for it; an update call, with its nodes' names): it emits the call's
    ``graphflop::repeat`` node and takes in the graph being built the names the flat copy's
    nodes would have taken, in their order, so every later node is named as in the flat step.
    The sampled directions and the estimates, built op by op, are made calls afterwards
    (:meth:`describe`: each maximal run of one call site, described as :func:`build` describes
    it). :meth:`hierarchy` numbers the calls in graph order.

    Args:
        forward: the traced forward graph, with :data:`~graphflop.meta.HIERARCHY`.
        update: the update graph the step copies (its parameters' placeholders are the
            sources of its update nodes).
    """

    def __init__(self, forward: GraphModule, update: GraphModule) -> None:
        self.h: Hierarchy = forward.meta[HIERARCHY]
        self.d = _Describer(forward, self.h)
        self.d.update_sources(update)
        self.templates: list[GraphModule] = []
        self.calls: list[DerivedCall] = []
        self.names: dict[Node, tuple[str, ...]] = {}
        self._copied: dict[int, int] = {}  # id of a template copied -> its index
        self._variants: dict[tuple, int] = {}  # a run's description -> its template's index
        self._root = torch.nn.Module()
        self.call_op = torch.ops.graphflop.repeat.default
        #: :meth:`per_parameter`'s variants: what each one's first run made
        self._per_param: dict[tuple, tuple] = {}
        #: per template, the plan taking its calls' names (:func:`_numbered_plan`)
        self._plans: dict[int, tuple] = {}
        #: per :meth:`per_parameter` variant (the id of what its first run made, kept in
        #: ``_per_param``), its template's nodes' annotations at the values' positions, each
        #: with its :func:`~graphflop.passes.calls.localize_plan`
        self._exposed: dict[int, list[tuple[dict, tuple]]] = {}
        #: :meth:`_runs`'s plans, per list of parameters' names
        self._run_plans: dict[tuple[str, ...], list[tuple]] = {}

    def call(
        self, g: Graph, template: GraphModule, c: DerivedCall, args: list[Node], names: Any
    ) -> Node:
        """Emit at the end of ``g`` a call of ``template`` (another graph's template, copied
        once) standing for call ``c`` of that graph, on ``args``; ``names``: the names of the
        call's nodes in the flat graph copied (its template's node order), taken in ``g`` as
        copying them would take them. Returns the ``graphflop::repeat`` node."""
        t = self._copied.get(id(template))
        if t is None:
            t = self._copied[id(template)] = len(self.templates)
            self.templates.append(_copy_template(template))
        taken = self._take(g, names, t)
        rep = emit_named(g, self.call_op, (list(args), len(self.calls)), "repeat_call")
        self.calls.append(DerivedCall(c.site, t, c.modules, c.sources, c.tags))
        self.names[rep] = taken
        return rep

    def _take(self, g: Graph, names: Sequence[str], t: int) -> tuple[str, ...]:
        """``take_names(g, names)`` for the names of a call of template ``t``: where each is
        of fx's numbered form (the calls of a block's derivative after the first few), a base
        at a time by a plan worked out once per template (:func:`_take_planned`)."""
        plan = self._plans.get(t)
        if plan is None or not fits_numbered(names, plan[0]):
            plan = _numbered_plan(names)
            if plan is None:  # a name of another form (a block's first calls: ``mm_default``)
                return tuple(take_names(g, names))
            self._plans[t] = plan
        return _take_planned(g, names, plan)

    def item(self, g: Graph, rep: Node, i: int, meta: dict) -> Node:
        """A getitem of call ``rep``'s node ``i`` at the end of ``g``, with ``meta``."""
        item = emit_named(g, operator.getitem, (rep, i), "repeat_item")
        object.__setattr__(item, "meta", meta)
        return item

    def describe(self, g: Graph, nodes: list[Node]) -> None:
        """Make each maximal run of one call site of ``nodes`` (consecutive nodes of ``g``,
        built op by op) a call of the template its description gives (a run that cannot be
        described stays as it is): its repeat node where its first node was, a getitem per
        node read outside it."""
        run: list[Node] = []
        at: int | None = None
        for n in [*nodes, None]:
            s = self.d.site(n) if n is not None else None
            if run and s != at:
                assert at is not None
                self._make_call(g, run, at)
                run = []
            if s is not None and n is not None:
                run.append(n)
            at = s

    def _make_call(
        self, g: Graph, run: list[Node], s: int, exposed: frozenset[int] = frozenset()
    ) -> tuple[int, list[tuple], list[Node], dict[int, Node]] | None:
        """Make ``run`` (call site ``s``) a call: ``(its template's index, its source slots'
        keys, its values from outside, its getitems by position)``, a getitem for each node
        read outside the run and each position in ``exposed``; None (the run left as it is)
        where it cannot be described."""
        try:
            sig, ext, order = self.d.describe(run, s)
        except _Unshared:
            return None
        t = self._variants.get(sig)
        if t is None:
            t = self._variants[sig] = len(self.templates)
            self.templates.append(self.d.template(run, ext, s, self._root))
        sources = tuple(self.d.names[(s, k)] for k in order)
        self.calls.append(
            DerivedCall(s, t, self.h.sites[s].modules, sources, self.d.tags_of(sources))
        )
        with g.inserting_before(run[0]):
            rep = emit_named(g, self.call_op, (list(ext), len(self.calls) - 1), "repeat_call")
        self.names[rep] = tuple(n.name for n in run)
        inside = set(run)
        prev = rep
        items: dict[int, Node] = {}
        for i, n in enumerate(run):
            if i in exposed or not inside.issuperset(n.users):
                with g.inserting_after(prev):
                    item = emit_named(g, operator.getitem, (rep, i), "repeat_item")
                object.__setattr__(item, "meta", n.meta)
                n.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
                items[i] = prev = item
        for n in reversed(run):
            g.erase_node(n)
        return t, order, ext, items

    def per_parameter(
        self,
        g: Graph,
        params: list[tuple[str, torch.Tensor]],
        kind: Hashable,
        build: Callable[[str], Node],
        reads: Callable[[list[str]], list[Node]],
    ) -> dict[str, Node]:
        """Per parameter (``(placeholder name, value)`` pairs, in order), the node ``build(p)``
        makes for it at the end of ``g`` (with the nodes it needs), each run of one call site's
        parameters a call as :meth:`describe` would make it: built node by node at the first
        run of each variant (``kind`` and the parameters' paths in the block and layouts) and
        made a call at once; at the variant's other runs, the call emitted without building
        (its nodes' names taken in ``g`` as building would take them), reading ``reads(run)``
        where the first run read ``reads(first run)`` (the nodes from outside each run's work
        reads, in one order). Returns the values: a call's getitems, or the nodes built where
        a run cannot be a call. The graph is the one building every run and then
        :meth:`describe` give, but for getitems of values nothing reads (drop them)."""
        out: dict[str, Node] = {}
        layouts = self.d.layouts
        for s, group, rels, values in self._runs(params):
            if s is None:
                out[group[0]] = build(group[0])
                continue
            lay = []  # (_layout_of, in line: a parameter at a time, the step's hottest loop)
            for v in values:
                got = layouts.get(id(v))
                if got is None or got[0] is not v:
                    got = layouts[id(v)] = (v, (tuple(v.shape), v.stride(), v.dtype, v.device))
                lay.append(got[1])
            key = (kind, rels, tuple(lay))
            known = self._per_param.get(key)
            if known is not None and self._emit(g, s, known, group, reads(group), out):
                continue
            mark = next(iter(reversed(g.nodes)))
            made_values = [build(p) for p in group]
            run = nodes_after(mark)
            if known is None:
                pos = {n: x for x, n in enumerate(run)}
                exposed = [pos[v] for v in made_values]
                # the names a call of the variant takes, a base at a time (one plan per
                # variant: a name at a time cost about a tenth of the step's time per block)
                candidates = NamePlan([base_name(g, n.target) for n in run])
                first_reads = reads(group)
                made = self._make_call(g, run, s, frozenset(exposed))
                if made is not None:
                    t, order, ext, items = made
                    at = {x: a for a, x in enumerate(first_reads)}  # (the last, as dict(zip))
                    ext_at = [at.get(x) for x in ext]  # per value from outside, its read's
                    where = None if None in ext_at else ext_at
                    self._per_param[key] = (t, order, where, exposed, candidates)
                    made_values = [items[x] for x in exposed]
            out.update(zip(group, made_values))
        return out

    def _runs(
        self, params: list[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[int | None, list[str], tuple | None, list[torch.Tensor]]]:
        """:meth:`per_parameter`'s runs of ``params``: per run its call site (None: one
        parameter outside the blocks), its parameters, their keys in the block and their
        values. The runs of a list of parameters are worked out once (the directions and the
        estimates run over the same parameters): per run its bounds, site, names and keys."""
        names = tuple([p for p, _ in params])
        plan = self._run_plans.get(names)
        if plan is None:
            plan = self._run_plans[names] = self._plan_runs(names)
        for i, j, s, group, rels in plan:
            yield s, group, rels, [v for _, v in params[i:j]]

    def _plan_runs(self, names: tuple[str, ...]) -> list[tuple]:
        """The runs of parameters ``names``: per run ``(start, end, site, names, keys in the
        block)``, consecutive parameters of one call site each (:meth:`per_parameter`)."""
        keys = self.d.keys
        plan = []
        i = 0
        while i < len(names):
            k = keys.get(names[i])
            s = k[0] if k is not None else None
            j = i + 1
            while s is not None and j < len(names) and self._site_of(names[j]) == s:
                j += 1
            group = list(names[i:j])
            rels = tuple([keys[p][1] for p in group]) if s is not None else None
            plan.append((i, j, s, group, rels))
            i = j
        return plan

    def _site_of(self, p: str) -> int | None:
        k = self.d.keys.get(p)
        return k[0] if k is not None else None

    def _emit(
        self, g: Graph, s: int, known: tuple, group: list[str], reads: list[Node], out: dict
    ) -> bool:
        """Call ``known`` (a variant's first run: template, source slots, per value from
        outside its position in what the first run read (None: a value from outside that
        is not one of its reads), values' positions, the
        :class:`~graphflop.ad.builder.NamePlan` of its names) emitted for ``group`` at call
        site ``s``, reading ``reads`` (in the first run's order); False, with nothing
        emitted, where a value from outside is not one of the first run's reads."""
        t, order, where, exposed, candidates = known
        if where is None:
            return False
        names = self.d.names
        sources = tuple([names[(s, k)] for k in order])
        c = DerivedCall(s, t, self.h.sites[s].modules, sources, self.d.tags_of(sources))
        self.calls.append(c)
        taken = tuple(candidates.take(g))
        rep = emit_named(
            g, self.call_op, ([reads[a] for a in where], len(self.calls) - 1), "repeat_call"
        )
        self.names[rep] = taken
        metas = self._exposed.get(id(known))
        if metas is None:  # the template's nodes' annotations at the values' positions
            body = [x for x in self.templates[t].graph.nodes if x.op != "placeholder"]
            metas = self._exposed[id(known)] = [
                (body[x].meta, localize_plan(body[x].meta)) for x in exposed
            ]
        absolute = dict(c.modules)
        item = self.item
        for p, x, (tm, plan) in zip(group, exposed, metas):
            out[p] = item(g, rep, x, localized(tm, plan, c, absolute))
        return True

    def hierarchy(self, gm: GraphModule) -> DerivedHierarchy | None:
        """The recorded hierarchy of step ``gm`` (its graph the one built), its calls
        numbered in graph order; None without calls."""
        calls: list[DerivedCall] = []
        names: list[tuple[str, ...]] = []
        for n in gm.graph.nodes:
            if n.target is self.call_op and n.op == "call_function":
                calls.append(self.calls[n.args[1]])
                names.append(self.names[n])
                n.update_arg(1, len(calls) - 1)
        if not calls:
            return None
        return DerivedHierarchy(tuple(self.templates), tuple(calls), gm, names=tuple(names))


def nodes_after(last: Node) -> list[Node]:
    """The nodes after ``last`` in its graph (what a builder made since)."""
    out = []
    n = last.next
    while n.op != "root":
        out.append(n)
        n = n.next
    return out
