"""Run graphflop's generated graphs on real random tensors and compare them with PyTorch.

``verify_gradients`` checks every parameter gradient of the backward graph against
``torch.func.grad`` of the same loss (eager ``torch.autograd.grad`` where ``torch.func`` refuses
the model: a custom ``autograd.Function`` without ``setup_context``, ``torch.utils.checkpoint``'s
saved-tensor hooks; either runs the model's own Functions with their own ``backward``); :func:`graphflop.runtime.verify_tangent.verify_jvp` checks
the JVP graph's loss tangent against ``torch.func.jvp``, and
:func:`graphflop.runtime.verify_all.verify_analysis` runs all the checks of one analysis (both
still importable from here). Errors are normwise relative per tensor, ``‖a − b‖ / max(‖b‖, floor)``, with
an absolute floor for gradients that are zero in exact arithmetic (:func:`gradient_floor`).
:func:`forward_gradient_samples` decides how many directions the forward-gradient unbiasedness
check (:func:`graphflop.runtime.verify_fg.verify_forward_gradient`, batched over directions)
may afford.

The reference and graphflop's graphs see the same random numbers: both run from the same
generator seed, and the reference's training-mode dropout is PyTorch's ``native_dropout``
decomposition, the form graphflop traces (:func:`reference_mode`). The reference runs with
PyTorch's math attention kernel and without ``nn.MultiheadAttention``'s fast path (the fused
kernels have no forward-mode derivative on CPU). Attention called with dropout is the exception:
its kernel draws the mask in its own way, so the gradient and JVP comparisons of such a model
are not run (:func:`graphflop.runtime.verify_attention.attention_dropout`). Non-floating inputs
keep the values of the model's example where it gives real ones (a mask, token ids); otherwise
integer inputs are drawn over their real index range (the rows of the embedding tables they
index, padding rows included). A NaN or infinity in a compared value fails its check, unless
graphflop's value and the reference's are NaN or infinite at the same elements
(:func:`same_nonfinite`): the check is then not comparable (``Check.comparable``), and has not
passed either.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Interpreter, Node

from graphflop.frontend.loss import differentiable, loss_output, loss_value
from graphflop.meta import (
    CONSTANTS,
    LEAF,
    LOSS_KIND,
    NO_GRAD,
    SIGNATURE,
    SOURCE,
    VJP,
    Signature,
)
from graphflop.ops import MissingRuleError, lookup
from graphflop.runtime.attention import math_attention

#: the forward-gradient check's default number of steps, the FLOPs they may spend together
#: (about half a minute on two CPU cores) and the fewest steps worth a statistical check
VERIFY_SAMPLES = 100
VERIFY_FLOPS = 2e12
MIN_VERIFY_SAMPLES = 16
#: the most directions one may ask for, and the most FLOPs they may spend together (10 times
#: the default's budget, about five minutes on two CPU cores): past either the check would run
#: for hours, and a chi-squared test over 10,000 directions already detects a bias of 7%
MAX_VERIFY_SAMPLES = 10_000
MAX_VERIFY_FLOPS = 10 * VERIFY_FLOPS


def forward_gradient_samples(requested: int | None, step_flops: float) -> tuple[int, str]:
    """Directions for the forward-gradient unbiasedness check, and why the default was cut.

    Args:
        requested: the number asked for (``--verify-samples``); it always wins. None: the
            default, :data:`VERIFY_SAMPLES` directions, or as many as fit in :data:`VERIFY_FLOPS`,
            or none when fewer than :data:`MIN_VERIFY_SAMPLES` fit.
        step_flops: FLOPs of one forward-gradient step (0: unknown, the default applies).

    Returns:
        ``(directions, note)``: ``note`` is empty unless the default was cut down or skipped,
        when it says why in one line (0: skip the check).

    Raises:
        ValueError: ``requested`` is negative or over :data:`MAX_VERIFY_SAMPLES`, or its steps
            would spend more than :data:`MAX_VERIFY_FLOPS`; the message says what fits.
    """
    if requested is not None:
        if not 0 <= requested <= MAX_VERIFY_SAMPLES:
            raise ValueError(
                f"bad --verify-samples {requested}: give 0 (skip the check) to "
                f"{MAX_VERIFY_SAMPLES:,}"
            )
        if requested * step_flops > MAX_VERIFY_FLOPS:
            fit = int(MAX_VERIFY_FLOPS // step_flops)
            raise ValueError(
                f"--verify-samples {requested} would run {requested:,} forward-gradient steps "
                f"of {step_flops / 1e9:,.1f} GFLOPs each, more than the {MAX_VERIFY_FLOPS:.0e} "
                f"FLOPs a check may spend (hours on a CPU): give at most {fit:,}"
                + (" (or 0 to skip the check)" if fit < MIN_VERIFY_SAMPLES else "")
            )
        return requested, ""
    fit = int(VERIFY_FLOPS // step_flops) if step_flops else VERIFY_SAMPLES
    if fit >= VERIFY_SAMPLES:
        return VERIFY_SAMPLES, ""
    if fit >= MIN_VERIFY_SAMPLES:
        return fit, (
            f"forward-gradient check over {fit} directions, not {VERIFY_SAMPLES}: one "
            f"direction costs a step of {step_flops / 1e9:,.1f} GFLOPs (--verify-samples M sets the number)"
        )
    return 0, (
        f"forward-gradient check skipped: one direction costs a step of "
        f"{step_flops / 1e9:,.1f} GFLOPs, too many to repeat {MIN_VERIFY_SAMPLES}+ times (--verify-samples M runs it anyway)"
    )


@dataclass(frozen=True)
class Check:
    """Result of one comparison: the worst relative error and where it occurred.

    Attributes:
        name: what was compared with what.
        worst_rel_error: the largest error (dimensionless; NaN when the check could not run).
        where: the tensor it occurred at, or why the check could not run.
        tolerance: the largest error that passes.
        measure: what ``worst_rel_error`` measures, in words.
        dtype: the dtype the compared graphs ran in.
        tolerance_note: why ``tolerance`` is what it is, where a rule set it (the lowest
            precision the graph computes in, :func:`dtype_tolerance`); "" otherwise. In the
            line, not in the JSON.
        detail: the traceback of the error that stopped the check ("" when none), for
            ``--debug``; not in the JSON.
        comparable: False when graphflop's value and the reference's are NaN or infinite at
            the same elements (:func:`same_nonfinite`: the model's own derivative is not
            finite there), so no error measures them; the check ran and has not passed
            (``worst_rel_error`` is NaN, ``where`` says where and what the finite part gave).
    """

    name: str
    worst_rel_error: float
    where: str
    tolerance: float
    measure: str = "normwise relative error"
    dtype: str = ""
    detail: str = field(default="", compare=False, repr=False)
    comparable: bool = True
    tolerance_note: str = field(default="", compare=False)

    @property
    def ok(self) -> bool:
        return bool(self.comparable and self.worst_rel_error <= self.tolerance)

    @property
    def ran(self) -> bool:
        return not self.comparable or not math.isnan(self.worst_rel_error)

    def line(self) -> str:
        """One line saying in words what was checked and whether it passed."""
        if not self.comparable:
            return f"{self.name}: NOT COMPARABLE ({self.where})"
        if not self.ran:
            return f"{self.name}: NOT RUN ({self.where})"
        verdict = "passed" if self.ok else "FAILED"
        name = f"{self.name} in {self.dtype}" if self.dtype else self.name
        note = f": {self.tolerance_note}" if self.tolerance_note else ""
        return (
            f"{name}: {verdict}: {self.measure} {self.worst_rel_error:.1e} "
            f"(tolerance {self.tolerance:.1e}{note}; {self.where})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``inspect --json``'s ``verify`` entries)."""
        return {
            "check": self.name,
            # JSON has no infinity: a NaN/inf comparison (FAILED, ``where`` says so) is null
            "worst_rel_error": self.worst_rel_error
            if math.isfinite(self.worst_rel_error)
            else None,
            "where": self.where,
            "tolerance": self.tolerance,
            "ok": self.ok,
            "ran": self.ran,
            "comparable": self.comparable,
            "measure": self.measure,
            "dtype": self.dtype,
        }


class _Recorder(Interpreter):
    """Runs a graph, keeping the values of the nodes named in ``keep`` (every node: None)."""

    def __init__(self, gm, keep=None):
        super().__init__(gm)
        self.keep = keep
        self.values: dict[str, Any] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if self.keep is None or n.name in self.keep:
            self.values[n.name] = out
        return out


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached in float64, or complex128 where it is complex (``Tensor.double()`` would
    drop the imaginary part, and with it a difference there: a complex gradient that is off by
    a conjugate agrees with its reference in the real part)."""
    t = t.detach()
    return t.to(torch.complex128) if t.is_complex() else t.double()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / max(‖b‖, 1e-30)`` in float64 (any matching shapes; dimensionless; complex
    values compared whole)."""
    a, b = wide(a), wide(b)
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def nonfinite(got: torch.Tensor, ref: torch.Tensor) -> str:
    """Which of two compared values holds a NaN or an infinity, in words ("" when neither):
    such a value fails its check whatever the other holds (NaN compares false with every
    tolerance, so it must never reach the error measure)."""
    bad = [
        who for who, t in (("graphflop's", got), ("the reference's", ref)) if not t.isfinite().all()
    ]
    return f"NaN or inf in {' and '.join(bad)} value" if bad else ""


def same_nonfinite(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether ``got`` and ``ref`` (same shape) are NaN at the same elements and infinite, with
    the same signs, at the same elements, and at least one element is either: then the model's
    derivative itself is not finite there (``torch.where`` that selects away a branch that is
    NaN or infinite still multiplies that branch's derivative by 0 in reverse mode, and
    0 · NaN = NaN), graphflop and PyTorch agree on it, and only the finite elements can be
    compared."""
    if got.shape != ref.shape:
        return False
    nan_g, nan_r = got.isnan(), ref.isnan()
    inf_g, inf_r = got.isinf(), ref.isinf()
    return (
        bool((nan_g | inf_g).any())
        and torch.equal(nan_g, nan_r)
        and torch.equal(inf_g, inf_r)
        and torch.equal(got[inf_g].sign(), ref[inf_r].sign())
    )


#: why a check over values NaN or infinite in the same places in both compares nothing there
SAME_NONFINITE = (
    "graphflop's and the reference's {what} are NaN or inf at the same "
    "{count} elements{where} (the model's own derivative is not finite there, e.g. a torch.where "
    "over a NaN or inf branch it does not take)"
)


#: an absolute error below FLOOR_ULPS · eps · ‖∇L‖ always passes (rounding of a sum of up to
#: about 10⁶ terms is √N·eps relative to their scale; a gradient that is zero in exact
#: arithmetic — a Linear bias before BatchNorm — is such rounding noise)
FLOOR_ULPS = 1024


def floor_unit(dtype: torch.dtype, low: torch.dtype | None = None) -> float:
    """The absolute floor's unit, relative to the scale it multiplies: ``FLOOR_ULPS · eps`` of
    ``dtype`` (the dtype the graphs ran in), or the machine epsilon of ``low`` (the lowest
    precision the graph computes in, :func:`lowest_precision`) where that is larger: a value
    rounded to bfloat16 carries up to 2⁻⁸ of its scale, more than float32's sums of 10⁶ terms
    (1024 · 2⁻²³ = 1.2e-4)."""
    unit = FLOOR_ULPS * torch.finfo(dtype).eps
    return max(unit, torch.finfo(low).eps) if low is not None and low.is_floating_point else unit


def floor_words(dtype: torch.dtype, low: torch.dtype | None = None) -> str:
    """:func:`floor_unit` in words, for a check's ``measure``."""
    if floor_unit(dtype, low) > FLOOR_ULPS * torch.finfo(dtype).eps:
        return f"{_dtype_name(cast(torch.dtype, low))}'s eps"
    return f"{FLOOR_ULPS}·eps"


def gradient_floor(
    dtype: torch.dtype, grad_norm: float, tolerance: float, low: torch.dtype | None = None
) -> float:
    """The denominator floor of the normwise relative error: ``FLOOR_ULPS · eps · ‖∇L‖ /
    tolerance``, so that ``‖a − b‖ ≤ max(tolerance · ‖b‖, FLOOR_ULPS · eps · ‖∇L‖)`` passes
    (``FLOOR_ULPS · eps`` is :func:`floor_unit`: the eps of ``low`` where larger).

    Args:
        dtype: the dtype the graphs ran in (its machine epsilon ``eps``).
        grad_norm: the gradient's scale: ``‖∇L‖``, the norm of the whole reference gradient,
            or ``|L|/‖p‖`` where that is larger (:func:`verify_gradients`).
        tolerance: the check's tolerance.
        low: the lowest precision the graph computes in (:func:`lowest_precision`), or None.
    """
    return floor_unit(dtype, low) * grad_norm / tolerance


def lowest_precision(forward: GraphModule) -> torch.dtype | None:
    """The floating dtype of lowest precision (largest machine epsilon) among the values on
    ``forward``'s differentiated path: each ``call_function`` node's ``val`` (every tensor of a
    multi-output op's) where the node depends on a parameter or an input through ops with a
    derivative (not through ``detach``, another op whose derivative is zero, or a node made with
    grad mode off) and the loss or an output depends on it. None where none is floating. A
    region under the model's own ``torch.autocast(dtype=torch.bfloat16)`` makes it bfloat16
    whatever dtype verify runs in; a detached side computation in a lower precision (an amax
    cast to float8 for scaling) does not, since no gradient or tangent goes through it."""
    sig: Signature | None = forward.meta.get(SIGNATURE)
    nodes = list(forward.graph.nodes)
    if sig is not None:
        sources = {p for p, _ in sig.params} | set(sig.inputs)
        ends = {sig.loss, *sig.outputs} if sig.loss else set(sig.outputs)
    else:  # a graph not from graphflop's trace: every placeholder, every output
        sources = {n.name for n in nodes if n.op == "placeholder"}
        ends = set()
    active: set[Node] = set()
    for n in nodes:
        if n.op == "placeholder":
            if n.name in sources:
                active.add(n)
        elif (
            n.op == "call_function"
            and not n.meta.get(NO_GRAD)
            and not _zero_derivative(n.target)
            and any(a in active for a in n.all_input_nodes)
        ):
            active.add(n)
    outs = [n for n in nodes if n.name in ends] or [
        a for n in nodes if n.op == "output" for a in n.all_input_nodes
    ]
    low: torch.dtype | None = None
    seen: set[Node] = set()
    stack = [n for n in outs if n in active]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if a in active)
        if n.op != "call_function":
            continue
        for v in torch.utils._pytree.tree_leaves(n.meta.get("val")):
            if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
                continue
            if low is None or torch.finfo(v.dtype).eps > torch.finfo(low).eps:
                low = v.dtype
    return low


def _zero_derivative(op: Any) -> bool:
    """Whether ``op``'s rule says its derivative is zero (``detach``, rounding, sign)."""
    try:
        return lookup(op, need=()).zero_derivative
    except MissingRuleError:
        return False


def dtype_tolerance(forward: GraphModule, tolerance: float) -> tuple[float, str]:
    """The tolerance of the gradient and JVP checks of ``forward``: ``tolerance``, or the machine
    epsilon of the lowest precision it computes in (:func:`lowest_precision`; two units of
    roundoff, one rounding in each of graphflop's and the reference's computation, where they
    round a value at different points) where that is larger: bfloat16's 2⁻⁷ = 7.8e-3,
    float16's 2⁻¹⁰ = 9.8e-4; float32's 1.2e-7 and float64's never exceed the default 1e-4.
    Returns ``(tolerance, note)``, the note naming the dtype where it set the tolerance
    (``Check.tolerance_note``), else ""."""
    low = lowest_precision(forward)
    eps = torch.finfo(low).eps if low is not None else 0.0
    if eps <= tolerance:
        return tolerance, ""
    return eps, f"the eps of {_dtype_name(cast(torch.dtype, low))}, which the graph computes in"


def padding_idx(embedding: torch.fx.Node) -> int:
    """The ``padding_idx`` of an ``aten.embedding`` node (-1: none)."""
    n = embedding
    idx = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx", -1)
    assert isinstance(idx, (int, torch.SymInt)), n.format_node()  # the schema: SymInt padding_idx
    return int(idx)


def index_ranges(forward: GraphModule) -> dict[str, tuple[int, list[int]]]:
    """Integer input placeholder → (exclusive upper bound, padding rows) for inputs that index
    embedding tables (directly or through views): the smallest table's row count, and the
    tables' ``padding_idx`` values."""
    views = {
        torch.ops.aten.view.default,
        torch.ops.aten._unsafe_view.default,
        torch.ops.aten.reshape.default,
        torch.ops.aten.expand.default,
        torch.ops.aten.clone.default,
        torch.ops.aten.permute.default,
        torch.ops.aten.unsqueeze.default,
        torch.ops.aten.squeeze.dims,
        torch.ops.aten.slice.Tensor,
        torch.ops.aten.select.int,
    }
    out: dict[str, tuple[int, list[int]]] = {}
    for n in forward.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.embedding.default:
            continue
        src = n.args[1]
        while isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target in views:
            src = src.args[0]
        if not isinstance(src, torch.fx.Node) or src.op != "placeholder":
            continue
        rows = int(n.args[0].meta["val"].shape[0])
        pad = padding_idx(n)
        high, pads = out.get(src.name, (rows, []))
        out[src.name] = (min(high, rows), pads + ([pad] if pad >= 0 else []))
    return out


def real_arguments(
    forward: GraphModule,
    model: nn.Module,
    *,
    seed: int = 0,
    examples: tuple[torch.Tensor, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """Real tensors for every placeholder of a traced forward graph: the model's parameters and
    buffers (in the graph's dtypes), random inputs, and random valid targets.

    A non-floating input (a bool mask, token ids) keeps the value the model's example gives
    (``examples``, in the order of ``forward.meta[SIGNATURE].inputs``) when that example is a
    real tensor (not meta, not fake) of the placeholder's shape and dtype: random values could
    mean something the model never sees (a key padding mask hiding a whole row, which makes
    attention NaN). Otherwise integer inputs that index embedding tables are drawn over the
    tables' rows (:func:`index_ranges`), with each ``padding_idx`` written at the first
    positions so that padding is exercised; other integer inputs from {0, 1}. Floating inputs
    are always drawn from N(0, 1)."""
    sig: Signature = forward.meta[SIGNATURE]
    gen = torch.Generator().manual_seed(seed)
    values: dict[str, torch.Tensor] = {}
    phs = {n.name: n for n in forward.graph.nodes if n.op == "placeholder"}
    for name, qual in sig.params:
        values[name] = model.get_parameter(qual).detach().clone().to(phs[name].meta["val"].dtype)
    constants = forward.meta.get(CONSTANTS, {})
    for name, qual in sig.buffers:
        # a tensor made in forward (torch.tensor(...)) is a constant of the graph
        value = constants[name] if name in constants else model.get_buffer(qual)
        values[name] = value.detach().clone().to(phs[name].meta["val"].dtype)
    nodes = {n.name: n for n in forward.graph.nodes}
    # the output the loss is computed from (the first floating one), as the loss itself: a
    # model may return a 0-d count first, then its logits
    out_val = loss_output([nodes[o].meta.get("val") for o in sig.outputs])
    ranges = index_ranges(forward)
    given = _example_values(sig, phs, examples)
    for name in sig.inputs + sig.targets:
        v = phs[name].meta["val"]
        if v.is_floating_point():
            values[name] = torch.randn(tuple(v.shape), generator=gen, dtype=v.dtype)
            continue
        if name in given:
            values[name] = given[name]
            continue
        high, pads = ranges.get(name, (2, []))
        if name in sig.targets and out_val is not None:
            # the class dim: last of (N, C) and of token logits (B, T, V), else dim 1
            high = out_val.shape[-1] if out_val.dim() <= 3 else out_val.shape[1]
        x = torch.randint(0, high, tuple(v.shape), generator=gen, dtype=v.dtype)
        flat = x.view(-1)
        for i, pad in enumerate(p for p in pads if p < high):
            if i < flat.numel():
                flat[i] = pad
        values[name] = x
    return values


def _example_values(sig: Signature, phs: dict, examples) -> dict[str, torch.Tensor]:
    """The example's non-floating inputs that hold real values, by placeholder name (those
    whose shape and dtype are the placeholder's: ``--batch`` or ``--input-shape`` may have
    changed the shape, and then the example's values do not fit)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not examples or len(examples) != len(sig.inputs):
        return {}
    out = {}
    for name, t in zip(sig.inputs, examples):
        v = phs[name].meta["val"]
        real = isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and not t.is_meta
        if real and not t.is_floating_point() and t.shape == v.shape and t.dtype == v.dtype:
            out[name] = t.detach().clone()
    return out


def run_forward(forward: GraphModule, values: dict[str, torch.Tensor], keep=None) -> dict[str, Any]:
    """Run the forward graph; returns the values by node name of every node, or of the nodes
    named in ``keep`` (``backward_reads(backward)``: what a backward graph needs, so that a
    large model's activations are freed as the run goes)."""
    order = [n.name for n in forward.graph.nodes if n.op == "placeholder"]
    rec = _Recorder(forward, keep)
    rec.run(*[values[n] for n in order])
    return rec.values


def backward_reads(backward: GraphModule) -> set[str]:
    """Names of the forward nodes :func:`run_backward` reads: the residuals and the loss."""
    names = {n.meta.get(SOURCE, n.name) for n in backward.graph.nodes if n.op == "placeholder"}
    return names | {backward.meta[SIGNATURE].loss}


def run_backward(backward: GraphModule, fwd_values: dict[str, Any], ct: float = 1.0) -> tuple:
    """Run the backward graph on the forward's recorded values with loss cotangent ``ct``
    (default 1: the gradients)."""
    info = backward.meta[VJP]
    args = []
    for n in backward.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name == info.cotangent_input:
            v = fwd_values[backward.meta[SIGNATURE].loss]
            args.append(torch.full_like(v, ct))
        else:
            args.append(fwd_values[n.meta.get(SOURCE, n.name)])
    return backward(*args)


#: the generator seed graphflop's graphs and the reference both run from (same dropout masks)
RNG_SEED = 1234

_F_DROPOUT = F.dropout


def _native_dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout`` whose training mode is PyTorch's decomposition of ``native_dropout``, the
    form graphflop traces (PyTorch's CPU kernel draws its mask with ``bernoulli_`` instead, a
    different use of the generator)."""
    if training and 0 < p < 1:
        from torch._decomp import decomposition_table

        out = decomposition_table[torch.ops.aten.native_dropout.default](input, p, True)[0]
        return input.copy_(out) if inplace else out  # nn.Dropout(inplace=True): the same mask
    return _F_DROPOUT(input, p, training, inplace)


_BERNOULLI = torch.bernoulli
_TENSOR_BERNOULLI = torch.Tensor.bernoulli


def _decomposed_bernoulli(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.bernoulli(p)`` as PyTorch's decomposition of ``aten.bernoulli``, the form
    graphflop traces (one uniform draw per element compared with ``p``; the CPU kernel uses the
    generator otherwise, so a draw after it differed); any other form as it is."""
    if args or kwargs.get("generator") is not None or set(kwargs) - {"generator"}:
        return _BERNOULLI(input, *args, **kwargs)
    from torch._decomp import decomposition_table

    return decomposition_table[torch.ops.aten.bernoulli.default](input)


@contextlib.contextmanager
def seeded(seed: int = RNG_SEED) -> Iterator[None]:
    """Run the block from generator state ``seed`` (CPU), restoring the generator after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def reference_mode(seed: int = RNG_SEED) -> Iterator[None]:
    """How the eager reference runs: from generator state ``seed``, training-mode dropout as
    :func:`_native_dropout` (``torch.nn.functional.dropout`` pointed at it while the block
    runs: ``nn.Dropout`` and multi-head attention call it by that name), ``torch.bernoulli``
    as :func:`_decomposed_bernoulli`, attention in
    PyTorch's math kernel and ``nn.MultiheadAttention``/``TransformerEncoder`` without their
    fast path (the fused CPU kernels have no forward-mode derivative)."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    F.dropout = _native_dropout
    torch.bernoulli = _decomposed_bernoulli
    torch.Tensor.bernoulli = _decomposed_bernoulli  # type: ignore[method-assign,assignment]
    try:
        with seeded(seed), math_attention():
            yield
    finally:
        F.dropout = _F_DROPOUT
        torch.bernoulli = _BERNOULLI
        torch.Tensor.bernoulli = _TENSOR_BERNOULLI  # type: ignore[method-assign]
        torch.backends.mha.set_fastpath_enabled(fast)


def reference_loss_fn(forward: GraphModule, model: nn.Module, values: dict[str, torch.Tensor]):
    """``f(params) -> loss`` for torch.func, using the model itself (not graphflop's graphs),
    in :func:`reference_mode` (the same random numbers as graphflop's graphs run
    :func:`seeded`)."""
    sig: Signature = forward.meta[SIGNATURE]
    loss_kind = forward.meta.get(LOSS_KIND, "sum")
    seed = RNG_SEED
    buffers = {q: values[n].clone() for n, q in sig.buffers}
    # parameters torch.func cannot differentiate (a frozen int8 weight) go in as constants
    buffers.update((q, values[n]) for n, q in sig.params if not differentiable(values[n]))
    inputs = [values[n] for n in sig.inputs]
    targets = [values[n] for n in sig.targets]

    def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
        with reference_mode(seed):
            out = torch.func.functional_call(
                model, {**params, **{k: v.clone() for k, v in buffers.items()}}, tuple(inputs)
            )
        first = loss_output(out)
        return loss_value(
            loss_kind if loss_kind in ("cross_entropy", "mse") else "sum", first, targets
        )

    return f


def verify_gradients(
    forward: GraphModule,
    backward: GraphModule,
    model: nn.Module,
    *,
    tolerance: float = 1e-4,
    seed: int = 0,
    examples: tuple[torch.Tensor, ...] | None = None,
) -> Check:
    """Compare every parameter gradient of ``backward`` with ``torch.func.grad`` of the same
    loss on the same random inputs (and dropout masks), in the dtype the graphs were traced in;
    ``examples``: the model's example inputs (:func:`real_arguments`).

    The error per parameter is ``‖a − b‖ / max(‖b‖, gradient_floor(dtype, s, tolerance, low))``
    with ``s = max(‖∇L‖, Σ|ℓ|/‖p‖)`` (normwise relative, with an absolute floor for gradients
    that are zero in exact arithmetic; ``Σ|ℓ|/‖p‖``, the gradient a relative change of the
    parameters would give a loss of size ``Σ|ℓ|``, the magnitudes of the terms the loss adds
    up (:func:`loss_magnitude`, at least ``|L|``), for a loss whose whole gradient is rounding
    noise, as instance norm without affine followed by a spatial mean gives, or the sum of a
    layer norm's output without affine, 0 for every input); the worst one is reported. A NaN or infinity in either gradient is an
    infinite error (the check fails, :func:`nonfinite`), unless both gradients have them at the
    same elements (:func:`same_nonfinite`): the finite elements are compared, and when they
    agree the check is not comparable.
    """
    values = real_arguments(forward, model, seed=seed, examples=examples)
    with seeded():
        fwd_values = run_forward(
            forward, values, backward_reads(backward) | {loss_terms_name(forward)}
        )
    grads = run_backward(backward, fwd_values)
    sig: Signature = forward.meta[SIGNATURE]
    params = differentiable_params(sig, values)
    cast_to = floating_dtype(params)
    dtype = cast_to or torch.float64
    model = _cast(model, cast_to)
    ref, loss, what = reference_gradients(reference_loss_fn(forward, model, values), params, model)
    # the scale of the finite elements (those NaN or inf in both are compared apart)
    total = norm64(t[t.isfinite()] for t in ref.values())
    magnitude = max(abs(float(loss)), loss_magnitude(forward, fwd_values))
    scale = max(total, loss_scale(magnitude, params.values()))
    low = lowest_precision(forward)
    floor = max(gradient_floor(dtype, scale, tolerance, low), 1e-300) if math.isfinite(scale) else 0
    worst, where = 0.0, "no parameters"
    shared: dict[str, int] = {}  # parameter → elements NaN or inf in both gradients alike
    compared = 0  # finite elements compared
    pairs = [(qual, grads[pos], ref[qual]) for pos, qual in backward.meta[VJP].grads]
    # the inputs anew: a model that makes its input require grad did it to them above
    fresh = {**values, **{n: values[n].detach() for n in sig.inputs}}
    pairs += _leaf_pairs(
        forward, backward, grads, reference_loss_fn(forward, model, fresh), params, model
    )
    for qual, ours, theirs in pairs:
        a, b = wide(ours), wide(theirs)
        bad = nonfinite(a, b)
        if bad and same_nonfinite(a, b):
            finite = a.isfinite()
            shared[qual] = int((~finite).sum())
            a, b, bad = a[finite], b[finite], ""
        compared += a.numel()
        e = math.inf if bad else float((a - b).norm()) / max(float(b.norm()), floor, 1e-300)
        if e > worst or where == "no parameters":
            worst, where = e, f"{bad} at {qual}" if bad else f"at {qual}"
        if bad:
            break
    name = f"gradients vs {what}"
    measure = f"worst normwise relative error (floor {floor_words(dtype, low)}·max(‖∇L‖, Σ|ℓ|/‖p‖))"
    if shared and worst <= tolerance:  # a finite element that differs still fails the check
        at = ", ".join(shared)
        why = SAME_NONFINITE.format(
            what="gradients", count=f"{sum(shared.values()):,}", where=f" of {at}"
        )
        if compared:
            why += f"; the {compared:,} finite elements agree to {worst:.1e} ({where})"
        return Check(name, math.nan, why, tolerance, measure, _dtype_name(dtype), comparable=False)
    return Check(name, worst, where, tolerance, measure, _dtype_name(dtype))


#: the first words of PyTorch's refusals to run a model under ``torch.func``'s transforms that
#: eager autograd runs: a custom Function without ``setup_context``, and saved-tensor hooks
#: (``torch.utils.checkpoint(use_reentrant=False)``)
FUNCTORCH_REFUSALS = (
    "In order to use an autograd.Function with functorch transforms",
    "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks",
    # torch.inference_mode() inside the model: torch.func's wrappers meet an inference tensor
    "Cannot set version_counter for inference tensor",
    # x.requires_grad_() in the model's forward (which graphflop's trace ignores)
    "You are attempting to call Tensor.requires_grad_()",
)


def functorch_refused(e: BaseException) -> bool:
    """Whether ``e`` is ``torch.func`` refusing a model eager autograd can run
    (:data:`FUNCTORCH_REFUSALS`)."""
    return isinstance(e, RuntimeError) and any(r in str(e) for r in FUNCTORCH_REFUSALS)


def reference_gradients(
    f, params: dict[str, torch.Tensor], model: nn.Module | None = None
) -> tuple[dict, torch.Tensor, str]:
    """``(∇f(params), f(params), what)`` for a scalar ``f`` of a dict of parameters: by
    ``torch.func.grad_and_value``, or, where ``torch.func`` refuses the model
    (:func:`functorch_refused`), by eager autograd (:func:`eager_gradients`). ``what`` names
    the one used."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ref, loss = torch.func.grad_and_value(f)(params)
        except RuntimeError as e:
            if not functorch_refused(e):
                raise
        else:
            for w in caught:  # the warnings of a run that counts, not of a refused one
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            return ref, loss, "torch.func.grad"
    grads, loss = eager_gradients(f, [params], model)
    return grads[0], loss, "torch.autograd.backward"


def eager_gradients(f, args: list, model: nn.Module | None = None) -> tuple[list, torch.Tensor]:
    """``(gradients, f(*args))`` by eager autograd, as a training step runs it:
    ``loss.backward()`` on detached leaves (the reentrant checkpoint refuses
    ``torch.autograd.grad``). ``args``: dicts of tensors or tuples of tensors; the gradients
    come back in the same structure, zeros where the loss does not reach a tensor (as
    ``torch.func`` gives). With ``model``, the first dict holds its parameters by qualified
    name and they stay in the model through the backward too: the reentrant checkpoint
    reruns the forward there, reading the module's parameters."""
    leaves = [
        {k: v.detach().requires_grad_(True) for k, v in a.items()}
        if isinstance(a, dict)
        else tuple(v.detach().requires_grad_(True) for v in a)
        for a in args
    ]
    from torch.nn.utils.stateless import _reparametrize_module

    held = (
        _reparametrize_module(model, leaves[0], tie_weights=True)
        if model is not None and isinstance(leaves[0], dict)
        else contextlib.nullcontext()
    )
    with torch.enable_grad(), held:
        loss = f(*leaves)
        # as the forward ran (dropout's form, math attention): a checkpoint reruns it here
        with reference_mode():
            loss.backward()

    def grad(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(v) if v.grad is None else v.grad

    grads = [
        {k: grad(v) for k, v in a.items()} if isinstance(a, dict) else tuple(grad(v) for v in a)
        for a in leaves
    ]
    return grads, loss.detach()


def eager_leaf_gradients(f, params: dict[str, torch.Tensor], model: nn.Module) -> list:
    """The ``.grad`` eager autograd gives each value the model's code makes a new leaf
    (``requires_grad_()`` on a tensor that does not require grad) while ``f(params)`` runs
    its forward (:func:`eager_gradients`), in the order of the calls (the numbers
    :data:`~graphflop.meta.LEAF` gives their nodes); None for a leaf the loss does not
    reach."""
    made: list[torch.Tensor] = []
    original = torch.Tensor.requires_grad_

    def requires_grad_(self: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
        new = requires_grad and not self.requires_grad
        out = original(self, requires_grad)
        if new:
            made.append(self)
        return out

    def forward_noted(p: dict[str, torch.Tensor]) -> torch.Tensor:
        torch.Tensor.requires_grad_ = requires_grad_  # type: ignore[method-assign,assignment]
        try:
            return f(p)
        finally:
            torch.Tensor.requires_grad_ = original  # type: ignore[method-assign]

    eager_gradients(forward_noted, [params], model)
    return [t.grad for t in made]


def _leaf_pairs(
    forward: GraphModule, backward: GraphModule, grads: tuple, f, params: dict, model: nn.Module
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, graphflop's, eager's) gradient of each leaf the model's code made that the
    backward returns (:attr:`~graphflop.meta.VjpInfo.leaf_grads`), eager's by
    :func:`eager_leaf_gradients` (zeros where the loss does not reach it)."""
    leaf_grads = backward.meta[VJP].leaf_grads
    if not leaf_grads:
        return []
    number = {n.name: n.meta[LEAF] for n in forward.graph.nodes if LEAF in n.meta}
    # only the trainable parameters require grad, as in training (a value computed from a
    # frozen one alone is the new leaf the trace saw)
    trainable = {q for _, q in forward.meta[SIGNATURE].trainable()}
    frozen = {q: v.detach() for q, v in params.items() if q not in trainable}
    eager = eager_leaf_gradients(
        lambda p: f({**frozen, **p}),
        {q: v for q, v in params.items() if q in trainable},
        model,
    )
    out = []
    for pos, name in leaf_grads:
        k = number[name]
        ref = eager[k] if k < len(eager) else None
        theirs = torch.zeros_like(grads[pos]) if ref is None else ref
        if k >= len(eager):  # eager made fewer leaves: no value to compare with
            theirs = torch.full_like(grads[pos], math.nan)
        out.append((f"the leaf {name}", grads[pos], theirs))
    return out


def norm64(tensors: Any) -> float:
    """The 2-norm of all the elements of ``tensors`` together (complex ones by modulus), in
    float64."""
    return math.sqrt(sum(float(wide(t).abs().pow(2).sum()) for t in tensors))


def loss_scale(loss: float, params: Any) -> float:
    """``|L| / ‖p‖`` over ``params`` (float64): the size of a gradient a relative change of the
    parameters gives a loss of size ``|L|``; 0 without parameters or a finite loss. Give it
    :func:`loss_magnitude` for ``L``: the scale of a loss whose terms cancel."""
    norm = norm64(params)
    return abs(loss) / norm if norm > 0 and math.isfinite(loss) else 0.0


_aten = torch.ops.aten
#: ops the loss's terms reach it through: sums add them, means add them scaled by the count
_LOSS_SUMS = frozenset({_aten.sum.default, _aten.sum.dim_IntList})
_LOSS_MEANS = frozenset({_aten.mean.default, _aten.mean.dim})
#: views and copies of one tensor: the same terms
_LOSS_VIEWS = frozenset(
    {
        _aten.view.default,
        _aten.reshape.default,
        _aten._unsafe_view.default,
        _aten.squeeze.default,
        _aten.squeeze.dim,
        _aten.squeeze.dims,
        _aten.unsqueeze.default,
        _aten.alias.default,
        _aten.clone.default,
        _aten.view_as_real.default,
    }
)
#: products and quotients by a number: the terms scaled by it
_LOSS_SCALES = frozenset({_aten.mul.Tensor, _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar})


def loss_terms_name(forward: GraphModule) -> str:
    """The name of the forward node :func:`loss_magnitude` reads (keep it when running the
    forward)."""
    return loss_terms(forward)[0]


def loss_terms(forward: GraphModule) -> tuple[str, float]:
    """The forward node whose elements the loss adds up, and the factor each enters it with:
    from the loss node back through sums, means (``1/count``), views and products by a number
    (``sum(mean(y) · 2)``: ``y``, ``2/numel(y)``). The loss node itself, factor 1, where it is
    none of those (a cross-entropy)."""
    node = next(n for n in forward.graph.nodes if n.name == forward.meta[SIGNATURE].loss)
    factor = 1.0
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        src = node.args[0]
        if node.target in _LOSS_SUMS or node.target in _LOSS_VIEWS:
            pass
        elif node.target in _LOSS_MEANS:
            n_in, n_out = (_numel(x) for x in (src, node))
            if n_in is None or n_out is None or n_in == 0:
                break
            factor *= n_out / n_in
        elif node.target in _LOSS_SCALES and isinstance(node.args[1], (int, float)):
            c = abs(float(node.args[1]))
            if c == 0 or not math.isfinite(c):
                break
            factor *= c if node.target in (_aten.mul.Tensor, _aten.mul.Scalar) else 1 / c
        else:
            break
        node = src
    return node.name, factor


def _numel(node: torch.fx.Node) -> int | None:
    v = node.meta.get("val")
    try:
        return int(v.numel()) if isinstance(v, torch.Tensor) else None
    except (TypeError, RuntimeError):  # a data-dependent size
        return None


def loss_magnitude(forward: GraphModule, fwd_values: dict[str, Any]) -> float:
    """``max(|L|, Σ|ℓᵢ|)``, the loss and the sum of the magnitudes of the terms it adds up
    (:func:`loss_terms`, read from ``fwd_values``: run the forward keeping that node). A loss
    whose terms cancel (the sum of a layer norm's output without affine: 0 for every input)
    is rounding noise of a few ``eps · Σ|ℓᵢ|``, and so are its derivatives at that scale;
    ``|L|`` alone would say there is no scale at all. NaN or infinite terms are left out."""
    loss = float(wide(fwd_values[forward.meta[SIGNATURE].loss]).abs().sum())
    loss = loss if math.isfinite(loss) else 0.0
    name, factor = loss_terms(forward)
    terms = fwd_values.get(name)
    if not isinstance(terms, torch.Tensor) or not (terms.is_floating_point() or terms.is_complex()):
        return loss
    mag = wide(terms).abs()
    return max(loss, factor * float(mag[mag.isfinite()].sum()))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cast_model(model: nn.Module, dtype: torch.dtype, only: torch.dtype | None = None) -> nn.Module:
    """A copy of ``model`` whose floating parameters and buffers are in ``dtype`` and complex
    ones in its complex counterpart (float64 → complex128, float32 → complex64); integer and
    boolean ones as they are. ``nn.Module.to(dtype)`` casts complex tensors to the real dtype
    (dropping their imaginary parts) and refuses a non-floating ``dtype``. ``only``: cast
    only the floating tensors of that dtype, the others kept (a model mixing dtypes on
    purpose, :func:`main_dtype`)."""
    complex_dtype = {
        torch.float64: torch.complex128,
        torch.float32: torch.complex64,
        torch.float16: torch.complex32,
    }.get(dtype)

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t if only is not None and t.dtype != only else t.to(dtype)
        if t.is_complex() and complex_dtype is not None:
            return t.to(complex_dtype)
        return t

    return copy_model(model)._apply(cast)


def main_dtype(model: nn.Module) -> tuple[torch.dtype | None, bool]:
    """The floating dtype holding most of ``model``'s parameter and buffer elements (None
    without floating ones), and whether another floating dtype holds some (mixed dtypes)."""
    count: dict[torch.dtype, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            count[t.dtype] = count.get(t.dtype, 0) + t.numel()
    main = max(count, key=count.__getitem__, default=None)
    return main, len(count) > 1


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy of ``model``. A tensor attribute computed from the parameters with
    autograd on (the old ``nn.utils.weight_norm``'s ``module.weight``, which its forward
    pre-hook computes again on every call) is copied detached: ``copy.deepcopy`` refuses a
    tensor that is not a graph leaf."""
    import copy

    memo: dict[int, Any] = {}
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, torch.Tensor) and not v.is_leaf and id(v) not in memo:
                memo[id(v)] = v.detach().clone()
    return copy.deepcopy(model, memo)


def differentiable_params(
    sig: Signature, values: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The parameters (by qualified name) torch.func can differentiate: floating and complex
    ones; :func:`reference_loss_fn` gives the others (a frozen int8 weight) as constants."""
    return {q: values[n] for n, q in sig.params if differentiable(values[n])}


def floating_dtype(params: Any, default: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype of the first floating tensor of ``params`` (a dict of tensors), else
    ``default`` (an int8 or complex parameter says nothing about the verify dtype)."""
    return next((p.dtype for p in params.values() if p.is_floating_point()), default)


def _cast(model: nn.Module, dtype):
    return model if dtype is None else cast_model(model, dtype)


#: names that moved to :mod:`graphflop.runtime.verify_tangent` (the JVP check) and
#: :mod:`graphflop.runtime.verify_all` (all the checks of one analysis), kept importable from here
_MOVED = {
    **dict.fromkeys(
        ("run_jvp", "padding_rows", "verify_jvp", "tangent_floor", "tangent_error"),
        "verify_tangent",
    ),
    **dict.fromkeys(("gap_reasons", "gap_notes", "verify_analysis"), "verify_all"),
}


def __getattr__(name: str) -> Any:
    """The :data:`_MOVED` names, from their modules (imported on first use: they import this
    one)."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"graphflop.runtime.{_MOVED[name]}"), name)
