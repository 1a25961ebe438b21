"""``graphflop plan`` against torch's own engines (:mod:`graphflop.runtime.parallel_probe`,
torchrun, gloo, 2 ranks, the last of 3 steps): the predicted collectives equal the logged ones
as a multiset (kind, group size, elements, dtype, phase), the predicted matrix-product FLOPs
equal FlopCounterMode's count of each rank's local ops, the predicted peak is within 2 % of the
profiler's allocator peak.

The model is models/llama.py at a tiny size (vocabulary 128, width 64, 4 blocks, 4 query and 2
key/value heads of 16, SwiGLU width 128), global batch 4 × 16 tokens, AdamW: each of the 2
data-parallel ranks trains on 2 × 16 tokens, each tensor-parallel rank on all 4 × 16, the
micro-batch graphflop analyses. The peak is the eager schedule's with each storage at its
local size, TP redistributions' new tensors, and under ZeRO-2/3 FSDP's gathered parameters,
flat gradients and reduce-scatter buffers at the points its engine makes and frees them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from graphflop.analysis import analyze
from graphflop.load import load, make_inputs
from graphflop.parallel import Plan, predict
from graphflop.runtime.parallel_probe import run_probe

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "models" / "llama.py")
TINY = dict(vocab=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128)
B, T = 4, 16

pytestmark = pytest.mark.slow

# mode -> (plan, the rows each rank trains on: data-parallel ranks split the batch, tensor-
# parallel ranks each take all of it)
_PLANS = {
    "ddp": (dict(dp=2), B // 2),
    "zero1": (dict(dp=2, zero=1), B // 2),
    "zero2": (dict(dp=2, zero=2), B // 2),
    "zero3": (dict(dp=2, zero=3), B // 2),
    "tp": (dict(tp=2), B),
    "tp_sp": (dict(tp=2, sp=True), B),
}
_ANALYSES: dict[int, tuple] = {}


def _analysis(rows: int):
    if rows not in _ANALYSES:
        loaded = load(LLAMA, ctor_kwargs=TINY, meta=True)
        a = analyze(
            loaded.model, make_inputs(loaded, shapes=[(rows, T)]), optimizer="adamw", jvp=False
        )
        _ANALYSES[rows] = (loaded.model, a)
    return _ANALYSES[rows]


def _logged(mode: str) -> list[dict]:
    args = [f"{k}={v}" for k, v in TINY.items()]
    return run_probe(LLAMA, mode, 2, args=args, batch=B, seq=T, micro_batches=2)


@pytest.mark.parametrize("mode", list(_PLANS))
def test_plan_equals_engine(mode):
    kw, rows = _PLANS[mode]
    model, a = _analysis(rows)
    rank = predict(a, model, Plan(**kw), micro_batch=rows).ranks[0]
    predicted = Counter(c.key() for c in rank.collectives)
    for rec in _logged(mode):
        logged = Counter(
            (c["kind"], c["group_size"], c["elements"], c["dtype"], c["phase"])
            for c in rec["collectives"]
        )
        assert predicted == logged, (rec["rank"], predicted, logged)
        # FlopCounterMode counts matrix products (and the fused attention kernel by its SDPA
        # formulas, whose backward recomputes the scores): graphflop's mm FLOPs, exactly
        assert rank.mm_flops["total"] == rec["flops"], rec["flops_by_op"]
        peak = rank.memory_bytes["peak"]
        assert abs(peak - rec["peak_bytes"]) <= 0.02 * rec["peak_bytes"], (
            peak,
            rec["peak_bytes"],
            rec["live_by_kind"],
        )
