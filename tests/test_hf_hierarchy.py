"""transformers models built in Python from a config keep their hierarchy (each decoder layer
traced once): their configurations ask for a KV cache by default (``use_cache=True``), which
the trace turns off when the call does not ask for it, and says so in the report
(:mod:`graphflop.frontend.libraries`). The reference for every figure is the same model with
``config.use_cache=False`` analysed flat (no outlining)."""

from __future__ import annotations

import pytest
import torch

from graphflop.analysis import analyze
from graphflop.export.report import warning_lines
from graphflop.frontend import outline
from graphflop.meta import HIERARCHY, OUTLINED, OutlineInfo

pytest.importorskip("transformers")

LAYERS = 2
# hidden 16 over 2 heads: head size 8; 1 key/value head
TINY_LLAMA = dict(
    vocab_size=50,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=1,
)
BATCH, SEQ = 2, 8


def _llama(use_cache: bool | None = None):
    from graphflop.load import _preload_torchvision

    _preload_torchvision()  # transformers imports torchvision (graphflop.load's note)
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    if use_cache is not None:
        model.config.use_cache = use_cache
    return model.train()


def _ids():
    return torch.zeros(BATCH, SEQ, dtype=torch.long)


def _flat(model, example):
    """``model`` analysed with no block outlined (every layer traced in full)."""
    plan = outline.plan
    try:
        outline.plan = lambda *a, **k: {}
        return analyze(model, example)
    finally:
        outline.plan = plan


def _cache_lines(report):
    return [a for a in report.assumptions if a.startswith("traced without the KV cache")]


def test_default_cache_gets_the_hierarchy_and_the_flat_figures_without_cache():
    model = _llama()
    assert model.config.use_cache is True  # transformers' default
    hier = analyze(model, (_ids(),))
    assert model.config.use_cache is True  # restored
    assert hier.forward.meta[OUTLINED] == OutlineInfo(calls=LAYERS, traced_once=1)
    assert len(hier.forward.meta[HIERARCHY].sites) == LAYERS
    (line,) = _cache_lines(hier.report)
    assert "DynamicCache" in line and "use_cache=True" in line
    assert f"assumption: {line}" in warning_lines(hier.report)

    flat = _flat(_llama(use_cache=False), (_ids(),))
    assert HIERARCHY not in flat.forward.meta and not flat.report.assumptions
    got = hier.report.to_dict()
    assert got.pop("assumptions") == [line]
    # totals by role, per-module rows, per-op rows and every peak
    assert got == flat.report.to_dict()
    # the cache's class can be made again afterwards
    from transformers.cache_utils import DynamicCache

    assert DynamicCache() is not None


def test_explicit_use_cache_is_kept_and_counts_the_cache_copies():
    """``use_cache=True`` passed by the call: traced with the cache, as eager PyTorch runs it
    (each layer's keys and values copied into the cache: no hierarchy, no line)."""
    on = _flat(_llama(), ((_ids(),), {"use_cache": True}))
    again = analyze(_llama(), ((_ids(),), {"use_cache": True}))
    assert again.forward.meta[OUTLINED] == OutlineInfo(calls=0, traced_once=0)
    assert not _cache_lines(again.report)
    assert again.report.to_dict() == on.report.to_dict()
    off = _flat(_llama(use_cache=False), (_ids(),))
    t_on, t_off = on.report.totals, off.report.totals
    # torch.cat onto the empty cache: 0 FLOPs; it reads and writes the keys and the values,
    # each (B, kv heads, T, head size) = 2·1·8·8 float32 = 512 bytes, in each of 2 layers:
    # 2 layers · 2 tensors · 512 B · (read + write) = 4096 B more
    assert t_on.forward.flops == t_off.forward.flops
    assert t_on.train_step.flops == t_off.train_step.flops
    moved = lambda t: t.forward.bytes_read + t.forward.bytes_written  # noqa: E731
    assert moved(t_on) - moved(t_off) == LAYERS * 2 * (2 * 1 * SEQ * 8 * 4) * 2
    # the memory peaks are the same (measured against eager PyTorch in
    # graphflop.frontend.libraries.cache_assumption's note)
    assert on.report.memory == off.report.memory


def test_use_cache_false_passed_or_configured_gets_no_line():
    passed = analyze(_llama(), ((_ids(),), {"use_cache": False}))
    configured = analyze(_llama(use_cache=False), (_ids(),))
    for a in (passed, configured):
        assert a.forward.meta[OUTLINED] == OutlineInfo(calls=LAYERS, traced_once=1)
        assert not a.report.assumptions
