"""``analyze``: trace, build every graph, annotate, and roll the annotations up.

The :class:`Analysis` it returns holds the annotated graphs (``forward``, ``backward``, ``jvp``,
``update``) and a summary with the same content as ``graphflop inspect --json``
(:meth:`Analysis.to_dict`). The summary is computed from node annotations only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from graphflop.ad.jvp import build_jvp
from graphflop.ad.vjp import build_vjp
from graphflop.frontend.trace import trace
from graphflop.meta import (
    COST,
    FORWARD_GRADIENT,
    GHOSTS,
    KIND,
    LINEARIZED,
    LOSS_KIND,
    MODULE,
    ROLE,
    SIGNATURE,
    ZERO_COST,
    NodeCost,
)
from graphflop.passes.flops import annotate_flops, tensor_bytes
from graphflop.passes.forward_gradient import build_forward_gradient_step
from graphflop.passes.memory import (
    forward_schedule,
    jvp_schedule,
    saved_for_backward_bytes,
    train_schedule,
)
from graphflop.passes.optimizer import STATE_KINDS, build_update

SCHEMA_VERSION = 1


@dataclass
class Analysis:
    """Annotated graphs and their summary.

    Attributes:
        name: model name.
        forward: traced forward graph (with loss), annotated.
        backward: backward graph, or None when not built.
        jvp: JVP graph, or None.
        update: optimizer update graph, or None.
        summary: the JSON-ready dict (see the README for the schema).
    """

    name: str
    forward: GraphModule
    backward: GraphModule | None = None
    jvp: GraphModule | None = None
    update: GraphModule | None = None
    forward_gradient: GraphModule | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.summary


def analyze(
    model: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    *,
    name: str | None = None,
    loss: str = "auto",
    optimizer: str = "sgd",
    tangents: str = "params",
    directions: int = 1,
    distribution: str = "normal",
    backward: bool = True,
    jvp: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Analysis:
    """Trace ``model`` and build, annotate and summarise its graphs.

    Args:
        model: the module (used in its current train/eval mode).
        example_inputs: one tensor per input (FakeTensors are fine: nothing is allocated).
        loss: see :func:`graphflop.frontend.trace.trace`.
        optimizer: ``sgd``, ``momentum``, ``adam`` or ``adamw``.
        tangents: which values carry tangents in the JVP graph (``params``, ``inputs``, ``all``).
        directions, distribution: of the forward-gradient step (see
            :func:`~graphflop.passes.forward_gradient.build_forward_gradient_step`).
        backward, jvp: build those graphs.
        progress: called with a short message before each stage.

    Raises:
        TraceError, MissingRuleError, ValueError: see the passes.
    """
    say = progress or (lambda msg: None)
    say("tracing")
    fwd = trace(model, example_inputs, loss=loss)
    annotate_flops(fwd)
    sig = fwd.meta[SIGNATURE]
    a = Analysis(name or type(model).__name__, fwd)
    has_loss = sig.loss is not None
    lin = None  # the JVP graph with parameter tangents: transposed, and the forward gradient's
    if jvp:
        say("building the JVP graph")
        a.jvp = annotate_flops(build_jvp(fwd, tangents))
        if tangents == "params":
            lin = a.jvp
    if backward and has_loss:
        say("building the backward graph")
        a.backward = annotate_flops(build_vjp(fwd, linearized=lin))
        say("building the optimizer update")
        phs = {n.name: n for n in fwd.graph.nodes if n.op == "placeholder"}
        modules = {q: q.rpartition(".")[0] for _, q in sig.params}
        a.update = annotate_flops(
            build_update(
                [(q, phs[p].meta["val"]) for p, q in sig.params],
                optimizer,
                fake_mode=_fake_mode(fwd),
                modules=modules,
            )
        )
        lin = lin or a.backward.meta[LINEARIZED]
    if jvp and has_loss:
        say("building the forward-gradient step")
        a.forward_gradient = annotate_flops(
            build_forward_gradient_step(
                fwd, optimizer, directions=directions, distribution=distribution, jvp=lin
            )
        )
    say("summarising")
    a.summary = summarize(a, optimizer=optimizer, tangents=tangents)
    return a


def _fake_mode(gm):
    from graphflop.meta import fake_mode_of

    return fake_mode_of([n.meta["val"] for n in gm.graph.nodes if "val" in n.meta])


def _cost_dict(c: NodeCost) -> dict[str, int]:
    return {
        "flops": c.flops,
        "mm_flops": c.mm_flops,
        "transcendentals": c.transcendentals,
        "random_elements": c.random_elements,
        "bytes_read": c.bytes_read,
        "bytes_written": c.bytes_written,
    }


def _sum(nodes) -> NodeCost:
    t = ZERO_COST
    for n in nodes:
        t = t + n.meta.get(COST, ZERO_COST)
    return t


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _layer_name(path: str) -> str:
    return path if path else "(model)"


def summarize(a: Analysis, *, optimizer: str, tangents: str) -> dict[str, Any]:
    """Roll the node annotations of ``a``'s graphs up into totals, ratios, memory and layers."""
    fwd = a.forward
    sig = fwd.meta[SIGNATURE]
    phs = {n.name: n for n in fwd.graph.nodes if n.op == "placeholder"}
    fnodes = [n for n in fwd.graph.nodes if n.op == "call_function"]
    params = sum(phs[p].meta["val"].numel() for p, _ in sig.params)
    params_bytes = sum(tensor_bytes(phs[p].meta["val"]) for p, _ in sig.params)

    layers: dict[str, dict[str, Any]] = {}

    def layer(path: str) -> dict[str, Any]:
        if path not in layers:
            layers[path] = {
                "name": _layer_name(path),
                "params": 0,
                "forward_flops": 0,
                "forward_mm_flops": 0,
                "output_shape": None,
                "output_bytes": 0,
                "backward_flops": 0,
                "backward_mm_flops": 0,
                "grad_input_flops": 0,
                "grad_weight_flops": 0,
                "grad_accum_flops": 0,
                "pruned_flops": 0,
                "update_flops": 0,
                "jvp_flops": 0,
                "jvp_mm_flops": 0,
                "tangent_from_input_flops": 0,
                "tangent_from_param_flops": 0,
                "jvp_skipped_flops": 0,
            }
        return layers[path]

    for n in fnodes:
        c = n.meta[COST]
        L = layer(n.meta.get(MODULE, ""))
        L["forward_flops"] += c.flops
        L["forward_mm_flops"] += c.mm_flops
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            L["output_shape"] = list(v.shape)
            L["output_bytes"] = tensor_bytes(v)
    for p, q in sig.params:
        layer(phs[p].meta.get(MODULE) or q.rpartition(".")[0])["params"] += (
            phs[p].meta["val"].numel()
        )
    fwd_total = _sum(fnodes)
    loss_total = _sum(n for n in fnodes if n.meta.get(ROLE) == "loss")
    totals: dict[str, Any] = {"forward": _cost_dict(fwd_total), "loss": _cost_dict(loss_total)}
    ratios: dict[str, Any] = {}
    memory: dict[str, Any] = {"params_bytes": params_bytes}

    fsched = forward_schedule(fwd)
    fpeak, _ = fsched.peak()
    memory["forward_peak_bytes"] = params_bytes + fpeak

    if a.backward is not None:
        bnodes = [n for n in a.backward.graph.nodes if n.op == "call_function"]
        by_role: dict[str, int] = {}
        for n in bnodes:
            c = n.meta[COST]
            role = n.meta.get(ROLE, "grad_input")
            by_role[role] = by_role.get(role, 0) + c.flops
            L = layer(n.meta.get(MODULE, ""))
            L["backward_flops"] += c.flops
            L["backward_mm_flops"] += c.mm_flops
            if role in ("grad_input", "grad_weight", "grad_accum"):
                L[f"{role}_flops"] += c.flops
        pruned = 0
        for g in a.backward.meta.get(GHOSTS, []):
            pruned += g.cost.flops
            layer(g.module)["pruned_flops"] += g.cost.flops
        btot = _sum(bnodes)
        totals["backward"] = {
            **_cost_dict(btot),
            "grad_input_flops": by_role.get("grad_input", 0),
            "grad_weight_flops": by_role.get("grad_weight", 0),
            "grad_accum_flops": by_role.get("grad_accum", 0),
            "loss_flops": by_role.get("loss", 0),
            "pruned_flops": pruned,
        }
        unodes = [n for n in a.update.graph.nodes if n.op == "call_function"]
        utot = _sum(unodes)
        for n in unodes:
            layer(n.meta.get(MODULE, ""))["update_flops"] += n.meta[COST].flops
        totals["update"] = {
            **_cost_dict(utot),
            "optimizer": optimizer,
            "flops_per_param": _ratio(utot.flops, params),
        }
        totals["train_step"] = {
            "flops": fwd_total.flops + btot.flops + utot.flops,
            "mm_flops": fwd_total.mm_flops + btot.mm_flops,
        }
        ratios["backward_forward"] = _ratio(btot.flops + utot.flops, fwd_total.flops)
        ratios["backward_forward_no_update"] = _ratio(btot.flops, fwd_total.flops)
        ratios["backward_forward_mm"] = _ratio(btot.mm_flops, fwd_total.mm_flops)
        ratios["train_step_forward"] = _ratio(totals["train_step"]["flops"], fwd_total.flops)
        n_state = len(STATE_KINDS[optimizer])
        memory["grads_bytes"] = params_bytes
        memory["optimizer_state_bytes"] = n_state * params_bytes
        memory["saved_for_backward_bytes"] = saved_for_backward_bytes(fwd, a.backward)
        tpeak, _ = train_schedule(fwd, a.backward, a.update).peak()
        memory["train_peak_bytes"] = params_bytes * (2 + n_state) + tpeak

    if a.jvp is not None:
        jnodes = [
            n
            for n in a.jvp.graph.nodes
            if n.op == "call_function" and n.meta.get(KIND) in ("tangent", "coef")
        ]
        jtot = _sum(jnodes)
        by_role = {}
        for n in jnodes:
            c = n.meta[COST]
            L = layer(n.meta.get(MODULE, ""))
            L["jvp_flops"] += c.flops
            L["jvp_mm_flops"] += c.mm_flops
            role = n.meta.get(ROLE, "tangent_from_input")
            by_role[role] = by_role.get(role, 0) + c.flops
            if role in ("tangent_from_input", "tangent_from_param"):
                L[f"{role}_flops"] += c.flops
        skipped = 0
        for g in a.jvp.meta.get(GHOSTS, []):
            skipped += g.cost.flops
            layer(g.module)["jvp_skipped_flops"] += g.cost.flops
        totals["jvp"] = {
            **_cost_dict(jtot),
            "tangent_from_input_flops": by_role.get("tangent_from_input", 0),
            "tangent_from_param_flops": by_role.get("tangent_from_param", 0),
            "skipped_flops": skipped,
            "tangents": tangents,
        }
        if a.forward_gradient is not None:
            fnodes_fg = [n for n in a.forward_gradient.graph.nodes if n.op == "call_function"]
            fgc = _sum(fnodes_fg)
            info = a.forward_gradient.meta[FORWARD_GRADIENT]
            by = {}
            for n in fnodes_fg:
                k = n.meta.get(ROLE, "forward")
                by[k] = by.get(k, 0) + n.meta[COST].flops
            totals["forward_gradient_step"] = {
                **_cost_dict(fgc),
                "directions": info.directions,
                "distribution": info.distribution,
                "primal_flops": by.get("forward", 0) + by.get("loss", 0),
                "tangent_flops": by.get("tangent_from_input", 0) + by.get("tangent_from_param", 0),
                "direction_flops": by.get("direction", 0),
                "update_flops": by.get("update", 0),
            }
            ratios["forward_gradient_step_forward"] = _ratio(fgc.flops, fwd_total.flops)
        ratios["jvp_forward"] = _ratio(jtot.flops, fwd_total.flops)
        jpeak, _ = jvp_schedule(a.jvp).peak()
        n_tan = sum(
            tensor_bytes(n.meta["val"])
            for n in a.jvp.graph.nodes
            if n.op == "placeholder" and n.meta.get(KIND) == "tangent"
        )
        memory["jvp_peak_bytes"] = params_bytes + n_tan + jpeak

    rows = []
    for L in layers.values():
        f = L["forward_flops"]
        if a.backward is not None:
            L["ratio"] = _ratio(L["backward_flops"] + L["update_flops"], f)
            L["ratio_no_update"] = _ratio(L["backward_flops"], f)
        if a.jvp is not None:
            L["jvp_ratio"] = _ratio(L["jvp_flops"], f)
        L["share"] = _ratio(f, fwd_total.flops) or 0.0
        rows.append(L)

    inputs = [
        {
            "name": n,
            "shape": list(phs[n].meta["val"].shape),
            "dtype": str(phs[n].meta["val"].dtype).removeprefix("torch."),
        }
        for n in sig.inputs
    ]
    return {
        "schema_version": SCHEMA_VERSION,
        "model": a.name,
        "inputs": inputs,
        "params": params,
        "loss": fwd.meta.get(LOSS_KIND),
        "optimizer": optimizer if a.backward is not None else None,
        "totals": totals,
        "ratios": ratios,
        "memory": memory,
        "layers": rows,
    }
