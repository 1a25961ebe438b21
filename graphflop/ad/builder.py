"""Emitting nodes from derivative rules: the ``b`` that JVP and transpose rules call.

A builder appends ``call_function`` nodes to an fx graph, computing each node's ``val`` by running
the op on FakeTensors (no real memory) and tagging it with ``KIND``, ``ROLE``, ``SOURCE``,
``MODULE`` and ``PARAM_DERIVED``. Provenance comes from the builder's :class:`RuleContext`, set for
the rules of one forward node with :meth:`Builder.context`::

    with b.context(source=n.name, module=n.meta[MODULE]):
        t = rule.jvp(b, out, args, tangents, kwargs)

Work that is not needed is not emitted but recorded as a :class:`~graphflop.meta.Ghost`: a call
whose tensor arguments include a :class:`~graphflop.ops.ghost.GhostValue` and no real tangent (or
any call made in a context with ``ghost=True``) produces a ghost. Ghosts stand for symbolic zeros
that would have been non-zero had the value required a gradient (the model input's tangent, the
first layer's input cotangent), so the work saved can be reported.

Writes on every emitted node: ``val``, ``KIND``, ``ROLE``, ``SOURCE``, ``MODULE``,
``PARAM_DERIVED``. Reads ``KIND`` and ``PARAM_DERIVED`` of the arguments.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Graph, Node
from torch.fx.graph import _illegal_char_regex, _illegal_names, _name_regex
from torch.fx.immutable_collections import immutable_dict
from torch.fx.node import map_arg
from torch.utils._python_dispatch import TorchDispatchMode

from graphflop.meta import KIND, MODULE, PARAM_DERIVED, ROLE, SOURCE, Ghost, fresh_fake, new_fake
from graphflop.ops.cost import op_cost, value_of
from graphflop.ops.ghost import GhostValue, ghost_ids, is_ghost
from graphflop.ops.shape import reduced_dims
from graphflop.ops.tree import leaves, meta_key, tree_map, value_key

__all__ = [
    "NO_KWARGS",
    "Builder",
    "GhostValue",
    "NamePlan",
    "RuleContext",
    "base_name",
    "copy_node",
    "emit",
    "emit_named",
    "fake_output",
    "no_kwargs",
    "placeholder",
    "is_ghost",
    "makes_nodes",
    "fits_numbered",
    "new_node",
    "node_parts",
    "numbered_names",
    "parse_names",
    "take_name",
    "take_again",
    "take_names",
    "take_parsed",
]

_FAST_ARGS = hasattr(Node, "_update_args_kwargs")
#: ``torch.fx.map_arg`` without its Python frame (its check that the function is callable):
#: the C function it calls, where this PyTorch has it
_map_arg = getattr(torch._C, "_fx_map_arg", map_arg)

#: the keyword arguments of every node made here without any: one shared empty mapping. fx
#: makes each node its own ``immutable_dict`` (kept as given where it is one already), an
#: object the cyclic collector tracks; an analysis keeps about 200 such per GPT-2 block, and
#: the collector's pass when :func:`~graphflop.analysis.analyze` turns it back on costs about
#: 0.4 µs per object it keeps (docs/analysis_scale.md). ``immutable_dict`` cannot be changed
#: in place, so sharing it is safe; ``update_kwarg`` and the ``kwargs`` setter replace it.
NO_KWARGS: immutable_dict = immutable_dict()


def emit(graph: Graph, target: Any, args: tuple, kwargs: dict) -> Node:
    """``graph.call_function(target, args, kwargs)`` without fx's walk over the arguments
    looking for SymInts to warn about (graphflop's graphs have static shapes): about a third
    of the cost of creating a node, which the builders pay once per emitted node."""
    return emit_named(graph, target, args, base_name(graph, target), kwargs)


def emit_named(
    graph: Graph, target: Any, args: tuple, name: str, kwargs: dict | None = None
) -> Node:
    """:func:`emit` with the name ``name`` asked of fx (which makes it unique in ``graph``):
    ``graph.create_node("call_function", target, args, kwargs, name=name)`` without the walk
    over the arguments."""
    if not _FAST_ARGS:  # pragma: no cover - a PyTorch without the private setter
        return graph.create_node("call_function", target, args, kwargs, name=name)
    return new_node(graph, "call_function", target, name, args, kwargs or NO_KWARGS)


def placeholder(graph: Graph, name: str) -> Node:
    """``graph.placeholder(name)``, without fx's conversion of the name to a candidate where
    it changes nothing (a name of lower-case letters, digits and underscores that is not
    ``__magic__``: fx's snake case and lower case keep it as it is), made by :func:`new_node`:
    a trace makes one per parameter, twice."""
    if name.islower() and not (name.startswith("__") and name.endswith("__")):
        return new_node(graph, "placeholder", name, name, (), NO_KWARGS)
    return no_kwargs(graph.placeholder(name))


def no_kwargs(node: Node) -> Node:
    """``node`` (one without keyword arguments, just made) holding :data:`NO_KWARGS`, the
    shared empty mapping, in place of the one ``Graph.create_node`` made it."""
    if _FAST_ARGS:
        node._update_args_kwargs(node.args, NO_KWARGS)
    return node


def makes_nodes(graph: Graph) -> bool:
    """Whether :func:`new_node` makes ``graph``'s nodes itself (not through ``create_node``):
    it has no owning module (whose create-node hooks ``create_node`` would call) and this
    torch.fx has the parts. Reads what :func:`new_node` reads, ``Graph._owning_module`` (one
    of the parts), the field fx's ``owning_module`` property returns (torch 2.11 and later)."""
    return _PARTS and graph._owning_module is None


def base_name(graph: Graph, target: Any) -> str:
    """The base of the name :func:`emit` gives a node of ``target`` (``mm_default``; fx makes
    it unique per graph: ``mm_default_3``), derived once per target."""
    name = _BASE_NAMES.get(target)
    if name is None:  # fx's own clean-up of the candidate: ``mm.default`` -> ``mm_default``
        name = _BASE_NAMES[target] = _illegal_char_regex.sub("_", graph._target_to_str(target))
        m = _name_regex.match(name)
        if m is not None and m.group(2) is None and name not in _illegal_names:
            _PLAIN.add(name)
    return name


#: the C base of fx's ``Node``: its constructor, without ``Node.__init__``'s checks
_NodeBase: Any = getattr(torch._C, "_NodeBase", None)
_init_node: Any = _NodeBase.__init__ if _NodeBase is not None else None
#: whether this torch.fx has the parts :func:`new_node` makes a node with (the C base's
#: constructor, the argument setter, the graph's insert point, namespace and find_nodes table)
_PARTS = (
    _FAST_ARGS
    and _init_node is not None
    and all(
        hasattr(Graph(), a)
        for a in (
            "_insert",
            "_find_nodes_lookup_table",
            "_len",
            "_graph_namespace",
            "_owning_module",
        )
    )
)


def new_node(
    graph: Graph,
    op: str,
    target: Any,
    name: str,
    args: tuple,
    kwargs: dict,
    type_expr: Any = None,
    taken: bool = False,
    row: dict | None = None,
) -> Node:
    """``graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)`` for
    valid arguments (a callable ``target`` of a ``call_function``, a string one otherwise): the
    name taken as fx takes it (:func:`take_names`, without its regular expression for the
    names graphflop asks for: a :func:`base_name` or one fx made, ``base_<number>``), the node
    made by the C base's constructor (``Node.__init__``'s checks of the target are the
    caller's) and filed as ``create_node`` files it, without its walk over the arguments for
    SymInts (graphflop's graphs have static shapes). About half of what ``create_node`` costs,
    which the derivative and update builders pay once per node. ``create_node`` itself where
    ``graph`` has an owning module (its create-node hooks) or this torch.fx lacks the parts.

    Empty ``kwargs`` are :data:`NO_KWARGS`, the shared empty mapping (one object fewer per
    node for the collector). ``taken``: ``name`` is the one fx would give, already taken in
    ``graph``'s namespace (:func:`take_names` of the names of many nodes at once). ``row``:
    :func:`find_row` of ``graph``, ``op`` and ``target``, where the caller files many nodes of
    one target (the row is found without hashing the target again: an ``OpOverload``'s hash is
    a Python method)."""
    ns = graph._graph_namespace
    if not _PARTS or graph._owning_module is not None:
        if taken:  # fx takes it again: as it is, the name being free and fx's form
            ns._used_names.discard(name)
        node = graph.create_node(op, target, name=name, type_expr=type_expr)
        node._update_args_kwargs(args, kwargs or NO_KWARGS)
        return node
    if not taken:
        name = _take(ns, name)
    node = Node.__new__(Node)
    _init_node(node, graph, name, op, target, type_expr)
    node._update_args_kwargs(args, kwargs or NO_KWARGS)
    ns._obj_to_name[node] = name
    graph._insert(node)
    if row is None:  # (find_row, in line)
        rows = graph.__dict__.get(_ROWS) if op == "call_function" else None
        row = rows.get(id(target)) if rows is not None else None
        if row is None:
            row = find_row(graph, op, target)
    row[node] = None
    graph._len += 1
    return node


def node_parts(graph: Graph) -> tuple[Any, dict, Any] | None:
    """What :func:`new_node` makes and files a node of ``graph`` with, for a caller copying
    many nodes in a loop of its own (a block's nodes at each of its calls): ``(init, names,
    insert)``, the C base's constructor (``init(Node.__new__(Node), graph, name, op, target,
    type_expr)``), the namespace's table of node names (``names[node] = name``) and the
    graph's insert (its root's C ``_prepend``). The caller then sets the node's arguments
    (``_update_args_kwargs``), files it in its :func:`find_row` row and counts it
    (``graph._len``), as :func:`new_node` does. None where :func:`makes_nodes` is false or
    nodes are not inserted at the graph's end (fx's ``inserting_before``/``inserting_after``
    in force)."""
    if not makes_nodes(graph):
        return None
    root = graph._root
    prepend = getattr(root, "_prepend", None)
    if prepend is None or graph._insert != root.prepend:
        return None
    return _init_node, graph._graph_namespace._obj_to_name, prepend


def find_row(graph: Graph, op: str, target: Any) -> dict[Node, None]:
    """The row of fx's find_nodes table of ``graph`` in which a node of ``op`` and ``target``
    is filed (``_FindNodesLookupTable.insert``'s: per ``(op, target)`` of a ``call_function``,
    per ``(op, None)`` otherwise, the nodes as keys of a dict), made if it is not there: the
    same dict as long as the graph lives (fx removes a node from its row, never a row).

    A ``call_function``'s row is also noted in the graph's own table of rows by the target's
    identity (:data:`_ROWS`), where :func:`new_node` finds it again without the table's key:
    hashing it calls ``OpOverload.__hash__``, a Python method, once per node made (about 0.2
    us of the 0.45 filing a node costs). The identity stays the target's: the table's key
    holds the target for as long as the row is there."""
    row = graph._find_nodes_lookup_table.table[(op, target if op == "call_function" else None)]
    if op == "call_function":
        rows = graph.__dict__.get(_ROWS)
        if rows is None:
            rows = graph.__dict__[_ROWS] = {}
        rows[id(target)] = row
    return row


#: the attribute of an fx ``Graph`` holding :func:`find_row`'s rows, by the target's ``id``
_ROWS = "_graphflop_find_rows"


def take_name(graph: Graph, candidate: str) -> str:
    """The name fx gives a node of ``graph`` made now with the name ``candidate``, taken
    (:func:`take_names` of one)."""
    return take_names(graph, (candidate,))[0]


def take_names(graph: Graph, candidates: Iterable[str]) -> list[str]:
    """The names fx gives nodes of ``graph`` made now, one after the other, with the names
    ``candidates``, taken (``_Namespace.create_name`` of each, in half its time: without its
    regular expression for a name of the two forms graphflop asks for, a plain identifier (a
    :func:`base_name`, ``repeat_item``, a placeholder's name: no number at its end, not a
    keyword's or a builtin's; fx takes it, or its base's next free number) and one fx made,
    ``base_<number>``)."""
    ns = graph._graph_namespace
    return [_take(ns, candidate) for candidate in candidates]


def take_plain(graph: Graph, names: Sequence[str]) -> list[str] | None:
    """``take_names(graph, names)`` for ``names`` the caller knows to be, where ASCII,
    identifiers without a number at their end (``<base>_<digits>``): where they are ASCII,
    free, distinct and none a keyword's or builtin's name, each is taken as it is (its base
    count kept, or 0), all at once; None, nothing taken, otherwise (take them one by one)."""
    if not "".join(names).isascii() or not _illegal_names.keys().isdisjoint(names):
        return None
    ns = graph._graph_namespace
    used = ns._used_names
    if not used.isdisjoint(names):
        return None
    before = len(used)
    used.update(names)
    if len(used) - before != len(names):  # a name twice
        used.difference_update(names)
        return None
    setdefault = ns._base_count.setdefault
    for x in names:
        setdefault(x, 0)
    return list(names)


def _take(ns: Any, candidate: str) -> str:
    """:func:`take_names` of one name in namespace ``ns`` (a graph's ``_graph_namespace``)."""
    used, count = ns._used_names, ns._base_count
    if candidate in _PLAIN:
        base, num = candidate, count.get(candidate, 0)
    else:
        base, _, digits = candidate.rpartition("_")
        ident = candidate.isascii() and candidate.isidentifier()
        if ident and not digits.isdigit():  # fx's regular expression: no number
            if candidate in _illegal_names:  # renamed even where free: fx's reading
                return ns.create_name(candidate, None)
            base, num = candidate, count.get(candidate, 0)
        elif not ident or not base or base[-1] == "_":
            return ns.create_name(candidate, None)  # another form: fx's reading
        elif candidate not in used:  # a numbered name still free is taken as it is
            used.add(candidate)
            count[base] = int(digits)
            return candidate
        else:
            num = count.get(base, 0)
    name = candidate
    while name in used:
        num += 1
        name = f"{base}_{num}"
    used.add(name)
    count[base] = num
    return name


#: a name asked of fx as its ``_Namespace.create_name`` reads it (:func:`parse_names`): the
#: name, its base, its number (None: none) and whether it is a Python keyword or builtin's
#: name; a base of None where fx first cleans the name up (no regular expression saved)
ParsedName = tuple[str, str | None, int | None, bool]


def parse_names(candidates: Iterable[str]) -> list[ParsedName]:
    """``candidates`` read once as ``_Namespace.create_name`` reads each (its regular
    expression), for :func:`take_parsed` to take many times: a template's node names, which
    each of its calls' copies asks for again."""
    out: list[ParsedName] = []
    for c in candidates:
        m = _name_regex.match(c)
        if m is None:
            out.append((c, None, None, False))
            continue
        base, digits = m.group(1, 2)
        out.append(
            (c, base, None if digits is None else int(digits), _illegal_names.get(c) is not None)
        )
    return out


def take_parsed(graph: Graph, parsed: list[ParsedName]) -> tuple[list[str], list[int | None]]:
    """:func:`take_names` of names :func:`parse_names` read: the names fx gives nodes of
    ``graph`` made now, one after the other, with those names (``_Namespace.create_name`` of
    each, taken), and each name's number (None where the name is its base: a candidate with
    no number, kept as it is), by which :func:`take_again` takes the name in another graph."""
    ns = graph._graph_namespace
    used, count = ns._used_names, ns._base_count
    names: list[str] = []
    nums: list[int | None] = []
    for candidate, base, num, illegal in parsed:
        if base is None:  # another form: fx's reading
            names.append(ns.create_name(candidate, None))
            nums.append(None)
            continue
        name = candidate
        if num is None or name in used:  # numbered on from the base's count
            num = count.get(base, 0)
            if illegal:
                num += 1
                name = f"{base}_{num}"
        while name in used:
            num += 1
            name = f"{base}_{num}"
        used.add(name)
        count[base] = num
        names.append(name)
        nums.append(None if name == base else num)
    return names, nums


def take_again(graph: Graph, name: str, base: str, num: int | None) -> bool:
    """Take in ``graph`` a name :func:`take_parsed` gave (``base``: its candidate's base,
    ``num`` the number it gave), as ``_Namespace.create_name(name)`` takes it where that keeps
    the name: whether it did (False: the name is taken in ``graph``, nothing changed; fx would
    number it on)."""
    ns = graph._graph_namespace
    if name in ns._used_names:
        return False
    ns._used_names.add(name)
    count = ns._base_count
    count[base] = count.get(base, 0) if num is None else num
    return True


def numbered_names(names: Sequence[str]) -> tuple[list[str], dict[str, list[int]]] | None:
    """``names`` read as fx's numbered form ``<base>_<digits>`` (an ASCII identifier whose base
    does not end in ``_``: :func:`take_names` takes such a name as it is where it is free, else
    the next free number of its base): per name its prefix ``<base>_``, and per base the
    positions of its names, in the order first met. None where a name is of another form."""
    prefixes = []
    bases: dict[str, list[int]] = {}
    for k, name in enumerate(names):
        base, _, digits = name.rpartition("_")
        if not (base and base[-1] != "_" and digits.isdigit() and name.isascii()):
            return None
        if not name.isidentifier():
            return None
        prefixes.append(base + "_")
        bases.setdefault(base, []).append(k)
    return prefixes, bases


def fits_numbered(names: Sequence[str], prefixes: Sequence[str]) -> bool:
    """Whether ``names`` are of the numbered form ``prefixes`` describe (the first value of
    :func:`numbered_names` of these names or of another call's of one template): each name its
    prefix and then ASCII digits."""
    if not names:
        return not prefixes
    if len(prefixes) != len(names) or not all(map(str.startswith, names, prefixes)):
        return False
    digits = list(map(str.removeprefix, names, prefixes))
    joined = "".join(digits)
    return all(digits) and joined.isascii() and joined.isdigit()


class NamePlan:
    """:func:`take_names` for the calls of one template derivative, a base at a time: the
    names a call's copies ask fx for are per node either its op's base name (fixed,
    ``fixed[i]``) or a name given per call (None in ``fixed``: a primal copy's forward node
    name). Taken one by one they cost a tenth of a millisecond per call of a GPT-2 block's
    JVP (two hundred names); a plan per template takes most of them with a few set
    operations.

    The names of one base are taken apart from the others' (fx renames a name
    ``<base>_<digits>`` or a plain ``<base>`` only ever ``<base>_<number>``). A plain base
    (:data:`_PLAIN`) asked ``m`` times takes ``<base>`` where it is free, then the base's
    next ``m`` (or ``m - 1``) numbers; a given name of fx's numbered form is taken as it is
    (the base's count set to its number). A base both plain and a given name's (``getitem``:
    a tangent's getitem and a primal copy's) is taken one by one, its names in order. Where
    a name the plan would take is not free, or is made twice, where a given name is of
    another form or where a base is not plain, every name is taken one by one.

    Args:
        fixed: per node of the template, in order, the base name asked of fx for its copy, or
            None for a name given per call.
    """

    def __init__(self, fixed: Iterable[str | None]) -> None:
        self.fixed: list[str | None] = list(fixed)
        self.slots = [i for i, b in enumerate(self.fixed) if b is None]
        groups: dict[str, list[int]] = {}
        for i, b in enumerate(self.fixed):
            if b is not None:
                groups.setdefault(b, []).append(i)
        #: per base of the fixed names, their positions (None: a base not plain)
        self.groups = groups if all(b in _PLAIN for b in groups) else None
        #: the plan of the given names (:meth:`_plan`), from the last call it fitted
        self._given: tuple | None = None

    def _plan(self, given: Sequence[str]) -> tuple | None:
        """How a call with the given names ``given`` is taken (None where a name is not of
        fx's numbered form: an ASCII identifier ``<base>_<digits>``, its base not ending in
        ``_``): per given name its prefix ``<base>_``; the plain bases taken at once with
        how many names; per base of given names taken as they are, ``(base, its prefix,
        index of its last)``, and those names' indices; per base taken one by one, its
        positions and per position its given name's index (None: a fixed name); and the
        permutation putting the names in order."""
        assert self.groups is not None
        read = numbered_names(given)
        if read is None:
            return None
        prefixes, bases = read
        plain = [(b, b + "_", len(pos)) for b, pos in self.groups.items() if b not in bases]
        free = [(b, b + "_", ks[-1]) for b, ks in bases.items() if b not in self.groups]
        free_ks = [k for k, p in enumerate(prefixes) if p[:-1] not in self.groups]
        mixed = []
        for b, ks in bases.items():
            if b in self.groups:
                at: dict[int, int | None] = {self.slots[k]: k for k in ks}
                at.update((i, None) for i in self.groups[b])
                pos = sorted(at)
                mixed.append((b, pos, [at[i] for i in pos]))
        order = [i for b, _, _ in plain for i in self.groups[b]]
        order += [self.slots[k] for k in free_ks] + [i for _, pos, _ in mixed for i in pos]
        where = {i: j for j, i in enumerate(order)}
        gather = operator.itemgetter(*[where[i] for i in range(len(order))]) if order else None
        return tuple(prefixes), plain, free, free_ks, mixed, gather

    def candidates(self, given: Sequence[str]) -> list[str]:
        """The names asked of fx, in order: ``fixed`` with ``given`` in its gaps."""
        out: list[Any] = list(self.fixed)
        for i, name in zip(self.slots, given):
            out[i] = name
        return out

    def take(self, graph: Graph, given: Sequence[str] = ()) -> list[str]:
        """``take_names(graph, self.candidates(given))``; ``given``: the names of the
        positions ``fixed`` leaves None, in order."""
        if self.groups is None:
            return take_names(graph, self.candidates(given))
        plan = self._given
        if plan is None or not fits_numbered(given, plan[0]):
            plan = self._given = self._plan(given)
            if plan is None:
                return take_names(graph, self.candidates(given))
        _, plain, free, free_ks, mixed, gather = plan
        ns = graph._graph_namespace
        used, count = ns._used_names, ns._base_count
        made: list[str] = []
        last: list[int] = []
        for base, prefix, m in plain:  # <prefix><c + 1>, ...: made in C, not a name at a time
            c = count.get(base, 0)
            if base not in used:  # a base still free is taken as it is, the others numbered on
                made.append(base)
                m -= 1
            if len(_NUMBERS) <= c + m:
                _NUMBERS.extend(map(str, range(len(_NUMBERS), 2 * (c + m) + 1)))
            made += map(prefix.__add__, _NUMBERS[c + 1 : c + m + 1])
            last.append(c + m)
        made += given if not mixed else [given[k] for k in free_ks]
        if not used.isdisjoint(made):  # a name taken: one by one
            return take_names(graph, self.candidates(given))
        before = len(used)
        used.update(made)
        if len(used) - before != len(made):  # a name twice: one by one
            used.difference_update(made)
            return take_names(graph, self.candidates(given))
        for (base, _, _), n in zip(plain, last):
            count[base] = n
        for base, prefix, k in free:
            count[base] = int(given[k][len(prefix) :])
        fixed = self.fixed
        for _, pos, ks in mixed:  # in order, apart from the other bases
            names: list[Any] = [fixed[i] if k is None else given[k] for i, k in zip(pos, ks)]
            made += take_names(graph, names)
        if gather is None:
            return made
        return [gather(made)] if len(made) == 1 else list(gather(made))


#: ``str(i)`` at ``i``: the numbers of the names :class:`NamePlan` makes, written once
_NUMBERS: list[str] = []

#: op -> the base of its nodes' names, as torch.fx derives it (fx makes it unique per graph)
_BASE_NAMES: dict[Any, str] = {}
#: the base names that are plain: no number at their end, not a Python builtin's name
_PLAIN: set[str] = {"repeat_call", "repeat_item"}  # and the recorders' names for calls, items


def copy_node(
    graph: Graph,
    node: Node,
    arg_transform: Any = lambda a: a,
    name: str | None = None,
    taken: bool = False,
) -> Node:
    """``graph.node_copy(node, arg_transform)`` (same name, or ``name`` where given; arguments
    mapped, a shallow copy of ``meta``) without the walk :func:`emit` skips. ``taken``: the
    name is already taken (:func:`new_node`)."""
    if not _FAST_ARGS:  # pragma: no cover
        if taken:
            graph._graph_namespace._used_names.discard(name or node.name)
        copied = graph.node_copy(node, arg_transform)
        if name is not None:
            copied._rename(name)
        return copied
    args = _map_arg(node.args, arg_transform)
    # no keyword arguments: the shared empty mapping (NO_KWARGS), not one per copy
    kwargs = _map_arg(node.kwargs, arg_transform) if node.kwargs else NO_KWARGS
    new = new_node(graph, node.op, node.target, name or node.name, args, kwargs, node.type, taken)
    # filled in place: assigning an attribute of a node in a graph re-files it in fx's
    # find_nodes table (Node.__setattr__), a fifth of what a copy costs
    meta = new.meta
    meta.clear()
    meta.update(node.meta)
    return new


aten = torch.ops.aten


@dataclass(frozen=True)
class RuleContext:
    """What the nodes a rule emits are tagged with.

    Attributes:
        source: ``SOURCE`` of emitted nodes: the forward node the rule is for.
        module: ``MODULE`` of emitted nodes: that node's ``nn.Module`` path.
        role: ``ROLE`` of emitted nodes (builders may refine it, see :meth:`Builder.role_for`).
        param_derived: the forward node is computed from parameters only (JVP builders give its
            coefficients the role ``tangent_from_param``).
        ghost: emit nothing: every call returns a ghost (work that is pruned).
    """

    source: str = ""
    module: str = ""
    role: str = "forward"
    param_derived: bool = False
    ghost: bool = False


#: the names of :class:`RuleContext`'s fields
_CONTEXT_FIELDS = frozenset(f.name for f in fields(RuleContext))


def _updated(ctx: RuleContext, changes: dict[str, Any]) -> RuleContext:
    """``dataclasses.replace(ctx, **changes)`` in a third of its time (no ``__init__`` through
    the frozen class's ``object.__setattr__`` per field; the fields have no defaults computed
    at construction): a builder enters a context once or more per forward node it
    differentiates (ResNet-18's analysis: about 1,400 times).

    Raises:
        TypeError: for a name that is not a field of :class:`RuleContext`."""
    if not _CONTEXT_FIELDS.issuperset(changes):
        unknown = sorted(set(changes) - _CONTEXT_FIELDS)
        raise TypeError(f"RuleContext has no field {unknown[0]!r}")
    new = object.__new__(RuleContext)
    values = new.__dict__
    values.update(ctx.__dict__)
    values.update(changes)
    return new


class _ContextBlock:
    """The block :meth:`Builder.context` returns: ``ctx`` the builder's context inside it, the
    previous one restored on leaving (a plain class: a generator's context manager costs
    about three times as much to enter and leave)."""

    __slots__ = ("builder", "ctx", "saved")

    def __init__(self, builder: Builder, ctx: RuleContext):
        self.builder, self.ctx = builder, ctx

    def __enter__(self) -> RuleContext:
        self.saved = self.builder.ctx
        self.builder.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc: Any) -> None:
        self.builder.ctx = self.saved


class Builder:
    """Base builder: emission, fake propagation, ghosts and the tangent algebra helpers.

    Attributes:
        graph: the fx graph nodes are appended to.
        fake_mode: the FakeTensorMode values are computed in.
        ghosts: the list every :class:`~graphflop.meta.Ghost` record is appended to.
        ctx: the current :class:`RuleContext` (set with :meth:`context`).
        log: emitted active nodes and ghosts, in order (the JVP graph's ``JVP_LOG``).
        ghost_links: real node → ghosts that a tangent sum dropped into it (their cotangent is
            its own; the JVP graph's ``GHOST_LINKS``).
    """

    #: node kind of values that carry the linear (differentiated) data in this graph
    active_kind = "tangent"

    def __init__(self, graph: Graph, fake_mode: Any, ghosts: list[Ghost]):
        self.graph = graph
        self.fake_mode = fake_mode
        self.ghosts = ghosts
        self.ctx = RuleContext()
        self.log: list[Node | GhostValue] = []
        self.ghost_links: dict[Node, list[GhostValue]] = {}

    # -- rule context ------------------------------------------------------------------------
    def context(self, **changes: Any) -> _ContextBlock:
        """Within the block, emit with the current context updated by ``changes`` (fields of
        :class:`RuleContext`); the previous context is restored on leaving. The ``with``
        statement's target is the new context.

        Raises:
            TypeError: for a name that is not a field of :class:`RuleContext`.
        """
        return _ContextBlock(self, _updated(self.ctx, changes))

    # -- hooks -------------------------------------------------------------------------------
    def import_arg(self, a: Any) -> Any:
        """The value to use in this graph for argument ``a`` (builders over another graph's
        values import them here)."""
        return a

    def kind_for(self, args_flat: list[Any]) -> str:
        """``KIND`` of a node made from ``args_flat``: active when any argument is."""
        active = any(
            isinstance(a, Node) and a.meta.get(KIND) == self.active_kind for a in args_flat
        )
        return self.active_kind if active else "coef"

    def role_for(self, kind: str, args_flat: list[Any]) -> str:
        """``ROLE`` of a node of ``kind`` made from ``args_flat``: the context's role."""
        return self.ctx.role

    # -- emission ----------------------------------------------------------------------------
    def _fake(self, op: Any, args: Any, kwargs: Any) -> Any:
        """The op's output as FakeTensors (:func:`fake_output` over the arguments' values; the
        shape cache keyed without mapping the arguments to their values, which a hit skips)."""
        return _cached(
            self.fake_mode,
            op,
            _shape_key(op, args, kwargs, value_key),
            lambda: (tree_map(value_of, args), tree_map(value_of, kwargs)),
        )

    def call(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        """Emit ``op(*args, **kwargs)``; returns the new node, or a GhostValue."""
        if type(self).import_arg is not Builder.import_arg:
            args = tree_map(self.import_arg, args)
            kwargs = tree_map(self.import_arg, kwargs)
        flat = leaves((args, kwargs))
        # (most calls have no ghost argument: the lists below are made only where one has)
        if self.ctx.ghost or any(isinstance(a, GhostValue) for a in flat):
            ghosts = [a for a in flat if is_ghost(a)]
            active = [
                a for a in flat if isinstance(a, Node) and a.meta.get(KIND) == self.active_kind
            ]
            if (ghosts and not active) or self.ctx.ghost:
                return self._ghost(op, args, kwargs, flat)
            # a real tangent beside a ghost: the ghost is a zero here
            args = tree_map(lambda a: self.zeros_like(a) if is_ghost(a) else a, args)
            kwargs = tree_map(lambda a: self.zeros_like(a) if is_ghost(a) else a, kwargs)
            flat = leaves((args, kwargs))
        out = self._fake(op, args, kwargs)
        node = emit(self.graph, op, tuple(args), dict(kwargs))
        # the arguments' kinds and PARAM_DERIVED read in one walk (no ghost is left among
        # them here): kind_for's and _param_derived's, where kind_for is the base's
        active_kind = self.active_kind
        derived = True
        is_active = False
        for a in flat:
            if isinstance(a, Node):
                m = a.meta
                if derived and not m.get(PARAM_DERIVED, False):
                    derived = False
                if not is_active and m.get(KIND) == active_kind:
                    is_active = True
        if type(self).kind_for is Builder.kind_for:
            kind = active_kind if is_active else "coef"
        else:
            kind = self.kind_for(flat)
        ctx = self.ctx
        meta = node.meta
        meta["val"] = out
        meta[KIND] = kind
        meta[ROLE] = self.role_for(kind, flat)
        meta[SOURCE] = ctx.source
        meta[MODULE] = ctx.module
        meta[PARAM_DERIVED] = derived
        if kind == active_kind:
            self.log.append(node)
        return node

    def _ghost(self, op: Any, args: Any, kwargs: Any, flat: list[Any]) -> GhostValue:
        out = self._fake(op, args, kwargs)
        name = f"ghost_{next(ghost_ids)}"
        cost = op_cost(op, args, kwargs, out)
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
        inputs = tuple(a.name for a in flat if isinstance(a, Node) or is_ghost(a))
        role = self.role_for(self.active_kind, flat)
        ctx = self.ctx
        rec = Ghost(name, _op_str(op), shape, ctx.source, ctx.module, role, cost, inputs)
        self.ghosts.append(rec)
        active = any(
            (isinstance(a, Node) and a.meta.get(KIND) == self.active_kind)
            or (is_ghost(a) and a.kind == self.active_kind)
            for a in flat
        )
        kind = self.active_kind if active else "coef"
        g = GhostValue(out, op, args, kwargs, rec, _param_derived(flat), kind)
        self.log.append(g)
        return g

    def getitem(self, multi: Node, i: int) -> Node:
        """Element ``i`` of a multi-output primal node (reusing an existing ``getitem``)."""
        for u in multi.users:
            if u.target is operator.getitem and u.args[1] == i:
                return self.import_arg(u)
        with self.graph.inserting_after(multi):
            node = self.graph.call_function(operator.getitem, (multi, i))
        node.meta.update({k: v for k, v in multi.meta.items() if k != "val"})
        node.meta["val"] = multi.meta["val"][i]
        return self.import_arg(node)

    # -- tangent algebra ---------------------------------------------------------------------
    def add(self, x: Any, y: Any) -> Any:
        """Sum of two tangents where ``None`` is a symbolic zero and a ghost adds nothing."""
        if x is None or (is_ghost(x) and not is_ghost(y) and y is not None):
            return self._link(y, x)
        if y is None or (is_ghost(y) and not is_ghost(x)):
            return self._link(x, y)
        return self.call(aten.add.Tensor, x, y)

    def _link(self, real: Any, ghost: Any) -> Any:
        if is_ghost(ghost) and isinstance(real, Node):
            self.ghost_links.setdefault(real, []).append(ghost)
        return real

    def sub(self, x: Any, y: Any) -> Any:
        """Difference of two tangents (``None`` a symbolic zero, a ghost subtracts nothing)."""
        if y is None:
            return x
        if x is None or (is_ghost(x) and not is_ghost(y)):
            return self._link(self.call(aten.neg.default, y), x)
        if is_ghost(y) and not is_ghost(x):
            return self._link(x, y)
        return self.call(aten.sub.Tensor, x, y)

    def sum_to(self, x: Any, target: tuple[int, ...]) -> Any:
        """Sum ``x`` over the dims along which a value of shape ``target`` was broadcast."""
        src = tuple(value_of(x).shape)
        target = tuple(target)
        if src == target:
            return x
        lead, kept = reduced_dims(src, target)
        dims = lead + kept
        if dims:
            x = self.call(aten.sum.dim_IntList, x, dims, True)
        if tuple(value_of(x).shape) != target:
            x = self.call(aten.view.default, x, list(target))
        return x

    def as_ghost(self, v: Any) -> Any:
        """A ghost standing for ``v`` (a node), of kind ``cotangent`` when ``v`` is a cotangent
        and ``coef`` otherwise; ``None`` and ghosts are returned as they are."""
        if v is None or is_ghost(v):
            return v
        kind = "cotangent" if v.meta.get(KIND) == "cotangent" else "coef"
        return GhostValue(v.meta["val"], param_derived=v.meta.get(PARAM_DERIVED, False), kind=kind)

    def full(self, shape: list[int], value: float, like: Any) -> Any:
        """``aten.full`` of ``shape`` filled with ``value``, in ``like``'s dtype and device."""
        v = value_of(like)
        return self.call(aten.full.default, list(shape), value, dtype=v.dtype, device=v.device)

    def zeros(self, shape: Any, like: Any) -> Any:
        """Zeros of ``shape`` in ``like``'s dtype and device."""
        return self.full(list(shape), 0.0, like)

    def zeros_like(self, a: Any) -> Any:
        """Zeros of ``a``'s shape, dtype and device."""
        return self.zeros(tuple(value_of(a).shape), a)


#: the attribute of a fake mode holding its shape cache, {(op, argument metadata) -> FakeTensor
#: output(s)} (on the mode itself: a table keyed by the mode would hold every mode for good,
#: the cached tensors naming theirs)
_SHAPE_CACHE = "_graphflop_shape_cache"
#: per :func:`shape_cache_scope` entered, the fake modes given a shape cache inside it
_SCOPES: list[list[Any]] = []


@contextlib.contextmanager
def shape_cache_scope() -> Iterator[None]:
    """Drop, on leaving, the shape caches made inside (:func:`fake_output`). A cache's
    FakeTensors name their fake mode, which holds the cache: a cycle the collector cannot
    always see through (a view's base is held from C++), so without this each fake mode and
    every tensor cached for it would stay alive for good (``analyze`` runs in one; measured:
    a 3-block GPT-2's analysis left 0.35 MiB behind each time). Work after the scope on
    the same mode only caches anew."""
    made: list[Any] = []
    _SCOPES.append(made)
    try:
        yield
    finally:
        _SCOPES.remove(made)
        for mode in made:
            mode.__dict__.pop(_SHAPE_CACHE, None)


def fake_output(fake_mode: Any, op: Any, vals: Any, kvals: Any) -> Any:
    """``op(*vals, **kvals)`` on FakeTensors in ``fake_mode``, from the shape cache when the
    same op has run on arguments of the same shapes, strides and dtypes (a transformer's 48
    blocks emit the same calls 48 times; a FakeTensor dispatch costs about a millisecond, a
    view's too)."""
    return _cached(fake_mode, op, _shape_key(op, vals, kvals, meta_key), lambda: (vals, kvals))


def _cached(fake_mode: Any, op: Any, key: Any, values: Any) -> Any:
    """The shape cache's entry for ``key``, else a new FakeTensor of the metadata
    :data:`_OUTPUTS` keeps for ``key``, else ``op`` run in ``fake_mode`` on ``values()``
    (``(args, kwargs)`` of FakeTensors); the result kept under ``key`` unless it is None."""
    cache = fake_mode.__dict__.get(_SHAPE_CACHE)
    if cache is None:
        cache = {}
        setattr(fake_mode, _SHAPE_CACHE, cache)
        if _SCOPES:
            _SCOPES[-1].append(fake_mode)
    if key is not None:
        try:  # (hashed here once: an unhashable argument, a list of lists, is not cached)
            hit = cache.get(key)
        except TypeError:
            key = hit = None
        if hit is not None:
            return hit
        made = _OUTPUTS.get(key) if key is not None else None
        if made is not None:
            fresh = cache[key] = fresh_fake(fake_mode, *made)
            return fresh
    vals, kvals = values()
    out: Any = None
    view = key is not None and op in _VIEW_OPS and _plain_view_input(fake_mode, vals, kvals)
    if view:
        layout = _VIEW_LAYOUTS.get(key)
        if layout is not None:
            out = _view_output(fake_mode, op, vals, layout)
    if out is None:
        with fake_mode:
            out = op(*vals, **kvals)
        if view:
            _note_view(key, vals[0], out)
    if key is not None:
        cache[key] = out
        if (
            type(out) is FakeTensor
            and not out._is_view()
            and not out.requires_grad
            and out.constant is None
            and out.storage_offset() == 0
        ):
            if len(_OUTPUTS) > 100_000:
                _OUTPUTS.clear()
            _OUTPUTS[key] = (tuple(out.shape), out.stride(), out.dtype, out.device)
    return out


#: the view ops :func:`_view_output` makes the output of: per op, the op that reaches the
#: Python dispatch key on a FakeTensor (``reshape``, a composite, reaches it as ``view``
#: where it makes a view)
_VIEW_OPS = {
    aten.permute.default: aten.permute.default,
    aten.view.default: aten.view.default,
    aten.expand.default: aten.expand.default,
    aten.reshape.default: aten.view.default,
    aten.unsqueeze.default: aten.unsqueeze.default,
    aten.squeeze.dim: aten.squeeze.dim,
    aten.squeeze.dims: aten.squeeze.dims,
    aten.transpose.int: aten.transpose.int,
    aten.t.default: aten.t.default,
}

#: a shape cache key of a view op of :data:`_VIEW_OPS` -> the layout of its output, a view of
#: its input, ``(shape, strides, storage offset)``, as the fake mode's dispatch made it: for
#: the process (its first call of a key dispatches through the mode), as FakeTensorMode keeps
#: its own cache, whose entries are the same function of the same metadata (a view's output
#: metadata is one of the input's and the constant arguments), and as :data:`_OUTPUTS`
_VIEW_LAYOUTS: dict[Any, tuple] = {}


class _GiveOutput(TorchDispatchMode):
    """A dispatch mode that answers the first call of ``op`` that reaches it with ``out``
    (made beforehand), and runs every other call as it would run without it (``prim.device``,
    which the view bookkeeping asks of a FakeTensor, answered as the fake mode answers it:
    the tensor's fake device)."""

    def __init__(self, op: Any, out: torch.Tensor) -> None:
        super().__init__()
        self.op, self.out = op, out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is self.op:
            self.op = None  # answered: once
            return self.out
        if func is _PRIM_DEVICE and type(args[0]) is FakeTensor:
            return args[0].fake_device
        return func(*args, **(kwargs or {}))


_PRIM_DEVICE = torch.ops.prim.device.default


def _plain_view_input(fake_mode: Any, vals: Any, kvals: Any) -> bool:
    """Whether a view op's arguments ``vals``, ``kvals`` are what :func:`_view_output` makes
    the output for: one FakeTensor of ``fake_mode`` first (strided, not requiring grad, no
    constant, no conjugate or negative bit, no symbolic shapes), then constants only, and no
    keyword arguments."""
    x = vals[0] if vals else None
    return not (
        kvals
        or type(x) is not FakeTensor
        or x.fake_mode is not fake_mode
        or x.requires_grad
        or x.constant is not None
        or x.layout is not torch.strided
        or x.is_conj()
        or x.is_neg()
        or fake_mode.shape_env is not None
        or any(isinstance(a, torch.Tensor) for a in leaves(vals[1:]))
    )


def _view_output(fake_mode: Any, op: Any, vals: Any, layout: tuple) -> Any:
    """``op(*vals)`` in ``fake_mode`` for a view op of :data:`_VIEW_OPS` whose output has the
    ``layout`` (:data:`_VIEW_LAYOUTS`) on its input's storage, arguments as
    :func:`_plain_view_input` allows, in about half the time a dispatch through the fake mode
    takes (that is mostly the fake mode's cache key, worked out from the arguments again: about
    130 us): the FakeTensor of that layout on the input's storage made as the fake mode's
    cache makes it (``set_`` of the storage on an empty meta tensor), and the op then
    dispatched with a mode that answers it with that tensor, so that the view bookkeeping
    above the Python key makes it a view of the input as it does the fake mode's (the same
    tensor: class, layout, storage, view base, dispatch keys, attributes). None where the op
    did not reach the mode as expected (the caller then dispatches through the fake mode)."""
    x = vals[0]
    shape, stride, offset = layout
    with torch._C._DisableTorchDispatch():
        made = torch.empty(0, dtype=x.dtype, device="meta")
        made.set_(x.untyped_storage(), offset, shape, stride)
    out = new_fake(fake_mode, made, x.device)
    mode = _GiveOutput(_VIEW_OPS[op], out)
    with mode:
        viewed = op(*vals)
    return viewed if viewed is out and mode.op is None else None


def _note_view(key: Any, x: Any, out: Any) -> None:
    """Keep in :data:`_VIEW_LAYOUTS` under ``key`` the layout of ``out``, the fake mode's
    output of a view op on ``x``, where it is a FakeTensor viewing ``x``'s storage (not a
    ``reshape``'s copy)."""
    if (
        type(out) is FakeTensor
        and out._is_view()
        and not out.requires_grad
        and out.untyped_storage()._cdata == x.untyped_storage()._cdata
    ):
        if len(_VIEW_LAYOUTS) > 100_000:
            _VIEW_LAYOUTS.clear()
        _VIEW_LAYOUTS[key] = (tuple(out.shape), out.stride(), out.storage_offset())


#: a shape cache key -> the metadata of the op's output, ``(shape, strides, dtype, device)``,
#: where it is one new tensor (not a view, no gradient, no constant value): for the process,
#: as PyTorch keeps FakeTensorMode's own cache. Across analyses, and across fake modes (each
#: analysis has its own), a key's first call in a mode is then a :func:`~graphflop.meta.
#: fresh_fake` (about 40 us) instead of a dispatch through the mode (about 100 us when the
#: mode's cache has it, its key worked out again from the arguments): a ResNet-18's
#: derivative graphs make about 200 such calls.
_OUTPUTS: dict[Any, tuple] = {}


def _shape_key(op: Any, args: Any, kwargs: Any, key_of: Any) -> Any:
    """A key of an op call by its arguments' metadata (``key_of``: :func:`meta_key` for
    values, :func:`value_key` for graph nodes: equal keys either way), or None (do not cache);
    it may be unhashable (:func:`_cached` then does not cache either).

    Only ops whose output metadata is a function of the inputs' metadata are cached: views and
    computations, not ops reading tensor values (``nonzero``, ``item``)."""
    if op in _UNCACHED:
        return None
    try:
        return (op, key_of(args), key_of(kwargs))
    except TypeError:  # a value-carrying FakeTensor
        return None


_UNCACHED = {aten.nonzero.default, aten._local_scalar_dense.default}


def _param_derived(flat: list[Any]) -> bool:
    """A value computed from parameters (and constants) only: its cotangent is a weight
    gradient."""
    return all(a.meta.get(PARAM_DERIVED, False) for a in flat if isinstance(a, Node) or is_ghost(a))


def _op_str(op: Any) -> str:
    from graphflop.ops import op_name

    return op_name(op)
