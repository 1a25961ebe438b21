"""The forward-gradient step (Baydin et al. 2022, "Gradients without Backpropagation",
arXiv 2202.08587) as one explicit graph.

For each of ``K`` directions: sample ``v`` with one entry per parameter element (Gaussian, or
Rademacher ±1), run the JVP with ``v`` as the parameter tangents to get the scalar directional
derivative ``d = ∇L·v``; the gradient estimate is ``g = (1/K) Σ d·v``, an unbiased estimate of
``∇L`` for directions with identity covariance. The optimizer update is then applied to ``g``.
Primal (and coefficient) nodes are shared by the ``K`` directions: only tangent work repeats.

Outputs, in order: the loss, the new parameters, the new optimizer state, then the ``K``
directional derivatives. Writes ``ROLE="direction"`` on the sampling and ``g = d·v`` nodes and
``gm.meta[FORWARD_GRADIENT]`` (:class:`ForwardGradientInfo`).
"""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from graphflop.ad.builder import Builder
from graphflop.ad.jvp import build_jvp
from graphflop.meta import (
    FORWARD_GRADIENT,
    JVP,
    KIND,
    MODULE,
    ROLE,
    SIGNATURE,
    SOURCE,
    UPDATE,
    ForwardGradientInfo,
    Signature,
    fake_mode_of,
    graph_module,
)
from graphflop.passes.optimizer import SLOT, OptimizerConfig, build_update, inline_update

aten = torch.ops.aten
DISTRIBUTIONS = ("normal", "rademacher")


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
        jvp: ``build_jvp(forward, "params")`` when already built; built here otherwise.

    Raises:
        ValueError: bad ``directions`` or ``distribution``, or a forward graph without a loss.
    """
    if directions < 1:
        raise ValueError(f"directions must be at least 1, got {directions}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}; one of {DISTRIBUTIONS}")
    sig: Signature = forward.meta[SIGNATURE]
    if sig.loss is None:
        raise ValueError("the forward graph has no loss")
    if jvp is None:
        jvp = build_jvp(forward, "params")
    info = jvp.meta[JVP]
    g = Graph()
    fake_mode = fake_mode_of([n.meta["val"] for n in forward.graph.nodes if "val" in n.meta])
    b = _StepBuilder(g, fake_mode, [])
    b.role = "direction"

    jvp_nodes = list(jvp.graph.nodes)
    tangent_of = {t: p for t, p in info.tangent_inputs}
    env: dict[Node, Node] = {}
    for n in jvp_nodes:
        if n.op == "placeholder" and n.name not in tangent_of:
            env[n] = g.node_copy(n)
    phs = {n.name: env[n] for n in jvp_nodes if n in env}
    upd = build_update(
        [(q, phs[p].meta["val"]) for p, q in sig.params], optimizer, fake_mode=fake_mode
    )
    state_phs = {}
    for n in upd.graph.nodes:
        if n.op == "placeholder" and n.meta[SLOT] not in ("param", "grad"):
            state_phs[n.name] = g.node_copy(n)
    dir_inputs: dict[tuple[int, str], Node] = {}
    if direction_inputs:
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
                dir_inputs[(k, p)] = ph

    out_node = next(n for n in jvp_nodes if n.op == "output")
    loss_t_pos = info.primal_outputs
    primal_outs = out_node.args[0][: info.primal_outputs]
    ds, vs = [], []
    for k in range(directions):
        v = {}
        for t, p in info.tangent_inputs:
            b.source, b.module = p, phs[p].meta.get(MODULE, "")
            if direction_inputs:
                v[t] = dir_inputs[(k, p)]
            else:
                val = phs[p].meta["val"]
                r = b.call(aten.randn.default, list(val.shape), dtype=val.dtype, device=val.device)
                v[t] = b.call(aten.sign.default, r) if distribution == "rademacher" else r
        local = dict(env)
        local.update({n: v[n.name] for n in jvp_nodes if n.name in v})
        for n in jvp_nodes:
            if n.op in ("placeholder", "output") or (k > 0 and n in env):
                continue
            if k > 0 and n.meta.get(KIND) != "tangent":
                local[n] = env[n]  # primal and coefficient nodes are shared by all directions
                continue
            local[n] = g.node_copy(n, local.__getitem__)
            if k == 0 and n.meta.get(KIND) != "tangent":
                env[n] = local[n]
        ds.append(local[out_node.args[0][loss_t_pos]])
        vs.append(v)
    # g = (1/K) Σ_k d_k · v_k
    b.role = "direction"
    grads = {}
    for t, p in info.tangent_inputs:
        b.source = p
        acc = None
        for d, v in zip(ds, vs):
            term = b.call(aten.mul.Tensor, v[t], d)
            acc = term if acc is None else b.call(aten.add.Tensor, acc, term)
        if directions > 1:
            acc = b.call(aten.div.Tensor, acc, float(directions))
        grads[p] = acc
    # the update, inlined with the estimate as the gradient
    qual = dict(sig.params)
    new_state = inline_update(
        g, upd, {qual[p]: phs[p] for p in qual}, {qual[p]: grads[p] for p in qual}, state_phs
    )
    loss = next(
        env[o] for o in primal_outs if isinstance(o, Node) and o.meta.get(SOURCE) == sig.loss
    )
    g.output(tuple([loss] + new_state + ds))
    gm = graph_module(torch.nn.Module(), g)
    gm.meta[SIGNATURE] = sig
    gm.meta[FORWARD_GRADIENT] = ForwardGradientInfo(
        tuple(n.name for n in g.nodes if n.op == "placeholder"),
        tuple(q for _, q in sig.params),
        tuple(n for n in state_phs if n not in ("lr", "step")),
        directions,
        distribution,
        direction_inputs,
    )
    gm.meta[UPDATE] = upd.meta[UPDATE]
    return gm
