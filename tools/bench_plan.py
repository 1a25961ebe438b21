"""Benchmark: graphflop's parallel plan against torch under the fake process group, FSDP2
(``zero3``), tensor parallelism (``tp``) and FSDP2 × TP on a 2-D mesh (``fsdp_tp``: ``--tp``
ranks inner, world / tp data-parallel) at large worlds, full model size, one process.

For each model × mode × world, two sides on the same configuration and micro-batch:

- **torch** (:func:`bench_plan_fake.run_world`): the fake process group (``FakeStore``,
  backend ``"fake"``), the model built under FakeTensorMode, FSDP2 ``fully_shard`` per block
  plus the root (``zero3``), ``parallelize_module`` with the Megatron plan (``tp``), or that
  plan on the mesh's inner dimension then FSDP2 on the outer one (``fsdp_tp``), AdamW
  (``foreach=False``); the collectives logged by graphflop.runtime.parallel_probe's dispatch
  mode (op level: kind, group size, elements, dtype, phase) and the peak of torch's
  ``FSDPMemTracker`` (zero3, fsdp_tp) or ``MemTracker`` (tp) over the last of 2 steps, rank 0.
- **graphflop** (:func:`graphflop.parallel.predict`, what ``graphflop plan`` prints): the
  model analysed on the meta device with one block (``--blocks``: each of the model's blocks
  counted from it), AdamW, the CPU eager memory model; rank class 0.

Per row: the collectives equal as a multiset or not (and their bytes on each side), the
predicted and the tracker's peak, the relative error; per world the worst error. The results
go to ``--out`` as JSON and the table to stdout (Markdown).

    python tools/bench_plan.py --out results/bench_plan.json            # everything
    python tools/bench_plan.py --models llama3-8b --modes tp --worlds 8 --out r.json
    python tools/bench_plan.py --models llama3-8b --modes fsdp_tp --worlds 64 256 1024

A TP degree that does not divide a dim the plan shards (heads, key/value heads, vocabulary),
or an ``fsdp_tp`` world that is not a multiple of ``--tp`` above it, is not run: the row says
why.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_plan_fake import run_world  # noqa: E402

#: name -> (model spec, constructor arguments, the constructor argument counting the blocks,
#: the model's blocks)
MODELS: dict[str, tuple[str, dict, str, int]] = {
    "gpt2-xl": (f"{ROOT}/models/gpt2.py:gpt2_xl", {}, "n_layer", 48),
    "llama3-8b": (f"{ROOT}/models/llama.py:Llama", {}, "n_layers", 32),
}


def _key(c: dict) -> tuple:
    return (c["kind"], c["group_size"], c["elements"], c["dtype"], c["phase"])


_ESIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "float64": 8}


def _bytes(keys: Counter) -> int:
    return sum(k[2] * _ESIZE.get(k[3], 4) * n for k, n in keys.items())


def plan_side(
    spec: str,
    ctor: dict,
    blocks_arg: str,
    n_blocks: int,
    mode: str,
    world: int,
    batch: int,
    seq: int,
    tp: int = 8,
) -> dict:
    """graphflop's rank-0 figures: collectives (multiset keys) and the predicted peak."""
    from graphflop.analysis import analyze
    from graphflop.load import load, make_inputs
    from graphflop.parallel import Plan, predict

    t0, c0 = time.perf_counter(), time.process_time()
    loaded = load(spec, ctor_kwargs={**ctor, blocks_arg: 1}, meta=True)
    a = analyze(
        loaded.model,
        make_inputs(loaded, shapes=[(batch, seq)]),
        optimizer="adamw",
        jvp=False,
        device="cpu",
    )
    plan = {
        "zero3": lambda: Plan(dp=world, zero=3),
        "tp": lambda: Plan(tp=world),
        "fsdp_tp": lambda: Plan(dp=world // tp, tp=tp, zero=3),
    }[mode]()
    rank = predict(
        a, loaded.model, plan, micro_batch=batch, memory_device="cpu", block_counts=(n_blocks,)
    ).ranks[0]
    return {
        "collectives": Counter(c.key() for c in rank.collectives),
        "peak": int(rank.memory_bytes["peak"]),
        "memory_bytes": {k: int(v) for k, v in rank.memory_bytes.items()},
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
    }


def torch_side(
    spec: str, ctor: dict, mode: str, world: int, batch: int, seq: int, tp: int = 8
) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    rec = run_world(spec, mode, world, ctor, batch, seq, tp=tp)
    return {
        "collectives": Counter(_key(c) for c in rec["collectives"]),
        "peak": rec["peak_bytes"],
        "live_at_step_start": rec["live_at_step_start"],
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
    }


def _why_not(name: str, mode: str, world: int, tp: int) -> str | None:
    """Why ``mode`` cannot run at ``world`` (None when it can)."""
    if mode == "zero3":
        return None
    if mode == "fsdp_tp":
        if world % tp or world <= tp:
            return f"world {world} is not a multiple of tp {tp} above it"
        why = _tp_divides(name, tp)
        return f"tp {why}" if why else None
    return _tp_divides(name, world)


def _tp_divides(name: str, world: int) -> str | None:
    """Why ``world``-way TP cannot shard the model (None when it can)."""
    import importlib.util

    spec = MODELS[name][0].split(":")[0]
    m = importlib.util.spec_from_file_location("_m", spec)
    assert m is not None and m.loader is not None
    mod = importlib.util.module_from_spec(m)
    m.loader.exec_module(mod)
    if name == "llama3-8b":
        c = mod.LLAMA3_8B
        dims = {"heads": c["n_heads"], "key/value heads": c["n_kv_heads"], "vocabulary": c["vocab"]}
    else:
        layers, heads, width = mod.SIZES["xl"]
        dims = {"heads": heads, "vocabulary": mod.VOCAB_SIZE}
    bad = [f"{k} {v}" for k, v in dims.items() if v % world]
    return f"{world} does not divide " + ", ".join(bad) if bad else None


def run(
    names: list[str],
    modes: list[str],
    worlds: list[int],
    batch: int,
    seq: int,
    out: Path | None = None,
    tp: int = 8,
) -> list:
    """The rows of every model × mode × world; written to ``out`` as JSON after each row
    (a long run keeps what it has measured)."""
    rows: list[dict] = []

    def save() -> None:
        if out is not None:
            out.write_text(json.dumps(rows, indent=1) + "\n")

    for name in names:
        spec, ctor, blocks_arg, n_blocks = MODELS[name]
        for mode in modes:
            for world in worlds:
                row: dict = {"model": name, "mode": mode, "world": world}
                if mode == "fsdp_tp":
                    row["mesh"] = f"dp {world // tp} x tp {tp}"
                why = _why_not(name, mode, world, tp)
                if why:
                    row["skipped"] = why
                    rows.append(row)
                    save()
                    print(f"{name} {mode} w{world}: skipped ({why})", flush=True)
                    continue
                p = plan_side(spec, ctor, blocks_arg, n_blocks, mode, world, batch, seq, tp)
                t = torch_side(spec, ctor, mode, world, batch, seq, tp)
                row.update(
                    collectives_equal=p["collectives"] == t["collectives"],
                    n_collectives=[sum(p["collectives"].values()), sum(t["collectives"].values())],
                    collective_bytes=[_bytes(p["collectives"]), _bytes(t["collectives"])],
                    predicted_peak=p["peak"],
                    tracker_peak=t["peak"],
                    error=(p["peak"] - t["peak"]) / t["peak"],
                    plan_memory_bytes=p["memory_bytes"],
                    plan_cpu_s=p["cpu_s"],
                    plan_wall_s=p["wall_s"],
                    torch_cpu_s=t["cpu_s"],
                    torch_wall_s=t["wall_s"],
                    logged=[[*k, n] for k, n in sorted(t["collectives"].items())],
                )
                if not row["collectives_equal"]:
                    row["only_predicted"] = [
                        [*k, n] for k, n in (p["collectives"] - t["collectives"]).items()
                    ]
                    row["only_logged"] = [
                        [*k, n] for k, n in (t["collectives"] - p["collectives"]).items()
                    ]
                rows.append(row)
                save()
                print(
                    f"{name} {mode} w{world}: collectives equal {row['collectives_equal']} "
                    f"({row['n_collectives']}), peak {p['peak']:,} / {t['peak']:,} "
                    f"({row['error']:+.2%}); plan {p['cpu_s']:.1f} s CPU, torch "
                    f"{t['cpu_s']:.1f} s CPU",
                    flush=True,
                )
    return rows


def replan(rows: list, batch: int, seq: int, tp: int) -> list:
    """``rows`` with graphflop's side computed again (torch's side does not depend on it):
    the predicted peak and its error against the saved tracker peak, the collectives against
    the saved logged multiset (a row saved without it: against its count and bytes)."""
    for r in rows:
        if "skipped" in r:
            continue
        spec, ctor, blocks_arg, n_blocks = MODELS[r["model"]]
        p = plan_side(spec, ctor, blocks_arg, n_blocks, r["mode"], r["world"], batch, seq, tp)
        if "logged" in r:
            logged = Counter({tuple(k[:-1]): k[-1] for k in r["logged"]})
            r["collectives_equal"] = p["collectives"] == logged
        else:
            r["collectives_equal"] = [sum(p["collectives"].values()), _bytes(p["collectives"])] == [
                r["n_collectives"][1],
                r["collective_bytes"][1],
            ]
            r["collectives_checked"] = "count and bytes (no logged multiset saved)"
        r.update(
            n_collectives=[sum(p["collectives"].values()), r["n_collectives"][1]],
            collective_bytes=[_bytes(p["collectives"]), r["collective_bytes"][1]],
            predicted_peak=p["peak"],
            error=(p["peak"] - r["tracker_peak"]) / r["tracker_peak"],
            plan_memory_bytes=p["memory_bytes"],
            plan_cpu_s=p["cpu_s"],
            plan_wall_s=p["wall_s"],
            replanned=True,
        )
    return rows


def table(rows: list) -> str:
    """The Markdown table of ``rows`` and the worst error per world."""
    out = [
        "| model | mode | world | collectives equal (count, bytes) | predicted peak | "
        "tracker peak | error | time plan / torch (s CPU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mode = f"{r['mode']} ({r['mesh']})" if "mesh" in r else r["mode"]
        if "skipped" in r:
            out.append(
                f"| {r['model']} | {mode} | {r['world']} | not run: {r['skipped']} | | | | |"
            )
            continue
        eq = "yes" if r["collectives_equal"] else "NO"
        nb = r["collective_bytes"]
        b = f"{nb[0]:,}" if nb[0] == nb[1] else f"{nb[0]:,} / {nb[1]:,}"
        out.append(
            f"| {r['model']} | {mode} | {r['world']} | {eq} ({r['n_collectives'][1]}, "
            f"{b} B) | {r['predicted_peak']:,} | {r['tracker_peak']:,} | {r['error']:+.3%} | "
            f"{r['plan_cpu_s']:.1f} / {r['torch_cpu_s']:.1f} |"
        )
    worst: dict[int, float] = {}
    for r in rows:
        if "error" in r:
            worst[r["world"]] = max(worst.get(r["world"], 0.0), abs(r["error"]))
    out.append("")
    out.append(
        "worst |error| per world: " + ", ".join(f"{w}: {e:.3%}" for w, e in sorted(worst.items()))
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument(
        "--modes", nargs="+", choices=("zero3", "tp", "fsdp_tp"), default=["zero3", "tp", "fsdp_tp"]
    )
    p.add_argument("--tp", type=int, default=8, help="fsdp_tp: TP ranks (the inner mesh dim)")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--batch", type=int, default=1, help="rows per data-parallel rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", help="write the rows as JSON")
    p.add_argument("--table", help="print the table of a --out JSON and exit")
    p.add_argument(
        "--replan",
        help="compute graphflop's side of a --out JSON again (torch's side kept), write it "
        "back and print the table",
    )
    a = p.parse_args(argv)
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return 0
    if a.replan:
        path = Path(a.replan)
        rows = replan(json.loads(path.read_text()), a.batch, a.seq, a.tp)
        path.write_text(json.dumps(rows, indent=1) + "\n")
        print(table(rows))
        return 0
    out = Path(a.out) if a.out else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    if a.tp < 2:
        print(f"error: --tp {a.tp}: fsdp_tp needs at least 2 TP ranks", file=sys.stderr)
        return 2
    rows = run(a.models, a.modes, a.worlds, a.batch, a.seq, out, a.tp)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
