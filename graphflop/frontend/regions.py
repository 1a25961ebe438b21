"""Regions of the traced graph whose derivative the model's own code decides: the nodes made
inside one ``torch.utils.checkpoint`` call, and the nodes made with grad mode off, found while
tracing and tagged.

Eager PyTorch runs a checkpointed function's forward without saving anything inside it
(``use_reentrant=False``: saved-tensor hooks that keep nothing; ``use_reentrant=True``: under
``no_grad``), keeps its inputs, and in the backward runs the function's forward again before
differentiating it. The trace is the same ops either way, so while tracing
:func:`checkpoints_tagged` calls the function directly (no hooks: ``torch.func`` refuses
saved-tensor hooks, and the reentrant form is an ``autograd.Function`` it cannot run) and tags
the nodes the call made with :data:`~graphflop.meta.CHECKPOINT`
(:class:`~graphflop.meta.CheckpointTag`); the backward builder
(:mod:`graphflop.ad.vjp`) re-emits the region's forward in the backward, role ``recompute``.
A reentrant call none of whose tensor inputs is differentiable (depends on no trainable
parameter nor on a value the model marked ``requires_grad_``; the model's inputs do not require
grad) gives, as in eager, outputs with no derivative: they are detached in the trace, and
:mod:`graphflop.frontend.trace` counts the parameters used only inside as frozen, with a warning.

:func:`~graphflop.frontend.recording.nodes_added` (the nodes a block adds to the graph being traced) and
:func:`graphflop.meta.occurrences` (the calls of one region number told apart, the copies of an
outlined block sharing it) serve custom Functions too (:mod:`graphflop.frontend.custom_function`).

:func:`grad_mode_tagged` tags :data:`~graphflop.meta.NO_GRAD` the nodes made while the model's
code has grad mode off (``torch.no_grad()``, ``torch.set_grad_enabled(False)``,
``torch.inference_mode()``, a method decorated with one of them): eager autograd records nothing
there, so their outputs carry no gradient, as after ``detach``; the JVP gives them no tangent
(:mod:`graphflop.ad.jvp`), so the backward, its transpose, gives them no cotangent.

An in-place write with grad mode off (``h[:, 0] = v``, ``h.masked_fill_(m, 0)``,
``h[:, 1:3].copy_(v)`` under ``torch.no_grad()``) is not recorded by eager autograd either: the
tensor written into keeps the derivative it had, as if the write were not there.
Functionalization makes the write a new value of the tensor's storage (a scatter of the written
part into the old value, made with grad mode off) and makes the views of it again from that
value; :func:`no_grad_write` tags that new value :data:`~graphflop.meta.NO_GRAD_WRITE` with the
way to the old one, whose tangent the JVP gives it, and the views made again from it as views
to differentiate. Writes ``CHECKPOINT``, ``NO_GRAD`` and ``NO_GRAD_WRITE``.

The model's code reading a traced value's ``requires_grad``, ``is_leaf`` or ``grad_fn``
(``if x.requires_grad: ...``; :class:`~graphflop.frontend.composite.CompositeOps` sees the
read) gets what eager training would give (:func:`eager_flags`): the fake tensors' own flags
say nothing of it. In an outlined block's template the call's inputs read as at the call it is
traced for; a template whose answers depend on them is traced again for each other set of its
calls' inputs' flags, and a graph that differs has the block traced in full
(:func:`grad_read_in_templates`, :func:`grad_states`, :mod:`graphflop.frontend.trace`).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import sys
from collections import deque
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint as torch_checkpoint
from torch.autograd.function import Function
from torch.fx import Node

from graphflop.frontend import recording
from graphflop.frontend.errors import TraceError
from graphflop.meta import (
    CHECKPOINT,
    LEAF,
    NO_GRAD,
    NO_GRAD_WRITE,
    CheckpointTag,
    NoGradWrite,
)

aten = torch.ops.aten

#: region numbers, unique in the process (a template's regions and the main graph's never meet)
region_ids = itertools.count()


#: :attr:`CheckpointTag.unmodelled` of a call with another checkpoint call inside
NESTED = (
    "checkpoint nested in another checkpoint (eager reruns the inner call's forward once more "
    "for its own backward; graphflop reruns it once)"
)


def tag_checkpoint(
    made: list[Node], whole: bool, detached: bool = False, unmodelled: str = ""
) -> None:
    """Tag ``made`` (one checkpoint call's nodes) as one region; an enclosing checkpoint's tag
    replaces an inner one's (the outer call's backward reruns the inner one's forward too),
    and the enclosing call is marked :data:`NESTED` (its recompute is not eager's)."""
    region = next(region_ids)
    inner = [n.meta[CHECKPOINT].unmodelled for n in made if CHECKPOINT in n.meta]
    if inner and not unmodelled:
        unmodelled = next((u for u in inner if u and u != NESTED), NESTED)
    for i, n in enumerate(made):
        n.meta[CHECKPOINT] = CheckpointTag(region, i, whole, detached, unmodelled)


class _GradSources:
    """Which placeholders of the graph being traced carry a derivative (the trainable
    parameters), and the values the model's code marked ``requires_grad_(True)``; set by
    :func:`grad_sources` around the main trace only (elsewhere every value counts as
    differentiable)."""

    trainable: frozenset[int] = frozenset()
    marked: set[Node] = set()
    active: bool = False
    #: a reentrant checkpoint ran outside the main trace (an outlined block's template): whether
    #: its outputs carry a derivative was not decided (it depends on each call's inputs)
    undecided: bool = False
    #: how many new leaves the main trace made so far (each tagged ``LEAF`` with its number)
    leaves: int = 0
    #: the model's code marked a value outside the main trace (an outlined block's template)
    marked_outside: bool = False
    #: while an outlined block's template is traced: per placeholder, whether it carries a
    #: derivative (:func:`template_grad_sources`); None elsewhere
    template_sources: tuple[bool, ...] | None = None
    #: with :attr:`template_sources`: per input of the call (its first placeholders), whether
    #: eager reads it as a leaf (``is_leaf``)
    template_leaves: tuple[bool, ...] = ()
    #: the model's code read ``requires_grad``, ``is_leaf`` or ``grad_fn`` of a value in an
    #: outlined block's template whose answer depends on the call's inputs
    #: (:func:`grad_read_in_templates`)
    input_read: bool = False
    #: the leaves the model's code turned ``requires_grad_(False)``: the stop-gradient node
    #: their reads go through meanwhile -> the leaf's own node (:func:`stop_gradient`)
    stopped: dict[Node, Node] = {}
    #: the model's parameters' names, its first placeholders (:func:`grad_sources`)
    params: tuple[str, ...] = ()
    #: the main trace's placeholders, in order, as :func:`stop_gradient` last saw them
    placeholders: list[Node] = []

    @classmethod
    def outside(cls) -> None:
        """What it holds outside the main trace (as :func:`grad_sources` leaves it)."""
        cls.active = False
        cls.trainable = frozenset()
        cls.params = ()
        cls.marked = set()
        cls.stopped = {}
        cls.placeholders = []


def grad_sources(
    trainable: set[int], params: tuple[str, ...] = (), left_off: set[int] | None = None
) -> contextlib.AbstractContextManager[None]:
    """While active, the reentrant checkpoint decides as eager does whether its outputs carry
    a derivative: ``trainable`` are the positions of the placeholders (in order) that require
    grad; the model's inputs do not. ``params``: the names of the parameters, the first
    placeholders (:func:`mark_requires_grad` refuses to turn a frozen one on). ``left_off``: filled, on
    leaving, with the positions of the trainable placeholders the model's code turned
    ``requires_grad_(False)`` and left so (eager's backward gives them no gradient at all:
    its AccumulateGrad reads the flag when it runs)."""

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        _GradSources.trainable = frozenset(trainable)
        _GradSources.params = params
        _GradSources.marked = set()
        _GradSources.leaves = 0
        _GradSources.stopped = {}
        _GradSources.placeholders = []
        _GradSources.active = True
        try:
            yield
            if left_off is not None:
                off = set(_GradSources.stopped.values())  # turned off, not on again
                left_off.update(i for i, n in enumerate(_GradSources.placeholders) if n in off)
        finally:
            _GradSources.outside()

    return scope()


def mark_requires_grad(t: torch.Tensor) -> None:
    """Note that the model's code made ``t`` require grad (``Tensor.requires_grad_()``). In
    the main trace, a value that depends on no trainable parameter (nor on a value marked
    before) is one eager autograd makes a leaf that requires grad: its node is tagged
    :data:`~graphflop.meta.LEAF`. Outside the main trace (an outlined block's template) that
    depends on each call's inputs: :func:`marked_in_templates` says it happened."""
    node = _node_of(t)
    if node is not None:
        frozen = _frozen_param(node) if _GradSources.active and node.op == "placeholder" else None
        if frozen is not None:
            raise TraceError(
                f"the model turns its frozen parameter {frozen} on with requires_grad_() "
                "inside forward, which graphflop does not model (eager would give it the "
                "gradient of the later reads only): set its requires_grad before analysing"
            )
        if _GradSources.active and not _differentiable((t,)):
            node.meta.setdefault(LEAF, _GradSources.leaves)
            _GradSources.leaves += 1
        elif not _GradSources.active:
            _GradSources.marked_outside = True
        _GradSources.marked.add(node)


def _frozen_param(node: Node) -> str | None:
    """The name of the parameter placeholder ``node`` of the main trace stands for where it
    does not require grad (:func:`grad_sources`' ``params``, less the trainable ones), else
    None."""
    for i, n in enumerate(node.graph.nodes):
        if i >= len(_GradSources.params) or n.op != "placeholder":
            return None
        if n is node:
            return None if i in _GradSources.trainable else _GradSources.params[i]
    return None


def stop_gradient(t: torch.Tensor) -> None:
    """The model's code called ``t.requires_grad_(False)``. Eager autograd then records no
    use of ``t`` until ``requires_grad_(True)``: a trainable leaf's (a parameter's, or a value
    made a leaf before) later reads go through a stop-gradient (``aten.detach``) node, which
    :func:`resume_gradient` ends. A value that carries no derivative is left as it is. Outside
    the main trace (an outlined block's template) :func:`marked_in_templates` says it happened.

    Raises:
        TraceError: ``t`` is a computed value that carries a derivative (eager PyTorch refuses
            it too: only a leaf's flag changes).
    """
    node = _node_of(t)
    if node is None:
        return
    if not _GradSources.active:
        _GradSources.marked_outside = True
        return
    if not _differentiable((t,)):
        return
    if node.op != "placeholder" and LEAF not in node.meta:
        raise TraceError(
            "the model calls requires_grad_(False) on a value it computed, which eager PyTorch "
            "refuses (only a leaf's flag can change): read it through .detach() instead"
        )
    rec = recording.current()
    assert rec is not None  # (_node_of found a node)
    stopped = _node_of(t.detach())
    assert stopped is not None
    # as a value made with grad mode off: no gradient (a parameter read only so is frozen),
    # and --verify's tangent reference is <gradient, direction>, since eager forward-mode AD
    # ignores requires_grad
    stopped.meta[NO_GRAD] = True
    _GradSources.stopped[stopped] = node
    if node.op == "placeholder":
        _GradSources.placeholders = [n for n in node.graph.nodes if n.op == "placeholder"]
    rec.bind(_inner(t), stopped)


def resume_gradient(t: torch.Tensor) -> None:
    """The model's code called ``t.requires_grad_(True)`` after :func:`stop_gradient`: its
    later reads are the leaf's own node again."""
    node = _node_of(t)
    leaf = _GradSources.stopped.pop(node, None) if node is not None else None
    if leaf is not None:
        rec = recording.current()
        assert rec is not None
        rec.bind(_inner(t), leaf)


def _inner(t: torch.Tensor) -> torch.Tensor:
    """The tensor below functionalization's wrappers (what the recorder binds nodes to)."""
    while torch._is_functional_tensor(t):
        t = torch._from_functional_tensor(t)
    return t


@contextlib.contextmanager
def marked_in_templates() -> Iterator[list[bool]]:
    """Yields a list whose one item says, on leaving, whether the model's code called
    ``requires_grad_()`` in the block outside the main trace (an outlined block's template:
    whether the value becomes a new leaf depends on each call's inputs)."""
    with _raised_inside("marked_outside") as got:
        yield got


@contextlib.contextmanager
def _raised_inside(flag: str) -> Iterator[list[bool]]:
    """Yields a list whose one item says, on leaving, whether :class:`_GradSources`' ``flag``
    was set inside the block (cleared on entering, restored on leaving)."""
    was = getattr(_GradSources, flag)
    setattr(_GradSources, flag, False)
    got = [False]
    try:
        yield got
    finally:
        got[0] = getattr(_GradSources, flag)
        setattr(_GradSources, flag, was)


def _node_of(t: Any) -> Node | None:
    """The node of ``t`` in the graph being traced, after the writes into its base."""
    return recording.node_of(t, sync=True)


@contextlib.contextmanager
def template_grad_sources(
    sources: tuple[bool, ...], leaves: tuple[bool, ...] = ()
) -> Iterator[None]:
    """While an outlined block's template is traced: ``sources[i]`` says whether its
    placeholder ``i`` carries a derivative, for :func:`requires_grad_in_trace`: the call's
    inputs as eager sees them at the call the template is traced for (:func:`grad_states`), its
    parameters where trainable, its buffers not. ``leaves[i]``: whether input ``i`` (the first
    ``len(leaves)`` placeholders) is a leaf there (:func:`eager_flags`)."""
    was = _GradSources.template_sources, _GradSources.template_leaves
    _GradSources.template_sources, _GradSources.template_leaves = sources, leaves
    try:
        yield
    finally:
        _GradSources.template_sources, _GradSources.template_leaves = was


@contextlib.contextmanager
def grad_read_in_templates() -> Iterator[list[bool]]:
    """Yields a list whose one item says, on leaving, whether the model's code read
    ``requires_grad``, ``is_leaf`` or ``grad_fn`` of a value in the block outside the main trace
    (an outlined block's template) whose answer depends on the call's inputs (another call's
    inputs may read otherwise: :func:`eager_flags`)."""
    with _raised_inside("input_read") as got:
        yield got


class TracedGradFn:
    """What ``t.grad_fn`` reads as, while tracing, for a value eager autograd would have given
    one (:func:`eager_flags`: it requires grad and is no leaf); code that only tells it from
    None (``t.grad_fn is None``) reads what eager reads. Its node is not modelled:
    ``next_functions`` is empty, ``name()`` says so."""

    __slots__ = ()
    next_functions: tuple = ()

    def name(self) -> str:
        return "GraphflopTracedBackward"

    @property
    def metadata(self) -> dict:
        return {}


#: the one :class:`TracedGradFn`
TRACED_GRAD_FN = TracedGradFn()


def eager_flags(t: torch.Tensor) -> tuple[bool, bool]:
    """``(t.requires_grad, t.is_leaf)`` as eager PyTorch reads them in a training step, for a
    value ``t`` of the graph being traced (what the model's code reads while tracing,
    :class:`~graphflop.frontend.composite.CompositeOps`): it requires grad where it depends
    on a trainable parameter or a value marked ``requires_grad_`` through differentiable ops
    (not through ``detach`` nor a value made with grad mode off; floating-point or complex
    only), as :func:`requires_grad_in_trace` decides; the model's inputs do not. It is a leaf
    where it requires no grad, or it is a parameter or a value the model made a leaf
    (``requires_grad_()``). In an outlined block's template the call's inputs read as they do
    at the call it is traced for (:func:`template_grad_sources`); an answer that depends on
    them is noted (:func:`grad_read_in_templates`). A tensor with no node reads its own
    flags."""
    if not (t.is_floating_point() or t.is_complex()):
        return False, True
    if _GradSources.template_sources is None or _GradSources.active:
        requires = requires_grad_in_trace(t)
        if not requires:
            return False, True
        node = _node_of(t)
        if node is None:
            return True, False
        return True, node.op == "placeholder" or (LEAF in node.meta and node in _GradSources.marked)
    node = _node_of(t)
    if node is None:
        return bool(t.requires_grad), bool(t.is_leaf)
    phs = {n: i for i, n in enumerate(node.graph.nodes) if n.op == "placeholder"}
    sources = _GradSources.template_sources
    n_in = len(_GradSources.template_leaves)
    reached = [phs[n] for n in _placeholders_reached(node)]
    if any(i >= n_in and (i >= len(sources) or sources[i]) for i in reached):
        requires = True  # through a parameter of the block's own, whatever its inputs
    elif any(i < n_in for i in reached):
        _GradSources.input_read = True
        requires = any(sources[i] for i in reached if i < n_in)
    else:
        requires = False
    if not requires:
        return False, True
    if node.op == "placeholder":
        i = phs[node]
        return True, _GradSources.template_leaves[i] if i < n_in else True
    return True, False


def _placeholders_reached(node: Node) -> list[Node]:
    """The placeholders among ``node`` and its inputs, followed as :func:`_reaches` follows
    them."""
    found: list[Node] = []

    def note(n: Node) -> bool:
        if n.op == "placeholder":
            found.append(n)
        return False

    _reaches([node], note)
    return found


def grad_states(graph: torch.fx.Graph) -> Callable[[Any], tuple[bool, bool]]:
    """Inside the main trace (:func:`grad_sources`), once ``graph`` is recorded: a function
    giving, for a node of it (or a constant, not a node), :func:`eager_flags` of its value as
    the main trace saw it (the trainable parameters and the values marked so far held)."""
    trainable, marked = _GradSources.trainable, set(_GradSources.marked)
    sources: set[Node] = set()

    def state(n: Any) -> tuple[bool, bool]:
        if not isinstance(n, Node):
            return False, True
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()):
            return False, True
        if not sources:  # (the placeholders found once, when first asked)
            placeholders = itertools.takewhile(lambda p: p.op == "placeholder", graph.nodes)
            sources.update(p for i, p in enumerate(placeholders) if i in trainable)
            sources.update(marked)
        if not _reaches([n], sources.__contains__):
            return False, True
        return True, n.op == "placeholder" or (LEAF in n.meta and n in marked)

    return state


def _template_source(n: Node) -> bool:
    """Whether placeholder ``n`` of a template carries a derivative (True where unknown)."""
    sources = _GradSources.template_sources
    if sources is None:
        return True
    i = [p for p in n.graph.nodes if p.op == "placeholder"].index(n)
    return i >= len(sources) or sources[i]


def requires_grad_in_trace(t: torch.Tensor) -> bool:
    """Whether eager's ``t.requires_grad`` would be True: ``t`` depends on a trainable
    parameter or a value marked ``requires_grad_`` (:func:`_differentiable`; a parameter read
    with grad mode off still requires grad, a value made from it there does not). In an outlined
    block's template (outside the main trace) the sources are its trainable parameters and the
    call's inputs that require grad at the call it is traced for (:func:`eager_flags`)."""
    if recording.current() is None:
        return t.requires_grad
    if not (t.is_floating_point() or t.is_complex()):
        return False
    if _GradSources.active:
        return _differentiable((t,))
    node = _node_of(t)
    if node is None:
        return True  # cannot be told: as _differentiable
    if _GradSources.template_sources is not None:  # (an answer that depends on the inputs noted)
        return eager_flags(t)[0]
    return _reaches([node], lambda n: n.op == "placeholder" and _template_source(n))


def _differentiable(args: tuple) -> bool:
    """Whether one of ``args``' tensors depends on a trainable parameter or on a value marked
    ``requires_grad_``, not through a ``detach`` nor a value made with grad mode off (as eager
    autograd sees it; True whenever it cannot be told)."""
    rec = recording.current()
    if rec is None:
        return True
    graph = rec.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sources = {placeholders[i] for i in _GradSources.trainable if i < len(placeholders)}
    sources |= _GradSources.marked
    tensors = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    start: list[Node] = []
    for t in tensors:
        if not (t.is_floating_point() or t.is_complex()):
            continue
        node = _node_of(t)
        if node is None:
            return True
        start.append(node)
    return _reaches(start, sources.__contains__)


def _reaches(start: list[Node], is_source: Callable[[Node], bool]) -> bool:
    """Whether a node ``is_source`` holds for is among ``start`` and their inputs, followed as
    eager autograd follows a derivative: not through a ``detach`` (a stop-gradient) nor a node
    made with grad mode off (no derivative; a write there keeps its own)."""
    seen: set[Node] = set()
    stack = list(start)
    while stack:
        n = stack.pop()
        if is_source(n):
            return True
        if n in seen:
            continue
        seen.add(n)
        if n.target is aten.detach.default:
            continue
        if n.meta.get(NO_GRAD) and NO_GRAD_WRITE not in n.meta:
            continue
        stack.extend(n.all_input_nodes)
    return False


_GENERATOR = torch_checkpoint._checkpoint_without_reentrant_generator


def _traced_generator(
    fn: Any,
    preserve_rng_state: bool = True,
    context_fn: Any = None,
    determinism_check: Any = None,
    debug: bool = False,
    early_stop: bool = True,
    *args: Any,
    **kwargs: Any,
) -> Iterator[None]:
    """Stands in for PyTorch's non-reentrant checkpoint's pre- and post-forward logic (same
    arguments): no hooks; the nodes the forward makes between the two steps are tagged. With
    grad mode off PyTorch checkpoints nothing, and neither does this; early stop off
    (``early_stop=False`` or ``set_checkpoint_early_stop(False)``) reruns the whole region."""
    if not torch.is_grad_enabled():
        yield
        return
    forced = torch_checkpoint._enable_checkpoint_early_stop
    early = forced if forced is not None else early_stop
    with recording.nodes_added() as made:
        yield
    tag_checkpoint(made, whole=not early, unmodelled=_context_fn_note(context_fn))


def _context_fn_note(context_fn: Any) -> str:
    """:attr:`CheckpointTag.unmodelled` for a checkpoint's ``context_fn``: empty for the
    default; otherwise (selective activation checkpointing's policy, which keeps the outputs
    of the ops it names instead of rerunning them, or any other context) what is not
    modelled."""
    if context_fn is None or context_fn is torch_checkpoint.noop_context_fn:
        return ""
    inner = getattr(context_fn, "func", None)
    args = getattr(context_fn, "args", ())
    if inner is torch_checkpoint.create_selective_checkpoint_contexts and args:
        policy = args[0]
        name = getattr(policy, "__qualname__", None) or f"a list of {len(policy)} ops"
        return (
            f"selective activation checkpointing policy {name} not modelled (eager keeps "
            "the outputs of the ops it saves; graphflop reruns the whole region)"
        )
    name = getattr(inner or context_fn, "__qualname__", type(context_fn).__name__)
    return f"checkpoint context_fn {name} not modelled (graphflop reruns as plain checkpoint)"


def run_checkpoint_function(function: Any, *args: Any) -> Any:
    """``CheckpointFunction.apply(function, preserve_rng_state, *args)`` (the reentrant
    checkpoint) while tracing: ``function(*args)``, its nodes tagged as a region the
    backward reruns whole."""
    detached = _active() and not _differentiable(args)
    if not _active() and recording.recording():
        _GradSources.undecided = True
    with recording.nodes_added() as made:
        out = function(*args)
    tag_checkpoint(made, whole=True, detached=detached)
    if detached:  # eager: "None of the inputs have requires_grad=True"; no derivative out
        out = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
    return out


@contextlib.contextmanager
def undecided_checkpoints() -> Iterator[list[bool]]:
    """Yields a list whose one item says, on leaving, whether a reentrant checkpoint ran in
    the block outside the main trace (:attr:`_GradSources.undecided`)."""
    with _raised_inside("undecided") as got:
        yield got


def _active() -> bool:
    """Inside the main trace (:func:`grad_sources`) with a graph being traced."""
    return _GradSources.active and recording.recording()


@contextlib.contextmanager
def checkpoints_tagged() -> Iterator[None]:
    """While active, ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` runs its
    function without saved-tensor hooks and tags its nodes (:func:`_traced_generator`); the
    reentrant form goes through :func:`run_checkpoint_function` (from
    :func:`graphflop.frontend.custom_function.inline_functions`, which sees its
    ``Function.apply``)."""
    torch_checkpoint._checkpoint_without_reentrant_generator = _traced_generator
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = _GENERATOR


#: the code of ``torch.autograd.Function.apply``, whose C++ part runs a Function's forward (a
#: custom op's kernel, through the autograd wrapper ``torch.library`` gives it) with grad mode
#: off whatever the model's mode
_APPLY = Function.__dict__["apply"].__func__.__code__


#: the code of functions the stack walk of :func:`_in_function_apply` stops at: where an
#: outlined block's template is traced inside the main trace, at the block's first call
#: (:func:`outside_main_trace`), the ``Function.apply`` below them is the main trace's
#: (the ``graphflop::repeat`` op's), not the template's
_STACK_BARRIERS: set[Any] = set()


def _in_function_apply() -> bool:
    """Whether the caller runs inside ``Function.apply`` (found on the Python stack, above any
    :data:`_STACK_BARRIERS` frame)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code is _APPLY:
            return True
        if code in _STACK_BARRIERS:
            return False
        frame = frame.f_back
    return False


@contextlib.contextmanager
def outside_main_trace() -> Iterator[None]:
    """While active (inside the main trace: an outlined block's template traced at the block's
    first call, :meth:`graphflop.frontend.outline.Outliner.fake_call`), :class:`_GradSources`
    holds what it holds outside the main trace, as where templates are traced after it
    (:func:`grad_sources` left); the main trace's state is put back on leaving."""
    names = ("trainable", "params", "marked", "stopped", "placeholders", "active", "leaves")
    saved = [getattr(_GradSources, k) for k in names]
    _GradSources.outside()
    try:
        yield
    finally:
        for k, v in zip(names, saved):
            setattr(_GradSources, k, v)


@contextlib.contextmanager
def grad_mode_tagged() -> Iterator[None]:
    """While active, each node ``make_fx``'s tracer makes while the model's code has grad mode
    off is tagged :data:`~graphflop.meta.NO_GRAD`, when grad mode was on on entering (a trace
    started under ``no_grad`` tags nothing: it is the caller's mode, not the model's). Grad
    mode off inside ``Function.apply`` (PyTorch's own Functions; a custom op, an outlined
    block's ``graphflop::repeat`` among them, called with an input that requires grad) is
    autograd's, not the model's: not tagged (with grad mode off when it is called, the
    custom op's wrapper does not go through ``apply``, and its node is tagged). An outlined
    block called with grad mode off is traced in that mode
    (:mod:`graphflop.frontend.outline`), so its template's nodes are tagged themselves."""
    if not torch.is_grad_enabled():
        yield
        return

    def tag(node: Node) -> None:
        if not torch.is_grad_enabled() and node.op == "call_function" and not _in_function_apply():
            node.meta[NO_GRAD] = True

    with recording.each_node(tag):
        yield


@contextlib.contextmanager
def no_grad_write(target: Any) -> Iterator[None]:
    """Around an in-place write into ``target`` (the tensor a call writes into: ``self`` of
    ``Tensor.__setitem__``, ``masked_fill_``, ``copy_``) made while tracing with grad mode off:
    tags the node holding the new value of ``target``'s storage
    :class:`~graphflop.meta.NoGradWrite` with the way to the old value (eager autograd does not
    see the write: the tensor keeps its derivative), and the views of it functionalization
    made again from that value (``target``'s own among them) as views to differentiate.

    Functionalization writes into a view by scattering the written part into the old value of
    the storage (its base: the value the view was taken from, through view ops only) and
    making the view again from the new value with the same view ops; so the new value is the
    node as many view ops above ``target``'s new node as its old node was below the old
    value. Nothing is tagged where that does not hold (a shape that differs, no way back to
    the old value through the nodes the write made): the write then cuts the derivative. A
    write in inference mode into a tensor made outside it runs as under ``no_grad``
    (:func:`_normal_write`)."""
    before = _node_of(target) if not torch.is_grad_enabled() else None
    if before is None:
        yield
        return
    base, depth = _view_base(before)
    with recording.nodes_added() as made, _normal_write(target):
        yield
        after = _node_of(target)  # the view made again from the new value, where it is one
    views: list[Node] = []
    new = after
    while new is not None and len(views) < depth and _is_view(new):
        views.append(new)
        new = new.args[0] if isinstance(new.args[0], Node) else None
    inside = set(made)
    if new is None or len(views) != depth or new not in inside or not _same_kind(new, base):
        return
    # the write reads the old value through the nodes it made and the view written into
    chain = before
    while chain is not base:
        inside.add(chain)
        chain = chain.args[0]  # type: ignore[assignment]
    way = _way(new, base, inside)
    if way is None:
        return
    for n in (new, *views):
        if not n.meta.get(NO_GRAD):  # grad mode not the model's (a custom op's kernel)
            return
    new.meta[NO_GRAD_WRITE] = NoGradWrite(way)
    for v in views:
        v.meta[NO_GRAD_WRITE] = NoGradWrite(None)


@contextlib.contextmanager
def detached_write(target: Any) -> Iterator[None]:
    """Grad mode off around an in-place write made with grad mode on into a view of a
    ``detach()`` (``torch.embedding_renorm_(weight.detach(), ...)``, which
    ``F.embedding(max_norm=...)`` calls to renormalize the rows it reads, ``h.detach().mul_(2)``):
    eager autograd does not record it (the alias requires no grad), so the tensor it was
    detached from keeps its derivative with the written values, as after a write under
    ``no_grad``; so the write is traced as one (:func:`no_grad_write`). Nothing otherwise."""
    node = _node_of(target) if torch.is_grad_enabled() else None
    while node is not None and _is_view(node) and node.target is not aten.detach.default:
        node = node.args[0]  # type: ignore[assignment]
    if node is None or node.target is not aten.detach.default:
        yield
        return
    with torch.no_grad():
        yield


@contextlib.contextmanager
def _normal_write(target: Any) -> Iterator[None]:
    """Inference mode off (grad mode still off) around a write made in inference mode into a
    tensor made outside it: eager writes into that tensor, which stays a normal one;
    functionalization would make its new value anew, in inference mode, an inference tensor
    the rest of the trace could not differentiate ('Inference tensors cannot be saved for
    backward')."""
    if not torch.is_inference_mode_enabled() or target.is_inference():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def _is_view(n: Node) -> bool:
    """Whether ``n``'s output aliases its first input: a view op's (ATen's schema says so), or
    one output of a view op with several (``split``)."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return isinstance(n.args[0], Node) and _is_view(n.args[0])
    return bool(getattr(n.target, "is_view", False)) and isinstance(n.args[0], Node)


def _view_base(n: Node) -> tuple[Node, int]:
    """The node ``n`` is a view of through view ops only, and how many view ops away."""
    depth = 0
    while _is_view(n):
        n, depth = n.args[0], depth + 1  # type: ignore[assignment]
    return n, depth


def _same_kind(a: Node, b: Node) -> bool:
    """Whether two nodes' values have one shape and one dtype."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (
        isinstance(va, torch.Tensor)
        and isinstance(vb, torch.Tensor)
        and va.shape == vb.shape
        and va.dtype == vb.dtype
    )


def _way(start: Node, goal: Node, inside: set[Node]) -> tuple[int, ...] | None:
    """The shortest way from ``start`` to ``goal`` through the nodes in ``inside``: positions
    in ``node.args``, one per step (:attr:`~graphflop.meta.NoGradWrite.before`), or None."""
    queue: deque[tuple[Node, tuple[int, ...]]] = deque([(start, ())])
    seen = {start}
    while queue:
        n, way = queue.popleft()
        for i, a in enumerate(n.args):
            if a is goal:
                return (*way, i)
            if isinstance(a, Node) and a in inside and a not in seen:
                seen.add(a)
                queue.append((a, (*way, i)))
    return None
