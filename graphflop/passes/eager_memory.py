"""The eager memory model: what PyTorch autograd saves and allocates for a training step.

graphflop's forward graph has the composite ops (batch/layer/group norm, softmax, log-softmax,
GELU, dropout, the losses) decomposed into their parts, and its backward reads whichever parts
its rules need: batch norm's ``x - mean`` and ``x̂``, softmax's ``exp`` and sum, dropout's bool
mask. Eager autograd runs each composite op as one kernel and saves what ATen's derivative
formula needs (:data:`graphflop.frontend.composite.EAGER_SAVES`): the input plus mean and inverse
std, the output, a float mask on CPU. This module keeps graphflop's graphs and swaps, for each
decomposed composite op, the residuals its backward reads from inside the decomposition for the
values eager autograd saves for that op (the nodes are found by the
:data:`~graphflop.meta.COMPOSITE` tags tracing writes). ATen ops whose derivative formula saves
values graphflop's rule does not read (:data:`ATEN_SAVES`: max, average and adaptive pooling and
gather, kept whole; reflection and replication padding, decomposed into an index made from
constants and found by their tags) keep them until their backward has run
(:attr:`EagerResiduals.held`; max pooling its input and indices, as two storages), and their
backward is one kernel too. A division's quotient, which graphflop's rule reads, stands for the
dividend eager saves (:data:`RESULT_AS_INPUT`); the output of an op the model ran in place stands
for the input graphflop's rule reads where the in-place form's formula saves the result
(:data:`INPUT_AS_RESULT_IN_PLACE`: ``leaky_relu_``). Attention PyTorch runs with its fused kernel
saves q, k, v, its output, the mask and a logsumexp, and makes no scores or probabilities in
forward or backward (:mod:`graphflop.passes.eager_attention`). Each composite op's forward and
backward (and each convolution's backward) run as the one kernel eager runs: the decomposition's
inner nodes hold nothing (:func:`one_kernel_backward`). So composite ops need not be kept whole
with rules of their own for the memory figures to be those of the eager run; training-mode batch
norm is kept whole anyway (:data:`~graphflop.frontend.composite.KEPT_WHOLE`, for the cost of
tracing it): its node is a one-node region whose rule's backward reads x, μ and rstd, eager's
saves.

The eager train step (:func:`eager_train_schedule`): the forward, each multi-output op's outputs
as separate storages; the backward with the eager residuals; gradients allocated as the backward
produces them and kept (``zero_grad(set_to_none=True)``, PyTorch's default), none for what no
gradient reaches (the zero fills of :func:`ungraded_nodes`: ``.grad`` stays None); a plain op's output
gradient and saved values held to its rule's last node, as its one eager autograd node holds them
until it returns (:func:`~graphflop.passes.eager_kernels.autograd_node_reads`); the update in
place, with the temporaries ``torch.optim`` makes for the parameters with a gradient
(:func:`optimizer_temporaries`, :func:`graded_sizes`); kernels' own
temporaries on CPU (:func:`kernel_temporaries`). The eager JVP (:func:`eager_jvp_schedule`):
``torch.func.jvp``, primal and tangent as one dual tensor. Reads ``val``, ``COMPOSITE``,
``CHECKPOINT`` and ``ROLE`` (the recompute of a checkpoint: random draws are redrawn, not
saved; the sums of a value's gradients), ``RESIDUAL``, ``SOURCE``, ``KIND``; writes nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Set
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import torch
from torch.fx import GraphModule, Node

from graphflop.frontend.composite import (
    CPU_FLOAT32_ONLY,
    EAGER_SAVES,
    EAGER_SAVES_IN_PLACE,
    FLOAT_MASK_ON_CPU,
    FUSED_SDPA,
    composite_regions,
    tag_of,
)
from graphflop.meta import (
    CHECKPOINT,
    COMPOSITE,
    FUNCTION,
    GAPS,
    INPLACE,
    JVP,
    KIND,
    RESIDUAL,
    ROLE,
    SIGNATURE,
    SOURCE,
    VJP,
    occurrences,
)
from graphflop.passes.eager_attention import FusedAttention, attention_jvp
from graphflop.passes.eager_kernels import (
    GRAD_OUTPUT_COPIED,
    TANGENT_FORMULA,
    autograd_node_reads,
    backward_temporaries,
    broadcast_product_backward,
    formula_reads,
    merge_reads,
    nodes_made_by,
    one_kernel_backward,
    one_kernel_forward,
    weight_norm_workspace,
    zero_tangent_mms,
)
from graphflop.passes.flops import tensor_bytes
from graphflop.passes.memory import Schedule, forward_storages
from graphflop.passes.memory_calls import ComposedSchedule, backward_runs, forward_runs

aten = torch.ops.aten

#: ATen ops whose derivative formula saves values graphflop's backward does not read: op ->
#: (the argument positions, the output positions) of the values eager autograd saves for it.
#: Most are kept whole in graphflop's forward graph; reflection and replication padding are
#: traced decomposed (PyTorch's core-ATen table makes them an ``index``), their nodes tagged
#: (:data:`~graphflop.frontend.composite.EAGER_SAVES`) and held by region
#: (:func:`eager_forward`). From PyTorch's
#: ``tools/autograd/derivatives.yaml`` (the ``self:`` formulas named in each comment); the
#: bytes measured with ``torch.autograd.graph.saved_tensors_hooks``
#: (``tests/test_memory_eager.py``). graphflop's rules compute these gradients from the
#: shapes alone (the pools' col2im, gather's scatter) or from the indices only, so the
#: values are saved in addition to graphflop's residuals (:attr:`EagerForward.held`).
ATEN_SAVES: dict[Any, tuple[tuple[int, ...], tuple[int, ...]]] = {
    # avg_pool2d_backward(grad, self, kernel_size, stride, padding, ceil_mode, ...)
    aten.avg_pool2d.default: ((0,), ()),
    aten.avg_pool3d.default: ((0,), ()),
    # _adaptive_avg_pool2d_backward(grad, self)
    aten._adaptive_avg_pool2d.default: ((0,), ()),
    aten._adaptive_avg_pool3d.default: ((0,), ()),
    # max_pool2d_with_indices_backward(grad, self, kernel_size, ..., indices): the input and
    # the indices (graphflop's rule, a scatter of the indices, reads the indices only)
    aten.max_pool2d_with_indices.default: ((0,), (1,)),
    aten.max_pool3d_with_indices.default: ((0,), (1,)),
    # adaptive_max_pool2d_backward(grad, self, result1): the input and the indices
    aten.adaptive_max_pool2d.default: ((0,), (1,)),
    aten.adaptive_max_pool3d.default: ((0,), (1,)),
    # reflection_pad2d_backward(grad, self, padding) (1d, 3d and replication_pad alike)
    aten.reflection_pad1d.default: ((0,), ()),
    aten.reflection_pad2d.default: ((0,), ()),
    aten.reflection_pad3d.default: ((0,), ()),
    aten.replication_pad1d.default: ((0,), ()),
    aten.replication_pad2d.default: ((0,), ()),
    aten.replication_pad3d.default: ((0,), ()),
    # rrelu_with_noise_backward(grad, self, noise, lower, upper, training, false): self and
    # noise (graphflop's rule reads the noise only); rrelu_with_noise_ (traced functional)
    # saves result and noise: rrelu_with_noise_backward(grad, result, noise, ..., true)
    aten.rrelu_with_noise.default: ((0, 1), ()),
    aten.rrelu_with_noise_functional.default: ((), (0, 1)),
    # gather_backward(grad, self, dim, index, sparse_grad): self (for its sizes) and index
    aten.gather.default: ((0, 2), ()),
}
#: :data:`ATEN_SAVES`'s ops by name: those traced decomposed (reflection and replication
#: padding, which PyTorch's core-ATen table decomposes into an index) are found by the
#: :data:`~graphflop.meta.COMPOSITE` tags of their decompositions (they are in
#: :data:`~graphflop.frontend.composite.EAGER_SAVES` too, which says what eager saves)
_ATEN_SAVES_NAMES = frozenset(str(op) for op in ATEN_SAVES)
#: Plain ATen ops whose rule reads their output where eager's derivative formula saves an input
#: instead: op -> the argument position of that input. The output, read by the op's own
#: backward nodes, stands for the input (:attr:`EagerForward.result_as`); read by another op's
#: backward it is that op's residual, as it is. From ``tools/autograd/derivatives.yaml``, the
#: bytes measured with ``torch.autograd.graph.saved_tensors_hooks``
#: (``tests/test_memory_eager.py``).
RESULT_AS_INPUT: dict[Any, int] = {
    # div.Tensor's ``other: div_tensor_other_backward(grad, self, other)`` (-grad·self/other²):
    # DivBackward0 saves self where other needs a gradient (and other always); graphflop's
    # rule computes the same cotangent from the quotient (-ct·out/other, one division fewer)
    aten.div.Tensor: 0,
}
#: Plain ATen ops whose rule reads an input where eager's derivative formula for the in-place
#: form saves the result (a node tagged :data:`~graphflop.meta.INPLACE`): op -> the argument
#: position of that input. The output, which the model's next op reads anyway, stands for the
#: input read by the op's own backward nodes (:attr:`EagerForward.input_as`). From
#: ``tools/autograd/derivatives.yaml``, the bytes measured with
#: ``torch.autograd.graph.saved_tensors_hooks`` (``tests/test_memory_eager.py``).
INPUT_AS_RESULT_IN_PLACE: dict[Any, int] = {
    # leaky_relu_'s ``self: leaky_relu_backward(grad, result, negative_slope, true)``
    # (LeakyReluBackward1); leaky_relu's saves self (LeakyReluBackward0)
    aten.leaky_relu.default: 0,
}
#: Plain ATen ops whose eager backward is one kernel of the saved result and the gradient
#: (``tools/autograd/derivatives.yaml``): ``relu``'s ``threshold_backward(grad, result, 0)``,
#: ``sigmoid_backward(grad, result)``, ``tanh_backward(grad, result)``. It allocates the
#: input's gradient while the result and the gradient are live; graphflop's rule makes a bool
#: mask (``relu``: the result may be freed before the select) or ``1 - out`` and products
#: first (:func:`~graphflop.passes.eager_kernels.one_kernel_backward`; profiler allocator
#: events, PyTorch 2.13 CPU). ``hardswish_backward(grad, self)`` reads the saved input, as
#: graphflop's rule does, and makes its comparisons and coefficient inside the kernel.
ONE_KERNEL_BACKWARD = frozenset(
    {aten.relu.default, aten.sigmoid.default, aten.tanh.default, aten.hardswish.default}
)
#: backward placeholders' RESIDUAL kinds that are not saved for backward: parameters and
#: buffers. A floating value computed from them only (``param_derived``: a scaled or
#: standardised weight, rotary cos/sin) is: eager autograd saves it as a storage of its own,
#: made anew each forward (``saved_tensors_hooks``, ``tests/test_memory_eager.py``); one that
#: is a view of a parameter or buffer (``t(W)``) shares its storage and has no key in
#: :func:`~graphflop.passes.memory.forward_storages`, so it is not counted. An integer one is
#: counted only as an embedding's indices (:func:`not_saved`).
_NOT_ACTIVATIONS = (None, "param", "buffer")
#: the ops :func:`eager_forward` reads besides the composite regions (one walk finds them)
_EAGER_FORWARD_OPS = frozenset(
    {
        *ATEN_SAVES,
        aten.convolution.default,
        *ONE_KERNEL_BACKWARD,
        aten._native_batch_norm_legit_functional.default,
        *RESULT_AS_INPUT,
        *INPUT_AS_RESULT_IN_PLACE,
    }
)
#: their ids: a node's target looked up without ``OpOverload``'s ``__hash__`` (a Python
#: method) per node of the flat forward; the same test, as an op equals only itself
_EAGER_FORWARD_IDS = frozenset(map(id, _EAGER_FORWARD_OPS))


def embedding_indices(forward: GraphModule | Iterable[Node]) -> frozenset[str]:
    """The names of the forward nodes (of ``forward``'s graph, or those given) an
    ``aten.embedding`` reads as its indices (eager's ``embedding_backward(grad, indices,
    ...)`` saves them)."""
    nodes = forward.graph.nodes if isinstance(forward, GraphModule) else forward
    embedding = aten.embedding.default
    return frozenset(
        a.name
        for n in nodes
        if n.target is embedding
        and n.op == "call_function"
        and len(n.args) > 1
        and isinstance(a := n.args[1], Node)
    )


def not_saved(p: Node, indices: frozenset[str] = frozenset()) -> bool:
    """Whether backward placeholder ``p`` holds no value eager autograd saves: no residual, a
    parameter or buffer, or an integer value computed from them and constants only that is
    not an embedding's indices (``indices``: :func:`embedding_indices`). Such an integer is
    most often the index arithmetic of an op traced decomposed (nearest upsampling, uneven
    adaptive pooling), which eager's one kernel never makes; the positions a model makes
    with ``arange`` for a position embedding eager does make and save."""
    kind = p.meta.get(RESIDUAL)
    if kind in _NOT_ACTIVATIONS:
        return True
    if kind != "param_derived":
        return False
    v = p.meta.get("val")
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return False
    return p.meta.get(SOURCE, p.name) not in indices


def unstored_values(forward: GraphModule) -> frozenset[str]:
    """The forward's node names with no storage of their own in the eager schedule: the
    parameters and buffers and the views of them (a Linear's ``t(W)``, a reshaped bias), to
    which :func:`~graphflop.passes.memory.forward_storages` gives no key (and the output
    node). The train schedules take the same values from their own forward's
    :meth:`~graphflop.passes.memory.Schedule.add_graph`, which returns them, rather than
    scheduling the forward again."""
    stored, _ = forward_storages(forward, {})
    return frozenset(n.name for n in forward.graph.nodes if n.name not in stored)


def residual_keys(
    p: Node,
    state: set[str],
    saved: bool,
    remap: dict[str, list[str]],
    unstored: Set[str],
) -> list[str]:
    """The keys (``f:NAME``) of the forward values that backward residual placeholder ``p``
    stands for in the eager train schedule, those with a storage of their own: none for a
    parameter or buffer (``state``) or a value eager does not save (``saved`` False:
    :func:`not_saved`); of the values it stands for (``remap``:
    :attr:`EagerResiduals.remap`), those not in ``unstored`` (the forward's values without
    a storage: :meth:`~graphflop.passes.memory.Schedule.add_graph`'s, :func:`unstored_values`). A
    value computed from parameters that is a view of one (``param_derived``: the ``t(W)`` an
    ``addmm`` saves) is the parameter's storage, always live: its key names no step, and a
    backward view of it (``t(t(W))``, the input gradient's ``mm`` operand) would otherwise be
    scheduled as a new storage of its size, which eager never allocates."""
    src = p.meta.get(SOURCE, p.name)
    if src in state or not saved:
        return []
    stand = remap.get(p.name)
    if stand is None:  # (most residuals: the value itself, no list made to filter)
        return [] if src in unstored else [f"f:{src}"]
    return [f"f:{x}" for x in stand if x not in unstored]


#: the execution each memory figure describes, by memory model (``Report.memory.describes``)
DESCRIBES = {
    "eager": {
        "saved_for_backward_bytes": "tensors eager PyTorch autograd saves for backward (ATen "
        "derivative formulas), once per storage; parameters and buffers excluded",
        "train_peak_bytes": "eager training step on {device}: forward, backward with gradients "
        "allocated as produced (zero_grad(set_to_none=True)), in-place torch.optim update",
        "forward_peak_bytes": "graphflop's forward graph in its own node order",
        "jvp_peak_bytes": "torch.func.jvp on {device} (eager forward-mode AD, attention on its "
        "math path: sdpa_kernel(SDPBackend.MATH)): each op's primal and tangent computed "
        "together and freed together as one dual tensor, with the kernels' temporaries (oneDNN "
        "convolution, batch_norm_jvp)",
    },
    "graph": {
        "saved_for_backward_bytes": "forward values graphflop's backward graph reads",
        "train_peak_bytes": "graphflop's forward, backward and update graphs in their own node "
        "order, gradients and optimizer state always live",
        "forward_peak_bytes": "graphflop's forward graph in its own node order",
        "jvp_peak_bytes": "graphflop's JVP graph in its own node order",
    },
}


@dataclass(frozen=True)
class EagerResiduals:
    """Attributes:
    remap: backward placeholder name -> the forward node names eager autograd keeps instead.
    sizes: forward node name -> bytes where eager's tensor differs (CPU dropout's float mask;
        fused attention's inner nodes, 0, and its logsumexp and converted mask).
    backward_sizes: backward node name -> bytes where eager's differs (the backward of a
        composite op, fused attention or a convolution as one kernel: 0 but for the gradients
        it returns; :func:`one_kernel_backward`).
    extra: forward node name -> bytes of a fused kernel's temporaries (fused attention).
    backward_extra: the same for backward nodes.
    backward_reads: backward node name -> the backward nodes a fused kernel keeps live until
        that node has run (:meth:`Schedule.add_graph`'s ``also_reads``).
    accumulate: forward node names whose ``sizes`` are in an accumulate dtype that autocast
        does not lower (fused attention's float32 logsumexp).
    reads: forward node name -> the forward nodes a composite op's kernel keeps live until
        that node has run (:func:`one_kernel_forward`).
    held: backward node name -> the forward node names eager autograd saves for the ATen op
        (:data:`ATEN_SAVES`) whose derivative that node completes (the last backward node its
        rule, or its decomposition's rules, made), beyond graphflop's residuals: live until
        that node has run.
    """

    remap: dict[str, list[str]]
    sizes: dict[str, int]
    backward_sizes: dict[str, int] = field(default_factory=dict)
    extra: dict[str, int] = field(default_factory=dict)
    backward_extra: dict[str, int] = field(default_factory=dict)
    backward_reads: dict[str, list[str]] = field(default_factory=dict)
    accumulate: frozenset[str] = frozenset()
    reads: dict[str, list[str]] = field(default_factory=dict)
    held: dict[str, list[str]] = field(default_factory=dict)


def _regions(forward: GraphModule, inner: bool = False) -> list[list[Node]]:
    """Each decomposed composite op's nodes: nodes with one region number, connected.
    ``inner``: fused attention's nodes as the composite ops it decomposes into (softmax)."""
    return composite_regions(forward.graph.nodes, inner)


def _saved_by(region: list[Node]) -> tuple[list[Node], Node | None, Node | None]:
    """(the nodes eager autograd saves for this op, its output 0, its mask output 1)."""
    tags = {n: n.meta[COMPOSITE] for n in region}
    op = tags[region[0]].op
    in_place = op in EAGER_SAVES_IN_PLACE and any(n.meta.get(INPLACE) for n in region)
    ins, outs = (EAGER_SAVES_IN_PLACE if in_place else EAGER_SAVES)[op]
    saved: list[Node] = []
    for k in outs:
        found = [n for n in region if tags[n].output == k]
        saved.extend(found[:1])
    for k in ins:
        for n in region:
            hit = [n.all_input_nodes[i] for i, kk in tags[n].inputs if kk == k]
            if hit:
                saved.append(hit[0])
                break
    out0 = next((n for n in region if tags[n].output == 0), None)
    mask = next((n for n in region if tags[n].output == 1), None)
    return saved, out0, mask


#: composite ops whose statistics outputs eager's CUDA kernels make in float32 for a 16-bit
#: input (``layer_norm_cuda``, ``batch_norm_cuda`` and cuDNN's: the accumulate type); their
#: CPU kernels (and ``native_group_norm`` on either) make them in the input's dtype, as
#: PyTorch's decompositions do, but where the weight is float32 and the input 16-bit
#: (``param_scalar_type``'s mixed type: :data:`MIXED_STATS`)
FLOAT_STATS_ON_CUDA = frozenset(
    {
        "aten.native_layer_norm.default",
        "aten.native_batch_norm.default",
        "aten._native_batch_norm_legit.default",
        "aten._native_batch_norm_legit.no_stats",
        "aten._native_batch_norm_legit_functional.default",
    }
)

#: composite ops whose statistics are float32 where the input is 16-bit and the weight float32
#: (``layer_norm_cpu``'s, ``native_group_norm``'s and ``batch_norm_cpu``'s
#: ``param_scalar_type(input, mixed_type)``):
#: op -> the weight's argument position
MIXED_STATS = {
    "aten.native_layer_norm.default": 2,
    "aten.native_group_norm.default": 1,
    # batch_norm_cpu's save_mean and save_invstd alike
    **{k: 1 for k in EAGER_SAVES if "batch_norm" in k},
}


def _input_dtype(region: list[Node], k: int) -> torch.dtype | None:
    """The dtype of the composite op's input ``k`` (None where no node of ``region`` reads
    it, or it has no tensor value)."""
    for n in region:
        for i, kk in n.meta[COMPOSITE].inputs:
            v = n.all_input_nodes[i].meta.get("val")
            if kk == k and isinstance(v, torch.Tensor):
                return v.dtype
    return None


def _eager_dtype(region: list[Node], dtype: torch.dtype, device: str) -> torch.dtype:
    """The dtype eager's kernel makes a saved output of the composite op ``region`` is a
    decomposition of in, where the decomposition makes it in ``dtype``: float32 for a 16-bit
    one where the weight is float32 (:data:`MIXED_STATS`) or on CUDA
    (:data:`FLOAT_STATS_ON_CUDA`), else ``dtype``."""
    if dtype.itemsize >= 4 or not dtype.is_floating_point:
        return dtype
    op = region[0].meta[COMPOSITE].op
    weight = MIXED_STATS.get(op)
    mixed = weight is not None and _input_dtype(region, weight) == torch.float32
    if mixed or (device == "cuda" and op in FLOAT_STATS_ON_CUDA):
        return torch.float32
    return dtype


def _saved_output_sizes(region: list[Node], saved: list[Node], device: str) -> dict[str, int]:
    """The saved outputs of the composite op (:data:`EAGER_SAVES`) the graph has whose eager
    dtype differs from the decomposition's (:func:`_eager_dtype`: group norm's statistics in
    float32 for a bfloat16 input with a float32 weight): node name -> eager's bytes."""
    _, outs = EAGER_SAVES[region[0].meta[COMPOSITE].op]
    sizes = {}
    for n in saved:
        tag, v = n.meta.get(COMPOSITE), n.meta.get("val")
        if tag is None or tag.output not in outs or not isinstance(v, torch.Tensor):
            continue
        dtype = _eager_dtype(region, v.dtype, device)
        if dtype != v.dtype:
            sizes[n.name] = v.numel() * dtype.itemsize
    return sizes


def _kept_whole_stat_sizes(nodes: Iterable[Node], device: str) -> dict[str, int]:
    """Of ``nodes``, training-mode batch norm kept whole
    (:data:`~graphflop.frontend.composite.KEPT_WHOLE`) with a 16-bit input: its mean and inverse std (``getitem`` 1 and 2) in float32 where the
    weight is float32 (``batch_norm_cpu``'s ``param_scalar_type``) or on CUDA (the accumulate
    type): node name -> eager's bytes, where they differ from the traced value's."""
    sizes = {}
    for n in nodes:
        if (
            n.op != "call_function"
            or n.target is not aten._native_batch_norm_legit_functional.default
        ):
            continue
        x, w = (a.meta.get("val") if isinstance(a, Node) else None for a in n.args[:2])
        if not isinstance(x, torch.Tensor) or x.dtype.itemsize >= 4:
            continue
        if device != "cuda" and not (isinstance(w, torch.Tensor) and w.dtype == torch.float32):
            continue
        for u in n.users:
            v = u.meta.get("val")
            if u.target is operator.getitem and u.args[1] in (1, 2) and isinstance(v, torch.Tensor):
                if v.dtype.itemsize < 4:
                    sizes[u.name] = v.numel() * 4
    return sizes


def _dropped_saves(region: list[Node], device: str) -> tuple[Node, int] | None:
    """The outputs eager autograd saves for this composite op (:data:`EAGER_SAVES`) that the
    graph no longer has (nothing in the forward read them: layer norm's mean and rstd in a
    16-bit dtype, casts of the float32 statistics back to the input's dtype): (an inner node of
    the decomposition that stands for them, their bytes at eager's dtype), or None where none
    was dropped. The stand-in, a value of the op's own kernel that holds nothing eagerly
    (:func:`one_kernel_forward`), is saved in their place: live until the op's backward has
    run, as eager's statistics are."""
    tag = region[0].meta[COMPOSITE]
    if tag.op not in EAGER_SAVES or not tag.outputs:
        return None
    tags = {n: n.meta[COMPOSITE] for n in region}
    _, outs = EAGER_SAVES[tag.op]
    have = {t.output for t in tags.values()}
    nbytes = 0
    for k in outs:
        if k in have or k >= len(tag.outputs):
            continue
        numel, dtype = tag.outputs[k]
        nbytes += numel * _eager_dtype(region, dtype, device).itemsize
    if not nbytes:
        return None
    for n in region:
        v = n.meta.get("val")
        target = n.target
        if (
            tags[n].output is None
            and isinstance(v, torch.Tensor)
            and isinstance(target, torch._ops.OpOverload)
            and not any(r.alias_info is not None for r in target._schema.returns)
            and not any(a.alias_info is not None for a in target._schema.arguments)
        ):
            return n, nbytes
    return None


@dataclass
class EagerForward:
    """The forward half of :func:`eager_residuals` (it does not read the backward graph).

    Attributes:
        saves: forward node name of a composite op -> the forward node names
            eager autograd saves for that op.
        sizes, reads: :attr:`EagerResiduals.sizes`, :attr:`EagerResiduals.reads`.
        kernels: the ops whose backward is one eager kernel: (their forward node names, the
            bytes of the kernel's temporaries) (:func:`one_kernel_backward`'s ``regions``).
        attention: the fused attention calls (``extra``, ``accumulate``).
        held: forward node name of an op of :data:`ATEN_SAVES` -> the forward node names eager
            autograd saves for it: a kept-whole op's node (:func:`aten_saves`), or each node
            of a decomposed one's region (reflection and replication padding).
        result_as: forward node name of a plain ATen op of :data:`RESULT_AS_INPUT` -> the
            forward node name of the input eager saves where graphflop's rule reads the output.
        input_as: forward node name of a plain ATen op of :data:`INPUT_AS_RESULT_IN_PLACE` the
            model ran in place -> the forward node name of the input graphflop's rule reads
            where eager saves the op's output.
        copied: the indices into ``kernels`` of the kernels that copy a non-contiguous output
            gradient (:data:`~graphflop.passes.eager_kernels.GRAD_OUTPUT_COPIED`; CPU only).
    """

    saves: dict[str, list[str]]
    sizes: dict[str, int]
    kernels: list[tuple[set[str], int]]
    reads: dict[str, list[str]]
    attention: FusedAttention
    held: dict[str, list[str]] = field(default_factory=dict)
    result_as: dict[str, str] = field(default_factory=dict)
    input_as: dict[str, str] = field(default_factory=dict)
    copied: frozenset[int] = frozenset()

    def stands_for(self, residual: str, reader: str) -> list[str]:
        """The forward node names eager keeps for forward value ``residual`` read by a backward
        node made by forward node ``reader``'s rule: what the composite op ``reader`` belongs
        to saves (:data:`~graphflop.frontend.composite.EAGER_SAVES`), the input a
        :data:`RESULT_AS_INPUT` op's own output stands for, the output an in-place
        :data:`INPUT_AS_RESULT_IN_PLACE` op's input stands for, or ``residual`` itself."""
        if reader in self.saves:
            return self.saves[reader]
        if reader == residual and reader in self.result_as:
            return [self.result_as[reader]]
        if self.input_as.get(reader) == residual:
            return [reader]
        return [residual]


def eager_forward(forward: GraphModule, device: str) -> EagerForward:
    """:class:`EagerForward` of ``forward`` (``device`` as :func:`eager_residuals`)."""
    saves: dict[str, list[str]] = {}  # forward node of a composite op -> what the op saves
    sizes: dict[str, int] = {}
    attention = FusedAttention(device)
    kernels: list[tuple[set[str], int]] = []  # composite ops whose backward is one kernel
    reads: dict[str, list[str]] = {}
    copied: set[int] = set()  # kernels that copy a non-contiguous output gradient
    held: dict[str, list[str]] = {}  # decomposed ops of ATEN_SAVES (one backward kernel: above)
    for region in _regions(forward):
        op = region[0].meta[COMPOSITE].op
        if op in CPU_FLOAT32_ONLY and (device != "cpu" or _input_dtype(region, 0) != torch.float32):
            continue  # not modelled there: graphflop's residuals
        if op in EAGER_SAVES:
            if device == "cpu" and op in GRAD_OUTPUT_COPIED:
                copied.add(len(kernels))
            tmp = backward_temporaries(region)
            if device == "cpu":
                tmp += weight_norm_workspace(region)
            kernels.append(({n.name for n in region}, tmp))
        if op == FUSED_SDPA:
            saved = attention.forward(region)
            if saved is None:  # the math path on this device: graphflop's residuals
                continue
        else:
            saved, out0, mask = _saved_by(region)
            f_sizes, f_reads = one_kernel_forward(region)
            sizes |= f_sizes
            reads |= f_reads
            float_mask = device == "cpu" and op in FLOAT_MASK_ON_CPU
            if float_mask and out0 is not None and mask is not None:
                itemsize = out0.meta["val"].element_size()
                sizes[mask.name] = mask.meta["val"].numel() * itemsize
            sizes |= _saved_output_sizes(region, saved, device)
            dropped = _dropped_saves(region, device)
            if dropped is not None:
                saved.append(dropped[0])
                sizes[dropped[0].name] = dropped[1]
        names = [m.name for m in saved]  # (one list for the region's nodes: read only)
        for n in region:
            saves[n.name] = names
        if op in _ATEN_SAVES_NAMES and CHECKPOINT not in region[0].meta and saved:
            # a decomposed op of ATEN_SAVES (reflection padding: its backward reads an index
            # made from constants, none of the values eager saves): held as a kept-whole one
            held |= {n.name: [m.name for m in saved] for n in region}
    sizes |= attention.sizes
    # the ops the rest reads, in graph order: one walk over the graph, then over these only
    ops = [
        n
        for n in forward.graph.nodes
        if n.op == "call_function" and id(n.target) in _EAGER_FORWARD_IDS
    ]
    kept_whole = aten_saves(ops)
    held |= kept_whole
    held |= computed_conv_weights(ops)
    # fused attention's and convolution_backward's backward: one kernel each too
    kernels += attention.regions
    kernels += [({n.name}, 0) for n in ops if _is_plain_conv(n)]
    # the ops of ATEN_SAVES: one backward kernel each (avg_pool2d_backward, gather_backward's
    # scatter_add into zeros, ...), where graphflop's rule unfolds the window (col2im)
    targets = {n.name: n.target for n in ops if n.name in kept_whole}
    for name in kept_whole:
        if device == "cpu" and str(targets[name]) in GRAD_OUTPUT_COPIED:
            copied.add(len(kernels))
        kernels.append(({name}, 0))
    # plain ATen ops whose eager backward is one kernel reading the saved result with the
    # gradient (ONE_KERNEL_BACKWARD): graphflop's rule makes a mask or coefficients first
    kernels += [
        ({n.name}, 0)
        for n in ops
        if n.target in ONE_KERNEL_BACKWARD and COMPOSITE not in n.meta and CHECKPOINT not in n.meta
    ]
    # batch norm's backward on the CPU: one native_batch_norm_backward, which allocates an
    # input-sized temporary beside the input's gradient (two empty_like of the input, one
    # freed before it returns: profiler allocator events, PyTorch 2.13 CPU)
    norms = [n for n in ops if n.target is aten._native_batch_norm_legit_functional.default]
    kernels += [
        ({n.name}, tensor_bytes(n.args[0].meta.get("val")) if device == "cpu" else 0) for n in norms
    ]
    sizes |= _kept_whole_stat_sizes(norms, device)
    result_as = {
        n.name: a.name
        for n in ops
        if n.target in RESULT_AS_INPUT
        and COMPOSITE not in n.meta  # (a composite op's part: EAGER_SAVES says what it saves)
        and CHECKPOINT not in n.meta  # (eager saves the region's inputs only, as aten_saves)
        and isinstance(a := n.args[RESULT_AS_INPUT[n.target]], Node)
    }
    input_as = {
        n.name: a.name
        for n in ops
        if n.target in INPUT_AS_RESULT_IN_PLACE
        and n.meta.get(INPLACE)
        and COMPOSITE not in n.meta
        and CHECKPOINT not in n.meta
        and isinstance(a := n.args[INPUT_AS_RESULT_IN_PLACE[n.target]], Node)
    }
    return EagerForward(
        saves, sizes, kernels, reads, attention, held, result_as, input_as, frozenset(copied)
    )


def aten_saves(forward: GraphModule | Iterable[Node]) -> dict[str, list[str]]:
    """The plain ATen ops of :data:`ATEN_SAVES` in ``forward`` (its graph's nodes, or the
    nodes given) -> the forward node names eager autograd saves for each (ops inside a checkpoint region left out: eager saves nothing there
    but the region's inputs; those of a composite op's decomposition too: :data:`EAGER_SAVES`
    says what eager saves for the op). Parameters, buffers and views of them have no storage of their
    own in the eager schedule (:func:`~graphflop.passes.memory.forward_storages`), so they are
    not counted; a value computed from a buffer (take_along_dim's wrapped index) is."""
    held: dict[str, list[str]] = {}
    for n in forward.graph.nodes if isinstance(forward, GraphModule) else forward:
        if n.op != "call_function" or n.target not in ATEN_SAVES:
            continue
        if CHECKPOINT in n.meta or COMPOSITE in n.meta:  # (a composite op's: EAGER_SAVES)
            continue
        ins, outs = ATEN_SAVES[n.target]
        names = [a.name for i in ins if i < len(n.args) and isinstance(a := n.args[i], Node)]
        names += [u.name for u in n.users if u.target is operator.getitem and u.args[1] in outs]
        if names:
            held[n.name] = names
    return held


def computed_conv_weights(forward: GraphModule | Iterable[Node]) -> dict[str, list[str]]:
    """Convolutions (of ``forward``'s graph, or among the nodes given) whose weight the model
    computes (a standardised or masked weight: not a parameter's placeholder) -> that weight's forward node name. Eager's
    ``convolution_backward(grad, input, weight, ...)`` is one formula for every input, so
    autograd saves the input and the weight whichever of them needs a gradient; graphflop's
    rule reads the weight only for the input's gradient (not made where the input needs none,
    the model's own input). The input is a residual of the weight's gradient anyway; the
    weight, where it is a parameter or a view of one, has no storage of its own
    (:func:`~graphflop.passes.memory.forward_storages`) and is not counted. Ops inside a
    checkpoint region are left out, as in :func:`aten_saves`."""
    held: dict[str, list[str]] = {}
    for n in forward.graph.nodes if isinstance(forward, GraphModule) else forward:
        if n.op != "call_function" or n.target is not aten.convolution.default:
            continue
        w = n.args[1]
        if CHECKPOINT in n.meta or not isinstance(w, Node) or w.op != "call_function":
            continue
        held[n.name] = [w.name]
    return held


def plain_ops(forward: GraphModule, kernels: list[tuple[set[str], int]]) -> frozenset[str]:
    """The forward nodes whose eager derivative is one autograd node of a plain ATen op
    (:func:`~graphflop.passes.eager_kernels.autograd_node_reads`): ``call_function`` nodes
    that are no composite op's part (:data:`~graphflop.meta.COMPOSITE`) and whose backward
    is no one-kernel region of ``kernels`` (:attr:`EagerForward.kernels`)."""
    one_kernel = set().union(*(names for names, _ in kernels))
    return frozenset(
        [
            n.name
            for n in forward.graph.nodes
            if n.op == "call_function" and COMPOSITE not in n.meta and n.name not in one_kernel
        ]
    )


def eager_residuals(forward: GraphModule, backward: GraphModule, device: str) -> EagerResiduals:
    """What eager autograd keeps in place of the residuals graphflop's backward reads.

    Args:
        device: ``cpu`` or ``cuda`` (dropout's mask: the input's dtype on CPU, bool on CUDA).
    """
    ef = eager_forward(forward, device)
    sizes, kernels, reads, attention = ef.sizes, ef.kernels, ef.reads, ef.attention
    b_sizes, b_reads, b_extra = one_kernel_backward(
        backward, kernels, scatters_in_place(backward), ef.copied
    )
    p_reads, p_extra = broadcast_product_backward(forward, backward)
    for k, names in p_reads.items():
        b_reads.setdefault(k, []).extend(names)
    # a plain op's eager backward node holds its output gradient and saved values to its end
    merge_reads(b_reads, autograd_node_reads(backward, plain_ops(forward, kernels).__contains__))
    for k, nbytes in p_extra.items():
        b_extra[k] = b_extra.get(k, 0) + nbytes
    # a residual read by the backward of a composite op's parts stands for what that op saves,
    # a division's quotient read by its own backward for its dividend (EagerForward.stands_for;
    # the backward nodes' SOURCE names the forward node whose rule made them)
    remap: dict[str, list[str]] = {}
    unread: list[str] = []  # residuals the backward does not read (a custom Function's)
    replayed = _replayed_draws(forward)
    indices = embedding_indices(forward)
    for p in backward.graph.nodes:
        if p.op != "placeholder" or not_saved(p, indices):
            continue
        src = p.meta.get(SOURCE, p.name)
        if src in replayed and all(u.meta.get(ROLE) == "recompute" for u in p.users):
            remap[p.name] = []  # a checkpoint's recompute redraws it from the saved RNG state
            continue
        stand: list[str] = []
        for u in p.users:
            for name in ef.stands_for(src, u.meta.get(SOURCE, "")):
                if name not in stand:
                    stand.append(name)
        if not p.users:
            unread.append(src)
        if stand != [src]:  # (a residual nothing reads stands for nothing)
            remap[p.name] = stand
    # a plain ATen op's saved values: held until the last backward node its rule made (where
    # eager's derivative of the op has run); an op whose output needs no gradient has none
    # (a decomposed op's nodes hold one list: held until the last of their backward nodes)
    last: dict[tuple[str, ...], str] = {}
    for n in backward.graph.nodes:
        if n.op == "call_function" and (src := n.meta.get(SOURCE)) in ef.held:
            last[tuple(ef.held[src])] = n.name
    held = {b: list(names) for names, b in last.items()}
    if unread:
        for b, names in _function_saves(forward, backward, unread).items():
            held.setdefault(b, []).extend(names)
    a = attention
    return EagerResiduals(
        remap,
        sizes,
        b_sizes,
        a.extra,
        b_extra,
        b_reads,
        frozenset(a.accumulate),
        reads,
        held,
    )


def _function_saves(
    forward: GraphModule, backward: GraphModule, unread: list[str]
) -> dict[str, list[str]]:
    """The values among ``unread`` (forward node names of residuals no backward node reads)
    that a custom ``autograd.Function`` saved (``ctx.save_for_backward`` or a ``ctx``
    attribute) though its ``backward`` does not read them: eager keeps them all the same, on
    the Function's backward node, until it has run. Backward node name of the last node of
    the Function's backward -> those forward node names."""
    by_name = {n.name: n for n in forward.graph.nodes}
    saved: dict[int, list[str]] = {}  # the Function call's region -> its unread saves
    for name in unread:
        tag = by_name[name].meta.get(FUNCTION) if name in by_name else None
        if tag is not None and tag.saved:
            saved.setdefault(tag.region, []).append(name)
    if not saved:
        return {}
    last: dict[int, str] = {}
    for n in backward.graph.nodes:
        src = by_name.get(n.meta.get(SOURCE, "")) if n.op == "call_function" else None
        tag = src.meta.get(FUNCTION) if src is not None else None
        if tag is not None and tag.region in saved:
            last[tag.region] = n.name
    return {last[r]: names for r, names in saved.items() if r in last}


def _merged(
    reads: dict[str, list[str]],
    held: dict[str, list[str]],
    stand_in: dict[str, list[str]] | None = None,
) -> dict[str, list[str]]:
    """``reads`` with :attr:`EagerResiduals.held` added as the forward's keys (``f:``), or as
    the keys ``stand_in`` gives for a held node."""
    out = {k: list(v) for k, v in reads.items()}
    for k, names in held.items():
        if stand_in and k in stand_in:
            out.setdefault(k, []).extend(stand_in[k])
        else:
            out.setdefault(k, []).extend(f"f:{x}" for x in names)
    return out


def _replayed_draws(forward: GraphModule) -> set[str]:
    """The random ops inside the model's ``torch.utils.checkpoint`` regions: eager saves the
    generator state (not counted, as ``saved_tensors_hooks`` do not see it) and redraws the
    same numbers in the recompute; graphflop's backward reads the forward's draw instead."""
    seeded = torch.Tag.nondeterministic_seeded
    return {
        n.name
        for n in forward.graph.nodes
        if CHECKPOINT in n.meta and seeded in getattr(n.target, "tags", ())
    }


def _residual_sources(
    forward: GraphModule, backward: GraphModule, eager: EagerResiduals
) -> dict[str, list[str]]:
    """Backward activation placeholder -> the forward node names it stands for, eagerly."""
    indices = embedding_indices(forward)
    return {
        p.name: eager.remap.get(p.name, [p.meta.get(SOURCE, p.name)])
        for p in backward.graph.nodes
        if p.op == "placeholder" and not not_saved(p, indices)
    }


def eager_saved_bytes(forward: GraphModule, backward: GraphModule, device: str = "cpu") -> int:
    """Bytes eager autograd saves for backward: the eager residuals, once per storage,
    parameters and buffers excluded (inputs and targets included)."""
    return sum(eager_saved_storages(forward, backward, device).values())


def eager_saved_storages(
    forward: GraphModule,
    backward: GraphModule,
    device: str = "cpu",
    *,
    eager: EagerResiduals | None = None,
    schedule: ComposedSchedule | None = None,
) -> dict[str, int]:
    """The storages :func:`eager_saved_bytes` counts: forward node name of the storage's
    owner (the node that allocated it) -> bytes.

    ``eager``: :func:`eager_residuals` of these graphs, where already made. ``schedule``: a
    :class:`~graphflop.passes.memory_calls.ComposedSchedule` of the eager train step
    (:func:`eager_train_schedule` with ``composed``), whose forward steps (``f:``) own the
    same storages: the owners are read from it, per call of a repeated block, instead of a
    schedule of the flat forward graph."""
    eager = eager or eager_residuals(forward, backward, device)
    held = [x for xs in eager.held.values() for x in xs]
    if schedule is not None:
        sources = {x for xs in _residual_sources(forward, backward, eager).values() for x in xs}
        sources.update(held)
        found = schedule.owners([f"f:{x}" for x in sources])
        return {o.split(":", 1)[1]: nb for o, nb in (v for v in found.values() if v is not None)}
    storage, size = forward_storages(forward, eager.sizes)
    seen = set()
    for names in [*_residual_sources(forward, backward, eager).values(), held]:
        for name in names:
            k = storage.get(name)
            if k is not None:
                seen.add(k)
    return {k.split(":", 1)[1]: size[k] for k in seen}


def _is_plain_conv(n: Node) -> bool:
    """A non-transposed ``aten.convolution``, grouped or not (the oneDNN path on CPU: grouped
    and depthwise convolutions allocate as ungrouped ones do, profiler allocator events)."""
    return n.op == "call_function" and n.target is aten.convolution.default and not n.args[6]


def _backend_format(conv: Node) -> torch.memory_format:
    """The memory format eager's CPU convolution computes in: channels-last where its input or
    its weight is channels-last (ATen ``determine_backend_memory_format`` for oneDNN), else
    contiguous."""
    for a in conv.args[:2]:
        v = a.meta.get("val") if isinstance(a, Node) else None
        if v is None or v.dim() not in (4, 5):
            continue
        fmt = torch.channels_last if v.dim() == 4 else torch.channels_last_3d
        if v.is_contiguous(memory_format=fmt) and not v.is_contiguous():
            return fmt
    return torch.contiguous_format


def _input_val(conv: Node) -> Any:
    """The ``val`` of a convolution's input (None where it has none)."""
    x = conv.args[0]
    return x.meta.get("val") if isinstance(x, Node) else None


def _copy_bytes(v: Any, fmt: torch.memory_format) -> int:
    """Bytes of ``v.contiguous(memory_format=fmt)``'s copy: 0 where ``v`` is already laid out
    so (``contiguous`` returns it), else its dense size."""
    if not isinstance(v, torch.Tensor) or v.dim() < 3 or v.is_contiguous(memory_format=fmt):
        return 0
    return tensor_bytes(v)


def conv_input_copy_bytes(conv: Node) -> int:
    """Bytes of the copy eager's CPU convolution makes of an input not laid out in its
    backend's memory format (a channel slice, a permuted view): ``input.contiguous(fmt)``,
    live while the forward kernel runs and again while its backward does (of the saved input)."""
    return _copy_bytes(_input_val(conv), _backend_format(conv))


def _weight_bytes(conv: Node) -> int:
    w = conv.args[1]
    return tensor_bytes(w.meta.get("val")) if isinstance(w, Node) else 0


def _onednn_path(conv: Node) -> str:
    """Which oneDNN kernels eager's CPU convolution runs (profiler allocator events, PyTorch
    2.13 CPU, AVX-512): ``blocked`` (channels in blocks: ungrouped, depthwise with one channel
    in and out per group, or grouped with multiples of 8 channels per group in and out),
    ``grouped_gemm`` (other grouped convolutions: blocked forward and input gradient, a GEMM
    weight gradient in the plain layout) or ``plain`` (one input channel per group and more
    out, a depthwise convolution with a channel multiplier: GEMM in the plain layout)."""
    x, y, g = _input_val(conv), conv.meta["val"], conv.args[8]
    if not isinstance(g, int) or g == 1 or x is None:
        return "blocked"
    cin, cout = x.shape[1], y.shape[1]
    if cin == cout == g or (cin // g % 8 == 0 and cout // g % 8 == 0):
        return "blocked"
    return "plain" if cin == g else "grouped_gemm"


def conv_forward_bytes(conv: Node) -> int:
    """Bytes of eager's CPU convolution's forward temporaries (oneDNN, ``mkldnn_convolution``):
    in its blocked layout, the input reordered into it (an input of a multiple of 16 channels;
    one of fewer is read as it is) and the weight reordered, live while the output is made into
    a buffer of that layout, then that buffer while it is copied into the output: the larger
    of the two; in the plain layout (:func:`_onednn_path`), the buffer only; in channels-last,
    the weight's reorder only. Plus :func:`conv_input_copy_bytes`."""
    x, y = _input_val(conv), conv.meta["val"]
    w = _weight_bytes(conv)
    copy = conv_input_copy_bytes(conv)
    if _backend_format(conv) != torch.contiguous_format:
        return w + copy
    if _onednn_path(conv) == "plain":
        return tensor_bytes(y) + copy
    reordered = tensor_bytes(x) if x is not None and x.dim() > 1 and x.shape[1] % 16 == 0 else 0
    return max(reordered + w, tensor_bytes(y)) + copy


@dataclass(frozen=True)
class ConvBackward:
    """What eager's CPU ``convolution_backward`` of one forward convolution allocates beyond
    its gradients, from the forward node alone (:func:`conv_backward`).

    Attributes:
        weight_stage_bytes: the temporaries beyond the gradients at the kernel's largest, (where
            it makes the weight gradient only, where it makes the input gradient too).
        input_copy_bytes: :func:`conv_input_copy_bytes`.
        out_shape: the convolution's output shape (its output gradient's).
        memory_format: the backend's memory format (:func:`_backend_format`).
    """

    weight_stage_bytes: tuple[int, int]
    input_copy_bytes: int
    out_shape: tuple[int, ...]
    memory_format: torch.memory_format


def conv_backward(conv: Node) -> ConvBackward:
    """:class:`ConvBackward` of forward convolution ``conv``.

    In oneDNN's blocked layout the kernel makes the input gradient first (the output gradient
    and the weight reordered, a buffer for the result, then that buffer copied into the
    gradient), then the weight gradient (the input and the output gradient reordered while a
    buffer of the weight's layout is made, then that buffer copied into the gradient): the
    latter is the larger, ``max(input + output, weight)`` beyond the gradients, but where the
    convolution is strided (ungrouped, or 32 or more output channels a group): its input
    gradient is copied once more as the kernel returns, the buffer, the gradient and the copy live together (``2·input - weight``
    beyond the gradients: the weight gradient is not made yet). A grouped convolution's GEMM weight
    gradient reorders nothing (``max(output, input - weight, weight)`` with the input
    gradient's stage: its reorders less the weight gradient); in the plain layout, the buffers
    only (``max(input - weight, weight)``). In channels-last, the weight gradient's buffer and
    its conversion to the weight's layout."""
    fmt = _backend_format(conv)
    x, y = _input_val(conv), conv.meta["val"]
    xb, yb, w = tensor_bytes(x), tensor_bytes(y), _weight_bytes(conv)
    path = _onednn_path(conv)
    # a strided convolution's input gradient is copied once more as it leaves the blocked
    # kernel: an ungrouped one's, or a grouped one's with 32 or more output channels a group
    # (measured: 8 and 16 are not copied, nor a depthwise one's)
    strided = isinstance(conv.args[3], (list, tuple)) and any(s != 1 for s in conv.args[3])
    g = conv.args[8] if isinstance(conv.args[8], int) else 1
    copied = strided and path == "blocked" and (g == 1 or y.shape[1] // g >= 32)
    gi = (2 if copied else 1) * xb  # the input gradient's buffer and copies
    if fmt != torch.contiguous_format:
        stage = (2 * w, 2 * w)
    elif path == "blocked":
        stage = (max(xb + yb, w), max(xb + yb, w, yb, gi - w))
    elif path == "grouped_gemm":
        stage = (w, max(yb, gi - w, w))
    else:
        stage = (w, max(gi - w, w))
    return ConvBackward(stage, conv_input_copy_bytes(conv), tuple(y.shape), fmt)


def conv_grad_output_copy_bytes(c: ConvBackward, made: list[Node]) -> int:
    """Bytes of the copy eager's CPU ``convolution_backward`` makes of an output gradient not
    laid out in its backend's memory format (``grad_output.contiguous(fmt)``: the expanded
    gradient of a sum, the permuted one of a permute), live while the whole backward kernel
    runs. ``made``: the backward nodes the convolution's transpose rule made; the output
    gradient is the cotangent they read from outside, of the convolution's output shape."""
    inside = set(made)
    for n in made:
        for a in n.all_input_nodes:
            v = a.meta.get("val")
            if a in inside or a.meta.get(KIND) != "cotangent" or not isinstance(v, torch.Tensor):
                continue
            if tuple(v.shape) == c.out_shape:
                return _copy_bytes(v, c.memory_format)
    return 0


def conv_backward_temporaries(c: ConvBackward, made: list[Node]) -> dict[str, int]:
    """Backward node name -> bytes of eager's CPU ``convolution_backward`` temporaries, for
    the backward nodes ``made`` (in graph order) of a forward convolution (``c``): the copies
    of a non-contiguous input and output gradient (:func:`conv_input_copy_bytes`,
    :func:`conv_grad_output_copy_bytes`), live through every convolution of its backward, and,
    at the last, the kernel's stages (:attr:`ConvBackward.weight_stage_bytes`)."""
    cs = [n for n in made if n.op == "call_function" and n.target is aten.convolution.default]
    if not cs:
        return {}
    copies = c.input_copy_bytes + conv_grad_output_copy_bytes(c, made)
    out = {n.name: copies for n in cs}
    input_grad = any(n.args[6] for n in cs)  # the input gradient: a transposed convolution
    out[cs[-1].name] += c.weight_stage_bytes[input_grad]
    return out


#: matrix products whose CPU kernel (``addmm_impl_cpu_``) hands its two operands to BLAS
BLAS_MATMULS = (aten.mm.default, aten.addmm.default)


def _blas_layout(v: torch.Tensor) -> bool:
    """Whether BLAS can read matrix ``v`` as it is laid out: row-major with a leading dimension
    of at least its column count, or column-major with one of at least its row count (ATen's
    ``addmm_impl_cpu_``; a size-1 row is no exception: a stride other than that is copied)."""
    rows, cols = v.shape
    s0, s1 = v.stride()
    return (s1 == 1 and s0 >= max(1, cols)) or (s0 == 1 and s1 >= max(1, rows))


def matmul_operand_copy_bytes(n: Node) -> int:
    """Bytes of the copies eager's CPU ``mm``/``addmm`` makes of operands BLAS cannot read as
    they are laid out (:func:`_blas_layout`: the expanded gradient of a sum or a mean, stride 0;
    a strided slice): ``clone(MemoryFormat::Contiguous)`` of each, live while the product is
    made (in a linear layer's backward, one per product: its input gradient's, then its weight
    gradient's). 0 for other nodes. Profiler allocator events, PyTorch 2.13 CPU, float32 and
    bfloat16 alike."""
    if n.op != "call_function" or n.target not in BLAS_MATMULS:
        return 0
    operands = n.args[:2] if n.target is aten.mm.default else n.args[1:3]
    total = 0
    for a in operands:
        v = a.meta.get("val") if isinstance(a, Node) else None
        if isinstance(v, torch.Tensor) and v.dim() == 2 and not _blas_layout(v):
            total += tensor_bytes(v)
    return total


@dataclass(frozen=True)
class ForwardKernels:
    """What :func:`kernel_temporaries` reads of a forward graph, in one walk over it (on CPU).

    Attributes:
        convs: the plain convolutions (:func:`_is_plain_conv`): node name -> node.
        composite: the names of the nodes of composite ops' decompositions.
        temporaries: forward node name -> bytes of its kernel's temporaries (the forward half
            of :func:`kernel_temporaries`).
    """

    convs: dict[str, Node]
    composite: frozenset[str]
    temporaries: dict[str, int]


def forward_kernels(forward: GraphModule) -> ForwardKernels:
    """:class:`ForwardKernels` of ``forward`` (the CPU kernels'; one walk over its nodes)."""
    convs: dict[str, Node] = {}
    composite: set[str] = set()
    mms: list[Node] = []
    mm, addmm, conv = aten.mm.default, aten.addmm.default, aten.convolution.default
    for n in forward.graph.nodes:
        if COMPOSITE in n.meta:
            composite.add(n.name)
        if n.op != "call_function":
            continue
        t = n.target
        if (t is mm or t is addmm) and COMPOSITE not in n.meta:
            mms.append(n)
        elif t is conv and _is_plain_conv(n):
            convs[n.name] = n
    fwd = {name: conv_forward_bytes(n) for name, n in convs.items()}
    for n in mms:
        if b := matmul_operand_copy_bytes(n):
            fwd[n.name] = fwd.get(n.name, 0) + b
    return ForwardKernels(convs, frozenset(composite), fwd)


def kernel_temporaries(
    forward: GraphModule,
    backward: GraphModule | None,
    device: str,
    *,
    kernels: ForwardKernels | None = None,
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of the temporaries eager kernels hold while they run: (forward node name -> bytes,
    backward node name -> bytes).

    On CPU, PyTorch runs a float convolution (grouped, depthwise or not) with oneDNN
    (``aten::mkldnn_convolution``), which computes into a buffer of its own layout and copies
    into the output: one output-sized temporary (none in channels-last), besides the copy of an
    input not laid out in the backend's memory format (:func:`conv_input_copy_bytes`). Its
    backward (``aten::convolution_backward``) copies such an input and such an output gradient
    (the expanded gradient of a sum) and reorders the input and the output gradient for the
    weight gradient (:func:`conv_backward_temporaries`). (Measured with the profiler's allocator
    events on PyTorch 2.13 CPU, ``tests/test_memory_eager.py``; oneDNN's backward-weights
    scratchpad, 10 to 30 KiB here, and its channel padding to a multiple of the vector width
    are not modelled.) A matrix product (``mm``, ``addmm``: a linear layer and its backward)
    copies an operand BLAS cannot read as laid out (:func:`matmul_operand_copy_bytes`), where
    it is not part of a composite op's decomposition (eager runs that op as one kernel). Other
    ops and CUDA (cuDNN workspaces, cuBLAS's copies are not modelled): none. ``kernels``:
    :func:`forward_kernels` of ``forward``, where made already (``forward`` is then not read).
    """
    bwd: dict[str, int] = {}
    if device != "cpu":
        return {}, bwd
    fk = kernels if kernels is not None else forward_kernels(forward)
    fwd = dict(fk.temporaries)
    if backward is None:
        return fwd, bwd
    convs, composite = fk.convs, fk.composite
    made: dict[str, list[Node]] = {}  # forward conv -> the backward nodes its rule made
    for n in backward.graph.nodes:
        if n.op == "call_function" and (src := n.meta.get(SOURCE)) in convs:
            made.setdefault(src, []).append(n)
    for src, nodes in made.items():
        bwd |= conv_backward_temporaries(conv_backward(convs[src]), nodes)
    for n in backward.graph.nodes:
        if n.meta.get(SOURCE) not in composite and (b := matmul_operand_copy_bytes(n)):
            bwd[n.name] = bwd.get(n.name, 0) + b
    return fwd, bwd


def temporaries_at(
    forward: GraphModule,
    backward: GraphModule,
    fwd_tmp: dict[str, int],
    bwd_tmp: dict[str, int],
    dtypes: dict[str, torch.dtype],
) -> tuple[dict[str, int], dict[str, int]]:
    """:func:`kernel_temporaries`' bytes with each kernel run in the dtype ``dtypes`` gives
    its forward op (autocast): a forward kernel's temporaries scaled by its op's itemsize
    against the traced one, a backward kernel's by those of the forward op whose rule made it
    (``SOURCE``: the backward of a half op runs in half). Ops ``dtypes`` does not name, and
    ops of no floating value, keep their bytes."""
    fnodes = {n.name: n for n in forward.graph.nodes}
    sources = {n.name: n.meta.get(SOURCE) for n in backward.graph.nodes}

    def at(name: str | None, nbytes: int) -> int:
        n = fnodes.get(name or "")
        v = n.meta.get("val") if n is not None else None
        if isinstance(v, (tuple, list)) and v:  # a multi-output op: its output 0's
            v = v[0]
        d = dtypes.get(name or "")
        if d is None or not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
            return nbytes
        return nbytes * d.itemsize // v.element_size()

    fwd = {k: at(k, b) for k, b in fwd_tmp.items()}
    bwd = {k: at(sources.get(k), b) for k, b in bwd_tmp.items()}
    return fwd, bwd


def _one_kernel_extra_at(
    forward: GraphModule,
    backward: GraphModule,
    extra: dict[str, int],
    dtypes: dict[str, torch.dtype],
) -> dict[str, int]:
    """:attr:`EagerResiduals.backward_extra` with each one-kernel backward's temporaries (batch
    norm's CPU one) at its op's dtype (:func:`temporaries_at`); fused attention's stay as
    they are, in the kernel's accumulate dtype (float32 under autocast too)."""
    fused = {
        n.name
        for n in forward.graph.nodes
        if getattr(n.meta.get(COMPOSITE), "op", None) == FUSED_SDPA
    }
    sources = {n.name: n.meta.get(SOURCE) for n in backward.graph.nodes}
    mine = {k: v for k, v in extra.items() if sources.get(k) not in fused}
    _, scaled = temporaries_at(forward, backward, {}, mine, dtypes)
    return extra | scaled


@overload
def eager_jvp_schedule(
    jvp: GraphModule, device: str = ..., composed: Literal[False] = ...
) -> Schedule: ...
@overload
def eager_jvp_schedule(
    jvp: GraphModule, device: str = ..., composed: bool = ...
) -> Schedule | ComposedSchedule: ...
def eager_jvp_schedule(
    jvp: GraphModule, device: str = "cpu", composed: bool = False
) -> Schedule | ComposedSchedule:
    """``torch.func.jvp`` run eagerly: graphflop's JVP graph in its order (each op's primal and
    tangent computed together, as forward-mode AD does, each freed when nothing reads it), the
    outputs of multi-output ops as separate storages, with the kernels' temporaries
    (:func:`kernel_temporaries`). A value and its tangent are one dual tensor in eager
    forward-mode AD: both are freed when the later of them is last read
    (:func:`dual_pairs`). Parameters and tangents are the baseline. ``composed``: where the
    JVP graph keeps its blocks as calls (:func:`~graphflop.passes.memory_calls.backward_runs`),
    a :class:`~graphflop.passes.memory_calls.ComposedSchedule` (the same peak, each block's
    steps worked out once per template)."""
    base = jvp_baseline(jvp)
    pairs = dual_pairs(jvp)
    sizes, extra, reads = jvp_overrides(jvp, device, pairs)
    runs = backward_runs(jvp) if composed else None
    s: Schedule | ComposedSchedule = Schedule()
    kw: dict[str, Any] = {}
    if runs is not None:
        s, kw = ComposedSchedule(), {"runs": runs}
    s.add_graph(
        jvp,
        "j",
        **kw,
        baseline=base,
        keep_outputs=True,
        eager=True,
        sizes=sizes,
        extra=extra,
        also_reads=reads,
    )
    names = {n.name for n in jvp.graph.nodes}
    for primal, tangents in pairs.items():
        if primal in names:
            s.ties.append([f"j:{primal}"] + [f"j:{t}" for t in tangents])
    return s


def jvp_baseline(jvp: GraphModule) -> set[str]:
    """The JVP graph's always-live placeholders: parameters, buffers, the tangent inputs."""
    return jvp.meta[SIGNATURE].state() | {t for t, _ in jvp.meta[JVP].tangent_inputs}


def jvp_overrides(
    jvp: GraphModule, device: str, pairs: dict[str, list[str]]
) -> tuple[dict[str, int], dict[str, int], dict[str, list[str]]]:
    """The eager JVP's per-node overrides of the memory model (sizes, kernel temporaries,
    the values a kernel or formula keeps live) for :meth:`Schedule.add_graph`, given
    :func:`dual_pairs` (``pairs``, which may name nodes outside ``jvp``: those of values
    read from outside a repeated block's template, :mod:`graphflop.passes.recorded_memory`)."""
    tmp, _ = kernel_temporaries(jvp, None, device)
    for name, nbytes in (_zero_tangent_convs(jvp, device) | zero_tangent_mms(jvp)).items():
        tmp[name] = tmp.get(name, 0) + nbytes
    sizes, norm_tmp, reads = _norm_jvp(jvp, pairs, device)
    a_sizes, a_tmp, a_reads = attention_jvp(jvp, _regions(jvp), pairs)
    sizes |= a_sizes
    norm_tmp |= a_tmp
    reads |= a_reads
    for name, held in formula_reads(jvp, sizes).items():
        reads[name] = reads.get(name, []) + held
    return sizes, tmp | norm_tmp, reads


def _zero_tangent_convs(jvp: GraphModule, device: str) -> dict[str, int]:
    """Tangent convolutions of a convolution whose input has no tangent (the first layer):
    eager forward-mode AD (``convolution_jvp``) still computes ``conv(input_t, weight)`` with
    the input's tangent materialised as zeros, so one input-sized and one output-sized
    tensor (besides the kernel's temporary) are live with the weight-tangent convolution's
    result (profiler allocator events, PyTorch 2.13 CPU). Node name -> bytes."""
    if device != "cpu":
        return {}
    by_source: dict[str, list[Node]] = {}
    for n in jvp.graph.nodes:
        if n.meta.get(KIND) == "tangent" and _is_plain_conv(n):
            by_source.setdefault(n.meta.get(SOURCE, ""), []).append(n)
    out = {}
    for convs in by_source.values():
        n = convs[0]
        x = n.args[0]
        if len(convs) == 1 and isinstance(x, Node) and x.meta.get(KIND) != "tangent":
            out[n.name] = tensor_bytes(x.meta["val"]) + tensor_bytes(n.meta["val"])
    return out


#: input-sized temporaries eager forward-mode AD holds at once besides a composite op's tangent
#: result (profiler allocator events, PyTorch 2.13 CPU): ``batch_norm_jvp`` (ATen
#: FunctionsManual.cpp, training mode) ``input - mean`` and the products and sums of its formula,
#: four; softmax (functorch's decomposition for its JVP: ``x - max``, ``exp`` and their
#: products), two, one of them freed before the result is made; dropout on CPU (its float mask
#: :data:`FLOAT_MASK_ON_CPU`, and one product), one; layer and group norm (``layer_norm_jvp``,
#: ``group_norm_jvp``), four, as batch norm; SiLU (its tangent as ``sigmoid``, a cast and the
#: products and sum of ``silu_backward``'s formula), five; GELU (one ``gelu_backward(x_t, x)``
#: kernel), none
JVP_TEMPORARIES = {
    **{k: 4 for k in EAGER_SAVES if "batch_norm" in k},
    "aten._softmax.default": 1,
    "aten.native_dropout.default": 1,
    "aten.native_layer_norm.default": 4,
    "aten.native_group_norm.default": 4,
    "aten.silu.default": 5,
    "aten.gelu.default": 0,
}


def _norm_jvp(
    jvp: GraphModule, pairs: dict[str, list[str]], device: str
) -> tuple[dict[str, int], dict[str, int], dict[str, list[str]]]:
    """Eager batch norm and softmax (also inside attention, which forward-mode AD runs on its
    math path) in a JVP graph: one kernel for the primal (the decomposition's inner nodes hold
    nothing) and one formula for the tangent (its inner tangent nodes hold nothing; its
    temporaries, :data:`JVP_TEMPORARIES`, are charged to the tangent result, which is also
    where the input and its tangent may be freed). Returns (sizes, extra, also_reads) for
    :meth:`Schedule.add_graph`."""
    sizes: dict[str, int] = {}
    extra: dict[str, int] = {}
    reads: dict[str, list[str]] = {}
    made = nodes_made_by(jvp)
    for region in _regions(jvp, inner=True):
        tags = {n: tag_of(n, True) for n in region}
        count = JVP_TEMPORARIES.get(tags[region[0]].op)
        if count is None or region[0].meta[COMPOSITE].op == FUSED_SDPA:  # attention_jvp's
            continue
        names = {n.name for n in region}
        x = next((n.all_input_nodes[i] for n in region for i, k in tags[n].inputs if k == 0), None)
        out0 = [n.name for n in region if tags[n].output == 0]
        # a composite op kept whole: its rule (the multi-output node's) made output 0's tangent
        out0 += [
            n.all_input_nodes[0].name
            for n in region
            if tags[n].output == 0
            and n.target is operator.getitem
            and n.all_input_nodes[0] in region
        ]
        keep = {t for o in out0 for t in pairs.get(o, [])}
        for n in region:
            if tags[n].output is None:
                sizes[n.name] = 0
            elif tags[n].output == 1 and device == "cpu" and tags[n].op in FLOAT_MASK_ON_CPU:
                sizes[n.name] = n.meta["val"].numel() * x.meta["val"].element_size()  # type: ignore[union-attr]
        inner_t = [n for n in made(names) if n.meta.get(KIND) in TANGENT_FORMULA]
        for n in inner_t:
            if n.name not in keep:
                sizes[n.name] = 0
        result = [n for n in inner_t if n.name in keep]
        if x is not None and result:
            extra[result[-1].name] = count * tensor_bytes(x.meta["val"])
            others = [n.name for n in region if tags[n].output not in (None, 0)]  # dropout's mask
            reads[result[-1].name] = [x.name] + pairs.get(x.name, []) + others
    return sizes, extra, reads


def dual_pairs(jvp: GraphModule) -> dict[str, list[str]]:
    """Forward node name -> the JVP graph's nodes holding its tangent: the tangent nodes its
    rule made (``SOURCE``) that something outside the rule reads (or the graph returns)."""
    pairs: dict[str, list[str]] = {}
    for n in jvp.graph.nodes:
        if n.meta.get(KIND) != "tangent" or n.op == "placeholder":
            continue
        src = n.meta.get(SOURCE)
        if any(u.op == "output" or u.meta.get(SOURCE) != src for u in n.users):
            pairs.setdefault(src, []).append(n.name)
    return pairs


_SCATTERS = (
    aten.index_put.default,
    aten.index_add.default,
    aten.scatter_add.default,
    aten.scatter.src,
    aten.slice_scatter.default,
    aten.select_scatter.default,
)
_FRESH = (aten.full.default, aten.zeros.default, aten.zeros_like.default, aten.full_like.default)


def scatters_in_place(backward: GraphModule) -> set[str]:
    """Backward nodes that scatter into a fresh zeros tensor nothing else reads: eager
    backward kernels (``embedding_dense_backward``, ``index_add_``, ``select_backward``,
    ``slice_backward``, max pooling's) fill one zeroed gradient in place, where graphflop's
    graph makes the zeros and an out-of-place result."""
    out = set()
    for n in backward.graph.nodes:
        if n.op != "call_function" or n.target not in _SCATTERS:
            continue
        base = n.args[0]
        if isinstance(base, Node) and base.target in _FRESH and len(base.users) == 1:
            out.add(n.name)
    return out


def optimizer_temporaries(optimizer: str, param_bytes: list[int], device: str) -> int:
    """Peak bytes of the temporaries ``torch.optim``'s update makes beyond parameters,
    gradients and state (torch/optim/adam.py, sgd.py). On CPU the single-tensor loop runs
    (foreach is the default only for CUDA tensors): Adam/AdamW's ``exp_avg_sq.sqrt() / bc``
    holds two tensors of one parameter's size; SGD and momentum update in place. On CUDA the
    foreach kernels: Adam/AdamW's ``_foreach_sqrt`` makes one tensor per parameter; SGD and
    momentum in place."""
    if optimizer not in ("adam", "adamw") or not param_bytes:
        return 0
    return 2 * max(param_bytes) if device == "cpu" else sum(param_bytes)


def leaf_lifetimes(backward: GraphModule) -> tuple[set[str], list[str]]:
    """(the backward's output nodes that are gradients of leaves the model made, the forward
    keys of those leaves): eager autograd keeps such a leaf (``requires_grad_()`` on a value
    that depends on no trainable parameter) in the autograd graph's ``AccumulateGrad`` node,
    and its gradient in the leaf's ``.grad``, until the graph is freed with the loss, after
    the backward: both live to the backward's end whether or not the backward reads the leaf,
    and neither into the optimizer step (:attr:`~graphflop.meta.VjpInfo.leaf_grads`)."""
    info = backward.meta.get(VJP)
    if info is None or not info.leaf_grads:
        return set(), []
    out = next(n for n in reversed(backward.graph.nodes) if n.op == "output")
    released = {out.args[0][pos].name for pos, _ in info.leaf_grads}
    return released, [f"f:{name}" for _, name in info.leaf_grads]


def ungraded_nodes(backward: GraphModule) -> frozenset[str]:
    """Names of the backward's nodes eager autograd never makes: those that do not depend on
    the loss cotangent and are read only by such nodes and the graph's output, the zero fills
    graphflop's backward gives a parameter (or a model input, a leaf the model made) no
    gradient reaches (:func:`~graphflop.passes.optimizer.gradient_free`): eager autograd
    leaves its ``.grad`` None (measured, ``tests/test_memory_eager.py``: an unused trainable
    ``Linear``'s weight adds no bytes to the train peak). Empty where the backward stops at
    ops without a transpose rule (``GAPS``), as :func:`gradient_free` is; in a recorded top
    level, a call's values are taken as made (their call reads the cotangent or not as a
    whole)."""
    if backward.meta.get(GAPS):
        return frozenset()
    info = backward.meta.get(VJP)
    if info is None:
        return frozenset()
    live: set[Node] = set()
    for n in backward.graph.nodes:
        if n.op != "output" and (
            n.name == info.cotangent_input or not live.isdisjoint(n._input_nodes)
        ):
            live.add(n)
    needed = set(live)
    for n in reversed(backward.graph.nodes):
        if n.op == "output" or n in needed:
            continue
        if not needed.isdisjoint(n.users):
            needed.add(n)
    return frozenset(
        n.name for n in backward.graph.nodes if n.op == "call_function" and n not in needed
    )


def rng_state_bytes(calls: int) -> int:
    """Bytes ``torch.utils.checkpoint``'s RNG bookkeeping adds to the train peak for ``calls``
    checkpoint calls (``preserve_rng_state=True``, the default): each call keeps the CPU
    generator's state (``torch.get_rng_state()``, 5,056 B in PyTorch 2.13) until its backward,
    and its recompute runs under ``torch.random.fork_rng``, which holds one more copy while it
    runs (one recompute at a time): ``(calls + 1)`` states, 0 for no call. Counted as live
    throughout the step (an upper bound where the peak is elsewhere). Measured (profiler
    allocator events, PyTorch 2.13 CPU): a Linear-GELU-Linear block in a checkpoint, 11,456 B
    against 1,760 B without it."""
    return torch.get_rng_state().numel() * (calls + 1) if calls else 0


def checkpoint_calls(forward: GraphModule) -> int:
    """The number of ``torch.utils.checkpoint`` calls the model made in ``forward``
    (:func:`~graphflop.meta.occurrences` of :data:`~graphflop.meta.CHECKPOINT`), those whose
    outputs eager gives no derivative (``detached``: their autograd node is freed at once)
    left out."""
    calls = occurrences(forward.graph.nodes, CHECKPOINT)
    return len({c for n, c in calls.items() if not n.meta[CHECKPOINT].detached})


def graded_sizes(
    forward: GraphModule, backward: GraphModule, ungraded: Set[str] | None = None
) -> list[int]:
    """Bytes of each trainable parameter of ``forward`` that ``backward`` gives a gradient
    (those whose gradient output is not one of ``ungraded``, default
    :func:`ungraded_nodes` of ``backward``): the parameters ``torch.optim`` updates (it skips
    ``.grad`` None), whose sizes its temporaries follow (:func:`optimizer_temporaries`)."""
    if ungraded is None:
        ungraded = ungraded_nodes(backward)
    info = backward.meta.get(VJP)
    skipped: set[str] = set()
    if info is not None and ungraded:
        out = next(n for n in reversed(backward.graph.nodes) if n.op == "output")
        outs = out.args[0]
        assert isinstance(outs, (tuple, list)), "a backward graph outputs a tuple of gradients"
        skipped = {
            q for pos, q in info.grads if isinstance(outs[pos], Node) and outs[pos].name in ungraded
        }
    phs = {n.name: n for n in forward.graph.find_nodes(op="placeholder")}
    sig = forward.meta[SIGNATURE]
    return [tensor_bytes(phs[p].meta["val"]) for p, q in sig.trainable() if q not in skipped]


@overload
def eager_train_schedule(
    forward: GraphModule,
    backward: GraphModule,
    optimizer: str,
    device: str = ...,
    keep_grads: bool = ...,
    composed: Literal[False] = ...,
    eager: EagerResiduals | None = ...,
    stand_in: dict[str, list[str]] | None = ...,
    dtypes: dict[str, torch.dtype] | None = ...,
    hold_inputs: bool = ...,
) -> Schedule: ...
@overload
def eager_train_schedule(
    forward: GraphModule,
    backward: GraphModule,
    optimizer: str,
    device: str = ...,
    keep_grads: bool = ...,
    composed: bool = ...,
    eager: EagerResiduals | None = ...,
    stand_in: dict[str, list[str]] | None = ...,
    dtypes: dict[str, torch.dtype] | None = ...,
    hold_inputs: bool = ...,
) -> Schedule | ComposedSchedule: ...
def eager_train_schedule(
    forward: GraphModule,
    backward: GraphModule,
    optimizer: str,
    device: str = "cpu",
    keep_grads: bool = False,
    composed: bool = False,
    eager: EagerResiduals | None = None,
    stand_in: dict[str, list[str]] | None = None,
    dtypes: dict[str, torch.dtype] | None = None,
    hold_inputs: bool = False,
) -> Schedule | ComposedSchedule:
    """The eager training step's live storages (see the module docstring); parameters and
    optimizer state are the baseline, not scheduled; gradients are scheduled, or, with
    ``keep_grads`` (``zero_grad(set_to_none=False)``), are baseline buffers the backward
    accumulates into: each gradient the backward makes lives only while it is added.

    ``composed``: where the forward or the backward graph keeps its repeated blocks as calls
    (:func:`~graphflop.passes.memory_calls.forward_runs`,
    :func:`~graphflop.passes.memory_calls.backward_runs`), a
    :class:`~graphflop.passes.memory_calls.ComposedSchedule` that works out each block's steps
    once per template (the same :meth:`~ComposedSchedule.peak` to the byte); otherwise, and
    without ``composed``, the flat :class:`Schedule`. ``eager``: :func:`eager_residuals` of
    these graphs, where already made. ``stand_in``: backward residual placeholder, or backward
    node of :attr:`EagerResiduals.held` -> the schedule keys it reads instead of the forward's
    values (a what-if's recomputed values, :mod:`graphflop.passes.checkpoint`; the casts
    autocast saves, :mod:`graphflop.passes.amp`), parameters' placeholders included.
    ``dtypes``: forward node name -> the dtype its kernel runs in, where a what-if changes it
    (autocast, :func:`graphflop.passes.amp.amp_dtypes`): the kernels' temporaries
    (:func:`kernel_temporaries`) at that dtype (:func:`temporaries_at`); the values' sizes
    come with ``eager``. ``hold_inputs``: the model's inputs and the loss's targets live to
    the backward's end, as the caller of a training step holds them (the measurement counts
    them live throughout), rather than freed after their last reader: the same wherever
    autograd saves them, not where a what-if saves a copy instead (autocast's cast of the
    input)."""
    eager = eager or eager_residuals(forward, backward, device)
    sig = forward.meta[SIGNATURE]
    state = sig.state()
    fwd_tmp, bwd_tmp = kernel_temporaries(forward, backward, device)
    if dtypes is not None:
        fwd_tmp, bwd_tmp = temporaries_at(forward, backward, fwd_tmp, bwd_tmp, dtypes)
    released, held = leaf_lifetimes(backward)
    if hold_inputs:
        held += [f"f:{x}" for x in (*sig.inputs, *sig.targets)]
    # the zero fills of what no gradient reaches: eager makes none (.grad stays None)
    ungraded = ungraded_nodes(backward)
    if keep_grads:  # AccumulateGrad adds each new gradient into .grad in place and frees it
        out = next(n for n in backward.graph.nodes if n.op == "output")
        for a in out.all_input_nodes:
            if a.name not in released and a.name not in ungraded:  # (a leaf: new each step)
                bwd_tmp[a.name] = bwd_tmp.get(a.name, 0) + tensor_bytes(a.meta.get("val"))
    f_runs = forward_runs(forward) if composed else None
    b_runs = backward_runs(backward) if composed else None
    # a plain ATen op's saved values (EagerResiduals.held) are read by a backward node as keys
    # of the forward's: a top-level step reads them as it reads any key; in a repeated block,
    # the flat schedule (a call's profile could not stand for its reads)
    if b_runs and eager.held and any(n.name in eager.held for _, run in b_runs for n in run):
        f_runs = b_runs = None
    s: Schedule | ComposedSchedule = Schedule()
    f_kw: dict[str, Any] = {}
    b_kw: dict[str, Any] = {}
    if f_runs is not None or b_runs is not None:
        s = ComposedSchedule()
        f_kw["runs"] = f_runs or []
        b_kw["runs"] = b_runs or []
    b_extra = eager.backward_extra
    if dtypes is not None:
        b_extra = _one_kernel_extra_at(forward, backward, b_extra, dtypes)
    for k, v in b_extra.items():
        bwd_tmp[k] = bwd_tmp.get(k, 0) + v
    fwd_tmp |= eager.extra
    unstored = s.add_graph(
        forward,
        "f",
        **f_kw,
        baseline=state,
        eager=True,
        sizes=eager.sizes,
        extra=fwd_tmp,
        also_reads=eager.reads,
    )
    ext: dict[str, str | list[str]] = {}
    base_b = set()
    indices = embedding_indices(forward)
    for n in backward.graph.nodes:
        if n.op == "placeholder" and n.meta.get(RESIDUAL) is not None:
            if stand_in is not None and n.name in stand_in:  # (a parameter's saved cast)
                ext[n.name] = list(stand_in[n.name])
            # a value computed from parameters that eager saves is the forward's: held from
            # where it is made; one that is a view of a parameter, always live, as they are
            elif keys := residual_keys(n, state, not not_saved(n, indices), eager.remap, unstored):
                ext[n.name] = keys
            else:
                base_b.add(n.name)
    s.add_graph(
        backward,
        "b",
        **b_kw,
        baseline=base_b,
        external=ext,
        keep_outputs=not keep_grads,
        free_outputs=keep_grads,
        eager=True,
        sizes=eager.backward_sizes | dict.fromkeys(ungraded, 0),
        extra=bwd_tmp,
        also_reads=_merged(eager.backward_reads, eager.held, stand_in or {}),
        inplace=scatters_in_place(backward),
        released=released,
        held=held,
    )
    sizes = graded_sizes(forward, backward, ungraded)
    s.add_transient("u:optimizer", optimizer_temporaries(optimizer, sizes, device))
    return s
