"""The ``--verify`` JVP check: graphflop's JVP graph's loss tangent against
``torch.func.jvp`` along a random direction (:func:`verify_jvp`), compared with a relative
error that has an absolute floor scaled to the loss and the direction (:func:`tangent_floor`,
:func:`tangent_error`)."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from torch.fx import GraphModule
from torch.overrides import TorchFunctionMode

from graphflop.meta import JVP, NO_GRAD, SIGNATURE, Signature
from graphflop.runtime import verify
from graphflop.runtime.verify import (
    SAME_NONFINITE,
    Check,
    _cast,
    _dtype_name,
    differentiable_params,
    floating_dtype,
    floor_unit,
    floor_words,
    lowest_precision,
    nonfinite,
    norm64,
    padding_idx,
    real_arguments,
    same_nonfinite,
    seeded,
)


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
        pad = padding_idx(n)
        if isinstance(table, torch.fx.Node) and table.op == "placeholder" and pad >= 0:
            rows.setdefault(table.name, []).append(pad)
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
    formula for an op of the model (``_embedding_bag``), and where the model turns grad mode off
    (``torch.no_grad()``: eager forward-mode AD, ``torch.func.jvp`` among it, differentiates
    through it; graphflop's JVP, the backward's transpose, does not, as eager autograd), the
    reference is ``<∇loss, direction>``
    with the gradient from ``torch.func.grad`` (exact: the loss is a scalar); so it is where the
    model reads a tensor's ``requires_grad``, ``is_leaf`` or ``grad_fn`` and the inputs have no
    tangent (forward-mode AD reads every value as a leaf that requires no grad, graphflop's
    trace as a training step does: the gradient is taken with respect to the parameters only). The error is
    relative with an absolute floor scaled to the loss and the direction
    (:func:`tangent_floor`, :func:`tangent_error`): a tangent that is zero in exact arithmetic
    passes on rounding noise. Where ``torch.func.jvp``'s tangent is NaN or infinite and
    graphflop's finite, the reverse-mode ``<∇loss, direction>`` is the reference when it is
    finite (PyTorch's forward-mode formula for ``atan2`` is NaN at (0, 0), its gradient 0, and
    graphflop's JVP is the map its backward transposes). A NaN or infinity in either tangent
    fails the check, unless both are NaN (or the same infinity): then it is not comparable
    (``Check.comparable``)."""
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
    params = differentiable_params(sig, values)
    model = _cast(model, floating_dtype(params))
    # only floating inputs are differentiable (token ids stay fixed)
    input_names = [n for n in sig.inputs if values[n].is_floating_point()]

    def f(p, xs):
        vals = dict(values)
        vals.update({n: xs[i] for i, n in enumerate(input_names)})
        # through the module: a test may point verify.reference_loss_fn elsewhere
        return verify.reference_loss_fn(forward, model, vals)(p)

    xs = tuple(values[n] for n in input_names)
    p_t = {q: tangents.get(n, torch.zeros_like(values[n])) for n, q in sig.params if q in params}
    x_t = tuple(tangents.get(n, torch.zeros_like(values[n])) for n in input_names)
    # the warnings of a reference that refused to run are not the model's (a reentrant
    # checkpoint warns that nothing requires grad under torch.func and dual tensors)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if any(n.meta.get(NO_GRAD) for n in forward.graph.nodes):
                raise NotImplementedError("grad mode off in the model: no forward AD reference")
            try:
                # torch.func.jvp's return type is a 2- or 3-tuple whatever has_aux says
                with _GradFlagReads() as flags:
                    loss, ref = torch.func.jvp(f, (params, xs), (p_t, x_t))  # type: ignore[misc]
                what = "torch.func.jvp"
                if flags.read and not any(bool(t.any()) for t in x_t):
                    # the model reads requires_grad/is_leaf/grad_fn, which forward-mode AD
                    # leaves False/True/None everywhere, where graphflop's forward reads them
                    # as a training step does (computed from trainable parameters: True, False,
                    # a node): the tangent of that function is <gradient, direction>, the
                    # gradient with respect to the parameters (the inputs require no grad)
                    ref = _tangent_from_gradient(f, params, xs, p_t, x_t, model, inputs=False)[0]
                    what = "torch.func.grad · direction (the model reads requires_grad)"
            except RuntimeError as e:
                if not verify.functorch_refused(e):
                    raise
                # a custom Function torch.func cannot run: eager forward-mode AD runs its jvp
                loss, ref = _eager_jvp(f, (params, xs), (p_t, x_t))
                what = "torch.autograd.forward_ad"
        except (NotImplementedError, RuntimeError) as e:
            if "forward AD" not in str(e) and not isinstance(e, NotImplementedError):
                raise
            caught.clear()
            # an op PyTorch has no forward-mode formula for (_embedding_bag), or a Function
            # without a jvp (the reentrant checkpoint's): the loss is a scalar, so its tangent
            # is <gradient, direction>, the gradient from reverse mode
            ref, by = _tangent_from_gradient(f, params, xs, p_t, x_t, model)
            with torch.no_grad():
                loss = f(params, xs)
            what = f"{by} · direction"
            caught.clear()
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not bool(ref.isfinite().all()) and bool(got.isfinite().all()):
        # PyTorch's forward-mode formula can be NaN where its reverse-mode one is finite
        # (atan2 at (0, 0) divides by x² + y²; atan2_backward gives 0): graphflop's JVP is the
        # map its backward transposes, so the reverse-mode tangent is the reference then
        alt, by = _tangent_from_gradient(f, params, xs, p_t, x_t, model)
        if bool(alt.isfinite().all()):
            ref, what = alt, f"{by} · direction ({what}'s is not finite)"
    bad = nonfinite(got, ref)
    if bad and same_nonfinite(got, ref):
        return Check(
            f"JVP loss tangent vs {what}",
            math.nan,
            SAME_NONFINITE.format(what="loss tangents", count=got.numel(), where=""),
            tolerance,
            dtype=_dtype_name(got.dtype),
            comparable=False,
        )
    # the scale of the loss's terms (a loss whose terms cancel is rounding noise of them)
    with seeded():
        keep = {verify.loss_terms_name(forward), sig.loss}
        magnitude = verify.loss_magnitude(forward, verify.run_forward(forward, values, keep))
    low = lowest_precision(forward)
    floor = tangent_floor(
        got.dtype,
        max(abs(float(loss)), magnitude),
        [values[p] for p in tangents],
        list(tangents.values()),
        tolerance,
        low,
    )
    return Check(
        f"JVP loss tangent vs {what}",
        math.inf if bad else tangent_error(got, ref, floor),
        bad or "the scalar loss tangent",
        tolerance,
        f"relative error (floor {floor_words(got.dtype, low)}·Σ|ℓ|·‖ṗ‖/‖p‖)",
        _dtype_name(got.dtype),
    )


def tangent_floor(
    dtype: torch.dtype,
    loss: float,
    primals: list[torch.Tensor],
    tangents: list[torch.Tensor],
    tolerance: float,
    low: torch.dtype | None = None,
) -> float:
    """The denominator floor of the JVP check's relative error: ``FLOOR_ULPS · eps · |L| ·
    ‖ṗ‖ / ‖p‖ / tolerance``, so that ``|a − b| ≤ max(tolerance · |b|, FLOOR_ULPS · eps · |L|
    · ‖ṗ‖/‖p‖)`` passes (:func:`tangent_error`; ``FLOOR_ULPS · eps`` is
    :func:`~graphflop.runtime.verify.floor_unit`: the eps of ``low`` where larger).

    ``‖ṗ‖/‖p‖`` is the size of the direction relative to the point (the norms over every
    primal that has a tangent, parameters and inputs together, in float64), and ``|L| ·
    ‖ṗ‖/‖p‖`` the loss tangent that size of relative change gives a loss of size ``|L|``: the
    scale of the terms the tangent is computed from. :func:`verify_jvp` gives ``Σ|ℓ|`` for
    ``|L|``, the magnitudes of the terms the loss adds up
    (:func:`graphflop.runtime.verify.loss_magnitude`): a loss whose terms cancel (the sum of a
    layer norm's output without affine, 0 for every input) has their scale, not its own. A tangent that is zero in exact
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
        low: the lowest precision the graph computes in
            (:func:`~graphflop.runtime.verify.lowest_precision`), or None.
    """
    p, v = norm64(primals), norm64(tangents)
    if p == 0 or not math.isfinite(loss * v / p):
        return 0.0
    return floor_unit(dtype, low) * abs(loss) * v / p / tolerance


def tangent_error(got: torch.Tensor, ref: torch.Tensor, floor: float) -> float:
    """``|a − b| / max(|b|, floor)`` in float64 (``floor`` from :func:`tangent_floor`;
    dimensionless)."""
    a, b = got.detach().double(), ref.detach().double()
    return float((a - b).norm()) / max(float(b.norm()), floor, 1e-300)


class _GradFlagReads(TorchFunctionMode):
    """While active, notes (:attr:`read`) whether the code run reads a tensor's
    ``requires_grad``, ``is_leaf`` or ``grad_fn``."""

    def __init__(self) -> None:
        super().__init__()
        self.read = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        owner = getattr(func, "__self__", None)
        if any(owner is d for d in _GRAD_FLAGS):
            self.read = True
        return func(*args, **(kwargs or {}))


#: the descriptors of ``Tensor.requires_grad``, ``is_leaf`` and ``grad_fn``
_GRAD_FLAGS = tuple(
    torch._C.TensorBase.__dict__[k] for k in ("requires_grad", "is_leaf", "grad_fn")
)


def _tangent_from_gradient(
    f, params, xs, p_t, x_t, model=None, inputs: bool = True
) -> tuple[torch.Tensor, str]:
    """``(<∇f, (p_t, x_t)>, what)`` for a scalar ``f(params, xs)`` (floating inputs only), by
    reverse mode: ``torch.func.grad``, or eager autograd where torch.func refuses the model
    (``what`` names the one used). ``inputs=False``: the gradient with respect to the
    parameters only (``x_t`` left out; the inputs require no grad, as in a training step)."""
    try:
        if inputs:
            gp, gx = torch.func.grad(f, argnums=(0, 1))(params, xs)
        else:
            gp, gx = torch.func.grad(f)(params, xs), ()
        by = "torch.func.grad"
    except RuntimeError as e:
        if not verify.functorch_refused(e):
            raise
        if inputs:
            (gp, gx), _ = verify.eager_gradients(f, [params, xs], model)
        else:
            (gp,), _ = verify.eager_gradients(lambda p: f(p, xs), [params], model)
            gx = ()
        by = "torch.autograd.backward"
    total = sum((gp[q] * p_t[q]).sum() for q in gp)
    return total + sum((d * t).sum() for d, t in zip(gx, x_t)), by


def _eager_jvp(f, primals: tuple, tangents: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f(*primals), its tangent)`` by eager forward-mode AD (``torch.autograd.forward_ad``
    dual tensors), for the models ``torch.func.jvp`` refuses (a custom Function with a ``jvp``
    but no ``setup_context``). ``primals``/``tangents``: a dict of parameters and a tuple of
    inputs, and their tangents."""
    import torch.autograd.forward_ad as fwad

    (params, xs), (p_t, x_t) = primals, tangents
    with fwad.dual_level():
        dp = {q: fwad.make_dual(v, p_t[q]) for q, v in params.items()}
        dx = tuple(fwad.make_dual(x, t) for x, t in zip(xs, x_t))
        loss, tangent = fwad.unpack_dual(f(dp, dx))
    if tangent is None:  # the loss does not depend on the direction
        tangent = torch.zeros_like(loss)
    return loss.detach(), tangent.detach()
