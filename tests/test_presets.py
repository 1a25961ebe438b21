"""Published presets and Hub names (``hf:llama-3.1-8b``, ``hf:meta-llama/Llama-3.1-8B``): the
parameter counts against the published figures, the offline path (preset, cached
``config.json``) and the one-line refusal of a Hub name that cannot be read. No test here uses
the network: the Hub is put offline (``HF_HUB_OFFLINE``) or pointed at a closed port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphflop import presets
from graphflop.load import SpecError, load

ROOT = Path(__file__).resolve().parents[1]


def test_published_precision_reads_the_figure_as_written():
    assert presets.published_precision("8.03B") == (8_030_000_000, 10_000_000)
    assert presets.published_precision("405.9B") == (405_900_000_000, 100_000_000)
    assert presets.published_precision("124M") == (124_000_000, 1_000_000)
    # a trailing zero of an integer is not a significant digit: 110M is given to 10 M
    assert presets.published_precision("110M") == (110_000_000, 10_000_000)
    assert presets.published_precision("1.5B") == (1_500_000_000, 100_000_000)
    with pytest.raises(ValueError, match="not a parameter count"):
        presets.published_precision("8 billion")
    # 8,030,261,248 is 8.03 B to the nearest 10 M; 8.04B is not it
    assert presets.matches_published(8_030_261_248, "8.03B")
    assert not presets.matches_published(8_030_261_248, "8.04B")
    # a source that truncates: 7,615,616,512 is 7.61B down, 7.62B to the nearest
    assert presets.matches_published(7_615_616_512, "7.61B", "down")
    assert not presets.matches_published(7_615_616_512, "7.61B")


def test_preset_names_and_hub_names_find_the_same_preset():
    p = presets.find("llama-3.1-70b")
    assert p is not None and p.hub == "meta-llama/Llama-3.1-70B"
    assert presets.find("META-LLAMA/Llama-3.1-70B") is p  # any case
    assert presets.find("meta-llama/Meta-Llama-3.1-70B") is p  # the older Hub name
    assert presets.find("llama-3.1-7b") is None
    names = [p.name for p in presets.PRESETS]
    assert len(set(names)) == len(names) == 17


def _counts(name: str) -> tuple[int, int]:
    model = load(f"hf:{name}", meta=True, seq=1).model
    total = sum(t.numel() for t in model.parameters())
    return total, presets.active_parameters(model, model.config)


@pytest.mark.parametrize("name", [p.name for p in presets.PRESETS])
def test_preset_parameters_equal_the_published_figures(name):
    """Total (and, for mixture-of-experts models, active) parameters of the model built on
    the meta device, rounded as the source rounds, equal the published figure."""
    pytest.importorskip("transformers")
    p = presets.find(name)
    assert p is not None
    total, active = _counts(name)
    assert presets.matches_published(total, p.params, p.rounding), (total, p.params)
    if p.active is None:
        assert active == total  # a dense model runs every parameter
    else:
        assert active < total
        assert presets.matches_published(active, p.active, p.rounding), (active, p.active)


def test_exact_counts_of_three_presets():
    """Worked out from the configurations by hand.

    Llama-3.1-8B: embedding and head 2·128256·4096 = 1,050,673,152; per layer q and o
    2·4096², k and v 2·4096·1024, MLP 3·4096·14336, two norms 2·4096: 218,112,000; 32 layers
    and the final norm: 1,050,673,152 + 32·218,112,000 + 4096 = 8,030,261,248.

    Mixtral-8x7B: per layer attention 41,943,040, experts 8·3·4096·14336 = 1,409,286,144,
    router 8·4096, norms 8192; embedding and head 2·32000·4096 = 262,144,000; total
    262,144,000 + 32·1,451,270,144 + 4096 = 46,702,792,704. Each token runs 2 of 8 experts:
    active = total − 32·(6/8)·1,409,286,144 = 12,879,925,248.
    """
    pytest.importorskip("transformers")
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert _counts("llama-3.1-8b") == (2 * 128256 * 4096 + 32 * layer + 4096,) * 2
    experts = 8 * 3 * 4096 * 14336
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + experts + 8 * 4096 + 2 * 4096
    total = 2 * 32000 * 4096 + 32 * layer + 4096
    assert total == 46_702_792_704
    assert _counts("mixtral-8x7b") == (total, total - 32 * experts * 6 // 8)
    assert _counts("mixtral-8x7b")[1] == 12_879_925_248


def test_active_parameters_count_shared_experts_and_dense_layers():
    """A small DeepSeek-V3-shaped model: 2 layers, the first dense; the second 1 shared + 2
    of 4 routed experts of width 8 on a width of 8. The routed experts' stacked weights are
    4·(16·8 + 8·8) = 768 parameters (gate and up (4, 2·8, 8), down (4, 8, 8)): the token reads
    2/4 of them, and all of the shared expert, the router and the dense layer."""
    pytest.importorskip("transformers")
    small = dict(
        num_hidden_layers=2,
        first_k_dense_replace=1,
        hidden_size=8,
        intermediate_size=16,
        moe_intermediate_size=8,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=4,
        kv_lora_rank=4,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=4,
        vocab_size=10,
    )
    model = load("hf:deepseek_v3", ctor_kwargs=small, meta=True, seq=4).model
    (found,) = presets.routed_experts(model, model.config)
    assert found[0] == "model.layers.1.mlp.experts" and found[1:] == (768, 4, 2)
    total = sum(t.numel() for t in model.parameters())
    assert presets.active_parameters(model, model.config) == total - 768 // 2


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """huggingface_hub offline, with an empty cache in ``tmp_path``."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def _cache_config(cache: Path, repo: str, config: dict) -> None:
    """``config`` as ``repo``'s config.json in a huggingface_hub cache laid out as the client
    lays it out: models--ORG--NAME/{refs/main, snapshots/COMMIT/config.json}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))


def test_a_hub_name_resolves_from_the_cache_offline(offline_hub):
    pytest.importorskip("transformers")
    _cache_config(
        offline_hub,
        "someone/tiny-gpt2",
        {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 50},
    )
    loaded = load("hf:someone/tiny-gpt2", meta=True, seq=8)
    assert type(loaded.model).__name__ == "GPT2LMHeadModel"
    assert loaded.model.config.n_embd == 32 and loaded.model.config.n_layer == 1
    assert any("someone/tiny-gpt2 from the Hugging Face cache" in n for n in loaded.notes)
    # --arg still sets fields of a Hub configuration, and refuses one it does not have
    assert (
        load(
            "hf:someone/tiny-gpt2", ctor_kwargs={"n_layer": 2}, meta=True, seq=8
        ).model.config.n_layer
        == 2
    )
    with pytest.raises(SpecError, match="no field 'n_layers'"):
        load("hf:someone/tiny-gpt2", ctor_kwargs={"n_layers": 2}, meta=True, seq=8)


def test_a_preset_hub_name_falls_back_to_the_preset_offline(offline_hub):
    pytest.importorskip("transformers")
    small = {"num_hidden_layers": 1}
    loaded = load("hf:meta-llama/Llama-3.1-8B", ctor_kwargs=small, meta=True, seq=8)
    cfg = loaded.model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads) == (4096, 14336, 8)
    assert cfg.num_hidden_layers == 1 and cfg.vocab_size == 128256
    (note,) = [n for n in loaded.notes if "preset" in n]
    assert "preset llama-3.1-8b" in note and "HF_HUB_OFFLINE" in note
    # the preset's own name never asks the Hub
    assert (
        load("hf:Llama-3.1-8B", ctor_kwargs=small, meta=True, seq=8).model.config.hidden_size
        == 4096
    )


def test_inspect_json_records_the_preset_fallback(offline_hub, capsys):
    """The note that a Hub name fell back to a preset reaches the JSON (model_notes, the last
    key), not only standard error."""
    pytest.importorskip("transformers")
    from graphflop.cli import main

    argv = ["inspect", "hf:meta-llama/Llama-3.1-8B", "--arg", "num_hidden_layers=1"]
    assert main([*argv, "--seq", "8", "--format", "json", "--no-jvp", "--no-backward"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc)[-1] == "model_notes"
    (note,) = [n for n in doc["model_notes"] if "preset" in n]
    assert "preset llama-3.1-8b" in note and "HF_HUB_OFFLINE" in note


def test_a_preset_note_names_its_source_once_parenthesised():
    """GPT-2's source ends in a parenthesis of its own (the paper's table): the note read
    '...(Radford et al. 2019, Table 2))'."""
    pytest.importorskip("transformers")
    (note,) = load("hf:gpt2-small", ctor_kwargs={"n_layer": 1}, meta=True, seq=8).notes
    source = presets.find("gpt2-small").source
    assert note == f"configuration: graphflop's preset gpt2-small, from {source}"
    assert "))" not in note


def test_cli_models_footer_fits_count(capsys, monkeypatch):
    """The footer points at --count only when --count was not given (the counts themselves
    stubbed: building the 17 models is another test's)."""
    from graphflop.cli import main
    from graphflop.cli import models as models_cli

    stub = {"params_exact": 1, "active_exact": 1}
    monkeypatch.setattr(models_cli, "exact_counts", lambda name: stub)
    assert main(["models"]) == 0
    assert "--count gives the exact counts" in " ".join(capsys.readouterr().out.split())
    assert main(["models", "--count"]) == 0
    footer = " ".join(capsys.readouterr().out.split())
    assert "--count gives" not in footer and "exact active: the counts of the models" in footer


def test_a_hub_name_with_no_cache_and_no_preset_is_one_line(offline_hub):
    pytest.importorskip("transformers")
    with pytest.raises(SpecError) as e:
        load("hf:someone/not-cached@v2", meta=True)
    msg = str(e.value)
    assert "\n" not in msg and "not in the Hugging Face cache" in msg
    assert "hf:llama-3.1-8b" in msg and "hf:path/to/folder" in msg


def test_a_sequence_longer_than_the_positions_is_refused():
    pytest.importorskip("transformers")
    with pytest.raises(SpecError, match=r"longer than the model's 1024 positions \(n_positions\)"):
        load("hf:gpt2-small", ctor_kwargs={"n_layer": 1}, meta=True, seq=4096)
    loaded = load(
        "hf:gpt2-small", ctor_kwargs={"n_layer": 1, "n_positions": 4096}, meta=True, seq=4096
    )
    assert loaded.model.config.n_positions == 4096


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "graphflop.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
    )


def test_cli_hub_name_without_network_or_cache_is_one_line_exit_2(tmp_path):
    """The Hub's address is a closed local port (no network, HF_HUB_OFFLINE unset): the probe
    fails at once and the command says so in one line, with status 2 and no output file."""
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    r = _cli(
        "inspect",
        "hf:someone/no-such-model",
        "--json",
        str(out),
        HF_ENDPOINT="http://127.0.0.1:9",
        HF_HUB_CACHE=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="0",
    )
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "127.0.0.1 cannot be reached" in r.stderr and "graphflop models" in r.stderr
    assert not out.exists()


def test_cli_models_lists_every_preset():
    r = _cli("models", "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["name"] for row in rows] == [p.name for p in presets.PRESETS]
    mixtral = next(row for row in rows if row["name"] == "mixtral-8x7b")
    assert mixtral["hub"] == "mistralai/Mixtral-8x7B-v0.1"
    assert (mixtral["params"], mixtral["active"]) == ("46.7B", "12.9B")
    table = _cli("models")
    assert table.returncode == 0 and "llama-3.1-405b" in table.stdout


def test_inspect_reports_the_routing_of_a_mixture_of_experts(capsys):
    """Mixtral-8x7B cut to one layer at 64 tokens: every routed expert counted (transformers'
    default grouped path), the routing assumption and active parameters in the JSON.

    Forward matrix FLOPs per token: q and o 2·2·4096² = 67,108,864; k and v 2·2·4096·1024 =
    16,777,216; router 2·4096·8 = 65,536; 2 of 8 experts 2·2·3·4096·14336 = 704,643,072; head
    2·4096·32000 = 262,144,000; over 64 tokens, plus attention's QKᵀ and AV 2·2·64·64·4096 =
    67,108,864: 67,314,384,896. Active parameters: 1,713,418,240 less 6/8 of the experts'
    1,409,286,144 = 656,453,632."""
    pytest.importorskip("transformers")
    from graphflop.cli import main

    argv = ["inspect", "hf:mixtral-8x7b", "--arg", "num_hidden_layers=1", "--seq", "64"]
    assert main([*argv, "--format", "json", "--no-jvp"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    per_token = 67_108_864 + 16_777_216 + 65_536 + 704_643_072 + 262_144_000
    assert doc["totals"]["forward"]["mm_flops"] == 64 * per_token + 67_108_864
    assert doc["totals"]["forward"]["complete"] and doc["totals"]["backward"]["complete"]
    ex = doc["experts"]
    assert (ex["experts"], ex["top_k"], ex["routed_layers"], ex["tokens"]) == (8, 2, 1, 64)
    assert ex["tokens_per_expert"] == 16.0  # 64·2/8
    assert (ex["params"], ex["active_params"]) == (1_713_418_240, 656_453_632)
    assert "experts (1 routed layer, top 2 of 8): balanced" in captured.err
    assert "16.0 tokens per expert" in captured.err


def _mixtral_json(capsys, *extra: str) -> dict:
    from graphflop.cli import main

    argv = ["inspect", "hf:mixtral-8x7b", "--arg", "num_hidden_layers=1", "--seq", "64"]
    assert main([*argv, "--format", "json", "--no-jvp", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_routing_capacity_and_histogram(capsys, tmp_path):
    """--routing capacity:1.25: each of 8 experts computes ⌈1.25·128/8⌉ = 20 rows, 160 in
    all against the 128 token-expert rows: 32 more rows through gate/up (4096 → 28672) and
    down (14336 → 4096), 2·32·4096·43008 = 11,274,289,152 more forward matrix FLOPs, twice as
    many in the backward (the input's and the weights' cotangents). A measured histogram
    changes the reported split, not the FLOPs."""
    pytest.importorskip("transformers")
    base = _mixtral_json(capsys)
    cap = _mixtral_json(capsys, "--routing", "capacity:1.25")
    extra = 2 * 32 * 4096 * 43008
    assert extra == 11_274_289_152
    fwd = lambda d: d["totals"]["forward"]["mm_flops"]  # noqa: E731
    bwd = lambda d: d["totals"]["backward"]["mm_flops"]  # noqa: E731
    assert fwd(cap) - fwd(base) == extra and bwd(cap) - bwd(base) == 2 * extra
    assert (
        cap["experts"]["tokens_per_expert"] == 20.0
        and "capacity factor 1.25" in (cap["experts"]["routing"])
    )
    hist = tmp_path / "counts.json"
    hist.write_text("[4, 1, 1, 2, 0, 0, 0, 0]")
    from graphflop.cli import main

    argv = ["inspect", "hf:mixtral-8x7b", "--arg", "num_hidden_layers=1", "--seq", "64"]
    assert main([*argv, "--format", "json", "--no-jvp", "--routing", str(hist)]) == 0
    captured = capsys.readouterr()
    measured = json.loads(captured.out)
    assert fwd(measured) == fwd(base)
    # 128 rows split 4:1:1:2 (of 8 parts): 128·4/8 = 64, 16, 16, 32, then four idle experts
    ex = measured["experts"]
    assert ex["expert_tokens"] == [64.0, 16.0, 16.0, 32.0, 0.0, 0.0, 0.0, 0.0]
    assert (ex["tokens_per_expert_min"], ex["tokens_per_expert_max"]) == (0.0, 64.0)
    assert ex["tokens_per_expert"] == 16.0 and ex["uniform"] is False
    assert "0.0 to 64.0 tokens per expert (mean 16.0)" in captured.err
    assert base["experts"]["uniform"] is True and base["experts"]["expert_tokens"] == [16.0] * 8


def test_batched_mm_experts_differ_from_grouped_in_the_backward(capsys):
    """transformers' batched_mm experts gather each token-expert row's weights: the forward's
    matrix FLOPs are grouped_mm's, the backward's too, but the backward also scatter-adds the
    cotangents of the S = T·k = 128 gathered copies of gate/up (4096·28672) and down
    (14336·4096) into the stacked weights, S·3·4096·14336 = 22,548,578,304 FLOPs, and the
    copies are saved, 4 bytes each: 90,194,313,216 bytes. The two paths' elementwise routing
    work differs by well under 0.01% of that (128·4097 FLOPs at this size)."""
    pytest.importorskip("transformers")
    grouped = _mixtral_json(capsys)
    batched = _mixtral_json(capsys, "--arg", "experts_implementation=batched_mm")
    total = lambda d, phase, key="flops": d["totals"][phase][key]  # noqa: E731
    for phase in ("forward", "backward"):
        assert total(batched, phase, "mm_flops") == total(grouped, phase, "mm_flops")
    scatter = 128 * 3 * 4096 * 14336
    assert scatter == 22_548_578_304
    assert abs(total(batched, "forward") - total(grouped, "forward")) < 1e-4 * scatter
    extra = total(batched, "backward") - total(grouped, "backward")
    assert abs(extra - scatter) < 1e-4 * scatter
    saved = lambda d: d["memory"]["saved_for_backward_bytes"]  # noqa: E731
    assert abs(saved(batched) - saved(grouped) - 4 * scatter) < 1e-4 * 4 * scatter


def test_routing_that_does_not_fit_is_one_line(capsys, tmp_path):
    pytest.importorskip("transformers")
    from graphflop.cli import main

    hist = tmp_path / "counts.json"
    hist.write_text("[1, 2, 3]")
    cases = [
        (["hf:mixtral-8x7b", "--routing", "capacity:0"], "give capacity:F with F > 0"),
        (["hf:mixtral-8x7b", "--routing", "uniform"], "give balanced, capacity:F or a JSON"),
        (["hf:mixtral-8x7b", "--routing", str(hist)], "3 counts and the model routes among 8"),
        # a missing file is named as such, not as a malformed option
        (["hf:mixtral-8x7b", "--routing", str(tmp_path / "no.json")], "no.json: not found"),
        # at most T of the T·k rows reach one expert: ⌈F·T·k/E⌉ ≤ T bounds F by E/k = 8/2
        (["hf:mixtral-8x7b", "--routing", "capacity:1e9"], "F at most E/k = 8/2 = 4"),
        (["hf:gpt2-small", "--routing", "capacity:2"], "has none: drop it"),
    ]
    for argv, message in cases:
        code = main(["inspect", *argv, "--arg", "num_hidden_layers=1", "--seq", "8"])
        err = capsys.readouterr().err
        lines = [x for x in err.strip().splitlines() if not x.startswith("note:")]
        assert code == 2 and len(lines) == 1 and message in lines[0], (argv, err)


def test_arg_reaches_the_attention_and_experts_implementations():
    """The implementation choices a configuration takes as keywords and keeps privately
    (``attn_implementation``, ``experts_implementation``) are fields for --arg, on a preset as
    on a model type."""
    pytest.importorskip("transformers")
    for spec in ("hf:mixtral-8x7b", "hf:mixtral"):
        args = {"num_hidden_layers": 1, "attn_implementation": "eager"}
        args["experts_implementation"] = "batched_mm"
        cfg = load(spec, ctor_kwargs=args, meta=True, seq=8).model.config
        assert (cfg._attn_implementation, cfg._experts_implementation) == ("eager", "batched_mm")


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"tool_{name}", ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_docs_tools_keep_one_presets_section(tmp_path):
    """tools/presets.py writes its section into docs/zoo.md once, replacing the old one;
    tools/zoo.py, rewriting the zoo's table, keeps it."""
    presets_tool, zoo_tool = _tool("presets"), _tool("zoo")
    out = tmp_path / "zoo.md"
    out.write_text("# The zoo\n\ntable\n")
    presets_tool.write_section(out, presets_tool.markdown({}))
    presets_tool.write_section(
        out, presets_tool.markdown({"gpt2-small": {"status": "x", "seconds": 3}})
    )
    text = out.read_text()
    assert text.startswith("# The zoo\n\ntable\n")
    assert text.count(presets_tool.BEGIN) == 1 and text.count(presets_tool.END) == 1
    assert "| gpt2-small | | | | | | | | 3 | | x |" in text  # the second run's row
    kept = zoo_tool._with_kept_sections(out, "# The zoo\n\nnew table\n")
    assert kept.startswith("# The zoo\n\nnew table\n") and kept.count(presets_tool.BEGIN) == 1


def test_a_vocabulary_made_smaller_than_the_token_ids_names_them():
    """Whisper's configuration keeps its special token ids (pad 50256, decoder start 50257)
    when ``--arg vocab_size=100`` shrinks the vocabulary: the embedding's padding_idx then lies
    outside its table and the build fails. The error names each id not below vocab_size and
    the arguments to give; with them the model builds."""
    with pytest.raises(SpecError) as e:
        load("hf:whisper", ctor_kwargs={"vocab_size": 100}, meta=True, seq=16)
    msg = str(e.value)
    assert "pad_token_id 50256" in msg and "decoder_start_token_id 50257" in msg, msg
    assert "not below vocab_size 100" in msg and "--arg pad_token_id=0" in msg, msg
    ids = dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_id"), 0)
    small = {"vocab_size": 100, "decoder_start_token_id": 0, **ids}
    model = load("hf:whisper", ctor_kwargs=small, meta=True, seq=16).model
    assert model.get_input_embeddings().num_embeddings == 100
