"""Run graphflop's generated graphs on real random tensors and compare them with PyTorch.

``verify_gradients`` checks every parameter gradient of the backward graph against
``torch.func.grad`` of the same loss; ``verify_jvp`` checks the JVP graph's loss tangent against
``torch.func.jvp``. Relative error is ``‖a − b‖ / max(‖b‖, tiny)`` per tensor.
:func:`forward_gradient_samples` decides how many steps the forward-gradient unbiasedness check
(:func:`verify_forward_gradient`) may afford.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter

from graphflop.frontend.trace import loss_value
from graphflop.meta import (
    CONSTANTS,
    FORWARD_GRADIENT,
    JVP,
    LOSS_KIND,
    SIGNATURE,
    SOURCE,
    VJP,
    Signature,
)

#: the forward-gradient check's default number of steps, the FLOPs they may spend together
#: (about half a minute on two CPU cores) and the fewest steps worth a statistical check
VERIFY_SAMPLES = 100
VERIFY_FLOPS = 2e12
MIN_VERIFY_SAMPLES = 16


def forward_gradient_samples(requested: int | None, step_flops: float) -> tuple[int, str]:
    """Steps for the forward-gradient unbiasedness check, and why the default was cut.

    Args:
        requested: the number asked for (``--verify-samples``); it always wins. None: the
            default, :data:`VERIFY_SAMPLES` steps, or as many as fit in :data:`VERIFY_FLOPS`,
            or none when fewer than :data:`MIN_VERIFY_SAMPLES` fit.
        step_flops: FLOPs of one forward-gradient step (0: unknown, the default applies).

    Returns:
        ``(steps, note)``: ``note`` is empty unless the default was cut down or skipped, when it
        says why in one line (0 steps: skip the check).
    """
    if requested is not None:
        return requested, ""
    fit = int(VERIFY_FLOPS // step_flops) if step_flops else VERIFY_SAMPLES
    if fit >= VERIFY_SAMPLES:
        return VERIFY_SAMPLES, ""
    if fit >= MIN_VERIFY_SAMPLES:
        return fit, (
            f"forward-gradient check over {fit} steps, not {VERIFY_SAMPLES}: one step "
            f"is {step_flops / 1e9:,.1f} GFLOPs (--verify-samples M sets the number)"
        )
    return 0, (
        f"forward-gradient check skipped: one step is {step_flops / 1e9:,.1f} GFLOPs, too many "
        f"to repeat {MIN_VERIFY_SAMPLES}+ times (--verify-samples M runs it anyway)"
    )


@dataclass(frozen=True)
class Check:
    """Result of one comparison: the worst relative error and where it occurred."""

    name: str
    worst_rel_error: float
    where: str
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.worst_rel_error <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``inspect --json``'s ``verify`` entries)."""
        return {
            "check": self.name,
            "worst_rel_error": self.worst_rel_error,
            "where": self.where,
            "tolerance": self.tolerance,
            "ok": self.ok,
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


def real_arguments(
    forward: GraphModule, model: nn.Module, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Real tensors for every placeholder of a traced forward graph: the model's parameters and
    buffers (in the graph's dtypes), random inputs, and random valid targets."""
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
    out_val = (
        next(n for n in forward.graph.nodes if n.name == (sig.outputs or (None,))[0]).meta["val"]
        if sig.outputs
        else None
    )
    for name in sig.inputs + sig.targets:
        v = phs[name].meta["val"]
        if v.is_floating_point():
            values[name] = torch.randn(tuple(v.shape), generator=gen, dtype=v.dtype)
        else:
            high = out_val.shape[-1] if (name in sig.targets and out_val is not None) else 2
            values[name] = torch.randint(0, high, tuple(v.shape), generator=gen, dtype=v.dtype)
    return values


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


def reference_loss_fn(forward: GraphModule, model: nn.Module, values: dict[str, torch.Tensor]):
    """``f(params) -> loss`` for torch.func, using the model itself (not graphflop's graphs)."""
    sig: Signature = forward.meta[SIGNATURE]
    loss_kind = forward.meta.get(LOSS_KIND, "sum")
    buffers = {q: values[n].clone() for n, q in sig.buffers}
    inputs = [values[n] for n in sig.inputs]
    targets = [values[n] for n in sig.targets]

    def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
        # attention in its math kernel: the fused CPU kernels have no forward-mode derivative
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out = torch.func.functional_call(
                model, {**params, **{k: v.clone() for k, v in buffers.items()}}, tuple(inputs)
            )
        first = (
            out if isinstance(out, torch.Tensor) else torch.utils._pytree.tree_flatten(out)[0][0]
        )
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
) -> Check:
    """Compare every parameter gradient of ``backward`` with ``torch.func.grad`` of the same
    loss on the same random inputs, in the dtype the graphs were traced in."""
    values = real_arguments(forward, model, seed=seed)
    grads = run_backward(backward, run_forward(forward, values, backward_reads(backward)))
    sig: Signature = forward.meta[SIGNATURE]
    params = {q: values[n] for n, q in sig.params}
    model = _cast(model, next(iter(params.values())).dtype if params else None)
    ref = torch.func.grad(reference_loss_fn(forward, model, values))(params)
    worst, where = 0.0, ""
    # a gradient that is zero in exact arithmetic (an attention key's bias: softmax ignores a
    # shift along its row) is rounding noise on both sides: measured against the largest one
    floor = 1e-10 * max((float(g.detach().double().norm()) for g in ref.values()), default=0.0)
    for pos, qual in backward.meta[VJP].grads:
        e = float((grads[pos].detach().double() - ref[qual].detach().double()).norm()) / max(
            float(ref[qual].detach().double().norm()), floor, 1e-30
        )
        if e >= worst:
            worst, where = e, qual
    return Check("gradients vs torch.func.grad", worst, where, tolerance)


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
) -> Check:
    """Compare the JVP graph's loss tangent with ``torch.func.jvp`` along a random direction
    (zero in the :func:`padding_rows` of embedding tables, whose derivative PyTorch defines
    as zero for gradients but not for ``torch.func.jvp``). Where PyTorch has no forward-mode
    formula for an op of the model (``_embedding_bag``), the reference is ``<∇loss, direction>``
    with the gradient from ``torch.func.grad`` (exact: the loss is a scalar)."""
    values = real_arguments(forward, model, seed=seed)
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
        _, ref = torch.func.jvp(f, (params, xs), (p_t, x_t))
        what = "torch.func.jvp"
    except (NotImplementedError, RuntimeError) as e:
        if "forward AD" not in str(e):
            raise
        # an op PyTorch has no forward-mode formula for (_embedding_bag): the loss is a scalar,
        # so its tangent is <gradient, direction>, the gradient from reverse mode
        gp, gx = torch.func.grad(f, argnums=(0, 1))(params, xs)
        ref = sum((gp[q] * p_t[q]).sum() for q in gp) + sum((g * t).sum() for g, t in zip(gx, x_t))
        what = "torch.func.grad · direction"
    return Check(f"JVP loss tangent vs {what}", rel_error(got, ref), "loss", tolerance)


def gap_notes(report) -> list[str]:
    """One line per ``--verify`` check that cannot run because an op lacks a rule (the phase
    it checks is incomplete, ``report.uncounted``): the gradient check needs a complete
    backward, the JVP check a complete JVP, the forward-gradient check both."""
    t = report.totals
    ops = ", ".join(u.op for u in report.uncounted if set(u.missing) & {"jvp", "transpose"})
    notes = []
    if t.backward is not None and not t.backward.complete:
        notes.append(f"gradient check not run: the backward stops at ops without rules ({ops})")
    if t.jvp is not None and not t.jvp.complete:
        notes.append(f"JVP check not run: the JVP stops at ops without rules ({ops})")
    if t.jvp is not None and not (t.jvp.complete and (t.backward is None or t.backward.complete)):
        notes.append("forward-gradient check not run: it needs a complete JVP and backward")
    return notes


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
    the checks of phases that an op without a rule left incomplete are not run
    (:func:`gap_notes` says which)."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphflop.ad.jvp import build_jvp
    from graphflop.ad.vjp import build_vjp
    from graphflop.frontend.trace import trace

    dt = torch.float64 if dtype == "float64" else torch.float32
    model = copy.deepcopy(loaded.model).to(dt)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        xs = tuple(
            torch.empty(
                tuple(t.shape), dtype=dt if t.is_floating_point() else t.dtype, device="cpu"
            )
            for t in inputs
        )
    fwd = trace(model, xs, loss=analysis.forward.meta.get(LOSS_KIND, "auto"))
    checks = []
    t = analysis.report.totals
    bwd_ok = t.backward is None or t.backward.complete
    if analysis.backward is not None and bwd_ok:
        checks.append(verify_gradients(fwd, build_vjp(fwd), model, tolerance=tolerance))
    if analysis.jvp is not None and t.jvp.complete:
        jvp_totals = analysis.report.totals.jvp
        tangents = jvp_totals.tangents if jvp_totals is not None else "params"
        checks.append(verify_jvp(fwd, build_jvp(fwd, tangents), model, tolerance=tolerance))
        if forward_gradient_samples and fwd.meta[SIGNATURE].loss is not None and bwd_ok:
            # a statistical check needs no float64: run it on a float32 trace, faster
            model32 = copy.deepcopy(loaded.model).float()
            with mode:
                xs32 = tuple(
                    torch.empty(
                        tuple(t.shape),
                        device="cpu",
                        dtype=torch.float32 if t.is_floating_point() else t.dtype,
                    )
                    for t in inputs
                )
            fwd32 = trace(model32, xs32, loss=analysis.forward.meta.get(LOSS_KIND, "auto"))
            checks.append(verify_forward_gradient(fwd32, model32, samples=forward_gradient_samples))
    return checks


def verify_forward_gradient(
    forward: GraphModule, model: nn.Module, *, samples: int = 128, seed: int = 0
) -> Check:
    """Statistical check that the forward-gradient step estimates the gradient without bias.

    Runs the step graph (SGD, lr = 1, directions sampled inside the graph) ``samples`` times, so
    each run's ``w − w_new`` is one estimate ``g = (∇L·v) v``, and compares their mean ``ḡ`` with
    the backward graph's gradient ``∇L`` along ``u = ∇L/‖∇L‖``. For Gaussian ``v``,
    ``u·g = ‖∇L‖ (u·v)²``, so ``u·ḡ / ‖∇L‖`` is a mean of ``samples`` χ²₁ draws: mean 1, standard
    deviation √(2/samples), whatever the parameter count. The check passes when it lies within
    4 standard deviations of 1; ``worst_rel_error`` reports ``|u·ḡ/‖∇L‖ − 1|`` and the tolerance
    the 4σ bound.
    """
    from graphflop.ad.vjp import build_vjp
    from graphflop.passes.forward_gradient import build_forward_gradient_step

    values = real_arguments(forward, model, seed=seed)
    sig: Signature = forward.meta[SIGNATURE]
    if not sig.trainable():
        return Check(
            f"forward-gradient mean along ∇L over {samples} directions",
            0.0,
            "no parameters: nothing to estimate",
            4 * (2.0 / samples) ** 0.5,
        )
    backward = build_vjp(forward)
    grads = run_backward(backward, run_forward(forward, values, backward_reads(backward)))
    true = torch.cat([g.flatten() for g in grads])
    step = build_forward_gradient_step(forward, "sgd")
    info = step.meta[FORWARD_GRADIENT]
    w = torch.cat([values[p].flatten() for p, _ in sig.trainable()])
    args = [torch.tensor(1.0, dtype=torch.float32) if n == "lr" else values[n] for n in info.inputs]
    torch.manual_seed(seed)
    total = torch.zeros_like(true)
    for _ in range(samples):
        out = step(*args)
        new_w = torch.cat([t.flatten() for t in out[1 : 1 + len(sig.trainable())]])
        total += w - new_w
    est = total / samples
    norm = float(true.norm())
    proj = float(est @ true) / max(norm * norm, 1e-300)
    return Check(
        f"forward-gradient mean along ∇L over {samples} directions",
        abs(proj - 1.0),
        "u·ḡ/‖∇L‖",
        4 * (2.0 / samples) ** 0.5,
    )
