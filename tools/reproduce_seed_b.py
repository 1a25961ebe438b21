"""Regenerate seed B's results (Baydin et al. 2022, "Gradients without Backpropagation") in
``docs/seed-b/`` on this machine.

Usage: python tools/reproduce_seed_b.py [--out docs/seed-b] [--quick]

1. Rf, Rb, Rf/Rb for logistic regression, the MLP and the CNN (batch 64), measured on ONNX
   Runtime (graphflop's exported graphs) and in eager PyTorch, beside the paper's figures and
   beside graphflop's FLOP ratios.
2. Rf/Rb vs depth for 1024-wide MLPs: FLOP ratios for 1–100 hidden layers, measured times on
   ONNX Runtime up to 50 layers.
3. FGD vs backprop training on scikit-learn's digits, each with its own learning rate picked
   from a small grid (a shared learning rate flatters forward gradients); loss vs time and vs
   steps, and Tf/Tb.
4. The estimator's variance for K = 1, 2, 4, 8, 16 directions.
5. Memory of both (graphflop's liveness counts: train-step peak vs JVP peak, saved activations).

The paper ran on MNIST on a GPU; this runs on digits (8×8) on this machine's CPU, with fewer
steps — the point is the ratios and the honest comparison, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAPER = {
    "logreg.py": {"Rf": 2.435, "Rb": 4.389},
    "mlp.py": {"Rf": 2.468, "Rb": 4.165},
    "cnn.py": {"Rf": 1.434, "Rb": 2.211},
}


def log(t0, msg):
    print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)


def bench(spec: str, repeat: int, extra=()) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [
            sys.executable,
            "-m",
            "graphflop.cli",
            "bench",
            spec,
            "--device",
            "cpu",
            "--repeat",
            str(repeat),
            "--warmup",
            "2",
            "--json",
            f.name,
            *extra,
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())


def flop_ratios(spec: str, **ctor) -> dict:
    from graphflop.analysis import analyze
    from graphflop.load import load, make_inputs

    loaded = load(spec, ctor_kwargs=ctor, meta=True)
    loaded.model.train()
    r = analyze(loaded.model, make_inputs(loaded)).report
    t, m = r.totals, r.memory
    f = t.forward.flops
    return {
        "Rf_flops": t.forward_gradient_step.flops / f,
        "Rb_flops": t.train_step.flops / f,
        "params": r.params,
        "train_peak_bytes": m.train_peak_bytes,
        "jvp_peak_bytes": m.jvp_peak_bytes,
        "saved_for_backward_bytes": m.saved_for_backward_bytes,
        "params_bytes": m.params_bytes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "seed-b"))
    ap.add_argument("--quick", action="store_true", help="fewer points and steps (for tests)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    q = args.quick
    res: dict = {}

    # 1. Rf and Rb
    rows = []
    for model in PAPER:
        log(t0, f"bench {model}")
        spec = str(ROOT / "models" / model)
        b = bench(spec, 5 if q else 30, ["--runtime", "both"])
        fr = flop_ratios(spec)
        for rt, doc in b["runtimes"].items():
            rows.append(
                {
                    "model": model,
                    "runtime": f"{rt} ({doc.get('provider', 'cpu')})",
                    **{
                        f"{k}_ms": doc["phases"][k]["median_s"] * 1e3
                        for k in ("forward", "train_step", "forward_gradient_step")
                    },
                    **doc["ratios"],
                    "Rf_flops": fr["Rf_flops"],
                    "Rb_flops": fr["Rb_flops"],
                    "paper_Rf": PAPER[model]["Rf"],
                    "paper_Rb": PAPER[model]["Rb"],
                }
            )
        res.setdefault("memory", []).append({"model": model, **fr})
    res["runtime_ratios"] = rows

    # 2. depth
    depths = [1, 2, 5] if q else [1, 2, 5, 10, 20, 50, 100]
    drows = []
    for d in depths:
        log(t0, f"MLP depth {d}")
        spec = str(ROOT / "models" / "mlp.py")
        fr = flop_ratios(spec, depth=d)
        row = {
            "depth": d,
            "params": fr["params"],
            "Rf_flops": fr["Rf_flops"],
            "Rb_flops": fr["Rb_flops"],
            "Rf_over_Rb_flops": fr["Rf_flops"] / fr["Rb_flops"],
        }
        if d <= (5 if q else 50):
            b = bench(spec, 3 if q else 8, ["--runtime", "onnxruntime", "--arg", f"depth={d}"])
            r = b["runtimes"]["onnxruntime"]["ratios"]
            row.update({"Rf_time": r["Rf"], "Rb_time": r["Rb"], "Rf_over_Rb_time": r["Rf_over_Rb"]})
        drows.append(row)
    res["depth"] = drows

    # 3. training: tuned learning rates, then FGD vs backprop
    from graphflop.train.config import TrainConfig
    from graphflop.train.data import load_digits
    from graphflop.train.loop import estimator_variance, train

    data = load_digits()
    steps = 60 if q else 600
    grids = {"backprop": [0.01, 0.03, 0.1, 0.3], "fgd": [1e-4, 3e-4, 1e-3, 3e-3]}
    train_res = {}
    for model in ("logreg.py", "mlp.py"):
        spec = str(ROOT / "models" / model)
        for method, grid in grids.items():
            best = None
            for lr in grid[:2] if q else grid:
                log(t0, f"train {model} {method} lr {lr}")
                r = train(
                    spec,
                    data,
                    TrainConfig(
                        method=method,
                        optimizer="sgd",
                        lr=lr,
                        steps=steps,
                        eval_every=max(steps // 20, 1),
                        seed=0,
                        threads=1,
                    ),
                )
                v = r.summary["final_val_loss"]
                if v == v and (best is None or v < best[0]):  # NaN never wins
                    best = (v, lr, r)
            train_res[(model, method)] = best
    curves = {}
    for (model, method), (v, lr, r) in train_res.items():
        curves[f"{model}:{method}"] = {
            "lr": lr,
            "final_val_loss": v,
            "final_val_accuracy": r.summary["final_val_accuracy"],
            "history": [h for h in r.history if h.get("val_loss") is not None],
        }
    res["training"] = curves
    res["tf_tb"] = {}
    for model in ("logreg.py", "mlp.py"):
        b = curves[f"{model}:backprop"]
        f = curves[f"{model}:fgd"]
        target = b["final_val_loss"]
        t_b = next(h["wall_s"] for h in b["history"] if h["val_loss"] <= target)
        hit = next((h["wall_s"] for h in f["history"] if h["val_loss"] <= target), None)
        # and what FGD reached in the wall time backprop used
        f_at = [h for h in f["history"] if h["wall_s"] <= b["history"][-1]["wall_s"]]
        res["tf_tb"][model] = {
            "target_val_loss": target,
            "backprop_s": t_b,
            "fgd_s": hit,
            "Tf_over_Tb": hit / t_b if hit else None,
            "fgd_val_acc_in_backprop_time": f_at[-1]["val_accuracy"] if f_at else None,
            "backprop_val_acc": b["final_val_accuracy"],
        }
    _plot_training(curves, out / "training.png")

    # 4. variance vs K
    log(t0, "estimator variance")
    ks = (1, 2, 4, 8, 16)
    var = estimator_variance(
        str(ROOT / "models" / "logreg.py"), directions=ks, samples=200 if q else 1000, data=data
    )
    res["variance"] = {
        "params": var["params"],
        "relative_variance": {str(k): v for k, v in var["relative_variance"].items()},
        "theory_relative": {str(k): v for k, v in var["theory_relative"].items()},
    }
    _plot_variance(var, out / "variance.png")
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "README.md").write_text(_report(res, steps))
    log(t0, f"done: {out}")
    return 0


def _plot_training(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=110)
    for row, model in enumerate(("logreg.py", "mlp.py")):
        for method, style in (("backprop", "-"), ("fgd", "--")):
            c = curves[f"{model}:{method}"]
            h = c["history"]
            label = f"{method} (lr {c['lr']:g})"
            axes[row][0].plot(
                [x["wall_s"] for x in h], [x["val_loss"] for x in h], style, label=label
            )
            axes[row][1].plot(
                [x["step"] for x in h], [x["val_loss"] for x in h], style, label=label
            )
        axes[row][0].set_title(f"{model}: validation loss vs wall time (s)")
        axes[row][1].set_title(f"{model}: validation loss vs steps")
        for ax in axes[row]:
            ax.legend()
            ax.set_ylabel("cross-entropy")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_variance(var, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(var["relative_variance"])
    fig, ax = plt.subplots(figsize=(5, 3.6), dpi=120)
    ax.loglog(ks, [var["relative_variance"][k] for k in ks], "o-", label="measured")
    ax.loglog(ks, [var["theory_relative"][k] for k in ks], "k:", label="(n+1)/K (Gaussian)")
    ax.set_xlabel("directions K")
    ax.set_ylabel("E‖ĝ − ∇L‖² / ‖∇L‖²")
    ax.set_title(f"forward-gradient variance, logreg (n = {var['params']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _f(x, nd=2):
    return "–" if x is None else f"{x:.{nd}f}"


def _seconds(x) -> str:
    return "not reached" if x is None else f"{x:.2f} s"


def _report(r, steps) -> str:
    rr = r["runtime_ratios"]
    lines = [
        "# Seed B reproduced on this machine",
        "",
        "Regenerated by `python tools/reproduce_seed_b.py` (CPU; `graphflop bench` method: warm-up "
        "runs, then timed runs over rotating input sets; medians). Rf = forward-gradient step / "
        "forward, Rb = backprop train step / forward, both with SGD.",
        "",
        "## Rf and Rb (batch 64)",
        "",
        "| model | runtime | fwd ms | train ms | fwd-grad ms | Rf | Rb | Rf/Rb | Rf FLOPs | Rb FLOPs "
        "| paper Rf | paper Rb | paper Rf/Rb |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[
            f"| {x['model']} | {x['runtime']} | {x['forward_ms']:.2f} | {x['train_step_ms']:.2f} | "
            f"{x['forward_gradient_step_ms']:.2f} | {_f(x['Rf'])} | {_f(x['Rb'])} | "
            f"{_f(x['Rf_over_Rb'])} | {_f(x['Rf_flops'])} | {_f(x['Rb_flops'])} | {x['paper_Rf']} | "
            f"{x['paper_Rb']} | {x['paper_Rf'] / x['paper_Rb']:.2f} |"
            for x in rr
        ],
        "",
        "In FLOPs the two steps cost the same (Rf ≈ Rb): a weight-perturbed JVP through a layer "
        "does the same two products backprop does (one for the first layer). What forward mode "
        "saves is memory and the backward's bookkeeping, so measured Rf/Rb below 1 comes from "
        "runtime overheads, not arithmetic; eager PyTorch's `torch.func.jvp` carries large "
        "per-op overheads, so there forward gradients are slower than backprop. The paper's "
        "Rf/Rb ≈ 0.6 was measured with the authors' own forward-mode implementation against "
        "PyTorch's autograd.",
        "",
        "## Rf/Rb vs depth (1024-wide MLPs, batch 64)",
        "",
        "| hidden layers | params | Rf FLOPs | Rb FLOPs | Rf/Rb FLOPs | Rf time (ORT) | Rb time "
        "(ORT) | Rf/Rb time (ORT) |",
        "|---|---|---|---|---|---|---|---|",
        *[
            f"| {x['depth']} | {x['params']:,} | {_f(x['Rf_flops'])} | {_f(x['Rb_flops'])} | "
            f"{_f(x['Rf_over_Rb_flops'], 3)} | {_f(x.get('Rf_time'))} | {_f(x.get('Rb_time'))} | "
            f"{_f(x.get('Rf_over_Rb_time'))} |"
            for x in r["depth"]
        ],
        "",
        "Paper: Rf/Rb under 0.6 up to 10 layers, just over 0.8 at 100. In FLOPs graphflop finds "
        "Rf/Rb ≈ 1 at every depth; the measured ratio shows what the runtime makes of it.",
        "",
        f"## FGD vs backprop on digits ({steps} SGD steps, batch 64; `training.png`)",
        "",
        "Learning rates were tuned separately for each method on a small grid (backprop "
        "0.01–0.3, FGD 1e-4–3e-3); a shared learning rate flatters forward gradients.",
        "",
        "| model | method | lr | final val loss | final val acc |",
        "|---|---|---|---|---|",
        *[
            f"| {k.split(':')[0]} | {k.split(':')[1]} | {v['lr']:g} | {v['final_val_loss']:.3f} | "
            f"{v['final_val_accuracy']:.3f} |"
            for k, v in r["training"].items()
        ],
        "",
        "| model | backprop's final val loss | backprop time | FGD time to reach it | Tf/Tb | "
        "FGD val acc in backprop's time | backprop val acc |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {m} | {v['target_val_loss']:.3f} | {v['backprop_s']:.2f} s | "
            f"{_seconds(v['fgd_s'])} | {_f(v['Tf_over_Tb'])} | "
            f"{_f(v['fgd_val_acc_in_backprop_time'], 3)} | {_f(v['backprop_val_acc'], 3)} |"
            for m, v in r["tf_tb"].items()
        ],
        "",
        "Paper: forward gradients reached a given loss sooner (Tf/Tb = 0.211 for the MLP in one "
        "setting). Here, with separately tuned learning rates, backprop wins clearly: the "
        "estimator's variance grows with the parameter count (below), which forces small "
        "learning rates on FGD.",
        "",
        "## Variance vs directions K (`variance.png`)",
        "",
        "| K | " + " | ".join(r["variance"]["relative_variance"]) + " |",
        "|---|" + "---|" * len(r["variance"]["relative_variance"]),
        "| E‖ĝ−∇L‖²/‖∇L‖² | "
        + " | ".join(f"{v:.1f}" for v in r["variance"]["relative_variance"].values())
        + " |",
        "| theory (n+1)/K | "
        + " | ".join(f"{v:.1f}" for v in r["variance"]["theory_relative"].values())
        + " |",
        "",
        "## Memory (graphflop's liveness counts, batch 64, float32)",
        "",
        "| model | params | saved for backward | train-step peak | JVP peak |",
        "|---|---|---|---|---|",
        *[
            f"| {x['model']} | {x['params_bytes'] / 2**20:.2f} MiB | "
            f"{x['saved_for_backward_bytes'] / 2**20:.2f} MiB | {x['train_peak_bytes'] / 2**20:.2f} MiB "
            f"| {x['jvp_peak_bytes'] / 2**20:.2f} MiB |"
            for x in r["memory"]
        ],
        "",
        "The train-step peak holds parameters, gradients and the saved activations; the JVP "
        "peak holds parameters, their tangents (the direction) and only the live activations. "
        "The paper found no real difference in its implementation; graphflop's counts show where "
        "a difference comes from (saved activations) and that it grows with batch size.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
