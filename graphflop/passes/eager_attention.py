"""Fused scaled dot-product attention in the eager memory model
(:mod:`graphflop.passes.eager_memory`): what PyTorch's fused kernel saves, allocates and frees
for the attention calls tracing tagged :data:`~graphflop.frontend.composite.FUSED_SDPA`
(:func:`~graphflop.frontend.composite.fused_on_cpu`), and the matrix FLOPs its backward adds
to graphflop's graph (:func:`fused_score_products`, :func:`eager_attention_flops`). Reads
``val``, ``COMPOSITE``, ``SOURCE``, ``MODULE``, ``COST``; writes nothing.
"""

from __future__ import annotations

from itertools import islice

import torch
from torch.fx import GraphModule, Node

from graphflop.frontend.composite import FUSED_SDPA
from graphflop.meta import COMPOSITE, COST, MODULE
from graphflop.passes.eager_kernels import is_view, nodes_made_by
from graphflop.passes.flops import tensor_bytes
from graphflop.report import EagerAttention

aten = torch.ops.aten


def fused_score_products(fwd: GraphModule) -> list[Node]:
    """The score product q·kᵀ (the first ``bmm``) of each attention call tracing tagged as
    PyTorch's fused kernel (:data:`~graphflop.frontend.composite.FUSED_SDPA`), one per call.

    graphflop's graph holds attention in its math form, whose backward is four products
    (dP = dO·vᵀ, dV = Pᵀ·dO, dQ = dS·k, dK = dSᵀ·q: twice the forward's two); the fused kernel
    keeps only a logsumexp and recomputes the scores q·kᵀ in its backward, a fifth product the
    size of this one (FlopCounterMode's ``sdpa_backward_flop_count`` counts the same five)."""
    first: dict[tuple[str, int], Node] = {}
    # the bmm nodes in graph order (fx's table by op and target, sorted), not every node
    for n in fwd.graph.find_nodes(op="call_function", target=aten.bmm.default):
        tag = n.meta.get(COMPOSITE)
        if tag is None or tag.op != FUSED_SDPA:
            continue
        # a repeated block's copies share their region numbers: the module tells them apart
        first.setdefault((n.meta.get(MODULE) or "", tag.region), n)
    return list(first.values())


def eager_attention_flops(fwd: GraphModule, copies: dict[str, int] | None = None) -> EagerAttention:
    """What eager PyTorch's fused attention kernel adds to the backward of graphflop's graph:
    the recomputed score product of each call :func:`fused_score_products` finds, at the
    forward node's ``COST`` (whole-model size), times ``copies`` of the node where given (a
    plan's ``--blocks``: how many blocks an analysed one stands for)."""
    products = fused_score_products(fwd)
    w = {n.name: (copies or {}).get(n.name, 1) for n in products}
    return EagerAttention(
        calls=sum(w.values()),
        kernel=FUSED_SDPA,
        backward_recompute_flops=sum(n.meta[COST].flops * w[n.name] for n in products),
        backward_recompute_mm_flops=sum(n.meta[COST].mm_flops * w[n.name] for n in products),
    )


def _split(n: int, long: int, mid: int | None) -> int:
    """The CPU flash kernel's block length over a sequence of ``n``: queries in blocks of 256
    from 768 on (``long``), 64 from 192 on (``mid``), else 32; keys (``mid`` None) in blocks
    of 512; never longer than the sequence (its buffer sizes in the profiler's allocator
    events, PyTorch 2.13 CPU, at lengths 5 to 1024)."""
    if mid is None:
        return min(n, 512)
    return min(n, 256 if n >= long else 64 if n >= mid else 32)


def _back_through(chain: list[tuple[Node, torch.Tensor]], grad: torch.Tensor) -> torch.Tensor:
    """A gradient (a meta tensor) taken back through views as autograd does: permutes
    inverted, reshapes (copying where no view can do it)."""
    for u, before in reversed(chain):
        if u.target is aten.permute.default:
            dims = list(u.args[1])  # type: ignore[arg-type]
            grad = grad.permute([dims.index(d) for d in range(len(dims))])
        elif u.target is aten.transpose.int:
            grad = grad.transpose(u.args[1], u.args[2])  # type: ignore[arg-type]
        else:
            grad = grad.reshape(before.shape)
    return grad


def _dense_strides(v: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor of ``v``'s shape in ``v``'s memory order (``empty_like``)."""
    out = [0] * v.dim()
    step = 1
    for d in sorted(range(v.dim()), key=lambda d: (v.stride(d), -d)):
        out[d] = step
        step *= v.shape[d]
    return tuple(out)


_STRIDED_VIEWS = (
    aten.permute.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.unsqueeze.default,
    aten.squeeze.dim,
)


class FusedAttention:
    """Eager memory of the attention calls tagged :data:`FUSED_SDPA` (PyTorch's fused kernel
    on CPU; on CUDA the flash or memory-efficient kernel, assumed, not measured).

    Forward: the kernel saves q, k, v, its output, the mask (a bool mask converted to a float
    mask of q's dtype: a new storage) and a logsumexp of shape q.shape[:3] in float32 (float64
    for float64 q; tools/autograd/derivatives.yaml); it never makes the scores, the
    probabilities or graphflop's scaled q, GQA copies and causal index tensors, so the
    decomposition's inner nodes hold nothing, and two of them carry the logsumexp and the
    converted mask. On CUDA the memory-efficient kernel (float32, or a mask) pads the
    logsumexp's rows to a multiple of 32, flash (half precision, no mask) does not; float64
    runs the math path there (no swap). Backward: one kernel, like a composite op's
    (:attr:`regions`, for :func:`~graphflop.passes.eager_kernels.one_kernel_backward`): the
    nodes the region's rules made hold nothing but the gradients leaving it (dq, dk, dv). CPU
    temporaries (profiler
    allocator events, PyTorch 2.13, one thread): forward, one thread's block buffers
    ``(qs·ks + 2·qs + qs·E)`` accumulate-dtype elements; backward, ``2·qs·ks`` elements
    (qs, ks: :func:`_split`) and a copy of the output's gradient unless it arrives in
    (B, L, H, E) order (:meth:`_free_copies`). bfloat16's packing buffers are left out.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.sizes: dict[str, int] = {}
        self.extra: dict[str, int] = {}
        #: (forward node names, backward temporaries' bytes) of each fused region
        self.regions: list[tuple[set[str], int]] = []
        self.accumulate: set[str] = set()  # the logsumexp nodes (float32 under autocast too)

    def forward(self, region: list[Node]) -> list[Node] | None:
        """The nodes standing for what the kernel saves (None: the math path runs)."""
        tags = {n: n.meta[COMPOSITE] for n in region}
        ins: dict[int, Node] = {}
        for n in region:
            for i, k in tags[n].inputs:
                ins.setdefault(k, n.all_input_nodes[i])
        outs = [n for n in region if tags[n].output == 0]
        inner = [n for n in region if tags[n].output is None and n.op == "call_function"]
        for n in region:  # a constant mask is lifted into the graph inside the call
            if n.op != "call_function":
                ins.setdefault(3, n)
        # the first two inner nodes that hold a tensor of their own (at most two are read)
        spare = list(
            islice(
                (
                    n
                    for n in inner
                    if isinstance(n.meta.get("val"), torch.Tensor) and not is_view(n)
                ),
                2,
            )
        )
        mask = ins.get(3)
        bool_mask = mask is not None and mask.meta["val"].dtype == torch.bool
        if not outs or any(k not in ins for k in (0, 1, 2)) or len(spare) < 1 + bool_mask:
            return None
        qv, kv = ins[0].meta["val"], ins[1].meta["val"]
        if self.device != "cpu" and qv.dtype == torch.float64:
            return None
        b, h, rows, e = qv.shape
        acc = 8 if qv.dtype == torch.float64 else 4
        if self.device != "cpu" and (qv.dtype == torch.float32 or mask is not None):
            rows = -(-rows // 32) * 32
        self.sizes |= {n.name: 0 for n in inner}
        self.sizes[spare[0].name] = b * h * rows * acc
        self.accumulate.add(spare[0].name)
        saved = [ins[0], ins[1], ins[2], outs[-1], spare[0]]
        if bool_mask:
            self.sizes[spare[1].name] = mask.meta["val"].numel() * qv.element_size()  # type: ignore[union-attr]
            saved.append(spare[1])
        elif mask is not None:
            saved.append(mask)
        tmp = 0
        if self.device == "cpu":
            copied = self._free_copies(outs[-1], _dense_strides(qv))
            qs, ks = _split(qv.shape[2], 768, 192), _split(kv.shape[2], 0, None)
            self.extra[outs[-1].name] = (qs * ks + 2 * qs + qs * e) * acc
            tmp = tensor_bytes(outs[-1].meta["val"]) * copied + 2 * qs * ks * acc
        self.regions.append(({n.name for n in region}, tmp))
        return saved

    def _free_copies(self, out: Node, strides: tuple[int, ...]) -> bool:
        """The CPU kernel's output has q's memory order (``strides``), not graphflop's
        row-major one: a copy of a permutation of it that is contiguous in that order (q from
        ``view(B, L, H, E).transpose(1, 2)``, the output's ``transpose(1, 2).contiguous()``;
        multi-head attention's sequence-first q and ``permute(2, 0, 1, 3)``) is a view in
        eager. Returns whether the output's gradient reaches the backward kernel in another
        order than (B, L, H, E) (it then copies it): the gradient of the first copy found
        (row-major) taken back through the views, or, with none, row-major.

        A pure function of the output's shape, dtype and ``strides`` and of the views and
        copies reading it (their targets and arguments, in the order of their users), worked
        out once per such pattern (:data:`_COPIES`: every call of a repeated block has the
        same) and applied to the copies found."""
        v = out.meta["val"]
        walk: list[Node] = []  # the views and copies reading ``out``, depth first
        pattern = _copies_key(out, walk)
        key = (pattern, strides) if pattern is not None else None
        got = _COPIES.get(key) if key is not None else None
        if got is None:
            copied, free = _free_copies(out, v, strides)
            pos = {n: i for i, n in enumerate(walk)}
            got = (copied, tuple(pos[n] for n in free))
            if key is not None:
                if len(_COPIES) >= _COPIES_MAX:
                    _COPIES.clear()
                _COPIES[key] = got
        for i in got[1]:
            self.sizes[walk[i].name] = 0
        return got[0]


#: :meth:`FusedAttention._free_copies` per pattern (:func:`_copies_key`): whether the
#: gradient is copied, the positions in the walk of the copies that are views in eager;
#: bounded (cleared when full)
_COPIES: dict[tuple, tuple[bool, tuple[int, ...]]] = {}
_COPIES_MAX = 256


def _frozen(a: object) -> object:
    """``a`` as a hashable key (lists as tuples); a node (a size traced as a value) makes
    the pattern unknown (KeyError)."""
    if isinstance(a, (list, tuple)):
        return tuple(_frozen(x) for x in a)
    if isinstance(a, (int, float, bool, str)) or a is None:
        return a
    raise KeyError(a)


def _copies_key(out: Node, walk: list[Node]) -> tuple | None:
    """The pattern :func:`_free_copies` reads from ``out``: its shape and dtype, the default
    dtype, and depth first (users in order) each view of :data:`_STRIDED_VIEWS` (its target,
    its arguments after the first, its own readers) and each copy reading it; the nodes
    appended to ``walk`` in that order. None where an argument is not a constant."""
    v = out.meta["val"]
    rows: list[tuple] = []

    def visit(n: Node) -> None:
        for u in n.users:
            if u.target in _STRIDED_VIEWS:
                walk.append(u)
                rows.append((u.target, _frozen(u.args[1:]), len(u.users)))
                visit(u)
                rows.append(())
            elif u.target is aten.clone.default:
                walk.append(u)
                rows.append((u.target,))

    try:
        visit(out)
    except KeyError:
        return None
    return (tuple(v.shape), v.dtype, torch.get_default_dtype(), tuple(rows))


def _free_copies(out: Node, v: torch.Tensor, strides: tuple[int, ...]) -> tuple[bool, list[Node]]:
    """:meth:`FusedAttention._free_copies`, worked out: (whether the gradient is copied, the
    copies that are views in eager)."""
    first = torch.empty_strided(v.shape, strides, dtype=v.dtype, device="meta")
    todo: list[tuple[Node, torch.Tensor, list[tuple[Node, torch.Tensor]]]] = [(out, first, [])]
    grad: torch.Tensor | None = None
    free: list[Node] = []
    while todo:
        n, t, chain = todo.pop()
        for u in n.users:
            if u.target in _STRIDED_VIEWS:
                try:
                    todo.append((u, u.target(t, *u.args[1:]), [*chain, (u, t)]))
                except RuntimeError:  # a view eager would have to copy for
                    continue
            elif u.target is aten.clone.default:
                if t.is_contiguous():
                    free.append(u)
                if grad is None:
                    grad = _back_through(chain, torch.empty(t.shape, device="meta"))
    if grad is None:
        grad = torch.empty(v.shape, device="meta")
    return not grad.transpose(1, 2).is_contiguous(), free


def math_attention_jvp_bytes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Peak bytes PyTorch's math attention kernel (``_scaled_dot_product_attention_math``)
    holds under eager forward-mode AD beyond its inputs and their tangents, for q
    [B, H, L, E], k [B, Hk, S, E], v [B, Hk, S, Ev] (meta tensors): the scaled q and k and
    their tangents (the kernel scales both by √scale), GQA's expanded copies of k and v and
    their tangents when Hk < H, and the larger of the product phase (scores, their tangent
    and the two products it is summed from: four score-sized tensors, the scaled k alive) and
    the softmax phase (scores and tangent, the probabilities and two temporaries of
    ``_safe_softmax``'s tangent formula: five; the scaled k freed). Profiler allocator events,
    PyTorch 2.13 CPU, one thread. Masks (at most L·S elements, against B·H·L·S for a score)
    are left out."""
    it = q.element_size()
    b, h, rows, e = q.shape
    cols = k.shape[2]
    qb = b * h * rows * e * it
    kb = b * h * cols * e * it
    vb = b * h * cols * v.shape[-1] * it
    sb = b * h * rows * cols * it
    gqa = 2 * (kb + vb) if k.shape[1] < h else 0
    return gqa + 2 * qb + max(2 * kb + 4 * sb, 5 * sb)


def attention_jvp(
    jvp: GraphModule, regions: list[list[Node]], pairs: dict[str, list[str]]
) -> tuple[dict[str, int], dict[str, int], dict[str, list[str]]]:
    """Attention tagged :data:`FUSED_SDPA` in a JVP graph. Forward-mode AD cannot run the
    fused kernel; eager ``torch.func.jvp`` runs the math kernel
    (:func:`graphflop.runtime.attention.math_attention`), as one op: the decomposition's inner
    nodes and inner tangent nodes hold nothing, and the kernel's own peak
    (:func:`math_attention_jvp_bytes`, less the output and its tangent, which the schedule
    holds) is charged to the output's tangent, where q, k, v and their tangents are read.
    ``regions``: the graph's composite regions; ``pairs``: :func:`dual_pairs`. Returns
    (sizes, extra, also_reads) for :meth:`Schedule.add_graph`."""
    sizes: dict[str, int] = {}
    extra: dict[str, int] = {}
    reads: dict[str, list[str]] = {}
    made = nodes_made_by(jvp)
    for region in regions:
        tags = {n: n.meta[COMPOSITE] for n in region}
        if tags[region[0]].op != FUSED_SDPA:
            continue
        ins: dict[int, Node] = {}
        for n in region:
            for i, kk in tags[n].inputs:
                ins.setdefault(kk, n.all_input_nodes[i])
        names = {n.name for n in region}
        out = [n.name for n in region if tags[n].output == 0]
        keep = set(out) | {t for o in out for t in pairs.get(o, [])}
        inner_t = [n for n in made(names) if n.name not in names]
        for n in [*region, *inner_t]:
            if n.name not in keep:
                sizes[n.name] = 0
        result = [n for n in inner_t if n.name in keep]
        if not result or any(kk not in ins for kk in (0, 1, 2)):
            continue
        q, k, v = (ins[kk].meta["val"] for kk in (0, 1, 2))
        held = sum(tensor_bytes(n.meta["val"]) for n in [*region, *inner_t] if n.name in keep)
        extra[result[-1].name] = max(0, math_attention_jvp_bytes(q, k, v) - held)
        reads[result[-1].name] = [
            x for kk in (0, 1, 2) for x in [ins[kk].name, *pairs.get(ins[kk].name, [])]
        ]
    return sizes, extra, reads
