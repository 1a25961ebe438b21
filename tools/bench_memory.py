"""graphflop's memory figures against measured eager PyTorch runs on CPU → docs/memory.md.

For each model at its batch: the measured eager saved-for-backward bytes, train-step peak and
``torch.func.jvp`` peak (:mod:`graphflop.runtime.memory_probe`), PyTorch's ``MemTracker`` peak
(``torch.distributed._tools.mem_tracker``, over the same step), and graphflop's figures in its
eager model (the default) and its graph model, with ratios graphflop / measured.

Usage: ``python tools/bench_memory.py [--out docs/memory.md] [--only NAME ...] [--cache FILE]``. Runs real
steps on CPU (about two minutes for all models on one core); writes the file atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from graphflop.analysis import AnalyzeOptions, analyze
from graphflop.io import atomic_write
from graphflop.load import _preload_torchvision, load
from graphflop.runtime.memory_probe import Measured, measure


@dataclass
class Case:
    name: str
    build: Callable[[], tuple[nn.Module, tuple]]


def _models_file(path: str, batch: int) -> Callable[[], tuple[nn.Module, tuple]]:
    def build():
        loaded = load(path)
        shape = loaded.example_inputs[0].shape
        return loaded.model, (torch.randn(batch, *shape[1:]),)

    return build


def _torchvision(name: str, batch: int) -> Callable[[], tuple[nn.Module, tuple]]:
    def build():
        loaded = load(f"torchvision:{name}")  # imports torchvision as graphflop's specs do
        return loaded.model, (torch.randn(batch, 3, 224, 224),)

    return build


def _dropout_bn() -> tuple[nn.Module, tuple]:
    m = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )
    return m, (torch.randn(16, 3, 32, 32),)


def _gpt2(seq: int) -> Callable[[], tuple[nn.Module, tuple]]:
    def build():
        _preload_torchvision()
        from transformers import GPT2Config, GPT2Model

        cfg = GPT2Config(attn_implementation="sdpa")
        return GPT2Model(cfg), (torch.randint(0, cfg.vocab_size, (1, seq)),)

    return build


def _llama() -> tuple[nn.Module, tuple]:
    _preload_torchvision()
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return LlamaModel(cfg), (torch.randint(0, cfg.vocab_size, (2, 256)),)


def _vit(batch: int) -> Callable[[], tuple[nn.Module, tuple]]:
    return _torchvision("vit_b_16", batch)


CASES = [
    Case("MLP b64", _models_file("models/mlp.py", 64)),
    Case("CNN b64", _models_file("models/cnn.py", 64)),
    Case("ConvNet b64", _models_file("models/convnet.py", 64)),
    Case("dropout+BN net b16", _dropout_bn),
    Case("ResNet-18 b8", _torchvision("resnet18", 8)),
    Case("MobileNetV2 b8", _torchvision("mobilenet_v2", 8)),
    Case("GPT-2 small (GPT2Model, no LM head) T=128", _gpt2(128)),
    Case("GPT-2 small (GPT2Model, no LM head) T=512", _gpt2(512)),
    Case("ResNet-50 b4", _torchvision("resnet50", 4)),
    Case("ViT-B/16 b1", _vit(1)),
    Case("Llama (4 layers, d=256, GQA) b2 T=256", _llama),
]


def memtracker_peak(model: nn.Module, inputs: tuple, loss: str) -> int:
    """Peak of MemTracker over one step (after a warm-up step), all reference types."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from graphflop.frontend.loss import loss_value, make_targets

    with torch.no_grad():
        out = model(*inputs)
    first = out if isinstance(out, torch.Tensor) else out[0]
    targets = make_targets(loss, first, None, inside=True)  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    def step() -> None:
        o = model(*inputs)
        f = o if isinstance(o, torch.Tensor) else o[0]
        loss_value(loss, f, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    mt = MemTracker()
    mt.track_external(model, opt, *inputs, *targets)
    with mt:
        step()
    snap = mt.get_tracker_snapshot("peak")
    return max(d["Total"] for d in snap.values())


def _as_measured(model: nn.Module, inputs: tuple) -> Any:
    """The call the measurement makes, for graphflop: a transformers model whose configuration
    keeps a KV cache (GPT-2's default) is given ``use_cache=True``, which graphflop otherwise
    leaves off (its report's assumption line)."""
    if getattr(getattr(model, "config", None), "use_cache", False) is True:
        return inputs, {"use_cache": True}
    return inputs


def row(case: Case, cache: dict) -> dict:
    torch.manual_seed(0)
    model, inputs = case.build()
    model.train()
    if case.name in cache:  # measured figures of an earlier run (--cache)
        got, mt = Measured(**cache[case.name]["measured"]), cache[case.name]["memtracker"]
    else:
        got = measure(model, inputs)
        mt = memtracker_peak(model, inputs, got.loss)
        cache[case.name] = {"measured": asdict(got), "memtracker": mt}
    eager_model = AnalyzeOptions(loss=got.loss)
    graph_model = AnalyzeOptions(loss=got.loss, jvp=False, memory_model="graph")
    example = _as_measured(model, inputs)
    eager = analyze(model, example, eager_model).report.memory
    graph = analyze(model, example, graph_model).report.memory
    return {
        "name": case.name,
        "measured": got,
        "memtracker": mt,
        "eager": eager,
        "graph": graph,
    }


def _mib(b: int | None) -> str:
    return "–" if b is None else f"{b / 2**20:.2f}"


def _r(a: int | None, b: int | None) -> str:
    return "–" if not a or not b else f"{a / b:.3f}"


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Memory: graphflop's figures against measured eager PyTorch runs",
        "",
        "Generated by `tools/bench_memory.py` (CPU, PyTorch "
        f"{torch.__version__.split('+')[0]}, float32, SGD, models in train mode, graphflop's "
        "default loss). MiB = 2^20 bytes; ratios are graphflop / measured. The GPT-2 small "
        "rows are transformers' `GPT2Model` at batch 1 (the base model: no LM head, its "
        "output the last hidden states); the Llama row is its `LlamaModel`.",
        "",
        "## Method",
        "",
        "* **saved (measured)**: one forward + loss under `torch.autograd.graph.saved_tensors_hooks`;"
        " every packed tensor's storage counted once (by storage pointer), parameters and "
        "buffers excluded, inputs and targets included "
        "(`graphflop.runtime.memory_probe.measure_saved`).",
        "* **train peak (measured)**: one step (`zero_grad(set_to_none=True)`, forward, loss, "
        "`backward()`, `optimizer.step()`) after a warm-up step, under "
        "`torch.profiler.profile(profile_memory=True)`; the running sum of the raw allocator "
        "events (`[memory]`, +alloc/−free) gives the peak above the start, to which the bytes "
        "live at the start (parameters, buffers, inputs, targets, optimizer state) are added.",
        "* **JVP peak (measured)**: `torch.func.jvp` of the loss in the parameters, the same "
        "profiler method, plus parameters, buffers, inputs, targets and tangents. Attention runs "
        "its math path (`torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`): the fused CPU "
        "kernel has no forward derivative, and the math path is the execution graphflop's JVP "
        "graph describes.",
        "* **MemTracker**: `torch.distributed._tools.mem_tracker.MemTracker` over the same "
        "step (its peak, all reference types).",
        "* **graphflop eager**: `inspect --memory-model eager` (the default): residuals as ATen's "
        "derivative formulas save them, gradients allocated as produced, in-place update "
        "(`graphflop/passes/eager_memory.py`). **graph**: `--memory-model graph`, graphflop's "
        "own graphs in their node order (the figures before the eager memory model).",
        "* **Optimizer state** (`optimizer_state_bytes`, eager model; `plan`'s per-rank "
        "`optimizer_state` the same way): what `torch.optim`'s state holds after a step, the "
        "bytes of every tensor in `optimizer.state`: momentum's buffer like each trainable "
        "parameter; Adam's and AdamW's two moments and a per-parameter `step` count, a 0-dim "
        "float32 tensor (`_init_group` in torch/optim/adam.py): 4 B per trainable tensor "
        "(`tests/test_optimizer_state.py` sums a real step's state). The step counts live on "
        "the CPU unless the optimizer is `capturable` or `fused`, so on `cuda` they are host "
        "memory that the figures count with the device's (a train peak 4 B per trainable "
        "tensor above the GPU's: 40 B for 10 tensors, 1,164 B for a 7B Llama's 291). The graph "
        "model counts the moments only: its update graph takes one step scalar.",
        "* graphflop eager also charges the CPU kernels' own temporaries measured with the same "
        "profiler events: a convolution (oneDNN) holds its reordered input and weight, then an "
        "output-sized buffer; its backward copies a non-contiguous output gradient or input "
        "(a sum's expanded gradient, a permuted view), then holds the input gradient's stage and "
        "the weight gradient's (the reordered input and output gradient, then a weight-sized "
        "buffer), by grouping, stride and memory format (`eager_memory.conv_backward`); "
        "oneDNN's scratchpads are not modelled; backward scatters into fresh "
        "zeros (embedding, max pooling, index/slice backward) run in place.",
        "* Attention without dropout (and with the flash backend enabled, dense 4-D q, k, v, a "
        "2-D or 4-D mask) runs PyTorch's fused CPU kernel "
        "(`_scaled_dot_product_flash_attention_for_cpu`; the rule is `use_flash_attention_cpp` "
        "in `sdp_utils_cpp.cpp`, checked against the kernel PyTorch picks in "
        "`tests/test_memory_sdpa.py`): graphflop eager counts what it saves (q, k, v, its "
        "output, the mask, a bool mask converted to float, and a float32 logsumexp of "
        "B·H·L), no scores or probabilities in forward or backward, its output in q's memory "
        "order (a `transpose(1, 2).contiguous()` of it is then a view), and its CPU block "
        "buffers and gradient copy (`graphflop/passes/eager_attention.py`). Attention with "
        "dropout > 0 (GPT-2 here) runs the math path, as graphflop's graph counts it. On CUDA "
        "the flash and memory-efficient kernels are assumed to save the same (the efficient "
        "kernel's logsumexp padded to 32 rows), unmeasured.",
        "* graphflop's eager **JVP** figure models `torch.func.jvp`: graphflop's JVP graph in its "
        "order with each value and its tangent freed together (one dual tensor), the "
        "temporaries of eager tangent formulas (batch norm's `batch_norm_jvp` four input-sized, "
        "softmax's one and dropout's one besides the result with its float mask), the "
        "convolution temporaries, and the first convolution's materialised zero input tangent "
        "(`convolution_jvp` convolves it: one input- and one output-sized tensor).",
        "* The Llama is built with `use_cache=False`, as graphflop's `hf:` loader builds every "
        "Hugging Face model; tracing then sees the mask eager attention runs (none: "
        "`is_causal=True`), because graphflop answers transformers' packed-sequence check from "
        "the trace (`graphflop/frontend/libraries.py`). GPT-2 keeps transformers' default "
        "`use_cache=True`, and graphflop is called with `use_cache=True` as well: by default it "
        "traces a transformers model without the cache its call does not ask for (so that "
        "each layer is traced once), and says so in the report; on the math attention path "
        "that changes what is saved (GPT-2 small T=128: measured 162.78 MiB with the cache, "
        "171.78 without; graphflop without it 167.28, see (2)).",
        "* Not modelled: (1) the KV cache (`DynamicCache`, `use_cache=True`) holds a copy of "
        "each layer's k and v until the model returns, in `torch.func.jvp` with their tangents; "
        "graphflop's trace keeps tensor outputs only, so the cache is dead code to it (GPT-2 "
        "small T=512's JVP ratio 0.92: up to 12 layers × k, v × primal, tangent × 1.5 MiB = "
        "72 MiB, by count). (2) Attention on PyTorch's math path (dropout > 0) with strided k "
        "and v (views of one projection's output: HF GPT-2 with `use_cache=False`, where no "
        "cache concatenates them) saves contiguous copies of k and v for its products, "
        "2·T·d·4 bytes per layer, of which graphflop counts half: measured GPT-2 small with "
        "`use_cache=False` saved 171.78 MiB against graphflop's 167.28 (0.974) at T=128 and "
        "1011.11 against 993.10 (0.982) at T=512 (differences 12 × 0.375 MiB and 12 × 1.5 "
        "MiB, T·d·4 bytes per layer; graphflop run at the end of stop 47). "
        "(3) Inside the math attention kernel under forward-mode AD, graphflop charges its "
        "peak by formula (`math_attention_jvp_bytes`: scaled q and k, GQA copies, four or "
        "five score-sized tensors); masks and the order of its temporaries are left out "
        "(isolated attention: 0.91–0.93 of the measured JVP peak). (4) LSTM layers in float32 "
        "on CPU run oneDNN's fused kernel (`mkldnn_rnn_layer`), which saves a workspace "
        "(a uint8 buffer: 114,688 B for one layer at T=12, B=4, H=32) whose size graphflop "
        "does not model: a 2-layer LSTM measured 0.474 saved and 0.454 train peak "
        "(graphflop / measured); in float64 (no oneDNN) 0.988 and 0.919. The fused kernel has "
        "no forward derivative either: `torch.func.jvp` cannot run it in float32.",
        "",
        "## Saved for backward",
        "",
        "| model | measured MiB | graphflop eager | ratio | graph | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, e, g = r["measured"], r["eager"], r["graph"]
        lines.append(
            f"| {r['name']} | {_mib(m.saved_for_backward_bytes)} | "
            f"{_mib(e.saved_for_backward_bytes)} | "
            f"{_r(e.saved_for_backward_bytes, m.saved_for_backward_bytes)} | "
            f"{_mib(g.saved_for_backward_bytes)} | "
            f"{_r(g.saved_for_backward_bytes, m.saved_for_backward_bytes)} |"
        )
    lines += [
        "",
        "## Train-step peak",
        "",
        "| model | measured MiB | MemTracker | ratio | graphflop eager | ratio | graph | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, e, g, t = r["measured"], r["eager"], r["graph"], r["memtracker"]
        lines.append(
            f"| {r['name']} | {_mib(m.train_peak_bytes)} | {_mib(t)} | "
            f"{_r(t, m.train_peak_bytes)} | {_mib(e.train_peak_bytes)} | "
            f"{_r(e.train_peak_bytes, m.train_peak_bytes)} | {_mib(g.train_peak_bytes)} | "
            f"{_r(g.train_peak_bytes, m.train_peak_bytes)} |"
        )
    lines += [
        "",
        "## JVP peak",
        "",
        "| model | torch.func.jvp MiB | graphflop eager | ratio |",
        "|---|---|---|---|",
    ]
    for r in rows:
        m, e = r["measured"], r["eager"]
        lines.append(
            f"| {r['name']} | {_mib(m.jvp_peak_bytes)} | {_mib(e.jvp_peak_bytes)} | "
            f"{_r(e.jvp_peak_bytes, m.jvp_peak_bytes)} |"
        )
    return "\n".join(lines + _ort_section()) + "\n"


def _ort_section(path: str = "docs/memory_ort.md") -> list[str]:
    """The ONNX Runtime peaks of ``path`` (written by ``tools/bench_ort_memory.py``: ORT's
    arena counters from its profile against graphflop's figure over ORT's own node order),
    as a short table; nothing when the file is absent."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 6 and cells[1] in ("forward", "train_step", "forward_gradient_step"):
                rows.append(f"| {cells[0]} | {cells[1]} | {cells[2]} | {cells[4]} | {cells[5]} |")
    if not rows:
        return []
    return [
        "",
        "## ONNX Runtime peaks",
        "",
        f"From `{path}` (`python tools/bench_ort_memory.py`: the exported graphs run by `graphflop "
        "bench` on ORT's CPU provider, peak from ORT's arena counters in its profile; graphflop's "
        "figure is its live-bytes rule over the node order ORT runs). Bytes.",
        "",
        "| model | phase | ORT measured | graphflop, ORT order | ratio |",
        "|---|---|--:|--:|--:|",
        *rows,
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/memory.md")
    ap.add_argument("--only", nargs="*", help="case names to run (substring match)")
    ap.add_argument(
        "--cache",
        help="JSON file of measured figures: read if it exists (those models are not re-run), "
        "written with every model measured",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cache: dict = {}
    if args.cache and os.path.exists(args.cache):
        with open(args.cache) as f:
            cache = json.load(f)
    rows = []
    for case in CASES:
        if args.only and not any(o.lower() in case.name.lower() for o in args.only):
            continue
        print(case.name, file=sys.stderr, flush=True)
        rows.append(row(case, cache))
        if args.cache:
            atomic_write(args.cache, json.dumps(cache, indent=1))
    atomic_write(args.out, markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
