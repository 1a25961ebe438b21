"""FLOP and byte pass: writes ``COST`` (:class:`~graphflop.meta.NodeCost`) on every node.

Reads ``val`` (output FakeTensors), ``COMPOSITE`` and the rule table. Placeholders, outputs and
``getitem`` cost nothing. A ``call_function`` node whose op has no rule costs 0 (the summary lists
it as uncounted); inside :func:`graphflop.ops.strict_rules` it raises
:class:`~graphflop.ops.MissingRuleError` naming the op, the node and the rule file.

A composite op eager PyTorch runs as one kernel (layer norm, softmax, GELU, ...: the ops of
:data:`~graphflop.frontend.composite.EAGER_SAVES`, whose decompositions tracing tags with
``COMPOSITE``) moves the bytes of that kernel, not those of its decomposition's parts
(:func:`one_kernel_bytes`): its inputs from outside read once, its outputs written once, in
their dtypes; the parts' temporaries (a 16-bit input's float32 upcast and the float32 values
computed from it, the per-row statistics a softmax keeps on the way) are not counted. Its FLOPs
stay the sum of its parts' (docs/flops_conventions.md, One kernel's bytes). So does its
backward (``native_layer_norm_backward``, ``_softmax_backward_data``, ``gelu_backward``, ...):
the backward nodes made for its parts (``SOURCE``; a backward graph's ``BACKWARD_KERNELS``) move
that one kernel's bytes (:func:`backward_kernel_costs`).
"""

from __future__ import annotations

import operator
from collections import ChainMap
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphflop.frontend import outline  # noqa: F401  (defines graphflop::repeat)
from graphflop.frontend.composite import EAGER_SAVES, composite_regions
from graphflop.meta import (
    BACKWARD_KERNELS,
    CALL_SITE,
    COMPOSITE,
    COST,
    DERIVED_HIERARCHY,
    HIERARCHY,
    KIND,
    ROLE,
    SOURCE,
    ZERO_COST,
    Hierarchy,
    NodeCost,
)
from graphflop.ops import has_rule, lookup
from graphflop.ops.cost import op_cost, tensor_bytes, value_of
from graphflop.passes.infra import GraphPass

#: a call of a template derivative in a recorded top level (``graphflop::repeat``)
_REPEAT = torch.ops.graphflop.repeat.default

# op_cost, tensor_bytes and value_of live with the rule table (graphflop.ops.cost), below the
# graph builder that also needs them; the passes import them from here
__all__ = [
    "AnnotateFlops",
    "annotate_flops",
    "annotate_templates",
    "backward_kernel_bytes",
    "backward_kernel_costs",
    "backward_kernel_map",
    "backward_kernels_of",
    "call_escapes",
    "flat_costs",
    "one_kernel_bytes",
    "one_kernel_costs",
    "op_cost",
    "read_shares",
    "rule_cost",
    "run_escapes",
    "sum_costs",
    "template_kernel_map",
    "tensor_bytes",
    "total_cost",
    "value_of",
]


def annotate_flops(gm: GraphModule) -> GraphModule:
    """Write ``COST`` on every node of ``gm`` (in place) and return it.

    A graph with a :class:`~graphflop.meta.Hierarchy` (outlined blocks) has each template
    costed once (:func:`annotate_templates`) and each copy of a template node given its
    template node's cost; every other node is costed on its own. A derivative graph whose
    blocks are calls (:data:`~graphflop.meta.DERIVED_HIERARCHY`) has each template derivative
    costed once: with the flat graph (``runs``), each call's node gets its template node's
    cost; where ``gm`` is the recorded top level itself (``direct=True``), the template's
    nodes carry the costs, each call node their sum and its getitems nothing. The parts of a
    composite op eager runs as one kernel carry that kernel's bytes (:func:`one_kernel_bytes`),
    in a template as in the flat graph, so a copy's cost is the one it has on its own.

    Raises:
        MissingRuleError: for a ``call_function`` node whose op has no rule, inside
            :func:`graphflop.ops.strict_rules` (else such a node costs 0).
    """
    h: Hierarchy | None = gm.meta.get(HIERARCHY)
    templates: list[list[Node]] = []  # each template's nodes
    of_site: list[int] = []  # each call site's template
    if h is not None:
        annotate_templates(h)
        templates = [list(t.nodes) for t in h.templates]
        of_site = [s.template for s in h.sites]
    done = _cost_calls(gm)
    recorded = _cost_recorded(gm)
    if recorded:
        done = recorded
    fresh: dict[Node, NodeCost] = {}  # the nodes costed by their rules here
    for n in gm.graph.nodes:
        if n in done:
            continue
        tag = n.meta.get(CALL_SITE) if of_site else None
        if tag is not None and tag[0] < len(of_site):
            t = templates[of_site[tag[0]]][tag[1]]
            if n.target is operator.getitem and (
                isinstance(n.args[0], Node) and n.args[0].meta.get(CALL_SITE) == tag
            ):
                n.meta[COST] = ZERO_COST  # a getitem tracing added to the copy
                continue
            if n.target is t.target and _same_out(n, t):
                n.meta[COST] = t.meta[COST]
                continue
        if n.op == "call_function":
            n.meta[COST] = fresh[n] = op_cost(n.target, n.args, n.kwargs, n, node=n.name)
        else:
            n.meta[COST] = ZERO_COST
    # a composite op whose nodes all took their template's (or template derivative's) costs
    # has its one kernel's bytes from there already
    one_kernel_bytes(gm.graph.nodes, fresh)
    backward_kernel_bytes(gm.graph.nodes, fresh, gm.meta.get(BACKWARD_KERNELS))
    return gm


def _cost_calls(gm: GraphModule) -> set[Node]:
    """Where derivative graph ``gm`` keeps its blocks as calls (:data:`DERIVED_HIERARCHY`,
    :mod:`graphflop.passes.calls`): cost each template derivative's nodes once and give every
    node of each call its template node's ``COST`` (a call's node and its template node have
    the same op, constants and argument layouts). Returns the nodes so costed."""
    dh = gm.meta.get(DERIVED_HIERARCHY)
    if dh is None or not dh.runs:
        return set()
    costs: dict[int, list[NodeCost]] = {}
    done: set[Node] = set()
    kernels = gm.meta.get(BACKWARD_KERNELS)
    for c, run in zip(dh.calls, dh.runs):
        cs = costs.get(c.template)
        if cs is None:
            tpl = dh.templates[c.template].graph.nodes
            raw = {
                t: op_cost(t.target, t.args, t.kwargs, t, node=t.name)
                for t in tpl
                if t.op == "call_function"
            }
            for t, cost in raw.items():
                t.meta[COST] = cost
            one_kernel_bytes(tpl, raw)
            backward_kernel_bytes(
                tpl, raw, template_kernel_map(kernels, c.sources), run_escapes(list(raw), run)
            )
            cs = costs[c.template] = [t.meta[COST] for t in raw]
        for n, cost in zip(run, cs):
            n.meta[COST] = cost
        done.update(run)
    return done


def _cost_recorded(gm: GraphModule) -> set[Node]:
    """Where ``gm`` is the top level of a recorded derivative hierarchy (its
    :data:`DERIVED_HIERARCHY`'s ``graph`` is ``gm`` itself: built with ``direct=True``, there is
    no flat graph): cost each template derivative's nodes once (``COST`` on the template's
    nodes, placeholders and output :data:`ZERO_COST`), give each ``graphflop::repeat`` call node
    its template's total (so that a node-by-node sum over the top level is the flat graph's
    total) and each getitem of a call :data:`ZERO_COST`. The per-role, per-module and per-op
    figures come from the templates (``calls.derived_figures``). Returns the nodes so costed."""
    dh = gm.meta.get(DERIVED_HIERARCHY)
    if dh is None or dh.graph is not gm:
        return set()
    totals: dict[int, NodeCost] = {}
    done: set[Node] = set()
    for n in gm.graph.nodes:
        if n.target is _REPEAT and n.op == "call_function":
            t = dh.calls[n.args[1]].template
            total = totals.get(t)
            if total is None:
                kernels = template_kernel_map(
                    gm.meta.get(BACKWARD_KERNELS), dh.calls[n.args[1]].sources
                )
                escapes = call_escapes(dh.templates[t], n)
                total = totals[t] = _cost_template(dh.templates[t], kernels, escapes)
            n.meta[COST] = total
            done.add(n)
        elif n.target is operator.getitem and getattr(n.args[0], "target", None) is _REPEAT:
            n.meta[COST] = ZERO_COST
            done.add(n)
    return done


def _cost_template(
    t: GraphModule,
    kernels: Mapping[str, int] | None = None,
    escapes: Collection[Node] = frozenset(),
) -> NodeCost:
    """Write ``COST`` on every node of template derivative ``t`` (once: a template already
    costed is left as it is) and return the sum over its nodes. ``kernels``, ``escapes``: its
    nodes' one backward kernels (:func:`template_kernel_map`) and those a call's nodes outside
    it read (:func:`call_escapes`)."""
    fresh: dict[Node, NodeCost] = {}
    for x in t.graph.nodes:
        if COST not in x.meta:
            if x.op == "call_function":
                x.meta[COST] = fresh[x] = op_cost(x.target, x.args, x.kwargs, x, node=x.name)
            else:
                x.meta[COST] = ZERO_COST
    if fresh:
        one_kernel_bytes(t.graph.nodes, fresh)
        backward_kernel_bytes(t.graph.nodes, fresh, kernels, escapes)
    return sum_costs(x.meta[COST] for x in t.graph.nodes)


def _same_out(n: Node, t: Node) -> bool:
    a, b = n.meta.get("val"), t.meta.get("val")
    if a is b:  # (a copy the direct hierarchy made shares its template node's value)
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)


def annotate_templates(h: Hierarchy) -> None:
    """Write ``COST`` on every node of every template of ``h`` (once: a template already
    costed is left as it is). A template's ``copy_`` into one of its placeholders (a training-mode
    batch norm's running statistics) is its buffer write, which no call copies (the flat graph
    returns the value written): it costs nothing, and needs no rule under
    :func:`graphflop.ops.strict_rules`.

    Raises:
        MissingRuleError: as :func:`annotate_flops`.
    """
    copy_ = torch.ops.aten.copy_.default
    for tpl in h.templates:
        fresh: dict[Node, NodeCost] = {}
        for n in tpl.nodes:
            if COST in n.meta:
                continue
            if n.target is copy_ and getattr(n.args[0], "op", None) == "placeholder":
                n.meta[COST] = ZERO_COST
            elif n.op == "call_function":
                n.meta[COST] = fresh[n] = op_cost(n.target, n.args, n.kwargs, n, node=n.name)
            else:
                n.meta[COST] = ZERO_COST
        if fresh:
            one_kernel_bytes(tpl.nodes, fresh)


def in_one_kernel(n: Node) -> bool:
    """Whether ``n`` is a part of a composite op eager PyTorch runs as one kernel (a
    ``call_function`` node tagged with an op of
    :data:`~graphflop.frontend.composite.EAGER_SAVES`): its ``COST``'s bytes are its share of
    that kernel's (:func:`one_kernel_bytes`), not its rule's."""
    tag = n.meta.get(COMPOSITE)
    return tag is not None and n.op == "call_function" and tag.op in EAGER_SAVES


def rule_cost(n: Node) -> NodeCost:
    """``n``'s cost by its op's rule alone: its ``COST``, or where that may hold its share of
    a composite op's one kernel (:func:`in_one_kernel`) or one backward kernel (a backward
    node a forward node's rule made), its rule's cost made anew."""
    if in_one_kernel(n) or (_derived(n) and has_rule(n.target)):
        return op_cost(n.target, n.args, n.kwargs, n)
    return n.meta.get(COST, ZERO_COST)


def _derived(n: Node) -> bool:
    """Whether ``n`` is a backward graph's node a forward node's rule made (a cotangent or a
    coefficient, a recomputed value), not a forward part or an update: such a node may carry
    its share of a composite op's one backward kernel (:func:`backward_kernel_costs`)."""
    return (
        n.op == "call_function"
        and COMPOSITE not in n.meta
        and n.meta.get(KIND) in ("cotangent", "coef")
        and n.meta.get(ROLE) != "update"
    )


def _is_view(n: Node) -> bool:
    return n.op == "call_function" and has_rule(n.target) and lookup(n.target).bytes == "view"


def read_shares(n: Node, cost: NodeCost) -> dict[Node, float]:
    """The fraction of each input of ``n`` that ``n`` reads, ``cost`` its rule's: all of each,
    but where its byte rule reads less than its inputs hold (a gather, an embedding: the rows
    it picks), the difference comes off its largest input (the table the rows are picked
    from). A view reads nothing itself, and what reads through it is not known here: all of
    its input."""
    ins = n.all_input_nodes
    sizes = [tensor_bytes(a.meta.get("val")) for a in ins]
    out = dict.fromkeys(ins, 1.0)
    excess = sum(sizes) - cost.bytes_read
    if _is_view(n) or not has_rule(n.target) or excess <= 0 or not ins:
        return out
    big = max(range(len(ins)), key=lambda i: sizes[i])
    if sizes[big]:
        out[ins[big]] = max(0.0, sizes[big] - excess) / sizes[big]
    return out


def one_kernel_bytes(nodes: Iterable[Node], fresh: Mapping[Node, NodeCost]) -> None:
    """Write :func:`one_kernel_costs` on its nodes (``COST``)."""
    for n, cost in one_kernel_costs(nodes, fresh).items():
        n.meta[COST] = cost


def flat_costs(
    nodes: Iterable[Node],
    kernels: Mapping[str, int] | None = None,
    escapes: Collection[Node] = frozenset(),
) -> dict[Node, NodeCost]:
    """Each node's cost as :func:`annotate_flops` gives it when every node is costed on its own
    (no template): its rule's, with a composite op's one kernel's bytes
    (:func:`one_kernel_costs`) and, given the backward graph's ``kernels``
    (:data:`~graphflop.meta.BACKWARD_KERNELS`, or a template derivative's
    :func:`template_kernel_map`, with its ``escapes``), its one backward kernel's
    (:func:`backward_kernel_costs`); written nowhere (tests check a template copy's ``COST``
    against it)."""
    nodes = list(nodes)
    out = {
        n: op_cost(n.target, n.args, n.kwargs, n) if n.op == "call_function" else ZERO_COST
        for n in nodes
    }
    out |= one_kernel_costs(nodes, out)
    if kernels:
        out |= backward_kernel_costs(nodes, out, kernels, escapes)
    return out


def one_kernel_costs(nodes: Iterable[Node], fresh: Mapping[Node, NodeCost]) -> dict[Node, NodeCost]:
    """The costs of the parts of each composite op among ``nodes`` that eager PyTorch runs as
    one kernel (:func:`in_one_kernel`) with that kernel's bytes: the FLOPs stay the rules',
    the bytes become each part's share of

    * read: each tensor the op takes from outside its parts, once, whole (or the share its
      readers' byte rules read of it: :func:`read_shares`), charged to its first reader;
    * written: each of the op's outputs (a part its tag names an output, or one another
      ``call_function`` node reads: a derivative rule's coefficient), once, at its dtype,
      charged to the part that makes its storage (the base of a view, the multi-output part
      behind a ``getitem``); the parts' temporaries are not written.

    ``fresh``: the nodes whose ``COST`` is their rule's (just costed); an op none of whose parts
    is among them already has its kernel's bytes (a template's copy) and is left as it is, one
    with some is costed from its parts' rules. An op traced as one node (training-mode batch
    norm, :data:`~graphflop.frontend.composite.KEPT_WHOLE`; a GELU in one part) has its rule's
    bytes, its kernel's already; one with a part without a cost rule keeps its parts' costs
    (the phase is incomplete anyway). A layer norm over [B, T, D] in bfloat16: read
    B·T·D·2 + γ and β D·2 each, written B·T·D·2 (its output; μ and rstd where the graph has
    them as outputs), where the decomposition read and wrote its float32 upcast and
    temporaries."""
    out: dict[Node, NodeCost] = {}
    # only the regions with a node in ``fresh`` (each region whole: a composite op's nodes
    # share its region number), not a flat graph's every copy of its templates' ops
    regions = {tag.region for n in fresh if (tag := n.meta.get(COMPOSITE)) is not None}
    if not regions:
        return out
    nodes = [
        n for n in nodes if (tag := n.meta.get(COMPOSITE)) is not None and tag.region in regions
    ]
    for region in composite_regions(nodes):
        parts = [n for n in region if in_one_kernel(n)]
        if not parts or not any(n in fresh for n in parts):
            continue
        ops = [n for n in parts if n.target is not operator.getitem]
        if len(ops) < 2 or not all(has_rule(n.target) for n in ops):
            continue
        rules = {n: fresh[n] if n in fresh else rule_cost(n) for n in parts}
        out |= _kernel_costs(parts, rules, _forward_leaves)
    return out


def _read_outside(n: Node, inside: set[Node]) -> bool:
    """Whether a ``call_function`` node outside ``inside`` reads ``n`` (a graph's output node
    is no reader: a template derivative returns inner values its calls' flat nodes never
    read)."""
    return any(u not in inside and u.op == "call_function" for u in n.users)


def _forward_leaves(n: Node, inside: set[Node]) -> bool:
    """Whether composite op part ``n`` is an output of its kernel: one its tag names, or one
    read outside it."""
    return n.meta[COMPOSITE].output is not None or _read_outside(n, inside)


def _kernel_costs(
    parts: list[Node],
    rules: Mapping[Node, NodeCost],
    leaves: Callable[[Node, set[Node]], bool],
) -> dict[Node, NodeCost]:
    """``parts`` (one kernel's nodes, in graph order; ``rules`` their rules' costs) with that
    kernel's bytes: each input from outside read once (its readers' shares,
    :func:`read_shares`), charged to its first reader; each part ``leaves`` (given the set of
    parts) says is an output written once, charged to the part that makes its storage; FLOPs
    the rules'."""
    out: dict[Node, NodeCost] = {}
    inside = set(parts)
    read = dict.fromkeys(parts, 0.0)
    taken: dict[Node, float] = {}
    for n in parts:
        outer = [a for a in n.all_input_nodes if a not in inside]
        if not outer:
            continue
        shares = read_shares(n, rules[n])
        for a in outer:
            size = tensor_bytes(a.meta.get("val"))
            got = taken.get(a, 0.0)
            part = min(size - got, shares[a] * size)
            if part > 0:
                taken[a] = got + part
                read[n] += part
    written = dict.fromkeys(parts, 0)
    seen: set[Node] = set()
    for n in parts:
        if not leaves(n, inside):
            continue
        m = n  # the storage the output is: through views to their base
        while _is_view(m) and m.all_input_nodes and m.all_input_nodes[0] in inside:
            m = m.all_input_nodes[0]
        if _is_view(m) or m in seen:  # a view of an input from outside: nothing written
            continue
        seen.add(m)
        owner = m
        if m.target is operator.getitem:
            base = m.args[0]
            if not isinstance(base, Node) or base not in inside:
                continue
            owner = base
        written[owner] += tensor_bytes(m.meta.get("val"))
    for n in parts:
        out[n] = replace(rules[n], bytes_read=round(read[n]), bytes_written=written[n])
    return out


def backward_kernel_map(forward: GraphModule) -> dict[str, int]:
    """For a backward graph's :data:`~graphflop.meta.BACKWARD_KERNELS`: each node of
    ``forward`` that is a part of a composite op eager runs as one kernel (an op of
    :data:`~graphflop.frontend.composite.EAGER_SAVES`, its ``COMPOSITE`` region) -> that op
    occurrence's number."""
    out: dict[str, int] = {}
    for i, region in enumerate(composite_regions(forward.graph.nodes)):
        if region[0].meta[COMPOSITE].op in EAGER_SAVES:
            out |= dict.fromkeys((n.name for n in region), i)
    return out


def template_kernel_map(
    kernels: Mapping[str, int] | None, sources: Iterable[str]
) -> Mapping[str, int] | None:
    """A template derivative's :func:`backward_kernel_map`: its source slot ``@k`` -> the
    number of the one-kernel composite op that one call's forward node ``sources[k]`` is a
    part of (one call holds one copy of each of the block's ops, so the numbers tell them
    apart in the template as in the flat graph); a source outside the call keeps its name
    (a checkpoint's recompute of another block), and its number."""
    if not kernels:
        return None
    slots = {f"@{k}": kernels[s] for k, s in enumerate(sources) if s in kernels}
    return ChainMap(slots, dict(kernels))


def run_escapes(template: list[Node], run: list[Node]) -> set[Node]:
    """The nodes of a template derivative (``template``: its ``call_function`` nodes, in
    order) whose value a node outside the call reads, from one call's flat nodes (``run``,
    in the same order): a value a later call or the top level reads leaves its kernel, which
    the template alone cannot tell (its output returns every node)."""
    inside = set(run)
    return {
        t
        for t, r in zip(template, run)
        if any(u.op == "call_function" and u not in inside for u in r.users)
    }


def call_escapes(template: GraphModule, call: Node) -> set[Node]:
    """:func:`run_escapes` from a recorded top level's call node (``graphflop::repeat``): the
    template nodes its ``getitem``s are, where a ``call_function`` node reads one."""
    out = template.graph.output_node().args[0]
    assert isinstance(out, (tuple, list))
    read: set[Node] = set()
    for g in call.users:
        i = g.args[1] if g.target is operator.getitem else None
        if isinstance(i, int) and any(u.op == "call_function" for u in g.users):
            x = out[i]
            assert isinstance(x, Node)
            read.add(x)
    return read


def backward_kernels_of(nodes: Iterable[Node], kernels: Mapping[str, int]) -> list[list[Node]]:
    """The backward nodes of each composite op eager runs as one kernel among ``nodes``: those
    a rule made for one of its parts (:data:`~graphflop.meta.SOURCE`, looked up in
    ``kernels``: :func:`backward_kernel_map`), cotangents and coefficients (the grouping of
    the time pass's backward kernels), a checkpoint's recomputed values apart (the forward
    kernel run again); in graph order."""
    groups: dict[tuple[int, bool], list[Node]] = {}
    for n in nodes:
        if not _derived(n):
            continue
        k = kernels.get(n.meta.get(SOURCE) or "")
        if k is not None:
            groups.setdefault((k, n.meta.get(ROLE) == "recompute"), []).append(n)
    return list(groups.values())


def backward_kernel_bytes(
    nodes: Iterable[Node],
    fresh: Mapping[Node, NodeCost],
    kernels: Mapping[str, int] | None,
    escapes: Collection[Node] = frozenset(),
) -> None:
    """Write :func:`backward_kernel_costs` on its nodes (``COST``)."""
    if not kernels:
        return
    for n, cost in backward_kernel_costs(nodes, fresh, kernels, escapes).items():
        n.meta[COST] = cost


def backward_kernel_costs(
    nodes: Iterable[Node],
    fresh: Mapping[Node, NodeCost],
    kernels: Mapping[str, int],
    escapes: Collection[Node] = frozenset(),
) -> dict[Node, NodeCost]:
    """The costs of each composite op's backward nodes among ``nodes``
    (:func:`backward_kernels_of`) with the bytes of the one kernel eager runs for it
    (``native_layer_norm_backward``, ``_softmax_backward_data``, ``gelu_backward``, ...;
    tools/autograd/derivatives.yaml), as :func:`one_kernel_costs` has its forward's: FLOPs
    the rules', read each tensor from outside (the cotangent, the forward values the
    derivative rules read) once, written each value the nodes leave (one read outside them,
    or one none of them reads: the gradients it returns) once, at its dtype; the
    intermediates not counted. ``escapes``: in a template derivative, the nodes a call's
    nodes outside it read (:func:`run_escapes`). ``fresh`` as :func:`one_kernel_costs`'s; a
    group of one op or
    with a node without a cost rule keeps its rules' bytes. Layer norm over [B, T, D] in
    float32: read the cotangent, x, x̂ and x - μ (graphflop's residuals: eager's kernel reads
    x, μ and rstd and recomputes the other two) B·T·D·4 each, μ and rstd B·T·4 each, γ D·4;
    written the input gradient B·T·D·4, γ's and β's D·4 each."""
    out: dict[Node, NodeCost] = {}
    for parts in backward_kernels_of(nodes, kernels):
        if not any(n in fresh for n in parts):
            continue
        ops = [n for n in parts if n.target is not operator.getitem]
        if len(ops) < 2 or not all(has_rule(n.target) for n in ops):
            continue
        rules = {n: fresh[n] if n in fresh else rule_cost(n) for n in parts}
        out |= _kernel_costs(
            parts,
            rules,
            # a gradient it returns is read by none of its nodes
            lambda n, inside: (
                n in escapes or _read_outside(n, inside) or not any(u in inside for u in n.users)
            ),
        )
    return out


class AnnotateFlops(GraphPass):
    """:func:`annotate_flops` as a pass: requires ``val``, provides ``flops``.

    Raises ``MissingRuleError`` for an op without a rule inside
    :func:`graphflop.ops.strict_rules`.
    """

    name = "annotate_flops"
    required = ("val",)
    provided = ("flops",)

    def call(self, graph_module: GraphModule) -> PassResult:
        return PassResult(annotate_flops(graph_module), False)


def total_cost(nodes) -> NodeCost:
    """Sum of ``COST`` over nodes (missing costs count as zero)."""
    return sum_costs(n.meta.get(COST, ZERO_COST) for n in nodes)


def sum_costs(costs) -> NodeCost:
    """Sum of an iterable of :class:`~graphflop.meta.NodeCost`, field by field (one NodeCost
    made, not one per term: the summary sums every node of every graph)."""
    f = mm = tr = rnd = br = bw = 0
    for c in costs:
        f += c.flops
        mm += c.mm_flops
        tr += c.transcendentals
        rnd += c.random_elements
        br += c.bytes_read
        bw += c.bytes_written
    return NodeCost(f, mm, tr, rnd, br, bw)
