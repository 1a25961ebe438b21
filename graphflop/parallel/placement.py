"""Tensor-parallel placements propagated through a graph, the collectives where they change,
and each node's cost on one rank's local shapes.

Every tensor value of a forward or backward graph gets a placement over the TP group, as
``torch.distributed.tensor`` (DTensor) has them: ``Replicate()`` (every rank holds all of it),
``Shard(dim)`` (rank r holds the r-th 1/tp of one factor of ``dim``) or ``Partial()`` (every
rank holds a summand; the value is their sum, or max for a reduction by max). Placements start
at the parameters (from the TP plan: ``colwise`` shards a Linear's weight and bias on dim 0,
``rowwise`` its weight on dim 1 and an Embedding's on dim 0) and the inputs (replicated), and
each op's rule gives its output's placement and the placements it needs of its inputs; where a
value's placement is not the one needed, a redistribution is inserted (DTensor's rules):

    Partial → Replicate   all_reduce over the group
    Partial → Shard(d)    reduce_scatter
    Shard(d) → Replicate  all_gather
    Replicate → Shard(d)  a local slice (no communication)

and, at the boundaries of the modules the plan names, the layouts ``parallelize_module``
imposes: a row-wise module's output is all-reduced (reduce-scattered on the sequence dim under
sequence parallelism); a column-wise module's input is all-gathered from the sequence shard
under sequence parallelism; in the backward the mirror (a column-wise module's input
cotangent is all-reduced or reduce-scattered, a row-wise module's output cotangent
all-gathered).

A collective's ``elements`` is the element count of the whole (unsharded) tensor: an
all_reduce's operand, an all_gather's output, a reduce_scatter's input.

A Shard is kept with the factor of its dim that is sharded (``factor``, its size; ``inner``,
the stride inside the dim), so a sharded dim merged into another by a view (attention's
``(batch, heads) → batch·heads``) and split again finds the heads again. The local cost of a
node is :func:`graphflop.ops.cost.op_cost` on meta tensors of its local shapes, so a matrix
product over a sharded contraction counts 2·M·(K/tp)·N and a bias added after it N·M.

Reads ``val``, ``MODULE``, ``PARAM``, ``RESIDUAL``, ``SOURCE``; writes nothing.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphflop.meta import MODULE, ZERO_COST, NodeCost
from graphflop.ops.cost import op_cost
from graphflop.parallel.plan import PlanError

__all__ = [
    "Collective",
    "Placement",
    "Placements",
    "REPLICATE",
    "propagate",
]

aten = torch.ops.aten


@dataclass(frozen=True)
class Placement:
    """One value's placement over the TP group.

    Attributes:
        kind: ``R`` (Replicate), ``S`` (Shard) or ``P`` (Partial).
        dim: the sharded dim (Shard only).
        factor: size of the sharded factor of ``dim`` (Shard only).
        inner: stride of that factor inside ``dim`` (1: its innermost; a plain Shard has
            ``factor`` = the dim's size and ``inner`` 1).
        reduce: how Partial summands combine: ``sum`` or ``max``.
    """

    kind: str
    dim: int = 0
    factor: int = 0
    inner: int = 1
    reduce: str = "sum"

    def __str__(self) -> str:
        if self.kind == "S":
            return f"Shard({self.dim})"
        if self.kind == "P":
            return "Partial()" if self.reduce == "sum" else f"Partial({self.reduce})"
        return "Replicate()"


REPLICATE = Placement("R")
PARTIAL = Placement("P")


def shard(dim: int, size: int) -> Placement:
    """A plain Shard of ``dim`` (of ``size`` elements)."""
    return Placement("S", dim, size, 1)


@dataclass(frozen=True)
class Collective:
    """One collective one rank takes part in.

    Attributes:
        kind: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``send``,
            ``recv``, ``all_to_all``.
        group: the mesh dimension: ``tp``, ``dp`` or ``pp``.
        group_size: ranks in the group.
        elements: elements of the whole tensor (see the module docstring); for send/recv, of
            the tensor sent.
        dtype: its dtype (``float32``, ...).
        phase: ``forward``, ``backward`` or ``optimizer``.
        at: the graph node, module or parameter group it belongs to.
    """

    kind: str
    group: str
    group_size: int
    elements: int
    dtype: str
    phase: str
    at: str = ""

    def key(self) -> tuple[str, int, int, str, str]:
        """(kind, group size, elements, dtype, phase): what a logged collective is compared on."""
        return (self.kind, self.group_size, self.elements, self.dtype, self.phase)

    def bytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.elements * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "group": self.group,
            "group_size": self.group_size,
            "elements": self.elements,
            "dtype": self.dtype,
            "phase": self.phase,
            "at": self.at,
        }


@dataclass
class Placements:
    """What :func:`propagate` returns for one graph.

    Attributes:
        of: node name → placement (a tuple of them for a multi-output op).
        cost: node name → its cost on one rank's local shapes.
        collectives: the TP collectives, in graph order.
        local_bytes: node name → bytes of its local value.
        moved_to: node name → the placement it was last redistributed to (what autograd
            saves of it, where a consumer saved the redistributed value).
    """

    of: dict[str, Any]
    cost: dict[str, NodeCost]
    collectives: list[Collective]
    local_bytes: dict[str, int]
    moved_to: dict[str, Placement]


def _dtype(v: Any) -> str:
    return str(v.dtype).removeprefix("torch.")


def local_shape(shape: tuple[int, ...], p: Placement, tp: int) -> tuple[int, ...]:
    """``shape`` as one rank holds it under ``p``.

    Raises:
        PlanError: ``tp`` does not divide the sharded dim (Megatron's layers, and torch's
            sequence parallelism, need equal shards: a sequence of 10 tokens over 3 ranks has
            none).
    """
    if p.kind != "S" or tp == 1:
        return tuple(shape)
    s = list(shape)
    if s[p.dim] % tp:
        raise PlanError(
            f"--tp {tp} does not divide dim {p.dim} ({s[p.dim]}) of a {tuple(s)} tensor the plan "
            "shards (heads, KV heads, hidden, vocabulary, or the sequence under --sp): choose a "
            "--tp that divides it, or an input shape it divides"
        )
    s[p.dim] //= tp
    return tuple(s)


def _numel(shape) -> int:
    return math.prod(int(x) for x in shape)


# --- per-op rules ------------------------------------------------------------------------------

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SAME = {
    aten.clone.default,
    aten._to_copy.default,
    aten.alias.default,
    aten.detach.default,
    aten.contiguous.default,
    aten.lift_fresh_copy.default,
}
_SUMS = {aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default}
_MAXES = {aten.amax.default: "max", aten.amin.default: "min"}
_NEEDS_WHOLE_DIM = {aten.var_mean.correction, aten.var.correction, aten.std.correction}
_LINEAR_IN_EACH = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default}
#: linear in their first operand when the others are numbers (a Partial stays Partial);
#: scaled by a tensor, a Partial is reduced first, as Megatron reduces a layer's partial sums
#: before the next layer reads them
_LINEAR_IN_ONE = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}


class _Need(Exception):
    """A rule's request: these input placements (the engine redistributes and reruns)."""


def _a(n: Node) -> Any:
    """A node's arguments, untyped (fx's argument type is a wide union)."""
    return n.args


def _k(n: Node) -> Any:
    return n.kwargs


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _view_rule(src: tuple[int, ...], dst: tuple[int, ...], p: Placement, tp: int, where: str):
    """The placement of ``view(x, dst)`` for ``x`` of shape ``src`` sharded as ``p``."""
    # group src and dst dims into runs of equal product
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        a, b = [i], [j]
        pa = src[i] if i < len(src) else 1
        pb = dst[j] if j < len(dst) else 1
        i += 1
        j += 1
        while pa != pb:
            if pa < pb:
                pa *= src[i]
                a.append(i)
                i += 1
            else:
                pb *= dst[j]
                b.append(j)
                j += 1
        groups.append(([k for k in a if k < len(src)], [k for k in b if k < len(dst)]))
    for a, b in groups:
        if p.dim not in a:
            continue
        # the factor's stride over the whole group, then the out dim it starts in
        g = p.inner * math.prod(src[k] for k in a if k > p.dim)
        acc = 1
        for pos in range(len(b) - 1, -1, -1):
            k = b[pos]
            if g < acc * dst[k]:
                if g % acc:
                    break
                inner = g // acc
                if inner * p.factor <= dst[k]:  # the factor lies inside this dim
                    return Placement("S", k, p.factor, inner)
                # the factor spans this dim and outer ones: shard the outermost it reaches
                span = dst[k] // inner
                while span < p.factor and pos > 0:
                    pos -= 1
                    span *= dst[b[pos]]
                kk = b[pos]
                if inner != 1 or span != p.factor or dst[kk] % tp:
                    break
                return Placement("S", kk, dst[kk], 1)
            acc *= dst[k]
        break
    raise PlanError(
        f"--tp {tp} cannot shard {where}: the view {tuple(src)} → {tuple(dst)} splits the "
        f"sharded dim {p.dim} into parts {tp} does not divide (heads, KV heads, hidden or "
        "vocabulary): choose a --tp that divides them"
    )


class _Engine:
    """Placement propagation over one graph (see the module docstring)."""

    def __init__(
        self,
        gm: GraphModule,
        tp: int,
        phase: str,
        init: dict[str, Placement],
        boundary: Callable[[Node, Node, Placement, bool], Placement | None],
        params: set[str],
        grad_of: Callable[[Node], Placement | None],
        vocab: set[str],
    ):
        self.gm, self.tp, self.phase, self.vocab = gm, tp, phase, vocab
        self.grad_reads = 0
        self.init, self.boundary, self.grad_of = init, boundary, grad_of
        self.of: dict[str, Any] = {}
        self.cost: dict[str, NodeCost] = {}
        self.collectives: list[Collective] = []
        self.local_bytes: dict[str, int] = {}
        self.param = set(params)  # nodes computed from parameters only
        self.moved_to: dict[str, Placement] = {}
        #: Partial values some consumer reduces: every consumer reads the reduced value
        self.reduce_early: set[str] = set()
        self._moved: dict[tuple[str, Placement], Placement] = {}

    # redistribution ------------------------------------------------------------------------
    def move(self, a: Node, src: Placement, dst: Placement) -> Placement:
        """Redistribute ``a`` from ``src`` to ``dst`` (once per value and target)."""
        if src == dst or (src.kind == "S" and dst.kind == "S" and src.dim == dst.dim):
            return src
        if src.kind == "R" or dst.kind == "P" and src.kind != "P":
            return dst  # a local slice (or the Replicate → Partial view of a value): no comm
        key = (a.name, dst)
        if key in self._moved:
            return dst
        self._moved[key] = dst
        self.moved_to[a.name] = dst
        v = a.meta["val"]
        n = v.numel()
        kind = {
            ("P", "R"): "all_reduce",
            ("P", "S"): "reduce_scatter",
            ("S", "R"): "all_gather",
            ("S", "S"): "all_to_all",
        }[(src.kind, dst.kind)]
        self.collectives.append(Collective(kind, "tp", self.tp, n, _dtype(v), self.phase, a.name))
        return dst

    # the walk ------------------------------------------------------------------------------
    def run(self) -> Placements:
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                self.of[n.name] = self.init.get(n.name, REPLICATE)
                self.cost[n.name] = ZERO_COST
            elif n.op == "call_function":
                self._call(n)
            elif n.op == "output":
                self._output(n)
            self._bytes(n)
        return Placements(self.of, self.cost, self.collectives, self.local_bytes, self.moved_to)

    def _bytes(self, n: Node) -> None:
        v, p = n.meta.get("val"), self.of.get(n.name)
        if isinstance(v, torch.Tensor) and isinstance(p, Placement):
            self.local_bytes[n.name] = _numel(local_shape(v.shape, p, self.tp)) * v.element_size()

    def _input(self, n: Node, a: Node) -> Placement:
        p = self.of[a.name]
        if not isinstance(p, Placement):
            return p
        if a.name in self.param:
            return p
        if p.kind == "P" and a.name in self.reduce_early:
            p = self.move(a, p, REPLICATE)
        q = self.boundary(a, n, p, self.phase == "forward")
        return self.move(a, p, q) if q is not None else p

    def _call(self, n: Node) -> None:
        if n.target is operator.getitem:
            src, i = _a(n)
            self.of[n.name] = self.of[src.name][i]
            self.cost[n.name] = ZERO_COST
            if src.name in self.param:
                self.param.add(n.name)
            return
        nodes = [a for a in n.all_input_nodes]
        if nodes and all(a.name in self.param for a in nodes):
            self.param.add(n.name)
        flat, spec = tree_flatten((_a(n), _k(n)))
        tensors = [
            k for k, a in enumerate(flat) if isinstance(a, Node) and _is_tensor(a.meta.get("val"))
        ]
        ins = {k: self._input(n, flat[k]) for k in tensors}
        try:
            out, need = _rule(n, flat, ins, self.tp, self.param, self.vocab)
        except PlanError as e:
            e.node = e.node or n.name  # for the caller's diagnosis (a fused projection)
            raise
        for k, q in need.items():
            ins[k] = self.move(flat[k], ins[k], q)
        self.of[n.name] = out
        self.cost[n.name] = self._local_cost(n, flat, spec, ins, out)

    def _local_cost(self, n, flat, spec, ins, out) -> NodeCost:
        if self.tp == 1 or all(p == REPLICATE for p in ins.values()) and _all_r(out):
            from graphflop.meta import COST

            return n.meta.get(COST, ZERO_COST)
        local = list(flat)
        for k, p in ins.items():
            v = flat[k].meta["val"]
            local[k] = torch.empty(local_shape(v.shape, p, self.tp), dtype=v.dtype, device="meta")
        args, kwargs = tree_unflatten(local, spec)
        lo = _local_out(n.meta.get("val"), out, self.tp)
        try:
            return op_cost(n.target, args, kwargs, lo)
        except Exception:  # a rule that reads a value of the global shape: scale by the output
            from graphflop.meta import COST

            c = n.meta.get(COST, ZERO_COST)
            return c if _all_r(out) else _scale(c, 1 / self.tp)

    def _output(self, n: Node) -> None:
        flat, _ = tree_flatten(_a(n))
        for a in flat:
            if not isinstance(a, Node) or not _is_tensor(a.meta.get("val")):
                continue
            want = self.grad_of(a)
            have = self.of[a.name]
            if want is None:
                continue
            if have.kind == "P" and want.kind == "R" and self.grad_reads:
                # a replicated parameter's partial gradient stays partial; the optimizer
                # reduces it each time it reads it (DTensor redistributes per op)
                v = a.meta["val"]
                self.collectives += [
                    Collective(
                        "all_reduce", "tp", self.tp, v.numel(), _dtype(v), "optimizer", a.name
                    )
                ] * self.grad_reads
                continue
            self.move(a, have, want)


def _scale(c: NodeCost, f: float) -> NodeCost:
    return NodeCost(
        flops=round(c.flops * f),
        mm_flops=round(c.mm_flops * f),
        transcendentals=round(c.transcendentals * f),
        random_elements=round(c.random_elements * f),
        bytes_read=round(c.bytes_read * f),
        bytes_written=round(c.bytes_written * f),
    )


def _all_r(out: Any) -> bool:
    if isinstance(out, Placement):
        return out == REPLICATE
    return all(_all_r(o) for o in out)


def _local_out(v: Any, p: Any, tp: int) -> Any:
    if isinstance(v, torch.Tensor):
        pl = p if isinstance(p, Placement) else REPLICATE
        return torch.empty(local_shape(v.shape, pl, tp), dtype=v.dtype, device="meta")
    if isinstance(v, (tuple, list)):
        ps = p if isinstance(p, (tuple, list)) else [p] * len(v)
        return type(v)(_local_out(x, q, tp) for x, q in zip(v, ps, strict=False))
    return v


def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _shape(a: Node) -> tuple[int, ...]:
    return tuple(int(x) for x in a.meta["val"].shape)


def _rule(  # noqa: C901 (one dispatch over the op families)
    n: Node, flat: list, ins: dict[int, Placement], tp: int, params: set[str], vocab: set[str]
) -> tuple[Any, dict[int, Placement]]:
    """(output placement, input placements needed) of one op."""
    t = n.target
    val: Any = n.meta.get("val")
    where = f"{n.meta.get(MODULE) or 'the model'} ({n.name})"
    ks = list(ins)
    if not ks:
        return _replicated(val), {}
    if t in (aten.embedding_dense_backward.default, aten.index_put.default) and (
        n.meta.get(MODULE) in vocab
    ):
        # a vocabulary-parallel embedding's weight cotangent: each rank scatters into its rows
        need = {k: REPLICATE for k in ks if ins[k].kind != "R"}
        if t is aten.index_put.default:
            need[ks[0]] = shard(0, int(val.shape[0]))
        return shard(0, int(val.shape[0])), need
    if t is aten.embedding_dense_backward.default and ins[ks[0]].kind == "S":
        # a width-sharded embedding's weight cotangent (ColwiseParallel shards an embedding's
        # weight on dim 1): the output cotangent sharded on its last dim scatters into the
        # rank's columns
        g = ins[ks[0]]
        if g.dim == len(_shape(flat[ks[0]])) - 1:
            return shard(1, int(val.shape[1])), {k: REPLICATE for k in ks[1:]}
    if t is aten.index_put.default and ins[ks[-1]].kind == "S":
        # an embedding's weight cotangent scattered into zeros, values sharded on a dim the
        # indices do not pick (ColwiseParallel's width-sharded embedding): each rank scatters
        # its columns (values' dims: the indices' shape, then self's dims past those indexed)
        picked = [i for i in _a(n)[1] if i is not None]
        idx_nd = max((len(_shape(i)) for i in picked), default=0)
        out_dim = ins[ks[-1]].dim - idx_nd + len(_a(n)[1])
        if ins[ks[-1]].dim >= idx_nd and len(_a(n)[1]) <= out_dim < len(val.shape):
            out = shard(out_dim, int(val.shape[out_dim]))
            return out, {ks[0]: out, **{k: REPLICATE for k in ks[1:-1]}}
    x = flat[ks[0]]
    p = ins[ks[0]]
    if all(q == REPLICATE for q in ins.values()):
        return _replicated(val), {}
    if t in _VIEWS:
        if p.kind != "S":
            return p, {}
        return _view_rule(_shape(x), tuple(int(s) for s in val.shape), p, tp, where), {}
    if t in _SAME:
        return p, {}
    if t is aten.permute.default:
        if p.kind != "S":
            return p, {}
        perm = [_norm(d, len(val.shape)) for d in _a(n)[1]]
        return replace(p, dim=perm.index(p.dim)), {}
    if t in (aten.transpose.int, aten.t.default):
        if p.kind != "S":
            return p, {}
        nd = len(val.shape)
        d0, d1 = (0, 1) if t is aten.t.default else (_norm(_a(n)[1], nd), _norm(_a(n)[2], nd))
        d = d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim
        return replace(p, dim=d), {}
    if t is aten.unsqueeze.default:
        d = _norm(_a(n)[1], len(val.shape))
        return (replace(p, dim=p.dim + (d <= p.dim)) if p.kind == "S" else p), {}
    if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        if p.kind != "S":
            return p, {}
        src = _shape(x)
        dims = (
            [_norm(d, len(src)) for d in (_a(n)[1] if isinstance(_a(n)[1], list) else [_a(n)[1]])]
            if len(_a(n)) > 1
            else [i for i, s in enumerate(src) if s == 1]
        )
        dims = [d for d in dims if src[d] == 1]
        return replace(p, dim=p.dim - sum(d < p.dim for d in dims)), {}
    if t is aten.expand.default:
        if p.kind == "P":  # reduce the small value, not its broadcast
            return REPLICATE, {ks[0]: REPLICATE}
        shift = len(val.shape) - len(_shape(x))
        return (replace(p, dim=p.dim + shift) if p.kind == "S" else p), {}
    if t in _SUMS or t in _MAXES or t in _NEEDS_WHOLE_DIM:
        return _reduction(n, t, x, p, ks[0], val)
    if t in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        return _matmul(n, flat, ins, ks, params)
    if t is aten.embedding.default:
        w = ins[ks[0]]
        if w.kind == "S" and w.dim == 0:
            return PARTIAL, {ks[1]: REPLICATE}
        if w.kind == "S":
            return shard(len(val.shape) - 1, int(val.shape[-1])), {ks[1]: REPLICATE}
        return _elementwise(n, flat, ins, ks, val)
    if t is aten.gather.default and p.kind == "S":
        d = _norm(_a(n)[1], len(_shape(x)))
        if p.dim == d:  # a vocabulary-parallel pick: each rank its hits, zero elsewhere
            return PARTIAL, {ks[1]: REPLICATE}
        return replace(p, factor=int(val.shape[p.dim])), {ks[1]: p}
    if t is aten.cat.default:
        return _cat(n, flat, ins, ks, val)
    if t in (aten.split.Tensor, aten.split_with_sizes.default):
        return _split(n, x, p, val, tp, where)
    if t in (aten.slice_scatter.default, aten.select_scatter.default) and len(ks) == 2:
        # a cotangent scattered into zeros along another dim (the backward of a slice)
        part = ins[ks[1]]
        d = _norm(_a(n)[2] if len(_a(n)) > 2 else _k(n).get("dim", 0), len(val.shape))
        if part.kind == "S":
            sd = part.dim + (t is aten.select_scatter.default and d <= part.dim)
            if sd != d:
                out = replace(
                    part, dim=sd, factor=int(val.shape[sd]) if part.inner == 1 else part.factor
                )
                return out, {ks[0]: out}
    if t in (aten.slice.Tensor, aten.select.int) and p.kind == "S":
        d = _norm(_a(n)[1] if len(_a(n)) > 1 else 0, len(_shape(x)))
        if d != p.dim:
            dim = p.dim - (t is aten.select.int and d < p.dim)
            return replace(p, dim=dim), {}
        return REPLICATE, {ks[0]: REPLICATE}
    if isinstance(val, torch.Tensor) and all(
        _broadcastable(_shape(flat[k]), tuple(val.shape)) for k in ks
    ):
        return _elementwise(n, flat, ins, ks, val)
    return _replicated(val), {k: REPLICATE for k in ks}


def _replicated(val: Any) -> Any:
    if isinstance(val, (tuple, list)):
        return tuple(REPLICATE for _ in val)
    return REPLICATE


def _broadcastable(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    if len(src) > len(dst):
        return False
    return all(s in (1, d) for s, d in zip(reversed(src), reversed(dst), strict=False))


def _elementwise(n, flat, ins, ks, val) -> tuple[Placement, dict[int, Placement]]:
    nd = len(val.shape)
    out_shape = tuple(int(s) for s in val.shape)
    target = None
    best = -1
    for k in ks:
        q = ins[k]
        s = _shape(flat[k])
        if q.kind == "S":
            d = q.dim + nd - len(s)
            if s[q.dim] == out_shape[d] and _numel(s) > best:
                target, best = replace(q, dim=d), _numel(s)
    need: dict[int, Placement] = {}
    if target is not None:
        for k in ks:
            q = ins[k]
            s = _shape(flat[k])
            d = target.dim - (nd - len(s))
            full = d >= 0 and s[d] == out_shape[target.dim]
            if q.kind == "S" and q.dim + nd - len(s) == target.dim and full:
                continue
            if not full:
                if q.kind != "R":
                    need[k] = REPLICATE
                continue
            need[k] = replace(target, dim=d)
        return target, need
    partial = [k for k in ks if ins[k].kind == "P"]
    t = n.target
    linear = (t in _LINEAR_IN_EACH and len(partial) == len(ks)) or (
        t in _LINEAR_IN_ONE and len(ks) == 1 and partial == ks[:1]
    )
    if linear and all(ins[k].reduce == "sum" for k in partial):
        return PARTIAL, {}
    return REPLICATE, {k: REPLICATE for k in partial}


def _reduction(n, t, x, p, k0, val) -> tuple[Any, dict[int, Placement]]:
    src = _shape(x)
    nd = len(src)
    dims_arg = _a(n)[1] if len(_a(n)) > 1 else None
    if t in (aten.sum.default, aten.mean.default) or dims_arg in (None, []):
        dims = list(range(nd))
    else:
        dims = [_norm(d, nd) for d in (dims_arg if isinstance(dims_arg, list) else [dims_arg])]
    keep = bool(_k(n).get("keepdim", _a(n)[2] if len(_a(n)) > 2 else False))
    if p.kind == "P":
        if t in _SUMS and p.reduce == "sum":
            return PARTIAL, {}
        return _replicated(val), {k0: REPLICATE}
    if p.dim in dims:
        if t in _SUMS:
            return PARTIAL, {}
        if t in _MAXES:
            return Placement("P", reduce=_MAXES[t]), {}
        return _replicated(val), {k0: REPLICATE}
    dim = p.dim if keep else p.dim - sum(d < p.dim for d in dims)
    out = replace(p, dim=dim)
    return (tuple(out for _ in val) if isinstance(val, (tuple, list)) else out), {}


def _cat(n, flat, ins, ks, val) -> tuple[Placement, dict[int, Placement]]:
    nd = len(val.shape)
    d = _norm(_a(n)[1] if len(_a(n)) > 1 else _k(n).get("dim", 0), nd)
    ps = [ins[k] for k in ks]
    if all(q.kind == "S" and q.dim == ps[0].dim for q in ps):
        if ps[0].dim != d:
            return ps[0], {}
        # the parts of a fused projection's cotangent: Megatron's layout again
        return shard(d, int(val.shape[d])), {}
    if all(q.kind == "P" for q in ps):
        return PARTIAL, {}
    return REPLICATE, {k: REPLICATE for k in ks}


def _split(n, x, p, val, tp, where) -> tuple[Any, dict[int, Placement]]:
    src = _shape(x)
    d = _norm(_a(n)[2] if len(_a(n)) > 2 else _k(n).get("dim", 0), len(src))
    if p.kind != "S" or d != p.dim:
        return tuple(p for _ in val), {}
    # a fused projection split on its sharded dim: each rank's slice holds its share of every
    # part (Megatron's layout of a fused QKV weight)
    outs = []
    for v in val:
        size = int(v.shape[d])
        if size % tp:
            raise PlanError(
                f"--tp {tp} cannot shard {where}: a part of size {size} of the split of a "
                f"sharded dim is not divisible by it: choose a --tp that divides {size}"
            )
        outs.append(shard(d, size))
    return tuple(outs), {}


def _matmul(n, flat, ins, ks, params) -> tuple[Placement, dict[int, Placement]]:  # noqa: C901
    """mm (M,K)@(K,N), addmm (bias + mm), bmm (B,M,K)@(B,K,N)."""
    t = n.target
    bias_k = ks[0] if t is aten.addmm.default else None
    ka, kb = (ks[1], ks[2]) if bias_k is not None else (ks[0], ks[1])
    a, b = ins[ka], ins[kb]
    need: dict[int, Placement] = {}
    val: Any = n.meta["val"]
    off = 1 if t is aten.bmm.default else 0
    sa, sb = _shape(flat[ka]), _shape(flat[kb])

    def act(k):  # the activation (not parameter-derived) operand is the one to gather
        return flat[k].name not in params

    if off and (a.kind == "S" and a.dim == 0 or b.kind == "S" and b.dim == 0):
        # batched over a sharded batch dim (attention heads)
        tgt = a if a.kind == "S" and a.dim == 0 else b
        for k, q in ((ka, a), (kb, b)):
            if not (q.kind == "S" and q.dim == 0):
                need[k] = replace(tgt, factor=tgt.factor)
        return tgt, need
    for k, q in ((ka, a), (kb, b)):
        if q.kind == "P" and (a.kind != "R" and b.kind != "R"):
            need[k] = REPLICATE
    a = need.get(ka, a)
    b = need.get(kb, b)
    rows, red_a, red_b, cols = off, off + 1, off, off + 1
    if a.kind == "P" or b.kind == "P":
        out = PARTIAL
    elif a.kind == "R" and b.kind == "R":
        out = REPLICATE
    elif a.kind == "S" and b.kind == "S" and a.dim == red_a and b.dim == red_b:
        out = PARTIAL
    elif a.kind == "R" and b.kind == "S":
        if b.dim == cols:
            out = shard(cols, int(val.shape[cols]))
        else:  # contraction sharded on b: slice a locally
            need[ka] = shard(red_a, sa[red_a])
            out = PARTIAL
    elif a.kind == "S" and b.kind == "R":
        if a.dim == rows:
            out = replace(a)
        else:
            need[kb] = shard(red_b, sb[red_b])
            out = PARTIAL
    else:  # both sharded, not on the contraction: gather the activation
        k = ka if act(ka) else kb
        need[k] = REPLICATE
        return _matmul_again(n, flat, ins, ks, params, need)
    if bias_k is not None:
        bq = ins[bias_k]
        if out.kind == "S" and out.dim == len(val.shape) - 1:
            if not (bq.kind == "S"):
                need[bias_k] = shard(0, _shape(flat[bias_k])[0])
        elif bq.kind != "R":
            need[bias_k] = REPLICATE
    return out, need


def _matmul_again(n, flat, ins, ks, params, need):
    ins2 = dict(ins)
    ins2.update(need)
    out, more = _matmul(n, flat, ins2, ks, params)
    return out, {**need, **more}


def propagate(
    gm: GraphModule,
    tp: int,
    *,
    phase: str,
    init: dict[str, Placement],
    boundary: Callable[[Node, Node, Placement, bool], Placement | None],
    params: set[str],
    grad_of: Callable[[Node], Placement | None] = lambda a: None,
    vocab: frozenset[str] = frozenset(),
    grad_reads: int = 0,
) -> Placements:
    """Placements of every value of ``gm`` over a TP group of ``tp`` ranks.

    Args:
        gm: a forward or backward graph (nodes with ``val``).
        tp: the TP degree.
        phase: ``forward`` or ``backward`` (the phase of the collectives).
        init: placeholder name → placement (others Replicate).
        boundary: ``(value, consumer, placement, forward) -> placement`` the consumer needs
            at a module boundary, or None: the TP plan's module layouts.
        params: placeholder names of parameters (never redistributed at a boundary).
        grad_of: an output value → the placement it must have (a parameter's gradient: its
            parameter's), or None.
        vocab: modules whose embedding the plan shards by vocabulary rows (their weight
            gradient, ``embedding_dense_backward``, is then sharded on dim 0).
        grad_reads: where a replicated parameter's gradient comes out partial (a norm's weight
            under sequence parallelism), the all_reduces the optimizer makes of it, phase
            ``optimizer`` (DTensor reduces it at each op reading it); 0: one all_reduce in
            the backward.

    Raises:
        PlanError: a sharded dim that ``tp`` does not divide (heads, KV heads, hidden,
            vocabulary).
    """
    first = _Engine(gm, tp, phase, init, boundary, params, grad_of, set(vocab))
    first.run()
    again = _Engine(gm, tp, phase, init, boundary, params, grad_of, set(vocab))
    again.grad_reads = grad_reads
    again.reduce_early = {
        c.at for c in first.collectives if c.kind == "all_reduce" and c.phase == phase
    }
    return again.run()
