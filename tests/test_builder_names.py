"""Shortcuts the derivative builders take around fx give what fx gives: a placeholder's name
(:func:`graphflop.ad.builder.placeholder`) and the fake mode of a graph's values
(:func:`graphflop.meta.fake_mode_of`, which reads the values only up to the first fake tensor);
and around FakeTensorMode: an op's output made from the metadata kept for its call in another
fake mode (:func:`graphflop.ad.builder.fake_output`) is the one the mode gives."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph

from graphflop.ad import builder
from graphflop.ad.builder import fake_output, new_node, placeholder, shape_cache_scope
from graphflop.meta import fake_mode_of, fresh_fake
from graphflop.ops.tree import meta_key

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


def test_new_node_as_create_node():
    """``new_node`` (the builders' node constructor) makes the node fx's ``create_node`` makes:
    name, op, target, arguments, users, place in the graph (appended, or at an insert point),
    the graph's length and find_nodes table, its code."""
    aten = torch.ops.aten

    def build(make):
        g = Graph()
        x = make(g, "placeholder", "x", "x", (), {})
        w = make(g, "placeholder", "p_w", "p_w", (), {})
        m1 = make(g, "call_function", aten.mul.Tensor, "mul_tensor", (x, 2.0), {})
        m2 = make(g, "call_function", aten.mul.Tensor, "mul_tensor", (m1, w), {})
        s = make(g, "call_function", aten.sum.dim_IntList, "sum", (m2, [0]), {"keepdim": True})
        a = make(g, "call_function", aten.add.Tensor, "mul_tensor_1", (s, x), {"alpha": 2})
        k = make(g, "call_function", aten.add.Tensor, "for", (a, w), {})
        with g.inserting_before(m1):  # at an insert point
            make(g, "call_function", aten.neg.default, "neg", (x,), {})
        g.output(k)
        return g

    def fx(g, op, target, name, args, kwargs):
        return g.create_node(op, target, args, kwargs, name=name)

    ours, theirs = build(new_node), build(fx)

    def rows(g):
        return [
            (n.name, n.op, n.target, str(n.args), str(n.kwargs), list(n.users)) for n in g.nodes
        ]

    assert str(rows(ours)) == str(rows(theirs))
    # worked out from fx's rules: ``mul_tensor`` taken (numbered on: its base's next number,
    # 1, then 2 where ``mul_tensor_1`` is asked for), ``sum`` (a builtin's) and ``for`` (a
    # keyword) numbered even where free
    assert [n.name for n in ours.nodes] == [
        *("x", "p_w", "neg", "mul_tensor", "mul_tensor_1", "sum_1", "mul_tensor_2", "for_1"),
        "output",
    ]
    assert ours._len == theirs._len == 9
    assert ours.find_nodes(op="call_function", target=aten.mul.Tensor) == [
        n for n in ours.nodes if n.target is aten.mul.Tensor
    ]
    assert [n.name for n in ours.find_nodes(op="placeholder")] == ["x", "p_w"]
    ours.lint()
    assert ours.python_code("self").src == theirs.python_code("self").src


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


def test_output_kept_across_fake_modes_is_the_modes_own():
    aten = torch.ops.aten
    # x: 2x3x4 float32 laid out as a transposed 2x4x3 (strides 12, 1, 3); w: 4x5
    calls = [
        (aten.mul.Tensor, ("x", 2.0)),  # elementwise keeps x's layout: strides (12, 1, 3)
        (aten.matmul.default, ("x", "w")),  # 2x3x5, contiguous: strides (15, 5, 1)
        (aten.sum.dim_IntList, ("x", [1], True)),  # 2x1x4; the size-1 dim's stride 4 (4, 4, 1)
    ]
    expected = [((2, 3, 4), (12, 1, 3)), ((2, 3, 5), (15, 5, 1)), ((2, 1, 4), (4, 4, 1))]
    for second in (False, True):  # the second mode's outputs: from what the first one kept
        mode = FakeTensorMode()
        with shape_cache_scope():
            x = fresh_fake(mode, (2, 3, 4), (12, 1, 3), torch.float32, "cpu")
            w = fresh_fake(mode, (4, 5), (5, 1), torch.float32, "cpu")
            for (op, names), (shape, stride) in zip(calls, expected):
                args = tuple({"x": x, "w": w}.get(a, a) if isinstance(a, str) else a for a in names)
                key = builder._shape_key(op, args, {}, meta_key)
                assert (key in builder._OUTPUTS) or not second
                out = fake_output(mode, op, args, {})
                with mode:
                    ref = op(*args)
                got = (type(out), out.fake_mode, out.device, out.dtype, out.requires_grad)
                assert got == (type(ref), mode, ref.device, ref.dtype, ref.requires_grad)
                assert (tuple(out.shape), out.stride()) == (tuple(ref.shape), ref.stride())
                assert (tuple(out.shape), out.stride()) == (shape, stride)
                assert not out._is_view() and out.storage_offset() == 0
                assert key in builder._OUTPUTS  # a new tensor, not a view: kept
