"""Regenerate seed B's training results (Baydin et al. 2022, "Gradients without
Backpropagation", arXiv 2202.08587) and the critics' remedies in ``docs/seed-b/``.

Usage: python tools/reproduce_seed_b.py [--out docs/seed-b] [--steps 100] [--seeds 3]
       [--data-dir MNIST_DIR] [--only flops,protocol,tuned,activity,variance] [--quick]

Sections (each merges its figures into ``OUT/results.json``, so they can run apart):

* ``flops``: Rf and Rb in FLOPs (forward-gradient step / forward, train step / forward, SGD)
  for logreg, the MLP 1024-1024-10 and the CNN at MNIST size, batch 64, and for 1024-wide MLPs
  of 1 … 100 hidden layers (graphflop's counts; timings are ``graphflop bench``'s, in
  ``docs/seed-b/bench.md``).
* ``protocol``: the paper's protocol: plain SGD (no momentum, no adaptive rates), batch 64, one
  learning rate shared by both methods (2e-4, the rate of the paper's second MLP experiment; the
  seed gives no other), no decay; ``--seeds`` seeds each.
* ``tuned``: each method's own SGD learning rate from a half-decade ladder (…, 1e-3, 3e-3,
  1e-2, …), started around a guess and extended until the best final validation loss (seed 0)
  is interior; then ``--seeds`` seeds at the best rate.
* ``activity``: weight- against activity-perturbed FGD (Ren et al. 2023) on the MLP, each
  tuned the same way, ``--seeds`` seeds.
* ``variance``: the estimator's error ``E‖ĝ − ∇L‖²/‖∇L‖²`` for logreg, the MLP and the CNN with
  independent Gaussian and orthogonal directions, and with activity perturbation, against
  theory.

Tf/Tb at equal loss: per seed, the level ``L`` is the worse of the two methods' final validation
losses (so both reach it); ``T`` is the training wall time at the first evaluation with loss
≤ ``L``. Accuracy at equal wall time: each method's last evaluation within the shorter of the
two runs' training times. Data: scikit-learn's digits (8×8, bundled) unless ``--data-dir``
names the four MNIST IDX files. This machine's 2 cores are shared, so runs are short (100 steps,
4.5 epochs of digits) and wall times are noisy: the step counts are the robust comparison.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("logreg.py", "mlp.py", "cnn.py")
PAPER = {  # Baydin et al. 2022 (MNIST, their forward-mode PyTorch)
    "logreg.py": {"Rf": 2.435, "Rb": 4.389, "Tf_Tb": 0.553},
    "mlp.py": {"Rf": 2.468, "Rb": 4.165, "Tf_Tb": 0.211},
    "cnn.py": {"Rf": 1.434, "Rb": 2.211, "Tf_Tb": 0.514},
}
PAPER_LR = 2e-4
LADDER = [float(f"{m}e{e}") for e in range(-6, 1) for m in (1, 3)]  # 1e-6, 3e-6, …, 1, 3
GUESS = {  # where each tuning ladder starts (SGD)
    ("logreg.py", "backprop"): 0.3,
    ("mlp.py", "backprop"): 0.3,
    ("cnn.py", "backprop"): 0.1,
    ("logreg.py", "fgd"): 0.01,
    ("mlp.py", "fgd"): 1e-3,
    ("cnn.py", "fgd"): 1e-3,
    ("mlp.py", "activations"): 0.01,
}
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def merge(path: Path, key: str, value) -> None:
    """Merge ``{key: value}`` into the JSON file ``path`` under an exclusive lock."""
    path.touch()
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        text = f.read()
        doc = json.loads(text) if text.strip() else {}
        doc[key] = value
        f.seek(0)
        f.truncate()
        f.write(json.dumps(doc, indent=1, default=str) + "\n")


def prune(path: Path, keep: set[str]) -> None:
    """Drop the keys of ``path`` that no section writes (figures of older versions)."""
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        doc = json.loads(f.read() or "{}")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({k: v for k, v in doc.items() if k in keep}, indent=1) + "\n")


# --- FLOPs ---------------------------------------------------------------------------------------


def flop_ratios(spec: str, **ctor) -> dict:
    from graphflop.analysis import analyze
    from graphflop.load import load, make_inputs

    loaded = load(spec, ctor_kwargs=ctor, meta=True)
    loaded.model.train()
    r = analyze(loaded.model, make_inputs(loaded)).report
    f = r.totals.forward.flops
    return {
        "params": r.params,
        "Rf_flops": r.totals.forward_gradient_step.flops / f,
        "Rb_flops": r.totals.train_step.flops / f,
    }


def section_flops(a) -> dict:
    out: dict = {"models": {}, "depth": []}
    for m in MODELS:
        log(f"FLOPs {m}")
        out["models"][m] = flop_ratios(str(ROOT / "models" / m))
    for d in [1, 2, 5] if a.quick else [1, 2, 5, 10, 20, 50, 100]:
        log(f"FLOPs MLP depth {d}")
        out["depth"].append({"depth": d, **flop_ratios(str(ROOT / "models" / "mlp.py"), depth=d)})
    return out


# --- training ------------------------------------------------------------------------------------


def run(a, data, model: str, method: str, lr: float, seed: int) -> dict:
    """One SGD run; returns its summary figures and validation curve."""
    from graphflop.train.config import TrainConfig
    from graphflop.train.loop import train

    perturb = "activations" if method == "activations" else "weights"
    c = TrainConfig(
        method="fgd" if method in ("fgd", "activations") else method,
        perturb=perturb,
        optimizer="sgd",
        lr=lr,
        steps=a.steps,
        batch=64,
        seed=seed,
        eval_every=a.eval_every,
        threads=1,
    )
    t = time.time()
    r = train(str(ROOT / "models" / model), data, c)
    s = r.summary
    final = s["final_val_loss"]
    log(f"  {model} {method} lr {lr:g} seed {seed}: val loss {final} ({time.time() - t:.0f} s)")
    return {
        "lr": lr,
        "seed": seed,
        "final_val_loss": final if final is not None and math.isfinite(final) else None,
        "final_val_accuracy": s["final_val_accuracy"],
        "diverged": s["diverged"],
        "train_wall_s": s["train_wall_s"],
        "curve": [
            [h["step"], round(h["wall_s"], 4), h["val_loss"], h["val_accuracy"]]
            for h in r.history
            if h["val_loss"] is not None
        ],
    }


def _score(r: dict) -> float:
    v = r["final_val_loss"]
    return math.inf if v is None or r["diverged"] else v


def tune(a, data, model: str, method: str) -> dict:
    """Ladder search around the guess until the best rate (seed 0) has a worse rate on each
    side (or the ladder's end); returns every rate tried and the best."""
    i = LADDER.index(GUESS[(model, method)])
    tried: dict[int, dict] = {}
    lo, hi = i - 1, i + 1
    while True:
        for j in range(max(lo, 0), min(hi, len(LADDER) - 1) + 1):
            if j not in tried:
                tried[j] = run(a, data, model, method, LADDER[j], 0)
        best = min(tried, key=lambda j: _score(tried[j]))
        if best == min(tried) and best > 0:
            lo = best - 1
        elif best == max(tried) and best < len(LADDER) - 1:
            hi = best + 1
        else:
            break
    grid = [tried[j] for j in sorted(tried)]
    interior = min(tried) < best < max(tried)
    return {"grid": grid, "best_lr": LADDER[best], "interior": interior, "best": tried[best]}


def seeds_at(a, data, model, method, lr, first: dict | None = None) -> list[dict]:
    runs = [first] if first is not None else []
    for s in range(len(runs), a.seeds):
        runs.append(run(a, data, model, method, lr, s))
    return runs


def _first_time(curve, level):
    return next((c[1] for c in curve if c[2] is not None and c[2] <= level + 1e-12), None)


def _last_within(curve, t):
    within = [c for c in curve if c[1] <= t + 1e-12]
    return within[-1][3] if within else None


def compare(b_runs: list[dict], f_runs: list[dict]) -> dict:
    """Tf/Tb at equal loss, accuracy at equal time and at equal steps, per seed and summarised."""
    per = []
    for b, f in zip(b_runs, f_runs):
        if b["final_val_loss"] is None or f["final_val_loss"] is None:
            per.append({"Tf_Tb": None})
            continue
        level = max(b["final_val_loss"], f["final_val_loss"])
        tb, tf = _first_time(b["curve"], level), _first_time(f["curve"], level)
        t_eq = min(b["train_wall_s"], f["train_wall_s"])
        per.append(
            {
                "level": level,
                "Tb_s": tb,
                "Tf_s": tf,
                "Tf_Tb": tf / tb if tf and tb else None,
                "acc_equal_time_backprop": _last_within(b["curve"], t_eq),
                "acc_equal_time_fgd": _last_within(f["curve"], t_eq),
            }
        )
    return {
        "per_seed": per,
        "Tf_Tb": stats([p["Tf_Tb"] for p in per]),
        "acc_equal_time_backprop": stats([p.get("acc_equal_time_backprop") for p in per]),
        "acc_equal_time_fgd": stats([p.get("acc_equal_time_fgd") for p in per]),
    }


def stats(xs) -> dict:
    """Mean, sample standard deviation, min and max of the values that are not None."""
    v = [x for x in xs if x is not None]
    if not v:
        return {"n": 0, "mean": None, "sd": None, "min": None, "max": None}
    return {
        "n": len(v),
        "mean": statistics.fmean(v),
        "sd": statistics.stdev(v) if len(v) > 1 else 0.0,
        "min": min(v),
        "max": max(v),
    }


def summarise(runs: list[dict]) -> dict:
    return {
        "lr": runs[0]["lr"],
        "val_loss": stats([r["final_val_loss"] for r in runs]),
        "val_accuracy": stats([r["final_val_accuracy"] for r in runs]),
        "diverged": sum(r["diverged"] for r in runs),
        "train_wall_s": stats([r["train_wall_s"] for r in runs]),
        "runs": runs,
    }


def section_protocol(a, data) -> dict:
    out = {"lr": PAPER_LR, "models": {}}
    for m in MODELS:
        runs = {meth: seeds_at(a, data, m, meth, PAPER_LR) for meth in ("backprop", "fgd")}
        out["models"][m] = {
            **{meth: summarise(r) for meth, r in runs.items()},
            "compare": compare(runs["backprop"], runs["fgd"]),
        }
    return out


def section_tuned(a, data) -> dict:
    out: dict = {"models": {}}
    for m in MODELS:
        doc, runs = {}, {}
        for meth in ("backprop", "fgd"):
            t = tune(a, data, m, meth)
            runs[meth] = seeds_at(a, data, m, meth, t["best_lr"], t["best"])
            doc[meth] = {
                **summarise(runs[meth]),
                "grid": [{"lr": g["lr"], "final_val_loss": g["final_val_loss"]} for g in t["grid"]],
                "interior": t["interior"],
            }
        doc["compare"] = compare(runs["backprop"], runs["fgd"])
        out["models"][m] = doc
    return out


def section_activity(a, data) -> dict:
    out: dict = {}
    runs = {}
    for meth in ("fgd", "activations"):
        t = tune(a, data, "mlp.py", meth)
        runs[meth] = seeds_at(a, data, "mlp.py", meth, t["best_lr"], t["best"])
        out[meth] = {
            **summarise(runs[meth]),
            "grid": [{"lr": g["lr"], "final_val_loss": g["final_val_loss"]} for g in t["grid"]],
            "interior": t["interior"],
        }
    pairs = zip(runs["fgd"], runs["activations"])
    out["activity_lower_every_seed"] = all(
        f["final_val_loss"] is not None
        and w["final_val_loss"] is not None
        and f["final_val_loss"] < w["final_val_loss"]
        for w, f in pairs
    )
    return out


# --- variance ------------------------------------------------------------------------------------


def activity_variance(data, spec: str, samples: int, seed: int = 0) -> dict:
    import torch
    import torch.nn.functional as F

    from graphflop.train.activity import ActivityPerturbation
    from graphflop.train.model import build_model

    model, _, _ = build_model(spec, data, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(data.y_train), generator=gen)[:64]
    x, y = data.x_train[idx], data.y_train[idx]
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    true = {p: p.grad.detach().clone() for p in model.parameters()}
    gsq = sum(float(g.double().pow(2).sum()) for g in true.values())
    ap = ActivityPerturbation(model, torch.Generator().manual_seed(seed + 1))
    err = 0.0
    for _ in range(samples):
        _, est = ap.estimate(x, y)
        err += sum(float((est[p] - g).double().pow(2).sum()) for p, g in true.items())
    return {"relative_variance": err / samples / gsq, "samples": samples}


def section_variance(a, data) -> dict:
    from graphflop.train.variance import estimator_variance

    out: dict = {}
    for m in MODELS:
        spec = str(ROOT / "models" / m)
        small = m == "logreg.py"
        ks = (1, 2, 4, 8, 16) if small else (1, 8)
        samples = (200 if small else 20) // (4 if a.quick else 1)
        doc = {}
        for orth in (False, True):
            log(f"variance {m} orthogonal={orth}")
            v = estimator_variance(spec, data=data, directions=ks, samples=samples, orthogonal=orth)
            doc["orthogonal" if orth else "gaussian"] = {
                "relative_variance": {str(k): x for k, x in v["relative_variance"].items()},
                "theory_relative": {str(k): x for k, x in v["theory_relative"].items()},
                "samples": samples,
            }
            doc["params"] = v["params"]
        if m != "cnn.py" or not a.quick:
            log(f"variance {m} activity perturbation")
            doc["activations"] = activity_variance(data, spec, samples)
        out[m] = doc
    return out


# --- report --------------------------------------------------------------------------------------


def _pm(st: dict, nd: int = 3) -> str:
    """``mean ± sd`` of a :func:`stats` record (``–`` when empty)."""
    if not st or not st.get("n"):
        return "–"
    return f"{st['mean']:.{nd}f} ± {st['sd']:.{nd}f}"


def plot_training(doc: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    for col, m in enumerate(MODELS):
        for row, sec in enumerate(("protocol", "tuned")):
            ax = axes[row][col]
            for meth, style in (("backprop", "-"), ("fgd", "--")):
                d = doc.get(sec, {}).get("models", {}).get(m, {}).get(meth)
                if not d:
                    continue
                for i, r in enumerate(d["runs"]):
                    c = [x for x in r["curve"] if x[2] is not None]
                    ax.plot(
                        [x[0] for x in c],
                        [x[2] for x in c],
                        style,
                        color="C0" if meth == "backprop" else "C3",
                        alpha=0.8,
                        label=f"{meth} lr {d['lr']:g}" if i == 0 else None,
                    )
            ax.set_title(f"{m}: {'paper protocol' if row == 0 else 'tuned'}")
            ax.set_xlabel("step")
            ax.set_ylabel("validation loss")
            ax.legend()
    fig.savefig(path, dpi=100)


def plot_variance(doc: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, m in zip(fig.subplots(1, 3), MODELS):
        v = doc["variance"][m]
        for key, style in (("gaussian", "o-"), ("orthogonal", "s-")):
            ks = [int(k) for k in v[key]["relative_variance"]]
            ax.loglog(ks, list(v[key]["relative_variance"].values()), style, label=f"{key}")
            ax.loglog(ks, list(v[key]["theory_relative"].values()), "k:", lw=0.8)
        if "activations" in v:
            ax.loglog([1], [v["activations"]["relative_variance"]], "g^", label="activations")
        ax.set_title(f"{m} (n = {v['params']:,})")
        ax.set_xlabel("directions K")
        ax.set_ylabel("E‖ĝ − ∇L‖² / ‖∇L‖²")
        ax.legend()
    fig.savefig(path, dpi=100)


def main_table(doc: dict) -> list[str]:
    lines = [
        "| model | paper Rf | paper Rb | paper Tf/Tb | Rf, Rb FLOPs (graphflop) | Tf/Tb, paper "
        "protocol | Tf/Tb, tuned | val loss backprop / FGD, protocol | val loss backprop / FGD, "
        "tuned |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in MODELS:
        p, f = PAPER[m], doc["flops"]["models"][m]
        pr, tu = doc["protocol"]["models"][m], doc["tuned"]["models"][m]
        lines.append(
            f"| {m} | {p['Rf']} | {p['Rb']} | {p['Tf_Tb']} | {f['Rf_flops']:.2f}, "
            f"{f['Rb_flops']:.2f} | {_pm(pr['compare']['Tf_Tb'], 2)} | "
            f"{_pm(tu['compare']['Tf_Tb'], 2)} | {_pm(pr['backprop']['val_loss'])} / "
            f"{_pm(pr['fgd']['val_loss'])} | {_pm(tu['backprop']['val_loss'])} / "
            f"{_pm(tu['fgd']['val_loss'])} |"
        )
    return lines


def runs_table(sec: dict, grid: bool) -> list[str]:
    lines = [
        "| model | method | lr | val loss | val accuracy | acc. at equal time | Tf/Tb "
        + ("| lr grid: final val loss (seed 0) | best interior |" if grid else "|"),
        "|---|---|---|---|---|---|---|" + ("---|---|" if grid else ""),
    ]
    for m in MODELS:
        d = sec["models"][m]
        for meth in ("backprop", "fgd"):
            r, c = d[meth], d["compare"]
            row = (
                f"| {m} | {meth} | {r['lr']:g} | {_pm(r['val_loss'])} | "
                f"{_pm(r['val_accuracy'])} | {_pm(c['acc_equal_time_' + meth])} | "
                + (_pm(c["Tf_Tb"], 2) if meth == "fgd" else "")
                + " |"
            )
            if grid:
                g = ", ".join(
                    f"{x['lr']:g}: {x['final_val_loss']:.3f}"
                    if x["final_val_loss"] is not None
                    else f"{x['lr']:g}: diverged"
                    for x in r["grid"]
                )
                row += f" {g} | {'yes' if r['interior'] else 'no'} |"
            lines.append(row)
    return lines


def variance_table(doc: dict) -> list[str]:
    lines = [
        "| model | n | directions | K | measured | theory | samples |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in MODELS:
        v = doc["variance"][m]
        for key in ("gaussian", "orthogonal"):
            for k, x in v[key]["relative_variance"].items():
                t = v[key]["theory_relative"][k]
                lines.append(
                    f"| {m} | {v['params']:,} | {key} | {k} | {x:,.1f} | {t:,.1f} | "
                    f"{v[key]['samples']} |"
                )
        if "activations" in v:
            a = v["activations"]
            lines.append(
                f"| {m} | {v['params']:,} | activity perturbation | 1 | "
                f"{a['relative_variance']:,.1f} | – | {a['samples']} |"
            )
    return lines


def activity_table(doc: dict) -> list[str]:
    lines = [
        "| perturbation | lr | val loss | val accuracy | lr grid: final val loss (seed 0) |",
        "|---|---|---|---|---|",
    ]
    for key, label in (("fgd", "weights (Baydin et al.)"), ("activations", "activations")):
        r = doc["activity"][key]
        g = ", ".join(
            f"{x['lr']:g}: {x['final_val_loss']:.3f}"
            if x["final_val_loss"] is not None
            else f"{x['lr']:g}: diverged"
            for x in r["grid"]
        )
        lines.append(
            f"| {label} | {r['lr']:g} | {_pm(r['val_loss'])} | {_pm(r['val_accuracy'])} | {g} |"
        )
    return lines


def depth_table(doc: dict) -> list[str]:
    lines = [
        "| hidden layers | params | Rf FLOPs | Rb FLOPs | Rf/Rb FLOPs |",
        "|---|---|---|---|---|",
    ]
    for d in doc["flops"]["depth"]:
        lines.append(
            f"| {d['depth']} | {d['params']:,} | {d['Rf_flops']:.3f} | {d['Rb_flops']:.3f} | "
            f"{d['Rf_flops'] / d['Rb_flops']:.4f} |"
        )
    return lines


def render(out: Path) -> None:
    """Write ``training.png``, ``variance.png`` and the generated tables
    (``tables.md``, included by hand into the README) from ``results.json``."""
    doc = json.loads((out / "results.json").read_text())
    plot_training(doc, out / "training.png")
    plot_variance(doc, out / "variance.png")
    st = doc["settings"]
    parts = [
        f"<!-- generated by tools/reproduce_seed_b.py --render from results.json: {st} -->",
        "## main",
        *main_table(doc),
        "## protocol",
        *runs_table(doc["protocol"], grid=False),
        "## tuned",
        *runs_table(doc["tuned"], grid=True),
        "## activity",
        *activity_table(doc),
        "## variance",
        *variance_table(doc),
        "## depth",
        *depth_table(doc),
    ]
    (out / "tables.md").write_text("\n".join(parts) + "\n")


# --- main ----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "seed-b"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--data-dir", default=None, help="MNIST IDX folder (default: digits)")
    ap.add_argument("--only", default="flops,protocol,tuned,activity,variance")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--render", action="store_true", help="only redraw the figures and tables.md")
    a = ap.parse_args()
    out = Path(a.out)
    if a.render:
        render(out)
        return 0
    if a.quick:
        a.steps, a.seeds, a.eval_every = 10, 2, 5
    out.mkdir(parents=True, exist_ok=True)
    from graphflop.train.data import load_dataset

    data = load_dataset("mnist" if a.data_dir else "digits", a.data_dir)
    res = out / "results.json"
    merge(
        res,
        "settings",
        {"dataset": data.name, "steps": a.steps, "seeds": a.seeds, "eval_every": a.eval_every},
    )
    sections = {
        "flops": lambda: section_flops(a),
        "protocol": lambda: section_protocol(a, data),
        "tuned": lambda: section_tuned(a, data),
        "activity": lambda: section_activity(a, data),
        "variance": lambda: section_variance(a, data),
    }
    prune(res, {"settings", *sections})
    for name in a.only.split(","):
        log(f"== {name}")
        merge(res, name, sections[name]())
    if all(k in json.loads(res.read_text()) for k in sections):
        render(out)
    log(f"done: {res}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
