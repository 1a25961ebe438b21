"""The graph being recorded while a model is traced, behind one seam.

graphflop's tracing hooks (module scopes, composite-op tags, checkpoint and grad-mode tags,
custom Functions, decomposition replays, library workarounds) read and extend the graph that
the recorder under them is building: whether a graph is being recorded, the graph itself, the
node that made a tensor, a tensor bound to a node they made, the nodes a block of code added,
and a hook on every node made. Today that recorder is ``make_fx``'s proxy mode, whose
bookkeeping is private PyTorch API (``get_proxy_mode``, ``get_proxy_slot``,
``track_tensor_tree``, ``PythonKeyTracer``); every use of it by those hooks is here, so that
it can move between PyTorch releases, or another recorder take its place (issue 33 item 4: a
dispatch-level recorder of graphflop's own, docs/analysis_scale.md Round 21), in one module.

The outliner (:mod:`graphflop.frontend.outline`) still reads ``make_fx``'s tracer itself: a
call it copies is recorded through the tracer's own proxies.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._library.utils import get_layout_constraint_tag
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx import Graph, GraphModule, Node, Proxy
from torch.fx.experimental.proxy_tensor import (
    PythonKeyTracer,
    get_proxy_mode,
    get_proxy_slot,
    track_tensor_tree,
)
from torch.fx.node import map_aggregate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

try:  # what OpRecorder mirrors make_fx with (private; without it the trace uses make_fx)
    from torch.fx.experimental.proxy_tensor import (
        CONSTANT_NUMEL_LIMIT,
        _should_save_eager_input_vals,
        disable_autocast_cache,
        extract_val,
    )
    from torch.utils._python_dispatch import autograd_would_have_decomposed

    #: whether this PyTorch has what :class:`OpRecorder` needs
    AVAILABLE = True
except ImportError:  # pragma: no cover - a PyTorch that moved them
    AVAILABLE = False

try:  # what fast_detach detaches a FakeTensor with (:func:`_snapshots` enters them once)
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    _BATCHED = AVAILABLE
except ImportError:  # pragma: no cover - a PyTorch that moved them
    _BATCHED = False

from graphflop.ad.builder import NO_KWARGS
from graphflop.ad.builder import new_node as builder_new_node
from graphflop.meta import graph_module, new_fake

__all__ = [
    "AVAILABLE",
    "OpRecorder",
    "Recording",
    "current",
    "each_node",
    "node_of",
    "nodes_added",
    "record",
    "recording",
]


class Recording:
    """The graph one recorder is building, as the hooks use it: ``make_fx``'s tracer, or an
    :class:`OpRecorder`.

    Attributes:
        tracer: ``make_fx``'s tracer (a ``PythonKeyTracer``), or None.
        own: the :class:`OpRecorder`, or None.
    """

    __slots__ = ("own", "tracer")

    def __init__(self, tracer: Any, own: OpRecorder | None = None):
        self.tracer, self.own = tracer, own

    @property
    def graph(self) -> Graph:
        """The graph being built; nodes are appended at its end."""
        return self.own.graph if self.own is not None else self.tracer.graph

    def node_of(self, t: Any, sync: bool = False) -> Node | None:
        """The node that made tensor ``t`` (through functionalization's wrappers), or None:
        ``t`` is not a tensor, or has no node (a constant). ``sync``: bring a functional
        wrapper up to date with the writes into its base first (``torch._sync``: after an
        in-place write through a view, the node of the value as written)."""
        if not isinstance(t, torch.Tensor):
            return None
        if sync and torch._is_functional_tensor(t):
            torch._sync(t)
        while torch._is_functional_tensor(t):
            t = torch._from_functional_tensor(t)
        if self.own is not None:
            return self.own.node_of(t)
        slot = get_proxy_slot(t, self.tracer, None)
        node = getattr(getattr(slot, "proxy", None), "node", None)
        return node if isinstance(node, Node) else None

    def bind(self, t: torch.Tensor, node: Node) -> None:
        """Record ``node`` as the value of tensor ``t`` from now on (a node the caller added:
        later ops reading ``t`` read ``node``)."""
        if self.own is not None:
            self.own.bind(t, node)
        else:
            track_tensor_tree(t, Proxy(node, self.tracer), constant=None, tracer=self.tracer)


def current() -> Recording | None:
    """The graph being recorded, or None when nothing is traced."""
    if _ACTIVE:
        return Recording(None, _ACTIVE[-1])
    mode = get_proxy_mode()
    return Recording(mode.tracer) if mode is not None else None


def recording() -> bool:
    """Whether a graph is being recorded."""
    return bool(_ACTIVE) or get_proxy_mode() is not None


def node_of(t: Any, sync: bool = False) -> Node | None:
    """The node that made tensor ``t`` in the graph being recorded (:meth:`Recording.node_of`),
    or None: nothing is recorded, ``t`` is not a tensor, or has no node."""
    rec = current()
    return rec.node_of(t, sync) if rec is not None else None


@contextlib.contextmanager
def nodes_added() -> Iterator[list[Node]]:
    """Yields a list that, on leaving, holds the nodes the block added to the graph being
    recorded, in order (empty when nothing is recorded)."""
    rec = current()
    made: list[Node] = []
    if rec is None:
        yield made
        return
    graph = rec.graph
    last = next(iter(reversed(graph.nodes)), None)
    yield made
    for n in reversed(graph.nodes):
        if n is last:
            break
        made.append(n)
    made.reverse()


@contextlib.contextmanager
def each_node(hook: Callable[[Node], None]) -> Iterator[None]:
    """While active, ``hook(node)`` is called for every node the recorder makes, right after it
    is made (nested hooks all run, the innermost last)."""
    outer = PythonKeyTracer.create_node

    def create_node(self: PythonKeyTracer, *args: Any, **kwargs: Any) -> Node:
        node = outer(self, *args, **kwargs)
        hook(node)
        return node

    PythonKeyTracer.create_node = create_node  # type: ignore[method-assign]
    _NODE_HOOKS.append(hook)
    try:
        yield
    finally:
        _NODE_HOOKS.remove(hook)
        PythonKeyTracer.create_node = outer  # type: ignore[method-assign]


# --- a recorder of graphflop's own (issue 33 item 4) ---------------------------------------

#: the hooks :func:`each_node` registered, called for every node :class:`OpRecorder` makes
_NODE_HOOKS: list[Callable[[Node], None]] = []


class _TensorMap:
    """Tensor -> value, by the tensor's identity, the tensor held weakly: what
    ``WeakTensorKeyDictionary`` gives :class:`OpRecorder` (``get``, ``in``, setting, deleting),
    for a third of its cost. That dictionary makes a ``WeakIdRef`` (a Python object) per
    look-up; here a look-up is by ``id`` and a check that the weak reference stored with the
    value still leads to the tensor (an entry of a tensor that died stays, unread: another
    tensor given its ``id`` finds it dead, and binding that tensor replaces it). The recorder
    looks up every tensor argument of every op: an outlined call's parameters each."""

    __slots__ = ("_by_id",)

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, t: Any) -> Any:
        got = self._by_id.get(id(t))
        return got[1] if got is not None and got[0]() is t else None

    def __contains__(self, t: Any) -> bool:
        got = self._by_id.get(id(t))
        return got is not None and got[0]() is t

    def __setitem__(self, t: Any, value: Any) -> None:
        self._by_id[id(t)] = (weakref.ref(t), value)

    def __delitem__(self, t: Any) -> None:
        if t not in self:
            raise KeyError(t)
        del self._by_id[id(t)]


#: the :class:`OpRecorder` s recording now (innermost last)
_ACTIVE: list[OpRecorder] = []


class OpRecorder(TorchDispatchMode):
    """A dispatch-level recorder: each ATen op that reaches it (under functionalization and
    over a FakeTensorMode) appended to an fx graph as ``make_fx``'s proxy mode appends it, for
    a fraction of its cost per op.

    What ``make_fx(f, decomposition_table=table, _allow_fake_constant=True)`` records, done the
    same way: an op in ``table`` replaced by its decomposition, a CompositeImplicitAutograd op
    that autograd would have decomposed by its decomposition, ``prim.device`` not recorded,
    ``is_nonzero`` as ``(x != 0).item()``, ``lift_fresh`` recorded as ``lift_fresh_copy``; each
    other op one ``call_function`` node named after its overload packet, a ``getitem`` node per
    element of a tuple or list result, a tensor no node made read through a
    ``_tensor_constant<k>`` attribute; small constants (``torch.tensor(...)`` and the ops
    reading only such) carried as real values, so that ``.item()`` on them works. Node
    ``meta["val"]``: a detached alias of the op's result, as ``make_fx``'s (not its
    ``tensor_meta``, which graphflop does not read).

    Not modelled (``record`` is then not for the trace): symbolic shapes, pre-dispatch
    tracing, tensor subclasses other than FakeTensor, opaque objects.
    """

    def __init__(self, table: dict[Any, Callable[..., Any]]):
        super().__init__()
        self.table = table
        self.graph = Graph()
        self.root = torch.nn.Module()
        # weakly keyed, as make_fx's tensor tracker: a factory's result held only by the
        # kernel stays unshared, so autograd's wrapping of it is no ``detach``
        self._nodes = _TensorMap()
        self._consts = _TensorMap()
        self._n_constants = 0
        #: (op, the first tensor argument's device type) -> autograd_would_have_decomposed
        self._decomposes: dict[tuple[Any, str | None], bool] = {}

    def _would_decompose(self, func: Any, flat: list[Any]) -> bool:
        """``autograd_would_have_decomposed(func, flat)``, kept per op and device type for the
        trace (it reads only the first tensor argument's device, and the dispatcher's table,
        which does not change while a model is traced; about 8 us a call)."""
        device = next((a.device.type for a in flat if isinstance(a, torch.Tensor)), None)
        key = (func, device)
        hit = self._decomposes.get(key)
        if hit is None:
            hit = self._decomposes[key] = autograd_would_have_decomposed(func, flat)
        return hit

    def node_of(self, t: Any) -> Node | None:
        """The node bound to tensor ``t`` (a FakeTensor below functionalization), or None."""
        return self._nodes.get(t)

    def constant_of(self, t: Any) -> torch.Tensor | None:
        """The real value carried for tensor ``t`` (a small constant), or None."""
        return self._consts.get(t)

    def bind(self, t: Any, node: Node, constant: torch.Tensor | None = None) -> None:
        """Record ``node`` as tensor ``t``'s value from now on, with ``constant`` its real value
        where it is a small constant (None: not one, or no longer)."""
        self._nodes[t] = node
        if constant is not None:
            self._consts[t] = constant
        elif t in self._consts:
            del self._consts[t]

    def new_node(self, op: str, target: Any, args: tuple, kwargs: dict, name: str) -> Node:
        """A node appended to the graph (fx makes ``name`` unique), the :func:`each_node` hooks
        called on it."""
        # (builder.new_node: create_node's node for these arguments, in about half its time;
        # empty kwargs builder.NO_KWARGS)
        node = builder_new_node(self.graph, op, target, name, args, kwargs or NO_KWARGS)
        if op == "call_function" and _saves_input_vals(target, args, kwargs):
            # an op with exact stride needs (a custom op's tag): its inputs' values, as make_fx
            node.meta["eager_input_vals"] = map_aggregate((args, kwargs), _input_val)
        for hook in _NODE_HOOKS:
            hook(node)
        return node

    def _constant(self, t: torch.Tensor) -> Node:
        """A ``get_attr`` node reading tensor ``t``, which no node made (``make_fx``'s
        ``_tensor_constant<k>``)."""
        name = f"_tensor_constant{self._n_constants}"
        self._n_constants += 1
        setattr(self.root, name, t)
        node = self.new_node("get_attr", name, (), {}, name)
        node.meta["val"] = extract_val(t)  # (as make_fx's tracer: a fake alias)
        self.bind(t, node)
        return node

    def __enter__(self) -> OpRecorder:
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _DEVICE:
            return _device(func, args, kwargs)
        decomposition = self.table.get(func)
        if decomposition is not None:
            with self:
                out = decomposition(*args, **kwargs)
            if out is not NotImplemented:
                return out
        flat, spec = tree_flatten((args, kwargs))
        if func not in _SHAPE_QUERIES and self._would_decompose(func, flat):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func is _IS_NONZERO:
            with self:
                torch._check(args[0].numel() == 1, lambda: "ambiguous truth value")
                return (args[0] != 0).item()
        values: list[Any] = []
        consts: list[Any] = []
        all_constant, any_constant = True, False
        for x in flat:
            if isinstance(x, torch.Tensor):
                node = self._nodes.get(x)
                if node is None:  # no node made it: a constant (not counted as one below)
                    values.append(self._constant(x))
                    consts.append(x)
                    continue
                c = self._consts.get(x)
                all_constant = all_constant and c is not None
                any_constant = any_constant or c is not None
                values.append(node)
                consts.append(c if c is not None else x)
            else:
                values.append(x)
                consts.append(x)

        def on_constants() -> Any:  # func run for real on the constants' values
            with unset_fake_temporarily():
                cargs, ckwargs = tree_unflatten(consts, spec)
                return func(*cargs, **ckwargs)

        if all_constant and _DATA_DEPENDENT in func.tags:  # (the flag first: tags cost 2 us)
            return on_constants()
        if func is _LIFT_FRESH:
            func = _LIFT_FRESH_COPY
        nargs, nkwargs = tree_unflatten(values, spec)
        node = self.new_node("call_function", func, nargs, nkwargs, node_name(self.graph, func))
        out = func(*args, **kwargs)
        constant = None
        if func is _LIFT_FRESH_COPY and out.numel() <= CONSTANT_NUMEL_LIMIT:
            with unset_fake_temporarily():
                constant = args[0].clone()
        elif (
            all_constant
            and any_constant
            and _SEEDED not in func.tags
            and all(
                t.numel() <= CONSTANT_NUMEL_LIMIT
                for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor)
            )
        ):
            constant = on_constants()
        self.track(out, node, constant)
        return out

    def track(self, out: Any, node: Node, constant: Any = None) -> None:
        """``out``'s tensors bound to ``node`` (a tuple's or list's elements to a ``getitem``
        of it each, made for every element as ``make_fx`` makes them)."""
        if isinstance(out, torch.Tensor):
            self.bind(out, node, constant)
            node.meta["val"] = _snapshots((out,))[0]  # (extract_val(out))
        elif isinstance(out, (tuple, list)) and all(isinstance(e, torch.Tensor) for e in out):
            # the list's snapshots, then each getitem's, in one batch (its modes entered once)
            n, snaps = len(out), _snapshots([*out, *out])
            node.meta["val"] = out.__class__(snaps[:n])  # (extract_val(out))
            for i, e in enumerate(out):
                item = self.new_node("call_function", operator.getitem, (node, i), {}, "getitem")
                self.bind(e, item, constant[i] if constant is not None else None)
                item.meta["val"] = snaps[n + i]
        elif isinstance(out, (tuple, list)):
            node.meta["val"] = out.__class__(_snapshots(out))  # (extract_val(out))
            for i, e in enumerate(out):
                item = self.new_node("call_function", operator.getitem, (node, i), {}, "getitem")
                self.track(e, item, constant[i] if constant is not None else None)


def record(
    fn: Callable[..., Any], decomposition_table: dict[Any, Callable[..., Any]]
) -> Callable[..., GraphModule]:
    """``fn`` recorded by an :class:`OpRecorder`: ``record(fn, table)(*args)`` returns the graph
    module ``make_fx(fn, decomposition_table=table, _allow_fake_constant=True)(*args)``
    returns for the same call (``args`` FakeTensors, run in their FakeTensorMode; placeholders
    ``arg<i>_1``, then the ops, then an ``output`` node returning ``fn``'s result with its
    tensors as their nodes)."""

    def run(*args: Any) -> GraphModule:
        rec = OpRecorder(decomposition_table)
        for i, (a, val) in enumerate(zip(args, _snapshots(args, include_real=True))):
            name = f"arg{i}_1"
            ph = rec.new_node("placeholder", name, (), {}, name)
            ph.meta["val"] = val
            if isinstance(a, torch.Tensor):
                rec.bind(a, ph)
        with disable_autocast_cache(), rec:
            out = fn(*args)
        leaves, spec = tree_flatten(out)
        results = [
            (rec.node_of(t) or rec._constant(t)) if isinstance(t, torch.Tensor) else t
            for t in leaves
        ]
        rec.graph.output(tree_unflatten(results, spec))
        return graph_module(rec.root, rec.graph)

    return run


def _device(func: Any, args: Any, kwargs: Any) -> Any:
    """``prim.device`` of a tensor (what a functional wrapper asks of the tensor it wraps:
    functionalisation wraps every parameter, and an outlined call's outputs), answered as
    the fake mode next on the dispatch stack answers it (``_device_handler``: its fake device,
    or ``meta`` inside a kernel) where it is next, without the dispatch to it (a Python mode's
    handler: about a third of the query); ``func(*args)`` otherwise."""
    a = args[0] if len(args) == 1 and not kwargs else None
    if (
        type(a) is FakeTensor
        and torch._C._len_torch_dispatch_stack() == 1
        and torch._C._get_dispatch_mode(_FAKE_KEY) is not None
    ):
        return _META if a.fake_mode.in_kernel_invocation else a.fake_device
    return func(*args, **kwargs)


_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
_META = torch.device("meta")


def _snapshots(values: Any, include_real: bool = False) -> list:
    """``[extract_val(v, include_real) for v in values]``: a node's value as ``make_fx`` keeps
    it, the FakeTensors among ``values`` detached together as ``fast_detach`` detaches each (a
    ``detach`` in the fake mode's kernel invocation, its two dispatch guards entered once per
    fake mode instead of per tensor: a trace has a placeholder per parameter), then each
    wrapped as a FakeTensor of its own."""
    if not _BATCHED:  # pragma: no cover - a PyTorch without them
        return [extract_val(v, include_real) for v in values]
    out: list[Any] = []
    fakes: dict[int, tuple[Any, list[int]]] = {}  # per fake mode (by id), its tensors' places
    for i, v in enumerate(values):
        if type(v) is FakeTensor:
            fakes.setdefault(id(v.fake_mode), (v.fake_mode, []))[1].append(i)
            out.append(None)
        else:
            out.append(extract_val(v, include_real))
    for mode, places in fakes.values():
        with no_python_dispatcher(), in_kernel_invocation_manager(mode):
            metas = [_DETACH(values[i]) for i in places]
        for i, meta in zip(places, metas):
            v = values[i]
            real = v.real_tensor if include_real else None
            out[i] = new_fake(mode, meta, v.device, real_tensor=real)  # (FakeTensor(...))
    return out


def node_name(graph: Graph, func: Any) -> str:
    """The name ``make_fx`` asks for a node of op ``func`` (its overload packet's name in
    snake case: ``convolution``), derived once per op (fx's regular expressions: about 4 us)."""
    name = _NODE_NAMES.get(func)
    if name is None:
        name = _NODE_NAMES[func] = graph._target_to_str(func.overloadpacket.__name__)
    return name


#: op -> :func:`node_name`
_NODE_NAMES: dict[Any, str] = {}


def _saves_input_vals(target: Any, args: tuple, kwargs: dict) -> bool:
    """``_should_save_eager_input_vals(target, (args, kwargs))``, looked up once per target
    where the target alone decides it (:func:`_by_target`). It costs 6 us for a ``getitem``
    and 20 for a custom op (module look-ups, an import, a config read): an outlined call's
    ``repeat`` node and its ``getitem`` nodes paid it at every call."""
    got = _SAVES_INPUTS.get(target)
    if got is None:
        got = _should_save_eager_input_vals(target, (args, kwargs))
        if _by_target(target):
            _SAVES_INPUTS[target] = got
    return got


def _by_target(target: Any) -> bool:
    """Whether ``_should_save_eager_input_vals`` reads ``target`` alone: a callable that is no
    torch operator (never saved), one of PyTorch's own op overloads (``aten``, ``prims``: its
    layout tag, or ``flexible_layout`` without one) or another op overload with a layout tag
    (saved where it is ``needs_exact_strides``); not a higher-order op (its arguments count)
    or another library's op overload without a tag (the configured default counts)."""
    if not isinstance(target, torch._ops.OperatorBase):
        return callable(target)
    return isinstance(target, torch._ops.OpOverload) and (
        target.namespace in _BUILTIN  # (PyTorch's own: its tag, or flexible_layout)
        or get_layout_constraint_tag(target, with_default=False) is not None
    )


#: per target :func:`_by_target` admits, :func:`_saves_input_vals`
_SAVES_INPUTS: dict[Any, bool] = {}
#: the namespaces of PyTorch's own ops (``torch._library.utils.is_builtin``)
_BUILTIN = frozenset({"aten", "prim", "prims"})


def _input_val(v: Any) -> Any:
    """An argument's value as ``make_fx`` keeps it in ``eager_input_vals``: a node's fake
    ``val`` (aliased), else None."""
    if isinstance(v, Node) and isinstance(v.meta.get("val"), FakeTensor):
        return extract_val(v.meta["val"])
    return None


_DEVICE = torch.ops.prim.device.default
_DETACH = torch.ops.aten.detach.default
_IS_NONZERO = torch.ops.aten.is_nonzero.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_LIFT_FRESH_COPY = torch.ops.aten.lift_fresh_copy.default
_SHAPE_QUERIES = (
    torch.ops.aten.size.default,
    torch.ops.aten.stride.default,
    torch.ops.aten.storage_offset.default,
)
_DATA_DEPENDENT = torch.Tag.data_dependent_output
_SEEDED = torch.Tag.nondeterministic_seeded
