"""``inspect --verify`` must not report a pass it did not earn: the example's masks and ids are
kept (random ones can mask whole rows: NaN), a NaN or infinity in a compared value fails its
check, and a check that did not run counts as not passed (exit 1)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from graphflop.cli import main
from graphflop.meta import SIGNATURE

HEADER = "import torch\nfrom torch import nn\nimport torch.nn.functional as F\n\n"

PADMASK = """
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, pad):  # pad: bool (N, T), True = ignore that key
            return self.mha(x, x, x, key_padding_mask=pad)[0].mean(1)

    def example_inputs():
        return (torch.randn(4, 2, 8), torch.tensor([[False, False]] * 3 + [[False, True]]))
    """


def _file(tmp_path: Path, body: str, name: str = "m") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(body))
    return f"{path}:M"


def _verify(spec: str, capsys, *extra: str) -> tuple[int, dict, list[str]]:
    rc = main(["inspect", spec, "--verify", "--format", "json", *extra])
    out, err = capsys.readouterr()
    return rc, json.loads(out), err.splitlines()


class PadMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x, pad):
        return self.mha(x, x, x, key_padding_mask=pad)[0].mean(1)


def _padmask_trace():
    from graphflop.frontend.trace import trace

    torch.manual_seed(0)
    model = PadMask().double()
    pad = torch.tensor([[False, False]] * 3 + [[False, True]])
    fwd = trace(model, (torch.randn(4, 2, 8, dtype=torch.float64), pad), loss="sum")
    return model, pad, fwd


def test_a_real_mask_of_the_example_is_kept_a_fake_one_is_not():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphflop.runtime.verify import real_arguments

    model, pad, fwd = _padmask_trace()
    x_name, pad_name = fwd.meta[SIGNATURE].inputs
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    values = real_arguments(fwd, model, examples=(x, pad))
    assert torch.equal(values[pad_name], pad)
    assert not torch.equal(values[x_name], x)  # floating inputs stay random draws
    with FakeTensorMode():
        fake = torch.zeros(4, 2, dtype=torch.bool)
    drawn = real_arguments(fwd, model, examples=(x, fake))[pad_name]
    assert drawn.dtype == torch.bool and drawn.shape == (4, 2)
    # a meta example or one of another shape (--batch) cannot give values: drawn instead
    meta = torch.zeros(4, 2, dtype=torch.bool, device="meta")
    assert torch.equal(real_arguments(fwd, model, examples=(x, meta))[pad_name], drawn)
    small = torch.zeros(2, 2, dtype=torch.bool)
    assert torch.equal(real_arguments(fwd, model, examples=(x, small))[pad_name], drawn)


def test_gradients_of_the_example_mask_are_compared_and_pass():
    """With the example's mask (no row fully masked) PyTorch's own gradients are finite and
    nonzero for every parameter (4 tensors, 288 numbers: in_proj 24×8 = 192 and its bias 24,
    out_proj 8×8 = 64 and its bias 8), and the check compares them: it names a parameter, not
    "no parameters"."""
    from graphflop.ad.vjp import build_vjp
    from graphflop.runtime.verify import verify_gradients

    model, pad, fwd = _padmask_trace()
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    eager = PadMask().double()
    eager.load_state_dict(model.state_dict())
    eager(x, pad).sum().backward()
    assert all(p.grad.isfinite().all() and p.grad.abs().sum() > 0 for p in eager.parameters())
    c = verify_gradients(fwd, build_vjp(fwd), model, examples=(x, pad))
    assert c.ran and c.ok and c.worst_rel_error < 1e-10, c
    assert c.where.startswith("at mha."), c


def test_nan_gradients_in_the_same_places_are_not_comparable():
    """A mask hiding every key of a row makes attention NaN, in PyTorch's reference and in
    graphflop's graph alike, at the same elements: the check is NOT COMPARABLE (not passed; it
    once said passed, 0.0e+00, no parameters: NaN compared false with the running worst error;
    then FAILED with an infinite error, though graphflop agrees with PyTorch)."""
    from graphflop.ad.vjp import build_vjp
    from graphflop.runtime.verify import verify_gradients

    model, _, fwd = _padmask_trace()
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    hidden = torch.tensor([[True, True]] + [[False, False]] * 3)  # row 0: every key hidden
    c = verify_gradients(fwd, build_vjp(fwd), model, examples=(x, hidden))
    assert c.ran and not c.ok and not c.comparable and math.isnan(c.worst_rel_error), c
    assert "graphflop's and the reference's gradients are NaN or inf at the same" in c.where, c
    assert "of mha." in c.where, c
    assert ": NOT COMPARABLE (" in c.line() and "passed" not in c.line()
    d = c.to_dict()
    assert d["ran"] and not d["ok"] and not d["comparable"] and d["worst_rel_error"] is None
    json.dumps(d, allow_nan=False)  # JSON has no NaN


def _scaled_backward(monkeypatch, change):
    """Make graphflop's backward graph's gradients ``change(g)`` when the check runs them."""
    from graphflop.runtime import verify

    real = verify.run_backward
    monkeypatch.setattr(verify, "run_backward", lambda *a: [change(g) for g in real(*a)])


def test_same_place_nans_do_not_hide_a_wrong_finite_element(monkeypatch):
    """The finite elements are still compared: graphflop's gradient twice PyTorch's there (its
    NaNs kept) FAILS the check, with a relative error of 1 (‖2g − g‖/‖g‖)."""
    from graphflop.ad.vjp import build_vjp
    from graphflop.runtime.verify import verify_gradients

    model, _, fwd = _padmask_trace()
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    hidden = torch.tensor([[True, True]] + [[False, False]] * 3)
    _scaled_backward(monkeypatch, lambda g: 2 * g)
    c = verify_gradients(fwd, build_vjp(fwd), model, examples=(x, hidden))
    assert c.comparable and not c.ok and c.worst_rel_error == pytest.approx(1.0), c


def test_nans_in_different_places_fail(monkeypatch):
    """A NaN in graphflop's gradient where PyTorch's is finite fails the check (infinite
    error): only NaNs at the same elements are not comparable."""
    from graphflop.ad.vjp import build_vjp
    from graphflop.runtime.verify import verify_gradients

    def one_nan(g):
        g = g.clone()
        g.view(-1)[0] = math.nan
        return g

    model, pad, fwd = _padmask_trace()
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    _scaled_backward(monkeypatch, one_nan)
    c = verify_gradients(fwd, build_vjp(fwd), model, examples=(x, pad))
    assert c.comparable and not c.ok and c.worst_rel_error == math.inf, c
    assert "NaN or inf in graphflop's value" in c.where, c


WHERE_TRAP = """
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):  # sqrt(y) is NaN where y < 0, the branch torch.where drops
            y = self.fc(x)
            return torch.where(y > 0, torch.sqrt(y), y)

    def example_inputs():
        return (torch.randn(8, 4),)
    """


def test_torch_where_trap_is_not_comparable_from_the_cli(tmp_path, capsys):
    """The adversarial pass's finding: --verify said FAILED with an infinite error, though
    PyTorch's gradient is NaN at the same elements (sqrt'(y) = inf at y < 0, times the 0 the
    where's backward gives the dropped branch: NaN). Now: NOT COMPARABLE for the gradients and
    for the forward-gradient check (its target gradient is NaN); the JVP (a forward-mode where
    selects the tangent of the branch it takes) passes; exit 1: not every check passed."""
    rc, doc, err = _verify(_file(tmp_path, WHERE_TRAP), capsys, "--verify-samples", "16")
    grad, jvp, fg = doc["verify"]
    assert not grad["comparable"] and not grad["ok"] and grad["worst_rel_error"] is None
    assert "NaN or inf at the same" in grad["where"] and "of fc.weight" in grad["where"]
    assert jvp["comparable"] and jvp["ok"]
    assert not fg["comparable"] and "tested against is NaN or inf" in fg["where"], fg
    assert [line.split(": ")[1] for line in err if ": NOT COMPARABLE (" in line] == [
        "gradients vs torch.func.grad",
        "forward-gradient estimate unbiased over 16 directions",
    ], err
    assert "inf (tolerance" not in "\n".join(err)
    assert "verify: 1 of 3 checks passed" in err
    assert rc == 1


def test_same_nonfinite():
    from graphflop.runtime.verify import same_nonfinite

    nan, inf = math.nan, math.inf
    t = torch.tensor
    assert same_nonfinite(t([1.0, nan, inf]), t([2.0, nan, inf]))
    assert not same_nonfinite(t([1.0, 2.0]), t([1.0, 2.0]))  # nothing non-finite
    assert not same_nonfinite(t([nan, 1.0]), t([1.0, nan]))  # other places
    assert not same_nonfinite(t([inf, 1.0]), t([-inf, 1.0]))  # other signs
    assert not same_nonfinite(t([nan, 1.0]), t([inf, 1.0]))  # NaN against inf
    assert not same_nonfinite(t([nan]), t([nan, nan]))  # other shapes


def test_nan_loss_tangent_fails_the_jvp_check():
    from graphflop.ad.jvp import build_jvp
    from graphflop.runtime.verify import verify_jvp

    model, _, fwd = _padmask_trace()
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    hidden = torch.tensor([[True, True]] + [[False, False]] * 3)
    c = verify_jvp(fwd, build_jvp(fwd, "params"), model, examples=(x, hidden))
    assert c.ran and not c.ok and "NaN or inf" in c.where, c


def test_padmask_model_verifies_from_the_cli(tmp_path, capsys):
    rc, doc, err = _verify(_file(tmp_path, PADMASK), capsys, "--verify-samples", "16")
    grad, jvp, fg = doc["verify"]
    assert grad["ran"] and grad["ok"] and grad["where"].startswith("at mha."), grad
    assert jvp["ran"] and jvp["ok"] and fg["ran"] and fg["ok"]
    assert "verify: 3 of 3 checks passed" in err
    assert rc == 0


SCALAR_AUX = """
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            y = self.fc(x)
            return (y > 0).sum(), y  # a 0-d integer count first, then the logits

    def example_inputs():
        return (torch.randn(2, 6),)
    """


def test_targets_come_from_the_first_floating_output_not_a_0d_count(tmp_path, capsys):
    """The loss (cross-entropy, logits (2, 3)) is computed from the first floating output, so
    the targets are 2 class indices in [0, 3); the 0-d count first used to raise IndexError
    in all three checks."""
    from graphflop.frontend.trace import trace
    from graphflop.runtime.verify import real_arguments

    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            y = self.fc(x)
            return (y > 0).sum(), y

    model = M()
    fwd = trace(model, (torch.randn(2, 6),))
    (target,) = fwd.meta[SIGNATURE].targets
    t = real_arguments(fwd, model)[target]
    assert t.shape == (2,) and int(t.min()) >= 0 and int(t.max()) < 3
    rc, doc, err = _verify(_file(tmp_path, SCALAR_AUX), capsys, "--verify-samples", "16")
    assert [c["ok"] and c["ran"] for c in doc["verify"]] == [True, True, True], doc["verify"]
    assert "verify: 3 of 3 checks passed" in err
    assert rc == 0


COMPLEX_OUT = """
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.fft.fft(self.fc(x))  # a complex (2, 8) output

    def example_inputs():
        return (torch.randn(2, 8),)
    """


def test_sum_loss_of_a_complex_output_is_real_and_verifies(tmp_path, capsys):
    """Noticed in testing: the sum of a complex output was a complex loss, which has no
    gradient (torch.func.grad refused it, so --verify's gradient check did not run). It is the
    sum of the real and imaginary parts: view_as_real 0 FLOPs, then a sum over 2·8·2 = 32
    elements, 32 FLOPs (docs/flops_conventions.md: 1 per input element), reading 32 float32 = 128 bytes."""
    rc, doc, err = _verify(_file(tmp_path, COMPLEX_OUT), capsys, "--verify-samples", "16")
    assert doc["loss"] == "sum"
    assert (doc["totals"]["loss"]["flops"], doc["totals"]["loss"]["bytes_read"]) == (32, 128)
    assert [c["ok"] and c["ran"] for c in doc["verify"]] == [True, True, True], doc["verify"]
    assert "verify: 3 of 3 checks passed" in err and "Warning" not in err
    assert rc == 0


DATACLASS_OUT = """
    from dataclasses import dataclass


    @dataclass
    class Out:
        count: int
        logits: torch.Tensor


    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return Out(7, self.fc(x))

    def example_inputs():
        return (torch.randn(2, 4),)
    """


def test_a_plain_dataclass_output_is_read_field_by_field(tmp_path, capsys):
    """Tester's finding: a @dataclass holding the logits was refused with 'no
    tensor in the model's output'. Its (2, 3) logits get the cross-entropy loss: 2·3 log-softmax
    and gather work as for a plain tensor output (the FLOPs equal the tensor model's)."""
    rc, doc, err = _verify(_file(tmp_path, DATACLASS_OUT), capsys, "--verify-samples", "16")
    assert doc["loss"] == "cross_entropy" and doc["params"] == 4 * 3 + 3
    assert [c["ok"] and c["ran"] for c in doc["verify"]] == [True, True, True], doc["verify"]
    plain = DATACLASS_OUT.replace("return Out(7, self.fc(x))", "return self.fc(x)")
    _, ref, _ = _verify(_file(tmp_path, plain, "plain"), capsys, "--verify-samples", "16")
    assert doc["totals"] == ref["totals"]
    assert rc == 0


def test_debug_prints_the_traceback_of_a_check_that_errored(tmp_path, capsys, monkeypatch):
    import graphflop.runtime.verify as verify

    def broken(*a, **k):
        raise ZeroDivisionError("deliberate")

    monkeypatch.setattr(verify, "verify_gradients", broken)
    spec = _file(tmp_path, SCALAR_AUX)
    rc, doc, err = _verify(spec, capsys, "--verify-samples", "0")
    assert rc == 1 and not doc["verify"][0]["ran"]
    assert "Traceback" not in "\n".join(err)  # without --debug: one line
    assert "verify: gradients vs torch.func.grad: NOT RUN (ZeroDivisionError: deliberate)" in err
    rc, doc, err = _verify(spec, capsys, "--verify-samples", "0", "--debug")
    text = "\n".join(err)
    assert rc == 1 and "Traceback (most recent call last):" in text
    assert "in broken" in text and text.count("ZeroDivisionError: deliberate") == 2
    assert "detail" not in doc["verify"][0]  # not in the JSON


@torch.library.custom_op("gfverifytrust::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    """A custom op graphflop has no rule for: the backward and the JVP stop at it."""
    return 2 * x


@twice.register_fake
def _(x):
    return torch.empty_like(x)


class GapNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(twice(torch.relu(self.fc1(x))))


def example_inputs():
    return (torch.randn(3, 8),)


def test_checks_a_gap_stops_are_not_run_and_exit_1(tmp_path, capsys):
    """Every check stopped by an op without a rule: three NOT RUN lines, "0 of 3 checks passed"
    and exit 1 (it said "0 of 0 checks passed" and exited 0), as for attention dropout."""
    path = tmp_path / "gap.py"
    path.write_text("from test_verify_trust import GapNet, example_inputs  # noqa: F401\n")
    out = tmp_path / "out.json"
    rc = main(["inspect", f"{path}:GapNet", "--loss", "sum", "--verify", "--json", str(out)])
    err = capsys.readouterr().err.splitlines()
    lines = [x for x in err if x.startswith("verify: ")]
    op = "gfverifytrust.twice.default"
    assert lines == [
        f"verify: gradients vs torch.func.grad: NOT RUN (the backward stops at ops without rules ({op}))",
        f"verify: JVP loss tangent vs torch.func.jvp: NOT RUN (the JVP stops at ops without rules ({op}))",
        "verify: forward-gradient estimate unbiased over 100 directions: NOT RUN (it needs a complete JVP and backward)",
        "verify: 0 of 3 checks passed",
    ], err
    doc = json.loads(out.read_text())
    assert [(c["ran"], c["ok"]) for c in doc["verify"]] == [(False, False)] * 3
    assert op in doc["verify_note"]  # the gap note stays in the JSON
    assert rc == 1


def test_no_check_at_all_is_not_a_pass(tmp_path, capsys, monkeypatch):
    import graphflop.runtime.verify_all as verify_all

    monkeypatch.setattr(verify_all, "verify_analysis", lambda *a, **k: [])
    rc, _, err = _verify(_file(tmp_path, SCALAR_AUX), capsys)
    assert "verify: 0 of 0 checks passed" in err
    assert rc == 1


class SoftmaxRows(nn.Module):
    """softmax(x·xᵀ) summed over its rows: identically 1, so the loss is 2·5 = 10 and its
    tangent along any direction is exactly 0."""

    def forward(self, x):
        return torch.softmax(x @ x.transpose(-1, -2), -1).sum(-1)


def _jvp_check(model, x, **kw):
    from graphflop.ad.jvp import build_jvp
    from graphflop.frontend.trace import trace
    from graphflop.runtime.verify import verify_jvp

    fwd = trace(model, (x,), loss="sum")
    return verify_jvp(fwd, build_jvp(fwd, "inputs"), model, **kw)


def test_a_tangent_zero_in_exact_arithmetic_passes_on_the_floor(monkeypatch):
    """Both tangents are rounding noise around 0 (|·| < 1e-13 with |L| = 10), 100 %+ apart
    relative to each other: the plain relative error failed (3.6 in the tester's run); the
    floor 1024·eps·|L|·‖ẋ‖/‖x‖ (≈ 1024 · 2.2e-16 · 10 · 1 ≈ 2.3e-12 absolute) passes them."""
    import graphflop.runtime.verify as verify
    import graphflop.runtime.verify_tangent as verify_tangent

    seen = {}
    real_error = verify_tangent.tangent_error

    def spy(got, ref, floor):
        seen.update(got=float(got), ref=float(ref), floor=floor)
        return real_error(got, ref, floor)

    monkeypatch.setattr(verify_tangent, "tangent_error", spy)
    c = _jvp_check(SoftmaxRows(), torch.randn(2, 5, 3, dtype=torch.float64))
    assert c.ran and c.ok, c
    assert abs(seen["got"]) < 1e-13 and abs(seen["ref"]) < 1e-13
    assert verify.rel_error(torch.tensor(seen["got"]), torch.tensor(seen["ref"])) > 1e-4
    # the floor is worked out from real_arguments' x and direction: |L| = 10 exactly
    # (verify_jvp draws its direction from a generator seeded 1, real_arguments' x from 0)
    (x,) = verify.real_arguments(*_trace_and_model()).values()
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    eps = 2.220446049250313e-16
    assert seen["floor"] == pytest.approx(1024 * eps * 10 * float(v.norm() / x.norm()) / 1e-4)


def _trace_and_model():
    from graphflop.frontend.trace import trace

    model = SoftmaxRows()
    return trace(model, (torch.randn(2, 5, 3, dtype=torch.float64),), loss="sum"), model


def test_a_wrong_tangent_still_fails(monkeypatch):
    """Graphflop's loss tangent doubled (a JVP rule scaling by 2) fails where the true tangent
    is not zero (relative error 1), and an error of 1e-6 where it is zero fails too: the floor
    there is ≈ 2.3e-12 absolute (2.3e-8 as the denominator at tolerance 1e-4)."""
    import graphflop.runtime.verify_tangent as verify
    from graphflop.meta import JVP

    real_run = verify.run_jvp

    def doubled(jvp, values, tangents):
        outs = list(real_run(jvp, values, tangents))
        i = jvp.meta[JVP].primal_outputs
        outs[i] = 2 * outs[i]
        return tuple(outs)

    class FirstColumn(nn.Module):  # softmax's first column summed: a tangent far from zero
        def forward(self, x):
            return torch.softmax(x @ x.transpose(-1, -2), -1)[..., 0]

    x = torch.randn(2, 5, 3, dtype=torch.float64)
    assert _jvp_check(FirstColumn(), x).ok
    monkeypatch.setattr(verify, "run_jvp", doubled)
    c = _jvp_check(FirstColumn(), x)
    assert c.ran and not c.ok and c.worst_rel_error == pytest.approx(1.0, rel=1e-9), c
    floor = verify.tangent_floor(
        torch.float64, 10.0, [torch.ones(30, dtype=torch.float64)], [torch.ones(30)], 1e-4
    )
    assert floor == pytest.approx(1024 * 2.220446049250313e-16 * 10 / 1e-4)
    assert verify.tangent_error(torch.tensor(1e-6), torch.tensor(0.0), floor) > 40  # ≈ 44
    assert verify.tangent_error(torch.tensor(1e-13), torch.tensor(-1e-13), floor) < 1e-4


class _SpatialMeanOfInstanceNorm(nn.Module):
    """Instance norm without affine, then the spatial mean: identically 0 in exact arithmetic,
    so the loss does not depend on the parameters and every gradient is rounding noise."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.InstanceNorm2d(4)

    def forward(self, x):
        return self.norm(self.conv(x)).mean((2, 3))


def test_a_gradient_of_rounding_noise_passes_and_a_wrong_gradient_still_fails(monkeypatch):
    """Tester's finding: the gradient check's floor scaled with ‖∇L‖, itself noise here, and
    compared noise with noise (relative error 2-3: FAILED). The floor's scale is now
    max(‖∇L‖, |L|/‖p‖); the forward-gradient check compares its estimate with the noise level."""
    import graphflop.runtime.verify as verify
    from graphflop.ad.vjp import build_vjp
    from graphflop.frontend.trace import trace
    from graphflop.runtime.verify_fg import verify_forward_gradient

    torch.manual_seed(0)
    model = _SpatialMeanOfInstanceNorm().double()
    fwd = trace(model, (torch.randn(2, 3, 6, 6, dtype=torch.float64),))
    bwd = build_vjp(fwd)
    check = verify.verify_gradients(fwd, bwd, model)
    assert check.ok, check.line()
    fg = verify_forward_gradient(fwd, model, samples=20)
    assert fg.ok and "rounding noise" in fg.where, fg.line()
    # a real gradient off by 1 % still fails (a Linear head makes the gradient real)
    model2 = nn.Sequential(_SpatialMeanOfInstanceNorm(), nn.Linear(4, 3)).double()
    fwd2 = trace(model2, (torch.randn(2, 3, 6, 6, dtype=torch.float64),))
    bwd2 = build_vjp(fwd2)
    real_backward = verify.run_backward
    monkeypatch.setattr(
        verify, "run_backward", lambda *a, **k: [g * 1.01 for g in real_backward(*a, **k)]
    )
    wrong = verify.verify_gradients(fwd2, bwd2, model2)
    assert not wrong.ok and wrong.worst_rel_error == pytest.approx(0.01, rel=1e-6)


def test_not_run_reason_keeps_the_advice():
    """A tester's finding: NOT RUN reasons were cut at 160 characters, mid-word, losing the
    advice graphflop's errors end with. Up to 600 characters now stay whole; beyond, the cut
    falls between words and says so."""
    import math

    from graphflop.runtime.verify_all import _run

    advice = "give inputs in the parameters' dtype (--dtype), or cast them in forward"
    long = "aten::mm multiplies complex128 and float64 operands " * 3 + advice
    checks: list = []
    _run(checks, "trace", 1e-4, lambda: (_ for _ in ()).throw(RuntimeError(long)))
    assert checks[0].where == f"RuntimeError: {long}" and math.isnan(checks[0].worst_rel_error)
    _run(checks, "trace", 1e-4, lambda: (_ for _ in ()).throw(RuntimeError("word " * 200)))
    assert checks[1].where.endswith("word …") and len(checks[1].where) < 640


INT8_FROZEN = """
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.qw = nn.Parameter(torch.randint(-128, 127, (8, 8), dtype=torch.int8),
                                   requires_grad=False)
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(x @ self.qw.float().t())

    def example_inputs():
        return (torch.randn(2, 8),)
    """


def test_a_frozen_int8_parameter_stays_int8_and_verifies(tmp_path, capsys):
    """A tester's finding: --verify-dtype float32 cast every parameter with the first one's
    dtype (int8 here: 'nn.Module.to only accepts floating point or complex dtypes') and handed
    the int8 weight to torch.func to differentiate. Now only floating (and complex) tensors
    change dtype, and the frozen int8 weight goes into the reference as a constant."""
    rc, doc, err = _verify(_file(tmp_path, INT8_FROZEN), capsys, "--verify-dtype", "float32")
    assert [c["ok"] and c["ran"] for c in doc["verify"]] == [True, True, True], doc["verify"]
    assert rc == 0


def test_cast_model_keeps_complex_and_integer_tensors():
    """``nn.Module.to(float64)`` turns a complex64 parameter real (dropping its imaginary
    part); verify's cast makes it complex128 and leaves an int8 buffer alone."""
    from graphflop.runtime.verify import cast_model

    m = nn.Module()
    m.w = nn.Parameter(torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
    m.v = nn.Parameter(torch.ones(2))
    m.register_buffer("q", torch.tensor([5, -3], dtype=torch.int8))
    c = cast_model(m, torch.float64)
    assert (c.w.dtype, c.v.dtype, c.q.dtype) == (torch.complex128, torch.float64, torch.int8)
    assert torch.equal(c.w.detach(), m.w.detach().to(torch.complex128))
    assert m.w.dtype == torch.complex64  # a copy


OLD_STYLE_FUNCTION = """
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g


    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return Square.apply(self.fc(x))

    def example_inputs():
        return (torch.randn(3, 8),)
    """

STRAIGHT_THROUGH = """
    class RoundSTE(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return torch.round(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g  # straight through: not the derivative of round


    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.out = nn.Linear(4, 2)

        def forward(self, x):
            return self.out(RoundSTE.apply(self.fc(x) * 4))

    def example_inputs():
        return (torch.randn(3, 8),)
    """


def test_a_custom_autograd_function_is_traced_through_its_forward(tmp_path, capsys):
    """A tester's finding (transformers' Bloom, GeLUFunction): a model calling a custom
    autograd.Function could not be traced ('must override the setup_context staticmethod').
    Its forward's ops are traced, its own backward gives the gradient. By hand: fc 2*3*8*4 =
    192 + bias 12 = 204 FLOPs; Square's x * x, 12 elements, 12 FLOPs (in the model's own
    row). The gradients verify against eager autograd running Square's backward; Square has
    no jvp, so the JVP (and the forward gradient) is incomplete, naming it, and not checked."""
    rc, doc, err = _verify(_file(tmp_path, OLD_STYLE_FUNCTION), capsys)
    layers = {row["name"]: row for row in doc["layers"]}
    assert layers["fc"]["forward_flops"] == 204
    assert layers["(model)"]["forward_flops"] == 12
    checks = {c["check"].split(" vs")[0]: c for c in doc["verify"]}
    assert checks["gradients"]["ran"] and checks["gradients"]["ok"], checks
    assert not checks["JVP loss tangent"]["ran"]
    assert "autograd.Function Square" in checks["JVP loss tangent"]["where"]
    assert doc["totals"]["backward"]["complete"] and not doc["totals"]["jvp"]["complete"]
    assert any("autograd.Function Square has no jvp" in e for e in err)
    assert rc == 1


@pytest.mark.slow  # about 10 s; run in CI with -m slow
def test_a_straight_through_function_passes_the_gradient_check(tmp_path, capsys):
    """A straight-through estimator's backward is not the derivative of its forward (round:
    zero almost everywhere); graphflop's backward is the Function's own (the identity), as
    the reference's (torch.func runs the class's backward), and --verify passes."""
    rc, doc, err = _verify(_file(tmp_path, STRAIGHT_THROUGH), capsys)
    grad = next(c for c in doc["verify"] if c["check"].startswith("gradients"))
    assert grad["ran"] and grad["ok"], grad
    assert doc["totals"]["backward"]["complete"]
    assert rc == 1  # RoundSTE has no jvp: the JVP check is not run


def test_gap_reasons_names_uncounted_ops_when_no_rule_gap_cuts_the_backward():
    """A backward cut short with no derivative gap (an op without a cost rule, say) names the
    uncounted ops: the note used to read "the backward stops at " with nothing after it."""
    from types import SimpleNamespace as NS

    from graphflop.runtime.verify_all import gap_reasons

    cut = NS(complete=False)
    report = NS(
        totals=NS(backward=cut, jvp=cut),
        derivative_gaps=[],
        uncounted=[NS(op="aten.foo.default", missing=("cost",))],
    )
    assert gap_reasons(report) == {
        "gradients": "the backward stops at ops the analysis could not count: "
        "aten.foo.default (no cost)",
        "jvp": "the JVP stops at ops the analysis could not count: aten.foo.default (no cost)",
        "forward_gradient": "it needs a complete JVP and backward",
    }


@pytest.mark.parametrize(
    "msg",
    [
        "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double",  # _grouped_mm
        "\"addmm_impl_cpu_\" not implemented for 'Double'",
    ],
)
def test_a_kernel_refusing_float64_names_the_float32_verify(msg):
    """A kernel with no float64 form (``torch._grouped_mm``, which transformers' batched
    experts call: Qwen2-MoE under ``--verify``) stops verify's float64 reference; the not-run
    check says to verify in float32. Other errors get no such advice."""
    from graphflop.runtime.verify_all import _run

    def refuse(m):
        def fn():
            raise RuntimeError(m)

        return fn

    checks: list = []
    assert _run(checks, "gradients", 1e-4, refuse(msg)) is None
    assert checks[0].where.endswith("; verify in float32 (--verify-dtype float32)"), checks[0]
    _run(checks, "gradients", 1e-4, refuse("shape '[2, 3]' is invalid for input of size 5"))
    assert "--verify-dtype" not in checks[1].where
