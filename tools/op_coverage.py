"""Op coverage report: every op in graphflop's rule table, its rules, and the checks it passes.

Runs every case of the op database (``graphflop/testing/opdb/``) through the generic checks of
``graphflop/testing/checks.py`` (the same functions ``tests/test_ops.py`` runs: forward FLOPs
against the hand-worked count and FlopCounterMode, JVP against ``torch.func.jvp`` and finite
differences, VJP against ``torch.func.grad``, the dot-product test) and, unless ``--no-onnx``, the
ONNX round trip (the backward graph on ONNX Runtime against PyTorch). An op's check
passes when every case whose graphs hold the op passes it; a check a case documents as a known
gap (a strict xfail) is shown as such.

Writes ``docs/op_coverage.md``:

    python tools/op_coverage.py [--no-onnx] [--out docs/op_coverage.md]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

from graphflop.testing import checks as C
from graphflop.testing.opdb import OP_DB

ROOT = Path(__file__).resolve().parents[1]

CHECKS = ("flops", "jvp", "fd", "vjp", "dot", "onnx")
TITLES = {
    "flops": "FLOPs",
    "jvp": "JVP vs torch.func",
    "fd": "JVP vs finite differences",
    "vjp": "VJP vs torch.func",
    "dot": "dot-product test",
    "onnx": "ONNX round trip of the backward graph (counted for the ops that graph holds)",
}


def _outcome(fn, *args) -> str:
    try:
        fn(*args)
        return "pass"
    except Exception as e:  # noqa: BLE001  (any failure is a failed check)
        return f"fail: {type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"


def _ops_by_role(name: str) -> dict[str, set]:
    """The ops of a case's graphs: all of them (cost), the forward's (JVP rules run), the
    linearized graph's tangent nodes (transpose rules run); a case that does not build: its
    forward ops only."""
    ops: dict[str, set] = {"cost": set(), "jvp": set(), "transpose": set(), "backward": set()}
    try:
        ops["cost"] = C.graph_ops(*C.all_graphs(name))
        ops["backward"] = C.graph_ops(C.vjp_graph(name))  # what the onnx check exports
        ops["jvp"] = C.graph_ops(C.traced(name).fwd)
        ops["transpose"] = C.tangent_ops(name)
    except Exception:  # noqa: BLE001  (a case that does not build: its forward ops only)
        try:
            ops["cost"] = C.graph_ops(C.traced(name).fwd)
        except Exception:  # noqa: BLE001
            pass
    return ops


def run_cases(onnx: bool) -> tuple[dict, dict, dict]:
    """Per case: {check: outcome}; per case: ops by role (cost / jvp / transpose); per case:
    {check: documented reason for failing, or None}."""
    names = CHECKS if onnx else CHECKS[:-1]
    results: dict[str, dict[str, str]] = {}
    used: dict[str, dict[str, set]] = {}
    expected: dict[str, dict[str, str | None]] = {}
    for case in OP_DB:
        results[case.name] = {k: _outcome(C.CHECKS[k], case.name) for k in names}
        expected[case.name] = {k: C.expected_failure(case, k) for k in CHECKS}
        used[case.name] = _ops_by_role(case.name)
    return results, used, expected


def _cell(outcomes: list[tuple[str, str | None]]) -> str:
    if not outcomes:
        return "–"
    fails = [o for o, xf in outcomes if o != "pass" and not xf]
    xfails = [o for o, xf in outcomes if o != "pass" and xf]
    passes = sum(1 for o, _ in outcomes if o == "pass")
    if fails:
        return f"**FAIL** ({len(fails)}/{len(outcomes)})"
    if xfails:
        return f"pass {passes}/{len(outcomes)}, known gap {len(xfails)}"
    return f"pass ({passes})"


def render(results, used, expected, seconds: float, onnx: bool) -> str:
    from graphflop.ops import all_rules, op_name

    rules = {op_name(op): r for op, r in all_rules().items()}
    cases_of: dict[str, list[str]] = defaultdict(list)
    in_backward: dict[str, list[str]] = defaultdict(list)  # the onnx check exports only these
    for case, ops in used.items():
        for o in ops["cost"]:
            cases_of[o].append(case)
        for o in ops.get("backward", ()):
            in_backward[o].append(case)
    checks = CHECKS if onnx else CHECKS[:-1]
    lines = [
        "# Op coverage",
        "",
        "Written by `tools/op_coverage.py`. Every ATen op overload in graphflop's rule table "
        "(`graphflop/ops/`), its rules, and the op-database checks (`graphflop/testing/opdb/`) passed by "
        "the cases whose graphs (forward, JVP, backward, linearized) hold it. A cell counts the "
        "cases that ran the check; *known gap* is a check a case documents as failing (a "
        "strict xfail, with its reason in `graphflop/testing/opdb/`); – means no case holds the op.",
        "",
        "Checks: " + "; ".join(f"**{c}**: {TITLES[c]}" for c in checks) + ". "
        "FLOPs compares the forward count with the hand-worked value and the matrix FLOPs with "
        "FlopCounterMode. JVP rules run when their op is in a forward graph, transpose rules "
        "when their op is a tangent node of a linearized graph.",
        "",
        f"{len(rules)} ops with rules, {len(results)} op-database cases; checks took "
        f"{seconds:.0f} s.",
        "",
    ]
    by_family: dict[str, list[str]] = defaultdict(list)
    for name, r in rules.items():
        by_family[r.family].append(name)
    for family in sorted(by_family):
        lines += [
            f"## {family}",
            "",
            "| op | bytes | JVP | transpose | cases | " + " | ".join(checks) + " |",
            "|---|---|---|---|---:|" + "---|" * len(checks),
        ]
        for name in sorted(by_family[family]):
            r = rules[name]
            jvp = "zero" if r.zero_derivative else ("yes" if r.jvp else "–")
            tr = "yes" if r.transpose else "–"
            cs = cases_of.get(name, [])
            cells = [
                _cell(
                    [
                        (results[c][k], expected[c].get(k))
                        for c in (in_backward.get(name, []) if k == "onnx" else cs)
                        if k in results[c]
                    ]
                )
                for k in checks
            ]
            lines.append(
                f"| `{name}` | {r.bytes} | {jvp} | {tr} | {len(cs)} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    failing = [
        (c, k, o)
        for c, res in results.items()
        for k, o in res.items()
        if o != "pass" and not expected[c].get(k)
    ]
    lines += ["## Failing checks", ""]
    lines += [f"- `{c}` {k}: {o}" for c, k, o in failing] or ["None."]
    gaps = [
        (c, k, expected[c][k])
        for c, res in results.items()
        for k, o in res.items()
        if expected[c].get(k)
    ]
    lines += ["", "## Known gaps (strict xfails in the op database)", ""]
    lines += [f"- `{c}` {k}: {why}" for c, k, why in gaps] or ["None."]
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "op_coverage.md"))
    p.add_argument("--no-onnx", action="store_true", help="skip the ONNX round trips (faster)")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    t = time.perf_counter()
    results, used, expected = run_cases(not args.no_onnx)
    text = render(results, used, expected, time.perf_counter() - t, not args.no_onnx)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
