"""Decompositions replayed per argument signature (graphflop.frontend.replay): the
graph is the one tracing every call gives, node for node, composite tags included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import spec
from torch import nn

import graphflop.frontend.nodynamo as nodynamo
import graphflop.frontend.replay as replay
from graphflop.frontend.outline import graph_signature
from graphflop.frontend.trace import trace
from graphflop.load import load, make_inputs
from graphflop.meta import COMPOSITE


def _signature(gm: torch.fx.GraphModule) -> list:
    """graph_signature plus each node's composite tag, its region numbers replaced by their
    order of first appearance (replayed regions are numbered afresh)."""
    regions: dict[int, int] = {}

    def tag(t):
        if t is None:
            return None
        return (t.op, regions.setdefault(t.region, len(regions)), t.output, t.inputs, tag(t.inner))

    return [
        (*row, n.name, tag(n.meta.get(COMPOSITE)))
        for row, n in zip(graph_signature(gm.graph), gm.graph.nodes, strict=True)
    ]


def _both(model: nn.Module, inputs: tuple, monkeypatch, **kw) -> tuple[list, list, int]:
    """Signatures traced without and with replays, and the number of replayed calls."""
    made: list[replay.Replays] = []
    init = replay.Replays.__init__

    def recording(self, regions):
        init(self, regions)
        made.append(self)

    monkeypatch.setattr(replay.Replays, "__init__", recording)
    monkeypatch.setattr(replay, "ENABLED", False)
    off = _signature(nodynamo.run(lambda: trace(model, inputs, **kw)))
    monkeypatch.setattr(replay, "ENABLED", True)
    on = _signature(nodynamo.run(lambda: trace(model, inputs, **kw)))
    return off, on, made[-1].hits


class TwoNorms(nn.Module):
    """Two batch norms of one signature, one of them called twice (its second call reads the
    running statistics its first call wrote), a layer norm and GELU twice, a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.bn2 = nn.BatchNorm2d(4)
        self.ln = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn1(self.conv(x)).relu()
        y = self.bn2(y) + self.bn2(x)
        z = F.gelu(self.ln(y)) + F.gelu(self.ln(x))
        return z.softmax(-1).flatten(1)


def test_replayed_graph_equals_traced(monkeypatch):
    model = TwoNorms().train()
    x = torch.randn(2, 4, 8, 8)
    off, on, hits = _both(model, (x,), monkeypatch, reuse=False)
    # bn1/bn2 on (2,4,8,8): 3 calls, 2 replayed; layer norm and GELU: 1 each
    assert hits >= 4
    assert on == off


def test_a_replayed_write_is_read_afterwards():
    """Batch norm's decomposition writes the running statistics with ``copy_``: after a
    replayed call, reading them must read the replayed ``copy_`` node, as traced."""
    import itertools

    from torch.fx.experimental.proxy_tensor import make_fx

    from graphflop.ops import decomposition_table

    aten = torch.ops.aten
    table = {aten.native_batch_norm.default: decomposition_table()[aten.native_batch_norm.default]}

    def f(x, w, b, rm, rv):
        y = aten.native_batch_norm.default(x, w, b, rm, rv, True, 0.1, 1e-5)[0]
        z = aten.native_batch_norm.default(y, w, b, rm, rv, True, 0.1, 1e-5)[0]
        return z, rm + 1, rv * 2

    args = (torch.randn(2, 3, 4), torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3))
    graphs = []
    for enabled in (False, True):
        replays = replay.Replays(itertools.count())
        replay.ENABLED = enabled
        try:
            gm = make_fx(f, decomposition_table=replays.wrap(table), tracing_mode="fake")(*args)
        finally:
            replay.ENABLED = True
        graphs.append(graph_signature(gm.graph))
        hits = replays.hits
    assert hits == 1
    assert graphs[0] == graphs[1]
    copies = [i for i, row in enumerate(graphs[1]) if row[1] == "aten.copy_.default"]
    # first call: mean into rm (placeholder 3), var into rv (4); second call: into those copies
    assert [graphs[1][i][2][0] for i in copies] == [
        ("node", 3),
        ("node", 4),
        ("node", copies[0]),
        ("node", copies[1]),
    ]
    add = next(row for row in graphs[1] if row[1] == "aten.add.Tensor" and 1 in row[2])
    assert add[2][0] == ("node", copies[2])  # rm + 1 reads the second (replayed) call's write


def test_same_argument_twice_is_not_confused_with_two_arguments(monkeypatch):
    """``mse(a, a)`` and ``mse(a, b)`` have the same argument metadata but not the same graph."""

    class M(nn.Module):
        def forward(self, a, b):
            return (F.mse_loss(a, b) + F.mse_loss(a, a) + F.mse_loss(b, a)).reshape(1, 1)

    off, on, hits = _both(M(), (torch.randn(3, 5), torch.randn(3, 5)), monkeypatch, reuse=False)
    assert hits >= 1
    assert on == off


def test_scalars_of_another_type_are_another_signature(monkeypatch):
    """``1``, ``1.0`` and ``True`` are equal in Python, and so are ``0.0`` and ``-0.0``, but
    ``1 - m`` on an int64 tensor is int64 and ``1.0 - m`` float32 (a tester's finding: the
    second call replayed the first's template, and an embedding later got float indices)."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 4)
            self.time = nn.Linear(1, 4)

        def forward(self, x, m):
            t = self.time(torch.arange(float(x.shape[1]))[:, None])  # float32
            pos = self.emb(torch.arange(x.shape[1]))  # int64 indices
            a = (1 - m) + torch.floor_divide(m, 2)  # int64
            b = (1.0 - m) + torch.floor_divide(m, 2.0)  # float32
            c = F.hardtanh(x, -0.0, 1.0) + F.hardtanh(x, 0.0, 1.0)
            return x + pos + t + c + (a * b).unsqueeze(-1)

    x, m = torch.randn(2, 8, 4), torch.ones(2, 8, dtype=torch.long)
    off, on, _ = _both(M(), (x, m), monkeypatch, reuse=False)
    assert on == off
    dtypes = [row[4][2] for row in on if row[1] in ("aten.arange.start_step", "aten.sub.Tensor")]
    assert torch.int64 in dtypes and torch.float32 in dtypes


@pytest.mark.parametrize("name", ["resnet.py:resnet18", "gpt2.py:gpt2_small"])
def test_zoo_graphs_unchanged(name, monkeypatch):
    loaded = load(spec(name), ctor_kwargs={"n_layer": 2} if "gpt2" in name else {}, meta=True)
    loaded.model.train()
    inputs = make_inputs(loaded, batch=2, shapes=[(2, 32)] if "gpt2" in name else None)
    off, on, hits = _both(loaded.model, inputs, monkeypatch)
    assert hits >= 1
    assert on == off
