"""The op database (``graphflop/testing/opdb/``) through the generic checks of
``graphflop/testing/checks.py``, all in float64, one test per (check, case).

Per case: ``flops`` (hand-worked forward FLOPs, FlopCounterMode's matrix FLOPs), ``mm_ratio``
(JVP 3×, backward 2× the forward's matrix FLOPs), ``jvp`` (vs ``torch.func.jvp``), ``fd`` (vs
finite differences), ``vjp`` (vs ``torch.func.grad``), ``dot`` (the dot-product test), ``rules``
(every op has a rule), ``no_backward`` (generated graphs use forward ops only), ``aten`` (the ops
the case claims appear in its graphs). A check a case documents as failing (``OpCase.xfail``) is a
strict xfail. And once: every JVP and transpose rule is run by some case (coverage).
"""

from __future__ import annotations

import pytest

from graphflop.testing import checks
from graphflop.testing.opdb import OP_DB

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")


def cases_for(check: str, cases=OP_DB) -> list:
    """``pytest.param`` per case, strict-xfail where the case documents a bug for ``check``."""
    out = []
    for c in cases:
        reason = checks.expected_failure(c, check)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(c.name, id=c.name, marks=marks))
    return out


@pytest.mark.parametrize("name", cases_for("flops"))
def test_forward_flops(name):
    checks.check_forward_flops(name)


@pytest.mark.parametrize(
    "name", cases_for("mm_ratio", [c for c in OP_DB if checks.has_matrix_ops(c)])
)
def test_matrix_flops_of_jvp_and_backward(name):
    checks.check_matrix_flops_ratio(name)


@pytest.mark.parametrize("name", cases_for("jvp"))
def test_jvp_matches_torch_func(name):
    checks.check_jvp(name)


@pytest.mark.parametrize("name", cases_for("fd"))
def test_jvp_matches_finite_differences(name):
    checks.check_finite_differences(name)


@pytest.mark.parametrize("name", cases_for("vjp"))
def test_vjp_matches_torch_func(name):
    checks.check_vjp(name)


@pytest.mark.parametrize("name", cases_for("dot"))
def test_dot_product(name):
    checks.check_dot_product(name)


@pytest.mark.parametrize("name", cases_for("rules"))
def test_every_op_has_a_rule(name):
    checks.check_rules(name)


@pytest.mark.parametrize("name", cases_for("no_backward"))
def test_generated_graphs_use_forward_ops(name):
    checks.check_forward_ops_only(name)


@pytest.mark.parametrize("name", cases_for("aten"))
def test_case_exercises_its_ops(name):
    checks.check_case_ops(name)


def test_every_derivative_rule_is_exercised():
    checks.check_rule_coverage()


def test_checks_cover_every_xfail_key():
    """Every check an op-database case may document as failing has a check function."""
    from graphflop.testing.opdb import CHECKS as XFAIL_KEYS

    assert set(XFAIL_KEYS) <= set(checks.CHECKS)
    used = {k for c in OP_DB for k in c.xfail} - {"*"}
    assert used <= set(checks.CHECKS)
