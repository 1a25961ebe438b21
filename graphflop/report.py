"""The typed analysis report: totals, ratios, memory and per-layer rows, as frozen dataclasses.

:func:`graphflop.passes.summary.summarize` computes a :class:`Report` from node annotations;
:meth:`Report.to_dict` writes the JSON document of ``graphflop inspect --json`` (schema version
:data:`SCHEMA_VERSION`: the keys, their order and their values are part of the schema) and
:meth:`Report.from_dict` reads one back. FLOPs count one multiply-add as 2; bytes are bytes.

A phase that was not built (no backward graph, no JVP graph) has ``None`` totals and its keys
are absent from the JSON document; a ratio whose denominator is zero is ``None`` (``null``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any

from graphflop.meta import NodeCost

SCHEMA_VERSION = 1


def _fields_dict(obj: Any) -> dict[str, Any]:
    """The dataclass's fields in declaration order, shallow."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _pick(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    return {f.name: d[f.name] for f in fields(cls)}


@dataclass(frozen=True)
class CostTotals:
    """Summed :class:`~graphflop.meta.NodeCost` of a set of nodes.

    Attributes:
        flops: FLOPs (one multiply-add = 2).
        mm_flops: the part of ``flops`` done by matrix-class ops.
        transcendentals: elements of exp/log/tanh/sqrt/... (also in ``flops``).
        random_elements: random numbers drawn.
        bytes_read, bytes_written: tensor bytes the nodes read and write.
        macs: multiply-adds of the matrix-class ops, ``mm_flops / 2`` (docs/flops_conventions.md, Units).
        complete: False when an op of the phase has no rule: its work is counted as 0 and
            what depends on it in a JVP or backward graph is not built (``Report.uncounted``).
    """

    flops: int = 0
    mm_flops: int = 0
    transcendentals: int = 0
    random_elements: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    # MACs and partial results (serialised after the phase's own fields, so older readers of
    # the JSON find the fields they know first)
    macs: int = 0
    complete: bool = True

    @staticmethod
    def cost_fields(c: NodeCost) -> dict[str, Any]:
        """The six cost fields of ``c``, as keyword arguments for any ``CostTotals`` subclass."""
        return {
            "flops": c.flops,
            "mm_flops": c.mm_flops,
            "transcendentals": c.transcendentals,
            "random_elements": c.random_elements,
            "bytes_read": c.bytes_read,
            "bytes_written": c.bytes_written,
            "macs": c.mm_flops // 2,
        }

    @classmethod
    def of(cls, c: NodeCost, **more: Any) -> CostTotals:
        """The totals of a summed cost (``more``: the subclass's own fields, ``complete``)."""
        return cls(**CostTotals.cost_fields(c), **more)

    def to_dict(self) -> dict[str, Any]:
        d = _fields_dict(self)
        for k in _LATE_KEYS:  # keys added after schema v1's first release go last
            d[k] = d.pop(k)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


#: CostTotals keys written after each phase's own keys, in this order
_LATE_KEYS = ("macs", "complete")


@dataclass(frozen=True)
class ForwardTotals(CostTotals):
    """The forward graph's totals.

    Attributes:
        unused_flops: FLOPs of the work the model's code does but nothing it returns (or the
            loss) depends on, removed by dead-code elimination and not in ``flops`` (a
            pooler whose output is not returned).
    """

    unused_flops: int = 0


@dataclass(frozen=True)
class BackwardTotals(CostTotals):
    """The backward graph's totals, and its FLOPs by role.

    Attributes:
        grad_input_flops, grad_weight_flops, grad_accum_flops, loss_flops: FLOPs of the nodes
            with that role.
        pruned_flops: FLOPs of the cotangents not emitted (the graph's ghosts).
        recompute_flops: FLOPs of the forward work the backward reruns (role ``recompute``:
            the model's own ``torch.utils.checkpoint`` regions), part of ``flops``; in the
            JSON only where nonzero.
    """

    grad_input_flops: int = 0
    grad_weight_flops: int = 0
    grad_accum_flops: int = 0
    loss_flops: int = 0
    pruned_flops: int = 0
    recompute_flops: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if not self.recompute_flops:  # schema v1 had no such key: added only where it counts
            del d["recompute_flops"]
        return d


@dataclass(frozen=True)
class UpdateTotals(CostTotals):
    """The optimizer update's totals.

    Attributes:
        optimizer: ``sgd``, ``momentum``, ``adam`` or ``adamw``.
        flops_per_param: update FLOPs per parameter element (None without parameters).
    """

    optimizer: str = "sgd"
    flops_per_param: float | None = None


@dataclass(frozen=True)
class TrainStepTotals:
    """Forward + backward + update FLOPs (``mm_flops``: forward + backward; ``macs`` =
    ``mm_flops / 2``; ``complete``: every phase of the step is)."""

    flops: int = 0
    mm_flops: int = 0
    macs: int = 0
    complete: bool = True

    def to_dict(self) -> dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainStepTotals:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class JvpTotals(CostTotals):
    """The JVP graph's tangent and coefficient work.

    Attributes:
        tangent_from_input_flops, tangent_from_param_flops: FLOPs by role.
        skipped_flops: FLOPs of tangents not emitted (symbolic zeros).
        tangents: which values carry tangents (``params``, ``inputs``, ``all``).
    """

    tangent_from_input_flops: int = 0
    tangent_from_param_flops: int = 0
    skipped_flops: int = 0
    tangents: str = "params"


@dataclass(frozen=True)
class ForwardGradientTotals(CostTotals):
    """The forward-gradient step's totals.

    Attributes:
        directions: number of directions ``K``.
        distribution: ``normal`` or ``rademacher``.
        primal_flops: forward and loss work.
        tangent_flops: tangent work (all ``K`` directions).
        direction_flops: sampling the directions and forming ``g = d·v``.
        update_flops: the optimizer update.
        tangent_pass: how the ``K`` tangent passes were built
            (:attr:`graphflop.meta.ForwardGradientInfo.tangent_pass`): ``one tangent pass``
            (K = 1), ``one batched tangent pass`` (tangents with a leading K dimension;
            ``; K copies of <ops>`` names ops copied per direction) or ``copies: <why>``.
    """

    directions: int = 1
    distribution: str = "normal"
    primal_flops: int = 0
    tangent_flops: int = 0
    direction_flops: int = 0
    update_flops: int = 0
    tangent_pass: str = "one tangent pass"


@dataclass(frozen=True)
class ActivityGradientTotals(CostTotals):
    """The activity-perturbed forward-gradient step's totals
    (:mod:`graphflop.passes.activity_gradient`; Ren et al. 2023).

    Attributes:
        directions: number of tangent draws ``K``.
        primal_flops: forward and loss work (the per-example loss terms included).
        tangent_flops: the forward-mode pass (all ``K`` draws).
        direction_flops: forming the activity-gradient estimates ``d_b·u``.
        grad_weight_flops: the layers' local gradients (``ĝᵀ·x``, bias sums).
        update_flops: the optimizer update.
        peak_bytes: peak live bytes of the step graph in its node order, placeholders held.
        weight_perturbation_peak_bytes: the same for the weight-perturbed step (None when
            that step was not built).
    """

    directions: int = 1
    primal_flops: int = 0
    tangent_flops: int = 0
    direction_flops: int = 0
    grad_weight_flops: int = 0
    update_flops: int = 0
    peak_bytes: int = 0
    weight_perturbation_peak_bytes: int | None = None


@dataclass(frozen=True)
class Totals:
    """Totals per phase; ``None`` for a phase that was not built."""

    forward: ForwardTotals
    loss: CostTotals
    backward: BackwardTotals | None = None
    update: UpdateTotals | None = None
    train_step: TrainStepTotals | None = None
    jvp: JvpTotals | None = None
    forward_gradient_step: ForwardGradientTotals | None = None
    activity_gradient_step: ActivityGradientTotals | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() for k, v in _fields_dict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Totals:
        types: dict[str, Any] = {
            "forward": ForwardTotals,
            "loss": CostTotals,
            "backward": BackwardTotals,
            "update": UpdateTotals,
            "train_step": TrainStepTotals,
            "jvp": JvpTotals,
            "forward_gradient_step": ForwardGradientTotals,
            "activity_gradient_step": ActivityGradientTotals,
        }
        return cls(**{k: t.from_dict(d[k]) for k, t in types.items() if k in d})


@dataclass(frozen=True)
class Ratios:
    """FLOP ratios; each is None when its phase was not built or its denominator is zero.

    Attributes:
        backward_forward: (backward + update) / forward.
        backward_forward_no_update: backward / forward.
        backward_forward_mm: backward mm FLOPs / forward mm FLOPs.
        train_step_forward: train step / forward.
        forward_gradient_step_forward: forward-gradient step / forward.
        jvp_forward: JVP / forward.
    """

    backward_forward: float | None = None
    backward_forward_no_update: float | None = None
    backward_forward_mm: float | None = None
    train_step_forward: float | None = None
    forward_gradient_step_forward: float | None = None
    jvp_forward: float | None = None

    def to_dict(self, totals: Totals) -> dict[str, Any]:
        """The ratios of the phases ``totals`` has, in schema order."""
        return {
            k: v
            for k, v in _fields_dict(self).items()
            if getattr(totals, _RATIO_PHASE[k]) is not None
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ratios:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


#: ratio -> the phase whose totals must exist for the JSON document to carry it
_RATIO_PHASE = {
    "backward_forward": "backward",
    "backward_forward_no_update": "backward",
    "backward_forward_mm": "backward",
    "train_step_forward": "backward",
    "forward_gradient_step_forward": "forward_gradient_step",
    "jvp_forward": "jvp",
}


def _plain(v: Any) -> Any:
    """``v`` as JSON-ready values: a nested report dataclass as its ``to_dict()``, a tuple as a
    list (of plain values)."""
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    to_dict = getattr(v, "to_dict", None)
    return to_dict() if to_dict is not None else v


@dataclass(frozen=True)
class CompiledPartition:
    """One AOTAutograd partitioner's cut of the joint graph (``memory.compiled.min_cut`` and
    ``.default``; :class:`graphflop.passes.compiled_memory.Partition` has the node names).

    Attributes:
        saved_for_backward_bytes: the forward outputs the backward reads (parameters and
            buffers left out), once per storage, bytes.
        saved_tensors: how many such outputs.
        recomputed_nodes: backward nodes that recompute forward nodes.
        recompute_flops: their FLOPs under graphflop's rules.
        uncounted_ops: the recomputed ops without a rule (counted 0).
        forward_backward_peak_bytes: largest sum of live storages while the forward then the
            backward graph run in node order (parameters, buffers, inputs and targets not
            included), bytes.
    """

    saved_for_backward_bytes: int
    saved_tensors: int
    recomputed_nodes: int
    recompute_flops: int
    uncounted_ops: tuple[str, ...]
    forward_backward_peak_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {k: _plain(v) for k, v in _fields_dict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompiledPartition:
        return cls(**{**_pick(cls, d), "uncounted_ops": tuple(d["uncounted_ops"])})


@dataclass(frozen=True)
class CompiledWhatIf:
    """Under ``memory_model="compiled"``: what ``torch.compile``'s AOTAutograd partitions save
    and recompute (:mod:`graphflop.passes.compiled_memory`).

    Attributes:
        execution: the execution the figures describe, in words.
        min_cut: ``min_cut_rematerialization_partition``'s cut (what ``torch.compile`` runs).
        default: ``default_partition``'s cut (saves what the backward reads, recomputes
            nothing).
    """

    execution: str
    min_cut: CompiledPartition
    default: CompiledPartition

    def to_dict(self) -> dict[str, Any]:
        return {k: _plain(v) for k, v in _fields_dict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompiledWhatIf:
        return cls(
            d["execution"],
            CompiledPartition.from_dict(d["min_cut"]),
            CompiledPartition.from_dict(d["default"]),
        )


@dataclass(frozen=True)
class CheckpointedModule:
    """One checkpointed module of :class:`CheckpointWhatIf` (``per_module``).

    Attributes:
        module: its path.
        recompute_flops: FLOPs of its forward nodes rerun in the backward.
        recomputed_nodes: how many such nodes.
    """

    module: str
    recompute_flops: int
    recomputed_nodes: int

    def to_dict(self) -> dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointedModule:
        return cls(**_pick(cls, d))


@dataclass(frozen=True)
class CheckpointWhatIf:
    """With ``checkpoint=PATTERN``: ``torch.utils.checkpoint(use_reentrant=False)`` around the
    matching modules, in bytes and FLOPs (:mod:`graphflop.passes.checkpoint`).

    Attributes:
        execution: the execution the figures describe, in words.
        pattern: the pattern as given.
        pattern_syntax: ``glob``, or ``regex`` for a pattern starting ``re:``.
        modules: the checkpointed module paths (outermost matches), in forward order.
        saved_for_backward_bytes: bytes saved for backward with checkpointing (once per
            storage).
        eager_saved_for_backward_bytes: the eager model's saved bytes without checkpointing.
        checkpoint_input_bytes: of ``saved_for_backward_bytes``, the checkpointed modules'
            inputs.
        recompute_flops: FLOPs of the forward nodes rerun in the backward, all modules.
        train_peak_bytes: estimated train-step peak with checkpointing (parameters, gradients
            and optimizer state included); None when not computed (absent from the JSON).
        per_module: each checkpointed module's recompute FLOPs and nodes.
    """

    execution: str
    pattern: str
    pattern_syntax: str
    modules: tuple[str, ...]
    saved_for_backward_bytes: int
    eager_saved_for_backward_bytes: int
    checkpoint_input_bytes: int
    recompute_flops: int
    train_peak_bytes: int | None
    per_module: tuple[CheckpointedModule, ...]

    def to_dict(self) -> dict[str, Any]:
        return {k: _plain(v) for k, v in _fields_dict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointWhatIf:
        return cls(
            **{
                **_pick(cls, {"train_peak_bytes": None, **d}),
                "modules": tuple(d["modules"]),
                "per_module": tuple(CheckpointedModule.from_dict(m) for m in d["per_module"]),
            }
        )


@dataclass(frozen=True)
class RecomputeWhatIf:
    """With ``recompute=attention``: selective activation recomputation (Korthikanti et al.
    2022) of every attention core, in bytes and FLOPs
    (:mod:`graphflop.passes.selective_recompute`).

    Attributes:
        execution: the execution the figures describe, in words.
        policy: ``attention``.
        cores: the recomputed cores (the score product's module path), in forward order.
        fused_cores: attention calls traced as PyTorch's fused kernel, which already save only
            q, k, v, the output and the logsumexp: left alone.
        prologue_recomputed: whether the cheap ops only a core reads (the scaling of q, the
            reshapes before the products) are recomputed with it (they save bytes).
        saved_for_backward_bytes: bytes saved for backward with the cores recomputed (once per
            storage).
        eager_saved_for_backward_bytes: the eager model's saved bytes without.
        recompute_input_bytes: of ``saved_for_backward_bytes``, the cores' inputs.
        recompute_flops: FLOPs of the forward nodes rerun in the backward, all cores.
        recompute_mm_flops: of those, the matrix products' (the score product and the product
            with v).
        train_peak_bytes: estimated train-step peak (parameters, gradients and optimizer state
            included); None when not computed (absent from the JSON).
        per_core: each core's recompute FLOPs and nodes (``module`` names the core).
    """

    execution: str
    policy: str
    cores: tuple[str, ...]
    fused_cores: int
    prologue_recomputed: bool
    saved_for_backward_bytes: int
    eager_saved_for_backward_bytes: int
    recompute_input_bytes: int
    recompute_flops: int
    recompute_mm_flops: int
    train_peak_bytes: int | None
    per_core: tuple[CheckpointedModule, ...]

    def to_dict(self) -> dict[str, Any]:
        return {k: _plain(v) for k, v in _fields_dict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecomputeWhatIf:
        return cls(
            **{
                **_pick(cls, {"train_peak_bytes": None, **d}),
                "cores": tuple(d["cores"]),
                "per_core": tuple(CheckpointedModule.from_dict(m) for m in d["per_core"]),
            }
        )


@dataclass(frozen=True)
class AmpWhatIf:
    """With ``amp=bf16|fp16``: a step under ``torch.autocast``, in bytes
    (:mod:`graphflop.passes.amp`).

    Attributes:
        execution: the execution the figures describe, in words.
        dtype: ``bf16`` or ``fp16``.
        saved_for_backward_bytes: bytes saved for backward under autocast (once per storage).
        saved_cast_bytes: of those, the cast copies (half weights and activations, float32
            inputs of float32 ops).
        eager_saved_for_backward_bytes: the eager model's saved bytes without autocast.
        flops_unchanged: always True: autocast changes dtypes, not the FLOP counts.
        train_peak_bytes: estimated train-step peak under autocast (parameters, gradients and
            optimizer state in float32 included); None when not computed (absent from the
            JSON).
    """

    execution: str
    dtype: str
    saved_for_backward_bytes: int
    saved_cast_bytes: int
    eager_saved_for_backward_bytes: int
    flops_unchanged: bool = True
    train_peak_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in _fields_dict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AmpWhatIf:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class Memory:
    """Memory in bytes (docs/flops_conventions.md, Memory); ``None`` for a phase that was not built.

    Attributes:
        params_bytes: the parameters.
        forward_peak_bytes: parameters and buffers + the live-tensor peak of graphflop's
            forward graph (forward and loss) in its own node order, under every memory model
            (not an eager run: a decomposed op's temporaries are live tensors).
        grads_bytes: the gradients (as many bytes as the parameters).
        optimizer_state_bytes: the optimizer state: under the eager model what
            ``torch.optim``'s state holds (Adam's per-parameter step counts included:
            :func:`graphflop.passes.optimizer.optimizer_state_bytes`), for the parameters that
            get a gradient only (``torch.optim`` makes none where ``.grad`` stays None); under
            the graph model the update graph's state inputs, every trainable parameter's.
        saved_for_backward_bytes: forward values the backward reads.
        train_peak_bytes: parameters, buffers, gradients and state + the train step's live
            peak.
        jvp_peak_bytes: parameters, buffers and the parameters' tangents + the JVP graph's
            live peak.
        memory_model: ``eager`` (what eager PyTorch autograd saves and allocates on
            ``device``) or ``graph`` (graphflop's own graphs in their node order); None in
            reports written before eager memory was modelled (``graph``).
        device: the device the eager model describes (``cpu`` or ``cuda``).
        describes: figure name -> the execution that figure describes, in words.
        keep_grads: gradients kept between steps (``zero_grad(set_to_none=False)``: live from
            the start, the backward accumulating into them) rather than set to None.
        buffers_bytes: the module's buffers (batch norm's running statistics, masks, rotary
            tables): held for the module's life like the parameters, so in every peak; None in
            reports written before buffers were counted (they were then scheduled as inputs).
        compiled: under ``memory_model`` ``compiled``, both AOTAutograd partitions (saved
            bytes, recomputed nodes and their FLOPs, peaks: :class:`CompiledWhatIf`).
        checkpoint: with ``checkpoint=PATTERN``, the checkpointing what-if (saved bytes,
            recompute FLOPs: :class:`CheckpointWhatIf`).
        amp: with ``amp=bf16|fp16``, the autocast what-if (saved bytes, train peak:
            :class:`AmpWhatIf`).
        recompute: with ``recompute=attention``, selective recompute of the attention cores
            (saved bytes, recompute FLOPs: :class:`RecomputeWhatIf`).
    """

    params_bytes: int
    forward_peak_bytes: int
    grads_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    saved_for_backward_bytes: int | None = None
    train_peak_bytes: int | None = None
    jvp_peak_bytes: int | None = None
    memory_model: str | None = None
    device: str | None = None
    describes: dict[str, str] | None = None
    keep_grads: bool | None = None
    buffers_bytes: int | None = None
    compiled: CompiledWhatIf | None = None
    checkpoint: CheckpointWhatIf | None = None
    amp: AmpWhatIf | None = None
    recompute: RecomputeWhatIf | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: _plain(v) for k, v in _fields_dict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Memory:
        what_ifs: dict[str, Any] = {
            "compiled": CompiledWhatIf,
            "checkpoint": CheckpointWhatIf,
            "amp": AmpWhatIf,
            "recompute": RecomputeWhatIf,
        }
        return cls(
            **{
                f.name: what_ifs[f.name].from_dict(d[f.name]) if f.name in what_ifs else d[f.name]
                for f in fields(cls)
                if f.name in d
            }
        )


@dataclass(frozen=True)
class LayerRow:
    """FLOPs and parameters of one module (``name`` ``(model)`` for the model's own forward).

    FLOP fields of a phase that was not built are 0; its ratios are None. ``ratio`` is
    (backward + update) / forward, ``ratio_no_update`` backward / forward, ``jvp_ratio``
    JVP / forward, ``share`` this layer's part of the forward FLOPs. ``saved_bytes``: the
    bytes saved for backward whose storages this module's forward allocated (in the report's
    memory model; the inputs under ``(model)``), 0 without a backward.
    """

    name: str
    params: int = 0
    forward_flops: int = 0
    forward_mm_flops: int = 0
    output_shape: tuple[int, ...] | None = None
    output_bytes: int = 0
    backward_flops: int = 0
    backward_mm_flops: int = 0
    grad_input_flops: int = 0
    grad_weight_flops: int = 0
    grad_accum_flops: int = 0
    pruned_flops: int = 0
    update_flops: int = 0
    jvp_flops: int = 0
    jvp_mm_flops: int = 0
    tangent_from_input_flops: int = 0
    tangent_from_param_flops: int = 0
    jvp_skipped_flops: int = 0
    saved_bytes: int = 0
    ratio: float | None = None
    ratio_no_update: float | None = None
    jvp_ratio: float | None = None
    share: float = 0.0

    def to_dict(self, *, backward: bool = True, jvp: bool = True) -> dict[str, Any]:
        """The row's JSON object; the ratios of a phase that was not built are left out."""
        d = _fields_dict(self)
        d["output_shape"] = list(self.output_shape) if self.output_shape is not None else None
        if not backward:
            del d["ratio"], d["ratio_no_update"]
        if not jvp:
            del d["jvp_ratio"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerRow:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        if kw.get("output_shape") is not None:
            kw["output_shape"] = tuple(kw["output_shape"])
        return cls(**kw)


@dataclass(frozen=True)
class InputSpec:
    """One model input: placeholder name, shape and dtype (``float32``, ``int64``, ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InputSpec:
        return cls(d["name"], tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True)
class Uncounted:
    """An op the analysis could not count or differentiate (partial results,
    docs/flops_conventions.md).

    Attributes:
        op: ``aten.x.overload`` (or the custom op's) name.
        count: forward nodes calling it.
        nodes: those nodes' names.
        modules: their ``nn.Module`` paths, each once.
        missing: the kinds of rule it lacks that the analysis needed, of ``cost``, ``jvp``,
            ``transpose``: with no cost rule its nodes count 0; with no JVP or transpose rule the
            JVP or backward stops at its nodes (what depends on them is not built);
            ``recompute``: ``op`` is a ``torch.utils.checkpoint`` use whose recompute is not
            modelled as eager runs it (the backward's count is not eager's).
    """

    op: str
    count: int
    nodes: tuple[str, ...]
    modules: tuple[str, ...]
    missing: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "count": self.count,
            "nodes": list(self.nodes),
            "modules": list(self.modules),
            "missing": list(self.missing),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Uncounted:
        return cls(d["op"], d["count"], tuple(d["nodes"]), tuple(d["modules"]), tuple(d["missing"]))


@dataclass(frozen=True)
class OpRow:
    """The nodes of one op in one phase, summed (``inspect --by op``).

    Attributes:
        op: ``aten.x.overload`` name.
        phase: ``forward``, ``backward``, ``update``, ``jvp`` or ``forward_gradient_step``;
            a phase's rows sum to its totals.
        count: nodes.
        flops, mm_flops, bytes_read, bytes_written: as in :class:`CostTotals`.
    """

    op: str
    phase: str
    count: int
    flops: int
    mm_flops: int
    bytes_read: int
    bytes_written: int

    def to_dict(self) -> dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpRow:
        return cls(**_pick(cls, d))


#: the phases :class:`OpRow` covers, in report order
OP_PHASES = ("forward", "backward", "update", "jvp", "forward_gradient_step")


@dataclass(frozen=True)
class PhaseTime:
    """Predicted seconds of one phase on one device (:mod:`graphflop.passes.step_time`).

    Attributes:
        seconds: the phase's predicted time, ``compute_s + memory_s + overhead_s + host_s -
            overlap_s``.
        compute_s: the work time (time less overhead) of the kernels whose compute term is at
            least their memory term.
        memory_s: the work time of the kernels whose memory term is larger.
        overhead_s: every kernel's launch or dispatch cost.
        overlap_s: on an asynchronous device (a GPU), the seconds of host overhead and device
            work that run at the same time (:mod:`graphflop.passes.step_time`); 0 on a CPU.
        host_s: host seconds beyond the kernels: ``nn.Module`` calls and the autograd engine's
            per-node work (a calibrated profile's; :mod:`graphflop.passes.step_time`).
        kernels: eager kernels (a composite op's decomposition counts once).
        flops: FLOPs of the phase (as in its :class:`CostTotals`).
        by_role: role -> seconds, each role's share of :attr:`seconds` (its kernels' seconds
            × ``seconds`` / their sum: on a GPU less its share of the overlap, with host costs
            plus its share of them), so the roles add up to the phase.
        complete: False when the phase's FLOP totals are incomplete (an op without a rule:
            :attr:`CostTotals.complete`) or a kernel of it was timed without a cost rule; its
            time is then a lower bound.
        no_cost_rule: the ops of the phase without a cost rule, timed at their tensors' bytes
            on the memory roofline (no compute), in the order first met.
    """

    seconds: float
    compute_s: float
    memory_s: float
    overhead_s: float
    kernels: int
    flops: int
    by_role: tuple[tuple[str, float], ...] = ()
    overlap_s: float = 0.0
    host_s: float = 0.0
    complete: bool = True
    no_cost_rule: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = _fields_dict(self)
        d["by_role"] = dict(self.by_role)
        d["no_cost_rule"] = list(self.no_cost_rule)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PhaseTime:
        # reports written before a key existed take its default
        defaults = {"overlap_s": 0.0, "host_s": 0.0, "complete": True, "no_cost_rule": ()}
        kw = _pick(cls, {**defaults, **d})
        kw["by_role"] = tuple(d.get("by_role", {}).items())
        kw["no_cost_rule"] = tuple(d.get("no_cost_rule", ()))
        return cls(**kw)


@dataclass(frozen=True)
class LayerTime:
    """Predicted seconds of one module's nodes, per phase, and what bounds its forward.

    Attributes:
        name: module path (``(model)`` for the model's own forward).
        forward_s, backward_s, update_s, jvp_s: seconds, the module's share of the phase
            (the rows of a phase add up to it; 0 for a phase not built).
        bound: what bounds most of its forward time (``compute``, ``memory``, ``overhead``).
    """

    name: str
    forward_s: float
    backward_s: float
    update_s: float
    jvp_s: float
    bound: str

    def to_dict(self) -> dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerTime:
        return cls(**_pick(cls, d))


@dataclass(frozen=True)
class OpTime:
    """The eager kernels of one op in one phase, summed (a composite op's kernel under the
    composite op's name).

    Attributes:
        op: ``aten.x.overload`` of the kernel.
        phase: as in :class:`OpRow`.
        kernels: how many.
        seconds: their share of the phase's seconds (their kernels' seconds × the phase's
            seconds / the sum of its kernels' seconds), so the rows of a phase add up to it:
            ``compute_s + memory_s + overhead_s + host_s - overlap_s``.
        compute_s, memory_s, overhead_s: their kernels' terms, as in :class:`PhaseTime` (the
            rows of a phase add up to its own).
        host_s, overlap_s: their share of the phase's host costs and of its host/device
            overlap (in proportion to their kernels' seconds; 0 where the phase has none).
        flops, bytes: FLOPs and bytes read + written by those kernels (for an op without a
            cost rule, the bytes of its tensors it was timed at).
        bound: what bounds most of their time.
        no_cost_rule: the op has no cost rule: timed at its tensors' bytes on the memory
            roofline, no compute (a lower bound).
    """

    op: str
    phase: str
    kernels: int
    seconds: float
    compute_s: float
    memory_s: float
    overhead_s: float
    flops: int
    bytes: int
    bound: str
    host_s: float = 0.0
    overlap_s: float = 0.0
    no_cost_rule: bool = False

    def to_dict(self) -> dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpTime:
        # reports written before a key existed take its default
        return cls(**_pick(cls, {"host_s": 0.0, "overlap_s": 0.0, "no_cost_rule": False, **d}))


@dataclass(frozen=True)
class TimeReport:
    """Predicted step time on one device (``inspect --device``).

    Attributes:
        device: the profile's name; title: its readable name.
        source: ``datasheet`` or ``calibrated``.
        amp: the autocast dtype matrix products and convolutions ran in, or None.
        phases: phase -> :class:`PhaseTime` (``forward``, ``loss``, ``backward``, ``update``,
            ``train_step``, ``jvp``, ``forward_gradient_step``: those built).
        ratios: ``Rb`` = train step / forward, ``Rf`` = forward-gradient step / forward,
            ``Rf_over_Rb``, ``backward_forward`` = (backward + update) / forward, and
            ``jvp_forward``, in predicted seconds; each ``None`` when its phases are absent.
        flop_ratios: the same ratios in FLOPs, beside them.
        layers: one :class:`LayerTime` per module row of the report.
        ops: one :class:`OpTime` per (phase, kernel op).
        recompute: what-if (``checkpoint``, ``recompute``) -> predicted seconds of the forward
            kernels it reruns in the backward (each timed as in the forward), which a train
            step with that what-if adds to ``train_step``; empty without those what-ifs.
        memory_bytes: the device's memory, bytes, where the profile knows it (data sheets,
            calibrated GPUs); None otherwise.
    """

    device: str
    title: str
    source: str
    amp: str | None
    phases: tuple[tuple[str, PhaseTime], ...]
    ratios: tuple[tuple[str, float | None], ...]
    flop_ratios: tuple[tuple[str, float | None], ...]
    layers: tuple[LayerTime, ...] = ()
    ops: tuple[OpTime, ...] = ()
    recompute: tuple[tuple[str, float], ...] = ()
    memory_bytes: int | None = None

    def phase(self, name: str) -> PhaseTime | None:
        """The phase ``name``, or None when it was not built."""
        return dict(self.phases).get(name)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device": self.device,
            "title": self.title,
            "source": self.source,
            "amp": self.amp,
            "phases": {k: v.to_dict() for k, v in self.phases},
            "ratios": dict(self.ratios),
            "flop_ratios": dict(self.flop_ratios),
            "layers": [L.to_dict() for L in self.layers],
            "ops": [o.to_dict() for o in self.ops],
        }
        if self.recompute:  # only under --checkpoint / --recompute
            out["recompute"] = dict(self.recompute)
        if self.memory_bytes is not None:
            out["memory_bytes"] = self.memory_bytes
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TimeReport:
        return cls(
            device=d["device"],
            title=d["title"],
            source=d["source"],
            amp=d.get("amp"),
            phases=tuple((k, PhaseTime.from_dict(v)) for k, v in d["phases"].items()),
            ratios=tuple(d["ratios"].items()),
            flop_ratios=tuple(d["flop_ratios"].items()),
            layers=tuple(LayerTime.from_dict(L) for L in d.get("layers", ())),
            ops=tuple(OpTime.from_dict(o) for o in d.get("ops", ())),
            recompute=tuple(d.get("recompute", {}).items()),
            memory_bytes=d.get("memory_bytes"),
        )


@dataclass(frozen=True)
class EagerAttention:
    """Which attention execution the FLOPs count, where the two differ: graphflop's graph
    holds scaled dot-product attention in its math form (forward q·kᵀ and P·v; backward dP,
    dV, dQ, dK: four products, twice the forward's two), what ``sdpa_kernel(SDPBackend.MATH)``
    runs and what every ``inspect`` FLOP figure counts. Eager PyTorch on CPU runs ``calls`` of
    them on its fused kernel (``kernel``), whose backward recomputes the scores q·kᵀ from the
    saved logsumexp: a fifth product, 2.5 times the forward's attention products
    (FlopCounterMode's ``sdpa_backward_flop_count`` counts the same), which ``plan`` counts.

    Attributes:
        calls: attention calls tagged as the fused kernel.
        kernel: the fused kernel's ATen op.
        backward_recompute_flops: FLOPs of the recomputed score products, all calls, whole
            model (all in ``backward_recompute_mm_flops``: they are matrix products).
        backward_recompute_mm_flops: their matrix FLOPs: eager PyTorch's backward ``mm_flops``
            is the graph's plus this.
    """

    calls: int
    kernel: str
    backward_recompute_flops: int
    backward_recompute_mm_flops: int

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (``eager_attention`` of :meth:`Report.to_dict`)."""
        return {
            "calls": self.calls,
            "kernel": self.kernel,
            "backward_recompute_flops": self.backward_recompute_flops,
            "backward_recompute_mm_flops": self.backward_recompute_mm_flops,
            "describes": "totals count graphflop's graph: attention in its math form "
            "(sdpa_kernel(SDPBackend.MATH); backward 4 products, 2x the forward's); eager "
            "PyTorch runs these calls on the fused kernel, whose backward recomputes q.k^T "
            "(5 products, 2.5x): its backward adds backward_recompute_flops (what plan counts)",
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EagerAttention:
        """Read :meth:`to_dict`'s object."""
        return cls(
            d["calls"], d["kernel"], d["backward_recompute_flops"], d["backward_recompute_mm_flops"]
        )


@dataclass(frozen=True)
class Report:
    """Everything ``graphflop inspect`` reports about one model.

    Attributes:
        model: the model's name.
        inputs: the model's tensor inputs.
        params: parameter elements.
        loss: the loss the forward graph ends in (``cross_entropy``, ``mse``, ``sum``, ...).
        optimizer: the update's optimizer, None without a backward graph.
        totals, ratios, memory: see their classes.
        layers: one row per module, in the order modules first appear in the graphs.
        schema_version: :data:`SCHEMA_VERSION`.
        trainable_params: parameter elements that train (None when read from a document
            written before the key existed).
        frozen_params: parameter elements with ``requires_grad=False``: no gradient, update or
            optimizer state (``params = trainable_params + frozen_params``).
        uncounted: ops without the rules the analysis needed (empty when complete).
        ops: per-phase, per-op rows (:class:`OpRow`).
        assumptions: one line per assumption the counts rest on beyond the shapes (the rows
            of a data-dependent expert dispatch under a routing model); in the JSON only where
            there is one.
        time: predicted times on a device (:class:`TimeReport`), when one was asked for; in
            the JSON only then.
        eager_attention: the attention calls eager PyTorch runs on a fused kernel, whose
            backward does more matrix work than the graph's math form
            (:class:`EagerAttention`); None (and not in the JSON) when there are none.
    """

    model: str
    inputs: tuple[InputSpec, ...]
    params: int
    loss: str | None
    optimizer: str | None
    totals: Totals
    ratios: Ratios
    memory: Memory
    layers: tuple[LayerRow, ...]
    schema_version: int = SCHEMA_VERSION
    # trainable and frozen parameter counts
    trainable_params: int | None = None
    frozen_params: int | None = None
    # partial results and the per-op breakdown (docs/flops_conventions.md)
    uncounted: tuple[Uncounted, ...] = ()
    ops: tuple[OpRow, ...] = ()
    assumptions: tuple[str, ...] = ()
    time: TimeReport | None = None
    eager_attention: EagerAttention | None = None

    @property
    def has_backward(self) -> bool:
        """Whether the backward (and update) graphs were built."""
        return self.totals.backward is not None

    @property
    def has_jvp(self) -> bool:
        """Whether the JVP graph was built."""
        return self.totals.jvp is not None

    @property
    def derivative_gaps(self) -> tuple[Uncounted, ...]:
        """The ops of :attr:`uncounted` without a JVP or transpose rule: the JVP and backward
        graphs stop at their nodes (what depends on them is missing, gradients included)."""
        return tuple(u for u in self.uncounted if {"jvp", "transpose"} & set(u.missing))

    def layer(self, name: str) -> LayerRow:
        """The row of the module ``name`` (``(model)`` for the model's own forward).

        Raises:
            KeyError: no such row.
        """
        for row in self.layers:
            if row.name == name:
                return row
        names = [r.name for r in self.layers]
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"rows: {', '.join(names[:8])}"
        raise KeyError(
            f"no layer row {name!r}; {hint}{' ...' if not close and len(names) > 8 else ''}"
        )

    def layers_at_depth(self, depth: int) -> tuple[LayerRow, ...]:
        """The rows rolled up to module paths of at most ``depth`` dotted parts (``1``: the
        model's children), summing counters and recomputing ratios and shares; rows already
        shallower stay as they are; a group's output is its last row's (the
        block's output).

        Raises:
            ValueError: ``depth`` below 1.
        """
        if depth < 1:
            raise ValueError(f"bad depth {depth}: must be at least 1")
        groups: dict[str, list[LayerRow]] = {}
        for row in self.layers:
            key = row.name if row.name == "(model)" else ".".join(row.name.split(".")[:depth])
            groups.setdefault(key, []).append(row)
        total = self.totals.forward.flops
        return tuple(
            _rolled(k, rows, total, self.has_backward, self.has_jvp) for k, rows in groups.items()
        )

    def layer_dicts(self) -> list[dict[str, Any]]:
        """The rows as JSON objects (``layers`` of :meth:`to_dict`)."""
        return [L.to_dict(backward=self.has_backward, jvp=self.has_jvp) for L in self.layers]

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of ``graphflop inspect --json`` (schema version 1): keys in schema
        order, lists for shapes, ``None`` for undefined ratios."""
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "model": self.model,
            "inputs": [i.to_dict() for i in self.inputs],
            "params": self.params,
            # trainable and frozen parameter counts
            "trainable_params": self.trainable_params,
            "frozen_params": self.frozen_params,
            "loss": self.loss,
            "optimizer": self.optimizer,
            "totals": self.totals.to_dict(),
            "ratios": self.ratios.to_dict(self.totals),
            "memory": self.memory.to_dict(),
            "layers": self.layer_dicts(),
            "uncounted": [u.to_dict() for u in self.uncounted],
            "ops": [o.to_dict() for o in self.ops],
        }
        if self.assumptions:
            out["assumptions"] = list(self.assumptions)
        if self.time is not None:
            out["time"] = self.time.to_dict()
        if self.eager_attention is not None:
            out["eager_attention"] = self.eager_attention.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        """Read a document written by :meth:`to_dict` (other top-level keys are ignored).

        Raises:
            KeyError: a required key is missing.
            ValueError: an unsupported ``schema_version``.
        """
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(
                f"unsupported schema_version {d.get('schema_version')!r}; "
                f"this graphflop reads {SCHEMA_VERSION}"
            )
        return cls(
            model=d["model"],
            inputs=tuple(InputSpec.from_dict(i) for i in d["inputs"]),
            params=d["params"],
            loss=d["loss"],
            optimizer=d["optimizer"],
            totals=Totals.from_dict(d["totals"]),
            ratios=Ratios.from_dict(d["ratios"]),
            memory=Memory.from_dict(d["memory"]),
            layers=tuple(LayerRow.from_dict(L) for L in d["layers"]),
            # trainable and frozen parameter counts
            trainable_params=d.get("trainable_params"),
            frozen_params=d.get("frozen_params"),
            uncounted=tuple(Uncounted.from_dict(u) for u in d.get("uncounted", ())),
            ops=tuple(OpRow.from_dict(o) for o in d.get("ops", ())),
            assumptions=tuple(d.get("assumptions", ())),
            time=TimeReport.from_dict(d["time"]) if "time" in d else None,
            eager_attention=(
                EagerAttention.from_dict(d["eager_attention"]) if "eager_attention" in d else None
            ),
        )


def _rolled(
    name: str, rows: list[LayerRow], forward_flops: int, has_bwd: bool, has_jvp: bool
) -> LayerRow:
    """One row summing ``rows`` (their ratios recomputed from the sums)."""
    if len(rows) == 1 and rows[0].name == name:
        return rows[0]
    skip = {
        "name",
        "output_shape",
        "output_bytes",
        "ratio",
        "ratio_no_update",
        "jvp_ratio",
        "share",
    }
    sums = {
        f.name: sum(getattr(r, f.name) for r in rows)
        for f in fields(LayerRow)
        if f.name not in skip
    }
    last = rows[-1]
    f = sums["forward_flops"]
    return LayerRow(
        name=name,
        **sums,
        output_shape=last.output_shape,
        output_bytes=last.output_bytes,
        ratio=(sums["backward_flops"] + sums["update_flops"]) / f if has_bwd and f else None,
        ratio_no_update=sums["backward_flops"] / f if has_bwd and f else None,
        jvp_ratio=sums["jvp_flops"] / f if has_jvp and f else None,
        share=f / forward_flops if forward_flops else 0.0,
    )


__all__ = [
    "SCHEMA_VERSION",
    "BackwardTotals",
    "CostTotals",
    "ForwardGradientTotals",
    "InputSpec",
    "JvpTotals",
    "ForwardTotals",
    "LayerRow",
    "Memory",
    "OpRow",
    "OpTime",
    "LayerTime",
    "PhaseTime",
    "Ratios",
    "Report",
    "TrainStepTotals",
    "TimeReport",
    "Totals",
    "Uncounted",
    "UpdateTotals",
]
