"""Reverse mode = linearize + transpose (the JAX design).

``build_vjp(forward)`` linearizes the forward graph with :func:`~graphflop.ad.jvp.build_jvp`
(tangents on the parameters, and on the inputs when their gradients are asked for), then walks
the tangent nodes in reverse order and applies each op's transpose rule, emitting an explicit
backward ``fx.GraphModule``:

* placeholders: the residuals it reads (forward values; parameters too, marked as such), then
  the loss cotangent ``ct_loss``;
* outputs: one gradient per parameter (then per input, when asked).

Coefficients that derivative rules compute from primals (ReLU's mask, ``1 - tanh²``) are
recomputed in the backward graph from the residuals, so the forward graph stays the model's own
forward. Cotangents flowing into several uses are summed (role ``grad_accum``). Cotangents
nothing needs are never emitted: the tangents they would transpose are ghosts, and transposing a
ghost records what the pruned backward work would have cost (``gm.meta[GHOSTS]``, role
``grad_input`` for the first layer's missing input gradient).

The model's own ``torch.utils.checkpoint`` regions (forward nodes tagged
:data:`~graphflop.meta.CHECKPOINT`) are differentiated as eager PyTorch runs them: the backward
of a region's nodes reads no residual from inside the region but a copy of the region's forward
re-emitted in the backward (role ``recompute``) just before the first of them, from the
region's inputs; a region that stops early (``use_reentrant=False``, the default) keeps its
recompute up to the last value the backward reads, one that does not (reentrant) keeps all of
it. Random ops are not rerun: their outputs stay residuals (eager replays the generator state).

Writes on backward nodes: ``KIND="cotangent"`` (``coef`` for recomputed coefficients and
forward nodes), ``ROLE`` (``grad_input``, ``grad_weight``, ``grad_accum``, ``loss``,
``recompute``), ``SOURCE``,
``MODULE``; on residual placeholders ``KIND="primal"`` and ``RESIDUAL`` (``param``,
``buffer``, ``input``, ``target`` or ``activation``); ``gm.meta[VJP]`` (:class:`VjpInfo`).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from graphflop.ad import functions
from graphflop.ad.blocks import (
    RecordedCalls,
    RecordedFallback,
    checkpoint_calls,
    transpose_log,
)
from graphflop.ad.blocks import (
    residual_meta as _residual_meta,
)
from graphflop.ad.builder import Builder, emit, placeholder
from graphflop.ad.jvp import build_jvp, has_leaves
from graphflop.ad.simplify import fold_transposed_matmuls
from graphflop.meta import (
    CHECKPOINT,
    DERIVED_HIERARCHY,
    GAPS,
    GHOST_LINKS,
    GHOSTS,
    JVP,
    JVP_LOG,
    KIND,
    LINEARIZED,
    MODULE,
    PARAM,
    PARAM_DERIVED,
    RESIDUAL,
    ROLE,
    SIGNATURE,
    SOURCE,
    VJP,
    Gap,
    GhostLinks,
    Signature,
    VjpInfo,
    fake_mode_of,
    graph_module,
    graphflop_meta,
)
from graphflop.ops import MissingRuleError, is_strict, lookup, op_name
from graphflop.ops.cost import value_of
from graphflop.ops.ghost import GhostValue, is_ghost


class TransposeBuilder(Builder):
    """Emits into the backward graph; imports linearized-graph values it reads as residual
    placeholders (primals) or recomputed copies (coefficients)."""

    active_kind = "cotangent"

    def __init__(
        self,
        graph: Graph,
        fake_mode,
        ghosts,
        sig: Signature,
        lin: GraphModule,
        forward: GraphModule | None = None,
    ):
        super().__init__(graph, fake_mode, ghosts)
        self.sig = sig
        #: a :class:`graphflop.passes.calls.DirectRecorder` (``build_vjp``'s), or None
        self.recorder: Any = None
        #: transposing a recorded JVP: its calls (:class:`graphflop.ad.blocks.RecordedCalls`)
        self.calls: RecordedCalls | None = None
        self.imported: dict[Any, Node] = {}
        self.checkpoints = _Checkpoints(forward, lin) if forward is not None else None
        self.residual_order: list[tuple[str, str, str]] = []
        self._last_placeholder: Node | None = None
        self._kinds = {p: "param" for p, _ in sig.params}
        self._kinds.update({b_: "buffer" for b_, _ in sig.buffers})
        self._kinds.update({i: "input" for i in sig.inputs})
        self._kinds.update({t: "target" for t in sig.targets})

    def placeholder(self, name: str, meta: dict) -> Node:
        if self._last_placeholder is None:
            first = next(iter(self.graph.nodes), None)
            ctx = self.graph.inserting_before(first) if first is not None else None
        else:
            ctx = self.graph.inserting_after(self._last_placeholder)
        if ctx is None:
            node = placeholder(self.graph, name)
        else:
            with ctx:
                node = placeholder(self.graph, name)
        node.meta.update(meta)
        self._last_placeholder = node
        return node

    def import_arg(self, a: Any) -> Any:
        if not isinstance(a, Node) or a.graph is self.graph:
            return a
        kind = a.meta.get(KIND)
        if kind == "primal" and self.checkpoints is not None:
            inside = self.checkpoints.read(self, a)
            if inside is not None:
                return inside
        return self._import(a, kind)

    def _import(self, a: Any, kind: Any) -> Any:
        """The backward graph's node for the linearized graph's value ``a`` (a node, or a
        recorded call's ``(repeat node, position)`` with no node made for it:
        :meth:`graphflop.ad.blocks.RecordedCalls.lookup`)."""
        name, m = "", None
        if type(a) is tuple:
            assert self.calls is not None
            if a not in self.imported:
                if kind != "primal":
                    raise RecordedFallback(self.calls.annotations(*a)[0])
                name, m = self.calls.annotations(*a)
        elif self.calls is not None:  # one node per value of a recorded JVP's call
            a = self.calls.canon(a)
            if kind == "coef" and a in self.calls.thin and a not in self.imported:
                raise RecordedFallback(a.name)
        if a in self.imported:
            return self.imported[a]
        if kind == "primal":
            if m is None:
                name, m = a.name, a.meta
            src = m.get(SOURCE, name)
            rkind = self._kinds.get(src) or (
                "param_derived" if m.get(PARAM_DERIVED) else "activation"
            )
            meta = _residual_meta(m)
            meta[RESIDUAL] = rkind
            ph = self.placeholder(src, meta)
            self.residual_order.append((ph.name, src, rkind))
            self.imported[a] = ph
            return ph
        if kind == "coef":
            args = tuple(self._import_tree(x) for x in a.args)
            kwargs = {k: self._import_tree(v) for k, v in a.kwargs.items()}
            target = a.target
            assert callable(target), a.format_node()  # coefficients are call_function nodes
            node = emit(self.graph, target, args, kwargs)
            node.meta.update(graphflop_meta(a.meta))
            node.meta["val"] = a.meta["val"]
            node.meta[KIND] = "coef"
            role = self.ctx.role
            node.meta[ROLE] = role if role != "grad_accum" else "grad_input"
            self.imported[a] = node
            return node
        raise ValueError(f"backward graph cannot read {a.format_node()} (kind {kind})")

    def _import_tree(self, x):
        if isinstance(x, (list, tuple)):
            return type(x)(self._import_tree(y) for y in x)
        return self.import_arg(x)


def _is_linear(a: Any) -> bool:
    if is_ghost(a):  # a skipped tangent is linear; a skipped coefficient is not
        return a.kind == "tangent"
    return isinstance(a, Node) and a.meta.get(KIND) == "tangent"


def build_vjp(
    forward: GraphModule,
    *,
    input_grads: bool = False,
    linearized: GraphModule | None = None,
    per_template: bool = True,
    recorder: Any = None,
) -> GraphModule:
    """Build the backward graph of a traced forward graph (see the module docstring).

    Args:
        forward: a graph from :func:`graphflop.frontend.trace.trace` with a loss.
        input_grads: also return the cotangents of the model's inputs.
        linearized: the JVP graph of ``forward`` to transpose, when already built (tangents on
            the parameters, and on the inputs too for ``input_grads``); built here otherwise.
            A recorded JVP hierarchy's top level (``recorder``) is transposed call by call
            from its repeat nodes (:class:`graphflop.ad.blocks.RecordedCalls`), or expanded
            first (:func:`graphflop.passes.calls.expand_jvp`) where it cannot be (checkpointed
            blocks); one cut at a custom Function without ``jvp`` is linearized again through
            the Function (recorded, with ``recorder``).
        per_template: transpose each repeated block's call once per variant and expand it at
            its other calls (:mod:`graphflop.ad.blocks`; the same graph node for node as
            ``False``, which runs the rules at every call).
        recorder: with ``per_template``, a :class:`graphflop.passes.calls.DirectRecorder` of
            ``forward``: the graph returned is then the top level of the backward's hierarchy
            (``gm.meta[DERIVED_HIERARCHY]``; each expanded call, and each variant's first call,
            one ``graphflop::repeat`` node; the clean-ups run per template derivative), and
            ``calls.expand`` of it the flat backward, node for node the one built without it.
            Where that cannot be shown (a fold across a call's boundary, checkpointed work, a
            parameter's gradient named at one call of a template and not another) the flat
            graph is built instead, without the hierarchy.

    Returns:
        The backward GraphModule; ``gm.meta[LINEARIZED]`` holds the JVP graph it was
        transposed from.

    Raises:
        MissingRuleError: for a tangent op with no transpose rule, inside
            :func:`graphflop.ops.strict_rules` (otherwise the cotangent stops there and the node
            is listed in ``gm.meta[GAPS]``, with the linearization's own gaps).
        ValueError: when the forward graph has no loss.
    """
    sig: Signature = forward.meta[SIGNATURE]
    if sig.loss is None:
        raise ValueError("the forward graph has no loss: trace with loss='sum' or another loss")
    if linearized is not None:
        _check_linearizes(forward, linearized)
        if has_leaves(forward) and not linearized.meta[JVP].leaf_tangents:
            linearized = None  # without the leaves' tangents: not the one eager transposes
    lin = linearized
    tangents = "all" if input_grads else "params"
    dh = lin.meta.get(DERIVED_HIERARCHY) if lin is not None else None
    if dh is not None and dh.graph is lin and _cut(lin) and per_template and recorder is not None:
        # a custom Function without jvp cuts the recorded JVP: record a linearization that
        # goes through it (its own backward is the transpose) and transpose that
        lin = build_jvp(
            forward, tangents, for_transpose=True, recorder=type(recorder)(forward), leaves=True
        )
        dh = lin.meta.get(DERIVED_HIERARCHY)
    checkpointed = bool(checkpoint_calls(forward))
    if checkpointed:
        # the recompute eager runs is kept through dead-code elimination, which the recorded
        # graph's clean-up does not do per call (DirectRecorder.clean): built flat at once,
        # not recorded first and then built again
        recorder = None
    if dh is not None and dh.graph is lin:  # a recorded JVP
        if per_template and dh.log is not None and not (checkpointed or _cut(lin)):
            try:  # each call's residuals and cotangents read from its repeat node
                return _build_vjp(forward, sig, lin, input_grads, per_template, recorder, dh)
            except RecordedFallback:
                recorder = type(recorder)(forward) if recorder is not None else None
        lin = dh.expand_jvp(lin)  # its flat graph, transposed as built flat
    if lin is None or _cut(lin):
        # a custom Function without jvp cuts the JVP graph: transpose a linearization that
        # goes through it instead (its own backward is the transpose)
        lin = build_jvp(
            forward, tangents, for_transpose=True, per_template=per_template, leaves=True
        )
    return _build_vjp(forward, sig, lin, input_grads, per_template, recorder, None)


def _cut(lin: GraphModule) -> bool:
    """Whether the JVP graph ``lin`` is cut at a custom Function without ``jvp`` (a gap
    naming it)."""
    return any(g.op.startswith(functions.LABEL) for g in lin.meta.get(GAPS, ()))


def _check_linearizes(forward: GraphModule, lin: GraphModule) -> None:
    """Raise ``ValueError`` unless ``lin`` is a JVP graph of ``forward``: each of
    ``forward``'s placeholders (parameters, buffers, inputs) a placeholder of ``lin`` of the
    same name, shape and dtype. Another model's JVP used to be transposed into a backward of
    the wrong shapes without a word."""
    mine = {n.name: n.meta.get("val") for n in lin.graph.find_nodes(op="placeholder")}
    for n in forward.graph.find_nodes(op="placeholder"):  # in graph order
        v, w = n.meta.get("val"), mine.get(n.name, None)
        same = (
            n.name in mine
            and isinstance(v, torch.Tensor) == isinstance(w, torch.Tensor)
            and (
                not isinstance(v, torch.Tensor)
                or (isinstance(w, torch.Tensor) and (v.shape, v.dtype) == (w.shape, w.dtype))
            )
        )
        if not same:
            got = (
                f"{tuple(w.shape)} {w.dtype}"
                if isinstance(w, torch.Tensor)
                else "none"
                if n.name not in mine
                else type(w).__name__
            )
            want = (
                f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
            )
            raise ValueError(
                f"linearized is not a JVP graph of this forward graph: its input {n.name!r} "
                f"is {got}, the forward's is {want}; build it with build_jvp(forward)"
            )


def _build_vjp(
    forward: GraphModule,
    sig: Signature,
    lin: GraphModule,
    input_grads: bool,
    per_template: bool,
    recorder: Any,
    recorded: Any,
) -> GraphModule:
    """:func:`build_vjp` of ``lin`` (``recorded``: its hierarchy, where ``lin`` is a recorded
    JVP's top level: the log is the hierarchy's whole log, a call's entries ``(repeat node,
    position)``; raises :class:`RecordedFallback` where it cannot be transposed so)."""
    info = lin.meta[JVP]
    out_node = next(n for n in reversed(lin.graph.nodes) if n.op == "output")
    loss_tangent = out_node.args[0][info.primal_outputs]

    g = Graph()
    ghosts: list = []
    fake_mode = fake_mode_of(n.meta.get("val") for n in lin.graph.nodes if "val" in n.meta)
    b = TransposeBuilder(g, fake_mode, ghosts, sig, lin, forward)
    b.recorder = recorder if per_template else None
    if recorded is not None:
        b.calls = RecordedCalls(recorded)
        b.calls.imported = b.imported
    # from the end, where the loss is (names are unique: the same node)
    loss_node = next(n for n in reversed(forward.graph.nodes) if n.name == sig.loss)
    ct_loss = b.placeholder(
        "ct_loss",
        {
            "val": loss_node.meta["val"],
            KIND: "cotangent",
            ROLE: "loss",
            SOURCE: sig.loss,
            MODULE: "loss",
        },
    )
    ct: dict[Any, Any] = {_key(loss_tangent): ct_loss}
    gaps: list[Gap] = list(lin.meta.get(GAPS, ()))  # the linearization's cuts cut this too
    links: Any = lin.meta.get(GHOST_LINKS) or GhostLinks()
    if b.calls is not None:  # a call's node made flat: its getitem's links
        links = _CanonLinks(links, b.calls)
    terms = _GhostTerms(links)  # one for the whole log, however many calls of the rules

    def rules(entries: list[Any]) -> None:
        _transpose_entries(b, entries, ct, terms, gaps)

    log = _log_of(lin, recorded, per_template)
    if per_template:
        linked = lambda e: bool(links.get(e))  # noqa: E731
        transpose_log(forward, b, log, ct, rules, linked, lambda: (len(ghosts), len(gaps)))
    else:
        rules(log)

    if b.checkpoints is not None:
        gaps.extend(b.checkpoints.unmodelled())
    outputs: list[Node] = []
    named: list[tuple[Node, str]] = []  # with a recorder: parameter gradients of calls
    grads: list[tuple[int, str]] = []
    in_grads: list[tuple[int, str]] = []
    placeholders = {n.name: n for n in lin.graph.find_nodes(op="placeholder")}
    for t_name, p_name in info.tangent_inputs:
        t_node = placeholders[t_name]
        g_val = ct.get(t_node)
        if g_val is None or is_ghost(g_val):
            with b.context(source=p_name, module="", role="grad_weight", ghost=False):
                g_val = b.zeros_like(t_node)
        if PARAM in t_node.meta:
            grads.append((len(outputs), t_node.meta[PARAM]))
            if b.recorder is not None and PARAM not in g_val.meta and b.recorder.inside(g_val):
                named.append((g_val, t_node.meta[PARAM]))  # a call's node: its template's
            else:
                g_val.meta.setdefault(PARAM, t_node.meta[PARAM])
        else:
            in_grads.append((len(outputs), p_name))
        outputs.append(g_val)
    leaf_grads: list[tuple[int, str]] = []
    for t_name, n_name in info.leaf_tangents:  # eager stores them in the leaves' .grad
        t_node = placeholders[t_name]
        g_val = ct.get(t_node)
        if g_val is None or is_ghost(g_val):
            with b.context(source=n_name, module="", role="grad_input", ghost=False):
                g_val = b.zeros_like(t_node)
        leaf_grads.append((len(outputs), n_name))
        outputs.append(g_val)
    g.output(tuple(outputs))
    if b.recorder is not None:
        moved = b.recorder.finish(g, [n for n, _ in named])
        kept = b.checkpoints.kept() if b.checkpoints and b.checkpoints.emitted else None
        named = [(moved.get(n, n), p) for n, p in named]
        if not b.recorder.name(named) or not b.recorder.clean(g, kept):
            return build_vjp(
                forward, input_grads=input_grads, linearized=lin, per_template=per_template
            )
        gm = graph_module(torch.nn.Module(), g)
        dh = b.recorder.hierarchy(gm)
        if dh is not None:
            gm.meta[DERIVED_HIERARCHY] = dh
    else:
        g.eliminate_dead_code(is_impure_node=b.checkpoints.kept() if b.checkpoints else None)
        gm = fold_transposed_matmuls(graph_module(torch.nn.Module(), g))
    gm.meta[SIGNATURE] = sig
    gm.meta[GHOSTS] = ghosts
    gm.meta[LINEARIZED] = lin
    gm.meta[GAPS] = tuple(gaps)
    kept = {n.name for n in g.nodes}
    gm.meta[VJP] = VjpInfo(
        tuple(r for r in b.residual_order if r[0] in kept),
        ct_loss.name,
        tuple(grads),
        tuple(in_grads),
        tuple(leaf_grads),
    )
    return gm


def _log_of(lin: GraphModule, recorded: Any, per_template: bool) -> Any:
    """The JVP log ``lin`` is transposed by, in the order transposed; a recorded JVP's whole
    log (a :class:`~graphflop.passes.calls.CallLog`) as it is with ``per_template``:
    :func:`~graphflop.ad.blocks.transpose_log` reads it in reverse, a call's run at a time."""
    if recorded is None:
        return list(reversed(lin.meta[JVP_LOG]))
    if per_template and hasattr(recorded.log, "_parts"):
        return recorded.log
    return list(reversed(recorded.log))


class _CanonLinks:
    """A recorded JVP's ghost links read through :meth:`RecordedCalls.canon` (a call's node
    made flat has its getitem's)."""

    def __init__(self, links: GhostLinks, calls: RecordedCalls) -> None:
        self.links, self.calls = links, calls

    def get(self, node: Any, default: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        if node is None:
            return default
        got = self.links.get(node)
        return got if got else self.links.get(self.calls.canon(node), default)

    def items(self) -> Any:
        """The (real node, ghosts) pairs, each real node read through ``canon``."""
        return ((self.calls.canon(n), gs) for n, gs in self.links.items())


class _GhostTerms:
    """The ghost terms tangent sums dropped into real tangents (the JVP graph's
    :data:`~graphflop.meta.GHOST_LINKS`, read through ``links``), and which of them have been
    transposed, over one whole transpose: the log is transposed in many calls of
    :func:`_transpose_entries` where it has call sites (an entry, a call's run, at a time).

    A ghost ``g`` dropped into a real tangent ``r`` (the sum is emitted as ``r``) would have
    received the sum's cotangent, summed back to ``g``'s shape where the sum broadcast it. It
    takes it where ``r``'s cotangent is complete and ``g`` is not transposed yet:

    * ``r`` logged after ``g`` (``x.mean(0) + fc(x)``: the sum is the addmm's tangent, made
      after the mean's ghost): at ``r``'s entry, reached first;
    * ``r`` logged before ``g`` (``fc(x) + x.mean(0)``): at ``g``'s own entry, reached first;
      ``r``'s cotangent is complete by then (every reader of the sum comes later in the log).

    Each link is credited once, whichever entry comes first (the state lives here, not in one
    call of the rules: a link credited at ``g``'s entry in one call was credited again at
    ``r``'s in the next, 32 FLOPs of pruned sum too many behind a LayerNorm); a ghost dropped
    into several sums, or also read by other ghost work, takes the sum of its cotangents, as
    eager accumulates a gradient (role ``grad_accum``)."""

    def __init__(self, links: Any) -> None:
        self.links = links
        self._owners: dict[int, list[Any]] | None = None
        self._done: set[int] = set()  # ghosts transposed (their cotangent taken)

    def at_real(self, b: TransposeBuilder, entry: Node, c: Any, ct: dict[Any, Any]) -> None:
        """Credit the ghosts dropped into ``entry`` (cotangent ``c``) not transposed yet."""
        for gh in self.links.get(entry):
            if id(gh) not in self._done:
                _credit(b, gh, c, ct)

    def at_ghost(self, b: TransposeBuilder, gh: GhostValue, ct: dict[Any, Any]) -> None:
        """Before ghost ``gh``'s entry takes its cotangent: credit it with the cotangent of
        each real tangent it was dropped into that is still to be transposed (logged before
        it); then it is transposed."""
        if self._owners is None:
            self._owners = {}
            for real, gs in self.links.items():
                for g in gs:
                    self._owners.setdefault(id(g), []).append(real)
        for real in self._owners.get(id(gh), ()):
            c = ct.get(_key(real))
            if c is not None:
                _credit(b, gh, c, ct)
        self._done.add(id(gh))


def _credit(b: TransposeBuilder, gh: GhostValue, c: Any, ct: dict[Any, Any]) -> None:
    """Add the cotangent ``c`` of a sum ``gh`` was dropped into, summed back to ``gh``'s shape
    where the sum broadcast it (x.mean(0) + fc(x): [4, 8] to [8]), into ``gh``'s cotangent:
    ghost work of the op that made ``gh`` (of the model's root for a ghost input, which no op
    made)."""
    rec = gh.record
    source, module = (rec.source, rec.module) if rec is not None else ("", "")
    with b.context(source=source, module=module, role="grad_input", ghost=True):
        shape = tuple(value_of(gh).shape)
        g = b.as_ghost(c)
        have = tuple(value_of(g).shape)
        if have != shape:
            # the real tangent was the smaller operand (x + fc(x), fc(x): [2, 1]): its
            # cotangent is already summed over the dims it broadcast; the ghost's, of the
            # sum's shape, is as large (its work counted by shape: the values are never run)
            wide = list(torch.broadcast_shapes(have, shape))
            if list(have) != wide:
                g = b.call(torch.ops.aten.expand.default, g, wide)
        out = b.sum_to(g, shape)
        prev = ct.get(_key(gh))
        if prev is not None:
            with b.context(role="grad_accum"):
                out = b.call(torch.ops.aten.add.Tensor, prev, out)
    ct[_key(gh)] = out


def _transpose_entries(
    b: TransposeBuilder, entries: list[Any], ct: dict[Any, Any], terms: _GhostTerms, gaps: list[Gap]
) -> None:
    """Transpose the JVP-log ``entries`` (in the order transposed) with their rules, updating
    the cotangents ``ct``; a rule-less op's entry is a gap (an error under strict rules).
    ``terms`` credits the ghost terms tangent sums skipped (:class:`_GhostTerms`)."""
    for entry in entries:
        if is_ghost(entry):
            terms.at_ghost(b, entry, ct)
        if isinstance(entry, functions.FunctionEntry):  # the Function's own backward
            cs = [ct.pop(o, None) if isinstance(o, Node) else None for o in entry.outputs]
            if any(c is not None for c in cs):
                functions.transpose(b, entry, cs, ct)
            continue
        c = ct.pop(_key(entry), None)
        if c is None:
            continue
        if not is_ghost(entry):
            terms.at_real(b, entry, c, ct)
        try:
            _transpose(b, entry, c, ct)
        except MissingRuleError:  # partial results: the cotangent stops here
            if is_strict():
                raise
            gaps.append(_gap(entry))


def _gap(entry: Any) -> Gap:
    """The :class:`Gap` of a JVP-log entry whose op has no transpose rule."""
    if isinstance(entry, Node):
        op, src, mod = entry.target, entry.meta.get(SOURCE, ""), entry.meta.get(MODULE, "")
    else:
        op, src, mod = entry.op, entry.record.source, entry.record.module
    return Gap(op_name(op), src, mod, "transpose")


def _in_dtype_of(b: Builder, out: Any, target: Any) -> Any:
    """``out``, a cotangent of ``target``, in ``target``'s floating dtype: eager autograd casts
    each gradient a node returns to its input's dtype (``validate_outputs``), so a bfloat16
    value whose consumer computed in float32 (a loss's ``_to_copy``) gets a bfloat16 gradient
    (tester's finding: ResNet-18 in bfloat16 stopped in a gather's transpose)."""
    want, got = value_of(target), value_of(out)
    if (
        isinstance(want, torch.Tensor)
        and isinstance(got, torch.Tensor)
        and want.dtype != got.dtype
        and want.is_floating_point()
        and got.is_floating_point()
    ):
        return b.call(torch.ops.aten._to_copy.default, out, dtype=want.dtype)
    return out


def _linear_mask(a: Any) -> Any:
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return [_is_linear(x) for x in a]
    return _is_linear(a)


def _targets(arg: Any, lin: Any):
    """(index within a list argument or None, linear value) pairs of one argument."""
    if isinstance(lin, list):
        return [(j, x) for j, (x, is_lin) in enumerate(zip(arg, lin)) if is_lin]
    return [(None, arg)] if lin else []


def _key(v: Any) -> Any:
    """Cotangents are keyed by node, or by identity for ghosts."""
    return id(v) if is_ghost(v) else v


def _transpose(b: TransposeBuilder, entry: Node | GhostValue, c: Any, ct: dict[Any, Any]) -> None:
    """Apply ``entry``'s transpose rule to its cotangent ``c``, once per linear argument, adding
    each argument's cotangent into ``ct`` (role ``grad_accum`` where one is already there)."""
    if isinstance(entry, Node):
        op, source, module = entry.target, entry.meta.get(SOURCE, ""), entry.meta.get(MODULE, "")
        ghost = False
    elif entry.record is not None:  # a ghost: the transpose of work that was not emitted
        op, source, module = entry.op, entry.record.source, entry.record.module
        ghost = True
    else:
        raise ValueError(f"{entry.name} in the JVP log has no Ghost record")
    args, kwargs = entry.args, entry.kwargs
    if op is operator.getitem:  # a piece of a multi-output op: gather its cotangents by piece
        index = args[1]
        assert isinstance(index, int), entry  # getitem of a multi-output op's result
        _transpose_getitem(b, args[0], index, c, ct, (source, module, ghost))
        return
    rule = lookup(op, need=("transpose",), node=entry.name)
    transpose = rule.transpose
    assert transpose is not None  # lookup checked it
    linear = [_linear_mask(a) for a in args]
    for i, lin_i in enumerate(linear):
        for j, target in _targets(args[i], lin_i):
            one_hot: list[Any] = [
                False if not isinstance(x, list) else [False] * len(x) for x in linear
            ]
            if j is None:
                one_hot[i] = True
            else:
                one_hot[i][j] = True
            target_pd = target.meta.get(PARAM_DERIVED, False)
            role = "loss" if module == "loss" else ("grad_weight" if target_pd else "grad_input")
            forced = ghost or is_ghost(target)
            with b.context(
                source=source, module=module, role=role, param_derived=target_pd, ghost=forced
            ):
                cin = c
                if forced:  # a multi-output op's cotangent is a list with one per output
                    cin = [b.as_ghost(x) for x in c] if isinstance(c, list) else b.as_ghost(c)
                cts = transpose(b, cin, args, kwargs, one_hot)
                out = cts[i] if j is None else cts[i][j]
                if out is None:
                    continue
                out = _in_dtype_of(b, out, target)
                prev = ct.get(_key(target))
                if prev is not None:
                    with b.context(role="grad_accum"):
                        out = b.call(torch.ops.aten.add.Tensor, prev, out)
                ct[_key(target)] = out


def _transpose_getitem(
    b: TransposeBuilder,
    multi: Any,
    i: int,
    c: Any,
    ct: dict[Any, Any],
    where: tuple[str, str, bool],
) -> None:
    """File cotangent ``c`` of output ``i`` of the multi-output tangent ``multi`` in slot ``i``
    of ``multi``'s cotangent, a list with one entry per output (``None`` for outputs with none),
    which ``multi``'s own transpose rule then receives whole."""
    slots = ct.get(_key(multi))
    if slots is None:
        outputs = multi.val if is_ghost(multi) else multi.meta["val"]
        slots = ct[_key(multi)] = [None] * len(outputs)
    if slots[i] is not None:
        source, module, ghost = where
        with b.context(source=source, module=module, role="grad_accum", ghost=ghost):
            c = b.call(torch.ops.aten.add.Tensor, slots[i], c)
    slots[i] = c


class _Checkpoints:
    """The forward's ``torch.utils.checkpoint`` calls (:data:`~graphflop.meta.CHECKPOINT`) and
    their recompute in the backward graph being built.

    A rule of a node inside a call that reads a value of that call reads the call's recompute
    instead of a residual; the recompute (every node of the call, random ops excepted, in
    forward order, role ``recompute``) is emitted on the first read a rule of the call makes,
    reading the call's inputs, parameters and random outputs as residuals. :meth:`kept` says
    which recompute nodes dead-code elimination must keep although nothing reads them: eager
    reruns a call in order up to the last value its backward unpacks (early stop), or whole."""

    def __init__(self, forward: GraphModule, lin: GraphModule) -> None:
        occ = checkpoint_calls(forward)  # shared: read only
        self.call_of = {n.name: c for n, c in occ.items()}
        self.nodes: dict[int, list[Node]] = {}
        for n, c in occ.items():
            self.nodes.setdefault(c, []).append(n)
        self.whole = {c: ns[0].meta[CHECKPOINT].whole for c, ns in self.nodes.items()}
        self.lin: dict[str, Node] = {}
        if occ:
            for n in lin.graph.nodes:
                if n.meta.get(KIND) == "primal":
                    self.lin.setdefault(n.meta.get(SOURCE, n.name), n)
        self.copies: dict[int, dict[str, Any]] = {}
        self.emitted: dict[int, list[Node]] = {}

    def read(self, b: TransposeBuilder, a: Node) -> Any:
        """The value a rule (the builder's context: the forward node it is for) reads for
        primal ``a``: the recompute's copy when both lie in one checkpoint call, else None (a
        residual). A rule inside a call makes the call's recompute emitted first."""
        call = self.call_of.get(b.ctx.source)
        if call is None:
            return None
        copies = self._recompute(b, call)
        return copies.get(a.meta.get(SOURCE, a.name))

    def _recompute(self, b: TransposeBuilder, call: int) -> dict[str, Any]:
        if call in self.copies:
            return self.copies[call]
        copies: dict[str, Any] = {}
        self.copies[call] = copies
        made: list[Node] = []

        def arg(x: Node) -> Any:
            if x.name in copies:
                return copies[x.name]
            return b._import(self.lin[x.name], KIND_PRIMAL)

        for f in self.nodes[call]:
            if f.op != "call_function" or f.name not in self.lin:
                continue
            tags = getattr(f.target, "tags", ())
            if torch.Tag.nondeterministic_seeded in tags:  # the forward's random draw
                copies[f.name] = b._import(self.lin[f.name], KIND_PRIMAL)
                continue
            node = emit(b.graph, f.target, map_arg(f.args, arg), map_arg(f.kwargs, arg))
            node.meta["val"] = f.meta.get("val")
            node.meta[KIND] = "coef"
            node.meta[ROLE] = "recompute"
            node.meta[SOURCE] = f.name
            node.meta[MODULE] = f.meta.get(MODULE, "")
            node.meta[PARAM_DERIVED] = f.meta.get(PARAM_DERIVED, False)
            copies[f.name] = node
            made.append(node)
        self.emitted[call] = made
        return copies

    def unmodelled(self) -> list[Gap]:
        """One :class:`Gap` (kind ``recompute``) per call whose recompute graphflop does not
        model as eager runs it, the reason as its ``op``."""
        gaps: list[Gap] = []
        for ns in self.nodes.values():
            why = next((u for n in ns if (u := n.meta[CHECKPOINT].unmodelled)), "")
            if why:
                paths = [n.meta[MODULE].split(".") for n in ns if n.meta.get(MODULE)]
                shared = itertools.takewhile(lambda p: len(set(p)) == 1, zip(*paths))
                module = ".".join(p[0] for p in shared)  # the module the call ran
                gaps.append(Gap(why, ns[0].name, module, "recompute"))
        return gaps

    def emitted_copy(self, node: Node) -> None:
        """Take ``node``, a recompute node copied from a call's template backward (its
        :data:`SOURCE` the call's forward node), as its checkpoint call's recompute, as if
        :meth:`read` had emitted it: kept by :meth:`kept` as eager runs it, and read by the
        call's later rules."""
        src = node.meta[SOURCE]
        call = self.call_of[src]
        self.copies.setdefault(call, {})[src] = node
        self.emitted.setdefault(call, []).append(node)

    def kept(self):
        """``is_impure_node`` for dead-code elimination of the finished backward graph: the
        recompute nodes eager runs (each call's whole recompute, or, with early stop, its
        nodes up to the last one something else reads)."""
        keep: set[Node] = set()
        for call, made in self.emitted.items():
            if self.whole[call]:
                keep.update(made)
                continue
            live = _live(made)
            last = max((i for i, n in enumerate(made) if n in live), default=-1)
            keep.update(made[: last + 1])
        return lambda n: n in keep or n.is_impure()


KIND_PRIMAL = "primal"


def _live(made: list[Node]) -> set[Node]:
    """The nodes of ``made`` whose value reaches the graph's output other than through a
    recompute node nothing reads."""
    inside = set(made)
    live: set[Node] = set()
    for n in reversed(made):
        if any(u not in inside or u in live for u in n.users):
            live.add(n)
    return live
