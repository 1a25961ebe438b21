"""Decompositions traced once per argument signature and replayed (docs/analysis_scale.md).

While :func:`~graphflop.frontend.trace.trace` runs, every composite op is decomposed into core
ATen by running its decomposition under ``make_fx``, which costs about a millisecond per op it
records (a training-mode batch norm is 22 ops: ResNet-50's 53 of them were half its trace). The
same op on arguments of the same shapes, strides and dtypes decomposes into the same nodes, so
:class:`Replays` traces a decomposition once per signature, keeps the nodes it added as a
:class:`Template`, and on the next call with that signature appends copies of them to the graph
and hands ``make_fx`` the outputs it would have had: the graph is the one tracing every call
would give, node for node and in the same order (``tests/test_replay.py`` compares them).

A signature is the op, the arguments' metadata (:func:`~graphflop.ops.tree.meta_key`: tensors
by shape, strides, dtype and device, scalars by type and exact value), which arguments are the
same graph value, the grad and autocast modes and the default dtype. A call is traced inline
(and never replayed) when its decomposition adds anything but ``call_function`` nodes (tensor
constants), reads a graph value that is not one of its arguments, returns a tensor that is not
a new node or an argument, returns views (storage offsets, shared storage), or writes into an
argument other than by a node the replay can name; or when the argument metadata is not
hashable (a FakeTensor carrying a constant value).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx import Node
from torch.fx.node import map_aggregate, map_arg
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphflop.ad.builder import new_node
from graphflop.frontend import recording
from graphflop.meta import COMPOSITE, CompositeTag, fresh_fake
from graphflop.ops.tree import meta_key

__all__ = ["Replays", "Template"]

from torch._subclasses.fake_tensor import FakeTensor

#: a reference in a template: ("in", k) the call's k-th tensor argument, ("t", j) its j-th node
Ref = tuple[str, int]
_INLINE = object()  # a signature whose calls are traced inline
#: False: :meth:`Replays.wrap` leaves the table as it is (every call traced inline; the tests
#: compare both graphs)
ENABLED = True


@dataclasses.dataclass(frozen=True)
class Template:
    """The nodes one decomposition call added to the graph, with references in place of nodes.

    Attributes:
        nodes: ``(target, args, kwargs, meta)`` per node, in graph order; ``args``/``kwargs``
            hold :data:`Ref` tuples wrapped in :class:`_Ref` where the node read a graph value.
        outputs: one entry per leaf of the returned value (``tree_flatten``): a :data:`Ref`, or
            ``("c", value)`` for a non-tensor leaf.
        spec: the returned value's pytree spec.
        writes: ``(k, j)``: argument ``k``'s graph value is node ``j`` after the call (an
            in-place write such as batch norm's ``copy_`` into its running statistics).
    """

    nodes: tuple[tuple[Any, Any, Any, dict], ...]
    outputs: tuple[tuple[str, Any], ...]
    spec: Any
    writes: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class _Ref:
    ref: Ref


class Replays:
    """A decomposition table's entries wrapped to trace each signature once and replay it.

    Args:
        regions: the counter :func:`~graphflop.frontend.composite.tagged_decompositions` draws
            composite regions from; a replayed decomposition's tags get fresh numbers from it.

    Attributes:
        templates: signature -> :class:`Template` (or the inline marker).
        hits: calls replayed; misses: calls traced inline.
    """

    def __init__(self, regions: Iterator[int]):
        self.regions = regions
        self.templates: dict[Any, Any] = {}
        self.hits = 0
        self.misses = 0

    def wrap(self, table: dict[Any, Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
        """``table`` with every decomposition wrapped (a new dict)."""
        if not ENABLED:
            return dict(table)
        return {op: self._wrapped(op, fn) for op, fn in table.items()}

    def _wrapped(self, op: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
        def replayed(*args: Any, **kwargs: Any) -> Any:
            rec = recording.current()
            if rec is None:
                return fn(*args, **kwargs)
            flat = tree_flatten((args, kwargs))[0]
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            nodes = [rec.node_of(t) for t in tensors]
            key = _signature(op, args, kwargs, nodes)
            template = self.templates.get(key) if key is not None else _INLINE
            if template is None:  # first call of this signature: trace it and keep it
                self.misses += 1
                graph = rec.graph
                last = next(iter(reversed(graph.nodes)), None)
                out = fn(*args, **kwargs)
                self.templates[key] = _capture(graph, last, tensors, nodes, out, rec)
                return out
            if template is _INLINE:
                self.misses += 1
                return fn(*args, **kwargs)
            self.hits += 1
            assert isinstance(template, Template)  # the templates hold these or the marker
            return self._replay(template, tensors, nodes, rec)

        replayed.__name__ = getattr(fn, "__name__", "decomposition")
        replayed.__doc__ = fn.__doc__
        return replayed

    def _replay(self, t: Template, tensors: list, nodes: list, rec: recording.Recording) -> Any:
        graph = rec.graph
        made: list[Node] = []
        renumber: dict[int, int] = {}

        def resolve(a: Any) -> Any:
            if isinstance(a, _Ref):
                kind, i = a.ref
                return nodes[i] if kind == "in" else made[i]
            return a

        for target, args, kwargs, meta in t.nodes:
            # (builder.new_node: create_node's node, named as it names it, in half its time;
            # no recorder's node hooks run, as none ran through create_node)
            node = new_node(
                graph,
                "call_function",
                target,
                _name(graph, target),
                map_aggregate(args, resolve),
                map_aggregate(kwargs, resolve),
            )
            node.meta.update(meta)
            tag = meta.get(COMPOSITE)
            if tag is not None:
                node.meta[COMPOSITE] = self._renumbered(tag, renumber)
            made.append(node)
        leaves = []
        for kind, v in t.outputs:
            if kind == "in":
                leaves.append(tensors[v])
            elif kind == "t":
                node = made[v]
                val = node.meta["val"]
                leaves.append(
                    fresh_fake(val.fake_mode, val.shape, val.stride(), val.dtype, val.device)
                )
                rec.bind(leaves[-1], node)
            else:
                leaves.append(v)
        for k, j in t.writes:
            rec.bind(tensors[k], made[j])
        return tree_unflatten(leaves, t.spec)

    def _renumbered(self, tag: CompositeTag, renumber: dict[int, int]) -> CompositeTag:
        if tag.region not in renumber:
            renumber[tag.region] = (
                next(self.regions) if tag.region >= 0 else next(_REPLAYED_ATTENTION)
            )
        inner = self._renumbered(tag.inner, renumber) if tag.inner is not None else None
        if not _TAG_FIELDS:  # (a CompositeTag of other fields)
            return dataclasses.replace(tag, region=renumber[tag.region], inner=inner)
        # (dataclasses.replace's tag, by the constructor: a tenth of its cost)
        return CompositeTag(
            tag.op, renumber[tag.region], tag.output, tag.inputs, inner, tag.outputs
        )


#: fresh numbers for a replayed attention call's regions (negative, as composite's own)
_REPLAYED_ATTENTION = itertools.count(-(10**9), -1)


#: whether :class:`~graphflop.meta.CompositeTag` has the fields :meth:`Replays._renumbered`
#: makes one of, in its order
_TAG_FIELDS = tuple(f.name for f in dataclasses.fields(CompositeTag)) == (
    "op",
    "region",
    "output",
    "inputs",
    "inner",
    "outputs",
)


def _name(graph: torch.fx.Graph, target: Any) -> str:
    """The name ``make_fx`` asks for a node of ``target`` (an ATen op by its packet's name, as
    :func:`~graphflop.frontend.recording.node_name`; another callable as ``create_node``
    names it), so that a replayed graph's names are the traced graph's (buffer updates name
    nodes); derived once per target."""
    name = _NAMES.get(target)
    if name is None:
        packet = getattr(target, "overloadpacket", None)
        name = graph._target_to_str(packet.__name__ if packet is not None else target)
        _NAMES[target] = name
    return name


#: target -> :func:`_name` (the targets of the decompositions' nodes: a bounded set of ops)
_NAMES: dict[Any, str] = {}


def _signature(op: Any, args: Any, kwargs: Any, nodes: list) -> Any:
    """The key a template is kept under, or None when the call cannot be replayed."""
    if any(n is None for n in nodes):
        return None
    first: dict[Node, int] = {}
    same = tuple(first.setdefault(n, i) for i, n in enumerate(nodes))
    try:
        key = (
            op,
            meta_key(args),
            meta_key(kwargs),
            same,
            torch.is_grad_enabled(),
            torch.is_autocast_enabled("cpu"),
            torch.get_default_dtype(),
        )
        hash(key)
    except TypeError:
        return None
    return key


def _capture(
    graph: torch.fx.Graph,
    last: Node | None,
    tensors: list,
    nodes: list,
    out: Any,
    rec: recording.Recording,
) -> Any:
    """The :class:`Template` of the nodes added after ``last``, or the inline marker."""
    new: list[Node] = []
    n = last.next if last is not None else next(iter(graph.nodes), None)
    while n is not None and n.op != "root":
        new.append(n)
        n = n.next
    if any(n.op != "call_function" for n in new):
        return _INLINE
    index = {n: j for j, n in enumerate(new)}
    inputs: dict[Node, int] = {}
    for k, n in enumerate(nodes):
        inputs.setdefault(n, k)
    foreign = []

    def ref(a: Node) -> Any:
        if a in index:
            return _Ref(("t", index[a]))
        if a in inputs:
            return _Ref(("in", inputs[a]))
        foreign.append(a)
        return a

    entries = []
    for n in new:
        meta = {k: v for k, v in n.meta.items() if k != "nn_module_stack"}
        entries.append((n.target, map_arg(n.args, ref), map_arg(n.kwargs, ref), meta))
    leaves, spec = tree_flatten(out)
    outputs = _outputs(leaves, tensors, index, rec)
    writes = _writes(tensors, nodes, index, rec)
    if foreign or outputs is None or writes is None:
        return _INLINE
    return Template(tuple(entries), tuple(outputs), spec, tuple(writes))


def _outputs(leaves: list, tensors: list, index: dict, rec: recording.Recording) -> Any:
    """The template's output references, or None when an output cannot be replayed (a view:
    replayed outputs are fresh tensors)."""
    outputs: list[tuple[str, Any]] = []
    storages = {t.untyped_storage()._cdata for t in tensors}
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            outputs.append(("c", leaf))
            continue
        node = rec.node_of(leaf)
        if node in index:
            if not isinstance(leaf, FakeTensor) or leaf.storage_offset() != 0:
                return None
            storage = leaf.untyped_storage()._cdata
            if storage in storages:
                return None  # a view of an argument or of another output
            storages.add(storage)
            outputs.append(("t", index[node]))
        else:
            k = next((k for k, t in enumerate(tensors) if leaf is t), None)
            if k is None:
                return None  # a tensor that is neither a new node nor an argument
            outputs.append(("in", k))
    return outputs


def _writes(tensors: list, nodes: list, index: dict, rec: recording.Recording) -> Any:
    """``(k, j)`` for every argument whose graph value is now new node ``j``, or None when one
    is now a node the call did not add."""
    writes = []
    for k, t in enumerate(tensors):
        now = rec.node_of(t)
        if now is nodes[k]:
            continue
        if now not in index:
            return None
        writes.append((k, index[now]))
    return writes
