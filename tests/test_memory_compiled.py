"""``--memory-model compiled``: what torch.compile's AOTAutograd min-cut partition saves and
recomputes (:mod:`graphflop.passes.compiled_memory`), checked against a compiled run
(backend ``aot_eager_decomp_partition``: the same decompositions and partitioner, nothing compiled)
measured with ``saved_tensors_hooks`` and against hand-counted FLOPs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from graphflop.analysis import analyze
from graphflop.frontend.loss import loss_value
from graphflop.passes.compiled_memory import EXECUTION, compiled_memory
from graphflop.runtime.memory_probe import measure_saved


class _WithLoss(nn.Module):
    """``model`` followed by graphflop's loss, so the loss is inside the compiled region."""

    def __init__(self, model: nn.Module, kind: str, targets: tuple) -> None:
        super().__init__()
        self.model, self.kind, self.targets = model, kind, targets

    def forward(self, *x: torch.Tensor) -> torch.Tensor:
        return loss_value(self.kind, self.model(*x), self.targets)


def _measured_compiled_saved(model: nn.Module, inputs: tuple, kind: str, targets: tuple) -> int:
    """Saved bytes of one compiled forward (after a first call compiles it)."""
    import torch._dynamo

    torch._dynamo.reset()
    w = torch.compile(_WithLoss(model, kind, targets), backend="aot_eager_decomp_partition")
    w(*inputs).backward()
    return measure_saved(w, inputs, "output")


class _Chain(nn.Module):
    """Linear, then a pointwise chain ``tanh(sigmoid(h)·h)`` the min-cut recomputes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.tanh(torch.sigmoid(h) * h)


def test_pointwise_chain_recomputed_by_hand() -> None:
    torch.manual_seed(0)
    cm = compiled_memory(_Chain(), (torch.randn(4, 8),), "sum")
    # min-cut saves the input x and h = addmm (each 4·8 fp32 = 128 B): 256 B, and recomputes
    # sigmoid(h), sigmoid(h)·h and tanh(·) in the backward: 3 ops × 32 elements × 1 FLOP
    # (docs/flops_conventions.md: a transcendental or a multiply is 1 FLOP per output element) = 96
    # FLOPs
    assert cm.min_cut.saved_bytes == 256
    assert sorted(cm.min_cut.recomputed) == ["mul", "sigmoid", "tanh"]
    assert cm.min_cut.recompute_flops == 96
    # the default partition saves x, h, sigmoid(h) and tanh(·): 4 × 128 B, recomputes nothing
    assert cm.default.saved_bytes == 512
    assert cm.default.recompute_flops == 0
    # parameters and buffers: 8·8 + 8 fp32 = 288 B; input 128 B (a sum loss: no target)
    assert (cm.state_bytes, cm.input_bytes) == (288, 128)


def test_saved_bytes_equal_a_compiled_run() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 10),
        nn.GELU(),
        nn.Linear(10, 5),
    )
    x = torch.randn(2, 3, 6, 6)
    t = (torch.zeros(2, dtype=torch.long),)
    cm = compiled_memory(model, (x,), "cross_entropy")
    assert cm.min_cut.saved_bytes == _measured_compiled_saved(model, (x,), "cross_entropy", t)


@pytest.mark.slow  # a subprocess CLI run: 10 s
def test_analyze_and_cli_name_the_execution(tmp_path) -> None:
    torch.manual_seed(0)
    model = _Chain()
    a = analyze(model, (torch.randn(4, 8),), loss="sum", jvp=False, memory_model="compiled")
    mem = a.report.memory
    assert mem.memory_model == "compiled"
    assert mem.saved_for_backward_bytes == 256
    assert mem.compiled is not None and mem.compiled.execution == EXECUTION
    assert mem.compiled.min_cut.recompute_flops == 96
    with pytest.raises(
        ValueError, match="unknown memory_model .inductor.: one of eager, graph, compiled"
    ):
        analyze(model, (torch.randn(4, 8),), memory_model="inductor")
    spec = tmp_path / "chain.py"
    spec.write_text(
        "import torch\nfrom torch import nn\n"
        "class Chain(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        h = self.fc(x)\n        return torch.tanh(torch.sigmoid(h) * h)\n"
        "def example_inputs():\n    return (torch.randn(4, 8),)\n"
    )
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "graphflop.cli", "inspect", str(spec), "--no-jvp", "--loss", "sum"]
    cmd += ["--memory-model", "compiled", "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    doc = json.loads(out.read_text())["memory"]
    assert doc["memory_model"] == "compiled"
    assert doc["compiled"]["execution"] == EXECUTION
    assert doc["compiled"]["min_cut"]["saved_for_backward_bytes"] == 256


def test_compiled_jvp_figure_names_the_eager_jvp() -> None:
    """The JVP is not compiled: under ``--memory-model compiled`` its peak is the eager
    model's (torch.func.jvp), and its description must say so, not 'graphflop's JVP graph'."""
    torch.manual_seed(0)
    x = (torch.randn(4, 8),)
    compiled = analyze(_Chain(), x, loss="sum", memory_model="compiled").report.memory
    eager = analyze(_Chain(), x, loss="sum", memory_model="eager").report.memory
    assert compiled.jvp_peak_bytes == eager.jvp_peak_bytes
    assert compiled.describes["jvp_peak_bytes"] == eager.describes["jvp_peak_bytes"]
    assert compiled.describes["jvp_peak_bytes"].startswith("torch.func.jvp on cpu")


def test_no_deprecation_warning_from_copying_the_joint_graph() -> None:
    """Tester's finding: ``--memory-model compiled`` printed PyTorch's FutureWarning about
    ``LeafSpec`` (raised inside ``deepcopy`` of the joint graph's pytree specs)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled_memory(_Chain(), (torch.randn(4, 8),), "sum")
    assert [str(w.message) for w in caught if "LeafSpec" in str(w.message)] == []


def test_transformers_decoder_partitioned() -> None:
    """A transformers decoder (Llama, one layer, on the meta device): its packed-sequence
    check read the position ids' values (``.all()``), which AOTAutograd's functional tensors
    cannot give, so every decoder raised DataDependentOutputException; the joint graph is now
    recorded with the libraries' traceable paths, as graphflop's trace records the forward.
    The saved bytes are at least the checkpointed residual stream's: the decoder layer's
    input and the final norm's input, batch 2 × 8 tokens × 32 float32 each (2 · 2·8·32·4 =
    4,096 B)."""
    from graphflop.load import load, make_inputs

    cfg = dict(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    loaded = load("hf:llama", ctor_kwargs=cfg, meta=True, seq=8)
    a = analyze(loaded.model.train(), make_inputs(loaded, batch=2), memory_model="compiled")
    mem = a.report.memory
    assert mem.memory_model == "compiled"
    assert mem.saved_for_backward_bytes >= 2 * 2 * 8 * 32 * 4


class _ConstantIndex(nn.Module):
    """An index tensor made in forward (``torch.tensor([...])``): a FakeTensor attribute of
    the joint graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor([0, 2, 2, 5])
        return self.fc(x).index_add(1, idx, x[:, :4])


def test_constant_made_in_forward_partitioned() -> None:
    """Tester's finding: copying the joint graph deep-copied the constant's FakeTensor
    (RuntimeError: set the storage of a meta tensor to a cpu storage)."""
    torch.manual_seed(0)
    model, x = _ConstantIndex(), torch.randn(2, 8)
    t = (torch.zeros(2, dtype=torch.long),)
    cm = compiled_memory(model, (x,), "cross_entropy")
    assert cm.min_cut.saved_bytes == _measured_compiled_saved(model, (x,), "cross_entropy", t)


class _LoopMoE(nn.Module):
    """A mixture of experts looping over its experts, each picking its rows with
    ``torch.where(idx == e)`` (a data-dependent ``nonzero``)."""

    def __init__(self, d: int = 16, experts: int = 4, k: int = 2, h: int = 32) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d)) for _ in range(experts)
        )
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        x2 = x.reshape(-1, d)
        w, idx = torch.topk(self.router(x2).softmax(-1), self.k, dim=-1)
        out = torch.zeros_like(x2)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            out = out.index_add(0, tok, expert(x2[tok]) * w[tok, slot].unsqueeze(-1))
        return out.reshape(b, t, d)


def test_routed_experts_partitioned_as_a_balanced_compiled_run() -> None:
    """Tester's finding: the joint graph of a ``torch.where(idx == e)`` dispatch failed with
    DynamicOutputShapeException; it is now recorded with the routing's rows (balanced: T·k/E
    = 8·2/4 = 4 per expert), as graphflop's trace records it. Reference: a compiled run
    (nonzero captured, ``capture_dynamic_output_shape_ops``) on inputs whose router sends
    exactly 4 token-expert pairs to each expert (token t to experts t mod 4 and t+1 mod 4).
    The saved rows and columns of each ``nonzero`` (``unbind`` views) are its one storage."""
    import torch._dynamo

    torch.manual_seed(0)
    model = _LoopMoE()
    with torch.no_grad():
        model.router.weight.zero_()
        model.router.weight[:, :4] = torch.eye(4)
    x = torch.randn(1, 8, 16) * 0.1
    for t in range(8):
        x[0, t, t % 4], x[0, t, (t + 1) % 4] = 3.0, 2.0
    _, idx = torch.topk(model.router(x.reshape(-1, 16)), 2, dim=-1)
    assert torch.bincount(idx.flatten(), minlength=4).tolist() == [4, 4, 4, 4]
    cm = compiled_memory(model, (x,), "sum")
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        measured = _measured_compiled_saved(model, (x,), "sum", ())
    assert cm.min_cut.saved_bytes == measured
    # by hand: x (8·16 fp32, 512 B), the softmax (8·4 fp32, 128 B), the top-k indices (8·2
    # int64, 128 B), and per expert its nonzero (4·2 int64, 64 B), x2[tok] (4·16 fp32, 256 B),
    # the ReLU (4·32 fp32, 512 B), the second Linear's output (256 B) and w[tok, slot] (16 B)
    assert measured == 512 + 128 + 128 + 4 * (64 + 256 + 512 + 256 + 16)


def test_unsized_nonzero_refused_in_one_line(monkeypatch) -> None:
    """A ``nonzero`` the joint graph cannot size (here: the routing's sizing taken away) is
    refused in one line naming the exception and the other memory models, not an internal
    error."""
    import contextlib

    import graphflop.frontend.dispatch as dispatch
    from graphflop.frontend.trace import TraceError

    monkeypatch.setattr(dispatch, "routed_nonzero", contextlib.nullcontext)
    with pytest.raises(TraceError) as info:
        compiled_memory(_LoopMoE(), (torch.randn(1, 8, 16),), "sum")
    text = str(info.value)
    assert "\n" not in text and "DynamicOutputShapeException: aten.nonzero.default" in text
    assert text.endswith("use --memory-model eager or graph")
