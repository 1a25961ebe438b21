"""``inspect --plot-memory``: the live-bytes timelines behind the reported
memory peaks (graphflop.export.memory_timeline) and their picture (graphflop.export.memory_plot).

The plot is true only if its curve's maximum is the reported figure: the timelines are rebuilt
from the analysis's graphs with a baseline worked out from the report's parameter, gradient and
state bytes, and compared with ``train_peak_bytes``/``jvp_peak_bytes``, which the summary
computes on its own."""

from __future__ import annotations

import matplotlib
import pytest
import torch
from conftest import ConvBnDropPool, ConvRes
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from graphflop.analysis import analyze
from graphflop.cli import main
from graphflop.export.memory_timeline import memory_timeline
from graphflop.passes.memory import Schedule

matplotlib.use("Agg")


_MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10)), (4, 20)),
    "conv_bn_dropout": (ConvBnDropPool, (2, 3, 16, 16)),
}
_SETTINGS = {
    "eager": {"memory_model": "eager"},
    "graph": {"memory_model": "graph"},
    "eager_keep_grads_adam": {"memory_model": "eager", "keep_grads": True, "optimizer": "adam"},
    "graph_keep_grads_momentum": {
        "memory_model": "graph",
        "keep_grads": True,
        "optimizer": "momentum",
    },
    "eager_cuda_adam": {"memory_model": "eager", "device": "cuda", "optimizer": "adam"},
}


def _analysis(model: str, **options):
    build, shape = _MODELS[model]
    torch.manual_seed(0)
    return analyze(build(), (torch.randn(*shape),), **options)


@pytest.mark.parametrize("setting", sorted(_SETTINGS))
@pytest.mark.parametrize("model", sorted(_MODELS))
def test_timeline_peaks_equal_the_reported_peaks(model: str, setting: str) -> None:
    a = _analysis(model, **_SETTINGS[setting])
    mem = a.report.memory
    train, jvp = memory_timeline(a)
    assert (train.kind, jvp.kind) == ("train", "jvp")
    assert train.peak_bytes == max(train.live_bytes) + train.baseline_bytes
    assert train.peak_bytes == mem.train_peak_bytes
    assert jvp.peak_bytes == max(jvp.live_bytes) + jvp.baseline_bytes == mem.jvp_peak_bytes
    # the baseline: parameters, buffers (batch norm's running statistics: 2 × 8 float32 and
    # an int64 count = 72 B where the model has one) and optimizer state, and the gradients
    # where they live throughout (graph model, or --keep-grads); JVP: parameters, buffers and
    # the parameters' tangents. Adam's state: two moments and, under the eager model, a
    # float32 step count per parameter tensor (torch.optim.Adam's state["step"])
    moments = {"sgd": 0, "momentum": 1, "adam": 2}[a.report.optimizer]
    tensors = len(list(_MODELS[model][0]().parameters()))
    steps = 4 * tensors if a.report.optimizer == "adam" else 0
    state = moments * mem.params_bytes + (steps if mem.memory_model == "eager" else 0)
    grads = mem.params_bytes if mem.memory_model == "graph" or mem.keep_grads else 0
    buffers = mem.buffers_bytes or 0
    assert train.baseline_bytes == mem.params_bytes + buffers + grads + state
    assert jvp.baseline_bytes == 2 * mem.params_bytes + buffers
    # the phases cover every step in order: forward, backward, update
    assert [p for p, _, _ in train.phases] == ["forward", "backward", "update"]
    assert train.phases[0][1] == 0 and train.phases[-1][2] == len(train.live_bytes)
    assert all(a[2] == b[1] for a, b in zip(train.phases, train.phases[1:]))
    # the tensors labelled at the peak are everything live there: they add up to it
    for tl in (train, jvp):
        assert sum(t.nbytes for t in tl.peak_tensors) == tl.live_bytes[tl.peak_step]
        assert [t.nbytes for t in tl.peak_tensors] == sorted(
            (t.nbytes for t in tl.peak_tensors), reverse=True
        )


def test_schedule_timeline_by_hand() -> None:
    # x (4 float32: 16 B) -> a = 2x -> b = a + 1 -> c = a·b, c returned (kept to the end)
    def f(x: torch.Tensor) -> torch.Tensor:
        a = x * 2
        return a * (a + 1)

    gm = make_fx(f)(torch.randn(4))
    names = [n.name for n in gm.graph.nodes if n.op != "output"]
    assert names == ["x_1", "mul", "add", "mul_1"]
    s = Schedule()
    s.add_graph(gm, "g", baseline=set(), keep_outputs=True)
    # step 0: x; 1: x, a (x's last reader: freed after); 2: a, b; 3: a, b, c; output: c
    assert s.timeline() == [16, 32, 32, 48, 16]
    assert s.peak() == (48, "g:mul_1")
    assert s.live_at(3) == {"g:mul": 16, "g:add": 16, "g:mul_1": 16}
    assert s.live_at(-1) == {"g:mul_1": 16}
    with pytest.raises(IndexError):
        s.live_at(5)
    s.add_transient("u:tmp", 100)  # a kernel's temporaries: live at their one step only
    assert s.timeline()[-1] == 16 + 100 and s.peak() == (116, "u:tmp")


def test_labels_name_the_largest_tensors() -> None:
    # the MLP's graph-model train step: 4×20 input, 4×32 hidden, 4×10 logits, float32
    a = _analysis("mlp", memory_model="graph", jvp=False)
    (train,) = memory_timeline(a)
    top = train.peak_tensors[0]
    assert top.nbytes == max(t.nbytes for t in train.peak_tensors)
    assert top.shape is not None and top.dtype == "float32"
    # shape × 4 bytes, except where the memory model counts the storage otherwise
    assert top.nbytes == 4 * int(torch.tensor(top.shape).prod())
    assert top.phase in ("forward", "backward", "update")


def test_forward_only_draws_the_forward_peak() -> None:
    a = _analysis("mlp", backward=False, jvp=False)
    (fwd,) = memory_timeline(a)
    assert fwd.kind == "forward" and fwd.peak_bytes == a.report.memory.forward_peak_bytes
    assert [p for p, _, _ in fwd.phases] == ["forward"]


def test_compiled_model_is_refused() -> None:
    from dataclasses import replace

    a = _analysis("mlp", jvp=False)
    a = replace(
        a, report=replace(a.report, memory=replace(a.report.memory, memory_model="compiled"))
    )
    with pytest.raises(ValueError, match="compiled"):
        memory_timeline(a)


def test_figure_marks_the_reported_peaks() -> None:
    from matplotlib.text import Text

    from graphflop.export.memory_plot import _figure

    a = _analysis("conv_bn_dropout", checkpoint="0", amp="bf16")
    timelines = memory_timeline(a)
    fig = _figure(a, timelines)
    texts = "\n".join(t.get_text() for t in fig.findobj(Text))
    mem = a.report.memory
    for figure in (mem.train_peak_bytes, mem.jvp_peak_bytes):
        assert f"peak {figure / 2**10:.2f} KiB" in texts  # 10–100 KiB: KiB units
    assert timelines[0].peak_tensors[0].name in texts
    assert "memory model eager on cpu" in texts
    assert f"what-if --amp bf16: peak {mem.amp.train_peak_bytes / 2**10:.2f} KiB" in texts
    assert "what-if --checkpoint 0" in texts


MLP_SPEC = ["models/mlp.py", "--arg", "hidden=32", "--batch", "4"]


@pytest.mark.parametrize(
    "suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")]
)
def test_cli_writes_each_format(tmp_path, capsys, suffix: str, magic: bytes) -> None:
    path = tmp_path / "sub" / f"mem{suffix}"
    rc = main(["inspect", *MLP_SPEC, "--no-jvp", "--plot-memory", str(path)])
    capsys.readouterr()
    assert rc == 0 and path.read_bytes().startswith(magic)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--plot-memory", "{d}/mem.jpg"], "unsupported suffix"),
        (["--plot-memory", "{d}/file.txt/mem.png"], "is a file, not a folder"),
        (["--plot-memory", "{d}/mem.png", "--memory-model", "compiled"], "--memory-model compiled"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, flags, message) -> None:
    (tmp_path / "file.txt").write_text("")
    flags = [f.format(d=tmp_path) for f in flags]
    rc = main(["inspect", *MLP_SPEC, *flags])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_cli_integer_output_plots_the_forward(tmp_path, capsys) -> None:
    spec = tmp_path / "argmax.py"
    spec.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 3)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x).argmax(-1)\n"
        "def example_inputs(): return (torch.randn(2, 4),)\n"
    )
    path = tmp_path / "mem.png"
    rc = main(["inspect", str(spec), "--plot-memory", str(path)])
    _, err = capsys.readouterr()
    assert rc == 0 and "forward only" in err and path.read_bytes().startswith(b"\x89PNG")


def _resnet18() -> nn.Module:
    from conftest import spec

    from graphflop.load import load

    return load(spec("resnet.py:resnet18")).model


@pytest.mark.parametrize(
    ("build", "shape", "mode", "options"),
    [
        (ConvRes, (2, 3, 12, 12), "eval", {}),
        (ConvRes, (2, 3, 12, 12), "eval", {"record_derivatives": False}),
        (ConvRes, (2, 3, 12, 12), "train", {}),
        (_resnet18, (1, 3, 64, 64), "eval", {}),
    ],
    ids=["convres_eval", "convres_eval_unrecorded", "convres_train", "resnet18_eval"],
)
def test_outlined_timelines_equal_the_flat_ones(build, shape, mode, options) -> None:
    # the JVP copies a multi-output node's getitems in output order: the outlined forward's
    # getitems of eval batch norm were made in graph order ([1], [2], [0]), the flat trace's
    # in another ([0], then the unread [1], [2] it added afterwards), and each getitem of a
    # batch norm kept whole is a storage of its own, allocated at its step
    torch.manual_seed(0)
    model = build().train(mode == "train")
    x = torch.randn(*shape)
    outlined = analyze(model, (x,), **options)
    assert outlined.hierarchy is not None  # the blocks were outlined
    flat = analyze(model, (x,), outline=False, **options)
    got, want = memory_timeline(outlined), memory_timeline(flat)
    assert [t.kind for t in got] == [t.kind for t in want] == ["train", "jvp"]
    for a, b in zip(got, want):
        assert (a.kind, a.baseline_bytes, a.phases) == (b.kind, b.baseline_bytes, b.phases)
        assert (a.kind, a.live_bytes) == (b.kind, b.live_bytes)
        assert a.peak_step == b.peak_step
