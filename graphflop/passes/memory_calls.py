"""Memory schedules composed per call of a repeated block: each block's steps worked out once,
the calls and the top level composed, the peak equal to the flat schedule's to the byte.

A :class:`~graphflop.passes.memory.Schedule` walks every node of the flat graphs. Where a graph
is a top level calling repeated blocks (the forward's :class:`~graphflop.meta.Hierarchy`, a
derivative graph's :class:`~graphflop.passes.calls.DerivedHierarchy`), each call is one *run*
of consecutive nodes, and the calls of one template (one variant of a forward block, one
template derivative) are copies of the same nodes. :class:`ComposedSchedule` keeps the top
level's steps as they are and each call as one item: the run's steps relative to the call
(a *profile*, built once per template and per-call pattern), the keys of the values it reads
from outside, and its position. The peak is then composed:

- *a block's internal peak over its entry*: the bytes live when the call starts, less the
  storages from outside whose last reader is inside the call (freed where that reader is),
  plus, at each of its steps, the storages the call has allocated and not yet freed and that
  step's kernel temporaries; the maximum over the steps is worked out once per template and
  per pattern (which of its values outlive the call, which values from outside it frees and
  where), so each further call of that pattern costs its arguments, not its nodes;
- *the residuals each call leaves live*: the values of a call read after it (by the top level,
  a later call, the backward: a residual) are storages from then on, freed where their last
  reader is, as in the flat schedule.

Exact, not an estimate: the profile of a call is taken only where the call agrees with the
template's first call in everything the schedule reads that is not fixed by the template: the
pattern of its arguments from outside (which argument each read is, how many keys each stands
for), and the per-node overrides of the memory model (eager sizes, kernel temporaries, the
values a kernel keeps live, scatters in place, which nodes are the graph's outputs); a call
that differs gets a profile of its own. Storages freed together (``ties``: the eager JVP's
primal and tangent, one dual tensor) are taken too: a call's value in a tie becomes a storage
of its own, held to the tie's last reader.

The calls' nodes are still read for their arguments and those overrides (dictionary look-ups,
not steps); what is done once per template is the steps and the peak inside the call. A
recorded hierarchy's calls (no flat graph) are added by :mod:`graphflop.passes.recorded_memory`
from its top level and its templates, the overrides worked out once per context of a template.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, repeat
from operator import ne
from typing import Any

from torch.fx import GraphModule, Node

from graphflop.meta import CALL_SITE, DERIVED_HIERARCHY, HIERARCHY, SIGNATURE, Hierarchy
from graphflop.passes.memory import Step, _NodeSteps

__all__ = ["ComposedSchedule", "Run", "backward_runs", "composed_forward_schedule", "forward_runs"]

#: a run of a graph: (its template's key, its nodes in graph order)
Run = tuple[Hashable, list[Node]]


def forward_runs(forward: GraphModule) -> list[Run] | None:
    """The forward graph's calls as runs, keyed by the variant of the block they copy; None
    where the graph has no hierarchy or a call's nodes are not one run.

    The runs are cut where the call site changes from one node to the next (found by a
    C-level ``map`` over the sites), the nodes taken as slices: the per-node work is one
    read of :data:`~graphflop.meta.CALL_SITE`, the rest per run. Worked out once per forward
    graph (kept on it, as :func:`graphflop.ad.blocks.call_keys`: the forward and train
    schedules both read it): shared, read, never written."""
    h: Hierarchy | None = forward.meta.get(HIERARCHY)
    if h is None or h.graph is None:
        return None
    from graphflop.ad.blocks import on_graph

    return on_graph(forward, "_graphflop_forward_runs", lambda f: _forward_runs(f, h))


def _forward_runs(forward: GraphModule, h: Hierarchy) -> list[Run] | None:
    nodes = list(forward.graph.nodes)
    sites = [t[0] if (t := n.meta.get(CALL_SITE)) is not None else None for n in nodes]
    # the positions where the site differs from the node before's: each run's first node
    cuts = [0, *compress(range(1, len(nodes)), map(ne, sites[1:], sites)), len(nodes)]
    runs: list[Run] = []
    seen: set[int] = set()
    for a, b in zip(cuts, cuts[1:]):
        s = sites[a]
        if s is None:
            continue
        if s in seen:  # a call's nodes in two runs: not a copy of its template's
            return None
        seen.add(s)
        runs.append((("forward", h.sites[s].variant), nodes[a:b]))
    return runs


def composed_forward_schedule(forward: GraphModule) -> ComposedSchedule | None:
    """:func:`~graphflop.passes.memory.forward_schedule` composed per call, or None where the
    forward graph has no calls to compose."""
    runs = forward_runs(forward)
    if runs is None:
        return None
    s = ComposedSchedule()
    s.add_graph(
        forward, "f", runs=runs, baseline=forward.meta[SIGNATURE].state(), keep_outputs=True
    )
    return s


def backward_runs(gm: GraphModule) -> list[Run] | None:
    """A derivative graph's calls (:data:`~graphflop.meta.DERIVED_HIERARCHY`) as runs, keyed
    by their template derivative; None where it has none."""
    dh = gm.meta.get(DERIVED_HIERARCHY)
    if dh is None or len(dh.runs) != len(dh.calls):
        return None
    return [(("derived", id(dh), c.template), r) for c, r in zip(dh.calls, dh.runs)]


@dataclass
class _Profile:
    """A run's steps relative to its call: the run's node ``i`` has key ``@i``; a value from
    outside is ``<k``, the call's ``k``-th outside key (:attr:`_Call.outer`)."""

    steps: list[Step]
    #: run position -> whether the node has a step (a view of an always-live tensor has none)
    keyed: list[bool]
    #: per resolved pattern of the outside keys, the analysis (:meth:`ComposedSchedule._inside`)
    inside: dict[tuple, _Inside] = field(default_factory=dict)
    #: the run positions without a step
    unkeyed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.unkeyed = [i for i, k in enumerate(self.keyed) if not k]


@dataclass
class _Inside:
    """A profile's storages given which outside keys name a storage.

    Attributes:
        root: step key -> the storage it lives in: its own key, another step's, or ``<k``.
        size: own storage key -> bytes.
        alloc: own storage key -> step index where it is allocated.
        last: storage (own key or ``<k``) -> the last step index reading it.
        peaks: (storages kept past the call, outside storages freed inside) -> (the largest
            bytes live inside the call over what was live at its entry, its first step index).
    """

    root: dict[str, str]
    size: dict[str, int]
    alloc: dict[str, int]
    last: dict[str, int]
    peaks: dict[tuple, tuple[int, int]] = field(default_factory=dict)
    #: (k, the last step index reading outside key ``<k``), for the outside keys it reads
    outer_last: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.outer_last = [(int(r[1:]), j) for r, j in self.last.items() if r[0] == "<"]


@dataclass
class _Call:
    profile: _Profile
    prefix: str
    run: list[Node]
    outer: list[str]  # the outside keys, flattened in the order the profile numbers them


class ComposedSchedule:
    """Steps of one or more graphs run one after another, each call of a repeated block one
    item (see the module docstring). Same arguments as
    :class:`~graphflop.passes.memory.Schedule`; :meth:`add_graph` takes the graph's ``runs``
    too."""

    def __init__(self) -> None:
        self.items: list[Step | _Call] = []
        self.keep: set[str] = set()
        self.ties: list[list[str]] = []
        #: per graph prefix: its run nodes' (run, position), its nodes by name, per run the
        #: item number of its call
        self._graphs: dict[str, tuple[dict[Node, tuple[int, int]], dict[str, Node], list]] = {}
        self._profiles: dict[tuple, _Profile] = {}
        #: per template key, the positions of its nodes that read a value from outside the run
        self._boundary: dict[Hashable, list[int]] = {}
        #: the lifetimes last worked out, with the schedule's size then (:meth:`_lifetimes`)
        self._lives: tuple[tuple[int, ...], _Lives] | None = None

    def add_graph(
        self,
        gm: GraphModule,
        prefix: str,
        *,
        runs: Sequence[Run] = (),
        baseline: set[str],
        external: dict[str, str | list[str]] | None = None,
        free_outputs: bool = False,
        keep_outputs: bool = False,
        eager: bool = False,
        sizes: dict[str, int] | None = None,
        extra: dict[str, int] | None = None,
        also_reads: dict[str, list[str]] | None = None,
        inplace: set[str] | None = None,
        released: set[str] | None = None,
        held: list[str] | None = None,
    ) -> set[str]:
        """:meth:`Schedule.add_graph <graphflop.passes.memory.Schedule.add_graph>`, with each
        of ``runs`` (consecutive nodes of ``gm``, in graph order) one call item; returns the
        names of the nodes whose value names no storage, a call's (its profile's positions
        without a step) included."""
        external = external or {}
        nodes = _NodeSteps(gm, eager, sizes, extra, also_reads, inplace, free_outputs, released)
        runs = [(key, r) for key, r in runs if r]
        index: dict[Node, tuple[int, int]] = {}  # run node -> (run, position)
        for ci, (_, r) in enumerate(runs):
            index.update(zip(r, zip(repeat(ci), count())))
        numbers: list[int] = []  # per run, its call's item number
        if prefix in self._graphs:
            raise ValueError(f"a graph with prefix {prefix!r} was added already")
        self._graphs[prefix] = (index, nodes.by_name, numbers)
        overrides = _overrides(nodes, index, len(runs))
        keys = _Keys(prefix, index, numbers, self.items)
        unstored: set[str] = set()
        # the nodes in order, a run's nodes skipped where they are consecutive (its last node
        # where its length says: no node of the top level among them), so that a call costs
        # its boundary, not its nodes
        order = list(gm.graph.nodes)
        first = {r[0]: ci for ci, (_, r) in enumerate(runs)}
        at = 0
        while at < len(order):
            n = order[at]
            at += 1
            started = first.get(n)
            if started is not None:
                numbers.append(len(self.items))
                key, run = runs[started]
                self._add_call(key, started, run, prefix, nodes, keys, index, overrides[started])
                call = self.items[-1]
                assert isinstance(call, _Call)
                unstored.update(run[i].name for i in call.profile.unkeyed)
                end = at + len(run) - 2
                if end < len(order) and order[end] is run[-1]:
                    at = end + 1
                continue
            if n in index:  # a run's node after its first (runs not consecutive)
                continue
            if n.op == "output":
                kept: set[str] = set()
                self.items.append(nodes.output_step(n, prefix, keys, held or [], kept))
                if keep_outputs:
                    self.keep.update(kept)
                continue
            if n.op == "placeholder":
                if n.name in baseline:
                    keys[n] = []
                    unstored.add(n.name)
                    continue
                if n.name in external:
                    ext = external[n.name]
                    keys[n] = [ext] if isinstance(ext, str) else list(ext)
                    if not keys[n]:
                        unstored.add(n.name)
                    continue
            step = nodes.step(n, f"{prefix}:{n.name}", keys)
            if step is not None:
                self.items.append(step)
            else:
                unstored.add(n.name)
        return unstored

    def _add_call(
        self,
        key: Hashable,
        ci: int,
        run: list[Node],
        prefix: str,
        nodes: _NodeSteps,
        keys: dict[Node, list[str]],
        index: dict[Node, tuple[int, int]],
        overrides: list[tuple],
    ) -> None:
        """Add run ``ci`` as one call item. Only the run's nodes that read a value from
        outside it (found at the template's first call: the calls of one template are copies
        of the same nodes) and those with overrides are visited."""
        bound = self._boundary.get((key, len(run)))
        if bound is None:
            bound = self._boundary[key, len(run)] = [
                i
                for i, n in enumerate(run)
                if any(index.get(a, (-1,))[0] != ci for a in n._input_nodes)
            ]
        held_at = {i: names for tag, i, names in overrides if tag == "r"}
        visit = sorted(set(bound) | held_at.keys()) if held_at else bound
        ext: dict[Node, int] = {}
        refs: list[int] = []
        held: list[tuple[int, tuple]] = []
        by_name = nodes.by_name
        for i in visit:
            for a in run[i]._input_nodes:  # all_input_nodes without the copy into a list
                hit = index.get(a)
                if hit is None or hit[0] != ci:
                    refs.append(ext.setdefault(a, len(ext)))
            names = held_at.get(i)
            if names:
                row = []
                for m in names:
                    a = by_name[m]
                    hit = index.get(a)
                    inside = hit is not None and hit[0] == ci
                    row.append(hit[1] if inside else -1 - ext.setdefault(a, len(ext)))  # type: ignore[index]
                held.append((i, tuple(row)))
        lists = [keys.get(a, []) for a in ext]
        sig = (
            key,
            len(run),
            tuple(refs),
            tuple(len(x) for x in lists),
            tuple(held),
            # (a set, not a sorted tuple: each (kind, position) once, so the same test of
            # equality, without sorting tens of a call's overrides per call)
            frozenset([o for o in overrides if o[0] != "r"]),
        )
        profile = self._profiles.get(sig)
        if profile is None:
            profile = self._profiles[sig] = _profile(run, ext, lists, nodes)
        self.items.append(_Call(profile, prefix, run, [k for x in lists for k in x]))

    def _locate(self, k: str) -> tuple[int, str] | None:
        """(call item number, key in its profile) of the outer key ``k`` of a run's node, or
        None (a key of the top level, or of a node without a step)."""
        prefix, _, name = k.partition(":")
        g = self._graphs.get(prefix)
        if g is None:
            return None
        index, by_name, numbers = g
        hit = index.get(by_name.get(name))  # type: ignore[arg-type]
        if hit is None or hit[0] >= len(numbers):
            return None
        number = numbers[hit[0]]
        c = self.items[number]
        assert isinstance(c, _Call)
        return (number, f"@{hit[1]}") if c.profile.keyed[hit[1]] else None

    def add_transient(self, key: str, nbytes: int) -> None:
        """A storage of ``nbytes`` allocated and freed at one step (a kernel's temporaries)."""
        self.items.append(Step(key, nbytes, None, []))

    # -- the composition ---------------------------------------------------------------------
    def _lifetimes(self) -> _Lives:
        """The storages and their lifetimes over the flat order of steps (:class:`_Lives`);
        worked out once for :meth:`owners` and :meth:`peak` of one schedule, again where an
        item, kept key or tie was added since (the schedules are built by appending)."""
        mark = (len(self.items), len(self.keep), len(self.ties), sum(map(len, self.ties)))
        if self._lives is not None and self._lives[0] == mark:
            return self._lives[1]
        lives = _Lives(self.items, self._locate)
        i = 0
        for number, item in enumerate(self.items):
            lives.offsets.append(i)
            if isinstance(item, Step):
                lives.step(item, i)
                i += 1
            else:
                lives.call(item, number, i)
                i += len(item.profile.steps)
        for k in self.keep:
            rs = lives.resolve(k)
            if rs is not None:
                lives.last[rs] = i
        for group in self.ties:  # a call's tied values become storages of their own (resolve)
            sts = {rs for rs in map(lives.resolve, group) if rs is not None}
            t = max((lives.last[st] for st in sts), default=0)
            for st in sts:
                lives.last[st] = t
        lives.locate = None  # resolved: no reference back to the schedule that keeps it
        self._lives = (mark, lives)
        return lives

    def peak(self) -> tuple[int, str]:
        """(largest sum of live storage bytes, the step where it first occurs; ``(0, "")`` for
        a schedule that holds nothing): :meth:`Schedule.peak
        <graphflop.passes.memory.Schedule.peak>` of the same steps, composed per call."""
        lives = self._lifetimes()
        storage, size, last, offsets = lives.storage, lives.size, lives.last, lives.offsets
        rel = lives.rel
        frees: dict[int, list[str]] = {}
        for st, i in last.items():
            frees.setdefault(i, []).append(st)
        at_index = sorted(frees)
        # a call's storages that something outside it reads (or a tie holds): by call item
        # (in the order resolved, as ``size`` has them: no key parsed back)
        mine: dict[int, list[str]] = {}
        for st, (number, _) in lives.place.items():
            mine.setdefault(number, []).append(st)
        live = 0
        best, at = 0, ""
        for number, item in enumerate(self.items):
            i = offsets[number]
            if isinstance(item, Step):
                if storage[item.key] == item.key:
                    live += size[item.key]
                if live + item.extra > best:
                    best, at = live + item.extra, item.key
                for st in frees.get(i, ()):
                    live -= size.get(st, 0)
                continue
            n = len(item.profile.steps)
            if not n:
                continue
            own = mine.get(number, [])
            dying: dict[str, int] = {}  # storages from outside whose last step is in the call
            ours = f"#{number}:"
            for x in at_index[bisect_left(at_index, i) : bisect_left(at_index, i + n)]:
                for st in frees[x]:
                    if not st.startswith(ours):
                        dying[st] = x - i
            escaping = [st for st in own if last[st] >= i + n]
            kept = frozenset(map(rel.__getitem__, escaping))
            moved = tuple(sorted((rel[st], last[st] - i) for st in own if last[st] < i + n))
            freed = tuple(sorted((j, size[st]) for st, j in dying.items()))
            m, j = _inside_peak(item.profile, lives.inners[number], kept, moved, freed)
            if live + m > best:
                best, at = (
                    live + m,
                    f"{item.prefix}:{item.run[int(item.profile.steps[j].key[1:])].name}",
                )
            live += sum(size[st] for st in escaping) - sum(size[st] for st in dying)
        return (best, at) if best > 0 else (0, "")

    def owner(self, key: str) -> tuple[str, int] | None:
        """(the key of the step that allocated the storage ``key`` lives in, its bytes), or None
        for a key with no storage (a view of an always-live tensor). Within a call the owner is
        the run's node that allocated it (``PREFIX:NODE``)."""
        lives = self._lifetimes()
        return self._owner(key, lives)

    def owners(self, keys: Sequence[str]) -> dict[str, tuple[str, int] | None]:
        """:meth:`owner` of each of ``keys``, the lifetimes worked out once."""
        lives = self._lifetimes()
        return {k: self._owner(k, lives) for k in keys}

    def _owner(self, key: str, lives: _Lives) -> tuple[str, int] | None:
        st = lives.storage.get(key)
        if st is None:
            loc = self._locate(key)
            if loc is None:
                return None
            number, rel = loc
            c = self.items[number]
            assert isinstance(c, _Call)
            inner = lives.inners[number]
            r = inner.root[rel]
            if r[0] == "<":
                return self._owner(c.outer[int(r[1:])], lives)
            return f"{c.prefix}:{c.run[int(r[1:])].name}", inner.size[r]
        if st[0] == "#":
            number, i = lives.place[st]
            c = self.items[number]
            assert isinstance(c, _Call)
            return f"{c.prefix}:{c.run[i].name}", lives.size[st]
        return st, lives.size[st]


class _Lives:
    """The storages of a :class:`ComposedSchedule` and where each is last read, over the flat
    order of its steps (a step's index: its call's first index plus its index in the call).

    Attributes:
        storage: outer key -> the storage it lives in (an outer key, or ``#ITEM:@i`` for the
            run's node ``i`` of call item ``ITEM``: a call's storage appears only where
            something after the call reads it).
        size: storage -> bytes.
        last: storage -> index of the last step reading it.
        offsets: per item, the index of its first step.
        inners: per call item, its profile's storages as the call resolved them.
        place: a call's storage (``#ITEM:@i``) -> (ITEM, i), not parsed back from the key.
        rel: a call's storage (``#ITEM:@i``) -> ``@i``, its key in the call's profile.
    """

    def __init__(
        self, items: list[Step | _Call], locate: Callable[[str], tuple[int, str] | None]
    ) -> None:
        self.items = items
        #: (set to None once the lifetimes are worked out: a cycle through the schedule)
        self.locate: Callable[[str], tuple[int, str] | None] | None = locate
        self.storage: dict[str, str] = {}
        self.size: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.offsets: list[int] = []
        self.inners: dict[int, _Inside] = {}
        self.nothing: set[str] = set()  # keys no step has
        self.place: dict[str, tuple[int, int]] = {}
        self.rel: dict[str, str] = {}  # a call's storage -> its key in the profile (``@i``)

    def resolve(self, k: str) -> str | None:
        """The storage outer key ``k`` lives in, or None where no step has that key."""
        st = self.storage.get(k)
        if st is not None or k in self.nothing:
            return st
        assert self.locate is not None, "resolved while the lifetimes are worked out"
        loc = self.locate(k)
        if loc is None:
            self.nothing.add(k)
            return None
        number, rel = loc
        c = self.items[number]
        assert isinstance(c, _Call)
        inner = self.inners[number]
        r = inner.root[rel]
        if r[0] == "<":
            st = self.resolve(c.outer[int(r[1:])])
        else:
            st = f"#{number}:{r}"
            if st not in self.size:
                self.size[st] = inner.size[r]
                self.last[st] = self.offsets[number] + inner.last[r]
                self.place[st] = (number, int(r[1:]))
                self.rel[st] = r
        if st is not None:
            self.storage[k] = st
        return st

    def step(self, item: Step, i: int) -> None:
        storage, last = self.storage, self.last
        if item.alias_of is not None and self.resolve(item.alias_of) is not None:
            st = storage[item.key] = storage[item.alias_of]
        else:
            st = storage[item.key] = item.key
            self.size[st] = item.nbytes
        last[st] = max(last.get(st, i), i)
        get = storage.get  # (a key resolved already: no call of resolve)
        for r in item.reads:
            rs = get(r) or self.resolve(r)
            if rs is not None:
                last[rs] = max(last.get(rs, i), i)

    def call(self, item: _Call, number: int, i: int) -> None:
        # (each outside key resolved once: a call reads tens of them, a block's residuals,
        # most of them resolved already: looked up without a call of resolve)
        get, resolve = self.storage.get, self.resolve
        rs = [get(k) or resolve(k) for k in item.outer]
        inner = self.inners[number] = _analysis(item.profile, tuple([r is not None for r in rs]))
        last = self.last
        for k, j in inner.outer_last:
            st = rs[k]
            if last.get(st, -1) < i + j:  # type: ignore[arg-type]
                last[st] = i + j  # type: ignore[index]


class _Keys(dict):
    """Node -> the keys its value is read as (:meth:`Schedule.add_graph`'s ``keys``), a run's
    node's looked up when read (``PREFIX:NODE``, or none for a node without a step)."""

    def __init__(
        self,
        prefix: str,
        index: dict[Node, tuple[int, int]],
        numbers: list[int],
        items: list[Step | _Call],
    ) -> None:
        super().__init__()
        self.prefix, self.index, self.numbers, self.steps = prefix, index, numbers, items

    def __missing__(self, n: Node) -> list[str]:
        ci, i = self.index[n]
        c = self.steps[self.numbers[ci]]
        assert isinstance(c, _Call)
        v = self[n] = [f"{self.prefix}:{n.name}"] if c.profile.keyed[i] else []
        return v

    def get(self, n: Node, default: Any = None) -> Any:
        try:
            return self[n]
        except KeyError:
            return default


def _overrides(
    nodes: _NodeSteps, index: dict[Node, tuple[int, int]], count: int
) -> list[list[tuple]]:
    """Per run, the memory model's per-node overrides on its nodes, ``(kind, position,
    value)``: ``s`` size, ``x`` kernel temporaries, ``p`` written in place, ``o`` a graph
    output (freed into a baseline buffer), ``r`` the names a kernel keeps live."""
    per: list[list[tuple]] = [[] for _ in range(count)]
    by_name = nodes.by_name
    tables: list[tuple[str, Any]] = [
        ("s", nodes.sizes.items()),
        ("x", nodes.extra.items()),
        ("p", ((m, None) for m in nodes.inplace)),
        ("r", ((m, tuple(v)) for m, v in nodes.also_reads.items())),
    ]
    for tag, entries in tables:
        for m, v in entries:
            n = by_name.get(m)
            hit = index.get(n) if n is not None else None
            if hit is not None:
                per[hit[0]].append((tag, hit[1], v))
    if nodes.free_outputs:
        for n in nodes.outputs:
            hit = index.get(n)
            if hit is not None:
                per[hit[0]].append(("o", hit[1], None))
    return per


def _profile(
    run: list[Node], ext: dict[Node, int], lists: list[list[str]], nodes: _NodeSteps
) -> _Profile:
    """The run's steps relative to the call (see :class:`_Profile`)."""
    env: dict[Node, list[str]] = {}
    k = 0
    for a, j in ext.items():
        env[a] = [f"<{k + m}" for m in range(len(lists[j]))]
        k += len(lists[j])
    steps: list[Step] = []
    keyed: list[bool] = []
    for i, n in enumerate(run):
        step = nodes.step(n, f"@{i}", env)
        keyed.append(step is not None)
        if step is not None:
            steps.append(step)
    return _Profile(steps, keyed)


def _analysis(p: _Profile, resolved: tuple[bool, ...]) -> _Inside:
    """The profile's storages where the outside keys ``resolved`` marks name a storage (a key
    that names none is neither aliased nor read, as in the flat schedule)."""
    got = p.inside.get(resolved)
    if got is not None:
        return got
    root: dict[str, str] = {}
    size: dict[str, int] = {}
    alloc: dict[str, int] = {}
    last: dict[str, int] = {}

    def of(k: str) -> str | None:
        if k[0] == "<":
            return k if resolved[int(k[1:])] else None
        return root.get(k)

    for j, s in enumerate(p.steps):
        a = of(s.alias_of) if s.alias_of is not None else None
        if a is None:
            r = root[s.key] = s.key
            size[r] = s.nbytes
            alloc[r] = j
        else:
            r = root[s.key] = a
        last[r] = j
        for x in s.reads:
            rx = of(x)
            if rx is not None:
                last[rx] = j
    got = p.inside[resolved] = _Inside(root, size, alloc, last)
    return got


def _inside_peak(
    p: _Profile,
    inner: _Inside,
    kept: frozenset[str],
    moved: tuple[tuple[str, int], ...],
    freed: tuple[tuple[int, int], ...],
) -> tuple[int, int]:
    """(the largest bytes live at a step of the call over those live at its entry, the first
    step index where it occurs): the call's own storages from their step through their last
    reader (those in ``kept`` to its end; those in ``moved``, ``(storage, step index)``, to
    that step: a tie holds them past their last reader), less the outside storages ``freed``
    ((step index, bytes): freed after that step)."""
    key = (kept, moved, freed)
    got = inner.peaks.get(key)
    if got is not None:
        return got
    lasts = inner.last | dict(moved)
    frees: dict[int, int] = {}
    for r, j in lasts.items():
        if r[0] != "<" and r not in kept:
            frees[j] = frees.get(j, 0) + inner.size[r]
    for j, nbytes in freed:
        frees[j] = frees.get(j, 0) + nbytes
    live = 0
    best, at = None, 0
    for j, s in enumerate(p.steps):
        if inner.root[s.key] == s.key:
            live += inner.size[s.key]
        v = live + s.extra
        if best is None or v > best:
            best, at = v, j
        live -= frees.get(j, 0)
    got = inner.peaks[key] = (best if best is not None else 0, at)
    return got
