"""What-if: activation checkpointing of the modules whose path matches a pattern.

``torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False)`` runs the module's
forward under saved-tensor hooks that keep nothing: the tensors its ops would save are dropped,
the module's inputs are kept (the recompute closure holds them), and the backward reruns the
module's forward the first time one of its saved tensors is needed, stopping as soon as every
tensor the first run saved has been recomputed (``set_checkpoint_early_stop(True)``, the
default), so ops after the module's last saving op are not rerun.

:func:`checkpoint_memory` computes that from graphflop's annotated forward graph, on top of the
eager memory model's saved set (:mod:`graphflop.passes.eager_memory`):

* a checkpointed region is every forward node whose :data:`~graphflop.meta.MODULE` path is a
  matching path or lies under one (the outermost matching path names the region);
* a residual stays saved when at least one backward op that reads it was made by the rule of a
  forward node outside every region; residuals read only by the backward of region nodes are
  dropped; each region's inputs (values made outside it and read inside it, parameters, buffers
  and values derived from parameters only left out) are saved. The values eager saves for a
  plain ATen op beyond graphflop's residuals (average pooling's input, gather's: the eager
  model's :attr:`~graphflop.passes.eager_memory.EagerResiduals.held`) are cut the same way,
  the op itself their reader;
* a region's recompute is its forward nodes in graph order up to the last one whose value
  eager saves (the eager model's stand-in for a residual), that node's whole composite op
  included; its FLOPs are those nodes' :data:`~graphflop.meta.COST` FLOPs. An op that saves
  only its inputs (a linear layer: its input and weight) is not rerun when it comes last:
  autograd packs the inputs an op saves before its kernel runs, and the pack that completes
  the count stops the recompute there (measured: a checkpointed ``fc2(relu(fc1(x)))`` reruns
  fc1's ``addmm`` and the ``relu``, not fc2's ``addmm``).

With an optimizer, the train peak is estimated: the eager train schedule (the report's,
:func:`~graphflop.passes.eager_memory.eager_train_schedule`) in which dropped residuals are
freed after their last forward reader and made again just before the first backward node
reading any of its region's dropped residuals (the region's inputs live until then), plus the
CPU generator state each call keeps; the recompute's other temporaries are left out.

Bytes follow the eager model's conventions (once per storage, parameters and buffers excluded,
inputs and targets included). A module called several times forms one region (its calls are not
told apart). Reads ``val``, ``MODULE``, ``COST``, ``COMPOSITE``, ``RESIDUAL``, ``SOURCE``,
``PARAM_DERIVED``; writes nothing.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from torch.fx import GraphModule, Node

from graphflop.meta import (
    COMPOSITE,
    COST,
    MODULE,
    PARAM_DERIVED,
    ROLE,
    SIGNATURE,
    SOURCE,
)
from graphflop.passes.eager_memory import (
    checkpoint_calls,
    eager_residuals,
    eager_train_schedule,
    embedding_indices,
    not_saved,
    rng_state_bytes,
)
from graphflop.passes.memory import Schedule, forward_storages
from graphflop.report import CheckpointedModule, CheckpointWhatIf

__all__ = [
    "EXECUTION",
    "CheckpointMemory",
    "CheckpointPatternError",
    "checkpoint_memory",
    "module_matcher",
]


class CheckpointPatternError(ValueError):
    """A checkpoint what-if pattern (``--checkpoint``, ``AnalyzeOptions.checkpoint``) that is
    malformed or matches no module."""


#: the execution the checkpoint figures describe
EXECUTION = (
    "eager step with torch.utils.checkpoint(use_reentrant=False) around each matching module: "
    "its inputs saved, its internal activations recomputed in the backward (early stop)"
)


def module_matcher(pattern: str):
    """A predicate on module paths (``layers.fc1``): ``pattern`` is a shell glob matched
    against the whole path (``fnmatch.fnmatchcase``: ``h.*`` matches ``h.0`` and ``h.0.mlp``),
    or, prefixed with ``re:``, a Python regular expression that must match the whole path.

    Raises:
        CheckpointPatternError: an empty pattern or a bad regular expression.
    """
    if not pattern or pattern == "re:":
        raise CheckpointPatternError(
            "empty checkpoint pattern: give a module path glob such as 'h.*'"
        )
    if pattern.startswith("re:"):
        try:
            rx = re.compile(pattern[3:])
        except re.error as e:
            raise CheckpointPatternError(
                f"bad checkpoint pattern: regular expression {pattern[3:]!r}: {e}"
            ) from None
        return lambda path: rx.fullmatch(path) is not None
    return lambda path: fnmatch.fnmatchcase(path, pattern)


@dataclass(frozen=True)
class CheckpointMemory:
    """Attributes:
    pattern: the pattern as given.
    modules: the checkpointed module paths (outermost matches), in forward order.
    saved_bytes: bytes saved for backward with checkpointing (once per storage).
    eager_saved_bytes: the eager model's saved bytes without checkpointing.
    input_bytes: of ``saved_bytes``, the checkpointed modules' inputs (once per storage).
    recompute_flops: FLOPs of the forward nodes rerun in the backward, all modules.
    per_module: module path -> (recompute FLOPs, recomputed nodes).
    train_peak_bytes: estimated train-step peak with checkpointing, parameters, gradients
        and optimizer state included; None when not computed.
    recomputed: the forward node names rerun in the backward, all modules.
    """

    pattern: str
    modules: tuple[str, ...]
    saved_bytes: int
    eager_saved_bytes: int
    input_bytes: int
    recompute_flops: int
    per_module: dict[str, tuple[int, int]]
    train_peak_bytes: int | None = None
    recomputed: frozenset[str] = frozenset()

    def to_report(self) -> CheckpointWhatIf:
        """The report's section ``memory.checkpoint``."""
        return CheckpointWhatIf(
            execution=EXECUTION,
            pattern=self.pattern,
            pattern_syntax="regex" if self.pattern.startswith("re:") else "glob",
            modules=tuple(self.modules),
            saved_for_backward_bytes=self.saved_bytes,
            eager_saved_for_backward_bytes=self.eager_saved_bytes,
            checkpoint_input_bytes=self.input_bytes,
            recompute_flops=self.recompute_flops,
            train_peak_bytes=self.train_peak_bytes or None,
            per_module=tuple(CheckpointedModule(m, f, k) for m, (f, k) in self.per_module.items()),
        )


def _module_path(n: Node) -> str | None:
    """The module path of a node a checkpoint can hold: not the loss graphflop appends, which
    is no module eager PyTorch could checkpoint."""
    return None if n.meta.get(ROLE) == "loss" else n.meta.get(MODULE)


def _regions(forward: GraphModule, match) -> dict[Node, str]:
    """Forward node -> the outermost matching module path it lies in (call nodes only; not
    the loss, :func:`_module_path`)."""
    out: dict[Node, str] = {}
    for n in forward.graph.nodes:
        path = _module_path(n) if n.op == "call_function" else None
        if not path:
            continue
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if match(prefix):
                out[n] = prefix
                break
    return out


def _is_state(n: Node, state: set[str]) -> bool:
    return n.name in state or bool(n.meta.get(PARAM_DERIVED))


def _recompute(nodes: list[Node], savers: set[str]) -> list[Node]:
    """The region's nodes rerun before early stop: up to the last saver, its composite op
    whole."""
    last = max((i for i, n in enumerate(nodes) if n.name in savers), default=-1)
    if last < 0:
        return []
    tag = nodes[last].meta.get(COMPOSITE)
    while (
        tag is not None
        and last + 1 < len(nodes)
        and getattr(nodes[last + 1].meta.get(COMPOSITE), "region", None) == tag.region
    ):
        last += 1
    return nodes[: last + 1]


@dataclass
class _Cut:
    """Which storages stay saved and which a region recomputes."""

    kept: set[str]
    full: set[str]
    #: region -> the forward values its own ops pack for the backward (what its rerun must
    #: make again). A value another region's op packs is that region's input, held by its
    #: checkpoint: GPT-2's block N output, read by block N+1's first layer norm, is not rerun
    #: by block N (eager reruns block N only up to its MLP's GELU; tester, stop 45)
    savers: dict[str, set[str]]
    #: backward placeholder, or backward node holding a plain op's saved values
    #: (:attr:`~graphflop.passes.eager_memory.EagerResiduals.held`) -> (region, storage keys)
    dropped: dict[str, tuple[str, list[str]]]


def _saved_reads(
    backward: GraphModule, eager, indices: frozenset[str] = frozenset()
) -> list[tuple[str, list[str], list[str]]]:
    """What eager saves for backward, as (backward node, the forward ops whose backward reads
    it, the forward node names it stands for): each activation residual placeholder (its
    readers' sources, :attr:`~graphflop.passes.eager_memory.EagerResiduals.remap`) and each
    backward node holding a plain op's saved values (its own source,
    :attr:`~graphflop.passes.eager_memory.EagerResiduals.held`)."""
    out = []
    for n in backward.graph.nodes:
        if n.name in eager.held:
            out.append((n.name, [n.meta.get(SOURCE, "")], eager.held[n.name]))
        if n.op != "placeholder" or not_saved(n, indices):  # (indices: embedding_indices)
            continue
        users = [u.meta.get(SOURCE, "") for u in n.users]
        out.append((n.name, users, eager.remap.get(n.name, [n.meta.get(SOURCE, n.name)])))
    return out


def _cut(
    backward: GraphModule, eager, storage: dict[str, str], region: dict[Node, str], fnodes
) -> _Cut:
    cut = _Cut(set(), set(), {}, {})
    indices = embedding_indices(list(fnodes.values()))
    for p, users, stand in _saved_reads(backward, eager, indices):
        for s in users:  # packed under the checkpoint of the user's region
            if fnodes.get(s) in region:
                cut.savers.setdefault(region[fnodes[s]], set()).update(stand)
        keys = [storage[s] for s in stand if s in storage]
        cut.full.update(keys)
        if any(fnodes.get(s) not in region for s in users):
            cut.kept.update(keys)
        elif users:
            cut.dropped[p] = (region[fnodes[users[0]]], keys)
    return cut


def checkpoint_memory(
    forward: GraphModule,
    backward: GraphModule,
    pattern: str,
    device: str = "cpu",
    optimizer: str | None = None,
    state_bytes: int = 0,
) -> CheckpointMemory:
    """Saved bytes, recompute FLOPs and (with ``optimizer``) the train peak with the matching
    modules checkpointed (module docstring). ``device``: of the eager model (dropout mask
    dtype, optimizer temporaries); ``state_bytes``: parameters, buffers and optimizer state, added to
    the peak.

    Raises:
        CheckpointPatternError: a bad pattern, or no module path of the forward graph
            matches it.
    """
    match = module_matcher(pattern)
    region = _regions(forward, match)
    if not region:
        paths = sorted({p for n in forward.graph.nodes if (p := _module_path(n))})
        raise CheckpointPatternError(
            f"checkpoint pattern {pattern!r} matches no module; module paths: "
            + ", ".join(paths[:12])
            + (" ..." if len(paths) > 12 else "")
        )
    eager = eager_residuals(forward, backward, device)
    storage, size = forward_storages(forward, eager.sizes)
    sig = forward.meta[SIGNATURE]
    state = sig.state()
    cut = _cut(backward, eager, storage, region, {n.name: n for n in forward.graph.nodes})
    inputs: dict[str, set[str]] = {}
    by_region: dict[str, list[Node]] = {}
    for n, r in region.items():
        by_region.setdefault(r, []).append(n)
        for a in n.all_input_nodes:
            if region.get(a) != r and not _is_state(a, state) and a.name in storage:
                inputs.setdefault(r, set()).add(storage[a.name])
    per_module = {}
    recomputed: set[str] = set()
    for r, nodes in by_region.items():
        rerun = _recompute(nodes, cut.savers.get(r, set()))
        per_module[r] = (sum(getattr(n.meta.get(COST), "flops", 0) for n in rerun), len(rerun))
        recomputed.update(n.name for n in rerun)
    all_inputs = set().union(*inputs.values()) if inputs else set()
    peak = None
    if optimizer is not None:
        sched = _train_schedule(forward, backward, eager, size, cut, inputs, optimizer, device)
        # each call keeps the CPU generator's state (preserve_rng_state=True) to the backward,
        # and fork_rng copies it once more during a recompute (rng_state_bytes); the model's
        # own checkpoint calls' states too, as the report's train peak counts them
        rng = rng_state_bytes(len(by_region) + checkpoint_calls(forward))
        peak = state_bytes + rng + sched.peak()[0]
    return CheckpointMemory(
        pattern=pattern,
        modules=tuple(by_region),
        saved_bytes=sum(size[k] for k in cut.kept | all_inputs),
        eager_saved_bytes=sum(size[k] for k in cut.full),
        input_bytes=sum(size[k] for k in all_inputs),
        recompute_flops=sum(f for f, _ in per_module.values()),
        per_module=per_module,
        train_peak_bytes=peak,
        recomputed=frozenset(recomputed),
    )


def _train_schedule(
    forward, backward, eager, size, cut: _Cut, inputs, optimizer: str, device: str
) -> Schedule:
    """The eager train schedule (:func:`~graphflop.passes.eager_memory.eager_train_schedule`,
    the report's, the optimizer's temporaries included) with checkpointing: residuals a
    region drops (and the values a plain op of the region holds) are freed in the forward
    after their last forward reader, and made again (``r:`` storages) just before the first
    backward node that reads any of that region's dropped values, the region's inputs kept
    live until then. The recompute's other temporaries are left out."""
    from graphflop.passes.memory import Step

    stand = {p: [f"r:{r}:{k}" for k in keys] for p, (r, keys) in cut.dropped.items()}
    s = eager_train_schedule(forward, backward, optimizer, device, eager=eager, stand_in=stand)
    new: dict[str, tuple[str, int]] = {}  # r: key -> (region, bytes)
    for r, keys in cut.dropped.values():
        for k in keys:
            new[f"r:{r}:{k}"] = (r, size[k])
    first: dict[str, int] = {}
    for i, st in enumerate(s.steps):
        for k in st.reads:
            if k in new:
                first.setdefault(new[k][0], i)
    for r, i in sorted(first.items(), key=lambda kv: -kv[1]):
        keep = sorted(inputs.get(r, ()))
        for k in [k for k, (rr, _) in new.items() if rr == r]:
            s.steps.insert(i, Step(k, new[k][1], None, list(keep)))
    return s
