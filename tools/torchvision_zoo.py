"""Analyse torchvision classifiers one after another: does each trace and build every graph, how
long does it take, and what are its forward FLOPs and backward/forward ratio.

A smoke test of op coverage and tracing on real architectures (not part of the test suite: it
takes a minute and needs torchvision). Models are built on the meta device; nothing is
allocated.

    python tools/torchvision_zoo.py [--batch 2] [--eval] [NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

DEFAULT = [
    "resnet18",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "regnet_y_400mf",
    "convnext_tiny",
    "vit_b_16",
    "swin_t",
    "maxvit_t",
    "inception_v3",
    "densenet121",
    "squeezenet1_0",
    "shufflenet_v2_x0_5",
    "mnasnet0_5",
    "googlenet",
    "alexnet",
    "vgg11",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", default=DEFAULT, help="torchvision.models builders")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--eval", action="store_true", help="analyse in eval mode (default: train)")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    from graphflop.analysis import analyze
    from graphflop.load import load, make_inputs

    failed = 0
    print(
        "| model | analysis s | forward FLOPs | (backward+update)/forward |\n|---|---:|---:|---:|"
    )
    for name in args.names:
        t = time.perf_counter()
        try:
            loaded = load(f"torchvision:{name}", meta=True)
            loaded.model.train(not args.eval)
            a = analyze(loaded.model, make_inputs(loaded, batch=args.batch), name=name)
        except Exception as e:  # report and go on: this is a survey
            failed += 1
            print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:160]} | | |")
            continue
        r = a.report
        print(
            f"| {name} | {time.perf_counter() - t:.1f} | {r.totals.forward.flops:,} "
            f"| {r.ratios.backward_forward:.3f} |",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
