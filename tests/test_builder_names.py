"""Shortcuts the derivative builders take around fx give what fx gives: a placeholder's name
(:func:`graphflop.ad.builder.placeholder`) and the fake mode of a graph's values
(:func:`graphflop.meta.fake_mode_of`, which reads the values only up to the first fake tensor)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph

from graphflop.ad.builder import placeholder
from graphflop.meta import fake_mode_of

# names fx keeps, names it numbers (taken before) and names it converts (upper case: snake
# case then lower case; ``__magic__``: stripped)
NAMES = ["args_0", "t_addmm_5", "x", "x", "x_1", "p_model_W_q", "p_model_qW", "__y__", "y", "_1"]


def test_placeholder_names_as_fx():
    ours, theirs = Graph(), Graph()
    for name in NAMES:
        a, b = placeholder(ours, name), theirs.placeholder(name)
        assert (a.op, a.target, a.name) == (b.op, b.target, b.name)
    # what fx made of them, worked out by hand from its rules
    assert [n.name for n in ours.nodes] == [
        "args_0",
        "t_addmm_5",
        "x",
        "x_1",  # "x" taken: numbered
        "x_2",  # "x_1" taken: the next number
        "p_model_w_q",  # lower case
        "p_model_q_w",  # "qW" snake-cased ("q_W"), then lower case
        "y",  # "__y__" stripped
        "y_1",
        "_1",
    ]


def test_fake_mode_of_breadth_first_and_lazy():
    m1, m2 = FakeTensorMode(), FakeTensorMode()
    with m1:
        a = torch.empty(2)
    with m2:
        b = torch.empty(2)
    # every value before those nested in them: b (a value) before a (nested in an earlier one)
    assert fake_mode_of([(a,), b]) is m2
    assert fake_mode_of([1, [[a]], [b]]) is m2  # b one level down, a two
    assert fake_mode_of([1, [[a]]]) is m1
    assert fake_mode_of([1, None, [2]]) is None

    def values():
        yield None
        yield b
        raise AssertionError("read past the first fake tensor")

    assert fake_mode_of(values()) is m2


def test_name_plan_takes_names_as_fx_one_by_one():
    """:class:`graphflop.ad.builder.NamePlan` (a call's names a base at a time) gives the names
    fx gives nodes made one after the other with them (``_Namespace.create_name`` of each) and
    leaves its namespace as fx does, whatever is taken already."""
    import random

    from graphflop.ad.builder import NamePlan, base_name

    def namespace(used, counts):
        g = Graph()
        ns = g._graph_namespace
        ns._used_names, ns._base_count = set(used), dict(counts)
        return g

    base_name(Graph(), torch.ops.aten.mm.default)  # "mm_default" known as a plain base
    import operator

    base_name(Graph(), operator.getitem)
    # by hand: mm_default taken (count 3): _4, _5; view_4 free: as it is (count 4); getitem
    # taken (count 0): _1, then getitem_2 free: as it is (count 2)
    plan = NamePlan(["mm_default", None, "mm_default", "getitem", None])
    g = namespace({"mm_default", "getitem"}, {"mm_default": 3, "getitem": 0})
    got = plan.take(g, ["view_4", "getitem_2"])
    assert got == ["mm_default_4", "view_4", "mm_default_5", "getitem_1", "getitem_2"]
    assert g._graph_namespace._base_count == {"mm_default": 5, "getitem": 2, "view": 4}

    rng = random.Random(0)
    plain = ["mm_default", "add_tensor", "getitem"]
    numbered = ["view", "getitem", "addmm", "sum_1"]  # sum_1_<n>: the base sum_1
    for _ in range(400):
        fixed = [rng.choice(plain) if rng.random() < 0.6 else None for _ in range(rng.randrange(9))]
        plan = NamePlan(fixed)
        ref = namespace(set(), {})._graph_namespace
        for _ in range(rng.randrange(12)):  # names fx gave before
            b = rng.choice(plain + numbered)
            ref.create_name(f"{b}_{rng.randrange(8)}" if rng.random() < 0.6 else b, None)
        for _ in range(3):  # calls one after the other, the plan kept
            given = [f"{rng.choice(numbered)}_{rng.randrange(12)}" for _ in plan.slots]
            if given and rng.random() < 0.1:
                given[-1] = rng.choice(plain)  # a name of another form: one by one
            g = namespace(ref._used_names, ref._base_count)
            want = [ref.create_name(x, None) for x in plan.candidates(given)]
            assert plan.take(g, given) == want
            ns = g._graph_namespace
            assert ns._used_names == ref._used_names
            assert ns._base_count == ref._base_count
