"""The optimizer update as graph nodes: SGD, SGD with momentum, Adam, AdamW.

``build_update(params, optimizer)`` returns a GraphModule taking, in order, the parameters, their
gradients, the optimizer state tensors and the scalar hyper-parameter inputs (``lr``, and
``step`` for Adam/AdamW), and returning the new parameters then the new state. Every update op is
elementwise over the parameter, so its FLOPs per parameter element are (docs/flops_conventions.md):

========  ==========================================================  =====
SGD       ``w - lr·g``                                                 2
momentum  ``b = μ·b + g; w - lr·b`` (PyTorch's SGD algorithm)           4
Adam      ``m = β1·m + (1-β1)·g`` (3), ``v = β2·v + (1-β2)·g·g`` (4),    18
          ``m̂ = m / (1 - β1^t)`` (3), ``v̂ = v / (1 - β2^t)`` (3),
          ``w - lr·m̂ / (√v̂ + ε)`` (5) — Kingma & Ba (2015), Algorithm 1,
          counted as seed A, Appendix B: the bias corrections are
          evaluated per element, as the formula is written
AdamW     Adam + decoupled weight decay ``w - w·(lr·λ)`` (2)             20
========  ==========================================================  =====

AdamW's ``lr·λ`` is one 0-dim product made once per update graph and read by every
parameter's decay: 1 FLOP beside the per-element counts (``20·P + 1`` for ``P`` elements).

The counts do not depend on the batch size: gradients arrive already summed over the batch.

A parameter the backward graph gives no gradient (:func:`gradient_free`: the loss does not
depend on it, or only through ops without a derivative) gets no update work and no state update:
``torch.optim``'s SGD and Adam/AdamW skip parameters whose ``.grad`` is None
(torch/optim/sgd.py, adam.py: ``if p.grad is not None``). Its new value and new state are its
inputs, passed through as ``aten.alias`` views (no FLOPs, no bytes moved; a graph output may not
be one of its inputs in ONNX), so the graph keeps one input and one output per parameter.

Writes ``KIND="update"``, ``ROLE="update"``, ``SOURCE``/``PARAM`` (the parameter's
placeholder/qualified name) and ``MODULE`` (the parameter's module path); on placeholders
``SLOT`` (:data:`SLOT`: what the input holds).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphflop.ad.builder import (
    NO_KWARGS,
    Builder,
    copy_node,
    emit_named,
    fits_numbered,
    new_node,
    take_names,
    take_plain,
)
from graphflop.meta import (
    DERIVED_HIERARCHY,
    GAPS,
    HIERARCHY,
    KIND,
    MODULE,
    PACKED,
    PARAM,
    PARAM_DERIVED,
    ROLE,
    SIGNATURE,
    SLOT,
    SOURCE,
    UPDATE,
    VJP,
    UpdateInfo,
    graph_fake_mode,
    graph_module,
)
from graphflop.passes.calls import DerivedHierarchy, is_recorded, unpacked
from graphflop.passes.infra import FLAT, GraphPass
from graphflop.passes.step_calls import (
    BlockParams,
    _numbered_plan,
    _outside,
    _take_planned,
    nodes_after,
    slot_suffix,
)

aten = torch.ops.aten
_REPEAT = torch.ops.graphflop.repeat.default
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
#: node.meta key on update placeholders: ``param``, ``grad``, a state kind, ``lr`` or ``step``
SLOT = SLOT

#: FLOPs per parameter element of each update (docs/flops_conventions.md); AdamW's update
#: adds 1 once (``lr·λ``)
FLOPS_PER_ELEMENT = {"sgd": 2, "momentum": 4, "adam": 18, "adamw": 20}
#: optimizer-state tensors kept per parameter, each the parameter's size and dtype
STATE_KINDS = {
    "sgd": (),
    "momentum": ("momentum",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
}

#: optimizers whose ``torch.optim`` step keeps a step count per parameter beside
#: :data:`STATE_KINDS` (``state["step"]``, a 0-dim tensor)
STEP_COUNTED = frozenset({"adam", "adamw"})


def step_count_bytes(optimizer: str) -> int:
    """Bytes of one parameter's step count: ``torch.optim.Adam``/``AdamW`` keep
    ``state["step"]`` per parameter, a 0-dim tensor of
    ``torch.optim.optimizer._get_scalar_dtype()`` (float32; float64 when the default dtype is
    float64); 0 for optimizers without one.

    Where it lives: on the CPU unless ``capturable`` or ``fused`` is set
    (torch/optim/adam.py ``_init_group``: "special device hosting for step"), so with the
    default step on a GPU these bytes are host memory. graphflop's memory figures count them
    with the rest of the state on every device (a ``cuda`` figure is then 4 B per trainable
    tensor above what the GPU holds: docs/memory.md).
    """
    if optimizer not in STEP_COUNTED:
        return 0
    return 8 if torch.get_default_dtype() == torch.float64 else 4


def optimizer_state_bytes(optimizer: str, trainable_bytes: int, tensors: int) -> int:
    """Bytes of ``torch.optim``'s state for ``tensors`` trainable parameters of
    ``trainable_bytes`` bytes together: one tensor like the parameter per :data:`STATE_KINDS`
    entry (momentum's ``momentum_buffer``, Adam's ``exp_avg`` and ``exp_avg_sq``) and each
    parameter's step count (:func:`step_count_bytes`): the bytes of every tensor in the
    optimizer's ``state`` after a step."""
    n = len(STATE_KINDS[optimizer])
    return n * trainable_bytes + tensors * step_count_bytes(optimizer)


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters (PyTorch's defaults). ``lr`` is a graph input, the rest constants."""

    name: str = "sgd"
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    extra: dict = field(default_factory=dict)


class _UpdateBuilder(Builder):
    active_kind = "update"

    def kind_for(self, args_flat):
        return "update"


def build_update(
    params: list[tuple[str, torch.Tensor]],
    optimizer: str | OptimizerConfig = "sgd",
    *,
    fake_mode: FakeTensorMode | None = None,
    modules: dict[str, str] | None = None,
    no_gradient: frozenset[str] = frozenset(),
    blocks: BlockParams | None = None,
    direct: bool = False,
) -> GraphModule:
    """Build the update graph for ``params`` ((qualified name, tensor or FakeTensor) pairs).

    ``no_gradient``: qualified names of parameters that get no gradient (:func:`gradient_free`):
    no update work, their new value and state are views of their inputs (``torch.optim`` skips
    a parameter whose ``.grad`` is None).

    ``blocks``: the parameters of the forward graph's repeated blocks
    (:class:`~graphflop.passes.step_calls.BlockParams`). Each run of consecutive parameters of
    one call site is a call of one template update per block variant (the parameters by their
    path in the block, with their layouts): its first call is built op by op, the others are
    copies of its nodes with the call's parameters, modules and sources (no fake-tensor run),
    and the graph keeps the calls as ``gm.meta[DERIVED_HIERARCHY]``. The graph is the same
    node for node either way (``tests/test_step_calls.py``).

    ``direct`` (with ``blocks``): the graph returned is the top level of the update's
    hierarchy (:func:`~graphflop.passes.calls.is_recorded`), no flat graph made: each call a
    ``graphflop::repeat`` node with a getitem per new value and new state, a variant's first
    call built op by op and then made a call, the others emitted without copying their nodes
    (their names taken as the copies would take them, kept as the call's flat names). Such a
    later call's parameters, gradients and each optimizer state are one placeholder each,
    ``packed_param``, ``packed_grad``, ``packed_<state>`` (:data:`~graphflop.meta.PACKED`:
    per parameter its flat placeholder's name, taken, and annotations; none made), read by
    the call as ``(pack, position)`` arguments (:func:`_pack`).
    :func:`~graphflop.passes.calls.flat_view` of it is the graph built without ``direct``,
    node for node and name for name (``tests/test_step_recorded.py``).

    Raises:
        ValueError: for an unknown optimizer.
    """
    cfg = optimizer if isinstance(optimizer, OptimizerConfig) else OptimizerConfig(optimizer)
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.name!r}; one of {', '.join(OPTIMIZERS)}")
    fake_mode = fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
    modules = modules or {}
    g = Graph()
    b = _UpdateBuilder(g, fake_mode, [])

    def ph(name, val, qual=None, module="", slot=None):
        n = _placeholder(g, name)
        n.meta.update(
            {
                "val": _fake(fake_mode, val),
                KIND: "primal",
                ROLE: "update",
                SOURCE: name,
                MODULE: module,
                PARAM_DERIVED: True,
            }
        )
        if qual:
            n.meta[PARAM] = qual
        n.meta[SLOT] = slot or name
        return n

    # once, not per kind: module, and the placeholders' names after ``<kind>_`` (slot_name)
    get = modules.get  # (the parent worked out only where ``modules`` has no entry)
    owned = [
        (q, t, m if (m := get(q)) is not None else _parent(q), slot_suffix(q)) for q, t in params
    ]

    recording = direct and blocks is not None
    site_of = blocks.site_of if blocks is not None else lambda q: None
    runs = _runs(params, site_of)  # (call site or None, parameters), in order
    # per call site's run, its variant (recorded: a variant's later calls' parameters,
    # gradients and states are packed, one placeholder per kind, none made for them)
    keys: list[Any] = [
        blocks.variant(params, idx, no_gradient) if blocks is not None and at is not None else None
        for at, idx in runs
    ]
    packed = _packed_runs(runs, keys, owned) if recording else {}

    def slots(kind):
        out: list[Any] = []
        i = 0
        while i < len(owned):
            run = packed.get(i)
            if run is None:
                q, t, module, suffix = owned[i]
                out.append(ph(f"{kind}_{suffix}", t, q, module, kind))
                i += 1
                continue
            idx, plain = run
            out += _pack(g, kind, [owned[k] for k in idx], fake_mode, plain)
            i = idx[-1] + 1
        return out

    w, gr = slots("param"), slots("grad")
    state = [slots(kind) for kind in STATE_KINDS[cfg.name]]
    device = params[0][1].device if params else torch.device("cpu")
    dtype = params[0][1].dtype if params else torch.float32
    with fake_mode:  # lr and step in the parameters' dtype: no mixed-precision update
        scalar = torch.empty((), dtype=dtype, device=device)
    lr = ph("lr", scalar)
    step = ph("step", scalar) if cfg.name in ("adam", "adamw") else None
    new_w: list[Node] = []
    new_state: list[list[Node]] = [[] for _ in state]

    def one(i: int, q: str) -> tuple[Node, list[Node]]:
        with b.context(source=w[i].name, module=w[i].meta[MODULE]):
            if q in no_gradient:  # torch.optim skips it: passed through (views), no work
                nw, new = (
                    b.call(aten.alias.default, w[i]),
                    [b.call(aten.alias.default, s[i]) for s in state],
                )
            else:
                nw, new = _param_update(b, cfg, w[i], gr[i], [s[i] for s in state], lr, step, lr_wd)
        nw.meta[PARAM] = q
        return nw, new

    # per block variant, its first call's nodes, per parameter its outputs' positions, per
    # node its parameter's position in the call and whether it names the parameter, and the
    # variant's number
    firsts: dict[tuple, _First] = {}
    names: dict[int, tuple[list[str], tuple | None]] = {}  # per variant (_copy_call)
    # per call: its site, variant, nodes, parameters' placeholders and the map it was copied
    # by (None for the variant's first call): BlockParams.hierarchy's; recorded: its site,
    # variant's first call, parameters, repeat node and names (BlockParams.recorded's)
    calls: list[tuple] = []

    def block_call(at: int, idx: list[int], key: tuple) -> list[tuple[Node, list[Node]]]:
        """The update of call site ``at``'s parameters ``idx`` (of variant ``key``): its
        variant's first call built op by op, another copied (recorded: a call, its nodes not
        copied)."""
        first = firsts.get(key)
        if first is not None and recording:
            outs, rep, taken = _record_call(g, first, idx, w, gr, state, params, names)
            calls.append((at, first, idx, rep, taken))
            return outs
        last = next(iter(reversed(g.nodes)))
        copied = None
        if first is not None:
            outs, copied = _copy_call(g, first, idx, w, gr, state, params, names)
        else:
            outs = [one(k, params[k][0]) for k in idx]
        made = nodes_after(last)
        if first is None:
            first = firsts[key] = _first_call(made, outs, idx, w, len(firsts))
        if recording:  # made a call by BlockParams.recorded
            calls.append((at, first, idx, None, None))
        else:
            calls.append((at, first[4], made, [w[k] for k in idx], copied))
        return outs

    with b.context(role="update"):
        decays = cfg.name == "adamw" and any(q not in no_gradient for q, _ in params)
        lr_wd = b.call(aten.mul.Tensor, lr, cfg.weight_decay) if decays else None
        for (at, idx), key in zip(runs, keys):
            outs = [one(idx[0], params[idx[0]][0])] if at is None else block_call(at, idx, key)
            _collect(outs, new_w, new_state)
    g.output(tuple(new_w + [n for s in new_state for n in s]))
    gm = _with_calls(g, blocks, calls, w, recording)
    gm.meta[UPDATE] = UpdateInfo(
        cfg.name,
        tuple(q for q, _ in params),
        tuple(n.name for st in state for n in st),
        ("lr", "step") if step is not None else ("lr",),
        tuple(f"{kind}.{q}" for kind in STATE_KINDS[cfg.name] for q, _ in params),
    )
    return gm


def _runs(params: list[tuple[str, Any]], site_of: Any) -> list[tuple[int | None, list[int]]]:
    """``params``' positions in runs: each run of consecutive parameters of one call site
    (``site_of``), a parameter outside every block a run of its own (site None)."""
    runs: list[tuple[int | None, list[int]]] = []
    i = 0
    while i < len(params):
        at = site_of(params[i][0])
        j = i + 1
        while at is not None and j < len(params) and site_of(params[j][0]) == at:
            j += 1
        runs.append((at, list(range(i, j))))
        i = j
    return runs


def _packed_runs(
    runs: list[tuple[int | None, list[int]]], keys: list[Any], owned: list[tuple]
) -> dict[int, tuple[list[int], bool]]:
    """The runs whose placeholders a recorded update packs (:func:`_pack`), by their first
    parameter's position: a call of a block variant after its first (whose nodes are built op
    by op on the parameters' own placeholders), whose placeholders' names fx takes as they
    are asked (:func:`_placeholder`'s plain case); with each, whether no name suffix of its
    ends in ``_<digits>`` (``plain`` of :func:`_pack`: the same for the calls of one variant,
    whose parameters' paths in the block end alike, so read once per variant)."""
    seen: dict[Any, bool | None] = {}
    out: dict[int, tuple[list[int], bool]] = {}
    for (at, idx), key in zip(runs, keys):
        if at is None:
            continue
        if key not in seen:
            seen[key] = None
            continue
        if all(_plain(f"grad_{owned[k][3]}") for k in idx):  # (every kind's likewise)
            plain = seen[key]
            if plain is None:
                plain = seen[key] = not any(owned[k][3].rpartition("_")[2].isdigit() for k in idx)
            out[idx[0]] = idx, plain
    return out


def _plain(name: str) -> bool:
    """Whether fx takes placeholder name ``name`` as it is asked (:func:`_placeholder`)."""
    return name.islower() and not (name.startswith("__") and name.endswith("__"))


class _Packed:
    """A flat update's placeholder held in a :data:`~graphflop.meta.PACKED` placeholder: its
    name and annotations, and the argument a call reads it by, ``(pack, position)``."""

    __slots__ = ("name", "meta", "arg")

    def __init__(self, name: str, meta: dict, arg: tuple[Node, int]) -> None:
        self.name, self.meta, self.arg = name, meta, arg


def _pack(
    g: Graph, kind: str, owned: list[tuple], mode: FakeTensorMode, plain: bool = False
) -> list[_Packed]:
    """One ``packed_{kind}`` placeholder of ``g`` standing for the placeholders ``kind``
    (``param``, ``grad``, a state kind) of parameters ``owned`` ((qualified name, tensor,
    module, name suffix) each; their values made fake tensors of ``mode``): their names taken
    in ``g`` as :func:`_placeholder` takes them, their annotations as ``build_update``'s
    ``ph`` makes them, held in the pack's :data:`~graphflop.meta.PACKED` (made placeholders
    by :func:`~graphflop.passes.calls.unpack`). Its ``val``: the tuple of theirs. Returns
    per parameter its :class:`_Packed`. ``plain``: no suffix ends in ``_<digits>`` (the names
    are taken at once where they are free: :func:`~graphflop.ad.builder.take_plain`)."""
    prefix = kind + "_"
    asked = [prefix + suffix for _, _, _, suffix in owned]
    names = take_plain(g, asked) if plain else None
    if names is None:
        names = take_names(g, asked)  # (in order, as one at a time)
    metas = tuple(
        [
            {
                "val": t if type(t) is FakeTensor else _fake(mode, t),
                KIND: "primal",
                ROLE: "update",
                SOURCE: x,
                MODULE: module,
                PARAM_DERIVED: True,
                PARAM: q,
                SLOT: kind,
            }
            for (q, t, module, _), x in zip(owned, asked)
        ]
    )
    pack = new_node(g, "placeholder", f"packed_{kind}", f"packed_{kind}", (), NO_KWARGS)
    pack.meta["val"] = tuple([m["val"] for m in metas])  # (a packed value)
    pack.meta[SLOT] = f"{kind}_pack"
    pack.meta[PACKED] = (tuple(names), metas)
    return [_Packed(name, meta, (pack, a)) for a, (name, meta) in enumerate(zip(names, metas))]


def _arg(x: Any) -> Any:
    """A call's argument for ``x``: a node, or a packed placeholder's ``(pack, position)``."""
    return x.arg if type(x) is _Packed else x


def _placeholder(g: Graph, name: str) -> Node:
    """``g.placeholder(name)``; fx's candidate name for a placeholder is its target made snake
    case (``Graph._target_to_str``), which leaves a name with no upper case letter that is not
    a magic name as it is: such a name is asked for as it is, without that step."""
    if name.lower() != name or (name.startswith("__") and name.endswith("__")):
        return g.placeholder(name)
    return new_node(g, "placeholder", name, name, (), {})


#: what :func:`_copy_call` copies of a variant's first call (:func:`_first_call`)
_First = tuple[
    list[Node], list[int], list[list[int]], list[tuple[int, bool]], int, list[Node], list[tuple]
]


def _first_call(
    made: list[Node], outs: list[tuple[Node, list[Node]]], idx: list[int], w: list[Node], v: int
) -> _First:
    """What :func:`_copy_call` copies of variant ``v``'s first call (its nodes ``made``, per
    parameter ``outs``, its parameters ``idx``): the nodes, the parameters, per parameter its
    new value's and new state's positions, per node its parameter's position in the call and
    whether it names the parameter, ``v``, the values the call reads from outside, and a list
    holding :func:`_record_plan`'s plan once made."""
    pos = {n: p for p, n in enumerate(made)}
    where = [[pos[nw], *(pos[n] for n in new)] for nw, new in outs]
    own = {w[k].name: a for a, k in enumerate(idx)}
    slots = [(own[n.meta[SOURCE]], PARAM in n.meta) for n in made]
    return made, idx, where, slots, v, _outside(made), []


def _copy_call(
    g: Graph,
    first: _First,
    idx: list[int],
    w: list[Node],
    gr: list[Node],
    state: list[list[Node]],
    params: list[tuple[str, torch.Tensor]],
    names: dict[int, tuple[list[str], tuple | None]],
) -> tuple[list[tuple[Node, list[Node]]], dict[Node, Node]]:
    """A call of a template update: the first call's nodes copied with parameters ``idx`` for
    its own (their placeholders, sources, modules and names); per parameter its new value and
    new state, and the map of the first call's placeholders and nodes to the call's. The
    copies keep the first call's output metadata: the variant's parameters have the same
    layouts.

    The copies' names are taken at once (``names``: per variant, its last call's names and
    the plan they were taken by): every name of the first call is taken, so a copy's node
    is named as the last call's node was asked for, its base's next number, and the names of
    a call after the first two are of fx's numbered form, taken a base at a time
    (:func:`~graphflop.passes.step_calls._take_planned`)."""
    made, _, where, slots = first[:4]
    env = _call_env(first, idx, w, gr, state)
    taken = _copy_names(g, first, names)
    get = env.__getitem__
    copies = []
    for n, (a, named), name in zip(made, slots, taken):
        new = copy_node(g, n, get, name, taken=True)
        # the node's parameter: the first call's ``a``-th parameter's counterpart
        _own_param(new.meta, w[idx[a]], params[idx[a]][0] if named else None)
        env[n] = new
        copies.append(new)
    return [(copies[pos[0]], [copies[x] for x in pos[1:]]) for pos in where], env


def _own_param(meta: dict, w: Node, name: str | None) -> None:
    """``meta`` (a copy's, of a template update's node) made the call's: its source and module
    those of the call's parameter placeholder ``w``, and, for a node that names its
    parameter, ``name``, that parameter's qualified name."""
    meta[SOURCE] = w.name
    meta[MODULE] = w.meta[MODULE]
    if name is not None:
        meta[PARAM] = name


def _with_calls(
    g: Graph, blocks: BlockParams | None, calls: list[tuple], w: list[Node], recording: bool
) -> GraphModule:
    """The update graph module of ``g`` with its hierarchy (where it has calls): the top
    level of the calls as recorded (:meth:`BlockParams.recorded`), or the calls of the graph
    built flat (:meth:`BlockParams.hierarchy`)."""
    root = torch.nn.Module()
    if blocks is None or not calls:
        return graph_module(root, g)
    if not recording:
        gm = graph_module(root, g)
        gm.meta[DERIVED_HIERARCHY] = blocks.hierarchy(gm, calls)
        return gm
    templates, made, names = blocks.recorded(g, calls, w, root)
    gm = graph_module(root, g)
    gm.meta[DERIVED_HIERARCHY] = DerivedHierarchy(templates, made, gm, names=names)
    return gm


def _collect(
    outs: list[tuple[Node, list[Node]]], new_w: list[Node], new_state: list[list[Node]]
) -> None:
    """Append each parameter's new value and new state (``outs``) to the outputs."""
    for nw, new in outs:
        new_w.append(nw)
        for acc, n in zip(new_state, new):
            acc.append(n)


def _call_env(
    first: _First, idx: list[int], w: list[Node], gr: list[Node], state: list[list[Node]]
) -> dict[Node, Node]:
    """The first call's values from outside mapped to the call of parameters ``idx``: its
    parameters', gradients' and states' placeholders; ``lr``, ``step`` and ``lr·λ`` shared."""
    _, first_idx, _, _, _, outside = first[:6]
    env: dict[Node, Node] = {x: x for x in outside}
    for a, k in zip(first_idx, idx):
        env[w[a]], env[gr[a]] = w[k], gr[k]
        for s in state:
            env[s[a]] = s[k]
    return env


def _copy_names(
    g: Graph, first: _First, names: dict[int, tuple[list[str], tuple | None]]
) -> tuple[str, ...]:
    """The names of a copy of ``first``'s nodes, taken in ``g`` (see :func:`_copy_call`)."""
    made, v = first[0], first[4]
    asked, plan = names.get(v) or ([n.name for n in made], None)
    if plan is None or not fits_numbered(asked, plan[0]):
        plan = _numbered_plan(asked)
    taken = _take_planned(g, asked, plan) if plan is not None else take_names(g, asked)
    names[v] = (list(taken), plan)
    return tuple(taken)


def _record_call(
    g: Graph,
    first: _First,
    idx: list[int],
    w: list[Node],
    gr: list[Node],
    state: list[list[Node]],
    params: list[tuple[str, torch.Tensor]],
    names: dict[int, tuple[list[str], tuple | None]],
) -> tuple[list[tuple[Node, list[Node]]], Node, tuple[str, ...]]:
    """:func:`_copy_call` recorded: the names the copies would take are taken in ``g``
    (every later node is named as in the graph built flat), and in place of the copies one
    ``graphflop::repeat`` node (its call number set by
    :meth:`~graphflop.passes.step_calls.BlockParams.recorded`) with a getitem per new value
    and new state, annotated as the copy would be. Returns per parameter its new value and
    new state (getitems), the repeat node and the names taken."""
    plan = _record_plan(first, w, gr, state)
    taken = _copy_names(g, first, names)
    lists = (w, gr, *state)
    args = []
    for li, x in plan[0]:
        if li >= 0:
            x = lists[li][idx[x]]
            if type(x) is _Packed:  # (_arg, in line)
                x = x.arg
        args.append(x)
    rep = emit_named(g, _REPEAT, (args, -1), "repeat_call")
    items: dict[int, Node] = {}
    for pos, a, named, meta in plan[1]:  # in the run's order, as the flat graph's nodes
        k = idx[a]  # read outside the run
        m = dict(meta)
        _own_param(m, w[k], params[k][0] if named else None)
        item = emit_named(g, operator.getitem, (rep, pos), "repeat_item")
        object.__setattr__(item, "meta", m)  # (no find_nodes re-filing)
        items[pos] = item
    return [(items[at[0]], [items[x] for x in at[1:]]) for at in first[2]], rep, taken


def _record_plan(
    first: _First, w: list[Node], gr: list[Node], state: list[list[Node]]
) -> tuple[list[tuple[int, Any]], list[tuple[int, int, bool, dict]]]:
    """How :func:`_record_call` emits a call of ``first``'s variant, worked out at its first
    recorded call and kept in ``first``'s last entry: per value the first call reads from
    outside, ``(list, position in the call)`` of the call's parameter, gradient or state
    (``list`` 0, 1, 2 + the state kind's index) or ``(-1, the value)`` for one all calls
    share (``lr``, ``step``, ``lr·λ``); per node read outside the run (in the run's order),
    its position, its parameter's position in the call, whether it names the parameter and
    its annotations (the first call's, made the call's per call)."""
    plan = first[6]
    if plan:
        return plan[0]
    made, first_idx, where, slots, _, outside = first[:6]
    at: dict[Node, tuple[int, int]] = {}
    for j, a in enumerate(first_idx):
        at[w[a]], at[gr[a]] = (0, j), (1, j)
        for i, st in enumerate(state):
            at[st[a]] = (2 + i, j)
    args = [at.get(x, (-1, x)) for x in outside]
    items = [
        (pos, *slots[pos], made[pos].meta) for pos in sorted({x for pos in where for x in pos})
    ]
    plan.append((args, items))
    return plan[0]


def _param_update(
    b: Builder,
    cfg: OptimizerConfig,
    w: Node,
    g: Node,
    state: list[Node],
    lr: Node,
    step: Node | None,
    lr_wd: Node | None,
) -> tuple[Node, list[Node]]:
    """One parameter's update: its new value and its new optimizer state (one node per
    ``STATE_KINDS`` entry), emitted in ``b``'s current context."""
    if cfg.name == "sgd":
        return b.call(aten.sub.Tensor, w, b.call(aten.mul.Tensor, g, lr)), []
    if cfg.name == "momentum":
        buf = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, state[0], cfg.momentum), g)
        return b.call(aten.sub.Tensor, w, b.call(aten.mul.Tensor, buf, lr)), [buf]
    nw, m, v = _adam(b, cfg, w, g, state[0], state[1], lr, step, lr_wd)
    return nw, [m, v]


def build_update_for(
    forward: GraphModule,
    optimizer: str | OptimizerConfig = "sgd",
    *,
    fake_mode: FakeTensorMode | None = None,
    backward: GraphModule | None = None,
    direct: bool = False,
) -> GraphModule:
    """The update graph for the trainable parameters of a traced forward graph (frozen ones,
    ``Signature.frozen``, get no update and no state). With ``backward`` (the forward's
    backward graph), the parameters it gives no gradient (:func:`gradient_free`) get no update
    work either (their state stays an input and output, unchanged).

    Each parameter's update nodes carry ``MODULE`` = the parameter's module path (its qualified
    name up to the last dot). Built on ``fake_mode``, by default the forward graph's own. Where
    ``forward`` has repeated blocks (:data:`~graphflop.meta.HIERARCHY`), a block's parameters'
    update is built once per block variant and kept as calls (``blocks`` of
    :func:`build_update`); with ``direct``, the graph returned is their top level
    (``direct`` of :func:`build_update`: no flat graph made).

    Args:
        forward: a graph from :func:`graphflop.frontend.trace.trace`.
        optimizer: a name from :data:`OPTIMIZERS` or an :class:`OptimizerConfig`.

    Raises:
        ValueError: for an unknown optimizer.
    """
    sig = forward.meta[SIGNATURE]
    phs = {n.name: n for n in forward.graph.find_nodes(op="placeholder")}
    trainable = sig.trainable()  # frozen parameters are not updated
    return build_update(
        [(q, phs[p].meta["val"]) for p, q in trainable],
        optimizer,
        fake_mode=fake_mode or graph_fake_mode(forward),
        modules={q: _parent(q) for _, q in trainable},
        no_gradient=gradient_free(backward) if backward is not None else frozenset(),
        blocks=BlockParams(forward) if HIERARCHY in forward.meta else None,
        direct=direct,
    )


def gradient_free(backward: GraphModule) -> frozenset[str]:
    """Qualified names of the parameters a backward graph gives no gradient: those whose
    gradient output does not depend on the loss cotangent (a gradient is linear in it, so such
    an output is a zero fill). That is a parameter the loss does not depend on (a model output
    after the first, which the loss does not read), or depends on only through ops without a
    derivative (``detach``, ``argmax``, comparisons): where ``torch.autograd`` leaves ``.grad``
    None. A parameter with a gradient that happens to be zero (a Linear bias before BatchNorm)
    is not one. Empty when the backward stops at ops without a transpose rule (``GAPS``): a
    zero there may be a gap's, not the model's.

    Args:
        backward: a graph from :func:`graphflop.ad.vjp.build_vjp`.
    """
    if backward.meta.get(GAPS):
        return frozenset()
    info = backward.meta[VJP]
    live: set[Node] = set()
    out = None
    for n in backward.graph.nodes:
        if n.op == "output":
            out = n
        elif not live.isdisjoint(n._input_nodes) or n.name == info.cotangent_input:
            live.add(n)  # (isdisjoint: the inputs' keys in C, a generator's frame per node else)
    outs = out.args[0] if out is not None else ()
    assert isinstance(outs, (tuple, list)), "a backward graph outputs a tuple of gradients"
    return frozenset(q for pos, q in info.grads if outs[pos] not in live)


class AddOptimizerUpdate(GraphPass):
    """Forward graph → the update graph for its parameters (:func:`build_update_for`).

    Args:
        optimizer: a name from :data:`OPTIMIZERS` or an :class:`OptimizerConfig`.
        fake_mode: the FakeTensorMode to build on (default: the forward graph's).
        backward: the forward's backward graph: parameters it gives no gradient get no update
            work (:func:`gradient_free`). None: every trainable parameter is updated.
        direct: return the top level of the update's hierarchy, no flat graph made
            (:func:`build_update`'s ``direct``; read it flat through
            :func:`~graphflop.passes.calls.flat_view`).

    Requires ``traced``; provides ``update``. Raises ``ValueError`` for an unknown optimizer.
    """

    #: runs on the flat graph: its derivative graph is not yet built per template
    scope = FLAT
    name = "add_optimizer_update"
    required = ("traced",)
    provided = ("update",)

    def __init__(
        self,
        optimizer: str | OptimizerConfig = "sgd",
        *,
        fake_mode: FakeTensorMode | None = None,
        backward: GraphModule | None = None,
        direct: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.fake_mode = fake_mode
        self.backward = backward
        self.direct = direct

    def call(self, graph_module: GraphModule) -> PassResult:
        gm = build_update_for(
            graph_module,
            self.optimizer,
            fake_mode=self.fake_mode,
            backward=self.backward,
            direct=self.direct,
        )
        return PassResult(gm, True)


def _adam(b, cfg, w, g, m, v, lr, step, lr_wd):
    b1, b2 = cfg.betas
    shape = list(w.meta["val"].shape)
    # first moment: 3 FLOPs per element
    m = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, m, b1), b.call(aten.mul.Tensor, g, 1 - b1))
    # second moment: 4
    gg = b.call(aten.mul.Tensor, g, g)
    v = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, v, b2), b.call(aten.mul.Tensor, gg, 1 - b2))
    # bias corrections, per element as written: 3 + 3
    t = b.call(aten.expand.default, step, shape)
    # β as a 0-d tensor in the parameters' dtype: a bare Python float would be exported to ONNX
    # as a float32 constant, and 1 − 0.999ᵗ in float32 loses four digits
    val = w.meta["val"]
    beta1, beta2 = (
        b.call(aten.full.default, [], beta, dtype=val.dtype, device=val.device) for beta in (b1, b2)
    )
    m_hat = b.call(
        aten.div.Tensor, m, b.call(aten.rsub.Scalar, b.call(aten.pow.Tensor_Tensor, beta1, t), 1)
    )
    v_hat = b.call(
        aten.div.Tensor, v, b.call(aten.rsub.Scalar, b.call(aten.pow.Tensor_Tensor, beta2, t), 1)
    )
    # update: 5
    denom = b.call(aten.add.Tensor, b.call(aten.sqrt.default, v_hat), cfg.eps)
    upd = b.call(aten.mul.Tensor, b.call(aten.div.Tensor, m_hat, denom), lr)
    if cfg.name == "adamw":  # decoupled weight decay: 2
        w = b.call(aten.sub.Tensor, w, b.call(aten.mul.Tensor, w, lr_wd))
    return b.call(aten.sub.Tensor, w, upd), m, v


def inline_update(
    g, update: GraphModule, params: dict, grads: dict, state: dict, copies: dict | None = None
) -> list:
    """Copy ``update``'s nodes into graph ``g``; returns the nodes of its outputs (new
    parameters, then new state).

    ``params`` and ``grads`` map a parameter's qualified name to the node holding it in ``g``;
    ``state`` maps the update's other placeholder names (state, ``lr``, ``step``) to nodes of ``g``.
    ``copies``, where given, receives each node of ``update`` and its copy.
    """
    env: dict = {}
    out = None
    for n in update.graph.nodes:
        if n.op == "placeholder":
            if n.meta[SLOT] == "param":
                env[n] = params[n.meta[PARAM]]
            elif n.meta[SLOT] == "grad":
                env[n] = grads[n.meta[PARAM]]
            else:
                env[n] = state[n.name]
        elif n.op == "output":
            out = n
        else:
            env[n] = copy_node(g, n, env.__getitem__)
    assert out is not None, "an update graph ends in its output node"
    if copies is not None:
        copies.update(env)
    return [env[a] for a in out.args[0]]


def _parent(q: str) -> str:
    return q.rpartition(".")[0]


def _fake(mode, t):
    if isinstance(t, FakeTensor):
        return t
    with mode:
        return torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)


def template_node(dh: DerivedHierarchy, getitem: Node, bodies: dict[int, list[Node]]) -> Node:
    """The node of its call's template that ``getitem`` (``operator.getitem`` of a
    ``graphflop::repeat`` node of ``dh``'s top level) stands for; ``bodies`` holds each
    template's nodes but its placeholders, listed at the first read."""
    rep, i = getitem.args
    t = dh.calls[cast(Node, rep).args[1]].template  # type: ignore[index]
    body = bodies.get(t)
    if body is None:
        body = bodies[t] = [x for x in dh.templates[t].graph.nodes if x.op != "placeholder"]
    return body[cast(int, i)]


def not_updated(update: GraphModule) -> frozenset[str]:
    """Qualified names of the parameters an update graph passes through without work (built
    with ``no_gradient``): their new value is an ``aten.alias`` of their own input."""
    out = next(n for n in reversed(update.graph.nodes) if n.op == "output")
    news = out.args[0][: len(update.meta[UPDATE].params)]
    dh = update.meta.get(DERIVED_HIERARCHY) if is_recorded(update) else None
    # a recorded update's templates: per template, the positions of its nodes (placeholders
    # left out, as template_node counts them) that pass a placeholder through, found once
    aliases: dict[int, frozenset[int]] = {}

    def passed_through(n: Any) -> bool:  # an alias of a placeholder (of its call's template)
        if dh is not None and n.target is operator.getitem and n.args[0].target is _REPEAT:
            rep, i = n.args
            t = dh.calls[rep.args[1]].template
            at = aliases.get(t)
            if at is None:
                body = (x for x in dh.templates[t].graph.nodes if x.op != "placeholder")
                at = aliases[t] = frozenset(k for k, x in enumerate(body) if _alias(x))
            return i in at
        return _alias(n)

    return frozenset(n.meta[PARAM] for n in news if passed_through(n))


def _alias(n: Node) -> bool:
    """``n`` is an ``aten.alias`` of a placeholder."""
    a = n.args[0]
    return n.target is aten.alias.default and isinstance(a, Node) and a.op == "placeholder"


def for_every_parameter(update: GraphModule | None) -> GraphModule | None:
    """``update`` when it updates every parameter it holds, else None. A forward-gradient step
    updates every trainable parameter (its estimate ``(∇L·v) v`` is nonzero even where ``∇L``
    is zero), so it is given ``update`` only in the first case and builds its own otherwise."""
    return update if update is not None and not not_updated(update) else None


def update_param_count(gm: GraphModule, skipped: frozenset[str] | None = None) -> int:
    """Parameter elements an update graph updates (those it passes through without work,
    :func:`not_updated`, excluded; ``skipped``: those, where already worked out)."""
    if skipped is None:
        skipped = not_updated(gm)
    return sum(
        m["val"].numel()
        for n in gm.graph.find_nodes(op="placeholder")
        for _, m in unpacked(n)
        if m.get(SLOT) == "param" and m[PARAM] not in skipped
    )


__all__ = [
    "AddOptimizerUpdate",
    "build_update",
    "build_update_for",
    "for_every_parameter",
    "gradient_free",
    "not_updated",
    "OptimizerConfig",
    "OPTIMIZERS",
    "STATE_KINDS",
    "STEP_COUNTED",
    "optimizer_state_bytes",
    "step_count_bytes",
    "FLOPS_PER_ELEMENT",
    "Node",
]
