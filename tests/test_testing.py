"""graphflop.testing: the rule-table context managers restore the table exactly."""

from __future__ import annotations

import pytest
import torch

import graphflop
from graphflop.meta import NodeCost
from graphflop.ops import all_rules, has_rule
from graphflop.testing import restored_rules, temporary_rule, without_rule

I0 = torch.ops.aten.special_i0e.default  # an op graphflop has no rule for
RELU = torch.ops.aten.relu.default  # one it has


def _cost(out, *args, **kwargs):
    return NodeCost(flops=7)


def test_temporary_rule_adds_then_removes():
    assert not has_rule(I0)
    before = all_rules()
    with temporary_rule(I0, cost=_cost, family="elementwise") as rule:
        assert all_rules()[I0] is rule
        assert (rule.family, rule.bytes, rule.jvp, rule.transpose) == (
            "elementwise",
            "compute",
            None,
            None,
        )
    assert all_rules() == before


def test_temporary_rule_replaces_then_restores_even_on_error():
    original = all_rules()[RELU]
    with pytest.raises(RuntimeError, match="boom"):
        with temporary_rule(RELU, cost=_cost):
            assert all_rules()[RELU].cost is _cost
            raise RuntimeError("boom")
    assert all_rules()[RELU] is original


def test_temporary_rule_rejects_an_unknown_family_and_changes_nothing():
    before = all_rules()
    with pytest.raises(ValueError, match="unknown op family"):
        with temporary_rule(I0, cost=_cost, family="nonsense"):
            pass
    assert all_rules() == before


def test_without_rule_removes_then_restores():
    original = all_rules()[RELU]
    with without_rule(RELU):
        assert not has_rule(RELU)
        graphflop.register_rule(RELU, cost=_cost)  # dropped on leaving the block
    assert all_rules()[RELU] is original
    with without_rule(I0):  # an op without a rule stays without one
        graphflop.register_rule(I0, cost=_cost)
    assert not has_rule(I0)


def test_restored_rules_undoes_every_change():
    before = all_rules()
    with restored_rules():
        graphflop.register_rule(I0, cost=_cost)
        with without_rule(RELU):
            pass
        graphflop.register_rule(RELU, cost=_cost, override=True)  # relu has a rule already
        assert all_rules() != before
    assert all_rules() == before
