"""ONNX export: every graph exports with standard ops only, runs in ONNX Runtime with the same
numbers as in PyTorch, and the train step equals one torch.optim step."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import spec
from torch import nn

from graphflop.analysis import analyze
from graphflop.export.onnx import OnnxExportError, export_all, graph_io_names
from graphflop.load import load, make_inputs
from graphflop.meta import COST, ROLE, SIGNATURE, SOURCE, TRAIN_STEP, UPDATE
from graphflop.ops import op_name
from graphflop.runtime.graphs import forward_gradient_graph, step_graphs, train_step_graph
from graphflop.runtime.onnxrt import run, session
from graphflop.runtime.verify import real_arguments, rel_error, run_forward

CPU = "CPUExecutionProvider"
# every model file (ResNet-50 standing for resnet.py; DeeperConvNet with 3 middle layers)
ZOO = [
    ("convnet.py", 2),
    ("onenet.py", 4),
    ("deeper_convnet.py", 1),
    ("logreg.py", 8),
    ("mlp.py", 8),
    ("cnn.py", 2),
    ("resnet.py:resnet50", 1),
    ("linearnet.py", 2),
]
STANDARD_DOMAINS = {"", "ai.onnx"}


def _setup(name, batch, optimizer="sgd", ctor=None):
    real = load(spec(name), ctor_kwargs=ctor or {})
    real.model.train()
    a = analyze(real.model, make_inputs(real, batch=batch), optimizer=optimizer)
    return real, a


#: exported in the default suite; the others run with -m slow (CI) to keep it under budget
_DEFAULT_EXPORTS = {"convnet.py", "linearnet.py"}  # mlp.py, cnn.py: 9.5-10 s each


@pytest.mark.parametrize(
    "name,batch",
    [
        pytest.param(n, b, id=n, marks=() if n in _DEFAULT_EXPORTS else pytest.mark.slow)
        for n, b in ZOO
    ],
)
def test_export_runs_and_matches_pytorch(tmp_path, name, batch):
    ctor = {"in_features": 3 * 16 * 16} if name == "linearnet.py" else None
    if name == "deeper_convnet.py":
        real = load(spec(name), ctor_kwargs={"middle_layers": 3})
        a = analyze(real.model, make_inputs(real, batch=batch))
        ctor = {}
    if ctor is None:
        real, a = _setup(name, batch)
    elif ctor:  # the seed's LinearNet has 617 M parameters: same architecture, 16×16 inputs
        real = load(spec(name), ctor_kwargs=ctor)
        a = analyze(real.model, make_inputs(real, shapes=[(batch, 3, 16, 16)]))
    _export_and_compare(tmp_path, real, a, name)


@pytest.mark.slow  # about 90 s on a shared machine: every step graph exported
def test_gpt2_block_exports_and_matches_pytorch(tmp_path):
    # a one-block GPT-2: the attention's q, k, v split is a split in the JVP graph (with
    # getitems) and a concatenation of the pieces' cotangents in the backward graph
    ctor = {"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 64, "n_positions": 8}
    real = load(spec("gpt2.py:gpt2_small"), ctor_kwargs=ctor)
    real.model.train()
    a = analyze(real.model, make_inputs(real, shapes=[(2, 8)]))
    assert any(n.target == torch.ops.aten.cat.default for n in a.backward.graph.nodes)
    _export_and_compare(tmp_path, real, a, "gpt2")


def _export_and_compare(tmp_path, real, a, name):
    """Export ``a``'s step graphs, check them with ONNX's checker and the manifest's FLOPs, and
    run the forward and backward graphs in ONNX Runtime against PyTorch."""
    manifest = export_all(step_graphs(a), tmp_path, name=name)
    import onnx

    for kind, g in manifest["graphs"].items():
        model = onnx.load(tmp_path / g["file"])
        onnx.checker.check_model(model)
        for node in model.graph.node:
            assert node.domain in STANDARD_DOMAINS, (kind, node.op_type, node.domain)
            assert not node.op_type.lower().endswith("backward"), (kind, node.op_type)
        assert len(g["nodes"]) == len(model.graph.node)
    _check_manifest_flops(a, manifest)
    values = real_arguments(a.forward, real.model)
    fv = run_forward(a.forward, values)
    # forward
    g = manifest["graphs"]["forward"]
    sess = session(tmp_path / "forward.onnx", CPU)
    names = [n.name for n in a.forward.graph.nodes if n.op == "placeholder"]
    feeds = dict(zip(g["inputs"], [values[n] for n in names]))
    out = run(sess, feeds)
    loss_pos = g["outputs"].index("loss")
    assert rel_error(torch.from_numpy(out[loss_pos]), fv[a.forward.meta[SIGNATURE].loss]) < 1e-4
    # backward: residuals from the PyTorch forward run
    g = manifest["graphs"]["backward"]
    sess = session(tmp_path / "backward.onnx", CPU)
    bnames = [n for n in a.backward.graph.nodes if n.op == "placeholder"]
    feeds = {}
    for onnx_name, n in zip(g["inputs"], bnames):
        feeds[onnx_name] = (
            torch.ones(()) if onnx_name == "ct_loss" else fv[n.meta.get(SOURCE, n.name)]
        )
    got = run(sess, feeds)
    ref = a.backward(*[feeds[k] for k in g["inputs"]])
    for x, y in zip(got, ref):
        assert rel_error(torch.from_numpy(x), y) < 1e-4


def _graph_flops(gm) -> int:
    return sum(n.meta[COST].flops for n in gm.graph.nodes if COST in n.meta)


def _check_manifest_flops(a, manifest):
    """Each ONNX node carries its share of graphflop's FLOPs once: the manifest sums to the
    graph's FLOPs and to the report's totals; a node mapped to no graphflop node has none."""
    t = a.report.totals
    totals = {
        "forward": t.forward.flops,  # the loss included
        "backward": t.backward.flops,
        "train_step": t.train_step.flops,
        "forward_gradient_step": t.forward_gradient_step.flops,
    }
    graphs = step_graphs(a)
    for kind, g in manifest["graphs"].items():
        got = sum(e["flops"] for e in g["nodes"])
        assert got == _graph_flops(graphs[kind]) == totals[kind], kind
        assert sum(e["bytes"] for e in g["nodes"]) <= sum(e["node_bytes"] for e in g["nodes"])
        assert all(e["flops"] == 0 for e in g["nodes"] if e["graphflop_node"] is None), kind


def test_manifest_flops_once_on_the_matrix_products(tmp_path):
    """The MLP (784→1024→1024→10, batch 8): its matrix products' FLOPs sit on the ONNX
    MatMul/Gemm nodes, once, and nowhere else (a ReLU mask's Greater no longer carries a
    product's FLOPs)."""
    real, a = _setup("mlp.py", 8)
    manifest = export_all(step_graphs(a, kinds=("forward", "backward")), tmp_path)
    mm = {"MatMul", "Gemm"}
    # forward: 2·B·(784·1024 + 1024·1024 + 1024·10) = 16·1,861,632 for the products, and
    # B·(1024 + 1024 + 10) for the biases the addmm nodes (ONNX Gemm) add
    products = 2 * 8 * (784 * 1024 + 1024 * 1024 + 1024 * 10)
    fwd = products + 8 * (1024 + 1024 + 10)
    # backward: every weight gradient (the forward's products again) plus the input gradients
    # of the 2nd and 3rd layers, 2·B·(1024·1024 + 1024·10); none for the first layer's input
    bwd = products + 2 * 8 * (1024 * 1024 + 1024 * 10)
    for kind, want in (("forward", fwd), ("backward", bwd)):
        nodes = manifest["graphs"][kind]["nodes"]
        assert sum(e["flops"] for e in nodes if e["op_type"] in mm) == want, kind
        biggest_other = max(e["flops"] for e in nodes if e["op_type"] not in mm)
        assert biggest_other <= 5 * 8 * 1024, kind  # elementwise work: a few FLOPs per value


@pytest.mark.slow  # 15 s
def test_forward_outputs_the_residuals_and_chains_into_backward(tmp_path):
    """forward.onnx with residuals, then backward.onnx on ONNX Runtime: the loss and the
    gradients of the train step (SGD: new = p − lr·grad) of the same graphs."""
    real, a = _setup("cnn.py", 2)
    graphs = step_graphs(a, kinds=("forward", "backward", "train_step"), residuals=True)
    manifest = export_all(graphs, tmp_path)
    plain = export_all(step_graphs(a, kinds=("forward",)), tmp_path / "plain")
    assert not [o for o in plain["graphs"]["forward"]["outputs"] if o.startswith("saved.")]
    gf, gb, gt = (manifest["graphs"][k] for k in ("forward", "backward", "train_step"))
    values = real_arguments(a.forward, real.model)
    phs = [n.name for n in a.forward.graph.nodes if n.op == "placeholder"]
    fwd_in = dict(zip(gf["inputs"], [values[n] for n in phs]))
    fwd_out = dict(zip(gf["outputs"], run(session(tmp_path / "forward.onnx", CPU), fwd_in)))
    feeds = {}
    for name in gb["inputs"]:
        if name == "ct_loss":
            feeds[name] = torch.ones(())
        elif name in fwd_out:
            feeds[name] = torch.from_numpy(fwd_out[name])
        else:
            feeds[name] = fwd_in[name.removeprefix("saved.")]
    grads = dict(zip(gb["outputs"], run(session(tmp_path / "backward.onnx", CPU), feeds)))
    lr = 0.5
    ts_in = {**fwd_in, "lr": torch.tensor(lr)}
    ts_out = dict(zip(gt["outputs"], run(session(tmp_path / "train_step.onnx", CPU), ts_in)))
    assert rel_error(torch.from_numpy(fwd_out["loss"]), torch.from_numpy(ts_out["loss"])) < 1e-6
    qual = [q for _, q in a.forward.meta[SIGNATURE].params]
    assert {f"grad.{q}" for q in qual} <= set(grads)
    for q in qual:
        step = (fwd_in[q] - torch.from_numpy(ts_out[f"new.{q}"])) / lr
        assert rel_error(torch.from_numpy(grads[f"grad.{q}"]), step) < 1e-4, q


@pytest.mark.slow  # 13 s
def test_weight_gradient_convolutions_as_matrix_products(tmp_path):
    """The CNN's four weight-gradient convolutions as per-position matrix products: the same
    FLOPs (graphflop's train-step total), the same numbers as the original graph in PyTorch and
    on ONNX Runtime, and the manifest still sums to the total."""
    from graphflop.runtime.bench import _step_feeds as bench_feeds
    from graphflop.runtime.graphs import conv_weight_grads_as_mm, on_device

    real, a = _setup("cnn.py", 2)
    ts = train_step_graph(a)
    new, count = conv_weight_grads_as_mm(ts)
    assert count == 4  # conv1…conv4's dW; the input gradients (transposed) stay convolutions
    convs = [n for n in new.graph.nodes if n.target is torch.ops.aten.convolution.default]
    assert all(n.meta.get(ROLE) != "grad_weight" for n in convs) and len(convs) == 4 + 3
    assert _graph_flops(new) == _graph_flops(ts) == a.report.totals.train_step.flops
    args = bench_feeds({"train_step": ts}, a, real.model, 1, 0.1)["train_step"][0]
    with torch.no_grad():
        ref, got = on_device(ts, "cpu")(*args), on_device(new, "cpu")(*args)
    for x, y in zip(got, ref):
        assert rel_error(x, y) < 1e-5
    manifest = export_all({"train_step": new}, tmp_path)
    g = manifest["graphs"]["train_step"]
    assert sum(e["flops"] for e in g["nodes"]) == _graph_flops(ts)
    out = run(session(tmp_path / "train_step.onnx", CPU), dict(zip(g["inputs"], args)))
    for x, y in zip(out, ref):
        assert rel_error(torch.from_numpy(x), y) < 1e-4


def _step_feeds(graph_inputs, info_inputs, values, state, lr, dtype=torch.float64):
    feeds = []
    for n in info_inputs:
        if n == "lr":
            feeds.append(torch.tensor(lr, dtype=dtype))
        elif n == "step":
            feeds.append(torch.tensor(1.0, dtype=dtype))
        elif n in state:
            feeds.append(state[n])
        else:
            feeds.append(values[n])
    return dict(zip(graph_inputs, feeds))


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_train_step_equals_one_torch_optim_step(tmp_path, optimizer):
    real = load(spec("mlp.py"), ctor_kwargs={"in_features": 64, "hidden": 32})
    real.model.train()
    a = analyze(real.model, make_inputs(real, shapes=[(8, 1, 8, 8)]), optimizer=optimizer)
    ts = train_step_graph(a)
    manifest = export_all({"train_step": ts}, tmp_path)
    g = manifest["graphs"]["train_step"]
    info = ts.meta[TRAIN_STEP]
    values = real_arguments(a.forward, real.model)
    sig = a.forward.meta[SIGNATURE]
    upd = a.update.meta[UPDATE]
    by_qual = {q: values[p] for p, q in sig.params}
    state = {
        n: torch.zeros_like(by_qual[lab.split(".", 1)[1]])
        for n, lab in zip(upd.state_names, upd.state_labels)
    }
    lr = 0.05
    feeds = _step_feeds(g["inputs"], info.inputs, values, state, lr, torch.float32)
    out = run(session(tmp_path / "train_step.onnx", CPU), feeds)
    # reference: the same model, loss and data, one torch.optim step
    model = copy.deepcopy(real.model)
    opt = {
        "sgd": lambda p: torch.optim.SGD(p, lr=lr),
        "momentum": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=lr),
        "adamw": lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.01),
    }[optimizer](model.parameters())
    x = values[sig.inputs[0]]
    t = values[sig.targets[0]]
    loss = torch.nn.functional.cross_entropy(model(x), t)
    loss.backward()
    opt.step()
    assert rel_error(torch.from_numpy(out[0]), loss.detach()) < 1e-6
    for i, q in enumerate(info.params):
        assert rel_error(torch.from_numpy(out[1 + i]), model.get_parameter(q).detach()) < 1e-4, q


def test_forward_gradient_step_onnx_matches_pytorch(tmp_path):
    real, a = _setup("mlp.py", 8)
    step = forward_gradient_graph(a.forward, "sgd")
    manifest = export_all({"forward_gradient_step": step}, tmp_path, name="mlp")
    assert manifest["model"] == "mlp" and list(manifest["graphs"]) == ["forward_gradient_step"]
    g = manifest["graphs"]["forward_gradient_step"]
    values = real_arguments(a.forward, real.model)
    args = []
    for n in step.graph.nodes:
        if n.op != "placeholder":
            continue
        args.append(
            torch.tensor(0.1)
            if n.name == "lr"
            else torch.randn(n.meta["val"].shape)
            if n.name.startswith("v0_")
            else values[n.name]
        )
    ref = step(*args)
    got = run(session(tmp_path / "forward_gradient_step.onnx", CPU), dict(zip(g["inputs"], args)))
    assert len(got) == len(ref)
    for x, y in zip(got, ref):
        assert rel_error(torch.from_numpy(x), y) < 1e-4


def test_unexportable_op_is_named_and_no_file_is_left(tmp_path):
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return torch.ops.aten.i0.default(x * self.w)

    from graphflop.ops._common import per_output
    from graphflop.testing import temporary_rule

    with temporary_rule(torch.ops.aten.i0.default, family="elementwise", cost=per_output(1)):
        a = analyze(Odd(), (torch.randn(2, 3),), loss="sum", backward=False, jvp=False)
        out = tmp_path / "out"
        with pytest.raises(OnnxExportError, match=r"aten\.i0\.default \(node i0"):
            export_all(a, out, graphs=("forward",))  # an Analysis: the graphs it holds
        assert not out.exists()
        assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.slow
def test_cli_export_and_bench(tmp_path):
    import json

    from graphflop.cli import main

    out = tmp_path / "onnx"
    assert main(["export", spec("logreg.py"), "--batch", "4", "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "backward.onnx",
        "forward.onnx",
        "forward_gradient_step.onnx",
        "manifest.json",
        "train_step.onnx",
    ]
    m = json.loads((out / "manifest.json").read_text())
    assert m["graphs"]["train_step"]["inputs"][:2] == ["fc.weight", "fc.bias"]
    assert "new.fc.weight" in m["graphs"]["train_step"]["outputs"]
    res = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                spec("logreg.py"),
                "--batch",
                "4",
                "--runtime",
                "both",
                "--device",
                "cpu",
                "--warmup",
                "1",
                "--repeat",
                "3",
                "--profile",
                "--json",
                str(res),
            ]
        )
        == 0
    )
    d = json.loads(res.read_text())
    # logistic regression 784→10 at batch 4: the matrix product 2·4·784·10 = 62,720, the bias
    # 4·10 = 40 and the cross-entropy loss 5·B·C + 9·B + 1 = 5·4·10 + 9·4 + 1 = 237
    # (docs/flops_conventions.md, tests/test_seed_a.py); the FLOP counts are graphflop's, the same
    # for both runtimes
    assert d["flops"]["forward"] == 2 * 4 * 784 * 10 + 4 * 10 + (5 * 4 * 10 + 9 * 4 + 1)
    for rt in ("onnxruntime", "torch"):
        ph, r = d["runtimes"][rt]["phases"], d["runtimes"][rt]["ratios"]
        assert set(ph) == {"forward", "train_step", "forward_gradient_step"}
        for k, v in ph.items():
            assert v["runs"] == 3 and v["q1_s"] <= v["median_s"] <= v["q3_s"]
            assert v["flops_per_s"] == d["flops"][k] / v["median_s"]
        fwd = ph["forward"]["median_s"]
        assert r["Rf"] == ph["forward_gradient_step"]["median_s"] / fwd
        assert r["Rb"] == ph["train_step"]["median_s"] / fwd
        assert r["Rf_over_Rb"] == r["Rf"] / r["Rb"]
    prof = d["runtimes"]["onnxruntime"]["profile"]["train_step"]
    assert prof["top_nodes"] and any(n["graphflop_node"] for n in prof["top_nodes"])


@pytest.mark.slow  # 15 s: an export of every step graph
def test_export_logs_nothing_through_onnx_ir(tmp_path):
    """Tester's finding: exporting an EmbeddingBag model printed onnx_ir's 'Attribute type is
    ambiguous because it is an empty sequence' six times; the exporter's loggers are quiet
    while graphflop exports (its own errors are one line)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("onnx_ir")
    logger.addHandler(handler)
    try:
        bag = nn.EmbeddingBag(20, 8, mode="mean")
        a = analyze(bag, (torch.tensor([[1, 0, 3], [4, 5, 0]]),), loss="sum")
        export_all(step_graphs(a), tmp_path)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []


@pytest.mark.slow  # about 10 s; run in CI with -m slow
def test_a_squeeze_of_no_size_one_dimension_exports(tmp_path):
    """A tester's finding: ``y.squeeze(1)`` of a (3, 4) tensor (PyTorch: a no-op) stopped the
    export (the exporter makes it ``prims.view_of``, which it cannot translate). It exports
    as an alias; forward.onnx's loss on ONNX Runtime equals graphflop's graph in PyTorch."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x).squeeze(1).relu()

    x = torch.randn(3, 8)
    a = analyze(M(), (x,), loss="sum")
    assert any("squeeze" in str(n.target) for n in a.forward.graph.nodes)
    manifest = export_all(step_graphs(a), tmp_path)
    assert set(manifest["graphs"]) == {"forward", "backward", "train_step", "forward_gradient_step"}
    values = real_arguments(a.forward, M())
    fv = run_forward(a.forward, values)
    g = manifest["graphs"]["forward"]
    names = [n.name for n in a.forward.graph.nodes if n.op == "placeholder"]
    # fed by graphflop's names for the placeholders: a constant the model made (an index
    # tensor) is in the file, not among its inputs (run feeds only the declared inputs)
    onnx_names = graph_io_names("forward", a.forward)[0]
    out = run(
        session(tmp_path / "forward.onnx", CPU), dict(zip(onnx_names, [values[n] for n in names]))
    )
    loss = torch.from_numpy(out[g["outputs"].index("loss")])
    assert rel_error(loss, fv[a.forward.meta[SIGNATURE].loss]) < 1e-6


@pytest.mark.slow  # (about 3 s: an ONNX export and an onnxruntime run; CI's slow pass)
def test_a_value_copied_into_a_row_exports_a_valid_model(tmp_path):
    """A tester's finding: ``h[:, 0] = 0.0`` (a 0-d value copied into a row) was exported as
    one ``CastLike`` of the source's shape: an invalid model (ONNX's checker and ONNX Runtime
    refuse it) written with exit status 0. The source is expanded first: every graph passes
    the full check and forward.onnx's loss on ONNX Runtime equals graphflop's graph."""
    import onnx

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            h = self.fc(x)
            h[:, 0] = 0.0
            return self.head(h)

    torch.manual_seed(0)
    model, x = M(), torch.randn(2, 8)
    a = analyze(model, (x,), loss="sum")
    manifest = export_all(step_graphs(a), tmp_path)
    for name in manifest["graphs"]:
        onnx.checker.check_model(onnx.load(tmp_path / f"{name}.onnx"), full_check=True)
    values = real_arguments(a.forward, model)
    fv = run_forward(a.forward, values)
    g = manifest["graphs"]["forward"]
    names = [n.name for n in a.forward.graph.nodes if n.op == "placeholder"]
    # fed by graphflop's names for the placeholders: a constant the model made (an index
    # tensor) is in the file, not among its inputs (run feeds only the declared inputs)
    onnx_names = graph_io_names("forward", a.forward)[0]
    out = run(
        session(tmp_path / "forward.onnx", CPU), dict(zip(onnx_names, [values[n] for n in names]))
    )
    loss = torch.from_numpy(out[g["outputs"].index("loss")])
    assert rel_error(loss, fv[a.forward.meta[SIGNATURE].loss]) < 1e-6


@pytest.mark.slow  # (the default suite's 5 minutes: run in CI's slow pass)
def test_batch_norm_kept_whole_exports_as_its_parts(tmp_path):
    # training-mode batch norm is one node in graphflop's graphs; ONNX Runtime's
    # BatchNormalization would normalise with the running statistics, so the export writes
    # PyTorch's decomposition of it: the forward loss and the backward's gradients match
    # PyTorch, and each ONNX node carries its share of the node's FLOPs once (no bias before
    # the batch norm: its gradient is exactly 0, rounding noise in both runs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, bias=False),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 5),
    ).train()
    a = analyze(model, (torch.randn(2, 3, 8, 8),))
    ops = {str(n.target) for n in a.forward.graph.nodes}
    assert "aten._native_batch_norm_legit_functional.default" in ops
    _export_and_compare(tmp_path, SimpleNamespace(model=model), a, "bn")
    import onnx

    forward = onnx.load(tmp_path / "forward.onnx")
    assert "BatchNormalization" not in {n.op_type for n in forward.graph.node}


def _ort_equals_eager(tmp_path, model, inputs, tol=1e-4):
    """Export ``model``'s forward and backward graphs (loss: the sum of its output), check each
    with ONNX's full checker, run them on ONNX Runtime's CPU provider with the model's
    parameters and ``inputs`` and compare with eager PyTorch: the forward's output with
    ``model(*inputs)``, the backward's parameter gradients with autograd's; the manifest's
    FLOPs sum to graphflop's (a rewritten node keeps its FLOPs). Returns the analysis."""
    import onnx

    a = analyze(model, inputs, loss="sum")
    manifest = export_all(step_graphs(a, kinds=("forward", "backward")), tmp_path)
    assert set(manifest["graphs"]) == {"forward", "backward"}
    for g in manifest["graphs"].values():
        onnx.checker.check_model(onnx.load(tmp_path / g["file"]), full_check=True)
    _check_manifest_flops(a, manifest)
    sig = a.forward.meta[SIGNATURE]
    values = real_arguments(a.forward, model) | dict(zip(sig.inputs, inputs))
    g = manifest["graphs"]["forward"]
    names = [n.name for n in a.forward.graph.nodes if n.op == "placeholder"]
    # fed by graphflop's names for the placeholders: a constant the model made (an index
    # tensor) is in the file, not among its inputs (run feeds only the declared inputs)
    onnx_names = graph_io_names("forward", a.forward)[0]
    out = run(
        session(tmp_path / "forward.onnx", CPU), dict(zip(onnx_names, [values[n] for n in names]))
    )
    model.zero_grad()
    eager = model(*inputs)
    eager.sum().backward()
    got = torch.from_numpy(out[g["outputs"].index("output_0")])
    assert rel_error(got, eager.detach()) < tol
    fv = run_forward(a.forward, values)
    g = manifest["graphs"]["backward"]
    bnames = [n for n in a.backward.graph.nodes if n.op == "placeholder"]
    feeds = {
        name: torch.ones(()) if name == "ct_loss" else fv[n.meta.get(SOURCE, n.name)]
        for name, n in zip(g["inputs"], bnames)
    }
    grads = dict(zip(g["outputs"], run(session(tmp_path / "backward.onnx", CPU), feeds)))
    for q, p in model.named_parameters():
        assert rel_error(torch.from_numpy(grads[f"grad.{q}"]), p.grad) < tol, q
    return a


class _Writes(nn.Module):
    """A linear layer, then one write into its output (``write(h, *indices)``)."""

    def __init__(self, write):
        super().__init__()
        self.fc, self.write = nn.Linear(4, 4), write

    def forward(self, x, *indices):
        return self.write(self.fc(x), *indices)


def _rows_mask_cols_slice(h, mask):
    h[mask, 1:3] = 0.5  # traced as index_put(h[:, 1:3], [mask], 0.5), slice_scatter'd back
    return h


def _cols_mask(h, mask):
    h[:, mask] = -1.0  # index_put(h, [None, mask], -1)
    return h


def _mask_and_index(h, mask, idx, accumulate):
    return torch.ops.aten.index_put.default(h, [mask, idx], torch.tensor(2.0), accumulate)


def _two_masks(h, rows, cols):
    return torch.ops.aten.index_put.default(h, [rows, cols], torch.tensor(3.0), True)


def _mask_mid_slice_3d(h, mask):
    h[:, mask, 1:] = 0.25  # index_put(h[:, :, 1:], [None, mask], 0.25) of a (2, 3, 4) h
    return h


_ROWS = torch.tensor([True, False, True])
_COLS = torch.tensor([False, True, True, False])


@pytest.mark.parametrize(
    "write,inputs",
    [
        # traced as a slice, then a mask alone: it exported before too (kept as a guard)
        pytest.param(_rows_mask_cols_slice, (_ROWS,), id="x[mask,1:3]=v"),
        pytest.param(_cols_mask, (_COLS,), id="x[:,mask]=v"),
        pytest.param(
            lambda h, m, i: _mask_and_index(h, m, i, False),
            (_ROWS, torch.tensor([3, 0])),
            id="x[mask,idx]=v",
        ),
        pytest.param(
            # the mask's 2 rows paired with the 2 columns, the second pair written twice
            lambda h, m, i: _mask_and_index(h, m, i, True),
            (torch.tensor([False, True, True]), torch.tensor([1, 1])),
            id="x[mask,idx]+=v",
        ),
        pytest.param(
            # 1 selected row broadcast against 2 selected columns (PyTorch's rule)
            _two_masks,
            (torch.tensor([False, True, False]), _COLS),
            id="x[mask,mask]+=v",
        ),
    ],
)
def test_index_put_with_a_mask_among_several_indices_exports(tmp_path, write, inputs):
    """A tester's finding: ``index_put`` with a boolean mask among several indices
    (``x[:, mask] = v``; a mask with an integer index or another mask, accumulating or not) was
    refused ('Boolean index_put with multiple indices does not support None indices', 'only
    1-D boolean masks'), or exported a model ONNX Runtime failed on (two masks whose
    coordinates broadcast). The mask is written as its coordinates (nonzero), as PyTorch reads
    it: both graphs pass the full check and ONNX Runtime's output and gradients equal eager
    PyTorch's."""
    torch.manual_seed(0)
    _ort_equals_eager(tmp_path, _Writes(write), (torch.randn(3, 4), *inputs))


def test_index_put_with_a_mask_between_slices_exports(tmp_path):
    torch.manual_seed(0)
    model = _Writes(_mask_mid_slice_3d)
    a = _ort_equals_eager(tmp_path, model, (torch.randn(2, 3, 4), _ROWS))
    puts = [n for n in a.forward.graph.nodes if n.target == torch.ops.aten.index_put.default]
    assert any(i is None for n in puts for i in n.args[1])  # [None, mask]: the refused form


class _Hypot(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.hypot(self.fc(x), x[:1])  # y broadcast over the rows


def test_hypot_exports_as_the_root_of_the_squares(tmp_path):
    """A tester's finding: ``aten.hypot`` was refused (the exporter has no function for it).
    It is written ``sqrt(x·x + y·y)``: ONNX Runtime's output and gradients equal eager
    PyTorch's, and the manifest keeps hypot's FLOPs (``_ort_equals_eager``)."""
    torch.manual_seed(0)
    a = _ort_equals_eager(tmp_path, _Hypot(), (torch.randn(3, 4),))
    assert any(n.target == torch.ops.aten.hypot.default for n in a.forward.graph.nodes)


def test_hypot_of_half_tensors_squares_in_float32():
    """hypot(300, 400) = 500 in float16, whose largest value is 65504: 300² overflows it, so
    the export squares 16-bit inputs in float32. ONNX Runtime's result equals PyTorch's."""
    import onnx

    from graphflop.export.onnx import export_graph

    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    h = g.call_function(torch.ops.aten.hypot.default, (x, y))
    g.output((h,))
    xs = torch.tensor([300.0, -3.0, 0.0], dtype=torch.float16)
    ys = torch.tensor([400.0, 4.0, 0.0], dtype=torch.float16)
    x.meta["val"], y.meta["val"], h.meta["val"] = xs, ys, torch.hypot(xs, ys)
    ex = export_graph(torch.fx.GraphModule({}, g), "forward", ["x", "y"], ["hypot"])
    assert ex.model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    want = torch.hypot(xs, ys)
    assert want[0] == 500
    (got,) = run(session(ex.model, CPU), {"x": xs, "y": ys})
    assert torch.equal(torch.from_numpy(got), want)
    # ONNX Runtime's CPU provider computes float16 Mul in float32 anyway; ONNX's reference
    # evaluator computes each op in its own type (inf here had the squares stayed float16)
    from onnx.reference import ReferenceEvaluator

    (got,) = ReferenceEvaluator(ex.model).run(None, {"x": xs.numpy(), "y": ys.numpy()})
    assert torch.equal(torch.from_numpy(got), want)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.float64, marks=pytest.mark.slow)]
)
def test_a_real_tensor_to_a_complex_power_exports(dtype):
    """``x ** (a + bi)`` of a real ``x`` (the derivative of ``x ** (0.5 + 1j)`` reads
    ``x ** (-0.5 + 1j)``) was refused: the exporter's ``pow`` takes the exponent with
    ``float()``. It is written from its real and imaginary parts (onnx_rewrites): ONNX
    Runtime's values equal PyTorch's principal value for positive, negative and zero bases,
    the zero base's 0, inf + NaN·i and NaN included. By hand: (-2) ** (0.5 + 1j) =
    e^(0.5·ln 2 − π)·(cos φ + i·sin φ), φ = ln 2 + π/2: −0.0390 + 0.0470i."""
    from graphflop.export.onnx import export_graph

    xs = torch.tensor([2.0, -2.0, 0.0, 3.5, -0.25, 1.0], dtype=dtype)
    complex_dtype = torch.complex64 if dtype == torch.float32 else torch.complex128
    # the exporter writes Python floats as float32 constants: π, which a negative base's
    # value holds, is good to 1.7e-7 in float64 too (the exponents are float32 numbers)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-6, "atol": 1e-12}
    for exponent in (0.5 + 1j, -0.5 + 1j, 2 + 0.25j, 1j):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        p = g.call_function(torch.ops.aten.pow.Tensor_Scalar, (x, exponent))
        g.output((p,))
        want = torch.pow(xs, exponent)
        x.meta["val"], p.meta["val"] = xs, want
        assert want.dtype == complex_dtype
        ex = export_graph(torch.fx.GraphModule({}, g), "forward", ["x"], ["power"])
        (got,) = run(session(ex.model, CPU), {"x": xs})
        got_c = torch.view_as_complex(torch.from_numpy(got).contiguous())
        assert got_c.dtype == complex_dtype
        for part in (torch.real, torch.imag):
            assert torch.allclose(part(got_c), part(want), equal_nan=True, **tol), exponent
        if dtype == torch.float64:  # without π: to float64's precision
            positive = xs > 0
            assert torch.allclose(got_c[positive], want[positive], rtol=1e-13, atol=0)
    minus_two = torch.pow(torch.tensor(-2.0), 0.5 + 1j)
    phi = math.log(2) + math.pi / 2
    hand = math.exp(0.5 * math.log(2) - math.pi) * complex(math.cos(phi), math.sin(phi))
    assert abs(complex(minus_two) - hand) < 1e-6 and round(hand.real, 4) == -0.0390


class _EmptyLikeTransposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x).t()  # (4, 3), strides (1, 4)
        out = torch.empty_like(h)  # the same strides: empty_permuted((4, 3), (1, 0))
        out[:] = h
        return out.t().reshape(-1) * 2  # a view of out.t(), dense only with out's strides


def test_empty_like_exports_with_its_strides(tmp_path):
    """A tester's finding: ``aten.empty_permuted`` (PyTorch's decomposition of ``empty_like``,
    which keeps the source's memory order) was refused. It is written ``empty_strided`` with
    the same strides; the graph's later views of it stay valid, ONNX Runtime's output and
    gradients equal eager PyTorch's."""
    torch.manual_seed(0)
    a = _ort_equals_eager(tmp_path, _EmptyLikeTransposed(), (torch.randn(3, 4),))
    (node,) = [
        n for n in a.forward.graph.nodes if n.target == torch.ops.aten.empty_permuted.default
    ]
    assert list(node.args[1]) == [1, 0]


def _rope_frequencies(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """Meta's LLaMA ``precompute_freqs_cis``: e^{i·t·θ^(-2k/dim)}, complex (end, dim / 2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


class _ComplexRope(nn.Module):
    """Rotary embeddings as Meta's LLaMA code writes them: pairs of features viewed as complex
    numbers (``view_as_complex``), multiplied by the complex frequencies, viewed as real again."""

    def __init__(self, heads=2, head_dim=8, length=4):
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(heads * head_dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(heads * head_dim, heads * head_dim, bias=False)
        self.register_buffer("freqs_cis", _rope_frequencies(head_dim, length), persistent=False)

    def rotate(self, x):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        freqs = self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, pairs.shape[-1])
        return torch.view_as_real(pairs * freqs).flatten(3)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.rotate(self.wq(x).view(b, t, self.heads, -1))
        k = self.rotate(self.wk(x).view(b, t, self.heads, -1))
        return (q * k).sum(-1)


@pytest.mark.slow  # (about 2 s: an ONNX export and an onnxruntime run; CI's slow pass)
def test_complex_rotary_embedding_exports(tmp_path):
    """A tester's finding: the backward of complex rotary embeddings (LLaMA's original code)
    holds ``aten.conj_physical`` (the cotangent of ``z·f`` with respect to ``z`` is
    ``ct·conj(f)``), which was refused. The exporter writes a complex tensor as its real and
    imaginary parts (``view_as_real``); ``conj_physical`` is written as the imaginary part
    negated there. The complex buffer and the backward's complex residual are fed in that
    form (``onnxrt.run``); ONNX Runtime's output and gradients equal eager PyTorch's."""
    torch.manual_seed(0)
    a = _ort_equals_eager(tmp_path, _ComplexRope(), (torch.randn(2, 4, 16),))
    ops = {n.target for n in a.backward.graph.nodes}
    assert torch.ops.aten.conj_physical.default in ops
    complex_inputs = [
        n for n in a.backward.graph.nodes if n.op == "placeholder" and n.meta["val"].is_complex()
    ]
    assert complex_inputs  # the rotated pairs' frequencies, saved for the backward
    # bench's feeds (as_declared): the complex buffer given as its real view too
    from graphflop.runtime.onnxrt import as_declared

    values = real_arguments(a.forward, _ComplexRope())
    names = [n.name for n in a.forward.graph.nodes if n.op == "placeholder"]
    sess = session(tmp_path / "forward.onnx", CPU)
    inputs = [i.name for i in sess.get_inputs()]
    assert [k for k, n in zip(inputs, names) if values[n].is_complex()] == ["freqs_cis"]
    feeds = as_declared(sess, {k: values[n].numpy() for k, n in zip(inputs, names)})
    assert feeds["freqs_cis"].shape == (4, 4, 2)  # (positions, pairs) + (real, imaginary)
    ref = run(sess, {k: values[n] for k, n in zip(inputs, names)})
    for x, y in zip(sess.run(None, feeds), ref):
        assert (x == y).all()


class _ComplexExp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        z = torch.view_as_complex(self.fc(x).view(-1, 2, 2))
        return torch.view_as_real(torch.exp(z)).sum()


def test_an_op_without_complex_translation_is_refused_saying_so(tmp_path):
    """The exporter translates complex values for some ops only (``exp`` not among them): the
    refusal names the op and node, says that complex values are what it cannot translate, and
    what to do."""
    a = analyze(_ComplexExp(), (torch.randn(3, 4),), loss="sum", backward=False, jvp=False)
    with pytest.raises(OnnxExportError) as info:
        export_all(a, tmp_path / "out", graphs=("forward",))
    message = str(info.value)
    assert "no function for complex values of aten.exp.default (node exp of the forward" in message
    assert "view_as_real" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


class _ComplexMoves(nn.Module):
    """Complex values moved without arithmetic (unsqueeze, expand, reshape, repeat, select): the
    exporter has no complex function for these, nor for the select_scatter, squeeze and complex
    zeros of the backward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        z = torch.view_as_complex(self.fc(x).view(3, 4, 2))
        v = z.unsqueeze(0).expand(2, 3, 4).reshape(2, 12).repeat(1, 2)
        return torch.view_as_real(v * v.select(1, 3).unsqueeze(1))


def test_complex_values_moved_without_arithmetic_export(tmp_path):
    """Each such op is applied to the real view (the real and imaginary parts move together):
    ONNX Runtime's output and gradients equal eager PyTorch's."""
    torch.manual_seed(0)
    a = _ort_equals_eager(tmp_path, _ComplexMoves(), (torch.randn(3, 8),))
    from graphflop.export.onnx_errors import complex_argument

    moved = {
        op_name(n.target)
        for g in (a.forward, a.backward)
        for n in g.graph.nodes
        if n.op == "call_function" and complex_argument(n)
    }
    for op in ("unsqueeze.default", "expand.default", "repeat.default", "select.int"):
        assert f"aten.{op}" in moved
    assert {"aten.select_scatter.default", "aten.squeeze.dims"} <= moved
