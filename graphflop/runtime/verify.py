"""Run graphflop's generated graphs on real random tensors and compare them with PyTorch.

``verify_gradients`` checks every parameter gradient of the backward graph against
``torch.func.grad`` of the same loss; ``verify_jvp`` checks the JVP graph's loss tangent against
``torch.func.jvp``. Errors are normwise relative per tensor, ``‖a − b‖ / max(‖b‖, floor)``, with
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
index, padding rows included). A NaN or infinity in a compared value fails its check.
"""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Interpreter

from graphflop.frontend.loss import loss_output, loss_value
from graphflop.meta import (
    CONSTANTS,
    JVP,
    LOSS_KIND,
    SIGNATURE,
    SOURCE,
    VJP,
    Signature,
)
from graphflop.runtime.attention import math_attention

#: the forward-gradient check's default number of steps, the FLOPs they may spend together
#: (about half a minute on two CPU cores) and the fewest steps worth a statistical check
VERIFY_SAMPLES = 100
VERIFY_FLOPS = 2e12
MIN_VERIFY_SAMPLES = 16


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
    """
    if requested is not None:
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
        detail: the traceback of the error that stopped the check ("" when none), for
            ``--debug``; not in the JSON.
    """

    name: str
    worst_rel_error: float
    where: str
    tolerance: float
    measure: str = "normwise relative error"
    dtype: str = ""
    detail: str = field(default="", compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return bool(self.worst_rel_error <= self.tolerance)

    @property
    def ran(self) -> bool:
        return not math.isnan(self.worst_rel_error)

    def line(self) -> str:
        """One line saying in words what was checked and whether it passed."""
        if not self.ran:
            return f"{self.name}: NOT RUN ({self.where})"
        verdict = "passed" if self.ok else "FAILED"
        name = f"{self.name} in {self.dtype}" if self.dtype else self.name
        return (
            f"{name}: {verdict}: {self.measure} {self.worst_rel_error:.1e} "
            f"(tolerance {self.tolerance:.1e}; {self.where})"
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


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / max(‖b‖, 1e-30)`` in float64 (any matching shapes; dimensionless)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def nonfinite(got: torch.Tensor, ref: torch.Tensor) -> str:
    """Which of two compared values holds a NaN or an infinity, in words ("" when neither):
    such a value fails its check whatever the other holds (NaN compares false with every
    tolerance, so it must never reach the error measure)."""
    bad = [
        who for who, t in (("graphflop's", got), ("the reference's", ref)) if not t.isfinite().all()
    ]
    return f"NaN or inf in {' and '.join(bad)} value" if bad else ""


#: an absolute error below FLOOR_ULPS · eps · ‖∇L‖ always passes (rounding of a sum of up to
#: about 10⁶ terms is √N·eps relative to their scale; a gradient that is zero in exact
#: arithmetic — a Linear bias before BatchNorm — is such rounding noise)
FLOOR_ULPS = 1024


def gradient_floor(dtype: torch.dtype, grad_norm: float, tolerance: float) -> float:
    """The denominator floor of the normwise relative error: ``FLOOR_ULPS · eps · ‖∇L‖ /
    tolerance``, so that ``‖a − b‖ ≤ max(tolerance · ‖b‖, FLOOR_ULPS · eps · ‖∇L‖)`` passes.

    Args:
        dtype: the dtype the graphs ran in (its machine epsilon ``eps``).
        grad_norm: ``‖∇L‖``, the norm of the whole reference gradient.
        tolerance: the check's tolerance.
    """
    return FLOOR_ULPS * torch.finfo(dtype).eps * grad_norm / tolerance


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
        pad = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx", -1)
        high, pads = out.get(src.name, (rows, []))
        out[src.name] = (min(high, rows), pads + ([int(pad)] if pad >= 0 else []))
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
            high = out_val.shape[-1]
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
    if training and 0 < p < 1 and not inplace:
        from torch._decomp import decomposition_table

        return decomposition_table[torch.ops.aten.native_dropout.default](input, p, True)[0]
    return _F_DROPOUT(input, p, training, inplace)


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
    runs: ``nn.Dropout`` and multi-head attention call it by that name), attention in
    PyTorch's math kernel and ``nn.MultiheadAttention``/``TransformerEncoder`` without their
    fast path (the fused CPU kernels have no forward-mode derivative)."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    F.dropout = _native_dropout
    try:
        with seeded(seed), math_attention():
            yield
    finally:
        F.dropout = _F_DROPOUT
        torch.backends.mha.set_fastpath_enabled(fast)


def reference_loss_fn(forward: GraphModule, model: nn.Module, values: dict[str, torch.Tensor]):
    """``f(params) -> loss`` for torch.func, using the model itself (not graphflop's graphs),
    in :func:`reference_mode` (the same random numbers as graphflop's graphs run
    :func:`seeded`)."""
    sig: Signature = forward.meta[SIGNATURE]
    loss_kind = forward.meta.get(LOSS_KIND, "sum")
    seed = RNG_SEED
    buffers = {q: values[n].clone() for n, q in sig.buffers}
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

    The error per parameter is ``‖a − b‖ / max(‖b‖, gradient_floor(dtype, ‖∇L‖, tolerance))``
    (normwise relative, with an absolute floor for gradients that are zero in exact
    arithmetic); the worst one is reported. A NaN or infinity in either gradient is an
    infinite error (the check fails, :func:`nonfinite`).
    """
    values = real_arguments(forward, model, seed=seed, examples=examples)
    with seeded():
        fwd_values = run_forward(forward, values, backward_reads(backward))
    grads = run_backward(backward, fwd_values)
    sig: Signature = forward.meta[SIGNATURE]
    params = {q: values[n] for n, q in sig.params}
    dtype = next(iter(params.values())).dtype if params else torch.float64
    model = _cast(model, dtype if params else None)
    ref = torch.func.grad(reference_loss_fn(forward, model, values))(params)
    total = math.sqrt(sum(float(g.detach().double().pow(2).sum()) for g in ref.values()))
    floor = max(gradient_floor(dtype, total, tolerance), 1e-300) if math.isfinite(total) else 0
    worst, where = 0.0, "no parameters"
    for pos, qual in backward.meta[VJP].grads:
        a, b = grads[pos].detach().double(), ref[qual].detach().double()
        bad = nonfinite(a, b)
        e = math.inf if bad else float((a - b).norm()) / max(float(b.norm()), floor, 1e-300)
        if e > worst or where == "no parameters":
            worst, where = e, f"{bad} at {qual}" if bad else f"at {qual}"
        if bad:
            break
    return Check(
        "gradients vs torch.func.grad",
        worst,
        where,
        tolerance,
        f"worst normwise relative error (floor {FLOOR_ULPS}·eps·‖∇L‖)",
        _dtype_name(dtype),
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cast(model: nn.Module, dtype):
    if dtype is None:
        return model
    import copy

    return copy.deepcopy(model).to(dtype)


def run_jvp(
    jvp: GraphModule, values: dict[str, torch.Tensor], tangents: dict[str, torch.Tensor]
) -> tuple:
    """Run a JVP graph: primal placeholders from ``values``, tangent placeholders from
    ``tangents`` (keyed by the primal placeholder's name)."""
    info = jvp.meta[JVP]
    t_of = {t: p for t, p in info.tangent_inputs}
    args = []
    for n in jvp.graph.nodes:
        if n.op != "placeholder":
            continue
        args.append(tangents[t_of[n.name]] if n.name in t_of else values[n.name])
    return jvp(*args)


def padding_rows(forward: GraphModule) -> dict[str, list[int]]:
    """The ``padding_idx`` rows of embedding tables, by the table's placeholder name: the rows
    of a parameter read directly by ``aten.embedding`` with ``padding_idx >= 0`` (rows PyTorch
    never trains)."""
    rows: dict[str, list[int]] = {}
    for n in forward.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.embedding.default:
            continue
        table = n.args[0]
        pad = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx", -1)
        if isinstance(table, torch.fx.Node) and table.op == "placeholder" and pad >= 0:
            rows.setdefault(table.name, []).append(int(pad))
    return rows


def verify_jvp(
    forward: GraphModule,
    jvp: GraphModule,
    model: nn.Module,
    *,
    tolerance: float = 1e-4,
    seed: int = 0,
    examples: tuple[torch.Tensor, ...] | None = None,
) -> Check:
    """Compare the JVP graph's loss tangent with ``torch.func.jvp`` along a random direction
    (zero in the :func:`padding_rows` of embedding tables, whose derivative PyTorch defines
    as zero for gradients but not for ``torch.func.jvp``). Where PyTorch has no forward-mode
    formula for an op of the model (``_embedding_bag``), the reference is ``<∇loss, direction>``
    with the gradient from ``torch.func.grad`` (exact: the loss is a scalar). The error is
    relative with an absolute floor scaled to the loss and the direction
    (:func:`tangent_floor`, :func:`tangent_error`): a tangent that is zero in exact arithmetic
    passes on rounding noise. A NaN or infinity in either tangent fails the check."""
    values = real_arguments(forward, model, seed=seed, examples=examples)
    sig: Signature = forward.meta[SIGNATURE]
    info = jvp.meta[JVP]
    gen = torch.Generator().manual_seed(seed + 1)
    tangents = {
        p: torch.randn(values[p].shape, generator=gen, dtype=values[p].dtype)
        for _, p in info.tangent_inputs
    }
    # PyTorch gives an embedding table's padding_idx row no gradient, and graphflop's JVP keeps
    # that convention (it stays the VJP's transpose); torch.func.jvp does not. Directions with
    # those rows zero make the two agree without hiding anything else.
    for p, rows in padding_rows(forward).items():
        if p in tangents:
            tangents[p][rows] = 0
    with seeded():
        outs = run_jvp(jvp, values, tangents)
    got = outs[info.primal_outputs]
    params = {q: values[n] for n, q in sig.params}
    model = _cast(model, next(iter(params.values())).dtype if params else None)
    # only floating inputs are differentiable (token ids stay fixed)
    input_names = [n for n in sig.inputs if values[n].is_floating_point()]

    def f(p, xs):
        vals = dict(values)
        vals.update({n: xs[i] for i, n in enumerate(input_names)})
        return reference_loss_fn(forward, model, vals)(p)

    xs = tuple(values[n] for n in input_names)
    p_t = {q: tangents.get(n, torch.zeros_like(values[n])) for n, q in sig.params}
    x_t = tuple(tangents.get(n, torch.zeros_like(values[n])) for n in input_names)
    try:
        loss, ref = torch.func.jvp(f, (params, xs), (p_t, x_t))
        what = "torch.func.jvp"
    except (NotImplementedError, RuntimeError) as e:
        if "forward AD" not in str(e):
            raise
        # an op PyTorch has no forward-mode formula for (_embedding_bag): the loss is a scalar,
        # so its tangent is <gradient, direction>, the gradient from reverse mode
        ref = _tangent_from_gradient(f, params, xs, p_t, x_t)
        with torch.no_grad():
            loss = f(params, xs)
        what = "torch.func.grad · direction"
    bad = nonfinite(got, ref)
    floor = tangent_floor(
        got.dtype, float(loss), [values[p] for p in tangents], list(tangents.values()), tolerance
    )
    return Check(
        f"JVP loss tangent vs {what}",
        math.inf if bad else tangent_error(got, ref, floor),
        bad or "the scalar loss tangent",
        tolerance,
        f"relative error (floor {FLOOR_ULPS}·eps·|L|·‖ṗ‖/‖p‖)",
        _dtype_name(got.dtype),
    )


def tangent_floor(
    dtype: torch.dtype,
    loss: float,
    primals: list[torch.Tensor],
    tangents: list[torch.Tensor],
    tolerance: float,
) -> float:
    """The denominator floor of the JVP check's relative error: ``FLOOR_ULPS · eps · |L| ·
    ‖ṗ‖ / ‖p‖ / tolerance``, so that ``|a − b| ≤ max(tolerance · |b|, FLOOR_ULPS · eps · |L|
    · ‖ṗ‖/‖p‖)`` passes (:func:`tangent_error`).

    ``‖ṗ‖/‖p‖`` is the size of the direction relative to the point (the norms over every
    primal that has a tangent, parameters and inputs together, in float64), and ``|L| ·
    ‖ṗ‖/‖p‖`` the loss tangent that size of relative change gives a loss of size ``|L|``: the
    scale of the terms the tangent is computed from. A tangent that is zero in exact
    arithmetic (a softmax's rows summed: identically 1) is rounding noise of a few ``eps`` of
    that scale, in graphflop's graph and in the reference alike; relative to each other such
    values differ by 100 % or more. ``FLOOR_ULPS`` (as for gradients, :func:`gradient_floor`)
    leaves room for sums of up to about 10⁶ terms. 0 when ``‖p‖ = 0`` or ``L = 0``: no scale,
    the plain relative error.

    Args:
        dtype: the dtype the graphs ran in (its machine epsilon ``eps``).
        loss: ``L``, the loss value at the primal point.
        primals: the primals that have tangents; tangents: theirs, in the same order.
        tolerance: the check's tolerance.
    """
    p = math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in primals))
    v = math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tangents))
    if p == 0 or not math.isfinite(loss * v / p):
        return 0.0
    return FLOOR_ULPS * torch.finfo(dtype).eps * abs(loss) * v / p / tolerance


def tangent_error(got: torch.Tensor, ref: torch.Tensor, floor: float) -> float:
    """``|a − b| / max(|b|, floor)`` in float64 (``floor`` from :func:`tangent_floor`;
    dimensionless)."""
    a, b = got.detach().double(), ref.detach().double()
    return float((a - b).norm()) / max(float(b.norm()), floor, 1e-300)


def _tangent_from_gradient(f, params, xs, p_t, x_t) -> torch.Tensor:
    """``<∇f, (p_t, x_t)>`` for a scalar ``f(params, xs)`` (floating inputs only), by reverse
    mode."""
    gp, gx = torch.func.grad(f, argnums=(0, 1))(params, xs)
    total = sum((gp[q] * p_t[q]).sum() for q in gp)
    return total + sum((d * t).sum() for d, t in zip(gx, x_t))


#: the words :func:`gap_notes` names each check by, keyed as :func:`gap_reasons`
_GAP_LABELS = {"gradients": "gradient", "jvp": "JVP", "forward_gradient": "forward-gradient"}


def gap_reasons(report) -> dict[str, str]:
    """Why a ``--verify`` check cannot run because an op lacks a rule (the phase it checks is
    incomplete, ``report.uncounted``), keyed ``gradients``, ``jvp``, ``forward_gradient``
    (absent: no gap stops it): the gradient check needs a complete backward, the JVP check a
    complete JVP, the forward-gradient check both."""
    t = report.totals
    ops = ", ".join(u.op for u in report.uncounted if set(u.missing) & {"jvp", "transpose"})
    out = {}
    if t.backward is not None and not t.backward.complete:
        out["gradients"] = f"the backward stops at ops without rules ({ops})"
    if t.jvp is not None and not t.jvp.complete:
        out["jvp"] = f"the JVP stops at ops without rules ({ops})"
    if t.jvp is not None and not (t.jvp.complete and (t.backward is None or t.backward.complete)):
        out["forward_gradient"] = "it needs a complete JVP and backward"
    return out


def gap_notes(report) -> list[str]:
    """:func:`gap_reasons` as one line each (``verify_note`` in the JSON)."""
    return [f"{_GAP_LABELS[k]} check not run: {why}" for k, why in gap_reasons(report).items()]


def verify_analysis(
    loaded,
    inputs,
    analysis,
    *,
    dtype: str = "float64",
    tolerance: float = 1e-4,
    forward_gradient_samples: int = 0,
) -> list[Check]:
    """Re-trace ``loaded.model`` in ``dtype`` and check the backward and JVP graphs built the
    same way as ``analysis``'s against torch.func. Returns one :class:`Check` per comparison;
    the checks of phases that an op without a rule left incomplete are returned not run (NaN
    error, not ok, :func:`gap_reasons`' words as ``where``), and so are the gradient and JVP
    checks of a model whose attention is called with dropout
    (:func:`graphflop.runtime.verify_attention.attention_dropout`). A check that raises (a
    reference PyTorch cannot differentiate, say) is returned as not run (NaN error, not ok),
    with the error's first line as ``where``: nothing is raised."""
    import copy

    from graphflop.ad.jvp import build_jvp
    from graphflop.ad.vjp import build_vjp

    loss = analysis.forward.meta.get(LOSS_KIND, "auto")
    examples = getattr(loaded, "example_inputs", None)  # real values, when the file gives them
    dt = torch.float64 if dtype == "float64" else torch.float32
    model = copy.deepcopy(loaded.model).to(dt)
    checks: list[Check] = []
    fwd = _run(checks, "trace in " + dtype, tolerance, lambda: _trace_in(model, inputs, dt, loss))
    if fwd is None:
        return checks
    t = analysis.report.totals
    gaps = gap_reasons(analysis.report)  # checks an op without a rule stops: NOT RUN
    # attention dropout: the reference's masks cannot be graphflop's (attention_dropout)
    no_ref = _attention_dropout_note(analysis, fwd, model, examples)
    if analysis.backward is not None:
        name = "gradients vs torch.func.grad"
        _run(
            checks,
            name,
            tolerance,
            lambda: (
                _not_run(name, gaps.get("gradients") or no_ref, tolerance)
                or verify_gradients(
                    fwd, build_vjp(fwd), model, tolerance=tolerance, examples=examples
                )
            ),
        )
    if analysis.jvp is not None:
        name = "JVP loss tangent vs torch.func.jvp"
        _run(
            checks,
            name,
            tolerance,
            lambda: (
                _not_run(name, gaps.get("jvp") or no_ref, tolerance)
                or verify_jvp(
                    fwd,
                    build_jvp(fwd, t.jvp.tangents),
                    model,
                    tolerance=tolerance,
                    examples=examples,
                )
            ),
        )
    if (
        analysis.jvp is not None
        and forward_gradient_samples
        and fwd.meta[SIGNATURE].loss is not None
    ):
        from graphflop.runtime.verify_fg import FG_ALPHA, verify_forward_gradient

        name = f"forward-gradient estimate unbiased over {forward_gradient_samples} directions"
        # a statistical check needs no float64: run it on a float32 trace, faster
        model32 = copy.deepcopy(loaded.model).float()
        _run(
            checks,
            name,
            FG_ALPHA,
            lambda: (
                _not_run(name, gaps.get("forward_gradient", ""), FG_ALPHA)
                or verify_forward_gradient(
                    _trace_in(model32, inputs, torch.float32, loss),
                    model32,
                    samples=forward_gradient_samples,
                    examples=examples,
                )
            ),
        )
    return checks


def _attention_dropout_note(analysis, fwd: GraphModule, model: nn.Module, examples) -> str:
    """:func:`graphflop.runtime.verify_attention.attention_dropout_note` when the model's
    attention runs with dropout ("" when it does not, or when there is no check it stops)."""
    if analysis.backward is None and analysis.jvp is None:
        return ""
    from graphflop.runtime import verify_attention

    try:
        p = verify_attention.attention_dropout(fwd, model, examples)
    except Exception:  # noqa: BLE001 - the checks' own reference runs report the error
        p = 0.0
    return verify_attention.attention_dropout_note(p) if p else ""


def _not_run(name: str, why: str, tolerance: float) -> Check | None:
    """A not-run :class:`Check` saying ``why``; None when ``why`` is empty (the check runs)."""
    return Check(name, math.nan, why, tolerance) if why else None


def _trace_in(model: nn.Module, inputs, dt: torch.dtype, loss: str) -> GraphModule:
    """``model`` traced on inputs shaped like ``inputs``, floating ones in ``dt``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphflop.frontend.trace import trace

    with FakeTensorMode(allow_non_fake_inputs=True):
        xs = tuple(
            torch.empty(tuple(t.shape), dtype=dt if t.is_floating_point() else t.dtype)
            for t in inputs
        )
    return trace(model, xs, loss=loss)


def _run(checks: list[Check], name: str, tolerance: float, fn) -> Any:
    """``fn()``; a :class:`Check` it returns is appended to ``checks``. An exception becomes a
    not-run check named ``name``, its traceback in ``detail`` (returns None)."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - reported as a check that did not run
        msg = " ".join(str(e).split())[:160]
        tb = traceback.format_exc()
        checks.append(Check(name, math.nan, f"{type(e).__name__}: {msg}", tolerance, detail=tb))
        return None
    if isinstance(out, Check):
        checks.append(out)
    return out
