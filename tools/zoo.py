"""The zoo: models none of us wrote, analysed with default settings, beside FlopCounterMode.

Every model (torchvision, timm and transformers models built from configurations, no weights)
is analysed the way ``graphflop inspect SPEC`` does by default (meta device, batch 1, train
mode, loss ``auto``, backward + SGD update + JVP with parameter tangents), each in its own
child process, which reports:

* parameters; graphflop's forward, backward and JVP matrix FLOPs (``mm_flops``);
* ``torch.utils.flop_counter.FlopCounterMode`` on the same meta model and inputs: the forward
  with the default attention kernel, and forward and forward + backward (of the same loss)
  with scaled-dot-product attention forced to the math kernel
  (``sdpa_kernel(SDPBackend.MATH)``);
* why the two differ, in one line: FlopCounterMode's default CPU attention kernel is counted 0,
  and its grouped-convolution weight gradient is G times too high (docs/flops_conventions.md); the tool computes
  that excess from graphflop's forward graph and checks that it accounts for the whole
  difference;
* analysis seconds (load + analyze) and peak RSS of the child after the analysis;
* status: ok, or the failure's one line.

Results are written as they come to ``--json`` (default ``docs/zoo.json``) and the Markdown
table to ``--out`` (default ``docs/zoo.md``); a model that fails does not stop the run.

    python tools/zoo.py                    # every model (about half an hour on 2 cores)
    python tools/zoo.py --only bert gpt2   # some of them
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools._child import run_json_child  # noqa: E402


@dataclass(frozen=True)
class Entry:
    """One zoo model: ``spec`` with config/constructor ``args``; ``shape`` overrides the
    default input shape; ``eval`` analyses in eval mode; ``note`` says what is not default."""

    name: str
    spec: str
    args: dict = field(default_factory=dict)
    shape: tuple[int, ...] | None = None
    seq: int | None = None
    eval: bool = False
    note: str = ""


TV = "torchvision:"
#: why some rows run at batch 2
BN2 = (
    "batch 2: at batch 1 a train-mode batch norm sees one value per channel, which PyTorch "
    "itself refuses (ValueError)"
)
#: the routing assumption of the mixture-of-experts rows
MOE = (
    "routing: each token runs exactly its top-k experts (transformers' batched_mm experts), "
    "plus the router's matmul and top-k (N·⌈log2 k⌉ comparisons); the count does not depend "
    "on how tokens spread over experts"
)
ZOO: list[Entry] = [
    # torchvision classification, segmentation, video
    *(
        Entry(n, TV + n)
        for n in (
            "resnet50",
            "mobilenet_v3_large",
            "efficientnet_b0",
            "convnext_tiny",
            "vit_b_16",
            "swin_t",
            "regnet_y_400mf",
            "densenet121",
            "maxvit_t",
        )
    ),
    Entry("inception_v3", TV + "inception_v3", shape=(2, 3, 299, 299), note=BN2),
    Entry("fcn_resnet50", TV + "fcn_resnet50"),
    Entry("deeplabv3_resnet50", TV + "deeplabv3_resnet50", shape=(2, 3, 224, 224), note=BN2),
    Entry("r3d_18", TV + "r3d_18", shape=(1, 3, 16, 112, 112), note="16 frames of 112×112"),
    # timm: one model per family
    *(
        Entry("timm " + n, "timm:" + n)
        for n in (
            "resnet50d",
            "efficientnet_b0",
            "convnext_nano",
            "vit_small_patch16_224",
            "deit_tiny_patch16_224",
            "swin_tiny_patch4_window7_224",
            "regnety_002",
            "mixer_b16_224",
            "poolformer_s12",
            "ghostnet_100",
            "cspdarknet53",
        )
    ),
    Entry("timm levit_128", "timm:levit_128", shape=(2, 3, 224, 224), note=BN2),
    # transformers from configurations (the library's defaults unless said)
    Entry("bert", "hf:bert", note="bert-base"),
    Entry("roberta", "hf:roberta", note="roberta-base"),
    Entry("distilbert", "hf:distilbert"),
    Entry("albert", "hf:albert", note="albert-xxlarge shapes (the config default)"),
    Entry("electra", "hf:electra", note="electra-small discriminator"),
    Entry("gpt2", "hf:gpt2", note="gpt2 small"),
    Entry(
        "llama",
        "hf:llama",
        {"num_key_value_heads": 8},
        note="Llama-2-7B shapes with 8 key/value heads for 32 query heads (GQA)",
    ),
    Entry("mistral", "hf:mistral", note="Mistral-7B (GQA, 8 kv heads)"),
    Entry("qwen2", "hf:qwen2", note="Qwen2-7B shapes"),
    Entry("gemma", "hf:gemma", note="Gemma-7B shapes"),
    Entry("phi3", "hf:phi3", note="Phi-3-mini"),
    Entry("opt", "hf:opt", note="opt-350m shapes"),
    Entry("gpt_neox", "hf:gpt_neox", note="GPT-NeoX-20B shapes"),
    Entry("t5", "hf:t5", note="t5-small; encoder and decoder at seq 128"),
    Entry("bart", "hf:bart", note="bart-large"),
    Entry("whisper", "hf:whisper", note="whisper default config; 3000 mel frames, 128 tokens"),
    Entry(
        "wav2vec2",
        "hf:wav2vec2",
        eval=True,
        note="wav2vec2-base; 1 s of 16 kHz audio; eval mode: train mode's layer drop draws a "
        "random number per layer and branches on it (data-dependent, cannot be traced)",
    ),
    Entry("vit", "hf:vit", note="vit-base 224"),
    Entry("clip", "hf:clip", seq=77, note="text 77 tokens (CLIP's maximum) + image 224"),
    Entry(
        "mixtral",
        "hf:mixtral",
        {"experts_implementation": "batched_mm"},
        note=f"Mixtral-8x7B; {MOE}",
    ),
    Entry(
        "qwen2_moe",
        "hf:qwen2_moe",
        {"experts_implementation": "batched_mm"},
        note=f"Qwen1.5-MoE-A2.7B shapes; {MOE}",
    ),
]


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _first(out):
    import torch

    return out if isinstance(out, torch.Tensor) else torch.utils._pytree.tree_flatten(out)[0][0]


def _flop_counter(model, inputs) -> dict:
    """FlopCounterMode's forward (default kernel), forward and forward + backward (math
    attention) of ``model`` on ``inputs``, with the loss graphflop picks."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from graphflop.frontend.libraries import traced_by_libraries
    from graphflop.frontend.trace import default_loss

    with traced_by_libraries():
        with torch.no_grad(), FlopCounterMode(display=False) as c0:
            model(*inputs)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as c:
            out = model(*inputs)
            fwd = c.get_total_flops()
            first = _first(out)
            if default_loss(out) == "cross_entropy":
                target = torch.zeros(first.shape[0], dtype=torch.long, device=first.device)
                loss = F.cross_entropy(first, target)
            else:
                loss = first.sum()
            loss.backward()
    return {
        "fcm_fwd_default": c0.get_total_flops(),
        "fcm_fwd": fwd,
        "fcm_bwd": c.get_total_flops() - fwd,
    }


def _grouped_conv_excess(forward) -> tuple[int, int]:
    """FlopCounterMode's excess on the weight gradients of grouped convolutions: (G − 1) × the
    convolution's matrix FLOPs for each grouped convolution whose weight trains (docs/flops_conventions.md), and
    how many there are."""
    import torch

    from graphflop.meta import COST, PARAM_DERIVED, SIGNATURE

    trainable = {p for p, _ in forward.meta[SIGNATURE].trainable()}
    excess = count = 0
    for n in forward.graph.nodes:
        if n.target is not torch.ops.aten.convolution.default:
            continue
        groups = n.args[8] if len(n.args) > 8 else 1
        w = n.args[1]
        # a weight computed from parameters (weight norm) has a weight gradient too
        trains = getattr(w, "name", None) in trainable or w.meta.get(PARAM_DERIVED, False)
        if groups > 1 and trains:
            excess += (groups - 1) * n.meta[COST].mm_flops
            count += 1
    return excess, count


def _backward_mm_of_non_mm(a) -> int:
    """Backward matrix FLOPs of forward ops that are not matrix ops (an average pool with
    ``count_include_pad=False`` or ``ceil_mode`` transposes to a convolution)."""
    from graphflop.meta import COST, SOURCE

    fwd = {n.name: n for n in a.forward.graph.nodes}
    total = 0
    for n in a.backward.graph.nodes:
        cost = n.meta.get(COST)
        src = fwd.get(n.meta.get(SOURCE, ""))
        if cost and cost.mm_flops and src is not None and COST in src.meta:
            total += cost.mm_flops if src.meta[COST].mm_flops == 0 else 0
    return total


def worker(name: str) -> dict:
    """Analyse one zoo model (in this process) and return its row."""
    import warnings

    warnings.simplefilter("ignore")
    entry = next(e for e in ZOO if e.name == name)
    t0 = time.perf_counter()
    from graphflop.analysis import analyze
    from graphflop.load import load, make_inputs

    loaded = load(entry.spec, ctor_kwargs=dict(entry.args), meta=True, seq=entry.seq)
    loaded.model.train(not entry.eval)
    inputs = make_inputs(loaded, shapes=[entry.shape] if entry.shape else None)
    a = analyze(loaded.model, inputs, name=entry.name)
    row: dict = {"seconds": round(time.perf_counter() - t0, 1), "peak_rss_mb": round(_rss_mb())}
    r = a.report
    row.update(
        params=r.params,
        inputs=[list(i.shape) for i in r.inputs],
        loss=r.loss,
        ours_fwd=r.totals.forward.mm_flops + r.totals.loss.mm_flops,
        ours_bwd=r.totals.backward.mm_flops if r.totals.backward else None,
        ours_jvp=r.totals.jvp.mm_flops if r.totals.jvp else None,
        notes=list(loaded.notes),
    )
    row["conv_excess"], row["grouped_convs"] = _grouped_conv_excess(a.forward)
    row["bwd_mm_of_non_mm"] = _backward_mm_of_non_mm(a)
    try:
        row.update(_flop_counter(loaded.model, inputs))
    except Exception as e:  # FlopCounterMode's run failing is a finding, not a zoo failure
        row["fcm_error"] = f"{type(e).__name__}: {_line(e)}"
    return row


def _line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:200]


def explain(row: dict) -> str:
    """One line: why graphflop's and FlopCounterMode's matrix FLOPs differ (or that they agree)."""
    if "fcm_error" in row:
        return f"FlopCounterMode failed: {row['fcm_error']}"
    if "fcm_fwd" not in row:
        return ""
    parts = []
    d_fwd = row["fcm_fwd"] - row["ours_fwd"]
    d_bwd = row["fcm_bwd"] - (row["ours_bwd"] or 0)
    if d_fwd:
        parts.append(f"forward differs by {d_fwd:+,} (unexplained)")
    pool = row.get("bwd_mm_of_non_mm", 0)
    if d_bwd and row["conv_excess"]:
        parts.append(
            f"FlopCounterMode's weight gradients of {row['grouped_convs']} grouped convs are "
            f"G× too high: +{row['conv_excess']:,}"
        )
    if d_bwd and pool:
        parts.append(
            f"graphflop's average-pool backward is a transposed convolution, in its matrix "
            f"FLOPs: −{pool:,}"
        )
    if d_bwd and d_bwd != row["conv_excess"] - pool:
        rest = d_bwd - row["conv_excess"] + pool
        parts.append(f"backward differs by {rest:+,} more (unexplained)")
    lost = row["fcm_fwd"] - row["fcm_fwd_default"]
    if lost:
        parts.append(f"FlopCounterMode's default CPU attention kernel counts 0: −{lost:,} forward")
    return "; ".join(parts) or "equal"


def _g(x) -> str:
    return "" if x is None else f"{x / 1e9:,.2f}"


def markdown(rows: dict[str, dict]) -> str:
    ok = sum(1 for e in ZOO if rows.get(e.name, {}).get("status") == "ok")
    done = sum(1 for e in ZOO if e.name in rows)
    import torch

    lines = [
        "# The zoo: models none of us wrote",
        "",
        "Written by `python tools/zoo.py` (do not edit by hand). Each model is analysed as "
        "`graphflop inspect SPEC` does by default: built from its library's constructor or "
        "configuration on the meta device (no weights, no download), batch 1 (token inputs "
        "of 128), train mode, loss `auto` (cross-entropy for (N, C) logits and, token-level, "
        "for a language model's (B, T, V) logits, else the sum of the first output), backward + SGD update + JVP with parameter tangents; one child "
        "process per model.",
        "",
        "Matrix FLOPs (`mm_flops`: matrix products, convolutions, attention; 1 multiply-add = "
        "2) in GFLOPs. FlopCounterMode (FCM) runs on the same meta model and inputs with the "
        "same loss; its columns force scaled-dot-product attention to the math kernel "
        "(`sdpa_kernel(SDPBackend.MATH)`); the last column says why the figures differ. "
        "Seconds: load + analysis in the child; RSS: the child's peak after the analysis.",
        "",
        f"**{ok} of {len(ZOO)} analysed** (forward, backward, JVP); {done} run. Machine: "
        f"{platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}, "
        f"{_versions()}.",
        "",
        f"FlopCounterMode's forward with the default attention kernel differs from its math "
        f"kernel's in {_default_kernel_diffs(rows)} of these runs (on meta tensors the math "
        "form is what runs; on real CPU tensors the fused kernel is counted 0: a 1×4×64×32 "
        "self-attention counts 0 on CPU and 2,097,152 on meta in torch 2.13).",
        "",
        "| model | config | params | fwd | FCM fwd | bwd | FCM bwd | jvp | s | RSS MB "
        "| status | difference |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for e in ZOO:
        r = rows.get(e.name)
        if r is None:
            continue
        cfg = e.note or "default"
        if e.args:
            cfg += " (" + ", ".join(f"{k}={v}" for k, v in e.args.items()) + ")"
        lines.append(
            f"| {e.name} | {cfg} | {r.get('params', 0) / 1e6:,.1f} M | {_g(r.get('ours_fwd'))} "
            f"| {_g(r.get('fcm_fwd'))} | {_g(r.get('ours_bwd'))} | {_g(r.get('fcm_bwd'))} "
            f"| {_g(r.get('ours_jvp'))} | {r.get('seconds', '')} | {r.get('peak_rss_mb', '')} "
            f"| {r['status']} | {explain(r) if r['status'] == 'ok' else ''} |"
        )
    lines += ["", *FINDINGS]
    return "\n".join(lines) + "\n"


#: what the first full run hit, and what was done about it
FINDINGS = [
    "## What the first run hit",
    "",
    "- MoE routing needed a rule for `aten.topk` (added: N·⌈log2 k⌉ comparisons per row, the "
    "values' tangent gathered at the indices). transformers' default experts implementation "
    "(`grouped_mm`) then failed: it sorts tokens by expert (`aten.sort`, no rule) and calls "
    "`_grouped_mm` with data-dependent group sizes; the MoE rows use `batched_mm`, which "
    "computes the same tokens·k expert products. Since then `sort`, `histc` and transformers' "
    "`grouped_mm_fallback` have rules (docs/flops_conventions.md), and the presets below are "
    "analysed through the default implementation.",
    "- inception_v3, deeplabv3_resnet50, timm levit_128 at batch 1 in train mode: PyTorch's "
    "batch norm refuses one value per channel (ValueError, not a graphflop limit): batch 2.",
    "- wav2vec2 in train mode: LayerDrop branches on a random number "
    "(`if not skip_the_layer`), data-dependent: analysed in eval mode.",
    "- CLIP at 128 tokens: its text model allows at most 77 positions: 77 tokens.",
    "- Every remaining difference from FlopCounterMode is explained: its grouped-convolution "
    "weight gradient is G× too high (docs/flops_conventions.md). The first run also found graphflop's backward "
    "of a 2-D average pool with `ceil_mode`/`count_include_pad=False` counted as a transposed "
    "convolution in its matrix FLOPs while the forward pool is not; it is pooling now "
    "(`col2im`, docs/flops_conventions.md) and those five models were run again. A 3-D "
    "average pool's backward is still a transposed convolution.",
]


def _default_kernel_diffs(rows: dict[str, dict]) -> int:
    return sum(1 for r in rows.values() if r.get("fcm_fwd_default", 0) != r.get("fcm_fwd", 0))


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("torchvision", "timm", "transformers"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg} not installed")
    return ", ".join(out)


def run_one(e: Entry, timeout: float) -> dict:
    """Run :func:`worker` for ``e`` in a child process; its row with ``status``."""
    row = run_json_child(__file__, e.name, timeout)
    row.setdefault("status", "ok")
    return row


def _with_kept_sections(path: Path, text: str) -> str:
    """``text`` followed by the sections other tools write into ``path`` (tools/presets.py's,
    between its ``<!-- presets: ... -->`` and ``<!-- /presets -->`` markers), so that
    rewriting the zoo's table keeps them."""
    old = path.read_text() if path.exists() else ""
    kept = re.findall(r"<!-- presets:.*?<!-- /presets -->\n?", old, re.S)
    return text.rstrip("\n") + "\n\n" + "".join(kept) if kept else text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="zoo names to run (default: all)")
    p.add_argument("--json", default=str(ROOT / "docs" / "zoo.json"))
    p.add_argument("--out", default=str(ROOT / "docs" / "zoo.md"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per model")
    p.add_argument("--render", action="store_true", help="rewrite --out from --json only")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    from graphflop.io import atomic_write

    unknown = sorted(set(args.only or ()) - {e.name for e in ZOO})
    if unknown:
        p.error(f"unknown zoo names {', '.join(unknown)}; known: {', '.join(e.name for e in ZOO)}")
    path = Path(args.json)
    rows: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}
    # without --only, models already analysed (status ok in --json) are not run again
    todo = [
        e
        for e in ZOO
        if (e.name in args.only if args.only else rows.get(e.name, {}).get("status") != "ok")
        and not args.render
    ]
    for i, e in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {e.name} ...", end=" ", flush=True)
        row = run_one(e, args.timeout)
        rows[e.name] = row
        print(row["status"], f"{row.get('seconds', '')} s", explain(row), flush=True)
        atomic_write(path, json.dumps(rows, indent=1) + "\n")
        atomic_write(Path(args.out), _with_kept_sections(Path(args.out), markdown(rows)))
    atomic_write(Path(args.out), _with_kept_sections(Path(args.out), markdown(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
