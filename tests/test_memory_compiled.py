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
