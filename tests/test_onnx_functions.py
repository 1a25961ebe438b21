"""Repeated blocks written once as ONNX local functions (graphflop/export/onnx_functions.py):
the folded graphs compute what the flat ones compute on ONNX Runtime, hold each block's nodes
once, and the manifest still lists (and sums) every flat node; a block that cannot be one call
stays inline with the reason."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from graphflop.analysis import analyze
from graphflop.export.onnx import export_all
from graphflop.export.onnx_functions import DOMAIN, fold_blocks
from graphflop.meta import SIGNATURE
from graphflop.runtime.graphs import step_graphs
from graphflop.runtime.onnxrt import run, session
from graphflop.runtime.verify import real_arguments, rel_error, run_forward

CPU = "CPUExecutionProvider"


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Stack(nn.Module):
    """Three identical residual blocks between a stem and a head."""

    def __init__(self, d: int = 6, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(4, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(blocks)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(5, 4)
    a = analyze(model, (x,))
    graphs = step_graphs(a, kinds=("forward", "backward", "train_step"), residuals=True)
    root = tmp_path_factory.mktemp("fold")
    flat = export_all(graphs, root / "flat")
    folded = export_all(graphs, root / "folded", functions=True)
    return model, x, a, root, flat, folded


def _count(path) -> tuple[int, list[int]]:
    m = onnx.load(path)
    return len(m.graph.node), [len(f.node) for f in m.functions]


@pytest.mark.slow  # exports three graphs twice: about a minute
def test_each_block_once_and_called_per_block(exported):
    _, _, _, root, flat, folded = exported
    for kind, g in folded["graphs"].items():
        fns = g["functions"]["functions"]
        # forward and backward: one function (the blocks are equal), called 3 times; the
        # train step holds a block's forward and its derivative as two functions
        assert len(fns) == (2 if kind == "train_step" else 1), kind
        assert all(len(f["calls"]) == 3 for f in fns.values()), (kind, fns)
        top, bodies = _count(root / "folded" / g["file"])
        # the manifest's counts (what graphflop export prints) are the file's
        assert g["functions"]["graph_nodes"] == top
        assert list(g["functions"]["function_nodes"].values()) == bodies
        n_flat, _ = _count(root / "flat" / g["file"])
        # every flat row is folded into a call or stays in the graph; the graph holds the
        # unfolded rows plus one call per block (Constant nodes the exporter shares are copied
        # into each function that reads them, and dropped outside when nothing reads them)
        rows = g["nodes"]
        assert len(rows) == n_flat == len(flat["graphs"][kind]["nodes"])
        unfolded = sum(1 for r in rows if "call" not in r)
        calls = sum(len(f["calls"]) for f in fns.values())
        assert top <= unfolded + calls
        assert top + sum(bodies) < n_flat, kind
        # the body of a function: the rows one of its calls folded (plus copied constants)
        for name, body in zip(fns, bodies):
            first = fns[name]["calls"][0]
            assert body >= sum(1 for r in rows if r.get("call") == first)


@pytest.mark.slow  # exports three graphs twice: about a minute
def test_inlined_again_has_the_flat_ops(exported):
    from collections import Counter

    from onnx.inliner import inline_local_functions

    _, _, _, root, flat, folded = exported
    for g in folded["graphs"].values():
        back = inline_local_functions(onnx.load(root / "folded" / g["file"]))
        ops = Counter(n.op_type for n in back.graph.node if n.op_type != "Constant")
        ref = Counter(
            n.op_type
            for n in onnx.load(root / "flat" / g["file"]).graph.node
            if n.op_type != "Constant"
        )
        assert ops == ref


@pytest.mark.slow  # exports three graphs twice: about a minute
def test_folded_graphs_compute_what_flat_ones_do(exported):
    model, _, a, root, flat, folded = exported
    values = real_arguments(a.forward, model)
    phs = [n.name for n in a.forward.graph.nodes if n.op == "placeholder"]
    g = folded["graphs"]["forward"]
    feeds = dict(zip(g["inputs"], [values[n] for n in phs]))
    out_flat = run(session(root / "flat" / "forward.onnx", CPU), feeds)
    out_fold = run(session(root / "folded" / "forward.onnx", CPU), feeds)
    ref = run_forward(a.forward, values)[a.forward.meta[SIGNATURE].loss]
    loss = g["outputs"].index("loss")
    assert rel_error(torch.from_numpy(out_fold[loss]), ref) < 1e-5
    for p, q in zip(out_flat, out_fold):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)
    # backward from the forward's residuals: the gradients equal the flat graph's and torch's
    fwd = dict(zip(g["outputs"], out_fold))
    gb = folded["graphs"]["backward"]
    bfeeds = {}
    for name in gb["inputs"]:
        if name == "ct_loss":
            bfeeds[name] = np.ones((), np.float32)
        elif name in fwd:
            bfeeds[name] = fwd[name]
        else:
            bfeeds[name] = feeds[name.removeprefix("saved.")]
    grads_flat = run(session(root / "flat" / "backward.onnx", CPU), bfeeds)
    grads = dict(zip(gb["outputs"], run(session(root / "folded" / "backward.onnx", CPU), bfeeds)))
    for p, q in zip(grads_flat, grads.values()):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)
    # and torch's backward graph on the same feeds
    ref = a.backward(*[torch.as_tensor(bfeeds[k]) for k in gb["inputs"]])
    for name, r in zip(gb["outputs"], ref):
        assert rel_error(torch.from_numpy(grads[name]), r) < 1e-4, name
    assert {f"grad.{q}" for q, _ in model.named_parameters()} <= set(grads)


@pytest.mark.slow  # exports three graphs twice: about a minute
def test_manifest_flops_still_sum(exported):
    _, _, a, _, _, folded = exported
    t = a.report.totals
    assert sum(r["flops"] for r in folded["graphs"]["forward"]["nodes"]) == t.forward.flops
    assert sum(r["flops"] for r in folded["graphs"]["backward"]["nodes"]) == t.backward.flops


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(i, TensorProto.FLOAT, [2]) for i in inputs],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [2]) for o in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_block_a_path_leaves_and_reenters_stays_inline():
    # site A: a = Neg(x); c = Add(a, b) — but b = Relu(a) is top level: A → top → A
    nodes = [
        helper.make_node("Neg", ["x"], ["a"], name="n0"),
        helper.make_node("Relu", ["a"], ["b"], name="n1"),
        helper.make_node("Add", ["a", "b"], ["c"], name="n2"),
    ]
    m = _model(nodes, ["x"], ["c"])
    report = fold_blocks(m, ["A", None, "A"])
    assert report.inline == {"A": "not convex: a path leaves the block and comes back"}
    assert not m.functions and len(m.graph.node) == 3


def test_equal_blocks_share_a_function_and_different_ones_do_not():
    # three sites: A and B are Neg → Exp, C is Neg → Log; a Constant shared by all
    nodes = [
        helper.make_node("Constant", [], ["k"], value=helper.make_tensor("k", 1, [1], [2.0])),
        helper.make_node("Neg", ["x"], ["a1"], name="a1"),
        helper.make_node("Mul", ["a1", "k"], ["a2"], name="a2"),
        helper.make_node("Neg", ["a2"], ["b1"], name="b1"),
        helper.make_node("Mul", ["b1", "k"], ["b2"], name="b2"),
        helper.make_node("Neg", ["b2"], ["c1"], name="c1"),
        helper.make_node("Abs", ["c1"], ["c2"], name="c2"),
    ]
    m = _model(nodes, ["x"], ["c2"])
    flat_out = session_run(m, np.array([1.5, -0.25], np.float32))
    report = fold_blocks(m, [None, "A", "A", "B", "B", "C", "C"])
    onnx.checker.check_model(m, full_check=True)
    assert sorted(map(sorted, report.functions.values())) == [["A", "B"], ["C"]]
    assert all(n.domain == DOMAIN for n in m.graph.node)  # the shared Constant moved inside
    assert [len(f.node) for f in m.functions] == [3, 2]  # Constant, Neg, Mul; Neg, Abs
    np.testing.assert_array_equal(session_run(m, np.array([1.5, -0.25], np.float32)), flat_out)
    assert flat_out.tolist() == [6.0, 1.0]  # |-(−(−x·2)·2)| = 4|x|


def session_run(m, x):
    import onnxruntime as ort

    s = ort.InferenceSession(m.SerializeToString(), providers=[CPU])
    return s.run(None, {"x": x})[0]


_STACK_FILE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class Net(nn.Sequential):
    def __init__(self):
        super().__init__(Block(), Block(), nn.Linear(4, 2))


def example_inputs():
    return (torch.randn(3, 4),)
"""


@pytest.mark.slow  # (about 14 s: three ONNX exports; CI's slow pass)
def test_export_no_outline_writes_flat_models_and_says_so(tmp_path, capsys):
    """``export --no-outline`` outlines no block, so its ONNX models hold no local function,
    as with ``--flat``; the help of both options says so."""
    from conftest import cli

    model = tmp_path / "stack.py"
    model.write_text(_STACK_FILE)
    functions = {}
    for how in ("default", "--no-outline", "--flat"):
        out = tmp_path / how.strip("-")
        flags = [] if how == "default" else [how]
        rc, _, _ = cli(capsys, "export", f"{model}:Net", "--out", out, *flags)
        assert rc == 0
        functions[how] = len(onnx.load(out / "forward.onnx").functions)
    assert functions == {"default": 1, "--no-outline": 0, "--flat": 0}
    rc, help_text, _ = cli(capsys, "export", "--help")
    assert rc == 0
    text = " ".join(help_text.split())
    flat_help = text[text.index("--flat write") :]
    assert "--no-outline also writes them flat" in flat_help
    start = text.index("--no-outline trace")
    no_outline = text[start : text.index("--loss {", start)]
    assert "The ONNX models are then flat, as with --flat" in no_outline
