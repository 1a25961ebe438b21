"""What every rank computes, holds and sends under a :class:`~graphflop.parallel.plan.Plan`,
from an :class:`~graphflop.analysis.Analysis` of one micro-batch on one data-parallel rank.

The forward and backward graphs are put on the plan: tensor-parallel placements propagated
node by node (:mod:`graphflop.parallel.placement`) give each node's local cost and the TP
collectives; each node is given a pipeline stage (blocks split by FLOPs); the data-parallel
collectives follow the ZeRO stage as torch runs it:

- ZeRO 0 (DDP): one all_reduce per gradient bucket (the first bucket 1 MiB, the others 25 MiB,
  ``DistributedDataParallel``'s defaults, filled in the order the backward makes the
  gradients), once per step (gradient accumulation under ``no_sync``).
- ZeRO 1 (``ZeroRedundancyOptimizer``): DDP's all_reduces, then after the step one broadcast
  per parameter from the rank that owns it (parameters dealt largest first to the rank with the
  fewest elements so far); the optimizer state of the owned parameters only.
- ZeRO 2 (FSDP ``SHARD_GRAD_OP``) and ZeRO 3 (FSDP2 ``fully_shard``): one unit per block plus
  the root (the rest); per micro-batch a forward all_gather of each unit's parameters (each
  padded on dim 0 to a multiple of the DP group, FSDP2's padding) and a reduce_scatter of its
  gradients; ZeRO 3 gathers each block again in the backward (the root stays gathered).

Pipeline parallelism: the blocks (:func:`pipeline_units`: the chain of the analysis's outlined
block calls, in execution order, with the modules of their class traced in full beside them;
without one, the children of the outermost ``ModuleList``/``Sequential`` of one module class,
:func:`find_blocks`) split into ``pp · chunks`` runs balanced by FLOPs (:func:`_balanced_split`:
the costliest stage as cheap as it can be), the nodes before the blocks on the first stage,
those after on the last, those between two blocks with the one before; per micro-batch a
send of each activation crossing a stage boundary and, in the backward, of its cotangent; the
bubble fraction (p − 1)/(v·m + p − 1) of GPipe, 1F1B and interleaved 1F1B with v chunks
(Narayanan et al. 2021, section 2.2); micro-batches whose activations a stage holds at once:
GPipe m, 1F1B min(p − s, m), interleaved min(2(p − s − 1) + (v − 1)p + 1, v·m) chunk
micro-batches of 1/v of the stage each (Megatron's warm-up count).

Memory per rank: parameters, gradients and optimizer state as the ZeRO stage shards them
(ZeRO 2 and 3 hold the parameter shards at rest), activations (the eager memory model's saved
tensors, each at its local TP size) × in flight, FSDP's gathered parameters, DDP's gradient
buckets and a pipeline stage's receive buffers (one per micro-batch and received tensor), the
micro-batch (a pipeline's first stage every micro-batch's inputs, its last their targets), and
the step's rise. With one stage, one micro-batch and every block analysed (or blocks counted,
:func:`_local_schedule_rise`), the rise is the eager memory model's train schedule with every
storage at its local size under the TP placements, each TP redistribution's new tensor (what
autograd saves where a consumer reads the redistributed value: under SP the gathered inputs of
attention and MLP) and, under ZeRO 2/3, FSDP's buffers where its engine makes and frees them
(gathered units, FSDP2's all-gather output and copy-out, its backward prefetch, the flat
gradient or reduce-scatter input and the gradient shard; :func:`_fsdp_schedule_rise`, blocks
counted from one analysed block too); the gathered parameters live at its peak are reported as
``all_gather_buffers``. With pipeline stages (ZeRO 0/1), that schedule's steps of each of the
rank's stages are replayed per micro-batch in the pipeline schedule's order
(:func:`_pipeline_rise`; blocks counted from one analysed per stage: its copies offset in per
stage and micro-batch, :func:`_copies_peak`). Otherwise
the rise is the analysis's eager train peak less its parameters and optimizer state, scaled by
this rank's gradients plus activations in flight over the single rank's, and the gathered
buffers are ZeRO 3's two largest units or ZeRO 2's every unit (an estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from graphflop.meta import LOSS_KIND, MODULE, RESIDUAL, ROLE, SIGNATURE, SOURCE, VJP
from graphflop.parallel.placement import (
    REPLICATE,
    Collective,
    Placement,
    Placements,
    local_shape,
    propagate,
)
from graphflop.parallel.plan import Plan, PlanError, too_many_stages
from graphflop.parallel.tp_plan import (
    boundary_layouts,
    check_tp_plan,
    default_plan_notes,
    default_tp_plan,
    fused_output_error,
    local_shard_notes,
    nothing_sharded_message,
    param_placement,
    unsharded_note,
)
from graphflop.passes.eager_attention import eager_attention_flops, fused_score_products
from graphflop.passes.eager_memory import (
    eager_saved_storages,
    eager_train_schedule,
    optimizer_temporaries,
)
from graphflop.passes.memory import Schedule, Step
from graphflop.passes.optimizer import STATE_KINDS, not_updated, step_count_bytes
from graphflop.report import EagerAttention

__all__ = ["PlanReport", "RankClass", "find_blocks", "pipeline_units", "predict"]

DDP_FIRST_BUCKET_BYTES = 1024 * 1024
#: ops of torch.optim's single-tensor step that read a gradient: Adam/AdamW lerp_ and the two
#: operands of addcmul_; SGD and momentum one add
_GRAD_READS = {"adam": 3, "adamw": 3, "sgd": 1, "momentum": 1}
DDP_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True)
class RankClass:
    """Figures shared by a class of identical ranks (one pipeline stage: dp · tp ranks).

    Attributes:
        name: ``all ranks``, ``stage 0 (first)``, ``stage k (middle)``, ``stage p-1 (last)``.
        stage: pipeline stage.
        ranks: ranks in the class.
        blocks: the block module paths this stage runs.
        flops: per step (all micro-batches): forward, backward, recompute, update, total.
        mm_flops: the matrix-product part of the same (FlopCounterMode's convention).
        memory_bytes: parameters, gradients, optimizer_state (with Adam's step counts),
            activations (saved tensors × in flight), all_gather_buffers (FSDP's gathered
            parameters at the peak), engine_buffers (DDP's gradient buckets, a pipeline
            stage's receive buffers), batch (the micro-batch's inputs and targets; a pipeline
            stage's inputs or targets of every micro-batch), step_rise (the rest of the step's
            rise over its start: gradients, activations and temporaries as they coexist at the
            peak; see the module docstring), buffers (the module buffers the stage holds:
            running statistics, masks, rotary tables; whole on every rank), peak = parameters +
            buffers + optimizer_state + all_gather_buffers + engine_buffers + batch + step_rise.
        in_flight: micro-batches whose activations the stage holds at its peak (fractional
            for interleaved chunks).
        collectives: per step, each with its group (tp, dp, pp).
        fits: peak ≤ the device's memory, or None without a device.
    """

    name: str
    stage: int
    ranks: int
    blocks: tuple[str, ...]
    flops: dict[str, int]
    mm_flops: dict[str, int]
    memory_bytes: dict[str, int]
    in_flight: float
    collectives: tuple[Collective, ...]
    fits: bool | None = None

    def collective_bytes(self) -> dict[str, int]:
        """Bytes of the whole tensors per group (tp, dp, pp)."""
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.group] = out.get(c.group, 0) + c.bytes()
        return out

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "stage": self.stage,
            "ranks": self.ranks,
            "blocks": list(self.blocks),
            "flops": self.flops,
            "mm_flops": self.mm_flops,
            "memory_bytes": self.memory_bytes,
            "in_flight_micro_batches": self.in_flight,
            "collective_bytes": self.collective_bytes(),
            "collectives": [c.to_dict() for c in self.collectives],
            "fits": self.fits,
        }


@dataclass(frozen=True)
class PlanReport:
    """The plan's per-rank figures.

    Attributes:
        model: model name.
        plan: the plan (with the TP plan used, the default one filled in).
        micro_batch: samples per micro-batch per DP rank; global_batch: dp · m · micro_batch.
        ranks: one :class:`RankClass` per pipeline stage.
        bubble: the pipeline bubble's fraction of the step's time.
        balance: the busiest stage's FLOPs over the mean stage's (1 = balanced).
        split: how the stages were cut.
        stages: the blocks (module paths) of each virtual stage in order, one tuple per
            virtual stage (``--blocks``: the analysed block, once); the first path of each
            stage after the first is where torch's pipelining splits
            (``split_spec={path: SplitPoint.BEGINNING}``).
        device, device_memory_bytes: what fits/does not fit was judged against.
        notes: assumptions stated.
        loss: the loss the train graph ends in (``cross_entropy``, ``sum``, ...; JSON: in
            ``plan``).
        assumptions: the analysis's assumptions beyond the shapes (``Report.assumptions``:
            a routed mixture of experts' rows per expert), one line each.
        eager_attention: the attention calls run on PyTorch's fused kernel
            (as ``Report.eager_attention``, whole model per micro-batch, the copies of
            ``--blocks`` counted): the ranks' backward
            FLOPs count its recomputed score products, as eager PyTorch runs them, where
            ``inspect``'s totals count the graph's math form; None where there are none (JSON:
            ``null``).
    """

    model: str
    plan: Plan
    micro_batch: int
    global_batch: int
    ranks: tuple[RankClass, ...]
    bubble: float
    balance: float
    split: str
    device: str | None = None
    device_memory_bytes: int | None = None
    notes: tuple[str, ...] = field(default=())
    stages: tuple[tuple[str, ...], ...] = field(default=())
    loss: str | None = None
    assumptions: tuple[str, ...] = field(default=())
    eager_attention: EagerAttention | None = None
    #: what the render reads: the forward graph, its placements and each node's stage
    detail: Any = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        """The ``graphflop plan --json`` document."""
        return {
            "model": self.model,
            "plan": {**self.plan.to_dict(), "loss": self.loss},
            "micro_batch": self.micro_batch,
            "global_batch": self.global_batch,
            "bubble": self.bubble,
            "balance": self.balance,
            "split": self.split,
            "stages": [list(st) for st in self.stages],
            "device": self.device,
            "device_memory_bytes": self.device_memory_bytes,
            "ranks": [r.to_dict() for r in self.ranks],
            "notes": list(self.notes),
            "assumptions": list(self.assumptions),
            "eager_attention": (
                None
                if self.eager_attention is None
                else {**self.eager_attention.to_dict(), "describes": PLAN_ATTENTION}
            ),
        }


#: what a plan's ``eager_attention`` says about the ranks' FLOPs
PLAN_ATTENTION = (
    "ranks' backward FLOPs count eager PyTorch: these calls on the fused kernel, whose backward "
    "recomputes q.k^T (5 products, 2.5x the forward's); inspect's totals count graphflop's graph, "
    "attention in its math form (4 products, 2x), backward_recompute_flops less (whole model, "
    "per micro-batch; at local size on TP ranks). Which calls run fused is PyTorch's CPU rule "
    "(use_flash_attention_cpp), taken for cuda too, unmeasured there"
)


def find_blocks(model: nn.Module) -> list[str]:
    """The module paths of the model's repeated blocks: the children of its outermost
    ``ModuleList``/``Sequential`` whose children are all one class (two or more children
    before one; then the fewest dots in its path; then the longest; ties the first). Outermost, not longest: a mixture of
    experts' ``layers.0.experts`` (8 experts) lies inside its 3 layers, which are the blocks a
    pipeline splits."""
    best: list[str] = []
    best_key: tuple[bool, int, int] | None = None
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or not len(m):
            continue
        kids = list(m.named_children())
        if len({type(c) for _, c in kids}) != 1:
            continue
        key = (len(kids) < 2, path.count(".") + (1 if path else 0), -len(kids))
        if best_key is None or key < best_key:
            best_key = key
            best = [f"{path}.{k}" if path else k for k, _ in kids]
    return best


def pipeline_units(fwd: GraphModule, model: nn.Module) -> tuple[list[str], str]:
    """The module paths of the units a pipeline's stage boundaries fall between, in execution
    order, and how they were found (``calls`` or ``list``).

    From the analysis's hierarchy (:data:`~graphflop.meta.HIERARCHY`): the modules of its
    outlined block calls, with the modules of the same class beside them that were traced in
    full (a first block that differs from the rest, ResNet's downsampling bottleneck, a dense
    layer before mixture-of-experts layers: modules of that class where the class is not
    torch's own, or in the same parent module as a call), the outermost of those; then the
    longest chain of them in execution order, each reading what the one before it made
    (directly, or through nodes outside every unit), the first such chain on ties. Where a
    boundary between two of the chain's units would cut a module around one (a node between
    them runs in a module enclosing it: experts outlined inside layers that were not, a first
    layer's attention outlined with the later layers' attention inside them), each such unit
    is replaced by the innermost such module and the chain found again. Without a chain of
    two units (no hierarchy: nothing repeated was outlined), the children of the outermost
    ``ModuleList``/``Sequential`` of one class (:func:`find_blocks`).
    """
    from graphflop.meta import HIERARCHY

    h = fwd.meta.get(HIERARCHY)
    paths = dict(model.named_modules())
    seeds = sorted({_site_root(s) for s in h.sites} if h is not None else set())
    seeds = [p for p in seeds if p in paths]
    nodes = [n for n in fwd.graph.nodes if n.op == "call_function"]
    for _ in range(64):  # each round lifts a unit to a module enclosing it
        if not seeds:
            break
        chain = _unit_chain(nodes, _with_same_class(seeds, paths))
        if chain is None:
            break
        units, cut = chain
        if not cut:
            return units, "calls"
        lifted = sorted({cut.get(p, p) for p in units})
        if lifted == seeds:
            break
        seeds = lifted
    return find_blocks(model), "list"


def _site_root(site: Any) -> str:
    """The module path a call site calls (its template's nodes' paths are ``@`` and
    ``@.child``: the called module's own and its submodules')."""
    rel, path = site.modules[0]
    suffix = rel[1:]  # "" for "@", ".0.attn" for "@.0.attn"
    return path[: len(path) - len(suffix)] if suffix else path


def _with_same_class(seeds: list[str], paths: dict[str, nn.Module]) -> list[str]:
    """``seeds`` with the modules of a seed's class (one not defined by torch, or beside a
    seed in its parent), the outermost of them, none enclosing a seed of its own class (T5's
    first block encloses outlined calls of other classes: the block is the unit)."""
    classes = {type(paths[p]) for p in seeds}
    parents = {p.rpartition(".")[0] for p in seeds}
    cands = set(seeds)
    for p, m in paths.items():
        if not p or type(m) not in classes:
            continue
        if type(m).__module__.startswith("torch.") and p.rpartition(".")[0] not in parents:
            continue
        if any(s.startswith(p + ".") and type(paths[s]) is type(m) for s in seeds):
            continue  # a list of blocks like itself, not one of them
        cands.add(p)
    return sorted(c for c in cands if not any(c.startswith(o + ".") for o in cands))


def _unit_chain(nodes: list[Node], cands: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """The longest chain of ``cands`` (module paths) in the order their first nodes run, each
    reading what the one before it made, and its units that a boundary would cut out of a
    module enclosing them (a node between the chain's first and last unit, in no unit, runs
    in that module), each with the innermost such module; None without a chain of two."""
    of = _unit_index(cands)
    unit = {n: of(n.meta.get(MODULE) or "") for n in nodes}
    first: dict[int, int] = {}
    for i, n in enumerate(nodes):
        u = unit[n]
        if u is not None:
            first.setdefault(u, i)
    upstream: dict[Node, frozenset[int]] = {}
    edges: dict[int, set[int]] = {}
    for n in nodes:
        feeds: set[int] = set()
        for a in n.all_input_nodes:
            w = unit.get(a)
            feeds |= {w} if w is not None else upstream.get(a, frozenset())
        u = unit[n]
        if u is None:
            upstream[n] = frozenset(feeds)
        else:
            edges.setdefault(u, set()).update(w for w in feeds if w != u)
    order = sorted(first, key=first.__getitem__)
    length: dict[int, int] = {}
    before: dict[int, int | None] = {}
    for u in order:
        prev = [w for w in edges.get(u, ()) if first.get(w, len(nodes)) < first[u]]
        best = max(prev, key=lambda w: (length[w], -first[w]), default=None)
        length[u] = 1 + (length[best] if best is not None else 0)
        before[u] = best
    if not length or max(length.values()) < 2:
        return None
    end = max(order, key=lambda u: (length[u], -first[u]))
    chain = [end]
    while before[chain[-1]] is not None:
        chain.append(before[chain[-1]])  # type: ignore[arg-type]
    chain.reverse()
    units = [cands[u] for u in chain]
    # nodes between the chain's first and last unit outside every unit
    span = range(first[chain[0]], max(i for i, n in enumerate(nodes) if unit[n] == chain[-1]))
    between = {m for i in span if unit[nodes[i]] is None and (m := nodes[i].meta.get(MODULE) or "")}
    cut = {}
    for u in units:
        around = [m for m in between if u.startswith(m + ".")]
        if around:
            cut[u] = max(around, key=len)
    return units, cut


def _check_block_order(fwd: GraphModule, blocks: list[str]) -> None:
    """Refuse a forward graph whose blocks do not run once each, in order (a block called
    again after a later one): pipeline stages hand each micro-batch on in one direction.

    Raises:
        PlanError: naming the block that runs again and the block it runs after.
    """
    index = {b: i for i, b in enumerate(blocks)}
    last = -1
    for n in fwd.graph.nodes:
        path = n.meta.get(MODULE) or ""
        parts = path.split(".")
        i = next(
            (index[p] for k in range(len(parts), 0, -1) if (p := ".".join(parts[:k])) in index),
            None,
        )
        if i is None:
            continue
        if i < last:
            raise PlanError(
                f"block {blocks[i]} runs again after {blocks[last]}: pipeline stages need each "
                "block to run once, in order; drop --pp"
            )
        last = i


def _unit_index(units: list[str]):
    """module path -> the index of the unit it lies in (its own or an enclosing path), or None."""
    index = {u: i for i, u in enumerate(units)}

    def of(path: str) -> int | None:
        parts = path.split(".") if path else []
        for k in range(len(parts), 0, -1):
            i = index.get(".".join(parts[:k]))
            if i is not None:
                return i
        return None

    return of


def _unit_of_nodes(gm: GraphModule, units: list[str], entry: int, exit_: int) -> dict[str, int]:
    """node name -> the index of the unit it runs in: a unit's nodes (by module path) its
    index; nodes before any unit's node ``entry``, after the last ``exit_``, between units the
    previous unit's (what a stage boundary before the next unit leaves on this side)."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    of = _unit_index(units)
    found = [of(n.meta.get(MODULE) or "") for n in nodes]
    last = max((i for i, u in enumerate(found) if u is not None), default=-1)
    out, cur = {}, None
    for i, n in enumerate(nodes):
        if found[i] is not None:
            cur = found[i]
            out[n.name] = cur
        elif cur is None:
            out[n.name] = entry
        elif i > last:
            out[n.name] = exit_
        else:
            out[n.name] = cur
    return out


def _unit_costs(fwd, bwd, fp, bp, f_unit, b_unit, n: int) -> list[int]:
    """FLOPs of one micro-batch (forward and backward, each node at its local TP cost) of what
    runs before the units, of each unit, and after them: ``n + 2`` entries."""
    out = [0] * (n + 2)
    for gm, pl, unit in ((fwd, fp, f_unit), (bwd, bp, b_unit)):
        for node in gm.graph.nodes:
            c = pl.cost.get(node.name)
            if c is not None and node.name in unit:
                out[unit[node.name] + 1] += c.flops
    return out


def _balanced_split(costs: list[int], stages: int, pre: int, post: int) -> list[int]:
    """Units per stage: ``costs`` (in order) cut into ``stages`` runs of one or more units, the
    first run also costing ``pre`` and the last ``post``, so that the costliest stage costs the
    least; among those the next costliest, and so on (stage costs compared sorted, largest
    first); among those the earlier stages taking more units. Identical costs and no
    ``pre``/``post``: the split by count, the first stages taking the remainder.

    Raises:
        ValueError: fewer units than stages.
    """
    n = len(costs)
    if n < stages:
        raise ValueError(f"{n} units cannot fill {stages} stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def run(i: int, j: int, s: int) -> int:
        return prefix[j] - prefix[i] + (pre if s == 0 else 0) + (post if s == stages - 1 else 0)

    # best[s][j]: (stage costs sorted largest first, negated counts) of the best split of the
    # first j units into s + 1 stages, and its counts
    best: list[dict[int, tuple[tuple, list[int]]]] = [{} for _ in range(stages)]
    for j in range(1, n - stages + 2):
        best[0][j] = ((run(0, j, 0),), [j])
    for s in range(1, stages):
        for j in range(s + 1, n - (stages - 1 - s) + 1):
            cands = []
            for i in range(s, j):
                if i not in best[s - 1]:
                    continue
                key, counts = best[s - 1][i]
                new = tuple(sorted((*key, run(i, j, s)), reverse=True))
                cands.append(((new, [-k for k in counts] + [-(j - i)]), counts + [j - i]))
            key_, counts_ = min(cands, key=lambda c: c[0])
            best[s][j] = (key_[0], counts_)
    return best[stages - 1][n][1]


def _dtype(v: Any) -> str:
    return str(v.dtype).removeprefix("torch.")


def predict(  # noqa: C901
    analysis: Any,
    model: nn.Module,
    plan: Plan,
    *,
    micro_batch: int,
    device_memory_bytes: int | None = None,
    device: str | None = None,
    memory_device: str = "cpu",
    block_counts: tuple[int, ...] | None = None,
    total_blocks: int | None = None,
) -> PlanReport:
    """Per-rank FLOPs, memory and collectives of ``plan`` (see the module docstring).

    Args:
        analysis: :func:`graphflop.analysis.analyze` of ``model`` on one micro-batch (its
            backward and update built).
        model: the model (meta device is fine): its module tree gives the blocks and the
            default TP plan.
        plan: the plan.
        micro_batch: samples per micro-batch (the analysis's batch).
        device_memory_bytes, device: the device's memory, for fits/does not fit.
        memory_device: the eager memory model's device (``cpu`` or ``cuda``).
        block_counts: the blocks each virtual stage of the real model has, when ``analysis``
            is of the model built with one block per virtual stage (identical blocks: each
            block's nodes, parameters, saved tensors and collectives count that many times).
        total_blocks: the blocks the real model has, when ``analysis`` is of the model built
            with one block per virtual stage (``plan --blocks``): they are split between the
            stages as the real model's analysis would split them (each costing the analysed
            blocks' mean FLOPs) and counted as ``block_counts`` has them.

    Raises:
        PlanError: more stages than blocks; a TP degree that does not divide a sharded dim;
            ``block_counts`` or ``total_blocks`` with an analysis whose blocks are not one per
            virtual stage.
    """
    fwd, bwd = analysis.forward, analysis.backward
    if bwd is None:
        raise PlanError("a plan needs the backward graph: the model's output has no loss")
    rep = analysis.report
    sig = fwd.meta[SIGNATURE]
    phs = {n.name: n for n in fwd.graph.nodes if n.op == "placeholder"}
    param_of = dict(sig.params)  # placeholder → qualified name
    trainable = {q for _, q in sig.trainable()}
    # trainable parameters the backward gives no gradient (the update skips them): torch.optim
    # makes no state for a parameter whose .grad stays None, and DDP leaves a globally unused
    # parameter's .grad None, as FSDP2 does its sharded one; FSDP1's flat parameter
    # (ZeRO-2 here) gives every parameter that requires grad a gradient, zeros for these
    update = analysis.update
    stateless = not_updated(update) if update is not None and plan.zero != 2 else frozenset()
    notes: list[str] = []

    # tensor parallelism ----------------------------------------------------------------------
    user_plan = bool(plan.tp_plan)
    if user_plan:
        check_tp_plan(model, plan.tp_plan)
    tp_plan = plan.tp_plan or (default_tp_plan(model, fwd, plan.sp) if plan.tp > 1 else ())
    if tp_plan and not plan.tp_plan:
        notes += default_plan_notes(model, fwd, tp_plan)
    from dataclasses import replace as _replace

    plan = _replace(plan, tp_plan=tp_plan)
    embeddings = frozenset(p for p, m in model.named_modules() if isinstance(m, nn.Embedding))
    pplace: dict[str, Placement] = {}
    for ph, q in sig.params:
        shape = tuple(int(s) for s in phs[ph].meta["val"].shape)
        pplace[q] = param_placement(q, shape, tp_plan, embeddings) if plan.tp > 1 else REPLICATE
        if pplace[q].kind == "S" and shape[pplace[q].dim] % plan.tp:
            raise PlanError(
                f"--tp {plan.tp} does not divide dim {pplace[q].dim} ({shape[pplace[q].dim]}) "
                f"of {q}, which the TP plan shards (hidden, heads or vocabulary): choose a --tp "
                "that divides it"
            )
    if plan.tp > 1 and not any(pl.kind == "S" for pl in pplace.values()):
        raise PlanError(
            nothing_sharded_message(
                model,
                plan.tp,
                [q for ph, q in sig.params if len(phs[ph].meta["val"].shape) >= 2],
                user_plan,
            )
        )
    if plan.tp > 1:
        unsharded = [
            q
            for ph, q in sig.params
            if pplace[q].kind != "S" and len(phs[ph].meta["val"].shape) >= 2
        ]
        if unsharded:
            notes.append(unsharded_note(model, unsharded))
    layouts = boundary_layouts(tp_plan, plan.sp)
    vocab = frozenset(
        e
        for e in embeddings
        if pplace.get(f"{e}.weight", REPLICATE).kind == "S" and pplace[f"{e}.weight"].dim == 0
    )
    f_init = {ph: pplace[q] for ph, q in sig.params}
    try:
        fp = propagate(
            fwd,
            plan.tp,
            phase="forward",
            init=f_init,
            boundary=layouts,
            params=set(f_init),
            vocab=vocab,
        )
    except PlanError as e:
        fused = fused_output_error(fwd, tp_plan, plan.tp, e.node)
        if fused is None:
            raise
        raise fused from e
    if plan.tp > 1 and not plan.sp:
        notes += local_shard_notes(fwd, fp.of, tp_plan)
    b_init: dict[str, Placement] = {}
    b_params: set[str] = set()
    for n in bwd.graph.nodes:
        if n.op != "placeholder":
            continue
        src = n.meta.get(SOURCE, n.name)
        if src in param_of:
            b_init[n.name] = pplace[param_of[src]]
            b_params.add(n.name)
        elif isinstance(fp.of.get(src), Placement):
            b_init[n.name] = fp.moved_to.get(src, fp.of[src])
    out_node = next(n for n in bwd.graph.nodes if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    grad_want = {
        outs[i].name: pplace[q]
        for i, q in bwd.meta[VJP].grads
        if i < len(outs) and isinstance(outs[i], Node)
    }
    bp = propagate(
        bwd,
        plan.tp,
        phase="backward",
        init=b_init,
        boundary=layouts,
        params=b_params,
        grad_of=lambda a: grad_want.get(a.name),
        vocab=vocab,
        grad_reads=_GRAD_READS.get(getattr(rep.totals.update, "optimizer", ""), 1),
    )

    # pipeline stages ---------------------------------------------------------------------
    blocks, found_by = pipeline_units(fwd, model)
    vstages = plan.virtual_stages
    if plan.pp > 1 and not blocks:
        raise PlanError(
            "the model has no repeated blocks to split into pipeline stages (no chain of "
            "repeated block calls, no ModuleList or Sequential of one block class): drop --pp"
        )
    if plan.pp > 1 and total_blocks is not None and vstages > total_blocks:
        raise too_many_stages(plan, total_blocks, "--blocks gives")
    if plan.pp > 1 and vstages > len(blocks) and total_blocks is None:
        raise too_many_stages(plan, len(blocks))
    if plan.pp > 1:
        _check_block_order(fwd, blocks)
    f_unit = _unit_of_nodes(fwd, blocks, -1, len(blocks))
    b_unit = _unit_of_nodes(bwd, blocks, len(blocks), -1)
    # a backward node belongs where the forward node it differentiates runs
    for n in bwd.graph.nodes:
        src = n.meta.get(SOURCE)
        if src in f_unit and n.op != "placeholder":
            b_unit[n.name] = f_unit[src]
    weight_of_block = {b: 1 for b in blocks}
    unit_cost = _unit_costs(fwd, bwd, fp, bp, f_unit, b_unit, len(blocks))
    if total_blocks is not None and block_counts is None:
        if len(blocks) != vstages:
            raise PlanError(
                f"--blocks: the model built with one block per pipeline stage ({vstages}) has "
                f"{len(blocks)} repeated blocks: the argument --blocks names does not set the "
                "number of blocks; name the constructor argument that does (n_layer=48, "
                "num_hidden_layers=80)"
            )
        # the real model's blocks are copies of the analysed one: each costs the analysed
        # blocks' mean, and they are split as the full analysis would split them
        each = round(sum(unit_cost[1:-1]) / len(blocks))
        block_counts = tuple(
            _balanced_split([each] * total_blocks, vstages, unit_cost[0], unit_cost[-1])
            if plan.pp > 1
            else (total_blocks,)
        )
    if block_counts is not None:
        if len(block_counts) != vstages or len(blocks) != vstages:
            raise PlanError(
                f"--blocks: the model built with one block per pipeline stage ({vstages}) has "
                f"{len(blocks)} repeated blocks: the argument --blocks names does not set the "
                "number of blocks; name the constructor argument that does (n_layer=48, "
                "num_hidden_layers=80)"
            )
        weight_of_block = dict(zip(blocks, block_counts, strict=True))
        notes.append(
            "analysed with one block per stage; each stage's blocks counted from it: "
            + ", ".join(f"{b} ×{k}" for b, k in weight_of_block.items())
        )
        counts = [1] * vstages
    elif plan.pp > 1:
        counts = _balanced_split(unit_cost[1:-1], vstages, unit_cost[0], unit_cost[-1])
    else:
        counts = [len(blocks)]
    runs, i = [], 0
    for k in counts:
        runs.append(blocks[i : i + k])
        i += k
    block_stage = {b: v for v, run in enumerate(runs) for b in run}
    # unit index (-1 before the blocks, len(blocks) after) -> virtual stage
    stage_of_unit = {-1: 0, len(blocks): len(runs) - 1} | {
        u: block_stage[b] for u, b in enumerate(blocks)
    }
    f_stage = {k: stage_of_unit[u] for k, u in f_unit.items()}
    b_stage = {k: stage_of_unit[u] for k, u in b_unit.items()}

    def rank_stage(v: int) -> int:
        return v % plan.pp

    f_weight = _node_weights(fwd, weight_of_block, None)
    b_weight = _node_weights(bwd, weight_of_block, f_weight)

    # parameters per stage: the stages whose forward reads them
    p_stages: dict[str, set[int]] = {}
    for ph, q in sig.params:
        users = phs[ph].users
        p_stages[q] = {rank_stage(f_stage[u.name]) for u in users} or {0}
    # buffers per stage: on the stages whose forward reads them (an unread one on its
    # module's stage), whole on every rank of the stage (neither TP nor FSDP shards a buffer),
    # once per copy of an analysed block
    buffer_bytes = [0] * plan.pp
    stage_buffers: list[list[tuple[str, int, int]]] = [[] for _ in range(plan.pp)]
    for ph, q in sig.buffers:
        module = q.rpartition(".")[0]
        home = rank_stage(_stage_of_module(module, block_stage))
        copies = next((k for b, k in weight_of_block.items() if _inside(module, b)), 1)
        v = phs[ph].meta["val"]
        for s_ in {rank_stage(f_stage[u.name]) for u in phs[ph].users} or {home}:
            buffer_bytes[s_] += copies * v.numel() * _esize(phs[ph])
            kind = (str(v.dtype).removeprefix("torch."), v.numel(), _esize(phs[ph]))
            stage_buffers[s_] += [kind] * copies
    numel = {q: phs[ph].meta["val"].numel() for ph, q in sig.params}
    shape_of = {q: tuple(int(s) for s in phs[ph].meta["val"].shape) for ph, q in sig.params}
    esize = {q: phs[ph].meta["val"].element_size() for ph, q in sig.params}
    dtype_of = {q: _dtype(phs[ph].meta["val"]) for ph, q in sig.params}
    for blk, k in weight_of_block.items():  # the copies of an analysed block's parameters
        for q in [q for q in list(numel) if q.startswith(blk + ".")]:
            for i in range(1, k):
                copy = f"{blk}#{i}{q[len(blk) :]}"
                numel[copy], shape_of[copy], esize[copy] = numel[q], shape_of[q], esize[q]
                dtype_of[copy], pplace[copy], p_stages[copy] = dtype_of[q], pplace[q], p_stages[q]
                if q in trainable:
                    trainable.add(copy)
                if q in stateless:
                    stateless = stateless | {copy}
    fsdp_blocks = [f"{b}#{i}" if i else b for b in blocks for i in range(weight_of_block.get(b, 1))]

    def local_numel(q: str) -> int:
        return math.prod(local_shape(shape_of[q], pplace[q], plan.tp))

    # activations per micro-batch, at local size, per stage -------------------------------
    saved = eager_saved_storages(fwd, bwd, memory_device)
    saved_local = [0] * plan.pp
    rec = rep.memory.recompute
    sel = None
    if rec is not None:  # selective recompute: only the storages it keeps, each at local size
        from graphflop.passes.selective_recompute import selective_recompute

        sel = selective_recompute(fwd, bwd, rec.policy, memory_device)
        notes.append(
            f"--recompute {rec.policy}: {len(sel.cores)} attention cores rerun in the backward "
            "(their residuals not saved, their inputs saved), each storage and each rerun "
            "node at its local size"
            + (f"; {sel.fused_cores} fused attention calls left alone" if sel.fused_cores else "")
        )
    eager_local = [0] * plan.pp  # the same without the what-ifs: the peak's what-if share
    for name, nbytes in saved.items():
        whole = _global_bytes(fwd, name)
        loc = fp.local_bytes.get(name, whole)
        frac = loc / whole if whole else 1.0
        s_ = rank_stage(f_stage.get(name, 0))
        eager_local[s_] += round(nbytes * frac) * f_weight.get(name, 1)
        if sel is None or name in sel.saved_storages:
            saved_local[s_] += round(nbytes * frac) * f_weight.get(name, 1)
    mem = rep.memory
    ck = mem.checkpoint
    ck_scale = 1.0
    if ck is not None and mem.saved_for_backward_bytes:
        ck_scale = ck.saved_for_backward_bytes / mem.saved_for_backward_bytes
        notes.append(
            f"--checkpoint {ck.pattern}: saved bytes scaled by {ck_scale:.3f} on every stage "
            "(the what-if's saved bytes over the eager model's); its recompute FLOPs added per "
            "module at the stage's local share"
        )
    amp = mem.amp
    if amp is not None and mem.saved_for_backward_bytes:
        ck_scale *= amp.saved_for_backward_bytes / mem.saved_for_backward_bytes
        notes.append(f"--amp {amp.dtype}: saved bytes scaled as the autocast what-if has them")
    # what the what-ifs change of the one-device step's peak (checkpointing: fewer saved
    # activations, a block's recompute on top; autocast: half activations, cast copies), each
    # against the eager peak; a rank's schedule takes its share of it by its activations
    whatif_delta = sum(
        w.train_peak_bytes - mem.train_peak_bytes
        for w in (ck, amp, rec)
        if w is not None and w.train_peak_bytes is not None and mem.train_peak_bytes
    )
    if whatif_delta:
        notes.append(
            f"peak: the what-if's change of the one-device train peak ({whatif_delta:+,} B) "
            "on every rank, scaled by the rank's activations in flight over the model's"
        )
    # the eager step's rise over its start (gradients, activations and temporaries as they
    # coexist in the eager schedule), and what it is made of, for scaling to a rank
    rise = max(0, (mem.train_peak_bytes or 0) - mem.params_bytes - (mem.optimizer_state_bytes or 0))
    dynamic_global = (mem.grads_bytes or 0) + (mem.saved_for_backward_bytes or 0)
    inputs_bytes, targets_bytes = (
        sum(
            phs[i].meta["val"].numel() * phs[i].meta["val"].element_size()
            for i in names
            if i in phs and isinstance(phs[i].meta.get("val"), torch.Tensor)
        )
        for names in (sig.inputs, sig.targets)
    )
    batch_bytes = inputs_bytes + targets_bytes
    # torch's Adam/AdamW keep a float32 step count per parameter beside the moments, as the
    # one-device analysis counts them (optimizer_state_bytes)
    upd_opt = getattr(rep.totals.update, "optimizer", None) or "sgd"
    step_bytes = step_count_bytes(upd_opt)
    # the optimizer keeps state for the trainable parameters only (frozen ones, LoRA's base
    # weights, have none): state bytes per trainable parameter byte
    trainable_bytes = sum(
        phs[ph].meta["val"].numel() * _esize(phs[ph]) for ph, q in sig.params if q in trainable
    )
    state_per_param_byte = float(len(STATE_KINDS[upd_opt])) if trainable_bytes else 0.0
    # one stage, state not sharded by ZeRO-2/3, every block analysed: the eager schedule itself,
    # each storage at its local size
    local_rise = None
    if plan.pp == 1 and plan.zero <= 1 and mem.memory_model == "eager":
        local_rise = _local_schedule_rise(
            fwd,
            bwd,
            fp,
            bp,
            memory_device,
            getattr(rep.totals.update, "optimizer", "sgd"),
            [local_numel(q) * esize[q] for q in trainable],
            {"f": f_weight, "b": b_weight},
        )
    # pipelines (state not sharded by ZeRO-2/3; every block analysed, or blocks counted from
    # one per stage): the eager schedule's steps of each stage replayed per micro-batch in the
    # order the pipeline schedule runs them
    stage_rise: list[int] | None = None
    if plan.pp > 1 and plan.zero <= 1 and mem.memory_model == "eager":
        opt_name = getattr(rep.totals.update, "optimizer", "sgd")
        base = _local_schedule(fwd, bwd, fp, bp, memory_device, opt_name, [])
        stage_rise = [
            _pipeline_rise(
                base,
                fwd,
                fp,
                f_stage,
                b_stage,
                plan,
                r,
                optimizer_temporaries(
                    opt_name,
                    [local_numel(q) * esize[q] for q in trainable if r in p_stages[q]],
                    memory_device,
                ),
                {"f": f_weight, "b": b_weight},
            )
            for r in range(plan.pp)
        ]

    # ZeRO 2/3 on one stage (every block analysed, or blocks counted from one): the same
    # schedule with FSDP's buffers
    fsdp_schedule = (
        plan.pp == 1 and plan.zero >= 2 and mem.memory_model == "eager" and plan.micro_batches == 1
    )

    # FLOPs per stage per micro-batch ----------------------------------------------------
    def sums(gm, pl: Placements, stage_of, role_map, weight):
        flops = [dict.fromkeys(("forward", "backward", "recompute"), 0) for _ in range(plan.pp)]
        mm = [dict.fromkeys(("forward", "backward", "recompute"), 0) for _ in range(plan.pp)]
        for n in gm.graph.nodes:
            c = pl.cost.get(n.name)
            if c is None:
                continue
            s = rank_stage(stage_of.get(n.name, 0))
            role = role_map(n)
            w = weight.get(n.name, 1)
            flops[s][role] += c.flops * w
            mm[s][role] += c.mm_flops * w
        return flops, mm

    ff, fm = sums(fwd, fp, f_stage, lambda n: "forward", f_weight)
    bf, bm = sums(
        bwd,
        bp,
        b_stage,
        lambda n: "recompute" if n.meta.get(ROLE) == "recompute" else "backward",
        b_weight,
    )
    # PyTorch's fused attention kernel recomputes the scores q·kᵀ in its backward (as
    # FlopCounterMode's SDPA backward formula counts it): one more product per call, at local
    # (TP) size; inspect counts the graph's math form and states the difference
    # (Report.eager_attention)
    for n in fused_score_products(fwd):
        c, w = fp.cost[n.name], f_weight.get(n.name, 1)
        bf[rank_stage(f_stage[n.name])]["backward"] += c.flops * w
        bm[rank_stage(f_stage[n.name])]["backward"] += c.mm_flops * w
    if sel is not None:  # the cores' rerun, node by node at local cost
        for n in fwd.graph.nodes:
            if n.name in sel.recomputed and n.name in fp.cost:
                s, w = rank_stage(f_stage.get(n.name, 0)), f_weight.get(n.name, 1)
                bf[s]["recompute"] += fp.cost[n.name].flops * w
                bm[s]["recompute"] += fp.cost[n.name].mm_flops * w
    if ck is not None:
        glob_fwd: dict[str, int] = {}
        loc_fwd: dict[str, int] = {}
        for n in fwd.graph.nodes:
            m = n.meta.get(MODULE) or ""
            from graphflop.meta import COST

            c = n.meta.get(COST)
            if c is None:
                continue
            for row in ck.per_module:
                if m == row.module or m.startswith(row.module + "."):
                    glob_fwd[row.module] = glob_fwd.get(row.module, 0) + c.flops
                    loc_fwd[row.module] = loc_fwd.get(row.module, 0) + fp.cost[n.name].flops
        for row in ck.per_module:
            s = rank_stage(block_stage.get(row.module, _stage_of_module(row.module, block_stage)))
            share = loc_fwd.get(row.module, 0) / (glob_fwd.get(row.module) or 1)
            bf[s]["recompute"] += round(row.recompute_flops * share) * weight_of_block.get(
                row.module, 1
            )

    # collectives ----------------------------------------------------------------------------
    m = plan.micro_batches
    per_stage_coll: list[list[Collective]] = [[] for _ in range(plan.pp)]
    for pl, stage_of, weight in ((fp, f_stage, f_weight), (bp, b_stage, b_weight)):
        for coll_ in pl.collectives:
            s = rank_stage(stage_of.get(coll_.at, 0))
            per_stage_coll[s].extend([coll_] * (m * weight.get(coll_.at, 1)))
    if plan.pp > 1:
        _pipeline_sends(fwd, fp, f_stage, plan, per_stage_coll)
        # a parameter read on several stages (tied input and output embeddings): each holds a
        # copy, and its gradients are summed between them once per step after the backward
        tied = [q for ph, q in sig.params if q in trainable and len(p_stages[q]) > 1]
        for q in tied:
            for st in p_stages[q]:
                per_stage_coll[st].append(
                    Collective(
                        "all_reduce",
                        "pp",
                        len(p_stages[q]),
                        local_numel(q),
                        dtype_of[q],
                        "backward",
                        q,
                    )
                )
        if tied:
            notes.append(
                "read on more than one pipeline stage, each stage holding a copy: "
                + ", ".join(f"{q} (stages {sorted(p_stages[q])})" for q in tied)
                + "; their gradients are all-reduced between those stages after the backward, "
                "as Megatron does for tied embeddings (torch.distributed.pipelining leaves the "
                "copies apart: synchronise them yourself)"
            )

    ranks = []
    upd = rep.totals.update
    per_param = (upd.flops_per_param or 0.0) if upd is not None else 0.0
    bubble = (plan.pp - 1) / (plan.chunks * m + plan.pp - 1) if plan.pp > 1 else 0.0
    for s in range(plan.pp):
        qs = [q for q in numel if s in p_stages[q]]
        tq = [q for q in qs if q in trainable]
        sq = [q for q in tq if q not in stateless]  # those with optimizer state
        p_bytes = sum(local_numel(q) * esize[q] for q in qs)
        g_bytes = sum(local_numel(q) * esize[q] for q in tq)
        dp = plan.dp
        units = _fsdp_units(qs, fsdp_blocks)
        coll = per_stage_coll[s]
        gather_buf = 0
        fsdp_rise: int | None = None
        owned: list[str] | None = None
        if plan.zero <= 1:
            # not under a pipeline: PipelineStage runs every forward under DDP's no_sync,
            # which clears require_forward_param_sync, so after the first step's first
            # micro-batch DDP broadcasts no buffers (torch 2.13 stage.py / distributed.py)
            if plan.pp == 1:
                coll += _ddp_buffer_broadcasts(stage_buffers[s], dp)
            coll += _ddp_buckets(bwd, bp, grad_want, tq, local_numel, esize, dtype_of, dp, outs)
            owned = _zero1_owned(tq, local_numel, dp) if plan.zero == 1 else None
            if plan.zero == 1:
                coll += [
                    Collective("broadcast", "dp", dp, local_numel(q), dtype_of[q], "optimizer", q)
                    for q in sorted(tq, key=local_numel, reverse=True)
                ]
            o_bytes = (
                round(
                    sum(local_numel(q) * esize[q] for q in owned if q not in stateless)
                    * state_per_param_byte
                )
                if owned is not None
                else round(sum(local_numel(q) * esize[q] for q in sq) * state_per_param_byte)
            )
            upd_numel = (
                sum(local_numel(q) for q in owned)
                if owned is not None
                else sum(local_numel(q) for q in tq)
            )
        else:
            # FSDP shards and gathers every parameter, frozen ones too (FSDP2's fully_shard
            # and FSDP1's flat parameters alike); only the gradients differ: FSDP2
            # reduce-scatters the trainable parameters' gradients alone, FSDP1's flat
            # gradient (use_orig_params, frozen and trainable in one flat parameter) is the
            # whole unit's, zeros where a parameter is frozen
            padded = {q: _padded(shape_of[q], pplace[q], plan.tp, dp) for q in qs}
            grad_members = {
                u: [
                    q
                    for q in mem_
                    if q in trainable or (plan.zero == 2 and any(t in trainable for t in mem_))
                ]
                for u, mem_ in units.items()
            }
            has_bwd = _units_with_backward(fwd, bwd, list(units))
            mixed = [
                u
                for u, mem_ in units.items()
                if any(q in trainable for q in mem_) and any(q not in trainable for q in mem_)
            ]
            if plan.zero == 2 and mixed and not any(n.startswith("ZeRO-2 (FSDP") for n in notes):
                notes.append(
                    "ZeRO-2 (FSDP SHARD_GRAD_OP, use_orig_params) keeps frozen and trainable "
                    f"parameters in one flat parameter in {len(mixed)} unit(s) "
                    f"({', '.join(mixed[:3])}{', …' if len(mixed) > 3 else ''}): they are "
                    "gathered and reduce-scattered whole (frozen parts as zeros), as counted; "
                    "torch also computes the frozen parameters' gradients there (backward "
                    "FLOPs not counted), and a rank's optimizer state is that of the trainable "
                    "elements in its slice of each flat parameter (the figure is the mean)"
                )
            for unit, members in units.items():
                if not members:
                    continue
                elems = sum(padded[q] for q in members)
                rs_elems = sum(padded[q] for q in grad_members[unit])
                dt = dtype_of[members[0]]
                for _ in range(m):
                    coll.append(Collective("all_gather", "dp", dp, elems, dt, "forward", unit))
                    if plan.zero == 3 and unit != "(root)" and unit in has_bwd:
                        coll.append(Collective("all_gather", "dp", dp, elems, dt, "backward", unit))
                    if rs_elems:
                        coll.append(
                            Collective("reduce_scatter", "dp", dp, rs_elems, dt, "backward", unit)
                        )
            unit_bytes = [sum(padded[q] * esize[q] for q in mem_) for mem_ in units.values()]
            sharded = sum(padded[q] * esize[q] for q in sq) // dp  # with optimizer state
            grad_sharded = sum(padded[q] * esize[q] for mem_ in grad_members.values() for q in mem_)
            if plan.zero == 3:
                gather_buf = sum(sorted(unit_bytes, reverse=True)[:2])
            else:
                gather_buf = sum(unit_bytes)
            # at rest FSDP holds the shards only (SHARD_GRAD_OP too: its gathered units live
            # from a unit's forward to its backward, in all_gather_buffers)
            p_bytes = sum(padded[q] * esize[q] for q in qs) // dp
            if fsdp_schedule:
                # the analysed blocks' units (not their copies, which the schedule offsets in)
                live = {u: mem_ for u, mem_ in units.items() if mem_ and "#" not in u}
                ub = {u: sum(padded[q] * esize[q] for q in mem_) for u, mem_ in live.items()}
                rb = {u: sum(padded[q] * esize[q] for q in grad_members[u]) for u in live}
                fsdp_rise, gather_buf = _fsdp_schedule_rise(
                    fwd,
                    bwd,
                    fp,
                    bp,
                    memory_device,
                    getattr(rep.totals.update, "optimizer", "sgd"),
                    zero=plan.zero,
                    unit_of_param={q: u for u, mem_ in live.items() for q in mem_},
                    unit_order=list(live),
                    gathered_bytes=ub,
                    # FSDP2 keeps each unsharded parameter as a view of its own all-gather
                    # output, dim 0 padded to a multiple of the group: the padded size
                    unsharded_bytes=ub,
                    reduced_bytes=rb,
                    shard_bytes={u: b // dp for u, b in rb.items()},
                    local_shard_param_bytes=[padded[q] * esize[q] // dp for q in tq],
                    weights={"f": f_weight, "b": b_weight},
                    copies=weight_of_block,
                    grad_bytes={
                        q: (local_numel(q) * esize[q], numel[q] * esize[q])
                        for mem_ in live.values()
                        for q in mem_
                        if q in trainable
                    },
                )
            g_bytes = grad_sharded // dp
            o_bytes = round(sharded * state_per_param_byte)
            upd_numel = sum(padded[q] for q in tq) // dp
        in_flight = _in_flight(plan, s)
        act = round(saved_local[s] * ck_scale * in_flight)
        o_bytes += step_bytes * (
            sum(q not in stateless for q in owned)
            if plan.zero == 1 and owned is not None
            else len(sq)
        )
        engine = g_bytes if plan.zero <= 1 and dp > 1 else 0  # DDP's gradient buckets
        stage_batch = batch_bytes
        if plan.pp > 1:
            # a pipeline stage keeps a receive buffer per micro-batch for each tensor it
            # receives (activations forward, cotangents backward), reused from step to step
            engine += sum(c.bytes() for c in coll if c.kind == "recv" and c.group == "pp")
            # the schedule splits the whole batch into views: the first stage holds the
            # inputs, the last the targets, of every micro-batch
            stage_batch = m * (
                (inputs_bytes if s == 0 else 0) + (targets_bytes if s == plan.pp - 1 else 0)
            )
        scheduled = (
            fsdp_rise - gather_buf
            if fsdp_rise is not None
            else local_rise
            if local_rise is not None
            else stage_rise[s]
            if stage_rise is not None
            else None
        )
        if scheduled is not None:  # the eager schedule's rise, without the what-ifs
            eager_saved = sum(saved.values())
            share = eager_local[s] * in_flight / eager_saved if eager_saved else 0.0
            step_rise = max(0, scheduled + round(whatif_delta * share))
        else:
            step_rise = round(rise * (g_bytes + act) / dynamic_global) if dynamic_global else 0
        peak = p_bytes + buffer_bytes[s] + o_bytes + gather_buf + engine + stage_batch + step_rise
        flops = {
            "forward": ff[s]["forward"] * m,
            "backward": bf[s]["backward"] * m,
            "recompute": bf[s]["recompute"] * m,
            "update": round(per_param * upd_numel),
        }
        flops["total"] = sum(flops.values())
        mmf = {
            "forward": fm[s]["forward"] * m,
            "backward": bm[s]["backward"] * m,
            "recompute": bm[s]["recompute"] * m,
        }
        mmf["total"] = sum(mmf.values())
        name = (
            "all ranks"
            if plan.pp == 1
            else f"stage {s} ({'first' if s == 0 else 'last' if s == plan.pp - 1 else 'middle'})"
        )
        ranks.append(
            RankClass(
                name=name,
                stage=s,
                ranks=plan.dp * plan.tp,
                blocks=tuple(
                    b if weight_of_block.get(b, 1) == 1 else f"{b} ×{weight_of_block[b]}"
                    for v, run in enumerate(runs)
                    if rank_stage(v) == s
                    for b in run
                ),
                flops=flops,
                mm_flops=mmf,
                memory_bytes={
                    "parameters": p_bytes,
                    "buffers": buffer_bytes[s],
                    "gradients": g_bytes,
                    "optimizer_state": o_bytes,
                    "activations": act,
                    "all_gather_buffers": gather_buf,
                    "engine_buffers": engine,
                    "batch": stage_batch,
                    "step_rise": step_rise,
                    "peak": peak,
                },
                in_flight=in_flight,
                collectives=tuple(coll),
                fits=None if device_memory_bytes is None else peak <= device_memory_bytes,
            )
        )
    totals = [r.flops["total"] for r in ranks]
    balance = max(totals) / (sum(totals) / len(totals)) if sum(totals) else 1.0
    per_stage = [sum(weight_of_block.get(b, 1) for b in run) for run in runs]
    split = (
        f"{sum(per_stage)} blocks ("
        + (
            "the chain of repeated block calls"
            if found_by == "calls"
            else "the outermost list of one block class"
        )
        + f") into {vstages} stages of {', '.join(map(str, per_stage))} blocks, balanced by "
        "FLOPs; modules before the blocks on the first stage, after them on the last"
        if plan.pp > 1
        else "one stage"
    )
    return PlanReport(
        model=rep.model if hasattr(rep, "model") else analysis.name,
        plan=plan,
        micro_batch=micro_batch,
        global_batch=micro_batch * m * plan.dp,
        ranks=tuple(ranks),
        bubble=bubble,
        balance=balance,
        split=split,
        stages=tuple(tuple(run) for run in runs),
        device=device,
        device_memory_bytes=device_memory_bytes,
        notes=tuple(notes),
        loss=fwd.meta.get(LOSS_KIND),
        assumptions=tuple(rep.assumptions),
        eager_attention=ea if (ea := eager_attention_flops(fwd, f_weight)).calls else None,
        detail=(fwd, fp, {k: rank_stage(v) for k, v in f_stage.items()}),
    )


def _local_schedule(
    fwd: GraphModule,
    bwd: GraphModule,
    fp: Placements,
    bp: Placements,
    device: str,
    optimizer: str,
    local_param_bytes: list[int],
) -> Schedule:
    """The eager memory model's train schedule of one micro-batch
    (:func:`~graphflop.passes.eager_memory.eager_train_schedule`) with every storage and kernel
    temporary scaled to its node's local size under the TP placements, each TP
    redistribution's new tensor, and the optimizer's temporaries of the local parameters
    (``local_param_bytes``, one entry per parameter)."""
    sched = eager_train_schedule(fwd, bwd, optimizer, device)
    whole = {"f": _node_bytes(fwd), "b": _node_bytes(bwd)}
    local = {"f": fp.local_bytes, "b": bp.local_bytes}
    for st in sched.steps:
        prefix, _, name = st.key.partition(":")
        if prefix == "u":
            st.nbytes = optimizer_temporaries(optimizer, local_param_bytes, device)
            continue
        w = whole.get(prefix, {}).get(name)
        lo = local.get(prefix, {}).get(name)
        if w and lo is not None and lo != w:
            st.nbytes = round(st.nbytes * lo / w)
            st.extra = round(st.extra * lo / w)
    _redistributed_copies(sched, {"f": (fwd, fp), "b": (bwd, bp)})
    return sched


def _weighted_peak(sched: Schedule, weights: dict[str, dict[str, int]] | None) -> int:
    """The peak of ``sched``'s timeline with the copies ``weights`` counts (see
    :func:`_local_schedule_rise`)."""
    if not weights or not any(weights.values()):
        return max(sched.timeline(), default=0)
    phase = [st.key.partition(":")[0] for st in sched.steps]
    ks = [
        weights.get(ph, {}).get(st.key.partition(":")[2].split("@")[0], 1)
        for ph, st in zip(phase, sched.steps, strict=True)
    ]
    return _copies_peak(sched, phase, ks)[0]


def _copies_peak(  # noqa: C901
    sched: Schedule,
    phase: list[str],
    ks: list[int],
    segment: list[Any] | None = None,
    *,
    gathered: tuple[str, ...] = (),
    neighbours: tuple[int, int, int, int] | None = None,
) -> tuple[int, int, int]:
    """The peak of ``sched`` (in each segment, one analysed block standing for K identical
    blocks run one after another) with the K − 1 copies not analysed offset in.

    Args:
        sched: the schedule with the analysed block.
        phase: per step, ``f`` (forward), ``b`` (backward) or another phase (the update).
        ks: per step, the copies its block counts for, 1 outside the block (a segment's K:
            the largest of its steps').
        segment: per step, the segment it belongs to (None: none), where a schedule replays
            several: a pipeline rank's (stage, micro-batch) actions (:func:`_pipeline_rise`),
            each its forward steps or its backward steps. Default: the schedule is one
            segment, the update included.
        gathered: key prefixes of gathered-parameter storages, whose copies' bytes are reported.
        neighbours: FSDP2's buffers that overlap a neighbouring copy's backward, as
            ``(prefetch bytes, prefetch after step, reduce-scatter bytes, reduce-scatter
            before step)``: while copy j (forward order) runs its backward, after its own
            parameters are unsharded, copy j − 1's all-gather output (prefetched) is live when
            j > 1; until its own reduce-scatter input is made, copy j + 1's reduce-scatter input
            is live when j < K.

    Per segment, each copy not analysed holds the storages made in the block's steps that
    outlive their phase in the segment: the forward's (``S`` per copy: what the backward
    reads, what a stage sends on, ZeRO-2's gathered parameters) until its backward, the
    backward's (``G``: gradients, or their shards) after it; what is freed within its phase
    (a temporary, the output the next block reads) is live for one copy at a time. A
    segment's offsets: in the forward, 0 before the block and (K − 1)·S from it on (the block
    standing for the last copy); in the backward, (K − 1)·S before the block, in it the
    largest over the copy j it stands for of (j − 1)·S + (K − j)·G plus the neighbours'
    buffers, after it and in the update (K − 1)·G. A step's offset is its own segment's plus
    every other segment's at that point. With K = 1 everywhere it is the schedule's own peak.

    Returns:
        (peak bytes, index of the step where it first occurs, bytes of the copies' gathered
        storages and prefetched all-gather output in the offset there).
    """
    tl = sched.timeline()
    if max(ks, default=1) <= 1:
        peak = max(tl, default=0)
        return peak, (tl.index(peak) if tl else 0), 0
    end = len(sched.steps)
    seg_of = segment if segment is not None else [0] * end
    storage, size, last = sched._lifetimes()
    # per segment: K, and the bytes each copy not analysed holds past its forward (S, of
    # which gathered parameters) and past its backward (G)
    k_of: dict[Any, int] = {}
    held_s: dict[Any, int] = {}
    held_gathered: dict[Any, int] = {}
    held_g: dict[Any, int] = {}
    for i, st in enumerate(sched.steps):
        seg = seg_of[i]
        if seg is None:
            continue
        k_of[seg] = max(k_of.get(seg, 1), ks[i])
        if ks[i] == 1 or storage[st.key] != st.key:
            continue
        j = last.get(st.key, i)
        if j < end and seg_of[j] == seg and phase[j] == phase[i]:
            continue  # freed within its phase: one copy at a time
        nbytes = size[st.key]
        if phase[i] == "f":
            held_s[seg] = held_s.get(seg, 0) + nbytes
            if gathered and st.key.startswith(gathered):
                held_gathered[seg] = held_gathered.get(seg, 0) + nbytes
        elif phase[i] == "b":
            held_g[seg] = held_g.get(seg, 0) + nbytes
    ag_bytes, ag_after, rs_bytes, rs_before = neighbours or (0, end, 0, -1)
    # per segment: its copies' offset (bytes, of which gathered) and where it stands: "f" held
    # S, "b" in its backward block, "g" after it
    offset: dict[Any, tuple[int, int]] = {}
    state: dict[Any, str] = {}
    fixed = fixed_gathered = 0  # every segment's offset summed
    peak, at, at_gathered = 0, 0, 0
    for i in range(end):
        seg = seg_of[i]
        mine = (0, 0)  # the step's own segment's offset (in ``fixed``)
        cands: list[tuple[int, int]] | None = None  # what stands in for it at this step
        if seg is not None:
            k, s1, g1 = k_of[seg], held_s.get(seg, 0), held_g.get(seg, 0)
            s1_gathered = held_gathered.get(seg, 0)
            old = mine = offset.get(seg, (0, 0))
            if phase[i] == "f":
                if ks[i] > 1 and seg not in state:
                    state[seg], mine = "f", ((k - 1) * s1, (k - 1) * s1_gathered)
            elif phase[i] == "b":
                if ks[i] > 1:  # the block standing for copy j, each j in turn
                    state[seg] = "b"
                    cands = []
                    for j in sorted({j for j in (1, 2, k - 1, k) if 1 <= j <= k}):
                        ag = ag_bytes if j > 1 and i > ag_after else 0
                        rs = rs_bytes if j < k and i < rs_before else 0
                        own = (j - 1) * s1 + (k - j) * g1 + ag + rs
                        cands.append((own, (j - 1) * s1_gathered + ag))
                elif state.get(seg) == "b":
                    state[seg], mine = "g", ((k - 1) * g1, 0)
            else:
                state[seg], mine = "g", ((k - 1) * g1, 0)
            fixed += mine[0] - old[0]
            fixed_gathered += mine[1] - old[1]
            offset[seg] = mine
        for own, own_gathered in cands if cands is not None else [mine]:
            v = tl[i] + fixed - mine[0] + own
            if v > peak:
                peak, at, at_gathered = v, i, fixed_gathered - mine[1] + own_gathered
    return peak, at, at_gathered


def _redistributed_copies(sched: Any, graphs: dict[str, tuple[GraphModule, Placements]]) -> None:
    """Put into ``sched`` the new storage each TP redistribution makes: DTensor's collectives
    (all_gather, reduce_scatter, all_reduce) write a new tensor of the value's size under its
    new placement, which the later readers of the value (forward consumers, and what autograd
    saves for the backward) read; the value itself lives until the collective has read it.
    Under sequence parallelism this is the gathered input of attention and MLP (the whole
    sequence) that their matrix products save, where the value is sequence-sharded."""
    from graphflop.passes.memory import Step

    moved: dict[str, int] = {}
    for prefix, (gm, pl) in graphs.items():
        idx = _node_index(gm)
        for name, dst in pl.moved_to.items():
            v = idx[name].meta.get("val") if name in idx else None
            if isinstance(v, torch.Tensor) and isinstance(pl.of.get(name), Placement):
                tp = max((c.group_size for c in pl.collectives if c.group == "tp"), default=1)
                moved[f"{prefix}:{name}"] = math.prod(local_shape(tuple(v.shape), dst, tp)) * (
                    v.element_size()
                )
    if not moved:
        return
    new = {k: f"{k}@moved" for k in moved}
    steps: list[Step] = []
    live: set[str] = set()
    for st in sched.steps:
        st.reads = [new[r] if r in live else r for r in st.reads]
        if st.alias_of in live:
            st.alias_of = new[st.alias_of]
        steps.append(st)
        if st.key in moved:
            steps.append(Step(new[st.key], moved[st.key], None, [st.key]))
            live.add(st.key)
    sched.steps = steps
    sched.keep = {new.get(k, k) for k in sched.keep}
    sched.ties = [[new.get(k, k) for k in group] for group in sched.ties]


def _local_schedule_rise(
    fwd: GraphModule,
    bwd: GraphModule,
    fp: Placements,
    bp: Placements,
    device: str,
    optimizer: str,
    local_param_bytes: list[int],
    weights: dict[str, dict[str, int]] | None = None,
) -> int:
    """The eager training step's rise over its start on one rank: the peak of
    :func:`_local_schedule`.

    ``weights`` (``"f"``/``"b"`` → node name → k) counts an analysed block for k identical
    ones run one after another. Each of the k − 1 copies not analysed holds the storages of
    its nodes that outlive their phase: in the forward, the values the backward reads
    (``S`` per copy); after its backward, its gradients (``G``). What is freed within its
    phase (a temporary, the output the next block reads) is live for one copy at a time. The
    analysed block's timeline is offset by what the other copies hold: in the forward (the
    block standing for the last copy) (k − 1)·S, in its backward the larger of (k − 1)·S (the
    first copy) and (k − 1)·G (the last), before it in the backward (k − 1)·S, after it and in
    the update (k − 1)·G. With k = 1 everywhere it is the schedule's own peak.
    """
    sched = _local_schedule(fwd, bwd, fp, bp, device, optimizer, local_param_bytes)
    return _weighted_peak(sched, weights)


def _fsdp_schedule_rise(  # noqa: C901
    fwd: GraphModule,
    bwd: GraphModule,
    fp: Placements,
    bp: Placements,
    device: str,
    optimizer: str,
    *,
    zero: int,
    unit_of_param: dict[str, str],
    unit_order: list[str],
    gathered_bytes: dict[str, int],
    unsharded_bytes: dict[str, int],
    shard_bytes: dict[str, int],
    reduced_bytes: dict[str, int] | None = None,
    local_shard_param_bytes: list[int],
    weights: dict[str, dict[str, int]] | None = None,
    copies: dict[str, int] | None = None,
    grad_bytes: dict[str, tuple[int, int]] | None = None,
) -> tuple[int, int]:
    """The training step's rise over its start on one rank under FSDP, and the bytes of
    gathered parameters live at that peak: :func:`_local_schedule` (the optimizer's temporaries
    of the sharded parameters) with the FSDP units' buffers put in at the points torch's
    engines make and free them. The root unit holds what no block does.

    ZeRO 2 (FSDP ``SHARD_GRAD_OP``): each unit's flat parameter is gathered (``gathered_bytes``,
    dim 0 padded) before its first forward node and kept until its post-backward (the end of
    its backward); there the unit's gradients are concatenated into one flat gradient (the
    gradients and the flat copy live together), the gathered parameters freed, the
    reduce-scatter's output (the gradient shard, ``shard_bytes``) made and the flat gradient
    freed.

    ``reduced_bytes``: the bytes each unit reduce-scatters (default ``gathered_bytes``): under
    FSDP2 its trainable parameters' (frozen ones have no gradient), under FSDP1 the whole
    flat parameter's; a unit with none is only resharded.

    ZeRO 3 (FSDP2 ``fully_shard``): each unit is gathered into an all-gather output
    (``gathered_bytes``) that is copied out into the unsharded parameters
    (``unsharded_bytes``: FSDP2 gives each parameter a buffer of its padded size and views the
    parameter into it; both live during the copy) and then freed; a block's unsharded
    parameters are freed after its forward (``reshard_after_forward``) and gathered again
    before its backward, the root's kept from the forward to the end of the backward; before
    a block's backward the block that ran before it in the forward is prefetched (its
    all-gather output lives until its own backward starts). At each post-backward: the unit's
    parameters resharded, the previous reduce-scatter's input freed (FSDP2 keeps it until
    the next reduce-scatter), the unit's gradients copied into a new reduce-scatter input and
    freed, the reduce-scatter's output (the gradient shard) made. Before the reshard, a gradient held whole
    whose parameter is tensor-parallel sharded (``grad_bytes``: parameter → (bytes at its
    placement, whole bytes); a vocabulary-parallel embedding's, scattered into whole zeros) is
    first redistributed to the parameter's placement, FSDP2's ``_get_grad_inner_tensor``: a new
    tensor (DTensor clones a Replicate → Shard chunk) made while the whole gradient is live,
    which then is freed.

    ``weights`` (``"f"``/``"b"`` → node name → K) and ``copies`` (unit → K) count an analysed
    block for K identical blocks, each its own unit: the block's steps and its unit's buffers
    stand for each copy in turn, the other copies offset in by :func:`_copies_peak` (their
    saved activations, ZeRO-2's gathered parameters, their gradient shards, and under ZeRO 3
    the neighbouring copies' prefetched all-gather output and reduce-scatter input).

    Returns:
        (peak rise in bytes, gathered bytes live at the peak).
    """
    from graphflop.passes.memory import Step

    sched = _local_schedule(fwd, bwd, fp, bp, device, optimizer, local_shard_param_bytes)
    root = unit_order[-1] if unit_order and unit_order[-1] == "(root)" else "(root)"
    blocks = [u for u in unit_order if u != "(root)"]
    reduced = gathered_bytes if reduced_bytes is None else reduced_bytes

    def unit_of_module(mod: str) -> str:
        for b in blocks:
            if mod == b or mod.startswith(b + "."):
                return b
        return root

    f_unit = {
        n.name: unit_of_module(n.meta.get(MODULE) or "")
        for n in fwd.graph.nodes
        if n.op == "call_function"
    }
    b_unit: dict[str, str] = {}
    for n in bwd.graph.nodes:
        if n.op != "call_function":
            continue
        src = n.meta.get(SOURCE)
        b_unit[n.name] = f_unit.get(src, root) if src is not None else root
    out_node = next(n for n in bwd.graph.nodes if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    # a gradient redistributed to its parameter's placement is read as the new tensor
    made = {st.key for st in sched.steps}
    grads_of: dict[str, list[str]] = {}
    all_grads: set[str] = set()
    grad_bytes = grad_bytes or {}
    storage, size, _ = sched._lifetimes()
    redist_of: dict[str, list[tuple[str, int]]] = {}  # unit -> (gradient key, bytes after)
    for i, q in bwd.meta[VJP].grads:
        if i < len(outs) and isinstance(outs[i], Node) and q in unit_of_param:
            key = f"b:{outs[i].name}"
            moved = f"{key}@moved"
            key_ = moved if moved in made else key
            local, whole = grad_bytes.get(q, (0, 0))
            if local < whole and key_ in storage and size[storage[key_]] == whole:
                redist_of.setdefault(unit_of_param[q], []).append((key_, local))
                key_ = f"fsdp:redist:{unit_of_param[q]}:{key_}"
            grads_of.setdefault(unit_of_param[q], []).append(key_)
            all_grads |= {key, moved}

    def unit_at(key: str) -> tuple[str, str | None]:
        prefix, _, name = key.partition(":")
        if prefix == "f":
            return "f", f_unit.get(name)
        if prefix == "b":
            return "b", b_unit.get(name)
        return prefix, None

    idx = [unit_at(st.key) for st in sched.steps]
    first: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], int] = {}
    for i, (ph, u) in enumerate(idx):
        if u is None or u == root:
            continue
        first.setdefault((ph, u), i)
        last[(ph, u)] = i
    f_begin = next(i for i, (ph, _) in enumerate(idx) if ph == "f")
    b_end = next(i for i, st in enumerate(sched.steps) if st.key == "b:__output__")
    fwd_order = sorted((u for u in blocks if ("f", u) in first), key=lambda u: first[("f", u)])
    prev_of = {u: fwd_order[k - 1] for k, u in enumerate(fwd_order) if k}
    before: dict[int, list[Step]] = {}
    after: dict[int, list[Step]] = {}
    keep: set[str] = set()

    owner: dict[str, str] = {}  # an FSDP step's key -> the unit it stands for in a copy

    def step(key: str, nbytes: int = 0, reads: tuple[str, ...] = ()) -> Step:
        parts = key.split(":")
        if len(parts) > 2:
            owner[key] = parts[2]
        return Step(key, nbytes, None, list(reads))

    def gather(u: str, tag: str, prefetched: bool = False) -> list[Step]:
        if u not in gathered_bytes:  # a unit without parameters (the root of a model whose
            return []  # parameters all sit in blocks)
        if zero == 2:
            return [step(f"fsdp:param:{u}", gathered_bytes[u])]
        ag = [] if prefetched else [step(f"fsdp:ag:{u}:{tag}", gathered_bytes[u])]
        return [*ag, step(f"fsdp:param:{u}:{tag}", unsharded_bytes[u], (f"fsdp:ag:{u}:{tag}",))]

    prev_rs: list[str | None] = [None]

    def post_backward(u: str, tag: str) -> list[Step]:
        if u not in gathered_bytes:
            return []
        grads = tuple(grads_of.get(u, ()))
        if zero == 2:
            if not reduced.get(u):
                return [step(f"fsdp:reshard:{u}", 0, (f"fsdp:param:{u}",))]
            keep.add(f"fsdp:grad:{u}")
            return [
                step(f"fsdp:flat:{u}", reduced[u], grads),
                step(f"fsdp:reshard:{u}", 0, (f"fsdp:param:{u}",)),
                step(f"fsdp:grad:{u}", shard_bytes[u], (f"fsdp:flat:{u}",)),
            ]
        # FSDP2 takes (and redistributes) the gradients before it reshards
        out = [step(f"fsdp:redist:{u}:{g}", nb, (g,)) for g, nb in redist_of.get(u, [])]
        out.append(step(f"fsdp:reshard:{u}", 0, (f"fsdp:param:{u}:{tag}",)))
        if not reduced.get(u):  # every parameter frozen: nothing to reduce-scatter
            return out
        if prev_rs[0] is not None:
            out.append(step(f"fsdp:rs_done:{u}", 0, (prev_rs[0],)))
        out.append(step(f"fsdp:rs_in:{u}", reduced[u], grads))
        out.append(step(f"fsdp:grad:{u}", shard_bytes[u], (f"fsdp:rs_in:{u}",)))
        keep.add(f"fsdp:grad:{u}")
        prev_rs[0] = f"fsdp:rs_in:{u}"
        return out

    # forward: the root first (its pre-forward runs before anything), each block around its run
    before.setdefault(f_begin, []).extend(gather(root, "f"))
    for u in fwd_order:
        before.setdefault(first[("f", u)], []).extend(gather(u, "f"))
        if zero == 3:
            after.setdefault(last[("f", u)], []).append(
                step(f"fsdp:reshard_f:{u}", 0, (f"fsdp:param:{u}:f",))
            )
    # backward, in the order the blocks' backward starts; the root's pre-backward (at the
    # backward's start) prefetches the first of them
    prefetched: set[str] = set()
    b_order = sorted((u for u in blocks if ("b", u) in first), key=lambda u: first[("b", u)])
    if zero == 3 and b_order:
        b_begin = next(i for i, (ph, _) in enumerate(idx) if ph == "b")
        before.setdefault(b_begin, []).append(
            step(f"fsdp:ag:{b_order[0]}:b", gathered_bytes[b_order[0]])
        )
        owner.pop(f"fsdp:ag:{b_order[0]}:b")  # made once, for the last copy only
        prefetched.add(b_order[0])
    for u in b_order:
        i = first[("b", u)]
        if zero == 3:
            before.setdefault(i, []).extend(gather(u, "b", prefetched=u in prefetched))
            p = prev_of.get(u)
            if p is not None and ("b", p) in first:
                before[i].append(step(f"fsdp:ag:{p}:b", gathered_bytes[p]))
                prefetched.add(p)
        after.setdefault(last[("b", u)], []).extend(post_backward(u, "b"))
    before.setdefault(b_end, []).extend(post_backward(root, "f"))

    steps: list[Step] = []
    phase: list[str] = []
    ks: list[int] = []
    weights = weights or {}
    copies = copies or {}
    for i, st in enumerate(sched.steps):
        ph, _, name = st.key.partition(":")
        added = [*before.get(i, []), st, *after.get(i, [])]
        if st.key == "b:__output__":
            st.reads = [r for r in st.reads if r not in all_grads]
        steps.extend(added)
        phase.extend([ph] * len(added))
        ks.extend(
            copies.get(owner.get(x.key, ""), 1)
            if x is not st
            else weights.get(ph, {}).get(name.split("@")[0], 1)
            for x in added
        )
    sched.steps = steps
    sched.keep = (sched.keep - all_grads) | keep
    neighbours = None
    copied = [u for u in blocks if copies.get(u, 1) > 1]
    keys = [st.key for st in steps]
    if (
        zero == 3
        and len(copied) == 1
        and {f"fsdp:param:{copied[0]}:b", f"fsdp:rs_in:{copied[0]}"} <= set(keys)
    ):
        u = copied[0]
        neighbours = (
            gathered_bytes[u],
            keys.index(f"fsdp:param:{u}:b"),
            reduced[u],
            keys.index(f"fsdp:rs_in:{u}"),
        )
    gathered_keys = ("fsdp:param:", "fsdp:ag:")
    peak, at, more = _copies_peak(sched, phase, ks, gathered=gathered_keys, neighbours=neighbours)
    gathered = more + sum(nb for k, nb in sched.live_at(at).items() if k.startswith(gathered_keys))
    return peak, gathered


def _node_bytes(gm: GraphModule) -> dict[str, int]:
    out = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out[n.name] = v.numel() * v.element_size()
    return out


def _node_weights(
    gm: GraphModule, weight_of_block: dict[str, int], forward: dict[str, int] | None
) -> dict[str, int]:
    """node name → how many identical blocks it stands for (only where more than 1): a node
    in a block (by module path; a backward node by the forward node it differentiates)."""
    heavy = {b: k for b, k in weight_of_block.items() if k != 1}
    out: dict[str, int] = {}
    if not heavy:
        return out
    for n in gm.graph.nodes:
        src = n.meta.get(SOURCE)
        if forward is not None and src is not None and n.op != "placeholder":
            if src in forward:
                out[n.name] = forward[src]
            continue
        m = n.meta.get(MODULE) or ""
        for b, k in heavy.items():
            if m == b or m.startswith(b + "."):
                out[n.name] = k
                break
    return out


def _stage_of_module(module: str, block_stage: dict[str, int]) -> int:
    for b, s in block_stage.items():
        if _inside(module, b):
            return s
    return 0


def _inside(module: str, block: str) -> bool:
    return module == block or module.startswith(block + ".")


def _esize(n: Node) -> int:
    return int(n.meta["val"].element_size())


def _global_bytes(gm: GraphModule, name: str) -> int:
    node = _node_index(gm).get(name)
    v = node.meta.get("val") if node is not None else None
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


#: the attribute of a graph module holding its nodes by name (on the module itself: keyed by
#: ``id(gm)`` in a table, a later module given a freed one's id read the freed one's nodes)
_INDEX = "_graphflop_node_index"


def _node_index(gm: GraphModule) -> dict[str, Node]:
    idx = gm.__dict__.get(_INDEX)
    if idx is None or len(idx) != len(gm.graph.nodes):
        idx = {n.name: n for n in gm.graph.nodes}
        object.__setattr__(gm, _INDEX, idx)  # not a submodule: nn.Module's setattr
    return idx


def _in_flight(plan: Plan, s: int) -> float:
    """Micro-batches whose activations stage ``s`` holds at its peak (module docstring)."""
    p, m, v = plan.pp, plan.micro_batches, plan.chunks
    if p == 1:
        return 1.0
    if plan.schedule == "gpipe":
        return float(m)
    if plan.schedule == "1f1b":
        return float(min(p - s, m))
    return min(2 * (p - s - 1) + (v - 1) * p + 1, v * m) / v


def _padded(shape: tuple[int, ...], pl: Placement, tp: int, dp: int) -> int:
    """Elements of a parameter's local TP shard with dim 0 padded to a multiple of ``dp``
    (FSDP2's padding)."""
    loc = local_shape(shape, pl, tp)
    if not loc:
        return dp  # a scalar: one element per rank
    d0 = -(-loc[0] // dp) * dp
    return d0 * math.prod(loc[1:])


def _units_with_backward(fwd: GraphModule, bwd: GraphModule, units: list[str]) -> set[str]:
    """The FSDP units (blocks; a copy ``block#i`` as its block) whose forward nodes the
    backward differentiates: FSDP2's pre-backward hook, which gathers a block again, runs on
    a block whose outputs need a gradient, and a block with none has no backward node."""
    modules = {n.name: n.meta.get(MODULE) or "" for n in fwd.graph.nodes}
    differentiated = {
        modules.get(n.meta.get(SOURCE), "")
        for n in bwd.graph.nodes
        if n.op == "call_function" and n.meta.get(SOURCE) is not None
    }
    return {u for u in units if any(_inside(m, u.split("#")[0]) for m in differentiated if m)}


def _fsdp_units(params: list[str], blocks: list[str]) -> dict[str, list[str]]:
    """FSDP units: one per block, the root holding the rest."""
    units: dict[str, list[str]] = {b: [] for b in blocks}
    units["(root)"] = []
    for q in params:
        for b in blocks:
            if q.startswith(b + "."):
                units[b].append(q)
                break
        else:
            units["(root)"].append(q)
    return units


def _zero1_owned(params: list[str], local_numel, dp: int) -> list[str]:
    """The parameters rank 0 owns under ``ZeroRedundancyOptimizer``'s partition (largest
    first, each to the rank with the fewest elements so far; the fullest rank is the one whose
    state is reported)."""
    sizes = [0] * dp
    owned: list[list[str]] = [[] for _ in range(dp)]
    for q in sorted(params, key=local_numel, reverse=True):
        r = sizes.index(min(sizes))
        owned[r].append(q)
        sizes[r] += local_numel(q)
    return owned[sizes.index(max(sizes))]


#: the bytes of one coalesced broadcast of DDP's buffers (``broadcast_bucket_size``)
DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def _ddp_buffer_broadcasts(buffers: list[tuple[str, int, int]], dp: int) -> list[Collective]:
    """DDP's buffer sync before every forward (``broadcast_buffers=True``, the default:
    ``DistributedDataParallel._sync_buffers`` -> ``dist._broadcast_coalesced`` from rank 0):
    the module's buffers (``buffers``: dtype, elements, bytes per element, in module order)
    flattened into one broadcast per dtype, each bucket closed once it holds
    :data:`DDP_BROADCAST_BUCKET_BYTES` (logged at step 3 for a batch-norm model: float32 of
    the running means and variances, int64 of the batch counters)."""
    if dp == 1 or not buffers:
        return []
    out: list[Collective] = []
    open_: dict[str, list[int]] = {}  # dtype -> [elements, bytes] of its open bucket
    for dt, numel, size in buffers:
        b = open_.setdefault(dt, [0, 0])
        b[0] += numel
        b[1] += numel * size
        if b[1] >= DDP_BROADCAST_BUCKET_BYTES:
            out.append(Collective("broadcast", "dp", dp, b[0], dt, "forward", "buffers"))
            del open_[dt]
    out += [
        Collective("broadcast", "dp", dp, n, dt, "forward", "buffers")
        for dt, (n, _) in open_.items()
        if n
    ]
    return out


def _ddp_buckets(bwd, bp, grad_want, params, local_numel, esize, dtype_of, dp, outs):
    """DDP's gradient all_reduces: buckets filled in the order the backward makes the
    gradients (first 1 MiB, then 25 MiB), one per dtype run."""
    if dp == 1 or not params:
        return []
    order: list[str] = []
    pos = {a.name: i for i, a in enumerate(outs) if isinstance(a, Node)}
    by_out = {}
    for i, q in bwd.meta[VJP].grads:
        if i < len(outs) and isinstance(outs[i], Node):
            by_out[q] = outs[i].name
    made = {n.name: k for k, n in enumerate(bwd.graph.nodes)}
    want = set(params)
    order = sorted(
        (q for q in by_out if q in want), key=lambda q: made.get(by_out[q], pos.get(q, 0))
    )
    order += [q for q in params if q not in by_out]
    out, cur, cur_bytes, limit = [], 0, 0, DDP_FIRST_BUCKET_BYTES
    dt = None
    for q in order:
        if dt is not None and dtype_of[q] != dt and cur:
            out.append(Collective("all_reduce", "dp", dp, cur, dt, "backward", "bucket"))
            cur = cur_bytes = 0
        dt = dtype_of[q]
        cur += local_numel(q)
        cur_bytes += local_numel(q) * esize[q]
        if cur_bytes >= limit:
            out.append(Collective("all_reduce", "dp", dp, cur, dt, "backward", "bucket"))
            cur = cur_bytes = 0
            limit = DDP_BUCKET_BYTES
    if cur:
        out.append(Collective("all_reduce", "dp", dp, cur, dt or "float32", "backward", "bucket"))
    return out


def _pipeline_sends(fwd, fp: Placements, f_stage, plan: Plan, per_stage) -> None:
    """Per micro-batch: each activation crossing from one virtual stage to a later one, sent
    in the forward and its cotangent sent back in the backward (received by the other), over
    the pipeline's group of ``pp`` ranks (torch's ``PipelineStage`` sends on its group)."""
    m, p = plan.micro_batches, plan.pp
    for n in fwd.graph.nodes:
        if n.op != "call_function" or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        s = f_stage.get(n.name, 0)
        later = sorted({f_stage[u.name] for u in n.users if u.op != "output"} - {s})
        v = n.meta["val"]
        pl = fp.of.get(n.name, REPLICATE)
        elems = math.prod(local_shape(tuple(v.shape), pl, plan.tp))
        grad = v.is_floating_point() and n.meta.get(RESIDUAL) is None
        for t in later:
            if t < s:
                continue
            a, b = s % plan.pp, t % plan.pp
            dt = _dtype(v)
            for _ in range(m):
                per_stage[a].append(Collective("send", "pp", p, elems, dt, "forward", n.name))
                per_stage[b].append(Collective("recv", "pp", p, elems, dt, "forward", n.name))
                if grad:
                    per_stage[b].append(Collective("send", "pp", p, elems, dt, "backward", n.name))
                    per_stage[a].append(Collective("recv", "pp", p, elems, dt, "backward", n.name))


def _pipeline_actions(plan: Plan, rank: int) -> list[tuple[str, int, int]]:
    """(``F`` or ``B``, virtual stage, micro-batch) in the order pipeline rank ``rank`` runs
    them under ``torch.distributed.pipelining``'s schedules: GPipe every forward then every
    backward; 1F1B min(m, p − rank) forwards, then one backward and one forward alternating,
    then the remaining backwards; interleaved 1F1B (stages rank, rank + p, ... looped) with
    (v − 1)·r + 2(p − 1 − rank) warm-up forwards, r = m / max(1, m / p) micro-batches per
    round, each later forward followed by a backward, the stage of each chosen round by
    round (forwards up the chunks, backwards down them)."""
    p, m, v = plan.pp, plan.micro_batches, plan.chunks
    if plan.schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    if plan.schedule == "1f1b":
        warm = min(m, p - rank)
        out = [("F", rank, i) for i in range(warm)]
        nxt = warm
        for i in range(m):
            out.append(("B", rank, i))
            if nxt < m:
                out.append(("F", rank, nxt))
                nxt += 1
        return out
    per = m // max(1, m // p)
    total = v * m
    warm = min((v - 1) * per + 2 * (p - 1 - rank), total)
    f_next: dict[int, int] = {}
    b_next: dict[int, int] = {}
    out = []

    def fwd(op: int) -> None:
        st = ((op // per) % v) * p + rank
        out.append(("F", st, f_next.get(st, 0)))
        f_next[st] = f_next.get(st, 0) + 1

    def bwd(op: int) -> None:
        st = (v - 1 - ((op - warm) // per) % v) * p + rank
        out.append(("B", st, b_next.get(st, 0)))
        b_next[st] = b_next.get(st, 0) + 1

    for op in range(total + warm):
        if op < total:
            fwd(op)
        if op >= warm:
            bwd(op)
    return out


def _pipeline_rise(
    base: Schedule,
    fwd: GraphModule,
    fp: Placements,
    f_stage: dict[str, int],
    b_stage: dict[str, int],
    plan: Plan,
    rank: int,
    optimizer_bytes: int,
    weights: dict[str, dict[str, int]] | None = None,
) -> int:
    """The step's rise on pipeline rank ``rank``: the steps of ``base`` (one micro-batch's
    eager train schedule at local sizes) of each of the rank's virtual stages, replayed per
    micro-batch in the schedule's order (:func:`_pipeline_actions`), then the optimizer's
    temporaries (``optimizer_bytes``). A stage reads only its own values (what it receives
    sits in the receive buffers, counted apart); gradients made by a stage's first backward
    stay, later micro-batches' are added into them and freed; what
    ``torch.distributed.pipelining`` holds on top: each forward's outputs sent on, until the
    micro-batch's backward on that stage; a received activation's gradient (the buffer's
    ``.grad``), to the step's end; the last stage's model outputs (kept for the merged
    output), to the step's end.

    ``weights`` (``"f"``/``"b"`` → node name → k, ``plan --blocks``) counts a stage's analysed
    block for k identical ones run one after another: each (stage, micro-batch) of the replay
    offsets the k − 1 copies not analysed in (:func:`_copies_peak`, each action a segment)."""
    sig = fwd.meta[SIGNATURE]
    batch = {f"f:{n}" for n in (*sig.inputs, *sig.targets)}
    last = plan.virtual_stages - 1

    def stage_of(key: str) -> int | None:
        prefix, _, name = key.partition(":")
        return f_stage.get(name) if prefix == "f" else b_stage.get(name) if prefix == "b" else None

    # each stage's steps, reading only the stage's own values (what it receives sits in the
    # receive buffers), the batch's micro-batch slices views of the whole batch
    by_stage: dict[tuple[str, int], list[Step]] = {}
    for st in base.steps:
        v = stage_of(st.key)
        if v is not None:
            reads = [r for r in st.reads if stage_of(r) == v]
            alias = st.alias_of if st.alias_of and stage_of(st.alias_of) == v else None
            nbytes = 0 if st.key in batch else st.nbytes
            by_stage.setdefault((st.key[0], v), []).append(
                Step(st.key, nbytes, alias, reads, st.extra)
            )
    # values crossing stage boundaries: sent on by their stage, received by a later one
    sent: dict[int, list[str]] = {}
    grad_in: dict[int, int] = {}
    for n in fwd.graph.nodes:
        val = n.meta.get("val")
        if n.op != "call_function" or not isinstance(val, torch.Tensor):
            continue
        v = f_stage.get(n.name, 0)
        later = {f_stage[u.name] for u in n.users if u.op != "output" and f_stage[u.name] > v}
        if later:
            sent.setdefault(v, []).append(f"f:{n.name}")
        if val.is_floating_point() and n.meta.get(RESIDUAL) is None:
            whole = val.numel() * val.element_size()
            for t in later:
                grad_in[t] = grad_in.get(t, 0) + fp.local_bytes.get(n.name, whole)
    sched = Schedule()
    backward_done: set[int] = set()
    # per step: the (stage, micro-batch) action it belongs to, its phase and the copies its
    # block counts for (1 outside a block)
    segment: list[tuple[int, int] | None] = []
    phase: list[str] = []
    ks: list[int] = []
    node_weight = weights or {}
    for kind, v, mb in _pipeline_actions(plan, rank):
        pre = f"{mb}/"
        prefix = "f" if kind == "F" else "b"
        start = len(sched.steps)
        for st in by_stage.get((prefix, v), []):
            alias = pre + st.alias_of if st.alias_of else None
            reads = [pre + r for r in st.reads]
            sched.steps.append(Step(pre + st.key, st.nbytes, alias, reads, st.extra))
            ks.append(node_weight.get(prefix, {}).get(st.key.partition(":")[2].split("@")[0], 1))
        if kind == "B":
            sched.steps.append(Step(f"{pre}held:{v}", 0, None, [pre + k for k in sent.get(v, [])]))
            ks.append(1)
            if v not in backward_done:
                backward_done.add(v)
                sched.keep.update(pre + k for k in base.keep if stage_of(k) == v)
            if grad_in.get(v):
                key = f"{pre}grad_in:{v}"
                sched.steps.append(Step(key, grad_in[v], None, []))
                sched.keep.add(key)
                ks.append(1)
        elif v == last:
            sched.keep.update(pre + f"f:{o}" for o in sig.outputs)
        segment += [(v, mb)] * (len(sched.steps) - start)
        phase += [prefix] * (len(sched.steps) - start)
    sched.add_transient("u:optimizer", optimizer_bytes)
    segment.append(None)
    phase.append("u")
    ks.append(1)
    return _copies_peak(sched, phase, ks, segment)[0]
