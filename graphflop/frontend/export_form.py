"""graphflop's form of a traced forward graph, from ``make_fx``'s graph or a ``torch.export``
program.

Placeholders are named and classified as ``torch.export`` does (``p_model_*`` parameters,
``b_model_*`` buffers, ``args_i`` inputs and loss targets; constants made in forward become fixed
buffers), buffer writes become outputs, every output of a multi-output op gets a ``getitem`` node,
and every node is tagged.

Writes on each node: ``KIND="primal"``, ``ROLE`` (``forward`` or ``loss``), ``SOURCE``,
``MODULE`` (the ``nn.Module`` path, from ``nn_module_stack``), ``PARAM_DERIVED``; on parameter
placeholders ``PARAM``; on new ``getitem`` nodes ``val``. Writes ``gm.meta[SIGNATURE]``,
``gm.meta[CONSTANTS]``, ``gm.meta[LOSS_KIND]`` and ``gm.meta[FACTS] = {"traced"}``.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch
from torch.fx import GraphModule, Node

from graphflop.ad.builder import copy_node
from graphflop.ad.builder import placeholder as new_placeholder
from graphflop.frontend.composite import getitem_tag
from graphflop.frontend.errors import TraceError, first_line
from graphflop.frontend.scopes import module_path
from graphflop.io import sanitize_name
from graphflop.meta import (
    COMPOSITE,
    CONSTANTS,
    FACTS,
    FUNCTION,
    KIND,
    LEAF,
    LOSS_KIND,
    MODULE,
    PARAM,
    PARAM_DERIVED,
    ROLE,
    SIGNATURE,
    SOURCE,
    UNUSED,
    NodeCost,
    Signature,
    graph_module,
)
from graphflop.ops import MissingRuleError, decomposition_table
from graphflop.ops.recurrent import functionalize_inplace

aten = torch.ops.aten


def from_exported(
    ep: torch.export.ExportedProgram, *, loss_output: int | None = 0, loss_kind: str = "output"
) -> GraphModule:
    """A graphflop forward graph from a user's ``torch.export`` program.

    The program is decomposed to the same core-ATen set as :func:`trace` and its placeholders
    classified (parameters, buffers, inputs). ``loss_output`` names the user output that is the
    scalar loss the backward starts from (``None``: no loss; only forward and JVP graphs then).

    Raises:
        TraceError: when the program cannot be decomposed or the loss output is not a scalar.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = ep.run_decompositions(decomposition_table())
    except Exception as e:
        raise TraceError(f"decomposing the exported program failed: {first_line(e)}") from e
    n_user = sum(1 for s_ in ep.graph_signature.input_specs if s_.kind.name == "USER_INPUT")
    gm = _to_graph(ep, n_inputs=n_user, loss_index=loss_output, loss_kind=loss_kind, wrapped=False)
    sig = gm.meta[SIGNATURE]
    if sig.loss is not None:
        val = next(n for n in gm.graph.nodes if n.name == sig.loss).meta["val"]
        if val.numel() != 1:
            raise TraceError(
                f"output {loss_output} is not a scalar loss (shape "
                f"{tuple(val.shape)}); pass loss_output=None or the loss's index"
            )
    return gm


def _to_graph(
    ep: torch.export.ExportedProgram,
    *,
    n_inputs: int,
    loss_index: int | None,
    loss_kind: str,
    wrapped: bool,
) -> GraphModule:
    """An exported program's graph in graphflop's form: placeholders classified from the
    program's signature (the first ``n_inputs`` user inputs are the model's, the rest loss
    targets), user output ``loss_index`` the loss."""
    prefix = "model." if wrapped else ""
    gm = ep.graph_module
    sig = ep.graph_signature
    params, buffers, user_inputs = [], [], []
    constants: dict[str, torch.Tensor] = {}
    for spec in sig.input_specs:
        kind = spec.kind.name
        name = spec.arg.name
        if kind == "PARAMETER":
            params.append((name, spec.target.removeprefix(prefix)))
        elif kind == "BUFFER":
            buffers.append((name, spec.target.removeprefix(prefix)))
        elif kind == "USER_INPUT":
            user_inputs.append(name)
        elif kind == "CONSTANT_TENSOR":  # torch.tensor(...) made in forward: a fixed buffer
            buffers.append((name, spec.target.removeprefix(prefix)))
            constants[name] = ep.constants[spec.target]
        else:
            raise TraceError(f"unsupported graph input kind {kind} for {name}")
    model_inputs, target_names = user_inputs[:n_inputs], user_inputs[n_inputs:]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_args = list(out_node.args[0])
    buffer_updates, user_outs = [], []
    for spec, a in zip(sig.output_specs, out_args):
        if spec.kind.name == "BUFFER_MUTATION":
            buffer_updates.append((a.name, spec.target.removeprefix(prefix)))
        elif spec.kind.name == "USER_OUTPUT":
            user_outs.append(a)
        else:
            raise TraceError(f"unsupported graph output kind {spec.kind.name}")
    loss_name = user_outs[loss_index].name if loss_index is not None else None
    model_outs = [o for i, o in enumerate(user_outs) if i != loss_index]
    signature = Signature(
        params=tuple(params),
        buffers=tuple(buffers),
        inputs=tuple(model_inputs),
        targets=tuple(target_names),
        loss=loss_name,
        outputs=tuple(n.name for n in model_outs if hasattr(n, "name")),
        buffer_updates=tuple(buffer_updates),
    )
    return _finish(gm, signature, constants, loss_kind, wrapped)


def _finish(
    gm: GraphModule, signature: Signature, constants: dict, loss_kind: str, wrapped: bool
) -> GraphModule:
    """Write the graph keys, complete the ``getitem`` nodes and tag every node."""
    gm.meta[SIGNATURE] = signature
    gm.meta[CONSTANTS] = constants
    gm.meta[LOSS_KIND] = loss_kind
    gm.meta[FACTS] = {"traced"}
    _complete_getitems(gm)
    _tag_nodes(gm, signature, wrapped)
    return gm


def _complete_getitems(gm: GraphModule) -> None:
    """Give every output of a multi-output op a ``getitem`` node, so derivative rules can read
    any of them (max pooling's indices) as an ordinary forward value."""
    for n in list(gm.graph.nodes):
        val = n.meta.get("val")
        if n.op != "call_function" or not isinstance(val, (tuple, list)):
            continue
        have = {u.args[1] for u in n.users if u.target is operator.getitem}
        last = n
        for i, v in enumerate(val):
            if i in have or not isinstance(v, torch.Tensor):
                continue
            with gm.graph.inserting_after(last):
                g = gm.graph.call_function(operator.getitem, (n, i))
            g.meta.update({k: v_ for k, v_ in n.meta.items() if k not in ("val", COMPOSITE)})
            g.meta["val"] = v
            tag = getitem_tag(n, i)
            if tag is not None:
                g.meta[COMPOSITE] = tag
            last = g
    gm.recompile()


def may_be_param_derived(n: torch.fx.Node) -> bool:
    """Whether op node ``n`` is :data:`~graphflop.meta.PARAM_DERIVED` when all its inputs are:
    not a value the model made a leaf that requires grad (a source of derivatives of its own,
    as an input), nor a random draw (timm's DropPath mask, ``bernoulli_`` of an empty tensor:
    new each step, no constant; eager autograd saves it as an activation). The one rule of the
    flat form's tagging and of the direct hierarchy's (:mod:`graphflop.frontend.direct_hierarchy`)."""
    return LEAF not in n.meta and torch.Tag.nondeterministic_seeded not in getattr(
        n.target, "tags", ()
    )


def _tag_nodes(gm: GraphModule, sig: Signature, wrapped: bool = True) -> None:
    """Write ``KIND``, ``SOURCE``, ``MODULE``, ``ROLE``, ``PARAM_DERIVED`` (and ``PARAM``) on
    every node (:func:`tag_node`)."""
    param_names = dict(sig.params)
    constants = set(param_names) | {n for n, _ in sig.buffers}
    for n in gm.graph.nodes:
        path = "" if n.op == "placeholder" else module_path(n, wrapped)
        tag_node(n, n.name, path, n.name in constants, param_names)


def tag_node(
    n: torch.fx.Node, source: str, path: str, fixed: bool, param_names: dict[str, str]
) -> None:
    """The flat form's annotations on ``n``, the node ``source`` of the flat graph in module
    ``path``: ``KIND`` primal, ``SOURCE``, ``MODULE``, ``ROLE`` (``loss`` in the loss's module),
    ``PARAM_DERIVED`` (a placeholder: ``fixed``, a parameter, buffer or constant; an op: its
    inputs all are, :func:`may_be_param_derived`) and, for a parameter's placeholder (named in
    ``param_names``), ``PARAM``. The one tagging of :func:`_tag_nodes` and of the direct
    hierarchy's nodes (:mod:`graphflop.frontend.direct_hierarchy`)."""
    meta = n.meta
    meta[KIND] = "primal"
    meta[SOURCE] = source
    if n.op == "placeholder":
        meta[MODULE] = ""
        meta[ROLE] = "forward"
        meta[PARAM_DERIVED] = fixed
        if n.name in param_names:
            meta[PARAM] = param_names[n.name]
        return
    meta[MODULE] = path
    meta[ROLE] = "loss" if path == "loss" else "forward"
    # an op computed from parameters, buffers and constants only (an embedding lookup at the
    # model's token ids is not; one at arange positions is)
    meta[PARAM_DERIVED] = (
        n.op == "call_function"
        and may_be_param_derived(n)
        and all(a.meta.get(PARAM_DERIVED, False) for a in n.all_input_nodes)
    )


def from_make_fx(
    gm: GraphModule,
    *,
    params: list[str],
    buffers: list[str],
    n_inputs: int,
    loss_kind: str,
    target_nodes: list,
    calls: Any = None,
) -> GraphModule:
    """``make_fx``'s graph in graphflop's form: placeholders named and classified as
    ``torch.export`` does (``p_model_*``, ``b_model_*``, ``args_i``; constants made in forward
    become fixed buffers), the target nodes made inside the trace turned into placeholders, the
    functionalised buffer writes (``copy_`` into a placeholder, or into an ``alias`` of one)
    turned into outputs, reads after a write pointed at the new value.

    ``calls`` (an :class:`~graphflop.frontend.outline.Expansion`, or None) expands the outlined
    calls as they are met, each template node copied once, straight into the new graph.

    Raises:
        TraceError: a write into an input.
    """
    old = gm.graph
    g = torch.fx.Graph()
    env, phs, sig_params, sig_buffers, model_inputs, target_names, constants = placeholders(
        gm, g, params=params, buffers=buffers, n_inputs=n_inputs, target_nodes=target_nodes
    )
    n_p, n_b = len(params), len(buffers)
    out_node = next(n for n in reversed(old.nodes) if n.op == "output")
    index = {env[n]: i for i, n in enumerate(phs)}
    old_index = {n: i for i, n in enumerate(phs)}
    writes: dict = {}
    params_written: dict[str, None] = {}

    def write(args: tuple, into: Any = None) -> Any:
        """A ``copy_`` (arguments in ``g``) into a placeholder, or into an ``alias`` of one
        (instance norm's running statistics), is a buffer write: its new value, which later
        reads see; None for another ``copy_``. ``into``: the ``copy_``'s destination in
        ``old``, where the caller has it (a top-level ``copy_``), told through ``alias`` and
        ``copy_`` nodes (a ``copy_`` returns its destination): a batch norm called twice in
        training mode writes its running statistics into the first call's ``copy_``, whose
        value in ``g`` is the value written then (the second call reads it, as in eager)."""
        target, table = (args[0], index) if into is None else (into, old_index)
        through = (
            (aten.alias.default,) if into is None else (aten.alias.default, aten.copy_.default)
        )
        while isinstance(target, torch.fx.Node) and target.target in through:
            target = target.args[0]
        i = table.get(target)
        if i is None:
            return None
        if i >= n_p + n_b:
            raise TraceError(
                f"the model writes in place into input {i - n_p - n_b}; only buffers and "
                "parameters (under no_grad) may be updated in forward"
            )
        value = args[1]
        if i < n_p:  # a parameter written with grad mode off: later reads see the new value
            params_written.setdefault(params[i], None)
        else:
            writes[buffers[i - n_p]] = value
        env[phs[i]] = value
        return value

    _copy_nodes(old, g, env, calls, write)
    results = [env[a] for a in out_node.args[0]]
    updates = [(v.name, b) for b, v in writes.items()]
    g.output(tuple(list(writes.values()) + results))
    functionalize_inplace(g)  # in-place ops left on temporaries (recurrent layers)
    _fold_regenerated_views(g)
    unused = _eliminate_dead_code(g)
    new = graph_module(torch.nn.Module(), g)
    new.meta[UNUSED] = unused
    # the outputs as the output node names them after those rewrites: a write into a
    # temporary that is an output (circular padding's slice writes into the ``empty`` it
    # returns) made its last functional value the output, not the ``empty``
    final = list(next(n for n in reversed(g.nodes) if n.op == "output").args[0])
    updates = [(v.name, b) for v, (_, b) in zip(final, updates)]
    results = final[len(writes) :]
    has_loss = loss_kind != "none"
    signature = Signature(
        params=tuple(sig_params),
        buffers=tuple(sig_buffers),
        inputs=tuple(model_inputs),
        targets=tuple(target_names),
        loss=results[0].name if has_loss else None,
        outputs=tuple(r.name for r in results[1 if has_loss else 0 :]),
        buffer_updates=tuple(updates),
        params_written=tuple(params_written),
    )
    return _finish(new, signature, constants, loss_kind, wrapped=True)


def placeholders(
    gm: GraphModule,
    g: torch.fx.Graph,
    *,
    params: list[str],
    buffers: list[str],
    n_inputs: int,
    target_nodes: list,
) -> tuple[dict, list, list, list, list, list, dict[str, torch.Tensor]]:
    """:func:`from_make_fx`'s placeholders of ``g`` for ``make_fx``'s graph ``gm``: ``(env``
    (``gm``'s placeholders, constants and target nodes to ``g``'s), ``gm``'s placeholders, the
    signature's parameters, buffers, inputs and targets, the constants``)``."""
    old = gm.graph
    phs = [n for n in old.nodes if n.op == "placeholder"]
    n_p, n_b = len(params), len(buffers)
    env: dict = {}
    sig_params: list = []
    sig_buffers: list = []
    model_inputs: list = []
    target_names: list = []
    constants: dict[str, torch.Tensor] = {}

    def placeholder(name: str, src):
        ph = new_placeholder(g, name)  # (g.placeholder(name): one per parameter)
        ph.meta.update(src.meta)
        ph.meta.pop("nn_module_stack", None)
        return ph

    for i, n in enumerate(phs):
        if i < n_p:
            env[n] = placeholder("p_model_" + _ident(params[i]), n)
            sig_params.append((env[n].name, params[i]))
        elif i < n_p + n_b:
            env[n] = placeholder("b_model_" + _ident(buffers[i - n_p]), n)
            sig_buffers.append((env[n].name, buffers[i - n_p]))
    held: dict[str, Node] = {}  # one placeholder per constant, however often it is read
    for n in old.nodes:
        if n.op == "get_attr":  # torch.tensor(...) made in forward: a fixed buffer
            if n.target in held:  # a plain tensor attribute read twice: two get_attr nodes
                env[n] = held[n.target]
                continue
            env[n] = held[n.target] = placeholder("c_" + _ident(n.target), n)
            sig_buffers.append((env[n].name, n.target))
            constants[env[n].name] = getattr(gm, n.target)
    for i, n in enumerate(phs[n_p + n_b :]):
        env[n] = placeholder(f"args_{i}", n)
        model_inputs.append(env[n].name)
    for j, n in enumerate(target_nodes):
        env[n] = placeholder(f"args_{n_inputs + j}", n)
        target_names.append(env[n].name)
    return env, phs, sig_params, sig_buffers, model_inputs, target_names, constants


def _copy_nodes(old: torch.fx.Graph, g: torch.fx.Graph, env: dict, calls: Any, write: Any) -> None:
    """Copy ``old``'s nodes not in ``env`` into ``g`` in order, each outlined call of ``calls``
    expanded where it stands (its ``getitem`` nodes are its template's outputs, its
    buffer-write ``copy`` nodes the outputs themselves), each ``copy_`` first offered to
    ``write`` (its arguments in ``g``, and its destination in ``old``)."""
    results_of: dict = {}
    for n in old.nodes:
        if n in env or n.op in ("placeholder", "get_attr", "output"):
            continue
        if calls is not None:
            if n in calls.calls:
                results_of[n] = calls.body(n, g, env.__getitem__, write)
                continue
            if n.target is operator.getitem and n.args[0] in results_of:
                env[n] = results_of[n.args[0]][n.args[1]]
                if LEAF in n.meta:  # a call's output the model made a leaf (a hook's)
                    env[n].meta[LEAF] = n.meta[LEAF]
                continue
            if calls.drops(n):
                env[n] = env[n.args[1]]
                continue
        if n.target is aten.copy_.default:
            got = write(torch.fx.node.map_arg(n.args, env.__getitem__), n.args[0])
            if got is not None:
                env[n] = got
                continue
        env[n] = copy_node(g, n, env.__getitem__)


def _frozen(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(y) for y in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in x.items()))
    return x


def _fold_regenerated_views(g: torch.fx.Graph) -> None:
    """A view op that repeats an earlier one nothing reads (same op, same arguments) is that
    one: functionalization made the view where the model took it, then made it again where it
    was first read, its base written in place before (``torch.flatten`` of an in-place ReLU's
    output, read by the next module's ``linear``); eager took it once, at the first place and
    in that module. The later copy's readers read the earlier one, which dead-code elimination
    then keeps (GoogLeNet's auxiliary heads: the flatten was in ``aux1.fc1``, after the weight's
    transpose, where an outlined ``aux1.conv`` left it in ``aux1``)."""
    seen: dict[tuple, torch.fx.Node] = {}
    for n in list(g.nodes):
        if n.op != "call_function" or not getattr(n.target, "is_view", False):
            continue
        try:
            key = (n.target, _frozen(n.args), _frozen(n.kwargs))
            hash(key)
        except TypeError:
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = n
        elif not first.users:
            n.replace_all_uses_with(first)
            g.erase_node(n)


#: the profiler's marks (``torch.autograd.profiler.record_function``, which
#: ``nn.DataParallel.forward`` enters too): impure for fx, but no work and no value
PROFILER_MARKS = frozenset(
    getattr(torch.ops.profiler, name)
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
)


def _is_profiler_mark(n: torch.fx.Node) -> bool:
    packet = getattr(n.target, "overloadpacket", None)
    return packet is not None and packet in PROFILER_MARKS


def _kept(n: torch.fx.Node) -> bool:
    """Nodes dead-code elimination keeps although nothing reads them: side effects, and a
    custom Function's input aliases and saved tensors, which its own backward and jvp read
    (eager computes them in the forward too). The profiler's marks are dropped
    (:data:`PROFILER_MARKS`: they have no ``val``, and no cost)."""
    if _is_profiler_mark(n):
        return False
    tag = n.meta.get(FUNCTION)
    return n.is_impure() or (tag is not None and (tag.input is not None or bool(tag.saved)))


def _eliminate_dead_code(g: torch.fx.Graph) -> NodeCost:
    """Dead code removed from ``g`` as ``g.eliminate_dead_code()`` removes it, returning the
    summed cost of the ops it removed (reported as ``totals.forward.unused_flops``, never
    silently dropped; an op without a rule counts 0)."""
    from graphflop.ops.cost import op_cost, value_of
    from graphflop.ops.tree import tree_map

    # fx's eliminate_dead_code, with the users tested before the impurity (which it tests on
    # every node) and each removed op's arguments read as it goes
    dead: list[tuple] = []
    for n in reversed(g.nodes):
        if n.users or _kept(n):
            continue
        if n.op == "call_function" and not _is_profiler_mark(n):
            args, kwargs = tree_map(value_of, n.args), tree_map(value_of, n.kwargs)
            dead.append((n.target, args, kwargs, n.meta.get("val")))
        g.erase_node(n)
    total = NodeCost()
    for op, args, kwargs, out in reversed(dead):  # summed in graph order
        try:
            total = total + op_cost(op, args, kwargs, out)
        except MissingRuleError:  # --strict: a dead op without a rule is not an error
            pass
    return total


def _ident(name: str) -> str:
    return sanitize_name(name).lower()
