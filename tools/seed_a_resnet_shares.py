"""Where ResNet's backward/forward ratio falls short of 2: the share of the forward FLOPs in the
stem convolution (1:1, its input is data) and in batch norm, ReLU and the loss (a little over
2:1), counted per layer by graphflop at batch 1 on the meta device.

Usage: python tools/seed_a_resnet_shares.py [--out docs/seed-a]

Writes ``resnet_shares.csv``, adds the rows to ``results.json`` (key ``resnet_shares``) and
rewrites ``README.md`` from ``results.json`` (:func:`reproduce_seed_a._report`), so the seed A
README cites them. Layers are graphflop's per-layer rows: ``conv1`` is the stem; batch norm,
ReLU and the loss are the rows named ``*bn<k>``, ``*relu``, ``*downsample.1`` and ``loss``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reproduce_seed_a import ROOT, _analysis, _report, _write_csv  # noqa: E402

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
_SMALL = re.compile(r"(^|\.)(bn\d|relu|downsample\.1)$")


def shares(arch: str) -> dict:
    """One row: forward FLOPs, the stem's and batch norm/ReLU/loss's, with their shares and
    the latter's backward FLOPs."""
    r = _analysis(f"resnet.py:{arch}", 1)
    rows = r.layer_dicts()
    fwd = r.totals.forward.flops
    stem = sum(x["forward_flops"] for x in rows if x["name"] == "conv1")
    small = [x for x in rows if _SMALL.search(x["name"]) or x["name"] == "loss"]
    sf = sum(x["forward_flops"] for x in small)
    sb = sum(x["backward_flops"] for x in small)
    return {
        "arch": arch,
        "batch": 1,
        "forward_flops": fwd,
        "stem_forward_flops": stem,
        "stem_share": stem / fwd,
        "bn_relu_loss_forward_flops": sf,
        "bn_relu_loss_share": sf / fwd,
        "bn_relu_loss_backward_flops": sb,
        "bn_relu_loss_ratio": sb / sf,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "seed-a"))
    out = Path(ap.parse_args().out)
    rows = [shares(a) for a in ARCHS]
    _write_csv(out / "resnet_shares.csv", rows)
    path = out / "results.json"
    results = json.loads(path.read_text())
    results["resnet_shares"] = rows
    path.write_text(json.dumps(results, indent=1))
    (out / "README.md").write_text(_report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
