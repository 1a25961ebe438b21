"""graphflop bench: the bookkeeping of the timing (alternating rounds, quartiles, the noisy
flag), the three runtimes on a BatchNorm model, direction sampling inside the step, and where
--profile writes. No timing is asserted: the machine is shared."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from conftest import spec
from torch import nn

from graphflop.analysis import analyze
from graphflop.load import load, make_inputs
from graphflop.runtime import timing
from graphflop.runtime.bench import (
    PHASES,
    SAMPLING,
    bench_graph_torch,
    bench_onnxruntime,
    bench_torch,
    timing_report,
)
from graphflop.runtime.timing import Timing, summarize, time_phases


def test_rounds_alternate_and_quartiles_are_the_runs(monkeypatch):
    calls = []
    clock = iter(range(1000))  # each perf_counter read advances one tick
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    fns = {k: (lambda i, k=k: calls.append((k, i))) for k in ("a", "b", "c")}
    t = time_phases(fns, warmup=1, repeat=3, sync=lambda: None)
    # one warm-up round, then three timed rounds, each running a, b, c once in order
    warm = [("a", 0), ("b", 0), ("c", 0)]
    assert calls == warm + [(k, i) for i in (0, 1, 2) for k in ("a", "b", "c")]
    for k in fns:  # every run read the clock twice, consecutive ticks: 1 s each
        assert t[k].times == (1.0, 1.0, 1.0) and t[k].median_s == 1.0 and t[k].runs == 3


def test_spread_flags_a_noisy_phase():
    # statistics.quantiles([1, 2, 3, 4, 5], n=4) (exclusive method) = [1.5, 3, 4.5]
    t = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (t.median_s, t.q1_s, t.q3_s) == (3.0, 1.5, 4.5)
    assert t.spread == pytest.approx(3.0 / 3.0) and t.noisy
    quiet = summarize([1.0, 1.01, 1.02, 0.99, 1.0])  # quartiles 0.995–1.015: 2% of 1.0
    assert quiet.spread == pytest.approx(0.02) and not quiet.noisy
    lines = timing.noisy_phases({"onnxruntime": {"forward": t, "train_step": quiet}})
    assert len(lines) == 1 and "onnxruntime forward" in lines[0] and "100%" in lines[0]


def test_round_ratios_are_per_round():
    f = Timing(1.0, 1.0, 1.0, 3, (1.0, 2.0, 4.0))
    tr = Timing(2.0, 2.0, 2.0, 3, (2.0, 6.0, 4.0))  # per-round Rb: 2, 3, 1
    fg = Timing(3.0, 3.0, 3.0, 3, (3.0, 2.0, 4.0))  # per-round Rf: 3, 1, 1
    doc = timing_report(
        {"forward": f, "train_step": tr, "forward_gradient_step": fg},
        {k: 1 for k in PHASES},
        "onnxruntime",
    )
    assert doc["round_ratios"]["Rb"]["median"] == statistics.median([2.0, 3.0, 1.0])
    assert doc["round_ratios"]["Rf"]["median"] == 1.0
    assert doc["ratios"]["Rf"] == 3.0 and doc["ratios"]["Rb"] == 2.0  # ratios of medians
    assert doc["sampling_in_step"] is True and doc["sampling"] == SAMPLING["onnxruntime"]


def test_bench_table_shows_the_medians_of_the_per_round_ratios(capsys):
    """A tester's finding: the table showed ratios of medians (Rf 3.00 here) beside the
    quartiles of the per-round ratios (1.00–2.00), while docs/seed-b/bench.md reports the
    medians of the per-round ratios. Per-round Rf 3, 1, 1: median 1, quartiles (exclusive
    method) 1 and 3; Rb 2, 3, 1: median 2, quartiles 1 and 3; Rf/Rb 3/2, 2/6, 4/4: median 1,
    quartiles 1/3 and 3/2."""
    from graphflop.cli.bench import _print_times

    f = Timing(1.0, 1.0, 1.0, 3, (1.0, 2.0, 4.0))
    tr = Timing(2.0, 2.0, 2.0, 3, (2.0, 6.0, 4.0))
    fg = Timing(3.0, 3.0, 3.0, 3, (3.0, 2.0, 4.0))
    doc = timing_report(
        {"forward": f, "train_step": tr, "forward_gradient_step": fg},
        {k: 1 for k in PHASES},
        "torch",
    )
    _print_times({"model": "m", "device": "cpu", "runtimes": {"torch": doc | {"device": "cpu"}}})
    out = capsys.readouterr().out
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if "torch (cpu)" in line)
    cells = [[c.strip() for c in lines[j].strip(" │").split("│")[-3:]] for j in (i, i + 1)]
    assert cells == [["1.00", "2.00", "1.00"], ["(1.00–3.00)", "(1.00–3.00)", "(0.33–1.50)"]]
    assert "median (quartiles) of the per-round ratios" in " ".join(out.split())


class LinearBatchNorm(nn.Module):
    """Linear → BatchNorm1d → ReLU → Linear: running statistics change in every train step."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


@pytest.mark.slow  # 10 s
def test_batchnorm_model_benches_on_every_runtime(tmp_path):
    model = LinearBatchNorm().train()
    x = torch.randn(4, 6)
    a = analyze(model, (x,))
    kw = dict(warmup=1, repeat=2, rotate=2)
    before = model.bn.running_mean.clone()
    t = {
        "torch": bench_torch(a, model, device="cpu", **kw),
        "graph_torch": bench_graph_torch(a, model, device="cpu", **kw),
        "onnxruntime": bench_onnxruntime(a, model, provider="CPUExecutionProvider", **kw)[0],
    }
    for rt, phases in t.items():
        assert set(phases) == set(PHASES), rt
        assert all(p.runs == 2 and p.q1_s <= p.median_s <= p.q3_s for p in phases.values()), rt
    # the eager steps updated the running statistics (train step and torch.func.jvp alike)
    assert not torch.equal(model.bn.running_mean, before)


class _Attention(nn.Module):
    """Attention without dropout: eager CPU runs PyTorch's fused kernel, which has no
    forward-mode derivative."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum(1)


def test_torch_runtime_runs_forward_mode_through_fused_attention():
    """bench's eager forward-gradient step (torch.func.jvp) runs attention on the math kernel:
    on the fused CPU kernel torch.func.jvp raises (checked first, so the test can fail)."""
    model = _Attention()
    x = torch.randn(2, 5, 8)
    with pytest.raises(Exception, match="forward AD|not implemented"):
        f = lambda p: torch.func.functional_call(model, p, (x,)).sum()  # noqa: E731
        params = dict(model.named_parameters())
        torch.func.jvp(f, (params,), ({k: torch.ones_like(v) for k, v in params.items()},))
    phases = bench_torch(analyze(model, (x,)), model, device="cpu", warmup=1, repeat=2, rotate=2)
    assert phases["forward_gradient_step"].runs == 2


def test_graph_torch_samples_a_new_direction_each_step():
    """The forward-gradient graph graph_torch runs draws its direction inside: two calls on
    the same inputs give different directional derivatives (the last output)."""
    from graphflop.export.onnx import graph_io_names
    from graphflop.runtime.bench import _step_feeds
    from graphflop.runtime.graphs import on_device, step_graphs

    real = load(spec("logreg.py"))
    a = analyze(real.model, make_inputs(real, batch=4))
    graphs = step_graphs(a, kinds=("forward_gradient_step",), sampling=True)
    ins = graph_io_names("forward_gradient_step", graphs["forward_gradient_step"])[0]
    assert not [n for n in ins if n.startswith("direction")]  # no direction is fed
    args = _step_feeds(graphs, a, real.model, 1, 0.1)["forward_gradient_step"][0]
    gm = on_device(graphs["forward_gradient_step"], "cpu")
    with torch.no_grad():
        d1, d2 = gm(*args)[-1], gm(*args)[-1]
    assert torch.isfinite(d1) and not torch.equal(d1, d2)


@pytest.mark.slow
def test_cli_bench_all_runtimes_and_profile_under_out(tmp_path, monkeypatch):
    from graphflop.cli import main

    monkeypatch.chdir(tmp_path)
    out, res = tmp_path / "run", tmp_path / "bench.json"
    argv = ["bench", spec("logreg.py"), "--batch", "4", "--device", "cpu", "--warmup", "0"]
    argv += ["--repeat", "2", "--profile", "--out", str(out), "--json", str(res)]
    assert main(argv) == 0
    d = json.loads(res.read_text())
    assert list(d["runtimes"]) == ["torch", "graph_torch", "onnxruntime"]
    for doc in d["runtimes"].values():
        assert doc["sampling_in_step"] is True
        assert set(doc["round_ratios"]) == {"Rf", "Rb", "Rf_over_Rb"}
    kinds = sorted(p.name.split("_2")[0] for p in (out / "profile").iterdir())
    assert kinds == ["forward", "forward_gradient_step", "train_step"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "run"]  # cwd: nothing


class ConvBatchNorm(nn.Module):
    """Conv2d → BatchNorm2d → ReLU → spatial mean → Linear (the tester's bn.py): a training
    batch norm traces to ``aten.var_mean.correction``, which the ONNX exporter decomposes, and
    the conv's weight gradient is rewritten as matrix products for ONNX Runtime."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.c(x))).mean((2, 3)))


@pytest.mark.slow  # 15 s
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_onnxruntime_train_step_of_a_conv_batchnorm_model_is_one_sgd_step(tmp_path, mode):
    """bench's ONNX Runtime train step (weight gradients as matrix products) of a Conv2d +
    BatchNorm2d model, in train and eval mode: loss, new parameters and (train mode) new running
    statistics equal one eager ``torch.optim.SGD`` step on the same data and targets."""
    import copy

    import onnx

    from graphflop.passes.conv_wgrad import conv_weight_grads_as_mm
    from graphflop.runtime.bench import _step_feeds
    from graphflop.runtime.graphs import step_graphs
    from graphflop.runtime.onnxrt import run, session
    from graphflop.runtime.verify import rel_error

    torch.manual_seed(0)
    model = getattr(ConvBatchNorm(), mode)()
    a = analyze(model, (torch.randn(2, 3, 8, 8),))
    assert a.train_step is not None
    assert conv_weight_grads_as_mm(a.train_step)[1] == 1  # c.weight's dW: the rewrite is used
    lr, kw = 0.5, dict(warmup=0, repeat=1, rotate=1)
    bench_onnxruntime(a, model, provider="CPUExecutionProvider", lr=lr, export_dir=tmp_path, **kw)
    ts = onnx.load(str(tmp_path / "onnx" / "train_step.onnx"))
    names = [i.name for i in ts.graph.input]
    graphs = step_graphs(a, kinds=("train_step",), sampling=True, wgrad_mm=True)
    feeds = dict(zip(names, _step_feeds(graphs, a, model, 1, lr)["train_step"][0]))
    out = dict(
        zip([o.name for o in ts.graph.output], run(session(ts, "CPUExecutionProvider"), feeds))
    )
    # reference: the same model, data and targets, one eager SGD step
    ref = copy.deepcopy(model)
    loss = nn.functional.cross_entropy(ref(feeds["input_0"]), feeds["target"])
    loss.backward()
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    assert rel_error(torch.from_numpy(out["loss"]), loss.detach()) < 1e-5
    # the update lr·∇L of every parameter, all in one vector (c.bias's is zero in exact
    # arithmetic in train mode: batch norm removes a per-channel shift)
    qual = [q for q, _ in ref.named_parameters()]
    step = torch.cat([torch.from_numpy(feeds[q].numpy() - out[f"new.{q}"]).flatten() for q in qual])
    want = torch.cat([(feeds[q] - ref.get_parameter(q).detach()).flatten() for q in qual])
    assert rel_error(step, want) < 1e-4 and want.norm() > 1e-2
    if mode == "train":  # the running statistics moved by momentum 0.1 towards the batch's
        for q in ("bn.running_mean", "bn.running_var"):
            assert rel_error(torch.from_numpy(out[f"new.{q}"]), ref.get_buffer(q)) < 1e-5, q
    else:
        assert not any(o.startswith("new.bn.running") for o in out)


def test_exporter_failure_is_one_line_without_colour_or_torch_logs(capfd):
    """A graph torch.export cannot trace (a view of a transposed copy): the error is the root
    cause's first line, without the exporter's ANSI colours, and torch's loggers print nothing."""
    import torch.fx

    from graphflop.export.onnx import OnnxExportError, export_graph

    class Bad(nn.Module):
        def forward(self, x):
            return torch.ops.aten.view.default(torch.ops.aten.clone.default(x.t()), [-1])

    gm = torch.fx.symbolic_trace(Bad())
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["val"] = torch.empty(3, 4, device="meta")
    capfd.readouterr()
    with pytest.raises(OnnxExportError) as info:
        export_graph(gm, "forward", ["x"], ["y"])
    msg = str(info.value)
    assert "\n" not in msg and "\x1b" not in msg
    assert msg.startswith("exporting the forward graph to ONNX failed: torch.export")
    assert "view" in msg  # the root cause, not the exporter's advice block
    captured = capfd.readouterr()
    assert "always_classified" not in captured.err and captured.err == "", captured.err


def test_exporter_error_line_strips_colour_and_keeps_the_root_cause():
    from torch.onnx._internal.exporter._errors import TorchExportError

    from graphflop.export.onnx_errors import exporter_error_line

    root = ValueError("Cannot view a tensor\n\nWhile executing %view")
    try:
        raise TorchExportError("Failed. \x1b[96mThis is step 1/3\x1b[0m of it.\n- advice") from root
    except TorchExportError as e:
        line = exporter_error_line(e)
    expected = "torch.export (the exporter's step 1) failed: ValueError: Cannot view a tensor"
    assert line == expected
    assert exporter_error_line(RuntimeError("\x1b[1mbold\x1b[0m text\nmore")) == "bold text"


def test_training_batch_norm_is_not_blamed_on_the_exporter():
    """A training-mode batch norm is one node (``_native_batch_norm_legit_functional``),
    which ONNX export writes as PyTorch's decomposition (ONNX's BatchNormalization normalises
    with the running statistics): no op of the train step is unexportable."""
    from graphflop.export.onnx_errors import unexportable_node

    a = analyze(ConvBatchNorm().train(), (torch.randn(2, 3, 8, 8),))
    targets = {n.target for n in a.train_step.graph.nodes}
    assert torch.ops.aten._native_batch_norm_legit_functional.default in targets
    assert unexportable_node(a.train_step) is None


class LastStepLSTM(nn.Module):
    """LSTM (batch first) → Linear on the last step: the tester's lstm_bf.py."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


def test_eager_jvp_through_an_lstm_equals_the_gradient_dot_direction():
    """Tester's finding: torch.func.jvp through nn.LSTM on CPU raises ("forward
    AD with mkldnn_rnn_layer") on oneDNN's fused kernel; under eager_jvp it runs PyTorch's
    native kernels and gives the directional derivative ∇L·v (autograd's, float64)."""
    from graphflop.runtime.attention import eager_jvp, has_fused_rnn

    torch.manual_seed(0)
    m = LastStepLSTM()
    x = torch.randn(2, 5, 8)
    params = {k: p.detach() for k, p in m.named_parameters()}
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def f(p):
        return torch.func.functional_call(m, p, (x,)).square().sum()

    if torch.backends.mkldnn.is_available():
        with pytest.raises(NotImplementedError):
            torch.func.jvp(f, (params,), (v,))
    with eager_jvp("cpu", has_fused_rnn(m)):
        _, d = torch.func.jvp(f, (params,), (v,))
    m64 = LastStepLSTM().double()
    m64.load_state_dict(m.state_dict())
    loss = m64(x.double()).square().sum()
    grads = torch.autograd.grad(loss, list(m64.parameters()))
    want = sum((g * v[k].double()).sum() for (k, _), g in zip(m64.named_parameters(), grads))
    assert torch.isclose(d.double(), want, rtol=1e-4), (float(d), float(want))
    assert torch._C._get_mkldnn_enabled() == torch.backends.mkldnn.is_available()  # restored


def test_cli_bench_torch_runtime_on_an_lstm_notes_the_kernels(tmp_path):
    from graphflop.cli import main

    path = tmp_path / "lstm.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.rnn = nn.LSTM(8, 16, batch_first=True)\n"
        "        self.fc = nn.Linear(16, 4)\n"
        "    def forward(self, x):\n"
        "        return self.fc(self.rnn(x)[0][:, -1])\n"
        "def example_inputs():\n"
        "    return (torch.randn(2, 5, 8),)\n"
    )
    res = tmp_path / "b.json"
    argv = ["bench", f"{path}:M", "--runtime", "torch", "--warmup", "0", "--repeat", "1"]
    assert main([*argv, "--json", str(res)]) == 0  # was an internal error
    doc = json.loads(res.read_text())["runtimes"]["torch"]
    assert "native kernels" in doc["rnn_note"]
    assert set(doc["phases"]) == set(PHASES)
