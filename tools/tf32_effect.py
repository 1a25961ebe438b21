"""Predicted times with float32 convolutions at the FP32 peak (``cudnn_allow_tf32=False``,
graphflop's data-sheet model until 2026-12-05) and at the TF32 peak (torch's default), on
data-sheet GPUs: per phase, and summed over convolution kernels and over every other kernel
(docs/time.md, "TF32"). Markdown rows on standard output, milliseconds, before → after.

    PYTHONPATH=. python tools/tf32_effect.py
"""

from __future__ import annotations

import torch

from graphflop.analysis import analyze
from graphflop.devices import device_spec
from graphflop.load import load
from graphflop.meta import TIME
from graphflop.passes.time_profile import from_device

CASES = (
    ("torchvision:resnet50", (256, 3, 224, 224), "a100-80gb"),
    ("models/resnet.py:resnet18", (8, 3, 224, 224), "h200"),
    ("models/resnet.py:resnet18", (16, 3, 224, 224), "h200"),
    ("models/cnn.py", (256, 1, 28, 28), "h200"),
    ("models/mlp.py", (256, 1, 28, 28), "h200"),
)


def _times(model: torch.nn.Module, x: torch.Tensor, device: str, tf32: bool) -> list[float]:
    """forward, backward, train step, conv kernels, other kernels: seconds."""
    a = analyze(
        model,
        (x,),
        jvp=False,
        time_profile=from_device(device_spec(device), cudnn_allow_tf32=tf32),
    )
    t = a.report.time
    assert t is not None
    conv = other = 0.0
    for gm in (a.forward, a.backward, a.update):
        for n in gm.graph.nodes if gm is not None else ():
            nt = n.meta.get(TIME)
            if nt is None:
                continue
            if nt.op_class.startswith("conv"):
                conv += nt.seconds
            else:
                other += nt.seconds
    phases = [t.phase(p).seconds for p in ("forward", "backward", "train_step")]
    return [*phases, conv, other]


def main() -> None:
    for spec, shape, device in CASES:
        loaded = load(spec, meta=True)
        x = torch.empty(*shape, device="meta")
        before = _times(loaded.model, x, device, tf32=False)
        after = _times(loaded.model, x, device, tf32=True)
        cells = " | ".join(f"{b * 1e3:.4g} → {a * 1e3:.4g}" for b, a in zip(before, after))
        print(f"| {spec} | {'×'.join(map(str, shape))} | {device} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
