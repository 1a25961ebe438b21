"""Analysis facts the pictures need that the analysis does not report (yet).

Everything here is read from the graphs' node annotations (``val``, ``MODULE``, ``SOURCE``,
``KIND``, ``RESIDUAL``, ``PARAM``, ``GHOSTS``, PyTorch's ``nn_module_stack``) or from the
typed report ``analysis.report`` (only through :func:`report`). Nothing is written. The
annotation readers are the computations the typed report could take over:

* :func:`report` / :func:`layer_rows` / :func:`loss_kind`: the report (one accessor);
* :func:`grad_input_flops`: a layer's input-gradient FLOPs, accumulation included;
* :func:`weight_accumulations`, :func:`weight_accum_flops`: the gradient accumulations that sum
  weight gradients (a parameter read twice), which count as weight gradient;
* :func:`saved_bytes`: bytes of forward values the backward reads, per module;
* :func:`node_costs`: per forward node, the FLOPs of its backward and tangent nodes and the
  bytes the backward keeps of it (for boxes that hold part of a module's ops);
* :func:`ghost_flops`: pruned / skipped FLOPs per (module, role);
* :func:`forward_modules`, :func:`own_ops`, :func:`forward_reads`: modules in forward order,
  a parent module's own op names, the forward data flow between modules;
* :func:`module_types`: module class names;
* :func:`incoming_cotangent`: the cotangent that reached a forward node's backward;
* :func:`param_gradients`: each parameter's gradient node in the backward's output;
* :func:`shape_of`, :func:`bytes_of`, :func:`numel`, :func:`op_short`: per-value readers;
* :func:`count_call_nodes`: call nodes in some graphs (the ``auto`` level's measure).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from graphflop.meta import (
    COST,
    GHOSTS,
    KIND,
    MODULE,
    PARAM,
    RESIDUAL,
    ROLE,
    SIGNATURE,
    SOURCE,
    ZERO_COST,
)
from graphflop.report import LayerRow, Report

#: residual kinds that are not forward values (a parameter or buffer, or derived from one)
PARAM_RESIDUALS = ("param", "buffer", "param_derived")


# -- the report: one accessor ---------------------------------------------------------------


def report(analysis: Any) -> Report:
    """``analysis.report``, the typed :class:`~graphflop.report.Report`: the only read of it."""
    return analysis.report


def layer_rows(analysis: Any) -> dict[str, LayerRow]:
    """Module path → its layer row of the report (``""`` for ``(model)``)."""
    return {"" if row.name == "(model)" else row.name: row for row in report(analysis).layers}


def loss_kind(analysis: Any) -> str:
    """The loss's name (``cross_entropy``, ...), or ``loss``."""
    return report(analysis).loss or "loss"


def grad_input_flops(row: LayerRow, weight_accum: int = 0) -> int:
    """A layer row's input-gradient FLOPs, the accumulation of input cotangents included:
    ``weight_accum`` FLOPs of its accumulations sum weight gradients (:func:`weight_accum_flops`)
    and count as weight gradient."""
    return row.grad_input_flops + row.grad_accum_flops - weight_accum


def weight_accumulations(gm: Any) -> set[str]:
    """Names of the backward ``gm``'s accumulation nodes (role ``grad_accum``) that sum weight
    gradients: the cotangents of a parameter read more than once (a tied embedding, read by the
    embedding lookup and the output projection), rather than of an activation. An accumulation
    is one when a summand is a weight gradient or such an accumulation."""
    out: set[str] = set()
    if gm is None:
        return out
    for n in gm.graph.nodes:  # topological order: a summand is classified before its sum
        if n.meta.get(ROLE) != "grad_accum":
            continue
        if any(
            isinstance(x, torch.fx.Node) and (x.meta.get(ROLE) == "grad_weight" or x.name in out)
            for x in n.args
        ):
            out.add(n.name)
    return out


def weight_accum_flops(analysis: Any) -> dict[str, int]:
    """Module → FLOPs of its :func:`weight_accumulations` (0 where none)."""
    out: dict[str, int] = defaultdict(int)
    gm = analysis.backward
    names = weight_accumulations(gm)
    for n in gm.graph.nodes if gm is not None else ():
        if n.name in names:
            out[n.meta.get(MODULE, "")] += n.meta.get(COST, ZERO_COST).flops
    return out


# -- per value -------------------------------------------------------------------------------


def shape_of(v: Any) -> str:
    """``2×3`` for a tensor ``val`` ("scalar" for 0-d, "–" for none, joined for tuples)."""
    if isinstance(v, torch.Tensor):
        return "×".join(map(str, v.shape)) if v.dim() else "scalar"
    if isinstance(v, (tuple, list)):
        return ", ".join(shape_of(x) for x in v if isinstance(x, torch.Tensor)) or "–"
    return "–"


def bytes_of(v: Any) -> int:
    """Bytes of a tensor ``val`` (summed over tuples; 0 for anything else)."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(bytes_of(x) for x in v)
    return 0


def numel(v: Any) -> int:
    """Elements of a tensor ``val`` (0 for anything else)."""
    return v.numel() if isinstance(v, torch.Tensor) else 0


def op_short(target: Any) -> str:
    """``aten.convolution.default`` → ``convolution``; ``operator.getitem`` → ``getitem``."""
    if isinstance(target, str):
        parts = target.split(".")
        return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]
    name = getattr(target, "__name__", None) or str(target)
    return name.split(".")[0]


# -- per graph -------------------------------------------------------------------------------


def count_call_nodes(analysis: Any, keys: tuple[str, ...]) -> int:
    """``call_function`` nodes in the analysis's graphs named ``keys`` (absent graphs: 0)."""
    total = 0
    for k in keys:
        gm = getattr(analysis, k, None)
        if gm is not None:
            total += sum(1 for n in gm.graph.nodes if n.op == "call_function")
    return total


def module_types(gm: Any) -> dict[str, str]:
    """Module path → class name, from PyTorch's ``nn_module_stack`` (absent → no entry)."""
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        path = n.meta.get(MODULE)
        stack = n.meta.get("nn_module_stack")
        if path is None or path in out or not stack:
            continue
        try:
            typ = list(stack.values())[-1][1]
        except (IndexError, TypeError):
            continue
        name = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
        out[path] = name.rsplit(".", 1)[-1]
    return out


def incoming_cotangent(gm: Any, source: str) -> str | None:
    """Name of the cotangent that reached ``source``'s backward nodes from outside them."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get(SOURCE) != source:
            continue
        for u in n.all_input_nodes:
            if u.meta.get(SOURCE) != source and u.meta.get(KIND) == "cotangent":
                return u.name
    return None


def ghost_flops(gm: Any) -> dict[tuple[str, str], int]:
    """(module path, role) → FLOPs of the graph's ghosts (work not emitted), in record order."""
    per: dict[tuple[str, str], int] = defaultdict(int)
    for g in gm.meta.get(GHOSTS, []):
        per[(g.module, g.role)] += g.cost.flops
    return per


def saved_bytes(analysis: Any) -> dict[str, int]:
    """Module → bytes of its forward values (activations, inputs) the backward reads."""
    out: dict[str, int] = defaultdict(int)
    if analysis.backward is None:
        return out
    for n in analysis.backward.graph.nodes:
        kind = n.meta.get(RESIDUAL)
        if n.op == "placeholder" and kind is not None and kind not in PARAM_RESIDUALS:
            out[n.meta.get(MODULE, "")] += bytes_of(n.meta.get("val"))
    return out


#: role → the column of :func:`node_costs` its FLOPs count in
NODE_COST_COLUMN = {
    "grad_input": "grad_input",
    "grad_accum": "grad_input",
    "grad_weight": "grad_weight",
    "tangent_from_input": "jvp",
    "tangent_from_param": "jvp",
}


def node_costs(analysis: Any) -> dict[str, dict[str, int]]:
    """Forward call node name → ``forward`` FLOPs, ``grad_input`` and ``grad_weight`` (each with
    the accumulations of its cotangents: :func:`weight_accumulations` of the backward) and
    ``jvp`` FLOPs of the backward and JVP nodes derived from it (``SOURCE``) in the same module,
    and ``saved`` bytes of it the backward reads (absent keys: 0)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    module: dict[str, str] = {}
    for n in analysis.forward.graph.nodes:
        if n.op == "call_function":
            module[n.name] = n.meta.get(MODULE, "")
            out[n.name]["forward"] += n.meta.get(COST, ZERO_COST).flops
    weight_sums = weight_accumulations(analysis.backward)
    for gm in (analysis.backward, analysis.jvp):
        if gm is None:
            continue
        for n in gm.graph.nodes:
            src = n.meta.get(SOURCE)
            if src not in module or n.meta.get(MODULE, "") != module[src]:
                continue
            if n.op == "call_function":
                col = NODE_COST_COLUMN.get(n.meta.get(ROLE))
                # the names are the backward's: a JVP node may share one (``add_tensor_9``)
                if gm is analysis.backward and n.name in weight_sums:
                    col = "grad_weight"
                if col is not None:
                    out[src][col] += n.meta.get(COST, ZERO_COST).flops
            elif gm is analysis.backward and n.meta.get(RESIDUAL) not in (None, *PARAM_RESIDUALS):
                out[src]["saved"] += bytes_of(n.meta.get("val"))
    return out


def param_gradients(analysis: Any) -> dict[str, str]:
    """Parameter qualified name → the backward output node holding its gradient."""
    if analysis.backward is None:
        return {}
    out = next(n for n in analysis.backward.graph.nodes if n.op == "output")
    return {v.meta[PARAM]: v.name for v in out.args[0] if hasattr(v, "meta") and v.meta.get(PARAM)}


def forward_modules(analysis: Any) -> list[str]:
    """Module paths with call nodes in the forward graph, in forward order."""
    order: dict[str, None] = {}
    for n in analysis.forward.graph.nodes:
        if n.op == "call_function":
            order.setdefault(n.meta.get(MODULE, ""), None)
    return list(order)


def own_ops(analysis: Any, parents: set[str]) -> dict[str, list[str]]:
    """Parent module → the distinct op names of its own forward ops (views left out)."""
    ops: dict[str, list[str]] = defaultdict(list)
    for n in analysis.forward.graph.nodes:
        m = n.meta.get(MODULE, "")
        if n.op == "call_function" and m in parents:
            name = op_short(n.target)
            if name not in ops[m] and name not in ("getitem", "view", "reshape"):
                ops[m].append(name)
    return dict(ops)


def model_inputs(gm: Any) -> set[str]:
    """Names of the model-input placeholders (the signature's ``inputs``)."""
    sig = gm.meta.get(SIGNATURE)
    return set(sig.inputs) if sig else set()


def forward_reads(analysis: Any) -> Iterator[tuple[tuple[str, str], str, int]]:
    """Each read of a model input or a call node's value by a forward call node:
    (``("input", name)`` or ``("module", path)`` of the value, reading module, value bytes)."""
    fwd = analysis.forward
    inputs = model_inputs(fwd)
    where: dict[str, tuple[str, str]] = {}
    for n in fwd.graph.nodes:
        if n.op == "placeholder" and n.name in inputs:
            where[n.name] = ("input", n.name)
        elif n.op == "call_function":
            where[n.name] = ("module", n.meta.get(MODULE, ""))
    for n in fwd.graph.nodes:
        if n.op != "call_function":
            continue
        for u in n.all_input_nodes:
            if u.name in where:
                yield where[u.name], n.meta.get(MODULE, ""), bytes_of(u.meta.get("val"))
