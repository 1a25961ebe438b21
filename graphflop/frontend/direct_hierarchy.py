"""The forward hierarchy built straight from ``make_fx``'s graph, without the flat forward.

:func:`build_direct` gives the :class:`~graphflop.meta.Hierarchy` that
:func:`graphflop.frontend.hierarchy.build` reads back from the flat graph
(:func:`~graphflop.frontend.export_form.from_make_fx` with each outlined call expanded), each
call kept one ``graphflop::repeat`` node: what survives of a call's template (its *variant*)
is worked out once per distinct (template, outputs read) and shared by the calls that read
the same outputs. Its top-level graph (:attr:`Hierarchy.graph`) is node for node, name for name
the one :func:`~graphflop.frontend.hierarchy.build` makes, with the graph keys
:func:`~graphflop.frontend.export_form.from_make_fx` writes on the flat graph (``SIGNATURE``,
``CONSTANTS``, ``LOSS_KIND``, ``FACTS``, ``UNUSED``, the dead code's cost included).

Buffer writes are the flat form's: a template's ``copy_`` of one of its values into a
placeholder (batch norm's running statistics in training) is not copied, its value the call's
result after the template's outputs (as :func:`~graphflop.frontend.hierarchy.expand` reads
it); the top level's ``copy_`` into a buffer's placeholder (of a call's output through the
stub's functional ``copy``, which the flat form leaves out: ``num_batches_tracked``) is not
copied either; each value written is the buffer's update, the flat graph's outputs before the
model's, in the order written. Where the flat form rewrites what a call's copies would be (an
in-place op that ``functionalize_inplace`` would rewrite, a write into anything but a buffer,
a buffer written twice or read after its write, a view ``_fold_regenerated_views`` could fold,
a call inside a checkpoint or custom Function, a template returning one value twice), it returns
None and the caller takes the flat path
(:func:`graphflop.frontend.trace._forward_and_hierarchy`).

Writes on the templates' nodes :data:`~graphflop.meta.MODULE` (relative to the called module,
as :class:`~graphflop.frontend.outline.Expansion` does); on the top-level graph's nodes the
annotations :func:`~graphflop.frontend.export_form.from_make_fx` writes on the flat graph's.

:func:`flat_forward` makes the flat forward on demand from a hierarchy :func:`build_direct`
made, exactly the flat path's graph (names, annotations, graph keys), from what the build
records beside it: ``make_fx``'s namespace before any copy's name was claimed (the copies' names
are claimed again, call by call, as ``Expansion`` claims them), each call's module stacks and
the names of the ``getitem`` nodes the flat form completes among its copies.
"""

from __future__ import annotations

import operator
import re
import weakref
from typing import Any, cast

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from graphflop.ad.builder import (
    NO_KWARGS,
    ParsedName,
    base_name,
    copy_node,
    emit_named,
    find_row,
    makes_nodes,
    new_node,
    node_parts,
    parse_names,
    take_again,
    take_names,
    take_parsed,
)
from graphflop.frontend.composite import getitem_tag
from graphflop.frontend.export_form import (
    _frozen,
    _kept,
    may_be_param_derived,
    placeholders,
    tag_node,
)
from graphflop.frontend.outline import MARK, Walk, _same_layout, _stack_path, called_at, path_in
from graphflop.frontend.scopes import module_path
from graphflop.meta import (
    CALL_SITE,
    CHECKPOINT,
    COMPOSITE,
    CONSTANTS,
    FACTS,
    FUNCTION,
    HIERARCHY,
    KIND,
    LEAF,
    LOSS_KIND,
    MODULE,
    PARAM_DERIVED,
    ROLE,
    SIGNATURE,
    SOURCE,
    UNUSED,
    CallSite,
    Hierarchy,
    NodeCost,
    Signature,
    graph_module,
)
from graphflop.ops import MissingRuleError
from graphflop.ops.recurrent import inplace_twin

__all__ = ["build_direct", "flat_forward"]

aten = torch.ops.aten


class _Unsupported(Exception):
    """The flat form would rewrite something the direct build does not model."""


def _rewritten(n: Node) -> bool:
    """``n``'s op is one the flat form may rewrite or turn into a buffer write."""
    if n.op != "call_function":
        return False
    return n.target is aten.copy_.default or (bool(n.args) and inplace_twin(n.target) is not None)


def _call_of(n: Node) -> tuple[list[Node], int]:
    """A ``repeat`` node's arguments: the call's tensors, its template's key."""
    tensors, key = n.args
    return cast(list, tensors), cast(int, key)


def _output_of(n: Node) -> tuple[Node, int]:
    """A call's ``getitem`` node's arguments: the call, the output's index."""
    return cast(Node, n.args[0]), cast(int, n.args[1])


#: ``torch.fx.map_arg`` without its Python frame, where this PyTorch has its C function
_fx_map_arg: Any = getattr(torch._C, "_fx_map_arg", map_arg)

#: torch.fx's reading of a name: its base and number (``add_7``: ``add``, 7)
_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")


def _base(name: str) -> str:
    """The base fx numbers ``name`` from: names of other bases never take its numbers."""
    m = _NAME.match(name)
    if m is None:
        raise _Unsupported(f"a node name fx reads otherwise: {name}")
    return m.group(1)


def _is_view(n: Node) -> bool:
    return n.op == "call_function" and bool(getattr(n.target, "is_view", False))


class _Template:
    """What the direct build reads of one template graph, worked out once."""

    def __init__(self, graph: Graph):
        self.nodes = list(graph.nodes)
        self.phs = [t for t in self.nodes if t.op == "placeholder"]
        self.ph_index = {t: i for i, t in enumerate(self.phs)}
        out = self.nodes[-1]
        self.outs = list(out.args[0])
        if len(set(self.outs)) != len(self.outs) or not all(isinstance(a, Node) for a in self.outs):
            raise _Unsupported("a template's outputs repeat or are not values")
        for t in self.outs:
            if t.op != "placeholder" and isinstance(t.meta.get("val"), (tuple, list)):
                raise _Unsupported("a template returns a multi-output op's tuple")
        self.body = [t for t in self.nodes if t.op not in ("placeholder", "output")]
        #: a multi-output op: the flat form may complete getitem nodes among the copies
        self.multi = any(isinstance(t.meta.get("val"), (tuple, list)) for t in self.body)
        self._find_writes()
        self.bases = {_base(t.name) for t in [*self.outs, *self.written] if t.op != "placeholder"}
        self.named: list[Node] = []
        self.names: list[str] = []
        self.parsed: list[ParsedName] = []
        # (rel, inner) per module path relative to the call, in the order Expansion meets them
        # (its last inner for each path)
        inner_of: dict[str, tuple] = {}
        self.inner: dict[Node, tuple] = {}
        for t in self.body:
            if CHECKPOINT in t.meta:
                raise _Unsupported("a checkpoint inside a block")
            if _rewritten(t) and t not in self.write_nodes:
                raise _Unsupported("a buffer write or in-place op inside a block")
            rel = module_path(t, wrapped=False) or MARK
            t.meta[MODULE] = rel
            inner_of[rel] = self.inner[t] = tuple(
                (path[len(MARK) + 1 :], cls)
                for path, cls in (t.meta.get("nn_module_stack") or {}).values()
                if path != MARK
            )
        self.inner_of = inner_of
        self._check_unread_views()
        self.view_outputs = {
            i for i, t in enumerate(self.outs) if _is_view(t) and len(t.users) == 1
        }
        #: the views of the call's arguments (their copies' arguments are top-level nodes)
        self.boundary_views = [
            t
            for t in self.body
            if _is_view(t) and all(a.op == "placeholder" for a in t.all_input_nodes)
        ]
        self.variants: dict[frozenset, tuple] = {}
        self.derived: dict[tuple, dict[Node, bool]] = {}
        self._kept: dict[tuple, frozenset[Node]] = {}
        self._completed: dict[tuple, int] = {}

    def completed(self, items: tuple) -> int:
        """How many getitem nodes the flat form completes among a variant's copies (its
        ``items``, :meth:`variant`), counted once per variant."""
        got = self._completed.get(items)
        if got is None:
            got = self._completed[items] = sum(1 for _, out in items if out is not None)
        return got

    def kept(self, items: tuple) -> frozenset[Node]:
        """The template nodes a variant's ``items`` (:meth:`variant`) copy, once per variant."""
        got = self._kept.get(items)
        if got is None:
            got = self._kept[items] = frozenset(self.nodes[i] for i, out in items if out is None)
        return got

    def _find_writes(self) -> None:
        """The template's buffer writes: a ``copy_`` of one of its values into a placeholder
        (batch norm's running statistics in training), which the flat form does not copy: the
        value is the buffer's update (an output of the flat graph) and the call's result after
        the template's outputs (:func:`graphflop.frontend.hierarchy.expand`). Refused where the
        template reads the placeholder after writing it (the flat form's copies would read the
        value written), writes it twice, or writes a placeholder or one of its outputs."""
        #: per buffer write, in the template's order: the placeholder written, the value
        self.writes: list[tuple[Node, Node]] = []
        self.write_nodes: set[Node] = set()
        position = {t: i for i, t in enumerate(self.nodes)}
        for t in self.body:
            if t.target is not aten.copy_.default or t.args[0] not in self.ph_index:
                continue
            ph, value = t.args[0], t.args[1] if len(t.args) == 2 else None
            if t.users or t.kwargs or not isinstance(value, Node) or value.op == "placeholder":
                raise _Unsupported("a buffer write of another form inside a block")
            if value in self.outs or any(w is ph or v is value for w, v in self.writes):
                raise _Unsupported("a buffer written twice, or with an output, inside a block")
            if any(position[u] > position[t] for u in ph.users):
                raise _Unsupported("a buffer read after its write inside a block")
            self.writes.append((ph, value))
            self.write_nodes.add(t)
        #: the values written, in order: the call's results after its outputs
        self.written = [v for _, v in self.writes]

    def claim(self, bases: set[str]) -> None:
        """Claim, at each call, the names of the nodes whose names have one of ``bases``: the
        copies whose names the direct build needs are the outputs', and Expansion's names for
        them depend only on the names it claims of the same base before them (at any call of
        any template)."""
        self.named = [t for t in self.body if _base(t.name) in bases]
        self.names = [t.name for t in self.named]
        self.parsed = parse_names(self.names)  # (read once, taken at every call)

    def _check_unread_views(self) -> None:
        """Refuse a view nothing in the template reads that ``_fold_regenerated_views`` could
        fold on (it folds a later view of the same op and arguments into it): one reading a
        placeholder (which a call may pass as another's argument), or one a later view of the
        template repeats (the copies' other arguments are the call's own nodes). One reading
        outputs only (``detach`` of a ReLU's output) is checked call by call
        (:func:`_check_call_views`: a later view may view the same output again); one reading
        an output and another of the template's nodes only its own call's view can repeat."""
        self.unread_output_views: list[Node] = []
        outs = set(self.outs)
        unread: set[tuple] = set()
        for t in self.body:
            if not _is_view(t):
                continue
            try:
                key = (t.target, _frozen(t.args), _frozen(t.kwargs))
                hash(key)
            except TypeError:
                raise _Unsupported("a view with arguments that do not hash") from None
            if key in unread:
                raise _Unsupported("a view repeating an unread one inside a block")
            if not t.users:
                if any(a.op == "placeholder" for a in t.all_input_nodes):
                    raise _Unsupported("an unread view of a block's argument")
                if all(a in outs for a in t.all_input_nodes):
                    self.unread_output_views.append(t)
                unread.add(key)

    def variant(self, used: frozenset) -> tuple:
        """``(items, placeholders read, dead code's cost)`` of a call whose outputs ``used``
        (template nodes) are read: the template's nodes dead-code elimination keeps, as
        :class:`~graphflop.meta.Hierarchy` lists them (with the ``getitem`` nodes the flat form
        completes)."""
        got = self.variants.get(used)
        if got is not None:
            return got
        from graphflop.ops.cost import op_cost, value_of
        from graphflop.ops.tree import tree_map

        live: set[Node] = set(used) | set(self.written)  # (the flat graph returns them)
        dead = NodeCost()
        for t in reversed(self.body):
            if t in self.write_nodes:  # (not copied: the value written stands for it)
                continue
            if t in live or _kept(t) or any(u in live for u in t.users):
                live.add(t)
                continue
            args, kwargs = tree_map(value_of, t.args), tree_map(value_of, t.kwargs)
            try:
                dead = dead + op_cost(t.target, args, kwargs, t.meta.get("val"))
            except MissingRuleError:
                pass
        items: list[tuple[int, int | None]] = []
        read: set[int] = set()
        for index, t in enumerate(self.nodes):
            if t not in live or t.op != "call_function":
                continue
            items.append((index, None))
            for a in t.all_input_nodes:
                if a.op == "placeholder":
                    read.add(self.ph_index[a])
            val = t.meta.get("val")
            if isinstance(val, (tuple, list)):
                have = {u.args[1] for u in t.users if u.target is operator.getitem and u in live}
                items.extend(
                    (index, i)
                    for i, v in enumerate(val)
                    if i not in have and isinstance(v, torch.Tensor)
                )
        got = self.variants[used] = (tuple(items), frozenset(read), dead)
        return got

    def param_derived(self, pattern: tuple[bool, ...]) -> dict[Node, bool]:
        """Each template node's ``PARAM_DERIVED`` at a call whose arguments' are ``pattern``."""
        got = self.derived.get(pattern)
        if got is None:
            got = dict(zip(self.phs, pattern))
            for t in self.body:
                got[t] = may_be_param_derived(t) and all(got[a] for a in t.all_input_nodes)
            self.derived[pattern] = got
        return got


def build_direct(
    gm: GraphModule,
    templates: dict[int, Graph],
    model: nn.Module,
    *,
    params: list[str],
    buffers: list[str],
    n_inputs: int,
    loss_kind: str,
    target_nodes: list,
    prefix: str = "model",
    walk: Walk | None = None,
) -> Hierarchy | None:
    """The :class:`~graphflop.meta.Hierarchy` of ``make_fx``'s graph ``gm`` (its outlined calls
    of ``templates``, for ``model``), as :func:`graphflop.frontend.hierarchy.build` makes it
    from the flat graph :func:`~graphflop.frontend.export_form.from_make_fx` gives (the same
    keyword arguments), without making that graph; the graph keys ``from_make_fx`` writes are on
    :attr:`Hierarchy.graph`'s ``meta``. None when ``gm`` has no outlined call, or where the flat
    form rewrites what the direct build does not model (see the module docstring). ``gm`` is
    left as it was (its node names are claimed on a copy of its namespace). ``walk``:
    ``model``'s :class:`~graphflop.frontend.outline.Walk`, current (its module paths), where
    the caller has one."""
    try:
        return _build(
            gm, templates, model, params, buffers, n_inputs, loss_kind, target_nodes, prefix, walk
        )
    except _Unsupported:
        return None


def _build(
    gm: GraphModule,
    templates: dict[int, Graph],
    model: nn.Module,
    params: list[str],
    buffers: list[str],
    n_inputs: int,
    loss_kind: str,
    target_nodes: list,
    prefix: str,
    walk: Walk | None = None,
) -> Hierarchy | None:
    call_op = torch.ops.graphflop.repeat.default
    old = gm.graph
    calls = [n for n in old.nodes if n.op == "call_function" and n.target is call_op]
    if not calls:
        return None
    keys = sorted(templates)
    tpl = {k: _Template(templates[k]) for k in keys}
    bases = set().union(*(t.bases for t in tpl.values()))
    call_set = set(calls)
    # a multi-output op at the top level: the flat form may complete its getitem nodes, named
    # after every getitem the flat graph made before (the copies' included)
    multi = any(
        n.op == "call_function"
        and n not in call_set
        and isinstance(n.meta.get("val"), (tuple, list))
        for n in old.nodes
    )
    # (the getitem nodes completed among a call's copies: named for flat_forward)
    multi = multi or any(t.multi for t in tpl.values())
    if multi:
        bases.add("getitem")
    for t in tpl.values():
        t.claim(bases)
    g = Graph()
    env, _phs, sig_params, sig_buffers, model_inputs, target_names, constants = placeholders(
        gm, g, params=params, buffers=buffers, n_inputs=n_inputs, target_nodes=target_nodes
    )
    d = _Direct(old, tpl, call_set, set(env))
    d.buffer_of = {_phs[len(params) + i]: b for i, b in enumerate(buffers)}
    d.refuse_rewrites()
    d.check_writes()
    d.find_live()
    _check_folds(old, d.preset, d.call_set, tpl)
    sites = _Sites(old, model, prefix, {k: i for i, k in enumerate(keys)}, walk)
    before = sites.namespace.copy()  # (for flat_forward: every copy's name)
    d.claim_names(sites.namespace, multi)
    fixed = {name for name, _ in sig_params} | {name for name, _ in sig_buffers}
    param_names = dict(sig_params)
    top: list[Any] = []
    for n in g.nodes:  # the placeholders, tagged as _tag_nodes tags them
        tag_node(n, n.name, "", n.name in fixed, param_names)
        top.append(n)
    outs = d.assemble(g, env, sites, top)
    has_loss = loss_kind != "none"
    top_gm = graph_module(torch.nn.Module(), g)
    top_gm.meta[UNUSED] = d.dead_cost
    top_gm.meta[SIGNATURE] = Signature(
        params=tuple(sig_params),
        buffers=tuple(sig_buffers),
        inputs=tuple(model_inputs),
        targets=tuple(target_names),
        loss=d.flat_name.get(outs[0], outs[0].name) if has_loss else None,
        outputs=tuple(d.flat_name.get(r, r.name) for r in outs[1 if has_loss else 0 :]),
        buffer_updates=tuple((d.flat_name.get(v, v.name), b) for b, v in d.updates),
        params_written=(),
    )
    top_gm.meta[CONSTANTS] = constants
    top_gm.meta[LOSS_KIND] = loss_kind
    top_gm.meta[FACTS] = {"traced"}
    _RECORDS[top_gm] = _Record(before, sites.stacks, d.completed)
    return Hierarchy(
        templates=tuple(templates[k] for k in keys),
        variants=tuple(sites.variants),
        sites=tuple(sites.sites),
        top=tuple(top),
        graph=top_gm,
        runs=True,
    )


class _Sites:
    """The call sites as :class:`~graphflop.frontend.outline.Expansion` records them (module
    paths, the names it claims for each call's copies) and their variants' numbers."""

    def __init__(
        self,
        old: Graph,
        model: nn.Module,
        prefix: str,
        position: dict[int, int],
        walk: Walk | None = None,
    ):
        self.namespace = _NamespaceCopy(old)
        self.model, self.prefix, self.position = model, prefix, position
        #: per module (by id), its first path (read only)
        self.walk = walk if walk is not None else Walk(model)
        self.paths: dict[int, str] = self.walk.paths(prefix)
        self.sites: list[CallSite] = []
        self.variants: dict[tuple, int] = {}
        #: per site, its copies' module stack of an inner path (``_call``'s ``stack_of``)
        self.stacks: list[Any] = []

    def submodules(self, called: nn.Module | None) -> dict[str, nn.Module]:
        """The submodules of ``called`` by path (what ``get_submodule`` of each path finds,
        :func:`~graphflop.frontend.outline.path_in`'s look-up), from the walk's tree of it
        where every module in the model walks as ``nn.Module`` does; empty otherwise (each
        path then looked up by ``path_in``)."""
        if called is None or not self.walk.plain:
            return {}
        return dict(self.walk.tree_of(called))


class _Direct:
    """The walks over ``make_fx``'s graph ``old``: what the flat form would rewrite, what
    survives its dead-code elimination, and the top-level graph."""

    def __init__(self, old: Graph, tpl: dict, call_set: set[Node], preset: set[Node]):
        self.old, self.tpl, self.call_set, self.preset = old, tpl, call_set, preset
        self._own: list[Node] | None = None
        self.live: set[Node] = set()
        self.used_of: dict[Node, set[Node]] = {c: set() for c in call_set}
        self.variant_of: dict[Node, tuple] = {}
        self.dead_cost = NodeCost()
        self.flat_name: dict[Node, str] = {}
        #: per call, the names Expansion gives the copies the direct build names
        self.names_of: dict[Node, dict[Node, str]] = {}
        self.getitems: _GetitemNames | None = None
        #: per site, the names of the getitem nodes the flat form completes among its copies
        self.completed: dict[int, list[str]] = {}
        #: ``old``'s buffers' placeholders, and the buffer each stands for
        self.buffer_of: dict[Node, str] = {}
        #: the top level's buffer writes (``copy_`` into a buffer's placeholder) and the
        #: functional copies of a call's output into a buffer (the stub's), which the flat form
        #: leaves out: the value each stands for (a ``copy``'s, the call's output)
        self.stands_for: dict[Node, Node] = {}
        #: the buffer updates in the order the flat form writes them: (buffer, value in ``g``)
        self.updates: list[tuple[str, Node]] = []

    def claim_names(self, namespace: _NamespaceCopy, multi: bool) -> None:
        """The names Expansion claims for the copies (:attr:`names_of`), call by call; where
        ``multi``, the flat graph's getitem names before it completes any (:attr:`getitems`)."""
        for n in self.own_nodes():
            if n in self.call_set:
                t = self.tpl[_call_of(n)[1]]
                self.names_of[n] = dict(zip(t.named, namespace.take(t.parsed)))
        if not multi:
            return
        made: list[str] = []  # the flat graph's nodes named getitem, in the order made
        for n in self.own_nodes():
            if n in self.call_set:
                made.extend(x for x in self.names_of[n].values() if _base(x) == "getitem")
            elif not self.is_output(n) and _base(n.name) == "getitem":
                made.append(n.name)
        self.getitems = _GetitemNames(made)

    def own_nodes(self) -> list[Node]:
        """``old``'s nodes the flat form copies or expands (not its placeholders, constants,
        the nodes that became placeholders, or its output); listed once (``old`` does not
        change while the build walks it)."""
        if self._own is None:
            self._own = [
                n
                for n in self.old.nodes
                if n not in self.preset and n.op not in ("placeholder", "get_attr", "output")
            ]
        return self._own

    def is_output(self, n: Node) -> bool:
        """``n`` is a call's ``getitem``."""
        return n.target is operator.getitem and n.args[0] in self.call_set

    def refuse_rewrites(self) -> None:
        for n in self.own_nodes():
            if n in self.call_set:
                if any(k in n.meta for k in (CHECKPOINT, FUNCTION)):
                    raise _Unsupported("a call inside a checkpoint or custom Function")
                if any(u.target is not operator.getitem for u in n.users):
                    raise _Unsupported("a call's result list used whole")
                if not all(isinstance(x, Node) for x in _call_of(n)[0]):
                    raise _Unsupported("a call's argument that is not a value")
            elif self.is_output(n):
                if LEAF in n.meta:
                    raise _Unsupported("a call's output made a leaf")
            elif n.target is aten.copy_.default and n.args[0] in self.buffer_of:
                value = n.args[1] if len(n.args) == 2 and not n.kwargs and not n.users else None
                if not isinstance(value, Node):
                    raise _Unsupported("a buffer write of another form at the top level")
                self.stands_for[n] = self.stands_for.get(value, value)
            elif _rewritten(n):
                raise _Unsupported("a buffer write or in-place op at the top level")
            elif n.target is aten.copy.default and any(
                isinstance(a, Node) and self.is_output(a) for a in n.args
            ):
                # (the stub's buffer write of a call's output, Expansion.drops: its value the
                # output's, where only buffer writes read it)
                out = n.args[1] if len(n.args) == 2 else None
                if not (
                    isinstance(out, Node)
                    and self.is_output(out)
                    and isinstance(n.args[0], Node)
                    and _same_layout(n, out)
                    and all(u.target is aten.copy_.default for u in n.users)
                ):
                    raise _Unsupported("a copy of a call's output")
                self.stands_for[n] = out

    def writes(self) -> list[tuple[Node, Node, Node | None]]:
        """Every buffer write of the flat form, in its order: ``(where`` (a call, or the top
        level's ``copy_``), the buffer's placeholder in ``old``, the value written in ``old``
        (None for a call's: its template's)``)``."""
        out: list[tuple[Node, Node, Node | None]] = []
        for n in self.own_nodes():
            if n in self.call_set:
                tensors, key = _call_of(n)
                t = self.tpl[key]
                out.extend((n, tensors[t.ph_index[ph]], None) for ph, _ in t.writes)
            elif n.target is aten.copy_.default and n in self.stands_for:
                out.append((n, cast(Node, n.args[0]), self.stands_for[n]))
        return out

    def check_writes(self) -> None:
        """Refuse a write the direct build does not model: into a value other than a buffer
        (a parameter, an input: the flat form's error), twice into one buffer, or into one read
        afterwards (the flat form's later reads read the value written)."""
        position = {n: i for i, n in enumerate(self.old.nodes)}
        written: set[Node] = set()
        for where, ph, _ in self.writes():
            if ph not in self.buffer_of or ph in written:
                raise _Unsupported("a write into a value other than a buffer, or twice")
            if where in self.call_set and sum(a is ph for a in _call_of(where)[0]) > 1:
                # (the flat form's copies reading the other placeholder read the value written)
                raise _Unsupported("a buffer written by a call that gets it twice")
            written.add(ph)
            for u in ph.users:
                if position[u] > position[where] and u not in self.stands_for:
                    raise _Unsupported("a buffer read after its write")

    def read_by(self, n: Node, u: Node) -> bool:
        """``u`` (a node of ``old``) reads ``n`` in the flat graph and survives there."""
        if u not in self.call_set:
            return u in self.live
        tensors, key = _call_of(u)
        reads = self.variant_of[u][1]
        if any(a is n and j in reads for j, a in enumerate(tensors)):
            return True
        t = self.tpl[key]
        # an output that is the call's argument itself, read after the call
        outs = [t.outs[_output_of(w)[1]] for w in u.users if w in self.live]
        return any(o.op == "placeholder" and tensors[t.ph_index[o]] is n for o in outs)

    def find_live(self) -> None:
        """Dead-code elimination of the flat graph, users before producers: per call the
        template outputs read, its variant and the arguments its variant reads; the cost of
        the dead code."""
        from graphflop.ops.cost import op_cost, value_of
        from graphflop.ops.tree import tree_map

        self.live.add(next(n for n in reversed(self.old.nodes) if n.op == "output"))
        # the values written into buffers: the flat graph's outputs (a call's are its variant's)
        self.live.update(v for _, _, v in self.writes() if v is not None)
        for n in reversed(self.own_nodes()):
            if n in self.stands_for:
                continue
            if n in self.call_set:
                t = self.tpl[_call_of(n)[1]]
                v = self.variant_of[n] = t.variant(frozenset(self.used_of[n]))
                if v[0]:
                    self.live.add(n)
                self.dead_cost = self.dead_cost + v[2]
            elif self.is_output(n):
                if n in self.live or any(self.read_by(n, u) for u in n.users):
                    self.live.add(n)
                    call, i = _output_of(n)
                    out = self.tpl[_call_of(call)[1]].outs[i]
                    if out.op != "placeholder":
                        self.used_of[call].add(out)
            elif n in self.live or _kept(n) or any(self.read_by(n, u) for u in n.users):
                self.live.add(n)
            elif n.op == "call_function":
                args, kwargs = tree_map(value_of, n.args), tree_map(value_of, n.kwargs)
                try:
                    cost = op_cost(n.target, args, kwargs, n.meta.get("val"))
                except MissingRuleError:
                    continue
                self.dead_cost = self.dead_cost + cost

    def assemble(self, g: Graph, env: dict, sites: _Sites, top: list) -> list:
        """The top-level graph's nodes after its placeholders (each call's ``repeat`` and
        ``getitem`` nodes as :func:`graphflop.frontend.hierarchy._top_graph` makes them);
        returns the graph's outputs."""
        results: dict[Node, dict[int, Node]] = {}
        for n in self.own_nodes():
            if n in self.stands_for:
                if n.target is aten.copy_.default:  # (a copy's value: a live node's)
                    buffer = self.buffer_of[cast(Node, n.args[0])]
                    self.updates.append((buffer, env[self.stands_for[n]]))
                continue
            if n in self.call_set:
                results[n] = _call(n, g, env, self, sites, top)
                self.completions(n, len(sites.sites) - 1)
                tensors, key = _call_of(n)
                t = self.tpl[key]
                for k, (ph, _) in enumerate(t.writes):
                    buffer = self.buffer_of[tensors[t.ph_index[ph]]]
                    self.updates.append((buffer, results[n][len(t.outs) + k]))
            elif self.is_output(n):
                call, i = _output_of(n)
                tensors, key = _call_of(call)
                out = self.tpl[key].outs[i]
                if out.op == "placeholder":
                    env[n] = env[tensors[self.tpl[key].ph_index[out]]]
                elif n in self.live:
                    env[n] = results[call][i]
            elif n in self.live:
                new = env[n] = copy_node(g, n, env.__getitem__)
                self.flat_name[new] = n.name
                tag_node(new, n.name, module_path(n, wrapped=True), False, {})
                top.append(new)
                self.complete(n, new, g, top)
        out_node = next(n for n in reversed(self.old.nodes) if n.op == "output")
        outs = [env[a] for a in cast(list, out_node.args[0])]
        output = g.output(tuple([*(v for _, v in self.updates), *outs]))
        tag_node(output, "output", module_path(output, wrapped=True), False, {})
        top.append(output)
        return outs

    def complete(self, n: Node, new: Node, g: Graph, top: list) -> None:
        """The ``getitem`` nodes the flat form adds after ``new`` (the copy of ``n``, a
        multi-output op at the top level) for its outputs nothing reads, named and annotated
        as there."""
        val = n.meta.get("val")
        if n.op != "call_function" or not isinstance(val, (tuple, list)):
            return
        have = {u.args[1] for u in n.users if u.target is operator.getitem and u in self.live}
        for i, v in enumerate(val):
            if i in have or not isinstance(v, torch.Tensor):
                continue
            assert self.getitems is not None  # (claim_names saw n)
            name = self.getitems.take()
            item = emit_named(g, operator.getitem, (new, i), name)
            meta = {k: x for k, x in n.meta.items() if k not in ("val", COMPOSITE)}
            meta["val"] = v
            tag = getitem_tag(n, i)
            if tag is not None:
                meta[COMPOSITE] = tag
            item.meta = meta
            self.flat_name[item] = name
            tag_node(item, name, module_path(item, wrapped=True), False, {})
            top.append(item)

    def completions(self, call: Node, site: int) -> None:
        """Advance the getitem names past those the flat form gives ``call``'s copies (site
        ``site``), recording them (:attr:`completed`)."""
        if self.getitems is not None:
            n = self.tpl[_call_of(call)[1]].completed(self.variant_of[call][0])
            if n:
                self.completed[site] = [self.getitems.take() for _ in range(n)]


class _GetitemNames:
    """The names ``_complete_getitems`` gives the getitem nodes it adds to the flat graph, one
    after the other: fx's ``create_name("getitem")`` in a namespace holding ``made`` (the
    flat graph's nodes of that base, in the order made)."""

    def __init__(self, made: list[str]):
        self.used = set(made)
        self.count = 0
        for name in made:
            m = _NAME.match(name)
            if m is not None and m.group(2) is not None:
                self.count = int(m.group(2))

    def take(self) -> str:
        num, name = self.count, "getitem"
        while name in self.used:
            num += 1
            name = f"getitem_{num}"
        self.used.add(name)
        self.count = num
        return name


class _NamespaceCopy:
    """The names :class:`~graphflop.frontend.outline.Expansion` claims in ``make_fx``'s
    graph's namespace, claimed on a copy of it (``gm`` keeps its own)."""

    def __init__(self, graph: Graph | _NamespaceCopy):
        ns = cast(Graph, graph)._graph_namespace  # (a copy has one too)
        copy = type(ns).__new__(type(ns))
        copy.__dict__.update(ns.__dict__)
        copy._used_names = set(ns._used_names)
        copy._base_count = type(ns._base_count)(ns._base_count)
        self._graph_namespace: Any = copy

    def copy(self) -> _NamespaceCopy:
        return _NamespaceCopy(self)

    def take(self, parsed: list[ParsedName]) -> list[str]:
        """The names of :func:`~graphflop.ad.builder.take_parsed`, taken."""
        return take_parsed(self, parsed)[0]  # type: ignore[arg-type]


def _call(n: Node, g: Graph, env: dict, d: _Direct, s: _Sites, top: list) -> dict[int, Node]:
    """Call ``n``'s site, and its ``repeat`` node and ``getitem`` nodes in ``g`` (as
    :func:`graphflop.frontend.hierarchy._top_graph` makes them) where its variant keeps nodes:
    the ``getitem`` node of each output index read."""
    tensors, key = _call_of(n)
    t: _Template = d.tpl[key]
    items, reads, _ = d.variant_of[n]
    number = len(s.sites)
    site = n.meta.get("nn_module_stack") or {}
    site_path = list(site.values())[-1][0] if site else ""
    stacks: dict[tuple, dict] = {}

    called = called_at(s.model, s.prefix, site_path)
    fulls: dict[str, str] = {}  # (each submodule's path looked up once per call)
    subs = s.submodules(called)

    def stack_of(inner: tuple) -> dict:
        got = stacks.get(inner)
        if got is None:
            got = stacks[inner] = dict(site)
            for path, cls in inner:
                full = fulls.get(path)
                if full is None:
                    sub = subs.get(path)
                    full = fulls[path] = (
                        s.paths.get(id(sub), f"{site_path}.{path}")
                        if sub is not None
                        else path_in(called, site_path, path, s.paths)
                    )
                got[full] = (full, cls)
        return got

    modules = {rel: _stack_path(stack_of(inner)) for rel, inner in t.inner_of.items()}
    s.stacks.append(stack_of)
    names = d.names_of[n]
    variant = s.variants.setdefault((s.position[key], items), len(s.variants))
    s.sites.append(CallSite(s.position[key], variant, tuple(modules.items())))
    if not items:
        return {}
    top.append(number)
    args: list[Node | None] = [env[a] if j in reads else None for j, a in enumerate(tensors)]
    call_op = torch.ops.graphflop.repeat.default
    call = emit_named(g, call_op, (args, number), base_name(g, call_op))
    call.meta[CALL_SITE] = (number, -1)
    # (an argument the variant does not read: no node it keeps depends on it)
    pattern = tuple(
        j in reads and bool(env[a].meta.get(PARAM_DERIVED, False)) for j, a in enumerate(tensors)
    )
    pd = t.param_derived(pattern)
    kept = t.kept(items)
    indices = (_output_of(u)[1] for u in n.users if u in d.live)
    results = [*t.outs, *t.written]  # (the values written: the flat graph's outputs)
    read = sorted({i for i in indices if t.outs[i] in kept})
    read += range(len(t.outs), len(results))
    vals: list[Any] = [None] * len(results)
    out: dict[int, Node] = {}
    for i in read:
        vals[i] = results[i].meta.get("val")
    call.meta["val"] = tuple(vals)
    for i in read:
        o = results[i]
        item = emit_named(g, operator.getitem, (call, i), "getitem")
        meta = dict(o.meta)
        meta["nn_module_stack"] = stack_of(t.inner[o])
        meta[KIND] = "primal"
        meta[SOURCE] = names[o]
        meta[MODULE] = modules[o.meta[MODULE]]
        meta[ROLE] = "loss" if meta[MODULE] == "loss" else "forward"
        meta[PARAM_DERIVED] = pd[o]
        item.meta = meta
        d.flat_name[item] = names[o]
        out[i] = item
    return out


def _check_folds(old: Graph, preset: set, call_set: set, tpl: dict) -> None:
    """Raise where ``_fold_regenerated_views`` could fold a view: one nothing reads in the flat
    graph (before dead-code elimination) that a later view repeats (same op and arguments).
    A template's own unread views are refused per template (:class:`_Template`); here a
    call's output view its call leaves unread, and a top-level view nothing reads followed by
    a view of the same op and arguments (top-level, or a call's view of its arguments)."""

    def canon(a: Any) -> Any:
        """The flat graph's value of ``a``: a call's output ``("out", call, i)``, or the
        argument itself where the template returns it."""
        while isinstance(a, Node) and a.target is operator.getitem and a.args[0] in call_set:
            call, i = _output_of(a)
            tensors, key = _call_of(call)
            out = tpl[key].outs[i]
            if out.op != "placeholder":
                return ("out", call, i)
            a = tensors[tpl[key].ph_index[out]]
        return a

    unread: set[tuple] = set()
    for n in old.nodes:
        if n in call_set:
            _check_call_views(n, tpl[_call_of(n)[1]], unread, canon)
            continue
        if n in preset or not _is_view(n):
            continue
        key = _view_key(n, canon)
        if key in unread:
            raise _Unsupported("a view repeating an unread one")
        if not any(u not in call_set or _reads(u, n, tpl) for u in n.users):
            unread.add(key)


def _view_key(n: Node, value: Any) -> tuple:
    """``_fold_regenerated_views``'s key of view ``n``, its nodes mapped by ``value``."""
    try:
        key = (n.target, _frozen(map_arg(n.args, value)), _frozen(n.kwargs))
        hash(key)
    except TypeError:
        raise _Unsupported("a view with arguments that do not hash") from None
    return key


def _check_call_views(call: Node, t: _Template, unread: set, canon: Any) -> None:
    """Raise where ``call`` leaves an output view unread, or one of its copies views an
    argument as a top-level view nothing reads did before."""
    for i in t.view_outputs:
        if not any(u.target is operator.getitem and u.args[1] == i and u.users for u in call.users):
            raise _Unsupported("a call's output view left unread")
    if unread:
        tensors = _call_of(call)[0]
        for v in t.boundary_views:
            if _view_key(v, lambda a: canon(tensors[t.ph_index[a]])) in unread:
                raise _Unsupported("a call's view repeating an unread one")
    for v in t.unread_output_views:  # (a later view of the same output may repeat it)
        unread.add(_view_key(v, lambda a: ("out", call, t.outs.index(a))))


def _reads(call: Node, n: Node, tpl: dict) -> bool:
    """A copy of ``call``'s template reads ``n`` in the flat graph (before dead-code
    elimination), or a node after the call reads it as the call's output."""
    tensors, key = _call_of(call)
    t = tpl[key]
    for j, a in enumerate(tensors):
        if a is not n:
            continue
        ph = t.phs[j]
        if any(u.op != "output" for u in ph.users):
            return True
        if ph in t.outs:
            i = t.outs.index(ph)
            if any(u.target is operator.getitem and u.args[1] == i and u.users for u in call.users):
                return True
    return False


def _named_node(
    g: Graph,
    x: Node,
    args: tuple,
    kwargs: dict,
    name: str,
    parsed: ParsedName,
    num: int | None,
    row: dict[Node, None],
) -> Node:
    """A copy of template node ``x`` in ``g`` with ``args``, ``kwargs`` (no ``meta``) and the
    name ``name``, which :func:`~graphflop.ad.builder.take_parsed` gave from ``parsed`` (the
    template node's name, read) with number ``num``: ``g.create_node(x.op, x.target, args,
    kwargs, name=name, type_expr=x.type)``, the name taken in ``g``'s namespace as fx takes it
    without reading it again (:func:`~graphflop.ad.builder.take_again`; the copies of every
    call would read their names twice: a tenth of the trace's cost per block), then the node
    made and inserted as ``create_node`` makes and inserts it (filed in ``row``, the find_nodes
    table's row of ``x``'s target: :func:`~graphflop.ad.builder.find_row`). Raises
    :class:`_Unsupported` where fx would give another name (taken in ``g`` already).
    ``create_node`` itself where ``g`` has an owning module (its create-node hooks) or this
    torch.fx lacks the parts. (:func:`_flat_forward` makes the common case's copy in line.)"""
    if not makes_nodes(g):
        new = g.create_node(x.op, x.target, args, kwargs, name=name, type_expr=x.type)
    else:
        base = parsed[1]
        if base is None:  # (a name fx cleaned up: its own reading)
            taken = take_names(g, (name,))[0] == name
        else:
            taken = take_again(g, name, base, num)
        if not taken:
            raise _Unsupported("a copy's name taken in the flat graph")
        new = new_node(g, x.op, x.target, name, args, kwargs, x.type, True, row)
    if new.name != name:
        raise _Unsupported("a copy's name taken in the flat graph")
    return new


class _Record:
    """What :func:`build_direct` keeps of a build for :func:`flat_forward`: ``make_fx``'s
    namespace before any copy's name was claimed, per site its ``stack_of`` (the copies'
    module stacks) and the names of the getitem nodes the flat form completes among its
    copies."""

    def __init__(self, namespace: _NamespaceCopy, stacks: list, completed: dict[int, list[str]]):
        self.namespace, self.stacks, self.completed = namespace, stacks, completed


#: per hierarchy :func:`build_direct` made (by its top-level graph), what it recorded
_RECORDS: weakref.WeakKeyDictionary[GraphModule, _Record] = weakref.WeakKeyDictionary()


def flat_forward(h: Hierarchy) -> GraphModule | None:
    """The flat forward graph of a hierarchy :func:`build_direct` made, exactly the one
    ``trace``'s flat path makes (:func:`~graphflop.frontend.export_form.from_make_fx` with the
    calls expanded by :class:`~graphflop.frontend.outline.Expansion`): the same nodes in the
    same order, names, arguments and annotations (each copy's its template node's, with the
    call's module stack, :data:`~graphflop.meta.CALL_SITE` and the flat form's ``KIND``,
    ``SOURCE``, ``MODULE``, ``ROLE``, ``PARAM_DERIVED``), and its graph keys (``SIGNATURE``,
    ``CONSTANTS``, ``LOSS_KIND``, ``FACTS``, ``UNUSED``; ``HIERARCHY`` is ``h``, whose
    top-level nodes share their ``meta`` with the flat graph's, as the flat path's do;
    ``OUTLINED`` is the caller's: ``len(h.sites)`` calls). The copies' names are claimed again,
    call by call, on ``make_fx``'s namespace as it was, as ``Expansion`` claims them.

    None where ``h`` was not made by :func:`build_direct` (or the names it would give are not
    the flat form's), never another graph."""
    record = _RECORDS.get(h.graph) if h.graph is not None else None
    if record is None:
        return None
    try:
        return _flat_forward(h, record)
    except _Unsupported:
        return None


def _written(tnodes: list[Node]) -> list[Node]:
    """The values a template writes into buffers (a ``copy_`` into a placeholder), in order."""
    return [
        cast(Node, x.args[1])
        for x in tnodes
        if x.target is aten.copy_.default and cast(Node, x.args[0]).op == "placeholder"
    ]


def forget(h: Hierarchy) -> None:
    """Drop what :func:`build_direct` recorded for :func:`flat_forward` of ``h`` (after its
    last use): the record's module stacks name the model's modules and its fake tensors, which
    a table keyed by ``h``'s graph would otherwise keep for as long as the graph lives."""
    if h.graph is not None:
        _RECORDS.pop(h.graph, None)


def _plan(
    g: Graph, tnodes: list[Node], items: tuple, at: dict[Node, int], inner: dict, read: list
) -> tuple[list[tuple], list[tuple]]:
    """A variant's ``items`` as :func:`_flat_forward` copies them into ``g`` at each of its
    calls, what every call reads of its template nodes read once, and the inner module
    stacks its copies have (their keys in ``inner``, each once, in the order first met).
    Per item ``(index, out, template node, its place in the template's body, its args, its
    kwargs, its inner stack's place among the keys, the row of ``g``'s find_nodes table its
    copies are filed in, the base of its name as fx reads it (``read``: the template's names
    parsed), its copies' ``meta`` but for what each call sets)`` (the last seven None for a
    getitem the flat form completes). The ``meta`` is the template node's with the keys each
    copy sets (:func:`_flat_forward`) added in the order it sets them, so that a copy of it
    with those keys set holds the same keys in the same order as the template node's
    ``meta`` copied, then set key by key."""
    out: list[tuple] = []
    keys: dict[tuple, int] = {}
    for index, o in items:
        x = tnodes[index]
        if o is None:
            row = find_row(g, x.op, x.target)
            k = keys.setdefault(inner[x], len(keys))
            i = at[x]
            meta = dict(x.meta)
            meta["nn_module_stack"] = None
            meta[CALL_SITE] = None
            meta[KIND] = "primal"
            for key in (SOURCE, MODULE, ROLE, PARAM_DERIVED):
                meta[key] = None
            out.append((index, o, x, i, x.args, x.kwargs, k, row, read[i][1], meta))
        else:
            out.append((index, o, x, None, None, None, None, None, None, None))
    return out, list(keys)


def _complete(g: Graph, parent: Node, x: Node, out: int, name: str, derived: bool) -> None:
    """The getitem the flat form completes at a call: output ``out`` of ``parent`` (the copy
    of template node ``x``) named ``name``, annotated as ``_tag_nodes`` annotates it
    (``derived``: its PARAM_DERIVED, ``x``'s)."""
    new = emit_named(g, operator.getitem, (parent, out), name)
    if new.name != name:
        raise _Unsupported("a copy's name taken in the flat graph")
    meta = {k: v for k, v in parent.meta.items() if k not in ("val", COMPOSITE)}
    meta["val"] = x.meta["val"][out]
    tag = getitem_tag(parent, out)
    if tag is not None:
        meta[COMPOSITE] = tag
    path = parent.meta[MODULE]
    meta[KIND] = "primal"
    meta[SOURCE] = name
    meta[MODULE] = path
    meta[ROLE] = "loss" if path == "loss" else "forward"
    meta[PARAM_DERIVED] = derived
    object.__setattr__(new, "meta", meta)


def _flat_forward(h: Hierarchy, record: _Record) -> GraphModule:
    namespace = record.namespace.copy()
    tnodes = [list(t.nodes) for t in h.templates]
    bodies = [[x for x in ns if x.op not in ("placeholder", "output")] for ns in tnodes]
    candidates = [[x.name for x in body] for body in bodies]
    phs = [[x for x in ns if x.op == "placeholder"] for ns in tnodes]
    # (the values written into buffers: a call's results after its outputs)
    outs = [[*ns[-1].args[0], *_written(ns)] for ns in tnodes]
    inner = [
        {
            x: tuple(
                (path[len(MARK) + 1 :], cls)
                for path, cls in (x.meta.get("nn_module_stack") or {}).values()
                if path != MARK
            )
            for x in body
        }
        for body in bodies
    ]
    # each template node's inputs (all call_function: module paths from their own stacks)
    inputs = [{x: x.all_input_nodes for x in body} for body in bodies]
    if any(x.op != "call_function" for body in bodies for x in body):
        raise _Unsupported("a template node that is not an op")
    derived: dict[tuple, dict[Node, bool]] = {}
    g = Graph()
    env: dict[Node, Node] = {}
    results: dict[Node, list] = {}
    call_op = torch.ops.graphflop.repeat.default
    # each template node's name read once (fx's reading), taken at each call as Expansion takes
    # its copies' names, with the numbers they are taken by in the flat graph
    parsed = [parse_names(names) for names in candidates]
    where = [{x: i for i, x in enumerate(body)} for body in bodies]
    plans = [_plan(g, tnodes[t], items, where[t], inner[t], parsed[t]) for t, items in h.variants]
    names_of = [take_parsed(namespace, parsed[s.template]) for s in h.sites]  # type: ignore[arg-type]
    fast = makes_nodes(g)
    ns = g._graph_namespace if fast else None  # (the parts new_node reads, where it has them)
    used, counts = (ns._used_names, ns._base_count) if ns is not None else (set(), {})
    # (what new_node makes a node with, where the copies are made here in line)
    parts = node_parts(g)
    make = Node.__new__
    for n in h.graph.graph.nodes:
        if n.target is call_op:
            args, number = n.args
            t, items = h.variants[h.sites[number].variant]
            tenv: dict[Node, Node] = {p: env[a] for p, a in zip(phs[t], args) if a is not None}
            (names, nums), stack_of = names_of[number], record.stacks[number]
            read = parsed[t]
            completed = iter(record.completed.get(number, ()))
            # PARAM_DERIVED as _tag_nodes works it out, per template and pattern of the
            # arguments' (those no kept node reads count False: nothing reads them)
            pattern = tuple(
                p in tenv and bool(tenv[p].meta.get(PARAM_DERIVED, False)) for p in phs[t]
            )
            pd = derived.get((t, pattern))
            if pd is None:
                pd = derived[(t, pattern)] = dict(zip(phs[t], pattern))
                for x in bodies[t]:
                    pd[x] = may_be_param_derived(x) and all(pd[a] for a in inputs[t][x])
            plan, keys = plans[h.sites[number].variant]
            # per inner module stack of the variant's copies: the stack at this call, its
            # path (the copies' MODULE: module_path of the node's stack) and role
            stacks = []
            for key in keys:
                stack = stack_of(key)
                path = _stack_path(stack)
                stacks.append((stack, path, "loss" if path == "loss" else "forward"))
            value_of = tenv.__getitem__
            for index, out, x, i, xargs, xkwargs, k, row, base, tmeta in plan:
                if out is not None:  # a getitem the flat form completes
                    _complete(g, tenv[x], x, out, next(completed), pd[x])
                    continue
                name = names[i]
                try:
                    args = _fx_map_arg(xargs, value_of)
                    kwargs = _fx_map_arg(xkwargs, value_of) if xkwargs else NO_KWARGS
                except KeyError:
                    raise _Unsupported("a copy reads a value its call does not pass") from None
                if parts is not None and base is not None:  # (new_node's work, in line)
                    if name in used:  # (take_again's take of the name, in line)
                        raise _Unsupported("a copy's name taken in the flat graph")
                    used.add(name)
                    num = nums[i]
                    counts[base] = counts.get(base, 0) if num is None else num
                    new = make(Node)
                    parts[0](new, g, name, "call_function", x.target, x.type)
                    new._update_args_kwargs(args, kwargs)
                    parts[1][new] = name
                    parts[2](new)
                    row[new] = None
                    g._len += 1
                else:
                    new = _named_node(g, x, args, kwargs, name, read[i], nums[i], row)
                tenv[x] = new
                # the template node's meta with its call's module stack and site and
                # _tag_nodes's annotations (_plan's meta: KIND set, the rest here)
                stack, path, role = stacks[k]
                meta = tmeta.copy()
                meta["nn_module_stack"] = stack
                meta[CALL_SITE] = (number, index)
                meta[SOURCE] = name
                meta[MODULE] = path
                meta[ROLE] = role
                meta[PARAM_DERIVED] = pd[x]
                object.__setattr__(new, "meta", meta)
            results[n] = [tenv.get(o) for o in outs[t]]
        elif n.target is operator.getitem and n.args[0] in results:
            got = results[n.args[0]][n.args[1]]
            if got is None:
                raise _Unsupported("a call's output its variant does not keep")
            env[n] = got
        else:
            name = n.meta[SOURCE]
            # (copy_node's copy, without its copy of the meta this one shares)
            args = _fx_map_arg(n.args, env.__getitem__)
            kwargs = _fx_map_arg(n.kwargs, env.__getitem__) if n.kwargs else NO_KWARGS
            new = env[n] = new_node(g, n.op, n.target, name, args, kwargs, n.type)
            if new.name != name:
                raise _Unsupported("a top-level node's name taken in the flat graph")
            # sharing the meta dict, as the flat path's hierarchy shares it with the flat graph
            object.__setattr__(new, "meta", n.meta)
    flat = graph_module(torch.nn.Module(), g)
    meta = h.graph.meta
    flat.meta[UNUSED] = meta[UNUSED]
    flat.meta[SIGNATURE] = meta[SIGNATURE]
    flat.meta[CONSTANTS] = dict(meta[CONSTANTS])
    flat.meta[LOSS_KIND] = meta[LOSS_KIND]
    flat.meta[FACTS] = set(meta[FACTS])
    flat.meta[HIERARCHY] = h
    return flat
