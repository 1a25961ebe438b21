"""The default tensor-parallel plan, found from the module structure, and the module layouts a
plan imposes at module boundaries.

Megatron's pattern (Shoeybi et al. 2019, section 3), found without module names: inside a
module holding two or more ``nn.Linear`` layers (an attention block, an MLP), a Linear whose
output reaches another of them through the module's ops (q/k/v or a fused qkv; MLP up and
gate) is column-wise, one whose output reaches none (attention out, MLP down) row-wise; a Linear outside such a module whose
output width is the token embedding's row count (the LM head) is column-wise with its output
gathered (``ColwiseParallel(output_layouts=Replicate())``, as torch's tensor-parallel examples
shard a head; a head that is not a module, as a tied one, stays vocabulary-parallel into the
loss); an
``nn.Embedding`` read with the model's input ids is vocabulary-parallel (``rowwise``, as
``parallelize_module`` shards an embedding), other embeddings (positions) replicated. Under
sequence parallelism, every norm module (``LayerNorm``, ``RMSNorm``, any class named
``*Norm``) is ``sequence_parallel``. Reads ``MODULE``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from torch import nn
from torch.fx import GraphModule, Node

from graphflop.meta import MODULE
from graphflop.parallel.placement import REPLICATE, Placement, shard
from graphflop.parallel.plan import COLWISE_REPLICATE, match_style

__all__ = ["SEQUENCE_DIM", "boundary_layouts", "default_tp_plan", "param_placement"]

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
    return tuple(plan)


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


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("Norm")


def param_placement(
    qualified: str,
    shape: tuple[int, ...],
    tp_plan: tuple[tuple[str, str], ...],
    embeddings: frozenset[str],
) -> Placement:
    """A parameter's placement under the plan: ``colwise`` shards dim 0 (a Linear's weight
    (out, in) and bias); ``rowwise`` a Linear's weight on dim 1 (its bias replicated) and an
    Embedding's weight on dim 0 (the vocabulary); everything else replicated."""
    module, _, leaf = qualified.rpartition(".")
    style = match_style(tp_plan, module)
    if style in ("colwise", COLWISE_REPLICATE):
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
    """The layouts ``parallelize_module`` imposes where a value crosses into or out of a module
    the plan names (see :mod:`graphflop.parallel.placement`): ``(value, consumer, placement,
    forward) -> placement`` the consumer reads, or None for no change."""

    @cache
    def styled(path: str) -> tuple[str, str] | None:
        parts = path.split(".") if path else []
        for i in range(len(parts), 0, -1):
            m = ".".join(parts[:i])
            s = match_style(tp_plan, m)
            if s is not None:
                return m, s
        return None

    def seq(value: Node) -> Placement | None:
        v = value.meta.get("val")
        shape = getattr(v, "shape", ())
        if len(shape) < 3:
            return None
        return shard(SEQUENCE_DIM, int(shape[SEQUENCE_DIM]))

    def layout(value: Node, consumer: Node, p: Placement, forward: bool) -> Placement | None:
        a = styled(value.meta.get(MODULE) or "")
        b = styled(consumer.meta.get(MODULE) or "")
        if a == b:
            return None
        q = p
        if a is not None:  # leaving module a
            style = a[1]
            if forward and style == COLWISE_REPLICATE and q.kind == "S":
                q = REPLICATE  # the output gathered
            elif q.kind == "P" and (
                (forward and style == "rowwise")
                or (not forward and style in ("colwise", COLWISE_REPLICATE))
            ):
                q = (seq(value) if sp else None) or REPLICATE
        if b is not None:  # entering module b
            style = b[1]
            if forward and style in ("colwise", COLWISE_REPLICATE):
                q = REPLICATE
            elif not forward and style == COLWISE_REPLICATE and q == REPLICATE:
                # the gathered output's cotangent: each rank keeps its slice
                shape = getattr(value.meta.get("val"), "shape", ())
                if shape:
                    q = shard(len(shape) - 1, int(shape[-1]))
            elif not forward and style == "rowwise" and (q.kind == "P" or q == seq(value)):
                # the output cotangent entering (a weight cotangent accumulated here is not)
                q = REPLICATE
            elif style == "sequence_parallel":
                q = seq(value) or q
        return None if q == p else q

    return layout
