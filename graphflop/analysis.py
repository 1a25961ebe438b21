"""``analyze``: trace, build every graph, annotate, and roll the annotations up.

The :class:`Analysis` it returns holds the annotated graphs (``forward``, ``backward``, ``jvp``,
``update``, ``forward_gradient``, and ``train_step`` built on request) and a typed
:class:`~graphflop.report.Report` computed from node annotations only; :meth:`Analysis.to_dict`
is the ``graphflop inspect --json`` document. Each derived graph is made by its passes run
through torch.fx's ``PassManager`` (:func:`graphflop.passes.infra.run_passes`). What to build
and how to count is one :class:`AnalyzeOptions` value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from graphflop._gc import paused_gc
from graphflop.ad.builder import shape_cache_scope
from graphflop.ad.jvp import TANGENT_CHOICES, build_jvp, has_leaves
from graphflop.frontend import nodynamo
from graphflop.frontend.errors import library_logs_quiet, quiet_loggers
from graphflop.frontend.inputs import split_example
from graphflop.frontend.loss import LOSSES
from graphflop.frontend.trace import trace
from graphflop.meta import (
    HIERARCHY,
    JVP,
    LINEARIZED,
    LOSS_KIND,
    OUTLINED,
    SIGNATURE,
    Hierarchy,
    OutlineInfo,
    graph_module,
)
from graphflop.passes.activity_gradient import BuildActivityGradientStep, NotPerturbable
from graphflop.passes.autodiff import BuildJvp, BuildVjp
from graphflop.passes.calls import flat_view, release_names
from graphflop.passes.checkpoint import module_matcher
from graphflop.passes.compiled_memory import compiled_report_memory
from graphflop.passes.flops import AnnotateFlops
from graphflop.passes.forward_gradient import (
    DISTRIBUTIONS,
    MAX_DIRECTIONS,
    BuildForwardGradientStep,
)
from graphflop.passes.hierarchy import compose
from graphflop.passes.infra import FLAT, SCOPES, TEMPLATE, GraphPass, run_passes
from graphflop.passes.optimizer import OPTIMIZERS, AddOptimizerUpdate, for_every_parameter
from graphflop.passes.selective_recompute import POLICIES as RECOMPUTE_POLICIES
from graphflop.passes.selective_recompute import check_policy as check_recompute_policy
from graphflop.passes.step_calls import forget_tables
from graphflop.passes.summary import Graphs, summarize
from graphflop.passes.time_profile import TimeProfile
from graphflop.passes.train_step import BuildTrainStep
from graphflop.report import SCHEMA_VERSION, Report

__all__ = [
    "AMP_DTYPES",
    "DEVICES",
    "MEMORY_MODELS",
    "RECOMPUTE_POLICIES",
    "SCHEMA_VERSION",
    "Analysis",
    "AnalyzeOptions",
    "PassRun",
    "analyze",
]


class _FlatOnRead:
    """A field holding a graph as :func:`analyze` built it (a recorded derivative hierarchy's
    top level, or a flat graph) whose reads give the flat graph: the
    :func:`~graphflop.passes.calls.flat_view`, made on the first read (and kept once the graph
    is costed), so an analysis whose consumers read only the report never expands its blocks.
    Read on the class (the dataclass's default), it is None."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_as_built_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> GraphModule | None:
        if obj is None:
            return None
        gm = obj.__dict__.get(self.slot)
        return flat_view(gm) if gm is not None else None

    def __set__(self, obj: Any, value: GraphModule | None) -> None:
        obj.__dict__[self.slot] = value

    def built(self, obj: Any) -> GraphModule | None:
        """The graph as held, not expanded."""
        return obj.__dict__.get(self.slot)


_NOT_COPIED = (
    "an Analysis cannot be {what}: its graphs' nodes name each other (a deep copy recurses "
    "past Python's limit) and hold fake tensors; keep its report instead (a.report pickles, "
    "and Report.from_dict(a.to_dict()) rebuilds it from JSON), or analyze again"
)


@dataclass
class Analysis:
    """Annotated graphs and their report.

    Attributes:
        name: model name.
        forward: traced forward graph (with loss), annotated.
        backward: backward graph, or None when not built.
        jvp: JVP graph, or None.
        update: optimizer update graph (built with the backward graph), or None. Recorded
            (``record_derivatives``), it is held as its recorded top level and read as its
            flat view, as ``forward_gradient`` below.
        forward_gradient: forward-gradient step graph, or None. Built from a recorded JVP it
            is held as its recorded top level and read as its flat view, made on the first
            read (:func:`~graphflop.passes.calls.flat_view`).
        activity_gradient: activity-perturbed step graph
            (:mod:`graphflop.passes.activity_gradient`), or None when not built or the model
            has parameters outside Linear/Conv layers.
        report: the typed report (:class:`~graphflop.report.Report`).

    The derivative and step graphs read as flat graphs, every node of every block; where
    :func:`analyze` recorded one as a hierarchy (``record_derivatives``, the default), its flat
    view is made on the first read (:func:`~graphflop.passes.calls.flat_view`), and
    :meth:`as_built` gives the recorded top levels without expanding them. ``copy.copy`` keeps
    them; ``dataclasses.replace`` reads every field, so its copy holds the flat views (the same
    graphs node for node). An analysis is neither deep-copied nor pickled (``TypeError``): its
    report is.
    """

    name: str
    forward: GraphModule
    report: Report
    backward: _FlatOnRead = _FlatOnRead()
    jvp: _FlatOnRead = _FlatOnRead()
    update: _FlatOnRead = _FlatOnRead()
    forward_gradient: _FlatOnRead = _FlatOnRead()
    activity_gradient: _FlatOnRead = _FlatOnRead()
    _train_step: GraphModule | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def train_step(self) -> GraphModule | None:
        """The whole backprop step (forward, backward, update) as one flop-annotated graph,
        built on first access (:class:`~graphflop.passes.train_step.BuildTrainStep`); None
        without a backward graph (:func:`analyze` builds the update graph with it)."""
        if self._train_step is None and self.backward is not None and self.update is not None:
            self._train_step = run_passes(
                self.forward, [BuildTrainStep(self.backward, self.update), AnnotateFlops()]
            )
        return self._train_step

    def to_dict(self) -> dict[str, Any]:
        """The ``graphflop inspect --json`` document (schema version 1)."""
        return self.report.to_dict()

    def __copy__(self) -> Analysis:
        """A shallow copy: the same graphs and report (as ``dataclasses.replace`` gives)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict) -> Analysis:
        raise TypeError(_NOT_COPIED.format(what="deep-copied"))

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NOT_COPIED.format(what="pickled"))

    @property
    def hierarchy(self) -> Hierarchy | None:
        """The forward graph's hierarchy (:class:`~graphflop.meta.Hierarchy`: each distinct
        repeated block's template graph once, the top-level graph calling them), or None for a
        model without outlined blocks."""
        return self.forward.meta.get(HIERARCHY)

    @property
    def outlined(self) -> OutlineInfo:
        """How tracing outlined repeated blocks: the calls that were copies of a template, the
        templates traced, and the groups of repeated modules traced in full, each copy on its
        own, with why (:attr:`~graphflop.meta.OutlineInfo.in_full`; the figures are the same
        either way, the analysis slower)."""
        return self.forward.meta.get(OUTLINED) or OutlineInfo()

    def flat(self) -> Graphs:
        """The inlined graphs, every node of every block: what a consumer that needs each
        node reads (``verify`` on real tensors, ``bench``, op-level renders, ONNX export, a
        pass of scope :data:`~graphflop.passes.infra.FLAT`). The forward graph is the traced
        one; the derivative graphs are, with ``record_derivatives`` (the default), the flat
        views of the recorded JVP, backward and forward-gradient step
        (:func:`~graphflop.passes.calls.flat_view`: ``gm.meta[DERIVED_HIERARCHY].graph`` is
        the recorded top level)."""
        return Graphs(
            self.forward,
            self.backward,
            self.update,
            self.jvp,
            self.forward_gradient,
            self.activity_gradient,
        )

    def as_built(self) -> Graphs:
        """The graphs as :func:`analyze` built them, nothing expanded: the forward graph (flat,
        with its :attr:`hierarchy`) and each derivative or step graph as built, a recorded
        hierarchy's top level (``gm.meta[DERIVED_HIERARCHY]``, whose ``graph`` is ``gm``:
        :func:`~graphflop.passes.calls.is_recorded`) where it was recorded, else the flat
        graph. What the report's figures were composed from."""
        held = {k: f.built(self) for k, f in vars(Analysis).items() if isinstance(f, _FlatOnRead)}
        return Graphs(self.forward, **held)

    def run_pass(self, p: GraphPass) -> PassRun:
        """Run the pass ``p`` on this analysis's forward graph as its scope says.

        A pass of scope :data:`~graphflop.passes.infra.TEMPLATE` (the default) runs once on
        each template graph of :attr:`hierarchy` and once on the top-level graph, whose call
        nodes (``graphflop::repeat``, tagged :data:`~graphflop.meta.CALL_SITE` ``(site,
        -1)``) stand for the blocks: combine its node annotations over the calls with
        :func:`graphflop.passes.hierarchy.compose`. Without a hierarchy, or for a pass of
        scope :data:`~graphflop.passes.infra.FLAT`, it runs on the flat forward graph.

        Returns:
            :class:`PassRun`: the graphs the pass returned (``top`` the flat graph's result
            where it ran flat, ``templates`` empty then).

        Raises:
            ValueError: ``p.scope`` is not one of :data:`~graphflop.passes.infra.SCOPES`.
            PassOrderError and whatever ``p`` raises.
        """
        scope = getattr(p, "scope", TEMPLATE)
        if scope not in SCOPES:
            raise ValueError(f"pass {type(p).__name__} has scope {scope!r}: one of {SCOPES}")
        h = self.hierarchy
        if scope == FLAT or h is None or h.graph is None:
            return PassRun(run_passes(self.forward, [p]), (), flat=True)
        templates = tuple(run_passes(graph_module(nn.Module(), t), [p]) for t in h.templates)
        return PassRun(run_passes(h.graph, [p]), templates, flat=False)

    def compose(
        self, value: Callable[[Node], float], *, by_module: bool = False, flat: bool = False
    ) -> float | dict[str, float]:
        """``value(node)`` summed over every node of the forward graph, read where
        :meth:`run_pass` runs a pass: composed over :attr:`hierarchy`'s calls
        (:func:`graphflop.passes.hierarchy.compose`, each template's nodes once) where it
        has one with a top-level graph, else summed over the flat forward graph.

        Args:
            value: a number per node (as ``compose``'s).
            by_module: return ``{module path: sum}`` instead.
            flat: sum over the flat forward graph even with a hierarchy: where a pass of
                scope :data:`~graphflop.passes.infra.FLAT` wrote its figures
                (``PassRun.flat``).
        """
        h = self.hierarchy
        if flat or h is None or h.graph is None:
            return compose(self.forward, value, by_module=by_module)
        return compose(h, value, by_module=by_module)


@dataclass(frozen=True)
class PassRun:
    """What :meth:`Analysis.run_pass` returns.

    Attributes:
        top: the graph the pass returned for the top level (or for the flat graph).
        templates: per template of the hierarchy, the graph the pass returned for it (empty
            where the pass ran flat).
        flat: whether the pass ran on the flat graph.
    """

    top: GraphModule
    templates: tuple[GraphModule, ...]
    flat: bool


@dataclass(frozen=True, kw_only=True)
class AnalyzeOptions:
    """What :func:`analyze` builds and how it counts: every setting but the model, its inputs,
    its display name and the progress callback; keyword-only. Checked when made
    (``dataclasses.replace`` included), with the command line's choices and limits.

    Attributes:
        loss: see :func:`graphflop.frontend.trace.trace` (``auto``, ``output``, ``sum``,
            ``cross_entropy``, ``mse``, ``none``).
        optimizer: ``sgd``, ``momentum``, ``adam`` or ``adamw``.
        tangents: which values carry tangents in the JVP graph (``params``, ``inputs``, ``all``).
        directions, distribution: of the forward-gradient step (see
            :func:`~graphflop.passes.forward_gradient.build_forward_gradient_step`):
            1 to :data:`~graphflop.passes.forward_gradient.MAX_DIRECTIONS` directions,
            ``normal`` or ``rademacher``.
        backward, jvp: build those graphs. With ``loss="auto"``, a model whose output holds
            no floating-point tensor (it ends in argmax) gets neither: nothing to differentiate.
        memory_model: ``eager`` (default: what eager PyTorch autograd saves and allocates on
            ``device``, ``cpu`` or ``cuda``) or ``graph`` (graphflop's own graphs in their node
            order); see :mod:`graphflop.passes.eager_memory`; or ``compiled`` (what
            ``torch.compile``'s AOTAutograd min-cut partition saves and recomputes:
            :mod:`graphflop.passes.compiled_memory`).
        device: ``cpu`` or ``cuda``: the device the memory model describes.
        keep_grads: gradients kept between steps (``zero_grad(set_to_none=False)``).
        checkpoint: what-if ``torch.utils.checkpoint(use_reentrant=False)`` around the modules
            whose path matches this glob (``re:`` prefix: a regular expression): saved bytes
            and recompute FLOPs in ``report.memory.checkpoint``
            (:mod:`graphflop.passes.checkpoint`); needs the backward graph.
        amp: what-if autocast to ``bf16`` or ``fp16`` on ``device``: saved bytes and train
            peak in ``report.memory.amp`` (:mod:`graphflop.passes.amp`).
        recompute: what-if ``attention``: selective recompute of every attention core (the
            score product through the product with v rerun in the backward, its inputs
            saved; Korthikanti et al. 2022): saved bytes and recompute FLOPs in
            ``report.memory.recompute`` (:mod:`graphflop.passes.selective_recompute`).
        record_derivatives: build the JVP and the backward as recorded hierarchies (each
            repeated block's derivative built once per variant and called at its other call
            sites: ``direct=True`` of :class:`~graphflop.passes.autodiff.BuildJvp` and
            :class:`~graphflop.passes.autodiff.BuildVjp`), FLOP-annotated per template and
            summarised from the templates; the one-direction forward-gradient step is built
            from the recorded JVP without expanding it (a recorded step, summarised from its
            templates too), and so is the optimizer update (``direct`` of
            :class:`~graphflop.passes.optimizer.AddOptimizerUpdate`); the eager memory
            schedules read the recorded graphs too
            (:mod:`graphflop.passes.recorded_memory`, the flat views where a call could
            differ); the consumers that need every node (the other forward-gradient steps,
            the graph memory model, the what-ifs, the time pass, and
            :attr:`Analysis.jvp`/:attr:`Analysis.backward`/:attr:`Analysis.update`/
            :attr:`Analysis.forward_gradient`, made on their first read) read their flat views
            (:func:`graphflop.passes.calls.flat_view`: the graphs built flat, node for node,
            names included). The same report. On by default; False builds them flat.
        outline: trace each distinct repeated block once and copy it at its other calls
            (:mod:`graphflop.frontend.outline`; ``reuse`` of
            :func:`~graphflop.frontend.trace.trace`): the block's forward, Python code
            included, runs at its first call only. False traces every call: for a block whose
            forward depends on Python state outside it (a module-level counter, a class
            attribute its parent sets between calls), which the outliner cannot see.

    Raises:
        ValueError: an unknown loss, optimizer, tangents, distribution, memory model, device or
            amp dtype; ``directions`` out of range; an empty or malformed ``checkpoint``
            pattern; an unknown ``recompute`` policy; a what-if (``checkpoint``, ``amp``,
            ``recompute``, ``keep_grads``) with ``backward=False``; ``checkpoint``, ``amp`` or
            ``recompute`` (what-ifs on the eager memory model) with ``memory_model`` ``graph``
            or ``compiled``; ``recompute`` on a model with no attention core.
        TypeError: a field of the wrong type (``directions`` not an int, ``backward``,
            ``jvp``, ``keep_grads`` not a bool, a choice or pattern not a str).
    """

    loss: str = "auto"
    optimizer: str = "sgd"
    tangents: str = "params"
    directions: int = 1
    distribution: str = "normal"
    backward: bool = True
    jvp: bool = True
    memory_model: str = "eager"
    device: str = "cpu"
    keep_grads: bool = False
    checkpoint: str | None = None
    amp: str | None = None
    recompute: str | None = None
    time_profile: TimeProfile | None = None
    record_derivatives: bool = True
    outline: bool = True

    def __post_init__(self) -> None:
        if self.time_profile is not None and not isinstance(self.time_profile, TimeProfile):
            raise TypeError(
                "time_profile must be a TimeProfile (graphflop.passes.time_profile) or None, "
                f"not {type(self.time_profile).__name__}"
            )
        for name in ("backward", "jvp", "keep_grads", "record_derivatives", "outline"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be True or False, not {v!r}")
        if not isinstance(self.directions, int) or isinstance(self.directions, bool):
            raise TypeError(f"directions must be an int, not {type(self.directions).__name__}")
        if not 1 <= self.directions <= MAX_DIRECTIONS:
            raise ValueError(
                f"directions must be 1 to {MAX_DIRECTIONS:,} (each holds a tangent of every "
                f"parameter), not {self.directions:,}"
            )
        for name, choices in (
            ("loss", (*LOSSES, "auto")),
            ("optimizer", OPTIMIZERS),
            ("tangents", TANGENT_CHOICES),
            ("distribution", DISTRIBUTIONS),
            ("memory_model", MEMORY_MODELS),
            ("device", DEVICES),
        ):
            _choice(name, getattr(self, name), choices)
        if self.amp is not None:
            _choice("amp", self.amp, AMP_DTYPES, "or None")
        if self.checkpoint is not None:
            if not isinstance(self.checkpoint, str):
                raise TypeError(
                    "checkpoint must be a module path pattern (str) or None, not "
                    f"{type(self.checkpoint).__name__}"
                )
            module_matcher(self.checkpoint)  # empty or malformed: CheckpointPatternError
        if self.recompute is not None:
            check_recompute_policy(self.recompute)
        eager_what_ifs = [
            w for w in ("checkpoint", "amp", "recompute") if getattr(self, w) is not None
        ]
        if not self.backward and (eager_what_ifs or self.keep_grads):
            what = eager_what_ifs[0] if eager_what_ifs else "keep_grads"
            raise ValueError(f"{what}= is a what-if on the backward, and backward=False skips it")
        if self.memory_model != "eager" and eager_what_ifs:
            what = eager_what_ifs[0]
            raise ValueError(
                f"{what}= is a what-if on the eager memory model, not on memory_model="
                f"{self.memory_model!r}: drop one of the two (or use memory_model='eager')"
            )


#: the memory models, devices and autocast dtypes :class:`AnalyzeOptions` takes
MEMORY_MODELS = ("eager", "graph", "compiled")
DEVICES = ("cpu", "cuda")
AMP_DTYPES = ("bf16", "fp16")


def _choice(name: str, value: Any, choices: tuple[str, ...], extra: str = "") -> None:
    """Raise TypeError or ValueError unless ``value`` is one of ``choices``."""
    listed = ", ".join(choices) + (f" {extra}" if extra else "")
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {listed}, not {value!r}")
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}: one of {listed}")


def analyze(
    model: nn.Module,
    example_inputs: Any,
    options: AnalyzeOptions | None = None,
    *,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
    **overrides: Any,
) -> Analysis:
    """Trace ``model`` and build, annotate and summarise its graphs.

    ``analyze(model, x, AnalyzeOptions(optimizer="adam"))`` and ``analyze(model, x,
    optimizer="adam")`` are the same call: keyword arguments named after
    :class:`AnalyzeOptions`' fields override ``options`` (default ``AnalyzeOptions()``).

    Args:
        model: the module (used in its current train/eval mode); an ``nn.DataParallel``
            (the model or a submodule) is analysed as the module it wraps.
        example_inputs: what a model file's ``example_inputs()`` may return: a tensor, a tuple
            of positional inputs, a dict of keyword inputs or ``(args, kwargs)``
            (:func:`graphflop.frontend.inputs.split_example`); FakeTensors are fine (nothing is
            allocated).
        options: the settings (:class:`AnalyzeOptions`).
        name: the model's name in the report (default: its class name).
        progress: called with a short message before each stage.
        overrides: fields of :class:`AnalyzeOptions` replacing those of ``options``.

    While it runs, and only when the process has never imported ``torch._dynamo``, light
    stand-ins take Dynamo's place (:mod:`graphflop.frontend.nodynamo`: its import costs about 2 s
    of CPU; nothing here compiles); ``memory_model="compiled"`` uses the real Dynamo.

    Raises:
        TraceError, MissingRuleError, ValueError: see the passes; ValueError and TypeError
            also for bad options (see :class:`AnalyzeOptions`).
        TypeError: ``model`` not an ``nn.Module``, ``progress`` not callable, an override that
            is not a field of :class:`AnalyzeOptions`, ``options`` not an ``AnalyzeOptions``.
    """
    if options is None:
        options = AnalyzeOptions()
    elif not isinstance(options, AnalyzeOptions):
        raise TypeError(f"options must be an AnalyzeOptions, not {type(options).__name__}")
    unknown = sorted(set(overrides) - {f.name for f in fields(AnalyzeOptions)})
    if unknown:
        raise TypeError(
            f"analyze() got an unexpected keyword argument {unknown[0]!r}; the options are "
            + ", ".join(f.name for f in fields(AnalyzeOptions))
        )
    o = replace(options, **overrides) if overrides else options
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable (one str argument), not {progress!r}")
    if isinstance(model, nn.DataParallel):
        # what its forward runs without GPUs (and the work its replicas share with them)
        model = model.module
    args, kwargs = split_example(example_inputs)
    if kwargs and o.memory_model == "compiled":
        raise ValueError("memory_model='compiled' takes positional inputs only, not keywords")
    say = progress or (lambda msg: None)
    # FakeTensorMode logs a traceback before re-raising a kernel's error; the error is raised
    with (
        paused_gc(),
        quiet_loggers("torch._subclasses.fake_tensor"),
        library_logs_quiet(),  # transformers' info and warning logs
        shape_cache_scope(),
        torch.inference_mode(False),  # a training step's graphs, whatever the caller's mode
        torch.enable_grad(),
    ):
        return nodynamo.run(
            lambda: _analyze(model, args, kwargs, o, name=name, say=say),
            light=o.memory_model != "compiled",
        )


def _what_ifs(
    report: Report,
    g: Graphs,
    device: str,
    optimizer: str,
    checkpoint: str | None,
    amp: str | None,
    recompute: str | None = None,
) -> tuple[Report, dict[str, frozenset[str]]]:
    """``report`` with the checkpointing and autocast what-ifs added to its memory section
    (each needs the backward graph; none without it), and the forward node names each
    rerunning what-if (``checkpoint``, ``recompute``) runs again in the backward."""
    reruns: dict[str, frozenset[str]] = {}
    if g.backward is None:
        return report, reruns
    mem = report.memory
    if checkpoint is not None:
        from graphflop.passes.checkpoint import checkpoint_memory

        state = mem.params_bytes + (mem.buffers_bytes or 0) + (mem.optimizer_state_bytes or 0)
        ck = checkpoint_memory(g.forward, g.backward, checkpoint, device, optimizer, state)
        mem = replace(mem, checkpoint=ck.to_report())
        reruns["checkpoint"] = ck.recomputed
    if amp is not None:
        from graphflop.passes.amp import amp_memory
        from graphflop.passes.eager_memory import checkpoint_calls, rng_state_bytes

        state = mem.params_bytes + (mem.buffers_bytes or 0) + (mem.optimizer_state_bytes or 0)
        # the model's own checkpoint calls' RNG states, as the report's train peak counts them
        state += rng_state_bytes(checkpoint_calls(g.forward))
        am = amp_memory(g.forward, g.backward, amp, device, optimizer, state)
        mem = replace(mem, amp=am.to_report())
    if recompute is not None:
        from graphflop.passes.selective_recompute import selective_recompute

        rc = selective_recompute(
            g.forward, g.backward, recompute, device, optimizer, mem.train_peak_bytes
        )
        mem = replace(mem, recompute=rc.to_report())
        reruns["recompute"] = rc.recomputed
    return replace(report, memory=mem), reruns


def _analyze(
    model: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    kwargs: dict[str, Any],
    o: AnalyzeOptions,
    *,
    name: str | None,
    say: Callable[[str], None],
) -> Analysis:
    loss, optimizer, tangents, device = o.loss, o.optimizer, o.tangents, o.device
    directions, distribution = o.directions, o.distribution
    backward, jvp, memory_model = o.backward, o.jvp, o.memory_model
    say("tracing")
    fwd = run_passes(
        trace(model, example_inputs, loss=loss, kwargs=kwargs, reuse=o.outline),
        [AnnotateFlops()],
    )
    has_loss = fwd.meta[SIGNATURE].loss is not None
    if loss == "auto" and not has_loss:  # the output has nothing to differentiate (argmax)
        backward = jvp = False
    g = Graphs(fwd)
    lin = None  # the JVP graph with parameter tangents: transposed, and the forward gradient's
    direct = o.record_derivatives
    # values the model made leaves that require grad: the transposed linearization has their
    # tangents too, the JVP (eager forward mode, which ignores requires_grad) has not
    leaves = has_leaves(fwd)
    if jvp:
        say("building the JVP graph")
        g = replace(g, jvp=run_passes(fwd, [BuildJvp(tangents, direct=direct), AnnotateFlops()]))
        lin = g.jvp if tangents == "params" else None
        release_names(g.jvp)  # (each top level's, once built: the summary's peak is after)
    if backward and has_loss:
        say("building the backward graph")
        bwd = run_passes(
            fwd, [BuildVjp(linearized=None if leaves else lin, direct=direct), AnnotateFlops()]
        )
        g = replace(g, backward=bwd)
        release_names(bwd)
        say("building the optimizer update")
        # no gradient: no update; recorded with the derivatives: its top level, no flat graph
        add_update = AddOptimizerUpdate(optimizer, backward=bwd, direct=direct)
        g = replace(g, update=run_passes(fwd, [add_update, AnnotateFlops()]))
        release_names(g.update)
        if lin is None:
            lin = bwd.meta[LINEARIZED]
            if lin.meta[JVP].opaque or leaves:  # built to be transposed (a Function without
                lin = build_jvp(fwd, "params")  # jvp, the leaves' tangents)
    if jvp and has_loss:
        say("building the forward-gradient step")
        upd = for_every_parameter(g.update)  # a forward gradient updates every parameter
        step = BuildForwardGradientStep(
            optimizer,
            directions=directions,
            distribution=distribution,
            jvp=lin,
            update=upd,
        )
        g = replace(g, forward_gradient=run_passes(fwd, [step, AnnotateFlops()]))
        g = replace(g, activity_gradient=_activity(fwd, optimizer, directions, upd))
        release_names(g.forward_gradient)
    # the builders' tables of the forward graph (forget_tables, below): none is read by the
    # summary, whose memory schedules are the analysis's peak (about 7 MiB of Llama-3.1-405B's)
    forget_tables(fwd)
    say("summarising")
    name = name or type(model).__name__
    report = summarize(
        g,
        name=name,
        optimizer=optimizer,
        tangents=tangents,
        memory_model="eager" if memory_model == "compiled" else memory_model,
        device=device,
        keep_grads=o.keep_grads,
    )
    if memory_model == "compiled":
        say("partitioning the joint graph as torch.compile does")
        mem = compiled_report_memory(
            report.memory, model, example_inputs, fwd.meta.get(LOSS_KIND, "none"), optimizer, device
        )
        report = replace(report, memory=mem)
    # the consumers that read every node take the flat views of recorded hierarchies (each
    # made once, and only for them: the Analysis expands its graphs when they are read; the
    # forward-gradient step's only for the time pass)
    flat = (
        replace(g, backward=_flat(g.backward), jvp=_flat(g.jvp), update=_flat(g.update))
        if _needs_flat(o)
        else g
    )
    report, reruns = _what_ifs(report, flat, device, optimizer, o.checkpoint, o.amp, o.recompute)
    if o.time_profile is not None:
        from graphflop.passes.step_time import time_report

        say(f"timing on {o.time_profile.name}")
        timed = replace(flat, forward_gradient=_flat(g.forward_gradient))  # node by node
        tr = time_report(timed, report, o.time_profile, amp=o.amp, reruns=reruns)
        report = replace(report, time=tr)
    # the tables the derivative graphs' builders and describers read of the forward graph:
    # dropped, not kept with the analysis (a later reader, such as a flat view, works them out
    # again): a tenth of the objects the collector's pass after the analysis scans
    # (graphflop/_gc.py), about 190 per GPT-2 block
    forget_tables(fwd)
    return Analysis(
        name,
        fwd,
        report,
        g.backward,
        g.jvp,
        g.update,
        forward_gradient=g.forward_gradient,
        activity_gradient=g.activity_gradient,
    )


def _flat(gm: GraphModule | None) -> GraphModule | None:
    return flat_view(gm) if gm is not None else None


def _needs_flat(o: AnalyzeOptions) -> bool:
    """Whether a stage after the summary reads every node of the derivative graphs: the
    checkpoint, autocast and recompute what-ifs and the step time."""
    return any(x is not None for x in (o.checkpoint, o.amp, o.recompute, o.time_profile))


def _activity(
    fwd: GraphModule, optimizer: str, directions: int, update: GraphModule | None
) -> GraphModule | None:
    """The activity-perturbed step, or None where the model does not allow it (a parameter
    outside Linear/Conv layers, a loss without per-example terms)."""
    step = BuildActivityGradientStep(optimizer, directions=directions, update=update)
    try:
        return run_passes(fwd, [step, AnnotateFlops()])
    except NotPerturbable:  # an optional section: absent where the model does not allow it
        return None
