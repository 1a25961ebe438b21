"""The eager memory schedules read off recorded derivative hierarchies (``direct=True``:
:func:`~graphflop.passes.calls.is_recorded`) without their flat views: the JVP's
(:func:`recorded_jvp_schedule`) and the train step's with the storages saved for backward
(:func:`recorded_train_schedule`). The top level's nodes are the steps, each
``graphflop::repeat`` node one call item of a
:class:`~graphflop.passes.memory_calls.ComposedSchedule` whose profile is its template's, the
call's arguments its values from outside, the top level's ``getitem``\\ s of it the values read
after it. The same bytes as :func:`~graphflop.passes.eager_memory.eager_jvp_schedule`,
:func:`~graphflop.passes.eager_memory.eager_train_schedule` and
:func:`~graphflop.passes.eager_memory.eager_saved_storages` on the flat views, to the byte
(``tests/test_recorded_memory.py``).

The eager model's per-node overrides are worked out on a copy of the template made per
*context* of its calls, not per call. In the JVP
(:func:`~graphflop.passes.eager_memory.jvp_overrides`: composite ops as one kernel, tangent
formulas, kernel temporaries; the dual pairs a value and its tangent are freed together by)
the context is: which of its nodes are read after the call (a tangent read outside its rule is
held with its primal), the layouts and kinds of its arguments, the tangents held with its
arguments, which of its nodes the flat graph names after one of the call's forward sources.
The eager passes pair a node with its tangents by name (the flat JVP names its copy of a
forward node after it; fx's counter may give a ``getitem`` such a name too): in the copy the
sources ``@k`` are renamed and the nodes the flat graph names after source ``k`` take that
name, so the passes run on it as they run on the flat graph. A dual pair's tie on storages
nothing outside the call reads is folded into the profile (:func:`_fold_ties`); the others
are left to the schedule, in the flat graph's order. In the backward
(:func:`~graphflop.passes.eager_kernels.one_kernel_backward`, convolutions' temporaries,
scatters in place, the gradients it returns) the context is: which nodes are read after the
call, which are the graph's outputs, and per forward source slot its one-kernel backward (as
a partition of the slots), that kernel's temporaries and a convolution's, and whether it is a
plain op (its rule's last node holds what the rule reads:
:func:`~graphflop.passes.eager_kernels.autograd_node_reads`). The top level's
overrides are worked out on a copy of it with each call's value a top-level node reads a
placeholder (:func:`_top_copy`).

Where a call could differ from what its context's copy says, no schedule is made (None, and
the caller schedules the flat view): JVP nodes without a flat name, two calls of one call
site, a template node whose forward source is not the call's, a top-level node sharing a name
(JVP) or source with a call's nodes, a call's source naming a node outside that call (fx's
counter names a ``getitem`` of one call after a forward ``getitem`` of another, GPT-2's
``var_mean``'s) where the eager passes would find nodes by that name
(:meth:`_Builder.check_foreign`), a composite op whose region (or one-kernel backward) reaches across a call's boundary,
a scatter into zeros made in another part of the graph. Reads what the eager schedules read,
and :data:`~graphflop.meta.DERIVED_HIERARCHY`; writes nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from itertools import compress, count, repeat
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from graphflop.ad.builder import copy_node
from graphflop.frontend.composite import FUSED_SDPA
from graphflop.meta import (
    COMPOSITE,
    DERIVED_HIERARCHY,
    KIND,
    RESIDUAL,
    ROLE,
    SIGNATURE,
    SOURCE,
    graph_module,
)
from graphflop.passes.calls import DerivedHierarchy, is_recorded
from graphflop.passes.eager_kernels import (
    TANGENT_FORMULA,
    autograd_node_reads,
    merge_reads,
    one_kernel_backward,
)
from graphflop.passes.eager_memory import (
    _FRESH,
    _SCATTERS,
    ConvBackward,
    _replayed_draws,
    conv_backward,
    conv_backward_temporaries,
    dual_pairs,
    eager_forward,
    embedding_indices,
    forward_kernels,
    graded_sizes,
    jvp_baseline,
    jvp_overrides,
    kernel_temporaries,
    matmul_operand_copy_bytes,
    not_saved,
    optimizer_temporaries,
    plain_ops,
    residual_keys,
    scatters_in_place,
    ungraded_nodes,
)
from graphflop.passes.flops import tensor_bytes
from graphflop.passes.memory import Step, _NodeSteps
from graphflop.passes.memory_calls import (
    ComposedSchedule,
    _analysis,
    _Call,
    _Profile,
    _profile,
    forward_runs,
)

__all__ = ["recorded_jvp_schedule", "recorded_train_schedule"]

aten = torch.ops.aten

_REPEAT = torch.ops.graphflop.repeat.default
#: the name a template's copy gives its copy of forward source slot k (fx never makes it)
_SLOT = "gfslot_{}"


class _Unsupported(Exception):
    """A recorded hierarchy whose calls the copies of their templates may not stand for."""


@dataclass(frozen=True)
class _Named:
    """A call's node as the schedule names it (its name in the flat graph)."""

    name: str


class _Run:
    """A call's nodes by position in its template, as :class:`_Named` (for the keys
    :meth:`ComposedSchedule.peak` and ``owner`` report)."""

    def __init__(self, names: tuple[str | None, ...]) -> None:
        self.names = names

    def __getitem__(self, i: int) -> _Named:
        return _Named(self.names[i] or "")


@dataclass
class _Context:
    """A template's copy for one context of its calls, with the eager overrides on it.

    Attributes:
        gm: the copy: placeholders for the call's arguments, then for the tangents of its
            arguments held with them (``held``), the template's nodes, an output returning the
            nodes read after the call.
        nodes: the copy's nodes in template order (position ``i`` is the template's node ``i``).
        steps: :class:`_NodeSteps` of the copy with the overrides.
        ties: per dual pair of the copy, the positions of the primal and its tangents.
        pairs: per source slot, the positions of the tangents read outside their rule.
    """

    gm: GraphModule
    nodes: list[Node]
    steps: _NodeSteps
    ties: list[list[int]]
    pairs: dict[int, list[int]]
    #: the copy's placeholders -> their positions (a call's values from outside, in order)
    ext: dict[Node, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.ext = {p: j for j, p in enumerate(phs)}


@dataclass
class _Template:
    """What is fixed per template: its placeholders, its nodes by position, their source
    slots, the composite regions of each placeholder's readers."""

    gm: GraphModule
    placeholders: list[Node]
    nodes: list[Node]
    slot: list[int]  # per position, its source slot
    regions: list[set[int]]  # per placeholder, the composite regions of its readers
    scattered: list[int]  # the placeholders a scatter of the template writes into


def recorded_jvp_schedule(top: GraphModule, device: str = "cpu") -> ComposedSchedule | None:
    """The eager JVP schedule (:func:`~graphflop.passes.eager_memory.eager_jvp_schedule`) of
    the recorded JVP top level ``top`` composed per call, without its flat view; None where
    ``top`` is not a recorded top level or a call could differ from its template's copy (see
    the module docstring)."""
    if not is_recorded(top):
        return None
    try:
        return _Builder(top, device).build()
    except _Unsupported:
        return None


def _region_ids(n: Any) -> set[int]:
    """The composite regions node ``n`` belongs to (its own and an inner op's)."""
    tag = n.meta.get(COMPOSITE) if isinstance(n, Node) else None
    if tag is None:
        return set()
    out = {tag.region}
    if tag.inner is not None:
        out.add(tag.inner.region)
    return out


def _template_of(dh: DerivedHierarchy, cache: dict[int, _Template], number: int) -> _Template:
    """The :class:`_Template` of call ``number``'s template (made once, kept in ``cache``).

    Raises:
        _Unsupported: a template node's forward source is not one of the call's (``@k``):
            another node, elsewhere, may share it.
    """
    c = dh.calls[number]
    got = cache.get(c.template)
    if got is not None:
        return got
    gm = dh.templates[c.template]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    slot: list[int] = []
    for n in nodes:
        src = n.meta.get(SOURCE)
        if not isinstance(src, str) or src[:1] != "@":
            raise _Unsupported
        slot.append(int(src[1:]))
    pos = {n: i for i, n in enumerate(phs)}
    regions: list[set[int]] = [set() for _ in phs]
    for n in nodes:
        for a in n.all_input_nodes:
            if a in pos:
                regions[pos[a]] |= _region_ids(n)
    scattered = [
        j
        for j, p in enumerate(phs)
        if any(r.target in _SCATTERS and r.args[0] is p for r in p.users)
    ]
    got = cache[c.template] = _Template(gm, phs, nodes, slot, regions, scattered)
    return got


def _call_value(n: Node) -> tuple[int, int] | None:
    """(call number, position) of a top-level ``getitem`` of a call, else None."""
    if n.op != "call_function" or n.target is not operator.getitem:
        return None
    rep, i = n.args
    if not isinstance(rep, Node) or rep.target is not _REPEAT:
        return None
    number = rep.args[1]
    assert isinstance(number, int) and isinstance(i, int)
    return number, i


def _call_values(top: GraphModule) -> dict[Node, tuple[int, int]]:
    """:func:`_call_value` of each of ``top``'s nodes that is a call's value (one walk, so
    the builders' several walks of the top level look each node up)."""
    out = {}
    for n in top.graph.nodes:
        if n.target is operator.getitem and (at := _call_value(n)) is not None:
            out[n] = at
    return out


def _top_copy(
    top: GraphModule,
    name: Callable[[tuple[int, int]], str],
    values: dict[Node, tuple[int, int]] | None = None,
    output_values: bool = True,
) -> tuple[GraphModule, dict[str, tuple[int, int]]]:
    """A recorded top level as the eager passes read a graph: each call's value that a
    top-level node reads a placeholder (named ``name((call number, position))``, with the
    value's ``val`` and kind), the values the calls read among its outputs (a value a call reads
    is read outside its rule), the placeholders only calls read left out; and those
    placeholders' names -> (call number, position).

    ``values``: :func:`_call_values` of ``top``, where worked out already. ``output_values``
    False: a call's value only calls and the output read is left out too (the train step's
    gradients: the backward's overrides, :func:`scatters_in_place`,
    :func:`one_kernel_backward` and :func:`kernel_temporaries`, read no such value: they
    look at the ``call_function`` nodes, their arguments and their users).

    Raises:
        _Unsupported: a name taken (the copy's names are the top level's).
    """
    call_value = (values if values is not None else _call_values(top)).get
    g = Graph()
    env: dict[Node, Node] = {}
    read_by_calls: dict[Node, None] = {}
    names: dict[str, tuple[int, int]] = {}
    output: Node | None = None
    calls = set(top.graph.find_nodes(op="call_function", target=_REPEAT))
    calls_and_output = calls | set(top.graph.find_nodes(op="output"))
    for n in top.graph.nodes:
        if n in calls:
            read_by_calls.update(dict.fromkeys(n._input_nodes))
            continue
        at = call_value(n)
        if (at is not None or n.op == "placeholder") and calls.issuperset(n.users):
            continue  # read by calls only (or by nothing)
        if at is not None and not output_values and calls_and_output.issuperset(n.users):
            continue  # read by calls and the output only
        if at is not None:
            p = env[n] = g.placeholder(name(at))
            # filled in place: assigning it re-files the node in fx's find_nodes table
            p.meta.clear()
            p.meta.update({k: n.meta[k] for k in ("val", KIND) if k in n.meta})
            names[p.name] = at
        elif n.op == "output":
            output = n
            continue
        else:
            env[n] = copy_node(g, n, env.__getitem__)
        if env[n].name != (n.name if at is None else name(at)):
            raise _Unsupported
    assert output is not None
    outs = dict.fromkeys(output.all_input_nodes) | read_by_calls
    g.output(tuple(env[a] for a in outs if a in env))
    return graph_module(top, g), names


#: a value the schedule holds with another: ``("top", node name)`` or ``("call", call
#: number, position)``
_Ref = tuple


class _Builder:
    def __init__(self, top: GraphModule, device: str) -> None:
        dh: DerivedHierarchy = top.meta[DERIVED_HIERARCHY]
        if dh.names is None or len(dh.names) != len(dh.calls):
            raise _Unsupported
        if len({c.site for c in dh.calls}) != len(dh.calls):
            raise _Unsupported  # a call site in two runs: its sources' nodes in two calls
        self.top, self.dh, self.device = top, dh, device
        self.at = _call_values(top)  # the calls' values: node -> (call number, position)
        self.names: tuple[tuple[str, ...], ...] = dh.names  # type: ignore[assignment]
        self.sources: set[str] = set().union(*(c.sources for c in dh.calls))
        #: the calls' nodes' names in the flat graph -> their call number, their position
        #: (two tables filled by C-level updates: no pair made per node)
        self.where_call: dict[str | None, int] = {}
        self.where_pos: dict[str | None, int] = {}
        for number, names in enumerate(dh.names):
            self.where_call.update(zip(names, repeat(number)))
            self.where_pos.update(zip(names, count()))
        if None in self.where_pos:
            raise _Unsupported  # nodes a fold made: named only in the flat graph
        #: per (template, the calls' positions named after each source slot): :meth:`named`
        #: and its inverse, shared by the calls of that pattern (read only)
        self.named_at: dict[tuple, tuple[dict[int, int], dict[int, int], int]] = {}
        self.named_keys: dict[tuple, int] = {}
        #: per context key: the positions named after a slot with tangents, those tangents
        self.paired: dict[Hashable, list[tuple[int, list[int]]]] = {}
        self.templates: dict[int, _Template] = {}
        self.contexts: dict[Hashable, _Context] = {}
        self.s = ComposedSchedule()
        # the calls' keys (``j:NAME``, NAME its node's name in the flat graph) located as
        # ComposedSchedule._locate looks a run's node up: by_name, then index
        self.by_name: dict[str, str] = {}
        self.index: dict[str, tuple[int, int]] = {}
        self.numbers: list[int] = []  # per call, its item number
        self.s._graphs["j"] = (self.index, self.by_name, self.numbers)  # type: ignore[assignment]
        self.keys: dict[Any, list[str]] = {}
        self.top_nodes = {n.name: n for n in top.graph.nodes}
        self.top_at = {n.name: i for i, n in enumerate(top.graph.nodes)}
        #: (where the pair's first tangent is in the flat graph's order, the tie's keys)
        self.tie_rows: list[tuple[tuple[int, int], list[str]]] = []
        #: per call, the positions of its nodes something outside it reads; per profile,
        #: the context's ties not folded into it (:func:`_fold_ties`), in order
        self.referenced: dict[int, set[int]] = {}
        self.unfolded: dict[Hashable, list[list[int]]] = {}
        #: per call number: its context, its key, its positions named after a source slot
        self.call_ctx: list[_Context] = []
        self.ckeys: list[Hashable] = []
        self.context_ids: dict[tuple, int] = {}  # context key -> its number
        self.slot_at: list[dict[int, int]] = []
        #: the calls' nodes the top level's overrides name -> (call number, position)
        self.call_names: dict[str, tuple[int, int]] = {}
        #: (call number, position) of a node named after (call number, source slot)'s source
        self.foreign: list[tuple[int, int, int, int]] = []

    # -- checks and the templates ---------------------------------------------------------
    def template(self, number: int) -> _Template:
        return _template_of(self.dh, self.templates, number)

    def named(self, number: int) -> tuple[dict[int, int], dict[int, int], int]:
        """Call ``number``'s nodes named after one of its forward sources in the flat graph
        (its copies of forward nodes, and any other node fx's counter gave such a name):
        source slot -> position, its inverse, and a number per distinct table (for the context
        keys). A source naming a node of another call is noted (:meth:`check_foreign`). The
        positions and calls are looked up by C-level maps over the sources, the tables made
        once per template and pattern of positions (shared: read only), not per source."""
        c = self.dh.calls[number]
        pos = tuple(map(self.where_pos.get, c.sources))
        calls = list(map(self.where_call.get, c.sources))
        own = tuple(map(operator.eq, calls, repeat(number)))
        if own.count(True) + calls.count(None) != len(calls):  # a source naming another
            # call's node: noted (found by C-level maps, not a test per source)
            foreign = map(
                operator.and_, map(operator.is_not, calls, repeat(None)), map(operator.not_, own)
            )
            for k in compress(count(), foreign):
                self.foreign.append((calls[k], pos[k], number, k))  # type: ignore[arg-type]
        got = self.named_at.get((c.template, pos, own))
        if got is None:
            out = {k: i for k, (i, mine) in enumerate(zip(pos, own)) if i is not None and mine}
            # (equal tables, one number: a source naming another call's node varies its
            # position, not the table)
            number_of = self.named_keys.setdefault(tuple(out.items()), len(self.named_keys))
            got = (out, {i: k for k, i in out.items()}, number_of)
            self.named_at[c.template, pos, own] = got
        return got

    def check_foreign(self) -> None:
        """A node of one call that fx's counter named after a forward source of another
        call (a ``getitem``): the eager passes, which find a node's tangents by its name, find
        that source's nodes. Supported where they find nothing they would change: the source
        has no tangent or coefficient node (so no dual pair, no formula's node a composite
        op's tangent would hold nothing of) and the node is not in fused attention (whose
        inner nodes of any kind hold nothing)."""
        formulas: dict[tuple[int, int], bool] = {}  # (template, slot) -> has a formula node
        for number, i, other, k in self.foreign:
            t, t2 = self.template(number), self.template(other)
            tk = (self.dh.calls[other].template, k)
            has = formulas.get(tk)
            if has is None:
                kinds = {n.meta.get(KIND) for n, slot in zip(t2.nodes, t2.slot) if slot == k}
                has = formulas[tk] = bool(kinds & set(TANGENT_FORMULA))
            if has or self.call_ctx[other].pairs.get(k):
                raise _Unsupported
            tag = t.nodes[i].meta.get(COMPOSITE)
            if tag is not None and tag.op == FUSED_SDPA:
                raise _Unsupported

    def check_top(self) -> None:
        """No top-level node shares a name or source with a call's nodes' names or sources,
        and no composite op's region reaches from the top level into a call."""
        for n in self.top.graph.nodes:
            if n.target is _REPEAT or self.at.get(n) is not None:
                continue
            src = n.meta.get(SOURCE)
            for x in (src, n.name):
                if x in self.sources or x in self.where_pos:
                    raise _Unsupported
            ids = _region_ids(n)
            if not ids:
                continue
            for a in n.all_input_nodes:
                if ids & _region_ids(a) and self.at.get(a) is not None:
                    raise _Unsupported  # one composite op's region across a boundary

    # -- keys ----------------------------------------------------------------------------
    def call_key(self, number: int, i: int) -> list[str]:
        """The keys of call ``number``'s node ``i`` (none where its profile has no step)."""
        item = self.s.items[self.numbers[number]]
        assert isinstance(item, _Call)
        if not item.profile.keyed[i]:
            return []
        name = self.names[number][i]
        if name not in self.index:
            self.by_name[name] = name
            self.index[name] = (number, i)
        return [f"j:{name}"]

    def value_pairs(self, v: Node, top_pairs: dict[str, list[str]]) -> list[_Ref]:
        """The tangents held with value ``v`` (a top-level node or a call's value)."""
        # (none, for most arguments: returned without a comprehension's frame)
        at = self.at.get(v)
        if at is None:
            ms = top_pairs.get(v.name)
            return [("top", m) for m in ms] if ms else []
        number, i = at
        k = self.slot_at[number].get(i)
        if k is None:
            return []  # not named after a forward source: no pairs
        qs = self.call_ctx[number].pairs.get(k)
        return [("call", number, q) for q in qs] if qs else []

    def ref_keys(self, ref: _Ref) -> list[str]:
        if ref[0] == "call":
            return self.call_key(ref[1], ref[2])
        return self.keys.get(self.top_nodes[ref[1]], [])

    # -- the build ------------------------------------------------------------------------
    def build(self) -> ComposedSchedule:
        self.check_top()
        read_after: dict[int, set[int]] = {}
        reps: list[Node] = []
        for n in self.top.graph.nodes:
            if n.target is _REPEAT:
                reps.append(n)
            elif (at := self.at.get(n)) is not None and n.users:
                read_after.setdefault(at[0], set()).add(at[1])
        top_gm = self.top_copy()
        top_pairs = dual_pairs(top_gm)
        top_ties = [[p, *ts] for p, ts in top_pairs.items() if p in self.top_nodes]
        for group in top_ties:
            self.tie_rows.append(((self.top_at[group[1]], 0), [f"j:{x}" for x in group]))
        # each call's context, in order (a call's arguments' tangents are earlier calls')
        held: list[list[list[_Ref]]] = []
        for number, rep in enumerate(reps):
            if rep.args[1] != number:
                raise _Unsupported
            after = sorted(read_after.get(number, ()))
            held.append(self.add_context(rep, number, after, top_pairs))
        self.check_foreign()
        self.walk(top_gm, top_pairs, held, read_after)
        # the ties in the flat graph's order (of each pair's first tangent), as dual_pairs
        # makes them: ties sharing a storage are applied one after the other
        self.tie_rows.sort(key=lambda row: row[0])
        self.s.ties.extend(keys for _, keys in self.tie_rows)
        return self.s

    def walk(
        self,
        top_gm: GraphModule,
        top_pairs: dict[str, list[str]],
        held: list[list[list[_Ref]]],
        read_after: dict[int, set[int]],
    ) -> None:
        """The top level's steps, with the overrides worked out on its copy ``top_gm``, and
        each call as one item."""
        sizes, extra, reads = jvp_overrides(top_gm, self.device, top_pairs)
        nodes = _NodeSteps(self.top, True, sizes, extra, reads, None, False)
        # the calls' nodes the overrides name: stand-ins whose keys are the calls' keys
        stand_ins: dict[str, Any] = {}
        by_call: dict[int, list[_Ref]] = {}
        for m in {m for names in reads.values() for m in names} - self.top_nodes.keys():
            at = self.call_names.get(m)
            if at is None:
                raise _Unsupported
            stand_ins[m] = ("call", *at)
            by_call.setdefault(at[0], []).append(stand_ins[m])
        nodes.by_name = {**nodes.by_name, **stand_ins}
        self.note_referenced(read_after, held, stand_ins.values())
        keys = self.keys
        baseline = jvp_baseline(self.top)
        s = self.s
        for n in self.top.graph.nodes:
            if n.target is _REPEAT:
                number = len(self.numbers)
                self.add_call(n, number, held[number])
                for ref in by_call.get(number, ()):
                    keys[ref] = self.call_key(number, ref[2])
            elif (at := self.at.get(n)) is not None:
                keys[n] = self.call_key(*at)
            elif n.op == "output":
                r = nodes.reads_of(n, keys)
                s.items.append(Step("j:__output__", 0, None, r))
                s.keep.update(r)
            elif n.op == "placeholder" and n.name in baseline:
                keys[n] = []
            elif (step := nodes.step(n, f"j:{n.name}", keys)) is not None:
                s.items.append(step)

    def note_referenced(
        self,
        read_after: dict[int, set[int]],
        held: list[list[list[_Ref]]],
        stand_ins: Iterable[_Ref],
    ) -> None:
        """Per call, its nodes whose keys something outside it reads (as a value read after
        it, a tangent held with a later call's argument or a top-level node's): their
        storages' ties are left to the schedule, the others' folded into the profile."""
        for number, positions in read_after.items():
            self.referenced.setdefault(number, set()).update(positions)
        refs = [ref for rows in held for row in rows for ref in row] + list(stand_ins)
        for ref in refs:
            if ref[0] == "call":
                self.referenced.setdefault(ref[1], set()).add(ref[2])

    def top_copy(self) -> GraphModule:
        """The top level for the overrides (:func:`_top_copy`), each call's value named as in
        the flat graph."""
        gm, names = _top_copy(self.top, lambda at: self.names[at[0]][at[1]], self.at)
        self.call_names.update(names)
        return gm

    def add_context(
        self, rep: Node, number: int, after: list[int], top_pairs: dict[str, list[str]]
    ) -> list[list[_Ref]]:
        """Find or make call ``number``'s context (checked), enter the tangents its values
        the top level reads hold in ``top_pairs``; returns the tangents held with each of its
        arguments (:meth:`value_pairs`)."""
        t = self.template(number)
        named, slot_at, named_key = self.named(number)
        self.slot_at.append(slot_at)
        args = rep.all_input_nodes
        if len(args) != len(t.placeholders) or args != list(rep.args[0]):  # type: ignore[arg-type]
            raise _Unsupported
        for j, a in enumerate(args):
            if t.regions[j] and t.regions[j] & _region_ids(a):
                raise _Unsupported  # one composite op's region across the call's boundary
        held = [self.value_pairs(a, top_pairs) for a in args]
        features = tuple(
            (_layout(a.meta.get("val")), a.meta.get(KIND), len(h)) for a, h in zip(args, held)
        )
        # (the named table as its number; the key as its number: hashed once per call, not
        # again in the profile's key)
        key = (self.dh.calls[number].template, tuple(after), features, named_key)
        ckey = self.context_ids.setdefault(key, len(self.context_ids))
        ctx = self.contexts.get(ckey)
        if ctx is None:
            ctx = self.contexts[ckey] = self.context(t, args, [len(h) for h in held], after, named)
            # the named slots with tangents held with them, in slot order: the only ones the
            # loop below enters anything for (worked out once per context)
            self.paired[ckey] = [(i, ctx.pairs[k]) for k, i in named.items() if ctx.pairs.get(k)]
        self.call_ctx.append(ctx)
        self.ckeys.append(ckey)
        names = self.names[number]
        for i, qs in self.paired[ckey]:
            if names[i] in self.call_names:  # a value the top level reads
                top_pairs[names[i]] = [names[q] for q in qs]
                self.call_names.update((names[q], (number, q)) for q in qs)
        return held

    def add_call(self, rep: Node, number: int, held: list[list[_Ref]]) -> None:
        """Add call ``number`` as one item: its context's profile for its arguments' keys."""
        ctx = self.call_ctx[number]
        lists = [self.keys.get(a, []) for a in rep.all_input_nodes]
        lists += [self.ref_keys(r) for h in held for r in h]
        ext = ctx.ext
        outside = frozenset(self.referenced.get(number, ()))
        pkey = (self.ckeys[number], tuple(len(x) for x in lists), outside)
        profile = self.s._profiles.get(pkey)
        if profile is None:
            profile = self.s._profiles[pkey] = _profile(ctx.nodes, ext, lists, ctx.steps)
            outer = sum(len(x) for x in lists)
            folded = _fold_ties(profile, ctx.ties, outside, outer)
            self.unfolded[pkey] = [g for i, g in enumerate(ctx.ties) if i not in folded]
        self.numbers.append(len(self.s.items))
        run: Any = _Run(self.names[number])
        self.s.items.append(_Call(profile, "j", run, [k for x in lists for k in x]))
        at = self.top_at[rep.name]
        for group in self.unfolded[pkey]:  # (the ties left to the schedule, in order)
            keyed = [k for i in group for k in self.call_key(number, i)]
            if keyed:
                self.tie_rows.append(((at, group[1]), keyed))

    def context(
        self,
        t: _Template,
        args: list[Node],
        held: list[int],
        after: list[int],
        named: dict[int, int],
    ) -> _Context:
        """The template's copy for calls with these arguments' layouts and kinds, this many
        tangents held with each, these nodes read after the call, these nodes named after
        these source slots."""
        g = Graph()
        env: dict[Node, Node] = {}
        for p, a in zip(t.placeholders, args):
            q = env[p] = g.placeholder(p.name)
            q.meta = {k: a.meta[k] for k in ("val", KIND) if k in a.meta}
        held_names = [
            [g.placeholder(f"held_{j}_{m}").name for m in range(c)] for j, c in enumerate(held)
        ]
        nodes = []
        slot_at = {i: k for k, i in named.items()}
        for i, n in enumerate(t.nodes):
            k = slot_at.get(i)
            name = _SLOT.format(k) if k is not None else None
            new = env[n] = copy_node(g, n, env.__getitem__, name)
            if name is not None and new.name != name:
                raise _Unsupported
            new.meta[SOURCE] = _SLOT.format(t.slot[i])
            nodes.append(new)
        g.output(tuple(nodes[i] for i in after))
        gm = graph_module(t.gm, g)
        pairs = dual_pairs(gm)
        slot_pairs: dict[int, list[int]] = {}
        position = {n.name: i for i, n in enumerate(nodes)}
        ties = []
        for src, tangents in pairs.items():
            k = int(src[len(_SLOT.format("")) :])
            slot_pairs[k] = [position[x] for x in tangents]
            if src in position:
                ties.append([position[src], *slot_pairs[k]])
        for p, row in zip(t.placeholders, held_names):
            if row:
                pairs[env[p].name] = row
        sizes, extra, reads = jvp_overrides(gm, self.device, pairs)
        steps = _NodeSteps(gm, True, sizes, extra, reads, None, False)
        return _Context(gm, nodes, steps, ties, slot_pairs)


def _fold_ties(p: _Profile, ties: list[list[int]], outside: frozenset[int], outer: int) -> set[int]:
    """Fold into profile ``p`` the ties (positions in its run, in the flat graph's order) whose
    storages are the call's own, read by nothing outside it (no position in ``outside`` lives
    in them) and in no tie left to the schedule: each such tie's storages are held to the last
    step reading any of them, as :meth:`Schedule._lifetimes` holds them, by a read of each at
    that step. Returns the ties folded (their numbers in ``ties``). ``outer``: how many keys
    from outside the profile reads (each names a storage: the values of steps)."""
    inner = _analysis(p, (True,) * outer)
    step_at: dict[int, int] = {}
    for j, s in enumerate(p.steps):
        step_at[int(s.key[1:])] = j
    root = {i: inner.root[f"@{i}"] for i in step_at}
    shared = {root[i] for i in outside if i in root}
    groups = [{root[i] for i in group if i in root} for group in ties]
    fold = {g for g, rs in enumerate(groups) if rs and all(r[0] != "<" for r in rs)}
    fold -= {g for g in fold if groups[g] & shared}
    while True:  # a storage also in a tie left to the schedule: that tie's order decides
        kept = set().union(*(groups[g] for g in range(len(groups)) if g not in fold))
        drop = {g for g in fold if groups[g] & kept}
        if not drop:
            break
        fold -= drop
    last = dict(inner.last)
    for g in sorted(fold):
        t = max(last[r] for r in groups[g])
        for i in ties[g]:
            if i in root and last[root[i]] < t:
                p.steps[t].reads.append(f"@{i}")
        for r in groups[g]:
            last[r] = t
    p.inside.clear()  # worked out again with the reads
    return fold


def _layout(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype)
    return None


# -- the eager train step ---------------------------------------------------------------------
def recorded_train_schedule(
    forward: GraphModule,
    backward: GraphModule,
    optimizer: str,
    device: str = "cpu",
    keep_grads: bool = False,
) -> tuple[ComposedSchedule, dict[str, int]] | None:
    """The eager train step's schedule
    (:func:`~graphflop.passes.eager_memory.eager_train_schedule` with ``composed``) and the
    storages saved for backward
    (:func:`~graphflop.passes.eager_memory.eager_saved_storages`) of the flat ``forward`` and
    the recorded backward top level ``backward``, without its flat view: each of its calls one
    item whose profile is its template's, the overrides of the eager model worked out once per
    context of its calls; None where ``backward`` is not a recorded top level or a call could
    differ from its context's copy (as :func:`recorded_jvp_schedule`; besides, a scatter
    whose zeros come from outside the call)."""
    if not is_recorded(backward):
        return None
    try:
        return _TrainBuilder(forward, backward, optimizer, device, keep_grads).build()
    except _Unsupported:
        return None


class _TrainBuilder:
    def __init__(
        self,
        forward: GraphModule,
        top: GraphModule,
        optimizer: str,
        device: str,
        keep_grads: bool,
    ) -> None:
        dh: DerivedHierarchy = top.meta[DERIVED_HIERARCHY]
        if len({c.site for c in dh.calls}) != len(dh.calls):
            raise _Unsupported  # a call site in two runs: its sources' nodes in two calls
        self.forward, self.top, self.dh = forward, top, dh
        self.at = _call_values(top)  # the calls' values: node -> (call number, position)
        self.indices = embedding_indices(forward)
        self.optimizer, self.device, self.keep_grads = optimizer, device, keep_grads
        self.sources: set[str] = set().union(*(c.sources for c in dh.calls))
        self.ef = eager_forward(forward, device)
        # an op whose saved values eager holds (EagerForward.held), differentiated inside a
        # call: the flat schedule (its backward node reads a forward key, which a call's
        # profile could not stand for); at the top level, its last node reads them
        if any(f in self.sources for f in self.ef.held):
            raise _Unsupported
        #: forward node name -> its one-kernel backward's number (in ``ef.kernels``)
        self.owner = {name: i for i, (names, _) in enumerate(self.ef.kernels) for name in names}
        #: forward nodes whose eager backward is one autograd node of a plain op, holding
        #: what it reads to its end (eager_kernels.autograd_node_reads)
        self.plain = plain_ops(forward, self.ef.kernels)
        #: forward convolutions whose backward holds temporaries: name -> what it allocates
        self.kernels = forward_kernels(forward)  # (read again for the backward's)
        fwd_tmp, _ = kernel_temporaries(forward, None, device, kernels=self.kernels)
        self.conv_bytes = {
            name: conv_backward(n) for name, n in self.kernels.convs.items() if name in fwd_tmp
        }
        self.fwd_tmp = fwd_tmp
        self.templates: dict[int, _Template] = {}
        self.s = ComposedSchedule()
        self.by_name: dict[str, str] = {}
        self.index: dict[str, tuple[int, int]] = {}
        self.numbers: list[int] = []
        self.keys: dict[Any, list[str]] = {}
        self.contexts: dict[Hashable, _Context] = {}
        self.context_ids: dict[tuple, int] = {}  # context key -> its number
        self.top_nodes = {n.name: n for n in top.graph.nodes}
        self.reader_rows: dict[int, list[list[tuple]]] = {}
        self.reader_slots: dict[int, list[tuple[int | None, ...]]] = {}
        self.arg_at: dict[Node, dict[Node, list[int]]] = {}
        #: the top level's placeholders holding a value eager autograd saves (not_saved)
        self.saved = [
            p for p in top.graph.find_nodes(op="placeholder") if not not_saved(p, self.indices)
        ]
        self._held: dict[str, list[str]] | None = None
        #: the top level's zero fills eager never makes (ungraded_nodes); a call's value
        #: among them: the flat schedule (a call's profile makes all its values)
        self.ungraded = ungraded_nodes(top)
        if any(
            n.target is _REPEAT or n in self.at for n in top.graph.nodes if n.name in self.ungraded
        ):
            raise _Unsupported

    def template(self, number: int) -> _Template:
        return _template_of(self.dh, self.templates, number)

    def call_key(self, number: int, i: int) -> list[str]:
        """The keys of call ``number``'s node ``i`` (``b:@NUMBER.I``; none where its profile
        has no step)."""
        item = self.s.items[self.numbers[number]]
        assert isinstance(item, _Call)
        if not item.profile.keyed[i]:
            return []
        name = f"@{number}.{i}"
        if name not in self.index:
            self.by_name[name] = name
            self.index[name] = (number, i)
        return [f"b:{name}"]

    def check_top(self) -> None:
        """No top-level node has a call's source; no scatter into zeros made in another
        part (a call, the top level) than the scatter (scatters_in_place reads the zeros'
        users)."""
        for n in self.top.graph.nodes:
            if n.target is _REPEAT or self.at.get(n) is not None:
                continue
            if n.op == "call_function" and n.meta.get(SOURCE) in self.sources:
                raise _Unsupported  # (a residual placeholder stands for a call's forward node)
            if n.op == "call_function" and n.target in _SCATTERS:
                base = n.args[0]
                if isinstance(base, Node) and (at := self.at.get(base)) is not None:
                    t = self.template(at[0])
                    if t.nodes[at[1]].target in _FRESH:
                        raise _Unsupported

    def build(self) -> tuple[ComposedSchedule, dict[str, int]]:
        self.check_top()
        ef, forward, s = self.ef, self.forward, self.s
        remap = self.remap()
        sig = forward.meta[SIGNATURE]
        state = sig.state()
        fwd_tmp = dict(self.fwd_tmp) | ef.attention.extra
        unstored = s.add_graph(
            forward,
            "f",
            runs=forward_runs(forward) or [],
            baseline=state,
            eager=True,
            sizes=ef.sizes,
            extra=fwd_tmp,
            also_reads=ef.reads,
        )
        self.s._graphs["b"] = (self.index, self.by_name, self.numbers)  # type: ignore[assignment]
        self.walk(state, remap, unstored)
        sizes = graded_sizes(forward, self.top, self.ungraded)
        s.add_transient("u:optimizer", optimizer_temporaries(self.optimizer, sizes, self.device))
        held = self.held()
        # the walk's tables are read: freed before the lifetimes below are worked out, the
        # analysis's peak (about 20 KiB per Llama layer)
        del ef, fwd_tmp
        self.release()
        # the storages saved for backward (eager_saved_storages with the schedule); each name
        # once, in the order first named (a composite op's residuals each stand for all it
        # saves: GPT-2 names each of them four times over)
        names = dict.fromkeys(
            x for p in self.saved for x in remap.get(p.name, [p.meta.get(SOURCE, p.name)])
        )
        names.update(dict.fromkeys(x for xs in held.values() for x in xs))
        found = s.owners([f"f:{x}" for x in names])
        owners = {o.split(":", 1)[1]: nb for o, nb in (v for v in found.values() if v is not None)}
        return s, owners

    def release(self) -> None:
        """Drop the tables the walk read (the eager forward, the kernels, the calls' contexts
        and keys): after :meth:`walk`, only the schedule, the saved placeholders and
        :meth:`held` (worked out) are read."""
        for attr in (
            "ef",
            "owner",
            "plain",
            "kernels",
            "conv_bytes",
            "fwd_tmp",
            "templates",
            "keys",
            "contexts",
            "context_ids",
            "top_nodes",
            "reader_rows",
            "reader_slots",
            "arg_at",
            "at",
            "indices",
        ):
            self.__dict__.pop(attr, None)

    def readers(self, p: Node) -> list[tuple[Any, Any]]:
        """The flat graph's readers of top-level node ``p``, in order, as (their
        :data:`~graphflop.meta.SOURCE`, their :data:`~graphflop.meta.ROLE`): top-level nodes
        (``""`` for no source), and for a call reading it the template's nodes reading that
        argument, their sources made the call's (None for no source)."""
        out: list[tuple[Any, Any]] = []
        for u in p.users:
            if u.target is not _REPEAT:
                out.append((u.meta.get(SOURCE, ""), u.meta.get(ROLE)))
                continue
            number = u.args[1]
            assert isinstance(number, int)
            c = self.dh.calls[number]
            rows = self.template_readers(c.template, number)
            for j in self.arg_positions(u)[p]:
                out += [(c.sources[k] if k is not None else None, role) for k, role in rows[j]]
        return out

    def reader_sources(self, p: Node) -> dict[Any, None]:
        """The distinct sources of :meth:`readers` of ``p``, in the order first met: what
        :meth:`remap` reads where ``p``'s source is no replayed draw (a reader met again adds
        nothing to what it stands for), without a row per reader of the templates."""
        out: dict[Any, None] = {}
        for u in p.users:
            if u.target is not _REPEAT:
                out[u.meta.get(SOURCE, "")] = None
                continue
            number = u.args[1]
            assert isinstance(number, int)
            c = self.dh.calls[number]
            slots = self.template_slots(c.template, number)
            sources = c.sources
            for j in self.arg_positions(u)[p]:
                for k in slots[j]:
                    out[sources[k] if k is not None else None] = None
        return out

    def template_slots(self, template: int, number: int) -> list[tuple[int | None, ...]]:
        """Per placeholder of the template, its readers' distinct source slots
        (:meth:`template_readers` without the roles), in the order first met."""
        got = self.reader_slots.get(template)
        if got is None:
            rows = self.template_readers(template, number)
            got = self.reader_slots[template] = [
                tuple(dict.fromkeys(k for k, _ in row)) for row in rows
            ]
        return got

    def arg_positions(self, rep: Node) -> dict[Node, list[int]]:
        """Call ``rep``'s arguments -> their positions among its arguments (made once per
        call, not once per argument read)."""
        got = self.arg_at.get(rep)
        if got is None:
            got = self.arg_at[rep] = {}
            for j, a in enumerate(rep.args[0]):  # type: ignore[arg-type]
                got.setdefault(a, []).append(j)
        return got

    def template_readers(self, template: int, number: int) -> list[list[tuple]]:
        """Per placeholder of the template, its readers' (source slot, role)."""
        got = self.reader_rows.get(template)
        if got is None:
            t = self.template(number)
            got = self.reader_rows[template] = [
                [
                    (int(r.meta[SOURCE][1:]) if r.meta.get(SOURCE) else None, r.meta.get(ROLE))
                    for r in p.users
                    if r.op != "output"
                ]
                for p in t.placeholders
            ]
        return got

    def remap(self) -> dict[str, list[str]]:
        """:attr:`EagerResiduals.remap` of the flat backward, read off the top level's
        placeholders and the calls' readers of them."""
        replayed = _replayed_draws(self.forward)
        remap: dict[str, list[str]] = {}
        stands_for = self.ef.stands_for
        for p in self.saved:
            src = p.meta.get(SOURCE, p.name)
            if src in replayed and all(role == "recompute" for _, role in self.readers(p)):
                remap[p.name] = []
                continue
            stand: list[str] = []
            for reader in self.reader_sources(p):
                for name in stands_for(src, reader):
                    if name not in stand:
                        stand.append(name)
            if stand != [src]:
                remap[p.name] = stand
        return remap

    def walk(self, state: set[str], remap: dict[str, list[str]], unstored: set[str]) -> None:
        """The backward's top level as steps, each call one item (after the forward's);
        ``unstored``: the forward's nodes whose value names no storage (its ``add_graph``'s)."""
        top, keys, s = self.top, self.keys, self.s
        saved = set(self.saved)
        read_after: dict[int, set[int]] = {}
        outs: dict[int, set[int]] = {}
        out = next(n for n in reversed(top.graph.nodes) if n.op == "output")
        for n, (number, i) in self.at.items():  # (the calls' values, not every top-level node)
            if n.users:
                read_after.setdefault(number, set()).add(i)
            if out in n.users:
                outs.setdefault(number, set()).add(i)
        nodes, by_call = self.top_steps(out)
        self.region_call: dict[int, int] = {}
        for n in top.graph.nodes:
            if n.target is _REPEAT:
                number = len(self.numbers)
                if n.args[1] != number:
                    raise _Unsupported
                after = sorted(read_after.get(number, ()))
                self.add_call(n, number, after, sorted(outs.get(number, ())))
                for ref in by_call.get(number, ()):
                    keys[ref] = self.call_key(number, ref[2])
            elif (at := self.at.get(n)) is not None:
                keys[n] = self.call_key(*at)
            elif n.op == "output":
                r = nodes.reads_of(n, keys)
                s.items.append(Step("b:__output__", 0, None, r))
                if not self.keep_grads:
                    s.keep.update(r)
            elif n.op == "placeholder" and n.meta.get(RESIDUAL) is not None:
                keys[n] = residual_keys(n, state, n in saved, remap, unstored)
            elif (step := nodes.step(n, f"b:{n.name}", keys)) is not None:
                s.items.append(step)

    def top_steps(self, out: Node) -> tuple[_NodeSteps, dict[int, list[tuple]]]:
        """The top level's steps with the overrides worked out on its copy; the calls' nodes
        those name, by call (stand-ins whose keys are entered when the call is added)."""
        top_gm, call_names = self.top_copy()
        inplace = scatters_in_place(top_gm)
        sizes, reads, b_extra = one_kernel_backward(
            top_gm, self.ef.kernels, inplace, self.ef.copied, owner=self.owner
        )
        self.top_regions = {
            o
            for n in top_gm.graph.nodes
            if n.op == "call_function" and (o := self.owner.get(n.meta.get(SOURCE, ""))) is not None
        }
        _, extra = kernel_temporaries(self.forward, top_gm, self.device, kernels=self.kernels)
        if self.keep_grads:
            for a in out.all_input_nodes:
                if self.at.get(a) is None and a.name not in self.ungraded:
                    extra[a.name] = extra.get(a.name, 0) + tensor_bytes(a.meta.get("val"))
        for k, v in b_extra.items():
            extra[k] = extra.get(k, 0) + v
        merge_reads(reads, autograd_node_reads(top_gm, self.plain.__contains__))
        sizes |= dict.fromkeys(self.ungraded, 0)
        nodes = _NodeSteps(self.top, True, sizes, extra, reads, inplace, self.keep_grads)
        stand_ins: dict[str, Any] = {}
        by_call: dict[int, list[tuple]] = {}
        for m in {m for names in reads.values() for m in names} - self.top_nodes.keys():
            at = call_names.get(m)
            if at is None:  # (a kernel's reads name only its graph's nodes)
                raise _Unsupported
            stand_ins[m] = ("call", *at)
            by_call.setdefault(at[0], []).append(stand_ins[m])
        nodes.by_name = {**nodes.by_name, **stand_ins}
        for name, held in self.held().items():  # forward keys, read as they are named
            reads.setdefault(name, []).extend(f"f:{x}" for x in held)
        nodes.also_reads = reads
        return nodes, by_call

    def held(self) -> dict[str, list[str]]:
        """:attr:`~graphflop.passes.eager_memory.EagerResiduals.held` of the flat backward:
        the top level's last node of each op of ``EagerForward.held`` (none is a call's;
        worked out once)."""
        if self._held is None:
            last: dict[str, str] = {}
            for n in self.top.graph.nodes:
                if n.op == "call_function" and (src := n.meta.get(SOURCE)) in self.ef.held:
                    last[src] = n.name
            self._held = {b: self.ef.held[f] for f, b in last.items()}
        return self._held

    def top_copy(self) -> tuple[GraphModule, dict[str, tuple[int, int]]]:
        """The top level for the overrides (:func:`_top_copy`), each call's value a
        placeholder ``gfcall_NUMBER_I``."""
        return _top_copy(
            self.top, lambda at: f"gfcall_{at[0]}_{at[1]}", self.at, output_values=False
        )

    def add_call(self, rep: Node, number: int, after: list[int], outs: list[int]) -> None:
        """Call ``number`` as one item: its context's profile for its arguments' keys."""
        t = self.template(number)
        c = self.dh.calls[number]
        args = rep.all_input_nodes
        if args != list(rep.args[0]):  # type: ignore[arg-type]
            raise _Unsupported
        for j in t.scattered:
            if args[j].target in _FRESH:
                raise _Unsupported  # zeros from outside the call scattered into
        # per source slot: its one-kernel backward's number in the call (in the order the
        # slots first name it), that kernel's temporaries and whether it copies the output
        # gradient, a convolution's temporaries, a plain op: looked up per slot by C-level
        # maps, the checks per kernel
        sources = c.sources
        owners = list(map(self.owner.get, sources))
        groups: dict[int | None, int | None] = {None: None}
        nbytes: dict[int | None, int | None] = {None: None}
        copies: dict[int | None, bool] = {None: False}
        for o in dict.fromkeys(owners):
            if o is None:
                continue
            if self.region_call.setdefault(o, number) != number or o in self.top_regions:
                raise _Unsupported  # one kernel's backward in two parts of the graph
            groups[o] = len(groups) - 1
            nbytes[o] = self.ef.kernels[o][1]
            copies[o] = o in self.ef.copied
        feats: list[tuple[int | None, int | None, ConvBackward | None, bool, bool]] = list(
            zip(
                map(groups.__getitem__, owners),
                map(nbytes.__getitem__, owners),
                map(self.conv_bytes.get, sources),
                map(copies.__getitem__, owners),
                map(self.plain.__contains__, sources),
            )
        )
        # the arguments' strides: a kernel's copy of a non-contiguous output gradient, a
        # matrix product's of an operand BLAS cannot read (the last block's, under a sum)
        strides = tuple(
            tuple(v.stride()) if isinstance(v := a.meta.get("val"), torch.Tensor) else None
            for a in args
        )
        # (the key as its number: hashed once per call, not again in the profile's key)
        key = (c.template, tuple(after), tuple(outs), tuple(feats), strides)
        ckey = self.context_ids.setdefault(key, len(self.context_ids))
        ctx = self.contexts.get(ckey)
        if ctx is None:
            ctx = self.contexts[ckey] = self.context(t, args, after, outs, feats)
        lists = [self.keys.get(a, []) for a in args]
        ext = ctx.ext
        pkey = ("b", ckey, tuple(len(x) for x in lists))
        profile = self.s._profiles.get(pkey)
        if profile is None:
            profile = self.s._profiles[pkey] = _profile(ctx.nodes, ext, lists, ctx.steps)
        self.numbers.append(len(self.s.items))
        run: Any = _Run(self.dh.names[number] if self.dh.names is not None else ())
        self.s.items.append(_Call(profile, "b", run, [k for x in lists for k in x]))

    def context(
        self,
        t: _Template,
        args: list[Node],
        after: list[int],
        outs: list[int],
        feats: list[tuple[int | None, int | None, ConvBackward | None, bool, bool]],
    ) -> _Context:
        """The template's copy for calls with these nodes read after them, these among the
        graph's outputs, these forward features per source slot (its one-kernel backward, that
        kernel's temporaries, a convolution's backward temporaries, whether that kernel copies
        a non-contiguous output gradient, whether it is a plain op: one eager autograd node,
        :func:`~graphflop.passes.eager_memory.plain_ops`)."""
        g = Graph()
        env: dict[Node, Node] = {}
        for p, a in zip(t.placeholders, args):
            q = env[p] = g.placeholder(p.name)
            q.meta = {k: a.meta[k] for k in ("val", KIND) if k in a.meta}
        nodes = []
        for i, n in enumerate(t.nodes):
            new = env[n] = copy_node(g, n, env.__getitem__)
            new.meta[SOURCE] = _SLOT.format(t.slot[i])
            nodes.append(new)
        g.output(tuple(nodes[i] for i in after))
        gm = graph_module(t.gm, g)
        kernels: dict[int, tuple[set[str], int]] = {}
        copied: set[int] = set()
        for k, (grp, nbytes, _, copies, _) in enumerate(feats):
            if grp is not None:
                kernels.setdefault(grp, (set(), nbytes or 0))[0].add(_SLOT.format(k))
                if copies:
                    copied.add(grp)
        inplace = scatters_in_place(gm)
        sizes, reads, b_extra = one_kernel_backward(
            gm, [kernels[i] for i in range(len(kernels))], inplace, copied
        )
        plain = {_SLOT.format(k) for k, f in enumerate(feats) if f[4]}
        merge_reads(reads, autograd_node_reads(gm, plain.__contains__))
        extra: dict[str, int] = {}
        made: dict[int, list[Node]] = {}  # a convolution's slot -> its backward nodes
        for i, n in enumerate(nodes):
            if n.op == "call_function" and feats[t.slot[i]][2] is not None:
                made.setdefault(t.slot[i], []).append(n)
        for k, ns in made.items():
            extra |= conv_backward_temporaries(feats[k][2], ns)  # type: ignore[arg-type]
        for i, n in enumerate(nodes):  # (a one-kernel op's backward runs no matrix product)
            if self.device != "cpu" or feats[t.slot[i]][0] is not None:
                continue
            if b := matmul_operand_copy_bytes(n):
                extra[n.name] = extra.get(n.name, 0) + b
        if self.keep_grads:
            for i in outs:
                n = nodes[i]
                extra[n.name] = extra.get(n.name, 0) + tensor_bytes(n.meta.get("val"))
        for k2, v in b_extra.items():
            extra[k2] = extra.get(k2, 0) + v
        steps = _NodeSteps(gm, True, sizes, extra, reads, inplace, self.keep_grads)
        steps.outputs = {nodes[i] for i in outs}
        return _Context(gm, nodes, steps, [], {})
