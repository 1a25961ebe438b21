"""Every ``node.meta`` and ``gm.meta`` key graphflop reads and writes, and their frozen values.

Every analysis result lives on the graph, so any pass or front end finds it beside the node it
describes (docs/architecture.md). Passes write the keys below; exporters and reports only read
them, with ``.get()``, and tolerate absence. This module is the only place a ``gf_`` key is
spelled (``tests/test_meta.py`` enforces it): everything else uses the constants.

Node keys (``node.meta``)
    ``val``              (PyTorch's own) the output as a FakeTensor, or a tuple of them.
    :data:`KIND`         ``"primal"`` (a value of the forward computation), ``"coef"`` (a
                         primal-only value a derivative rule needs, e.g. ReLU's mask),
                         ``"tangent"`` (linear in the tangent inputs), ``"cotangent"`` (a backward
                         value) or ``"update"``.
    :data:`ROLE`         what the node is for, one of :data:`ROLES`.
    :data:`SOURCE`       name of the forward node this node was derived from (itself for forward
                         nodes).
    :data:`MODULE`       ``nn.Module`` path of that forward node (``""`` for the model's own
                         forward).
    :data:`COST`         :class:`NodeCost`, written by :mod:`graphflop.passes.flops`.
    :data:`PARAM`        on parameter placeholders and gradient outputs: the parameter's qualified
                         name.
    :data:`PARAM_DERIVED` on forward nodes: True when every floating input is a parameter or
                         derived from parameters only (``permute(W)``), so its cotangent is a
                         weight gradient.
    :data:`RESIDUAL`     on backward placeholders that hold forward values: ``param``, ``buffer``,
                         ``input``, ``target``, ``activation`` or ``param_derived``.
    :data:`SLOT`         on update-graph placeholders: what the input holds (``param``, ``grad``,
                         a state kind, ``lr``, ``step``; ``param_pack``, ``grad_pack`` for a
                         :data:`PACKED` placeholder).
    :data:`PACKED`       on a recorded update's top-level placeholder that stands for a block
                         call's parameters' (gradients', one state's) placeholders of the flat
                         graph, none made: their names and their annotations (two tuples, in
                         order; ``graphflop.passes.calls.unpacked``).
    :data:`COMPOSITE`    on forward nodes a composite op was decomposed into while tracing:
                         :class:`CompositeTag` (which op, which of its outputs, which inputs).
    :data:`CHECKPOINT`   on forward nodes the model ran inside ``torch.utils.checkpoint``:
                         :class:`CheckpointTag` (which region, the node's place in it, whether
                         the backward reruns all of it).
    :data:`TIME`         :class:`NodeTime`: the node's predicted seconds on a device and what
                         bounds it, written by :mod:`graphflop.passes.step_time`.
    :data:`INPLACE`      on forward nodes the model computed with an in-place op (``relu_``,
                         ``add_``, a function called with ``inplace=True``), which the trace
                         made functional: True (on a view, the op's node, not the view
                         functionalization takes again). Eager PyTorch writes such a node's output
                         into its first input's storage (:mod:`graphflop.passes.step_time`
                         times it so).
    :data:`NO_GRAD`      on forward nodes the model made with grad mode off (``torch.no_grad``,
                         ``set_grad_enabled(False)``, ``inference_mode``): True. As in eager
                         PyTorch they carry no derivative (the JVP gives them no tangent).
    :data:`NO_GRAD_WRITE` on ``NO_GRAD`` nodes that hold a tensor's value after the model wrote
                         into it (or into a view of it) in place with grad mode off:
                         :class:`NoGradWrite`. Eager autograd does not see such a write, so the
                         tensor keeps its derivative.
    :data:`LEAF`         on forward nodes whose value the model's code made require grad
                         (``Tensor.requires_grad_()``, PEFT's ``enable_input_require_grads``
                         hook on a frozen embedding's output) while it depended on no trainable
                         parameter: its number among those calls (0 for the first the
                         model made). Eager autograd makes such a value a leaf and
                         computes its gradient; the backward's linearization gives it a
                         tangent input of its own (:attr:`JvpInfo.leaf_tangents`).
    :data:`FUNCTION`     on forward nodes a custom ``torch.autograd.Function``'s ``forward``
                         made: :class:`FunctionTag` (which Function, the node's place in the
                         call, which of its inputs, outputs or saved tensors the node is).
    :data:`CALL_SITE`    on forward nodes copied from an outlined block's template:
                         ``(site, index)``, the call site's number in :class:`Hierarchy`'s
                         ``sites`` and the template node's position in its graph; on a template
                         graph's nodes :data:`MODULE` is the path relative to the called module
                         (``@``, ``@.attn``).

Graph keys (``gm.meta``)
    :data:`SIGNATURE`    :class:`Signature` of a traced forward graph.
    :data:`LOSS_KIND`    the loss the forward graph ends in (``cross_entropy``, ``mse``, ``sum``,
                         ``output``, ``none``).
    :data:`CONSTANTS`    name → real tensor for ``get_attr`` constants made while tracing.
    :data:`OUTLINED`     :class:`OutlineInfo`: how many repeated module calls were copies.
    :data:`HIERARCHY`    :class:`Hierarchy` of a traced forward graph: each outlined block's
                         template graph once, and its call sites.
    :data:`DERIVED_HIERARCHY` on a JVP or backward graph of a forward graph with a
                         :data:`HIERARCHY`: ``graphflop.passes.calls.DerivedHierarchy``, each
                         block variant's derivative nodes once as a template, and its calls.
    :data:`GHOSTS`       list of :class:`Ghost`: work that was not emitted (symbolic zeros, pruned
                         cotangents), with what it would have cost.
    :data:`JVP`          :class:`JvpInfo` of a JVP graph.
    :data:`JVP_LOG`      tuple of the tangent nodes and ghosts (``graphflop.ops.ghost.GhostValue``)
                         the JVP builder emitted, in order (a custom Function's as one
                         ``graphflop.ad.functions.FunctionEntry``); the transpose pass replays
                         it in reverse.
    :data:`GHOST_LINKS`  :class:`GhostLinks`: real tangent node → the ghosts a tangent sum dropped
                         into it (JVP graphs).
    :data:`VJP`          :class:`VjpInfo` of a backward graph.
    :data:`LINEARIZED`   on a backward graph: the JVP graph it is the transpose of.
    :data:`BACKWARD_KERNELS` on a backward graph: forward node name → the number of the
                         composite op occurrence eager runs as one kernel (the forward's
                         :data:`COMPOSITE` regions of ``EAGER_SAVES``'s ops) it is a part of:
                         the backward nodes made for those nodes (:data:`SOURCE`) are that op's
                         one backward kernel (``graphflop.passes.flops.backward_kernel_costs``).
    :data:`UPDATE`       :class:`UpdateInfo` of an update graph (and of graphs that inline one).
    :data:`TRAIN_STEP`   :class:`TrainStepInfo` of a train-step graph.
    :data:`FORWARD_GRADIENT` :class:`ForwardGradientInfo` of a forward-gradient step graph.
    :data:`MEMORY`       :class:`MemoryInfo`, written by ``annotate_memory``.
    :data:`FACTS`        the set of pass facts a graph has (``traced``, ``flops``, ...).
    :data:`GAPS`         tuple of :class:`Gap`: where a JVP or backward graph was cut because an
                         op lacks a rule (partial results; ``graphflop.ops.strict_rules`` raises
                         instead).
    :data:`UNUSED`       on a forward graph: the :class:`NodeCost` of the work dead-code
                         elimination removed (nothing the model returns depends on it).
    :data:`ASSUMPTIONS`  on a forward graph: tuple of one-line strings, what the trace assumed
                         about values it does not have (the rows of a data-dependent expert
                         dispatch under a routing model, :mod:`graphflop.frontend.dispatch`).
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

PREFIX = "gf_"

# node keys
KIND = "gf_kind"
ROLE = "gf_role"
SOURCE = "gf_source"
MODULE = "gf_module"
COST = "gf_cost"
PARAM = "gf_param"
PARAM_DERIVED = "gf_param_derived"
RESIDUAL = "gf_residual"
SLOT = "gf_slot"
PACKED = "gf_packed"
COMPOSITE = "gf_composite"
CHECKPOINT = "gf_checkpoint"
FUNCTION = "gf_function"
CALL_SITE = "gf_call_site"
TIME = "gf_time"
INPLACE = "gf_inplace"
NO_GRAD = "gf_no_grad"
NO_GRAD_WRITE = "gf_no_grad_write"
LEAF = "gf_leaf"

# graph keys
SIGNATURE = "gf_signature"
LOSS_KIND = "gf_loss_kind"
CONSTANTS = "gf_constants"
OUTLINED = "gf_outlined"
HIERARCHY = "gf_hierarchy"
DERIVED_HIERARCHY = "gf_derived_hierarchy"
GHOSTS = "gf_ghosts"
JVP = "gf_jvp"
JVP_LOG = "gf_jvp_log"
GHOST_LINKS = "gf_ghost_links"
VJP = "gf_vjp"
LINEARIZED = "gf_linearized"
BACKWARD_KERNELS = "gf_backward_kernels"
UPDATE = "gf_update"
TRAIN_STEP = "gf_train_step"
FORWARD_GRADIENT = "gf_forward_gradient"
MEMORY = "gf_memory"
FACTS = "gf_facts"
GAPS = "gf_gaps"
UNUSED = "gf_unused"
ASSUMPTIONS = "gf_assumptions"

#: every node key and graph key above
NODE_KEYS = (
    KIND,
    ROLE,
    SOURCE,
    MODULE,
    COST,
    PARAM,
    PARAM_DERIVED,
    RESIDUAL,
    SLOT,
    PACKED,
    COMPOSITE,
    CHECKPOINT,
    FUNCTION,
    CALL_SITE,
    TIME,
    INPLACE,
    NO_GRAD,
    NO_GRAD_WRITE,
    LEAF,
)
GRAPH_KEYS = (
    SIGNATURE,
    LOSS_KIND,
    CONSTANTS,
    OUTLINED,
    HIERARCHY,
    DERIVED_HIERARCHY,
    GHOSTS,
    JVP,
    JVP_LOG,
    GHOST_LINKS,
    VJP,
    LINEARIZED,
    BACKWARD_KERNELS,
    UPDATE,
    TRAIN_STEP,
    FORWARD_GRADIENT,
    MEMORY,
    FACTS,
    GAPS,
    UNUSED,
    ASSUMPTIONS,
)


def graphflop_meta(meta: dict) -> dict:
    """The graphflop keys of a ``node.meta`` dict (what a copied node inherits)."""
    return {k: v for k, v in meta.items() if k.startswith(PREFIX)}


#: Roles a node can carry (docs/flops_conventions.md, "Roles and the update").
ROLES = (
    "forward",
    "loss",
    "grad_input",
    "grad_weight",
    "grad_accum",
    "recompute",
    "tangent_from_input",
    "tangent_from_param",
    "direction",
    "update",
)


@dataclass(frozen=True)
class NodeCost:
    """Cost of one node, per docs/flops_conventions.md.

    Attributes:
        flops: floating-point operations, one multiply-add = 2.
        mm_flops: the part of ``flops`` done by matrix-class ops (mm, bmm, conv, attention).
        transcendentals: elements of exp/log/tanh/sqrt/... (also counted in ``flops``).
        random_elements: random numbers drawn (0 FLOPs).
        bytes_read: bytes of the tensor inputs the node reads (0 for views).
        bytes_written: bytes of the tensors the node writes (0 for views).
    """

    flops: int = 0
    mm_flops: int = 0
    transcendentals: int = 0
    random_elements: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def __add__(self, other: NodeCost) -> NodeCost:
        return NodeCost(
            self.flops + other.flops,
            self.mm_flops + other.mm_flops,
            self.transcendentals + other.transcendentals,
            self.random_elements + other.random_elements,
            self.bytes_read + other.bytes_read,
            self.bytes_written + other.bytes_written,
        )


ZERO_COST = NodeCost()


@dataclass(frozen=True)
class Signature:
    """What the placeholders and outputs of a traced forward graph are.

    Attributes:
        params: (placeholder name, parameter qualified name) pairs, in placeholder order.
        buffers: (placeholder name, buffer qualified name) pairs.
        inputs: placeholder names of the model's tensor inputs.
        targets: placeholder names of the loss targets (may be empty).
        loss: name of the node holding the scalar loss, or None when no loss was traced.
        outputs: names of the model's output nodes.
        buffer_updates: (node name, buffer qualified name) pairs for mutated buffers.
        frozen: placeholder names of the parameters that do not train (``requires_grad=False``):
            no gradient, no update, no optimizer state; they stay in ``params``.
        params_written: qualified names of the parameters the forward writes into in place
            with grad mode off (``F.embedding(max_norm=...)`` renormalizes the rows it reads):
            the graph's reads after the write read the written value, whose derivative is the
            parameter's (autograd does not record the write); the graph does not output it
            (eager keeps it in the parameter, which the optimizer then updates: the update's
            figures are the same on either value).
    """

    params: tuple[tuple[str, str], ...]
    buffers: tuple[tuple[str, str], ...]
    inputs: tuple[str, ...]
    targets: tuple[str, ...]
    loss: str | None
    outputs: tuple[str, ...]
    buffer_updates: tuple[tuple[str, str], ...] = field(default=())
    frozen: tuple[str, ...] = field(default=())
    params_written: tuple[str, ...] = field(default=())

    def state(self) -> set[str]:
        """The placeholder names of ``params`` and ``buffers``: the module's state, which the
        module holds for its whole life, so a memory schedule counts it as always live (a
        baseline), never as a tensor freed after its last reader."""
        return {p for p, _ in self.params} | {b for b, _ in self.buffers}

    def trainable(self) -> tuple[tuple[str, str], ...]:
        """The (placeholder name, qualified name) pairs of ``params`` not in ``frozen``."""
        return tuple(p for p in self.params if p[0] not in self.frozen)


@dataclass(frozen=True)
class Ghost:
    """Work graphflop decided not to emit, recorded with what it would have cost.

    Attributes:
        name: a unique name (``ghost_<n>``).
        op: the op overload that would have run.
        shape: its output shape.
        source: the forward node it came from.
        module: that node's module path.
        role: the role it would have had (``grad_input``, ``tangent_from_input``, ...).
        cost: its cost, counted with the same rule as an emitted node.
        inputs: names of real nodes or other ghosts it would have read.
    """

    name: str
    op: str
    shape: tuple[int, ...]
    source: str
    module: str
    role: str
    cost: NodeCost
    inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class JvpInfo:
    """Where things are in a JVP graph.

    Attributes:
        tangent_inputs: (tangent placeholder name, primal placeholder name) pairs, in order.
        primal_outputs: number of leading outputs that are the forward's outputs.
        tangent_outputs: names of the forward nodes whose tangents follow, in order.
        opaque: custom Functions without ``jvp`` whose tangent is an opaque node: the graph is
            a linearization to transpose, not one to run (``build_jvp(for_transpose=True)``).
        leaf_tangents: (tangent placeholder name, forward node name) pairs: the values the
            model's code made leaves that require grad (:data:`LEAF`), each given a tangent
            input of its own (``build_jvp(leaves=True)``, the backward's linearization).
    """

    tangent_inputs: tuple[tuple[str, str], ...]
    primal_outputs: int
    tangent_outputs: tuple[str, ...]
    opaque: tuple[str, ...] = ()
    leaf_tangents: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class VjpInfo:
    """Where things are in a backward graph.

    Attributes:
        residuals: (placeholder name, forward node name, kind) triples, kind one of ``param``,
            ``buffer``, ``input``, ``target``, ``activation``.
        cotangent_input: name of the loss-cotangent placeholder.
        grads: (output position, parameter qualified name) pairs.
        input_grads: (output position, input placeholder name) pairs.
        leaf_grads: (output position, forward node name) pairs: the gradients of the values
            the model's code made leaves that require grad (:data:`LEAF`), which eager
            autograd computes and stores in their ``.grad``.
    """

    residuals: tuple[tuple[str, str, str], ...]
    cotangent_input: str
    grads: tuple[tuple[int, str], ...]
    input_grads: tuple[tuple[int, str], ...]
    leaf_grads: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class UpdateInfo:
    """Placeholder and output layout of an update graph."""

    optimizer: str
    params: tuple[str, ...]  # qualified names, in order
    state_names: tuple[str, ...]  # state placeholder names, in order
    scalars: tuple[str, ...]  # "lr" (and "step")
    state_labels: tuple[str, ...] = ()  # readable state names ("momentum.fc.weight"), in order


@dataclass(frozen=True)
class TrainStepInfo:
    """Layout of a train-step graph: placeholder names in order, and what the outputs are."""

    inputs: tuple[str, ...]
    params: tuple[str, ...]  # qualified names, in new-parameter output order
    state: tuple[str, ...]
    buffer_updates: tuple[str, ...]  # qualified names of the trailing buffer outputs


@dataclass(frozen=True)
class ForwardGradientInfo:
    """Layout of a forward-gradient step graph.

    Attributes:
        inputs: placeholder names in order (primal placeholders, then optimizer state, then the
            ``lr``/``step`` scalars, then the directions when ``direction_inputs``).
        params: parameter qualified names, in output order.
        state: optimizer-state placeholder names, in output order.
        directions: number of directions ``K``.
        distribution: ``normal`` or ``rademacher``.
        direction_inputs: directions are graph inputs (``v{k}_<param>``) rather than sampled.
        tangent_pass: how the ``K`` tangent passes were built: ``one tangent pass`` (K = 1),
            ``one batched tangent pass`` (tangents with a leading K dimension; ``; K copies
            of <ops>`` names ops copied per direction), or ``copies: <why>``.
        buffer_updates: qualified names of the buffers the step updates (BatchNorm's running
            statistics), output after the directional derivatives, in this order.

    Outputs, in order: the loss, the new parameters (``params``), the new optimizer state
    (``state``), the ``directions`` directional derivatives, the new buffers
    (``buffer_updates``).
    """

    inputs: tuple[str, ...]
    params: tuple[str, ...]
    state: tuple[str, ...]
    directions: int
    distribution: str
    direction_inputs: bool
    tangent_pass: str = "one tangent pass"
    buffer_updates: tuple[str, ...] = ()

    def derivatives(self, outputs: Any) -> Any:
        """The ``directions`` directional derivatives among a run's ``outputs``."""
        start = 1 + len(self.params) + len(self.state)
        return outputs[start : start + self.directions]


@dataclass(frozen=True)
class GhostLinks:
    """Real tangent node → the ghosts a tangent sum dropped into it (``gm.meta[GHOST_LINKS]``).

    A sum ``real + ghost`` is emitted as ``real``; in the transpose the ghost would receive the
    same cotangent as ``real``, which is how the pruned work it stands for is recorded.

    Attributes:
        links: (real node, ghosts) pairs, in the order the first ghost was dropped into each;
            the ghosts are ``graphflop.ops.ghost.GhostValue``.
    """

    links: tuple[tuple[torch.fx.Node, tuple[Any, ...]], ...] = ()
    _index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", dict(self.links))

    @classmethod
    def of(cls, links: dict[torch.fx.Node, list[Any]]) -> GhostLinks:
        """Frozen copy of a builder's ``{node: [ghost, ...]}`` record."""
        return cls(tuple((n, tuple(gs)) for n, gs in links.items()))

    def items(self) -> Iterator[tuple[torch.fx.Node, tuple[Any, ...]]]:
        """The (real node, ghosts) pairs, as ``dict.items`` gives them."""
        return iter(self.links)

    def get(self, node: Any, default: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        """The ghosts dropped into ``node`` (``default`` when none)."""
        return self._index.get(node, default)

    def __bool__(self) -> bool:
        return bool(self.links)


@dataclass(frozen=True)
class OutlineInfo:
    """How tracing used outlining of repeated modules.

    Attributes:
        calls: module calls whose graphs were copies of a template.
        traced_once: templates traced (each once).
        in_full: one line per group of repeated modules traced in full (each copy traced on
            its own), saying which and why (``Block ×3 (blocks.0, blocks.1, blocks.2): ...``).
            A module of fewer than 3 modules, itself counted (a repeated ``nn.Linear``), is
            never outlined (:func:`graphflop.frontend.outline.plan`'s ``min_modules``) and is
            not listed: it is no candidate.
    """

    calls: int = 0
    traced_once: int = 0
    in_full: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class CallSite:
    """One call of an outlined block in a traced forward graph.

    Attributes:
        template: the template's position in :attr:`Hierarchy.templates`.
        variant: the position in :attr:`Hierarchy.variants` of what this call kept of the
            template (dead-code elimination drops the nodes whose results no one reads).
        modules: ``(relative path, path in the model)`` pairs: each :data:`MODULE` of the
            template's nodes (``@``, ``@.attn``) as this call's copies carry it (``h.5``,
            ``h.5.attn``).
    """

    template: int
    variant: int
    modules: tuple[tuple[str, str], ...]

    def module(self, relative: str) -> str:
        """The path in the model of the template's module ``relative``."""
        return dict(self.modules)[relative]


@dataclass(frozen=True, eq=False)
class Hierarchy:
    """A traced forward graph as a top level that calls each distinct repeated block's graph.

    Attributes:
        templates: one graph per distinct outlined call (module structure and argument
            metadata), traced once; its nodes carry ``val`` and a :data:`MODULE` relative to
            the called module.
        variants: ``(template, items)``: the template's nodes one or more call sites kept, in
            graph order, each ``(index, None)`` for a copy of the template's node ``index`` or
            ``(index, i)`` for the ``getitem`` of its output ``i`` that tracing added
            afterwards.
        sites: the call sites, in graph order.
        top: the forward graph's nodes outside every call, in graph order, with each call
            site's number (an int) where its nodes begin.
        graph: the top level as a graph of its own, each call one ``graphflop::repeat``
            node (tagged :data:`CALL_SITE` ``(site, -1)``) whose ``getitem`` nodes are the
            values read outside the call; None where a call's nodes are not one run. Its
            other nodes share their ``meta`` dict with the forward graph's nodes they copy,
            so the annotations written on the forward graph (``COST``) are read here too.
        runs: whether each call's nodes are one run of the forward graph, no other node among
            them; where not (a copy rewritten after tracing counts at the top level, after its
            call), what is listed in the order the flat graph first meets it (per-op and
            per-module rows) is ordered by the flat graph.
    """

    templates: tuple[torch.fx.Graph, ...]
    variants: tuple[tuple[int, tuple[tuple[int, int | None], ...]], ...]
    sites: tuple[CallSite, ...]
    top: tuple[Any, ...]
    graph: Any = None
    runs: bool = True


@dataclass(frozen=True)
class CompositeTag:
    """One node of a composite op's decomposition (:mod:`graphflop.frontend.composite`).

    Attributes:
        op: the composite op's overload name (``aten.native_layer_norm.default``).
        region: the decomposition's number in its trace; the copies of an outlined call share
            it, so one occurrence is a connected set of nodes with the same number.
        output: which of the op's outputs this node is (None: an inner node).
        inputs: ``(i, k)`` pairs: this node's ``all_input_nodes[i]`` is the op's input ``k``.
        inner: the tag the node had as part of a composite op the outer one decomposed into
            (the softmax inside attention), or None.
        outputs: ``(numel, dtype)`` of each of the op's outputs as the decomposition made them
            (empty where unknown): what an output the graph dropped (nothing in the forward
            reads it) would have been.
    """

    op: str
    region: int
    output: int | None
    inputs: tuple[tuple[int, int], ...]
    inner: CompositeTag | None = None
    outputs: tuple[tuple[int, torch.dtype], ...] = ()


#: what bounds a node's predicted time (:class:`NodeTime`)
BOUNDS = ("compute", "memory", "overhead")


@dataclass(frozen=True)
class NodeTime:
    """A node's predicted time on one device (:mod:`graphflop.passes.step_time`).

    A node that eager PyTorch runs inside one kernel with others (a composite op's
    decomposition, its backward) carries its share of that kernel's time.

    Attributes:
        seconds: predicted time, ``max(compute_s, memory_s) + overhead_s`` (its share).
        compute_s: FLOPs / achieved FLOP/s of its op class and dtype (its share).
        memory_s: bytes read and written / achieved bandwidth (its share).
        overhead_s: per-kernel launch or dispatch cost, plus on a calibrated CPU the page
            faults of an output above glibc's largest mmap threshold (its share).
        bound: the largest of the three terms, one of :data:`BOUNDS`.
        kernel: the eager kernel the node is part of (its op name, or the composite op's).
        kernel_id: the name of that kernel's first node (which nodes share one kernel).
        op_class: the kernel's product class (``matmul``, ``matmul_thin``, ``conv``,
            ``conv_backward``: a backward's convolution) or ``other``.
        dtype: the dtype key its rate was taken for (``tf32`` for a float32 product the
            profile runs on TF32 tensor cores).
        no_cost_rule: the node's op has no cost rule (its ``COST`` is 0): its kernel was
            timed at the bytes of its tensors (inputs read, output written, from their
            metadata) on the memory roofline, no compute, a lower bound.
    """

    seconds: float
    compute_s: float
    memory_s: float
    overhead_s: float
    bound: str
    kernel: str
    kernel_id: str
    op_class: str
    dtype: str
    no_cost_rule: bool = False


#: how a custom autograd.Function is named where its own derivative is missing (``Gap.op``)
FUNCTION_LABEL = "autograd.Function "


@dataclass(frozen=True)
class CheckpointTag:
    """One forward node the model computed inside ``torch.utils.checkpoint``
    (:mod:`graphflop.frontend.regions`).

    Attributes:
        region: the checkpoint call's number in its trace (the copies of an outlined block
            share it; :func:`occurrences` tells them apart).
        position: the node's place among the region's nodes, in trace order.
        whole: the backward reruns the whole region (``use_reentrant=True``, or early stop
            off); otherwise it stops once every value the backward reads is recomputed.
        detached: a reentrant call none of whose tensor inputs is differentiable (depends on
            no trainable parameter): eager gives its outputs no derivative, so the trace
            detaches them and the parameters used only inside it get no gradient.
        unmodelled: why graphflop's recompute of this call is not what eager runs (a
            checkpoint nested in another: eager reruns the inner call once more for its own
            backward), empty when it is; the backward is then marked incomplete.
    """

    region: int
    position: int
    whole: bool = False
    detached: bool = False
    unmodelled: str = ""


@dataclass(frozen=True)
class NoGradWrite:
    """A forward node that holds a tensor's value after an in-place write the model made with
    grad mode off (``h[:, 0] = v``, ``h.index_put_(...)``, ``h.masked_fill_(...)``,
    ``h[:, 1:3].copy_(v)`` under ``torch.no_grad()``; :mod:`graphflop.frontend.regions`).
    Eager autograd records nothing there, so the tensor written into keeps the derivative it
    had before the write, as if the write were not there (the values written get none of their
    own).

    Attributes:
        before: where the tensor's value before the write is, from this node: the positions
            in ``node.args`` to follow, one per step (``(2,)``: ``node.args[2]``); the JVP
            gives this node that value's tangent. None on a view of the written tensor the
            trace made again from its new value (functionalization's regenerated view): it
            is differentiated as the view it is.
    """

    before: tuple[int, ...] | None


def written_before(node: Any) -> Any:
    """The node :attr:`NoGradWrite.before` of ``node``'s tag leads to, or None (no tag, a
    regenerated view's tag, or a path that no longer leads to a node)."""
    tag = node.meta.get(NO_GRAD_WRITE)
    if tag is None or tag.before is None:
        return None
    for i in tag.before:
        if i >= len(node.args) or not isinstance(node.args[i], torch.fx.Node):
            return None
        node = node.args[i]
    return node


@dataclass(frozen=True)
class FunctionTag:
    """One forward node a custom ``torch.autograd.Function``'s ``forward`` made
    (:mod:`graphflop.frontend.custom_function`).

    Attributes:
        function: the call's :class:`~graphflop.frontend.custom_function.FunctionRecord`
            (the class's name, its traced ``backward`` and ``jvp`` graphs, or why they could
            not be traced); shared by the copies of an outlined block.
        region: the call's number in its trace.
        position: the node's place among the call's nodes, in trace order.
        input: which tensor argument of ``apply`` this node passes in (None: not one).
        output: which tensor output of the call this node is (None: not one).
        saved: which of the tensors the call saved for ``backward`` (``ctx.saved_tensors``,
            then tensors kept as ``ctx`` attributes) and for ``jvp``
            (``ctx.save_for_forward``, numbered after those) this node is.
    """

    function: Any
    region: int
    position: int
    input: int | None = None
    output: int | None = None
    saved: tuple[int, ...] = ()


@dataclass(frozen=True)
class MemoryInfo:
    """Live-tensor peak of one graph on its own, in its node order.

    Attributes:
        peak_bytes: the peak, in bytes.
        peak_at: the node at which it occurs.
    """

    peak_bytes: int
    peak_at: str


def fresh_fake(
    mode: Any,
    shape: Any,
    stride: Any,
    dtype: torch.dtype,
    device: Any,
    requires_grad: bool = False,
) -> torch.Tensor:
    """A new FakeTensor of FakeTensorMode ``mode`` with this shape, strides, dtype and device,
    sharing storage with nothing (``requires_grad`` only for floating dtypes).

    Made directly from a meta tensor, outside any mode (no recorder sees it): an
    ``empty_strided`` call through the fake mode costs about 8x more (0.40 against 0.05 ms),
    and tracing makes one per parameter, buffer and outlined call.

    Where neither a fake mode nor a proxy mode is set (the derivative builders' shape cache,
    :func:`graphflop.ad.builder.fake_output`: a ResNet-50's analysis makes about 400 after its
    trace), leaving them is nothing (their context managers unset and restore nothing):
    Python dispatch turned off alone, in half the time (about 5 against 11 us)."""
    if (
        _get_mode(_FAKE_KEY) is None
        and _get_mode(_PROXY_KEY) is None
        and _pre_dispatch_modes().get(0) is None  # (the proxy mode's place there)
    ):
        with torch._C._DisableTorchDispatch():
            return _fresh_fake(mode, shape, stride, dtype, device, requires_grad)
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch._C._DisableTorchDispatch():
        return _fresh_fake(mode, shape, stride, dtype, device, requires_grad)


#: what :func:`fresh_fake` asks to see whether a fake or proxy mode is set (the ones
#: ``unset_fake_temporarily`` and ``disable_proxy_modes_tracing`` unset: the latter on the
#: pre-dispatch stack too)
_get_mode = torch._C._get_dispatch_mode
_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
_PROXY_KEY = torch._C._TorchDispatchModeKey.PROXY
_pre_dispatch_modes = torch._ops.mode_stack_state_for_pre_dispatch


def fresh_fakes(mode: Any, metas: Iterable[tuple], bare: bool = False) -> list[torch.Tensor]:
    """:func:`fresh_fake` of each ``(shape, stride, dtype, device, requires_grad)`` of
    ``metas``, the modes left once for all (a trace makes one per parameter: leaving and
    restoring them took about 40% of each).

    ``bare``: the caller runs where no functorch transform and no pre-dispatch tracing is in
    force (below functionalisation, under ``torch._C._DisableFuncTorch``): Python dispatch
    turned off is then enough for no mode to see the meta tensors made, without leaving the
    fake and tracing modes (about 10 us: an outlined call's outputs at each call)."""
    if bare:
        with torch._C._DisableTorchDispatch():
            return [_fresh_fake(mode, *m) for m in metas]
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch._C._DisableTorchDispatch():
        return [_fresh_fake(mode, *m) for m in metas]


def _fresh_fake(
    mode: Any, shape: Any, stride: Any, dtype: torch.dtype, device: Any, requires_grad: bool
) -> torch.Tensor:
    meta = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device="meta")
    return new_fake(mode, meta, device, requires_grad and dtype.is_floating_point)


def new_fake(
    mode: Any, elem: torch.Tensor, device: Any, requires_grad: bool = False, real_tensor: Any = None
) -> torch.Tensor:
    """``FakeTensor(mode, elem, device, real_tensor=real_tensor)`` (``elem`` a meta tensor that
    does not require grad), requiring grad where ``requires_grad``.

    Made as ``FakeTensor.__new__`` makes it, without its Python: the subclass tensor, then the
    attributes the constructor set on the first FakeTensor made for this mode and device
    (:func:`_fake_state`: none depends on ``elem``), copied in at once. The constructor costs
    about 25 us, most of it setting those attributes one by one (five memo descriptors of three
    attributes each, the device normalised twice); a trace makes one per parameter for its
    inputs, another for each placeholder's value, and one or two per recorded op's value. Where
    that first tensor's attributes are not all of the plain kind (a PyTorch whose constructor
    sets more), while ``torch.export`` runs (whose constructor notes each tensor) or in
    FakeTensor's debug mode, the constructor itself."""
    if type(device) is not torch.device:
        device = torch.device(device)
    state = _fake_state(mode, elem, device)
    if state is None or torch.compiler.is_exporting():
        made = _fake_tensor_class()(mode, elem, device, real_tensor=real_tensor)
        if requires_grad:
            made.requires_grad_(True)
        return made
    out = _fast_fake(mode, elem, device, requires_grad, state)
    if real_tensor is not None:
        out.__dict__["real_tensor"] = real_tensor
    return out


def _fast_fake(
    mode: Any, elem: torch.Tensor, device: torch.device, requires_grad: bool, state: tuple
) -> torch.Tensor:
    """:func:`new_fake`'s tensor, ``state`` its attributes (:func:`_fake_state`)."""
    out: torch.Tensor = torch.Tensor._make_subclass(
        _fake_tensor_class(),
        elem,
        requires_grad,
        dispatch_device=True,
        device_for_backend_keys=device,
    )
    if not mode._allow_unsafe_data_ptr_access:
        torch._C._set_throw_on_mutable_data_ptr(out)
    else:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
    attrs = out.__dict__
    attrs.update(state[0])
    for k in state[1]:
        attrs[k] = mode
    return out


def _fake_tensor_class() -> type:
    """``FakeTensor``, imported at the first call (an import statement per tensor made costs
    about a microsecond)."""
    global _FAKE_TENSOR
    if _FAKE_TENSOR is None:
        from torch._subclasses.fake_tensor import FakeTensor

        _FAKE_TENSOR = FakeTensor
    return _FAKE_TENSOR


_FAKE_TENSOR: type | None = None

#: per FakeTensorMode, per device: the attributes :func:`new_fake` copies into a new FakeTensor
#: (None: it calls the constructor); none holds the mode (which would keep it alive)
_FAKE_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fake_state(mode: Any, elem: torch.Tensor, device: torch.device) -> tuple | None:
    """The attributes ``FakeTensor(mode, elem, device)`` sets on the tensor, read off one made
    so (once per mode and device): ``(attributes, names)``, the attributes but those bound to
    ``mode``, whose names come second. None unless each is None, ``mode`` or a device (so
    that none depends on ``elem``, or on the mode's state at the time), the constructor sets no
    other state where FakeTensor's debug mode is off, and a tensor :func:`_fast_fake` makes of
    ``elem`` has the same attributes and dispatch keys as the constructor's."""
    per_mode = _FAKE_STATES.get(mode)
    if per_mode is None:
        per_mode = _FAKE_STATES[mode] = {}
    if device in per_mode:
        return per_mode[device]
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig

    state = None
    if not FakeTensorConfig.debug and hasattr(mode, "_allow_unsafe_data_ptr_access"):
        made = FakeTensor(mode, elem, device)
        attrs = dict(vars(made))
        if all(v is None or v is mode or type(v) is torch.device for v in attrs.values()):
            own = tuple(k for k, v in attrs.items() if v is mode)
            plain = {k: v for k, v in attrs.items() if v is not mode}
            fast = _fast_fake(mode, elem, device, False, (plain, own))
            same = vars(fast).keys() == attrs.keys() and all(
                vars(fast)[k] is v for k, v in attrs.items()
            )
            if (
                same
                and str(torch._C._dispatch_keys(fast)) == str(torch._C._dispatch_keys(made))
                and fast.device == made.device
                and fast.requires_grad == made.requires_grad
            ):
                state = (plain, own)
    per_mode[device] = state
    return state


def fake_mode_of(values) -> FakeTensorMode | None:
    """The FakeTensorMode of the first FakeTensor among ``values`` (nested tuples allowed).

    Unlike ``torch._guards.detect_fake_mode`` this ignores any ambient tracing context (inside a
    ``torch.compile`` backend that would be Dynamo's mode, with symbolic shapes).
    """
    from torch._subclasses.fake_tensor import FakeTensor

    # breadth first: every value of ``values`` before those nested in them; ``values`` read
    # only up to the first FakeTensor (a graph's values: its first node's, mostly)
    nested: deque[Any] = deque()
    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
        if isinstance(v, (tuple, list)):
            nested.extend(v)
    while nested:
        v = nested.popleft()
        if isinstance(v, FakeTensor):
            return v.fake_mode
        if isinstance(v, (tuple, list)):
            nested.extend(v)
    return None


def graph_fake_mode(gm: torch.fx.GraphModule) -> FakeTensorMode | None:
    """The FakeTensorMode of ``gm``'s node values (see :func:`fake_mode_of`): the first node
    whose value is a FakeTensor ends the walk (:func:`fake_mode_of` reads every value before
    the tensors nested in tuples)."""
    from torch._subclasses.fake_tensor import FakeTensor

    values = []
    for n in gm.graph.nodes:
        if "val" in n.meta:
            v = n.meta["val"]
            if isinstance(v, FakeTensor):
                return v.fake_mode
            values.append(v)
    return fake_mode_of(values)


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated when first needed (called, or ``.code``
    read), not when it is made: code generation costs about 0.2 s per 5,000 nodes and most
    graphs the passes build are only analysed (PyTorch's ``_LazyGraphModule``; a plain
    GraphModule where that is missing)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - older or newer PyTorch without it
        return torch.fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


@dataclass(frozen=True)
class Gap:
    """A node where a JVP or backward graph was cut for want of a rule (:data:`GAPS`).

    Attributes:
        op: the op's ``aten.x.overload`` name.
        node: the forward node (``SOURCE``) whose tangent or cotangent was not built.
        module: that node's ``nn.Module`` path.
        kind: the missing kind of rule: ``jvp`` or ``transpose``; or ``recompute``: a
            ``torch.utils.checkpoint`` call whose recompute graphflop does not model (``op``
            says how, :attr:`CheckpointTag.unmodelled`).
    """

    op: str
    node: str
    module: str
    kind: str


def occurrences(nodes: Iterable[torch.fx.Node], key: str) -> dict[torch.fx.Node, int]:
    """torch.fx.Node → the number of its call, for the nodes tagged ``key`` (a tag with ``region`` and
    ``position``), ``nodes`` in graph order. A call's nodes are consecutive in the graph (every
    node made during the call is tagged) with positions that do not fall, so a node starts
    another call when the node before it is not of its region or its position is below the
    previous one's (an outlined block's copies repeat the template's region numbers; the
    copies of a block called inside a call carry the position of the call's one node that
    stood for it). Numbers count from 0 in graph order."""
    out: dict[torch.fx.Node, int] = {}
    calls = itertools.count()
    prev: Any = None  # the previous node's tag
    call = -1
    for n in nodes:
        tag = n.meta.get(key)
        if tag is None:
            prev = None
            continue
        if prev is None or prev.region != tag.region or tag.position < prev.position:
            call = next(calls)
        out[n] = call
        prev = tag
    return out
