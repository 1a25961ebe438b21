"""What-if: selective activation recomputation of attention cores (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.2).

Attention's core — the score product q·kᵀ, its scaling and mask, the softmax, the softmax's
dropout and the product with v — holds the tensors of shape (…, s, s) whose size grows with
the square of the sequence, and costs little to compute again. Selective recompute keeps only
the core's inputs (q, k, v) and reruns the core in the backward; everything else stays saved.

:func:`selective_recompute` finds the cores in any traced forward graph, with no module names:

* a **score product** is a matrix product (``mm``, ``bmm``, ``addmm``, ``baddbmm``) whose two
  matrix operands are both activations (computed from the model's inputs, neither a parameter
  nor derived from parameters only);
* its **core** is every node between it and the next such product that consumes its result
  (the product with v): the score product's descendants that are ancestors of that product,
  both products included, with no other matrix product among them (a path through a
  projection is a layer, not a core);
* the core's **prologue** is the cheap ops whose value only the core reads, taken in as far as
  they go: views, copies and elementwise ops (FLOPs at most one per output element, no matrix
  product) that are not parameters or derived from them — in math attention the scaling of q
  and the reshapes that feed the two products, up to the projection that made q, k and v. It
  is recomputed too when that saves bytes (the scaled q is then not kept beside q); when it
  does not, the core alone is recomputed.

Bytes follow the eager memory model's saved set (:mod:`graphflop.passes.eager_memory`; once per
storage, parameters and buffers excluded, inputs and targets included), cut as the checkpoint
what-if cuts it (:mod:`graphflop.passes.checkpoint`): a residual read only by the backward of
nodes inside a core is dropped, one read by any other backward node stays, each core's inputs
are saved. The recompute reruns every node of each core and prologue (Megatron's
``CheckpointFunction`` over the core, which reruns its whole forward; eager
``torch.utils.checkpoint(use_reentrant=False)`` would stop before the product with v, an op
that saves only its inputs). Its FLOPs are those nodes' :data:`~graphflop.meta.COST`.

Attention calls traced as PyTorch's fused kernel (:data:`~graphflop.frontend.composite.FUSED_SDPA`)
need nothing: the kernel already saves only q, k, v, its output and the small logsumexp, and
recomputes the scores in its own backward. They are counted (``fused_cores``) and left alone.

Reads ``val``, ``MODULE``, ``COST``, ``COMPOSITE``, ``RESIDUAL``, ``SOURCE``,
``PARAM_DERIVED``; writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from graphflop.frontend.composite import FUSED_SDPA
from graphflop.meta import COMPOSITE, COST, MODULE, SIGNATURE
from graphflop.passes.checkpoint import _cut, _is_state, _train_schedule
from graphflop.passes.eager_memory import eager_residuals
from graphflop.passes.memory import forward_storages
from graphflop.report import CheckpointedModule, RecomputeWhatIf

__all__ = [
    "EXECUTION",
    "POLICIES",
    "RecomputeMemory",
    "RecomputePolicyError",
    "attention_cores",
    "selective_recompute",
]

aten = torch.ops.aten

#: the recompute policies: ``attention``, Korthikanti et al.'s selective recompute
POLICIES = ("attention",)

#: the execution the figures describe
EXECUTION = (
    "eager step with each attention core (score product q·kᵀ through the product with v, and "
    "the cheap ops only it reads) rerun whole in the backward from its saved inputs "
    "(selective recompute, Korthikanti et al. 2022)"
)

# matrix products and the argument positions of their two matrix operands
_PRODUCTS = {
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.addmm.default: (1, 2),
    aten.baddbmm.default: (1, 2),
}


class RecomputePolicyError(ValueError):
    """An unknown recompute policy, or a model with no attention core to recompute."""


def check_policy(policy: object) -> str:
    """``policy`` if it is one of :data:`POLICIES`.

    Raises:
        TypeError: not a str.
        RecomputePolicyError: an unknown policy.
    """
    if not isinstance(policy, str):
        raise TypeError(f"recompute must be one of {', '.join(POLICIES)} or None, not {policy!r}")
    if policy not in POLICIES:
        raise RecomputePolicyError(
            f"unknown recompute policy {policy!r}: one of {', '.join(POLICIES)}"
        )
    return policy


@dataclass(frozen=True)
class AttentionCore:
    """One attention core: ``name`` (the score product's module path, ``#k`` added from the
    second core of a module on), its score product and product with v (node names), and its
    nodes (core, then prologue) in graph order."""

    name: str
    score: str
    context: str
    core: tuple[str, ...]
    prologue: tuple[str, ...]


@dataclass(frozen=True)
class RecomputeMemory:
    """Attributes:
    policy: the policy (``attention``).
    cores: the recomputed cores, in forward order.
    fused_cores: attention calls traced as the fused kernel, left alone.
    prologue: whether the cores' prologues are recomputed (they save bytes) or not.
    saved_bytes: bytes saved for backward with the cores recomputed (once per storage).
    eager_saved_bytes: the eager model's saved bytes without.
    input_bytes: of ``saved_bytes``, the cores' inputs (once per storage).
    recompute_flops: FLOPs of the nodes rerun in the backward, all cores.
    recompute_mm_flops: of those, the matrix products'.
    saved_storages: the forward node names owning the storages ``saved_bytes`` counts.
    recomputed: the forward node names rerun in the backward.
    per_core: core name -> (recompute FLOPs, recomputed nodes).
    train_peak_bytes: estimated train-step peak (parameters, gradients and optimizer state
        included); None when not computed.
    """

    policy: str
    cores: tuple[AttentionCore, ...]
    fused_cores: int
    prologue: bool
    saved_bytes: int
    eager_saved_bytes: int
    input_bytes: int
    recompute_flops: int
    recompute_mm_flops: int
    saved_storages: frozenset[str]
    recomputed: frozenset[str]
    per_core: dict[str, tuple[int, int]]
    train_peak_bytes: int | None = None

    def to_report(self) -> RecomputeWhatIf:
        """The report's section ``memory.recompute``."""
        return RecomputeWhatIf(
            execution=EXECUTION,
            policy=self.policy,
            cores=tuple(c.name for c in self.cores),
            fused_cores=self.fused_cores,
            prologue_recomputed=self.prologue,
            saved_for_backward_bytes=self.saved_bytes,
            eager_saved_for_backward_bytes=self.eager_saved_bytes,
            recompute_input_bytes=self.input_bytes,
            recompute_flops=self.recompute_flops,
            recompute_mm_flops=self.recompute_mm_flops,
            train_peak_bytes=self.train_peak_bytes or None,
            per_core=tuple(CheckpointedModule(m, f, k) for m, (f, k) in self.per_core.items()),
        )


def _numel(v: object) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel()
    if isinstance(v, (tuple, list)):
        return sum(_numel(x) for x in v)
    return 0


def _is_random(n: Node) -> bool:
    """A random op (dropout's draw): ATen's ``nondeterministic_seeded`` tag."""
    return torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())


def _fused(n: Node) -> bool:
    return getattr(n.meta.get(COMPOSITE), "op", None) == FUSED_SDPA


def attention_cores(forward: GraphModule) -> tuple[list[AttentionCore], int]:
    """The attention cores of ``forward`` (module docstring) and the number of attention
    calls traced as PyTorch's fused kernel (left out of the cores)."""
    sig = forward.meta[SIGNATURE]
    state = {p for p, _ in sig.params} | {b for b, _ in sig.buffers}
    order = {n: i for i, n in enumerate(forward.graph.nodes)}
    data: set[Node] = set()  # computed from the model's inputs
    for n in forward.graph.nodes:
        if (n.op == "placeholder" and n.name in sig.inputs) or any(
            a in data for a in n.all_input_nodes
        ):
            data.add(n)

    def product(n: Node) -> bool:
        pos = _PRODUCTS.get(n.target) if n.op == "call_function" else None  # type: ignore[call-overload]
        if pos is None:
            return False
        ops = [n.args[i] for i in pos]
        return all(isinstance(a, Node) and a in data and not _is_state(a, state) for a in ops)

    cores: list[AttentionCore] = []
    fused: set[tuple[str, int]] = set()
    taken: set[Node] = set()
    names: dict[str, int] = {}
    for s in forward.graph.nodes:
        if not product(s) or s in taken:
            continue
        if _fused(s):
            tag = s.meta[COMPOSITE]
            fused.add((s.meta.get(MODULE) or "", tag.region))
            continue
        found = _core(s, product, order)
        if found is None:
            continue
        end, core = found
        pro = _prologue(core, state)
        taken |= core
        mod = s.meta.get(MODULE) or "(root)"
        names[mod] = names.get(mod, 0) + 1
        cores.append(
            AttentionCore(
                mod if names[mod] == 1 else f"{mod}#{names[mod]}",
                s.name,
                end.name,
                tuple(n.name for n in sorted(core, key=order.__getitem__)),
                tuple(n.name for n in sorted(pro, key=order.__getitem__)),
            )
        )
    return cores, len(fused)


def _core(s: Node, product, order: dict[Node, int]) -> tuple[Node, set[Node]] | None:
    """(the product with v, the core's nodes) of score product ``s``, or None: no product of
    activations consumes its result, or another matrix product lies between the two."""
    desc: set[Node] = set()
    todo = [s]
    while todo:  # descendants, up to (not through) the next products of activations
        for u in todo.pop().users:
            if u not in desc:
                desc.add(u)
                if not product(u):
                    todo.append(u)
    ends = sorted((u for u in desc if product(u)), key=order.__getitem__)
    if not ends:
        return None
    end = ends[0]
    core = {s, end}
    todo = [end]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a in desc and a not in core:
                core.add(a)
                todo.append(a)
    if any(getattr(n.meta.get(COST), "mm_flops", 0) for n in core - {s, end}):
        return None  # another matrix product between the two: a layer, not a core
    return end, core


def _prologue(core: set[Node], state: set[str]) -> set[Node]:
    """The cheap ops whose value only the core (or ops already taken) reads, taken in
    transitively: views, copies and elementwise ops, no matrix product, not parameters or
    derived from them only."""
    region = set(core)
    pro: set[Node] = set()
    todo = [a for n in core for a in n.all_input_nodes if a not in region]
    while todo:
        a = todo.pop()
        if a in region or a.op != "call_function" or _is_state(a, state) or _fused(a):
            continue
        c = a.meta.get(COST)
        if c is None or c.mm_flops or c.flops > _numel(a.meta.get("val")):
            continue
        if not all(u in region for u in a.users):
            continue
        region.add(a)
        pro.add(a)
        todo.extend(x for x in a.all_input_nodes if x not in region)
        # an input left out earlier may now have all its users inside
        todo.extend(x for n in region for x in n.all_input_nodes if x not in region)
    return pro


def selective_recompute(
    forward: GraphModule,
    backward: GraphModule,
    policy: str = "attention",
    device: str = "cpu",
    optimizer: str | None = None,
    eager_train_peak: int | None = None,
) -> RecomputeMemory:
    """Saved bytes, recompute FLOPs and (with ``optimizer`` and ``eager_train_peak``, the
    eager model's train peak without the what-if) the train peak with every attention core
    recomputed in the backward (module docstring). ``device``: of the eager model (dropout
    mask dtype, optimizer temporaries).

    The train peak is an estimate: ``eager_train_peak`` plus the change in the peak of the
    checkpoint what-if's train schedule (:mod:`graphflop.passes.checkpoint`) when the cores'
    residuals are dropped in the forward and made again just before the backward first reads
    them, plus the CPU generator state each core that reruns a random op (its dropout)
    keeps for its rerun.

    Raises:
        RecomputePolicyError: an unknown policy, or a graph with no attention core (neither
            a math one nor a fused one).
    """
    check_policy(policy)
    cores, fused = attention_cores(forward)
    if not cores and not fused:
        raise RecomputePolicyError(
            "recompute attention: the model has no attention core (a matrix product of two "
            "activations whose result another such product consumes): drop --recompute"
        )
    eager = eager_residuals(forward, backward, device)
    storage, size = forward_storages(forward, eager.sizes)
    sig = forward.meta[SIGNATURE]
    state = {p for p, _ in sig.params} | {b for b, _ in sig.buffers}
    fnodes = {n.name: n for n in forward.graph.nodes}

    def cut_with(prologue: bool):
        region: dict[Node, str] = {}
        for c in cores:
            for x in (*c.core, *(c.prologue if prologue else ())):
                region[fnodes[x]] = c.name
        cut = _cut(backward, eager, storage, region, fnodes)
        inputs: dict[str, set[str]] = {}
        for n, r in region.items():
            for a in n.all_input_nodes:
                if region.get(a) != r and not _is_state(a, state) and a.name in storage:
                    inputs.setdefault(r, set()).add(storage[a.name])
        all_inputs = set().union(*inputs.values()) if inputs else set()
        # a core's input that one of its ops also saves (the score product saves q and k) is
        # kept, not made again: the backward reads the stored copy
        for p, (r, keys) in list(cut.dropped.items()):
            rest = [k for k in keys if k not in inputs.get(r, ())]
            if rest:
                cut.dropped[p] = (r, rest)
            else:
                del cut.dropped[p]
        return region, cut, inputs, all_inputs, sum(size[k] for k in cut.kept | all_inputs)

    with_pro = cut_with(True)
    without = cut_with(False)
    use_pro = with_pro[-1] < without[-1]
    region, cut, inputs, all_inputs, saved = with_pro if use_pro else without
    per_core: dict[str, tuple[int, int]] = {}
    mm = 0
    for c in cores:
        nodes = [fnodes[x] for x in (*c.core, *(c.prologue if use_pro else ()))]
        costs = [n.meta.get(COST) for n in nodes]
        per_core[c.name] = (sum(getattr(k, "flops", 0) for k in costs), len(nodes))
        mm += sum(getattr(k, "mm_flops", 0) for k in costs)
    peak = None
    if optimizer is not None and eager_train_peak is not None:
        peaks = []
        for cut_, ins in ((cut, inputs), (_cut(backward, eager, storage, {}, fnodes), {})):
            sched = _train_schedule(forward, backward, eager, size, cut_, ins, optimizer, device)
            peaks.append(sched.peak()[0])
        # each rerun of a random op (its dropout) restores the generator state kept at its
        # first run; a core with no random op (no dropout, or p = 0) keeps none
        rng = torch.get_rng_state().numel() * sum(
            any(_is_random(fnodes[x]) for x in (*c.core, *(c.prologue if use_pro else ())))
            for c in cores
        )
        peak = eager_train_peak + peaks[0] - peaks[1] + rng
    kept = cut.kept | all_inputs
    return RecomputeMemory(
        policy=policy,
        cores=tuple(cores),
        fused_cores=fused,
        prologue=use_pro,
        saved_bytes=saved,
        eager_saved_bytes=sum(size[k] for k in cut.full),
        input_bytes=sum(size[k] for k in all_inputs),
        recompute_flops=sum(f for f, _ in per_core.values()),
        recompute_mm_flops=mm,
        saved_storages=frozenset(k.split(":", 1)[1] for k in kept),
        recomputed=frozenset(n.name for n in region),
        per_core=per_core,
        train_peak_bytes=peak,
    )
