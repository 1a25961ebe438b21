"""The forward-gradient step (Baydin et al. 2022, "Gradients without Backpropagation",
arXiv 2202.08587) as one explicit graph.

For each of ``K`` directions: sample ``v`` with one entry per parameter element (Gaussian, or
Rademacher ±1), run the JVP with ``v`` as the parameter tangents to get the scalar directional
derivative ``d = ∇L·v``; the gradient estimate is ``g = (1/K) Σ d·v``, an unbiased estimate of
``∇L`` for directions with identity covariance. The optimizer update is then applied to ``g``.
Primal (and coefficient) nodes are shared by the ``K`` directions: only tangent work repeats.
For ``K`` > 1 the tangent work is one pass on tangents with a leading ``K`` dimension (each
op batched as ``torch.func.vmap`` batches it), or ``K`` copies where that is not possible.

Outputs, in order: the loss, the new parameters, the new optimizer state, then the ``K``
directional derivatives. Writes ``ROLE="direction"`` on the sampling and ``g = d·v`` nodes and
``gm.meta[FORWARD_GRADIENT]`` (:class:`ForwardGradientInfo`).

Given a recorded JVP (:func:`~graphflop.passes.calls.is_recorded`: each repeated block's JVP
built once per variant) and one sampled direction, the step is built without expanding it: its
top level is the JVP's top level copied, each block call still a call of the block's JVP
template (a direction's tangent work through a block is that template), with the update
graph's calls as calls and the directions and estimates made calls per block
(:class:`~graphflop.passes.step_calls.StepRecorder`); the step returned is that recorded top
level, and :func:`~graphflop.passes.calls.flat_view` of it is, node for node and name for name,
the step built from the flat JVP. Otherwise (``K`` > 1, directions as inputs, a JVP whose log
holds a custom Function's entries) the step is built from the JVP's flat view.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from graphflop.ad.builder import (
    NO_KWARGS,
    Builder,
    RuleContext,
    copy_node,
    find_row,
    makes_nodes,
    new_node,
)
from graphflop.ad.functions import FunctionEntry
from graphflop.ad.jvp import build_jvp
from graphflop.meta import (
    CONSTANTS,
    COST,
    DERIVED_HIERARCHY,
    FORWARD_GRADIENT,
    JVP,
    KIND,
    MODULE,
    PACKED,
    PARAM,
    ROLE,
    SIGNATURE,
    SOURCE,
    UPDATE,
    ForwardGradientInfo,
    JvpInfo,
    Signature,
    fresh_fake,
    graph_fake_mode,
    graph_module,
)
from graphflop.passes import step_calls
from graphflop.passes.calls import CallLog, DerivedHierarchy, flat_view, is_recorded, unpack
from graphflop.passes.infra import FLAT, GraphPass
from graphflop.passes.optimizer import (
    SLOT,
    OptimizerConfig,
    build_update_for,
    inline_update,
    template_node,
)

aten = torch.ops.aten
DISTRIBUTIONS = ("normal", "rademacher")
#: forward-gradient directions' upper bound (analyze's, inspect's and train's directions): each
#: holds a tangent of every parameter, and the step graph one JVP per direction (a tester's
#: K = 10,000 took 123 s and 1.4 GB on a 30-parameter model; K = 10^8 ran until killed)
MAX_DIRECTIONS = 1024


class _StepBuilder(Builder):
    active_kind = "update"

    def kind_for(self, args_flat):
        return "direction"


def build_forward_gradient_step(
    forward: GraphModule,
    optimizer: str | OptimizerConfig = "sgd",
    *,
    directions: int = 1,
    distribution: str = "normal",
    direction_inputs: bool = False,
    jvp: GraphModule | None = None,
    update: GraphModule | None = None,
    batched: bool = True,
) -> GraphModule:
    """Build the forward-gradient step graph of a traced forward graph (see module docstring).

    Args:
        forward: a graph from :func:`graphflop.frontend.trace.trace` with a loss.
        optimizer: the update applied to the estimate (``sgd``, ``momentum``, ``adam``,
            ``adamw``).
        directions: ``K`` ≥ 1 directions averaged in one step.
        distribution: ``normal`` (N(0, I)) or ``rademacher`` (±1, drawn as the sign of a normal
            sample).
        direction_inputs: take the directions as inputs instead of sampling them (for export
            and for reproducible runs).
        jvp: ``build_jvp(forward, "params")`` when already built (flat, or recorded:
            ``direct=True``, see the module docstring); built here (flat) otherwise.
        update: ``build_update_for(forward, optimizer)`` when already built (flat, or
            recorded: ``direct=True``); built here otherwise.
        batched: for ``K`` > 1, one tangent pass on tangents with a leading ``K`` dimension
            (as ``torch.func.vmap`` batches them; same FLOPs as ``K`` copies, fewer nodes)
            instead of ``K`` copies of the tangent nodes. An op the batching cannot handle is
            copied per direction, and if the batched pass fails as a whole the graph falls back
            to ``K`` copies, as it takes them for a graph with a data-dependent size
            (:func:`data_dependent`); ``ForwardGradientInfo.tangent_pass`` says which.

    Raises:
        ValueError: bad ``directions`` or ``distribution``, a forward graph without a loss, or
            an ``update`` graph for another optimizer.
    """
    sig = _check(forward, optimizer, directions, distribution, update)
    jvp = jvp if jvp is not None else build_jvp(forward, "params")
    fake_mode = graph_fake_mode(forward)
    upd = (
        update if update is not None else build_update_for(forward, optimizer, fake_mode=fake_mode)
    )
    if is_recorded(jvp):
        if _records(jvp, upd, directions, direction_inputs):
            step = _recorded_step(forward, sig, jvp, upd, fake_mode, distribution)
            step.meta[CONSTANTS] = forward.meta.get(CONSTANTS, {})  # as the flat step's
            return step
        jvp = flat_view(jvp)  # built flat from the JVP's flat graph (below)
    upd = flat_view(upd)  # a recorded update (``direct``): its flat graph, copied below
    info: JvpInfo = jvp.meta[JVP]
    how = "one tangent pass" if directions == 1 else "copies: asked for (batched=False)"
    st = _Start(jvp, upd, info, fake_mode, directions, direction_inputs)
    ds: list[Node] = []
    vs: list[dict] = []
    if directions > 1 and batched and data_dependent(forward):
        how = "copies: a size that depends on values (a routed expert dispatch) cannot be batched"
    elif directions > 1 and batched:
        try:
            ds, vs, how = _batched_pass(st, jvp, info, distribution, directions)
        except Exception as e:  # noqa: BLE001 - any op vmap cannot trace: K copies instead
            st = _Start(jvp, upd, info, fake_mode, directions, direction_inputs)
            how = f"copies: the batched pass failed ({type(e).__name__}: {_first_line(e)})"
    g, b, env, phs, state_phs = st.g, st.b, st.env, st.phs, st.state_phs
    jvp_copies: dict[Node, Node] = {}  # the first direction's copy of every JVP node
    upd_copies: dict[Node, Node] = {}
    with b.context(role="direction"):
        if not ds:
            for k in range(directions):
                v = _direction(b, info, phs, k, st.given, distribution)
                out = jvp_copies if k == 0 else None
                ds.append(_copy_tangents(g, jvp, info, env, v, first=k == 0, copies=out))
                vs.append(v)
        grads = _estimate(b, info, ds, vs)
    qual = dict(sig.trainable())
    new_state = inline_update(
        g,
        upd,
        {qual[p]: phs[p] for p in qual},
        {qual[p]: grads[p] for p in qual},
        state_phs,
        copies=upd_copies,
    )
    gm = _step_module(g, sig, jvp, upd, info, env, new_state, ds, st, distribution, how)
    # the work through each repeated block as calls of one template per block variant: the
    # JVP graph's and the update graph's calls as copied, the directions and estimates read off
    known: list[step_calls.Known] = []
    for built, copies in ((jvp, jvp_copies), (upd, upd_copies)):
        dh = built.meta.get(DERIVED_HIERARCHY)
        if dh is not None and copies:
            known += step_calls.known_calls(dh, copies)
    dh = step_calls.build(gm, forward, known, update=upd)
    if dh is not None:
        gm.meta[DERIVED_HIERARCHY] = dh
    # the forward's constants (torch.tensor(...) made in forward) are this graph's inputs too
    gm.meta[CONSTANTS] = forward.meta.get(CONSTANTS, {})
    return gm


#: ops whose output size is their input's values (a mixture-of-experts loop's rows of an expert)
_DATA_DEPENDENT = (torch.ops.aten.nonzero.default,)


def data_dependent(forward: GraphModule) -> bool:
    """Whether ``forward`` holds an op whose output size depends on values (a routed expert
    dispatch, :mod:`graphflop.frontend.dispatch`): the trace gave it the size the routing
    assumption says, real inputs give it theirs. A direction's own tangent pass runs with
    those; a batched pass reshapes the ``K`` directions' rows to the traced size and cannot,
    so such a step takes ``K`` copies."""
    return any(n.op == "call_function" and n.target in _DATA_DEPENDENT for n in forward.graph.nodes)


def _step_module(
    g: Graph,
    sig: Signature,
    jvp: GraphModule,
    upd: GraphModule,
    info: JvpInfo,
    env: dict[Node, Any],
    new_state: list[Node],
    ds: list[Node],
    st: _Start,
    distribution: str,
    how: str,
) -> GraphModule:
    """The step's outputs (``env``: each JVP node's copy) and its graph module with its
    annotations (:data:`~graphflop.meta.SIGNATURE`, :data:`~graphflop.meta.FORWARD_GRADIENT`,
    :data:`~graphflop.meta.UPDATE`)."""
    primal_outs = _outputs(jvp)[: info.primal_outputs]
    loss = next(
        env[o] for o in primal_outs if isinstance(o, Node) and o.meta.get(SOURCE) == sig.loss
    )
    # the running statistics a training-mode forward updates, as the train step outputs them
    updated = dict(sig.buffer_updates)
    buffers = [
        (env[o], updated[o.meta[SOURCE]])
        for o in primal_outs
        if isinstance(o, Node) and o.meta.get(SOURCE) in updated
    ]
    g.output(tuple([loss] + new_state + ds + [n for n, _ in buffers]))
    gm = graph_module(torch.nn.Module(), g)
    gm.meta[SIGNATURE] = sig
    gm.meta[FORWARD_GRADIENT] = ForwardGradientInfo(
        tuple([n.name for n in g.find_nodes(op="placeholder")]),  # (in graph order)
        tuple([q for _, q in sig.trainable()]),
        tuple(n for n in st.state_phs if n not in ("lr", "step")),
        len(ds),
        distribution,
        st.given is not None,
        how,
        tuple(q for _, q in buffers),
    )
    gm.meta[UPDATE] = upd.meta[UPDATE]
    return gm


def _records(jvp: GraphModule, upd: GraphModule, directions: int, direction_inputs: bool) -> bool:
    """Whether the step is built from recorded JVP ``jvp`` as it is (:func:`_recorded_step`):
    one sampled direction, a JVP whose calls keep their flat names (none made by a fold of
    transposed products, which names its nodes apart) and whose log has no custom Function's
    entry (its tangents read through the log), an update graph whose calls are runs of
    consecutive nodes. Else the step is built from the JVP's flat view."""
    dh: DerivedHierarchy = jvp.meta[DERIVED_HIERARCHY]
    if directions != 1 or direction_inputs or dh.names is None or dh.fold_names is not None:
        return False
    log = dh.log
    if type(log) is CallLog:  # its calls' runs not read entry by entry
        if log.holds(FunctionEntry):
            return False
    elif any(isinstance(e, FunctionEntry) for e in log or ()):
        return False
    udh = upd.meta.get(DERIVED_HIERARCHY)
    if udh is None:
        return True
    if is_recorded(upd):  # its calls as recorded, with their flat names
        return udh.names is not None
    if len(udh.runs) != len(udh.calls):
        return False
    pos = {n: i for i, n in enumerate(upd.graph.nodes)}
    return all(
        [pos[n] for n in run] == list(range(pos[run[0]], pos[run[0]] + len(run)))
        for run in udh.runs
        if run
    )


def _recorded_step(
    forward: GraphModule,
    sig: Signature,
    jvp: GraphModule,
    upd: GraphModule,
    fake_mode,
    distribution: str,
) -> GraphModule:
    """The one-direction step built from recorded JVP top level ``jvp`` without expanding it:
    the JVP's top level copied (its calls calling copies of its templates: a direction's
    tangent work through a block is the block's JVP template), the update graph's calls as
    calls, the directions and estimates made calls per block
    (:class:`~graphflop.passes.step_calls.StepRecorder`). The step returned is that top level
    (:func:`~graphflop.passes.calls.is_recorded`); its flat view is the step built from the
    flat JVP, node for node and name for name."""
    info: JvpInfo = jvp.meta[JVP]
    st = _Start(jvp, upd, info, fake_mode, 1, False)
    g, b = st.g, st.b
    rec = step_calls.StepRecorder(forward, upd)
    with b.context(role="direction"):
        v = _recorded_direction(b, info, st.phs, distribution, rec)
        env, d = _copy_top(g, jvp, info, st.env, v, rec)
        grads = _recorded_estimate(b, info, d, v, rec)
    qual = dict(sig.trainable())
    new_state = _copy_update(
        g,
        upd,
        {qual[p]: st.phs[p] for p in qual},
        {qual[p]: grads[p] for p in qual},
        st.state_phs,
        rec,
    )
    gm = _step_module(
        g, sig, jvp, upd, info, env, new_state, [d], st, distribution, "one tangent pass"
    )
    dh = rec.hierarchy(gm)
    if dh is not None:
        gm.meta[DERIVED_HIERARCHY] = dh
    return gm


def _recorded_direction(
    b: Builder,
    info: JvpInfo,
    phs: dict[str, Node],
    distribution: str,
    rec: step_calls.StepRecorder,
) -> dict[str, Node]:
    """:func:`_direction` of one sampled direction, each block's parameters' draws a call
    (:meth:`~graphflop.passes.step_calls.StepRecorder.per_parameter`: built once per block
    variant)."""
    tangent = {p: t for t, p in info.tangent_inputs}
    params = [(p, phs[p].meta["val"]) for _, p in info.tangent_inputs]
    made = rec.per_parameter(
        b.graph,
        params,
        ("direction", distribution),
        lambda p: _draw(b, phs, p, distribution),
        lambda _: [],
    )
    return {tangent[p]: n for p, n in made.items()}


def _recorded_estimate(
    b: Builder, info: JvpInfo, d: Node, v: dict[str, Node], rec: step_calls.StepRecorder
) -> dict[str, Node]:
    """:func:`_estimate` of one direction (``g = d·v`` per parameter placeholder name), each
    block's parameters' products a call, built once per block variant."""
    tangent = {p: t for t, p in info.tangent_inputs}
    params = [(p, v[t].meta["val"]) for t, p in info.tangent_inputs]
    return rec.per_parameter(
        b.graph,
        params,
        "estimate",
        lambda p: _estimate_of(b, p, [d], [v[tangent[p]]]),
        lambda group: [*(v[tangent[p]] for p in group), d],
    )


def _last(g: Graph) -> Node:
    return next(iter(reversed(g.nodes)))


def _copy_top(
    g: Graph,
    jvp: GraphModule,
    info: JvpInfo,
    env: dict[Node, Node],
    v: dict,
    rec: step_calls.StepRecorder,
) -> tuple[dict[Node, Any], Node]:
    """Copy recorded JVP top level ``jvp``'s nodes for direction ``v``: its nodes, and per call
    a call of (a copy of) its template with its getitems, the names of its nodes taken as the
    flat JVP's are by their copies. Returns each JVP node's copy and the loss tangent."""
    dh: DerivedHierarchy = jvp.meta[DERIVED_HIERARCHY]
    assert dh.names is not None, "checked by _records"
    call_op = torch.ops.graphflop.repeat.default
    local: dict[Node, Any] = dict(env)
    for n in jvp.graph.nodes:
        if n.op == "placeholder":
            if n.name in v:
                local[n] = v[n.name]
            continue
        if n.op == "output":
            continue
        if n.target is call_op:
            args, number = n.args
            c = dh.calls[number]
            local[n] = rec.call(
                g,
                dh.templates[c.template],
                c,
                [local[a] for a in args],
                dh.names[number],
            )
        elif n.target is operator.getitem and getattr(n.args[0], "target", None) is call_op:
            local[n] = rec.item(g, local[n.args[0]], n.args[1], dict(n.meta))
        else:
            local[n] = copy_node(g, n, local.__getitem__)
    return local, local[_outputs(jvp)[info.primal_outputs]]


def _copy_update(
    g: Graph,
    upd: GraphModule,
    params: dict,
    grads: dict,
    state: dict,
    rec: step_calls.StepRecorder,
) -> list[Node]:
    """:func:`~graphflop.passes.optimizer.inline_update` with the update graph's calls (its
    :data:`~graphflop.meta.DERIVED_HIERARCHY`'s runs) copied as calls of its templates; of a
    recorded update (``build_update(direct=True)``), its top level's calls."""
    dh: DerivedHierarchy | None = upd.meta.get(DERIVED_HIERARCHY)
    if dh is not None and dh.graph is upd:
        return _copy_recorded_update(g, upd, dh, params, grads, state, rec)
    starts = {run[0]: i for i, run in enumerate(dh.runs) if run} if dh is not None else {}
    env: dict[Node, Any] = {}
    out = None
    n = next(iter(upd.graph.nodes))
    while n.op != "root":
        if n.op == "placeholder":
            env[n] = _slot_value(n, params, grads, state)
        elif n.op == "output":
            out = n
        elif n in starts:  # a call: a run of consecutive nodes (checked by _records)
            assert dh is not None
            i = starts[n]
            run, c = dh.runs[i], dh.calls[i]
            inside = set(run)
            ext = step_calls._outside(run)
            rep = rec.call(
                g, dh.templates[c.template], c, [env[e] for e in ext], [x.name for x in run]
            )
            for k, x in enumerate(run):
                if not inside.issuperset(x.users):  # read outside the run
                    env[x] = rec.item(g, rep, k, dict(x.meta))
            n = run[-1]
        else:
            env[n] = copy_node(g, n, env.__getitem__)
        n = n.next
    assert out is not None, "an update graph ends in its output node"
    return [env[a] for a in out.args[0]]


def _slot_value(n: Node, params: dict, grads: dict, state: dict) -> Any:
    """What an update's placeholder ``n`` reads in the step: its parameter, its gradient or
    its optimizer state (by its :data:`~graphflop.meta.SLOT`)."""
    return _slot_of(n.meta, params, grads, state, n.name)


def _slot_of(meta: dict, params: dict, grads: dict, state: dict, name: str) -> Any:
    """:func:`_slot_value` of the update's placeholder ``name`` of annotations ``meta`` (a
    node's, or one a :data:`~graphflop.meta.PACKED` placeholder holds)."""
    slot = meta[SLOT]
    if slot == "param":
        return params[meta[PARAM]]
    if slot == "grad":
        return grads[meta[PARAM]]
    return state[name]


def _copy_recorded_update(
    g: Graph,
    upd: GraphModule,
    dh: DerivedHierarchy,
    params: dict,
    grads: dict,
    state: dict,
    rec: step_calls.StepRecorder,
) -> list[Node]:
    """:func:`_copy_update` of a recorded update's top level ``upd``: per call its
    ``graphflop::repeat`` node (the call's flat names taken as the flat update's copies take
    them) and getitems, annotated as the flat update's nodes the getitems stand for (a
    template node's annotations made the call's, and its cost)."""
    call_op = torch.ops.graphflop.repeat.default
    names = dh.names
    assert names is not None, "checked by _records"
    env: dict[Node, Any] = {}
    out = None
    bodies: dict[int, list[Node]] = {}  # per template, its nodes (costs read per getitem)
    costs: dict[tuple[int, int], Any] = {}  # per template and position, its node's cost
    for n in upd.graph.nodes:
        if n.op == "placeholder":
            packed = n.meta.get(PACKED)
            env[n] = (
                _slot_value(n, params, grads, state)
                if packed is None
                else [_slot_of(m, params, grads, state, x) for x, m in zip(*packed)]
            )
        elif n.op == "output":
            out = n
        elif n.target is call_op:
            args, number = n.args
            c = dh.calls[number]
            xs = [env[a] if type(a) is not tuple else env[a[0]][a[1]] for a in args]
            env[n] = rec.call(g, dh.templates[c.template], c, xs, names[number])
        elif n.target is operator.getitem and getattr(n.args[0], "target", None) is call_op:
            rep, i = n.args
            meta = dict(n.meta)
            key = (dh.calls[rep.args[1]].template, i)  # read once per template node
            cost = costs.get(key, costs)
            if cost is costs:
                cost = costs[key] = template_node(dh, n, bodies).meta.get(COST)
            if cost is not None:  # the flat node's cost, where the getitem's is none
                meta[COST] = cost
            env[n] = rec.item(g, env[rep], i, meta)
        else:
            env[n] = copy_node(g, n, env.__getitem__)
    assert out is not None, "an update graph ends in its output node"
    return [env[a] for a in out.args[0]]


class _Start:
    """The step graph's beginning: the JVP graph's primal placeholders (``env``, ``phs``), the
    optimizer-state placeholders and, with ``direction_inputs``, the direction placeholders."""

    def __init__(
        self,
        jvp: GraphModule,
        upd: GraphModule,
        info: JvpInfo,
        fake_mode,
        directions: int,
        direction_inputs: bool,
    ) -> None:
        self.g = g = Graph()
        self.fake_mode = fake_mode
        self.b = _StepBuilder(g, fake_mode, [])
        tangent_of = {t for t, _ in info.tangent_inputs}
        self.env: dict[Node, Node] = {}
        # (the row found once, not per placeholder)
        row = find_row(g, "placeholder", None) if makes_nodes(g) else None
        for n in jvp.graph.find_nodes(op="placeholder"):  # in graph order
            if n.name in tangent_of:
                continue
            if n.args or n.kwargs:
                self.env[n] = copy_node(g, n)
                continue
            # copy_node of a placeholder without arguments: nothing to map, its row once
            new = new_node(g, "placeholder", n.target, n.name, (), NO_KWARGS, n.type, row=row)
            new.meta.update(n.meta)
            self.env[n] = new
        self.phs = {n.name: c for n, c in self.env.items()}
        self.state_phs: dict[str, Node] = {}  # by the update's names
        for n in upd.graph.find_nodes(op="placeholder"):
            packed = n.meta.get(PACKED)
            if packed is None:
                if n.meta[SLOT] not in ("param", "grad"):
                    self.state_phs[n.name] = copy_node(g, n)
            elif packed[1][0][SLOT] not in ("param", "grad"):  # a recorded update's state
                self.state_phs.update(zip(packed[0], unpack(g, n)))
        self.given = (
            _direction_placeholders(g, info, self.phs, directions) if direction_inputs else None
        )


def _first_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def _batched_pass(
    st: _Start, jvp: GraphModule, info: JvpInfo, distribution: str, k: int
) -> tuple[list[Node], list[dict], str]:
    """The ``K`` directions as one tensor per parameter with a leading ``K`` dimension, pushed
    through the JVP graph's tangent nodes once (:class:`_Batcher`); returns the ``K`` loss
    tangents, the ``K`` directions (views of the batched ones) and how the pass was built."""
    b = st.b
    stacked: dict[str, Node] = {}
    with b.context(role="direction"):
        for t, p in info.tangent_inputs:
            if st.given is not None:
                with _of_parameter(b, st.phs, p):
                    stacked[t] = b.call(aten.stack.default, [st.given[(i, p)] for i in range(k)])
            else:
                stacked[t] = _draw(b, st.phs, p, distribution, leading=(k,))
    batcher = _Batcher(st.g, st.fake_mode, k)
    d = batcher.run(jvp, info, st.env, stacked)
    with b.context(role="direction"):
        ds = (
            [b.call(aten.select.int, d, 0, i) for i in range(k)]
            if d in batcher.batched
            else [d] * k
        )
        vs = [
            {
                t: st.given[(i, p)] if st.given is not None else b.call(aten.select.int, v, 0, i)
                for (t, p), v in zip(info.tangent_inputs, stacked.values())
            }
            for i in range(k)
        ]
    copied = sorted(batcher.copied)
    how = "one batched tangent pass" + (f"; K copies of {', '.join(copied)}" if copied else "")
    return ds, vs, how


class _Batcher:
    """Copies a JVP graph's nodes into ``g`` with the tangents carrying a leading ``K``
    dimension: primal and coefficient nodes once, each tangent node with a batched argument
    replaced by the graph ``make_fx`` records for ``torch.func.vmap`` of its op (PyTorch's
    batching rules; e.g. ``mm`` of a batched left factor becomes ``view, mm, view``), in
    graphflop's decomposition table. An op vmap cannot batch, or whose batched form uses an
    op without a graphflop rule, is traced as ``K`` copies on ``select``-ed slices and
    ``stack``-ed (listed in ``copied``). Traces are cached by op, constants and argument
    shapes (a transformer's blocks repeat the same calls)."""

    def __init__(self, g: Graph, fake_mode, k: int) -> None:
        from graphflop.ops import decomposition_table

        self.g, self.fake_mode, self.k = g, fake_mode, k
        self.table = decomposition_table()
        self.batched: set[Node] = set()
        self.copied: set[str] = set()
        self.cache: dict[Any, Graph] = {}

    def run(
        self, jvp: GraphModule, info: JvpInfo, env: dict[Node, Node], stacked: dict[str, Node]
    ) -> Node:
        """Copy ``jvp``'s nodes (primal ones into ``env``, shared); returns the loss tangent."""
        local: dict[Node, Any] = dict(env)
        for n in jvp.graph.nodes:
            if n.op == "placeholder":
                if n.name in stacked:
                    local[n] = stacked[n.name]
                    self.batched.add(stacked[n.name])
                continue
            if n.op == "output":
                continue
            if n.meta.get(KIND) != "tangent":
                local[n] = env[n] = copy_node(self.g, n, local.__getitem__)
                continue
            local[n] = self._node(n, local)
        out = local[_outputs(jvp)[info.primal_outputs]]
        if not isinstance(out, Node):
            raise ValueError("the loss tangent is not one node")
        return out

    def _node(self, n: Node, local: dict[Node, Any]) -> Any:
        src = n.args[0]
        if n.target is operator.getitem and isinstance(src, Node) and isinstance(local[src], tuple):
            return local[src][n.args[1]]
        leaves, spec = tree_flatten((n.args, n.kwargs))
        pos = [i for i, a in enumerate(leaves) if isinstance(a, Node)]
        ins = [local[leaves[i]] for i in pos]
        if not any(isinstance(x, Node) and x in self.batched for x in ins):
            return copy_node(self.g, n, local.__getitem__)
        if n.op != "call_function" or not all(isinstance(x, Node) for x in ins):
            raise ValueError(f"cannot batch node {n.name} ({n.op} {n.target})")
        dims = tuple(0 if x in self.batched else None for x in ins)
        key = (
            n.target,
            str(spec),
            repr([a for i, a in enumerate(leaves) if i not in pos]),
            tuple(
                (tuple(v.shape), v.dtype, tuple(v.stride()), d)
                for v, d in zip((x.meta["val"] for x in ins), dims)
            ),
        )
        if key not in self.cache:
            self.cache[key] = self._trace(n, leaves, spec, pos, ins, dims)
        return self._inline(self.cache[key], n, ins)

    def _trace(self, n: Node, leaves, spec, pos, ins, dims) -> Graph:
        target = n.target
        assert callable(target), n.format_node()  # _node batches call_function nodes only

        def f(*ts):
            ls = list(leaves)
            for i, t in zip(pos, ts):
                ls[i] = t
            args, kwargs = tree_unflatten(ls, spec)
            return target(*args, **kwargs)

        def copies(*ts):
            outs = [
                f(*(t.select(0, i) if d == 0 else t for t, d in zip(ts, dims)))
                for i in range(self.k)
            ]
            return tree_map(lambda *xs: torch.stack(xs), *outs)

        # a tensor of its own per argument: nodes of equal metadata share one FakeTensor
        # (builder.fake_output's cache), and make_fx, which tracks tensors by identity,
        # would read both arguments of add(a, b) from one placeholder
        vals = [
            fresh_fake(self.fake_mode, v.shape, v.stride(), v.dtype, v.device)
            for v in (x.meta["val"] for x in ins)
        ]
        # the trace's own warnings are not the model's
        with self.fake_mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with _vmap_fallback_refused():
                    gm: GraphModule | None = make_fx(
                        torch.func.vmap(f, in_dims=dims), decomposition_table=self.table
                    )(*vals)
            except RuntimeError as e:
                if _VMAP_FALLBACK not in str(e):
                    raise
                gm = None  # an op without a batching rule (vmap's slow per-slice loop)
            if gm is None or not _traceable(gm.graph):
                self.copied.add(str(n.target))
                gm = make_fx(copies, decomposition_table=self.table)(*vals)
        gm.graph.eliminate_dead_code()
        if not _traceable(gm.graph):
            raise ValueError(f"{n.target} traced to ops without rules")
        return gm.graph

    def _inline(self, sub: Graph, n: Node, ins: list[Node]) -> Any:
        """Copy ``sub``'s nodes into the step graph on ``ins``, with ``n``'s annotations."""
        m: dict[Node, Node] = {}
        phs = [s for s in sub.nodes if s.op == "placeholder"]
        m.update(zip(phs, ins))
        ann = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}
        out: Any = None
        for s in sub.nodes:
            if s.op == "output":
                out = tree_map(lambda a: m[a] if isinstance(a, Node) else a, s.args[0])
            elif s.op != "placeholder":
                c = copy_node(self.g, s, m.__getitem__)
                c.meta = {**ann, "val": s.meta["val"]}
                m[s] = c
        outs = tree_flatten(out)[0]
        self.batched.update(o for o in outs if isinstance(o, Node))
        return tuple(out) if isinstance(out, list) else out


#: functorch's error for an op without a batching rule while its fallback is off
#: (``BatchedFallback.cpp``'s ``warnFallback``, PyTorch 2.13)
_VMAP_FALLBACK = "hit the vmap fallback which is currently disabled"


@contextmanager
def _vmap_fallback_refused() -> Iterator[None]:
    """functorch's fallback for an op without a batching rule (a loop over the batch) off
    within: such an op raises ``RuntimeError`` (:data:`_VMAP_FALLBACK`) instead of running the
    loop. Detecting it by the fallback's warning did not work: a ``torch.ops`` call has no
    Python warning handler in PyTorch 2.13, so that C++ ``TORCH_WARN`` went straight to file
    descriptor 2 (a raw ``[W... BatchedFallback.cpp:82] Warning: There is a performance drop
    ...`` line on stderr) and never reached ``warnings``."""
    # private functorch switches, absent from torch's stubs
    functorch: Any = torch._C._functorch
    was = functorch._is_vmap_fallback_enabled()
    functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        functorch._set_vmap_fallback_enabled(was)


def _traceable(graph: Graph) -> bool:
    """Every node is a placeholder, the output, or a call of an op with a graphflop rule."""
    from graphflop.ops import has_rule

    return all(
        s.op in ("placeholder", "output") or (s.op == "call_function" and has_rule(s.target))
        for s in graph.nodes
    )


def _check(
    forward: GraphModule,
    optimizer: str | OptimizerConfig,
    directions: int,
    distribution: str,
    update: GraphModule | None,
) -> Signature:
    if directions < 1:
        raise ValueError(f"directions must be at least 1, got {directions}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}; one of {DISTRIBUTIONS}")
    sig: Signature = forward.meta[SIGNATURE]
    if sig.loss is None:
        raise ValueError("the forward graph has no loss")
    name = optimizer.name if isinstance(optimizer, OptimizerConfig) else optimizer
    if update is not None and update.meta[UPDATE].optimizer != name:
        raise ValueError(f"the update graph is {update.meta[UPDATE].optimizer}'s, not {name}'s")
    return sig


def _outputs(gm: GraphModule) -> list[Any]:
    """The values ``gm`` outputs, in order (nodes, or constants)."""
    return list(next(n for n in gm.graph.nodes if n.op == "output").args[0])


def _direction_placeholders(
    g: Graph, info: JvpInfo, phs: dict[str, Node], directions: int
) -> dict[tuple[int, str], Node]:
    """Placeholders ``v{k}_<param>`` for the directions, when they are inputs."""
    out: dict[tuple[int, str], Node] = {}
    for k in range(directions):
        for _, p in info.tangent_inputs:
            ph = g.placeholder(f"v{k}_{p}")
            ph.meta.update(
                {
                    "val": phs[p].meta["val"],
                    KIND: "direction",
                    ROLE: "direction",
                    SOURCE: p,
                    MODULE: "",
                }
            )
            out[(k, p)] = ph
    return out


def _direction(
    b: Builder,
    info: JvpInfo,
    phs: dict[str, Node],
    k: int,
    given: dict[tuple[int, str], Node] | None,
    distribution: str,
) -> dict[str, Node]:
    """Direction ``k``: tangent placeholder name → the node holding its value (given or
    sampled)."""
    return {
        t: given[(k, p)] if given is not None else _draw(b, phs, p, distribution)
        for t, p in info.tangent_inputs
    }


def _of_parameter(b: Builder, phs: dict[str, Node], p: str) -> AbstractContextManager[RuleContext]:
    """The builder's context for the direction nodes of parameter placeholder ``p``: its
    source and its module."""
    return b.context(source=p, module=phs[p].meta.get(MODULE, ""))


def _draw(
    b: Builder, phs: dict[str, Node], p: str, distribution: str, leading: tuple[int, ...] = ()
) -> Node:
    """A direction sampled for parameter placeholder ``p`` (shape ``leading`` + its shape, its
    dtype and device): ``randn``, and for ``rademacher`` its sign."""
    val = phs[p].meta["val"]
    with _of_parameter(b, phs, p):
        r = b.call(aten.randn.default, [*leading, *val.shape], dtype=val.dtype, device=val.device)
        return b.call(aten.sign.default, r) if distribution == "rademacher" else r


def _copy_tangents(
    g: Graph,
    jvp: GraphModule,
    info: JvpInfo,
    env: dict[Node, Node],
    v: dict,
    *,
    first: bool,
    copies: dict[Node, Node] | None = None,
) -> Node:
    """Copy the JVP graph's nodes for one direction ``v``; returns the loss tangent ``d``.

    Primal and coefficient nodes are copied with the first direction (into ``env``) and shared
    by the others: only tangent work repeats. ``copies``, where given, receives each JVP node's
    copy.
    """
    local = dict(env)
    local.update({n: v[n.name] for n in jvp.graph.nodes if n.name in v})
    for n in jvp.graph.nodes:
        if n.op in ("placeholder", "output") or (not first and n in env):
            continue
        if not first and n.meta.get(KIND) != "tangent":
            local[n] = env[n]
            continue
        local[n] = copy_node(g, n, local.__getitem__)
        if first and n.meta.get(KIND) != "tangent":
            env[n] = local[n]
    if copies is not None:
        copies.update(local)
    return local[_outputs(jvp)[info.primal_outputs]]


def _estimate(b: Builder, info: JvpInfo, ds: list[Node], vs: list[dict]) -> dict[str, Node]:
    """``g = (1/K) Σ_k d_k · v_k`` per parameter placeholder name."""
    return {p: _estimate_of(b, p, ds, [v[t] for v in vs]) for t, p in info.tangent_inputs}


def _estimate_of(b: Builder, p: str, ds: list[Node], vs: list[Node]) -> Node:
    """Parameter placeholder ``p``'s estimate ``(1/K) Σ_k d_k · v_k`` from the ``K`` loss
    tangents ``ds`` and ``p``'s ``K`` direction tensors ``vs``."""
    with b.context(role="direction", source=p):
        acc: Node | None = None
        for d, v in zip(ds, vs):
            term = b.call(aten.mul.Tensor, v, d)
            acc = term if acc is None else b.call(aten.add.Tensor, acc, term)
        if len(ds) > 1:
            acc = b.call(aten.div.Tensor, acc, float(len(ds)))
    assert acc is not None, "at least one direction"
    return acc


class BuildForwardGradientStep(GraphPass):
    """Forward graph → its forward-gradient step graph (:func:`build_forward_gradient_step`;
    the constructor takes that function's options).

    Requires ``traced``; provides ``forward_gradient``. Raises ``ValueError`` (see the
    function).
    """

    #: runs on the flat forward graph (the step is built per template only from a recorded
    #: JVP handed to it, see the module docstring)
    scope = FLAT
    name = "build_forward_gradient_step"
    required = ("traced",)
    provided = ("forward_gradient",)

    def __init__(
        self,
        optimizer: str | OptimizerConfig = "sgd",
        *,
        directions: int = 1,
        distribution: str = "normal",
        direction_inputs: bool = False,
        jvp: GraphModule | None = None,
        update: GraphModule | None = None,
        batched: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.directions = directions
        self.distribution = distribution
        self.direction_inputs = direction_inputs
        self.jvp = jvp
        self.update = update
        self.batched = batched

    def call(self, graph_module: GraphModule) -> PassResult:
        gm = build_forward_gradient_step(
            graph_module,
            self.optimizer,
            directions=self.directions,
            distribution=self.distribution,
            direction_inputs=self.direction_inputs,
            jvp=self.jvp,
            update=self.update,
            batched=self.batched,
        )
        return PassResult(gm, True)
