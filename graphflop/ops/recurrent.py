"""Recurrent layers (LSTM, GRU, RNN and their cells): no rules of their own, they are traced as
their parts, so every time step's matrix products are counted (``mm_flops``), the first step's
hidden product included, as PyTorch computes it, and the gates elementwise
(docs/flops_conventions.md).

Two things make that possible:

* PyTorch's C++ decomposition of the recurrent layers runs inside ``torch.func.functionalize``
  but leaves some in-place ops on fresh temporaries in the graph (``gates.add_(...)``,
  ``sigmoid_``, ``tanh_``, ``mul_``; other composite kernels do the same, ``rms_norm`` its
  ``add_``). Tracing rewrites each into its functional twin (:func:`functionalize_inplace`,
  exact when nothing reads the overwritten value or another alias of it afterwards; any ATen op
  writing only its first argument has one, :func:`inplace_twin`); one it cannot rewrite keeps
  its twin's rule where :data:`INPLACE_TWINS` lists it (the same cost, a JVP that emits the
  functional op on tangents). A write into slices of a tensor the graph made (circular
  padding's ``copy_`` into an ``empty`` one) becomes the functional op and a ``slice_scatter``
  of its result into that tensor. A write left in place that a later node reads through
  another alias is a dependence the graph's edges do not show (:func:`hidden_writes`): the
  JVP marks it a gap rather than miss it.
* On CPU float32 tensors PyTorch routes an LSTM layer to ``aten.mkldnn_rnn_layer``, one fused
  kernel; graphflop decomposes it (:func:`mkldnn_rnn_layer`) into the same per-step products
  and gates as on every other device and dtype, so an LSTM counts the same everywhere.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

from graphflop.ops import elementwise, shape  # noqa: F401  (the functional rules must exist first)
from graphflop.ops.registry import all_rules, register, register_decomposition

aten = torch.ops.aten

#: in-place op -> its functional twin, for the in-place ops recurrent decompositions leave
INPLACE_TWINS: dict[Any, Any] = {
    aten.add_.Tensor: aten.add.Tensor,
    aten.sub_.Tensor: aten.sub.Tensor,
    aten.mul_.Tensor: aten.mul.Tensor,
    aten.sigmoid_.default: aten.sigmoid.default,
    aten.tanh_.default: aten.tanh.default,
    aten.relu_.default: aten.relu.default,
    # in-place view ops that composite C++ kernels apply to their temporaries, below
    # functionalization (matmul's vector-matrix case squeezes its product in place; a GRU or RNN
    # with batch_first transposes its output back in place and keeps using the tensor, not the
    # value the op returns): traced in place, so the fake tensor changes shape as the caller
    # expects, then rewritten into the functional view like the ops above
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.squeeze_.default: aten.squeeze.default,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}


def functional_form(op: Any) -> Any:
    """The functional twin of an in-place op in :data:`INPLACE_TWINS`, else ``op``."""
    return INPLACE_TWINS.get(op, op)


def inplace_twin(op: Any) -> Any:
    """The functional twin of an in-place ATen op that writes its first argument only: from
    :data:`INPLACE_TWINS`, else by name (``aten.add_.Scalar`` -> ``aten.add.Scalar``: the ops a
    C++ composite kernel applies to its temporaries, as ``rms_norm`` does with ``add_``); None
    for any other op."""
    twin = INPLACE_TWINS.get(op)
    if twin is not None or not isinstance(op, torch._ops.OpOverload):
        return twin
    packet = op.overloadpacket.__name__
    if (
        op.namespace != "aten"
        or not packet.endswith("_")
        or packet.startswith("_")
        or packet in _NOT_TWINNED
    ):
        return None
    args = op._schema.arguments
    writes = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
    if len(writes) != 1 or writes[0] is not args[0]:
        return None
    functional = getattr(getattr(aten, packet[:-1], None), op._overloadname, None)
    if not isinstance(functional, torch._ops.OpOverload):
        return None
    same = [(a.name, str(a.type)) for a in functional._schema.arguments] == [
        (a.name, str(a.type)) for a in args
    ]
    return functional if same else None  # pow_.Scalar is not pow.Scalar


#: in-place ops that are not their functional twin applied to a temporary: storage changes
#: (``copy_`` is: a write into a buffer is made a buffer update before, and only writes into
#: temporaries are rewritten)
_NOT_TWINNED = frozenset({"set_", "resize_", "resize_as_", "swap_"})


#: ops whose output aliases their first argument (for :func:`functionalize_inplace`)
_VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.squeeze.dims,
    aten.squeeze.dim,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.permute.default,
    aten.t.default,
    aten.transpose.int,
    aten.expand.default,
    aten.alias.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.chunk.default,
}


#: views whose getitems are disjoint pieces of their input
_SPLITS = {
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.chunk.default,
}


def _is_view(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and (n.target in _VIEWS or n.target is operator.getitem)


def _chain(x: torch.fx.Node) -> list[torch.fx.Node]:
    """``x`` and the values it is a view of, innermost first."""
    chain = [x]
    while _is_view(chain[-1]) and isinstance(chain[-1].args[0], torch.fx.Node):
        chain.append(chain[-1].args[0])
    return chain


def _overlapping(x: torch.fx.Node) -> set[torch.fx.Node]:
    """Every value sharing memory with ``x`` (other than ``x``): what it views and the other
    views of those, leaving out the disjoint pieces of a split."""
    chain = _chain(x)
    out: set[torch.fx.Node] = set(chain[1:])
    stack = [u for u in x.users if _is_view(u)]
    for a, inner in zip(chain[1:], chain):
        if a.target in _SPLITS:
            continue  # the other pieces of a split are disjoint from ``inner``
        stack += [u for u in a.users if _is_view(u) and u is not inner]
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack += [u for u in n.users if _is_view(u)]
    return out


def functionalize_inplace(graph: torch.fx.Graph) -> int:
    """Rewrite ``y = op_(x, ...)`` (an op with an :func:`inplace_twin`) into ``y = op(x, ...)``
    wherever that is exact: no alias of
    ``x`` other than ``x`` itself is read after the node, and later readers of ``x`` are
    pointed at ``y``. Where ``x`` is slices and selects of a tensor the graph made,
    the write is a write into that tensor: ``y = op(x, ...)`` scattered back into it
    (:func:`_scatter_back`), as functionalization would. Returns the number of nodes
    rewritten; the others keep their in-place op (and :data:`INPLACE_TWINS`' rules)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for n in list(graph.nodes):
        twin = inplace_twin(n.target) if n.op == "call_function" and n.args else None
        x = n.args[0] if twin is not None else None
        if not isinstance(x, torch.fx.Node):
            continue
        if n.target not in INPLACE_TWINS and x.op == "placeholder":
            continue  # a write into an input: only a temporary's is a functional op
        aliases = _overlapping(x)
        if any(order[u] > order[n] and not _is_view(u) for a in aliases for u in a.users):
            if _scatter_back(graph, n, twin, order):
                order = {m: i for i, m in enumerate(graph.nodes)}
                done += 1
            continue  # another alias of x is read after the write: keep it in place
        n.target = twin
        for u in [u for u in x.users if order[u] > order[n]]:
            u.replace_input_with(x, n)
        done += 1
    return done


#: view op -> the op writing a value into that view of its input, same arguments after ``src``
_SCATTERS: dict[Any, Any] = {
    aten.slice.Tensor: aten.slice_scatter.default,
    aten.select.int: aten.select_scatter.default,
}


def _scatter_back(
    graph: torch.fx.Graph, n: torch.fx.Node, twin: Any, order: dict[torch.fx.Node, int]
) -> bool:
    """Rewrite in-place ``n`` (``op_(x, ...)``, ``x`` a chain of :data:`_SCATTERS` views of a
    base tensor the graph made) into ``y = op(x, ...)`` and the base's new value,
    ``base' = slice_scatter(base, y, ...)`` (``select_scatter``) through the chain, every
    reader of the base after ``n`` then reading ``base'``. This is what a composite kernel's write into a new
    tensor means (``_pad_circular`` copies slices of its input and of itself into an ``empty``
    one, below functionalization) and what ``torch.func.functionalize`` makes of it above.

    Exact when no alias of the base made before ``n`` but the chain itself is read after
    ``n`` (readers of views made after it read the new base); False, and nothing changed,
    otherwise, or where the base is an input (a graph placeholder or attribute) or the chain
    has another view."""
    chain = _chain(n.args[0])  # type: ignore[arg-type]
    base = chain[-1]
    if not _fresh(base) or any(v.target not in _SCATTERS for v in chain[:-1]):
        return False
    if any(order[u] > order[n] for v in chain for u in v.users if v is not base):
        return False  # the written view (or one on the way) is read after the write
    earlier = [a for a in _overlapping(base) | {base} if order[a] < order[n]]
    if any(order[u] > order[n] for a in earlier if a is not base for u in a.users):
        return False  # a view taken before the write is read after it
    later = [u for u in base.users if order[u] > order[n]]
    n.target = twin
    value, at = n, n
    for view, parent in zip(chain, chain[1:]):
        with graph.inserting_after(at):
            value = at = graph.call_function(
                _SCATTERS[view.target], (parent, value, *view.args[1:]), dict(view.kwargs)
            )
        value.meta = {**n.meta, "val": parent.meta.get("val")}
    for u in later:
        u.replace_input_with(base, value)
    return True


def _fresh(n: torch.fx.Node) -> bool:
    """Whether ``n`` is a tensor of its own: made by an op whose output aliases none of its
    inputs (not a view, not an in-place op's result, not a graph input)."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    return not any(r.alias_info is not None for r in n.target._schema.returns)


def hidden_writes(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Node -> the in-place nodes left in ``graph`` (after :func:`functionalize_inplace`) that
    wrote, before it, into memory one of its arguments shares, other than through the
    in-place node's own result: a dependence the graph's edges do not show. A derivative
    pass that follows only the edges would miss it (the tangent of the written value never
    reaches the reader), so it must treat each such write as cut."""
    written: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    overload = torch._ops.OpOverload
    if not _writers_filed(graph, overload):  # a functional graph (the usual case)
        return {}
    # per op (by identity: an OpOverload's hash is a Python method, a call per node otherwise)
    # the positions it writes
    by_op: dict[int, tuple[int, ...]] = {}
    for m in graph.nodes:
        t = m.target
        at = by_op.get(id(t))
        if at is None:
            at = by_op[id(t)] = _written_args(t) if isinstance(t, overload) else ()
        if not at or m.op != "call_function":
            continue
        for i in at:
            value = m.args[i] if i < len(m.args) else None
            if isinstance(value, torch.fx.Node):
                for a in _overlapping(value) | {value}:
                    written.setdefault(a, []).append(m)
    out: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    if not written:  # a functional graph (the usual case): nothing to look for
        return out
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        hits = [m for a in n.all_input_nodes for m in written.get(a, ()) if order[m] < order[n]]
        if hits:
            out[n] = list(dict.fromkeys(hits))
    return out


def _writers_filed(graph: torch.fx.Graph, overload: type) -> bool:
    """Whether ``graph`` may hold an op writing into an argument: looked up per op in fx's
    table of the graph's nodes by op and target (``find_nodes``' table: a row per distinct
    target, not a walk over every node); True where this torch.fx has no such table."""
    table = getattr(getattr(graph, "_find_nodes_lookup_table", None), "table", None)
    if not isinstance(table, dict):  # pragma: no cover - a torch.fx without the table
        return True
    return any(
        row and key[0] == "call_function" and isinstance(key[1], overload) and _written_args(key[1])
        for key, row in table.items()
    )


@functools.cache
def _written_args(op: torch._ops.OpOverload) -> tuple[int, ...]:
    """The positions of the arguments ``op``'s schema says it writes into."""
    return tuple(
        i
        for i, arg in enumerate(op._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def _register_twins() -> None:
    rules = all_rules()
    for inplace, functional in INPLACE_TWINS.items():
        r = rules[functional]
        register(
            inplace,
            r.family,
            r.cost,
            bytes=r.bytes,
            jvp=r.jvp,
            transpose=r.transpose,
            zero_derivative=r.zero_derivative,
        )


_register_twins()


@register_decomposition(aten.mkldnn_rnn_layer.default)
def mkldnn_rnn_layer(
    inp: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor,
    b_hh: torch.Tensor,
    hx: torch.Tensor,
    cx: torch.Tensor,
    reverse: bool,
    batch_sizes: list[int],
    mode: int,
    hidden_size: int,
    num_layers: int,
    has_biases: bool,
    bidirectional: bool,
    batch_first: bool,
    train: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LSTM layer over ``inp`` (T, B, I) from ``hx``, ``cx`` ((1,) B, H), as PyTorch's
    generic LSTM computes it per step t: ``gates = x_t·W_ihᵀ + b_ih + h·W_hhᵀ + b_hh``
    (4H wide: input, forget, cell, output), ``c = σ(f)·c + σ(i)·tanh(g)``,
    ``h = σ(o)·tanh(c)``. Returns ``(y (T, B, H), hy, cy, workspace)``; the workspace is
    oneDNN's (:func:`onednn_lstm_workspace_bytes`, uint8) where ``train`` and float32, else empty: nothing
    in the graph reads it, but eager autograd saves it (``MkldnnRnnLayerBackward0``'s
    ``result3``; :data:`graphflop.frontend.composite.EAGER_SAVES`)."""
    if mode != 2 or batch_sizes:  # PyTorch uses the kernel for dense LSTMs only
        raise NotImplementedError("mkldnn_rnn_layer: only dense LSTM layers are decomposed")
    # the caller has already laid the input out as (T, B, I) and splits layers and
    # directions: num_layers, bidirectional and batch_first describe the whole module
    h, c = hx.reshape(hx.shape[-2:]), cx.reshape(cx.shape[-2:])
    w_ih_t, w_hh_t = w_ih.t(), w_hh.t()
    steps = range(inp.shape[0] - 1, -1, -1) if reverse else range(inp.shape[0])
    outs: list[torch.Tensor] = []
    for t in steps:
        if has_biases:
            gates = torch.addmm(b_ih, inp[t], w_ih_t) + torch.addmm(b_hh, h, w_hh_t)
        else:
            gates = torch.mm(inp[t], w_ih_t) + torch.mm(h, w_hh_t)
        i, f, g, o = gates.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    if reverse:
        outs.reverse()
    y = torch.stack(outs, 0)
    n_steps, rows, width = inp.shape
    float32 = inp.dtype == torch.float32  # (bfloat16's workspace is laid out otherwise)
    nbytes = (
        onednn_lstm_workspace_bytes(n_steps, rows, width, hidden_size) if train and float32 else 0
    )
    workspace = inp.new_empty((nbytes,), dtype=torch.uint8)
    return y, h.reshape(hx.shape), c.reshape(cx.shape), workspace


def _good_ld(n: int, itemsize: int = 4) -> int:
    """oneDNN's leading dimension for ``n`` elements (``rnn_utils::get_good_ld``): rounded up
    to 64 bytes, plus 64 bytes where that is a multiple of 256 elements (4K aliasing)."""
    ld = -(-n // (64 // itemsize)) * (64 // itemsize)
    return ld + 64 // itemsize if ld % 256 == 0 else ld


def onednn_lstm_workspace_bytes(steps: int, batch: int, input_size: int, hidden: int) -> int:
    """Bytes of the workspace oneDNN's float32 LSTM forward makes in training for one layer
    and one direction (what ``aten.mkldnn_rnn_layer`` returns as output 3 and autograd saves),
    from oneDNN's ``rnn_utils`` (``set_workspace_sizes``, ``set_offsets``): each part starts
    on a 4096-byte page, and the size ends on one. With T steps, B rows, ``ld`` = the good
    leading dimension of max(I, H), and (T + 1) states of the layer below and this one (2):

    * the gates, T·B·ld(4H) floats; the hidden state per step, T·B·ld(H);
    * the states, 2·(T + 1)·B·ld floats; the cell states, 2·(T + 1)·B·H;
    * the state gradients of layer and iteration, 2·(T + 1)·B·ld each, and of the cell
      state, 2·(T + 1)·B·H (made in forward, filled in backward).

    Checked against the workspace PyTorch 2.13 saves (CPU) for 40 shapes, bidirectional and
    stacked layers (each layer and direction is one call); ``tests/test_rnn.py``."""
    page = 4096
    states = 2 * (steps + 1) * batch
    ld = _good_ld(max(input_size, hidden))
    parts = (
        steps * batch * _good_ld(4 * hidden),
        steps * batch * _good_ld(hidden),
        states * ld,
        states * hidden,
        states * ld,
        states * ld,
        states * hidden,
    )
    offset = 0
    for floats in parts:
        offset = -(-offset // page) * page + 4 * floats
    return -(-offset // page) * page
