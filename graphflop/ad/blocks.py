"""The transpose of a repeated block built once per template and expanded at every call.

A traced forward graph with outlined blocks (:data:`~graphflop.meta.HIERARCHY`) linearizes into
a JVP graph whose tangent work for one call site is one run of its log (the JVP emits each
forward node's tangents in forward order, and a call's nodes are one run of the forward). Its
transpose (:func:`graphflop.ad.vjp.build_vjp`) walks the log in reverse, so each call site's
backward is again one run: the same rules, on the same shapes, with only the module paths, the
forward node names and the residuals changing from call to call.

:class:`BlockTranspose` builds that run with the rules once per *variant* — the call's template,
which of its nodes carry tangents (the activity pattern: the JVP log's entries for the call),
which of its outputs arrive with a cotangent and which of its inputs already hold one, and
which of the values its entries read are computed from parameters only (``PARAM_DERIVED``: the
cotangent work for such a tangent is a weight gradient, so a block run on learned latents, or
on a tangent only a parameter feeds, labels its backward unlike one run on activations) — as a
:class:`TemplateBackward`: the backward nodes of one call, whose arguments are the residuals
the call reads (values of the template's forward: its inputs, parameters and inner nodes), the
cotangents arriving at its outputs and those already held by its inputs, and whose results are
the cotangents of its inputs and parameters. Every other call of that variant is the template
backward expanded: its nodes copied with the call's residuals, cotangents, module paths and
forward node names, no rule run. The flat backward graph is the same, node for node (ops,
arguments, shapes, roles, modules, residual placeholders in order), as the one the rules give
call by call (``tests/test_hierarchy.py``).

A ``torch.utils.checkpoint`` call inside a block, or around exactly one block, is recomputed
within the block's run (the first rule reading one of its primals emits the recompute): the
template backward holds the recompute, and its copy at another call reruns that call's forward
from that call's residuals (a value only the recompute reads, such as a bias, found through the
forward graph) and is kept through dead-code elimination as the rules' recompute is.

A call is transposed by the rules instead (and its variant not reused) where expanding could
differ from them: ghost work in it (a pruned cotangent), a gap, a custom Function, a
``torch.utils.checkpoint`` call around several blocks (or nested, or detached), an input
passed twice, or a residual or coefficient that an earlier call had already imported for the
one and not for the other.

A recorded JVP (:class:`graphflop.passes.calls.DirectRecorder`: its blocks are calls of
template JVPs) is transposed without its flat graph: :class:`RecordedCalls` gives each call's
values one node, and a call of a variant already transposed at an earlier call of the same
template JVP takes its residuals and cotangents from its ``graphflop::repeat`` node's
arguments and getitems (:meth:`BlockTranspose.transpose_call`); the other calls are made flat
aside and transposed as above. A custom Function's log entry (:mod:`graphflop.ad.functions`)
splits its call's run in two and is transposed on its own between them; it names the first
call's nodes, which the recorder erased, so it is read through the nodes that stand for them
(:meth:`RecordedCalls.function_entry`), and a cotangent that the rules filed on a node made
flat is moved onto that node before another run of the call or an entry reads it
(:meth:`RecordedCalls.settle`).

What both expanders (and the describers of :mod:`graphflop.passes.calls`) read of the forward
graph is worked out in one walk per forward graph and kept on it: where each node is in its
call (:func:`call_keys`), how the calls are checkpointed (:func:`checkpointed_sites`,
:func:`checkpoint_calls`). What a call's expansion reads of its template is worked out once per
template instead of at every call: which of its nodes read which placeholder, and which
annotations a copy makes the call's (:func:`graphflop.passes.calls.localize_plan`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from graphflop.ad.builder import NO_KWARGS, NamePlan, base_name, copy_node, emit, placeholder
from graphflop.ad.functions import FunctionEntry
from graphflop.meta import (
    CALL_SITE,
    CHECKPOINT,
    HIERARCHY,
    KIND,
    MODULE,
    PARAM_DERIVED,
    RESIDUAL,
    ROLE,
    SOURCE,
    Hierarchy,
    graphflop_meta,
)
from graphflop.ops.ghost import is_ghost

__all__ = [
    "BlockLinearize",
    "CallRun",
    "CallKeys",
    "CallPlans",
    "RecordedCalls",
    "RecordedFallback",
    "BlockTranspose",
    "TemplateBackward",
    "TemplateJvp",
    "call_keys",
    "call_plans",
    "checkpoint_calls",
    "checkpointed",
    "checkpointed_sites",
    "residual_meta",
    "transpose_log",
]


def _leaves(x: Any) -> list[Any]:
    out: list[Any] = []
    stack = [x]
    while stack:
        y = stack.pop()
        if isinstance(y, (list, tuple)):
            stack.extend(reversed(y))
        elif isinstance(y, dict):
            stack.extend(reversed(list(y.values())))
        else:
            out.append(y)
    return out


def _layout(n: Node) -> Any:
    """The metadata of ``n``'s value that the nodes reading it carry on into theirs (shape,
    strides, storage offset, dtype): a template's nodes keep the values its first call gave
    them, so a call whose value differs here (a loss's cotangent broadcast with strides 0 at
    the last block, a contiguous sum at the others) is a variant of its own."""
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype)
    return None


def _state(v: Any) -> Any:
    """What a cotangent slot holds, as a signature: None, ``("node", layout)``
    (:func:`_layout`), or per slot of a multi-output value; ``False`` (do not reuse) for a
    ghost."""
    if v is None:
        return None
    if isinstance(v, list):
        inner = tuple(_state(x) for x in v)
        return False if False in inner else inner
    if is_ghost(v) or not isinstance(v, Node):
        return False
    return ("node", _layout(v))


class _NotReusable(Exception):
    """A call's backward that expanding at another call could not reproduce."""


def _first_of(pair: tuple) -> Any:
    return pair[0]


def _one(refs: list[tuple] | None) -> tuple:
    """The one way a value is found at another call (:class:`_NotReusable`: none, or
    several)."""
    if not refs or len(set(refs)) != 1:
        raise _NotReusable
    return refs[0]


def _appended(tail: Node) -> list[Node]:
    """The nodes after ``tail`` other than placeholders (what a run appended)."""
    nodes: list[Node] = []
    n = tail.next
    while n.op != "root":
        if n.op != "placeholder":
            nodes.append(n)
        n = n.next
    return nodes


def _references(arrived: list[Any], held: list[Any]) -> dict[Node, list[tuple]]:
    """Per backward value a run found in place, where: ``("in", k, slot)`` the cotangent
    entry ``k`` arrived with (slot of a multi-output one), ``("prev", i)`` the one external
    ``i`` held."""
    refs: dict[Node, list[tuple]] = {}
    for k, v in enumerate(arrived):
        for s, x in enumerate(v) if isinstance(v, list) else [(None, v)]:
            if isinstance(x, Node):
                refs.setdefault(x, []).append(("in", k, s))
    for i, v in enumerate(held):
        if isinstance(v, Node):
            refs.setdefault(v, []).append(("prev", i))
    return refs


@dataclass(eq=False)
class TemplateBackward:
    """The backward of one variant of a template's call, as the rules built it at its first
    call (``site``).

    Attributes:
        site: the call site it was built at.
        entries: that call's JVP-log entries, in the order transposed.
        nodes: its backward nodes, in order (``call_function`` nodes of that call's backward).
        inputs: per backward node argument from outside ``nodes``, how to find it at another
            call: ``("in", k, slot)`` the cotangent entry ``k`` arrived with, ``("prev", i)``
            the cotangent external ``i`` held before, ``("new", j)`` residual ``j`` of
            :attr:`residuals` (imported by this call), ``("old", node)`` a residual or
            coefficient imported before the call (``node``: the linearized graph's).
        residuals: the linearized graph's values this call imported first, in order (primals
            become residual placeholders).
        coefficients: per node of :attr:`nodes` that recomputes a linearized coefficient, that
            coefficient (so a later import reuses the copy).
        results: per external (a tangent outside the call it writes a cotangent for: its
            inputs' and parameters' tangents), the cotangent it holds after the call (an
            ``inputs``-style reference, ``("node", i)`` for node ``i``), or None (unchanged).
        reusable: False where expanding could differ from the rules (see the module
            docstring): the rules run at every call of the variant.
    """

    site: int
    entries: list[Any]
    nodes: list[Node] = field(default_factory=list)
    inputs: dict[Node, tuple] = field(default_factory=dict)
    residuals: list[Node] = field(default_factory=list)
    coefficients: dict[int, Node] = field(default_factory=dict)
    results: list[tuple | None] = field(default_factory=list)
    reusable: bool = True
    #: with a recorder (:class:`graphflop.passes.calls.DirectRecorder`): its handle, and the
    #: positions of :attr:`nodes` read after the call (getitems of the call)
    direct: tuple | None = None
    exposed: list[int] = field(default_factory=list)
    #: transposing a recorded JVP: per value of the first call's (an argument of its call, or
    #: one of its template nodes) ``("arg", j)`` or ``("pos", i)``, so another call of the
    #: same JVP template finds its own value without walking its nodes
    places: dict[Node, tuple] | None = None
    #: with :attr:`direct`: per node of :attr:`nodes`, the base of the name fx gives its copy,
    #: as a plan taking a call's names
    bases: NamePlan | None = None
    #: the linearized graph's values of :attr:`inputs`' ``("old", node)`` references, in order
    #: (listed at the first expansion)
    olds: list[Node] | None = None
    #: transposing a recorded JVP: per residual, how a call expanded with :attr:`places`
    #: imports it (:meth:`BlockTranspose._plan_imports`; planned at the first expansion)
    imports: list[tuple] | None = None
    #: with :attr:`places`: what :meth:`BlockTranspose._fresh_match` checks (planned at the
    #: first expansion)
    checks: tuple | None = None


class BlockTranspose:
    """Per call site of ``forward``'s hierarchy, the transpose of its run of the JVP log,
    built by the rules once per variant and expanded at the other calls.

    Args:
        forward: the traced forward graph (with :data:`~graphflop.meta.HIERARCHY`).
        b: the transpose builder (:class:`graphflop.ad.vjp.TransposeBuilder`) of the backward
            graph being built.

    Attributes:
        templates: the template backwards built, by variant signature.
        built, expanded: how many calls the rules transposed and how many were expanded.
    """

    def __init__(self, forward: GraphModule, b: Any) -> None:
        self.b = b
        self.forward = forward
        self.g: Graph = b.graph
        #: records each expanded call as a call instead of copying its nodes (or None)
        self.recorder: Any = getattr(b, "recorder", None)
        self.root = torch.nn.Module()  # the owner of the template derivatives' graphs
        h: Hierarchy | None = forward.meta.get(HIERARCHY)
        self.h = h
        #: forward node name -> (site, template index[, output of a getitem added afterwards])
        self.tag: dict[str, tuple] = {}
        #: the inverse
        self.name: dict[tuple, str] = {}
        #: call sites whose calls the rules must transpose
        self.unsafe: set[int] = set()
        self.templates: dict[tuple, TemplateBackward] = {}
        self.built = 0
        self.expanded = 0
        #: transposing a recorded JVP: its calls (:meth:`read_calls`)
        self.calls: Any = None
        if h is None:
            return
        # a getitem tracing added afterwards shares its parent's tag, with its output
        keys = call_keys(forward)
        self.tag = keys.tags  # shared: read only
        self.name = keys.tag_names
        self.unsafe.update(keys.dup)  # two nodes copy one template node (a rewritten graph)
        self.unsafe.update(_checkpoints_across(forward))
        #: per call site, how its nodes are checkpointed (:func:`checkpointed_sites`): a call
        #: checkpointed and one not are variants of their own
        self.checkpointed = checkpointed_sites(forward)
        # module paths: per site, absolute <-> relative
        self.rel = [{a: r for r, a in s.modules} for s in h.sites]
        self.abs = [dict(s.modules) for s in h.sites]
        # one module under two relative paths: a path cannot be mapped back, the rules run
        self.unsafe.update(i for i, s in enumerate(h.sites) if len(self.rel[i]) != len(s.modules))

    @classmethod
    def of(cls, forward: GraphModule, b: Any) -> BlockTranspose | None:
        """The expander for ``forward``, or None when it has no call sites."""
        if forward.meta.get(HIERARCHY) is None:
            return None
        return cls(forward, b)

    # -- runs of the log ---------------------------------------------------------------------
    def site_of(self, entry: Any) -> int | None:
        """The call site whose forward node ``entry`` (a linearized tangent node) is the
        tangent work of; None for ghosts, custom Functions and top-level work."""
        if isinstance(entry, tuple):  # a recorded JVP's call entry: (repeat node, position)
            return self.calls.site(entry[0])
        if not isinstance(entry, Node):
            return None
        t = self.tag.get(entry.meta.get(SOURCE, ""))
        return None if t is None else t[0]

    def run(self, entries: list[Any], i: int) -> int:
        """The end of the run of entries from ``i`` that belong to one call site (``i`` when
        ``entries[i]`` belongs to none)."""
        e = entries[i]
        s = self.site_of(e)
        if s is None:
            return i
        j, end = i + 1, len(entries)
        rep = e[0] if isinstance(e, tuple) else None
        while j < end:
            f = entries[j]
            # a recorded JVP's entry of the same call (one site) without looking it up
            if (rep is None or not isinstance(f, tuple) or f[0] is not rep) and (
                self.site_of(f) != s
            ):
                break
            j += 1
        return j

    def transpose(
        self,
        run: list[Node],
        ct: dict[Any, Any],
        rules: Callable[[list[Any]], None],
        state: Callable[[], tuple[int, int]],
    ) -> TemplateBackward | None:
        """Transpose ``run`` (one call site's entries, in the order transposed) into the
        backward graph, updating the cotangents ``ct``: by expanding its variant's template
        backward, or by ``rules(run)`` (recording the template backward at a variant's first
        call). ``state()`` counts the ghosts and gaps recorded so far (a call that adds any
        is not reused). Returns the template backward recorded at this call, if any."""
        site = self.site_of(run[0])
        assert site is not None
        inside = set(run)
        externals: list[Node] = []
        seen: set[Node] = set()
        # per value the entries read, its PARAM_DERIVED: a tangent's decides the role of the
        # cotangent work for it (grad_weight or grad_input), a primal's or coefficient's the
        # PARAM_DERIVED of the backward nodes reading it
        derived: list[bool] = []
        for e in run:
            for a in _leaves((e.args, e.kwargs)):
                if is_ghost(a):
                    self._rules(run, rules, site)
                    return None
                if isinstance(a, Node):
                    m = a.meta
                    derived.append(m.get(PARAM_DERIVED, False))
                    if m.get(KIND) == "tangent" and a not in inside and a not in seen:
                        seen.add(a)
                        externals.append(a)
        incoming = tuple(_state(ct.get(e)) for e in run)
        prior = tuple(_state(ct.get(x)) for x in externals)
        if site in self.unsafe or False in incoming or False in prior:
            self._rules(run, rules, site)
            return None
        h = self.h
        assert h is not None
        key = (
            h.sites[site].variant,
            self.checkpointed.get(site),
            tuple((self.tag[e.meta[SOURCE]][1:], e.target) for e in run),
            incoming,
            prior,
            len(externals),
            tuple(derived),
        )
        t = self.templates.get(key)
        if t is None:
            t = self.templates[key] = TemplateBackward(site, run)
            self._record(t, run, externals, ct, rules, state)
            return t
        if not t.reusable or not self._expand(t, run, externals, ct, site):
            self._rules(run, rules, site)
        return None

    def _rules(self, run: list[Any], rules: Callable[[list[Any]], None], site: int | None) -> None:
        """Transpose ``run`` with the rules; with a recorder and the call site ``site``, make
        the nodes they appended a call where they are one unbroken run (placeholders of the
        residuals imported aside)."""
        self.built += 1
        if site is None or self.recorder is None:
            rules(run)
            return
        g, b = self.g, self.b
        tail = next(iter(reversed(g.nodes)))
        n_nodes, n_imported = len(g.nodes), len(b.imported)
        rules(run)
        self._as_call(tail, n_nodes, n_imported, site)

    def _as_call(self, tail: Node, n_nodes: int, n_imported: int, site: int) -> list[Node]:
        """The nodes appended after ``tail`` (the graph had ``n_nodes`` nodes and the builder
        ``n_imported`` imports), made a call of site ``site`` by the recorder where they are
        one unbroken run; [] where they are not."""
        g, b = self.g, self.b
        new_imports = itertools.islice(reversed(b.imported.values()), len(b.imported) - n_imported)
        placed = sum(1 for gn in new_imports if gn.op == "placeholder")
        nodes = _appended(tail)
        if not nodes or len(g.nodes) - n_nodes != len(nodes) + placed:
            return []
        if self.recorder is not None:
            self.recorder.template(nodes, site, self.root, None)
        return nodes

    # -- a recorded JVP's call -------------------------------------------------------------------
    def read_calls(self, calls: RecordedCalls) -> None:
        """Transpose the calls of a recorded JVP (``calls``: its hierarchy as the transpose
        reads it) with :meth:`transpose_call`."""
        self.calls = calls
        self.fast: dict[tuple, TemplateBackward] = {}
        self._walks: dict[tuple, list[tuple]] = {}
        #: per list of a run's positions (:meth:`call_run`): the list, its order transposed and
        #: each position's place there
        self._orders: dict[int, tuple] = {}

    def transpose_call(
        self,
        run: list[tuple],
        ct: dict[Any, Any],
        rules: Callable[[list[Any]], None],
        state: Callable[[], tuple[int, int]],
    ) -> None:
        """Transpose one call of the recorded JVP (``run``: its log entries ``(repeat node,
        position)``, in the order transposed): :meth:`call_run` of its positions."""
        self._call_run(run[0][0], tuple([e[1] for e in run]), None, ct, rules, state)

    def call_run(
        self,
        rep: Node,
        positions: Sequence[int],
        ct: dict[Any, Any],
        rules: Callable[[list[Any]], None],
        state: Callable[[], tuple[int, int]],
    ) -> None:
        """Transpose the run of call ``rep`` that logged its template's ``positions`` (in
        forward order: the list the log's run holds, shared by the template's calls;
        transposed in reverse). What the run reads of its positions (their order transposed,
        each one's place in it) is worked out once per such list, not per call."""
        got = self._orders.get(id(positions))
        if got is None or got[0] is not positions:
            order = tuple(reversed(positions))
            index = {k: i for i, k in enumerate(order)}
            got = (positions, order, index if len(index) == len(order) else None)
            self._orders[id(positions)] = got
        self._call_run(rep, got[1], got[2], ct, rules, state)

    def _call_run(
        self,
        rep: Node,
        positions: tuple[int, ...],
        index: dict[int, int] | None,
        ct: dict[Any, Any],
        rules: Callable[[list[Any]], None],
        state: Callable[[], tuple[int, int]],
    ) -> None:
        """Transpose the run of call ``rep`` logging its template's ``positions`` (in the order
        transposed; ``index``: position -> its place there, None where unknown). A call of a
        JVP template whose variant (its logged positions, which of its arguments are one value
        and which are computed from parameters only, the cotangents arriving and held) has a
        template backward recorded at an earlier call of that JVP template is that template
        backward, its residuals and cotangents read from the call's arguments and getitems (no
        node of the call made); every other call is made flat aside
        (:meth:`RecordedCalls.flat`) and transposed as :meth:`transpose` transposes the flat
        JVP's, its first call of a variant recording the template backward.

        The cotangents arriving are read only where one can be: at the entries whose value a
        node holds (:meth:`RecordedCalls.holder`). For a call none of whose values was made a
        node or imported yet (:attr:`RecordedCalls.touched`: the one transposed in a single
        run, as every call of a GPT-2 is) those are its getitems, found by position: the work
        per call follows its getitems, not its template's hundred logged entries."""
        calls = self.calls
        calls.settle(rep, ct)  # an earlier run's cotangents, where this one reads them
        site = calls.site(rep)
        args: Any = rep.args[0]
        first: dict[int, int] = {}
        pattern = tuple([first.setdefault(id(a), j) for j, a in enumerate(args)])
        # which arguments are computed from parameters only (two calls of one template JVP
        # may differ there: the roles of the cotangent work for them, :meth:`transpose`)
        derived = tuple([isinstance(a, Node) and a.meta.get(PARAM_DERIVED, False) for a in args])
        externals: list[Node] = []
        seen: set[Node] = set()
        template = calls.template(rep)
        for ref in self._walk(template, positions):
            a = args[ref[1]] if ref[0] == "arg" else calls.value(rep, ref[1])
            if isinstance(a, Node) and a.meta.get(KIND) == "tangent" and a not in seen:
                seen.add(a)
                externals.append(a)
        arrive = self._holders(rep, positions, index)
        incoming = []
        for i, holder in arrive:
            st = _state(ct.get(holder))
            if st is not None:
                incoming.append((i, st))
        fresh = all(st is not False for _, st in incoming)
        prior = tuple([_state(ct.get(x)) for x in externals])
        h = self.h
        assert h is not None
        fkey = (
            h.sites[site].variant,
            self.checkpointed.get(site),
            template,
            positions,
            pattern,
            derived,
            tuple(incoming),
            prior,
            len(externals),
        )
        t = self.fast.get(fkey)
        if t is not None and site not in self.unsafe:
            given = _Places(t.places or {}, calls, rep)
            if self._expand(t, positions, externals, ct, site, given, arrive):
                return
            self._rules(calls.flat(rep, [(rep, k) for k in positions], ct), rules, site)
            return
        side = calls.flat(rep, [(rep, k) for k in positions], ct)
        t = self.transpose(side, ct, rules, state)
        if t is not None and t.reusable and fresh and False not in prior:
            reached = self._correspondence(t.entries, t.entries, site, site) or {}
            places: dict[Node, tuple] = {}
            at = {x: i for i, x in enumerate(calls.side[rep])}
            for x in reached:
                if x in at:
                    places[x] = ("pos", at[x])
                    places[calls.value(rep, at[x])] = ("pos", at[x])
                elif any(x is a for a in args):
                    places[x] = ("arg", next(j for j, a in enumerate(args) if a is x))
            t.places = places
            self.fast[fkey] = t

    def _holders(
        self, rep: Node, positions: tuple[int, ...], index: dict[int, int] | None
    ) -> list[tuple[int, Node]]:
        """Per entry of call ``rep``'s run (``positions``, ``index`` as :meth:`_call_run`
        takes them) whose value a node holds (:meth:`RecordedCalls.holder`), its place in the
        run and that node, in order."""
        calls = self.calls
        arrive: list[tuple[int, Node]] = []
        if index is not None and rep not in calls.touched:  # its getitems only
            for k, item in calls.items_of(rep).items():
                i = index.get(k)
                if i is not None:
                    arrive.append((i, item))
            if len(arrive) > 1:
                arrive.sort(key=_first_of)
            return arrive
        items, canonical, firsts = calls.items, calls.canonical, calls._first
        for i, k in enumerate(positions):
            e = (rep, k)
            h = items.get(e) or canonical.get(e) or firsts.get(e) or calls.holder(e)
            if h is not None:
                arrive.append((i, h))
        return arrive

    def _walk(self, template: int, positions: tuple[int, ...]) -> list[tuple]:
        """The values from outside the run that the logged template nodes ``positions`` read,
        in :meth:`transpose`'s order (with repeats): ``("arg", j)`` placeholder ``j``,
        ``("pos", k)`` a tangent template node ``k`` not logged."""
        key = (template, positions)
        got = self._walks.get(key)
        if got is None:
            calls = self.calls
            nodes = calls.nodes[template]
            at = {x: i for i, x in enumerate(nodes)}
            ph = {x: j for j, x in enumerate(calls.phs[template])}
            inside = set(positions)
            got = []
            for i in positions:
                x = nodes[i]
                for a in _leaves((x.args, x.kwargs)):
                    if a in ph:
                        got.append(("arg", ph[a]))
                    elif a in at and at[a] not in inside and a.meta.get(KIND) == "tangent":
                        got.append(("pos", at[a]))
            self._walks[key] = got
        return got

    # -- the first call of a variant: the rules, recorded ---------------------------------------
    def _record(
        self,
        t: TemplateBackward,
        run: list[Node],
        externals: list[Node],
        ct: dict[Any, Any],
        rules: Callable[[list[Any]], None],
        state: Callable[[], tuple[int, int]],
    ) -> None:
        b, g = self.b, self.g
        before = state()
        tail = next(iter(reversed(g.nodes)))
        n_nodes = len(g.nodes)
        n_imported = len(b.imported)
        arrived = [ct.get(e) for e in run]
        held = [ct.get(x) for x in externals]
        self._rules(run, rules, None)
        try:
            if state() != before or any(e in ct for e in run):
                raise _NotReusable
            new_imports = list(
                itertools.islice(reversed(b.imported.items()), len(b.imported) - n_imported)
            )[::-1]
            nodes = _appended(tail)
            placed = sum(1 for _, gn in new_imports if gn.op == "placeholder")
            if len(g.nodes) - n_nodes != len(nodes) + placed:  # a node inserted further up
                raise _NotReusable
            position = {n: i for i, n in enumerate(nodes)}
            refs = _references(arrived, held)
            for ln, gn in new_imports:
                if gn.op == "placeholder":
                    refs.setdefault(gn, []).append(("new", len(t.residuals)))
                    t.residuals.append(ln)
                elif gn in position:
                    t.coefficients[position[gn]] = ln
                else:
                    raise _NotReusable
            self._inputs(t, nodes, position, refs)
            for i, x in enumerate(externals):
                v = ct.get(x)
                if v is held[i]:
                    t.results.append(None)
                elif v in position:
                    t.results.append(("node", position[v]))
                else:
                    t.results.append(_one(refs.get(v) if isinstance(v, Node) else None))
        except _NotReusable:
            t.reusable = False
            if self.recorder is not None:
                self._as_call(tail, n_nodes, n_imported, t.site)
            return
        t.nodes = nodes
        if self.recorder is not None:
            t.direct = self.recorder.template(nodes, t.site, self.root, t.inputs)
            exposed = set(t.coefficients)
            exposed.update(r[1] for r in t.results if r is not None and r[0] == "node")
            t.exposed = sorted(exposed)

    def _inputs(
        self,
        t: TemplateBackward,
        nodes: list[Node],
        position: dict[Node, int],
        refs: dict[Node, list[tuple]],
    ) -> None:
        """Fill ``t.inputs``: how each argument of ``nodes`` from outside them is found at
        another call (raises :class:`_NotReusable` where it cannot be)."""
        imported_as = {gn: ln for ln, gn in self.b.imported.items()}
        site_rel = self.rel[t.site]
        for n in nodes:
            if n.op != "call_function" or n.meta.get(MODULE) not in site_rel:
                raise _NotReusable
            src = n.meta.get(SOURCE)
            if src is not None and self.tag.get(src, (None,))[0] != t.site:
                raise _NotReusable
            for a in n.all_input_nodes:
                if a in position:
                    continue
                r = refs.get(a)
                if r is None and a in imported_as:
                    ln = imported_as[a]
                    if type(ln) is tuple:  # a recorded call's value imported by its key
                        ln = self.calls.value(*ln)
                    r = refs[a] = [("old", ln)]
                t.inputs[a] = _one(r)

    # -- another call of the variant: the template backward expanded ----------------------------
    def _correspondence(self, a: list[Node], b: Sequence[Any], sa: int, sb: int) -> dict | None:
        """The linearized graph's values at call ``sa`` that ``a``'s entries read, directly or
        through coefficients and primals of the call, mapped to the same values at call
        ``sb`` (read at the same places by ``b``'s entries); None where the two differ."""
        corr: dict[Node, Node] = {}
        back: dict[Node, Node] = {}
        stack: list[tuple[Any, Any]] = list(zip(a, b))
        while stack:
            x, y = stack.pop()
            if isinstance(x, Node):
                if not isinstance(y, Node):
                    return None
                prev = corr.get(x)
                if prev is not None:
                    if prev is not y:
                        return None
                    continue
                if back.get(y, x) is not x:
                    return None
                corr[x] = y
                back[y] = x
                ix, iy = self._inside(x, sa), self._inside(y, sb)
                if ix != iy:
                    return None
                if ix:
                    if x.target != y.target or len(x.args) != len(y.args):
                        return None
                    if x.kwargs.keys() != y.kwargs.keys():
                        return None
                    stack.extend(zip(x.args, y.args))
                    stack.extend((x.kwargs[k], y.kwargs[k]) for k in x.kwargs)
            elif isinstance(x, (list, tuple)):
                if not isinstance(y, (list, tuple)) or len(x) != len(y):
                    return None
                stack.extend(zip(x, y))
            else:
                try:
                    if type(x) is not type(y) or x != y:
                        return None
                except Exception:  # an uncomparable constant: do not reuse
                    return None
        return corr

    def _inside(self, n: Node, site: int) -> bool:
        """Whether linearized node ``n`` is work of call ``site`` (a copy of one of its forward
        nodes, or emitted for one)."""
        t = n.meta.get(CALL_SITE)
        if t is None:
            t = self.tag.get(n.meta.get(SOURCE, ""))
        return t is not None and t[0] == site and n.op != "placeholder"

    def _recompute_inputs(
        self, t: TemplateBackward, corr: dict[Node, Node] | None, site: int
    ) -> None:
        """Add to ``corr`` the residuals ``t``'s first call imported that no tangent reads,
        only its checkpoint's recompute (a bias: the recompute reruns its addmm), mapped by
        the forward graph: a forward node of the call to its copy at call ``site``, a value
        from outside the call to the one call ``site`` reads at the same argument. A recorded
        JVP's call (``corr`` a :class:`_Places`) returns at once: :func:`build_vjp
        <graphflop.ad.vjp.build_vjp>` transposes a checkpointed model's recorded JVP through
        its flat graph, so no recompute is emitted there."""
        cp = self.b.checkpoints
        if corr is None or cp is None or not cp.emitted:
            return
        assert type(corr) is dict  # a _Places cannot be added to (see above)
        lin = cp.lin
        for ln in t.residuals:
            if ln in corr:
                continue
            name = self._counterpart(ln.meta.get(SOURCE, ln.name), t.site, site)
            other = lin.get(name) if name is not None else None
            if other is not None:
                corr[ln] = other

    def _counterpart(self, name: str, sa: int, sb: int) -> str | None:
        """The forward node at call ``sb`` that forward node ``name`` is at call ``sa`` (None
        where there is none)."""
        t = self.tag.get(name)
        if t is not None:
            return self.name.get((sb, *t[1:])) if t[0] == sa else None
        nodes = self.__dict__.get("_fnodes")
        if nodes is None:
            nodes = self._fnodes = {n.name: n for n in self.forward.graph.nodes}
        f = nodes.get(name)
        if f is None:
            return None
        for u in f.users:  # read by a node of call sa: the same argument at call sb
            tu = self.tag.get(u.name)
            if tu is None or tu[0] != sa:
                continue
            v = nodes.get(self.name.get((sb, *tu[1:]), ""))
            if v is None:
                return None
            for x, y in zip(_leaves((u.args, u.kwargs)), _leaves((v.args, v.kwargs))):
                if x is f:
                    return y.name if isinstance(y, Node) else None
        return None

    def _fresh_match(self, t: TemplateBackward, corr: _Places) -> list[Any] | None:
        """For a call none of whose values a node stands for or was imported (``corr.fresh``),
        the keys of ``t``'s coefficients in ``corr`` where :meth:`_same_imports` would find
        the call's imports the same as ``t``'s first call's, read from the places planned once
        per template backward (no lookup per residual); None where it might not (asked
        again of :meth:`_same_imports`)."""
        checks = t.checks
        if checks is None:
            if t.olds is None:
                t.olds = [ref[1] for ref in t.inputs.values() if ref[0] == "old"]
            places = t.places or {}
            rp = [places.get(ln) for ln in t.residuals]
            cp = [places.get(ln) for ln in t.coefficients.values()]
            ok = not t.olds and None not in rp and None not in cp
            res = [r[1] for r in rp if r is not None and r[0] == "arg"]
            checks = t.checks = (ok, res, cp)
        ok, res, cp = checks
        if not ok:
            return None
        rep = corr.rep
        args: Any = rep.args[0]
        for j in res:
            if args[j] is None:
                return None
        its = self.calls.items_of(rep)
        imported = self.b.imported
        keys: list[Any] = []
        for p in cp:
            y = args[p[1]] if p[0] == "arg" else its.get(p[1]) or (rep, p[1])
            if y is None or y in imported:
                return None
            keys.append(y)
        return keys

    def _same_imports(self, t: TemplateBackward, corr: Any) -> bool:
        """Whether the call ``corr`` maps to has imported the same residuals and coefficients
        before its run as ``t``'s first call had. Where a recorded call's (:class:`_Places`)
        is not, the stand-ins the check reads are made (:meth:`_Places.made`), as where it read
        no key (:meth:`RecordedCalls.lookup`): the call's values made flat next are then read
        through them, as before keys stood for them."""
        if self._imports_match(t, corr, corr.get):
            return True
        made = getattr(corr, "made", None)
        if made is not None:
            self._imports_match(t, corr, made)
        return False

    def _imports_match(self, t: TemplateBackward, corr: Any, get: Callable[[Any], Any]) -> bool:
        imported = self.b.imported
        if t.olds is None:
            t.olds = [ref[1] for ref in t.inputs.values() if ref[0] == "old"]
        for ln in t.olds:
            if get(ln) not in imported:
                return False
        # a recorded call's map (:class:`_Places`) tells a residual it knows without making
        # its stand-in (made as the residual is imported); where the call is not expanded,
        # the stand-ins are made as if this check had made them
        known = getattr(corr, "known", None)
        if known is None or not all(known(ln) for ln in t.residuals):
            if any(get(ln) is None for ln in t.residuals):
                return False
            known = None
        for ln in t.coefficients.values():
            y = get(ln)
            if y is None or y in imported:
                if known is not None:
                    any(get(x) is None for x in t.residuals)
                return False
        return True

    def _results(
        self,
        t: TemplateBackward,
        externals: list[Node],
        ct: dict[Any, Any],
        corr: Any,
        resolve: Callable[[tuple], Any],
        made: Any,
        coefs: list[Any] | None = None,
    ) -> None:
        """After a call recorded for ``t`` (``made``: template node position -> its getitem),
        the coefficients it recomputed as the imports later calls reuse (``coefs``: their keys
        in ``corr``, where known), and the cotangents of its externals."""
        imported = self.b.imported
        if coefs is None:
            coefs = [corr[ln] for ln in t.coefficients.values()]
        for i, y in zip(t.coefficients, coefs):
            imported[y] = made[i]
        for x, r in zip(externals, t.results):
            if r is not None:
                ct[x] = resolve(r)
        self.expanded += 1

    def _expand(
        self,
        t: TemplateBackward,
        run: Sequence[Any],
        externals: list[Node],
        ct: dict[Any, Any],
        site: int,
        given: Any = None,
        arrive: list[tuple[int, Node]] | None = None,
    ) -> bool:
        """Copy ``t``'s nodes for call ``site``; False (nothing emitted) where the call's
        values do not map onto the template backward's (``given``: that map, when known
        without walking the call's nodes). The cotangents arriving are those of ``run``'s
        entries, or with ``arrive`` those of its ``(place in run, node)`` pairs (the other
        entries hold none)."""
        b = self.b
        corr = given if given is not None else self._correspondence(t.entries, run, t.site, site)
        self._recompute_inputs(t, corr, site)
        if corr is None:
            return False
        coefs = self._fresh_match(t, corr) if type(corr) is _Places and corr.fresh else None
        if coefs is None and not self._same_imports(t, corr):
            return False
        arrived = _arrived(run, arrive, ct)
        held = [ct.get(x) for x in externals]
        if type(corr) is _Places and corr.fresh:
            residuals = self._import_planned(t, corr)
        else:
            residuals = [b._import(corr[ln], "primal") for ln in t.residuals]

        def resolve(ref: tuple) -> Any:
            kind = ref[0]
            if kind == "in":
                v = arrived[ref[1]]
                return v if ref[2] is None else v[ref[2]]
            if kind == "prev":
                return held[ref[1]]
            if kind == "new":
                return residuals[ref[1]]
            if kind == "old":
                return b.imported[corr[ref[1]]]
            return made[ref[1]]

        made: Any = []
        if t.direct is not None:  # a call of the template derivative, its nodes not copied
            values = [resolve(ref) for ref in t.direct[1]]
            if t.bases is None:  # the names the copies below would ask fx for
                t.bases = NamePlan([base_name(self.g, n.target) for n in t.nodes])
            made = self.recorder.call(self.g, t.direct, site, values, t.exposed, t.bases)
            self._results(t, externals, ct, corr, resolve, made, coefs)
            return True
        env = {a: resolve(ref) for a, ref in t.inputs.items()}
        rel, absolute = self.rel[t.site], self.abs[site]
        for i, n in enumerate(t.nodes):
            src = n.meta.get(SOURCE)
            new = env[n] = _emit_copy(
                self.g,
                n,
                env,
                absolute[rel[n.meta[MODULE]]],
                None if src is None else self.name[(site,) + self.tag[src][1:]],
            )
            made.append(new)
            ln = t.coefficients.get(i)
            if ln is not None:
                b.imported[corr[ln]] = new
        _take_recompute(b, made)
        for x, r in zip(externals, t.results):
            if r is not None:
                ct[x] = resolve(r)
        self.expanded += 1
        return True

    def _import_planned(self, t: TemplateBackward, corr: _Places) -> list[Any]:
        """``[b._import(corr[ln], "primal") for ln in t.residuals]`` for a call none of whose
        values was made a node or imported before (``corr.fresh``), by a plan made once per
        template backward (:meth:`_plan_imports`): a residual at a position of the call's
        template is its placeholder made from the template node's residual annotations made
        the call's (:func:`graphflop.passes.calls.localized`), without the stand-in's key,
        annotations and lookups per residual; one the call reads from outside (an argument),
        or at a getitem of the call, is imported as before."""
        plan = t.imports
        if plan is None:
            plan = t.imports = self._plan_imports(t, corr.rep)
        b, calls, rep = self.b, corr.calls, corr.rep
        args: Any = rep.args[0]
        c = calls.dh.calls[rep.args[1]]
        absolute = calls._absolute(c)
        localized = calls.dh.localized
        its = calls.items_of(rep)
        imported, kinds, order = b.imported, b._kinds, b.residual_order
        g = self.g
        last = b._last_placeholder
        out: list[Any] = []
        with g.inserting_before(last.next):  # after the last placeholder, in order
            for p in plan:
                if p[0] == "arg":
                    out.append(b._import(args[p[1]], "primal"))
                    continue
                _, i, name, base, lp, other, _ln = p
                key = (rep, i)
                if i in its or key in imported:
                    out.append(b._import(corr[p[6]], "primal"))
                    continue
                m = localized(base, lp, c, absolute)
                src = m.get(SOURCE, name)
                rkind = kinds.get(src) or other
                m[RESIDUAL] = rkind
                ph = placeholder(g, src)
                if ph.meta:
                    ph.meta.update(m)
                else:
                    object.__setattr__(ph, "meta", m)
                b._last_placeholder = ph
                order.append((ph.name, src, rkind))
                imported[key] = ph
                out.append(ph)
        return out

    def _plan_imports(self, t: TemplateBackward, rep: Node) -> list[tuple]:
        """Per residual of ``t`` (a recorded JVP's: :attr:`TemplateBackward.places`),
        ``("arg", j)`` for the call's argument ``j``, or ``("pos", i, name, base, plan, kind,
        ln)`` for its template node ``i``: the stand-in's name, the residual annotations of the
        template node (:func:`residual_meta`, ``RESIDUAL`` last) and their
        :func:`~graphflop.passes.calls.localize_plan`, the residual kind where the source is
        no input's (``param_derived`` or ``activation``), the residual itself."""
        calls = self.calls
        places = t.places or {}
        plan: list[tuple] = []
        template: int | None = None
        for ln in t.residuals:
            r = places[ln]
            if r[0] == "arg":
                plan.append(r)
                continue
            if template is None:
                template = calls.template(rep)
            x = calls.nodes[template][r[1]]
            lp = calls._plans.get(x)
            if lp is None:
                lp = calls._plans[x] = calls.dh.localize_plan(x.meta)
            base = residual_meta(x.meta)
            base[RESIDUAL] = None
            other = "param_derived" if x.meta.get(PARAM_DERIVED) else "activation"
            plan.append(("pos", r[1], x.name, base, lp, other, ln))
        return plan


def _arrived(run: Sequence[Any], arrive: list[tuple[int, Node]] | None, ct: dict[Any, Any]) -> list:
    """The cotangents arrived at ``run``'s entries, taken out of ``ct`` (``arrive``: where
    given, the only entries that can hold one, each ``(place in run, node)``)."""
    if arrive is None:
        return [ct.pop(e, None) for e in run]
    arrived: list[Any] = [None] * len(run)
    for i, e in arrive:
        arrived[i] = ct.pop(e, None)
    return arrived


def _take_recompute(b: Any, made: list[Node]) -> None:
    """The recompute nodes among ``made`` (a call's template backward copied) taken as
    their checkpoint call's, as if the rules had emitted them."""
    if b.checkpoints is None:
        return
    for n in made:
        if n.meta.get(ROLE) == "recompute":
            b.checkpoints.emitted_copy(n)


@dataclass(frozen=True, eq=False)
class CallKeys:
    """Where a forward graph's nodes copied from a template are in their calls: worked out in
    one walk over the graph by :func:`call_keys`, shared by the JVP's and the backward's
    expanders and the derivative graphs' describers (:mod:`graphflop.passes.calls`); read,
    never written.

    Attributes:
        key: per such node, its key in its call: ``(template index,)``, or ``(template index,
            output)`` for a ``getitem`` tracing added afterwards.
        site_nodes: per call site, its nodes in graph order.
        by_key: per call site, key -> its node (the last, where two share a key).
        names: per such node's name, ``(site, key)``.
        tags: per such node's name, ``(site, *key)``; ``tag_names`` the inverse (the last
            name, where two share one).
        dup: the call sites where two nodes share a key (a rewritten graph).
        split: the call sites whose nodes are not one run of the graph.
    """

    key: dict[Node, tuple]
    site_nodes: dict[int, list[Node]]
    by_key: dict[int, dict[tuple, Node]]
    names: dict[str, tuple[int, tuple]]
    tags: dict[str, tuple]
    tag_names: dict[tuple, str]
    dup: frozenset[int]
    split: frozenset[int]


def _emit_copy(g: Graph, x: Node, env: dict, module: str, source: str | None) -> Node:
    """A copy of template node ``x`` emitted into ``g`` for a call: its arguments mapped by
    ``env``, a shallow copy of its ``meta`` with the call's ``MODULE`` and, where ``source`` is
    given, ``SOURCE`` (the meta set whole: assigning a node's attribute re-files it in fx's
    find_nodes table, as :func:`~graphflop.ad.builder.copy_node` avoids)."""
    new = emit(g, x.target, map_arg(x.args, env.__getitem__), map_arg(x.kwargs, env.__getitem__))
    meta = dict(x.meta)
    meta[MODULE] = module
    if source is not None:
        meta[SOURCE] = source
    object.__setattr__(new, "meta", meta)
    return new


def _on_graph(forward: GraphModule, attr: str, compute: Callable[[GraphModule], Any]) -> Any:
    """``compute(forward)``, worked out once per forward graph (and again where it has grown):
    kept on the graph itself, since the values name its nodes (a table beside the graphs would
    keep every graph alive; on the graph they are freed with it). Shared: read, never written."""
    g = forward.graph
    stamp = len(g.nodes)
    got = g.__dict__.get(attr)
    if got is not None and got[0] == stamp:
        return got[1]
    value = compute(forward)
    g.__dict__[attr] = (stamp, value)
    return value


#: the tables :func:`_on_graph` keeps on a forward graph (:func:`forget_tables`)
_TABLES = (
    "_graphflop_call_keys",
    "_graphflop_checkpointed_sites",
    "_graphflop_checkpoint_calls",
    "_graphflop_checkpointed",
    "_graphflop_call_plans",
    "_graphflop_has_leaves",
    "_graphflop_forward_runs",  # (memory_calls.forward_runs)
)


def checkpointed(forward: GraphModule) -> list[Node]:
    """The nodes of ``forward`` tagged :data:`~graphflop.meta.CHECKPOINT`, in graph order:
    looked for once per forward graph (:func:`checkpointed_sites`, :func:`checkpoint_calls`
    and the describers' :func:`~graphflop.passes.calls.forward_tags` read them, not the
    whole graph each). Shared: read, never written."""
    return _on_graph(
        forward,
        "_graphflop_checkpointed",
        lambda f: [n for n in f.graph.nodes if CHECKPOINT in n.meta],
    )


def on_graph(forward: GraphModule, attr: str, compute: Callable[[GraphModule], Any]) -> Any:
    """:func:`_on_graph` for the other modules of the derivative builders (``attr`` one of
    :data:`_TABLES`, so that :func:`forget_tables` drops it)."""
    assert attr in _TABLES, attr
    return _on_graph(forward, attr, compute)


def forget_tables(forward: GraphModule) -> None:
    """Drop the tables worked out once per forward graph here (:func:`call_keys` and the
    checkpoints'): a reader after that works them out again."""
    d = forward.graph.__dict__
    for attr in _TABLES:
        d.pop(attr, None)


def call_keys(forward: GraphModule) -> CallKeys:
    """:class:`CallKeys` of ``forward``, worked out once per forward graph."""
    return _on_graph(forward, "_graphflop_call_keys", _call_keys)


def _call_keys(forward: GraphModule) -> CallKeys:
    h = forward.meta.get(HIERARCHY)
    if h is not None and h.runs:
        got = _keys_by_call(forward, h)
        if got is not None:
            return got
    return _keys_by_node(forward)


def _keys_by_call(forward: GraphModule, h: Hierarchy) -> CallKeys | None:
    """:func:`call_keys` a call at a time: each call's nodes (one run of the graph: its
    hierarchy's ``runs``) are its variant's items, in order, so a call is found at its first
    node and its keys are its variant's (:attr:`~graphflop.meta.Hierarchy.variants`: made
    once per variant); its tables are filled from them in C, not node by node. None (read
    node by node instead) where a call's first or last node is not its variant's first or
    last item, or a call site comes twice."""
    key: dict[Node, tuple] = {}
    site_nodes: dict[int, list[Node]] = {}
    by_key: dict[int, dict[tuple, Node]] = {}
    names: dict[str, tuple[int, tuple]] = {}
    tags: dict[str, tuple] = {}
    tag_names: dict[tuple, str] = {}
    dup: set[int] = set()
    shared: dict[int, tuple] = {}  # one key per template position, shared by every call
    vkeys: dict[int, tuple[tuple, ...]] = {}
    sites = h.sites
    nodes = list(forward.graph.nodes)
    i, count = 0, len(nodes)
    while i < count:
        t = nodes[i].meta.get(CALL_SITE)
        if t is None:
            i += 1
            continue
        s = t[0]
        v = sites[s].variant
        ks = vkeys.get(v)
        if ks is None:
            ks = vkeys[v] = tuple(
                (shared.setdefault(x, (x,)) if out is None else (x, out))
                for x, out in h.variants[v][1]
            )
        m = len(ks)
        ns = nodes[i : i + m]
        if s in site_nodes or not m or len(ns) != m or _key_at(ns[0], s) != ks[0]:
            return None
        if _key_at(ns[-1], s) != ks[-1]:
            return None
        i += m
        site_nodes[s] = ns
        own = by_key[s] = dict(zip(ks, ns))
        if len(own) != m:  # two nodes copy one template node (a rewritten graph)
            dup.add(s)
        key.update(zip(ns, ks))
        call_names = list(map(_NAME, ns))
        names.update(zip(call_names, zip(itertools.repeat(s), ks)))
        call_tags = list(map(tuple.__add__, itertools.repeat((s,)), ks))
        tags.update(zip(call_names, call_tags))
        tag_names.update(zip(call_tags, call_names))
    return CallKeys(key, site_nodes, by_key, names, tags, tag_names, frozenset(dup), frozenset())


def _key_at(n: Node, site: int) -> tuple | None:
    """Forward node ``n``'s key in call ``site`` (:attr:`CallKeys.key`), None where it is not
    a node of that call."""
    t = n.meta.get(CALL_SITE)
    if t is None or t[0] != site:
        return None
    if n.target is operator.getitem:
        parent = n.args[0] if n.args else None
        if isinstance(parent, Node) and parent.meta.get(CALL_SITE) == t:
            return (t[1], n.args[1])
    return (t[1],)


def _keys_by_node(forward: GraphModule) -> CallKeys:
    """:func:`call_keys` in one walk over the graph's nodes."""
    key: dict[Node, tuple] = {}
    site_nodes: dict[int, list[Node]] = {}
    by_key: dict[int, dict[tuple, Node]] = {}
    names: dict[str, tuple[int, tuple]] = {}
    tags: dict[str, tuple] = {}
    tag_names: dict[tuple, str] = {}
    dup: set[int] = set()
    span: dict[int, list[int]] = {}  # per site: its first node's index, its count, its last
    # one key per template position, shared by every call (a tuple per node was one more
    # object per node for the collector's pass after the analysis: graphflop/_gc.py)
    keys: dict[int, tuple] = {}
    getitem = operator.getitem
    i = -1
    for n in forward.graph.nodes:
        i += 1
        t = n.meta.get(CALL_SITE)
        if t is None:
            continue
        s = t[0]
        ns = site_nodes.get(s)
        if ns is None:
            ns = site_nodes[s] = []
            by_key[s] = {}
            span[s] = [i, 0, i]
        at = span[s]
        at[1] += 1
        at[2] = i
        k: tuple | None = keys.get(t[1])
        if k is None:
            k = keys[t[1]] = (t[1],)
        tag: tuple = t
        if n.target is getitem:
            args = n.args
            parent = args[0] if args else None
            if isinstance(parent, Node) and parent.meta.get(CALL_SITE) == t:
                # a getitem tracing added afterwards: its parent's key and its output
                k = (t[1], args[1])
                tag = (s, t[1], args[1])
        own = by_key[s]
        if k in own:  # two nodes copy one template node (a rewritten graph)
            dup.add(s)
        own[k] = n
        key[n] = k
        ns.append(n)
        names[n.name] = (s, k)
        tags[n.name] = tag
        tag_names[tag] = n.name
    split = frozenset(s for s, (first, count, last) in span.items() if last - first + 1 != count)
    return CallKeys(key, site_nodes, by_key, names, tags, tag_names, frozenset(dup), split)


class CallPlans:
    """What every call of a variant reads of its forward nodes, by their place among the
    call's nodes (a call's nodes are its variant's items, in order: one key each,
    :func:`call_keys`), worked out at the variant's first call: calling it with a call site
    gives ``(reads, results, unread, count, items)``: ``(p, q, j)`` per placeholder read
    (node ``p``'s ``q``-th input is placeholder ``j``), in order; the places of the nodes
    that can be read outside the call (the template's results: its outputs and the values it
    writes into buffers; where the hierarchy has a top-level graph, no other node of a call
    is read outside it); the placeholders no node reads; how many placeholders; how many
    items. None where the call's nodes are not its variant's items.

    Args:
        forward: the traced forward graph.
        h: its hierarchy.
    """

    def __init__(self, forward: GraphModule, h: Hierarchy) -> None:
        self.h = h
        self.keys = call_keys(forward)  # shared: read only
        self._plans: dict[int, tuple] = {}
        self._template_reads: dict[int, tuple] = {}

    def __call__(self, site: int) -> tuple | None:
        v = self.h.sites[site].variant
        got = self._plans.get(v)
        ns = self.keys.site_nodes[site]
        if got is None:
            template, items = self.h.variants[v]
            reads, unread, count = self._reads(template)
            key = self.keys.key
            if len(items) != len(ns) or any(
                key[n] != ((i,) if o is None else (i, o)) for n, (i, o) in zip(ns, items)
            ):
                got = self._plans[v] = (None,)
            else:
                plan = [
                    (p, q, j)
                    for p, (index, out) in enumerate(items)
                    if out is None
                    for q, j in reads.get(index, ())
                ]
                tnodes = list(self.h.templates[template].nodes)
                results = _results(tnodes)
                outward = [
                    p
                    for p, (index, out) in enumerate(items)
                    if out is None and tnodes[index] in results
                ]
                got = self._plans[v] = (plan, outward, unread, count, len(items))
        if got[0] is None or got[4] != len(ns):
            return None
        return got

    def _reads(self, template: int) -> tuple[dict[int, list[tuple[int, int]]], list[int], int]:
        """Of forward template ``template`` (worked out once): per node (by index) that reads
        a placeholder, ``(q, j)`` for its ``q``-th input node being placeholder ``j``; the
        placeholders no node reads; how many placeholders it has."""
        got = self._template_reads.get(template)
        if got is None:
            tnodes = list(self.h.templates[template].nodes)
            phs = {t: i for i, t in enumerate(t for t in tnodes if t.op == "placeholder")}
            reads: dict[int, list[tuple[int, int]]] = {}
            for i, x in enumerate(tnodes):
                pairs = [(q, phs[a]) for q, a in enumerate(x.all_input_nodes) if a in phs]
                if pairs:
                    reads[i] = pairs
            unread = [j for t, j in phs.items() if not t.users]
            got = self._template_reads[template] = (reads, unread, len(phs))
        return got


def call_plans(forward: GraphModule) -> CallPlans | None:
    """:class:`CallPlans` of ``forward``, kept on the graph (the JVP's walk for the nodes it
    needs and its expander share it); None where it has no hierarchy with a top-level graph."""
    h = forward.meta.get(HIERARCHY)
    if h is None or h.graph is None:
        return None
    return _on_graph(forward, "_graphflop_call_plans", lambda f: CallPlans(f, h))


def checkpointed_sites(forward: GraphModule) -> dict[int, tuple]:
    """Per call site with checkpointed nodes, how: per such node, its place in the template,
    its region relative to the call's (numbered in order of first use) and whether the region
    reruns whole. Two calls of one template differ here when one runs under a checkpoint (a
    model checkpointing only some of its blocks): their derivatives differ (the recompute).
    Worked out once per forward graph (the JVP's expander and the backward's both read it):
    shared by every caller, read, never written."""
    return _on_graph(forward, "_graphflop_checkpointed_sites", _checkpointed_sites)


def _checkpointed_sites(forward: GraphModule) -> dict[int, tuple]:
    out: dict[int, list] = {}
    first: dict[int, dict[int, int]] = {}
    for n in checkpointed(forward):
        tag, cs = n.meta.get(CHECKPOINT), n.meta.get(CALL_SITE)
        if tag is None or cs is None:
            continue
        regions = first.setdefault(cs[0], {})
        rel = regions.setdefault(tag.region, len(regions))
        out.setdefault(cs[0], []).append((cs[1:], rel, tag.whole))
    return {s: tuple(v) for s, v in out.items()}


def checkpoint_calls(forward: GraphModule) -> dict[Node, int]:
    """``occurrences(forward.graph.nodes, CHECKPOINT)``: per node of a
    ``torch.utils.checkpoint`` call, the call's number (:func:`graphflop.meta.occurrences`);
    empty where the model checkpoints nothing. Worked out once per forward graph (the
    backward's expander and its checkpoints read it): shared, read, never written."""
    from graphflop.meta import occurrences

    return _on_graph(
        forward,
        "_graphflop_checkpoint_calls",
        lambda f: occurrences(f.graph.nodes, CHECKPOINT) if checkpointed(f) else {},
    )


def _checkpoints_across(forward: GraphModule) -> set[int]:
    """The call sites whose transpose the rules must build at every call for a
    ``torch.utils.checkpoint`` call: one whose nodes are not all one call site's (a checkpoint
    around several blocks, or around part of the top level too: its recompute is emitted at
    the first of its calls the backward reaches, in that call's run), and one whose recompute
    eager does not run as graphflop builds it (nested, or detached). A checkpoint inside a
    call, or around exactly one call, is recomputed within the call's run: its template
    backward holds the recompute, copied at every call with the call's own residuals."""
    sites: dict[int, set[Any]] = {}
    for n, c in checkpoint_calls(forward).items():
        t = n.meta[CHECKPOINT]
        cs = n.meta.get(CALL_SITE)
        sites.setdefault(c, set()).add(None if cs is None or t.unmodelled or t.detached else cs[0])
    unsafe: set[int] = set()
    for at in sites.values():
        if len(at) > 1 or None in at:
            unsafe.update(s for s in at if s is not None)
    return unsafe


class RecordedFallback(Exception):
    """The transpose of a recorded JVP needs a value of a call that its stand-in cannot give
    (a coefficient to recompute from a call's node not made): transpose the flat JVP
    instead."""


class RecordedCalls:
    """A recorded JVP hierarchy (:class:`graphflop.passes.calls.DerivedHierarchy` with its
    whole log) as the transpose reads it: per call's template node, the one node that stands
    for its value (the call's getitem where the top level reads it; else a node outside every
    graph with the template node's annotations made the call's, or the first call's node it
    replaced), and a call's nodes made flat aside where the rules must run on them. A value
    that a template backward expanded at a call imports (:class:`_Places`) is keyed by
    ``(repeat node, position)`` until a node must stand for it (:meth:`lookup`).

    Args:
        dh: the recorded JVP's hierarchy (``dh.log`` set).
    """

    def __init__(self, dh: Any) -> None:
        self.dh = dh
        self._localize = dh.localize
        repeat = self._repeat = torch.ops.graphflop.repeat.default
        #: (repeat node, position) -> its getitem
        self.items: dict[tuple[Node, int], Node] = {}
        #: per repeat node, position -> its getitem
        self._items_of: dict[Node, dict[int, Node]] = {}
        for n in dh.graph.graph.nodes:
            if n.target is operator.getitem and getattr(n.args[0], "target", None) is repeat:
                self.items[(n.args[0], n.args[1])] = n
                self._items_of.setdefault(n.args[0], {})[n.args[1]] = n
        self._first = {at: x for x, at in dh.moved.items()}
        self.nodes = [[x for x in t.graph.nodes if x.op == "call_function"] for t in dh.templates]
        self.phs = [[x for x in t.graph.nodes if x.op == "placeholder"] for t in dh.templates]
        self.canonical: dict[tuple[Node, int], Node] = {}
        #: the transpose's imports (its builder's ``imported``; keys as :meth:`lookup` gives)
        self.imported: dict[Any, Node] = {}
        #: stand-ins without arguments (a coefficient cannot be recomputed from them)
        self.thin: set[Node] = set()
        #: per repeat node made flat, its nodes in template order
        self.side: dict[Node, list[Node]] = {}
        #: repeat nodes made flat since the last :meth:`settle_all` (the rules may have filed
        #: cotangents on their nodes made flat)
        self.unsettled: dict[Node, None] = {}
        #: a flat-made node -> the node that stands for its value
        self.alias: dict[Node, Node] = {}
        self.scratch = Graph()
        self._paths: dict[Any, dict[str, str]] = {}
        #: per template node, its :func:`graphflop.passes.calls.localize_plan`
        self._plans: dict[Node, tuple] = {}
        #: the repeat nodes of calls some of whose values a node stands for (:attr:`canonical`,
        #: a first call's node) or the transpose imported by key (an expansion,
        #: :class:`_Places`): for any other call, a value's holder is its getitem or none
        self.touched: set[Node] = {at[0] for at in dh.moved.values()}
        #: those of them some of whose values a node stands for (:attr:`canonical`, a first
        #: call's node)
        self.standing: set[Node] = set(self.touched)

    def site(self, rep: Node) -> int:
        return self.dh.calls[rep.args[1]].site

    def items_of(self, rep: Node) -> dict[int, Node]:
        """Call ``rep``'s getitems at the top level, by position."""
        return self._items_of.get(rep, {})

    def _absolute(self, c: Any) -> dict[str, str]:
        """Call ``c``'s module paths, relative -> in the model (made once per call)."""
        got = self._paths.get(c)
        if got is None:
            got = self._paths[c] = dict(c.modules)
        return got

    def template(self, rep: Node) -> int:
        return self.dh.calls[rep.args[1]].template

    def value(self, rep: Node, i: int) -> Node:
        """The node standing for call ``rep``'s template node ``i``."""
        key = (rep, i)
        v = self.items.get(key) or self.canonical.get(key)
        if v is None:
            v = self._first.get(key)
            if v is None:
                name, meta = self.annotations(rep, i)
                # a stand-in only: made outside the scratch graph's node list and namespace
                # (fx's create_node names and files it: a third of the transpose's time per call)
                v = Node(self.scratch, name, "call_function", self.target(rep, i), (), NO_KWARGS)
                object.__setattr__(v, "meta", meta)
                self._rekey(key, v)
            self.thin.add(v)
            self.canonical[key] = v
            self.touched.add(rep)
            self.standing.add(rep)
        return v

    def target(self, rep: Node, i: int) -> Any:
        return self.nodes[self.dh.calls[rep.args[1]].template][i].target

    def annotations(self, rep: Node, i: int) -> tuple[str, dict]:
        """The name and annotations (a fresh dict) of the node that would stand for call
        ``rep``'s template node ``i`` (:meth:`value`)."""
        c = self.dh.calls[rep.args[1]]
        x = self.nodes[c.template][i]
        plan = self._plans.get(x)
        if plan is None:  # the template's annotations are not changed meanwhile
            plan = self._plans[x] = self.dh.localize_plan(x.meta)
        return x.name, self.dh.localized(x.meta, plan, c, self._absolute(c))

    def lookup(self, rep: Node, i: int) -> Any:
        """:meth:`value` of call ``rep``'s template node ``i`` where a node stands for it or is
        the first call's; else the key ``(rep, i)`` itself, without making a stand-in: the
        transpose's imports (``imported``) are keyed by it until one is made
        (:meth:`_rekey`). A template backward expanded at a call (:class:`_Places`) imports a
        call's residuals and coefficients by it: no node made per value (46 per GPT-2
        block)."""
        key = (rep, i)
        v = self.items.get(key) or self.canonical.get(key)
        if v is not None:
            return v
        if key in self._first:
            return self.value(rep, i)
        return key

    def _rekey(self, key: tuple[Node, int], v: Node) -> None:
        """The import keyed by ``key`` (:meth:`lookup`), if any, keyed by its stand-in ``v``
        now, in its place (the builders count a run's imports from the end of ``imported``).
        Only a later run of the same call reads a value imported by key as a node (its nodes
        made flat, :meth:`_Places.made`, :meth:`holder`): a call's run split in two, which no
        recorded JVP has today (a Function's entry or a ghost splits only calls the JVP built
        by the rules, whose values are first calls' nodes, :attr:`dh.moved`, never keys);
        ``test_value_imported_by_key_then_read_as_a_node`` forces it."""
        imported = self.imported
        if key in imported:
            items = list(imported.items())
            imported.clear()
            imported.update((v if type(k) is tuple and k == key else k, w) for k, w in items)

    def holder(self, key: tuple[Node, int]) -> Node | None:
        """The node that holds the cotangent of call ``key[0]``'s template node ``key[1]``:
        its getitem, else the node standing for it where one was made (:meth:`value`; a
        cotangent is keyed by a node that was read), else None (none can have arrived)."""
        v = self.items.get(key) or self.canonical.get(key) or self._first.get(key)
        if v is None and key in self.imported:  # imported by its key (:meth:`lookup`)
            v = self.value(*key)
        return v

    def canon(self, a: Node) -> Node:
        """The node standing for ``a``'s value (``a`` itself at the top level)."""
        v = self.alias.get(a)
        if v is not None:
            return v
        at = self.dh.moved.get(a)
        return self.value(*at) if at is not None else a

    def flat(self, rep: Node, run: list[tuple], ct: dict[Any, Any]) -> list[Node]:
        """The nodes of ``run``'s entries, call ``rep`` made flat aside (once; its arguments
        the top level's), the cotangents arrived at its getitems moved onto them."""
        made = self.side.get(rep)
        if made is None:
            c = self.dh.calls[rep.args[1]]
            absolute = dict(c.modules)
            args: Any = rep.args[0]
            env: dict[Node, Any] = dict(zip(self.phs[c.template], args))
            made = []
            for x in self.nodes[c.template]:
                new = copy_node(self.scratch, x, env.__getitem__)
                self._localize(new.meta, c, absolute)
                env[x] = new
                made.append(new)
            for i, new in enumerate(made):
                key = (rep, i)
                v = self.items.get(key) or self.canonical.get(key)
                if v is None and key in self.imported:  # imported by its key: its stand-in
                    v = self.value(rep, i)
                if v is None:
                    self.canonical[key] = new
                else:
                    self.alias[new] = v
            self.touched.add(rep)
            self.standing.add(rep)
            self.side[rep] = made
        self.unsettled[rep] = None
        for i in range(len(made)):
            item = self.holder((rep, i))
            if item is not None and item is not made[i] and item in ct:
                ct[made[i]] = ct.pop(item)
        return [made[i] for _, i in run]

    def settle(self, rep: Node, ct: dict[Any, Any]) -> None:
        """Move the cotangents that the rules filed on call ``rep``'s nodes made flat
        (:meth:`flat`) onto the nodes that hold them (:meth:`holder`), where a later run of
        the call (:meth:`BlockTranspose.transpose_call`: a call whose run a custom
        Function's entry or a ghost splits) and a Function's entry read them. Raises
        :class:`RecordedFallback` where both hold one."""
        made = self.side.get(rep)
        for i, x in enumerate(made or ()):
            if x not in ct:
                continue
            v = self.holder((rep, i))
            if v is None or v is x:
                continue
            if v in ct:
                raise RecordedFallback(x.name)
            ct[v] = ct.pop(x)

    def settle_all(self, ct: dict[Any, Any]) -> None:
        """:meth:`settle` every call made flat since the last time: before a ghost's entry,
        which reads the cotangent of each real tangent it was dropped into
        (:class:`graphflop.ad.vjp._GhostTerms`) at the node that holds it (a call's run that
        the ghost splits, ``x + fc(x) * mask`` with a frozen ``mask``, filed it on the node made
        flat: the ghost work was not credited at the call transposed first)."""
        for rep in self.unsettled:
            self.settle(rep, ct)
        self.unsettled.clear()

    def function_entry(self, e: FunctionEntry, ct: dict[Any, Any]) -> FunctionEntry:
        """A custom Function's log entry ``e`` as the transpose reads it: each tangent and
        saved value the node standing for it (:meth:`canon`: ``e`` names a first call's
        nodes, which :meth:`~graphflop.passes.calls.DirectRecorder.finish` erased), the
        cotangents of the calls it reads settled on those nodes (:meth:`settle`)."""
        for x in (*e.inputs, *e.outputs):
            at = self._at(x) if isinstance(x, Node) else None
            if at is not None:
                self.value(*at)  # its holder made, where none is yet
                self.settle(at[0], ct)

        def node(x: Any) -> Any:
            return self.canon(x) if isinstance(x, Node) else x

        return replace(
            e,
            inputs=tuple(node(x) for x in e.inputs),
            outputs=tuple(node(x) for x in e.outputs),
            saved={j: node(x) for j, x in e.saved.items()},
        )

    def _at(self, x: Node) -> tuple[Node, int] | None:
        """``(repeat node, position)`` of the call's node ``x`` stands for, or None (a top
        level node)."""
        at = self.dh.moved.get(x)
        if at is not None:
            return at
        args: Any = x.args
        if x.target is operator.getitem and getattr(args[0], "target", None) is self._repeat:
            return args[0], args[1]
        return None


class _Places:
    """A first call's values (``places``: value -> ``("arg", j)`` or ``("pos", i)``) mapped to
    call ``rep``'s: the correspondence :meth:`BlockTranspose._expand` reads."""

    def __init__(self, places: dict[Node, tuple], calls: RecordedCalls, rep: Node) -> None:
        self.places, self.calls, self.rep = places, calls, rep
        #: whether no value of the call was made a node or imported before (its values are
        #: imported by key from here on: :attr:`RecordedCalls.touched`)
        self._fresh = rep not in calls.touched
        calls.touched.add(rep)

    @property
    def fresh(self) -> bool:
        """Whether no value of the call was made a node or imported before this map was made,
        nor a node made to stand for one since (:attr:`RecordedCalls.standing`)."""
        return self._fresh and self.rep not in self.calls.standing

    def known(self, x: Any) -> bool:
        """Whether :meth:`get` of ``x`` is not None (without making a stand-in)."""
        r = self.places.get(x)
        if r is None:
            return False
        return r[0] != "arg" or self.rep.args[0][r[1]] is not None  # type: ignore[index]

    def made(self, x: Any) -> Any:
        """:meth:`get`, a stand-in made where no node stands for the value
        (:meth:`RecordedCalls.value`)."""
        r = self.places.get(x)
        if r is None:
            return None
        if r[0] == "arg":
            return self.rep.args[0][r[1]]  # type: ignore[index]
        return self.calls.value(self.rep, r[1])

    def get(self, x: Any, default: Any = None) -> Any:
        r = self.places.get(x)
        if r is None:
            return default
        if r[0] == "arg":
            return self.rep.args[0][r[1]]  # type: ignore[index]
        return self.calls.lookup(self.rep, r[1])

    def __getitem__(self, x: Any) -> Any:
        v = self.get(x)
        if v is None:
            raise KeyError(x)
        return v


def transpose_log(
    forward: GraphModule,
    b: Any,
    log: list[Any],
    ct: dict[Any, Any],
    rules: Callable[[list[Any]], None],
    linked: Callable[[Any], bool],
    state: Callable[[], tuple[int, int]],
) -> BlockTranspose | None:
    """Transpose the JVP log's entries ``log`` (in the order transposed) into ``b``'s graph:
    each call site's run through :meth:`BlockTranspose.transpose`, every other entry (and a
    run with an entry ``linked`` to ghost terms) by ``rules``. With ``b.calls`` (a recorded
    JVP's :class:`RecordedCalls`; ``log`` its hierarchy's whole log) a call's run of
    ``(repeat node, position)`` entries goes through :meth:`BlockTranspose.transpose_call`.
    Returns the expander (None for a forward graph without call sites)."""
    blocks = BlockTranspose.of(forward, b)
    calls: RecordedCalls | None = getattr(b, "calls", None)
    if blocks is None:
        assert calls is None
        rules(log)
        return None
    if calls is not None:
        blocks.read_calls(calls)
        if hasattr(
            log, "_parts"
        ):  # the hierarchy's log itself (a CallLog): its calls' runs kept whole
            log = _reversed_runs(log, blocks)
    i = 0
    #: per repeat node, the positions of its getitems ``linked`` to ghost terms
    linked_at: dict[Node, set[int]] = {}
    while i < len(log):
        e = log[i]
        if type(e) is CallRun:  # one call's whole run, no other entry of its call site beside
            assert calls is not None
            _transpose_run(blocks, calls, e, ct, rules, state, linked, linked_at)
            i += 1
            continue
        j = blocks.run(log, i)
        if calls is not None and j > i and _one_call(log, i, j):
            # the entries of one call: each (its repeat node, position), one pass over them
            rep = log[i][0]
            at = linked_at.get(rep)
            if at is None:
                at = linked_at[rep] = {k for k, item in calls.items_of(rep).items() if linked(item)}
            run = log[i:j]
            if at and any(e[1] in at for e in run):  # ghost terms to credit: the rules
                rules(calls.flat(rep, run, ct))
            else:
                blocks.transpose_call(run, ct, rules, state)
            i = j
            continue
        if j == i:
            e = log[i]
            if calls is not None and isinstance(e, FunctionEntry):
                e = calls.function_entry(e, ct)  # read from the calls' nodes
            elif calls is not None and is_ghost(e):
                calls.settle_all(ct)  # the cotangents it is credited with, where it reads them
            rules([e])
            i += 1
            continue
        run = log[i:j]
        whole = calls is not None and all(isinstance(e, tuple) for e in run)
        if calls is not None and not whole and any(isinstance(e, tuple) for e in run):
            run = [calls.flat(e[0], [e], ct)[0] if isinstance(e, tuple) else e for e in run]
        if any(linked(calls.items.get(e) if whole else e) for e in run):  # type: ignore[union-attr]
            # ghost terms to credit: the rules
            rules(calls.flat(run[0][0], run, ct) if whole else run)  # type: ignore[union-attr]
        elif whole:
            blocks.transpose_call(run, ct, rules, state)
        else:
            blocks.transpose(run, ct, rules, state)
        i = j
    return blocks


class CallRun:
    """A call's run of a recorded JVP's log (:class:`graphflop.passes.calls.CallLog`):
    ``(rep, k)`` for each ``k`` of ``positions`` (its template's logged positions, in forward
    order, shared by the template's calls). In the log :func:`transpose_log` reads (in the
    order transposed), a run that no entry of the same call site adjoins is kept whole: taken
    as one run (:meth:`BlockTranspose.call_run`) without making its entries."""

    __slots__ = ("positions", "rep")

    def __init__(self, rep: Node, positions: Sequence[int]) -> None:
        self.rep, self.positions = rep, positions


def _transpose_run(
    blocks: BlockTranspose,
    calls: RecordedCalls,
    e: CallRun,
    ct: dict[Any, Any],
    rules: Callable[[list[Any]], None],
    state: Callable[[], tuple[int, int]],
    linked: Callable[[Any], bool],
    linked_at: dict[Node, set[int]],
) -> None:
    """Transpose call run ``e`` as :func:`transpose_log` transposes a call's entries: by the
    rules where one of its getitems is ``linked`` to ghost terms, else by
    :meth:`BlockTranspose.call_run`."""
    rep = e.rep
    at = linked_at.get(rep)
    if at is None:
        at = linked_at[rep] = {k for k, item in calls.items_of(rep).items() if linked(item)}
    if at and not at.isdisjoint(e.positions):  # ghost terms to credit: the rules
        rules(calls.flat(rep, [(rep, k) for k in reversed(e.positions)], ct))
    else:
        blocks.call_run(rep, e.positions, ct, rules, state)


def _reversed_runs(log: Any, blocks: BlockTranspose) -> list[Any]:
    """A recorded JVP's whole log (a :class:`graphflop.passes.calls.CallLog`) in the order
    transposed, each call's run that no entry of its call site adjoins one
    :class:`CallRun`, every other entry as the log reads."""
    parts = log._parts[::-1]
    calls = blocks.calls
    out: list[Any] = []
    end = len(parts)
    for at, p in enumerate(parts):
        if type(p) is not CallRun:
            out.append(p)
            continue
        rep = p.rep
        s = calls.site(rep)
        prev = out[-1] if out else None
        before = calls.site(prev.rep) if type(prev) is CallRun else blocks.site_of(prev)
        after = None
        if at + 1 < end:
            q = parts[at + 1]
            after = calls.site(q.rep) if type(q) is CallRun else blocks.site_of(q)
        if before != s and after != s:
            out.append(p)
        else:
            out.extend([(rep, k) for k in reversed(p.positions)])
    return out


def _value(r: Any, made: Any, lin: Any, args: list[Node]) -> Any:
    """The value a template JVP's reference ``r`` stands for at a call (``made``: the call's
    nodes or getitems by position; ``args``: its arguments): None, a node made, a list or
    tuple of them, or an argument's primal (``("p", j)``) or tangent. A function of its own,
    not a closure of ``_expand``: a recursive closure is a cycle, left with what it holds
    (the call's nodes) for the collector's pass after the analysis."""
    if r is None:
        return None
    if isinstance(r, int):
        return made[r]
    if isinstance(r, list):
        return [_value(x, made, lin, args) for x in r]
    if isinstance(r, tuple) and r and isinstance(r[0], str):
        return lin.env[args[r[1]]] if r[0] == "p" else lin.tan[args[r[1]]]
    return tuple(_value(x, made, lin, args) for x in r)


def _one_call(log: list[Any], i: int, j: int) -> bool:
    """Whether ``log[i:j]`` are all entries ``(repeat node, position)`` of one repeat node."""
    rep = log[i][0] if isinstance(log[i], tuple) else None
    if rep is None:
        return False
    for k in range(i + 1, j):
        e = log[k]
        if not isinstance(e, tuple) or e[0] is not rep:
            return False
    return True


def _ref(v: Any, position: dict[Node, int], refs: dict[Any, tuple]) -> Any:
    """How a call's value ``v`` (a node, a list or tuple of them, or None) is found at
    another call: a position among the nodes made, an input reference (:class:`_NotReusable`
    for anything else: a ghost)."""
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        return type(v)(_ref(x, position, refs) for x in v)
    if isinstance(v, Node):
        if v in position:
            return position[v]
        if v in refs:
            return refs[v]
    raise _NotReusable


@dataclass(eq=False)
class TemplateJvp:
    """The JVP nodes of one call of a template (a variant: which of its inputs carry tangents,
    and of what kind, and which of its nodes' tangents are needed), as the rules built them
    at its first call (``site``).

    Attributes:
        site: the call site it was built at.
        nodes: per node emitted for the call, in order: ``("copy", key, node)`` the copy of
            the call's forward node ``key`` (template index[, getitem output]; ``node`` the
            first call's copy) or ``("emit", node)`` a tangent or coefficient node to copy.
        inputs: per emitted node's argument from outside the call, ``("p", j)`` the primal or
            ``("t", j)`` the tangent of the call's input ``j``.
        env, tan: per forward node of the call (by key), its primal copy and tangent: a
            position in :attr:`nodes`, an ``inputs``-style reference, a list of these, or None.
        log: positions in :attr:`nodes` of the tangent nodes logged, in order.
        reusable: False where expanding could differ from the rules.
    """

    site: int
    nodes: list[tuple] = field(default_factory=list)
    inputs: dict[Node, tuple] = field(default_factory=dict)
    env: dict[tuple, Any] = field(default_factory=dict)
    tan: dict[tuple, Any] = field(default_factory=dict)
    log: list[int] = field(default_factory=list)
    reusable: bool = True
    #: with a recorder (:class:`graphflop.passes.calls.DirectRecorder`): its handle; per node,
    #: the base of the name fx gives its copy (None for a primal copy, named after its forward
    #: node: ``copies``, its key each, in order), as a plan taking a call's names
    direct: tuple | None = None
    bases: NamePlan | None = None
    copies: list[tuple] = field(default_factory=list)
    #: with :attr:`direct`: the places among the call's forward nodes of ``copies`` and of
    #: its template derivative's source slots (:func:`_copy_names`)
    at: tuple[list[int], list[int]] = ([], [])


def _copy_names(t: TemplateJvp, ns: list[Node], g: Graph) -> tuple[NamePlan, list[str], tuple]:
    """The names that copying ``t``'s nodes for the call whose forward nodes are ``ns`` (its
    variant's items, in order) would ask fx for, in order: a primal copy its forward node's,
    another its op's base name (the plan's; the copies' names given, in order); and the call's
    forward node names per source slot of ``t``'s template derivative
    (:attr:`~graphflop.passes.calls.DerivedCall.sources`). Both read off the call's node names
    by the places worked out at the template's first call (:attr:`TemplateJvp.at`)."""
    if t.bases is None:
        t.bases = NamePlan([None if e[0] == "copy" else base_name(g, e[1].target) for e in t.nodes])
        t.copies = [e[1] for e in t.nodes if e[0] == "copy"]
    names = list(map(_NAME, ns))
    copy_at, source_at = t.at
    return t.bases, _gather(names, copy_at), tuple(_gather(names, source_at))


_NAME = operator.attrgetter("name")


def _gather(values: list[Any], at: list[int]) -> list[Any]:
    """``[values[i] for i in at]``, gathered in C."""
    if len(at) > 1:
        return list(operator.itemgetter(*at)(values))
    return [values[i] for i in at]


def _results(tnodes: list[Node]) -> set[Node]:
    """The nodes of a template (its nodes, in order) that a call of it returns, as
    :func:`graphflop.frontend.hierarchy.build` reads them: those its output returns and the
    values it writes into buffers (a ``copy_`` into a placeholder)."""
    found: set[Node] = set()
    map_arg(tnodes[-1].args, found.add)
    found.update(
        x.args[1]  # type: ignore[misc]
        for x in tnodes
        if x.target is _COPY_ and isinstance(x.args[0], Node) and x.args[0].op == "placeholder"
    )
    return found


_COPY_ = torch.ops.aten.copy_.default


def _positions(r: Any, out: set[int]) -> None:
    """Add to ``out`` the positions among a call's nodes that reference ``r`` names."""
    if isinstance(r, int):
        out.add(r)
    elif isinstance(r, (list, tuple)) and not (r and isinstance(r[0], str)):
        for x in r:
            _positions(x, out)


@dataclass(frozen=True)
class _Unread:
    """A call's argument that its template never reads (its ``j``-th placeholder has no
    user): no primal copy, no tangent, nothing a rule reads."""

    j: int


class BlockLinearize:
    """Per call site of ``forward``'s hierarchy, its JVP nodes, built by the rules once per
    variant (the template, its inputs' :meth:`_arg_state`, the tangents needed) and expanded
    at the other calls (the JVP graph is the same node for node).

    Args:
        forward: the traced forward graph (with :data:`~graphflop.meta.HIERARCHY`).
        lin: the linearizer (:class:`graphflop.ad.jvp._Linearizer`) building the JVP graph.
    """

    def __init__(self, forward: GraphModule, lin: Any) -> None:
        self.lin = lin
        h: Hierarchy = forward.meta[HIERARCHY]
        self.h = h
        keys = call_keys(forward)  # shared: read only
        self.key: dict[Node, tuple] = keys.key
        self.site_nodes: dict[int, list[Node]] = keys.site_nodes
        # two nodes copy one template node (a rewritten graph)
        self.unsafe: set[int] = set(keys.dup)
        # a custom Function's node, or a leaf's (its tangent is its own input): the rules
        for n in itertools.chain(lin.calls, getattr(lin, "leaf_tan", ())):
            if n in keys.key:
                self.unsafe.add(n.meta[CALL_SITE][0])
        # a call whose nodes are not one run of the forward: node by node, in place
        self.split = keys.split
        self.rel = [{a: r for r, a in s.modules} for s in h.sites]
        self.abs = [dict(s.modules) for s in h.sites]
        # one module under two relative paths: a path cannot be mapped back, the rules run
        self.unsafe.update(i for i, s in enumerate(h.sites) if len(self.rel[i]) != len(s.modules))
        self.by_key = keys.by_key
        self.checkpointed = checkpointed_sites(forward)  # a checkpointed call: its own variant
        self.templates: dict[tuple, TemplateJvp] = {}
        self.built = 0
        self.expanded = 0
        #: records each expanded call as a call instead of copying its nodes (or None)
        self.recorder: Any = getattr(lin, "recorder", None)
        self._plans = call_plans(forward) or CallPlans(forward, h)
        self._exposed: dict[tuple, tuple[list[int], list[int]]] = {}

    @classmethod
    def of(cls, forward: GraphModule, lin: Any) -> BlockLinearize | None:
        """The expander for ``forward``, or None when it has no call sites."""
        h = forward.meta.get(HIERARCHY)
        if h is None or h.graph is None:
            return None
        return cls(forward, lin)

    def nodes(self, n: Node) -> list[Node] | None:
        """The forward nodes of the call ``n`` begins (None where ``n`` begins none)."""
        t = n.meta.get(CALL_SITE)
        if t is None:
            return None
        ns = self.site_nodes.get(t[0])
        return ns if ns and ns[0] is n and t[0] not in self.split else None

    def _inputs(self, site: int) -> list[Any]:
        """The call's arguments (the forward nodes its template's placeholders stand for; an
        :class:`_Unread` for a placeholder no template node reads, as a Llama decoder layer's
        position ids: the rules read nothing of it): per input node of its variant's nodes that
        read a placeholder (:meth:`_plan`, in the call's node order), the first from outside
        the call; none where a placeholder read has no such node."""
        plan = self._plan(site)
        if plan is None:
            return []
        reads, unread, count = plan[0], plan[2], plan[3]
        args: dict[int, Any] = {}
        ns = self.site_nodes[site]
        for p, q, j in reads:  # its node p's q-th input is placeholder j's value
            if j in args:
                continue
            ins = ns[p].all_input_nodes
            if q < len(ins):
                a = ins[q]
                cs = a.meta.get(CALL_SITE)  # a node of the call is tagged with its site
                if cs is None or cs[0] != site:
                    args[j] = a
        for j in unread:
            args.setdefault(j, _Unread(j))
        return [args[j] for j in sorted(args)] if len(args) == count else []

    def _plan(self, site: int) -> tuple | None:
        """:class:`CallPlans` of call ``site`` (None: its nodes are not its variant's)."""
        return self._plans(site)

    def _arg_state(self, site: int, a: Node) -> Any:
        """A call input as a signature: what the rules read of it. Its value's
        ``PARAM_DERIVED`` (the call's forward nodes' follow from its inputs', and with them the
        ``PARAM_DERIVED`` and roles of the tangent work: latents, an ``nn.Parameter``, run
        through a block also run on activations), then its tangent's: None, ``False`` (a
        ghost or a multi-output tangent: the rules), or what the rules read of it."""
        pd = isinstance(a, Node) and bool(a.meta.get(PARAM_DERIVED, False))
        t = self.lin.tan.get(a)
        if t is None:
            return pd, None
        if not isinstance(t, Node):
            return False  # a ghost or a multi-output tangent: the rules
        m = t.meta
        where = self.rel[site].get(m.get(MODULE, ""), "outside")
        kind = (t.op == "placeholder", m.get(PARAM_DERIVED), m.get(ROLE), m.get(KIND), where)
        return (pd, *kind, _layout(t))

    def linearize(self, site: int, needed: set[Node], rules: Callable[[Node], None]) -> None:
        """Emit the JVP nodes of call ``site``'s forward nodes: its variant's template JVP
        expanded, or ``rules(n)`` per node (recording the template JVP at a variant's first
        call)."""
        ns = self.site_nodes[site]
        args = self._inputs(site)
        states = tuple(self._arg_state(site, a) for a in args)
        if site in self.unsafe or not args or False in states or len(set(args)) != len(args):
            return self._rules(ns, rules, site)
        key = (
            self.h.sites[site].variant,
            self.checkpointed.get(site),
            states,
            tuple(map(needed.__contains__, ns)),  # (in C: a generator's frame per node)
        )
        t = self.templates.get(key)
        if t is None:
            t = self.templates[key] = TemplateJvp(site)
            return self._record(t, ns, args, rules)
        if not t.reusable:
            return self._rules(ns, rules, site)
        self._expand(t, site, args)

    def _rules(
        self, ns: list[Node], rules: Callable[[Node], None], site: int | None = None
    ) -> None:
        """Run the rules on the call's forward nodes ``ns``; with a recorder and the call site
        ``site``, make the nodes they appended a call where they are one unbroken run."""
        self.built += 1
        if site is None or self.recorder is None:
            for n in ns:
                rules(n)
            return
        g: Graph = self.lin.graph
        tail = next(iter(reversed(g.nodes)))
        n_nodes = len(g.nodes)
        for n in ns:
            rules(n)
        made = _appended(tail)
        if made and len(g.nodes) - n_nodes == len(made):
            self.recorder.template(made, site, self.lin.forward, None)

    def _state(self) -> tuple[int, ...]:
        lin = self.lin
        return (len(lin.ghosts), len(lin.gaps), len(lin.b.ghost_links), len(lin.opaque))

    def _record(
        self, t: TemplateJvp, ns: list[Node], args: list[Node], rules: Callable[[Node], None]
    ) -> None:
        lin = self.lin
        g: Graph = lin.graph
        before = self._state()
        tail = next(iter(reversed(g.nodes)))
        n_nodes = len(g.nodes)
        n_log = len(lin.b.log)
        self._rules(ns, rules)
        try:
            made = _appended(tail)
            if self._state() != before or len(g.nodes) - n_nodes != len(made):
                raise _NotReusable
            self._fill(t, ns, args, made, n_log)
        except _NotReusable:
            t.reusable = False
            if self.recorder is not None and made and len(g.nodes) - n_nodes == len(made):
                self.recorder.template(made, t.site, lin.forward, None)
            return
        if self.recorder is not None:
            t.direct = self.recorder.template(made, t.site, lin.forward, self._input_refs(args))
            if t.direct is not None:  # a key's place among the call's nodes
                at = {k: p for p, k in enumerate(self.by_key[t.site])}
                copies = [e[1] for e in t.nodes if e[0] == "copy"]
                t.at = ([at[k] for k in copies], [at[k] for k in t.direct[2]])

    def _outward(self, t: TemplateJvp, site: int) -> tuple[list[tuple], list[int], list[int]]:
        """The keys of call ``site``'s forward nodes read outside it (their primal copies and
        tangents are what later nodes read of the call), the positions of ``t``'s nodes
        those values are (the call's getitems, ascending), and those of them logged, in the
        log's order."""
        plan = self._plan(site)
        if plan is None:  # (not expanded: BlockLinearize.linearize read no arguments)
            raise AssertionError("an expanded call whose nodes are not its variant's")
        ns = self.site_nodes[site]
        key = self.key
        keys = []
        for p in plan[1]:  # the template's results: what can be read outside the call
            n = ns[p]
            for u in n.users:  # a node of the call is tagged with its site
                cs = u.meta.get(CALL_SITE)
                if cs is None or cs[0] != site:
                    keys.append(key[n])
                    break
        cache = (id(t), tuple(keys))
        got = self._exposed.get(cache)
        if got is None:
            exposed: set[int] = set()
            for k in keys:
                _positions(t.env.get(k), exposed)
                _positions(t.tan.get(k), exposed)
            got = self._exposed[cache] = (sorted(exposed), [i for i in t.log if i in exposed])
        return keys, got[0], got[1]

    def _input_refs(self, args: list[Node]) -> dict[Any, tuple]:
        """Per JVP value of the call's inputs, ``("p", j)`` (input ``j``'s primal copy) or
        ``("t", j)`` (its tangent); :class:`_NotReusable` where one value is two of these."""
        lin = self.lin
        refs: dict[Any, tuple] = {}
        for j, a in enumerate(args):
            for kind, v in (("p", lin.env.get(a)), ("t", lin.tan.get(a))):
                if isinstance(v, Node):
                    if v in refs:
                        raise _NotReusable
                    refs[v] = (kind, j)
        return refs

    def _fill(
        self, t: TemplateJvp, ns: list[Node], args: list[Node], made: list[Node], n_log: int
    ) -> None:
        """Record in ``t`` the nodes ``made`` for call ``t.site`` (raises
        :class:`_NotReusable` where another call could not reuse them)."""
        lin = self.lin
        position = {n: i for i, n in enumerate(made)}
        refs = self._input_refs(args)
        copies = {lin.env[n]: self.key[n] for n in ns if n in lin.env}
        site_rel = self.rel[t.site]
        names = {n.name for n in ns}
        for n in made:
            if n in copies:
                t.nodes.append(("copy", copies[n], n))
                continue
            if n.meta.get(MODULE) not in site_rel or n.meta.get(SOURCE) not in names:
                raise _NotReusable
            t.nodes.append(("emit", n))
            for a in n.all_input_nodes:
                if a not in position:
                    t.inputs[a] = _one([refs[a]] if a in refs else None)

        for n in ns:
            k = self.key[n]
            t.env[k] = _ref(lin.env.get(n), position, refs)
            t.tan[k] = _ref(lin.tan.get(n), position, refs)
        for e in lin.b.log[n_log:]:
            if e not in position:
                raise _NotReusable
            t.log.append(position[e])

    def _expand(self, t: TemplateJvp, site: int, args: list[Node]) -> None:
        lin = self.lin
        own = self.by_key[site]
        fwd_env = lin.env
        keys: Any = own
        if t.direct is not None:  # a call of the template derivative, its nodes not copied
            values = [lin.env[args[j]] if k == "p" else lin.tan[args[j]] for k, j in t.direct[1]]
            keys, exposed, logged = self._outward(t, site)
            plan, given, sources = _copy_names(t, self.site_nodes[site], lin.graph)
            mark = (len(lin.b.log), t.log)
            made: Any = self.recorder.call(
                lin.graph, t.direct, site, values, exposed, plan, given, mark, sources
            )
        else:
            made = self._copy(t, site, args)
            logged = t.log

        for k in keys:  # with a recorder, only what is read after the call
            n = own[k]
            e, tv = t.env.get(k), t.tan.get(k)
            if e is not None:
                fwd_env[n] = _value(e, made, lin, args)
            if tv is not None:
                lin.tan[n] = _value(tv, made, lin, args)
        lin.b.log.extend(made[i] for i in logged)  # with a recorder, the getitems logged
        self.expanded += 1

    def _copy(self, t: TemplateJvp, site: int, args: list[Node]) -> list[Node]:
        """Copy ``t``'s nodes for call ``site`` (its inputs ``args``) into the JVP graph; the
        copies, in order."""
        lin = self.lin
        g: Graph = lin.graph
        env: dict[Node, Any] = {}
        for a, (kind, j) in t.inputs.items():  # the copies' arguments from outside the call
            env[a] = lin.env[args[j]] if kind == "p" else lin.tan[args[j]]
        own = self.by_key[site]
        rel, absolute = self.rel[t.site], self.abs[site]
        made: list[Node] = []
        fwd_env = lin.env
        for kind, x, *first in t.nodes:
            if kind == "copy":
                new = copy_node(g, own[x], fwd_env.__getitem__)
                fwd_env[own[x]] = new
                env[first[0]] = new
            else:
                src = x.meta.get(SOURCE)
                new = env[x] = _emit_copy(
                    g,
                    x,
                    env,
                    absolute[rel[x.meta[MODULE]]],
                    None if src is None else self._source(t.site, site, src),
                )
            made.append(new)
        return made

    def _source(self, a: int, b: int, name: str) -> str:
        """The name at call ``b`` of call ``a``'s forward node ``name``."""
        names = self.__dict__.setdefault("_names", {})
        if a not in names:
            names[a] = {n.name: k for k, n in self.by_key[a].items()}
        return self.by_key[b][names[a][name]].name


#: the keys :func:`residual_meta` has seen (graphflop's, ``val`` and others), and the others
_SEEN_KEYS = {"val"}
_OTHER_KEYS: set[str] = set()


def residual_meta(m: dict) -> dict:
    """A residual placeholder's annotations from its value's ``m``: ``graphflop_meta(m)``, then
    ``val`` where ``m`` has one. Where every key of ``m`` was seen before (a call's residual:
    its template node's keys), ``m`` copied less the other keys, ``val`` moved last: set
    operations rather than a test per key (a residual of every call: 30 per block of
    GPT-2)."""
    keys = m.keys()
    if keys <= _SEEN_KEYS:
        out = dict(m)
        for k in keys & _OTHER_KEYS:
            del out[k]
        if "val" in out:
            out["val"] = out.pop("val")
        return out
    out = graphflop_meta(m)
    _SEEN_KEYS.update(keys)
    _OTHER_KEYS.update(k for k in keys if k != "val" and k not in out)
    if "val" in m:
        out["val"] = m["val"]
    return out
