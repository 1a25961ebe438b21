"""Time pass: every node's predicted seconds on one device, and their roll-up per phase, role,
module and op (:class:`~graphflop.report.TimeReport`).

One **eager kernel** at a time: eager PyTorch runs a composite op (layer norm, softmax, GELU,
batch norm, fused attention, cross-entropy's pieces: the ops
:mod:`graphflop.frontend.composite` tags) as one kernel where graphflop's graph holds its
decomposition, and runs that op's backward (or its tangent formula) as one kernel too. So the
nodes of one decomposition, and the nodes derived from it (``SOURCE`` in the decomposition: its backward's
cotangents and coefficients, or its tangent formula), are timed as one kernel: one launch overhead, and the bytes the
kernel reads from outside and writes for outside, not the decomposition's temporaries. Every
other node is its own kernel. A kernel's time is

    max(compute_s, memory_s) + overhead_s
    compute_s = matrix FLOPs / achieved matmul-or-conv FLOP/s
                + transcendental elements / achieved rate + other FLOPs / achieved FLOP/s
    memory_s  = bytes read and written / achieved bandwidth

with the achieved rates of a :class:`~graphflop.passes.time_profile.TimeProfile` at the
kernel's size, in the dtype of its inputs (under autocast, matrix products and convolutions in
the autocast dtype, and each value's bytes at the dtype autocast gives it,
:func:`graphflop.passes.amp.amp_dtypes`; parameters, their gradients and the update stay
float32; a float32 product or convolution at the profile's ``tf32`` rate where it has one for
its class, :meth:`~graphflop.passes.time_profile.TimeProfile.product_dtype`: on a data-sheet
NVIDIA GPU from Ampere on, convolutions, as cuDNN runs them by default). The bound is
the largest of the three terms. Each node of a kernel carries its share of the kernel's time
(by FLOPs for a compute-bound kernel, by bytes for a memory-bound one, evenly for an
overhead-bound one), so sums over nodes are sums over kernels.

On an asynchronous device (a GPU profile, :attr:`TimeProfile.kind` ``"gpu"``) the host issues
kernels while earlier ones run, so a phase is not the sum of its kernels: the phase's time is
the end of a two-clock timeline over its nodes in graph order, the host's clock advancing by
each node's overhead (the host's per-op cost) and the device's by its work
(``max(compute_s, memory_s)``), a kernel starting when both the host has issued it and the
device has finished the one before: ``host += overhead_s; device = max(device, host) + work``,
the phase ``max(host, device)``, synchronised at its end. What the two clocks overlap is
:attr:`~graphflop.report.PhaseTime.overlap_s`. A step of small kernels is then bound by the
host (its overheads' sum), one of large kernels by the device (its work's sum).

Host time beyond the kernels (a calibrated profile's ``module_call_s`` and
``autograd_node_s``) is a phase's, not a node's (:attr:`~graphflop.report.PhaseTime.host_s`):
each ``nn.Module`` call of a pass that runs the forward (entering a module path, or entering it
again, in graph order: ResNet's ``relu`` module called twice per block counts twice; the model
itself once; not the loss, graphflop's objective), placed at the call's first node, and in the
backward each autograd node (one per forward op whose floating output depends on a trained
parameter, views included, a composite op's decomposition counting once, and one
``AccumulateGrad`` per parameter), spread evenly over the backward's nodes (on a GPU the host's
clock advances there).

A node the model computed in place (``INPLACE``: ``nn.ReLU(inplace=True)``) moves its bytes at
the in-place bandwidth and allocates nothing (no page faults).

A node whose op has no cost rule (``COST`` 0, listed as uncounted) is timed at the bytes of
its tensors (each tensor input read, its output written, from their metadata; none for an
op whose outputs alias its inputs) on the memory roofline, with no compute and one launch,
not as a view; ``NodeTime.no_cost_rule`` marks it, and the phases and ops it is in say so
(``PhaseTime.complete``, ``PhaseTime.no_cost_rule``, ``OpTime.no_cost_rule``).

Every breakdown of a phase (per op, per role, per module, the loss, a what-if's rerun) is its
kernels' seconds × the phase's seconds / the sum of the phase's kernels' seconds
(:func:`_share`): on a GPU its share of the overlap comes off, with host costs its share of
them goes on, so the rows add up to the phase. The loss phase is the loss kernels' share of
the forward.

Reads ``val``, ``COST``, ``COMPOSITE``, ``SOURCE``, ``KIND``, ``ROLE``, ``MODULE``, ``INPLACE``; writes
``TIME`` (:class:`~graphflop.meta.NodeTime`) on every ``call_function`` node it times.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from graphflop.meta import (
    BOUNDS,
    COMPOSITE,
    COST,
    INPLACE,
    KIND,
    MODULE,
    PARAM,
    ROLE,
    SOURCE,
    TIME,
    UPDATE,
    ZERO_COST,
    NodeTime,
)
from graphflop.ops import has_rule, op_name
from graphflop.passes.eager_kernels import is_view
from graphflop.passes.eager_memory import _regions, scatters_in_place
from graphflop.passes.flops import read_shares, rule_cost, tensor_bytes
from graphflop.passes.summary import Graphs
from graphflop.passes.time_profile import BACKWARD_SUFFIX, THIN_ROWS, TimeProfile
from graphflop.report import LayerRow, LayerTime, OpTime, PhaseTime, Report, TimeReport

__all__ = ["UPDATE_KERNEL", "Kernel", "annotate_time", "eager_kernels", "time_report"]

#: autocast dtype names -> dtype keys
_AMP = {"bf16": "bfloat16", "fp16": "float16", "bfloat16": "bfloat16", "float16": "float16"}


#: forward convolutions whose backward eager PyTorch runs as one ``convolution_backward``
_CONVOLUTIONS = (torch.ops.aten.convolution.default,)

_aten = torch.ops.aten
#: forward ops whose derivative eager PyTorch runs as one kernel (tools/autograd/
#: derivatives.yaml): ReLU's ``threshold_backward(grad, result, 0)``, where graphflop's rule
#: writes a comparison and a select; a max-pool's ``max_pool2d_with_indices_backward``, where it
#: writes zeros and a scatter; 3-D adaptive average pooling's ``_adaptive_avg_pool3d_backward``,
#: where it writes window bounds, divides, zeros and an ``index_add`` per dim; randomized leaky
#: ReLU's ``rrelu_with_noise_backward`` (one ``mul`` by the noise in training, one
#: ``leaky_relu_backward`` in evaluation, where graphflop's rule writes a mask, its coefficient
#: and a product); the others' ``X_backward`` kernels
ONE_BACKWARD_KERNEL = frozenset(
    {
        _aten.relu.default,
        _aten.threshold.default,
        _aten.hardtanh.default,
        _aten.hardswish.default,
        _aten.hardsigmoid.default,
        _aten.leaky_relu.default,
        _aten.sigmoid.default,
        _aten.tanh.default,
        _aten.max_pool2d_with_indices.default,
        _aten.max_pool3d_with_indices.default,
        _aten.avg_pool2d.default,
        _aten._adaptive_avg_pool2d.default,
        _aten._adaptive_avg_pool3d.default,
        _aten.rrelu_with_noise.default,
        _aten.rrelu_with_noise_functional.default,
    }
)

#: the kernel name of one parameter's optimizer update
UPDATE_KERNEL = "optimizer.update"


@dataclass
class Kernel:
    """One eager kernel of a graph: its nodes (in graph order), its name, and whether it is a
    forward op (not a backward or tangent kernel derived from one)."""

    name: str
    nodes: list[Node]
    forward: bool = True
    variant: str | None = None

    def keys(self) -> tuple[str, ...]:
        """The keys a profile's per-kernel tables (``kernels``, ``fixed``) hold this kernel
        under, most specific first: its variant, then its op name, each with
        :data:`~graphflop.passes.time_profile.BACKWARD_SUFFIX` for a derivative's kernel."""
        suffix = "" if self.forward else BACKWARD_SUFFIX
        return tuple(f"{k}{suffix}" for k in (self.variant, self.name) if k)


def _variant(region: list[Node], op: str) -> str | None:
    """A composite op's variant: its name and the transcendental ops its decomposition runs
    (``aten.gelu.default[tanh]`` for the tanh approximation, ``[erf]`` for the exact one:
    eager PyTorch runs them at different speeds), None when it runs none."""
    names = sorted(
        {
            op_name(n.target).split(".")[1]
            for n in region
            if n.meta.get(COST, ZERO_COST).transcendentals
        }
    )
    return f"{op}[{'+'.join(names)}]" if names else None


def _region_of(forward: GraphModule) -> dict[str, tuple[int, str, str | None]]:
    """Forward node name -> (its composite op's occurrence number, the composite op, its
    variant)."""
    out: dict[str, tuple[int, str, str | None]] = {}
    for i, region in enumerate(_regions(forward)):
        op = region[0].meta[COMPOSITE].op
        variant = _variant(region, op)
        for n in region:
            out[n.name] = (i, op, variant)
    return out


def eager_kernels(gm: GraphModule, forward: GraphModule) -> list[Kernel]:
    """``gm``'s ``call_function`` nodes (``getitem`` left out) grouped into the kernels eager
    PyTorch runs: one per composite op occurrence of ``forward`` for its primal nodes (its
    forward) and one for the nodes derived from it (its backward's cotangents and the
    coefficients they need, or its tangent formula); one per forward convolution for the
    backward nodes derived from it (eager PyTorch's ``convolution_backward``: the input,
    weight and bias gradients and the transposes they need, in one op); one per forward op of
    :data:`ONE_BACKWARD_KERNEL` for the backward nodes derived from it; one per parameter's
    optimizer update
    (:data:`UPDATE_KERNEL`: ``torch.optim``'s single-tensor step updates each parameter in
    place, SGD's with one ``add_`` that reads the parameter and its gradient and writes the
    parameter, where graphflop's update graph makes new tensors; timed at the profile's
    measured ``torch.optim`` step for the graph's optimizer where it has one (momentum and
    Adam run several in-place ops per parameter), else at its in-place bandwidth); one per
    other node; in the order of each kernel's first node."""
    region_of = _region_of(forward)
    convs = {n.name for n in forward.graph.nodes if n.target in _CONVOLUTIONS}
    one_bwd = {
        n.name: op_name(n.target) for n in forward.graph.nodes if n.target in ONE_BACKWARD_KERNEL
    }
    kernels: dict[object, Kernel] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        hit = region_of.get(n.meta.get(SOURCE, ""))
        backward = n.meta.get(KIND) in ("cotangent", "coef")
        key: object
        if backward and n.meta.get(SOURCE) in convs and n.meta.get(ROLE) != "update":
            # eager PyTorch's convolution_backward: input, weight and bias gradients at once
            key = ("convolution_backward", n.meta[SOURCE], n.meta.get(ROLE) == "recompute")
            if key not in kernels:
                kernels[key] = Kernel(op_name(torch.ops.aten.convolution.default), [], False)
            kernels[key].nodes.append(n)
        elif backward and n.meta.get(SOURCE) in one_bwd and n.meta.get(ROLE) != "update":
            # eager PyTorch's one derivative kernel of the op (threshold_backward, ...)
            key = ("one_backward", n.meta[SOURCE], n.meta.get(ROLE) == "recompute")
            if key not in kernels:
                kernels[key] = Kernel(one_bwd[n.meta[SOURCE]], [], False)
            kernels[key].nodes.append(n)
        elif n.meta.get(ROLE) == "update" and n.meta.get(KIND) == "update":
            key = ("update", n.meta.get(SOURCE))
            if key not in kernels:
                kernels[key] = Kernel(UPDATE_KERNEL, [])
            kernels[key].nodes.append(n)
        elif hit is not None:
            kind = "primal" if n.meta.get(KIND) in (None, "primal") else "derivative"
            key = (hit[0], kind, n.meta.get(ROLE) == "recompute")
            if key not in kernels:
                kernels[key] = Kernel(hit[1], [], forward=kind == "primal", variant=hit[2])
            kernels[key].nodes.append(n)
        else:
            primal = n.meta.get(KIND) in (None, "primal")
            kernels[n] = Kernel(op_name(n.target), [n], forward=primal)
    return list(kernels.values())


def _dtype_key(n: Node) -> str:
    """The dtype a node computes in: its first floating tensor input's (a matrix product's
    operands), else its output's."""
    for a in n.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return str(v.dtype).removeprefix("torch.")
    v = n.meta.get("val")
    if isinstance(v, (tuple, list)):
        v = next((x for x in v if isinstance(x, torch.Tensor)), None)
    if isinstance(v, torch.Tensor):
        return str(v.dtype).removeprefix("torch.")
    return "float32"


def _mm_class(n: Node) -> tuple[str, float]:
    """The op class of a matrix product or convolution and its smallest GEMM dimension.

    Class: ``conv`` (a forward convolution, or a JVP's tangent convolution, which eager's
    forward-mode AD runs as forward convolutions), ``conv_backward`` (a backward's convolution:
    an input or weight gradient, which eager PyTorch runs in ``convolution_backward``),
    ``matmul_thin`` (a product with a dimension of at most
    :data:`~graphflop.passes.time_profile.THIN_ROWS`: rows, columns or the contracted one) or
    ``matmul``.

    Smallest dimension: of the GEMM the product is, ``M × N`` outputs each a sum over ``K``
    products (``mm_flops = 2·M·N·K`` per matrix of a batch): for a matrix product ``M`` and
    ``N`` are the output's last two dimensions; for a convolution (output ``batch × C_out ×
    pixels``) ``N`` is ``C_out`` and ``M`` the rest of the output; ``K = mm_flops / (2 ×
    output elements)`` (input channels per group × kernel pixels). 0 when the output is not a
    tensor of at least two dimensions.
    """
    out = n.meta.get("val")
    c = n.meta.get(COST, ZERO_COST)
    dim = 0.0
    conv = "convolution" in op_name(n.target)
    if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.numel():
        k = c.mm_flops / (2 * out.numel())
        if conv:
            m, cols = out.numel() / out.shape[1], out.shape[1]
        else:
            m, cols = out.shape[-2], out.shape[-1]
        dim = float(min(m, cols, k))
    if conv:
        # a backward's convolution is eager's convolution_backward; a JVP's tangent
        # convolution (conv(ẋ, W) + conv(x, Ẇ)) runs as forward convolutions
        return ("conv_backward" if n.meta.get(KIND) == "cotangent" else "conv"), dim
    if 0 < dim <= THIN_ROWS:
        return "matmul_thin", dim
    return "matmul", dim


def _contracted_thin(n: Node) -> bool:
    """Whether ``n`` is a matrix product whose contracted dimension ``K`` is smaller than both
    of its output's ``M`` and ``N`` (a weight gradient summed over a batch or a sequence:
    ``dyᵀ @ x``). On a CPU such a product runs faster than one of the same FLOPs and smallest
    dimension whose rows are few (the forward ``x @ Wᵀ`` of a 64-row batch: 81-86 against
    69-71 GFLOP/s here), and a calibrated profile has its own curves for it."""
    out = n.meta.get("val")
    if "convolution" in op_name(n.target) or not isinstance(out, torch.Tensor) or out.dim() < 2:
        return False
    if not out.numel():
        return False
    k = n.meta.get(COST, ZERO_COST).mm_flops / (2 * out.numel())
    return 0 < k < min(out.shape[-2], out.shape[-1])


def _wide(n: Node) -> bool:
    """Whether ``n`` is a matrix product that is not contracted over its smallest dimension
    and whose larger output dimension exceeds its contracted one ``K``: ``max(M, N) > K >
    min(M, N)`` (a widening linear layer's ``x @ Wᵀ``, an output head over a vocabulary, the
    input gradient of a narrowing layer). On a CPU such products run below those of the same
    FLOPs and smallest dimension that contract their longest dimension, and a calibrated
    profile has its own curves for them (:data:`~graphflop.passes.time_profile.WIDE`)."""
    out = n.meta.get("val")
    if "convolution" in op_name(n.target) or not isinstance(out, torch.Tensor) or out.dim() < 2:
        return False
    if not out.numel():
        return False
    k = n.meta.get(COST, ZERO_COST).mm_flops / (2 * out.numel())
    m, cols = out.shape[-2], out.shape[-1]
    return min(m, cols) < k < max(m, cols)


#: a tensor-valued node -> its bytes under autocast (None: as traced)
_Sizer = Callable[[Node], int] | None


def _size(a: Node, sizer: _Sizer) -> int:
    return sizer(a) if sizer is not None else tensor_bytes(a.meta.get("val"))


def _largest_input(k: Kernel, sizer: _Sizer = None) -> int:
    """Bytes of the largest tensor a kernel takes from outside it."""
    inside = set(k.nodes)
    outer = {a for n in k.nodes for a in n.all_input_nodes if a not in inside}
    return max((_size(a, sizer) for a in outer), default=0)


#: a call of a template derivative in a recorded top level (its cost is its template's)
_REPEAT = torch.ops.graphflop.repeat.default


def no_cost_rule(n: Node) -> bool:
    """Whether ``n`` calls an op without a cost rule (its ``COST`` is 0, the FLOP report lists
    it as uncounted); ``getitem`` and a template derivative's call are not such ops."""
    return (
        n.op == "call_function"
        and n.target is not operator.getitem
        and n.target is not _REPEAT
        and not has_rule(n.target)
    )


def _aliases(n: Node) -> bool:
    """Whether ``n``'s op returns views of its inputs (its schema's returns alias an input
    without writing it): a view, which moves no bytes."""
    schema = getattr(n.target, "_schema", None)
    returns = getattr(schema, "returns", None)
    if not returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _metadata_bytes(n: Node, sizer: _Sizer = None) -> int:
    """Bytes a node without a cost rule moves, from its tensors' metadata: each tensor input
    read whole and its output written (0 for an op whose outputs are views of its inputs)."""
    if _aliases(n):
        return 0
    read = sum(_size(a, sizer) for a in n.all_input_nodes if tensor_bytes(a.meta.get("val")))
    return read + _size(n, sizer)


def _kernel_bytes(k: Kernel, sizer: _Sizer = None) -> int:
    """Bytes a kernel moves: one node's read + written (its rule's byte policy, scaled by its
    values' sizes under autocast); a group's inputs from outside it and outputs read outside it
    (its temporaries stay in the kernel)."""
    if len(k.nodes) == 1:
        n = k.nodes[0]
        c = n.meta.get(COST, ZERO_COST)
        if no_cost_rule(n):  # no byte policy: its tensors' bytes, from their metadata
            return _metadata_bytes(n, sizer)
        if sizer is None:
            return c.bytes_read + c.bytes_written
        raw_in = sum(tensor_bytes(a.meta.get("val")) for a in n.all_input_nodes)
        amp_in = sum(sizer(a) for a in n.all_input_nodes)
        raw_out = tensor_bytes(n.meta.get("val"))
        read = c.bytes_read * amp_in / raw_in if raw_in else c.bytes_read
        written = c.bytes_written * sizer(n) / raw_out if raw_out else c.bytes_written
        return round(read + written)
    inside = set(k.nodes)
    # an input from outside is read at most whole, and at most as much as the byte rules of
    # the nodes that take it say they read of it (a gather reads its rows, not the table)
    reads: dict[Node, float] = {}
    for n in k.nodes:
        if not any(a not in inside for a in n.all_input_nodes):
            continue
        for a, share in read_shares(n, rule_cost(n)).items():
            if a not in inside:
                reads[a] = reads.get(a, 0.0) + share * _size(a, sizer)
    read = round(sum(min(r, _size(a, sizer)) for a, r in reads.items()))
    written = 0
    for n in k.nodes:
        if is_view(n) or (no_cost_rule(n) and _aliases(n)):
            continue
        if any(u not in inside for u in n.users):
            written += _size(n, sizer)
    return read + written


def _fault_seconds(
    k: Kernel, profile: TimeProfile, sizer: _Sizer = None, in_place: frozenset[str] = frozenset()
) -> float:
    """Seconds of the page faults of the storages kernel ``k`` allocates for outside it (each
    output tensor of a node read outside the kernel, views, ``in_place`` nodes (a scatter eager
    runs into the zeros it made) and nodes the model ran in place (``INPLACE``) excepted):
    :meth:`~graphflop.passes.time_profile.TimeProfile.fault_seconds` of each."""
    if not profile.fault_s_per_byte:
        return 0.0
    inside = set(k.nodes)
    total = 0.0
    for n in k.nodes:
        if is_view(n) or n.target is operator.getitem or n.name in in_place or n.meta.get(INPLACE):
            continue
        if len(k.nodes) > 1 and all(u in inside for u in n.users):
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            total += profile.fault_seconds(_size(n, sizer))
        elif isinstance(v, (tuple, list)):
            total += sum(profile.fault_seconds(tensor_bytes(t)) for t in v)
    return total


def _amp_sizer(forward: GraphModule, amp: str, kind: str) -> Callable[[Node], int]:
    """Bytes of a value under autocast: a forward value at the dtype autocast gives it
    (:func:`graphflop.passes.amp.amp_dtypes`, the op lists of ``device``), a derived value
    (tangent, cotangent) at the dtype of the forward value it comes from (``SOURCE``);
    parameters, their gradients and the update's values stay float32 (master weights)."""
    from graphflop.passes.amp import HALF, amp_dtypes

    dts = amp_dtypes(forward, HALF[amp], "cuda" if kind == "gpu" else "cpu")

    def size(n: Node) -> int:
        v = n.meta.get("val")
        raw = tensor_bytes(v)
        if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            return raw
        if n.meta.get(PARAM) is not None or n.meta.get(ROLE) == "update":
            return raw
        dt = dts.get(n.name) if n.graph is forward.graph else None
        if dt is None:
            dt = dts.get(n.meta.get(SOURCE, ""))
        return v.numel() * dt.itemsize if dt is not None else raw

    return size


def _time_kernel(
    k: Kernel,
    profile: TimeProfile,
    amp: str | None,
    sizer: _Sizer,
    optimizer: str | None = None,
    first_update: bool = False,
    in_place: frozenset[str] = frozenset(),
) -> None:
    """Write ``TIME`` on the nodes of one kernel (``optimizer``: the update graph's, for an
    :data:`UPDATE_KERNEL`; ``first_update``: this is the step's first parameter, which carries
    the step's own cost, :attr:`~graphflop.passes.time_profile.TimeProfile.update_step_s`)."""
    costs = [n.meta.get(COST, ZERO_COST) for n in k.nodes]
    flops = sum(c.flops for c in costs)
    nbytes = _kernel_bytes(k, sizer)
    by_class: dict[tuple[str, str], int] = {}
    dims: dict[tuple[str, str], float] = {}
    contracted: dict[tuple[str, str], bool] = {}
    wide: dict[tuple[str, str], bool] = {}
    for n, c in zip(k.nodes, costs, strict=True):
        dtype = _dtype_key(n)
        if c.mm_flops:
            cls, dim = _mm_class(n)
            # under autocast in its dtype; else float32 in TF32 where the profile says
            # PyTorch runs the class so (cuDNN convolutions by default)
            mm_dtype = amp if amp is not None and dtype == "float32" else dtype
            key = (cls, profile.product_dtype(cls, mm_dtype))
            by_class[key] = by_class.get(key, 0) + c.mm_flops
            dims[key] = min(dims.get(key, dim), dim)
            contracted[key] = contracted.get(key, True) and _contracted_thin(n)
            wide[key] = wide.get(key, True) and _wide(n)
        plain = c.flops - c.mm_flops - c.transcendentals
        if c.transcendentals:
            key = ("transcendental", dtype)
            by_class[key] = by_class.get(key, 0) + c.transcendentals
        if plain > 0:
            by_class[("other", dtype)] = by_class.get(("other", dtype), 0) + plain
    compute = sum(
        profile.gemm_seconds(
            cls, d, f, dims[(cls, d)], contracted=contracted[(cls, d)], wide=wide[(cls, d)]
        )
        if (cls, d) in dims
        else profile.flops_seconds(cls, d, f)
        for (cls, d), f in by_class.items()
    )
    # the update, and an op the model ran in place (relu_), write into existing storage
    inplace = profile.inplace_bandwidth is not None and (
        k.name == UPDATE_KERNEL or all(n.meta.get(INPLACE) for n in k.nodes)
    )
    bandwidth = profile.inplace_bandwidth if inplace else profile.bandwidth
    assert bandwidth is not None
    memory = bandwidth.seconds(nbytes)
    keys = k.keys()
    measured = next((profile.kernels[x] for x in keys if x in profile.kernels), None)
    if measured is not None and nbytes:  # this eager kernel's own measured rate
        # over the bytes it moves; a derivative's kernel over eager's: the cotangent and the
        # saved input read, the input's gradient written (3 × its largest input)
        memory = measured.seconds(nbytes if k.forward else 3 * _largest_input(k, sizer))
        compute = min(compute, memory)
    # a kernel that moves nothing (a view, a metadata op) costs the dispatcher's time only;
    # a calibrated profile has each kind's own fixed cost as it runs inside a network
    engine = not k.forward and any(n.meta.get(KIND) == "cotangent" for n in k.nodes)
    overhead = profile.fixed_cost(
        k.name, k.forward, view=not (flops or nbytes), variant=k.variant, engine=engine
    )
    step = profile.updates.get(optimizer or "") if k.name == UPDATE_KERNEL else None
    if k.name != UPDATE_KERNEL:  # the update writes in place: no new storage
        overhead += _fault_seconds(k, profile, sizer, in_place)
    if step is not None:  # torch.optim's measured per-parameter step, over the parameter's bytes
        param_bytes = max(tensor_bytes(n.meta.get("val")) for n in k.nodes)
        memory = step.seconds(param_bytes) - step.fill_s if param_bytes else 0.0
        compute = min(compute, memory)
        overhead = step.fill_s
        if first_update:  # the step's cost around its per-parameter loop, once
            overhead += profile.update_step_s.get(optimizer or "", 0.0)
    work = max(compute, memory)
    bound = "overhead" if overhead >= work else "compute" if compute >= memory else "memory"
    products = ("matmul", "matmul_thin", "conv", "conv_backward")
    cls_name = next((c for c, _ in by_class if c in products), "other")
    dtype = next(iter(by_class), ("", _dtype_key(k.nodes[-1])))[1]
    if bound == "compute" and flops:
        weights = [c.flops / flops for c in costs]
    elif bound == "memory" and sum(c.bytes_read + c.bytes_written for c in costs):
        total = sum(c.bytes_read + c.bytes_written for c in costs)
        weights = [(c.bytes_read + c.bytes_written) / total for c in costs]
    else:
        weights = [1 / len(k.nodes)] * len(k.nodes)
    seconds = work + overhead
    for n, w in zip(k.nodes, weights, strict=True):
        n.meta[TIME] = NodeTime(
            seconds=seconds * w,
            compute_s=compute * w,
            memory_s=memory * w,
            overhead_s=overhead * w,
            bound=bound,
            kernel=k.name,
            kernel_id=k.nodes[0].name,
            op_class=cls_name,
            dtype=dtype,
            no_cost_rule=no_cost_rule(n),
        )


def annotate_time(
    gm: GraphModule, forward: GraphModule, profile: TimeProfile, amp: str | None = None
) -> GraphModule:
    """Write ``TIME`` on the ``call_function`` nodes of ``gm`` (in place; ``getitem`` gets
    none) and return it.

    Args:
        gm: a flop-annotated graph of the analysis of ``forward`` (``forward`` itself, its
            backward, update, JVP or forward-gradient step).
        forward: the forward graph whose composite ops make the eager kernels.
        profile: the device's achieved rates.
        amp: ``bf16``/``fp16``: float32 matrix products and convolutions run in that dtype.

    Raises:
        NoPeak: a matrix product or convolution in a dtype ``profile`` has no rate for.
        ValueError: an unknown ``amp``.
    """
    amp_key = None
    sizer: _Sizer = None
    if amp is not None:
        if amp not in _AMP:
            raise ValueError(f"unknown amp {amp!r}: one of bf16, fp16")
        amp_key = _AMP[amp]
        sizer = _amp_sizer(forward, "bf16" if amp_key == "bfloat16" else "fp16", profile.kind)
    info = gm.meta.get(UPDATE)
    optimizer = getattr(info, "optimizer", None)
    first = True
    in_place = frozenset(scatters_in_place(gm)) if profile.fault_s_per_byte else frozenset()
    for k in eager_kernels(gm, forward):
        _time_kernel(
            k, profile, amp_key, sizer, optimizer, first and k.name == UPDATE_KERNEL, in_place
        )
        first = first and k.name != UPDATE_KERNEL
    return gm


def _sum_phase(a: PhaseTime, b: PhaseTime) -> PhaseTime:
    roles = dict(a.by_role)
    for r, s in b.by_role:
        roles[r] = roles.get(r, 0.0) + s
    return PhaseTime(
        seconds=a.seconds + b.seconds,
        compute_s=a.compute_s + b.compute_s,
        memory_s=a.memory_s + b.memory_s,
        overhead_s=a.overhead_s + b.overhead_s,
        overlap_s=a.overlap_s + b.overlap_s,
        host_s=a.host_s + b.host_s,
        kernels=a.kernels + b.kernels,
        flops=a.flops + b.flops,
        by_role=tuple(roles.items()),
        complete=a.complete and b.complete,
        no_cost_rule=tuple(dict.fromkeys(a.no_cost_rule + b.no_cost_rule)),
    )


def _ops(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _phase_nodes(g: Graphs) -> dict[str, list[Node]]:
    """The nodes each phase's time sums (those its FLOP totals sum)."""
    out = {"forward": _ops(g.forward)}
    out["loss"] = [n for n in out["forward"] if n.meta.get(ROLE) == "loss"]
    if g.backward is not None and g.update is not None:
        out["backward"] = _ops(g.backward)
        out["update"] = _ops(g.update)
    if g.jvp is not None:
        out["jvp"] = [n for n in _ops(g.jvp) if n.meta.get(KIND) in ("tangent", "coef")]
        if g.forward_gradient is not None:
            out["forward_gradient_step"] = _ops(g.forward_gradient)
    return out


def _bound(compute: float, memory: float, overhead: float) -> str:
    return max(zip((compute, memory, overhead), BOUNDS, strict=True))[1]


def time_report(
    g: Graphs,
    report: Report,
    profile: TimeProfile,
    *,
    amp: str | None = None,
    reruns: Mapping[str, frozenset[str]] | None = None,
) -> TimeReport:
    """Time every graph of ``g`` on ``profile`` (:func:`annotate_time`) and roll the node times
    up per phase, role, module (``report``'s layer rows) and kernel op.

    ``reruns``: what-if (``checkpoint``, ``recompute``) -> the forward node names it reruns in
    the backward; each what-if's recompute time (:attr:`TimeReport.recompute`) is those
    nodes' share of the forward phase (:func:`_rerun_seconds`).

    Raises:
        NoPeak: a matrix product or convolution in a dtype ``profile`` has no rate for.
    """
    graphs = [g.forward, g.backward, g.update, g.jvp, g.forward_gradient]
    kernel_counts: dict[str, int] = {}
    phase_nodes = _phase_nodes(g)
    for gm in graphs:
        if gm is not None:
            annotate_time(gm, g.forward, profile, amp)
    phases: dict[str, PhaseTime] = {}
    totals = report.totals
    flops = {
        "forward": totals.forward.flops,
        "loss": totals.loss.flops,
        "backward": totals.backward.flops if totals.backward else 0,
        "update": totals.update.flops if totals.update else 0,
        "jvp": totals.jvp.flops if totals.jvp else 0,
        "forward_gradient_step": (
            totals.forward_gradient_step.flops if totals.forward_gradient_step else 0
        ),
    }
    complete = {
        "forward": totals.forward.complete,
        "loss": totals.loss.complete,
        "backward": totals.backward.complete if totals.backward else True,
        "update": totals.update.complete if totals.update else True,
        "jvp": totals.jvp.complete if totals.jvp else True,
        "forward_gradient_step": (
            totals.forward_gradient_step.complete if totals.forward_gradient_step else True
        ),
    }
    for name, nodes in phase_nodes.items():
        kernel_counts[name] = _kernels_in(nodes)
        if name == "loss":  # the loss's share of the forward, which runs it (below)
            continue
        phases[name] = _phase_time(
            nodes,
            flops[name],
            kernel_counts[name],
            asynchronous=profile.kind == "gpu",
            host=_host_costs(nodes, profile, name == "backward", g.forward),
            complete=complete[name],
        )
    # the loss runs inside the forward's timeline: its time is its kernels' share of the
    # forward (as its per-layer row and the forward's by_role have it), not a timeline of its
    # own (on a GPU that was 12.7 µs against a 14.3 µs row; tester, stop 49)
    phases["loss"] = _part(
        phase_nodes["loss"],
        phase_nodes["forward"],
        phases["forward"],
        flops["loss"],
        kernel_counts["loss"],
        complete["loss"],
    )
    if "backward" in phases:
        step = _sum_phase(_sum_phase(phases["forward"], phases["backward"]), phases["update"])
        order = ["forward", "loss", "backward", "update"]
        phases["train_step"] = step
        order.append("train_step")
    else:
        order = ["forward", "loss"]
    order += [p for p in ("jvp", "forward_gradient_step") if p in phases]
    return TimeReport(
        device=profile.name,
        title=profile.title,
        source=profile.source,
        amp=amp,
        phases=tuple((p, phases[p]) for p in order),
        ratios=_ratios({k: v.seconds for k, v in phases.items()}),
        flop_ratios=_ratios({k: float(v.flops) for k, v in phases.items()}),
        layers=_layers(phase_nodes, report.layers, phases),
        ops=_op_times(phase_nodes, phases),
        recompute=tuple(
            (what, _rerun_seconds(phase_nodes["forward"], phases["forward"], names))
            for what, names in (reruns or {}).items()
        ),
        memory_bytes=profile.memory_bytes,
    )


def _share(nodes: list[Node], phase: PhaseTime | None) -> float:
    """What one second of ``nodes``' kernel seconds (a phase's nodes) is of ``phase``: the
    phase's seconds over theirs (1 without the phase or any timed node). On a GPU profile the
    host/device overlap comes off, on a calibrated one the host's costs go on, in proportion."""
    kernels = sum(n.meta[TIME].seconds for n in nodes if TIME in n.meta)
    return phase.seconds / kernels if phase is not None and kernels else 1.0


def _rerun_seconds(nodes: list[Node], phase: PhaseTime, names: frozenset[str]) -> float:
    """Predicted seconds of rerunning the forward nodes named in ``names``: their share of
    the forward phase (:func:`_share`: on a data-sheet H100 the plain sum of ResNet-18's
    rerun blocks came to 1.49 ms against a 1.14 ms forward; tester, stop 45)."""
    rerun = sum(n.meta[TIME].seconds for n in nodes if n.name in names and TIME in n.meta)
    return rerun * _share(nodes, phase)


def _kernels_in(nodes: list[Node]) -> int:
    """How many eager kernels ``nodes`` (one phase's) make up."""
    return len({_kernel_key(n) for n in nodes if TIME in n.meta})


def _kernel_key(n: Node) -> tuple[int, str]:
    """One eager kernel: its graph and its first node's name."""
    return (id(n.graph), n.meta[TIME].kernel_id)


def _host_costs(
    nodes: list[Node], profile: TimeProfile, backward: bool, forward: GraphModule
) -> dict[Node, float]:
    """Host seconds beyond the kernels, at the node where eager spends them (the module
    docstring): ``nn.Module`` calls at the primal nodes of a pass that runs the forward, the
    autograd engine's nodes spread evenly over the backward's."""
    out: dict[Node, float] = {}
    timed = [n for n in nodes if TIME in n.meta]
    if profile.module_call_s and not backward:
        chain: tuple[str, ...] = ()
        for n in timed:
            if n.meta.get(KIND) != "primal" or n.meta.get(ROLE) == "loss":
                continue  # the loss is graphflop's objective, not a module of the model
            parts = str(n.meta.get(MODULE, "") or "").split(".")
            now = tuple(".".join(parts[: i + 1]) for i in range(len(parts)) if parts[0])
            entered = 1 if not out else 0  # the model's own call, once
            entered += sum(1 for i, m in enumerate(now) if i >= len(chain) or chain[i] != m)
            if entered:
                out[n] = entered * profile.module_call_s
            chain = now
    if profile.autograd_node_s and backward and timed:
        params = {n.meta[PARAM] for n in timed if n.meta.get(PARAM) is not None}
        share = (_autograd_nodes(forward, params) + len(params)) * profile.autograd_node_s
        for n in timed:
            out[n] = share / len(timed)
    return out


def _autograd_nodes(forward: GraphModule, params: set[str]) -> int:
    """The autograd nodes eager PyTorch records in ``forward``'s pass (beyond one
    ``AccumulateGrad`` per parameter): one per op whose floating output depends on a parameter
    in ``params`` (views included), a composite op's decomposition counting once."""
    active: set[Node] = set()
    # a composite op's occurrence: its nodes connected under one region number (the copies of
    # an outlined block share the template's numbers)
    occurrence = {n: i for i, nodes in enumerate(_regions(forward)) for n in nodes}
    regions: set[int] = set()
    count = 0
    for n in forward.graph.nodes:
        if n.op == "placeholder":
            if n.meta.get(PARAM) in params:
                active.add(n)
            continue
        if n.op != "call_function" or not any(a in active for a in n.all_input_nodes):
            continue
        active.add(n)
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else (vals,)  # batch norm's, max-pool's
        if n.target is operator.getitem or not any(
            isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals
        ):
            continue
        if n in occurrence:
            if occurrence[n] in regions:
                continue
            regions.add(occurrence[n])
        count += 1
    return count


def _no_cost_rule_ops(nodes: list[Node]) -> tuple[str, ...]:
    """The ops of ``nodes`` timed without a cost rule (their bytes only), in order first met."""
    out = (op_name(n.target) for n in nodes if TIME in n.meta and n.meta[TIME].no_cost_rule)
    return tuple(dict.fromkeys(out))


def _phase_time(
    nodes: list[Node],
    flops: int,
    kernels: int,
    asynchronous: bool = False,
    host: dict[Node, float] | None = None,
    complete: bool = True,
) -> PhaseTime:
    """One phase's roll-up; ``asynchronous``: its time is the host/device timeline's end (the
    module docstring), else the sum of its nodes' times; ``host``: host seconds beyond the
    kernels, by the node they come before (:func:`_host_costs`); ``complete``: the phase's
    FLOP totals are (else its time is marked incomplete too). Its roles are their shares of
    its seconds (:func:`_share`), so they add up to it."""
    host = host or {}
    sums = dict.fromkeys(BOUNDS, 0.0)
    roles: dict[str, float] = {}
    host_s = clock = device = 0.0
    for n in nodes:
        t: NodeTime | None = n.meta.get(TIME)
        if t is None:
            continue
        extra = host.get(n, 0.0)
        work = t.seconds - t.overhead_s
        sums["compute" if t.compute_s >= t.memory_s else "memory"] += work
        sums["overhead"] += t.overhead_s
        host_s += extra
        clock += extra + t.overhead_s
        device = max(device, clock) + work
        role = n.meta.get(ROLE, "")
        roles[role] = roles.get(role, 0.0) + t.seconds
    kernel_s = sum(sums.values())
    total = kernel_s + host_s
    seconds = max(clock, device) if asynchronous else total
    scale = seconds / kernel_s if kernel_s else 1.0
    missing = _no_cost_rule_ops(nodes)
    return PhaseTime(
        seconds=seconds,
        compute_s=sums["compute"],
        memory_s=sums["memory"],
        overhead_s=sums["overhead"],
        host_s=host_s,
        overlap_s=total - seconds,
        kernels=kernels,
        flops=flops,
        by_role=tuple((r, x * scale) for r, x in roles.items()),
        complete=complete and not missing,
        no_cost_rule=missing,
    )


def _part(
    part: list[Node],
    nodes: list[Node],
    phase: PhaseTime,
    flops: int,
    kernels: int,
    complete: bool = True,
) -> PhaseTime:
    """The share of ``phase`` (of ``nodes``) that its nodes ``part`` take: their kernels'
    compute, memory and overhead terms, and, in proportion to their kernels' seconds, its
    host costs, its overlap and its seconds (:func:`_share`)."""
    kernel_s = sum(n.meta[TIME].seconds for n in nodes if TIME in n.meta)
    sums = dict.fromkeys(BOUNDS, 0.0)
    roles: dict[str, float] = {}
    scale = _share(nodes, phase)
    for n in part:
        t: NodeTime | None = n.meta.get(TIME)
        if t is None:
            continue
        sums["compute" if t.compute_s >= t.memory_s else "memory"] += t.seconds - t.overhead_s
        sums["overhead"] += t.overhead_s
        role = n.meta.get(ROLE, "")
        roles[role] = roles.get(role, 0.0) + t.seconds * scale
    own = sum(sums.values())
    fraction = own / kernel_s if kernel_s else 0.0
    missing = _no_cost_rule_ops(part)
    return PhaseTime(
        seconds=own * scale,
        compute_s=sums["compute"],
        memory_s=sums["memory"],
        overhead_s=sums["overhead"],
        host_s=phase.host_s * fraction,
        overlap_s=phase.overlap_s * fraction,
        kernels=kernels,
        flops=flops,
        by_role=tuple(roles.items()),
        complete=complete and not missing,
        no_cost_rule=missing,
    )


def _ratios(s: dict[str, float]) -> tuple[tuple[str, float | None], ...]:
    def r(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    fwd = s.get("forward")
    step = s.get("train_step")
    fg = s.get("forward_gradient_step")
    bwd = s.get("backward")
    upd = s.get("update")
    return (
        ("Rb", r(step, fwd)),
        ("Rf", r(fg, fwd)),
        ("Rf_over_Rb", r(fg, step)),
        ("backward_forward", r(bwd + upd if bwd is not None and upd is not None else None, fwd)),
        ("jvp_forward", r(s.get("jvp"), fwd)),
    )


def _layers(
    phase_nodes: dict[str, list[Node]],
    rows: tuple[LayerRow, ...],
    phases: dict[str, PhaseTime],
) -> tuple[LayerTime, ...]:
    """Per module, its share of each phase (:func:`_share`), so the rows add up to the phase
    (before, a GPU's layer rows summed to more than their phase)."""
    per: dict[str, dict[str, float]] = {}
    split: dict[str, dict[str, float]] = {}
    for phase in ("forward", "backward", "update", "jvp"):
        nodes = [n for n in phase_nodes.get(phase, ()) if n.meta.get(TIME) is not None]
        scale = _share(nodes, phases.get(phase))
        for n in nodes:
            t: NodeTime = n.meta[TIME]
            name = n.meta.get(MODULE, "") or "(model)"
            per.setdefault(name, {}).setdefault(phase, 0.0)
            per[name][phase] += t.seconds * scale
            if phase == "forward":
                b = split.setdefault(name, dict.fromkeys(BOUNDS, 0.0))
                work = t.seconds - t.overhead_s
                b["compute" if t.compute_s >= t.memory_s else "memory"] += work
                b["overhead"] += t.overhead_s
    names = [r.name for r in rows] + [k for k in per if k not in {r.name for r in rows}]
    out = []
    for name in names:
        p = per.get(name, {})
        bs = split.get(name)
        out.append(
            LayerTime(
                name=name,
                forward_s=p.get("forward", 0.0),
                backward_s=p.get("backward", 0.0),
                update_s=p.get("update", 0.0),
                jvp_s=p.get("jvp", 0.0),
                bound=_bound(bs["compute"], bs["memory"], bs["overhead"]) if bs else "",
            )
        )
    return tuple(out)


def _op_times(
    phase_nodes: dict[str, list[Node]], phases: dict[str, PhaseTime]
) -> tuple[OpTime, ...]:
    """Per phase, its kernels grouped by op: their terms, and their shares of the phase's
    seconds, host costs and overlap (:func:`_part`), so each phase's rows add up to it."""
    rows: list[OpTime] = []
    for phase in ("forward", "backward", "update", "jvp", "forward_gradient_step"):
        nodes = phase_nodes.get(phase)
        if not nodes:
            continue
        by: dict[str, list[Node]] = {}
        for n in nodes:
            t: NodeTime | None = n.meta.get(TIME)
            if t is not None:
                by.setdefault(t.kernel, []).append(n)
        for op, ns in by.items():
            part = _part(ns, nodes, phases[phase], 0, 0)
            c, m, o = part.compute_s, part.memory_s, part.overhead_s
            costs = [n.meta.get(COST, ZERO_COST) for n in ns]
            rows.append(
                OpTime(
                    op=op,
                    phase=phase,
                    kernels=len({_kernel_key(n) for n in ns}),
                    seconds=part.seconds,
                    compute_s=c,
                    memory_s=m,
                    overhead_s=o,
                    host_s=part.host_s,
                    overlap_s=part.overlap_s,
                    flops=sum(x.flops for x in costs),
                    bytes=sum(
                        _metadata_bytes(n) if no_cost_rule(n) else x.bytes_read + x.bytes_written
                        for n, x in zip(ns, costs, strict=True)
                    ),
                    bound=_bound(c, m, o),
                    no_cost_rule=bool(part.no_cost_rule),
                )
            )
    return tuple(rows)
