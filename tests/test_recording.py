"""The recording seam (graphflop/frontend/recording.py) over make_fx's tracer."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import PythonKeyTracer, make_fx

from graphflop.frontend import recording


def test_nothing_recorded_outside_a_trace():
    t = torch.ones(2)
    assert not recording.recording()
    assert recording.current() is None
    assert recording.node_of(t) is None
    with recording.nodes_added() as made:
        t * 2
    assert made == []


def test_node_of_nodes_added_and_bind_inside_make_fx():
    seen: dict = {}

    def f(x):
        rec = recording.current()
        assert rec is not None and recording.recording()
        seen["x"] = rec.node_of(x)
        with recording.nodes_added() as made:
            y = torch.sin(x) * 3
        seen["made"] = list(made)
        seen["y"] = recording.node_of(y)
        assert rec.node_of(3) is None  # not a tensor
        # a node made by hand, bound to a fresh tensor: later ops read it
        z = torch.empty_like(x)
        node = rec.graph.call_function(torch.ops.aten.cos.default, (seen["x"],))
        node.meta["val"] = z
        rec.bind(z, node)
        seen["bound"] = node
        return z + y

    gm = make_fx(f)(torch.ones(3))
    kept = {
        torch.ops.aten.sin.default,
        torch.ops.aten.mul.Tensor,
        torch.ops.aten.cos.default,
        torch.ops.aten.add.Tensor,
    }
    # sin, mul (the block), cos (by hand), add; empty_like's nodes left out
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in kept]
    assert [n.target for n in ops] == [
        torch.ops.aten.sin.default,
        torch.ops.aten.mul.Tensor,
        torch.ops.aten.cos.default,
        torch.ops.aten.add.Tensor,
    ]
    assert seen["x"].op == "placeholder"
    assert seen["made"] == ops[:2]
    assert seen["y"] is ops[1]
    assert ops[3].args == (seen["bound"], ops[1])


def test_each_node_hook_nests_and_is_removed_even_on_error():
    original = PythonKeyTracer.create_node
    outer: list = []
    inner: list = []

    def f(x):
        with recording.each_node(lambda n: inner.append(n.target)):
            return torch.exp(x)

    with recording.each_node(lambda n: outer.append(n.target)):
        make_fx(f)(torch.ones(2))
    assert torch.ops.aten.exp.default in inner
    assert torch.ops.aten.exp.default in outer  # the outer hook still runs inside
    assert len(outer) > len(inner)  # it saw the placeholder and output too
    assert PythonKeyTracer.create_node is original
    with pytest.raises(RuntimeError), recording.each_node(lambda n: None):
        raise RuntimeError("x")
    assert PythonKeyTracer.create_node is original
