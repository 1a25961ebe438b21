"""Summary pass: roll the node annotations of an analysis's graphs up into a typed
:class:`~graphflop.report.Report` (totals, ratios, memory, per-layer rows).

Reads ``COST``, ``ROLE``, ``KIND``, ``MODULE`` and ``SOURCE`` on nodes; ``SIGNATURE``,
``LOSS_KIND``, ``GHOSTS``, ``GAPS`` and ``FORWARD_GRADIENT`` on graphs, and the rule table (an
op without a rule is uncounted); memory peaks come from
:mod:`graphflop.passes.memory`'s schedules. Writes nothing. The graphs must have been through
``annotate_flops``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch.fx import GraphModule, Node

from graphflop.meta import (
    ASSUMPTIONS,
    COST,
    DERIVED_HIERARCHY,
    FORWARD_GRADIENT,
    GAPS,
    GHOSTS,
    KIND,
    LOSS_KIND,
    MODULE,
    ROLE,
    SIGNATURE,
    SOURCE,
    UNUSED,
    Hierarchy,
    NodeCost,
)
from graphflop.ops import has_rule, op_name
from graphflop.passes.calls import (
    DerivedFigures,
    derived_figures,
    flat_view,
    is_recorded,
    rule_less_calls,
)
from graphflop.passes.eager_attention import eager_attention_flops
from graphflop.passes.eager_memory import (
    DESCRIBES,
    checkpoint_calls,
    eager_jvp_schedule,
    eager_residuals,
    eager_saved_storages,
    eager_train_schedule,
    rng_state_bytes,
)
from graphflop.passes.flops import sum_costs, tensor_bytes, total_cost
from graphflop.passes.hierarchy import ForwardFigures, forward_figures, hierarchy_of
from graphflop.passes.memory import (
    Schedule,
    forward_schedule,
    jvp_schedule,
    saved_storages,
    train_schedule,
)
from graphflop.passes.memory_calls import ComposedSchedule, composed_forward_schedule
from graphflop.passes.optimizer import not_updated, optimizer_state_bytes, update_param_count
from graphflop.passes.recorded_memory import recorded_jvp_schedule, recorded_train_schedule
from graphflop.report import (
    ActivityGradientTotals,
    BackwardTotals,
    CostTotals,
    EagerAttention,
    ForwardGradientTotals,
    ForwardTotals,
    InputSpec,
    JvpTotals,
    LayerRow,
    Memory,
    OpRow,
    Ratios,
    Report,
    Totals,
    TrainStepTotals,
    Uncounted,
    UpdateTotals,
)

#: per-layer counters, in LayerRow's field order (output_shape and output_bytes apart)
_COUNTERS = (
    "saved_bytes",
    "params",
    "forward_flops",
    "forward_mm_flops",
    "backward_flops",
    "backward_mm_flops",
    "grad_input_flops",
    "grad_weight_flops",
    "grad_accum_flops",
    "pruned_flops",
    "update_flops",
    "jvp_flops",
    "jvp_mm_flops",
    "tangent_from_input_flops",
    "tangent_from_param_flops",
    "jvp_skipped_flops",
)
#: LayerRow's fields: the name, a layer's counters and output (a row of :class:`_Layers`, in
#: this order), then the ratios :meth:`_Layers.freeze` works out
_ROW_FIELDS = tuple(f.name for f in fields(LayerRow))
_RATIOS = ("ratio", "ratio_no_update", "jvp_ratio", "share")
_BLANK = {k: None if k == "output_shape" else 0 for k in _ROW_FIELDS[1 : -len(_RATIOS)]}
assert _ROW_FIELDS == ("name", *_BLANK, *_RATIOS) and set(_BLANK) == {
    *_COUNTERS,
    "output_shape",
    "output_bytes",
}


@dataclass(frozen=True)
class Graphs:
    """The annotated graphs of one analysis (``None`` for those not built)."""

    forward: GraphModule
    backward: GraphModule | None = None
    update: GraphModule | None = None
    jvp: GraphModule | None = None
    forward_gradient: GraphModule | None = None
    activity_gradient: GraphModule | None = None


class _Layers:
    """Per-module counters, in the order modules first appear."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}

    def __getitem__(self, path: str) -> dict:
        row = self.rows.get(path)
        if row is None:
            row = self.rows[path] = _BLANK.copy()
        return row

    def add(self, node: Node, key: str, value: int) -> None:
        self[node.meta.get(MODULE, "")][key] += value

    def freeze(self, forward_flops: int, *, backward: bool, jvp: bool) -> tuple[LayerRow, ...]:
        out = []
        new = object.__new__
        for path, c in self.rows.items():
            f = c["forward_flops"]
            shape = c["output_shape"]
            d = {"name": path if path else "(model)", **c}  # LayerRow's fields, in order
            if shape is not None:
                d["output_shape"] = tuple(shape)
            b = c["backward_flops"]
            d["ratio"] = _ratio(b + c["update_flops"], f) if backward else None
            d["ratio_no_update"] = _ratio(b, f) if backward else None
            d["jvp_ratio"] = _ratio(c["jvp_flops"], f) if jvp else None
            d["share"] = _ratio(f, forward_flops) or 0.0
            # the frozen dataclass's __init__ sets its 23 fields one by one through
            # object.__setattr__ (about 6 us a row, 9 rows per GPT-2 block): the same object
            # made from the fields at once
            row = new(LayerRow)
            row.__dict__.update(d)
            out.append(row)
        return tuple(out)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _ops(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _by_role(nodes: list[Node], default: str) -> dict[str, int]:
    by: dict[str, int] = {}
    for n in nodes:
        role = n.meta.get(ROLE, default)
        by[role] = by.get(role, 0) + n.meta[COST].flops
    return by


def _placeholders(gm: GraphModule) -> dict[str, Node]:
    return {n.name: n for n in gm.graph.find_nodes(op="placeholder")}


def _forward(
    fwd: GraphModule,
    nodes: list[Node] | None,
    layers: _Layers,
    figures: ForwardFigures | None,
    phs: dict[str, Node],
    numels: dict[str, int],
) -> tuple[NodeCost, NodeCost]:
    """Forward and loss totals; fills the layers' forward FLOPs, outputs and parameters (from
    the hierarchy's composed ``figures`` where given, else node by node). ``nodes``:
    :func:`_ops` of ``fwd`` (None: not listed yet); ``phs``: its :func:`_placeholders`;
    ``numels``: per parameter's placeholder, its elements."""
    sig = fwd.meta[SIGNATURE]
    # a buffer's new value (batch norm's running statistics) is not the layer's output
    written = {name for name, _ in sig.buffer_updates}
    if figures is not None:
        for path, r in figures.rows.items():
            L = layers[path]
            L["forward_flops"] += r.flops
            L["forward_mm_flops"] += r.mm_flops
    if figures is not None and figures.in_order and not written:
        # the outputs too from the composed rows (each module's last node's value, as the walk
        # below finds it), not node by node: about a sixth of the summary's own work per block
        for path, r in figures.rows.items():
            if r.has_output:
                L = layers[path]
                L["output_shape"] = list(r.output_shape or ())
                L["output_bytes"] = r.output_bytes
    else:
        nodes = _ops(fwd) if nodes is None else nodes
        _forward_nodes(nodes, layers, figures is None, written)
    for p, q in sig.params:
        layers[phs[p].meta.get(MODULE) or q.rpartition(".")[0]]["params"] += numels[p]
    if figures is not None:
        return figures.total, figures.loss
    nodes = _ops(fwd) if nodes is None else nodes
    return total_cost(nodes), total_cost(n for n in nodes if n.meta.get(ROLE) == "loss")


def _forward_nodes(nodes: list[Node], layers: _Layers, flops: bool, written: set[str]) -> None:
    """The layers' outputs node by node (a template's buffer updates are not told apart from
    its outputs by the composed rows), and where ``flops``, their forward FLOPs; ``written``:
    the nodes that are a buffer's new value (batch norm's running statistics), no output."""
    last: dict[str, torch.Tensor] = {}  # per module, the value of its last node (its output)
    rows: dict[str, dict] = {}  # the layers' rows met so far (made in the order first met)
    for n in nodes:
        meta = n.meta
        path = meta.get(MODULE, "")
        if path not in rows:
            rows[path] = layers[path]
        if flops:
            row = rows[path]
            c = meta[COST]
            row["forward_flops"] += c.flops
            row["forward_mm_flops"] += c.mm_flops
        v = meta.get("val")
        if isinstance(v, torch.Tensor) and n.name not in written:
            last[path] = v
    for path, v in last.items():
        L = layers[path]
        L["output_shape"] = list(v.shape)
        L["output_bytes"] = tensor_bytes(v)


#: per derivative phase: the role of a node without one, the roles with a per-layer counter
_PHASE_ROLES = {
    "backward": ("grad_input", ("grad_input", "grad_weight", "grad_accum")),
    "jvp": ("tangent_from_input", ("tangent_from_input", "tangent_from_param")),
    "update": ("update", ()),
    "forward_gradient_step": ("forward", ()),
}


def _jvp_work(n: Node) -> bool:
    """The JVP graph's nodes its totals count: tangents and their coefficients."""
    return n.meta.get(KIND) in ("tangent", "coef")


def _derived(gm: GraphModule | None, phase: str, hierarchical: bool) -> DerivedFigures | None:
    """The figures of derivative graph ``gm`` composed per template derivative
    (:mod:`graphflop.passes.calls`), where it has its blocks as calls and ``hierarchical``."""
    dh = gm.meta.get(DERIVED_HIERARCHY) if gm is not None and hierarchical else None
    if dh is None:
        return None
    keep = _jvp_work if phase == "jvp" else (lambda n: True)
    return derived_figures(dh, keep, _PHASE_ROLES[phase][0])


def _add_composed(f: DerivedFigures, layers: _Layers, phase: str) -> None:
    """:func:`_add_phase` from composed figures."""
    roles = {r: f"{r}_flops" for r in _PHASE_ROLES[phase][1]}
    key, mm_key = f"{phase}_flops", f"{phase}_mm_flops"
    for path, (flops, mm, by_role) in f.rows.items():
        L = layers[path]
        L[key] += flops
        L[mm_key] += mm
        for role, x in by_role.items():
            if role in roles:
                L[roles[role]] += x


def _backward(bwd: GraphModule, layers: _Layers, f: DerivedFigures | None) -> BackwardTotals:
    """Backward totals; node by node, or from the composed figures ``f`` where given."""
    if f is not None:
        _add_composed(f, layers, "backward")
        total, by = f.total, f.by_role
        complete = not bwd.meta.get(GAPS) and not f.rule_less
    else:
        nodes = _ops(bwd)
        _add_phase(nodes, layers, "backward", *_PHASE_ROLES["backward"])
        total, by = total_cost(nodes), _by_role(nodes, "grad_input")
        complete = _complete(bwd, nodes)
    pruned = _ghost_flops(bwd, layers, "pruned_flops")
    return BackwardTotals(
        **CostTotals.cost_fields(total),
        complete=complete,
        grad_input_flops=by.get("grad_input", 0),
        grad_weight_flops=by.get("grad_weight", 0),
        grad_accum_flops=by.get("grad_accum", 0),
        loss_flops=by.get("loss", 0),
        pruned_flops=pruned,
        recompute_flops=by.get("recompute", 0),
    )


def _add_phase(
    nodes: list[Node], layers: _Layers, phase: str, default_role: str, roles: tuple[str, ...]
) -> None:
    """Add each node's FLOPs to its layer's ``<phase>_flops``/``<phase>_mm_flops`` and, for the
    roles in ``roles``, to ``<role>_flops`` (a node without a role counts as ``default_role``)."""
    for n in nodes:
        c = n.meta[COST]
        role = n.meta.get(ROLE, default_role)
        layers.add(n, f"{phase}_flops", c.flops)
        layers.add(n, f"{phase}_mm_flops", c.mm_flops)
        if role in roles:
            layers.add(n, f"{role}_flops", c.flops)


def _ghost_flops(gm: GraphModule, layers: _Layers, key: str) -> int:
    """The FLOPs of ``gm``'s ghosts (work not emitted), also added to each layer's ``key``."""
    total = 0
    for g in gm.meta.get(GHOSTS, []):
        total += g.cost.flops
        layers[g.module][key] += g.cost.flops
    return total


def _update(
    upd: GraphModule,
    layers: _Layers,
    optimizer: str,
    f: DerivedFigures | None,
    skipped: frozenset[str],
) -> UpdateTotals:
    """Update totals; FLOPs per parameter over the elements updated (a parameter without a
    gradient gets no update: :func:`~graphflop.passes.optimizer.update_param_count`, with
    ``skipped`` its :func:`~graphflop.passes.optimizer.not_updated`); node by node, or from
    the composed figures ``f`` where given."""
    params = update_param_count(upd, skipped)
    if f is not None:
        for path, (flops, _, _) in f.rows.items():
            layers[path]["update_flops"] += flops
        total = f.total
    else:
        nodes = _ops(upd)
        for n in nodes:
            layers.add(n, "update_flops", n.meta[COST].flops)
        total = total_cost(nodes)
    return UpdateTotals(
        **CostTotals.cost_fields(total),
        complete=True,  # the optimizers' ops all have rules
        optimizer=optimizer,
        flops_per_param=_ratio(total.flops, params),
    )


def _jvp(jvp: GraphModule, layers: _Layers, tangents: str, f: DerivedFigures | None) -> JvpTotals:
    """JVP totals; node by node, or from the composed figures ``f`` where given."""
    if f is not None:
        _add_composed(f, layers, "jvp")
        total, by = f.total, f.by_role
        complete = not jvp.meta.get(GAPS) and not f.rule_less
    else:
        nodes = [n for n in _ops(jvp) if _jvp_work(n)]
        _add_phase(nodes, layers, "jvp", *_PHASE_ROLES["jvp"])
        total, by = total_cost(nodes), _by_role(nodes, "tangent_from_input")
        complete = _complete(jvp, nodes)
    skipped = _ghost_flops(jvp, layers, "jvp_skipped_flops")
    return JvpTotals(
        **CostTotals.cost_fields(total),
        complete=complete,
        tangent_from_input_flops=by.get("tangent_from_input", 0),
        tangent_from_param_flops=by.get("tangent_from_param", 0),
        skipped_flops=skipped,
        tangents=tangents,
    )


def _forward_gradient(
    fg: GraphModule, jvp_complete: bool, f: DerivedFigures | None
) -> ForwardGradientTotals:
    """Forward-gradient step totals; node by node, or from the composed figures ``f``."""
    info = fg.meta[FORWARD_GRADIENT]
    if f is not None:
        total, by = f.total, f.by_role
        complete = not fg.meta.get(GAPS) and not f.rule_less
    else:
        nodes = _ops(fg)
        total, by = total_cost(nodes), _by_role(nodes, "forward")
        complete = _complete(fg, nodes)
    return ForwardGradientTotals(
        **CostTotals.cost_fields(total),
        complete=jvp_complete and complete,
        directions=info.directions,
        distribution=info.distribution,
        primal_flops=by.get("forward", 0) + by.get("loss", 0),
        tangent_flops=by.get("tangent_from_input", 0) + by.get("tangent_from_param", 0),
        direction_flops=by.get("direction", 0),
        update_flops=by.get("update", 0),
        tangent_pass=info.tangent_pass,
    )


def _activity_gradient(g: Graphs, ag: GraphModule, jvp_complete: bool) -> ActivityGradientTotals:
    """The totals of ``ag``, ``g``'s activity-perturbed step graph."""
    from graphflop.passes.activity_gradient import step_peak_bytes

    nodes = _ops(ag)
    by = _by_role(nodes, "forward")
    return ActivityGradientTotals(
        **CostTotals.cost_fields(total_cost(nodes)),
        complete=jvp_complete and _complete(ag, nodes),
        directions=ag.meta[FORWARD_GRADIENT].directions,
        primal_flops=by.get("forward", 0) + by.get("loss", 0),
        tangent_flops=by.get("tangent_from_input", 0) + by.get("tangent_from_param", 0),
        direction_flops=by.get("direction", 0),
        grad_weight_flops=by.get("grad_weight", 0),
        update_flops=by.get("update", 0),
        peak_bytes=step_peak_bytes(ag),
        weight_perturbation_peak_bytes=(
            step_peak_bytes(flat_view(g.forward_gradient))
            if g.forward_gradient is not None
            else None
        ),
    )


def _memory(
    g: Graphs,
    params_bytes: int,
    buffers_bytes: int,
    optimizer: str,
    trainable_bytes: int,
    stateful: tuple[int, int],
    model: str,
    device: str,
    keep_grads: bool,
    composed: bool,
) -> tuple[Memory, dict[str, int]]:
    """(the memory figures, the storages saved for backward: owner node name -> bytes, empty
    without a backward graph). Gradients and optimizer state only for the trainable
    parameters (``trainable_bytes`` of them; under the eager model, the gradients and the
    state as :func:`~graphflop.passes.optimizer.optimizer_state_bytes` counts it, Adam's step
    counts included, of the ``stateful`` (bytes, tensors) of them only: those the backward
    gives a gradient, as eager autograd leaves ``.grad`` None for the others and
    ``torch.optim`` makes no state for them); the parameters and buffers (``params_bytes +
    buffers_bytes``) are live in every peak; ``model``: ``eager`` or ``graph``
    (:mod:`graphflop.passes.eager_memory`). ``composed``: the forward peak, and under the
    eager model the train peak and the saved storages, from schedules that work out each
    repeated block's steps once per template and compose its calls
    (:mod:`graphflop.passes.memory_calls`; the same bytes as the flat schedules), and the
    eager JVP peak too. Under the eager model a recorded derivative hierarchy
    (``direct=True``) is scheduled off its top level (:mod:`graphflop.passes.recorded_memory`:
    the same bytes), else, or where a call could differ from its template's copy, on its flat
    view (:func:`~graphflop.passes.calls.flat_view`, whose calls compose as above)."""
    # the eager schedules read a recorded hierarchy's calls off its top level (its flat view
    # only where a call could differ from its template: recorded_memory's None)
    jsched: Schedule | ComposedSchedule | None = None
    train: tuple[ComposedSchedule, dict[str, int]] | None = None
    if model == "eager" and composed:
        if g.jvp is not None:
            jsched = recorded_jvp_schedule(g.jvp, device)
        if g.backward is not None:
            train = recorded_train_schedule(g.forward, g.backward, optimizer, device, keep_grads)
    g = replace(
        g,
        backward=_flat(g.backward) if train is None else g.backward,
        jvp=_flat(g.jvp) if jsched is None else g.jvp,
    )
    fsched = composed_forward_schedule(g.forward) if composed else None
    fpeak, _ = (fsched or forward_schedule(g.forward)).peak()
    resident = params_bytes + buffers_bytes  # the module's state: held for its whole life
    mem: dict[str, Any] = {"forward_peak_bytes": resident + fpeak}
    owners: dict[str, int] = {}
    if g.backward is not None:
        # eager: torch.optim's state, Adam's per-parameter step counts included, for the
        # parameters that get a gradient (torch.optim skips p.grad None and makes no state);
        # graphflop's update graph takes the moments of every trainable parameter and one
        # step scalar
        # eager: gradients for the parameters autograd gives one (p.grad stays None for one
        # read only where no gradient reaches it: under no_grad, after a detach, before a
        # no_grad call cuts the path off), as torch.optim's state; graphflop's update graph
        # reads a gradient for every trainable parameter
        if model == "eager":
            state = optimizer_state_bytes(optimizer, *stateful)
            grads = stateful[0]
        else:
            state = optimizer_state_bytes(optimizer, trainable_bytes, 0)
            grads = trainable_bytes
        if train is not None:  # the eager model, read off the recorded backward
            tpeak, _ = train[0].peak()
            owners = train[1]
            train_peak = resident + state + grads * keep_grads + tpeak
        elif model == "eager":  # gradients are scheduled: they appear as the backward makes them
            er = eager_residuals(g.forward, g.backward, device)
            sched = eager_train_schedule(
                g.forward, g.backward, optimizer, device, keep_grads, composed=composed, eager=er
            )
            tpeak, _ = sched.peak()
            train_peak = resident + state + grads * keep_grads + tpeak
            c = sched if isinstance(sched, ComposedSchedule) else None
            owners = eager_saved_storages(g.forward, g.backward, device, eager=er, schedule=c)
        else:
            tpeak, _ = train_schedule(g.forward, g.backward, _flat(g.update)).peak()
            train_peak = resident + state + trainable_bytes + tpeak
            owners = saved_storages(g.forward, g.backward)
        if model == "eager":  # the model's own checkpoint calls' RNG states (as --checkpoint's)
            train_peak += rng_state_bytes(checkpoint_calls(g.forward))
        # eager_saved_bytes / saved_for_backward_bytes: the sum over the saved storages
        saved = sum(owners.values())
        mem.update(
            grads_bytes=grads,
            optimizer_state_bytes=state,
            saved_for_backward_bytes=saved,
            train_peak_bytes=train_peak,
        )
    if g.jvp is not None:
        if jsched is None:
            jsched = (
                eager_jvp_schedule(g.jvp, device, composed)
                if model == "eager"
                else jvp_schedule(g.jvp)
            )
        jpeak, _ = jsched.peak()
        n_tan = sum(
            tensor_bytes(n.meta["val"])
            for n in g.jvp.graph.find_nodes(op="placeholder")
            if n.meta.get(KIND) == "tangent"
        )
        mem["jvp_peak_bytes"] = resident + n_tan + jpeak
    describes = {k: v.format(device=device) for k, v in DESCRIBES[model].items() if k in mem}
    if keep_grads and "train_peak_bytes" in describes:
        describes["train_peak_bytes"] = describes["train_peak_bytes"].replace(
            "allocated as produced (zero_grad(set_to_none=True))",
            "live from the start, accumulated into (zero_grad(set_to_none=False))",
        )
    memory = Memory(
        params_bytes=params_bytes,
        buffers_bytes=buffers_bytes,
        memory_model=model,
        device=device,
        describes=describes,
        keep_grads=keep_grads,
        **mem,
    )
    return memory, owners


def _flat(gm: GraphModule | None) -> GraphModule | None:
    """:func:`~graphflop.passes.calls.flat_view` of ``gm`` (None stays None)."""
    return flat_view(gm) if gm is not None else None


def _saved_by_layer(g: Graphs, layers: _Layers, owners: dict[str, int]) -> None:
    """Each layer's ``saved_bytes``: the saved storages (``owners``) its forward nodes
    allocated."""
    nodes = {n.name: n for n in g.forward.graph.nodes}
    for name, nbytes in owners.items():
        layers[nodes[name].meta.get(MODULE, "")]["saved_bytes"] += nbytes


def _ratios(t: Totals) -> Ratios:
    f = t.forward
    r: dict[str, float | None] = {}
    if t.backward is not None:
        b, u, step = t.backward, t.update, t.train_step
        assert u is not None and step is not None, "built with the backward's totals"
        r.update(
            backward_forward=_ratio(b.flops + u.flops, f.flops),
            backward_forward_no_update=_ratio(b.flops, f.flops),
            backward_forward_mm=_ratio(b.mm_flops, f.mm_flops),
            train_step_forward=_ratio(step.flops, f.flops),
        )
    if t.forward_gradient_step is not None:
        r["forward_gradient_step_forward"] = _ratio(t.forward_gradient_step.flops, f.flops)
    if t.jvp is not None:
        r["jvp_forward"] = _ratio(t.jvp.flops, f.flops)
    return Ratios(**r)


def _inputs(fwd: GraphModule, phs: dict[str, Node]) -> tuple[InputSpec, ...]:
    """The model inputs' specs; ``phs``: :func:`_placeholders` of ``fwd``."""
    return tuple(
        InputSpec(
            n,
            tuple(phs[n].meta["val"].shape),
            str(phs[n].meta["val"].dtype).removeprefix("torch."),
        )
        for n in fwd.meta[SIGNATURE].inputs
    )


def _totals(
    g: Graphs,
    layers: _Layers,
    optimizer: str,
    tangents: str,
    figures: ForwardFigures | None,
    derived: dict[str, DerivedFigures | None],
    fwd_nodes: list[Node] | None,
    fwd_rule_less: list[Node],
    phs: dict[str, Node],
    numels: dict[str, int],
    skipped: frozenset[str],
) -> Totals:
    """The totals; ``fwd_nodes``: :func:`_ops` of the forward (None: not listed yet),
    ``fwd_rule_less``: :func:`_rule_less` of them, ``phs`` and ``numels`` as :func:`_forward`
    reads them, ``skipped``: the parameters the update passes through (:func:`_update`)."""
    fwd_total, loss_total = _forward(g.forward, fwd_nodes, layers, figures, phs, numels)
    gaps = bool(g.forward.meta.get(GAPS))
    loss_rule_less = [n for n in fwd_rule_less if n.meta.get(ROLE) == "loss"]
    t: dict = {
        "forward": ForwardTotals.of(
            fwd_total,
            complete=not gaps and not fwd_rule_less,
            unused_flops=g.forward.meta.get(UNUSED, NodeCost()).flops,
        ),
        "loss": CostTotals.of(loss_total, complete=not gaps and not loss_rule_less),
    }
    if g.backward is not None:
        assert g.update is not None, "summarize checks the update comes with the backward"
        b = t["backward"] = _backward(g.backward, layers, derived.get("backward"))
        u = t["update"] = _update(g.update, layers, optimizer, derived.get("update"), skipped)
        mm = fwd_total.mm_flops + b.mm_flops
        t["train_step"] = TrainStepTotals(
            flops=fwd_total.flops + b.flops + u.flops,
            mm_flops=mm,
            macs=mm // 2,
            complete=t["forward"].complete and b.complete and u.complete,
        )
    if g.jvp is not None:
        j = t["jvp"] = _jvp(g.jvp, layers, tangents, derived.get("jvp"))
        if g.forward_gradient is not None:
            t["forward_gradient_step"] = _forward_gradient(
                g.forward_gradient, j.complete, derived.get("forward_gradient_step")
            )
        if g.activity_gradient is not None:
            t["activity_gradient_step"] = _activity_gradient(g, g.activity_gradient, j.complete)
    return Totals(**t)


def _rule_less(nodes: list[Node]) -> list[Node]:
    """The nodes whose op has no rule (counted as 0 FLOPs); a call of a template derivative
    (``graphflop::repeat``) is not one (its template's nodes are: :func:`rule_less_calls`)."""
    # the ops met, by identity (an OpOverload hashes in Python: a third of a walk keyed on
    # them), each looked up once; the nodes walked again only where one lacks a rule
    ops = {id(t): t for t in [n.target for n in nodes]}
    missing = {
        i
        for i, t in ops.items()
        if t is not operator.getitem and t is not _REPEAT and not has_rule(t)
    }
    if not missing:
        return []
    return [n for n in nodes if id(n.target) in missing]


_REPEAT = torch.ops.graphflop.repeat.default


def _ruled(h: Hierarchy) -> bool:
    """Every op of the flat forward graph of hierarchy ``h`` has a rule (``getitem`` apart):
    those of its top level's nodes and of its variants' templates (each template's nodes read
    once, not each call's), as :func:`_rule_less` tells them."""
    ops = {id(n.target): n.target for n in h.top if isinstance(n, Node) and n.op == "call_function"}
    for t in {t for t, _ in h.variants}:
        ops.update(
            (id(n.target), n.target) for n in h.templates[t].nodes if n.op == "call_function"
        )
    return all(t is operator.getitem or t is _REPEAT or has_rule(t) for t in ops.values())


def _complete(gm: GraphModule, nodes: list[Node]) -> bool:
    """Every node of ``nodes`` counted and the graph not cut for want of a rule."""
    return not gm.meta.get(GAPS) and not _rule_less(nodes)


_KINDS = ("cost", "jvp", "transpose", "recompute")


def _uncounted(
    g: Graphs, fwd_rule_less: list[Node], derived: dict[str, DerivedFigures | None]
) -> tuple[Uncounted, ...]:
    """Ops lacking a rule some graph needed: forward nodes without a cost rule
    (``fwd_rule_less``: :func:`_rule_less` of the forward's), nodes that derivative rules
    emitted without one, and the JVP and backward graphs' cuts (``GAPS``), grouped by op in
    the order first met. A recorded graph whose composed figures (``derived``, as
    :func:`_totals` reads them) found an op for every node is not walked again."""
    by: dict[str, tuple[dict[str, None], dict[str, None], set[str]]] = {}

    def add(op: str, node: str, module: str, kind: str) -> None:
        nodes, modules, kinds = by.setdefault(op, ({}, {}, set()))
        nodes[node] = None
        modules[module] = None
        kinds.add(kind)

    phases = {
        "backward": g.backward,
        "jvp": g.jvp,
        "update": g.update,
        "forward_gradient_step": g.forward_gradient if g.jvp is not None else None,
    }
    # the graphs whose composed figures found every op ruled
    ruled = {id(gm) for k, gm in phases.items() if (f := derived.get(k)) is not None and f.ruled}
    for gm in (g.forward, g.jvp, g.backward, g.update, g.forward_gradient):
        if gm is None:
            continue
        if is_recorded(gm):  # the top level's nodes, and each call's template nodes
            if id(gm) not in ruled:  # (else none: derived_figures walked the same nodes)
                for n, source, module in rule_less_calls(gm):
                    add(op_name(n.target), source or n.name, module, "cost")
        else:
            for n in fwd_rule_less if gm is g.forward else _rule_less(_ops(gm)):
                add(op_name(n.target), n.meta.get(SOURCE) or n.name, n.meta.get(MODULE, ""), "cost")
        for gap in gm.meta.get(GAPS, ()):
            add(gap.op, gap.node, gap.module, gap.kind)
    return tuple(
        Uncounted(
            op,
            len(nodes),
            tuple(nodes),
            tuple(modules),
            tuple(k for k in _KINDS if k in kinds),
        )
        for op, (nodes, modules, kinds) in by.items()
    )


def _op_rows(
    g: Graphs, figures: ForwardFigures | None, derived: dict[str, DerivedFigures | None]
) -> tuple[OpRow, ...]:
    """Per phase, the nodes of each op summed, in the order ops first appear; the nodes are
    those each phase's totals sum (the JVP graph's tangent and coefficient nodes); the
    forward's from the hierarchy's composed ``figures`` where given, the backward's and the
    JVP's from their composed ``derived`` figures where given."""
    phases = {
        "forward": g.forward,
        "backward": g.backward,
        "update": g.update,
        "jvp": g.jvp,
        "forward_gradient_step": g.forward_gradient if g.jvp is not None else None,
    }
    rows: list[OpRow] = []
    for phase, gm in phases.items():
        if gm is None or (phase == "update" and g.backward is None):
            continue
        composed = figures if phase == "forward" else derived.get(phase)
        if composed is not None:
            for op, (count, c) in composed.ops.items():
                rows.append(
                    OpRow(op, phase, count, c.flops, c.mm_flops, c.bytes_read, c.bytes_written)
                )
            continue
        nodes = _ops(gm)
        if phase == "jvp":
            nodes = [n for n in nodes if n.meta.get(KIND) in ("tangent", "coef")]
        by: dict[str, list[NodeCost]] = {}
        for n in nodes:
            if n.target is not operator.getitem:
                by.setdefault(op_name(n.target), []).append(n.meta[COST])
        for op, costs in by.items():
            c = sum_costs(costs)
            rows.append(
                OpRow(op, phase, len(costs), c.flops, c.mm_flops, c.bytes_read, c.bytes_written)
            )
    return tuple(rows)


def summarize(
    graphs: Graphs,
    *,
    name: str,
    optimizer: str,
    tangents: str,
    memory_model: str = "eager",
    device: str = "cpu",
    keep_grads: bool = False,
    hierarchical: bool = True,
) -> Report:
    """Roll the node annotations of ``graphs`` up into a :class:`~graphflop.report.Report`.

    Args:
        graphs: the flop-annotated graphs; ``update`` is required when ``backward`` is given,
            and ``forward_gradient`` is reported only with ``jvp``.
        name: the model's name.
        optimizer: the update's optimizer (for the state bytes and the report).
        tangents: which values carry tangents in the JVP graph (for the report).
        memory_model, device: the execution the memory figures describe (``eager`` on
            ``cpu``/``cuda``, or ``graph``: :mod:`graphflop.passes.eager_memory`).
        keep_grads: gradients kept between steps (``zero_grad(set_to_none=False)``).
        hierarchical: where the forward graph has a :class:`~graphflop.meta.Hierarchy`, take
            its totals, per-module forward rows and op table from each template's figures
            composed over its calls (:mod:`graphflop.passes.hierarchy`), and the backward's
            and the JVP's from their template derivatives where they keep their blocks as
            calls (:data:`~graphflop.meta.DERIVED_HIERARCHY`, :mod:`graphflop.passes.calls`),
            the update's and the forward-gradient step's likewise
            (:mod:`graphflop.passes.step_calls`);
            the forward peak, and under the eager memory model the train and JVP peaks and
            the saved storages, from each block's steps worked out once per template and composed over
            its calls (:mod:`graphflop.passes.memory_calls`). False sums the flat graphs'
            nodes one by one and schedules them node by node. Both give the same report.

    Raises:
        KeyError: a graph lacks ``COST`` (run ``annotate_flops``) or the forward graph lacks
            ``SIGNATURE``.
        ValueError: ``graphs`` has a backward graph without its update graph.
    """
    if graphs.backward is not None and graphs.update is None:
        raise ValueError("summarize: graphs.backward is given without graphs.update")
    if not hierarchical:  # node by node: the flat graphs of recorded derivative hierarchies
        graphs = replace(
            graphs,
            backward=_flat(graphs.backward),
            jvp=_flat(graphs.jvp),
            update=_flat(graphs.update),
            forward_gradient=_flat(graphs.forward_gradient),
        )
    fwd = graphs.forward
    sig = fwd.meta[SIGNATURE]
    phs = _placeholders(fwd)
    # each parameter's elements and bytes read once (the sums below and the layers' rows
    # read them: a few per parameter, hundreds of parameters in a deep model)
    numels: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for p, _ in sig.params:
        v = phs[p].meta["val"]
        numels[p] = v.numel()
        nbytes[p] = tensor_bytes(v)
    params = sum(numels[p] for p, _ in sig.params)
    params_bytes = sum(nbytes[p] for p, _ in sig.params)
    buffers_bytes = sum(tensor_bytes(phs[b].meta["val"]) for b, _ in sig.buffers)
    # frozen parameters (requires_grad=False): no gradient, update or optimizer state
    trainables = sig.trainable()
    trainable = sum(numels[p] for p, _ in trainables)
    trainable_bytes = sum(nbytes[p] for p, _ in trainables)
    # those the backward gives a gradient: the update skips the others (not_updated), and
    # torch.optim keeps no state for them
    skipped = not_updated(graphs.update) if graphs.update is not None else frozenset()
    stateful = [p for p, q in trainables if q not in skipped]
    stateful_sizes = (sum(nbytes[p] for p in stateful), len(stateful))
    layers = _Layers()
    h = hierarchy_of(fwd) if hierarchical else None
    figures = forward_figures(fwd, h) if h is not None else None
    derived = {
        "backward": _derived(graphs.backward, "backward", hierarchical),
        "jvp": _derived(graphs.jvp, "jvp", hierarchical),
        "update": _derived(graphs.update, "update", hierarchical),
        "forward_gradient_step": _derived(
            graphs.forward_gradient if graphs.jvp is not None else None,
            "forward_gradient_step",
            hierarchical,
        ),
    }
    # the forward's nodes listed only where read: the hierarchy's templates and top level
    # tell whether an op lacks a rule (_ruled), and the composed figures give the layers'
    # outputs where the calls' nodes are each one run of the block (in_order) and no node is
    # a buffer's new value
    fwd_nodes = (
        None if figures is not None and figures.in_order and not sig.buffer_updates else _ops(fwd)
    )
    if h is not None and fwd_nodes is None and _ruled(h):
        fwd_rule_less: list[Node] = []
    else:
        fwd_rule_less = _rule_less(fwd_nodes if fwd_nodes is not None else _ops(fwd))
    totals = _totals(
        graphs,
        layers,
        optimizer,
        tangents,
        figures,
        derived,
        fwd_nodes,
        fwd_rule_less,
        phs,
        numels,
        skipped,
    )
    ops = _op_rows(graphs, figures, derived)
    uncounted = _uncounted(graphs, fwd_rule_less, derived)
    # the composed figures' per-module rows and the forward's node list are read: not kept
    # through the memory schedules, the analysis's peak (about 20 KiB per Llama layer)
    del figures, derived, fwd_nodes
    memory, owners = _memory(
        graphs,
        params_bytes,
        buffers_bytes,
        optimizer,
        trainable_bytes,
        stateful_sizes,
        memory_model,
        device,
        keep_grads,
        hierarchical,
    )
    _saved_by_layer(graphs, layers, owners)
    return Report(
        model=name,
        inputs=_inputs(fwd, phs),
        params=params,
        loss=fwd.meta.get(LOSS_KIND),
        optimizer=optimizer if graphs.backward is not None else None,
        totals=totals,
        ratios=_ratios(totals),
        memory=memory,
        layers=layers.freeze(
            totals.forward.flops, backward=totals.backward is not None, jvp=totals.jvp is not None
        ),
        # trainable and frozen parameter counts
        trainable_params=trainable,
        frozen_params=params - trainable,
        uncounted=uncounted,
        ops=ops,
        assumptions=tuple(fwd.meta.get(ASSUMPTIONS, ())),
        eager_attention=_eager_attention(graphs),
    )


def _eager_attention(g: Graphs) -> EagerAttention | None:
    """The fused attention calls' extra backward work in eager PyTorch, where there is a
    backward and a fused call (:func:`~graphflop.passes.eager_attention.eager_attention_flops`)."""
    if g.backward is None:
        return None
    ea = eager_attention_flops(g.forward)
    return ea if ea.calls else None
