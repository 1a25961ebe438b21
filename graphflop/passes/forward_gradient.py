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
from torch.fx.passes.infra.pass_base import PassResult

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
    JvpInfo,
    Signature,
    graph_fake_mode,
    graph_module,
)
from graphflop.passes.infra import GraphPass
from graphflop.passes.optimizer import SLOT, OptimizerConfig, build_update_for, inline_update

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
    update: GraphModule | None = None,
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
        update: ``build_update_for(forward, optimizer)`` when already built; built here
            otherwise.

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
    info: JvpInfo = jvp.meta[JVP]
    g = Graph()
    b = _StepBuilder(g, fake_mode, [])
    tangent_of = {t: p for t, p in info.tangent_inputs}
    env = {
        n: g.node_copy(n)
        for n in jvp.graph.nodes
        if n.op == "placeholder" and n.name not in tangent_of
    }
    phs = {n.name: c for n, c in env.items()}
    state_phs = {
        n.name: g.node_copy(n)
        for n in upd.graph.nodes
        if n.op == "placeholder" and n.meta[SLOT] not in ("param", "grad")
    }
    given = _direction_placeholders(g, info, phs, directions) if direction_inputs else None
    ds, vs = [], []
    with b.context(role="direction"):
        for k in range(directions):
            v = _direction(b, info, phs, k, given, distribution)
            ds.append(_copy_tangents(g, jvp, info, env, v, first=k == 0))
            vs.append(v)
        grads = _estimate(b, info, ds, vs)
    qual = dict(sig.trainable())
    new_state = inline_update(
        g, upd, {qual[p]: phs[p] for p in qual}, {qual[p]: grads[p] for p in qual}, state_phs
    )
    primal_outs = _output(jvp).args[0][: info.primal_outputs]
    loss = next(
        env[o] for o in primal_outs if isinstance(o, Node) and o.meta.get(SOURCE) == sig.loss
    )
    g.output(tuple([loss] + new_state + ds))
    gm = graph_module(torch.nn.Module(), g)
    gm.meta[SIGNATURE] = sig
    gm.meta[FORWARD_GRADIENT] = ForwardGradientInfo(
        tuple(n.name for n in g.nodes if n.op == "placeholder"),
        tuple(q for _, q in sig.trainable()),
        tuple(n for n in state_phs if n not in ("lr", "step")),
        directions,
        distribution,
        direction_inputs,
    )
    gm.meta[UPDATE] = upd.meta[UPDATE]
    return gm


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


def _output(gm: GraphModule) -> Node:
    return next(n for n in gm.graph.nodes if n.op == "output")


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
    v = {}
    for t, p in info.tangent_inputs:
        if given is not None:
            v[t] = given[(k, p)]
            continue
        val = phs[p].meta["val"]
        with b.context(source=p, module=phs[p].meta.get(MODULE, "")):
            r = b.call(aten.randn.default, list(val.shape), dtype=val.dtype, device=val.device)
            v[t] = b.call(aten.sign.default, r) if distribution == "rademacher" else r
    return v


def _copy_tangents(
    g: Graph, jvp: GraphModule, info: JvpInfo, env: dict[Node, Node], v: dict, *, first: bool
) -> Node:
    """Copy the JVP graph's nodes for one direction ``v``; returns the loss tangent ``d``.

    Primal and coefficient nodes are copied with the first direction (into ``env``) and shared
    by the others: only tangent work repeats.
    """
    local = dict(env)
    local.update({n: v[n.name] for n in jvp.graph.nodes if n.name in v})
    for n in jvp.graph.nodes:
        if n.op in ("placeholder", "output") or (not first and n in env):
            continue
        if not first and n.meta.get(KIND) != "tangent":
            local[n] = env[n]
            continue
        local[n] = g.node_copy(n, local.__getitem__)
        if first and n.meta.get(KIND) != "tangent":
            env[n] = local[n]
    return local[_output(jvp).args[0][info.primal_outputs]]


def _estimate(b: Builder, info: JvpInfo, ds: list[Node], vs: list[dict]) -> dict[str, Node]:
    """``g = (1/K) Σ_k d_k · v_k`` per parameter placeholder name."""
    grads = {}
    for t, p in info.tangent_inputs:
        with b.context(role="direction", source=p):
            acc = None
            for d, v in zip(ds, vs):
                term = b.call(aten.mul.Tensor, v[t], d)
                acc = term if acc is None else b.call(aten.add.Tensor, acc, term)
            if len(ds) > 1:
                acc = b.call(aten.div.Tensor, acc, float(len(ds)))
        grads[p] = acc
    return grads


class BuildForwardGradientStep(GraphPass):
    """Forward graph → its forward-gradient step graph (:func:`build_forward_gradient_step`;
    the constructor takes that function's options).

    Requires ``traced``; provides ``forward_gradient``. Raises ``ValueError`` (see the
    function).
    """

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
    ) -> None:
        self.optimizer = optimizer
        self.options = {
            "directions": directions,
            "distribution": distribution,
            "direction_inputs": direction_inputs,
            "jvp": jvp,
            "update": update,
        }

    def call(self, graph_module: GraphModule) -> PassResult:
        gm = build_forward_gradient_step(graph_module, self.optimizer, **self.options)
        return PassResult(gm, True)
