"""ONNX Runtime peaks: graphflop's live-bytes figure over the node order ONNX Runtime ran
against the bytes ONNX Runtime's CPU arena held (graphflop.runtime.ort_memory)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from graphflop.analysis import analyze
from graphflop.export.onnx import export_all
from graphflop.runtime.graphs import step_graphs
from graphflop.runtime.ort_memory import OrtPeak, live_peak, measure

PHASES = ("forward", "train_step", "forward_gradient_step")


def test_live_peak_by_hand():
    # a → b (1000 B) → c (2000 B, reads b) → d = Reshape(c) (a view: 0 B) → e (256 B, reads
    # d); e is the graph's output. Sizes round up to the arena's 256 B: b 1024, c 2048, e 256.
    # Live: at c, b + c = 3072 (b's last reader is c); at e, c (through its view d) + e = 2304
    nodes = [
        ("nb", "Relu", ["a"], ["b"]),
        ("nc", "Exp", ["b"], ["c"]),
        ("nd", "Reshape", ["c", "shape"], ["d"]),
        ("ne", "ReduceSum", ["d"], ["e"]),
    ]
    sizes = {"b": 1000, "c": 2000, "d": 2000, "e": 256}
    assert live_peak(nodes, sizes, {"e"}) == (3072, "nc")
    # c kept to the end as an output too: at e, 2048 + 256 = 2304, still under 3072
    assert live_peak(nodes, sizes, {"c", "e"})[0] == 3072
    # a Reshape of a feed is a view of memory the run did not allocate: 0 bytes
    assert live_peak([("r", "Reshape", ["x", "s"], ["y"])], {"y": 4096}, {"y"})[0] == 0


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i in model.graph.input:
        t = i.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        out[i.name] = (
            np.asarray(rng.standard_normal(shape) * 0.1, dtype=dtype)
            if dtype.kind == "f"
            else np.zeros(shape, dtype)  # class 0: a valid target
        )
    return out


@pytest.mark.parametrize(
    "model,x",
    [
        pytest.param(MLP(), torch.randn(64, 32), id="mlp"),
        pytest.param(CNN(), torch.randn(16, 3, 8, 8), id="cnn", marks=pytest.mark.slow),
    ],
)
def test_predicted_peak_of_ort_order_within_10_percent(tmp_path, model, x):
    a = analyze(model, (x,), loss="cross_entropy")
    graphs = step_graphs(a, kinds=PHASES, sampling=True, wgrad_mm=True)
    manifest = export_all(graphs, tmp_path)
    for kind in PHASES:
        m = onnx.load(str(tmp_path / manifest["graphs"][kind]["file"]))
        p = measure(m, _feeds(m))
        assert isinstance(p, OrtPeak) and p.execution_order == "DEFAULT"
        assert p.peak_bytes is not None, "this ONNX Runtime's profile has no arena counters"
        assert abs(p.predicted_peak_bytes - p.peak_bytes) <= 0.10 * p.peak_bytes, (kind, p)
        # the arena's chunk peak holds at least the tensors
        assert p.arena_peak_bytes is not None and p.arena_peak_bytes >= p.peak_bytes


def test_mlp_forward_peak_by_hand(tmp_path):
    # forward of MLP on a (64, 32) batch: ONNX Runtime fuses fc1 + ReLU into one FusedGemm
    # (64×256 float32 = 65,536 B), then fc2's Gemm writes the output (64×10×4 = 2,560 B)
    # while the hidden activation is still read: 65,536 + 2,560 = 68,096 B live at once
    a = analyze(MLP(), (torch.randn(64, 32),), loss="none", backward=False, jvp=False)
    manifest = export_all({"forward": a.forward}, tmp_path)
    m = onnx.load(str(tmp_path / manifest["graphs"]["forward"]["file"]))
    p = measure(m, _feeds(m))
    assert p.predicted_peak_bytes == 65536 + 2560
    assert p.peak_bytes == 65536 + 2560


def test_bench_json_puts_the_peaks_beside_the_timings():
    from graphflop.runtime.bench import ORT_MEMORY_METHOD, timing_report
    from graphflop.runtime.timing import Timing

    t = {k: Timing(1.0, 1.0, 1.0, 1, (1.0,)) for k in PHASES}
    plain = timing_report(t, {k: 1 for k in PHASES}, "onnxruntime")
    p = OrtPeak(1000, 1280, None, 1024, "n", 2048, "m", 5, "DEFAULT")
    doc = timing_report(t, {k: 1 for k in PHASES}, "onnxruntime", {"train_step": p})
    step = doc["phases"]["train_step"]
    assert step["peak_bytes"] == 1000 and step["predicted_peak_bytes"] == 1024
    assert step["own_order_peak_bytes"] == 2048 and step["execution_order"] == "DEFAULT"
    # keys are only added: every key of the report without peaks is there, unchanged
    assert {k: v for k, v in step.items() if k in plain["phases"]["train_step"]} == plain["phases"][
        "train_step"
    ]
    assert (
        doc["memory_method"] == ORT_MEMORY_METHOD and "peak_bytes" not in doc["phases"]["forward"]
    )
