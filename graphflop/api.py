"""The public pass API: functions that take and return ``torch.fx.GraphModule``s.

Each function runs one graphflop pass (a ``torch.fx.passes.infra.pass_base.PassBase``, see
:mod:`graphflop.passes.infra`): it checks what the pass requires of its input (raising
:class:`~graphflop.passes.infra.PassOrderError` naming the missing fact and the pass that
provides it), runs it, and records the facts the result has in ``gm.meta[FACTS]``. The pass
classes themselves run in torch.fx's ``PassManager``. The node annotations they read and write
are documented in one place, :mod:`graphflop.meta`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.fx import GraphModule

from graphflop.ops import registry
from graphflop.passes.autodiff import BuildJvp, BuildVjp
from graphflop.passes.flops import AnnotateFlops
from graphflop.passes.forward_gradient import BuildForwardGradientStep
from graphflop.passes.infra import PassManager, PassOrderError, check
from graphflop.passes.memory import AnnotateMemory
from graphflop.passes.optimizer import AddOptimizerUpdate, OptimizerConfig
from graphflop.passes.train_step import BuildTrainStep


def build_vjp(
    forward: GraphModule,
    *,
    input_grads: bool = False,
    linearized: GraphModule | None = None,
    direct: bool = False,
) -> GraphModule:
    """The backward graph of a traced forward graph with a loss (:class:`BuildVjp`).

    ``direct=True``: where ``forward`` has repeated blocks, the graph returned is the top
    level of its hierarchy (``gm.meta[DERIVED_HIERARCHY]``; the flat graph is
    ``graphflop.passes.calls.expand`` of it), built without the flat graph where that is
    shown equal.

    Raises:
        PassOrderError: ``forward`` is not ``traced``.
        MissingRuleError, ValueError: see :func:`graphflop.ad.vjp.build_vjp`.
    """
    return BuildVjp(input_grads=input_grads, linearized=linearized, direct=direct).apply(forward)


def build_jvp(
    forward: GraphModule,
    tangents: str = "params",
    *,
    wrt_outputs: str = "loss",
    direct: bool = False,
) -> GraphModule:
    """The JVP graph of a traced forward graph (:class:`BuildJvp`).

    ``direct=True``: where ``forward`` has repeated blocks, the graph returned is the top
    level of its hierarchy (``gm.meta[DERIVED_HIERARCHY]``; the flat graph is
    ``graphflop.passes.calls.expand`` of it), built without the flat graph.

    Raises:
        PassOrderError: ``forward`` is not ``traced``.
        MissingRuleError, ValueError: see :func:`graphflop.ad.jvp.build_jvp`.
    """
    return BuildJvp(tangents, wrt_outputs=wrt_outputs, direct=direct).apply(forward)


def add_optimizer_update(
    forward: GraphModule, optimizer: str | OptimizerConfig = "sgd"
) -> GraphModule:
    """The update graph for ``forward``'s parameters (:class:`AddOptimizerUpdate`).

    Raises:
        PassOrderError: ``forward`` is not ``traced``.
        ValueError: an unknown optimizer.
    """
    return AddOptimizerUpdate(optimizer).apply(forward)


def build_forward_gradient_step(
    forward: GraphModule,
    optimizer: str | OptimizerConfig = "sgd",
    *,
    directions: int = 1,
    distribution: str = "normal",
    direction_inputs: bool = False,
    jvp: GraphModule | None = None,
    update: GraphModule | None = None,
) -> GraphModule:
    """The forward-gradient step graph (:class:`BuildForwardGradientStep`; the options are
    those of :func:`graphflop.passes.forward_gradient.build_forward_gradient_step`).

    Raises:
        PassOrderError: ``forward`` is not ``traced``.
        ValueError: see :func:`graphflop.passes.forward_gradient.build_forward_gradient_step`.
    """
    return BuildForwardGradientStep(
        optimizer,
        directions=directions,
        distribution=distribution,
        direction_inputs=direction_inputs,
        jvp=jvp,
        update=update,
    ).apply(forward)


def build_train_step(
    forward: GraphModule, backward: GraphModule, update: GraphModule
) -> GraphModule:
    """Forward, backward and update inlined into one graph (:class:`BuildTrainStep`).

    Raises:
        PassOrderError: ``forward`` is not ``traced``, ``backward`` has no ``vjp`` or
            ``update`` no ``update``.
    """
    return BuildTrainStep(backward, update).apply(forward)


def annotate_flops(gm: GraphModule) -> GraphModule:
    """Write ``COST`` on every node of ``gm``, in place, and return it (:class:`AnnotateFlops`).

    Raises:
        PassOrderError: a node lacks ``val`` (not a traced graph).
        MissingRuleError: a ``call_function`` node whose op has no rule.
    """
    return AnnotateFlops().apply(gm)


def annotate_memory(gm: GraphModule) -> GraphModule:
    """Write ``gm.meta[MEMORY]`` (:class:`~graphflop.meta.MemoryInfo`: the live-tensor peak of
    ``gm`` on its own, in bytes; parameters excluded for traced forward graphs), in place, and
    return ``gm`` (:class:`AnnotateMemory`).

    Raises:
        PassOrderError: a node lacks ``val``.
    """
    return AnnotateMemory().apply(gm)


def register_rule(
    op: Any,
    *,
    cost: Callable[..., Any],
    jvp: Callable[..., Any] | None = None,
    transpose: Callable[..., Any] | None = None,
    family: str = "custom",
    bytes: str = "compute",
    override: bool = False,
) -> registry.OpRule:
    """Add cost, JVP and transpose rules for an op (a custom op's ``OpOverload``, e.g.
    ``torch.ops.mylib.scale.default``). Signatures are those of :mod:`graphflop.ops.registry`.

    An op that already has a rule (a built-in one, or one registered before) is refused unless
    ``override=True``; then ``cost``, ``family`` and ``bytes`` replace the old rule's, and
    ``jvp`` and ``transpose`` too when given, while the old JVP and transpose rules are kept
    when not (so a cost-only override keeps the built-in derivatives).

    A pass that needs a kind of rule the op lacks raises ``MissingRuleError`` naming the op and
    the missing kinds (``jvp``, ``transpose``).

    Raises:
        ValueError: ``op`` already has a rule and ``override`` is false; an unknown ``family``
            or ``bytes`` policy.
    """
    return registry.register_user(
        op, family, cost, override=override, bytes=bytes, jvp=jvp, transpose=transpose
    )


__all__ = [
    "AddOptimizerUpdate",
    "AnnotateFlops",
    "AnnotateMemory",
    "BuildForwardGradientStep",
    "BuildJvp",
    "BuildTrainStep",
    "BuildVjp",
    "PassManager",
    "PassOrderError",
    "add_optimizer_update",
    "annotate_flops",
    "annotate_memory",
    "build_forward_gradient_step",
    "build_jvp",
    "build_train_step",
    "build_vjp",
    "check",
    "register_rule",
]
