"""The recording seam (graphflop/frontend/recording.py) over make_fx's tracer, and graphflop's
own recorder against make_fx."""

import dataclasses
import types

import pytest
import torch
from conftest import node_rows, spec
from torch.fx.experimental.proxy_tensor import PythonKeyTracer, make_fx

from graphflop.frontend import recording
from graphflop.frontend import trace as trace_module
from graphflop.load import load, make_inputs
from graphflop.meta import CHECKPOINT, COMPOSITE, FUNCTION, HIERARCHY


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


# --- graphflop's own recorder against make_fx (issue 33 item 4) ----------------------------


_OWN = pytest.mark.skipif(
    not recording.AVAILABLE, reason="this PyTorch lacks what graphflop's recorder needs"
)


def _val(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.dtype, v.storage_offset(), v.requires_grad)
    if isinstance(v, (tuple, list)):
        return tuple(_val(x) for x in v)
    return v


def _rows(gm):
    """Node for node: op, target, arguments, layout, name and every annotation (values by
    layout; composite and checkpoint regions numbered by first appearance: a replayed
    attention and a checkpoint draw their numbers from counters of the process)."""
    if isinstance(gm, torch.fx.Graph):  # (a template)
        gm = types.SimpleNamespace(graph=gm)
    regions: dict[int, int] = {}
    checkpoints: dict[int, int] = {}

    def tag(t):
        if t is None:
            return None
        region = regions.setdefault(t.region, len(regions))
        return dataclasses.replace(t, region=region, inner=tag(t.inner))

    def meta(n):
        out = {k: _val(v) for k, v in n.meta.items() if k != "tensor_meta"}
        if COMPOSITE in out:
            out[COMPOSITE] = tag(out[COMPOSITE])
        if CHECKPOINT in out:
            c = out[CHECKPOINT]
            out[CHECKPOINT] = dataclasses.replace(
                c, region=checkpoints.setdefault(c.region, len(checkpoints))
            )
        if FUNCTION in out:  # (its record holds the graphs traced for it: by name)
            f = out[FUNCTION]
            out[FUNCTION] = (
                f.function.name,
                checkpoints.setdefault(f.region, len(checkpoints)),
                f.position,
                f.input,
                f.output,
                f.saved,
            )
        return out

    return [(*row, n.name, meta(n)) for row, n in zip(node_rows(gm), gm.graph.nodes)]


def _trace_both(model, inputs, monkeypatch):
    made = {}
    for recorder in ("make_fx", "own"):
        monkeypatch.setattr(trace_module, "RECORDER", recorder)
        made[recorder] = trace_module.trace(model, inputs)
    return made["make_fx"], made["own"]


def _same(reference, own):
    assert _rows(own) == _rows(reference)
    for key in reference.meta.keys() - {HIERARCHY}:
        assert repr(own.meta[key]) == repr(reference.meta[key]), key
    h, g = reference.meta.get(HIERARCHY), own.meta.get(HIERARCHY)
    assert (h is None) == (g is None)
    if h is not None:
        assert [_rows(t) for t in g.templates] == [_rows(t) for t in h.templates]
        assert _rows(g.graph) == _rows(h.graph)
        assert g.variants == h.variants and g.runs == h.runs


@pytest.mark.parametrize(
    ("name", "batch"),
    [
        ("mlp.py", None),
        ("cnn.py", None),
        ("convnet.py", None),
        ("lora.py", None),
        ("gpt2.py", None),
        ("vit.py", None),
        ("resnet.py:resnet18", 2),
        pytest.param("deeper_convnet.py", None, marks=pytest.mark.slow),
        pytest.param("resnet.py:resnet50", 2, marks=pytest.mark.slow),
    ],
)
@_OWN
def test_own_recorder_traces_the_graph_make_fx_traces(name, batch, monkeypatch):
    """The forward ``trace`` makes with graphflop's recorder is the one it makes with
    ``make_fx`` (the reference): node for node, names, arguments, every annotation, the
    hierarchy's templates and top level."""
    loaded = load(spec(name), meta=True)
    loaded.model.train()
    _same(*_trace_both(loaded.model, make_inputs(loaded, batch=batch), monkeypatch))


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2

    @staticmethod
    def jvp(ctx, t):
        return t * 2


class _Block(torch.nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a = torch.nn.Linear(d, d)
        self.b = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        h = torch.relu_(self.a(x))
        h = self.drop(h)
        return x + self.b(h)


class _Features(torch.nn.Module):
    """What the trace's hooks see: in-place ops, dropout, a checkpoint of each kind, a custom
    Function, a write under no_grad, a leaf made by requires_grad_, embedding's max_norm, a
    constant read with item(), repeated blocks."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.emb = torch.nn.Embedding(20, d, max_norm=1.0)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(3))
        self.c1 = _Block(d)
        self.c2 = _Block(d)
        self.gru = torch.nn.GRU(d, d, batch_first=True)
        self.head = torch.nn.Linear(d, 4)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        x = torch.utils.checkpoint.checkpoint(self.c1, x, use_reentrant=False)
        x = torch.utils.checkpoint.checkpoint(self.c2, x, use_reentrant=True)
        x = _Twice.apply(x)
        with torch.no_grad():
            x[:, 0] = 0.0
        scale = torch.tensor(0.5)
        x = x * scale.item()
        m = torch.zeros_like(x).requires_grad_()
        x = x + m
        x, _ = self.gru(x)
        return self.head(x[:, -1])


@pytest.mark.parametrize(
    "case",
    [
        "features",
        pytest.param("torchvision:mobilenet_v3_small", marks=pytest.mark.slow),
        pytest.param("hf:gpt2", marks=pytest.mark.slow),
        pytest.param("hf:bert", marks=pytest.mark.slow),
        pytest.param("hf:t5", marks=pytest.mark.slow),
        pytest.param("hf:mixtral", marks=pytest.mark.slow),
    ],
)
@_OWN
def test_own_recorder_on_the_trace_hooks_and_library_models(case, monkeypatch):
    if case == "features":
        model, inputs = _Features(), (torch.randint(0, 20, (2, 5)),)
    else:
        loaded = load(case, meta=True)
        loaded.model.train()
        model, inputs = loaded.model, make_inputs(loaded, batch=2)
    _same(*_trace_both(model, inputs, monkeypatch))
