"""The public pass API: each function takes and returns ``torch.fx.GraphModule``s and declares
what it requires of its input (see :mod:`graphflop.passes.manager`). The node annotations they
read and write are documented in one place, :mod:`graphflop.meta`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.fx import GraphModule

from graphflop.ad import jvp as _jvp
from graphflop.ad import vjp as _vjp
from graphflop.meta import JVP, MEMORY, SIGNATURE, VJP, MemoryInfo
from graphflop.ops import registry
from graphflop.passes import flops as _flops
from graphflop.passes import memory as _memory
from graphflop.passes import optimizer as _optimizer
from graphflop.passes.manager import Pass, check

build_vjp = Pass("build_vjp", _vjp.build_vjp, requires=("traced",), ensures=("vjp",))
build_jvp = Pass("build_jvp", _jvp.build_jvp, requires=("traced",), ensures=("jvp",))
annotate_flops = Pass("annotate_flops", _flops.annotate_flops, ensures=("flops",))


def _add_update(forward: GraphModule, optimizer: str = "sgd") -> GraphModule:
    sig = forward.meta[SIGNATURE]
    phs = {n.name: n for n in forward.graph.nodes if n.op == "placeholder"}
    return _optimizer.build_update(
        [(q, phs[p].meta["val"]) for p, q in sig.params], optimizer, fake_mode=_fake(forward)
    )


def _fake(gm):
    from graphflop.meta import fake_mode_of

    return fake_mode_of([n.meta["val"] for n in gm.graph.nodes if "val" in n.meta])


#: ``add_optimizer_update(forward, optimizer)`` → the update graph for ``forward``'s parameters
add_optimizer_update = Pass(
    "add_optimizer_update", _add_update, requires=("traced",), ensures=("update",)
)


def _annotate_memory(gm: GraphModule) -> GraphModule:
    """Write ``gm.meta[MEMORY]``, a :class:`~graphflop.meta.MemoryInfo`: the live-tensor peak of ``gm`` on
    its own (parameters excluded for traced forward graphs)."""
    if JVP in gm.meta:
        sched = _memory.jvp_schedule(gm)
    elif SIGNATURE in gm.meta and VJP not in gm.meta:
        sched = _memory.forward_schedule(gm)
    else:
        sched = _memory.Schedule()
        sched.add_graph(gm, "g", baseline=set(), keep_outputs=True)
    peak, where = sched.peak()
    gm.meta[MEMORY] = MemoryInfo(peak_bytes=peak, peak_at=where.split(":", 1)[-1])
    return gm


annotate_memory = Pass("annotate_memory", _annotate_memory, ensures=("memory",))


def register_rule(
    op: Any,
    *,
    cost: Callable[..., Any],
    jvp: Callable[..., Any] | None = None,
    transpose: Callable[..., Any] | None = None,
    family: str = "custom",
    bytes: str = "compute",
) -> registry.OpRule:
    """Add cost, JVP and transpose rules for an op (a custom op's ``OpOverload``, e.g.
    ``torch.ops.mylib.scale.default``). Signatures are those of :mod:`graphflop.ops.registry`.

    A pass that needs a kind of rule the op lacks raises ``MissingRuleError`` naming the op and
    the missing kinds (``jvp``, ``transpose``).
    """
    return registry.register(op, family, cost, bytes=bytes, jvp=jvp, transpose=transpose)


__all__ = [
    "add_optimizer_update",
    "annotate_flops",
    "annotate_memory",
    "build_jvp",
    "build_vjp",
    "check",
    "register_rule",
]
