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
