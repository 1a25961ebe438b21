"""A tensor the model makes in its forward (``torch.tensor([...])``) is written into the
exported ONNX files as an initializer holding its value, so that each file runs on the inputs
its manifest documents; checked against eager PyTorch on ONNX Runtime."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
from torch import nn
from torch.func import functional_call, jvp

from graphflop.analysis import analyze
from graphflop.export.onnx import export_all, export_graph, graph_io_names
from graphflop.runtime.graphs import step_graphs
from graphflop.runtime.onnxrt import run, session

CPU = "CPUExecutionProvider"
IDX = [0, 2, 2, 5]


class _ConstantIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor(IDX)
        return self.fc(x).index_add(1, idx, x[:, :4])


def _close(got, want: torch.Tensor) -> None:
    assert torch.allclose(torch.from_numpy(got), want.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # (the default suite's 5 minutes: run in CI's slow pass)
def test_constant_is_an_initializer_and_each_file_runs_on_its_inputs(tmp_path) -> None:
    """Tester's finding: forward.onnx, train_step.onnx and forward_gradient_step.onnx took
    ``_tensor_constant0`` as an input the manifest gave no value for."""
    torch.manual_seed(0)
    model = _ConstantIndex()
    x, target = torch.randn(2, 8), torch.tensor([1, 4])
    a = analyze(model, (x,))
    manifest = export_all(step_graphs(a, residuals=True), tmp_path, name="c")
    graphs = manifest["graphs"]
    for kind in ("forward", "train_step", "forward_gradient_step"):
        g = graphs[kind]
        assert g["constants"] == ["_tensor_constant0"] and "unknown_constants" not in g
        proto = onnx.load(tmp_path / g["file"])
        assert [i.name for i in proto.graph.input] == g["inputs"]
        init = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
        assert init["_tensor_constant0"].tolist() == IDX
    params = {k: p.detach() for k, p in model.named_parameters()}
    values = {"fc.weight": params["fc.weight"], "fc.bias": params["fc.bias"]}
    values |= {"input_0": x, "target": target, "lr": torch.tensor(0.1)}
    v = {k: torch.randn_like(p) for k, p in params.items()}
    values |= {f"direction.{k}": d for k, d in v.items()}

    def feeds(kind: str) -> dict:
        return {n: values[n] for n in graphs[kind]["inputs"]}

    def loss_of(p: dict) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), target)

    # forward: the loss and the model's output
    out = dict(
        zip(
            graphs["forward"]["outputs"],
            run(session(tmp_path / "forward.onnx", CPU), feeds("forward")),
        )
    )
    _close(out["loss"], loss_of(params))
    _close(out["output_0"], model(x))
    # backward, fed the forward's residuals (saved.input_0 is the forward's input_0)
    bfeeds = {"ct_loss": torch.ones(())}
    for n in graphs["backward"]["inputs"][1:]:
        bfeeds[n] = out[n] if n in out else values[n.removeprefix("saved.")]
    grads = dict(
        zip(graphs["backward"]["outputs"], run(session(tmp_path / "backward.onnx", CPU), bfeeds))
    )
    ref = copy.deepcopy(model)
    nn.functional.cross_entropy(ref(x), target).backward()
    for k, p in ref.named_parameters():
        _close(grads[f"grad.{k}"], p.grad)
    # train step: one SGD step
    got = dict(
        zip(
            graphs["train_step"]["outputs"],
            run(session(tmp_path / "train_step.onnx", CPU), feeds("train_step")),
        )
    )
    for k, p in ref.named_parameters():
        _close(got[f"new.{k}"], p.detach() - 0.1 * p.grad)
    # forward-gradient step: d = ∂loss·v, p ← p − lr·d·v
    loss, d = jvp(loss_of, (params,), (v,))
    kind = "forward_gradient_step"
    got = dict(
        zip(graphs[kind]["outputs"], run(session(tmp_path / f"{kind}.onnx", CPU), feeds(kind)))
    )
    _close(got["loss"], loss)
    _close(got["directional_derivative_0"], d)
    for k, p in params.items():
        _close(got[f"new.{k}"], p - 0.1 * d * v[k])


def test_constant_of_unknown_value_stays_an_input_and_is_noted(tmp_path) -> None:
    """A constant whose value is not known (a meta tensor) cannot be written: it stays an
    input, listed under ``unknown_constants``, and ``graphflop export`` says so in one note."""
    from graphflop.cli.export import _unknown_constant_notes

    a = analyze(_ConstantIndex(), (torch.randn(2, 8),), jvp=False)
    ins, outs = graph_io_names("forward", a.forward)
    meta = {"c__tensor_constant0": torch.empty(4, dtype=torch.long, device="meta")}
    ex = export_graph(a.forward, "forward", ins, outs, meta)
    assert ex.constants == [] and ex.unknown_constants == ["_tensor_constant0"]
    assert "_tensor_constant0" in ex.inputs
    assert "_tensor_constant0" in [i.name for i in ex.model.graph.input]
    manifest = {"graphs": {"forward": {"unknown_constants": ex.unknown_constants}}}
    (note,) = _unknown_constant_notes(manifest)
    assert "_tensor_constant0" in note and "not known" in note
    assert _unknown_constant_notes({"graphs": {"forward": {}}}) == []


@pytest.mark.slow  # (the default suite's 5 minutes: run in CI's slow pass)
def test_step_graphs_carry_the_constants_without_the_forward(tmp_path) -> None:
    """The train step and forward-gradient step exported alone (``train --runtime
    onnxruntime`` exports one graph) still hold the constant; the ONNX runner feeds only the
    file's inputs and gives the fx graph's outputs."""
    from graphflop.meta import CONSTANTS
    from graphflop.runtime.graphs import forward_gradient_graph, train_step_graph
    from graphflop.train.runners import FxRunner, OrtRunner

    torch.manual_seed(0)
    model = _ConstantIndex()
    a = analyze(model, (torch.randn(2, 8),))
    ts, fg = train_step_graph(a), forward_gradient_graph(a.forward, "sgd")
    assert ts.meta[CONSTANTS] is a.forward.meta[CONSTANTS]
    manifest = export_all({"train_step": ts, "forward_gradient_step": fg}, tmp_path)
    for g in manifest["graphs"].values():
        assert g["constants"] == ["_tensor_constant0"] and "_tensor_constant0" not in g["inputs"]
    phs = [n for n in ts.graph.nodes if n.op == "placeholder"]
    values = {n.name: torch.randn(n.meta["val"].shape) for n in phs}
    values |= {"c__tensor_constant0": torch.tensor(IDX), "args_1": torch.tensor([1, 4])}
    values["lr"] = torch.tensor(0.1)
    ort = OrtRunner(ts, "train_step", CPU)
    assert "_tensor_constant0" not in [o for o, _ in ort.feed_names]
    for got, want in zip(ort(values), FxRunner(ts)(values)):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
