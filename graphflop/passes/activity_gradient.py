"""The activity-perturbed forward-gradient step (Ren, Kornblith, Liao, Hinton 2023, "Scaling
forward gradient with local losses", ICLR 2023) as one explicit graph, beside the
weight-perturbed step of :mod:`graphflop.passes.forward_gradient`.

Tangents go on the *outputs* ``z_l`` of the layers (``aten.addmm``/``aten.mm`` of an
``nn.Linear``, ``aten.convolution`` of an ``nn.Conv2d``) instead of the parameters: the forward
graph is rewritten with a zero perturbation ``a_l`` added to each ``z_l`` and the per-example
terms of the loss as the differentiated output, and :func:`graphflop.ad.jvp.build_jvp` (the rule
table) builds the forward-mode pass with tangents ``u_l`` (one Gaussian per element of ``z_l``)
on the ``a_l``. For each example ``b`` the pass gives ``d_b = Σ_l ∇_{z_{l,b}}L · u_{l,b}``; the
activity-gradient estimate is ``ĝ_{z_l} = (1/K) Σ_k d_{k,b} u_{k,l,b}`` and each layer's
parameter gradient is formed locally from it by its own chain rule: Linear ``g_W = ĝᵀ·x``
(one weight-gradient ``mm``), ``g_b = Σ_b ĝ``; Conv2d the weight-gradient convolution of ``x``
with ``ĝ`` (groups 1). The optimizer update is then applied as in the weight-perturbed step.
This is what :class:`graphflop.train.activity.ActivityPerturbation` computes in PyTorch.

The zero perturbations cost nothing: their primal ``z + a`` is dropped from the step graph (its
value is ``z``). Per-example separation assumes the examples of a batch do not interact (no
batch normalisation in training mode), and a loss that is a sum or mean of per-example terms
(cross-entropy, MSE, sum).

Outputs, in order: the loss, the new parameters, the new optimizer state, then the ``K``
per-example directional derivatives (shape ``(B,)``). Writes ``ROLE="direction"`` on the
sampling and estimate nodes, ``ROLE="grad_weight"`` on the local gradients, and
``gm.meta[FORWARD_GRADIENT]`` (:class:`~graphflop.meta.ForwardGradientInfo`, ``params``: the
trainable parameters; ``distribution``: ``normal``; ``tangent_pass``: ``activity``).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils._pytree import tree_map

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
    graph_fake_mode,
    graph_module,
)
from graphflop.passes.calls import flat_view
from graphflop.passes.forward_gradient import _StepBuilder
from graphflop.passes.infra import FLAT, GraphPass
from graphflop.passes.optimizer import SLOT, OptimizerConfig, build_update_for, inline_update

aten = torch.ops.aten
_VIEWS = {aten.permute.default, aten.t.default, aten.view.default, aten.reshape.default}
_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_REDUCE = {aten.sum.dim_IntList, aten.sum.default, aten.mean.default, aten.mean.dim}
#: the ops whose nodes are the layers' (Linear's ``addmm``/``mm``, Conv2d's ``convolution``)
_LAYER_OPS = (aten.addmm.default, aten.mm.default, aten.convolution.default)
#: meta key (not a graphflop annotation: private to this pass) marking a layer's nodes
_TAG = "activity_layer"


@dataclass(frozen=True)
class _Layer:
    op: str  # the addmm/mm/convolution node
    out: str  # the layer's output node z (the op, or a view of it)
    x: str  # the layer's input node
    weight: str  # parameter placeholder names
    bias: str | None


class NotPerturbable(ValueError):
    """The model's structure does not allow activity perturbation as built here (a parameter
    outside Linear/Conv2d layers, a grouped, transposed or not 2-D convolution, no per-example
    loss)."""


def build_activity_gradient_step(
    forward: GraphModule,
    optimizer: str | OptimizerConfig = "sgd",
    *,
    directions: int = 1,
    direction_inputs: bool = False,
    update: GraphModule | None = None,
) -> GraphModule:
    """Build the activity-perturbed step graph of a traced forward graph (module docstring).

    Args:
        forward: a graph from :func:`graphflop.frontend.trace.trace` with a loss.
        optimizer: the update applied to the estimate.
        directions: ``K`` ≥ 1 tangent draws averaged (``K`` copies of the tangent pass).
        direction_inputs: take the tangents as inputs ``u{k}_{l}`` (shaped like layer ``l``'s
            output, layers numbered in graph order) instead of sampling them.
        update: ``build_update_for(forward, optimizer)`` when already built.

    Raises:
        ValueError: ``directions`` < 1.
        NotPerturbable: (a ValueError) no loss, a trainable parameter that is not the weight
            or bias of a Linear/Conv layer, a grouped, transposed or not 2-D convolution, or
            a loss that is not a sum or mean of per-example terms.
    """
    if directions < 1:
        raise ValueError(f"directions must be at least 1, got {directions}")
    sig: Signature = forward.meta[SIGNATURE]
    if sig.loss is None:
        raise NotPerturbable("the forward graph has no loss")
    fake_mode = graph_fake_mode(forward)
    upd = (
        update if update is not None else build_update_for(forward, optimizer, fake_mode=fake_mode)
    )
    layers = _find_layers(forward, sig)
    _check_batch_leading(forward, sig, layers)
    pf = _perturbed_forward(forward, sig, layers, fake_mode)
    jvp = build_jvp(pf, "params")
    upd = flat_view(upd)  # a recorded update (``direct``): its flat graph is inlined
    return _step(forward, sig, jvp, upd, layers, fake_mode, directions, direction_inputs)


def _param_of(a: Any, trainable: set[str]) -> str | None:
    while isinstance(a, Node) and a.op == "call_function" and a.target in _VIEWS:
        a = a.args[0]
    return a.name if isinstance(a, Node) and a.name in trainable else None


def _find_layers(forward: GraphModule, sig: Signature) -> list[_Layer]:
    trainable = {p for p, _ in sig.trainable()}
    g = forward.graph
    # the layers' ops in graph order (fx's table of nodes by op: no walk over the others)
    nodes = sorted(
        n for t in _LAYER_OPS for n in g.find_nodes(op="call_function", target=t, sort=False)
    )
    layers, owned = [], set()
    for n in nodes:
        if n.target is aten.addmm.default:
            w, b, x = _param_of(n.args[2], trainable), _param_of(n.args[0], trainable), n.args[1]
        elif n.target is aten.mm.default:
            w, b, x = _param_of(n.args[1], trainable), None, n.args[0]
        elif n.target is aten.convolution.default:
            w, b, x = _param_of(n.args[1], trainable), _param_of(n.args[2], trainable), n.args[0]
            if w and (n.args[6] or n.args[8] != 1):
                raise NotPerturbable(
                    f"activity perturbation: convolution {n.name} is transposed or grouped; "
                    "only plain convolutions form their weight gradient locally here"
                )
            if w and n.args[0].meta["val"].dim() != 4:
                raise NotPerturbable(
                    f"activity perturbation: convolution {n.name} is not 2-D; only Conv2d "
                    "layers form their weight gradient locally here"
                )
        else:
            continue
        if w is None or not n.meta.get(MODULE):
            continue
        layers.append(_Layer(n.name, _layer_output(n).name, x.name, w, b))
        owned |= {w, b}
    stray = [q for p, q in sig.trainable() if p not in owned]
    if stray:
        raise NotPerturbable(
            f"activity perturbation forms gradients for Linear and Conv layers only; "
            f"parameter {stray[0]} belongs to another op"
        )
    return layers


def _layer_output(op: Node) -> Node:
    """The layer's output: ``op`` followed through its sole users that are views of the same
    module (back to the input's leading dimensions); one use of a shared layer at a time."""
    z = op
    while len(z.users) == 1:
        (u,) = z.users
        if u.target not in _THROUGH or u.meta.get(MODULE) != op.meta.get(MODULE):
            break
        z = u
    return z


def _fake_val(fake_mode, target, args, kwargs):
    def val(a):
        return a.meta["val"] if isinstance(a, Node) else a

    with fake_mode:
        return target(*tree_map(val, args), **tree_map(val, kwargs))


def _perturbed_forward(
    forward: GraphModule, sig: Signature, layers: list[_Layer], fake_mode
) -> GraphModule:
    """``forward`` with ``z_l + a_l`` in place of each layer output (``a_l`` trainable
    placeholders, the real parameters frozen) and the per-example loss terms as the loss."""
    g = Graph()
    m: dict[Node, Node] = {}
    out = g.graph_copy(forward.graph, m)
    by = {n.name: c for n, c in m.items()}
    for i, lay in enumerate(layers):
        for role, name in (("op", lay.op), ("x", lay.x)):
            by[name].meta[_TAG] = by[name].meta.get(_TAG, ()) + ((role, i),)
    first = next(n for n in g.nodes if n.op != "placeholder")
    acts = []
    for i, lay in enumerate(layers):
        z = by[lay.out]
        with g.inserting_before(first):
            a = g.placeholder(f"activity_{i}")
        a.meta.update({"val": z.meta["val"], KIND: "primal", ROLE: "forward", SOURCE: a.name})
        a.meta[MODULE] = z.meta.get(MODULE, "")
        with g.inserting_after(z):
            zp = g.call_function(aten.add.Tensor, (z, a))
        zp.meta = {**z.meta, _TAG: (("add", i),)}
        # every use of z but the sum's own reads z + activity
        z.replace_all_uses_with(zp, delete_user_cb=functools.partial(operator.is_not, zp))
        acts.append(a.name)
    g.output(out)
    per = _per_example_loss(g, sig, fake_mode, _batch(forward, sig))
    new_sig = replace(
        sig,
        params=sig.params + tuple((a, f"activity.{a}") for a in acts),
        frozen=tuple(p for p, _ in sig.params),
        loss=per.name,
    )
    pf = graph_module(forward, g)
    pf.meta.update(forward.meta)
    pf.meta[SIGNATURE] = new_sig
    return pf


def _check_batch_leading(forward: GraphModule, sig: Signature, layers: list[_Layer]) -> None:
    """Per-example activity gradients need every perturbed layer's output to lead with the batch
    (a layer applied to flattened rows, e.g. attention's in-projection on (B·T, d), does not)."""
    batch = _batch(forward, sig)
    nodes = {n.name: n for n in forward.graph.nodes}
    for layer in layers:
        shape = nodes[layer.out].meta["val"].shape
        if not shape or shape[0] != batch:
            raise NotPerturbable(
                f"activity perturbation: layer {layer.op}'s output {tuple(shape)} does not "
                f"lead with the batch ({batch})"
            )


def _batch(forward: GraphModule, sig: Signature) -> int:
    ph = next(n for n in forward.graph.nodes if n.name == sig.inputs[0])
    return int(ph.meta["val"].shape[0])


def _ancestors(n: Node) -> set[Node]:
    seen, todo = set(), [n]
    while todo:
        x = todo.pop()
        if x not in seen:
            seen.add(x)
            todo += x.all_input_nodes
    return seen


def _descendants(g: Graph, sources: set[Node]) -> set[Node]:
    """``sources`` and every node computed from one of them (one sweep in graph order, which
    is topological)."""
    out = set(sources)
    for n in g.nodes:
        if n not in out and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _per_example_loss(g: Graph, sig: Signature, fake_mode, batch: int) -> Node:
    """Copy the loss's reduction chain with its batch dimension kept: the last node on the
    loss's path that has the batch as its leading dimension is ``P``; each full ``sum``/
    ``mean`` after it becomes a sum over the other dimensions (``mean``: divided by the
    elements it averaged); the rest is copied (it must be elementwise with scalars)."""
    nodes = {n.name: n for n in g.nodes}
    loss = nodes[sig.loss]
    up = _ancestors(loss)
    outs = set().union(*(_ancestors(nodes[o]) for o in sig.outputs)) if sig.outputs else set()
    after_outs = _descendants(g, outs)
    from_out = [n for n in g.nodes if n in up and n in after_outs]
    cands = [
        n
        for n in from_out
        if isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].dim() >= 1
        and n.meta["val"].shape[0] == batch
    ]
    if not cands:
        raise NotPerturbable("activity perturbation: the loss has no per-example terms")
    p = cands[-1]
    after_p = _descendants(g, {p})
    chain = [n for n in g.nodes if n in up and n in after_p and n is not p]
    env: dict[Node, Node] = {p: p}
    out_node = next(n for n in g.nodes if n.op == "output")
    ann = {k: v for k, v in p.meta.items() if k not in ("val", _TAG)}
    for n in chain:
        with g.inserting_before(out_node):
            src = next((a for a in n.all_input_nodes if a in env), None)
            if n.target in _REDUCE and src is not None:
                mean = n.target in (aten.mean.default, aten.mean.dim)
                env[n] = _reduce_but_batch(g, env[src], mean, fake_mode, ann)
                continue
            c = g.node_copy(n, lambda a: env.get(a, a))
            try:
                val = _fake_val(fake_mode, c.target, c.args, c.kwargs)
            except RuntimeError as e:  # the batch dim is not where the loss's terms are
                raise NotPerturbable(
                    "activity perturbation: the loss's per-example terms could not be kept "
                    f"apart ({c.target} on them fails: {str(e).splitlines()[0]})"
                ) from e
            c.meta = {**ann, "val": val}
            env[n] = c
    per = env[loss]
    v = per.meta["val"]
    if v.dim() != 1 or v.shape[0] != batch:
        raise NotPerturbable(
            "activity perturbation: the loss is not a sum or mean of per-example terms"
        )
    return per


def _reduce_but_batch(g: Graph, x: Node, mean: bool, fake_mode, ann: dict) -> Node:
    v = x.meta["val"]
    dims = list(range(1, v.dim()))
    r = x
    if dims:
        r = g.call_function(aten.sum.dim_IntList, (x, dims))
        r.meta = {**ann, "val": _fake_val(fake_mode, r.target, r.args, r.kwargs)}
    if mean:
        r = g.call_function(aten.div.Tensor, (r, float(v.numel())))
        r.meta = {**ann, "val": _fake_val(fake_mode, r.target, r.args, r.kwargs)}
    return r


def _step(forward, sig, jvp, upd, layers, fake_mode, directions, direction_inputs) -> GraphModule:
    info = jvp.meta[JVP]
    tangent_names = {t for t, _ in info.tangent_inputs}
    act_names = {a for _, a in info.tangent_inputs}
    g = Graph()
    b = _StepBuilder(g, fake_mode, [])
    env: dict[Node, Node] = {}
    tagged: dict[tuple[str, int], Node] = {}
    for n in jvp.graph.nodes:
        if n.op == "placeholder" and n.name not in tangent_names | act_names:
            env[n] = g.node_copy(n)
            tagged.update({t: env[n] for t in n.meta.get(_TAG, ())})
    phs = {n.name: c for n, c in env.items()}
    state_phs = {
        n.name: g.node_copy(n)
        for n in upd.graph.nodes
        if n.op == "placeholder" and n.meta[SLOT] not in ("param", "grad")
    }
    tangent_of = {a: t for t, a in info.tangent_inputs}
    act_val = {
        n.name: n.meta["val"]
        for n in jvp.graph.nodes
        if n.op == "placeholder" and n.name in act_names
    }
    order = [f"activity_{i}" for i in range(len(layers))]
    given = {}
    if direction_inputs:
        for k in range(directions):
            for i, a in enumerate(order):
                ph = g.placeholder(f"u{k}_{i}")
                ph.meta.update(
                    {"val": act_val[a], KIND: "direction", ROLE: "direction", SOURCE: a, MODULE: ""}
                )
                given[(k, i)] = ph
    ds, us = [], []
    for k in range(directions):
        u = {}
        with b.context(role="direction"):
            for i, a in enumerate(order):
                if direction_inputs:
                    u[i] = given[(k, i)]
                    continue
                val = act_val[a]
                u[i] = b.call(
                    aten.randn.default, list(val.shape), dtype=val.dtype, device=val.device
                )
        ds.append(
            _copy_pass(
                g, jvp, env, {tangent_of[a]: u[i] for i, a in enumerate(order)}, tagged, k == 0
            )
        )
        us.append(u)
    grads = _local_grads(b, layers, tagged, ds, us)
    qual = dict(sig.trainable())
    new_state = inline_update(
        g, upd, {qual[p]: phs[p] for p in qual}, {qual[p]: grads[p] for p in qual}, state_phs
    )
    loss = env[next(n for n in jvp.graph.nodes if n.op == "output").args[0][0]]
    g.output(tuple([loss] + new_state + ds))
    gm = graph_module(torch.nn.Module(), g)
    gm.meta[SIGNATURE] = sig
    gm.meta[FORWARD_GRADIENT] = ForwardGradientInfo(
        tuple(n.name for n in g.nodes if n.op == "placeholder"),
        tuple(q for _, q in sig.trainable()),
        tuple(n for n in state_phs if n not in ("lr", "step")),
        directions,
        "normal",
        direction_inputs,
        "activity",
    )
    gm.meta[UPDATE] = upd.meta[UPDATE]
    return gm


def _copy_pass(
    g: Graph, jvp: GraphModule, env: dict[Node, Node], u: dict[str, Node], tagged, first: bool
) -> Node:
    """Copy the JVP graph's nodes for one draw ``u`` (tangent placeholder name → node); primal
    nodes once (into ``env``), the ``z + a`` primal as ``z``. Returns the per-example loss
    tangent; records the layers' tagged primal nodes in ``tagged``."""
    info = jvp.meta[JVP]
    local: dict[Node, Any] = dict(env)
    local.update({n: u[n.name] for n in jvp.graph.nodes if n.name in u})
    for n in jvp.graph.nodes:
        if n.op in ("placeholder", "output") or (not first and n in env):
            continue
        if n.meta.get(KIND) != "tangent":
            tags = n.meta.get(_TAG, ())
            if any(t[0] == "add" for t in tags):
                c = local[n.args[0]]  # z + 0 is z
            else:
                c = g.node_copy(n, local.__getitem__)
            local[n] = env[n] = c
            tagged.update({t: c for t in tags})
            continue
        local[n] = g.node_copy(n, local.__getitem__)
    return local[next(n for n in jvp.graph.nodes if n.op == "output").args[0][info.primal_outputs]]


def _local_grads(b, layers: list[_Layer], tagged, ds, us) -> dict[str, Node]:
    """Per parameter placeholder name, its locally formed gradient estimate."""
    grads: dict[str, Node] = {}
    for i, lay in enumerate(layers):
        op, x = tagged[("op", i)], tagged[("x", i)]
        mod = op.meta.get(MODULE, "")
        with b.context(role="direction", source=lay.out, module=mod):
            est: Node | None = None
            for d, u in zip(ds, us):
                v = u[i].meta["val"]
                dv = b.call(aten.view.default, d, [v.shape[0]] + [1] * (v.dim() - 1))
                term = b.call(aten.mul.Tensor, u[i], dv)
                est = term if est is None else b.call(aten.add.Tensor, est, term)
            if len(ds) > 1:
                est = b.call(aten.div.Tensor, est, float(len(ds)))
        assert est is not None, "at least one direction"
        with b.context(role="grad_weight", source=op.name, module=mod):
            for p, gp in _layer_grads(b, lay, op, x, est).items():
                # a layer applied more than once (weight sharing): its uses' gradients add up
                grads[p] = gp if p not in grads else b.call(aten.add.Tensor, grads[p], gp)
    return grads


def _layer_grads(b, lay: _Layer, op: Node, x: Node, est: Node) -> dict[str, Node]:
    ov = op.meta["val"]
    if op.target is aten.convolution.default:
        _, wt, _, stride, padding, dilation = op.args[:6]
        # aten.convolution's schema: the weight a tensor, stride, padding, dilation int lists
        assert isinstance(wt, Node), op.format_node()
        assert isinstance(stride, (list, tuple)) and isinstance(padding, (list, tuple))
        assert isinstance(dilation, (list, tuple))
        w, h_out = wt.meta["val"], ov.shape[2:]
        if any(padding):
            x = b.call(
                aten.constant_pad_nd.default, x, [padding[1], padding[1], padding[0], padding[0]]
            )
        # keep only the input the convolution reads, so that the weight-gradient convolution
        # below makes exactly the kernel (no work cropped away with strides > 1)
        for d in (0, 1):
            used = (h_out[d] - 1) * stride[d] + dilation[d] * (w.shape[2 + d] - 1) + 1
            if x.meta["val"].shape[2 + d] != used:
                x = b.call(aten.slice.Tensor, x, 2 + d, 0, used)
        xt = b.call(aten.permute.default, x, [1, 0, 2, 3])
        gt = b.call(aten.permute.default, est, [1, 0, 2, 3])
        # the weight gradient as a convolution of the input with the output gradient (stride
        # and dilation swap places)
        gw = b.call(
            aten.convolution.default, xt, gt, None, dilation, [0, 0], stride, False, [0, 0], 1
        )
        gw = b.call(aten.permute.default, gw, [1, 0, 2, 3])
        out = {lay.weight: gw}
        if lay.bias:
            out[lay.bias] = b.call(aten.sum.dim_IntList, est, [0, 2, 3])
        return out
    g2 = (
        est
        if tuple(est.meta["val"].shape) == tuple(ov.shape)
        else b.call(aten.view.default, est, list(ov.shape))
    )
    gw = b.call(aten.mm.default, b.call(aten.permute.default, g2, [1, 0]), x)
    out = {lay.weight: gw}
    if lay.bias:
        out[lay.bias] = b.call(aten.sum.dim_IntList, g2, [0])
    return out


class BuildActivityGradientStep(GraphPass):
    """Forward graph → its activity-perturbed step graph
    (:func:`build_activity_gradient_step`; the constructor takes that function's options).

    Requires ``traced``; provides ``activity_gradient``. Raises ``ValueError`` (see the
    function).
    """

    #: runs on the flat graph: its derivative graph is not yet built per template
    scope = FLAT
    name = "build_activity_gradient_step"
    required = ("traced",)
    provided = ("activity_gradient",)

    def __init__(
        self,
        optimizer: str | OptimizerConfig = "sgd",
        *,
        directions: int = 1,
        direction_inputs: bool = False,
        update: GraphModule | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.directions = directions
        self.direction_inputs = direction_inputs
        self.update = update

    def call(self, graph_module: GraphModule) -> PassResult:
        gm = build_activity_gradient_step(
            graph_module,
            self.optimizer,
            directions=self.directions,
            direction_inputs=self.direction_inputs,
            update=self.update,
        )
        return PassResult(gm, True)


def step_peak_bytes(step: GraphModule) -> int:
    """Peak live bytes of a step graph (activity- or weight-perturbed) run in its node order:
    the parameters and the other placeholders held throughout, plus the largest sum of the
    live intermediate tensors (:class:`graphflop.passes.memory.Schedule`; the new parameters
    and state are outputs kept to the end, as an out-of-place update makes them)."""
    from graphflop.passes.flops import tensor_bytes
    from graphflop.passes.memory import Schedule

    phs = [n for n in step.graph.nodes if n.op == "placeholder"]
    s = Schedule()
    s.add_graph(step, "s", baseline={n.name for n in phs}, keep_outputs=True)
    held = sum(
        tensor_bytes(n.meta["val"]) for n in phs if isinstance(n.meta.get("val"), torch.Tensor)
    )
    return held + s.peak()[0]
