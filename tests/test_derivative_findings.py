"""A tester's derivative findings, checked end to end through ``inspect --verify`` (graphflop's
gradient against ``torch.func.grad``, its JVP against ``torch.func.jvp`` or the gradient, all in
float64): a complex Python scalar factor (the cotangent takes its conjugate), a complex input
and a complex parameter, ``F.cosine_similarity`` (ATen's composite, whose norms are clamped under
a C++ ``NoGradGuard``), ``addmm`` with beta/alpha (a crash before), and ``clamp`` with tensor
bounds that cross or meet. The op database holds the per-op cases (``COMPLEX_SCALAR``,
``ADDMM_SCALED``, ``COSINE``)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from graphflop.cli import main

HEADER = "import torch\nfrom torch import nn\nimport torch.nn.functional as F\n\n"


def _inspect(tmp_path: Path, body: str, capsys) -> tuple[int, dict]:
    path = tmp_path / "m.py"
    path.write_text(HEADER + textwrap.dedent(body))
    rc = main(["inspect", f"{path}:M", "--loss", "sum", "--verify", "--format", "json"])
    out, _ = capsys.readouterr()
    return rc, json.loads(out)


def _checks(doc: dict) -> dict[str, bool]:
    """The gradient and JVP checks' results by the first word of their names."""
    return {c["check"].split()[0]: c["ok"] and c["ran"] for c in doc["verify"][:2]}


def _model(forward: str, params: str, inputs: str) -> str:
    return f"""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            {params}

        def forward(self, x):
            return {forward}

    def example_inputs():
        return ({inputs},)
    """


def test_complex_scalar_factors(tmp_path, capsys):
    """``(1j·w).imag`` has gradient +1 per element: the cotangent reaching ``1j·w`` is 1j
    (``imag``'s transpose), times conj(1j) = −1j (PyTorch's gradient of ``w·c`` is
    ``grad·conj(c)``) is 1; graphflop multiplied by 1j and gave −1. ``(w / (1+2j)).imag``
    alike (1j / conj(1+2j) = (−2+1j)/5: gradient −0.4, not +0.4)."""
    body = _model(
        "(1j * self.w).imag + (self.w / (1 + 2j)).imag",
        "self.w = nn.Parameter(torch.randn(3, 4))",
        "torch.randn(3, 4)",
    )
    rc, doc = _inspect(tmp_path, body, capsys)
    assert _checks(doc) == {"gradients": True, "JVP": True}, doc["verify"]
    assert rc == 0


def test_complex_input_phase(tmp_path, capsys):
    """``(x · exp(1j·w)).real`` with a complex64 input x (3, 4): the tester's case."""
    body = _model(
        "(x * torch.exp(1j * self.w)).real",
        "self.w = nn.Parameter(torch.randn(3, 4))",
        "torch.randn(3, 4, dtype=torch.complex64)",
    )
    rc, doc = _inspect(tmp_path, body, capsys)
    assert _checks(doc) == {"gradients": True, "JVP": True}, doc["verify"]
    assert rc == 0


def test_complex_parameter_times_complex_scalar(tmp_path, capsys):
    """A complex parameter ``z · (2−1j)``: the gradient is conj(2−1j)·x = (2+1j)·x; graphflop
    gave (2−1j)·x, equal in the real part, and verify compared only real parts then (it cast
    complex gradients with ``double()``); both fixed, so this fails on either."""
    body = _model(
        "(self.z * (2 - 1j)).real * x",
        "self.z = nn.Parameter(torch.randn(3, 4, dtype=torch.complex64))",
        "torch.randn(3, 4)",
    )
    rc, doc = _inspect(tmp_path, body, capsys)
    assert _checks(doc) == {"gradients": True, "JVP": True}, doc["verify"]
    assert rc == 0


def test_verify_compares_complex_values_whole():
    """A complex value off by its conjugate is off (the real parts agree)."""
    from graphflop.runtime.verify import norm64, rel_error

    a = torch.tensor([2 + 1j, 1 - 3j], dtype=torch.complex64)
    # ‖a − conj(a)‖ = ‖(2j, −6j)‖ = √40; ‖a‖ = √15
    assert abs(rel_error(a, a.conj()) - (40 / 15) ** 0.5) < 1e-6
    assert abs(norm64([a]) - 15**0.5) < 1e-6


def test_cosine_similarity_of_two_linears(tmp_path, capsys):
    """The tester's model: gradients 11-21 % off per parameter (the norms' derivative dropped)
    and the forward incomplete (``clamp_min.Tensor`` had no cost rule)."""
    body = _model(
        "F.cosine_similarity(self.a(x), self.b(x), dim=-1)",
        "self.a = nn.Linear(8, 8)\n            self.b = nn.Linear(8, 8)",
        "torch.randn(4, 8)",
    )
    rc, doc = _inspect(tmp_path, body, capsys)
    assert _checks(doc) == {"gradients": True, "JVP": True}, doc["verify"]
    assert doc["uncounted"] == [] and doc["totals"]["forward"]["complete"]
    assert rc == 0


def test_cosine_similarity_clamped_matches_eager_backward(tmp_path, capsys):
    """Every norm below eps (clamped): eager's gradient still goes through the norm (the clamp
    under ``NoGradGuard`` is not recorded), and graphflop's too (the JVP check compares with
    ``torch.func.jvp``, which sees the clamp here, so it is left out)."""
    body = _model(
        "nn.CosineSimilarity(dim=1, eps=50.0)(self.a(x), x * self.v)",
        "self.a = nn.Linear(8, 8)\n            self.v = nn.Parameter(torch.randn(8))",
        "torch.randn(4, 8)",
    )
    rc, doc = _inspect(tmp_path, body, capsys)
    assert _checks(doc)["gradients"], doc["verify"]


def test_addmm_with_beta_and_alpha(tmp_path, capsys):
    """``addmm(b, x, w, beta=0.5, alpha=2.0)`` ended in 'internal error: NotImplementedError';
    forward FLOPs as baddbmm's decomposition counts them: mm 2·4·8·5 = 320, alpha· 20, beta·b 5,
    add 20, the sum loss 20 = 385."""
    body = _model(
        "torch.addmm(self.b, x, self.w, beta=0.5, alpha=2.0)",
        "self.w = nn.Parameter(torch.randn(8, 5))\n            self.b = nn.Parameter(torch.randn(5))",
        "torch.randn(4, 8)",
    )
    rc, doc = _inspect(tmp_path, body, capsys)
    assert _checks(doc) == {"gradients": True, "JVP": True}, doc["verify"]
    assert doc["totals"]["forward"]["flops"] == 385, doc["totals"]["forward"]
    assert rc == 0


@pytest.mark.slow  # about 2.5 s (moved out of the default suite: its 300 s budget)
def test_clamp_with_crossed_and_equal_tensor_bounds(tmp_path, capsys):
    """Eager's ``clamp_backward_min_max``: where lo > hi the output is hi and only hi gets a
    gradient; where lo == hi > x none of x, lo, hi does. Bounds crossed on half the elements
    (hi = lo ∓ 1) and equal on the last row."""
    body = _model(
        "torch.clamp(x * self.w, min=self.lo, max=self.hi)",
        "self.w = nn.Parameter(torch.randn(4, 6))\n"
        "            self.lo = nn.Parameter(torch.randn(4, 6))\n"
        "            step = torch.tensor([1.0, -1.0]).repeat(12).view(4, 6)\n"
        "            step[3] = 0.0\n"
        "            self.hi = nn.Parameter(self.lo.detach() + step)",
        "torch.randn(4, 6)",
    )
    rc, doc = _inspect(tmp_path, body, capsys)
    assert _checks(doc)["gradients"], doc["verify"]


def test_clamp_min_tensor_is_costed():
    """``clamp_min.Tensor`` (ATen's composites clamp with a scalar tensor under NoGradGuard):
    1 FLOP per output element, as clamp."""
    from graphflop.ops.registry import lookup

    aten = torch.ops.aten
    out = torch.empty(2, 1, 4)
    for op in (aten.clamp_min.Tensor, aten.clamp_max.Tensor):
        assert lookup(op).cost(out, out, torch.tensor(1e-8)).flops == 8
