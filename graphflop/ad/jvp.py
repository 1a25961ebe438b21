"""Forward mode: the JVP graph, built explicitly from the rule table.

``build_jvp(forward)`` returns a graph computing the forward's primal outputs and the tangents of
its loss (and, optionally, model outputs) given tangents for the parameters and/or the inputs.
Primal and tangent nodes are interleaved in forward order, so no residual is kept. Every tangent
node is linear in the tangent inputs (rules put the nonlinear part into ``coef`` nodes), which
is what lets :mod:`graphflop.ad.vjp` transpose it.

Symbolic zeros: a tangent known to be zero is ``None`` and no work is emitted for it; so is the
tangent of a node the model made with grad mode off (``NO_GRAD``: eager autograd gives it no
gradient; eager forward-mode AD, which ``no_grad`` does not stop, would give it one), except a
tensor's value after an in-place write made there (``NO_GRAD_WRITE``), which keeps the tangent
of its value before, as eager autograd, which does not see the write. A tangent
that is zero only because the value was not chosen to carry one (the model input under weight
perturbation) is a ghost: the work it would have caused is recorded in ``gm.meta[GHOSTS]``.

Reads ``val`` and the graphflop keys :mod:`graphflop.frontend.trace` writes, and the rule table.
Writes ``KIND``, ``ROLE`` (``tangent_from_input``/``tangent_from_param``), ``SOURCE``, ``MODULE``,
``PARAM_DERIVED`` on new nodes (through the builder's rule context); ``gm.meta[GHOSTS]`` (list of
:class:`~graphflop.meta.Ghost`), ``gm.meta[SIGNATURE]``, ``gm.meta[JVP]`` (:class:`JvpInfo`),
``gm.meta[JVP_LOG]`` (tuple of the tangent nodes and ghosts emitted, in order, a custom
Function's tangent work as one :class:`~graphflop.ad.functions.FunctionEntry`: what the
transpose replays in reverse), ``gm.meta[GHOST_LINKS]`` (:class:`~graphflop.meta.GhostLinks`),
``gm.meta[LOSS_KIND]``, ``gm.meta[GAPS]`` (:class:`~graphflop.meta.Gap`: forward nodes whose op
has no JVP rule, or in-place writes left in the graph that a later node reads through another
alias, :func:`graphflop.ops.recurrent.hidden_writes`; their tangent is cut to a symbolic zero, so
the work that depends on it is not built, unless :func:`graphflop.ops.strict_rules` makes that an
error).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from graphflop.ad.blocks import BlockLinearize, call_keys, call_plans, on_graph
from graphflop.ad.builder import Builder, copy_node, placeholder
from graphflop.ad.functions import FunctionCall, emit_tangent, function_calls
from graphflop.meta import (
    CALL_SITE,
    CHECKPOINT,
    DERIVED_HIERARCHY,
    GAPS,
    GHOST_LINKS,
    GHOSTS,
    HIERARCHY,
    JVP,
    JVP_LOG,
    KIND,
    LEAF,
    LOSS_KIND,
    MODULE,
    NO_GRAD,
    NO_GRAD_WRITE,
    PARAM,
    PARAM_DERIVED,
    ROLE,
    SIGNATURE,
    SOURCE,
    Gap,
    Ghost,
    GhostLinks,
    JvpInfo,
    Signature,
    fake_mode_of,
    graph_module,
    written_before,
)
from graphflop.ops import MissingRuleError, is_strict, lookup, op_name
from graphflop.ops.ghost import GhostValue, is_ghost
from graphflop.ops.recurrent import hidden_writes

TANGENT_CHOICES = ("params", "inputs", "all")


class JvpBuilder(Builder):
    """Emits into the JVP graph; roles ``tangent_from_param``/``tangent_from_input``."""

    active_kind = "tangent"

    def role_for(self, kind: str, args_flat: list[Any]) -> str:
        """``tangent_from_input`` for tangent work that a tangent entering the layer (the
        forward node's module) from outside flows through; ``tangent_from_param`` for work on
        the layer's parameter tangents alone (docs/flops_conventions.md), and for coefficients of a
        parameter-only forward node.

        A tangent argument enters through the layer's input unless it is computed from
        parameters only (a parameter's tangent, or a view of it), was emitted in this layer
        from its parameter tangents alone (role ``tangent_from_param``: the first layer's
        ``conv(x, Ẇ) + ḃ`` is all parameter work), or is a parameter's tangent placeholder."""
        if kind != "tangent":
            return "tangent_from_param" if self.ctx.param_derived else "tangent_from_input"
        lin = [
            a
            for a in args_flat
            if (isinstance(a, Node) and a.meta.get(KIND) == "tangent") or is_ghost(a)
        ]
        if lin and not any(self._through_input(a) for a in lin):
            return "tangent_from_param"
        return "tangent_from_input"

    def _through_input(self, a: Any) -> bool:
        """Whether tangent ``a`` carries the layer's input tangent (see :meth:`role_for`)."""
        if is_ghost(a):
            return not a.param_derived
        if a.meta.get(PARAM_DERIVED, False):
            return False
        if a.op == "placeholder" or a.meta.get(MODULE) != self.ctx.module:
            return True
        return a.meta.get(ROLE) != "tangent_from_param"


def _is_float(v: Any) -> bool:
    """Whether ``v`` carries a tangent: a floating-point or complex tensor."""
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _needed(
    graph: Graph, outputs: list[Node], hidden: dict[Node, list[Node]] | None = None
) -> set[Node]:
    """The nodes whose tangents ``outputs``' tangents can depend on: their inputs (and the
    in-place writes ``hidden`` lists for a node, :func:`graphflop.ops.recurrent.hidden_writes`:
    it reads what they wrote), but not
    through a node made with grad mode off (``NO_GRAD``: it takes no tangent from its inputs),
    except a tensor's value after a write there (``NO_GRAD_WRITE``), which takes its value's
    before (or, made again as a view, its input's). A walk over the flat forward: its
    loop's bound methods taken once, the in-place writes looked up only where there are any
    (a tenth of a JVP's time per block of GPT-2 otherwise)."""
    seen: set[Node] = set()
    stack = list(outputs)
    pop, push, mark = stack.pop, stack.extend, seen.add
    writes = hidden.get if hidden else None
    while stack:
        n = pop()
        if n in seen:
            continue
        mark(n)
        if not n.meta.get(NO_GRAD):
            push(n._input_nodes)  # all_input_nodes' order (its keys), without the list
            if writes is not None:
                push(writes(n, ()))
            continue
        _past_no_grad(n, stack)
    return seen


def _past_no_grad(n: Node, stack: list[Node]) -> None:
    """Where the walk for the needed nodes goes on from ``n``, a node made with grad mode off
    (``NO_GRAD``): to all its inputs where it writes into a value made before it (its
    ``NO_GRAD_WRITE`` naming no earlier write), else to the value it wrote over, if any."""
    write = n.meta.get(NO_GRAD_WRITE)
    before = written_before(n) if write is not None else None
    if write is not None and write.before is None:
        stack.extend(n.all_input_nodes)
    elif before is not None:
        stack.append(before)


def _needed_by_call(forward: GraphModule, outputs: list[Node]) -> set[Node] | None:
    """:func:`_needed` of a forward graph with call sites and no hidden writes, a call's nodes
    marked at once: entered at one of its template's results (the only nodes of a call read
    outside it where the hierarchy has a top-level graph), what the walk would reach inside
    the call from there (and the inputs it would leave by) is worked out at the first call of
    its variant, by place among the call's nodes (:func:`~graphflop.ad.blocks.call_plan`),
    and read at the others. A call with a node made with grad mode off (``NO_GRAD``: the walk
    stops or jumps there) and any other node is walked node by node. None where ``forward``
    has no top-level graph."""
    plans = call_plans(forward)
    if plans is None:
        return None
    keys = call_keys(forward)
    # the calls walked node by node: a node made with grad mode off in them
    plain = {n.meta[CALL_SITE][0] for n in keys.key if NO_GRAD in n.meta}
    entry: dict[Node, tuple[int, int]] = {}
    for s, ns in keys.site_nodes.items():
        plan = plans(s)
        if plan is not None and s not in plain:
            for p in plan[1]:
                entry[ns[p]] = (s, p)
    reached: dict[tuple[int, int], tuple[list[int], list[tuple[int, int]]]] = {}
    sites = forward.meta[HIERARCHY].sites
    seen: set[Node] = set()
    stack = list(outputs)
    pop, push, mark = stack.pop, stack.extend, seen.add
    while stack:
        n = pop()
        if n in seen:
            continue
        at = entry.get(n)
        if at is not None:  # a call's result: what the walk reaches in the call, at once
            s, p = at
            ns = keys.site_nodes[s]
            v = (sites[s].variant, p)
            got = reached.get(v)
            if got is None:
                got = reached[v] = _reach(ns, p)
            seen.update(map(ns.__getitem__, got[0]))
            stack.extend([list(ns[i]._input_nodes)[q] for i, q in got[1]])
            continue
        mark(n)
        if not n.meta.get(NO_GRAD):
            push(n._input_nodes)
            continue
        _past_no_grad(n, stack)
    return seen


def _reach(ns: list[Node], p: int) -> tuple[list[int], list[tuple[int, int]]]:
    """From node ``p`` of a call (its nodes ``ns``, none made with grad mode off), the places
    of the call's nodes :func:`_needed`'s walk reaches, and ``(place, q)`` for each input
    from outside the call it leaves by (the ``q``-th input node of the node there)."""
    at = {n: i for i, n in enumerate(ns)}
    reach: list[int] = []
    exits: list[tuple[int, int]] = []
    seen: set[Node] = set()
    stack = [ns[p]]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        i = at[n]
        reach.append(i)
        for q, a in enumerate(n._input_nodes):
            if a in at:
                stack.append(a)
            else:
                exits.append((i, q))
    return reach, exits


def has_leaves(forward: GraphModule) -> bool:
    """Whether the model's code made a value of ``forward`` a leaf that requires grad
    (:data:`~graphflop.meta.LEAF`): the backward's linearization then differs from the JVP's
    (``build_jvp(leaves=True)``). Worked out once per forward graph (:func:`~graphflop.ad.
    blocks.on_graph`: the analysis asks before the derivatives are built, the backward again)."""
    return on_graph(forward, "_graphflop_has_leaves", _has_leaves)


def _has_leaves(forward: GraphModule) -> bool:
    return any(LEAF in n.meta for n in forward.graph.nodes)


def _differentiated(forward: GraphModule, sig: Signature, wrt_outputs: str) -> list[Node]:
    """The forward nodes whose tangents the JVP graph returns: the loss (and the model's
    outputs for ``wrt_outputs="outputs"``, or when there is no loss), floating ones only.
    They are looked up from the graph's end, where the loss and the outputs are, not over
    the whole flat forward."""
    diff_names = [sig.loss] if sig.loss else []
    if wrt_outputs == "outputs" or not diff_names:
        diff_names += [o for o in sig.outputs if o not in diff_names]
    wanted = set(diff_names)
    nodes: dict[str, Node] = {}
    for n in reversed(forward.graph.nodes) if wanted else ():
        if n.name in wanted:
            nodes[n.name] = n
            if len(nodes) == len(wanted):
                break
    return [nodes[n] for n in diff_names if _is_float(nodes[n].meta.get("val"))]


def build_jvp(
    forward: GraphModule,
    tangents: str = "params",
    *,
    wrt_outputs: str = "loss",
    for_transpose: bool = False,
    per_template: bool = True,
    recorder: Any = None,
    leaves: bool = False,
) -> GraphModule:
    """Build the JVP graph of a traced forward graph.

    Args:
        forward: a graph from :func:`graphflop.frontend.trace.trace`.
        tangents: which placeholders carry tangents: ``params`` (weight perturbation, the
            forward gradient of Baydin et al. 2022), ``inputs`` or ``all``.
        wrt_outputs: ``loss`` (the tangent of the scalar loss: the directional derivative) or
            ``outputs`` (tangents of the model's outputs too).
        for_transpose: the graph is only transposed, never run: a custom Function without
            ``jvp`` gets an opaque tangent node (:func:`graphflop.ad.functions.no_jvp`) instead
            of a gap, so the backward is built through it from its own ``backward``
            (``JvpInfo.opaque`` names such Functions).
        per_template: build each repeated block's JVP nodes once per variant and expand them
            at its other calls (:mod:`graphflop.ad.blocks`; the same graph node for node as
            ``False``, which runs the rules at every call).
        recorder: with ``per_template``, a :class:`graphflop.passes.calls.DirectRecorder` of
            ``forward``: the graph returned is then the top level of the JVP's hierarchy, each
            expanded call (and each variant's first call) one ``graphflop::repeat`` node, and
            ``gm.meta[DERIVED_HIERARCHY]`` holds the hierarchy (``calls.expand`` gives the flat
            graph, node for node the one built without it); ``JVP_LOG`` holds the top
            level's logged tangents and those of a call read after it (its getitems).
        leaves: also give each value the model's code made a leaf that requires grad
            (:data:`~graphflop.meta.LEAF`: ``requires_grad_()`` on a value that depends on no
            trainable parameter, PEFT's ``enable_input_require_grads``) a tangent input of
            its own, which replaces its (zero) tangent: the linearization the backward
            transposes, since eager autograd computes such a leaf's gradient and so
            differentiates everything between it and the loss (eager forward-mode AD, and so
            the JVP phase and the forward gradient, ignores ``requires_grad``).

    Returns:
        A GraphModule taking the forward's placeholders followed by one tangent per selected
        placeholder (same shape), then one per leaf (``leaves``, :attr:`JvpInfo.leaf_tangents`),
        returning the forward's outputs followed by the tangents.

    Raises:
        MissingRuleError: for an op on the differentiated path with no JVP rule, inside
            :func:`graphflop.ops.strict_rules` (otherwise the tangent is cut there and the
            node listed in ``gm.meta[GAPS]``).
        ValueError: for an unknown ``tangents`` choice.
    """
    if tangents not in TANGENT_CHOICES:
        raise ValueError(f"unknown tangents choice {tangents!r}; one of {TANGENT_CHOICES}")
    sig: Signature = forward.meta[SIGNATURE]
    diff_out = _differentiated(forward, sig, wrt_outputs)
    params = {p for p, _ in sig.trainable()}  # frozen parameters carry no tangent
    inputs = set(sig.inputs)
    carry = params if tangents == "params" else inputs if tangents == "inputs" else params | inputs

    lin = _Linearizer(forward, for_transpose, per_template)
    lin.recorder = recorder if per_template else None
    hidden = hidden_writes(forward.graph)
    needed = (
        None if hidden or not per_template else _needed_by_call(forward, diff_out)
    ) or _needed(forward.graph, diff_out, hidden)
    tangent_inputs = lin.placeholders(carry, ghostly=(params | inputs) - carry, params=params)
    leaf_tangents = lin.leaf_placeholders(needed) if leaves else []
    # an in-place write a needed node reads through another alias: its tangent cannot reach
    # that reader (the graph has no edge for it), so the derivative is cut there, visibly
    # (looked up only where there are writes: ``needed`` is most of the flat forward)
    lin.cut = (
        {m for n in needed for m in hidden.get(n, ()) if not m.meta.get(NO_GRAD)}
        if hidden
        else set()
    )
    outs = lin.propagate(needed)
    primal_outs = [lin.env[o] if isinstance(o, Node) else o for o in outs]
    tangent_outs = [lin.output_tangent(d) for d in diff_out]
    lin.graph.output(tuple(primal_outs + tangent_outs))
    log = list(lin.b.log)
    links = lin.b.ghost_links
    whole: Any = None  # the recorder's CallLog
    if lin.recorder is not None:  # a call's nodes linked to ghosts: its getitems
        moved = lin.recorder.finish(lin.graph, list(links))
        whole = lin.recorder.log(log)
        links = {moved.get(n, n): gs for n, gs in links.items()}
        # the log's nodes left at the top level (a call's tangents are its template's)
        log = [e for e in log if not isinstance(e, Node) or not getattr(e, "_erased", False)]

    gm = graph_module(forward, lin.graph)
    if lin.recorder is not None:
        dh = lin.recorder.hierarchy(gm)
        if dh is not None:  # with the whole log, for calls.expand_jvp (the transpose's)
            dh = replace(dh, log=whole if whole is not None else (), moved=lin.recorder.first_at)
            gm.meta[DERIVED_HIERARCHY] = dh
    gm.meta[SIGNATURE] = sig
    gm.meta[GHOSTS] = lin.ghosts
    gm.meta[JVP] = JvpInfo(
        tuple(tangent_inputs),
        len(primal_outs),
        tuple(d.name for d in diff_out),
        tuple(dict.fromkeys(lin.opaque)),
        tuple(leaf_tangents),
    )
    gm.meta[JVP_LOG] = tuple(log)
    gm.meta[GHOST_LINKS] = GhostLinks.of(links)
    gm.meta[LOSS_KIND] = forward.meta.get(LOSS_KIND)
    gm.meta[GAPS] = tuple(lin.gaps) + (_detached_regions(forward) if carry & inputs else ())
    return gm


#: the :class:`Gap` op of a reentrant checkpoint the trace detached, differentiated with
#: respect to the model's inputs
DETACHED_INPUT = (
    "reentrant checkpoint on the model's inputs (traced as taking no derivative, as eager does "
    "for inputs that do not require grad; the derivative with respect to the inputs through it "
    "is not modelled)"
)


def _detached_regions(forward: GraphModule) -> tuple[Gap, ...]:
    """One gap per reentrant checkpoint call the trace detached (none of its inputs depended
    on a parameter): with tangents on the inputs eager would differentiate through it."""
    first: dict[int, Node] = {}
    for n in forward.graph.nodes:
        tag = n.meta.get(CHECKPOINT)
        if tag is not None and tag.detached:
            first.setdefault(tag.region, n)
    return tuple(
        Gap(DETACHED_INPUT, n.name, n.meta.get(MODULE, ""), "recompute") for n in first.values()
    )


def _getitems(n: Node) -> list[Node]:
    """The ``getitem`` users of multi-output node ``n``, by output index."""
    items = [u for u in n.users if u.target is operator.getitem]
    if all(isinstance(u.args[1], int) for u in items):
        items.sort(key=lambda u: u.args[1])  # type: ignore[arg-type,return-value]
    return items


class _Linearizer:
    """The JVP graph as it is built: primal copies (``env``) and tangents (``tan``) of the
    forward's nodes, interleaved in forward order."""

    def __init__(
        self, forward: GraphModule, for_transpose: bool = False, per_template: bool = True
    ):
        self.forward = forward
        self.for_transpose = for_transpose
        self.per_template = per_template
        #: a :class:`graphflop.passes.calls.DirectRecorder`, or None (set by ``build_jvp``)
        self.recorder: Any = None
        self.calls = function_calls(forward)
        self.last = {id(c): c.nodes[-1] for c in self.calls.values()}
        self.opaque: list[str] = []
        self.graph = Graph()
        self.env: dict[Node, Node] = {}
        self.tan: dict[Node, Any] = {}
        #: the tangent input of each forward node tagged ``LEAF`` (``build_jvp(leaves=True)``)
        self.leaf_tan: dict[Node, Node] = {}
        self.ghosts: list[Ghost] = []
        self.gaps: list[Gap] = []
        #: in-place writes read through another alias (set by ``build_jvp``): cut, a gap each
        self.cut: set[Node] = set()
        fake_mode = fake_mode_of(n.meta.get("val") for n in forward.graph.nodes if "val" in n.meta)
        self.b = JvpBuilder(self.graph, fake_mode, self.ghosts)

    def _copy(self, n: Node) -> Node:
        return copy_node(self.graph, n, self.env.__getitem__)

    def placeholders(self, carry: set[str], ghostly: set[str], params: set[str]) -> list:
        """Copy the forward's placeholders, then add a tangent placeholder per floating one in
        ``carry``; those in ``ghostly`` get a ghost tangent. Returns the (tangent placeholder,
        primal placeholder) name pairs."""
        # (fx's table of nodes by op: not a walk over the whole forward)
        placeholders = self.forward.graph.find_nodes(op="placeholder")
        for n in placeholders:
            self.env[n] = self._copy(n)
        tangent_inputs = []
        for n in placeholders:
            if n.name in carry and _is_float(n.meta["val"]):
                t = placeholder(self.graph, f"t_{n.name}")
                role = "tangent_from_param" if n.name in params else "tangent_from_input"
                t.meta.update(
                    {
                        "val": n.meta["val"],
                        KIND: "tangent",
                        SOURCE: n.name,
                        MODULE: "",
                        PARAM_DERIVED: n.name in params,
                        ROLE: role,
                    }
                )
                if PARAM in n.meta:
                    t.meta[PARAM] = n.meta[PARAM]
                self.tan[n] = t
                tangent_inputs.append((t.name, n.name))
            elif n.name in ghostly and _is_float(n.meta["val"]):
                self.tan[n] = GhostValue(n.meta["val"], param_derived=n.name in params)
        return tangent_inputs

    def leaf_placeholders(self, needed: set[Node]) -> list[tuple[str, str]]:
        """A tangent placeholder (after the others) for each forward node tagged ``LEAF``
        whose value the differentiated outputs depend on (an unused leaf gets no gradient in
        eager either). Returns the (tangent placeholder, forward node) name pairs."""
        pairs = []
        for n in self.forward.graph.nodes:
            if not (LEAF in n.meta and n in needed and _is_float(n.meta.get("val"))):
                continue
            t = placeholder(self.graph, f"t_{n.name}")
            t.meta.update(
                {
                    "val": n.meta["val"],
                    KIND: "tangent",
                    SOURCE: n.name,
                    MODULE: n.meta.get(MODULE, ""),
                    PARAM_DERIVED: False,
                    ROLE: "tangent_from_input",
                }
            )
            self.leaf_tan[n] = t
            if n.op == "placeholder":  # a model input the model made require grad
                self._as_leaf(n)
            pairs.append((t.name, n.name))
        return pairs

    def _as_leaf(self, n: Node) -> None:
        """Give ``n`` its leaf tangent, unless it carries a real one (it then depends on a
        value that requires grad, and eager's ``requires_grad_()`` changes nothing)."""
        t = self.tan.get(n)
        if t is None or is_ghost(t):
            self.tan[n] = self.leaf_tan[n]

    def propagate(self, needed: set[Node]) -> tuple[Any, ...]:
        """Copy every forward node and emit the tangents of those in ``needed``, in forward
        order. Returns the forward's outputs (the output node's values)."""
        out_node = None
        blocks = BlockLinearize.of(self.forward, self) if self.per_template else None
        nodes = list(self.forward.graph.nodes)
        i, count = 0, len(nodes)
        while i < count:
            n = nodes[i]
            i += 1
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out_node = n
                continue
            run = blocks.nodes(n) if blocks is not None else None
            if run is not None and blocks is not None:  # a call: once per variant
                blocks.linearize(n.meta[CALL_SITE][0], needed, lambda x: self._node(x, needed))
                i += len(run) - 1  # (a call's nodes are one run, from ``n`` on: not split)
                continue
            self._node(n, needed)
        outs = out_node.args[0] if out_node is not None else None
        if not isinstance(outs, (tuple, list)):
            raise ValueError("the forward graph has no output node returning a tuple")
        return tuple(outs)

    def _node(self, n: Node, needed: set[Node]) -> None:
        """Copy forward node ``n`` (and its getitems) and emit its tangent if needed; a leaf's
        (``LEAF``) is its tangent input."""
        self._node_tangent(n, needed)
        if n in self.leaf_tan:
            self._as_leaf(n)

    def _node_tangent(self, n: Node, needed: set[Node]) -> None:
        if n not in self.env:
            self.env[n] = self._copy(n)
        # copy getitems at once, so rules can read every output; in output order, not in
        # ``n.users``' order (the order the nodes were made in: the flat trace's getitems of
        # outputs nothing read come after the others, an outlined graph's follow graph order)
        for u in _getitems(n):
            if u not in self.env:
                self.env[u] = self._copy(u)
        call = self.calls.get(n)
        if call is not None:  # a custom Function's ops: its own jvp, at its last node
            # called with grad mode off (all its nodes made so): no derivative
            if self.last[id(call)] is n and not all(m.meta.get(NO_GRAD) for m in call.nodes):
                self._function_tangent(call)
        elif n.meta.get(NO_GRAD):  # made with grad mode off: no derivative, as after detach
            # except a tensor's value after an in-place write (h[:, 0] = v, h.mul_(2) under
            # no_grad): autograd does not see the write, so the tensor keeps its derivative,
            # as if the write were not there; its views made again are views of it
            write = n.meta.get(NO_GRAD_WRITE)
            if write is not None and write.before is None and n in needed:
                self._tangent(n)
            elif write is not None:
                before = written_before(n)
                if before is not None and self.tan.get(before) is not None:
                    self.tan[n] = self.tan[before]
            return
        elif n in needed:
            self._tangent(n)

    def _function_tangent(self, call: FunctionCall) -> None:
        """The tangents of a custom Function call's outputs, from its own ``jvp``
        (:func:`graphflop.ad.functions.emit_tangent`); a gap where it has none."""
        if call.record.reason is None and call.record.jvp is None and self.for_transpose:
            self.opaque.append(call.record.name)
        _, gap = emit_tangent(self.b, call, self.env, self.tan, self.for_transpose)
        if gap is not None:
            if is_strict():
                raise MissingRuleError(
                    f"{gap.op} at {gap.node} has no jvp: give the class a jvp staticmethod"
                )
            self.gaps.append(gap)

    def _tangent(self, n: Node) -> None:
        """Emit the tangent of forward node ``n`` with its JVP rule (nothing for a symbolic
        zero; ghosts where every input tangent is one)."""
        if n.target is operator.getitem:
            parent = self.tan.get(n.args[0])  # type: ignore[arg-type]
            if isinstance(parent, (tuple, list)):
                t = parent[n.args[1]]  # type: ignore[index]
                if t is not None and _is_float(n.meta.get("val")):
                    self.tan[n] = t
            return
        arg_t = [_tangent_of(a, self.tan) for a in n.args]
        flat_t = [t for t in _flatten(arg_t) if t is not None]
        if not flat_t:
            return
        try:
            if n in self.cut:
                raise MissingRuleError(
                    f"{op_name(n.target)} at {n.name} writes in place into a tensor read "
                    "afterwards through another alias: graphflop cannot follow its derivative"
                )
            rule = lookup(n.target, need=("jvp",), node=n.name)
            if rule.zero_derivative or rule.jvp is None:
                return
            args = tuple(_map(a, self.env) for a in n.args)
            kwargs = {k: _map(v, self.env) for k, v in n.kwargs.items()}
            with self.b.context(
                source=n.name,
                module=n.meta.get(MODULE, ""),
                param_derived=n.meta.get(PARAM_DERIVED, False),
                ghost=all(is_ghost(t) for t in flat_t),
            ):
                # a rule may also refuse some arguments (MissingRuleError) before emitting
                t = rule.jvp(self.b, self.env[n], args, arg_t, kwargs)
        except MissingRuleError:
            if is_strict():
                raise
            self.gaps.append(Gap(op_name(n.target), n.name, n.meta.get(MODULE, ""), "jvp"))
            return  # the tangent is cut here: what depends on it is not built
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and not _is_float(val):
            t = None
        if t is not None:
            self.tan[n] = t

    def output_tangent(self, d: Node) -> Any:
        """The tangent of differentiated output ``d``: zeros where it is a symbolic zero or a
        ghost (the graph returns a tensor for each)."""
        t = self.tan.get(d)
        if t is None or is_ghost(t):
            with self.b.context(
                source=d.name,
                module=d.meta.get(MODULE, ""),
                param_derived=d.meta.get(PARAM_DERIVED, False),
                ghost=False,
            ):
                t = self.b.zeros_like(self.env[d])
        return t


def _tangent_of(a: Any, tan: dict) -> Any:
    if isinstance(a, Node):
        return tan.get(a)
    if isinstance(a, (list, tuple)):
        ts = [_tangent_of(x, tan) for x in a]
        return ts if any(t is not None for t in ts) else None
    return None


def _flatten(ts: list[Any]) -> Iterator[Any]:
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
