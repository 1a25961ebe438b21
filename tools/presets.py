"""The published presets (``graphflop models``), each analysed in full, beside the scaling-law
estimates people quote; writes the presets section of docs/zoo.md and docs/presets.json.

Every preset is built from its bundled configuration on the meta device and analysed as
``graphflop inspect hf:NAME --seq T`` does (train mode, loss ``auto``, backward, SGD update,
JVP with parameter tangents, eager memory model), at batch 1 and T = 4,096 tokens, or the
model's own positions where it has fewer (GPT-2 1,024, BERT 512; Whisper: 3,000 mel frames and
its decoder's 448 tokens; ViT-B/16: one 224×224 image, 197 patches), each in its own child
process, which reports:

* parameters and active parameters per token (:func:`graphflop.presets.active_parameters`);
* forward FLOPs (all, and matrix FLOPs) per token, and the training step's (forward + loss +
  backward + update) per token;
* for decoder-only language models, the estimates: 2N and 6N per token with N the active
  non-embedding parameters, and Kaplan et al. 2020's C_forward = 2N + 2·n_layer·n_ctx·d_attn;
  and graphflop's forward matrix FLOPs per token split into the terms that differ
  (2N, the LM head 2·d·V, attention 2·n_layer·n_ctx·(d_qk + d_v)·heads at full length);
* analysis seconds (load + analysis) and the child's peak RSS; status and completeness.

    python tools/presets.py                     # every preset (about 15 minutes on 2 cores)
    python tools/presets.py --only gpt2-small   # some of them (the others kept from --json)
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools._child import run_json_child  # noqa: E402

#: tokens of the analysis, where the model allows as many
SEQ = 4096
BEGIN = "<!-- presets: written by python tools/presets.py (do not edit by hand) -->"
END = "<!-- /presets -->"


def _positions(config) -> tuple[int | None, int]:
    """(the --seq to use or None for a model without token inputs, tokens processed)."""
    mt = config.model_type
    if mt == "vit":
        return None, (config.image_size // config.patch_size) ** 2 + 1
    if mt == "whisper":
        return config.max_target_positions, config.max_source_positions + (
            config.max_target_positions
        )
    limit = getattr(config, "max_position_embeddings", None)
    seq = min(SEQ, limit) if isinstance(limit, int) else SEQ
    return seq, 2 * seq if config.is_encoder_decoder else seq


def _decoder_only(model) -> bool:
    return type(model).__name__.endswith("ForCausalLM") or type(model).__name__.endswith(
        "LMHeadModel"
    )


def worker(name: str) -> dict:
    """Analyse preset ``name`` in this process; its row."""
    import warnings

    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    from torch import nn

    from graphflop.analysis import analyze
    from graphflop.load import load, make_inputs
    from graphflop.presets import active_parameters, find

    preset = find(name)
    assert preset is not None
    probe = load(f"hf:{name}", meta=True, seq=1).model
    seq, tokens = _positions(probe.config)
    loaded = load(f"hf:{name}", meta=True, seq=seq)
    model, config = loaded.model.train(), loaded.model.config
    inputs = make_inputs(loaded)
    a = analyze(model, inputs, name=f"hf:{name}")
    r = a.report
    t = r.totals
    total = sum(p.numel() for p in model.parameters())
    active = active_parameters(model, config)
    row: dict = {
        "seconds": round(time.perf_counter() - t0, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "seq": seq,
        "tokens": tokens,
        "inputs": [list(i.shape) for i in r.inputs],
        "params": total,
        "active": active,
        "fwd": t.forward.flops + t.loss.flops,
        "fwd_mm": t.forward.mm_flops + t.loss.mm_flops,
        "bwd": t.backward.flops if t.backward else None,
        "update": t.update.flops if t.update else None,
        "jvp": t.jvp.flops if t.jvp else None,
        "train_peak_bytes": r.memory.train_peak_bytes,
        "jvp_peak_bytes": r.memory.jvp_peak_bytes,
        "complete": all(
            x.complete for x in (t.forward, t.loss, t.backward, t.update, t.jvp) if x is not None
        ),
        "uncounted": [u.op for u in r.uncounted],
        "loss": r.loss,
    }
    if _decoder_only(model):
        embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
        head = model.get_output_embeddings()
        tied = head is not None and head.weight is model.get_input_embeddings().weight
        untied_head = head.weight.numel() if head is not None and not tied else 0
        heads = config.num_attention_heads
        d_qk = getattr(config, "qk_head_dim", None) or getattr(config, "head_dim", None)
        d_qk = d_qk or config.hidden_size // heads
        d_v = getattr(config, "v_head_dim", None) or d_qk
        layers = config.num_hidden_layers
        n = active - embeddings - untied_head  # Kaplan et al.'s non-embedding N (active)
        row.update(
            n_nonemb_active=n,
            # norm weights and biases: in N, but no product multiplies them
            vector_params=sum(q.numel() for q in model.parameters() if q.dim() <= 1),
            d_attn=heads * d_qk,
            kaplan_fwd=2 * n + 2 * layers * seq * heads * d_qk,
            head_mm=2 * config.hidden_size * config.vocab_size,
            attention_mm=2 * layers * seq * heads * (d_qk + d_v),
        )
    return row


def run_one(name: str, timeout: float) -> dict:
    """Run :func:`worker` for preset ``name`` in a child process; its row with ``status``."""
    row = run_json_child(__file__, name, timeout)
    if "complete" in row:
        row["status"] = "ok" if row["complete"] else "incomplete: " + ", ".join(row["uncounted"])
    return row


def _b(x: float) -> str:
    return f"{x / 1e9:,.3f}"


def markdown(rows: dict[str, dict]) -> str:
    from graphflop.presets import PRESETS

    ok = [p for p in PRESETS if rows.get(p.name, {}).get("status") == "ok"]
    out = [
        BEGIN,
        "## Published presets",
        "",
        "Each preset (`graphflop models`, `graphflop inspect hf:NAME`) built from its bundled "
        "configuration on the meta device and analysed in full: forward, loss, backward, SGD "
        "update, JVP (parameter tangents) and memory (eager model), at batch 1 × 4,096 tokens or "
        "the model's own length where it is shorter (GPT-2 1,024, BERT 512, Whisper 3,000 mel "
        "frames and 448 decoder tokens, ViT-B/16 one 224×224 image: 197 patches). Parameters "
        "exact (the published figure, as its source rounds it, in brackets); per-token FLOPs in "
        "GFLOPs over the tokens processed (encoder and decoder for T5 and Whisper); seconds: "
        "load + analysis in a child process; RSS: its peak.",
        "",
        f"**{len(ok)} of {len(PRESETS)} analysed in full.**",
        "",
        "| preset | tokens | params | active | fwd/token | train/token | train/fwd | peak train "
        "memory GiB | s | RSS MB | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in PRESETS:
        r = rows.get(p.name)
        if r is None:
            out.append(f"| {p.name} | | | | | | | | | | not run |")
            continue
        if "params" not in r:
            out.append(f"| {p.name} | | | | | | | | {r.get('seconds', '')} | | {r['status']} |")
            continue
        t = r["tokens"]
        train = r["fwd"] + (r["bwd"] or 0) + (r["update"] or 0)
        active = f"{r['active']:,} ({p.active})" if p.active else "="
        out.append(
            f"| {p.name} | {t:,} | {r['params']:,} ({p.params}) | {active} | {_b(r['fwd'] / t)} "
            f"| {_b(train / t)} | {train / r['fwd']:.2f} | {r['train_peak_bytes'] / 2**30:,.1f} "
            f"| {r['seconds']} | {r['peak_rss_mb']} | {r['status']} |"
        )
    out += [
        "",
        "### Beside the scaling-law estimates (decoder-only language models)",
        "",
        "N: the active non-embedding parameters (Kaplan et al. 2020: every parameter but the "
        "token and position embeddings; an untied LM head is an embedding too, whose product "
        "they count apart). Their forward estimate is C_forward = 2N + 2·n_layer·n_ctx·d_attn "
        "per token (d_attn = heads × query head width), the training estimate 6N. graphflop's "
        "forward matrix FLOPs per token are, term by term: 2(N − v), each weight matrix "
        "multiplying and adding once per token (v: the norm weights and biases N counts but no "
        "product multiplies; for MoE models N holds the routed experts a token runs, k of E, "
        "and the router); + the LM head 2·d·V; + attention's two products QKᵀ and AV at full "
        "length, 2·n_layer·n_ctx·heads·(d_qk + d_v) (Kaplan counts one, 2·n_layer·n_ctx·d_attn; a "
        "causal mask makes half the scores useless, but the math kernel computes and graphflop "
        "counts every one). 'rest' is what the three terms leave of graphflop's matrix FLOPs "
        "(0: they are the whole of it). The elementwise FLOPs (norms, activations, softmax, "
        "rotary embedding, residual adds, the loss) come on top: fwd − fwd mm. The token "
        "embedding is a lookup, 0 FLOPs in both counts. Kaplan's formula describes decoder-only "
        "language models; the encoder (BERT, ViT), encoder-decoder (T5, Whisper) presets have "
        "their FLOPs per token in the table above only. GFLOPs per token:",
        "",
        "| preset | n_ctx | N (active, non-emb.) | 2N | Kaplan C_fwd | graphflop fwd mm | "
        "= 2(N − v) | + head 2dV | + attention | rest (FLOPs) | + elementwise | = fwd | 6N | "
        "graphflop train |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in PRESETS:
        r = rows.get(p.name, {})
        if "kaplan_fwd" not in r:
            continue
        t, n = r["tokens"], r["n_nonemb_active"]
        weights = 2 * (n - r["vector_params"])
        rest = r["fwd_mm"] - t * (weights + r["head_mm"] + r["attention_mm"])
        train = r["fwd"] + (r["bwd"] or 0) + (r["update"] or 0)
        out.append(
            f"| {p.name} | {r['seq']:,} | {n:,} | {_b(2 * n)} | {_b(r['kaplan_fwd'])} "
            f"| {_b(r['fwd_mm'] / t)} | {_b(weights)} | {_b(r['head_mm'])} "
            f"| {_b(r['attention_mm'])} | {rest / t:,.0f} | {_b((r['fwd'] - r['fwd_mm']) / t)} "
            f"| {_b(r['fwd'] / t)} | {_b(6 * n)} | {_b(train / t)} |"
        )
    out += [
        "",
        "The training step per token is forward + backward (about 2× the forward's matrix "
        "FLOPs: the input and the weight gradients) + the SGD update (2 FLOPs per parameter, "
        "per step, not per token: at 4,096 tokens a small share): above 6N by the same head, "
        "attention and elementwise terms, times about 3.",
        "",
        END,
        "",
    ]
    return "\n".join(out)


def write_section(path: Path, section: str) -> None:
    """Replace the presets section of ``path`` (between :data:`BEGIN` and :data:`END`), or
    append it."""
    from graphflop.io import atomic_write

    text = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    atomic_write(path, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="preset names to run (default: all)")
    p.add_argument("--json", default=str(ROOT / "docs" / "presets.json"))
    p.add_argument("--out", default=str(ROOT / "docs" / "zoo.md"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per preset")
    p.add_argument("--render", action="store_true", help="rewrite --out from --json only")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    from graphflop.io import atomic_write
    from graphflop.presets import PRESETS

    unknown = sorted(set(args.only or ()) - {x.name for x in PRESETS})
    if unknown:
        p.error(
            f"unknown presets {', '.join(unknown)}; known: {', '.join(x.name for x in PRESETS)}"
        )
    path = Path(args.json)
    rows: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}
    todo = [] if args.render else [x.name for x in PRESETS if not args.only or x.name in args.only]
    for i, name in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {name} ...", end=" ", flush=True)
        rows[name] = run_one(name, args.timeout)
        print(rows[name]["status"], f"{rows[name].get('seconds', '')} s", flush=True)
        atomic_write(path, json.dumps(rows, indent=1) + "\n")
        write_section(Path(args.out), markdown(rows))
    write_section(Path(args.out), markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
