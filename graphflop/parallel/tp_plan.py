"""The default tensor-parallel plan, found from the module structure, and the module layouts a
plan imposes at module boundaries.

Megatron's pattern (Shoeybi et al. 2019, section 3), found without module names: inside a
module below the root holding two or more ``nn.Linear`` layers (an attention block, an MLP;
the root module's own Linears are not paired: the pattern is looked for in blocks, following
a Linear's output through the block's own ops, and a Linear on the root is usually a head,
handled below; a ``--tp-plan`` can pair them, as ``parallelize_module`` shards any module a
plan names), a Linear whose
output reaches another of them through the module's ops (q/k/v or a fused qkv; MLP up and
gate) is column-wise, one whose output reaches none (attention out, MLP down) row-wise; a Linear outside such a module whose
output width is the token embedding's row count (the LM head) is column-wise with its output
gathered (``ColwiseParallel(output_layouts=Replicate())``, as torch's tensor-parallel examples
shard a head; a head that is not a module, as a tied one, stays vocabulary-parallel into the
loss); an
``nn.Embedding`` read with the model's input ids is vocabulary-parallel (``rowwise``, as
``parallelize_module`` shards an embedding), other embeddings (positions) replicated. Under
sequence parallelism, every norm module (``LayerNorm``, ``RMSNorm``, any class named
``*Norm``) is ``sequence_parallel`` and each module holding column-wise layers gathers its
sequence-sharded input once (``prepare_input``: ``PrepareModuleInput(Shard(1) ->
Replicate())``), where the backward reduce-scatters its input's cotangent. Reads ``MODULE``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from graphflop.meta import MODULE
from graphflop.parallel.placement import REPLICATE, Placement, shard
from graphflop.parallel.plan import COLWISE_REPLICATE, PREPARE_INPUT, PlanError, match_style

__all__ = [
    "SEQUENCE_DIM",
    "boundary_layouts",
    "check_tp_plan",
    "default_plan_notes",
    "default_tp_plan",
    "fused_output_error",
    "param_placement",
    "unsharded_note",
]

#: the sequence dim of (batch, sequence, hidden) activations, as torch's SequenceParallel has it
SEQUENCE_DIM = 1


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def default_tp_plan(
    model: nn.Module, forward: GraphModule, sp: bool
) -> tuple[tuple[str, str], ...]:
    """Megatron's column/row plan for ``model`` (see the module docstring), as exact module
    paths → style."""
    mods = dict(model.named_modules())
    linears = [p for p, m in mods.items() if isinstance(m, nn.Linear)]
    embeddings = [p for p, m in mods.items() if isinstance(m, nn.Embedding)]
    per_parent: dict[str, list[str]] = {}
    for p in linears:
        per_parent.setdefault(_parent(p), []).append(p)
    token_embeddings: set[str] = set()
    by_module: dict[str, list[Node]] = {}
    for n in forward.graph.nodes:
        m = n.meta.get(MODULE) or ""
        by_module.setdefault(m, []).append(n)
        if n.op == "call_function" and m in mods and isinstance(mods[m], nn.Embedding):
            if len(n.args) > 1 and isinstance(n.args[1], Node) and n.args[1].op == "placeholder":
                token_embeddings.add(m)
    feeds = {p: _feeds_sibling(p, by_module.get(p, []), per_parent[_parent(p)]) for p in linears}
    vocab = {mods[e].num_embeddings for e in token_embeddings}
    plan: list[tuple[str, str]] = []
    for p in linears:
        lin = mods[p]
        if len(per_parent[_parent(p)]) >= 2 and _parent(p):
            plan.append((p, "colwise" if feeds[p] else "rowwise"))
        elif lin.out_features in vocab:
            plan.append((p, COLWISE_REPLICATE))
    plan += [(e, "rowwise") for e in embeddings if e in token_embeddings]
    if sp:
        plan += [(p, "sequence_parallel") for p, m in mods.items() if _is_norm(m) and p]
        # each module holding column-wise layers gathers its sequence-sharded input once
        # (PrepareModuleInput(Shard(1) -> Replicate()), as torch's tensor-parallel tutorial)
        cols = [p for p, st in plan if st == "colwise"]
        parents = dict.fromkeys(_parent(c) for c in cols if _parent(c))
        plan += [(p, PREPARE_INPUT) for p in parents]
    return tuple(plan)


#: the styles torch's ColwiseParallel / RowwiseParallel implement, only for these module classes
_SHARDING_STYLES = ("colwise", "rowwise", COLWISE_REPLICATE)


def check_tp_plan(model: nn.Module, tp_plan: tuple[tuple[str, str], ...]) -> None:
    """Check a user's TP plan against ``model``'s modules, as ``parallelize_module`` would.

    Raises:
        PlanError: a pattern that matches no module path (some paths listed), or a
            ``colwise`` / ``rowwise`` entry on a module that is neither ``nn.Linear`` nor
            ``nn.Embedding`` (torch's ColwiseParallel and RowwiseParallel shard only those).
    """
    mods = {p: m for p, m in model.named_modules() if p}
    for pattern, _ in tp_plan:
        if not any(match_style(((pattern, "replicate"),), p) for p in mods):
            paths = list(mods)
            raise PlanError(
                f"TP plan pattern {pattern!r} matches no module; module paths: "
                + ", ".join(paths[:12])
                + (" ..." if len(paths) > 12 else "")
            )
    for p, m in mods.items():
        style = match_style(tp_plan, p)
        if style in _SHARDING_STYLES and not isinstance(m, (nn.Linear, nn.Embedding)):
            raise PlanError(
                f"TP plan entry {style} on {p} ({type(m).__name__}): column- and row-wise "
                "sharding apply to nn.Linear and nn.Embedding only; match those modules, or "
                "give this one sequence_parallel, prepare_input or replicate"
            )


def default_plan_notes(
    model: nn.Module, forward: GraphModule, tp_plan: tuple[tuple[str, str], ...]
) -> list[str]:
    """Notes on where :func:`default_tp_plan`'s column/row pattern was not found: a module
    holding Linears directly where a column-wise Linear's output also leaves the module (it
    joins the residual stream unreduced, not through a row-wise Linear), or where no Linear
    feeds another (all row-wise, none opened by a column-wise one). One note, naming the modules and Linears (at most
    four of each), suggesting ``--tp-plan``; empty when the pattern was found everywhere."""
    style = dict(tp_plan)
    mods = dict(model.named_modules())
    per_parent: dict[str, list[str]] = {}
    for p, m in mods.items():
        if isinstance(m, nn.Linear) and _parent(p):
            per_parent.setdefault(_parent(p), []).append(p)
    by_module: dict[str, list[Node]] = {}
    for n in forward.graph.nodes:
        by_module.setdefault(n.meta.get(MODULE) or "", []).append(n)
    leaking: list[str] = []
    unopened: list[str] = []
    parents: list[str] = []
    for parent, lins in per_parent.items():
        if len(lins) < 2:
            continue
        cols = [p for p in lins if style.get(p) == "colwise"]
        bad = [c for c in cols if _leaves_parent(c, by_module.get(c, []), lins)]
        if not cols:  # no Linear feeds another: each row-wise one reads a whole input
            unopened.append(parent)
        elif not bad:
            continue
        leaking += bad
        parents.append(parent)
    if not parents:
        return []

    def few(xs: list[str]) -> str:
        return ", ".join(xs[:4]) + (f" and {len(xs) - 4} more" if len(xs) > 4 else "")

    classes = sorted({type(mods[p]).__name__ for p in parents})
    why = []
    if leaking:
        why.append(
            f"column-wise {few(leaking)} also feed{'s' if len(leaking) == 1 else ''} the "
            "module's output (the residual stream) rather than only a row-wise Linear"
        )
    if unopened:
        why.append(
            f"in {few(unopened)} no Linear feeds another, so all are row-wise, each reading a "
            "whole (replicated) input"
        )
    return [
        f"the default TP plan found no Megatron column/row pattern in {few(parents)} "
        f"({', '.join(classes)}, Linears held directly): {'; '.join(why)}; its placements "
        "there are a guess: give a --tp-plan file naming each Linear's style"
    ]


def _leaves_parent(linear: str, nodes: list[Node], siblings: list[str]) -> bool:
    """Whether ``linear``'s output leaves its parent module (reaches a node outside it, or
    the graph's output) other than through another Linear of the parent."""
    parent = _parent(linear)
    others = set(siblings) - {linear}
    seen: set[str] = set()
    todo = [u for n in nodes for u in n.users]
    while todo:
        n = todo.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        m = n.meta.get(MODULE) or ""
        if m in others:
            continue
        if n.op == "output" or not _inside(m, parent):
            return True
        todo.extend(n.users)
    return False


def unsharded_note(model: nn.Module, params: list[str]) -> str:
    """The note for matrix parameters (qualified names) that no column- or row-wise module of
    the TP plan holds, naming their modules' classes: a Linear or Embedding can be given a
    style in a ``--tp-plan`` file; torch's ColwiseParallel / RowwiseParallel shard no other
    class (a convolution, a fused projection held as a bare parameter)."""
    mods = dict(model.named_modules())
    cls = {q: type(mods.get(q.rpartition(".")[0], model)).__name__ for q in params}
    shown = ", ".join(f"{q} ({cls[q]})" for q in params[:4]) + (
        f" and {len(params) - 4} more" if len(params) > 4 else ""
    )
    counts: dict[str, int] = {}
    for c in cls.values():
        counts[c] = counts.get(c, 0) + 1
    classes = ", ".join(f"{c} ×{k}" for c, k in counts.items())
    shardable = {
        type(m).__name__ for m in mods.values() if isinstance(m, (nn.Linear, nn.Embedding))
    }
    fix = (
        "give a --tp-plan file to shard the Linear and Embedding ones; "
        if shardable & set(counts)
        else ""
    )
    return (
        f"{len(params)} matrix parameter(s) that no column- or row-wise module of the TP plan "
        f"holds stay whole on every TP rank, their products unsharded: {shown}; by module "
        f"class: {classes} ({fix}column- and row-wise sharding apply to nn.Linear and "
        "nn.Embedding only)"
    )


def nothing_sharded_message(model: nn.Module, tp: int, params: list[str], user_plan: bool) -> str:
    """The one-line refusal when ``--tp`` > 1 shards no parameter: every TP rank would compute
    and hold the whole model (TP multiplies the work, it divides nothing). Names the matrix
    parameters' module classes (``params``, qualified names) and what to do: a ``--tp-plan``
    file naming the nn.Linear and nn.Embedding modules where the model has some, otherwise a
    model built from them, or data/pipeline parallelism instead."""
    mods = dict(model.named_modules())
    counts: dict[str, int] = {}
    for q in params:
        c = type(mods.get(q.rpartition(".")[0], model)).__name__
        counts[c] = counts.get(c, 0) + 1
    held = (
        "its matrix parameters are held by " + ", ".join(f"{c} ×{k}" for c, k in counts.items())
        if counts
        else "it has no matrix parameter"
    )
    shardable = sorted(p for p, m in mods.items() if p and isinstance(m, (nn.Linear, nn.Embedding)))
    if user_plan:
        fix = (
            "give column- or row-wise styles to its nn.Linear or nn.Embedding modules in --tp-plan"
        )
    elif shardable:
        fix = (
            "name its nn.Linear / nn.Embedding modules in a --tp-plan file "
            f"({', '.join(shardable[:3])}{', …' if len(shardable) > 3 else ''})"
        )
        on_root = [p for p in shardable if "." not in p and isinstance(mods[p], nn.Linear)]
        if len(on_root) >= 2:
            fix += (
                ": the default plan pairs the Linears of a block below the root (column-wise, "
                f"then row-wise), not those the root module holds itself ({', '.join(on_root[:3])}"
                f"{', …' if len(on_root) > 3 else ''}), but torch's parallelize_module shards "
                f'them where a plan names them (e.g. {{"{on_root[0]}": "colwise", '
                f'"{on_root[1]}": "rowwise"}} where the first feeds the second)'
            )
        shardable_cls = {
            type(m).__name__ for m in mods.values() if isinstance(m, (nn.Linear, nn.Embedding))
        }
        others = sorted(c for c in counts if c not in shardable_cls)
        if others:
            fix += (
                f"; its {', '.join(others)} parameters stay whole on every rank whatever the plan"
            )

    else:
        fix = "build the model from nn.Linear layers"
    return (
        f"--tp {tp} shards nothing: no parameter is held by a module the TP plan shards "
        f"column- or row-wise ({held}; torch's ColwiseParallel and RowwiseParallel shard "
        "nn.Linear and nn.Embedding only), so every TP rank would compute the whole model: "
        f"drop --tp (spread the model with --dp and --zero 3, or --pp), or {fix}"
    )


_aten = torch.ops.aten
#: ops that split a value into parts along one dim (a fused projection's q, k, v; a gated
#: projection's two halves)
_SPLITS = {_aten.split.Tensor, _aten.split_with_sizes.default, _aten.unbind.int}
_RESHAPES = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default}


def fused_output_error(
    forward: GraphModule, tp_plan: tuple[tuple[str, str], ...], tp: int, failed: str | None
) -> PlanError | None:
    """The refusal that names the real cause when placement propagation failed at node
    ``failed`` on a column-wise module's output split into parts: a fused projection (timm's
    ``attn.qkv``, reshaped to ``(..., 3, heads, head_dim)`` then unbound; a gated projection
    chunked in two). torch's ``ColwiseParallel`` gives each rank a contiguous ``1/tp`` of the
    output features, not its share of each part (Megatron's layout of a fused weight), so no
    ``--tp`` works: the message says so and suggests a ``--tp-plan`` that leaves the fused
    module's parent (the attention) whole. None: ``failed`` does not read such an output."""
    nodes = {n.name: n for n in forward.graph.nodes}
    n = nodes.get(failed or "")
    split: Node | None = None  # the reshape or split nearest the column-wise module
    while n is not None and n.op == "call_function":
        if _innermost_style(tp_plan, _module(n)) == "colwise":
            break
        ins = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(ins) != 1 and n.target not in _RESHAPES | _SPLITS:
            return None
        src = ins[0] if ins else None
        if src is None:
            return None
        if n.target in _SPLITS or (
            n.target in _RESHAPES and len(n.meta["val"].shape) > len(src.meta["val"].shape)
        ):
            split = n
        n = src
    if n is None or n.op != "call_function" or split is None:
        return None
    if split.target in _RESHAPES and not _parts_split(split, len(n.meta["val"].shape) - 1):
        return None  # heads the --tp does not divide, not a fused projection's parts
    fused = _module(n)
    shape = tuple(int(x) for x in n.meta["val"].shape)
    features = shape[-1] if shape else 0
    if split.target in _RESHAPES:
        dst = tuple(int(x) for x in split.meta["val"].shape)
        how = f"is reshaped to {dst}"
        parts = next((d for d in dst[len(shape) - 1 :] if d > 1), 0)
    else:
        val = split.meta.get("val")
        parts = len(val) if isinstance(val, (tuple, list)) else 0
        how = f"is split into {parts} parts (at {_module(split) or 'the model'}, {split.name})"
    what = "fused q/k/v dimension" if parts == 3 else f"fused dimension of its {parts} parts"
    plan = _plan_without(tp_plan, _parent(fused))
    fix = (
        "a --tp-plan file sharding the others, as: " + "; ".join(f"{p}: {s}" for p, s in plan)
        if plan
        else "drop --tp (no other module to shard)"
    )
    share = f"{features // tp} contiguous of its {features} output features" if features else ""
    return PlanError(
        f"--tp {tp} cannot shard {fused} column-wise: its output {shape} {how}: a column-wise "
        f"shard splits the {what} (torch's ColwiseParallel gives each rank {share}, not its "
        f"share of each part), whatever the --tp; keep {_over_repeats(_parent(fused) or fused)} "
        f"whole with "
        f"{fix} (docs/parallel.md)"
    )


def _args(n: Node) -> Any:
    """A node's arguments, untyped (fx's argument type is a wide union)."""
    return n.args


def _parts_split(view: Node, dim: int) -> bool:
    """The reshaped value ``view`` is split (unbound, split, selected) along ``dim``, the
    first dim the reshape cut its last one into (a fused projection's q, k, v), following it
    through permutes, transposes and copies."""
    todo = [(u, dim) for u in view.users]
    while todo:
        u, d = todo.pop()
        t, args = u.target, _args(u)
        if t in (_aten.unbind.int, _aten.select.int):
            if (args[1] if len(args) > 1 else u.kwargs.get("dim", 0)) == d:
                return True
        elif t in (_aten.split.Tensor, _aten.split_with_sizes.default):
            if (args[2] if len(args) > 2 else u.kwargs.get("dim", 0)) == d:
                return True
        elif t is _aten.permute.default:
            todo += [(w, list(args[1]).index(d)) for w in u.users]
        elif t is _aten.transpose.int:
            a, b = args[1], args[2]
            todo += [(w, b if d == a else a if d == b else d) for w in u.users]
        elif t in (_aten.clone.default, _aten.contiguous.default, _aten._to_copy.default):
            todo += [(w, d) for w in u.users]
    return False


def _over_repeats(path: str) -> str:
    """An exact module path as a pattern over its repeats (``blocks.3.mlp`` → ``blocks.*.mlp``);
    a pattern as it is."""
    if path.startswith("re:") or any(c in path for c in "*?["):
        return path
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", path)


def _plan_without(tp_plan: tuple[tuple[str, str], ...], parent: str) -> list[tuple[str, str]]:
    """``tp_plan`` with the entries of ``parent``'s Linears and of its repeats dropped, exact
    paths written as patterns over their repeats (``blocks.3.mlp.fc1`` → ``blocks.*.mlp.fc1``)."""

    drop = _over_repeats(parent)
    out: dict[str, str] = {}
    for path, style in tp_plan:
        p = _over_repeats(path)
        if _parent(p) == drop or (not drop and "." not in p):
            continue
        out.setdefault(p, style)
    return list(out.items())


def _inside(module: str, parent: str) -> bool:
    return module == parent or module.startswith(parent + ".")


def _feeds_sibling(linear: str, nodes: list[Node], siblings: list[str]) -> bool:
    """Whether ``linear``'s output reaches another Linear of its parent module through ops
    inside that parent (a column-wise layer feeds the row-wise one after it)."""
    parent = _parent(linear)
    others = set(siblings) - {linear}
    seen: set[str] = set()
    todo = [u for n in nodes for u in n.users]
    while todo:
        n = todo.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        m = n.meta.get(MODULE) or ""
        if m in others:
            return True
        if m != linear and _inside(m, parent):
            todo.extend(n.users)
    return False


def local_shard_notes(
    forward: GraphModule,
    of: dict[str, Any],
    tp_plan: tuple[tuple[str, str], ...],
) -> list[str]:
    """Notes on column-wise outputs torch hands on as a bare slice: ``ColwiseParallel``
    (``colwise``) returns the local tensor of its ``Shard(-1)`` output
    (``use_local_output=True``), and only a row-wise module (input layout ``Shard(-1)``)
    reads it as the shard it is; ops on the way that act on each slice alone (an activation,
    the product of two such slices) are fine. An op outside the plan's modules that needs the
    whole width (a norm, a Linear with no style, a residual add), or a column-wise module
    (input layout ``Replicate()``), gets the slice under torch: a shape mismatch, or a result
    on the slice, where graphflop gathers or slices the other operand. One note naming those
    consumers (at most four); none where the plan has sequence-parallel or prepare-input
    entries, whose outputs stay DTensors. ``of``: the forward's placements (node name ->
    placement)."""
    if any(s in ("sequence_parallel", PREPARE_INPUT) for _, s in tp_plan):
        return []
    bad: list[str] = []
    split: list[str] = []
    for n in forward.graph.nodes:
        if _innermost_style(tp_plan, _module(n)) == "colwise" and _first(of.get(n.name)):
            whole, parts = _whole_readers(n, of, tp_plan)
            bad += whole
            split += [f"{_module(n)} (at {m})" for m in parts]
    bad, split = list(dict.fromkeys(bad)), list(dict.fromkeys(split))

    def few(xs: list[str]) -> str:
        return ", ".join(xs[:4]) + (f" and {len(xs) - 4} more" if len(xs) > 4 else "")

    notes = []
    if split:
        notes.append(
            f"column-wise {few(split)}: output split into parts on its sharded dim (a fused "
            "projection's chunk or split): torch's ColwiseParallel (colwise) hands on the local "
            "slice of its Shard(-1) output (use_local_output=True), a contiguous 1/tp of the "
            "features, not the rank's share of each part (Megatron's layout of a fused weight, "
            "which graphflop's figures assume); there torch splits the slice, mixing the parts "
            "(a consumer of the whole part width, such as a convolution, fails on the shape): "
            "shard that module's parent differently with a --tp-plan file (leave it whole), or "
            "split the projection into one Linear per part"
        )
    if bad:
        notes.append(
            f"{few(bad)} read{'s' if len(bad) == 1 else ''} a column-wise module's output as a "
            "whole: torch's ColwiseParallel (colwise) hands on the local slice of its Shard(-1) "
            "output (use_local_output=True), which only a row-wise module reads as a shard; "
            "there torch fails on a shape mismatch or computes on the slice, where graphflop "
            "gathers it (or slices the other operand): give that column-wise module "
            "colwise:replicate (its output gathered) or its consumer rowwise"
        )
    return notes


def _whole_readers(
    n: Node, of: dict[str, Any], tp_plan: tuple[tuple[str, str], ...]
) -> tuple[list[str], list[str]]:
    """The modules (or ``the model``) where ``n``'s value, as its column-wise module hands it
    on, is read whole, and those where it is split into parts on its sharded dim (a fused
    projection's ``chunk``): following its users outside that module through ops that keep it
    a slice of the same dim, up to row-wise modules."""
    out: list[str] = []
    split: list[str] = []
    seen = {n.name}
    todo = [u for u in n.users if _module(u) != _module(n) and u.op != "output"]
    while todo:
        u = todo.pop()
        if u.name in seen:
            continue
        seen.add(u.name)
        style = _innermost_style(tp_plan, _module(u))
        if style == "rowwise":
            continue
        if u.target in _SPLITS and _splits_sharded_dim(u, of):
            split.append(_module(u) or "the model")
            continue
        p = _first(of.get(u.name))
        if (
            style is not None
            or not isinstance(p, Placement)
            or p.kind != "S"
            or _whole_operand(u, p.dim, of)
        ):
            out.append(_module(u) or "the model")
            continue
        todo.extend(w for w in u.users if w.op != "output")
    return out, split


def _splits_sharded_dim(n: Node, of: dict[str, Any]) -> bool:
    """Split op ``n`` (split, split_with_sizes, unbind) cuts its input along the input's
    sharded dim."""
    args = _args(n)
    x = args[0]
    p = _first(of.get(x.name)) if isinstance(x, Node) else None
    if not isinstance(p, Placement) or p.kind != "S":
        return False
    kwargs: Any = n.kwargs
    d: int = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if n.target is _aten.unbind.int:
        d = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    ndim = len(x.meta["val"].shape)
    return (d + ndim if d < 0 else d) == p.dim


def _innermost_style(tp_plan: tuple[tuple[str, str], ...], path: str) -> str | None:
    parts = path.split(".") if path else []
    for i in range(len(parts), 0, -1):
        style = match_style(tp_plan, ".".join(parts[:i]))
        if style is not None:
            return style
    return None


def _first(p: Any) -> Any:
    return p[0] if isinstance(p, (tuple, list)) and p else p


def _whole_operand(n: Node, dim: int, of: dict[str, Any]) -> bool:
    """Another tensor operand of ``n`` spans its output's sharded ``dim`` whole (not itself a
    shard there, as the other column-wise slice of ``q @ k`` or ``silu(gate) * up`` is)."""
    out = getattr(n.meta.get("val"), "shape", ())
    operands = [a for a in n.all_input_nodes if hasattr(a.meta.get("val"), "shape")]
    for a in operands if len(operands) > 1 else ():  # one: the slice itself (a view)
        v = a.meta["val"]
        i = dim - (len(out) - len(v.shape))
        q = _first(of.get(a.name))
        sharded = isinstance(q, Placement) and q.kind == "S" and q.dim == i
        if 0 <= i < len(v.shape) and int(v.shape[i]) > 1 and not sharded:
            return True
    return False


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("Norm")


def param_placement(
    qualified: str,
    shape: tuple[int, ...],
    tp_plan: tuple[tuple[str, str], ...],
    embeddings: frozenset[str],
) -> Placement:
    """A parameter's placement under the plan, as torch's ``ColwiseParallel`` and
    ``RowwiseParallel`` distribute it (``torch/distributed/tensor/parallel/style.py``):
    ``colwise`` shards a Linear's weight (out, in) and bias on dim 0 and an Embedding's weight
    (vocabulary, width) on dim 1, its width; ``rowwise`` a Linear's weight on dim 1 (its bias
    replicated) and an Embedding's weight on dim 0, the vocabulary; everything else
    replicated. ``embeddings``: the nn.Embedding modules' paths."""
    module, _, leaf = qualified.rpartition(".")
    style = match_style(tp_plan, module)
    if style in ("colwise", COLWISE_REPLICATE):
        if module in embeddings and len(shape) == 2:
            return shard(1, shape[1])
        return shard(0, shape[0])
    if style == "rowwise":
        if module in embeddings:
            return shard(0, shape[0])
        if leaf == "weight" and len(shape) == 2:
            return shard(1, shape[1])
    return REPLICATE


def boundary_layouts(  # noqa: C901 (one rule per style and direction)
    tp_plan: tuple[tuple[str, str], ...], sp: bool
) -> Callable[[Node, Node, Placement, bool], Placement | None]:
    """The layouts ``parallelize_module`` imposes where a value crosses into or out of modules
    the plan names (see :mod:`graphflop.parallel.placement`): ``(value, consumer, placement,
    forward) -> placement`` the consumer reads, or None for no change. The styled modules the
    value leaves apply their output layouts (innermost first), then those the consumer enters
    their input layouts (outermost first)."""

    @cache
    def chain(path: str) -> tuple[tuple[str, str], ...]:
        """The styled modules containing ``path``, innermost first."""
        parts = path.split(".") if path else []
        out = []
        for i in range(len(parts), 0, -1):
            m = ".".join(parts[:i])
            s = match_style(tp_plan, m)
            if s is not None:
                out.append((m, s))
        return tuple(out)

    def seq(value: Node) -> Placement | None:
        v = value.meta.get("val")
        shape = getattr(v, "shape", ())
        if len(shape) < 3:
            return None
        return shard(SEQUENCE_DIM, int(shape[SEQUENCE_DIM]))

    def leave(style: str, value: Node, q: Placement, forward: bool) -> Placement:
        if forward:
            if style == COLWISE_REPLICATE and q.kind == "S":
                return REPLICATE  # the output gathered
            if style == "rowwise" and q.kind == "P":
                return (seq(value) if sp else None) or REPLICATE
            return q
        if q.kind != "P":
            return q
        if style == PREPARE_INPUT:  # the mirror of its gather: a reduce-scatter
            return seq(value) or REPLICATE
        if style == COLWISE_REPLICATE:
            return (seq(value) if sp else None) or REPLICATE
        if style == "colwise" and not sp:
            return REPLICATE
        return q  # under SP a column-wise input cotangent is reduced where its input was gathered

    def enter(style: str, value: Node, q: Placement, forward: bool) -> Placement:
        if forward and style in ("colwise", COLWISE_REPLICATE, PREPARE_INPUT):
            return REPLICATE
        if not forward and style == COLWISE_REPLICATE and q == REPLICATE:
            # the gathered output's cotangent: each rank keeps its slice
            shape = getattr(value.meta.get("val"), "shape", ())
            return shard(len(shape) - 1, int(shape[-1])) if shape else q
        if not forward and style == "rowwise" and (q.kind == "P" or q == seq(value)):
            # the output cotangent entering (a weight cotangent accumulated here is not)
            return REPLICATE
        if style == "sequence_parallel":
            return seq(value) or q
        return q

    def layout(value: Node, consumer: Node, p: Placement, forward: bool) -> Placement | None:
        a = chain(_module(value))
        b = chain(_module(consumer))
        if a == b:
            return None
        q = p
        for m, style in a:
            if (m, style) not in b:
                q = leave(style, value, q, forward)
        for m, style in reversed(b):
            if (m, style) not in a:
                q = enter(style, value, q, forward)
        return None if q == p else q

    return layout


def _module(n: Node) -> str:
    return n.meta.get(MODULE) or ""
