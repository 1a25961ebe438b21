"""Regenerate the Graphviz pictures in ``docs/renders/`` with :func:`graphflop.export.graphviz.render`.

Usage: python tools/render_docs.py [--out docs/renders]

Writes (every model analysed on the meta device, batch from its ``example_inputs()``):

* ``linearnet_train.svg/.png``, ``onenet_train.svg/.png``, ``convnet_train.svg/.png`` — seed A's
  networks, forward + backward + SGD update at op level;
* ``mlp_jvp.svg/.png`` — seed B's MLP (batch 64), the JVP graph with tangents on the parameters;
* ``resnet50_train_module.png`` (and ``.svg``) — ResNet-50 at module level, one box per module.

``docs/renders/README.md`` says what to look at in each; it is written by hand, not here.
Needs Graphviz's ``dot``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphflop.analysis import analyze  # noqa: E402
from graphflop.export.graphviz import render  # noqa: E402
from graphflop.load import load, make_inputs  # noqa: E402

#: (output stem, model spec under models/, graph, level, formats)
PICTURES = (
    ("linearnet_train", "linearnet.py", "train", "op", (".svg", ".png")),
    ("onenet_train", "onenet.py", "train", "op", (".svg", ".png")),
    ("convnet_train", "convnet.py", "train", "op", (".svg", ".png")),
    ("mlp_jvp", "mlp.py", "jvp", "op", (".svg", ".png")),
    ("resnet50_train_module", "resnet.py:resnet50", "train", "module", (".svg", ".png")),
)
MAX_BYTES = 1 << 20


def _analysis(spec: str):
    loaded = load(str(ROOT / "models" / spec), meta=True)
    loaded.model.train()
    return analyze(loaded.model, make_inputs(loaded), name=spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "renders"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    too_big = []
    for stem, spec, graph, level, formats in PICTURES:
        t0 = time.perf_counter()
        a = _analysis(spec)
        t1 = time.perf_counter()
        for suffix in formats:
            path = out / f"{stem}{suffix}"
            render(a, path, graph=graph, level=level)
            size = path.stat().st_size
            if size > MAX_BYTES:
                too_big.append(path.name)
            print(
                f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: "
                f"{size / 1024:.0f} KiB (analysis {t1 - t0:.1f} s, "
                f"total {time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
    if too_big:
        print(f"over 1 MiB: {', '.join(too_big)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
