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
    # the layers get the cache object: traced in full, said
    why = (
        "LlamaDecoderLayer ×2 (model.layers.0, model.layers.1): called with a DynamicCache "
        "argument (not tensors, numbers, strings, and tuples, lists and dicts of them)"
    )
    assert again.forward.meta[OUTLINED] == OutlineInfo(0, 0, in_full=(why,))
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
    # Llama's attention runs fused (no dropout): it saves the keys and values either way, and
    # graphflop frees the cache's copies after their last use, so every memory figure is the
    # same (eager's no-grad forward and JVP peaks are not: cache_assumption's note)
    assert on.report.memory == off.report.memory


def test_use_cache_false_passed_or_configured_gets_no_line():
    passed = analyze(_llama(), ((_ids(),), {"use_cache": False}))
    configured = analyze(_llama(use_cache=False), (_ids(),))
    for a in (passed, configured):
        assert a.forward.meta[OUTLINED] == OutlineInfo(calls=LAYERS, traced_once=1)
        assert not a.report.assumptions


def _t5(use_cache: bool | None = None):
    from graphflop.load import _preload_torchvision

    _preload_torchvision()
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_ff=32, num_layers=3, num_heads=2, d_kv=8
    )
    model = transformers.T5ForConditionalGeneration(config)
    if use_cache is not None:  # the decoder holds a copy of the configuration
        for m in model.modules():
            if isinstance(vars(m).get("config"), transformers.PretrainedConfig):
                m.config.use_cache = use_cache
    return model.train()


@pytest.mark.slow  # (moved out of the default suite: its 300 s budget)
def test_t5_blocks_after_the_first_share_a_template_per_stack():
    """Block 0 of each stack computes the relative attention bias (a parameter of its own);
    blocks 1 and 2 are called with it and return it as given (a call's output that is its
    input itself: the caller's own tensor), so they are copies: one template per stack, and
    one each for the feed-forward and cross-attention layers of blocks 0 (7 calls)."""
    from test_hierarchy import _check

    ids = _ids()
    example = ((ids,), {"decoder_input_ids": ids})
    hier = analyze(_t5(), example)
    assert hier.forward.meta[OUTLINED] == OutlineInfo(calls=7, traced_once=4)
    h = _check(hier)
    # each call's module: a submodule's path less its path in the template
    called = {
        (s.template, path[: len(path) - len(rel) + 1]) for s in h.sites for rel, path in s.modules
    }
    assert len(called) == 7
    blocks = {t: sorted(p for u, p in called if u == t) for t, _ in called}
    assert sorted(blocks.values()) == [
        ["decoder.block.0.layer.1"],
        ["decoder.block.0.layer.2", "encoder.block.0.layer.1"],
        ["decoder.block.1", "decoder.block.2"],
        ["encoder.block.1", "encoder.block.2"],
    ]
    flat = _flat(_t5(use_cache=False), example)
    got = hier.report.to_dict()
    assert len(got.pop("assumptions")) == 1  # the decoder's own configuration asked for a cache
    assert got == flat.report.to_dict()


def _gpt2_cross_attention():
    """A one-layer GPT-2 with cross-attention, and an example with encoder states: it makes a
    DynamicCache, then wraps it in an EncoderDecoderCache in a later statement."""
    from graphflop.load import _preload_torchvision

    _preload_torchvision()
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=SEQ, add_cross_attention=True
    )
    model = transformers.GPT2LMHeadModel(config).train()
    return model, ((_ids(),), {"encoder_hidden_states": torch.randn(BATCH, 3, 16)})


@pytest.mark.parametrize("name", ["t5", "gpt2_cross_attention"])
def test_the_line_names_the_cache_the_model_makes(name):
    """A tester's finding: a T5 model's line said it would have made a DynamicCache, where it
    makes an EncoderDecoderCache (``EncoderDecoderCache(DynamicCache(…), DynamicCache(…))``:
    the two DynamicCache objects are made first); GPT-2 with cross-attention wraps its
    DynamicCache in one a statement later. The line names the class of the cache eager
    PyTorch returns, and the cache classes work as before afterwards."""
    if name == "t5":
        model, example = _t5(), ((_ids(),), {"decoder_input_ids": _ids()})
    else:
        model, example = _gpt2_cross_attention()
    args, kwargs = example
    with torch.no_grad():
        kind = type(model(*args, **kwargs).past_key_values).__name__
    assert kind == "EncoderDecoderCache"
    (line,) = _cache_lines(analyze(model, example).report)
    assert f"would have made one ({kind})" in line and "DynamicCache" not in line
    with torch.no_grad():
        again = model(*args, **kwargs).past_key_values
    assert type(again).__name__ == kind and again.get_seq_length() == SEQ


@pytest.mark.parametrize("how", ["kwarg", "config"])
def test_output_hidden_states_keeps_the_hierarchy_from_the_first_analysis(how):
    """transformers puts output-capturing hooks on the decoder layers (and their attention
    modules) at the first call that asks for hidden states: the layer's own hook runs at
    each call of the copy, the attention's does nothing (no attentions asked for). The
    hidden states the outlined graph returns are eager PyTorch's."""
    from graphflop.frontend.trace import trace
    from graphflop.meta import SIGNATURE

    def model_and_example():
        model = _llama(use_cache=False)
        if how == "config":
            model.config.output_hidden_states = True
            return model, (_ids(),)
        return model, ((_ids(),), {"output_hidden_states": True})

    model, example = model_and_example()
    hier = analyze(model, example)  # the model's first call: the hooks are put on inside
    assert hier.forward.meta[OUTLINED] == OutlineInfo(calls=LAYERS, traced_once=1)
    flat = _flat(*model_and_example())
    assert hier.report.to_dict() == flat.report.to_dict()

    model, example = model_and_example()
    args, kwargs = example if how == "kwarg" else (example, {})
    gm = trace(model, args, kwargs=kwargs, loss="none")
    assert gm.meta[OUTLINED] == OutlineInfo(calls=LAYERS, traced_once=1)
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    sig = gm.meta[SIGNATURE]
    values = [state[q] for _, q in sig.params] + [state[q] for _, q in sig.buffers]
    got = gm(*values, *args)
    with torch.no_grad():
        out = model(*args, **kwargs)
    want = [out.logits, *out.hidden_states]
    assert len(want) == 1 + LAYERS + 1 and len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = torch.nn.Linear(4, 4), torch.nn.Tanh()

    def forward(self, x, cache=None):
        y = self.act(self.fc(x))
        return y if cache is None else y + cache.get_seq_length()


class _CacheUser(torch.nn.Module):
    """Three blocks handed a transformers cache: made as the configuration says ("config"),
    whatever it says ("always"), or never ("never")."""

    def __init__(self, when: str):
        import transformers

        super().__init__()
        self.config = transformers.GPT2Config(n_layer=1)  # use_cache=True by default
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))
        self.when = when

    def forward(self, x):
        from transformers.cache_utils import DynamicCache

        made = self.when == "always" or (self.when == "config" and self.config.use_cache)
        cache = DynamicCache() if made else None
        for b in self.blocks:
            x = b(x, cache)
        return x


@pytest.mark.parametrize(
    # a block handed a cache (an object it could write into) is traced in full
    "when,calls,line",
    [("config", 3, True), ("always", 0, False), ("never", 3, False)],
)
def test_cache_off_only_where_a_cache_is_made_and_the_configuration_decides(when, calls, line):
    """A cache made as the configuration says is turned off (the line); one made whatever
    it says is traced as made (no line); a configuration asking for a cache the model never
    makes changes nothing (no line). The configuration is put back each time."""
    from graphflop.load import _preload_torchvision

    _preload_torchvision()
    model = _CacheUser(when)
    x = torch.randn(2, 4)
    a = analyze(model, (x,))
    assert model.config.use_cache is True
    assert bool(_cache_lines(a.report)) == line
    assert a.forward.meta[OUTLINED].calls == calls


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_keeps_the_flat_figures(reentrant):
    """``gradient_checkpointing_enable()`` runs each decoder layer under
    ``torch.utils.checkpoint`` (inside the layer's ``__call__``, so inside its template).
    Non-reentrant (transformers' default): still one traced layer, its JVP and transpose (with
    the recompute) built once and copied at the other layer (they were built call by call).
    Reentrant: whether the checkpoint's outputs carry a derivative is each call's own (its
    inputs': eager detaches them where none requires grad), so the layer is not traced once
    (its attention and MLP are). Either way the report is the flat one's, recompute included."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_hierarchy import _check, _expanded_calls

    model = _llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    a = analyze(model, _ids())
    _check(a)
    if reentrant:
        why = "LlamaDecoderLayer ×2 (model.layers.0, model.layers.1): a reentrant checkpoint inside"
        assert a.forward.meta[OUTLINED] == OutlineInfo(2 * LAYERS, 2, in_full=(why,))
    else:
        assert a.forward.meta[OUTLINED] == OutlineInfo(calls=LAYERS, traced_once=1)
        assert _expanded_calls(a).expanded == LAYERS - 1
    flat = _flat(model, _ids()).report
    assert a.report.totals == flat.totals and a.report.memory == flat.memory
    assert a.report.totals.backward.recompute_flops > 0
