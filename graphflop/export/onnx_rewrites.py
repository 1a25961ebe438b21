"""Graph rewrites that make graphflop's graphs exportable to ONNX (:func:`exportable`): each
replaces a node the ONNX exporter (``torch.onnx.export(..., dynamo=True)``, onnxscript's ATen
library) has no function for, or translates into an invalid model, by ops it translates
correctly and that compute the same values.

* a squeeze of no size-1 dimension → ``alias`` (the exporter makes it ``prims.view_of``, which
  it cannot translate);
* a ``copy`` whose source is broadcast into a larger destination → the source expanded first
  (the exporter writes one ``CastLike`` of the source's shape: an invalid model);
* ``index_put`` with a boolean mask among several indices (``x[:, mask] = v``,
  ``x[mask, idx] = v``) → the mask's coordinates (``nonzero``, one integer index per mask
  dimension), as PyTorch's own ``index_put`` does: the exporter's boolean path takes only
  1-D masks and no ``None``, and does not broadcast two masks' coordinates;
* ``conj_physical`` → the imaginary part negated on the real view of the complex value
  (``view_as_real``), the exporter's representation of complex tensors; of a real tensor,
  ``alias``;
* ops that move a complex tensor's elements and have no complex function in the exporter
  (``unsqueeze``, ``squeeze``, ``expand``, ``select``, ``reshape``, ``repeat``, ``alias``,
  ``select_scatter``, ``slice_scatter``; ``constant_pad_nd`` with 0, as the backward of a one-sided FFT pads its
  complex cotangent) → the same op on the real views, the last dimension of 2 moved along;
* ``full`` of complex zeros → the zeros of the real view (the exporter casts to a complex
  type, which ONNX's shape inference refuses);
* ``empty_permuted`` (PyTorch's decomposition of ``empty_like``) → ``empty_strided`` with the
  same strides;
* a real floating tensor to a complex power (``pow.Tensor_Scalar(x, a + bi)``, as the derivative of
  ``x ** (a + bi)`` reads ``x ** (a − 1 + bi)``) → its real and imaginary parts, PyTorch's
  principal value ``exp((a + bi)·(ln|x| + iθ))``, θ = π where x < 0 and 0 elsewhere:
  ``e^(a·ln|x| − bθ)·(cos φ, sin φ)``, φ = b·ln|x| + aθ (0 where x = 0, so that a zero base
  gives PyTorch's 0, ∞ + NaN·i or NaN), viewed as complex (the exporter's ``pow`` converts the
  exponent with ``float()``). The exporter writes a, b and π as float32 constants, so in a
  float64 graph a negative base's value, or any base's with a, b not float32 numbers, is good
  to about 1e-7 (relative), as any Python float a float64 graph holds;
* ``hypot(x, y)`` → ``sqrt(x·x + y·y)``, computed in float32 for 16-bit inputs and cast back
  (float16's squares overflow above 256; in float32 the result is PyTorch's to the bit, for
  bfloat16 too, checked on 10⁵ random pairs). In float32 the squares overflow above about
  1.8·10¹⁹, where ``torch.hypot`` does not.

A rewritten node keeps its name, ``val`` and meta, its cost (:data:`~graphflop.meta.COST`)
among them, and becomes the call that gives the result; the helper nodes inserted before it
carry its graphflop keys (module, role, source, call site) but no cost, so the exported
graph's FLOPs are the original's. Reads ``val`` of nodes (shapes, dtypes) and the graphflop
keys; the given graph is not changed (a copy is).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from graphflop.meta import COST, graphflop_meta

__all__ = ["exportable"]

aten = torch.ops.aten

_SQUEEZES = (aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default)
#: index tensors ``index_put`` reads as boolean masks (uint8 is PyTorch's deprecated mask type)
_MASK_DTYPES = (torch.bool, torch.uint8)
#: dtypes in which the export of ``hypot`` squares in float32 (as PyTorch's kernel computes)
_NARROW_FLOATS = (torch.float16, torch.bfloat16)


def _val(a: Any) -> torch.Tensor | None:
    val = a.meta.get("val") if isinstance(a, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _shape(a: Any) -> tuple[int, ...] | None:
    val = _val(a)
    return tuple(val.shape) if val is not None else None


def _call(n: Node, *targets: Any) -> bool:
    return n.op == "call_function" and n.target in targets


def _arguments(n: Node) -> dict[str, Any]:
    """``n``'s arguments by the names of its ATen overload's schema, defaults filled in (an
    argument neither given nor defaulted is absent)."""
    out: dict[str, Any] = {}
    for i, a in enumerate(n.target._schema.arguments):  # type: ignore[union-attr]
        if i < len(n.args):
            out[a.name] = n.args[i]
        elif a.name in n.kwargs:
            out[a.name] = n.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


# --- what each rewrite applies to -----------------------------------------------------------


def _noop_squeeze(n: Node) -> bool:
    """A squeeze of no size-1 dimension (PyTorch treats ``x.squeeze(1)`` of a (3, 4) tensor as
    a no-op)."""
    if not _call(n, *_SQUEEZES):
        return False
    into = _shape(n)
    return into is not None and _shape(n.args[0]) == into


def _broadcast_copy(n: Node) -> bool:
    """A ``copy`` whose source has another shape than its destination (``h[:, 0] = 0.0``: a 0-d
    value copied into a row)."""
    if not _call(n, aten.copy.default):
        return False
    dst, src = _shape(n.args[0]), _shape(n.args[1])
    return dst is not None and src is not None and dst != src


def _is_mask(a: Any) -> bool:
    val = _val(a)
    return val is not None and val.dtype in _MASK_DTYPES


def _masked_index_put(n: Node) -> bool:
    """An ``index_put`` with a boolean mask among two or more indices (``None`` included)."""
    if not _call(n, aten.index_put.default, aten._unsafe_index_put.default):
        return False
    indices = _arguments(n)["indices"]
    return len(indices) > 1 and any(_is_mask(i) for i in indices)


def _conj_physical(n: Node) -> bool:
    return _call(n, aten.conj_physical.default, aten._conj_physical.default)


#: ops that move a complex tensor's elements without arithmetic and that the exporter has no
#: complex function for → their arguments for the real views ``[..., 2]`` of their complex
#: tensors (``a``: the call's arguments by name; ``r``: the rank of the complex ``self``;
#: ``real``: a tensor argument's real view), called there instead
_RealViewArguments = Callable[[dict[str, Any], int, Callable[[Any], Any]], tuple[Any, ...]]
_REAL_VIEW_ARGUMENTS: dict[Any, _RealViewArguments] = {
    # ``pad`` lists dimensions from the last: the real and imaginary parts padded by nothing
    aten.constant_pad_nd.default: lambda a, r, real: (real(a["self"]), [0, 0, *a["pad"]], 0.0),
    aten.unsqueeze.default: lambda a, r, real: (
        real(a["self"]),
        a["dim"] if a["dim"] >= 0 else a["dim"] + r + 1,
    ),
    aten.select.int: lambda a, r, real: (real(a["self"]), a["dim"] % r, a["index"]),
    aten.expand.default: lambda a, r, real: (real(a["self"]), [*a["size"], 2]),
    aten.reshape.default: lambda a, r, real: (real(a["self"]), [*a["shape"], 2]),
    aten.repeat.default: lambda a, r, real: (real(a["self"]), [*a["repeats"], 1]),
    aten.alias.default: lambda a, r, real: (real(a["self"]),),
    # the real view's last dimension (2) is never squeezed
    aten.squeeze.default: lambda a, r, real: (real(a["self"]),),
    aten.squeeze.dim: lambda a, r, real: (real(a["self"]), a["dim"] % r),
    aten.squeeze.dims: lambda a, r, real: (real(a["self"]), [d % r for d in a["dim"]]),
    aten.select_scatter.default: lambda a, r, real: (
        real(a["self"]),
        real(a["src"]),
        a["dim"] % r,
        a["index"],
    ),
    aten.slice_scatter.default: lambda a, r, real: (
        real(a["self"]),
        real(a["src"]),
        a["dim"] % r,
        a["start"],
        a["end"],
        a["step"],
    ),
}


def _complex_data_movement(n: Node) -> bool:
    """A call of an op of :data:`_REAL_VIEW_ARGUMENTS` on a complex tensor (a pad with 0 only:
    another value would pad the real and imaginary parts with different constants)."""
    if n.op != "call_function" or n.target not in _REAL_VIEW_ARGUMENTS:
        return False
    val = _val(n.args[0])
    if val is None or not val.is_complex():
        return False
    return n.target is not aten.constant_pad_nd.default or _arguments(n)["value"] == 0


def _complex_zeros(n: Node) -> bool:
    """A ``full`` of complex zeros (the zeros a transpose fills a complex cotangent into): the
    exporter makes it a ``Cast`` to a complex type, which ONNX's shape inference refuses."""
    if not _call(n, aten.full.default):
        return False
    val = _val(n)
    return val is not None and val.is_complex() and _arguments(n)["fill_value"] == 0


def _empty_permuted(n: Node) -> bool:
    return _call(n, aten.empty_permuted.default)


def _hypot(n: Node) -> bool:
    return _call(n, aten.hypot.default)


def _real_to_complex_power(n: Node) -> bool:
    if not _call(n, aten.pow.Tensor_Scalar):
        return False
    base = _val(n.args[0])
    return base is not None and base.is_floating_point() and isinstance(n.args[1], complex)


# --- the rewrites: each inserts its helper nodes before ``n`` and returns the call ``n``
# becomes (target, args, kwargs)

_Call = tuple[Any, tuple[Any, ...], dict[str, Any]]


def _as_alias(g: Graph, n: Node) -> _Call:
    return aten.alias.default, (n.args[0],), {}


def _expanded_copy(g: Graph, n: Node) -> _Call:
    dst, src = n.args[0], n.args[1]
    dst_val = _val(dst)
    assert dst_val is not None  # _broadcast_copy's
    wide = g.call_function(aten.expand.default, (src, list(dst_val.shape)))
    wide.meta["val"] = dst_val
    return n.target, (dst, wide, *n.args[2:]), dict(n.kwargs)


def _integer_index_put(g: Graph, n: Node) -> _Call:
    """Each k-D mask among the indices becomes k integer indices, the columns of
    ``nonzero(mask)`` (the mask's coordinates in row-major order, as PyTorch's ``index_put``
    reads a mask)."""
    args = _arguments(n)
    indices: list[Any] = []
    for index in args["indices"]:
        val = _val(index) if _is_mask(index) else None
        if val is None:
            indices.append(index)
            continue
        coordinates = g.call_function(aten.nonzero.default, (index,))
        indices += [g.call_function(aten.select.int, (coordinates, 1, d)) for d in range(val.dim())]
    return n.target, (args["self"], indices, args["values"], args["accumulate"]), {}


def _conjugate(g: Graph, n: Node) -> _Call:
    """``conj(z)``: the real view ``[..., 2]`` of ``z`` with its imaginary half negated, viewed
    as complex again (of a real ``z``: ``z``)."""
    z = n.args[0]
    val = _val(z)
    if val is None or not val.is_complex():
        return aten.alias.default, (z,), {}
    pairs = g.call_function(aten.view_as_real.default, (z,))
    real = g.call_function(aten.slice.Tensor, (pairs, -1, 0, 1))
    imag = g.call_function(aten.slice.Tensor, (pairs, -1, 1, 2))
    negated = g.call_function(aten.neg.default, (imag,))
    pairs_conj = g.call_function(aten.cat.default, ([real, negated], -1))
    return aten.view_as_complex.default, (pairs_conj,), {}


def _on_real_view(g: Graph, n: Node) -> _Call:
    """The op applied to the real view ``[..., 2]`` of its complex input (the real and
    imaginary parts move together: :data:`_REAL_VIEW_ARGUMENTS`), viewed as complex again."""
    rank = _val(n.args[0]).dim()  # type: ignore[union-attr]  # _complex_data_movement's

    def real(z: Any) -> Node:
        return g.call_function(aten.view_as_real.default, (z,))

    arguments = _REAL_VIEW_ARGUMENTS[n.target](_arguments(n), rank, real)
    moved = g.call_function(n.target, arguments)  # type: ignore[arg-type]
    return aten.view_as_complex.default, (moved,), {}


def _real_zeros(g: Graph, n: Node) -> _Call:
    """The zeros of the real view ``[..., 2]``, viewed as complex."""
    val = _val(n)
    assert val is not None  # _complex_zeros'
    kwargs = {**n.kwargs, "dtype": val.real.dtype}
    zeros = g.call_function(aten.full.default, ([*val.shape, 2], 0.0), kwargs)
    return aten.view_as_complex.default, (zeros,), {}


def _permuted_strides(shape: list[int], physical_layout: list[int]) -> list[int]:
    """The strides of ``torch.empty_permuted(shape, physical_layout)``: dense in the order
    ``physical_layout`` gives (its last dimension the innermost)."""
    strides = [0] * len(shape)
    step = 1
    for d in reversed(physical_layout):
        strides[d] = step
        step *= max(int(shape[d]), 1)
    return strides


def _as_empty_strided(g: Graph, n: Node) -> _Call:
    args = _arguments(n)
    shape = list(args["size"])
    strides = _permuted_strides(shape, list(args["physical_layout"]))
    kwargs: dict[str, Any] = {
        k: n.kwargs[k] for k in ("dtype", "layout", "device", "pin_memory") if k in n.kwargs
    }
    return aten.empty_strided.default, (shape, strides), kwargs


def _hypotenuse(g: Graph, n: Node) -> _Call:
    """``sqrt(x·x + y·y)``; 16-bit inputs are squared in float32 and the result cast back."""
    x, y = n.args[0], n.args[1]
    out = _val(n)
    narrow = out is not None and out.dtype in _NARROW_FLOATS
    if narrow:
        x, y = (
            g.call_function(aten._to_copy.default, (v,), {"dtype": torch.float32}) for v in (x, y)
        )
    squares = tuple(g.call_function(aten.mul.Tensor, (v, v)) for v in (x, y))
    total = g.call_function(aten.add.Tensor, squares)
    if not narrow:
        return aten.sqrt.default, (total,), {}
    assert out is not None
    root = g.call_function(aten.sqrt.default, (total,))
    return aten._to_copy.default, (root,), {"dtype": out.dtype}


def _complex_power(g: Graph, n: Node) -> _Call:
    """``x ** (a + bi)`` of a real ``x`` from its real and imaginary parts (the module's
    docstring), viewed as complex."""
    x, exponent = n.args[0], n.args[1]
    base = _val(x)
    assert isinstance(exponent, complex) and base is not None  # _real_to_complex_power's
    a, b = exponent.real, exponent.imag

    def call(op: Any, *args: Any, **kwargs: Any) -> Node:
        return g.call_function(op, args, kwargs)

    log_abs = call(aten.log.default, call(aten.abs.default, x))
    # the exporter writes a Python float as a float32 constant (π to 1.7e-7, in a float64
    # graph too; ONNX Runtime has no float64 Acos to make it from)
    negative = call(aten._to_copy.default, call(aten.lt.Scalar, x, 0), dtype=base.dtype)
    theta = call(aten.mul.Tensor, negative, math.pi)
    magnitude = call(
        aten.exp.default,
        call(aten.sub.Tensor, call(aten.mul.Tensor, log_abs, a), call(aten.mul.Tensor, theta, b)),
    )
    phase = call(
        aten.add.Tensor, call(aten.mul.Tensor, log_abs, b), call(aten.mul.Tensor, theta, a)
    )
    phase = call(aten.where.ScalarSelf, call(aten.eq.Scalar, x, 0), 0.0, phase)
    real = call(aten.mul.Tensor, magnitude, call(aten.cos.default, phase))
    imag = call(aten.mul.Tensor, magnitude, call(aten.sin.default, phase))
    return aten.view_as_complex.default, (call(aten.stack.default, [real, imag], -1),), {}


#: (applies to the node, rewrite), in the order tried
_REWRITES: tuple[tuple[Callable[[Node], bool], Callable[[Graph, Node], _Call]], ...] = (
    (_noop_squeeze, _as_alias),
    (_broadcast_copy, _expanded_copy),
    (_masked_index_put, _integer_index_put),
    (_conj_physical, _conjugate),
    (_complex_data_movement, _on_real_view),
    (_complex_zeros, _real_zeros),
    (_empty_permuted, _as_empty_strided),
    (_hypot, _hypotenuse),
    (_real_to_complex_power, _complex_power),
)


def _rewrite_of(n: Node) -> Callable[[Graph, Node], _Call] | None:
    return next((rewrite for applies, rewrite in _REWRITES if applies(n)), None)


def exportable(gm: GraphModule) -> GraphModule:
    """``gm``, or a copy (same node names) made exportable by the module's rewrites: each
    rewritten node keeps its name, ``val`` and meta and becomes the call giving the result;
    the helper nodes inserted before it carry its graphflop keys but no cost."""
    if not any(_rewrite_of(n) for n in gm.graph.nodes):
        return gm
    graph = Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for n in list(graph.nodes):
        keys = {k: v for k, v in graphflop_meta(n.meta).items() if k != COST}
        # a rewrite's result may need another (a no-op squeeze of a complex tensor: an alias,
        # then the alias of its real view); each turns the node into an op of another kind
        for _ in range(len(_REWRITES)):
            rewrite = _rewrite_of(n)
            if rewrite is None:
                break
            before = set(graph.nodes)
            with graph.inserting_before(n):
                n.target, n.args, n.kwargs = rewrite(graph, n)
            for new in graph.nodes:
                if new not in before:
                    new.meta = {**keys, **new.meta}
    copy = GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy
