"""Seed B's runtime ratios on this machine: Rf and Rb for logistic regression, the MLP and the
CNN, on ONNX Runtime (graphflop's exported graphs) and in eager PyTorch, beside the paper's.

Usage: python tools/bench_seed_b.py [--device cpu|cuda] [--repeat N] [--out docs/bench]
Writes ``seed_b_<device>.json`` and ``seed_b_<device>.md``. Each model is run at batch 64 (the
models' example batch); see ``graphflop.runtime.bench`` for the timing method.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from graphflop.io import atomic_write

ROOT = Path(__file__).resolve().parents[1]
PAPER = {  # Baydin et al. 2022, reported on MNIST in PyTorch (their forward-mode implementation)
    "logreg.py": {"Rf": 2.435, "Rb": 4.389},
    "mlp.py": {"Rf": 2.468, "Rb": 4.165},
    "cnn.py": {"Rf": 1.434, "Rb": 2.211},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for model in PAPER:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [
                sys.executable,
                "-m",
                "graphflop.cli",
                "bench",
                str(ROOT / "models" / model),
                "--runtime",
                "both",
                "--device",
                args.device,
                "--repeat",
                str(args.repeat),
                "--json",
                f.name,
            ]
            print("+", " ".join(cmd[2:]), flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            results[model] = json.loads(Path(f.name).read_text())
    meta = {
        "machine": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "device": args.device,
        "repeat": args.repeat,
    }
    atomic_write(
        out / f"seed_b_{args.device}.json", json.dumps({"meta": meta, "results": results}, indent=1)
    )
    lines = [
        f"# Seed B runtime ratios on {args.device.upper()} (`tools/bench_seed_b.py`)",
        "",
        f"Method: {next(iter(results.values()))['method']}; batch 64; float32. "
        "Rf = forward-gradient step / forward, Rb = backprop train step / forward (SGD).",
        "",
        "| model | runtime | forward ms | train step ms | fwd-grad step ms | Rf | Rb | Rf/Rb "
        "| paper Rf | paper Rb | paper Rf/Rb |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, res in results.items():
        p = PAPER[model]
        for rt, doc in res["runtimes"].items():
            ph, r = doc["phases"], doc["ratios"]
            lines.append(
                f"| {model} | {rt} ({doc.get('provider', doc.get('device'))}) | "
                f"{ph['forward']['median_s'] * 1e3:.2f} | {ph['train_step']['median_s'] * 1e3:.2f} "
                f"| {ph['forward_gradient_step']['median_s'] * 1e3:.2f} | {r['Rf']:.2f} | "
                f"{r['Rb']:.2f} | {r['Rf_over_Rb']:.2f} | {p['Rf']} | {p['Rb']} | "
                f"{p['Rf'] / p['Rb']:.3f} |"
            )
    atomic_write(out / f"seed_b_{args.device}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
