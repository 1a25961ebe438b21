"""All the ``--verify`` checks of one analysis (:func:`verify_analysis`): the gradient check
(:func:`graphflop.runtime.verify.verify_gradients`), the JVP check
(:func:`graphflop.runtime.verify_tangent.verify_jvp`) and the forward-gradient check
(:func:`graphflop.runtime.verify_fg.verify_forward_gradient`), each returned as a
:class:`~graphflop.runtime.verify.Check`, NOT RUN with the reason where an op without a rule
(:func:`gap_reasons`), attention dropout or an error stops it."""

from __future__ import annotations

import dataclasses
import math
import re
import traceback
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from graphflop.meta import FUNCTION_LABEL, LOSS_KIND, OUTLINED, SIGNATURE
from graphflop.runtime import verify
from graphflop.runtime.verify import Check, cast_model, copy_model
from graphflop.runtime.verify_tangent import verify_jvp

#: the words :func:`gap_notes` names each check by, keyed as :func:`gap_reasons`
_GAP_LABELS = {"gradients": "gradient", "jvp": "JVP", "forward_gradient": "forward-gradient"}


def gap_reasons(report) -> dict[str, str]:
    """Why a ``--verify`` check cannot run because an op lacks a rule (the phase it checks is
    incomplete, ``report.uncounted``), keyed ``gradients``, ``jvp``, ``forward_gradient``
    (absent: no gap stops it): the gradient check needs a complete backward, the JVP check a
    complete JVP, the forward-gradient check both."""
    t = report.totals
    gaps = report.derivative_gaps
    plain = [u.op for u in gaps if not u.op.startswith(FUNCTION_LABEL)]
    own = [u for u in gaps if u.op.startswith(FUNCTION_LABEL)]
    ops = f"ops without rules ({', '.join(plain)})" if plain else ""
    no_jvp = ", ".join(u.op for u in own if "transpose" not in u.missing)
    broken = ", ".join(u.op for u in own if "transpose" in u.missing)
    bwd = [w for w in (ops, broken and f"{broken}, whose backward could not be traced") if w]
    fwd = bwd + ([f"{no_jvp}, which has no jvp"] if no_jvp else [])
    # a checkpoint whose recompute is not modelled leaves the counts incomplete, not the
    # derivatives: the checks run
    recompute_only = all(set(u.missing) == {"recompute"} for u in report.uncounted)
    bwd_cut = t.backward is not None and not t.backward.complete and not recompute_only
    jvp_cut = t.jvp is not None and not t.jvp.complete and not recompute_only
    # a phase cut short by something other than a derivative gap (an op the analysis could
    # not count, say) names what the report lists as uncounted instead of an empty list
    rest = ", ".join(f"{u.op} (no {'/'.join(u.missing)})" for u in report.uncounted)
    other = f"ops the analysis could not count: {rest or 'see the report'}"
    out = {}
    if bwd_cut:
        out["gradients"] = f"the backward stops at {' and '.join(bwd) or other}"
    if jvp_cut:
        out["jvp"] = f"the JVP stops at {' and '.join(fwd) or other}"
    if t.jvp is not None and (jvp_cut or bwd_cut):
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
    same way as ``analysis``'s against torch.func, within ``tolerance`` or the machine epsilon
    of the lowest precision the re-traced graph computes in where larger
    (:func:`~graphflop.runtime.verify.dtype_tolerance`: a model's own bfloat16 autocast, 7.8e-3),
    the checks' ``tolerance_note`` saying so. Returns one :class:`Check` per comparison;
    the checks of phases that an op without a rule left incomplete are returned not run (NaN
    error, not ok, :func:`gap_reasons`' words as ``where``), and so are the gradient and JVP
    checks of a model whose attention is called with dropout
    (:func:`graphflop.runtime.verify_attention.attention_dropout`). A check that raises (a
    reference PyTorch cannot differentiate, say) is returned as not run (NaN error, not ok),
    with the error's first line as ``where``: nothing is raised."""
    from graphflop.ad.jvp import build_jvp
    from graphflop.ad.vjp import build_vjp
    from graphflop.frontend.errors import MixedDtypes, TraceError

    loss = analysis.forward.meta.get(LOSS_KIND, "auto")
    examples = getattr(loaded, "example_inputs", None)  # real values, when the file gives them
    dt = torch.float64 if dtype == "float64" else torch.float32
    model = cast_model(loaded.model, dt)
    checks: list[Check] = []
    # traced as the analysis was: outlined where it outlined a call (a flat analysis, asked
    # with outline=False or with nothing repeated, is checked on a flat trace)
    info = analysis.forward.meta.get(OUTLINED)
    reuse = info is not None and info.calls > 0

    own_kept = False

    def traced() -> GraphModule:
        """The trace in ``dt``; where the model mixes dtypes on purpose (a float64 block, a
        bfloat16 one, the casts in its forward) and the cast of every tensor to ``dt`` met
        the model's own casts, the trace with only the tensors in the inputs' dtype cast
        (:func:`_own_dtypes_kept`)."""
        nonlocal model, own_kept
        try:
            return _trace_in(model, inputs, dt, loss, reuse=reuse)
        except TraceError as e:
            kept = _own_dtypes_kept(loaded.model, inputs, dt)
            if kept is None or not isinstance(e.__cause__ or e, MixedDtypes):
                raise
            try:
                fwd = _trace_in(kept, inputs, dt, loss, reuse=reuse)
            except TraceError:
                raise e from None
            model, own_kept = kept, True
            return fwd

    fwd = _run(checks, "trace in " + dtype, tolerance, traced)
    if fwd is None:
        return checks
    # the default 1e-4, or the eps of the lowest precision the graph computes in where larger
    # (the model's own bfloat16 autocast): verify's dtype is not all the model computes in
    tolerance, note = verify.dtype_tolerance(fwd, tolerance)
    first = len(checks)
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
                or verify.verify_gradients(
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
    if note:
        checks[first:] = [dataclasses.replace(c, tolerance_note=note) for c in checks[first:]]
    if dt is torch.float64:  # the model's own casts (autocast) met verify's float64 in eager
        checks[first:] = [
            dataclasses.replace(c, where=f"{c.where}; {_IN_FLOAT32}")
            if not c.ran and _DTYPE_MISMATCH.search(c.where) and _IN_FLOAT32 not in c.where
            else c
            for c in checks[first:]
        ]
    if (
        analysis.jvp is not None
        and forward_gradient_samples
        and fwd.meta[SIGNATURE].loss is not None
    ):
        from graphflop.runtime.verify_fg import FG_ALPHA, verify_forward_gradient

        name = f"forward-gradient estimate unbiased over {forward_gradient_samples} directions"
        # a statistical check needs no float64: run it on a float32 trace, faster
        # (a model mixing dtypes on purpose: its main dtype's tensors only, as traced() does)
        # (own dtypes kept where the trace above kept them)
        kept = _own_dtypes_kept(loaded.model, inputs, torch.float32) if own_kept else None
        model32 = kept if kept is not None else copy_model(loaded.model).float()
        _run(
            checks,
            name,
            FG_ALPHA,
            lambda: (
                _not_run(name, gaps.get("forward_gradient", ""), FG_ALPHA)
                or verify_forward_gradient(
                    _trace_in(model32, inputs, torch.float32, loss, reuse=reuse),
                    model32,
                    samples=forward_gradient_samples,
                    examples=examples,
                )
            ),
        )
    return checks


def _own_dtypes_kept(model: nn.Module, inputs, dt: torch.dtype) -> nn.Module | None:
    """For a model whose floating parameters and buffers have several dtypes (mixed on
    purpose, the casts in its forward), a copy with those in the floating inputs' dtype (else
    the dtype holding most elements, :func:`~graphflop.runtime.verify.main_dtype`) cast to
    ``dt`` and the others kept; None for a model of one dtype."""
    main, mixed = verify.main_dtype(model)
    if not mixed:
        return None
    first = next((t.dtype for t in inputs if t.is_floating_point()), main)
    return cast_model(model, dt, only=first)


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


def _trace_in(
    model: nn.Module, inputs, dt: torch.dtype, loss: str, *, reuse: bool = True
) -> GraphModule:
    """``model`` traced on inputs shaped like ``inputs``, floating ones in ``dt`` (``reuse``:
    repeated blocks outlined, as :func:`~graphflop.frontend.trace.trace` takes it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphflop.frontend.errors import MixedDtypes, TraceError
    from graphflop.frontend.trace import trace

    with FakeTensorMode(allow_non_fake_inputs=True):
        xs = tuple(
            torch.empty(tuple(t.shape), dtype=dt if t.is_floating_point() else t.dtype)
            for t in inputs
        )
    try:
        return trace(model, xs, loss=loss, reuse=reuse)
    except MixedDtypes as e:
        if dt is not torch.float64 or "float64" not in e.found:
            raise
        # the model casts to a dtype of its own (x.float(), autocast) where verify cast it to
        # float64: the advice is verify's dtype, not the inputs'
        raise TraceError(
            f"{e.found}: the model casts values to a dtype of its own, which meet the float64 "
            f"ones verify makes; {_IN_FLOAT32}"
        ) from e


#: the advice where verify's float64 is what stopped a check
_IN_FLOAT32 = "verify in float32 (--verify-dtype float32)"
#: a kernel's refusal of float64 operands (``torch._grouped_mm``: "Expected mat_a to be Float32,
#: BFloat16 or Float16 matrix, got Double"; "… not implemented for 'Double'"): the reference ran
#: in verify's float64, which the model's own dtype would not meet
_NO_DOUBLE_KERNEL = re.compile(r"got Double\b|not implemented for 'Double'")
#: an eager kernel's refusal of operands of two dtypes, one of them double ("expected m1 and
#: m2 to have the same dtype, but got: float != double"; "expected scalar type Double but found
#: Float"): in a float64 verify, the model's own casts (its bfloat16 autocast) meeting verify's
#: float64
_DTYPE_MISMATCH = re.compile(
    r"(same dtype|scalar type|dtypes? mismatch).*\b[Dd]ouble\b|\b[Dd]ouble\b.*but found"
)


def _run(checks: list[Check], name: str, tolerance: float, fn) -> Any:
    """``fn()``; a :class:`Check` it returns is appended to ``checks``. An exception becomes a
    not-run check named ``name``, its traceback in ``detail`` (returns None)."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - reported as a check that did not run
        from graphflop.runtime.inplace import inplace_reason, inplace_refusal

        if inplace_refusal(e):
            # the reference is eager autograd's: graphflop's functional graphs have no such limit
            why = (
                f"eager autograd, the reference, refuses the model: {inplace_reason(e)}; "
                "graphflop's functional graphs differentiate it, and an out-of-place op there "
                "lets the check run"
            )
            checks.append(Check(name, math.nan, why, tolerance, detail=traceback.format_exc()))
            return None
        msg = " ".join(str(e).split())
        if len(msg) > 600:  # whole sentences up to there: graphflop's errors end in their advice
            msg = msg[:600].rsplit(" ", 1)[0] + " …"
        if _NO_DOUBLE_KERNEL.search(msg):
            msg += f"; {_IN_FLOAT32}"
        tb = traceback.format_exc()
        checks.append(Check(name, math.nan, f"{type(e).__name__}: {msg}", tolerance, detail=tb))
        return None
    if isinstance(out, Check):
        checks.append(out)
    return out
