"""Regenerate the Graphviz pictures in ``docs/renders/`` with :func:`graphflop.export.graphviz.render`.

Usage: python tools/render_docs.py [--out docs/renders]

Writes (every model analysed on the meta device, batch from its ``example_inputs()``):

* ``linearnet_train.svg/.png``, ``onenet_train.svg/.png``, ``convnet_train.svg/.png`` — seed A's
  networks, forward + backward + SGD update at op level;
* ``mlp_jvp.svg/.png`` — seed B's MLP (batch 64), the JVP graph with tangents on the parameters;
* ``resnet50_train_module.png`` (and ``.svg``) — ResNet-50 at module level, one box per module,
  identical bottleneck blocks drawn once;
* ``gpt2_small_train_module.png/.svg/.html`` — GPT-2 small (token ids 1×128) at module level, its
  12 blocks drawn once as "×12"; ``vit_b_16_train_module.png/.svg`` — ViT-B/16 likewise;
* ``gpt2_h0_train_op.svg`` and ``gpt2_h0_forward_op.svg/.png`` — GPT-2 small's first block
  (``h.0``) alone at op level (its train PNG would be over 1 MiB);
* ``gpt2_small_html_screenshot.png`` — the HTML page in headless Chromium 1,200 px wide,
  searching "h.5", a block drawn as the "× 12" fold (only when ``chromium`` is installed).

``docs/renders/README.md`` says what to look at in each; it is written by hand, not here.
Needs Graphviz's ``dot``.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphflop.analysis import analyze  # noqa: E402
from graphflop.export.graphviz import render  # noqa: E402
from graphflop.load import load, make_inputs  # noqa: E402

GPT2 = "gpt2.py:gpt2_small"
#: (output stem, model spec under models/, graph, level, formats, module)
PICTURES = (
    ("linearnet_train", "linearnet.py", "train", "op", (".svg", ".png"), None),
    ("onenet_train", "onenet.py", "train", "op", (".svg", ".png"), None),
    ("convnet_train", "convnet.py", "train", "op", (".svg", ".png"), None),
    ("mlp_jvp", "mlp.py", "jvp", "op", (".svg", ".png"), None),
    ("resnet50_train_module", "resnet.py:resnet50", "train", "module", (".svg", ".png"), None),
    ("gpt2_small_train_module", GPT2, "train", "module", (".svg", ".png", ".html"), None),
    ("vit_b_16_train_module", "vit.py:vit_b_16", "train", "module", (".svg", ".png"), None),
    ("gpt2_h0_train_op", GPT2, "train", "op", (".svg",), "h.0"),
    ("gpt2_h0_forward_op", GPT2, "forward", "op", (".svg", ".png"), "h.0"),
)
MAX_BYTES = 1 << 20
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


@functools.lru_cache(maxsize=2)
def _analysis(spec: str):
    loaded = load(str(ROOT / "models" / spec), meta=True)
    loaded.model.train()
    # GPT-2: token ids (1, 128), as in the README's example
    kw = {"shapes": [(1, 128)], "dtype": torch.int64} if spec == GPT2 else {}
    return analyze(loaded.model, make_inputs(loaded, **kw), name=spec)


def screenshot(page: Path, out: Path, query: str = "h.5") -> bool:
    """A headless Chromium screenshot of the HTML ``page`` searching ``query``; False when
    ``chromium`` is not installed."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        return False
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={out}",
             "--window-size=1200,1000", f"{page.resolve().as_uri()}#q={query}"],
            capture_output=True, timeout=120, check=True,
        )  # fmt: skip
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "renders"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    too_big = []
    for stem, spec, graph, level, formats, module in PICTURES:
        t0 = time.perf_counter()
        a = _analysis(spec)
        t1 = time.perf_counter()
        for suffix in formats:
            path = out / f"{stem}{suffix}"
            render(a, path, graph=graph, level=level, module=module)
            size = path.stat().st_size
            if size > MAX_BYTES:
                too_big.append(path.name)
            print(
                f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: "
                f"{size / 1024:.0f} KiB (analysis {t1 - t0:.1f} s, "
                f"total {time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
    shot = out / "gpt2_small_html_screenshot.png"
    if screenshot(out / "gpt2_small_train_module.html", shot):
        print(f"{shot.name}: {shot.stat().st_size / 1024:.0f} KiB", flush=True)
    if too_big:
        print(f"over 1 MiB: {', '.join(too_big)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
