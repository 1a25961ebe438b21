"""Diagnosing ONNX export failures for :mod:`graphflop.export.onnx`: which node's op the
exporter cannot translate (:func:`unexportable_node`; for complex values, :func:`complex_argument`
and :data:`COMPLEX_ADVICE`), one clean line for any other exporter failure
(:func:`exporter_error_line`), and the loggers torch's exporter writes through
(:data:`EXPORTER_LOGGERS`, kept quiet meanwhile)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.fx import GraphModule, Node

__all__ = [
    "COMPLEX_ADVICE",
    "EXPORTER_LOGGERS",
    "complex_argument",
    "exporter_error_line",
    "in_chain",
    "unexportable_node",
]


def _registry():
    try:
        from torch.onnx._internal.exporter import _registration

        return _registration.ONNXRegistry.from_torchlib()
    except Exception:  # private API moved: rely on the exporter's own error
        return None


#: what a refusal of an op on complex values adds: why, and what to do
COMPLEX_ADVICE = (
    "ONNX's operators do not compute on complex tensors: the exporter writes a complex tensor "
    "as its real and imaginary parts (a last dimension of 2, as torch.view_as_real) and "
    "translates complex values for only some ops (add, sub, mul, div, matmul, abs, conj, "
    "views and reshapes among them); write this step with the real and imaginary parts "
    "(torch.view_as_real, real arithmetic) instead"
)


def complex_argument(n: Node) -> bool:
    """Whether a tensor argument of ``n`` is complex (the exporter then needs a function for
    complex values of its op)."""
    found = False

    def visit(a: Any) -> Any:
        nonlocal found
        val = a.meta.get("val") if isinstance(a, Node) else None
        found = found or (isinstance(val, torch.Tensor) and val.is_complex())
        return a

    torch.fx.node.map_aggregate((n.args, n.kwargs), visit)
    return found


def unexportable_node(gm: GraphModule) -> Node | None:
    """The first node whose op the ONNX exporter can translate neither directly (no function
    for it or another overload of it in the exporter's registry; for complex arguments
    (:func:`complex_argument`), no function for complex values) nor through the ATen
    decomposition the exporter applies first (``aten.var_mean.correction`` of a training batch
    norm decomposes into registered ops; ``aten.i0`` into ``prims.bessel_i0``, which has none),
    or None."""
    import operator

    reg = _registry()
    if reg is None:
        return None
    table: dict | None = None
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if _registered(reg, n.target, complex_argument(n)):
            continue
        table = _decomposition_table(reg) if table is None else table
        if not _decomposes_to_registered(reg, table, n):
            return n
    return None


def _decomposition_table(reg) -> dict:
    """The exporter's ATen decompositions for the ops ``reg`` has no function for ({} when its
    private API moved)."""
    try:
        from torch.onnx._internal.exporter import _decomp

        return _decomp.create_onnx_friendly_decomposition_table(
            set(_decomp.get_onnx_implemented_overloads(reg))
        )
    except Exception:
        return {}


def _registered(reg, target, complex_values: bool = False) -> bool:
    """Whether ``target`` or another overload of its op has a function in ``reg`` (one for
    complex values when ``complex_values``: the exporter picks its functions by that)."""
    packet = getattr(target, "overloadpacket", None)
    siblings = [getattr(packet, o) for o in packet.overloads()] if packet else []
    for op in (target, *siblings):
        try:
            functions = reg.get_decomps(op)
        except Exception:  # not an op the registry knows
            continue
        if any(bool(getattr(f, "is_complex", False)) == complex_values for f in functions):
            return True
    return False


def _decomposes_to_registered(reg, table: dict, node: Node) -> bool:
    """Whether the exporter's decomposition ``table`` turns ``node``'s op into ops that all have
    a function in ``reg`` (traced on meta tensors of the node's argument shapes)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def meta(a):
        if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor):
            v = a.meta["val"]
            return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
        return a

    target = node.target
    if not callable(target) or target not in table:  # the table's keys are OpOverloads
        return False
    try:
        args = torch.fx.node.map_aggregate(node.args, meta)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, meta)
        traced = make_fx(lambda *a: target(*a, **kwargs), decomposition_table=table)(*args)
    except Exception:  # the decomposition fails on these arguments
        return False
    return all(
        _registered(reg, n.target, complex_argument(n))
        for n in traced.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    )


#: ANSI escape sequences (the exporter colours parts of its messages)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def exporter_error_line(e: BaseException) -> str:
    """One line for an exporter failure ``e``: the first line of the innermost exception it was
    raised from (the exporter's own message is a multi-line advice block), prefixed with that
    exception's type and, when ``torch.export`` (the exporter's step 1) failed, with that;
    ANSI escape codes and surrounding white space removed."""
    chain = _chain(e)
    root = chain[-1]
    text = " ".join(_ANSI.sub("", str(root)).split("\n", 1)[0].split())
    line = f"{type(root).__name__}: {text}" if root is not e else text or type(e).__name__
    if in_chain(e, "TorchExportError") and root is not e:
        line = f"torch.export (the exporter's step 1) failed: {line}"
    return line


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from (``__cause__``), outermost first."""
    chain = [e]
    while chain[-1].__cause__ is not None and chain[-1].__cause__ not in chain:
        chain.append(chain[-1].__cause__)
    return chain


def in_chain(e: BaseException, type_name: str) -> bool:
    """Whether ``e`` or an exception it was raised from is of the class named ``type_name``."""
    return any(type(c).__name__ == type_name for c in _chain(e))


#: the loggers the exporter's steps write through; quiet during an export (torch.export logs
#: "always_classified is unsupported." at ERROR for each attempt that fails; onnx_ir warns of
#: every empty attribute list, an EmbeddingBag's among them)
EXPORTER_LOGGERS = ("torch.export", "torch._export", "torch.onnx", "onnx_ir", "onnxscript")
