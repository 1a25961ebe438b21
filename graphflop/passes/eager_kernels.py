"""Eager kernels as one step in the eager memory model (:mod:`graphflop.passes.eager_memory`):
a composite op's forward and backward, a convolution's backward and an op's tangent formula
allocate what the one eager kernel or C++ expression allocates, not what graphflop's
decomposition of it holds on the way (profiler allocator events, PyTorch 2.13 CPU). Reads
``val``, ``COMPOSITE``, ``SOURCE``, ``KIND``; writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.fx import GraphModule, Node

from graphflop.meta import COMPOSITE, KIND, ROLE, SOURCE
from graphflop.ops import has_rule, lookup
from graphflop.passes.flops import tensor_bytes

aten = torch.ops.aten


def is_view(n: Node) -> bool:
    """Whether ``n`` calls an op whose rule says its output is a view of its input."""
    return n.op == "call_function" and has_rule(n.target) and lookup(n.target).bytes == "view"


def nodes_made_by(gm: GraphModule) -> Callable[[set[str]], list[Node]]:
    """A lookup, built in one pass over ``gm``: forward node names -> the nodes of ``gm`` their
    rules made (``SOURCE``), placeholders excluded, in ``gm``'s order. Lets a per-region pass
    visit each region's nodes instead of the whole graph per region."""
    position: dict[Node, int] = {}
    by_source: dict[str, list[Node]] = {}
    for i, n in enumerate(gm.graph.nodes):
        position[n] = i
        src = n.meta.get(SOURCE)
        if src is not None and n.op != "placeholder":
            by_source.setdefault(src, []).append(n)

    def made(names: set[str]) -> list[Node]:
        return sorted((n for s in names for n in by_source.get(s, ())), key=position.__getitem__)

    return made


def one_kernel_forward(region: list[Node]) -> tuple[dict[str, int], dict[str, list[str]]]:
    """A composite op's forward as the one eager kernel it is (``native_group_norm``,
    ``gelu``, ...): it allocates its outputs only, so the decomposition's inner nodes (those
    no output names and nothing outside the op reads) hold nothing, and its inputs stay live
    until its last output is made. Returns (sizes, also_reads) for
    :meth:`Schedule.add_graph`."""
    inside = set(region)
    inner: list[Node] = []
    outs: list[Node] = []
    for n in region:
        if n.meta[COMPOSITE].output is not None:
            outs.append(n)
        elif inside.issuperset(n.users):  # (read by nothing outside the op)
            inner.append(n)
    if not inner or not outs:
        return {}, {}
    # (_input_nodes: all_input_nodes without the copy into a list)
    outer = sorted({a.name for n in region for a in n._input_nodes if a not in inside})
    return {n.name: 0 for n in inner}, {outs[-1].name: outer}


#: bytes per input element of the temporaries a composite op's eager backward makes besides the
#: gradients it returns, where it makes any (profiler allocator events, PyTorch 2.13 CPU):
#: nan_to_num's ``grad * isfinite(x)`` holds isfinite's bool result and its conversion to the
#: gradient's dtype while the product is made (1 + itemsize; isfinite's own ``abs(x)`` and two
#: bool comparisons, freed before, hold less)
BACKWARD_TEMPORARIES = {"aten.nan_to_num.default": 1}


#: output-sized temporaries a composite op's eager backward holds beside the gradients it
#: returns at its largest, where its derivative formula is several ATen ops in one autograd
#: node (tools/autograd/derivatives.yaml; C++ keeps a full expression's temporaries to its
#: end): ``addcmul``'s ``grad * tensor2 * value`` holds ``grad * tensor2`` (1); ``addcdiv``'s
#: tensor2 gradient ``-grad * (value * tensor1 / (tensor2 * tensor2))`` holds ``value *
#: tensor1``, ``tensor2 * tensor2``, their quotient and ``-grad`` (4); ``lerp.Tensor``'s weight
#: gradient ``grad * (end - self)`` holds ``end - self`` (1); ``lerp.Scalar`` none. Measured
#: (profiler allocator events, PyTorch 2.13 CPU, float32 (2048, 8) after Linear(8, 8) layers,
#: sum loss, SGD): addcmul 328,264 B, addcdiv 590,408 B, lerp 524,872 B, graphflop within 4 B
BACKWARD_OUTPUT_TEMPORARIES = {
    "aten.addcmul.default": 1,
    "aten.addcdiv.default": 4,
    "aten.lerp.Tensor": 1,
}


def backward_temporaries(region: list[Node]) -> int:
    """Bytes of :data:`BACKWARD_TEMPORARIES` (or :data:`BACKWARD_OUTPUT_TEMPORARIES`) for one
    composite op's region (0 for most)."""
    op = region[0].meta[COMPOSITE].op
    copies = BACKWARD_OUTPUT_TEMPORARIES.get(op)
    if copies is not None:
        if op == "aten.addcmul.default" and _op_input(region, 2) is None:
            # tensor2 is tensor1 (an input is tagged at its first position): eager makes both
            # gradients, then their sum (measured 5 N at the peak, not 4)
            copies += 1
        out = next((n for n in region if n.meta[COMPOSITE].output == 0), None)
        return copies * tensor_bytes(out.meta.get("val")) if out is not None else 0
    per = BACKWARD_TEMPORARIES.get(op)
    if per is None:
        return 0
    x = _op_input(region, 0)
    if x is None:
        return 0
    val = x.meta["val"]
    return val.numel() * (per + val.element_size())


def _op_input(region: list[Node], k: int) -> Node | None:
    """The node a composite op's region reads as the op's input ``k`` (a region node's
    ``COMPOSITE.inputs``: its argument positions and the op's input numbers), or None."""
    for n in region:
        for i, j in n.meta[COMPOSITE].inputs:
            if j == k:
                return n.all_input_nodes[i]
    return None


def weight_norm_workspace(region: list[Node]) -> int:
    """Bytes of the buffer the CPU backward kernel of weight norm's fused op
    (``_weight_norm_interface_backward``) makes where ``dim`` is the last of ``v``'s dims and
    not 0 (``weight_norm_backward_last_dim_kernel``, aten/src/ATen/native/cpu/
    WeightNormKernel.cpp): ``max(3, threads) × N`` values of the norms' dtype (float32 for a
    float32, bfloat16 or float16 ``v``), ``N`` the last dim's size and ``threads``
    ``torch.get_num_threads()`` at analysis time, zeroed and held until the kernel returns,
    with both gradients (profiler allocator events, PyTorch 2.13 CPU: 3·64·4 = 768 B for a
    (64, 64) ``v`` at 2 threads). 0 for any other op, for ``dim`` 0 (that kernel makes
    none) and where the norms' shape cannot tell the two apart (a last dim of size 1)."""
    if region[0].meta[COMPOSITE].op != "aten._weight_norm_interface.default":
        return 0
    v = _op_input(region, 0)
    norm = next((n for n in region if n.meta[COMPOSITE].output == 1), None)
    if v is None or norm is None:
        return 0
    vv, nv = v.meta["val"], norm.meta["val"]
    n_last = vv.shape[-1] if vv.dim() > 1 else 0
    if n_last <= 1 or tuple(nv.shape) != (1,) * (vv.dim() - 1) + (n_last,):
        return 0
    return max(3, torch.get_num_threads()) * n_last * nv.element_size()


#: ops whose CPU backward kernel makes a non-contiguous output gradient contiguous before it
#: starts (``grad_output.contiguous()`` in ``layer_norm_backward_cpu``,
#: ``native_group_norm_backward``, ``softmax_backward_cpu``, ``log_softmax_backward_cpu``,
#: ``max_pool2d_with_indices_backward``, ``avg_pool2d_backward``): the expanded gradient of a
#: sum or a mean is copied whole and the copy lives while the kernel runs (profiler allocator
#: events, PyTorch 2.13 CPU; ``gelu_backward``, ``silu_backward``, the batch norm's and the
#: elementwise ones read it as it is). Composite ops' names, as their tags spell them, and
#: kept-whole ops' overloads by name
GRAD_OUTPUT_COPIED = frozenset(
    {
        "aten.native_layer_norm.default",
        "aten.native_group_norm.default",
        "aten._softmax.default",
        "aten._log_softmax.default",
        "aten.max_pool2d_with_indices.default",
        "aten.avg_pool2d.default",
    }
)


def grad_output_copy_bytes(nodes: list[Node]) -> int:
    """Bytes of the contiguous copies of the non-contiguous output gradients that one
    kernel's backward nodes ``nodes`` read: the cotangents they read from outside (of
    :data:`GRAD_OUTPUT_COPIED`'s ops)."""
    inside = set(nodes)
    outer = {a for n in nodes for a in n.all_input_nodes if a not in inside}
    return sum(
        tensor_bytes(v)
        for a in outer
        if a.meta.get(KIND) == "cotangent"
        and isinstance(v := a.meta.get("val"), torch.Tensor)
        and not v.is_contiguous()
    )


def one_kernel_backward(
    backward: GraphModule,
    regions: list[tuple[set[str], int]],
    inplace: set[str] | frozenset[str] = frozenset(),
    copied: set[int] | frozenset[int] = frozenset(),
    *,
    owner: Mapping[str, int] | None = None,
) -> tuple[dict[str, int], dict[str, list[str]], dict[str, int]]:
    """The backward of each composite op in ``regions`` (the names of a region's forward
    nodes, the bytes of its backward's temporaries) as one eager kernel, as autograd runs it
    (``silu_backward``, ``gelu_backward``, ``native_group_norm_backward``,
    ``native_layer_norm_backward``, ``_softmax_backward_data``, ...; tools/autograd/
    derivatives.yaml): the backward nodes its forward nodes' rules made (``SOURCE``) hold
    nothing but the gradients that leave them (and the storages those are views of), where
    graphflop's backward of the decomposition makes input-sized temporaries live together
    (SiLU's ``sigmoid``, ``1 - sigmoid`` and two products); what the kernel reads and the
    gradients it makes are live together at its last node, with its temporaries. ``inplace``:
    the backward nodes that write into their first argument's storage (a scatter into fresh
    zeros, :func:`~graphflop.passes.eager_memory.scatters_in_place`): a gradient made so
    keeps that storage, as a view keeps its base (``nll_loss_backward``'s dense gradient,
    N × C, is such a scatter, and eager holds it while ``_log_softmax_backward_data`` runs).
    ``copied``: the indices into ``regions`` of the kernels that copy a non-contiguous output
    gradient (:data:`GRAD_OUTPUT_COPIED`, on CPU): the copy is one of their temporaries
    (:func:`grad_output_copy_bytes`). ``owner``: each region's forward node names -> the
    region's index, where made already. Returns (sizes, also_reads, extra) for
    :meth:`Schedule.add_graph`."""
    if owner is None:
        owner = {name: i for i, (names, _) in enumerate(regions) for name in names}
    groups: dict[int, list[Node]] = {}
    for n in backward.graph.nodes:
        i = owner.get(n.meta.get(SOURCE, "")) if n.op == "call_function" else None
        if i is not None:
            groups.setdefault(i, []).append(n)
    sizes: dict[str, int] = {}
    reads: dict[str, list[str]] = {}
    extra: dict[str, int] = {}
    for i, nodes in groups.items():
        inside = set(nodes)
        leaving = [n for n in nodes if any(u not in inside for u in n.users)]
        keep: set[Node] = set()
        for n in leaving:  # a gradient and the storage it is a view of or was written into
            m: Node | None = n
            while m in inside and m not in keep:
                keep.add(m)
                base = m.args[0] if m.args and isinstance(m.args[0], Node) else None
                m = base if is_view(m) or m.name in inplace else None
        sizes |= {n.name: 0 for n in nodes if n not in keep}
        outer = {a.name for n in nodes for a in n.all_input_nodes if a not in inside}
        reads[nodes[-1].name] = sorted(outer) + [n.name for n in leaving]
        nbytes = regions[i][1] + (grad_output_copy_bytes(nodes) if i in copied else 0)
        if nbytes:
            extra[nodes[-1].name] = nbytes
    return sizes, reads, extra


#: JVP graph node kinds that make up an op's tangent formula: the tangent and the coefficients
#: computed from primal values for it (``erf``'s ``exp(-x²)``)
TANGENT_FORMULA = ("tangent", "coef")


def formula_reads(jvp: GraphModule, sizes: dict[str, int]) -> dict[str, list[str]]:
    """One op's tangent formula in eager forward-mode AD is one C++ expression
    (tools/autograd/derivatives.yaml ``result:``; addmm's ``self_t + mat1_t.mm(mat2_p) +
    mat1_p.mm(mat2_t)``): its partial results are freed when the expression ends, so a
    linear layer's two products and two sums are live together with its output (profiler
    allocator events, PyTorch 2.13 CPU), where graphflop's graph frees each when read. Node
    name -> the tangent nodes of the same rule (``SOURCE``) it keeps live: the rule's last
    tangent node holds the others. Nodes ``sizes`` makes 0 (composite ops modelled as one
    kernel) are left out."""
    groups: dict[str, list[str]] = {}
    for n in jvp.graph.nodes:
        if (
            n.meta.get(KIND) in TANGENT_FORMULA
            and n.op == "call_function"
            and sizes.get(n.name) != 0
        ):
            groups.setdefault(n.meta.get(SOURCE, ""), []).append(n.name)
    return {names[-1]: names[:-1] for names in groups.values() if len(names) > 1}


_MATMULS = (aten.addmm.default, aten.mm.default, aten.bmm.default)


def zero_tangent_mms(jvp: GraphModule) -> dict[str, int]:
    """Tangents of a matrix product one of whose operands has no tangent (the first linear
    layer's input): eager forward-mode AD (``mm``'s ``mat1_t.mm(mat2_p) +
    mat1_p.mm(mat2_t)``) materialises the missing tangent as zeros and multiplies it too, so
    its formula holds two more output-sized tensors (that product and the sum with it) than
    graphflop's one product (profiler allocator events, PyTorch 2.13 CPU: ``addmm``'s
    primal, two products and two sums live together). The bytes are charged to the rule's
    last tangent node. Node name -> bytes."""
    nodes = {n.name: n for n in jvp.graph.nodes}
    rules: dict[str, list[Node]] = {}
    for n in jvp.graph.nodes:
        src = n.meta.get(SOURCE)
        if n.meta.get(KIND) == "tangent" and n.op == "call_function" and src in nodes:
            if nodes[src].op == "call_function" and nodes[src].target in _MATMULS:
                rules.setdefault(src, []).append(n)
    out = {}
    for src, tangents in rules.items():
        if sum(t.target in _MATMULS for t in tangents) == 1:
            out[tangents[-1].name] = 2 * tensor_bytes(nodes[src].meta["val"])
    return out


#: backward node roles that are no part of the eager autograd node of the forward op whose
#: rule made them (:func:`autograd_node_reads`)
_NOT_THE_NODE = ("recompute", "grad_accum")


def merge_reads(reads: dict[str, list[str]], more: dict[str, list[str]]) -> None:
    """Add ``more``'s names to ``reads`` (also_reads: node name -> names), each once."""
    for k, names in more.items():
        have = reads.setdefault(k, [])
        have.extend(x for x in names if x not in have)


def autograd_node_reads(
    backward: GraphModule, plain: Callable[[str], bool]
) -> dict[str, list[str]]:
    """Eager autograd runs a plain ATen op's derivative formulas as one node
    (``MulBackward0``, ``MmBackward0``, ``SubBackward0``, ...; tools/autograd/
    derivatives.yaml), and the engine holds what the node reads until the node has returned:
    the output gradient (``call_function``'s ``inputs``, freed after ``validate_outputs``
    has reduced a broadcast operand's gradient) and the values it saved
    (``release_variables()`` in ``evaluate_function``, after ``call_function``). graphflop's
    rule frees each value after its own last product: ``mul``'s ``ct·b`` reads ``b``, then
    ``ct·a`` reads ``a``, and ``b`` was freed before ``ct·a`` is made, where eager holds both
    (profiler allocator events, PyTorch 2.13 CPU: a SwiGLU MLP's ``silu(gate(x)) * up(x)``,
    whose ``MulBackward0`` holds both factors, the output gradient and its two products).

    The backward nodes of ``backward`` are grouped by the forward node whose rule made them
    (``SOURCE``), those of the forward nodes ``plain`` accepts (a plain op's: a composite
    op's parts and a one-kernel backward are their own models, :func:`one_kernel_backward`).
    Left out are a checkpoint's recompute (its nodes are the forward's ops again, each its own
    eager node) and the sums of a value's gradients (``grad_accum``): the engine adds a
    gradient into the next node's input buffer after the node that made it has returned and
    released what it held (GPT-2's tied ``wte``: the head's gradient plus the embedding's,
    summed after ``EmbeddingBackward0`` has freed its output gradient and the token ids).
    Returns also_reads for :meth:`~graphflop.passes.memory.Schedule.add_graph`: each group's
    last node reads every value from outside the group that a node of the group reads
    (placeholders by their names: the residuals' keys)."""
    groups: dict[str, list[Node]] = {}
    for n in backward.graph.nodes:
        if n.op != "call_function" or n.meta.get(ROLE) in _NOT_THE_NODE:
            continue
        src = n.meta.get(SOURCE)
        if src is not None and plain(src):
            groups.setdefault(src, []).append(n)
    reads: dict[str, list[str]] = {}
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        inside = set(nodes)
        last = nodes[-1]
        own = set(last.all_input_nodes)
        outer = [
            a.name
            for n in nodes[:-1]
            for a in n.all_input_nodes
            if a not in inside and a not in own
        ]
        if outer:
            reads[last.name] = list(dict.fromkeys(outer))
    return reads


#: binary ops whose eager backward (``MulBackward0``, ``DivBackward0``) returns both operands'
#: gradients at the broadcast shape, reduced to each operand's shape afterwards
BROADCAST_PRODUCTS = (aten.mul.Tensor, aten.div.Tensor)
_REDUCTIONS = (aten.sum.dim_IntList, aten.view.default)


def broadcast_product_backward(
    forward: GraphModule, backward: GraphModule
) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Eager ``MulBackward0``/``DivBackward0`` (tools/autograd/derivatives.yaml, profiler
    allocator events, PyTorch 2.13 CPU): the node computes both operands' gradients at the
    broadcast (output) shape, ``grad * other`` then ``grad * self`` for mul, the divisor's
    ``-grad * ((self / other) / other)`` then ``grad / other`` for div; the engine reduces each
    to its operand's shape (``sum_to``, in ``validate_outputs``) only after the node has
    returned, while the output gradient is still live. So a reduced operand's full-size
    gradient (a scalar's, a (n, 1) one's) is live with the output gradient and the other
    operand's gradient, where graphflop's rule sums it away before making the other. And the
    divisor's formula, one C++ expression, holds its temporaries to its end: ``self / other``,
    its quotient by ``other``, ``-grad`` and the product, four output-sized tensors where
    graphflop's rule (from the forward's quotient) makes three. Returns (also_reads, extra)
    for :meth:`Schedule.add_graph`: each reduced full-size product made before the rule's last
    product is read by it (the values from outside the rule, the output gradient among them,
    are held to its last node by :func:`autograd_node_reads`, as for every plain op); the
    divisor's product holds one output-sized temporary more. graphflop's div rule makes the
    divisor's gradient first, as eager does. A composite op's parts (weight norm's
    ``v * (g / ‖v‖)``, one ``_weight_norm_interface`` eagerly) are left to its one kernel
    (:func:`one_kernel_backward`)."""
    ops = {
        n.name: n
        for n in forward.graph.nodes
        if n.op == "call_function" and n.target in BROADCAST_PRODUCTS and COMPOSITE not in n.meta
    }
    groups: dict[str, list[Node]] = {}
    for n in backward.graph.nodes:
        if n.op == "call_function" and (src := n.meta.get(SOURCE)) in ops:
            groups.setdefault(src, []).append(n)
    reads: dict[str, list[str]] = {}
    extra: dict[str, int] = {}
    for src, group in groups.items():
        inside = set(group)
        products = [n for n in group if n.target not in _REDUCTIONS]
        if not products:
            continue
        last = products[-1]
        before = set(group[: group.index(last)])
        held = [
            a.name
            for n in group
            if n.target is aten.sum.dim_IntList
            for a in n.all_input_nodes[:1]
            if a in before
        ]
        if held:
            reads.setdefault(last.name, []).extend(held)
        if ops[src].target is aten.div.Tensor:
            for n in products:
                coef = [a for a in n.all_input_nodes if a in inside and a.meta.get(KIND) == "coef"]
                if n.target is aten.mul.Tensor and any(a.target is aten.div.Tensor for a in coef):
                    extra[n.name] = extra.get(n.name, 0) + tensor_bytes(ops[src].meta["val"])
                    break
    return reads, extra
