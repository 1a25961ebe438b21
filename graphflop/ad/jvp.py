"""Forward mode: the JVP graph, built explicitly from the rule table.

``build_jvp(forward)`` returns a graph computing the forward's primal outputs and the tangents of
its loss (and, optionally, model outputs) given tangents for the parameters and/or the inputs.
Primal and tangent nodes are interleaved in forward order, so no residual is kept. Every tangent
node is linear in the tangent inputs (rules put the nonlinear part into ``coef`` nodes), which
is what lets :mod:`graphflop.ad.vjp` transpose it.

Symbolic zeros: a tangent known to be zero is ``None`` and no work is emitted for it. A tangent
that is zero only because the value was not chosen to carry one (the model input under weight
perturbation) is a ghost: the work it would have caused is recorded in ``gm.meta[GHOSTS]``.

Reads ``val``, graphflop keys (:mod:`graphflop.meta`) written by :mod:`graphflop.frontend.trace`, the rule table. Writes
``KIND``, ``ROLE`` (``tangent_from_input``/``tangent_from_param``), ``SOURCE``,
``MODULE``, ``PARAM_DERIVED`` on new nodes; ``gm.meta[GHOSTS]``,
``gm.meta[SIGNATURE]``, ``gm.meta[JVP]`` (:class:`JvpInfo`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from graphflop.ad.builder import Builder, GhostValue, is_ghost
from graphflop.meta import (
    GHOST_LINKS,
    GHOSTS,
    JVP,
    JVP_LOG,
    KIND,
    LOSS_KIND,
    MODULE,
    PARAM,
    PARAM_DERIVED,
    ROLE,
    SIGNATURE,
    SOURCE,
    JvpInfo,
    Signature,
    fake_mode_of,
    graph_module,
)
from graphflop.ops import lookup

TANGENT_CHOICES = ("params", "inputs", "all")


class JvpBuilder(Builder):
    active_kind = "tangent"

    def role_for(self, kind, args_flat):
        if kind != "tangent":
            return "tangent_from_param" if self.param_derived else "tangent_from_input"
        lin = [
            a
            for a in args_flat
            if (isinstance(a, Node) and a.meta.get(KIND) == "tangent") or is_ghost(a)
        ]
        if lin and all(a.meta.get(PARAM_DERIVED, False) for a in lin):
            return "tangent_from_param"
        return "tangent_from_input"


def _is_float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _needed(graph: Graph, outputs: list[Node]) -> set[Node]:
    seen, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def build_jvp(
    forward: GraphModule,
    tangents: str = "params",
    *,
    wrt_outputs: str = "loss",
) -> GraphModule:
    """Build the JVP graph of a traced forward graph.

    Args:
        forward: a graph from :func:`graphflop.frontend.trace.trace`.
        tangents: which placeholders carry tangents: ``params`` (weight perturbation, the
            forward gradient of Baydin et al. 2022), ``inputs`` or ``all``.
        wrt_outputs: ``loss`` (the tangent of the scalar loss: the directional derivative) or
            ``outputs`` (tangents of the model's outputs too).

    Returns:
        A GraphModule taking the forward's placeholders followed by one tangent per selected
        placeholder (same shape), returning the forward's outputs followed by the tangents.

    Raises:
        MissingRuleError: for an op on the differentiated path with no JVP rule.
        ValueError: for an unknown ``tangents`` choice.
    """
    if tangents not in TANGENT_CHOICES:
        raise ValueError(f"unknown tangents choice {tangents!r}; one of {TANGENT_CHOICES}")
    sig: Signature = forward.meta[SIGNATURE]
    fgraph = forward.graph
    nodes = {n.name: n for n in fgraph.nodes}
    diff_names = [sig.loss] if sig.loss else []
    if wrt_outputs == "outputs" or not diff_names:
        diff_names += [o for o in sig.outputs if o not in diff_names]
    diff_out = [nodes[n] for n in diff_names if _is_float(nodes[n].meta.get("val"))]
    needed = _needed(fgraph, diff_out)

    params = {p for p, _ in sig.params}
    inputs = set(sig.inputs)
    carry = params if tangents == "params" else inputs if tangents == "inputs" else params | inputs
    ghostly = (params | inputs) - carry

    g = Graph()
    env: dict[Node, Node] = {}
    tan: dict[Node, Any] = {}
    ghosts: list = []
    fake_mode = fake_mode_of([n.meta.get("val") for n in fgraph.nodes if "val" in n.meta])
    b = JvpBuilder(g, fake_mode, ghosts)

    placeholders = [n for n in fgraph.nodes if n.op == "placeholder"]
    for n in placeholders:
        env[n] = g.node_copy(n, lambda x: env[x])
    tangent_inputs = []
    for n in placeholders:
        if n.name in carry and _is_float(n.meta["val"]):
            t = g.placeholder(f"t_{n.name}")
            t.meta.update(
                {
                    "val": n.meta["val"],
                    KIND: "tangent",
                    SOURCE: n.name,
                    MODULE: "",
                    PARAM_DERIVED: n.name in params,
                    ROLE: "tangent_from_param" if n.name in params else "tangent_from_input",
                }
            )
            if PARAM in n.meta:
                t.meta[PARAM] = n.meta[PARAM]
            tan[n] = t
            tangent_inputs.append((t.name, n.name))
        elif n.name in ghostly and _is_float(n.meta["val"]):
            tan[n] = GhostValue(n.meta["val"], param_derived=n.name in params)

    out_node = None
    for n in fgraph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            out_node = n
            continue
        if n not in env:
            env[n] = g.node_copy(n, lambda x: env[x])
        new = env[n]
        for u in n.users:  # copy getitems at once, so rules can read every output
            if u.target is operator.getitem and u not in env:
                env[u] = g.node_copy(u, lambda x: env[x])
        if n not in needed:
            continue
        if n.target is operator.getitem:
            parent = tan.get(n.args[0])
            if isinstance(parent, (tuple, list)):
                t = parent[n.args[1]]
                if t is not None and _is_float(n.meta.get("val")):
                    tan[n] = t
            continue
        arg_t = [_tangent_of(a, tan) for a in n.args]
        flat_t = [t for t in _flatten(arg_t) if t is not None]
        if not flat_t:
            continue
        rule = lookup(n.target, need=("jvp",), node=n.name)
        if rule.zero_derivative:
            continue
        b.source, b.module = n.name, n.meta.get(MODULE, "")
        b.param_derived = n.meta.get(PARAM_DERIVED, False)
        b.force_ghost = all(is_ghost(t) for t in flat_t)
        args = tuple(_map(a, env) for a in n.args)
        kwargs = {k: _map(v, env) for k, v in n.kwargs.items()}
        try:
            t = rule.jvp(b, new, args, arg_t, kwargs)
        finally:
            b.force_ghost = False
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            t = None
        if t is not None:
            tan[n] = t

    outs = list(out_node.args[0])
    primal_outs = [env[o] if isinstance(o, Node) else o for o in outs]
    tangent_outs = []
    for d in diff_out:
        t = tan.get(d)
        if t is None or is_ghost(t):
            b.source, b.module, b.force_ghost = d.name, d.meta.get(MODULE, ""), False
            t = b.zeros_like(env[d])
        tangent_outs.append(t)
    g.output(tuple(primal_outs + tangent_outs))
    gm = graph_module(forward, g)
    gm.meta[SIGNATURE] = sig
    gm.meta[GHOSTS] = ghosts
    gm.meta[JVP] = JvpInfo(tuple(tangent_inputs), len(primal_outs), tuple(d.name for d in diff_out))
    gm.meta[JVP_LOG] = b.log
    gm.meta[GHOST_LINKS] = b.ghost_links
    gm.meta[LOSS_KIND] = forward.meta.get(LOSS_KIND)
    return gm


def _tangent_of(a: Any, tan: dict) -> Any:
    if isinstance(a, Node):
        return tan.get(a)
    if isinstance(a, (list, tuple)):
        ts = [_tangent_of(x, tan) for x in a]
        return ts if any(t is not None for t in ts) else None
    return None


def _flatten(ts):
    for t in ts:
        if isinstance(t, list):
            yield from _flatten(t)
        else:
            yield t


def _map(a: Any, env: dict) -> Any:
    if isinstance(a, Node):
        return env[a]
    if isinstance(a, (list, tuple)):
        return type(a)(_map(x, env) for x in a)
    return a
