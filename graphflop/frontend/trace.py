"""Model → forward graph of core ATen ops on FakeTensors, with the loss at its end: the
:func:`trace` entry point and its ``make_fx`` driver.

``make_fx`` over ``torch.func.functionalize`` (Python control flow on shapes traces; in-place
ops become functional, buffer writes become outputs) turns the model and a loss
(:mod:`graphflop.frontend.loss`) into a graph whose placeholders are the parameters, buffers,
inputs and loss targets, in one pass: the decomposition table (PyTorch's core-ATen set extended
by the rule files, :func:`graphflop.ops.decomposition_table`) breaks composite ops into the parts
docs/flops_conventions.md counts as they are traced. While tracing, process-wide state is changed
and restored: global module hooks record module paths (:mod:`graphflop.frontend.scopes`), composite
ops are routed to graphflop's decompositions (:mod:`graphflop.frontend.composite`), identical
repeated modules are traced once (:mod:`graphflop.frontend.outline`). Tracing runs on FakeTensors:
no activation memory. :func:`from_exported` takes a ``torch.export`` program instead; both give the
graph in the form :mod:`graphflop.frontend.export_form` writes.

Writes (through :func:`~graphflop.frontend.export_form.from_make_fx`) on each node: ``val``
(PyTorch), ``KIND="primal"``, ``ROLE`` (``forward`` or ``loss``), ``SOURCE``, ``MODULE`` (the
``nn.Module`` path), ``PARAM_DERIVED``; on parameter placeholders ``PARAM``. Writes
``gm.meta[SIGNATURE]`` (its ``frozen``: the parameters with ``requires_grad=False``), ``CONSTANTS``, ``LOSS_KIND``, ``FACTS``, ``OUTLINED``
(:class:`~graphflop.meta.OutlineInfo`), ``HIERARCHY`` (:class:`~graphflop.meta.Hierarchy`,
where blocks were outlined; :mod:`graphflop.frontend.hierarchy`) and ``ASSUMPTIONS`` (the routing that sized a
data-dependent expert dispatch, :mod:`graphflop.frontend.dispatch`; the modules a training-mode
model left in eval mode, :func:`modules_in_eval`).

Every name other modules import from here stays importable here: :func:`trace`,
:class:`TraceError`, :func:`from_exported`, :func:`decomposition_table`, :func:`loss_value`,
:func:`default_loss`, :func:`make_targets`, :data:`LOSSES`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import operator
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from graphflop.frontend import outline as repeats
from graphflop.frontend import recording
from graphflop.frontend.composite import CompositeOps, tagged_decompositions
from graphflop.frontend.custom_function import inline_functions, trace_records
from graphflop.frontend.direct_hierarchy import build_direct, flat_forward, forget
from graphflop.frontend.dispatch import (
    RoutedDispatch,
    routed_index_decompositions,
    routed_nonzero,
)
from graphflop.frontend.errors import (
    MixedDtypes,
    TraceError,
    find_cause,
    first_line,
    library_logs_quiet,
    quiet_loggers,
)
from graphflop.frontend.export_form import from_exported, from_make_fx
from graphflop.frontend.fakecache import fast_cache_hits
from graphflop.frontend.hierarchy import build as build_hierarchy
from graphflop.frontend.inputs import bind_call, split_example
from graphflop.frontend.libraries import (
    CacheMade,
    cache_assumption,
    cache_configs,
    caches_off,
    caches_refused,
    data_dependent_hint,
    stacked_experts_in,
    traced_by_libraries,
)
from graphflop.frontend.loss import (
    LOSSES,
    default_loss,
    differentiable,
    loss_output,
    loss_value,
    make_targets,
    output_tensors,
    single_class,
    single_class_line,
    single_class_refusal,
    token_vocabularies,
)
from graphflop.frontend.regions import (
    _STACK_BARRIERS,
    checkpoints_tagged,
    grad_mode_tagged,
    grad_read_in_templates,
    grad_sources,
    grad_states,
    mark_requires_grad,
    marked_in_templates,
    outside_main_trace,
    resume_gradient,
    stop_gradient,
    template_grad_sources,
    undecided_checkpoints,
)
from graphflop.frontend.replay import Replays
from graphflop.frontend.scopes import ModuleScopes, qualname
from graphflop.meta import (
    ASSUMPTIONS,
    CHECKPOINT,
    COMPOSITE,
    HIERARCHY,
    MODULE,
    NO_GRAD,
    NO_GRAD_WRITE,
    OUTLINED,
    SIGNATURE,
    CompositeTag,
    OutlineInfo,
    fake_mode_of,
    fresh_fake,
    fresh_fakes,
)
from graphflop.ops import decomposition_table
from graphflop.ops.recurrent import functionalize_inplace

__all__ = [
    "LOSSES",
    "TraceError",
    "as_fake",
    "decomposition_table",
    "default_loss",
    "from_exported",
    "loss_value",
    "make_targets",
    "trace",
]

aten = torch.ops.aten


def trace(
    model: nn.Module,
    inputs: Any,
    *,
    loss: str = "auto",
    fake_mode: FakeTensorMode | None = None,
    reuse: bool = True,
    kwargs: dict[str, Any] | None = None,
) -> GraphModule:
    """Trace ``model`` on ``inputs`` (FakeTensors or real tensors) followed by ``loss``.

    Args:
        model: the module; its mode (train/eval) is used as is.
        inputs: the model's inputs in any form :func:`graphflop.analyze` takes (a tensor, a
            tuple or list of positional arguments, a dict of keyword arguments, or
            ``(args, kwargs)``; :func:`graphflop.frontend.inputs.split_example`); with
            ``kwargs`` given, the positional arguments alone, as a tuple or list.
        loss: ``cross_entropy`` (against integer targets), ``mse``, ``sum``, ``output`` (the
            model's first output is already the scalar loss), ``none`` or ``auto``
            (cross-entropy for (N, C) logits and for a language model's (B, T, V) token
            logits, else sum; :func:`default_loss`).
        fake_mode: the FakeTensorMode to trace in (default: the inputs', else a new one).
        reuse: trace each set of identical repeated modules (a transformer's blocks) once
            and copy the graph (:mod:`graphflop.frontend.outline`); the graph is the same either way.
        kwargs: keyword arguments of the model call (None: those ``inputs`` holds, if any;
            an empty dict: none, ``inputs`` taken as the positional arguments whatever their
            form). Tensors among ``inputs`` and ``kwargs``
            become the graph's inputs (positional ones first); other values are constants
            (:mod:`graphflop.frontend.inputs`).

    Returns:
        An ``fx.GraphModule`` of core ATen ops. Its placeholders are the parameters, buffers,
        inputs and targets (see ``gm.meta[SIGNATURE]``); its outputs are the buffer updates,
        then the loss, then the model's outputs.

    Raises:
        TraceError: when the model cannot be traced (the cause is chained), or it has
            uninitialised lazy parameters, a TorchScript module (the model or a submodule:
            ``torch.jit.script``), or a tensor that is both a parameter and a buffer.
        TypeError: ``inputs`` in none of those forms.
    """
    if loss not in LOSSES + ("auto",):
        raise ValueError(f"unknown loss {loss!r}; one of {', '.join(LOSSES)} or auto")
    if kwargs is None:
        inputs, kwargs = split_example(inputs)
    _refused(model)
    # the graphs describe training whatever the caller's grad mode: a model's own no_grad
    # regions are told apart under it (``with torch.no_grad(): analyze(...)`` hid them)
    with _grad_on():
        return _trace_in(model, tuple(inputs), loss, fake_mode, reuse, kwargs or {})


def _refused(model: nn.Module) -> None:
    """:func:`_refuse_lazy`, then :func:`_refuse_scripted`, of ``model``. Where every module
    of its tree walks as ``nn.Module`` does (:func:`repeats._plain_walk`: none is a
    TorchScript module), by one plain walk of the tree that looks at each module's tables
    (where none holds a lazy tensor, neither refusal has anything to say); else, and to name
    what is refused, by the refusals' own walks."""
    tree = repeats._tree(model)
    if all(repeats._plain_walk(type(m)) for _, m in tree):
        from torch.nn.parameter import is_lazy as lazy

        is_lazy: Any = lazy  # (of a table's values: None among them)
        if not any(
            any(map(is_lazy, m._parameters.values())) or any(map(is_lazy, m._buffers.values()))
            for _, m in tree
        ):
            return
    _refuse_lazy(model)
    _refuse_scripted(model)


def _refuse_lazy(model: nn.Module) -> None:
    """Raise a TraceError naming the first uninitialised lazy parameter or buffer of ``model``
    (``nn.LazyLinear`` before its first call: its shapes are not known yet)."""
    from torch.nn.parameter import is_lazy

    for kind, named in (("parameter", model.named_parameters), ("buffer", model.named_buffers)):
        for name, t in named():
            if is_lazy(t):
                raise TraceError(
                    f"the model's {kind} {name} is an uninitialised lazy {kind} (a Lazy* "
                    "module before its first call: its shape is not known yet): run the model "
                    "once on an example batch before analysing it (graphflop inspect does that "
                    "for a model file)"
                )


def _refuse_scripted(model: nn.Module) -> None:
    """Raise a TraceError naming the first TorchScript module of ``model`` (the model itself,
    ``""``, or a submodule: ``torch.jit.script(...)``): its forward runs in the TorchScript
    interpreter, whose module tables are not Python dicts (its parameters live in C++), so the
    trace can neither swap them for traced tensors nor tell its layers apart."""
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            what = f"the model's submodule {name}" if name else "the model"
            raise TraceError(
                f"{what} is a TorchScript module ({type(m).__name__} of "
                f"{getattr(m, 'original_name', '?')}, from torch.jit.script or "
                "torch.jit.trace), which graphflop cannot trace: analyse the Python module it "
                "was scripted from (build the model without torch.jit.script)"
            )


def _refuse_parameter_buffers(params: dict, buffers: dict) -> None:
    """Raise a TraceError where one tensor is a parameter of one module and a buffer of another
    (``register_buffer("w", other.weight)``), naming both places (``params``, ``buffers``: as
    ``named_parameters`` and ``named_buffers`` list them, each tensor at its first place): a
    parameter is an input the step updates, a buffer state it carries, and one tensor cannot
    be both (torch's ``functional_call`` refuses it, naming an option the user cannot give)."""
    both = {id(t) for t in params.values()}.intersection(map(id, buffers.values()))
    if not both:
        return
    held = next(q for q, t in params.items() if id(t) in both)
    name = next(q for q, t in buffers.items() if t is params[held])
    raise TraceError(
        f"one tensor is both the parameter {held} and the buffer {name}: hold it in one role, "
        f"e.g. read {held} where {name} is read, assign the parameter (not register_buffer) to "
        f"make {name} a tied parameter, or register a copy ({held}.detach().clone()) as the "
        "buffer"
    )


@contextlib.contextmanager
def _grad_on() -> Iterator[None]:
    """Grad mode on and inference mode off, as in a training step, whatever they were."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def _trace_in(
    model: nn.Module,
    inputs: tuple,
    loss: str,
    fake_mode: FakeTensorMode | None,
    reuse: bool,
    kwargs: dict[str, Any],
) -> GraphModule:
    configs = cache_configs(model, inputs, kwargs)
    with _bound(model, inputs, kwargs) as tensors:
        fake_mode = fake_mode or fake_mode_of(tensors) or FakeTensorMode(allow_non_fake_inputs=True)
        tensors = tuple(as_fake(fake_mode, t) for t in tensors)
        # FakeTensorMode logs a traceback before re-raising a kernel's error (a shape mismatch
        # in the model); the error itself becomes graphflop's one-line TraceError
        quiet = quiet_loggers("torch._subclasses.fake_tensor")
        # the module tree walked once for what reads it before the model's code first runs
        # (a later attempt walks it again: :func:`_trace`)
        first = [repeats.Walk(model)]
        outside = repeats.held_outside(first[0].modules)
        shared = repeats.held_shared(model, outside) if outside else None
        if shared:
            raise TraceError(shared)
        # (each attempt of :func:`_trace` puts the modules' state back, and
        # :func:`_meta_attributes` its own changes: nothing else here writes into a module)
        with (
            quiet,
            library_logs_quiet(),
            traced_by_libraries(),
            _meta_attributes(model, fake_mode, first[0].modules, outside, first[0].holders()),
        ):
            gm = _without_cache(
                configs, lambda: _trace(model, tensors, loss, fake_mode, reuse, first)
            )
    line = repeats.held_outside_line(model, outside) if outside else None
    if line:
        gm.meta[ASSUMPTIONS] += (line,)
    _check_matmul_dtypes(gm)
    return gm


def _without_cache(configs: list, run: Any) -> GraphModule:
    """``run()``'s graph, traced with the KV cache off where the model would make one and the
    call did not ask for it (``configs``: :func:`cache_configs`), with the report's line saying
    so (:func:`cache_assumption`): the cache is an argument every layer writes into, which
    keeps the layers from being traced once, and training does not read it. A model that
    makes no cache is traced once, as it is; one that makes a cache whatever its
    configuration says is traced with it, and no line."""
    if not configs:
        return run()
    try:
        with caches_refused():
            return run()
    except Exception as e:
        made = find_cause(e, CacheMade)
        if made is None:
            raise
    try:
        with caches_off(configs), caches_refused():
            gm = run()
    except Exception as e:
        if find_cause(e, CacheMade) is None:
            raise
        return run()
    gm.meta[ASSUMPTIONS] = (*gm.meta.get(ASSUMPTIONS, ()), cache_assumption(made.kind))
    return gm


#: matrix-class ops whose eager kernels refuse operands of two dtypes (their meta kernels, which
#: fake tensors run, do not check)
SAME_DTYPE_OPERANDS = {
    aten.mm.default: (0, 1),
    aten.addmm.default: (0, 1, 2),
    aten.bmm.default: (0, 1),
    aten.convolution.default: (0, 1),
}


def _check_matmul_dtypes(gm: GraphModule) -> None:
    """Refuse a graph that eager PyTorch could not run: a matrix product or convolution of
    operands in two dtypes (a float64 model given float32 inputs: ``mat1 and mat2 must have the
    same dtype``).

    Raises:
        TraceError: naming the op, the dtypes and the module.
    """
    # where the forward calls its blocks, each template's products once and the top level's
    # (a call's copies read values of its template's nodes' dtypes: none of them is refused
    # where no template's node is); the flat graph's where one is (the first named)
    h = gm.meta.get(HIERARCHY)
    if h is not None and isinstance(h.graph, GraphModule):
        if not any(_mixed_dtypes(g) for g in (h.graph.graph, *h.templates)):
            return
    refused = _mixed_dtypes(gm.graph)
    if not refused:
        return
    n = next(n for n in gm.graph.nodes if n in refused)
    module = n.meta.get(MODULE) or "the model"
    raise MixedDtypes(
        f"{n.target.name()} in {module} multiplies {' and '.join(refused[n])} operands, "
        "which PyTorch refuses (it needs one dtype)",
        "give inputs in the parameters' dtype (--dtype), or cast one side in the model",
    )


def _mixed_dtypes(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[str]]:
    """The matrix products and convolutions of ``graph`` whose operands are in two dtypes, and
    those dtypes (found by fx's table of nodes by op, not a walk over every node)."""
    refused: dict[torch.fx.Node, list[str]] = {}
    for op, where in SAME_DTYPE_OPERANDS.items():
        for n in graph.find_nodes(op="call_function", target=op):
            args = [n.args[i] for i in where]
            vals = [a.meta.get("val") for a in args if isinstance(a, torch.fx.Node)]
            dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in vals if v is not None})
            if len(dtypes) > 1:
                refused[n] = dtypes
    return refused


@contextlib.contextmanager
def _bound(model: nn.Module, args: tuple, kwargs: dict) -> Iterator[tuple]:
    """The model called on tensors only while tracing: bound to ``args``/``kwargs`` when they
    hold keyword or non-tensor arguments, and given its own class back afterwards."""
    if not kwargs and all(isinstance(t, torch.Tensor) for t in args):
        yield args
        return
    cls = type(model)
    try:
        yield bind_call(model, args, kwargs)
    finally:
        model.__class__ = cls


@contextlib.contextmanager
def _meta_attributes(
    model: nn.Module,
    fake_mode: FakeTensorMode,
    modules: list[nn.Module] | None = None,
    outside: list[nn.Module] | None = None,
    holders: list[nn.Module] | None = None,
) -> Iterator[None]:
    """A module's tensor attributes that are neither parameters nor buffers (``self.scale =
    torch.ones(8)``, the original LLaMA's ``self.freqs_cis``) made fake CPU tensors while
    tracing where the model was built on the meta device, as its parameters and buffers are
    (:func:`as_fake`): a meta tensor beside the inputs' CPU ones is a device mismatch. One
    tensor held by several modules stays one (one constant of the trace, as in eager). So are
    the parameters and buffers of a module the model holds only as a plain attribute
    (:func:`repeats.held_outside`): constants of the trace, as they are on a real device.
    ``modules``: ``list(model.modules())``, ``outside``: those modules, and ``holders``: the
    modules of ``modules`` holding a tensor attribute (:meth:`repeats.Walk.holders`), where
    the caller has them."""
    tree = list(model.modules()) if modules is None else modules
    if outside is None:
        outside = repeats.held_outside(tree)
    saved: list[tuple[dict, str, torch.Tensor]] = []
    fakes: dict[int, torch.Tensor] = {}
    try:
        if holders is None:
            holders = list(filter(repeats.holds_tensors, tree))
        tables = [m.__dict__ for m in [*holders, *filter(repeats.holds_tensors, outside)]]
        tables += [t for m in outside for t in (m._parameters, m._buffers)]
        for table in tables:
            for k, v in list(table.items()):
                if isinstance(v, torch.Tensor) and not _is_fake(v) and v.device.type == "meta":
                    fake = fakes.get(id(v))
                    if fake is None:
                        fake = fakes[id(v)] = as_fake(fake_mode, v)
                    saved.append((table, k, v))
                    table[k] = fake
        yield
    finally:
        for table, k, v in saved:
            table[k] = v


@contextlib.contextmanager
def _state_swapped(
    modules: list[nn.Module], tensors: list[torch.Tensor], traced: list[torch.Tensor]
) -> Iterator[None]:
    """Each of ``tensors`` (the model's parameters and buffers) held as its traced tensor in
    ``traced`` (the FakeTensors the model's call was traced with) in every module of
    ``modules`` that holds it (a tied weight in each), as ``functional_call`` holds them during
    the call; put back afterwards. Outlined calls' templates are traced with them so (after the
    model's call, :func:`_templates`): a template that reads a tensor of a module outside its
    own (a global module) reads a FakeTensor its trace does not know, a constant, which it
    refuses (:func:`_outside_state`), whether the model was built on the meta device or not;
    the meta tensor itself would meet the trace's CPU ones, a device mismatch (a tester's
    finding). Cost: one look at each module's tables (GPT-2 XL's 580 tensors in
    582 modules: 0.4 ms)."""
    swap = {id(t): f for t, f in zip(tensors, traced) if f is not t}
    saved: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for m in modules:
            for table in (m._parameters, m._buffers):
                for k, v in table.items():
                    if v is not None and id(v) in swap:
                        saved.append((table, k, v))
        for held, k, v in saved:
            held[k] = swap[id(v)]
        yield
    finally:
        for held, k, v in reversed(saved):
            held[k] = v


_IS = operator.is_


@contextlib.contextmanager
def _state_kept(
    model: nn.Module,
    modules: list[nn.Module] | None = None,
    holders: list[nn.Module] | None = None,
) -> Iterator[None]:
    """Puts every module's parameters, buffers and plain tensor attributes back afterwards:
    ``functional_call`` leaves a module reachable by two paths holding the traced tensors (a
    PyTorch bug), and a forward pre-hook that sets an attribute (the old
    ``nn.utils.weight_norm`` and ``spectral_norm`` set ``module.weight``, computed from the
    parameters) leaves the traced tensor there; one the trace made where there was none is
    removed, as is a parameter or buffer the model's forward registered (a buffer made at the
    first call: the model's own run would make it again), and each module's submodules are put
    back as they were (a forward that swaps one in and leaves it). ``modules``:
    ``list(model.modules())``, and ``holders``: those of them holding a tensor attribute
    (:meth:`repeats.Walk.holders`), where the caller has them."""
    if modules is None:
        modules = list(model.modules())
    if holders is None:
        holders = list(filter(repeats.holds_tensors, modules))
    held = set(map(id, holders))
    saved = [
        (
            m,
            dict(m._parameters),
            dict(m._buffers),
            _tensor_attributes(m) if id(m) in held else {},
            dict(m._modules),
        )
        for m in modules
    ]
    try:
        yield
    finally:
        holds = repeats.holds_tensors
        for m, params, buffers, attributes, children in saved:
            # a parameter or buffer the forward registered: removed (the tables compared
            # first: almost always the same names, and then nothing is removed)
            ps, bs, ms = m._parameters, m._buffers, m._modules
            if ps.keys() != params.keys():
                for k in ps.keys() - params.keys():
                    del ps[k]
            if params:
                ps.update(params)
            if bs.keys() != buffers.keys():
                for k in bs.keys() - buffers.keys():
                    del bs[k]
                    m._non_persistent_buffers_set.discard(k)
            if buffers:
                bs.update(buffers)
            if ms.keys() != children.keys() or not all(map(_IS, ms.values(), children.values())):
                ms.clear()
                ms.update(children)
            # (a module holding no tensor attribute before or after: none to put back)
            if attributes or holds(m):
                for k in _tensor_attributes(m).keys() - attributes.keys():
                    del m.__dict__[k]
                m.__dict__.update(attributes)


def _tensor_attributes(m: nn.Module) -> dict[str, torch.Tensor]:
    """``m``'s tensor attributes that are neither parameters nor buffers (they live in its
    ``__dict__``); most modules hold none, which one look without a Python loop tells
    (:func:`~graphflop.frontend.outline.holds_tensors`)."""
    if not repeats.holds_tensors(m):
        return {}
    return {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)}


def _trace(
    model: nn.Module,
    inputs: tuple,
    loss: str,
    fake_mode: FakeTensorMode,
    reuse: bool,
    first: list[repeats.Walk] | None = None,
) -> GraphModule:
    """Trace with outlining, leaving out a structure that turns out not outlinable and
    starting again. ``first``: a list holding the module tree's :class:`repeats.Walk` made
    since the model's code last ran, taken by the first attempt (emptied); each later attempt
    walks the tree again."""
    excluded: set[int] = set()
    start = first.pop() if first else repeats.Walk(model)
    left_out: list[tuple[list[nn.Module], str]] = (
        repeats.unshared(model, modules=start.modules, holders=start.holders()) if reuse else []
    )
    walk: repeats.Walk | None = start
    while True:
        # the module tree walked once per attempt, before the model's code runs (a failed
        # attempt ran it)
        if walk is None:
            walk = repeats.Walk(model)
        outline = repeats.plan(model, excluded, walk=walk) if reuse else {}
        try:
            # each attempt puts the state back: a failed one may leave a module reachable by
            # two paths holding its traced tensors (:func:`_state_kept`)
            with _state_kept(model, walk.modules, walk.holders()):
                gm = _trace_once(model, inputs, loss, fake_mode, outline, walk)
        except Exception as e:
            walk = None  # (the model's code ran: the next attempt walks the tree again)
            cause = find_cause(e, repeats.NotOutlinable)
            if cause is None or not outline:
                raise
            excluded.add(cause.structure)
            if cause.structure < 0:  # no structure's own: none is outlined
                left_out.append(([], f"every repeated block traced in full: {cause}"))
            else:
                modules = [m for m, s in outline.items() if s == cause.structure]
                left_out.append((modules, str(cause)))
            # a structure's own fault: leave it out; past two retries (or a fault of no
            # structure), trace everything in full rather than start again once more
            reuse = cause.structure >= 0 and len(excluded) <= 2
            if cause.structure >= 0 and not reuse:
                left_out.append(
                    (
                        [],
                        "every other repeated block traced in full too (three "
                        "structures were not outlinable)",
                    )
                )
            continue
        info = gm.meta[OUTLINED]
        gm.meta[OUTLINED] = dataclasses.replace(
            info, in_full=_in_full(model, left_out) + info.in_full
        )
        return gm


def _in_full(model: nn.Module, groups: list[tuple[list[nn.Module], str]]) -> tuple[str, ...]:
    """One line per group of repeated modules traced in full: ``Block ×3 (blocks.0, blocks.1,
    blocks.2): why`` (the first two and the last of a longer list), or ``why`` alone for a
    group of none."""
    if not groups:
        return ()
    path = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    lines = []
    for modules, why in groups:
        if not modules:
            lines.append(why)
            continue
        names = [path.get(id(m), "?") for m in modules]
        shown = ", ".join(names if len(names) <= 3 else [*names[:2], "…", names[-1]])
        lines.append(f"{type(modules[0]).__name__} ×{len(modules)} ({shown}): {why}")
    return tuple(lines)


def _templates_held(
    outliner: repeats.Outliner,
    table: dict,
    fake_mode: FakeTensorMode,
    modes: Any,
    walk: repeats.Walk,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    flat_state: list,
    gm: GraphModule | None = None,
    states: Any = None,
    early: _Early | None = None,
) -> dict:
    """:func:`_templates` of ``outliner``'s calls, traced with the model's parameters and
    buffers held as the fake tensors its traced call used (``flat_state``, in the order of
    ``params`` then ``buffers``). The templates are traced after the model's call, when its
    parameters and buffers are its own again, which a template reaching one outside its module
    would read as a constant (real, or a meta tensor beside the trace's CPU ones); each traced
    tensor's qualified name, by identity, lets :func:`_templates` name such a read. ``gm``: the
    main trace's graph, whose ``repeat`` nodes are the calls; ``states``: its
    :func:`~graphflop.frontend.regions.grad_states`."""
    if not outliner.calls:
        return _templates(outliner, table, fake_mode, modes, {})
    names = {id(t): q for t, q in zip(flat_state, [*params, *buffers])}
    state = [*params.values(), *buffers.values()]
    with _state_swapped(walk.modules, state, flat_state):
        return _templates(outliner, table, fake_mode, modes, names, _CallInputs(gm, states), early)


class _CallInputs:
    """The eager ``(requires_grad, is_leaf)`` of the inputs of each outlined call (the main
    trace's ``repeat`` nodes of ``gm``, in order; ``states``: its
    :func:`~graphflop.frontend.regions.grad_states`), worked out when asked for; every input
    requires no grad without ``gm``."""

    def __init__(self, gm: GraphModule | None = None, states: Any = None):
        self.states = states
        self.calls: dict[int, list[list]] = {}
        self._memo: dict[Any, tuple[bool, bool]] = {}
        if gm is not None and states is not None:
            op = torch.ops.graphflop.repeat.default
            for n in gm.graph.nodes:
                if n.target is op:
                    self.calls.setdefault(n.args[1], []).append(n.args[0])

    def of(self, key: int, n_inputs: int) -> list[tuple[tuple[bool, bool], ...]]:
        """Per call of ``key`` (its first first), its ``n_inputs`` inputs' flags."""
        calls = self.calls.get(key) or [[None] * n_inputs]
        return [tuple(self._state(a) for a in operands[:n_inputs]) for operands in calls]

    def first(self, key: int, n_inputs: int) -> tuple[tuple[bool, bool], ...]:
        """The flags of the inputs of the first call of ``key``."""
        calls = self.calls.get(key) or [[None] * n_inputs]
        return tuple(self._state(a) for a in calls[0][:n_inputs])

    def _state(self, a: Any) -> tuple[bool, bool]:
        if self.states is None or a is None:
            return False, True
        found = self._memo.get(a)
        if found is None:
            found = self._memo[a] = self.states(a)
        return found


def _trace_once(
    model: nn.Module,
    inputs: tuple,
    loss: str,
    fake_mode: FakeTensorMode,
    outline: dict,
    walk: repeats.Walk | None = None,
) -> GraphModule:
    if walk is None:
        walk = repeats.Walk(model)
    paths = walk.paths("model")  # (ModuleScopes': read before the model's code runs)
    params = dict(walk.named("_parameters"))  # (model.named_parameters())
    buffers = dict(walk.named("_buffers"))
    _refuse_parameter_buffers(params, buffers)
    flat_state = as_fakes(fake_mode, [*params.values(), *buffers.values()])
    n_p, n_b = len(params), len(buffers)
    slots = _state_slots(model, walk, params, buffers)
    chosen: dict[str, Any] = {}

    def objective(*flat):
        state = (dict(zip(params, flat[:n_p])), dict(zip(buffers, flat[n_p : n_p + n_b])))
        ids = flat[n_p + n_b :]
        with ModuleScopes(model, paths=paths) as scopes:
            # the tables the model looks its integer inputs up in: its token embeddings
            with token_vocabularies(model, ids, walk.modules) as vocab:
                if slots is None:
                    out = torch.func.functional_call(model, state, tuple(ids))
                else:  # (functional_call's reparametrization, slot by slot)
                    out = _call_holding(model, slots, flat, tuple(ids))
            scopes.leave_model()
            outs = output_tensors(out)
            if not outs:
                raise TraceError(
                    f"no tensor in the model's output (a {type(out).__name__}): return a "
                    "tensor, or a tuple, list, dict or dataclass of tensors"
                )
            # the loss is computed from the first floating-point output (a model may return
            # its predicted classes first, then the logits)
            head = loss_output(outs)
            kind = default_loss(head, ids, vocab) if loss == "auto" else loss
            line = _check_loss(kind, loss == "auto", head)
            if line:
                chosen["line"] = line
            chosen["loss"] = kind
            if kind == "none":
                return tuple(outs)
            # the targets are made here, in the graph, and become placeholders afterwards
            targets = make_targets(kind, head, fake_mode, inside=True)
            chosen["targets"] = [scopes.mark(t) for t in targets]
            return (loss_value(kind, head, targets), *outs)

    regions = _Numbers()
    replays = Replays(regions)
    table = replays.wrap(tagged_decompositions(decomposition_table(), regions))
    # not replayed: the same mask shape may stand for another expert's rows
    table.update(_chained(table, routed_index_decompositions()))
    dispatch = RoutedDispatch()
    modes = _FunctionModes(dispatch, CompositeOps())
    outliner = repeats.Outliner(outline, fake_mode, transparent=modes.passes_custom_ops, walk=walk)
    trainable = {i for i, p in enumerate(params.values()) if p.requires_grad}
    left_off: set[int] = set()  # trainable ones the forward turned off and left so
    early = _Early(outliner, regions, table, fake_mode, modes, torch.is_grad_enabled())
    try:
        with (
            routed_nonzero(),
            warnings.catch_warnings(record=True) as caught,
            fake_mode,
            inline_functions() as records,
            checkpoints_tagged(),
            _requires_grad_ignored(),
            _input_writes_unrecorded(),
            _tensor_metadata_shared(),
            fast_cache_hits(),
        ):
            # recorded, not shown: fake tensors make torch warn about its own internals; the
            # model's own warnings are shown once each after the trace (_reemit)
            warnings.simplefilter("always")
            early.records = records
            outliner.first_template = early.trace
            with outliner, grad_sources(trainable, tuple(params), left_off), grad_mode_tagged():
                gm = _recorder(
                    torch.func.functionalize(modes.around(objective)), decomposition_table=table
                )(*flat_state, *inputs)
                states = grad_states(gm.graph) if outliner.calls else None
            outliner.first_template = None
            templates = _templates_held(
                outliner,
                table,
                fake_mode,
                modes,
                walk,
                params,
                buffers,
                flat_state,
                gm,
                states,
                early,
            )
            with modes:
                trace_records(records, table, fake_mode)
    except TraceError:
        _reemit(caught)
        raise
    except Exception as e:
        if find_cause(e, (repeats.NotOutlinable, CacheMade)) is not None:
            raise  # the caller traces again: its warnings are shown then
        _reemit(caught)
        pipe = find_cause(e, BrokenPipeError)  # the model printed into a closed pipe
        if pipe is not None:
            raise pipe from None
        hint = data_dependent_hint(e)
        if hint is not None and stacked_experts_in(e) is None:  # that hint names its fix
            hint = dispatch.refusal(e) or hint
        raise TraceError(
            hint
            or f"tracing the model on the example inputs failed: {type(e).__name__}: "
            f"{first_line(e)}{_advice(e)}"
        ) from e
    _reemit(caught)
    for rec in {r.name: r for r in records if r.reason}.values():
        warnings.warn(
            f"custom autograd.Function {rec.name}: {rec.reason}; its backward and JVP are "
            "left incomplete",
            UserWarning,
            stacklevel=2,
        )
    form = dict(
        params=list(params),
        buffers=list(buffers),
        n_inputs=len(inputs),
        loss_kind=chosen["loss"],
        target_nodes=chosen.get("targets", []),
    )
    # the module tree as walked before the model's code ran, where it is still so
    after = walk.after()
    out, copies = _forward_and_hierarchy(gm, templates, model, form, after)
    skipped = [(list(modules), why) for why, modules in outliner.in_full.values()]
    out.meta[OUTLINED] = OutlineInfo(
        calls=copies, traced_once=len(templates), in_full=_in_full(model, skipped)
    )
    out.meta[ASSUMPTIONS] = tuple(dispatch.lines) + ((chosen["line"],) if "line" in chosen else ())
    in_eval = modules_in_eval(model, after.tree)
    if in_eval:
        out.meta[ASSUMPTIONS] += (_in_eval_line(in_eval),)
    written = out.meta[SIGNATURE].params_written
    if written:
        out.meta[ASSUMPTIONS] += (_written_line(written),)
    sig = out.meta[SIGNATURE]
    off = {q for i, q in enumerate(params) if i in left_off}
    frozen = tuple(p for p, q in sig.params if not params[q].requires_grad or q in off)
    frozen += _detached_only(out, frozen)
    frozen += _no_grad_only(out, frozen)
    out.meta[SIGNATURE] = dataclasses.replace(sig, frozen=frozen)
    return out


def _state_slots(
    model: nn.Module, walk: repeats.Walk, params: dict, buffers: dict
) -> list[tuple[dict, str, int]] | None:
    """Where the model holds each of its parameters and buffers (``params``, ``buffers``: as
    ``named_parameters`` and ``named_buffers`` list them): ``(table, name, k)`` for each
    ``_parameters`` or ``_buffers`` entry of a module in the tree holding one, ``k`` its place
    among them (a tensor held in several places, tied, at each). :func:`_call_holding` puts
    the traced tensors there: what ``torch.func.functional_call(model, (params, buffers))``
    does (its reparametrization with tied weights), without its walks of the tree by name for
    the tied ones, nor its checks and swaps name by name (about 0.07 ms per GPT-2 block).
    None, for ``functional_call`` itself, where the tree is walked otherwise
    (:attr:`repeats.Walk.plain`), a tensor is both a parameter and a buffer (refused before
    this is reached: :func:`_refuse_parameter_buffers`; the check stays for other callers), or
    the model is data-parallel (which ``functional_call`` refuses; a TorchScript module is
    refused before this is reached: :func:`_refuse_scripted`)."""
    if not walk.plain or isinstance(model, nn.DataParallel):
        return None
    place: dict[int, int] = {}
    for k, t in enumerate([*params.values(), *buffers.values()]):
        if place.setdefault(id(t), k) != k:
            return None
    return [
        (table, name, place[id(t)])
        for _, m in walk.tree
        for table in (m._parameters, m._buffers)
        for name, t in table.items()
        if t is not None and id(t) in place
    ]


def _call_holding(model: nn.Module, slots: list, values: tuple, args: tuple) -> Any:
    """``model(*args)`` with each slot of :func:`_state_slots` holding ``values[k]``, as it
    held before afterwards."""
    held = [table[name] for table, name, _ in slots]
    try:
        for table, name, k in slots:
            table[name] = values[k]
        return model(*args)
    finally:
        for (table, name, _), t in zip(slots, held):
            table[name] = t


def _check_loss(kind: str, auto: bool, head: torch.Tensor) -> str | None:
    """Refuse a loss ``kind`` the output ``head`` cannot give (a ``TraceError``); return the
    assumption line of ``auto`` summing a single-class ``(N, 1)`` output, else None."""
    if kind != "none" and not differentiable(head):
        raise TraceError(
            f"loss {kind!r} needs a floating-point output to differentiate, but the "
            f"model's output has none (a {head.dtype} tensor first): return the logits "
            "or scores, or leave the loss to 'auto' to analyse the forward only"
        )
    if kind == "output" and head.numel() != 1:
        raise TraceError(
            "loss 'output' takes the model's first floating-point output as the loss, "
            f"but it has shape {tuple(head.shape)}: return the scalar loss first, or "
            "choose another loss (sum, mse, cross_entropy)"
        )
    if kind == "cross_entropy" and single_class(head):
        raise TraceError(single_class_refusal(head))
    if auto and single_class(head) and head.dim() == 2:  # (N, 1): the sum, not cross-entropy
        return single_class_line(head)
    return None


#: folders whose warnings a trace does not pass on: torch warns about its own internals on
#: fake tensors and proxies, and graphflop's own warnings are raised outside the trace
_QUIET_ORIGINS = tuple(
    os.path.dirname(os.path.abspath(f)) + os.sep
    for f in (torch.__file__ or "", os.path.dirname(__file__))
)


def _reemit(caught: list[warnings.WarningMessage]) -> None:
    """Warn again, once each, the warnings recorded while tracing that the model's own code
    raised (the model's file, transformers, any package but torch and graphflop), at the place
    that raised them, so the caller's warning filters and ``catch_warnings`` see them."""
    seen: set[tuple[type[Warning], str, str, int]] = set()
    for w in caught:
        key = (w.category, str(w.message), w.filename, w.lineno)
        if key in seen or os.path.abspath(w.filename).startswith(_QUIET_ORIGINS):
            continue
        seen.add(key)
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def modules_in_eval(model: nn.Module, tree: list[tuple[str, nn.Module]] | None = None) -> list[str]:
    """The paths of the modules in eval mode in a model whose root is in training mode
    (outermost ones only: ``layers.2``, not also ``layers.2.bn``); none for a root in eval
    mode (then the whole analysis is of eval mode). ``tree``: ``list(model.named_modules())``,
    where the caller has it."""
    if not model.training:
        return []
    kept: list[str] = []
    for name, m in model.named_modules() if tree is None else tree:
        if not m.training and not any(name.startswith(k + ".") for k in kept):
            kept.append(name)
    return kept


def _in_eval_line(paths: list[str]) -> str:
    """The report's line for the modules a training-mode analysis found in eval mode."""
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return (
        f"{shown} in eval mode, as the model left {'it' if len(paths) == 1 else 'them'} (its "
        "constructor or its train()): no dropout there, batch norm on running statistics "
        "(--eval puts every module in eval mode)"
    )


def _written_line(names: tuple[str, ...]) -> str:
    """The report's line for the parameters the forward writes into in place with grad mode
    off (:attr:`~graphflop.meta.Signature.params_written`)."""
    return (
        f"the model writes in place into {', '.join(names)} with grad mode off (as "
        "F.embedding's max_norm renormalizes the rows it reads): the forward reads the written "
        "values, which keep the parameter's derivative (eager autograd does not record the "
        "write); eager keeps them in the parameter, which the optimizer then updates (the "
        "update's figures are the same)"
    )


#: whether ``make_fx`` notes each torch function called while tracing (its
#: ``TorchFunctionMetadataMode``): only its module-stack tracer (``pre_dispatch``,
#: ``record_module_stack``) reads the notes, for a ``torch_fn`` annotation graphflop's traces
#: never get; the mode sees every tensor method call, a dozen for each of ``make_fx``'s
#: inputs among them (a third of a placeholder's cost). False: off where this PyTorch's
#: ``make_fx`` has the option
FUNCTION_METADATA = False

_FN_METADATA_OPTION = "_disable_torch_fn_metadata_mode" in inspect.signature(make_fx).parameters


#: the trace's recorder: ``"own"`` (graphflop's :class:`~graphflop.frontend.recording.
#: OpRecorder`, the same graph node for node as ``make_fx``'s at half its cost or less:
#: ``tests/test_recording.py`` on the zoo; ``make_fx`` where this PyTorch lacks what it needs)
#: or ``"make_fx"`` (the reference)
RECORDER = os.environ.get("GRAPHFLOP_RECORDER", "own")


def _recorder(fn: Any, decomposition_table: dict, template: bool = False) -> Any:
    """The recorder of ``fn`` (:data:`RECORDER`): the main trace's, or a ``template``'s (with
    ``make_fx``, a FakeTensor no node made is then an error, not a constant; with graphflop's
    recorder a constant, which :func:`_trace_template` refuses)."""
    if RECORDER == "make_fx" or not recording.AVAILABLE:
        return _make_fx(
            fn, decomposition_table=decomposition_table, _allow_fake_constant=not template
        )
    return recording.record(fn, decomposition_table)


def _make_fx(fn: Any, **kwargs: Any) -> Any:
    """``make_fx(fn, **kwargs)``, without its torch-function notes (:data:`FUNCTION_METADATA`),
    returning a graph module whose Python code is generated on first use only: graphflop reads
    the graph and never runs it (the code of a 96-block GPT-2's top level took 8 ms to generate
    and compile)."""
    if not FUNCTION_METADATA and _FN_METADATA_OPTION:
        kwargs["_disable_torch_fn_metadata_mode"] = True
    traced = make_fx(fn, **kwargs)

    def run(*args: Any) -> GraphModule:
        with _lazy_code():
            return traced(*args)

    return run


def _lazy_code() -> contextlib.AbstractContextManager:
    """torch.fx's lazy graph modules in force (their code made when first called or read),
    where this PyTorch has them."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # pragma: no cover - a PyTorch without lazy graph modules
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def _forward_and_hierarchy(
    gm: GraphModule,
    templates: dict,
    model: nn.Module,
    form: dict,
    walk: repeats.Walk | None = None,
) -> tuple[GraphModule, int]:
    """The flat forward in graphflop's form, its :data:`~graphflop.meta.HIERARCHY` (where it
    has outlined calls) and the number of calls expanded. The hierarchy is built first, straight
    from ``make_fx``'s graph (:func:`~graphflop.frontend.direct_hierarchy.build_direct`), and
    the flat forward made from it (:func:`~graphflop.frontend.direct_hierarchy.flat_forward`:
    node for node, name for name and annotation for annotation the graph :func:`_flat_form`
    makes, ``tests/test_direct_hierarchy.py``; batch norm's buffer writes included); where the
    direct build does not model what the flat form rewrites (in-place ops, checkpoints,
    foldable views), the flat form is made and the hierarchy read back from it
    (:func:`build_hierarchy`). ``walk``: ``model``'s :class:`repeats.Walk`, current (its
    module paths), where the caller has one."""
    h = build_direct(gm, templates, model, **form, walk=walk) if templates else None
    out = flat_forward(h) if h is not None else None
    if h is not None:
        forget(h)  # (the flat forward is made once, here)
        if out is not None:
            return out, len(h.sites)
    sites: list[tuple[int, dict[str, str]]] = []
    out, copies = _flat_form(gm, templates, model, sites, walk=walk, **form)
    hierarchy = build_hierarchy(out, templates, sites)
    if hierarchy is not None:
        out.meta[HIERARCHY] = hierarchy
    return out, copies


def _flat_form(
    gm: GraphModule,
    templates: dict,
    model: nn.Module,
    sites: list,
    walk: repeats.Walk | None = None,
    **form: Any,
) -> tuple[GraphModule, int]:
    """The flat graph in graphflop's form and the number of outlined calls expanded: each
    template node copied once, straight into the new graph where its call stood
    (:class:`repeats.Expansion`), named and annotated as :func:`repeats.inline` names and
    annotates its copies in ``make_fx``'s graph."""
    calls = repeats.Expansion(gm.graph, templates, model, sites=sites, walk=walk)
    return from_make_fx(gm, calls=calls, **form), len(calls.calls)


def _flat_form_twice(
    gm: GraphModule,
    templates: dict,
    model: nn.Module,
    sites: list,
    walk: repeats.Walk | None = None,
    **form: Any,
) -> tuple[GraphModule, int]:
    """:func:`_flat_form` by two copies: :func:`repeats.inline` into ``make_fx``'s graph, then
    :func:`from_make_fx` into graphflop's (the reference the single copy is tested against)."""
    copies = repeats.inline(gm.graph, templates, model, sites=sites, walk=walk)
    return from_make_fx(gm, **form), copies


class _FunctionModes:
    """graphflop's torch-function modes for a trace (the routed expert dispatch, then the
    composite ops kept whole), in force inside the traced function only (:meth:`around`).
    make_fx's own per-input work (a placeholder and its metadata for every parameter) calls
    tensor methods a dozen times per input; each call would pass through every Python mode
    on the stack, which made the placeholders of a deep model cost as much as its traced ops."""

    def __init__(self, *modes: Any):
        self.modes = modes
        self._stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> _FunctionModes:
        stack = contextlib.ExitStack()
        for m in self.modes:
            stack.enter_context(m)
        self._stack.append(stack)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stack.pop().__exit__(*exc)

    def passes_custom_ops(self, mode: Any) -> bool:
        """Whether ``mode`` returns a custom op's result unchanged with nothing else done
        (:meth:`repeats.Outliner._direct`): the composite ops always; the routed dispatch
        while it follows no mask (a call given a mask would run inside the mask's sizing)."""
        if isinstance(mode, CompositeOps):
            return any(m is mode for m in self.modes)
        if isinstance(mode, RoutedDispatch):
            return any(m is mode for m in self.modes) and not mode.following_masks()
        return False

    def around(self, fn: Any) -> Any:
        """``fn`` called with the modes in force."""

        def run(*args: Any) -> Any:
            with self:
                return fn(*args)

        return run


def _detached_only(gm: GraphModule, frozen: tuple[str, ...]) -> tuple[str, ...]:
    """The trainable parameters read only inside reentrant checkpoints whose inputs carry no
    derivative (eager gives them no gradient, as if frozen), with a warning naming each such
    checkpoint's module."""
    out: list[str] = []
    scopes: dict[int, list[list[str]]] = {}
    for n in gm.graph.nodes:
        tag = n.meta.get(CHECKPOINT)
        if tag is not None and tag.detached and n.meta.get(MODULE):
            scopes.setdefault(tag.region, []).append(n.meta[MODULE].split("."))
    # a call's module: the scope its nodes share
    modules = {
        r: ".".join(p[0] for p in itertools.takewhile(lambda p: len(set(p)) == 1, zip(*paths)))
        or "the model"
        for r, paths in scopes.items()
    }
    if not modules:
        return ()
    out.extend(
        _read_only_where(
            gm, frozen, lambda u: (t := u.meta.get(CHECKPOINT)) is not None and t.detached
        )
    )
    for module in dict.fromkeys(modules.values()):
        warnings.warn(
            f"reentrant checkpoint in {module}: none of its inputs requires grad, so, as in "
            "eager PyTorch, its outputs carry no gradient and the parameters used only inside "
            "it get none (counted as frozen); checkpoint with use_reentrant=False, or make an "
            "input require grad, to train them",
            UserWarning,
            stacklevel=3,
        )
    return tuple(out)


def _no_grad_only(gm: GraphModule, frozen: tuple[str, ...]) -> tuple[str, ...]:
    """The trainable parameters read only by nodes the model made with grad mode off
    (:data:`~graphflop.meta.NO_GRAD`): eager gives them no gradient, as if frozen. A write
    into the parameter itself under ``no_grad`` (its new value, tagged
    :data:`~graphflop.meta.NO_GRAD_WRITE` with the way to the old one) keeps its derivative:
    that reader does not count (HF RWKV's eval-mode ``weight.div_(...)``)."""

    def no_grad(u: Any) -> bool:
        write = u.meta.get(NO_GRAD_WRITE)
        return bool(u.meta.get(NO_GRAD)) and (write is None or write.before is None)

    return tuple(_read_only_where(gm, frozen, no_grad))


def _read_only_where(gm: GraphModule, frozen: tuple[str, ...], where: Any) -> list[str]:
    """The parameters not in ``frozen`` that some node reads and every reader of which is
    ``where(node)``."""
    phs = {n.name: n for n in gm.graph.find_nodes(op="placeholder", sort=False)}  # (no walk)
    out = []
    for p, _ in gm.meta[SIGNATURE].params:
        users = list(phs[p].users)
        if p not in frozen and users and all(where(u) for u in users):
            out.append(p)
    return out


def _chained(table: dict, first: dict) -> dict:
    """``first``'s decompositions, each falling back to ``table``'s of its op (or to the op's
    own handling) where it returns NotImplemented."""

    def chain(op, fn, rest):
        def decomposed(*args, **kwargs):
            out = fn(*args, **kwargs)
            if out is NotImplemented and rest is not None:
                return rest(*args, **kwargs)
            return out

        return decomposed

    return {op: chain(op, fn, table.get(op)) for op, fn in first.items()}


@contextlib.contextmanager
def _input_writes_unrecorded() -> Iterator[None]:
    """While tracing, functionalisation writes the final value of each input the model wrote
    into (a buffer's running statistics; a parameter written under ``no_grad``, as
    ``F.embedding(max_norm=...)`` renormalizes the rows it reads) back into the input with
    grad mode off: the write is the model's own, made where its code had grad mode off or on
    a buffer, and autograd refused it into a parameter (a leaf that requires grad) with grad
    mode on after the forward (a tester's finding). Where the write goes, and what it may
    be, is :func:`~graphflop.frontend.export_form.from_make_fx`'s to decide."""
    from torch._functorch import eager_transforms

    original = eager_transforms._propagate_functional_input_mutation

    def propagate(input_tensor: torch.Tensor, wrapped_tensor: torch.Tensor) -> None:
        # (torch.no_grad() by its two calls: this runs once per parameter of the model)
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            original(input_tensor, wrapped_tensor)
        finally:
            torch._C._set_grad_enabled(prev)

    eager_transforms._propagate_functional_input_mutation = propagate
    try:
        yield
    finally:
        eager_transforms._propagate_functional_input_mutation = original


@contextlib.contextmanager
def _tensor_metadata_shared() -> Iterator[None]:
    """While tracing, ``make_fx``'s ``tensor_meta`` annotation of a FakeTensor of static
    shape (``shape_prop._extract_tensor_metadata``: its shape, dtype, ``requires_grad``,
    strides and memory format) made once per distinct metadata and shared by the nodes that
    have it, as an immutable tuple. ``make_fx`` works it out for every placeholder and node,
    by three contiguity checks: about an eighth of a placeholder's cost, and a deep model has
    one per parameter. Where this PyTorch's ``make_fx`` reads it otherwise, nothing changes;
    graphflop's own recorder (:data:`RECORDER`) writes no ``tensor_meta``."""
    from torch.fx.experimental import proxy_tensor

    original = getattr(proxy_tensor, "_extract_tensor_metadata", None)
    if original is None:  # pragma: no cover - a PyTorch whose make_fx annotates otherwise
        yield
        return
    made: dict[tuple, Any] = {}

    def extract(result: torch.Tensor, include_contiguity: bool = True) -> Any:
        if (
            include_contiguity
            and type(result) is FakeTensor
            and result.layout is torch.strided
            and not result.is_quantized
        ):
            shape, stride = tuple(result.shape), result.stride()
            if all(type(s) is int for s in shape) and all(type(s) is int for s in stride):
                key = (shape, stride, result.dtype, result.requires_grad)
                got = made.get(key)
                if got is None:
                    got = made[key] = original(result, include_contiguity)
                return got
        return original(result, include_contiguity)

    proxy_tensor._extract_tensor_metadata = extract
    try:
        yield
    finally:
        proxy_tensor._extract_tensor_metadata = original


@contextlib.contextmanager
def _requires_grad_ignored() -> Iterator[None]:
    """While tracing, ``Tensor.requires_grad_`` in the model's code (transformers' gradient
    checkpointing makes the embeddings' output require grad, so that the reentrant
    checkpoint sees an input that does; PEFT's ``enable_input_require_grads`` does it from a
    hook) returns the tensor unchanged, as functionalisation refuses it; the call is noted
    (:func:`~graphflop.frontend.regions.mark_requires_grad`): a value that depends on no
    trainable parameter is tagged :data:`~graphflop.meta.LEAF`, whose gradient the backward
    computes as eager autograd does."""
    original = torch.Tensor.requires_grad_

    def requires_grad_(self: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
        if not recording.recording():
            return original(self, requires_grad)
        if requires_grad:
            resume_gradient(self)
            mark_requires_grad(self)
        else:
            stop_gradient(self)
        return self

    torch.Tensor.requires_grad_ = requires_grad_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.requires_grad_ = original  # type: ignore[method-assign]


#: why a structure whose template reads a constant is traced in full
CONSTANTS = (
    "its forward reads a tensor that is no parameter, buffer or input (a plain tensor "
    "attribute, or a constant such as the number a setitem writes)"
)


def _trace_template(
    outliner: repeats.Outliner,
    key: int,
    call: Any,
    table: dict,
    fake_mode: FakeTensorMode,
    modes: _FunctionModes,
    names: dict[int, str],
    module: nn.Module | None = None,
    inputs: tuple[tuple[bool, bool], ...] | None = None,
) -> torch.fx.Graph:
    """The graph of one outlined module call (made by ``call.module``, or by ``module``, another
    instance of its structure), module paths relative to :data:`repeats.MARK`. ``names``: the
    qualified name of each of the model's parameters and buffers as traced, by ``id``, which
    the template's modules hold while it is traced (:func:`_state_swapped`). ``inputs``: the
    eager ``(requires_grad, is_leaf)`` of each of the call's inputs, as the model's code reads
    them there (:func:`~graphflop.frontend.regions.eager_flags`; None: each requires grad, no
    leaf).

    Raises:
        NotOutlinable: the template reads a constant (:data:`CONSTANTS`; a parameter or buffer
            of a module outside the call's, :func:`_outside_state`), writes in place into a
            tensor other than its running statistics, or its outputs are strided otherwise.
    """
    m = call.module if module is None else module
    fn = outliner.template_fn(key, module)

    def scoped(*tensors):
        with ModuleScopes(m, prefix=repeats.MARK, base=[(repeats.MARK, qualname(m))]):
            return fn(*tensors)

    # the call's inputs carry a derivative as at the call, its parameters where trainable
    if inputs is None:
        inputs = ((True, False),) * call.n_inputs
    sources = tuple(r for r, _ in inputs) + tuple(bool(m[4]) for m in call.state_meta)
    with template_grad_sources(sources, tuple(leaf for _, leaf in inputs)):
        gm = _recorder(
            torch.func.functionalize(modes.around(scoped)), decomposition_table=table, template=True
        )(*outliner.example_tensors(key, fake_mode))
    # writes into the template's own temporaries (circular padding's copies into a new
    # tensor) made functional as the whole graph's are (export_form), before its writes into
    # buffers are told apart
    functionalize_inplace(gm.graph)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = {phs[call.n_inputs + i] for i in call.written}
    direct = {phs[call.n_inputs + i] for i in call.direct}
    copies = [n for n in gm.graph.nodes if n.target is aten.copy_.default]
    targets = [n.args[0] for n in copies]
    constants = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    if constants:
        raise repeats.NotOutlinable(call.structure, _outside_state(constants, names) or CONSTANTS)
    if len(set(targets)) != len(targets) or set(targets) != written | direct:
        raise repeats.NotOutlinable(
            call.structure, "writes in place into a tensor other than its running statistics"
        )
    for n in copies:  # the functionalised writes: their new values are outputs already
        if n.args[0] in written:
            n.replace_all_uses_with(n.args[1])
            gm.graph.erase_node(n)
    # in-place ops a composite kernel left on its temporaries (rms_norm's add_): rewritten
    # into their functional twins here as tracing rewrites the flat graph's
    # (from_make_fx), so each copy is still what its template node is and the hierarchy
    # keeps it in its call (a node no longer its template's counts at the top level, after
    # the call: the per-op table's order would differ from the flat graph's)
    functionalize_inplace(gm.graph)
    # the trace continued from the outputs' metadata as PyTorch's kernels give it; the
    # decomposed graph must give the same, or the rest of the trace could differ
    out = next(n for n in gm.graph.nodes if n.op == "output")
    got = [(tuple(a.meta["val"].shape), a.meta["val"].stride()) for a in out.args[0]]
    if got != [m[:2] for m in call.out_meta]:
        raise repeats.NotOutlinable(call.structure, "its graph's outputs are strided otherwise")
    return gm.graph


def _outside_state(constants: list, names: dict[int, str]) -> str | None:
    """Why a template that reads ``constants`` (its ``get_attr`` values) is not outlined, where
    one is a parameter or buffer of the model (``names``, by ``id``: of a module outside the
    call's, which its forward reaches other than through its tree: a global, a closure; one
    held as a plain attribute is refused before, :func:`repeats.held_apart`); None otherwise."""
    found = [names[id(c)] for c in constants if id(c) in names]
    if not found:
        return None
    return (
        f"its forward reads {found[0]}, a parameter or buffer of a module outside it (reached "
        "other than as a submodule: a global, a closure): a template stands for the block's "
        "own parameters and buffers only"
    )


def _advice(e: BaseException) -> str:
    """What to do about a model's own error, where its message says it (appended to it)."""
    if "more than 1 value per channel when training" in str(e):
        # batch norm in training mode over a batch of one example (Inception's auxiliary head)
        return "; give a batch of 2 or more (--batch 2) or trace in eval mode (--eval)"
    if isinstance(e, TypeError) and re.search(r"must be Tensor, not (list|tuple)\b", str(e)):
        # example_inputs() returning [[1.0, 2.0], ...]: a non-tensor input is a constant
        return (
            "; an example input that is a list or tuple of numbers is passed to the model as "
            "it is, not as a tensor: make it one with torch.tensor(...)"
        )
    return ""


#: why a structure whose graph depends on its inputs' ``requires_grad`` or ``is_leaf`` (which
#: differ between its calls) is traced in full
READS_GRAD_FLAG = (
    "its forward reads requires_grad or is_leaf of its inputs, which differ between its calls"
)


def _templates(
    outliner: repeats.Outliner,
    table: dict,
    fake_mode: FakeTensorMode,
    modes: _FunctionModes,
    names: dict[int, str],
    call_inputs: _CallInputs | None = None,
    early: _Early | None = None,
) -> dict[int, torch.fx.Graph]:
    """Each distinct outlined call's template graph (``names``: as :func:`_trace_template`'s),
    traced with its first call's inputs' ``requires_grad`` and ``is_leaf`` as eager reads them
    (``call_inputs``). Where the model's code reads one of those flags of a value that depends
    on them (:func:`~graphflop.frontend.regions.grad_read_in_templates`) and another call's
    inputs read otherwise, the template is traced again with those: a graph that differs
    raises :class:`repeats.NotOutlinable` (:data:`READS_GRAD_FLAG`; the block traced in full).
    ``early``: the templates traced at their call's first run, taken where they stand for the
    template traced here (:meth:`_Early.taken`; such a trace read no flag that depends on the
    call's inputs: :meth:`_Early.trace`).

    Raises:
        NotOutlinable: a structure with a reentrant checkpoint inside (whether its outputs
            carry a derivative is decided per call, by its inputs), one whose forward calls
            ``requires_grad_()`` (whether the value becomes a new leaf is decided per call,
            too), a structure whose copies differ in their layer index
            (:data:`repeats.INDEX_ATTRS`) and whose forward reads it (any read of the stand-in
            the template is traced with, or a failure on it: :class:`repeats._Index`), or whose
            graph traced from a copy with another index, a real integer, differs.
    """
    templates = {}
    if call_inputs is None:
        call_inputs = _CallInputs()
    for key, call in enumerate(outliner.calls):
        taken = early.taken(key, call) if early is not None else None
        if taken is not None:
            templates[key], undecided, marked = taken
        else:
            first = call_inputs.first(key, call.n_inputs)
            with (
                undecided_checkpoints() as undecided,
                marked_in_templates() as marked,
                grad_read_in_templates() as read,
                grad_mode_tagged(),
            ):
                templates[key] = _trace_template(
                    outliner, key, call, table, fake_mode, modes, names, inputs=first
                )
            if read[0]:  # the graph may depend on each call's inputs' flags: traced per flags
                for other in dict.fromkeys(call_inputs.of(key, call.n_inputs)):
                    if other == first:
                        continue
                    with grad_mode_tagged():
                        again = _trace_template(
                            outliner, key, call, table, fake_mode, modes, names, inputs=other
                        )
                    if repeats.graph_signature(again) != repeats.graph_signature(templates[key]):
                        raise repeats.NotOutlinable(call.structure, READS_GRAD_FLAG)
        if undecided[0]:  # detached or not is each call's own (its inputs' derivative)
            raise repeats.NotOutlinable(call.structure, "a reentrant checkpoint inside")
        if marked[0]:  # a new leaf or not is each call's own (its inputs' derivative)
            raise repeats.NotOutlinable(call.structure, "calls requires_grad_() in forward")
        if call.check is None:
            continue
        if outliner.index_used.get(key, [False])[0]:
            raise repeats.NotOutlinable(call.structure, repeats.USES_INDEX)
        if repeats.graph_signature(templates[key]) != repeats.graph_signature(
            _trace_template(
                outliner, key, call, table, fake_mode, modes, names, call.check, inputs=first
            )
        ):
            raise repeats.NotOutlinable(call.structure, "its graph depends on layer_idx")
    return templates


class _Numbers:
    """The trace's composite region numbers (``itertools.count()``), drawn from a counter
    aside while a template is traced inside the main trace (:class:`_Early`): a template
    taken after the main trace gets the numbers its trace there would have drawn
    (:meth:`take`), so that every number is the one tracing it after the main trace gives."""

    #: where the numbers drawn aside start (no trace draws as many)
    ASIDE = 1 << 48

    def __init__(self) -> None:
        self._main = itertools.count()
        self._now = self._main
        self._aside = itertools.count(self.ASIDE)

    def __iter__(self) -> _Numbers:
        return self

    def __next__(self) -> int:
        return next(self._now)

    @contextlib.contextmanager
    def aside(self) -> Iterator[list[int]]:
        """While active, numbers are drawn aside; yields ``[start, end]`` of those drawn,
        filled on leaving."""
        start = next(self._aside)  # (a number no one draws: marks the start)
        span = [start + 1, start + 1]
        prev, self._now = self._now, self._aside
        try:
            yield span
        finally:
            self._now = prev
            span[1] = next(self._aside)  # (marks the end)

    def take(self, span: list[int]) -> dict[int, int]:
        """Main numbers for the ``span`` of numbers drawn aside, drawn now, in their order."""
        return {n: next(self._main) for n in range(*span)}


class _ReadsInputFlags(Exception):
    """An early template's trace (:meth:`_Early.trace`) read ``requires_grad``, ``is_leaf`` or
    ``grad_fn`` of a value that depends on the call's inputs: its graph may be the first
    call's only once traced with that call's flags, which the main trace knows when it ends
    (:class:`_CallInputs`); the fake run decides the call's outputs and the template is
    traced after the model's call."""


class _Early:
    """The templates traced at their call's first run (:attr:`repeats.Outliner.first_template`),
    inside the main trace, and what :func:`_templates` takes of them: each as traced after the
    model's call (the checks that need the model's call done made then; its composite region
    numbers and custom Function records put where that trace would have put them)."""

    def __init__(
        self,
        outliner: repeats.Outliner,
        numbers: _Numbers,
        table: dict,
        fake_mode: FakeTensorMode,
        modes: _FunctionModes,
        grad: bool,
    ):
        self.outliner = outliner
        self.numbers = numbers
        self.table = table
        self.fake_mode = fake_mode
        self.modes = modes
        self.grad = grad  # grad mode where the trace started (where templates are traced)
        self.records: list = []  # the trace's custom Function records
        #: per call key: the region numbers drawn aside, its records, and the flags of
        #: :func:`_templates`' checks
        self.kept: dict[int, tuple] = {}

    def trace(self, key: int) -> torch.fx.Graph:
        """Call ``key``'s template, traced now (at its first run, inside the ``repeat`` op's
        fake kernel) as :func:`_templates` traces it, with the main trace's state set aside."""
        call = self.outliner.calls[key]
        n = len(self.records)
        try:
            with (
                self.numbers.aside() as span,
                outside_main_trace(),
                torch.set_grad_enabled(self.grad),
                undecided_checkpoints() as undecided,
                marked_in_templates() as marked,
                grad_read_in_templates() as read,
                grad_mode_tagged(),
            ):
                graph = _traced_early(self, key, call)
        finally:
            records = self.records[n:]
            del self.records[n:]
        if read[0]:  # (traced here, its inputs read as requiring grad: the first call's may not)
            raise _ReadsInputFlags(call.structure)
        self.kept[key] = (span, records, undecided, marked)
        return graph

    def taken(self, key: int, call: Any) -> tuple | None:
        """Call ``key``'s template traced early and the flags of its checks, where it stands
        for the template traced now: traced (None otherwise), and the call's module holding
        no other layer index than other calls' (otherwise the template is traced now with
        stand-ins for them, :meth:`repeats.Outliner.template_fn`).

        Raises:
            NotOutlinable: as the template's trace now would raise before tracing: the
                module's attributes changed after the call, or it reaches a module outside
                its tree.
        """
        graph = self.outliner.early.get(key)
        if graph is None or call.check is not None:
            return None
        if repeats._modules_state(call.module) != call.state:  # (template_fn's checks)
            raise repeats.NotOutlinable(call.structure, "attributes changed after the call")
        apart = repeats.held_apart(repeats._tree(call.module))
        if apart is not None:
            raise repeats.NotOutlinable(call.structure, apart)
        span, records, undecided, marked = self.kept[key]
        _renumbered(graph, self.numbers.take(span))
        self.records.extend(records)
        return graph, undecided, marked


def _traced_early(early: _Early, key: int, call: Any) -> torch.fx.Graph:
    return _trace_template(early.outliner, key, call, early.table, early.fake_mode, early.modes, {})


# the Function.apply below an early template's trace is the main trace's repeat op's
_STACK_BARRIERS.add(_traced_early.__code__)


def _renumbered(graph: torch.fx.Graph, numbers: dict[int, int]) -> None:
    """Each :data:`COMPOSITE` tag of ``graph``'s nodes (and the tags inside it) with its region
    number in ``numbers`` given the number it maps to."""
    if not numbers:
        return

    def tag_of(tag: CompositeTag) -> CompositeTag:
        inner = tag_of(tag.inner) if tag.inner is not None else None
        region = numbers.get(tag.region, tag.region)
        if region == tag.region and inner is tag.inner:
            return tag
        return dataclasses.replace(tag, region=region, inner=inner)

    for n in graph.nodes:
        tag = n.meta.get(COMPOSITE)
        if tag is not None:
            n.meta[COMPOSITE] = tag_of(tag)


def _is_fake(t: Any) -> bool:
    return isinstance(t, FakeTensor)


def as_fake(fake_mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a FakeTensor of ``fake_mode``; a meta tensor (a model built without memory)
    becomes a fake CPU tensor of its shape, strides and dtype, so that tensors the model makes
    in ``forward`` without ``device=`` (``torch.arange(T)``: CPU ones) meet tensors of their own
    device, as they do when the model runs. A tensor made under inference mode becomes a fake
    tensor of its metadata that is not an inference tensor (autograd refuses to save those)."""
    if _is_fake(t):
        return t
    if t.device.type != "meta" and not t.is_inference():
        return fake_mode.from_tensor(t)
    if t.device.type != "meta":  # made under inference mode: its fake would be one too
        return fresh_fake(fake_mode, t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
    return fresh_fake(fake_mode, t.shape, t.stride(), t.dtype, "cpu", t.requires_grad)


def as_fakes(fake_mode: FakeTensorMode, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`as_fake` of each of ``ts`` (a model's parameters and buffers); those of a model
    built on the meta device made together (:func:`~graphflop.meta.fresh_fakes`)."""
    if not all(t.device.type == "meta" and not _is_fake(t) for t in ts):
        return [as_fake(fake_mode, t) for t in ts]
    return fresh_fakes(
        fake_mode, [(t.shape, t.stride(), t.dtype, "cpu", t.requires_grad) for t in ts]
    )
