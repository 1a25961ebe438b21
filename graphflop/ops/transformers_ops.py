"""Rules for the custom ops HuggingFace ``transformers`` defines (namespace ``transformers``),
registered when a graph first holds one (the ops exist only once transformers has defined
them: :func:`register_transformers_rules`, called by the rule table's lookup).

``transformers::grouped_mm_fallback(x, W, offs)``: the routed experts of a mixture-of-experts
layer on a CPU (or any device where ``torch._grouped_mm`` cannot be used): x (S, K) holds the S
token-expert pairs sorted by expert, W (E, K, N) the E experts' weights, offs (E,) the running
count of rows per expert; row r of the output is ``x[r] · W[e(r)]``. Every row meets exactly one
expert, so the cost is 2·S·K·N FLOPs (all in ``mm_flops``) whatever the split of rows among
experts: the routing changes which weights a row meets, not how many multiply-adds it takes.
The op is bilinear in (x, W) with ``offs`` constant: its JVP is ``op(dx, W) + op(x, dW)``; its
transpose gives x's cotangent ``op(ct, Wᵀ)`` (2·S·N·K) and W's, per expert ``x_gᵀ·ct_g``
(2·S·K·N), with graphflop's op ``graphflop::grouped_mm_weight_grad(x, ct, offs, E)`` (the
product transformers' backward computes; its backward op needs W, which the transpose of
``op(x, dW)`` does not have).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import shape
from graphflop.ops.registry import def_bilinear, register

F = "linalg"


def _grouped_cost(out, x, w, offs, *args, **kwargs) -> NodeCost:
    """2·S·K·N for x (S, K) and W (E, K, N): one K-long product per output element; S the
    rows the routing assumption computes (:class:`Routing`: S itself unless a capacity)."""
    s, k = shape(x)
    f = 2 * current_routing().rows(s, shape(w)[0]) * k * shape(w)[-1]
    return NodeCost(flops=f, mm_flops=f)


@torch.library.custom_op("graphflop::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(
    x: torch.Tensor, ct: torch.Tensor, offs: torch.Tensor, experts: int
) -> torch.Tensor:
    """Per group g of rows (``offs``: running row counts, one per group), ``x_gᵀ · ct_g``:
    (experts, K, N) for x (S, K) and ct (S, N); a group with no rows gets zeros."""
    out = x.new_zeros(experts, x.shape[1], ct.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[g] = x[start:end].T @ ct[start:end]
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _(x: torch.Tensor, ct: torch.Tensor, offs: torch.Tensor, experts: int) -> torch.Tensor:
    return x.new_empty(experts, x.shape[1], ct.shape[1])


def _weight_grad_cost(out, x, ct, offs, experts, *args, **kwargs) -> NodeCost:
    """2·S·K·N: every row's outer product x_r ⊗ ct_r added into its group's (K, N); S as in
    the forward (:class:`Routing`)."""
    s, k = shape(x)
    f = 2 * current_routing().rows(s, experts) * k * shape(ct)[-1]
    return NodeCost(flops=f, mm_flops=f)


def _transpose_grouped(op: Any):
    def transpose(b, ct, args, kwargs, linear):
        x, w, offs = args[:3]
        cts: list[Any] = [None, None, None]
        if linear[0]:  # op(dx, W): W is a primal
            wt = b.call(torch.ops.aten.transpose.int, w, 1, 2)
            cts[0] = b.call(op, ct, wt, offs)
        if linear[1]:  # op(x, dW): x is a primal
            grad = torch.ops.graphflop.grouped_mm_weight_grad.default
            cts[1] = b.call(grad, x, ct, offs, shape(w)[0])
        return cts

    return transpose


def register_transformers_rules() -> None:
    """Register the rules of the transformers ops that exist now (idempotent)."""
    ns = getattr(torch.ops, "transformers", None)
    if ns is None:
        return
    try:
        op = ns.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):  # a transformers without it
        return
    from graphflop.ops import registry

    if op in registry._TABLE:
        return
    grad = torch.ops.graphflop.grouped_mm_weight_grad.default
    register(grad, F, _weight_grad_cost, context=current_routing)
    register(op, F, _grouped_cost, context=current_routing)
    def_bilinear(op, _transpose_grouped(op))


# --- the routing assumption ---------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """How the T·k token-expert rows of a routed-experts layer spread over its E experts, as
    far as the count depends on it.

    ``balanced`` (the default): T·k/E rows per expert, the expectation under uniform routing;
    every row is computed once, so the FLOPs are those of the T·k rows whatever the split.
    ``capacity`` (factor F): each expert computes a buffer of C = ⌈F·T·k/E⌉ rows, padded
    when it receives fewer, its overflow dropped when more (Switch/GShard-style capacity):
    E·C rows. ``histogram`` (measured counts, one per expert, scaled to T·k): the split is
    reported; without a capacity the FLOPs are again those of the T·k rows.
    """

    kind: str = "balanced"
    factor: float | None = None
    counts: tuple[float, ...] | None = None

    def rows(self, rows: int, experts: int) -> int:
        """Rows the grouped products of ``rows`` token-expert pairs over ``experts`` compute."""
        if self.kind == "capacity":
            assert self.factor is not None
            return experts * math.ceil(self.factor * rows / experts)
        return rows

    def tokens_per_expert(self, rows: int, experts: int) -> list[float]:
        """Rows each expert receives (capacity: the buffer each computes)."""
        if self.kind == "capacity":
            return [float(self.rows(rows, experts) // experts)] * experts
        if self.kind == "histogram":
            assert self.counts is not None
            total = sum(self.counts)
            return [rows * c / total for c in self.counts]
        return [rows / experts] * experts

    def expert_rows(self, rows: int, experts: int, expert: int | None) -> int:
        """Rows expert ``expert`` (0-based; None: not known) receives of ``rows`` token-expert
        rows, a whole number: balanced, ⌊rows/E⌋ plus one for each of the first rows mod E
        experts (the experts' rows sum to ``rows``); a histogram, its counts apportioned to
        ``rows`` by largest remainders (ties to the lower expert); an expert outside 0..E-1
        none.

        Raises:
            ValueError: a capacity (a loop over experts computes what each receives, no
                buffer); an unknown expert where the rows differ among experts; a histogram
                of another number of experts.
        """
        if expert is not None and not 0 <= expert < experts:
            return 0  # no index equals it
        if self.kind == "capacity":
            raise ValueError(
                f"--routing capacity:{self.factor:g} describes a capacity-limited expert "
                "buffer, and this model's loop over its experts computes the rows each "
                "receives: use --routing balanced or a histogram"
            )
        if self.kind == "histogram":
            assert self.counts is not None
            if len(self.counts) != experts:
                raise ValueError(
                    f"the routing histogram holds {len(self.counts)} counts and the router "
                    f"chooses among {experts} experts: give one count per expert"
                )
            total = sum(self.counts)
            shares = [rows * c / total for c in self.counts]
            whole = [math.floor(s) for s in shares]
            order = sorted(range(experts), key=lambda i: (-(shares[i] - whole[i]), i))
            for i in order[: rows - sum(whole)]:
                whole[i] += 1
            if expert is None:
                raise ValueError(
                    "a histogram routing needs each expert's number, and the indices are "
                    "compared with a tensor: compare them with the Python int of the expert "
                    "(idx == e)"
                )
            return whole[expert]
        if expert is None:
            if rows % experts:
                raise ValueError(
                    f"{rows} token-expert rows do not split evenly over {experts} experts and "
                    "the indices are compared with a tensor, not the expert's Python int: "
                    "compare them with the int (idx == e)"
                )
            return rows // experts
        return rows // experts + (1 if expert < rows % experts else 0)

    def name(self) -> str:
        """The routing as ``--routing`` spells it (a histogram: its counts)."""
        if self.kind == "capacity":
            return f"capacity:{self.factor:g}"
        if self.kind == "histogram":
            assert self.counts is not None
            return "histogram [" + ", ".join(f"{c:g}" for c in self.counts) + "]"
        return "balanced"

    def describe(self) -> str:
        if self.kind == "capacity":
            return (
                f"capacity factor {self.factor:g}: each expert computes ⌈{self.factor:g}·T·k/E⌉ "
                "rows, padded when it receives fewer, its overflow dropped"
            )
        if self.kind == "histogram":
            return (
                f"measured histogram of {len(self.counts or ())} experts, scaled to T·k; every "
                "token-expert row computed once (no capacity limit)"
            )
        return (
            "balanced: T·k/E rows per expert, the expectation under uniform routing; every "
            "token-expert row computed once, whatever the split (no capacity limit)"
        )


_BALANCED = Routing()
_ROUTING: contextvars.ContextVar[Routing | None] = contextvars.ContextVar("routing", default=None)


def current_routing() -> Routing:
    """The routing assumption the grouped products are counted under (balanced unless set)."""
    return _ROUTING.get() or _BALANCED


@contextlib.contextmanager
def routing(model: Routing) -> Iterator[None]:
    """Count the routed experts' grouped products under ``model`` in this block."""
    token = _ROUTING.set(model)
    try:
        yield
    finally:
        _ROUTING.reset(token)


def parse_routing(text: str) -> Routing:
    """``balanced``, ``capacity:F`` (F > 0; its upper bound, E/k, depends on the model) or
    the path of a JSON file holding a list of per-expert token counts (non-negative, not all
    zero).

    Raises:
        ValueError: anything else, with what to give instead.
    """
    if text == "balanced":
        return Routing()
    if text.startswith("capacity:"):
        try:
            factor = float(text.partition(":")[2])
        except ValueError:
            factor = math.nan
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"bad --routing {text}: give capacity:F with F > 0 (e.g. 1.25)")
        return Routing("capacity", factor=factor)
    path = Path(text)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "not found"
        raise ValueError(
            f"bad --routing {text}: {what}; give balanced, capacity:F or a JSON file holding a "
            "list of one token count per expert"
        )
    try:
        counts = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--routing {text}: cannot read it as JSON: {e}") from e
    if (
        not isinstance(counts, list)
        or len(counts) < 2
        or not all(isinstance(c, (int, float)) and c >= 0 for c in counts)
        or not sum(counts) > 0
    ):
        raise ValueError(
            f"--routing {text}: give a JSON list of one non-negative token count per expert, "
            "not all zero (e.g. [310, 250, 198, 266])"
        )
    return Routing("histogram", counts=tuple(float(c) for c in counts))
